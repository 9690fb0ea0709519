"""What runs for one GEMM call: the kernel (skinny or wgmma), the wgmma kernel's config heuristics and its plan.

``plan_call`` picks the kernel: up to ``SKINNY_MAX_M`` tokens with a column-major B (the ``F.linear`` weight),
and with a 16-byte aligned row-major B up to ``SKINNY_MAX_M_ROW_B`` row-major tokens or
``SKINNY_MAX_M_COLUMN_TOKENS`` column-major ones, run the memory-bound skinny kernel; the rest the wgmma kernel,
planned by ``make_plan``. Its heuristic config (``heuristic_config``): small M is computed as the transposed
problem (swap A/B) so tokens fill wgmma's N, or on one 64-row token tile; few output tiles with long K are split
along K; a few waves take the tile width that fits them best; a short last wave of tiles is split along K over the
idle SMs (``stream_k_plan``). ``config_space`` is the space the autotuner searches. Why each rule is as it is, with
the measurements behind it: docs/ops/gemm.md.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch

from nvfly.arch import sm90
from nvfly.ops.common.mainloop import operand_box
from nvfly.ops.common.operands import OPERAND_DTYPES, operand_major
from nvfly.ops.common.scheduler import STREAM_K_REGIONS, StreamK, StreamKSplit, grid_schedule, split_count, \
    stream_k_split
from nvfly.ops.gemm import skinny_plan
from nvfly.ops.gemm.config import Epilogue, GemmConfig, store_box
from nvfly.ops.gemm.skinny_config import SkinnyConfig
from nvfly.ops.gemm.skinny_plan import SkinnyPlan
from nvfly.runtime.driver import plan_l2_bytes, plan_sm_count

# The skinny kernel's share of small M (it supports up to skinny_config.MAX_M), tuned on the H200 (docs/ops/gemm.md,
# "Skinny or wgmma"). Column-major B: up to SKINNY_MAX_M tokens, or SKINNY_MAX_M_SHORT_K when K < SKINNY_SHORT_K.
SKINNY_MAX_M = 16
SKINNY_SHORT_K = 1024
SKINNY_MAX_M_SHORT_K = 8
# row-major B (N contiguous: the skinny kernel's cp.async + ldmatrix.trans variant): row-major tokens
SKINNY_MAX_M_ROW_B = 4
# row-major B with column-major tokens (A = x.t(): M contiguous): one token tile still wins, two do not
SKINNY_MAX_M_COLUMN_TOKENS = 8


# ---------------------------------------------------------------------------------------------- configs
def config_space(dtype: torch.dtype = torch.bfloat16) -> list[GemmConfig]:
    """Every config the autotuner may try (all compile; see GemmConfig.check)."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    space = []
    for bm, consumers in ((128, 2), (256, 2), (64, 1), (128, 1)):
        for bn in (256, 192, 128, 96, 64, 32, 16, 8):
            for stages in range(MAX_STAGES, 2, -1):
                for group_m in (8, 16):
                    for cluster_m in (1, 2) if bn % 128 == 0 else (1,):  # narrower multicasts measured no gain
                        cfg = GemmConfig(bm, bn, stages, consumers, group_m, cluster_m=cluster_m)
                        if cfg.check(itemsize) is None:
                            space.append(cfg)
    for bm, bn in ((128, 128), (64, 256), (128, 64), (64, 128)):
        for stages in (7, 6, 5, 4):
            cfg = GemmConfig(bm, bn, stages, 2, pingpong=True)
            if cfg.check(itemsize) is None:
                space.append(cfg)
    # the TMA-store epilogue (stmatrix + TMA store through shared memory): its staging buffers cost ring stages
    # (with every tile the heuristic picks: 128x64, 128x96, 128x160, 128x192 and 128x224 fill waves, see wave_fit)
    for bm, bn, consumers, pingpong in ((128, 128, 2, True), (64, 256, 2, True), (128, 64, 2, True),
                                        (128, 256, 2, False), (256, 128, 2, False), (128, 128, 2, False),
                                        (64, 256, 1, False), (128, 192, 2, False), (64, 128, 1, False),
                                        (128, 64, 2, False), (128, 96, 2, False), (128, 160, 2, False),
                                        (128, 224, 2, False)):
        for store_buffers in (1, 2):
            if store_buffers == 2 and bn <= GemmConfig(bn=bn).store_width:
                continue  # one slice per tile: the same as 1 buffer
            for cluster_m in (1, 2) if not pingpong and bn % 128 == 0 else (1,):
                fits = [cfg for cfg in (GemmConfig(bm, bn, stages, consumers, cluster_m=cluster_m, pingpong=pingpong,
                                                   tma_store=True, store_buffers=store_buffers)
                                        for stages in range(MAX_STAGES, 2, -1)) if cfg.check(itemsize) is None]
                space.extend(fits[:2])  # the deepest two rings that fit next to the staging buffers
    # the token tiles of token_tile_config: 64 rows, each width one wave may take, at the deepest ring for each B
    for bn in range(TOKEN_TILE.bn, 257, TOKEN_TILE_STEP["K"]):
        for b_major in ("K", "MN"):
            cfg = deepest_ring(replace(TOKEN_TILE, bn=bn), itemsize, b_major)
            if cfg is not None and cfg not in space:
                space.append(cfg)
    return space


