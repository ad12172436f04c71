// The hot configuration of the distillation kernel, with fewer barriers (included by distill.cu after its
// helpers; not a standalone header). Same math, same results as rows_kernel (the functions of distill_common.h),
// for the launches that dominate training and inference: 16-bit or float32 logits, a full teacher row, slices in
// shared memory, rows aligned to 16 bytes, one device, the student's gradient or none.
//
// What differs from rows_kernel, and why (kernels/NOTES.md, version 5): rows_kernel spent a third of its stalls
// at 12 barriers per row, four of them cluster-wide. Here
//   - each thread copies and later reads only its own chunks of the slice: no block barrier after the copy;
//   - each warp finds its maximum and its sums of exponentials without leaving the warp (shuffles); warp 0 of
//     each block combines its block's, one cluster barrier publishes them, and warp 0 of each block combines the
//     blocks' in the same fixed order (so every block holds identical normalisers; cluster_fold);
//   - the loss is not reduced across the cluster: each warp writes its partial sum, and a small kernel adds a
//     row's partials in a fixed order (deterministic);
//   - the barrier that keeps a block's shared memory alive while others read it is split: arrive right after
//     the last remote read, wait just before the block exits, with the whole gradient pass in between.
// Forward KL and inference need one full cluster barrier per row; reverse KL and the JSD (whose gradients need
// the row sum ks) two; the JSD's 16-bit rows summed again with its series (below kJsdDirectMin) three.
//
// At the end, the split vocabulary's kernels, which keep nothing on chip: phase_norms_kernel (phase 0, the rows'
// normalisers) and phase_stream_kernel (phases 1 and 2).

#include "distill_peer.cuh"  // (PeerRows: fast_rows' SPLIT instances wait for the other ranks' normalisers)

constexpr int kFastThreads = 256;
constexpr int kFastWarps = kFastThreads / 32;
// fast_rows' training instances that need ks (reverse KL, the JSD; 16-bit logits) in blocks of kNarrowThreads
// threads, uncapped (`__launch_bounds__(kNarrowThreads, 7)`: 55-70 registers), where every other instance keeps
// kFastThreads capped at 32 registers. Measured as a whole-kernel change on H200s (kernels/NOTES.md, after
// version 23): reverse KL's step -6%, the JSD step -4% to -4.5%, the one-barrier launches 0 to +1%. false: every
// kernel compiles to the instructions it had before (tools/sass_compare.py), to measure against.
constexpr bool kNarrowKsBlocks = true;
constexpr int kNarrowThreads = 128;
// Rows whose slices overflow the 40 KB shared-memory target (bfloat16 rows beyond 163840 entries: Gemma's 256000)
// take 64 KB or more a block, three blocks an SM at most: in kNarrowThreads blocks that is 12 warps an SM to hide the
// copy's and the cluster barriers' latency, against 28 at 128256 entries. Their 16-bit training rows (one device,
// rows on the 16-byte grid) take blocks of kWideThreads with the narrow instances' forms and no register cap beyond
// three blocks an SM's (fast_rows_kernel_wide): 24 warps an SM. Measured at 4096 x 256000 bf16 on an H200
// (kernels/NOTES.md, version 57): forward KL's step -7.8%, the JSD's -5.1%, reverse KL's -1.3%; rows off the grid
// (SHIFT) keep the narrow blocks (six instances fewer to compile). false: they take the narrow instances, as before.
constexpr bool kWideLongRows = true;
constexpr int kWideThreads = 256;
// The JSD's bfloat16 training rows keep each entry's u_s from the terms pass, in 16 bits over the teacher's logit
// in shared memory (dead after that pass), so the gradient pass forms only ps (1 MUFU) where it formed ps, e^d and
// log z (3): kernels/NOTES.md, "The JSD step after version 23". u_s is stored as fp16 times kKeptUsScale (so that
// |u_s| down to ~1e-7 stays a normal fp16 number, 11 significant bits; where ps > 0, |u_s| < ~90 and the product
// stays below fp16's 65504). A row summed again with the series reads the teacher's logits from device memory.
// Not for float16 logits: the kept u_s is rounded by up to 2^-11 |u_s|, which in the gradient ps (u_s - ks) is
// 2^-11 |u_s| / |u_s - ks| relative: as large as a float16 gradient's own rounding (2^-11) wherever
// |u_s| >~ |u_s - ks|, and below 1/8 of a bfloat16 gradient's (2^-8) there. false: the kernels compile as before.
constexpr bool kJsdKeepUs = true;
constexpr float kKeptUsScale = 512.f;
// The kept u_s is the terms pass's own (jsd_entry_direct's z form, good to ~3.5e-7 absolute), without the 4-term
// series that mixture_us_short takes below |d| = kJsdShortSeries to keep u_s's relative digits: those digits
// matter where the gradient ps (u_s - ks) is itself small across the row, in rows whose student and teacher nearly
// agree (ks and every u_s small); those have a JSD below kJsdDirectMin and are summed again with the series, which
// then writes their u_s again in mixture_us_short's forms (the gradient of such a row is what it was; a tree
// without that rewrite fails test_jsd_gradient_of_small_logits_that_nearly_agree on an H200). In a row above it
// the absolute ~3.5e-7 is at most about the kept u_s's own fp16 rounding (2^-11 |u_s|) wherever |u_s| > ~7e-4;
// elsewhere it is the error of entries whose gradient ~ps ks is small against the row's. The series cost ~9
// instructions an entry in the terms pass (predicated, so issued by every entry; 2 of them constant loads): that
// loop 45.5 -> 36.6 instructions an entry, the JSD step -8% on an H200 (kernels/NOTES.md, version 27). false: the
// kernels compile as before.
constexpr bool kKeptUsDirect = true;
// The JSD's bfloat16 terms pass forms its points with the mixture's weights in the probabilities, e.ps = (1 - beta)
// ps and e.pt = beta pt, by taking log2 of the weights into the rows' normalisers (once a thread): the summand
// (1 - beta) ps u_s + beta pt u_t (jsd_entry_weighted) then needs two multiplications an entry fewer, and ks sums
// the student's part, (1 - beta) ps u_s, which it needs anyway, divided by 1 - beta once a row. The weights' logs
// add one rounding common to a row's probabilities (~1e-7 relative, as ex2.approx's). false: compiles as before.
constexpr bool kJsdWeightedPoints = true;
// The JSD's bfloat16 terms pass (kJsdWeightedPoints) takes a chunk whose every entry has |d| < kJsdLogSpace through
// jsd_entry_plain: there every value is finite (the logits, the rows' normalisers, z >= min(1, e^d) > 2^-93), so
// the z form's log-space branch for d >= kJsdLogSpace and the summand's guards for a probability of 0 are no-ops
// that every entry issued anyway (predicated: ~8 of the loop's ~35 instructions an entry, cuobjdump); a chunk with
// one entry outside (a -inf or NaN logit, a far tail) takes jsd_entry_weighted, as every chunk did before. The
// chunk's test is one comparison an entry on d, which the points form anyway. false: compiles as before.
constexpr bool kJsdPlainChunks = true;
// The plain chunks' teacher probability from the student's and e^d (jsd_entry_plain_from_ps): 3 exponentials an entry
// where the terms pass took 4, in a loop whose MUFU work (4 an entry: 32 cycles of a scheduler's MUFU a warp's
// chunk, against ~26 issue cycles) bounds it. A chunk is plain only where also every (1 - beta) ps is a normal
// number, tested on the student's logits against one threshold a row. Measured (one H200, kernels/NOTES.md, version
// 35): the JSD step -2.7% (logits of spread 3) and -2.2% (spread 2), every other kernel within +-0.4%. false
// compiles the kernels as version 34.
constexpr bool kJsdPtFromPs = true;
// The JSD's bfloat16 gradient pass (KEEP_US) in a row whose ks is finite and whose student maximum is moderate: the
// factor (1 - beta) scale folded into ps's exponent (one offset a row, mx + lz - log2 factor, rounded once: where |mx|
// <= kFoldedGradMax the offset lies below 512 (lz <= 31, a float factor above 2^-150), so its rounding is a relative
// error below 2^-15 common to the row's gradient), and no per-entry guard for ps = 0 or NaN: 2^(x k2 - offset) (u_s -
// ks) is 0 where ps is 0 (the kept u_s is finite there: the terms pass keeps 0 for a u_s of +-inf or NaN, which only
// logits of +-inf or NaN give) and NaN where ps is NaN, as the guard made it; where ks is not finite (a row with a NaN)
// the guarded loop keeps its zeros at entries without mass. SASS (sm_90): the loop 104 -> 62.5 instructions a chunk of
// 8 entries (70 registers, no spill). Measured on an H200 (kernels/NOTES.md, version 44): the JSD step -2.7% (logits of
// spread 2) and -3.7% (spread 3), every other kernel within +-0.2% (spread 2); every one-GPU test passed with it on.
// Not in the vocabulary split's one-read kernel (SPLIT: it needs two GPUs to test). false: the kernels compile as
// before.
constexpr bool kJsdFoldedGrad = true;
constexpr float kFoldedGradMax = 256.f;
// The JSD's bfloat16 training rows keep each entry's (1 - beta) ps from the terms pass too, in fp16 over the
// student's logit in shared memory (dead after that pass but for a row summed again with the series, which reads the
// student's logits from device memory as it reads the teacher's), so the gradient pass forms no exponential: each
// entry's gradient is the kept ps times (kept u_s - ks) times the row's factor, two instructions and two conversions
// where kJsdFoldedGrad's loop took an exponential, its argument and a conversion of the logit. The kept ps is the
// terms pass's own probability, formed with a row's power of two 2^E folded into the normalisers (E = 15 + floor(lz),
// so the row's largest (1 - beta) ps lies in [2^14, 2^15], within fp16's range; the terms' sums, linear in the
// probabilities, are divided by 2^E once a warp): so the terms pass adds only the pack and the store. The kept ps
// is rounded by up to 2^-11 of itself (1/8 of a bfloat16 gradient's own rounding); entries below 2^-29 of the row's
// largest probability are fp16 subnormals, rounded to an absolute 2^-24 of that scale. Not in the vocabulary
// split's one-read kernel (SPLIT, which exchanges the sums across ranks). Measured on an H200 (kernels/NOTES.md,
// version 49): the JSD step -3.1% and -2.9% (logits of spread 2 and 3), every other case within the rounds' spread;
// the JSD's GPU tests passed with it on. false: the kernels compile as before.
constexpr bool kJsdKeptPs = true;
// The JSD's bfloat16 terms pass (kJsdPlainChunks' plain chunks) in base 2: d2 = d log2(e) from the logits'
// difference by the same one multiply-add, 2^d2 and log2 z straight from ex2.approx and lg2.approx, the chunk's
// summands and ks parts summed in log2(e) units and multiplied by ln 2 once a thread (jsd_entry_plain_base2): two
// multiplications an entry fewer (206 -> 188 SASS instructions a plain chunk of 8 entries). One H200: the JSD step
// -2.8% / -3.4% (logits of spread 2 / 3), every other kernel untouched (kernels/NOTES.md, version 50). Not in the
// split's one-read kernel (SPLIT), which needs two GPUs to test. false: the kernels compile as before.
constexpr bool kJsdBase2Terms = true;
// The JSD's bfloat16 training rows sum ks from the kept, fp16-rounded u_s (each chunk's packed halves unpacked
// again: one HADD2.F32 an entry) where it summed the exact ones, so that the gradient ps (u_s - ks) is that of the
// rounded u_s throughout. Where one entry holds most of the student's mass (ps -> 1) u_s - ks cancels to ~(1 - ps)
// of u_s, and the kept u_s' rounding (2^-12 |u_s|) against the exact ks was a relative error ~2^-12 / (1 - ps) of
// that entry's gradient (8.7e-3 at ps = 0.96, beyond a bfloat16 gradient's rounding; kernels/NOTES.md, version 51);
// against the rounded ks it scales with (1 - ps) as the gradient does. Entries whose u_s is not finite keep their
// exact part (kept as 0, they would hide the NaN that sends the row to the guarded loop). The tail entry (a row's
// last entries past its chunks; rows off the 16-byte grid: its head's too) keeps its u_s in a float register,
// rounded to fp16 all the same, its part from that. Rows summed again with the series (below kJsdDirectMin: the
// distributions nearly agree) sum ks from the u_s they keep again, rounded likewise: with the series' exact ks
// there, rows uniform on a support left ~4e-8 in a gradient that is 0 (bfloat16 rows of 100 and 104 entries, an
// H200; kernels/NOTES.md, version 53).
// The same holds where the row's gradient cancels whole (student and teacher uniform on a support: u_s the same at
// every entry, the gradient 0): against the exact ks the kept u_s' rounding left ~ps 2^-12 |u_s| an entry.
// Measured on an H200 (kernels/NOTES.md, version 52): the JSD step +3.0% (logits of spread 2 and 3); only in rows
// where an entry holds over half the student's mass (a loop of its own) +1.7-2.1% even where no row took it,
// and it left the uniform rows as they were. false: the kernels compile as before.
constexpr bool kJsdKsFromKept = true;
// The JSD's bfloat16 training rows keep u_s less its largest value u_max = -log(1 - beta) (ps / m <= 1 / (1 - beta)),
// kept times kKeptUsScale by one FFMA where it was one FMUL. ks, summed from the kept values (kJsdKsFromKept),
// moves by the same offset, and the gradient ps (u_s - ks) is unchanged but for rounding. Why: the fp16 kept u_s is
// good to 2^-12 |u_s| absolute, and where the student's mass lies on entries the teacher gives little, u_s is near
// u_max at each of them (log 2 at beta 0.5) and ks too, so u_s - ks is a small part of u_s and the kept u_s'
// rounding a large part of the gradient. Rows summed again (below kJsdDirectMin) keep u_s itself: theirs are small,
// and where student and teacher agree exactly every kept u_s is 0 and the gradient exactly 0 (an offset left it at
// its rounding: test_jsd_gradient_where_distributions_nearly_agree failed so on an H200). Measured on an H200
// (tools/probe_kept_us.py, bfloat16 rows of 50001 entries, 10 draws of each kind, two seeds): student and teacher
// independent draws of spread 3 at beta 0.5, 4.7e-3 to 6.4e-3 of the gradient's norm from float64 without it, 1.9e-3
// to 3.0e-3 with it, bfloat16's own rounding of the exact gradient being 1.9e-3 to 3.0e-3 (within 0.1e-3 of it in
// every row kind and beta 0.1 / 0.5 / 0.9); the JSD step +0.8% (tools/distill_trees.py, one round; kernels/NOTES.md,
// version 54). false: the kernels compile as before.
constexpr bool kJsdKeptUsOffset = true;
// Forward KL's 16-bit training rows in kNarrowThreads blocks too, summing the direct form of the summand with its
// mass (kl_term_direct, as the forward alone does; 4 instructions an entry against kl_term's ~13): capped at 32
// registers the mass had been a register too many (measured slower, kernels/NOTES.md, version 20). A thread whose
// direct sum falls below kDirectMin of its mass sums its entries again after its gradient is written, which the
// fused head writes over the student's logits: the tail entry's student logit is kept in a register for that.
// false: forward KL's step compiles as before (256 capped threads, kl_term).
constexpr bool kDirectStepTerms = true;
// The mass of the direct terms' test (a thread's sum of ps + pt, against which kDirectMin judges its direct sum)
// taken from the thread's own sums of the normalisers' pass, 2^(warp max) sum 2^(a - warp max) for each
// distribution, rescaled once by the row's normalisers, where the terms loop added two FADDs an entry for it (16 of
// the 155 instructions a chunk of forward KL's training loop: 137 with it). The narrow (uncapped) training instances,
// forward and reverse KL, one device. The test is a threshold: its mass needs no more than a few digits. One H200:
// forward KL's step -2.1% / -2.3%, reverse KL's -3.4% / -3.7% (logits of spread 2 / 3; kernels/NOTES.md, version
// 50). false: the kernels compile as before.
constexpr bool kMassFromNorms = true;
// The same instances form each probability as 2^(x k2 - c) with one offset a distribution, c = mx + lz rounded
// once (the pair's exact sum: two_sum), where (x k2 - mx) - lz took an FFMA and an FADD: two FADDs an entry fewer in
// the terms pass, one in reverse KL's gradient pass. The offset's rounding e = (mx + lz) - c is a factor 2^e common
// to the row's probabilities, taken out where it matters rather than left in: forward KL's q - p is formed as
// ps' - pt' 2^(es - et) = (ps - pt) 2^es (one FFMA, as the FADD it replaces), whose gradient is scaled by scale
// 2^-es; the direct sum's pt' d term carries 2^et, so a thread's sum S' = 2^et sum pt d + 2^es sum (ps - pt) is
// made sum pt d + sum (ps - pt) by 2^-et S' + (1 - 2^(es - et)) sum (ps - pt), the last sum the thread's masses of
// kMassFromNorms (reverse KL: s and t exchanged, its ks times 2^-es). Rows whose offsets lie beyond
// kFoldedOffsetMax (or are not finite) keep the pair: below it |e| <= 2^-15 (2^-14 with kFoldedScale's second
// rounding), so 2^e is 1 + e ln 2 to 2e-9.
// false: the kernels compile as before.
constexpr bool kFoldedOffsets = true;
constexpr float kFoldedOffsetMax = 1024.f;
// Forward KL's folded rows take the gradient's factor into both offsets too: c - lambda with lambda = log2(scale)
// rounded to float, so the loop's q - p is the gradient as written, (ps - pt) 2^lambda 2^es (no FMUL an entry;
// 2^lambda is scale to 2^-21, 2^es to |es| <= 2^-14: both far below a 16-bit gradient's rounding, 2^-9 or 2^-11),
// and the thread's loss is multiplied by 2^-lambda once. lambda and 2^-lambda are one thread's, in double, while
// the copy is in flight; a scale that is not a positive number within 2^+-100 is not folded (the row keeps the
// pair). Probabilities below 2^-126 after the factor (ex2.approx flushes them) give 0 for gradients that would be
// below 2^-126. false: the kernels compile as with kFoldedOffsets alone.
constexpr bool kFoldedScale = true;
// The JSD's forward alone sums the direct form of its summand with a thread-level second sum (fast_rows,
// JSD_FWD_DIRECT), where it takes the series' branch on |d| < 0.5 for every entry. The thread's mass is the
// mixture's, (1 - beta) ps + beta pt: with ps + pt (5b17ff6) it ran 14% faster on an H200 on logits of spread 1.5
// but 30% slower on the suite's (spread 1 after T: 5% of threads, so most warps, took the second sum). With the
// mixture mass, one H200: -18.8% (spread 1.5) and -16.3% (spread 1), every other kernel within +-0.8%
// (kernels/NOTES.md, version 26). false compiles the kernels as before.
constexpr bool kJsdForwardDirect = true;
// float32 JSD training rows (fast_rows_kernel<float, JSD, true>, one device): the terms pass keeps each entry's
// student probability and u_s, as floats, over the chunk of logits it has just read (its own: a float32 chunk holds
// four of each), and the gradient pass forms (1 - beta) ps (u_s - ks) from them (jsd_student_grad): the values
// student_grad forms again from the logits (make_point's ps, mixture_u's u_s, which point_terms forms by the same
// functions: jsd_point_entry), so the same bits, without the second pass's two exponentials and the mixture's u_s.
// The row's partial chunk (read from device memory in each pass) keeps the recomputation. false: the gradient pass
// recomputes every entry.
constexpr bool kF32KeptJsd = true;

