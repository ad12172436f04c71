"""Research variants under kernels/variants/: one self-contained .cu each, all exporting
``kl_div_probs_batchmean(predictions, targets)`` (the seed's problem), built by the same loader.
Adding a variant is adding one file; ``variant_names()`` lists them in file-name order (v0, v1, ...)."""
from __future__ import annotations

from pathlib import Path

from .loader import kernels_root, load_sources

BINDINGS = "variant_bindings.cpp"


def variants_dir() -> Path:
    return kernels_root() / "variants"


def variant_names() -> list[str]:
    return sorted(p.stem for p in variants_dir().glob("*.cu"))


def load_variant(name: str, *, verbose: bool = False):
    """The compiled module of ``kernels/variants/<name>.cu`` (CUDA; built on first use, then cached)."""
    src = variants_dir() / f"{name}.cu"
    if not src.is_file():
        raise ValueError(f"no variant {name!r}; known: {', '.join(variant_names())}")
    return load_sources([src, variants_dir() / BINDINGS], name=f"kldiv_variant_{name}", verbose=verbose)
