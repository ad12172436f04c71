// The moment form's kernel (the math: distill_moment.h; included by distill.cu after distill_fast.cuh, not a
// standalone header): forward or reverse KL without a gradient, the launches of evaluation and of D3's forward
// alone. One block per row, each thread a running Moment over its 16-byte chunks straight from device memory
// (kMomentUnroll chunks of each tensor loaded before any is used, as phase_norms_kernel), then the threads' Moments
// merged over each warp and the warps' in a fixed order: deterministic, no atomics, no shared-memory copy of the
// row and no cluster. The row is read once, two exponentials an entry (fast_rows reads it once too, but keeps it in
// a cluster's shared memory and takes four exponentials an entry over two passes and a cluster barrier).
//
// A row whose moment form comes out NaN (distill_moment.h says when: a student -inf where the teacher has mass,
// padding at a large finite value, a NaN logit, ...) is taken again by the same block in the two-normaliser form,
// streaming from device memory (moment_fallback_row): the answer every other kernel gives, at about three reads of
// the row instead of one, for those rows only.
constexpr int kMomentThreads = 256, kMomentUnroll = 1;

// The block's Moments merged (each thread passes its own): warp by warp through shuffles (lane i takes lane i + o),
// then the warps' in order by thread 0. The row's loss (moment_loss) is returned to every thread.
template <bool SHIFT>
__device__ __forceinline__ float moment_block_loss(Moment<float> m, float k2, const MomentRef<float>& ref) {
  __shared__ Moment<float> slots[kMomentThreads / 32];
  __shared__ float result;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Moment<float> n;
    n.o = __shfl_down_sync(0xffffffffu, m.o, o);
    n.z = __shfl_down_sync(0xffffffffu, m.z, o);
    n.c = __shfl_down_sync(0xffffffffu, m.c, o);
    n.b = __shfl_down_sync(0xffffffffu, m.b, o);
    n.qo = __shfl_down_sync(0xffffffffu, m.qo, o);
    n.qs = __shfl_down_sync(0xffffffffu, m.qs, o);
    if (lane < o) moment_merge(m, n, k2);
  }
  if (lane == 0) slots[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    Moment<float> r = slots[0];
    for (int w = 1; w < kMomentThreads / 32; ++w) moment_merge(r, slots[w], k2);
    result = moment_loss<SHIFT>(r, k2, ref);
  }
  __syncthreads();
  return result;
}

// A thread's chunks of a row (p: P's logits, q: Q's; see distill_moment.h), then the block's loss.
template <typename T, bool SHIFT>
__device__ __forceinline__ float moment_row(const T* p, const T* q, int64_t v, float k2, const MomentRef<float>& ref) {
  constexpr int N = Vec<T>::N, U = kMomentUnroll;
  const int chunks = static_cast<int>(v / N);
  Moment<float> m = moment_empty<float>();
  for (int c0 = threadIdx.x; c0 < chunks; c0 += U * kMomentThreads) {
    Vec<T> vp[U], vq[U];
    load_chunk_pairs<kMomentThreads>(p, q, c0, chunks, vp, vq);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + u * kMomentThreads >= chunks) break;
      float xp[N], xq[N];
#pragma unroll
      for (int i = 0; i < N; ++i) {
        xp[i] = static_cast<float>(vp[u].v[i]);
        xq[i] = static_cast<float>(vq[u].v[i]);
      }
      moment_group<SHIFT>(m, xp, xq, k2, ref);  // a group of one chunk: e, d and x of N entries in registers
    }
  }
  if (threadIdx.x == 0 && v % N != 0) {  // the row's last entries, short of a chunk: padded with -inf
    float xp[N], xq[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int64_t j = static_cast<int64_t>(chunks) * N + i;
      xp[i] = j < v ? static_cast<float>(p[j]) : ninf<float>();
      xq[i] = j < v ? static_cast<float>(q[j]) : ninf<float>();
    }
    moment_group<SHIFT>(m, xp, xq, k2, ref);
  }
  return moment_block_loss<SHIFT>(m, k2, ref);
}

