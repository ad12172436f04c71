"""How the way a two-GPU call's ranks are aligned before it changes its measured time (the question behind
tools/bench_vocab_parallel.py --align), under torchrun:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --standalone --nproc-per-node 2 tools/probe_split_alignment.py

The bench's logits problem (bf16 4096 x 128256 split, T = 2, 10% masked), forward KL and the JSD at beta 0.5, the
training step eager and captured in a CUDA graph, each timed as the bench times it (L2 flushed, CUDA events) after
aligning the ranks by: host (a barrier: the hosts wait, so each GPU idles while its host queues the call's first
kernels), stream (a one-float all-reduce on the stream: the GPUs wait, the hosts queue on), stream+sleep (the same
and a ~1.5 ms GPU sleep, so the host is surely ahead when the call starts). Rank 0 prints each mode's median and
20-80% quantiles of the slowest rank's time, rank 0's own median, and the host's time to queue one call.
"""
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vocab_parallel as bench  # noqa: E402  (tools/, the script's own folder)

from kldiv_inline import timing  # noqa: E402

MODES = ("host", "stream", "stream+sleep", "stream", "host")  # each twice (but the sleep): drift shows


def main() -> None:
    gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", device_id=gpu)
    rank, world = dist.get_rank(), dist.get_world_size()
    args = bench.parse(["--forms", "logits"])
    prob = bench.Problem("logits", args, "cuda", rank, world)
    token = torch.zeros(1, device="cuda")
    flush = timing.L2Flush("cuda")

    def timed(step, mode, reps=20, warmup=3):
        def prepare():
            if mode.startswith("stream"):
                dist.all_reduce(token)
                if mode == "stream+sleep":
                    torch.cuda._sleep(3_000_000)
            else:
                dist.barrier()
            return prob.prepare(*prob.parts)

        for _ in range(warmup):
            step(*prepare())
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        host = []
        for start, end in events:
            inputs = prepare()
            flush()
            t0 = time.perf_counter()
            start.record()
            step(*inputs)
            end.record()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        mine = [s.elapsed_time(e) for s, e in events]
        return timing.quantiles(bench.slowest(mine, "cuda")), timing.quantiles(mine), timing.quantiles(host)

    if rank == 0:
        print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)
    for beta in (0.0, 0.5):
        fn = bench.providers(prob, beta, args.temperature, dist.group.WORLD, world)[1][2]
        step = bench.training_step(fn, prob)
        for name, run in (("eager", step), ("graph", bench.captured(step, prob, prob.parts))):
            for mode in MODES:
                slowest, mine, host = timed(run, mode)
                if rank == 0:
                    print(f"beta {beta} {name:5s} {mode:13s} slowest {slowest[0]:.3f} ({slowest[1]:.3f}-"
                          f"{slowest[2]:.3f})  rank 0 {mine[0]:.3f}  host queues a call in {host[0]:.3f} ms",
                          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
