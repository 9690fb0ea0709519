"""Float compares that give bit masks, two 16-bit lanes at a time, and conversions of raw bits.

``compare_mask`` (``set.<cmp>.u32.<type>``: all ones where the compare holds, per 16-bit lane for bf16x2 / f16x2)
filters many values with one instruction a pair and no predicate registers; ``f16_to_f32`` (``cvt.f32.f16``)
converts a half given as its 16 bits; ``e8m0_to_f32`` decodes an MX scale byte, ``e2m1x8_to_e4m3x8`` and
``convert_shared_e2m1x32`` turn packed MXFP4 values into e4m3 (times 2^-6, exact) for fp8 wgmma, ``f32_to_e2m1``
rounds to e2m1. ``divide`` with ``division_reciprocal``: many correctly rounded divisions by one divisor
(``div.rn.f32``'s fast path, the reciprocal refined once). ``tanh_approx`` is the MUFU unit's tanh (``tanh.approx.f32``,
sm_75+): one instruction, where ``nvfly.tanh`` (a correctly rounded expansion) is ~20 (an ex2, a reciprocal and a
polynomial); its relative error is at most 2^-10.987 (PTX ISA), under bf16's half ulp, which is why
FlashAttention-3 soft-caps with it. ``e4m3x4_to_16bit``, ``convert_shared_e4m3x16`` and ``store_e4m3x16``
(Ada/Hopper ``cvt.rn.f16x2.e4m3x2``) turn fp8 (e4m3) into f16 or bf16, for kernels that read fp8 data and compute
on 16-bit tensor-core atoms (e.g. an fp8 KV cache dequantised before ``mma.sync``); ``permute_bytes`` (``prmt``)
gathers fp8 bytes into the pairs they convert. Every e4m3 value is exact in f16 and in bf16, so they round nothing; bf16 goes through f32 because sm_90
has no e4m3 -> bf16 ``cvt`` (four times the instructions: prefer f16 MMAs on converted fp8).
"""
from __future__ import annotations

import struct
from typing import Any

from nvfly.arch.memory import load_shared, store_shared
from nvfly.arch.ptx import asm, asm_multi
from nvfly.arch.target import requires
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.language import fma, maximum, minimum, select
from nvfly.frontend.trace import traced
from nvfly.frontend.values import Scalar, as_value

# PTX's float compare operators: ordered ones (false when either is NaN) and the unordered "...u" ones (true then)
COMPARES = ("eq", "ne", "lt", "le", "gt", "ge", "equ", "neu", "ltu", "leu", "gtu", "geu", "num", "nan")
_PACKED_TYPES = {dtypes.bf16: "bf16x2", dtypes.f16: "f16x2"}


@traced
def compare_mask(a: Any, b: Any, cmp: str, dtype: DType) -> Scalar:
    """``a <cmp> b`` as a u32 mask (``set.<cmp>.u32.<type>``). ``dtype`` f32: ``a``, ``b`` are f32 and the mask
    is all ones or zero; bf16 / f16: ``a``, ``b`` are 32-bit words holding two values each (low half first) and
    each 16-bit half of the mask is all ones where that pair's compare holds (``bf16x2`` / ``f16x2``)."""
    if cmp not in COMPARES:
        raise CompileError(f"compare_mask: cmp must be one of {', '.join(COMPARES)}; got {cmp!r}")
    if dtype == dtypes.f32:
        ptx_type = "f32"
    elif dtype in _PACKED_TYPES:
        ptx_type = _PACKED_TYPES[dtype]
    else:
        raise CompileError(f"compare_mask compares f32, or pairs of bf16 / f16; got {dtype.name}")
    operands = [as_value(x) for x in (a, b)]
    for x in operands:
        if not isinstance(x, Scalar) or x.dtype.bits != 32 or (dtype == dtypes.f32) != (x.dtype == dtypes.f32):
            raise CompileError(f"compare_mask of {ptx_type} takes {'f32' if dtype == dtypes.f32 else '32-bit word'} "
                               f"scalars, got {getattr(x, 'dtype', x)}")
    return asm(f"set.{cmp}.u32.{ptx_type} $0, $1, $2;", operands, dtypes.u32, side_effects=False)


