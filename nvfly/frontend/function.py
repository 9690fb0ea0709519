"""Tracing a kernel: arguments become entry-block values, the rewritten Python body emits the kernel's IR.

``trace_kernel`` is the front end's one entry point: Python function + argument specs + launch shape in,
``TracedKernel`` (an MLIR module plus its parameter ABI) out. ``DeviceFunction`` (``@nvfly.func``) is a helper
that kernels call; it is inlined at trace time with its own control flow rewritten.
"""
from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from mlir import ir

from nvfly.errors import CompileError, NvflyError, user_traceback_location
from nvfly.frontend import ast_rewrite, control_flow, dtypes
from nvfly.frontend.spec import ArgSpec, ConstexprSpec, Param, ScalarSpec, TensorSpec, TmaSpec
from nvfly.frontend.tensor import Tensor, pointer_type
from nvfly.frontend.tma_types import TmaDescriptorValue
from nvfly.frontend.trace import KernelBuilder, is_tracing
from nvfly.frontend.values import Scalar

RUNTIME = types.SimpleNamespace(
    if_=control_flow.if_, for_range=control_flow.for_range, while_=control_flow.while_,
    and_=control_flow.and_, or_=control_flow.or_, not_=control_flow.not_, ifexp=control_flow.ifexp,
    get=ast_rewrite.get, static_condition=ast_rewrite.static_condition)


@dataclass(frozen=True)
class AbiParam:
    """One kernel parameter as the driver passes it.

    ``kind``: "ptr" (u64 device address), "int"/"float" (scalar of ``dtype``) or "tma" (128 bytes by value);
    ``source``: (kernel-argument index, field) where field is "ptr", ("shape", d), ("stride", d), "value", "tma".
    """
    kind: str
    dtype: Optional[str]
    source: tuple

    @property
    def size(self) -> int:
        if self.kind == "ptr":
            return 8
        if self.kind == "tma":
            return 128
        return dtypes.BY_NAME[self.dtype].itemsize  # type: ignore[index]

    @property
    def align(self) -> int:
        return 64 if self.kind == "tma" else self.size


@dataclass
class TracedKernel:
    name: str
    builder: KernelBuilder
    abi: list[AbiParam]
    block: tuple[int, int, int]
    cluster: Optional[tuple[int, int, int]]
    target: str
    dynamic_smem_bytes: int = 0
    tma_params: list[int] = field(default_factory=list)
    cooperative: bool = False
    dependent: bool = False

    @property
    def module(self) -> ir.Module:
        return self.builder.module


class _Lazy:
    """Rewrites a function on first use (reading its source is not free)."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._make: Optional[Callable[[Any], Callable[..., Any]]] = None

    def build(self) -> Callable[..., Any]:
        if self._make is None:
            self._make = ast_rewrite.rewrite(self.fn)
        return self._make(RUNTIME)


class DeviceFunction:
    """``@nvfly.func``: a device helper called from kernels, inlined at trace time (dynamic control flow ok)."""

    def __init__(self, fn: Callable[..., Any]):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self._lazy = _Lazy(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_tracing():
            raise CompileError(f"@nvfly.func {self.fn.__qualname__} can only be called from kernel code")
        return self._lazy.build()(*args, **kwargs)


def _abi_for(params: Sequence[Param], specs: Sequence[ArgSpec]) -> list[AbiParam]:
    abi: list[AbiParam] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, TensorSpec):
            idx_dt = "i64" if spec.index_bits == 64 else "i32"
            abi.append(AbiParam("ptr", None, (i, "ptr")))
            abi.extend(AbiParam("int", idx_dt, (i, ("shape", d))) for d, s in enumerate(spec.shape) if s is None)
            abi.extend(AbiParam("int", idx_dt, (i, ("stride", d))) for d, s in enumerate(spec.stride) if s is None)
        elif isinstance(spec, ScalarSpec):
            abi.append(AbiParam("float" if spec.dtype.is_float else "int", spec.dtype.name, (i, "value")))
        elif isinstance(spec, TmaSpec):
            abi.append(AbiParam("tma", None, (i, "tma")))
    return abi


def _abi_type(p: AbiParam) -> ir.Type:
    if p.kind == "ptr":
        return pointer_type("global")
    if p.kind == "tma":
        return ir.Type.parse("!llvm.ptr")
    return dtypes.BY_NAME[p.dtype].mlir()  # type: ignore[index]


def _device_args(params: Sequence[Param], specs: Sequence[ArgSpec], abi: list[AbiParam],
                 values: Sequence[ir.Value]) -> dict[str, Any]:
    by_source = {p.source: v for p, v in zip(abi, values)}
    args: dict[str, Any] = {}
    for i, (param, spec) in enumerate(zip(params, specs)):
        if isinstance(spec, TensorSpec):
            idx_dt = dtypes.i64 if spec.index_bits == 64 else dtypes.i32
            shape = [s if s is not None else Scalar(by_source[(i, ("shape", d))], idx_dt, spec.shape_facts[d])
                     for d, s in enumerate(spec.shape)]
            stride = [s if s is not None else Scalar(by_source[(i, ("stride", d))], idx_dt, spec.stride_facts[d])
                      for d, s in enumerate(spec.stride)]
            args[param.name] = Tensor(by_source[(i, "ptr")], spec.dtype, shape, stride, "global", spec.align, idx_dt)
        elif isinstance(spec, ScalarSpec):
            args[param.name] = Scalar(by_source[(i, "value")], spec.dtype, spec.fact)
        elif isinstance(spec, TmaSpec):
            args[param.name] = TmaDescriptorValue(by_source[(i, "tma")], spec.info)
        else:
            assert isinstance(spec, ConstexprSpec)
            args[param.name] = spec.value
    return args


def trace_kernel(fn: Callable[..., Any], lazy: _Lazy, params: Sequence[Param], specs: Sequence[ArgSpec],
                 block: tuple[int, int, int], cluster: Optional[tuple[int, int, int]], target: str,
                 opt_level: int = 3, name: Optional[str] = None) -> TracedKernel:
    """Trace ``fn`` for these argument specs into a kernel module."""
    abi = _abi_for(params, specs)
    kernel_name = name or fn.__name__
    builder = KernelBuilder(kernel_name, target, lambda: [_abi_type(p) for p in abi], block, cluster,
                            opt_level=opt_level)
    body = lazy.build()
    try:
        with builder.activate():
            kwargs = _device_args(params, specs, abi, list(builder.entry.arguments))
            result = body(**kwargs)
            if result is not None:
                raise CompileError(f"kernel {kernel_name} returns a value; kernels write their results to tensors")
        with builder.context, ir.Location.unknown():
            builder.finish()
    except CompileError as exc:
        if exc.filename is None:
            filename, lineno = user_traceback_location(exc.__traceback__)
            if filename is not None:
                raise CompileError(exc.message, filename, lineno) from None
        raise
    except NvflyError:
        raise
    except Exception as exc:  # a Python error inside the user's kernel code
        filename, lineno = user_traceback_location(sys.exc_info()[2])
        raise CompileError(f"{type(exc).__name__}: {exc}", filename, lineno) from exc
    tma_params = [k for k, p in enumerate(abi) if p.kind == "tma"]
    return TracedKernel(kernel_name, builder, abi, block, cluster, target, builder.dynamic_smem_bytes, tma_params,
                        builder.cooperative, builder.dependent)
