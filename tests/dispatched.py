"""The torch operations a call dispatches, for host-path tests (a call that should allocate only its output)."""
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Recording(TorchDispatchMode):
    def __init__(self, ops: list[str]):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def dispatched(fn: Callable[[], Any]) -> tuple[list[str], Any]:
    """(the torch operations ``fn()`` dispatches, its result): a mode sees an op, not what its kernel calls."""
    ops: list[str] = []
    with _Recording(ops):
        result = fn()
    return ops, result
