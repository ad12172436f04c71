// Divergences of logits for distillation on CUDA (the math: distill_common.h; the contract: distill_bindings.cpp).
//
// One row (a token's logits over the vocabulary, 128k-256k entries) per thread-block cluster. Each block of the
// cluster copies its slice of the student's (and teacher's) row into shared memory once, so the row is read from
// device memory exactly once however many passes the math needs:
//   1. the normalisers of both rows: each block's max and sum of exponentials, combined across the cluster through
//      distributed shared memory (every block combines all blocks' values in the same order: identical results);
//   2. the divergence terms (and the gradients that need no row sum: forward KL's p_s - p_t), cluster-summed;
//   3. the remaining gradients (reverse KL and JSD need the row's K = sum p u first).
// The gradients are streamed out (evict-first stores); the loss per row is reduced over rows by a second,
// single-block kernel in a fixed order. No atomics on values, no host synchronisation: deterministic, and
// capturable in a CUDA graph. Rows too long for shared memory read their slices from device memory in each pass
// instead (the cluster keeps its working set small, so the later passes mostly hit L2).
//
// The same kernel runs one phase at a time for a vocabulary split across processes (distill_phase): the caller
// combines the rows' statistics across ranks between the phases.
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "distill_api.h"
#include "distill_common.h"
#include "distill_plan.h"
#include "scale_span.cuh"

namespace cg = cooperative_groups;

namespace distill {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kWarps = kMaxThreads / 32;
constexpr int kSliceAlign = 16;  // entries: a slice starts on a 16-byte boundary for every dtype
// Shared memory for a row's slices: 32 KB blocks (clusters of 16 for a 128k bf16 vocabulary) ran fastest on an
// H200 (1.53 ms against 1.68 ms with 64 KB blocks, kernels/NOTES.md); else as much as a block may have.
constexpr size_t kSmemTarget = 40 * 1024;
constexpr size_t kSmemMax = 200 * 1024;

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

template <typename T> struct alignas(16) Vec {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T, typename A> struct Params {
  const T* s;
  const T* t;  // null for a top-k teacher
  int64_t s_stride, t_stride;
  const int64_t* idx;  // top-k: [n, k]
  const A* lp;
  int64_t k;
  const int64_t* labels;  // null: no mask
  int64_t ignore_index;
  int64_t n, v, slice;  // slice: entries per block (a multiple of kSliceAlign)
  A k2;                 // log2(e) / T: logits to base-2 exponents
  A inv_t;              // 1 / T: the gradients' factor
  RowConst<A> c;
  T* gs;  // student gradient rows (stride gs_stride), null if not written by this launch
  int64_t gs_stride;
  T* gt;                    // teacher gradient, contiguous [n, v], null if not written
  const double* scale_dev;  // 1 / unmasked rows, computed on the device (batchmean); null: scale_host
  double scale_host;
  int phase;          // -1: all phases (one device); else PHASE_NORMS / PHASE_TERMS / PHASE_GRAD
  const A* norms_in;  // [n, 4], phases after PHASE_NORMS
  const A* k_in;      // [n, 2], PHASE_GRAD
  A* out;             // -1: loss per row [n]; PHASE_NORMS: [n, 4]; PHASE_TERMS: [n, 3]
  bool staged;        // the fast kernels: the copy in four groups, each thread's maximum taken as they land

  // The loss's scale before the 1 / T of the gradients: batchmean's from the device, else the host's.
  __device__ __forceinline__ double base_scale() const { return scale_dev ? *scale_dev : scale_host; }
};

// ------------------------------------------------------------------------------------------ reductions
// A butterfly over each group of WIDTH lanes (WIDTH a power of two <= 32): every lane of a group ends with its
// group's combination, the same bits in each (op symmetric in its arguments). Records of several values (float2,
// float4) are shuffled member by member. warp_sum and warp_max are two, cluster_fold's (distill_fast.cuh) others.
template <typename A> __device__ __forceinline__ A shfl_xor(A v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ float2 shfl_xor(float2 v, int o) { return make_float2(shfl_xor(v.x, o), shfl_xor(v.y, o)); }
__device__ __forceinline__ float4 shfl_xor(float4 v, int o) {
  return make_float4(shfl_xor(v.x, o), shfl_xor(v.y, o), shfl_xor(v.z, o), shfl_xor(v.w, o));
}
template <int WIDTH, typename R, typename Op> __device__ __forceinline__ R warp_fold(R r, Op op) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) r = op(r, shfl_xor(r, o));
  return r;
}
template <typename A> __device__ __forceinline__ A warp_sum(A v) {
  return warp_fold<32>(v, [](A a, A b) { return a + b; });
}
template <typename A> __device__ __forceinline__ A warp_max(A v) {
  return warp_fold<32>(v, [](A a, A b) { return fmax(a, b); });
}

// NV sums over the block, returned to every thread. Fixed order: deterministic. `scratch` holds kWarps * NV.
template <int NV, typename A> __device__ __forceinline__ void block_sum(A (&v)[NV], A* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = warp_sum(v[i]);
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < NV; ++i) scratch[warp * NV + i] = v[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = warp_sum(lane < warps ? scratch[lane * NV + i] : A(0));
  __syncthreads();  // scratch is reused by the next reduction
}

template <int NV, typename A> __device__ __forceinline__ void block_max(A (&v)[NV], A* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = warp_max(v[i]);
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < NV; ++i) scratch[warp * NV + i] = v[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = warp_max(lane < warps ? scratch[lane * NV + i] : ninf<A>());
  __syncthreads();
}

// Cross-block reductions of a cluster. Each block publishes its values in `slot` (its shared memory; one slot
// per reduction and launch: blocks read each other's slots after the barrier, and keep their shared memory until
// the final barrier before they exit). Lane r of warp 0 reads rank r's values, and every block combines them in
// the same fixed order, so all blocks of the cluster hold identical results.
template <int NV, typename A>
__device__ __forceinline__ void cluster_sum(cg::cluster_group& cluster, A (&v)[NV], A* slot, A* bcast) {
  if (threadIdx.x == 0)
#pragma unroll
    for (int i = 0; i < NV; ++i) slot[i] = v[i];
  cluster.sync();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const bool mine = lane < static_cast<int>(cluster.num_blocks());
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const A x = warp_sum(mine ? *cluster.map_shared_rank(slot + i, lane) : A(0));
      if (lane == 0) bcast[i] = x;
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = bcast[i];
}

// The rows' normalisers over the cluster from each block's (max, sum of 2^(x - max)) of two rows: the cluster's
// max, and log2 of the blocks' sums rescaled to it.
template <typename A>
__device__ __forceinline__ void cluster_norms(cg::cluster_group& cluster, const A (&mx)[2], const A (&sm)[2], A* slot,
                                              A* bcast, Norm<A> (&norm)[2]) {
  if (threadIdx.x == 0) {
    slot[0] = mx[0];
    slot[1] = sm[0];
    slot[2] = mx[1];
    slot[3] = sm[1];
  }
  cluster.sync();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const bool mine = lane < static_cast<int>(cluster.num_blocks());
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const A m = mine ? *cluster.map_shared_rank(slot + 2 * w, lane) : ninf<A>();
      const A s = mine ? *cluster.map_shared_rank(slot + 2 * w + 1, lane) : A(0);
      const A g = warp_max(m);
      const A z = warp_sum(g == ninf<A>() || s == A(0) ? A(0) : s * d_exp2(m - g));
      if (lane == 0) {
        bcast[2 * w] = g;
        bcast[2 * w + 1] = d_log2(z);
      }
    }
  }
  __syncthreads();
  norm[0] = Norm<A>{bcast[0], bcast[1]};
  norm[1] = Norm<A>{bcast[2], bcast[3]};
}

// --------------------------------------------------------------------------------------- slices of a row
// Loads Vec<T>::N entries: one 16-byte load where `vec`, else one by one.
template <typename T> __device__ __forceinline__ Vec<T> load_chunk(const T* p, bool vec) {
  if (vec) return *reinterpret_cast<const Vec<T>*>(p);
  Vec<T> out;
#pragma unroll
  for (int q = 0; q < Vec<T>::N; ++q) out.v[q] = p[q];
  return out;
}

// Stores a chunk of gradients: one 16-byte streaming (evict-first) store where `vec`, else one by one.
template <typename T> __device__ __forceinline__ void store_chunk(T* dst, const Vec<T>& g, bool vec) {
  if (vec) {
    __stcs(reinterpret_cast<uint4*>(dst), *reinterpret_cast<const uint4*>(&g));
  } else {
#pragma unroll
    for (int q = 0; q < Vec<T>::N; ++q) dst[q] = g.v[q];
  }
}

__host__ __device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
// The entries from x to the next 16-byte boundary (0 on it): a row's head, before its first whole chunk.
template <typename T> __host__ __device__ __forceinline__ int row_head(const T* x) {
  return static_cast<int>(((16u - (reinterpret_cast<uintptr_t>(x) & 15u)) & 15u) / sizeof(T));
}

// The largest of a chunk's raw values (packed max for 16-bit types: half the instructions).
template <typename T> __device__ __forceinline__ float chunk_max(const Vec<T>& v) {
  float m = static_cast<float>(v.v[0]);
#pragma unroll
  for (int q = 1; q < Vec<T>::N; ++q) m = fmaxf(m, static_cast<float>(v.v[q]));
  return m;
}
__device__ __forceinline__ double chunk_max(const Vec<double>& v) { return fmax(v.v[0], v.v[1]); }

// Entry q of a chunk as a float (q a compile-time constant after unrolling). bfloat16 is a float's top half: the
// 32-bit word holding entries q and q + 1 gives each in one instruction, the low one shifted up and the high one
// masked, where the element-wise conversion took two for the high one (extract, then shift; SASS of sm_90).
template <typename T> __device__ __forceinline__ float entry_float(const Vec<T>& v, int q) {
  return static_cast<float>(v.v[q]);
}
__device__ __forceinline__ float entry_float(const Vec<c10::BFloat16>& v, int q) {
  const uint32_t w = reinterpret_cast<const uint32_t*>(&v)[q >> 1];
  return __uint_as_float((q & 1) ? (w & 0xffff0000u) : (w << 16));
}
__device__ __forceinline__ float chunk_max(const Vec<c10::BFloat16>& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  const __nv_bfloat162 m = __hmax2(__hmax2(h[0], h[1]), __hmax2(h[2], h[3]));
  return fmaxf(__low2float(m), __high2float(m));
}
__device__ __forceinline__ float chunk_max(const Vec<c10::Half>& v) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
  const __half2 m = __hmax2(__hmax2(h[0], h[1]), __hmax2(h[2], h[3]));
  return fmaxf(__low2float(m), __high2float(m));
}

