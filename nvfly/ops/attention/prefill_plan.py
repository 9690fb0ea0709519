"""Prefill attention plans: the tile, the ring and the launch grid, and the causal tile arithmetic (pure Python,
shared by the kernel's trace and the CPU model in the tests).

A CTA owns ``block_m`` query rows of one (batch, query head): ``consumers`` = block_m / 64 consumer warpgroups of
64 rows each, and a producer warpgroup whose one thread TMA-loads Q once and K and V block by block (``block_n``
keys) into two ``stages``-deep mbarrier rings. docs/ops/attention.md explains the choices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# (Dqk, Dv) pairs, whole 128-byte swizzle rows, and the keys of a ring stage for each Dqk. S is 64 x block_n f32 a
# warpgroup (block_n / 2 registers a thread), O 64 x Dv (Dv / 2): 128 keys up to Dqk 192 (DeepSeek's 192/128:
# 209 KB of shared memory), 80 at 256 (FlashAttention-3's tile: 225 KB, under the 227 KB a CTA may have)
HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
BLOCK_N = {64: 128, 128: 128, 192: 128, 256: 80}
BLOCK_M = 128               # two consumer warpgroups of 64 rows (wgmma's M)
MAX_SMEM = 227 * 1024       # one CTA's opt-in limit on H100/H200
STAGES = 2                  # K and V rings each; FA3 uses 2 (the loads run a whole block ahead of the math)
PRODUCER_REGS = 24          # the producer only issues TMA
CONSUMER_REGS = 240         # 24 * 128 + 240 * 256 = 64512 of the SM's 65536 registers
BARRIER_BYTES = 1024        # barriers first; the tiles start 1024-byte aligned (128-byte swizzle atoms need it)
SWIZZLE = 128


@dataclass(frozen=True)
class PrefillPlan:
    """What the prefill kernel is compiled for (its Constexpr) and how it is launched.

    dqk, dv: head dims; causal: a key is masked past its query's position plus the runtime causal offset
    (Skv - Sq bottom-right aligned, 0 top-left); block_m, block_n: query rows of a CTA and keys of a ring stage;
    stages: depth of each of the K and V rings."""
    dqk: int
    dv: int
    causal: bool
    block_m: int = BLOCK_M
    block_n: int = 128
    stages: int = STAGES

    @property
    def consumers(self) -> int:
        return self.block_m // 64

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    def q_bytes(self, itemsize: int) -> int:
        return self.block_m * self.dqk * itemsize

    def k_stage_bytes(self, itemsize: int) -> int:
        return self.block_n * self.dqk * itemsize

    def v_stage_bytes(self, itemsize: int) -> int:
        return self.block_n * self.dv * itemsize

    def smem_bytes(self, itemsize: int) -> int:
        return BARRIER_BYTES + self.q_bytes(itemsize) + self.stages * (self.k_stage_bytes(itemsize)
                                                                       + self.v_stage_bytes(itemsize))

    def grid(self, batch: int, heads: int, sq: int) -> tuple[int, int, int]:
        """(query tiles, query heads, batch)."""
        return (-(-sq // self.block_m), heads, batch)


def prefill_plan(dqk: int, dv: int, causal: bool) -> PrefillPlan:
    """The plan of a supported (Dqk, Dv) pair (``HEAD_DIMS``)."""
    return PrefillPlan(dqk, dv, causal, block_n=BLOCK_N[dqk])


def causal_offset(sq: int, skv: int, alignment: str) -> int:
    """What is added to a query's index to get the last key it sees: bottom-right alignment puts the last query on
    the last key (flash-attn's convention, and decode's), top-left the first query on the first key (torch SDPA's
    is_causal)."""
    return skv - sq if alignment == "bottom_right" else 0


def key_blocks(m_block: Any, skv: Any, causal: bool, offset: Any, block_m: int, block_n: int,
               minimum: Callable[[Any, Any], Any] = min, maximum: Callable[[Any, Any], Any] = max) -> tuple[Any, Any]:
    """(unmasked, total) key blocks of query tile ``m_block``: blocks [0, unmasked) are fully visible to every row
    of the tile and need no mask; [unmasked, total) are evaluated with the mask (the sequence's tail block, and
    causal blocks crossing the diagonal); blocks from total on are fully masked and never loaded. The kernel calls
    it on traced values with ``nvfly.minimum``/``nvfly.maximum`` (floor divisions of non-negative values only)."""
    blocks = (skv + block_n - 1) // block_n
    whole = skv // block_n  # blocks without a tail
    if not causal:
        return whole, blocks
    last_key = m_block * block_m + block_m - 1 + offset  # the last key the tile's last row sees
    total = minimum(blocks, (maximum(last_key + 1, 0) + block_n - 1) // block_n)
    first_last_key = m_block * block_m + offset  # the last key the tile's first row sees
    unmasked = minimum(minimum(whole, maximum(first_last_key + 1, 0) // block_n), total)
    return unmasked, total
