// The rows' statistics exchanged through peer memory, for a vocabulary split across the GPUs of one machine
// (included by distill_fast.cuh, inside distill.cu; not a standalone header). vocab_parallel.py sets it up.
//
// Why: split, each rank must know every row's normalisers over the whole vocabulary before any term or gradient,
// and through torch.distributed that is a collective between two kernels: every rank reads its slices twice
// (once for the normalisers, once for the terms and gradients) and the host queues the kernels and two
// collectives where one device queues one kernel. With the records exchanged through memory that the ranks' GPUs
// map from each other, a kernel can wait for the other ranks' records of a row itself: fast_rows keeps its slice
// of the row in shared memory across the wait (one read of the logits), and a rank whose slices do not fit its
// fast kernel runs phase 0, then peer_norms_kernel (the exchange alone, in place of the collective), then phase 1.
// The rows' terms go the same way (peer_terms_kernel, or the JSD's one-read kernel itself): no collective at all.
//
// The protocol. Every rank holds a buffer of 64-bit words, slots[kPeerStages][2][world][cap][4]; rank j's record
// of row i in call e at stage g goes into slots[g][e & 1][j][i] of every rank's buffer (its own included), each
// float in one 64-bit store with e in its upper half. Stage 0: the (max, log2 sum) pairs of its slice
// (phase_norms_kernel's four floats). Stage 1: its slice's (loss, ks, kt) sums (phase 1's terms). Stage 2, the
// JSD's 16-bit training rows only: the same sums again where the row's JSD came out below kJsdDirectMin (fast_rows
// sums its slice again with the series there; a rank whose slices took the phases, summed with the series
// already, publishes its record again). A reader polls its own buffer until all four words of every rank's record
// carry e: a 64-bit aligned store and load are single-copy atomic, so a word that carries e carries this call's
// value, and no fence orders one word against another. Then every rank combines the same records in rank order
// (combine_norm, as distill_combine does after an all-gather; combine_terms' additions for the sums): the same
// bits on every rank. e is a per-rank counter on the device, bumped by a one-thread kernel before each exchanging
// call (so a replayed CUDA graph counts its calls too); every rank makes the same calls, so the counters agree.
// Two parities: a rank may start call e + 1 while another still reads call e's records, never call e + 2 (a rank
// finishes call e + 1 only once every rank has published its stage-1 records of call e + 1, which each does
// after its work of call e).
//
// Progress: every block publishes its row's record before it waits, and the blocks of a grid start in ascending
// order, so the lowest row resident on either rank always finds the other rank's record published or its block
// resident: some row always completes. That holds between one-read kernels, and between ranks that take the
// phases (peer_norms_kernel's and peer_terms_kernel's threads publish before they wait, rows in the same order),
// and for forward KL's one-read kernel against the phases (it waits for stage 0 only; stage 1 follows in
// peer_terms_kernel). It does not hold for the JSD's one-read kernel, whose rows also wait for stage 1 inside it,
// against a rank that took the phases: that rank's stage-1 records follow its peer_norms_kernel, which needs every
// row's stage-0 record, and the one-read rank's rows beyond the clusters its GPU holds at once publish theirs only
// after the resident rows have finished (measured: two H200s, float32, 33 rows of 64128 | 3001 entries, the last
// two rows never resident). So the JSD's training rows take the one-read kernel on every rank whose slice fits
// on chip, rows off the 16-byte grid copied onto it first (distill_peer_terms); only a slice too wide for a
// cluster's shared memory (over 409600 float32 or 819200 16-bit entries) or KLDIV_DISTILL_FAST=0 on some ranks
// alone still pairs the two forms, and then a call with more rows than fit at once hits the timeout below
// (loudly). But a grid of waiting blocks fills its GPU: a rank whose split kernel waits
// while the other rank's stream waits for some other communication of this rank (queued on another stream, which
// cannot start here) is stuck, as with NCCL's collectives queued in different orders (vocab_parallel.py's
// KLDIV_DISTILL_PEER=0 is the way out). A rank that never publishes (another rank raised before its kernel, or
// called with other rows) would leave the waiting kernel spinning: after kPeerTimeoutNs it prints which rank and
// row it waited for and traps (the CUDA context is lost, so the process fails loudly rather than hanging).

#pragma once

#include "distill_peer_words.cuh"  // (peer_store, peer_load, global_ns: one word of a record)