// Copies `count` entries from device memory into shared memory (16-byte asynchronous copies where aligned).
template <typename T> __device__ __forceinline__ void copy_slice(T* dst, const T* src, int64_t count) {
  constexpr int N = Vec<T>::N;
  if (aligned16(src)) {
    const int64_t chunks = count / N;
    const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(base + static_cast<unsigned>(c * 16)),
                   "l"(src + c * N));
    for (int64_t j = chunks * N + threadIdx.x; j < count; j += blockDim.x) dst[j] = src[j];
  } else {
    for (int64_t j = threadIdx.x; j < count; j += blockDim.x) dst[j] = src[j];
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// ------------------------------------------------------------------------------------------- the kernel
// What a launch computes, fixed at compile time for the hot cases so that their loops carry nothing else.
enum Cfg : int {
  CFG_INFER = 0,    // the loss only (one device)
  CFG_STUDENT = 1,  // the loss and the student's gradient (one device): training
  CFG_GENERIC = 2,  // anything, by run-time flags: teacher gradients, vocabulary-parallel phases
};

// One row per cluster (see the top of this file). SMEM: the row's slices sit in shared memory (else each pass
// reads device memory). A masked row writes zeros and skips every barrier (its whole cluster agrees).
template <typename T, int MODE, bool TOPK, bool SMEM, int CFG>
__global__ void __launch_bounds__(kMaxThreads) rows_kernel(const Params<T, typename AccOf<T>::type> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // thread-block clusters need sm_90; the host refuses older GPUs before launching
#else
  using A = typename AccOf<T>::type;
  constexpr int N = Vec<T>::N;
  constexpr bool TWO = !TOPK;  // a teacher row beside the student's
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A scratch[kWarps * 4];
  __shared__ A slot_norms[4], slot_terms[4], bcast[4];

  cg::cluster_group cluster = cg::this_cluster();
  const int64_t ranks = cluster.num_blocks();
  const int64_t rank = cluster.block_rank();
  const int64_t row = blockIdx.x / ranks;
  const int64_t lo = rank * p.slice;
  const int64_t count = max64(0, min64(p.v - lo, p.slice));
  const T* gsrc = p.s + row * p.s_stride + lo;
  const T* gtsrc = TWO ? p.t + row * p.t_stride + lo : nullptr;
  // Which gradients this launch writes (constants for the compile-time configurations).
  T* gs = CFG == CFG_INFER ? nullptr : (p.gs ? p.gs + row * p.gs_stride + lo : nullptr);
  T* gt = CFG == CFG_GENERIC && p.gt ? p.gt + row * p.v + lo : nullptr;
  const bool w_gs = CFG == CFG_STUDENT || (CFG == CFG_GENERIC && gs != nullptr);
  const bool w_gt = CFG == CFG_GENERIC && gt != nullptr;
  const bool writes_out = rank == 0 && p.out != nullptr;

  if (p.labels && p.labels[row] == p.ignore_index) {  // masked: zeros, and no barrier (the cluster agrees)
    const Vec<T> zero{};
    for (int64_t j0 = threadIdx.x * N; j0 < count; j0 += blockDim.x * N) {
      const bool whole = j0 + N <= count;
#pragma unroll
      for (int q = 0; q < N; ++q) {
        if (w_gs && (whole || j0 + q < count)) gs[j0 + q] = zero.v[q];
        if (w_gt && (whole || j0 + q < count)) gt[j0 + q] = zero.v[q];
      }
    }
    if (writes_out && threadIdx.x == 0) {
      if (p.phase == -1) p.out[row] = A(0);
      else if (p.phase == PHASE_NORMS)
        p.out[4 * row] = p.out[4 * row + 1] = p.out[4 * row + 2] = p.out[4 * row + 3] = ninf<A>();
      else if (p.phase == PHASE_TERMS) p.out[3 * row] = p.out[3 * row + 1] = p.out[3 * row + 2] = A(0);
    }
    return;
  }

  const T* xs = gsrc;
  const T* xt = gtsrc;
  if constexpr (SMEM) {
    T* sm_s = reinterpret_cast<T*>(smem_raw);
    copy_slice(sm_s, gsrc, count);
    xs = sm_s;
    if (TWO) {
      copy_slice(sm_s + p.slice, gtsrc, count);
      xt = sm_s + p.slice;
    }
    asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();
  }
  // Whole chunks of N entries, then the tail one by one. Shared-memory slices start 16-byte aligned.
  const int64_t chunks = count / N;
  const bool vec = SMEM || (aligned16(xs) && (!TWO || aligned16(xt)));
  const bool gs_vec = gs && aligned16(gs), gt_vec = gt && aligned16(gt);
  const A k2 = p.k2;

  // ---- 1. the normalisers of both rows
  Norm<A> norm[2];
  if (p.phase == -1 || p.phase == PHASE_NORMS) {
    A mx[2] = {ninf<A>(), ninf<A>()};
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      mx[0] = fmax(mx[0], static_cast<A>(chunk_max(load_chunk(xs + c * N, vec))));
      if (TWO) mx[1] = fmax(mx[1], static_cast<A>(chunk_max(load_chunk(xt + c * N, vec))));
    }
    for (int64_t j = chunks * N + threadIdx.x; j < count; j += blockDim.x) {
      mx[0] = fmax(mx[0], static_cast<A>(xs[j]));
      if (TWO) mx[1] = fmax(mx[1], static_cast<A>(xt[j]));
    }
    block_max<2>(mx, scratch);
    mx[0] = scaled_max(mx[0], k2);  // k2 > 0: the max of the scaled logits
    mx[1] = scaled_max(mx[1], k2);
    A sm[2] = {A(0), A(0)};
    const A m0 = mx[0] == ninf<A>() ? A(0) : mx[0], m1 = mx[1] == ninf<A>() ? A(0) : mx[1];
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const Vec<T> vs = load_chunk(xs + c * N, vec);
#pragma unroll
      for (int q = 0; q < N; ++q) sm[0] += d_exp2(static_cast<A>(vs.v[q]) * k2 - m0);
      if (TWO) {
        const Vec<T> vt = load_chunk(xt + c * N, vec);
#pragma unroll
        for (int q = 0; q < N; ++q) sm[1] += d_exp2(static_cast<A>(vt.v[q]) * k2 - m1);
      }
    }
    for (int64_t j = chunks * N + threadIdx.x; j < count; j += blockDim.x) {
      sm[0] += d_exp2(static_cast<A>(xs[j]) * k2 - m0);
      if (TWO) sm[1] += d_exp2(static_cast<A>(xt[j]) * k2 - m1);
    }
    block_sum<2>(sm, scratch);
    sm[0] = part_sum(sm[0], m0);  // (a block of padding beyond the lanes' range: a stand-in)
    sm[1] = part_sum(sm[1], m1);
    cluster_norms(cluster, mx, sm, slot_norms, bcast, norm);
    if (p.phase == PHASE_NORMS) {
      if (writes_out && threadIdx.x == 0) {
        p.out[4 * row] = norm[0].mx;
        p.out[4 * row + 1] = norm[0].lz;
        p.out[4 * row + 2] = norm[1].mx;
        p.out[4 * row + 3] = norm[1].lz;
      }
      cluster.sync();  // no block leaves while another may still read its slots
      // (a slice's normalisers: combine_row_norms applies usable() to the ranks' combination)
      return;
    }
    norm[0] = usable(norm[0]);  // the whole row's: NaN beyond the lanes' range
    norm[1] = usable(norm[1]);
  } else {
    const A* nr = p.norms_in + 4 * row;  // the ranks' combination (combine_row_norms: already usable())
    norm[0] = Norm<A>{nr[0], nr[1]};
    norm[1] = Norm<A>{nr[2], nr[3]};
  }
  const A scale = static_cast<A>(p.base_scale() * static_cast<double>(p.inv_t));

  if constexpr (TOPK) {
    // ---- 2'. a top-k teacher: buckets are the k tokens and the tail (see distill_cpu.cpp's row_topk).
    const int64_t words = (p.slice + 31) / 32;
    unsigned* bits = reinterpret_cast<unsigned*>(smem_raw + (SMEM ? p.slice * sizeof(T) : 0));
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0u;
    __syncthreads();
    const int64_t* idx = p.idx + row * p.k;
    const A* lp = p.lp + row * (p.k + 1);  // (the prepared row: the tail's mass at lp[k])
    auto log2_ps = [&](T x) { return log2_prob(static_cast<A>(x), k2, norm[0]); };
    A bad = A(0);
    for (int64_t j = threadIdx.x; j < p.k; j += blockDim.x) {
      const int64_t x = idx[j];
      if (x < 0 || x >= p.v) {
        bad = A(1);
      } else if (x >= lo && x < lo + count) {
        const unsigned bit = 1u << ((x - lo) & 31);
        if (atomicOr(&bits[(x - lo) >> 5], bit) & bit) bad = A(1);  // a duplicate
      }
    }
    __syncthreads();
    // Terms of this block's members and its part of the student's tail mass.
    Terms<A> acc{A(0), A(0), A(0)};
    for (int64_t j = threadIdx.x; j < p.k; j += blockDim.x) {
      const int64_t x = idx[j];
      if (x >= lo && x < lo + count) {
        const A ls2 = log2_ps(xs[x - lo]);
        point_terms<MODE, true, false>(bucket_point(d_exp2(ls2), ls2 * A(kLn2), d_exp(lp[j]), lp[j]), p.c, acc);
      }
    }
    A v[4] = {acc.loss, acc.ks, A(0), bad};  // loss, ks, p_tail, bad
    for (int64_t j = threadIdx.x; j < count; j += blockDim.x)
      if (!((bits[j >> 5] >> (j & 31)) & 1u)) v[2] += d_exp2(log2_ps(xs[j]));
    block_sum<4>(v, scratch);
    cluster_sum<4>(cluster, v, slot_terms, bcast);
    A loss = v[0], ks = v[1];
    const A p_tail = v[2];
    const A q_tail = lp[p.k];
    const Point<A> tail = bucket_point(p_tail, d_log(p_tail), q_tail, d_log(q_tail));
    if (p.k < p.v) {
      Terms<A> ta{A(0), A(0), A(0)};
      point_terms<MODE, true, false>(tail, p.c, ta);
      loss += ta.loss;
      ks += ta.ks;
    }
    if (v[3] != A(0)) loss = ks = std::numeric_limits<A>::quiet_NaN();
    if (writes_out && threadIdx.x == 0) p.out[row] = loss;
    if (w_gs) {
      const A tail_coef = tail.ps > A(0) ? student_grad<MODE>(tail, p.c, ks) / tail.ps : A(0);
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        const Vec<T> vs = load_chunk(xs + c * N, vec);
        Vec<T> g;
#pragma unroll
        for (int q = 0; q < N; ++q) g.v[q] = static_cast<T>(d_exp2(log2_ps(vs.v[q])) * tail_coef * scale);
        store_chunk(gs + c * N, g, gs_vec);
      }
      for (int64_t j = chunks * N + threadIdx.x; j < count; j += blockDim.x)
        gs[j] = static_cast<T>(d_exp2(log2_ps(xs[j])) * tail_coef * scale);
      __syncthreads();  // the members' own gradients overwrite the tail formula written above
      for (int64_t j = threadIdx.x; j < p.k; j += blockDim.x) {
        const int64_t x = idx[j];
        if (x >= lo && x < lo + count) {
          const A ls2 = log2_ps(xs[x - lo]);
          gs[x - lo] = static_cast<T>(
              student_grad<MODE>(bucket_point(d_exp2(ls2), ls2 * A(kLn2), d_exp(lp[j]), lp[j]), p.c, ks) * scale);
        }
      }
    }
    cluster.sync();
    return;
  } else {
    // ---- 2. terms, and the gradients that need no row sum; 3. the gradients that do.
    const bool gs_in_terms = w_gs && !student_needs_k<MODE>(), gt_in_terms = w_gt && !teacher_needs_k<MODE>();
    const bool gs_later = w_gs && student_needs_k<MODE>(), gt_later = w_gt && teacher_needs_k<MODE>();
    // The row sums this launch needs: ks for a student gradient that needs it; both in the generic launch.
    constexpr bool KS = CFG == CFG_GENERIC || (CFG == CFG_STUDENT && student_needs_k<MODE>());
    constexpr bool KT = CFG == CFG_GENERIC;
    const RowNorms<A> rn = row_norms(norm[0], norm[1]);
    A ks = A(0), kt = A(0);
    if (p.phase != PHASE_GRAD) {
      Terms<A> acc{A(0), A(0), A(0)};
      // `close` is a row's constant: each value gets its own loop, with nothing of the other inside.
      auto terms_pass = [&](auto close_c) {
        constexpr bool CLOSE = decltype(close_c)::value;
        auto entry = [&](T xa, T xb, T& ga, T& gb) {
          const Point<A> e = make_point<CLOSE>(static_cast<A>(xa), static_cast<A>(xb), k2, rn);
          point_terms<MODE, KS, KT>(e, p.c, acc);
          if (gs_in_terms) ga = static_cast<T>(student_grad<MODE>(e, p.c, A(0)) * scale);
          if (gt_in_terms) gb = static_cast<T>(teacher_grad<MODE>(e, p.c, A(0)) * scale);
        };
        for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
          const Vec<T> vs = load_chunk(xs + c * N, vec), vt = load_chunk(xt + c * N, vec);
          Vec<T> g, h;
#pragma unroll
          for (int q = 0; q < N; ++q) entry(vs.v[q], vt.v[q], g.v[q], h.v[q]);
          if (gs_in_terms) store_chunk(gs + c * N, g, gs_vec);
          if (gt_in_terms) store_chunk(gt + c * N, h, gt_vec);
        }
        for (int64_t j = chunks * N + threadIdx.x; j < count; j += blockDim.x) {
          T ga, gb;
          entry(xs[j], xt[j], ga, gb);
          if (gs_in_terms) gs[j] = ga;
          if (gt_in_terms) gt[j] = gb;
        }
      };
      if (rn.close) terms_pass(std::true_type{});
      else terms_pass(std::false_type{});
      A v[3] = {acc.loss, acc.ks, acc.kt};
      block_sum<3>(v, scratch);
      cluster_sum<3>(cluster, v, slot_terms, bcast);
      ks = v[1];
      kt = v[2];
      if (writes_out && threadIdx.x == 0) {
        if (p.phase == -1) {
          p.out[row] = v[0];
        } else {
          p.out[3 * row] = v[0];
          p.out[3 * row + 1] = v[1];
          p.out[3 * row + 2] = v[2];
        }
      }
    } else {
      ks = p.k_in[2 * row];
      kt = p.k_in[2 * row + 1];
    }
    if (p.phase != PHASE_TERMS && (gs_later || gt_later)) {
      auto grad_pass = [&](auto close_c) {
        constexpr bool CLOSE = decltype(close_c)::value;
        auto entry = [&](T xa, T xb, T& ga, T& gb) {
          const Point<A> e = make_point<CLOSE>(static_cast<A>(xa), static_cast<A>(xb), k2, rn);
          if (gs_later) ga = static_cast<T>(student_grad<MODE>(e, p.c, ks) * scale);
          if (gt_later) gb = static_cast<T>(teacher_grad<MODE>(e, p.c, kt) * scale);
        };
        for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
          const Vec<T> vs = load_chunk(xs + c * N, vec), vt = load_chunk(xt + c * N, vec);
          Vec<T> g, h;
#pragma unroll
          for (int q = 0; q < N; ++q) entry(vs.v[q], vt.v[q], g.v[q], h.v[q]);
          if (gs_later) store_chunk(gs + c * N, g, gs_vec);
          if (gt_later) store_chunk(gt + c * N, h, gt_vec);
        }
        for (int64_t j = chunks * N + threadIdx.x; j < count; j += blockDim.x) {
          T ga, gb;
          entry(xs[j], xt[j], ga, gb);
          if (gs_later) gs[j] = ga;
          if (gt_later) gt[j] = gb;
        }
      };
      if (rn.close) grad_pass(std::true_type{});
      else grad_pass(std::false_type{});
    }
    if (p.phase != PHASE_GRAD) cluster.sync();  // others may still read this block's slots
  }
