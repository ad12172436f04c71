"""One harness for any op: check it against float64, time it against its peers and the floor, plot it.

    from kldiv_inline import harness
    cases = [harness.Case(f"n={n}", (torch.rand(n, device=dev),)) for n in (1 << 16, 1 << 22)]
    checked = harness.check({"mine": mod.scale2}, reference=lambda x: 2 * x, cases=cases)
    timed = harness.bench({"mine": mod.scale2, "torch": lambda x: 2 * x}, cases=cases,
                          bytes_moved=lambda x: 2 * x.numel() * x.element_size())
    fig = harness.plot(timed)

A provider is any callable taking a case's ``args``; it returns a tensor or a tuple/list/dict of them. ``check``
runs the reference on the same inputs upcast to float64 (floating tensors only, recursively in tuples, lists and
dicts; integer tensors, indices perhaps, reach it as they are) and compares each provider's outputs with it, output
by output (dicts key by key): the relative error ||out - ref|| / ||ref|| against a tolerance for the output's dtype
(``TOLERANCE``, overridable; exact where the reference's output is integer or boolean, complex ones compared whole),
NaN or inf only where the reference has them, shapes equal. A norm lets a few wrong elements of a long output
through (three of a million, each off by its own size, are 2e-3 relative: within bfloat16's tolerance);
``per_element=True`` also holds every element to the tolerance times the output's largest reference value, which
catches them (a vectorised loop's mishandled tail, say). Each call runs ``poisoned``: new tensors start as NaN, so
an element the kernel fails to write shows up (boolean and integer outputs, where the poison is a legal value, are
computed a second time over memory that held zeros). Every provider and the reference get their own copies of the
case's tensors, so one that writes into its inputs (or accumulates gradients in them) changes no one else's; tensors
that share memory share their copy. A copy keeps its tensor's strides and storage offset, and so the alignment of its
data (far into a large buffer, modulo 512 bytes).

``bench`` refuses to time a provider that failed its check: it checks every provider first, against ``reference=``
or else the reference the cases were last checked with (``check`` records it on each case, with its tolerance and
per_element, which that check is held to again), unless ``checked=`` hands it the result of a check (of these very
callables and the kinds of the cases' inputs: ``check`` records them on each row, ``check_id``) or
``reference=None`` says to time unchecked. A time below ``BELOW_FLOOR`` x the floor is warned about (on the CPU,
whose small inputs stay in its caches, most often for that). Timing follows ``kldiv_inline.timing`` (CUDA events, L2
flush, input rotation, median and 20/80% quantiles; a wall clock on the CPU, its inputs rotated through its
last-level cache); the floor is the bytes moved over the read bandwidth of ``kldiv_inline.floors``.

The kit's own suites (``kldiv_inline.bench``) go through the same functions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import math
import numbers
import types
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import floors, loader, timing
from .reference import error_dtype, relative_error

# Relative error allowed per output dtype: a few units of the dtype's rounding, for arrays of values.
# Integer and boolean outputs must be exact.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3,
             torch.complex128: 1e-12, torch.complex64: 1e-5}  # (complex: its parts' float dtype's)

CHECK_COLUMNS = ["provider", "case", "device", "max_abs_err", "rel_err", "tol", "ok", "error", "check_id"]
BENCH_COLUMNS = ["provider", "case", "device", "timer", "status", "median_ms", "q20_ms", "q80_ms", "bytes",
                 "gbps", "floor_gbps", "floor_source", "floor_ms", "x_floor", "pct_of_peak", "rel_err"]

# Below this x_floor a timing is warned about (noise allows a little under 1: the floor is itself measured).
BELOW_FLOOR = 0.9
WALL_INNER_CUDA = 50  # back-to-back calls per wall-clock sample on a GPU: the host's cost per call shows
TIMERS = ("auto", "cuda", "wall")

# A case's meta becomes columns of its rows: a meta key named like a result column would overwrite it.
RESERVED_META = frozenset(CHECK_COLUMNS + BENCH_COLUMNS + ["peak_mib"])



@dataclasses.dataclass
class Case:
    """One set of inputs. ``args`` are passed to every provider (each gets its own copies of the tensors);
    ``meta`` becomes extra columns of each row (e.g. ``{"pass": "fwd", "dtype": "float32"}``; not named like
    a result column: ``RESERVED_META``). ``reference`` is set by ``check`` (or given here): the float64 truth
    ``bench`` checks providers against; ``check`` records its ``tolerance`` and ``per_element`` beside it, which
    ``bench`` checks with too unless it is given its own."""

    name: str
    args: tuple
    meta: dict = dataclasses.field(default_factory=dict)
    reference: Callable | None = dataclasses.field(default=None, repr=False, compare=False)
    checked_with: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.args, list):
            self.args = tuple(self.args)
        elif not isinstance(self.args, tuple):
            self.args = (self.args,)  # a single input
        _check_meta(self)


def _check_meta(case: Case) -> None:
    clash = sorted(set(case.meta) & RESERVED_META)
    if clash:
        raise ValueError(f"case {case.name!r}: meta keys {clash} are result columns (they would overwrite them); "
                         "rename them")


# --------------------------------------------------------------------------------------------- helpers
def poison_allocator(device: str, nbytes: int = 64 << 20) -> None:
    """Fill free memory of the CUDA caching allocator with NaN, so that unwritten outputs read NaN."""
    if device == "cuda":
        torch.empty(nbytes // 4, device=device).fill_(float("nan"))  # freed at once, the block stays cached


@contextlib.contextmanager
def poisoned(device: str):
    """Inside, memory a kernel fails to write reads NaN (integers: their maximum): tensors from
    ``torch.empty``/``at::empty`` are filled by PyTorch's deterministic mode (``fill_uninitialized_memory``;
    nondeterministic ops only warn, and the warning is silenced), and on a GPU the caching allocator's free
    memory is filled first, for buffers taken from it some other way."""
    poison_allocator(device)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(deterministic|CUBLAS_WORKSPACE_CONFIG)")
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        items = [_map_tensors(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # (a namedtuple: its fields)
    if isinstance(obj, Mapping):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _leaf(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A detached copy (in ``dtype``) with ``t``'s sizes, strides and storage offset, a leaf that requires grad if
    ``t`` did. The strides are kept even where clone() would not (a slice with gaps, an expanded view with stride
    0): a kernel checked or timed on a strided input must see that input, not a contiguous copy of it. The offset
    too (_offset), and with it the data's alignment: a copy at the start of its own storage let a kernel that
    reads from the storage's start, or one whose vector loads need an alignment the input lacks, pass (and be
    timed on aligned data)."""
    grad, t = t.requires_grad, t.detach()
    if t.layout != torch.strided:  # sparse and other layouts: strides do not apply
        return (t.to(dtype, copy=True) if dtype is not None else t.clone()).requires_grad_(grad)
    if t.numel() == 0:
        return (t.to(dtype, copy=True) if dtype is not None else
                t.clone(memory_format=torch.contiguous_format)).requires_grad_(grad)
    span = _span(t)
    if type(t) not in (torch.Tensor, torch.nn.Parameter):  # (a wrapper subclass: its own clone, at offset 0)
        flat = t.as_strided((span,), (1,), t.storage_offset())
        flat = flat.to(dtype, copy=True) if dtype is not None else flat.clone()
        return flat.as_strided(t.shape, t.stride()).requires_grad_(grad)
    # The memory as stored, copied into a storage of its own after the offset (copy_ converts the dtype), then
    # viewed alike, with t's conjugate and negative bits again: copied resolved, a kernel that reads the memory
    # of x.conj() or x.conj().imag (a negative view) as if it held their values passed on a case built to test it
    flat = _as_stored(t).as_strided((span,), (1,), t.storage_offset())  # the span of storage the view reaches
    offset = _offset(t.storage_offset(), (dtype or t.dtype).itemsize)
    storage = torch.empty(offset + span, dtype=dtype or t.dtype, device=t.device)
    # (what lies before the data reads NaN: a kernel that reads from the storage's start gets no plausible values)
    storage[:offset].fill_(math.nan if storage.is_floating_point() or storage.is_complex() else 0)
    storage[offset:].copy_(flat)
    return _with_bits(storage.as_strided(t.shape, t.stride(), offset), t).requires_grad_(grad)


