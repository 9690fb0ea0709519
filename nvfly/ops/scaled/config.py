"""The scaled (FP8) GEMM kernel's configs and epilogue options. Pure Python: plans, tests and the kernel read them."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from nvfly.ops.common.gemm_config import BARRIER_BYTES, SMEM_LIMIT, StagedStore

BK = 128           # K elements per k-block: one 128-byte swizzle row of fp8, and the block scales' 128
SCALE_BLOCK = 128  # the block recipes' block edge (1x128 activations, 128x128 weights)
MX_BLOCK = 32      # OCP MX: an e8m0 scale per 32 elements along K, i.e. per fp8 wgmma k-step
SCALINGS = ("tensor", "row", "block", "block1x128", "mxfp8", "mxfp4")
MX = ("mxfp8", "mxfp4")  # e8m0 scales per 32 of K for both operands, promoted every k-step (mxfp4: e2m1 weights)
BLOCKWISE = ("block", "block1x128") + MX  # scales applied in the mainloop
# staged_scales: a stage's slot for its bm f32 activation scales (at most 256 rows), a whole 1024 bytes so that the
# next stage's operand tiles stay aligned for the 128-byte swizzle
SCALE_SLOT = 1024
# staged_scales on the grouped contiguous layout: a group's first row is any row, and boxes starting there (off
# 16 bytes in their inner, f32-row dimension) died on the H200 (illegal instruction); the box starts at the row
# rounded down to SCALE_ALIGN rows (16 bytes) and is SCALE_ALIGN rows longer (so
# at most 252 rows: the slot, TMA's 256-row box; make_grouped_plan refuses 256-row tiles there)
SCALE_ALIGN = 4
# block scales: a tile's columns in runs that each lie in one 128x128 weight block, at most this many runs a tile
# (each run's scale times each row's, 2 x runs registers per 64 rows)
MOST_WEIGHT_RUNS = 8


def weight_runs(bn: int) -> int:
    """Runs of a bn-wide tile's columns that each lie in one SCALE_BLOCK-wide weight block: tiles start at multiples
    of bn, so runs of gcd(bn, SCALE_BLOCK) columns never straddle a block edge (1: the tile lies in one block; 3 for
    192 = 3 x 64; 5 for 160 = 5 x 32)."""
    return bn // math.gcd(bn, SCALE_BLOCK)


def weight_scales_reason(bn: int) -> Optional[str]:
    """None if bn-wide tiles can take 128x128 weight-block scales (``weight_runs``), else why not."""
    if weight_runs(bn) > MOST_WEIGHT_RUNS:
        return (f"bn={bn}: with 128x128 weight blocks the tile's columns fall in {weight_runs(bn)} runs of "
                f"gcd(bn, 128) = {math.gcd(bn, SCALE_BLOCK)} (at most {MOST_WEIGHT_RUNS}: bn dividing 128, or e.g. "
                f"96, 112, 160, 192, 224, 256)")
    return None


@dataclass(frozen=True)
class ScaledConfig(StagedStore):
    """One point of the scaled GEMM's config space: a bm x bn output tile split between ``consumers`` warpgroups
    (64 or 128 rows each), a ring of ``stages`` k-blocks of 128, ``group_m`` tile rows per rasterisation group,
    ``split_k`` K splits (each writes f32 partial sums; a reduce kernel scales and adds them; with ``split_fix_up``
    they add up in the kernel instead: each split adds its sums into its tile's workspace slot and counts itself in,
    and the split counted in last reads the sums back, zeroes slot and count and runs the epilogue: one launch, no
    partials, the stream-K fix-up); ``issue_ahead``: the promoted mainloop issues k-block k+1's wgmmas before k's
    fp32 add (a third accumulator); ``packed_b``: B arrives
    as packed e2m1 (MXFP4, set by the plan): each stage also holds B's packed bn x 64-byte tile, which the consumers
    convert into the stage's e4m3 tile; ``tma_store``: the epilogue stages the scaled 16-bit tile in shared memory
    (``store_buffers`` column slices of ``store_width`` per consumer, behind the ring) and stores it with TMA, as the
    dense GEMM's (others, and split-K partials, go through registers); ``stream_k``: a partial last wave of tiles
    (a single one included) is dealt out as contiguous k ranges over all SMs, shared tiles summed in a workspace
    (the dense GEMM's stream K; the plan decides whether the shape has such a wave); ``staged_scales`` (block scales):
    the producer also TMA-loads the k-block's bm activation scales (sa[tile rows, kb], f32) into the stage, behind
    its operands in a 1024-byte slot (``SCALE_SLOT``), and the consumers read them from shared memory instead of
    global (DeepGEMM's); ``cluster_n``: blocks per thread-block cluster along N (1, 2 or 4; the grouped kernel 1 or
    2), which take adjacent tile columns of one tile row: each loads a bm / cluster_n-row slice of the shared A tile
    and multicasts it to all of them (A's L2 -> SM traffic divided by cluster_n; the dense GEMM's cluster along M,
    transposed), a last cluster column past N computed and not stored; ``stream_a``/``stream_b`` (the grouped kernel
    only): L2 eviction hints on the operands' TMA loads, the streamed one's evict_first and the other's evict_last
    (the dense GEMM's, ``load_hint``: e.g. the experts' weights, read once, streamed past the tokens' tiles that
    their N tiles re-read); ``skip_empty`` (the grouped kernel only): a consumer whose rows of a tile all lie past
    its group's end (a group's last, partial tile row) waits for and releases the tile's stages without issuing
    its wgmmas, promotions or stores (the tensor cores then run the other consumer's half alone)."""
    bm: int = 128
    bn: int = 128
    stages: int = 6
    consumers: int = 2
    group_m: int = 8
    split_k: int = 1
    issue_ahead: bool = False
    packed_b: bool = False
    tma_store: bool = False
    store_buffers: int = 1
    stream_k: bool = False
    split_fix_up: bool = False
    staged_scales: bool = False
    cluster_n: int = 1
    stream_a: bool = False
    stream_b: bool = False
    skip_empty: bool = False

    @property
    def wg_m(self) -> int:
        return self.bm // self.consumers

    @property
    def scales_offset(self) -> int:
        """Where a stage's activation scales start (``staged_scales``): behind its operand tiles."""
        return (self.bm + self.bn) * BK + (self.bn * BK // 2 if self.packed_b else 0)

    @property
    def stage_bytes(self) -> int:
        return self.scales_offset + (SCALE_SLOT if self.staged_scales else 0)

    @property
    def load_bytes(self) -> int:
        """The bytes TMA brings into a stage (B's packed tile rather than its e4m3 one when ``packed_b``; the
        activation scales with ``staged_scales``)."""
        return (self.bm + (self.bn // 2 if self.packed_b else self.bn)) * BK + (4 * self.bm if self.staged_scales
                                                                                 else 0)

    @property
    def ring_end(self) -> int:
        """Where the ring ends in dynamic shared memory (the TMA-store staging buffers start)."""
        return BARRIER_BYTES + self.stages * self.stage_bytes

    def smem_bytes(self) -> int:
        return self.ring_end + self.staging_bytes()

    def staging_reason(self) -> Optional[str]:
        """StagedStore's, except that split K's fix-up hands the epilogue whole sums, which it can stage."""
        return StagedStore.staging_reason(replace(self, split_k=1) if self.split_fix_up else self)

    def check(self, promote: bool = False) -> Optional[str]:
        """None if this config compiles (with a promoted accumulator when ``promote``), else why not."""
        if self.consumers not in (1, 2) or self.bm % self.consumers or self.wg_m not in (64, 128):
            return f"bm={self.bm} with {self.consumers} consumers: each consumer needs 64 or 128 rows"
        if self.bn % 8 or not 8 <= self.bn <= 256:
            return f"bn={self.bn}: must be a multiple of 8 in [8, 256]"
        if self.packed_b and self.bn % 16:
            return f"bn={self.bn} with packed (MXFP4) B: a multiple of 16 (stages of whole 1024-byte swizzle atoms)"
        if self.issue_ahead and not promote:
            return "issue_ahead: only the promoted mainloop issues ahead"
        # promotion keeps a second accumulator (the running fp32 sum next to the k-block's partial), issuing ahead
        # a third (the next k-block's partial); up to 192 of the consumers' 232 registers compile without spills
        accumulators = 3 if self.issue_ahead else 2 if promote else 1
        registers = (self.wg_m // 64) * self.bn // 2 * accumulators
        most = 128 if accumulators == 1 else 192
        if registers > most:
            return (f"{self.wg_m}x{self.bn} per consumer needs {registers} accumulator registers (at most {most}, "
                    f"{accumulators} accumulator(s))")
        if self.stream_a and self.stream_b:
            return "stream_a and stream_b: at most one operand is streamed"
        if self.stages < 2:
            return "at least 2 stages"
        if self.staging_reason():
            return self.staging_reason()
        if self.stream_k and self.split_k != 1:
            return "stream_k: stream K takes no K split"
        if self.split_fix_up and self.stream_k:
            return "split_fix_up: stream K's tiles have their own fix-up (no K split to add up)"
        if not 1 <= self.split_k <= 32:
            return f"split_k={self.split_k}: 1 to 32"
        if self.smem_bytes() > SMEM_LIMIT:
            return f"{self.smem_bytes()} bytes of shared memory exceed {SMEM_LIMIT}"
        return self.cluster_reason()

    def cluster_reason(self) -> Optional[str]:
        """None if this config's blocks can run in clusters of ``cluster_n`` along N, else why not."""
        if self.cluster_n not in (1, 2, 4):
            return f"cluster_n={self.cluster_n}: 1, 2 or 4 blocks per cluster"
        # each block multicasts bm / cluster_n rows of A (16 at the least: whole 8-row atoms of the 128-byte swizzle)
        if self.cluster_n > 1 and (self.split_k != 1 or self.stream_k):
            return (f"cluster_n={self.cluster_n}: a cluster's blocks share whole tiles' k-blocks (no K split or "
                    f"stream K)")
        return None


def deepest(cfg: ScaledConfig, most: int = 8) -> ScaledConfig:
    """``cfg`` with the deepest ring of at most ``most`` stages that fits shared memory."""
    stages = max(2, min(most, (SMEM_LIMIT - BARRIER_BYTES - cfg.staging_bytes()) // cfg.stage_bytes))
    return replace(cfg, stages=stages)


@dataclass(frozen=True)
class ScaledEpilogue:
    """What the kernel applies. scaling: "tensor" (one scale each: alpha = sa * sb, in the epilogue), "row"
    (sa per output row, sb per output column, in the epilogue), "block" (sa per row and 128-k block, sb per
    128x128 block of the kernel's B, applied to each k-block's partial sum in the mainloop), "block1x128" (sb
    per column and 128-k block instead), "mxfp8" (e8m0 sa per row and sb per column for every ``scale_k`` = 32
    of K: each wgmma k-step is promoted) or "mxfp4" (the same with packed e2m1 B); promote: accumulate each k-block
    in a fresh wgmma accumulator and add it into an fp32 sum (always with block scales; otherwise
    torch's ``use_fast_accum=False``); bias: a bias vector added last, along the output's columns, or along its
    rows (``bias_rows``: the swapped problem, whose rows are the caller's columns); partial: split K, the kernel
    writes its K range's unscaled f32 sums (out is [split, rows, cols]) and ``scaled_reduce_kernel`` applies the
    scales and the bias."""
    scaling: str = "tensor"
    promote: bool = False
    bias: bool = False
    bias_rows: bool = False
    partial: bool = False

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling: expected one of {SCALINGS}, got {self.scaling!r}")
        if self.scaling in BLOCKWISE and not self.promote:
            raise ValueError("scaling: block scales are applied by promotion (promote=True)")

    @property
    def scale_k(self) -> int:
        """K elements per promotion: a k-block (BK) of 128, or one 32-wide k-step for MX scales."""
        return MX_BLOCK if self.scaling in MX else BK
