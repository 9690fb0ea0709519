"""What runs for one grouped scaled GEMM call signature: the tile heuristic and the plan (host logic on shapes and
strides; the group sizes stay on the device).

Heuristic: the promoted mainloop keeps two accumulators per consumer (the fp32 sums and a k-block's partial), so
tiles are at most 128 columns (block scales also need a tile's columns inside one 128-wide weight block). Groups of
up to ``SMALL_GROUP_ROWS`` rows on average (decode: the weights are streamed once, memory-bound) take a 64-row tile
on one consumer warpgroup with a deep ring; more rows the 128 x 128 tile on two consumers (as the dense scaled
GEMM's promoted tile). MX scales promote every k-step, in order: 64 x 64 for decode (64 x 128 on one consumer
spills with MX's column scales) or 128 x 128, MXFP4 weights with the packed B tile in every stage
(``ScaledConfig.packed_b``). The ring is as deep as shared memory holds next to the group table. Measurements:
docs/ops/scaled.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from nvfly.ops.common.gemm_config import BARRIER_BYTES, SMEM_LIMIT, store_box
from nvfly.ops.common.groups import table_bytes
from nvfly.ops.scaled.config import (BK, MX, SCALE_ALIGN, SCALE_SLOT, ScaledConfig, ScaledEpilogue,
                                     weight_scales_reason)
from nvfly.ops.scaled.grouped_kernel import GROUPED_LAYOUTS, GROUPED_SCALINGS
from nvfly.ops.scaled.plan import ScaledPlan

MAX_GROUPS = 1024      # the group table lives in shared memory (torch's limit too)
SMALL_GROUP_ROWS = 64  # at most this many rows a group on average: the 64-row tile
MAX_STAGES = 12


@dataclass(frozen=True)
class ScaledGroupedPlan(ScaledPlan):
    """How the grouped scaled kernel runs one call signature: the scaled GEMM's plan fields (never swapped; m the
    rows bound, T or Mmax; ``grid`` from an upper bound on the tiles: blocks past the real count exit at once) with
    the ``layout`` ("contiguous" or "masked") and the ``groups``; ``store_box``: the TMA-store epilogue's output
    (box, swizzle) (``config.tma_store``; the contiguous output's descriptor is 2-D [T, N])."""
    layout: str = "contiguous"
    groups: int = 1

    @property
    def smem_bytes(self) -> int:
        return self.config.smem_bytes() + table_bytes(self.groups)

    @property
    def scale_rows(self) -> int:
        """The staged scales' TMA box rows (``config.staged_scales``): bm, or bm + SCALE_ALIGN on the contiguous
        layout (its box starts at the tile's first row rounded down to 16 bytes)."""
        return self.config.bm + (SCALE_ALIGN if self.layout == "contiguous" else 0)


def fits(cfg: ScaledConfig, groups: int, epilogue: ScaledEpilogue) -> Optional[str]:
    """None if the grouped kernel compiles ``cfg`` with ``groups`` groups' table and ``epilogue``, else why not."""
    why = cfg.check(epilogue.promote)
    if why:
        return why
    if cfg.cluster_n not in (1, 2):
        return f"cluster_n={cfg.cluster_n}: the grouped scaled kernel runs 1 or 2 blocks per cluster"
    if cfg.split_k != 1:
        return "the grouped scaled kernel runs without K splits"
    if cfg.packed_b != (epilogue.scaling == "mxfp4"):
        return f"packed_b with {epilogue.scaling} scales: only MXFP4 weights arrive packed (and always do)"
    if epilogue.scaling in MX and cfg.issue_ahead:
        return "issue_ahead with MX scales: they promote every k-step, not k-blocks"
    if cfg.packed_b and cfg.skip_empty:  # both consumers convert each stage and meet on a named barrier
        return "skip_empty with packed (MXFP4) weights: every consumer converts its share of each stage"
    if cfg.staged_scales and epilogue.scaling != "block":
        return f"staged_scales: the producer stages block scales' 1x128 activation scales, not {epilogue.scaling}"
    if epilogue.scaling == "block" and weight_scales_reason(cfg.bn):
        return weight_scales_reason(cfg.bn)
    if cfg.smem_bytes() + table_bytes(groups) > SMEM_LIMIT:
        return f"{cfg.smem_bytes() + table_bytes(groups)} bytes of shared memory exceed {SMEM_LIMIT}"
    return None


def deepest(cfg: ScaledConfig, groups: int) -> ScaledConfig:
    """``cfg`` with the deepest ring (at most MAX_STAGES) that fits next to the group table (and the TMA-store
    staging buffers)."""
    room = SMEM_LIMIT - BARRIER_BYTES - table_bytes(groups) - cfg.staging_bytes()
    return replace(cfg, stages=max(2, min(MAX_STAGES, room // cfg.stage_bytes)))


def heuristic_config(rows_per_group: float, groups: int, epilogue: ScaledEpilogue) -> ScaledConfig:
    """The tile of groups of ``rows_per_group`` rows on average (see the module doc); block scales on the 128-row
    tile: 128 x 192 with the TMA-store epilogue in 2-block clusters along N, the activation scales staged by TMA
    (796 / 771 TFLOP/s, 1.02x / 1.06x unstaged, on DeepSeek-V3's gate/up and down at 4096 tokens, docs/ops/scaled.md;
    ``fallback_config`` where the output takes no TMA store; ``_plan`` unstages scales TMA cannot load); MX scales
    64 x 64 or 128 x 128 with the TMA store, in order, MXFP4's packed B tile in every stage."""
    if epilogue.scaling in MX:  # in order (a promotion per k-step); 64 x 128 on one consumer spilled, 64 x 64 not
        tile = ScaledConfig(64, 64, 2, 1) if rows_per_group <= SMALL_GROUP_ROWS else \
            ScaledConfig(128, 128, 2, 2, tma_store=True)
        return deepest(replace(tile, packed_b=epilogue.scaling == "mxfp4"), groups)
    if rows_per_group <= SMALL_GROUP_ROWS:
        return deepest(ScaledConfig(64, 128, 2, 1), groups)
    if epilogue.scaling == "block":
        return deepest(ScaledConfig(128, 192, 2, 2, tma_store=True, cluster_n=2, staged_scales=True), groups)
    return fallback_config(groups, epilogue)


def fallback_config(groups: int, epilogue: ScaledEpilogue) -> ScaledConfig:
    """The 128-row tile where the heuristic's TMA store cannot run (f32 or unaligned outputs): 128 x 128, block
    scales issuing k-block k + 1's wgmmas before k's promotion (1.06x the serial walk)."""
    return deepest(ScaledConfig(128, 128, 2, 2, issue_ahead=epilogue.scaling == "block",
                                packed_b=epilogue.scaling == "mxfp4"), groups)


def make_grouped_plan(layout: str, epilogue: ScaledEpilogue, groups: int, m: int, n: int, k: int,
                      rows_per_group: float, sms: int, config: Optional[ScaledConfig] = None) -> ScaledGroupedPlan:
    """The plan of a checked call: ``m`` the rows bound (T or Mmax), ``rows_per_group`` the heuristic's estimate;
    ``config`` the caller's (checked) or the heuristic's."""
    if layout not in GROUPED_LAYOUTS:
        raise ValueError(f"layout: expected one of {GROUPED_LAYOUTS}, got {layout!r}")
    if epilogue.scaling not in GROUPED_SCALINGS or epilogue.bias or epilogue.partial:
        raise ValueError(f"epilogue: the grouped scaled kernel applies {GROUPED_SCALINGS} scales without a bias, "
                         f"got {epilogue}")
    if config is None:
        config = heuristic_config(rows_per_group, groups, epilogue)
    elif epilogue.scaling == "mxfp4" and not config.packed_b:  # a caller's tile gets the packed B tile too
        config = replace(config, packed_b=True)
    why = fits(config, groups, epilogue)
    if config.staged_scales and layout == "contiguous" and 4 * (config.bm + SCALE_ALIGN) > SCALE_SLOT:
        why = (f"staged_scales: bm={config.bm}: the contiguous layout's boxes of bm + {SCALE_ALIGN} scales exceed "
               f"the stage's {SCALE_SLOT}-byte slot (and TMA's 256-row box)")
    if why:
        raise ValueError(f"config: {why}")
    cn = config.cluster_n
    if layout == "contiguous":  # a group adds at most one partial tile row to the tokens'
        bound_rows = math.ceil(m / config.bm) + groups
    else:
        bound_rows = groups * math.ceil(m / config.bm)
    tiles = bound_rows * math.ceil(n / (config.bn * cn)) * cn  # whole clusters of tile columns
    batch = (1,) if layout == "masked" else ()
    return ScaledGroupedPlan(config=config, epilogue=epilogue, swap=False, m=m, n=n, k=k, k_tiles=math.ceil(k / BK),
                             grid=max(cn, min(tiles, sms // cn * cn)), threads=128 * (1 + config.consumers),
                             a_box=batch + (config.bm // cn, BK),
                             b_box=(1, config.bn, BK // 2 if config.packed_b else BK),
                             b_swizzle=0 if config.packed_b else 128, layout=layout,
                             groups=groups,
                             store_box=store_box(config, layout == "masked") if config.tma_store else None)
