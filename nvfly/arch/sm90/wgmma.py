"""wgmma: warpgroup matrix multiply-accumulate from shared memory (PTX ``wgmma.mma_async``).

One instruction computes a 64 x N x K tile (K = 16 for 16-bit inputs, 32 for 8-bit) for the 128 threads of a
warpgroup: A and B come from shared memory through 64-bit matrix descriptors, D stays in registers (N/2 f32
per thread). The shared-memory layouts are the canonical GMMA layouts built with ``nvfly.layout``
(``operand_layout``); the descriptor fields (swizzle mode, leading and stride byte offsets) and the TMA boxes
that fill them are read off those layouts, not written by hand.

Accumulator fragment (per thread ``t`` of the warpgroup, warp ``w = t // 32``, lane ``l``): element
``4*j + 2*h + e`` is row ``16*w + l//4 + 8*h``, column ``8*j + 2*(l%4) + e`` for j < N/8, h, e in {0, 1}.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mlir import ir
from mlir.dialects import llvm, nvvm

from nvfly.arch.ptx import asm
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.trace import traced
from nvfly.frontend.values import Scalar
from nvfly.layout import ComposedLayout, make_swizzle_atom, tile_to_shape

_WGMMA_TYPES = {"bf16": "bf16", "f16": "f16", "f8e4m3": "e4m3", "f8e5m2": "e5m2", "f32": "f32"}
_SWIZZLE_MODE = {128: 1, 64: 2, 32: 3, 0: 0}  # descriptor bits 62-63


# ---------------------------------------------------------------------------------------------- layouts
def operand_layout(mn: int, k: int, dtype: DType, major: str, swizzle: int = 128) -> ComposedLayout:
    """The shared-memory layout (in elements) of an (MN x K) wgmma operand tile.

    K-major: rows of K; MN-major: MN is contiguous, and swizzle-wide MN chunks each hold all K rows
    (so one TMA box of (K, chunk) fills one chunk).
    """
    _check_major(major)
    atom = make_swizzle_atom(swizzle, dtype.bits, k_major=(major == "K"))
    order = (0, 1) if major == "K" else (1, 0)
    return tile_to_shape(atom, (mn, k), order)


def choose_swizzle(mn: int, dtype: DType, major: str) -> int:
    """The widest swizzle (bytes) an (MN x 128-byte K) operand tile can use: 128 for K-major; for MN-major
    the widest whose row (swizzle / itemsize elements of MN) divides the MN extent."""
    _check_major(major)
    if major == "K":
        return 128
    for swizzle in (128, 64, 32):
        if mn % (swizzle // dtype.itemsize) == 0:
            return swizzle
    raise CompileError(f"an MN-major operand tile of {mn} {dtype.name} elements is narrower than a 32-byte "
                       f"swizzle row ({32 // dtype.itemsize} elements)")


def _check_major(major: str) -> None:
    if major not in ("K", "MN"):
        raise CompileError(f"major must be 'K' or 'MN', got {major!r}")


def descriptor_offsets(layout: ComposedLayout, dtype: DType, major: str, swizzle: int) -> tuple[int, int]:
    """(leading byte offset, stride byte offset) of the GMMA descriptor for a canonical operand layout.

    K-major:  8-row groups are ``SBO`` apart (LBO unused with swizzling); MN-major: swizzle-wide MN chunks
    are ``LBO`` apart and 8-row groups of K are ``SBO`` apart. The layout is checked to be canonical.
    """
    inner = layout.inner
    size = dtype.itemsize
    width = max(swizzle, 16) // size  # elements in one swizzle row
    if major == "K":
        for r in range(8):
            if inner((r, 0)) != r * width:
                raise CompileError(f"operand layout {layout} is not a canonical K-major GMMA layout "
                                   f"(rows of an 8-row group must be {width} elements apart)")
        return 16, inner((8, 0)) * size
    for r in range(8):
        if inner((0, r)) != r * width:
            raise CompileError(f"operand layout {layout} is not a canonical MN-major GMMA layout "
                               f"(K rows of an 8-row group must be {width} elements apart)")
    mn = layout.shape[0] if isinstance(layout.shape[0], int) else _flat_size(layout.shape[0])
    lbo = inner((width, 0)) * size if mn > width else 16
    return lbo, inner((0, 8)) * size


def _flat_size(shape: Any) -> int:
    if isinstance(shape, int):
        return shape
    total = 1
    for s in shape:
        total *= _flat_size(s)
    return total


@dataclass(frozen=True)
class TmaBox:
    """One TMA box filling part of an operand tile: its shared-memory byte offset in the tile and its
    coordinate offset in (MN, K) elements."""
    smem_offset: int
    mn_offset: int
    k_offset: int


def operand_boxes(layout: ComposedLayout, mn: int, k: int, dtype: DType, major: str, swizzle: int,
                  parts: int = 1) -> tuple[tuple[int, int], list[list[TmaBox]]]:
    """The TMA box shape (in global-tensor order: (MN, K) for K-major, (K, MN) for MN-major) and, for each of
    ``parts`` equal slices of the MN extent, the boxes that fill it in an (mn x k) tile laid out by ``layout``.

    Several parts let the blocks of a cluster each load one slice and multicast it to all of them.
    """
    width = max(swizzle, 16) // dtype.itemsize
    inner = layout.inner
    if mn % parts:
        raise CompileError(f"MN tile {mn} does not split into {parts} equal parts")
    part = mn // parts
    if major == "K":
        if k % width:
            raise CompileError(f"K tile {k} must be a multiple of the {width}-element swizzle row")
        box_mn = min(part, 256)
        if part % box_mn:
            raise CompileError(f"MN slice {part} is not a multiple of the {box_mn}-row box")
        boxes = [[TmaBox(inner((m, kk)) * dtype.itemsize, m, kk) for kk in range(0, k, width)
                  for m in range(p * part, (p + 1) * part, box_mn)] for p in range(parts)]
        return (box_mn, width), boxes
    if part % width:
        raise CompileError(f"MN slice {part} must be a multiple of the {width}-element swizzle row")
    box_k = min(k, 256)
    boxes = [[TmaBox(inner((m, kk)) * dtype.itemsize, m, kk) for m in range(p * part, (p + 1) * part, width)
              for kk in range(0, k, box_k)] for p in range(parts)]
    return (box_k, width), boxes


# ---------------------------------------------------------------------------------------------- atom
@dataclass(frozen=True)
class WgmmaAtom:
    """``wgmma.mma_async.m64nNkK`` with A and B in shared memory.

    Inputs bf16/f16 (K=16; either operand K- or MN-major) or fp8 e4m3/e5m2 (K=32; both K-major);
    accumulation in f32.
    """
    n: int
    a_dtype: DType
    b_dtype: DType
    a_major: str = "K"
    b_major: str = "K"

    def __post_init__(self) -> None:
        if self.n % 8 or not 8 <= self.n <= 256:
            raise CompileError(f"wgmma N must be a multiple of 8 in [8, 256], got {self.n}")
        _check_major(self.a_major)
        _check_major(self.b_major)
        for name, dt in (("A", self.a_dtype), ("B", self.b_dtype)):
            if dt.name not in _WGMMA_TYPES or dt == dtypes.f32:
                raise CompileError(f"wgmma {name} must be bf16, f16, f8e4m3 or f8e5m2, got {dt.name}")
        if self.a_dtype.bits != self.b_dtype.bits or (self.a_dtype.bits == 16 and self.a_dtype != self.b_dtype):
            raise CompileError(f"wgmma cannot mix {self.a_dtype.name} and {self.b_dtype.name}")
        if self.a_dtype.bits == 8 and (self.a_major != "K" or self.b_major != "K"):
            raise CompileError("fp8 wgmma needs both operands K-major (transposes exist only for 16-bit types)")

    @property
    def m(self) -> int:
        return 64

    @property
    def k(self) -> int:
        return 256 // self.a_dtype.bits

    @property
    def acc_registers(self) -> int:
        return self.n // 2

    def acc_type(self) -> ir.Type:
        return ir.Type.parse("!llvm.struct<(" + ", ".join(["f32"] * self.acc_registers) + ")>")


class Accumulator:
    """A warpgroup's f32 accumulator fragment (an LLVM struct in registers; see the module doc for the
    element-to-(row, column) map). Carried through dynamic loops like any value."""

    def __init__(self, value: ir.Value, n: int):
        self.value = value
        self.n = n

    @staticmethod
    @traced
    def zeros(atom: WgmmaAtom) -> "Accumulator":
        return Accumulator(llvm.mlir_zero(atom.acc_type()), atom.n)

    @staticmethod
    @traced
    def undefined(atom: WgmmaAtom) -> "Accumulator":
        """An accumulator whose registers nothing defines yet: the input of a first ``mma(..., zero=True)``.

        Zeroing registers with ordinary moves between wgmmas makes ptxas serialise them (C7515).
        """
        return Accumulator(llvm.mlir_undef(atom.acc_type()), atom.n)

    def __nvfly_flatten__(self) -> tuple[list[ir.Value], Callable[[Sequence[ir.Value]], "Accumulator"]]:
        n = self.n
        return [self.value], lambda vs: Accumulator(vs[0], n)

    def __len__(self) -> int:
        return self.n // 2

    @traced
    def __getitem__(self, i: int) -> Scalar:
        return Scalar(llvm.extractvalue(ir.F32Type.get(), self.value, [i]), dtypes.f32)

    @traced
    def map(self, fn: Callable[[Scalar, int], Any]) -> "Accumulator":
        """A new accumulator with element ``i`` replaced by ``fn(element, i)`` (an f32)."""
        out = self.value
        for i in range(self.n // 2):
            v = fn(self[i], i)
            out = llvm.insertvalue(out, v.to(dtypes.f32).value, [i])
        return Accumulator(out, self.n)

    @traced
    def fence(self) -> "Accumulator":
        """Keep the compiler from moving accumulator reads or writes across wgmma boundaries."""
        regs = [self[i] for i in range(self.n // 2)]
        n = len(regs)
        text = "// fence accumulator"
        res_t = ir.Type.parse("!llvm.struct<(" + ", ".join(["f32"] * n) + ")>")
        constraints = ",".join(["=f"] * n + [str(i) for i in range(n)])
        out = llvm.inline_asm(res_t, [r.value for r in regs], text, constraints, has_side_effects=True)
        return Accumulator(out, self.n)


# ---------------------------------------------------------------------------------------------- descriptors
@traced
def smem_descriptor(address: Scalar, lbo_bytes: int, sbo_bytes: int, swizzle: int) -> Scalar:
    """The 64-bit GMMA matrix descriptor of the operand tile starting at shared address ``address``."""
    high = ((lbo_bytes >> 4) & 0x3FFF) << 16 | ((sbo_bytes >> 4) & 0x3FFF) << 32 | _SWIZZLE_MODE[swizzle] << 62
    if high >= 1 << 63:
        high -= 1 << 64
    start = ((address >> 4) & 0x3FFF).to(dtypes.i64)
    return start | high


# ---------------------------------------------------------------------------------------------- instructions
@traced
def fence() -> None:
    """``wgmma.fence``: order register and shared-memory accesses before the next wgmma."""
    nvvm.wgmma_fence_aligned()


@traced
def commit_group() -> None:
    nvvm.wgmma_commit_group_sync_aligned()


@traced
def wait_group(pending: int) -> None:
    """Wait until at most ``pending`` committed wgmma groups of this warpgroup are in flight."""
    nvvm.wgmma_wait_group_sync_aligned(pending)


@traced
def mma(atom: WgmmaAtom, acc: Accumulator, desc_a: Scalar, desc_b: Scalar, zero: bool = False) -> Accumulator:
    """acc += A @ B for one 64 x N x K step, or acc = A @ B with ``zero`` (asynchronous: commit and wait
    before reading ``acc``)."""
    if acc.n != atom.n:
        raise CompileError(f"accumulator is 64x{acc.n}, the atom is 64x{atom.n}")
    shape = ir.Attribute.parse(f"#nvvm.shape<m = 64, n = {atom.n}, k = {atom.k}>")
    t = nvvm.WGMMATypes
    layout_a = nvvm.MMALayout.row if atom.a_major == "K" else nvvm.MMALayout.col
    layout_b = nvvm.MMALayout.col if atom.b_major == "K" else nvvm.MMALayout.row
    out = nvvm.wgmma_mma_async(
        atom.acc_type(), acc.value, desc_a.value, desc_b.value, shape,
        getattr(t, _WGMMA_TYPES[atom.a_dtype.name]), getattr(t, _WGMMA_TYPES[atom.b_dtype.name]), t.f32,
        nvvm.WGMMAScaleOut.zero if zero else nvvm.WGMMAScaleOut.one, nvvm.WGMMAScaleIn.one, nvvm.WGMMAScaleIn.one, layout_a, layout_b)
    return Accumulator(out, atom.n)


@traced
def stmatrix_x4(address: Scalar, regs: Sequence[Scalar], transpose: bool = False) -> None:
    """Store four 8x8 b16 matrices from the warp's registers (``stmatrix.x4``); lanes 8i..8i+7 give the row
    addresses of matrix i, and each lane's register i holds two b16 of matrix i in mma fragment order."""
    if len(regs) != 4:
        raise CompileError("stmatrix_x4 takes four 32-bit registers")
    asm(f"stmatrix.sync.aligned.m8n8.x4{'.trans' if transpose else ''}.shared.b16 [$0], {{$1, $2, $3, $4}};",
        [address, *regs])
