// The forward alone of forward and reverse KL (no gradient): one pass over each row, straight from device memory.
// Included by distill.cu after distill_fast.cuh (load_chunk_pairs, the fast kernels' conventions).
//
// Without a gradient to write, a KL of two softmax rows needs no entry's probability, only three sums: with P the
// weighting distribution (the teacher for forward KL, the student for reverse KL), Q the other, raw logits xa, xb,
// raw maxima ma, mb, scaled maxima oa = ma k2, ob = mb k2 (rounded) and references ca, cb near each row's maximum,
//   la = sum 2^(xa k2 - oa),  lb = sum 2^(xb k2 - ob),  w = sum 2^(xa k2 - oa) ((xa - ca) - (xb - cb)),
//   KL(P || Q) = E_P[a - b] - log Za + log Zb = K (w / la + (ca - ma) - (cb - mb)) + ln2 (ra - rb) + ln(lb / la),
// with K = k2 ln 2 (= 1 / T) and ra = ma k2 - oa, rb the scaled maxima's roundings (exact by an FMA). So an offset
// of either row's logits never enters a rounded term: each logit is taken from a reference near its own row's
// values (exact), and only then are the two rows' differences subtracted (xa - xb itself is rounded at the offset's
// size: float32 logits at +-1e4 lost 1e-4 of a KL of ~3 that way). Each entry costs two exponentials and ~19
// instructions in all (SASS of sm_90, bf16: 13 in the entry's own arithmetic, the rest the chunks' maxima, loads
// and loop), where fast_rows spends four exponentials and ~27 over a row held in a cluster's shared memory,
// issue-bound at ~1.9 x its 2-tensor floor on an H200; one block per row, no shared-memory copy, no cluster: the
// loads of phase_norms_kernel, which streams at ~4.7 TB/s. One H200: 0.44 ms for 4096 x 128256 bf16 rows, from
// fast_rows' 0.87 (kernels/NOTES.md, version 33).
//
// The price is the plain form's cancellation: the KL is the difference of terms of the size of the logits' spread
// over T, each good to ~4e-7 of its size (typical; ~3e-6 at worst: the float sums' ~50 roundings a thread),
// where fast_rows' non-negative summands keep ~1e-7 relative however small the KL (distill_common.h). So a row is
// trusted only where its KL is at least kStreamDirectMin times its largest term (and times 1, for terms below 1):
// there the plain form's error is ~6e-6 of the KL (typical), far less above it. Every other row (student and
// teacher nearly agree, or a large spread cancels to a small KL), and a row with anything
// not finite (NaN or infinite logits, -inf holes, a maximum beyond the offset limit), is summed again from device
// memory with the accurate summands of point_terms at the normalisers this pass found, as the split vocabulary's
// phases do: such a row costs a second read, every other row one.
// kStreamForward false: the forward alone stays fast_rows', and this kernel is not instantiated.
constexpr bool kStreamForward = true;
constexpr int kStreamFwdThreads = 256, kStreamFwdUnroll = 4;
constexpr float kStreamDirectMin = 1.f / 16;
// kRowRefs: every thread takes the references ca, cb from the row's first chunk (one 16-byte load of each row that
// the block's threads share) in place of its own first chunks' maxima, so that no part's reference differs from
// another's: no reference moves when parts combine (no rebasing of w), and dev, which weighs in the trust test, is
// 0. With each thread's own references, an emulation of the suite's rows (spread 2, T = 2) put kk dev / 16 at up
// to 0.87 of a row's KL, close to sending some of them to the second sum (kernels/NOTES.md, version 33). Not yet
// measured: false, the kernels compile as before.
constexpr bool kRowRefs = false;

// A part's (a thread's, a warp's, the block's) sums of one row: the weighting distribution's raw max and sum at
// its scaled max, the other's, the weighted differences w taken from the part's references ca, cb, and dev, how
// far the references merged into this part lay from its own (raw, for the trust test).
struct StreamSums { float ma, la, mb, lb, w, ca, cb, dev; };