@requires("sm_75", "tanh.approx.f32")
def tanh_approx(x: Any) -> Scalar:
    """tanh of an f32 by the MUFU unit (``tanh.approx.f32``): relative error at most 2^-10.987, tanh(0) = 0,
    saturating to +-1."""
    v = as_value(x, dtypes.f32 if isinstance(x, (int, float)) else None)
    if not isinstance(v, Scalar) or v.dtype != dtypes.f32:
        raise CompileError(f"tanh_approx takes an f32 scalar, got {getattr(v, 'dtype', v)}")
    return asm("tanh.approx.f32 $0, $1;", [v], dtypes.f32, side_effects=False)


@traced
def f16_to_f32(bits: Any) -> Scalar:
    """The f32 value of the f16 whose 16 bits are ``bits`` (an i16), exactly (``cvt.f32.f16``)."""
    v = as_value(bits)
    if not isinstance(v, Scalar) or v.dtype != dtypes.i16:
        raise CompileError(f"f16_to_f32 takes the 16 bits of an f16 as an i16, got {getattr(v, 'dtype', v)}")
    return asm("cvt.f32.f16 $0, $1;", [v], dtypes.f32, side_effects=False)


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
    store_e4m3x16(words, dst_low, dst_high, dtype)


@requires("sm_89", "cvt.rn.f16x2.e4m3x2")
def store_e4m3x16(words: list, dst_low: Any, dst_high: Any, dtype: DType) -> None:
    """``convert_shared_e4m3x16`` of sixteen e4m3 values already loaded (four 32-bit words, lowest byte first): so
    that a thread issues all its shared loads before the first conversion waits on one."""
    out = []
    for word in words:
        out.extend(e4m3x4_to_16bit(word, dtype))
    store_shared(dst_low, out[:4])
    store_shared(dst_high, out[4:])


def permute_bytes(low: Any, high: Any, selector: int) -> Scalar:
    """``prmt.b32``: a 32-bit word whose byte i is byte (selector >> 4i) & 7 of the 8 bytes of ``low`` (0-3) and
    ``high`` (4-7), e.g. to gather fp8 bytes into the pairs ``e4m3x4_to_16bit`` converts."""
    if not 0 <= selector <= 0x7777 or any((selector >> (4 * i)) & 8 for i in range(4)):
        raise CompileError(f"permute_bytes: selector 0x{selector:x} must pick bytes 0-7 (four nibbles of 0-7)")
    return asm(f"prmt.b32 $0, $1, $2, 0x{selector:04x};", [as_value(low, dtypes.i32), as_value(high, dtypes.i32)],
               dtypes.i32, side_effects=False)


_FP8_KINDS = {"f8e4m3": "e4m3", "f8e5m2": "e5m2"}


@requires("sm_89", "cvt.rn.satfinite.e4m3x2.f32")
def f32x2_to_fp8x2(low: Any, high: Any, dtype: DType) -> Scalar:
    """Two f32 values rounded to nearest even to ``dtype`` (f8e4m3 or f8e5m2), saturating to the largest finite
    value, in one 16-bit word, ``low`` in the low byte (``cvt`` names the high one first)."""
    kind = _FP8_KINDS.get(dtype.name)
    if kind is None:
        raise CompileError(f"f32 rounds to f8e4m3 or f8e5m2 here, got {dtype.name}")
    return asm(f"cvt.rn.satfinite.{kind}x2.f32 $0, $1, $2;", [as_value(high).to(dtypes.f32),
                                                                as_value(low).to(dtypes.f32)],
               result=dtypes.i16, side_effects=False)


E8M0_NAN = 0xFF
_E8M0_ZERO_BITS = 0x00400000  # 2^-127: below f32's normals, the subnormal with the top mantissa bit set
_F32_NAN_BITS = 0x7FC00000


