"""The set-up files agree with each other and with the layout the users asked for."""
import re
from pathlib import Path

import pytest

try:
    import tomllib  # Python >= 3.11
except ImportError:  # 3.10, which the kit supports: tomli is tomllib's source, where installed
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in ("test", "notebooks", "lint"):
        wanted |= {_name(r) for r in project["optional-dependencies"][extra]}
    env = (ROOT / "environment.yml").read_text()
    deps = env.split("dependencies:", 1)[1]  # the channels list above is not packages
    listed = {_name(m) for m in re.findall(r"^\s+- (?!pip:)([A-Za-z0-9_.\-\[\]<>=]+)\s*$", deps, re.MULTILINE)}
    listed -= {"python", "pip"}
    assert wanted == listed, f"only in pyproject: {wanted - listed}; only in environment.yml: {listed - wanted}"
    assert re.search(r"^name: kldiv-inline$", env, re.MULTILINE)


def test_layout():
    for path in ("notebooks", "kernels", "kldiv_inline", "results", "environment.yml", "README.md", "Makefile",
                 ".ci/run", "kernels/kldiv.cu", "kernels/kldiv_cpu.cpp"):
        assert (ROOT / path).exists(), path


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()
