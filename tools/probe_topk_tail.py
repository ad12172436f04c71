"""A top-k teacher whose k tokens hold all but a small tail of its mass: each token's loss against float64 PyTorch
(kldiv_inline.reference) on the same float32 log-probabilities, and the prepared rows' tail column against the
tail computed in float64. The tail, 1 - the sum of the k probabilities, is a small difference of numbers near 1;
distill_topk_prepare forms it in double (kernels/distill_plan.h, topk_tail).

    python tools/probe_topk_tail.py [--device cpu|cuda] [--seeds 30] [--vocab 4096] [--k 100 200]
                                    [--tails 1e-3 1e-4 1e-5]

Per (tail, dtype, beta), over the seeds (6 tokens each, student logits of spread 2, bf16 and fp32, reduction
none): the largest relative error of a token's loss, and per tail the largest relative error of the tail column
(tails much below 1e-5 are not drawn: the float32 rounding of the log-probabilities moves the mass by ~1e-7).
One JSON line a case (to $OUT/topk_tail.jsonl when OUT is set), a table last.
"""
import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jsonl_out import emit  # noqa: E402

import kldiv_inline as K  # noqa: E402
from kldiv_inline.distill import TOPK_MASS_SLACK  # noqa: E402
from kldiv_inline.reference import generalized_jsd_reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--k", type=int, nargs="+", default=[100, 200])
    ap.add_argument("--tails", type=float, nargs="+", default=[1e-3, 1e-4, 1e-5])
    args = ap.parse_args()
    dev, n, v = args.device, 6, args.vocab
    card = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(card, torch.__version__, torch.version.cuda, flush=True)
    mod = K.load(dev, extension="distill")
    worst: dict = {}
    for seed in range(args.seeds):
        g = torch.Generator().manual_seed(seed)
        for k in args.k:
            for tail in args.tails:
                top, idx = torch.log_softmax(torch.randn(n, v, dtype=torch.float64, generator=g) * 2.5, -1).topk(k, -1)
                lp = (top - top.logsumexp(-1, keepdim=True) + math.log1p(-tail)).float()
                exact = 1 - lp.double().exp().sum(-1)  # the tail of these float32 log-probabilities
                idx, lp = idx.to(dev), lp.to(dev)
                rows = mod.distill_topk_prepare(idx, lp, v, None, -100, math.log1p(TOPK_MASS_SLACK))[0]
                err = float((rows[:, k].double().cpu() / exact - 1).abs().max())
                worst[(tail, "tail", None)] = max(worst.get((tail, "tail", None), 0.0), err)
                for dtype in (torch.bfloat16, torch.float32):
                    s = (torch.randn(n, v, dtype=torch.float64, generator=g) * 2).to(device=dev, dtype=dtype)
                    for beta in (0.0, 0.5, 1.0):
                        out = K.generalized_jsd(s, teacher_topk=(idx, lp), beta=beta, reduction="none")
                        ref = generalized_jsd_reference(s.double(), teacher_topk=(idx, lp.double()), beta=beta,
                                                        reduction="none")
                        e = float(((out.double() - ref).abs() / ref.abs()).max())
                        key = (tail, str(dtype).removeprefix("torch."), beta)
                        worst[key] = max(worst.get(key, 0.0), e)
    cases = sorted(worst.items(), key=lambda x: (-x[0][0], x[0][1], x[0][2] or 0))
    for (tail, what, beta), e in cases:
        emit(dict(card=card, device=dev, tail=tail, what=what, beta=beta, seeds=args.seeds, vocab=v, k=args.k,
                  max_rel_err=e), "topk_tail.jsonl")
    print(f"{'tail':>8} {'what':>9} {'beta':>5} {'max rel err':>12}")
    for (tail, what, beta), e in cases:
        print(f"{tail:8.0e} {what:>9} {'' if beta is None else beta:>5} {e:12.2e}")


if __name__ == "__main__":
    main()
