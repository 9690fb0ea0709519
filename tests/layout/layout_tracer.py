"""A fake dynamic integer for the layout tests: records every operator applied to it.

``Dyn`` behaves like the DSL's traced integers: it supports ``+ - * // % >> << & ^ |`` with
ints and other ``Dyn``s, and refuses to be evaluated at trace time (``bool``, ``int``,
``hash``, comparisons, ``abs``, ...). It also carries the concrete value, so the result of a
traced computation can be checked against the static computation.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, List


class EvaluatedDynamicValue(AssertionError):
    """The layout code tried to turn a dynamic value into a Python value."""


class Tracer:
    """Records the operator names emitted on the ``Dyn`` values it creates."""

    def __init__(self) -> None:
        self.ops: List[str] = []

    def var(self, value: int) -> "Dyn":
        return Dyn(value, self)

    def count(self, op: str) -> int:
        return self.ops.count(op)

    def reset(self) -> None:
        self.ops.clear()


def _binary(name: str, fn: Callable[[int, int], int], reverse: bool = False) -> Callable[["Dyn", Any], "Dyn"]:
    def method(self: "Dyn", other: Any) -> "Dyn":
        if isinstance(other, Dyn):
            other_value = other.value
        elif isinstance(other, int) and not isinstance(other, bool):
            other_value = other
        else:
            return NotImplemented
        a, b = (other_value, self.value) if reverse else (self.value, other_value)
        self.tracer.ops.append(name)
        return Dyn(fn(a, b), self.tracer)

    return method


def _refuse(what: str) -> Callable[..., Any]:
    def method(self: "Dyn", *args: Any) -> Any:
        raise EvaluatedDynamicValue(f"layout code evaluated a dynamic value with {what}")

    return method


class Dyn:
    """A traced integer with a hidden concrete ``value``."""

    __slots__ = ("value", "tracer")

    def __init__(self, value: int, tracer: Tracer) -> None:
        self.value = value
        self.tracer = tracer

    def __repr__(self) -> str:
        return f"Dyn({self.value})"

    __str__ = __repr__

    __add__ = _binary("add", operator.add)
    __radd__ = _binary("add", operator.add, reverse=True)
    __sub__ = _binary("sub", operator.sub)
    __rsub__ = _binary("sub", operator.sub, reverse=True)
    __mul__ = _binary("mul", operator.mul)
    __rmul__ = _binary("mul", operator.mul, reverse=True)
    __floordiv__ = _binary("floordiv", operator.floordiv)
    __rfloordiv__ = _binary("floordiv", operator.floordiv, reverse=True)
    __mod__ = _binary("mod", operator.mod)
    __rmod__ = _binary("mod", operator.mod, reverse=True)
    __rshift__ = _binary("shr", operator.rshift)
    __rrshift__ = _binary("shr", operator.rshift, reverse=True)
    __lshift__ = _binary("shl", operator.lshift)
    __rlshift__ = _binary("shl", operator.lshift, reverse=True)
    __and__ = _binary("and", operator.and_)
    __rand__ = _binary("and", operator.and_, reverse=True)
    __xor__ = _binary("xor", operator.xor)
    __rxor__ = _binary("xor", operator.xor, reverse=True)
    __or__ = _binary("or", operator.or_)
    __ror__ = _binary("or", operator.or_, reverse=True)

    __bool__ = _refuse("bool()")
    __int__ = _refuse("int()")
    __index__ = _refuse("int()/index")
    __float__ = _refuse("float()")
    __hash__ = _refuse("hash()")  # type: ignore[assignment]
    __eq__ = _refuse("==")  # type: ignore[assignment]
    __ne__ = _refuse("!=")  # type: ignore[assignment]
    __lt__ = _refuse("<")
    __le__ = _refuse("<=")
    __gt__ = _refuse(">")
    __ge__ = _refuse(">=")
    __abs__ = _refuse("abs()")
    __neg__ = _refuse("unary -")


def value_of(x: Any) -> Any:
    """The concrete value of a (nested tuple of) ``Dyn``/int."""
    if isinstance(x, tuple):
        return tuple(value_of(e) for e in x)
    return x.value if isinstance(x, Dyn) else x
