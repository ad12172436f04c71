"""Times the distillation divergence with the vocabulary split across GPUs; run it under torchrun:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --standalone --nproc-per-node 2 tools/bench_vocab_parallel.py   # -> results/<card>-x2/bench.csv
    torchrun --standalone --nproc-per-node 2 tools/bench_vocab_parallel.py --device cpu --tokens 32 --vocab 500 \\
        --hidden 16 --out /tmp/bench.csv                                              # a smoke test on the CPU

One global problem (default: bfloat16, 4096 tokens x a 128256 vocabulary, T = 2, 10% of tokens masked, forward
and backward; forward KL and the JSD at beta 0.5), in two forms:
  logits:       generalized_jsd of given logits, the student's gradient;
  fused_linear: fused_linear_generalized_jsd of hidden states [tokens, hidden] and LM-head weights [vocab, hidden]
                (student and teacher alike), the gradients of the student's hidden states and weight;
each timed as
  kldiv_inline   world 1: the kit's op on one device (group=None), on rank 0 while the others wait;
  kldiv_inline   world N: the kit's op with group=WORLD, each rank a contiguous 1/N of the vocabulary (of the
                 logits, or of the weights' rows);
  megatron_style world N: kldiv_inline.peers' Megatron-style PyTorch peer of the form, the same split;
  with --graph (GPUs, logits form), kldiv_inline_graph world 1 and N: the same training steps captured in a CUDA
                 graph and replayed (no host work in the step: what a training loop that captures its step gets).
Each provider is checked first and a wrong one is not timed: its loss against float64 PyTorch (logits) or the
one-device op's (fused_linear, whose logits are rounded to bfloat16 by the matrix product), its gradients (this
rank's slice) against the one-device op's. Times follow kldiv_inline.timing: CUDA events around each call after
warm-up, the L2 flushed before each, the ranks aligned outside the timed region (--align); a world-N call's
time is its slowest rank's. Rows as bench.csv's plus `world`, `beta`, `temperature`, `hidden`; for the logits
form `bytes` and `gbps` are per GPU (both logits read, the gradient written once). Rank 0 writes the CSV and
env.json (`align`: how the ranks were aligned) after each row, as `python -m kldiv_inline bench` does (env.json says
`partial` until the run ends), and prints a table last: each time over the one-device op's (`/ world 1`) and the
peer's over it. A run of some forms (or betas, or without --graph) into a folder holding rows of others is
refused (they would be lost).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

# NVLink multicast off in every process this launches (before NCCL starts).
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kldiv_inline as K  # noqa: E402
from kldiv_inline import envinfo, floors, timing  # noqa: E402
from kldiv_inline.bench import COLUMNS, PARTIAL_NOTE, drop_derived, refuse_dropping  # noqa: E402
from kldiv_inline.peers import megatron_style_fused_linear_generalized_jsd, megatron_style_generalized_jsd  # noqa: E402
from kldiv_inline.reference import generalized_jsd_reference, relative_error  # noqa: E402

envinfo.count_as_code(__file__)  # this script writes the results: an edited copy makes them +dirty

# bench.csv's columns, then this run's own (each once: bench.COLUMNS already has beta and hidden)
EXTRA_COLUMNS = [c for c in ("world", "beta", "temperature", "hidden") if c not in COLUMNS]
FORMS = ("logits", "fused_linear")
# The loss's relative error: against float64 (logits: the float32 peer's exp and log), against the one-device
# op (fused_linear: the same bf16 logits up to the matrix products' order of summation).
LOSS_TOL = {"logits": 1e-4, "fused_linear": 2e-3}
GRAD_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5, torch.float64: 1e-9}
REFERENCE_ROWS = 256  # rows per float64 chunk of the reference loss
HEAD_START_CYCLES = 2_000_000  # GPU clock cycles (~1 ms at an H100's or H200's ~1.8-2 GHz) before each aligned call


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma list of {FORMS}")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size of the fused_linear form")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--masked", type=float, default=0.1, help="fraction of tokens whose label is ignore_index")
    ap.add_argument("--betas", default="0,0.5", help="comma list")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--results", default=str(envinfo.REPO_ROOT / "results"),
                    help="the results folder: the CSV goes to <results>/<device>-x<world>/bench.csv")
    ap.add_argument("--out", default=None, help="the CSV's path instead (env.json beside it)")
    ap.add_argument("--align", choices=["stream", "host"], default="stream",
                    help="how a world-N call's ranks start together: stream (default), a one-float all-reduce "
                         "and a ~1 ms GPU sleep queued before each call (outside the timed region), so the GPUs "
                         "wait for each other while each host queues the call ahead, as the world-1 rows' host "
                         "does; host, a barrier that blocks the hosts, so each GPU idles while its host queues the "
                         "call's first kernels (that latency in the time: +0.11 ms for forward KL on two H200s)")
    ap.add_argument("--graph", action="store_true",
                    help="also time the logits form's steps captured in a CUDA graph (kldiv_inline_graph; GPUs only)")
    args = ap.parse_args(argv)
    args.forms = args.forms.split(",")
    if not set(args.forms) <= set(FORMS):
        ap.error(f"--forms: choose from {FORMS}")
    return args


def slice_bounds(vocab: int, world: int) -> list[int]:
    """Contiguous slices in rank order, the first vocab % world ranks one entry wider."""
    widths = [vocab // world + (r < vocab % world) for r in range(world)]
    return [sum(widths[:r]) for r in range(world + 1)]


class Problem:
    """One form's inputs, the whole ones (the same on every rank: one seed) and this rank's slices, and which
    of them are leaves that take a gradient (`grads`) and which of those are split (`split`)."""

    def __init__(self, form: str, args, device: str, rank: int, world: int):
        gen = torch.Generator(device=device).manual_seed(1234)
        dtype = getattr(torch, args.dtype)
        n, v, hdim = args.tokens, args.vocab, args.hidden

        def randn(*shape, scale):
            return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)

        labels = torch.randint(0, v, (n,), generator=gen, device=device)
        self.labels = labels.masked_fill(torch.rand(n, generator=gen, device=device) < args.masked, -100)
        b = slice_bounds(v, world)
        self.lo, self.hi = b[rank], b[rank + 1]
        part = slice(self.lo, self.hi)
        self.form = form
        if form == "logits":
            s, t = randn(n, v, scale=2.0), randn(n, v, scale=2.0)
            self.whole = (s, t)
            self.parts = (s[:, part].contiguous(), t[:, part].contiguous())
            self.grads, self.split = (0,), (0,)
        else:  # logits of spread ~2, as above: weights of norm ~2 per row against unit hidden states
            h, th = randn(n, hdim, scale=1.0), randn(n, hdim, scale=1.0)
            w, tw = randn(v, hdim, scale=2.0 / hdim ** 0.5), randn(v, hdim, scale=2.0 / hdim ** 0.5)
            self.whole = (h, w, th, tw)
            self.parts = (h, w[part].contiguous(), th, tw[part].contiguous())
            self.grads, self.split = (0, 1), (1,)

    def prepare(self, *inputs):
        """Fresh leaves (outside the timed region) for the inputs that take a gradient."""
        return tuple(x.detach().requires_grad_() if i in self.grads else x for i, x in enumerate(inputs))


def providers(prob: Problem, beta: float, temperature: float, group, world: int):
    """(impl, world, fn(*inputs) -> loss, whether every rank runs it on its slices)."""
    kw = dict(beta=beta, temperature=temperature, labels=prob.labels)
    if prob.form == "logits":
        def ours(g):
            return lambda s, t: K.generalized_jsd(s, t, group=g, **kw)

        def peer(s, t):
            return megatron_style_generalized_jsd(s, t, prob.labels, beta=beta, temperature=temperature, group=group)
    else:
        def ours(g):
            return lambda h, w, th, tw: K.fused_linear_generalized_jsd(h, w, th, tw, group=g, **kw)

        def peer(h, w, th, tw):
            return megatron_style_fused_linear_generalized_jsd(h, w, th, tw, prob.labels, beta=beta,
                                                               temperature=temperature, group=group)
    out = [("kldiv_inline", 1, ours(None), False)]
    if world > 1:
        out.append(("kldiv_inline", world, ours(group), True))
    out.append(("megatron_style", world, peer, True))
    return out


def captured(step, prob: Problem, inputs):
    """``step`` (a training step) captured in a CUDA graph on fresh static leaves of ``inputs``
    (kldiv_inline.timing.capture, as the two-GPU test captures it), run by replaying it: it ignores the inputs it
    is given (the static ones hold the same values) and returns the graph's outputs."""
    graph, out = timing.capture(step, *prob.prepare(*inputs))

    def replay(*_):
        graph.replay()
        return out
    replay.graph = graph  # (the graph lives as long as its runner)
    return replay


