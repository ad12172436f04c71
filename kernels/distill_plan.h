// Host-side planning shared by both distillation backends (distill.cu, distill_cpu.cpp): the operands' checks,
// their layout as rows, and the dispatch of run-time choices to kernel templates. kldiv_inline/distill.py checks
// first with friendlier messages; these checks keep a direct call of the module from reading out of bounds.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <type_traits>

#include "distill_common.h"

namespace distill {

// Logits as rows: s (and t) are [n, v] with unit stride along the vocabulary and any row stride; the top-k
// teacher's indices (int64) and log-probabilities (float32, float64 for float64 logits) are contiguous [n, k];
// labels are contiguous int64 [n]. Undefined tensors stand for "not given".
struct Rows {
  at::Tensor s, t, idx, lp, labels;
  int64_t n = 0, v = 0, k = 0;
  bool has_teacher() const { return t.defined(); }
  bool topk() const { return idx.defined(); }
};

inline at::Tensor opt(const c10::optional<at::Tensor>& o) { return o.has_value() ? *o : at::Tensor(); }

inline at::ScalarType acc_type(at::ScalarType st) { return st == at::kDouble ? at::kDouble : at::kFloat; }

// Labels (undefined: none) for n rows: contiguous int64 [n] on `device`, named in the error as the `where` device
// ("logits'", "rows'", "indices'").
inline void check_labels(const at::Tensor& labels, int64_t n, const at::Device& device, const char* where) {
  TORCH_CHECK(!labels.defined() || (labels.dim() == 1 && labels.size(0) == n && labels.is_contiguous() &&
                                    labels.scalar_type() == at::kLong && labels.device() == device),
              "distill: labels must be contiguous int64 [rows] on the ", where, " device");
}

inline Rows prepare_rows(const at::Tensor& student, const c10::optional<at::Tensor>& teacher,
                         const c10::optional<at::Tensor>& topk_idx, const c10::optional<at::Tensor>& topk_lp,
                         const c10::optional<at::Tensor>& labels) {
  Rows r;
  r.s = student;
  r.t = opt(teacher);
  r.idx = opt(topk_idx);
  r.lp = opt(topk_lp);
  r.labels = opt(labels);
  TORCH_CHECK(r.s.dim() == 2 && r.s.stride(1) == 1,
              "distill: student logits must be [rows, vocab] with unit "
              "stride along the vocabulary, got sizes ",
              r.s.sizes(), " strides ", r.s.strides());
  TORCH_CHECK(at::isFloatingType(r.s.scalar_type()), "distill: logits must be floating point, got ", r.s.scalar_type());
  r.n = r.s.size(0);
  r.v = r.s.size(1);
  TORCH_CHECK(r.t.defined() != r.idx.defined(), "distill: give exactly one of teacher logits and a top-k teacher");
  if (r.t.defined()) {
    TORCH_CHECK(r.t.sizes() == r.s.sizes() && r.t.stride(1) == 1,
                "distill: teacher logits must match the "
                "student's [rows, vocab] with unit stride along the vocabulary");
    TORCH_CHECK(r.t.scalar_type() == r.s.scalar_type() && r.t.device() == r.s.device(),
                "distill: teacher logits must have the student's dtype and device");
  } else {
    TORCH_CHECK(r.lp.defined(), "distill: a top-k teacher needs log-probabilities beside its indices");
    TORCH_CHECK(r.idx.dim() == 2 && r.idx.size(0) == r.n && r.idx.is_contiguous() && r.idx.scalar_type() == at::kLong &&
                    r.idx.device() == r.s.device(),
                "distill: top-k indices must be contiguous int64 [rows, k] on the logits' device");
    TORCH_CHECK(r.lp.dim() == 2 && r.lp.size(0) == r.n && r.lp.size(1) == r.idx.size(1) + 1 && r.lp.is_contiguous() &&
                    r.lp.scalar_type() == acc_type(r.s.scalar_type()) && r.lp.device() == r.s.device(),
                "distill: a top-k teacher's rows must be contiguous [rows, k + 1] as distill_topk_prepare writes "
                "them (the k log-probabilities, then the tail's mass), float32 (float64 for float64 logits), "
                "beside the indices; got ",
                r.lp.sizes(), " beside indices ", r.idx.sizes());
    r.k = r.idx.size(1);
  }
  check_labels(r.labels, r.n, r.s.device(), "logits'");
  return r;
}

// The per-row statistics passed between the phases of a vocabulary-parallel call: [n, width] of the
// accumulation type on the logits' device (float64_ok: or float64, as the CPU twin's K sums are).
inline void check_row_stats(const at::Tensor& x, const Rows& r, int64_t width, const char* what,
                            bool float64_ok = false) {
  const auto acc = acc_type(r.s.scalar_type());
  TORCH_CHECK(x.defined() && x.dim() == 2 && x.size(0) == r.n && x.size(1) == width && x.is_contiguous() &&
                  (x.scalar_type() == acc || (float64_ok && x.scalar_type() == at::kDouble)) &&
                  x.device() == r.s.device(),
              "distill: ", what, " must be contiguous [rows, ", width, "] of the accumulation dtype",
              float64_ok ? " (or float64)" : "", " on the logits' device");
}

// distill_combine's operands: parts [world >= 1, n, 4 (normalisers) or 3 (terms)], contiguous, float32 or
// float64; with terms and a reduction other than none, a 0-d float64 scale on parts' device. Returns the width.
inline int64_t check_combine(const at::Tensor& parts, int64_t reduction, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(parts.dim() == 3 && parts.size(0) >= 1 && (parts.size(2) == 4 || parts.size(2) == 3) &&
                  parts.is_contiguous() && (parts.scalar_type() == at::kFloat || parts.scalar_type() == at::kDouble),
              "distill: the gathered statistics must be contiguous [ranks, rows, 4 or 3], float32 or float64, got ",
              parts.sizes(), " ", parts.scalar_type());
  TORCH_CHECK(reduction >= RED_NONE && reduction <= RED_BATCHMEAN, "distill: unknown reduction code ", reduction);
  const int64_t width = parts.size(2);
  if (width == 3 && reduction != RED_NONE)
    TORCH_CHECK(scale.has_value() && scale->numel() == 1 && scale->scalar_type() == at::kDouble &&
                    scale->device() == parts.device(),
                "distill: the loss's scale must be one float64 value on the statistics' device");
  return width;
}

// distill_forward's loss_scale and distill_reduction_scale's factor (the same constant): finite.
inline void check_loss_scale(double loss_scale) {
  TORCH_CHECK(std::isfinite(loss_scale), "distill: loss_scale must be finite, got ", loss_scale);
}

// distill_reduction_scale's labels: none, or contiguous int64 [n] on the rows' device; its factor finite.
inline void check_scale_labels(const at::Tensor& rows, const c10::optional<at::Tensor>& labels, int64_t reduction,
                               double factor) {
  check_loss_scale(factor);
  TORCH_CHECK(rows.dim() >= 1, "distill: the rows must have a leading dimension");
  TORCH_CHECK(reduction >= RED_NONE && reduction <= RED_BATCHMEAN, "distill: unknown reduction code ", reduction);
  check_labels(opt(labels), rows.size(0), rows.device(), "rows'");
}

// A scale computed on the device (a reduction's divisor): one float64 value on the logits' device; its address.
inline const double* device_scale(const c10::optional<at::Tensor>& scale, const Rows& r) {
  TORCH_CHECK(scale.has_value() && scale->numel() == 1 && scale->scalar_type() == at::kDouble &&
                  scale->device() == r.s.device(),
              "distill: the scale must be one float64 value on the logits' device");
  return scale->data_ptr<double>();
}

// distill_forward's optional scale: with reduction sum only, and loss_scale 1 (the caller's scale holds it); null
// when not given. loss_scale must be finite.
inline const double* forward_scale(const c10::optional<at::Tensor>& scale, const Rows& r, int64_t reduction,
                                   double loss_scale) {
  check_loss_scale(loss_scale);
  if (!scale.has_value()) return nullptr;
  TORCH_CHECK(reduction == RED_SUM, "distill: a scale goes with reduction sum only");
  TORCH_CHECK(loss_scale == 1.0, "distill: with a scale given, fold loss_scale into it");
  return device_scale(scale, r);
}

// reduction none's losses [n] times loss_scale (in place; as they are for 1).
inline at::Tensor scaled_rows(at::Tensor& rows_loss, double loss_scale) {
  if (loss_scale != 1.0 && rows_loss.numel() > 0) rows_loss.mul_(loss_scale);
  return rows_loss;
}

// An uninitialised [n, v] view of a new buffer whose row i lies as far from the 16-byte grid as row i of rows with
// row stride `stride` whose first row lies `head` entries past the grid: a row stride equal to `stride` modulo a
// chunk (the narrowest one of at least v: at most a chunk's padding a row) and a storage offset of `head` into a
// buffer that starts on the grid (the allocators' blocks do). Contiguous where that is the layout (head 0, v a
// multiple of a chunk's entries modulo it, or one row).
inline at::Tensor rows_laid_out(int64_t n, int64_t v, int64_t stride, int64_t head, const at::TensorOptions& o) {
  const int64_t vec = 16 / static_cast<int64_t>(o.dtype().itemsize());
  const int64_t row = n > 1 ? v + ((stride - v) % vec + vec) % vec : v;
  if (n == 0 || (row == v && head == 0)) return at::empty({n, v}, o);
  const at::Tensor buf = at::empty({head + (n - 1) * row + v}, o);
  return buf.as_strided({n, v}, {row, 1}, head);
}

// A new gradient for the student's rows [n, v], laid out as they are modulo a 16-byte chunk: its row stride the
// student's modulo a chunk (at least v, so never more than a chunk's padding a row), its storage offset the
// student's modulo a chunk (on a buffer that starts on the grid). Contiguous rows get a contiguous gradient; rows
// sliced out of a padded vocabulary (50257 entries of rows of 50304) get one whose rows lie on the 16-byte grid as
// theirs do, so that the fast kernels take student, teacher and gradient rows without a copy. The fake of
// distill_forward (kldiv_inline/distill.py, _grad_like_rows) gives the same strides.
inline at::Tensor grad_like_rows(const Rows& r) {
  const int64_t vec = 16 / static_cast<int64_t>(r.s.element_size());
  return rows_laid_out(r.n, r.v, r.s.stride(0), r.s.storage_offset() % vec, r.s.options());
}

// Output buffer for the student's gradient: a given one (written in place, e.g. over the logits themselves) or
// a new one (like_rows: laid out as the student's rows, grad_like_rows; else contiguous).
inline at::Tensor grad_buffer(const c10::optional<at::Tensor>& given, const Rows& r, bool like_rows = false) {
  if (!given.has_value()) return like_rows ? grad_like_rows(r) : at::empty({r.n, r.v}, r.s.options());
  const at::Tensor& g = *given;
  TORCH_CHECK(g.dim() == 2 && g.size(0) == r.n && g.size(1) == r.v && g.stride(1) == 1 &&
                  g.scalar_type() == r.s.scalar_type() && g.device() == r.s.device(),
              "distill: the gradient buffer must be [rows, vocab] of the logits' dtype and device, unit stride "
              "along the vocabulary");
  return g;
}

// Calls f(mode) with the mode as a std::integral_constant.
template <typename F> void dispatch_mode(int mode, F&& f) {
  switch (mode) {
    case FORWARD_KL:
      f(std::integral_constant<int, FORWARD_KL>{});
      break;
    case REVERSE_KL:
      f(std::integral_constant<int, REVERSE_KL>{});
      break;
    default:
      f(std::integral_constant<int, JSD>{});
      break;
  }
}

// Phases of a vocabulary-parallel call (the caller combines rows' statistics across ranks in between).
enum Phase : int { PHASE_NORMS = 0, PHASE_TERMS = 1, PHASE_GRAD = 2 };

inline void check_scalars(double beta, double temperature, int64_t reduction) {
  TORCH_CHECK(beta >= 0.0 && beta <= 1.0, "distill: beta must lie in [0, 1], got ", beta);
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature),
              "distill: temperature must be positive and "
              "finite, got ",
              temperature);
  TORCH_CHECK(reduction >= RED_NONE && reduction <= RED_BATCHMEAN, "distill: unknown reduction code ", reduction);
}

