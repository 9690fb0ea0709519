"""GPU-scope memory operations on global memory: what blocks use to share counts and partial results.

``red_add`` (``red.relaxed.gpu.global.add``: no result), ``atom_add`` (``atom.<order>.gpu.global.add``: the old
value), ``arrive`` (an acq_rel count on a u32 counter), ``load_relaxed`` / ``load_acquire``
(``ld.relaxed|acquire.gpu.global``: never a stale L1 line), ``store_relaxed`` / ``store_release``
(``st.relaxed|release.gpu.global``) and ``store_zeros_x4``. Loads and stores take 32- and 64-bit integers and f32 /
f64, one value or a vector (v2 / v4 up to 16 bytes).

The pattern of a reduction across blocks (see ``gemm_skinny`` and ``gemm_kernel``): every block adds its f32
partial sums into a zeroed workspace with relaxed reductions (``red_add``), fences, and counts itself in on a
per-tile counter (``arrive``); the block that sees the count of all others reads the complete sums back with
relaxed GPU-scope loads, finishes the tile and zeroes the workspace and counter again.
"""
from __future__ import annotations

from typing import Any, Sequence, Union

from nvfly.arch.ptx import asm, asm_multi
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.trace import traced
from nvfly.frontend.values import Scalar, as_value

ValueOrVector = Union[Any, Sequence[Any]]

_TYPES = (dtypes.i32, dtypes.u32, dtypes.i64, dtypes.f32, dtypes.f64)


def _check_type(what: str, dtype: DType) -> None:
    if dtype not in _TYPES:
        raise CompileError(f"{what} takes 32- or 64-bit integers, f32 or f64; got {dtype.name}")


def _bits_type(dtype: DType) -> str:
    """The PTX type of a load or store: f32 / f64, or the untyped bits of an integer."""
    return dtype.name if dtype.is_float else f"b{dtype.bits}"


def _vector(what: str, count: int, dtype: DType) -> str:
    """The ``.v2`` / ``.v4`` qualifier of ``count`` values (none for one); at most 16 bytes."""
    if count not in (1, 2, 4) or count * dtype.bits > 128:
        raise CompileError(f"{what}: {count} values of {dtype.name} are not a 1-, 2- or 4-wide vector of at most "
                           "16 bytes")
    return "" if count == 1 else f".v{count}"


def _values(what: str, value: ValueOrVector, dtype: DType | None) -> list[Scalar]:
    """One value or a vector, converted to one dtype (``dtype``, else the first value's)."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise CompileError(f"{what} needs at least one value")
    first = as_value(items[0], dtype)
    out = [first] + [as_value(v, first.dtype) for v in items[1:]]
    if not all(isinstance(v, Scalar) for v in out):
        raise CompileError(f"{what} takes scalars (one, or a list for a vector)")
    _check_type(what, first.dtype)
    return out


def _placeholders(first: int, n: int) -> str:
    text = ", ".join(f"${first + i}" for i in range(n))
    return text if n == 1 else "{" + text + "}"


@traced
def red_add(address: Any, value: ValueOrVector, dtype: DType | None = None) -> None:
    """``*address += value`` (relaxed, GPU scope), no result (``red.relaxed.gpu.global.add``). ``value``: one
    scalar (integers add as u32 / u64), or a list of 2 or 4 f32 added to a 16-byte aligned ``address`` in one
    instruction (``.v4.f32``, sm_90); ``dtype`` converts them (default: the first value's dtype)."""
    values = _values("red_add", value, dtype)
    dt = values[0].dtype
    if len(values) > 1 and dt != dtypes.f32:
        raise CompileError(f"red_add adds vectors of f32 only, got {len(values)} values of {dt.name}")
    vector = _vector("red_add", len(values), dt)
    ptx_type = dt.name if dt.is_float else f"u{dt.bits}"
    asm(f"red.relaxed.gpu.global.add{vector}.{ptx_type} [$0], {_placeholders(1, len(values))};",
        [address, *values])


_ATOM_ORDERS = ("relaxed", "acquire", "release", "acq_rel")


@traced
def atom_add(address: Any, value: Any, order: str = "relaxed", dtype: DType | None = None) -> Scalar:
    """``old = *address; *address += value`` at GPU scope with memory order ``order`` (relaxed, acquire, release,
    acq_rel); returns ``old`` (``atom.<order>.gpu.global.add.u32|u64|f32|f64``)."""
    if order not in _ATOM_ORDERS:
        raise CompileError(f"atom_add order must be one of {', '.join(_ATOM_ORDERS)}; got {order!r}")
    (v,) = _values("atom_add", value, dtype)
    ptx_type = v.dtype.name if v.dtype.is_float else f"u{v.dtype.bits}"
    return asm(f"atom.{order}.gpu.global.add.{ptx_type} $0, [$1], $2;", [address, v], v.dtype)


@traced
def arrive(address: Any) -> Scalar:
    """Count the caller in on a u32 counter (``atom.acq_rel.gpu.global.add.u32`` of 1); the previous count, as
    i32."""
    return asm("atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;", [address], result=dtypes.i32)


def _load(order: str, address: Any, dtype: DType, vector: int) -> Any:
    _check_type(f"load_{order}", dtype)
    text = f"ld.{order}.gpu.global{_vector(f'load_{order}', vector, dtype)}.{_bits_type(dtype)}"
    if vector == 1:
        return asm(f"{text} $0, [$1];", [address], dtype)
    return asm_multi(f"{text} {_placeholders(0, vector)}, [${vector}];", [dtype] * vector, [address])


@traced
def load_relaxed(address: Any, dtype: DType, vector: int = 1) -> Any:
    """``vector`` values of ``dtype`` at ``address`` (aligned to their size), relaxed at GPU scope
    (``ld.relaxed.gpu.global``): one Scalar, or a list for a vector."""
    return _load("relaxed", address, dtype, vector)


@traced
def load_acquire(address: Any, dtype: DType) -> Scalar:
    """The value of ``dtype`` at ``address``, acquire at GPU scope (``ld.acquire.gpu.global``): what the writer
    stored before its release is visible after it."""
    return _load("acquire", address, dtype, 1)


def _store(order: str, address: Any, value: ValueOrVector, dtype: DType | None) -> None:
    values = _values(f"store_{order}", value, dtype)
    dt = values[0].dtype
    text = f"st.{order}.gpu.global{_vector(f'store_{order}', len(values), dt)}.{_bits_type(dt)}"
    asm(f"{text} [$0], {_placeholders(1, len(values))};", [address, *values])


@traced
def store_relaxed(address: Any, value: ValueOrVector, dtype: DType | None = None) -> None:
    """Store one value or a vector (a list of 2 or 4) at ``address``, relaxed at GPU scope
    (``st.relaxed.gpu.global``); ``dtype`` converts them."""
    _store("relaxed", address, value, dtype)


@traced
def store_release(address: Any, value: Any, dtype: DType | None = None) -> None:
    """Store ``value`` at ``address``, release at GPU scope (``st.release.gpu.global``): the caller's earlier
    writes are visible to a thread that acquires it."""
    _store("release", address, value, dtype)


@traced
def store_zeros_x4(address: Any) -> None:
    """Sixteen zero bytes at the 16-byte aligned ``address`` (``st.global.v4.b32``)."""
    asm("st.global.v4.b32 [$0], {0, 0, 0, 0};", [address])
