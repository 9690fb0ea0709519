"""Decode attention plans: the tile, the shared-memory ring and the split-KV count, chosen per shape (pure Python).

A CTA of ``WARPS`` warps owns one (batch, KV head, query tile, KV split); the query tile's rows are the Sq x G query
rows (query token, head in the group) that share the KV head, so K and V are read once for all of them. Every stage
of the ring holds ``BLOCK_N`` keys of K and V in 16-key slices. The warps are ``row_warps`` x ``key_warps``: a warp
owns 16 rows of the tile and every key_warps-th slice of each stage, with its own online softmax; the warps sharing
rows merge at the end. docs/ops/attention.md explains the choices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

WARPS = 4                  # 4 sub-partitions' tensor cores busy (8 warps, in pairs, with column_warps = 2)
ROWS = 16                  # query rows of a warp: the M of mma.m16n8k16
BLOCK_N = WARPS * 16       # keys of one ring stage
SMEM_PER_SM = 228 * 1024   # H100/H200 shared memory an SM gives its CTAs
SMEM_RESERVED = 1024       # what the driver keeps per resident CTA
MAX_SMEM = 227 * 1024      # one CTA's opt-in limit
REGISTERS_PER_SM = 65536
MIN_THREAD_REGISTERS = 168 # what a thread keeps (Dv = 128 uses ~180 at two CTAs an SM, Dv = 64 ~110 at three)
MAX_SPLITS = 128           # FA3's cap: the combine reads at most this many partials a row
HEAD_DIMS = (64, 128, 192, 256)  # multiples of 64: whole 128-byte swizzle groups, 16-byte copies that divide
MAX_SQ = 16
SWAPPED_ROWS = 8           # a swapped plan's query rows: the N of mma.m16n8k16
SWAP_BY_DEFAULT = True     # plans of Sq·G <= SWAPPED_ROWS swapped unless told (measured 1.00-1.07x the m16 rows: docs)
FIXUP_BY_DEFAULT = True    # split plans merge in their last CTA, no combine launch (measured 1.00-1.04x: docs)
FIXUP_MAX_ROWS = 16        # ... up to this many packed rows: past them the last CTA's serial merge costs more than
                           # the combine kernel's launch (fp8 B 1 at 32-96 rows 0.75-0.94x: docs)
WAVE_FILL = 0.8            # FA3: no split when one wave already fills 80% of the CTA slots
SPLIT_EFFICIENCY = 0.85    # FA3: the fewest splits within 85% of the best wave efficiency
# where the CTAs before splitting fill at most an eighth of the slots (one long sequence), the best efficiency:
# measured 3-9% faster on one 128K sequence than the fewest within 85% (docs/ops/attention.md)
FEW_CTAS_SPLIT_EFFICIENCY = 1.0


@dataclass(frozen=True)
class DecodePlan:
    """What the decode kernel is compiled for (its Constexpr) and how it is launched.

    sq: query tokens per sequence; group: query heads per KV head (G); dqk, dv: head dims; paged/page_size: KV read
    through a block table of pages of ``page_size`` tokens; causal: queries aligned to the end of their sequence;
    stages: ring depth; splits: CTAs sharing one sequence's keys (1: no combine); row_warps: warps that split the
    query tile's rows (16 each; the other WARPS / row_warps split the keys); fp8: K and V are e4m3 (the ring holds
    their bytes; warps convert their fragments to f16 in registers); kv_block: a flex BlockMask's KV block
    size (a multiple of BLOCK_N; 0: no block mask); warp_tiles: 16-row tiles a warp computes (2: a warp owns 32
    rows, so that a key slice's fragments are read and converted once for 32 rows, not by two warps);
    lazy_rescale: O's rescale (Dv / column_warps multiplies a lane a slice) skipped, by a warp-uniform branch, when
    no row maximum of the warp's tile rose (exact: those factors are 1); swapped: Sᵀ = K Qᵀ and Oᵀ = Vᵀ Pᵀ, keys and
    O's columns as the MMAs' M and the query rows (at most ``SWAPPED_ROWS``) as their N, so that no m16 row tile
    is mostly padding (``swap_declined`` says when a plan cannot); pdl_combine (splits > 1): the combine kernel is
    a programmatic dependent launch, its CTAs launched while the split kernel runs (each split CTA lets it launch
    at its start) and waiting (``griddepcontrol.wait``) before they read the partials; fixup_combine (splits > 1):
    no combine kernel, the split CTA of a (sequence, KV head, query tile) that counts itself in last on its counter
    (``fixup_counter``) merges the tile's partials itself and zeroes the counter for the next call."""
    sq: int
    group: int
    dqk: int
    dv: int
    paged: bool
    page_size: int
    causal: bool
    stages: int
    splits: int
    row_warps: int = 1
    fp8: bool = False
    kv_block: int = 0
    warp_tiles: int = 1
    lazy_rescale: bool = False
    swapped: bool = False
    pdl_combine: bool = False
    fixup_combine: bool = False

    @property
    def key_warps(self) -> int:
        return WARPS // self.row_warps

    @property
    def tile_rows(self) -> int:
        """Query rows of a CTA."""
        if self.swapped:
            return SWAPPED_ROWS
        return ROWS * self.row_warps * self.warp_tiles

    @property
    def column_warps(self) -> int:
        """Warps sharing rows and key slices, each with Dv / column_warps of O's columns: 2 for Dv > 128, whose full
        16 x Dv f32 accumulator (96-128 registers a thread) spills beside the rest; swapped plans hold half of it
        (Dv / 4 a lane) and keep one warp a slice."""
        return 2 if self.dv > 128 and not self.swapped else 1

    @property
    def threads(self) -> int:
        return WARPS * self.column_warps * 32

    @property
    def query_in_registers(self) -> bool:
        """Whether the warps hold Q's A fragments in registers for the whole loop instead of re-reading them from
        shared memory every key slice: fp8 plans up to Dqk 128 (16-32 registers), where Q's re-reads would be a
        third of the shared-memory traffic a stage; 16-bit plans keep their measured code. Swapped plans up to Dqk
        128 (Qᵀ's B fragments: Dqk / 8 registers)."""
        return (self.fp8 or self.swapped) and self.dqk <= 128 and self.warp_tiles == 1

    @property
    def rows(self) -> int:
        """Query rows sharing a KV head: the packed M."""
        return self.sq * self.group

    @property
    def m_tiles(self) -> int:
        """Query tiles (CTAs) per KV head and split."""
        return -(-self.rows // self.tile_rows)

    @property
    def q_bytes(self) -> int:
        return self.tile_rows * self.dqk * 2

    @property
    def stage_bytes(self) -> int:
        """One ring stage: BLOCK_N keys of K and V, 2 bytes an element (fp8: 1)."""
        return BLOCK_N * (self.dqk + self.dv) * (1 if self.fp8 else 2)

    @property
    def ring_bytes(self) -> int:
        return self.stages * self.stage_bytes

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the ring, the query tile, then the warps' row maxima and sums (f32; ``stat_rows``
        of each)."""
        return self.ring_bytes + self.q_bytes + 2 * self.stat_rows * 4

    @property
    def stat_rows(self) -> int:
        """Rows of the warps' merge: key_warps x tile_rows (WARPS x ROWS x warp_tiles)."""
        return self.key_warps * self.tile_rows

    @property
    def partial_bytes(self) -> int:
        """The warps' f32 O for the merge, over the ring after the loop."""
        return self.stat_rows * self.dv * 4

    def grid(self, batch: int, kv_heads: int) -> tuple[int, int, int]:
        """(splits x query tiles, KV heads, batch): the query tiles of one split are neighbours, so the CTAs that
        read the same keys run together and all but the first find them in L2."""
        return self.splits * self.m_tiles, kv_heads, batch

    @property
    def fixup_bytes(self) -> int:
        """``fixup_combine``'s shared memory, over the ring after the warps' merge: each tile row's split weights
        and 1 / their sum (f32)."""
        return self.tile_rows * (self.splits + 1) * 4

    def fixup_counters(self, batch: int, kv_heads: int) -> int:
        """The arrival counters of ``fixup_combine``: one a (sequence, KV head, query tile)."""
        return batch * kv_heads * self.m_tiles


def fixup_counter(b: Any, hkv: Any, m_tile: Any, kv_heads: Any, m_tiles: int) -> Any:
    """The counter of the split CTAs of (sequence b, KV head hkv, query tile m_tile) (the kernel's arithmetic)."""
    return (b * kv_heads + hkv) * m_tiles + m_tile


def stages_for(dqk: int, dv: int, fp8: bool = False) -> int:
    """Ring depth: 4 stages of 16 KB (d = 64, three CTAs an SM), 3 of 32 KB (d = 128, two CTAs an SM) or of 64 KB
    (d = 256, one CTA): 64-128 KB of K/V in flight per SM either way. fp8 stages are half as big: twice as many fill
    the same shared memory with the same bytes in flight."""
    stages = 4 if BLOCK_N * (dqk + dv) * 2 <= 16 * 1024 else 3
    return 2 * stages if fp8 else stages


def ctas_per_sm(plan: DecodePlan) -> int:
    """Resident CTAs an SM holds, by shared memory and by registers (up to 255 a thread)."""
    by_smem = SMEM_PER_SM // (plan.smem_bytes + SMEM_RESERVED)
    by_registers = REGISTERS_PER_SM // (plan.threads * MIN_THREAD_REGISTERS)
    return max(1, min(by_smem, by_registers, 4))


def num_splits(ctas: int, slots: int, n_blocks: int, max_splits: int = MAX_SPLITS,
               split_efficiency: float = SPLIT_EFFICIENCY) -> int:
    """FA3's heuristic on CTA slots (SMs x resident CTAs): 1 split when ``ctas`` fill WAVE_FILL of the slots or the
    keys are at most 4 stages, else the fewest splits (at most one per stage, ``max_splits``, ``slots``) whose
    wave efficiency (waves / ceil(waves)) is within ``split_efficiency`` of the best (1.0: the best)."""
    if ctas >= WAVE_FILL * slots or n_blocks <= 4:
        return 1
    limit = max(1, min(max_splits, slots, n_blocks))
    efficiency = []
    for splits in range(1, limit + 1):
        waves = ctas * splits / slots
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency)
    return next(s for s, e in enumerate(efficiency, start=1) if e >= split_efficiency * best)


