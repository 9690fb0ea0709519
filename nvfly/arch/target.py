"""Which compile targets have which atoms.

An atom builder declares the target it needs with ``requires``; tracing it for a kernel compiled for another
target is a CompileError naming the atom, the instruction, what it needs and the kernel's target (pointing at
the user's line, like every trace-time error), instead of a ptxas rejection or an LLVM abort much later.

Two kinds of need: ``"sm_90"`` (compute capability 9.0 or newer: TMA, mbarrier transaction counts, clusters,
stmatrix) and ``"sm_90a"`` (the arch-specific Hopper features, on sm_90a only: wgmma, setmaxnreg).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from nvfly.errors import CompileError
from nvfly.frontend.trace import current, traced

F = TypeVar("F", bound=Callable[..., Any])

_TARGET = re.compile(r"sm_(\d+)([a-z]?)$")


@dataclass(frozen=True)
class Target:
    """A compile target such as ``sm_90a``: compute capability (major * 10 + minor) and its feature suffix."""
    capability: int
    suffix: str

    @staticmethod
    def parse(name: str) -> "Target":
        match = _TARGET.match(name)
        if match is None:
            raise CompileError(f"compile target {name!r} is not of the form sm_<major><minor>[a]")
        return Target(int(match.group(1)), match.group(2))

    def has(self, need: "Target") -> bool:
        """True if this target runs what ``need`` names: an arch-specific need (``sm_90a``) only on that chip
        with that suffix, a plain one (``sm_90``) on it and every newer one."""
        if need.suffix:
            return self == need
        return self.capability >= need.capability


def requires(need: str, instruction: str) -> Callable[[F], F]:
    """Decorator of an atom builder (replaces ``traced``): the atom traces only for targets that have ``need``.

    ``instruction`` is the PTX the atom emits, named in the error.
    """
    needed = Target.parse(need)
    wording = need if needed.suffix else f"{need} or newer"

    def wrap(fn: F) -> F:
        atom = f"{fn.__module__.split('.')[2]}.{fn.__qualname__}" if fn.__module__.startswith("nvfly.arch.") \
            else fn.__qualname__

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            target = current().target
            if not Target.parse(target).has(needed):
                raise CompileError(f"{atom} ({instruction}) needs target {wording}; this kernel is compiled for "
                                   f"{target}")
            return fn(*args, **kwargs)

        return traced(checked)  # type: ignore[return-value]

    return wrap
