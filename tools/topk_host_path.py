"""The host's path through an eager training step, against the step's time, for the kldiv_inline package this
script imports: the loop for a change to the Python front end or the C++ glue (is the host now shorter than the
kernels?). Run one process per package to compare, alternating, in one call on one GPU:

    (cd /tmp/old && KLDIV_INLINE_KERNELS=/tmp/old/kernels python /path/to/tools/topk_host_path.py old --path .)
    python tools/topk_host_path.py new

Cases: the distillation suite's top-k teacher step (bf16 4096 x 128256, k = 100, T = 2, 10% masked) and forward
KL's logits step. Prints one JSON line (and appends it to $OUT/host2.jsonl when OUT is set), each figure the
median and the 20% and 80% quantiles in ms: timed the suite's way (harness.bench), with an L2 flush and CUDA events
around each call, 20 calls back to back (wall clock, one synchronisation), and the host's own time through one
step from an idle GPU (wall clock around the call; it includes the top-k checks' wait for their small kernel).
"""
import os
import sys
import time

if "--path" in sys.argv:  # import the package found there (a copy of an older tree), not this checkout's
    sys.path.insert(0, os.path.abspath(sys.argv[sys.argv.index("--path") + 1]))
else:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from jsonl_out import emit  # noqa: E402

import kldiv_inline  # noqa: E402
from kldiv_inline import bench_distill as BD  # noqa: E402
from kldiv_inline import harness, timing  # noqa: E402


def quantiles(ts) -> list[float]:
    return [round(x, 4) for x in timing.quantiles(ts)]


def suite_way(step, args, reps: int) -> list[float]:
    timed = harness.bench({"o": step}, [harness.Case("c", args, {})], reference=None, setup=BD._fresh_student,
                          reps=reps, warmup=3)
    return [round(float(timed[c].iloc[0]), 4) for c in ("median_ms", "q20_ms", "q80_ms")]


def host_only(step, args, n: int = 40) -> list[float]:
    out = []
    for _ in range(n):
        x = BD._fresh_student(*args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(*x)
        out.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return out


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else "this"
    s, t, y, idx, lp = BD.make_inputs(*BD.sizes("cuda"), "cuda", seed=1)
    topk = BD.topk_providers(0.0)[BD.OURS]
    logits = BD.logits_providers(0.0, "fwd+bwd", "cuda")[BD.OURS]
    flush = timing.L2Flush("cuda")
    for _ in range(5):
        topk(*BD._fresh_student(s, idx, lp, y))
        logits(*BD._fresh_student(s, t, y))
    torch.cuda.synchronize()
    res = {"tree": tag, "file": kldiv_inline.__file__, "device": torch.cuda.get_device_name()}
    res["topk suite-like (harness.bench)"] = suite_way(topk, (s, idx, lp, y), 30)
    res["topk flush+events"] = quantiles(timing.time_cuda(topk, [(s, idx, lp, y)], 30, 5, flush, BD._fresh_student))
    res["topk wall b2b x20"] = quantiles(timing.time_wall(topk, [(s, idx, lp, y)], 8, 3, "cuda", inner=20,
                                                          prepare=BD._fresh_student))
    res["topk host-only"] = quantiles(host_only(topk, (s, idx, lp, y)))
    res["logits fwdKL host-only"] = quantiles(host_only(logits, (s, t, y)))
    res["logits fwdKL suite-like"] = suite_way(logits, (s, t, y), 20)
    emit(res, "host2.jsonl")


if __name__ == "__main__":
    main()
