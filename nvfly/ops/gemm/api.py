"""The GEMM's host functions on torch tensors: ``matmul`` (mm / addmm / bmm / linear with a fused epilogue), ``bind``
(its launches for one call signature, cached), ``eligibility``, ``path`` and ``describe`` (which kernel and plan a
call gets), ``reference`` and ``compile_configs`` (the kernel compiled without a GPU).
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Union

import torch

import nvfly
from nvfly.ops.common import scratch
from nvfly.ops.common.opcall import OpCalls, named
from nvfly.ops.common.operands import OPERAND_DTYPES, hopper_reason, operand_major, store_reason, tma_reason
from nvfly.ops.gemm import skinny_plan
from nvfly.ops.gemm.config import ACTIVATIONS, REDUCE_THREADS, Epilogue, GemmConfig, store_box
from nvfly.ops.gemm.kernel import gemm_kernel, split_k_reduce_kernel
from nvfly.ops.gemm.plan import GemmPlan, operand_box, plan_call
from nvfly.ops.gemm.skinny_config import SkinnyConfig
from nvfly.ops.gemm.skinny_plan import SkinnyPlan
from nvfly.runtime.tma import cached_descriptor
from nvfly.runtime.torch_args import current_stream, layout_key, vector_width

MATMUL = "nvfly.ops.gemm.matmul"
PATH = "nvfly.ops.gemm.path"
BIND = "nvfly.ops.gemm.bind"
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------- checks
# In the order a caller needs them: shapes and dtypes (``product_shape``, ``check``: the same on every device, so
# that the torch ops' fakes raise what the ops do), then the device, then the layouts (``eligibility``). Errors
# and reasons start with the argument's name.
def product_shape(a: Any, b: Any, c: Any = None, out: Any = None,
                  names: tuple[str, str, str, str] = ("a", "b", "c", "out")) -> tuple[int, ...]:
    """The output shape of ``a @ b (+ c)`` for 2-D or 3-D tensors (or TensorInfos) of one dtype, any dtype and
    device; raises ValueError (TypeError for the dtypes) naming the argument (``names``: as the caller calls a, b, c
    and out) when they do not multiply, c does not broadcast to the output or out has another shape."""
    a_name, b_name, c_name, out_name = names
    if a.dim() not in (2, 3):
        raise ValueError(f"{a_name}: expected a 2-D or 3-D tensor, got {a.dim()}-D")
    if b.dim() != a.dim():
        raise ValueError(f"{b_name}: expected a {a.dim()}-D tensor as {a_name} is, got {b.dim()}-D")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"{b_name}: shape {tuple(b.shape)} and {a_name}'s {tuple(a.shape)} do not multiply "
                         f"(K is {a.shape[-1]} in {a_name}, {b.shape[-2]} in {b_name})")
    if a.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"{b_name}: {b.shape[0]} batches, {a_name} has {a.shape[0]}")
    if b.dtype != a.dtype:
        raise TypeError(f"{b_name}: dtype {b.dtype} differs from {a_name}'s {a.dtype}")
    shape = (a.shape[0], a.shape[1], b.shape[2]) if a.dim() == 3 else (a.shape[0], b.shape[1])
    if c is not None:
        try:
            torch.broadcast_shapes(tuple(c.shape), shape)
        except RuntimeError:
            raise ValueError(f"{c_name}: shape {tuple(c.shape)} does not broadcast to the output's {shape}") from None
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"{out_name}: expected shape {shape}, got {tuple(out.shape)}")
    return shape


def check(a: Any, b: Any, c: Any = None, out_dtype: Optional[torch.dtype] = None, out: Any = None,
          activation: str = "none") -> tuple[int, ...]:
    """``product_shape``, then what nvfly's GEMM takes of any device: bf16 or fp16 operands, a bf16, fp16 or fp32
    output, a known activation; raises TypeError or ValueError naming the argument. Returns the output shape."""
    shape = product_shape(a, b, c, out)
    if a.dtype not in OPERAND_DTYPES:
        raise TypeError(f"a: dtype {a.dtype} is not supported: nvfly's GEMM takes bf16 or fp16 operands")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: {out_dtype} is not bf16, fp16 or fp32")
    if out is not None and out.dtype != (out_dtype or a.dtype):
        raise TypeError(f"out: expected dtype {out_dtype or a.dtype}, got {out.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    return shape


def _check_types(a: Any, b: Any, c: Any, out: Any) -> None:
    for name, t in (("a", a), ("b", b), ("c", c), ("out", out)):
        if not isinstance(t, torch.Tensor) and (t is not None or name in ("a", "b")):
            raise TypeError(f"{name}: expected a torch.Tensor{' or None' if name in ('c', 'out') else ''}, got "
                            f"{type(t).__name__}")


def _layout_reason(a: Any, b: Any) -> Optional[str]:
    for name, t, kdim in (("a", a, -1), ("b", b, -2)):
        major = operand_major(t, kdim)
        if major is None:
            return f"{name}: neither of its last two dimensions is contiguous"
        unit = kdim if major == "K" else (-2 if kdim == -1 else -1)
        reason = tma_reason(name, t, unit)
        if reason:
            return reason
    return None


def eligibility(a: Any, b: Any, c: Any = None, out_dtype: Optional[torch.dtype] = None,
                out: Any = None) -> Optional[str]:
    """None when ``matmul(a, b, c=c, out_dtype=out_dtype, out=out)`` runs on nvfly, else the reason it is declined
    (``check``'s error, then the device's, then the layouts'). Takes tensors or TensorInfos."""
    try:
        check(a, b, c, out_dtype, out)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return hopper_reason("nvfly's GEMM", a, b=b, c=c, out=out) or _layout_reason(a, b)


def _new_plan(op: str, a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], activation: str,
              out_dtype: Optional[torch.dtype], out: Optional[torch.Tensor], config: Any, skinny: Optional[bool],
              scaled: bool, swap: Optional[bool] = None) -> Union[GemmPlan, SkinnyPlan]:
    """The plan of a call after its checks, in the caller's order; errors name ``op`` and the argument."""
    with named(op):
        _check_types(a, b, c, out)
        check(a, b, c, out_dtype, out, activation)
        return _checked_plan(a, b, c, activation, out_dtype, out, config, skinny, scaled, swap)