// Ranks an exchange serves, and records a row and call (distill_peer_alloc sizes the buffers from both).
constexpr int kMaxPeers = 8;
constexpr int kPeerStages = 3;
constexpr unsigned long long kPeerTimeoutNs = 60ull * 1000000000ull;  // a minute, as the tests' collective timeout

struct PeerRows {
  // [world] on the device: rank r's buffer's address as this process maps it (its own at rank). In device memory,
  // not in the kernel's parameters: a parameter array indexed by the lane is copied to the stack first.
  const long long* slots;
  const unsigned* epoch;  // this rank's call counter, on its device
  int world, rank;
  int64_t cap;       // rows a buffer holds
  float* rows_loss;  // the JSD's one-read kernel: the rows' losses over the whole vocabulary [n]
};

// The word index of rank `from`'s record of `row` at `stage` in call e, in any rank's buffer.
__device__ __forceinline__ int64_t peer_slot(const PeerRows& pr, int stage, unsigned e, int from, int64_t row) {
  return (((static_cast<int64_t>(stage) * 2 + (e & 1u)) * pr.world + from) * pr.cap + row) * 4;
}

// This rank's record of `row` into every rank's buffer.
__device__ __forceinline__ void peer_publish(const PeerRows& pr, int stage, unsigned e, int64_t row, float4 rec,
                                             int to) {
  unsigned long long* at = reinterpret_cast<unsigned long long*>(pr.slots[to]) + peer_slot(pr, stage, e, pr.rank, row);
  peer_store(at, rec.x, e);
  peer_store(at + 1, rec.y, e);
  peer_store(at + 2, rec.z, e);
  peer_store(at + 3, rec.w, e);
}

// Out of line, so that the message's code stays out of the waiting loop's kernels.
__device__ __noinline__ void peer_timeout(int rank, int from, int64_t row, int stage, unsigned e) {
  printf(
      "kldiv_inline distill: rank %d waited %llu s for rank %d's statistics of row %lld (stage %d, call %u): a "
      "rank did not make the same call\n",
      rank, kPeerTimeoutNs / 1000000000ull, from, static_cast<long long>(row), stage, e);
  __trap();
}

// Rank `from`'s record of `row` in call e, from this rank's buffer once it has arrived.
__device__ __forceinline__ float4 peer_wait(const PeerRows& pr, int stage, unsigned e, int64_t row, int from) {
  const unsigned long long* at =
      reinterpret_cast<const unsigned long long*>(pr.slots[pr.rank]) + peer_slot(pr, stage, e, from, row);
  unsigned long long w[4];
  const unsigned long long t0 = global_ns();
  for (unsigned spin = 0;; ++spin) {
    bool all = true;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      w[q] = peer_load(at + q);
      all = all && static_cast<unsigned>(w[q] >> 32) == e;
    }
    if (all) break;
    if ((spin & 1023u) == 1023u && global_ns() - t0 > kPeerTimeoutNs) peer_timeout(pr.rank, from, row, stage, e);
  }
  return make_float4(__uint_as_float(static_cast<unsigned>(w[0])), __uint_as_float(static_cast<unsigned>(w[1])),
                     __uint_as_float(static_cast<unsigned>(w[2])), __uint_as_float(static_cast<unsigned>(w[3])));
}

// The whole row's normalisers from the ranks' records recs[0 .. world) (each phase_norms_kernel's four floats), in
// rank order: combine_row_norms' arithmetic, so the same bits as the all-gather route's distill_combine.
__device__ __forceinline__ float4 peer_combine(const float4* recs, int world) {
  float4 out;  // (the records as parts [world, 1, 4]: row 0 of one)
  combine_row_norms(reinterpret_cast<const float*>(recs), 0, 1, world, reinterpret_cast<float*>(&out));
  return out;
}

// The counter of exchanging calls, bumped before each. 0 is skipped (a zeroed buffer's words carry it), by going
// on at 2, so that the parity still alternates from call to call when the counter wraps.
__global__ void peer_bump_kernel(unsigned* epoch) {
  const unsigned e = epoch[0] + 1u;
  epoch[0] = e == 0u ? 2u : e;
}

