"""Times the distillation divergence with the vocabulary split across GPUs; run it under torchrun:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --standalone --nproc-per-node 2 tools/bench_vocab_parallel.py      # -> results/<card>-x2/
    torchrun --standalone --nproc-per-node 2 tools/bench_vocab_parallel.py --device cpu --tokens 32 --vocab 500

One global problem (default: bfloat16 logits, 4096 tokens x 128256, T = 2, 10% of tokens masked, forward and
backward, the student's gradient; forward KL and the JSD at beta 0.5), timed as
  kldiv_inline   world 1: generalized_jsd on one device (group=None), rank 0 alone while the others wait;
  kldiv_inline   world N: generalized_jsd(..., group=WORLD), each rank a contiguous 1/N of the vocabulary;
  megatron_style world N: kldiv_inline.peers.megatron_style_generalized_jsd, the same split.
Each provider is checked first (its loss against float64 PyTorch, its slice of the student's gradient against
the one-device op's) and a wrong one is not timed. Times follow kldiv_inline.timing (CUDA events around each
call after warm-up, the L2 flushed before each, ranks aligned by a barrier outside the timed region); a world-N
call's time is the slowest rank's. Rows as bench.csv's plus `world`, `beta` and `temperature`; `bytes` and
`gbps` are per GPU (both logits read, the gradient written once). Rank 0 writes the CSV and env.json and prints
a table last.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# NVLink multicast off in every process this launches (before NCCL starts).
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kldiv_inline as K  # noqa: E402
from kldiv_inline import envinfo, floors, timing  # noqa: E402
from kldiv_inline.bench import COLUMNS  # noqa: E402
from kldiv_inline.peers import megatron_style_generalized_jsd  # noqa: E402
from kldiv_inline.reference import generalized_jsd_reference, relative_error  # noqa: E402

EXTRA_COLUMNS = ["world", "beta", "temperature"]
LOSS_TOL = 1e-4  # the loss's relative error against float64 (the float32 peer's exp/log included)
GRAD_TOL = {torch.bfloat16: 8e-3, torch.float16: 1.5e-3, torch.float32: 2e-5, torch.float64: 1e-9}
REFERENCE_ROWS = 256  # rows per float64 chunk of the reference loss


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--masked", type=float, default=0.1, help="fraction of tokens whose label is ignore_index")
    ap.add_argument("--betas", default="0,0.5", help="comma list")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="CSV path (default results/<device>-x<world>/bench.csv)")
    return ap.parse_args(argv)


def slice_bounds(vocab: int, world: int) -> list[int]:
    """Contiguous slices in rank order, the first vocab % world ranks one entry wider."""
    widths = [vocab // world + (r < vocab % world) for r in range(world)]
    return [sum(widths[:r]) for r in range(world + 1)]


def reference_loss(s: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, beta: float, temperature: float) -> float:
    """The batchmean loss in float64, a chunk of rows at a time (the whole problem in float64 would not fit)."""
    total = 0.0
    for lo in range(0, s.shape[0], REFERENCE_ROWS):
        sl = slice(lo, lo + REFERENCE_ROWS)
        total += float(generalized_jsd_reference(s[sl], t[sl], beta=beta, temperature=temperature, labels=labels[sl],
                                                 reduction="sum"))
    return total / max(int((labels != -100).sum()), 1)


class Problem:
    """The full inputs (the same on every rank: one seed) and this rank's slices."""

    def __init__(self, args, device: str, rank: int, world: int):
        gen = torch.Generator(device=device).manual_seed(1234)
        dtype = getattr(torch, args.dtype)
        shape = (args.tokens, args.vocab)
        self.s = (torch.randn(shape, generator=gen, device=device) * 2.0).to(dtype)
        self.t = (torch.randn(shape, generator=gen, device=device) * 2.0).to(dtype)
        labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen, device=device)
        masked = torch.rand(args.tokens, generator=gen, device=device) < args.masked
        self.labels = labels.masked_fill(masked, -100)
        b = slice_bounds(args.vocab, world)
        self.lo, self.hi = b[rank], b[rank + 1]
        self.s_part = self.s[:, self.lo:self.hi].contiguous()
        self.t_part = self.t[:, self.lo:self.hi].contiguous()


def step(loss_fn):
    """A training step: the loss and the student's gradient (its logits are a fresh leaf per call)."""
    def run(s, t, labels):
        loss = loss_fn(s, t, labels)
        loss.backward()
        return loss.detach(), s.grad
    return run


def providers(beta: float, temperature: float, group, world: int):
    """(impl, world, step function, whether every rank runs it)."""
    ours = dict(beta=beta, temperature=temperature)
    out = [("kldiv_inline", 1, step(lambda s, t, y: K.generalized_jsd(s, t, labels=y, **ours)), False)]
    if world > 1:
        out.append(("kldiv_inline", world,
                    step(lambda s, t, y: K.generalized_jsd(s, t, labels=y, group=group, **ours)), True))
    out.append(("megatron_style", world, step(lambda s, t, y: megatron_style_generalized_jsd(
        s, t, y, beta=beta, temperature=temperature, group=group)), True))
    return out


