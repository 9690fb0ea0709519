"""Dense GEMM on torch tensors (Hopper): ``matmul`` covering mm / addmm / bmm / linear with a fused epilogue.

    out = act(alpha * A @ B + beta * C)       A: [(B,) M, K], B: [(B,) K, N], C broadcastable to [(B,) M, N]

Every operand major-ness works without copies (row- or column-major A and B); tails in M, N, K are fine.
``eligibility`` says why an input is declined (e.g. a stride TMA cannot express); callers then use
PyTorch. ``config_space`` is the space the autotuner searches; ``default_config`` picks a config per shape
without tuning. Small M is computed as the transposed problem (swap A/B) so tokens fill wgmma's N; few
output tiles with long K are split along K; a short last wave of tiles is split along K over the idle SMs
(``stream_k_plan``). Up to ``SKINNY_MAX_M`` tokens with a column-major B (the ``F.linear`` weight), and with a
16-byte aligned row-major B up to ``SKINNY_MAX_M_ROW_B`` row-major tokens or ``SKINNY_MAX_M_COLUMN_TOKENS``
column-major ones, run the memory-bound skinny kernel instead (``gemm_skinny``); ``path`` says which ran.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, Union

import torch

import nvfly
from nvfly.arch import sm90
from nvfly.runtime.driver import plan_l2_bytes, plan_sm_count
from nvfly.runtime.tma import cached_descriptor
from nvfly.runtime.torch_args import current_stream, layout_key, vector_width
from nvfly.ops import gemm_skinny
from nvfly.ops.common import scratch
from nvfly.ops.gemm_kernel import (ACTIVATIONS, REDUCE_THREADS, Epilogue, GemmConfig, gemm_kernel,
                                   split_k_reduce_kernel, store_box)
from nvfly.ops.gemm_skinny import SkinnyConfig, SkinnyPlan

_DTYPES = {torch.bfloat16: nvfly.bf16, torch.float16: nvfly.f16}
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# tokens (M) up to which matmul picks the skinny kernel when B is column-major (it supports up to
# gemm_skinny.MAX_M); tuned on the H200
SKINNY_MAX_M = 16
# ... and with K under SKINNY_SHORT_K: the wgmma kernel wins at M = 16 (16x32768x512 17.3 vs 18.6 us rowxcol,
# 17.9 vs 20.8 colxcol; cuBLAS 17.4 / 17.1), the skinny kernel still at M = 8 (14.4 vs 16.7, 18.5 vs 19.5)
# (H200, --compare-paths, benchmarks/results/gemm_16x32768_h200.json)
SKINNY_SHORT_K = 1024
SKINNY_MAX_M_SHORT_K = 8
# row-major tokens (A K-contiguous) with a row-major B (N contiguous: the skinny kernel's cp.async +
# ldmatrix.trans variant): the tokens up to which matmul picks the skinny kernel. Measured on the H200 over the
# dense suite's 14 (N, K) (benchmarks/results/gemm_row_b_paths_h200.json, --compare-paths, rowxrow): the wgmma
# kernel on the swapped problem was faster at M = 16 on 13 of 14 (geomean 1.08x; 16x2112x7168 22.7 -> 18.6 us)
# and at M = 8 on 9 of 14 (1.03x), the skinny kernel at M = 1 (4096x4096: 17.2 vs 18.8 us); at M = 2 and 4 the two
# trade places within a few percent (skinny faster on 7 of 14 at each, gemm_row_b_small_m_h200.json).
SKINNY_MAX_M_ROW_B = 4
# column-major tokens (A = x.t(): M contiguous) with a row-major B: the tokens up to which matmul picks the skinny
# kernel. Measured on the H200 (benchmarks/results/gemm_skinny_paths_h200.json, skinny vs the wgmma kernel, us):
# with two token tiles the row-B kernel's staged tokens cost more than the wgmma kernel's TMA, whose tiles take any
# major: 16x4096x14336 colxrow 49.0 vs 43.8, 16x4096x4096 21.4 vs 20.7; with one tile the skinny kernel wins:
# 8x14336x4096 colxrow 41.2 vs 46.6. (A column-major B reads column-major tokens through registers at every M:
# 16x4096x14336 colxcol 38.0 us vs the wgmma kernel's 45.0, gemm_skinny.COLUMN_B_TOKENS)
SKINNY_MAX_M_COLUMN_TOKENS = 8


# ---------------------------------------------------------------------------------------------- eligibility
def _operand_major(t: torch.Tensor, contiguous_k_dim: int) -> Optional[str]:
    """'K' if the K dimension (``contiguous_k_dim``: -1 for A, -2 for B) is contiguous, 'MN' if the other
    matrix dimension is, None if neither."""
    other = -2 if contiguous_k_dim == -1 else -1
    if t.stride(contiguous_k_dim) == 1 or t.shape[contiguous_k_dim] == 1:
        return "K"
    if t.stride(other) == 1 or t.shape[other] == 1:
        return "MN"
    return None


def _tma_reason(name: str, t: torch.Tensor, unit_dim: int) -> Optional[str]:
    if t.data_ptr() % 16:
        return f"{name}: its address is not 16-byte aligned (TMA needs it)"
    for d in range(t.dim()):
        if d % t.dim() == unit_dim % t.dim() or t.shape[d] == 1:
            continue
        if (t.stride(d) * t.element_size()) % 16:
            return (f"{name}: stride {t.stride(d)} of dimension {d} is not a multiple of 16 bytes "
                    f"(TMA cannot describe it)")
    return None


def eligibility(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None,
                out_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when ``matmul(a, b, c=c)`` runs on nvfly, else the reason it is declined."""
    if not (a.is_cuda and b.is_cuda):
        return "operands are not CUDA tensors"
    if a.device != b.device or (c is not None and c.device != a.device):
        return "operands are on different devices"
    if _capability(a.device.index)[0] != 9:
        return "nvfly's GEMM needs an sm_90 (Hopper) GPU"
    if a.dtype not in _DTYPES or b.dtype != a.dtype:
        return f"dtypes {a.dtype} x {b.dtype}: nvfly's GEMM takes bf16 or fp16 operands of one dtype"
    if (out_dtype or a.dtype) not in _OUT_DTYPES:
        return f"output dtype {out_dtype} is not bf16, fp16 or fp32"
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        return f"ranks {a.dim()} and {b.dim()}: expected two 2-D or two 3-D operands"
    if a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply"
    for name, t, kdim in (("A", a, -1), ("B", b, -2)):
        major = _operand_major(t, kdim)
        if major is None:
            return f"{name}: neither of its last two dimensions is contiguous"
        unit = kdim if major == "K" else (-2 if kdim == -1 else -1)
        reason = _tma_reason(name, t, unit)
        if reason:
            return reason
    if c is not None:
        shape = (a.shape[0],) * (a.dim() == 3) + (a.shape[-2], b.shape[-1])
        try:
            torch.broadcast_shapes(c.shape, shape)
        except RuntimeError:
            return f"C of shape {tuple(c.shape)} does not broadcast to {shape}"
    return None


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