// fast_rows' cluster exchanges (the normalisers; ks; the JSD's row sums) in two levels (cluster_fold): each block's
// warps' records combined by its warp 0 into one record a block, then one cluster barrier, then warp 0 reads the
// ranks' 16 records. And only the arrives that publish a record are releases: the others, and the arrive of the
// barrier that only keeps a block's shared memory alive for the others before it exits, are relaxed. In one level,
// warp 0 of every block read all ranks x warps (128) records from the other blocks' shared memory after the
// cluster barrier while the block's other warps waited for it at a block barrier (13% of the bf16 forward alone's
// warp stall samples on an H200), and every arrive was a release (a device-wide memory barrier, MEMBAR.ALL.GPU:
// 2 x 4.4% of the samples). kernels/NOTES.md, version 29. false: the kernels compile as before.
constexpr bool kTwoLevelExchange = true;

// The arrive before leaving relaxed in the one-level exchanges too (reverse KL, the JSD's forward alone: their last
// remote reads are warp 0's, whose values reach every warp through shared memory and a block barrier before it, and
// the arrive takes one of them as an operand). One H200: reverse KL's forward alone -3.2% / -3.7%, its step -1.1% /
// -1.5%, the rest within +-1% (kernels/NOTES.md, version 30). false: the kernels compile as before.
constexpr bool kRelaxedLeave = true;

// fast_rows' scale (batchmean's device-side divisor, *p.scale_dev) loaded once the slices' copy is in flight, not
// after the normalisers' cluster barrier: there the load came right before its first use, and the forward KL
// step's warps stalled on it (the DMUL after the load: 3.7% of its warp stall samples on an H200, Nsight Compute;
// the step -4%: kernels/NOTES.md, version 38). false: the kernels compile as before.
constexpr bool kEarlyScale = true;
// The same in fast_topk_kernel (distill_fast_topk.cuh), whose gradient pass loaded it after the members' pass.
// Measured at -0.6% on the top-k step when that kernel still left through a cluster barrier (version 38), left off;
// after kTopkPush and kTopkLabelFirst the scale's DMUL waiting for its load held 3.0% of the kernel's warp stall
// samples, and the switch took the step's kernel from 0.580 to 0.567 ms on an H200 (kernels/NOTES.md, version 42).
// false: those kernels compile as before.
constexpr bool kEarlyScaleTopk = true;

// The two halves of a cluster barrier (cooperative_groups' cluster.sync() is both at once).
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// An arrive that orders no memory access (no MEMBAR): for the barrier before a block exits, after the block's last
// read of another's shared memory. `after`: a value computed from that read, so the read has completed (its value
// arrived) before the arrive is issued; the asm's operand makes the compiler keep that order.
__device__ __forceinline__ void cluster_arrive_relaxed(float after) {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::"f"(after) : "memory");
}
// The same for a thread that has published nothing and read nothing remote since the last barrier.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}

// Records pushed into other blocks' shared memory (st.async), counted on the receiver's mbarrier by their bytes:
// an exchange with no release fence (a cluster-scope release compiles to MEMBAR.ALL.GPU, which waits for all of
// the thread's outstanding memory operations; so does a remote mbarrier arrive with .release.cluster) and no read
// of another block's shared memory, so no block need stay alive for the others' reads. PTX allows st.async only
// into another block of a cluster of more than one: a block writes its own records with plain stores (and, where
// other threads read them, a local mbar_arrive). Used by fast_topk_kernel (kTopkPush, distill_fast_topk.cuh).
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// The address of `local` (a shared-memory address of this block) in the block of cluster rank `rank`.
__device__ __forceinline__ unsigned at_rank(unsigned local, int rank) {
  unsigned r;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
  return r;
}
// One thread: an mbarrier for `arrivals` arrivals (mbar_expect's and any mbar_arrive's), then made visible to the
// cluster's pushes (mbar_init_fence, before the cluster barrier that every pushing block waits on).
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// The one arrival, with the bytes the phase waits for (pushes may land before it: the count goes below zero).
__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// An arrival of this block's own (a release at the block's scope: the thread's stores before it are seen by a
// thread that waits for the phase).
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// dst, bar: at_rank addresses of another block's slot and mbarrier (never this block's).
__device__ __forceinline__ void push_f32(unsigned dst, float v, unsigned bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];" ::"r"(dst), "f"(v), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void push_f32x4(unsigned dst, float4 v, unsigned bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
               : "memory");
}
// The mbarrier retired, by one thread once every thread's mbar_wait has returned (a block barrier after them):
// PTX leaves any other use of an mbarrier's memory undefined until it is invalidated, and the next block on the
// SM may put that shared memory to another use (its slice's copy).
__device__ __forceinline__ void mbar_inval(unsigned bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Until the phase (the first: parity 0) completes: every byte pushed has landed and is visible to this thread.
__device__ __forceinline__ void mbar_wait(unsigned bar) {
  unsigned done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar)
        : "memory");
  } while (!done);
}

// Two normalisers' (max, sum of 2^(x - max)) pairs combined; a pair with no mass (sum 0, max maybe -inf) adds
// nothing. Symmetric in its arguments, so every lane of a butterfly ends with the same value.
__device__ __forceinline__ void combine_pair(float& m, float& l, float m2, float l2) {
  const float g = fmaxf(m, m2);
  l = (l == 0.f ? 0.f : l * d_exp2(m - g)) + (l2 == 0.f ? 0.f : l2 * d_exp2(m2 - g));
  m = g;
}

// ------------------------------------------------------------- what the fast kernels (rows and top-k) share
// A block's place in its row: one row per cluster, each block a slice of it.
struct FastSlice {
  int ranks, rank;  // blocks in the cluster, this block's rank
  int64_t row, lo;  // the row, the slice's first entry
  int count;        // entries in this slice (the last block's may be short or empty)
  int head;         // SHIFT: the row's entries before rank 0's slice (0 in the other ranks)
  int lane, warp;
};
// SHIFT: rows may start off the 16-byte grid (a vocabulary whose rows are not a whole number of 16-byte chunks,
// e.g. 50257 bfloat16 entries, contiguous), the student's, teacher's and gradient's rows each at the same offset
// from it (fast_path_ok checks that, row by row): the slices then start at the row's first entry on the grid, and
// rank 0 visits the entries before it (its head, fewer than a chunk) one by one, as the last rank does its tail.
// Without SHIFT the rows are on the grid (head 0), the instances that take no others (the split's; the top-k
// teacher's SHIFT instances keep their head below the slice: distill_fast_topk.cuh) compile as before.
template <bool SHIFT = false, typename T>
__device__ __forceinline__ FastSlice fast_slice(const Params<T, float>& p, const cg::cluster_group& cluster) {
  FastSlice f;
  f.ranks = static_cast<int>(cluster.num_blocks());
  f.rank = static_cast<int>(cluster.block_rank());
  unsigned cid;  // the cluster's index in the grid: the row (blockIdx.x / ranks without the integer division)
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(cid));
  f.row = cid;
  int64_t head = 0;
  if constexpr (SHIFT) head = min64(row_head(p.s + f.row * p.s_stride), p.v);
  f.head = f.rank == 0 ? static_cast<int>(head) : 0;
  f.lo = head + static_cast<int64_t>(f.rank) * p.slice;
  f.count = static_cast<int>(max64(0, min64(p.v - f.lo, p.slice)));
  f.lane = threadIdx.x & 31;
  f.warp = threadIdx.x >> 5;
  return f;
}

