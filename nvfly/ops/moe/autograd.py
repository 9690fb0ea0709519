"""The MoE router and token shuffles, differentiable (``torch.autograd.Function``), forward and backward on nvfly's
kernels where they take the tensors (``api.eligibility``), else on the torch references of the same math
(``api.reference_*``, which is how the formulas are tested without a GPU):

- ``dispatch(x, order, top_k)``: rows[i] = x[order[i] // top_k]. Backward: grad_x[t] = the sum of token t's top_k
  rows of the gradient, ``api.combine`` unweighted (the combine kernel).
- ``combine(y, slots, weights)``: out[t] = sum_j weights[t, j] y[slots[t * top_k + j]]. Backward: grad_y[slots[s]] =
  weights[s] grad_out[s // top_k] (``api.spread``: the dispatch kernel, scattering, scaled) and grad_weights[t, j] =
  dot(y[slots[t * top_k + j]], grad_out[t]) (``api.slot_dots``).
- ``route(logits, top_k, renormalize)``: the router's softmax, top-k and renormalisation (one kernel forward). Its
  backward stays on torch: the chosen experts' probabilities recomputed from the logits (softmax, gather,
  renormalise: [T, E] elementwise work) and differentiated by torch's autograd; the expert ids carry no gradient.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from nvfly.ops.moe import api


def _on_nvfly(*tensors: torch.Tensor) -> bool:
    return api.eligibility(*tensors) is None


def _pick(fast: Callable[..., Any], reference: Callable[..., Any], *tensors: torch.Tensor) -> Callable[..., Any]:
    """``fast`` (the kernel's call) where the kernels take ``tensors``, else its torch ``reference``."""
    return fast if _on_nvfly(*tensors) else reference


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, slots = _pick(api.dispatch, api.reference_dispatch, x, order)(x, order, top_k)
        ctx.mark_non_differentiable(slots)
        ctx.save_for_backward(slots)
        ctx.top_k = top_k
        return rows, slots

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor, _grad_slots: Optional[torch.Tensor]) -> tuple:
        (slots,) = ctx.saved_tensors
        grad_rows = grad_rows.contiguous()
        combine = _pick(api.combine, api.reference_combine, grad_rows, slots)
        return combine(grad_rows, slots, None, ctx.top_k), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, slots, weights)
        return _pick(api.combine, api.reference_combine, y, slots, weights)(y, slots, weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        y, slots, weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_y = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_y = _pick(api.spread, api.reference_spread, grad, slots, weights)(grad, slots, weights)
        if ctx.needs_input_grad[2]:
            dots = _pick(api.slot_dots, api.reference_slot_dots, y, slots, grad)(y, slots, grad)
            grad_weights = dots.to(weights.dtype)
        return grad_y, None, grad_weights


def reference_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router on torch: softmax over the experts in float32 (or float64), the top_k, renormalised."""
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    weights, ids = torch.topk(probs, top_k)
    return (weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights), ids


def route_weights(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The routing weights of the experts ``ids`` as a function of the logits (what the backward differentiates)."""
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).gather(1, ids)
    return probs / probs.sum(dim=-1, keepdim=True) if renormalize else probs


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        nvfly_takes = top_k <= min(api.MAX_TOP_K, logits.shape[-1]) and logits.shape[-1] <= api.MAX_EXPERTS
        run = _pick(api.route, reference_route, logits) if nvfly_takes else reference_route
        weights, ids = run(logits, top_k, renormalize)
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(logits, ids)
        ctx.renormalize = renormalize
        return weights, ids

    @staticmethod
    def backward(ctx: Any, grad_weights: torch.Tensor, _grad_ids: Optional[torch.Tensor]) -> tuple:
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            (grad,) = torch.autograd.grad(route_weights(leaf, ids, ctx.renormalize), leaf, grad_weights)
        return grad, None, None


def dispatch(x: torch.Tensor, order: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``api.dispatch`` (with respect to x): (rows, slots)."""
    return _Dispatch.apply(x, order, top_k)


def combine(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Differentiable ``api.combine`` (with respect to y and the weights)."""
    return _Combine.apply(y, slots, weights)


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``api.route`` (the weights with respect to the logits): (weights, ids)."""
    return _Route.apply(logits, top_k, bool(renormalize))
