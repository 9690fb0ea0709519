"""``torch.library`` operators (``nvfly.torch.library.operator``) for nvfly's RMSNorm and TopK, usable in eager code and in torch.compile graphs.

- ``nvfly::rms_norm(x, normalized_shape, weight=None, eps=None) -> (y, rstd)``
- ``nvfly::fused_add_rms_norm(x, residual, normalized_shape, weight=None, eps=None) -> (y, x + residual, rstd)``
- ``nvfly::rms_norm_backward(grad_out, x, normalized_shape, rstd, weight, grad_residual, output_mask)
  -> (grad_x, grad_weight)`` (``grad_weight`` is empty when not asked for or without a weight)
- ``nvfly::topk(x, k, dim=-1, largest=True, sorted=True) -> (values, indices)``

``rstd`` has torch's ``_fused_rms_norm`` shape (the leading dimensions, then ones) and is float32. The norms are
differentiable (their backward is ``nvfly::rms_norm_backward``), and so are TopK's values. Each op has a fake
implementation for tracing. Inputs nvfly declines (another device, an unsupported dtype, ...) are computed
with torch operations, with the same semantics (fp32 math; TopK ties as ``nvfly.ops.topk`` documents).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from nvfly.ops import rmsnorm as _rms
from nvfly.ops.common.opcall import named
from nvfly.ops import topk as _topk
from nvfly.torch.library import operator, register_fake


# ---------------------------------------------------------------------------------------------- references
def _stat_shape(x: Tensor, normalized_shape: Sequence[int]) -> list[int]:
    axis = x.dim() - len(normalized_shape)
    return list(x.shape[:axis]) + [1] * len(normalized_shape)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_reference(x: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor],
                       eps: Optional[float]) -> tuple[Tensor, Tensor]:
    """(y, rstd) with torch operations, accumulating in fp32 (fp64 for fp64 inputs)."""
    acc = _acc_dtype(x.dtype)
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    eps = torch.finfo(acc).eps if eps is None else eps
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps) if dims else torch.ones_like(xf)
    y = xf * rstd
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(x.dtype).contiguous(), rstd.contiguous()


def rms_norm_backward_reference(grad_out: Tensor, x: Tensor, normalized_shape: Sequence[int], rstd: Tensor,
                                weight: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """(grad_x, grad_weight) with torch operations; grad_x is left in the accumulation dtype."""
    acc = _acc_dtype(x.dtype)
    axis = x.dim() - len(normalized_shape)
    dims = list(range(axis, x.dim()))
    xhat = x.to(acc) * rstd.to(acc).reshape(_stat_shape(x, normalized_shape))
    g = grad_out.to(acc) * weight.to(acc) if weight is not None else grad_out.to(acc)
    mean_dot = (g * xhat).mean(dims, keepdim=True) if dims else (g * xhat)
    grad_x = (g - xhat * mean_dot) * rstd.to(acc).reshape(_stat_shape(x, normalized_shape))
    grad_w = (grad_out.to(acc) * xhat).sum(list(range(axis))) if weight is not None else None
    return grad_x, grad_w


def topk_reference(x: Tensor, k: int, dim: int = -1, largest: bool = True) -> tuple[Tensor, Tensor]:
    """TopK with nvfly's tie rule (a stable sort: equal values lowest index first, NaN largest)."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k).contiguous(), indices.narrow(dim, 0, k).contiguous()


# ---------------------------------------------------------------------------------------------- rms_norm
@operator("rms_norm")
def rms_norm(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor] = None,
             eps: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """(y, rstd) of RMSNorm over ``normalized_shape`` (the last dimensions of x)."""
    if _rms.eligibility(x, weight, None, normalized_shape, eps) is None:
        y, _, rstd = _rms.rms_norm_forward(x, weight, eps, None, normalized_shape)
        return y, rstd.view(_stat_shape(x, normalized_shape))
    _check_norm("rms_norm", x, weight, None, eps, normalized_shape)
    return rms_norm_reference(x, normalized_shape, weight, eps)