// A masked row's slice of the gradient: zeros (no barrier: the whole cluster sees the same label); and the `head`
// entries before it (fast_slice's SHIFT).
template <int THREADS = kFastThreads, typename T>
__device__ __forceinline__ void zero_slice(T* gs, int count, int head = 0) {
  constexpr int N = Vec<T>::N;
  const Vec<T> zero{};
  for (int c = threadIdx.x; c < count / N; c += THREADS) store_chunk(gs + c * N, zero, true);
  for (int j = count / N * N + threadIdx.x; j < count; j += THREADS) gs[j] = zero.v[0];
  if (head > 0 && threadIdx.x < static_cast<unsigned>(head)) gs[-1 - static_cast<int>(threadIdx.x)] = zero.v[0];
}

// The slices' copies may ask L2 to fetch 128 or 256 bytes around each 16-byte chunk (cp.async's .L2::128B /
// .L2::256B hint): L2B, 0 for no hint. kStepL2Prefetch for forward KL's rows in fast_rows (not the split's one-read
// kernels, which need two GPUs to time), kTopkL2Prefetch for the top-k teacher's (distill_fast_topk.cuh); 0: the
// kernels compile as before. Measured on an H200 (kernels/NOTES.md, version 48): 128 B took forward KL's step -1.0%
// and -1.2% and the top-k teacher's -0.7% and -0.9% (logits of spread 2 and 3, medians of three rounds); in every
// fast_rows instance 128 B took the JSD's step +1.2%, and 256 B the JSD's and reverse KL's +1-2%.
constexpr int kStepL2Prefetch = 128;
constexpr int kTopkL2Prefetch = 128;

