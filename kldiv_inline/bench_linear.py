"""The fused LM head's suite: ``fused_linear_generalized_jsd`` against the peers, through the harness.

Cases (CUDA): bfloat16, tokens x hidden 4096 x vocabulary 128256 (Llama 3's head), student and teacher each given
as hidden states + weight, T = 2, 10% of the tokens masked, forward + backward w.r.t. the student's hidden states
and weight; 4096 tokens (the goals' shape) and a sweep of 1024 to 16384 tokens (time and memory against tokens);
beta 0 (forward KL) and 0.5 at the goals' shape, SWEEP_BETAS across the sweep. Providers: ours (the goals');
ours with ``skip_masked=True`` (SKIP_MASKED: no products for masked tokens, one host synchronisation); PyTorch with
materialised logits (both heads' ``hidden @ weight.T`` in bf16, TRL's loss ``peers.trl_generalized_jsd``,
backward), eager and under torch.compile; Liger-Kernel's ``LigerFusedLinearJSD`` when installed.
On the CPU the same runs at the sizes given (the CPU twin, for a test).

Every provider is checked against the float64 reference (``reference.generalized_jsd_reference`` of float64
logits of the same bf16 inputs: the loss and both gradients) on the first CHECK_TOKENS tokens, then timed
(``harness.bench``, CUDA events, with the peak memory of a step beyond its inputs).

Columns besides the harness's: ``hidden``; the floor, the four matrix products (student logits, teacher logits,
grad hidden, grad weight) = 8 x tokens x hidden x vocabulary FLOP over the bf16 matrix-product rate measured in the
same run (torch.matmul of two 8192^2 matrices through the harness): ``floor_ms``, ``x_floor``, ``matmul_tflops``;
beside it, not judged by the goals, the floor at the rate the same products keep after SUSTAINED_SECONDS back to
back (``matmul_tflops_sustained``, ``x_floor_sustained``): a card at its power limit lowers its clock under
sustained products, and a step of the fused head is ~25 ms of products in a row (every token's products, for
SKIP_MASKED too, which makes none for the masked 10%: its floor of the products it must make is ~10% lower, and its
``x_floor`` ~10% kinder than the goals' rows', which is why it stands beside them and not in them);
``extra_mib``: ``peak_mib`` less the bytes of the parameter gradients (hidden's and weight's), the memory the
loss itself costs; and for ours the accuracy on the checked tokens: ``loss_rel_err`` (against the float64 loss of
the same bf16 inputs) and ``grad_rel_err`` (the larger of the two gradients' relative errors against a float32
reference that materialises the logits from the same bf16 tensors), beside ``loss_rel_err_torch`` and
``grad_rel_err_torch``, the same for PyTorch's eager bf16 path (whose logits are rounded to bf16 like ours: at a
small size that rounding alone puts the loss error near 1e-3).

``run`` returns the rows; ``goal_rows`` evaluates LINEAR_GOALS on them.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch

from . import harness
from .fused_linear import fused_linear_generalized_jsd
from .peers import trl_generalized_jsd
from .reference import generalized_jsd_reference, relative_error
from .timing import quantiles, time_cuda, time_wall

OURS = "kldiv_inline"
SKIP_MASKED = "kldiv_inline_skip_masked"  # ours with skip_masked=True: beside the goals' row, not in it
TEMPERATURE = 2.0
MASKED = 0.10          # share of tokens whose label is ignore_index
CHECK_TOKENS = 256     # tokens of a case checked against float64 (the whole head in float64 is 4 GiB a weight)
# The harness's check catches a wrong provider; it does not rank accuracy (ours' is measured apart). Every provider
# makes bf16 logits (one rounding of each, which moves the loss and the gradients by up to ~1e-2 relative at
# these spreads) and returns bf16 or float32 gradients: one bound for all outputs.
CHECK_TOLERANCE = 3e-2
HEADLINE = (4096, 4096, 128256)     # (tokens, hidden, vocabulary) of the goals
SWEEP_TOKENS = (1024, 2048, 8192, 16384)
# The sweep's other sizes run forward KL only: each (size, beta) costs a fresh torch.compile and the peers' steps
# (at 16384 tokens eager's take seconds), and a sweep of both betas ran past a 10-minute device call on an H100.
SWEEP_BETAS = (0.0,)

# The goals at HEADLINE, matched on beta: (name, beta, what, peer or None, bound). "x_floor": our time / floor <=
# bound. "speedup": peer time / our time >= bound. "extra_mib": our extra memory <= bound (MiB). "extra_vs_peer":
# our extra memory / the peer's < bound. "loss_rel_err", "grad_rel_err": <= bound.
LINEAR_GOALS = [
    ("L1", 0.0, "x_floor", None, 1.15),
    ("L1", 0.0, "speedup", "torch_compile", 1.25),
    ("L1", 0.0, "speedup", "liger", 4.0),
    ("L2", 0.5, "x_floor", None, 1.15),
    ("L2", 0.5, "speedup", "torch_compile", 1.25),
    ("L2", 0.5, "speedup", "liger", 4.0),
    ("L3", 0.0, "extra_mib", None, 1024.0),
    ("L3", 0.5, "extra_mib", None, 1024.0),
    ("L3", 0.5, "extra_vs_peer", "liger", 1.0),
    ("L4", 0.0, "loss_rel_err", None, 1e-3),
    ("L4", 0.5, "loss_rel_err", None, 1e-3),
    ("L4", 0.0, "grad_rel_err", None, 8e-3),
    ("L4", 0.5, "grad_rel_err", None, 8e-3),
]
# Back-to-back products before the sustained rate is timed. An H100 timed so (tools/matmul_clocks.py): 1980 MHz and
# 781 TFLOP/s in the burst the goals' floor is taken from, 1410 MHz and 703 TFLOP/s (0.90 of it) after seconds of
# products at its power limit: the clock the fused head's steps run at, back to back, in training.
SUSTAINED_SECONDS = 2.0


CPU_SHAPE = (64, 64, 512)           # (tokens, hidden, vocabulary) on the CPU twin: any speed, so a small one


def default_sizes(device: str) -> list[tuple[int, int, int]]:
    """(tokens, hidden, vocabulary) of the cases: the goals' shape and the sweep on CUDA; a small one on the CPU."""
    if device != "cuda":
        return [CPU_SHAPE]
    return sizes_of_tokens(device, (HEADLINE[0], *SWEEP_TOKENS))