@functools.lru_cache(maxsize=None)
def _capability(device: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


# the deepest ring the heuristic builds: narrow tiles of small-M (memory-bound) problems need the bytes in
# flight (H200, benchmarks/results/gemm_tiles_h200.log: swapped 64x6144x4096 on 64x64 tiles 124 -> 142 TFLOP/s
# from 7 to 10 stages, 14 no better; 128x4096x14336 on 64x128 tiles 286 -> 313 from 7 to 9). Only tiles of at
# most 16 KB a stage (64 x 64 and narrower) fit more than 10: 128x4096x4096 / 128x4096x7168 on 64x64 tiles
# 219 -> 226 / 255 -> 287 TFLOP/s rowxcol, 219 -> 240 / 254 -> 271 colxrow from 10 to 14 (cuBLAS 218 / 278,
# 235 / 280; benchmarks.gemm_configs --tiles 64x64s14, m128_tiles log); the swapped 64x64 split-K tiles of
# 64x4096x4096 105 either way.
MAX_STAGES = 14


def deepest_ring(cfg: GemmConfig, itemsize: int, b_major: str = "K", most: int = MAX_STAGES) -> Optional[GemmConfig]:
    """``cfg`` with the deepest ring of at most ``most`` stages that passes ``check`` (its staging buffers and
    everything else counted), or None when no depth does."""
    for stages in range(most, 1, -1):
        if replace(cfg, stages=stages).check(itemsize, b_major) is None:
            return replace(cfg, stages=stages)
    return None


# candidate tiles and their relative throughput per output element, measured on the H200
# (benchmarks/gemm_configs.py): the 128x128 ping-pong tile hides its epilogue and wins on short K; 128x64 fills a
# wave that 128x128 tiles leave half empty (512x2112x7168: 68 -> 132 tiles, 394 -> 471 TFLOP/s rowxcol, 389 -> 512
# rowxrow; it ties 64x128, which stays first: 128x6144x4096 255 vs 246); the 128x256
# cooperative tile, whose epilogue is rarer per k-block, wins from K = 4096 on (LONG_K_EFFICIENCY; side by side,
# --compare-regions and --compare-stream-k: 2048x4096x14336 738 vs 680 TFLOP/s rowxrow and 749 vs 710 colxcol,
# 512x7168x16384 682 vs 660 and 682 vs 653, 4096x10240x8192 684 vs 659, 4096x14336x4096 681 vs 667)
_TILES = ((GemmConfig(128, 128, 6, 2, pingpong=True, tma_store=True, store_buffers=1), 1.0),
          (GemmConfig(128, 256, 4, 2, tma_store=True, store_buffers=1), 0.97),
          (GemmConfig(256, 128, 4, 2, tma_store=True, store_buffers=1), 0.94),
          (GemmConfig(64, 256, MAX_STAGES, 1), 0.7), (GemmConfig(64, 128, MAX_STAGES, 1), 0.6),
          (GemmConfig(128, 64, MAX_STAGES, 2, tma_store=True, store_buffers=1), 0.6),
          (GemmConfig(64, 64, MAX_STAGES, 1), 0.45))
LONG_K = 4096
LONG_K_EFFICIENCY = {(128, 256): 1.02}
# the cost of a short last wave that stream K deals out over all SMs, in waves (its share and the fix-up), fitted
# to 1024x2112x7168 (H200, benchmarks.gemm_configs --tiles): 136 tiles of 128x128 611 TFLOP/s, 80 of 128x224 471,
# 264 of 128x64 490; 336x6144x4096 144 of 128x128 422, 84 of 128x224 406. Counted after at most two whole waves:
# after five, 336x28672x4096's 672 streamed 128x128 tiles lost to 336 of 128x256 (520 vs 572)
STREAM_K_TAIL_WAVES = 0.3
# Wave fit: a few waves of 128-row tiles at least 128 wide take the width (WAVE_FIT_WIDTHS) that minimises
# waves x (128 + width): a block's time per k-block goes with the bytes it loads (128 + width rows), so the same
# waves of narrower tiles are faster, and fewer waves of wider ones can be. Measured side by side on the H200
# (benchmarks.gemm_configs --tiles, rowxcol, TFLOP/s): 512x10240x8192 128x160 (256 tiles) 697 vs 128x128
# ping-pong (320) 592, 128x192 (216) 634, 128x256 (160) 503, cuBLAS 740; 512x6144x4096 128x192 (128 tiles) 673
# vs 128x224 (112) 608, 128x256 (96) 564, cuBLAS 661; 512x7168x16384 128x224 (128 tiles) 722 vs 128x256 (112) 672
# (benchmarks/results/gemm_tiles_h200.log). Over the 45 shapes of M 128-3072 whose default it changed, the old
# and new defaults side by side: +7.8% rowxcol, +7.1% rowxrow (geomean; 0.93 -> 1.00 and 0.94 -> 1.01 of cuBLAS;
# benchmarks/results/gemm_wave_fit_widths_h200.log). Up to WAVE_FIT_MAX_WAVES waves and from half a wave on
# (below it, split K fills the SMs); a streamed short tail (stream K) already fills its last wave.
# Short K (under WAVE_FIT_SHORT_K_TILES k-blocks: K < 1536 in 16 bits) keeps a ping-pong tile whose waves are at
# least WAVE_FIT_FULL full: its hidden epilogue outweighs the model there (512x8192x1024: 128 tiles of 128x256 448
# vs 256 ping-pong 472; 768x8192x1024 128x192 532 vs 539), while less full waves still gain (336x8192x1024, 73%:
# 309 -> 357), as do full ones from K = 1536 on (256x24576x1536, 97%: 539 -> 557).
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
    for cfg, eff in _TILES:
        if k >= LONG_K:
            eff = LONG_K_EFFICIENCY.get((cfg.bm, cfg.bn), eff)
        tiles = math.ceil(m / cfg.bm) * math.ceil(n / cfg.bn) * batches
        # padded work over the SMs, in units of one 128x128 tile; a short last wave that stream K deals out over
        # all SMs costs its share of a wave plus the fix-up (STREAM_K_TAIL_WAVES) after at most two whole waves
        full, tail = divmod(tiles, sms)
        streamed = full <= 2 and stream_k_plan(tiles, k_tiles, sms)[1]
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
        # rows end a block's only tile, TMA writes whole lines. Faster on all 16 suite rows (M = 128) that ran the
        # register epilogue (H200, do_bench / CUDA graphs, ratio to cuBLAS, gemm_small_tile_store_h200.log):
        # 128x7168x2048 rowxrow 0.96 / 0.78 -> 1.00 / 1.02 (64x128, 9 stages either way), 128x4096x4096 rowxcol
        # 0.99 / 1.05 -> 1.03 / 1.27 (64x64, 14 -> 13 stages), 128x6144x4096 rowxcol 0.98 / 0.93 -> 0.99 / 0.95
        cfg = deepest_ring(replace(cfg, tma_store=True, store_buffers=1), itemsize, most=cfg.stages)
    # 2-block clusters multicasting B (cluster_m=2) measured within noise of cluster_m=1 on the H200
    # (benchmarks/gemm_configs.py), so the heuristic leaves them to the autotuner
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
            or stream_k_plan(now, k_tiles, sms)[1]):
        return cfg
    if cfg.pingpong and k_tiles < WAVE_FIT_SHORT_K_TILES and now >= WAVE_FIT_FULL * math.ceil(now / sms) * sms:
        return cfg  # short K in well-filled waves: the ping-pong tile's hidden epilogue weighs more
    width = min(WAVE_FIT_WIDTHS, key=lambda w: (cost(w), -w))
    if cost(width) >= cost(cfg.bn):
        return cfg
    return deepest_ring(replace(cfg, bn=width, pingpong=False), itemsize)


