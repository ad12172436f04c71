"""Profile one training step of the fused LM head (fused_linear_generalized_jsd, forward + backward) and list the GPU
kernels it runs, grouped by name, with their share of the step: where the time beyond the matrix products goes.

    python tools/profile_fused_head.py [--tokens 4096 --hidden 4096 --vocab 128256 --beta 0.0 --chunk-size N]
                                       [--masked 0.1] [--skip-masked]

The case is the bench's (bf16, student and teacher as hidden states + weight, T = 2, 10% of tokens masked;
--masked sets that share, --skip-masked passes skip_masked=True).
"""
import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_clocks import median, sampled  # noqa: E402  (tools/, the script's own folder)
from trace_steps import host_during, ops_of  # noqa: E402

import kldiv_inline as K  # noqa: E402
from kldiv_inline.timing import quantiles, time_cuda  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--hidden", type=int, default=4096)
ap.add_argument("--vocab", type=int, default=128256)
ap.add_argument("--beta", type=float, default=0.0)
ap.add_argument("--chunk-size", type=int, default=None)
ap.add_argument("--masked", type=float, default=0.1, help="share of tokens whose label is ignore_index")
ap.add_argument("--skip-masked", action="store_true", help="skip_masked=True: no products for masked tokens")
ap.add_argument("--rows", type=int, default=25, help="kernels listed")
ap.add_argument("--trace-json", default=None, help="also write the host + device trace (chrome://tracing) here")
ap.add_argument("--gap-us", type=float, default=20.0, help="idle intervals listed: those longer than this")
ap.add_argument("--ops-us", type=float, default=0.0,
                help="also list the middle back-to-back step's device ops in order, those longer than this (us)")
args = ap.parse_args()
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
g = torch.Generator(device="cuda").manual_seed(0)
n, h_size, v = args.tokens, args.hidden, args.vocab


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()


h = rand(n, h_size).requires_grad_()
w = rand(v, h_size, scale=h_size**-0.5).requires_grad_()
th, tw = rand(n, h_size), rand(v, h_size, scale=h_size**-0.5)
lab = torch.randint(0, v, (n,), device="cuda", generator=g)
lab[torch.rand(n, device="cuda", generator=g) < args.masked] = -100
print(f"{int((lab != -100).sum())} of {n} tokens unmasked, skip_masked={args.skip_masked}", flush=True)


def step():
    h.grad = w.grad = None
    K.fused_linear_generalized_jsd(h, w, th, tw, beta=args.beta, temperature=2.0, labels=lab,
                                   chunk_size=args.chunk_size, skip_masked=args.skip_masked).backward()


for _ in range(3):
    step()
torch.cuda.synchronize()


def idle_gpu():
    """time_cuda's prepare: each timed step starts from an idle GPU, as the profiled one does."""
    torch.cuda.synchronize()
    return ()


# The step's own time (CUDA events around it, through the kit's timing loop), to set beside the GPU time of its
# kernels below: the difference is time with no kernel running, from the host's path before the first launch and
# between launches.
step_ms = quantiles(time_cuda(step, [()], reps=7, warmup=0, prepare=idle_gpu))[0]


def busy_gpu():
    """time_cuda's prepare: tens of ms of GPU sleep queued ahead of the step, so that the host's whole path runs
    while the GPU is still busy: the step's time bound by the GPU alone."""
    torch.cuda.synchronize()
    torch.cuda._sleep(60_000_000)  # cycles: ~30 ms at 2 GHz
    return ()


# The same step three ways: from an idle GPU (above), back to back as the bench times it (no synchronisation
# between steps), and behind queued GPU work (host latency hidden); with the host's own time per step.
gpu_bound_ms = quantiles(time_cuda(step, [()], reps=7, warmup=0, prepare=busy_gpu))[0]
b2b_ms = quantiles(time_cuda(step, [()], reps=7, warmup=1))[0]
host_ms = []
torch.cuda.synchronize()
for _ in range(7):
    t_host = time.perf_counter()
    step()
    host_ms.append((time.perf_counter() - t_host) * 1e3)
torch.cuda.synchronize()
# The SM clock and power while steps run back to back (nvidia-smi sampled every 50 ms): a step behind idle time
# may run at a higher clock than steps in a row at the card's power limit.
_, clocks, watts = sampled(lambda: time_cuda(step, [()], reps=10, warmup=0))
if clocks:
    print(f"back to back: SM clock {clocks[0]:.0f} / {median(clocks):.0f} / {clocks[-1]:.0f} MHz, "
          f"power {watts[0]:.0f} / {median(watts):.0f} / {watts[-1]:.0f} W (min / median / max of "
          f"{len(clocks)} samples)")
print(f"step from an idle GPU {step_ms:.2f} ms, back to back {b2b_ms:.2f} ms, behind queued GPU work "
      f"{gpu_bound_ms:.2f} ms (medians of 7, CUDA events); the host's path per step {quantiles(host_ms)[0]:.2f} ms "
      f"(back to back, wall clock)")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step()
    torch.cuda.synchronize()
