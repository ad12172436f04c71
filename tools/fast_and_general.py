"""One step by the fast distillation kernels and by the general one (rows_kernel: KLDIV_DISTILL_FAST=0, which
distill_forward reads on every call) in one process: the comparison tools/probe_layouts.py and
tools/probe_teacher_grad.py make."""
import os
import re
import statistics

import torch

from kldiv_inline import timing


def kernels_of(fn) -> str:
    """Which kernel fn() launched: "general" (rows_kernel, as tests/test_distill.py's general_kernel), "fast"
    (fast_rows or stream_forward), else "?"."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    if any(re.search(r"[^\w]rows_kernel<", x) for x in names):
        return "general"
    return "fast" if any("fast_rows" in x or "stream_forward" in x for x in names) else "?"


def by_both_paths(step, reps: int) -> dict[str, tuple[str, object, float]]:
    """{"new": ..., "general": ...}, each (the kernel step took, step()'s result, the median of `reps` CUDA-event
    timings of step in ms after 3 warm-up calls); the knob restored (unset) however it ends."""
    out = {}
    for path in ("new", "general"):
        if path == "general":
            os.environ["KLDIV_DISTILL_FAST"] = "0"
        try:
            took = kernels_of(step)
            result = step()
            ms = statistics.median(timing.time_cuda(lambda: step(), [()], reps, 3))
        finally:
            os.environ.pop("KLDIV_DISTILL_FAST", None)
        out[path] = (took, result, ms)
    return out
