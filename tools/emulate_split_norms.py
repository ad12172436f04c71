"""A CPU emulation of the vocabulary split's float32 normalisers (kernels/distill_fast.cuh's phase_norms_kernel:
256 threads, 4 chunks of 4 logits a thread an iteration, a running maximum, the warp's xor tree, the warps in
order; then the ranks' float64 combination) and of what their rounding does to the JSD's student gradient (beta
0.5), all else exact: the gradient formed in float64 from the kernel's float32 points, (x k2 - max) - lz.

    python tools/emulate_split_norms.py            # ~15 s, no GPU

Rows of tools/probe_split_accuracy.py's trials (the same draws) that the split measured worst on two H200s (at
22921b3, student gradient against float64: trial 10 rows 29 / 21 4.7e-5 / 3.1e-5, trial 20 rows 30 / 16 1.5e-4 /
1.1e-4, trial 9 rows 1 / 9 2.0e-5 / 2.0e-5, trial 13 rows 9 / 23 5.3e-5 / 1.2e-5; the one process 1.6e-6 to 1.4e-4),
each with the threads' sums in float (the kernel) and as kNormDoubleSums sums them (each call's 16 terms in float,
added to a double, the thread's total rounded to float before the combination). Prints each row's gradient error and
how far the emulated probabilities' sum is from 1. What it showed (kernels/NOTES.md, version 36): the float sums
reproduce the measured errors within 2.7 x (4.9e-5, 2.2e-5, 1.6e-4, 2.9e-4, 2.0e-5, 2.0e-5, 2.0e-5, 1.3e-5; the
GPU's ex2.approx errors are not emulated), the row's
probabilities summing to 1 +- ~1e-6; the double sums bring them to 5e-6, 2e-6, 6e-6, 1.3e-4, 7e-7, 9e-6, 2e-5,
1.3e-5 (the rows left are the float32 normaliser's own rounding, which the one process has too).
"""
import numpy as np
import torch

F32 = np.float32
THREADS, UNROLL, N = 256, 4, 4  # kNormThreads, kNormUnroll, float32 logits a 16-byte chunk
VOCAB, WIDTHS, ROWS = 128256, (100000, 28256), 33
CASES = ((10, (29, 21)), (20, (30, 16)), (9, (1, 9)), (13, (9, 23)))


def exp2f(x):
    return np.exp2(np.float64(x)).astype(F32)


def point(v, k2, o):  # x k2 - o as the kernel's fused multiply-add: the product exact, one rounding
    return F32(np.float64(v) * np.float64(k2) - np.float64(o))


def thread_sums(x, k2, double):
    """Each thread's (largest raw logit, sum of 2^(x k2 - max k2)) as running_norm forms it."""
    chunks = x.size // N
    xc = x[:chunks * N].reshape(chunks, N)
    out = []
    for tid in range(THREADS):
        mr, acc = -np.inf, (0.0 if double else F32(0))
        for c0 in range(tid, chunks, THREADS * UNROLL):
            vals = xc[[c for c in range(c0, c0 + UNROLL * THREADS, THREADS) if c < chunks]].reshape(-1)
            g = vals.max()
            if g > mr:
                if acc != 0:
                    f = exp2f(F32((F32(mr) - F32(g)) * k2))
                    acc = acc * np.float64(f) if double else F32(acc * f)
                mr = g
            o = F32(F32(mr) * k2)
            if double:
                part = F32(0)
                for v in vals:
                    part = F32(part + exp2f(point(v, k2, o)))
                acc = acc + np.float64(part)
            else:
                for v in vals:
                    acc = F32(acc + exp2f(point(v, k2, o)))
        out.append((mr, F32(acc)))
    return out


def combine(m, s, m2, s2, k2):  # combine_pair
    g = max(m, m2)
    a = F32(0) if s == 0 else F32(s * exp2f(F32((F32(m) - F32(g)) * k2)))
    b = F32(0) if s2 == 0 else F32(s2 * exp2f(F32((F32(m2) - F32(g)) * k2)))
    return g, F32(a + b)


def slice_norm(x, k2, double):
    lanes_all = thread_sums(x, k2, double)
    warps = []
    for w in range(THREADS // 32):
        lanes = lanes_all[w * 32:(w + 1) * 32]
        for o in (16, 8, 4, 2, 1):
            lanes = [combine(*lanes[i], *lanes[i ^ o], k2) for i in range(32)]
        warps.append(lanes[0])
    m, s = warps[0]
    for w in warps[1:]:
        m, s = combine(m, s, *w, k2)
    return np.float64(F32(F32(m) * k2)), np.float64(F32(np.log2(np.float64(s))))


def split_norm(x, k2, double):  # the ranks' (max, log2 sum) combined in float64, rounded to float
    parts, lo = [], 0
    for w in WIDTHS:
        parts.append(slice_norm(x[lo:lo + w], k2, double))
        lo += w
    top = max(p[0] for p in parts)
    return top, np.float64(F32(np.log2(sum(np.exp2(p[1] + p[0] - top) for p in parts))))


def grad_error(s, t, k2, ns, nt):
    """The JSD student gradient from points under normalisers ns, nt, against exact normalisers; and sum ps - 1."""
    k2d = np.float64(k2)

    def logp(x, n):
        a = (x.astype(np.float64) * k2d - n[0]).astype(F32)
        return (a.astype(np.float64) - n[1]).astype(F32).astype(np.float64) * np.log(2)

    def grad(ls, lt):
        ps, pt = np.exp(ls), np.exp(lt)
        us = ls - np.log(0.5 * ps + 0.5 * pt)
        return 0.5 * ps * (us - (ps * us).sum())

    exact = [torch.log_softmax(torch.from_numpy(x.astype(np.float64)) * (k2d * np.log(2)), -1).numpy() for x in (s, t)]
    g0, g1 = grad(*exact), grad(logp(s, ns), logp(t, nt))
    return np.linalg.norm(g1 - g0) / np.linalg.norm(g0), np.exp(logp(s, ns)).sum() - 1


def main() -> None:
    for trial, rows in CASES:
        gen = torch.Generator().manual_seed(7000 + trial)
        full = []
        for _ in range(2):  # student, teacher: tools/probe_split_accuracy.py's draws
            scale = float(torch.rand((), generator=gen)) * 4 + 0.5
            full.append((torch.randn((ROWS, VOCAB), dtype=torch.float64, generator=gen) * scale).float().numpy())
        torch.randint(0, VOCAB, (ROWS,), generator=gen)
        torch.rand((ROWS,), generator=gen)
        temperature = float(torch.rand((), generator=gen)) * 2 + 0.5
        k2 = F32(np.log2(np.e) / temperature)  # the kernel's p.k2
        for r in rows:
            cols = []
            for name, double in (("float sums", False), ("double sums", True)):
                ns, nt = split_norm(full[0][r], k2, double), split_norm(full[1][r], k2, double)
                err, mass = grad_error(full[0][r], full[1][r], k2, ns, nt)
                cols.append(f"{name}: gradient {err:.1e} (sum ps - 1 = {mass:+.1e})")
            print(f"trial {trial} row {r}: " + "; ".join(cols), flush=True)


if __name__ == "__main__":
    main()
