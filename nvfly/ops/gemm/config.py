"""The dense GEMM kernel's own constants and config helpers. The config space, the epilogue options and the
shared-memory constants it shares with the grouped and scaled kernels are nvfly.ops.common.gemm_config's.

Pure Python (no tracing): plans, the autotuner and the kernel all read these.
"""
from __future__ import annotations

from nvfly.ops.common.gemm_config import ACTIVATIONS, SMEM_LIMIT, Epilogue, GemmConfig, store_box, store_width

REDUCE_THREADS = 256  # threads per block of split_k_reduce_kernel
