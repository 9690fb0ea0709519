"""nvfly's MoE router and token shuffles as torch operators: differentiable, with fakes, so that ``torch.compile``
traces a whole MoE layer (no graph break) and its backward.

- ``nvfly::moe_route(logits, top_k, renormalize=True) -> (weights, ids)``: softmax, top-k, renormalised
  (``nvfly.ops.moe.route``); backward in closed form on torch ops (``route_backward``).
- ``nvfly::moe_permute(x, ids, experts) -> (rows, offs, slots)``: the token copies grouped by expert
  (``nvfly.ops.moe.permute``); backward ``nvfly::moe_sum_rows`` (each token's top-k gradient rows summed).
- ``nvfly::moe_unpermute(y, slots, weights) -> out``: the weighted sum back per token (``nvfly.ops.moe.unpermute``);
  backward ``nvfly::moe_spread`` (y) and ``nvfly::moe_slot_dots`` (the weights).

Each runs nvfly's kernels where they take the tensors and the torch references of the same math elsewhere (the
pieces of ``nvfly.ops.moe`` decide). With ``torch.ops.nvfly.grouped_mm`` for the experts:

    weights, ids = torch.ops.nvfly.moe_route(x.float() @ router.float().mT, top_k)
    rows, offs, slots = torch.ops.nvfly.moe_permute(x, ids, experts)
    h = torch.ops.nvfly.grouped_mm(rows, w13.mT, offs, fuse="silu_mul")
    out = torch.ops.nvfly.moe_unpermute(torch.ops.nvfly.grouped_mm(h, w2.mT, offs), slots, weights)
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nvfly.ops import moe
from nvfly.ops.common.opcall import named, renamed
from nvfly.ops.moe.autograd import (combine_backward_weights, combine_backward_y, dispatch_backward,
                                    route_backward)
from nvfly.torch.library import operator, register_autograd, register_fake


# ---------------------------------------------------------------------------------------------- checks
def _matrix(name: str, t: Any, what: str = "") -> None:
    if not isinstance(t, Tensor) or t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor{what}, got "
                         f"{f'shape {tuple(t.shape)}' if isinstance(t, Tensor) else type(t).__name__}")


def _check_route(logits: Tensor, top_k: int) -> None:
    _matrix("logits", logits, " [tokens, experts]")
    if not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating-point tensor, got {logits.dtype}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k: expected an int in [1, {logits.shape[1]}] (the experts), got {top_k}")


def _check_permute(x: Tensor, ids: Tensor, experts: int) -> None:
    _matrix("x", x, " [tokens, H]")
    _matrix("ids", ids, " [tokens, top_k]")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids: expected an int64 or int32 tensor, got {ids.dtype}")
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids: {ids.shape[0]} tokens, x has {x.shape[0]}")
    if experts < 1:
        raise ValueError(f"experts: expected a positive int, got {experts}")


def _check_unpermute(y: Tensor, slots: Tensor, weights: Tensor) -> None:
    _matrix("y", y, " [tokens * top_k, H]")
    _matrix("weights", weights, " [tokens, top_k]")
    if not weights.is_floating_point():
        raise TypeError(f"weights: expected a floating-point tensor, got {weights.dtype}")
    if weights.numel() != y.shape[0]:
        raise ValueError(f"weights: {tuple(weights.shape)} holds {weights.numel()} routing slots, y has {y.shape[0]} "
                         "rows")
    if slots.dim() != 1 or slots.shape[0] != y.shape[0]:
        raise ValueError(f"slots: expected a 1-D tensor of {y.shape[0]} elements (y's rows), got shape "
                         f"{tuple(slots.shape)}")


# ---------------------------------------------------------------------------------------------- operators
# The implementations check their arguments without ``named``'s context manager (a µs a call on a host-bound
# layer) and call the pieces' ``eager_*`` forms: Dynamo never enters an operator's implementation.
@operator("moe_route")
def moe_route(logits: Tensor, top_k: int, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    """(routing weights [T, top_k] float32, expert ids [T, top_k] int64) of router ``logits`` [T, E]."""
    try:
        _check_route(logits, top_k)
    except (TypeError, ValueError) as exc:
        raise renamed("nvfly::moe_route", exc) from None
    return moe.eager_route(logits, top_k, renormalize)


@operator("moe_permute")
def moe_permute(x: Tensor, ids: Tensor, experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rows [T * k, H] grouped by expert, the experts' ends int32 [E], slots int64 [T * k]) for ``ids`` [T, k]."""
    try:
        _check_permute(x, ids, experts)
    except (TypeError, ValueError) as exc:
        raise renamed("nvfly::moe_permute", exc) from None
    return moe.eager_permute(x, ids, experts)


