// The distillation module's functions: both backends (distill.cu for CUDA, distill_cpu.cpp for the CPU twin)
// implement them with the same semantics (each includes this header, so a signature that drifts fails to compile)
// and distill_bindings.cpp binds them for Python (kldiv_inline/distill.py and vocab_parallel.py, which validate
// the arguments and lay the logits out as rows first).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

// "cuda" or "cpu": which backend this module was built with.
const char* distill_backend();

// The divergence of student and teacher over rows of logits (distill_common.h has the math), all on this device.
// student [n, v]; exactly one of teacher [n, v] (same dtype) and a top-k teacher (topk_idx int64 [n, k],
// topk_lp [n, k + 1], float32 or float64 for float64 logits: distill_topk_prepare's rows, the k normalised
// log-probabilities then the tail's mass); labels int64 [n] or None
// (rows whose label is ignore_index are masked). reduction: 0 none, 1 sum, 2 batchmean (over unmasked rows).
// Returns {loss ([n] for none, else 0-d; float32, float64 for float64 logits), d loss / d student logits if
// want_student (written into grad_student_out when given, which may alias the student logits), d loss / d teacher
// logits if want_teacher}. The gradients are those of the reduced loss (for none: of the sum of the rows' losses).
// scale: with reduction sum only, a 0-d float64 tensor on the logits' device that multiplies the loss and the
// gradients (the fused LM head's batchmean divisor, counted over the whole batch on the device).
// loss_scale: a finite constant that multiplies the loss (each row's for none) and the gradients, folded into the
// reduction's scale (gradient accumulation's 1 / steps: no pass over the gradient in backward); 1 with a scale.
std::vector<at::Tensor> distill_forward(const at::Tensor& student, const c10::optional<at::Tensor>& teacher,
                                        const c10::optional<at::Tensor>& topk_idx,
                                        const c10::optional<at::Tensor>& topk_lp,
                                        const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                        double temperature, int64_t reduction, bool want_student, bool want_teacher,
                                        const c10::optional<at::Tensor>& grad_student_out,
                                        const c10::optional<at::Tensor>& scale, double loss_scale);

// One phase of a call whose vocabulary is split across processes (each holds a slice of every row):
//   0 (norms): returns {[n, 4] the normalisers of student and teacher logits / T over this slice: (max, log of
//              the sum of exp(x / T - max)) of each, see distill_common.h's Norm}
//   1 (terms): given the rows' global normalisers [n, 4], returns {[n, 3] this slice's (loss, ks, kt) sums, and the
//              gradients that need no row sums: the student's for forward KL, the teacher's for reverse KL}; the
//              sums are of the accumulation dtype on CUDA (its kernels sum in it) and float64 on the CPU twin (its
//              rows' sums are double: the ranks' sum of them is then rounded once, as one process rounds its own)
//   2 (grad):  given the normalisers and the global (ks, kt) [n, 2] (distill_combine's: of the dtype of phase 1's
//              terms), returns {undefined, the remaining gradients}
// scale: a 0-d float64 tensor (the reduction's divisor, 1 / unmasked rows for batchmean), multiplied with 1/T.
std::vector<at::Tensor> distill_phase(int64_t phase, const at::Tensor& student, const at::Tensor& teacher,
                                      const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                      double temperature, const c10::optional<at::Tensor>& norms,
                                      const c10::optional<at::Tensor>& ksums, const c10::optional<at::Tensor>& scale,
                                      bool want_student, bool want_teacher,
                                      const c10::optional<at::Tensor>& grad_student_out);

// The phases' per-row statistics gathered from every rank of a vocabulary split, parts [world, n, width] of the
// dtype distill_phase gave them (rank r's at index r), combined in rank order (the same bits on every rank; the
// results of parts' dtype, the terms added in it):
//   width 4 (phase 0's normalisers): returns {[n, 4] the rows' normalisers over the whole vocabulary}
//   width 3 (phase 1's terms): returns {[n, 2] the rows' (ks, kt) for phase 2, the loss: the rows' losses [n] for
//            reduction none, else 0-d, their sum (in float64) times scale}
// scale: a 0-d float64 tensor on parts' device (distill_reduction_scale's), for width 3 unless reduction is none.
std::vector<at::Tensor> distill_combine(const at::Tensor& parts, int64_t reduction,
                                        const c10::optional<at::Tensor>& scale);

