"""The grouped GEMM's host functions on torch tensors: ``grouped_mm`` (``torch._grouped_mm`` semantics, with an
optional fused gate/up SiLU epilogue), ``grouped_mm_masked`` (the masked layout of CUDA-graph decode), ``check``
and ``eligibility`` (why a call is declined), ``describe`` (what a call runs), ``validate_offsets`` (a host-synced
check of the device sizes), ``reference`` (float32, per group) and ``compile_variants`` (the kernel without a GPU).
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

import nvfly
from nvfly.ops.common.gemm_config import GemmConfig
from nvfly.ops.common.groups import validate_offsets
from nvfly.ops.common.opcall import OpCalls, named
from nvfly.ops.common.operands import OPERAND_DTYPES, hopper_reason, operand_major, tma_reason
from nvfly.ops.grouped.kernel import FUSES, grouped_kernel
from nvfly.ops.grouped.plan import MAX_GROUPS, GroupedPlan, deepest, make_plan
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.tma import cached_descriptor
from nvfly.runtime.torch_args import layout_key

GROUPED_MM = "nvfly.ops.grouped.grouped_mm"
GROUPED_MM_MASKED = "nvfly.ops.grouped.grouped_mm_masked"
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------- checks
def layout_of(a: Any, b: Any, masked: bool = False) -> str:
    """The kernel layout of operands of these ranks: 2-D x 3-D "contiguous", 2-D x 2-D "kgrouped", 3-D x 3-D
    "masked" with counts, else "batched" (3-D x 3-D without offsets: a bmm); raises ValueError for the others."""
    if masked:
        if a.dim() != 3 or b.dim() != 3:
            raise ValueError(f"a, b: the masked layout takes a 3-D a [E, Mmax, K] and a 3-D b [E, K, N], got "
                             f"{a.dim()}-D and {b.dim()}-D")
        return "masked"
    ranks = (a.dim(), b.dim())
    if ranks == (2, 3):
        return "contiguous"
    if ranks == (2, 2):
        return "kgrouped"
    if ranks == (3, 3):
        return "batched"
    if ranks == (3, 2):
        raise ValueError("a, b: a 3-D a with a 2-D b (groups along N) is not supported by nvfly's grouped GEMM")
    raise ValueError(f"a, b: expected 2-D or 3-D operands, got {a.dim()}-D and {b.dim()}-D")


def _tensor_like(t: Any) -> bool:
    """A torch.Tensor, or tensor metadata (shape, strides, dtype, device: Inductor's operands)."""
    return isinstance(t, torch.Tensor) or all(hasattr(t, attr) for attr in ("shape", "dtype", "dim", "stride"))


def check(a: Any, b: Any, offs: Any = None, out_dtype: Optional[torch.dtype] = None, out: Any = None,
          fuse: str = "none", masked: bool = False) -> tuple[str, tuple[int, ...], int]:
    """``product``, then what nvfly's kernel takes of any device: bf16 or fp16 operands; raises TypeError or
    ValueError naming the argument. Returns (layout, output shape, groups)."""
    result = product(a, b, offs, out_dtype, out, fuse, masked)
    if a.dtype not in OPERAND_DTYPES:
        raise TypeError(f"a: dtype {a.dtype} is not supported: nvfly's grouped GEMM takes bf16 or fp16 operands")
    return result


def product(a: Any, b: Any, offs: Any = None, out_dtype: Optional[torch.dtype] = None, out: Any = None,
            fuse: str = "none", masked: bool = False) -> tuple[str, tuple[int, ...], int]:
    """The product's rules, any dtype and device (types, ranks, one operand dtype, shapes that multiply, offsets of
    the right kind): (layout, output shape, groups); raises TypeError or ValueError naming the argument. ``offs`` is
    the masked layout's counts when ``masked``. Takes tensors or their metadata
    (``nvfly.torch.gemm_ops.TensorInfo``). The torch ops and their fakes check this much."""
    offs_name = "counts" if masked else "offs"
    for name, t in (("a", a), ("b", b)):
        if not _tensor_like(t):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if out is not None and not _tensor_like(out):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    if fuse not in FUSES:
        raise ValueError(f"fuse: expected one of {FUSES}, got {fuse!r}")
    layout = layout_of(a, b, masked)
    if b.dtype != a.dtype:
        raise TypeError(f"b: dtype {b.dtype} differs from a's {a.dtype}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: {out_dtype} is not bf16, fp16 or fp32")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"b: shape {tuple(b.shape)} and a's {tuple(a.shape)} do not multiply (K is {a.shape[-1]} "
                         f"in a, {b.shape[-2]} in b)")
    if layout in ("masked", "batched") and a.shape[0] != b.shape[0]:
        raise ValueError(f"b: {b.shape[0]} groups, a has {a.shape[0]}")
    if layout == "batched":
        if offs is not None:
            raise ValueError("offs: 3-D x 3-D operands are a batch of equal groups and take no offsets")
        groups = a.shape[0]
    else:
        if not _tensor_like(offs):
            raise TypeError(f"{offs_name}: expected a 1-D int32 torch.Tensor (required with a 2-D operand), got "
                            f"{type(offs).__name__}")
        if offs.dtype != torch.int32 or offs.dim() != 1:
            raise TypeError(f"{offs_name}: expected a 1-D int32 tensor, got {offs.dim()}-D {offs.dtype}")
        groups = offs.shape[0]
        if not 1 <= groups <= MAX_GROUPS:
            raise ValueError(f"{offs_name}: {groups} groups: nvfly's grouped GEMM takes 1 to {MAX_GROUPS}")
        if layout in ("contiguous", "masked") and groups != b.shape[0]:
            raise ValueError(f"{offs_name}: {groups} groups, b has {b.shape[0]} experts")
    n = b.shape[-1]
    if fuse == "silu_mul":
        if layout == "kgrouped":
            raise ValueError("fuse: the fused gate/up projection takes 3-D weights, not the K-grouped 2-D x 2-D")
        if n % 2:
            raise ValueError(f"b: the fused gate/up projection takes gate and up columns, 2 * I, got N = {n}")
        n //= 2
    if layout == "contiguous":
        shape: tuple[int, ...] = (a.shape[0], n)
    elif layout == "kgrouped":
        shape = (groups, a.shape[0], n)
    else:
        shape = (a.shape[0], a.shape[1], n)
    if out is not None:
        if tuple(out.shape) != shape:
            raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
        if out.dtype != (out_dtype or a.dtype):
            raise TypeError(f"out: expected dtype {out_dtype or a.dtype}, got {out.dtype}")
    return layout, shape, groups


