// The kit's read-bandwidth kernel: the floor a memory-bound kernel is measured against.
//
// It reads every byte of a buffer once and does as little else as possible: 16-byte loads, UNROLL of them
// in flight per thread before any arithmetic (enough bytes in flight to cover the memory latency), a grid
// sized to fill every SM at the kernel's occupancy, and a grid-stride loop so each block streams a share
// of the buffer. The bytes are folded with XOR and each block writes one word, so the compiler cannot drop
// a load; the XOR of the block words is the XOR of the buffer's 32-bit words (the test checks it).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kThreads = 512;

template <int UNROLL>
__global__ void __launch_bounds__(kThreads)
read_kernel(const uint4* __restrict__ data, const int64_t n_vec, uint32_t* __restrict__ block_words) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (UNROLL - 1) * stride < n_vec; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = __ldg(data + i + u * stride);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n_vec; i += stride) {
    const uint4 v = __ldg(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ uint32_t warp_words[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_words[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t w = 0;
#pragma unroll
    for (int k = 0; k < kThreads / 32; ++k) w ^= warp_words[k];
    block_words[blockIdx.x] = w;
  }
}

template <int UNROLL>
int64_t full_grid() {
  int dev = 0, sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_kernel<UNROLL>, kThreads, 0));
  return static_cast<int64_t>(std::max(per_sm, 1)) * sms;
}

template <int UNROLL>
at::Tensor launch(const at::Tensor& buffer) {
  const int64_t n_vec = buffer.nbytes() / 16;
  const int64_t grid = std::max<int64_t>(1, std::min(full_grid<UNROLL>(), (n_vec + kThreads - 1) / kThreads));
  at::Tensor words = at::empty({grid}, buffer.options().dtype(at::kInt));
  read_kernel<UNROLL><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint4*>(buffer.const_data_ptr()), n_vec, static_cast<uint32_t*>(words.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return words;
}

}  // namespace

at::Tensor read_floor(const at::Tensor& buffer, int64_t unroll) {
  TORCH_CHECK(buffer.is_cuda(), "read_floor: expected a CUDA tensor, got ", buffer.device());
  TORCH_CHECK(buffer.is_contiguous(), "read_floor: expected a contiguous tensor");
  TORCH_CHECK(buffer.nbytes() % 16 == 0 && buffer.nbytes() > 0,
              "read_floor: the buffer's size must be a positive multiple of 16 bytes, got ", buffer.nbytes());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(buffer.const_data_ptr()) % 16 == 0,
              "read_floor: the buffer must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(buffer.device());
  switch (unroll) {
    case 1:
      return launch<1>(buffer);
    case 2:
      return launch<2>(buffer);
    case 4:
      return launch<4>(buffer);
    case 8:
      return launch<8>(buffer);
    default:
      TORCH_CHECK(false, "read_floor: unroll must be 1, 2, 4 or 8, got ", unroll);
  }
}
