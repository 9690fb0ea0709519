"""The host side of the MoE router and token shuffles (``kernels.py``): argument checks, eligibility,
per-signature plans (``nvfly.ops.common.opcall``) and the launches.

    weights, ids = route(logits, top_k)           # softmax, top-k, renormalised: [T, k] float32, int64
    order, offs = sort_by_expert(ids, experts)   # the routing slots grouped by expert, the experts' ends
    rows, slots = dispatch(x, order, top_k)      # rows[i] = x[order[i] // top_k]; slots[order[i]] = i
    out = combine(y, slots, weights)             # out[t] = sum_j weights[t, j] * y[slots[t * top_k + j]]

and the shuffles' gradients (``nvfly.ops.moe.autograd``), on the same kernels:

    grad_x = combine(grad_rows, slots, None, k)  # the dispatch's: each token's k rows summed (unweighted)
    grad_y = spread(grad_out, slots, weights)    # the combine's: grad_y[slots[s]] = weights[s] * grad_out[s // k]
    grad_w = slot_dots(y, slots, grad_out)       # the combine's: grad_w[t, j] = y[slots[t * k + j]] . grad_out[t]

``reference_*``: each call on torch (any device and dtype; differentiable), the definitions the kernels and the
autograd formulas are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

from nvfly.ops.common.opcall import Declined, OpCalls
from nvfly.ops.moe.kernels import (moe_combine_kernel, moe_dispatch_kernel, moe_route_kernel, moe_slot_dot_kernel,
                                   moe_sort_kernel)
from nvfly.runtime.torch_args import layout_key, vector_width

if TYPE_CHECKING:
    import torch

ROW_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")
MAX_THREADS = 256  # a block's threads: one 16-byte vector each (a 2048-column bf16 row per block)
MAX_EXPERTS = 1024  # the sort's one block has a thread per expert
SORT_THREADS = 1024  # the sort's block (fewer for fewer slots)
MAX_TOP_K = 32  # the router's warp keeps the j-th expert in lane j
ROUTE_WARPS = 4  # tokens a router block takes (a warp each)


@dataclass(frozen=True)
class ShufflePlan:
    """Blocks of ``threads`` threads moving ``vec`` elements each: ``column_blocks`` blocks per row of H."""
    vec: int
    threads: int
    column_blocks: int


def shuffle_plan(h: int, vec: int) -> ShufflePlan:
    """Whole rows per block up to MAX_THREADS vectors (the block count stays rows x a few: launches are cheap, and
    every thread has one vector to move), in warps."""
    vectors = -(-h // vec)
    threads = min(MAX_THREADS, -(-vectors // 32) * 32)
    return ShufflePlan(vec, threads, -(-vectors // threads))


# ---------------------------------------------------------------------------------------------- checks
def _rows_check(name: str, t: Any) -> None:
    import torch
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [rows, H], got shape {tuple(t.shape)}")
    if str(t.dtype) not in ROW_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported (bfloat16, float16, float32)")


def _index_check(name: str, t: Any, numel: int) -> None:
    import torch
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected an int64 or int32 tensor")
    if t.dim() != 1 or t.numel() != numel:
        raise ValueError(f"{name}: expected a 1-D tensor of {numel} elements, got shape {tuple(t.shape)}")


def check_dispatch(x: Any, order: Any, top_k: Any) -> None:
    _rows_check("x", x)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: expected a positive int, got {top_k!r}")
    _index_check("order", order, x.shape[0] * top_k)


def check_route(logits: Any, top_k: Any) -> None:
    _rows_check("logits", logits)
    experts = logits.shape[1]
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"logits: expected 1 to {MAX_EXPERTS} experts (columns), got {experts}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(MAX_TOP_K, experts):
        raise ValueError(f"top_k: expected an int in [1, {min(MAX_TOP_K, experts)}], got {top_k!r}")


def check_sort(ids: Any, experts: Any) -> None:
    import torch
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError("ids: expected an int64 or int32 tensor of expert ids")
    if isinstance(experts, bool) or not isinstance(experts, int) or not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"experts: expected an int in [1, {MAX_EXPERTS}], got {experts!r}")


def _weights_check(weights: Any, slots: Optional[int], rows: str = "") -> None:
    """A 2-D float32 tensor of ``slots`` elements (None: any)."""
    import torch
    if not isinstance(weights, torch.Tensor) or weights.dim() != 2 or weights.dtype != torch.float32:
        raise TypeError("weights: expected a 2-D float32 tensor [tokens, top_k]")
    if slots is not None and weights.numel() != slots:
        raise ValueError(f"weights: {tuple(weights.shape)} holds {weights.numel()} routing slots, {rows}")


def check_combine(y: Any, slots: Any, weights: Any, top_k: Any = None) -> None:
    """``weights`` None (an unweighted sum): ``top_k`` gives the slots per token."""
    _rows_check("y", y)
    if weights is None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1 or y.shape[0] % top_k:
            raise ValueError(f"top_k: expected a positive int dividing y's {y.shape[0]} rows, got {top_k!r}")
    else:
        _weights_check(weights, y.shape[0], f"y has {y.shape[0]} rows")
    _index_check("slots", slots, y.shape[0])


def check_spread(grad: Any, slots: Any, weights: Any) -> None:
    _rows_check("grad", grad)
    _weights_check(weights, None)
    if weights.shape[0] != grad.shape[0]:
        raise ValueError(f"weights: expected [{grad.shape[0]}, top_k] (grad's tokens), got {tuple(weights.shape)}")
    _index_check("slots", slots, weights.numel())


def check_slot_dots(y: Any, slots: Any, grad: Any) -> None:
    _rows_check("y", y)
    _rows_check("grad", grad)
    if grad.shape[1] != y.shape[1] or grad.shape[0] == 0 and y.shape[0] or y.shape[0] % max(grad.shape[0], 1):
        raise ValueError(f"grad: expected [tokens, {y.shape[1]}] with tokens dividing y's {y.shape[0]} rows, got "
                         f"{tuple(grad.shape)}")
    if grad.dtype != y.dtype:
        raise TypeError(f"grad: dtype {grad.dtype} is not y's {y.dtype}")
    _index_check("slots", slots, y.shape[0])


def eligibility(*tensors: Any) -> Optional[str]:
    """None when the shuffle kernels take these tensors, else why not (the layer then shuffles on torch)."""
    if any(t.device.type != "cuda" for t in tensors):
        return "a tensor is not on CUDA"
    if any(t.is_floating_point() and (t.dim() != 2 or str(t.dtype) not in ROW_DTYPES) for t in tensors):
        return "a float tensor is not 2-D bfloat16, float16 or float32"
    if any(t.dim() == 2 and t.stride(1) != 1 and t.shape[1] > 1 for t in tensors):
        return "rows are not contiguous"
    if any(t.dim() == 1 and t.stride(0) != 1 and t.numel() > 1 for t in tensors):
        return "an index tensor is not contiguous"
    if any(t.numel() >= 1 << 31 for t in tensors):
        return "a tensor has 2**31 elements or more"
    return None


# ---------------------------------------------------------------------------------------------- calls
ROUTE = "nvfly.ops.moe.route"
SORT = "nvfly.ops.moe.sort_by_expert"
DISPATCH = "nvfly.ops.moe.dispatch"
COMBINE = "nvfly.ops.moe.combine"
SPREAD = "nvfly.ops.moe.spread"
SLOT_DOTS = "nvfly.ops.moe.slot_dots"
_ROUTE: OpCalls["_Shuffle"] = OpCalls()
_SORT: OpCalls["_Shuffle"] = OpCalls()
_DISPATCH: OpCalls["_Shuffle"] = OpCalls()
_COMBINE: OpCalls["_Shuffle"] = OpCalls()
_SPREAD: OpCalls["_Shuffle"] = OpCalls()
_SLOT_DOTS: OpCalls["_Shuffle"] = OpCalls()


@dataclass(frozen=True)
class _Shuffle:
    """A call's plan: its output's ``rows`` x ``h`` (the router: tokens x top_k; the sort: slots x experts), the
    launch (None: nothing to do) and its scalars after the tensors."""
    rows: int
    h: int
    launch: Any
    scalars: tuple


def _planned(calls: OpCalls[_Shuffle], op: str, make: Any, *args: Any) -> _Shuffle:
    """The plan of this call's signature (its tensors' layouts, its other arguments with their types), made by
    ``make(*args)`` (which checks them) on a miss."""
    try:
        key = tuple(layout_key(a) if hasattr(a, "data_ptr") else (a, type(a)) for a in args)
        call = calls.get(key)
    except Exception:  # noqa: BLE001 - not tensors: the checks explain
        key = call = None
    return calls.plan(op, key, make, *args) if call is None else call


def _planned_if_taken(calls: OpCalls[Any], op: str, make: Any, tensors: tuple, *args: Any) -> Optional[_Shuffle]:
    """``_planned``, or None where the kernels decline ``tensors`` (``eligibility``): both decided on a signature's
    first call (a decline remembered as ``Declined``), so the hot path is one key and one lookup."""
    try:
        key = tuple(layout_key(a) if hasattr(a, "data_ptr") else (a, type(a)) for a in args)
        call = calls.get(key)
    except Exception:  # noqa: BLE001 - not tensors: the checks explain
        key = call = None
    if call is None:
        reason = eligibility(*tensors)
        call = Declined(reason) if reason else calls.plan(op, None, make, *args)
        calls.remember(key, call)
    return None if type(call) is Declined else call


def _plan(kernel: Any, rows: int, blocks: int, h: int, top_k: int, vec: int, *flags: bool,
          whole_rows: bool = False) -> _Shuffle:
    """A block per row (``whole_rows``: walking the row) or per row and column block."""
    p = shuffle_plan(h, vec)
    grid = (blocks, 1 if whole_rows else p.column_blocks, 1)
    launch = kernel.prepared(grid, p.threads) if blocks and h else None
    return _Shuffle(rows, h, launch, (h, top_k, p.vec, p.threads, *flags))


def _plan_route(logits: "torch.Tensor", top_k: int, renormalize: bool) -> _Shuffle:
    check_route(logits, top_k)
    tokens, experts = logits.shape
    launch = moe_route_kernel.prepared(-(-tokens // ROUTE_WARPS), 32 * ROUTE_WARPS) if tokens else None
    return _Shuffle(tokens, top_k, launch, (tokens, experts, top_k, ROUTE_WARPS, renormalize))


def _plan_sort(ids: "torch.Tensor", experts: int) -> _Shuffle:
    check_sort(ids, experts)
    n = ids.numel()
    threads = max(-(-experts // 32) * 32, min(SORT_THREADS, -(-n // 32) * 32))
    return _Shuffle(n, experts, moe_sort_kernel.prepared(1, threads), (n, experts, threads))


def _plan_dispatch(x: "torch.Tensor", order: "torch.Tensor", top_k: int) -> _Shuffle:
    check_dispatch(x, order, top_k)
    n, h = x.shape[0] * top_k, x.shape[1]
    return _plan(moe_dispatch_kernel, n, n, h, top_k, vector_width(h, (x, None), x.element_size()), False, False)


def _plan_spread(grad: "torch.Tensor", slots: "torch.Tensor", weights: "torch.Tensor") -> _Shuffle:
    check_spread(grad, slots, weights)
    n, h, top_k = weights.numel(), grad.shape[1], weights.shape[1]
    return _plan(moe_dispatch_kernel, n, n, h, top_k, vector_width(h, (grad, None), grad.element_size()), True, True)


def _plan_combine(y: "torch.Tensor", slots: "torch.Tensor", weights: Optional["torch.Tensor"],
                  top_k: Optional[int]) -> _Shuffle:
    check_combine(y, slots, weights, top_k)
    top_k = weights.shape[1] if weights is not None else top_k
    tokens, h = y.shape[0] // top_k, y.shape[1]
    return _plan(moe_combine_kernel, tokens, tokens, h, top_k, vector_width(h, (y, None), y.element_size()),
                 weights is not None)


def _plan_slot_dots(y: "torch.Tensor", slots: "torch.Tensor", grad: "torch.Tensor") -> _Shuffle:
    check_slot_dots(y, slots, grad)
    tokens, h = grad.shape
    top_k = y.shape[0] // tokens if tokens else 1
    vec = vector_width(h, (y, grad), y.element_size())
    return replace(_plan(moe_slot_dot_kernel, tokens, tokens, h, top_k, vec, whole_rows=True), h=top_k)


def route(logits: "torch.Tensor", top_k: int, renormalize: bool = True
          ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(weights float32 [T, top_k], expert ids int64 [T, top_k]) of router ``logits`` [T, E]: the top_k experts of
    each token in order (ties: the lower expert first) and their softmax probabilities over the E experts, or
    renormalised to sum to 1 over the top_k (``renormalize``)."""
    return _route(_planned(_ROUTE, ROUTE, _plan_route, logits, top_k, bool(renormalize)), logits)


