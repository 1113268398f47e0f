"""Local block attention with log-sum-exp, forward and backward, and the fp32 merge of partials."""

from megatron_charm.kernels.backends import BlockKernel, available_kernels, select_kernel
from megatron_charm.kernels.merge import merge_partial

__all__ = ["BlockKernel", "available_kernels", "select_kernel", "merge_partial"]
