"""The host's time through each piece of the eager training steps' front end, on a GPU: where the eager top-k
teacher's step spends the host time that can make it follow the host instead of its 0.57-ms kernel (bf16 4096 x
128256, k = 100, T = 2, 10% masked: the distillation suite's case). Each piece is called ``--n`` times (300 unless
named) with a synchronisation every few calls outside the timed region; the figures are microseconds, the
median and the 20% and 80% quantiles of perf_counter around the call.

    python tools/host_pieces.py [--path OLD_TREE] [--tag old]   # one process a package, alternating

Pieces: the whole step from an idle GPU and fed; generalized_jsd's forward; loss.backward(); the front end
(`_prepare`) and its parts (settings, transforms, labels, rows, the top-k pair with its preparation kernel and
read-back); the C++ calls alone (distill_topk_prepare with a device or a pinned host buffer, distill_forward,
distill_scale_grad_); PyTorch's own calls that the path makes (an event's record, current_stream, a pinned copy,
ones_like). A piece the package lacks is left out. Prints one JSON line (and appends it to $OUT/host_pieces.jsonl
when OUT is set).
"""
import os
import sys
import time

if "--path" in sys.argv:  # import the package found there (a copy of an older tree), not this checkout's
    sys.path.insert(0, os.path.abspath(sys.argv[sys.argv.index("--path") + 1]))
else:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from jsonl_out import emit  # noqa: E402

import kldiv_inline  # noqa: E402
from kldiv_inline import bench_distill as BD  # noqa: E402
from kldiv_inline import distill as D  # noqa: E402


def quantiles(ts: list[float]) -> list[float]:
    ts = sorted(ts)
    return [round(ts[len(ts) // 2], 1), round(ts[int(len(ts) * 0.2)], 1), round(ts[int(len(ts) * 0.8)], 1)]


def piece(fn, n: int, pre=None, post=None, sync_every: int = 40) -> list[float]:
    """fn(*pre()) timed n times; post(result) after each, outside the timed region."""
    out = []
    for i in range(n):
        args = pre() if pre else ()
        t0 = time.perf_counter_ns()
        r = fn(*args)
        out.append((time.perf_counter_ns() - t0) / 1e3)
        if post:
            post(r)
        if i % sync_every == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return quantiles(out)


def main() -> None:
    tag = sys.argv[sys.argv.index("--tag") + 1] if "--tag" in sys.argv else "this"
    n = int(sys.argv[sys.argv.index("--n") + 1]) if "--n" in sys.argv else 300
    s, _, y, idx, lp = BD.make_inputs(*BD.sizes("cuda"), "cuda", seed=1)
    v = s.shape[-1]
    step = BD.topk_providers(0.0)[BD.OURS]
    mod = D._module(s.device)
    slack = 0.0198

    def fresh():
        return BD._fresh_student(s, idx, lp, y)

    for _ in range(5):
        step(*fresh())
    torch.cuda.synchronize()
    res: dict = {"tree": tag, "file": kldiv_inline.__file__, "device": torch.cuda.get_device_name()}

    def from_idle(k: int = 60) -> list[float]:
        out = []
        for _ in range(k):
            x = fresh()
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            step(*x)
            out.append((time.perf_counter_ns() - t0) / 1e3)
            torch.cuda.synchronize()
        return quantiles(out)

    kw = dict(teacher_topk=(idx, lp), beta=0.0, temperature=2.0, labels=y)
    res["step from idle"] = from_idle()
    res["step fed"] = piece(step, 100, pre=fresh, sync_every=2)
    res["generalized_jsd fwd"] = piece(lambda x: D.generalized_jsd(x, **kw), 100, pre=lambda: fresh()[:1],
                                       sync_every=2)
    res["loss.backward"] = piece(lambda loss: loss.backward(), 100,
                                 pre=lambda: (D.generalized_jsd(fresh()[0], **kw),), sync_every=2)

    def front(x):
        return D._prepare(x, None, (idx, lp), 0.0, 2.0, y, -100, "batchmean", defer_check=True)

    res["_prepare"] = piece(front, n, pre=lambda: fresh()[:1], post=lambda r: r[2]())
    res["_check_settings"] = piece(lambda: D._check_settings(0.0, 2.0, -100, "batchmean"), n)
    res["refuse_transforms"] = piece(lambda: D.refuse_transforms("g", s, None, y, idx, lp), n)
    res["_check_labels"] = piece(lambda: D._check_labels(y, s.shape[:-1], s.device), n)
    res["_rows"] = piece(lambda: D._rows(s, v), n)
    res["_is_tracing"] = piece(lambda: D._is_tracing(s), n)
    res["_validate_topk"] = piece(lambda: D._validate_topk((idx, lp), s, s.shape[:-1], v, y, -100, defer=True), n,
                                  post=lambda r: r[2]())
    res["distill_topk_prepare (device flags)"] = piece(lambda: mod.distill_topk_prepare(idx, lp, v, y, -100, slack), n)
    try:  # (a pinned buffer of flags: packages from deb52e9 on)
        host = torch.empty(3, dtype=torch.int32, pin_memory=True)
        mod.distill_topk_prepare(idx, lp, v, y, -100, slack, host)
        torch.cuda.synchronize()  # (the buffer is zeroed on the host by the next call: no kernel may still write it)
        res["distill_topk_prepare (pinned flags)"] = piece(
            lambda: mod.distill_topk_prepare(idx, lp, v, y, -100, slack, host), n, sync_every=1)
    except TypeError:
        pass
    _, flags = mod.distill_topk_prepare(idx, lp, v, y, -100, slack)
    res["read_back_later"] = piece(lambda: D.read_back_later(flags), n, post=lambda r: r())
    pinned = torch.empty(3, dtype=torch.int32, pin_memory=True)
    res["copy_ to pinned, non-blocking"] = piece(lambda: pinned.copy_(flags, non_blocking=True), n)
    ev = torch.cuda.Event()
    res["Event.record()"] = piece(lambda: ev.record(), n)
    res["current_stream(device)"] = piece(lambda: torch.cuda.current_stream(flags.device), n)
    res["new_empty((0,))"] = piece(lambda: s.new_empty((0,)), n)
    kernel_args, _, check = front(fresh()[0])
    check()
    rest = kernel_args[1:]  # (after the student's logits)
    res["distill_forward (training)"] = piece(lambda x: mod.distill_forward(x, *rest, True, False), 100,
                                              pre=lambda: fresh()[:1], sync_every=2)
    g, one = torch.empty_like(s), torch.ones((), device="cuda")
    res["distill_scale_grad_ (factor 1)"] = piece(lambda: mod.distill_scale_grad_(g, one), n)
    res["ones_like"] = piece(lambda: torch.ones_like(one), n)
    emit(res, "host_pieces.jsonl")


if __name__ == "__main__":
    main()
