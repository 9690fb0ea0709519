"""Eager routing of aten calls to nvfly kernels, shared by every nvfly op.

    nvfly.torch.routing.install_routing()      # once: registers the CUDA implementations below
    with nvfly.torch.routing.routing():        # in this block (this thread / async context) calls may go to nvfly
        y = F.rms_norm(x, (4096,), w)          # -> aten::_fused_rms_norm (CUDA) -> nvfly when eligible
        v, i = torch.topk(logits, 50)          # -> aten::topk (CUDA) -> nvfly when eligible

The switch is a contextvar; inside an enabled block autograd runs backward passes on the calling thread (its
CUDA device threads would not see the switch), so backward kernels are routed too.

A *route* is an aten overload, an eligibility function (None or the reason nvfly declines) and the nvfly
function to call, both taking the aten arguments. ``install_routing`` registers, for each route, a
``torch.library`` implementation for the CUDA dispatch key that checks the switch and the eligibility, calls
nvfly, and otherwise (declined, switched off, or nvfly raised) falls through to the kernel torch had there
(``torch.library.get_kernel(...).call_boxed``). It sits below autograd, so backward passes keep torch's
formulas and reach routed ops again. Other ops (GEMM, SDPA) add themselves with ``register_route``. An op
torch implements as a composite (``aten::scaled_dot_product_attention``) is routed on ``AutogradCUDA`` (above
autograd: its fallthrough, the composite, keeps torch's backward) and on ``CUDA`` (reached under
``torch.inference_mode``, which skips autograd keys), both falling through to the composite.

Which aten ops F.rms_norm reaches (torch 2.8 to 2.13): ``aten::rms_norm`` is CompositeImplicitAutograd and, for
CUDA inputs whose weight has the input's dtype (not channels-last, not complex), calls ``aten::_fused_rms_norm``,
which has a CUDA kernel and an autograd formula using ``aten::_fused_rms_norm_backward``; both are routed.
``aten::rms_norm`` itself is left alone: a CUDA kernel registered there would replace its composite autograd.
Other inputs take torch's composite path (pow/mean/rsqrt), which is not routed.

A routed call's host cost: the dispatcher's trampoline into the Python kernel and back to torch's (paid while
switched off too), then the decision. A route with a ``signature`` (GEMM, SDPA, RMSNorm, TopK) decides once per
call signature (``tensor_key`` of each tensor, the scalars the rule reads, the modes and flags it reads) and later
calls cost a dictionary lookup: declined calls go straight to torch's kernel, accepted ones to ``run``. What a
signature leaves out and may change (the GEMM autotune database) calls ``forget_decisions``. Measured by
``benchmarks/routing_overhead.py`` (plain, switched off, routed).

Every decline is logged at debug level on the "nvfly" logger (at info level when ``NVFLY_DEBUG`` is set), once per
signature; an exception inside nvfly is logged (a warning, once per op and error type), the call falls back and its
signature is declined from then on.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Hashable, Iterator, Optional

import torch

from nvfly import settings
from nvfly.ops.common.opcall import Eligibility, OpCalls

log = logging.getLogger("nvfly")

_SWITCH: contextvars.ContextVar[bool] = contextvars.ContextVar("nvfly_routing")  # unset: off


@dataclass(frozen=True)
class Route:
    """An aten overload (``"aten::topk"``, ``"aten::mm.out"``) routed to nvfly on ``dispatch_key``.

    ``signature`` (optional) maps the aten arguments to a hashable key of everything ``eligibility`` depends on
    (None: this call is not remembered): the routed kernel then decides once per signature and later calls cost a
    dictionary lookup. What the key leaves out must not change the decision, or must call ``forget_decisions``."""
    op: str
    eligibility: Eligibility
    run: Callable[..., Any]
    dispatch_key: str = "CUDA"
    signature: Optional[Callable[..., Optional[Hashable]]] = None


_ROUTES: dict[tuple[str, str], Route] = {}
_INSTALLED: dict[tuple[str, str], Any] = {}  # route key -> the kernel torch had (None: nothing to route)
_LIBRARY: Optional[torch.library.Library] = None
_LOCK = threading.Lock()
_WARNED: set[tuple[str, str]] = set()
_DEFAULTS_REGISTERED = False
_DECIDED: list[OpCalls[tuple[Optional[str]]]] = []  # each routed kernel's signature -> (reason or None,)


# ---------------------------------------------------------------------------------------------- the switch
def enable_routing() -> None:
    """Route eligible calls to nvfly from now on, in this thread / async context."""
    _SWITCH.set(True)


def disable_routing() -> None:
    """Stop routing in this thread / async context."""
    _SWITCH.set(False)


def routing_enabled() -> bool:
    """Whether calls are routed in this thread / async context."""
    return _SWITCH.get(False)


@contextlib.contextmanager
def routing(enabled: bool = True) -> Iterator[None]:
    """Route eligible calls to nvfly inside the block (``enabled=False``: keep them on torch).

    Inside an enabled block autograd runs backward on the calling thread: its CUDA worker threads would not
    see the switch (a context variable), and backward kernels would stay on torch."""
    token = _SWITCH.set(enabled)
    backward_here = torch.autograd.set_multithreading_enabled(False) if enabled else contextlib.nullcontext()
    try:
        with backward_here:
            yield
    finally:
        _SWITCH.reset(token)


# ---------------------------------------------------------------------------------------------- registry
def register_route(op: str, eligibility: Eligibility, run: Callable[..., Any],
                   dispatch_key: str = "CUDA", signature: Optional[Callable[..., Optional[Hashable]]] = None) -> None:
    """Add a route (it takes effect at the next ``install_routing``). ``eligibility``, ``run`` and ``signature``
    (``Route``) receive the aten arguments in schema order (keyword-only ones as keywords); ``run`` returns what the
    op returns."""
    name = op if "::" in op else f"aten::{op}"
    with _LOCK:
        _ROUTES[(name, dispatch_key)] = Route(name, eligibility, run, dispatch_key, signature)


def tensor_key(t: torch.Tensor) -> tuple:
    """A tensor's part of a route signature: shape, strides, dtype, device index (-1 off a GPU) and address modulo
    16 (five reads: ``get_device`` makes no device object, as ``layout_key``'s ``device`` does)."""
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15


def forget_decisions() -> None:
    """Decide every signature again (what a signature leaves out changed: e.g. the GEMM autotune database)."""
    for decided in list(_DECIDED):
        decided.clear()


def routes() -> list[Route]:
    return list(_ROUTES.values())


def install_routing() -> None:
    """Register the nvfly implementation of every route not registered yet (idempotent; never undone)."""
    global _LIBRARY
    _register_default_routes()
    __import__("nvfly.torch.flex_ops").torch.flex_ops.install()  # flex_attention: a py_impl on its HOP, not aten
    with _LOCK:
        # every kernel torch has is read before any route registers: one op routed on two keys (SDPA on CUDA and
        # AutogradCUDA) falls through to torch's composite on both, which a CUDA registration would otherwise
        # change for AutogradCUDA
        pending: dict[tuple[str, str], Any] = {}
        for key, route in _ROUTES.items():
            if key in _INSTALLED:
                continue
            try:
                pending[key] = torch.library.get_kernel(route.op, route.dispatch_key)
            except RuntimeError as exc:  # e.g. a CPU-only torch build has no CUDA kernel to fall back to
                log.debug("nvfly: not routing %s: %s", route.op, exc)
                _INSTALLED[key] = None
        for key, fallthrough in pending.items():
            route = _ROUTES[key]
            if _LIBRARY is None:
                _LIBRARY = torch.library.Library("aten", "IMPL")
            _LIBRARY.impl(route.op.split("::", 1)[1], _routed(route, fallthrough), route.dispatch_key,
                          with_keyset=True)
            _INSTALLED[key] = fallthrough


def installed() -> list[str]:
    """The aten overloads routed now."""
    return list(dict.fromkeys(op for (op, _), kernel in _INSTALLED.items() if kernel is not None))


def _routed(route: Route, fallthrough: Any) -> Callable[..., Any]:
    """The kernel registered for ``route``: when routing is on, the decision of the call's signature (made once:
    ``eligibility``, then a dictionary lookup), nvfly's ``run`` if it accepts, else ``fallthrough``. An nvfly
    failure falls back and declines its signature from then on."""
    decided: OpCalls[tuple[Optional[str]]] = OpCalls()
    _DECIDED.append(decided)
    # bound once: a declined call is the switch, the key, one lookup and torch's kernel
    switch, lookup, signature, run = _SWITCH.get, decided.get, route.signature, route.run
    call_torch = fallthrough.call_boxed

    def impl(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if switch(False):
            key = hit = None
            if signature is not None:
                try:
                    key = signature(*args, **kwargs)
                    hit = lookup(key)
                except Exception:  # noqa: BLE001 - not tensors, unhashable: decided without remembering
                    key = None
            if hit is None:
                hit = (_decide(route, args, kwargs),)
                decided.remember(key, hit)
                if hit[0] is not None:
                    _declined(route, hit[0])
            if hit[0] is None:
                try:
                    return run(*args, **kwargs)
                except Exception as exc:  # an nvfly failure must never break the caller: use torch
                    _failed(route, exc)
                    decided.remember(key, (f"nvfly raised {type(exc).__name__}: {exc}",))
        return call_torch(keyset, *args, **kwargs)

    impl.__name__ = f"nvfly_route_{route.op.replace('::', '_').replace('.', '_')}"
    return impl


def _decide(route: Route, args: tuple, kwargs: dict) -> Optional[str]:
    try:
        return route.eligibility(*args, **kwargs)
    except Exception as exc:  # a broken eligibility check declines
        return f"eligibility check raised {type(exc).__name__}: {exc}"


def _declined(route: Route, reason: str) -> None:
    """Log a decline (once per signature where the route has one)."""
    level = logging.INFO if settings.get("debug") else logging.DEBUG
    if log.isEnabledFor(level):
        log.log(level, "nvfly: %s stays on torch: %s", route.op, reason)


def _failed(route: Route, exc: Exception) -> None:
    key = (route.op, type(exc).__name__)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("nvfly: %s raised %s: %s; the call falls back to torch (warned once per op and error type)",
                    route.op, type(exc).__name__, exc)
    log.debug("nvfly: %s fell back to torch after an error", route.op, exc_info=exc)


# ---------------------------------------------------------------------------------------------- nvfly's routes
# An eager RMSNorm call moving less than this (input + output, or the backward's three tensors) runs its kernel in
# less time than nvfly's host path costs over torch's (28 vs 11 us a call on the H200, routing_overhead_h200.json):
# launch-bound, it stays on torch. Under CUDA-graph capture the host path is paid once and nvfly's kernel runs.
RMS_NORM_EAGER_BYTES = 64 << 20


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _launch_bound(x: torch.Tensor, tensors: int) -> Optional[str]:
    moved = tensors * x.numel() * x.element_size()
    if moved >= RMS_NORM_EAGER_BYTES or _capturing(x):
        return None
    return (f"{moved / 2**20:.1f} MiB moved (< {RMS_NORM_EAGER_BYTES >> 20} MiB) outside CUDA-graph capture: "
            "launch-bound, where nvfly's host path costs more than its kernel saves")


def _register_default_routes() -> None:
    """The routes of RMSNorm and TopK (GEMM's come with ``nvfly.torch.autotune``, which the package imports)."""
    global _DEFAULTS_REGISTERED
    if _DEFAULTS_REGISTERED:
        return
    _DEFAULTS_REGISTERED = True
    from nvfly.ops import rmsnorm, topk

    def rms_norm_eligibility(x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor],
                             eps: Optional[float]) -> Optional[str]:
        return _launch_bound(x, 2) or rmsnorm.eligibility(x, weight, None, normalized_shape, eps)

    def rms_norm_run(x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor],
                     eps: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
        y, _, rstd = rmsnorm.rms_norm_forward(x, weight, eps, None, normalized_shape)
        axis = x.dim() - len(normalized_shape)
        return y, rstd.view(list(x.shape[:axis]) + [1] * len(normalized_shape))

    def rms_norm_backward_eligibility(grad_out: torch.Tensor, x: torch.Tensor, normalized_shape: list[int],
                                      rstd: torch.Tensor, weight: Optional[torch.Tensor],
                                      output_mask: list[bool]) -> Optional[str]:
        if not output_mask[0]:
            return "the input gradient is not needed"
        if rstd.dtype != torch.float32 or grad_out.dtype != x.dtype:
            return "rstd is not float32 or grad_out's dtype differs from the input's"
        return _launch_bound(x, 3) or rmsnorm.backward_eligibility(x, normalized_shape, grad_out)

    def rms_norm_backward_run(grad_out: torch.Tensor, x: torch.Tensor, normalized_shape: list[int],
                              rstd: torch.Tensor, weight: Optional[torch.Tensor],
                              output_mask: list[bool]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        return rmsnorm.rms_norm_backward(grad_out, x, rstd.reshape(-1), weight, normalized_shape,
                                         needs_weight_grad=bool(output_mask[1]))

    def topk_run(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
                 sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return topk.topk(x, k, dim, largest, sorted)

    def rms_norm_signature(x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor],
                           eps: Optional[float]) -> tuple:
        return (tensor_key(x), tuple(normalized_shape), weight is not None and tensor_key(weight), eps, type(eps),
                _capturing(x))

    def rms_norm_backward_signature(grad_out: torch.Tensor, x: torch.Tensor, normalized_shape: list[int],
                                    rstd: torch.Tensor, weight: Optional[torch.Tensor], output_mask: list[bool]
                                    ) -> tuple:
        return (tensor_key(grad_out), tensor_key(x), tuple(normalized_shape), rstd.dtype,
                weight is not None and tensor_key(weight), tuple(output_mask), _capturing(x))

    def topk_signature(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> tuple:
        return tensor_key(x), k, dim, largest, sorted

    register_route("aten::_fused_rms_norm", rms_norm_eligibility, rms_norm_run, signature=rms_norm_signature)
    register_route("aten::_fused_rms_norm_backward", rms_norm_backward_eligibility, rms_norm_backward_run,
                   signature=rms_norm_backward_signature)
    register_route("aten::topk", topk.eligibility, topk_run, signature=topk_signature)


class _RoutingModule(types.ModuleType):
    """This module, callable as its switch with the routes installed: ``with nvfly.torch.routing():``."""

    def __call__(self, enabled: bool = True) -> ContextManager[None]:
        install_routing()
        return routing(enabled)


sys.modules[__name__].__class__ = _RoutingModule
