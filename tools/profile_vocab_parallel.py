"""Where the vocabulary-parallel training step (the logits form of tools/bench_vocab_parallel.py: bf16 4096 x
128256 split across the ranks, T = 2, 10% masked) spends its time, under torchrun:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --standalone --nproc-per-node 2 tools/profile_vocab_parallel.py [--beta 0] [--steps 5] \\
        [--topk K] [--trace DIR]

--topk K: the teacher as its top K log-probabilities (global indices) instead of logits.
Rank 0 prints, for the one-device op (rank 0 alone, the whole rows) and the split one: the step timed with CUDA
events back to back, the host's wall time per step (no synchronisation inside), and from a host + device trace
of --steps steps back to back: the GPU time of each kernel name (per step; a collective's includes its waiting
for the other ranks), the GPU's busy time outside the collectives, and the host's operators and runtime calls by
their own CPU time.
"""
import argparse
import collections
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trace_steps import busy, host_ms_per_step, split_logits  # noqa: E402  (tools/, the script's own folder)

import kldiv_inline as K  # noqa: E402
from kldiv_inline.timing import quantiles, time_cuda  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--beta", type=float, default=0.0)
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--vocab", type=int, default=128256)
ap.add_argument("--topk", type=int, default=0, help="the teacher's top K log-probabilities instead of its logits")
ap.add_argument("--trace", default=None, help="a folder: each rank's chrome trace of the split step goes there")
args = ap.parse_args()

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
n = args.tokens
s, t, labels, lo, hi = split_logits(args.tokens, args.vocab, rank, world)
parts = (s[:, lo:hi].contiguous(), t[:, lo:hi].contiguous())
topk = None
if args.topk:  # a served teacher's top-k: global indices and log-probabilities, the same on every rank
    lp, idx = torch.log_softmax(t.float() / 2.0, dim=-1).topk(args.topk, dim=-1)
    topk = (idx, lp)
    t, parts = None, (parts[0], None)  # (the logits' memory freed)


def stepper(student, teacher, group):
    leaf = student.detach().requires_grad_()
    given = {"teacher_topk": topk} if topk is not None else {"teacher_logits": teacher}

    def step():
        loss = K.generalized_jsd(leaf, beta=args.beta, temperature=2.0, labels=labels, group=group, **given)
        return torch.autograd.grad(loss, [leaf])
    return step


def report(name, step, everyone):
    """Times `step` and traces it; `everyone`: every rank runs it (a collective), else rank 0 alone."""
    if not everyone and rank != 0:
        return
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ms = quantiles(time_cuda(step, [()], reps=15, warmup=3))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    host = host_ms_per_step(step)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    if args.trace and everyone:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.trace) / f"split_rank{rank}.json"))
    if rank != 0:
        return
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_name = collections.defaultdict(float)
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    for e in kernels:
        per_name[e.name] += (e.time_range.end - e.time_range.start) / 1e3 / args.steps
    # A collective's kernel runs from its launch until the other ranks' data arrive: its time is mostly waiting,
    # so the GPU's own work is counted without it.
    work = busy((e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower())
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    print(f"\n== {name}: {ms[0]:.3f} ms a step (q20 {ms[1]:.3f}, q80 {ms[2]:.3f}), host wall {host:.3f} ms a step, "
          f"peak {peak_mib:.0f} MiB above the inputs; "
          f"trace of {args.steps} steps: GPU busy outside collectives {work / 1e3 / args.steps:.3f} ms a step, "
          f"first kernel to last {span / 1e3 / args.steps:.3f} ms a step (collective kernels include their "
          "waiting for the other ranks)", flush=True)
    for k, ms_k in sorted(per_name.items(), key=lambda x: -x[1])[:14]:
        print(f"   {ms_k:8.3f} ms  {k[:100]}", flush=True)
    # Where the host's time goes: the operators and runtime calls by their own (self) CPU time per step, with
    # how many calls a step makes (the split call's host path is what its step follows).
    host_ops = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    print(f"   host: {sum(e.count for e in host_ops) / args.steps:.0f} operator and runtime calls a step; by self "
          "CPU time a step:", flush=True)
    for e in sorted(host_ops, key=lambda e: -e.self_cpu_time_total)[:16]:
        print(f"   {e.self_cpu_time_total / 1e3 / args.steps:8.3f} ms  {e.count / args.steps:5.1f} calls  {e.key[:80]}",
              flush=True)


def bare_gathers():
    """The host's wall time of one bare all-gather of [tokens, 4] float32 (what the split step does twice)."""
    x = torch.randn(n, 4, device="cuda")
    out = x.new_empty(world * n, 4)
    return lambda: dist.all_gather_into_tensor(out, x)


print(torch.cuda.get_device_name(), torch.__version__, f"world {world}, beta {args.beta}", flush=True)
gather = bare_gathers()
for _ in range(5):
    gather()
gather_host = host_ms_per_step(gather, steps=50)
if rank == 0:
    print(f"one bare all-gather of [{n}, 4] float32: host wall {gather_host:.3f} ms", flush=True)
report("one device (rank 0, whole rows)", stepper(s, t, None), everyone=False)
dist.barrier()
report(f"split over {world}", stepper(*parts, dist.group.WORLD), everyone=True)
dist.barrier()
dist.destroy_process_group()
