"""How long one record takes from one GPU to another through the split's peer buffers, without any kernel work
around it: the part of a split kernel's wait that no schedule can remove. Two processes, one GPU each:

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 tools/probe_peer_latency.py

The buffers are the vocabulary split's own (kldiv_inline.vocab_parallel: every rank's, mapped into every rank),
written and read with the protocol's own functions (kernels/distill_peer_words.cuh, included: 64-bit
st.relaxed.sys stores carrying the call's tag in their upper half, ld.relaxed.sys polls). One thread a GPU, ITERS
rounds each, timed by %globaltimer:
  pingpong 1 / 4 words: rank 0 stores, rank 1 polls until it lands and stores back (a round trip; half is the
      latency of one record, 1 word or a whole record of 4 as peer_publish writes it and peer_wait polls it: four
      8-byte stores, four loads issued before any is tested; "2 x 16 B": the record in two 16-byte stores and
      loads instead);
  exchange 4 words: both ranks store their record into the other's buffer and poll for the other's, round after
      round (the split kernel's pattern with no skew between the ranks: one latency a round);
  local 4 words: a rank stores into its own buffer and polls it (what a wait costs with nothing to travel).
A split kernel's wait over these is the skew between the two GPUs' schedules of the same row (kernels/NOTES.md).
Measured on two H200s (commit 8fae943): 0.73-0.74 us one way (1 or 4 words, 8- or 16-byte accesses), 0.79 us a
symmetric exchange, 0.29 us for a rank's own buffer.
"""
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kldiv_inline import load_sources, vocab_parallel  # noqa: E402

ITERS = 20000

KERNELS = Path(__file__).resolve().parent.parent / "kernels"