def _checked_plan(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], activation: str,
                  out_dtype: Optional[torch.dtype], out: Optional[torch.Tensor], config: Any, skinny: Optional[bool],
                  scaled: bool, swap: Optional[bool]) -> Union[GemmPlan, SkinnyPlan]:
    """The plan of arguments that passed ``check``: the device and the layouts (``eligibility``), then the plan."""
    reason = eligibility(a, b, c, out_dtype, out)
    if reason:
        raise ValueError(reason)
    return plan_call(a, b, c is not None, activation, config, skinny, scaled, swap)


def matmul(a: torch.Tensor, b: torch.Tensor, *, c: Optional[torch.Tensor] = None, alpha: float = 1.0,
           beta: float = 1.0, activation: str = "none", out_dtype: Optional[torch.dtype] = None,
           out: Optional[torch.Tensor] = None, config: Union[GemmConfig, SkinnyConfig, None] = None,
           skinny: Optional[bool] = None, swap: Optional[bool] = None) -> torch.Tensor:
    """act(alpha * a @ b + beta * c) for 2-D or batched 3-D bf16/fp16 operands (fp32 accumulation).

    ``skinny``: None picks the kernel, True forces the skinny kernel (as does a SkinnyConfig ``config``),
    False the wgmma kernel. ``swap``: None computes small M as the transposed problem when no config is given,
    True always does (``config`` then applies to the transposed problem), False never. Raises TypeError or
    ValueError naming the argument when nvfly cannot run it."""
    use_c = c is not None and beta != 0
    call = _bound(MATMUL, a, b, c if use_c else None, alpha != 1.0, activation, out_dtype, out, config, skinny, swap)
    if out is None:
        out = torch.empty(call.shape, dtype=call.out_dtype, device=a.device)
    call.run(a, b, c if use_c else None, out, alpha, beta)
    return out


