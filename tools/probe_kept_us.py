"""The JSD's bfloat16 training gradients on a GPU against float64, for several kernels/ trees on the same draws:
the measurement behind kJsdKeptUsOffset (kernels/distill_fast.cuh) and the bound of
tests/test_distill.py::test_training_rows_with_offsets_far_from_zero. tools/emulate_kept_us.py is its CPU emulation.

    python tools/probe_kept_us.py kernels /tmp/on/kernels [--draws 8] [--seed 0]

Rows: bfloat16 logits of 50001 entries (on the 16-byte grid: the fast kernels), the kinds of emulate_kept_us.py
(student and teacher independent draws of spread 3 at the test's offsets; students drawn around the teacher), each
kind ``--draws`` times in one batch. For each tree (a process of its own, through KLDIV_INLINE_KERNELS) the
extension's distill_forward with the student's gradient, reduction none, beta 0.5, 0.9 and 0.1; each row's
gradient error as the test measures it (the norm of the part beyond float16/bfloat16's subnormal spacing over the
float64 gradient's norm), the largest of a kind's draws; beside it bfloat16's own rounding of the exact gradient
(the floor of any bfloat16 gradient). Checks nothing: prints the table.
"""
import argparse
import json
import os
import subprocess
import sys

BETAS = (0.5, 0.9, 0.1)
VOCAB = 50001
DEV = os.environ.get("PROBE_DEVICE", "cuda")  # (cpu: the CPU twin, a smoke test of this script)


def kinds(draw):
    """name: a function that makes one (student, teacher) pair of float64 logits."""
    return {
        "independent 130/130": lambda: (draw(130), draw(130)),
        "independent 130/400": lambda: (draw(130), draw(400)),
        "independent -400/-400": lambda: (draw(-400), draw(-400)),
        "independent 400/400": lambda: (draw(400), draw(400)),
        "near (t + 0.5 N)": lambda: (lambda t: (t + 0.5 * draw(0) / 3.0, t))(draw(0)),
        "apart (t + 1.5 N)": lambda: (lambda t: (t + 1.5 * draw(0) / 3.0, t))(draw(0)),
        "apart (t + 3 N)": lambda: (lambda t: (t + draw(0), t))(draw(0)),
    }


def child(draws: int, seed: int) -> None:
    """One tree (KLDIV_INLINE_KERNELS): prints one JSON line {kind|beta: [kernel error, bf16 floor]}."""
    import torch

    import kldiv_inline as K
    from kldiv_inline.reference import generalized_jsd_reference

    g = torch.Generator().manual_seed(seed)

    def draw(shift):
        return torch.randn(VOCAB, dtype=torch.float64, generator=g) * 3.0 + shift

    made = kinds(draw)
    names = [name for name in made for _ in range(draws)]
    pairs = [made[name]() for name in names]
    width = VOCAB + (-VOCAB) % 8
    n = len(pairs)
    s = torch.zeros(n, width, dtype=torch.bfloat16, device=DEV)
    t = torch.zeros(n, width, dtype=torch.bfloat16, device=DEV)
    for i, (a, b) in enumerate(pairs):
        s[i, :VOCAB], t[i, :VOCAB] = a.to(torch.bfloat16), b.to(torch.bfloat16)
    s, t = s[:, :VOCAB], t[:, :VOCAB]
    lab = torch.zeros(n, dtype=torch.long, device=DEV)
    mod = K.load(DEV, extension="distill")
    tiny = torch.finfo(torch.bfloat16).smallest_normal * torch.finfo(torch.bfloat16).eps
    out = {}
    for beta in BETAS:
        gs = torch.full((n, width), float("nan"), dtype=torch.bfloat16, device=DEV)[:, :VOCAB]
        gs = mod.distill_forward(s, t, None, None, lab, -100, beta, 1.0, 0, True, False, gs)[1]
        s64 = s.double().requires_grad_()
        loss = generalized_jsd_reference(s64, t.double(), beta=beta, labels=lab, reduction="none")
        (ref,) = torch.autograd.grad(loss.sum(), s64)
        for i, name in enumerate(names):
            r = ref[i]
            err = float(((gs[i].double() - r).abs() - tiny).clamp(min=0).norm() / r.norm())
            floor = float((r.to(torch.bfloat16).double() - r).norm() / r.norm())
            key = f"{name}|{beta:g}"
            old = out.get(key, [0.0, 0.0])
            out[key] = [max(old[0], err), max(old[1], floor)]
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", help="kernels/ folders (none: the tree KLDIV_INLINE_KERNELS names)")
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child or not args.trees:
        child(args.draws, args.seed)
        return
    results = []
    for tree in args.trees:
        env = dict(os.environ, KLDIV_INLINE_KERNELS=os.path.abspath(tree))
        done = subprocess.run([sys.executable, __file__, "--child", "--draws", str(args.draws), "--seed",
                               str(args.seed)], env=env, capture_output=True, text=True)
        if done.returncode:  # (the child's reason: a build error in the tree, no GPU, out of memory)
            sys.exit(f"{tree}: {done.stderr[-2000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'rows':24s} {'beta':>4s} " + " ".join(f"{'tree ' + str(i):>9s}" for i in range(len(args.trees)))
          + f" {'bf16':>9s}   (gradient's error, largest of {args.draws} draws)")
    for key in results[0]:
        name, beta = key.split("|")
        print(f"{name:24s} {beta:>4s} " + " ".join(f"{r[key][0]:9.2e}" for r in results)
              + f" {max(r[key][1] for r in results):9.2e}")
    for i, tree in enumerate(args.trees):
        print(f"tree {i}: {tree}")


if __name__ == "__main__":
    main()