@traced
def e8m0_to_f32(byte: Any) -> Scalar:
    """2^(byte - 127) in f32 for an OCP MX e8m0 scale byte (an integer scalar, e.g. a u8 load): integer ops
    only, the byte shifted into f32's exponent field; byte 0 is the subnormal 2^-127 and 0xFF is NaN."""
    v = as_value(byte)
    if not isinstance(v, Scalar) or not v.dtype.is_int:
        raise CompileError(f"e8m0_to_f32 takes the scale's byte as an integer scalar, got {getattr(v, 'dtype', v)}")
    bits = v.to(dtypes.i32) & 0xFF  # a signed byte's sign extension masked off
    bits = select(bits == 0, _E8M0_ZERO_BITS, select(bits == E8M0_NAN, _F32_NAN_BITS, bits << 23))
    return bits.bitcast(dtypes.f32)


@traced
def e2m1x8_to_e4m3x8(word: Any) -> list:
    """Eight OCP e2m1 values packed in a 32-bit word (two a byte, the lower-numbered in the low nibble, as torch's
    float4_e2m1fn_x2) as eight e4m3 bytes in two 32-bit words (values 0-3, then 4-7, lowest byte first), each value
    times 2^-6: the nibble's exponent and mantissa bits move to e4m3's bits 4-2 (e2m1's bias 1 under e4m3's 7) and
    its sign to bit 7, so every value (0.5 the subnormal included) is exact; fold 2^6 into the scale."""
    w = as_value(word)
    if not isinstance(w, Scalar) or w.dtype != dtypes.i32:
        raise CompileError(f"e2m1x8_to_e4m3x8 takes a 32-bit word as an i32, got {getattr(w, 'dtype', w)}")
    return e2m1x8_to_e4m3x8_bits(w)


def e2m1x8_to_e4m3x8_bits(w: Any) -> list:
    """``e2m1x8_to_e4m3x8``'s bit operations on anything with integer operators: a traced i32, or (to test them
    without a GPU) Python ints or int64 tensors holding the word's unsigned value."""
    out = []
    for half in (w & 0xFFFF, (w >> 16) & 0xFFFF):
        spread = (half | (half << 8)) & 0x00FF00FF     # bytes 0, 2: the packed bytes 0, 1
        nibbles = (spread | (spread << 4)) & 0x0F0F0F0F  # a nibble a byte, in order
        out.append(((nibbles & 0x08080808) << 4) | ((nibbles & 0x07070707) << 2))
    return out


def convert_shared_e2m1x32(src: Any, dst_low: Any, dst_high: Any) -> None:
    """Thirty-two packed e2m1 values (16 bytes) at shared address ``src`` (16-byte aligned) as e4m3 times 2^-6
    (``e2m1x8_to_e4m3x8``): values 0-15 to the 16 bytes at ``dst_low``, 16-31 to ``dst_high`` (so that a converted
    row may be laid out in swizzled 16-byte segments). One 16-byte shared load and two 16-byte stores."""
    out = []
    for word in load_shared(src, 4):
        out.extend(e2m1x8_to_e4m3x8(word))
    store_shared(dst_low, out[:4])
    store_shared(dst_high, out[4:])


# e2m1's rounding thresholds (a magnitude's code = how many it passes): at the ties 0.25, 1.25, 2.5 and 5 the even
# code below wins (strictly above), at 0.75, 1.75 and 3.5 the even code above (at or above); past 6 it saturates
E2M1_ABOVE = (0.25, 1.25, 2.5, 5.0)
E2M1_AT_OR_ABOVE = (0.75, 1.75, 3.5)


