"""Whether kernels/ trees give the same bits: the extension's distill_forward on the same inputs in each tree's
own process (KLDIV_INLINE_KERNELS, as tools/distill_trees.py has it), the losses and gradients compared by their
SHA-256. For a change meant to leave the results as they were (a value kept where it was formed again).

    python tools/trees_agree.py OLD_KERNELS NEW_KERNELS [--dtype float32] [--vocab 128256 50257 1000] [--rows 256]

Cases per vocabulary: betas 0, 0.1, 0.5, 0.9 and 1, the student's gradient (reduction none, T = 2, ~10% of rows
masked), on rows of spread 2 and on rows that nearly agree (the student the teacher plus 0.01 x noise: the JSD's
series region), the same draws in every tree. Prints one row per case: identical, or which outputs differ (and
by how much at most, from the outputs' sums). Needs a GPU.
"""
import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

from tree_timing import build, tree_env

BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)


def child(dtype_name: str, vocabs: list[int], rows: int) -> None:
    """Prints `case loss-hash grad-hash loss-sum grad-abs-sum` lines for the tree KLDIV_INLINE_KERNELS names."""
    import torch

    import kldiv_inline as K

    mod = K.load("cuda", extension="distill")
    dtype = getattr(torch, dtype_name)

    def digest(x) -> str:
        return hashlib.sha256(x.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]

    for v in vocabs:
        g = torch.Generator(device="cuda").manual_seed(v)
        t = torch.randn(rows, v, device="cuda", generator=g) * 2
        far = (torch.randn(rows, v, device="cuda", generator=g) * 2).to(dtype)
        near = (t + 0.01 * torch.randn(rows, v, device="cuda", generator=g)).to(dtype)
        t = t.to(dtype)
        lab = torch.randint(0, v, (rows,), device="cuda", generator=g)
        lab[torch.rand(rows, device="cuda", generator=g) < 0.1] = -100
        for kind, s in (("far", far), ("near", near)):
            for beta in BETAS:
                loss, gs, _ = mod.distill_forward(s, t, None, None, lab, -100, beta, 2.0, 0, True, False)
                torch.cuda.synchronize()
                print(f"V={v} {kind} beta={beta:g} {digest(loss)} {digest(gs)} {float(loss.double().sum()):.9e} "
                      f"{float(gs.double().abs().sum()):.9e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", type=Path, help="kernels/ directories (the first is the baseline)")
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--vocab", type=int, nargs="+", default=[128256, 50257, 1000])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.dtype, args.vocab, args.rows)
        return
    if len(args.trees) < 2:
        ap.error("name two kernels/ directories or more")
    build(args.trees, "import kldiv_inline as K; K.load('cuda', extension='distill')")
    cmd = [sys.executable, __file__, "--child", "--dtype", args.dtype, "--rows", str(args.rows), "--vocab",
           *(str(v) for v in args.vocab)]
    runs = []
    for tree in args.trees:
        out = subprocess.run(cmd, env=tree_env(tree), capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{tree}: {out.stderr[-2000:]}")
        runs.append({" ".join(line.split()[:3]): line.split()[3:] for line in out.stdout.splitlines() if line})
    import torch

    print(torch.cuda.get_device_name(), torch.__version__, f"{args.dtype}, {args.rows} rows")
    base = runs[0]
    for case, (lh, gh, ls, gsum) in base.items():
        verdicts = []
        for other in runs[1:]:
            olh, ogh, ols, ogs = other[case]
            if (olh, ogh) == (lh, gh):
                verdicts.append("identical")
            else:
                what = [w for w, a, b in (("loss", lh, olh), ("grad", gh, ogh)) if a != b]
                verdicts.append(f"DIFFER in {' and '.join(what)} (loss sum {ls} -> {ols}, |grad| sum {gsum} -> {ogs})")
        print(f"{case:28s} {'; '.join(verdicts)}")


if __name__ == "__main__":
    main()
