// Divergences of logits for distillation on the CPU: the twin of distill.cu, with the same entry points and
// semantics (distill_common.h holds the per-entry arithmetic, distill_plan.h the checks).
//
// One row (token) at a time, rows spread over OpenMP threads; every sum over a row runs in order in double, so
// results do not depend on the thread count. A row is read in three passes (logsumexp, terms, gradient): the
// CPU twin is the reference semantics and the CI path, not a fast path.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "distill_api.h"
#include "distill_common.h"
#include "distill_plan.h"

namespace distill {
namespace {

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

// Below this many rows x vocabulary one thread is faster than waking the OpenMP team.
constexpr int64_t kParallelMin = 1 << 16;

struct Args {
  Rows r;
  int64_t ignore_index;
  double beta, inv_t;
};

// A call's tensors as raw pointers, taken before any OpenMP region: data_ptr() throws for a tensor without
// storage (torch.func's wrappers, say), and an exception thrown inside a parallel region aborts the process.
template <typename T, typename A> struct RowPtrs {
  const T *s = nullptr, *t = nullptr;
  const int64_t *labels = nullptr, *idx = nullptr;
  const A* lp = nullptr;
  T *gs = nullptr, *gt = nullptr;
  int64_t s_stride = 0, t_stride = 0, gs_stride = 0;
};

template <typename T, typename A> RowPtrs<T, A> row_ptrs(const Rows& r, const at::Tensor& gs, const at::Tensor& gt) {
  RowPtrs<T, A> p;
  p.s = r.s.data_ptr<T>();
  p.s_stride = r.s.stride(0);
  if (r.t.defined()) {
    p.t = r.t.data_ptr<T>();
    p.t_stride = r.t.stride(0);
  }
  if (r.labels.defined()) p.labels = r.labels.data_ptr<int64_t>();
  if (r.topk()) {
    p.idx = r.idx.data_ptr<int64_t>();
    p.lp = r.lp.data_ptr<A>();
  }
  if (gs.defined()) {
    p.gs = gs.data_ptr<T>();
    p.gs_stride = gs.stride(0);
  }
  if (gt.defined()) p.gt = gt.data_ptr<T>();
  return p;
}

template <typename T, typename A> inline bool row_masked(const Args& a, const RowPtrs<T, A>& p, int64_t i) {
  return p.labels && p.labels[i] == a.ignore_index;
}

// The normaliser of a row or of a slice of one (distill_common.h's Norm; k2 = log2(e) / T). NaN anywhere gives NaN
// (as PyTorch's log_softmax); a row of -inf has no mass (lz = -inf); a maximum beyond the lanes' range gives a
// stand-in sum (part_sum: a slice of padding; a whole row is made NaN where its entries use it, usable()).
template <typename T, typename A> Norm<A> row_norm(const T* x, int64_t v, A k2) {
  A raw = ninf<A>();
  for (int64_t j = 0; j < v; ++j) {
    const A a = static_cast<A>(x[j]);
    if (a > raw || a != a) raw = a;
    if (raw != raw) return {raw, raw};
  }
  const A mx = scaled_max(raw, k2);
  const A shift = mx == ninf<A>() ? A(0) : mx;  // a +inf maximum turns the sum into NaN below
  double sum = 0.0;
  for (int64_t j = 0; j < v; ++j) sum += static_cast<double>(d_exp2(static_cast<A>(x[j]) * k2 - shift));
  // The log taken of the double sum and rounded once: rounding the sum to float32 first put lz up to 2^-24 / ln 2
  // (8.6e-8) off in log2 units whatever its size, which a peaked row's cancelling gradient turns into a relative
  // error of ~1e-4; rounded once, lz is off by half its own ulp (2e-10 near 0), as a split row's combined one is.
  const double l = offset_ok(shift) || sum != sum ? sum : 1.0;  // part_sum's stand-in, in double
  return {mx, static_cast<A>(d_log2(l))};
}

// An entry's point (the row's `close` chooses make_point's form; the CPU needs no hoisting).
template <typename T, typename A> Point<A> point_at(T xs, T xt, A k2, const RowNorms<A>& rn) {
  return rn.close ? make_point<true>(static_cast<A>(xs), static_cast<A>(xt), k2, rn)
                  : make_point<false>(static_cast<A>(xs), static_cast<A>(xt), k2, rn);
}

// Loss and gradient sums of a row given both log-normalisers.
template <typename T, int MODE, typename A>
Terms<double> row_terms(const T* s, const T* t, int64_t v, A k2, const RowNorms<A>& rn, const RowConst<A>& c) {
  Terms<double> acc{0.0, 0.0, 0.0};
  for (int64_t j = 0; j < v; ++j) {
    Terms<A> e{A(0), A(0), A(0)};
    point_terms<MODE, true, true>(point_at(s[j], t[j], k2, rn), c, e);
    acc.loss += e.loss;
    acc.ks += e.ks;
    acc.kt += e.kt;
  }
  return acc;
}

// Gradients of a row (already scaled by `scale`, i.e. the reduction's divisor and 1/T); either output may be null.
template <typename T, int MODE, typename A>
void row_grad(const T* s, const T* t, int64_t v, A k2, const RowNorms<A>& rn, const RowConst<A>& c, A ks, A kt, A scale,
              T* gs, T* gt) {
  for (int64_t j = 0; j < v; ++j) {
    const Point<A> e = point_at(s[j], t[j], k2, rn);
    if (gs) gs[j] = static_cast<T>(student_grad<MODE>(e, c, ks) * scale);
    if (gt) gt[j] = static_cast<T>(teacher_grad<MODE>(e, c, kt) * scale);
  }
}

// A top-k row: the k tokens and the tail (the rest of the vocabulary) as buckets. lp: the prepared row, k
// log-probabilities then the teacher's tail mass (distill_topk_prepare's). Members are marked in `mark` (scratch
// of v bytes); a duplicate or out-of-range index makes the row's loss NaN (the Python layer rejects them first).
template <typename T, int MODE, typename A>
A row_topk(const T* s, int64_t v, const int64_t* idx, const A* lp, int64_t k, A k2, const RowConst<A>& c, A scale,
           T* gs, std::vector<unsigned char>& mark) {
  const Norm<A> ns = usable(row_norm<T, A>(s, v, k2));
  auto log2_p = [&](int64_t j) { return log2_prob(static_cast<A>(s[j]), k2, ns); };
  mark.assign(v, 0);
  bool bad = false;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t x = idx[j];
    if (x < 0 || x >= v || mark[x]) {
      bad = true;
      break;
    }
    mark[x] = 1;
  }
  const A nan = std::numeric_limits<A>::quiet_NaN();
  if (bad) {
    if (gs) std::fill(gs, gs + v, static_cast<T>(nan));
    return nan;
  }
  double p_tail = 0.0;
  for (int64_t j = 0; j < v; ++j)
    if (!mark[j]) p_tail += static_cast<double>(d_exp2(log2_p(j)));
  const A q_tail = lp[k];
  const Point<A> tail = bucket_point(static_cast<A>(p_tail), d_log(static_cast<A>(p_tail)), q_tail, d_log(q_tail));
  Terms<A> acc{A(0), A(0), A(0)};
  double loss = 0.0, ks = 0.0;
  auto member = [&](int64_t j) {
    const A ls2 = log2_p(idx[j]);
    return bucket_point(d_exp2(ls2), ls2 * A(kLn2), d_exp(lp[j]), lp[j]);
  };
  // k == v: no token is left for a tail (the teacher's 1 - sum exp(logprobs) is then only its rounding).
  const int64_t buckets = k < v ? k + 1 : k;
  for (int64_t j = 0; j < buckets; ++j) {
    acc = Terms<A>{A(0), A(0), A(0)};
    point_terms<MODE, true, true>(j < k ? member(j) : tail, c, acc);
    loss += acc.loss;
    ks += acc.ks;
  }
  if (gs) {
    // Tail entries share their bucket's gradient in proportion to their probability.
    const A tail_coef = tail.ps > A(0) ? student_grad<MODE>(tail, c, static_cast<A>(ks)) / tail.ps : A(0);
    for (int64_t j = 0; j < v; ++j)
      if (!mark[j]) gs[j] = static_cast<T>(d_exp2(log2_p(j)) * tail_coef * scale);
    for (int64_t j = 0; j < k; ++j)
      gs[idx[j]] = static_cast<T>(student_grad<MODE>(member(j), c, static_cast<A>(ks)) * scale);
  }
  return static_cast<A>(loss);
}

// The rows of distill_forward. (OpenMP pragmas cannot sit inside the AT_DISPATCH macros' arguments.)
template <typename T, int MODE>
void forward_rows(const Args& a, double inv_div, at::Tensor& rows_loss, at::Tensor& gs, at::Tensor& gt) {
  using A = typename AccOf<T>::type;
  const Rows& r = a.r;
  const RowConst<A> c = row_const<A>(a.beta);
  const A k2 = static_cast<A>(a.inv_t * kLog2e), scale = static_cast<A>(inv_div * a.inv_t);
  A* out = rows_loss.data_ptr<A>();
  const RowPtrs<T, A> p = row_ptrs<T, A>(r, gs, gt);
#pragma omp parallel if (r.n * r.v >= kParallelMin)
  {
    std::vector<unsigned char> mark;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < r.n; ++i) {
      const T* s = p.s + i * p.s_stride;
      T* gsi = p.gs ? p.gs + i * p.gs_stride : nullptr;
      T* gti = p.gt ? p.gt + i * r.v : nullptr;
      if (row_masked(a, p, i)) {
        out[i] = A(0);
        if (gsi) std::fill(gsi, gsi + r.v, T(0));
        if (gti) std::fill(gti, gti + r.v, T(0));
        continue;
      }
      if (r.topk()) {
        out[i] = row_topk<T, MODE, A>(s, r.v, p.idx + i * r.k, p.lp + i * (r.k + 1), r.k, k2, c, scale, gsi, mark);
        continue;
      }
      const T* t = p.t + i * p.t_stride;
      const RowNorms<A> rn = row_norms(usable(row_norm<T, A>(s, r.v, k2)), usable(row_norm<T, A>(t, r.v, k2)));
      const Terms<double> sums = row_terms<T, MODE, A>(s, t, r.v, k2, rn, c);
      out[i] = static_cast<A>(sums.loss);
      if (gsi || gti)
        row_grad<T, MODE, A>(s, t, r.v, k2, rn, c, static_cast<A>(sums.ks), static_cast<A>(sums.kt), scale, gsi, gti);
    }
  }
}

