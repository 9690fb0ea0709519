"""Argument checks the attention host paths share (decode's ``api``, ``prefill_api``, ``mla_api``): errors name the op
and the argument (``kv_options.error``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from nvfly.ops.attention.kv_options import OP, error

if TYPE_CHECKING:
    import torch


def tensor_argument(value: Any, name: str, rank: int, op: str = OP) -> None:
    """``value`` is a torch.Tensor of ``rank`` dimensions."""
    import torch
    if not isinstance(value, torch.Tensor):
        raise error(TypeError, name, f"expected a torch.Tensor, got {type(value).__name__}", op)
    if value.dim() != rank:
        raise error(ValueError, name, f"expected {rank} dimensions, got shape {tuple(value.shape)}", op)


def aligned(t: "torch.Tensor") -> bool:
    """16-byte copies of every row: a 16-byte aligned base and every stride but the last a multiple of 16 bytes.
    A fake tensor (torch.compile's tracing) has no address: its storage offset stands for the base (allocations are
    16-byte aligned), and the compiled graph's op checks the real address again when it runs."""
    from torch._subclasses.fake_tensor import is_fake
    base = t.storage_offset() * t.element_size() if is_fake(t) else t.data_ptr()
    return base % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def check_values(cache_seqlens: Any, block_table: Any, capacity: int, pages: int, op: str = OP) -> None:
    """Lengths within the cache and page numbers within k_cache (reads them: a device sync)."""
    if cache_seqlens is not None and cache_seqlens.numel():
        low, high = int(cache_seqlens.min()), int(cache_seqlens.max())
        if low < 0 or high > capacity:
            raise error(ValueError, "cache_seqlens", f"lengths from {low} to {high}, the cache holds {capacity}", op)
    if block_table is not None and block_table.numel():
        low, high = int(block_table.min()), int(block_table.max())
        if low < 0 or high >= pages:
            raise error(ValueError, "block_table", f"page numbers from {low} to {high}, k_cache has {pages} pages",
                        op)


def hopper_reason(q: Any, what: str) -> Optional[str]:
    """None when q is on an sm_90 GPU, else why ``what`` (a kernel family's name) cannot run there."""
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, not CUDA"
    import torch
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"q is on an sm_{major}{minor} GPU: nvfly's {what} needs an sm_90 (Hopper) GPU"
    return None


def require_cuda(q: Any, op: str = OP) -> None:
    if q.device.type != "cuda":
        raise error(ValueError, "q", f"on {q.device.type}; {op} runs on CUDA devices", op)


def sm_count(device: Any) -> int:
    """The SM count the plans are sized for."""
    from nvfly.runtime.driver import plan_sm_count
    return plan_sm_count(device.index if device.index is not None else 0)
