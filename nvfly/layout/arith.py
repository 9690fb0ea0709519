"""Integer helpers shared by the layout algebra.

Every integer in a shape, stride, coordinate or offset is either *static* (a Python
``int``, known at trace time) or *dynamic* (any other object that implements the Python
operators ``+ - * // % >> << & ^`` with ints and with each other, e.g. the DSL's traced
``Int32``/``Int64`` scalars, which emit MLIR ``arith`` ops).

The helpers here fold static values in Python and emit the fewest operations on dynamic
values: identities (``x + 0``, ``x * 1``, ``x // 1``, ...) emit nothing, and division /
modulo of a dynamic value by a static power of two become a shift / mask. Dynamic values
are assumed to be non-negative (they are sizes, indices and offsets), which is what makes
the shift/mask rewrites exact.

No helper ever calls ``int()``, ``bool()``, ``hash()`` or a comparison on a dynamic value:
those cannot be evaluated while tracing. Operations that genuinely need a Python value
call :func:`require_static`, which raises :class:`LayoutError`.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Union

from nvfly.layout.errors import LayoutError

__all__ = [
    "IntLike", "is_static", "is_dynamic", "is_constant", "require_static", "log2_exact",
    "add", "sub", "mul", "floordiv", "mod", "ceil_div", "shift_right", "shift_left",
    "bit_and", "bit_xor", "gcd_static",
]

#: A static ``int`` or a dynamic (traced) integer.
IntLike = Union[int, Any]


def is_static(x: Any) -> bool:
    """True when ``x`` is a Python ``int`` (known at trace time)."""
    return isinstance(x, int)


def is_dynamic(x: Any) -> bool:
    """True when ``x`` is an integer leaf that is not a Python ``int`` (a traced value)."""
    return not isinstance(x, (int, tuple))


def is_constant(x: Any, value: int) -> bool:
    """True when ``x`` is static and equal to ``value``; never evaluates a dynamic ``x``."""
    return isinstance(x, int) and x == value


def require_static(x: Any, op: str, what: str) -> int:
    """Return ``x`` if it is static, else raise a :class:`LayoutError` naming ``op`` and ``what``."""
    if isinstance(x, int):
        return x
    raise LayoutError(
        f"{op}: {what} must be a static integer (a Python int known at trace time), "
        f"but it is a dynamic value of type {type(x).__name__}")


def log2_exact(v: int) -> Optional[int]:
    """``k`` if the static ``v`` equals ``2**k`` (``k >= 0``), else ``None``."""
    if v > 0 and v & (v - 1) == 0:
        return v.bit_length() - 1
    return None


def add(a: IntLike, b: IntLike) -> IntLike:
    """``a + b``; adding a static 0 returns the other operand unchanged."""
    if is_constant(a, 0):
        return b
    if is_constant(b, 0):
        return a
    return a + b


def sub(a: IntLike, b: IntLike) -> IntLike:
    """``a - b``; subtracting a static 0 returns ``a`` unchanged."""
    if is_constant(b, 0):
        return a
    return a - b


def mul(a: IntLike, b: IntLike) -> IntLike:
    """``a * b``; a static 0 factor gives static 0, a static 1 factor returns the other operand."""
    if is_constant(a, 0) or is_constant(b, 0):
        return 0
    if is_constant(a, 1):
        return b
    if is_constant(b, 1):
        return a
    return a * b


def _check_divisor(b: IntLike, op: str) -> None:
    if is_constant(b, 0):
        raise LayoutError(f"{op}: division by a static zero")


def floordiv(a: IntLike, b: IntLike) -> IntLike:
    """``a // b``; by a static 1 returns ``a``; a dynamic ``a`` by a static ``2**k`` emits ``a >> k``."""
    _check_divisor(b, "floordiv")
    if is_static(b):
        if b == 1:
            return a
        if is_static(a):
            return a // b
        k = log2_exact(b)
        if k is not None:
            return a >> k
        return a // b
    if is_constant(a, 0):
        return 0
    return a // b


def mod(a: IntLike, b: IntLike) -> IntLike:
    """``a % b``; by a static 1 gives 0; a dynamic ``a`` mod a static ``2**k`` emits ``a & (2**k - 1)``."""
    _check_divisor(b, "mod")
    if is_static(b):
        if b == 1:
            return 0
        if is_static(a):
            return a % b
        k = log2_exact(b)
        if k is not None:
            return a & (b - 1)
        return a % b
    if is_constant(a, 0):
        return 0
    return a % b


def ceil_div(a: IntLike, b: IntLike) -> IntLike:
    """``ceil(a / b)`` for non-negative ``a`` and positive ``b`` (``(a + b - 1) // b`` when dynamic)."""
    _check_divisor(b, "ceil_div")
    if is_static(a) and is_static(b):
        return -(-a // b)
    if is_constant(b, 1):
        return a
    return floordiv(add(a, sub(b, 1)), b)


def shift_right(a: IntLike, s: int) -> IntLike:
    """``a >> s`` for a static shift ``s`` (a negative ``s`` shifts left); a zero shift emits nothing."""
    s = require_static(s, "shift_right", "the shift amount")
    if s == 0 or is_constant(a, 0):
        return a
    if s < 0:
        return shift_left(a, -s)
    return a >> s


def shift_left(a: IntLike, s: int) -> IntLike:
    """``a << s`` for a static shift ``s`` (a negative ``s`` shifts right); a zero shift emits nothing."""
    s = require_static(s, "shift_left", "the shift amount")
    if s == 0 or is_constant(a, 0):
        return a
    if s < 0:
        return shift_right(a, -s)
    return a << s


def bit_and(a: IntLike, b: IntLike) -> IntLike:
    """``a & b``; a static 0 operand gives static 0."""
    if is_constant(a, 0) or is_constant(b, 0):
        return 0
    return a & b


def bit_xor(a: IntLike, b: IntLike) -> IntLike:
    """``a ^ b``; xor with a static 0 returns the other operand unchanged."""
    if is_constant(a, 0):
        return b
    if is_constant(b, 0):
        return a
    return a ^ b


def gcd_static(a: IntLike, b: IntLike) -> int:
    """``gcd(a, b)`` of two static integers; raises :class:`LayoutError` for a dynamic operand."""
    return math.gcd(require_static(a, "gcd", "the first operand"), require_static(b, "gcd", "the second operand"))

