"""fp8 (e4m3) to 16-bit conversion (Ada/Hopper ``cvt.rn.f16x2.e4m3x2``), for kernels that read fp8 data and compute
on 16-bit tensor-core atoms (e.g. an fp8 KV cache dequantised before ``mma.sync``).

Every e4m3 value is exact in f16 (and in bf16), so the conversions round nothing; bf16 goes through f32 because
sm_90 has no e4m3 -> bf16 ``cvt``.
"""
from __future__ import annotations

from typing import Any

from nvfly.arch.ptx import asm, asm_multi
from nvfly.arch.target import requires
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType

# one 32-bit word of four e4m3 (lowest byte first) -> $0, $1: values 0-1 and 2-3 as f16x2 (low half first)
_TO_F16 = ("{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, {src}; cvt.rn.f16x2.e4m3x2 {d0}, lo; "
           "cvt.rn.f16x2.e4m3x2 {d1}, hi; }}")
_TO_BF16 = ("{{ .reg .b16 lo, hi, h0, h1, h2, h3; .reg .b32 w0, w1; .reg .f32 f0, f1, f2, f3; "
            "mov.b32 {{lo, hi}}, {src}; cvt.rn.f16x2.e4m3x2 w0, lo; cvt.rn.f16x2.e4m3x2 w1, hi; "
            "mov.b32 {{h0, h1}}, w0; mov.b32 {{h2, h3}}, w1; cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; "
            "cvt.f32.f16 f2, h2; cvt.f32.f16 f3, h3; cvt.rn.bf16x2.f32 {d0}, f1, f0; "
            "cvt.rn.bf16x2.f32 {d1}, f3, f2; }}")


def _conversion(dtype: DType, src: str, d0: str, d1: str) -> str:
    if dtype.name not in ("f16", "bf16"):
        raise CompileError(f"e4m3 converts to f16 or bf16, got {dtype.name}")
    return (_TO_F16 if dtype.name == "f16" else _TO_BF16).format(src=src, d0=d0, d1=d1)


@requires("sm_89", "cvt.rn.f16x2.e4m3x2")
def e4m3x4_to_16bit(word: Any, dtype: DType) -> list:
    """Four e4m3 values in a 32-bit word (lowest byte first) as two 32-bit words of two ``dtype`` (f16 or bf16)
    values each: [values 0, 1], [values 2, 3], the lower-numbered value in the low half (mma's packing)."""
    return asm_multi(_conversion(dtype, "$2", "$0", "$1"), [dtypes.i32] * 2, [word], side_effects=False)


@requires("sm_89", "cvt.rn.f16x2.e4m3x2")
def convert_shared_e4m3x16(src: Any, dst_low: Any, dst_high: Any, dtype: DType) -> None:
    """Sixteen e4m3 values at shared address ``src`` (16-byte aligned) as sixteen ``dtype`` values: values 0-7 to
    the 16 bytes at ``dst_low``, 8-15 to ``dst_high`` (so a converted row may be laid out in swizzled 16-byte
    segments). One 16-byte shared load and two 16-byte stores."""
    words = asm_multi("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", [dtypes.i32] * 4, [src])
    out = []
    for word in words:
        out.extend(e4m3x4_to_16bit(word, dtype))
    asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", [dst_low, *out[:4]])
    asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", [dst_high, *out[4:]])