def sizes_of_tokens(device: str, tokens: Sequence[int]) -> list[tuple[int, int, int]]:
    """The cases at the given token counts (a sweep's points chosen by hand: one size that a time limit cut off, or
    more of them), with the hidden size and vocabulary of the goals' shape on CUDA and of CPU_SHAPE on the CPU."""
    bad = [t for t in tokens if int(t) != t or t < 1]
    if bad or not tokens:
        raise ValueError(f"token counts are positive integers; got {list(tokens)}")
    _, hidden, vocab = HEADLINE if device == "cuda" else CPU_SHAPE
    return [(int(t), hidden, vocab) for t in tokens]


def make_inputs(tokens: int, hidden: int, vocab: int, device: str, seed: int | None = None):
    """Student and teacher hidden states [tokens, hidden] and heads [vocab, hidden] in bf16, the heads scaled so
    the logits spread like an LM's (standard deviation 2), and labels with MASKED of them ignore_index. Without a
    seed, one is drawn from torch's global generator, so a caller (a test) that seeds torch replays the inputs."""
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(2**62, ())) if seed is None else seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(torch.bfloat16)

    hs, ws = randn(tokens, hidden), randn(vocab, hidden, scale=2 / hidden**0.5)
    th, tw = randn(tokens, hidden), randn(vocab, hidden, scale=2 / hidden**0.5)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    labels[torch.rand(tokens, device=device, generator=g) < MASKED] = -100
    return hs, ws, th, tw, labels