def training_step(fn, prob: Problem):
    """The loss and the gradients of the inputs that take one."""
    def run(*inputs):
        loss = fn(*inputs)
        return (loss.detach(), *torch.autograd.grad(loss, [inputs[i] for i in prob.grads]))
    return run


def reference_loss(prob: Problem, beta: float, temperature: float) -> float:
    """The logits form's batchmean loss in float64, a chunk of rows at a time (the whole problem in float64 would
    not fit)."""
    s, t = prob.whole
    total = 0.0
    for lo in range(0, s.shape[0], REFERENCE_ROWS):
        sl = slice(lo, lo + REFERENCE_ROWS)
        total += float(generalized_jsd_reference(s[sl], t[sl], beta=beta, temperature=temperature,
                                                 labels=prob.labels[sl], reduction="sum"))
    return total / max(int((prob.labels != -100).sum()), 1)


def time_it(fn, prob: Problem, inputs, args, device: str, aligned: bool) -> list[float]:
    """Per-call milliseconds of this rank (CUDA events, or a wall clock on the CPU). aligned: every rank runs the
    call, each call's start aligned across the ranks outside the timed region (--align)."""
    token = torch.zeros(1, device=device) if aligned and device == "cuda" and args.align == "stream" else None

    def prepare(*x):
        if token is not None:
            dist.all_reduce(token)  # the GPUs wait for each other; the hosts queue on (NCCL's stream order)
            # A head start for the host: the split step's host path (~0.5 ms a call on an H200 host) is close to
            # forward KL's device time (~0.58 ms), so without it the host catches up only after several calls and
            # the early calls' times carry its queueing, which the one-device rows' (host far ahead) never do.
            torch.cuda._sleep(HEAD_START_CYCLES)
        elif aligned:
            dist.barrier()
        return prob.prepare(*x)

    if device == "cuda":
        return timing.time_cuda(fn, [inputs], args.reps, args.warmup, flush=timing.L2Flush(device), prepare=prepare)
    return timing.time_wall(fn, [inputs], args.reps, args.warmup, device, prepare=prepare)


