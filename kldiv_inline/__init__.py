"""kldiv-inline: KL-divergence kernels compiled at run time from kernels/*.cu and *.cpp.

    import kldiv_inline as K
    K.kl_div(log_probs, target, reduction="batchmean")        # drop-in for F.kl_div, forward and backward
    K.kl_div_from_probs(probs, target)                        # F.kl_div(torch.log(p), t, 'batchmean'), fused
    K.load("cuda")                                            # the compiled module (built on first use)
    K.load_sources(["my_kernel.cu", "bind.cpp"])              # the same loader for your own kernels
    K.generalized_jsd(student_logits, teacher_logits, beta=0.5, temperature=2.0, labels=labels)  # distillation
    K.fused_linear_generalized_jsd(hidden, lm_head.weight, t_hidden, t_head.weight, labels=labels)  # LM head fused

    from kldiv_inline import harness                          # check, time and plot any op against
    harness.check(...), harness.bench(...), harness.plot(...) # float64 PyTorch, its peers and the floor
"""
from . import kernelbench, vocab_parallel
from .distill import GeneralizedJSDLoss, generalized_jsd
from .fused_linear import FusedLinearGeneralizedJSDLoss, fused_linear_generalized_jsd
from .loader import KernelBuildError, ToolchainError, load, load_sources
from .ops import KLDivLoss, kl_div, kl_div_from_probs

__all__ = ["kl_div", "kl_div_from_probs", "KLDivLoss", "generalized_jsd", "GeneralizedJSDLoss",
           "fused_linear_generalized_jsd", "FusedLinearGeneralizedJSDLoss", "load", "load_sources", "KernelBuildError",
           "ToolchainError", "kernelbench", "vocab_parallel"]