// The rows of distill_phase: see distill_bindings.cpp. ws/wt: which gradients this phase writes.
template <typename T, int MODE>
void phase_rows(const Args& a, int64_t phase, const at::Tensor& norms, const at::Tensor& ksums, double scale_v,
                at::Tensor& out, at::Tensor& gs, at::Tensor& gt) {
  using A = typename AccOf<T>::type;
  const Rows& r = a.r;
  const RowConst<A> c = row_const<A>(a.beta);
  const A k2 = static_cast<A>(a.inv_t * kLog2e), sc = static_cast<A>(scale_v * a.inv_t);
  const RowPtrs<T, A> p = row_ptrs<T, A>(r, gs, gt);
  A* const n_base = phase == PHASE_NORMS ? out.data_ptr<A>() : nullptr;
  double* const t_base = phase == PHASE_TERMS ? out.data_ptr<double>() : nullptr;  // (see distill_phase)
  const A* const l_base = phase == PHASE_NORMS ? nullptr : norms.data_ptr<A>();
  const A* const k_base = ksums.defined() ? ksums.data_ptr<A>() : nullptr;
#pragma omp parallel for schedule(static) if (r.n * r.v >= kParallelMin)
  for (int64_t i = 0; i < r.n; ++i) {
    const T* s = p.s + i * p.s_stride;
    const T* t = p.t + i * p.t_stride;
    T* gsi = p.gs ? p.gs + i * p.gs_stride : nullptr;
    T* gti = p.gt ? p.gt + i * r.v : nullptr;
    const bool masked = row_masked(a, p, i);
    if (phase == PHASE_NORMS) {
      const Norm<A> ns = masked ? Norm<A>{ninf<A>(), ninf<A>()} : row_norm<T, A>(s, r.v, k2);
      const Norm<A> nt = masked ? Norm<A>{ninf<A>(), ninf<A>()} : row_norm<T, A>(t, r.v, k2);
      A* o = n_base + 4 * i;
      o[0] = ns.mx;
      o[1] = ns.lz;
      o[2] = nt.mx;
      o[3] = nt.lz;
      continue;
    }
    if (masked) {
      if (phase == PHASE_TERMS) std::fill(t_base + 3 * i, t_base + 3 * i + 3, 0.0);
      if (gsi) std::fill(gsi, gsi + r.v, T(0));
      if (gti) std::fill(gti, gti + r.v, T(0));
      continue;
    }
    const A* l = l_base + 4 * i;
    const RowNorms<A> rn = row_norms(Norm<A>{l[0], l[1]}, Norm<A>{l[2], l[3]});
    A ks = A(0), kt = A(0);
    if (phase == PHASE_TERMS) {
      const Terms<double> sums = row_terms<T, MODE, A>(s, t, r.v, k2, rn, c);
      double* o = t_base + 3 * i;
      o[0] = sums.loss;
      o[1] = sums.ks;
      o[2] = sums.kt;
    } else if (k_base) {
      ks = k_base[2 * i];
      kt = k_base[2 * i + 1];
    }
    if (gsi || gti) row_grad<T, MODE, A>(s, t, r.v, k2, rn, c, ks, kt, sc, gsi, gti);
  }
}