def time_it(fn, inputs, args, device: str, aligned: bool) -> list[float]:
    """Per-call milliseconds of this rank (CUDA events, or a wall clock on the CPU)."""
    def prepare(s, t, labels):
        if aligned:
            dist.barrier()
        return s.detach().requires_grad_(), t, labels

    if device == "cuda":
        return timing.time_cuda(fn, [inputs], args.reps, args.warmup, flush=timing.L2Flush(device), prepare=prepare)
    return timing.time_wall(fn, [inputs], args.reps, args.warmup, device, prepare=prepare)


def slowest(times: list[float], device: str) -> list[float]:
    """Each call's time on the slowest rank."""
    x = torch.tensor(times, dtype=torch.float64, device=device)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.stack(parts).amax(dim=0).tolist()


def run_beta(args, prob: Problem, beta: float, device: str, rank: int, world: int) -> list[dict]:
    group = dist.group.WORLD
    dtype = prob.s.dtype
    ref = reference_loss(prob.s, prob.t, prob.labels, beta, args.temperature)
    # The one-device op's gradient: every rank computes it (once) to check its slice of the split ones.
    _, g1 = step(lambda s, t, y: K.generalized_jsd(s, t, labels=y, beta=beta, temperature=args.temperature))(
        prob.s.detach().requires_grad_(), prob.t, prob.labels)
    g1 = g1[:, prob.lo:prob.hi].clone()
    rows = []
    for impl, w, fn, everyone in providers(beta, args.temperature, group, world):
        inputs = (prob.s_part, prob.t_part, prob.labels) if everyone else (prob.s, prob.t, prob.labels)
        loss, grad = fn(inputs[0].detach().requires_grad_(), inputs[1], inputs[2])
        errs = torch.tensor([abs(float(loss) - ref) / abs(ref),
                             relative_error(grad if everyone else grad[:, prob.lo:prob.hi], g1)], device=device)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)  # the worst rank's: every rank decides alike
        rel_err, grad_err = errs.tolist()
        ok = rel_err <= LOSS_TOL and grad_err <= GRAD_TOL[dtype]
        status = "ok" if ok else f"wrong: loss rel err {rel_err:.2e}, grad rel err {grad_err:.2e}"
        times = []
        if ok and (everyone or rank == 0):
            times = time_it(fn, inputs, args, device, aligned=everyone)
        if everyone and ok:
            times = slowest(times, device)
        dist.barrier()  # the others wait while rank 0 times the one-device op
        per_gpu_bytes = 3 * args.tokens * (args.vocab // w) * prob.s.element_size()
        row = {"device": device, "impl": impl, "pass": "fwd+bwd", "form": "logits",
               "dtype": args.dtype, "batch": args.tokens, "features": args.vocab, "rel_err": rel_err,
               "status": status, "timer": "cuda" if device == "cuda" else "wall", "bytes": per_gpu_bytes,
               "world": w, "beta": beta, "temperature": args.temperature}
        if times:
            med, q20, q80 = timing.quantiles(times)
            peak = floors.device_peak_gbps(device)
            gbps = per_gpu_bytes / med / 1e6
            row.update(median_ms=med, q20_ms=q20, q80_ms=q80, gbps=gbps,
                       pct_of_peak=100 * gbps / peak if peak else None)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows, each time also as a ratio to the one-device op's and the Megatron-style peer's of its beta."""
    df = pd.DataFrame(rows)
    lines = [f"{'impl':<16}{'world':>6}{'beta':>6}{'median ms':>11}{'q20':>9}{'q80':>9}{'GB/s/GPU':>10}"
             f"{'/ world 1':>11}{'peer / this':>13}  status"]
    for r in rows:
        same = df[df.beta == r["beta"]]
        base = same[(same.impl == "kldiv_inline") & (same.world == 1)].median_ms
        peer = same[same.impl == "megatron_style"].median_ms
        med = r.get("median_ms")

        def ratio(num, den):
            return f"{num / den:.3f}" if pd.notna(num) and pd.notna(den) and den else "-"

        lines.append(f"{r['impl']:<16}{r['world']:>6}{r['beta']:>6}"
                     + "".join(f"{r[k]:>{w}.4f}" if pd.notna(r.get(k)) else f"{'-':>{w}}"
                               for k, w in (("median_ms", 11), ("q20_ms", 9), ("q80_ms", 9)))
                     + (f"{r['gbps']:>10.0f}" if pd.notna(r.get("gbps")) else f"{'-':>10}")
                     + f"{ratio(med, base.iloc[0] if len(base) else None):>11}"
                     + f"{ratio(peer.iloc[0] if len(peer) else None, med):>13}  {r['status'][:50]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        prob = Problem(args, device, rank, world)
        rows = []
        for beta in (float(b) for b in args.betas.split(",")):
            rows += run_beta(args, prob, beta, device, rank, world)
        if rank == 0:
            out = Path(args.out) if args.out else (Path(envinfo.REPO_ROOT) / "results"
                                                   / f"{envinfo.device_slug(device)}-x{world}" / "bench.csv")
            out.parent.mkdir(parents=True, exist_ok=True)
            pd.DataFrame(rows).reindex(columns=COLUMNS + EXTRA_COLUMNS).to_csv(out, index=False)
            envinfo.write_env(out.parent, device, {
                "world": world, "command": f"torchrun --nproc-per-node {world} tools/bench_vocab_parallel.py "
                + " ".join(sys.argv[1:])})
            print(f"-> {out}")
            print(table(rows))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
