"""nvfly's grouped GEMM (MoE experts) in PyTorch: custom ops, autograd, and the eager route of ``torch._grouped_mm``
/ ``F.grouped_mm``.

- ``nvfly::grouped_mm(a, b, offs=None, *, out_dtype=None, fuse="none")``: ``torch._grouped_mm``'s semantics
  (2-D x 3-D with offsets, 2-D x 2-D grouped along K, 3-D x 3-D), ``fuse="silu_mul"`` the fused gate/up
  projection; differentiable (the backward GEMMs are nvfly grouped GEMMs again), with a fake for torch.compile.
- ``nvfly::grouped_mm_masked(a, b, counts, *, out_dtype=None, fuse="none")``: the masked layout (inference).
- The route ``aten::_grouped_mm`` (CUDA): under ``nvfly.torch.routing()`` eligible calls (no bias, out_dtype None
  or a's dtype, see ``nvfly.ops.grouped.eligibility``) run on nvfly; torch keeps its autograd formula, whose
  backward calls reach the route again.

Every op falls back to torch when nvfly declines the inputs or raises; the reason is logged and recorded once per
signature (``nvfly explain`` lists the decisions).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import Tensor

from nvfly.ops import grouped
from nvfly.ops.common.opcall import Declined, OpCalls, named
from nvfly.runtime.torch_args import layout_key
from nvfly.torch import routing
from nvfly.torch.gemm_ops import Decision, decisions, record
from nvfly.torch.library import operator, register_fake

log = logging.getLogger("nvfly")

_DECIDED: OpCalls[Any] = OpCalls()  # signature -> True (nvfly runs it) or Declined


def _decision(op: str, a: Tensor, b: Tensor, reason: Optional[str]) -> None:
    problem = f"{tuple(a.shape)}@{tuple(b.shape)} {a.dtype}x{b.dtype} on {a.device}"
    record(Decision("op", op, (a.shape[0] if a.dim() == 3 else 1, a.shape[-2], b.shape[-1], a.shape[-1]),
                    problem, reason=reason))


def _run(op: str, a: Tensor, b: Tensor, offs: Optional[Tensor], out_dtype: Optional[torch.dtype], fuse: str,
         masked: bool) -> Tensor:
    """nvfly's grouped GEMM, or torch's when nvfly declines these operands or failed on them before."""
    key = (layout_key(a), layout_key(b), layout_key(offs), out_dtype, fuse, masked)
    decided = _DECIDED.get(key)
    if decided is None:
        with named(f"nvfly::{op}"):
            grouped.check(a, b, offs, out_dtype, None, fuse, masked)
        reason = grouped.eligibility(a, b, offs, out_dtype, None, fuse, masked)
        decided = Declined(reason) if reason else True
        _DECIDED.remember(key, decided)
        _decision(op, a, b, reason)
    if decided is True:
        try:
            if masked:
                return grouped.grouped_mm_masked(a, b, offs, out_dtype=out_dtype, fuse=fuse)
            return grouped.grouped_mm(a, b, offs, out_dtype=out_dtype, fuse=fuse)
        except Exception as exc:  # never break the model: torch computes this signature from now on
            reason = f"nvfly raised {type(exc).__name__}: {exc}"
            _DECIDED.remember(key, Declined(reason))
            _decision(op, a, b, reason)
            log.warning("nvfly: %s: %s; falling back to torch for these operands", op, reason)
    return torch_grouped_mm(a, b, offs, out_dtype=out_dtype, fuse=fuse, masked=masked)


def torch_grouped_mm(a: Tensor, b: Tensor, offs: Optional[Tensor], *, out_dtype: Optional[torch.dtype] = None,
                     fuse: str = "none", masked: bool = False) -> Tensor:
    """The same product on torch's kernels (routing off): ``torch._grouped_mm`` where torch has it for these
    operands, else a loop over the groups; the masked layout as a batched product with the rows past each count
    left as torch computes them."""
    with routing.routing(False):
        if masked:
            y = torch.bmm(a, b)
        elif hasattr(torch, "_grouped_mm") and a.is_cuda and (out_dtype in (None, a.dtype)):
            y = torch._grouped_mm(a, b, offs)
        else:
            y = _loop_grouped_mm(a, b, offs)
        if fuse == "silu_mul":
            half = y.shape[-1] // 2
            y = torch.nn.functional.silu(y[..., :half]) * y[..., half:]
        return y.to(out_dtype) if out_dtype is not None else y


def _loop_grouped_mm(a: Tensor, b: Tensor, offs: Optional[Tensor]) -> Tensor:
    if offs is None:
        return torch.bmm(a, b)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a[s:e] @ b[g]
        return out
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])


# ---------------------------------------------------------------------------------------------- custom ops
@operator("grouped_mm")
def grouped_mm(a: Tensor, b: Tensor, offs: Optional[Tensor] = None, *, out_dtype: Optional[torch.dtype] = None,
               fuse: str = "none") -> Tensor:
    """``torch._grouped_mm(a, b, offs, out_dtype=out_dtype)`` on nvfly (``fuse="silu_mul"``: silu(gate) * up of
    gate/up weights [.., K, 2I])."""
    return _run("grouped_mm", a, b, offs, out_dtype, fuse, False)


@operator("grouped_mm_masked")
def grouped_mm_masked(a: Tensor, b: Tensor, counts: Tensor, *, out_dtype: Optional[torch.dtype] = None,
                      fuse: str = "none") -> Tensor:
    """The masked layout: a [E, Mmax, K] x b [E, K, N], group g's first counts[g] rows."""
    return _run("grouped_mm_masked", a, b, counts, out_dtype, fuse, True)


