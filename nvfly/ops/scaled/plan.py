"""What runs for one scaled GEMM call: the config heuristic and the plan.

Heuristic (``heuristic_config``): the fast-accumulating recipes (tensor/row-wise with ``use_fast_accum``) take
128x256, 128x192 or 128x128 tiles, whichever's waves take least time (waves x width, ties to the wider); promoted
mainloops keep two accumulators per consumer, so 128x128 (two consumers of 64 rows, 64 + 64 registers each), or
for tensor/row scales 128x192 (96 + 96) where its waves of tiles take less time (waves x width); both narrow to 64
columns while 128-wide tiles would fill less than FILL of the SMs. 128-row tiles store through shared memory and
TMA (``ScaledConfig.tma_store``; f32 outputs, swapped and split-K plans through registers). Small M (at most SWAP_MAX_M rows)
with tensor/row scales is computed as the transposed problem (swap A/B: the weights fill wgmma's 64-row M, the
tokens its N); block scales stay unswapped on one 64-row token tile (their activation scales run along the
kernel's rows), its width the widest that still fills FILL of the SMs. Small-M tiles that fill at most half the
SMs split K over the idle ones (f32 partials, then a reduce kernel applies scales and bias; or, with
``ScaledConfig.split_fix_up``, the splits add up in the kernel's workspace and the last one stores: one launch,
``SPLIT_FIX_UP`` says which the heuristic takes). Clusters along N multicasting A (``ScaledConfig.cluster_n``;
unswapped, without K splits or stream K) are the caller's choice: at M = 128 to 512 they measured slower than
independent blocks. Measurements: docs/ops/scaled.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from dataclasses import replace

from nvfly.ops.common.gemm_config import store_box
from nvfly.ops.common.scheduler import StreamK, grid_schedule, split_count
from nvfly.ops.scaled.config import BK, BLOCKWISE, MX, ScaledConfig, ScaledEpilogue, deepest, weight_scales_reason

SWAP_MAX_M = 64
FILL = 0.8  # token tiles: the widest whose tiles still fill this share of the SMs
# promoted 128-row tiles up to 192 wide (64 x 192 per consumer: 96 + 96 accumulator registers) for these scalings;
# block1x128 and MX hold column scales besides. Block scales can (three 64-column runs, each in one weight block:
# config.weight_runs), in order (no third accumulator): with staged scales 1.00x cuBLAS against 0.87x for 128 x 128
# (benchmarks.scaled --block-tiles, docs/ops/scaled.md)
WIDE_PROMOTED = ("tensor", "row", "block")
# block scales' 128 x 192 tile (staged scales, in order) does a tile's work at ~1.05x the rate of the 128 x 128 one
# (issuing ahead), measured at M = 16384 where both fill their waves: the waves x width comparison weighs it so
WIDE_BLOCK_RATE = 1.05
# small M splits K while the tiles fill at most half the SMs: each split at least SPLIT_MIN_K_TILES k-blocks, at
# most SPLIT_MAX splits
SPLIT_MIN_K_TILES = 4
SPLIT_MAX = 16
# the heuristic's K splits add up in the kernel (ScaledConfig.split_fix_up: one launch), not in the reduce kernel
# (two): the second launch costs far more host time than the fix-up costs on the GPU (docs/ops/scaled.md)
SPLIT_FIX_UP = True


@dataclass(frozen=True)
class ScaledPlan:
    """How the kernel runs one call signature; with ``swap`` m and n are the transposed problem's (out^T =
    b^T a^T: the kernel's A is the caller's b)."""
    config: ScaledConfig
    epilogue: ScaledEpilogue
    swap: bool
    m: int
    n: int
    k: int
    k_tiles: int
    grid: int
    threads: int
    a_box: tuple[int, int]
    b_box: tuple[int, int]
    b_swizzle: int = 128  # packed (MXFP4) B: unswizzled 64-byte rows, converted into the swizzled e4m3 tile
    store_box: Optional[tuple] = None  # the TMA-store epilogue's output (box, swizzle) (config.tma_store)
    # stream K (config.stream_k, where the tiles end in a partial wave): the sk_tiles tiles from dp_tiles on are
    # dealt out as block_iters k-blocks per block (none: 0s)
    dp_tiles: int = 0
    block_iters: int = 0
    sk_tiles: int = 0
    # split K with config.split_fix_up: the output tiles whose splits add up in the workspace (none: 0)
    fix_up_tiles: int = 0

    @property
    def shared_tiles(self) -> int:
        """Tiles that several blocks add up in the workspace (stream K's or split K's), a slot per consumer each."""
        return self.sk_tiles or self.fix_up_tiles


def heuristic_config(m: int, n: int, k: int, promote: bool, swap: bool, sms: int,
                     scaling: str = "tensor") -> ScaledConfig:
    """The config of the m x n x k problem the kernel computes (already transposed when ``swap``) with ``scaling``."""
    if swap:  # tokens along the kernel's N: the narrowest multiple of 8 that holds them
        bn = max(8, 8 * math.ceil(n / 8))
        bm, consumers = (64, 1) if math.ceil(m / 64) <= sms else (128, 2)
        return split_small_m(deepest(ScaledConfig(bm, bn, 2, consumers), most=12), m, n, k, sms)
    if m <= 64:  # one 64-row token tile, as narrow (down to 32) as filling the SMs needs
        bn = next((w for w in (128, 64) if math.ceil(n / w) >= FILL * sms), 32)
        return split_small_m(deepest(ScaledConfig(64, bn, 2, 1), most=12), m, n, k, sms)
    # 128-row tiles store through shared memory and TMA (the dense GEMM's epilogue): one instruction a slice, drained
    # under the next tile's mainloop instead of 4-byte stores the consumer waits on
    if promote:  # two accumulators: at most 192 columns, narrower while the tiles leave SMs idle
        row_tiles = math.ceil(m / 128)
        # 64 wide only in one wave: a second, partial wave of 64-wide tiles takes as long as one of 128-wide ones
        # (waves x width, as below; docs/ops/scaled.md, "One wave of 64-wide tiles")
        bn = 128 if row_tiles * math.ceil(n / 128) >= FILL * sms or row_tiles * math.ceil(n / 64) > sms else 64
        if bn == 128 and scaling in WIDE_PROMOTED:  # 192 where its waves of tiles take less time (DeepGEMM's choice)
            rate = {192: WIDE_BLOCK_RATE if scaling == "block" else 1.0, 128: 1.0}
            bn = min((192, 128), key=lambda w: (math.ceil(row_tiles * math.ceil(n / w) / sms) * w / rate[w], -w))
        return deepest(ScaledConfig(128, bn, 2, 2, tma_store=True))
    # one accumulator, up to 256 wide: among the widths whose tiles fill the SMs, the one whose waves take least
    # time (waves x width; ties to the wider), as the promoted tiles choose 192
    filling = [w for w in (256, 192, 128) if math.ceil(m / 128) * math.ceil(n / w) >= FILL * sms]
    if filling:
        bn = min(filling, key=lambda w: (math.ceil(math.ceil(m / 128) * math.ceil(n / w) / sms) * w, -w))
    else:
        bn = 128 if math.ceil(m / 128) * math.ceil(n / 128) >= FILL * sms else 64
    return deepest(ScaledConfig(128, bn, 2, 2, tma_store=True))


def split_small_m(cfg: ScaledConfig, m: int, n: int, k: int, sms: int) -> ScaledConfig:
    """``cfg`` with K split over the idle SMs when its tiles fill at most half of them (see SPLIT_MIN_K_TILES)."""
    tiles = math.ceil(m / cfg.bm) * math.ceil(n / cfg.bn)
    k_tiles = math.ceil(k / BK)
    if 2 * tiles > sms:
        return cfg
    split = split_count(k_tiles, max(1, min(sms // tiles, k_tiles // SPLIT_MIN_K_TILES, SPLIT_MAX)))
    return replace(cfg, split_k=split, split_fix_up=SPLIT_FIX_UP and split > 1)


def make_plan(m: int, n: int, k: int, epilogue: ScaledEpilogue, config: Optional[ScaledConfig],
              swap: Optional[bool], sms: int, out_itemsize: int = 2) -> ScaledPlan:
    """The plan of an m x n x k call (the caller's problem) with ``epilogue`` (bias_rows is set here for a swapped
    plan); ``config`` None: the heuristic's, of the transposed problem when swapped; ``swap`` None: the
    heuristic's choice (small M, tensor/row scales). A TMA-store config stores through registers instead where the
    staged epilogue cannot (``out_itemsize`` not 2, a swapped (transposed) output, split-K partials)."""
    if swap is None:
        swap = m <= SWAP_MAX_M and epilogue.scaling not in BLOCKWISE and config is None
    if swap and epilogue.scaling in BLOCKWISE:
        raise ValueError("swap: block scales run unswapped (the activation scales run along the kernel's rows)")
    if swap:
        m, n = n, m
        epilogue = ScaledEpilogue(epilogue.scaling, epilogue.promote, epilogue.bias, bias_rows=epilogue.bias)
    if config is None:
        config = heuristic_config(m, n, k, epilogue.promote, swap, sms, epilogue.scaling)
        # block scales issue k-block k+1's wgmmas before k's promotion (faster on every block row measured) where
        # the third accumulator fits (not 128 x 192: a WIDE_PROMOTED block tile runs in order)
        if epilogue.scaling == "block" and replace(config, issue_ahead=True).check(promote=True) is None:
            config = replace(config, issue_ahead=True)
        if epilogue.scaling == "block" and config.bm == 128:  # the producer stages the activation scales: 1.12x
            config = deepest(replace(config, staged_scales=True), most=config.stages)  # measured on 128-row tiles
        if epilogue.scaling == "mxfp4":  # B's packed tile rides every stage too: as deep a ring as still fits
            config = deepest(replace(config, packed_b=True), most=config.stages)
    if config.packed_b != (epilogue.scaling == "mxfp4"):
        if epilogue.scaling != "mxfp4":
            raise ValueError(f"config: packed_b with {epilogue.scaling} scales: only MXFP4 weights arrive packed")
        config = replace(config, packed_b=True)
    if config.tma_store and (out_itemsize != 2 or swap or (config.split_k > 1 and not config.split_fix_up)):
        config = deepest(replace(config, tma_store=False), most=config.stages)
    why = config.check(epilogue.promote)
    if why:
        raise ValueError(f"config: {why}")
    if config.stream_a or config.stream_b:
        raise ValueError("config: stream_a, stream_b: only the grouped scaled kernel hints its loads")
    if config.skip_empty:
        raise ValueError("config: skip_empty: only the grouped scaled kernel's tiles cross a group's end")
    if epilogue.scaling == "block" and weight_scales_reason(config.bn):
        raise ValueError(f"config: {weight_scales_reason(config.bn)}")
    if config.staged_scales and (epilogue.scaling != "block" or swap):
        raise ValueError(f"config: staged_scales: the producer stages block scales' 1x128 activation scales "
                         f"(unswapped), not {epilogue.scaling}{' swapped' if swap else ''}")
    if config.issue_ahead and epilogue.scaling == "block1x128":
        raise ValueError("config: issue_ahead with block1x128 scales: two k-blocks' column scales next to three "
                         "accumulators spill")
    if config.issue_ahead and epilogue.scaling in MX:
        raise ValueError("config: issue_ahead with MX scales: they promote every k-step, not k-blocks")
    if config.cluster_n > 1 and swap:
        raise ValueError(f"config: cluster_n={config.cluster_n} on a swapped plan: its tokens are one tile column, "
                         f"no neighbour along N shares its A (pass swap=False)")
    k_tiles = math.ceil(k / BK)
    split = split_count(k_tiles, config.split_k)  # every split at least one k-block
    config = replace(config, split_k=split, split_fix_up=config.split_fix_up and split > 1)
    if split > 1 and not config.split_fix_up:  # f32 partials for the reduce kernel
        epilogue = replace(epilogue, partial=True)
    # stream K over any partial last wave (a single one too: the M = 128 case)
    schedule = grid_schedule(m, n, k_tiles, config.bm, config.bn, sms=sms, group_m=config.group_m,
                             split_k=config.split_k, stream_k=StreamK("tail") if config.stream_k else None,
                             split_fix_up=config.split_fix_up, cluster_n=config.cluster_n)
    b_box = (min(config.bn, 256), BK // 2) if config.packed_b else (min(config.bn, 256), BK)
    return ScaledPlan(config=config, epilogue=epilogue, swap=swap, m=m, n=n, k=k, k_tiles=k_tiles,
                      grid=max(1, schedule.grid), threads=128 * (1 + config.consumers),
                      a_box=(config.bm // config.cluster_n, BK), b_box=b_box, b_swizzle=0 if config.packed_b else 128,
                      store_box=store_box(config, False) if config.tma_store else None,
                      dp_tiles=schedule.dp_tiles, block_iters=schedule.block_iters, sk_tiles=schedule.sk_tiles,
                      fix_up_tiles=schedule.output_tiles if config.split_fix_up else 0)
