"""Traced values: scalars and short vectors whose Python operators emit ``arith`` / ``math`` / ``vector`` ops.

Integer scalars carry ``divisor``, a statically known factor of their run-time value (1 when nothing is known).
It flows through arithmetic (``a*b`` multiplies the factors, ``a+b`` takes their gcd) and lets memory operations
prove the alignment that 16-byte vector loads and TMA need.

Integer ``//`` and ``%`` truncate toward zero (C semantics, like Triton and CUDA), not toward negative infinity.
"""
from __future__ import annotations

import math as _pymath
from typing import Any, Callable, Optional, Sequence, Union

from mlir import ir
from mlir.dialects import arith, math as mmath, vector

from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.trace import traced

PyNumber = Union[bool, int, float]
_MAX_DIVISOR = 1 << 30


def _cap(divisor: int) -> int:
    """Keep a divisor small: past 2**30 only its power-of-two part (still a true factor) is kept."""
    return divisor if divisor <= _MAX_DIVISOR else _pymath.gcd(divisor, _MAX_DIVISOR)


def _static_divisor(value: int) -> int:
    return _MAX_DIVISOR if value == 0 else _cap(abs(value))


def constant(value: PyNumber, dtype: DType) -> "Scalar":
    """A traced constant of ``dtype``."""
    t = dtype.mlir()
    if dtype.is_float:
        result = arith.constant(t, float(value))
    elif dtype.kind == "bool":
        result = arith.constant(t, 1 if value else 0)
    else:
        bits = dtype.bits
        v = int(value)
        if not (-(1 << (bits - 1)) <= v < (1 << bits)):
            raise CompileError(f"constant {v} does not fit in {dtype.name}")
        if v >= 1 << (bits - 1):
            v -= 1 << bits
        result = arith.constant(t, v)
    return Scalar(result, dtype, _static_divisor(int(value)) if dtype.is_int and dtype.kind != "bool" else 1)


def python_dtype(value: PyNumber) -> DType:
    """The dtype a Python number takes when it must become a traced value."""
    if isinstance(value, bool):
        return dtypes.i1
    if isinstance(value, int):
        return dtypes.i32 if -(1 << 31) <= value < (1 << 31) else dtypes.i64
    if isinstance(value, float):
        return dtypes.f32
    raise CompileError(f"cannot use a {type(value).__name__} as a device value")


def as_value(value: Any, dtype: Optional[DType] = None) -> "Scalar | Vector":
    """``value`` as a traced Scalar/Vector (Python numbers become constants of ``dtype`` or their natural type)."""
    if isinstance(value, Undefined):
        value._fail()
    if isinstance(value, (Scalar, Vector)):
        return value if dtype is None else value.to(dtype)
    if isinstance(value, (bool, int, float)):
        return constant(value, dtype or python_dtype(value))
    raise CompileError(f"expected a device value or a Python number, got {type(value).__name__}")


class Undefined:
    """Stands for a variable that a dynamic branch or loop assigns but that has no value after it."""

    __slots__ = ("name", "why")

    def __init__(self, name: str, why: str):
        self.name = name
        self.why = why

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise CompileError(f"variable '{self.name}' has no value here: {self.why}")

    __getattr__ = _fail  # type: ignore[assignment]
    __call__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _fail
    __getitem__ = __setitem__ = __bool__ = __iter__ = __lt__ = __gt__ = __le__ = __ge__ = _fail
    __truediv__ = __floordiv__ = __mod__ = __and__ = __or__ = __neg__ = _fail


@traced
def convert(value: Any, dtype: DType) -> "Scalar | Vector":
    """``dtype(value)``: convert a traced value, or make a constant from a Python number."""
    return as_value(value, dtype)


def _is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float))