def _grouped_mm_fake(a: Tensor, b: Tensor, offs: Optional[Tensor] = None, *,
                     out_dtype: Optional[torch.dtype] = None, fuse: str = "none") -> Tensor:
    with named("nvfly::grouped_mm"):
        _, shape, _ = grouped.check(a, b, offs, out_dtype, None, fuse)
    return a.new_empty(shape, dtype=out_dtype or a.dtype)


def _grouped_mm_masked_fake(a: Tensor, b: Tensor, counts: Tensor, *, out_dtype: Optional[torch.dtype] = None,
                            fuse: str = "none") -> Tensor:
    with named("nvfly::grouped_mm_masked"):
        _, shape, _ = grouped.check(a, b, counts, out_dtype, None, fuse, True)
    return a.new_empty(shape, dtype=out_dtype or a.dtype)


register_fake("grouped_mm", _grouped_mm_fake)
register_fake("grouped_mm_masked", _grouped_mm_masked_fake)


# ---------------------------------------------------------------------------------------------- autograd
def _setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Tensor) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)
    ctx.fuse = keyword_only_inputs.get("fuse", "none")


def _backward(ctx: Any, grad: Tensor) -> tuple:
    """dA = dY @ B^T and dB = A^T @ dY group by group, as grouped GEMMs again: 2-D x 3-D gives dA in the same
    layout and dB grouped along K; 2-D x 2-D gives both as 2-D x 3-D products of the transposes; 3-D x 3-D batched
    products. The fused gate/up recomputes gate and up (one grouped GEMM) and backpropagates silu(gate) * up into
    them first."""
    a, b, offs = ctx.saved_tensors
    if ctx.fuse == "silu_mul":
        h = grouped_mm(a, b, offs).float()
        half = h.shape[-1] // 2
        gate, up = h[..., :half], h[..., half:]
        sig = torch.sigmoid(gate)
        g = grad.float()
        grad = torch.cat([g * up * sig * (1 + gate * (1 - sig)), g * gate * sig], dim=-1).to(a.dtype)
    grad = grad.to(a.dtype)
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_a = grad_b = None
    if a.dim() == 2 and b.dim() == 3:
        grad_a = grouped_mm(grad, b.mT, offs) if need_a else None
        grad_b = grouped_mm(a.mT, grad, offs) if need_b else None
    elif a.dim() == 3:
        grad_a = torch.bmm(grad, b.mT) if need_a else None
        grad_b = torch.bmm(a.mT, grad) if need_b else None
    else:  # 2-D x 2-D, out[g] = a[:, K_g] @ b[K_g]: dA[:, K_g]^T = b[K_g] @ dY[g]^T, dB[K_g] = a[:, K_g]^T @ dY[g]
        grad_a = grouped_mm(b, grad.mT, offs).mT if need_a else None
        grad_b = grouped_mm(a.mT, grad, offs) if need_b else None
    return grad_a, grad_b, None


torch.library.register_autograd("nvfly::grouped_mm", _backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------- explain
def explain_grouped(groups: int, m: int, n: int, k: int, *, layout: str = "contiguous", fuse: str = "none",
                    b_major: str = "K", rows_per_group: Optional[float] = None) -> str:
    """``nvfly explain --groups``: what nvfly runs for a grouped GEMM (``layout`` "contiguous": m routed rows in
    all, "masked": m rows of capacity a group, "kgrouped": an m x n output a group, k the sum of the groups' K),
    what it cannot run, and the grouped decisions of this process."""
    lines = [f"grouped GEMM, {layout}{' + silu_mul' if fuse != 'none' else ''}: {groups} groups, M={m} N={n} K={k}, "
             f"B {b_major}-major (bf16)"]
    try:
        lines.append("  nvfly runs: " + grouped.describe(layout, groups, m, n, k, fuse=fuse, b_major=b_major,
                                                          rows_per_group=rows_per_group))
    except (TypeError, ValueError) as exc:
        lines.append(f"  nvfly declines: {exc}")
    lines.append("  routed: torch._grouped_mm / F.grouped_mm under nvfly.torch.routing() (no bias, out_dtype None "
                 "or a's dtype; the backward's grouped products too); torch.ops.nvfly.grouped_mm under torch.compile")
    lines.append("  not covered: 3-D x 2-D (groups along N), bias, fp32 operands; Inductor's max-autotune grouped-mm "
                 "candidates do not include nvfly yet")
    seen = [d for d in decisions() if d.op.startswith("grouped_mm")]
    if seen:
        lines.append("  decisions in this process:")
        lines += [f"    {d.op} {d.problem}: {d.reason or 'nvfly'}" for d in seen[-10:]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- the route
def _route_eligibility(a: Tensor, b: Tensor, offs: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    if bias is not None:
        return "bias: nvfly's grouped GEMM takes no bias"
    if out_dtype is not None and out_dtype != a.dtype:
        return f"out_dtype: {out_dtype} is not a's dtype (torch refuses it; its error stays torch's)"
    return grouped.eligibility(a, b, offs)


def _route_run(a: Tensor, b: Tensor, offs: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return grouped.grouped_mm(a, b, offs)


routing.register_route("aten::_grouped_mm", _route_eligibility, _route_run)
