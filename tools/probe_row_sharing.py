"""Probe: do the block slots that fast_rows' clusters of 16 leave empty (~15% on an H200, kernels/NOTES.md "Where
the clusters of 16 leave SMs idle") take work from a second stream? The rows of one call are shared between the
one-read cluster kernel (distill_forward on rows [0, n1)) and the split vocabulary's streamed phases (one block a
row, no cluster: distill_phase 0, distill_combine, distill_phase 1 (and 2 for the JSD) on rows [n1, n), world 1)
on a second stream, launched together. A streamed row reads its logits twice from device memory (~1.7 x a
cluster row's bytes) but needs no cluster: if the slots are free and the card's bandwidth has room (the cluster
kernel moves ~3 TB/s of the H200's ~4.5), the call ends sooner than the cluster kernel alone.

    python tools/probe_row_sharing.py [--reps 20] [--betas 0,0.5] [--fractions 1,0.95,0.9,0.85,0.8,0.7]

Prints, per beta and share of rows given to the cluster kernel, the call's median time (both orders of launch),
against the cluster kernel alone on every row and the phases alone on every row; and each shared call's loss and
gradient against the cluster kernel's (they are different kernels: agreement to float32 rounding, not bits).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kldiv_inline as K  # noqa: E402
from kldiv_inline import timing  # noqa: E402
from kldiv_inline.bench_distill import make_inputs  # noqa: E402

T = 2.0  # the suite's temperature
SUM = 1  # the module's reduction code for sum


def timed(fn, reps, warmup=3) -> tuple[float, float, float]:
    times = timing.time_cuda(lambda: fn(), [()], reps, warmup)
    return timing.quantiles(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--betas", default="0,0.5")
    ap.add_argument("--fractions", default="1,0.95,0.9,0.85,0.8,0.7")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)
    n, v = args.tokens, args.vocab
    s, t, lab, _, _ = make_inputs(n, v, "cuda", seed=0)  # the distillation suite's inputs
    mod = K.load("cuda", extension="distill")
    one = torch.ones((), dtype=torch.float64, device="cuda")
    grad = torch.empty_like(s)
    side = torch.cuda.Stream()

    def cluster_rows(r0, r1, beta):
        return mod.distill_forward(s[r0:r1], t[r0:r1], None, None, lab[r0:r1], -100, beta, T, SUM, True, False,
                                   grad[r0:r1], None)[0]

    def phase_rows(r0, r1, beta):
        common = (lab[r0:r1], -100, beta, T)
        xs, xt, out = s[r0:r1], t[r0:r1], grad[r0:r1]
        local = mod.distill_phase(0, xs, xt, *common, None, None, None, False, False, None)[0]
        norms = mod.distill_combine(local[None], 0, None)[0]
        terms = mod.distill_phase(1, xs, xt, *common, norms, None, one, True, False, out)[0]
        ksums, loss = mod.distill_combine(terms[None], SUM, one)
        if beta != 0.0:
            mod.distill_phase(2, xs, xt, *common, norms, ksums, one, True, False, out)
        return loss

    def shared(n1, beta, side_first):
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        parts = []

        def on_side():
            with torch.cuda.stream(side):
                parts.append(phase_rows(n1, n, beta))
        if side_first:
            on_side()
        parts.append(cluster_rows(0, n1, beta))
        if not side_first:
            on_side()
        cur.wait_stream(side)
        return parts[0] + parts[1]

    rows = []
    for beta in (float(b) for b in args.betas.split(",")):
        ref_loss = cluster_rows(0, n, beta).double()
        ref_grad = grad.float().clone()
        base = timed(lambda beta=beta: cluster_rows(0, n, beta), args.reps)
        rows.append((beta, "cluster kernel, every row", 1.0, base, None))
        ph = timed(lambda beta=beta: phase_rows(0, n, beta), args.reps)
        rows.append((beta, "streamed phases, every row", 0.0, ph, None))
        for f in (float(x) for x in args.fractions.split(",")):
            n1 = min(n, max(1, round(n * f)))
            if n1 >= n:
                continue
            for side_first in (False, True):
                grad.fill_(float("nan"))
                loss = shared(n1, beta, side_first).double()
                torch.cuda.synchronize()
                err_l = abs((loss - ref_loss) / ref_loss).item()
                err_g = ((grad.float() - ref_grad).norm() / ref_grad.norm()).item()
                q = timed(lambda n1=n1, beta=beta, side_first=side_first: shared(n1, beta, side_first), args.reps)
                order = "phases launched first" if side_first else "cluster launched first"
                rows.append((beta, f"shared, {order}", f, q, (err_l, err_g)))
            print(f"beta {beta} fraction {f} done", flush=True)
    print(f"{'beta':>4}  {'rows to the cluster kernel':<30} {'share':>5} {'median':>8} {'q20':>8} {'q80':>8} "
          f"{'/ alone':>7}  errors (loss, grad)")
    for beta, name, f, (med, q20, q80), errs in rows:
        base = next(r[3][0] for r in rows if r[0] == beta and r[2] == 1.0)
        e = "" if errs is None else f"{errs[0]:.1e} {errs[1]:.1e}"
        print(f"{beta:>4}  {name:<30} {f:>5.2f} {med:8.3f} {q20:8.3f} {q80:8.3f} {med / base:7.3f}  {e}")


if __name__ == "__main__":
    main()