template <typename T> void scale_rows(at::Tensor& grad, const double* g, bool per_row) {
  using A = typename AccOf<T>::type;
  T* const base = grad.data_ptr<T>();  // before the parallel region (see RowPtrs)
  const int64_t rows = grad.size(0), cols = grad.size(1), stride = grad.stride(0);
#pragma omp parallel for schedule(static) if (grad.numel() >= kParallelMin)
  for (int64_t i = 0; i < rows; ++i) {
    const A f = static_cast<A>(g[per_row ? i : 0]);
    if (f == A(1)) continue;
    T* row = base + i * stride;
    for (int64_t j = 0; j < cols; ++j) row[j] = static_cast<T>(static_cast<A>(row[j]) * f);
  }
}

void check_device(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "distill (cpu backend): expected CPU tensors, got ", x.device());
}

// The reduction's divisor's reciprocal times factor (distill_forward's loss_scale): for batchmean factor / the rows
// whose label is not ignore_index (all n without labels; 0 when none is), else factor (none: per row, scaled in
// backward by grad_output). One rounding, as distill.cu's inv_count_kernel.
double reduction_inv(const at::Tensor& labels, int64_t n, int64_t ignore_index, int64_t reduction,
                     double factor = 1.0) {
  if (reduction != RED_BATCHMEAN) return factor;
  int64_t count = n;
  if (labels.defined()) {
    const int64_t* lab = labels.data_ptr<int64_t>();
    count = 0;
    for (int64_t i = 0; i < n; ++i) count += lab[i] != ignore_index;
  }
  return count > 0 ? factor / static_cast<double>(count) : 0.0;
}

}  // namespace
}  // namespace distill

