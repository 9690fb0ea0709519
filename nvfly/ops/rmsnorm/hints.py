"""RMSNorm's reductions and cache-hinted accesses: the device building blocks its kernels share.

Kept together, apart from the kernels, because shared versions (nvfly/arch) are to replace them: the reductions
(``group_sum``, ``block_sum``), the cache-hinted vector accesses (``cache_policy``, ``load_vector``,
``store_vector``) and the hint choices of the forward's kernels (``row_hints``, ``two_pass_hints``).
"""
from __future__ import annotations

from typing import Any, Optional

import nvfly
from nvfly.arch.ptx import asm, asm_multi
from nvfly.ops.rmsnorm.plan import LOAD_HINTS


# ---------------------------------------------------------------------------------------------- reductions
@nvfly.func
def group_sum(value, scratch, base, group, warp, lane, GROUP):
    """Sum ``value`` over the GROUP threads of a row (shuffles; for GROUP > 32 also shared memory).

    Every thread of the block must call it (it holds a barrier when GROUP > 32); it uses the f32 slots
    ``scratch[base : base + threads // 32]``.
    """
    if GROUP <= 32:
        total = nvfly.warp_reduce(value, "add", GROUP)
    else:
        value = nvfly.warp_reduce(value, "add")
        if lane == 0:
            scratch[base + warp] = value
        nvfly.syncthreads()
        first = base + group * (GROUP // 32)
        total = scratch[first]
        for w in nvfly.static_range(1, GROUP // 32):
            total = total + scratch[first + w]
    return total


@nvfly.func
def block_sum(value, scratch, THREADS):
    """Sum ``value`` over the block; every thread gets the total (one barrier: each warp sums the warps' partial
    sums from ``scratch``, THREADS // 32 f32 slots, with shuffles over the next power of two of lanes, the lanes
    past the last warp adding zero)."""
    warps = THREADS // 32
    width = 1 << (warps - 1).bit_length()
    tid = nvfly.thread_idx.x
    lane = tid & 31
    value = nvfly.warp_reduce(value, "add")
    if lane == 0:
        scratch[tid >> 5] = value
    nvfly.syncthreads()
    slot = lane & (width - 1)
    if warps == width:
        return nvfly.warp_reduce(scratch[slot], "add", width)
    return nvfly.warp_reduce(nvfly.select(slot < warps, scratch[nvfly.minimum(slot, warps - 1)], 0.0), "add", width)


# ---------------------------------------------------------------------------------------------- cache-hinted accesses
def cache_policy(priority: str) -> Any:
    """An L2 eviction policy (``evict_first``, ``evict_normal`` or ``evict_last``) for every access it is given
    to."""
    return asm(f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", result=nvfly.i64, side_effects=False)


# Cache hints (RowPlan.cache_hints): x, the residual and both outputs are touched once, so they skip L1 and leave
# L2 first; the weight, read for every row, is kept in both (Inductor's kernel loads its weight evict_last).
STREAM_L1 = "L1::no_allocate"
KEEP_L1 = "L1::evict_last"


def load_vector(t: Any, coord: tuple, width: int, mask: Any, hint: Optional[tuple]) -> Any:
    """``t.load(*coord, width=width, mask=mask)``; with ``hint`` = (L1 eviction qualifier, L2 policy) and a
    16- or 8-byte vector, one cache-hinted ld.global instead (zeros where ``mask`` is false: nothing is read)."""
    words = width * t.dtype.itemsize // 4
    if hint is None or words not in (2, 4):
        return t.load(*coord, width=width, mask=mask)
    l1, policy = hint
    outs = ", ".join(f"${i}" for i in range(words))
    load = f"ld.global.{l1}.L2::cache_hint.v{words}.u32 {{{outs}}}, [${words}], ${words + 1};"
    if mask is None:
        loaded = asm_multi(load, [nvfly.i32] * words, [t.address(*coord), policy], side_effects=False)
    else:
        predicated = load.replace(f"[${words}], ${words + 1}", f"[${words + 1}], ${words + 2}")
        zeros = " ".join(f"mov.b32 ${i}, 0;" for i in range(words))
        loaded = asm_multi(f"{{ .reg .pred p; setp.ne.b32 p, ${words}, 0; {zeros} @p {predicated} }}",
                           [nvfly.i32] * words, [mask.to(nvfly.i32), t.address(*coord), policy], side_effects=False)
    return nvfly.make_vector(loaded, nvfly.i32).bitcast(t.dtype)


def store_vector(t: Any, value: Any, coord: tuple, width: int, mask: Any, hint: Optional[tuple]) -> None:
    """``t.store(value, *coord, mask=mask)`` of ``width`` elements; with ``hint`` and a 16- or 8-byte vector, one
    cache-hinted st.global."""
    value = value.to(t.dtype)
    words = width * t.dtype.itemsize // 4
    if hint is None or words not in (2, 4):
        t.store(value, *coord, mask=mask)
        return
    l1, policy = hint
    parts = value.bitcast(nvfly.i32).tolist()

    def store(first: int) -> str:  # operand ``first`` is the address, then the words, then the policy
        ins = ", ".join(f"${first + 1 + i}" for i in range(words))
        return f"st.global.{l1}.L2::cache_hint.v{words}.u32 [${first}], {{{ins}}}, ${first + 1 + words};"
    if mask is None:
        asm(store(0), [t.address(*coord), *parts, policy])
    else:
        asm(f"{{ .reg .pred p; setp.ne.b32 p, $0, 0; @p {store(1)} }}",
            [mask.to(nvfly.i32), t.address(*coord), *parts, policy])


# ---------------------------------------------------------------------------------------------- the kernels' hints
def row_hints(CACHE_HINTS: Any) -> tuple[Optional[tuple], Optional[tuple], Optional[tuple]]:
    """(hint for the streamed rows' loads, for the weight, for the stores) of ``load_vector``/``store_vector``:
    none (False), all three (True), or the loads' only (LOAD_HINTS: the stores plain, as Inductor's)."""
    if not CACHE_HINTS:
        return None, None, None
    stream = (STREAM_L1, cache_policy("evict_first"))
    return stream, (KEEP_L1, cache_policy("evict_last")), None if CACHE_HINTS == LOAD_HINTS else stream


# Cache hints of the two-pass kernel (RowPlan.cache_hints): the first pass keeps x's (and the residual's) lines
# in L1 for the second, which reads them for the last time. In L2 the first read stays normal: a second read that
# hits L1 never reaches L2 to lower an evict_last line again. The weight and the outputs as in row_hints.
FIRST_READ = "L1::evict_last"
LAST_READ = "L1::evict_first"


def two_pass_hints(CACHE_HINTS: Any) -> tuple[Optional[tuple], Optional[tuple], Optional[tuple], Optional[tuple]]:
    """(first read, last read, weight, stores) hints of ``load_vector``/``store_vector``, or four Nones. With
    LOAD_HINTS, Inductor's: the first read also kept in L2 (evict_last), the stores plain."""
    if not CACHE_HINTS:
        return None, None, None, None
    drop = cache_policy("evict_first")
    if CACHE_HINTS == LOAD_HINTS:
        keep = cache_policy("evict_last")
        return (FIRST_READ, keep), (LAST_READ, drop), (KEEP_L1, keep), None
    return ((FIRST_READ, cache_policy("evict_normal")), (LAST_READ, drop), (KEEP_L1, cache_policy("evict_last")),
            (STREAM_L1, drop))
