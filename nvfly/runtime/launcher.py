"""Launching a compiled kernel: parameter packing and the driver call, kept short for the cached path."""
from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any, Optional, Sequence

from nvfly.compiler.artifact import CompiledKernel
from nvfly.frontend.function import AbiParam
from nvfly.runtime import driver

_FORMAT = {"ptr": "Q", "tma": "128s", "i1": "B", "i8": "b", "u8": "B", "i16": "h", "i32": "i", "u32": "I",
           "i64": "q", "f16": "e", "bf16": "H", "f32": "f", "f64": "d"}


def _bf16_bits(value: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


class ParamPacker:
    """Packs kernel arguments into an aligned buffer and the ``void*[]`` that cuLaunchKernel takes.

    Each thread reuses its own buffer, so packing allocates nothing after the first launch.
    """

    def __init__(self, abi: Sequence[AbiParam]):
        fmt = "<"
        offset = 0
        self.offsets: list[int] = []
        for p in abi:
            pad = -offset % p.align
            if pad:
                fmt += f"{pad}x"
            offset += pad
            self.offsets.append(offset)
            fmt += _FORMAT["tma" if p.kind == "tma" else "ptr" if p.kind == "ptr" else p.dtype]
            offset += p.size
        self.format = fmt
        self.size = max(offset, 8)
        self.bf16 = [i for i, p in enumerate(abi) if p.dtype == "bf16"]
        self._local = threading.local()

    def _buffers(self) -> tuple[Any, int]:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            raw = ctypes.create_string_buffer(self.size + 64)
            base = ctypes.addressof(raw)
            start = -base % 64
            view = (ctypes.c_char * self.size).from_buffer(raw, start)
            pointers = (ctypes.c_void_p * max(1, len(self.offsets)))(
                *[base + start + off for off in self.offsets])
            bufs = (raw, view, pointers, ctypes.addressof(pointers))
            self._local.bufs = bufs
        return bufs[1], bufs[3]

    def pack(self, values: list[Any]) -> int:
        """Write ``values`` (one per ABI parameter); returns the address of the pointer array."""
        for i in self.bf16:
            values[i] = _bf16_bits(float(values[i]))
        view, address = self._buffers()
        struct.pack_into(self.format, view, 0, *values)
        return address


class Launcher:
    """A compiled kernel loaded on one device, ready to launch."""

    def __init__(self, compiled: CompiledKernel, device: int):
        image = compiled.cubin if compiled.cubin is not None else compiled.ptx.encode() + b"\0"
        self.compiled = compiled
        self.device = device
        self.function = driver.LoadedFunction(image, compiled.name, device, compiled.dynamic_smem_bytes)
        self.packer = ParamPacker(compiled.abi)
        self.block = compiled.block
        self.cluster = compiled.cluster
        self.smem = compiled.dynamic_smem_bytes
        self.sources = [p.source for p in compiled.abi]

    def launch(self, grid: tuple[int, int, int], stream: Any, values: list[Any]) -> None:
        address = self.packer.pack(values)
        if self.cluster is None:
            driver.launch(self.function, grid, self.block, self.smem, stream, address)
        else:
            driver.launch_cluster(self.function, grid, self.block, self.cluster, self.smem, stream, address)


def normalize_dim3(value: Any, what: str) -> tuple[int, int, int]:
    """(x, y, z) from an int or a 1-3 tuple of positive ints."""
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