// The checks of distill_forward's arguments shared by both backends, and the rows they describe.
inline Rows prepare_forward(const at::Tensor& student, const c10::optional<at::Tensor>& teacher,
                            const c10::optional<at::Tensor>& topk_idx, const c10::optional<at::Tensor>& topk_lp,
                            const c10::optional<at::Tensor>& labels, double beta, double temperature, int64_t reduction,
                            bool want_teacher) {
  check_scalars(beta, temperature, reduction);
  Rows r = prepare_rows(student, teacher, topk_idx, topk_lp, labels);
  TORCH_CHECK(!(want_teacher && r.topk()), "distill: no gradient for a top-k teacher");
  return r;
}

// distill_topk_prepare's operands: indices int64 [n, k] and log-probabilities (float32 or float64) [n, k], both
// contiguous, labels contiguous int64 [n] or none, all on one device; flags_out none or a contiguous int32 [3] in
// host memory (pinned for CUDA indices: distill.cu checks that).
inline void check_topk_prepare(const at::Tensor& idx, const at::Tensor& lp, const c10::optional<at::Tensor>& labels,
                               int64_t vocab, const c10::optional<at::Tensor>& flags_out) {
  TORCH_CHECK(!flags_out.has_value() || (flags_out->device().is_cpu() && flags_out->scalar_type() == at::kInt &&
                                         flags_out->numel() == 3 && flags_out->is_contiguous()),
              "distill: the top-k flags' tensor must be a contiguous int32 [3] in host memory");
  TORCH_CHECK(idx.dim() == 2 && idx.is_contiguous() && idx.scalar_type() == at::kLong,
              "distill: top-k indices must be contiguous int64 [rows, k]");
  TORCH_CHECK(lp.sizes() == idx.sizes() && lp.is_contiguous() &&
                  (lp.scalar_type() == at::kFloat || lp.scalar_type() == at::kDouble) && lp.device() == idx.device(),
              "distill: top-k log-probabilities must be contiguous float32/float64 [rows, k] beside the indices");
  TORCH_CHECK(vocab >= 1 && idx.size(1) >= 1 && idx.size(1) <= vocab, "distill: top-k needs 1 <= k <= vocabulary");
  check_labels(opt(labels), idx.size(0), idx.device(), "indices'");
}

