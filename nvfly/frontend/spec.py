"""What a kernel is specialised on: parameter kinds (from annotations) and argument specs (from values).

A spec is the compile-time view of one argument: a tensor's dtype, rank, which extents/strides are static and
what is known of the dynamic ones (a power-of-two factor up to 16, the base address alignment, whether offsets
fit in 32 bits); a scalar's dtype; a Constexpr's value. Specs are hashable: a tuple of them (plus the launch's
block and cluster shape and the target) is the specialisation key.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from nvfly.errors import CompileError, LaunchError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.tma_types import TmaDescriptorType, TmaInfo

FACT_LIMIT = 16  # facts about dynamic integers go up to "a multiple of 16"


def pow2_factor(value: int, limit: int = FACT_LIMIT) -> int:
    """The largest power of two ≤ ``limit`` dividing ``value`` (``limit`` for 0)."""
    if value == 0:
        return limit
    return min(limit, value & -value)


# ---------------------------------------------------------------------------------------------- annotations
class Constexpr:
    """Annotation of a compile-time parameter: its value is part of the specialisation and folds at trace time.

    ``BLOCK: nvfly.Constexpr`` or ``BLOCK: nvfly.Constexpr[int]``.
    """

    def __class_getitem__(cls, item: Any) -> type:
        return cls


@dataclass(frozen=True)
class TensorAnnotation:
    """Annotation of a tensor parameter: optional required dtype and rank, and which dims are static.

    ``static_dims``: dimensions whose extent (and stride) become compile-time constants (``True`` for all).
    """
    dtype: Optional[DType] = None
    rank: Optional[int] = None
    static_dims: Union[bool, tuple[int, ...]] = ()

    def is_static(self, dim: int) -> bool:
        return self.static_dims is True or (isinstance(self.static_dims, tuple) and dim in self.static_dims)


class TensorType:
    """``nvfly.Tensor`` as an annotation: ``x: nvfly.Tensor``, ``x: nvfly.Tensor[nvfly.bf16]``,
    ``x: nvfly.Tensor[nvfly.bf16, 2]``; ``nvfly.Tensor(static_dims=(1,))`` for more."""

    def __class_getitem__(cls, item: Any) -> TensorAnnotation:
        items = item if isinstance(item, tuple) else (item,)
        dtype = items[0] if items and isinstance(items[0], DType) else None
        rank = items[1] if len(items) > 1 else None
        return TensorAnnotation(dtype, rank)

    def __new__(cls, dtype: Optional[DType] = None, rank: Optional[int] = None,
                static_dims: Union[bool, tuple[int, ...]] = ()) -> TensorAnnotation:  # type: ignore[misc]
        return TensorAnnotation(dtype, rank, tuple(static_dims) if not isinstance(static_dims, bool) else static_dims)


# ---------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as the compiler sees it. ``None`` entries of shape/stride are dynamic."""
    dtype: DType
    shape: tuple[Optional[int], ...]
    stride: tuple[Optional[int], ...]
    shape_facts: tuple[int, ...]   # power-of-two factor of each dynamic extent (1 for static ones)
    stride_facts: tuple[int, ...]
    align: int                     # bytes, power of two ≤ 16
    index_bits: int                # 32 or 64

    @property
    def rank(self) -> int:
        return len(self.shape)

    @staticmethod
    def of(dtype: DType, shape: Sequence[int], stride: Sequence[int], address: int,
           annotation: Optional[TensorAnnotation] = None) -> "TensorSpec":
        """The spec of a concrete tensor (``address`` only matters modulo 16)."""
        ann = annotation or TensorAnnotation()
        sh: list[Optional[int]] = []
        st: list[Optional[int]] = []
        shf: list[int] = []
        stf: list[int] = []
        for d, (extent, step) in enumerate(zip(shape, stride)):
            static = ann.is_static(d)
            sh.append(extent if static else None)
            shf.append(1 if static else pow2_factor(extent))
            # unit and zero strides are static: they decide contiguity and broadcasting
            if static or step in (0, 1):
                st.append(step)
                stf.append(1)
            else:
                st.append(None)
                stf.append(pow2_factor(step))
        extent_span = sum((e - 1) * abs(s) for e, s in zip(shape, stride) if e > 0)
        index_bits = 32 if extent_span < (1 << 31) - 1 else 64
        return TensorSpec(dtype, tuple(sh), tuple(st), tuple(shf), tuple(stf), pow2_factor(address), index_bits)