# A single wave of 128x128 tiles at most WAVE_FIT_FILL full narrows its tiles (to a multiple of 32 columns) to fill
# the SMs when B is K-major: 336x4104x1024 rowxcol 99 -> 129 tiles of 128x96, 232 -> 241 and 226 -> 254 TFLOP/s
# (colxcol 233 vs 229: even; with the rule 0.91-1.01x cuBLAS rowxcol, 0.94-0.96 colxcol in three runs). A row-major
# (MN-major) B tile 96 wide loses its 128-byte swizzle: 224 -> 213 rowxrow (H200, benchmarks.gemm_configs --tiles
# 128x96, benchmarks/results/gemm_tiles_h200.log). The same for 64-row tiles: 128x6144x4096 on 128 tiles of 64x96
# instead of 96 of 64x128, 259 -> 268 TFLOP/s rowxcol, 255 -> 277 colxcol (cuBLAS 278 / 279; rowxrow 257 -> 237, MN-major;
# 128x7168x2048 on 64x112: even; gemm_tiles_m128_h200.log).
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
    # bytes per SM (64x10240x8192 rowxcol: 160 tiles of 64x64 159 TFLOP/s, 80 of 128x64 202, cuBLAS 210; H200,
    # benchmarks.gemm_configs --tiles swap:128x64)
    bm, consumers = (64, 1) if math.ceil(n / 64) * batches <= sms else (128, 2)
    tiles = math.ceil(n / bm) * batches
    cfg = deepest_ring(GemmConfig(bm, bn, MAX_STAGES, consumers), itemsize)
    k_tiles = math.ceil(k / (128 // itemsize))
    if tiles * 2 <= sms and k_tiles >= 16:
        split = min(max(1, sms // tiles), k_tiles // 4, 16)
        if split > 1:
            cfg = replace(cfg, split_k=split)
    return cfg


# One 64-row token tile: 48 < M <= 64 tokens fill wgmma's M, and weight tiles as narrow as one wave allows give
# one block per SM with no K split and so no reduce launch. A block streams its weights at ~45 GB/s whatever its
# tile (ncu, 64x10240x8192: ours 3.62 TB/s from 80 blocks of the swapped 128x64 tile, cuBLAS's 112-wide tiles
# 3.97 TB/s from 92; ncu_gemm_small_m_h200.md), so the blocks a small-M call runs set its bandwidth. H200, do_bench
# / CUDA-graph ratio to cuBLAS, swapped default -> token tile (gemm_small_m_plans_h200.log, 'old' -> 'fill'):
# rowxcol 64x10240x8192 on 64x80 0.93 / 0.91 -> 0.99 / 0.98, 64x32768x512 on 64x256 0.96 / 0.77 -> 1.00 / 0.99,
# 64x24576x1536 on 64x192 0.95 / 0.88 -> 0.99 / 1.03, 64x7168x2048 on 64x64 1.01 / 1.04 -> 1.03 / 1.09. Widths
# are multiples of 16, which the TMA-store epilogue needs (64x56 with the register epilogue lost there, 0.97 / 1.04
# -> 0.95 / 0.99, gemm_small_m_plans_first_h200.log), and of 32 with an MN-major B, whose tile then has 64- or
# 128-byte swizzle rows (rowxrow 64x10240x8192 on 64x96 0.94 / 0.92 -> 1.00 / 0.97; on 64x80, 32-byte rows, 0.98 /
# 0.96 -> 0.90 / 0.86, and 64x6144x4096 on 64x48 0.96 / 0.97 -> 0.85 / 0.83: gemm_token_fill_probe_h200.log).
# Earlier, on N = 4096 (64x32 tiles, m64_tiles logs): 64x4096x4096 119 / 116 TFLOP/s rowxcol / rowxrow against the
# swapped 64x64 split-K-2 tiles' 105 / 106 (cuBLAS 119 / 122); with half a wave or less (64x2112x7168: 66 tiles)
# and short K the split swapped tiles win (99 vs 97). A 14-stage ring keeps the bytes in flight that 10 did not.
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
# be an L2 hit, so its loads go first and the other operand's last. H200, do_bench (cold L2) / CUDA graph (warm)
# ratio to cuBLAS, without -> with (gemm_small_m_plans_h200.log): rowxcol 64x10240x8192 on 64x80 0.99 / 0.98 ->
# 1.06 / 1.01, rowxrow 64x24576x1536 on 64x192 0.99 / 0.99 -> 1.13 / 1.02, rowxrow 16x4096x14336 swapped 0.97 /
# 1.02 -> 1.08 / 1.05, rowxcol 128x24576x1536 1.00 / 1.03 -> 1.12 / 1.10. Weights that fit stay unhinted:
# back-to-back calls re-read them from L2, which the hint forfeits (64x32768x512, 32 MiB: graphs 0.99 -> 0.71,
# gemm_token_fill_probe_h200.log). Nor past 8 L2s, where do_bench lost 1-7% (57344x8192 at M = 16, 64, 128;
# 8192x28672 at M = 16; gemm_small_m_plans_first_h200.log). Likely cause of the cold gain: the dirty lines the
# hinted stream no longer evicts (do_bench flushes L2 by writing it), which bounds the gain while the stream's
# cost grows; not measured apart.
STREAM_HINT_L2S = (1, 8)  # hinted: operands of [1, 8) L2 sizes


def stream_hints(cfg: GemmConfig, m: int, n: int, k: int, batches: int, itemsize: int, l2_bytes: int) -> GemmConfig:
    """``cfg`` with stream_a / stream_b set for an operand read once of STREAM_HINT_L2S L2 sizes (see above)."""
    low, high = STREAM_HINT_L2S[0] * l2_bytes, STREAM_HINT_L2S[1] * l2_bytes
    if math.ceil(m / (cfg.bm * cfg.cluster_m)) == 1 and low <= n * k * batches * itemsize < high:
        return replace(cfg, stream_b=True)
    if math.ceil(n / cfg.bn) == 1 and low <= m * k * batches * itemsize < high:
        return replace(cfg, stream_a=True)
    return cfg


# ---------------------------------------------------------------------------------------------- launching
@functools.lru_cache(maxsize=None)
def _operand_box(rows: int, bk: int, dtype: Any, major: str, rank: int, parts: int = 1) -> tuple[tuple[int, ...], int]:
    """(TMA box, swizzle) of an operand viewed as [(B,) MN, K] (K-major) or [(B,) K, MN] (MN-major): one
    k-block of ``rows`` rows (split in ``parts`` slices) and a batch of 1."""
    swizzle = sm90.choose_swizzle(rows // parts, dtype, major)  # each slice a whole number of swizzle rows
    layout = sm90.operand_layout(rows, bk, dtype, major, swizzle)
    box, _ = sm90.operand_boxes(layout, rows, bk, dtype, major, swizzle, parts)
    return (1,) * (rank - 2) + tuple(box), swizzle


@dataclass(frozen=True)
class _Plan:
    """Everything about a call that depends only on shapes, strides and options (cached per signature)."""
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
    reduce_epilogue: Optional[Epilogue]
    # the TMA-store epilogue: the output descriptor's (box, swizzle), and the config without it for outputs
    # TMA cannot store (store_reason)
    store_box: Optional[tuple] = None
    store_swizzle: int = 0
    register_config: Optional[GemmConfig] = None
    # stream K: the sk_tiles tiles from dp_tiles on are dealt out as block_iters k-blocks per block (none: 0s)
    dp_tiles: int = 0
    block_iters: int = 0
    sk_tiles: int = 0


_CALLS: dict[tuple, Any] = {}  # call signature -> _WgmmaCall or _SkinnyCall


def _make_plan(a3: torch.Tensor, b3: torch.Tensor, has_c: bool, activation: str, config: Optional[GemmConfig],
               batched: bool, scaled: bool = False, swap: Optional[bool] = None) -> _Plan:
    batches, m, k = a3.shape
    n = b3.shape[-1]
    dtype = _DTYPES[a3.dtype]
    itemsize = a3.element_size()
    sms = plan_sm_count(a3.get_device())
    chosen = config is None  # the heuristic's config, not the caller's
    if chosen and not swap:  # unswapped when it applies
        config = token_tile_config(m, n, k, batches, itemsize, sms, _operand_major(b3, -2))
    if swap is None:
        swap = config is None and m <= 64 < n
    if config is None:
        config = small_m_config(m, n, k, batches, itemsize, sms) if swap else \
            default_config(m, n, k, batches, itemsize, sms)
    if swap:
        a3, b3 = b3.transpose(-1, -2), a3.transpose(-1, -2)
        m, n = n, m
    a_major, b_major = _operand_major(a3, -1), _operand_major(b3, -2)
    if chosen and not swap and b_major == "K":
        config = fill_wave_k_major(config, m, n, batches, itemsize, sms)
    if chosen:
        config = stream_hints(config, m, n, k, batches, itemsize, plan_l2_bytes(a3.get_device()))
    narrowest = 32 // itemsize  # an MN-major tile must span at least one 32-byte swizzle row
    if b_major == "MN" and config.bn % narrowest:
        widened = replace(config, bn=narrowest * math.ceil(config.bn / narrowest))
        # the wider tile may not fit the ring the narrower one did (128x168 with 6 stages fits, 128x176 does not)
        config = deepest_ring(widened, itemsize, "MN", most=widened.stages)
        if config is None:
            raise ValueError(f"config: widened to bn={widened.bn} for the MN-major B operand, "
                             f"{replace(widened, stages=2).check(itemsize, 'MN')}")
    bk = config.bk(itemsize)
    k_tiles = math.ceil(k / bk)
    # every split gets at least one k-block
    split = math.ceil(k_tiles / math.ceil(k_tiles / min(config.split_k, k_tiles)))
    config = replace(config, split_k=split)
    if config.tma_store and (swap or split > 1):
        # split-K stores f32 partials, and the swapped problem's output is transposed (its contiguous dim is
        # the kernel's M, which stmatrix would need .trans and a transposed box for): the register epilogue
        config = replace(config, tma_store=False)
    why = config.check(itemsize, b_major)  # a caller's config, checked against this call's B
    if why:
        raise ValueError(f"config: {why} (B is {b_major}-major here)")
    rank = 3 if batched else 2
    a_box, a_swizzle = _operand_box(config.bm, bk, dtype, a_major, rank)
    b_box, b_swizzle = _operand_box(config.bn, bk, dtype, b_major, rank, config.cluster_m)
    cm = config.cluster_m
    tiles = math.ceil(m / (config.bm * cm)) * cm * math.ceil(n / config.bn) * batches * split
    dp_tiles, block_iters = stream_k_plan(tiles, k_tiles, sms) if config.stream_k and split == 1 and cm == 1 \
        else (0, 0)
    sk_tiles = tiles - dp_tiles if block_iters else 0
    if not block_iters:
        grid = min(tiles, sms // cm * cm)
    elif dp_tiles:
        grid = sms  # the whole tiles are whole waves: dp_tiles is a multiple of the grid
    else:
        grid = math.ceil(sk_tiles * k_tiles / block_iters)  # as many blocks as k ranges
    return _Plan(config, swap, a_major, b_major, m, n, k_tiles, batches, grid,
                 128 * (1 + config.consumers), a_box, a_swizzle, b_box, b_swizzle,
                 Epilogue(has_c=has_c, activation=activation, partial=split > 1, scaled=scaled and split == 1),
                 Epilogue(has_c=has_c, activation=activation, scaled=scaled) if split > 1 else None,
                 *(store_box(config, batched) if config.tma_store else (None, 0)),
                 replace(config, tma_store=False) if config.tma_store else None, dp_tiles, block_iters, sk_tiles)


# Stream K. STREAM_K_REGION picks the tiles whose k-blocks are dealt out as contiguous ranges, one per block:
# "short-tail": a last wave at most 1/MIN_TAIL_SPLIT full after whole waves; "tail": any partial last wave
# (also a single partial wave); "tail+wave": a partial last wave and the whole wave before it (each block then
# streams more than one tile, each tile shared by 2-3 blocks); "off". A block gets at least MIN_BLOCK_ITERS
# k-blocks and a tile is shared by at most MAX_CONTRIBUTORS blocks (each adds its f32 tile to the workspace).
# Measured side by side on the H200 (benchmarks/results/gemm_stream_k_regions_h200.log): only the short tail
# pays. "tail" lost everywhere else: 336x4104x1024 209 -> 123 TFLOP/s (a ~2-3 us fix-up per shared tile: the
# workspace adds, read-back and zeroing, against a 12 us kernel), 512x7168x16384 660 -> 522 and 2048x4096x14336
# 680 -> 562 (blocks streaming one weight panel at different k offsets lose the L2 reuse of tiles that run the
# same k together), 64x6144x4096 124 -> 119; "tail+wave" lost more. The short tail: 2048x2112x7168 537 -> 679.
STREAM_K_REGIONS = ("off", "short-tail", "tail", "tail+wave")
STREAM_K_REGION = "short-tail"
MIN_TAIL_SPLIT = 8
MIN_BLOCK_ITERS = 4
MAX_CONTRIBUTORS = 16


def stream_k_plan(tiles: int, k_tiles: int, sms: int, region: Optional[str] = None) -> tuple[int, int]:
    """(dp_tiles, block_iters) of a persistent launch of ``tiles`` output tiles of ``k_tiles`` k-blocks over
    ``sms`` blocks: the first ``dp_tiles`` tiles (whole waves) run whole, the k-blocks of the rest are dealt out
    ``block_iters`` to a block in order (``region``, default STREAM_K_REGION, says which tiles); (0, 0) when
    nothing is streamed (whole waves, or a region the shape has not)."""
    region = region or STREAM_K_REGION
    if region not in STREAM_K_REGIONS:
        raise ValueError(f"stream-K region {region!r}: expected one of {STREAM_K_REGIONS}")
    full, tail = divmod(tiles, sms)
    if region == "off" or tail == 0:
        return 0, 0
    if region == "short-tail" and (full == 0 or tail > sms // MIN_TAIL_SPLIT
                                   or k_tiles < MIN_TAIL_SPLIT * MIN_BLOCK_ITERS):
        return 0, 0
    sk_tiles = tail + sms if region == "tail+wave" and full else tail
    block_iters = max(math.ceil(sk_tiles * k_tiles / sms), math.ceil(k_tiles / MAX_CONTRIBUTORS), MIN_BLOCK_ITERS)
    return tiles - sk_tiles, block_iters


def store_reason(out3: torch.Tensor) -> Optional[str]:
    """None when the TMA-store epilogue can write the 3-D output view ``out3`` ([B, M, N] as the kernel sees
    it), else why the register epilogue stores it instead."""
    if out3.element_size() != 2:
        return "the TMA-store epilogue stores 16-bit outputs (stmatrix); f32 goes through registers"
    if out3.stride(-1) != 1 and out3.shape[-1] != 1:
        return "the output's last dimension is not contiguous"
    if out3.shape[-1] * out3.element_size() % 16:
        # seen on the H200: with such an extent the TMA store also wrote the columns just past it (the
        # padding of a strided view), so only whole 16-byte rows are stored through TMA
        return "the output's rows are not a multiple of 16 bytes long"
    return _tma_reason("out", out3, -1)


def _skinny_wanted(a: torch.Tensor, b: torch.Tensor, config: Any, skinny: Optional[bool]) -> bool:
    """Whether this call runs the skinny kernel: forced by ``skinny=True`` or a SkinnyConfig (an error when it
    cannot), else automatic when no GemmConfig is given for at most SKINNY_MAX_M rows with a column-major B, and
    with a 16-byte aligned row-major B at most SKINNY_MAX_M_ROW_B rows (SKINNY_MAX_M_COLUMN_TOKENS when A is
    column-major)."""
    forced = skinny is True or isinstance(config, SkinnyConfig)
    if skinny is False or isinstance(config, GemmConfig):
        if forced:
            raise ValueError("nvfly.ops.gemm.matmul: skinny=True contradicts a GemmConfig or skinny=False")
        return False
    why = gemm_skinny.reason(a, b)
    if forced and why:
        raise ValueError(f"nvfly.ops.gemm.matmul: the skinny kernel cannot run this: {why}")
    m, b_major = a.shape[-2], gemm_skinny.b_major(b)
    if b_major == "col":
        limit = SKINNY_MAX_M if a.shape[-1] >= SKINNY_SHORT_K else SKINNY_MAX_M_SHORT_K
    else:
        limit = SKINNY_MAX_M_COLUMN_TOKENS if m > 1 and a.stride(-2) == 1 else SKINNY_MAX_M_ROW_B
    return forced or (why is None and m <= limit)


def _new_plan(a: torch.Tensor, b: torch.Tensor, use_c: bool, activation: str, out_dtype: Optional[torch.dtype],
              c: Optional[torch.Tensor], config: Any, skinny: Optional[bool],
              scaled: bool, swap: Optional[bool] = None) -> Union[_Plan, SkinnyPlan]:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    reason = eligibility(a, b, c, out_dtype)
    if reason:
        raise ValueError(f"nvfly.ops.gemm.matmul: {reason}")
    return _eligible_plan(a, b, use_c, activation, config, skinny, scaled, swap)


def _eligible_plan(a: torch.Tensor, b: torch.Tensor, use_c: bool, activation: str, config: Any,
                   skinny: Optional[bool], scaled: bool, swap: Optional[bool]) -> Union[_Plan, SkinnyPlan]:
    """``_new_plan`` past its checks (operands of any device, meta included: plans read shapes and strides)."""
    if swap is not None and (skinny or isinstance(config, SkinnyConfig)):
        raise ValueError("nvfly.ops.gemm.matmul: swap applies to the wgmma kernel, not to the skinny kernel")
    a3, b3 = (a, b) if a.dim() == 3 else (a.unsqueeze(0), b.unsqueeze(0))
    if _skinny_wanted(a, b, config, False if swap is not None else skinny):
        batches, m, k = a3.shape
        return gemm_skinny.make_plan(m, b3.shape[-1], k, batches, use_c, activation, scaled, config,
                                     plan_sm_count(a.get_device()),
                                     row_b=gemm_skinny.b_major(b) == "row")
    return _make_plan(a3, b3, use_c, activation, config, a.dim() == 3, scaled=scaled, swap=swap)


def matmul(a: torch.Tensor, b: torch.Tensor, *, c: Optional[torch.Tensor] = None, alpha: float = 1.0,
           beta: float = 1.0, activation: str = "none", out_dtype: Optional[torch.dtype] = None,
           out: Optional[torch.Tensor] = None, config: Union[GemmConfig, SkinnyConfig, None] = None,
           skinny: Optional[bool] = None, swap: Optional[bool] = None) -> torch.Tensor:
    """act(alpha * a @ b + beta * c) for 2-D or batched 3-D bf16/fp16 operands (fp32 accumulation).

    ``skinny``: None picks the kernel, True forces the skinny kernel (as does a SkinnyConfig ``config``),
    False the wgmma kernel. ``swap``: None computes small M as the transposed problem when no config is given,
    True always does (``config`` then applies to the transposed problem), False never."""
    use_c = c is not None and beta != 0
    call = bind(a, b, c=c if use_c else None, scaled=alpha != 1.0, activation=activation, out_dtype=out_dtype,
                out=out, config=config, skinny=skinny, swap=swap)
    if out is None:
        out = torch.empty(call.shape, dtype=call.out_dtype, device=a.device)
    call.run(a, b, c if use_c else None, out, alpha, beta)
    return out


def bind(a: torch.Tensor, b: torch.Tensor, *, c: Optional[torch.Tensor] = None, scaled: bool = False,
         activation: str = "none", out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None,
         config: Union[GemmConfig, SkinnyConfig, None] = None, skinny: Optional[bool] = None,
         swap: Optional[bool] = None) -> Any:
    """The launches of ``matmul`` for operands laid out like these (cached per call signature), as an object
    with ``shape``, ``out_dtype`` and ``run(a, b, c, out, alpha, beta)``: out = act(alpha * a @ b + beta * c)
    for tensors of the same layouts as the bound ones (c given iff bound with one; alpha other than 1 only when
    ``scaled``; ``out`` as bound, or a new contiguous tensor when bound with None). After its first launch a
    call reads only the tensors' addresses. Raises ValueError (naming the argument) when nvfly cannot run it."""
    # everything that decides the kernels and their launch
    key = (layout_key(a), layout_key(b), layout_key(c), layout_key(out), activation, out_dtype, config, scaled,
           skinny, swap)
    call = _CALLS.get(key)
    if call is None:
        shape = (a.shape[0], a.shape[1], b.shape[2]) if a.dim() == 3 else (a.shape[0], b.shape[1])
        if a.dim() == b.dim() and a.dim() in (2, 3) and a.shape[-1] == b.shape[-2] and 0 in (*shape[-2:], a.shape[-1]):
            call = _EmptyCall(shape, out_dtype or a.dtype, activation)
        else:
            plan = _new_plan(a, b, c is not None, activation, out_dtype, c, config, skinny, scaled, swap)
            out_dtype = out_dtype or a.dtype
            if out is not None and (out.shape != shape or out.dtype != out_dtype or out.device != a.device):
                raise ValueError(f"out: expected a {out_dtype} tensor of shape {shape} on {a.device}, got "
                                 f"{out.dtype} {tuple(out.shape)} on {out.device}")
            call = _SkinnyCall(plan, shape, out_dtype) if type(plan) is SkinnyPlan else \
                _WgmmaCall(plan, out, shape, out_dtype)
        if len(_CALLS) >= _CALL_LIMIT:
            _CALLS.clear()
        _CALLS[key] = call
    return call


_CALL_LIMIT = 4096


class _EmptyCall:
    """M, N or K of zero: no kernel (an empty output, or beta * C through the activation)."""

    def __init__(self, shape: tuple, out_dtype: torch.dtype, activation: str):
        self.shape = shape
        self.out_dtype = out_dtype
        self.activation = activation

    def run(self, a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], out: torch.Tensor, alpha: float,
            beta: float) -> None:
        result = torch.zeros(self.shape, dtype=torch.float32, device=a.device)
        if c is not None:
            result = result + beta * c.float()
        out.copy_(_torch_activation(result, self.activation))


class _SkinnyCall:
    """The skinny kernel's launch for one call signature (``bind``'s cache)."""

    def __init__(self, plan: SkinnyPlan, shape: tuple, out_dtype: torch.dtype):
        self.shape = shape
        self.out_dtype = out_dtype
        self.run = gemm_skinny.prepared_launch(plan, shape)


class _WgmmaCall:
    """The wgmma kernel's launches for one call signature (``bind``'s cache): prepared launches, and the TMA
    descriptors of the operands' addresses seen (everything else about them is fixed by the signature)."""

    def __init__(self, plan: _Plan, out: Optional[torch.Tensor], shape: tuple, out_dtype: torch.dtype):
        self.plan = plan
        self.shape = shape
        self.out_dtype = out_dtype
        self.batched = len(shape) == 3
        cfg = plan.config
        if cfg.tma_store:
            probe = out if out is not None else torch.empty(shape, dtype=out_dtype, device="meta")
            probe3 = probe if self.batched else probe.unsqueeze(0)
            if store_reason(probe3.transpose(-1, -2) if plan.swap else probe3) is not None:
                cfg = plan.register_config
        self.config = cfg
        self.tma_store = cfg.tma_store
        self.main = gemm_kernel.prepared(plan.grid, plan.threads, (cfg.cluster_m, 1, 1))
        # split K: f32 partials laid out like the caller's output (a swapped plan writes their transpose), so that
        # the reduce kernel reads and writes both in memory order, several elements of a row per thread
        self.out_m, self.out_n = (plan.n, plan.m) if plan.swap else (plan.m, plan.n)
        self.reduce_vec = 1
        self.reduce = None
        if plan.reduce_epilogue is not None:
            if out is None or out.stride(-1) == 1:  # None: a new contiguous output
                self.reduce_vec = vector_width(self.out_n, (out,), out_dtype.itemsize)
            self.reduce = split_k_reduce_kernel.prepared(
                (math.ceil(plan.m * plan.n / (REDUCE_THREADS * self.reduce_vec)), plan.batches), REDUCE_THREADS)
        self.partial_sums = plan.batches * cfg.split_k * plan.m * plan.n if self.reduce is not None else 0
        # stream K: one workspace slot and arrival count per streamed consumer tile
        self.sk_slots = plan.sk_tiles * (1 if cfg.pingpong else cfg.consumers)
        self.slot_sums = cfg.wg_m * cfg.bn
        self._descriptors: dict[tuple[int, int, int], tuple] = {}

    def run(self, a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], out: torch.Tensor, alpha: float,
            beta: float) -> None:
        plan = self.plan
        cfg = self.config
        addresses = (a.data_ptr(), b.data_ptr(), out.data_ptr() if self.tma_store else 0)
        descs = self._descriptors.get(addresses)
        sums = counts = partials = None
        if self.sk_slots:
            sums, counts = scratch.workspace(a.device, current_stream(a.device.index), self.sk_slots,
                                             self.slot_sums)
        if self.partial_sums:
            partials = scratch.partials(a.device, current_stream(a.device.index), self.partial_sums)
        if descs is not None and self.main.warm and (self.reduce is None or self.reduce.warm):
            # the generated launches read only addresses: the kernels' 3-D (transposed, broadcast) views of out,
            # C and the partials start where out, C and the flat buffer do
            a_desc, b_desc, out_desc = descs
            if partials is None:
                self.main(a_desc, b_desc, out, c, out_desc, plan.m, plan.n, plan.k_tiles, plan.batches, alpha, beta,
                          sums, counts, plan.dp_tiles, plan.block_iters, cfg, plan.a_major, plan.b_major,
                          plan.epilogue)
            else:
                self.main(a_desc, b_desc, partials, None, None, plan.m, plan.n, plan.k_tiles, plan.batches, 1.0,
                          0.0, None, None, 0, 0, cfg, plan.a_major, plan.b_major, plan.epilogue)
                self.reduce(partials, out, c, self.out_m, self.out_n, alpha, beta, cfg.split_k,
                            plan.reduce_epilogue, self.reduce_vec)
            return
        a3, b3 = (a, b) if self.batched else (a.unsqueeze(0), b.unsqueeze(0))
        out3 = out if self.batched else out.unsqueeze(0)
        c3 = None if c is None else (c.expand(self.shape) if self.batched else c.expand(self.shape).unsqueeze(0))
        if partials is not None:
            partials = partials[:self.partial_sums].view(plan.batches * cfg.split_k, self.out_m, self.out_n)
            reduce_out3, reduce_c3 = out3, c3
        if plan.swap:
            a3, b3 = b3.transpose(-1, -2), a3.transpose(-1, -2)
            out3 = out3.transpose(-1, -2)
            c3 = c3.transpose(-1, -2) if c3 is not None else None
        if descs is None:
            descs = self._describe(a3, b3, out3)
            if len(self._descriptors) >= 64:
                self._descriptors.clear()
            self._descriptors[addresses] = descs
        a_desc, b_desc, out_desc = descs
        if partials is None:
            self.main(a_desc, b_desc, out3, c3, out_desc, plan.m, plan.n, plan.k_tiles, plan.batches, alpha, beta,
                      sums, counts, plan.dp_tiles, plan.block_iters, cfg, plan.a_major, plan.b_major, plan.epilogue)
            return
        self.main(a_desc, b_desc, partials.transpose(-1, -2) if plan.swap else partials, None, None, plan.m, plan.n,
                  plan.k_tiles, plan.batches, 1.0, 0.0, None, None, 0, 0, cfg, plan.a_major, plan.b_major,
                  plan.epilogue)
        self.reduce(partials, reduce_out3, reduce_c3, self.out_m, self.out_n, alpha, beta, cfg.split_k,
                    plan.reduce_epilogue, self.reduce_vec)

    def _describe(self, a3: torch.Tensor, b3: torch.Tensor, out3: torch.Tensor) -> tuple:
        plan = self.plan
        a_desc, b_desc = _descriptors(plan, a3, b3, self.batched)
        out_desc = cached_descriptor(out3 if self.batched else out3[0], plan.store_box, plan.store_swizzle) \
            if self.tma_store else None
        return a_desc, b_desc, out_desc


def path(a: torch.Tensor, b: torch.Tensor, *, c: Optional[torch.Tensor] = None, activation: str = "none",
         out_dtype: Optional[torch.dtype] = None, config: Union[GemmConfig, SkinnyConfig, None] = None,
         skinny: Optional[bool] = None, scaled: bool = False, swap: Optional[bool] = None) -> str:
    """Which kernel ``matmul`` runs for these operands (for benchmarks): 'skinny' (with '-rowB' for a row-major
    B and '-splitK<s>' when they apply), or 'wgmma' with '-swapAB', '-splitK<s>' and
    '-streamK<tiles>x<k-blocks per block>' when they apply; raises when matmul would."""
    return _plan_name(_new_plan(a, b, c is not None, activation, out_dtype, c, config, skinny, scaled, swap))


def _plan_name(plan: Union[_Plan, SkinnyPlan]) -> str:
    if isinstance(plan, SkinnyPlan):
        return "skinny" + ("-rowB" if plan.row_b else "") + \
            (f"-splitK{plan.config.splits}" if plan.config.splits > 1 else "")
    return "wgmma" + ("-swapAB" if plan.swap else "") + \
        (f"-splitK{plan.config.split_k}" if plan.config.split_k > 1 else "") + \
        (f"-streamK{plan.sk_tiles}x{plan.block_iters}" if plan.block_iters else "")


def dense_operand(batches: int, rows: int, cols: int, last_contiguous: bool,
                  make: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
    """A densely packed [(batches,) rows, cols] matrix whose last dimension is contiguous, or whose rows are (a
    transposed view), on a contiguous tensor from ``make(shape)`` (it chooses the device, dtype and values)."""
    t = make((batches, rows, cols) if last_contiguous else (batches, cols, rows))
    t = t if last_contiguous else t.transpose(-1, -2)
    return t if batches > 1 else t[0]


def describe(m: int, n: int, k: int, *, batches: int = 1, dtype: torch.dtype = torch.bfloat16,
             majors: tuple[str, str] = ("K", "K")) -> str:
    """What ``matmul`` runs without a config on densely packed ``[batches x] m x n x k`` operands (A: [M, K], B:
    [K, N], each "K"- or "MN"-major), eligibility aside and planned for an H100/H200 (132 SMs, 50 MiB of L2; no GPU
    needed): the kernel as ``path`` names it, then its tile and what the heuristic added, e.g. "wgmma: 64x80 tile
    on 128 blocks, 12 stages, TMA-store epilogue, B streamed (L2 evict_first)"."""
    def meta(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")
    a = dense_operand(batches, m, k, majors[0] == "K", meta)
    b = dense_operand(batches, k, n, majors[1] == "MN", meta)
    plan = _eligible_plan(a, b, False, "none", None, None, False, None)
    if isinstance(plan, SkinnyPlan):
        return f"{_plan_name(plan)}: {plan.config}"
    cfg = plan.config
    what = [f"{cfg.bm}x{cfg.bn} tile" + (" of the transposed problem" if plan.swap else "") +
            f" on {plan.grid} block{'s' if plan.grid != 1 else ''}", f"{cfg.stages} stages"]
    what += ["ping-pong consumers"] if cfg.pingpong else []
    what += [f"{cfg.cluster_m}-block clusters"] if cfg.cluster_m > 1 else []
    what += ["TMA-store epilogue"] if cfg.tma_store else []
    what += [f"{operand_name} streamed (L2 evict_first)" for operand_name, on in (("A", cfg.stream_a),
                                                                               ("B", cfg.stream_b)) if on]
    return f"{_plan_name(plan)}: " + ", ".join(what)


def _descriptors(plan: _Plan, a3: torch.Tensor, b3: torch.Tensor, batched: bool) -> tuple[Any, Any]:
    """TMA descriptors of the (possibly swapped) 3-D operands, viewed with their contiguous dim last."""
    a_view = a3 if plan.a_major == "K" else a3.transpose(-1, -2)
    b_view = b3.transpose(-1, -2) if plan.b_major == "K" else b3
    if not batched:
        a_view, b_view = a_view[0], b_view[0]
    return (cached_descriptor(a_view, plan.a_box, plan.a_swizzle),
            cached_descriptor(b_view, plan.b_box, plan.b_swizzle))


def _torch_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(x)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(x)
    return x


def reference(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None, alpha: float = 1.0,
              beta: float = 1.0, activation: str = "none") -> torch.Tensor:
    """The float32 reference of ``matmul`` (for tests and benchmarks)."""
    r = alpha * (a.float() @ b.float())
    if c is not None:
        r = r + beta * c.float()
    return _torch_activation(r, activation)


def compile_configs(configs: Sequence[GemmConfig], dtype: torch.dtype = torch.bfloat16,
                    majors: Sequence[tuple[str, str]] = (("K", "MN"),), target: str = "sm_90a",
                    epilogue: Optional[Epilogue] = None, batched: bool = False,
                    out_dtype: Optional[torch.dtype] = None, stream_k: bool = False) -> list[Any]:
    """Compile the kernel for each config and operand major-ness it supports (no GPU needed); returns
    CompiledKernels. ``epilogue`` (default: none, or partials for split K) with a C input of the output's
    shape when it has one; ``batched``: rank-3 descriptors; ``out_dtype``: default ``dtype``; ``stream_k``:
    with the stream-K tail's fix-up (configs without split K or a cluster)."""
    from nvfly.runtime.torch_args import TensorDesc
    nv = _DTYPES[dtype]
    out_nv = {torch.float32: nvfly.f32, None: nv}.get(out_dtype) or _DTYPES[out_dtype]
    rank = 3 if batched else 2
    shape = (2,) * batched + (4096, 4096)
    kernels = []
    for cfg in configs:
        bk = cfg.bk(nv.itemsize)
        for a_major, b_major in majors:
            if cfg.check(nv.itemsize, b_major):
                continue
            a_box, a_sw = _operand_box(cfg.bm, bk, nv, a_major, rank)
            b_box, b_sw = _operand_box(cfg.bn, bk, nv, b_major, rank, cfg.cluster_m)
            a_desc = nvfly.TmaDescriptor(TensorDesc(nv, shape), a_box, swizzle=a_sw)
            b_desc = nvfly.TmaDescriptor(TensorDesc(nv, shape), b_box, swizzle=b_sw)
            epi = epilogue or Epilogue(partial=cfg.split_k > 1)
            out = TensorDesc(out_nv if cfg.split_k == 1 else nvfly.f32, (2 if batched else 1, 4096, 4096))
            c_in = TensorDesc(nv, (2 if batched else 1, 4096, 4096)) if epi.has_c else None
            out_desc = None
            if cfg.tma_store and cfg.split_k == 1:
                if out_nv.itemsize != 2:
                    cfg = replace(cfg, tma_store=False)
                else:
                    box, sw = store_box(cfg, batched)
                    out_desc = nvfly.TmaDescriptor(TensorDesc(out_nv, shape), box, swizzle=sw)
            tail = stream_k and cfg.split_k == 1 and cfg.cluster_m == 1
            sums = TensorDesc(nvfly.f32, (1 << 24,)) if tail else None
            counts = TensorDesc(nvfly.i32, (1024,)) if tail else None
            kernels.append(gemm_kernel.compile(
                a_desc, b_desc, out, c_in, out_desc, 4096, 4096, 64, 2 if batched else 1, 1.0, 0.0, sums, counts,
                0, 0, CFG=cfg,
                A_MAJOR=a_major, B_MAJOR=b_major, EPI=epi, block=128 * (1 + cfg.consumers),
                cluster=(cfg.cluster_m, 1, 1), target=target))
    return kernels