CUDA_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include "distill_peer_words.cuh"  // peer_store, peer_load, global_ns: the kit's own
// The record in two 16-byte accesses (an alternative the kit does not use).
__device__ __forceinline__ void st_sys2(unsigned long long* at, unsigned long long a, unsigned long long b) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(at), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void ld_sys2(const unsigned long long* at, unsigned long long& a, unsigned long long& b) {
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(at) : "memory");
}
// Polls until every word of the record carries tag i (words 1 or 4, every load issued before any is tested, as
// distill_peer.cuh's peer_wait; VEC: 16-byte loads); false after 2 s.
template <bool VEC>
__device__ __forceinline__ bool wait_tag(const unsigned long long* at, int words, unsigned i, unsigned long long t0) {
  for (unsigned spin = 0;; ++spin) {
    unsigned long long w[4] = {0, 0, 0, 0};
    if (VEC) {
      ld_sys2(at, w[0], w[1]);
      ld_sys2(at + 2, w[2], w[3]);
    } else if (words == 1) {
      w[0] = peer_load(at);
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) w[q] = peer_load(at + q);
    }
    bool all = true;
#pragma unroll
    for (int q = 0; q < 4; ++q) all = all && (q >= words || static_cast<unsigned>(w[q] >> 32) == i);
    if (all) return true;
    if ((spin & 1023u) == 1023u && global_ns() - t0 > 2000000000ull) return false;
  }
}
template <bool VEC>
__device__ __forceinline__ void put(unsigned long long* at, int words, unsigned i) {
  const unsigned long long tag = static_cast<unsigned long long>(i) << 32;
  if (VEC) {
    st_sys2(at, tag | 0, tag | 1);
    st_sys2(at + 2, tag | 2, tag | 3);
  } else {
    for (int q = 0; q < words; ++q) peer_store(at + q, 0.f, i);  // (tag i in the upper half)
  }
}
// kind 0: pingpong (rank 0 starts), 1: exchange (both store, then both poll), 2: local (own buffer).
template <bool VEC>
__global__ void probe_kernel(unsigned long long* mine, unsigned long long* peer, int rank, int kind, int words,
                             int iters, long long* out) {
  const unsigned long long t0 = global_ns();
  bool ok = true;
  for (int r = 1; r <= iters && ok; ++r) {
    const unsigned i = static_cast<unsigned>(r);
    // Two slots by the round's parity, as the kit's records alternate by the call's: a rank one round ahead
    // must not overwrite a record the other has yet to read.
    unsigned long long* mine_r = mine + (r & 1) * 8;
    unsigned long long* peer_r = peer + (r & 1) * 8;
    if (kind == 0) {
      if (rank == 0) { put<VEC>(peer_r, words, i); ok = wait_tag<VEC>(mine_r, words, i, t0); }
      else { ok = wait_tag<VEC>(mine_r, words, i, t0); put<VEC>(peer_r, words, i); }
    } else if (kind == 1) {
      put<VEC>(peer_r, words, i);
      ok = wait_tag<VEC>(mine_r, words, i, t0);
    } else {
      put<VEC>(mine_r, words, i);
      ok = wait_tag<VEC>(mine_r, words, i, t0);
    }
  }
  out[0] = ok ? static_cast<long long>(global_ns() - t0) : -1;
}
// words 1, 4, or -4 for 4 in two 16-byte stores and loads.
torch::Tensor probe(int64_t mine, int64_t peer, int64_t rank, int64_t kind, int64_t words, int64_t iters) {
  auto out = torch::zeros({1}, torch::dtype(torch::kInt64).device(torch::kCUDA));
  auto k = words < 0 ? probe_kernel<true> : probe_kernel<false>;
  k<<<1, 1>>>(reinterpret_cast<unsigned long long*>(mine), reinterpret_cast<unsigned long long*>(peer),
                         static_cast<int>(rank), static_cast<int>(kind), static_cast<int>(words < 0 ? -words : words),
                         static_cast<int>(iters), reinterpret_cast<long long*>(out.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
"""
CPP_SRC = """#include <torch/extension.h>
torch::Tensor probe(int64_t mine, int64_t peer, int64_t rank, int64_t kind, int64_t words, int64_t iters);
"""


def build():
    """The probe through the kit's loader (its compiler set-up and cache), from files written for it."""
    folder = Path(tempfile.mkdtemp(prefix="probe_peer_latency_"))
    (folder / "probe_peer_latency.cu").write_text(CUDA_SRC)
    (folder / "probe_peer_latency.cpp").write_text(CPP_SRC)
    return load_sources([folder / "probe_peer_latency.cu", folder / "probe_peer_latency.cpp"], functions=["probe"],
                        include_dirs=[KERNELS])


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == 2, "two ranks: one GPU each"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    device = torch.device("cuda", rank)
    key = ("probe", id(group), str(device))
    peers = vocab_parallel._setup_peers(key, device, group, 4096)
    if peers is None:
        raise SystemExit("the two GPUs cannot map each other's memory: no peer route to probe")
    addresses = peers.slots.tolist()
    mod = build()
    rows = []
    # Each case its own words of the buffers (tags restart at 1 in every case): 64 words apart.
    cases = [(0, 1), (0, 4), (0, -4), (1, 4), (1, -4), (2, 4), (2, -4)]
    for case, (kind, words) in enumerate(cases):  # each case its own words of the buffers (tags restart at 1)
        base = case * 64 * 8
        dist.barrier()
        torch.cuda.synchronize()
        out = mod.probe(addresses[rank] + base, addresses[1 - rank] + base, rank, kind, words, ITERS)
        ns = int(out.item())
        name = ["pingpong", "exchange", "local"][kind]
        per = ns / ITERS / (2 if kind == 0 else 1) / 1e3 if ns >= 0 else float("nan")
        shape = "1 word" if words == 1 else "4 words" if words == 4 else "4 words, 2 x 16 B"
        rows.append((f"{name} {shape}", per))
    if rank == 0:
        print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, f"{ITERS} rounds")
        for name, us in rows:
            print(f"{name:28s} {us:.3f} us" + (" (half the round trip)" if name.startswith("pingpong") else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
