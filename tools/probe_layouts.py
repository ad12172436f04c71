"""Times the distillation step on rows whose student, teacher and gradient lie at different offsets from the 16-byte
grid (logits sliced out of a padded vocabulary beside contiguous tensors): the fast kernel after copying the rows
that do not share the reference's offsets (kernels/distill.cu, fast_layout) against the general kernel those
calls took before (KLDIV_DISTILL_FAST=0, read on every call), and against contiguous rows of the same size (no copy).
The copies are copy_rows_kernel's (kernels/distill.cu); for comparison, each vocabulary also times PyTorch's copy_
of one tensor of its logits between the two layouts (sliced -> contiguous and back), against its 2-pass floor.

    python tools/probe_layouts.py [--tokens 4096] [--reps 20] [--vocab 50257:50304 151665:151936]

Per vocabulary (V:W, the sliced rows W entries apart), layout and pass (bf16, T = 2, 10% of tokens masked;
fwd+bwd at beta 0 and 0.5, forward alone at beta 0): the median of CUDA-event timings in ms and its ratio to the
floor (read both logit tensors and write the gradient, or read both for the forward, at the read bandwidth measured
at the start), the kernels each took (fast or general), and the loss's largest relative difference between the
two paths. One JSON line a case (to $OUT/layouts.jsonl when OUT is set), a table last.
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fast_and_general import by_both_paths  # noqa: E402
from jsonl_out import emit  # noqa: E402

import kldiv_inline as K  # noqa: E402
from kldiv_inline import timing  # noqa: E402
from kldiv_inline.floors import measure_floor  # noqa: E402

LAYOUTS = {  # (student sliced, teacher sliced): the gradient is always the op's own, contiguous
    "contiguous": (False, False),
    "both_sliced": (True, True),  # no copy: the gradient's rows lie as the student's (grad_like_rows)
    "teacher_sliced": (False, True),  # the teacher copied onto the student's offsets
    "student_sliced": (True, False),  # the teacher copied onto the student's (and gradient's) offsets
}


def time_cases(s, t, lab, reps, floor, base) -> list[dict]:
    """The three passes on one layout, each by the new path and by the general kernel."""
    out = []
    s.requires_grad_()  # (a leaf: a slice of a tensor that needs no gradient, or one that is whole)
    for beta, grad in ((0.0, True), (0.5, True), (0.0, False)):
        kw = dict(beta=beta, temperature=2.0, labels=lab)

        def step(kw=kw, grad=grad):
            if grad:
                loss = K.generalized_jsd(s, t, **kw)
                return loss, torch.autograd.grad(loss, [s])[0]
            with torch.no_grad():
                return K.generalized_jsd(s, t, **kw), None

        nbytes = s.element_size() * s.numel() * (3 if grad else 2)
        rec = dict(base, beta=beta, **{"pass": "fwd+bwd" if grad else "fwd"}, floor_ms=floor.ms(nbytes))
        losses = {}
        for path, (took, result, ms) in by_both_paths(step, reps).items():
            losses[path] = result[0].double()
            rec[f"{path}_ms"], rec[f"{path}_kernel"] = ms, took
            rec[f"{path}_x_floor"] = ms / rec["floor_ms"]
        rec["loss_rel_diff"] = float(((losses["new"] - losses["general"]).abs() / losses["general"].abs()).max())
        emit(rec, "layouts.jsonl")
        out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--vocab", nargs="+", default=["50257:50304", "151665:151936"])
    a = ap.parse_args()
    dev = "cuda"
    floor = measure_floor(dev)
    name = torch.cuda.get_device_name()
    rows, copies = [], []
    for spec in a.vocab:
        v, w = (int(x) for x in spec.split(":"))
        n = a.tokens
        gen = torch.Generator(device=dev).manual_seed(0)
        lab = torch.randint(0, v, (n,), device=dev, generator=gen)
        lab[torch.rand(n, device=dev, generator=gen) < 0.1] = -100
        padded = torch.randn(n, w, device=dev, generator=gen).to(torch.bfloat16)
        whole = torch.empty(n, v, device=dev, dtype=torch.bfloat16)
        for direction, (dst, src) in {"sliced->contiguous": (whole, padded[:, :v]),
                                      "contiguous->sliced": (padded[:, :v], whole)}.items():
            ms = statistics.median(timing.time_cuda(lambda d=dst, s=src: d.copy_(s), [()], a.reps, 3))
            emit(dict(card=name, vocab=v, width=w, tokens=n, torch_copy=direction, ms=ms,
                      x_floor=ms / floor.ms(2 * whole.numel() * whole.element_size())), "layouts.jsonl")
            copies.append((v, w, direction, ms, ms / floor.ms(2 * whole.numel() * whole.element_size())))
        del padded, whole
        for layout, sliced in LAYOUTS.items():
            s, t = (torch.randn(n, w if cut else v, device=dev, generator=gen).mul_(2.0).to(torch.bfloat16)
                    for cut in sliced)
            s, t = (x[:, :v] if cut else x for x, cut in zip((s, t), sliced))
            base = dict(card=name, torch=torch.__version__, vocab=v, width=w, tokens=n, layout=layout,
                        floor_gbps=floor.gbps)
            rows += time_cases(s, t, lab, a.reps, floor, base)
    print(f"\n{name}, torch {torch.__version__}, floor {floor.gbps:.0f} GB/s, {a.tokens} tokens, bf16, T = 2")
    print(f"{'V:W':>14} {'layout':>15} {'beta':>4} {'pass':>7} {'new ms':>8} {'x floor':>7} {'general':>8} "
          f"{'x floor':>7} {'gen/new':>7} kernels")
    for r in rows:
        print(f"{r['vocab']:>7}:{r['width']:<6} {r['layout']:>15} {r['beta']:>4} {r['pass']:>7} {r['new_ms']:8.3f} "
              f"{r['new_x_floor']:7.2f} {r['general_ms']:8.3f} {r['general_x_floor']:7.2f} "
              f"{r['general_ms'] / r['new_ms']:7.2f} {r['new_kernel']}/{r['general_kernel']}")
    for v, w, direction, ms, xf in copies:
        print(f"{v:>7}:{w:<6} PyTorch's copy_ of one tensor, {direction}: {ms:.3f} ms = {xf:.2f} x its floor")


if __name__ == "__main__":
    main()
