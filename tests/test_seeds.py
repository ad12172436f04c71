"""Test seeds replay: tests/conftest.py seeds every test afresh, KLDIV_TEST_SEED=N fixes the seed, and a failing
test's report names the seed that replays it. Runs pytest on a scratch folder holding a copy of the conftest."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# A test that prints its first random number and fails, so that its report carries the seed.
PROBE = """
import torch

def test_probe():
    print("draw", torch.rand(()).item())
    assert False
"""


@pytest.fixture
def probe_dir(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    return tmp_path


def run_probe(folder: Path, seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KLDIV_TEST_SEED"}
    if seed is not None:
        env["KLDIV_TEST_SEED"] = seed
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rN", str(folder)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def draw(output: str) -> str:
    return re.search(r"^draw (\S+)$", output, re.MULTILINE).group(1)


def test_a_failure_names_its_seed_and_the_seed_replays_it(probe_dir):
    first = run_probe(probe_dir, None)
    assert "1 failed" in first, first
    seed = re.search(r"KLDIV_TEST_SEED=(\d+) python -m pytest '\S*test_probe.py::test_probe' replays", first)
    assert seed, f"the failure's report does not name its seed:\n{first}"
    replay = run_probe(probe_dir, seed.group(1))
    assert draw(replay) == draw(first)
    assert f"KLDIV_TEST_SEED={seed.group(1)}: every test seeded with it" in replay


def test_fresh_seeds_without_the_variable(probe_dir):
    draws = {draw(run_probe(probe_dir, None)) for _ in range(2)}
    assert len(draws) == 2  # two 32-bit seeds alike would be a 1-in-4e9 event


def test_malformed_seed_stops_the_run(probe_dir):
    out = run_probe(probe_dir, "twelve")
    assert "KLDIV_TEST_SEED='twelve' is not an integer seed" in out, out
    assert "draw" not in out
