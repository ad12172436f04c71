// v3: v2 with one log per element instead of two: t * (log t - log p) = t * log(t / p), an IEEE division
// and one accurate logf (the literal formula stays for t == 0, p <= 0, inf, NaN and ratios that over- or
// underflow). The log of a number near 1 also avoids cancelling two logs of similar size. The float
// accumulators are emptied into a double every 8 iterations, which keeps the 1e-6 accuracy at 2^28 terms.
// This is the arithmetic of the production kernel (kernels/kldiv.cu), which adds every dtype, layout,
// reduction and the fused gradient.
#include "variant_common.cuh"

namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ float term(float pv, float tv) {
  const float r = tv / pv;
  if (tv > 0.0f && r >= 1.17549435e-38f && r <= 3.40282347e38f) return tv * logf(r);
  return (tv == 0.0f ? 0.0f : tv * logf(tv)) - tv * logf(pv);
}

__global__ void partial_kernel(const float* __restrict__ p, const float* __restrict__ t, int64_t n,
                               double* __restrict__ partials) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  double total = 0.0;
  int pending = 0;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const bool aligned = ((reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(t)) & 15) == 0;
  const int64_t nvec = aligned ? n / 4 : 0;
  const float4* p4 = reinterpret_cast<const float4*>(p);
  const float4* t4 = reinterpret_cast<const float4*>(t);
  int64_t i = tid;
  for (; i + stride < nvec; i += 2 * stride) {
    const float4 pa = __ldg(p4 + i), ta = __ldg(t4 + i), pb = __ldg(p4 + i + stride), tb = __ldg(t4 + i + stride);
    acc[0] += term(pa.x, ta.x) + term(pb.x, tb.x);
    acc[1] += term(pa.y, ta.y) + term(pb.y, tb.y);
    acc[2] += term(pa.z, ta.z) + term(pb.z, tb.z);
    acc[3] += term(pa.w, ta.w) + term(pb.w, tb.w);
    if (++pending == 8) {
      total += double(acc[0]) + double(acc[1]) + double(acc[2]) + double(acc[3]);
      acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
      pending = 0;
    }
  }
  for (; i < nvec; i += stride) {
    const float4 pa = __ldg(p4 + i), ta = __ldg(t4 + i);
    acc[0] += term(pa.x, ta.x);
    acc[1] += term(pa.y, ta.y);
    acc[2] += term(pa.z, ta.z);
    acc[3] += term(pa.w, ta.w);
  }
  for (int64_t j = nvec * 4 + tid; j < n; j += stride) acc[0] += term(p[j], t[j]);
  const double s = block_sum(total + double(acc[0]) + double(acc[1]) + double(acc[2]) + double(acc[3]));
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

}  // namespace

at::Tensor kl_div_probs_batchmean(const at::Tensor& predictions, const at::Tensor& targets) {
  return launch_batchmean<kThreads>(partial_kernel, predictions, targets);
}
