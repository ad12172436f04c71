"""Research variants under kernels/variants/: one self-contained .cu each, all exporting
``kl_div_probs_batchmean(predictions, targets)`` (the seed's problem), built by the same loader.
Adding a variant is adding one file, named ``v<number>_<what>.cu``; ``variant_names()`` lists them in the
order of their numbers (v0, v1, ..., v10). Other .cu files there (a scratch copy, say) are no variant."""
from __future__ import annotations

import re
from pathlib import Path

from .loader import kernels_root, load_sources

BINDINGS = "variant_bindings.cpp"


def variants_dir() -> Path:
    return kernels_root() / "variants"


_VARIANT_RE = re.compile(r"v(\d+)_\w+")


def variant_names() -> list[str]:
    names = [p.stem for p in variants_dir().glob("v*_*.cu") if _VARIANT_RE.fullmatch(p.stem)]
    return sorted(names, key=lambda n: (int(_VARIANT_RE.fullmatch(n)[1]), n))  # v10 after v9, not after v1


def load_variant(name: str, *, verbose: bool = False):
    """The compiled module of ``kernels/variants/<name>.cu`` (CUDA; built on first use, then cached)."""
    src = variants_dir() / f"{name}.cu"
    if not src.is_file():
        raise ValueError(f"no variant {name!r}; known: {', '.join(variant_names())}")
    return load_sources([src, variants_dir() / BINDINGS], name=f"kldiv_variant_{name}", verbose=verbose)