def bind(a: torch.Tensor, b: torch.Tensor, *, c: Optional[torch.Tensor] = None, scaled: bool = False,
         activation: str = "none", out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None,
         config: Union[GemmConfig, SkinnyConfig, None] = None, skinny: Optional[bool] = None,
         swap: Optional[bool] = None) -> Any:
    """The launches of ``matmul`` for operands laid out like these (cached per call signature), as an object
    with ``shape``, ``out_dtype`` and ``run(a, b, c, out, alpha, beta)``: out = act(alpha * a @ b + beta * c)
    for tensors of the same layouts as the bound ones (c given iff bound with one; alpha other than 1 only when
    ``scaled``; ``out`` as bound, or a new contiguous tensor when bound with None). After its first launch a
    call reads only the tensors' addresses. Raises TypeError or ValueError (naming the argument) when nvfly cannot
    run it."""
    return _bound(BIND, a, b, c, scaled, activation, out_dtype, out, config, skinny, swap)


def _bound(op: str, a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], scaled: bool, activation: str,
           out_dtype: Optional[torch.dtype], out: Optional[torch.Tensor], config: Any, skinny: Optional[bool],
           swap: Optional[bool]) -> Any:
    try:
        # everything that decides the kernels and their launch
        key = (layout_key(a), layout_key(b), layout_key(c), layout_key(out), activation, out_dtype, config, scaled,
               skinny, swap)
        call = _CALLS.get(key)
    except Exception:  # noqa: BLE001 - not tensors, an unhashable argument: the checks explain
        key = call = None
    if call is None:
        call = _CALLS.plan(op, key, _new_call, a, b, c, scaled, activation, out_dtype, out, config, skinny, swap)
    return call


def _new_call(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], scaled: bool, activation: str,
              out_dtype: Optional[torch.dtype], out: Optional[torch.Tensor], config: Any, skinny: Optional[bool],
              swap: Optional[bool]) -> Any:
    """A signature's first call: its checks (they raise), then its launches."""
    _check_types(a, b, c, out)
    shape = check(a, b, c, out_dtype, out, activation)
    if 0 in (*shape[-2:], a.shape[-1]):
        return _EmptyCall(shape, out_dtype or a.dtype, activation)
    plan = _checked_plan(a, b, c, activation, out_dtype, out, config, skinny, scaled, swap)
    out_dtype = out_dtype or a.dtype
    return _SkinnyCall(plan, shape, out_dtype) if type(plan) is SkinnyPlan else _WgmmaCall(plan, out, shape, out_dtype)


# call signature -> _WgmmaCall, _SkinnyCall or _EmptyCall
_CALLS: OpCalls[Union["_WgmmaCall", "_SkinnyCall", "_EmptyCall"]] = OpCalls()


class _EmptyCall:
    """M, N or K of zero: no kernel (an empty output, or beta * C through the activation)."""

    def __init__(self, shape: tuple, out_dtype: torch.dtype, activation: str):
        self.shape = shape
        self.out_dtype = out_dtype
        self.activation = activation

    def run(self, a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], out: torch.Tensor, alpha: float,
            beta: float) -> None:
        result = torch.zeros(self.shape, dtype=torch.float32, device=a.device)
        if c is not None:
            result = result + beta * c.float()
        out.copy_(_torch_activation(result, self.activation))


class _SkinnyCall:
    """The skinny kernel's launch for one call signature (``bind``'s cache)."""

    def __init__(self, plan: SkinnyPlan, shape: tuple, out_dtype: torch.dtype):
        self.shape = shape
        self.out_dtype = out_dtype
        self.run = skinny_plan.prepared_launch(plan, shape)


