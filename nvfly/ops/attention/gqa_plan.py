"""Warpgroup-MMA GQA decode plans (``decode``'s default at 16 < Sq x G <= 128, fp8 past 32): 16-bit K and V of head
dim 128, the Sq x G query rows of one KV head (at most 64; 128 on two consumer warpgroups with ``wide``) as one wgmma
M = 64 each (pure Python, shared by the kernel's trace, the host and the CPU tests); fp8 (e4m3) K and V
(``GqaPlan.fp8``) converted to f16 tiles in shared memory for the same f16 wgmmas.

A CTA owns one (sequence, KV head, split): its Sq x G packed query rows (row r: query token r // G, head
hkv * G + r % G) and the split's keys, streamed in ``BLOCK_N`` = 64-key tiles of K and V through a ``stages``-deep
TMA ring, as the MLA kernel's (``mla_plan``; the split arithmetic is its ``split_blocks`` / ``unmasked_end``).
docs/ops/attention.md (decode, wgmma) explains the choices.
"""
from __future__ import annotations

from dataclasses import dataclass

from nvfly.ops.attention.mla_plan import BLOCK_N, mla_splits
from nvfly.ops.attention.plan import MAX_SPLITS, SMEM_PER_SM, SMEM_RESERVED

HEAD_DIM = 128              # Dqk = Dv
BLOCK_M = 64                # packed query rows of a CTA: one wgmma M
THREADS = 256               # a producer warpgroup and a consumer warpgroup (all of O's 128 columns)
CTAS_PER_SM = 2             # by registers (below) and shared memory (3 stages: 2 x 112 KB + the driver's 1 KB each)
PRODUCER_REGS = 40          # the producer issues TMA and reads the block table
CONSUMER_REGS = 216         # (40 + 216) * 128 = 32768: two CTAs an SM
STAGES = 3                  # 3 x 32 KB of K and V in flight a CTA, 192 KB an SM
# two consumer warpgroups (GqaPlan.consumers 2: 65-128 rows, 384 threads): one CTA an SM, by registers
# ((40 + 2 x 232) x 128 = 64512) and shared memory (Q 32 KB + 5 stages of 32 KB: 160 KB of K and V in flight an SM)
WIDE_CONSUMER_REGS = 232
WIDE_STAGES = 5
SWIZZLE = 128
BOX_COLUMNS = SWIZZLE // 2  # 16-bit columns of a 128-byte swizzle row: one TMA box's width
BOX_BYTES = BLOCK_N * SWIZZLE
# dynamic shared memory: the 1024-byte aligned tiles (128-byte swizzle atoms), Q's then the ring's, then the
# barriers (Q's, then the ring's: 2 full and 1 empty a stage), so that two CTAs of 3 stages fit an SM with room
Q_BYTES = BLOCK_M * HEAD_DIM * 2
K_BYTES = BLOCK_N * HEAD_DIM * 2
STAGE_BYTES = 2 * K_BYTES   # K's tile, then V's
Q_OFFSET = 0
# fp8 (GqaPlan.fp8): a stage holds K's and V's 64 keys x 128 bytes (one 128-byte swizzled TMA box each); the consumer
# converts them to f16 tiles laid out as a 16-bit stage's (the staging, after Q's tile) for the same wgmmas. 4 stages:
# Q 16 KB + staging 32 KB + 64 KB of fp8 K and V a CTA (112 KB), two CTAs an SM: 128 KB of cache bytes in flight an
# SM (the 16-bit plans': 192 KB)
FP8_TILE_BYTES = BLOCK_N * HEAD_DIM
FP8_STAGE_BYTES = 2 * FP8_TILE_BYTES
FP8_STAGES = 4
# two consumer warpgroups (one CTA an SM): Q 32 KB + staging 32 KB + 8 stages of 16 KB, the same 128 KB in flight
FP8_WIDE_STAGES = 8
STAGING_BYTES = STAGE_BYTES


