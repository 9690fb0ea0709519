"""Float compares that give bit masks, two 16-bit lanes at a time, and the f16 -> f32 conversion of raw bits.

``compare_mask`` (``set.<cmp>.u32.<type>``: all ones where the compare holds, per 16-bit lane for bf16x2 / f16x2)
filters many values with one instruction a pair and no predicate registers; ``f16_to_f32`` (``cvt.f32.f16``)
converts a half given as its 16 bits.
"""
from __future__ import annotations

from typing import Any

from nvfly.arch.ptx import asm
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.trace import traced
from nvfly.frontend.values import Scalar, as_value

# PTX's float compare operators: ordered ones (false when either is NaN) and the unordered "...u" ones (true then)
COMPARES = ("eq", "ne", "lt", "le", "gt", "ge", "equ", "neu", "ltu", "leu", "gtu", "geu", "num", "nan")
_PACKED_TYPES = {dtypes.bf16: "bf16x2", dtypes.f16: "f16x2"}


@traced
def compare_mask(a: Any, b: Any, cmp: str, dtype: DType) -> Scalar:
    """``a <cmp> b`` as a u32 mask (``set.<cmp>.u32.<type>``). ``dtype`` f32: ``a``, ``b`` are f32 and the mask
    is all ones or zero; bf16 / f16: ``a``, ``b`` are 32-bit words holding two values each (low half first) and
    each 16-bit half of the mask is all ones where that pair's compare holds (``bf16x2`` / ``f16x2``)."""
    if cmp not in COMPARES:
        raise CompileError(f"compare_mask: cmp must be one of {', '.join(COMPARES)}; got {cmp!r}")
    if dtype == dtypes.f32:
        ptx_type = "f32"
    elif dtype in _PACKED_TYPES:
        ptx_type = _PACKED_TYPES[dtype]
    else:
        raise CompileError(f"compare_mask compares f32, or pairs of bf16 / f16; got {dtype.name}")
    operands = [as_value(x) for x in (a, b)]
    for x in operands:
        if not isinstance(x, Scalar) or x.dtype.bits != 32 or (dtype == dtypes.f32) != (x.dtype == dtypes.f32):
            raise CompileError(f"compare_mask of {ptx_type} takes {'f32' if dtype == dtypes.f32 else '32-bit word'} "
                               f"scalars, got {getattr(x, 'dtype', x)}")
    return asm(f"set.{cmp}.u32.{ptx_type} $0, $1, $2;", operands, dtypes.u32, side_effects=False)


@traced
def f16_to_f32(bits: Any) -> Scalar:
    """The f32 value of the f16 whose 16 bits are ``bits`` (an i16), exactly (``cvt.f32.f16``)."""
    v = as_value(bits)
    if not isinstance(v, Scalar) or v.dtype != dtypes.i16:
        raise CompileError(f"f16_to_f32 takes the 16 bits of an f16 as an i16, got {getattr(v, 'dtype', v)}")
    return asm("cvt.f32.f16 $0, $1;", [v], dtypes.f32, side_effects=False)