@traced
def max_x2(a: Any, b: Any, dtype: DType) -> Scalar:
    """The larger of each 16-bit lane of two 32-bit words of ``dtype`` (bf16 or f16) pairs (``max.NaN.<type>x2``:
    a NaN wins)."""
    kind = _PACKED_TYPES.get(dtype)
    if kind is None:
        raise CompileError(f"max_x2 takes bf16 or f16 pairs, got {dtype.name}")
    return asm(f"max.NaN.{kind} $0, $1, $2;", [as_value(a), as_value(b)], dtypes.i32, side_effects=False)


@traced
def max_abs_x2(words: list, dtype: DType) -> Scalar:
    """The largest magnitude in each 16-bit lane of 32-bit words of ``dtype`` (bf16 or f16) pairs, as one word of
    two: the sign bits cleared and ``max.NaN.<type>x2`` (a NaN wins), one instruction for two values each."""
    if dtype not in _PACKED_TYPES:
        raise CompileError(f"max_abs_x2 takes bf16 or f16 pairs, got {dtype.name}")
    most = as_value(words[0]) & 0x7FFF7FFF
    for w in words[1:]:
        most = max_x2(most, as_value(w) & 0x7FFF7FFF, dtype)
    return most


@traced
def division_reciprocal(divisor: Any) -> Scalar:
    """The reciprocal ``divide`` multiplies by, for many divisions by one f32 ``divisor``: ``rcp.approx.ftz``
    refined by one Newton step, as sm_90's ``div.rn.f32`` computes it for each division."""
    d = as_value(divisor)
    if not isinstance(d, Scalar) or d.dtype != dtypes.f32:
        raise CompileError(f"division_reciprocal takes an f32, got {getattr(d, 'dtype', d)}")
    y = asm("rcp.approx.ftz.f32 $0, $1;", [d], dtypes.f32, side_effects=False)
    return fma(y, fma(-d, y, 1.0), y)


@traced
def divide(x: Any, divisor: Any, reciprocal: Any) -> Scalar:
    """f32 ``x / divisor`` rounded to nearest even with ``reciprocal = division_reciprocal(divisor)``: ``div.rn.f32``'s
    fast path (the quotient from the reciprocal, one fma-computed remainder, one correction), three instructions,
    without its per-division reciprocal and range check (FCHK, which sends zeros, subnormals and quotients near
    f32's ends to a slow path). Equal to ``div.rn.f32`` where x, the divisor and the quotient are normal and the
    divisor positive and finite, zeros included; a quotient below 2^-100 may be off by ulps."""
    q = x * reciprocal
    # the remainder negated (d q - x, exactly -(x - d q) rounded) and subtracted: the same correction as
    # q + r (x - d q), but a zero x keeps its sign (-0: q = -0, d q - x = +0, -r * +0 + -0 = -0), where adding
    # r * (x - d q) = +0 to q = -0 would give +0 and need a copysign
    return fma(-as_value(reciprocal), fma(divisor, q, -as_value(x)), q)


# f32_to_e2m1 rounds a magnitude by adding the power of two whose f32 ulp is e2m1's step there (0.5 below 2, 1 below
# 4, 2 above): the sum's bits less the constant's count the steps, from the code at the binade's start (0, 4, 6)
E2M1_MAGIC = ((2.0, 2.0 ** 22, 0), (4.0, 2.0 ** 23, 2), (None, 2.0 ** 24, 4))


@traced
def f32_to_e2m1(value: Any, nan: bool = True) -> Scalar:
    """The OCP e2m1 code (an i32, 0-15, sign in bit 3) of an f32 value, rounded to nearest even and saturating to
    +-6 (NaN: 0; ``nan=False`` for values known not to be NaN saves two instructions), the sign kept (-0 for small
    negatives); sm_90 has no e2m1 ``cvt``: the magnitude plus ``E2M1_MAGIC``'s constant rounds it to nearest even in
    one add (about ten instructions, where counting the seven thresholds ``E2M1_ABOVE`` / ``E2M1_AT_OR_ABOVE`` took
    about twenty)."""
    v = as_value(value)
    if not isinstance(v, Scalar) or v.dtype != dtypes.f32:
        raise CompileError(f"f32_to_e2m1 takes an f32, got {getattr(v, 'dtype', v)}")
    magnitude = abs(v)
    (low, c0, o0), (mid, c1, o1), (_, c2, o2) = E2M1_MAGIC
    magic = select(magnitude < low, c0, select(magnitude < mid, c1, c2))
    less = select(magnitude < low, _f32_bits(c0) - o0, select(magnitude < mid, _f32_bits(c1) - o1, _f32_bits(c2) - o2))
    steps = (magnitude + magic).bitcast(dtypes.i32) - less
    code = minimum(steps, 7)  # inf saturates
    if nan:
        code = select(magnitude == magnitude, code, 0)  # NaN passes no threshold
    return code | ((v.bitcast(dtypes.i32) >> 28) & 8)