using namespace distill;

const char* distill_backend() { return "cpu"; }

std::vector<at::Tensor> distill_forward(const at::Tensor& student, const c10::optional<at::Tensor>& teacher,
                                        const c10::optional<at::Tensor>& topk_idx,
                                        const c10::optional<at::Tensor>& topk_lp,
                                        const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                        double temperature, int64_t reduction, bool want_student, bool want_teacher,
                                        const c10::optional<at::Tensor>& grad_student_out,
                                        const c10::optional<at::Tensor>& scale, double loss_scale) {
  check_device(student);
  Args a{prepare_forward(student, teacher, topk_idx, topk_lp, labels, beta, temperature, reduction, want_teacher),
         ignore_index, beta, 1.0 / temperature};
  const Rows& r = a.r;
  const double* scale_given = forward_scale(scale, r, reduction, loss_scale);
  const auto acc = acc_type(r.s.scalar_type());
  at::Tensor rows_loss = at::empty({r.n}, r.s.options().dtype(acc));
  at::Tensor gs = want_student ? grad_buffer(grad_student_out, r, true) : at::Tensor();
  at::Tensor gt = want_teacher ? at::empty({r.n, r.v}, r.s.options()) : at::Tensor();
  // The gradients are those of the reduced loss.
  const double inv_div = scale_given ? *scale_given : reduction_inv(r.labels, r.n, ignore_index, reduction, loss_scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.s.scalar_type(), "distill_forward", [&] {
    dispatch_mode(mode_of(beta),
                  [&](auto mode_c) { forward_rows<scalar_t, decltype(mode_c)::value>(a, inv_div, rows_loss, gs, gt); });
  });
  if (reduction == RED_NONE) return {scaled_rows(rows_loss, loss_scale), gs, gt};
  double total = 0.0;
  AT_DISPATCH_FLOATING_TYPES(acc, "distill_total", [&] {
    const scalar_t* l = rows_loss.data_ptr<scalar_t>();
    for (int64_t i = 0; i < r.n; ++i) total += static_cast<double>(l[i]);
  });
  at::Tensor loss = at::empty({}, r.s.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES(acc, "distill_loss",
                             [&] { *loss.data_ptr<scalar_t>() = static_cast<scalar_t>(total * inv_div); });
  return {loss, gs, gt};
}

std::vector<at::Tensor> distill_phase(int64_t phase, const at::Tensor& student, const at::Tensor& teacher,
                                      const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                      double temperature, const c10::optional<at::Tensor>& norms,
                                      const c10::optional<at::Tensor>& ksums, const c10::optional<at::Tensor>& scale,
                                      bool want_student, bool want_teacher,
                                      const c10::optional<at::Tensor>& grad_student_out) {
  check_device(student);
  check_scalars(beta, temperature, RED_SUM);
  Args a{prepare_rows(student, teacher, c10::nullopt, c10::nullopt, labels), ignore_index, beta, 1.0 / temperature};
  const Rows& r = a.r;
  const auto acc = acc_type(r.s.scalar_type());
  const int mode = mode_of(beta);
  TORCH_CHECK(phase >= PHASE_NORMS && phase <= PHASE_GRAD, "distill: unknown phase ", phase);
  if (phase != PHASE_NORMS) check_row_stats(opt(norms), r, 4, "the rows' normalisers");
  // The rows' K sums: distill_combine's of phase 1's float64 terms, rounded once here to the accumulation dtype.
  at::Tensor k_acc;
  if (phase == PHASE_GRAD && ((want_student && mode != FORWARD_KL) || (want_teacher && mode != REVERSE_KL))) {
    check_row_stats(opt(ksums), r, 2, "the rows' K sums", /*float64_ok=*/true);
    k_acc = ksums->to(acc);
  }
  const bool grads = phase != PHASE_NORMS && (want_student || want_teacher);
  if (grads)
    TORCH_CHECK(scale.has_value() && scale->numel() == 1 && scale->scalar_type() == at::kDouble,
                "distill: the gradient scale must be one float64 value");
  const double scale_v = grads ? scale->item<double>() : 0.0;
  // PHASE_TERMS writes the gradients that need no row sums (student's in forward KL, teacher's in reverse KL);
  // PHASE_GRAD writes the others.
  auto needs_k = [&](bool teacher_side) { return teacher_side ? mode != REVERSE_KL : mode != FORWARD_KL; };
  const bool ws = want_student && (phase == PHASE_TERMS ? !needs_k(false) : phase == PHASE_GRAD && needs_k(false));
  const bool wt = want_teacher && (phase == PHASE_TERMS ? !needs_k(true) : phase == PHASE_GRAD && needs_k(true));
  at::Tensor out = phase == PHASE_NORMS   ? at::empty({r.n, 4}, r.s.options().dtype(acc))
                   : phase == PHASE_TERMS ? at::empty({r.n, 3}, r.s.options().dtype(at::kDouble))
                                          : at::Tensor();
  at::Tensor gs = ws ? grad_buffer(grad_student_out, r) : at::Tensor();
  at::Tensor gt = wt ? at::empty({r.n, r.v}, r.s.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.s.scalar_type(), "distill_phase", [&] {
    dispatch_mode(mode, [&](auto mode_c) {
      phase_rows<scalar_t, decltype(mode_c)::value>(a, phase, opt(norms), k_acc, scale_v, out, gs, gt);
    });
  });
  return {out, gs, gt};
}

std::vector<at::Tensor> distill_combine(const at::Tensor& parts, int64_t reduction,
                                        const c10::optional<at::Tensor>& scale) {
  check_device(parts);
  const int64_t width = check_combine(parts, reduction, scale);
  const int64_t world = parts.size(0), n = parts.size(1);
  std::vector<at::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(parts.scalar_type(), "distill_combine", [&] {
    using A = scalar_t;
    const A* p = parts.data_ptr<A>();
    if (width == 4) {
      at::Tensor norms = at::empty({n, 4}, parts.options());
      A* o = norms.data_ptr<A>();
      for (int64_t i = 0; i < n; ++i) combine_row_norms(p, i, n, world, o);
      result = {norms};
      return;
    }
    at::Tensor rows_loss = at::empty({n}, parts.options()), ksums = at::empty({n, 2}, parts.options());
    A* l = rows_loss.data_ptr<A>();
    A* k = ksums.data_ptr<A>();
    double total = 0.0;  // in row order, in double, as distill_forward's
    for (int64_t i = 0; i < n; ++i) {
      combine_terms(p + 3 * i, 3 * n, world, l[i], k[2 * i], k[2 * i + 1]);
      total += static_cast<double>(l[i]);
    }
    if (reduction == RED_NONE) {
      result = {ksums, rows_loss};
      return;
    }
    at::Tensor loss = at::empty({}, parts.options());
    *loss.data_ptr<A>() = static_cast<A>(total * scale->item<double>());
    result = {ksums, loss};
  });
  return result;
}

// Peer memory is GPU memory that other processes map: nothing of it on the CPU (vocab_parallel.py's CPU ranks
// exchange the normalisers by all-gather).
std::vector<at::Tensor> distill_peer_alloc(int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "distill (cpu backend): peer buffers are CUDA memory; CPU ranks exchange by all-gather");
}