// One 16-byte asynchronous copy from device to shared memory (dst: a shared-memory address).
template <int L2B = 0, typename T> __device__ __forceinline__ void cp_async16(unsigned dst, const T* src) {
  static_assert(L2B == 0 || L2B == 128 || L2B == 256, "cp.async's L2 fetch hint: 128 or 256 bytes");
  if constexpr (L2B == 256) asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else if constexpr (L2B == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// The copy of a slice: thread x's chunks are c = x + i kFastThreads for i < mine (its count, chunk_count) and it
// later reads no other thread's, so no block barrier follows it. `copy(i)` issues its chunk i's cp.async: i is a
// compile-time constant for the first three, so the addresses are the thread's base plus an immediate (the copy
// took ~15 instructions a chunk pair from chunk indices; kernels/NOTES.md, version 23). Staged: the first three in
// a commit group each and the rest in a fourth (empty groups included, so every thread has four), so that
// for_each_landed can take each as it lands while the later ones are in flight; else one group, waited for whole.
// a + b = s + e exactly (Knuth's two-sum: six roundings to nearest, whatever the operands' magnitudes)
__device__ __forceinline__ void two_sum(float a, float b, float& s, float& e) {
  s = __fadd_rn(a, b);
  const float bb = __fsub_rn(s, a);
  e = __fadd_rn(__fsub_rn(a, __fsub_rn(s, bb)), __fsub_rn(b, bb));
}

// A pointer the compiler must hold in a register from here on (an empty asm that may have changed it): the copy's
// addresses are then that register plus an immediate, not recomputed from the row and the index under each
// chunk's predicate.
template <typename P> __device__ __forceinline__ P* pinned(P* ptr) {
  asm("" : "+l"(ptr));
  return ptr;
}
template <int THREADS = kFastThreads> __device__ __forceinline__ int chunk_count(int chunks) {
  const int x = static_cast<int>(threadIdx.x);
  return x < chunks ? (chunks - 1 - x) / THREADS + 1 : 0;
}
template <typename F> __device__ __forceinline__ void issue_copy(int mine, bool staged, F copy) {
  int i0 = 0;  // the first chunk not yet in a commit group
  if (staged) {
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      if (i < mine) copy(i);
      asm volatile("cp.async.commit_group;\n" ::);
    }
    i0 = 3;
  }
#pragma unroll 1
  for (int i = i0; i < mine; ++i) copy(i);
  asm volatile("cp.async.commit_group;\n" ::);
  if (!staged) asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// take(i) for each of this thread's chunks once its copy (issue_copy) has landed: staged, group by group.
template <typename F> __device__ __forceinline__ void for_each_landed(int mine, bool staged, F take) {
  int i1 = 0;
  if (staged) {  // wait_group takes an immediate: the three single-chunk groups spelled out
    asm volatile("cp.async.wait_group 3;\n" ::: "memory");
    if (0 < mine) take(0);
    asm volatile("cp.async.wait_group 2;\n" ::: "memory");
    if (1 < mine) take(1);
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    if (2 < mine) take(2);
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    i1 = 3;
  }
  for (int i = i1; i < mine; ++i) take(i);
}

// Two normalisers' (max, sum) pairs from n records record(i) (i = rank x warps + warp: (m0, l0, m1, l1)), lane i
// taking records i, i + 32, ..., then a butterfly: the same records in the same order give every lane of every
// block the same bits.
template <typename Record>
__device__ __forceinline__ void combine_records(int n, int lane, Record record, float& m0, float& l0, float& m1,
                                                float& l1) {
  m0 = m1 = ninf<float>();
  l0 = l1 = 0.f;
  for (int i = lane; i < n; i += 32) {
    const float4 q = record(i);
    combine_pair(m0, l0, q.x, q.y);
    combine_pair(m1, l1, q.z, q.w);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    combine_pair(m0, l0, __shfl_xor_sync(0xffffffffu, m0, o), __shfl_xor_sync(0xffffffffu, l0, o));
    combine_pair(m1, l1, __shfl_xor_sync(0xffffffffu, m1, o), __shfl_xor_sync(0xffffffffu, l1, o));
  }
}
// Warp 0 of each block, after the cluster barrier that published them: the records of every rank's warps' slots
// (slot w of rank r), read from the ranks' shared memory.
template <int WARPS = kFastWarps>
__device__ __forceinline__ void combine_cluster_pairs(const cg::cluster_group& cluster, float4* slots, int ranks,
                                                      int lane, float& m0, float& l0, float& m1, float& l1) {
  combine_records(
      ranks * WARPS, lane, [&](int i) { return *cluster.map_shared_rank(slots + i % WARPS, i / WARPS); }, m0, l0, m1,
      l1);
}

// kTwoLevelExchange: the cluster's combination of one record a warp (`mine`, lane 0's; R float, float2 or float4;
// `op` symmetric with identity `none`), returned in every thread of every block with the same bits (the same
// records combined in the same order everywhere). slots: WARPS + 1 records of this block's shared memory, which
// no other exchange uses. The block's warps' records are combined by warp 0 after a block barrier into
// slots[WARPS], which warp 0's arrive releases to the cluster (the other warps publish nothing and arrive relaxed);
// after the cluster barrier warp 0 folds the ranks' records (lane r reads rank r's; ranks <= 16) and hands the
// result to the block's warps through slots[0] (its own warps' records, read before) and a block barrier. (Every
// warp folding the ranks' records itself, with no block barrier after, ran 12% slower on the forward alone: 8 x
// the instructions and a spill under the 32-register cap; kernels/NOTES.md, version 29.)
template <int WARPS, typename R, typename Op>
__device__ __forceinline__ R cluster_fold(const cg::cluster_group& cluster, R* slots, R mine, R none, int ranks,
                                          int lane, int warp, Op op) {
  static_assert(WARPS <= 32, "a record a lane");
  if (lane == 0) slots[warp] = mine;
  __syncthreads();
  if (warp == 0) {
    const R r = warp_fold<WARPS>(lane < WARPS ? slots[lane] : none, op);
    if (lane == 0) slots[WARPS] = r;
    cluster_arrive();
  } else {
    cluster_arrive_relaxed();
  }
  cluster_wait();
  if (warp == 0) {  // (lanes 16-31 fold `none` among themselves; lane 0 holds the ranks' combination)
    const R r = warp_fold<16>(lane < ranks ? *cluster.map_shared_rank(slots + WARPS, lane) : none, op);
    if (lane == 0) slots[0] = r;
  }
  __syncthreads();
  return slots[0];
}
// The ops of fast_rows' exchanges: two normalisers' (max, sum) pairs (combine_pair), and plain sums.
struct FoldPairs {
  __device__ __forceinline__ float4 operator()(float4 a, float4 b) const {
    combine_pair(a.x, a.y, b.x, b.y);
    combine_pair(a.z, a.w, b.z, b.w);
    return a;
  }
};
struct FoldSum {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  __device__ __forceinline__ float2 operator()(float2 a, float2 b) const { return make_float2(a.x + b.x, a.y + b.y); }
};

// The whole row on one device. (A vocabulary split across devices runs phase_norms_kernel and
// phase_stream_kernel, below: fast_rows' phases, which copied the slices into shared memory too, were slower;
// kernels/NOTES.md, version 14.)
// THREADS: the block's threads (kFastThreads, or kNarrowThreads for the instances kNarrowKsBlocks names).
// SPLIT (forward KL, the JSD's training rows): this device holds a slice of every row, and the cluster's
// normalisers of its slice are exchanged with the other ranks' through peer memory (*pr; distill_peer.cuh) before
// the terms: the row's slice stays in shared memory across the wait, so a split reads its logits once. Forward
// KL's warps' losses are its slice's (stage 1 follows in peer_terms_kernel); the JSD exchanges its slice's
// (loss, ks) too (stage 1; stage 2 where the row is summed again with the series) before the gradient needs ks,
// and writes the row's loss over the whole vocabulary into pr->rows_loss.
// SHIFT: rows may start off the 16-byte grid (fast_slice); the instances launched where some row does, every
// other compiles as before such rows were taken (one instance for both measured the steps 1-3% slower, H200).
// UNCAPPED: the forms tuned for the uncapped training instances (narrow blocks, and the wide blocks of long rows).
template <typename T, int MODE, bool GRAD, int THREADS = kFastThreads, bool SPLIT = false, bool SHIFT = false,
          bool UNCAPPED = THREADS == kNarrowThreads>
__device__ __forceinline__ void fast_rows(const Params<T, float>& p, const PeerRows* pr = nullptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  constexpr int N = Vec<T>::N;
  constexpr int WARPS = THREADS / 32;
  // The gradient needs the row sum ks first (reverse KL, JSD).
  constexpr bool KS = GRAD && student_needs_k<MODE>();
  // Forward KL's training rows in narrow blocks (kDirectStepTerms): direct terms, the tail's student logit kept.
  constexpr bool STEP_DIRECT = kDirectStepTerms && GRAD && !KS && UNCAPPED;
  // The terms pass's forms ("2. terms" below says why): G, its loop writes forward KL's gradient; DIRECT, it sums
  // forward or reverse KL's direct summand and tests it against the thread's mass.
  constexpr bool G = GRAD && !KS;
  constexpr bool DIRECT = kDirectTerms && MODE != JSD && (!G || STEP_DIRECT);
  constexpr bool MASS_FROM_NORMS = kMassFromNorms && DIRECT && !SPLIT && UNCAPPED;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // kTwoLevelExchange where it measured faster (one H200, kernels/NOTES.md, version 29): forward KL (its step -4%,
  // its forward alone -1.4%) and the JSD's training rows (-1.4%). Reverse KL (its step +1.1%, its forward alone
  // -0.7%) and the JSD's forward alone (+1.3%) keep the one-level exchanges.
  constexpr bool TWO_LEVEL = kTwoLevelExchange && (MODE == FORWARD_KL || (MODE == JSD && GRAD));
  static_assert(!SPLIT || (TWO_LEVEL && (MODE == FORWARD_KL || GRAD)),
                "the split's one-read kernels: forward KL, "
                "the JSD's training rows");
  __shared__ float4 peer_recs[kMaxPeers + 1];  // SPLIT: the ranks' records (unused, so not allocated, elsewhere)
  constexpr int SLOTS = TWO_LEVEL ? WARPS + 1 : WARPS;  // a record a warp (and the block's: cluster_fold)
  __shared__ float2 slot_split[SLOTS];                  // SPLIT: float32 JSD's (ks, loss) cluster fold
  __shared__ float4 slot_norms[SLOTS];
  __shared__ float slot_ks[SLOTS];
  __shared__ float bcast[4];

  cg::cluster_group cluster = cg::this_cluster();
  static_assert(!(SPLIT && SHIFT), "a split's rows are on the grid (distill_peer_terms)");
  const FastSlice sl = fast_slice<SHIFT>(p, cluster);
  const int ranks = sl.ranks, count = sl.count, lane = sl.lane, warp = sl.warp;
  const T* gsrc = p.s + sl.row * p.s_stride + sl.lo;
  const T* gtsrc = p.t + sl.row * p.t_stride + sl.lo;
  T* gs = GRAD ? p.gs + sl.row * p.gs_stride + sl.lo : nullptr;
  float* partial = p.out + (sl.row * ranks + sl.rank) * WARPS;  // this block's warps' losses

  if (p.labels && p.labels[sl.row] == p.ignore_index) {  // masked: zeros, and no barrier (the cluster agrees)
    if (GRAD) zero_slice<THREADS>(gs, count, sl.head);
    if (threadIdx.x < WARPS) partial[threadIdx.x] = 0.f;
    if (SPLIT && MODE == JSD && sl.rank == 0 && threadIdx.x == 0) pr->rows_loss[sl.row] = 0.f;
    return;
  }

  // The copy (issue_copy): each thread its own chunks of both slices; its maximum is taken from each group as it
  // lands (p.staged) while the later ones are still in flight.
  T* xs = reinterpret_cast<T*>(smem_raw);
  T* xt = xs + p.slice;
  const int chunks = count / N;
  const unsigned bs = static_cast<unsigned>(__cvta_generic_to_shared(xs));
  const unsigned bt = static_cast<unsigned>(__cvta_generic_to_shared(xt));
  const bool staged = p.staged;
  const int mine = chunk_count<THREADS>(chunks);
  {
    const unsigned ds = bs + threadIdx.x * 16u, dt = bt + threadIdx.x * 16u;
    const T* s0 = pinned(gsrc + threadIdx.x * N);
    const T* t0 = pinned(gtsrc + threadIdx.x * N);
    constexpr int L2B = MODE == FORWARD_KL && !SPLIT ? kStepL2Prefetch : 0;
    issue_copy(mine, staged, [&](int i) {
      cp_async16<L2B>(ds + i * (THREADS * 16u), s0 + i * (THREADS * N));
      cp_async16<L2B>(dt + i * (THREADS * 16u), t0 + i * (THREADS * N));
    });
  }
  double scale_raw = 0.0;  // kEarlyScale: the scale before 1 / T, loaded while the copy is in flight
  if constexpr (kEarlyScale) scale_raw = p.base_scale();
  auto gradient_scale = [&](double raw) { return static_cast<float>(raw * static_cast<double>(p.inv_t)); };
  // kFoldedOffsets (FOLD) and kFoldedScale (FOLD_SCALE), below. FOLD_SCALE: (lambda, 2^-lambda), or NaN where the
  // scale does not fold; read after the normalisers' exchange, whose first block barrier publishes it
  constexpr bool FOLD = kFoldedOffsets && MASS_FROM_NORMS;
  constexpr bool FOLD_SCALE = kFoldedScale && FOLD && kEarlyScale && G;
  __shared__ float2 scale_fold;
  if constexpr (FOLD_SCALE) {
    static_assert(TWO_LEVEL, "cluster_fold's block barrier publishes scale_fold");
    if (threadIdx.x == 0) {
      const double g = gradient_scale(scale_raw);
      const float lam = static_cast<float>(log2(g));
      scale_fold = g > 0.0 && fabsf(lam) <= 100.f
                       ? make_float2(lam, static_cast<float>(exp2(-static_cast<double>(lam))))
                       : make_float2(std::numeric_limits<float>::quiet_NaN(), 0.f);
    }
  }
  // The last block's slice may end in a partial chunk: its entries are read from device memory in each pass by
  // threads 0 .. N-2 (no thread writes an entry another reads); rank 0's head (fast_slice) by threads N .. 2N-2,
  // at indices -head .. -1 of the slice: every "tail" below is such an entry, at either end.
  const int tid = static_cast<int>(threadIdx.x);
  const int tail = !SHIFT || tid < N ? chunks * N + tid : tid - N - sl.head;
  const bool has_tail = !SHIFT || tid < N ? tail < count : tail < 0;
  const float k2 = p.k2;
  float tail_xs = 0.f;  // STEP_DIRECT: the tail entry's student logit, read before any gradient replaces it

  // ---- 1. normalisers: the warp's max, the warp's sums relative to it, then one cluster barrier
  Norm<float> norm[2];
  // kMassFromNorms: this thread's (offset, sum) of each distribution, for the direct terms' mass
  [[maybe_unused]] float own_norms[4] = {0.f, 0.f, 0.f, 0.f};
  {
    float mx[2] = {ninf<float>(), ninf<float>()};
    const T* xs0 = xs + threadIdx.x * N;
    const T* xt0 = xt + threadIdx.x * N;
    auto take_max = [&](int i) {
      mx[0] = fmaxf(mx[0], chunk_max(load_chunk(xs0 + i * (THREADS * N), true)));
      mx[1] = fmaxf(mx[1], chunk_max(load_chunk(xt0 + i * (THREADS * N), true)));
    };
    for_each_landed(mine, staged, take_max);
    if (has_tail) {
      const float a = static_cast<float>(gsrc[tail]);
      if (STEP_DIRECT) tail_xs = a;
      mx[0] = fmaxf(mx[0], a);
      mx[1] = fmaxf(mx[1], static_cast<float>(gtsrc[tail]));
    }
    mx[0] = scaled_max(warp_max(mx[0]), k2);  // k2 > 0: the max of the scaled logits
    mx[1] = scaled_max(warp_max(mx[1]), k2);
    const float o0 = mx[0] == ninf<float>() ? 0.f : mx[0], o1 = mx[1] == ninf<float>() ? 0.f : mx[1];
    float sm[2] = {0.f, 0.f};
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
      const Vec<T> vs = load_chunk(xs + c * N, true), vt = load_chunk(xt + c * N, true);
#pragma unroll
      for (int q = 0; q < N; ++q) {
        sm[0] += d_exp2(entry_float(vs, q) * k2 - o0);
        sm[1] += d_exp2(entry_float(vt, q) * k2 - o1);
      }
    }
    if (has_tail) {
      sm[0] += d_exp2(static_cast<float>(gsrc[tail]) * k2 - o0);
      sm[1] += d_exp2(static_cast<float>(gtsrc[tail]) * k2 - o1);
    }
    if constexpr (MASS_FROM_NORMS) {
      own_norms[0] = o0;
      own_norms[1] = sm[0];
      own_norms[2] = o1;
      own_norms[3] = sm[1];
    }
    sm[0] = part_sum(warp_sum(sm[0]), o0);  // (a warp of padding beyond the lanes' range: a stand-in)
    sm[1] = part_sum(warp_sum(sm[1]), o1);
    if constexpr (TWO_LEVEL) {
      const float4 r =
          cluster_fold<WARPS>(cluster, slot_norms, make_float4(mx[0], sm[0], mx[1], sm[1]),
                              make_float4(ninf<float>(), 0.f, ninf<float>(), 0.f), ranks, lane, warp, FoldPairs{});
      if constexpr (SPLIT) {  // this slice's record, as phase_norms_kernel writes it, for the ranks' combination
        const float4 w = peer_exchange_block(*pr, 0, sl.row, make_float4(r.x, d_log2(r.y), r.z, d_log2(r.w)),
                                             sl.rank == 0, peer_recs, PeerNorms{});
        norm[0] = Norm<float>{w.x, w.y};  // (peer_combine's, usable already)
        norm[1] = Norm<float>{w.z, w.w};
      } else {
        norm[0] = usable(Norm<float>{r.x, d_log2(r.y)});
        norm[1] = usable(Norm<float>{r.z, d_log2(r.w)});
      }
    } else {
      if (lane == 0) slot_norms[warp] = make_float4(mx[0], sm[0], mx[1], sm[1]);
      cluster_arrive();
      cluster_wait();
      if (warp == 0) {  // every block combines all ranks x warps pairs in the same order
        float m0, l0, m1, l1;
        combine_cluster_pairs<WARPS>(cluster, slot_norms, ranks, lane, m0, l0, m1, l1);
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
  }
  // The arrive of the barrier before leaving, once this block reads no other's shared memory any more.
  auto arrive_to_leave = [&](float after) {
    if constexpr (TWO_LEVEL || kRelaxedLeave) cluster_arrive_relaxed(after);
    else cluster_arrive();
  };
  if (!KS) arrive_to_leave(norm[0].mx + norm[1].mx);
  if constexpr (!kEarlyScale) scale_raw = p.base_scale();
  const float scale = gradient_scale(scale_raw);
  const RowNorms<float> rn = row_norms(norm[0], norm[1]);
  // Visits this thread's entries with their logits: its chunks from shared memory, then its tail entry from device
  // memory, in a loop compiled for the row's offset choice (rn.close), f(close_c, xs, xt) with close_c that choice as
  // a type. WRITE: what `f` returns is the entry's gradient (before the factor gscale), stored over the row of gs
  // (alias-safe: a thread writes only entries it has read).
  auto for_each_entry = [&](auto write_c, float gscale, auto&& f) {
    constexpr bool WRITE = decltype(write_c)::value;
    auto pass = [&](auto close_c) {
      for (int c = threadIdx.x; c < chunks; c += THREADS) {
        const Vec<T> vs = load_chunk(xs + c * N, true), vt = load_chunk(xt + c * N, true);
        Vec<T> g;
#pragma unroll
        for (int q = 0; q < N; ++q) {
          const float d = f(close_c, entry_float(vs, q), entry_float(vt, q));
          if (WRITE) g.v[q] = static_cast<T>(d * gscale);
        }
        if (WRITE) store_chunk(gs + c * N, g, true);
      }
      if (has_tail) {
        const float xs_tail = STEP_DIRECT ? tail_xs : static_cast<float>(gsrc[tail]);
        const float d = f(close_c, xs_tail, static_cast<float>(gtsrc[tail]));
        if (WRITE) gs[tail] = static_cast<T>(d * gscale);
      }
    };
    if (rn.close) pass(std::true_type{});
    else pass(std::false_type{});
  };
  // The same with each entry's point (make_point) and the gradient's factor scale.
  auto for_each_point = [&](auto write_c, auto&& f) {
    for_each_entry(write_c, scale, [&](auto close_c, float xsv, float xtv) {
      return f(make_point<decltype(close_c)::value>(xsv, xtv, k2, rn));
    });
  };
  // FOLD: each distribution's one offset c = mx + lz and its rounding e; `folded`, the row's offsets allow it.
  // folded_point: an entry's point with ps' = ps 2^es, pt' = pt 2^et (ls, lt their logarithms) and make_point's d
  // (its rounding is not the offsets': where not CLOSE, (lt2' - ls2') - (et - es)).
  struct Folded { float cs, es, ct, et; } fo{0.f, 0.f, 0.f, 0.f};
  bool folded = false;
  [[maybe_unused]] float2 sf = make_float2(0.f, 1.f);  // FOLD_SCALE: (lambda, 2^-lambda)
  if constexpr (FOLD) {
    two_sum(rn.s.mx, rn.s.lz, fo.cs, fo.es);
    two_sum(rn.t.mx, rn.t.lz, fo.ct, fo.et);
    if constexpr (FOLD_SCALE) {  // c - lambda, its rounding added to e's
      sf = scale_fold;
      float e;
      two_sum(fo.cs, -sf.x, fo.cs, e);
      fo.es += e;
      two_sum(fo.ct, -sf.x, fo.ct, e);
      fo.et += e;
    }
    folded = fabsf(fo.cs) < kFoldedOffsetMax && fabsf(fo.ct) < kFoldedOffsetMax;  // (NaN and -inf fail)
  }
  auto folded_point = [&](auto close_c, float xsv, float xtv) {
    constexpr bool CLOSE = decltype(close_c)::value;
    const float ls2 = d_fma(xsv, k2, -fo.cs), lt2 = d_fma(xtv, k2, -fo.ct);
    Point<float> e;
    e.ps = d_exp2(ls2);
    e.pt = d_exp2(lt2);
    e.ls = ls2 * static_cast<float>(kLn2);
    e.lt = lt2 * static_cast<float>(kLn2);
    e.d = CLOSE ? point_d<true>(xsv, xtv, k2, rn) : ((lt2 - ls2) - (fo.et - fo.es)) * static_cast<float>(kLn2);
    return e;
  };
  // 2^x for a row's |x| <= 2^-13 (the offsets' roundings and their differences, where folded): 1 + x ln 2 to 4e-9
  [[maybe_unused]] auto exp2_tiny = [](float x) { return d_fma(x, static_cast<float>(kLn2), 1.f); };

  // ---- 2. terms (and forward KL's gradient, which needs no row sum)
  // Where this loop writes no gradient (the forward alone; reverse KL, whose gradient needs ks), forward and
  // reverse KL sum the direct form of their summand (kl_term_direct) and the entries' mass; a thread whose sum is
  // below kDirectMin of its mass (where the direct form may have cancelled) sums its entries again in the
  // non-negative form with its series (kl_term): the series' ~11 instructions an entry leave the loop that bounds
  // the kernel (kernels/NOTES.md, version 20). Where the loop writes forward KL's gradient only in the uncapped
  // narrow blocks (STEP_DIRECT): under the 32-register cap the mass is a register too many (measured slower); the
  // second sum reads the tail's student logit from a register, as the gradient may have replaced it (fused head).
  // (G and DIRECT are defined at the top.)
  // The JSD's 16-bit training rows take its summand's direct form everywhere (jsd_entry_direct: no series and no
  // branch on its region, ~25 instructions an entry); a row whose JSD comes out below kJsdDirectMin is summed
  // again with the series by the whole cluster (the row's sum, which ks's cluster barrier gathers anyway, is the
  // same in every block, so all take the same branch) before its gradient pass (kernels/NOTES.md, version 21).
  constexpr bool JSD_DIRECT = kDirectTerms && MODE == JSD && KS && sizeof(T) == 2;
  // The JSD's forward alone (kJsdForwardDirect): the direct form too, with the thread's mixture mass
  // m = (1 - beta) ps + beta pt, to which the form's error is proportional (~3.5e-7 m), and the thread's second sum
  // below kJsdDirectMin of it (so at most ~6e-6 of the thread's sum, the bound of the training rows' row-level
  // test), as forward and reverse KL's direct sums: the direct summand is >= 0 and equal to the series' up to
  // rounding, so threads summed either way add up to the row's JSD.
  constexpr bool JSD_FWD_DIRECT = kJsdForwardDirect && kDirectTerms && MODE == JSD && !GRAD;
  constexpr bool KEEP_US = kJsdKeepUs && JSD_DIRECT && std::is_same<T, c10::BFloat16>::value;  // (see kJsdKeepUs)
  // kF32KeptJsd: float32 rows' ps and u_s kept over their logits by the terms pass, for the gradient pass
  constexpr bool KEEP_F32 = kF32KeptJsd && MODE == JSD && KS && std::is_same<T, float>::value && !SPLIT;
  using KeptVec = Vec<c10::Half>;
  static_assert(!KEEP_US || KeptVec::N == N, "u_s kept in 16 bits an entry");
  // kJsdKeptPs: (1 - beta) ps kept over the student's chunk (fp16, times 2^ps_exp), for the gradient pass
  constexpr bool KEPT_PS = kJsdKeptPs && KEEP_US && !SPLIT && kJsdPlainChunks && kJsdWeightedPoints && kKeptUsDirect;
  // KEEP_US: u_s as the gradient pass needs it, scaled for fp16: the terms' own z form (kKeptUsDirect), else
  // mixture_us_short's forms (the 4-term series below kJsdShortSeries, else the z form).
  // kJsdFoldedGrad, kJsdKeptPs: a u_s of +-inf or NaN (logits of +-inf or NaN) kept as 0, so that an entry without
  // mass gives 0 in the unguarded gradient loop (an entry with mass and such a u_s makes ks NaN: the guarded loop runs)
  auto finite_us = [](float us) {
    return !(kJsdFoldedGrad || KEPT_PS) || SPLIT || fabsf(us) < std::numeric_limits<float>::infinity() ? us : 0.f;
  };
  // kJsdBase2Terms: the plain chunks in base 2; the terms pass's sums then in log2(e) units until its end
  // (PT_FROM_PS: see jsd_entry_plain_from_ps; the plain chunks' teacher probabilities made from the student's)
  constexpr bool PT_FROM_PS = kJsdPtFromPs && kJsdPlainChunks && kJsdWeightedPoints;
  static_assert(!PT_FROM_PS || kKeptUsDirect, "the plain chunks keep the terms' own u_s");
  constexpr bool BASE2 = kJsdBase2Terms && KEEP_US && !SPLIT && PT_FROM_PS;
  constexpr float kUnits = BASE2 ? static_cast<float>(kLog2e) : 1.f;  // the other entries' sums into those units
  constexpr bool KS_FROM_KEPT = kJsdKsFromKept && KEPT_PS && BASE2;   // (see kJsdKsFromKept)
  // kJsdKeptUsOffset: u_s kept less its largest value -log(1 - beta) in the first pass (rows summed again keep u_s
  // itself); ks, summed from the kept values, then moves by the same offset
  constexpr bool US_OFFSET = kJsdKeptUsOffset && KS_FROM_KEPT;
  [[maybe_unused]] const float kept_off = US_OFFSET && p.c.beta < 1.f ? kKeptUsScale * log1pf(-p.c.beta) : 0.f;
  // A kept u_s (times kKeptUsScale) within fp16's range. u_s = -log z falls below -65504 / kKeptUsScale (~-128)
  // only where the teacher outweighs the student by e^128 / beta, a student probability below float's smallest
  // numbers (0, or a gradient term below ~1e-40): a finite logit that far below the row's (a -1e4 mask beside
  // logits of ~1e4) was kept as -inf, and ps 0 times -inf made its gradient NaN. (A plain chunk's |d| < 64 keeps
  // its u_s in range: only the other entries are clamped.)
  auto in_fp16 = [](float kept) { return fminf(fmaxf(kept, -65504.f), 65504.f); };
  // u_s as kept: times kKeptUsScale (US_OFFSET: plus off, already times it), a u_s not finite as 0, in fp16's range
  auto keep = [&](float us, float off) {
    if constexpr (US_OFFSET) return in_fp16(d_fma(finite_us(us), kKeptUsScale, off));
    else return in_fp16(finite_us(us) * kKeptUsScale);
  };
  auto fp16_rounded = [](float x) { return __half2float(__float2half_rn(x)); };  // (KS_FROM_KEPT: as stored)
  auto kept_us = [&](const Point<float>& e, float us) {
    if constexpr (kKeptUsDirect) return keep(us, kept_off);  // (rows summed again write theirs again, below)
    const float s =
        e.d * e.d < static_cast<float>(kJsdShortSeries * kJsdShortSeries) ? e.d * horner<4>(&p.c.us[0], e.d) : us;
    return in_fp16(s * kKeptUsScale);
  };
  float us_tail = 0.f;  // KEEP_US: the tail entry's (its logits stay in device memory)
  float ks = 0.f;
  [[maybe_unused]] float ps_exp = 0.f;
  if constexpr (KEPT_PS) ps_exp = 15.f + fminf(fmaxf(floorf(rn.s.lz), 0.f), 64.f);  // (a NaN lz: 0)
  {
    Terms<float> acc{0.f, 0.f, 0.f};
    float mass = 0.f;
    [[maybe_unused]] float mass_s = 0.f, mass_t = 0.f;
    if constexpr (MASS_FROM_NORMS) {  // each distribution's sum over this thread's entries, 2^(o - mx - lz) sum
      auto own_mass = [](float o, float sum, const Norm<float>& n) {
        return sum == 0.f ? 0.f : sum * d_exp2((o - n.mx) - n.lz);  // (no entry with mass: 0, whatever the offsets)
      };
      mass_s = own_mass(own_norms[0], own_norms[1], rn.s);
      mass_t = own_mass(own_norms[2], own_norms[3], rn.t);
      mass = mass_s + mass_t;
    }
    if constexpr (KEEP_US) {  // the terms, each chunk's u_s written over its teacher's chunk
      // kJsdWeightedPoints: the points' probabilities carry the mixture's weights through the normalisers
      RowNorms<float> rw = rn;
      if constexpr (kJsdWeightedPoints) {
        rw.s.lz = rn.s.lz - log2f(1.f - p.c.beta);
        rw.t.lz = rn.t.lz - log2f(p.c.beta);
      }
      if constexpr (KEPT_PS) {  // both probabilities times 2^ps_exp (d, from rn's dd and dlz, is as before)
        rw.s.lz -= ps_exp;
        rw.t.lz -= ps_exp;
      }
      [[maybe_unused]] float ks_kept = 0.f;  // KS_FROM_KEPT: sum (1 - beta) ps 2^ps_exp kept u_s (times kKeptUsScale)
      auto pass = [&](auto close_c) {
        constexpr bool CLOSE = decltype(close_c)::value;
        // (in_chunk: an entry whose kept u_s is fp16-rounded, a chunk's, or under KS_FROM_KEPT the tail's too)
        auto entry = [&](float xsv, float xtv, float& wps, bool in_chunk) {
          float us;
          if constexpr (kJsdWeightedPoints) {  // acc.ks sums (1 - beta) ps u_s, divided out below
            const Point<float> e = make_point<CLOSE>(xsv, xtv, k2, rw);
            float b;
            acc.loss += jsd_entry_weighted(e, p.c, us, b) * kUnits;
            // KS_FROM_KEPT: a chunk's finite u_s counts from its kept value, below
            if (!(KS_FROM_KEPT && in_chunk) || !(fabsf(us) < std::numeric_limits<float>::infinity()))
              acc.ks += b * kUnits;
            wps = e.ps;
            return kept_us(e, us);
          } else {
            const Point<float> e = make_point<CLOSE>(xsv, xtv, k2, rn);
            float ut;
            acc.loss += jsd_entry_direct(e, p.c, us, ut);
            acc.ks += e.ps <= 0.f ? 0.f : e.ps * us;
            wps = e.ps;
            return kept_us(e, us);
          }
        };
        // PT_FROM_PS: (1 - beta) ps is normal (2^-120 and up) where a student logit lies above this
        [[maybe_unused]] const float xs_normal = PT_FROM_PS ? ((rw.s.mx + rw.s.lz) - 120.f) / k2 : 0.f;
        [[maybe_unused]] const float pt_per_ps = PT_FROM_PS ? p.c.beta / (1.f - p.c.beta) : 0.f;
        for (int c = threadIdx.x; c < chunks; c += THREADS) {
          const Vec<T> vs = load_chunk(xs + c * N, true), vt = load_chunk(xt + c * N, true);
          if constexpr (!(kJsdPlainChunks && kJsdWeightedPoints)) {  // (as before version 34)
            KeptVec kept;
            float wps;
#pragma unroll
            for (int q = 0; q < N; ++q)
              kept.v[q] = static_cast<c10::Half>(entry(entry_float(vs, q), entry_float(vt, q), wps, true));
            *reinterpret_cast<KeptVec*>(xt + c * N) = kept;  // this thread's own chunk, just read
            continue;
          }
          static_assert(N == 8, "a chunk of 16-bit logits: eight kept u_s in one 16-byte store");
          bool plain = true;
#pragma unroll
          for (int q = 0; q < N; ++q) {
            const float xsv = entry_float(vs, q);
            if constexpr (BASE2)
              plain &= fabsf(point_d2<CLOSE>(xsv, entry_float(vt, q), k2, rw)) < float(kJsdLogSpace * kLog2e);
            else plain &= fabsf(point_d<CLOSE>(xsv, entry_float(vt, q), k2, rw)) < float(kJsdLogSpace);
            if constexpr (PT_FROM_PS) plain &= xsv > xs_normal;
          }
          // Each branch packs its kept u_s into words (fp16 pairs, round to nearest as the cast): halves set one by
          // one in a vector that both branches write were packed, unpacked and packed again at the join (PRMTs).
          float kf[N];
          [[maybe_unused]] float kp[N];  // KEPT_PS: (1 - beta) ps 2^ps_exp
          if (plain) {
#pragma unroll
            for (int q = 0; q < N; ++q) {
              [[maybe_unused]] float us, b;
              if constexpr (BASE2) {  // d2, the summand, b and lz2 in log2(e) units
                const float xsv = entry_float(vs, q);
                const float d2 = point_d2<CLOSE>(xsv, entry_float(vt, q), k2, rw);
                const float ps = d_exp2(log2_prob(xsv, k2, rw.s));
                float lz2;
                acc.loss += jsd_entry_plain_base2(ps, d2, pt_per_ps, p.c, lz2, b);
                // u_s = -lz2 ln 2, kept times kKeptUsScale (US_OFFSET: less -log(1 - beta))
                if constexpr (US_OFFSET) kf[q] = d_fma(lz2, static_cast<float>(-kKeptUsScale * kLn2), kept_off);
                else kf[q] = lz2 * static_cast<float>(-kKeptUsScale * kLn2);
                if constexpr (KEPT_PS) kp[q] = ps;
              } else if constexpr (PT_FROM_PS) {
                const float xsv = entry_float(vs, q);
                const float d = point_d<CLOSE>(xsv, entry_float(vt, q), k2, rw);
                const float ps = d_exp2(log2_prob(xsv, k2, rw.s));  // (make_point's e.ps)
                acc.loss += jsd_entry_plain_from_ps(ps, d, pt_per_ps, p.c, us, b);
                kf[q] = us * kKeptUsScale;
                if constexpr (KEPT_PS) kp[q] = ps;
              } else {
                const Point<float> e = make_point<CLOSE>(entry_float(vs, q), entry_float(vt, q), k2, rw);
                acc.loss += jsd_entry_plain(e, p.c, us, b);
                kf[q] = kept_us(e, us);
              }
              if constexpr (!KS_FROM_KEPT) acc.ks += b;
            }
          } else {
#pragma unroll
            for (int q = 0; q < N; ++q) kf[q] = entry(entry_float(vs, q), entry_float(vt, q), kp[q], true);
          }
          auto store_halves = [&](T* dst, const float* f) {  // eight floats as fp16 (round to nearest, as the cast)
            __half2 h[N / 2];
#pragma unroll
            for (int q = 0; q < N / 2; ++q) h[q] = __floats2half2_rn(f[2 * q], f[2 * q + 1]);
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(h);
            return *reinterpret_cast<const uint4*>(h);
          };
          const uint4 kept_us_words = store_halves(xt + c * N, kf);  // its own chunk, just read
          if constexpr (KEPT_PS) store_halves(xs + c * N, kp);       // (likewise)
          if constexpr (KS_FROM_KEPT) {  // ks from the kept u_s (times kKeptUsScale; a non-finite one kept as 0)
            const __half2* h = reinterpret_cast<const __half2*>(&kept_us_words);
#pragma unroll
            for (int q = 0; q < N / 2; ++q) {
              const float2 u = __half22float2(h[q]);
              ks_kept = d_fma(kp[2 * q], u.x, ks_kept);
              ks_kept = d_fma(kp[2 * q + 1], u.y, ks_kept);
            }
          }
        }
        float wps_tail;  // (the tail's gradient forms its ps again)
        if (has_tail) {
          // KS_FROM_KEPT: the tail's u_s rounded as a chunk's is, and its part of ks from that rounded u_s
          us_tail = entry(static_cast<float>(gsrc[tail]), static_cast<float>(gtsrc[tail]), wps_tail, KS_FROM_KEPT);
          if constexpr (KS_FROM_KEPT) {
            us_tail = fp16_rounded(us_tail);
            ks_kept = d_fma(wps_tail, us_tail, ks_kept);
          }
        }
      };
      if (rn.close) pass(std::true_type{});
      else pass(std::false_type{});
      if constexpr (BASE2) {  // back to natural units
        acc.loss *= static_cast<float>(kLn2);
        acc.ks *= static_cast<float>(kLn2);
      }
      if constexpr (KS_FROM_KEPT) acc.ks += ks_kept * (1.f / kKeptUsScale);
    } else if (FOLD && folded) {
      if constexpr (FOLD) {  // forward / reverse KL's direct terms from folded points (see kFoldedOffsets)
        constexpr bool FWD = MODE == FORWARD_KL;
        // p weights the summand (forward KL: pt), q is the other: q - p formed in q's units, q' - p' 2^(eq - ep)
        const float ep = FWD ? fo.et : fo.es, eq = FWD ? fo.es : fo.et, x = eq - ep;
        const float r = exp2_tiny(x);
        const float gscale = FOLD_SCALE ? 1.f : scale * exp2_tiny(-fo.es);  // (FOLD_SCALE: 2^lambda is in qp)
        for_each_entry(std::bool_constant<G>{}, gscale, [&](auto close_c, float xsv, float xtv) {
          const Point<float> e = folded_point(close_c, xsv, xtv);
          const float pp = FWD ? e.pt : e.ps, qq = FWD ? e.ps : e.pt;
          const float qp = d_fma(-pp, r, qq);  // (q - p) 2^eq
          // Forward KL tests no pt = 0 (kl_term_direct's test): 0 times an infinite d (a teacher's logit of -inf)
          // is NaN, which sends the thread to its second sum, whose form has the test. Reverse KL keeps it (ks's).
          if constexpr (FWD) acc.loss += d_fma(pp, e.d, qp);
          else acc.loss += pp <= 0.f ? qq : d_fma(pp, -e.d, qp);  // (p = 0: qp is qq)
          if (KS) acc.ks += e.ps > 0.f ? -e.ps * e.d : 0.f;       // (times 2^es)
          return G ? qp : 0.f;  // forward KL: (ps - pt) 2^es (times 2^lambda), written times 2^-es (or as it is)
        });
        // The sum S' = 2^lambda (2^ep (sum p u + r' sum p) + 2^eq sum (q - p)) (r' = 2^x - r, r's own rounding;
        // lambda 0 but for FOLD_SCALE) as the pair's: 2^-lambda 2^-ep S' - x ln 2 sum (q - p) - r' sum p, with the
        // sums from this thread's masses
        const float r_err = d_fma(x, static_cast<float>(kLn2), 1.f - r);  // (1 - r is exact)
        const float mq_mp = FWD ? mass_s - mass_t : mass_t - mass_s, mp = FWD ? mass_t : mass_s;
        const float unfold = FOLD_SCALE ? exp2_tiny(-ep) * sf.y : exp2_tiny(-ep);
        acc.loss = d_fma(acc.loss, unfold, -d_fma(mq_mp, x * static_cast<float>(kLn2), r_err * mp));
        if (KS) acc.ks *= exp2_tiny(-fo.es);
      }
    } else if constexpr (KEEP_F32) {  // point_terms' terms, each chunk's ps and u_s kept over its logits
      auto pass = [&](auto close_c) {
        constexpr bool CLOSE = decltype(close_c)::value;
        for (int c = threadIdx.x; c < chunks; c += THREADS) {
          const Vec<T> vs = load_chunk(xs + c * N, true), vt = load_chunk(xt + c * N, true);
          Vec<T> kept_ps, kept_us;
#pragma unroll
          for (int q = 0; q < N; ++q) {
            const Point<float> e = make_point<CLOSE>(entry_float(vs, q), entry_float(vt, q), k2, rn);
            float us, ut;
            acc.loss += jsd_point_entry(e, p.c, us, ut);
            acc.ks += e.ps <= 0.f ? 0.f : e.ps * us;  // (point_terms' ks)
            kept_ps.v[q] = e.ps;
            kept_us.v[q] = us;
          }
          *reinterpret_cast<Vec<T>*>(xs + c * N) = kept_ps;  // this thread's own chunks, just read
          *reinterpret_cast<Vec<T>*>(xt + c * N) = kept_us;
        }
        if (has_tail)
          point_terms<MODE, true, false>(
              make_point<CLOSE>(static_cast<float>(gsrc[tail]), static_cast<float>(gtsrc[tail]), k2, rn), p.c, acc);
      };
      if (rn.close) pass(std::true_type{});
      else pass(std::false_type{});
    } else {
      for_each_point(std::bool_constant<G>{}, [&](const Point<float>& e) {
        if constexpr (DIRECT) {
          const bool fwd = MODE == FORWARD_KL;
          const float pp = fwd ? e.pt : e.ps, qq = fwd ? e.ps : e.pt;
          acc.loss += kl_term_direct(pp, qq, fwd ? e.d : -e.d);
          if constexpr (!MASS_FROM_NORMS) mass += pp + qq;
          if (KS) acc.ks += e.ps > 0.f ? -e.ps * e.d : 0.f;   // (point_terms' ks of reverse KL)
        } else if constexpr (JSD_DIRECT || JSD_FWD_DIRECT) {  // (one or the other: KS needs GRAD)
          float us, ut;
          acc.loss += jsd_entry_direct(e, p.c, us, ut);
          if constexpr (JSD_DIRECT) acc.ks += e.ps <= 0.f ? 0.f : e.ps * us;
          else mass += d_fma(p.c.beta, e.pt - e.ps, e.ps);  // the mixture mass
        } else {
          point_terms<MODE, KS, false>(e, p.c, acc);
        }
        if constexpr (G) return student_grad<MODE>(e, p.c, 0.f);
        else return 0.f;
      });
    }
    constexpr double kMin = JSD_FWD_DIRECT ? kJsdDirectMin : kDirectMin;
    if ((DIRECT || JSD_FWD_DIRECT) && !(acc.loss >= static_cast<float>(kMin) * mass)) {  // this thread's entries again
      Terms<float> exact{0.f, 0.f, 0.f};
      for_each_point(std::false_type{}, [&](const Point<float>& e) {
        point_terms<MODE, false, false>(e, p.c, exact);
        return 0.f;
      });
      acc.loss = exact.loss;
    }
    if constexpr (KEPT_PS) {  // the probabilities carried 2^ps_exp (exact: a power of two)
      const float unscale = ldexpf(1.f, -static_cast<int>(ps_exp));
      acc.loss *= unscale;
      acc.ks *= unscale;
    }
    const float loss = warp_sum(acc.loss);
    if (lane == 0) partial[warp] = loss;
    if (KS && !JSD_DIRECT) {
      const float k = warp_sum(acc.ks);
      if constexpr (SPLIT) {  // float32's JSD: the slice's (ks, loss), then the ranks' (stage 1)
        const float2 v = cluster_fold<WARPS>(cluster, slot_split, make_float2(k, loss), make_float2(0.f, 0.f), ranks,
                                             lane, warp, FoldSum{});
        const float4 w =
            peer_exchange_block(*pr, 1, sl.row, make_float4(v.y, v.x, 0.f, 0.f), sl.rank == 0, peer_recs, PeerSums{});
        ks = w.y;
        if (sl.rank == 0 && threadIdx.x == 0) pr->rows_loss[sl.row] = w.x;
      } else if constexpr (TWO_LEVEL) {
        ks = cluster_fold<WARPS>(cluster, slot_ks, k, 0.f, ranks, lane, warp, FoldSum{});
      } else {
        if (lane == 0) slot_ks[warp] = k;
        cluster_arrive();  // every block has read the normalisers and published its ks
        cluster_wait();
        if (warp == 0) {
          float v = 0.f;
          for (int i = lane; i < ranks * WARPS; i += 32) v += *cluster.map_shared_rank(slot_ks + i % WARPS, i / WARPS);
          v = warp_sum(v);
          if (lane == 0) bcast[0] = v;
        }
        __syncthreads();
        ks = bcast[0];
      }
      arrive_to_leave(ks);
    }
    if constexpr (JSD_DIRECT) {
      // The row's (ks, loss): every warp's published, one cluster barrier, then summed by every block in the same
      // order (so every block holds the same bits). Slots of their own for the second sum: it needs no barrier
      // for other blocks to finish reading the first.
      __shared__ float2 slot_kl[2][SLOTS];
      auto row_sums = [&](float2* slots, float k, float l) {
        if constexpr (TWO_LEVEL) {
          return cluster_fold<WARPS>(cluster, slots, make_float2(k, l), make_float2(0.f, 0.f), ranks, lane, warp,
                                     FoldSum{});
        } else {
          if (lane == 0) slots[warp] = make_float2(k, l);
          cluster_arrive();  // every block has read the normalisers (and any earlier slots) and published its own
          cluster_wait();
          if (warp == 0) {
            float2 v = make_float2(0.f, 0.f);
            for (int i = lane; i < ranks * WARPS; i += 32) {
              const float2 q = *cluster.map_shared_rank(slots + i % WARPS, i / WARPS);
              v.x += q.x;
              v.y += q.y;
            }
            v = make_float2(warp_sum(v.x), warp_sum(v.y));
            if (lane == 0) {
              bcast[0] = v.x;
              bcast[1] = v.y;
            }
          }
          __syncthreads();
          return make_float2(bcast[0], bcast[1]);
        }
      };
      float2 sums = row_sums(slot_kl[0], warp_sum(acc.ks), loss);
      if constexpr (KEEP_US && kJsdWeightedPoints) {  // ks = sum (1 - beta) ps u_s / (1 - beta)
        const float w = 1.f - p.c.beta;
        sums.x = w > 0.f ? sums.x / w : 0.f;  // (beta rounded to 1 in float32: no student gradient, ks unused)
      }
      // SPLIT: the ranks' (loss, ks) records of their slices combined, at stage 1 (then 2 after the series)
      auto over_ranks = [&](int stage, float2 v) {
        if constexpr (SPLIT) {
          const float4 w = peer_exchange_block(*pr, stage, sl.row, make_float4(v.y, v.x, 0.f, 0.f), sl.rank == 0,
                                               peer_recs, PeerSums{});
          return make_float2(w.y, w.x);
        } else {
          return v;
        }
      };
      sums = over_ranks(1, sums);
      if (!(sums.y >= static_cast<float>(kJsdDirectMin))) {  // the row again, with the series
        Terms<float> exact{0.f, 0.f, 0.f};
        if constexpr (KEEP_US) {  // the teacher's logits from device memory (shared memory holds u_s now)
          // kKeptUsDirect: each entry's u_s written again, in mixture_us_short's forms (the series near d = 0).
          // KS_FROM_KEPT: ks summed from the u_s as kept (fp16-rounded), as the first pass does; a u_s that is not
          // finite (kept as 0) adds its exact part. (These are rows whose distributions nearly agree, where the
          // gradient cancels most: with the series' exact ks, rows uniform on a support left ~4e-8 in a gradient
          // that is 0; kernels/NOTES.md, version 53.) US_OFFSET or not, these keep u_s itself: their u_s are small
          // (the distributions nearly agree), and where they agree exactly every kept u_s is 0 and so is the
          // gradient, which an offset would leave at its rounding (kernels/NOTES.md, version 54).
          auto entry = [&](const Point<float>& e) {
            point_terms<MODE, !KS_FROM_KEPT, false>(e, p.c, exact);
            const float us = mixture_us_short(e, p.c);
            const float kept = keep(us, 0.f);
            if constexpr (!KS_FROM_KEPT) {
              return kept;
            } else {
              const float rounded = fp16_rounded(kept);
              const bool finite = fabsf(us) < std::numeric_limits<float>::infinity();
              if (e.ps > 0.f) exact.ks += e.ps * (finite ? rounded * (1.f / kKeptUsScale) : us);
              return rounded;
            }
          };
          auto pass = [&](auto close_c) {
            constexpr bool CLOSE = decltype(close_c)::value;
            for (int c = threadIdx.x; c < chunks; c += THREADS) {
              // (KEPT_PS: shared memory holds the kept ps in place of the student's logits)
              const Vec<T> vs = load_chunk(KEPT_PS ? gsrc + c * N : xs + c * N, true);
              const Vec<T> vt = load_chunk(gtsrc + c * N, true);
              if constexpr (kKeptUsDirect) {
                KeptVec kept;
#pragma unroll
                for (int q = 0; q < N; ++q)
                  kept.v[q] =
                      static_cast<c10::Half>(entry(make_point<CLOSE>(entry_float(vs, q), entry_float(vt, q), k2, rn)));
                *reinterpret_cast<KeptVec*>(xt + c * N) = kept;  // this thread's own chunk
              } else {
#pragma unroll
                for (int q = 0; q < N; ++q)
                  point_terms<MODE, true, false>(make_point<CLOSE>(entry_float(vs, q), entry_float(vt, q), k2, rn), p.c,
                                                 exact);
              }
            }
            if (has_tail) {
              if constexpr (kKeptUsDirect)
                us_tail =
                    entry(make_point<CLOSE>(static_cast<float>(gsrc[tail]), static_cast<float>(gtsrc[tail]), k2, rn));
              else
                point_terms<MODE, true, false>(
                    make_point<CLOSE>(static_cast<float>(gsrc[tail]), static_cast<float>(gtsrc[tail]), k2, rn), p.c,
                    exact);
            }
          };
          if (rn.close) pass(std::true_type{});
          else pass(std::false_type{});
        } else {
          for_each_point(std::false_type{}, [&](const Point<float>& e) {
            point_terms<MODE, true, false>(e, p.c, exact);
            return 0.f;
          });
        }
        const float loss2 = warp_sum(exact.loss);
        if (lane == 0) partial[warp] = loss2;
        sums = over_ranks(2, row_sums(slot_kl[1], warp_sum(exact.ks), loss2));
      }
      ks = sums.x;
      if (SPLIT && sl.rank == 0 && threadIdx.x == 0) pr->rows_loss[sl.row] = sums.y;
      arrive_to_leave(sums.x + sums.y);
    }
  }

  // ---- 3. the gradients that need ks (reverse KL, JSD)
  // (16-bit gradients: the JSD's u_s without the 10-term series, see mixture_us_short)
  if constexpr (KEEP_US) {  // ps and the kept u_s: (1 - beta) ps (u_s - ks), as student_grad
    const float coef = (1.f - p.c.beta) * scale;
    // An entry's gradient from its (weighted) ps and kept u_s, with the guard: NaN stays NaN; no mass, no gradient
    auto guarded = [&](float ps, float us_scaled, float factor) {
      if (!(ps > 0.f)) return ps != ps ? ps : 0.f;
      return factor * ps * (us_scaled * (1.f / kKeptUsScale) - ks);
    };
    auto grad = [&](float xsv, float us_scaled) { return guarded(d_exp2(log2_prob(xsv, k2, rn.s)), us_scaled, coef); };
    // This thread's chunks: each entry's gradient from its student logit (KEPT_PS: its kept (1 - beta) ps 2^ps_exp)
    // and kept u_s (scaled), by entry_grad.
    auto chunk_grads = [&](auto&& entry_grad) {
      for (int c = threadIdx.x; c < chunks; c += THREADS) {
        Vec<T> g;
        if constexpr (KEPT_PS) {
          const KeptVec wps = *reinterpret_cast<const KeptVec*>(xs + c * N);
          const KeptVec kept = *reinterpret_cast<const KeptVec*>(xt + c * N);
#pragma unroll
          for (int q = 0; q < N; ++q)
            g.v[q] = static_cast<T>(entry_grad(static_cast<float>(wps.v[q]), static_cast<float>(kept.v[q])));
        } else {
          const Vec<T> vs = load_chunk(xs + c * N, true);
          const KeptVec kept = *reinterpret_cast<const KeptVec*>(xt + c * N);
#pragma unroll
          for (int q = 0; q < N; ++q)
            g.v[q] = static_cast<T>(entry_grad(entry_float(vs, q), static_cast<float>(kept.v[q])));
        }
        store_chunk(gs + c * N, g, true);
      }
    };
    const bool finite_ks = fabsf(ks) < std::numeric_limits<float>::infinity();
    if constexpr (KEPT_PS) {  // the factor scale 2^-ps_exp ((1 - beta) is in the kept ps)
      const float coef_kept = scale * ldexpf(1.f, -static_cast<int>(ps_exp));
      if (finite_ks) {  // a ps of 0 has a finite kept u_s (finite_us): 0
        const float c1 = coef_kept * (1.f / kKeptUsScale), c0 = coef_kept * ks;
        chunk_grads([&](float wps, float us_scaled) { return wps * d_fma(us_scaled, c1, -c0); });
      } else {  // (a NaN in the row) with grad's guard
        chunk_grads([&](float wps, float us_scaled) { return guarded(wps, us_scaled, coef_kept); });
      }
    } else {
      // kJsdFoldedGrad: ps times the factor as 2^(x k2 - folded), folded = mx + lz - log2 coef in double, rounded once
      const double folded =
          static_cast<double>(rn.s.mx) + static_cast<double>(rn.s.lz) - log2(static_cast<double>(coef));
      if (kJsdFoldedGrad && !SPLIT && finite_ks && fabsf(rn.s.mx) <= kFoldedGradMax &&
          fabs(folded) < 1024.0) {  // (NaN fails every test)
        const float off = static_cast<float>(folded);
        chunk_grads([&](float xsv, float us_scaled) {
          return d_exp2(d_fma(xsv, k2, -off)) * d_fma(us_scaled, 1.f / kKeptUsScale, -ks);
        });
      } else {
        chunk_grads(grad);
      }
    }
    if (has_tail) gs[tail] = static_cast<T>(grad(static_cast<float>(gsrc[tail]), us_tail));
  } else if constexpr (KEEP_F32) {  // (1 - beta) ps (u_s - ks) from the kept ps and u_s, as student_grad
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
      const Vec<T> kept_ps = load_chunk(xs + c * N, true), kept_us = load_chunk(xt + c * N, true);
      Vec<T> g;
#pragma unroll
      for (int q = 0; q < N; ++q) g.v[q] = jsd_student_grad(kept_ps.v[q], kept_us.v[q], p.c, ks) * scale;
      store_chunk(gs + c * N, g, true);
    }
    if (has_tail) {  // (its logits in device memory: formed again, as for_each_point does)
      auto tail_grad = [&](auto close_c) {
        return student_grad<MODE>(make_point<decltype(close_c)::value>(static_cast<float>(gsrc[tail]),
                                                                       static_cast<float>(gtsrc[tail]), k2, rn),
                                  p.c, ks);
      };
      gs[tail] = static_cast<T>((rn.close ? tail_grad(std::true_type{}) : tail_grad(std::false_type{})) * scale);
    }
  } else if (FOLD && KS && folded) {  // reverse KL: ps' (-d - ks) times scale 2^-es
    for_each_entry(std::true_type{}, scale * exp2_tiny(-fo.es), [&](auto close_c, float xsv, float xtv) {
      return student_grad<MODE, sizeof(T) == 2>(folded_point(close_c, xsv, xtv), p.c, ks);
    });
  } else if (KS) {
    for_each_point(std::true_type{},
                   [&](const Point<float>& e) { return student_grad<MODE, sizeof(T) == 2>(e, p.c, ks); });
  }
  cluster_wait();  // no block leaves while another may still read its shared memory
#endif
}

// The kernels around fast_rows. For 16-bit logits a block's slices take ~32 KB of shared memory, so 7 blocks fit
// in an SM, and at more than 32 registers a thread only 6 would: the forward KL's gradient kernel went from 32
// to 40 registers after a change that removed instructions and lost the time it gained (kernels/NOTES.md,
// version 9), so 16-bit logits get a cap. The JSD too since version 12 (no spill; 40 registers uncapped, and
// capped its step ran 4% faster on an H200; with version 9's logs a cap had made it spill).
// float32 slices are twice the size (shared memory limits those blocks first) and keep the
// compiler's own choice: any cap there changed ptxas's strategy and made it spill.
// (SHIFT: fast_rows')
template <typename T, int MODE, bool GRAD, bool SHIFT = false>
__global__ void __maxnreg__(32) fast_rows_kernel_16(const Params<T, float> p) {
  fast_rows<T, MODE, GRAD, kFastThreads, false, SHIFT>(p);
}
template <typename T, int MODE, bool GRAD, bool SHIFT = false>
__global__ void __launch_bounds__(kFastThreads) fast_rows_kernel(const Params<T, float> p) {
  fast_rows<T, MODE, GRAD, kFastThreads, false, SHIFT>(p);
}
// The 16-bit training instances in narrower blocks, uncapped (kNarrowKsBlocks, kDirectStepTerms).
template <typename T, int MODE, bool SHIFT = false>
__global__ void __launch_bounds__(kNarrowThreads, 7) fast_rows_kernel_narrow(const Params<T, float> p) {
  fast_rows<T, MODE, true, kNarrowThreads, false, SHIFT>(p);
}
// The same for long rows (kWideLongRows): three blocks an SM leave each thread up to 85 registers.
template <typename T, int MODE>
__global__ void __launch_bounds__(kWideThreads, 3) fast_rows_kernel_wide(const Params<T, float> p) {
  fast_rows<T, MODE, true, kWideThreads, false, false, true>(p);
}

// The split's one-read kernels (SPLIT; forward KL and the JSD's training rows, distill_peer_terms): as
// fast_rows_kernel_narrow (16-bit training rows), fast_rows_kernel_16 (16-bit forward KL, no gradient) and
// fast_rows_kernel (float32).
template <typename T, int MODE>
__global__ void __launch_bounds__(kNarrowThreads, 7)
    split_rows_kernel_narrow(const Params<T, float> p, const PeerRows pr) {
  fast_rows<T, MODE, true, kNarrowThreads, true>(p, &pr);
}
template <typename T, bool GRAD>
__global__ void __maxnreg__(32) split_rows_kernel_16(const Params<T, float> p, const PeerRows pr) {
  fast_rows<T, FORWARD_KL, GRAD, kFastThreads, true>(p, &pr);
}
template <typename T, int MODE, bool GRAD>
__global__ void __launch_bounds__(kFastThreads) split_rows_kernel(const Params<T, float> p, const PeerRows pr) {
  fast_rows<T, MODE, GRAD, kFastThreads, true>(p, &pr);
}

// STRIDE: the rows' losses' spacing in `rows` (3: column 0 of the split's [n, 3] terms).
template <int STRIDE = 1>
__global__ void __launch_bounds__(256) fast_rows_total_kernel(const float* __restrict__ partial, int64_t n, int per_row,
                                              float* __restrict__ rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= n) return;
  const int lane = threadIdx.x & 31;
  float s = 0.f;
  for (int i = lane; i < per_row; i += 32) s += partial[row * per_row + i];
  s = warp_sum(s);
  if (lane == 0) rows[row * STRIDE] = s;
}

// A thread's next U 16-byte chunks of two rows (c0, c0 + STRIDE, ..., those below `chunks`; the rest are left
// unset), every load issued before any is used: the split's streaming kernels' loads.
template <int STRIDE, typename T, int U>
__device__ __forceinline__ void load_chunk_pairs(const T* s, const T* t, int c0, int chunks, Vec<T> (&vs)[U],
                                                 Vec<T> (&vt)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u * STRIDE;
    if (c < chunks) {
      vs[u] = load_chunk(s + static_cast<int64_t>(c) * Vec<T>::N, true);
      vt[u] = load_chunk(t + static_cast<int64_t>(c) * Vec<T>::N, true);
    }
  }
}