def slowest(times: list[float], device: str) -> list[float]:
    """Each call's time on the slowest rank."""
    x = torch.tensor(times, dtype=torch.float64, device=device)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.stack(parts).amax(dim=0).tolist()


def _part(prob: Problem, grads: tuple, split_by_me: bool) -> list[torch.Tensor]:
    """This rank's slice of each gradient (those of split inputs are already slices when the rank ran split)."""
    return [g if split_by_me or i not in prob.split else (g[:, prob.lo:prob.hi] if prob.form == "logits"
                                                          else g[prob.lo:prob.hi])
            for i, g in zip(prob.grads, grads)]


def run_beta(args, prob: Problem, beta: float, device: str, rank: int, world: int, progress) -> list[dict]:
    group = dist.group.WORLD
    provs = [(*p, False) for p in providers(prob, beta, args.temperature, group, world)]
    if args.graph and device == "cuda" and prob.form == "logits":
        provs += [("kldiv_inline_graph", w, fn, everyone, True) for impl, w, fn, everyone, _ in provs
                  if impl == "kldiv_inline"]
    # The one-device op's loss and gradients: every rank computes them (once) to check its slices of the others.
    one = training_step(provs[0][2], prob)(*prob.prepare(*prob.whole))
    ref = reference_loss(prob, beta, args.temperature) if prob.form == "logits" else float(one[0])
    ref_grads = _part(prob, one[1:], False)
    rows = []
    for impl, w, fn, everyone, graph in provs:
        inputs = prob.parts if everyone else prob.whole
        step = training_step(fn, prob)
        if graph:
            step = captured(step, prob, inputs)
        got = step(*prob.prepare(*inputs))
        grad_err = max(relative_error(g, r) for g, r in zip(_part(prob, got[1:], everyone), ref_grads))
        errs = torch.tensor([abs(float(got[0]) - ref) / abs(ref), grad_err], device=device)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)  # the worst rank's: every rank decides alike
        rel_err, grad_err = errs.tolist()
        ok = rel_err <= LOSS_TOL[prob.form] and grad_err <= GRAD_TOL[prob.whole[0].dtype]
        status = "ok" if ok else f"wrong: loss rel err {rel_err:.2e}, grad rel err {grad_err:.2e}"
        times = []
        if ok and (everyone or rank == 0):
            times = time_it(step, prob, inputs, args, device, aligned=everyone)
        if everyone and ok:
            times = slowest(times, device)
        dist.barrier()  # the others wait while rank 0 times the one-device op
        row = {"device": device, "impl": impl, "pass": "fwd+bwd", "form": prob.form, "dtype": args.dtype,
               "batch": args.tokens, "features": args.vocab, "rel_err": rel_err, "status": status,
               "timer": "cuda" if device == "cuda" else "wall", "world": w, "beta": beta,
               "temperature": args.temperature, "hidden": args.hidden if prob.form == "fused_linear" else None}
        if times:
            med, q20, q80 = timing.quantiles(times)
            row.update(median_ms=med, q20_ms=q20, q80_ms=q80)
            if prob.form == "logits":
                per_gpu_bytes = 3 * args.tokens * (args.vocab // w) * prob.whole[0].element_size()
                peak = floors.device_peak_gbps(device)
                gbps = per_gpu_bytes / med / 1e6
                row.update(bytes=per_gpu_bytes, gbps=gbps, pct_of_peak=100 * gbps / peak if peak else None)
        rows.append(row)
        progress(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows, each time also over the one-device op's (a captured step's over the captured one-device step's)
    and the peer's over it (same form and beta)."""
    df = pd.DataFrame(rows)

    def num(v, fmt, width):
        return f"{v:>{width}{fmt}}" if pd.notna(v) else f"{'-':>{width}}"

    lines = [f"{'form':<13}{'impl':<19}{'world':>6}{'beta':>6}{'median ms':>11}{'q20':>9}{'q80':>9}{'/ world 1':>11}"
             f"{'peer / this':>13}  status"]
    for r in rows:
        same = df[(df.form == r["form"]) & (df.beta == r["beta"])]
        base = same[(same.impl == r["impl"]) & (same.world == 1)].median_ms  # a graph's over the graph's
        if not len(base):
            base = same[(same.impl == "kldiv_inline") & (same.world == 1)].median_ms
        peer = same[same.impl == "megatron_style"].median_ms
        med = r.get("median_ms")
        over_base = med / base.iloc[0] if len(base) and pd.notna(med) else None
        peer_over = peer.iloc[0] / med if len(peer) and pd.notna(med) else None
        lines.append(f"{r['form']:<13}{r['impl']:<19}{r['world']:>6}{r['beta']:>6}" + num(med, ".3f", 11)
                     + num(r.get("q20_ms"), ".3f", 9) + num(r.get("q80_ms"), ".3f", 9) + num(over_base, ".3f", 11)
                     + num(peer_over, ".2f", 13) + f"  {r['status'][:50]}")
    return "\n".join(lines)


def refuse_dropping_cases(out: Path, args) -> None:
    """Refuses a run that would replace ``out``'s rows of betas it does not time, or its captured steps
    (kldiv_inline_graph) without --graph: they would be lost (refuse_dropping says it of forms)."""
    if not out.exists():
        return
    held = envinfo.read_csv(out, usecols=["form", "beta", "impl"])
    held = held[held["form"].isin(args.forms)]
    betas = {float(b) for b in args.betas.split(",")}
    lost = sorted({float(b) for b in held["beta"].dropna()} - betas)
    if lost:
        raise SystemExit(f"{out} holds rows of beta {', '.join(f'{b:g}' for b in lost)}, which --betas {args.betas} "
                         "would drop: give this run another folder (--out or --results), or time those betas too")
    if not args.graph and (held["impl"] == "kldiv_inline_graph").any():
        raise SystemExit(f"{out} holds steps captured in a CUDA graph (kldiv_inline_graph), which a run without "
                         "--graph would drop: give this run another folder (--out or --results), or pass --graph")


def main(argv=None) -> int:
    args = parse(argv)
    device = args.device
    if device == "cuda":
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(gpu)
        dist.init_process_group("nccl", device_id=gpu)
    else:
        dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        rows = []
        out = Path(args.out) if args.out else (Path(args.results) / f"{envinfo.device_slug(device)}-x{world}"
                                               / "bench.csv")
        # (every rank reads the same file and decides alike, before any collective)
        refuse_dropping(out, args.forms, "form", "--forms", "--out or --results")
        refuse_dropping_cases(out, args)
        extra = {"world": world, "align": args.align if device == "cuda" else "host",
                 "command": f"torchrun --nproc-per-node {world} tools/bench_vocab_parallel.py "
                 + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))}  # (main's own arguments)
        start, done = time.monotonic(), []

        def save(finished: bool) -> None:
            """The CSV of the rows so far and env.json, as bench's main saves them: env.json says partial, with this
            run's record, before the CSV is replaced (whole), and the previous run's rows and figures go at the first
            row, so a run cut short (Ctrl-C, a time limit) leaves its rows under its own record, marked partial,
            never under the previous run's."""
            if len(done) == 1 and not finished:
                out.unlink(missing_ok=True)
                drop_derived(out.parent)
            envinfo.write_env(out.parent, device, {**extra, "partial": PARTIAL_NOTE})
            envinfo.write_atomic(out, pd.DataFrame(done).reindex(columns=COLUMNS + EXTRA_COLUMNS).to_csv(index=False))
            if finished:
                envinfo.write_env(out.parent, device, extra, drop=("partial",))

        def progress(row):
            """Rank 0: a line a row as it is done, and the files so far (a run cut short keeps what it measured)."""
            if rank != 0:
                return
            print(f"[{time.monotonic() - start:6.0f} s] {row['form']} beta={row['beta']} {row['impl']} world "
                  f"{row['world']}: {row.get('median_ms', float('nan')):.4f} ms, {row['status'][:60]}", flush=True)
            done.append(row)
            save(finished=False)

        for form in args.forms:
            prob = Problem(form, args, device, rank, world)
            for beta in (float(b) for b in args.betas.split(",")):
                rows += run_beta(args, prob, beta, device, rank, world, progress)
            del prob
        if rank == 0:
            save(finished=True)
            print(f"-> {out}")
            print(table(rows))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Done and the group destroyed: leave without the interpreter's finalisation, where gloo's leftover worker
    # threads can abort a process that did everything right ("terminate called without an active exception", seen
    # now and then on CPU ranks), which torchrun would report as this rank's failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
