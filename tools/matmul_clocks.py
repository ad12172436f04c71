"""The bf16 matrix-product rate two ways, with the SM clock and power beside each: as the fused head's bench
measures its floor (kldiv_inline.bench_linear.matmul_tflops: a short burst after a pause), and sustained (after
seconds of back-to-back products, as in a training step of the fused head, which runs ~25 ms of products in a
row). An H100 at its power limit lowers its clock under sustained products; a floor taken from the burst is then
one the step cannot reach.

    python tools/matmul_clocks.py [--size 8192] [--seconds 3]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_clocks import median, sampled  # noqa: E402  (tools/, the script's own folder)

from kldiv_inline.bench_linear import matmul_tflops, matmul_tflops_sustained  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--size", type=int, default=8192)
ap.add_argument("--seconds", type=float, default=3.0, help="back-to-back products before the sustained timing")
args = ap.parse_args()
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
n = args.size
time.sleep(1.0)  # a pause, as between the bench's cases
burst, c1, w1 = sampled(lambda: matmul_tflops("cuda", size=n))
# the bench's own sustained rate (its x_floor_sustained), here after --seconds of products
sustained, c2, w2 = sampled(lambda: matmul_tflops_sustained("cuda", size=n, seconds=args.seconds, reps=50))
print(f"{'':24} {'TFLOP/s':>8} {'SM MHz (median)':>16} {'W (median)':>11}")
print(f"{'burst (the bench floor)':24} {burst:8.1f} {median(c1):16.0f} {median(w1):11.0f}")
print(f"{'sustained':24} {sustained:8.1f} {median(c2):16.0f} {median(w2):11.0f}")
print(f"sustained / burst = {sustained / burst:.3f}")