class _WgmmaCall:
    """The wgmma kernel's launches for one call signature (``bind``'s cache): prepared launches, and the TMA
    descriptors of the operands' addresses seen (everything else about them is fixed by the signature)."""

    def __init__(self, plan: GemmPlan, out: Optional[torch.Tensor], shape: tuple, out_dtype: torch.dtype):
        self.plan = plan
        self.shape = shape
        self.out_dtype = out_dtype
        self.batched = len(shape) == 3
        cfg = plan.config
        if cfg.tma_store:
            probe = out if out is not None else torch.empty(shape, dtype=out_dtype, device="meta")
            probe3 = probe if self.batched else probe.unsqueeze(0)
            if store_reason(probe3.transpose(-1, -2) if plan.swap else probe3) is not None:
                cfg = plan.register_config
        self.config = cfg
        self.tma_store = cfg.tma_store
        self.main = gemm_kernel.prepared(plan.grid, plan.threads, (cfg.cluster_m, 1, 1))
        # split K: f32 partials laid out like the caller's output (a swapped plan writes their transpose), so that
        # the reduce kernel reads and writes both in memory order, several elements of a row per thread
        self.out_m, self.out_n = (plan.n, plan.m) if plan.swap else (plan.m, plan.n)
        self.reduce_vec = 1
        self.reduce = None
        if plan.reduce_epilogue is not None:
            if out is None or out.stride(-1) == 1:  # None: a new contiguous output
                self.reduce_vec = vector_width(self.out_n, (out,), out_dtype.itemsize)
            self.reduce = split_k_reduce_kernel.prepared(
                (math.ceil(plan.m * plan.n / (REDUCE_THREADS * self.reduce_vec)), plan.batches), REDUCE_THREADS)
        self.partial_sums = plan.batches * cfg.split_k * plan.m * plan.n if self.reduce is not None else 0
        # stream K: one workspace slot and arrival count per streamed consumer tile
        self.sk_slots = plan.sk_tiles * (1 if cfg.pingpong else cfg.consumers)
        self.slot_sums = cfg.wg_m * cfg.bn
        self._descriptors: dict[tuple[int, int, int], tuple] = {}

    def run(self, a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], out: torch.Tensor, alpha: float,
            beta: float) -> None:
        plan = self.plan
        cfg = self.config
        addresses = (a.data_ptr(), b.data_ptr(), out.data_ptr() if self.tma_store else 0)
        descs = self._descriptors.get(addresses)
        sums = counts = partials = None
        if self.sk_slots:
            sums, counts = scratch.workspace(a.device, current_stream(a.device.index), self.sk_slots,
                                             self.slot_sums)
        if self.partial_sums:
            partials = scratch.partials(a.device, current_stream(a.device.index), self.partial_sums)
        if descs is not None and self.main.warm and (self.reduce is None or self.reduce.warm):
            # the generated launches read only addresses: the kernels' 3-D (transposed, broadcast) views of out,
            # C and the partials start where out, C and the flat buffer do
            a_desc, b_desc, out_desc = descs
            if partials is None:
                self.main(a_desc, b_desc, out, c, out_desc, plan.m, plan.n, plan.k_tiles, plan.batches, alpha, beta,
                          sums, counts, plan.dp_tiles, plan.block_iters, cfg, plan.a_major, plan.b_major,
                          plan.epilogue)
            else:
                self.main(a_desc, b_desc, partials, None, None, plan.m, plan.n, plan.k_tiles, plan.batches, 1.0,
                          0.0, None, None, 0, 0, cfg, plan.a_major, plan.b_major, plan.epilogue)
                self.reduce(partials, out, c, self.out_m, self.out_n, alpha, beta, cfg.split_k,
                            plan.reduce_epilogue, self.reduce_vec)
            return
        a3, b3 = (a, b) if self.batched else (a.unsqueeze(0), b.unsqueeze(0))
        out3 = out if self.batched else out.unsqueeze(0)
        c3 = None if c is None else (c.expand(self.shape) if self.batched else c.expand(self.shape).unsqueeze(0))
        if partials is not None:
            partials = partials[:self.partial_sums].view(plan.batches * cfg.split_k, self.out_m, self.out_n)
            reduce_out3, reduce_c3 = out3, c3
        if plan.swap:
            a3, b3 = b3.transpose(-1, -2), a3.transpose(-1, -2)
            out3 = out3.transpose(-1, -2)
            c3 = c3.transpose(-1, -2) if c3 is not None else None
        if descs is None:
            descs = self._describe(a3, b3, out3)
            if len(self._descriptors) >= 64:
                self._descriptors.clear()
            self._descriptors[addresses] = descs
        a_desc, b_desc, out_desc = descs
        if partials is None:
            self.main(a_desc, b_desc, out3, c3, out_desc, plan.m, plan.n, plan.k_tiles, plan.batches, alpha, beta,
                      sums, counts, plan.dp_tiles, plan.block_iters, cfg, plan.a_major, plan.b_major, plan.epilogue)
            return
        self.main(a_desc, b_desc, partials.transpose(-1, -2) if plan.swap else partials, None, None, plan.m, plan.n,
                  plan.k_tiles, plan.batches, 1.0, 0.0, None, None, 0, 0, cfg, plan.a_major, plan.b_major,
                  plan.epilogue)
        self.reduce(partials, reduce_out3, reduce_c3, self.out_m, self.out_n, alpha, beta, cfg.split_k,
                    plan.reduce_epilogue, self.reduce_vec)

    def _describe(self, a3: torch.Tensor, b3: torch.Tensor, out3: torch.Tensor) -> tuple:
        plan = self.plan
        a_desc, b_desc = _descriptors(plan, a3, b3, self.batched)
        out_desc = cached_descriptor(out3 if self.batched else out3[0], plan.store_box, plan.store_swizzle) \
            if self.tma_store else None
        return a_desc, b_desc, out_desc