// Phase 0 of a split vocabulary (PHASE_NORMS) where the fast kernel runs (aligned 16-bit or float32 rows): each
// row's two normalisers (max of x k2, log2 of the sum of 2^(x k2 - max)) straight from device memory, one block
// per row, each thread a running (max, sum) over its 16-byte chunks, kNormUnroll of each tensor loaded before
// any is used. fast_rows' normalisers copy the slices into shared memory and meet at a cluster barrier between
// the maximum and the sums; a phase that keeps nothing needs neither (kernels/NOTES.md, version 13).
constexpr int kNormThreads = 256, kNormUnroll = 4;
// float32 logits: each thread's normaliser sums in double (running_norm's double overload, each call's 16 terms
// summed in float first). In float, a thread of a peaked row adds its ~400 small terms one by one to a sum near 1
// (the top entry's), each addition rounded at 2^-24: the row's normaliser ends up ~1e-6 off, and the gradients' K
// sums move with it (ks = Sum ps u_s times that error), where u_s - ks cancels to ~1e-3 at a peaked row's top
// entries: the split's float32 JSD student gradient (a teacher gradient wanted, so the phases) measured up to 8.7 x
// the one-process error, and 1.1e-4 of its float64 truth at one seed of the two-GPU test, on two H200s
// (tools/probe_split_accuracy.py); tools/emulate_split_norms.py reproduces those errors on the CPU and predicts the
// one-process level with the double sums (kernels/NOTES.md, version 36). Measured on two H200s: the worst of 24 draws
// 8.7 -> 2.3 x the one-process error, the median 1.28 -> 1.19 x. 16-bit logits compile the same either way (their
// gradients round at 2^-8); false compiles every kernel as before the switch.
constexpr bool kNormDoubleSums = true;
template <typename T> using NormSum = std::conditional_t<kNormDoubleSums && sizeof(T) == 4, double, float>;