events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
total = sum(e.self_device_time_total for e in events)
print(f"GPU time of one step: {total / 1e3:.2f} ms over {sum(e.count for e in events)} kernels; the step takes "
      f"{step_ms:.2f} ms (median of 7, CUDA events), so {step_ms - total / 1e3:.2f} ms without a kernel running")
print(f"{'ms':>8} {'share':>6} {'calls':>6}  kernel")
for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.rows]:
    print(f"{e.self_device_time_total / 1e3:8.3f} {e.self_device_time_total / total:6.1%} {e.count:6d}  {e.key[:110]}")


# Where the idle time sits: one more step under the host's profiler too (CPU activity: the CUDA runtime calls and
# the aten operators, on the same clock as the kernels). For each interval with no kernel running, what the host
# was doing meanwhile; then the runtime calls by total time (a synchronising call or an allocation shows here).
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    with record_function("profiled_step"):
        step()
    torch.cuda.synchronize()
    # Then three steps back to back (no synchronisation): the middle one's device time, busy and idle, with the
    # steps before and after it queued (as the bench times them).
    for i in range(3):
        with record_function(f"b2b_step_{i}"):
            step()
    torch.cuda.synchronize()
path = args.trace_json or tempfile.mkstemp(suffix=".json")[1]
prof.export_chrome_trace(path)
trace = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
step_ev = next(e for e in trace if e.get("name") == "profiled_step" and e.get("cat") == "user_annotation")
t0 = step_ev["ts"]
gpu_all = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
marks = {e["name"]: e for e in trace if e.get("cat") == "user_annotation" and e["name"].startswith("b2b_step_")}
# The profiled step's device ops: those before the back-to-back steps (a synchronisation lies between).
gpu = [e for e in gpu_all if "b2b_step_0" not in marks or e["ts"] < marks["b2b_step_0"]["ts"]]
host = [e for e in trace if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op")]
busy = sum(e["dur"] for e in gpu)
print(f"\nhost + device trace of one step: host path {step_ev['dur'] / 1e3:.2f} ms, device ops {len(gpu)} "
      f"({busy / 1e3:.2f} ms busy), first device op {(gpu[0]['ts'] - t0) / 1e3:.3f} ms after the step's start, "
      f"last ends at {(gpu[-1]['ts'] + gpu[-1]['dur'] - t0) / 1e3:.2f} ms")
gaps, last_end = [], t0
for e in gpu:
    if e["ts"] - last_end > args.gap_us:
        gaps.append((last_end, e["ts"], e["name"]))
    last_end = max(last_end, e["ts"] + e["dur"])
print(f"{len(gaps)} idle intervals over {args.gap_us:g} us, {sum(b - a for a, b, _ in gaps) / 1e3:.2f} ms in all "
      f"(from the step's start; ms since the start, length, the device op that ends it, host work meanwhile):")
for a, b, nxt in gaps:
    what = ", ".join(f"{n[:40]} {us:.0f}" for n, us in host_during(host, a, b).most_common(6))
    print(f"  {(a - t0) / 1e3:8.3f} {(b - a):8.1f} us  before {nxt[:40]!r}: {what}")
calls = collections.defaultdict(lambda: [0, 0.0, 0.0])
for e in host:
    if e.get("cat") in ("cuda_runtime", "cuda_driver"):
        c = calls[e["name"]]
        c[0] += 1
        c[1] += e["dur"]
        c[2] = max(c[2], e["dur"])
print(f"{'calls':>6} {'total us':>9} {'max us':>8}  CUDA runtime/driver call")
for name, (count, tot, mx) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:15]:
    print(f"{count:6d} {tot:9.1f} {mx:8.1f}  {name}")

# The middle back-to-back step: its device ops are those launched inside its host range.
mid, after = (ops_of(trace, gpu_all, marks[f"b2b_step_{i}"]) for i in (1, 2)) if len(marks) == 3 else ([], [])
if mid and after:
    g0, g1 = mid[0]["ts"], after[0]["ts"]
    busy_mid = sum(e["dur"] for e in mid)
    mm = sum(e["dur"] for e in mid if "nvjet" in e["name"] or "gemm" in e["name"].lower())
    print(f"\nback to back, the middle of three steps: {(g1 - g0) / 1e3:.2f} ms from its first device op to the next "
          f"step's, {busy_mid / 1e3:.2f} ms busy in {len(mid)} ops ({mm / 1e3:.2f} ms of matrix products), "
          f"{(g1 - g0 - busy_mid) / 1e3:.2f} ms idle")
    if args.ops_us > 0:  # each chunk's products in order: which one a chunk's size slows
        print(f"its device ops over {args.ops_us:g} us, in order (us, name):")
        for e in mid:
            if e["dur"] > args.ops_us:
                print(f"  {e['dur']:9.1f}  {e['name'][:100]}")
