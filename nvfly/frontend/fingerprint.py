"""A stable hash of a kernel's Python source and what it reads from its module, for the spec-level cache.

It covers the function's source, the source of user-defined functions and nvfly device functions it refers to
(through globals, closures or attributes of user modules, recursively) and the values of simple constants it
reads. nvfly's own code is covered by the nvfly version in every key.
"""
from __future__ import annotations

import hashlib
import inspect
import sys
import types
from typing import Any, Callable, Optional

_SIMPLE = (bool, int, float, str, bytes, type(None))


def _is_simple(value: Any) -> bool:
    if isinstance(value, _SIMPLE):
        return True
    if isinstance(value, tuple):
        return all(_is_simple(v) for v in value)
    from nvfly.frontend.dtypes import DType
    return isinstance(value, DType)


_TRUSTED = ("nvfly", "mlir", "torch", "triton", "numpy", "builtins")


def _module_name(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    return getattr(obj, "__module__", None) or ""


def _is_user_code(obj: Any) -> bool:
    """Code whose changes are not covered by a package version (the user's own modules)."""
    root = _module_name(obj).split(".")[0]
    return root not in _TRUSTED and root not in sys.stdlib_module_names


def _underlying(value: Any) -> Optional[Callable]:
    """The Python function behind a plain function or an nvfly kernel/func object."""
    if isinstance(value, types.FunctionType):
        return value
    inner = getattr(value, "fn", None)
    return inner if isinstance(inner, types.FunctionType) else None


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def fingerprint(fn: Callable) -> Optional[str]:
    """Hex digest, or None when something the function uses cannot be hashed reliably."""
    h = hashlib.sha256()
    seen: set[int] = set()
    try:
        if not _feed(fn, h, seen):
            return None
    except (OSError, TypeError):
        return None
    return h.hexdigest()


def _feed(fn: Callable, h: Any, seen: set[int]) -> bool:
    if id(fn) in seen:
        return True
    seen.add(id(fn))
    h.update(inspect.getsource(fn).encode())
    referenced: list[tuple[str, Any]] = []
    for name in sorted(_names(fn.__code__)):
        if name in fn.__globals__:
            referenced.append((name, fn.__globals__[name]))
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            referenced.append((name, cell.cell_contents))
        except ValueError:  # empty cell
            continue
    code_names = _names(fn.__code__)
    for name, value in referenced:
        h.update(name.encode())
        if _is_simple(value):
            h.update(repr(value).encode())
        elif _underlying(value) is not None:
            target = _underlying(value)
            if _is_user_code(target) and not _feed(target, h, seen):
                return False
        elif isinstance(value, types.ModuleType):
            if _is_user_code(value) and not _feed_module(value, code_names, h, seen):
                return False
        elif isinstance(value, type):
            if _is_user_code(value):
                h.update(inspect.getsource(value).encode())
        elif _is_user_code(type(value)):
            return False  # an object of the user's whose state may change what is traced
    return True


def _feed_module(module: types.ModuleType, attrs: set[str], h: Any, seen: set[int]) -> bool:
    for attr in sorted(attrs):
        member = getattr(module, attr, None)
        if member is None:
            continue
        h.update(f"{module.__name__}.{attr}".encode())
        if _is_simple(member):
            h.update(repr(member).encode())
        elif _underlying(member) is not None and _is_user_code(_underlying(member)):
            if not _feed(_underlying(member), h, seen):
                return False
    return True
