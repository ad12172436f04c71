"""Times the backward's pass over a fused gradient when grad_output is not 1 (kernels/scale_span.cuh): the
distillation module's distill_scale_grad_ (one factor, one a row, and the no-op factor of 1) and the KL op's
kl_div_scale_grad_, on a bf16 gradient of 4096 x 128256 entries, after an L2 flush, CUDA events, ``--reps`` calls
(30 unless named). Prints one JSON line (appended to $OUT/scale_pass.jsonl when OUT is set): each case's median
and 20% / 80% quantiles in ms, and GB/s of read + write at the median. For variants of the kernel, one process a
kernels/ tree, alternating:

    KLDIV_INLINE_KERNELS=/tmp/variant/kernels python tools/scale_pass.py --tag variant
    python tools/scale_pass.py --tag this
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from jsonl_out import emit  # noqa: E402

import kldiv_inline as K  # noqa: E402
from kldiv_inline import timing  # noqa: E402


def main() -> None:
    tag = sys.argv[sys.argv.index("--tag") + 1] if "--tag" in sys.argv else "this"
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 30
    distill, kl = K.load("cuda", extension="distill"), K.load("cuda")
    flush = timing.L2Flush("cuda")
    g = torch.randn(4096, 128256, device="cuda").to(torch.bfloat16)
    moved = 2 * g.numel() * g.element_size()
    res: dict = {"tree": tag, "device": torch.cuda.get_device_name(), "kernels": os.environ.get("KLDIV_INLINE_KERNELS")}
    f32 = dict(device="cuda", dtype=torch.float32)
    cases = {"distill factor 0.5": (distill.distill_scale_grad_, g, torch.tensor(0.5, **f32)),
             "distill a factor a row": (distill.distill_scale_grad_, g, torch.full((4096,), 0.5, **f32)),
             "distill factor 1": (distill.distill_scale_grad_, g, torch.ones((), **f32)),
             "kl factor 0.5": (kl.kl_div_scale_grad_, g.view(-1), torch.tensor(0.5, device="cuda", dtype=g.dtype)),
             "kl factor 1": (kl.kl_div_scale_grad_, g.view(-1), torch.ones((), device="cuda", dtype=g.dtype))}
    for name, (fn, grad, factor) in cases.items():
        med, q20, q80 = timing.quantiles(timing.time_cuda(lambda f=fn, x=grad, c=factor: f(x, c), [()], reps, 5,
                                                          flush))
        res[name] = {"ms": [round(med, 4), round(q20, 4), round(q80, 4)], "GB/s": round(moved / (med * 1e-3) / 1e9)}
    emit(res, "scale_pass.jsonl")


if __name__ == "__main__":
    main()
