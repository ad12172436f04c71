"""The generalized JSD's accuracy as beta nears 0 or 1, against 60-digit arithmetic (mpmath, which torch installs
with sympy): each token's loss from the kit in float64 and float32 logits. Float32 lanes form the mixture's log,
log(1 - beta + beta e^d), to an absolute ~2^-23 while the loss is ~min(beta, 1 - beta) times a divergence, so
their relative error grows as ~eps / min(beta, 1 - beta) (the documented limit); float64 lanes take each side's
part from log1p of its own small term and the series of the exchanged problem for beta > 1/2
(kernels/distill_common.h, exact_ends), so they should hold ~1e-15 at every beta.

    python tools/probe_jsd_beta_ends.py [--device cpu|cuda] [--vocab 60] [--seeds 3]

Rows: logits of spread 2 (two per seed) and one row that nearly agrees (the teacher the student plus 0.01 x noise:
the JSD's series region), T = 1. Prints per beta and dtype the largest relative error over the rows (nan: float32
lanes refuse a beta that is 1 in float32).
"""
import argparse
import sys
from pathlib import Path

import mpmath
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kldiv_inline as K  # noqa: E402

BETAS = (1e-30, 1e-16, 1e-12, 1e-9, 1e-6, 1e-3, 0.3, 0.5, 1 - 1e-3, 1 - 1e-6, 1 - 1e-9, 1 - 1e-12)


def truth(s_row: torch.Tensor, t_row: torch.Tensor, beta: float) -> mpmath.mpf:
    """The row's JSD from its (float64) logits, in mpmath's precision."""
    b = mpmath.mpf(beta)
    xs, xt = [mpmath.mpf(float(v)) for v in s_row], [mpmath.mpf(float(v)) for v in t_row]
    zs, zt = mpmath.fsum(mpmath.exp(v) for v in xs), mpmath.fsum(mpmath.exp(v) for v in xt)
    total = mpmath.mpf(0)
    for a, c in zip((mpmath.exp(v) / zs for v in xs), (mpmath.exp(v) / zt for v in xt)):
        m = (1 - b) * a + b * c
        total += b * c * mpmath.log(c / m) + (1 - b) * a * mpmath.log(a / m)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    mpmath.mp.dps = 60
    rows = []
    for seed in range(args.seeds):
        g = torch.Generator().manual_seed(seed)
        s = torch.randn(3, args.vocab, dtype=torch.float64, generator=g) * 2
        t = torch.randn(3, args.vocab, dtype=torch.float64, generator=g) * 2
        t[2] = s[2] + 0.01 * torch.randn(args.vocab, dtype=torch.float64, generator=g)
        rows.append((s, t))
    print(f"{'beta':>22} {'float64':>9} {'float32':>9}   (largest relative error of a token's loss)")
    for beta in BETAS:
        worst = {}
        for dtype in (torch.float64, torch.float32):
            errs = []
            if dtype != torch.float64 and float(torch.tensor(beta, dtype=torch.float32)) == 1.0 and beta < 1:
                worst[dtype] = float("nan")  # 1 in float32: refused by the kit (1 - beta would be 0)
                continue
            for s, t in rows:
                s_d, t_d = s.to(dtype), t.to(dtype)  # the truth of the rounded logits
                out = K.generalized_jsd(s_d.to(args.device), t_d.to(args.device), beta=beta, reduction="none").cpu()
                for r in range(s.shape[0]):
                    want = truth(s_d[r].double(), t_d[r].double(), beta)
                    errs.append(abs(float((mpmath.mpf(float(out[r])) - want) / want)))
            worst[dtype] = max(errs)
        print(f"{beta!r:>22} {worst[torch.float64]:9.1e} {worst[torch.float32]:9.1e}", flush=True)


if __name__ == "__main__":
    main()
