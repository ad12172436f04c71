"""What the profiling tools (profile_topk_step.py, profile_fused_head.py, profile_vocab_parallel.py,
probe_split_graph.py) share: the host's wall time per step, the reading of a host + device trace (torch.profiler's
chrome-trace events, the "X" ones, or its events for kernels), and the split tools' problem."""
import collections
import time

import torch


def host_ms_per_step(step, steps: int = 20) -> float:
    """The host's wall time per step, `steps` back to back with no synchronisation between them (a step whose
    device work is shorter than this is bound by the host)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - t0) / steps * 1e3
    torch.cuda.synchronize()
    return ms


def ops_of(trace: list, gpu_ops: list, mark: dict) -> list:
    """The device ops (of `gpu_ops`) launched inside a host range `mark` (a record_function's event), matched by
    the profiler's correlation ids: the host runs ahead, so time alone does not tell back-to-back steps apart."""
    ids = {e["args"].get("correlation") for e in trace if e.get("cat") in ("cuda_runtime", "cuda_driver")
           and mark["ts"] <= e["ts"] <= mark["ts"] + mark["dur"]}
    return [e for e in gpu_ops if e.get("args", {}).get("correlation") in ids]


def host_during(host: list, start: float, end: float) -> collections.Counter:
    """Microseconds of each host event name (of `host`) that overlap [start, end)."""
    during = collections.Counter()
    for h in host:
        overlap = min(end, h["ts"] + h["dur"]) - max(start, h["ts"])
        if overlap > 0:
            during[h["name"]] += overlap
    return during


def busy(intervals) -> float:
    """The length of the union of (start, end) intervals (the time some kernel runs)."""
    total, last = 0.0, None
    for a, b in sorted(intervals):
        if last is None or a > last:
            total += b - a
            last = b
        elif b > last:
            total += b - last
            last = b
    return total


def split_logits(tokens: int, vocab: int, rank: int, world: int, device: str = "cuda"):
    """The vocabulary-split tools' problem: bf16 student and teacher logits [tokens, vocab] (N(0, 4); the same on
    every rank: one seed), labels with 10% of the tokens masked, and this rank's slice [lo, hi) of the vocabulary
    (even, in rank order): (s, t, labels, lo, hi)."""
    gen = torch.Generator(device=device).manual_seed(0)
    s = (torch.randn(tokens, vocab, generator=gen, device=device) * 2).bfloat16()
    t = (torch.randn(tokens, vocab, generator=gen, device=device) * 2).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    labels = labels.masked_fill(torch.rand(tokens, generator=gen, device=device) < 0.1, -100)
    return s, t, labels, rank * vocab // world, (rank + 1) * vocab // world