def path(a: torch.Tensor, b: torch.Tensor, *, c: Optional[torch.Tensor] = None, activation: str = "none",
         out_dtype: Optional[torch.dtype] = None, config: Union[GemmConfig, SkinnyConfig, None] = None,
         skinny: Optional[bool] = None, scaled: bool = False, swap: Optional[bool] = None) -> str:
    """Which kernel ``matmul`` runs for these operands (for benchmarks): 'skinny' (with '-rowB' for a row-major
    B and '-splitK<s>' when they apply), or 'wgmma' with '-swapAB', '-splitK<s>' and
    '-streamK<tiles>x<k-blocks per block>' when they apply; raises when matmul would."""
    return _plan_name(_new_plan(PATH, a, b, c, activation, out_dtype, None, config, skinny, scaled, swap))


def _plan_name(plan: Union[GemmPlan, SkinnyPlan]) -> str:
    if isinstance(plan, SkinnyPlan):
        return "skinny" + ("-rowB" if plan.row_b else "") + \
            (f"-splitK{plan.config.splits}" if plan.config.splits > 1 else "")
    return "wgmma" + ("-swapAB" if plan.swap else "") + \
        (f"-splitK{plan.config.split_k}" if plan.config.split_k > 1 else "") + \
        (f"-streamK{plan.sk_tiles}x{plan.block_iters}" if plan.block_iters else "")