def _check_norm(op: str, x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], eps: Optional[float],
                normalized_shape: Sequence[int]) -> None:
    """What a norm op and its fake refuse on every device and dtype (nvfly declines the rest: torch computes it)."""
    with named(f"nvfly::{op}"):
        _rms.check_shapes(x, weight, residual, eps, normalized_shape)


def _rms_norm_fake(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor] = None,
                   eps: Optional[float] = None) -> tuple[Tensor, Tensor]:
    _check_norm("rms_norm", x, weight, None, eps, normalized_shape)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(_stat_shape(x, normalized_shape), dtype=_acc_dtype(x.dtype)))


@operator("fused_add_rms_norm")
def fused_add_rms_norm(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor] = None,
                       eps: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual, rstd); the sum is rounded to x's dtype before the norm."""
    if _rms.eligibility(x, weight, residual, normalized_shape, eps) is None:
        y, h, rstd = _rms.rms_norm_forward(x, weight, eps, residual, normalized_shape)
        return y, h, rstd.view(_stat_shape(x, normalized_shape))
    _check_norm("fused_add_rms_norm", x, weight, residual, eps, normalized_shape)
    h = (x + residual).contiguous()
    y, rstd = rms_norm_reference(h, normalized_shape, weight, eps)
    return y, h, rstd


def _fused_add_rms_norm_fake(x: Tensor, residual: Tensor, normalized_shape: list[int],
                             weight: Optional[Tensor] = None, eps: Optional[float] = None
                             ) -> tuple[Tensor, Tensor, Tensor]:
    _check_norm("fused_add_rms_norm", x, weight, residual, eps, normalized_shape)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(_stat_shape(x, normalized_shape), dtype=_acc_dtype(x.dtype)))