// A top-k teacher's split-vocabulary kernels (distill_topk_slice, distill_topk_slice_grad): student rows
// [n, v] (this rank's slice, starting at `offset` of the vocabulary), their global normalisers [n, 4] of the
// accumulation dtype (the student's in columns 0-1), the teacher's global indices int64 [n, k], contiguous, all on
// one device; a positive temperature. Returns the accumulation dtype.
inline at::ScalarType check_topk_slice(const at::Tensor& student, const at::Tensor& norms, const at::Tensor& idx,
                                       int64_t offset, double temperature) {
  TORCH_CHECK(student.dim() == 2 && student.stride(1) == 1 &&
                  (student.scalar_type() == at::kHalf || student.scalar_type() == at::kBFloat16 ||
                   student.scalar_type() == at::kFloat || student.scalar_type() == at::kDouble),
              "distill: the student's rows must be floating-point [rows, vocabulary slice] with unit stride along it");
  const auto acc = acc_type(student.scalar_type());
  TORCH_CHECK(norms.dim() == 2 && norms.size(0) == student.size(0) && norms.size(1) == 4 && norms.is_contiguous() &&
                  norms.scalar_type() == acc && norms.device() == student.device(),
              "distill: the rows' normalisers must be contiguous [rows, 4] of the accumulation dtype beside the rows");
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == student.size(0) && idx.size(1) >= 1 && idx.is_contiguous() &&
                  idx.scalar_type() == at::kLong && idx.device() == student.device(),
              "distill: top-k indices must be contiguous int64 [rows, k >= 1] beside the rows");
  TORCH_CHECK(offset >= 0, "distill: the slice's offset must be >= 0");
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature), "distill: temperature must be positive and finite");
  return acc;
}

