"""wgmma: warpgroup matrix multiply-accumulate (PTX ``wgmma.mma_async``, sm_90a).

One instruction computes a 64 x N x K tile (K = 16 for 16-bit inputs, 32 for 8-bit) for the 128 threads of a
warpgroup: B comes from shared memory through a 64-bit matrix descriptor, A either the same way or from
registers (``AFragment``, e.g. attention's P in P @ V), D stays in registers (N/2 elements per thread, f32 or
f16). The shared-memory layouts are the canonical GMMA layouts built with ``nvfly.layout``
(``operand_layout``); the descriptor fields (swizzle mode, leading and stride byte offsets) and the TMA boxes
that fill them are read off those layouts, not written by hand.

Accumulator fragment (per thread ``t`` of the warpgroup, warp ``w = t // 32``, lane ``l``): element
``4*j + 2*h + e`` is row ``16*w + l//4 + 8*h``, column ``8*j + 2*(l%4) + e`` for j < N/8, h, e in {0, 1}.
An f16 accumulator packs elements 2i and 2i + 1 into 32-bit register i (low half first).

Register-A fragment (one 64 x K slice, four 32-bit registers per thread, low bits first): register ``r`` holds
row ``16*w + l//4 + 8*(r%2)``; 16-bit A: columns ``8*(r//2) + 2*(l%4) + {0, 1}``; 8-bit A: columns
``16*(r//2) + 4*(l%4) + {0, 1, 2, 3}``. For 16-bit A this is what ``sm80.ldmatrix_x4`` loads for the warp's
16 rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mlir import ir
from mlir.dialects import llvm, nvvm, vector

from nvfly.arch.floats import f32x2_to_fp8x2
from nvfly.arch.ptx import asm
from nvfly.arch.target import requires
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.trace import traced
from nvfly.frontend.values import Scalar, as_value, make_vector
from nvfly.layout import ComposedLayout, make_swizzle_atom, tile_to_shape

_WGMMA_TYPES = {"bf16": "bf16", "f16": "f16", "f8e4m3": "e4m3", "f8e5m2": "e5m2", "f32": "f32"}
_SWIZZLE_MODE = {128: 1, 64: 2, 32: 3, 0: 0}  # descriptor bits 62-63
A_SOURCES = ("shared", "registers")


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
    """``wgmma.mma_async.m64nNkK``: D (64 x N, registers) += A (64 x K) @ B (K x N, shared memory).

    Inputs bf16/f16 (K = 16; from shared memory either operand may be K- or MN-major) or fp8 e4m3/e5m2 in any
    pairing (K = 32; both operands K-major). ``acc_dtype``: f32, or f16 for f16 and fp8 inputs.
    ``a_source``: "shared" (A through a matrix descriptor) or "registers" (A from an ``AFragment``; K-major only,
    the register fragment has no transpose).
    """
    n: int
    a_dtype: DType
    b_dtype: DType
    a_major: str = "K"
    b_major: str = "K"
    acc_dtype: DType = dtypes.f32
    a_source: str = "shared"

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
        if self.acc_dtype not in (dtypes.f32, dtypes.f16):
            raise CompileError(f"wgmma accumulates in f32 or f16, got {self.acc_dtype.name}")
        if self.acc_dtype == dtypes.f16 and self.a_dtype == dtypes.bf16:
            raise CompileError("bf16 wgmma accumulates in f32 only (f16 accumulation needs f16 or fp8 inputs)")
        if self.a_source not in A_SOURCES:
            raise CompileError(f"wgmma a_source must be one of {A_SOURCES}, got {self.a_source!r}")
        if self.a_source == "registers" and self.a_major != "K":
            raise CompileError("wgmma with A from registers needs a_major='K' (the register fragment has no "
                               "transpose)")

    @property
    def m(self) -> int:
        return 64

    @property
    def k(self) -> int:
        return 256 // self.a_dtype.bits

    @property
    def acc_registers(self) -> int:
        """32-bit registers of the accumulator per thread (f16 packs two elements into one)."""
        return self.n * self.acc_dtype.bits // 64

    def acc_type(self) -> ir.Type:
        register = "f32" if self.acc_dtype == dtypes.f32 else "i32"
        return ir.Type.parse("!llvm.struct<(" + ", ".join([register] * self.acc_registers) + ")>")


def a_fragment_elements(atom: WgmmaAtom, step: int) -> list[tuple[int, ...]]:
    """For each register of the ``AFragment`` that ``Accumulator.to_a_fragments`` builds for k-step ``step``
    of ``atom``, the accumulator elements it packs (low bits first).

    16-bit A: elements 2r, 2r + 1 of the step's eight, which keeps the accumulator's column order. 8-bit A:
    each thread's own elements, no shuffles (as FlashAttention-3 builds P), which permutes the columns; see
    ``register_a_k_order``.
    """
    if atom.a_dtype.bits == 16:
        return [(8 * step + 2 * r, 8 * step + 2 * r + 1) for r in range(4)]
    return [tuple(16 * step + 8 * (r // 2) + 2 * (r % 2) + d for d in (0, 1, 4, 5)) for r in range(4)]


def register_a_k_order(atom: WgmmaAtom) -> tuple[int, ...]:
    """For each column k of a k-step's A operand built by ``Accumulator.to_a_fragments``, the column of the
    accumulator's k-step slice it holds: the identity for 16-bit A; for 8-bit A, within every 16 columns, A
    column ``4q + b`` holds accumulator column ``8*(b//2) + 2q + b%2``.

    For 8-bit A, B's K rows must be permuted the same way (row k of B holds row ``order[k]`` of the unpermuted
    operand), e.g. while transposing V into K-major shared memory.
    """
    if atom.a_dtype.bits == 16:
        return tuple(range(atom.k))
    return tuple(16 * (k // 16) + 8 * ((k % 4) // 2) + 2 * ((k % 16) // 4) + k % 2 for k in range(atom.k))


class AFragment:
    """The A operand of one register-A wgmma: a 64 x K slice, four 32-bit registers per thread in the
    register-A layout of the module doc. Build it with ``Accumulator.to_a_fragments`` or from registers that
    hold that layout (``sm80.ldmatrix_x4`` for 16-bit A)."""

    def __init__(self, registers: Sequence[Scalar], dtype: DType):
        if len(registers) != 4 or any(r.dtype.bits != 32 for r in registers):
            raise CompileError("a wgmma A fragment is four 32-bit registers")
        self.registers = list(registers)
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"AFragment<{self.dtype.name}>"

    def __nvfly_flatten__(self) -> tuple[list[ir.Value], Callable[[Sequence[ir.Value]], "AFragment"]]:
        dtype = self.dtype
        types = [r.dtype for r in self.registers]
        return ([r.value for r in self.registers],
                lambda vs: AFragment([Scalar(v, t) for v, t in zip(vs, types)], dtype))


class Accumulator:
    """A warpgroup's accumulator fragment (an LLVM struct in registers; see the module doc for the
    element-to-(row, column) map), f32 or f16. Carried through dynamic loops like any value."""

    def __init__(self, value: ir.Value, n: int, dtype: DType = dtypes.f32):
        self.value = value
        self.n = n
        self.dtype = dtype

    @staticmethod
    @traced
    def zeros(atom: WgmmaAtom) -> "Accumulator":
        return Accumulator(llvm.mlir_zero(atom.acc_type()), atom.n, atom.acc_dtype)

    @staticmethod
    @traced
    def undefined(atom: WgmmaAtom) -> "Accumulator":
        """An accumulator whose registers nothing defines yet: the input of a first ``mma(..., zero=True)``.

        Zeroing registers with ordinary moves between wgmmas makes ptxas serialise them (C7515).
        """
        return Accumulator(llvm.mlir_undef(atom.acc_type()), atom.n, atom.acc_dtype)

    def __nvfly_flatten__(self) -> tuple[list[ir.Value], Callable[[Sequence[ir.Value]], "Accumulator"]]:
        n, dtype = self.n, self.dtype
        return [self.value], lambda vs: Accumulator(vs[0], n, dtype)

    def __len__(self) -> int:
        return self.n // 2

    @property
    def _registers(self) -> int:
        return self.n * self.dtype.bits // 64

    def _register_type(self) -> ir.Type:
        return ir.F32Type.get() if self.dtype == dtypes.f32 else ir.IntegerType.get_signless(32)

    @traced
    def __getitem__(self, i: int) -> Scalar:
        if self.dtype == dtypes.f32:
            return Scalar(llvm.extractvalue(ir.F32Type.get(), self.value, [i]), dtypes.f32)
        pair = llvm.bitcast(ir.VectorType.get([2], ir.F16Type.get()),
                            llvm.extractvalue(self._register_type(), self.value, [i // 2]))
        return Scalar(vector.extract(pair, [], [i % 2]), dtypes.f16)

    @traced
    def map(self, fn: Callable[[Scalar, int], Any]) -> "Accumulator":
        """A new accumulator with element ``i`` replaced by ``fn(element, i)`` (converted to the
        accumulator's dtype)."""
        out = self.value
        if self.dtype == dtypes.f32:
            for i in range(self.n // 2):
                v = fn(self[i], i)
                out = llvm.insertvalue(out, v.to(dtypes.f32).value, [i])
            return Accumulator(out, self.n)
        for r in range(self._registers):
            pair = [as_value(fn(self[2 * r + e], 2 * r + e)).to(dtypes.f16) for e in range(2)]
            out = llvm.insertvalue(out, make_vector(pair).bitcast(dtypes.i32)[0].value, [r])
        return Accumulator(out, self.n, self.dtype)

    @traced
    def fence(self) -> "Accumulator":
        """Keep the compiler from moving accumulator reads or writes across wgmma boundaries."""
        n = self._registers
        reg_t = self._register_type()
        regs = [llvm.extractvalue(reg_t, self.value, [i]) for i in range(n)]
        text = "// fence accumulator"
        res_t = self.value.type
        constraints = ",".join(["=" + _register_constraint(self.dtype)] * n + [str(i) for i in range(n)])
        out = llvm.inline_asm(res_t, regs, text, constraints, has_side_effects=True)
        return Accumulator(out, self.n, self.dtype)

    @traced
    def to_a_fragments(self, atom: WgmmaAtom) -> list["AFragment"]:
        """This 64 x N accumulator as the A operand of a register-A ``atom``: one ``AFragment`` per k-step
        (N / atom.k of them), elements rounded to the atom's A dtype (fp8: saturating to finite).

        Which elements each register packs: ``a_fragment_elements``; 8-bit A permutes the columns within each
        16 (``register_a_k_order``). An f16 accumulator passed unchanged to f16 A hands the next wgmma the
        previous one's accumulator registers, and ptxas then serialises every wgmma of the kernel (C7511);
        attention's softmax in between gives P registers of its own.
        """
        if atom.a_source != "registers":
            raise CompileError("to_a_fragments builds the A operand of an atom with a_source='registers'")
        if self.n % atom.k:
            raise CompileError(f"a 64x{self.n} accumulator does not split into k-steps of {atom.k} columns")
        fragments = []
        for step in range(self.n // atom.k):
            if atom.a_dtype.bits == 16:
                registers = [_pack_16bit(self[lo], self[hi], atom.a_dtype)
                             for lo, hi in a_fragment_elements(atom, step)]
            else:
                registers = [make_vector([_pack_fp8(self[b0], self[b1], atom.a_dtype),
                                          _pack_fp8(self[b2], self[b3], atom.a_dtype)]).bitcast(dtypes.i32)[0]
                             for b0, b1, b2, b3 in a_fragment_elements(atom, step)]
            fragments.append(AFragment(registers, atom.a_dtype))
        return fragments


def _register_constraint(acc_dtype: DType) -> str:
    return "f" if acc_dtype == dtypes.f32 else "r"


def _pack_16bit(low: Scalar, high: Scalar, dtype: DType) -> Scalar:
    return make_vector([low.to(dtype), high.to(dtype)]).bitcast(dtypes.i32)[0]


def _pack_fp8(low: Scalar, high: Scalar, dtype: DType) -> Scalar:
    """Two values rounded to fp8 in one 16-bit word, ``low`` in the low byte."""
    return f32x2_to_fp8x2(low, high, dtype)


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
@requires("sm_90a", "wgmma.fence")
def fence() -> None:
    """``wgmma.fence``: order register and shared-memory accesses before the next wgmma (also after writing
    the registers of an accumulator or an ``AFragment`` that a wgmma then reads)."""
    nvvm.wgmma_fence_aligned()


@requires("sm_90a", "wgmma.commit_group")
def commit_group() -> None:
    nvvm.wgmma_commit_group_sync_aligned()


@requires("sm_90a", "wgmma.wait_group")
def wait_group(pending: int) -> None:
    """Wait until at most ``pending`` committed wgmma groups of this warpgroup are in flight."""
    nvvm.wgmma_wait_group_sync_aligned(pending)


@requires("sm_90a", "wgmma.mma_async")
def mma(atom: WgmmaAtom, acc: Accumulator, a: "Scalar | AFragment", desc_b: Scalar,
        zero: bool = False) -> Accumulator:
    """acc += A @ B for one 64 x N x K step, or acc = A @ B with ``zero`` (asynchronous: commit and wait
    before reading ``acc``). ``a``: A's matrix descriptor, or its ``AFragment`` for a register-A atom."""
    if acc.n != atom.n or acc.dtype != atom.acc_dtype:
        raise CompileError(f"accumulator is 64x{acc.n} {acc.dtype.name}, the atom is 64x{atom.n} "
                           f"{atom.acc_dtype.name}")
    if atom.a_source == "registers":
        if not isinstance(a, AFragment) or a.dtype != atom.a_dtype:
            raise CompileError(f"a register-A wgmma takes an AFragment of {atom.a_dtype.name} as A, got {a!r}")
        return _mma_register_a(atom, acc, a, desc_b, zero)
    if isinstance(a, AFragment):
        raise CompileError("this wgmma reads A from shared memory: pass A's descriptor, or build the atom with "
                           "a_source='registers'")
    shape = ir.Attribute.parse(f"#nvvm.shape<m = 64, n = {atom.n}, k = {atom.k}>")
    t = nvvm.WGMMATypes
    layout_a = nvvm.MMALayout.row if atom.a_major == "K" else nvvm.MMALayout.col
    layout_b = nvvm.MMALayout.col if atom.b_major == "K" else nvvm.MMALayout.row
    out = nvvm.wgmma_mma_async(
        atom.acc_type(), acc.value, a.value, desc_b.value, shape,
        getattr(t, _WGMMA_TYPES[atom.a_dtype.name]), getattr(t, _WGMMA_TYPES[atom.b_dtype.name]),
        getattr(t, _WGMMA_TYPES[atom.acc_dtype.name]),
        nvvm.WGMMAScaleOut.zero if zero else nvvm.WGMMAScaleOut.one, nvvm.WGMMAScaleIn.one, nvvm.WGMMAScaleIn.one, layout_a, layout_b)
    return Accumulator(out, atom.n, atom.acc_dtype)


def _mma_register_a(atom: WgmmaAtom, acc: Accumulator, a: AFragment, desc_b: Scalar, zero: bool) -> Accumulator:
    """The register-A form, as inline PTX (NVVM's wgmma op takes A only as a descriptor); the accumulator
    registers are read-write operands, the scale-d predicate is the constant ``not zero`` like NVVM's."""
    regs = atom.acc_registers
    d_list = ", ".join(f"${i}" for i in range(regs))
    a_list = ", ".join(f"${regs + i}" for i in range(4))
    # 16-bit B may be MN-major (imm-trans-b); the 8-bit form has no transpose operands
    trans_b = f", {int(atom.b_major == 'MN')}" if atom.a_dtype.bits == 16 else ""
    types = ".".join(_WGMMA_TYPES[d.name] for d in (atom.acc_dtype, atom.a_dtype, atom.b_dtype))
    text = ("{\n.reg .pred p;\n"
            f"setp.ne.b32 p, {0 if zero else 1}, 0;\n"
            f"wgmma.mma_async.sync.aligned.m64n{atom.n}k{atom.k}.{types} {{{d_list}}}, {{{a_list}}}, "
            f"${regs + 4}, p, 1, 1{trans_b};\n}}")
    reg_t = acc._register_type()
    initial = [llvm.extractvalue(reg_t, acc.value, [i]) for i in range(regs)]
    constraints = ",".join(["=" + _register_constraint(atom.acc_dtype)] * regs + ["r"] * 4 + ["l"]
                           + [str(i) for i in range(regs)])
    out = llvm.inline_asm(atom.acc_type(), [r.value for r in a.registers] + [desc_b.value] + initial, text,
                          constraints, has_side_effects=True)
    return Accumulator(out, atom.n, atom.acc_dtype)


@requires("sm_90", "stmatrix")
def stmatrix_x4(address: Scalar, regs: Sequence[Scalar], transpose: bool = False) -> None:
    """Store four 8x8 b16 matrices from the warp's registers (``stmatrix.x4``); lanes 8i..8i+7 give the row
    addresses of matrix i, and each lane's register i holds two b16 of matrix i in mma fragment order."""
    if len(regs) != 4:
        raise CompileError("stmatrix_x4 takes four 32-bit registers")
    asm(f"stmatrix.sync.aligned.m8n8.x4{'.trans' if transpose else ''}.shared.b16 [$0], {{$1, $2, $3, $4}};",
        [address, *regs])
