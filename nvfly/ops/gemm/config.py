"""The dense GEMM kernel's own constants and config helpers. The config space, the epilogue options and the
shared-memory constants it shares with the grouped and scaled kernels are nvfly.ops.common.gemm_config's.

Pure Python (no tracing): plans, the autotuner and the kernel all read these.
"""
from __future__ import annotations

from typing import Optional

from nvfly.ops.common.gemm_config import ACTIVATIONS, SMEM_LIMIT, Epilogue, GemmConfig, store_box, store_width

REDUCE_THREADS = 256  # threads per block of split_k_reduce_kernel


def load_hint(cfg: GemmConfig, operand: str) -> Optional[str]:
    """The L2 eviction hint of operand ``operand``'s ("A" or "B") loads: None when neither is streamed."""
    if not (cfg.stream_a or cfg.stream_b):
        return None
    return "evict_first" if (cfg.stream_a if operand == "A" else cfg.stream_b) else "evict_last"