// distill_topk_slice_grad's further operands: the buckets' gradients [n, k + has_tail] of the accumulation dtype,
// the gathered sums [n, k + 1] float64, labels (contiguous int64 [n] or none) and the scale (a 0-d float64 or
// none), all beside the rows.
inline void check_topk_slice_grad(const at::Tensor& student, const at::Tensor& idx, const at::Tensor& g_buckets,
                                  const at::Tensor& whole, bool has_tail, const c10::optional<at::Tensor>& labels,
                                  const c10::optional<at::Tensor>& scale, at::ScalarType acc) {
  const int64_t n = student.size(0), k = idx.size(1);
  TORCH_CHECK(g_buckets.dim() == 2 && g_buckets.size(0) == n && g_buckets.size(1) == k + (has_tail ? 1 : 0) &&
                  g_buckets.is_contiguous() && g_buckets.scalar_type() == acc && g_buckets.device() == student.device(),
              "distill: the buckets' gradients must be contiguous [rows, k + 1 with a tail, else k] of the "
              "accumulation dtype beside the rows");
  TORCH_CHECK(whole.dim() == 2 && whole.size(0) == n && whole.size(1) == k + 1 && whole.is_contiguous() &&
                  whole.scalar_type() == at::kDouble && whole.device() == student.device(),
              "distill: the gathered bucket sums must be contiguous float64 [rows, k + 1] beside the rows");
  check_labels(opt(labels), n, student.device(), "logits'");
  TORCH_CHECK(!scale.has_value() ||
                  (scale->numel() == 1 && scale->scalar_type() == at::kDouble && scale->device() == student.device()),
              "distill: the gradient's scale must be one float64 value on the logits' device");
}

