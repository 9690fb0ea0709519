"""Time GEMM configs side by side on a few shapes (tuning aid): python -m benchmarks.gemm_configs

``--compare-store``: each config next to its TMA-store-epilogue twins (GemmConfig.tma_store, the deepest ring
that fits next to the staging buffers, with 2 and with 1 staging slice per consumer), e.g.

    python -m benchmarks.gemm_configs --compare-store --layouts rowxrow,colxrow \\
        --shapes 4096x4096x4096,8192x8192x8192,4096x32768x512,2048x2112x7168

``--compare-stream-k``: the default tiles with and without the stream-K tail (GemmConfig.stream_k), e.g.

    python -m benchmarks.gemm_configs --compare-stream-k --layouts rowxrow,colxcol \
        --shapes 2048x2112x7168,1024x7168x2048,8192x8192x8192,4096x14336x4096

``--compare-regions``: the default call (its own config, swap-AB for small M) and the other default tiles under each
stream-K region (plan.STREAM_K_REGIONS: which tiles are dealt out as contiguous k ranges), e.g.

    python -m benchmarks.gemm_configs --compare-regions --layouts rowxrow \
        --shapes 64x6144x4096,336x4104x1024,512x7168x16384,2048x4096x14336,1024x7168x2048

``--compare-wave-fit``: the default call beside the config it would run without the wave fit (plan.wave_fit),
alternately twice each with cuBLAS, on the shapes whose default the wave fit changes (others are listed as
unchanged), e.g.

    python -m benchmarks.gemm_configs --compare-wave-fit --layouts rowxcol,rowxrow \
        --shapes 512x10240x8192,512x6144x4096,768x4096x7168,512x8192x1024

``--tiles``: the default call beside named tiles (BMxBN, ``pp`` ping-pong, ``kK`` split K, ``swap:`` on the transposed
problem, ``@REGION`` under that stream-K region, e.g. ``swap:64x64@tail``: M = 64's tiles streamed instead of
split; TMA store but with split K, the deepest ring that fits up to 7 stages or sS), e.g. tiles that fit the waves
better than the default ones (336x4104x1024, the suite's last shape under 0.9x cuBLAS: ``--tiles 128x128k2,128x256k2,64x256``):

    python -m benchmarks.gemm_configs --tiles 128x128pp,128x96pp,64x48,swap:64x64 \
        --shapes 336x4104x1024,64x6144x4096,4096x4096x4096
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
from dataclasses import replace
from typing import Any, Iterator, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_ms, rel_err  # noqa: E402
from nvfly.ops import gemm  # noqa: E402
from nvfly.ops.gemm import GemmConfig, api, plan  # noqa: E402

SHAPES = [(8192, 8192, 8192), (4096, 32768, 512), (1024, 7168, 2048), (4096, 4096, 4096), (4096, 24576, 1536)]
CONFIGS = [GemmConfig(128, 256, 4, 2), GemmConfig(128, 256, 3, 2), GemmConfig(128, 256, 4, 2, cluster_m=2),
           GemmConfig(128, 128, 6, 2, pingpong=True), GemmConfig(64, 256, 5, 2, pingpong=True),
           GemmConfig(128, 128, 4, 2, pingpong=True)]
STORE_BASES = [GemmConfig(128, 128, 6, 2, pingpong=True), GemmConfig(128, 256, 4, 2),
               GemmConfig(256, 128, 4, 2), GemmConfig(128, 256, 4, 2, cluster_m=2)]


def deepest(cfg: GemmConfig) -> Optional[GemmConfig]:
    """``cfg`` at the deepest ring of at most its stages that fits (bf16)."""
    return plan.deepest_ring(cfg, 2, most=cfg.stages)


def with_store(configs: list[GemmConfig]) -> list[GemmConfig]:
    """Each config, then its TMA-store twins (2 and 1 staging slices) at the deepest ring that fits."""
    out = []
    for cfg in configs:
        out.append(cfg)
        for buffers in (2, 1):
            twin = deepest(replace(cfg, tma_store=True, store_buffers=buffers, stages=7))
            if twin is not None and twin not in out and (buffers == 2 or twin.store_slices < cfg.bn // twin.store_width):
                out.append(twin)
    return out


def label(cfg: GemmConfig) -> str:
    store = f"-tma{cfg.store_slices}" if cfg.tma_store else ""
    tail = "" if cfg.stream_k else "-nosk"
    return f"{cfg.bm}x{cfg.bn}s{cfg.stages}c{cfg.cluster_m}{'pp' if cfg.pingpong else ''}{store}{tail}"


def other_default_tiles(m: int, n: int, k: int) -> list[GemmConfig]:
    """The two large default tiles (plan.TILES) other than the tile of the shape's default config."""
    first = plan.default_config(m, n, k)
    return [cfg for cfg, _ in plan.TILES[:3] if (cfg.bm, cfg.bn) != (first.bm, first.bn)]


