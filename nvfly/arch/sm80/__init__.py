"""Ampere (sm_80) atoms, also available on Hopper: cp.async with commit/wait groups, ldmatrix, movmatrix,
mma.sync.

Register fragments follow PTX's ``mma.m16n8k16`` layouts: A is four 32-bit registers (eight 16-bit values),
B two, C/D four f32. ``ldmatrix_x4`` fills an A fragment (or two B fragments) from shared memory;
``movmatrix_trans`` transposes an 8 x 8 matrix held in registers in that layout.
"""
from __future__ import annotations

from typing import Any, Sequence

from nvfly.arch.ptx import asm, asm_multi
from nvfly.arch.target import requires
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.values import Scalar, as_value

_MMA_TYPES = {"bf16": "bf16", "f16": "f16"}


@requires("sm_80", "cp.async")
def cp_async(smem: Scalar, src: Any, nbytes: int = 16, valid: Any = None) -> None:
    """Asynchronous global -> shared copy of 4, 8 or 16 bytes (``cp.async``); with ``valid`` false the
    destination is zero-filled instead (a predicated copy for tails)."""
    if nbytes not in (4, 8, 16):
        raise CompileError(f"cp.async copies 4, 8 or 16 bytes, got {nbytes}")
    cache = "cg" if nbytes == 16 else "ca"
    if valid is None:
        asm(f"cp.async.{cache}.shared.global [$0], [$1], {nbytes};", [smem, src])
    else:
        size = as_value(valid).to(dtypes.i32) * nbytes
        asm(f"cp.async.{cache}.shared.global [$0], [$1], {nbytes}, $2;", [smem, src, size])


@requires("sm_80", "cp.async.commit_group")
def cp_async_commit() -> None:
    asm("cp.async.commit_group;")


@requires("sm_80", "cp.async.wait_group")
def cp_async_wait(pending: int = 0) -> None:
    """Wait until at most ``pending`` committed cp.async groups of this thread are outstanding."""
    asm(f"cp.async.wait_group {pending};")


@requires("sm_75", "ldmatrix")
def ldmatrix_x4(smem: Scalar, transpose: bool = False) -> list[Scalar]:
    """Load four 8x8 b16 matrices (``ldmatrix.x4``): lanes 8i..8i+7 give the row addresses of matrix i; each
    lane gets one 32-bit register per matrix."""
    return asm_multi(f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if transpose else ''}.shared.b16 "
                     "{$0, $1, $2, $3}, [$4];", [dtypes.i32] * 4, [smem])


@requires("sm_75", "movmatrix")
def movmatrix_trans(word: Scalar) -> Scalar:
    """Transpose an 8 x 8 b16 matrix across the warp (``movmatrix.sync.aligned.m8n8.trans.b16``, sm_75+): lane l
    holds row l // 4, columns 2 * (l % 4) + {0, 1} of the matrix in one 32-bit register (low half first) and
    gets the same elements of its transpose, i.e. source rows 2 * (l % 4) + {0, 1} of column l // 4."""
    return asm("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", [word], dtypes.i32)


@requires("sm_80", "mma.sync.m16n8k16")
def mma_m16n8k16(a: Sequence[Scalar], b: Sequence[Scalar], c: Sequence[Any], dtype: DType) -> list[Scalar]:
    """D = A @ B + C for one m16n8k16 tile (``mma.sync``, f32 accumulation); A row-major, B column-major."""
    if dtype.name not in _MMA_TYPES:
        raise CompileError(f"mma.m16n8k16 takes bf16 or f16, got {dtype.name}")
    if len(a) != 4 or len(b) != 2 or len(c) != 4:
        raise CompileError("mma.m16n8k16 takes 4 A registers, 2 B registers and 4 accumulators")
    t = _MMA_TYPES[dtype.name]
    return asm_multi(f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{$0, $1, $2, $3}}, "
                     "{$4, $5, $6, $7}, {$8, $9}, {$0, $1, $2, $3};", [dtypes.f32] * 4,
                     [*a, *b, *c], side_effects=False, tied=True)
