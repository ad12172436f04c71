"""The distillation suite: ``generalized_jsd`` against the peers on logits, through the harness.

Cases (CUDA): bfloat16 logits 4096 x 128256 (Llama 3's vocabulary), T = 2, 10% of the tokens masked. Forms:
``logits`` (student and teacher logits; forward + backward w.r.t. the student, and forward only) and ``topk``
(a served teacher's k = 100 log-probabilities). Peers: the TRL-style PyTorch loss (``peers.trl_generalized_jsd``)
eager and under torch.compile, and Liger-Kernel's JSD on log-probabilities made by PyTorch's log_softmax first,
as its users call it (when installed). Every provider is checked against the float64 reference
(``reference.generalized_jsd_reference``: the loss, and the student's gradient for fwd+bwd) on the first rows of
the case, then timed (``harness.bench``, with the peak memory a call allocates beyond its inputs). On the CPU the
same cases run at a small size (the CPU twin).

One more row, ``fwd+bwd/4``: forward KL's training step for gradient accumulation over 4 micro-batches, i.e. the
loss a quarter of fwd+bwd's, each provider as its users write it: the peers divide the loss by 4 before backward
(torch.compile folds the factor into its backward), the kit is given ``loss_scale=0.25``, which its forward folds
into the gradient it writes (dividing its loss instead costs one more read and write of the gradient in backward:
``tools/scale_pass.py`` times that pass). Its floor is fwd+bwd's.

Floors: fwd+bwd reads both logit tensors and writes the student's gradient once (3 tensors); fwd reads both
(2); topk reads the student's logits and writes their gradient (2; the top-k pair, int64 indices and float32
log-probabilities, is 0.23% of that at k = 100). These are
the goals' floors (``bytes``, ``x_floor``). A masked token's logits need not be read at all (its loss is 0 and its
gradient zeros, written), and the kernels do not read them, so each row also has the floor of the bytes that must
move (``moved_bytes``, ``x_floor_moved``: the unmasked rows' reads and every write), which no honest time beats.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from . import floors, harness
from .distill import generalized_jsd
from .peers import liger_generalized_jsd, trl_generalized_jsd
from .reference import generalized_jsd_reference

OURS = "kldiv_inline"
TEMPERATURE = 2.0
MASKED = 0.10       # share of tokens whose label is ignore_index
TOPK = 100
CHECK_ROWS = 256    # rows of a case checked against float64 (the whole case's float64 copies would need ~40 GiB)
ACCUMULATION = 4    # the micro-batches of the gradient-accumulation row: its loss is fwd+bwd's / this
ACCUMULATED = f"fwd+bwd/{ACCUMULATION}"  # that row's pass


def sizes(device: str) -> tuple[int, int]:
    """(tokens, vocabulary) of the suite's cases."""
    return (4096, 128256) if device == "cuda" else (64, 4096)


def make_inputs(tokens: int, vocab: int, device: str, seed: int | None = None):
    """Student and teacher logits (bf16, like an LM head's), labels with MASKED of them ignore_index, and the
    teacher's top-k log-probabilities (float32, as a server returns them). Without a seed, one is drawn from
    torch's global generator, so a caller (a test) that seeds torch replays the inputs."""
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(2**62, ())) if seed is None else seed)
    s = (torch.randn(tokens, vocab, device=device, generator=g) * 2).to(torch.bfloat16)
    t = (torch.randn(tokens, vocab, device=device, generator=g) * 2).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    labels[torch.rand(tokens, device=device, generator=g) < MASKED] = -100
    lp, idx = torch.log_softmax(t.float(), dim=-1).topk(min(TOPK, vocab), dim=-1)
    return s, t, labels, idx, lp


# ------------------------------------------------------------------------------------------- providers
def _step(loss_fn: Callable, divide: int = 1) -> Callable:
    """A training step: loss / divide and its gradient w.r.t. the student logits (the student is a leaf that
    requires grad). ``divide`` > 1: gradient accumulation's scaled loss (backward gets grad_output 1 / divide)."""
    def run(s, *rest):
        s.grad = None
        loss = loss_fn(s, *rest)
        if divide != 1:
            loss = loss / divide
        loss.backward()
        return loss, s.grad
    return run


def _training(pass_: str) -> int:
    """0 for a forward-only pass, else the divisor of the loss before backward (1 for fwd+bwd)."""
    return {"fwd": 0, "fwd+bwd": 1, ACCUMULATED: ACCUMULATION}[pass_]


def _fresh_student(s, *rest):
    """harness setup for fwd+bwd: a new leaf each call (outside the timed region), so no gradient accumulates."""
    return (s.detach().requires_grad_(), *rest)


def logits_providers(beta: float, pass_: str, device: str) -> dict[str, Callable | None]:
    divide = _training(pass_)
    scale = 1.0 / divide if divide > 1 else 1.0  # the kit's loss_scale: the accumulation's divisor, folded

    def ours(s, t, y):
        return generalized_jsd(s, t, beta=beta, temperature=TEMPERATURE, labels=y, loss_scale=scale)

    def trl(s, t, y):
        return trl_generalized_jsd(s, t, y, beta=beta, temperature=TEMPERATURE)

    out: dict[str, Callable | None] = {OURS: ours, "torch_eager": trl}
    if device == "cuda":
        out["torch_compile"] = torch.compile(trl, dynamic=False)
        liger = liger_generalized_jsd()
        out["liger"] = liger and (lambda s, t, y: liger(s, t, y, beta=beta, temperature=TEMPERATURE))
    return {k: (_step(f, 1 if k == OURS else divide) if f and divide else f) for k, f in out.items()}


