"""Times the distillation step with the teacher's gradient too (self-distillation: both logit tensors require grad)
by the fast kernels (kernels/distill.cu, distill_forward: the teacher's gradient as the student gradient of the
same divergence with the rows exchanged and beta -> 1 - beta, a second launch) against the general kernel such
calls took before (rows_kernel's generic instance; KLDIV_DISTILL_FAST=0, read on every call), and against the
step with the student's gradient alone.

    python tools/probe_teacher_grad.py [--tokens 4096] [--reps 20] [--vocab 128256 50257]

Per vocabulary and beta (0, 0.5, 1; bf16 logits, T = 2, 10% of tokens masked): the median of CUDA-event timings
in ms of each step and its ratio to its floor (read both logit tensors and write both gradients: 4 tensors; the
student's alone: 3) at the read bandwidth measured at the start, the kernels each took (fast or general), and the
largest relative difference between the two paths of the rows' losses and of the teacher's gradient (over the
whole tensor, relative to its largest entry). One JSON line a case (to $OUT/teacher_grad.jsonl when OUT is set),
a table last.
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


def time_vocab(v, n, reps, floor, name) -> list[dict]:
    """Each beta's record on rows of v entries."""
    dev = "cuda"
    out = []
    gen = torch.Generator(device=dev).manual_seed(0)
    lab = torch.randint(0, v, (n,), device=dev, generator=gen)
    lab[torch.rand(n, device=dev, generator=gen) < 0.1] = -100
    s, t = (torch.randn(n, v, device=dev, generator=gen).mul_(2.0).to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    tensor_bytes = s.numel() * s.element_size()
    for beta in (0.0, 0.5, 1.0):
        kw = dict(beta=beta, temperature=2.0, labels=lab, reduction="none")

        def both(kw=kw):
            loss = K.generalized_jsd(s, t, **kw)
            return (loss, *torch.autograd.grad(loss.sum(), [s, t]))

        def student(kw=kw):
            loss = K.generalized_jsd(s, t.detach(), **kw)
            return (loss, *torch.autograd.grad(loss.sum(), [s]))

        rec = dict(card=name, torch=torch.__version__, vocab=v, tokens=n, beta=beta, floor_gbps=floor.gbps,
                   floor_ms=floor.ms(4 * tensor_bytes), student_floor_ms=floor.ms(3 * tensor_bytes))
        results = {}
        for path, (took, result, ms) in by_both_paths(both, reps).items():
            results[path] = [x.detach().double() for x in result]
            rec[f"{path}_kernel"], rec[f"{path}_ms"] = took, ms
            rec[f"{path}_x_floor"] = ms / rec["floor_ms"]
        rec["student_only_ms"] = statistics.median(timing.time_cuda(lambda: student(), [()], reps, 3))
        rec["student_only_x_floor"] = rec["student_only_ms"] / rec["student_floor_ms"]
        (ln, _, gtn), (lg, _, gtg) = results["new"], results["general"]
        kept = lab != -100
        rec["loss_rel_diff"] = float(((ln - lg).abs() / lg.abs())[kept].max())
        rec["teacher_grad_rel_diff"] = float((gtn - gtg).abs().max() / gtg.abs().max())
        emit(rec, "teacher_grad.jsonl")
        out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--vocab", type=int, nargs="+", default=[128256, 50257])
    a = ap.parse_args()
    dev = "cuda"
    floor = measure_floor(dev)
    name = torch.cuda.get_device_name()
    rows = [rec for v in a.vocab for rec in time_vocab(v, a.tokens, a.reps, floor, name)]
    print(f"\n{name}, torch {torch.__version__}, floor {floor.gbps:.0f} GB/s, {a.tokens} tokens, bf16, T = 2")
    print(f"{'V':>7} {'beta':>4} {'new ms':>8} {'x floor':>7} {'general':>8} {'x floor':>7} {'gen/new':>7} "
          f"{'student':>8} {'x floor':>7} {'loss diff':>9} {'gt diff':>8} kernels")
    for r in rows:
        print(f"{r['vocab']:>7} {r['beta']:>4} {r['new_ms']:8.3f} {r['new_x_floor']:7.2f} {r['general_ms']:8.3f} "
              f"{r['general_x_floor']:7.2f} {r['general_ms'] / r['new_ms']:7.2f} {r['student_only_ms']:8.3f} "
              f"{r['student_only_x_floor']:7.2f} {r['loss_rel_diff']:9.1e} {r['teacher_grad_rel_diff']:8.1e} "
              f"{r['new_kernel']}/{r['general_kernel']}")


if __name__ == "__main__":
    main()