# ------------------------------------------------------------------------------------------- providers
def _step(loss_fn: Callable) -> Callable:
    """A training step: the loss and its gradients w.r.t. the student's hidden states and weight (leaves)."""
    def run(hs, ws, th, tw, y):
        loss = loss_fn(hs, ws, th, tw, y)
        loss.backward()
        return loss, hs.grad, ws.grad
    return run


def _fresh_student(hs, ws, *rest):
    """harness setup: new leaves each call (outside the timed region), so no gradient accumulates."""
    return (hs.detach().requires_grad_(), ws.detach().requires_grad_(), *rest)


def _materialised(beta: float) -> Callable:
    """What a PyTorch user writes: both heads' logits in bf16, then TRL's loss."""
    def loss(hs, ws, th, tw, y):
        with torch.no_grad():
            t = th @ tw.T
        return trl_generalized_jsd(hs @ ws.T, t, y, beta=beta, temperature=TEMPERATURE)
    return loss


def _liger(beta: float) -> Callable | None:
    try:
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD
    except Exception:  # not installed, or no triton here
        return None
    jsd = LigerFusedLinearJSD(jsd_beta=beta, ignore_index=-100, temperature=TEMPERATURE)
    return lambda hs, ws, th, tw, y: jsd(hs, ws, th, tw, y)


def _ours(beta: float, skip_masked: bool = False) -> Callable:
    def loss(hs, ws, th, tw, y):
        return fused_linear_generalized_jsd(hs, ws, th, tw, beta=beta, temperature=TEMPERATURE, labels=y,
                                            skip_masked=skip_masked)
    return loss


def providers(beta: float, device: str) -> dict[str, Callable | None]:
    out: dict[str, Callable | None] = {OURS: _ours(beta), SKIP_MASKED: _ours(beta, True),
                                       "torch_eager": _materialised(beta)}
    if device == "cuda":
        out["torch_compile"] = torch.compile(_materialised(beta), dynamic=False)
        out["liger"] = _liger(beta)
    return {k: f and _step(f) for k, f in out.items()}


def _reference_loss(beta: float, dtype: torch.dtype) -> Callable:
    """The loss of logits materialised in ``dtype`` from the inputs' values."""
    def loss(hs, ws, th, tw, y):
        hs, ws, th, tw = (x.to(dtype) for x in (hs, ws, th, tw))
        return generalized_jsd_reference(hs @ ws.T, th @ tw.T, beta=beta, temperature=TEMPERATURE, labels=y)
    return loss


def reference(beta: float) -> Callable:
    """The harness's reference step (it hands it float64 copies of the inputs)."""
    return _step(_reference_loss(beta, torch.float64))


# ------------------------------------------------------------------------------------------ measures
def matmul_tflops(device: str, size: int = 8192, reps: int = 10) -> float:
    """The bf16 matrix-product rate (TFLOP/s) of torch.matmul of two size x size matrices, timed by the harness."""
    a = torch.randn(size, size, device=device).to(torch.bfloat16)
    b = torch.randn(size, size, device=device).to(torch.bfloat16)
    timed = harness.bench({"matmul": torch.matmul}, [harness.Case(f"matmul {size}^3", (a, b))], reference=None,
                          reps=reps, warmup=3)
    return 2 * size**3 / (float(timed["median_ms"].iloc[0]) * 1e-3) / 1e12


def matmul_tflops_sustained(device: str, size: int = 8192, seconds: float = SUSTAINED_SECONDS, reps: int = 20) -> float:
    """The rate (TFLOP/s) of the same products as matmul_tflops after ``seconds`` of them back to back: the median
    of ``reps`` more, each timed by CUDA events (on the CPU, wall time) with no pause between them."""
    a = torch.randn(size, size, device=device).to(torch.bfloat16)
    b = torch.randn(size, size, device=device).to(torch.bfloat16)

    def timed(count: int, warmup: int) -> float:
        if device == "cuda":
            return quantiles(time_cuda(torch.matmul, [(a, b)], reps=count, warmup=warmup))[0]
        return quantiles(time_wall(torch.matmul, [(a, b)], reps=count, warmup=warmup, device=device))[0]

    one_ms = timed(3, 1)
    median_ms = timed(reps, max(3, int(seconds * 1e3 / one_ms)))
    return 2 * size**3 / (median_ms * 1e-3) / 1e12


