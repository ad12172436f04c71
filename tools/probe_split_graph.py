"""The vocabulary-parallel training step captured in a CUDA graph, under torchrun:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone --nproc-per-node 2 \\
        tools/probe_split_graph.py [--betas 0,0.5] [--tokens 4096] [--vocab 128256]

Eager, the split step (generalized_jsd(group=...) and autograd.grad over bf16 logits split across the ranks, T = 2,
10% masked) is bound by the host's path through it (tools/probe_split_host.py): ~0.65-0.95 ms of host time a step
against ~0.6 ms of kernels on two H200s. A training loop that captures its step in a CUDA graph (as Megatron-LM
and others can) replays the kernels and collectives with no host work. This checks that the split step can be
captured (its kernels and NCCL all-gathers, no host synchronisation, allocations from the graph's pool) and gives
the same loss and gradient as eager (bit for bit: the kernels are deterministic), then times, with CUDA events on
each rank (the slower rank's reported): eager and the graph's replays back to back, and each after a barrier and
an L2 flush (the bench's way, tools/bench_vocab_parallel.py); eager after a barrier and a flush on a fresh leaf
each step, as the bench gives it (its eager steps measured slower than this probe's on one machine: 0.98 against
0.67 ms, kernels/NOTES.md); and the one-device op on rank 0 back to back, the ratio's denominator. Rank 0 prints.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_vocab_parallel import slowest  # noqa: E402  (tools/, the script's own folder)
from trace_steps import split_logits  # noqa: E402

import kldiv_inline as K  # noqa: E402
from kldiv_inline.timing import L2Flush, capture, quantiles, time_cuda  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--betas", default="0,0.5")
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--vocab", type=int, default=128256)
ap.add_argument("--reps", type=int, default=20)
args = ap.parse_args()

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
group = dist.group.WORLD
s, t, labels, lo, hi = split_logits(args.tokens, args.vocab, rank, world)
s_part, t_part = s[:, lo:hi].contiguous(), t[:, lo:hi].contiguous()
flush = L2Flush("cuda")


def fresh_leaf_step(teacher, beta, grp):
    """The eager step on a leaf given each call, as the bench gives it (tools/bench_vocab_parallel.py's prepare):
    a new gradient-accumulation node every step, where stepper's steps share one."""
    def step(leaf):
        loss = K.generalized_jsd(leaf, teacher, beta=beta, temperature=2.0, labels=labels, group=grp)
        return loss, torch.autograd.grad(loss, [leaf])[0]
    return step


def stepper(student, teacher, beta, grp):
    """The same step on one leaf of ``student``, made once (what a capture needs: static inputs)."""
    leaf, step = student.detach().requires_grad_(), fresh_leaf_step(teacher, beta, grp)
    return lambda: step(leaf)


def timed(fn, aligned, leaf_of=None):
    """Per-call ms (the slower rank's): back to back, or each after a barrier and an L2 flush; with ``leaf_of``,
    fn takes a fresh leaf of that tensor each call (made outside the timed region)."""
    def prepare():
        if aligned:
            dist.barrier()
        return () if leaf_of is None else (leaf_of.detach().requires_grad_(),)
    times = time_cuda(fn, [()], args.reps, 3, flush=flush if aligned else None, prepare=prepare)
    return quantiles(slowest(times, "cuda"))


if rank == 0:
    print(torch.cuda.get_device_name(), torch.__version__, f"world {world}", flush=True)
rows = []
for beta in (float(b) for b in args.betas.split(",")):
    # Captured before any eager step: at 71d7888 this tool kept an eager step's loss (made on the default stream)
    # alive through the capture, whose autograd.grad then handed the leaf's gradient to that step's
    # gradient-accumulation node, made on the default stream: cudaErrorStreamCaptureImplicit (timing.capture says
    # more). The eager step below comes after the capture.
    step = stepper(s_part, t_part, beta, group)
    graph, (loss, g) = capture(step)
    graph.replay()
    eager_loss, eager_g = step()
    torch.cuda.synchronize()
    same = torch.equal(loss, eager_loss) and torch.equal(g, eager_g)
    agree = torch.tensor([float(same)], device="cuda")
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    one = None
    if rank == 0:
        one = quantiles(time_cuda(stepper(s, t, beta, None), [()], args.reps, 3))
    dist.barrier()
    rows.append((beta, bool(agree.item()), one, timed(step, False), timed(graph.replay, False), timed(step, True),
                 timed(graph.replay, True), timed(fresh_leaf_step(t_part, beta, group), True, leaf_of=s_part)))
    del graph
if rank == 0:
    print("beta  graph==eager  one GPU   eager b2b  graph b2b  eager aligned  graph aligned  eager aligned, fresh "
          "leaves   (ms, median [q20-q80]; ratios to one GPU)")
    for beta, same, one, *ts in rows:
        cells = "  ".join(f"{m:.3f} [{a:.3f}-{b:.3f}] {m / one[0]:.3f}x" for m, a, b in ts)
        print(f"{beta:4.2f}  {str(same):12s}  {one[0]:.3f}  {cells}", flush=True)
dist.barrier()
dist.destroy_process_group()