#endif
}

#include "distill_fast.cuh"
#include "distill_fast_topk.cuh"
#include "distill_split_topk.cuh"
#include "distill_stream_forward.cuh"

// factor / (rows whose label is not ignore_index), 0 when there are none: the batchmean divisor's reciprocal (times
// the caller's loss_scale), on the device.
__global__ void __launch_bounds__(
    1024) inv_count_kernel(const int64_t* __restrict__ labels, int64_t n, int64_t ignore_index,
                                          double factor, double* __restrict__ inv) {
  __shared__ long long part[32];
  long long c = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) c += labels[i] != ignore_index;
  c = warp_sum(c);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    long long total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += part[w];
    *inv = total > 0 ? factor / static_cast<double>(total) : 0.0;
  }
}

// loss = (sum of the rows' losses, in a fixed order, in double) * scale.
template <typename A>
__global__ void __launch_bounds__(
    1024) total_kernel(const A* __restrict__ rows, int64_t n, const double* __restrict__ scale_dev,
                                      double scale_host, A* __restrict__ out) {
  __shared__ double part[32];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += static_cast<double>(rows[i]);
  s = warp_sum(s);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += part[w];
    *out = static_cast<A>(total * (scale_dev ? *scale_dev : scale_host));
  }
}

// distill_combine's kernels, one thread per row (distill_common.h's combine_norm / combine_terms): parts
// [world, n, 4] -> the rows' normalisers [n, 4]; parts [world, n, 3] -> the rows' losses [n] and (ks, kt) [n, 2].
template <typename A>
__global__ void __launch_bounds__(256) combine_norms_kernel(const A* __restrict__ parts, int64_t n, int64_t world,
                                            A* __restrict__ out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) combine_row_norms(parts, i, n, world, out);
}

template <typename A>
__global__ void __launch_bounds__(256) combine_terms_kernel(const A* __restrict__ parts, int64_t n, int64_t world,
                                            A* __restrict__ rows_loss, A* __restrict__ ksums) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  combine_terms(parts + 3 * i, 3 * n, world, rows_loss[i], ksums[2 * i], ksums[2 * i + 1]);
}

// grad[row] *= grad_out (one value or one per row, G float or double: the loss's dtype, read as it is, so the
// backward needs no conversion of its own on the host's path); every block returns at once when the one factor
// is 1 (loss.backward() of a mean loss). Otherwise a pass over the whole gradient (scale_span.cuh): the blocks loop
// over chunks_per_row chunks of each row.
constexpr int kScaleThreads = 256, kScaleUnroll = 4;
template <typename T, typename G>
__global__ void __launch_bounds__(kScaleThreads)
scale_rows_kernel(T* grad, int64_t n, int64_t v, int64_t stride, const G* __restrict__ go, bool per_row,
                  int64_t chunks_per_row) {
  using A = typename AccOf<T>::type;
  if (!per_row && go[0] == G(1)) return;  // the usual backward of a mean loss: nothing to do
  const int64_t chunks = n * chunks_per_row;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t row = c / chunks_per_row;
    const A f = static_cast<A>(go[per_row ? row : 0]);
    if (f != A(1)) scale_span_chunk<kScaleThreads, kScaleUnroll>(grad + row * stride, v, f, c - row * chunks_per_row);
  }
}

// A top-k teacher's rows made ready, one block per row (see distill_topk_prepare in distill_api.h): the
// logsumexp of the log-probabilities, the normalised row [k + 1] (the tail's mass last, from a sum in double:
// topk_tail), and the checks' flags. Repeated indices by comparing
// every pair: k <= kDupCheckMax (distill_topk_prepare sorts longer rows).
constexpr int kPrepThreads = 128;
constexpr int64_t kDupCheckMax = 256;
// One row's verdicts raised in the call's flags: plain stores of 1, so the same result in any order, and no atomic
// on what may be pinned host memory (the eager step's flags: distill_topk_prepare), where a device's atomics are
// not guaranteed over PCIe. Volatile: each raised flag is one store the compiler keeps.
__device__ __forceinline__ void raise_topk_flags(int* flags, bool range, bool dup, bool bad_mass) {
  volatile int* f = flags;
  if (range) f[FLAG_RANGE] = 1;
  if (dup) f[FLAG_DUP] = 1;
  if (bad_mass) f[FLAG_MASS] = 1;
}
template <typename A>
__global__ void __launch_bounds__(kPrepThreads)
topk_prepare_kernel(const int64_t* __restrict__ idx, const A* __restrict__ lp, A* __restrict__ out, int64_t k,
                    int64_t vocab, const int64_t* __restrict__ labels, int64_t ignore_index, double slack_log,
                    bool check_dup, int* __restrict__ flags) {
  __shared__ int64_t row_idx[kDupCheckMax];
  __shared__ A scratch[kWarps];
  __shared__ double dscratch[kWarps];
  const int64_t row = blockIdx.x;
  const int64_t* xi = idx + row * k;
  const A* li = lp + row * k;
  const bool whole = k == vocab;
  A m[1] = {ninf<A>()};
  bool nan = false, range = false;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
    const A x = li[j];
    nan = nan || x != x;
    m[0] = x > m[0] ? x : m[0];
    const int64_t v = xi[j];
    range = range || v < 0 || v >= vocab;
    if (check_dup) row_idx[j] = v;
  }
  nan = __syncthreads_or(nan);
  range = __syncthreads_or(range);
  block_max<1>(m, scratch);
  double lse = m[0];  // in double (topk_shift); -inf (no mass) and +inf stay as they are
  if (nan) {
    lse = std::numeric_limits<double>::quiet_NaN();
  } else if (isfinite(m[0])) {
    double sum[1] = {0.0};
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
      sum[0] += exp(static_cast<double>(li[j]) - static_cast<double>(m[0]));
    block_sum<1>(sum, dscratch);
    lse = m[0] + log(sum[0]);
  }
  const A shift = topk_shift<A>(lse, whole);
  A* o = out + row * (k + 1);
  double q[1] = {0.0};  // the normalised row's mass, in double
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
    const A y = li[j] - shift;
    o[j] = y;
    q[0] += exp(static_cast<double>(y));
  }
  block_sum<1>(q, dscratch);
  if (threadIdx.x == 0) o[k] = topk_tail<A>(q[0], whole, shift);
  bool dup = false;
  if (check_dup)
    for (int64_t i = threadIdx.x; i < k; i += blockDim.x)
      for (int64_t j = i + 1; j < k; ++j) dup = dup || row_idx[i] == row_idx[j];
  dup = __syncthreads_or(dup);
  if (threadIdx.x == 0)
    raise_topk_flags(flags, range, dup,
                     !(labels && labels[row] == ignore_index) && topk_bad_mass(lse, whole, slack_log));
}

// The same for rows of k <= kPrepWarpK (a served teacher's usual 20-100 tokens), one warp a row, four rows a block:
// each lane's <= 4 entries stay in registers (no pass re-reads the row), the reductions are warp shuffles (no block
// barrier), and repeats are found by inserting each index into a per-warp hash table in shared memory (where
// topk_prepare_kernel's thread 0 compared k - 1 pairs one after another). At 4096 x 128256 and k = 100 on an H200
// (torch.profiler, the eager top-k training step): 17.8 -> 11.9 us of the step's 0.63 ms (kernels/NOTES.md,
// version 40). Results as topk_prepare_kernel's, the sum's rounding order aside.
constexpr int kPrepWarpK = 128;
constexpr int kPrepHashSlots = 256;  // a power of two >= 2 kPrepWarpK: probes stay short
static_assert(kPrepHashSlots == 256 && kPrepWarpK % 32 == 0, "the hash takes 8 bits; lanes hold k / 32 each");
template <typename A>
__global__ void __launch_bounds__(kPrepThreads)
topk_prepare_warp_kernel(const int64_t* __restrict__ idx, const A* __restrict__ lp, A* __restrict__ out, int64_t n,
                         int64_t k, int64_t vocab, const int64_t* __restrict__ labels, int64_t ignore_index,
                         double slack_log, int* __restrict__ flags) {
  constexpr int E = kPrepWarpK / 32, ROWS = kPrepThreads / 32;
  __shared__ int table[ROWS][kPrepHashSlots];  // 1 + the position of the index held there; 0: empty
  __shared__ int64_t held[ROWS][kPrepWarpK];   // the row's indices, by position
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * ROWS + w;
  if (row >= n) return;  // (a whole warp: no block barrier below)
  const bool masked = labels && labels[row] == ignore_index, whole = k == vocab;
  const int64_t* xi = idx + row * k;
  const A* li = lp + row * k;
  A x[E];
  int64_t v[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int j = lane + 32 * e;
    x[e] = j < k ? li[j] : ninf<A>();
    v[e] = j < k ? xi[j] : 0;
  }
  for (int i = lane; i < kPrepHashSlots; i += 32) table[w][i] = 0;
  bool nan = false, range = false;
  A m = ninf<A>();
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (lane + 32 * e >= k) continue;
    nan = nan || x[e] != x[e];
    m = x[e] > m ? x[e] : m;
    range = range || v[e] < 0 || v[e] >= vocab;
    held[w][lane + 32 * e] = v[e];
  }
  nan = __any_sync(0xffffffffu, nan);
  range = __any_sync(0xffffffffu, range);
  m = warp_max(m);
  double lse = m;  // in double (topk_shift); -inf (no mass) and +inf stay as they are
  if (nan) {
    lse = std::numeric_limits<double>::quiet_NaN();
  } else if (isfinite(m)) {
    double sum = 0.0;
#pragma unroll
    for (int e = 0; e < E; ++e)
      if (lane + 32 * e < k) sum += exp(static_cast<double>(x[e]) - static_cast<double>(m));
    lse = m + log(warp_sum(sum));
  }
  const A shift = topk_shift<A>(lse, whole);
  A* o = out + row * (k + 1);
  double q = 0.0;  // the normalised row's mass, in double
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (lane + 32 * e < k) {
      const A y = x[e] - shift;
      o[lane + 32 * e] = y;
      q += exp(static_cast<double>(y));
    }
  q = warp_sum(q);
  if (lane == 0) o[k] = topk_tail<A>(q, whole, shift);
  __syncwarp();  // the table cleared and the indices held, for every lane
  bool dup = false;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int j = lane + 32 * e;
    if (j >= k) continue;
    const uint64_t u = static_cast<uint64_t>(v[e]);
    unsigned slot = (static_cast<unsigned>(u ^ (u >> 32)) * 2654435761u) >> 24;  // 8 bits: kPrepHashSlots
    while (true) {  // linear probing; each lane inserts its own entries, so no lane waits on another
      const int prev = atomicCAS(&table[w][slot], 0, j + 1);
      if (prev == 0) break;
      if (held[w][prev - 1] == v[e]) {
        dup = true;
        break;
      }
      slot = (slot + 1) & (kPrepHashSlots - 1);
    }
  }
  dup = __any_sync(0xffffffffu, dup);
  if (lane == 0) raise_topk_flags(flags, range, dup, !masked && topk_bad_mass(lse, whole, slack_log));
}

