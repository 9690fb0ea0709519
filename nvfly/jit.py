"""The JIT driver: ``@nvfly.kernel`` objects that specialise, compile (with caches) and launch.

A launch goes: arguments -> specs -> compiled kernel -> loaded function -> cuLaunchKernel. Three caches keep
repeat work away:
- a fast in-process map from cheap argument keys (dtype, shape, strides, alignment) to a ready launcher;
- an in-process map from specs to compiled kernels;
- the disk cache: spec hash -> IR key (skips tracing) and IR key -> binary (skips lowering and ptxas).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from nvfly import settings
from nvfly.compiler import pipeline, toolchain
from nvfly.compiler.artifact import CompiledKernel
from nvfly.compiler.cache import DiskCache
from nvfly.errors import LaunchError
from nvfly.frontend.fingerprint import fingerprint
from nvfly.frontend.function import _Lazy, trace_kernel
from nvfly.frontend.spec import ConstexprSpec, Param, analyze_signature
from nvfly.runtime import driver, torch_args
from nvfly.runtime.launcher import Launcher, cluster_or_none, make_binder, normalize_dim3

log = logging.getLogger("nvfly")

DEFAULT_TARGET = "sm_90a"
_FAST_CACHE_LIMIT = 4096


def default_target() -> str:
    return settings.get("arch") or DEFAULT_TARGET


def _debug(msg: str, *args: Any) -> None:
    if settings.get("debug"):
        log.info(msg, *args)


@functools.lru_cache(maxsize=None)
def _disk_cache(root: str) -> DiskCache:
    return DiskCache(root)


def disk_cache() -> Optional[DiskCache]:
    return _disk_cache(settings.get("cache_dir")) if settings.get("disk_cache") else None


# ---------------------------------------------------------------------------------------------- compile-only mode
@dataclass
class _CompileOnly:
    target: str
    kernels: list[CompiledKernel] = field(default_factory=list)


_COMPILE_ONLY: contextvars.ContextVar[Optional[_CompileOnly]] = contextvars.ContextVar("nvfly_compile_only",
                                                                                       default=None)


@contextlib.contextmanager
def compile_only(target: Optional[str] = None) -> Iterator[list[CompiledKernel]]:
    """Within this block, kernel launches compile (for ``target``) and record the kernel instead of running."""
    state = _CompileOnly(target or default_target())
    token = _COMPILE_ONLY.set(state)
    try:
        yield state.kernels
    finally:
        _COMPILE_ONLY.reset(token)


# ---------------------------------------------------------------------------------------------- kernels
_PTX_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what a kernel's name (its PTX entry's) may be


@dataclass
class KernelStats:
    """What this kernel object did: for tests and ``nvfly explain``."""
    traced: int = 0
    lowered: int = 0
    disk_hits: int = 0
    compile_seconds: float = 0.0


class Kernel:
    """A GPU kernel written in Python (``@nvfly.kernel``). Launch with ``k[grid, block](*args)``."""

    def __init__(self, fn: Callable[..., Any], name: Optional[str] = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = name or fn.__name__
        if not _PTX_NAME.fullmatch(self.name):
            # the name becomes the PTX entry's: ptxas (or LLVM, before it) rejects anything else
            raise ValueError(f"name: a kernel name must be a PTX identifier (letters, digits and '_', not "
                             f"starting with a digit), got {self.name!r}")
        self.params: list[Param] = analyze_signature(fn)
        self._binder = make_binder([p.kind for p in self.params], torch_args.auto_key)
        self._lazy = _Lazy(fn)
        self._fingerprint: Optional[str] = None
        self._compiled: dict[tuple, CompiledKernel] = {}
        self._launchers: dict[tuple[str, int], Launcher] = {}
        self._fast: dict[tuple, Launcher] = {}
        self._lock = threading.Lock()
        self.stats = KernelStats()

    def __repr__(self) -> str:
        return f"<nvfly.kernel {self.name}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.name} is a kernel: launch it with {self.name}[grid, block](...) or .launch(...)")

    def __getitem__(self, config: Any) -> Callable[..., None]:
        if not isinstance(config, tuple) or len(config) not in (2, 3):
            raise TypeError(f"{self.name}[grid, block] or [grid, block, cluster] expected, got {config!r}")
        grid, block = config[0], config[1]
        cluster = config[2] if len(config) == 3 else None
        return functools.partial(self.launch, grid=grid, block=block, cluster=cluster)

    # ------------------------------------------------------------------ argument handling
    def _bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        if len(args) > len(self.params):
            raise LaunchError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        bound = list(args)
        for p in self.params[len(args):]:
            if p.name in kwargs:
                bound.append(kwargs.pop(p.name))
            elif p.default is not inspect.Parameter.empty:
                bound.append(p.default)
            else:
                raise LaunchError(f"{self.name}: missing argument '{p.name}'")
        if kwargs:
            raise LaunchError(f"{self.name}: unexpected argument(s) {', '.join(sorted(kwargs))}")
        return bound

    def specs(self, args: Sequence[Any], need_cuda: bool) -> tuple[tuple, int]:
        """(argument specs, device) for bound arguments; raises LaunchError on bad arguments."""
        specs = []
        device = -1
        for p, a in zip(self.params, args):
            spec, dev = torch_args.arg_spec(p, a, need_cuda)
            if dev >= 0:
                if device >= 0 and dev != device:
                    raise LaunchError(f"{self.name}: argument '{p.name}' is on cuda:{dev}, others on cuda:{device}")
                device = dev
            specs.append(spec)
        return tuple(specs), device

    # ------------------------------------------------------------------ compilation
    def _spec_hash(self, mem_key: tuple) -> Optional[str]:
        specs = mem_key[0]
        if any(isinstance(s, ConstexprSpec) and not _stable_repr(s.value) for s in specs):
            return None
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.fn) or ""
        if not self._fingerprint:
            return None
        blob = json.dumps({"fn": self._fingerprint, "name": self.name, "key": repr(mem_key),
                           "toolchain": toolchain.fingerprint(), "settings": settings.codegen_fingerprint()},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def compiled_for(self, specs: tuple, block: tuple[int, int, int], cluster: Optional[tuple[int, int, int]],
                     target: str) -> CompiledKernel:
        """The compiled kernel for these specs, from memory, disk, or a fresh trace and compile."""
        mem_key = (specs, block, cluster, target)
        hit = self._compiled.get(mem_key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._compiled.get(mem_key)
            if hit is None:
                hit = self._compile(mem_key)
                self._compiled[mem_key] = hit
        return hit

    def _compile(self, mem_key: tuple) -> CompiledKernel:
        specs, block, cluster, target = mem_key
        cache = disk_cache()
        spec_hash = self._spec_hash(mem_key) if cache else None
        if cache and spec_hash:
            key = cache.get_spec(spec_hash)
            files = cache.get(key) if key else None
            if files is not None:
                self.stats.disk_hits += 1
                _debug("nvfly: %s: disk cache hit (no trace) %s", self.name, key[:12])
                return CompiledKernel.from_files(files)
        t0 = time.perf_counter()
        traced = trace_kernel(self.fn, self._lazy, self.params, specs, block, cluster, target,
                              opt_level=settings.get("opt_level"), name=self.name)
        self.stats.traced += 1
        with traced.builder.context:
            key = pipeline.ir_key(traced, str(traced.module))
        files = cache.get(key) if cache else None
        if files is not None:
            self.stats.disk_hits += 1
            compiled = CompiledKernel.from_files(files)
            _debug("nvfly: %s: disk cache hit after trace %s", self.name, key[:12])
        else:
            compiled = pipeline.compile_traced(traced, key)
            self.stats.lowered += 1
            if cache:
                cache.put(key, compiled.files())
            _debug("nvfly: %s: compiled %s in %.3fs (%s)", self.name, key[:12], time.perf_counter() - t0,
                   compiled.summary())
        if cache and spec_hash:
            cache.put_spec(spec_hash, key)
        self.stats.compile_seconds += time.perf_counter() - t0
        return compiled

    def compile(self, *args: Any, block: Any = 128, cluster: Any = None, target: Optional[str] = None,
                **kwargs: Any) -> CompiledKernel:
        """Compile for these arguments (tensors, ``nvfly.TensorDesc``, scalars) without launching; no GPU needed."""
        bound = self._bind(args, kwargs)
        specs, _ = self.specs(bound, need_cuda=False)
        return self.compiled_for(specs, normalize_dim3(block, "block"), cluster_or_none(cluster),
                                 target or default_target())

    # ------------------------------------------------------------------ launching
    def launch(self, *args: Any, grid: Any, block: Any = 128, cluster: Any = None, stream: Any = None,
               **kwargs: Any) -> None:
        """Launch on ``grid`` blocks of ``block`` threads, on torch's current stream unless ``stream`` is given."""
        bound = args if (not kwargs and len(args) == len(self.params)) else self._bind(args, kwargs)
        try:
            key, raw = self._binder(bound)
            launcher = self._fast.get((key, block, cluster))
        except (AttributeError, TypeError):  # an argument of the wrong kind: the slow path explains
            launcher = None
        if launcher is None or _COMPILE_ONLY.get() is not None:  # compile-only mode records, never launches
            launcher, raw = self._miss(bound, block, cluster)
            if launcher is None:
                return
        if type(grid) is int:
            grid = (grid, 1, 1)
        elif type(grid) is not tuple or len(grid) != 3:
            grid = normalize_dim3(grid, "grid")
        launcher.launch(grid, torch_args.current_stream(launcher.device) if stream is None
                        else torch_args.stream_int(stream), raw)

    def _miss(self, bound: Sequence[Any], block: Any, cluster: Any) -> tuple[Optional[Launcher], Any]:
        """(launcher, raw arguments) when the fast map has none for these arguments: compiles and loads (errors
        explain bad arguments), or in compile-only mode records the kernel and returns (None, None)."""
        only = _COMPILE_ONLY.get()
        if only is not None:
            specs, _ = self.specs(bound, need_cuda=False)
            only.kernels.append(self.compiled_for(specs, normalize_dim3(block, "block"), cluster_or_none(cluster),
                                                  only.target))
            return None, None
        launcher = self._prepare(bound, block, cluster)
        key, raw = self._binder(bound)
        if len(self._fast) >= _FAST_CACHE_LIMIT:
            self._fast.clear()
        self._fast[(key, block, cluster)] = launcher
        return launcher, raw

    def prepared(self, grid: Any, block: Any = 128, cluster: Any = None, check: bool = False) -> "PreparedLaunch":
        """A launch on a fixed ``grid`` and ``block`` for callers that guarantee the argument layout themselves
        (see PreparedLaunch): ``p = k.prepared(grid, block)``, then ``p.launch(*args)`` per call."""
        return PreparedLaunch(self, grid, block, cluster, check)

    def _prepare(self, bound: Sequence[Any], block: Any, cluster: Any) -> Launcher:
        specs, device = self.specs(bound, need_cuda=True)
        why = driver.unavailable_reason()
        if why:
            raise LaunchError(f"{self.name}: cannot launch: {why} (nvfly.compile works without a GPU)")
        if device < 0:
            import torch
            device = torch.cuda.current_device()
        compiled = self.compiled_for(specs, normalize_dim3(block, "block"), cluster_or_none(cluster),
                                     driver.target_of(device))
        lkey = (compiled.key, device)
        launcher = self._launchers.get(lkey)
        if launcher is None:
            launcher = Launcher(compiled, device)
            self._launchers[lkey] = launcher
        return launcher