// running_norm's first half: mr raised to the chunks' largest raw logit and l rescaled to it; returns the offset.
template <typename T, int U, typename L>
__device__ __forceinline__ float running_max(const Vec<T> (&v)[U], int valid, float k2, float& mr, L& l) {
  float g = ninf<float>();
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (u < valid) g = fmaxf(g, chunk_max(v[u]));
  if (g > mr) {
    l = l == L(0) ? L(0) : l * static_cast<L>(d_exp2((mr - g) * k2));
    mr = g;
  }
  return mr == ninf<float>() ? 0.f : scaled_max(mr, k2);
}

// A thread's running normaliser after `valid` more chunks: mr is the largest raw logit so far, l the sum of
// 2^(x k2 - mr k2) (rescaled when mr grows; a pair with no mass, l = 0, stays 0).
template <typename T, int U>
__device__ __forceinline__ void running_norm(const Vec<T> (&v)[U], int valid, float k2, float& mr, float& l) {
  const float o = running_max(v, valid, k2, mr, l);
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (u < valid)
#pragma unroll
      for (int q = 0; q < Vec<T>::N; ++q) l += d_exp2(entry_float(v[u], q) * k2 - o);
  l = part_sum(l, o);  // entries so far beyond the lanes' range (padding): a stand-in
}
// The same with the sum in double (kNormDoubleSums): this call's terms summed in float, then added to l.
template <typename T, int U>
__device__ __forceinline__ void running_norm(const Vec<T> (&v)[U], int valid, float k2, float& mr, double& l) {
  const float o = running_max(v, valid, k2, mr, l);
  float part = 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (u < valid)
#pragma unroll
      for (int q = 0; q < Vec<T>::N; ++q) part += d_exp2(entry_float(v[u], q) * k2 - o);
  l += static_cast<double>(part);
  if (!(offset_ok(o) || l != l)) l = 1.0;  // (part_sum's stand-in, at float's offset limit)
}

