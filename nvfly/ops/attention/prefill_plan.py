"""Prefill attention plans: the tile, the ring and the launch grid, and the causal tile arithmetic (pure Python,
shared by the kernel's trace and the CPU model in the tests).

A CTA owns ``block_m`` query rows of one (batch, query head): ``consumers`` = block_m / 64 consumer warpgroups of
64 rows each, and a producer warpgroup whose one thread TMA-loads Q once and K and V block by block (``block_n``
keys) into two ``stages``-deep mbarrier rings. docs/ops/attention.md explains the choices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from nvfly.ops.common.scheduler import (check_unit_sizes, csr_table, head_grouped_lpt_unit, lpt_work_lists,
                                        pack_unit)

# (Dqk, Dv) pairs and the keys of a ring stage for each Dqk. S is 64 x block_n f32 a warpgroup (block_n / 2 registers
# a thread), O 64 x Dv (Dv / 2): 128 keys up to Dqk 192 (DeepSeek's 192/128: 209 KB of shared memory), 80 at 256
# (FlashAttention-3's tile: 225 KB, under the 227 KB a CTA may have). Rows are whole 128-byte swizzle rows, or
# 64-byte ones where a head dim is an odd multiple of 32 (96)
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (64, 128), (128, 64), (192, 128), (256, 256))
BLOCK_N = {64: 128, 96: 128, 128: 128, 192: 128, 256: 80}
FP8_HEAD_DIMS = ((64, 64), (128, 128), (256, 256))  # fp8 e4m3: one swizzle row (64 or 128 bytes) or two
FP8_BLOCK_N = 128  # a multiple of fp8 wgmma's 32-deep k-step and of V's 16-key permutation; D 256 fits: 161 KB
FP8_WIDE_BLOCK_N = 192  # fp8 D 128 (FlashAttention-3: 176 non-causal): fewer block steps a key; Vᵀ 64-byte swizzled
WIDE_BLOCK_N = {64: 192, 128: 176}  # bf16/fp16 ``wide``: FA3's D 64 tiles are 192 keys wide, its D 128 non-causal 176
MASK_BLOCK_N = 64  # D 256 with a BlockMask: stages that divide its 128-key blocks (80 does not)
BLOCK_M = 128               # two consumer warpgroups of 64 rows (wgmma's M)
MAX_SMEM = 227 * 1024       # one CTA's opt-in limit on H100/H200
STAGES = 2                  # K and V rings each; FA3 uses 2 (the loads run a whole block ahead of the math)
PRODUCER_REGS = 24          # the producer only issues TMA
CONSUMER_REGS = 240         # 24 * 128 + 240 * 256 = 64512 of the SM's 65536 registers
PERSISTENT_PRODUCER_REGS = 40  # and 232 a consumer thread: 40 * 128 + 232 * 256 = 64512
TABLE_PRODUCER_REGS = 32  # ``unit_table``: the producer reads its units' coordinates (24 spills; and 232)
PINGPONG_BARRIER = 1        # named barriers 1 and 2: consumer c waits on 1 + c for its turn to issue GEMMs
BARRIER_BYTES = 1024        # barriers first; the tiles start 1024-byte aligned (128-byte swizzle atoms need it)
SWIZZLE = 128
# ``persistent``: the (batch, head) pairs grouped so that a group's K and V fit in this much L2 (half of the
# H100/H200's 50 MiB, what ``plan_l2_bytes`` plans for): the units in flight share them
L2_KV_BYTES = 25 << 20


@dataclass(frozen=True)
class PrefillPlan:
    """What the prefill kernel is compiled for (its Constexpr) and how it is launched.

    dqk, dv: head dims; causal: keys past a right bound are masked, the query's position plus the runtime causal
    offset (Skv - Sq bottom-right aligned, 0 top-left) plus the runtime ``right`` (0 for causal, a sliding window's
    right extent); window: keys before a left bound (the position minus the runtime ``left``) are masked too;
    kv_block, q_block: a flex BlockMask's block sizes (0: none) whose tables list the key blocks; varlen: sequences
    packed along S with cu_seqlens; block_m, block_n: query rows of a CTA and keys of a ring stage; stages: depth of
    each of the K and V rings; overlap: a consumer issues S of key block j + 1 with P·V of block j and runs block
    j + 1's softmax under that P·V (FlashAttention-3's intra-warpgroup overlap; a second S tile in registers);
    pingpong: the two consumers take turns issuing their GEMMs (named barriers), one's softmax under the other's
    GEMMs; fp8: e4m3 Q, K and V (both GEMMs fp8, P rounded to e4m3) with V given transposed, (B, Dv, Hkv, Skv)
    with its keys permuted within every 16 (``sm90.register_a_k_order``), the K-major B of P·V; tree_max: the
    softmax's row maxima by a pairwise tree; poly_exp2: that many of every 16 of a thread's exp2 by a polynomial on
    the FMA pipe instead of MUFU (``softmax.online_softmax``); hoist: the per-row and per-column parts of the masks
    and mods out of the per-score code (``prefill_kernel.row_limits``: the positional bounds as two per-row limits
    relative to the thread's first key of the block, compared with each score's constant column offset; the mods'
    q_idx and kv_idx as affine values, ``mods.ModValue``: kv_idx - q_idx one subtraction and one conversion a
    block, a comparison with a number one compare a score); prefetch_mask: the mask_mod's table loads issued
    between S's issue and its wait and its compares after the wait (``prefill_kernel.mask_mod_keeps``), instead of
    its verdicts packed into bits there and unpacked after; lazy_rescale: O's rescale (Dv / 2 multiplies a thread)
    skipped by a warp-uniform branch when no row maximum of the warp rose (the factors are 1 then; not with the
    overlap); persistent: one CTA an SM (``grid``'s ``sms``) walks the (query tile, head, batch) units
    ``scheduler.head_grouped_lpt_unit`` orders (longest causal tiles first, pairs grouped so that their K and V
    stay in L2, ``pair_group``), Q through its own one-stage full/empty ring, the K and V rings' positions and
    the ping-pong turns carried from unit to unit (not with packed sequences nor fp8); unit_table (with persistent
    only): each CTA reads its units from a host-built list instead (``prefill_unit_table``: greedy LPT over the
    units' key blocks), its producer at ``TABLE_PRODUCER_REGS`` (it does no unit division);
    per_head_descales (fp8 only): the q, k and v descales are (B, Hkv) float32 tensors read at [batch, kv head]
    (FlashAttention-3's per-head factors; a per-tensor or (Hkv,) one passed as a view with zero strides), not
    one-element tensors read at [0]."""
    dqk: int
    dv: int
    causal: bool
    window: bool = False
    kv_block: int = 0
    q_block: int = 0
    varlen: bool = False
    block_m: int = BLOCK_M
    block_n: int = 128
    stages: int = STAGES
    overlap: bool = False
    pingpong: bool = False
    fp8: bool = False
    tree_max: bool = False
    poly_exp2: int = 0
    hoist: bool = False
    prefetch_mask: bool = False
    lazy_rescale: bool = False
    persistent: bool = False
    unit_table: bool = False
    per_head_descales: bool = False

    def __post_init__(self) -> None:
        if self.pingpong and self.consumers != 2:
            raise ValueError(f"a ping-pong prefill plan takes two consumer warpgroups, not {self.consumers}")
        if self.poly_exp2 not in (0, 1, 2, 4, 8):
            raise ValueError(f"poly_exp2 takes 0, 1, 2, 4 or 8 scores of every 16, not {self.poly_exp2}")
        if self.fp8 and (self.block_n % 32 or self.varlen or self.kv_block):
            raise ValueError("an fp8 prefill plan takes key blocks of a multiple of 32 keys, no packed sequences and "
                             "no BlockMask (V's keys are permuted by 16 from the tensor's first key)")
        if self.persistent and (self.varlen or self.fp8):
            raise ValueError("a persistent prefill plan takes no packed sequences (varlen) and no fp8 inputs")
        if self.per_head_descales and not self.fp8:
            raise ValueError("per_head_descales is an fp8 prefill plan's option (fp8=True)")
        if self.unit_table and not self.persistent:
            raise ValueError("unit_table is a persistent prefill plan's option (persistent=True)")

    @property
    def swizzle(self) -> int:
        """Bytes of a shared-memory swizzle row: 128 when both head dims' rows are multiples of 128 bytes, else 64."""
        rows = (self.dqk * self.itemsize, self.dv * self.itemsize)
        return SWIZZLE if all(row % SWIZZLE == 0 for row in rows) else SWIZZLE // 2

    @property
    def v_swizzle(self) -> int:
        """Bytes of V's swizzle row: the plan's, but for fp8's Vᵀ, whose rows are ``block_n`` keys, the widest
        (128, 64 or 32) dividing them (192 keys: 64)."""
        if not self.fp8:
            return self.swizzle
        return next(width for width in (self.swizzle, SWIZZLE // 2, SWIZZLE // 4) if self.block_n % width == 0)

    @property
    def itemsize(self) -> int:
        """Bytes of a Q, K or V element: 1 for fp8, else 2."""
        return 1 if self.fp8 else 2

    @property
    def producer_regs(self) -> int:
        """The producer warpgroup's registers a thread: ``PRODUCER_REGS``; persistent: ``PERSISTENT_PRODUCER_REGS``
        (it derives every unit's coordinates and key blocks itself); ``unit_table``: ``TABLE_PRODUCER_REGS`` (it
        reads them; at ``PRODUCER_REGS`` it spills)."""
        if self.unit_table:
            return TABLE_PRODUCER_REGS
        return PERSISTENT_PRODUCER_REGS if self.persistent else PRODUCER_REGS

    @property
    def consumer_regs(self) -> int:
        """A consumer warpgroup's registers a thread: what the producer leaves of the 64512 (``CONSUMER_REGS``)."""
        return CONSUMER_REGS - -(-(self.producer_regs - PRODUCER_REGS) // (8 * self.consumers)) * 8

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

    def grid(self, batch: int, heads: int, sq: int, sms: int = 0) -> tuple[int, int, int]:
        """(query tiles, query heads, batch); ``persistent``: (min(units, ``sms``), 1, 1), a CTA an SM."""
        tiles = -(-sq // self.block_m)
        if self.persistent:
            if sms < 1:
                raise ValueError(f"a persistent prefill plan's grid needs the SM count, got sms={sms}")
            return (min(tiles * heads * batch, sms), 1, 1)
        return (tiles, heads, batch)

    def kv_rows_in_l2(self, itemsize: int) -> int:
        """``persistent``: the keys of one KV head whose K and V fill ``L2_KV_BYTES``."""
        return L2_KV_BYTES // ((self.dqk + self.dv) * itemsize)


def prefill_plan(dqk: int, dv: int, causal: bool, window: bool = False, kv_block: int = 0, q_block: int = 0,
                 varlen: bool = False, overlap: Optional[bool] = None,
                 pingpong: Optional[bool] = None, fp8: bool = False, wide: Optional[bool] = None,
                 tree_max: Optional[bool] = None, poly_exp2: Optional[int] = None, mods: bool = False,
                 hoist: Optional[bool] = None, prefetch_mask: Optional[bool] = None,
                 lazy_rescale: Optional[bool] = None, persistent: Optional[bool] = None,
                 unit_table: Optional[bool] = None, per_head_descales: bool = False) -> PrefillPlan:
    """The plan of a supported (Dqk, Dv) pair (``HEAD_DIMS``, ``FP8_HEAD_DIMS`` with ``fp8``) and its masking
    options; ``overlap``/``pingpong`` None: the defaults below (``mods``: whether the kernel traces a score_mod or
    mask_mod); ``wide`` (fp8 D 128, and bf16/fp16 D 64 and 128 without a BlockMask; None: the default below):
    ``FP8_WIDE_BLOCK_N`` (``WIDE_BLOCK_N``) keys a stage instead of ``FP8_BLOCK_N`` (``BLOCK_N``); ``tree_max``
    (fp8 only; None: with ``wide``); ``poly_exp2`` (None: 0; bf16/fp16 by ``softmax.EXP2_CUBIC``); ``hoist``,
    ``prefetch_mask`` (None: on for bf16/fp16, measured below), ``lazy_rescale``, ``persistent``, ``unit_table``
    (None: off); ``per_head_descales``: fp8's descales per (batch, KV head), ``PrefillPlan``."""
    if overlap is None:
        # measured on the H200: at D <= 128 0.93x cuDNN with ping-pong, 0.95x without (causal rows lose most); at
        # 192/128 and 256 +3-13% on every row; with mods or a BlockMask there it spills (docs/ops/attention.md)
        overlap = dqk > 128 and not (fp8 or mods or kv_block)
    if pingpong is None:
        pingpong = dqk <= 128 or not fp8  # measured: 0.95x cuDNN vs 0.89x serial at D 128; faster at 192 and 256
    if wide is None:
        wide = False  # bf16 measured 0.94-1.01x (docs/results.md); fp8 not measured: --prefill-variants times it
    wide = wide and ((fp8 and dqk == 128) or (not fp8 and dv == dqk in WIDE_BLOCK_N and not kv_block))
    if fp8:
        block_n = FP8_WIDE_BLOCK_N if wide else FP8_BLOCK_N
    else:
        block_n = WIDE_BLOCK_N[dqk] if wide else stage_keys(dqk, kv_block)
    if tree_max is None:
        tree_max = wide
    # measured on the H200 (16-bit, docs/ops/attention.md): plain rows 0.99-1.04x, ALiBi 1.07x, window 1.04x;
    # prefetching the mask_mod's loads: documents 1.06x over hoist alone; fp8 plans not measured with them
    if hoist is None:
        hoist = not fp8
    if prefetch_mask is None:
        prefetch_mask = not fp8
    return PrefillPlan(dqk, dv, causal, window, kv_block, q_block, varlen, block_n=block_n, overlap=overlap,
                       pingpong=pingpong, fp8=fp8, tree_max=tree_max and fp8, poly_exp2=poly_exp2 or 0,
                       hoist=bool(hoist), prefetch_mask=bool(prefetch_mask),
                       lazy_rescale=bool(lazy_rescale) and not overlap, persistent=bool(persistent),
                       unit_table=bool(unit_table), per_head_descales=per_head_descales)


def stage_keys(dqk: int, kv_block: int = 0) -> int:
    """Keys of a ring stage: ``BLOCK_N``, or with a BlockMask a divisor of its 128-key blocks."""
    block_n = BLOCK_N[dqk]
    return block_n if not kv_block or 128 % block_n == 0 else MASK_BLOCK_N


def pair_group(skv: Any, group: Any, kv_rows: int, maximum: Callable[[Any, Any], Any] = max) -> Any:
    """``persistent``: the (batch, query head) pairs of a group of ``scheduler.head_grouped_lpt_unit``: as many KV
    heads as fit ``kv_rows`` keys (``PrefillPlan.kv_rows_in_l2``; at least one) times the ``group`` query heads of
    each (GQA), so that a group's K and V stay in L2 while its tiles run."""
    return maximum(kv_rows // maximum(skv, 1), 1) * group


def prefill_unit_table(plan: PrefillPlan, batch: int, heads: int, sq: int, skv: int, group: int, offset: int,
                       left: int, right: int, ctas: int) -> list[int]:
    """``unit_table``: the CTAs' work lists, ``scheduler.csr_table`` of ``scheduler.pack_unit`` codes: the units in
    ``scheduler.head_grouped_lpt_unit``'s order, each unit's cost its tile's key blocks (``key_blocks``: causal and
    window aware), dealt to the ``ctas`` CTAs by ``scheduler.lpt_work_lists``. ValueError for sizes a code cannot
    hold."""
    tiles_m = -(-sq // plan.block_m)
    check_unit_sizes(tiles_m, heads, batch, "attention.prefill")
    pairs = heads * batch
    grouped = pair_group(skv, group, plan.kv_rows_in_l2(plan.itemsize))
    units = [head_grouped_lpt_unit(unit, tiles_m, heads, pairs, grouped) for unit in range(tiles_m * pairs)]
    costs = []
    for m_block, _, _ in units:
        start, _, _, total = key_blocks(m_block, skv, plan.causal, plan.window, offset, left, right, plan.block_m,
                                        plan.block_n)
        costs.append(max(total - start, 0))
    lists = lpt_work_lists(costs, ctas)
    return csr_table([[pack_unit(*units[index]) for index in indices] for indices in lists])


def causal_offset(sq: int, skv: int, alignment: str) -> int:
    """What is added to a query's index to get the last key it sees: bottom-right alignment puts the last query on
    the last key (flash-attn's convention, and decode's), top-left the first query on the first key (torch SDPA's
    is_causal)."""
    return skv - sq if alignment == "bottom_right" else 0


def key_blocks(m_block: Any, skv: Any, causal: bool, window: bool, offset: Any, left: Any, right: Any, block_m: int,
               block_n: int, minimum: Callable[[Any, Any], Any] = min,
               maximum: Callable[[Any, Any], Any] = max) -> tuple[Any, Any, Any, Any]:
    """(start, unmasked_start, unmasked_end, total) key blocks of query tile ``m_block``: row r sees keys from
    r + offset - left (``window``) to r + offset + right (``causal``). Blocks [unmasked_start, unmasked_end) are
    fully visible to every row of the tile and need no mask; [start, unmasked_start) and [unmasked_end, total) are
    evaluated with it (a window's left edge, the sequence's tail block, blocks crossing the causal diagonal); blocks
    before start and from total on are fully masked and never loaded. The kernel calls it on traced values with
    ``nvfly.minimum``/``nvfly.maximum`` (floor divisions of non-negative values only)."""
    blocks = (skv + block_n - 1) // block_n
    whole = skv // block_n  # blocks without a tail
    first_row = m_block * block_m
    last_row = first_row + block_m - 1
    total, unmasked_end, start, unmasked_start = blocks, whole, 0, 0
    if causal:
        total = minimum(blocks, (maximum(last_row + offset + right + 1, 0) + block_n - 1) // block_n)
        unmasked_end = minimum(whole, maximum(first_row + offset + right + 1, 0) // block_n)
    if window:
        start = minimum(maximum(first_row + offset - left, 0) // block_n, total)
        unmasked_start = (maximum(last_row + offset - left, 0) + block_n - 1) // block_n
        unmasked_start = minimum(maximum(unmasked_start, start), total)
    unmasked_end = maximum(minimum(unmasked_end, total), unmasked_start)
    return start, unmasked_start, unmasked_end, total


def upper_inside_end(m_block: Any, skv: Any, causal: bool, offset: Any, right: Any, block_m: int, block_n: int,
                     minimum: Callable[[Any, Any], Any] = min, maximum: Callable[[Any, Any], Any] = max) -> Any:
    """The first key block of query tile ``m_block`` that is not inside the upper bounds (the causal bound and
    Skv) of every row of the tile: blocks before it need only a window's lower bound (``key_blocks``' unmasked_end
    before it is raised to unmasked_start). Blocks from ``key_blocks``' unmasked_start on need only the upper
    bounds."""
    whole = skv // block_n
    if not causal:
        return whole
    return minimum(whole, maximum(m_block * block_m + offset + right + 1, 0) // block_n)


def block_inside_bounds(first_row: Any, rows: int, first_key: Any, keys: int, skv: Any, causal: bool,
                        window: bool, low: Any, high: Any) -> Any:
    """Whether every key of [first_key, first_key + keys) is within Skv and the positional bounds of every row of
    [first_row, first_row + rows): row r sees keys r + low (``window``) ... r + high (``causal``). The kernel asks
    it of a BlockMask's listed blocks for a warp's 16 rows (traced values: a uniform branch skips the bounds' code
    where it holds); the tests, of every block against a brute-force check."""
    last_key = first_key + keys - 1
    inside = last_key < skv
    if causal:
        inside = inside & (last_key <= first_row + high)
    if window:
        inside = inside & (first_key >= first_row + rows - 1 + low)
    return inside


def pipelined_loops(start: Any, unmasked_start: Any, unmasked_end: Any, total: Any,
                    maximum: Callable[[Any, Any], Any] = max) -> tuple[tuple[Any, Any, bool], ...]:
    """The overlapped walk's loops after its first block (``start``, run with the positional mask): (first, end,
    masked) for ``key_blocks``'s three ranges, each starting one block later at the earliest; together they run
    start + 1 ... total - 1 once each, in order, those in [unmasked_start, unmasked_end) without the mask."""
    after = start + 1
    return ((after, unmasked_start, True), (maximum(unmasked_start, after), unmasked_end, False),
            (maximum(unmasked_end, after), total, True))