class PreparedLaunch:
    """One kernel launched on a fixed grid and block, with the least host work per call.

    For callers (ops) that key their own plans on everything that decides a kernel's specs: every call must
    pass the kernel's arguments positionally with the dtypes, shapes, strides, 16-byte alignment facts and
    devices of the first call, and scalars of the same spec (same low 4 bits and i32 range for ints); constexpr
    arguments must be the same values. ``launch(*args, stream=None)``:
    - the first call takes ``Kernel.launch``'s full path (argument checks, compile, load), then replaces
      ``launch`` by code generated for that launcher, with the grid, shapes and strides as constants: later
      calls read only tensors' ``data_ptr()``, scalars' values and TMA descriptors' bytes, and call the driver;
    - in compile-only mode (``nvfly.compile_only``) every call takes the full path, which records the kernel;
    - ``check=True`` verifies the contract on every call (the binder's key against the first call's) and
      raises LaunchError when an argument differs: for tests and debugging.
    ``stream`` as in ``Kernel.launch`` (None: torch's current stream on the kernel's device).
    """

    def __init__(self, kernel: Kernel, grid: Any, block: Any = 128, cluster: Any = None, check: bool = False):
        self.kernel = kernel
        self.grid = normalize_dim3(grid, "grid")
        self.block = block
        self.cluster = cluster
        self.check = check
        self._key: Any = None
        self._fast: Optional[Callable[..., None]] = None
        self.launch: Callable[..., None] = self._first

    def __repr__(self) -> str:
        state = "ready" if self._fast is not None else "not launched yet"
        return f"<nvfly prepared launch of {self.kernel.name} on {self.grid}x{self.block}, {state}>"

    def __call__(self, *args: Any, stream: Any = None) -> None:
        self.launch(*args, stream=stream)

    @property
    def warm(self) -> bool:
        """Whether a call now runs the generated code, which reads only addresses and scalars (after the first
        launch, outside compile-only mode): callers may then pass any tensor with the right ``data_ptr()``, e.g.
        a 2-D tensor in place of the 3-D view it was first launched with). Never with ``check``, which compares
        every call's arguments with the first call's."""
        return self._fast is not None and not self.check and _COMPILE_ONLY.get() is None

    def _full(self, args: Sequence[Any], stream: Any = None) -> None:
        if _COMPILE_ONLY.get() is not None and len(args) == len(self.kernel.params):
            self.kernel._miss(args, self.block, self.cluster)  # records the kernel (never runs it)
            return
        self.kernel.launch(*args, grid=self.grid, block=self.block, cluster=self.cluster, stream=stream)

    def _first(self, *args: Any, stream: Any = None) -> None:
        if _COMPILE_ONLY.get() is not None or len(args) != len(self.kernel.params):
            self._full(args, stream)  # records the kernel, or explains the arguments
            return
        kernel = self.kernel
        try:
            key, raw = kernel._binder(args)
            launcher = kernel._fast.get((key, self.block, self.cluster))
        except (AttributeError, TypeError):
            launcher = None
        if launcher is None:
            launcher, raw = kernel._miss(args, self.block, self.cluster)
            key, _ = kernel._binder(args)
        launcher.launch(self.grid, torch_args.current_stream(launcher.device) if stream is None
                        else torch_args.stream_int(stream), raw)
        self._fast = launcher.prepared(self.grid, raw, torch_args.stream_int, torch_args.current_stream,
                                       _COMPILE_ONLY, self._full)
        self._key = key
        self.launch = self._checked if self.check else self._fast

    def _checked(self, *args: Any, stream: Any = None) -> None:
        if _COMPILE_ONLY.get() is None:
            try:
                key = self.kernel._binder(args)[0] if len(args) == len(self.kernel.params) else None
            except (AttributeError, TypeError):
                key = None
            if key != self._key:
                raise LaunchError(f"{self.kernel.name}: a prepared launch got arguments unlike its first call's "
                                  f"(key {key!r}, first {self._key!r})")
        self._fast(*args, stream=stream)  # type: ignore[misc]