def _route(call: _Shuffle, logits: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    import torch
    weights = torch.empty((call.rows, call.h), dtype=torch.float32, device=logits.device)
    ids = torch.empty((call.rows, call.h), dtype=torch.int64, device=logits.device)
    if call.launch is not None:
        call.launch.launch(logits, weights, ids, *call.scalars)
    return weights, ids


def sort_by_expert(ids: "torch.Tensor", experts: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(order int32 [n]: the routing slots (flat indices of ``ids``) grouped by expert, in no fixed order within an
    expert; offs int32 [experts]: the experts' cumulative ends in ``order``) for expert ``ids`` in [0, experts)."""
    return _sort(_planned(_SORT, SORT, _plan_sort, ids, experts), ids)


def _sort(call: _Shuffle, ids: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    import torch
    order = torch.empty(call.rows, dtype=torch.int32, device=ids.device)
    offs = torch.empty(call.h, dtype=torch.int32, device=ids.device)
    call.launch.launch(ids, order, offs, *call.scalars)
    return order, offs


def dispatch(x: "torch.Tensor", order: "torch.Tensor", top_k: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(rows [T * top_k, H]: ``rows[i] = x[order[i] // top_k]``, slots [T * top_k] int64: ``slots[order[i]] = i``)
    for ``order``, a permutation of the T * top_k routing slots (e.g. sorted by expert)."""
    return _dispatch(_planned(_DISPATCH, DISPATCH, _plan_dispatch, x, order, top_k), x, order)


def _dispatch(call: _Shuffle, x: "torch.Tensor", order: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    import torch
    rows = torch.empty((call.rows, call.h), dtype=x.dtype, device=x.device)
    slots = torch.empty(call.rows, dtype=torch.int64, device=x.device)
    if call.launch is not None:
        call.launch.launch(x, order, rows, slots, x, *call.scalars)
    return rows, slots


def spread(grad: "torch.Tensor", slots: "torch.Tensor", weights: "torch.Tensor") -> "torch.Tensor":
    """[T * top_k, H] in grad's dtype: row ``slots[s]`` is ``weights[s // top_k, s % top_k] * grad[s // top_k]`` (in
    float32, rounded once), for ``grad`` [T, H], ``slots`` a permutation of the T * top_k routing slots and float32
    ``weights`` [T, top_k]: the combine's gradient with respect to y (the dispatch kernel, scattering and scaled)."""
    import torch
    call = _planned(_SPREAD, SPREAD, _plan_spread, grad, slots, weights)
    rows = torch.empty((call.rows, call.h), dtype=grad.dtype, device=grad.device)
    if call.launch is not None:
        call.launch.launch(grad, slots, rows, slots, weights.view(-1), *call.scalars)
    return rows


def slot_dots(y: "torch.Tensor", slots: "torch.Tensor", grad: "torch.Tensor") -> "torch.Tensor":
    """float32 [T, top_k]: ``dot(y[slots[t * top_k + j]], grad[t])`` in float32 for ``y`` [T * top_k, H] and ``grad``
    [T, H] (the combine's gradient with respect to its weights)."""
    import torch
    call = _planned(_SLOT_DOTS, SLOT_DOTS, _plan_slot_dots, y, slots, grad)
    out = torch.empty((call.rows, call.h), dtype=torch.float32, device=y.device)
    if call.launch is not None:
        call.launch.launch(y, slots, grad, out, *call.scalars)
    return out


def combine(y: "torch.Tensor", slots: "torch.Tensor", weights: Optional["torch.Tensor"],
            top_k: Optional[int] = None) -> "torch.Tensor":
    """[T, H] in y's dtype: ``out[t] = sum_j weights[t, j] * y[slots[t * top_k + j]]`` in float32, for ``y``
    [T * top_k, H] (a routing slot's expert row at ``slots[slot]``) and float32 routing ``weights`` [T, top_k];
    ``weights`` None: the plain sum of each token's ``top_k`` rows (the dispatch's gradient)."""
    call = _planned(_COMBINE, COMBINE, _plan_combine, y, slots, weights, top_k if weights is None else None)
    return _combine(call, y, slots, weights)


def _combine(call: _Shuffle, y: "torch.Tensor", slots: "torch.Tensor", weights: Optional["torch.Tensor"]
             ) -> "torch.Tensor":
    import torch
    out = torch.empty((call.rows, call.h), dtype=y.dtype, device=y.device)
    if call.launch is not None:
        call.launch.launch(y, slots, y if weights is None else weights, out, *call.scalars)
    return out


# ---------------------------------------------------------------------------------------------- where taken
# The layer's forward (``nvfly.ops.moe``): each call on the kernels where they take its tensors, else None (the
# caller computes it on torch), the eligibility decided with the plan, once per signature.
_ROUTE_TAKEN: OpCalls[Any] = OpCalls()
_SORT_TAKEN: OpCalls[Any] = OpCalls()
_DISPATCH_TAKEN: OpCalls[Any] = OpCalls()
_COMBINE_TAKEN: OpCalls[Any] = OpCalls()


def try_route(logits: "torch.Tensor", top_k: int, renormalize: bool = True
              ) -> Optional[tuple["torch.Tensor", "torch.Tensor"]]:
    """``route``, or None where the kernels decline ``logits``."""
    call = _planned_if_taken(_ROUTE_TAKEN, ROUTE, _plan_route, (logits,), logits, top_k, bool(renormalize))
    return None if call is None else _route(call, logits)


def try_sort_by_expert(ids: "torch.Tensor", experts: int) -> Optional[tuple["torch.Tensor", "torch.Tensor"]]:
    """``sort_by_expert``, or None where the kernels decline ``ids``."""
    call = _planned_if_taken(_SORT_TAKEN, SORT, _plan_sort, (ids,), ids, experts)
    return None if call is None else _sort(call, ids)


def try_dispatch(x: "torch.Tensor", order: "torch.Tensor", top_k: int
                 ) -> Optional[tuple["torch.Tensor", "torch.Tensor"]]:
    """``dispatch``, or None where the kernels decline x or ``order``."""
    call = _planned_if_taken(_DISPATCH_TAKEN, DISPATCH, _plan_dispatch, (x, order), x, order, top_k)
    return None if call is None else _dispatch(call, x, order)


def try_combine(y: "torch.Tensor", slots: "torch.Tensor", weights: "torch.Tensor") -> Optional["torch.Tensor"]:
    """``combine`` (weighted), or None where the kernels decline the tensors."""
    call = _planned_if_taken(_COMBINE_TAKEN, COMBINE, _plan_combine, (y, slots, weights), y, slots, weights, None)
    return None if call is None else _combine(call, y, slots, weights)


# ---------------------------------------------------------------------------------------------- references
def reference_dispatch(x: "torch.Tensor", order: "torch.Tensor", top_k: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """``dispatch`` on torch: (x[order // top_k], the inverse permutation of order)."""
    import torch
    order = order.long()
    slots = torch.empty_like(order)
    slots[order] = torch.arange(order.numel(), device=order.device)
    return x[order // top_k], slots


def reference_combine(y: "torch.Tensor", slots: "torch.Tensor", weights: Optional["torch.Tensor"],
                      top_k: Optional[int] = None) -> "torch.Tensor":
    """``combine`` on torch (float32 accumulation, or y's dtype where wider)."""
    import torch
    top_k = weights.shape[1] if weights is not None else top_k
    acc = torch.promote_types(y.dtype, torch.float32)
    rows = y[slots.long()].view(-1, top_k, y.shape[1]).to(acc)
    if weights is not None:
        rows = rows * weights.to(acc).unsqueeze(-1)
    return rows.sum(dim=1).to(y.dtype)


def reference_spread(grad: "torch.Tensor", slots: "torch.Tensor", weights: "torch.Tensor") -> "torch.Tensor":
    """``spread`` on torch."""
    import torch
    acc = torch.promote_types(grad.dtype, torch.float32)
    top_k = weights.shape[1]
    scaled = (grad.to(acc).repeat_interleave(top_k, dim=0) * weights.reshape(-1, 1).to(acc)).to(grad.dtype)
    return scaled.new_empty(scaled.shape).index_copy(0, slots.long(), scaled)


def reference_slot_dots(y: "torch.Tensor", slots: "torch.Tensor", grad: "torch.Tensor") -> "torch.Tensor":
    """``slot_dots`` on torch (in float32, or float64 for float64 inputs)."""
    import torch
    acc = torch.promote_types(y.dtype, torch.float32)
    tokens = grad.shape[0]
    rows = y[slots.long()].view(tokens, -1, y.shape[1]).to(acc)
    return (rows * grad.to(acc).unsqueeze(1)).sum(dim=-1)
