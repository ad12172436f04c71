"""kldiv-inline: KL-divergence kernels compiled at run time from kernels/*.cu / *.cpp."""
from .loader import KernelBuildError, ToolchainError, load, load_sources

__all__ = ["load", "load_sources", "KernelBuildError", "ToolchainError"]
