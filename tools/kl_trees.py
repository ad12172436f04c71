"""Times the KL op's kernels of several kernels/ trees against each other on one GPU, in one call (as
tools/distill_trees.py does for the distillation kernels): the probability form's forward and training step at
16384 x 16384 float32 (P1, P3) and the bf16 log-probability forward at 4096 x 128256 (P2), the bench's inputs.

    git archive HEAD~1 kernels | tar -x -C /tmp/old
    python tools/kl_trees.py /tmp/old/kernels kernels [--rounds 2] [--reps 20]

Each tree is built first, all at once (one process each, through KLDIV_INLINE_KERNELS), then timed in a process of
its own, the trees alternating for ``--rounds`` rounds. Prints each case's medians (ms) per tree and the read
floor of the bench's Floor (bytes / the best read bandwidth measured in that process). Checks nothing: run
`pytest -m gpu tests/test_ops.py tests/test_ops_reliability.py` for that.
"""
import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(reps: int) -> None:
    import torch

    from kldiv_inline import timing
    from kldiv_inline.bench import Case, make_inputs
    from kldiv_inline.ops import kl_div, kl_div_from_probs

    cases = [("P1 fwd probs float32", Case("probs", torch.float32, 16384, 16384, ("fwd",), "cuda"), False),
             ("P3 fwd+bwd probs float32", Case("probs", torch.float32, 16384, 16384, ("fwd+bwd",), "cuda"), True),
             ("P2 fwd logprobs bfloat16", Case("logprobs", torch.bfloat16, 4096, 128256, ("fwd",), "cuda"), False)]
    x = torch.rand(1 << 28, device="cuda")
    read_gbps = (1 << 30) / statistics.median(timing.time_cuda(x.sum, [()], 20, 3)) / 1e6
    del x
    for name, case, train in cases:
        p, t = make_inputs(case, "cuda")
        if case.form == "probs":
            def fwd(p=p, t=t):
                return kl_div_from_probs(p, t, reduction="batchmean")
        else:
            def fwd(p=p, t=t):
                return kl_div(p, t, reduction="batchmean")
        fn = fwd
        if train:
            leaf = p.detach().requires_grad_()

            def fn(leaf=leaf, t=t):
                leaf.grad = None
                kl_div_from_probs(leaf, t, reduction="batchmean").backward()
        ms = statistics.median(timing.time_cuda(fn, [()], reps, 3))
        tensors = 3 if train else 2
        floor = tensors * p.numel() * p.element_size() / read_gbps / 1e6
        print(f"{name} {ms:.4f} {floor:.4f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.reps)
        return
    envs = [{**os.environ, "KLDIV_INLINE_KERNELS": str(tree.resolve())} for tree in args.trees]
    build = "import torch, kldiv_inline.ops as o; o._module(torch.device('cuda'))"
    for proc in [subprocess.Popen([sys.executable, "-c", build], env=env, cwd=ROOT) for env in envs]:
        if proc.wait():
            sys.exit("a tree failed to build")
    import torch
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    times: dict[str, list[list[float]]] = {}
    floors: dict[str, float] = {}
    for _ in range(args.rounds):
        for k, env in enumerate(envs):
            out = subprocess.run([sys.executable, __file__, "--child", "--reps", str(args.reps), "x"], env=env,
                                 cwd=ROOT, check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                *name, ms, floor = line.split()
                key = " ".join(name)
                times.setdefault(key, [[] for _ in envs])[k].append(float(ms))
                floors[key] = float(floor)
    print(f"{'case':<28}" + "".join(f"{str(t):>26}" for t in args.trees) + "   last / first   floor")
    for key, per_tree in times.items():
        cols = "".join(f"{' / '.join(f'{v:.4f}' for v in ms):>26}" for ms in per_tree)
        change = statistics.median(per_tree[-1]) / statistics.median(per_tree[0]) - 1
        print(f"{key:<28}{cols}   {change:+.1%}   {floors[key]:.4f}")


if __name__ == "__main__":
    main()