# bf16x2_to_e2m1x8 rounds two bf16 magnitudes a (|x| times the scale's reciprocal, clamped to 6) per instruction:
# the magic is 64 times a's power of two (at least 1), whose bf16 ulp is e2m1's step (0.5 below 2, 1 below 4, 2
# above); the sum's bits less the magic's count the steps from the binade's first code, 2 * (exponent - 127)
_BF16_ONE_PAIR = 0x3F803F80
_BF16_SIX_PAIR = 0x40C040C0
_BF16_EXPONENT_PAIR = 0x7F807F80
_BF16_TIMES_64 = 0x03000300  # 6 added to a bf16 exponent field
_E2M1_CODE_BIAS = 0x03FE03FE  # per 16-bit lane: 6 << 7 of the magic's exponent plus 2 * 127 of the code's


@traced
def bf16x2_to_e2m1x8(words: list, reciprocal: Any) -> Scalar:
    """The eight OCP e2m1 codes (one 32-bit word, the lowest nibble first: ``f32_to_e2m1`` of each value times the
    f32 ``reciprocal``) of four 32-bit words of bf16 pairs (low half first), for a ``reciprocal`` that is a normal
    power of two and values that are not NaN (inf saturates): bf16x2 arithmetic, two values an instruction. |x|
    times the reciprocal is exact in bf16 (a power of two; a subnormal product is far below e2m1's 0.25), clamped
    to 6 (``min.bf16x2``), then rounded by one ``add.rn.bf16x2`` of a magic power of two (``max.bf16x2`` with 1
    and an exponent mask pick it), which rounds to nearest even at e2m1's step as ``f32_to_e2m1``'s f32 add does;
    integer ops on the pair then give the codes and the nibbles. About 13 instructions a pair, where
    ``f32_to_e2m1`` takes about 10 a value plus the conversions to f32."""
    if len(words) != 4:
        raise CompileError(f"bf16x2_to_e2m1x8 takes four 32-bit words of bf16 pairs, got {len(words)}")
    r = as_value(reciprocal)
    if not isinstance(r, Scalar) or r.dtype != dtypes.f32:
        raise CompileError(f"bf16x2_to_e2m1x8 takes the reciprocal as an f32, got {getattr(r, 'dtype', r)}")
    bits = r.bitcast(dtypes.i32)
    pair = bits | (bits >> 16)  # positive, a power of two (its low 16 bits zero): its bf16 in both halves
    codes = []
    for word in words:
        w = as_value(word)
        if not isinstance(w, Scalar) or w.dtype.bits != 32 or not w.dtype.is_int:
            raise CompileError(f"bf16x2_to_e2m1x8 takes 32-bit integer words, got {getattr(w, 'dtype', w)}")
        a = asm("mul.rn.bf16x2 $0, $1, $2;", [w & 0x7FFF7FFF, pair], dtypes.i32, side_effects=False)
        a = asm("min.bf16x2 $0, $1, $2;", [a, _BF16_SIX_PAIR], dtypes.i32, side_effects=False)
        e = asm("max.bf16x2 $0, $1, $2;", [a, _BF16_ONE_PAIR], dtypes.i32, side_effects=False) & _BF16_EXPONENT_PAIR
        total = asm("add.rn.bf16x2 $0, $1, $2;", [a, e + _BF16_TIMES_64], dtypes.i32, side_effects=False)
        # per lane: steps (sum less magic) plus the binade's first code; no borrow crosses lanes (each lane >= 0)
        code = total - e + (e >> 6) - _E2M1_CODE_BIAS
        codes.append(code | ((w >> 12) & 0x00080008))  # the signs (bits 15, 31) to bits 3, 19
    # nibble 2p: word p's low value, 2p + 1 its high one
    low01, low23 = codes[0] | (codes[1] << 8), codes[2] | (codes[3] << 8)  # bytes: low p, low p + 1, high p, high p+1
    lows = asm("prmt.b32 $0, $1, $2, 0x5410;", [low01, low23], dtypes.i32, side_effects=False)
    highs = asm("prmt.b32 $0, $1, $2, 0x7632;", [low01, low23], dtypes.i32, side_effects=False)
    return lows | (highs << 4)


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


