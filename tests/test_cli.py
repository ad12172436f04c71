"""The command line on this machine's best device: check writes its CSV and env.json, plot draws PNGs from
CSVs without a GPU, and the goals of the benchmark are evaluated from its rows."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kldiv_inline import bench, plots

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


def _fake_rows():
    rows = []
    for impl, scale in (("kldiv_inline", 1.0), ("torch_eager", 5.5), ("torch_compile", 1.3)):
        for batch in (64, 1024, 16384):
            floor = batch * 16384 * 8 / 4000e9 * 1e3
            t = floor * 1.02 * scale
            rows.append({"device": "cuda", "impl": impl, "pass": "fwd", "form": "probs", "dtype": "float32",
                         "batch": batch, "features": 16384, "median_ms": t, "q20_ms": t * 0.99,
                         "q80_ms": t * 1.01, "gbps": batch * 16384 * 8 / t / 1e6, "floor_ms": floor,
                         "x_floor": 1.02 * scale, "rel_err": 2e-8, "status": "ok", "timer": "cuda"})
    return rows


def test_goals_are_evaluated_from_rows():
    goals = {(g["goal"], g["target"]): g for g in bench.goal_rows(_fake_rows(), "cuda")}
    assert goals[("P1", "time / floor <= 1.05")]["met"]
    assert goals[("P1", "torch_eager time / ours >= 5.0")]["value"] == pytest.approx(5.5)
    assert goals[("P1", "torch_compile time / ours >= 1.05")]["met"]
    slow = [dict(r, x_floor=1.2) if r["impl"] == "kldiv_inline" else r for r in _fake_rows()]
    assert not {g["target"]: g for g in bench.goal_rows(slow, "cuda")}["time / floor <= 1.05"]["met"]


def test_plot_cli_draws_pngs_without_gpu(tmp_path):
    folder = tmp_path / "some-gpu"
    bench.write_csv(_fake_rows(), folder / "bench.csv")
    (folder / "env.json").write_text(json.dumps({"device_name": "Some GPU", "torch": "x", "commit": "abc",
                                                 "read_gbps": 4000.0}))
    written = plots.plot_all(tmp_path, tmp_path / "out")
    names = {p.name for p in written}
    assert {"time_fwd_probs_float32.png", "speedups.png"} <= names
    assert all(p.stat().st_size > 5000 for p in written)
