"""The host's side of the vocabulary split on two GPUs, under torchrun:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone --nproc-per-node 2 \\
        tools/probe_split_host.py [--step-only]

(1) three ways to all-gather [4096, 4] float32 over NCCL: the host's time per call back to back, and behind a
25 ms kernel (a call that waited for the device would take ~1.25 ms a call there); and one of them 30 Python
frames deep (PyTorch's NCCL flight recorder gathers the Python stack at every collective unless
TORCH_FR_BUFFER_SIZE=0; run with and without it, two H200s: ~5-10 us a gather, kernels/NOTES.md); (2) the split's
forward (bf16 4096 x 128256 split across the ranks, forward KL, T = 2, 10% masked, the student's gradient), its
phases called from Python as kldiv_inline.vocab_parallel calls them: host time per step, the step back to back
(CUDA events), and behind the long kernel. Rank 0 prints. (At 8a7fe75 it also timed distill_split, the same
sequence in C++ through PyTorch's functional all-gathers, since removed: kernels/NOTES.md, version 15.)
"""
import collections
import sys
import time

import torch
import torch.distributed as dist

import kldiv_inline as K
from kldiv_inline import distill, vocab_parallel

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
group = dist.group.WORLD
F = torch.ops._c10d_functional
SLEEP = int(50e6)  # cycles of torch.cuda._sleep: ~25 ms


def host_us(f, n=200, sleep=0):
    """The host's time per call of f, n back to back, optionally behind a long kernel."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    if sleep:
        torch.cuda._sleep(sleep)
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
STEP_ONLY = "--step-only" in sys.argv[1:]
if rank == 0:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)

# this rank's slice of bf16 4096 x 128256 logits
gen = torch.Generator(device="cuda").manual_seed(rank)
n, v = 4096, 128256 // world
s = (torch.randn(n, v, generator=gen, device="cuda") * 2).bfloat16()
t = (torch.randn(n, v, generator=gen, device="cuda") * 2).bfloat16()
lab = torch.randint(0, 100, (n,), device="cuda")
lab[::10] = -100
mod = distill._module(s.device)

if not STEP_ONLY:
    # (1) the all-gathers
    x = torch.randn(4096, 4, device="cuda")
    out = x.new_empty(world * 4096, 4)
    def nested(depth, f):
        return f() if depth == 0 else nested(depth - 1, f)

    gathers = {
        "dist.all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x),
        "the same, 30 Python frames deep": lambda: nested(30, lambda: dist.all_gather_into_tensor(out, x)),
        "30 Python frames, no gather": lambda: nested(30, lambda: None),
        "functional + wait_tensor": lambda: F.wait_tensor(F.all_gather_into_tensor(x, world, group.group_name)),
        "group._allgather_base().wait()": lambda: group._allgather_base(out, x).wait(),
    }
    for f in gathers.values():
        for _ in range(20):
            f()
    gather_us = {name: (host_us(f), host_us(f, n=20, sleep=SLEEP)) for name, f in gathers.items()}
    torch.cuda.synchronize()
    e0.record()
    torch.cuda._sleep(SLEEP)
    e1.record()
    torch.cuda.synchronize()
    if rank == 0:
        print(f"the long kernel: {e0.elapsed_time(e1):.1f} ms")
        for name, (us, behind) in gather_us.items():
            print(f"{name:32s} host {us:7.1f} us a call; behind the long kernel {behind:9.1f} us a call")

    # (2) the split's forward
    def gather(y):
        o = y.new_empty((world * y.shape[0],) + tuple(y.shape[1:]))
        dist.all_gather_into_tensor(o, y.contiguous())
        return o.view((world,) + tuple(y.shape))

    def from_python():
        scale = mod.distill_reduction_scale(s, lab, -100, 2)
        common = (lab, -100, 0.0, 2.0)
        local = mod.distill_phase(0, s, t, *common, None, None, None, False, False)[0]
        norms = mod.distill_combine(gather(local), 0)[0]
        terms, gs, _ = mod.distill_phase(1, s, t, *common, norms, None, scale, True, False)
        _, loss = mod.distill_combine(gather(terms), 2, scale)
        return loss, gs

    steps = {"phases from Python": from_python}
    for f in steps.values():
        for _ in range(5):
            f()
    step_us = {}
    for name, f in steps.items():
        us = host_us(f, n=20)
        torch.cuda.synchronize()
        dist.barrier()
        e0.record()
        for _ in range(20):
            f()
        e1.record()
        torch.cuda.synchronize()
        step_us[name] = (us, e0.elapsed_time(e1) / 20 * 1e3, host_us(f, n=10, sleep=SLEEP))
    if rank == 0:
        for name, (us, back, behind) in step_us.items():
            print(f"{name:20s} host {us:7.1f} us a step, back to back {back:7.1f} us a step, behind the long kernel "
                  f"{behind:9.1f} us a step")

# (3) the training step, stage by stage: each module function and the all-gather wrapped by a host timer.
spent = collections.Counter()


def timed(name, f):
    def call(*a, **kw):
        t0 = time.perf_counter_ns()
        r = f(*a, **kw)
        spent[name] += time.perf_counter_ns() - t0
        return r
    return call


class Timed:
    """The module with every function timed (what vocab_parallel and distill look up per call)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return timed(name, getattr(self.inner, name))


timed_mod = Timed(mod)
distill._module = lambda device: timed_mod
vocab_parallel._all_gather = timed("all_gather", vocab_parallel._all_gather)
leaf = s.detach().requires_grad_()


def train_step(beta):
    t0 = time.perf_counter_ns()
    loss = K.generalized_jsd(leaf, t, beta=beta, temperature=2.0, labels=lab, group=group)
    t1 = time.perf_counter_ns()
    (g,) = torch.autograd.grad(loss, [leaf])
    spent["autograd.grad"] += time.perf_counter_ns() - t1
    spent["generalized_jsd"] += t1 - t0
    return g


for beta in (0.0, 0.5):
    for sleep in (0, SLEEP):
        for _ in range(5):
            train_step(beta)
        spent.clear()
        reps = 10 if sleep else 50
        us = host_us(lambda b=beta: train_step(b), n=reps, sleep=sleep)
        if rank == 0:
            where = "behind the long kernel" if sleep else "back to back"
            print(f"training step, beta {beta}, {where}: host {us:7.1f} us a step; by stage (us a step): " +
                  ", ".join(f"{k} {v / reps / 1e3:.1f}" for k, v in spent.most_common()), flush=True)
dist.destroy_process_group()
