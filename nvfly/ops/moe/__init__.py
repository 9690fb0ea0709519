"""A Mixture-of-Experts layer on nvfly's pieces, with no host read of the routing (CUDA-graph safe):

    out = nvfly.ops.moe.moe(x, router_weight, w_gate_up, w_down, top_k)

router logits (nvfly's GEMM) -> softmax, top-k experts per token, renormalised (``route``: one kernel) -> the token
copies grouped by expert and the experts' cumulative ends (``permute``: a counting sort and a copy kernel) -> the
fused gate/up projection with SiLU-and-multiply (one grouped GEMM) -> the down projection (a grouped GEMM) -> the
copies weighted by their routing probabilities and summed back per token (``unpermute``: one kernel). Weights are
F.linear-style: ``router_weight`` [E, H], ``w_gate_up`` [E, 2I, H] (gate rows then up rows), ``w_down`` [E, H, I].
Inputs nvfly declines (CPU tensors, other dtypes) run each piece on torch. Where an input requires grad, the router,
``permute`` and ``unpermute`` are differentiable on nvfly's kernels (``autograd``: the shuffles' gradients are
shuffles again; the router's backward is torch's), the router logits and grouped GEMMs then on torch's autograd
(``nvfly.torch``'s ``torch.ops.nvfly.grouped_mm`` is nvfly's differentiable grouped GEMM, which this layer below
``nvfly.torch`` cannot import). Under ``torch.compile`` the nvfly calls
run eagerly between compiled regions (``torch.compiler.disable``: ``moe`` as one call, each piece as one);
``nvfly.torch`` offers the pieces and the grouped GEMM as traceable custom ops, whose implementations call the
``eager_*`` pieces (the same, without the wrapper: Dynamo never enters an operator's implementation).

Host time: a layer of 64 tokens is host-bound (the H200's host takes longer to issue the launches than the GPU to
run them), so every piece asks nvfly's eligibility once per call signature (``_RUNS``) and the hot path is a
layout key, one dictionary lookup and the prepared launch.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from nvfly.ops import gemm, grouped
from nvfly.ops import topk as topk_op
from nvfly.ops.common.opcall import OpCalls
from nvfly.ops.moe import api, autograd
from nvfly.runtime.torch_args import layout_key

__all__ = ["eager_permute", "eager_route", "eager_unpermute", "moe", "permute", "reference", "route", "unpermute"]


# (piece, its arguments' layouts and options) -> "" when nvfly runs them, else the piece's reason: a layer call
# asks each piece once per signature (the eligibility checks cost more host time than some of the launches)
_RUNS: OpCalls[str] = OpCalls()


def _nvfly_runs(piece: Callable[..., Optional[str]], *args: Any, **options: Any) -> bool:
    """Whether nvfly runs ``piece``'s eligibility's arguments (``piece`` returns None, or a reason)."""
    try:
        key = (piece, *[layout_key(a) if isinstance(a, torch.Tensor) else a for a in args], *options.items())
        reason = _RUNS.get(key)
    except Exception:  # noqa: BLE001 - unhashable: asked every time
        key = reason = None
    if reason is None:
        reason = piece(*args, **options) or ""
        _RUNS.remember(key, reason)
    return not reason


def _wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _router_logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    if not _wants_grad(x, router_weight) and _nvfly_runs(gemm.eligibility, x, router_weight.mT):
        return gemm.matmul(x, router_weight.mT, out_dtype=torch.float32)
    return (x @ router_weight.mT).float()


def _topk(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _nvfly_runs(topk_op.eligibility, probs, k):
        return topk_op.topk(probs, k)
    return torch.topk(probs, k)


def _grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, fuse: str) -> torch.Tensor:
    if not _wants_grad(a, b) and _nvfly_runs(grouped.eligibility, a, b, offs, fuse=fuse):
        return grouped.grouped_mm(a, b, offs, fuse=fuse)
    return _torch_grouped(a, b, offs, fuse)


def _torch_grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, fuse: str) -> torch.Tensor:
    """The per-group loop on torch (reads the offsets on the host): for inputs nvfly declines."""
    if a.is_cuda and hasattr(torch, "_grouped_mm"):
        out = torch._grouped_mm(a, b, offs)
        half = out.shape[-1] // 2
        return torch.nn.functional.silu(out[:, :half]) * out[:, half:] if fuse == "silu_mul" else out
    ends = offs.tolist()
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for g, (s, e) in enumerate(zip([0] + ends[:-1], ends)):
        out[s:e] = a[s:e] @ b[g]
    if fuse == "silu_mul":
        half = out.shape[-1] // 2
        out = torch.nn.functional.silu(out[:, :half]) * out[:, half:]
    return out


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [T, k] float32, expert ids [T, k] int64): softmax over the experts, the top k, their
    probabilities renormalised to sum to 1 (``renormalize``). One kernel (``api.route``); on torch, softmax, topk
    and the renormalisation."""
    return _untraced_route(logits, top_k, bool(renormalize))