// Two parts combined: each side's sums rescaled to the larger maxima (in scaled units: a side's sum is exact
// relative to its own scaled_max), its w moved to the reference of the side with mass. A side without mass (la 0)
// adds nothing (scaled by 0, never by 2^(-inf - -inf)); a NaN stays NaN.
__device__ __forceinline__ StreamSums combine_stream(const StreamSums& x, const StreamSums& y, float k2) {
  const float ga = fmaxf(x.ma, y.ma), gb = fmaxf(x.mb, y.mb);
  const float oa = scaled_max(ga, k2), ob = scaled_max(gb, k2);
  const float fx = x.la == 0.f ? 0.f : d_exp2(scaled_max(x.ma, k2) - oa);
  const float fy = y.la == 0.f ? 0.f : d_exp2(scaled_max(y.ma, k2) - oa);
  const float gx = x.lb == 0.f ? 0.f : d_exp2(scaled_max(x.mb, k2) - ob);
  const float gy = y.lb == 0.f ? 0.f : d_exp2(scaled_max(y.mb, k2) - ob);
  if constexpr (kRowRefs)  // (one reference for the whole row: w needs no move)
    return StreamSums{ga, x.la * fx + y.la * fy, gb, x.lb * gx + y.lb * gy, fx * x.w + fy * y.w, x.ca, x.cb, 0.f};
  const float ca = x.la != 0.f ? x.ca : y.ca, cb = x.la != 0.f ? x.cb : y.cb;
  const float dx = (x.ca - ca) - (x.cb - cb), dy = (y.ca - ca) - (y.cb - cb);  // (the references' moves)
  const float dev = fmaxf(x.la != 0.f ? x.dev + fabsf(dx) : 0.f, y.la != 0.f ? y.dev + fabsf(dy) : 0.f);
  const float w = fx * fmaf(x.la, dx, x.w) + fy * fmaf(y.la, dy, y.w);
  return StreamSums{ga, x.la * fx + y.la * fy, gb, x.lb * gx + y.lb * gy, w, ca, cb, dev};
}

__device__ __forceinline__ StreamSums shfl_xor(const StreamSums& v, int o) {
  if constexpr (kRowRefs)  // (the references are the row's in every lane, dev 0)
    return StreamSums{shfl_xor(v.ma, o),
                      shfl_xor(v.la, o),
                      shfl_xor(v.mb, o),
                      shfl_xor(v.lb, o),
                      shfl_xor(v.w, o),
                      v.ca,
                      v.cb,
                      v.dev};
  return StreamSums{shfl_xor(v.ma, o), shfl_xor(v.la, o), shfl_xor(v.mb, o), shfl_xor(v.lb, o),
                    shfl_xor(v.w, o),  shfl_xor(v.ca, o), shfl_xor(v.cb, o), shfl_xor(v.dev, o)};
}

// A thread's sums after `valid` more chunks of each row (va: the weighting row's, vb: the other's). `first`: the
// thread's first chunks, whose maxima set its references ca, cb (0 where they are not finite).
template <typename T, int U>
__device__ __forceinline__ void stream_update(const Vec<T> (&va)[U], const Vec<T> (&vb)[U], int valid, bool first,
                                              float k2, StreamSums& r) {
  float ga = ninf<float>(), gb = ninf<float>();
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (u < valid) {
      ga = fmaxf(ga, chunk_max(va[u]));
      gb = fmaxf(gb, chunk_max(vb[u]));
    }
  if (!kRowRefs && first) {
    r.ca = isfinite(ga) ? ga : 0.f;
    r.cb = isfinite(gb) ? gb : 0.f;
  }
  // (a maximum that grows rescales what is summed so far, as running_norm does; -inf - -inf is never formed)
  if (ga > r.ma) {
    if (r.la != 0.f) {
      const float f = d_exp2(scaled_max(r.ma, k2) - scaled_max(ga, k2));
      r.la *= f;
      r.w *= f;
    }
    r.ma = ga;
  }
  if (gb > r.mb) {
    if (r.lb != 0.f) r.lb *= d_exp2(scaled_max(r.mb, k2) - scaled_max(gb, k2));
    r.mb = gb;
  }
  const float oa = r.ma == ninf<float>() ? 0.f : scaled_max(r.ma, k2);
  const float ob = r.mb == ninf<float>() ? 0.f : scaled_max(r.mb, k2);
  // This group's sums first, then the running ones: ~32 entries a group, so a thread's ~500 terms of a 128k row
  // are rounded ~20 + 32 times, not ~500.
  float sa = 0.f, sb = 0.f, sw = 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (u < valid)
#pragma unroll
      for (int q = 0; q < Vec<T>::N; ++q) {
        const float xa = entry_float(va[u], q), xb = entry_float(vb[u], q);
        const float ea = d_exp2(xa * k2 - oa);
        sa += ea;
        sb += d_exp2(xb * k2 - ob);
        // (an entry without P's mass adds 0, even where xa - xb is NaN: -inf - -inf, padding)
        sw = fmaf(ea, fmaxf((xa - r.ca) - (xb - r.cb), -std::numeric_limits<float>::max()), sw);
      }
  r.la = part_sum(r.la + sa, oa);  // (a part beyond the offset limit: a stand-in, as running_norm's)
  r.lb = part_sum(r.lb + sb, ob);
  r.w += sw;
}

