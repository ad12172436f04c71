"""Per-step host timestamps of the eager vocabulary-split training step, beside its CUDA-event time; under torchrun:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone --nproc-per-node 2 \\
        tools/trace_split_steps.py [--beta 0] [--tokens 4096] [--vocab 128256] [--reps 30]
    torchrun --standalone --nproc-per-node 2 tools/trace_split_steps.py --device cpu --tokens 16 --vocab 64  # smoke

The bench (tools/bench_vocab_parallel.py) times each eager step after a barrier and an L2 flush, on a fresh leaf,
and reports the slower rank's CUDA-event time; that time has varied from ~0.67 to ~0.98 ms for forward KL on two
H200s with the same code, while the step's kernels take ~0.6 ms (kernels/NOTES.md). The step is bound by its
host path, so this records, for every timed step and every rank, on the host's monotonic clock (shared by the
processes of one machine): when the step began (after the barrier), each all-gather's entry and exit
(vocab_parallel's _all_gather, wrapped here), when generalized_jsd returned and when autograd.grad did.
Rank 0 prints one line per step (the slower rank's event time, then per rank: host ms of the step, its start
after the earliest rank's, the first gather's entry, both gathers' host time, the backward's) and a summary of
the steps above and below the median: which stage, on which rank, the slow steps spent their time in.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trace_steps import split_logits  # noqa: E402  (tools/, the script's own folder)

import kldiv_inline as K  # noqa: E402
from kldiv_inline import vocab_parallel  # noqa: E402
from kldiv_inline.timing import L2Flush  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--beta", type=float, default=0.0)
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--vocab", type=int, default=128256)
ap.add_argument("--reps", type=int, default=30)
ap.add_argument("--warmup", type=int, default=3)
args = ap.parse_args()

cuda = args.device == "cuda"
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if cuda:
    torch.cuda.set_device(rank)
s, t, labels, lo, hi = split_logits(args.tokens, args.vocab, rank, world, args.device)
s_part, t_part = s[:, lo:hi].contiguous(), t[:, lo:hi].contiguous()
flush = L2Flush(args.device)

marks: dict[str, float] = {}  # this step's host timestamps (s, perf_counter)
gather = vocab_parallel._all_gather


def traced_gather(x, group):
    i = sum(k.startswith("gather") for k in marks) // 2
    marks[f"gather{i}_in"] = time.perf_counter()
    out = gather(x, group)
    marks[f"gather{i}_out"] = time.perf_counter()
    return out


vocab_parallel._all_gather = traced_gather


def step(leaf):
    marks["enter"] = time.perf_counter()
    loss = K.generalized_jsd(leaf, t_part, beta=args.beta, temperature=2.0, labels=labels, group=dist.group.WORLD)
    marks["forward"] = time.perf_counter()
    grad = torch.autograd.grad(loss, [leaf])[0]
    marks["exit"] = time.perf_counter()
    return loss, grad


records = []  # per timed step: (event ms or None, marks)
for i in range(args.warmup + args.reps):
    leaf = s_part.detach().requires_grad_()
    dist.barrier()
    marks.clear()
    flush()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    step(leaf)
    if cuda:
        end.record()
        torch.cuda.synchronize()
    if i >= args.warmup:
        records.append((start.elapsed_time(end) if cuda else None, dict(marks)))

everyone = [None] * world
dist.all_gather_object(everyone, records)
if rank == 0:
    def ms(a, b):
        return (b - a) * 1e3

    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'} {torch.__version__} world {world} beta {args.beta}")
    print("step  event ms (slower rank)  | per rank: host ms, start after earliest, 1st gather at, gathers, "
          "backward (ms)")
    rows = []
    for i in range(args.reps):
        per = [everyone[r][i] for r in range(world)]
        event = max(e for e, _ in per) if cuda else None
        first = min(m["enter"] for _, m in per)
        cells = []
        for _, m in per:
            gathers = sum(ms(m[f"gather{k}_in"], m[f"gather{k}_out"]) for k in range(2) if f"gather{k}_in" in m)
            cells.append((ms(m["enter"], m["exit"]), ms(first, m["enter"]), ms(m["enter"], m.get("gather0_in",
                          m["enter"])), gathers, ms(m["forward"], m["exit"])))
        rows.append((event, cells))
        text = " | ".join(" ".join(f"{x:6.3f}" for x in c) for c in cells)
        print(f"{i:4d}  {event if event is not None else float('nan'):8.3f}  | {text}")
    # The steps above the median event time against those below: the mean of each stage on each rank.
    key = [e if e is not None else max(c[0] for c in cells) for e, cells in rows]
    med = statistics.median(key)
    for name, slow in (("slow", True), ("fast", False)):
        pick = [(k, cells) for k, (_, cells) in zip(key, rows) if (k > med) == slow]
        if not pick:
            continue
        means = [[statistics.mean(cells[r][j] for _, cells in pick) for j in range(5)] for r in range(world)]
        text = " | ".join(" ".join(f"{x:6.3f}" for x in m) for m in means)
        print(f"{name} ({len(pick)} steps) {statistics.mean(k for k, _ in pick):8.3f}  | {text}")
dist.barrier()
dist.destroy_process_group()