int64_t distill_peer_map(const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "distill (cpu backend): peer buffers are CUDA memory; CPU ranks exchange by all-gather");
}

std::vector<at::Tensor> distill_peer_terms(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                           int64_t, double, double, int64_t, const at::Tensor&, bool, bool,
                                           const c10::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                                           int64_t, int64_t) {
  TORCH_CHECK(false, "distill (cpu backend): peer buffers are CUDA memory; CPU ranks exchange by all-gather");
}

at::Tensor distill_reduction_scale(const at::Tensor& rows, const c10::optional<at::Tensor>& labels,
                                   int64_t ignore_index, int64_t reduction, double factor) {
  check_device(rows);
  check_scale_labels(rows, labels, reduction, factor);
  return at::full({}, reduction_inv(opt(labels), rows.size(0), ignore_index, reduction, factor),
                  rows.options().dtype(at::kDouble));
}

std::vector<at::Tensor> distill_topk_prepare(const at::Tensor& idx, const at::Tensor& lp, int64_t vocab,
                                             const c10::optional<at::Tensor>& labels, int64_t ignore_index,
                                             double slack_log, const c10::optional<at::Tensor>& flags_out) {
  check_device(idx);
  check_topk_prepare(idx, lp, labels, vocab, flags_out);
  const int64_t n = idx.size(0), k = idx.size(1);
  const bool whole = k == vocab;
  at::Tensor out = at::empty({n, k + 1}, lp.options());
  at::Tensor flags = flags_out.has_value() ? flags_out->zero_() : at::zeros({3}, idx.options().dtype(at::kInt));
  int* f = flags.data_ptr<int>();
  const int64_t* ix = idx.data_ptr<int64_t>();
  const int64_t* lab = labels.has_value() ? labels->data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(lp.scalar_type(), "distill_topk_prepare", [&] {
    using A = scalar_t;
    const A* l = lp.data_ptr<A>();
    A* o = out.data_ptr<A>();
    std::vector<int64_t> sorted(static_cast<size_t>(k));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t* xi = ix + i * k;
      const A* li = l + i * k;
      bool nan = false;
      A m = ninf<A>();
      for (int64_t j = 0; j < k; ++j) {
        nan = nan || li[j] != li[j];
        m = li[j] > m ? li[j] : m;
        if (xi[j] < 0 || xi[j] >= vocab) f[FLAG_RANGE] = 1;
      }
      double lse = m;  // in double (topk_shift); -inf (no mass) and +inf stay as they are
      if (nan) {
        lse = std::numeric_limits<double>::quiet_NaN();
      } else if (std::isfinite(m)) {
        double sum = 0.0;
        for (int64_t j = 0; j < k; ++j) sum += std::exp(static_cast<double>(li[j]) - static_cast<double>(m));
        lse = m + std::log(sum);
      }
      const A shift = topk_shift<A>(lse, whole);
      A* oi = o + i * (k + 1);
      double q = 0.0;  // the normalised row's mass, in double
      for (int64_t j = 0; j < k; ++j) {
        oi[j] = li[j] - shift;
        q += std::exp(static_cast<double>(oi[j]));
      }
      oi[k] = topk_tail<A>(q, whole, shift);
      std::copy(xi, xi + k, sorted.begin());  // repeated indices
      std::sort(sorted.begin(), sorted.end());
      if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) f[FLAG_DUP] = 1;
      if (!(lab && lab[i] == ignore_index) && topk_bad_mass(lse, whole, slack_log)) f[FLAG_MASS] = 1;
    }
  });
  return {out, flags};
}