def with_and_without_tail(m: int, n: int, k: int) -> list[GemmConfig]:
    """The default config of a shape and the two other default tiles, each with and without stream K."""
    tiles = [plan.default_config(m, n, k)] + other_default_tiles(m, n, k)
    return [replace(cfg, stream_k=on) for cfg in tiles for on in (True, False)]


def checked_ms(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, what: Any, **options: Any) -> float:
    """Median ms of ``gemm.matmul(a, b, **options)``, after checking one call against ``ref``."""
    out = gemm.matmul(a, b, **options)
    assert rel_err(out, ref) < 1e-2, (what, rel_err(out, ref))
    return bench_ms(lambda: gemm.matmul(a, b, out=out, **options))


@contextlib.contextmanager
def under_region(region: Optional[str]) -> Iterator[None]:
    """plan.STREAM_K_REGION set to ``region`` (None: left as it is) inside the block; plans are cached per call
    signature, regions aside, so the cache is emptied on the way in and out."""
    default_region = plan.STREAM_K_REGION
    plan.STREAM_K_REGION = region or default_region
    api._CALLS.clear()
    try:
        yield
    finally:
        plan.STREAM_K_REGION = default_region
        api._CALLS.clear()


def time_regions(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, flops: float) -> list[str]:
    """The default call and the other default tiles under each stream-K region, in TFLOP/s."""
    cells = []
    for cfg in [None] + other_default_tiles(a.shape[0], b.shape[1], a.shape[1]):
        for region in plan.STREAM_K_REGIONS:
            with under_region(region):
                ms = checked_ms(a, b, ref, (cfg, region), config=cfg)
                name = "default" if cfg is None else label(cfg)
                cells.append(f"{name}/{region} ({gemm.path(a, b, config=cfg)}) {flops / ms / 1e9:.0f}")
    return cells


def named_tile(name: str) -> tuple[GemmConfig, bool]:
    """(config, swap) of a --tiles name: BMxBN[pp][cC][kK][sS], optionally prefixed with 'swap:' (C: blocks per
    cluster along M, which multicast the B tile; K: split-K factor; S stages: at most S, default 7)."""
    swap = name.startswith("swap:")
    parsed = re.fullmatch(r"(\d+)x(\d+)(pp)?(?:c(\d+))?(?:k(\d+))?(?:s(\d+))?", name[len("swap:"):] if swap else name)
    if parsed is None:
        raise ValueError(f"--tiles {name}: expected [swap:]BMxBN[pp][cC][kK][sS]")
    bm, bn, pingpong, cluster, split, stages = parsed.groups()
    bm, bn, pingpong = int(bm), int(bn), bool(pingpong)
    base = GemmConfig(bm, bn, int(stages or 7), 1 if bm == 64 and not pingpong else 2, pingpong=pingpong,
                      split_k=int(split or 1), cluster_m=int(cluster or 1), tma_store=not (swap or split),
                      store_buffers=1)
    cfg = deepest(base)
    if cfg is None:
        raise ValueError(f"--tiles {name}: {base.check(2)}")
    return cfg, swap


