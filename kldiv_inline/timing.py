"""How one callable is timed: CUDA events or a wall clock, warm-up, L2 flush, input rotation, quantiles.

The only timing loop of the kit: ``harness.bench`` times every provider through it, ``floors`` times the
read-bandwidth floor through it.

* CUDA events around each call after the warm-up calls, so only device time between the two events counts.
* The L2 cache is flushed (a 256 MiB read) before every timed call when the inputs are at most twice its size
  (larger ones evict themselves), so each call reads its inputs from memory, as in a real model where other work
  ran in between.
* Input sets are rotated (``args_sets``), so consecutive calls do not see the same addresses.
* ``prepare`` (e.g. fresh ``requires_grad`` leaves) runs before each call, outside the timed region.
* A wall clock (``time.perf_counter``) on the CPU, and for launch-bound cases on a GPU: there ``inner``
  back-to-back calls with one synchronisation, so the host's per-call cost is what is measured.
* Reported: the median and the 20% and 80% quantiles of the per-call times.
"""
from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

FLUSH_BYTES = 256 << 20  # several times the L2 of current data-centre GPUs (H100 and H200: 50 MiB)


def quantiles(times_ms: Sequence[float]) -> tuple[float, float, float]:
    """(median, 20% quantile, 80% quantile)."""
    times_ms = list(times_ms)
    qs = statistics.quantiles(times_ms, n=10, method="inclusive") if len(times_ms) > 1 else times_ms * 9
    return statistics.median(times_ms), qs[1], qs[7]


def l2_bytes(device: str) -> int:
    """The L2 cache of the current GPU (0 on the CPU: its caches are not flushed)."""
    if device != "cuda":
        return 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "L2_cache_size", 50 << 20)


@functools.cache
def llc_bytes() -> int:
    """The CPU's last-level cache: the largest cache Linux lists for cpu0 (32 MiB where none is listed)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = entry.read_text().strip()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=32 << 20)


class L2Flush:
    """Reads a buffer larger than the L2 cache, so the next call reads its inputs from memory. A read, not a write:
    a written buffer left up to an L2 of dirty lines, written back to memory inside the next timed call as its
    reads evicted them (up to twice a small case's memory traffic, against a floor of reads alone); read lines
    are clean, and the previous call's own dirty lines are written back here, outside the timed region."""

    def __init__(self, device: str):
        if device == "cuda":
            self.buf = torch.zeros(FLUSH_BYTES // 8, dtype=torch.int64, device=device)
            self.out = torch.zeros((), dtype=torch.int64, device=device)
        else:
            self.buf = None

    def __call__(self):
        if self.buf is not None:
            torch.sum(self.buf, dim=0, out=self.out)


def _identity(*args):
    return args


def time_cuda(fn: Callable, args_sets: Sequence[tuple], reps: int, warmup: int, flush: L2Flush | None = None,
              prepare: Callable | None = None) -> list[float]:
    """Milliseconds of device time per call, from CUDA events around each of ``reps`` calls."""
    prepare = prepare or _identity
    for i in range(warmup):
        fn(*prepare(*args_sets[i % len(args_sets)]))
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        args = prepare(*args_sets[i % len(args_sets)])
        if flush is not None:
            flush()
        starts[i].record()
        fn(*args)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def time_wall(fn: Callable, args_sets: Sequence[tuple], reps: int, warmup: int, device: str, inner: int = 1,
              prepare: Callable | None = None) -> list[float]:
    """Wall milliseconds per call; with ``inner`` > 1, back-to-back calls and one sync (host cost included)."""
    prepare = prepare or _identity
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(warmup):
        fn(*prepare(*args_sets[i % len(args_sets)]))
    sync()
    out = []
    for i in range(reps):
        calls = [prepare(*args_sets[(i * inner + j) % len(args_sets)]) for j in range(inner)]
        sync()  # the work prepare queued (copies, say) done before the clock starts: it is not the call's
        t0 = time.perf_counter()
        for args in calls:
            fn(*args)
        sync()
        out.append((time.perf_counter() - t0) * 1e3 / inner)
    return out


def capture(step: Callable, *args):
    """(graph, outputs): ``step(*args)`` captured in a CUDA graph (``graph.replay()`` runs it again and
    overwrites the outputs), after three runs on a side stream, as PyTorch's CUDA-graph documentation asks (lazy
    set-up, allocator state). Replays read whatever the step's static inputs hold then.

    A step that runs autograd must not find its leaves still tied to an eager step's graph: autograd keeps a leaf's
    gradient-accumulation node, with the stream it was made on, for as long as any graph that uses the leaf is
    alive, and a capture whose backward hands a gradient to a node made on the default stream fails
    (cudaErrorStreamCaptureImplicit: "operation would make the legacy stream depend on a capturing blocking
    stream"). So drop an eager step's outputs (its loss holds its graph) before capturing, or capture on fresh
    leaves. (Seen with the split step: an eager step's loss, kept to compare with the replay, failed the capture.)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = step(*args)
    except RuntimeError as e:  # CUDA's words for it name neither autograd nor the leaf: say what to do
        if not any(w in str(e) for w in ("capturing", "StreamCapture", "stream capture")):
            raise
        raise RuntimeError(f"capture: the step could not be captured ({e}). If it runs autograd on leaves that an "
                           "eager step used, drop that step's outputs (its loss holds its graph, and with it each "
                           "leaf's gradient node and the stream it was made on) or capture on fresh leaves") from e
    return graph, out
