"""The harness: a researcher's own kernel checked, timed and plotted in a few lines (the README's snippet,
run as written), wrong providers caught and never timed, the timing columns, the floors and vendor peaks."""
import collections
import functools
import io
import math
import textwrap
import time
from pathlib import Path

import matplotlib.figure
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch

import kldiv_inline
from kldiv_inline import floors, harness

ROOT = Path(__file__).resolve().parent.parent

SCALE2_CPP = textwrap.dedent("""
    // y = 2 x, elementwise, float32 (a researcher's first kernel).
    #include <torch/extension.h>

    torch::Tensor scale2(const torch::Tensor& x) {
      TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.is_contiguous(),
                  "scale2: expected a contiguous float32 CPU tensor");
      torch::Tensor y = torch::empty_like(x);
      const float* in = x.const_data_ptr<float>();
      float* out = y.data_ptr<float>();
      for (int64_t i = 0; i < x.numel(); ++i) out[i] = 2.0f * in[i];
      return y;
    }

    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("scale2", &scale2); }
""")

SCALE2_CU = textwrap.dedent("""
    #include <ATen/core/Tensor.h>
    #include <ATen/ops/empty_like.h>
    #include <c10/cuda/CUDAException.h>
    #include <c10/cuda/CUDAStream.h>

    __global__ void scale2_kernel(const float* x, float* y, int64_t n, int64_t skip_every) {
      for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        if (skip_every == 0 || i % skip_every != 0) y[i] = 2.0f * x[i];
    }

    at::Tensor scale2(const at::Tensor& x, int64_t skip_every) {
      TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous(), "scale2: float32 CUDA");
      at::Tensor y = at::empty_like(x);
      scale2_kernel<<<256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<float>(), y.data_ptr<float>(), x.numel(), skip_every);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return y;
    }
""")
SCALE2_CU_BIND = textwrap.dedent("""
    #include <torch/extension.h>
    at::Tensor scale2(const at::Tensor& x, int64_t skip_every);
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("scale2", &scale2, py::arg("x"), py::arg("skip_every") = 0); }
""")


@pytest.fixture(scope="module")
def scale2_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scale2")
    (folder / "scale2.cpp").write_text(SCALE2_CPP)
    return folder


def _cases(device, sizes=(1 << 10, 1 << 14)):
    return [harness.Case(f"n={n}", (torch.rand(n, device=device),)) for n in sizes]