def time_tiles(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, flops: float, names: list[str]) -> list[str]:
    """The default call and each named tile (``@REGION``: under that stream-K region), in TFLOP/s, with the
    path each took."""
    cells = []
    for name in ["default"] + names:
        tile, _, region = name.partition("@")
        try:
            cfg, swap = (None, None) if tile == "default" else named_tile(tile)
            if region and region not in plan.STREAM_K_REGIONS:
                raise ValueError(f"stream-K region {region!r}: expected one of {plan.STREAM_K_REGIONS}")
        except ValueError as e:  # one impossible tile must not end the run
            cells.append(f"{name} declined ({e})")
            continue
        with under_region(region or None):
            try:
                ms = checked_ms(a, b, ref, name, config=cfg, swap=swap)
            except ValueError as e:  # e.g. a tile this call's operand majors cannot take
                cells.append(f"{name} declined ({e})")
                continue
            cells.append(f"{name} ({gemm.path(a, b, config=cfg, swap=swap)}) {flops / ms / 1e9:.0f}")
    return cells


def time_wave_fit(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, flops: float) -> list[str]:
    """The default call and the config without the wave fit, alternately twice each with cuBLAS (medians)."""
    m, k = a.shape
    n = b.shape[1]
    unfitted = plan.default_config(m, n, k, fit_waves=False)
    if unfitted == plan.default_config(m, n, k):
        return ["unchanged by the wave fit"]
    times: dict[str, list[float]] = {"without": [], "default": [], "cuBLAS": []}
    for config, what in ((unfitted, "wave fit off"), (None, "default")):  # each checked once, then timed
        assert rel_err(gemm.matmul(a, b, config=config), ref) < 1e-2, what
    for _ in range(2):
        times["without"].append(bench_ms(lambda: gemm.matmul(a, b, config=unfitted)))
        times["default"].append(bench_ms(lambda: gemm.matmul(a, b)))
        times["cuBLAS"].append(bench_ms(lambda: torch.mm(a, b)))
    rate = {name: flops / statistics.median(ms) / 1e9 for name, ms in times.items()}
    fitted = plan.default_config(m, n, k)
    return [f"without the wave fit {label(unfitted)} {rate['without']:.0f}",
            f"default {label(fitted)} {rate['default']:.0f}", f"cuBLAS {rate['cuBLAS']:.0f}",
            f"gain {rate['default'] / rate['without']:.3f}"]


def operand(rows: int, cols: int, major: str) -> torch.Tensor:
    if major == "row":
        return torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    return torch.randn(cols, rows, device="cuda").to(torch.bfloat16).t()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", help="comma-separated MxNxK (default: a built-in list)")
    p.add_argument("--layouts", default="rowxrow", help="comma-separated AxB majors: rowxrow, colxrow, rowxcol, colxcol")
    p.add_argument("--compare-store", action="store_true", help="compare with the TMA-store epilogue")
    p.add_argument("--compare-stream-k", action="store_true", help="default tiles with and without the stream-K tail")
    p.add_argument("--compare-regions", action="store_true", help="the default call and tiles under each stream-K region")
    p.add_argument("--tiles", help="comma-separated named tiles to time beside the default call (see above)")
    p.add_argument("--compare-wave-fit", action="store_true", help="the default call and the config without the "
                                                                   "wave fit, where it changes the default")
    args = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    configs = with_store(STORE_BASES) if args.compare_store else CONFIGS
    for layout in args.layouts.split(","):
        a_major, b_major = layout.split("x")
        for m, n, k in shapes:
            a = operand(m, k, a_major)
            b = operand(k, n, b_major)
            ref = a.float() @ b.float()
            cublas = bench_ms(lambda: torch.mm(a, b))
            line = [f"{layout} {m}x{n}x{k}: cuBLAS {2 * m * n * k / cublas / 1e9:.0f}"]
            if args.tiles:
                print(" | ".join(line + time_tiles(a, b, ref, 2 * m * n * k, args.tiles.split(","))), flush=True)
                continue
            if args.compare_wave_fit:
                print(" | ".join(line + time_wave_fit(a, b, ref, 2 * m * n * k)), flush=True)
                continue
            if args.compare_regions:
                print(" | ".join(line + time_regions(a, b, ref, 2 * m * n * k)), flush=True)
                continue
            for cfg in with_and_without_tail(m, n, k) if args.compare_stream_k else configs:
                ms = checked_ms(a, b, ref, cfg, config=cfg)
                line.append(f"{label(cfg)} ({gemm.path(a, b, config=cfg)}) {2 * m * n * k / ms / 1e9:.0f}")
            print(" | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