# e2m1 -> 16-bit: a nibble moved so that its sign is the 16-bit value's sign (bit 15) and its exponent and mantissa
# bits sit under the low exponent bits (E at the two lowest exponent bits, M the top mantissa bit): the 16-bit value
# is then the e2m1 value times 2^(1 - bias) exactly, e2m1's subnormal 0.5 a 16-bit subnormal (bf16: bias 127, EM
# shifted to bits 8-6; f16: bias 15, bits 11-9)
E2M1_EM_SHIFT = {"bf16": 6, "f16": 3}
E2M1_UNIT_EXPONENT = {"bf16": -126, "f16": -14}  # the unscaled 16-bit value is the e2m1 value times 2^this
_SIGN_PAIR = 0x80008000
_EM_PAIR = 0x70007000


def e2m1x8_to_16bit_bits(w: Any, dtype_name: str) -> list:
    """Eight packed e2m1 values (a 32-bit word, two a byte, the lower-numbered in the low nibble) as four 32-bit
    words of two 16-bit values each (``dtype_name`` "bf16" or "f16"), pairing nibble i with nibble i + 4: word i
    holds values i (low half) and i + 4 (high half), each the e2m1 value times 2^E2M1_UNIT_EXPONENT. Bit operations
    only, on anything with integer operators: a traced i32 (the arithmetic shifts' sign bits are masked off), or,
    to test them without a GPU, Python ints or int64 tensors holding the word's unsigned value."""
    em_shift = E2M1_EM_SHIFT[dtype_name]
    out = []
    for i in range(4):
        up = 12 - 4 * i  # nibble i's sign (bit 4i + 3) to bit 15, nibble i + 4's to bit 31
        sign = (w << up) & _SIGN_PAIR
        moved = up - em_shift
        em = (w << moved) if moved >= 0 else (w >> -moved)
        out.append(sign | (em & (_EM_PAIR >> em_shift)))
    return out


_PACKED_MUL = {"bf16": "mul.rn.bf16x2", "f16": "mul.rn.f16x2"}


# A bit-shuffled e2m1 layout (nvfly.ops.scaled.quantize.shuffle_mxfp4_a16's "shuffled-bf16" / "shuffled-f16"): the
# 16-bit word i (values 2i low, 2i + 1 high of a 32-bit word of 8 values) is the word shifted by
# E2M1_SHUFFLED_SHIFTS[dtype][i][0] masked to the sign bits, or-ed with it shifted by [i][1] masked to the
# exponent-mantissa bits (> 0: left, < 0: right). Found by exhaustive search: the eight bit sets tile the word with 5
# distinct shifts, all but one (bf16) or all (f16) left shifts, which ptxas may issue on the FMA pipe (IMAD.SHL),
# leaving the integer pipe the masks: ~13 ops for 8 values against e2m1x8_to_16bit_bits' ~16
E2M1_SHUFFLED_SHIFTS = {"bf16": ((0, 0), (6, -6), (5, 6), (4, 3)), "f16": ((0, 0), (3, 9), (2, 6), (1, 3))}