def readme_snippet() -> str:
    """The python block of the README's section "Your own kernel"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own kernel"):]
    return section[section.index("```python\n") + 10:section.index("```\n", section.index("```python"))]


def test_readme_snippet_runs_as_written_on_cpu(scale2_dir, monkeypatch):
    monkeypatch.chdir(scale2_dir)
    snippet = readme_snippet()
    assert "harness.check(" in snippet and "harness.bench(" in snippet and "harness.plot(" in snippet
    scope = {"dev": "cpu"}
    exec(compile(snippet, "README.md", "exec"), scope)
    checked, timed, fig = scope["checked"], scope["timed"], scope["fig"]
    assert list(checked.columns[:2]) == ["provider", "case"]
    assert {"max_abs_err", "rel_err", "ok"} <= set(checked.columns)
    assert checked["ok"].all() and (checked["rel_err"] == 0).all()
    assert set(harness.BENCH_COLUMNS) <= set(timed.columns)
    assert len(timed) == 4 and (timed["status"] == "ok").all() and (timed["timer"] == "wall").all()
    assert (timed["q20_ms"] <= timed["median_ms"]).all() and (timed["median_ms"] <= timed["q80_ms"]).all()
    assert (timed["bytes"] == [2 * 4 << 16] * 2 + [2 * 4 << 22] * 2).all()
    assert timed["gbps"].gt(0).all() and timed["floor_source"].eq("torch_sum").all()
    assert timed["x_floor"].round(9).eq((timed["median_ms"] / timed["floor_ms"]).round(9)).all()
    assert timed["pct_of_peak"].isna().all()  # a CPU has no vendor peak in the table
    assert isinstance(fig, matplotlib.figure.Figure) and len(fig.axes) == 2


def test_check_catches_wrong_providers(device):
    def skips_last(x):  # an off-by-one at the tail: the last element is never written ...
        right = 2 * x    # ... where memory last held the right answer (e.g. an earlier call's output)
        del right
        y = torch.empty_like(x)  # the allocator hands that block out again: only poisoning shows the bug
        y[:-1] = 2 * x[:-1]
        return y

    def skips_half(x):
        y = torch.empty_like(x)
        y[::2] = 2 * x[::2]
        return y

    def raises(x):
        raise RuntimeError("kernel launch failed")

    providers = {"right": lambda x: x * 2, "plus_1e-3": lambda x: 2 * x + 1e-3, "skips_last": skips_last,
                 "skips_half": skips_half, "nan": lambda x: torch.full_like(x, math.nan),
                 "wrong_shape": lambda x: 2 * x[:-1], "two_outputs": lambda x: (2 * x, x), "raises": raises,
                 "missing": None}
    df = harness.check(providers, reference=lambda x: 2 * x, cases=_cases(device, (1 << 16,)))
    ok = dict(zip(df["provider"], df["ok"]))
    assert ok == {"right": True, **{name: False for name in providers if name != "right"}}
    err = dict(zip(df["provider"], df["error"]))
    assert "relative error" in err["plus_1e-3"] and "shape" in err["wrong_shape"]
    assert "2 outputs" in err["two_outputs"] and "kernel launch failed" in err["raises"]
    # where: the element left unwritten, the poison it holds, and the likely cause
    assert "first at (65535,): nan against" in err["skips_last"] and "unwritten" in err["skips_last"]
    # (complex outputs too: their NaN formatted, not converted to a float)
    c = torch.tensor([1 + 1j, 2 + 0j], dtype=torch.complex64)
    assert "first at (1,): (nan" in harness.compare(torch.tensor([1 + 1j, complex("nan")]), c)["error"]
    assert err["missing"] == "not installed"
    assert df.set_index("provider").loc["plus_1e-3", "max_abs_err"] == pytest.approx(1e-3, rel=1e-3)


def test_infinities_must_sit_where_the_reference_has_them(device):
    # relative_error skips the reference's non-finite entries in its norm, so it must refuse an output that is
    # finite there, or infinite with the other sign, or infinite where the reference is finite: else a kernel that
    # turns a right inf loss into a number would pass every comparison of the kit's tests.
    from kldiv_inline.reference import relative_error
    inf = math.inf

    def t(*v):
        return torch.tensor(v, dtype=torch.float64, device=device)

    assert relative_error(t(1.0, inf), t(1.0, inf)) == 0.0
    assert relative_error(t(1.0, -inf), t(1.0, -inf)) == 0.0
    for out, ref in [((1.0, 2.0), (1.0, inf)), ((1.0, -inf), (1.0, inf)), ((1.0, inf), (1.0, 2.0)),
                     ((1.0, 2.0), (1.0, -inf))]:
        assert relative_error(t(*out), t(*ref)) == inf, (out, ref)
    assert not harness.compare(t(1.0, 2.0), t(1.0, inf))["ok"]
    df = harness.check({"nan_to_num": lambda x: torch.nan_to_num(x.log()), "right": lambda x: x.log()},
                       reference=lambda x: x.log(), cases=[harness.Case("zeros", (t(0.0, 1.0, 2.0),), {})])
    assert dict(zip(df["provider"], df["ok"])) == {"nan_to_num": False, "right": True}


def test_bench_refuses_to_time_a_wrong_provider(device):
    cases = _cases(device)
    harness.check({"wrong": lambda x: 2 * x + 1e-3}, reference=lambda x: 2 * x, cases=cases)
    # No reference given: bench checks against the one the cases were checked with, every provider.
    timed = harness.bench({"wrong": lambda x: 2 * x + 1e-3, "torch": lambda x: x + x}, cases=cases, reps=3,
                          warmup=1, bytes_moved=lambda x: 2 * x.nbytes)
    status = timed.set_index(["provider", "case"])["status"]
    assert (status.loc["wrong"] == "wrong").all() and (status.loc["torch"] == "ok").all()
    assert timed[timed["provider"] == "wrong"]["median_ms"].isna().all()
    assert (timed[timed["provider"] == "wrong"]["rel_err"] > 1e-5).all()
    # A check result handed in is used as it is.
    add = lambda x: x + x  # noqa: E731
    verdict = harness.check({"torch": add}, reference=lambda x: 3 * x, cases=cases)
    assert harness.bench({"torch": add}, cases=cases, checked=verdict, reps=3, warmup=1)["status"].eq("wrong").all()


def test_bench_needs_a_reference_or_an_explicit_none():
    cases = _cases("cpu")
    with pytest.raises(ValueError, match="reference=None"):
        harness.bench({"torch": lambda x: 2 * x}, cases=cases)
    timed = harness.bench({"torch": lambda x: 2 * x}, cases=cases, reference=None, reps=3, warmup=1)
    assert timed["status"].eq("ok").all() and timed["rel_err"].isna().all()
    assert timed["gbps"].isna().all()  # no bytes_moved: no bandwidth, no floor
    assert isinstance(harness.plot(timed), matplotlib.figure.Figure)
    # An empty case moves no bytes: a row without a multiple of its floor (a division by 0 ended the whole bench)
    empty = [harness.Case("empty", (torch.rand(0),))]
    timed = harness.bench({"torch": lambda x: 2 * x}, cases=empty, reference=None, reps=3, warmup=1,
                          bytes_moved=lambda x: 2 * x.nbytes)
    assert timed["status"].eq("ok").all() and timed["x_floor"].isna().all()


def test_wall_clock_leaves_prepare_out_on_an_asynchronous_device(monkeypatch):
    # On a GPU the wall clock's prepare (a setup's copies, say) queues work that the closing synchronisation waited
    # for inside the timed region. A queue of sleeps stands in for the device: prepare queues 40 ms, the call 1 ms.
    from kldiv_inline import timing
    queue = []

    def synchronize():
        while queue:
            time.sleep(queue.pop())

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    times = timing.time_wall(lambda x: queue.append(0.001), [(0,)], reps=3, warmup=1, device="cuda",
                             prepare=lambda x: queue.append(0.040) or (x,))
    assert max(times) < 20, times  # ms: the call's 1 ms (and the host's), not prepare's 40


def test_setup_meta_and_gradients(device):
    """A training step as a provider: setup makes fresh leaves, outputs (loss, grad) are both compared."""
    def step(f):
        def run(x, w):
            x.grad = None
            loss = f(x, w)
            loss.backward()
            return loss, x.grad
        return run

    x, w = torch.randn(4096, device=device), torch.rand(4096, device=device) + 0.5
    cases = [harness.Case("n=4096", (x, w), meta={"pass": "fwd+bwd", "dtype": "float32", "batch": 1})]
    setup = lambda x, w: (x.detach().requires_grad_(), w)  # noqa: E731
    bad_grad = step(lambda x, w: (w * x * x).sum() + 0 * x.detach().sum())  # right loss ...
    providers = {"right": step(lambda x, w: (w * x * x).sum()),
                 "no_grad_scale": lambda x, w: (bad_grad(x, w)[0], x.grad * 1.01)}  # ... wrong gradient
    timed = harness.bench(providers, cases=cases, reference=step(lambda x, w: (w * x * x).sum()), setup=setup,
                          bytes_moved=lambda x, w: 3 * x.nbytes, reps=3, warmup=1, measure_memory=True)
    assert list(timed.columns[:5]) == ["provider", "case", "pass", "dtype", "batch"]
    assert dict(zip(timed["provider"], timed["status"])) == {"right": "ok", "no_grad_scale": "wrong"}
    assert "peak_mib" in timed.columns
    if device == "cuda":  # the step allocates at least the gradient
        assert timed.set_index("provider").loc["right", "peak_mib"] >= 4096 * 4 / 2**20


def test_check_gives_each_provider_and_the_reference_their_own_inputs():
    """One that writes into its inputs changes no one else's, nor the case's."""
    x, i = torch.rand(1000), torch.randint(0, 1000, (100,))
    x0, i0 = x.clone(), i.clone()

    def ref(x, i):  # a reference may write into its inputs too, integer ones included
        out = 2 * x[i]
        x.zero_(), i.zero_()
        return out

    providers = {"in_place": lambda x, i: x.mul_(2)[i], "right": lambda x, i: 2 * x[i]}
    df = harness.check(providers, reference=ref, cases=[harness.Case("n=1000", (x, i))])
    assert df["ok"].all(), df["error"].tolist()
    assert torch.equal(x, x0) and torch.equal(i, i0)


def test_bench_times_each_provider_on_its_own_inputs(monkeypatch):
    # (a case beyond the CPU's last-level cache: one set of inputs; smaller ones rotate through a few sets, made
    # alike before the warm-up: test_the_cpu_rotates_input_sets_through_its_last_level_cache)
    monkeypatch.setattr(harness.timing, "llc_bytes", lambda: 1000)
    x = torch.rand(1000)
    x0, seen = x.clone(), []
    timed = harness.bench({"in_place": lambda x: x.mul_(2), "records": lambda x: seen.append(x)},
                          cases=[harness.Case("n=1000", (x,))], reference=None, reps=3, warmup=1)
    assert timed["status"].eq("ok").all() and len(seen) == 4
    assert all(torch.equal(s, x0) for s in seen) and torch.equal(x, x0)
    # One copy per provider, made before its warm-up, not one per call (inputs may be large).
    assert len({s.data_ptr() for s in seen}) == 1 and seen[0].data_ptr() != x.data_ptr()


def test_gradients_do_not_pile_up_on_the_case_inputs():
    """Each provider's inputs are fresh leaves that require grad, as the case's are."""
    w = torch.rand(1000, requires_grad=True)

    def step(w):
        (w * w).sum().backward()
        return w.grad

    df = harness.check({"a": step, "b": step}, reference=step, cases=[harness.Case("grad", (w,))])
    assert df["ok"].all(), df["error"].tolist()
    assert w.grad is None


def test_bench_times_only_the_callables_checked():
    cases = _cases("cpu", (1 << 10,))
    mine = functools.partial(torch.mul, other=2)  # a deep copy of it would be another object
    checked = harness.check({"m": mine}, reference=lambda x: 2 * x, cases=cases)
    with pytest.raises(ValueError, match="'m' is not the callable .*check it again"):
        harness.bench({"m": lambda x: 3 * x}, cases=cases, checked=checked, reps=3, warmup=1)
    for frame in (checked, checked.copy(), checked[checked["ok"]]):  # pandas copies keep the record
        assert harness.bench({"m": mine}, cases=cases, checked=frame, reps=3, warmup=1)["status"].eq("ok").all()

    class Op:
        def run(self, x):
            return 2 * x

    op = Op()  # op.run is a new bound method at each access: the same callable
    checked = harness.check({"m": op.run}, reference=lambda x: 2 * x, cases=cases)
    assert harness.bench({"m": op.run}, cases=cases, checked=checked, reps=3, warmup=1)["status"].eq("ok").all()
    # A frame built by hand has no record: trusted by name, as before.
    by_hand = pd.DataFrame(checked.drop(columns="check_id").to_dict("records"))
    assert harness.bench({"m": lambda x: x + x}, cases=cases, checked=by_hand, reps=3,
                         warmup=1)["status"].eq("ok").all()


def test_python_numbers_from_the_reference_are_float64():
    x = torch.randn(1000, dtype=torch.float64)
    df = harness.check({"float64": lambda x: x.sum()}, reference=lambda x: float(x.sum()),
                       cases=[harness.Case("sum", (x,))])
    assert df["ok"].all(), df["error"].tolist()
    assert harness.compare(torch.tensor(3), 3)["ok"]  # integers stay integers: exact


def test_dict_outputs_are_compared_by_key():
    providers = {"other_order": lambda x: {"b": x, "a": 2 * x}, "other_key": lambda x: {"a": 2 * x, "z": x},
                 "swapped": lambda x: {"a": x, "b": 2 * x}, "nested": lambda x: {"a": 2 * x, "b": {"c": x}},
                 "tuple": lambda x: (2 * x, x)}
    df = harness.check(providers, reference=lambda x: {"a": 2 * x, "b": x}, cases=_cases("cpu", (1 << 10,)))
    ok, err = dict(zip(df["provider"], df["ok"])), dict(zip(df["provider"], df["error"]))
    assert ok == {"other_order": True, "other_key": False, "swapped": False, "nested": False, "tuple": False}
    assert err["other_key"] == "the output has dict keys {'a', 'z'}, the reference {'a', 'b'}"
    assert "['b'] is a dict" in err["nested"] and "no dict" in err["tuple"]


def test_a_bad_reference_raises_once_naming_it():
    cases = _cases("cpu", (64,))
    providers = {"a": lambda x: 2 * x, "b": lambda x: x + x}
    with pytest.raises(TypeError, match="the reference returned ndarray"):
        harness.check(providers, reference=lambda x: x.numpy(), cases=cases)

    def raises(x):
        raise RuntimeError("no float64 kernel")

    with pytest.raises(RuntimeError, match="the reference raised on case 'n=64': RuntimeError: no float64 kernel"):
        harness.check(providers, reference=raises, cases=cases)
    with pytest.raises(TypeError, match="the reference returned ndarray"):
        harness.bench(providers, cases=cases, reference=lambda x: x.numpy(), reps=3, warmup=1)
    # A reference with nothing to compare (one that works in place and forgot its return, say) would pass every
    # provider, a provider that does nothing included.
    for nothing in (None, (), {}, [None], (None, None)):
        with pytest.raises(TypeError, match="the reference returned no tensors"):
            harness.check({"idle": lambda x, n=nothing: n}, reference=lambda x, n=nothing: n, cases=cases)


def test_bench_says_why_a_provider_failed_its_check():
    def raises(x):
        raise RuntimeError("kernel launch failed")

    cases = _cases("cpu", (1 << 10,))
    providers = {"raises": raises, "shape": lambda x: 2 * x[:-1], "off": lambda x: 2 * x + 1e-3}
    for checked in (None, harness.check(providers, reference=lambda x: 2 * x, cases=cases)):
        timed = harness.bench(providers, cases=cases, reference=lambda x: 2 * x, checked=checked, reps=3, warmup=1)
        status = dict(zip(timed["provider"], timed["status"]))
        assert status["raises"] == "wrong: RuntimeError: kernel launch failed"
        assert status["shape"].startswith("wrong: ") and "shape" in status["shape"]
        assert status["off"] == "wrong"  # the numbers: rel_err says by how much
        assert timed["median_ms"].isna().all()


def test_meta_keys_must_not_name_result_columns():
    for key in ("provider", "case", "device", "ok", "error", "status", "bytes", "median_ms", "peak_mib"):
        with pytest.raises(ValueError, match=f"meta keys \\['{key}'\\]"):
            harness.Case("c", (torch.rand(4),), meta={key: 1, "dtype": "float32"})
    case = harness.Case("c", (torch.rand(4),), meta={"dtype": "float32"})
    case.meta["status"] = "mine"  # changed after the case was made: caught when it is used
    with pytest.raises(ValueError, match="status"):
        harness.check({"t": lambda x: 2 * x}, reference=lambda x: 2 * x, cases=[case])
    with pytest.raises(ValueError, match="status"):
        harness.bench({"t": lambda x: 2 * x}, cases=[case], reference=None, reps=3, warmup=1)


def test_bench_validates_its_arguments():
    cases = _cases("cpu", (64,))
    for bad, match in (({"timer": "bogus"}, "timer must be one of 'auto', 'cuda', 'wall'"), ({"reps": 0}, "reps"),
                       ({"reps": 2.5}, "reps"), ({"warmup": -1}, "warmup")):
        with pytest.raises(ValueError, match=match):
            harness.bench({"t": lambda x: 2 * x}, cases=cases, reference=None, **bad)


def test_plot_legend_inside_the_figure_off_the_axes():
    """Shown by a plain savefig (no bbox_inches="tight") and in a window: inside the canvas, over no panel."""
    providers = {"mine": lambda x: 2 * x, "torch": lambda x: x + x}
    cases = _cases("cpu")
    with_bytes = harness.bench(providers, cases=cases, reference=None, reps=3, warmup=1,
                               bytes_moved=lambda x: 2 * x.nbytes)
    without = harness.bench(providers, cases=cases, reference=None, reps=3, warmup=1)
    for timed in (with_bytes, without):
        fig = harness.plot(timed, ours="mine")
        fig.canvas.draw()
        (legend,) = fig.legends
        box, canvas = legend.get_window_extent(), fig.bbox
        assert canvas.x0 <= box.x0 and box.x1 <= canvas.x1 and canvas.y0 <= box.y0 and box.y1 <= canvas.y1
        assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)
        plt.close(fig)


def test_plot_floor_of_a_single_case_is_visible():
    timed = harness.bench({"torch": lambda x: 2 * x}, cases=_cases("cpu", (1 << 12,)), reference=None, reps=3,
                          warmup=1, bytes_moved=lambda x: 2 * x.nbytes)
    fig = harness.plot(timed)
    (floor,) = [line for line in fig.axes[0].get_lines() if line.get_label() == "floor"]
    assert len(floor.get_xdata()) == 1 and floor.get_marker() not in (None, "", " ", "None")
    plt.close(fig)


def test_plot_keeps_cases_that_move_the_same_bytes():
    # A contiguous and a transposed input of one size: on a bytes axis they share a point, and the line kept one.
    x = torch.rand(512, 512)
    cases = [harness.Case("contiguous", (x.contiguous(),)), harness.Case("transposed", (x.t(),))]
    timed = harness.bench({"mine": lambda x: 2 * x.contiguous()}, cases=cases, reference=None, reps=3, warmup=1,
                          bytes_moved=lambda x: 2 * x.nbytes, floor=floors.Floor("cpu", 10.0, "fake", {"fake": 10.0}))
    fig = harness.plot(timed)
    for ax in fig.axes:
        (line,) = [line for line in ax.get_lines() if line.get_label() == "mine"]
        assert len(line.get_xdata()) == 2
        assert [t.get_text() for t in ax.get_xticklabels()] == ["contiguous", "transposed"]
    plt.close(fig)


def test_upcast_and_tolerances():
    a = torch.rand(3, dtype=torch.bfloat16).requires_grad_()
    up = harness.upcast((a, [torch.arange(3)], {"k": torch.ones(2, dtype=torch.float16)}, 2.5))
    assert up[0].dtype == torch.float64 and up[0].requires_grad and up[0].is_leaf
    assert up[1][0].dtype == torch.int64 and up[2]["k"].dtype == torch.float64 and up[3] == 2.5
    out, ref = torch.ones(8), torch.ones(8, dtype=torch.float64) * (1 + 1e-4)
    assert not harness.compare(out, ref)["ok"]                                 # float32: 1e-5
    assert harness.compare(out, ref, tolerance=1e-3)["ok"]                     # one number for every dtype
    assert harness.compare(out, ref, tolerance={torch.float32: 1e-3})["ok"]  # or per dtype
    assert harness.compare(out.bfloat16(), ref)["ok"]                          # bfloat16: 8e-3
    assert not harness.compare(torch.tensor([1, 2]), torch.tensor([1, 3]))["ok"]  # integers: exact
    big = torch.tensor([2**62, -(2**62), 7])  # exact beyond 2^53 too, where float64 rounds them alike
    for off in ([1, 0, 0], [0, -1, 0]):
        assert not harness.compare(big + torch.tensor(off), big)["ok"]
    assert not harness.compare((big + 1).int(), big)["ok"]                      # other integer dtypes alike
    assert harness.compare(big.clone(), big)["ok"]
    assert harness.compare(torch.tensor([1, 0], dtype=torch.int32), torch.tensor([1, 0]))["ok"]
    assert not harness.compare(torch.tensor([True, False]), torch.tensor([True, True]))["ok"]
    nan_both = torch.tensor([1.0, math.nan])
    assert harness.compare(nan_both, nan_both.double())["ok"]                  # NaN where the reference has it
    assert not harness.compare(nan_both, torch.ones(2, dtype=torch.float64))["ok"]


def test_one_number_of_tolerance_leaves_integer_outputs_exact():
    # Values and their argmax indices: one number passed to widen the bfloat16 values' tolerance let 10 of 1000
    # indices off by one through (2.8e-3 of the indices' norm, within 1e-2).
    x = torch.rand(1000, 64, dtype=torch.float64)
    idx = x.argmax(-1)
    off = idx.clone()
    off[::100] += 1
    for tolerance in (1e-2, {torch.bfloat16: 1e-2}):
        assert harness.compare((x.max(-1).values.bfloat16(), idx), (x.max(-1).values, idx), tolerance=tolerance)["ok"]
        verdict = harness.compare((x.max(-1).values.bfloat16(), off), (x.max(-1).values, idx), tolerance=tolerance)
        assert not verdict["ok"] and "output 1" in verdict["error"], verdict
    assert harness.tolerance_for(torch.int64, 1e-2) == 0.0
    assert harness.tolerance_for(torch.int64, {torch.int64: 1.0}) == 1.0  # named by dtype: the caller's choice


def test_an_integer_reference_is_exact_whatever_dtype_the_provider_returns():
    # argsort indices returned as float32, ten of them off by one, passed at float32's tolerance.
    ref = torch.rand(100_000).argsort()
    off = ref.clone()
    off[::10_000] += 1
    assert harness.compare(ref.float(), ref)["ok"]
    verdict = harness.compare(off.float(), ref)
    assert not verdict["ok"] and verdict["tol"] == 0.0, verdict
    assert not harness.compare(ref.float() + 0.25, ref, tolerance=1e-2)["ok"]  # one number: floats only


def test_tolerance_is_one_number_of_any_kind_or_a_clear_error():
    # A numpy scalar or a 0-d tensor failed every provider (a TypeError from inside each check).
    out, ref = torch.ones(8), torch.ones(8, dtype=torch.float64) * (1 + 1e-4)
    for tolerance in (np.float32(1e-3), np.float64(1e-3), torch.tensor(1e-3), 1e-3, 1):
        assert harness.compare(out, ref, tolerance=tolerance)["ok"], tolerance
    cases = _cases("cpu", (1 << 8,))
    assert harness.compare(out, ref, tolerance={torch.float32: np.float32(1e-3)})["ok"]
    for bad, error in (("1e-3", TypeError), (True, TypeError), (-1.0, ValueError), (math.nan, ValueError),
                       ({torch.float32: "1e-3"}, TypeError), ({torch.float32: -1.0}, ValueError),
                       ({"float32": 1e-3}, TypeError)):
        with pytest.raises(error, match="tolerance"):
            harness.check({"m": lambda x: 2 * x}, reference=lambda x: 2 * x, cases=cases, tolerance=bad)
        with pytest.raises(error, match="tolerance"):
            harness.bench({"m": lambda x: 2 * x}, cases=cases, reference=lambda x: 2 * x, tolerance=bad, reps=3)


def test_namedtuples_in_a_cases_args():
    pair = collections.namedtuple("Pair", "a b")
    x = torch.rand(64)
    cases = [harness.Case("nt", (pair(x, x + 1),))]
    verdict = harness.check({"m": lambda p: p.a + p.b}, reference=lambda p: p.a + p.b, cases=cases)
    assert verdict["ok"].all(), verdict
    timed = harness.bench({"m": lambda p: p.a + p.b}, cases=cases, reps=3, warmup=1)
    assert timed["status"].eq("ok").all(), timed


def test_joined_checks_keep_each_providers_verdict():
    # pd.concat keeps attrs only where every frame's are equal: with the record in attrs, joined checks of other
    # callables kept the first's record alone (a provider checked in the second was refused) or lost it (a
    # callable never checked was timed as "ok" by name). Each row now carries its own check's record.
    cases = _cases("cpu", (1 << 8, 1 << 9))
    good, bad, theirs = (lambda x: 2 * x), (lambda x: 3 * x), (lambda x: x + x)
    first = harness.check({"mine": good}, reference=lambda x: 2 * x, cases=cases)
    second = harness.check({"torch": theirs}, reference=lambda x: 2 * x, cases=cases)
    joined = pd.concat([first, second], ignore_index=True)
    timed = harness.bench({"mine": good, "torch": theirs}, cases=cases, checked=joined, reps=3, warmup=1)
    assert timed["status"].eq("ok").all(), timed
    with pytest.raises(ValueError, match="'mine' is not the callable check"):  # never checked: refused
        harness.bench({"mine": bad, "torch": theirs}, cases=cases, checked=joined, reps=3, warmup=1)
    # The bad callable checked on one case, the good on the other: the bad one is refused, not judged by the
    # good one's verdict on that case.
    mixed = pd.concat([harness.check({"mine": bad}, reference=lambda x: 2 * x, cases=cases[1:]),
                       harness.check({"mine": good}, reference=lambda x: 2 * x, cases=cases[:1])])
    with pytest.raises(ValueError, match="'mine' is not the callable check"):
        harness.bench({"mine": bad}, cases=cases, checked=mixed, reps=3, warmup=1)


def test_plot_draws_every_name_and_every_case():
    # A provider named "_fast" was missing from the legend (matplotlib hides labels that start with "_"); one
    # named with "$" made savefig raise (mathtext); a case without bytes (None) was dropped from a bytes axis.
    x = {n: torch.rand(n) for n in (256, 512, 1024)}
    cases = [harness.Case(f"n=${n}$_^", (x[n],)) for n in x]
    timed = harness.bench({"_fast": lambda t: 2 * t, "mine $x^$": lambda t: t + t}, cases=cases, reference=None,
                          reps=3, warmup=1, floor=floors.Floor("cpu", 10.0, "fake", {"fake": 10.0}),
                          bytes_moved=lambda t: None if t.numel() == 512 else 2 * t.nbytes)
    fig = harness.plot(timed, ours="_fast")
    fig.savefig(io.BytesIO(), format="png")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(label.endswith("_fast") for label in labels) and any("mine" in label for label in labels), labels
    lines = [line for line in fig.axes[0].get_lines() if line.get_label().endswith("_fast")]
    assert len(lines) == 1 and len(lines[0].get_xdata()) == 3  # every case, drawn per case
    plt.close(fig)


def test_plot_says_which_providers_it_does_not_draw():
    # A provider refused by its check (or that raised) drew nothing and was named nowhere: it read as one never
    # asked. An ``ours`` that is no provider of the frame was ignored.
    x = torch.rand(1 << 12)
    timed = harness.bench({"right": lambda t: 2 * t, "off $1$": lambda t: 2 * t + 1}, cases=[harness.Case("n", (x,))],
                          reference=lambda t: 2 * t, reps=3, warmup=1, floor=floors.Floor("cpu", 10.0, "fake",
                                                                                         {"fake": 10.0}))
    fig = harness.plot(timed, ours="right")
    fig.savefig(io.BytesIO(), format="png")  # ("$" in the note's name: no mathtext error)
    note = fig.get_supxlabel()
    assert note.startswith("not drawn") and "off" in note and "right" not in note and "(wrong: 1 of 1" in note, note
    # inside the figure, below the axes (the constrained layout makes room for it)
    fig.canvas.draw()
    box = fig._supxlabel.get_window_extent()
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y0 >= fig.bbox.y0
    assert not any(box.overlaps(ax.get_tightbbox()) for ax in fig.axes)
    plt.close(fig)
    with pytest.raises(ValueError, match="no provider"):
        harness.plot(timed, ours="mine")


def test_complex_outputs_are_compared_whole():
    # .double() of a complex tensor keeps its real part: the conjugate of the right answer passed.
    x = torch.rand(64, 256)
    cases = [harness.Case("rfft", (x,))]
    verdict = harness.check({"right": torch.fft.rfft, "conj": lambda x: torch.fft.rfft(x).conj()},
                            reference=torch.fft.rfft, cases=cases).set_index("provider")  # (complex64's default)
    assert verdict.loc["right", "ok"] and not verdict.loc["conj", "ok"], verdict
    assert verdict.loc["conj", "rel_err"] > 0.1
    ref = torch.fft.rfft(x.double())
    assert harness.compare(ref.to(torch.complex64), ref, tolerance=1e-5, per_element=True)["ok"]
    assert not harness.compare(ref.real.float(), ref, tolerance=1e-5)["ok"]  # the imaginary parts dropped


def test_bench_checks_with_the_tolerance_and_per_element_of_the_last_check():
    # bench re-checks against the reference a case was last checked with: on its defaults, a provider that a
    # per-element check (or a tighter tolerance) had just failed was timed as "ok".
    def tail_bug(x):
        y = (2 * x).bfloat16()
        y.view(-1)[-3:] = 0
        return y

    def slightly_off(x):
        return 2 * x * (1 + 3e-6)

    fl = floors.Floor("cpu", 10.0, "fake", {"fake": 10.0})
    cases = [harness.Case("1M", (torch.rand(1000, 1000) + 0.5,))]
    assert not harness.check({"tail_bug": tail_bug}, lambda x: 2 * x, cases, per_element=True)["ok"].any()
    timed = harness.bench({"tail_bug": tail_bug}, cases, reps=2, warmup=1, floor=fl)
    assert timed["status"].tolist() == ["wrong"], timed
    # given to bench, its own settings win
    timed = harness.bench({"tail_bug": tail_bug}, cases, reps=2, warmup=1, floor=fl, per_element=False)
    assert timed["status"].tolist() == ["ok"], timed
    cases = [harness.Case("n", (torch.rand(4096),))]
    assert not harness.check({"off": slightly_off}, lambda x: 2 * x, cases, tolerance=1e-6)["ok"].any()
    assert harness.bench({"off": slightly_off}, cases, reps=2, warmup=1, floor=fl)["status"].tolist() == ["wrong"]
    # a reference given to bench comes with bench's settings (the defaults here: float32's 1e-5)
    timed = harness.bench({"off": slightly_off}, cases, reference=lambda x: 2 * x, reps=2, warmup=1, floor=fl)
    assert timed["status"].tolist() == ["ok"], timed


def test_per_element_catches_a_few_wrong_elements_that_the_norm_lets_through(device):
    # A vectorised loop's mishandled tail: three elements of a million bfloat16 ones off by their own size are
    # ~2e-3 of the norm, within bfloat16's 8e-3. per_element holds each to the tolerance of the largest value.
    def tail_bug(x):
        y = (2 * x).bfloat16()
        y.view(-1)[-3:] = 0
        return y

    def right(x):
        return (2 * x).bfloat16()  # rounded once: every element within bfloat16's rounding of itself

    cases = [harness.Case("1M", (torch.rand(1000, 1000, device=device) + 0.5,))]
    norm_only = harness.check({"tail_bug": tail_bug, "right": right}, reference=lambda x: 2 * x, cases=cases)
    assert norm_only["ok"].all(), norm_only  # (the norm alone: both pass)
    both = harness.check({"tail_bug": tail_bug, "right": right}, reference=lambda x: 2 * x, cases=cases,
                         per_element=True).set_index("provider")
    assert both.loc["right", "ok"] and not both.loc["tail_bug", "ok"], both
    assert "relative error" in both.loc["tail_bug", "error"] and "at element (999, 99" in both.loc["tail_bug", "error"]
    timed = harness.bench({"tail_bug": tail_bug, "right": right}, cases=cases, reference=lambda x: 2 * x, reps=2,
                          warmup=1, per_element=True)
    assert dict(zip(timed["provider"], timed["status"])) == {"tail_bug": "wrong", "right": "ok"}
    # Tuples and dicts output by output; a 0-d output; an integer output stays exact; NaN where the reference has it.
    ref = {"a": torch.tensor([1.0, 2.0, math.nan], dtype=torch.float64), "b": torch.tensor(3.0, dtype=torch.float64),
           "i": torch.tensor([1, 2])}
    out = {"a": torch.tensor([1.0, 2.0, math.nan]), "b": torch.tensor(3.0), "i": torch.tensor([1, 2])}
    assert harness.compare(out, ref, per_element=True)["ok"]
    assert not harness.compare({**out, "b": torch.tensor(3.1)}, ref, per_element=True)["ok"]


def test_case_names_must_be_unique():
    cases = [harness.Case("same", (torch.rand(4),)), harness.Case("same", (torch.rand(4),))]
    with pytest.raises(ValueError, match="unique"):
        harness.check({"torch": lambda x: 2 * x}, reference=lambda x: 2 * x, cases=cases)


def test_vendor_peaks():
    assert floors.vendor_peak_gbps("NVIDIA H100 80GB HBM3") == 3350
    assert floors.vendor_peak_gbps("NVIDIA H100 PCIe") == 2000
    assert floors.vendor_peak_gbps("NVIDIA H200") == 4800
    assert floors.vendor_peak_gbps("NVIDIA A100-SXM4-80GB") == 2039
    assert floors.vendor_peak_gbps("NVIDIA A100-PCIE-40GB") == 1555
    assert floors.vendor_peak_gbps("NVIDIA A10") == 600
    assert floors.vendor_peak_gbps("NVIDIA GH200 480GB") is None  # its memory is not the H200's
    assert floors.vendor_peak_gbps("Some Future GPU") is None


def test_read_kernel_compiles():
    """The floor's CUDA kernel builds here too (nvcc needs no GPU); it runs in the GPU tests."""
    assert hasattr(floors.load_read_kernel(), "read_floor")


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_read_kernel_reads_every_byte():
    for nbytes in (16, 16 * 1000 + 16, 64 << 20):
        words = torch.randint(-2**31, 2**31, (nbytes // 4,), dtype=torch.int64).to(torch.int32)
        expected = np.bitwise_xor.reduce(words.numpy().view(np.uint32))
        for unroll in (1, 2, 4, 8):
            blocks = floors.read_words(words.cuda(), unroll).cpu().numpy().view(np.uint32)
            assert np.bitwise_xor.reduce(blocks) == expected, (nbytes, unroll)
    with pytest.raises(ValueError, match="multiple of 16"):
        floors.read_words(torch.zeros(3, device="cuda"))
    with pytest.raises(ValueError, match="unroll"):
        floors.read_words(torch.zeros(4, device="cuda"), 3)


@pytest.mark.gpu
def test_floor_is_the_best_source():
    floor = floors.measure_floor("cuda")
    assert set(floor.sources) == {"torch_sum", "read_kernel"}
    assert floor.gbps == max(floor.sources.values())
    # (Which source is faster is a benchmark's finding, recorded with each run as floor_source, not a test's: a
    # speed target here failed or passed with the card's spread.) Above the data sheet, the measure is wrong.
    peak = floors.device_peak_gbps("cuda")
    if peak:
        assert floor.gbps < peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_case_on_the_second_gpu_is_checked_and_timed_there():
    # Events, the L2 flush, the poisoned allocator and the floor act on the current GPU: a case on cuda:1 was
    # timed by events on cuda:0's stream, which its kernels never ran on.
    assert torch.cuda.current_device() == 0
    x = torch.rand(1 << 27, device="cuda:1")  # 512 MiB: a sum reads it in ~0.1-0.3 ms on an H100 or an H200
    cases = [harness.Case("cuda:1", (x,))]
    timed = harness.bench({"sum": torch.sum}, cases=cases, reference=torch.sum, reps=5, warmup=2,
                          bytes_moved=lambda x: x.nbytes)
    (row,) = timed.itertuples()
    assert row.status == "ok", row
    assert 0.5 <= row.x_floor <= 5, row  # timed on the GPU that ran it: near its floor, not ~0
    assert torch.cuda.current_device() == 0  # given back as it was


@pytest.mark.gpu
def test_readme_snippet_runs_as_written_on_cuda(tmp_path, monkeypatch):
    """The same block with dev = "cuda" and a CUDA scale2 behind the same name."""
    (tmp_path / "scale2.cu").write_text(SCALE2_CU)
    (tmp_path / "bind.cpp").write_text(SCALE2_CU_BIND)
    mod = kldiv_inline.load_sources([tmp_path / "scale2.cu", tmp_path / "bind.cpp"], name="scale2_cuda")
    monkeypatch.setattr(kldiv_inline, "load_sources", lambda *a, **k: mod)
    scope = {"dev": "cuda"}
    exec(compile(readme_snippet(), "README.md", "exec"), scope)
    assert scope["checked"]["ok"].all() and (scope["timed"]["status"] == "ok").all()
    assert (scope["timed"]["timer"] == "cuda").all() and scope["timed"]["floor_source"].notna().all()
    assert isinstance(scope["fig"], matplotlib.figure.Figure)


@pytest.mark.gpu
def test_poisoned_outputs_catch_a_cuda_kernel_that_skips_elements(tmp_path):
    (tmp_path / "scale2.cu").write_text(SCALE2_CU)
    (tmp_path / "bind.cpp").write_text(SCALE2_CU_BIND)
    mod = kldiv_inline.load_sources([tmp_path / "scale2.cu", tmp_path / "bind.cpp"], name="scale2_cuda")
    cases = _cases("cuda", (1 << 16, 1 << 22))
    df = harness.check({"mine": mod.scale2, "skips": lambda x: mod.scale2(x, 1000)}, reference=lambda x: 2 * x,
                       cases=cases)
    assert dict(zip(df["provider"], df["ok"])) == {"mine": True, "skips": False}
    timed = harness.bench({"mine": mod.scale2, "skips": lambda x: mod.scale2(x, 1000), "torch": lambda x: 2 * x},
                          cases=cases, bytes_moved=lambda x: 2 * x.nbytes)
    assert set(timed[timed["provider"] == "skips"]["status"]) == {"wrong"}
    ok = timed[timed["status"] == "ok"]
    assert (ok["timer"] == "cuda").all() and ok["floor_source"].isin(["torch_sum", "read_kernel"]).all()
    if floors.device_peak_gbps("cuda"):
        assert ok["pct_of_peak"].between(0, 100).all()


def test_copies_keep_the_inputs_strides():
    # A kernel checked or timed on a strided input must get that layout, not a contiguous copy of it: a slice with
    # gaps, a transpose, an expanded (stride 0) view.
    x = torch.randn(6, 8)
    seen = []

    def spy(a, b, c):
        seen.append((a.stride(), b.stride(), c.stride()))
        return a.sum() + b.sum() + c.sum()

    args = (x[:, ::2], x.t(), torch.randn(8).expand(5, 8))
    case = harness.Case("strided", args)
    harness.check({"spy": spy}, reference=lambda a, b, c: a.sum() + b.sum() + c.sum(), cases=[case])
    harness.bench({"spy": spy}, [case], reference=None, reps=1, warmup=0, timer="wall")
    want = tuple(a.stride() for a in args)
    assert seen and all(s == want for s in seen), (seen, want)
    up = harness.upcast(args)
    assert tuple(a.stride() for a in up) == want and all(torch.equal(u, a.double()) for u, a in zip(up, args))


def test_copies_keep_the_inputs_storage_offset_and_alignment():
    # Each copy started its own storage: a view at offset 1 (4 bytes off 16) reached providers at offset 0, aligned,
    # so a kernel that reads from the storage's start (or needs aligned vector loads) passed, and bench timed it
    # on aligned data.
    big = torch.rand(1 << 12)
    x = big[1:]
    seen = []

    def ignores_offset(x):  # the C++ slip: the storage's pointer, not x.data_ptr()
        return 2 * torch.empty(0).set_(x.untyped_storage(), 0, x.shape, x.stride())

    def spy(x):
        seen.append((x.storage_offset(), x.data_ptr() % 16))
        return 2 * x

    case = harness.Case("offset1", (x,))
    checked = harness.check({"ignores_offset": ignores_offset, "spy": spy}, lambda x: 2 * x, [case])
    assert checked.set_index("provider").ok.to_dict() == {"ignores_offset": False, "spy": True}
    harness.bench({"spy": spy}, [case], checked=checked, reps=2, warmup=0)
    assert len(seen) >= 3 and set(seen) == {(1, x.data_ptr() % 16)}, seen
    # Far into a large buffer: the offset stays not 0 and the address keeps its alignment (the CPU's 64 bytes),
    # but the copy holds little more than what the view reaches; views that share memory keep their own offsets.
    far = big[-5:]
    copy, shared, shared2 = harness.clone_args((far, big[9:12], big[10:13]))
    assert copy.storage_offset() > 0 and copy.data_ptr() % 64 == far.data_ptr() % 64, copy.storage_offset()
    assert copy.untyped_storage().nbytes() < 2048 and torch.equal(copy, far)
    assert (shared.storage_offset(), shared2.data_ptr() - shared.data_ptr()) == (9, 4)
    assert torch.equal(harness.upcast((x,))[0], x.double())


def test_sparse_inputs_are_copied_as_they_are():
    x = torch.randn(6, 6).relu().to_sparse()
    case = harness.Case("sparse", (x,))
    df = harness.check({"dense2": lambda a: 2 * a.to_dense()}, reference=lambda a: 2 * a.to_dense(), cases=[case])
    assert bool(df["ok"].iloc[0]), df["error"].iloc[0]
    timed = harness.bench({"dense2": lambda a: 2 * a.to_dense()}, [case], reference=None, reps=1, warmup=0,
                          timer="wall")
    assert timed["status"].iloc[0] == "ok"


def test_a_check_frame_pickles_and_serialises(tmp_path):
    # The record of the callables checked stays in memory: the frame pickles (a lambda would not) and writes as
    # CSV; read back, its verdicts are trusted by name.
    import json
    import pickle

    f = lambda x: 2 * x  # noqa: E731
    cases = [harness.Case("a", (torch.rand(64),))]
    df = harness.check({"m": f}, reference=lambda x: 2 * x, cases=cases)
    back = pickle.loads(pickle.dumps(df))
    json.dumps(df.attrs)
    assert back["ok"].all() and back["check_id"].tolist() == [str(df["check_id"].iloc[0])]
    df.to_csv(tmp_path / "checked.csv", index=False)
    assert pd.read_csv(tmp_path / "checked.csv")["check_id"].iloc[0].startswith("check ")
    timed = harness.bench({"m": f}, cases, checked=back, reps=1, warmup=0, timer="wall")
    assert timed["status"].tolist() == ["ok"]
    with pytest.raises(ValueError, match="check it again"):  # in memory, the record still guards
        harness.bench({"m": lambda x: 3 * x}, cases, checked=df, reps=1, warmup=0, timer="wall")


def test_capture_failure_says_what_to_do(monkeypatch):
    # A capture that CUDA refuses (an eager step's leaf still tied to the default stream) raises an error that
    # says what to do, with CUDA's own beneath it; other errors of the step pass through unchanged. The CUDA
    # pieces are stand-ins here (no GPU needed): only the error's handling is under test.
    import contextlib

    from kldiv_inline import timing

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    capturing = []
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext(capturing.append(g)))
    cuda_says = "CUDA error: operation would make the legacy stream depend on a capturing blocking stream"

    def step():
        if capturing:
            raise RuntimeError(cuda_says)
        return 1

    with pytest.raises(RuntimeError, match="drop that step's outputs") as info:
        timing.capture(step)
    assert cuda_says in str(info.value) and str(info.value.__cause__) == cuda_says
    capturing.clear()

    def wrong():
        if capturing:
            raise RuntimeError("shapes do not match")
        return 1

    with pytest.raises(RuntimeError, match="^shapes do not match$"):
        timing.capture(wrong)


@pytest.mark.gpu
def test_capture_replays_a_training_step():
    # timing.capture: the step (here a backward) runs from the graph on whatever its static leaf holds.
    from kldiv_inline import timing

    x = torch.randn(64, 1000, device="cuda").requires_grad_()

    def step():
        return torch.autograd.grad((x.square() * 0.5).sum(), [x])[0]

    graph, g = timing.capture(step)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g, x.detach())


