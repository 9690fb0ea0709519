"""MXFP4 weights x 16-bit (bf16 / fp16) activations: the streaming kernel's config and plan. Pure Python.

The kernel (``a16_kernel``) gives each CTA 16 output columns (weight rows) and a block of up to 16 tokens; its warps
split the CTA's K range in chunks of 128 k (64 bytes of every weight row), ``stages - 1`` chunks in flight per warp
(a cp.async ring; or ``unroll`` at a time loaded into registers).
Heuristic: one CTA per 16 weight rows and token block (token blocks vary fastest, so the CTAs that share weight rows
run together and all but the first read them from L2); while that gives fewer than ``FILL_CTAS`` CTAs per SM, K is
split over more CTAs (f32 partial sums, then the scaled GEMM's reduce kernel adds them and the bias), each split at
least ``SPLIT_MIN_CHUNKS`` chunks per warp, at most ``SPLIT_MAX`` splits. Large M re-reads the weights once per
16 tokens (from L2 while the token blocks of a weight row run together): correct for any M, fast for M <= 16
(docs/ops/scaled.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

CHUNK_K = 128      # k per chunk: 4 lanes x 32 k (one MX block each) of 16 weight rows, 64 bytes a row
LANE_K = 32        # k per lane and chunk: one 16-byte load of a weight row, one e8m0 scale
ROWS = 16          # weight rows (output columns) per CTA: the mma's M
TOKEN_BLOCK = 16   # tokens per CTA: two n8 mma tiles
FILL_CTAS = 2      # split K while the CTAs are fewer than this many per SM
SPLIT_MIN_CHUNKS = 2
SPLIT_MAX = 16
RING_CHUNK_BYTES = 32 * 2 * 16  # a warp's chunk in its cp.async ring: each lane's 16 bytes of two weight rows
# A16Config.tma_stages: a stage is TMA_CHUNKS chunks of the CTA's 16 weight rows (two 16 x 128-byte boxes, 128-byte
# swizzled) and their scale bytes (a 16 x 16-byte box), padded to whole 1024-byte swizzle atoms; barriers first
TMA_CHUNKS = 4
TMA_BOX_BYTES = 128
TMA_WEIGHT_BYTES = ROWS * TMA_CHUNKS * CHUNK_K // 2
TMA_SCALE_BYTES = ROWS * TMA_CHUNKS * CHUNK_K // LANE_K
TMA_STAGE_BYTES = 5 * 1024
TMA_BARRIER_BYTES = 1024
TMA_K_ALIGN = TMA_CHUNKS * CHUNK_K  # the scales' row stride (K / 32 bytes) a multiple of TMA's 16 bytes
STATIC_SMEM = 48 * 1024
# the weight's order in each 32-bit word (quantize.shuffle_mxfp4_a16): torch's nibbles, nibbles paired as the tokens'
# words, or the bit-shuffled layout of one activation dtype (fewer conversion ops)
LAYOUTS = ("natural", "shuffled", "shuffled-bf16", "shuffled-f16")


@dataclass(frozen=True)
class A16Config:
    """``warps`` per CTA (splitting its K range); ``stages``: each warp streams its chunks through a private ring of
    that many cp.async stages (``stages - 1`` chunks in flight while one is converted), or, with 0, loads ``unroll``
    chunks at a time straight into registers (ptxas may then delay the later loads past the first chunk's math);
    ``splits`` CTAs sharing one tile's K range (0: the heuristic's); ``wide_scales``: a second packed multiply per
    converted word so that e8m0 scales past 2 (bytes > 128) are exact too (without it they poison the output with
    inf/NaN; about a fifth more instructions); ``layout``: "natural" (torch's nibble order), or the weight given as
    ``shuffle_mxfp4_a16(w_q, layout)`` returns it: "shuffled" (k 2i and 2i + 1 at nibbles i and i + 4 of each
    32-bit word: the conversion's pairs are the tokens' natural words, no ``prmt``), "shuffled-bf16" /
    "shuffled-f16" (bit-shuffled for that activation dtype: the same pairs in fewer integer ops); ``ahead`` (with
    ``stages`` 0): each group of ``unroll`` chunks is loaded before the previous group's math (twice the weight
    registers); ``tma_stages`` (> 0, instead of both): a producer warp TMA-loads the CTA's weight rows and scales
    ``TMA_CHUNKS`` chunks a stage into a ring of that many stages shared by the warps (each takes whole stages
    round robin and reads its lanes' bytes back from shared memory), so that the loads in flight do not depend on
    how ptxas schedules register loads; K a multiple of ``TMA_K_ALIGN``."""
    warps: int = 4
    unroll: int = 4
    splits: int = 0
    wide_scales: bool = False
    # the registers mainloop: 1.0-1.6x the 8-stage ring on every row measured (docs/ops/scaled.md)
    stages: int = 0
    layout: str = "natural"
    ahead: bool = False
    tma_stages: int = 0

    @property
    def static_smem_bytes(self) -> int:
        """The CTA's static shared memory: the warps' cp.async rings and the partial tiles' reduction (with
        ``tma_stages`` all of it is dynamic)."""
        if self.tma_stages:
            return 0
        return self.warps * (self.stages * RING_CHUNK_BYTES + ROWS * TOKEN_BLOCK * 4)

    @property
    def dynamic_smem_bytes(self) -> int:
        """With ``tma_stages``: the ring's barriers, its stages, then the partial tiles' reduction."""
        if not self.tma_stages:
            return 0
        return TMA_BARRIER_BYTES + self.tma_stages * TMA_STAGE_BYTES + self.warps * ROWS * TOKEN_BLOCK * 4

    @property
    def threads(self) -> int:
        """The warps, and with ``tma_stages`` the producer warp."""
        return 32 * (self.warps + (1 if self.tma_stages else 0))

    def check(self) -> Optional[str]:
        if self.warps not in (1, 2, 4, 8):
            return f"warps={self.warps}: 1, 2, 4 or 8"
        if not 1 <= self.unroll <= 8:
            return f"unroll={self.unroll}: 1 to 8"
        if not 0 <= self.splits <= 32:
            return f"splits={self.splits}: 0 (the heuristic's) to 32"
        if self.layout not in LAYOUTS:
            return f"layout={self.layout!r}: one of {LAYOUTS}"
        if self.ahead and self.stages:
            return f"ahead=True: the registers mainloop's (stages=0), got stages={self.stages}"
        if self.stages == 1 or self.stages < 0:
            return f"stages={self.stages}: 0 (weights loaded into registers) or a ring of at least 2"
        if self.tma_stages and (self.stages or self.ahead):
            return f"tma_stages={self.tma_stages}: instead of stages / ahead, got stages={self.stages}, " \
                   f"ahead={self.ahead}"
        if self.tma_stages and not (self.tma_stages <= 32 and self.tma_stages % self.warps == 0):
            # warp w takes stages w, w + warps, ...: each slot then serves one warp, so no waiter runs two phases
            # ahead of a slot (an mbarrier parity wait cannot tell phase p from p + 2)
            return f"tma_stages={self.tma_stages}: 0 (off) or a multiple of warps={self.warps} up to 32"
        if self.static_smem_bytes > STATIC_SMEM:
            return (f"warps={self.warps} x stages={self.stages}: {self.static_smem_bytes} bytes of static shared "
                    f"memory exceed {STATIC_SMEM}")
        return None


@dataclass(frozen=True)
class A16Plan:
    """One call signature's launch: ``m_tiles`` n8 token tiles per CTA (1 for M <= 8), ``token_blocks`` blocks of 16
    tokens, ``groups`` of 16 weight rows, ``splits`` K ranges of ``chunks_per_split`` full chunks (the last split
    also takes a partial chunk), ``grid`` = groups x splits x token_blocks CTAs of ``threads``."""
    config: A16Config
    m: int
    n: int
    k: int
    m_tiles: int
    token_blocks: int
    groups: int
    splits: int
    chunks_per_split: int
    grid: int
    threads: int

    @property
    def partial(self) -> bool:
        return self.splits > 1

    @property
    def kernel_config(self) -> A16Config:
        """The config as the kernel is compiled for it: the split count is a runtime argument."""
        return replace(self.config, splits=0)


def make_a16_plan(m: int, n: int, k: int, config: Optional[A16Config], sms: int) -> A16Plan:
    """The plan of an m x n x k call (``config`` None: the heuristic's warps and unroll; splits 0: its split)."""
    config = config or A16Config()
    why = config.check()
    if not why and config.tma_stages and k % TMA_K_ALIGN:
        why = f"tma_stages: K={k} must be a multiple of {TMA_K_ALIGN} (the scales' rows, K / 32 bytes, TMA's 16)"
    if why:
        raise ValueError(f"config: {why}")
    token_blocks = max(1, math.ceil(m / TOKEN_BLOCK))  # M or N 0: a one-CTA plan that the call never launches
    groups = max(1, math.ceil(n / ROWS))
    full = k // CHUNK_K
    splits = config.splits
    if splits == 0:
        ctas = groups * token_blocks
        splits = 1
        if ctas < FILL_CTAS * sms:
            splits = max(1, min(math.ceil(FILL_CTAS * sms / ctas), full // (config.warps * SPLIT_MIN_CHUNKS),
                                SPLIT_MAX))
    chunks_per_split = math.ceil(full / splits) if full else 0
    if config.tma_stages:  # a split starts on a stage: TMA's boxes start on 16 bytes of the scale rows
        chunks_per_split = -(-chunks_per_split // TMA_CHUNKS) * TMA_CHUNKS
    if chunks_per_split:
        splits = math.ceil(full / chunks_per_split)  # every split holds a chunk
    else:
        splits = 1
    config = replace(config, splits=splits)
    return A16Plan(config=config, m=m, n=n, k=k, m_tiles=1 if m <= 8 else 2, token_blocks=token_blocks,
                   groups=groups, splits=splits, chunks_per_split=chunks_per_split,
                   grid=groups * splits * token_blocks, threads=config.threads)


def describe_a16_plan(plan: A16Plan) -> str:
    cfg = plan.config
    name = "mxfp4-a16-stream" + ("-wide" if cfg.wide_scales else "") + \
        ("" if cfg.layout == "natural" else f"-{cfg.layout}") + \
        (f"-splitK{plan.splits}" if plan.splits > 1 else "")
    flight = f"{cfg.stages}-stage cp.async ring per warp" if cfg.stages else \
        f"{cfg.unroll} chunks into registers per warp" + (", the next group loaded ahead" if cfg.ahead else "")
    if cfg.tma_stages:
        flight = f"{cfg.tma_stages}-stage TMA ring of {TMA_CHUNKS} chunks shared by the warps (a producer warp)"
    blocks = "" if plan.token_blocks == 1 else \
        f", {plan.token_blocks} token blocks (M > {TOKEN_BLOCK}: the weight streamed per block, no wgmma mainloop yet)"
    return (f"{name}: {ROWS} weight rows x {8 * plan.m_tiles} tokens per CTA, {plan.grid} CTAs of {cfg.warps} warps, "
            f"{flight} (chunks of {CHUNK_K} k){blocks}")
