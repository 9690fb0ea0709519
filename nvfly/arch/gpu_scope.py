"""GPU-scope memory operations for reductions across CTAs (split-K, stream-K fix-up).

The pattern (see ``gemm_skinny`` and ``gemm_kernel``): every CTA adds its f32 partial sums into a zeroed
workspace with relaxed reductions (``red_add*``), fences, and counts itself in on a per-tile counter
(``arrive``, acq_rel); the CTA that sees the count of all others reads the complete sums back with relaxed
GPU-scope loads (never a stale L1 line), finishes the tile and zeroes the workspace and counter again.
"""
from __future__ import annotations

from typing import Any, Sequence

from nvfly.arch.ptx import asm, asm_multi
from nvfly.frontend import dtypes


def red_add(address: Any, value: Any) -> None:
    """*address += value (f32, relaxed, GPU scope), no result."""
    asm("red.relaxed.gpu.global.add.f32 [$0], $1;", [address, value])


def red_add_x4(address: Any, values: Sequence[Any]) -> None:
    """Four f32 adds to the 16-byte aligned ``address`` in one instruction (sm_90)."""
    asm("red.relaxed.gpu.global.add.v4.f32 [$0], {$1, $2, $3, $4};", [address, *values])


def arrive(address: Any) -> Any:
    """Count the caller in on a u32 counter (acq_rel, GPU scope); the previous count."""
    return asm("atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;", [address], result=dtypes.i32)


def load_relaxed(address: Any) -> Any:
    return asm("ld.relaxed.gpu.global.f32 $0, [$1];", [address], result=dtypes.f32)


def load_relaxed_x4(address: Any) -> list[Any]:
    """Four f32 from the 16-byte aligned ``address`` (relaxed, GPU scope)."""
    return asm_multi("ld.relaxed.gpu.global.v4.f32 {$0, $1, $2, $3}, [$4];", [dtypes.f32] * 4, [address])


def store_zeros_x4(address: Any) -> None:
    """Sixteen zero bytes at the 16-byte aligned ``address``."""
    asm("st.global.v4.b32 [$0], {0, 0, 0, 0};", [address])