def _layout_reason(a: Any, b: Any, offs: Any, offs_name: str) -> Optional[str]:
    for name, t, kdim in (("a", a, -1), ("b", b, -2)):
        major = operand_major(t, kdim)
        if major is None:
            return f"{name}: neither of its last two dimensions is contiguous"
        reason = tma_reason(name, t, kdim if major == "K" else (-2 if kdim == -1 else -1))
        if reason:
            return reason
    if offs is not None and offs.stride(0) != 1 and offs.shape[0] > 1:
        return f"{offs_name}: not contiguous"
    return None


def _coordinate_reason(layout: str, a: Any, b: Any, fuse: str, n: int) -> Optional[str]:
    """Why a TMA load of the kernel could start at a coordinate of a contiguous dimension that is not a multiple
    of 16 bytes (TMA raises an illegal instruction there), or None. The device offsets are unknown on the host, so
    every contiguous dimension a group boundary can fall in is declined: column-major tokens (a group starts at any
    row), the weight gradient's K-contiguous operands (a group's K starts anywhere), and a fused MN-major B whose
    up columns start at an I of fewer than 16-byte multiples."""
    if layout == "contiguous" and operand_major(a, -1) == "MN":
        return ("a: column-major tokens (rows contiguous): a group may start at any row, and a TMA load cannot start "
                "at a row that is not a multiple of 16 bytes along the contiguous dimension")
    if layout == "kgrouped":
        for name, t, kdim in (("a", a, -1), ("b", b, -2)):
            if operand_major(t, kdim) == "K":
                return (f"{name}: K-contiguous in the K-grouped product: a group's K may start anywhere, and a TMA "
                        f"load cannot start at a K that is not a multiple of 16 bytes along the contiguous dimension")
    if fuse == "silu_mul" and operand_major(b, -2) == "MN" and (n * b.element_size()) % 16:
        return (f"b: the up columns start at column I = {n} of the N-contiguous gate/up weights, not a multiple of "
                f"16 bytes (where a TMA load must start)")
    return None


