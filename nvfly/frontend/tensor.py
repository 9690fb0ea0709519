"""Device-side tensors: a typed base pointer (global or shared memory) with a shape and strides.

Static extents and strides are Python ints (folded at trace time); dynamic ones are traced integers whose
``divisor`` records what the host knew (e.g. "a multiple of 16"). Offsets are computed in the tensor's index
type (i32, or i64 for tensors past 2**31 elements). Loads and stores carry the alignment the offsets prove, so
``t.load(i, j, width=8)`` on a suitably aligned bf16 row becomes one 16-byte ``ld.global.v4``.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

from mlir import ir
from mlir.dialects import llvm, scf

from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.trace import traced
from nvfly.frontend.values import Scalar, Vector, as_value, condition, full

IntLike = Union[int, Scalar]

ADDRESS_SPACE = {"generic": 0, "global": 1, "shared": 3}
_GEP_DYNAMIC = -2147483648  # LLVM's marker for "the index is an operand"


def pointer_type(space: str) -> ir.Type:
    return ir.Type.parse(f"!llvm.ptr<{ADDRESS_SPACE[space]}>")


def _divisor_of(x: IntLike) -> int:
    if isinstance(x, int):
        return abs(x) if x else 1 << 30
    return x.divisor


def gep(base: ir.Value, offset: IntLike, dtype: DType) -> ir.Value:
    """``base + offset`` elements of ``dtype`` (no op for a static zero)."""
    if isinstance(offset, int):
        if offset == 0:
            return base
        return llvm.getelementptr(base.type, base, [], [offset], dtype.mlir(), _inbounds())
    return llvm.getelementptr(base.type, base, [offset.value], [_GEP_DYNAMIC], dtype.mlir(), _inbounds())


def _inbounds() -> ir.Attribute:
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 3)  # inbounds (implies nusw)


def _alignment(base_align: int, offset_divisor: int, itemsize: int, access_bytes: int) -> int:
    return math.gcd(base_align, math.gcd(offset_divisor * itemsize, 1 << 12), access_bytes)


class Tensor:
    """A view of global or shared memory: ``ptr`` (element ``dtype``), ``shape`` and ``stride`` in elements."""

    __slots__ = ("ptr", "dtype", "shape", "stride", "space", "align", "index_dtype")

    def __init__(self, ptr: ir.Value, dtype: DType, shape: Sequence[IntLike], stride: Sequence[IntLike],
                 space: str, align: int, index_dtype: DType = dtypes.i32):
        if len(shape) != len(stride):
            raise CompileError(f"shape {tuple(shape)} and stride {tuple(stride)} have different ranks")
        self.ptr = ptr
        self.dtype = dtype
        self.shape = tuple(shape)
        self.stride = tuple(stride)
        self.space = space
        self.align = align
        self.index_dtype = index_dtype

    def __repr__(self) -> str:
        dims = lambda xs: "(" + ", ".join(str(x) if isinstance(x, int) else "?" for x in xs) + ")"  # noqa: E731
        return f"Tensor<{self.space} {self.dtype.name} shape={dims(self.shape)} stride={dims(self.stride)}>"

    @property
    def rank(self) -> int:
        return len(self.shape)

    # ------------------------------------------------------------------ addressing
    def _index(self, x: IntLike, what: str) -> IntLike:
        if isinstance(x, bool) or not isinstance(x, (int, Scalar)):
            raise CompileError(f"{what} must be an int or a traced integer, got {type(x).__name__}")
        if isinstance(x, Scalar):
            if not x.dtype.is_int or x.dtype.kind == "bool":
                raise CompileError(f"{what} must be an integer, got a {x.dtype.name} value")
            if x.dtype != self.index_dtype:
                return x.to(self.index_dtype)
        return x

    def offset(self, *coord: IntLike) -> IntLike:
        """Element offset of a coordinate (Python int when everything is static)."""
        if len(coord) != self.rank:
            raise CompileError(f"a rank-{self.rank} tensor needs {self.rank} indices, got {len(coord)}")
        total: IntLike = 0
        for d, (c, s) in enumerate(zip(coord, self.stride)):
            c = self._index(c, f"index {d}")
            if isinstance(s, int) and s == 0 or isinstance(c, int) and c == 0:
                continue
            term = c * s if not (isinstance(s, int) and s == 1) else c
            total = term if (isinstance(total, int) and total == 0) else total + term
        if isinstance(total, Scalar) and total.dtype != self.index_dtype:
            total = total.to(self.index_dtype)
        return total

    @traced
    def address(self, *coord: IntLike) -> ir.Value:
        """The pointer to element ``coord``."""
        return gep(self.ptr, self.offset(*coord), self.dtype)

    # ------------------------------------------------------------------ views
    @traced
    def __getitem__(self, index: Any) -> Any:
        index = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, slice) for i in index):
            return self._slice(index)
        return self.load(*index)

    @traced
    def __setitem__(self, index: Any, value: Any) -> None:
        index = index if isinstance(index, tuple) else (index,)
        self.store(value, *index)

    def _slice(self, index: tuple) -> "Tensor":
        if len(index) != self.rank:
            raise CompileError(f"a rank-{self.rank} tensor needs {self.rank} indices or slices, got {len(index)}")
        base: list[IntLike] = []
        shape: list[IntLike] = []
        stride: list[IntLike] = []
        for d, i in enumerate(index):
            if isinstance(i, slice):
                if i.step not in (None, 1):
                    raise CompileError("tensor slices take no step")
                start = 0 if i.start is None else i.start
                stop = self.shape[d] if i.stop is None else i.stop
                base.append(start)
                shape.append(stop - start if not (isinstance(start, int) and start == 0) else stop)
                stride.append(self.stride[d])
            else:
                base.append(i)
        off = self.offset(*base)
        align = _alignment(self.align, _divisor_of(off), self.dtype.itemsize, 1 << 12)
        return Tensor(gep(self.ptr, off, self.dtype), self.dtype, shape, stride, self.space, align,
                      self.index_dtype)

    @traced
    def view(self, shape: Sequence[IntLike], stride: Optional[Sequence[IntLike]] = None,
             dtype: Optional[DType] = None) -> "Tensor":
        """The same memory with another shape/stride (row-major when ``stride`` is omitted) or element type."""
        dtype = dtype or self.dtype
        if stride is None:
            stride = row_major_strides(shape)
        return Tensor(self.ptr, dtype, shape, stride, self.space, self.align, self.index_dtype)

    # ------------------------------------------------------------------ memory access
    def _check_vector(self, width: int) -> None:
        if width < 1 or width & (width - 1):
            raise CompileError(f"width must be a power of two, got {width}")
        if width > 1:
            last = self.stride[-1]
            if not (isinstance(last, int) and last == 1):
                raise CompileError("a vector access (width > 1) needs the last dimension to have static stride 1")

    @traced
    def load(self, *coord: IntLike, width: int = 1, mask: Any = None, other: Any = 0) -> Union[Scalar, Vector]:
        """Load one element, or ``width`` consecutive elements along the last dimension as a Vector.

        With ``mask`` (a traced bool), nothing is read where it is false and ``other`` is returned.
        """
        self._check_vector(width)
        off = self.offset(*coord)
        addr = gep(self.ptr, off, self.dtype)
        value_type = self.dtype.mlir() if width == 1 else ir.VectorType.get([width], self.dtype.mlir())
        nbytes = width * self.dtype.itemsize
        align = _alignment(self.align, _divisor_of(off), self.dtype.itemsize, nbytes)

        def emit() -> ir.Value:
            return llvm.load(value_type, addr, alignment=align)

        if mask is None:
            result = emit()
        else:
            op = scf.IfOp(condition(mask).value, [value_type], has_else=True)
            with ir.InsertionPoint(op.then_block):
                scf.YieldOp([emit()])
            with ir.InsertionPoint(op.else_block):
                scf.YieldOp([_fill(other, self.dtype, width)])
            result = op.results[0]
        return Scalar(result, self.dtype) if width == 1 else Vector(result, self.dtype)

    @traced
    def store(self, value: Any, *coord: IntLike, mask: Any = None) -> None:
        """Store a scalar, or a Vector of consecutive elements along the last dimension."""
        width = value.size if isinstance(value, Vector) else 1
        self._check_vector(width)
        v = value.to(self.dtype) if isinstance(value, Vector) else as_value(value, self.dtype)
        off = self.offset(*coord)
        addr = gep(self.ptr, off, self.dtype)
        align = _alignment(self.align, _divisor_of(off), self.dtype.itemsize, width * self.dtype.itemsize)
        if mask is None:
            llvm.store(v.value, addr, alignment=align)
            return
        op = scf.IfOp(condition(mask).value, [], has_else=False)
        with ir.InsertionPoint(op.then_block):
            llvm.store(v.value, addr, alignment=align)
            scf.YieldOp([])


def _fill(other: Any, dtype: DType, width: int) -> ir.Value:
    if isinstance(other, Vector):
        return other.to(dtype).value
    if width == 1:
        return as_value(other, dtype).value
    return full(width, other, dtype).value


def row_major_strides(shape: Sequence[IntLike]) -> tuple[IntLike, ...]:
    strides: list[IntLike] = []
    acc: IntLike = 1
    for extent in reversed(shape):
        strides.append(acc)
        acc = extent * acc if not (isinstance(acc, int) and acc == 1) else extent
    return tuple(reversed(strides))