def _cast_value(v: ir.Value, src: DType, dst: DType, result_type: ir.Type) -> ir.Value:
    """Emit the conversion of ``v`` (of element type ``src``) to ``dst``; ``result_type`` is scalar or vector."""
    if src == dst or (src.mlir_name == dst.mlir_name and src.kind != "bool" and dst.kind != "bool"):
        return v
    if dst.kind == "bool":
        zero_t = v.type
        if src.is_float:
            zero = arith.constant(zero_t, 0.0) if not isinstance(zero_t, ir.VectorType) else _splat_const(zero_t, 0.0)
            return arith.cmpf(arith.CmpFPredicate.UNE, v, zero)
        zero = arith.constant(zero_t, 0) if not isinstance(zero_t, ir.VectorType) else _splat_const(zero_t, 0)
        return arith.cmpi(arith.CmpIPredicate.ne, v, zero)
    if src.is_int and dst.is_int:
        if dst.bits > src.bits:
            return arith.extsi(result_type, v) if src.is_signed else arith.extui(result_type, v)
        return arith.trunci(result_type, v)
    if src.is_int and dst.is_float:
        return arith.sitofp(result_type, v) if src.is_signed else arith.uitofp(result_type, v)
    if src.is_float and dst.is_int:
        return arith.fptosi(result_type, v) if dst.is_signed or dst.kind == "bool" else arith.fptoui(result_type, v)
    # float -> float
    if src.bits == dst.bits or src.is_fp8 and dst.is_fp8:  # f16 <-> bf16, e4m3 <-> e5m2: through f32
        mid_t = _with_element(result_type, ir.F32Type.get())
        mid = arith.extf(mid_t, v)
        return arith.truncf(result_type, mid)
    if dst.bits > src.bits:
        return arith.extf(result_type, v)
    return arith.truncf(result_type, v)


def _with_element(t: ir.Type, element: ir.Type) -> ir.Type:
    if isinstance(t, ir.VectorType):
        return ir.VectorType.get(ir.VectorType(t).shape, element)
    return element


def _splat_const(t: ir.Type, value: PyNumber) -> ir.Value:
    vt = ir.VectorType(t)
    et = vt.element_type
    attr = ir.FloatAttr.get(et, float(value)) if not isinstance(et, ir.IntegerType) else ir.IntegerAttr.get(et, int(value))
    return arith.constant(t, ir.DenseElementsAttr.get_splat(vt, attr))


