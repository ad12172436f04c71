"""Whether the kit's float32 gradients are as exact as PyTorch's own float32 autograd of the same formula, across
the divergences: for each beta (0, 0.1, 0.5, 0.9, 1), logits' spread (N(0, s^2), s = 1, 3, 6) and temperature (0.6,
2), three draws (seeds 0-2) of 16 x 3001 float32 logits, the student's and the teacher's gradient of
generalized_jsd (reduction sum) against float64 (kldiv_inline.reference), beside PyTorch's float32 (log_softmax,
the mixture by logsumexp: kldiv_inline.reference's formula in float32):

    python tools/probe_float32_grads.py [--device cuda]     # the CPU twin by default

Prints, per setting, the largest ratio of our error to PyTorch's over the draws and our largest error, for each
gradient. The CPU twin at 00457b5: ratios 0.11-1.28 (above 1 only where both errors sit at float32's rounding,
1.9e-7 to 6.2e-7: forward and reverse KL at T 2); before version 66 (kernels/NOTES.md) the JSD's teacher gradient
at spread 6, T 0.6 reached 39 x. Checks nothing itself.
"""
import argparse

import torch

import kldiv_inline as K
from kldiv_inline.reference import generalized_jsd_reference, relative_error

BETAS, SPREADS, TEMPERATURES, DRAWS, ROWS, VOCAB = (0.0, 0.1, 0.5, 0.9, 1.0), (1.0, 3.0, 6.0), (0.6, 2.0), 3, 16, 3001


def torch_float32(s, t, beta, temperature):
    return generalized_jsd_reference(s, t, beta=beta, temperature=temperature, reduction="sum", dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    dev = ap.parse_args().device
    print("beta spread T | student: ours / PyTorch's float32 error, max (our max error) | teacher: the same")
    for beta in BETAS:
        for spread in SPREADS:
            for temperature in TEMPERATURES:
                ratio, worst = [[], []], [[], []]
                for seed in range(DRAWS):
                    gen = torch.Generator().manual_seed(seed)
                    s, t = ((torch.randn(ROWS, VOCAB, dtype=torch.float64, generator=gen) * spread).float().to(dev)
                            for _ in range(2))

                    def grads(fn, s, t, beta=beta, temperature=temperature):
                        s, t = s.clone().requires_grad_(), t.clone().requires_grad_()
                        fn(s, t, beta=beta, temperature=temperature).backward()
                        return s.grad, t.grad

                    truth = grads(lambda s, t, **kw: generalized_jsd_reference(s, t, reduction="sum", **kw),
                                  s.double(), t.double())
                    ours = grads(lambda s, t, **kw: K.generalized_jsd(s, t, reduction="sum", **kw), s, t)
                    theirs = grads(torch_float32, s, t)
                    for i in range(2):
                        e_ours, e_theirs = relative_error(ours[i], truth[i]), relative_error(theirs[i], truth[i])
                        ratio[i].append(e_ours / max(e_theirs, 1e-12))
                        worst[i].append(e_ours)
                print(f"{beta} {spread} {temperature} | {max(ratio[0]):6.2f} ({max(worst[0]):.1e}) | "
                      f"{max(ratio[1]):6.2f} ({max(worst[1]):.1e})")


if __name__ == "__main__":
    main()
