"""Times the KL op's kernels of several kernels/ trees against each other on one GPU, in one call (as
tools/distill_trees.py does for the distillation kernels): the probability form's forward and training step at
16384 x 16384 float32 (P1, P3) and the bf16 log-probability forward at 4096 x 128256 (P2), the bench's inputs.

    git archive HEAD~1 kernels | tar -x -C /tmp/old
    python tools/kl_trees.py /tmp/old/kernels kernels [--rounds 2] [--reps 20]

Each tree is built first, all at once, then timed in a process of its own, the trees alternating for ``--rounds``
rounds (tools/tree_timing.py, as distill_trees.py). Prints each case's times (ms) per tree, and after each case a
row of its read floor as each process measured it (bytes / the bandwidth of a sum over 1 GiB). Checks nothing: run
`pytest -m gpu tests/test_ops.py tests/test_ops_reliability.py` for that.
"""
import argparse
import statistics
import sys
from pathlib import Path

from tree_timing import build, print_table, time_rounds


def child(reps: int) -> None:
    import torch

    from kldiv_inline import timing
    from kldiv_inline.bench import Case, make_inputs
    from kldiv_inline.ops import kl_div, kl_div_from_probs

    cases = [("P1 fwd probs float32", Case("probs", torch.float32, 16384, 16384, ("fwd",), "cuda"), False),
             ("P3 fwd+bwd probs float32", Case("probs", torch.float32, 16384, 16384, ("fwd+bwd",), "cuda"), True),
             ("P2 fwd logprobs bfloat16", Case("logprobs", torch.bfloat16, 4096, 128256, ("fwd",), "cuda"), False)]
    x = torch.rand(1 << 28, device="cuda")
    read_gbps = (1 << 30) / statistics.median(timing.time_cuda(x.sum, [()], 20, 3)) / 1e6
    del x
    for name, case, train in cases:
        p, t = make_inputs(case, "cuda")
        if case.form == "probs":
            def fwd(p=p, t=t):
                return kl_div_from_probs(p, t, reduction="batchmean")
        else:
            def fwd(p=p, t=t):
                return kl_div(p, t, reduction="batchmean")
        fn = fwd
        if train:
            leaf = p.detach().requires_grad_()

            def fn(leaf=leaf, t=t):
                leaf.grad = None
                kl_div_from_probs(leaf, t, reduction="batchmean").backward()
        ms = statistics.median(timing.time_cuda(fn, [()], reps, 3))
        tensors = 3 if train else 2
        floor = tensors * p.numel() * p.element_size() / read_gbps / 1e6
        print(f"{name} {ms:.4f}")
        print(f"{name}, its floor {floor:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*", type=Path, help="kernels/ directories (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.reps)
        return
    if not args.trees:
        ap.error("name at least one kernels/ directory")
    build(args.trees, "import torch, kldiv_inline.ops as o; o._module(torch.device('cuda'))")
    cmd = [sys.executable, __file__, "--child", "--reps", str(args.reps)]
    print_table(args.trees, time_rounds(args.trees, cmd, args.rounds), 36)


if __name__ == "__main__":
    main()