@dataclass(frozen=True)
class GqaPlan:
    """What the warpgroup-MMA GQA decode kernel is compiled for (its Constexpr) and how it is launched.

    sq: query tokens per sequence; group: query heads per KV head (G; Sq x G <= 64 rows); paged/page_size: K and V
    through a block table of pages of ``page_size`` tokens (a multiple of BLOCK_N); causal: queries aligned to the
    end of their sequence; splits: CTAs sharing one sequence's keys (> 1: the combine kernel merges their
    partials); stages: the ring's depth; pdl_combine (splits > 1): the combine kernel is a programmatic dependent
    launch (as ``DecodePlan.pdl_combine``: its launch hides behind the split grid); fp8: e4m3 K and V, converted to
    f16 in shared memory (``FP8_STAGE_BYTES`` stages, the f16 staging tiles; with two consumers both convert)."""
    sq: int
    group: int
    paged: bool
    page_size: int
    causal: bool
    splits: int = 1
    stages: int = STAGES
    pdl_combine: bool = False
    consumers: int = 1
    fp8: bool = False

    @property
    def rows(self) -> int:
        return self.sq * self.group

    @property
    def threads(self) -> int:
        """A producer warpgroup and ``consumers`` consumer warpgroups, each owning 64 packed rows."""
        return 128 * (1 + self.consumers)

    @property
    def ctas_per_sm(self) -> int:
        return CTAS_PER_SM if self.consumers == 1 else 1

    @property
    def consumer_regs(self) -> int:
        return CONSUMER_REGS if self.consumers == 1 else WIDE_CONSUMER_REGS

    @property
    def q_bytes(self) -> int:
        return self.consumers * Q_BYTES

    @property
    def stage_bytes(self) -> int:
        return FP8_STAGE_BYTES if self.fp8 else STAGE_BYTES

    @property
    def staging_offset(self) -> int:
        """fp8: the f16 K and V tiles the consumer converts a stage into (1024-byte aligned, after Q's)."""
        return Q_OFFSET + self.q_bytes

    @property
    def ring_offset(self) -> int:
        return self.staging_offset + (STAGING_BYTES if self.fp8 else 0)

    @property
    def barrier_offset(self) -> int:
        return self.ring_offset + self.stages * self.stage_bytes

    @property
    def barriers(self) -> int:
        """mbarriers: Q's, then the ring's (a full barrier for K and one for V, and an empty one, a stage)."""
        return 1 + 3 * self.stages

    @property
    def smem_bytes(self) -> int:
        return self.barrier_offset + 8 * self.barriers

    def grid(self, batch: int, kv_heads: int) -> tuple[int, int, int]:
        """(splits, KV heads, batch)."""
        return self.splits, kv_heads, batch


def gqa_declined(sq: int, group: int, dqk: int, dv: int, dtype: str, fp8: bool = False, mods: bool = False,
                 paged: bool = False, page_size: int = 0, wide: bool = False) -> str:
    """Why the wgmma GQA kernel cannot compute a decode call ('' when it can): it has code for 16-bit K and V of
    head dim 128 (or fp8 ones), at most 64 packed query rows (128 with ``wide``: two consumer warpgroups), pages of
    a multiple of 64 tokens, and no mods or block masks; ``dtype``: q's."""
    if dtype not in ("torch.bfloat16", "torch.float16"):
        return f"dtype {dtype}: the wgmma GQA kernel takes bfloat16 or float16"
    if dqk != HEAD_DIM or dv != HEAD_DIM:
        return f"head dims {dqk}/{dv}: the wgmma GQA kernel takes Dqk = Dv = {HEAD_DIM}"
    if sq * group > (2 if wide else 1) * BLOCK_M:
        return (f"Sq x G = {sq * group} query rows, more than the {BLOCK_M} of one wgmma M" if not wide else
                f"Sq x G = {sq * group} query rows, more than the {2 * BLOCK_M} of two consumer warpgroups")
    if mods:
        return "score_mod / mask_mod / block_mask: the wgmma GQA kernel has no code for mods"
    if paged and page_size % BLOCK_N:
        return f"page size {page_size}: the wgmma GQA kernel reads pages of a multiple of {BLOCK_N} tokens"
    return ""


