"""The MoE router and token shuffles, differentiable (``torch.autograd.Function``), forward and backward on nvfly's
kernels where they take the tensors (``api.eligibility``), else on the torch references of the same math
(``api.reference_*``, which is how the formulas are tested without a GPU):

- ``dispatch(x, order, top_k)``: rows[i] = x[order[i] // top_k]. Backward: grad_x[t] = the sum of token t's top_k
  rows of the gradient, ``api.combine`` unweighted (the combine kernel).
- ``combine(y, slots, weights)``: out[t] = sum_j weights[t, j] y[slots[t * top_k + j]]. Backward: grad_y[slots[s]] =
  weights[s] grad_out[s // top_k] (``api.spread``: the dispatch kernel, scattering, scaled) and grad_weights[t, j] =
  dot(y[slots[t * top_k + j]], grad_out[t]) (``api.slot_dots``).
- ``route(logits, top_k, renormalize)``: the router's softmax, top-k and renormalisation (one kernel forward). Its
  backward stays on torch, in closed form (``route_backward``, a few elementwise ops; the expert ids carry no
  gradient).

The backward pieces (``dispatch_backward``, ``combine_backward_y``, ``combine_backward_weights``,
``route_backward``) are also what ``nvfly.torch``'s operators (``torch.ops.nvfly.moe_*``) differentiate with.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from nvfly.ops.common.opcall import OpCalls
from nvfly.ops.moe import api
from nvfly.runtime.torch_args import layout_key


# the tensors' layouts -> whether the kernels take them (``api.eligibility`` reads nothing else): the backward
# pieces run once or more per layer call, and the checks cost more host time than a lookup
_TAKEN: OpCalls[bool] = OpCalls()


def _on_nvfly(*tensors: torch.Tensor) -> bool:
    try:
        key = tuple([layout_key(t) for t in tensors])
        taken = _TAKEN.get(key)
    except Exception:  # noqa: BLE001 - not tensors: asked every time (the eligibility explains)
        key = taken = None
    if taken is None:
        taken = api.eligibility(*tensors) is None
        _TAKEN.remember(key, taken)
    return taken


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
        return dispatch_backward(grad_rows, slots, ctx.top_k), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, slots, weights)
        return _pick(api.combine, api.reference_combine, y, slots, weights)(y, slots, weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        y, slots, weights = ctx.saved_tensors
        grad_y = combine_backward_y(grad, slots, weights) if ctx.needs_input_grad[0] else None
        grad_weights = combine_backward_weights(y, slots, grad).to(weights.dtype) if ctx.needs_input_grad[2] else None
        return grad_y, None, grad_weights


def dispatch_backward(grad_rows: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """The dispatch's x-gradient: each token's top_k rows of ``grad_rows`` summed (the combine, unweighted)."""
    grad_rows = grad_rows.contiguous()
    return _pick(api.combine, api.reference_combine, grad_rows, slots)(grad_rows, slots, None, top_k)


def combine_backward_y(grad: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The combine's y-gradient: row slots[s] = weights[s] * grad[s // top_k]."""
    grad = grad.contiguous()
    return _pick(api.spread, api.reference_spread, grad, slots, weights)(grad, slots, weights)


def combine_backward_weights(y: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The combine's weight-gradient: dot(y[slots[t * top_k + j]], grad[t]) (float32, float64 for float64)."""
    grad = grad.contiguous()
    return _pick(api.slot_dots, api.reference_slot_dots, y, slots, grad)(y, slots, grad)


def reference_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router on torch: softmax over the experts in float32 (or float64), the top_k, renormalised."""
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    weights, ids = torch.topk(probs, top_k)
    return (weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights), ids


def route_backward(logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor,
                   renormalize: bool) -> torch.Tensor:
    """The router's logit-gradient for the gradient ``grad`` of its ``weights`` (of the experts ``ids``). Renormalised,
    the weights are the softmax of the chosen logits alone: dl[ids[j]] = w_j (g_j - sum_i w_i g_i), zero elsewhere;
    else they are the chosen softmax probabilities p: dl = p * (g scattered to ids - sum_j w_j g_j)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    g, w = grad.to(acc), weights.to(acc)
    inner = (w * g).sum(dim=-1, keepdim=True)
    if renormalize:
        grad_logits = torch.zeros(logits.shape, dtype=acc, device=logits.device).scatter(1, ids, w * (g - inner))
    else:
        probs = torch.softmax(logits.to(acc), dim=-1)
        grad_logits = probs * (torch.zeros_like(probs).scatter(1, ids, g) - inner)
    return grad_logits.to(logits.dtype)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        nvfly_takes = top_k <= min(api.MAX_TOP_K, logits.shape[-1]) and logits.shape[-1] <= api.MAX_EXPERTS
        run = _pick(api.route, reference_route, logits) if nvfly_takes else reference_route
        weights, ids = run(logits, top_k, renormalize)
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(logits, weights, ids)
        ctx.renormalize = renormalize
        return weights, ids

    @staticmethod
    def backward(ctx: Any, grad_weights: torch.Tensor, _grad_ids: Optional[torch.Tensor]) -> tuple:
        logits, weights, ids = ctx.saved_tensors
        return route_backward(logits, weights, ids, grad_weights, ctx.renormalize), None, None


def dispatch(x: torch.Tensor, order: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``api.dispatch`` (with respect to x): (rows, slots)."""
    return _Dispatch.apply(x, order, top_k)


def combine(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Differentiable ``api.combine`` (with respect to y and the weights)."""
    return _Combine.apply(y, slots, weights)


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``api.route`` (the weights with respect to the logits): (weights, ids)."""
    return _Route.apply(logits, top_k, bool(renormalize))
