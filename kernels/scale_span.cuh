// A span of a gradient scaled in place by one factor, in 16-byte vectors: the backward's pass over a fused
// gradient when grad_output is not 1 (gradient accumulation's loss / steps, a weighted sum of losses, a loss
// scaler), for kldiv.cu's scale_kernel (the whole gradient, one span) and distill.cu's scale_rows_kernel (one span
// a row). It must stream at the bandwidth: one 2-byte entry at a time a thread left most of it unused (distill.cu's
// first scale_rows_kernel: 1522 GB/s of read + write on an H200; this form 3755).
#pragma once

#include <cstdint>
#include <cstring>

// The span comes in chunks of THREADS x UNROLL vectors, each a block's: a thread loads its UNROLL vectors before
// it stores any (UNROLL x 16 bytes in flight).
template <int THREADS, int UNROLL, typename T> __host__ __device__ constexpr int64_t scale_span_chunks(int64_t len) {
  constexpr int64_t vec = 16 / sizeof(T);
  return ((len + vec - 1) / vec + int64_t(THREADS) * UNROLL - 1) / (int64_t(THREADS) * UNROLL);  // any alignment
}

// Chunk `part` of g[0, len) times f, by a block of THREADS threads (all of them call it). The entries before g's
// first 16-byte boundary (a strided row may start anywhere) and after its last whole vector are chunk 0's. Each
// entry becomes static_cast<T>(static_cast<A>(entry) * f).
template <int THREADS, int UNROLL, typename T, typename A>
__device__ __forceinline__ void scale_span_chunk(T* g, int64_t len, A f, int64_t part) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t misalign = static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(g) & 15)) & 15) / sizeof(T);
  const int64_t head = misalign < len ? misalign : len;
  const int64_t body = (len - head) / VEC, tail = head + body * VEC;  // whole vectors; where the rest starts
  if (part == 0) {
    if (threadIdx.x < head) g[threadIdx.x] = static_cast<T>(static_cast<A>(g[threadIdx.x]) * f);
    if (threadIdx.x < len - tail) g[tail + threadIdx.x] = static_cast<T>(static_cast<A>(g[tail + threadIdx.x]) * f);
  }
  uint4* b = reinterpret_cast<uint4*>(g + head);
  const int64_t j0 = part * THREADS * UNROLL + threadIdx.x;
  uint4 x[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
    if (j0 + u * THREADS < body) x[u] = b[j0 + u * THREADS];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if (j0 + u * THREADS >= body) continue;
    T e[VEC];
    memcpy(e, &x[u], 16);
#pragma unroll
    for (int q = 0; q < VEC; ++q) e[q] = static_cast<T>(static_cast<A>(e[q]) * f);
    memcpy(&x[u], e, 16);
    b[j0 + u * THREADS] = x[u];
  }
}
