"""Whether the L2 flush's writes cost the next timed call their write-back: small cases timed the harness's way
(CUDA events around each call, the flush before each) with the flush that writes its 256 MiB buffer (fill_, the
kit's before 0585069) against the one that reads it (timing.L2Flush now), in alternating rounds. A written
buffer leaves up to an L2 of dirty lines, which the timed call's reads evict and the memory writes back inside
the timed region; read lines are clean. Cases: x.sum() over float32 inputs of 4-64 MiB (the sizes the harness
flushes: at most twice the L2), and the KL op's fwd (batchmean) on 2 x 16 MiB. One GPU:
    python tools/probe_l2_flush.py [--rounds 4] [--reps 50]
"""
import argparse

import torch

import kldiv_inline as K
from kldiv_inline import floors
from kldiv_inline.timing import FLUSH_BYTES, L2Flush, quantiles, time_cuda

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=4)
ap.add_argument("--reps", type=int, default=50)
args = ap.parse_args()


class WriteFlush:
    """The flush as it was: 256 MiB written."""

    def __init__(self):
        self.buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def __call__(self):
        self.buf.fill_(1)


def sets(make, nbytes):
    """Input sets rotated as the harness rotates them: copies that together overflow three L2s."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return [make() for _ in range(min(8, max(2, 3 * l2 // nbytes + 1)))]


cases = []
for mib in (4, 16, 64):
    n = (mib << 20) // 4
    cases.append((f"sum {mib} MiB", torch.sum, sets(lambda n=n: (torch.rand(n, device="cuda"),), mib << 20),
                  mib << 20))
rows, cols = 1024, 4096  # 16 MiB each
kl_sets = sets(lambda: (torch.randn(rows, cols, device="cuda").log_softmax(-1),
                        torch.rand(rows, cols, device="cuda").softmax(-1)), 32 << 20)
cases.append(("kl_div batchmean 2 x 16 MiB", lambda x, t: K.kl_div(x, t, reduction="batchmean"), kl_sets, 32 << 20))

floor = floors.measure_floor("cuda")
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; floor {floor.gbps:.0f} GB/s "
      f"(L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MiB)")
flushes = {"write (fill_)": WriteFlush(), "read (now)": L2Flush("cuda")}
results = {(c[0], f): [] for c in cases for f in flushes}
for r in range(args.rounds):
    for name, fn, arg_sets, _ in cases:
        for fname, flush in (flushes.items() if r % 2 == 0 else reversed(flushes.items())):
            results[(name, fname)] += time_cuda(fn, arg_sets, args.reps, 5, flush)
print(f"{'case':30s} {'flush':14s} {'median us':>10s} {'q20':>8s} {'q80':>8s} {'x floor':>8s}")
for name, _, _, nbytes in cases:
    for fname in flushes:
        med, q20, q80 = quantiles(results[(name, fname)])
        x_floor = med / (nbytes / floor.gbps / 1e6)
        print(f"{name:30s} {fname:14s} {med * 1e3:10.1f} {q20 * 1e3:8.1f} {q80 * 1e3:8.1f} {x_floor:8.3f}")
