// The top-k teacher's hot configuration (included by distill.cu after distill_fast.cuh; not a standalone header).
// Same math and results as rows_kernel's top-k branch (distill_common.h's functions over k + 1 buckets: the k
// tokens the teacher gave and the tail holding the rest of each distribution's mass; distill_cpu.cpp's row_topk is
// the plain statement), for 16-bit and float32 student logits whose slices fit in shared memory.
//
// What differs from rows_kernel, and why (kernels/NOTES.md, version 10): rows_kernel read the student's slice in
// four passes (max, sum, the tail's mass, the gradient) with eight block and three cluster barriers per row, and
// ran at 2.6 x the floor of reading the logits and writing their gradient on an H100. Here
//   - the membership bitmap (which entries are top-k tokens) is built while the slice's copy is in flight, so the
//     tail's mass is summed in the same pass as the normaliser, relative to the same warp maximum: three passes;
//   - one cluster barrier per row publishes each warp's (max, sum, non-member sum) and a bad-index flag; every
//     block combines them in the same order (identical normalisers and tail mass everywhere);
//   - every block then computes all k members' terms itself (the members' logits read from their owners' shared
//     memory, which lives until the last barrier): the loss and the row sum ks need no second cluster barrier;
//   - each thread copies and reads its own chunks of the slice (no block barrier after the copy), as fast_rows.
// A gradient written over the student's own logits (the fused head) is safe: after the copy every logit is read
// from shared memory, and a block's own slice is all it writes.

// Each thread's first member (j = threadIdx.x < k; every member where k <= THREADS, as k = 100 in blocks of 128)
// loaded once into registers, before the label's check, so that its latency hides behind the label's and the copy's,
// and not read again from device memory by each of the three loops over the members (their long-scoreboard waits
// were ~14% of the kernel's warp stall samples on an H200: kernels/NOTES.md, version 38). The index is held as 32
// bits (-1 for one outside the vocabulary) to keep the narrow instances within their 40 registers (no spill). Measured
// on an H200 (tools/distill_trees.py, two rounds, spreads 2 and 3): the top-k step 0.626 / 0.621 -> 0.611 / 0.610 ms
// and 0.623 / 0.628 -> 0.614 / 0.615 ms (-2.2% / -1.8%), every other case unchanged. false: every member read from
// device memory in each loop.
constexpr bool kTopkMemberRegs = true;

// The cluster's exchanges pushed (st.async into each receiver's shared memory, counted by bytes on its mbarrier)
// where they were a cluster barrier and reads of other blocks' shared memory: each warp's normaliser record is
// pushed to every other rank and written into its own block's (each block combines the ranks x warps records from
// its own shared memory, in the same order as before, so the same bits), and each first member's logit
// (kTopkMemberRegs' j = threadIdx.x) likewise by the block whose slice holds it. Where k <= the block's threads no
// block reads another's shared memory, so the barrier before leaving goes too. What it removes (Nsight Compute of the
// top-k step on an H200, kernels/NOTES.md version 40): the release fences of both cluster arrives
// (MEMBAR.ALL.GPU, 10.6% of the warp stall samples), the remote reads' latency in the combination and the members'
// pass, and the waits for the cluster's slowest block before leaving. Measured on an H200 (tools/distill_trees.py, two
// rounds): the top-k step's kernel 0.613 -> 0.590 ms (-3.9%), every other case unchanged. false: the exchanges as
// before (the same instruction counts as at version 41, some lines reordered: kernels/NOTES.md, version 42).
constexpr bool kTopkPush = true;
static_assert(!kTopkPush || kTopkMemberRegs, "kTopkPush pushes the members kTopkMemberRegs holds in registers");

// The row's label loaded first, and the first member's index checked against the vocabulary only after the label's
// test: the range check had come between the index's load and the label's, so the label's load was issued only once
// the index had arrived and a block waited for two loads one after the other at its start (11.7% of the kernel's
// warp stall samples on an H200: 7.8% on the index, 3.9% on the label; kernels/NOTES.md, version 42). Measured on an
// H200: the top-k step's kernel 0.590 -> 0.580 ms (-1.7%). false: the loads as before.
constexpr bool kTopkLabelFirst = true;

