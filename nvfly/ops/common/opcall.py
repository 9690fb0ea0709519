"""The host side of an op call, shared by every op family and the torch glue: a call *signature* selects a
*plan* (its prepared launches) from a bounded cache; the first call of a signature checks the arguments and plans.

    _CALLS: OpCalls[_Call] = OpCalls()

    def op(x, k):
        try:
            key = (layout_key(x), k, type(k))        # what decides the plan: tensors' layouts, scalars
            call = _CALLS.get(key)                   # the hot path: one dict lookup ...
        except Exception:                            # unhashable arguments: planned, never remembered
            key = call = None
        if call is None:
            call = _CALLS.plan(OP, key, _plan, x, k)  # checks (raising errors that name OP), plans, remembers
        return call.run(x)                            # ... then the prepared launch

A signature is a tuple of ``nvfly.runtime.torch_args.layout_key`` of each tensor argument (shape, strides, dtype,
device, address modulo 16) and the scalar arguments that change the plan, with their types where equal values of
two types must plan differently (``True == 1`` but is not a valid ``eps``).

Eligibility: ``Eligibility`` functions return None when nvfly runs the arguments, else the reason it declines (the
torch glue then falls back to torch); a cache that remembers a decline stores a ``Declined`` in place of a plan.
Argument checks raise TypeError (a wrong type or dtype) or ValueError (a wrong shape or value) whose message starts
with the argument's name; ``named(op)`` puts the op's name in front.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Hashable, Iterator, Optional, TypeVar

if TYPE_CHECKING:
    import nvfly

Plan = TypeVar("Plan")

# None when nvfly runs the arguments, else why it declines them
Eligibility = Callable[..., Optional[str]]

CALL_LIMIT = 4096  # signatures a cache holds before it starts again (programs use far fewer)


@dataclass(frozen=True)
class Declined:
    """A signature nvfly does not run, and why: cached in place of a plan, so later calls fall back at once."""
    reason: str

    def __str__(self) -> str:
        return self.reason


@contextlib.contextmanager
def context_value(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """``var`` set to ``value`` inside the block (an op's plan options for the calls inside, say)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def named(op: str) -> Iterator[None]:
    """Argument errors raised inside name ``op`` first: TypeError and ValueError "x: ..." become "op: x: ..."."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        error = renamed(op, exc)
        if error is exc:
            raise
        raise error from None


def renamed(op: str, exc: Exception) -> Exception:
    """The error ``named(op)`` raises for ``exc`` (itself where it is not a plain TypeError or ValueError or names
    ``op`` already): for hot paths, where ``try: ... except (TypeError, ValueError) as e: raise renamed(op, e)``
    costs nothing until it raises (``named``'s generator costs about a µs a call)."""
    message = str(exc)
    if type(exc) not in (TypeError, ValueError) or message.startswith(op + ": "):
        return exc
    return type(exc)(f"{op}: {message}")


class OpCalls(Generic[Plan]):
    """Signature -> plan, at most ``limit`` of them (a full cache is emptied: signatures of one program are few, and
    a cache that overflows is better replanned than tracked).

    ``get(key)`` is the dictionary's own ``get`` (the hot path costs one lookup). Safe under threads in CPython:
    lookups and stores are single dictionary operations, and the overflow check and store hold a lock. Two threads
    missing on one signature both plan it (plans are values: either is right); planning holds no lock, since it
    may compile."""

    __slots__ = ("get", "limit", "_plans", "_lock")

    def __init__(self, limit: int = CALL_LIMIT):
        self._plans: dict[Hashable, Plan] = {}
        self.get: Callable[[Hashable], Optional[Plan]] = self._plans.get
        self.limit = limit
        self._lock = threading.Lock()

    def plan(self, op: str, key: Optional[Hashable], make: Callable[..., Plan], *args: Any) -> Plan:
        """A miss: ``make(*args)`` (its argument errors named for ``op``), remembered under ``key`` (None: not)."""
        with named(op):
            plan = make(*args)
        self.remember(key, plan)
        return plan

    def get_or_plan(self, op: str, key: Hashable, make: Callable[..., Plan], *args: Any) -> Plan:
        """The plan of ``key``, made by ``plan`` on a miss (for callers off the hot path: it costs a frame)."""
        plan = self._plans.get(key)
        return self.plan(op, key, make, *args) if plan is None else plan

    def remember(self, key: Optional[Hashable], plan: Plan) -> None:
        if key is None:
            return
        with self._lock:
            if len(self._plans) >= self.limit and key not in self._plans:
                self._plans.clear()
            self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()

    def values(self) -> list[Plan]:
        return list(self._plans.values())

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._plans


@dataclass(frozen=True)
class KernelScalars:
    """A kernel's arguments after its tensors, given by parameter name (``of`` checks the names against the
    kernel's signature); ``values`` holds them in the kernel's order, as PreparedLaunch.launch takes them."""
    names: tuple[str, ...]
    values: tuple[Any, ...]

    @classmethod
    def of(cls, kernel: "nvfly.Kernel", **by_name: Any) -> "KernelScalars":
        names = tuple(p.name for p in kernel.params if p.kind != "tensor")
        if set(names) != set(by_name):
            raise TypeError(f"{kernel.name}: expected the arguments {names}, got {tuple(by_name)}")
        return cls(names, tuple(by_name[name] for name in names))
