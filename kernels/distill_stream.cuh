// fast_stream_kernel: fast_rows' launches without the shared-memory copy (included by distill.cu after
// distill_fast.cuh; not a standalone header). A research variant, chosen by KLDIV_DISTILL_STREAM (1: plain loads,
// 2: with L2 eviction hints), for the instances whose row needs one cluster barrier: forward KL with the
// student's gradient, and every divergence without a gradient (16-bit logits). Same math, same results
// (make_point, point_terms, student_grad; the loss in the same per-warp partials for fast_rows_total_kernel).
//
// Why (kernels/NOTES.md, version 22): fast_rows' time on an H200 is about its issue-bound time plus the time to
// read its rows, as if the copy into shared memory and the arithmetic did not overlap (each block copies its
// slice, waits for it, then computes; only the other resident blocks can overlap it). Here each thread streams its
// own chunks through registers twice, every load of an iteration issued before any is used:
//   1. a running (max, sum of 2^(x k2 - max)) per thread for both rows (as phase_norms_kernel), then the warp's
//      pairs at the warp's maximum and one cluster barrier, as fast_rows;
//   2. the same chunks again, now in L1 or L2 (a block's slices are 32 KB and nothing holds shared memory, so an
//      SM's six blocks' slices may stay in its L1; the whole GPU's resident slices are ~25 MB of the 50 MB L2),
//      for the terms and the gradient, written as each chunk is done.
// A thread writes only entries it has read and no pass reads after the gradient's, so the gradient may be
// written over the student's logits. The forward alone's direct-form sum (version 20) falls back to the series by
// reading the thread's entries a third time.
constexpr int kStreamRowsUnroll = 1;

// L2 eviction policies for the two passes (HINT): the first pass's loads are to be kept until the second reads
// them, which is their last use.
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}

// One 16-byte chunk from device memory, cached in L1 and L2; with HINT under the L2 policy `pol`. Not the
// non-coherent path: the gradient may be written over these logits by the same thread later.
template <bool HINT, typename T> __device__ __forceinline__ Vec<T> load_chunk_l2(const T* src, uint64_t pol) {
  if constexpr (!HINT) {
    return *reinterpret_cast<const Vec<T>*>(src);
  } else {
    uint4 r;
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(src), "l"(pol));
    Vec<T> v;
    *reinterpret_cast<uint4*>(&v) = r;
    return v;
  }
}

// A thread's next U chunk pairs (c0, c0 + kFastThreads, ...; those at or past `chunks` left unset).
template <bool HINT, typename T, int U>
__device__ __forceinline__ void load_pairs_l2(const T* s, const T* t, int c0, int chunks, uint64_t pol, Vec<T> (&vs)[U],
                                              Vec<T> (&vt)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u * kFastThreads;
    if (c < chunks) {
      vs[u] = load_chunk_l2<HINT>(s + c * Vec<T>::N, pol);
      vt[u] = load_chunk_l2<HINT>(t + c * Vec<T>::N, pol);
    }
  }
}

// A (max, sum) pair of one thread, raw maximum mr (l taken at its scaled value, running_norm's convention), made
// the warp's: every lane ends with the warp's scaled maximum and its sum relative to it (part_sum applied, as
// fast_rows' warps publish theirs).
__device__ __forceinline__ void warp_norm_pair(float mr, float l, float k2, float& m_out, float& l_out) {
  const float m = mr == ninf<float>() ? ninf<float>() : scaled_max(mr, k2);
  const float g = warp_max(m);
  const float o = g == ninf<float>() ? 0.f : g;
  const float mine = l == 0.f ? 0.f : l * d_exp2(m - o);
  m_out = g;
  l_out = part_sum(warp_sum(mine), o);
}

