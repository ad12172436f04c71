// A top-k teacher over a vocabulary split across processes (included by distill.cu after its helpers; not a
// standalone header): the two kernels around the buckets' one-device kernel (kldiv_inline/vocab_parallel.py,
// topk_rows). Each rank holds a slice of the student's row; the k + 1 buckets need, per row, the log-probability of
// each member the slice holds and the slice's share of the tail's mass (topk_slice_kernel); after the gathered
// buckets' divergence, each entry's gradient is its bucket's (members) or its share of the tail's
// (topk_slice_grad_kernel). One block per row, reading the row in 16-byte chunks where it is aligned. The first
// kernel marks the slice's members in a bitmap in shared memory (one bit per entry: 8 KB for 64k entries), so a
// chunk's membership is one lookup. Before these kernels the same steps ran as ~50 PyTorch operations with float32
// copies of the whole slice (several GB at 4096 x 64k).
constexpr int kTopkSliceThreads = 256;

// The bitmap of the row's members that this slice holds (entries offset .. offset + v - 1), in shared memory.
__device__ __forceinline__ void mark_members(unsigned* bits, const int64_t* row_idx, int k, int64_t offset, int64_t v) {
  const int64_t words = (v + 31) / 32;
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0u;
  __syncthreads();
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int64_t e = row_idx[j] - offset;
    if (e >= 0 && e < v) atomicOr(bits + (e >> 5), 1u << (e & 31));
  }
  __syncthreads();
}

__device__ __forceinline__ bool is_member(const unsigned* bits, int64_t e) { return (bits[e >> 5] >> (e & 31)) & 1u; }

// The N membership bits of the chunk of entries e0 .. e0 + N - 1 (e0 a multiple of N, which divides 32).
template <int N> __device__ __forceinline__ unsigned chunk_members(const unsigned* bits, int64_t e0) {
  return (bits[e0 >> 5] >> (e0 & 31)) & ((1u << N) - 1u);
}

// part [n, k + 1] float64: column j < k the log2 probability of idx[row, j] where this slice holds it (else 0),
// column k the sum of the probabilities of the slice's other entries. A thread reads 16-byte chunks (kTopkSliceUnroll
// of them, 2 for double, loaded before any is used) where the row is 16-byte aligned, entries one by one elsewhere;
// each iteration's probabilities are summed in A, then into a double, and the block's warps' sums are added in a fixed
// order. (Entry by entry with a double add each, the kernel took 0.47 ms on a 4096 x 64128 bf16 slice on an H200,
// ~4 x its read; kernels/NOTES.md, version 18.)
template <typename T> constexpr int kTopkSliceUnroll = sizeof(T) == 8 ? 2 : 4;  // double: 4 spilled

template <typename T, typename A>
__global__ void __launch_bounds__(kTopkSliceThreads)
topk_slice_kernel(const T* __restrict__ s, int64_t s_stride, int64_t v, const A* __restrict__ norms,
                  const int64_t* __restrict__ idx, int k, int64_t offset, A k2, double* __restrict__ part) {
  constexpr int N = Vec<T>::N, U = kTopkSliceUnroll<T>;
  extern __shared__ unsigned bits[];
  __shared__ double sums[kTopkSliceThreads / 32];
  const int64_t row = blockIdx.x;
  const T* x = s + row * s_stride;
  const int64_t* row_idx = idx + row * k;
  double* out = part + row * (k + 1);
  const Norm<A> nm{norms[4 * row], norms[4 * row + 1]};  // combined: already usable()
  mark_members(bits, row_idx, k, offset, v);
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int64_t e = row_idx[j] - offset;
    out[j] = e >= 0 && e < v ? static_cast<double>(log2_prob(static_cast<A>(x[e]), k2, nm)) : 0.0;
  }
  double tail = 0.0;
  const int64_t chunks = aligned16(x) ? v / N : 0;  // a row off the 16-byte grid goes entry by entry
  for (int64_t c0 = threadIdx.x; c0 < chunks; c0 += kTopkSliceThreads * U) {
    Vec<T> xv[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (c0 + u * kTopkSliceThreads < chunks) xv[u] = load_chunk(x + (c0 + u * kTopkSliceThreads) * N, true);
    A sum = A(0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u * kTopkSliceThreads;
      if (c >= chunks) break;
      const unsigned m = chunk_members<N>(bits, c * N);
#pragma unroll
      for (int q = 0; q < N; ++q) {
        const A pv = d_exp2(log2_prob(static_cast<A>(xv[u].v[q]), k2, nm));
        sum += (m >> q) & 1u ? A(0) : pv;
      }
    }
    tail += static_cast<double>(sum);
  }
  for (int64_t e = chunks * N + threadIdx.x; e < v; e += blockDim.x)
    if (!is_member(bits, e)) tail += static_cast<double>(d_exp2(log2_prob(static_cast<A>(x[e]), k2, nm)));
  tail = warp_sum(tail);
  if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = tail;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < kTopkSliceThreads / 32; ++w) total += sums[w];
    out[k] = total;
  }
}