def accuracy(args: tuple, beta: float) -> dict:
    """Ours against float64 (the loss) and a float32 materialised reference (the gradients), with PyTorch's eager
    bf16 path's gradient error beside it."""
    with torch.no_grad():
        ref64 = _reference_loss(beta, torch.float64)(*args)
    loss, *grads = _step(_ours(beta))(*_fresh_student(*args))
    _, *ref32 = _step(_reference_loss(beta, torch.float32))(*_fresh_student(*args))
    eager_loss, *eager = _step(_materialised(beta))(*_fresh_student(*args))
    return {"loss_rel_err": relative_error(loss.detach(), ref64),
            "loss_rel_err_torch": relative_error(eager_loss.detach(), ref64),
            "grad_rel_err": max(relative_error(g, r) for g, r in zip(grads, ref32)),
            "grad_rel_err_torch": max(relative_error(g, r) for g, r in zip(eager, ref32))}


def _with_floor(rows: list[dict], tokens: int, hidden: int, vocab: int, tflops: float, grads_mib: float,
                sustained: float) -> None:
    floor_ms = 8 * tokens * hidden * vocab / (tflops * 1e12) * 1e3
    sustained_floor_ms = floor_ms * tflops / sustained  # the same FLOP at the sustained rate
    for r in rows:
        r.update(floor_ms=floor_ms, floor_source=f"bf16 matmul {tflops:.4g} TFLOP/s", matmul_tflops=tflops,
                 matmul_tflops_sustained=sustained)
        if r.get("status") == "ok":
            r["x_floor"] = r["median_ms"] / floor_ms
            r["x_floor_sustained"] = r["median_ms"] / sustained_floor_ms
            r["extra_mib"] = r.get("peak_mib", math.nan) - grads_mib


# ------------------------------------------------------------------------------------------------ runs
def case_meta(tokens: int, hidden: int, vocab: int, beta: float) -> dict:
    """The columns that name a case's rows."""
    return {"pass": "fwd+bwd", "form": "linear", "beta": beta, "dtype": "bfloat16", "batch": tokens,
            "features": vocab, "hidden": hidden}


