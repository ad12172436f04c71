"""Whether the top-k teacher's eager check, which waits for the preparation kernel right after the main kernel's
launch, is what leaves the training step following the host (the bench's D4 case: bf16 4096 x 128256, k = 100,
T = 2, 10% masked). The preparation kernel queues behind the previous step's work, so the wait keeps the host at
most one step ahead, and everything the host does after it (backward's autograd engine, the next step's front end)
must fit in one main kernel's time. Three ways of checking, each timed the bench's way (CUDA events around back
to back calls, a fresh student leaf each), in alternating rounds so that the host's slow and fast spells fall on
all of them:

  at-call      the kit as it is: check() in generalized_jsd, once its kernel is queued
  in-backward  check() at the end of the backward (after its launches): the wait moves past the engine's start
  none         no check (the bound: the step with no wait at all; never a way to run the kit)

Also the host's wall time per step (back to back, to the last launch's return). One GPU:
    python tools/probe_topk_check_wait.py [--rounds 6] [--reps 50]
"""
import argparse
import time

import torch

from kldiv_inline import bench_distill
from kldiv_inline import distill as D
from kldiv_inline.timing import quantiles, time_cuda

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--reps", type=int, default=50)
args = ap.parse_args()

_orig_topk_check = D._topk_check
_orig_backward = D._EagerForward.backward
_pending: list = []
MODE = {"now": "at-call"}


def _topk_check(*a, **k):
    check = _orig_topk_check(*a, **k)
    if MODE["now"] == "at-call":
        return check
    if MODE["now"] == "none":
        return D._no_check
    return lambda: _pending.append(check)


def _backward(ctx, grad_out):
    grads = _orig_backward(ctx, grad_out)
    while _pending:
        _pending.pop()()
    return grads


D._topk_check = _topk_check
D._EagerForward.backward = staticmethod(_backward)

print(torch.cuda.get_device_name(), torch.__version__, flush=True)
s, _, y, idx, lp = bench_distill.make_inputs(*bench_distill.sizes("cuda"), "cuda", seed=0)
step = bench_distill.topk_providers(0.0)[bench_distill.OURS]
fresh = bench_distill._fresh_student


def host_ms(reps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step(*fresh(s, idx, lp, y))
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t * 1e3 / reps


modes = ("at-call", "in-backward", "none")
rows = {m: [] for m in modes}
for r in range(args.rounds):
    for m in modes:
        MODE["now"] = m
        times = time_cuda(step, [(s, idx, lp, y)], reps=args.reps, warmup=3, prepare=fresh)
        med, q20, q80 = quantiles(times)
        h = host_ms(20)
        rows[m].append((med, q20, q80, h))
        print(f"round {r} {m:12s} median {med:.3f} q20 {q20:.3f} q80 {q80:.3f} ms; host {h:.3f} ms a step",
              flush=True)
assert not _pending
print("\n| check | median of round medians (ms) | best round | worst round | host ms a step (median) |")
print("| --- | --- | --- | --- | --- |")
for m in modes:
    meds = sorted(x[0] for x in rows[m])
    hosts = sorted(x[3] for x in rows[m])
    print(f"| {m} | {meds[len(meds) // 2]:.3f} | {meds[0]:.3f} | {meds[-1]:.3f} | {hosts[len(hosts) // 2]:.3f} |")