// The row's KL from its sums in the plain form (the top of this file), or NaN where that form is not to be trusted
// (the row is then summed again with point_terms).
__device__ __forceinline__ float stream_direct_kl(const StreamSums& r, float k2) {
  const float oa = scaled_max(r.ma, k2), ob = scaled_max(r.mb, k2);
  const bool usable_sums =
      isfinite(r.w) && isfinite(r.la) && isfinite(r.lb) && r.la > 0.f && r.lb > 0.f && offset_ok(oa) && offset_ok(ob);
  if (!usable_sums) return std::numeric_limits<float>::quiet_NaN();
  const float kk = k2 * static_cast<float>(kLn2);
  const float ra = fmaf(r.ma, k2, -oa), rb = fmaf(r.mb, k2, -ob);  // (exact: the products' roundings)
  const float mean = kk * (r.w / r.la), shift = kk * ((r.ca - r.ma) - (r.cb - r.mb));
  const float kl = (mean + shift) + (static_cast<float>(kLn2) * (ra - rb) + logf(r.lb / r.la));
  const float largest = fmaxf(fmaxf(fabsf(mean), fabsf(shift)), kk * r.dev);
  return kl >= kStreamDirectMin * fmaxf(1.f, largest) ? kl : std::numeric_limits<float>::quiet_NaN();
}

