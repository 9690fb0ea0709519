"""RMSNorm's cache hints: which ``nvfly.arch.memory.CacheHint`` each access of the forward's kernels gets
(``row_hints``, ``two_pass_hints``) for ``RowPlan.cache_hints``; the hinted accesses themselves are
``nvfly.arch.memory.load_hinted`` / ``store_hinted``.
"""
from __future__ import annotations

from typing import Any, Optional

from nvfly.arch.memory import CacheHint, L1Eviction, L2Policy, create_policy
from nvfly.ops.rmsnorm.plan import LOAD_HINTS

# x, the residual and both outputs are touched once, so they skip L1 and leave L2 first; the weight, read for every
# row, is kept in both (Inductor's kernel loads its weight evict_last).
STREAM_L1 = L1Eviction.NO_ALLOCATE
KEEP_L1 = L1Eviction.EVICT_LAST


def row_hints(CACHE_HINTS: Any) -> tuple[Optional[CacheHint], Optional[CacheHint], Optional[CacheHint]]:
    """(hint for the streamed rows' loads, for the weight, for the stores): none (False), all three (True), or the
    loads' only (LOAD_HINTS: the stores plain, as Inductor's)."""
    if not CACHE_HINTS:
        return None, None, None
    stream = CacheHint(STREAM_L1, create_policy(L2Policy.EVICT_FIRST))
    return stream, CacheHint(KEEP_L1, create_policy(L2Policy.EVICT_LAST)), None if CACHE_HINTS == LOAD_HINTS else stream


# The two-pass kernel: the first pass keeps x's (and the residual's) lines in L1 for the second, which reads them
# for the last time. In L2 the first read stays normal: a second read that hits L1 never reaches L2 to lower an
# evict_last line again. The weight and the outputs as in row_hints.
FIRST_READ = L1Eviction.EVICT_LAST
LAST_READ = L1Eviction.EVICT_FIRST


def two_pass_hints(CACHE_HINTS: Any) -> tuple[Optional[CacheHint], Optional[CacheHint], Optional[CacheHint],
                                              Optional[CacheHint]]:
    """(first read, last read, weight, stores) hints, or four Nones. With LOAD_HINTS, Inductor's: the first read
    also kept in L2 (evict_last), the stores plain."""
    if not CACHE_HINTS:
        return None, None, None, None
    drop = create_policy(L2Policy.EVICT_FIRST)
    if CACHE_HINTS == LOAD_HINTS:
        keep = create_policy(L2Policy.EVICT_LAST)
        return CacheHint(FIRST_READ, keep), CacheHint(LAST_READ, drop), CacheHint(KEEP_L1, keep), None
    return (CacheHint(FIRST_READ, create_policy(L2Policy.EVICT_NORMAL)), CacheHint(LAST_READ, drop),
            CacheHint(KEEP_L1, create_policy(L2Policy.EVICT_LAST)), CacheHint(STREAM_L1, drop))