def row_warps_for(rows: int) -> int:
    """Warps splitting the query rows: as few as hold them, up to all four (64 rows), so that K and V are read once
    for up to 64 rows; more rows take more CTAs, which find the keys in L2. Each warp's mma work grows with its key
    slices (row_warps of them a stage), still under the stage's DRAM time."""
    return 1 if rows <= ROWS else 2 if rows <= 2 * ROWS else WARPS


def swap_declined(sq: int, group: int, row_warps: int = 0, warp_tiles: int = 0) -> str:
    """Why a plan of Sq x G query rows cannot be swapped ('' when it can): more rows than the MMA's N, or row
    options that ask for m16 row tiles."""
    if sq * group > SWAPPED_ROWS:
        return f"Sq x G = {sq * group} query rows, more than the {SWAPPED_ROWS} a swapped tile holds"
    if row_warps > 1 or warp_tiles > 1:
        return f"row_warps {row_warps} / warp_tiles {warp_tiles} ask for m16 row tiles"
    return ""


def decode_plan(batch: int, sq: int, kv_heads: int, group: int, dqk: int, dv: int, max_seqlen: int, sm_count: int,
                paged: bool = False, page_size: int = 0, causal: bool = True, splits: int = 0,
                row_warps: int = 0, fp8: bool = False, kv_block: int = 0, stages: int = 0,
                warp_tiles: int = 0, lazy_rescale: bool = False,
                split_efficiency: float = 0.0, swapped: Optional[bool] = None, pdl_combine: bool = False,
                fixup_combine: Optional[bool] = None) -> DecodePlan:
    """The plan for one call shape; ``splits`` > 0 forces a split count, ``row_warps`` > 0 the row split,
    ``stages`` > 0 the ring depth and ``warp_tiles`` 2 32-row warps where the rows are more than 16 (0: fp8 d 128
    caches at the default depth take them, each slice converted once: measured 4-6% faster at Sq 8; 16-bit d 128
    ones past 32 rows too, each slice read once by two warps, not four: 1.00-1.11x at Sq 8 with G 6 and 8; at 32 rows
    16-bit ones measured equal or 2% slower);
    ``split_efficiency``: ``num_splits``'s (0: FEW_CTAS_SPLIT_EFFICIENCY or SPLIT_EFFICIENCY, above; fewer stages
    give more CTAs an SM, the split count planned on those slots); ``swapped``: the swapped-operand kernel where
    ``swap_declined`` finds nothing against it, else the plan without it (None: ``SWAP_BY_DEFAULT``);
    ``pdl_combine`` / ``fixup_combine``: the split-KV combine as a programmatic dependent launch / in the split
    kernel (``DecodePlan``; one of them; plans of one split keep neither; ``fixup_combine`` None:
    ``FIXUP_BY_DEFAULT`` up to FIXUP_MAX_ROWS packed rows where its split weights fit the ring and no PDL combine is
    asked for)."""
    asked_fixup = fixup_combine
    if fixup_combine is None:
        fixup_combine = FIXUP_BY_DEFAULT and not pdl_combine and sq * group <= FIXUP_MAX_ROWS
    if pdl_combine and fixup_combine:
        raise ValueError("decode_plan: pdl_combine and fixup_combine are two ways of one combine; ask for one")
    swapped = (SWAP_BY_DEFAULT if swapped is None else swapped) and not swap_declined(sq, group, row_warps,
                                                                                   warp_tiles)
    if swapped:
        row_warps = warp_tiles = 1
    if warp_tiles == 0:
        warp_tiles = 2 if dqk == dv == 128 and not stages and (fp8 or sq * group > 2 * ROWS) else 1
    if warp_tiles not in (1, 2):
        raise ValueError(f"decode_plan: warp_tiles {warp_tiles} must be 1 or 2")
    warp_tiles = warp_tiles if sq * group > ROWS else 1
    plan = DecodePlan(sq, group, dqk, dv, paged, page_size if paged else 0, causal,
                      stages or stages_for(dqk, dv, fp8), 1,
                      row_warps or row_warps_for(-(-sq * group // warp_tiles)), fp8, kv_block, warp_tiles,
                      lazy_rescale, swapped)
    if plan.partial_bytes > plan.ring_bytes:  # the merge's O goes over the ring
        raise ValueError(f"decode_plan: warp_tiles {warp_tiles} with {plan.stages} stages: the warps' merge "
                         f"({plan.partial_bytes} bytes) is larger than the ring ({plan.ring_bytes})")
    if splits <= 0:
        ctas, slots = batch * kv_heads * plan.m_tiles, sm_count * ctas_per_sm(plan)
        if not split_efficiency:
            split_efficiency = FEW_CTAS_SPLIT_EFFICIENCY if 8 * ctas <= slots else SPLIT_EFFICIENCY
        splits = num_splits(ctas, slots, -(-max_seqlen // BLOCK_N), split_efficiency=split_efficiency)
    splits = min(splits, MAX_SPLITS)
    if fixup_combine and splits > 1 and plan.tile_rows * (splits + 1) * 4 > plan.ring_bytes:
        if asked_fixup is None:  # the default: the combine kernel instead
            fixup_combine = False
        else:
            raise ValueError(f"decode_plan: fixup_combine's weights of {splits} splits "
                             f"({plan.tile_rows * (splits + 1) * 4} bytes) are larger than the ring ({plan.ring_bytes})")
    return DecodePlan(**{**plan.__dict__, "splits": splits, "pdl_combine": pdl_combine and splits > 1,
                         "fixup_combine": fixup_combine and splits > 1})


def split_range(seqlen: int, splits: int, split: int) -> tuple[int, int]:
    """The stages [begin, end) of split ``split`` of a sequence of ``seqlen`` keys (the kernel's arithmetic):
    the sequence's stages divided evenly, so ragged batches split every sequence by its own length."""
    n_blocks = -(-seqlen // BLOCK_N)
    per_split = -(-n_blocks // splits)
    begin = split * per_split
    return begin, max(begin, min(begin + per_split, n_blocks))


@dataclass(frozen=True)
class MaskTablesPlan:
    """What ``block_mask_kernel`` is compiled for: G query heads per KV head, the BlockMask's KV block size (a
    multiple of BLOCK_N), whether its tables are broadcast over the batch and over the heads (a dimension of 1),
    and whether it lists full blocks."""
    group: int
    kv_block: int
    batch_broadcast: bool
    head_broadcast: bool
    full: bool