def e2m1_shuffled_bit_positions(dtype_name: str) -> list:
    """For each value v (0..7) of a 32-bit word of the bit-shuffled layout, the source bit positions of its
    (mantissa, low exponent, high exponent, sign) bits (the e2m1 nibble's bits 0..3)."""
    top = 14 - E2M1_EM_SHIFT[dtype_name]  # the high exponent bit's target in the low half (bf16 8, f16 11)
    out = []
    for v in range(8):
        i, high = v // 2, v % 2
        sign_shift, em_shift = E2M1_SHUFFLED_SHIFTS[dtype_name][i]
        out.append([top - 2 + j + 16 * high - em_shift for j in range(3)] + [15 + 16 * high - sign_shift])
    return out


def e2m1x8_shuffled_to_16bit_bits(w: Any, dtype_name: str) -> list:
    """Eight e2m1 values in the bit-shuffled layout (``e2m1_shuffled_bit_positions``) as four 32-bit words of two
    16-bit values, word i = values 2i (low) and 2i + 1 (high), each times 2^E2M1_UNIT_EXPONENT (as
    ``e2m1x8_to_16bit_bits``). Bit operations only, on a traced i32 (the arithmetic right shift's sign bits are
    masked off) or, to test them without a GPU, Python ints holding the word's unsigned value."""
    em_mask = _EM_PAIR >> E2M1_EM_SHIFT[dtype_name]

    def shifted(n: int) -> Any:
        return w if n == 0 else (w << n) if n > 0 else (w >> -n)
    return [(shifted(a) & _SIGN_PAIR) | (shifted(b) & em_mask) for a, b in E2M1_SHUFFLED_SHIFTS[dtype_name]]


@traced
def e2m1x8_shuffled_to_16bit_scaled(word: Any, factor: Any, dtype: DType) -> list:
    """``e2m1x8_to_16bit_scaled`` for a word of the bit-shuffled layout (``e2m1x8_shuffled_to_16bit_bits``): word i
    holds values 2i and 2i + 1, each times the scale ``factor``."""
    w = as_value(word)
    if not isinstance(w, Scalar) or w.dtype != dtypes.i32:
        raise CompileError(f"e2m1x8_shuffled_to_16bit_scaled takes a 32-bit word as an i32, got "
                           f"{getattr(w, 'dtype', w)}")
    if dtype.name not in _PACKED_MUL:
        raise CompileError(f"e2m1 converts to bf16 or f16 here, got {dtype.name}")
    return scale_16bit_pairs(e2m1x8_shuffled_to_16bit_bits(w, dtype.name), factor, dtype)




@traced
def scale_16bit_pairs(words: list, factor: Any, dtype: DType) -> list:
    """Each i32 word of two ``dtype`` (bf16 or f16) values times ``factor`` (a word holding one 16-bit factor twice),
    one packed multiply (``mul.rn.bf16x2`` / ``f16x2``) a word."""
    if dtype.name not in _PACKED_MUL:
        raise CompileError(f"packed 16-bit multiplies take bf16 or f16, got {dtype.name}")
    return [asm(f"{_PACKED_MUL[dtype.name]} $0, $1, $2;", [v, factor], dtypes.i32, side_effects=False) for v in words]


@traced
def e2m1x8_to_16bit_scaled(word: Any, factor: Any, dtype: DType) -> list:
    """Eight packed e2m1 values (an i32) times a scale, as four i32 words of two ``dtype`` (bf16 or f16) values:
    word i holds values i and i + 4 (``e2m1x8_to_16bit_bits``'s pairing), each multiplied by ``factor``, a word
    holding the same 16-bit factor twice (the first of ``e8m0_to_16bit_factors``; scales past 2 also need the
    second, by ``scale_16bit_pairs``). The product of the exact unscaled value and a power of two is exact wherever
    it is representable."""
    w = as_value(word)
    if not isinstance(w, Scalar) or w.dtype != dtypes.i32:
        raise CompileError(f"e2m1x8_to_16bit_scaled takes a 32-bit word as an i32, got {getattr(w, 'dtype', w)}")
    if dtype.name not in _PACKED_MUL:
        raise CompileError(f"e2m1 converts to bf16 or f16 here, got {dtype.name}")
    return scale_16bit_pairs(e2m1x8_to_16bit_bits(w, dtype.name), factor, dtype)