namespace distill {
namespace {

// distill_topk_slice's rows (see distill_api.h): members' log2 probabilities, the other entries' mass in double.
template <typename T>
void topk_slice_rows(const at::Tensor& student, const at::Tensor& norms, const at::Tensor& idx, int64_t offset,
                     double temperature, at::Tensor& part) {
  using A = typename AccOf<T>::type;
  const int64_t n = student.size(0), v = student.size(1), k = idx.size(1), stride = student.stride(0);
  const T* const s_base = student.data_ptr<T>();  // before the parallel region (see RowPtrs)
  const A* const nr_base = norms.data_ptr<A>();
  const int64_t* const idx_base = idx.data_ptr<int64_t>();
  double* const out = part.data_ptr<double>();
  const A k2 = static_cast<A>(kLog2e / temperature);
#pragma omp parallel for schedule(static) if (n * v >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const T* x = s_base + i * stride;
    const Norm<A> nm{nr_base[4 * i], nr_base[4 * i + 1]};  // combined: already usable()
    std::vector<char> member(static_cast<size_t>(v), 0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = idx_base[i * k + j] - offset;
      const bool here = e >= 0 && e < v;
      if (here) member[static_cast<size_t>(e)] = 1;
      out[i * (k + 1) + j] = here ? static_cast<double>(log2_prob(static_cast<A>(x[e]), k2, nm)) : 0.0;
    }
    double tail = 0.0;  // in order, in double
    for (int64_t e = 0; e < v; ++e)
      if (!member[static_cast<size_t>(e)]) tail += static_cast<double>(d_exp2(log2_prob(static_cast<A>(x[e]), k2, nm)));
    out[i * (k + 1) + k] = tail;
  }
}

// distill_topk_slice_grad's rows: the other entries' share of the tail's gradient, then the members' buckets'.
template <typename T>
void topk_slice_grad_rows(const at::Tensor& student, const at::Tensor& norms, const at::Tensor& idx, int64_t offset,
                          double temperature, const at::Tensor& g_buckets, const at::Tensor& whole, bool has_tail,
                          const int64_t* lab, int64_t ignore_index, double scale, at::Tensor& grad) {
  using A = typename AccOf<T>::type;
  const int64_t n = student.size(0), v = student.size(1), k = idx.size(1), stride = student.stride(0);
  const int64_t gw = g_buckets.size(1);
  const T* const s_base = student.data_ptr<T>();  // before the parallel region (see RowPtrs)
  T* const g_base = grad.data_ptr<T>();
  const A* const nr_base = norms.data_ptr<A>();
  const int64_t* const idx_base = idx.data_ptr<int64_t>();
  const A* const gb = g_buckets.data_ptr<A>();
  const double* const wh = whole.data_ptr<double>();
  const A sc = static_cast<A>(scale);
  const A k2 = static_cast<A>(kLog2e / temperature);
#pragma omp parallel for schedule(static) if (n * v >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const T* x = s_base + i * stride;
    T* g = g_base + i * v;
    if (lab && lab[i] == ignore_index) {
      std::fill(g, g + v, static_cast<T>(0));
      continue;
    }
    const Norm<A> nm{nr_base[4 * i], nr_base[4 * i + 1]};  // combined: already usable()
    const double p_tail = wh[i * (k + 1) + k];
    // An entry's share of the tail's gradient: p_v g_tail / p_tail (the ratio in double).
    const A coef = has_tail && p_tail > 0.0 ? static_cast<A>(static_cast<double>(gb[i * gw + k]) / p_tail) : A(0);
    for (int64_t e = 0; e < v; ++e) g[e] = static_cast<T>(d_exp2(log2_prob(static_cast<A>(x[e]), k2, nm)) * coef * sc);
    for (int64_t j = 0; j < k; ++j) {  // the members: their buckets' gradients
      const int64_t e = idx_base[i * k + j] - offset;
      if (e >= 0 && e < v) g[e] = static_cast<T>(gb[i * gw + j] * sc);
    }
  }
}

}  // namespace
}  // namespace distill

