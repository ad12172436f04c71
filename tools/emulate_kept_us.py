"""An emulation, in float64 on the CPU, of what the JSD's bfloat16 training rows keep between their terms pass and
their gradient pass (kernels/distill_fast.cuh, kJsdKeepUs, kJsdKeptPs, kJsdKsFromKept) and of what that does to
the student's gradient (1 - beta) ps (u_s - ks): u_s = log(ps / m) kept in fp16 times kKeptUsScale (512), ps kept
in fp16 times 2^ps_exp, ks summed from the kept u_s, the gradient rounded to bfloat16. Everything else exact: the
GPU's ex2/lg2.approx and float32 sums are not emulated (they are ~2^-22, far below fp16's 2^-12).

    python tools/emulate_kept_us.py             # a few seconds, no GPU

For each row kind and beta it prints the row's JSD and the gradient's error (norm of the difference over the norm
of the float64 gradient, the largest of the draws): the kept u_s as the kernel keeps it; kept less its largest value
u_max = -log(1 - beta); kept less the row's ks; as kJsdKeptUsOffset keeps it (less u_max, and rows whose JSD is
below kJsdDirectMin = 1/16, which the kernel sums again, as kept: no offset); and bfloat16's own rounding of
the exact gradient (the floor of any bfloat16 gradient). Rows: bfloat16 logits of 50001 entries, student and teacher
independent draws of spread 3 (the rows of tests/test_distill.py::test_training_rows_with_offsets_far_from_zero, at
their offsets), and students drawn around the teacher. Where the student's mass lies on entries the teacher gives
little, u_s is near u_max at each of them and ks too, so u_s - ks is a small part of u_s and the kept u_s' rounding
(2^-12 |u_s|) a large part of the gradient.
"""
import argparse

import torch

KEPT_US_SCALE = 512.0


def fp16(x):
    return x.to(torch.float16).double()


def gradients(s, t, beta):
    """The float64 gradient, the row's JSD, and the emulated kernel's gradients in bfloat16 for each offset of the
    kept u_s (0: as the kernel keeps it; u_max; the row's ks, which only a second pass over the row could know)."""
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    ps, pt = ls.exp(), lt.exp()
    b = torch.tensor(beta, dtype=torch.float64)
    lm = torch.logaddexp(ls + torch.log1p(-b), lt + torch.log(b))  # log m, m = (1 - beta) ps + beta pt
    u = ls - lm
    ks = float((ps * u).sum())
    jsd = float(beta * (pt * (lt - lm)).sum() + (1 - beta) * ks)
    exact = (1 - beta) * ps * (u - ks)
    # kept ps: (1 - beta) ps 2^ps_exp in fp16, ps_exp = 15 + floor(log2 of the row's sum over its maximum)
    ps_exp = 15 + min(max(int(torch.floor(torch.log2(torch.exp(ls - ls.max()).sum()))), 0), 64)
    weights = (1 - beta) * ps * 2.0**ps_exp
    kept_ps = fp16(weights)
    out = {}
    for name, off in (("kept", 0.0), ("u_max", -float(torch.log1p(-b))), ("ks", ks)):
        kept = fp16((u - off) * KEPT_US_SCALE).clamp(-65504, 65504) / KEPT_US_SCALE
        kept_ks = (weights * kept).sum() / ((1 - beta) * 2.0**ps_exp)  # ks from the kept u_s (kJsdKsFromKept)
        out[name] = (kept_ps * 2.0**-ps_exp * (kept - kept_ks)).to(torch.bfloat16).double()
    # kJsdKeptUsOffset: less u_max; rows whose JSD is below kJsdDirectMin (1/16) keep theirs again, with no offset
    out["switch"] = out["kept"] if jsd < 1 / 16 else out["u_max"]
    out["bf16"] = exact.to(torch.bfloat16).double()
    return exact, jsd, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=50001)
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)

    def draw(shift):
        return torch.randn(args.vocab, dtype=torch.float64, generator=g) * 3.0 + shift

    kinds = {  # name: (student, teacher) logits before bfloat16
        "independent, offsets 130 / 130": lambda: (draw(130), draw(130)),
        "independent, offsets 130 / 400": lambda: (draw(130), draw(400)),
        "independent, offsets -400 / -400": lambda: (draw(-400), draw(-400)),
        "independent, offsets 0 / 0": lambda: (draw(0), draw(0)),
        "near (teacher + 0.5 N(0, 1))": lambda: (lambda t: (t + 0.5 * draw(0) / 3.0, t))(draw(0)),
        "apart (teacher + 1.5 N(0, 1))": lambda: (lambda t: (t + 1.5 * draw(0) / 3.0, t))(draw(0)),
        "apart (teacher + 3 N(0, 1))": lambda: (lambda t: (t + draw(0), t))(draw(0)),
    }
    cols = (("kept", "kept u_s"), ("u_max", "less u_max"), ("ks", "less ks"), ("switch", "switch"),
            ("bf16", "bf16 alone"))
    print(f"{'rows':40s} {'beta':>5s} {'JSD':>6s} " + " ".join(f"{head:>10s}" for _, head in cols)
          + f"   (gradient's error, largest of {args.draws} draws)")
    for name, make in kinds.items():
        for beta in (0.5, 0.9, 0.1):
            worst = dict.fromkeys(("kept", "u_max", "ks", "switch", "bf16"), 0.0)
            for _ in range(args.draws):
                s, t = (x.to(torch.bfloat16).double() for x in make())
                exact, jsd, out = gradients(s, t, beta)
                for k, v in out.items():
                    worst[k] = max(worst[k], float((v - exact).norm() / exact.norm()))
            print(f"{name:40s} {beta:5.2f} {jsd:6.3f} " + " ".join(f"{worst[key]:10.1e}" for key, _ in cols))

if __name__ == "__main__":
    main()