def eligibility(a: Any, b: Any, offs: Any = None, out_dtype: Optional[torch.dtype] = None, out: Any = None,
                fuse: str = "none", masked: bool = False) -> Optional[str]:
    """None when nvfly runs the call, else why it is declined (``check``'s error, then the device's, then the
    layouts', then the TMA coordinates')."""
    try:
        layout, shape, _ = check(a, b, offs, out_dtype, out, fuse, masked)
    except (TypeError, ValueError) as exc:
        return str(exc)
    offs_name = "counts" if masked else "offs"
    return (hopper_reason("nvfly's grouped GEMM", a, **{offs_name: offs}, b=b, out=out)
            or _layout_reason(a, b, offs, offs_name)
            or _coordinate_reason(layout, a, b, fuse, shape[-1]))


# ---------------------------------------------------------------------------------------------- plans
def plan_of(layout: str, a: torch.Tensor, b: torch.Tensor, shape: tuple, groups: int, fuse: str,
            config: Optional[GemmConfig], rows_per_group: Optional[float] = None,
            out_dtype: Optional[torch.dtype] = None) -> GroupedPlan:
    """The kernel's plan for checked operands of any device (meta included: it reads shapes and strides);
    ``out_dtype`` the output's (default a's)."""
    if layout == "contiguous":
        m, k = a.shape
        rows = m / groups
    elif layout == "masked":
        m, k = a.shape[1], a.shape[2]
        rows = m
    else:
        m, k = a.shape
        rows = k / groups  # a group's K range: its tokens
    if rows_per_group is not None:
        rows = rows_per_group
    return make_plan(layout, fuse, OPERAND_DTYPES[a.dtype].name, groups, operand_major(a, -1),
                     operand_major(b, -2), m, shape[-1], k, rows, plan_sm_count(a.get_device()), config,
                     (out_dtype or a.dtype).itemsize)