# ------------------------------------------------------------------- ways a wrong kernel or timing got through
def test_an_unwritten_boolean_element_is_caught(device):
    # Poisoned memory reads True in a boolean tensor, a legal value: a mask whose loop stops one element early
    # passed wherever the truth there is True. check runs such outputs again over memory that held zeros.
    x = torch.rand(1000, device=device)
    x[-1] = 0.9  # the truth at the element left unwritten: True

    def mask(x):
        out = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        out[:-1] = x[:-1] > 0.5
        return out

    def good(x):
        return x > 0.5

    checked = harness.check({"mask": mask, "good": good}, lambda x: x > 0.5, [harness.Case("b", (x,))])
    assert checked.set_index("provider").ok.to_dict() == {"mask": False, "good": True}
    assert "elements left unwritten" in checked.set_index("provider").error["mask"]


def test_an_unwritten_boolean_element_is_caught_against_a_reference_of_floats():
    # The second look ran only where the reference's output was integral: a boolean mask checked against floats
    # (1.0 / 0.0) read its poison, True, as 1.0 and passed with its last element unwritten (an int32 one's poison, its
    # maximum, failed before too: kept beside it as the control).
    x = torch.rand(1000)
    x[-1] = 0.9

    def mask(x, dtype=torch.bool):
        out = torch.empty(x.shape, dtype=dtype)
        out[:-1] = x[:-1] > 0.5
        return out

    providers = {"bool": mask, "int": functools.partial(mask, dtype=torch.int32), "good": lambda x: x > 0.5}
    checked = harness.check(providers, lambda x: (x > 0.5).double(), [harness.Case("b", (x,))]).set_index("provider")
    assert checked.ok.to_dict() == {"bool": False, "int": False, "good": True}, checked.error.to_dict()
    assert "elements left unwritten" in checked.error["bool"]