// ------------------------------------------------------------------------------------------- launching
struct Launch {
  int cluster = 1, threads = 128;
  int64_t slice = 0;
  size_t smem = 0;
  bool use_smem = true;
  bool balance = false;  // the load-balancing cluster scheduling policy (a research knob, below)
};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The smallest cluster whose blocks' slices fit the shared-memory target, else clusters of 16 up to the maximum,
// or global-memory passes for rows longer than a cluster of 16 can hold.
Launch plan_launch(int64_t v, size_t entry_bytes, bool topk) {
  Launch l;
  // A research knob: KLDIV_DISTILL_CLUSTER_POLICY=1 asks for the load-balancing cluster scheduling policy (the
  // default, spread, places a cluster's blocks on distinct SMs of a GPC).
  if (const char* env = std::getenv("KLDIV_DISTILL_CLUSTER_POLICY")) l.balance = std::atoi(env) == 1;
  // A research knob: KLDIV_DISTILL_SMEM_KIB sets the shared-memory target per block (so the cluster size) for
  // tuning runs; unset, the target above.
  size_t target = kSmemTarget;
  if (const char* env = std::getenv("KLDIV_DISTILL_SMEM_KIB")) target = static_cast<size_t>(std::atoi(env)) * 1024;
  auto bytes = [&](int64_t slice) {
    return static_cast<size_t>(slice) * entry_bytes + (topk ? static_cast<size_t>((slice + 31) / 32) * 4 : 0);
  };
  // The plan for clusters of c blocks where their slices fit `budget`.
  auto fits = [&](int c, size_t budget) {
    const int64_t slice = round_up((v + c - 1) / c, kSliceAlign);
    if (bytes(slice) > budget) return false;
    l.cluster = c;
    l.slice = slice;
    l.smem = bytes(slice);
    l.threads = slice >= 8192 ? 512 : slice >= 2048 ? 256 : 128;
    if (const char* env = std::getenv("KLDIV_DISTILL_THREADS")) {  // a research knob
      l.threads = std::atoi(env);
      // (the block reductions shuffle whole warps: a partial warp would read lanes that do not exist)
      TORCH_CHECK(l.threads >= 32 && l.threads <= kMaxThreads && l.threads % 32 == 0,
                  "distill: KLDIV_DISTILL_THREADS must be a multiple of 32 from 32 to 512, got ", env);
    }
    return true;
  };
  // A research knob: KLDIV_DISTILL_CLUSTER sets the cluster size (1-16, any size, not only the powers of 2 below:
  // clusters of 16 leave the SMs of a GPC with fewer than 16 idle) where its slices fit the maximum.
  if (const char* env = std::getenv("KLDIV_DISTILL_CLUSTER")) {
    const int c = std::atoi(env);
    TORCH_CHECK(c >= 1 && c <= 16, "distill: KLDIV_DISTILL_CLUSTER must be 1-16, got ", env);
    if (fits(c, kSmemMax)) return l;
  }
  // Within the target the smallest cluster that fits (the fewest blocks a row waits on); beyond it clusters of 16,
  // the smallest slices: the most blocks an SM holds. Rows of 256000 bf16 entries (1 MB for student and teacher)
  // had taken clusters of 8 (128 KB slices, one block an SM) and ran at 2.2-3.3 x their floor where clusters of 16
  // (64 KB, three blocks an SM) measured 1.4-2.0 x (an H200, kernels/NOTES.md, version 56).
  for (int c : {1, 2, 4, 8, 16})
    if (fits(c, target)) return l;
  if (fits(16, kSmemMax)) return l;
  l.use_smem = false;  // read each pass from device memory: a cluster of 16 keeps the row's passes in L2
  l.cluster = 16;
  l.slice = round_up((v + 15) / 16, kSliceAlign);
  l.smem = topk ? static_cast<size_t>((l.slice + 31) / 32) * 4 : 0;
  l.threads = 512;
  return l;
}

// A kernel's shared-memory limit and cluster-size permission, raised once per kernel and device (setting a
// function attribute costs microseconds, a sizeable share of a small call).
void prepare_kernel(const void* kernel, size_t smem, bool big_cluster) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, std::pair<size_t, bool>> done;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto& state = done[{kernel, dev}];
  if (smem > state.first) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    state.first = smem;
  }
  if (big_cluster && !state.second) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    state.second = true;
  }
}

// One wave of a kernel's blocks on the current device: the blocks an SM holds at once (its occupancy at `threads`
// a block, no dynamic shared memory) times the SMs, asked once per kernel and device.
int64_t one_wave(const void* kernel, int threads) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int64_t> waves;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  const auto it = waves.find({kernel, dev});
  if (it != waves.end()) return it->second;
  int per_sm = 0, sms = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return waves[{kernel, dev}] = max64(1, static_cast<int64_t>(per_sm) * sms);
}

// params2: a kernel's second parameter (the split's PeerRows), or none.
template <typename Kernel> void launch_rows(Kernel kernel, const Launch& l, int64_t n, const void* params,
                                            cudaStream_t stream, const void* params2 = nullptr) {
  prepare_kernel(reinterpret_cast<const void*>(kernel), l.smem, l.cluster > 8);
  const int64_t blocks = n * l.cluster;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "distill: too many rows for one launch");
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(l.threads);
  cfg.dynamicSmemBytes = l.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = l.cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (l.balance) {
    attr[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
    attr[1].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicyLoadBalancing;
    cfg.numAttrs = 2;
  }
  void* args[] = {const_cast<void*>(params), const_cast<void*>(params2)};
  C10_CUDA_CHECK(cudaLaunchKernelExC(&cfg, reinterpret_cast<const void*>(kernel), args));
}

// Launches the kernel instance for a launch plan and configuration. The compile-time configurations exist for
// the hot cases only (16-bit and float32 logits, full teacher rows, slices in shared memory); everything else
// takes the generic instance.
template <typename T, int MODE, bool TOPK, typename A>
void launch_for(const Launch& l, int cfg, int64_t n, const Params<T, A>& p, cudaStream_t stream) {
  if constexpr (TOPK || std::is_same<T, double>::value) {
    if (l.use_smem) launch_rows(rows_kernel<T, MODE, TOPK, true, CFG_GENERIC>, l, n, &p, stream);
    else launch_rows(rows_kernel<T, MODE, TOPK, false, CFG_GENERIC>, l, n, &p, stream);
  } else {
    if (!l.use_smem) launch_rows(rows_kernel<T, MODE, false, false, CFG_GENERIC>, l, n, &p, stream);
    else if (cfg == CFG_INFER) launch_rows(rows_kernel<T, MODE, false, true, CFG_INFER>, l, n, &p, stream);
    else if (cfg == CFG_STUDENT) launch_rows(rows_kernel<T, MODE, false, true, CFG_STUDENT>, l, n, &p, stream);
    else launch_rows(rows_kernel<T, MODE, false, true, CFG_GENERIC>, l, n, &p, stream);
  }
}

template <typename T, typename A>
Params<T, A> base_params(const Rows& r, int64_t ignore_index, double beta, double temperature, const Launch& l) {
  Params<T, A> p{};
  p.s = r.s.data_ptr<T>();
  p.t = r.t.defined() ? r.t.data_ptr<T>() : nullptr;
  p.s_stride = r.s.stride(0);
  p.t_stride = r.t.defined() ? r.t.stride(0) : 0;
  p.idx = r.idx.defined() ? r.idx.data_ptr<int64_t>() : nullptr;
  p.lp = r.lp.defined() ? r.lp.data_ptr<A>() : nullptr;
  p.k = r.k;
  p.labels = r.labels.defined() ? r.labels.data_ptr<int64_t>() : nullptr;
  p.ignore_index = ignore_index;
  p.n = r.n;
  p.v = r.v;
  p.slice = l.slice;
  p.inv_t = static_cast<A>(1.0 / temperature);
  p.k2 = static_cast<A>(kLog2e / temperature);
  p.c = row_const<A>(beta);
  p.phase = -1;
  return p;
}

// Whether a distill_forward call takes a fast kernel: fast_rows_kernel (distill_fast.cuh) for a full teacher row,
// fast_topk_kernel (distill_fast_topk.cuh) for a top-k teacher; no teacher gradient, 16-bit or float32 logits,
// slices in shared memory, every row of student, teacher and gradient starting on a 16-byte boundary (or, with a
// full teacher row, the three rows of an index at one offset from it: fast_path_ok's `allow_shift`).
// KLDIV_DISTILL_FAST=0 (a research knob) sends every call to rows_kernel, to compare the two.
bool fast_allowed() {
  const char* env = std::getenv("KLDIV_DISTILL_FAST");
  return !(env && std::atoi(env) == 0);
}

// Every row of x [n, v] starts on the 16-byte grid (the fast kernels' vector loads and stores).
bool rows_on_grid(const at::Tensor& x) {
  const int64_t vec = 16 / static_cast<int64_t>(x.element_size());
  return aligned16(x.data_ptr()) && (x.size(0) <= 1 || x.stride(0) % vec == 0);
}

// Every row of y [n, v] lies as far from the 16-byte grid as x's row of the same index (x's and y's entries of
// one size): one row head for both (fast_slice's SHIFT).
bool rows_co_aligned(const at::Tensor& x, const at::Tensor& y) {
  const auto el = static_cast<int64_t>(x.element_size());
  const auto px = reinterpret_cast<uintptr_t>(x.data_ptr()), py = reinterpret_cast<uintptr_t>(y.data_ptr());
  return y.element_size() == el && px % el == 0 && ((px - py) & 15) == 0 &&
         (x.size(0) <= 1 || ((x.stride(0) - y.stride(0)) * el) % 16 == 0);
}

// Every row of student, teacher (a full row) and gradient (where written) starts on the 16-byte grid.
bool all_rows_on_grid(const Rows& r, const at::Tensor& gs) {
  return rows_on_grid(r.s) && (r.topk() || rows_on_grid(r.t)) && (!gs.defined() || rows_on_grid(gs));
}

// allow_shift: the launch can take rows off the 16-byte grid where student, teacher (a full row) and gradient rows
// share their offsets from it (launch_fast's: fast_rows, stream_forward and fast_topk_kernel, their SHIFT
// instances; a top-k teacher's SHIFT instances need kTopkHeadPad bytes more shared memory); else every row must
// start on the grid.
// fast_kernel_takes: what the fast kernels refuse whatever the rows' layout; fast_layout_ok: the layout.
bool fast_kernel_takes(const Rows& r, const Launch& l, bool want_teacher) {
  return fast_allowed() && !want_teacher && l.use_smem && r.s.scalar_type() != at::kDouble;
}
bool fast_layout_ok(const Rows& r, const Launch& l, const at::Tensor& gs, bool allow_shift) {
  if (allow_shift && !all_rows_on_grid(r, gs)) {
    const bool co_aligned = rows_co_aligned(r.s, r.topk() ? r.s : r.t) && (!gs.defined() || rows_co_aligned(r.s, gs));
    return co_aligned && (!r.topk() || (kTopkShift && l.smem + kTopkHeadPad <= kSmemMax));
  }
  return all_rows_on_grid(r, gs);
}
bool fast_path_ok(const Rows& r, const Launch& l, const at::Tensor& gs, bool want_teacher, bool allow_shift = false) {
  return fast_kernel_takes(r, l, want_teacher) && fast_layout_ok(r, l, gs, allow_shift);
}

// x [n, v] itself when its rows are on the 16-byte grid, else an uninitialised [n, v] view of a buffer whose rows
// are padded to it (copy_ fills it).
at::Tensor on_grid_like(const at::Tensor& x) {
  if (rows_on_grid(x)) return x;
  const int64_t vec = 16 / static_cast<int64_t>(x.element_size());
  return at::empty({x.size(0), round_up(x.size(1), vec)}, x.options()).narrow(1, 0, x.size(1));
}
at::Tensor on_grid(const at::Tensor& x) {
  at::Tensor y = on_grid_like(x);
  if (!y.is_same(x)) y.copy_(x);
  return y;
}

// Out word i of 16 bytes that start `shift` bytes into word Q of w (a 32-byte window of the source).
template <int Q> __device__ __forceinline__ uint4 window_chunk(const uint32_t (&w)[8], unsigned shift) {
  return make_uint4(__funnelshift_r(w[Q], w[Q + 1], shift), __funnelshift_r(w[Q + 1], w[Q + 2], shift),
                    __funnelshift_r(w[Q + 2], w[Q + 3], shift), __funnelshift_r(w[Q + 3], w[Q + 4], shift));
}

// Copies rows [n, v] of src into dst (each its own row stride and offsets from the 16-byte grid; one element size
// of 2 or 4 bytes). Each aligned 16-byte store of dst takes its entries from the two aligned 16-byte words of src
// that hold them (funnel shifts; the second word only where the entries straddle, so no read lies past the row),
// so rows whose offsets differ move at the copy's bandwidth: PyTorch's copy_ of such strided rows ran at ~40% of
// it on an H200 (kernels/NOTES.md, version 55). dst's entries before its first aligned chunk and after its last
// one are copied one by one. Rows by blockIdx.y (striding), a row's chunks by blockIdx.x and the threads.
template <typename T>
__global__ void copy_rows_kernel(const T* __restrict__ src, int64_t src_stride, T* __restrict__ dst, int64_t dst_stride,
                                 int64_t n, int64_t v) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "copy_rows_kernel: 2- or 4-byte entries");
  constexpr int N = 16 / sizeof(T);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    const T* s = src + i * src_stride;
    T* d = dst + i * dst_stride;
    const int64_t head = min64(row_head(d), v), chunks = (v - head) / N, rest = v - head - chunks * N;
    const auto at = reinterpret_cast<uintptr_t>(s + head);
    const unsigned off = static_cast<unsigned>(at & 15u), shift = 8u * (off & 3u);
    const uint4* s16 = reinterpret_cast<const uint4*>(at - off);
    uint4* d16 = reinterpret_cast<uint4*>(d + head);
    for (int64_t c = first; c < chunks; c += step) {
      const uint4 a = s16[c], b = off ? s16[c + 1] : make_uint4(0u, 0u, 0u, 0u);
      const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      switch (off >> 2) {
        case 0:
          d16[c] = window_chunk<0>(w, shift);
          break;
        case 1:
          d16[c] = window_chunk<1>(w, shift);
          break;
        case 2:
          d16[c] = window_chunk<2>(w, shift);
          break;
        default:
          d16[c] = window_chunk<3>(w, shift);
          break;
      }
    }
    for (int64_t j = first; j < head + rest; j += step) {
      const int64_t e = j < head ? j : head + chunks * N + (j - head);
      d[e] = s[e];
    }
  }
}

