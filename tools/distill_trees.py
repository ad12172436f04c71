"""Times the distillation kernels of several kernels/ trees against each other on one GPU, in one call: the loop
for a change to kernels/distill*.cu* (is the new tree faster than the old, on this card, in this run?).

    git archive HEAD~1 kernels | tar -x -C /tmp/old
    python tools/distill_trees.py /tmp/old/kernels kernels [--rounds 2] [--reps 20] [--spreads 3 2]

Each tree is built first, all at once (one process each, through KLDIV_INLINE_KERNELS; ~90 s on a 16-core
machine, cached under KLDIV_INLINE_CACHE), then timed in a process of its own, the trees alternating for
``--rounds`` rounds so that a drift of the card's clock shows as a spread, not as a difference. Each process
times the extension's distill_forward on bf16 logits 4096 x 128256 (standard normal times each of ``--spreads``,
3 unless named; the bench suite's are 2: a kernel whose work depends on the data, as the direct sums' second sums
do, can gain at one spread and lose at another), T = 2, 10% of rows masked, batchmean: forward
KL, the JSD (beta 0.5) and reverse KL, each without a gradient (the forward alone) and with the student's (the
training step's kernels, with no autograd around them), the top-k teacher's step (k = 100) and the kernel that
checks and normalises that teacher first in an eager step (distill_topk_prepare); the median of
``--reps`` CUDA-event timings after 3 warm-up calls. Prints one row per case with each tree's medians, in ms, and
the last tree's change against the first. ``--near SD``: the student is the teacher plus SD times standard normal
noise (rows that nearly agree, a KL of ~SD^2 / (2 T^2) a token: below the one-pass forward alone's trust line for
SD <~ 0.7, so its rows take the second sum; kernels/distill_stream_forward.cuh). ``--vocab V``: rows of V entries
in place of 128256 (an odd V, GPT-2's 50257, makes the rows start off the 16-byte grid: the kernels' SHIFT
instances; kernels/NOTES.md, version 52). ``--dtype``: float16 or float32 logits in place of bfloat16.
``--steps``: each process also times the suite's own training steps (forward KL, the JSD and the top-k teacher:
kldiv_inline.bench_distill's providers and inputs through harness.bench, as `bench --suites distill` times them,
with autograd and the eager front end around the kernels): a kernel's gain alone need not show in the step (an
L2 evict-first policy on forward KL's copies timed -0.5% alone and +0.2-0.9% the suite's way; kernels/NOTES.md,
version 49). Checks nothing: run the GPU tests for that (`pytest -m gpu tests/test_distill.py`), and
tools/trees_agree.py for whether two trees give the same bits.
"""
import argparse
import math
import statistics
import sys
from pathlib import Path

from tree_timing import build, print_table, time_rounds

CASES = [(beta, grad) for beta in (0.0, 0.5, 1.0) for grad in (False, True)]


def suite_steps(reps: int) -> None:
    """The distillation suite's training steps of the kit (the tree KLDIV_INLINE_KERNELS names), timed as the
    suite times them: prints `case ms` lines."""
    from kldiv_inline import bench_distill as B
    from kldiv_inline import harness

    s, t, y, idx, lp = B.make_inputs(4096, 128256, "cuda", seed=1)
    steps = [(f"suite step beta={beta:g}", B.logits_providers(beta, "fwd+bwd", "cuda")[B.OURS], (s, t, y))
             for beta in (0.0, 0.5)]
    steps.append(("suite top-k step", B.topk_providers(0.0)[B.OURS], (s, idx, lp, y)))
    for name, fn, args in steps:
        timed = harness.bench({B.OURS: fn}, [harness.Case(name, args, {})], reference=None, setup=B._fresh_student,
                              reps=reps, warmup=3)
        print(f"{name} {float(timed['median_ms'].iloc[0]):.4f}")