def test_args_that_share_memory_share_their_copies():
    # A case passing one tensor twice (or overlapping views of one buffer) reached every provider as separate
    # copies: a kernel wrong for aliased inputs, the point of such a case, passed.
    y = torch.rand(1000)

    def axpy_in_place(a, b):  # meant 2 a + b; it writes a first, so b reads 2 a where b is a
        a.mul_(2)
        return a + b

    def seen(a, b, c):
        assert a.data_ptr() == b.data_ptr() and c.data_ptr() == a.data_ptr() + 4 * a.element_size()
        return a + b + c.sum()

    cases = [harness.Case("alias", (y, y))]
    checked = harness.check({"axpy": axpy_in_place}, lambda a, b: 2 * a + b, cases)
    assert not checked.ok.item() and checked.rel_err.item() > 0.3
    ok = harness.check({"seen": seen}, lambda a, b, c: a + b + c.sum(), [harness.Case("views", (y, y, y[4:]))])
    assert ok.ok.item(), ok.error.item()


def test_bench_refuses_a_checked_verdict_for_a_case_rebuilt_otherwise():
    # bench(checked=) took a verdict by the case's name: cases rebuilt under the same names in bfloat16 (a
    # notebook's cases cell edited) were timed "ok" on the float32 check of a kernel wrong in bfloat16.
    def mine(x):
        return 2 * x if x.dtype == torch.float32 else 3 * x

    checked = harness.check({"mine": mine}, lambda x: 2 * x, [harness.Case("n", (torch.rand(64),))])
    # fresh values of the same kind, or more of them (a check of a case's first rows vouches for it): the same case
    for again in (torch.rand(64), torch.rand(1000)):
        timed = harness.bench({"mine": mine}, [harness.Case("n", (again,))], checked=checked, reps=2)
        assert timed.status.item() == "ok"
    for other in (torch.rand(64, dtype=torch.bfloat16), torch.rand(8, 8), torch.rand(128)[::2], torch.rand(64) + 0j):
        with pytest.raises(ValueError, match="'n' is not the case check .* of checked= ran"):
            harness.bench({"mine": mine}, [harness.Case("n", (other,))], checked=checked, reps=2)


