// One 64-bit word of the peer exchange's records (distill_peer.cuh has the protocol): a float in the low half, the
// call's counter in the high half, stored and loaded relaxed at system scope (single-copy atomic, no fence), and
// the clock its waits are bounded by. A header of their own so that tools/probe_peer_latency.py times these very
// instructions (it includes this file); distill_peer.cuh includes it for the kit.

#pragma once

__device__ __forceinline__ void peer_store(unsigned long long* at, float v, unsigned e) {
  const unsigned long long w = (static_cast<unsigned long long>(e) << 32) | __float_as_uint(v);
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(at), "l"(w) : "memory");
}
__device__ __forceinline__ unsigned long long peer_load(const unsigned long long* at) {
  unsigned long long w;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(w) : "l"(at) : "memory");
  return w;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