# The rows above which the wgmma kernel is decode's default where gqa_declined accepts: at <= 16 rows the decode
# kernel's one m16 row tile wastes no MMA rows and is as fast; above, it rereads each K/V tile per 16-row tile
DEFAULT_ABOVE_ROWS = 16
# fp8 caches: the fp8 plans' shared-memory conversion holds them near 2.8 TB/s whatever the rows; the decode kernel's
# register conversion is faster up to 32 rows (one or two row warps a key slice) and slower past
FP8_DEFAULT_ABOVE_ROWS = 32


def gqa_by_default(sq: int, group: int, fp8: bool = False) -> bool:
    """Whether ``decode`` runs a call of Sq x G packed rows on the wgmma kernel without being asked (where
    ``gqa_declined`` accepts it): above ``DEFAULT_ABOVE_ROWS`` rows (``FP8_DEFAULT_ABOVE_ROWS`` with fp8 caches)."""
    return sq * group > (FP8_DEFAULT_ABOVE_ROWS if fp8 else DEFAULT_ABOVE_ROWS)


def gqa_plan(batch: int, sq: int, kv_heads: int, group: int, capacity: int, sm_count: int, paged: bool = False,
             page_size: int = 0, causal: bool = True, splits: int = 0, stages: int = 0,
             pdl_combine: bool = False, wide: bool = False, fp8: bool = False) -> GqaPlan:
    """The plan for one call shape: ``mla_splits``'s count over the plan's CTAs an SM and the cache's capacity
    in 64-key tiles (``splits`` > 0 forces one); ``stages`` > 0 forces the ring depth; ``pdl_combine``: where the
    plan splits, the combine as a programmatic dependent launch; ``wide``: more than 64 rows (at most 128) on two
    consumer warpgroups (``GqaPlan.consumers``); ``fp8``: e4m3 K and V (``FP8_STAGES`` deep, ``FP8_WIDE_STAGES``
    with two consumers)."""
    declined = gqa_declined(sq, group, HEAD_DIM, HEAD_DIM, "torch.bfloat16", fp8=fp8, paged=paged,
                            page_size=page_size, wide=wide)
    if declined:
        raise ValueError("gqa_plan: " + declined)
    consumers = 2 if sq * group > BLOCK_M else 1
    ctas_per_sm = CTAS_PER_SM if consumers == 1 else 1
    if splits <= 0:
        splits = mla_splits(batch * kv_heads, sm_count * ctas_per_sm, -(-capacity // BLOCK_N))
    splits = max(1, min(splits, MAX_SPLITS))
    default_stages = ((FP8_STAGES, FP8_WIDE_STAGES) if fp8 else (STAGES, WIDE_STAGES))[consumers - 1]
    plan = GqaPlan(sq, group, paged, page_size if paged else 0, causal, splits, stages or default_stages,
                   pdl_combine and splits > 1, consumers, fp8)
    if plan.ctas_per_sm * (plan.smem_bytes + SMEM_RESERVED) > SMEM_PER_SM:
        raise ValueError(f"gqa_plan: {plan.stages} stages ({plan.smem_bytes} bytes of shared memory) do not fit "
                         f"{plan.ctas_per_sm} CTAs an SM")
    return plan


__all__ = ["BLOCK_M", "BLOCK_N", "DEFAULT_ABOVE_ROWS", "FP8_DEFAULT_ABOVE_ROWS", "HEAD_DIM", "GqaPlan",
           "gqa_by_default", "gqa_declined", "gqa_plan"]