def test_bench_refuses_a_checked_verdict_for_a_case_aliased_conjugated_or_shifted_otherwise():
    # The signature held no aliasing, conjugate bit or alignment: a kernel right on (y, z) and wrong on (y, y), one
    # ignoring the conjugate bit, one reading from a 16-byte boundary, were timed "ok" on the other case's check.
    def axpy(a, b):
        a.add_(b)
        a.add_(b)
        return a

    def run(case_args, checked_args):
        checked = harness.check({"axpy": axpy}, lambda a, b: a + 2 * b, [harness.Case("c", checked_args)])
        assert checked.ok.item(), checked.error.item()
        with pytest.raises(ValueError, match="'c' is not the case check .* shared storage"):
            harness.bench({"axpy": axpy}, [harness.Case("c", case_args)], checked=checked, reps=2)

    y, z = torch.rand(64), torch.rand(64)
    run((y, y), (y, z))
    run((torch.rand(64) + 1j, (torch.rand(64) + 1j).conj()), (torch.rand(64) + 1j, torch.rand(64) + 1j))
    base = torch.rand(200)
    run((base[1:65], z), (base[4:68], z))  # 4 bytes past a 16-byte boundary, against on one
    # what the providers get is copies: views of one buffer that do not overlap get copies apart, and a view's
    # copy sits at its offset in an aligned storage, so neither is refused
    buf = torch.rand(2, 64)
    checked = harness.check({"axpy": axpy}, lambda a, b: a + 2 * b, [harness.Case("c", (buf[0], buf[1]))])
    assert harness.bench({"axpy": axpy}, [harness.Case("c", (torch.rand(64), torch.rand(64)))], checked=checked,
                         reps=2).status.item() == "ok"
    # the same kind again (fresh values, the same aliasing and alignment) is the case checked
    checked = harness.check({"axpy": axpy}, lambda a, b: a + 2 * b, [harness.Case("c", (base[4:68], z))])
    timed = harness.bench({"axpy": axpy}, [harness.Case("c", (torch.rand(200)[8:72], torch.rand(64)))],
                          checked=checked, reps=2)
    assert timed.status.item() == "ok"