def _span(t: torch.Tensor) -> int:
    """The elements of storage a strided view with elements reaches, from its first (its storage offset) on."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def _with_bits(view: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``view`` (of memory as stored) with ``like``'s negative and conjugate bits (views, no copy)."""
    view = torch._neg_view(view) if like.is_neg() else view
    return view.conj() if like.is_conj() else view


_ALIGN_BYTES = 512  # the CUDA caching allocator's block size, a multiple of any vector load (the CPU's: 64)


def _offset(offset: int, element_size: int) -> int:
    """The storage offset (in elements) of a copy of a view at ``offset``: the same where it is small, else one
    that keeps it not 0 and its address modulo _ALIGN_BYTES (views far into a large buffer copy only what they
    reach, not the buffer before them)."""
    unit = max(1, _ALIGN_BYTES // element_size)
    return offset if offset < 2 * unit else unit + offset % unit


def _overlap_clusters(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, list[int]]]:
    """Groups of two or more tensors whose spans of one storage overlap (same device and dtype; plain strided
    tensors with memory; one tensor given twice too): (the span's first element, its end, the tensors' positions
    in ``tensors``), as _copies copies them together."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        # (plain tensors: a wrapper subclass has no storage of its own to share)
        if (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and t.numel() > 0
                and t.device.type != "meta" and t.untyped_storage().data_ptr() != 0):
            key = (t.device, t.untyped_storage().data_ptr(), t.dtype)
            groups.setdefault(key, []).append(i)
    out = []
    for members in groups.values():
        # Tensors whose spans of the storage overlap, copied together (a span of its own each: views of one large
        # buffer far apart copy only what they reach)
        spans = sorted((tensors[i].storage_offset(), tensors[i].storage_offset() + _span(tensors[i]), i)
                       for i in members)
        clusters: list[list] = []
        for lo, hi, i in spans:
            if clusters and lo < clusters[-1][1]:
                clusters[-1][1] = max(clusters[-1][1], hi)
                clusters[-1][2].append(i)
            else:
                clusters.append([lo, hi, [i]])
        out += [(lo, hi, positions) for lo, hi, positions in clusters if len(positions) > 1]
    return out


def _sharing(tensors: Sequence[torch.Tensor]) -> dict[int, int]:
    """For each tensor (by position) whose copy shares memory with an earlier one's, that earlier one's position."""
    out = {}
    for _, _, positions in _overlap_clusters(tensors):
        first = min(positions)
        out.update({i: first for i in positions if i != first})
    return out


def _copies(obj: Any, dtype_of: Callable[[torch.Tensor], torch.dtype | None]) -> Any:
    """``obj`` with each tensor copied (_leaf, in ``dtype_of(t)``), tensors that share memory copied together so
    that they share the copy alike: a case built to pass one tensor twice, or overlapping views of one buffer
    (a kernel that must work in place, or whose inputs alias), reaches the provider so, not as separate copies;
    a tensor and its conjugate or negative view (``x`` and ``x.conj()``) too: the memory is copied as it is, and
    each view takes its own bits again. (Tensors of one storage but different dtypes, or other layouts, are copied
    apart.)"""
    shared: dict[int, torch.Tensor] = {}
    tensors = _tensors(obj)
    for lo, hi, positions in _overlap_clusters(tensors):
        members = [tensors[i] for i in positions]
        flat = _leaf(_as_stored(members[0].detach()).as_strided((hi - lo,), (1,), lo), dtype_of(members[0]))
        for t in members:  # (flat keeps lo's offset, _leaf: each view keeps its own alike)
            view = _with_bits(flat.as_strided(t.shape, t.stride(), flat.storage_offset() + t.storage_offset()
                                              - lo), t)
            shared[id(t)] = view.requires_grad_(t.requires_grad) if t.requires_grad else view
    return _map_tensors(obj, lambda t: shared[id(t)] if id(t) in shared else _leaf(t, dtype_of(t)))


def _as_stored(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` that reads its memory as stored: its conjugate and negative bits cleared (a view, no copy)."""
    t = t.conj() if t.is_conj() else t
    return torch._neg_view(t) if t.is_neg() else t


def upcast(obj: Any) -> Any:
    """``obj`` with every floating tensor as a float64 leaf (complex ones complex128; requiring grad where the
    original did) and every other tensor a copy as it is (integers may be indices): the reference cannot change
    the case's inputs. Tensors sharing memory share their copy (_copies)."""
    return _copies(obj, lambda t: torch.float64 if t.is_floating_point() else
                   torch.complex128 if t.is_complex() else None)


def clone_args(obj: Any) -> Any:
    """Fresh copies of every tensor in ``obj`` (leaves, requiring grad where the originals did; tensors sharing
    memory share their copy: _copies)."""
    return _copies(obj, lambda t: None)


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(obj, lambda t: found.append(t) or t)
    return found


