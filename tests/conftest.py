"""Shared test set-up: the `gpu` marker skips without CUDA; `device` parametrises over cpu and cuda; every test
runs under its own random seed, which KLDIV_TEST_SEED=N fixes to replay a failure."""
import os

import pytest
import torch

# CUDA code compiles on CPU-only machines for the kit's default architecture.
if not torch.cuda.is_available():
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


# Fresh random inputs for every test (never one fixed seed), replayable: KLDIV_TEST_SEED=N uses N instead, and
# a failing test's report names its seed.
SEED_ENV = "KLDIV_TEST_SEED"
_SEED = pytest.StashKey[int]()


def _fixed_seed() -> int | None:
    """KLDIV_TEST_SEED as an integer (decimal or 0x...), or None when unset."""
    text = os.environ.get(SEED_ENV, "").strip()
    if not text:
        return None
    try:
        return int(text, 0)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV}={text!r} is not an integer seed") from None


def pytest_configure(config):
    _fixed_seed()  # a malformed value stops the run here, before any test


def pytest_report_header(config):
    fixed = _fixed_seed()
    if fixed is not None:
        return f"{SEED_ENV}={fixed}: every test seeded with it"
    return f"random seeds: a fresh one per test, named in a failure's report ({SEED_ENV}=N replays it)"


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    fixed = _fixed_seed()
    seed = int.from_bytes(os.urandom(4), "little") if fixed is None else fixed
    torch.manual_seed(seed)  # the CPU and every CUDA device
    request.node.stash[_SEED] = seed
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    seed = item.stash.get(_SEED, None)
    if report.failed and seed is not None:
        report.sections.append(("seed", f"{SEED_ENV}={seed} python -m pytest '{item.nodeid}' replays this test"))