def test_bench_refuses_a_check_made_before_its_extension_was_rebuilt(scale2_dir, tmp_path):
    # bench(checked=) knew a provider by the callable: a lambda over a notebook's `mod` is the same lambda after the
    # build cell ran again on an edited (wrong) source, and was timed "ok" on the old check's verdict.
    mod = kldiv_inline.load_sources([scale2_dir / "scale2.cpp"], name="scale2")
    providers = {"mine": lambda x: mod.scale2(x), "direct": mod.scale2}
    cases = _cases("cpu")
    checked = harness.check(providers, lambda x: 2 * x, cases)
    assert checked.ok.all(), checked.error
    (tmp_path / "scale2.cpp").write_text(SCALE2_CPP.replace("2.0f * in[i]", "3.0f * in[i]"))
    first, mod = mod, kldiv_inline.load_sources([tmp_path / "scale2.cpp"], name="scale2")
    with pytest.raises(ValueError, match="provider 'mine': since check .* extension 'scale2' was loaded from"):
        harness.bench(providers, cases, checked=checked, reps=2)
    # a module's own function is the build it came from; the edit undone, the lambda calls the build checked
    assert (harness.bench({"direct": first.scale2}, cases, checked=checked, reps=2).status == "ok").all()
    mod = kldiv_inline.load_sources([scale2_dir / "scale2.cpp"], name="scale2")
    assert (harness.bench(providers, cases, checked=checked, reps=2).status == "ok").all()


