"""TMA descriptor types shared by the front end (device side) and the runtime (host side)."""
from __future__ import annotations

from dataclasses import dataclass

from mlir import ir

from nvfly.frontend.dtypes import DType

SWIZZLE_BYTES = (0, 32, 64, 128)


@dataclass(frozen=True)
class TmaInfo:
    """What kernel code depends on in a TMA descriptor: element type, rank and the box it copies.

    ``box`` is in the tensor's dimension order (outermost first, like torch), ``swizzle`` in bytes
    (0, 32, 64 or 128).
    """
    dtype: DType
    rank: int
    box: tuple[int, ...]
    swizzle: int = 128

    @property
    def box_bytes(self) -> int:
        n = self.dtype.itemsize
        for b in self.box:
            n *= b
        return n


class TmaDescriptorType:
    """Annotation of a kernel parameter that receives a host-built TMA descriptor (``nvfly.TmaDescriptor``)."""


class TmaDescriptorValue:
    """Inside a kernel: the address of a 128-byte TMA descriptor kernel parameter, and what it describes."""

    def __init__(self, ptr: ir.Value, info: TmaInfo):
        self.ptr = ptr
        self.info = info

    def __repr__(self) -> str:
        return f"TmaDescriptor<{self.info.dtype.name} box={self.info.box} swizzle={self.info.swizzle}>"