def dense_operand(batches: int, rows: int, cols: int, last_contiguous: bool,
                  make: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
    """A densely packed [(batches,) rows, cols] matrix whose last dimension is contiguous, or whose rows are (a
    transposed view), on a contiguous tensor from ``make(shape)`` (it chooses the device, dtype and values)."""
    t = make((batches, rows, cols) if last_contiguous else (batches, cols, rows))
    t = t if last_contiguous else t.transpose(-1, -2)
    return t if batches > 1 else t[0]


def describe(m: int, n: int, k: int, *, batches: int = 1, dtype: torch.dtype = torch.bfloat16,
             majors: tuple[str, str] = ("K", "K")) -> str:
    """What ``matmul`` runs without a config on densely packed ``[batches x] m x n x k`` operands (A: [M, K], B:
    [K, N], each "K"- or "MN"-major), eligibility aside and planned for an H100/H200 (132 SMs, 50 MiB of L2; no GPU
    needed): the kernel as ``path`` names it, then its tile and what the heuristic added, e.g. "wgmma: 64x80 tile
    on 128 blocks, 12 stages, TMA-store epilogue, B streamed (L2 evict_first)"."""
    def meta(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")
    a = dense_operand(batches, m, k, majors[0] == "K", meta)
    b = dense_operand(batches, k, n, majors[1] == "MN", meta)
    plan = plan_call(a, b, False, "none", None, None, False, None)
    if isinstance(plan, SkinnyPlan):
        return f"{_plan_name(plan)}: {plan.config}"
    cfg = plan.config
    what = [f"{cfg.bm}x{cfg.bn} tile" + (" of the transposed problem" if plan.swap else "") +
            f" on {plan.grid} block{'s' if plan.grid != 1 else ''}", f"{cfg.stages} stages"]
    what += ["ping-pong consumers"] if cfg.pingpong else []
    what += [f"{cfg.cluster_m}-block clusters"] if cfg.cluster_m > 1 else []
    what += ["TMA-store epilogue"] if cfg.tma_store else []
    what += [f"{operand_name} streamed (L2 evict_first)" for operand_name, on in (("A", cfg.stream_a),
                                                                               ("B", cfg.stream_b)) if on]
    return f"{_plan_name(plan)}: " + ", ".join(what)


def _descriptors(plan: GemmPlan, a3: torch.Tensor, b3: torch.Tensor, batched: bool) -> tuple[Any, Any]:
    """TMA descriptors of the (possibly swapped) 3-D operands, viewed with their contiguous dim last."""
    a_view = a3 if plan.a_major == "K" else a3.transpose(-1, -2)
    b_view = b3.transpose(-1, -2) if plan.b_major == "K" else b3
    if not batched:
        a_view, b_view = a_view[0], b_view[0]
    return (cached_descriptor(a_view, plan.a_box, plan.a_swizzle),
            cached_descriptor(b_view, plan.b_box, plan.b_swizzle))


def _torch_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(x)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(x)
    return x


def reference(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None, alpha: float = 1.0,
              beta: float = 1.0, activation: str = "none") -> torch.Tensor:
    """The float32 reference of ``matmul`` (for tests and benchmarks)."""
    r = alpha * (a.float() @ b.float())
    if c is not None:
        r = r + beta * c.float()
    return _torch_activation(r, activation)


def compile_configs(configs: Sequence[GemmConfig], dtype: torch.dtype = torch.bfloat16,
                    majors: Sequence[tuple[str, str]] = (("K", "MN"),), target: str = "sm_90a",
                    epilogue: Optional[Epilogue] = None, batched: bool = False,
                    out_dtype: Optional[torch.dtype] = None, stream_k: bool = False) -> list[Any]:
    """Compile the kernel for each config and operand major-ness it supports (no GPU needed); returns
    CompiledKernels. ``epilogue`` (default: none, or partials for split K) with a C input of the output's
    shape when it has one; ``batched``: rank-3 descriptors; ``out_dtype``: default ``dtype``; ``stream_k``:
    with the stream-K tail's fix-up (configs without split K or a cluster)."""
    from nvfly.runtime.torch_args import TensorDesc
    nv = OPERAND_DTYPES[dtype]
    out_nv = {torch.float32: nvfly.f32, None: nv}.get(out_dtype) or OPERAND_DTYPES[out_dtype]
    rank = 3 if batched else 2
    shape = (2,) * batched + (4096, 4096)
    kernels = []
    for cfg in configs:
        bk = cfg.bk(nv.itemsize)
        for a_major, b_major in majors:
            if cfg.check(nv.itemsize, b_major):
                continue
            a_box, a_sw = operand_box(cfg.bm, bk, nv, a_major, rank)
            b_box, b_sw = operand_box(cfg.bn, bk, nv, b_major, rank, cfg.cluster_m)
            a_desc = nvfly.TmaDescriptor(TensorDesc(nv, shape), a_box, swizzle=a_sw)
            b_desc = nvfly.TmaDescriptor(TensorDesc(nv, shape), b_box, swizzle=b_sw)
            epi = epilogue or Epilogue(partial=cfg.split_k > 1)
            out = TensorDesc(out_nv if cfg.split_k == 1 else nvfly.f32, (2 if batched else 1, 4096, 4096))
            c_in = TensorDesc(nv, (2 if batched else 1, 4096, 4096)) if epi.has_c else None
            out_desc = None
            if cfg.tma_store and cfg.split_k == 1:
                if out_nv.itemsize != 2:
                    cfg = replace(cfg, tma_store=False)
                else:
                    box, sw = store_box(cfg, batched)
                    out_desc = nvfly.TmaDescriptor(TensorDesc(out_nv, shape), box, swizzle=sw)
            tail = stream_k and cfg.split_k == 1 and cfg.cluster_m == 1
            sums = TensorDesc(nvfly.f32, (1 << 24,)) if tail else None
            counts = TensorDesc(nvfly.i32, (1024,)) if tail else None
            kernels.append(gemm_kernel.compile(
                a_desc, b_desc, out, c_in, out_desc, 4096, 4096, 64, 2 if batched else 1, 1.0, 0.0, sums, counts,
                0, 0, CFG=cfg,
                A_MAJOR=a_major, B_MAJOR=b_major, EPI=epi, block=128 * (1 + cfg.consumers),
                cluster=(cfg.cluster_m, 1, 1), target=target))
    return kernels
