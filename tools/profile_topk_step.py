"""Where a top-k teacher's training step spends its time on a GPU (the bench's D4 case: bf16 4096 x 128256,
k = 100, T = 2, 10% masked): timed the bench's way (harness.bench, a fresh student leaf per call) and back to back
on one leaf, from an idle GPU, the host's wall time per step, and a host + device trace of three steps back to
back with the idle intervals of the middle one and the host work during them.

    python tools/profile_topk_step.py [--gap-us 10] [--after-suite]
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trace_steps import host_during, host_ms_per_step, ops_of  # noqa: E402  (tools/, the script's own folder)

from kldiv_inline import bench_distill, harness  # noqa: E402
from kldiv_inline.timing import quantiles, time_cuda  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--gap-us", type=float, default=10.0, help="idle intervals listed: those longer than this")
ap.add_argument("--after-suite", action="store_true",
                help="first run the distillation suite's reverse-KL cases and the top-k case as the results run "
                     "does (peers included), then time the step again in that process: as is, with Python's "
                     "garbage collector off, and after gc.collect() and torch.cuda.empty_cache()")
args = ap.parse_args()
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
s, _, y, idx, lp = bench_distill.make_inputs(*bench_distill.sizes("cuda"), "cuda", seed=0)
step_of = bench_distill.topk_providers(0.0)[bench_distill.OURS]  # (s, idx, lp, y) -> (loss, grad)
leaf = s.detach().requires_grad_()


def step():
    return step_of(leaf, idx, lp, y)


for _ in range(3):
    step()
torch.cuda.synchronize()
timed = harness.bench({"ours": step_of}, [harness.Case("topk", (s, idx, lp, y), {})], reference=None,
                      setup=bench_distill._fresh_student, reps=8, warmup=3, measure_memory=True)
b2b = quantiles(time_cuda(step, [()], reps=15, warmup=3))[0]
idle = quantiles(time_cuda(step, [()], reps=7, warmup=0, prepare=lambda: (torch.cuda.synchronize(), ())[1]))[0]
host_ms = host_ms_per_step(step)
print(f"bench's way {timed['median_ms'].iloc[0]:.3f} ms; back to back on one leaf {b2b:.3f} ms; from an idle GPU "
      f"{idle:.3f} ms; host wall time per step (back to back, no synchronisation) {host_ms:.3f} ms")


def bench_way():
    return harness.bench({"ours": step_of}, [harness.Case("topk", (s, idx, lp, y), {})], reference=None,
                         setup=bench_distill._fresh_student, reps=8, warmup=3)["median_ms"].iloc[0]


if args.after_suite:
    import gc

    from kldiv_inline import floors
    rows = bench_distill.run("cuda", floors.measure_floor("cuda"), reps=8, betas=(1.0,))
    in_suite = next(r["median_ms"] for r in rows if r.get("form") == "topk" and r["impl"] == bench_distill.OURS)
    after = bench_way()
    gc.disable()
    no_gc = bench_way()
    gc.enable()
    gc.collect()
    torch.cuda.empty_cache()
    cleaned = bench_way()
    print(f"after the suite's reverse-KL cases: its top-k row {in_suite:.3f} ms; then the bench's way {after:.3f} ms, "
          f"with the garbage collector off {no_gc:.3f} ms, after gc.collect() and empty_cache() {cleaned:.3f} ms; "
          f"gc counts {gc.get_count()}, objects tracked {len(gc.get_objects())}")

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for i in range(3):
        with record_function(f"b2b_step_{i}"):
            step()
    torch.cuda.synchronize()
path = tempfile.mkstemp(suffix=".json")[1]
prof.export_chrome_trace(path)
trace = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
marks = {e["name"]: e for e in trace if e.get("cat") == "user_annotation" and e["name"].startswith("b2b_step_")}
gpu_all = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
host = [e for e in trace if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op")]


mid, after = ops_of(trace, gpu_all, marks["b2b_step_1"]), ops_of(trace, gpu_all, marks["b2b_step_2"])
g0, g1 = mid[0]["ts"], after[0]["ts"]
print(f"middle of three steps: {(g1 - g0) / 1e3:.3f} ms from its first device op to the next step's, "
      f"{sum(e['dur'] for e in mid) / 1e3:.3f} ms busy in {len(mid)} ops; host range of the step "
      f"{marks['b2b_step_1']['dur'] / 1e3:.3f} ms")
for e in mid:
    print(f"  {(e['ts'] - g0) / 1e3:8.3f} ms  {e['dur']:8.1f} us  {e['name'][:90]}")
last = g0
for e in [*mid, after[0]]:
    if e["ts"] - last > args.gap_us:
        during = host_during(host, last, e["ts"])
        print(f"  idle {(e['ts'] - last):8.1f} us before {e['name'][:40]!r}: "
              + ", ".join(f"{n[:40]} {us:.0f}" for n, us in during.most_common(8)))
    last = max(last, e["ts"] + e["dur"])
