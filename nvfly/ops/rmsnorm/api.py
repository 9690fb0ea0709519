"""RMSNorm's host functions: argument checks and eligibility, the per-call plan caches, and the launches."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import nvfly
from nvfly.ops.rmsnorm.kernels import (column_sum_kernel, rms_norm_backward_kernel, rms_norm_bulk_kernel,
                                       rms_norm_kernel, rms_norm_persistent_kernel, rms_norm_two_pass_kernel)
from nvfly.ops.rmsnorm.plan import (BACKWARD_MAX_ELEMENTS, BACKWARD_ROW_BLOCK_THREADS, BACKWARD_VECTORS_PER_THREAD,
                                    COLUMN_SUM_COLS, MAX_VECTORS_PER_THREAD, NARROW_MAX_ELEMENTS, ForwardOptions,
                                    RowPlan, bulk_plan, forward_plan, row_plan)
from nvfly.ops.common.opcall import KernelScalars, OpCalls
from nvfly.runtime import driver
from nvfly.runtime.torch_args import layout_key, vector_width

if TYPE_CHECKING:
    import torch

SUPPORTED_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")


def _is_tensor(value: Any) -> bool:
    import torch
    return isinstance(value, torch.Tensor)


def default_eps() -> float:
    """The eps torch uses when none is given: the float32 machine epsilon (fp32 accumulation)."""
    return 1.1920928955078125e-07


def _row_shape(x: "torch.Tensor", weight: Optional["torch.Tensor"],
               normalized_shape: Optional[Sequence[int]]) -> tuple[int, int]:
    """(M, N): the number of rows and the normalised size (the product of the last dimensions: ``normalized_shape``,
    else the weight's shape, else x's last dimension); errors blame the argument the caller passed."""
    if normalized_shape is not None:
        name, shape = "normalized_shape", tuple(int(s) for s in normalized_shape)
    elif weight is not None:
        name, shape = "weight", tuple(weight.shape)
    elif x.dim():
        name, shape = "x", (x.shape[-1],)
    else:
        raise ValueError("x: expected a dimension to normalise, got a 0-dimensional tensor")
    axis = x.dim() - len(shape)
    if not shape or axis < 0 or tuple(x.shape[axis:]) != shape:
        what = "" if name == "normalized_shape" else "shape "
        raise ValueError(f"{name}: {what}{shape} must be non-empty and match the last dimensions of x, whose shape "
                         f"is {tuple(x.shape)}")
    if weight is not None and tuple(weight.shape) != shape:
        raise ValueError(f"weight: expected shape {shape} (normalized_shape), got {tuple(weight.shape)}")
    return math.prod(x.shape[:axis]), math.prod(shape)


def check_shapes(x: Any, weight: Any = None, residual: Any = None, eps: Any = None,
                 normalized_shape: Optional[Sequence[int]] = None, residual_name: str = "residual") -> tuple[int, int]:
    """(M, N) as ``_row_shape`` for arguments of any dtype and device: raises TypeError (not tensors) or
    ValueError (shapes, eps) naming the argument (``residual_name``: as the caller calls the residual). The torch
    ops and their fakes check with it too."""
    for name, t in (("x", x), ("weight", weight), (residual_name, residual)):
        if not _is_tensor(t) and (t is not None or name == "x"):
            raise TypeError(f"{name}: expected a torch.Tensor{'' if name == 'x' else ' or None'}, got "
                            f"{type(t).__name__}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"{residual_name}: expected shape {tuple(x.shape)} (x's), got {tuple(residual.shape)}")
    m, n = _row_shape(x, weight, normalized_shape)
    if eps is not None and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0):
        raise ValueError(f"eps: expected a non-negative float or None, got {eps!r}")
    return m, n


def _check(x: Any, weight: Any, residual: Any, eps: Any, normalized_shape: Optional[Sequence[int]],
           residual_name: str = "residual") -> tuple[int, int]:
    """Validate arguments in the caller's order: shapes, dtypes, devices (errors name the argument); returns (M, N)
    as ``_row_shape``."""
    m, n = check_shapes(x, weight, residual, eps, normalized_shape, residual_name)
    _check_dtypes_and_devices(x, weight, residual, residual_name)
    return m, n


def _check_dtypes_and_devices(x: "torch.Tensor", weight: Optional["torch.Tensor"],
                              residual: Optional["torch.Tensor"], residual_name: str) -> None:
    for name, t in (("x", x), ("weight", weight), (residual_name, residual)):
        if t is not None and str(t.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported (bfloat16, float16, float32)")
    if residual is not None and residual.dtype != x.dtype:
        raise TypeError(f"{residual_name}: expected dtype {x.dtype} (x's), got {residual.dtype}")
    for name, t in (("weight", weight), (residual_name, residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, x on {x.device}")


def check_backward_shapes(grad_out: Any, x: Any, rstd: Any, weight: Any = None,
                          normalized_shape: Optional[Sequence[int]] = None, grad_residual: Any = None
                          ) -> tuple[int, int]:
    """(M, N) of ``rms_norm_backward``'s arguments of any dtype and device, as ``check_shapes``."""
    m, n = check_shapes(x, weight, grad_residual, None, normalized_shape, "grad_residual")
    for name, t in (("grad_out", grad_out), ("rstd", rstd)):
        if not _is_tensor(t):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if grad_out.shape != x.shape:
        raise ValueError(f"grad_out: expected shape {tuple(x.shape)} (x's), got {tuple(grad_out.shape)}")
    if rstd.numel() != m:
        raise ValueError(f"rstd: expected {m} values (one per row), got shape {tuple(rstd.shape)}")
    return m, n


