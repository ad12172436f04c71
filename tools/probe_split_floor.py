"""What a vocabulary split's kernels could reach with no exchange at all, on one GPU:

    python tools/probe_split_floor.py [--world 2] [--tokens 4096] [--vocab 128256] [--betas 0,0.5]

The one-device training step (generalized_jsd and autograd.grad over bf16 logits, T = 2, 10% of tokens masked:
tools/bench_vocab_parallel.py's problem) timed on the whole vocabulary and on one rank's slice of it (vocab /
world columns, the rows' shared-memory plan then the split kernel's: the same clusters and slices), each captured
in a CUDA graph (no host time) and replayed with the L2 flushed before each (CUDA events; median, 20-80%). The
slice's time over the whole's is the split's ratio if exchanging each token's statistics with the other ranks
cost nothing: the fixed costs of a row (its cluster's launch, barriers, reductions) do not shrink with its width.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kldiv_inline as K  # noqa: E402
from kldiv_inline.timing import L2Flush, capture, quantiles, time_cuda  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--betas", default="0,0.5")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    n = args.tokens
    labels = torch.randint(0, args.vocab, (n,), generator=gen, device="cuda")
    labels = labels.masked_fill(torch.rand(n, generator=gen, device="cuda") < 0.1, -100)
    flush = L2Flush("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)
    for beta in (float(b) for b in args.betas.split(",")):
        times = {}
        for width in (args.vocab, args.vocab // args.world):
            s = (torch.randn(n, width, generator=gen, device="cuda") * 2).bfloat16().requires_grad_()
            t = (torch.randn(n, width, generator=gen, device="cuda") * 2).bfloat16()

            def step(s, t, beta=beta):
                loss = K.generalized_jsd(s, t, beta=beta, temperature=2.0, labels=labels)
                return loss.detach(), *torch.autograd.grad(loss, [s])

            graph, _ = capture(step, s, t)
            times[width] = quantiles(time_cuda(graph.replay, [()], args.reps, 3, flush=flush))
            del graph, s, t
        full, slice_ = times[args.vocab], times[args.vocab // args.world]
        print(f"beta {beta}: {n} x {args.vocab} {full[0]:.4f} ms ({full[1]:.4f}-{full[2]:.4f}), one rank's slice "
              f"{n} x {args.vocab // args.world} {slice_[0]:.4f} ms ({slice_[1]:.4f}-{slice_[2]:.4f}): "
              f"{slice_[0] / full[0]:.3f} x")


if __name__ == "__main__":
    main()