@operator("moe_unpermute")
def moe_unpermute(y: Tensor, slots: Tensor, weights: Tensor) -> Tensor:
    """[T, H]: each token's rows of ``y`` at its ``slots`` weighted by ``weights`` [T, k], summed in float32."""
    try:
        _check_unpermute(y, slots, weights)
    except (TypeError, ValueError) as exc:
        raise renamed("nvfly::moe_unpermute", exc) from None
    return moe.eager_unpermute(y, slots, weights)


@operator("moe_sum_rows")
def moe_sum_rows(grad_rows: Tensor, slots: Tensor, top_k: int) -> Tensor:
    """[T, H]: each token's top_k rows (at its slots) summed: ``moe_permute``'s x-gradient."""
    return dispatch_backward(grad_rows, slots, top_k)


@operator("moe_spread")
def moe_spread(grad: Tensor, slots: Tensor, weights: Tensor) -> Tensor:
    """[T * k, H]: row slots[s] = weights[s] * grad[s // k]: ``moe_unpermute``'s y-gradient."""
    return combine_backward_y(grad, slots, weights)


@operator("moe_slot_dots")
def moe_slot_dots(y: Tensor, slots: Tensor, grad: Tensor) -> Tensor:
    """float32 [T, k]: dot(y[slots[t * k + j]], grad[t]): ``moe_unpermute``'s weight-gradient."""
    return combine_backward_weights(y, slots, grad)


def _route_fake(logits: Tensor, top_k: int, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    with named("nvfly::moe_route"):
        _check_route(logits, top_k)
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


def _permute_fake(x: Tensor, ids: Tensor, experts: int) -> tuple[Tensor, Tensor, Tensor]:
    with named("nvfly::moe_permute"):
        _check_permute(x, ids, experts)
    return (x.new_empty((ids.numel(), x.shape[1])), x.new_empty((experts,), dtype=torch.int32),
            x.new_empty((ids.numel(),), dtype=torch.int64))


def _unpermute_fake(y: Tensor, slots: Tensor, weights: Tensor) -> Tensor:
    with named("nvfly::moe_unpermute"):
        _check_unpermute(y, slots, weights)
    return y.new_empty((weights.shape[0], y.shape[1]))


register_fake("moe_route", _route_fake)
register_fake("moe_permute", _permute_fake)
register_fake("moe_unpermute", _unpermute_fake)
register_fake("moe_sum_rows", lambda grad_rows, slots, top_k: grad_rows.new_empty(
    (grad_rows.shape[0] // top_k, grad_rows.shape[1])))
register_fake("moe_spread", lambda grad, slots, weights: grad.new_empty((slots.shape[0], grad.shape[1])))
register_fake("moe_slot_dots", lambda y, slots, grad: grad.new_empty(
    (grad.shape[0], y.shape[0] // grad.shape[0]), dtype=torch.promote_types(y.dtype, torch.float32)))


# ---------------------------------------------------------------------------------------------- autograd
def _route_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    logits, _, renormalize = (*inputs, True)[:3]
    ctx.save_for_backward(logits, output[0], output[1])
    ctx.renormalize = renormalize


def _route_backward(ctx: Any, grad_weights: Tensor, _grad_ids: Any) -> tuple:
    logits, weights, ids = ctx.saved_tensors
    return route_backward(logits, weights, ids, grad_weights, ctx.renormalize), None, None


def _permute_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(output[2])
    ctx.top_k = inputs[1].shape[-1]


def _permute_backward(ctx: Any, grad_rows: Tensor, _grad_offs: Any, _grad_slots: Any) -> tuple:
    (slots,) = ctx.saved_tensors
    return moe_sum_rows(grad_rows.contiguous(), slots, ctx.top_k), None, None


def _unpermute_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _unpermute_backward(ctx: Any, grad: Tensor) -> tuple:
    y, slots, weights = ctx.saved_tensors
    grad = grad.contiguous()
    grad_y = moe_spread(grad, slots, weights.float().contiguous()) if ctx.needs_input_grad[0] else None
    grad_weights = moe_slot_dots(y, slots, grad).to(weights.dtype) if ctx.needs_input_grad[2] else None
    return grad_y, None, grad_weights


register_autograd("moe_route", _route_backward, setup_context=_route_setup)
register_autograd("moe_permute", _permute_backward, setup_context=_permute_setup)
register_autograd("moe_unpermute", _unpermute_backward, setup_context=_unpermute_setup)
