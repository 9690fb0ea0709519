"""What runs for one grouped GEMM call signature: the config heuristic and the plan (pure host logic on shapes and
strides: it never reads the group sizes, which stay on the device).

The heuristic picks the tile from the rows a group has on average (the kernel cannot see more without a host
sync): up to ``SMALL_GROUP_ROWS`` (decode: each weight is streamed once, memory-bound) a 64-row tile on one
consumer warpgroup, 128 columns wide, with the deepest ring that fits (bytes in flight per SM); more rows take the
GEMM's cooperative 128-row tile on two consumers, 256 columns wide when that still gives every SM a tile, else
128; in the contiguous layout, where the wide tiles would make between one and two waves (the second part-empty),
the 128 x 128 ping-pong tile. The measurements behind it: docs/ops/grouped.md. ``forward_variants`` names the
forward's candidate tiles next to the heuristic's (TMA store, clusters, other tile shapes) for the benchmark that
decides between them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from nvfly.ops.common.gemm_config import SMEM_LIMIT, GemmConfig, store_box
from nvfly.ops.common.mainloop import operand_box
from nvfly.ops.common.groups import table_bytes
from nvfly.ops.grouped.kernel import FUSES, LAYOUTS

MAX_GROUPS = 1024       # the group table lives in shared memory (torch's limit too)
SMALL_GROUP_ROWS = 64   # at most this many rows a group on average: the 64-row tile (see above)
MAX_STAGES = 12
# ping-pong 128 x 128 tiles with the TMA-store epilogue: the weight gradient's (K-grouped, 16-bit out), and the
# forward's where wide tiles would leave a part-empty second wave (heuristic_config)
PINGPONG_TILE = GemmConfig(128, 128, MAX_STAGES, 2, group_m=8, pingpong=True, tma_store=True, store_buffers=1,
                           stream_k=False)
KGROUPED_TILE = PINGPONG_TILE
# the K-grouped tile before KGROUPED_TILE (cooperative 128 x 256, register epilogue): benchmarks compare both
KGROUPED_COOPERATIVE = GemmConfig(128, 256, MAX_STAGES, 2, group_m=8, stream_k=False)
# few tokens a group (a k-block a tile: the kernel is the output's write): cooperative 128 x 256 with the whole tile
# staged (4 slice buffers), half the tiles and one staging wait a tile (docs/ops/grouped.md, "The weight gradient")
KGROUPED_WIDE_TILE = GemmConfig(128, 256, MAX_STAGES, 2, group_m=8, tma_store=True, store_buffers=4, stream_k=False)
KGROUPED_FEW_TOKENS = 32  # at most this many tokens a group on average: KGROUPED_WIDE_TILE (measured at 2-32)


@dataclass(frozen=True)
class GroupedPlan:
    """How the grouped kernel runs one call signature. ``layout``: "contiguous", "masked" or "kgrouped" (see
    kernel); m: the rows bound (T, Mmax or M), n: output columns (silu_mul: I), k: K (kgrouped: sum of the groups'
    K), k_tiles: k-blocks of K (not kgrouped); ``grid``: blocks of the persistent launch (from an upper bound on
    the tiles: blocks past the real count exit at once; a multiple of the config's cluster size)."""
    layout: str
    fuse: str
    dtype: str
    config: GemmConfig
    groups: int
    a_major: str
    b_major: str
    m: int
    n: int
    k: int
    k_tiles: int
    grid: int
    threads: int
    a_box: tuple
    a_swizzle: int
    b_box: tuple
    b_swizzle: int

    store_box: Optional[tuple] = None  # the TMA-store epilogue's output box and swizzle (config.tma_store)
    store_swizzle: int = 0
    why: str = "the caller's config"  # the heuristic's reason for its tile (``heuristic_config``)

    @property
    def smem_bytes(self) -> int:
        return self.config.smem_bytes(2) + (table_bytes(self.groups) if self.layout != "kgrouped" else 0)


def fits(cfg: GemmConfig, groups: int, layout: str, b_major: str, itemsize: int = 2) -> Optional[str]:
    """None if the kernel compiles ``cfg`` (no K splits; clusters in the contiguous and masked layouts) with its
    group table, else why not. (The fused gate/up tile takes no cluster along M either: ``make_plan``.)"""
    why = cfg.check(itemsize, b_major)
    if why:
        return why
    if cfg.split_k != 1:
        return "the grouped kernel runs without K splits"
    if cfg.cluster_m * cfg.cluster_n != 1 and layout == "kgrouped":
        return "clusters run in the contiguous and masked layouts (the K-grouped tiles take none)"
    if cfg.store_tiles != 1 and layout != "kgrouped":
        return "store_tiles: the K-grouped layout's (the ragged ones store a tile across a group's end by registers)"
    if cfg.skip_empty and (layout == "kgrouped" or cfg.pingpong):
        return "skip_empty: the cooperative tiles of the ragged layouts (a ping-pong consumer owns a whole tile)"
    table = table_bytes(groups) if layout != "kgrouped" else 0
    if cfg.smem_bytes(itemsize) + table > SMEM_LIMIT:
        return f"{cfg.smem_bytes(itemsize) + table} bytes of shared memory exceed {SMEM_LIMIT}"
    return None


def deepest(cfg: GemmConfig, groups: int, layout: str, b_major: str, itemsize: int = 2) -> GemmConfig:
    for stages in range(MAX_STAGES, 1, -1):
        if fits(replace(cfg, stages=stages), groups, layout, b_major, itemsize) is None:
            return replace(cfg, stages=stages)
    raise ValueError(f"config: no ring depth fits {cfg}")


def kgrouped_variants(groups: int, b_major: str = "MN", itemsize: int = 2) -> dict[str, GemmConfig]:
    """The weight gradient's tiles by name, each with its deepest ring (tests and ``benchmarks.grouped
    --wgrad-variants`` compare them): the heuristic's ping-pong + TMA store, ping-pong storing through registers,
    cooperative 128 x 256 with the TMA store, and the cooperative register-epilogue tile it replaced. Then the
    candidates for groups of a k-block or two (few tokens an expert: the kernel is an output write, one store a
    k-block), each staging more of its stores so that fewer of them wait for the one before: the ping-pong tile
    with the whole tile staged ("-2buf", store_buffers: a tile's second slice no longer waits for its first), with
    the slices of two tiles rotating ("-ring2", store_tiles: a slice waits only for its buffer's last store, not
    for every store of the previous tile; one buffer a tile: each slice overlaps the previous slice's store; two:
    128 KB of staging leave a 3-stage ring, enough at a k-block a tile), and the wider cooperative tiles (128 x 256
    and 256 x 128, half the tiles) with the whole tile staged, alone and rotating over two tiles."""
    pingpong_2buf = replace(KGROUPED_TILE, store_buffers=2)
    wide = KGROUPED_WIDE_TILE
    tall = GemmConfig(256, 128, MAX_STAGES, 2, group_m=8, tma_store=True, store_buffers=2, stream_k=False)
    variants = {"pingpong-tma": KGROUPED_TILE, "pingpong-register": replace(KGROUPED_TILE, tma_store=False),
                "cooperative-tma": replace(KGROUPED_COOPERATIVE, tma_store=True, store_buffers=1),
                "cooperative-register": KGROUPED_COOPERATIVE,
                "pingpong-tma-2buf": pingpong_2buf, "pingpong-tma-ring2": replace(KGROUPED_TILE, store_tiles=2),
                "pingpong-tma-2buf-ring2": replace(pingpong_2buf, store_tiles=2),
                "128x256-tma-4buf": wide, "128x256-tma-4buf-ring2": replace(wide, store_tiles=2),
                "256x128-tma-2buf": tall, "256x128-tma-2buf-ring2": replace(tall, store_tiles=2)}
    return {name: deepest(cfg, groups, "kgrouped", b_major, itemsize) for name, cfg in variants.items()}


def forward_variants(default: GemmConfig, groups: int, layout: str, b_major: str,
                     itemsize: int = 2) -> dict[str, GemmConfig]:
    """The forward's candidate tiles by name next to ``default`` (the heuristic's, "current"), each with its
    deepest ring, for ``benchmarks.grouped --variants`` and the tests (docs/ops/grouped.md, "Compute-bound rows"):
    the same tile with the TMA-store epilogue (whole rows of a group by TMA, a slice across a group's end through
    registers), with 2-block clusters along M multicasting B ("cluster2") or along N multicasting A ("cluster2n"),
    each with the TMA store; the 256 x 128 and 128 x 128 cooperative and the 128 x 128 ping-pong tiles with the TMA
    store (128 x 128 cooperative: twice the tiles of a 256-wide plan, for rows whose last wave of wide tiles is
    short, e.g. one-hot routing); the TMA-store tile whose second consumer skips a group's last tile row when the
    group ends in the first's rows ("skip-empty", cooperative tiles). A variant that does not fit (e.g. no cluster
    with a K-grouped layout) is left out."""
    tma = dict(tma_store=True, store_buffers=1)
    variants = {"current": default, "tma-store": replace(default, **tma),
                "cluster2": replace(default, cluster_m=2, group_m=max(2, default.group_m + default.group_m % 2)),
                "cluster2n": replace(default, cluster_n=2),
                "256x128-tma": GemmConfig(256, 128, MAX_STAGES, 2, group_m=8, stream_k=False, **tma),
                "128x128-tma": GemmConfig(128, 128, MAX_STAGES, 2, group_m=8, stream_k=False, **tma),
                "pingpong-tma": PINGPONG_TILE}
    variants["cluster2-tma"] = replace(variants["cluster2"], **tma)
    variants["cluster2n-tma"] = replace(variants["cluster2n"], **tma)
    variants["skip-empty"] = replace(variants["tma-store"], skip_empty=True)
    fitting = {}
    for name, cfg in variants.items():
        for stages in range(min(cfg.stages if name == "current" else MAX_STAGES, MAX_STAGES), 1, -1):
            if fits(replace(cfg, stages=stages), groups, layout, b_major, itemsize) is None:
                fitting[name] = replace(cfg, stages=stages)
                break
    return fitting


def heuristic_config(rows_per_group: float, row_tiles_128: int, n: int, groups: int, layout: str, b_major: str,
                     fused: bool, sms: int, itemsize: int = 2) -> tuple[GemmConfig, str]:
    """The tile of a grouped problem (see the module doc) and why, in a line: ``rows_per_group`` on average
    (K-grouped: the tokens a group's K range has), ``row_tiles_128`` an estimate of the 128-row tile rows of all
    groups, ``n`` output columns (silu_mul: I, the tile loads twice as many B columns)."""
    rows = f"{rows_per_group:g} rows a group"
    if layout == "kgrouped":
        # a group's K is its tokens (~T·k/E, a few k-blocks), so a tile's epilogue weighs like its mainloop:
        # ping-pong hides it under the other consumer's mainloop, TMA stores drain it asynchronously; with a k-block
        # or less a tile the stores are the whole kernel: half the tiles, each staged whole, store faster
        if rows_per_group <= KGROUPED_FEW_TOKENS:
            cfg, why = KGROUPED_WIDE_TILE, (f"{rows_per_group:g} tokens a group <= {KGROUPED_FEW_TOKENS}: the "
                                             "gradient's write is the kernel, half the tiles each staged whole")
        else:
            cfg, why = KGROUPED_TILE, (f"{rows_per_group:g} tokens a group: a few k-blocks a tile, the epilogue "
                                       "under the other consumer's mainloop")
    elif rows_per_group <= SMALL_GROUP_ROWS:
        cfg = GemmConfig(64, 128, MAX_STAGES, 1, group_m=8, stream_k=False)
        why = f"{rows} <= {SMALL_GROUP_ROWS}: memory-bound, each weight streamed once with the deepest ring"
    else:
        out_width = 128 if fused else 256
        wide = row_tiles_128 * math.ceil(n / out_width) >= sms
        # the TMA-store epilogue: 1.08x the register stores on the four compute-bound forward rows (1.03x
        # torch._grouped_mm, min 0.99x; docs/ops/grouped.md); the fused tile's was not measured: registers
        cfg = GemmConfig(128, 256 if wide else 128, MAX_STAGES, 2, group_m=8, stream_k=False,
                         tma_store=not fused, store_buffers=1)
        why = (f"{rows}: compute tiles, {out_width} output columns wide" if wide else
               f"{rows}: 128 columns wide, fewer {out_width}-wide tiles than SMs")
        # a ragged group's last tile row is part-full: on average half a tile row a group more than the tokens'
        expected_tiles = (row_tiles_128 - groups / 2) * math.ceil(n / 256)
        if wide and not fused and layout == "contiguous" and sms <= expected_tiles < 2 * sms:
            # between one and two waves of wide tiles the second runs part-empty (one-hot routing: 0.84x torch);
            # the 128 x 128 ping-pong tile's twice as many fill theirs (1.01x; 0.97x the wide tile's speed when
            # waves are full)
            cfg = PINGPONG_TILE
            why = (f"{rows}: ~{expected_tiles:.0f} 256-wide tiles would make 1-2 waves on {sms} SMs, the second "
                   "part-empty; 128-wide ping-pong tiles fill theirs")
    return deepest(cfg, groups, layout, b_major, itemsize), why


def make_plan(layout: str, fuse: str, dtype: str, groups: int, a_major: str, b_major: str, m: int, n: int, k: int,
              rows_per_group: float, sms: int, config: Optional[GemmConfig] = None,
              out_itemsize: int = 2) -> GroupedPlan:
    """The plan of a checked call: ``m`` the rows bound (T, Mmax or M), ``n`` the output columns, ``k`` (kgrouped:
    sum K), ``rows_per_group`` the heuristic's estimate; ``config`` the caller's (checked) or the heuristic's;
    ``out_itemsize`` the output's (a TMA-store config stores through registers for 32-bit outputs)."""
    import nvfly
    if layout not in LAYOUTS or fuse not in FUSES:
        raise ValueError(f"layout/fuse: expected one of {LAYOUTS} / {FUSES}, got {layout!r} / {fuse!r}")
    if fuse != "none" and layout == "kgrouped":
        raise ValueError("fuse: the fused gate/up projection takes 3-D weights, not the K-grouped 2-D x 2-D")
    if (layout == "contiguous" and a_major == "MN") or (layout == "kgrouped" and "K" in (a_major, b_major)):
        # a group boundary (device offsets) would be a TMA coordinate along the contiguous dimension, which must be
        # a multiple of 16 bytes (else an illegal instruction): api.eligibility declines these
        takes = "K-major A" if layout == "contiguous" else "MN-major A and B"
        raise ValueError(f"a_major/b_major: the {layout} layout takes {takes}, got {a_major}/{b_major}")
    nv = getattr(nvfly, dtype)
    itemsize = nv.itemsize
    fused = fuse == "silu_mul"
    if layout == "contiguous":
        row_tiles = math.ceil(m / 128) + groups
    elif layout == "masked":
        row_tiles = groups * math.ceil(min(m, max(rows_per_group, 1)) / 128)
    else:
        row_tiles = groups * math.ceil(m / 128)
    why = GroupedPlan.why
    if config is None:
        config, why = heuristic_config(rows_per_group, row_tiles, n, groups, layout, b_major, fused, sms, itemsize)
    if config.tma_store and out_itemsize != 2:  # the TMA-store epilogue stores 16-bit outputs
        config = deepest(replace(config, tma_store=False), groups, layout, b_major, itemsize)
    unfit = fits(config, groups, layout, b_major, itemsize)
    if unfit:
        raise ValueError(f"config: {unfit}")
    if fused and (config.bn % 16 or (b_major == "MN" and config.bn // 2 % (32 // itemsize))):
        raise ValueError(f"config: bn={config.bn}: the fused gate/up tile takes two halves of whole 32-byte "
                         f"swizzle rows (MN-major B) and of 8 columns")
    if fused and config.cluster_m != 1:
        raise ValueError("config: the fused gate/up tile runs without clusters along M (its B halves are the gate "
                         "and up columns)")
    bk = config.bk(itemsize)
    out_bn = config.bn // 2 if fused else config.bn
    cm, cn = config.cluster_m, config.cluster_n
    # the launch: an upper bound on the tile rows, in cluster rows (a group adds at most one partial cluster row to
    # the tokens' rows), times the tile columns in whole clusters
    if layout == "contiguous":
        bound_rows = math.ceil(m / (config.bm * cm)) + groups
    else:
        bound_rows = groups * math.ceil(m / (config.bm * cm))
    tiles = bound_rows * cm * math.ceil(n / (out_bn * cn)) * cn
    a_box, a_swizzle = operand_box(config.bm, bk, nv, a_major, 3 if layout == "masked" else 2, cn)
    b_box, b_swizzle = operand_box(config.bn, bk, nv, b_major, 2 if layout == "kgrouped" else 3, 2 if fused else cm)
    # the output tile's staging geometry (fused: out_bn columns); the contiguous output is 2-D
    out_box, out_swizzle = (store_box(replace(config, bn=out_bn), layout != "contiguous") if config.tma_store
                            else (None, 0))
    return GroupedPlan(layout=layout, fuse=fuse, dtype=dtype, config=config, groups=groups, a_major=a_major,
                       b_major=b_major, m=m, n=n, k=k, k_tiles=math.ceil(k / bk),
                       grid=max(cm * cn, min(tiles, sms // (cm * cn) * (cm * cn))),
                       threads=128 * (1 + config.consumers), a_box=a_box, a_swizzle=a_swizzle, b_box=b_box,
                       b_swizzle=b_swizzle, store_box=out_box, store_swizzle=out_swizzle, why=why)
