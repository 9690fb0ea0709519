"""Eager routing of aten calls to nvfly kernels, shared by every nvfly op.

    with nvfly.torch.routing():                # in this block (this thread / async context) calls may go to nvfly
        y = F.rms_norm(x, (4096,), w)          # -> aten::_fused_rms_norm (CUDA) -> nvfly when eligible
        v, i = torch.topk(logits, 50)          # -> aten::topk (CUDA) -> nvfly when eligible

The switch is a contextvar; inside an enabled block autograd runs backward passes on the calling thread (its
CUDA device threads would not see the switch), so backward kernels are routed too.

A *route* is an aten overload, an eligibility function (None or the reason nvfly declines) and the nvfly
function to call, both taking the aten arguments. For each route a ``torch.library`` implementation is registered
for the CUDA dispatch key that checks the switch and the eligibility, calls nvfly, and otherwise (declined,
switched off, or nvfly raised) falls through to the kernel torch had there
(``torch.library.get_kernel(...).call_boxed``). It sits below autograd, so backward passes keep torch's formulas and
reach routed ops again. Other ops (GEMM, SDPA) add themselves with ``register_route``. An op torch implements as a
composite (``aten::scaled_dot_product_attention``) is routed on ``AutogradCUDA`` (above autograd: its fallthrough,
the composite, keeps torch's backward) and on ``CUDA`` (reached under ``torch.inference_mode``, which skips
autograd keys), both falling through to the composite.

The registrations live only while routing is wanted somewhere in the process: the first enabled ``routing()``
block (or ``enable_routing()``) registers them, the last one to end removes them (``installed()`` lists them), so
outside routing a torch call costs what it costs without nvfly. A route whose ``wanted`` says it would decline every
call now (the GEMM routes while the autotune database has no entry where nvfly wins) is not registered at all;
``forget_decisions`` asks again. Registering costs a few µs per route at a block's start (the first one only, when
blocks nest or run in several threads at once), removing them about a µs each at its end; both are measured by
``benchmarks/routing_overhead.py``. The switch stays per thread / async context: a thread outside any block while
another is inside one passes through the registered kernels (switched off) to torch's.

Which aten ops F.rms_norm reaches (torch 2.8 to 2.13): ``aten::rms_norm`` is CompositeImplicitAutograd and, for
CUDA inputs whose weight has the input's dtype (not channels-last, not complex), calls ``aten::_fused_rms_norm``,
which has a CUDA kernel and an autograd formula using ``aten::_fused_rms_norm_backward``; both are routed.
``aten::rms_norm`` itself is left alone: a CUDA kernel registered there would replace its composite autograd.
Other inputs take torch's composite path (pow/mean/rsqrt), which is not routed.

A routed call's host cost: the hop into nvfly's kernel, then the decision. The routes are registered as the C++
route kernel (``native_routes``: built once per torch version) in front of the Python kernel: a call whose *call
key* (its tensors' layouts, scalars, grad mode, stream, SDPA backends) the Python kernel declined before goes to
torch's kernel from C++ without entering Python (a declined RMSNorm on the H200's host: +1.5 µs over torch alone,
+16.7 through the Python kernel; ``benchmarks/routing_overhead.py``); any other call reaches the Python kernel
through the dispatcher's trampoline (3-5 µs in a tight loop, several times that inside a model step). Where the
extension cannot be built (no C++ compiler) or ``NVFLY_ROUTING_NATIVE=0``, the Python kernel alone is registered and
every call pays the trampoline. A hook above the dispatcher (a ``TorchFunctionMode`` or ``__torch_dispatch__`` mode)
would put every torch call of the block through Python, not only the routed ops'. Registering fewer routes removes
even the C++ hop (``wanted``, ``NVFLY_ROUTING_RMS_NORM``, ``NVFLY_ROUTING_MIN_GAIN_US`` for the GEMM routes).
The decision, cheapest first:
- ``skip`` (RMSNorm forward and backward, SDPA): the host-overhead policy. A call whose kernel would save less than
  nvfly's host path costs (launch-bound: RMSNorm under ``RMS_NORM_EAGER_BYTES`` moved outside CUDA-graph capture,
  SDPA decode under ``MIN_KV_BYTES`` of K and V, prefill under ``MIN_PREFILL_FLOPS``) goes to torch's kernel after a
  few tensor reads, before any signature (0.3 µs of Python for RMSNorm on the CI machine, 1.2 µs before). While the
  "nvfly" logger logs routing decisions such calls are decided in full, so the log (and for SDPA ``explain``'s
  decisions) says why, once per signature.
- a route with a ``signature`` (GEMM, SDPA, RMSNorm, TopK) decides once per call signature (``tensor_key`` of each
  tensor, the scalars the rule reads, the modes and flags it reads) and later calls cost a dictionary lookup:
  declined calls go straight to torch's kernel, accepted ones to what ``bind`` made for the signature (GEMM: its
  bound launches and output allocation; SDPA decode: ``attention.bound_decode``'s launches on the (B, H, S, D)
  tensors as they are), else ``run``. What a signature leaves out and may change (the GEMM autotune database) calls
  ``forget_decisions``.
Measured by ``benchmarks/routing_overhead.py`` (plain, outside routing, switched off inside a block, routed, the
decision alone, a block's start and end; ``--profile``: whole decoder layers).

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
from nvfly.torch import native_routes
from nvfly.ops.common.opcall import Eligibility, OpCalls

log = logging.getLogger("nvfly")

_SWITCH: contextvars.ContextVar[bool] = contextvars.ContextVar("nvfly_routing")  # unset: off


@dataclass(frozen=True)
class Route:
    """An aten overload (``"aten::topk"``, ``"aten::mm.out"``) routed to nvfly on ``dispatch_key``.

    ``signature`` (optional) maps the aten arguments to a hashable key of everything ``eligibility`` depends on
    (None: this call is not remembered): the routed kernel then decides once per signature and later calls cost a
    dictionary lookup. What the key leaves out must not change the decision, or must call ``forget_decisions``.
    ``wanted`` (optional) says False when every call would be declined now: the route is then not registered (its
    calls cost nothing); asked when routing starts (the outermost block) and at ``forget_decisions``.
    ``skip`` (optional), the host-overhead policy: a cheap predicate (a few tensor reads) True only for calls that
    ``eligibility`` declines whatever else they hold, because nvfly's kernel would save less than its host path
    costs (launch-bound sizes outside CUDA-graph capture); they go to torch's kernel before the signature is built.
    While the "nvfly" logger logs routing decisions (info level: ``NVFLY_DEBUG``, or debug) they are decided in full
    instead, so the log (and for SDPA ``explain``'s decisions) says why, once per signature.
    ``bind`` (optional) makes, once per accepted signature, the callable that runs calls of that signature (the
    aten arguments in, the op's result out): what it prepares (launches, output shape, device) may read only what the
    signature holds; without it each call runs ``run``."""
    op: str
    eligibility: Eligibility
    run: Callable[..., Any]
    dispatch_key: str = "CUDA"
    signature: Optional[Callable[..., Optional[Hashable]]] = None
    wanted: Optional[Callable[[], bool]] = None
    skip: Optional[Callable[..., bool]] = None
    bind: Optional[Callable[..., Callable[..., Any]]] = None


RouteKey = tuple[str, str]  # (op, dispatch key)

_ROUTES: dict[RouteKey, Route] = {}
_FALLTHROUGHS: dict[RouteKey, Any] = {}  # the kernel torch has on a registered key (None: nothing to route)
_KERNELS: dict[RouteKey, Callable[..., Any]] = {}  # each route's kernel, made once: its decisions outlive blocks
_KEY_MAP: dict[str, str] = {}  # a route's dispatch key -> the key it is registered on (``on_keys``; tests)
_LIBRARY: Any = None  # the dispatcher library holding the registrations in force (None: none)
_REGISTERED: tuple[RouteKey, ...] = ()  # the routes registered now
_HOLDS = 0  # enabled routing() blocks in progress and enable_routing() holders, in every thread
_LOCK = threading.RLock()
_WARNED: set[tuple[str, str]] = set()
_DEFAULTS_REGISTERED = False
# a decision: (why torch runs the call, None) or (None, what runs it: ``run`` or what ``bind`` made)
RouteDecision = tuple[Optional[str], Optional[Callable[..., Any]]]
_DECIDED: list[OpCalls[RouteDecision]] = []  # each routed kernel's signature -> its decision
_PLAN: Optional[tuple] = None  # what _sync registers (``_plan``; None: to be made again)
_HELD: contextvars.ContextVar[bool] = contextvars.ContextVar("nvfly_routing_held")  # enable_routing's hold here


# ---------------------------------------------------------------------------------------------- the switch
def enable_routing() -> None:
    """Route eligible calls to nvfly from now on, in this thread / async context (the routes stay registered, for
    every thread, until ``disable_routing`` here)."""
    if not _HELD.get(False):
        _hold()
        _HELD.set(True)
    _SWITCH.set(True)


def disable_routing() -> None:
    """Stop routing in this thread / async context (and release ``enable_routing``'s registrations)."""
    _SWITCH.set(False)
    if _HELD.get(False):
        _HELD.set(False)
        _release()


def routing_enabled() -> bool:
    """Whether calls are routed in this thread / async context."""
    return _SWITCH.get(False)


@contextlib.contextmanager
def routing(enabled: bool = True) -> Iterator[None]:
    """Route eligible calls to nvfly inside the block (``enabled=False``: keep them on torch). An enabled block
    keeps the routes registered (the first one to start registers them, the last one to end removes them).

    Inside an enabled block autograd runs backward on the calling thread: its CUDA worker threads would not
    see the switch (a context variable), and backward kernels would stay on torch."""
    if enabled:
        _hold()
    token = _SWITCH.set(enabled)
    backward_here = torch.autograd.set_multithreading_enabled(False) if enabled else contextlib.nullcontext()
    try:
        with backward_here:
            yield
    finally:
        _SWITCH.reset(token)
        if enabled:
            _release()


# ---------------------------------------------------------------------------------------------- registry
def register_route(op: str, eligibility: Eligibility, run: Callable[..., Any],
                   dispatch_key: str = "CUDA", signature: Optional[Callable[..., Optional[Hashable]]] = None,
                   wanted: Optional[Callable[[], bool]] = None, skip: Optional[Callable[..., bool]] = None,
                   bind: Optional[Callable[..., Callable[..., Any]]] = None) -> None:
    """Add (or replace) a route, registered from the next time routing starts (or now, inside a block).
    ``eligibility``, ``run``, ``signature``, ``skip`` and ``bind`` (``Route``) receive the aten arguments in schema
    order (keyword-only ones as keywords); ``run`` returns what the op returns."""
    name = op if "::" in op else f"aten::{op}"
    with _LOCK:
        key = (name, dispatch_key)
        _ROUTES[key] = Route(name, eligibility, run, dispatch_key, signature, wanted, skip, bind)
        _KERNELS.pop(key, None)
        _forget_plan(force=True)


def tensor_key(t: torch.Tensor) -> tuple:
    """A tensor's part of a route signature: shape, strides, dtype, device index (-1 off a GPU) and address modulo
    16 (five reads: ``get_device`` makes no device object, as ``layout_key``'s ``device`` does)."""
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15


def forget_decisions() -> None:
    """Decide every signature again (what a signature leaves out changed: e.g. the GEMM autotune database), and
    which routes are wanted."""
    for decided in list(_DECIDED):
        decided.clear()
    if native_routes.loaded() is not None:
        native_routes.loaded().forget()  # the C++ kernels' kept declines go with them
    _forget_plan()


def routes() -> list[Route]:
    return list(_ROUTES.values())


def install_routing() -> None:
    """Make nvfly's own routes known (idempotent). Registration is left to ``routing()`` blocks and
    ``enable_routing()``, while they last."""
    _register_default_routes()
    __import__("nvfly.torch.flex_ops").torch.flex_ops.install()  # flex_attention: a py_impl on its HOP, not aten


def installed() -> list[str]:
    """The aten overloads routed now (registered while a routing block or ``enable_routing()`` is in force)."""
    return list(dict.fromkeys(op for op, _ in _REGISTERED))


def _forget_plan(force: bool = False) -> None:
    """Make the plan again (the routes or what they want changed) and, inside routing, register it now (``force``:
    even the routes registered already, a kernel changed)."""
    global _PLAN
    with _LOCK:
        _PLAN = None
        if _HOLDS:
            _sync(force)


def _hold() -> None:
    global _HOLDS
    with _LOCK:
        _HOLDS += 1
        if _HOLDS == 1:  # the routes are asked again whether they are wanted
            install_routing()
            _forget_plan()


def _release() -> None:
    global _HOLDS
    with _LOCK:
        _HOLDS -= 1
        if _HOLDS == 0:
            _sync()


def _is_wanted(route: Route) -> bool:
    if route.wanted is None:
        return True
    try:
        return bool(route.wanted())
    except Exception as exc:  # noqa: BLE001 - a broken predicate keeps the route (it decides per call)
        log.debug("nvfly: %s: wanted() raised %s: %s", route.op, type(exc).__name__, exc)
        return True


def _sync(force: bool = False) -> None:
    """Register the wanted routes while routing is held, none otherwise (under ``_LOCK``); ``force``: again, though
    the same routes are wanted (a kernel changed)."""
    global _LIBRARY, _REGISTERED, _PLAN
    if _HOLDS and _PLAN is None:
        if any(key not in _FALLTHROUGHS for key in _ROUTES):
            _unregister()  # torch's kernels are read with none of nvfly's registered
        _PLAN = _plan()
    plan = _PLAN if _HOLDS else ()
    if tuple(key for key, *_ in plan) == _REGISTERED and not force:
        return
    _unregister()
    registered = []
    native = native_routes.module() if plan else None
    for key, name, kernel, dispatch_key in plan:
        if native is not None:
            try:
                native.register_route(name, dispatch_key, _FALLTHROUGHS[key],
                                      native_routes.python_kernel(key[0], key[1], kernel), _SWITCH)
                registered.append(key)
                continue
            except Exception as exc:  # noqa: BLE001 - the Python kernel alone routes it
                log.debug("nvfly: %s: no C++ route kernel (%s: %s)", key[0], type(exc).__name__, exc)
        if _LIBRARY is None:
            # the dispatcher's library object, not torch.library.Library: its Python bookkeeping (a finalizer, a
            # frame walk, checks) would double what a block's start costs; same calls (torch 2.1 to 2.13)
            _LIBRARY = torch._C._dispatch_library("IMPL", "aten", "", __file__, _LINE)
        try:
            _LIBRARY.impl(name, dispatch_key, kernel, True)
        except RuntimeError as exc:  # not routed: the op stays torch's
            log.debug("nvfly: not routing %s: %s", key[0], exc)
            continue
        registered.append(key)
    _REGISTERED = tuple(registered)


_LINE = _sync.__code__.co_firstlineno  # where the registrations say they come from (torch's dispatcher dumps)


def _unregister() -> None:
    global _LIBRARY, _REGISTERED
    if _LIBRARY is not None:
        _LIBRARY.reset()  # the registrations go: torch's kernels are the ones dispatched again
    if _REGISTERED and native_routes.loaded() is not None:
        native_routes.loaded().reset()
    _LIBRARY, _REGISTERED = None, ()


def _plan() -> tuple[tuple[RouteKey, str, Callable[..., Any], str], ...]:
    """(route, op name, kernel, dispatch key) of each wanted route torch has a kernel to fall through to. Every kernel
    torch has is read while none of nvfly's is registered (``_sync`` makes the plan with none): one op routed on two
    keys (SDPA on CUDA and AutogradCUDA) falls through to torch's composite on both, which a CUDA registration would
    otherwise change for AutogradCUDA."""
    plan = []
    for key, route in _ROUTES.items():
        if key not in _FALLTHROUGHS:
            _FALLTHROUGHS[key] = _torch_kernel(route)
        fallthrough = _FALLTHROUGHS[key]
        if fallthrough is None or not _is_wanted(route):
            continue
        kernel = _KERNELS.get(key)
        if kernel is None:
            kernel = _KERNELS[key] = _routed(route, fallthrough)
        plan.append((key, route.op.split("::", 1)[1], kernel, _KEY_MAP.get(route.dispatch_key, route.dispatch_key)))
    return tuple(plan)


def _torch_kernel(route: Route) -> Any:
    """The kernel torch has for the route's op on its key (None where there is none: a CPU-only torch build)."""
    try:
        return torch.library.get_kernel(route.op, _KEY_MAP.get(route.dispatch_key, route.dispatch_key))
    except RuntimeError as exc:
        log.debug("nvfly: not routing %s: %s", route.op, exc)
        return None


@contextlib.contextmanager
def on_keys(keys: dict[str, str]) -> Iterator[None]:
    """Register the routes on other dispatch keys in the block (``{"CUDA": "CPU", "AutogradCUDA": "AutogradCPU"}``:
    CPU calls reach them; tests and ``benchmarks/routing_overhead.py --cpu``), with fresh kernels and decisions.
    Entered and left outside routing."""
    global _FALLTHROUGHS, _KERNELS, _KEY_MAP, _PLAN
    with _LOCK:
        if _HOLDS:
            raise RuntimeError("routing.on_keys: entered inside routing (the routes are registered now)")
        saved = _FALLTHROUGHS, _KERNELS, _KEY_MAP
        _FALLTHROUGHS, _KERNELS, _KEY_MAP, _PLAN = {}, {}, dict(keys), None
    try:
        yield
    finally:
        with _LOCK:
            _FALLTHROUGHS, _KERNELS, _KEY_MAP = saved
            _forget_plan(force=True)


def _routed(route: Route, fallthrough: Any) -> Callable[..., Any]:
    """The kernel registered for ``route``: when routing is on, torch's kernel at once for a call ``skip`` names
    (while routing decisions are not logged), else the decision of the call's signature (made once: ``eligibility``
    and ``bind``, then a dictionary lookup), what it runs if nvfly accepts, else ``fallthrough``. An nvfly failure
    falls back and declines its signature from then on."""
    decided: OpCalls[RouteDecision] = OpCalls()
    _DECIDED.append(decided)
    # bound once: a skipped call is the switch, the predicate and torch's kernel; a declined one the switch, the key,
    # one lookup and torch's kernel
    switch, lookup, signature, skip = _SWITCH.get, decided.get, route.signature, route.skip
    logged, call_torch = log.isEnabledFor, fallthrough.call_boxed
    native = native_routes.module()
    # a decline this kernel remembers (or its skip) is kept by the C++ kernel calling it, if one does
    kept = native.mark_declined if native is not None else _nothing

    def impl(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if switch(False):
            key = hit = None
            try:
                if skip is not None and skip(*args, **kwargs) and not logged(logging.INFO):
                    hit = _SKIPPED
                elif signature is not None:
                    key = signature(*args, **kwargs)
                    hit = lookup(key)
            except Exception:  # noqa: BLE001 - not tensors, unhashable: decided without remembering
                key = None
            if hit is None:
                hit = _decision(route, args, kwargs)
                decided.remember(key, hit)
            reason, runs = hit
            if reason is None:
                try:
                    return runs(*args, **kwargs)
                except Exception as exc:  # an nvfly failure must never break the caller: use torch
                    _failed(route, exc)
                    decided.remember(key, (f"nvfly raised {type(exc).__name__}: {exc}", None))
            if key is not None or hit is _SKIPPED:
                kept()
        return call_torch(keyset, *args, **kwargs)

    impl.__name__ = f"nvfly_route_{route.op.replace('::', '_').replace('.', '_')}"
    return impl


def _nothing() -> None:
    pass


_SKIPPED: RouteDecision = ("the route's skip: launch-bound, nvfly's host path would cost more than its kernel saves",
                           None)


def _decide(route: Route, args: tuple, kwargs: dict) -> Optional[str]:
    try:
        return route.eligibility(*args, **kwargs)
    except Exception as exc:  # a broken eligibility check declines
        return f"eligibility check raised {type(exc).__name__}: {exc}"


def _decision(route: Route, args: tuple, kwargs: dict) -> RouteDecision:
    """A call's decision, made in full (a declined one logged): the eligibility, then what runs the accepted."""
    reason = _decide(route, args, kwargs)
    if reason is not None:
        _declined(route, reason)
        return reason, None
    if route.bind is None:
        return None, route.run
    try:
        return None, route.bind(*args, **kwargs)
    except Exception as exc:  # binding is nvfly's work too: a failure falls back
        _failed(route, exc)
        return f"nvfly raised {type(exc).__name__}: {exc}", None


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


# torch.cuda.is_current_stream_capturing's own reading, unwrapped (a signature's hot path; a CPU build's stand-in
# raises, and is never called: no tensor there is a CUDA one)
_STREAM_CAPTURING = torch._C._cuda_isCurrentStreamCapturing if hasattr(torch._C, "_cuda_isCurrentStreamCapturing") \
    else torch.cuda.is_current_stream_capturing


def _small(x: torch.Tensor, tensors: int) -> bool:
    """Whether an RMSNorm call moving ``tensors`` tensors of x's size stays on torch: launch-bound, outside capture
    (the RMSNorm routes' ``skip``, the rule their eligibility applies)."""
    return tensors * x.nbytes < RMS_NORM_EAGER_BYTES and not (x.is_cuda and _STREAM_CAPTURING())


def _launch_bound(x: torch.Tensor, tensors: int) -> Optional[str]:
    if not _small(x, tensors):
        return None
    return (f"{tensors * x.nbytes / 2**20:.1f} MiB moved (< {RMS_NORM_EAGER_BYTES >> 20} MiB) outside CUDA-graph "
            "capture: launch-bound, where nvfly's host path costs more than its kernel saves")


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
                x.is_cuda and _STREAM_CAPTURING())

    def rms_norm_backward_signature(grad_out: torch.Tensor, x: torch.Tensor, normalized_shape: list[int],
                                    rstd: torch.Tensor, weight: Optional[torch.Tensor], output_mask: list[bool]
                                    ) -> tuple:
        return (tensor_key(grad_out), tensor_key(x), tuple(normalized_shape), rstd.dtype,
                weight is not None and tensor_key(weight), tuple(output_mask), x.is_cuda and _STREAM_CAPTURING())

    def rms_norm_skip(x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor],
                      eps: Optional[float]) -> bool:
        return _small(x, 2)

    def rms_norm_backward_skip(grad_out: torch.Tensor, x: torch.Tensor, normalized_shape: list[int],
                               rstd: torch.Tensor, weight: Optional[torch.Tensor], output_mask: list[bool]) -> bool:
        return _small(x, 3)

    def topk_signature(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> tuple:
        return tensor_key(x), k, dim, largest, sorted

    def rms_norm_wanted() -> bool:
        return bool(settings.get("routing_rms_norm"))

    register_route("aten::_fused_rms_norm", rms_norm_eligibility, rms_norm_run, signature=rms_norm_signature,
                   wanted=rms_norm_wanted, skip=rms_norm_skip)
    register_route("aten::_fused_rms_norm_backward", rms_norm_backward_eligibility, rms_norm_backward_run,
                   signature=rms_norm_backward_signature, wanted=rms_norm_wanted, skip=rms_norm_backward_skip)
    register_route("aten::topk", topk.eligibility, topk_run, signature=topk_signature)


class _RoutingModule(types.ModuleType):
    """This module, callable as its switch: ``with nvfly.torch.routing():``."""

    def __call__(self, enabled: bool = True) -> ContextManager[None]:
        return routing(enabled)


sys.modules[__name__].__class__ = _RoutingModule