# the deepest ring the heuristic builds: narrow tiles of small-M (memory-bound) problems need the bytes in flight,
# and only tiles of at most 16 KB a stage (64 x 64 and narrower) fit more than 10 (docs/ops/gemm.md, "Ring depth")
MAX_STAGES = 14


def deepest_ring(cfg: GemmConfig, itemsize: int, b_major: str = "K", most: int = MAX_STAGES) -> Optional[GemmConfig]:
    """``cfg`` with the deepest ring of at most ``most`` stages that passes ``check`` (its staging buffers and
    everything else counted), or None when no depth does."""
    for stages in range(most, 1, -1):
        if replace(cfg, stages=stages).check(itemsize, b_major) is None:
            return replace(cfg, stages=stages)
    return None


# candidate tiles and their relative throughput per output element, measured on the H200 (docs/ops/gemm.md,
# "Default tiles"): the 128x128 ping-pong tile hides its epilogue and wins on short K; 128x64 fills a wave that
# 128x128 tiles leave half empty; the 128x256 cooperative tile, whose epilogue is rarer per k-block, wins from
# K = LONG_K on (LONG_K_EFFICIENCY)
TILES = ((GemmConfig(128, 128, 6, 2, pingpong=True, tma_store=True, store_buffers=1), 1.0),
         (GemmConfig(128, 256, 4, 2, tma_store=True, store_buffers=1), 0.97),
         (GemmConfig(256, 128, 4, 2, tma_store=True, store_buffers=1), 0.94),
         (GemmConfig(64, 256, MAX_STAGES, 1), 0.7), (GemmConfig(64, 128, MAX_STAGES, 1), 0.6),
         (GemmConfig(128, 64, MAX_STAGES, 2, tma_store=True, store_buffers=1), 0.6),
         (GemmConfig(64, 64, MAX_STAGES, 1), 0.45))
LONG_K = 4096
LONG_K_EFFICIENCY = {(128, 256): 1.02}
# the cost of a short last wave that stream K deals out over all SMs, in waves (its share and the fix-up), fitted
# on the H200 and counted after at most two whole waves (docs/ops/gemm.md, "Stream K")
STREAM_K_TAIL_WAVES = 0.3
# Wave fit: a few waves of 128-row tiles at least 128 wide take the width (WAVE_FIT_WIDTHS) that minimises
# waves x (128 + width), since a block's time per k-block goes with the bytes it loads; up to WAVE_FIT_MAX_WAVES
# waves and from half a wave on. Short K (under WAVE_FIT_SHORT_K_TILES k-blocks) keeps a ping-pong tile whose
# waves are at least WAVE_FIT_FULL full (docs/ops/gemm.md, "Wave fit")
WAVE_FIT_WIDTHS = (128, 160, 192, 224, 256)
WAVE_FIT_MAX_WAVES = 3
WAVE_FIT_SHORT_K_TILES = 24
WAVE_FIT_FULL = 0.9


