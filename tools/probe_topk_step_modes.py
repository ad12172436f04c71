"""Whether the top-k teacher's eager training step (4096 x 128256 bfloat16, k = 100) runs in two modes, and whether
Python's garbage collector over a large heap (as torch.compile's caches leave one) decides them: 100 steps each,
timed alone with CUDA events after a 512 MiB write (the L2 flushed), under each heap and collector setting; a step
counts as slow above 0.62 ms (its kernels take ~0.57 ms on an H200). One GPU: `python tools/probe_topk_step_modes.py`.
"""
import gc

import torch

from kldiv_inline import bench_distill


def main() -> None:
    s, _, y, idx, lp = bench_distill.make_inputs(4096, 128256, "cuda", seed=1)
    s = s.requires_grad_()
    step = bench_distill.topk_providers(0.0)[bench_distill.OURS]
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")

    def times(n: int) -> list[float]:
        out = []
        for _ in range(n):
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(s, idx, lp, y)
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        return out

    def show(tag: str, v: list[float]) -> None:
        v, n = sorted(v), len(v)
        print(f"{tag:34s} median {v[n // 2]:.3f} q20 {v[n // 5]:.3f} q80 {v[4 * n // 5]:.3f} "
              f"slow(>0.62) {sum(x > 0.62 for x in v)}/{n}", flush=True)

    print(torch.cuda.get_device_name(), torch.__version__)
    times(10)
    show("small heap, gc on", times(100))
    junk = [{"a": [i], "b": (i,)} for i in range(3_000_000)]  # a heap like the KL suite's compiled graphs leave
    show("large heap, gc on", times(100))
    gc.disable()
    show("large heap, gc off", times(100))
    gc.enable()
    gc.freeze()
    show("large heap, gc.freeze()", times(100))
    gc.unfreeze()
    del junk
    gc.collect()
    show("heap freed, gc on", times(100))


if __name__ == "__main__":
    main()