template <typename T, int MODE, bool GRAD, bool HINT>
__device__ __forceinline__ void fast_stream(const Params<T, float>& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  constexpr int N = Vec<T>::N, U = kStreamRowsUnroll;
  static_assert(sizeof(T) == 2, "the streaming variant is compiled for 16-bit logits");
  static_assert(!(GRAD && student_needs_k<MODE>()), "one cluster barrier a row: no gradient that needs ks");
  __shared__ float4 slot_norms[kFastWarps];
  __shared__ float bcast[4];

  cg::cluster_group cluster = cg::this_cluster();
  const FastSlice sl = fast_slice(p, cluster);
  const int ranks = sl.ranks, count = sl.count, lane = sl.lane, warp = sl.warp;
  const T* gsrc = p.s + sl.row * p.s_stride + sl.lo;
  const T* gtsrc = p.t + sl.row * p.t_stride + sl.lo;
  T* gs = GRAD ? p.gs + sl.row * p.gs_stride + sl.lo : nullptr;
  float* partial = p.out + (sl.row * ranks + sl.rank) * kFastWarps;

  if (p.labels && p.labels[sl.row] == p.ignore_index) {  // masked: zeros, and no barrier (the cluster agrees)
    if (GRAD) zero_slice(gs, count);
    if (threadIdx.x < kFastWarps) partial[threadIdx.x] = 0.f;
    return;
  }
  const int chunks = count / N;
  const int tail = chunks * N + static_cast<int>(threadIdx.x);  // threads 0 .. N-2: the last partial chunk
  const bool has_tail = tail < count;
  const float k2 = p.k2;
  const uint64_t keep = HINT ? l2_evict_last_policy() : 0, last_use = HINT ? l2_evict_first_policy() : 0;

  // ---- 1. normalisers: running pairs per thread, the warp's, then one cluster barrier
  Norm<float> norm[2];
  {
    float ms = ninf<float>(), ls = 0.f, mt = ninf<float>(), lt = 0.f;
    for (int c0 = threadIdx.x; c0 < chunks; c0 += kFastThreads * U) {
      Vec<T> vs[U], vt[U];
      load_pairs_l2<HINT>(gsrc, gtsrc, c0, chunks, keep, vs, vt);
      const int valid = min(U, (chunks - c0 + kFastThreads - 1) / kFastThreads);
      running_norm(vs, valid, k2, ms, ls);
      running_norm(vt, valid, k2, mt, lt);
    }
    if (has_tail) {  // one entry, the rest of its chunk -inf
      Vec<T> vs[1], vt[1];
#pragma unroll
      for (int q = 0; q < N; ++q) vs[0].v[q] = vt[0].v[q] = static_cast<T>(ninf<float>());
      vs[0].v[0] = gsrc[tail];
      vt[0].v[0] = gtsrc[tail];
      running_norm(vs, 1, k2, ms, ls);
      running_norm(vt, 1, k2, mt, lt);
    }
    float4 w;
    warp_norm_pair(ms, ls, k2, w.x, w.y);
    warp_norm_pair(mt, lt, k2, w.z, w.w);
    if (lane == 0) slot_norms[warp] = w;
    cluster_arrive();
    cluster_wait();
    if (warp == 0) {  // every block combines all ranks x warps pairs in the same order
      float m0, l0, m1, l1;
      combine_cluster_pairs(cluster, slot_norms, ranks, lane, m0, l0, m1, l1);
      if (lane == 0) {
        bcast[0] = m0;
        bcast[1] = d_log2(l0);
        bcast[2] = m1;
        bcast[3] = d_log2(l1);
      }
    }
    __syncthreads();
    norm[0] = usable(Norm<float>{bcast[0], bcast[1]});
    norm[1] = usable(Norm<float>{bcast[2], bcast[3]});
  }
  cluster_arrive();  // this block reads no other's shared memory any more; wait before leaving
  const float scale = static_cast<float>((p.scale_dev ? *p.scale_dev : p.scale_host) * static_cast<double>(p.inv_t));
  const RowNorms<float> rn = row_norms(norm[0], norm[1]);

  // Visits this thread's entries with their points, from device memory (L1/L2 by now), in a loop compiled for
  // the row's offset choice; WRITE: what `f` returns is the entry's gradient (before the scale), stored.
  auto for_each_point = [&](auto write_c, auto&& f) {
    constexpr bool WRITE = decltype(write_c)::value;
    auto pass = [&](auto close_c) {
      constexpr bool CLOSE = decltype(close_c)::value;
      for (int c0 = threadIdx.x; c0 < chunks; c0 += kFastThreads * U) {
        Vec<T> vs[U], vt[U];
        load_pairs_l2<HINT>(gsrc, gtsrc, c0, chunks, last_use, vs, vt);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int c = c0 + u * kFastThreads;
          if (c >= chunks) break;
          Vec<T> g;
#pragma unroll
          for (int q = 0; q < N; ++q) {
            const float d =
                f(make_point<CLOSE>(static_cast<float>(vs[u].v[q]), static_cast<float>(vt[u].v[q]), k2, rn));
            if (WRITE) g.v[q] = static_cast<T>(d * scale);
          }
          if (WRITE) store_chunk(gs + c * N, g, true);
        }
      }
      if (has_tail) {
        const float d = f(make_point<CLOSE>(static_cast<float>(gsrc[tail]), static_cast<float>(gtsrc[tail]), k2, rn));
        if (WRITE) gs[tail] = static_cast<T>(d * scale);
      }
    };
    if (rn.close) pass(std::true_type{});
    else pass(std::false_type{});
  };

  // ---- 2. terms, and forward KL's gradient (fast_rows' terms loop: the direct form where no gradient is written)
  constexpr bool DIRECT = kDirectTerms && MODE != JSD && !GRAD;
  Terms<float> acc{0.f, 0.f, 0.f};
  float mass = 0.f;
  for_each_point(std::bool_constant<GRAD>{}, [&](const Point<float>& e) {
    if constexpr (DIRECT) {
      const bool fwd = MODE == FORWARD_KL;
      const float pp = fwd ? e.pt : e.ps, qq = fwd ? e.ps : e.pt;
      acc.loss += kl_term_direct(pp, qq, fwd ? e.d : -e.d);
      mass += pp + qq;
    } else {
      point_terms<MODE, false, false>(e, p.c, acc);
    }
    if constexpr (GRAD) return student_grad<MODE>(e, p.c, 0.f);
    else return 0.f;
  });
  if (DIRECT && !(acc.loss >= static_cast<float>(kDirectMin) * mass)) {  // this thread's entries again
    Terms<float> exact{0.f, 0.f, 0.f};
    for_each_point(std::false_type{}, [&](const Point<float>& e) {
      point_terms<MODE, false, false>(e, p.c, exact);
      return 0.f;
    });
    acc.loss = exact.loss;
  }
  const float loss = warp_sum(acc.loss);
  if (lane == 0) partial[warp] = loss;
  cluster_wait();  // no block leaves while another may still read its shared memory
#endif
}

// Six blocks of 256 threads an SM (40 registers): their slices (6 x 32 KB) about what the L1 holds with no shared
// memory in use. One chunk pair a thread in flight (kStreamRowsUnroll 1): two spilled up to 188 bytes at 40
// registers and up to 104 at 48 (ptxas, sm_90); 1536 threads' 32 bytes an SM cover the latency at the floor's rate.
template <typename T, int MODE, bool GRAD, bool HINT>
__global__ void __launch_bounds__(kFastThreads, 6) fast_stream_kernel(const Params<T, float> p) {
  fast_stream<T, MODE, GRAD, HINT>(p);
}