def _case_device(args: tuple) -> torch.device:
    """The device of a case: its first tensor's (the CPU where it has none)."""
    tensors = _tensors(args)
    return tensors[0].device if tensors else torch.device("cpu")


def _on_device(device: torch.device):
    """A case's GPU (_case_device) made the current one, where the events, the L2 flush, the poisoned allocator
    and the floor act (a case on cuda:1 was timed by events on cuda:0's stream); on the CPU, nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _outputs(out: Any, who: str = "a provider") -> list:
    """A result as a flat list of tensors (None stays None; numbers become 0-d tensors). A Python float from the
    reference becomes float64 (it is a double; float32 would round the truth); a provider's, float32 (what it
    computed in is unknown: held to float32's tolerance, as a kernel's float would be)."""
    if out is None or isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, float):  # (numpy's float64 too, a float: it was held to float64's tolerance)
        return [torch.tensor(float(out), dtype=torch.float64 if who == "the reference" else torch.float32)]
    if isinstance(out, (int, bool)):
        return [torch.tensor(out)]
    if isinstance(out, (tuple, list)):
        return [o for item in out for o in _outputs(item, who)]
    if isinstance(out, Mapping):
        return [o for k in sorted(out) for o in _outputs(out[k], who)]
    raise TypeError(f"{who} returned {type(out).__name__}; expected tensors (or tuples/lists/dicts of them)")


def _keys(d: Mapping) -> str:
    return "{" + ", ".join(sorted(map(repr, d))) + "}"


def _key_mismatch(out: Any, ref: Any, where: str = "the output") -> str:
    """Where a provider's dicts and the reference's differ in their keys, else "": dict outputs are compared
    key by key (flattened in sorted key order), so the key sets must agree, at every depth."""
    if isinstance(out, Mapping) != isinstance(ref, Mapping):
        return f"{where} is {'a dict' if isinstance(out, Mapping) else 'no dict'}, unlike the reference's"
    if isinstance(out, Mapping):
        if set(out) != set(ref):
            return f"{where} has dict keys {_keys(out)}, the reference {_keys(ref)}"
        pairs = [(out[k], ref[k], f"{where}[{k!r}]") for k in ref]
    elif isinstance(out, (tuple, list)) and isinstance(ref, (tuple, list)) and len(out) == len(ref):
        pairs = [(o, r, f"{where}[{i}]") for i, (o, r) in enumerate(zip(out, ref))]
    else:
        return ""  # tensors, numbers, or sequences the output count tells apart
    return next((m for m in (_key_mismatch(*p) for p in pairs) if m), "")


def tolerance_for(dtype: torch.dtype, tolerance: float | Mapping | None = None) -> float:
    """The relative error allowed for an output of ``dtype``: ``tolerance`` if a number, else from the table
    ``TOLERANCE`` updated by ``tolerance`` (a dtype -> number mapping); 0 for integer and boolean outputs
    unless such a mapping names their dtype. One number is for the floating outputs only: passed to widen a
    bfloat16 output's tolerance, it must not let an integer output (argmax indices beside the values) be off."""
    tolerance = _tolerance_arg(tolerance)
    if not (dtype.is_floating_point or dtype.is_complex):
        return float(tolerance[dtype]) if isinstance(tolerance, Mapping) and dtype in tolerance else 0.0
    if isinstance(tolerance, float):
        return tolerance
    table = {**TOLERANCE, **(tolerance or {})}
    if dtype in table:
        return table[dtype]
    raise ValueError(f"no tolerance for {dtype} outputs: pass tolerance= (a number or {{dtype: number}})")


def _tolerance_arg(tolerance: Any) -> float | Mapping | None:
    """``tolerance=`` as tolerance_for takes it: None, one number as a float (a numpy scalar, a 0-d tensor
    too), or a {dtype: number} mapping; anything else a clear error, not a failed check of every provider."""
    if tolerance is None:
        return None
    if isinstance(tolerance, Mapping):
        for dtype in tolerance:
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"tolerance's keys must be torch dtypes, got {dtype!r}")
        return {dtype: _tolerance_arg(value) for dtype, value in tolerance.items()}
    if isinstance(tolerance, torch.Tensor) and tolerance.numel() == 1 and not tolerance.is_complex():
        tolerance = tolerance.item()
    if isinstance(tolerance, numbers.Real) and not isinstance(tolerance, bool):
        value = float(tolerance)
        if not value >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
        return value
    raise TypeError(f"tolerance must be a number or a {{dtype: number}} mapping, got {type(tolerance).__name__}")


_REL_ERR = "relative error"  # compare's words for a failure in the numbers alone (bench's status tells the rest)


def compare(out: Any, ref: Any, tolerance: float | Mapping | None = None, per_element: bool = False) -> dict:
    """A provider's outputs against the reference's: max_abs_err, rel_err and tol (of the output furthest
    from its tolerance), ok, and error (why it failed beyond the numbers, else ""). ``per_element``: each
    floating output's largest error must also lie within tol times its largest finite |reference| value."""
    outs, refs = _outputs(out), _outputs(ref, "the reference")
    mismatch = _key_mismatch(out, ref)
    if not mismatch and len(outs) != len(refs):
        mismatch = f"{len(outs)} outputs, the reference has {len(refs)}"
    if mismatch:
        return {"max_abs_err": math.inf, "rel_err": math.inf, "tol": math.nan, "ok": False, "error": mismatch}
    max_abs, worst, errors = 0.0, (0.0, 0.0, -1.0), []
    for i, (o, r) in enumerate(zip(outs, refs)):
        nonfinite: list[str] = []  # (where the relative error is inf for NaN or inf out of place: which elements)
        if o is None or r is None:
            if (o is None) != (r is None):
                errors.append(f"output {i} is {'None' if o is None else 'a tensor'}, the reference's is not")
            continue
        o, r = o.detach(), r.detach()
        # An integer or boolean reference (indices) is exact whatever dtype the provider returns it in: argmax
        # indices returned as float32, ten of them off by one, passed at float32's tolerance.
        tol = tolerance_for(r.dtype if _integral(r) else o.dtype, tolerance)
        if o.shape != r.shape:
            errors.append(f"output {i} has shape {tuple(o.shape)}, the reference {tuple(r.shape)}")
            rel, abs_err = math.inf, math.inf
        elif _integral(o) and _integral(r):
            rel, abs_err = _integer_error(o, r)
        else:
            rel = relative_error(o, r)  # NaN/inf must sit where the reference has them, else inf
            wide = error_dtype(o, r)
            o, r = o.to(device=r.device, dtype=wide), r.to(wide)
            finite = torch.isfinite(r)
            diff = torch.where(finite, (o - r).abs(), 0.0)  # (0 where the reference is not finite)
            abs_err = math.inf if rel == math.inf else float(diff.max()) if diff.numel() else 0.0
            if per_element and abs_err != math.inf:
                errors += _element_error(i, diff, abs_err, r, finite, tol)
            if rel == math.inf:
                nonfinite = _nonfinite_error(i, o, r, finite, tol)
        max_abs = max(max_abs, abs_err)
        ratio = rel / tol if tol > 0 else (0.0 if rel == 0 else math.inf)
        ratio = math.inf if math.isnan(ratio) else ratio
        if (ratio, rel) > (worst[2], worst[0]):
            worst = (rel, tol, ratio)
        if not rel <= tol:  # NaN never passes
            errors += nonfinite or [f"output {i}: {_REL_ERR} {rel:.3g} > {tol:.3g}"]
    return {"max_abs_err": max_abs, "rel_err": worst[0], "tol": worst[1], "ok": not errors,
            "error": "; ".join(errors)}


