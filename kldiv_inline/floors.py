"""Bandwidth floors and vendor peaks: what a memory-bound kernel's time is measured against.

The floor of a case is the bytes it must move over the best read bandwidth measured on this device in this
process: the better of PyTorch's reduction (``x.sum()`` over 1 GiB) and the kit's own read kernel
(``kernels/read_floor.cu``: 16-byte loads, several in flight per thread, a grid that fills the GPU). A
reduction alone is not a floor: a kernel with more loads in flight can beat it (a bfloat16 KL case ran at
0.97 x the ``x.sum()`` bandwidth). On the CPU the floor is PyTorch's reduction.

The vendor peak is the card's data-sheet memory bandwidth; ``pct_of_peak`` of a timing row is its achieved
GB/s over that peak. Unknown cards (and the CPU) have no peak: the column stays empty.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import torch

from . import timing
from .loader import kernels_root, load_sources

# Data-sheet memory bandwidth in GB/s, matched against torch.cuda.get_device_name() (first match wins, so
# the more specific names come first).
VENDOR_PEAK_GBPS: list[tuple[str, float]] = [
    (r"\bH100\b.*PCIe", 2000),
    (r"\bH100\b.*NVL", 3900),
    (r"\bH100\b", 3350),        # SXM5 80GB HBM3 ("NVIDIA H100 80GB HBM3")
    (r"\bH200\b", 4800),        # SXM and NVL, 141GB HBM3e (not GH200, whose memory differs)
    (r"A100.*80GB.*PCIe", 1935),
    (r"A100.*80GB", 2039),      # SXM4 80GB
    (r"A100", 1555),            # 40GB, SXM4 and PCIe
    (r"L40S", 864),
    (r"\bL4\b", 300),
    (r"\bA10G?\b", 600),
    (r"RTX 4090", 1008),
]

READ_SOURCES = ("read_floor.cu", "read_floor_bindings.cpp")


def vendor_peak_gbps(device_name: str) -> float | None:
    """The card's data-sheet memory bandwidth in GB/s, or None for a card not in VENDOR_PEAK_GBPS."""
    for pattern, gbps in VENDOR_PEAK_GBPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return float(gbps)
    return None


def device_peak_gbps(device: str) -> float | None:
    """Vendor peak of the current GPU for ``device == "cuda"``; None on the CPU."""
    return vendor_peak_gbps(torch.cuda.get_device_name()) if device == "cuda" else None


@dataclasses.dataclass(frozen=True)
class Floor:
    """The read bandwidth a device reached in this process, and where it came from."""

    device: str
    gbps: float                  # the best of `sources`: the floor's bandwidth
    source: str                  # the source that gave it
    sources: dict[str, float]    # GB/s of every source measured: "torch_sum", "read_kernel" (CUDA)

    def ms(self, nbytes: int) -> float:
        """Milliseconds to move ``nbytes`` at the floor's bandwidth."""
        return nbytes / self.gbps / 1e6


def load_read_kernel(verbose: bool = False):
    """The compiled read kernel (``kernels/read_floor.cu``): ``read_floor(buffer, unroll=4)``; call it through
    ``read_words``, which checks the buffer first."""
    return load_sources([kernels_root() / f for f in READ_SOURCES], name="read_floor", verbose=verbose)


def read_words(buffer: torch.Tensor, unroll: int = 4) -> torch.Tensor:
    """One XOR word per block of the read kernel over every byte of ``buffer``: a contiguous CUDA tensor of a
    positive multiple of 16 bytes, 16-byte aligned; unroll 1, 2, 4 or 8 loads in flight per thread.
    Checked here: on an H200 a bad buffer crashed the process inside the extension instead of raising its
    TORCH_CHECK error (not yet understood)."""
    if not (isinstance(buffer, torch.Tensor) and buffer.is_cuda and buffer.is_contiguous()):
        raise ValueError("read_words: expected a contiguous CUDA tensor")
    if buffer.nbytes == 0 or buffer.nbytes % 16 or buffer.data_ptr() % 16:
        raise ValueError(f"read_words: the buffer must be a positive multiple of 16 bytes, 16-byte aligned "
                         f"(got {buffer.nbytes} bytes)")
    if unroll not in (1, 2, 4, 8):
        raise ValueError(f"read_words: unroll must be 1, 2, 4 or 8, got {unroll}")
    return load_read_kernel().read_floor(buffer, unroll)


def _gbps(fn, x, device: str, reps: int) -> float:
    """GB/s of the fastest of the timed reads: a floor is what the device can do at best."""
    if device == "cuda":
        times = timing.time_cuda(fn, [(x,)], reps, warmup=3)
    else:
        times = timing.time_wall(fn, [(x,)], max(3, reps // 4), warmup=1, device=device)
    return x.nbytes / min(times) / 1e6


def measure_floor(device: str, nbytes: int = 1 << 30, reps: int = 20) -> Floor:
    """Read bandwidth over an ``nbytes`` buffer from every source on ``device``, once per process (on a GPU, once
    per GPU: the current one, ``torch.cuda.current_device()``)."""
    return _measure_floor(device, nbytes, reps, torch.cuda.current_device() if device == "cuda" else None)


@functools.cache
def _measure_floor(device: str, nbytes: int, reps: int, index: int | None) -> Floor:
    x = torch.ones(nbytes // 4, device=device)  # the contents do not matter; a buffer far beyond the caches
    sources = {"torch_sum": _gbps(lambda a: a.sum(), x, device, reps)}
    if device == "cuda":
        read_words(x)  # checks the buffer (and builds the kernel) once; the timed calls go straight to the kernel
        mod = load_read_kernel()
        # The best number of 16-byte loads in flight per thread depends on the card: take the best.
        sources["read_kernel"] = max(_gbps(lambda a, u=u: mod.read_floor(a, u), x, device, reps)
                                     for u in (2, 4, 8))
    del x
    best = max(sources, key=sources.get)
    return Floor(device, sources[best], best, sources)