// dst [n, v] = src [n, v] (same dtype and device, 2- or 4-byte entries: the fast kernels' logits; unit stride along
// v) on the current stream.
void copy_rows(const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.dim() == 2, "distill: internal: copy_rows needs [n, v] rows");
  const int64_t n = src.size(0), v = src.size(1), el = src.element_size();
  TORCH_CHECK(src.sizes() == dst.sizes() && src.scalar_type() == dst.scalar_type() && (el == 2 || el == 4) &&
                  (v <= 1 || (src.stride(1) == 1 && dst.stride(1) == 1)),
              "distill: internal: copy_rows needs [n, v] rows of one 16-bit or 32-bit dtype, unit stride along v");
  if (n == 0 || v == 0) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  constexpr int kThreads = 256;
  const int64_t per_block = kThreads * (16 / el);
  const auto gx = static_cast<unsigned>(std::min<int64_t>((v + per_block - 1) / per_block, 1 << 16));
  const auto gy = static_cast<unsigned>(std::min<int64_t>(n, 65535));
  const dim3 grid(gx, gy);
  if (el == 2) {
    copy_rows_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t*>(src.data_ptr()),
                                                              src.stride(0), static_cast<uint16_t*>(dst.data_ptr()),
                                                              dst.stride(0), n, v);
  } else {
    copy_rows_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(static_cast<const uint32_t*>(src.data_ptr()),
                                                              src.stride(0), static_cast<uint32_t*>(dst.data_ptr()),
                                                              dst.stride(0), n, v);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// x [n, v] itself when each of its rows lies as far from the 16-byte grid as ref's row of the same index, else an
// uninitialised [n, v] view of a new buffer laid out so (rows_laid_out, distill_plan.h: ref's offset within its
// first 16 bytes, read from its address; a row stride equal to ref's modulo a chunk).
at::Tensor co_aligned_like(const at::Tensor& ref, const at::Tensor& x) {
  if (rows_co_aligned(ref, x)) return x;
  const int64_t el = x.element_size();
  const int64_t head = static_cast<int64_t>(reinterpret_cast<uintptr_t>(ref.data_ptr()) & 15u) / el;
  const at::Tensor y = rows_laid_out(x.size(0), x.size(1), ref.stride(0), head, x.options());
  TORCH_CHECK(rows_co_aligned(ref, y), "distill: internal: a new buffer off its reference's offsets");
  return y;
}

// The rows a distill_forward call's kernel reads and the buffer it writes the student's gradient to, and whether
// that kernel is a fast one (fast_layout). Where the rows as given would send a fast kernel's call to the general
// kernel (rows_kernel, ~3-4 x slower: kernels/NOTES.md, version 52) because student, teacher and gradient rows of
// an index lie at different offsets from the 16-byte grid (logits sliced out of a padded vocabulary, a row stride
// of 50304 entries for V = 50257, beside a contiguous gradient or a contiguous teacher, say), one of the three is
// kept as it is (the reference) and each other one that does not share its offsets gets a buffer that does: an
// input is copied into its buffer before the launch, the gradient copied out of its own after it (fill_inputs,
// gradient_out; both nothing where the rows are the given ones). Each copied tensor costs one more read and write
// of its bytes, and its bytes held until the call returns; the reference is the one that leaves the fewest bytes to
// copy (the student on a tie). Where even that layout is refused (a top-k teacher's shifted rows without room for
// their heads) every row is put on the grid; where that is refused too, or the fast kernels take no such call
// (fast_kernel_takes), the general kernel takes the rows as given.
struct KernelRows {
  bool fast = false;
  Rows r;        // the rows the kernel reads (the given ones, or buffers to fill)
  at::Tensor g;  // where the kernel writes the student's gradient (the given buffer, or one to copy out of)
  void fill_inputs(const Rows& given) const {
    if (!r.s.is_same(given.s)) copy_rows(given.s, r.s);
    if (r.t.defined() && !r.t.is_same(given.t)) copy_rows(given.t, r.t);
  }
  void gradient_out(at::Tensor& gs) const {
    if (gs.defined() && !g.is_same(gs)) copy_rows(g, gs);
  }
};
KernelRows fast_layout(const Rows& r, const Launch& l, const at::Tensor& gs, bool want_teacher) {
  const KernelRows given{false, r, gs};
  if (!fast_kernel_takes(r, l, want_teacher)) return given;
  if (fast_layout_ok(r, l, gs, true)) return KernelRows{true, r, gs};
  const at::Tensor t = r.topk() ? at::Tensor() : r.t;
  std::vector<at::Tensor> members = {r.s};
  if (t.defined()) members.push_back(t);
  if (gs.defined()) members.push_back(gs);
  size_t best = 0;
  int64_t best_bytes = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    int64_t bytes = 0;
    for (const at::Tensor& x : members)
      if (!rows_co_aligned(members[i], x)) bytes += x.numel() * static_cast<int64_t>(x.element_size());
    if (best_bytes < 0 || bytes < best_bytes) best = i, best_bytes = bytes;
  }
  auto laid = [&](auto like) {
    KernelRows out{true, r, gs};
    out.r.s = like(r.s);
    if (t.defined()) out.r.t = like(t);
    if (gs.defined()) out.g = like(gs);
    return out;
  };
  const KernelRows co = laid([&](const at::Tensor& x) { return co_aligned_like(members[best], x); });
  if (fast_layout_ok(co.r, l, co.g, true)) return co;
  const KernelRows grid = laid([](const at::Tensor& x) { return on_grid_like(x); });
  return fast_layout_ok(grid.r, l, grid.g, true) ? grid : given;
}

// Calls f(mode, grad, phase), each a std::integral_constant, for the kernel instance a split's terms or gradient
// phase launches: its only gradient is the student's, forward KL's in the terms phase (when `grad`), the others'
// in the gradient phase (forward KL launches nothing there).
template <typename F> void dispatch_phase(int mode, int phase, bool grad, F&& f) {
  dispatch_mode(mode, [&](auto mode_c) {
    constexpr int MODE = decltype(mode_c)::value;
    const std::integral_constant<int, PHASE_TERMS> terms_c;
    if (phase == PHASE_TERMS) {
      if constexpr (MODE == FORWARD_KL) {
        if (grad) f(mode_c, std::true_type{}, terms_c);
        else f(mode_c, std::false_type{}, terms_c);
      } else {
        f(mode_c, std::false_type{}, terms_c);
      }
    } else if constexpr (MODE != FORWARD_KL) {
      f(mode_c, std::true_type{}, std::integral_constant<int, PHASE_GRAD>{});
    }
  });
}

// KLDIV_DISTILL_STAGED=0 (a research knob): the fast kernels' copy in one group, waited for whole (as before the
// staged copy).
bool staged_copy() {
  const char* env = std::getenv("KLDIV_DISTILL_STAGED");
  return !(env && std::atoi(env) == 0);
}

// fast_rows' instance for rows without a gradient, or none where launch_fast sends such rows to
// stream_forward_kernel (forward and reverse KL, kStreamForward): those instances are not made at all (six kernels
// fewer to compile, none that could be launched by mistake).
template <typename T, int MODE, bool SHIFT> constexpr auto rows_alone_kernel() {
  using Kernel = void (*)(Params<T, float>);
  if constexpr (kStreamForward && MODE != JSD) return Kernel{nullptr};
  else if constexpr (sizeof(T) == 2) return Kernel{fast_rows_kernel_16<T, MODE, false, SHIFT>};
  else return Kernel{fast_rows_kernel<T, MODE, false, SHIFT>};
}