at::Tensor distill_topk_slice(const at::Tensor& student, const at::Tensor& norms, const at::Tensor& idx, int64_t offset,
                              double temperature) {
  check_device(student);
  check_topk_slice(student, norms, idx, offset, temperature);
  at::Tensor part = at::empty({student.size(0), idx.size(1) + 1}, student.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, student.scalar_type(), "distill_topk_slice",
                                  [&] { topk_slice_rows<scalar_t>(student, norms, idx, offset, temperature, part); });
  return part;
}

at::Tensor distill_topk_slice_grad(const at::Tensor& student, const at::Tensor& norms, const at::Tensor& idx,
                                   int64_t offset, double temperature, const at::Tensor& g_buckets,
                                   const at::Tensor& whole, bool has_tail, const c10::optional<at::Tensor>& labels,
                                   int64_t ignore_index, const c10::optional<at::Tensor>& scale) {
  check_device(student);
  const auto acc = check_topk_slice(student, norms, idx, offset, temperature);
  check_topk_slice_grad(student, idx, g_buckets, whole, has_tail, labels, scale, acc);
  at::Tensor grad = at::empty({student.size(0), student.size(1)}, student.options());
  const int64_t* lab = labels.has_value() ? labels->data_ptr<int64_t>() : nullptr;
  const double sc = scale.has_value() ? scale->item<double>() : 1.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, student.scalar_type(), "distill_topk_slice_grad", [&] {
    topk_slice_grad_rows<scalar_t>(student, norms, idx, offset, temperature, g_buckets, whole, has_tail, lab,
                                   ignore_index, sc, grad);
  });
  return grad;
}

bool distill_in_place_ok(int64_t, int64_t, bool) { return true; }  // each entry is read before it is written

void distill_scale_grad_(at::Tensor grad, const at::Tensor& grad_out) {
  TORCH_CHECK(grad.device().is_cpu() && grad.dim() == 2 && grad.stride(1) == 1,
              "distill: scale_grad_ needs a [rows, vocab] CPU tensor with unit stride along the vocabulary");
  TORCH_CHECK(grad_out.device() == grad.device() && (grad_out.numel() == 1 || grad_out.numel() == grad.size(0)),
              "distill: grad_output must hold one value or one per row");
  const at::Tensor go = grad_out.to(at::kDouble).contiguous();
  const double* g = go.data_ptr<double>();
  const bool per_row = go.numel() != 1 || grad.size(0) == 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "distill_scale_grad",
                                  [&] { scale_rows<scalar_t>(grad, g, per_row); });
}