def eager_route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` for callers Dynamo never traces (the module doc)."""
    if _wants_grad(logits):
        return autograd.route(logits, top_k, renormalize)
    if top_k <= api.MAX_TOP_K and logits.shape[-1] <= api.MAX_EXPERTS:
        routed = api.try_route(logits, top_k, renormalize)
        if routed is not None:
            return routed
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = _topk(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def permute(x: torch.Tensor, ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token copies grouped by expert [T * k, H], the experts' cumulative ends int32 [E], slots int64 [T * k]: routing
    slot s (token s // k's (s % k)-th expert) is row ``slots[s]`` of the copies). All on the device, no host read:
    a counting sort by expert in one block and the copies with their slots in one kernel (``api``); on torch, a
    stable argsort, a scatter-add count and a gather."""
    return _untraced_permute(x, ids, experts)


def eager_permute(x: torch.Tensor, ids: torch.Tensor, experts: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``permute`` for callers Dynamo never traces (the module doc)."""
    top_k = ids.shape[-1]
    flat = ids.reshape(-1)
    by_expert = api.try_sort_by_expert(flat, experts) if experts <= api.MAX_EXPERTS else None
    if by_expert is not None:
        order, offs = by_expert
    else:
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(experts, dtype=torch.int32, device=x.device)
        offs = torch.cumsum(counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)), 0,
                            dtype=torch.int32)
    if _wants_grad(x):
        rows, slots = autograd.dispatch(x, order, top_k)
        return rows, offs, slots
    dispatched = api.try_dispatch(x, order, top_k)
    rows, slots = dispatched if dispatched is not None else api.reference_dispatch(x, order, top_k)
    return rows, offs, slots


def unpermute(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, H] in y's dtype: each token's expert outputs (rows of ``y`` [T * k, H] at its routing ``slots``) weighted
    by its routing ``weights`` [T, k] and summed in float32 (``api.combine``: one read of y)."""
    return _untraced_unpermute(y, slots, weights)


def eager_unpermute(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``unpermute`` for callers Dynamo never traces (the module doc)."""
    weights = weights.float()
    if _wants_grad(y, weights):
        return autograd.combine(y, slots, weights.contiguous())
    out = api.try_combine(y, slots, weights.contiguous())
    return out if out is not None else api.reference_combine(y, slots, weights)


_untraced_route = torch.compiler.disable(eager_route)
_untraced_permute = torch.compiler.disable(eager_permute)
_untraced_unpermute = torch.compiler.disable(eager_unpermute)


@torch.compiler.disable
def moe(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
        *, renormalize: bool = True, logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The MoE layer's output [T, H] for tokens ``x`` [T, H] (see the module doc); ``logits``: the router's, if
    already computed."""
    experts = w_gate_up.shape[0]
    if logits is None:
        logits = _router_logits(x, router_weight)
    weights, ids = eager_route(logits, top_k, bool(renormalize))
    rows, offs, slots = eager_permute(x, ids, experts)
    hidden = _grouped(rows, w_gate_up.mT, offs, "silu_mul")
    y = _grouped(hidden, w_down.mT, offs, "none")
    return eager_unpermute(y, slots, weights)


def reference(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, *, renormalize: bool = True) -> torch.Tensor:
    """The float32 reference: every token through its top-k experts one by one (torch only)."""
    xf = x.float()
    weights, ids = autograd.reference_route(xf @ router_weight.float().mT, top_k, renormalize)
    out = torch.zeros_like(xf)
    half = w_gate_up.shape[1] // 2
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = xf[token] @ w_gate_up[e].float().mT
        h = torch.nn.functional.silu(h[:, :half]) * h[:, half:]
        out.index_add_(0, token, (h @ w_down[e].float().mT) * weights[token, slot].unsqueeze(-1))
    return out