def _element_error(i: int, diff: torch.Tensor, abs_err: float, r: torch.Tensor, finite: torch.Tensor,
                   tol: float) -> list[str]:
    """compare's per-element verdict on output i from its errors ``diff`` (|out - ref| where the reference is
    finite, else 0; their largest ``abs_err``): [] or the worst element's failure, its error relative to the
    largest finite |reference| value, and where it lies."""
    scale = float(r.abs()[finite].max()) if finite.any() else 0.0
    rel = abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else math.inf)
    if rel <= tol:
        return []
    worst = int(diff.argmax())
    at = tuple(int(x) for x in torch.unravel_index(torch.tensor(worst), diff.shape)) if diff.dim() else ()
    return [f"output {i}: {_REL_ERR} {rel:.3g} > {tol:.3g} at element {at} (of the largest |reference|, "
            f"{scale:.3g})"]


def _nonfinite_error(i: int, o: torch.Tensor, r: torch.Tensor, finite: torch.Tensor, tol: float) -> list[str]:
    """Where output i's NaN or inf does not match the reference's, as compare says it: how many such elements and
    the first, with both values. A NaN there is often an element the kernel never wrote: check runs each provider
    with new tensors starting as NaN."""
    wrong = (o.isfinite() != finite) | ((o.nan_to_num() != r.nan_to_num()) & ~finite)
    n = int(wrong.sum())
    if not n:
        return []
    first = int(wrong.reshape(-1).to(torch.uint8).argmax())  # (the first True, without a list of every index)
    at = tuple(int(x) for x in torch.unravel_index(torch.tensor(first), o.shape)) if o.dim() else ()
    got, want = o.reshape(-1)[first].item(), r.reshape(-1)[first].item()
    unwritten = " (NaN: unwritten? new tensors start as NaN in check)" if got != got else ""
    # (worded as a relative error first: a failure in the numbers alone, bench's status "wrong")
    return [f"output {i}: {_REL_ERR} inf > {tol:.3g}: {n} element{'s' if n > 1 else ''} whose NaN or inf does not "
            f"match the reference's, first at {at}: {got} against {want}{unwritten}"]


def _integral(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


def _integer_error(o: torch.Tensor, r: torch.Tensor) -> tuple[float, float]:
    """(relative, absolute) error of integer or boolean outputs, 0 only where they are equal value for value:
    compared as integers, since float64 holds integers exactly only up to 2^53 (2^62 + 1 passed for 2^62)."""
    o = o.to(r.device)
    if torch.equal(o, r) if o.dtype == r.dtype else torch.equal(o.long(), r.long()):
        return 0.0, 0.0
    diff = (o.long() - r.long()).double()  # exact in int64; a difference wider than int64 wraps (then inf below)
    num, den = float(torch.linalg.vector_norm(diff)), float(torch.linalg.vector_norm(r.double()))
    rel = num / den if den > 0 else math.inf
    return (rel if rel > 0 else math.inf), float(diff.abs().max())


def _prepare(setup: Callable | None):
    if setup is None:
        return lambda *args: args
    if not callable(setup):
        raise TypeError(f"setup must be a callable (*args) -> args, not {type(setup).__name__}")

    def prepared(*args):
        out = setup(*args)
        if not isinstance(out, (tuple, list)):  # (a tensor returned would be unpacked row by row)
            raise TypeError(f"setup must return the case's arguments as a tuple (e.g. `return (x, y)`; "
                            f"`return (x,)` for one), not {type(out).__name__}")
        return out
    return prepared


def _check_providers(providers: Any) -> None:
    """providers: a mapping of names to callables (None: not installed), as check, bench and plot key rows."""
    if not isinstance(providers, Mapping):
        raise TypeError(f"providers must be a mapping of names to callables, e.g. {{'mine': fn, 'torch': ref}} "
                        f"(None for one not installed), not {type(providers).__name__}")
    for name, fn in providers.items():
        if not isinstance(name, str):
            raise TypeError(f"providers' names must be str (they key the rows), not {type(name).__name__}: {name!r}")
        if fn is not None and not callable(fn):
            raise TypeError(f"provider {name!r} must be a callable or None (not installed), not "
                            f"{type(fn).__name__}")


def _case_list(cases: Any) -> list[Case]:
    """check's and bench's cases as a list, checked: any iterable of harness.Case (a list, a dict's values, a
    generator: read once), each name once."""
    if isinstance(cases, (Case, str, Mapping)) or not isinstance(cases, Iterable):
        raise TypeError(f"cases must be a list of harness.Case (`[Case(...)]` for one), not {type(cases).__name__}")
    cases = list(cases)
    others = [type(c).__name__ for c in cases if not isinstance(c, Case)]
    if others:
        raise TypeError(f"cases must be harness.Case objects, not {', '.join(sorted(set(others)))}")
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be unique (they key the rows): {names}")
    for case in cases:
        _check_meta(case)  # again: meta is a dict, changed perhaps since the case was made
    return cases


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:200]}"


