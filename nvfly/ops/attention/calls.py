"""What decode's and MLA decode's cached calls (``api._DecodeCall``, ``mla_api._MlaCall``) share: the out argument's
check, and per call the outputs' allocation and the lengths the kernel reads (docs/ops/attention.md, host path)."""
from __future__ import annotations

from typing import Any, Optional

from nvfly.ops.attention.kv_options import error


def check_out(out: Any, shape: tuple, q: Any, op: str) -> None:
    """``out`` is None or a contiguous tensor of ``shape``, q's dtype and device."""
    import torch
    if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != q.dtype
                            or out.device != q.device or not out.is_contiguous()):
        raise error(ValueError, "out", f"expected a contiguous {shape} {q.dtype} tensor on {q.device}", op)


class CallBuffers:
    """The outputs of a call signature (out of ``out_shape`` in q's dtype; the LSE (B, Hq, Sq) float32 when
    returned) and its lengths: the call's own (int64 converted) or, without any, the default lengths (all of the
    cache): one int32 tensor per (device, batch, capacity) under ``lengths_key``, kept and never written
    (``scratch.constant``), so a call launches no fill."""

    def __init__(self, q: Any, out_shape: tuple, return_lse: bool, cache_seqlens: Any, capacity: int,
                 lengths_key: str):
        import torch
        from nvfly.ops.common import scratch
        batch, sq, hq = q.shape[:3]
        self.batch, self.capacity = batch, capacity
        self.out_shape = out_shape
        self.lse_shape = (batch, hq, sq) if return_lse else None
        self.dtype, self.float32, self.int32 = q.dtype, torch.float32, torch.int32
        self.empty, self.full, self.constant = torch.empty, torch.full, scratch.constant
        self.convert_lengths = cache_seqlens is not None and cache_seqlens.dtype != torch.int32
        self.lengths_key = (lengths_key, batch, capacity)

    def outputs(self, device: Any, out: Any) -> tuple[Any, Optional[Any]]:
        """(out, lse): ``out`` or a new one, and a new LSE or None."""
        if out is None:
            out = self.empty(self.out_shape, dtype=self.dtype, device=device)
        return out, None if self.lse_shape is None else self.empty(self.lse_shape, dtype=self.float32, device=device)

    def lengths(self, device: Any, cache_seqlens: Any) -> Any:
        """The int32 lengths the kernel reads."""
        if cache_seqlens is None:
            return self.constant(device, self.lengths_key, lambda: self.full(
                (self.batch,), self.capacity, dtype=self.int32, device=device))
        return cache_seqlens.to(self.int32) if self.convert_lengths else cache_seqlens