// The exchange alone, one thread a row, for a rank whose phase 0 wrote its records (local [n, 4]): out [n, 4] the
// rows' normalisers over the whole vocabulary, as distill_combine's. Masked rows exchange nothing (every rank
// masks the same rows) and get phase 0's no-mass record.
__global__ void __launch_bounds__(
    128) peer_norms_kernel(const float4* __restrict__ local, const PeerRows pr,
                                          const int64_t* __restrict__ labels, int64_t ignore_index, int64_t n,
                                          float4* __restrict__ out) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= n) return;
  if (labels && labels[row] == ignore_index) {
    out[row] = make_float4(ninf<float>(), ninf<float>(), ninf<float>(), ninf<float>());
    return;
  }
  const unsigned e = *pr.epoch;
  const float4 mine = local[row];
  for (int j = 0; j < pr.world; ++j) peer_publish(pr, 0, e, row, mine, j);
  float4 recs[kMaxPeers];
  for (int j = 0; j < pr.world; ++j) recs[j] = peer_wait(pr, 0, e, row, j);
  out[row] = peer_combine(recs, pr.world);
}

// The rows' (loss, ks) from the ranks' stage-1 (or 2) records (loss, ks, -, -) of the JSD's one-read kernel:
// combine_terms over them, as distill_combine adds an all-gather's (the same bits on a one-read rank as on a rank
// whose slices took the phases). The third sum is dropped, so the compiler drops its additions.
struct PeerSums {
  __device__ __forceinline__ float4 operator()(const float4* recs, int world) const {
    float loss, ks, kt;
    combine_terms(reinterpret_cast<const float*>(recs), 4, world, loss, ks, kt);
    return make_float4(loss, ks, 0.f, 0.f);
  }
};

// Stage 1, one thread a row, for every rank once its terms [n, 3] (phase 1's, or forward KL's one-read kernel's)
// are written: the rows' losses [n] and (ks, kt) [n, 2] over the whole vocabulary, combined in rank order as
// distill_combine's combine_terms (masked rows: zeros, as there, with nothing exchanged). series_round: stage 2
// where the row's JSD is below kJsdDirectMin (the calls whose other ranks may run the JSD's one-read kernel).
__global__ void __launch_bounds__(
    128) peer_terms_kernel(const float* __restrict__ terms, const PeerRows pr,
                                          const int64_t* __restrict__ labels, int64_t ignore_index, int64_t n,
                                          bool series_round, float* __restrict__ rows_loss, float* __restrict__ ksums) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= n) return;
  if (labels && labels[row] == ignore_index) {
    rows_loss[row] = 0.f;
    ksums[2 * row] = ksums[2 * row + 1] = 0.f;
    return;
  }
  const unsigned e = *pr.epoch;
  const float4 mine = make_float4(terms[3 * row], terms[3 * row + 1], terms[3 * row + 2], 0.f);
  float4 recs[kMaxPeers];
  float loss = 0.f, ks = 0.f, kt = 0.f;
  for (int stage = 1; stage <= 2; ++stage) {
    for (int j = 0; j < pr.world; ++j) peer_publish(pr, stage, e, row, mine, j);
    for (int j = 0; j < pr.world; ++j) recs[j] = peer_wait(pr, stage, e, row, j);
    combine_terms(reinterpret_cast<const float*>(recs), 4, pr.world, loss, ks, kt);
    if (!series_round || loss >= static_cast<float>(kJsdDirectMin)) break;  // as fast_rows decides, on these bits
  }
  rows_loss[row] = loss;
  ksums[2 * row] = ks;
  ksums[2 * row + 1] = kt;
}

struct PeerNorms {
  __device__ __forceinline__ float4 operator()(const float4* recs, int world) const {
    return peer_combine(recs, world);
  }
};

// fast_rows' exchanges (SPLIT): the cluster's record of this slice at `stage` (`mine`, the same in every block)
// published by warp 0 of the cluster's first block, every block's warp 0 waiting for the ranks' records (lane j
// rank j's), lane 0 combining them; the result reaches the block's warps through `recs[kMaxPeers]` and a block
// barrier (the block's barriers between two exchanges keep the later from overwriting `recs` while it is read).
template <typename Combine>
__device__ __forceinline__ float4 peer_exchange_block(const PeerRows& pr, int stage, int64_t row, float4 mine,
                                                      bool publisher, float4 (&recs)[kMaxPeers + 1], Combine combine) {
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const unsigned e = *pr.epoch;
    if (publisher && lane < pr.world) peer_publish(pr, stage, e, row, mine, lane);
    if (lane < pr.world) recs[lane] = peer_wait(pr, stage, e, row, lane);
    __syncwarp();
    if (lane == 0) recs[kMaxPeers] = combine(recs, pr.world);
  }
  __syncthreads();
  return recs[kMaxPeers];
}