// Top-k teachers' student rows off the 16-byte grid (a vocabulary whose rows are not a whole number of 16-byte
// chunks, contiguous: GPT-2's 50257 in bfloat16) in fast_topk_kernel's SHIFT instances (fast_topk_rows), as
// fast_rows takes a full teacher's. false: such rows take the general kernel (rows_kernel, ~3-4 x slower), and the
// SHIFT instances are not compiled.
constexpr bool kTopkShift = true;
// The SHIFT instances' room below rank 0's slice in shared memory: a word for the head's members' bits, then 16
// bytes for its entries (fewer than a chunk), added to the launch's dynamic shared memory where some row is off
// the grid.
constexpr size_t kTopkHeadPad = 32;

// Tried and not kept (kernels/NOTES.md; the code is in the commits named there): the arrive before leaving relaxed,
// as fast_rows' kRelaxedLeave (+4% on the top-k step, version 39, 9c72496), and only rank 0's warp 0 waiting for
// the warps' member sums where the gradient needs none (-0.5%, version 41, bfa90f1); the 16-bit gradient pass with
// its factor folded into the exponent, as kJsdFoldedGrad (two instructions an entry fewer, +0.5%: version 44,
// e229bd5).

// SHIFT: the student's rows may start off the 16-byte grid (a vocabulary whose rows are not a whole number of
// 16-byte chunks, contiguous; the gradient's rows at the student's offsets: fast_path_ok), as fast_rows' SHIFT
// (fast_slice): the slices start at the row's first entry on the grid, and rank 0's head (fewer than a chunk)
// is copied one entry a thread, as the last rank's tail, into the kTopkHeadPad bytes below its slice in shared
// memory (so that xs[x - lo] holds a member x of the head as of the slice, for every reader, remote ones too),
// its members' bits in a word of their own. Without SHIFT the instances compile as before.
// THREADS: the block's threads (kFastThreads, or kNarrowThreads where kTopkNarrow says).
template <typename T, int MODE, bool GRAD, int THREADS = kFastThreads, bool SHIFT = false>
__device__ __forceinline__ void fast_topk_rows(const Params<T, float>& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  constexpr int N = Vec<T>::N;
  constexpr int W = THREADS / 32;
  constexpr bool KS = GRAD && student_needs_k<MODE>();  // the gradients need the row sum ks
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float4 slot_norms[W];  // each warp's (max, sum of 2^(x - max), max, the same sum over non-members)
  __shared__ float slot_bad[W];     // each warp's: a bad index seen (1) or not (0)
  __shared__ float2 slot_terms[W];  // each warp's members' (loss, ks)
  __shared__ float bcast[5];
  // kTopkPush: rank r's warp w's (max, sum, non-member sum, a bad index seen) at recv_norms[r * W + w]; the first
  // members' logits at recv_members[j]; their mbarriers.
  constexpr bool PUSH = kTopkPush;
  __shared__ __align__(16) float4 recv_norms[PUSH ? 16 * W : 1];
  __shared__ float recv_members[PUSH ? THREADS : 1];
  __shared__ __align__(8) unsigned long long push_bars[2];
  [[maybe_unused]] const unsigned bar_norms = smem_u32(&push_bars[0]), bar_members = smem_u32(&push_bars[1]);

  cg::cluster_group cluster = cg::this_cluster();
  const FastSlice sl = fast_slice<SHIFT>(p, cluster);
  const int ranks = sl.ranks, rank = sl.rank, count = sl.count, lane = sl.lane, warp = sl.warp;
  const int64_t row = sl.row, lo = sl.lo;
  const int head = SHIFT ? sl.head : 0;  // rank 0's entries before its slice (SHIFT), 0 elsewhere
  const T* gsrc = p.s + row * p.s_stride + lo;
  T* gs = GRAD ? p.gs + row * p.gs_stride + lo : nullptr;
  const int64_t* idx = p.idx + row * p.k;
  const float* lp = p.lp + row * (p.k + 1);  // (the prepared row: the teacher's tail mass at lp[k])
  [[maybe_unused]] int64_t label = 0;        // kTopkLabelFirst: the row's label, loaded before anything else
  if constexpr (kTopkLabelFirst) {
    if (p.labels) label = p.labels[row];
  }
  [[maybe_unused]] int x0 = -1;  // kTopkMemberRegs: member threadIdx.x's index (-1: outside the vocabulary)
  [[maybe_unused]] float l0 = 0.f;
  [[maybe_unused]] int64_t x_raw = -1;  // kTopkLabelFirst: the index as loaded, checked after the label's test
  const bool has0 = threadIdx.x < p.k;
  auto in_slice = [&](int64_t x) {  // a vocabulary index this block holds (SHIFT: rank 0's head too)
    if constexpr (SHIFT) return x >= lo - head && x < lo + count;
    else return x >= lo && x < lo + count;
  };
  if constexpr (kTopkMemberRegs) {
    if (has0) {
      const int64_t x = idx[threadIdx.x];
      if constexpr (kTopkLabelFirst) x_raw = x;
      else x0 = x < 0 || x >= p.v ? -1 : static_cast<int>(x);  // (a row in a cluster's shared memory: v < 2^21)
      l0 = lp[threadIdx.x];
    }
  }
  // Visits this thread's members j = threadIdx.x, + THREADS, ...: f(index, teacher log-probability).
  auto for_members = [&](auto f) {
    int64_t j = threadIdx.x;
    if constexpr (kTopkMemberRegs) {
      if (has0) f(static_cast<int64_t>(x0), l0);
      j += THREADS;
    }
    for (; j < p.k; j += THREADS) f(idx[j], lp[j]);
  };

  if (p.labels && (kTopkLabelFirst ? label : p.labels[row]) == p.ignore_index) {  // masked: zeros, and no barrier
    if (GRAD) zero_slice<THREADS>(gs, count, head);                               // (the cluster agrees)
    if (rank == 0 && threadIdx.x == 0) p.out[row] = 0.f;
    return;
  }
  if constexpr (kTopkLabelFirst && kTopkMemberRegs) x0 = x_raw < 0 || x_raw >= p.v ? -1 : static_cast<int>(x_raw);

  if constexpr (PUSH) {  // the mbarriers made ready for the cluster's pushes before any block pushes (cluster_wait)
    if (threadIdx.x == 0) {
      mbar_init(bar_norms, W + 1);  // the block's own warps' records arrive locally, the other ranks' as bytes
      mbar_init(bar_members, 1);
      mbar_expect(bar_norms, static_cast<unsigned>((ranks - 1) * W * sizeof(float4)));
      mbar_init_fence();
    }
    cluster_arrive_relaxed();
  }

  // The copy (issue_copy, as fast_rows): each thread its own chunks.
  // SHIFT: the head's members' bits (bit j for the entry lo - 1 - j) in the first word of kTopkHeadPad bytes, the
  // head's entries in its last 16 bytes, below the slice (a static __shared__ word would move the other instances'
  // shared memory, so their code)
  constexpr int PAD = SHIFT ? kTopkHeadPad : 0;
  [[maybe_unused]] unsigned* head_bits = reinterpret_cast<unsigned*>(smem_raw);
  T* xs = reinterpret_cast<T*>(smem_raw + PAD);
  unsigned* bits = reinterpret_cast<unsigned*>(smem_raw + PAD + static_cast<size_t>(p.slice) * sizeof(T));
  const int chunks = count / N;
  const unsigned bs = static_cast<unsigned>(__cvta_generic_to_shared(xs));
  const int mine = chunk_count<THREADS>(chunks);
  {
    const unsigned ds = bs + threadIdx.x * 16u;
    const T* s0 = pinned(gsrc + threadIdx.x * N);
    issue_copy(mine, p.staged,
               [&](int i) { cp_async16<kTopkL2Prefetch>(ds + i * (THREADS * 16u), s0 + i * (THREADS * N)); });
  }
  [[maybe_unused]] double scale_raw = 0.0;  // kEarlyScaleTopk: the scale before 1 / T, loaded during the copy
  if constexpr (kEarlyScaleTopk) scale_raw = p.base_scale();
  // The last block's partial chunk: threads 0 .. N-2 copy one entry each, by plain loads (the members' pass and
  // the gradient read every logit from shared memory: the gradient may overwrite the logits in device memory);
  // rank 0's head (SHIFT) threads N .. 2N-2, at indices -head .. -1: every "tail" below is such an entry.
  const int tid = static_cast<int>(threadIdx.x);
  const int tail = !SHIFT || tid < N ? chunks * N + tid : tid - N - head;
  const bool has_tail = !SHIFT || tid < N ? tail < count : tail < 0;
  float x_tail = ninf<float>();
  if (has_tail) {
    const T x = gsrc[tail];
    xs[tail] = x;
    x_tail = static_cast<float>(x);
  }

  // ---- membership, while the copy is in flight: a bit per entry of this slice; indices out of the vocabulary
  // (every block sees them) or repeated (the block holding them sees it) make the row NaN, as on the CPU.
  const int words = (count + 31) / 32;
  for (int w = threadIdx.x; w < words; w += THREADS) bits[w] = 0u;
  if constexpr (SHIFT) {
    if (threadIdx.x == 0) *head_bits = 0u;
  }
  if constexpr (PUSH) {  // (and the bytes of the first members' logits other blocks will push: 4 a valid index)
    const int pushed = __syncthreads_count(has0 && x0 >= 0 && !in_slice(x0));
    if (threadIdx.x == 0) mbar_expect(bar_members, static_cast<unsigned>(pushed) * 4u);
  } else {
    __syncthreads();
  }
  [[maybe_unused]] bool warp_bad;
  {
    bool bad = false;
    for_members([&](int64_t x, float) {
      if (x < 0 || x >= p.v) {
        bad = true;
      } else if (in_slice(x)) {
        // (the other instances' expressions kept as they were: written once for both, their code changed)
        if constexpr (SHIFT) {
          const int64_t i = x - lo;
          const unsigned bit = 1u << (i < 0 ? static_cast<int>(-1 - i) : (i & 31));
          if (atomicOr(i < 0 ? head_bits : &bits[i >> 5], bit) & bit) bad = true;
        } else {
          const unsigned bit = 1u << ((x - lo) & 31);
          if (atomicOr(&bits[(x - lo) >> 5], bit) & bit) bad = true;
        }
      }
    });
    bad = __any_sync(0xffffffffu, bad);
    if (!PUSH && lane == 0) slot_bad[warp] = bad ? 1.f : 0.f;  // (PUSH: in the norms' record)
    warp_bad = bad;
  }
  const float k2 = p.k2;

  // ---- 1. the normaliser and the tail's mass: each warp's max, then its sums relative to it, one cluster barrier
  float mx = ninf<float>();
  {
    const T* xs0 = xs + threadIdx.x * N;
    for_each_landed(mine, p.staged,
                    [&](int i) { mx = fmaxf(mx, chunk_max(load_chunk(xs0 + i * (THREADS * N), true))); });
    mx = fmaxf(mx, x_tail);
  }
  mx = scaled_max(warp_max(mx), k2);  // k2 > 0: the max of the scaled logits
  const float o = mx == ninf<float>() ? 0.f : mx;
  __syncthreads();  // the bitmap is complete (and the slice landed: every thread waited for its chunks)
  if constexpr (PUSH) {
    cluster_wait();  // every block's mbarriers are ready
    if (has0 && in_slice(x0)) {
      const float xv = static_cast<float>(xs[x0 - lo]);
      recv_members[threadIdx.x] = xv;  // this block's own (read by this thread only)
      const unsigned dst = smem_u32(&recv_members[threadIdx.x]);
      for (int r = 0; r < ranks; ++r)
        if (r != rank) push_f32(at_rank(dst, r), xv, at_rank(bar_members, r));
    }
  }
  // The teacher's tail mass (distill_topk_prepare's, beside its k log-probabilities: topk_tail), loaded here so
  // that the sums' pass hides its latency.
  const float q_tail_in = warp == 0 ? lp[p.k] : 0.f;
  float sm = 0.f, st = 0.f;  // all entries, non-members
  for (int c = threadIdx.x; c < chunks; c += THREADS) {
    const Vec<T> v = load_chunk(xs + c * N, true);
    const unsigned mb = bits[(c * N) >> 5] >> ((c * N) & 31);  // a chunk's N bits share a word
#pragma unroll
    for (int q = 0; q < N; ++q) {
      const float e = d_exp2(entry_float(v, q) * k2 - o);
      sm += e;
      st += (mb >> q) & 1u ? 0.f : e;
    }
  }
  if (has_tail) {
    const float e = d_exp2(x_tail * k2 - o);
    sm += e;
    const bool member = SHIFT && tail < 0 ? (*head_bits >> (-1 - tail)) & 1u : (bits[tail >> 5] >> (tail & 31)) & 1u;
    st += member ? 0.f : e;
  }
  sm = part_sum(warp_sum(sm), o);  // (a warp of padding beyond the lanes' range: a stand-in)
  st = part_sum(warp_sum(st), o);
  if constexpr (PUSH) {  // lane r pushes the warp's record to rank r; lane 0 writes this block's own
    const float4 rec = make_float4(mx, sm, st, warp_bad ? 1.f : 0.f);
    float4* mine = &recv_norms[rank * W + warp];
    if (lane == 0) {
      *mine = rec;
      mbar_arrive(bar_norms);
    }
    if (lane < ranks && lane != rank) push_f32x4(at_rank(smem_u32(mine), lane), rec, at_rank(bar_norms, lane));
    mbar_wait(bar_norms);
  } else {
    if (lane == 0) slot_norms[warp] = make_float4(mx, sm, mx, st);  // the same maxima: m1 ends equal to m0
    cluster_arrive();
    cluster_wait();
  }
  if (warp == 0) {  // every block combines all ranks x warps in the same order
    float m0, l0, m1, l1;
    bool bad = false;
    if constexpr (PUSH) {
      combine_records(
          ranks * W, lane,
          [&](int i) {
            const float4 r = recv_norms[i];
            return make_float4(r.x, r.y, r.x, r.z);
          },
          m0, l0, m1, l1);
      for (int i = lane; i < ranks * W; i += 32) bad |= recv_norms[i].w != 0.f;
    } else {
      combine_cluster_pairs<W>(cluster, slot_norms, ranks, lane, m0, l0, m1, l1);
      for (int i = lane; i < ranks * W; i += 32) bad |= *cluster.map_shared_rank(slot_bad + i % W, i / W) != 0.f;
    }
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) {
      bcast[0] = m0;
      bcast[1] = d_log2(l0);
      bcast[2] = l1 / l0;    // the student's tail mass
      bcast[3] = q_tail_in;  // the teacher's tail mass
      bcast[4] = bad ? 1.f : 0.f;
    }
  }
  __syncthreads();
  const Norm<float> ns = usable(Norm<float>{bcast[0], bcast[1]});
  const bool bad = bcast[4] != 0.f;

  // ---- 2. every block: all members' terms (their logits from their owners' shared memory), then the tail's
  auto member_point = [&](float x, float l) {
    const float ls2 = log2_prob(x, k2, ns);
    return bucket_point(d_exp2(ls2), ls2 * static_cast<float>(kLn2), d_exp(l), l);
  };
  // Members beyond the block's threads are read from their owners' shared memory (with kTopkPush too), so then no
  // block may leave before the others have read theirs (the same value in every block of the cluster).
  const bool reads_remote = !PUSH || p.k > THREADS;
  {
    Terms<float> acc{0.f, 0.f, 0.f};
    auto remote_member = [&](int64_t x, float l) {
      if (x < 0 || x >= p.v) return;  // the row is NaN (bad)
      T xv;
      if constexpr (SHIFT) {  // the slices start after the row's head; a member of the head is rank 0's
        const int64_t from = x - (lo - static_cast<int64_t>(rank) * p.slice);
        const int owner = from < 0 ? 0 : static_cast<int>(from / p.slice);
        xv = *cluster.map_shared_rank(xs + (from - static_cast<int64_t>(owner) * p.slice), owner);
      } else {
        const int owner = static_cast<int>(x / p.slice);
        xv = *cluster.map_shared_rank(xs + (x - static_cast<int64_t>(owner) * p.slice), owner);
      }
      point_terms<MODE, KS, false>(member_point(static_cast<float>(xv), l), p.c, acc);
    };
    if constexpr (PUSH) {
      mbar_wait(bar_members);
      if (has0 && x0 >= 0) point_terms<MODE, KS, false>(member_point(recv_members[threadIdx.x], l0), p.c, acc);
      for (int64_t j = threadIdx.x + THREADS; j < p.k; j += THREADS) remote_member(idx[j], lp[j]);
    } else {
      for_members(remote_member);
    }
    const float l = warp_sum(acc.loss), k = KS ? warp_sum(acc.ks) : 0.f;
    if (lane == 0) slot_terms[warp] = make_float2(l, k);
  }
  if (reads_remote) cluster_arrive();  // this block reads no other's shared memory any more; wait before leaving
  __syncthreads();
  if constexpr (PUSH) {  // both phases complete: every thread has waited on both mbarriers, every byte has landed
    if (threadIdx.x == 0) {
      mbar_inval(bar_norms);
      mbar_inval(bar_members);
    }
  }
  float loss = 0.f, ks = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w) {  // the same order in every thread and block
    loss += slot_terms[w].x;
    ks += slot_terms[w].y;
  }
  const float p_tail = bcast[2];
  const float q_tail = bcast[3];
  const Point<float> tp = bucket_point(p_tail, d_log(p_tail), q_tail, d_log(q_tail));
  if (p.k < p.v) {  // a tail bucket only where some of the vocabulary is outside the top-k
    Terms<float> ta{0.f, 0.f, 0.f};
    point_terms<MODE, KS, false>(tp, p.c, ta);
    loss += ta.loss;
    ks += ta.ks;
  }
  if (bad) loss = ks = std::numeric_limits<float>::quiet_NaN();
  if (rank == 0 && threadIdx.x == 0) p.out[row] = loss;

  // ---- 3. the gradient: a tail entry's share of its bucket's (p_v / p_tail), then the members' own over it
  if constexpr (GRAD) {
    if constexpr (!kEarlyScaleTopk) scale_raw = p.base_scale();
    const float scale = static_cast<float>(scale_raw * static_cast<double>(p.inv_t));
    const float coef = bad ? std::numeric_limits<float>::quiet_NaN()
                           : (tp.ps > 0.f ? student_grad<MODE>(tp, p.c, ks) / tp.ps : 0.f) * scale;
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
      const Vec<T> v = load_chunk(xs + c * N, true);
      Vec<T> g;
#pragma unroll
      for (int q = 0; q < N; ++q) g.v[q] = static_cast<T>(d_exp2(log2_prob(entry_float(v, q), k2, ns)) * coef);
      store_chunk(gs + c * N, g, true);
    }
    if (has_tail) gs[tail] = static_cast<T>(d_exp2(log2_prob(x_tail, k2, ns)) * coef);
    if (!bad) {         // (a bad row stays NaN everywhere; `bad` is the block's common value)
      __syncthreads();  // the members' gradients overwrite the tail formula written above
      for_members([&](int64_t x, float l) {
        if (in_slice(x))
          gs[x - lo] =
              static_cast<T>(student_grad<MODE>(member_point(static_cast<float>(xs[x - lo]), l), p.c, ks) * scale);
      });
    }
  }
  if (reads_remote) cluster_wait();  // no block leaves while another may still read its shared memory