def logits_reference(beta: float, pass_: str) -> Callable:
    def ref(s, t, y):
        return generalized_jsd_reference(s, t, beta=beta, temperature=TEMPERATURE, labels=y)
    divide = _training(pass_)
    return _step(ref, divide) if divide else ref


def topk_providers(beta: float) -> dict[str, Callable]:
    def ours(s, idx, lp, y):
        return generalized_jsd(s, teacher_topk=(idx, lp), beta=beta, temperature=TEMPERATURE, labels=y)
    return {OURS: _step(ours)}


def topk_reference(beta: float) -> Callable:
    def ref(s, idx, lp, y):
        return generalized_jsd_reference(s, teacher_topk=(idx, lp), beta=beta, temperature=TEMPERATURE, labels=y)
    return _step(ref)


# ------------------------------------------------------------------------------------------------ runs
def _rows(timed, meta_defaults: dict) -> list[dict]:
    return [{**meta_defaults, **r} for r in timed.rename(columns={"provider": "impl"}).to_dict("records")]


def _run(providers, reference, case: harness.Case, check_case: harness.Case, nbytes: int, moved: int, floor,
         reps: int, setup=None, inference: bool = False) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peers' warnings
        checked = harness.check(providers, reference, [check_case], setup=setup)
        timed = harness.bench(providers, [case], checked=checked, bytes_moved=lambda *_: nbytes, setup=setup,
                              reps=reps, warmup=3, floor=floor, measure_memory=True, inference_mode=inference)
    rows = _rows(timed, {"moved_bytes": moved})
    for r in rows:  # the floor of the bytes that must move, at the same bandwidth as x_floor's
        if r.get("x_floor") is not None and r["x_floor"] == r["x_floor"]:
            r["x_floor_moved"] = r["x_floor"] * nbytes / moved
    return rows


def run(device: str, floor: floors.Floor, reps: int = 10, betas=(0.0, 0.5, 1.0),
        on_case: Callable[[list[dict]], None] | None = None,
        done: Callable[[dict], bool] = lambda meta: False) -> list[dict]:
    """Every row of the suite on `device`: logits fwd+bwd per beta, logits fwd for beta 0 and 0.5, topk fwd+bwd,
    and forward KL's step with its loss scaled by 1 / ACCUMULATION (pass ACCUMULATED: the peers divide the loss,
    the kit takes loss_scale). ``on_case`` gets each case's rows as it ends (the CLI saves them, so a run cut
    short keeps its finished cases); a case whose columns (its ``meta``) ``done`` says are held is not run (a
    resumed run keeps its rows)."""
    tokens, vocab = sizes(device)
    s, t, y, idx, lp = make_inputs(tokens, vocab, device)
    n = CHECK_ROWS
    tensor_bytes = s.numel() * s.element_size()
    unmasked_bytes = int((y != -100).sum()) * vocab * s.element_size()  # (the rows whose logits must be read)
    base = {"dtype": "bfloat16", "batch": tokens, "features": vocab}
    rows = []

    def finished(case_rows: list[dict]) -> None:
        rows.extend(case_rows)
        if on_case is not None:
            on_case(case_rows)

    cases = [(beta, pass_) for beta in betas for pass_ in ("fwd+bwd", "fwd") if not (pass_ == "fwd" and beta == 1.0)]
    for beta, pass_ in cases + [(0.0, ACCUMULATED)]:
        torch._dynamo.reset()  # torch.compile sees each case fresh
        training = _training(pass_) > 0
        meta = {**base, "pass": pass_, "form": "logits", "beta": beta}
        if done(meta):
            continue
        name = f"{pass_} logits beta={beta:g} {tokens}x{vocab}"
        setup = _fresh_student if training else None
        case = harness.Case(name, (s, t, y), meta)
        small = harness.Case(name, (s[:n], t[:n], y[:n]), meta)
        nbytes = (3 if training else 2) * tensor_bytes
        moved = 2 * unmasked_bytes + (tensor_bytes if training else 0)
        finished(_run(logits_providers(beta, pass_, device), logits_reference(beta, pass_), case, small, nbytes,
                      moved, floor, reps, setup, inference=not training))
    meta = {**base, "pass": "fwd+bwd", "form": "topk", "beta": 0.0}
    if done(meta):
        return rows
    name = f"fwd+bwd topk{idx.shape[-1]} beta=0 {tokens}x{vocab}"
    case = harness.Case(name, (s, idx, lp, y), meta)
    small = harness.Case(name, (s[:n], idx[:n], lp[:n], y[:n]), meta)
    finished(_run(topk_providers(0.0), topk_reference(0.0), case, small, 2 * tensor_bytes,
                  unmasked_bytes + tensor_bytes, floor, reps, _fresh_student))
    return rows