// distill_topk_prepare's flags (int32 [3]): an index outside the vocabulary, a repeated index, a row's mass not
// that of a distribution.
enum TopkFlag : int { FLAG_RANGE = 0, FLAG_DUP = 1, FLAG_MASS = 2 };

// The shift that normalises a top-k row whose log-probabilities have logsumexp lse: mass above 1 is divided out
// (k < V), or the whole distribution normalised (k = V, `whole`); a row without mass is left as it is; NaN stays.
// lse in double, whatever the lanes (the row's sum of exponentials formed in double): whether the mass is above 1
// is decided on the values as given. A float32 logsumexp is rounded by ~6e-8, and a row whose k tokens hold all
// but 1e-8 of the mass came out above 1: shifted, its tail set to 0, and reverse KL's loss inf where it is finite.
template <typename A> DS_HD A topk_shift(double lse, bool whole) {
  const double s = whole || !(lse < 0.0) ? lse : 0.0;
  return s == ninf<double>() ? A(0) : static_cast<A>(s);
}

// A top-k teacher's tail mass, 1 - q_sum, from q_sum, the sum of its normalised row's k probabilities in double
// (distill_topk_prepare writes it beside the row): 0 where the row was shifted (mass above 1 divided out, or
// `whole`, k = vocab: the k buckets are the whole distribution), where nothing is left (mass that rounds to 1 or
// more) and for a NaN row, whose loss is NaN anyway. In double because a served teacher's k tokens often hold all
// but 1e-4 to 1e-6 of its mass: the tail is then a small difference of numbers near 1, and float32 exponentials
// summed in float32 left it off by a few percent of itself (reverse KL's loss ~1e-4 off where the tail is 1e-5).
template <typename A> DS_HD A topk_tail(double q_sum, bool whole, A shift) {
  const double t = 1.0 - q_sum;
  return whole || shift != A(0) || !(t > 0.0) ? A(0) : static_cast<A>(t);
}

// Whether an unmasked row's mass is no distribution's: more than 1 (k < V) or away from 1 (k = V) by more than
// the slack (log1p of it given); a NaN row is no offender here (its loss is NaN).
DS_HD bool topk_bad_mass(double lse, bool whole, double slack_log) {
  const double excess = whole ? (lse < 0.0 ? -lse : lse) : lse;
  return excess > slack_log;
}

}  // namespace distill