# ----------------------------------------------------------------------------------------------- check
def check(providers: Mapping[str, Callable | None], reference: Callable, cases: Sequence[Case], *,
          tolerance: float | Mapping | None = None, setup: Callable | None = None,
          per_element: bool = False) -> pd.DataFrame:
    """One row per (provider, case): provider, case, device, max_abs_err, rel_err, tol, ok, error, and the
    case's meta columns. ``reference`` gets the case's args upcast to float64 (floating tensors; integer
    tensors, indices perhaps, as they are). Each provider and the reference get their own copies of the
    case's tensors. ``setup(*args) -> args`` (e.g. fresh leaves that require grad) runs before every call,
    the reference's included. A provider that raises fails with the exception in ``error``; one given as None
    is "not installed". A reference that raises or returns no tensors raises here, naming the reference.
    ``per_element``: every element within the tolerance of its output's largest reference value, besides the
    norm (``compare``).

    Each row's ``check_id`` ("check <n>", one per call) records which callable each provider name was, so that
    ``bench(checked=)`` times only the callables checked, also for frames of several checks joined by
    ``pd.concat``; rows without it (built by hand, read from a file) are trusted by name."""
    _check_providers(providers)
    if not callable(reference):
        raise TypeError(f"reference must be a callable, not {type(reference).__name__}")
    cases = _case_list(cases)
    tolerance = _tolerance_arg(tolerance)
    prepare = _prepare(setup)
    rows, signatures = [], {}
    for case in cases:
        where = _case_device(case.args)
        signatures[case.name] = _signature(case.args)
        with _on_device(where):
            case.reference = reference
            case.checked_with = {"tolerance": tolerance, "per_element": per_element}
            device = where.type
            ref = _run_reference(reference, prepare, case)
            for name, fn in providers.items():
                row = {"provider": name, "case": case.name, **case.meta, "device": device}
                if fn is None:
                    rows.append({**row, "ok": False, "error": "not installed"})
                    continue
                rows.append({**row, **_check_one(fn, case, ref, prepare, device, tolerance, per_element)})
    mark = _CheckId(next(_CHECK_NUMBERS), providers, signatures)
    df = _frame(rows, CHECK_COLUMNS, cases)
    df["check_id"] = pd.Series([mark] * len(df), index=df.index, dtype=object)  # (object: pandas keeps the mark)
    return df


def _check_one(fn: Callable, case: Case, ref: Any, prepare: Callable, device: str,
               tolerance: float | Mapping | None, per_element: bool = False) -> dict:
    """compare's columns for one provider on one case (its inputs and outputs are freed on return, before the
    next provider's copies)."""
    try:
        args = prepare(*clone_args(case.args))  # its own inputs: it may write into them
        with poisoned(device):
            out = fn(*args)
        result = compare(out, ref, tolerance, per_element)
        if result["ok"] and _any_integral(out, ref):
            # Poisoned memory reads True in a boolean tensor (an integer's maximum), a legal value: a mask kernel
            # that leaves elements unwritten passed wherever the truth there is True. Run it again over new memory
            # that held zeros, and hold that result to the reference too.
            del out
            args = prepare(*clone_args(case.args))
            try:
                with poisoned(device), _ZeroedEmpty():
                    out = fn(*args)
            except Exception as e:
                # What the zeros made raise is a failure; what any dispatch mode makes raise (a higher-order op
                # with no rule for one) is the mode's: then the first look stands.
                try:
                    with poisoned(device), _PassThrough():
                        fn(*prepare(*clone_args(case.args)))
                except Exception:
                    return result
                return {"ok": False, "error": f"{_SECOND_LOOK}: {_error(e)} (elements left unwritten?)"}
            again = compare(out, ref, tolerance, per_element)
            if not again["ok"]:
                again["error"] = f"{_SECOND_LOOK}: {again['error']} (elements left unwritten?)"
                return again
        return result
    except Exception as e:  # a provider that fails is reported, the check goes on
        return {"ok": False, "error": _error(e)}


def _any_integral(out: Any, ref: Any) -> bool:
    """Whether the provider's outputs or the reference's hold an integer or boolean tensor, where the poison is a
    legal value. The provider's own count: a boolean mask checked against a reference of floats (1.0 and 0.0)
    read its poison, True, as 1.0 and passed with elements unwritten."""
    return any(t is not None and _integral(t) for t in [*_outputs(out), *_outputs(ref, "the reference")])


_SECOND_LOOK = "run again over new memory that held zeros (False), not the poison"


class _ZeroedEmpty(TorchDispatchMode):
    """New tensors (empty, empty_like, empty_strided, empty_permuted, new_empty, ...) filled with zeros as they are
    made, by PyTorch's operators called from Python or from a C++ extension alike, with PyTorch's own fill of new
    memory switched off. Not seen: memory a kernel takes some other way, a resize_ that grows a tensor, a compiled
    provider's graph (it runs eagerly under the mode)."""

    _EMPTY = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}

    def __enter__(self):
        self._fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False
        return super().__enter__()

    def __exit__(self, *exc):
        torch.utils.deterministic.fill_uninitialized_memory = self._fill
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self._EMPTY and isinstance(out, torch.Tensor) and out.numel():
            with torch.no_grad():
                out.zero_()
        return out


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: whether a provider runs under one at all (see _check_one)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _CheckId(str):
    """The mark of one ``check`` call on each of its rows (column ``check_id``, "check <n>"), holding which callable
    each provider name was (``.callables``). A column, not the frame's attrs: pandas keeps attrs through
    ``pd.concat`` only where every frame's are equal, so joined checks of other callables either kept the first's
    record alone (a provider checked in the second refused; one that failed there judged by the first's verdict)
    or lost it (trusted by name); a column keeps each row's own. A str to everything else: written to CSV or
    parquet, pickled (a lambda does not pickle), it is the plain "check <n>", and such rows are trusted by name,
    as rows built by hand. Copies of a frame keep this very object, so the callables stay the ones checked."""

    def __new__(cls, number: int, providers: Mapping[str, Callable | None], cases: Mapping[str, tuple]):
        self = super().__new__(cls, f"check {number}")
        self.callables = dict(providers)
        self.cases = dict(cases)  # case name -> _signature of its args as checked
        self.loaded = dict(loader.LAST_LOADED)  # the extensions' builds loaded last (a lambda calls those)
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (str, (str(self),))


_CHECK_NUMBERS = itertools.count(1)