def test_a_time_below_the_floor_is_warned_about():
    # A provider that caches its result across calls ran at 1e-4 x the floor, reported "ok" without a word.
    cache = {}

    def cached(x):
        key = (x.data_ptr(), x._version)
        if key not in cache:
            cache[key] = 2 * x
        return cache[key]

    floor = floors.Floor("cpu", 1.0, "given", {"given": 1.0})  # 1 GB/s: 8 MB take 8 ms
    with pytest.warns(UserWarning, match="'cached' on case 'c' ran at .* x the floor"):
        timed = harness.bench({"cached": cached}, [harness.Case("c", (torch.rand(1 << 20),))],
                              reference=lambda x: 2 * x, reps=3, floor=floor,
                              bytes_moved=lambda x: 2 * x.numel() * x.element_size())
    assert timed.x_floor.item() < harness.BELOW_FLOOR
    for bad in (-5, math.nan, "8", True):
        with pytest.raises(ValueError, match="bytes_moved returned"):
            harness.bench({"t": lambda x: 2 * x}, [harness.Case("c", (torch.rand(4),))], reference=lambda x: 2 * x,
                          reps=2, bytes_moved=lambda x, bad=bad: bad)


def test_the_cpu_rotates_input_sets_through_its_last_level_cache(monkeypatch):
    # One set of a case that fits in the CPU's last-level cache was read from it at every call but the first,
    # against a floor read from memory: the README's snippet ran "below the floor" on a CPU. Now sets rotate
    # through 3 x that cache, as the GPU's do through its L2; a case beyond twice the cache takes one set.
    monkeypatch.setattr(harness.timing, "llc_bytes", lambda: 1 << 20)
    seen = []

    def spy(x):
        seen.append(x.data_ptr())
        return 2 * x

    harness.bench({"spy": spy}, [harness.Case("small", (torch.rand(1 << 14),))], reference=lambda x: 2 * x, reps=16)
    assert len(set(seen[-16:])) == 8, seen  # (64 KiB a set: 8 sets, the most, in the 16 timed calls)
    seen.clear()
    harness.bench({"spy": spy}, [harness.Case("large", (torch.rand(1 << 20),))], reference=lambda x: 2 * x, reps=4)
    assert len(set(seen[-4:])) == 1  # 4 MiB: read from memory whatever


def test_below_the_floor_on_the_cpu_blames_its_cache_first():
    # The README's snippet on a CPU warned that bytes_moved or a cached result was at fault, while the cause was
    # its inputs staying in the last-level cache (one set, no flush) against a floor read from 1 GiB in memory.
    floor = floors.Floor("cpu", 1e-3, "given", {"given": 1e-3})  # (any time is below it)
    with pytest.warns(UserWarning, match="x the floor: .* Likely its inputs stay in the CPU's caches") as got:
        harness.bench({"torch": lambda x: 2 * x}, [harness.Case("c", (torch.rand(1 << 10),))],
                      reference=lambda x: 2 * x, reps=2, floor=floor, bytes_moved=lambda x: 8 * x.numel())
    assert "Else bytes_moved may count bytes" in str(got[0].message)


def test_a_numpy_float_from_a_provider_is_held_to_float32s_tolerance():
    # numpy's float64 is a float: held to float64's 1e-12, a float32 result (as a Python float is) failed.
    x = torch.rand(100)
    ref = float(x.double().sum())
    got = float(x.sum())  # float32's rounding
    checked = harness.check({"py": lambda x: got, "np": lambda x: np.float64(got)}, lambda x: x.sum(),
                            [harness.Case("s", (x,))])
    assert checked.ok.all() and (checked.tol == harness.TOLERANCE[torch.float32]).all(), (checked, ref)


def test_shared_copies_keep_each_tensors_kind():
    # (the first cut of the shared copies gave every tensor of a storage the first one's conjugate and negative
    # bits, refused wrapper subclasses, which have no storage of their own, and copied the whole span of a large
    # buffer for two far-apart views of it)
    x = torch.randn(6)
    z = torch.randn(6, dtype=torch.complex64)
    neg = torch._neg_view(x)
    got = harness.clone_args((x, neg, z, z.conj()))
    assert torch.equal(got[1], -x) and torch.equal(got[3], z.conj())
    big = torch.randn(1 << 20)
    a, b = harness.upcast((big[:4], big[-4:]))
    assert a.untyped_storage().nbytes() < 1024 and torch.equal(b, big[-4:].double())
    from torch.testing._internal.two_tensor import TwoTensor
    two = TwoTensor(torch.randn(3), torch.randn(3))
    assert torch.equal(harness.clone_args((two, two))[0], two)


def test_the_second_look_fails_no_correct_provider():
    x = torch.rand(64)

    def permuted_half(x):  # unwritten half of a tensor from empty_permuted: caught too
        out = torch.empty_permuted(x.shape, (0,), dtype=torch.bool)
        out[:32] = x[:32] > 0.5
        return out

    def by_cond(x):  # a higher-order op the zeroing mode cannot run: the first look stands
        return torch.cond(x.sum() > 0, lambda v: v > 0.5, lambda v: v < 0.5, (x,))

    def divides_by_unwritten(x):  # raises where its unwritten buffer holds zeros: a failure, not the mode's
        count = torch.empty(1, dtype=torch.int64)  # never written: the poison (int64's maximum), then 0
        7 // int(count[0])
        return x > 0.5

    x[40:] = 0.9
    checked = harness.check({"permuted": permuted_half, "cond": by_cond, "divides": divides_by_unwritten},
                            lambda x: x > 0.5, [harness.Case("b", (x,))]).set_index("provider")
    assert not checked.ok["permuted"] and checked.ok["cond"], checked.error.to_dict()
    assert not checked.ok["divides"] and "ZeroDivisionError" in checked.error["divides"]


