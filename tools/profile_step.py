"""Profile one training step of the kit's loss (forward + loss.backward()) and list the GPU kernels it runs.

    python tools/profile_step.py [--batch 16384 --features 16384 --dtype float32]

Use it to see where time goes beyond the fused kernel: extra passes show up as extra kernels (a clone,
a fill, an elementwise op) in the table.
"""
import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kldiv_inline as K  # noqa: E402
from kldiv_inline.reference import probability_rows

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=16384)
ap.add_argument("--features", type=int, default=16384)
ap.add_argument("--dtype", default="float32")
args = ap.parse_args()
dtype = getattr(torch, args.dtype)
p = probability_rows(args.batch, args.features, dtype=dtype, device="cuda").requires_grad_()
t = probability_rows(args.batch, args.features, dtype=dtype, device="cuda")


def step():
    p.grad = None
    K.kl_div_from_probs(p, t).backward()


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))
