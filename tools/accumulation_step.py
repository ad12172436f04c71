"""Times a gradient-accumulation step three ways, in one process on one GPU: the plain step (``loss.backward()``),
the loss divided before backward (``(loss / 4).backward()``: backward rescales the fused gradients, a pass over
each), and ``loss_scale=0.25`` (the factor folded into the forward: nothing to rescale). Two cases: forward KL on
bf16 logits 4096 x 128256 (``generalized_jsd``, T = 2, 10% of tokens masked; the suite's fwd+bwd/4 row) and the
fused LM head on hidden 4096 x 4096 with a 128256-row weight (``fused_linear_generalized_jsd``, the teacher as
hidden + weight, beta 0.5; its backward rescales grad hidden and grad weight). Each variant is checked against the
others (the loss and gradients of the three agree up to bf16 rounding) before it is timed: CUDA events around each
step after an L2 flush, ``--reps`` steps (20 unless named) after 3 warm-up steps, median and 20% / 80% quantiles;
``--rounds`` times (2 unless named) over the three in turn (a long step's clocks drift within a call: compare a
round's figures with each other). Prints one JSON line, appended to $OUT/accumulation_step.jsonl when OUT is set.

    python tools/accumulation_step.py [--reps 20] [--rounds 2] [--no-head]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from jsonl_out import emit  # noqa: E402

import kldiv_inline as K  # noqa: E402
from kldiv_inline import timing  # noqa: E402
from kldiv_inline.reference import relative_error  # noqa: E402

STEPS = 4  # micro-batches: the loss is a quarter of the batch's


def variants(loss_fn, leaves):
    """The step's three forms, each returning (loss backward ran on, the leaves' gradients)."""
    def step(scale_kw: dict, divide: int):
        def run():
            for x in leaves:
                x.grad = None
            loss = loss_fn(**scale_kw)
            if divide != 1:
                loss = loss / divide
            loss.backward()
            return loss, [x.grad for x in leaves]
        return run
    return {"plain": step({}, 1), f"loss / {STEPS}": step({}, STEPS),
            f"loss_scale=1/{STEPS}": step({"loss_scale": 1 / STEPS}, 1)}


def measure(name: str, loss_fn, leaves, reps: int, flush, rounds: int = 2) -> dict:
    steps = variants(loss_fn, leaves)
    out: dict = {}
    ref_loss, ref_grads = steps["plain"]()
    ref_loss, ref_grads = float(ref_loss.detach()), [g.clone() for g in ref_grads]
    for label, run in steps.items():
        loss, grads = run()
        factor = 1.0 if label == "plain" else 1 / STEPS
        err = max(relative_error(g.float(), r.float() * factor) for g, r in zip(grads, ref_grads))
        loss_err = abs(float(loss.detach()) - ref_loss * factor) / abs(ref_loss * factor)
        out[label] = {"ms": [], "grad_rel_err": float(f"{err:.3g}"), "loss_rel_err": float(f"{loss_err:.3g}")}
    for r in range(rounds):
        for label, run in steps.items():
            med, q20, q80 = timing.quantiles(timing.time_cuda(run, [()], reps, 3, flush))
            out[label]["ms"].append([round(med, 4), round(q20, 4), round(q80, 4)])
            print(f"{name:20s} round {r} {label:16s} {med:8.4f} ms  [{q20:.4f}, {q80:.4f}]  grad err "
                  f"{out[label]['grad_rel_err']:.2e}", flush=True)
    return out


def main() -> None:
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 20
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2
    dev = "cuda"
    flush = timing.L2Flush(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    tokens, vocab, hidden = 4096, 128256, 4096
    labels = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
    labels[torch.rand(tokens, device=dev, generator=g) < 0.1] = -100
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "commit": os.environ.get("KLDIV_INLINE_COMMIT"), "steps": STEPS}
    s = (torch.randn(tokens, vocab, device=dev, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    t = (torch.randn(tokens, vocab, device=dev, generator=g) * 2).to(torch.bfloat16)
    res["forward KL, logits 4096 x 128256"] = measure(
        "forward KL, logits", lambda **kw: K.generalized_jsd(s, t, temperature=2.0, labels=labels, **kw), [s], reps,
        flush, rounds)
    s = t = None  # (their 2 GiB freed before the head's case)
    if "--no-head" not in sys.argv:
        def weights(rows, cols):
            return (torch.randn(rows, cols, device=dev, generator=g) * cols**-0.5).to(torch.bfloat16)
        h = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
        w = weights(vocab, hidden).requires_grad_()
        th, tw = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16), weights(vocab, hidden)
        res["fused head, JSD, 4096 x 4096 x 128256"] = measure(
            "fused head, JSD", lambda **kw: K.fused_linear_generalized_jsd(h, w, th, tw, beta=0.5, temperature=2.0,
                                                                          labels=labels, **kw), [h, w], reps, flush,
            rounds)
    emit(res, "accumulation_step.jsonl")


if __name__ == "__main__":
    main()