def _stable_repr(value: Any) -> bool:
    """Whether ``repr(value)`` identifies the value across processes (so it may key the disk cache)."""
    import dataclasses
    from nvfly.frontend.dtypes import DType
    if isinstance(value, (bool, int, float, str, bytes, type(None), DType)):
        return True
    if isinstance(value, tuple):
        return all(_stable_repr(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and value.__dataclass_params__.frozen:
        # a frozen dataclass's generated repr names the class and every field
        return all(_stable_repr(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


class JitFunction:
    """``@nvfly.jit``: a host function that computes grids and launches kernels.

    Called normally it runs; ``.compile(*args)`` runs it in compile-only mode and returns the kernels it would
    launch, compiled for the target (no GPU needed when the arguments are CPU/meta tensors or TensorDescs).
    """

    def __init__(self, fn: Callable[..., Any]):
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def compile(self, *args: Any, target: Optional[str] = None, **kwargs: Any) -> list[CompiledKernel]:
        with compile_only(target) as kernels:
            self.fn(*args, **kwargs)
        return kernels


def compile(fn: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 - the public name is nvfly.compile
    """Compile a kernel (returns a CompiledKernel) or a jit function (returns the list of its kernels)."""
    if isinstance(fn, (Kernel, JitFunction)):
        return fn.compile(*args, **kwargs)
    raise TypeError(f"nvfly.compile takes an @nvfly.kernel or @nvfly.jit function, got {type(fn).__name__}")