class _GroupedCall:
    """The kernel's launch for one call signature: a prepared launch and the descriptors of the addresses seen."""

    def __init__(self, plan: GroupedPlan, shape: tuple, out_dtype: torch.dtype):
        self.plan = plan
        self.shape = shape
        self.out_dtype = out_dtype
        self.main = grouped_kernel.prepared(plan.grid, plan.threads,
                                            (plan.config.cluster_m * plan.config.cluster_n, 1, 1))
        self._descriptors: dict[tuple[int, int, int], tuple[Any, Any, Any]] = {}

    def run(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor) -> None:
        plan = self.plan
        addresses = (a.data_ptr(), b.data_ptr(), out.data_ptr() if plan.store_box else 0)
        descs = self._descriptors.get(addresses)
        if descs is None:
            descs = self._describe(a, b, out)
            if len(self._descriptors) >= 64:
                self._descriptors.clear()
            self._descriptors[addresses] = descs
        out3 = out.unsqueeze(0) if plan.layout == "contiguous" else out
        self.main(descs[0], descs[1], out3, offs, descs[2], plan.m, plan.n, plan.k, plan.k_tiles, plan.config,
                  plan.groups, plan.layout, plan.a_major, plan.b_major, plan.fuse)

    def _describe(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple[Any, Any, Any]:
        """TMA descriptors of the operands viewed with their contiguous dimension last: A as [(E,) rows, K] or
        [(E,) K, rows], B as [(E,) N, K] or [(E,) K, N]; the output's [E, M, N] with the TMA-store epilogue (else
        None)."""
        plan = self.plan
        a_view = a if plan.a_major == "K" else a.transpose(-1, -2)
        b_view = b.transpose(-1, -2) if plan.b_major == "K" else b
        out_desc = cached_descriptor(out, plan.store_box, plan.store_swizzle) if plan.store_box else None
        return (cached_descriptor(a_view, plan.a_box, plan.a_swizzle),
                cached_descriptor(b_view, plan.b_box, plan.b_swizzle), out_desc)


class _ZerosCall:
    """K of zero: every output is zeros (no kernel)."""

    def __init__(self, shape: tuple, out_dtype: torch.dtype):
        self.shape = shape
        self.out_dtype = out_dtype

    def run(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor) -> None:
        out.zero_()


class _NoCall:
    """An empty output: nothing to do."""

    def __init__(self, shape: tuple, out_dtype: torch.dtype):
        self.shape = shape
        self.out_dtype = out_dtype

    def run(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor) -> None:
        return None


class _BatchedCall:
    """3-D x 3-D without offsets: the dense GEMM's batched matmul."""

    def __init__(self, shape: tuple, out_dtype: torch.dtype, config: Optional[GemmConfig]):
        self.shape = shape
        self.out_dtype = out_dtype
        self.config = config

    def run(self, a: torch.Tensor, b: torch.Tensor, offs: Any, out: torch.Tensor) -> None:
        from nvfly.ops.gemm import matmul
        matmul(a, b, out_dtype=self.out_dtype, out=out, config=self.config)


_CALLS: OpCalls[Any] = OpCalls()


def _new_call(a: torch.Tensor, b: torch.Tensor, offs: Any, out_dtype: Optional[torch.dtype], out: Any, fuse: str,
              masked: bool, config: Optional[GemmConfig], rows_per_group: Optional[float]) -> Any:
    layout, shape, groups = check(a, b, offs, out_dtype, out, fuse, masked)
    out_dtype = out_dtype or a.dtype
    reason = eligibility(a, b, offs, out_dtype, out, fuse, masked)
    if reason:
        raise ValueError(reason)
    if layout == "batched" and fuse == "none":
        return _BatchedCall(shape, out_dtype, config)
    if math.prod(shape) == 0:
        return _NoCall(shape, out_dtype)
    if a.shape[-1] == 0:
        return _ZerosCall(shape, out_dtype)
    if layout == "batched":  # fused gate/up of equal groups: the masked layout with full counts
        layout = "masked"
    plan = plan_of(layout, a, b, shape, groups, fuse, config, rows_per_group, out_dtype)
    if plan.store_box and not _tma_storable(out, shape, out_dtype):  # the register epilogue stores any layout
        registers = deepest(replace(plan.config, tma_store=False), groups, layout, plan.b_major, a.dtype.itemsize)
        plan = plan_of(layout, a, b, shape, groups, fuse, registers, rows_per_group, out_dtype)
    return _GroupedCall(plan, shape, out_dtype)


def _tma_storable(out: Optional[torch.Tensor], shape: tuple, out_dtype: torch.dtype) -> bool:
    """Whether a TMA descriptor can cover the output (a new contiguous one when ``out`` is None): its last
    dimension contiguous, the others' strides and its address multiples of 16 bytes."""
    size = out_dtype.itemsize
    strides = out.stride() if out is not None else (shape[-2] * shape[-1], shape[-1], 1)
    return (strides[-1] == 1 and all(s * size % 16 == 0 for s in strides[:-1])
            and (out is None or out.data_ptr() % 16 == 0))


def _bound(op: str, a: Any, b: Any, offs: Any, out_dtype: Any, out: Any, fuse: str, masked: bool, config: Any,
           rows_per_group: Any) -> Any:
    try:
        key = (layout_key(a), layout_key(b), layout_key(offs), layout_key(out), out_dtype, fuse, masked, config,
               rows_per_group)
        call = _CALLS.get(key)
    except Exception:  # noqa: BLE001 - not tensors, an unhashable argument: the checks explain
        key = call = None
    if call is None:
        call = _CALLS.plan(op, key, _new_call, a, b, offs, out_dtype, out, fuse, masked, config, rows_per_group)
    return call


@functools.lru_cache(maxsize=64)
def _full_counts(device: torch.device, groups: int, rows: int) -> torch.Tensor:
    return torch.full((groups,), rows, dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------------------- the ops
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor] = None, *,
               out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None, fuse: str = "none",
               config: Optional[GemmConfig] = None, rows_per_group: Optional[float] = None,
               check_offsets: bool = False) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs, out_dtype=out_dtype)`` on bf16/fp16 operands (fp32 accumulation, bf16, fp16
    or fp32 out), each operand of either major-ness, except where a group boundary would fall in the contiguous
    dimension (column-major tokens, K-contiguous weight-gradient operands: see ``eligibility``):

    - a [T, K] x b [E, K, N] with ``offs`` (int32 [E], cumulative group ends on the device): out [T, N], rows of
      group g from offs[g-1] to offs[g] (the MoE forward: tokens sorted by expert; rows past offs[-1] are not
      written); pass F.linear-style weights [E, N, K] as ``w.mT``;
    - a [M, sum K] x b [sum K, N] with ``offs`` along K: out [E, M, N] (the weight gradient; empty groups: zeros);
    - a [E, M, K] x b [E, K, N]: out [E, M, N] (batched experts).

    ``fuse="silu_mul"``: b holds the gate columns [0, I) then the up columns [I, 2I) and the output is
    silu(a @ gate) * (a @ up), I columns wide (one kernel). The group sizes are never read on the host: groups of
    any size, 0 and smaller than a tile included; offsets that decrease or pass the end are clamped on the device
    (no memory outside the operands is touched); ``check_offsets=True`` checks them first with a host sync
    (``validate_offsets``: a ValueError naming ``offs``). ``config`` a GemmConfig for the kernel (no K split;
    ping-pong, the TMA store and 2-block clusters are options: ``plan.forward_variants``), ``rows_per_group`` the
    heuristic's estimate of a group's rows (default: the average). Raises TypeError or ValueError naming the
    argument when nvfly cannot run it."""
    call = _bound(GROUPED_MM, a, b, offs, out_dtype, out, fuse, False, config, rows_per_group)
    if check_offsets and offs is not None:
        with named(GROUPED_MM):
            validate_offsets(offs, a.shape[0] if b.dim() == 3 else a.shape[1])
    if out is None:
        out = torch.empty(call.shape, dtype=call.out_dtype, device=a.device)
    if type(call) is _GroupedCall and call.plan.layout == "masked":  # fused batched experts: full counts
        offs = _full_counts(a.device, a.shape[0], a.shape[1])
    call.run(a, b, offs, out)
    return out


def grouped_mm_masked(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, *,
                      out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None,
                      fuse: str = "none", config: Optional[GemmConfig] = None,
                      expected_rows: Optional[float] = None, check_offsets: bool = False) -> torch.Tensor:
    """The masked layout (fixed capacity per expert, CUDA-graph decode): a [E, Mmax, K] x b [E, K, N] -> out
    [E, Mmax, N] where group g computes its first ``counts[g]`` rows (int32 [E] on the device, clamped to
    [0, Mmax]); the other rows are not written. ``expected_rows``: the rows a group has on average, for the
    heuristic (default Mmax; DeepGEMM's expected_m). ``fuse``, ``config``, ``check_offsets`` (of the counts) as
    ``grouped_mm``."""
    call = _bound(GROUPED_MM_MASKED, a, b, counts, out_dtype, out, fuse, True, config, expected_rows)
    if check_offsets:
        with named(GROUPED_MM_MASKED):
            validate_offsets(counts, a.shape[1], masked=True, name="counts")
    if out is None:
        out = torch.empty(call.shape, dtype=call.out_dtype, device=a.device)
    call.run(a, b, counts, out)
    return out


def describe(layout: str, groups: int, m: int, n: int, k: int, *, fuse: str = "none", b_major: str = "MN",
             rows_per_group: Optional[float] = None, reason: bool = False) -> str:
    """What ``grouped_mm`` (``grouped_mm_masked`` for "masked") runs on densely packed bf16 operands (A K-major,
    "kgrouped" MN-major; B ``b_major``), planned for an H100/H200 (132 SMs; no GPU needed): the tile, ring and launch;
    with ``reason``, then why the heuristic took that tile (``GroupedPlan.why``), in parentheses."""
    if layout == "contiguous":
        a = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
        b = torch.empty(groups, k, 2 * n if fuse != "none" else n, dtype=torch.bfloat16, device="meta")
    elif layout == "masked":
        a = torch.empty(groups, m, k, dtype=torch.bfloat16, device="meta")
        b = torch.empty(groups, k, 2 * n if fuse != "none" else n, dtype=torch.bfloat16, device="meta")
    else:  # the weight gradient's x.mT (M-contiguous) and dy
        a = torch.empty(k, m, dtype=torch.bfloat16, device="meta").mT
        b = torch.empty(k, n, dtype=torch.bfloat16, device="meta")
    if b_major == "K":
        b = b.mT.contiguous().mT
    shape = (m, n) if layout == "contiguous" else (groups, m, n)
    plan = plan_of(layout, a, b, shape, groups, fuse, None, rows_per_group)  # the call's rows a group by default
    cfg = plan.config
    clusters = (f", {cfg.cluster_m}-block clusters along M (B multicast)" if cfg.cluster_m > 1 else
                f", {cfg.cluster_n}-block clusters along N (A multicast)" if cfg.cluster_n > 1 else "")
    return (f"grouped {layout}{' silu_mul' if fuse != 'none' else ''}: {cfg.bm}x{cfg.bn} tile on {cfg.consumers} "
            f"{'ping-pong ' if cfg.pingpong else ''}consumer{'s' if cfg.consumers > 1 else ''}, {cfg.stages} stages"
            f"{', TMA-store epilogue' if cfg.tma_store else ''}"
            f"{clusters}, up to {plan.grid} blocks, "
            f"A {plan.a_major}-major, B {plan.b_major}-major" + (f" ({plan.why})" if reason else ""))


def reference(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor] = None, *, fuse: str = "none",
              masked: bool = False) -> torch.Tensor:
    """The float32 per-group reference of ``grouped_mm`` (``masked``: ``grouped_mm_masked`` with ``offs`` the
    counts); rows no group covers are NaN (the kernels leave them unwritten)."""
    def finish(x: torch.Tensor) -> torch.Tensor:
        if fuse == "silu_mul":
            half = x.shape[-1] // 2
            return torch.nn.functional.silu(x[..., :half]) * x[..., half:]
        return x
    if masked or (a.dim() == 3 and b.dim() == 3):
        out = torch.stack([finish(a[g].float() @ b[g].float()) for g in range(a.shape[0])])
        if masked:
            for g, c in enumerate(offs.cpu().tolist()):
                out[g, max(0, min(c, a.shape[1])):] = float("nan")
        return out
    ends = offs.cpu().tolist()
    starts = [0] + ends[:-1]
    if a.dim() == 2 and b.dim() == 3:  # the weights converted a group at a time: they may be large
        width = b.shape[-1] // 2 if fuse == "silu_mul" else b.shape[-1]
        out = torch.full((a.shape[0], width), float("nan"), device=a.device)
        for g, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                out[s:e] = finish(a[s:e].float() @ b[g].float())
        return out
    out = torch.zeros(len(ends), a.shape[0], b.shape[1], device=a.device)
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            out[g] = a[:, s:e].float() @ b[s:e].float()
    return out


def compile_variants(variants: Sequence[tuple[str, str, str, str]], config: Optional[GemmConfig] = None,
                     groups: int = 8, dtype: torch.dtype = torch.bfloat16,
                     out_dtype: Optional[torch.dtype] = None, target: str = "sm_90a") -> list[Any]:
    """Compile the kernel (no GPU needed) for each (layout, fuse, A major, B major), with ``config`` or the
    heuristic's for a 4096 x 4096 x 4096 problem; returns CompiledKernels."""
    from nvfly.runtime.torch_args import TensorDesc
    nv = OPERAND_DTYPES[dtype]
    out_nv = {None: nv, torch.float32: nvfly.f32}.get(out_dtype) or OPERAND_DTYPES[out_dtype]
    kernels = []
    for layout, fuse, a_major, b_major in variants:
        plan = make_plan(layout, fuse, nv.name, groups, a_major, b_major, 4096, 4096, 4096,
                         4096 / groups if layout == "contiguous" else 4096, 132, config, out_nv.itemsize)
        a_rank, b_rank = (3 if layout == "masked" else 2), (2 if layout == "kgrouped" else 3)
        a_desc = nvfly.TmaDescriptor(TensorDesc(nv, (groups,) * (a_rank - 2) + (4096, 4096)), plan.a_box,
                                     swizzle=plan.a_swizzle)
        b_desc = nvfly.TmaDescriptor(TensorDesc(nv, (groups,) * (b_rank - 2) + (4096, 4096)), plan.b_box,
                                     swizzle=plan.b_swizzle)
        out = TensorDesc(out_nv, (1 if layout == "contiguous" else groups, 4096, 4096))
        offs = TensorDesc(nvfly.i32, (groups,))
        out_desc = None
        if plan.store_box:  # the contiguous output's descriptor is 2-D [T, N]
            out_desc = nvfly.TmaDescriptor(TensorDesc(out_nv, out.shape[1:] if layout == "contiguous" else out.shape),
                                           plan.store_box, swizzle=plan.store_swizzle)
        cm = plan.config.cluster_m * plan.config.cluster_n
        kernels.append(grouped_kernel.compile(a_desc, b_desc, out, offs, out_desc, 4096, 4096, 4096, plan.k_tiles,
                                              CFG=plan.config, GROUPS=groups, LAYOUT=layout, A_MAJOR=a_major,
                                              B_MAJOR=b_major, FUSE=fuse, block=plan.threads,
                                              cluster=(cm, 1, 1) if cm > 1 else None, target=target))
    return kernels
