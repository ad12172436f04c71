"""The command line on this machine's best device: check writes its CSV and env.json, plot draws PNGs from
CSVs without a GPU, and the goals of the benchmark are evaluated from its rows."""
import csv
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from kldiv_inline import bench, bench_linear, envinfo, plots
from kldiv_inline import goals as goals_mod

ROOT = Path(__file__).resolve().parent.parent


def test_check_cli_writes_results(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kldiv_inline", "check", "--results", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = list(csv.DictReader((folder / "correctness.csv").open()))
    assert len(rows) >= 600 and all(r["ok"] == "True" for r in rows)
    assert {r["dtype"] for r in rows} == {"float32", "float64", "float16", "bfloat16"}
    env = json.loads((folder / "env.json").read_text())
    for key in ("device_name", "torch", "commit", "command"):
        assert env[key]
    assert " passed, 0 failed" in proc.stdout


def test_every_reduced_check_can_fail(monkeypatch):
    # An op whose reduced results are 10% too large must fail every reduced row but the empty case's. A float16
    # softmax row cast from a sharp distribution had ~20% of its probabilities at 0, a reduced loss of +inf on both
    # sides, and inf passed against inf: 16-18 of 30 float16 rows passed such an op. log_target's target-zeros
    # rows are NaN on both sides by PyTorch's rule, and are checked by reduction='none' alone.
    from kldiv_inline import check

    def wrong(f):
        def g(x, t, reduction="mean", log_target=False):
            out = f(x, t, reduction=reduction, log_target=log_target)
            return out if reduction == "none" else out * 1.1
        return g

    monkeypatch.setattr(check, "kl_div_from_probs", wrong(check.kl_div_from_probs))
    monkeypatch.setattr(check, "kl_div", wrong(check.kl_div))
    rows = list(check.run_checks("cpu", dtypes=(torch.float16, torch.bfloat16)))
    passed = [(r["case"], r["dtype"], r["form"], r["log_target"], r["reduction"]) for r in rows
              if r["ok"] and r["reduction"] != "none" and r["case"] != "empty-0x5" and r["output"] == "loss"]
    assert passed == [], passed[:8]
    assert all(r["ok"] for r in rows if r["reduction"] == "none")  # (the gradients: a float16 mean's 1.1 x may
    # lie within float16's smallest subnormal; test_check_fails_one_element_wrong_and_a_wrong_gradient has them)
    assert not any(r["case"] == "target-zeros" and r["log_target"] and r["reduction"] != "none" for r in rows)


def _fake_rows(ours="kldiv_inline", peak_gbps=3350.0):
    rows = []
    for impl, scale in ((ours, 1.0), ("torch_eager", 5.5), ("torch_compile", 1.3)):
        for pass_, tensors in (("fwd", 2), ("fwd+bwd", 3)):
            for batch in (64, 1024, 16384):
                nbytes = tensors * batch * 16384 * 4
                floor = nbytes / 3000e9 * 1e3
                t = floor * 1.02 * scale
                rows.append({"device": "cuda", "impl": impl, "pass": pass_, "form": "probs", "dtype": "float32",
                             "batch": batch, "features": 16384, "median_ms": t, "q20_ms": t * 0.99,
                             "q80_ms": t * 1.01, "gbps": nbytes / t / 1e6, "floor_ms": floor,
                             "x_floor": 1.02 * scale, "rel_err": 2e-8, "status": "ok", "timer": "cuda",
                             "bytes": nbytes, "floor_gbps": 3000.0, "floor_source": "read_kernel",
                             "pct_of_peak": 100 * nbytes / t / 1e6 / peak_gbps})
    return rows


def test_check_fails_one_element_wrong_and_a_wrong_gradient(monkeypatch):
    # check compared each output by one norm: one element of a reduction='none' output tripled passed float32's
    # 1e-5 where that element was small (here 2-6 of 12 float32 rows, 20-23 of 36 over three dtypes; now none of
    # the float32 ones, 1-4 of 36: a 16-bit element whose value is its terms' rounding), and no gradient was ever
    # checked, so a wrong backward passed `check` and `make results`. Now each element is measured against its own
    # terms, and both operands' gradients are rows.
    from kldiv_inline import check

    def one_wrong(f):
        def g(x, t, reduction="mean", log_target=False):
            out = f(x, t, reduction=reduction, log_target=log_target)
            if reduction == "none" and out.numel() > 100:
                bump, at = torch.zeros_like(out), tuple(n // 2 for n in out.shape)
                bump[at] = 2 * out.detach()[at]  # (one element tripled)
                out = out + bump
            return out
        return g

    def wrong_backward(f):
        def g(x, t, reduction="mean", log_target=False):
            out = f(x, t, reduction=reduction, log_target=log_target)
            return out + 0.1 * (out - out.detach())  # the same value, every gradient 1.1 x
        return g

    cases = [c for c in check.CASES if c.name in ("vector-1023", "transposed-130x96", "broadcast-target-row")]
    monkeypatch.setattr(check, "kl_div_from_probs", one_wrong(check.kl_div_from_probs))
    monkeypatch.setattr(check, "kl_div", one_wrong(check.kl_div))
    rows = list(check.run_checks("cpu", dtypes=(torch.float32,), cases=cases))
    loss_none = [r for r in rows if r["output"] == "loss" and r["reduction"] == "none"]
    assert loss_none and not any(r["ok"] for r in loss_none)
    assert all(r["ok"] for r in rows if r["reduction"] != "none")
    monkeypatch.undo()
    monkeypatch.setattr(check, "kl_div_from_probs", wrong_backward(check.kl_div_from_probs))
    monkeypatch.setattr(check, "kl_div", wrong_backward(check.kl_div))
    rows = list(check.run_checks("cpu", dtypes=(torch.float32, torch.float16), cases=cases))
    assert {r["output"] for r in rows} == {"loss", "grad input", "grad target"}
    assert all(r["ok"] for r in rows if r["output"] == "loss")
    assert not [r for r in rows if r["ok"] and r["output"] != "loss"]
    monkeypatch.undo()

    class OneElement(torch.autograd.Function):  # the identity, whose backward makes one small element 1.5 x
        @staticmethod
        def forward(ctx, v):
            return v.view_as(v)

        @staticmethod
        def backward(ctx, g):
            flat = g.clone().reshape(-1)
            small = flat.abs().where(flat != 0, math.inf).argsort()[max(int((flat != 0).sum()) // 100, 0)]
            flat[small] *= 1.5  # (at the 1st percentile of the sizes: it hid in the norm and the largest's scale)
            return flat.reshape(g.shape)

    def one_wrong_element(f):
        def g(x, t, reduction="mean", log_target=False):
            return f(OneElement.apply(x), OneElement.apply(t), reduction=reduction, log_target=log_target)
        return g

    monkeypatch.setattr(check, "kl_div_from_probs", one_wrong_element(check.kl_div_from_probs))
    monkeypatch.setattr(check, "kl_div", one_wrong_element(check.kl_div))
    rows = [r for r in check.run_checks("cpu", dtypes=(torch.float32,), cases=cases[:2]) if r["output"] != "loss"]
    assert rows and not [r for r in rows if r["ok"]]
    monkeypatch.undo()

    def wrong_when_training(f):  # (a loss 2% off only where the forward also makes the gradient)
        def g(x, t, reduction="mean", log_target=False):
            out = f(x, t, reduction=reduction, log_target=log_target)
            return out * 1.02 if x.requires_grad else out
        return g

    monkeypatch.setattr(check, "kl_div_from_probs", wrong_when_training(check.kl_div_from_probs))
    monkeypatch.setattr(check, "kl_div", wrong_when_training(check.kl_div))
    rows = [r for r in check.run_checks("cpu", dtypes=(torch.float32,), cases=cases[:1]) if r["output"] == "loss"]
    assert rows and not [r for r in rows if r["ok"]]
    monkeypatch.undo()
    rows = list(check.run_checks("cpu", dtypes=(torch.float16,), cases=cases))
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


def test_goals_are_evaluated_from_rows():
    goals = {(g["goal"], g["target"]): g for g in bench.goal_rows(_fake_rows(), "cuda", "kldiv_inline")}
    assert goals[("P1", "time / floor <= 1.05")]["met"]
    assert goals[("P1", "torch_eager time / ours >= 5.0")]["value"] == pytest.approx(5.5)
    assert goals[("P1", "torch_compile time / ours >= 1.05")]["met"]
    # 3000 GB/s / 1.02 on a 3350 GB/s card: 87.8% of peak, short of P1's 90% and above P3's 85%.
    assert goals[("P1", "% of vendor peak >= 90")]["value"] == pytest.approx(100 * 3000 / 1.02 / 3350)
    assert not goals[("P1", "% of vendor peak >= 90")]["met"] and goals[("P3", "% of vendor peak >= 85")]["met"]
    assert goals[("floor", "time / floor >= 1.0")]["met"]
    slow = [dict(r, x_floor=1.2) if r["impl"] == "kldiv_inline" else r for r in _fake_rows()]
    assert not {g["target"]: g for g in bench.goal_rows(slow, "cuda", "kldiv_inline")}["time / floor <= 1.05"]["met"]
    # A row faster than the floor means the floor is no floor.
    beaten = [dict(r, x_floor=0.97) if r["impl"] == "torch_eager" and r["batch"] == 64 else r for r in _fake_rows()]
    floor_goal = {g["goal"]: g for g in bench.goal_rows(beaten, "cuda", "kldiv_inline")}["floor"]
    assert not floor_goal["met"] and floor_goal["value"] == 0.97 and "torch_eager" in floor_goal["case"]
    # Where a row has the floor of the bytes that must move (masked tokens' logits unread), that one counts: below
    # the goals' floor but above that one is a kernel skipping what it need not read, below both no floor at all.
    skips = [dict(r, x_floor=0.95, x_floor_moved=1.04) if r["impl"] == "kldiv_inline" else r for r in _fake_rows()]
    floor_goal = {g["goal"]: g for g in bench.goal_rows(skips, "cuda", "kldiv_inline")}["floor"]
    assert floor_goal["met"] and floor_goal["value"] > 1.0
    under = [dict(r, x_floor=0.95, x_floor_moved=0.99) if r["impl"] == "kldiv_inline" else r for r in _fake_rows()]
    floor_goal = {g["goal"]: g for g in bench.goal_rows(under, "cuda", "kldiv_inline")}["floor"]
    assert not floor_goal["met"] and floor_goal["value"] == 0.99
    # "ours" is a parameter: the same rows under another name meet the same goals.
    renamed = {(g["goal"], g["target"]): g["met"] for g in bench.goal_rows(_fake_rows("mine"), "cuda", "mine")}
    assert renamed == {k: g["met"] for k, g in goals.items()}
    # Errors print with their exponent (a 1e-5 error against a 1e-3 bound as "0.000" would say nothing).
    assert goals_mod.format_value({"target": "loss_rel_err <= 0.001", "value": 1.05e-5}) == "1.05e-05"
    assert goals_mod.format_value({"target": "time / floor <= 1.3", "value": 1.2594}) == "1.259"


def test_a_verdict_whose_bound_lies_within_the_runs_spread_says_so():
    # The verdict is the median's (as the goals define it); its value at the run's 20% and 80% quantiles is shown
    # beside it, and a bound inside that range is flagged: a rerun may turn the verdict (D4 on an H200 read 1.24
    # in one run and 1.48 in another).
    goals = {(g["goal"], g["target"]): g for g in bench.goal_rows(_fake_rows(), "cuda", "kldiv_inline")}
    x_floor = goals[("P1", "time / floor <= 1.05")]
    assert x_floor["spread"] == pytest.approx((1.02 * 0.99, 1.02 * 1.01))
    eager = goals[("P1", "torch_eager time / ours >= 5.0")]  # the peer's quantiles crossed with ours
    assert eager["spread"] == pytest.approx((5.5 * 0.99 / 1.01, 5.5 * 1.01 / 0.99))
    peak = goals[("P1", "% of vendor peak >= 90")]  # a rate: inverse in the time
    assert peak["spread"] == pytest.approx((peak["value"] / 1.01, peak["value"] / 0.99))
    assert goals[("P1", "relative error <= 1e-06")]["spread"] is None
    assert [goals_mod.met_word(goals[k]) for k in [("P1", "time / floor <= 1.05"), ("P1", "% of vendor peak >= 90")]] \
        == ["yes", "NO"]
    wide = [dict(r, q80_ms=r["median_ms"] * 1.05) if r["impl"] == "kldiv_inline" else r for r in _fake_rows()]
    goals = {(g["goal"], g["target"]): g for g in bench.goal_rows(wide, "cuda", "kldiv_inline")}
    fragile = goals[("P1", "time / floor <= 1.05")]  # 1.02 at the median, 1.071 at ours' 80%
    assert goals_mod.met_word(fragile) == "yes (bound within 20-80%)"
    table = goals_mod.goals_markdown(list(goals.values()), {"device_name": "GPU"})
    assert "| P1 | fwd probs float32 16384x16384 | time / floor <= 1.05 | 1.020 | 1.010-1.071 | " in table
    assert "| relative error <= 1e-06 | 2.00e-08 | - |" in table
    status = goals_mod.status_markdown([("run", list(goals.values()), {"device_name": "GPU", "date_utc": "d"})])
    assert "| GPU | 1.020 | 1.010-1.071 | yes (bound within 20-80%) | run (?, d) |" in status
    # Rows without quantiles (an older CSV) give no spread and the plain verdict.
    bare = [{k: v for k, v in r.items() if k not in ("q20_ms", "q80_ms")} for r in _fake_rows()]
    goal = {(g["goal"], g["target"]): g for g in bench.goal_rows(bare, "cuda", "kldiv_inline")}[
        ("P1", "time / floor <= 1.05")]
    assert goal["spread"] is None and goals_mod.met_word(goal) == "yes"


def test_a_goal_whose_case_ours_failed_is_not_met(tmp_path):
    # Ours wrong (failed its check, not timed) where the peers were timed: the goals said nothing for that case,
    # and status.md kept an older run's "yes" as the latest.
    broken = [dict(r, status="wrong", median_ms=None, x_floor=None, pct_of_peak=None)
              if r["impl"] == "kldiv_inline" and r["batch"] == 16384 and r["pass"] == "fwd" else r
              for r in _fake_rows()]
    p1 = [g for g in bench.goal_rows(broken, "cuda", "kldiv_inline") if g["goal"] == "P1"]
    assert len(p1) == 5 and not any(g["met"] for g in p1), p1
    assert {goals_mod.format_value(g) for g in p1} == {"not timed: wrong"}
    def p3(rows):
        return [(g["target"], g["met"]) for g in bench.goal_rows(rows, "cuda", "kldiv_inline") if g["goal"] == "P3"]
    assert p3(broken) == p3(_fake_rows()) and len(p3(broken)) == 3  # the other cases' goals as they were
    runs = [("old", bench.goal_rows(_fake_rows(), "cuda", "kldiv_inline"), {"device_name": "A", "date_utc": "1"}),
            ("new", bench.goal_rows(broken, "cuda", "kldiv_inline"), {"device_name": "A", "date_utc": "2"})]
    lines = [line for line in goals_mod.status_markdown(runs).splitlines() if line.startswith("| P1 ")]
    assert len(lines) == 5 and all("| NO | new (" in line for line in lines), lines
    assert "| - | NO |" in goals_mod.goals_markdown(p1, {})
    # The same in the distillation, fused-head and split goals.
    d = {"impl": "kldiv_inline", "pass": "fwd+bwd", "form": "logits", "beta": 0.0, "dtype": "bfloat16",
         "batch": 4096, "features": 128256, "status": "error: out of memory"}
    (d1,) = [g for g in goals_mod.distill_goal_rows([d], "kldiv_inline") if g["target"].startswith("time")]
    assert not d1["met"] and goals_mod.format_value(d1) == "not timed: error"
    lin = {"impl": "kldiv_inline", "form": "linear", "beta": 0.0, "batch": 4096, "hidden": 4096, "features": 128256,
           "status": "wrong"}
    assert [g["met"] for g in bench_linear.goal_rows([lin]) if g["goal"] == "L1"] == [False] * 3
    split = [{"impl": "kldiv_inline", "world": w, "median_ms": 1.0, "beta": 0.0, "form": "logits",
              "dtype": "bfloat16", "batch": 4096, "features": 128256, "status": "ok" if w == 1 else "wrong"}
             for w in (1, 2)]
    assert [g["met"] for g in goals_mod.vocab_goal_rows(split, "kldiv_inline")] == [False, False]


def test_a_goal_whose_peer_was_not_timed_is_not_measured_and_says_why():
    # A peer that failed its check, raised or is not installed at a goal's case: the goal vanished from goals.md
    # without a word. It is now listed, not measured; status.md keeps an earlier run's measured row over it (a run
    # on a machine without the peer says nothing of the goal), and shows it where no run measured the goal.
    broken = [dict(r, status="error: RuntimeError: boom", median_ms=None)
              if r["impl"] == "torch_compile" and r["batch"] == 16384 and r["pass"] == "fwd" else r
              for r in _fake_rows()]
    (p1,) = [g for g in bench.goal_rows(broken, "cuda", "kldiv_inline") if g["target"].startswith("torch_compile")
             and g["goal"] == "P1"]
    assert p1["met"] is None and goals_mod.format_value(p1) == 'peer "torch_compile" not timed: error'
    assert p1["ours_ms"] == pytest.approx(min(r["median_ms"] for r in _fake_rows() if r["impl"] == "kldiv_inline"
                                              and r["batch"] == 16384 and r["pass"] == "fwd"))
    runs = [("old", bench.goal_rows(_fake_rows(), "cuda", "kldiv_inline"), {"device_name": "A", "date_utc": "1"}),
            ("new", bench.goal_rows(broken, "cuda", "kldiv_inline"), {"device_name": "A", "date_utc": "2"})]
    for order in (runs, runs[::-1]):  # (whichever folder comes first)
        (line,) = [line for line in goals_mod.status_markdown(order).splitlines()
                   if line.startswith("| P1 ") and "torch_compile" in line]
        assert "| old (" in line and "not measured" not in line, line
    (line,) = [line for line in goals_mod.status_markdown(runs[1:]).splitlines()
               if line.startswith("| P1 ") and "torch_compile" in line]
    assert '| peer "torch_compile" not timed: error | - | not measured | new (' in line, line
    assert (f'| peer "torch_compile" not timed: error | - | {p1["ours_ms"]:.4f} | not measured |'
            in goals_mod.goals_markdown([p1], {}))
    # The same in the distillation, fused-head and split goals; a peer with no row at all (not run) stays unmeasured.
    d = {"pass": "fwd+bwd", "form": "logits", "beta": 0.0, "dtype": "bfloat16", "batch": 4096, "features": 128256,
         "median_ms": 1.0, "x_floor": 1.2}
    rows = [dict(d, impl="kldiv_inline", status="ok"), dict(d, impl="liger", status="not installed")]
    (d1,) = [g for g in goals_mod.distill_goal_rows(rows, "kldiv_inline") if "liger" in g["target"]]
    assert d1["met"] is None and goals_mod.format_value(d1) == 'peer "liger" not timed: not installed'
    assert not [g for g in goals_mod.distill_goal_rows(rows, "kldiv_inline") if "torch_compile" in g["target"]]
    lin = {"form": "linear", "beta": 0.0, "batch": 4096, "hidden": 4096, "features": 128256, "median_ms": 1.0,
           "extra_mib": 1.0}
    lin_rows = [dict(lin, impl=p, status="ok" if p == "kldiv_inline" else "wrong")
                for p in ("kldiv_inline", "liger", "torch_compile")]
    linear = [(g["goal"], g["peer"], g["met"]) for g in bench_linear.goal_rows(lin_rows) if g.get("peer")]
    assert linear == [("L1", "torch_compile", None), ("L1", "liger", None)]
    split = [{"impl": impl, "world": w, "median_ms": 1.0, "beta": 0.0, "form": "logits", "dtype": "bfloat16",
              "batch": 4096, "features": 128256, "status": "wrong" if impl == "megatron_style" else "ok"}
             for impl, w in (("kldiv_inline", 1), ("kldiv_inline", 2), ("megatron_style", 2))]
    (v1,) = [g for g in goals_mod.vocab_goal_rows(split, "kldiv_inline") if "megatron_style" in g["target"]]
    assert v1["met"] is None and goals_mod.format_value(v1) == 'peer "megatron_style" not timed: wrong'


def test_distillation_goals_take_their_own_dtype_and_one_gpu():
    # The goals are bfloat16's on one GPU: a float32 row, or a split row over two GPUs, listed first was taken.
    def row(**kw):
        return {"impl": "kldiv_inline", "pass": "fwd+bwd", "form": "logits", "beta": 0.0, "dtype": "bfloat16",
                "batch": 4096, "features": 128256, "status": "ok", "median_ms": 1.0, "x_floor": 1.2, **kw}
    for other in (row(dtype="float32", x_floor=2.5), row(world=2, x_floor=0.7)):
        (d1,) = [g for g in goals_mod.distill_goal_rows([other, row()], "kldiv_inline")
                 if g["target"].startswith("time")]
        assert d1["value"] == 1.2, d1


def test_environment_records_the_variables_that_change_timings(monkeypatch):
    from kldiv_inline import envinfo

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("KLDIV_UNRELATED", "1")
    recorded = envinfo.environment("cpu")["variables"]
    assert recorded["TORCH_FR_BUFFER_SIZE"] == "0" and recorded["NCCL_NVLS_ENABLE"] == "0"
    assert "KLDIV_UNRELATED" not in recorded


def test_the_recorded_commit_says_when_the_code_is_not_that_commits(tmp_path, monkeypatch):
    # A new kernel file beside the committed ones (a variant the bench times), another kernels/ tree by
    # KLDIV_INLINE_KERNELS, and a copy installed inside some other repository all recorded a clean commit.
    from kldiv_inline import envinfo

    monkeypatch.delenv("KLDIV_INLINE_COMMIT", raising=False)
    monkeypatch.delenv("KLDIV_INLINE_KERNELS", raising=False)
    repo = tmp_path / "repo"
    (repo / "kernels").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    (repo / "kernels" / "a.cu").write_text("")

    def git(*a):
        return subprocess.run(["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=n", *a],
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "x")
    head = git("rev-parse", "HEAD")
    monkeypatch.setattr(envinfo, "REPO_ROOT", repo.resolve())
    assert envinfo.commit() == head
    (repo / "kernels" / "v4_new.cu").write_text("")
    assert envinfo.commit() == head + "+dirty"
    # KLDIV_INLINE_COMMIT (a copy whose .git may be stale) naming HEAD, whole or by a prefix, hid +dirty; naming
    # another commit it is trusted as it is.
    for named in (head, head[:7]):
        monkeypatch.setenv("KLDIV_INLINE_COMMIT", named)
        assert envinfo.commit() == named + "+dirty"
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc")
    assert envinfo.commit() == "0123abc"
    monkeypatch.delenv("KLDIV_INLINE_COMMIT")
    (repo / "kernels" / "v4_new.cu").unlink()
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", head[:7])
    assert envinfo.commit() == head[:7]  # clean
    monkeypatch.delenv("KLDIV_INLINE_COMMIT")
    (repo / "kernels" / "a.cu").chmod(0o755)  # a copy that changed permission bits alone changed no code
    assert envinfo.commit() == head
    (repo / "kernels" / "a.cu").chmod(0o644)
    # A script of tools/ that writes committed results through write_env (bench_vocab_parallel) counts as code once
    # it says so: an edited one was recorded as the clean commit. A scratch probe beside it makes no run dirty.
    (repo / "tools").mkdir()
    (repo / "tools" / "bench_x.py").write_text("print(1)\n")
    (repo / "tools" / "probe.py").write_text("")
    git("add", "tools/bench_x.py")
    git("commit", "-qm", "tool")
    head = git("rev-parse", "HEAD")
    monkeypatch.setattr(envinfo, "_SCRIPTS", [])
    assert envinfo.commit() == head  # (probe.py: untracked, no script of this run)
    (repo / "tools" / "bench_x.py").write_text("print(2)\n")
    assert envinfo.commit() == head
    envinfo.count_as_code(repo / "tools" / "bench_x.py")
    assert envinfo.commit() == head + "+dirty"
    git("checkout", "-q", "tools/bench_x.py")
    assert envinfo.commit() == head
    (repo / "tools" / "probe.py").unlink()
    (tmp_path / "other").mkdir()
    monkeypatch.setenv("KLDIV_INLINE_KERNELS", str(tmp_path / "other"))
    assert envinfo.commit() == head + "+other-kernels"
    assert envinfo.environment("cpu")["kernels_dir"] == str((tmp_path / "other").resolve())
    monkeypatch.setenv("KLDIV_INLINE_KERNELS", str(repo / "kernels"))  # the checkout's own, named
    assert envinfo.commit() == head
    monkeypatch.setattr(envinfo, "REPO_ROOT", (repo / "kernels").resolve())  # a package dir, no source tree
    assert envinfo.commit().startswith("unknown (installed ")


def test_env_record_is_this_runs(tmp_path, monkeypatch):
    # A merged env.json keeps no key of an earlier run that this one does not write (a kernels_dir beside a commit
    # that says no other kernels were built); the kernels' knobs are recorded; the command replays as given.
    (tmp_path / "other").mkdir()
    monkeypatch.setenv("KLDIV_INLINE_KERNELS", str(tmp_path / "other"))
    monkeypatch.setenv("KLDIV_DISTILL_FAST", "0")
    monkeypatch.setattr(sys, "argv", ["kldiv_inline", "bench", "--results", str(tmp_path / "my results")])
    envinfo.write_env(tmp_path / "run", "cpu")
    first = json.loads((tmp_path / "run" / "env.json").read_text())
    assert first["kernels_dir"] == str((tmp_path / "other").resolve())
    assert first["variables"]["KLDIV_DISTILL_FAST"] == "0"
    assert shlex.split(first["command"])[-1] == str(tmp_path / "my results")
    envinfo.write_check_env(tmp_path / "check", "cpu")
    assert json.loads((tmp_path / "check" / "env.json").read_text())["kernels_dir"]
    monkeypatch.delenv("KLDIV_INLINE_KERNELS")
    monkeypatch.delenv("KLDIV_DISTILL_FAST")
    envinfo.write_env(tmp_path / "run", "cpu")
    envinfo.write_check_env(tmp_path / "check", "cpu")  # (at the top too: no bench has written one)
    for folder in ("run", "check"):
        env = json.loads((tmp_path / folder / "env.json").read_text())
        assert "kernels_dir" not in env and "+other-kernels" not in env["commit"], folder
        assert "KLDIV_DISTILL_FAST" not in env["variables"], folder


def test_the_recorded_command_is_the_one_main_ran(tmp_path, monkeypatch):
    # main([...]) called from Python (a notebook) recorded the interpreter's arguments (sys.argv) as the command.
    from kldiv_inline import check
    from kldiv_inline.__main__ import main

    real_checks = check.run_checks
    monkeypatch.setattr(check, "run_checks", lambda device: real_checks(device, dtypes=(torch.float32,),
                                                                         cases=check.CASES[:1]))
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    monkeypatch.setattr(sys, "argv", ["ipykernel_launcher.py", "-f", "/tmp/kernel-1.json"])
    results = tmp_path / "my results"
    assert main(["check", "--device", "cpu", "--results", str(results)]) == 0
    env = json.loads((results / "cpu-run" / "env.json").read_text())
    assert shlex.split(env["command"]) == ["python", "-m", "kldiv_inline", "check", "--device", "cpu", "--results",
                                           str(results)]
    assert "kernel-1.json" in envinfo.environment("cpu")["command"]  # outside main: the process's own


def test_vocab_goals_are_evaluated_from_rows():
    # The split's goals from the two-GPU bench's rows: eager and captured steps each over their own one-GPU time,
    # the peer over ours; a form or beta without its rows gives no goal row rather than a made-up one.
    def row(impl, world, ms, beta=0.0, form="logits"):
        return {"impl": impl, "world": world, "median_ms": ms, "beta": beta, "form": form, "dtype": "bfloat16",
                "batch": 4096, "features": 128256, "status": "ok"}
    rows = [row("kldiv_inline", 1, 1.13), row("kldiv_inline", 2, 0.81), row("megatron_style", 2, 14.0),
            row("kldiv_inline_graph", 1, 1.12), row("kldiv_inline_graph", 2, 0.65)]
    goals = {g["target"]: g for g in goals_mod.vocab_goal_rows(rows, "kldiv_inline")}
    scaling, captured = "time on 2 GPUs / on 1 <= 0.6", "steps captured in a CUDA graph: time on 2 GPUs / on 1 <= 0.6"
    assert set(goals) == {scaling, captured, "megatron_style time / ours on 2 GPUs >= 4.0"}
    eager, graph = goals[scaling], goals[captured]
    assert eager["value"] == pytest.approx(0.81 / 1.13) and not eager["met"]
    assert graph["value"] == pytest.approx(0.65 / 1.12) and graph["met"] and graph["ours_ms"] == 0.65
    assert goals["megatron_style time / ours on 2 GPUs >= 4.0"]["value"] == pytest.approx(14.0 / 0.81)
    # Without a captured one-GPU row the captured split has nothing to be a ratio of.
    assert len(goals_mod.vocab_goal_rows(rows[:3] + rows[4:], "kldiv_inline")) == 2


def test_plot_cli_draws_pngs_without_gpu(tmp_path):
    folder = tmp_path / "some-gpu"
    bench.write_csv(_fake_rows(), folder / "bench.csv")
    (folder / "env.json").write_text(json.dumps({"device_name": "Some GPU", "torch": "x", "commit": "abc",
                                                 "floor_gbps": 3000.0, "floor_source": "read_kernel"}))
    written = plots.plot_all(tmp_path, tmp_path / "out", ours=bench.OURS, peers=bench.PEERS)
    names = {p.name for p in written}
    assert {"time_fwd_probs_float32.png", "time_fwd_bwd_probs_float32.png", "speedups.png"} <= names
    assert all(p.stat().st_size > 5000 for p in written if p.suffix == ".png")
    assert "% of vendor peak" in (tmp_path / "out" / "some-gpu" / "goals.md").read_text()
    assert sorted(p.name for p in folder.iterdir()) == ["bench.csv", "env.json"]  # --out leaves the source alone


def test_correctness_figure_marks_failed_checks(tmp_path):
    # A failed check's rel_err is inf where NaN sat in the wrong place or a shape differed: a log axis draws no
    # inf, so the point was missing and the figure looked passed.
    import matplotlib.pyplot as plt

    rows = [{"dtype": d, "case": c, "rel_err": 1e-7 if d == "float32" else 1e-3, "tol": 1e-5 if d == "float32"
             else 8e-3, "ok": True} for d in ("float32", "bfloat16") for c in ("a", "b", "c")]
    rows[1].update(rel_err=float("inf"), ok=False)
    rows[5].update(rel_err=2e-2, ok=False)
    path = tmp_path / "correctness.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    ax = plots.plot_correctness(path)
    (marks,) = [c for c in ax.collections if c.get_label().startswith("failed check")]
    xy = marks.get_offsets()
    assert len(xy) == 2 and sorted(xy[:, 0]) == [1, 2]  # cases b and c
    assert max(xy[:, 1]) >= 1.0 and min(xy[:, 1]) == pytest.approx(2e-2)  # inf at the top, the other at its error
    assert "2 FAILED" in ax.get_title()
    plt.close(ax.figure)


def test_status_takes_each_goal_from_the_latest_run_of_its_card(tmp_path, capsys):
    # Three runs: card A on two days (the later one slower, partial, and without the peers), card B once. Each goal
    # of card A comes from the latest run that measured it; the floor row is the lowest of the card's runs.
    def run(folder, rows, **env):
        bench.write_csv(rows, tmp_path / folder / "bench.csv")
        (tmp_path / folder / "env.json").write_text(json.dumps({"commit": "c" * 40, **env}))

    slower = [dict(r, median_ms=r["median_ms"] * 1.2, x_floor=r["x_floor"] * 1.2) for r in _fake_rows()
              if r["impl"] == "kldiv_inline"]
    run("a-day1", _fake_rows(), device_name="Card A", date_utc="2026-01-01T00:00:00Z")
    run("later/a-day2", slower, device_name="Card A", date_utc="2026-01-02T00:00:00Z", partial="cut short")
    run("b", _fake_rows(), device_name="Card B", date_utc="2026-01-01T00:00:00Z")
    from kldiv_inline.__main__ import main

    assert main(["plot", "--results", str(tmp_path)]) == 0
    assert str(tmp_path / "status.md") in capsys.readouterr().out
    rows = [line.split(" | ") for line in (tmp_path / "status.md").read_text().splitlines()
            if line.startswith("| P") or line.startswith("| floor")]
    got = {(r[0].strip("| "), r[2], r[3]): (r[4], r[6], r[7].rstrip(" |")) for r in rows}  # (r[5]: 20-80%)
    later = "later/a-day2 (ccccccc, 2026-01-02, partial)"
    assert got[("P1", "time / floor <= 1.05", "Card A")] == ("1.224", "NO", later)
    assert got[("P1", "time / floor <= 1.05", "Card B")] == ("1.020", "yes", "b (ccccccc, 2026-01-01)")
    # the later run timed no peer: the speed-up comes from the day before
    assert got[("P1", "torch_eager time / ours >= 5.0", "Card A")] == ("5.500", "yes", "a-day1 (ccccccc, 2026-01-01)")
    assert got[("floor", "time / floor >= 1.0", "Card A")][2] == "a-day1 (ccccccc, 2026-01-01)"
    assert sum(1 for r in rows if r[0] == "| floor") == 2  # one a card


def test_committed_status_is_up_to_date(tmp_path):
    # results/status.md is derived from the committed runs: a run committed without `python -m kldiv_inline plot`
    # would leave it saying where the goals stood before.
    written = plots.write_status(ROOT / "results", bench.OURS, tmp_path)
    assert written.read_text() == (ROOT / "results" / "status.md").read_text(), \
        "results/status.md is stale: run `python -m kldiv_inline plot`"


def test_committed_goals_are_what_their_runs_give(tmp_path):
    # Every committed goals.md is what plot writes from its folder's bench.csv and env.json, and every goal row in
    # the README is a row of a committed goals.md or of results/status.md (checked against the runs above),
    # verbatim: a number edited by hand anywhere fails here.
    committed_rows = set()
    for csv_path in sorted((ROOT / "results").rglob("bench.csv")):
        folder = csv_path.parent
        out = tmp_path / folder.relative_to(ROOT)
        out.mkdir(parents=True)
        assert plots.write_goals(folder, bench.OURS, out).read_text() == (folder / "goals.md").read_text(), \
            f"{folder.relative_to(ROOT)}/goals.md is not what `python -m kldiv_inline plot` writes from its run"
        committed_rows |= set((folder / "goals.md").read_text().splitlines())
    committed_rows |= set((ROOT / "results" / "status.md").read_text().splitlines())
    readme_rows = [line for line in (ROOT / "README.md").read_text().splitlines()
                   if line.split(" | ")[0] in {"| floor"} | {f"| {c}{i}" for c in "PDLV" for i in range(1, 10)}]
    assert readme_rows, "the README's goal tables were not found"
    assert [r for r in readme_rows if r not in committed_rows] == []


def test_old_csvs_still_plot(tmp_path):
    """A bench.csv from before the floor's columns (no bytes, floor_gbps, pct_of_peak) still draws."""
    folder = tmp_path / "old-gpu"
    old = ["device", "impl", "pass", "form", "dtype", "batch", "features", "median_ms", "q20_ms", "q80_ms",
           "gbps", "floor_ms", "x_floor", "rel_err", "status", "timer"]
    folder.mkdir()
    pd.DataFrame(_fake_rows())[old].to_csv(folder / "bench.csv", index=False)
    (folder / "env.json").write_text(json.dumps({"device_name": "Old GPU", "read_gbps": 3000.0}))
    names = {p.name for p in plots.plot_all(tmp_path, ours=bench.OURS, peers=bench.PEERS)}
    assert {"time_fwd_probs_float32.png", "speedups.png"} <= names


def test_speedups_one_panel_per_pass(tmp_path):
    df = plots.load_bench(bench.write_csv(_fake_rows(), tmp_path / "bench.csv"))
    fig = plots.plot_speedups(df, "kldiv_inline", bench.PEERS)
    panels = fig.axes
    assert [ax.get_title(loc="left").split(":")[0] for ax in panels] == ["fwd", "fwd+bwd"]
    assert all(len(ax.get_yticklabels()) == 3 for ax in panels)  # the three sizes, one row each
    assert fig.legends  # outside the panels, not over the bars


def test_plot_folder_says_which_providers_it_does_not_draw(tmp_path, monkeypatch):
    # The folder's figures drew timed rows only: a peer that raised or is not installed, or ours where its check
    # failed, vanished from time_*.png and speedups.png unnamed (harness.plot's figure names them).
    import matplotlib.figure

    rows = [dict(r, status="error: ModuleNotFoundError: torch_compile", median_ms=None)
            if r["impl"] == "torch_compile" else
            dict(r, status="wrong: loss rel err 1e-01", median_ms=None) if r["impl"] == bench.OURS
            and r["batch"] == 16384 else r for r in _fake_rows()]
    rows += [dict(r, status="error: not installed", median_ms=None) if r["impl"] == "liger" else r
             for r in _fake_linear_rows()]
    folder = tmp_path / "gpu"
    bench.write_csv(rows, folder / "bench.csv")
    notes, real = {}, matplotlib.figure.Figure.savefig

    def savefig(fig, path, *a, **kw):
        notes[Path(path).name] = fig.get_supxlabel()
        return real(fig, path, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plots.plot_folder(folder, ours=bench.OURS, peers=bench.PEERS)
    for name in ("time_fwd_probs_float32.png", "time_fwd_bwd_probs_float32.png"):  # each of one pass
        assert notes[name] == ("not drawn: kldiv_inline (wrong: 1 of 3 cases); torch_compile (error: 3 of 3 "
                               "cases)"), (name, notes)
    assert notes["speedups.png"] == ("not drawn: kldiv_inline (wrong: 2 of 12 cases); torch_compile (error: 6 of 6 "
                                     "cases); liger (error: 6 of 6 cases)")  # both passes, the fused head's too
    assert notes["linear_time_memory.png"] == "not drawn: liger (error: 6 of 6 cases)"


def _fake_linear_rows():
    rows = []
    for impl, scale, extra in (("kldiv_inline", 1.1, 500.0), ("torch_eager", 1.8, 6000.0), ("liger", 4.0, 1600.0)):
        for beta in (0.0, 0.5):
            for tokens in (1024, 2048, 4096):
                floor = 8 * tokens * 4096 * 128256 / 700e12 * 1e3
                t = floor * scale
                rows.append({"device": "cuda", "impl": impl, "pass": "fwd+bwd", "form": "linear", "dtype": "bfloat16",
                             "batch": tokens, "features": 128256, "hidden": 4096, "beta": beta, "median_ms": t,
                             "q20_ms": t * 0.99, "q80_ms": t * 1.01, "floor_ms": floor, "x_floor": scale,
                             "status": "ok", "timer": "cuda", "peak_mib": extra + 1000,
                             "extra_mib": extra * tokens / 4096})
    return rows


def test_linear_sweep_draws_time_and_memory_against_tokens(tmp_path):
    folder = tmp_path / "linear-sweep" / "some-gpu"  # a separate run's folder, one level deeper: drawn too
    bench.write_csv(_fake_rows() + _fake_linear_rows(), folder / "bench.csv")
    names = {p.name for p in plots.plot_all(tmp_path, ours=bench.OURS, peers=bench.PEERS)}
    assert "linear_time_memory.png" in names
    assert not any("linear" in n and n.startswith("time_") for n in names)  # not drawn as a bandwidth sweep
    fig = plots.plot_linear_sweep(plots.load_bench(folder / "bench.csv"), bench.OURS, memory_bound_mib=1024)
    time_ax, memory_ax = fig.axes[0], fig.axes[1]
    assert len(fig.axes) == 4  # two betas, time and memory each
    ours = next(line for line in memory_ax.get_lines() if line.get_label() == bench.OURS)
    assert list(ours.get_xdata()) == [1024, 2048, 4096]
    assert list(ours.get_ydata()) == pytest.approx([125 / 1024, 250 / 1024, 500 / 1024])
    assert any(line.get_label() == "floor" for line in time_ax.get_lines())
    assert any(line.get_label() == "memory goal" for line in memory_ax.get_lines())


def test_linear_sweep_says_memory_was_not_measured():
    # A CPU run has no peak-memory counter: its memory panels said nothing and looked like a plotting fault.
    rows = [{**r, "extra_mib": math.nan, "peak_mib": math.nan} for r in _fake_linear_rows()]
    fig = plots.plot_linear_sweep(pd.DataFrame(rows), bench.OURS)
    memory_ax = fig.axes[1]
    assert not memory_ax.get_lines() or all(line.get_label() == "memory goal" for line in memory_ax.get_lines())
    assert any("not measured" in t.get_text() for t in memory_ax.texts)
    measured = plots.plot_linear_sweep(pd.DataFrame(_fake_linear_rows()), bench.OURS)
    assert not any("not measured" in t.get_text() for t in measured.axes[1].texts)


def test_linear_sweep_leaves_out_a_beta_timed_at_one_size():
    # The sweep times the JSD at the goals' shape only: one point is no curve, so its row of panels is left out.
    rows = [r for r in _fake_linear_rows() if r["beta"] == 0.0 or r["batch"] == 4096]
    fig = plots.plot_linear_sweep(pd.DataFrame(rows), bench.OURS)
    assert len(fig.axes) == 2 and "beta=0," in fig.axes[0].get_title()


def test_bench_cut_short_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    # A device's time limit can end a run mid-suite: the cases done are on disk, marked partial, with no goals.
    import argparse

    from kldiv_inline import bench_linear

    real = bench_linear.providers

    def providers(beta, device):
        if beta == 0.5:
            raise KeyboardInterrupt("the time limit")
        return real(beta, device)

    monkeypatch.setattr(bench_linear, "providers", providers)
    folder = tmp_path / "cpu-run"
    folder.mkdir()
    (folder / "goals.md").write_text("an earlier run's goals")
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    args = argparse.Namespace(device="cpu", results=str(tmp_path), suites=["linear"], reps=2, linear_sweep=False)
    with pytest.raises(KeyboardInterrupt):
        bench.main(args)
    rows = list(csv.DictReader((folder / "bench.csv").open()))
    assert rows and {float(r["beta"]) for r in rows} == {0.0}
    assert json.loads((folder / "env.json").read_text())["partial"] == bench.PARTIAL_NOTE
    assert not (folder / "goals.md").exists()
    plots.plot_all(tmp_path, ours=bench.OURS, peers=bench.PEERS)  # plot writes goals.md from the rows, labelled
    assert "Partial run: " + bench.PARTIAL_NOTE in (folder / "goals.md").read_text()


def test_distill_suite_cut_short_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    # The distillation suite saves each case as it ends, as the fused head's does: a time limit in its third case
    # leaves the first two on disk, marked partial, and --resume runs the others.
    import argparse

    from kldiv_inline import bench_distill

    done = []

    cut = {"after": 2}  # cases until the time limit

    def one_row(providers, reference, case, *rest, **kw):
        if len(done) == cut["after"]:
            raise KeyboardInterrupt("the time limit")
        done.append(case.name)
        return [{"device": "cpu", "impl": bench.OURS, "status": "ok", "median_ms": 1.0, "timer": "wall",
                 **case.meta}]

    monkeypatch.setattr(bench_distill, "_run", one_row)
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc")
    with pytest.raises(KeyboardInterrupt):
        bench.main(argparse.Namespace(device="cpu", results=str(tmp_path), suites=["distill"], reps=2))
    rows = pd.read_csv(tmp_path / "cpu-run" / "bench.csv")
    assert len(rows) == 2 and set(rows["form"]) == {"logits"}
    assert json.loads((tmp_path / "cpu-run" / "env.json").read_text())["partial"] == bench.PARTIAL_NOTE
    # --resume runs the rest: the two saved cases are not run again
    first, done[:], cut["after"] = list(done), [], None
    bench.main(argparse.Namespace(device="cpu", results=str(tmp_path), suites=["distill"], reps=2, resume=True))
    rows = pd.read_csv(tmp_path / "cpu-run" / "bench.csv")
    assert not set(first) & set(done) and len(rows) == len(first) + len(done) == 7  # 6 logits cases and top-k
    assert set(rows["form"]) == {"logits", "topk"}


def test_kl_suite_resumed_runs_only_the_cases_it_lacks(tmp_path, monkeypatch):
    # The KL suite's cases (each pass a row per provider) are kept by --resume as the other suites' are.
    import argparse

    ran, cut = [], {"after": 2}

    def fake_case(case, *rest, **kw):
        if len(ran) == cut["after"]:
            raise KeyboardInterrupt("the time limit")
        ran.append(case)
        return [{"device": "cpu", "impl": bench.OURS, "status": "ok", "median_ms": 1.0, "timer": case.timer, **m}
                for m in bench.case_metas(case)]

    monkeypatch.setattr(bench, "run_case", fake_case)
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc")
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    args = argparse.Namespace(device="cpu", results=str(tmp_path), suites=["kl"], reps=2)
    with pytest.raises(KeyboardInterrupt):
        bench.main(args)
    first, ran[:], cut["after"] = list(ran), [], None
    args.resume = True
    bench.main(args)
    cases = bench.headline_cases("cpu") + bench.sweep_cases("cpu")
    assert first == cases[:2] and ran == cases[2:]
    assert len(pd.read_csv(tmp_path / "cpu-run" / "bench.csv")) == sum(len(c.passes) for c in cases)


def test_a_cut_as_bench_csv_is_replaced_leaves_a_partial_run(tmp_path, monkeypatch):
    # Ctrl-C after bench.csv was replaced and before env.json was rewritten left the new run's rows beside the
    # previous run's finished record (no partial, its commit, command and date): plot wrote goals.md as if the run
    # had finished, and --resume refused it ("finished").
    import argparse

    ran, cut = [], {"after": None}
    monkeypatch.setattr(bench, "run_case", _fake_kl_case(ran, cut))
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    folder = tmp_path / "cpu-run"
    args = argparse.Namespace(device="cpu", results=str(tmp_path), suites=["kl"], reps=2)
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc")
    assert bench.main(args) == 0 and "partial" not in json.loads((folder / "env.json").read_text())
    real = bench.write_csv

    def cut_after_the_csv(rows, path):
        real(rows, path)
        raise KeyboardInterrupt("Ctrl-C")

    monkeypatch.setattr(bench, "write_csv", cut_after_the_csv)
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "4567def")
    with pytest.raises(KeyboardInterrupt):
        bench.main(args)
    env = json.loads((folder / "env.json").read_text())
    assert env.get("partial") == bench.PARTIAL_NOTE and env["commit"] == "4567def"
    assert len(pd.read_csv(folder / "bench.csv")) == 2  # the new run's first case's rows
    monkeypatch.setattr(bench, "write_csv", real)
    args.resume = True
    assert bench.main(args) == 0  # resumed, not refused as finished
    assert "partial" not in json.loads((folder / "env.json").read_text())


def test_a_new_run_takes_the_previous_runs_figures_away(tmp_path, monkeypatch):
    # A run cut short after its first case left the previous finished run's figures beside its one case's rows; plot
    # redraws only what those rows support, so the rest stood, captioned as the finished run's. What plot derives
    # from bench.csv goes when a run replaces it (with goals.md); the check's figure stays.
    import argparse

    ran, cut = [], {"after": None}
    monkeypatch.setattr(bench, "run_case", _fake_kl_case(ran, cut))
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc")
    folder = tmp_path / "cpu-run"
    args = argparse.Namespace(device="cpu", results=str(tmp_path), suites=["kl"], reps=2)
    assert bench.main(args) == 0
    drawn = plots.plot_folder(folder, ours=bench.OURS, peers=bench.PEERS)
    (folder / "correctness.png").write_text("the check's figure")
    assert len(drawn) >= 3
    for name in ("linear_time_memory.png", "speedups.png"):  # every figure plot derives from bench.csv
        (folder / name).write_text("a figure")
    ran.clear()
    cut["after"] = 1
    with pytest.raises(KeyboardInterrupt):
        bench.main(args)
    assert sorted(p.name for p in folder.iterdir()) == ["bench.csv", "correctness.png", "env.json"]
    assert all(any(p.match(d) for d in bench.DERIVED) for p in drawn)  # what plot draws, bench knows of


def test_bench_exits_nonzero_when_ours_is_wrong(tmp_path, monkeypatch, capsys):
    # bench (and results) exited 0 while the kit's own rows were wrong: a script or `make results` went on as if the
    # kernel were right. Ours wrong or raising gives 1 once every file is written; a peer's failure does not.
    import argparse

    ran, real = [], _fake_kl_case([], {"after": None})
    failing = {}

    def fake_case(case, *rest, **kw):
        ran.append(case)
        rows = real(case, *rest, **kw)
        return [dict(r, status=failing[r["impl"]], median_ms=None) if r["impl"] in failing and len(ran) == 2 else r
                for r in rows]

    monkeypatch.setattr(bench, "run_case", fake_case)
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    args = argparse.Namespace(device="cpu", results=str(tmp_path), suites=["kl"], reps=2)
    for who, status, code in ((None, None, 0), ("torch_eager", "wrong", 0), ("torch_eager", "error: boom", 0),
                              (bench.OURS, "wrong", 1), (bench.OURS, "error: out of memory", 1)):
        ran.clear()
        failing.clear()
        if who:
            failing[who] = status
        capsys.readouterr()
        assert bench.main(args) == code, (who, status)
        assert (tmp_path / "cpu-run" / "goals.md").exists()  # every file written first
        said = capsys.readouterr().err
        assert (f"bench: {bench.OURS} failed in 2 row(s)" in said and status in said) == bool(code), said[-500:]


def test_env_records_the_calls_each_suite_ran(tmp_path, monkeypatch, capsys):
    # --reps 25 timed the distill and linear suites with 10 calls a case, and env.json said only reps 25; the cap is
    # recorded per suite, and --help says so.
    import argparse

    from kldiv_inline import bench_distill
    from kldiv_inline.__main__ import main

    seen = {}
    monkeypatch.setattr(bench, "run_case", lambda case, *a, reps, **kw: seen.setdefault("kl", reps) and [])
    monkeypatch.setattr(bench_distill, "run", lambda *a, reps, **kw: seen.setdefault("distill", reps))
    monkeypatch.setattr(bench_linear, "run", lambda *a, reps, **kw: seen.setdefault("linear", reps))
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    for reps, calls in ((25, {"kl": 25, "distill": 10, "linear": 10}), (4, {"kl": 4, "distill": 4, "linear": 4})):
        seen.clear()
        bench.main(argparse.Namespace(device="cpu", results=str(tmp_path / str(reps)), suites=list(bench.SUITES),
                                      reps=reps))
        env = json.loads((tmp_path / str(reps) / "cpu-run" / "env.json").read_text())
        assert seen == calls and env["suite_reps"] == calls and env["options"]["reps"] == reps
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "suite_reps" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_no_case_is_timed_twice(device):
    # The CPU sweep's 2048 x 4096 forward was P5's headline case again: two rows of one case in bench.csv, the goal
    # taking the first.
    timed = [(c.form, c.dtype, c.batch, c.features, p, c.timer)
             for c in bench.headline_cases(device) + bench.sweep_cases(device) for p in c.passes]
    assert len(timed) == len(set(timed)), sorted(t for t in timed if timed.count(t) > 1)


def test_bench_resume_finishes_a_run_cut_short(tmp_path, monkeypatch):
    # --resume keeps the cases a cut-short run saved (not run again), runs the rest, and records the earlier part;
    # a finished run, another commit or other suites are refused.
    import argparse

    from kldiv_inline import bench_linear

    real, calls = bench_linear.providers, []

    def cut_at_jsd(beta, device):
        calls.append(beta)
        if beta == 0.5:
            raise KeyboardInterrupt("the time limit")
        return real(beta, device)

    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc")  # both parts' code: one clean commit
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    folder = tmp_path / "cpu-run"

    def args(**kw):
        return argparse.Namespace(**{"device": "cpu", "results": str(tmp_path), "suites": ["linear"], "reps": 2,
                                     "linear_sweep": False, **kw})

    monkeypatch.setattr(bench_linear, "providers", cut_at_jsd)
    with pytest.raises(KeyboardInterrupt):
        bench.main(args())
    first_rows = pd.read_csv(folder / "bench.csv")
    first_env = json.loads((folder / "env.json").read_text())
    assert set(first_rows["beta"]) == {0.0} and first_env["partial"]

    calls.clear()
    monkeypatch.setattr(bench_linear, "providers", lambda beta, device: calls.append(beta) or real(beta, device))
    assert bench.main(args(resume=True)) == 0
    assert calls == [0.5]  # the saved case was kept, not run again
    rows = pd.read_csv(folder / "bench.csv")
    assert sorted(set(rows["beta"])) == [0.0, 0.5] and (rows["status"] == "ok").all()
    pd.testing.assert_frame_equal(rows[rows["beta"] == 0.0].reset_index(drop=True), first_rows)
    env = json.loads((folder / "env.json").read_text())
    assert "partial" not in env and env["commit"] == "0123abc"
    assert env["earlier_parts"] == [{k: first_env[k] for k in bench.PART_KEYS if k in first_env}]
    assert (folder / "goals.md").exists()

    with pytest.raises(SystemExit, match="finished"):
        bench.main(args(resume=True))
    env["partial"] = bench.PARTIAL_NOTE
    (folder / "env.json").write_text(json.dumps(env))
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "4567def")
    with pytest.raises(SystemExit, match="commit 0123abc, this code is 4567def"):
        bench.main(args(resume=True))
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc+dirty")
    env["commit"] = "0123abc+dirty"
    (folder / "env.json").write_text(json.dumps(env))
    with pytest.raises(SystemExit, match="same clean commit"):
        bench.main(args(resume=True))
    with pytest.raises(SystemExit, match="holds rows of the linear suite"):
        bench.main(args(resume=True, suites=["kl"]))
    with pytest.raises(SystemExit, match="no run to continue"):
        bench.main(args(resume=True, results=str(tmp_path / "empty")))
    assert calls == [0.5]  # no refused call ran a case


def test_linear_tokens_pick_the_fused_heads_sizes(tmp_path, monkeypatch):
    # --linear-tokens: the fused head at the token counts given (the CPU twin's hidden size and vocabulary here).
    import argparse

    from kldiv_inline import bench_linear

    seen = []
    monkeypatch.setattr(bench_linear, "run", lambda device, **kw: seen.append(kw) or [])
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    bench.main(argparse.Namespace(device="cpu", results=str(tmp_path), suites=["linear"], reps=2,
                                  linear_sweep=False, linear_tokens=[8, 24]))
    assert seen[0]["sizes"] == [(8, 64, 512), (24, 64, 512)]
    assert bench_linear.sizes_of_tokens("cuda", [16384]) == [(16384, 4096, 128256)]
    with pytest.raises(ValueError, match="positive integers"):
        bench_linear.sizes_of_tokens("cuda", [0])
    for flags, message in ((["--linear-tokens", "1024,x"], "positive integers"),
                           (["--linear-tokens", "1024", "--linear-sweep"], "give one"),
                           (["--suites", "kl", "--linear-tokens", "1024"], "add linear to --suites")):
        proc = subprocess.run([sys.executable, "-m", "kldiv_inline", "bench", "--device", "cpu",
                               "--results", str(tmp_path / "cli"), *flags],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and message in proc.stderr, (flags, proc.stderr[-2000:])


def test_bench_runs_only_the_suites_asked_for(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kldiv_inline", "bench", "--suites", "linear", "--reps", "2",
                           "--results", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = list(csv.DictReader((folder / "bench.csv").open()))
    assert rows and {r["form"] for r in rows} == {"linear"}
    env = json.loads((folder / "env.json").read_text())
    assert "--suites linear" in env["command"] and "partial" not in env  # a finished run is not marked partial
    bad = subprocess.run([sys.executable, "-m", "kldiv_inline", "bench", "--suites", "kl,nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "suites are a comma-separated list of kl, distill, linear" in bad.stderr


def test_bench_refuses_to_drop_other_suites_rows(tmp_path):
    # A run of some suites into a folder whose bench.csv holds others' rows would lose them: refused, at once.
    from kldiv_inline.envinfo import device_slug

    folder = tmp_path / device_slug("cpu")
    bench.write_csv(_fake_rows(), folder / "bench.csv")  # the KL suite's rows
    for cmd in ("bench", "results"):
        proc = subprocess.run([sys.executable, "-m", "kldiv_inline", cmd, "--device", "cpu", "--suites", "linear",
                               "--results", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and "holds rows of the kl suite" in proc.stderr, proc.stderr[-2000:]
    assert len(pd.read_csv(folder / "bench.csv")) == len(_fake_rows())
    assert not (folder / "correctness.csv").exists()  # results refused before its check ran
    proc = subprocess.run([sys.executable, "-m", "kldiv_inline", "bench", "--suites", "kl", "--linear-sweep",
                           "--results", str(tmp_path / "other")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "add linear to --suites" in proc.stderr


def test_bench_refuses_to_replace_a_run_of_more_cases(tmp_path):
    # A run of the KL suite's headline cases into a folder holding its whole sweep, or of other --linear-tokens:
    # it replaced the finished run's bench.csv with fewer rows, and said nothing.
    import argparse

    folder = tmp_path / "cpu-run"
    bench.write_csv(_fake_rows(), folder / "bench.csv")

    def args(**kw):
        return argparse.Namespace(**{"suites": list(bench.SUITES), "reps": 2, "headline_only": False,
                                     "linear_sweep": False, "linear_tokens": None, **kw})

    def recorded(**kw):
        (folder / "env.json").write_text(json.dumps({"options": bench.run_options(args(**kw))}))

    recorded()
    with pytest.raises(SystemExit, match="the size sweep"):
        bench.check_suites(args(headline_only=True), folder)
    bench.check_suites(args(), folder)  # the same cases again: a re-run replaces the run
    recorded(headline_only=True)
    bench.check_suites(args(), folder)  # more cases than the run there
    recorded(linear_tokens=[8, 24])
    with pytest.raises(SystemExit, match="--linear-tokens 8,24"):
        bench.check_suites(args(linear_tokens=[8]), folder)
    bench.check_suites(args(linear_tokens=[8, 24, 32]), folder)
    bench.check_suites(args(suites=["kl"]), folder)  # (the linear suite's rows are not in this fake bench.csv)
    # A recorded run of the default sizes (no --linear-tokens: 64 tokens on the CPU, 4096 on a GPU) is not
    # replaced by one of other token counts; a sweep's counts hold the default's and --linear-tokens may hold it.
    recorded()
    with pytest.raises(SystemExit, match="default 64 tokens"):
        bench.check_suites(args(linear_tokens=[128]), folder)
    bench.check_suites(args(linear_tokens=[64, 128]), folder)
    recorded(device="cuda", linear_sweep=True)
    with pytest.raises(SystemExit, match="--linear-sweep"):
        bench.check_suites(args(device="cuda", linear_tokens=[4096]), folder)
    bench.check_suites(args(device="cuda", linear_tokens=[1024, 2048, 4096, 8192, 16384]), folder)
    recorded(device="cuda", linear_tokens=[4096, 16384])
    bench.check_suites(args(device="cuda", linear_sweep=True), folder)
    recorded(device="cuda")
    with pytest.raises(SystemExit, match="default 4096 tokens"):
        bench.check_suites(args(device="cuda", linear_tokens=[1024]), folder)
    with pytest.raises(SystemExit, match="on a GPU"):  # the CPU times one small shape: a sweep there sweeps nothing
        bench.check_suites(args(linear_sweep=True), folder)
    from kldiv_inline.__main__ import _tokens

    assert _tokens("8,8,4") == [4, 8]  # a count given twice is one case


def test_headline_only_is_refused_over_the_kl_suites_sweep_alone(tmp_path):
    # --headline-only picks the KL suite's cases only, yet a run of the distill (or linear) suite with it into a
    # folder of that suite's run was refused as dropping "the size sweep" that neither run had.
    import argparse

    folder = tmp_path / "cpu-run"
    bench.write_csv([{"device": "cpu", "impl": bench.OURS, "form": "logits", "status": "ok"}], folder / "bench.csv")

    def args(**kw):
        return argparse.Namespace(**{"suites": ["distill"], "reps": 2, "headline_only": False,
                                     "linear_sweep": False, "linear_tokens": None, **kw})

    (folder / "env.json").write_text(json.dumps({"options": bench.run_options(args())}))
    bench.check_suites(args(headline_only=True), folder)
    bench.check_suites(args(suites=["kl", "distill"], headline_only=True), folder)  # no sweep there to drop
    (folder / "env.json").write_text(json.dumps({"options": bench.run_options(args(suites=["kl", "distill"]))}))
    with pytest.raises(SystemExit, match="the size sweep"):
        bench.check_suites(args(suites=["kl", "distill"], headline_only=True), folder)


def test_results_files_are_written_whole(tmp_path, monkeypatch):
    # A run killed mid-write (a device's time limit) keeps the file's last whole version: the new text goes to a
    # file beside it and is renamed over it, so a failed write leaves the old one as it was.
    from kldiv_inline import envinfo

    path = tmp_path / "bench.csv"
    envinfo.write_atomic(path, "old\n")
    real = Path.write_text

    def killed(self, text):  # half the text on disk, then the end of the process
        real(self, text[: len(text) // 2])
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        envinfo.write_atomic(path, "a new version\n")
    monkeypatch.undo()
    assert path.read_text() == "old\n"
    envinfo.write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["bench.csv"]


def _fake_kl_case(ran, cut):
    """run_case's stand-in: a row per pass, no timing; the time limit after ``cut["after"]`` cases."""
    def fake_case(case, *rest, **kw):
        if len(ran) == cut["after"]:
            raise KeyboardInterrupt("the time limit")
        ran.append(case)
        return [{"device": "cpu", "impl": impl, "status": "ok", "median_ms": ms, "q20_ms": ms, "q80_ms": ms,
                 "floor_ms": 0.5, "x_floor": 2 * ms, "gbps": 10 / ms, "timer": case.timer, **m}
                for m in bench.case_metas(case) for impl, ms in ((bench.OURS, 1.0), ("torch_eager", 4.0))]
    return fake_case


def test_check_leaves_the_bench_runs_record_alone(tmp_path, monkeypatch, capsys):
    # A bench run cut short at one commit, then check at another: the bench's numbers keep their own commit,
    # command and date (goals.md and status.md credit them so, --resume compares that commit); check's record is
    # its own, under "check", and captions correctness.png.
    import torch

    from kldiv_inline import check
    from kldiv_inline.__main__ import main

    ran, cut = [], {"after": 2}
    monkeypatch.setattr(bench, "run_case", _fake_kl_case(ran, cut))
    real_checks = check.run_checks
    monkeypatch.setattr(check, "run_checks", lambda device: real_checks(device, dtypes=(torch.float32,),
                                                                         cases=check.CASES[:2]))
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    folder = tmp_path / "cpu-run"
    bench_argv = ["bench", "--device", "cpu", "--reps", "3", "--suites", "kl", "--results", str(tmp_path)]

    def as_run(commit, argv):
        monkeypatch.setenv("KLDIV_INLINE_COMMIT", commit)
        monkeypatch.setattr(sys, "argv", ["kldiv_inline", *argv])  # what env.json records as the command
        return main(argv)

    assert as_run("aaaaaaa", bench_argv) == 130  # (cut short: main says it was interrupted)
    cut_env = json.loads((folder / "env.json").read_text())
    assert as_run("bbbbbbb", ["check", "--device", "cpu", "--results", str(tmp_path)]) == 0
    env = json.loads((folder / "env.json").read_text())
    assert {k: env[k] for k in ("commit", "command", "date_utc", "partial")} == \
        {k: cut_env[k] for k in ("commit", "command", "date_utc", "partial")}
    assert env["check"]["commit"] == "bbbbbbb" and env["check"]["command"].split()[3] == "check"
    with pytest.raises(SystemExit, match="commit aaaaaaa, this code is bbbbbbb"):
        as_run("bbbbbbb", bench_argv + ["--resume"])
    cut["after"] = None
    assert as_run("aaaaaaa", bench_argv + ["--resume"]) == 0  # the same commit finishes it
    env = json.loads((folder / "env.json").read_text())
    assert [p["command"] for p in env["earlier_parts"]] == [cut_env["command"]]  # the bench's, not check's
    as_run("bbbbbbb", ["check", "--device", "cpu", "--results", str(tmp_path)])
    capsys.readouterr()
    assert as_run("bbbbbbb", ["plot", "--results", str(tmp_path)]) == 0
    head = (folder / "goals.md").read_text().splitlines()[0]
    assert "commit aaaaaaa" in head and "bbbbbbb" not in head and "`python -m kldiv_inline bench " in head
    assert "aaaaaaa" in (tmp_path / "status.md").read_text()
    assert "bbbbbbb" in plots._device_title(folder, "check") and "aaaaaaa" in plots._device_title(folder)
    # In a folder with no bench run, check's record is the folder's too (what ran there, and where).
    assert as_run("ccccccc", ["check", "--device", "cpu", "--results", str(tmp_path / "alone")]) == 0
    alone = json.loads((tmp_path / "alone" / "cpu-run" / "env.json").read_text())
    assert alone["commit"] == alone["check"]["commit"] == "ccccccc" and alone["device_name"]


def test_resume_refuses_other_options(tmp_path, monkeypatch):
    # A run of every suite cut short in its KL cases, resumed with fewer (one suite, the headline cases only) or
    # another number of timed calls, would be marked finished with cases missing, or of mixed timing: refused,
    # naming what differs, and the cut-short run is left as it was.
    import argparse

    ran, cut = [], {"after": 2}
    monkeypatch.setattr(bench, "run_case", _fake_kl_case(ran, cut))
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc")
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    folder = tmp_path / "cpu-run"

    def args(**kw):
        return argparse.Namespace(**{"device": "cpu", "results": str(tmp_path), "suites": list(bench.SUITES),
                                     "reps": 2, "headline_only": False, "linear_sweep": False,
                                     "linear_tokens": None, **kw})

    with pytest.raises(KeyboardInterrupt):
        bench.main(args())
    before = (folder / "bench.csv").read_text(), (folder / "env.json").read_text()
    cut["after"] = None
    with pytest.raises(SystemExit) as refused:
        bench.main(args(resume=True, suites=["kl"], headline_only=True))
    message = str(refused.value)
    assert "--suites kl,distill,linear there, --suites kl here" in message
    assert "no --headline-only there, --headline-only here" in message and "reps" not in message
    with pytest.raises(SystemExit, match="--reps 2 there, --reps 5 here"):
        bench.main(args(resume=True, reps=5))
    with pytest.raises(SystemExit, match="--linear-tokens 8,24 here"):
        bench.main(args(resume=True, linear_tokens=[24, 8]))
    assert ((folder / "bench.csv").read_text(), (folder / "env.json").read_text()) == before
    assert len(ran) == 2  # no refused resume ran a case
    assert json.loads(before[1])["options"]["suites"] == list(bench.SUITES)
    # the suites in another order are the same run
    monkeypatch.setattr("kldiv_inline.bench_distill.run", lambda *a, **kw: None)
    monkeypatch.setattr("kldiv_inline.bench_linear.run", lambda *a, **kw: None)
    assert bench.main(args(resume=True, suites=["linear", "kl", "distill"])) == 0
    assert "partial" not in json.loads((folder / "env.json").read_text())


def test_resume_refuses_other_settings(tmp_path, monkeypatch):
    # A run cut short under another torch, thread count or timing variable (OMP_NUM_THREADS, the kernels'
    # KLDIV_DISTILL_ switches) was resumed silently: one run's rows timed under two settings. Refused, naming
    # what differs; the same settings resume.
    import argparse

    ran, cut = [], {"after": 1}
    monkeypatch.setattr(bench, "run_case", _fake_kl_case(ran, cut))
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc")
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    for name in list(envinfo.timing_variables()):
        monkeypatch.delenv(name)
    folder = tmp_path / "cpu-run"
    args = argparse.Namespace(device="cpu", results=str(tmp_path), suites=["kl"], reps=2, resume=False)
    with pytest.raises(KeyboardInterrupt):
        bench.main(args)
    cut["after"], args.resume = None, True
    cut_env = json.loads((folder / "env.json").read_text())
    threads = torch.get_num_threads()
    for change, message in (({"torch": "2.3.0+cu121"}, f"torch 2.3.0+cu121 there, {torch.__version__} here"),
                            ({"cpu_threads": threads + 1}, f"torch threads {threads + 1} there, {threads} here"),
                            ({"variables": {"KLDIV_DISTILL_FAST": "0"}},
                             "KLDIV_DISTILL_FAST=0 there, KLDIV_DISTILL_FAST unset here")):
        (folder / "env.json").write_text(json.dumps({**cut_env, **change}))
        with pytest.raises(SystemExit, match="other settings") as refused:
            bench.main(args)
        assert message in str(refused.value), str(refused.value)
    (folder / "env.json").write_text(json.dumps(cut_env))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(SystemExit, match="OMP_NUM_THREADS unset there, OMP_NUM_THREADS=1 here"):
        bench.main(args)
    assert len(ran) == 1  # no refused resume ran a case
    monkeypatch.delenv("OMP_NUM_THREADS")
    # The CPU twin's compiler (CXX, named whole: CCACHE_DIR is no compiler) picks the code timed.
    monkeypatch.setenv("CCACHE_DIR", "/tmp/nowhere")
    monkeypatch.setenv("CXX", "clang++")
    with pytest.raises(SystemExit, match="CXX unset there, CXX=clang[+][+] here") as refused:
        bench.main(args)
    assert "CCACHE_DIR" not in str(refused.value)
    monkeypatch.delenv("CXX")
    assert bench.main(args) == 0


def test_plot_refuses_a_missing_folder_and_draws_a_run_folder_given_itself(tmp_path, capsys):
    from kldiv_inline.__main__ import main

    with pytest.raises(SystemExit) as missing:
        main(["plot", "--results", str(tmp_path / "nope")])
    assert missing.value.code == 2 and "no such folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as empty:
        main(["plot", "--results", str(tmp_path)])  # a folder, but no run in it
    assert "nothing to draw" in str(empty.value.code)
    folder = tmp_path / "some-gpu"
    bench.write_csv(_fake_rows(), folder / "bench.csv")
    (folder / "env.json").write_text(json.dumps({"device_name": "Some GPU", "torch": "x", "commit": "abc"}))
    assert main(["plot", "--results", str(folder)]) == 0  # one run's folder, given itself: drawn
    captured = capsys.readouterr()
    assert str(folder / "speedups.png") in captured.out and f"--results {tmp_path}`" in captured.err
    assert (folder / "goals.md").exists() and not (folder / "status.md").exists()  # no status.md whose run is "."


def test_plot_of_rows_that_give_no_figure_says_so_and_counts_the_goals(tmp_path, capsys):
    # A bench.csv whose rows give no figure (one case, ours alone: a run cut short after its first case) had its
    # goals.md written, yet plot said "no bench.csv or correctness.csv ...: nothing to draw" and exited 1.
    from kldiv_inline.__main__ import main

    folder = tmp_path / "some-gpu"
    bench.write_csv([r for r in _fake_rows() if r["impl"] == bench.OURS and r["batch"] == 64], folder / "bench.csv")
    for results, outputs in ((folder, ["goals.md"]), (tmp_path, ["goals.md", "status.md"])):
        assert main(["plot", "--results", str(results)]) == 0
        captured = capsys.readouterr()
        assert [Path(line).name for line in captured.out.splitlines()] == outputs, captured.out
        assert "no rows to draw" in captured.err and "bench.csv or correctness.csv" not in captured.err
    assert (folder / "goals.md").exists() and (tmp_path / "status.md").exists()
    assert main(["plot", "--results", str(tmp_path)]) == 0 and "no rows to draw" in capsys.readouterr().err
    bench.write_csv(_fake_rows(), folder / "bench.csv")  # figures drawn: nothing said
    assert main(["plot", "--results", str(folder)]) == 0 and "no rows to draw" not in capsys.readouterr().err


def test_bad_reps_and_results_paths_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    # A user's mistake gets argparse's error (exit 2, no traceback) before the check's or the floor's minutes.
    from kldiv_inline import check
    from kldiv_inline.__main__ import main

    def no_work(*a, **kw):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(bench, "main", no_work)
    monkeypatch.setattr(check, "run_checks", no_work)
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    cases = [(["bench", "--reps", "0", "--results", str(tmp_path)], "positive integer"),
             (["results", "--reps", "-3", "--results", str(tmp_path)], "positive integer"),
             (["check", "--results", str(afile)], "is a file, not a folder"),
             (["bench", "--results", str(afile / "deeper")], "is a file, so"),
             (["results", "--results", str(afile)], "is a file, not a folder"),
             (["plot", "--results", str(afile)], "is a file"),
             (["plot", "--results", str(tmp_path), "--out", str(afile)], "--out: ")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as refused:
            main([argv[0], "--device", "cpu", *argv[1:]] if argv[0] != "plot" else argv)
        err = capsys.readouterr().err
        assert refused.value.code == 2 and message in err, argv
        assert f"usage: python -m kldiv_inline {argv[0]}" in err, err  # (the command's usage, not the top level's)
    # plot writes goals.md, status.md and the PNGs into the results folders without --out: one it cannot write
    # into is refused before any work (PermissionError from write_goals before). (os.access stands in for the
    # permission bits, which root, as tests may run, passes by.)
    runs = tmp_path / "runs"
    (runs / "card").mkdir(parents=True)
    (runs / "card" / "bench.csv").write_text("case\n")  # (a run's folder: a folder of notes beside it is not asked)
    (runs / "notes").mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) not in (runs / "card", runs / "notes"))
    with pytest.raises(SystemExit) as refused:
        main(["plot", "--results", str(runs)])
    assert refused.value.code == 2 and "card is not writable" in capsys.readouterr().err


def test_an_interrupted_command_says_so_without_a_traceback(tmp_path, monkeypatch, capsys):
    import kldiv_inline.__main__ as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_check", interrupted)
    assert cli.main(["check", "--device", "cpu", "--results", str(tmp_path)]) == 130
    assert "python -m kldiv_inline check: interrupted" in capsys.readouterr().err


@pytest.mark.skipif(os.name != "posix", reason="death by a signal is POSIX's")
def test_an_interrupted_program_dies_by_sigint_so_a_shell_loop_around_it_stops(tmp_path):
    # A program that exits 130 after Ctrl-C tells bash it handled the signal: `for c in ...; do python -m
    # kldiv_inline ...; done` went on to the next command. Dying by SIGINT (after saying so) stops the loop: bash,
    # which got the terminal's SIGINT too, ends the loop when its child died by the signal (a shell's wait-and-
    # cooperative-exit), so the child's own way of ending is what is checked.
    import signal

    program = ("import sys, kldiv_inline.__main__ as cli\n"
               "def interrupted(args):\n    raise KeyboardInterrupt\n"
               "cli.cmd_check = interrupted\n"
               f"sys.argv = ['kldiv_inline', 'check', '--device', 'cpu', '--results', {str(tmp_path)!r}]\n"
               "cli.run_as_program()\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGINT, done.stderr
    assert "python -m kldiv_inline check: interrupted" in done.stderr and "Traceback" not in done.stderr


def test_broken_results_files_get_errors_that_name_them(tmp_path, monkeypatch):
    # An empty bench.csv stopped bench and plot with pandas' EmptyDataError; an env.json cut mid-write stopped check
    # with json's JSONDecodeError after its CSV was written (minutes in), and --resume too. Each names the file.
    from kldiv_inline import check
    from kldiv_inline.__main__ import main

    def no_work(*a, **kw):
        raise AssertionError("work started before the files were read")

    monkeypatch.setattr(check, "run_checks", no_work)
    monkeypatch.setattr(bench.floors, "measure_floor", no_work)
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda device: "cpu-run")
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc")
    folder = tmp_path / "cpu-run"
    folder.mkdir()
    (folder / "bench.csv").write_text("")
    for argv in (["bench", "--device", "cpu", "--suites", "kl", "--results", str(tmp_path)],
                 ["plot", "--results", str(tmp_path)]):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert f"{folder / 'bench.csv'} is empty" in str(refused.value.code), argv
    (folder / "bench.csv").unlink()
    (folder / "env.json").write_text('{"commit": ')
    for argv in (["check", "--device", "cpu", "--results", str(tmp_path)],
                 ["bench", "--device", "cpu", "--suites", "kl", "--resume", "--results", str(tmp_path)]):
        if argv[0] == "bench":
            (folder / "bench.csv").write_text("impl,pass,form\n")
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert f"{folder / 'env.json'} is not a JSON record" in str(refused.value.code), argv
    assert not (folder / "correctness.csv").exists()


def test_plot_names_the_column_or_row_a_bench_csv_lacks(tmp_path):
    # A bench.csv without a column the goals or the figures read (timer, status), or with an empty key cell (batch),
    # stopped plot with a bare KeyError or TypeError from deep inside them.
    from kldiv_inline.__main__ import main

    folder = tmp_path / "some-gpu"
    rows = _fake_rows()
    for drop, message in (("timer", "has no timer column"), ("status", "has no status column")):
        bench.write_csv(rows, folder / "bench.csv")
        pd.read_csv(folder / "bench.csv").drop(columns=[drop]).to_csv(folder / "bench.csv", index=False)
        for results in (tmp_path, folder):
            with pytest.raises(SystemExit) as refused:
                main(["plot", "--results", str(results)])
            assert str(refused.value.code).startswith(f"{folder / 'bench.csv'} {message}"), refused.value.code
    bench.write_csv([dict(r, batch=None) if i == 4 else r for i, r in enumerate(rows)], folder / "bench.csv")
    with pytest.raises(SystemExit, match=r"bench.csv: row 5 \(after the header\) has no batch number"):
        main(["plot", "--results", str(tmp_path)])
    bench.write_csv([dict(r, impl=None) if i == 2 else r for i, r in enumerate(rows)], folder / "bench.csv")
    with pytest.raises(SystemExit, match=r"row 3 \(after the header\) has no impl \(1 such row"):
        main(["plot", "--results", str(folder)])


def test_console_table_and_cpu_goals_say_what_they_hold(monkeypatch):
    # The distillation suite's rows of one case differ by beta only; a long provider name keeps its own column.
    rows = [{"impl": name, "pass": "fwd+bwd", "form": "logits", "dtype": "bfloat16", "batch": 64, "features": 4096,
             "beta": beta, "median_ms": 1.0, "x_floor": 2.0, "status": "ok"}
            for name in ("kldiv_inline", "kldiv_inline_skip_masked") for beta in (0.0, 0.5, 1.0)]
    lines = bench.table(rows).splitlines()
    assert lines[0].split()[:5] == ["impl", "pass", "form", "dtype", "beta"]
    assert len(set(lines[1:])) == 6 and [line.split()[4] for line in lines[1:4]] == ["0", "0.5", "1"]
    assert all(line.split()[:2] == ["kldiv_inline_skip_masked", "fwd+bwd"] for line in lines[4:])
    assert len({line.index("bfloat16") for line in lines[1:]}) == 1  # the columns line up
    assert bench.table([{k: v for k, v in rows[0].items() if k != "beta"}]).splitlines()[1].split()[4] == "-"
    # A CPU run ran no CUDA: goals.md says what the CUDA version is (the one torch was built with).
    from kldiv_inline import envinfo

    env = envinfo.environment("cpu")
    assert env["torch_cuda_build"] == env["cuda"]
    env.update(torch="2.14.1+cu130", cuda="13.0", torch_cuda_build="13.0")
    head = goals_mod.goals_markdown([], env).splitlines()[0]
    assert "torch 2.14.1+cu130 built with CUDA 13.0, CPU only" in head and ", CUDA 13.0" not in head
    assert "built with no CUDA" in goals_mod.goals_markdown([], dict(env, torch_cuda_build=None))
    gpu = dict(env, device="cuda")
    assert "(torch 2.14.1+cu130, CUDA 13.0, commit" in goals_mod.goals_markdown([], gpu)


def test_a_changed_codes_run_is_marked_in_status_and_captions(tmp_path):
    # status.md and the plots' captions cut env.json's commit to its first characters, and the "+dirty" (or
    # "+other-kernels") mark with it: a run of changed code read as the clean commit's.
    from kldiv_inline import goals, plots
    sha = "db2cfbef8b" + "0" * 30
    assert goals.short_commit(sha + "+dirty", 7) == "db2cfbe+dirty"
    assert goals.short_commit(sha + "+dirty+other-kernels", 10) == "db2cfbef8b+dirty+other-kernels"
    assert goals.short_commit(sha, 7) == "db2cfbe" and goals.short_commit("2c591d7", 7) == "2c591d7"
    row = dict(goal="P1", case="c", target="time / floor <= 1.05", value=1.0, met=True)
    table = goals.status_markdown([("run", [row], {"device_name": "Card", "commit": sha + "+dirty",
                                                   "date_utc": "2026-12-05T00:00:00Z"})])
    assert "(db2cfbe+dirty, 2026-12-05" in table
    (tmp_path / "env.json").write_text(json.dumps({"device_name": "Card", "torch": "2", "commit": sha + "+dirty"}))
    assert plots._device_title(tmp_path).endswith("db2cfbef8b+dirty")


def _bench_args(tmp_path, **kw):
    import argparse

    return argparse.Namespace(device="cpu", results=str(tmp_path), suites=["kl"], reps=2, **kw)


def test_a_cut_before_the_new_rows_leaves_no_old_rows_under_the_new_record(tmp_path, monkeypatch):
    # A finished run at one commit, then a run at another cut after its partial env.json and before its first
    # bench.csv: the old rows stood beside the new partial record, and --resume finished them as the new commit's.
    ran, cut = [], {"after": None}
    monkeypatch.setattr(bench, "run_case", _fake_kl_case(ran, cut))
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda d: "cpu-run")
    folder = tmp_path / "cpu-run"
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "aaaa111")
    assert bench.main(_bench_args(tmp_path)) == 0
    real = bench.write_csv

    def cut_before_csv(rows, path):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(bench, "write_csv", cut_before_csv)
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "bbbb222")
    with pytest.raises(KeyboardInterrupt):
        bench.main(_bench_args(tmp_path))
    assert not (folder / "bench.csv").exists()  # aaaa111's rows are not left under bbbb222's partial record
    monkeypatch.setattr(bench, "write_csv", real)
    with pytest.raises(SystemExit, match="no run to continue"):
        bench.main(_bench_args(tmp_path, resume=True))


@pytest.mark.parametrize("there, here", [
    ({"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "0"}),  # another card of the same model
    ({"NCCL_VERSION": "2.28.3-1"}, {"NCCL_VERSION": "2.28.9-1"}),  # the image's label
    ({}, {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}),  # a two-GPU machine's settings
], ids=["visible-card", "nccl-version", "multicast"])
def test_resume_takes_variables_a_one_device_suite_does_not_follow(tmp_path, monkeypatch, there, here):
    ran, cut = [], {"after": 1}
    monkeypatch.setattr(bench, "run_case", _fake_kl_case(ran, cut))
    monkeypatch.setattr("kldiv_inline.envinfo.device_slug", lambda d: "cpu-run")
    monkeypatch.setenv("KLDIV_INLINE_COMMIT", "0123abc")
    for name in list(envinfo.timing_variables()):
        monkeypatch.delenv(name)
    for k, v in there.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(KeyboardInterrupt):
        bench.main(_bench_args(tmp_path, resume=False))
    for k in there:
        monkeypatch.delenv(k)
    for k, v in here.items():
        monkeypatch.setenv(k, v)
    cut["after"] = None
    assert bench.main(_bench_args(tmp_path, resume=True)) == 0
    # The host's thread count is compared for a CPU run only.
    record = {"torch": torch.__version__, "cpu_threads": torch.get_num_threads() + 1, "variables": {}}
    assert bench._settings_differ(record, "cuda") == ""
    assert "torch threads" in bench._settings_differ(record, "cpu")