template <typename T> __global__ void __launch_bounds__(kNormThreads) phase_norms_kernel(const Params<T, float> p) {
  constexpr int N = Vec<T>::N, U = kNormUnroll;
  __shared__ float4 slots[kNormThreads / 32];
  const int64_t row = blockIdx.x;
  if (p.labels && p.labels[row] == p.ignore_index) {  // masked: no mass, as the other kernels write it
    if (threadIdx.x < 4) p.out[4 * row + threadIdx.x] = ninf<float>();
    return;
  }
  const T* s = p.s + row * p.s_stride;
  const T* t = p.t + row * p.t_stride;
  const float k2 = p.k2;
  const int chunks = static_cast<int>(p.v / N);
  float ms = ninf<float>();
  NormSum<T> ls = 0.f;  // (see kNormDoubleSums)
  float mt = ninf<float>();
  NormSum<T> lt = 0.f;
  for (int c0 = threadIdx.x; c0 < chunks; c0 += kNormThreads * U) {
    Vec<T> vs[U], vt[U];
    load_chunk_pairs<kNormThreads>(s, t, c0, chunks, vs, vt);
    const int valid = min(U, (chunks - c0 + kNormThreads - 1) / kNormThreads);
    running_norm(vs, valid, k2, ms, ls);
    running_norm(vt, valid, k2, mt, lt);
  }
  if (threadIdx.x == 0 && p.v % N != 0) {  // the row's last entries, short of a chunk: padded with -inf
    Vec<T> vs[1], vt[1];
#pragma unroll
    for (int q = 0; q < N; ++q) {
      const int64_t j = static_cast<int64_t>(chunks) * N + q;
      vs[0].v[q] = j < p.v ? s[j] : static_cast<T>(ninf<float>());
      vt[0].v[q] = j < p.v ? t[j] : static_cast<T>(ninf<float>());
    }
    running_norm(vs, 1, k2, ms, ls);
    running_norm(vt, 1, k2, mt, lt);
  }
  float ls_f = static_cast<float>(ls), lt_f = static_cast<float>(lt);
  // (max x k2, sum) pairs combined over the warp, then the block's warps in a fixed order (deterministic).
  ms = scaled_max(ms, k2);  // k2 > 0: the max of the scaled logits
  mt = scaled_max(mt, k2);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    combine_pair(ms, ls_f, __shfl_xor_sync(0xffffffffu, ms, o), __shfl_xor_sync(0xffffffffu, ls_f, o));
    combine_pair(mt, lt_f, __shfl_xor_sync(0xffffffffu, mt, o), __shfl_xor_sync(0xffffffffu, lt_f, o));
  }
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = make_float4(ms, ls_f, mt, lt_f);
  __syncthreads();
  if (threadIdx.x == 0) {
    float4 a = slots[0];
    for (int w = 1; w < kNormThreads / 32; ++w) {
      combine_pair(a.x, a.y, slots[w].x, slots[w].y);
      combine_pair(a.z, a.w, slots[w].z, slots[w].w);
    }
    reinterpret_cast<float4*>(p.out)[row] = make_float4(a.x, d_log2(a.y), a.z, d_log2(a.w));
  }
}