// The two-normaliser form of one row, streaming (no shared-memory copy): the rows' normalisers as
// phase_norms_kernel takes them, then every entry's point_terms; the row's loss to every thread.
template <typename T, int MODE>
__device__ __noinline__ float moment_fallback_row(const Params<T, float>& p, const T* s, const T* t) {
  constexpr int N = Vec<T>::N;
  __shared__ float4 slots[kMomentThreads / 32];
  __shared__ float total[kMomentThreads / 32];
  const float k2 = p.k2;
  const int chunks = static_cast<int>(p.v / N);
  float ms = ninf<float>(), ls = 0.f, mt = ninf<float>(), lt = 0.f;
  for (int c = threadIdx.x; c < chunks; c += kMomentThreads) {
    Vec<T> vs[1], vt[1];
    vs[0] = load_chunk(s + static_cast<int64_t>(c) * N, true);
    vt[0] = load_chunk(t + static_cast<int64_t>(c) * N, true);
    running_norm(vs, 1, k2, ms, ls);
    running_norm(vt, 1, k2, mt, lt);
  }
  if (threadIdx.x == 0 && p.v % N != 0) {
    Vec<T> vs[1], vt[1];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int64_t j = static_cast<int64_t>(chunks) * N + i;
      vs[0].v[i] = j < p.v ? s[j] : static_cast<T>(ninf<float>());
      vt[0].v[i] = j < p.v ? t[j] : static_cast<T>(ninf<float>());
    }
    running_norm(vs, 1, k2, ms, ls);
    running_norm(vt, 1, k2, mt, lt);
  }
  ms = scaled_max(ms, k2);
  mt = scaled_max(mt, k2);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    combine_pair(ms, ls, __shfl_xor_sync(0xffffffffu, ms, o), __shfl_xor_sync(0xffffffffu, ls, o));
    combine_pair(mt, lt, __shfl_xor_sync(0xffffffffu, mt, o), __shfl_xor_sync(0xffffffffu, lt, o));
  }
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = make_float4(ms, ls, mt, lt);
  __syncthreads();
  float4 a = slots[0];
  for (int w = 1; w < kMomentThreads / 32; ++w) {  // every thread, in the same order: the same values
    combine_pair(a.x, a.y, slots[w].x, slots[w].y);
    combine_pair(a.z, a.w, slots[w].z, slots[w].w);
  }
  const RowNorms<float> rn = row_norms(usable(Norm<float>{a.x, d_log2(a.y)}), usable(Norm<float>{a.z, d_log2(a.w)}));
  Terms<float> acc{0.f, 0.f, 0.f};
  for (int64_t j = threadIdx.x; j < p.v; j += kMomentThreads) {
    const float xs = static_cast<float>(s[j]), xt = static_cast<float>(t[j]);
    const Point<float> e = rn.close ? make_point<true>(xs, xt, k2, rn) : make_point<false>(xs, xt, k2, rn);
    point_terms<MODE, false, false>(e, p.c, acc);
  }
  const float l = warp_sum(acc.loss);
  if ((threadIdx.x & 31) == 0) total[threadIdx.x >> 5] = l;
  __syncthreads();
  float r = total[0];
  for (int w = 1; w < kMomentThreads / 32; ++w) r += total[w];
  return r;
}

// Forward (MODE FORWARD_KL: P the teacher) or reverse KL (P the student) of each row into p.out[row], 0 for a
// masked row. Rows start on 16-byte boundaries (moment_path_ok).
template <typename T, int MODE>
__global__ void __launch_bounds__(kMomentThreads, 4) moment_kernel(const Params<T, float> p) {
  static_assert(MODE != JSD, "the moment form is forward and reverse KL's");
  const int64_t row = blockIdx.x;
  if (p.labels && p.labels[row] == p.ignore_index) {
    if (threadIdx.x == 0) p.out[row] = 0.f;
    return;
  }
  const T* s = p.s + row * p.s_stride;
  const T* t = p.t + row * p.t_stride;
  const T* pp = MODE == FORWARD_KL ? t : s;
  const T* qq = MODE == FORWARD_KL ? s : t;
  const float k2 = p.k2;
  const MomentRef<float> ref = moment_reference(static_cast<float>(pp[0]), static_cast<float>(qq[0]), k2);
  float loss;
  if constexpr (sizeof(T) == 2) loss = moment_row<T, false>(pp, qq, p.v, k2, ref);
  else
    loss = moment_shift<T>(ref, k2) ? moment_row<T, true>(pp, qq, p.v, k2, ref)
                                    : moment_row<T, false>(pp, qq, p.v, k2, ref);
  if (loss != loss) loss = moment_fallback_row<T, MODE>(p, s, t);  // (the same value in every thread)
  if (threadIdx.x == 0) p.out[row] = loss;
}