// Peer memory for a vocabulary split across the GPUs of one machine (distill_peer.cuh has the protocol;
// vocab_parallel.py sets it up). CUDA only: the CPU twin refuses these three.
// distill_peer_alloc: a zeroed buffer on CUDA device `device` holding the records of `world` ranks (at most 8) for
// `cap` rows (the layout is distill_peer.cuh's; kept for the process's life: other processes map it), returned as
// {its IPC handle, uint8 [64] on the CPU; its address, int64 [1] on the CPU}.
std::vector<at::Tensor> distill_peer_alloc(int64_t world, int64_t cap, int64_t device);
// distill_peer_map: another process's buffer (its distill_peer_alloc handle) mapped on `device`: its address
// here, or 0 where this GPU cannot map it (no peer access between the two GPUs; the caller takes the all-gathers).
int64_t distill_peer_map(const at::Tensor& handle, int64_t device);
// distill_peer_terms: phases 0 and 1 of a split with the rows' statistics exchanged through the peer buffers
// instead of all-gathers (every rank of the group calls it for the same rows): peers int64 [world] on the
// logits' device, every rank's buffer as this process maps it (its own at `rank`), each holding slots for `cap`
// rows; epoch one int32 on the logits' device, this rank's call counter (zero at first). 16-bit and float32
// logits. Returns {the loss (as distill_combine's: [n] for reduction none, else 0-d, the rows' sum times scale),
// [n, 2] the rows' (ks, kt), [n, 4] the rows' normalisers or undefined, the student's gradient or undefined, the
// teacher's or undefined}: distill_phase 1's gradients, and distill_combine's results after it. Forward KL, and
// the JSD's training rows, without a teacher's gradient, on rows the fast kernel takes, run one kernel that reads
// the logits once (their normalisers stay undefined: no phase 2 needs them); any other call runs phase 0, the
// exchange, then phase 1.
std::vector<at::Tensor> distill_peer_terms(const at::Tensor& student, const at::Tensor& teacher,
                                           const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                           double temperature, int64_t reduction, const at::Tensor& scale,
                                           bool want_student, bool want_teacher,
                                           const c10::optional<at::Tensor>& grad_student_out, const at::Tensor& peers,
                                           const at::Tensor& epoch, int64_t rank, int64_t cap);

// A reduction's divisor's reciprocal times factor (a finite loss_scale) as a 0-d float64 tensor on the device of
// rows [n, ...]: for batchmean factor / the rows whose label is not ignore_index (all n without labels; 0 when none
// is), else factor. Counted on the device: nothing waits for it.
at::Tensor distill_reduction_scale(const at::Tensor& rows, const c10::optional<at::Tensor>& labels,
                                   int64_t ignore_index, int64_t reduction, double factor);

// Whether distill_forward can write d loss / d student logits over the student logits themselves
// (grad_student_out aliasing the student) for rows of `vocab` entries of `element_size` bytes (with a teacher's
// rows beside them, or a top-k teacher): on CUDA only when a cluster holds the rows on chip; always on the CPU.
// Asking beats catching the refusal: an error raised inside an extension can take the process down on some
// set-ups (seen on the lent H200s).
bool distill_in_place_ok(int64_t vocab, int64_t element_size, bool topk);

// A top-k teacher's log-probabilities made ready for distill_forward, with the checks of its indices and mass in
// the same pass: idx int64 [n, k], lp float32/float64 [n, k] (contiguous), labels int64 [n] or None (masked rows
// are exempt from the mass check). Returns {the rows distill_forward takes, [n, k + 1] of lp's dtype: columns
// 0 .. k-1 lp normalised (each row's mass above 1 divided out; with k = vocab the whole distribution normalised),
// column k the tail's mass, 1 - the sum of the normalised row's probabilities formed in double (topk_tail; 0 with
// k = vocab), int32 [3] flags: an index outside [0, vocab), a repeated index within a
// row (any k: rows longer than the CUDA kernel compares pairwise are sorted), an unmasked row whose mass is more
// than 1 (k < vocab) or away from 1 (k = vocab) by more than slack_log (a log1p)}. Nothing waits for the device.
// flags_out: where the flags go instead of a new tensor (zeroed here, returned as the second item), int32 [3] in
// host memory: for CUDA pinned, written by the kernel through its mapped address, so that the caller reads them
// once an event recorded after this call has completed, without a device buffer or a copy; the caller must not
// hand over a buffer that an earlier call's kernel may still write.
std::vector<at::Tensor> distill_topk_prepare(const at::Tensor& idx, const at::Tensor& lp, int64_t vocab,
                                             const c10::optional<at::Tensor>& labels, int64_t ignore_index,
                                             double slack_log, const c10::optional<at::Tensor>& flags_out);

// A top-k teacher over a vocabulary split across processes (vocab_parallel.py's topk_rows): this process holds
// the student's rows [n, v] of the slice that starts at `offset` of the vocabulary; norms [n, 4] are the rows'
// global normalisers (distill_combine's; the student's in columns 0-1); idx int64 [n, k] the teacher's global
// indices (each row's distinct). Returns [n, k + 1] float64: column j < k the log2 of the student's probability of
// idx[:, j] where this slice holds it, else 0; column k this slice's share of the tail's mass (the sum of the
// student's probabilities over the entries of the slice that are not among the row's indices).
at::Tensor distill_topk_slice(const at::Tensor& student, const at::Tensor& norms, const at::Tensor& idx, int64_t offset,
                              double temperature);

// The student's gradient [n, v] (its dtype) over the same slice, from the k + 1 buckets' gradients g_buckets
// [n, k + has_tail] (the accumulation dtype; distill_forward's over the buckets) and the gathered sums whole
// [n, k + 1] (float64; column k the tail's mass): an entry among the indices gets its bucket's gradient, any other
// p_v g_tail / p_tail (its share of the tail's; 0 without a tail or mass), each times scale (a 0-d float64 on the
// device, or none for 1) before rounding; rows whose label is ignore_index get zeros.
at::Tensor distill_topk_slice_grad(const at::Tensor& student, const at::Tensor& norms, const at::Tensor& idx,
                                   int64_t offset, double temperature, const at::Tensor& g_buckets,
                                   const at::Tensor& whole, bool has_tail, const c10::optional<at::Tensor>& labels,
                                   int64_t ignore_index, const c10::optional<at::Tensor>& scale);

// grad [n, v] *= grad_out (one value, or one per row), skipped (on the device) for rows whose factor is 1.
void distill_scale_grad_(at::Tensor grad, const at::Tensor& grad_out);