def eligibility(x: Any, weight: Any = None, residual: Any = None,
                normalized_shape: Optional[Sequence[int]] = None, eps: Any = None) -> Optional[str]:
    """None when nvfly computes this RMSNorm, else the reason it declines (callers then use torch)."""
    try:
        _check(x, weight, residual, eps, normalized_shape)
    except (TypeError, ValueError) as exc:
        return str(exc)
    if x.numel() == 0:
        return "x is empty"
    if x.numel() >= 1 << 31:
        return "x has 2**31 elements or more"
    if x.device.type != "cuda":
        return f"x is on {x.device.type}, not CUDA"
    return None


def _backward_size_reason(n: int, vec: int) -> Optional[str]:
    if -(-n // (1024 * vec)) > max(1, BACKWARD_MAX_ELEMENTS // vec):
        return f"rows of {n} elements are too long for the backward kernel (at most {1024 * BACKWARD_MAX_ELEMENTS})"
    return None


def backward_eligibility(x: Any, normalized_shape: Optional[Sequence[int]] = None,
                         grad_out: Optional["torch.Tensor"] = None) -> Optional[str]:
    """None when ``rms_norm_backward`` handles rows like ``x``'s, else why not (its rows must fit in registers:
    1024 threads x 16 elements, 16384 elements)."""
    reason = eligibility(x, None, None, normalized_shape)
    if reason is not None:
        return reason
    _, n = _row_shape(x, None, normalized_shape)
    rows = [_rows(x, n)] + ([_rows(grad_out, n)] if grad_out is not None else [])
    return _backward_size_reason(n, vector_width(n, rows, x.element_size()))


def _rows(t: "torch.Tensor", n: int) -> "torch.Tensor":
    """``t`` as (rows, n) with unit stride along the row: a view when the layout allows, else a copy."""
    rows = t.reshape(-1, n)
    return rows if rows.stride(1) == 1 or n == 1 else rows.contiguous()


def _is_rows(t: "torch.Tensor", m: int, n: int) -> bool:
    """Whether ``t`` is already a contiguous (m, n) tensor (passed to the kernels as it is)."""
    return t.dim() == 2 and t.shape[0] == m and t.is_contiguous()


# Per-call plans (nvfly.ops.common.opcall). The host path of a call is one dictionary lookup keyed on everything
# the argument checks and the launch shape depend on: for each tensor its layout_key (shape, strides, dtype, device
# and base address modulo 16: vector widths), and the other arguments' values (with their types: True == 1 but is
# not a valid eps). The first call of a key runs the checks (which raise, naming the argument) and makes the plan;
# later calls allocate the outputs and launch (nvfly.PreparedLaunch: only addresses and scalars are read).
RMS_NORM = "nvfly.ops.rmsnorm.rms_norm"
RMS_NORM_FORWARD = "nvfly.ops.rmsnorm.rms_norm_forward"
RMS_NORM_BACKWARD = "nvfly.ops.rmsnorm.rms_norm_backward"
_FORWARD: OpCalls["_Forward"] = OpCalls()
_BACKWARD: OpCalls["_Backward"] = OpCalls()


@dataclass(frozen=True)
class _Forward:
    """A forward call's plan: ``direct`` when x (and the residual) are contiguous (m, n) tensors and the weight
    is contiguous, so that they are passed as they are and y is ``empty_like(x)``; otherwise the call makes
    (m, n) row views (or copies), the same for every call of its key."""
    m: int
    n: int
    shape: tuple[int, ...]
    direct: bool
    launch: Optional[nvfly.PreparedLaunch]  # None: nothing to launch (empty rows or no rows)
    scalars: Optional[KernelScalars]        # the kernel's arguments after its six tensors


def rms_norm_forward(x: "torch.Tensor", weight: Optional["torch.Tensor"] = None, eps: Optional[float] = None,
                     residual: Optional["torch.Tensor"] = None, normalized_shape: Optional[Sequence[int]] = None,
                     want_rstd: bool = True, options: Optional[ForwardOptions] = None, *, op: str = RMS_NORM_FORWARD
                     ) -> tuple["torch.Tensor", Optional["torch.Tensor"], Optional["torch.Tensor"]]:
    """(y, x + residual or None, rstd or None); ``rstd`` has one fp32 entry per row (for the backward).

    ``options`` replaces the default plan choices (ForwardOptions): for comparing plans. ``op``: the public
    function whose call this is, as its errors name it (``rms_norm`` gives its own name).
    """
    try:
        key = (layout_key(x), layout_key(weight), layout_key(residual), eps, type(eps),
               normalized_shape if normalized_shape is None else tuple(normalized_shape), want_rstd, options)
        f = _FORWARD.get(key)
    except Exception:  # noqa: BLE001 - not tensors, an unhashable argument: the checks explain
        key = f = None
    if f is None:
        f = _FORWARD.plan(op, key, _forward_plan, x, weight, eps, residual, normalized_shape, want_rstd, options)
    if not f.direct:
        return _forward_general(f, x, weight, residual, want_rstd)
    import torch
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(f.m, dtype=torch.float32, device=x.device) if want_rstd else None
    f.launch.launch(x, x if weight is None else weight, x if residual is None else residual, y,
                    x if h is None else h, x if rstd is None else rstd, *f.scalars.values)
    return y, h, rstd


def _forward_general(f: _Forward, x: "torch.Tensor", weight: Optional["torch.Tensor"],
                     residual: Optional["torch.Tensor"], want_rstd: bool) -> tuple:
    """Any layout: (m, n) row views of x, the residual and the outputs (copies where rows are not unit-stride)."""
    import torch
    m, n = f.m, f.n
    if f.launch is None:
        return _forward_empty(f, x, residual, want_rstd)
    y = torch.empty(f.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(f.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = torch.empty(m, dtype=torch.float32, device=x.device) if want_rstd else None
    x2 = _rows(x, n)
    w = weight.reshape(-1).contiguous() if weight is not None else x2
    r2 = _rows(residual, n) if residual is not None else x2
    f.launch.launch(x2, w, r2, y.view(m, n), h.view(m, n) if h is not None else x2,
                    rstd if rstd is not None else x2, *f.scalars.values)
    return y, h, rstd


def _forward_empty(f: _Forward, x: "torch.Tensor", residual: Optional["torch.Tensor"], want_rstd: bool) -> tuple:
    """Rows of no elements, or no rows: nothing to launch."""
    import torch
    y = torch.empty(f.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(y) if residual is not None else None
    rstd = torch.empty(f.m, dtype=torch.float32, device=x.device) if want_rstd else None
    if rstd is not None:
        rstd.fill_(math.nan)  # the mean of an empty row
    if residual_out is not None:
        torch.add(x, residual, out=residual_out)
    return y, residual_out, rstd


def _forward_plan(x: Any, weight: Any, eps: Any, residual: Any, normalized_shape: Optional[Sequence[int]],
                  want_rstd: bool, options: Any) -> _Forward:
    """The first call of a signature: the checks (they raise), then the plan."""
    m, n = _check(x, weight, residual, eps, normalized_shape)
    options = _check_options(options)
    if m == 0 or n == 0:  # nothing to launch
        return _Forward(m, n, tuple(x.shape), False, None, None)
    sms = driver.plan_sm_count(x.get_device())
    p = _forward_plan_of(x, weight, residual, m, n, sms, options)
    flags = dict(HAS_WEIGHT=weight is not None, HAS_RESIDUAL=residual is not None, HAS_RSTD=bool(want_rstd))
    eps = default_eps() if eps is None else float(eps)
    if p.bulk:
        kernel = rms_norm_bulk_kernel
        launch = kernel.prepared(min(m, p.blocks_per_sm * sms), p.threads)
        scalars = KernelScalars.of(kernel, M=m, eps=eps, N=n, VEC=p.vec, THREADS=p.threads, STAGES=p.stages,
                                   BLOCKS_PER_SM=p.blocks_per_sm, **flags)
    elif p.two_pass:
        kernel = rms_norm_two_pass_kernel
        launch = kernel.prepared(m, p.threads)
        scalars = KernelScalars.of(kernel, eps=eps, N=n, VEC=p.vec, THREADS=p.threads, VECTORS=p.vectors, **flags,
                                   CACHE_HINTS=p.cache_hints)
    elif p.persistent:
        kernel = rms_norm_persistent_kernel
        launch = kernel.prepared(min(-(-m // p.rows), p.blocks_per_sm * sms), p.threads)
        scalars = KernelScalars.of(kernel, M=m, eps=eps, N=n, VEC=p.vec, GROUP=p.group, ROWS=p.rows,
                                   BLOCKS_PER_SM=p.blocks_per_sm, **flags, CACHE_HINTS=p.cache_hints)
    else:
        kernel = rms_norm_kernel
        launch = kernel.prepared(-(-m // p.rows), p.threads)
        scalars = KernelScalars.of(kernel, M=m, eps=eps, N=n, VEC=p.vec, GROUP=p.group, ROWS=p.rows, **flags,
                                   EARLY_WEIGHT=p.early_weight and weight is not None, CACHE_HINTS=p.cache_hints)
    direct = _is_rows(x, m, n) and (residual is None or _is_rows(residual, m, n)) and \
        (weight is None or (weight.dim() == 1 and weight.is_contiguous()))
    return _Forward(m, n, tuple(x.shape), direct, launch, scalars)


def _forward_plan_of(x: "torch.Tensor", weight: Optional["torch.Tensor"], residual: Optional["torch.Tensor"], m: int,
                     n: int, sm_count: int, options: ForwardOptions) -> RowPlan:
    """forward_plan for checked arguments (the vector width their layouts allow and its register budget), with
    their dtype."""
    vec = vector_width(n, (_rows(x, n), weight.reshape(-1).contiguous() if weight is not None else None,
                           _rows(residual, n) if residual is not None else None), x.element_size())
    if options.vector_bytes:
        vec = max(1, min(vec, options.vector_bytes // x.element_size()))
    if options.bulk:
        p = bulk_plan(n, vec, x.element_size(), residual is not None, options)
    else:
        max_vectors = MAX_VECTORS_PER_THREAD if vec * x.element_size() == 16 else NARROW_MAX_ELEMENTS // vec
        p = forward_plan(n, vec, m, sm_count, max_vectors, residual is not None, options)
    return dataclasses.replace(p, dtype=str(x.dtype))


def plan_of(x: "torch.Tensor", weight: Optional["torch.Tensor"] = None, residual: Optional["torch.Tensor"] = None,
            normalized_shape: Optional[Sequence[int]] = None, options: Optional[ForwardOptions] = None) -> RowPlan:
    """The plan ``rms_norm_forward`` follows for these arguments (raises as it does)."""
    m, n = _check(x, weight, residual, None, normalized_shape)
    return _forward_plan_of(x, weight, residual, m, n, driver.plan_sm_count(x.get_device()), _check_options(options))


def _check_options(options: Any) -> ForwardOptions:
    """``options``, None meaning the defaults (ForwardOptions checks its own fields)."""
    if options is None:
        return ForwardOptions()
    if not isinstance(options, ForwardOptions):
        raise ValueError(f"options: expected None or rmsnorm.ForwardOptions, got {type(options).__name__}")
    return options


def rms_norm(x: "torch.Tensor", weight: Optional["torch.Tensor"] = None, eps: Optional[float] = None,
             residual: Optional["torch.Tensor"] = None, normalized_shape: Optional[Sequence[int]] = None) -> Any:
    """RMSNorm over the last dimensions (``normalized_shape``, default: the weight's shape or the last one).

    Returns ``y``, or ``(y, x + residual)`` when ``residual`` is given. ``eps=None`` means the fp32 epsilon
    (as torch). Any row length and row stride; fp32 math for bf16/fp16/fp32 inputs.
    """
    y, residual_out, _ = rms_norm_forward(x, weight, eps, residual, normalized_shape, False, op=RMS_NORM)
    return y if residual is None else (y, residual_out)


def rms_norm_backward(grad_out: "torch.Tensor", x: "torch.Tensor", rstd: "torch.Tensor",
                      weight: Optional["torch.Tensor"] = None, normalized_shape: Optional[Sequence[int]] = None,
                      grad_residual: Optional["torch.Tensor"] = None, needs_weight_grad: bool = True
                      ) -> tuple["torch.Tensor", Optional["torch.Tensor"]]:
    """(grad_x, grad_weight or None) of ``y = rms_norm(x, weight)`` given ``rstd`` from the forward.

    ``x`` is the normalised input (``x + residual`` for the fused variant); ``grad_residual``, the gradient that
    reached the ``x + residual`` output, is added to ``grad_x`` (which is then also the residual's gradient).
    """
    try:
        key = (layout_key(grad_out), layout_key(x), layout_key(rstd), layout_key(weight), layout_key(grad_residual),
               normalized_shape if normalized_shape is None else tuple(normalized_shape), bool(needs_weight_grad))
        b = _BACKWARD.get(key)
    except Exception:  # noqa: BLE001 - not tensors, an unhashable argument: the checks explain
        key = b = None
    if b is None:
        b = _BACKWARD.plan(RMS_NORM_BACKWARD, key, _backward_plan, grad_out, x, rstd, weight, normalized_shape,
                           grad_residual, needs_weight_grad)
    import torch
    if b.launch is None:  # nothing to launch
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if grad_residual is not None:
            grad_x.copy_(grad_residual)
        return grad_x, torch.zeros_like(weight) if b.needs_weight_grad else None
    m, n = b.m, b.n
    if b.direct:
        dy2, x2, dr2, grad_x = grad_out, x, grad_residual, torch.empty_like(x)
        grad_x2 = grad_x
    else:
        dy2, x2 = _rows(grad_out, n), _rows(x, n)
        dr2 = _rows(grad_residual, n) if grad_residual is not None else None
        grad_x = torch.empty(b.shape, dtype=x.dtype, device=x.device)
        grad_x2 = grad_x.view(m, n)
    w = (weight if b.weight_flat else weight.reshape(-1).contiguous()) if weight is not None else x2
    partial = torch.empty(b.partial_shape, dtype=torch.float32, device=x.device) if b.needs_weight_grad else x2
    b.launch.launch(dy2, x2, w, rstd if b.rstd_flat else rstd.reshape(-1), x2 if dr2 is None else dr2, grad_x2,
                    partial, *b.scalars.values)
    if not b.needs_weight_grad:
        return grad_x, None
    grad_w = torch.empty(n, dtype=weight.dtype, device=x.device)
    b.column_sum.launch(partial, grad_w, *b.column_sum_scalars.values)
    return grad_x, grad_w if b.weight_flat else grad_w.view(weight.shape)


@dataclass(frozen=True)
class _Backward:
    """A backward call's plan (see _Forward); ``partial_shape`` is that of the per-block weight-gradient sums."""
    m: int
    n: int
    shape: tuple[int, ...]
    direct: bool
    weight_flat: bool   # the weight is a contiguous 1-D tensor (passed as it is; its gradient needs no view)
    rstd_flat: bool
    needs_weight_grad: bool
    launch: Optional[nvfly.PreparedLaunch]  # None: nothing to launch (empty rows or no rows)
    scalars: Optional[KernelScalars] = None
    partial_shape: tuple[int, int] = (0, 0)
    column_sum: Optional[nvfly.PreparedLaunch] = None
    column_sum_scalars: Optional[KernelScalars] = None


def _backward_plan(grad_out: Any, x: Any, rstd: Any, weight: Any, normalized_shape: Optional[Sequence[int]],
                   grad_residual: Any, needs_weight_grad: Any) -> _Backward:
    """The first call of a signature: the checks (they raise), then the plan."""
    import torch
    m, n = check_backward_shapes(grad_out, x, rstd, weight, normalized_shape, grad_residual)
    if rstd.dtype != torch.float32:
        raise TypeError(f"rstd: expected dtype torch.float32, got {rstd.dtype}")
    _check_dtypes_and_devices(x, weight, grad_residual, "grad_residual")
    for name, t in (("grad_out", grad_out), ("rstd", rstd)):
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, x on {x.device}")
    needs_weight_grad = bool(needs_weight_grad) and weight is not None
    weight_flat = weight is not None and weight.dim() == 1 and weight.is_contiguous()
    rstd_flat = rstd.dim() == 1  # as rstd.reshape(-1) would be
    if m == 0 or n == 0:
        return _Backward(m, n, tuple(x.shape), False, weight_flat, rstd_flat, needs_weight_grad, None)
    dy2, x2 = _rows(grad_out, n), _rows(x, n)
    dr2 = _rows(grad_residual, n) if grad_residual is not None else None
    w = weight.reshape(-1).contiguous() if weight is not None else None
    vec = vector_width(n, (dy2, x2, dr2, w), x.element_size())
    reason = _backward_size_reason(n, vec)
    if reason is not None:
        raise ValueError(f"x: {reason}")
    sms = driver.plan_sm_count(x.get_device())
    p = row_plan(n, vec, m, sms, BACKWARD_VECTORS_PER_THREAD, max(1, BACKWARD_MAX_ELEMENTS // vec), 1024,
                 BACKWARD_ROW_BLOCK_THREADS)
    # persistent: about two blocks per SM, each accumulating its own weight-gradient partial rows
    grid = min(-(-m // p.rows), 2 * sms)
    padded_n = -(-n // COLUMN_SUM_COLS) * COLUMN_SUM_COLS
    direct = _is_rows(x, m, n) and _is_rows(grad_out, m, n) and \
        (grad_residual is None or _is_rows(grad_residual, m, n))
    scalars = KernelScalars.of(rms_norm_backward_kernel, M=m, N=n, VEC=vec, GROUP=p.group, ROWS=p.rows,
                               HAS_WEIGHT=weight is not None, HAS_GRAD_RESIDUAL=grad_residual is not None,
                               NEEDS_WEIGHT_GRAD=needs_weight_grad)
    column_sum = column_sum_scalars = None
    if needs_weight_grad:
        column_sum = column_sum_kernel.prepared(padded_n // COLUMN_SUM_COLS, 256)
        column_sum_scalars = KernelScalars.of(column_sum_kernel, P=grid * p.rows, N=n)
    return _Backward(m, n, tuple(x.shape), direct, weight_flat, rstd_flat, needs_weight_grad,
                     rms_norm_backward_kernel.prepared(grid, p.threads), scalars, (grid * p.rows, padded_n),
                     column_sum, column_sum_scalars)