def child(reps: int, spreads: list[float], near: float | None, vocab: int, dtype_name: str = "bfloat16") -> None:
    """Times one tree (the one KLDIV_INLINE_KERNELS names): prints `case ms` lines, the cases of each spread."""
    import torch

    import kldiv_inline as K
    from kldiv_inline import timing
    from kldiv_inline.distill import TOPK_MASS_SLACK

    mod = K.load("cuda", extension="distill")
    dtype = getattr(torch, dtype_name)

    def median_ms(fn) -> float:
        return statistics.median(timing.time_cuda(fn, [()], reps, 3))

    def time_spread(spread: float, tag: str) -> None:  # (its tensors freed on return)
        torch.manual_seed(1)
        n, v = 4096, vocab
        s = (torch.randn(n, v, device="cuda") * spread).to(dtype) if near is None else None
        t = (torch.randn(n, v, device="cuda") * spread).to(dtype)
        if near is not None:  # (drawn after t: the default cases keep their inputs)
            s = (t.float() + near * torch.randn(n, v, device="cuda")).to(dtype)
        lab = torch.randint(0, 1000, (n,), device="cuda").masked_fill(torch.rand(n, device="cuda") < 0.1, -100)
        lp, idx = torch.log_softmax(t.float() / 2.0, dim=-1).topk(100, dim=-1)
        for beta, grad in CASES:
            ms = median_ms(lambda b=beta, g=grad: mod.distill_forward(s, t, None, None, lab, -100, b, 2.0, 2, g, False))
            print(f"beta={beta} {'step' if grad else 'forward'}{tag} {ms:.4f}")
        # (the teacher's rows as this tree's distill_forward takes them: its own distill_topk_prepare's)
        rows = mod.distill_topk_prepare(idx, lp, v, None, -100, math.log1p(TOPK_MASS_SLACK))[0]
        ms = median_ms(lambda: mod.distill_forward(s, None, idx, rows, lab, -100, 0.0, 2.0, 2, True, False))
        print(f"top-k step{tag} {ms:.4f}")
        # The eager top-k step's other kernel: the teacher's checks and normalisation (distill_topk_prepare).
        ms = median_ms(lambda: mod.distill_topk_prepare(idx, lp, v, lab, -100, math.log1p(TOPK_MASS_SLACK)))
        print(f"top-k prepare{tag} {ms:.4f}")

    for spread in spreads:
        time_spread(spread, f" x{spread:g}" if len(spreads) > 1 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", type=Path, help="kernels/ directories (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--spreads", type=float, nargs="+", default=[3.0],
                    help="the logits' standard deviations to time (each a set of cases; the suite's is 2)")
    ap.add_argument("--near", type=float, default=None,
                    help="the student as the teacher plus this much noise (rows that nearly agree)")
    ap.add_argument("--vocab", type=int, default=128256, help="the rows' length (odd: rows off the 16-byte grid)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the logits' dtype (the suite's steps, --steps, stay bfloat16)")
    ap.add_argument("--steps", action="store_true",
                    help="also the suite's training steps, timed the suite's way (autograd and the front end)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.reps, args.spreads, args.near, args.vocab, args.dtype)
        if args.steps:
            suite_steps(args.reps)
        return
    if len(args.trees) < 1:
        ap.error("name at least one kernels/ directory")
    for tree in args.trees:
        if not (tree / "distill.cu").exists():
            ap.error(f"{tree}: no distill.cu there")
    build(args.trees, "import kldiv_inline as K; K.load('cuda', extension='distill')")
    cmd = [sys.executable, __file__, "--child", "--reps", str(args.reps), "--spreads",
           *(str(x) for x in args.spreads), *(["--near", str(args.near)] if args.near is not None else []),
           "--vocab", str(args.vocab), "--dtype", args.dtype,
           *(["--steps"] if args.steps else [])]
    print_table(args.trees, time_rounds(args.trees, cmd, args.rounds), 22)

if __name__ == "__main__":
    main()
