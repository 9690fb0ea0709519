"""Votes, lane masks and bit counts of a warp: ``ballot`` (vote.sync.ballot), ``lanemask`` (%lanemask_*),
``popc`` (popc) and ``highest_bit`` (bfind), the pieces of warp-wide compaction (a lane's slot is the number of
voting lanes below it: ``popc(ballot(p) & lanemask("lt"))``). Leading zeros are the language's
``nvfly.count_leading_zeros``; shuffles, ``vote_any`` and ``redux_sync`` are the language's too."""
from __future__ import annotations

from typing import Any

from nvfly.arch.ptx import asm
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.trace import traced
from nvfly.frontend.values import Scalar, as_value

LANEMASKS = ("eq", "lt", "le", "gt", "ge")


def _int_operand(what: str, value: Any, widths: tuple[int, ...] = (32, 64)) -> Scalar:
    v = as_value(value)
    if not isinstance(v, Scalar) or not v.dtype.is_int or v.dtype.bits not in widths:
        widths_text = " or ".join(f"{w}-bit" for w in widths)
        raise CompileError(f"{what} takes a {widths_text} integer scalar, got {getattr(v, 'dtype', v)}")
    return v


@traced
def ballot(pred: Any) -> Scalar:
    """The lanes of the (whole, converged) warp where ``pred`` (a boolean or integer scalar: nonzero) holds, as a
    u32 bit mask (``vote.sync.ballot.b32``)."""
    p = as_value(pred)
    if not isinstance(p, Scalar) or not p.dtype.is_int:
        raise CompileError(f"ballot takes a boolean or integer scalar, got {getattr(p, 'dtype', p)}")
    return asm("{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.ballot.b32 $0, p, -1; }", [p.to(dtypes.u32)],
               dtypes.u32)


@traced
def lanemask(relation: str) -> Scalar:
    """The lanes whose index stands in ``relation`` ("eq", "lt", "le", "gt" or "ge") to this lane's, as a u32 bit
    mask (``mov.u32 %lanemask_<relation>``): ``lanemask("lt")`` is the lanes below this one."""
    if relation not in LANEMASKS:
        raise CompileError(f"lanemask relation must be one of {', '.join(LANEMASKS)}; got {relation!r}")
    return asm(f"mov.u32 $0, %lanemask_{relation};", [], dtypes.u32, side_effects=False)


@traced
def popc(bits: Any) -> Scalar:
    """The number of set bits of a 32- or 64-bit integer, as i32 (``popc.b32`` / ``popc.b64``)."""
    v = _int_operand("popc", bits)
    return asm(f"popc.b{v.dtype.bits} $0, $1;", [v], dtypes.i32, side_effects=False)


@traced
def highest_bit(bits: Any) -> Scalar:
    """The index of the highest set bit of a 32- or 64-bit integer read as unsigned, as u32; 0xFFFFFFFF when no bit
    is set (``bfind.u32`` / ``bfind.u64``)."""
    v = _int_operand("highest_bit", bits)
    return asm(f"bfind.u{v.dtype.bits} $0, $1;", [v], dtypes.u32, side_effects=False)
