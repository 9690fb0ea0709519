"""MLA decode plans (DeepSeek-V2/V3's latent cache): the tile, the shared memory and the split-KV count (pure Python,
shared by the kernel's trace, the host and the CPU tests).

One latent KV head of ``DQK`` = 576 columns whose first ``DV`` = 512 are V. A CTA owns ``BLOCK_M`` = 64 packed query
rows (query token r // Hq, head r % Hq: wgmma's M) of one sequence and one split of its keys, and streams the keys in
``BLOCK_N`` = 64-key tiles of 576 columns through a ``STAGES``-deep TMA ring; V is the same tile's first 512 columns.
docs/ops/attention.md (MLA) explains the choices.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from nvfly.ops.attention.plan import MAX_SPLITS, MAX_SQ

DQK = 576                   # the latent (512) and the rotary part (64)
DV = 512                    # V: the latent's first 512 columns
BLOCK_M = 64                # packed query rows of a CTA: one wgmma M
BLOCK_N = 64                # keys of a ring stage: one TMA box of rows (and a page of 64 holds exactly one)
STAGES = 2                  # 2 x 72 KB of keys in flight beside the 72 KB query tile
THREADS = 384               # a producer warpgroup and two consumer warpgroups (each 256 of O's 512 columns)
PRODUCER_REGS = 40          # the producer issues TMA and reads the block table
CONSUMER_REGS = 232         # 40 * 128 + 232 * 256 = 64512 of the SM's 65536 registers
SWIZZLE = 128
BOXES = DQK // (SWIZZLE // 2)  # 9 TMA boxes of 64 columns (one 128-byte swizzle row) a tile
BOX_BYTES = BLOCK_N * SWIZZLE
MAX_SMEM = 227 * 1024       # one CTA's opt-in limit on H100/H200

# dynamic shared memory, in bytes: barriers (Q's, then the ring's: at most BOXES full and one empty a stage), then
# 1024-byte aligned tiles (128-byte swizzle atoms need it)
BARRIER_BYTES = 1024
Q_BYTES = BLOCK_M * DQK * 2
STAGE_BYTES = BLOCK_N * DQK * 2
P_BYTES = BLOCK_M * BLOCK_N * 2
Q_OFFSET = BARRIER_BYTES
RING_OFFSET = Q_OFFSET + Q_BYTES
P_OFFSET = RING_OFFSET + STAGES * STAGE_BYTES
RESCALE_OFFSET = P_OFFSET + P_BYTES      # f32 per row: the block's O rescale, softmax warpgroup -> value warpgroup
FINAL_OFFSET = RESCALE_OFFSET + BLOCK_M * 4  # f32 per row: 1 / l at the end
SMEM_BYTES = FINAL_OFFSET + BLOCK_M * 4


@dataclass(frozen=True)
class MlaPlan:
    """What the MLA decode kernel is compiled for (its Constexpr) and how it is launched.

    sq: query tokens per sequence; heads: query heads (Hq; the rows are Sq x Hq packed); paged/page_size: keys
    through a block table of pages of ``page_size`` tokens (a multiple of BLOCK_N); causal: queries aligned to the
    end of their sequence; splits: CTAs sharing one sequence's keys (1: no combine); chunked: a full barrier per
    64-column box of a ring stage (the scores' wgmma start on a tile's first box, as FlashMLA's) rather than one a
    stage; evict_first: the key tiles' TMA loads carry an L2 evict-first hint; pdl_combine (splits > 1): the
    combine kernel is a programmatic dependent launch (as ``DecodePlan.pdl_combine``)."""
    sq: int
    heads: int
    paged: bool
    page_size: int
    causal: bool
    splits: int = 1
    chunked: bool = True
    evict_first: bool = False
    pdl_combine: bool = False

    @property
    def full_barriers(self) -> int:
        """Full barriers a ring stage: one a box when chunked."""
        return BOXES if self.chunked else 1

    @property
    def rows(self) -> int:
        return self.sq * self.heads

    @property
    def m_blocks(self) -> int:
        """CTAs per sequence and split: they read the same keys, one from DRAM and the others mostly from L2."""
        return -(-self.rows // BLOCK_M)

    def grid(self, batch: int) -> tuple[int, int]:
        """(splits x row blocks, batch): the row blocks of one split are neighbours, so they run together and
        share the keys in L2."""
        return self.splits * self.m_blocks, batch


def mla_plan(batch: int, sq: int, heads: int, capacity: int, sm_count: int, paged: bool = False,
             page_size: int = 0, causal: bool = True, splits: int = 0, chunked: Optional[bool] = None,
             evict_first: Optional[bool] = None, pdl_combine: Optional[bool] = None) -> MlaPlan:
    """The plan for one call shape: ``mla_splits`` over one CTA an SM (the kernel takes 225 KB of shared memory) and
    the cache's capacity in 64-key tiles; ``splits`` > 0 forces a count; ``chunked``, ``evict_first`` and
    ``pdl_combine`` (None: the defaults; pdl_combine only where the plan splits) choose the kernel's variant."""
    plan = MlaPlan(sq, heads, paged, page_size if paged else 0, causal)
    if splits <= 0:
        splits = mla_splits(batch * plan.m_blocks, sm_count, -(-capacity // BLOCK_N))
    splits = max(1, min(splits, MAX_SPLITS))
    options = {name: value for name, value in (("chunked", chunked), ("evict_first", evict_first),
                                               ("pdl_combine", pdl_combine and splits > 1 or None))
               if value is not None}
    return replace(plan, splits=splits, **options)


def mla_splits(ctas: int, slots: int, n_blocks: int) -> int:
    """The split count of the least modelled time: waves x (tiles of the longest split + 1 for the CTA's Q tile and
    pipeline fill + 1 for its partial's write and combine when split), the fewest splits among equals. Each CTA's
    tiles are long (72 KB, 4.5 M MACs at 128 heads), so the longest split's whole tiles decide the time where FA3's
    wave efficiency alone does not: at B 1, 128 heads, 32K keys it takes 64 splits of 8 tiles (128 of the 132 SMs)
    over 57 of 9."""
    def cost(splits: int) -> int:
        waves = -(-ctas * splits // slots)
        return waves * (-(-n_blocks // splits) + 1 + (splits > 1))
    return min(range(1, max(1, min(MAX_SPLITS, slots, n_blocks)) + 1), key=lambda s: (cost(s), s))


def split_blocks(seqlen: int, splits: int, split: int) -> tuple[int, int]:
    """The key tiles [begin, end) of split ``split`` of a sequence of ``seqlen`` keys (the kernel's arithmetic)."""
    n_blocks = -(-seqlen // BLOCK_N)
    per_split = -(-n_blocks // splits)
    begin = split * per_split
    return begin, max(begin, min(begin + per_split, n_blocks))


def unmasked_end(seqlen: int, sq: int, causal: bool, maximum=max) -> int:
    """Tiles before this index keep every key for every query row (no mask code); later ones are masked: the tail
    tile past the sequence and, causally, the keys after the first query's position seqlen - Sq."""
    visible = seqlen - (sq - 1 if causal else 0)  # keys the first query token sees
    return maximum(visible, 0) // BLOCK_N


__all__ = ["BLOCK_M", "BLOCK_N", "DQK", "DV", "MAX_SQ", "MlaPlan", "mla_plan", "mla_splits", "split_blocks",
           "unmasked_end"]
