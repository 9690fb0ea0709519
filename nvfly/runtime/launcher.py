"""Launching a compiled kernel with little host overhead.

The cached path of a launch runs two small functions generated per kernel signature (straight-line code, no
loops or type dispatch):
- ``bind(args) -> (key, raw)``: reads each tensor's address, shape and strides once; ``key`` picks the
  compiled variant, ``raw`` feeds the parameters;
- ``launch(grid, stream, raw)``: packs the parameters into a per-thread buffer with one ``struct.pack_into``
  and calls ``cuLaunchKernel`` through ctypes.
A prepared launch (``Kernel.prepared``) goes further for callers that fix the argument layout themselves: one
generated ``launch(*args, stream=None)`` with the grid, shapes and strides as constants, reading only tensor
addresses and scalar values.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any, Callable, Optional, Sequence

from nvfly.compiler.artifact import CompiledKernel
from nvfly.frontend.function import AbiParam
from nvfly.runtime import driver

_FORMAT = {"ptr": "Q", "tma": "128s", "i1": "B", "i8": "b", "u8": "B", "i16": "h", "i32": "i", "u32": "I",
           "i64": "q", "f16": "e", "bf16": "H", "f32": "f", "f64": "d"}
_I32_MIN, _I32_END = -(1 << 31), 1 << 31


def bf16_bits(value: float) -> int:
    """The bfloat16 bit pattern of ``value`` (round to nearest even)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


# ---------------------------------------------------------------------------------------------- binding
def make_binder(kinds: Sequence[str], auto: Callable[[Any], tuple[Any, Any]]) -> Callable[[Sequence[Any]], tuple]:
    """``bind(args) -> (key, raw)`` for parameters of these kinds (see module doc).

    Equal keys imply equal compile-time specs; a tensor's raw value is ``(address, shape, strides)``.
    ``auto`` handles parameters without annotation: value -> (key part, raw value).
    """
    names = [f"a{i}" for i in range(len(kinds))]
    lines = ["def bind(args):"]
    if names:
        lines.append(f"    {', '.join(names)}, = args")
    key: list[str] = []
    raw: list[str] = []
    for i, kind in enumerate(kinds):
        a = names[i]
        if kind == "tensor":
            lines += [f"    p{i} = {a}.data_ptr()", f"    s{i} = {a}.shape", f"    t{i} = {a}.stride()"]
            key.append(f"{a}.dtype, s{i}, t{i}, p{i} & 15, {a}.get_device()")
            raw.append(f"(p{i}, s{i}, t{i})")
        elif kind == "constexpr":
            key.append(a)
            raw.append(a)
        elif kind == "scalar":
            # an int's spec depends on its low 4 bits (power-of-two fact) and on whether it fits in 32 bits
            key.append(f"(({a} & 15, {_I32_MIN} <= {a} < {_I32_END}) if type({a}) is int else type({a}))")
            raw.append(a)
        elif kind == "tma":
            key.append(f"{a}.info, {a}.device")
            raw.append(f"{a}.raw")
        else:
            lines.append(f"    k{i}, r{i} = auto({a})")
            key.append(f"k{i}")
            raw.append(f"r{i}")
    lines.append(f"    return ({', '.join(key)},), ({', '.join(raw)},)")
    namespace: dict[str, Any] = {"auto": auto}
    exec("\n".join(lines), namespace)  # noqa: S102 - code generated from parameter kinds only
    return namespace["bind"]


# ---------------------------------------------------------------------------------------------- the driver call
_CU_LAUNCH: Optional[Any] = None


def _cu_launch_kernel() -> Any:
    global _CU_LAUNCH
    if _CU_LAUNCH is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernel
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        fn.restype = ctypes.c_int
        _CU_LAUNCH = fn
    return _CU_LAUNCH


_INVALID_CONTEXT = 201
CONFIGS_KEPT = 64  # cuLaunchKernelEx configs a launcher keeps, one a (grid, stream)


def _raise(status: int, name: str) -> None:
    driver.check((status,), f"cuLaunchKernel({name})")