@dataclass(frozen=True)
class ScalarSpec:
    """A run-time scalar; ``fact`` is the power-of-two factor (≤ 16) known of an integer's value."""
    dtype: DType
    fact: int = 1


@dataclass(frozen=True)
class ConstexprSpec:
    value: Any


@dataclass(frozen=True)
class TmaSpec:
    """A TMA descriptor argument (128 bytes, passed by value); ``info`` is what the kernel code depends on."""
    info: TmaInfo


ArgSpec = Union[TensorSpec, ScalarSpec, ConstexprSpec, TmaSpec]


# ---------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class Param:
    name: str
    kind: str   # "tensor", "scalar", "constexpr", "tma" or "auto" (decided by the value)
    annotation: Any = None
    default: Any = inspect.Parameter.empty


def analyze_signature(fn: Any) -> list[Param]:
    """The kernel parameters of ``fn`` from its annotations."""
    sig = inspect.signature(fn, eval_str=True)
    params: list[Param] = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise CompileError(f"kernel parameter *{p.name} is not supported: list the parameters",
                               fn.__code__.co_filename, fn.__code__.co_firstlineno)
        ann = p.annotation
        if ann is inspect.Parameter.empty:
            kind = "auto"
        elif ann is Constexpr:
            kind = "constexpr"
        elif ann is TensorType or isinstance(ann, TensorAnnotation):
            kind = "tensor"
            ann = ann if isinstance(ann, TensorAnnotation) else TensorAnnotation()
        elif isinstance(ann, DType):
            kind = "scalar"
        elif isinstance(ann, type) and issubclass(ann, TmaDescriptorType):
            kind = "tma"
        else:
            raise CompileError(f"parameter '{p.name}': unsupported annotation {ann!r} (use nvfly.Tensor, a dtype "
                               f"such as nvfly.i32, nvfly.Constexpr or nvfly.TmaDescriptor)",
                               fn.__code__.co_filename, fn.__code__.co_firstlineno)
        params.append(Param(p.name, kind, ann, p.default))
    return params


def scalar_spec_of(param: Param, value: Any) -> ArgSpec:
    """The spec of a non-tensor argument (kinds scalar, constexpr, auto)."""
    if param.kind == "constexpr":
        _check_hashable(param, value)
        return ConstexprSpec(value)
    if param.kind == "scalar":
        if not isinstance(value, (bool, int, float)):
            raise LaunchError(f"argument '{param.name}': expected a Python number for a {param.annotation.name} "
                              f"parameter, got {type(value).__name__}")
        return ScalarSpec(param.annotation, _int_fact(param.annotation, value))
    # auto: ints and floats are run-time scalars, everything else specialises
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _check_hashable(param, value)
        return ConstexprSpec(value)
    if isinstance(value, float):
        return ScalarSpec(dtypes.f32)
    dt = dtypes.i32 if -(1 << 31) <= value < (1 << 31) else dtypes.i64
    return ScalarSpec(dt, _int_fact(dt, value))


def _int_fact(dtype: DType, value: Any) -> int:
    if dtype.is_int and dtype.kind != "bool" and isinstance(value, int):
        return pow2_factor(value)
    return 1


def _check_hashable(param: Param, value: Any) -> None:
    try:
        hash(value)
    except TypeError:
        raise LaunchError(f"argument '{param.name}': a compile-time value must be hashable, got "
                          f"{type(value).__name__}") from None


def check_tensor_annotation(param: Param, spec: TensorSpec) -> None:
    ann = param.annotation
    if not isinstance(ann, TensorAnnotation):
        return
    if ann.dtype is not None and spec.dtype != ann.dtype:
        raise LaunchError(f"argument '{param.name}': expected a {ann.dtype.name} tensor, got {spec.dtype.name}")
    if ann.rank is not None and spec.rank != ann.rank:
        raise LaunchError(f"argument '{param.name}': expected a rank-{ann.rank} tensor, got rank {spec.rank}")