// A fast kernel: fast_topk_kernel (distill_fast_topk.cuh) for a top-k teacher, whose cluster's rank 0 writes each
// row's loss into rows_loss; else fast_rows_kernel (distill_fast.cuh), then each row's loss from its warps'
// partial sums (fast_rows_total_kernel). shifted: some row starts off the 16-byte grid (fast_path_ok let it
// through), so the instances that take such rows (SHIFT) are launched.
template <typename T, typename A>
void launch_fast(const Launch& plan, int mode, bool topk, bool want_student, int64_t n, Params<T, A> p,
                 at::Tensor& rows_loss, cudaStream_t stream, bool shifted) {
  if constexpr (std::is_same<A, double>::value) {
    TORCH_CHECK(false, "distill: no fast path for float64 logits");  // fast_path_ok refuses them first
  } else {
    if constexpr (kStreamForward) {  // forward and reverse KL without a gradient: one pass (stream_forward_kernel)
      if (!topk && !want_student && mode != JSD) {
        TORCH_CHECK(n < (int64_t(1) << 31), "distill: too many rows for one launch");
        p.out = rows_loss.data_ptr<float>();
        const auto kernel =
            mode == FORWARD_KL
                ? (shifted ? stream_forward_kernel<T, FORWARD_KL, true> : stream_forward_kernel<T, FORWARD_KL, false>)
                : (shifted ? stream_forward_kernel<T, REVERSE_KL, true> : stream_forward_kernel<T, REVERSE_KL, false>);
        kernel<<<static_cast<unsigned>(n), kStreamFwdThreads, 0, stream>>>(p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
    }
    Launch l = plan;
    // 16-bit training instances in blocks of kNarrowThreads (distill_fast.cuh): those that need ks
    // (kNarrowKsBlocks), forward KL's (kDirectStepTerms), the top-k teacher's (kTopkNarrow)
    const bool narrow = sizeof(T) == 2 && want_student &&
                        (topk ? kTopkNarrow : (mode == FORWARD_KL ? kDirectStepTerms : kNarrowKsBlocks));
    // and, where their slices overflow the shared-memory target (long rows, on the grid), in kWideThreads blocks
    const bool wide = kWideLongRows && narrow && !topk && !shifted && plan.smem > kSmemTarget;
    l.threads = wide ? kWideThreads : narrow ? kNarrowThreads : kFastThreads;
    p.staged = staged_copy();
    const int per_row = l.cluster * (l.threads / 32);  // the partial losses: one a warp
    at::Tensor partial = topk ? rows_loss : at::empty({n * per_row}, rows_loss.options());
    p.out = partial.data_ptr<float>();
    dispatch_mode(mode, [&](auto mode_c) {
      constexpr int MODE = decltype(mode_c)::value;
      auto launch = [&](auto with_grad, auto without_grad) {
        if (want_student) {
          launch_rows(with_grad, l, n, &p, stream);
        } else {
          TORCH_CHECK(without_grad != nullptr, "distill: rows without a gradient of mode ", MODE,
                      " take stream_forward_kernel");  // (launch_fast's first branch: never reached)
          launch_rows(without_grad, l, n, &p, stream);
        }
      };
      // A full teacher row's instances, SHIFT or not
      auto full_rows = [&](auto shift_c) {
        constexpr bool SHIFT = decltype(shift_c)::value;
        if constexpr (sizeof(T) == 2) {  // the register-capped instances (distill_fast.cuh)
          // Where the mode's training rows are narrow (narrow == want_student here), the capped training
          // instance is not instantiated at all: a kernel fewer to compile, none that could be launched by mistake.
          if constexpr (MODE == FORWARD_KL ? kDirectStepTerms : kNarrowKsBlocks) {
            if constexpr (kWideLongRows && !SHIFT) {
              if (wide) return launch(fast_rows_kernel_wide<T, MODE>, rows_alone_kernel<T, MODE, SHIFT>());
            }
            launch(fast_rows_kernel_narrow<T, MODE, SHIFT>, rows_alone_kernel<T, MODE, SHIFT>());
          } else launch(fast_rows_kernel_16<T, MODE, true, SHIFT>, rows_alone_kernel<T, MODE, SHIFT>());
        } else launch(fast_rows_kernel<T, MODE, true, SHIFT>, rows_alone_kernel<T, MODE, SHIFT>());
      };
      // A top-k teacher's instances, SHIFT or not (SHIFT: the head's room below rank 0's slice)
      auto topk_rows = [&](auto shift_c) {
        constexpr bool SHIFT = decltype(shift_c)::value;
        if constexpr (SHIFT) l.smem += kTopkHeadPad;
        if constexpr (sizeof(T) == 2 && kTopkNarrow)
          launch(fast_topk_kernel_narrow<T, MODE, SHIFT>, fast_topk_kernel<T, MODE, false, SHIFT>);
        else launch(fast_topk_kernel<T, MODE, true, SHIFT>, fast_topk_kernel<T, MODE, false, SHIFT>);
      };
      if (topk) {
        if (!shifted) topk_rows(std::false_type{});
        else if constexpr (kTopkShift) topk_rows(std::true_type{});
        else TORCH_CHECK(false, "distill: internal: a top-k teacher's rows off the 16-byte grid");
      } else if (shifted) full_rows(std::true_type{});
      else full_rows(std::false_type{});
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!topk) {
      fast_rows_total_kernel<><<<static_cast<unsigned>((n + 7) / 8), 256, 0, stream>>>(
          partial.data_ptr<float>(), n, per_row, rows_loss.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

// One phase of a vocabulary split across devices (distill_fast.cuh): the normalisers by phase_norms_kernel, the
// terms and gradient phases by phase_stream_kernel (GRAD: the launches whose only gradient is the student's,
// forward KL's in the terms phase, the others' in the gradient phase), each writing its rows' results to `out`.
template <typename T, typename A>
void launch_fast_phase(int mode, int phase, bool grad, int64_t n, const Params<T, A>& p, cudaStream_t stream) {
  if constexpr (std::is_same<A, double>::value) {
    TORCH_CHECK(false, "distill: no fast path for float64 logits");  // fast_path_ok refuses them first
  } else {
    TORCH_CHECK(n < (int64_t(1) << 31), "distill: too many rows for one launch");
    if (phase == PHASE_NORMS) {  // (the normalisers do not depend on the mode)
      phase_norms_kernel<T><<<static_cast<unsigned>(n), kNormThreads, 0, stream>>>(p);
    } else {
      dispatch_phase(mode, phase, grad, [&](auto m, auto g, auto ph) {
        phase_stream_kernel<T, decltype(m)::value, decltype(g)::value, decltype(ph)::value>
            <<<static_cast<unsigned>(n), kStreamThreads, 0, stream>>>(p);
      });
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The split's one-read kernels (distill_fast.cuh's split_rows kernels; distill_peer.cuh): each row's slice kept
// in shared memory while the ranks exchange the normalisers, then its terms and the student's gradient. Forward
// KL: its rows' losses into column 0 of terms [n, 3] (zeroed: forward KL has no K sums), for stage 1. The JSD's
// training rows exchange their sums in the kernel (stages 1 and 2) and write the rows' losses into rows_loss.
template <typename T, typename A>
void launch_split_rows(const Launch& plan, int mode, bool want_student, int64_t n, Params<T, A> p, PeerRows pr,
                       at::Tensor& terms, at::Tensor& rows_loss, cudaStream_t stream) {
  if constexpr (std::is_same<A, double>::value) {
    TORCH_CHECK(false, "distill: no peer exchange for float64 logits");  // distill_peer_terms refuses them first
  } else {
    Launch l = plan;
    l.threads = sizeof(T) == 2 && want_student ? kNarrowThreads : kFastThreads;  // as launch_fast's
    p.staged = staged_copy();
    const int per_row = l.cluster * (l.threads / 32);
    at::Tensor partial = at::empty({n * per_row}, rows_loss.options());  // the warps' losses
    p.out = partial.data_ptr<float>();
    pr.rows_loss = rows_loss.data_ptr<float>();
    if (mode == JSD) {
      TORCH_CHECK(want_student, "distill: the JSD's one-read kernel is its training rows'");
      if constexpr (sizeof(T) == 2) launch_rows(split_rows_kernel_narrow<T, JSD>, l, n, &p, stream, &pr);
      else launch_rows(split_rows_kernel<T, JSD, true>, l, n, &p, stream, &pr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    if constexpr (sizeof(T) == 2) {
      if (want_student) launch_rows(split_rows_kernel_narrow<T, FORWARD_KL>, l, n, &p, stream, &pr);
      else launch_rows(split_rows_kernel_16<T, false>, l, n, &p, stream, &pr);
    } else {
      if (want_student) launch_rows(split_rows_kernel<T, FORWARD_KL, true>, l, n, &p, stream, &pr);
      else launch_rows(split_rows_kernel<T, FORWARD_KL, false>, l, n, &p, stream, &pr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    C10_CUDA_CHECK(cudaMemsetAsync(terms.data_ptr<float>(), 0, static_cast<size_t>(n) * 3 * sizeof(float), stream));
    fast_rows_total_kernel<3><<<static_cast<unsigned>((n + 7) / 8), 256, 0, stream>>>(partial.data_ptr<float>(), n,
                                                                                      per_row, terms.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Stage 1 (and 2) of the split's peer exchange from this rank's terms [n, 3]: the rows' losses and (ks, kt).
void peer_terms(const at::Tensor& terms, const PeerRows& pr, const Rows& r, int64_t ignore_index, bool series_round,
                at::Tensor& rows_loss, at::Tensor& ksums, cudaStream_t stream) {
  if (r.n == 0) return;
  peer_terms_kernel<<<static_cast<unsigned>((r.n + 127) / 128), 128, 0, stream>>>(
      terms.data_ptr<float>(), pr, r.labels.defined() ? r.labels.data_ptr<int64_t>() : nullptr, ignore_index, r.n,
      series_round, rows_loss.data_ptr<float>(), ksums.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_device(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "distill (cuda backend): expected CUDA tensors, got ", x.device());
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.get_device()));
  TORCH_CHECK(major >= 9,
              "distill (cuda backend): the kernels use thread-block clusters, which need compute "
              "capability 9.0 (Hopper) or newer; this GPU has ",
              major, ".x. Use CPU tensors instead.");
}

// A gradient written over the student's own logits (the fused LM head does this) is safe only where the row's
// slices sit in shared memory: a later pass may read a logit the gradient already replaced.
void check_in_place(const at::Tensor& gs, const Rows& r, const Launch& l) {
  TORCH_CHECK(!gs.defined() || l.use_smem || !gs.is_alias_of(r.s),
              "distill: an in-place gradient needs rows that fit on chip (vocabulary of ", r.v, " is too long)");
}

}  // namespace
}  // namespace distill

using namespace distill;

const char* distill_backend() { return "cuda"; }

std::vector<at::Tensor> distill_forward(const at::Tensor& student, const c10::optional<at::Tensor>& teacher,
                                        const c10::optional<at::Tensor>& topk_idx,
                                        const c10::optional<at::Tensor>& topk_lp,
                                        const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                        double temperature, int64_t reduction, bool want_student, bool want_teacher,
                                        const c10::optional<at::Tensor>& grad_student_out,
                                        const c10::optional<at::Tensor>& scale, double loss_scale) {
  check_device(student);
  const Rows r =
      prepare_forward(student, teacher, topk_idx, topk_lp, labels, beta, temperature, reduction, want_teacher);
  const double* scale_given = forward_scale(scale, r, reduction, loss_scale);
  const c10::cuda::CUDAGuard guard(student.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto acc = acc_type(r.s.scalar_type());
  const auto dopts = r.s.options().dtype(at::kDouble);
  at::Tensor rows_loss = at::empty({r.n}, r.s.options().dtype(acc));
  at::Tensor gs = want_student ? grad_buffer(grad_student_out, r, true) : at::Tensor();
  // Every refusal before the first launch: a call that raises leaves nothing queued on the stream.
  const Launch l = plan_launch(r.v, r.s.element_size() * (r.topk() ? 1 : 2), r.topk());
  if (r.n > 0) check_in_place(gs, r, l);
  at::Tensor gt = want_teacher ? at::empty({r.n, r.v}, r.s.options()) : at::Tensor();
  // The scale of the loss and its gradients: loss_scale, over the divisor for batchmean. batchmean with labels: the
  // divisor is counted on the device (no synchronisation); otherwise known here.
  at::Tensor inv_div;
  double inv_host = loss_scale;
  if (reduction == RED_BATCHMEAN) {
    if (r.labels.defined() && r.n > 0) {
      inv_div = at::empty({}, dopts);
      inv_count_kernel<<<1, 1024, 0, stream>>>(r.labels.data_ptr<int64_t>(), r.n, ignore_index, loss_scale,
                                               inv_div.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      inv_host = r.n > 0 ? loss_scale / static_cast<double>(r.n) : 0.0;
    }
  }
  if (r.n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.s.scalar_type(), "distill_forward", [&] {
      using T = scalar_t;
      using A = typename AccOf<T>::type;
      // Params of a launch over rows kr of the divergence of `b`, the student's gradient (where ws) into kr.g.
      auto params = [&](const KernelRows& kr, double b, bool ws) {
        Params<T, A> p = base_params<T, A>(kr.r, ignore_index, b, temperature, l);
        p.gs = ws ? kr.g.data_ptr<T>() : nullptr;
        p.gs_stride = ws ? kr.g.stride(0) : 0;
        p.scale_dev = scale_given ? scale_given : inv_div.defined() ? inv_div.data_ptr<double>() : nullptr;
        p.scale_host = inv_host;
        p.out = rows_loss.data_ptr<A>();
        return p;
      };
      // A fast kernel's launch: kr's copies of the given rows in, the kernel (the rows' losses into `losses`), the
      // gradient copied out of kr.g into g.
      auto run_fast = [&](const KernelRows& kr, const Rows& given, double b, bool ws, at::Tensor& losses,
                          at::Tensor& g) {
        kr.fill_inputs(given);
        launch_fast(l, mode_of(b), kr.r.topk(), ws, r.n, params(kr, b, ws), losses, stream,
                    !all_rows_on_grid(kr.r, kr.g));
        kr.gradient_out(g);
      };
      if (want_teacher && !r.topk()) {
        // The teacher's gradient (self-distillation) from the fast kernels too, as a student's: exchanging the two
        // rows and beta for 1 - beta leaves the divergence as it is (forward KL becomes reverse KL with the rows
        // exchanged, and the JSD's mixture (1 - beta) p_s + beta p_t is the same), so the teacher's gradient is
        // that launch's student gradient. Two launches, each reading both rows: 6 tensors' bytes where one kernel
        // could move 4, against rows_kernel's generic instance at 2.2 x (forward and reverse KL) and 4.5 x (the
        // JSD) the 4-tensor floor on an H200 (kernels/NOTES.md, version 58). The teacher's launch comes first: a
        // student gradient written over the student's logits (the fused head's) must follow every read of them.
        Rows exchanged = r;
        std::swap(exchanged.s, exchanged.t);
        const KernelRows kt = fast_layout(exchanged, l, gt, false);
        const KernelRows ks = want_student ? fast_layout(r, l, gs, false) : KernelRows{true, r, gs};
        if (kt.fast && ks.fast) {
          at::Tensor unused = want_student ? at::empty_like(rows_loss) : rows_loss;  // (its losses: the same)
          run_fast(kt, exchanged, 1.0 - beta, true, unused, gt);
          if (want_student) run_fast(ks, r, beta, true, rows_loss, gs);
          return;
        }
      }
      const KernelRows kr = fast_layout(r, l, gs, want_teacher);
      if (kr.fast) {
        run_fast(kr, r, beta, want_student, rows_loss, gs);
        return;
      }
      Params<T, A> p = params(kr, beta, want_student);
      p.gt = want_teacher ? gt.data_ptr<T>() : nullptr;
      const int cfg = want_teacher ? CFG_GENERIC : (want_student ? CFG_STUDENT : CFG_INFER);
      dispatch_mode(mode_of(beta), [&](auto mode_c) {
        constexpr int MODE = decltype(mode_c)::value;
        if (r.topk()) launch_for<T, MODE, true>(l, cfg, r.n, p, stream);
        else launch_for<T, MODE, false>(l, cfg, r.n, p, stream);
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (reduction == RED_NONE) return {scaled_rows(rows_loss, loss_scale), gs, gt};
  at::Tensor loss = at::empty({}, r.s.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES(acc, "distill_total", [&] {
    total_kernel<scalar_t><<<1, 1024, 0, stream>>>(rows_loss.data_ptr<scalar_t>(), r.n,
                                                   scale_given         ? scale_given
                                                   : inv_div.defined() ? inv_div.data_ptr<double>()
                                                                       : nullptr,
                                                   inv_host, loss.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss, gs, gt};
}

std::vector<at::Tensor> distill_phase(int64_t phase, const at::Tensor& student, const at::Tensor& teacher,
                                      const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                      double temperature, const c10::optional<at::Tensor>& norms,
                                      const c10::optional<at::Tensor>& ksums, const c10::optional<at::Tensor>& scale,
                                      bool want_student, bool want_teacher,
                                      const c10::optional<at::Tensor>& grad_student_out) {
  check_device(student);
  check_scalars(beta, temperature, RED_SUM);
  const Rows r = prepare_rows(student, teacher, c10::nullopt, c10::nullopt, labels);
  const c10::cuda::CUDAGuard guard(student.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto acc = acc_type(r.s.scalar_type());
  const int mode = mode_of(beta);
  TORCH_CHECK(phase >= PHASE_NORMS && phase <= PHASE_GRAD, "distill: unknown phase ", phase);
  if (phase != PHASE_NORMS) check_row_stats(opt(norms), r, 4, "the rows' normalisers");
  auto needs_k = [&](bool teacher_side) { return teacher_side ? mode != REVERSE_KL : mode != FORWARD_KL; };
  const bool ws = want_student && (phase == PHASE_TERMS ? !needs_k(false) : phase == PHASE_GRAD && needs_k(false));
  const bool wt = want_teacher && (phase == PHASE_TERMS ? !needs_k(true) : phase == PHASE_GRAD && needs_k(true));
  if (phase == PHASE_GRAD && (ws || wt)) check_row_stats(opt(ksums), r, 2, "the rows' K sums");
  const double* scale_dev = (ws || wt) ? device_scale(scale, r) : nullptr;
  at::Tensor out = phase == PHASE_NORMS   ? at::empty({r.n, 4}, r.s.options().dtype(acc))
                   : phase == PHASE_TERMS ? at::empty({r.n, 3}, r.s.options().dtype(acc))
                                          : at::Tensor();
  at::Tensor gs = ws ? grad_buffer(grad_student_out, r) : at::Tensor();
  at::Tensor gt = wt ? at::empty({r.n, r.v}, r.s.options()) : at::Tensor();
  if (r.n == 0 || (phase == PHASE_GRAD && !(ws || wt))) return {out, gs, gt};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.s.scalar_type(), "distill_phase", [&] {
    using T = scalar_t;
    using A = typename AccOf<T>::type;
    const Launch l = plan_launch(r.v, 2 * sizeof(T), false);
    check_in_place(gs, r, l);
    Params<T, A> p = base_params<T, A>(r, ignore_index, beta, temperature, l);
    p.phase = static_cast<int>(phase);
    p.gs = ws ? gs.data_ptr<T>() : nullptr;
    p.gs_stride = ws ? gs.stride(0) : 0;
    p.gt = wt ? gt.data_ptr<T>() : nullptr;
    p.scale_dev = scale_dev;
    p.norms_in = phase != PHASE_NORMS ? norms->data_ptr<A>() : nullptr;
    p.k_in = phase == PHASE_GRAD && (ws || wt) ? ksums->data_ptr<A>() : nullptr;
    p.out = out.defined() ? out.data_ptr<A>() : nullptr;
    // The fast kernel where it applies: no teacher gradient in this phase (ws: forward KL's gradient in the terms
    // phase, the others' in the gradient phase, which is not launched without one). Nor the JSD's terms where the
    // teacher's gradient follows: its kt must be summed from mixture_ut_exact's u_t, as the gradient phase's
    // teacher_grad subtracts it from (rows_kernel's generic terms do; phase_stream_kernel keeps its hot loop).
    const bool exact_kt = phase == PHASE_TERMS && want_teacher && mode == JSD;
    if (!wt && !exact_kt && fast_path_ok(r, l, gs, false)) {
      launch_fast_phase(mode, static_cast<int>(phase), ws, r.n, p, stream);
      return;
    }
    dispatch_mode(mode,
                  [&](auto mode_c) { launch_for<T, decltype(mode_c)::value, false>(l, CFG_GENERIC, r.n, p, stream); });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, gs, gt};
}

std::vector<at::Tensor> distill_combine(const at::Tensor& parts, int64_t reduction,
                                        const c10::optional<at::Tensor>& scale) {
  check_device(parts);
  const int64_t width = check_combine(parts, reduction, scale);
  const int64_t world = parts.size(0), n = parts.size(1);
  TORCH_CHECK(n < (int64_t(1) << 39), "distill: too many rows for one launch");  // blocks of 256 below 2^31
  const unsigned blocks = static_cast<unsigned>((n + 255) / 256);
  const c10::cuda::CUDAGuard guard(parts.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  std::vector<at::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(parts.scalar_type(), "distill_combine", [&] {
    using A = scalar_t;
    if (width == 4) {
      at::Tensor norms = at::empty({n, 4}, parts.options());
      if (n > 0) {
        combine_norms_kernel<A><<<blocks, 256, 0, stream>>>(parts.data_ptr<A>(), n, world, norms.data_ptr<A>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      result = {norms};
      return;
    }
    at::Tensor rows_loss = at::empty({n}, parts.options()), ksums = at::empty({n, 2}, parts.options());
    if (n > 0) {
      combine_terms_kernel<A>
          <<<blocks, 256, 0, stream>>>(parts.data_ptr<A>(), n, world, rows_loss.data_ptr<A>(), ksums.data_ptr<A>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (reduction == RED_NONE) {
      result = {ksums, rows_loss};
      return;
    }
    at::Tensor loss = at::empty({}, parts.options());
    total_kernel<A>
        <<<1, 1024, 0, stream>>>(rows_loss.data_ptr<A>(), n, scale->data_ptr<double>(), 1.0, loss.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    result = {ksums, loss};
  });
  return result;
}

at::Tensor distill_reduction_scale(const at::Tensor& rows, const c10::optional<at::Tensor>& labels,
                                   int64_t ignore_index, int64_t reduction, double factor) {
  check_device(rows);
  check_scale_labels(rows, labels, reduction, factor);
  const int64_t n = rows.size(0);
  const auto dopts = rows.options().dtype(at::kDouble);
  if (reduction != RED_BATCHMEAN) return at::full({}, factor, dopts);
  if (!labels.has_value() || n == 0) return at::full({}, n > 0 ? factor / static_cast<double>(n) : 0.0, dopts);
  const c10::cuda::CUDAGuard guard(rows.device());
  at::Tensor inv = at::empty({}, dopts);
  inv_count_kernel<<<1, 1024, 0, c10::cuda::getCurrentCUDAStream()>>>(labels->data_ptr<int64_t>(), n, ignore_index,
                                                                      factor, inv.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return inv;
}

// Pinned host memory that kernels write, registered with PyTorch's pinned-memory cache once they are queued (as a
// non-blocking copy into pinned memory is): should its tensor be freed before they have run, the cache does not
// hand the buffer out again until then. The event is recorded when this leaves scope, i.e. after every launch
// declared after it, whether the function returns or throws; the destructor never throws.
namespace {
struct PinnedUse {
  void* ptr = nullptr;
  void* ctx = nullptr;
  c10::Stream stream = c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CUDA, 0));
  void arm(void* p, void* c, c10::Stream s) {
    ptr = p;
    ctx = c;
    stream = s;
  }
  ~PinnedUse() {
    if (!ptr) return;
    try {
      at::getHostAllocator(at::kCUDA)->record_event(ptr, ctx, stream);
    } catch (...) {  // (a failing CUDA call here has its error raised by the next check)
    }
  }
};
}  // namespace

std::vector<at::Tensor> distill_topk_prepare(const at::Tensor& idx, const at::Tensor& lp, int64_t vocab,
                                             const c10::optional<at::Tensor>& labels, int64_t ignore_index,
                                             double slack_log, const c10::optional<at::Tensor>& flags_out) {
  check_device(idx);
  check_topk_prepare(idx, lp, labels, vocab, flags_out);
  const c10::cuda::CUDAGuard guard(idx.device());
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor out = at::empty({lp.size(0), lp.size(1) + 1}, lp.options());
  at::Tensor flags;
  int* dflags = nullptr;  // where the kernel writes them
  PinnedUse pinned_use;   // (declared before the launches: its destructor runs after them, on every path)
  if (flags_out.has_value()) {
    // Pinned host memory, zeroed here and written by the kernel through its mapped address: the eager step's
    // verdicts need no device buffer, memset or copy, each a call on its host path (the caller hands a buffer that
    // no kernel still writes, and records an event after this call before it reads the flags).
    flags = *flags_out;
    int* host = flags.data_ptr<int>();
    std::memset(host, 0, 3 * sizeof(int));
    void* mapped = nullptr;
    const cudaError_t err = cudaHostGetDevicePointer(&mapped, host, 0);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // (not left for the next launch's check to find)
      TORCH_CHECK(false, "distill: the top-k flags' tensor must be pinned host memory (pin_memory=True): ",
                  cudaGetErrorString(err));
    }
    dflags = static_cast<int*>(mapped);
    pinned_use.arm(host, flags.storage().data_ptr().get_context(), stream.unwrap());
  } else {
    // Zeroed by one memset, not at::zeros (a fill kernel through the dispatcher).
    flags = at::empty({3}, idx.options().dtype(at::kInt));
    dflags = flags.data_ptr<int>();
    C10_CUDA_CHECK(cudaMemsetAsync(dflags, 0, 3 * sizeof(int), stream));
  }
  const int64_t n = idx.size(0), k = idx.size(1);
  if (n == 0) return {out, flags};
  TORCH_CHECK(n < (int64_t(1) << 31), "distill: too many rows for one launch");
  const int64_t* lab = labels.has_value() ? labels->data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(lp.scalar_type(), "distill_topk_prepare", [&] {
    if (k <= kPrepWarpK) {
      constexpr int64_t rows = kPrepThreads / 32;
      topk_prepare_warp_kernel<scalar_t><<<static_cast<unsigned>((n + rows - 1) / rows), kPrepThreads, 0, stream>>>(
          idx.data_ptr<int64_t>(), lp.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, k, vocab, lab, ignore_index,
          slack_log, dflags);
    } else {
      topk_prepare_kernel<scalar_t><<<static_cast<unsigned>(n), kPrepThreads, 0, stream>>>(
          idx.data_ptr<int64_t>(), lp.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), k, vocab, lab, ignore_index,
          slack_log, k <= kDupCheckMax, dflags);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (k > kDupCheckMax) {  // rows too long to compare every pair in shared memory: sorted
    const at::Tensor srt = std::get<0>(idx.sort(1));
    const at::Tensor dup = srt.narrow(1, 1, k - 1).eq(srt.narrow(1, 0, k - 1)).any().reshape({1}).to(at::kInt);
    flags.narrow(0, FLAG_DUP, 1).copy_(dup, /*non_blocking=*/true);  // (stream-ordered into pinned memory too)
  }
  return {out, flags};
}

// The dynamic shared memory of topk_slice_kernel (its members' bitmap), raised above the default 48 KB where a
// slice is that long (over 393,216 entries).
template <typename K> size_t topk_slice_smem(K kernel, int64_t v, const at::Tensor& x) {
  const size_t bytes = static_cast<size_t>((v + 31) / 32) * sizeof(unsigned);
  if (bytes > 48 * 1024) {
    int most = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, x.get_device()));
    TORCH_CHECK(bytes <= static_cast<size_t>(most), "distill: a top-k teacher's vocabulary slice of ", v,
                " entries is longer than one block's bitmap holds on this GPU (", static_cast<int64_t>(most) * 8,
                " entries)");
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
  return bytes;
}

at::Tensor distill_topk_slice(const at::Tensor& student, const at::Tensor& norms, const at::Tensor& idx, int64_t offset,
                              double temperature) {
  check_device(student);
  check_topk_slice(student, norms, idx, offset, temperature);
  const int64_t n = student.size(0), v = student.size(1), k = idx.size(1);
  TORCH_CHECK(n < (int64_t(1) << 31) && k < (int64_t(1) << 31), "distill: too many rows or indices for one launch");
  at::Tensor part = at::empty({n, k + 1}, student.options().dtype(at::kDouble));
  if (n == 0) return part;
  const c10::cuda::CUDAGuard guard(student.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, student.scalar_type(), "distill_topk_slice", [&] {
    using A = typename AccOf<scalar_t>::type;
    auto kernel = topk_slice_kernel<scalar_t, A>;
    const size_t smem = topk_slice_smem(kernel, v, student);
    kernel<<<static_cast<unsigned>(n), kTopkSliceThreads, smem, stream>>>(
        student.data_ptr<scalar_t>(), student.stride(0), v, norms.data_ptr<A>(), idx.data_ptr<int64_t>(),
        static_cast<int>(k), offset, static_cast<A>(kLog2e / temperature), part.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return part;
}

at::Tensor distill_topk_slice_grad(const at::Tensor& student, const at::Tensor& norms, const at::Tensor& idx,
                                   int64_t offset, double temperature, const at::Tensor& g_buckets,
                                   const at::Tensor& whole, bool has_tail, const c10::optional<at::Tensor>& labels,
                                   int64_t ignore_index, const c10::optional<at::Tensor>& scale) {
  check_device(student);
  const auto acc = check_topk_slice(student, norms, idx, offset, temperature);
  check_topk_slice_grad(student, idx, g_buckets, whole, has_tail, labels, scale, acc);
  const int64_t n = student.size(0), v = student.size(1), k = idx.size(1);
  TORCH_CHECK(n < (int64_t(1) << 31) && k < (int64_t(1) << 31), "distill: too many rows or indices for one launch");
  at::Tensor grad = at::empty({n, v}, student.options());
  if (n == 0) return grad;
  const c10::cuda::CUDAGuard guard(student.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, student.scalar_type(), "distill_topk_slice_grad", [&] {
    using A = typename AccOf<scalar_t>::type;
    topk_slice_grad_kernel<scalar_t, A><<<static_cast<unsigned>(n), kTopkSliceThreads, 0, stream>>>(
        student.data_ptr<scalar_t>(), student.stride(0), v, norms.data_ptr<A>(), idx.data_ptr<int64_t>(),
        static_cast<int>(k), offset, static_cast<A>(kLog2e / temperature), g_buckets.data_ptr<A>(),
        static_cast<int>(g_buckets.size(1)), whole.data_ptr<double>(), has_tail,
        labels.has_value() ? labels->data_ptr<int64_t>() : nullptr, ignore_index,
        scale.has_value() ? scale->data_ptr<double>() : nullptr, grad.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad;
}

// ------------------------------------------------------------------ peer memory (distill_peer.cuh)
// A CUDA device's number as the peer functions take it, checked: cast to c10's 8-bit DeviceIndex unchecked, -1 was
// the current device and 256 device 0, silently (the buffer then on another GPU than the logits).
static void check_device_index(int64_t device) {
  TORCH_CHECK(device >= 0 && device < static_cast<int64_t>(c10::cuda::device_count()), "distill: no CUDA device ",
              device, " (", static_cast<int>(c10::cuda::device_count()), " here)");
}

std::vector<at::Tensor> distill_peer_alloc(int64_t world, int64_t cap, int64_t device) {
  TORCH_CHECK(world >= 1 && world <= kMaxPeers && cap >= 1, "distill: a peer buffer serves 1 to ", kMaxPeers,
              " ranks and at least one row, got ", world, " ranks and ", cap, " rows");
  // distill_peer.cuh's layout: slots[kPeerStages][2][world][cap][4] of 64-bit words
  const int64_t bytes = kPeerStages * 2 * world * cap * 4 * static_cast<int64_t>(sizeof(unsigned long long));
  check_device_index(device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(bytes)));
  C10_CUDA_CHECK(cudaMemset(ptr, 0, static_cast<size_t>(bytes)));
  C10_CUDA_CHECK(cudaDeviceSynchronize());  // zero before any rank can map it (set-up only)
  cudaIpcMemHandle_t h;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&h, ptr));
  at::Tensor handle = at::empty({static_cast<int64_t>(sizeof(h))}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(handle.data_ptr<uint8_t>(), &h, sizeof(h));
  at::Tensor address =
      at::full({1}, static_cast<int64_t>(reinterpret_cast<intptr_t>(ptr)), at::TensorOptions().dtype(at::kLong));
  return {handle, address};
}

int64_t distill_peer_map(const at::Tensor& handle, int64_t device) {
  cudaIpcMemHandle_t h;
  TORCH_CHECK(!handle.is_cuda() && handle.scalar_type() == at::kByte && handle.is_contiguous() &&
                  handle.numel() == static_cast<int64_t>(sizeof(h)),
              "distill: a peer buffer's handle is ", sizeof(h), " bytes on the CPU (distill_peer_alloc's)");
  std::memcpy(&h, handle.data_ptr<uint8_t>(), sizeof(h));
  check_device_index(device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  if (cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
    (void)cudaGetLastError();  // not an error of the stream's work: this GPU cannot map it (the caller falls back)
    return 0;
  }
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(ptr));
}

std::vector<at::Tensor> distill_peer_terms(const at::Tensor& student, const at::Tensor& teacher,
                                           const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                           double temperature, int64_t reduction, const at::Tensor& scale,
                                           bool want_student, bool want_teacher,
                                           const c10::optional<at::Tensor>& grad_student_out, const at::Tensor& peers,
                                           const at::Tensor& epoch, int64_t rank, int64_t cap) {
  check_device(student);
  check_scalars(beta, temperature, reduction);
  const Rows r = prepare_rows(student, teacher, c10::nullopt, c10::nullopt, labels);
  const int64_t world = peers.numel();
  TORCH_CHECK(peers.device() == r.s.device() && peers.scalar_type() == at::kLong && peers.dim() == 1 &&
                  peers.is_contiguous() && world >= 1 && world <= kMaxPeers && rank >= 0 && rank < world,
              "distill: peers must be 1 to ", kMaxPeers, " buffer addresses (int64, on the logits' device), rank ",
              "one of them");
  TORCH_CHECK(epoch.device() == r.s.device() && epoch.scalar_type() == at::kInt && epoch.numel() == 1,
              "distill: the peer call counter is one int32 on the logits' device");
  TORCH_CHECK(r.n <= cap, "distill: ", r.n, " rows, more than the peer buffers hold (", cap, ")");
  TORCH_CHECK(acc_type(r.s.scalar_type()) == at::kFloat,
              "distill: the peer exchange is for 16-bit and float32 "
              "logits (float64's normalisers are exchanged by all-gather)");
  // The arguments checked below only once the counter has moved, checked now too: the ranks match records by the
  // counter's value, so a refusal after the bump left this rank a call ahead of the others (they waited for its
  // records, or, were the call retried, read its stale ones).
  if (want_student || want_teacher || reduction != RED_NONE) (void)device_scale(scale, r);
  if (want_student && grad_student_out.has_value()) (void)grad_buffer(grad_student_out, r);
  PeerRows pr{};
  pr.slots = reinterpret_cast<const long long*>(peers.data_ptr<int64_t>());
  pr.epoch = reinterpret_cast<const unsigned*>(epoch.data_ptr<int>());
  pr.world = static_cast<int>(world);
  pr.rank = static_cast<int>(rank);
  pr.cap = cap;
  const c10::cuda::CUDAGuard guard(student.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  peer_bump_kernel<<<1, 1, 0, stream>>>(reinterpret_cast<unsigned*>(epoch.data_ptr<int>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int mode = mode_of(beta);
  // The JSD's 16-bit training rows may be summed again with the series (stage 2): every rank of the call takes
  // that round alike, whichever local form its slices take (the condition is the same on every rank).
  const bool series_round = mode == JSD && r.s.element_size() == 2 && want_student && !want_teacher;
  at::Tensor rows_loss = at::empty({r.n}, r.s.options().dtype(at::kFloat));
  at::Tensor ksums = at::empty({r.n, 2}, rows_loss.options());
  std::vector<at::Tensor> result;  // {norms or undefined, gs, gt}
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.s.scalar_type(), "distill_peer_terms", [&] {
    using T = scalar_t;
    using A = typename AccOf<T>::type;
    const Launch l = plan_launch(r.v, 2 * sizeof(T), false);
    const at::Tensor given =
        want_student && grad_student_out.has_value() ? grad_buffer(grad_student_out, r) : at::Tensor();  // (checked)
    // One read of the logits: forward KL, and the JSD's training rows (which exchange their sums in the kernel).
    // The JSD's training rows take it on every rank whose slice fits on chip, rows off the 16-byte grid copied
    // onto it first: inside the one-read kernel a row waits for every rank's terms (stage 1), so against a rank
    // that took the phases it deadlocks once the rows outnumber the clusters its GPU holds at once (that rank's
    // peer_norms_kernel needs every row's stage-0 record before its phase 1 can publish any terms, and the
    // one-read rank's rows not yet resident have published none). distill_peer.cuh, "Progress".
    const bool one_read = mode == FORWARD_KL || (mode == JSD && want_student);
    const bool jsd_rows = mode == JSD && want_student && !want_teacher;
    Rows rr = r;
    at::Tensor gs_at = given;  // where the kernel writes the student's gradient (undefined: a new buffer)
    if (jsd_rows && fast_allowed() && l.use_smem && !fast_path_ok(r, l, given, false)) {
      rr.s = on_grid(r.s);
      rr.t = on_grid(r.t);
      // Without a given buffer the padded one is the gradient (a view [n, v]); a given one gets it copied.
      gs_at = on_grid_like(given.defined() ? given : at::empty({r.n, r.v}, r.s.options()));
      TORCH_CHECK(fast_path_ok(rr, l, gs_at, false), "distill: internal: rows copied onto the grid still refused");
    }
    if (one_read && !want_teacher && fast_path_ok(rr, l, gs_at, false)) {
      at::Tensor gs = gs_at;
      if (want_student && !gs.defined()) gs = grad_buffer(grad_student_out, r);  // (a new one)
      check_in_place(given, r, l);
      at::Tensor terms;  // forward KL's: this slice's terms, for stage 1
      if (mode == FORWARD_KL) terms = at::empty({r.n, 3}, rows_loss.options());
      if (r.n > 0) {
        Params<T, A> p = base_params<T, A>(rr, ignore_index, beta, temperature, l);
        p.gs = want_student ? gs.data_ptr<T>() : nullptr;
        p.gs_stride = want_student ? gs.stride(0) : 0;
        p.scale_dev = want_student ? device_scale(scale, r) : nullptr;
        launch_split_rows(l, mode, want_student, r.n, p, pr, terms, rows_loss, stream);
      }
      if (given.defined() && !gs.is_same(given)) gs = given.copy_(gs);
      if (mode == FORWARD_KL) {
        peer_terms(terms, pr, r, ignore_index, false, rows_loss, ksums, stream);
      } else {  // the kernel's stages 1 and 2 gave it the rows' losses; no phase 2 needs the K sums
        C10_CUDA_CHECK(cudaMemsetAsync(ksums.data_ptr<float>(), 0, ksums.numel() * sizeof(float), stream));
      }
      result = {at::Tensor(), gs, at::Tensor()};
      return;
    }
    // Phase 0, the exchange alone, phase 1, stage 1 (the same records and combinations as a one-read rank's)
    const at::Tensor local = distill_phase(PHASE_NORMS, student, teacher, labels, ignore_index, beta, temperature,
                                           c10::nullopt, c10::nullopt, c10::nullopt, false, false, c10::nullopt)[0];
    at::Tensor norms = at::empty({r.n, 4}, local.options());
    if (r.n > 0) {
      peer_norms_kernel<<<static_cast<unsigned>((r.n + 127) / 128), 128, 0, stream>>>(
          reinterpret_cast<const float4*>(local.data_ptr<float>()), pr,
          r.labels.defined() ? r.labels.data_ptr<int64_t>() : nullptr, ignore_index, r.n,
          reinterpret_cast<float4*>(norms.data_ptr<float>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    std::vector<at::Tensor> ph =
        distill_phase(PHASE_TERMS, student, teacher, labels, ignore_index, beta, temperature, norms, c10::nullopt,
                      scale, want_student, want_teacher, grad_student_out);
    peer_terms(ph[0], pr, r, ignore_index, series_round, rows_loss, ksums, stream);
    result = {norms, ph[1], ph[2]};
  });
  at::Tensor loss = rows_loss;
  if (reduction != RED_NONE) {
    loss = at::empty({}, rows_loss.options());
    total_kernel<float>
        <<<1, 1024, 0, stream>>>(rows_loss.data_ptr<float>(), r.n, device_scale(scale, r), 1.0, loss.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {loss, ksums, result[0], result[1], result[2]};
}

bool distill_in_place_ok(int64_t vocab, int64_t element_size, bool topk) {
  return plan_launch(vocab, static_cast<size_t>(element_size) * (topk ? 1 : 2), topk).use_smem;
}

void distill_scale_grad_(at::Tensor grad, const at::Tensor& grad_out) {
  TORCH_CHECK(grad.is_cuda() && grad.dim() == 2 && grad.stride(1) == 1,
              "distill: scale_grad_ needs a [rows, vocab] CUDA tensor with unit stride along the vocabulary");
  TORCH_CHECK(grad_out.device() == grad.device() && (grad_out.numel() == 1 || grad_out.numel() == grad.size(0)),
              "distill: grad_output must hold one value or one per row, on the gradient's device");
  if (grad.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The loss's dtype (float32, or float64 for float64 logits) as it is; any other converted to double.
  const bool as_float = grad_out.scalar_type() == at::kFloat;
  const at::Tensor go =
      (as_float || grad_out.scalar_type() == at::kDouble ? grad_out : grad_out.to(at::kDouble)).contiguous();
  const bool per_row = go.numel() != 1 || grad.size(0) == 1;
  const int64_t n = grad.size(0), v = grad.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "distill_scale_grad", [&] {
    // The grid: one wave of resident blocks, looping over the chunks (a no-op call, the usual one, costs that
    // wave's launch).
    const int64_t per_row_chunks = scale_span_chunks<kScaleThreads, kScaleUnroll, scalar_t>(v);
    TORCH_CHECK(n <= std::numeric_limits<int64_t>::max() / per_row_chunks, "distill: gradient too large to scale");
    const auto launch = [&](auto kernel, const auto* factors) {
      const int64_t grid = min64(n * per_row_chunks, one_wave(reinterpret_cast<const void*>(kernel), kScaleThreads));
      kernel<<<static_cast<unsigned>(grid), kScaleThreads, 0, stream>>>(grad.data_ptr<scalar_t>(), n, v, grad.stride(0),
                                                                        factors, per_row, per_row_chunks);
    };
    if (as_float) launch(scale_rows_kernel<scalar_t, float>, go.data_ptr<float>());
    else launch(scale_rows_kernel<scalar_t, double>, go.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}
