"""The order of a TopK: every element's u32 order key and unique 64-bit rank, and the flags of the streaming filter.

``key`` is the value's bits made monotone (so -0.0 ranks below +0.0, like torch's radix select), NaN (any payload)
above +inf, as in torch on CUDA; ``largest=False`` inverts the key, so NaNs then come last. The rank,
``(key << 32) | ~index`` (the top bit flipped so that signed compares order it), is unique: the k largest ranks in
decreasing order are the output, equal values listed lowest index first. Every kernel (``warp``, ``stream``,
``row``) ranks with these.
"""
from __future__ import annotations

from typing import Any

import nvfly

ABSENT = -(1 << 63)       # the rank of "no element": below every real rank (a real ~index is never 0)
NAN_ABOVE = {"f32": 0x7F800000, "bf16": 0x7F80, "f16": 0x7C00}  # |bits| above this: NaN
_KEY_MSB = 0x80000000


# ---------------------------------------------------------------------------------------------- ranks
@nvfly.func
def value_bits(value):
    """The bits of a bf16/f16/f32 value as a u32 (16-bit floats in the low half)."""
    if value.dtype == nvfly.f32:
        return value.bitcast(nvfly.u32)
    return (value.bitcast(nvfly.i16).to(nvfly.i32) & 0xFFFF).bitcast(nvfly.u32)


@nvfly.func
def bits_key(bits, dtype, LARGEST):
    """``order_key`` of the value with these bits (``value_bits``) and dtype."""
    if dtype == nvfly.f32:
        sign_fill = (bits.bitcast(nvfly.i32) >> 31).bitcast(nvfly.u32)
        key = bits ^ (sign_fill | _KEY_MSB)
        key = nvfly.select((bits & 0x7FFFFFFF) > NAN_ABOVE["f32"], 0xFFFFFFFF, key)
        inverted = 0xFFFFFFFF
    else:
        key = bits ^ (((bits >> 15) * 0x7FFF) | 0x8000)
        key = nvfly.select((bits & 0x7FFF) > NAN_ABOVE[dtype.name], 0xFFFF, key)
        inverted = 0xFFFF
    if not LARGEST:
        key = key ^ inverted
    return key


@nvfly.func
def order_key(value, LARGEST):
    """The u32 key of a bf16/f16/f32 value: larger key = earlier in the output (NaN first when LARGEST)."""
    return bits_key(value_bits(value), value.dtype, LARGEST)


@nvfly.func
def rank64(key, index):
    """The unique signed 64-bit rank of (key, index): ``(key << 32) | ~index`` with the top bit flipped, so
    that signed comparisons order ranks like the unsigned values."""
    high = (key ^ _KEY_MSB).bitcast(nvfly.i32).to(nvfly.i64) << 32
    return high | (~index).bitcast(nvfly.u32).to(nvfly.i64)


@nvfly.func
def rank_index(rank):
    """The index encoded in a 64-bit rank."""
    return ~rank.to(nvfly.i32)


@nvfly.func
def rank_key(rank):
    """The u32 key of a 64-bit rank (``rank64``'s inverse for the high half)."""
    return ((rank >> 32).to(nvfly.i32) ^ _KEY_MSB).bitcast(nvfly.u32)


# ---------------------------------------------------------------------------------------------- keys back to values
@nvfly.func
def key_bits(key, dtype, LARGEST):
    """The bits (u32; 16-bit floats in the low half) of the value whose order key is ``key`` (``order_key``'s
    inverse; NaN for the NaN key and for key 0, the key of ABSENT)."""
    if not LARGEST:
        key = key ^ (0xFFFFFFFF if dtype == nvfly.f32 else 0xFFFF)
    if dtype == nvfly.f32:
        return nvfly.select((key & _KEY_MSB) != 0, key ^ _KEY_MSB, ~key)
    return nvfly.select((key & 0x8000) != 0, key ^ 0x8000, key ^ 0xFFFF)


# ---------------------------------------------------------------------------------------------- the stream's flags
_ZERO_BELOW = {"f32": 0x7FFFFFFF, "bf16": 0x7FFF, "f16": 0x7FFF}  # key of the zero ranked lower (-0.0 when largest)


@nvfly.func
def flag_key(threshold_key, ties, dtype):
    """The key whose value flags elements: every element that ranks at or above a threshold with key
    ``threshold_key`` compares above that value as a float (below it when smallest) or is unordered with it.
    ``ties``: an element with the threshold's key may rank above it (a lower index), so one key lower; the
    lower-ranked zero one key lower again (-0.0 < +0.0 as keys, not as floats). Key 0 (NaN) flags everything."""
    flag = threshold_key - nvfly.select(ties & (threshold_key != 0), 1, 0).bitcast(nvfly.u32)
    return flag - nvfly.select(flag == _ZERO_BELOW[dtype.name], 1, 0).bitcast(nvfly.u32)


def flag_bit(u: int, e: int, vec: int, packed: bool) -> int:
    """The bit of a thread's per-iteration flags that stands for element ``e`` of its load ``u``. Packed (16-bit
    values compared two to a u32 word): word w = u * vec/2 + e/2 takes bit w for its low half, w + 16 for its
    high half (so one AND of the compare's 0xFFFF halves with 0x00010001 << w places both)."""
    if packed:
        return u * (vec // 2) + e // 2 + 16 * (e % 2)
    return u * vec + e


def flag_element(bit: Any, vec: int, packed: bool) -> tuple[Any, Any]:
    """(u, e) of a flag bit: ``flag_bit``'s inverse (Python ints or traced i32)."""
    if packed:
        words_log2 = (vec // 2).bit_length() - 1
        word = bit & 15
        return word >> words_log2, ((word & (vec // 2 - 1)) << 1) | (bit >> 4)
    vec_log2 = vec.bit_length() - 1
    return bit >> vec_log2, bit & (vec - 1)
