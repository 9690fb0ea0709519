"""Defining nvfly's torch operators with little per-call overhead.

``torch.library.custom_op`` runs every call through a Python wrapper (about 25 µs per call on a fast CPU);
an operator defined on a ``torch.library.Library``, its implementation registered for
CompositeExplicitAutograd, is called by the dispatcher directly (about 2 µs). ``operator`` keeps custom_op's
convenience: the schema is inferred from the type hints.

    @operator("mm")
    def mm(a: Tensor, b: Tensor, *, config: str = "auto") -> Tensor: ...
    register_fake("mm", lambda a, b, *, config="auto": a.new_empty(...))
    register_autograd("mm", backward, setup_context=setup)

``register_autograd`` is ``torch.library.register_autograd`` with a short way through calls that record no graph:
torch's autograd kernel builds a metadata object and redispatches below autograd on every call, grad or not
(about 7 µs a call, more than a shuffle's whole host path); nvfly's calls the implementation itself when no input
needs a gradient and nothing but a CPU or CUDA kernel sits below autograd (no fake or functional tensor, no
``__torch_dispatch__`` mode: those still redispatch, so tracing sees the fakes).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch._library.autograd import Info, make_autograd_impl

_LIBRARY = torch.library.Library("nvfly", "FRAGMENT")
_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}  # name -> the Python implementation ``operator`` registered

# the keys below autograd where the dispatcher would land on the CompositeExplicitAutograd implementation itself
_DIRECT_KEYS = frozenset((torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA))


def operator(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Any]:
    """Define ``nvfly::<name>`` with the decorated function as its implementation on every device; returns
    ``torch.ops.nvfly.<name>``."""
    def define(fn: Callable[..., Any]) -> Any:
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        _IMPLEMENTATIONS[name] = fn
        return getattr(torch.ops.nvfly, name)
    return define


def register_fake(name: str, fake: Callable[..., Any]) -> None:
    """The meta implementation of ``nvfly::<name>`` (shapes and dtypes only), for tracing and torch.compile."""
    torch.library.register_fake(f"nvfly::{name}", fake, lib=_LIBRARY)


def register_autograd(name: str, backward: Callable[..., Any], setup_context: Callable[..., Any]) -> None:
    """``torch.library.register_autograd("nvfly::<name>", backward, setup_context=setup_context)`` for an operator
    of ``operator`` (functional, no keyword-only tensors), whose calls without a gradient to record go straight
    to its implementation (the module doc)."""
    op = getattr(torch.ops.nvfly, name).default
    implementation = _IMPLEMENTATIONS[name]
    differentiable = make_autograd_impl(op, Info(backward, setup_context))
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad
    below_autograd = torch._C._after_autograd_keyset
    direct = _DIRECT_KEYS

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if grad_enabled() and any_requires_grad(*args):
            return differentiable(keyset, *args, **kwargs)
        if (keyset & below_autograd).highestPriorityTypeId() in direct:
            return implementation(*args, **kwargs)
        return differentiable(keyset, *args, **kwargs)  # (its no-grad branch redispatches below autograd)

    kernel.__name__ = f"nvfly_autograd_{name}"
    _LIBRARY.impl(name, kernel, "Autograd", with_keyset=True)