def run(device: str, reps: int = 10, sizes: Sequence[tuple[int, int, int]] | None = None,
        betas: Sequence[float] = (0.0, 0.5), check_tokens: int = CHECK_TOKENS,
        matmul_size: int | None = None, on_case: Callable[[list[dict]], None] | None = None,
        sweep_betas: Sequence[float] | None = None,
        done: Callable[[dict], bool] = lambda meta: False) -> list[dict]:
    """Every row of the suite on `device`: per (tokens, hidden, vocabulary) of ``sizes`` (default_sizes) and per
    beta (``betas`` at HEADLINE, ``sweep_betas`` at other sizes: by default SWEEP_BETAS where the sizes are the
    default ones on CUDA, else ``betas``), each provider checked (on the first check_tokens tokens) and timed,
    forward + backward. A case whose columns (case_meta) ``done`` says are held is not run (a resumed run keeps
    its rows). ``on_case`` gets each case's rows as it ends (the CLI saves them, so a sweep cut short keeps
    its finished sizes)."""
    if sweep_betas is None:
        sweep_betas = SWEEP_BETAS if sizes is None and device == "cuda" else betas
    sizes = list(sizes) if sizes is not None else default_sizes(device)
    todo = [(size, [b for b in (betas if size == HEADLINE else sweep_betas) if not done(case_meta(*size, b))])
            for size in map(tuple, sizes)]
    todo = [(size, bs) for size, bs in todo if bs]
    if not todo:
        return []
    matmul_size = matmul_size or (8192 if device == "cuda" else 256)
    tflops = matmul_tflops(device, matmul_size, reps=reps)
    sustained = matmul_tflops_sustained(device, matmul_size, seconds=SUSTAINED_SECONDS if device == "cuda" else 0.05)
    rows: list[dict] = []
    for (tokens, hidden, vocab), case_betas in todo:
        args = make_inputs(tokens, hidden, vocab, device)
        small = tuple(x[:check_tokens] if i in (0, 2, 4) else x for i, x in enumerate(args))
        grads_mib = (tokens * hidden + vocab * hidden) * 2 / 2**20  # the bf16 gradients of hidden and weight
        for beta in case_betas:
            torch._dynamo.reset()  # torch.compile sees each case fresh
            name = f"fwd+bwd linear beta={beta:g} {tokens}x{hidden}x{vocab}"
            meta = case_meta(tokens, hidden, vocab, beta)
            provs = providers(beta, device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # peers' warnings
                checked = harness.check(provs, reference(beta), [harness.Case(name, small, meta)],
                                        tolerance=CHECK_TOLERANCE, setup=_fresh_student)
                timed = harness.bench(provs, [harness.Case(name, args, meta)], checked=checked,
                                      setup=_fresh_student, reps=reps, warmup=3, measure_memory=True)
            case_rows = timed.rename(columns={"provider": "impl"}).to_dict("records")
            _with_floor(case_rows, tokens, hidden, vocab, tflops, grads_mib, sustained)
            mine = next(r for r in case_rows if r["impl"] == OURS)
            if mine["status"] == "ok":
                mine.update(accuracy(small, beta))
            rows += case_rows
            if on_case is not None:
                on_case(case_rows)
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _measured(row: dict, key: str) -> float:
    """row[key], NaN where it is missing or None (a column a CSV row left empty): not measured."""
    value = row.get(key)
    return math.nan if value is None else float(value)


def goal_rows(rows: list[dict], ours: str = OURS) -> list[dict]:
    """LINEAR_GOALS measured in the rows (HEADLINE's shape only): goal, case, target, value, ours_ms, met. Where
    ours failed its check or raised, the goal is NO (goals.untimed); where the peer did, not measured
    (goals.no_peer_time)."""
    from .goals import no_peer_time, pick_row, spread, untimed

    def find(impl, beta):
        return pick_row(rows, lambda r: (r.get("impl") == impl and r.get("form") == "linear"
                                      and float(r.get("beta")) == beta
                                      and (int(r["batch"]), int(r["hidden"]), int(r["features"])) == HEADLINE))

    out = []
    for name, beta, what, peer, bound in LINEAR_GOALS:
        case = f"fwd+bwd linear beta={beta:g} bfloat16 {'x'.join(map(str, HEADLINE))}"
        text = {"speedup": f"{peer} time / ours >= {bound}", "extra_vs_peer": f"extra memory / {peer}'s < {bound}",
                "x_floor": f"time / floor <= {bound}", "extra_mib": f"extra memory (MiB) <= {bound:g}"}.get(
            what, f"{what} <= {bound:g}")
        mine = find(ours, beta)
        if mine is None:
            continue
        if mine.get("status") != "ok":
            out.append(untimed(name, case, text, mine))
            continue
        other = find(peer, beta) if peer else None
        if peer and no_peer_time(out, name, case, text, mine, peer, other):
            continue
        if what == "speedup":
            value = other["median_ms"] / mine["median_ms"]
            ok = value >= bound
        elif what == "extra_vs_peer":
            value = _measured(mine, "extra_mib") / _measured(other, "extra_mib")
            ok = value < bound
        else:
            value = _measured(mine, what)
            ok = value <= bound
        if value != value:  # not measured (NaN): no verdict
            continue
        out.append({"goal": name, "case": case, "target": text, "value": float(value),
                    "ours_ms": mine["median_ms"], "met": bool(ok), "bound": bound,
                    "spread": spread(what, float(value), mine, other)})
    return out
