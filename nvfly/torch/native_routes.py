"""The routes' C++ kernel (``native/route_kernel.cpp``): the dispatcher's hop into Python skipped for the calls
nvfly's Python kernel sent to torch before.

A routed aten call entered Python on every call (torch's Python kernel holder: the interpreter's lock, the
arguments boxed into Python objects and back), and a call nvfly declines (a launch-bound RMSNorm in a decode step,
SDPA at Sq = 1 where torch keeps cuDNN) paid that hop for nothing: ~5 µs in a tight loop and several times that
inside a model's step. The C++ kernel keeps the *call keys* (``route_kernel.cpp`` says what they hold) of the calls
Python declined and sends later calls with those keys straight to torch's kernel; every other call goes to the
Python kernel as before. Only declines are kept, so a key can only ever send a call to torch's kernel.

Built by ``torch.utils.cpp_extension`` (a C++ compiler and ninja) on first use, once per torch and Python version,
into nvfly's cache folder (~40 s on a 2-core machine; later processes load it); where it cannot be built the routes
keep the Python kernel alone (logged once). ``NVFLY_ROUTING_NATIVE=0`` keeps the Python kernel.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from nvfly import settings

log = logging.getLogger("nvfly")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "route_kernel.cpp")
NAMESPACE = "nvfly_route"  # the ops holding nvfly's Python kernels, each with its aten op's schema

_LOCK = threading.Lock()
_MODULE: Any = None  # the loaded extension; False: it could not be built (not tried again in this process)
# nvfly_route op (defined in this process) -> (the Python kernel, the dispatcher library holding its registration,
# the kernel function)
_PYTHON_KERNELS: dict[str, tuple[Any, Any, Any]] = {}
_FRAGMENT: Any = None


def _tag() -> str:
    """What the build depends on besides the source (torch's C++ ABI, Python's), as a file-name part."""
    return re.sub(r"[^A-Za-z0-9]+", "_", f"torch{torch.__version__}_py{sys.version_info[0]}{sys.version_info[1]}")


def module() -> Optional[ModuleType]:
    """The built extension, or None (``routing_native`` off, or it cannot be built here: logged once)."""
    global _MODULE
    if not settings.get("routing_native"):
        return None
    with _LOCK:
        if _MODULE is None:
            _MODULE = _build() or False
        return _MODULE or None


def loaded() -> Optional[ModuleType]:
    """The extension if this process loaded it (never builds)."""
    return _MODULE or None


def _build() -> Optional[ModuleType]:
    from torch.utils import cpp_extension
    folder = os.path.join(settings.get("cache_dir"), "route_kernel", _tag())
    try:
        os.makedirs(folder, exist_ok=True)
        # the extension's name carries its build's versions: torch's builder keys its cache on the sources only
        return cpp_extension.load(f"nvfly_route_kernel_{_tag()}", [SOURCE], extra_cflags=["-O2"],
                                  build_directory=folder, verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the Python kernels route alone
        log.info("nvfly: routing keeps its Python kernels (the C++ route kernel could not be built: %s: %s)",
                 type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None


def python_kernel(op: str, dispatch_key: str, kernel: Callable[..., Any]) -> Any:
    """``kernel`` (a routed Python kernel: keyset, then the aten arguments) as a dispatcher kernel function the C++
    kernel can call: registered on an op of NAMESPACE with aten ``op``'s schema ("aten::mm.out"), one op a route
    (``dispatch_key`` tells SDPA's two apart), replacing the kernel registered for that route before."""
    global _FRAGMENT
    name = re.sub(r"\W", "_", op.split("::", 1)[1]) + "__" + dispatch_key
    registered = _PYTHON_KERNELS.get(name)
    if registered is None:  # the op is defined once, with its first kernel
        packet_name, _, overload = op.split("::", 1)[1].partition(".")
        schema = str(getattr(getattr(torch.ops.aten, packet_name), overload or "default")._schema)
        if _FRAGMENT is None:
            _FRAGMENT = torch._C._dispatch_library("FRAGMENT", NAMESPACE, "", __file__, 0)
        _FRAGMENT.define(name + schema[schema.index("("):], "", [])
    elif registered[0] is kernel:  # a block's start registers the routes again
        return registered[2]
    else:
        registered[1].reset()
    library = torch._C._dispatch_library("IMPL", NAMESPACE, "", __file__, 0)
    library.impl(name, "CPU", kernel, True)
    _PYTHON_KERNELS[name] = kernel, library, torch.library.get_kernel(f"{NAMESPACE}::{name}", "CPU")
    return _PYTHON_KERNELS[name][2]
