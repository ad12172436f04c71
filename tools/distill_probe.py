"""Checks and times the distillation kernel on a GPU in one call: a development probe for kernels/distill.cu.
The committed figures come from `python -m kldiv_inline bench`; this prints a table for one card and one run.

    python tools/distill_probe.py [--reps 15] [--tokens 4096] [--vocab 128256]

Per case (bf16 logits, T = 2, 10% of tokens masked): the loss's relative error against float64, our training
step (forward + backward), the kernel alone, the TRL-style PyTorch peer eager and compiled, and peak memory
beyond the inputs; times are medians of CUDA-event timings after warm-up, in ms, with the 3-tensor floor
(read both logit tensors, write the gradient) from the read bandwidth measured at the start.
"""
import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kldiv_inline as K  # noqa: E402
from kldiv_inline.peers import trl_generalized_jsd  # noqa: E402
from kldiv_inline.reference import generalized_jsd_reference, relative_error  # noqa: E402


def timed(fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def peak_mib(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--once", action="store_true", help="one call per configuration (for ncu), no timing")
    ap.add_argument("--smem-kib", default="", help="comma list of KLDIV_DISTILL_SMEM_KIB values to sweep")
    ap.add_argument("--threads", default="", help="comma list of KLDIV_DISTILL_THREADS values to sweep")
    args = ap.parse_args()
    dev = "cuda"
    print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)
    x = torch.rand(1 << 28, device=dev)
    read_gbps = (1 << 30) / timed(lambda: x.sum(), 20) / 1e6
    del x
    n, v = args.tokens, args.vocab
    g = torch.Generator(device=dev).manual_seed(0)
    s = (torch.randn(n, v, device=dev, generator=g) * 2).bfloat16()
    t = (torch.randn(n, v, device=dev, generator=g) * 2).bfloat16()
    lab = torch.randint(0, v, (n,), device=dev, generator=g)
    lab[torch.rand(n, device=dev, generator=g) < 0.1] = -100
    lp, idx = torch.log_softmax(t.float() / 2, -1).topk(100, dim=-1)
    nbytes = n * v * 2
    floor3 = 3 * nbytes / read_gbps / 1e6
    floor2 = 2 * nbytes / read_gbps / 1e6
    print(f"read {read_gbps:.0f} GB/s; floor fwd+bwd {floor3:.3f} ms, fwd {floor2:.3f} ms", flush=True)
    mod = K.load("cuda", extension="distill")
    if args.once:  # e.g. ncu --clock-control none -k regex:rows_kernel python tools/distill_probe.py --once
        for beta in (0.0, 0.5):
            mod.distill_forward(s, t, None, None, lab, -100, beta, 2.0, 2, True, False)
        mod.distill_forward(s, t, None, None, lab, -100, 0.0, 2.0, 2, False, False)
        torch.cuda.synchronize()
        return
    rows = []

    def add(name, ms, floor, extra=""):
        rows.append((name, ms, ms / floor if floor else float("nan"), extra))
        print(f"  {name:<40} {ms:8.3f} ms  {ms / floor if floor else float('nan'):6.3f} x floor  {extra}", flush=True)

    sw = s.detach().requires_grad_()
    for beta in (0.0, 0.5, 1.0):
        kw = dict(beta=beta, temperature=2.0, labels=lab)
        # accuracy against float64 (first 512 rows, to keep the float64 reference small)
        with torch.no_grad():
            out = K.generalized_jsd(s[:512], t[:512], **{**kw, "labels": lab[:512]})
            ref = generalized_jsd_reference(s[:512], t[:512], **{**kw, "labels": lab[:512]})
        err = relative_error(out, ref)

        def step():
            sw.grad = None
            K.generalized_jsd(sw, t, **kw).backward()

        add(f"ours fwd+bwd beta={beta}", timed(step, args.reps), floor3, f"rel err {err:.1e}, peak {peak_mib(step):.0f} MiB")
        add(f"  kernel alone beta={beta}", timed(lambda: mod.distill_forward(s, t, None, None, lab, -100, beta, 2.0, 2, True, False), args.reps), floor3)
        with torch.no_grad():
            add(f"ours fwd beta={beta}", timed(lambda: K.generalized_jsd(s, t, **kw), args.reps), floor2)
        for var, values in (("KLDIV_DISTILL_SMEM_KIB", args.smem_kib), ("KLDIV_DISTILL_THREADS", args.threads)):
            for val in filter(None, values.split(",")):
                os.environ[var] = val
                add(f"  kernel {var[15:].lower()}={val} beta={beta}", timed(lambda: mod.distill_forward(s, t, None, None, lab, -100, beta, 2.0, 2, True, False), args.reps), floor3)
                os.environ.pop(var)
        if not args.no_peers and beta in (0.0, 0.5):
            def peer(f):
                def run():
                    sw.grad = None
                    f(sw, t, lab, beta, 2.0).backward()
                return run
            try:
                add(f"trl eager fwd+bwd beta={beta}", timed(peer(trl_generalized_jsd), 3, 1), floor3, f"peak {peak_mib(peer(trl_generalized_jsd)):.0f} MiB")
                comp = torch.compile(trl_generalized_jsd)
                add(f"trl compile fwd+bwd beta={beta}", timed(peer(comp), args.reps, 3), floor3, f"peak {peak_mib(peer(comp)):.0f} MiB")
            except Exception as e:  # noqa: BLE001
                print("  peer failed:", type(e).__name__, str(e)[:200])
    floor_topk = 2 * nbytes / read_gbps / 1e6

    def topk_step():
        sw.grad = None
        K.generalized_jsd(sw, teacher_topk=(idx, lp), temperature=2.0, labels=lab).backward()

    with torch.no_grad():
        e = relative_error(K.generalized_jsd(s[:512], teacher_topk=(idx[:512], lp[:512]), temperature=2.0, labels=lab[:512]),
                           generalized_jsd_reference(s[:512], teacher_topk=(idx[:512], lp[:512].double()), temperature=2.0, labels=lab[:512]))
    add("ours topk k=100 fwd+bwd (eager checks)", timed(topk_step, args.reps), floor_topk, f"rel err {e:.1e}")
    add("  kernel alone topk", timed(lambda: mod.distill_forward(s, None, idx, lp, lab, -100, 0.0, 2.0, 2, True, False), args.reps), floor_topk)
    print("\nSUMMARY", torch.cuda.get_device_name())
    for name, ms, xf, extra in rows:
        print(f"{name:<42}{ms:9.3f}{xf:8.3f}  {extra}")


if __name__ == "__main__":
    main()