class _Traced:
    """Operators shared by Scalar and Vector; subclasses provide ``_wrap`` and ``_coerce``."""

    __slots__ = ("value", "dtype")
    value: ir.Value
    dtype: DType

    # ------------------------------------------------------------------ subclass hooks
    def _wrap(self, v: ir.Value, dtype: DType, divisor: int = 1) -> Any:
        raise NotImplementedError

    def _coerce(self, other: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def to(self, dtype: DType) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ python protocol
    def __bool__(self) -> bool:
        raise CompileError(
            "a traced value cannot be used as a Python bool here: conditions of if/while on traced values are "
            "supported, but `and`/`or`/`not`, chained comparisons and calls of plain Python helpers need "
            "`&`, `|`, `~` or an @nvfly.func helper")

    def __index__(self) -> int:
        raise CompileError("a traced value has no Python int value at trace time (use a Constexpr parameter "
                           "or a compile-time loop, nvfly.static_range, where a Python int is needed)")

    __int__ = __index__
    __hash__ = object.__hash__

    def __iter__(self) -> Any:
        raise CompileError(f"cannot iterate over a traced {self.dtype.name} value")

    # ------------------------------------------------------------------ arithmetic
    def _arith(self, other: Any, int_op: Callable, float_op: Callable, name: str, reverse: bool = False,
               uint_op: Optional[Callable] = None) -> Any:
        a, b = self._coerce(other)
        if reverse:
            a, b = b, a
        dt = a.dtype
        if dt.is_float:
            if float_op is None:
                raise CompileError(f"operator {name} is not defined for {dt.name}")
            if dt.is_fp8:
                raise CompileError(f"fp8 ({dt.name}) is a storage type: convert to f16/bf16/f32 before {name}")
            return a._wrap(float_op(a.value, b.value), dt)
        if int_op is None:
            raise CompileError(f"operator {name} is not defined for integers")
        op = uint_op if (uint_op is not None and not dt.is_signed) else int_op
        return a._wrap(op(a.value, b.value), dt, _divisor_rule(name, a, b))

    @traced
    def __add__(self, o: Any) -> Any:
        return self._arith(o, arith.addi, arith.addf, "+")

    @traced
    def __radd__(self, o: Any) -> Any:
        return self._arith(o, arith.addi, arith.addf, "+", reverse=True)

    @traced
    def __sub__(self, o: Any) -> Any:
        return self._arith(o, arith.subi, arith.subf, "-")

    @traced
    def __rsub__(self, o: Any) -> Any:
        return self._arith(o, arith.subi, arith.subf, "-", reverse=True)

    @traced
    def __mul__(self, o: Any) -> Any:
        return self._arith(o, arith.muli, arith.mulf, "*")

    @traced
    def __rmul__(self, o: Any) -> Any:
        return self._arith(o, arith.muli, arith.mulf, "*", reverse=True)

    @traced
    def __truediv__(self, o: Any) -> Any:
        a, b = self._coerce(o)
        if a.dtype.is_int:
            a, b = a.to(dtypes.f32), b.to(dtypes.f32)
        return a._arith(b, None, arith.divf, "/")

    @traced
    def __rtruediv__(self, o: Any) -> Any:
        a, b = self._coerce(o)
        if a.dtype.is_int:
            a, b = a.to(dtypes.f32), b.to(dtypes.f32)
        return b._arith(a, None, arith.divf, "/")

    @traced
    def __floordiv__(self, o: Any) -> Any:
        return self._arith(o, arith.divsi, None, "//", uint_op=arith.divui)

    @traced
    def __rfloordiv__(self, o: Any) -> Any:
        return self._arith(o, arith.divsi, None, "//", reverse=True, uint_op=arith.divui)

    @traced
    def __mod__(self, o: Any) -> Any:
        return self._arith(o, arith.remsi, arith.remf, "%", uint_op=arith.remui)

    @traced
    def __rmod__(self, o: Any) -> Any:
        return self._arith(o, arith.remsi, arith.remf, "%", reverse=True, uint_op=arith.remui)

    @traced
    def __lshift__(self, o: Any) -> Any:
        return self._arith(o, arith.shli, None, "<<")

    @traced
    def __rlshift__(self, o: Any) -> Any:
        return self._arith(o, arith.shli, None, "<<", reverse=True)

    @traced
    def __rshift__(self, o: Any) -> Any:
        return self._arith(o, arith.shrsi, None, ">>", uint_op=arith.shrui)

    @traced
    def __rrshift__(self, o: Any) -> Any:
        return self._arith(o, arith.shrsi, None, ">>", reverse=True, uint_op=arith.shrui)

    @traced
    def __and__(self, o: Any) -> Any:
        return self._arith(o, arith.andi, None, "&")

    __rand__ = __and__

    @traced
    def __or__(self, o: Any) -> Any:
        return self._arith(o, arith.ori, None, "|")

    __ror__ = __or__

    @traced
    def __xor__(self, o: Any) -> Any:
        return self._arith(o, arith.xori, None, "^")

    __rxor__ = __xor__

    @traced
    def __neg__(self) -> Any:
        if self.dtype.is_float:
            return self._wrap(arith.negf(self.value), self.dtype)
        return 0 - self

    def __pos__(self) -> Any:
        return self

    @traced
    def __invert__(self) -> Any:
        if self.dtype.is_float:
            raise CompileError("operator ~ is not defined for floats")
        return self ^ -1 if self.dtype.kind != "bool" else self ^ True

    @traced
    def __abs__(self) -> Any:
        if self.dtype.is_float:
            return self._wrap(mmath.absf(self.value), self.dtype)
        if not self.dtype.is_signed:
            return self
        return self._wrap(mmath.absi(self.value), self.dtype)

    # ------------------------------------------------------------------ comparisons
    def _compare(self, other: Any, ipred: str, fpred: str) -> Any:
        a, b = self._coerce(other)
        if a.dtype.is_float:
            pred = getattr(arith.CmpFPredicate, fpred)
            return a._wrap(arith.cmpf(pred, a.value, b.value), dtypes.i1)
        name = ipred if ipred in ("eq", "ne") else (("s" if a.dtype.is_signed else "u") + ipred)
        pred = getattr(arith.CmpIPredicate, name)
        return a._wrap(arith.cmpi(pred, a.value, b.value), dtypes.i1)

    @traced
    def __lt__(self, o: Any) -> Any:
        return self._compare(o, "lt", "OLT")

    @traced
    def __le__(self, o: Any) -> Any:
        return self._compare(o, "le", "OLE")

    @traced
    def __gt__(self, o: Any) -> Any:
        return self._compare(o, "gt", "OGT")

    @traced
    def __ge__(self, o: Any) -> Any:
        return self._compare(o, "ge", "OGE")

    @traced
    def __eq__(self, o: Any) -> Any:  # type: ignore[override]
        return self._compare(o, "eq", "OEQ")

    @traced
    def __ne__(self, o: Any) -> Any:  # type: ignore[override]
        return self._compare(o, "ne", "UNE")


def _divisor_rule(op: str, a: Any, b: Any) -> int:
    da, db = getattr(a, "divisor", 1), getattr(b, "divisor", 1)
    if op in ("+", "-"):
        return _pymath.gcd(da, db)
    if op == "*":
        return _cap(da * db)
    if op == "<<" and getattr(b, "static", None) is not None:
        return _cap(da << b.static)
    if op == "//" and getattr(b, "static", None) and da % b.static == 0:
        return max(1, da // abs(b.static))
    if op == "%" and getattr(b, "static", None):
        return _pymath.gcd(da, abs(b.static))
    return 1


class Scalar(_Traced):
    """A traced scalar of a given dtype. ``divisor`` is a known factor of integer values."""

    __slots__ = ("divisor", "static")

    def __init__(self, value: ir.Value, dtype: DType, divisor: int = 1, static: Optional[PyNumber] = None):
        self.value = value
        self.dtype = dtype
        self.divisor = divisor if dtype.is_int else 1
        self.static = static  # the Python value when this is a known constant

    def _wrap(self, v: ir.Value, dtype: DType, divisor: int = 1) -> "Scalar":
        return Scalar(v, dtype, divisor)

    def _coerce(self, other: Any) -> tuple["Scalar", "Scalar"]:
        if isinstance(other, Scalar):
            if other.dtype == self.dtype:
                return self, other
            common = dtypes.promote(self.dtype, other.dtype)
            return self.to(common), other.to(common)
        if isinstance(other, Vector):
            return other._coerce(self)[::-1]  # type: ignore[return-value]
        if _is_number(other):
            if isinstance(other, float) and self.dtype.is_int:
                return self.to(dtypes.f32), _const_scalar(other, dtypes.f32)
            return self, _const_scalar(other, self.dtype)
        raise CompileError(f"cannot combine a traced {self.dtype.name} with {type(other).__name__}")

    @traced
    def to(self, dtype: DType) -> "Scalar":
        """Convert to ``dtype`` (sign-extends signed ints, rounds to nearest even for floats)."""
        if dtype == self.dtype:
            return self
        v = _cast_value(self.value, self.dtype, dtype, dtype.mlir())
        div = self.divisor if dtype.is_int and dtype.bits >= self.dtype.bits else 1
        return Scalar(v, dtype, div)

    def bitcast(self, dtype: DType) -> "Scalar":
        if dtype.bits != self.dtype.bits:
            raise CompileError(f"bitcast from {self.dtype.name} to {dtype.name} changes the bit width")
        return Scalar(arith.bitcast(dtype.mlir(), self.value), dtype)

    def __repr__(self) -> str:
        return f"Scalar<{self.dtype.name}>"


def _const_scalar(value: PyNumber, dtype: DType) -> Scalar:
    s = constant(value, dtype)
    s.static = value
    return s


class Vector(_Traced):
    """A traced ``vector<N x dtype>`` held in registers: elementwise operators, static indexing, reductions."""

    __slots__ = ()

    def __init__(self, value: ir.Value, dtype: DType):
        self.value = value
        self.dtype = dtype

    @property
    def size(self) -> int:
        return ir.VectorType(self.value.type).shape[0]

    def __len__(self) -> int:
        return self.size

    def _wrap(self, v: ir.Value, dtype: DType, divisor: int = 1) -> "Vector":
        return Vector(v, dtype)

    def _coerce(self, other: Any) -> tuple["Vector", "Vector"]:
        if isinstance(other, Vector):
            if other.size != self.size:
                raise CompileError(f"vector sizes differ: {self.size} and {other.size}")
            if other.dtype == self.dtype:
                return self, other
            common = dtypes.promote(self.dtype, other.dtype)
            return self.to(common), other.to(common)
        if isinstance(other, Scalar) or _is_number(other):
            s = as_value(other, self.dtype if _is_number(other) and not (
                isinstance(other, float) and self.dtype.is_int) else None)
            common = dtypes.promote(self.dtype, s.dtype)
            me = self.to(common)
            s = s.to(common)
            return me, Vector(vector.broadcast(me.value.type, s.value), common)
        raise CompileError(f"cannot combine a traced vector with {type(other).__name__}")

    @traced
    def to(self, dtype: DType) -> "Vector":
        if dtype == self.dtype:
            return self
        rt = ir.VectorType.get([self.size], dtype.mlir())
        return Vector(_cast_value(self.value, self.dtype, dtype, rt), dtype)

    @traced
    def bitcast(self, dtype: DType) -> "Vector":
        total = self.size * self.dtype.bits
        if total % dtype.bits:
            raise CompileError(f"cannot bitcast {self.size} x {self.dtype.name} to {dtype.name} elements")
        rt = ir.VectorType.get([total // dtype.bits], dtype.mlir())
        return Vector(vector.bitcast(rt, self.value), dtype)

    @traced
    def __getitem__(self, index: Any) -> Scalar:
        if isinstance(index, int):
            if not -self.size <= index < self.size:
                raise CompileError(f"index {index} out of range for a vector of {self.size}")
            return Scalar(vector.extract(self.value, [], [index % self.size]), self.dtype)
        if isinstance(index, Scalar):
            return Scalar(vector.extract(self.value, [index.to(dtypes.i64).value], [ir.ShapedType.get_dynamic_size()]),
                          self.dtype)
        raise CompileError(f"vectors are indexed by int or traced int, got {type(index).__name__}")

    @traced
    def insert(self, index: int, value: Any) -> "Vector":
        """A copy of this vector with element ``index`` replaced."""
        s = as_value(value, self.dtype)
        return Vector(vector.insert(s.value, self.value, [], [index]), self.dtype)

    def tolist(self) -> list[Scalar]:
        return [self[i] for i in range(self.size)]

    @traced
    def reduce(self, kind: str) -> Scalar:
        """Reduce all lanes: ``kind`` is add, mul, max, min, and, or, xor."""
        float_kinds = {"add": "ADD", "mul": "MUL", "max": "MAXNUMF", "min": "MINNUMF"}
        int_kinds = {"add": "ADD", "mul": "MUL", "and": "AND", "or": "OR", "xor": "XOR",
                     "max": "MAXSI" if self.dtype.is_signed else "MAXUI",
                     "min": "MINSI" if self.dtype.is_signed else "MINUI"}
        table = float_kinds if self.dtype.is_float else int_kinds
        if kind not in table:
            raise CompileError(f"reduction {kind!r} is not defined for {self.dtype.name} (have {sorted(table)})")
        ck = getattr(vector.CombiningKind, table[kind])
        return Scalar(vector.reduction(self.dtype.mlir(), ck, self.value), self.dtype)

    def sum(self) -> Scalar:
        return self.reduce("add")

    def max(self) -> Scalar:
        return self.reduce("max")

    def min(self) -> Scalar:
        return self.reduce("min")

    def __repr__(self) -> str:
        return f"Vector<{self.size}x{self.dtype.name}>"


@traced
def full(size: int, value: Any, dtype: DType) -> Vector:
    """A vector of ``size`` copies of ``value``."""
    s = as_value(value, dtype)
    return Vector(vector.broadcast(ir.VectorType.get([size], dtype.mlir()), s.value), dtype)


@traced
def make_vector(elements: Sequence[Any], dtype: Optional[DType] = None) -> Vector:
    """A vector from a list of scalars (Python numbers become constants)."""
    if not elements:
        raise CompileError("make_vector needs at least one element")
    if dtype is None:
        first = next((e for e in elements if isinstance(e, Scalar)), None)
        dtype = first.dtype if first is not None else python_dtype(elements[0])
    vals = [as_value(e, dtype).value for e in elements]
    return Vector(vector.from_elements(ir.VectorType.get([len(vals)], dtype.mlir()), vals), dtype)


def condition(cond: Any) -> Scalar:
    """A branch, loop or mask condition as an i1 scalar (Python values become constants)."""
    c = as_value(cond) if not isinstance(cond, _Traced) else cond
    if isinstance(c, Vector):
        raise CompileError("the condition is a vector; reduce it to one value first")
    return c if c.dtype == dtypes.i1 else c.to(dtypes.i1)