def _signature(args: Any) -> tuple:
    """What kind of inputs a case has: each tensor's rank, dtype, device, layout, memory order (contiguous, or the
    order of its strides and which are 0), requires_grad, conjugate and negative bits, the alignment of its first
    element (to 16 bytes: a vectorised kernel's fast path) and which earlier tensor of the case its memory overlaps
    (an in-place kernel given one tensor twice), as the providers' copies have them; the value of a string, bool,
    None, dtype, device or enum (a reduction's name, a dtype to compute in), a function's name, and every other
    argument's type (a number, an array, a slice). A case rebuilt under its name in another dtype, on another device
    or transposed (a notebook's cases cell edited, the bench cell run again) is not the case a check ran. Fresh
    values and other sizes (of tensors, or numbers) are: a check of the first rows of a case too large to upcast to
    float64 vouches for the whole case (the kit's suites check so)."""
    parts: list = []

    def order(t: torch.Tensor):
        if t.layout != torch.strided or t.is_contiguous():
            return "contiguous"
        st = t.stride()
        return tuple(sorted(range(t.dim()), key=lambda d: -st[d])), tuple(d for d in range(t.dim()) if st[d] == 0)

    # What the providers get is copies (_copies): aligned storages at the views' offsets, one shared by tensors
    # whose spans of memory overlap. The signature describes those: alignment from the offset, sharing by overlap
    # (added after the walk, which must meet every tensor first: where in parts each tensor's entry is).
    tensors: list[torch.Tensor] = []
    entries: list[int] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        align = (t.storage_offset() * t.element_size()) % 16 if t.layout == torch.strided else None
        tensors.append(t)
        entries.append(len(parts))
        parts.append(("tensor", t.dim(), t.dtype, t.device, t.layout, order(t), t.requires_grad, t.is_conj(),
                      t.is_neg(), align))
        return t

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            note(obj)
        elif isinstance(obj, (tuple, list)):
            parts.append((type(obj).__name__, len(obj)))
            for o in obj:
                walk(o)
        elif isinstance(obj, Mapping):
            parts.append(("mapping", tuple(sorted(map(repr, obj)))))
            for k in sorted(obj, key=repr):
                walk(obj[k])
        elif obj is None or isinstance(obj, (str, bool, torch.dtype, torch.device, enum.Enum)):
            parts.append(repr(obj))  # (a setting: a reduction's name, a dtype to compute in)
        elif callable(obj) and hasattr(obj, "__qualname__"):
            parts.append(("callable", obj.__qualname__))  # (by name: a lambda made again when a cell reruns)
        else:
            parts.append(type(obj).__qualname__)  # (a size, a scale, an array of values, a slice: of any size)

    walk(args)
    shares = _sharing(tensors)
    for k, at in enumerate(entries):
        parts[at] += (shares.get(k),)
    return tuple(parts)


def _run_reference(reference: Callable, prepare: Callable, case: Case) -> Any:
    """The reference's outputs on ``case``. A reference that fails is one error, raised here, not every
    provider's."""
    args = prepare(*upcast(case.args))
    try:
        ref = reference(*args)
    except Exception as e:
        raise RuntimeError(f"the reference raised on case {case.name!r}: {_error(e)}") from e
    try:
        outs = _outputs(ref, "the reference")
    except TypeError as e:
        raise TypeError(f"case {case.name!r}: {e}") from None
    if all(o is None for o in outs):  # (None, (), {}, [None]): nothing to compare with, every provider would pass
        raise TypeError(f"case {case.name!r}: the reference returned no tensors ({ref!r}); a reference that works "
                        "in place must return what it wrote")
    return ref


def _frame(rows: list[dict], columns: list[str], cases: Sequence[Case]) -> pd.DataFrame:
    meta = list(dict.fromkeys(k for c in cases for k in c.meta))
    order = columns[:2] + [m for m in meta if m not in columns] + columns[2:]
    df = pd.DataFrame(rows, columns=order)
    if "ok" in df:
        df["ok"] = df["ok"].astype(bool)
    return df


# ----------------------------------------------------------------------------------------------- bench
_LAST_CHECK = object()  # bench's default: the reference each case was last checked with


def _same_callable(a: Callable | None, b: Callable | None) -> bool:
    # == as well as is: ``obj.method`` is a new bound method at each access, equal to the last one.
    return a is b or a == b


def _check_checked(providers: Mapping[str, Callable | None], checked: pd.DataFrame,
                   cases: Sequence[Case]) -> None:
    """Refuses a check's verdict on a provider name that now names another callable than the check of that row
    ran, or on a case name whose inputs now differ in kind from those it ran on (_signature). Rows without a
    check's mark (built by hand, read from a file) are trusted by name."""
    if "check_id" not in checked:
        return
    now = {c.name: _signature(c.args) for c in cases}
    for name, case, mark in zip(checked["provider"], checked["case"], checked["check_id"]):
        if not isinstance(mark, _CheckId):
            continue
        if case in now and case in mark.cases and mark.cases[case] != now[case]:
            raise ValueError(f"case {case!r} is not the case {mark} of checked= ran: its inputs' dtypes, devices, "
                             "ranks, memory orders, conjugate or negative bits, alignment, shared storage or other "
                             "arguments' types differ from those checked: check it again (harness.check) and pass "
                             "that result")
        fn = providers.get(name)
        if fn is None:
            continue
        then = mark.callables.get(name)
        if not (name in mark.callables and _same_callable(then, fn)):
            raise ValueError(f"provider {name!r} is not the callable {mark} of checked= ran ({fn!r} now, {then!r} "
                             "then): check it again (harness.check) and pass that result")
        rebuilt = _rebuilt_since(mark)
        if rebuilt and not isinstance(fn, types.BuiltinFunctionType):
            raise ValueError(f"provider {name!r}: since {mark} of checked= ran, {rebuilt}; the same "
                             "callable may now call the new build (a lambda over the module's variable), unchecked: "
                             "check it again (harness.check) and pass that result")


def _rebuilt_since(mark: _CheckId) -> str:
    """Which extensions (by the name given to the loader) were loaded from another build since the check ``mark``
    ran, in words, else "". A module's own function (``mod.scale2``) is the build it was made by, and its
    identity says which (_check_checked exempts it); any other callable can reach a module through a variable."""
    changed = [f"{name!r} was loaded from {loader.LAST_LOADED[name]} (checked with {ext})"
               for name, ext in sorted(mark.loaded.items()) if loader.LAST_LOADED.get(name, ext) != ext]
    return "; ".join(f"extension {c}" for c in changed)


def _verdict(row) -> tuple[bool, float, str]:
    error = getattr(row, "error", "")
    return bool(row.ok), row.rel_err, error if isinstance(error, str) else ""