E8M0_SPLIT = 128  # the largest e8m0 byte whose factor e8m0_to_16bit_factors' first word holds alone
# the 16-bit types' (exponent bias, largest exponent field, mantissa bits)
_HALF_FORMAT = {"bf16": (127, 255, 7), "f16": (15, 31, 10)}


def e8m0_factor_bits(byte: Any, dtype_name: str, wide: bool = False) -> list:
    """``e8m0_to_16bit_factors``' integer operations on anything with integer operators and ``minimum`` /
    ``maximum`` (a traced i32 0..255, or Python ints to test them without a GPU): each factor's 16 bits, twice in a
    32-bit word. A factor 2^f is built as its exponent field f + bias clamped to [0, all ones]: all ones is inf (so
    a byte whose factor overflows poisons the output), 0 is zero (f16 factors below its subnormals: weights that
    round to zero in f16 anyway)."""
    bias, top, mantissa = _HALF_FORMAT[dtype_name]
    unit = E2M1_UNIT_EXPONENT[dtype_name]
    mn = minimum if not isinstance(byte, int) else min
    mx = maximum if not isinstance(byte, int) else max

    def power(exponent_plus_bias: Any) -> Any:  # 2^(field - bias) in both halves
        field = mn(mx(exponent_plus_bias, 0), top) << mantissa
        return field | (field << 16)
    if not wide:
        return [power(byte - 127 - unit + bias)]
    return [power(mn(byte, E8M0_SPLIT) - 127 - unit + bias), power(mx(byte, E8M0_SPLIT) - E8M0_SPLIT + bias)]


@traced
def e8m0_to_16bit_factors(byte: Any, dtype: DType, wide: bool = False) -> list:
    """The multipliers that turn ``e2m1x8_to_16bit_bits``' unscaled values into value * 2^(byte - 127) for an e8m0
    scale byte, as ``dtype`` (bf16 or f16) held twice in an i32 word (integer operations only:
    ``e8m0_factor_bits``). Without ``wide``: [2^(byte - 127 - E2M1_UNIT_EXPONENT)], exact for bytes up to 128
    (scales up to 2; bf16 from byte 0 on; f16 from 99 on, 0 below, where every f16 weight rounds to 0); past 128
    (and 0xFF, OCP's NaN) the factor is inf, which poisons the output rather than clamping it. ``wide``: [that factor
    for min(byte, 128), 2^(max(byte, 128) - 128)], whose product is exact for every byte up to 254 (bf16; f16 up to
    143, past which f16 weights overflow)."""
    if dtype.name not in E2M1_UNIT_EXPONENT:
        raise CompileError(f"e8m0 factors are bf16 or f16 here, got {dtype.name}")
    b = as_value(byte).to(dtypes.i32) & 0xFF
    return e8m0_factor_bits(b, dtype.name, wide)


@traced
def pair_halves(low: Any, high: Any) -> list:
    """Two 32-bit words of two 16-bit values each, regrouped (``prmt``): [low's low half | high's low half << 16,
    low's high half | high's high half << 16]. Turns 16-bit values in natural order (k, k+1), (k+4, k+5) into the
    pairs (k, k+4), (k+1, k+5) that ``e2m1x8_to_16bit_bits`` gives."""
    a, b = as_value(low), as_value(high)
    return [asm(f"prmt.b32 $0, $1, $2, {selector};", [a, b], dtypes.i32, side_effects=False)
            for selector in ("0x5410", "0x7632")]