// Phases 1 and 2 of a split vocabulary where the fast kernels run (kernels/NOTES.md, version 14): with the rows'
// normalisers given, no entry needs another, so each row's slice goes straight from device memory through
// registers, one block per row, with no shared-memory copy and no cluster (fast_rows' phases copied the slice
// into shared memory first, which bounds the blocks an SM holds: their terms phase took 12-15% longer on H200s). The
// same point functions as every other kernel (make_point, point_terms, student_grad).
//   PHASE_TERMS: the row's (loss, ks, kt) into p.out [n, 3] (its warps' sums added in a fixed order), and forward
//                KL's gradient (GRAD);
//   PHASE_GRAD:  the student's gradient that needs ks (p.k_in).
// A thread writes only entries it has read, so the gradient may be written over the student's logits.
constexpr int kStreamThreads = 256, kStreamUnroll = 2;

template <typename T, int MODE, bool GRAD, int PHASE>
__global__ void __launch_bounds__(kStreamThreads, 4) phase_stream_kernel(const Params<T, float> p) {
  constexpr int N = Vec<T>::N, U = kStreamUnroll;
  constexpr bool TERMS = PHASE == PHASE_TERMS;
  static_assert(TERMS || PHASE == PHASE_GRAD, "the normalisers are phase_norms_kernel's");
  static_assert(kStreamThreads == kFastThreads, "zero_slice strides by kFastThreads");
  const int64_t row = blockIdx.x;
  const int count = static_cast<int>(p.v);
  T* gs = GRAD ? p.gs + row * p.gs_stride : nullptr;
  if (p.labels && p.labels[row] == p.ignore_index) {  // masked: zeros
    if (GRAD) zero_slice(gs, count);
    if (TERMS && threadIdx.x < 3) p.out[3 * row + threadIdx.x] = 0.f;
    return;
  }
  const T* s = p.s + row * p.s_stride;
  const T* t = p.t + row * p.t_stride;
  const float* nr = p.norms_in + 4 * row;
  const RowNorms<float> rn = row_norms(Norm<float>{nr[0], nr[1]}, Norm<float>{nr[2], nr[3]});
  const float k2 = p.k2;
  const float scale = static_cast<float>(p.base_scale() * static_cast<double>(p.inv_t));
  const float ks = TERMS ? 0.f : p.k_in[2 * row];
  const int chunks = count / Vec<T>::N;
  // A thread's sums. ks and kt are plain sums whose terms change sign, and the gradients subtract them from
  // per-entry values close to them (the JSD's u_s - ks): summed in float over a thread's ~250 entries of a 64k
  // slice they moved a float32 JSD gradient by ~1e-5 relative (an emulation of this order against float64; 3.5e-6
  // in fast_rows' cluster order). So each iteration's (U chunks') ks and kt are moved into double sums (1.2e-6 in
  // the emulation; kernels/NOTES.md, version 17). Forward KL keeps its kt (used only for a teacher's gradient) in
  // float: the doubles cost its hot instance (bf16, the student's gradient) 24 bytes of spill.
  constexpr bool DOUBLE_K = TERMS && MODE != FORWARD_KL;
  Terms<float> acc{0.f, 0.f, 0.f};
  double ks_sum = 0.0, kt_sum = 0.0;
  auto flush = [&]() {
    if constexpr (DOUBLE_K) {
      ks_sum += static_cast<double>(acc.ks);
      kt_sum += static_cast<double>(acc.kt);
      acc.ks = acc.kt = 0.f;
    }
  };
  auto pass = [&](auto close_c) {
    constexpr bool CLOSE = decltype(close_c)::value;
    // An entry's gradient before the scale (0 where this launch writes none), its terms added to acc.
    auto entry = [&](float xs, float xt) {
      const Point<float> e = make_point<CLOSE>(xs, xt, k2, rn);
      if constexpr (TERMS) {
        point_terms<MODE, true, true, float, false>(e, p.c, acc);  // (a JSD teacher's gradient: rows_kernel's terms)
        if constexpr (GRAD) return student_grad<MODE>(e, p.c, 0.f);
        else return 0.f;
      } else {
        return student_grad<MODE, sizeof(T) == 2>(e, p.c, ks);
      }
    };
    for (int c0 = threadIdx.x; c0 < chunks; c0 += kStreamThreads * U) {
      Vec<T> vs[U], vt[U];
      load_chunk_pairs<kStreamThreads>(s, t, c0, chunks, vs, vt);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * kStreamThreads;
        if (c >= chunks) break;
        Vec<T> g;
#pragma unroll
        for (int q = 0; q < N; ++q) {
          const float d = entry(entry_float(vs[u], q), entry_float(vt[u], q));
          if (GRAD) g.v[q] = static_cast<T>(d * scale);
        }
        if (GRAD) store_chunk(gs + static_cast<int64_t>(c) * N, g, true);
      }
      if constexpr (TERMS) flush();
    }
    for (int j = chunks * N + static_cast<int>(threadIdx.x); j < count; j += kStreamThreads) {  // short of a chunk
      const float d = entry(static_cast<float>(s[j]), static_cast<float>(t[j]));
      if (GRAD) gs[j] = static_cast<T>(d * scale);
      if constexpr (TERMS) flush();
    }
  };
  if (rn.close) pass(std::true_type{});
  else pass(std::false_type{});
  if constexpr (TERMS && !DOUBLE_K) {  // the row's sums: each warp's, then the warps' in order
    __shared__ float4 slots[kStreamThreads / 32];
    const float l = warp_sum(acc.loss), a = warp_sum(acc.ks), b = warp_sum(acc.kt);
    if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = make_float4(l, a, b, 0.f);
    __syncthreads();
    if (threadIdx.x == 0) {
      float4 r = slots[0];
      for (int w = 1; w < kStreamThreads / 32; ++w) {
        r.x += slots[w].x;
        r.y += slots[w].y;
        r.z += slots[w].z;
      }
      p.out[3 * row] = r.x;
      p.out[3 * row + 1] = r.y;
      p.out[3 * row + 2] = r.z;
    }
  } else if constexpr (DOUBLE_K) {  // the same, ks and kt in double
    __shared__ float slot_loss[kStreamThreads / 32];
    __shared__ double2 slot_k[kStreamThreads / 32];
    const float l = warp_sum(acc.loss);
    const double a = warp_sum(ks_sum), b = warp_sum(kt_sum);
    if ((threadIdx.x & 31) == 0) {
      slot_loss[threadIdx.x >> 5] = l;
      slot_k[threadIdx.x >> 5] = make_double2(a, b);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float rl = slot_loss[0];
      double2 rk = slot_k[0];
      for (int w = 1; w < kStreamThreads / 32; ++w) {
        rl += slot_loss[w];
        rk.x += slot_k[w].x;
        rk.y += slot_k[w].y;
      }
      p.out[3 * row] = rl;
      p.out[3 * row + 1] = static_cast<float>(rk.x);
      p.out[3 * row + 2] = static_cast<float>(rk.y);
    }
  }
}