def _verdicts(providers, cases, reference, checked, tolerance, setup,
              per_element=_LAST_CHECK) -> dict[tuple[str, str], tuple]:
    """(provider, case) -> (ok, rel_err, error) for every provider that exists."""
    out = {}
    if checked is not None:
        _check_checked(providers, checked, cases)
        for r in checked.itertuples(index=False):
            out[(r.provider, r.case)] = _verdict(r)
    for case in cases:
        todo = {n: f for n, f in providers.items() if f is not None and (n, case.name) not in out}
        if not todo:
            continue
        ref = case.reference if reference is _LAST_CHECK else reference
        # Left out, the tolerance and per_element of the check that set that reference: a provider that a
        # per-element check (or a tighter tolerance) failed must not pass bench's own check on the defaults.
        last = case.checked_with if reference is _LAST_CHECK else {}
        tol = last.get("tolerance") if tolerance is _LAST_CHECK else tolerance
        each = last.get("per_element", False) if per_element is _LAST_CHECK else per_element
        if ref is None and reference is _LAST_CHECK:
            raise ValueError(f"case {case.name!r} has no reference: bench checks every provider before timing "
                             "it, against reference=... or the reference the case was checked with "
                             "(harness.check records it); pass reference=None to time without checking")
        if ref is None:
            out.update({(n, case.name): (True, math.nan, "") for n in todo})
            continue
        for r in check(todo, ref, [case], tolerance=tol, setup=setup, per_element=each).itertuples(index=False):
            out[(r.provider, r.case)] = _verdict(r)
    return out


def _numbers_only(error: str) -> bool:
    """Whether a check's error says only that outputs were off by more than their tolerance."""
    return bool(error) and all(part.split(": ", 1)[-1].startswith(_REL_ERR) for part in error.split("; "))


def _wrong(rel_err: float, error: str) -> str:
    """The status of a provider that failed its check: "wrong" where its numbers were off (rel_err says by how
    much), else "wrong: <why>" (it raised, or its outputs had another shape, count or keys)."""
    if not error or (not pd.isna(rel_err) and _numbers_only(error)):
        return "wrong"
    return f"wrong: {error}"