class Launcher:
    """A compiled kernel loaded on one device; ``launch(grid, stream, raw)`` runs it."""

    def __init__(self, compiled: CompiledKernel, device: int):
        image = compiled.cubin if compiled.cubin is not None else compiled.ptx.encode() + b"\0"
        self.compiled = compiled
        self.device = device
        self.function = driver.LoadedFunction(image, compiled.name, device, compiled.dynamic_smem_bytes)
        self._local = threading.local()
        self._fmt, self._offsets, self._size = _layout(compiled.abi)
        self._configs: dict[tuple[tuple[int, int, int], int], Any] = {}  # (grid, stream) -> its cuLaunchKernelEx config
        self.launch = make_launch(compiled, self._fmt, int(self.function.function), _cu_launch_kernel(),
                                  self._local, self._buffers, device, driver.make_current, self._launch_ex)

    def _launch_ex(self, grid: tuple[int, int, int], stream: int, params: int) -> None:
        config = self._configs.get((grid, stream))
        if config is None:
            c = self.compiled
            config = driver.launch_config(grid, c.block, c.cluster, c.cooperative, c.dependent, c.dynamic_smem_bytes,
                                          driver.stream_handle(stream))
            if len(self._configs) >= CONFIGS_KEPT:
                self._configs.clear()
            self._configs[(grid, stream)] = config
        driver.launch_with(self.function, config, params)

    def prepared(self, grid: tuple[int, int, int], raw: Sequence[Any], stream_of: Callable[[Any], int],
                 current_stream: Callable[[int], int], bypass: Any, fallback: Callable[..., None]
                 ) -> Callable[..., None]:
        """``launch(*args, stream=None)`` on ``grid`` for arguments shaped like ``raw`` (see
        make_prepared_launch); it shares this launcher's parameter buffers."""
        return make_prepared_launch(self.compiled, self._fmt, int(self.function.function), _cu_launch_kernel(),
                                    self._local, self._buffers, self.device, driver.make_current,
                                    self._launch_ex, grid, raw, stream_of, current_stream, bypass, fallback)

    def _buffers(self) -> tuple[Any, int]:
        """This thread's parameter buffer (64-byte aligned) and the address of its ``void*[]``."""
        raw = ctypes.create_string_buffer(self._size + 64)
        base = ctypes.addressof(raw)
        start = -base % 64
        view = (ctypes.c_char * self._size).from_buffer(raw, start)
        pointers = (ctypes.c_void_p * max(1, len(self._offsets)))(*[base + start + o for o in self._offsets])
        self._local.keep = (raw, pointers)
        self._local.bufs = (view, ctypes.addressof(pointers))
        return self._local.bufs


def _param_values(compiled: CompiledKernel, ptr: str, value: str, tma: str,
                  dim: Callable[[int, int, int], str]) -> list[str]:
    """The expression of each ABI parameter: ``ptr``/``value``/``tma`` are formats of the argument index,
    ``dim(i, 1 or 2, d)`` gives shape (1) or stride (2) ``d`` of argument ``i``."""
    values = []
    for p in compiled.abi:
        i, field = p.source
        if field == "ptr":
            expr = ptr.format(i=i)
        elif field == "value":
            expr = value.format(i=i)
        elif field == "tma":
            expr = tma.format(i=i)
        else:
            expr = dim(i, 1 if field[0] == "shape" else 2, field[1])
        values.append(f"bf16_bits({expr})" if p.dtype == "bf16" else expr)
    return values


def _launch_body(compiled: CompiledKernel, values: Sequence[str], grid: str) -> list[str]:
    """Lines (indented for a function body) that pack ``values`` and launch on ``grid`` and ``stream``."""
    bx, by, bz = compiled.block
    lines = ["    try:",
             "        view, params = local.bufs",
             "    except AttributeError:",
             "        view, params = buffers()",
             f"    pack_into(view, 0, {', '.join(values)})" if values else "    pass"]
    if compiled.cluster is None and not compiled.cooperative and not compiled.dependent:
        call = (f"cu_launch(function, {grid}, {bx}, {by}, {bz}, {compiled.dynamic_smem_bytes}, stream, params, "
                "None)")
        lines += [f"    status = {call}",
                  "    if status:",
                  "        if status == invalid_context:  # a thread that never touched CUDA: adopt the context",
                  "            make_current(device)",
                  f"            status = {call}",
                  "        if status:",
                  "            fail(status, name)"]
    else:
        lines += [f"    launch_ex(({grid}), stream, params)"]
    return lines


def _exec(lines: Sequence[str], compiled: CompiledKernel, fmt: str, function: int, cu_launch: Callable[..., int],
          local: Any, buffers: Callable[[], tuple[Any, int]], device: int, make_current: Callable[[int], None],
          launch_ex: Callable[..., None], **extra: Any) -> Callable[..., None]:
    namespace: dict[str, Any] = {
        "local": local, "buffers": buffers, "pack_into": struct.Struct(fmt).pack_into, "bf16_bits": bf16_bits,
        "cu_launch": cu_launch, "function": function, "fail": _raise, "name": compiled.name,
        "launch_ex": launch_ex, "invalid_context": _INVALID_CONTEXT, "make_current": make_current,
        "device": device, **extra}
    exec("\n".join(lines), namespace)  # noqa: S102 - code generated from the kernel's ABI only
    return namespace["launch"]