@operator("rms_norm_backward")
def rms_norm_backward(grad_out: Tensor, x: Tensor, normalized_shape: list[int], rstd: Tensor,
                      weight: Optional[Tensor], grad_residual: Optional[Tensor],
                      output_mask: list[bool]) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_weight) of ``y = rms_norm(x, weight)`` (+ ``grad_residual``, the gradient of the fused
    variant's ``x + residual`` output, added to grad_x). ``grad_weight`` is empty unless ``output_mask[1]``
    and a weight is given."""
    needs_weight_grad = weight is not None and output_mask[1]
    if _rms.backward_eligibility(x, normalized_shape, grad_out) is None and (
            weight is None or weight.dtype == x.dtype) and (grad_residual is None or grad_residual.dtype == x.dtype):
        grad_x, grad_w = _rms.rms_norm_backward(grad_out, x, rstd.reshape(-1), weight, normalized_shape,
                                                grad_residual, needs_weight_grad)
    else:
        _check_norm_backward(grad_out, x, normalized_shape, rstd, weight, grad_residual)
        grad_x, grad_w = rms_norm_backward_reference(grad_out, x, normalized_shape, rstd, weight)
        if grad_residual is not None:
            grad_x = grad_x + grad_residual
        grad_x = grad_x.to(x.dtype).contiguous()
        grad_w = grad_w.to(weight.dtype) if needs_weight_grad else None
    return grad_x, grad_w if grad_w is not None else x.new_empty((0,))


def _rms_norm_backward_fake(grad_out: Tensor, x: Tensor, normalized_shape: list[int], rstd: Tensor,
                            weight: Optional[Tensor], grad_residual: Optional[Tensor],
                            output_mask: list[bool]) -> tuple[Tensor, Tensor]:
    _check_norm_backward(grad_out, x, normalized_shape, rstd, weight, grad_residual)
    grad_w = torch.empty_like(weight) if weight is not None and output_mask[1] else x.new_empty((0,))
    return torch.empty_like(x, memory_format=torch.contiguous_format), grad_w


def _check_norm_backward(grad_out: Tensor, x: Tensor, normalized_shape: Sequence[int], rstd: Tensor,
                         weight: Optional[Tensor], grad_residual: Optional[Tensor]) -> None:
    with named("nvfly::rms_norm_backward"):
        _rms.check_backward_shapes(grad_out, x, rstd, weight, normalized_shape, grad_residual)


def _save_norm(ctx: Any, normed: Tensor, weight: Optional[Tensor], rstd: Tensor,
               normalized_shape: list[int]) -> None:
    ctx.save_for_backward(normed, weight, rstd)
    ctx.normalized_shape = normalized_shape
    ctx.wants_weight_grad = weight is not None and weight.requires_grad


def _norm_grads(ctx: Any, grad_y: Tensor, grad_residual: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    normed, weight, rstd = ctx.saved_tensors
    grad_x, grad_w = rms_norm_backward(grad_y, normed, ctx.normalized_shape, rstd, weight, grad_residual,
                                       [True, ctx.wants_weight_grad])
    return grad_x, grad_w if ctx.wants_weight_grad else None


def _rms_norm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, normalized_shape, weight, _ = inputs
    _save_norm(ctx, x, weight, output[1], normalized_shape)


def _rms_norm_backward(ctx: Any, grad_y: Tensor, grad_rstd: Tensor) -> tuple:
    grad_x, grad_w = _norm_grads(ctx, grad_y, None)
    return grad_x, None, grad_w, None


def _fused_add_rms_norm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    _, _, normalized_shape, weight, _ = inputs
    _save_norm(ctx, output[1], weight, output[2], normalized_shape)


def _fused_add_rms_norm_backward(ctx: Any, grad_y: Tensor, grad_sum: Tensor, grad_rstd: Tensor) -> tuple:
    # x and residual both receive the gradient of h = x + residual: the norm's plus what reached h directly
    grad_h, grad_w = _norm_grads(ctx, grad_y, grad_sum)
    return grad_h, grad_h, None, grad_w, None


register_fake("rms_norm", _rms_norm_fake)
register_fake("fused_add_rms_norm", _fused_add_rms_norm_fake)
register_fake("rms_norm_backward", _rms_norm_backward_fake)
torch.library.register_autograd("nvfly::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
torch.library.register_autograd("nvfly::fused_add_rms_norm", _fused_add_rms_norm_backward,
                                setup_context=_fused_add_rms_norm_setup)


# ---------------------------------------------------------------------------------------------- topk
@operator("topk")
def topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> tuple[Tensor, Tensor]:
    """(values, int64 indices) like ``torch.topk``; always sorted; ties lowest index first."""
    if _topk.eligibility(x, k, dim, largest, sorted) is None:
        return _topk.topk(x, k, dim, largest, sorted)
    _check_topk(x, k, dim)
    return topk_reference(x, k, dim, largest)


def _check_topk(x: Tensor, k: int, dim: int) -> None:
    with named("nvfly::topk"):
        _topk.check_shapes(x, k, dim)


def _topk_fake(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
               ) -> tuple[Tensor, Tensor]:
    _check_topk(x, k, dim)
    shape = list(x.shape)
    if shape:
        shape[dim] = k
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


def _topk_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, _, dim, _, _ = inputs
    ctx.save_for_backward(output[1])
    ctx.dim = dim
    ctx.shape = x.shape


def _topk_backward(ctx: Any, grad_values: Tensor, grad_indices: Tensor) -> tuple:
    (indices,) = ctx.saved_tensors
    grad_x = grad_values.new_zeros(ctx.shape)
    return grad_x.scatter(ctx.dim, indices, grad_values) if grad_x.dim() else grad_values, None, None, None, None


register_fake("topk", _topk_fake)
torch.library.register_autograd("nvfly::topk", _topk_backward, setup_context=_topk_setup)