@functools.lru_cache(maxsize=4096)
def default_config(m: int, n: int, k: int, batches: int = 1, itemsize: int = 2, sms: int = 132,
                   fit_waves: bool = True) -> GemmConfig:
    """A good config for one problem without tuning: the tile that best balances waves over ``sms`` SMs
    and tile efficiency (``fit_waves``: then the width that fits a few waves best, see WAVE_FIT_WIDTHS), and K
    splits when there are few output tiles but long K."""
    best: Optional[tuple[float, GemmConfig]] = None
    k_tiles = math.ceil(k / (128 // itemsize))
    for cfg, eff in TILES:
        if k >= LONG_K:
            eff = LONG_K_EFFICIENCY.get((cfg.bm, cfg.bn), eff)
        tiles = math.ceil(m / cfg.bm) * math.ceil(n / cfg.bn) * batches
        # padded work over the SMs, in units of one 128x128 tile; a short last wave that stream K deals out over
        # all SMs costs its share of a wave plus the fix-up (STREAM_K_TAIL_WAVES) after at most two whole waves
        full, tail = divmod(tiles, sms)
        streamed = full <= 2 and stream_k_plan(tiles, k_tiles, sms).streamed
        waves = full + max(tail / sms, STREAM_K_TAIL_WAVES) if streamed else math.ceil(tiles / sms)
        cost = waves * (cfg.bm * cfg.bn) / (128 * 128) / eff
        if best is None or cost < best[0] - 1e-9:
            best = (cost, deepest_ring(cfg, itemsize, most=cfg.stages))
    assert best is not None
    cfg = wave_fit(best[1], m, n, k_tiles, batches, itemsize, sms) if fit_waves else best[1]
    tiles = math.ceil(m / cfg.bm) * math.ceil(n / cfg.bn) * batches
    if cfg.pingpong and tiles <= sms:
        # one tile per block: ping-pong would leave its second consumer idle, the cooperative schedule splits
        # the tile between both
        cfg = replace(cfg, pingpong=False)
    if tiles * 2 <= sms and k_tiles >= 16:
        split = min(max(1, sms // tiles), k_tiles // 8, 16)
        if split > 1:
            # split-K runs the cooperative schedule (ping-pong needs whole tiles per consumer)
            return replace(cfg, split_k=split, pingpong=False,
                           consumers=1 if cfg.bm == 64 else 2)
    if cfg.bm == 64 and not cfg.tma_store:
        # whole 64-row tiles store through TMA, one staging slice: the register epilogue's 4-byte stores down 64
        # rows end a block's only tile, TMA writes whole lines (docs/ops/gemm.md, "Epilogue of 64-row tiles")
        cfg = deepest_ring(replace(cfg, tma_store=True, store_buffers=1), itemsize, most=cfg.stages)
    # 2-block clusters multicasting B (cluster_m=2) measured within noise of cluster_m=1, so the heuristic leaves
    # them to the autotuner
    return cfg


def wave_fit(cfg: GemmConfig, m: int, n: int, k_tiles: int, batches: int, itemsize: int, sms: int) -> GemmConfig:
    """``cfg`` or, for a few waves of 128-row tiles, the cooperative 128-row tile of the width that fits the waves
    best (see WAVE_FIT_WIDTHS)."""
    def tiles(width: int) -> int:
        return math.ceil(m / 128) * math.ceil(n / width) * batches

    def cost(width: int) -> int:
        return math.ceil(tiles(width) / sms) * (128 + width)
    now = tiles(cfg.bn)
    if (cfg.bm != 128 or cfg.bn < 128 or cfg.split_k > 1 or not sms < 2 * now <= 2 * WAVE_FIT_MAX_WAVES * sms
            or stream_k_plan(now, k_tiles, sms).streamed):
        return cfg
    if cfg.pingpong and k_tiles < WAVE_FIT_SHORT_K_TILES and now >= WAVE_FIT_FULL * math.ceil(now / sms) * sms:
        return cfg  # short K in well-filled waves: the ping-pong tile's hidden epilogue weighs more
    width = min(WAVE_FIT_WIDTHS, key=lambda w: (cost(w), -w))
    if cost(width) >= cost(cfg.bn):
        return cfg
    return deepest_ring(replace(cfg, bn=width, pingpong=False), itemsize)


# A single wave of 128x128 (or 64x128) tiles at most WAVE_FIT_FILL full narrows its tiles (to a multiple of 32
# columns) to fill the SMs when B is K-major; an MN-major B tile that narrow loses its 128-byte swizzle
# (docs/ops/gemm.md, "Filling one wave")
WAVE_FIT_FILL = 0.8


def one_wave_width(n: int, rows_of_tiles: int, sms: int, step: int) -> int:
    """The narrowest tile width, a multiple of ``step``, that cuts N into at most one wave's share of tiles per row
    of tiles (``rows_of_tiles`` rows over ``sms`` SMs)."""
    return step * math.ceil(n / (step * (sms // rows_of_tiles)))


def fill_wave_k_major(cfg: GemmConfig, m: int, n: int, batches: int, itemsize: int, sms: int) -> GemmConfig:
    """The default ``cfg`` or, for a K-major B, its narrower twin that fills a partial single wave (see above)."""
    row_tiles = math.ceil(m / cfg.bm) * batches
    tiles = row_tiles * math.ceil(n / cfg.bn)
    if cfg.bm not in (64, 128) or (cfg.bn, cfg.split_k) != (128, 1) or tiles > WAVE_FIT_FILL * sms or sms < row_tiles:
        return cfg
    width = one_wave_width(n, row_tiles, sms, 32)
    if not 64 < width < cfg.bn:
        return cfg
    return deepest_ring(replace(cfg, bn=width, pingpong=False), itemsize)


@functools.lru_cache(maxsize=4096)
def small_m_config(m: int, n: int, k: int, batches: int, itemsize: int, sms: int) -> GemmConfig:
    """Config of the swapped problem (N x M) for small M: M becomes wgmma's N (a multiple of 8)."""
    bn = max(8, min(256, 8 * math.ceil(m / 8)))
    # 64-row tiles (one consumer) only while they fit one wave: beyond it, half as many 128-row tiles stream more
    # bytes per SM (docs/ops/gemm.md, "Small M")
    bm, consumers = (64, 1) if math.ceil(n / 64) * batches <= sms else (128, 2)
    tiles = math.ceil(n / bm) * batches
    cfg = deepest_ring(GemmConfig(bm, bn, MAX_STAGES, consumers), itemsize)
    k_tiles = math.ceil(k / (128 // itemsize))
    if tiles * 2 <= sms and k_tiles >= 16:
        split = min(max(1, sms // tiles), k_tiles // 4, 16)
        if split > 1:
            cfg = replace(cfg, split_k=split)
    return cfg


# One 64-row token tile for 48 < M <= 64: tokens fill wgmma's M, and weight tiles as narrow as one wave allows give
# one block per SM with no K split and so no reduce launch; a small-M call's bandwidth is set by the blocks it runs.
# Widths are multiples of 16 (the TMA-store epilogue), and of 32 with an MN-major B (64- or 128-byte swizzle rows)
# (docs/ops/gemm.md, "Token tiles")
TOKEN_TILE_M = (48, 64)          # M in (48, 64]
TOKEN_TILE_WAVE = 0.8            # the tiles fill at least this much of one wave, and no more than one
TOKEN_TILE_STEP = {"K": 16, "MN": 32}  # tile widths, by B's major (see above)
TOKEN_TILE_MIN_K_TILES = 32      # below it, where the swapped tiles split K, they win
TOKEN_TILE = GemmConfig(64, 32, MAX_STAGES, 1, tma_store=True, store_buffers=1)  # the narrowest


def token_tile_config(m: int, n: int, k: int, batches: int, itemsize: int, sms: int,
                      b_major: str = "K") -> Optional[GemmConfig]:
    """The token tile for 48 < M <= 64, as narrow as one wave of blocks allows (see above), else None."""
    if not TOKEN_TILE_M[0] < m <= TOKEN_TILE_M[1] or batches > sms:
        return None
    step = TOKEN_TILE_STEP[b_major]
    bn = max(TOKEN_TILE.bn, one_wave_width(n, batches, sms, step))
    if bn > 256 or math.ceil(n / bn) * batches < TOKEN_TILE_WAVE * sms:
        return None
    if (math.ceil(k / TOKEN_TILE.bk(itemsize)) < TOKEN_TILE_MIN_K_TILES
            and small_m_config(m, n, k, batches, itemsize, sms).split_k > 1):
        return None
    return deepest_ring(replace(TOKEN_TILE, bn=bn), itemsize, b_major)


# L2 eviction hints: an operand read once (one row of tiles covers the other) that is larger than the L2 can never
# be an L2 hit, so its loads go first and the other operand's last; weights that fit stay unhinted (back-to-back
# calls re-read them from L2), and past 8 L2s the hint lost (docs/ops/gemm.md, "L2 hints")
STREAM_HINT_L2S = (1, 8)  # hinted: operands of [1, 8) L2 sizes


def stream_hints(cfg: GemmConfig, m: int, n: int, k: int, batches: int, itemsize: int, l2_bytes: int) -> GemmConfig:
    """``cfg`` with stream_a / stream_b set for an operand read once of STREAM_HINT_L2S L2 sizes (see above)."""
    low, high = STREAM_HINT_L2S[0] * l2_bytes, STREAM_HINT_L2S[1] * l2_bytes
    if math.ceil(m / (cfg.bm * cfg.cluster_m)) == 1 and low <= n * k * batches * itemsize < high:
        return replace(cfg, stream_b=True)
    if math.ceil(n / cfg.bn) == 1 and low <= m * k * batches * itemsize < high:
        return replace(cfg, stream_a=True)
    return cfg


# Stream K (nvfly.ops.common.scheduler.StreamK): STREAM_K_REGION (one of STREAM_K_REGIONS) picks the tiles whose
# k-blocks are dealt out as contiguous ranges, one per block; only the short tail paid on the H200 (docs/ops/gemm.md,
# "Stream K")
STREAM_K_REGION = "short-tail"


def stream_k_plan(tiles: int, k_tiles: int, sms: int, region: Optional[str] = None) -> StreamKSplit:
    """The stream-K split of a persistent launch of ``tiles`` work tiles of ``k_tiles`` k-blocks over ``sms``
    blocks, for ``region`` (default STREAM_K_REGION): which whole tiles run first, and the k-blocks per block of
    the rest (nothing streamed for whole waves, or a region the shape has not)."""
    return stream_k_split(tiles, k_tiles, sms, StreamK(region or STREAM_K_REGION))


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class GemmPlan:
    """How the wgmma kernel runs one call signature: everything that depends only on shapes, strides and options
    (``api.bind`` caches it per signature). With ``swap`` every field but ``swap`` describes the transposed
    problem the kernel computes (out^T = B^T @ A^T)."""
    dtype: str                  # the operands' dtype, by name: 'bf16' or 'f16'
    config: GemmConfig
    swap: bool
    a_major: str
    b_major: str
    m: int
    n: int
    k_tiles: int
    batches: int
    grid: int
    threads: int
    a_box: tuple
    a_swizzle: int
    b_box: tuple
    b_swizzle: int
    epilogue: Epilogue
    reduce_epilogue: Optional[Epilogue]  # split K: the reduce kernel's epilogue (the main kernel's writes partials)
    # the TMA-store epilogue: the output descriptor's (box, swizzle), and the config without it for outputs
    # TMA cannot store (store_reason)
    store_box: Optional[tuple]
    store_swizzle: int
    register_config: Optional[GemmConfig]
    # stream K: the sk_tiles tiles from dp_tiles on are dealt out as block_iters k-blocks per block (none: 0s)
    dp_tiles: int
    block_iters: int
    sk_tiles: int


def heuristic_config(m: int, n: int, k: int, batches: int, itemsize: int, sms: int, l2_bytes: int, b_major: str,
                     swap: bool, token_tile: Optional[GemmConfig]) -> GemmConfig:
    """The heuristic's config of an m x n x k problem as the caller sees it (B ``b_major``-major), for the
    transposed problem when ``swap``: the token tile when there is one, else the small-M config of the transposed
    problem or the default config; unswapped with a K-major B, narrowed to fill a single wave; then with the L2
    hints of the problem the kernel computes."""
    if token_tile is not None:
        config = token_tile
    elif swap:
        config = small_m_config(m, n, k, batches, itemsize, sms)
    else:
        config = default_config(m, n, k, batches, itemsize, sms)
    if swap:
        m, n = n, m
    elif b_major == "K":
        config = fill_wave_k_major(config, m, n, batches, itemsize, sms)
    return stream_hints(config, m, n, k, batches, itemsize, l2_bytes)


def widened_for_mn_major_b(config: GemmConfig, itemsize: int) -> GemmConfig:
    """``config``, its tile widened to whole 32-byte swizzle rows where it is narrower (an MN-major B tile spans at
    least one) at the deepest ring that still fits; raises ValueError when none does."""
    narrowest = 32 // itemsize
    if config.bn % narrowest == 0:
        return config
    widened = replace(config, bn=narrowest * math.ceil(config.bn / narrowest))
    # the wider tile may not fit the ring the narrower one did (128x168 with 6 stages fits, 128x176 does not)
    fitted = deepest_ring(widened, itemsize, "MN", most=widened.stages)
    if fitted is None:
        raise ValueError(f"config: widened to bn={widened.bn} for the MN-major B operand, "
                         f"{replace(widened, stages=2).check(itemsize, 'MN')}")
    return fitted


def make_plan(a3: torch.Tensor, b3: torch.Tensor, has_c: bool, activation: str, config: Optional[GemmConfig],
              batched: bool, scaled: bool = False, swap: Optional[bool] = None) -> GemmPlan:
    """The wgmma kernel's plan for 3-D operands a3 [B, M, K] and b3 [B, K, N] (of any device, meta included: it
    reads shapes and strides; ``batched``: the caller's operands are 3-D). ``config`` None: the heuristic's
    (``heuristic_config``), else the caller's, of the transposed problem when ``swap``. ``swap`` None: small M
    without a token tile is swapped when the heuristic chooses the config."""
    batches, m, k = a3.shape
    n = b3.shape[-1]
    dtype = OPERAND_DTYPES[a3.dtype]
    itemsize = a3.element_size()
    sms = plan_sm_count(a3.get_device())

    # 1. the config of the problem: the caller's, or the heuristic's (unswapped when a token tile applies)
    if config is None:
        token_tile = None if swap else token_tile_config(m, n, k, batches, itemsize, sms, operand_major(b3, -2))
        if swap is None:
            swap = token_tile is None and m <= 64 < n
        config = heuristic_config(m, n, k, batches, itemsize, sms, plan_l2_bytes(a3.get_device()),
                                  operand_major(b3, -2), swap, token_tile)
    swap = bool(swap)
    # 2. the problem the kernel computes
    if swap:
        a3, b3 = b3.transpose(-1, -2), a3.transpose(-1, -2)
        m, n = n, m
    a_major, b_major = operand_major(a3, -1), operand_major(b3, -2)
    # 3. the config fitted to it: B's tile as wide as its major needs, every K split at least one k-block, and the
    # register epilogue where the TMA store cannot go (split K stores f32 partials, and the swapped problem's
    # output is transposed: its contiguous dim is the kernel's M, which stmatrix would need .trans and a
    # transposed box for)
    if b_major == "MN":
        config = widened_for_mn_major_b(config, itemsize)
    bk = config.bk(itemsize)
    k_tiles = math.ceil(k / bk)
    split = split_count(k_tiles, config.split_k)
    config = replace(config, split_k=split, tma_store=config.tma_store and not swap and split == 1)
    why = config.check(itemsize, b_major)  # a caller's config, checked against this call's B
    if why:
        raise ValueError(f"config: {why} (B is {b_major}-major here)")
    if config.cluster_n != 1:
        raise ValueError("config: the dense GEMM runs clusters along M only (cluster_m), not cluster_n")
    if config.skip_empty:
        raise ValueError("config: skip_empty: only the grouped kernel's tiles cross a group's end")
    # 4. the persistent launch: whole tiles, or a stream-K tail dealt out over the blocks
    cm = config.cluster_m
    schedule = grid_schedule(m, n, k_tiles, config.bm, config.bn, sms=sms, batches=batches, group_m=config.group_m,
                             split_k=split, cluster_m=cm,
                             stream_k=StreamK(STREAM_K_REGION) if config.stream_k else None)
    # 5. the TMA boxes and the epilogues
    rank = 3 if batched else 2
    a_box, a_swizzle = operand_box(config.bm, bk, dtype, a_major, rank)
    b_box, b_swizzle = operand_box(config.bn, bk, dtype, b_major, rank, cm)
    out_box, out_swizzle = store_box(config, batched) if config.tma_store else (None, 0)
    return GemmPlan(
        dtype=dtype.name, config=config, swap=swap, a_major=a_major, b_major=b_major, m=m, n=n, k_tiles=k_tiles,
        batches=batches, grid=schedule.grid, threads=128 * (1 + config.consumers), a_box=a_box, a_swizzle=a_swizzle,
        b_box=b_box, b_swizzle=b_swizzle,
        epilogue=Epilogue(has_c=has_c, activation=activation, partial=split > 1, scaled=scaled and split == 1),
        reduce_epilogue=Epilogue(has_c=has_c, activation=activation, scaled=scaled) if split > 1 else None,
        store_box=out_box, store_swizzle=out_swizzle,
        register_config=replace(config, tma_store=False) if config.tma_store else None,
        dp_tiles=schedule.dp_tiles, block_iters=schedule.block_iters, sk_tiles=schedule.sk_tiles)


# ---------------------------------------------------------------------------------------------- the kernel
def skinny_wanted(a: torch.Tensor, b: torch.Tensor, config: Any, skinny: Optional[bool]) -> bool:
    """Whether this call runs the skinny kernel: forced by ``skinny=True`` or a SkinnyConfig (an error when it
    cannot), else automatic when no GemmConfig is given for at most SKINNY_MAX_M rows with a column-major B, and
    with a 16-byte aligned row-major B at most SKINNY_MAX_M_ROW_B rows (SKINNY_MAX_M_COLUMN_TOKENS when A is
    column-major)."""
    forced = skinny is True or isinstance(config, SkinnyConfig)
    if skinny is False or isinstance(config, GemmConfig):
        if forced:
            raise ValueError("skinny: skinny=True or a SkinnyConfig contradicts a GemmConfig or skinny=False")
        return False
    why = skinny_plan.reason(a, b)
    if forced and why:
        raise ValueError(f"skinny: the skinny kernel cannot run this: {why}")
    m, b_major = a.shape[-2], skinny_plan.b_major(b)
    if b_major == "col":
        limit = SKINNY_MAX_M if a.shape[-1] >= SKINNY_SHORT_K else SKINNY_MAX_M_SHORT_K
    else:
        limit = SKINNY_MAX_M_COLUMN_TOKENS if m > 1 and a.stride(-2) == 1 else SKINNY_MAX_M_ROW_B
    return forced or (why is None and m <= limit)


def plan_call(a: torch.Tensor, b: torch.Tensor, use_c: bool, activation: str, config: Any, skinny: Optional[bool],
              scaled: bool, swap: Optional[bool]) -> Union[GemmPlan, SkinnyPlan]:
    """The plan of a ``matmul`` call that ``api.eligibility`` accepted: the skinny kernel's or the wgmma kernel's
    (operands of any device, meta included: plans read shapes and strides)."""
    if swap is not None and (skinny or isinstance(config, SkinnyConfig)):
        raise ValueError("swap: swap applies to the wgmma kernel, not to the skinny kernel")
    a3, b3 = (a, b) if a.dim() == 3 else (a.unsqueeze(0), b.unsqueeze(0))
    if skinny_wanted(a, b, config, False if swap is not None else skinny):
        batches, m, k = a3.shape
        return skinny_plan.make_plan(m, b3.shape[-1], k, batches, use_c, activation, scaled, config,
                                     plan_sm_count(a.get_device()),
                                     row_b=skinny_plan.b_major(b) == "row")
    return make_plan(a3, b3, use_c, activation, config, a.dim() == 3, scaled=scaled, swap=swap)