def make_launch(compiled: CompiledKernel, fmt: str, function: int, cu_launch: Callable[..., int], local: Any,
                buffers: Callable[[], tuple[Any, int]], device: int, make_current: Callable[[int], None],
                launch_ex: Callable[..., None]) -> Callable[..., None]:
    """``launch(grid, stream, raw)`` for one compiled kernel: straight-line packing and the driver call.

    ``cu_launch`` is cuLaunchKernel (ctypes); a thread without a current CUDA context adopts the device's
    primary context and retries once. Cluster, cooperative and dependent launches go through ``launch_ex(grid, stream,
    params)`` (cuLaunchKernelEx).
    """
    values = _param_values(compiled, "raw[{i}][0]", "raw[{i}]", "raw[{i}]",
                           lambda i, part, d: f"raw[{i}][{part}][{d}]")
    lines = ["def launch(grid, stream, raw):"] + _launch_body(compiled, values, "grid[0], grid[1], grid[2]")
    return _exec(lines, compiled, fmt, function, cu_launch, local, buffers, device, make_current, launch_ex)


def make_prepared_launch(compiled: CompiledKernel, fmt: str, function: int, cu_launch: Callable[..., int],
                         local: Any, buffers: Callable[[], tuple[Any, int]], device: int,
                         make_current: Callable[[int], None], launch_ex: Callable[..., None],
                         grid: tuple[int, int, int], raw: Sequence[Any], stream_of: Callable[[Any], int],
                         current_stream: Callable[[int], int], bypass: Any, fallback: Callable[..., None]
                         ) -> Callable[..., None]:
    """``launch(*args, stream=None)``: one kernel launched on a fixed ``grid`` with every argument's shape and
    strides fixed to those in ``raw`` (a binder's raw values of a first call).

    Only what may change between calls is read: a tensor argument's ``data_ptr()``, a scalar's value, a TMA
    descriptor's bytes; shapes, strides and the grid are constants of the generated code. ``stream`` None
    means ``current_stream(device)``, anything else goes through ``stream_of``. While ``bypass.get()`` is not
    None (compile-only mode) the call goes to ``fallback(args, stream)`` instead.
    """
    def dim(i: int, part: int, d: int) -> str:
        return str(int(raw[i][part][d]))
    values = _param_values(compiled, "a{i}.data_ptr()", "a{i}", "a{i}.raw", dim)
    names = [f"a{i}" for i in range(len(raw))]
    lines = [f"def launch({''.join(n + ', ' for n in names)}stream=None):",
             "    if bypass.get() is not None:",
             f"        return fallback(({''.join(n + ', ' for n in names)}), stream)",
             "    stream = current_stream(device) if stream is None else stream_of(stream)"]
    lines += _launch_body(compiled, values, ", ".join(str(int(g)) for g in grid))
    return _exec(lines, compiled, fmt, function, cu_launch, local, buffers, device, make_current, launch_ex,
                 stream_of=stream_of, current_stream=current_stream, bypass=bypass, fallback=fallback)


def _layout(abi: Sequence[AbiParam]) -> tuple[str, list[int], int]:
    """struct format (with explicit padding), offsets and total size of the parameter buffer."""
    fmt = "<"
    offset = 0
    offsets = []
    for p in abi:
        pad = -offset % p.align
        if pad:
            fmt += f"{pad}x"
        offset += pad
        offsets.append(offset)
        fmt += _FORMAT["tma" if p.kind == "tma" else "ptr" if p.kind == "ptr" else p.dtype]  # type: ignore[index]
        offset += p.size
    return fmt, offsets, max(offset, 8)


def normalize_dim3(value: Any, what: str) -> tuple[int, int, int]:
    """(x, y, z) from an int or a 1-3 tuple of non-negative ints."""
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise ValueError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(d < 0 for d in dims):
        raise ValueError(f"{what} must not be negative, got {value!r}")
    return tuple(dims) + (1,) * (3 - len(dims))  # type: ignore[return-value]


def cluster_or_none(cluster: Optional[Any]) -> Optional[tuple[int, int, int]]:
    if cluster is None:
        return None
    dims = normalize_dim3(cluster, "cluster")
    return None if dims == (1, 1, 1) else dims