// grad [n, v]: a member's bucket's gradient, another entry's p_v g_tail / p_tail (0 without a tail or mass), each
// times the scale before rounding; zeros for a masked row. gb [n, gw]: the buckets' gradients (gw = k + has_tail);
// whole [n, k + 1]: the gathered sums, column k the tail's mass. Every entry is first written as a tail entry
// (16-byte chunks where the row is aligned), then, after a block barrier, the members this slice holds are written
// over with their buckets' gradients: no membership lookup per entry, and no bitmap.
template <typename T, typename A>
__global__ void __launch_bounds__(kTopkSliceThreads)
topk_slice_grad_kernel(const T* __restrict__ s, int64_t s_stride, int64_t v, const A* __restrict__ norms,
                       const int64_t* __restrict__ idx, int k, int64_t offset, A k2, const A* __restrict__ gb, int gw,
                       const double* __restrict__ whole, bool has_tail, const int64_t* __restrict__ labels,
                       int64_t ignore_index, const double* __restrict__ scale, T* __restrict__ grad) {
  constexpr int N = Vec<T>::N, U = kTopkSliceUnroll<T>;
  const int64_t row = blockIdx.x;
  T* g = grad + row * v;
  const bool masked = labels && labels[row] == ignore_index;
  const T* x = s + row * s_stride;
  const Norm<A> nm{norms[4 * row], norms[4 * row + 1]};  // combined: already usable()
  const A sc = static_cast<A>(scale ? *scale : 1.0);
  const double p_tail = whole[row * (k + 1) + k];
  // The tail's share per unit of probability, times the scale (0 for a masked row: zeros everywhere).
  const A coef = masked || !has_tail || !(p_tail > 0.0)
                     ? A(0)
                     : static_cast<A>(static_cast<double>(gb[row * gw + k]) / p_tail) * sc;
  const int64_t chunks = aligned16(x) && aligned16(g) ? v / N : 0;
  for (int64_t c0 = threadIdx.x; c0 < chunks; c0 += kTopkSliceThreads * U) {
    Vec<T> xv[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (c0 + u * kTopkSliceThreads < chunks && !masked)
        xv[u] = load_chunk(x + (c0 + u * kTopkSliceThreads) * N, true);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u * kTopkSliceThreads;
      if (c >= chunks) break;
      Vec<T> out;
#pragma unroll
      for (int q = 0; q < N; ++q)
        out.v[q] = static_cast<T>(masked ? A(0) : d_exp2(log2_prob(static_cast<A>(xv[u].v[q]), k2, nm)) * coef);
      store_chunk(g + c * N, out, true);
    }
  }
  for (int64_t e = chunks * N + threadIdx.x; e < v; e += blockDim.x)
    g[e] = static_cast<T>(masked ? A(0) : d_exp2(log2_prob(static_cast<A>(x[e]), k2, nm)) * coef);
  if (masked) return;
  __syncthreads();  // the members' writes land after the tail's writes of the same entries
  const int64_t* row_idx = idx + row * k;
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int64_t e = row_idx[j] - offset;
    if (e >= 0 && e < v) g[e] = static_cast<T>(gb[row * gw + j] * sc);
  }
}