def test_a_check_of_smaller_inputs_of_the_same_kind_vouches_for_a_case():
    # Fresh 3-d tensors of other sizes have other strides, and a size passed as a number differs: the same kind of
    # case (they were refused); a transposed input, a string setting changed, are not.
    def f(x, n, how):
        return x * n

    checked = harness.check({"f": f}, f, [harness.Case("c", (torch.rand(2, 3, 8), 3, "a"))])
    for args in ((torch.rand(2, 5, 8), 4, "a"),):
        harness.bench({"f": f}, [harness.Case("c", args)], checked=checked, reps=2,
                      bytes_moved=lambda x, n, how: torch.tensor(x.numel() * 8))  # (a 0-d tensor of bytes)
    for args in ((torch.rand(8, 3, 2).transpose(0, 2), 3, "a"), (torch.rand(2, 3, 8), 3, "b"),
                 (torch.rand(2, 3, 8), 3, torch.float16)):
        with pytest.raises(ValueError, match="is not the case"):
            harness.bench({"f": f}, [harness.Case("c", args)], checked=checked, reps=2)


def test_a_tensor_and_its_conjugate_share_their_copy():
    # x and x.conj() (or a negative view of y) share memory: copied apart, a kernel that must see one through the
    # other (writing x in place, reading x.conj()) was checked on inputs that no longer alias.
    x = torch.randn(64, dtype=torch.complex64)

    def together(a, b):  # a + conj(a) where b is a's conjugate over the same memory, else a wrong number
        return a + b if b.is_conj() and a.data_ptr() == b.data_ptr() else torch.zeros_like(a)

    checked = harness.check({"together": together}, lambda a, b: a + b, [harness.Case("c", (x, x.conj()))])
    assert checked.ok.all(), checked.error.tolist()
    y = torch.randn(64)

    def opposite(a, b):  # 0 where b is a's negative view over the same memory, else a wrong number
        return a + b if b.is_neg() and a.data_ptr() == b.data_ptr() else torch.ones_like(a)

    checked = harness.check({"opposite": opposite}, lambda a, b: a + b, [harness.Case("n", (y, torch._neg_view(y)))])
    assert checked.ok.all(), checked.error.tolist()


def test_a_conjugate_or_negative_view_reaches_the_provider_as_one():
    # The copies resolved the bits: a kernel that reads the memory of x.conj() or of a negative view as if it held
    # their values (the kit's own ops once did, for x.conj().imag) passed a case built to test exactly that.
    z = torch.randn(64, dtype=torch.complex64)
    y = torch.randn(64)

    def as_stored(a):  # what a kernel reading a's memory, blind to its bits, computes: a times 2
        a = a.conj() if a.is_conj() else a
        return 2 * (torch._neg_view(a) if a.is_neg() else a)

    for case in (harness.Case("conj", (z.conj(),)), harness.Case("neg", (torch._neg_view(y),))):
        checked = harness.check({"blind": as_stored, "right": lambda a: 2 * a}, lambda a: 2 * a, [case])
        assert checked.set_index("provider").ok.to_dict() == {"blind": False, "right": True}, case.name
    w = torch._neg_view(torch.randn(8)).requires_grad_()  # still a leaf that takes its gradient
    checked = harness.check({"g": lambda a: torch.autograd.grad((a * a).sum(), a)[0]},
                            lambda a: torch.autograd.grad((a * a).sum(), a)[0], [harness.Case("grad", (w,))])
    assert checked.ok.all(), checked.error.tolist()


def test_a_check_of_a_cases_first_row_is_of_its_memory_order():
    # A [1, V] slice keeps the stride its rows had: the first row of a transposed case is of the transposed kind,
    # and the first row of a row-major case with gaps is not (a comparison that left dimensions of size 1 out took
    # the two for one kind, and a check of one vouched for the other).
    full, gaps = torch.randn(8, 6).t(), torch.randn(6, 16)[:, ::2]
    checked = harness.check({"f": torch.neg}, torch.neg, [harness.Case("c", (full[:1],))])
    harness.bench({"f": torch.neg}, [harness.Case("c", (full,))], checked=checked, reps=2)
    checked = harness.check({"f": torch.neg}, torch.neg, [harness.Case("c", (gaps[:1],))])
    with pytest.raises(ValueError, match="is not the case"):
        harness.bench({"f": torch.neg}, [harness.Case("c", (full,))], checked=checked, reps=2)


def test_a_cases_kind_takes_settings_by_value_and_the_rest_by_type():
    # (a numpy array, a slice or a lambda made again when a notebook cell reruns are the same kind of argument;
    # a dtype or a string setting changed is not)
    def f(x, a, s, fn, dtype):
        return x * 2

    def case(x, a, s, dtype=torch.float32):
        return harness.Case("c", (x, a, s, lambda v: v, dtype))

    checked = harness.check({"f": f}, f, [case(torch.rand(4), np.ones(3), slice(0, 2))])
    harness.bench({"f": f}, [case(torch.rand(9), np.zeros(5), slice(1, 7))], checked=checked, reps=2)
    with pytest.raises(ValueError, match="is not the case"):
        harness.bench({"f": f}, [case(torch.rand(4), np.ones(3), slice(0, 2), torch.float16)], checked=checked,
                      reps=2)


def test_bad_arguments_get_errors_that_say_what_is_expected():
    # Each of these read as something else: a list of providers "'list' object has no attribute 'items'", one Case
    # "'Case' object is not iterable", a setup returning a tensor "the reference raised ... takes 1 positional
    # argument but 100 were given", a bench frame as checked= an AttributeError, a check frame to plot a KeyError;
    # a floor of another device gave x_floor 1419 silently, one of 0 GB/s a ZeroDivisionError.
    x = torch.rand(100)
    cases = [harness.Case("n", (x,))]

    def double(v):
        return 2 * v

    with pytest.raises(TypeError, match="providers must be a mapping"):
        harness.check([double], double, cases)
    with pytest.raises(TypeError, match="provider 'mine' must be a callable"):
        harness.check({"mine": 2.0}, double, cases)
    with pytest.raises(TypeError, match="reference must be a callable"):
        harness.check({"mine": double}, None, cases)
    with pytest.raises(TypeError, match=r"cases must be a list of harness.Case \(`\[Case\(...\)\]` for one\)"):
        harness.check({"mine": double}, double, cases[0])
    with pytest.raises(TypeError, match="cases must be harness.Case objects, not tuple"):
        harness.check({"mine": double}, double, [("n", (x,))])
    # (any iterable of cases, read once: a dict's values, a generator; it was refused, or gave no rows)
    for given in ({"n": cases[0]}.values(), (c for c in cases), tuple(cases)):
        assert harness.check({"mine": double}, double, given).ok.tolist() == [True]
    with pytest.raises(TypeError, match="setup must return the case's arguments as a tuple"):
        harness.check({"mine": double}, double, cases, setup=lambda v: v)
    checked = harness.check({"mine": double}, double, cases)
    timed = harness.bench({"mine": double}, cases, checked=checked, reps=2)
    with pytest.raises(TypeError, match="checked= takes the frame harness.check returned.*bench's"):
        harness.bench({"mine": double}, cases, checked=timed, reps=2)
    with pytest.raises(TypeError, match="plot takes the frame harness.bench returned.*check's"):
        harness.plot(checked)
    with pytest.raises(ValueError, match="case 'n' is on cpu, the floor was measured on cuda"):
        harness.bench({"mine": double}, cases, checked=checked, reps=2, bytes_moved=lambda v: 800,
                      floor=floors.Floor("cuda", 3000.0, "read_kernel", {}))
    with pytest.raises(ValueError, match="floor's bandwidth must be a positive number"):
        harness.bench({"mine": double}, cases, checked=checked, reps=2, floor=floors.Floor("cpu", 0.0, "x", {}))
    with pytest.raises(ValueError, match="floor's device must name a torch device"):
        harness.bench({"mine": double}, cases, checked=checked, reps=2, floor=floors.Floor("gpu", 1.0, "x", {}))
    with pytest.raises(TypeError, match="floor must be a floors.Floor"):
        harness.bench({"mine": double}, cases, checked=checked, reps=2, floor=20.0)
    # (what is right still runs)
    fine = harness.bench({"mine": double}, cases, checked=checked, reps=2, bytes_moved=lambda v: 800,
                         floor=floors.Floor("cpu", 10.0, "torch_sum", {}))
    assert fine.status.item() == "ok" and fine.floor_gbps.item() == 10.0