// SHIFT: rows may start off the 16-byte grid, each with its teacher's row at the same offset from it (fast_path_ok):
// the instance launched where some row does; the other compiles as before such rows were taken.
template <typename T, int MODE, bool SHIFT = false>
__global__ void __launch_bounds__(kStreamFwdThreads) stream_forward_kernel(const Params<T, float> p) {
  static_assert(MODE == FORWARD_KL || MODE == REVERSE_KL, "the JSD has no plain three-sum form");
  constexpr int N = Vec<T>::N, U = kStreamFwdUnroll, WARPS = kStreamFwdThreads / 32;
  constexpr bool FWD = MODE == FORWARD_KL;  // weighting by the teacher
  __shared__ StreamSums slots[WARPS];
  __shared__ float row_kl;
  __shared__ float4 norms;  // the accurate pass's (student's mx, lz, teacher's mx, lz)
  const int64_t row = blockIdx.x;
  if (p.labels && p.labels[row] == p.ignore_index) {  // masked: 0, as every kernel writes it
    if (threadIdx.x == 0) p.out[row] = 0.f;
    return;
  }
  // A row off the 16-byte grid is taken from its first entry on the grid, s and t pointing there; its head, the
  // entries before (fewer than a chunk), lies at -head .. -1.
  const int head = SHIFT ? static_cast<int>(min64(row_head(p.s + row * p.s_stride), p.v)) : 0;
  const T* s = p.s + row * p.s_stride + head;
  const T* t = p.t + row * p.t_stride + head;
  const T* a = FWD ? t : s;
  const T* b = FWD ? s : t;
  const float k2 = p.k2;
  const int count = static_cast<int>(p.v) - head;
  const int chunks = count / N;
  StreamSums r{ninf<float>(), 0.f, ninf<float>(), 0.f, 0.f, 0.f, 0.f, 0.f};
  if constexpr (kRowRefs) {
    if (chunks > 0) {  // the row's first chunk's maxima (0 where not finite), the same in every thread
      const float ga = chunk_max(load_chunk(a, true)), gb = chunk_max(load_chunk(b, true));
      r.ca = isfinite(ga) ? ga : 0.f;
      r.cb = isfinite(gb) ? gb : 0.f;
    }
  }
  for (int c0 = threadIdx.x; c0 < chunks; c0 += kStreamFwdThreads * U) {
    Vec<T> va[U], vb[U];
    load_chunk_pairs<kStreamFwdThreads>(a, b, c0, chunks, va, vb);
    const int valid = min(U, (chunks - c0 + kStreamFwdThreads - 1) / kStreamFwdThreads);
    stream_update(va, vb, valid, c0 == static_cast<int>(threadIdx.x), k2, r);
  }
  // The row's last entries, short of a chunk, and (SHIFT) its head before its first chunk: padded with -inf
  if (threadIdx.x == 0 && (count % N != 0 || head > 0)) {
    constexpr int PARTS = SHIFT ? 2 : 1;
    Vec<T> va[PARTS], vb[PARTS];
#pragma unroll
    for (int q = 0; q < N; ++q) {
      const int j = chunks * N + q;
      va[0].v[q] = j < count ? a[j] : static_cast<T>(ninf<float>());
      vb[0].v[q] = j < count ? b[j] : static_cast<T>(ninf<float>());
      if constexpr (SHIFT) {
        const int h = q - N;
        va[1].v[q] = h >= -head ? a[h] : static_cast<T>(ninf<float>());
        vb[1].v[q] = h >= -head ? b[h] : static_cast<T>(ninf<float>());
      }
    }
    stream_update(va, vb, PARTS, chunks == 0, k2, r);
  }
  // The row's sums: each warp's, then the warps' in a fixed order (deterministic).
  r = warp_fold<32>(r, [k2](const StreamSums& x, const StreamSums& y) { return combine_stream(x, y, k2); });
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = r;
  __syncthreads();
  if (threadIdx.x == 0) {
    StreamSums all = slots[0];
    for (int w = 1; w < WARPS; ++w) all = combine_stream(all, slots[w], k2);
    const float kl = stream_direct_kl(all, k2);
    row_kl = kl;
    if (kl == kl) {
      p.out[row] = kl;
    } else {  // the normalisers as phase_norms_kernel and combine_row_norms give them, for point_terms
      const Norm<float> na = usable(Norm<float>{scaled_max(all.ma, k2), d_log2(all.la)});
      const Norm<float> nb = usable(Norm<float>{scaled_max(all.mb, k2), d_log2(all.lb)});
      const Norm<float> ns = FWD ? nb : na, nt = FWD ? na : nb;
      norms = make_float4(ns.mx, ns.lz, nt.mx, nt.lz);
    }
  }
  __syncthreads();
  if (row_kl == row_kl) return;  // (the block agrees: one shared value)

  // The accurate pass: the row again, each entry's non-negative summand (kl_term and its series).
  const float4 nr = norms;
  const RowNorms<float> rn = row_norms(Norm<float>{nr.x, nr.y}, Norm<float>{nr.z, nr.w});
  Terms<float> acc{0.f, 0.f, 0.f};
  auto pass = [&](auto close_c) {
    constexpr bool CLOSE = decltype(close_c)::value;
    auto entry = [&](float xs, float xt) {
      point_terms<MODE, false, false>(make_point<CLOSE>(xs, xt, k2, rn), p.c, acc);
    };
    for (int c0 = threadIdx.x; c0 < chunks; c0 += kStreamFwdThreads * U) {
      Vec<T> vs[U], vt[U];
      load_chunk_pairs<kStreamFwdThreads>(s, t, c0, chunks, vs, vt);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c0 + u * kStreamFwdThreads < chunks)
#pragma unroll
          for (int q = 0; q < N; ++q) entry(entry_float(vs[u], q), entry_float(vt[u], q));
    }
    for (int j = chunks * N + static_cast<int>(threadIdx.x); j < count; j += kStreamFwdThreads)
      entry(static_cast<float>(s[j]), static_cast<float>(t[j]));
    if constexpr (SHIFT)
      for (int j = static_cast<int>(threadIdx.x) - head; j < 0; j += kStreamFwdThreads)  // the head
        entry(static_cast<float>(s[j]), static_cast<float>(t[j]));
  };
  if (rn.close) pass(std::true_type{});
  else pass(std::false_type{});
  __shared__ float loss_slots[WARPS];
  const float l = warp_sum(acc.loss);
  if ((threadIdx.x & 31) == 0) loss_slots[threadIdx.x >> 5] = l;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = loss_slots[0];
    for (int w = 1; w < WARPS; ++w) total += loss_slots[w];
    p.out[row] = total;
  }
}