#endif
}

template <typename T, int MODE, bool GRAD, bool SHIFT = false>
__global__ void __launch_bounds__(kFastThreads) fast_topk_kernel(const Params<T, float> p) {
  fast_topk_rows<T, MODE, GRAD, kFastThreads, SHIFT>(p);
}
// kTopkNarrow: the 16-bit training instances in blocks of kNarrowThreads threads, as fast_rows' narrow instances
// (kNarrowKsBlocks). Written for slices of ~17 KB (clusters of 16), where 128 threads at up to 40 registers let 12
// blocks share an SM (256-thread blocks at the 40 registers ptxas chooses fit 6; capped at 32, 8 fit but ptxas
// spilled 56-68 bytes and the step ran 17% slower on an H200: kernels/NOTES.md); but at 128256 entries plan_launch
// takes clusters of 8 (a 32 KB slice and its 2 KB bitmap under the 40 KB target), and shared memory lets 6 blocks
// share an SM (Nsight Compute on an H200: 24 warps an SM, where 256-thread blocks had 48 at the same 6 blocks).
// Measured on an H200: the top-k step's kernel -1.9% (0.620 against 0.632 ms, two rounds, two spreads). Clusters
// of 16 for it (KLDIV_DISTILL_CLUSTER=16, so 12 blocks an SM) were 19% slower (kernels/NOTES.md, version 40).
// false: the kernels compile as before.
constexpr bool kTopkNarrow = true;
template <typename T, int MODE, bool SHIFT = false>
__global__ void __launch_bounds__(kNarrowThreads, 12) fast_topk_kernel_narrow(const Params<T, float> p) {
  fast_topk_rows<T, MODE, true, kNarrowThreads, SHIFT>(p);
}