def _n_input_sets(case: Case, device: str, timer: str) -> tuple[int, bool]:
    """How many input sets to rotate among, and whether to flush the L2 before each call: on the GPU, inputs that
    fit in (twice) the L2 are flushed and rotated among copies that together overflow it. On the CPU they are
    rotated alike through its last-level cache (not flushed: the wall clock would time the flush): one set of a
    case that fits there was read from the cache at every call but the first, against a floor read from memory,
    so a correct kernel ran "below the floor". A wall clock on the GPU times one set, as the host sees a step."""
    # (a sparse tensor has no nbytes: its dense size stands in, an upper bound of what it holds)
    in_bytes = sum(t.nbytes if t.layout == torch.strided else t.numel() * t.element_size()
                   for t in _tensors(case.args))
    if timer == "cuda":
        cache = timing.l2_bytes(device)
    elif device == "cpu":
        cache = timing.llc_bytes()
    else:
        return 1, False
    if in_bytes > 2 * cache:
        return 1, False
    return min(8, max(2, (3 * cache) // max(1, in_bytes) + 1)), timer == "cuda"


def _below_floor_why(device: str, timer: str) -> str:
    """The likely causes of a time below the floor, for bench's warning. A wall clock flushes no cache
    (_n_input_sets): inputs that fit in one (on the CPU, a small case's sets all fit in its last level) are read
    from it, while the floor was read from a buffer far beyond it; on the CPU that is the usual cause, and blaming
    bytes_moved alone sent the researcher hunting for a fault that was not there."""
    causes = ("bytes_moved may count bytes it need not move (padding, masked rows), or it does not do its work each "
              "call (a result cached across calls, work left running on another stream)")
    if timer != "wall":
        return f"Perhaps {causes}"
    if device == "cpu":
        what = ("its inputs stay in the CPU's caches between calls (at most 8 sets of them rotate, unflushed: a small "
                "case's all fit)")
    else:
        what = "its inputs stay in the L2 between calls (the wall clock times one set of them, unflushed)"
    return (f"Likely {what}, while the floor is read from memory: a case much larger than the cache measures "
            f"memory. Else {causes}")


def _check_floor(floor: Any, cases: Sequence[Case]) -> None:
    """bench's floor=: a floors.Floor with a positive bandwidth, measured on the cases' kind of device (a CUDA
    floor beside CPU cases gave x_floor 1419, silently)."""
    if floor is None:
        return
    if not isinstance(floor, floors.Floor):
        raise TypeError(f"floor must be a floors.Floor (floors.measure_floor(device)), not {type(floor).__name__}")
    if not (isinstance(floor.gbps, numbers.Real) and 0 < floor.gbps < math.inf):
        raise ValueError(f"floor's bandwidth must be a positive number of GB/s, not {floor.gbps!r}")
    try:
        kind = torch.device(floor.device).type  # (a floor of "cuda:1" holds for CUDA cases)
    except (RuntimeError, TypeError):
        raise ValueError(f"floor's device must name a torch device (cpu, cuda, ...), not {floor.device!r}") from None
    for case in cases:
        device = _case_device(case.args).type
        if device != kind:
            raise ValueError(f"case {case.name!r} is on {device}, the floor was measured on {floor.device}: "
                             f"give a floor of that device (floors.measure_floor({device!r})), or none")


def _check_bench_args(timer: str, reps: int, warmup: int) -> None:
    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {', '.join(map(repr, TIMERS))}, not {timer!r}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an integer >= 1 (timed calls per provider and case), not {reps!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, not {warmup!r}")


def _peak_mib(fn: Callable, args: tuple, device: str) -> float:
    """MiB the call allocates beyond what is allocated before it (its inputs among them), at its peak."""
    if device != "cuda":
        return math.nan
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(*args)
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _bench_case(case: Case, device: str, providers, verdicts, prepare, flushes, *, bytes_moved, floor, timer, reps,
                warmup, measure_memory, inference_mode) -> list[dict]:
    """bench's rows of one case, on the case's device (``device``'s type; the current one)."""
    rows = []
    case_timer = ("cuda" if device == "cuda" else "wall") if timer == "auto" else timer
    if case_timer == "cuda" and device != "cuda":
        raise ValueError(f"case {case.name!r}: timer='cuda' needs inputs on a CUDA device")
    nbytes = bytes_moved(*case.args) if bytes_moved is not None else None
    if isinstance(nbytes, torch.Tensor) and nbytes.dim() == 0 and not nbytes.is_complex():
        nbytes = nbytes.item()
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real)
                               or not 0 <= nbytes < math.inf):
        raise ValueError(f"case {case.name!r}: bytes_moved returned {nbytes!r}; it must be a number of bytes >= 0")
    base = {"case": case.name, **case.meta, "device": device, "timer": case_timer}
    if nbytes is not None:
        fl = floor or floors.measure_floor(device)
        base.update(bytes=nbytes, floor_gbps=fl.gbps, floor_source=fl.source, floor_ms=fl.ms(nbytes))
    peak = floors.device_peak_gbps(device)
    n_sets, flush = _n_input_sets(case, device, case_timer)
    gpu = (device, torch.cuda.current_device() if device == "cuda" else None)  # a flush buffer per GPU
    if flush and gpu not in flushes:
        flushes[gpu] = timing.L2Flush(device)
    for name, fn in providers.items():
        row = {"provider": name, **base}
        if fn is None:
            rows.append({**row, "status": "not installed"})
            continue
        ok, rel_err, error = verdicts[(name, case.name)]
        row["rel_err"] = rel_err
        if not ok:
            rows.append({**row, "status": _wrong(rel_err, error)})
            continue
        sets = [clone_args(case.args) for _ in range(n_sets)]  # its own inputs: it may write into them
        try:
            with torch.inference_mode(inference_mode):
                if case_timer == "cuda":
                    times = timing.time_cuda(fn, sets, reps, warmup, flushes.get(gpu) if flush else None,
                                             prepare)
                else:
                    inner = WALL_INNER_CUDA if device == "cuda" else 1
                    times = timing.time_wall(fn, sets, reps, warmup, device, inner, prepare)
                if measure_memory:
                    row["peak_mib"] = _peak_mib(fn, prepare(*sets[0]), device)
        except Exception as e:  # a provider that fails is reported, the run goes on
            rows.append({**row, "status": f"error: {_error(e)}"})
            continue
        finally:
            del sets  # before the next provider's copies
        med, q20, q80 = timing.quantiles(times)
        row.update(status="ok", median_ms=med, q20_ms=q20, q80_ms=q80)
        if nbytes is not None:
            # (no bytes to move, an empty case: no floor to be a multiple of)
            row.update(gbps=nbytes / med / 1e6 if med > 0 else math.nan,
                       x_floor=med / row["floor_ms"] if row["floor_ms"] > 0 else math.nan)
            if row["x_floor"] < BELOW_FLOOR:
                warnings.warn(f"{name!r} on case {case.name!r} ran at {row['x_floor']:.3g} x the floor: faster than "
                              f"the bytes it must move allow. {_below_floor_why(device, case_timer)}", stacklevel=3)
            if peak:
                row["pct_of_peak"] = 100.0 * row["gbps"] / peak
        rows.append(row)
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def bench(providers: Mapping[str, Callable | None], cases: Sequence[Case], *,
          bytes_moved: Callable[..., int] | None = None, reference: Callable | None = _LAST_CHECK,
          checked: pd.DataFrame | None = None, tolerance: float | Mapping | None = _LAST_CHECK,
          setup: Callable | None = None, timer: str = "auto", reps: int = 30, warmup: int = 5,
          floor: floors.Floor | None = None, measure_memory: bool = False,
          inference_mode: bool = False, per_element: bool = _LAST_CHECK) -> pd.DataFrame:
    """One row per (provider, case) with the timing columns (BENCH_COLUMNS) and the case's meta columns.

    ``bytes_moved(*args)``: the bytes a call must move at least (read once, written once); it gives gbps,
    floor_ms, x_floor (time / floor) and pct_of_peak (gbps over the card's vendor peak). ``timer``: "cuda"
    (events), "wall", or "auto" (events on a GPU, the wall clock on the CPU). ``floor``: a measured
    ``floors.Floor`` (default: measured on first use in this process). ``measure_memory``: add peak_mib,
    the memory one call allocates beyond its inputs (CUDA). ``inference_mode``: time under
    ``torch.inference_mode()`` (forward-only cases). ``setup`` as in ``check``, outside the timed region;
    ``tolerance`` and ``per_element`` as in ``check``, for the check it runs first (left out, as the check that
    set the case's reference had them; else the defaults).

    Each provider is timed on its own copies of the case's tensors (made once, before its warm-up), so one
    that writes into its inputs changes no other's. ``checked=``: a ``check`` frame of these same callables
    (a name that now names another callable is refused: check it again; so is a callable other than a module's
    own function once an extension was loaded from another build since the check: ``loader.LAST_LOADED``).

    status: "ok" (timed), "wrong" (failed its check on the numbers: not timed), "wrong: ..." (failed its
    check otherwise, e.g. raised: the check's error), "not installed" (given as None), or "error: ..."
    (raised while timed). rel_err is the check's (empty when timed with reference=None).
    """
    _check_providers(providers)
    cases = _case_list(cases)
    _check_bench_args(timer, reps, warmup)
    _check_floor(floor, cases)
    if checked is not None and not (isinstance(checked, pd.DataFrame)
                                    and {"provider", "case", "ok"} <= set(checked.columns)):
        raise TypeError("checked= takes the frame harness.check returned (columns provider, case, ok, ...), not "
                        + ("a frame without them (bench's?)" if isinstance(checked, pd.DataFrame)
                           else type(checked).__name__))
    if tolerance is not _LAST_CHECK:
        tolerance = _tolerance_arg(tolerance)
    verdicts = _verdicts(providers, cases, reference, checked, tolerance, setup, per_element)
    prepare = _prepare(setup)
    flushes: dict[tuple, timing.L2Flush] = {}
    rows = []
    for case in cases:
        where = _case_device(case.args)
        with _on_device(where):
            rows += _bench_case(case, where.type, providers, verdicts, prepare, flushes, bytes_moved=bytes_moved,
                                floor=floor, timer=timer, reps=reps, warmup=warmup, measure_memory=measure_memory,
                                inference_mode=inference_mode)
    columns = BENCH_COLUMNS + (["peak_mib"] if measure_memory else [])
    return _frame(rows, columns, cases)


# ------------------------------------------------------------------------------------------------ plot
def plot(timed: pd.DataFrame, ours: str | None = None, *, title: str | None = None):
    """A matplotlib Figure of a ``bench`` frame: time (with 20-80% bands) and GB/s against bytes moved, one
    line per provider (``ours`` drawn bold), the floor dashed (with a marker at each case) and the vendor peak
    dotted."""
    from . import plots

    if not (isinstance(timed, pd.DataFrame) and {"provider", "median_ms"} <= set(timed.columns)):
        raise TypeError("plot takes the frame harness.bench returned (columns provider, median_ms, ...), not "
                        + ("a frame without them (check's?)" if isinstance(timed, pd.DataFrame)
                           else type(timed).__name__))
    return plots.plot_timings(timed, ours=ours, title=title)
