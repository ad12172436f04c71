"""The research variants under kernels/variants/ (v0 seed .. v3): each file holds only its idea, the shared
scaffolding lives in variant_common.cuh, every variant compiles (no GPU needed), and on a GPU v1..v3 match
float64 while v0 keeps the seed's faults that the notebooks show."""
import re

import pytest
import torch

from kldiv_inline.reference import kl_div_reference, probability_rows, relative_error
from kldiv_inline.variants import load_variant, variant_names, variants_dir

VARIANTS = ["v0_seed", "v1_grid_stride", "v2_vectorized", "v3_ratio_log"]
FIXED = VARIANTS[1:]  # the seed's design fixed: xlogy, any shape, a 0-d result
COMMON = "variant_common.cuh"
# Definitions that belong to the shared header only.
SCAFFOLDING = [r"double\s+block_sum\s*\(", r"__global__\s+void\s+final_kernel\s*\(", r"cudaOccupancyMax",
               r"TORCH_CHECK\("]


def test_variant_names():
    assert variant_names() == VARIANTS


def test_variant_names_in_number_order_and_only_variants(tmp_path, monkeypatch):
    # Sorted as strings, v10 came before v1; and any .cu there (a scratch copy) was a variant the bench timed.
    (tmp_path / "variants").mkdir()
    for name in (*VARIANTS, "v10_next", "notes_scratch", "v2b_draft"):
        (tmp_path / "variants" / f"{name}.cu").write_text("")
    monkeypatch.setenv("KLDIV_INLINE_KERNELS", str(tmp_path))
    assert variant_names() == [*VARIANTS, "v10_next"]


def test_a_variant_that_does_not_build_fails_as_one_provider(monkeypatch):
    # It raised out of bench.providers and ended the whole CUDA bench; now its row says why.
    from kldiv_inline import bench, variants

    def broken(name):
        raise RuntimeError(f"{name} does not build")

    monkeypatch.setattr(variants, "load_variant", broken)
    fn = bench._variant("v9_broken")
    with pytest.raises(RuntimeError, match="v9_broken does not build"):
        fn(torch.ones(2), torch.ones(2))


@pytest.mark.parametrize("name", FIXED)
def test_each_variant_holds_only_its_idea(name):
    text = (variants_dir() / f"{name}.cu").read_text()
    assert f'#include "{COMMON}"' in text
    copied = [pattern for pattern in SCAFFOLDING if re.search(pattern, text)]
    assert not copied, f"{name}.cu repeats scaffolding of {COMMON}: {copied}"
    common = (variants_dir() / COMMON).read_text()
    assert all(re.search(pattern, common) for pattern in SCAFFOLDING)


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_variant_compiles(name):
    """nvcc builds it (for TORCH_CUDA_ARCH_LIST, 9.0 without a GPU) and the module imports."""
    module = load_variant(name)
    assert callable(module.kl_div_probs_batchmean)
    if name in FIXED:  # CPU tensors are refused before any CUDA call (they gave the kernels host pointers)
        p = torch.full((2, 3), 1 / 3)
        with pytest.raises(RuntimeError, match="CUDA tensors on one device only"):
            module.kl_div_probs_batchmean(p, p)


def _batchmean(p, t):
    return kl_div_reference(p, t, "batchmean", from_probs=True)


def _rows(shape, **kwargs):
    """Probability rows along the last dimension of `shape`, on the GPU."""
    return probability_rows(int(torch.tensor(shape[:-1]).prod()), shape[-1], device="cuda", **kwargs).view(shape)


@pytest.mark.gpu
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("shape", [(64, 1000), (7, 4099), (3, 5, 129)])
def test_variant_matches_float64(name, shape):
    """Peaked probability rows; an odd number of features takes the scalar tail of the vector loops."""
    if name == "v0_seed" and len(shape) > 2:
        pytest.skip("the seed reads sizes 0 and 1 only (test_seed_keeps_its_faults)")
    p, t = _rows(shape, scale=2.0), _rows(shape, scale=2.0)
    out = load_variant(name).kl_div_probs_batchmean(p, t)
    torch.cuda.synchronize()
    ref = _batchmean(p, t)
    assert out.dtype == torch.float32
    assert relative_error(out.reshape(()), ref) <= 1e-5
    assert out.shape == (() if name in FIXED else (1,))


@pytest.mark.gpu
@pytest.mark.parametrize("name", FIXED)
def test_fixed_variants_on_zero_targets_and_unaligned_views(name):
    """xlogy at t == 0, and inputs that start 4 bytes past a 16-byte boundary (scalar loads throughout)."""
    module = load_variant(name)
    p = probability_rows(33, 513, device="cuda")
    t = probability_rows(33, 513, device="cuda")
    t = t.masked_fill(torch.rand(t.shape, device="cuda") < 0.3, 0.0)
    assert relative_error(module.kl_div_probs_batchmean(p, t), _batchmean(p, t)) <= 1e-5
    flat_p, flat_t = p.flatten()[1:], t.flatten()[1:]
    assert flat_p.data_ptr() % 16 != 0
    out = module.kl_div_probs_batchmean(flat_p.view(1, -1), flat_t.view(1, -1))
    assert relative_error(out, _batchmean(flat_p.view(1, -1), flat_t.view(1, -1))) <= 1e-5
    # A 0-d input: batchmean has no batch to divide by, and F.kl_div gives the sum (it threw after a launch)
    p0, t0 = torch.tensor(0.3, device="cuda"), torch.tensor(0.6, device="cuda")
    assert relative_error(module.kl_div_probs_batchmean(p0, t0), _batchmean(p0, t0)) <= 1e-6


@pytest.mark.gpu
def test_seed_keeps_its_faults():
    """v0 is the seed as it was: notebooks 01 and 03 show these faults, so they must stay."""
    seed = load_variant("v0_seed")
    p = probability_rows(16, 256, device="cuda")
    t = probability_rows(16, 256, device="cuda")
    assert seed.kl_div_probs_batchmean(p, t).shape == (1,)  # not PyTorch's 0-d scalar
    t0 = t.clone()
    t0[0, 0] = 0.0
    assert torch.isnan(seed.kl_div_probs_batchmean(p, t0)).all()  # no xlogy
    p3, t3 = _rows((4, 8, 100)), _rows((4, 8, 100))
    wrong = seed.kl_div_probs_batchmean(p3, t3)  # takes (4, 8, 100) for 4 rows of 8
    assert relative_error(wrong.reshape(()), _batchmean(p3, t3)) > 0.1
