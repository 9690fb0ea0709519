"""FP8 scaled GEMM: nvfly vs cuBLAS (torch._scaled_mm), Inductor max-autotune's Triton scaled mm and a bf16 GEMM of
the same shape (torch.mm), in one process.

Accuracy first, for every row: nvfly's output against the float32 GEMM of the dequantised operands (relative
Frobenius error and the largest error over the largest |reference|), next to cuBLAS's where it runs the recipe.
Then the median times. Recipes: tensor-wise and row-wise fp32 scales, each with torch's default promoted
accumulation and with use_fast_accum=True, 1x128 x 128x128 and 1x128 x 1x128 block scales (always promoted), and
MXFP8 x MXFP8 (``mxfp8``) and MXFP8 x MXFP4 weights (``mxfp4``), e8m0 scales per 32 of K, promoted every k-step:
cuBLAS runs no MX on Hopper, so their peers are the bf16 GEMM (bf16_ms) and nvfly's 1x128 x 128x128 block path of
the same shape (nvfly_block_ms, vs_block). bf16 outputs. Every row carries its ``scaling``.

Usage: python -m benchmarks.scaled [--quick] [--no-triton] [--triton-shapes N] [--shapes M,N,K ...]
[--recipes tensor row block block1x128 tensor-fast row-fast mxfp8 mxfp4] [--name scaled] [--no-quantize]
[--issue-ahead] [--no-alternatives] [--block-tiles]. --quick: six shapes (< 3 min on the H200; Triton on the first
shape's row-wise recipe only); only the MX rows: --quick --recipes mxfp8 mxfp4 --no-triton --no-quantize --name
scaled_mx. Next to the heuristic's plan, each fp8 row also times ``alternative_configs`` (the same tile with the
register epilogue, "registers"; the 128 x 128 register tile where the plan widened a promoted one to 192, "previous"; split K over
128 x 128 tiles at 64 < M <= 128, "split2"; stream K over a partial last wave, "streamk"; up to M = 512 the plan's tile
in 2- and 4-block clusters along N multicasting A, "cluster2" and "cluster4", and where the plan's tile is 64 wide
the 128 x 128 tile, "tile128", also in 2-block clusters, "tile128_cluster2"; the issue-ahead mainloop,
"ahead", with --issue-ahead, always for block scales; small-M plans (swapped or split): "fixup" (split K adding up
in the kernel, one launch) or "reduce" (partials + the reduce kernel, two), whichever the plan is not, and "streamk"
over their tiles; --quick: on the row and block recipes, and on every recipe's small-M rows, which also time the
plan, its alternatives and cuBLAS replayed from CUDA graphs, ``*_graph_ms``, ``*graph_vs_cublas``):
``nvfly_<name>_ms``, ``<name>_vs_nvfly`` (> 1: the alternative is faster), ``<name>_vs_cublas``. The
quantisation kernels (bf16 -> e4m3 per row, 1x128, 128x128, MXFP8; bf16 -> MXFP4) are checked bit for bit against
the torch reference and timed after, in TB/s of bytes read + written beside a torch copy of as many bytes, with
each plan variant (nvfly.ops.scaled.quantize.QUANTIZE_VARIANTS) checked and timed beside the default; only
them: python -m benchmarks.scaled --quantize-only (< 2 min; writes scaled_quantize_h200.json).
Writes benchmarks/results/<name>_h200.json (after every row) and <name>_h200.png.

Block-scaled tiles (``--block-tiles``, < 3 min): the block recipe at M in {4096, 16384} on DeepSeek-V3 and Llama-70B
(N, K) weight shapes (``BLOCK_TILE_SHAPES``), no quantisation rows, the heuristic's plan (staged scales, 128 x 192
in order or 128 x 128 issuing ahead) beside "in_order" (where it issues ahead) and each ``BLOCK_TILES`` config that
is not the plan's: "previous" (128 x 128 ahead, scales from global), the tiles over several 128-wide weight blocks
"block192", "block160" (in order) and "block112" (issuing ahead: 3 x 56 registers fit), and staged scales on 128
("staged") and 192 ("block192_staged"), e.g.
python -m benchmarks.scaled --block-tiles --no-triton --name scaled_block_tiles. ``--issue-suite``: issue 30's shapes
(M 16, 128, 512, 4096 and 16384 on DeepSeek-V3's and Llama-70B's (N, K); rows carry ``m``, ``n``, ``k`` and
``scaling``), e.g. ``--issue-suite --recipes row block --no-quantize --name scaled_issue``.

MXFP4 weights x bf16 activations (``--a16``, its own suite, default name scaled_mxfp4_a16): rows M in {1, 4, 16, 64}
on DeepSeek-V3 and Llama-70B (N, K) weight shapes (--quick: five pairs, ~3 min with every variant), nvfly's
streaming kernel against torch.matmul on the bf16 weight of the same shape. Reported: TB/s of the packed weight (N*K/2 bytes of e2m1 pairs +
N*K/32 e8m0 scales per call) and its fraction of the memory floor, against the device copy bandwidth measured in
the same process (floor_fraction) and against 4.8 TB/s (spec_fraction); the error against the float32 GEMM on the
dequantised weight; also each mainloop variant of A16_VARIANTS by name (ring: the 8-stage cp.async ring, the
default before the registers mainloop; shuffled: the nibble-shuffled layout; bits*: the bit-shuffled
"shuffled-bf16" layout with the ring, registers, unroll 8, 8 warps, the next group loaded ahead; tma*: a producer
warp's TMA ring of 8 or 16 four-chunk stages, natural or bit-shuffled): <name>_tbps,
<name>_floor (fraction of the copy bandwidth), <name>_rel_err, and their geomeans at M <= 16 in the summary. The
results file is rewritten after every row. Usage: python -m benchmarks.scaled --a16 [--quick] [--a16-m 1 4 16 64] [--a16-variants NAME ...]
[--name ...].

Grouped MX (``--grouped-mx``, its own suite, default name scaled_grouped_mx, ~3 min): nvfly's grouped MX GEMM
(``scaled_grouped_mm`` / ``scaled_grouped_mm_masked``: MXFP8 tokens x MXFP4 (``mxfp4``) or MXFP8 (``mxfp8``) expert
weights, e8m0 scales per 32 of K; ``--recipes`` picks among them) on DeepSeek-V3's E = 256 top-8 routing
(``GROUPED_MX_CASES``: gate/up and down at 4096 tokens, uniform and randomly routed, contiguous; a masked decode
batch of 128 tokens), against the bf16 grouped GEMM of the same routing (nvfly's ``grouped_mm`` /
``grouped_mm_masked`` on the dequantised operands). Correctness first (``rel_err``/``max_err`` against the float32
product of the dequantised operands, owned rows), then nvfly_ms, nvfly_tflops, nvfly_tbps (the MX bytes that must
move), bf16_ms, bf16_tflops, vs_bf16. Usage: python -m benchmarks.scaled --grouped-mx [--recipes mxfp4 mxfp8].
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_ms, geomean, graph_ms, plot, progress, rel_err, write_results  # noqa: E402
from nvfly.ops import scaled  # noqa: E402
from nvfly.ops.scaled import A16Config, ScaledConfig, ScaledEpilogue  # noqa: E402
from nvfly.ops.scaled.config import deepest  # noqa: E402
from nvfly.ops.scaled.plan import SWAP_MAX_M, make_plan  # noqa: E402
from nvfly.ops.scaled.quantize import (QUANTIZE_VARIANTS, dequantize_mxfp4, quantize, quantize_fp8,  # noqa: E402
                                      quantize_mxfp4, shuffle_mxfp4_a16)

# the FP8 anchors (../shared/docs/anchors.md) first, then DeepSeek-V3's projections at decode and prefill sizes
ANCHORS = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 7168, 16384), (128, 8192, 8192), (2048, 24576, 1536)]
SUITE = ANCHORS + [(4096, 2112, 7168), (4096, 4096, 7168), (4096, 7168, 2048), (1024, 7168, 2048),
                   (1, 4096, 7168), (16, 4096, 7168), (64, 2112, 7168), (64, 7168, 2048), (16, 24576, 1536)]
QUICK = [(4096, 4096, 4096), (8192, 8192, 8192), (128, 8192, 8192), (4096, 2112, 7168), (16, 4096, 7168),
         (64, 7168, 2048)]
RECIPES = {"tensor": ("tensor", "tensor", False), "tensor-fast": ("tensor", "tensor", True),
           "row": ("row", "row", False), "row-fast": ("row", "row", True), "block": ("1x128", "128x128", False),
           "block1x128": ("1x128", "1x128", False), "mxfp8": ("mx", "mx", False), "mxfp4": ("mx", "mxfp4", False)}
MX_RECIPES = ("mxfp8", "mxfp4")
# (N, K) of DeepSeek-V3's dense projections (fused q_a/kv_a, q_b, o, shared-expert down) and Llama-70B's (fused qkv,
# o, down)
DENSE_NK = ((2112, 7168), (24576, 1536), (7168, 16384), (7168, 2048), (10240, 8192), (8192, 8192), (8192, 28672))
BLOCK_TILE_SHAPES = [(m, n, k) for m in (4096, 16384) for n, k in DENSE_NK]  # --block-tiles
ISSUE_SHAPES = [(m, n, k) for m in (16, 128, 512, 4096, 16384) for n, k in DENSE_NK]  # --issue-suite: issue 30's
# --block-tiles: the block plan's config with these fields (name: fields), each timed where it is not the plan's:
# the 128 x 128 tile issuing ahead with the scales from global ("previous", the default before staged scales),
# tiles over several weight blocks, and the activation scales staged by the producer (ScaledConfig.staged_scales)
BLOCK_TILES = {"previous": {"bn": 128, "issue_ahead": True, "staged_scales": False},
               "block192": {"bn": 192, "issue_ahead": False, "staged_scales": False},
               "block160": {"bn": 160, "issue_ahead": False, "staged_scales": False},
               "block112": {"bn": 112, "issue_ahead": True, "staged_scales": False},
               "staged": {"bn": 128, "issue_ahead": True, "staged_scales": True},
               "block192_staged": {"bn": 192, "issue_ahead": False, "staged_scales": True}}
# alternative_configs and small_m_alternatives
ALTERNATIVES = ("registers", "previous", "split2", "streamk", "ahead", "in_order", "fixup",
                "reduce", "cluster2", "cluster4", "tile128", "tile128_cluster2") + tuple(BLOCK_TILES)
# the plan's tile in clusters of 2 or 4 blocks along N that share (multicast) the A tile, timed up to this many rows
# (where every block reads the same few A rows from L2: ScaledConfig.cluster_n); "tile128": where the plan's tile is
# 64 wide, the 128 x 128 tile (half the blocks, each A tile read by half as many), also in clusters of 2
CLUSTER_MAX_M = 512
QUICK_ALTERNATIVES = ("row", "row-fast", "block")  # the recipes --quick times them on (row-wise and block targets)


def operands(m: int, n: int, k: int, recipe: str) -> tuple[torch.Tensor, ...]:
    ga, gb, _ = RECIPES[recipe]
    a, sa = quantize(torch.randn(m, k, device="cuda"), ga)
    b, sb = quantize(torch.randn(n, k, device="cuda"), gb, operand="b")  # mxfp4: packed (K/2, N) column-major
    if ga == "mx":  # e8m0 scales as torch names them (quantize gives their bytes)
        sa, sb = sa.view(torch.float8_e8m0fnu), sb.view(torch.float8_e8m0fnu)
    return a, b, sa, sb


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def cublas_call(a, b, sa, sb, fast: bool) -> Optional[Any]:
    """torch._scaled_mm on these operands, or None when cuBLAS refuses the recipe (what it said is printed)."""
    def run():
        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    try:
        run()
        torch.cuda.synchronize()
    except RuntimeError as e:
        print(f"  cuBLAS _scaled_mm declined: {str(e).splitlines()[0][:160]}")
        return None
    return run


def triton_call(a, b, sa, sb, fast: bool) -> Optional[Any]:
    """torch._scaled_mm compiled by Inductor max-autotune with only Triton templates as candidates."""
    import torch._inductor.config as cfg
    cfg.max_autotune_gemm_backends = "TRITON"

    def f(a, b, sa, sb):
        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    compiled = torch.compile(f, mode="max-autotune-no-cudagraphs", dynamic=False)
    try:
        compiled(a, b, sa, sb)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a peer's failure is reported, not fatal
        print(f"  Inductor scaled mm failed: {str(e).splitlines()[0][:160]}")
        return None
    return lambda: compiled(a, b, sa, sb)


# DeepSeek-V3 activations (K = 7168) at prefill and decode sizes, a 16384 x 4096 weight, K past a 128 group
QUANTIZE_SHAPES = [(4096, 7168), (16384, 4096), (16, 7168), (4000, 7072)]

# (N, K) of the weights: DeepSeek-V3 (q_a, q_b, kv_a, o, an expert's gate+up and down), Llama-70B (qkv, o, gate+up,
# down)
A16_WEIGHTS = [(1536, 7168), (24576, 1536), (576, 7168), (7168, 16384), (4096, 7168), (7168, 2048),
               (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]
A16_QUICK = [(576, 7168), (4096, 7168), (7168, 2048), (8192, 8192), (8192, 28672)]
A16_M = [1, 4, 16, 64]
SPEC_TBPS = 4.8  # the H200's HBM3e bandwidth
# --a16's mainloop variants, timed beside the default plan (nvfly_ms) as <name>_ms / <name>_tbps / <name>_floor;
# "shuffled" / "bits*" read shuffle_mxfp4_a16's copy of the weight in their layout (made once per weight, untimed)
A16_VARIANTS = {
    "ring": A16Config(stages=8),  # the default before the registers mainloop measured faster
    "shuffled": A16Config(layout="shuffled", stages=8),
    "bits": A16Config(layout="shuffled-bf16", stages=8),
    "bits_registers": A16Config(layout="shuffled-bf16", stages=0),
    "bits_registers_u8": A16Config(layout="shuffled-bf16", stages=0, unroll=8),
    "bits_w8": A16Config(layout="shuffled-bf16", warps=8, stages=4),
    "bits_w8_registers": A16Config(layout="shuffled-bf16", warps=8, stages=0),
    "bits_ahead": A16Config(layout="shuffled-bf16", stages=0, ahead=True),
    "bits_ahead_u2": A16Config(layout="shuffled-bf16", stages=0, unroll=2, ahead=True),
    "bits_w8_ahead": A16Config(layout="shuffled-bf16", warps=8, stages=0, ahead=True),
    # a producer warp TMA-loads 4-chunk stages into a ring shared by the warps (loads in flight by construction)
    "tma": A16Config(tma_stages=8),
    "tma16": A16Config(tma_stages=16),
    "bits_tma": A16Config(layout="shuffled-bf16", tma_stages=8),
}


def copy_tbps() -> float:
    """The device copy bandwidth (bytes read + written per second, in TB/s) of a 1 GiB bf16 copy, measured here."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e9


def a16_rows(weights: list[tuple[int, int]], ms: list[int], variants: list[str],
             save: Any) -> tuple[list[dict[str, Any]], float]:
    """MXFP4 x bf16 rows (the module docstring's --a16) and the measured copy bandwidth; ``save(rows, ceiling)``
    after every row (a timed-out run keeps what it measured)."""
    ceiling = copy_tbps()
    print(f"device copy: {ceiling:.2f} TB/s (reads + writes)", flush=True)
    rows = []
    for n, k in progress(weights, "scaled_mxfp4_a16"):
        w = torch.randn(n, k, device="cuda")
        q, sb = quantize_mxfp4(w.bfloat16(), "b")  # packed (K/2, N) column-major, e8m0 bytes (N, K/32)
        sb = sb.view(torch.float8_e8m0fnu)
        w16 = dequantize_mxfp4(q.t(), sb).bfloat16().t()  # (K, N): torch.matmul's weight of the same shape
        shuffled = {lay: shuffle_mxfp4_a16(q, lay) for lay in {A16_VARIANTS[v].layout for v in variants}
                    if lay != "natural"}
        del w
        weight_bytes = n * k // 2 + n * k // 32
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            scaled.scaled_mm(x, q, None, sb, out=out)
            ref = x.float() @ w16.float()
            row = {"m": m, "n": n, "k": k, "scaling": "mxfp4", "recipe": "mxfp4_a16", "out": "bf16", "path": scaled.path(x, q, None, sb),
                   "rel_err": rel_err(out, ref), "max_err": max_err(out, ref), "weight_bytes": weight_bytes}
            row["nvfly_ms"] = bench_ms(lambda: scaled.scaled_mm(x, q, None, sb, out=out))
            row["bf16_ms"] = bench_ms(lambda: torch.matmul(x, w16))
            row["nvfly_tbps"] = weight_bytes / row["nvfly_ms"] / 1e9
            row["bf16_tbps"] = 2 * n * k / row["bf16_ms"] / 1e9
            row["floor_fraction"] = row["nvfly_tbps"] / ceiling
            row["spec_fraction"] = row["nvfly_tbps"] / SPEC_TBPS
            row["vs_bf16"] = row["bf16_ms"] / row["nvfly_ms"]
            row["nvfly_tflops"] = 2.0 * m * n * k / row["nvfly_ms"] / 1e9
            line = []
            for name in variants:
                cfg = A16_VARIANTS[name]
                wq = shuffled.get(cfg.layout, q)
                got = torch.full_like(out, float("nan"))
                scaled.scaled_mm(x, wq, None, sb, out=got, config=cfg)
                row[f"{name}_rel_err"] = rel_err(got, ref)
                row[f"{name}_ms"] = bench_ms(lambda: scaled.scaled_mm(x, wq, None, sb, out=got, config=cfg))
                row[f"{name}_tbps"] = weight_bytes / row[f"{name}_ms"] / 1e9
                row[f"{name}_floor"] = row[f"{name}_tbps"] / ceiling
                line.append(f"{name} {row[f'{name}_tbps']:.2f} ({row[f'{name}_floor']:.0%}, err "
                            f"{row[f'{name}_rel_err']:.1e})")
            del ref
            rows.append(row)
            save(rows, ceiling)
            print(f"{m:>3}x{n:>5}x{k:>5} mxfp4_a16  err {row['rel_err']:.1e}  nvfly {row['nvfly_ms'] * 1e3:7.1f} us "
                  f"{row['nvfly_tbps']:.2f} TB/s ({row['floor_fraction']:.0%} of copy, {row['spec_fraction']:.0%} of "
                  f"{SPEC_TBPS})  bf16 matmul {row['bf16_ms'] * 1e3:7.1f} us ({row['bf16_tbps']:.2f} TB/s) "
                  f"x{row['vs_bf16']:.2f}  {row['path']}\n    TB/s: " + "  ".join(line), flush=True)
        del q, sb, w16, shuffled
    return rows, ceiling


def a16_summary(rows: list[dict[str, Any]], ceiling: float, variants: list[str], seconds: float) -> dict[str, Any]:
    """The geomean fraction of the copy bandwidth at M <= 16 of the default plan and of each variant."""
    small = [r for r in rows if r["m"] <= 16]
    summary = {"seconds": seconds, "rows": len(rows), "copy_tbps": ceiling,
               "max_rel_err": max((r["rel_err"] for r in rows), default=0.0),
               "geomean_floor_fraction_m_le_16": geomean([r["floor_fraction"] for r in small]) if small else 0.0,
               "min_floor_fraction_m_le_16": min((r["floor_fraction"] for r in small), default=0.0),
               "geomean_vs_bf16": geomean([r["vs_bf16"] for r in rows]) if rows else 0.0}
    for name in variants:
        if small:
            summary[f"{name}_geomean_floor_m_le_16"] = geomean([r[f"{name}_floor"] for r in small])
        summary[f"{name}_max_rel_err"] = max((r[f"{name}_rel_err"] for r in rows), default=0.0)
    return summary


def a16_main(args: argparse.Namespace) -> int:
    t_start = time.time()
    name = args.name if args.name != "scaled" else "scaled_mxfp4_a16"
    variants = args.a16_variants

    def save(rows: list[dict[str, Any]], ceiling: float) -> str:
        return write_results(name, rows, {"summary": a16_summary(rows, ceiling, variants, time.time() - t_start),
                                          "variants": {v: repr(A16_VARIANTS[v]) for v in variants}})
    rows, ceiling = a16_rows(A16_QUICK if args.quick else A16_WEIGHTS, args.a16_m, variants, save)
    print(a16_summary(rows, ceiling, variants, time.time() - t_start))
    path = save(rows, ceiling)
    series = {"nvfly MXFP4 x bf16 (packed weight)": [r["nvfly_tbps"] for r in rows]}
    series.update({f"nvfly {v}": [r[f"{v}_tbps"] for r in rows] for v in variants})
    series["torch.matmul bf16 (bf16 weight)"] = [r["bf16_tbps"] for r in rows]
    plot(name, [f"{r['m']}x{r['n']}x{r['k']}" for r in rows], series, "weight TB/s")
    print("wrote", path)
    return 0


def alternative_configs(m: int, n: int, k: int, recipe: str, ahead: bool,
                        block_tiles: bool = False) -> dict[str, tuple[ScaledConfig, bool]]:
    """(config, swap) pairs timed next to the heuristic's plan (``nvfly_<name>_ms``, ``<name>_vs_cublas``). Small-M
    plans (swapped or split, ``small_m_alternatives``): their K reduction the other way. Unswapped, unsplit fp8
    plans: "registers", the same tile storing through registers; "previous", where the plan widened a tile to
    128 x 192, the 128 x 128 tile planned before (promoted: storing through registers); "split2", 65 to 128 rows, 128 x 128 tiles split
    in two along K (128 units of work for 128 x 8192); "streamk", the plan's tile (128 x 128 at 65 to 128 rows) with
    stream K, where the tiles end in a partial wave; up to CLUSTER_MAX_M rows, "cluster2" and "cluster4", the plan's
    tile in clusters of 2 or 4 blocks along N multicasting A, and where the plan's tile is 64 wide "tile128" (the
    128 x 128 tile) and "tile128_cluster2"; with ``ahead`` (always for block scales), "ahead", the
    promoted mainloop issuing k-block k+1 before k's add (not block1x128; 128 wide), or "in_order" where the plan
    issues ahead already (block scales' default). With ``block_tiles`` (block recipe, 128-row plans) only
    "in_order" (where the plan issues ahead) and the ``BLOCK_TILES`` that are not the plan's."""
    scaling, fast = recipe.removesuffix("-fast"), RECIPES[recipe][2]
    if recipe in MX_RECIPES:
        return {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    epilogue = ScaledEpilogue(scaling, promote=not fast or scaling.startswith("block"))
    plan = make_plan(m, n, k, epilogue, None, None, sms)
    if plan.swap or plan.config.split_k > 1:
        return small_m_alternatives(m, n, k, epilogue, plan, sms)
    if block_tiles:
        if scaling != "block" or plan.config.bm != 128:
            return {}
        configs = {"in_order": replace(plan.config, issue_ahead=False)} if plan.config.issue_ahead else {}
        for name, fields in BLOCK_TILES.items():
            config = deepest(replace(plan.config, **fields))
            if config != plan.config:
                configs[name] = config
        return {name: (config, False) for name, config in configs.items()}
    configs = {}
    if plan.config.tma_store:
        configs["registers"] = deepest(replace(plan.config, tma_store=False))
        if plan.config.bn == 192:  # promoted tiles were at most 128 wide through registers, fast ones 128 or 256
            configs["previous"] = deepest(replace(plan.config if fast else configs["registers"], bn=128))
    if 64 < m <= 128:
        configs["split2"] = deepest(ScaledConfig(128, 128, 2, 2, split_k=2))
    streamed = deepest(ScaledConfig(128, 128, 2, 2, tma_store=True, stream_k=True)) if 64 < m <= 128 else \
        replace(plan.config, stream_k=True)
    if m > 64 and make_plan(m, n, k, plan.epilogue, streamed, False, sms).sk_tiles:  # ends in a partial wave
        configs["streamk"] = streamed
    if m <= CLUSTER_MAX_M:
        for cluster in (2, 4):
            if replace(plan.config, cluster_n=cluster).check(plan.epilogue.promote) is None:
                configs[f"cluster{cluster}"] = replace(plan.config, cluster_n=cluster)
        if plan.config.bn == 64:
            configs["tile128"] = deepest(replace(plan.config, bn=128), most=plan.config.stages)
            configs["tile128_cluster2"] = replace(configs["tile128"], cluster_n=2)
    if plan.config.issue_ahead:  # the block-scaled default: its mainloop in order beside it
        configs["in_order"] = replace(plan.config, issue_ahead=False)
    elif (ahead or scaling == "block") and not fast and scaling != "block1x128":
        configs["ahead"] = replace(plan.config, issue_ahead=True)
        if configs["ahead"].check(promote=True):  # three 64 x 192 accumulators do not fit: 128 wide
            configs["ahead"] = deepest(replace(configs["ahead"], bn=128))
    return {name: (config, False) for name, config in configs.items()}


def small_m_alternatives(m: int, n: int, k: int, epilogue: ScaledEpilogue, plan: Any,
                         sms: int) -> dict[str, tuple[ScaledConfig, bool]]:
    """The small-M plan (swapped, or splitting K) reducing K the other way, on its own tiles and swap: where it
    splits K, "fixup" (the splits add up in the kernel: one launch, ScaledConfig.split_fix_up) or "reduce" (f32
    partials and the reduce kernel: two launches), whichever the plan is not; "streamk": stream K over its tiles
    instead (one launch, k ranges over every SM), where they end in a partial wave."""
    cfg = plan.config
    configs = {}
    if cfg.split_k > 1:
        configs["reduce" if cfg.split_fix_up else "fixup"] = (replace(cfg, split_fix_up=not cfg.split_fix_up),
                                                              plan.swap)
    streamed = replace(cfg, split_k=1, split_fix_up=False, stream_k=True)
    if make_plan(m, n, k, epilogue, streamed, plan.swap, sms).sk_tiles:
        configs["streamk"] = (streamed, plan.swap)
    return configs


def graph_rows(row: dict[str, Any], a, b, sa, sb, out: torch.Tensor, fast: bool, cublas: Optional[Any],
               alternatives: dict[str, tuple[ScaledConfig, bool]]) -> None:
    """The row's plan, alternatives and cuBLAS replayed from CUDA graphs (``graph_ms``: no host or launch gaps, a
    warm L2): ``nvfly_graph_ms``, ``nvfly_<name>_graph_ms``, ``cublas_graph_ms``, ``graph_vs_cublas`` and
    ``<name>_graph_vs_cublas``. What remains of a gap to the event-timed numbers is the host's."""
    row["nvfly_graph_ms"] = graph_ms(lambda: scaled.scaled_mm(a, b, sa, sb, out=out, use_fast_accum=fast))
    for name, (config, swap) in alternatives.items():
        row[f"nvfly_{name}_graph_ms"] = graph_ms(
            lambda: scaled.scaled_mm(a, b, sa, sb, out=out, config=config, swap=swap, use_fast_accum=fast))
    if cublas is not None and row["nvfly_graph_ms"]:
        row["cublas_graph_ms"] = graph_ms(cublas)
        if row["cublas_graph_ms"]:
            for who in ["nvfly"] + [f"nvfly_{name}" for name in alternatives]:
                if row.get(f"{who}_graph_ms"):
                    key = "graph_vs_cublas" if who == "nvfly" else f"{who.removeprefix('nvfly_')}_graph_vs_cublas"
                    row[key] = row["cublas_graph_ms"] / row[f"{who}_graph_ms"]


def quantize_bytes(m: int, k: int, granularity: str) -> int:
    """Bytes a quantisation moves: the bf16 read, the fp8 (MXFP4: packed e2m1) values and the scales written."""
    values = m * k // 2 if granularity == "mxfp4" else m * k
    scales = {"row": 4 * m, "1x128": 4 * m * -(-k // 128), "128x128": 4 * -(-m // 128) * -(-k // 128)}
    return 2 * m * k + values + scales.get(granularity, m * k // 32)


def quantize_rows(variant_names: Any = None) -> list[dict[str, Any]]:
    """nvfly's quantisation kernels against the torch reference (the same result bit for bit, checked): TB/s of
    bytes read + written (``quantize_bytes``) beside a torch copy of as many bytes (copy_tbps: half of them read,
    half written) and the torch reference's time; each ``QUANTIZE_VARIANTS`` plan that applies to the granularity
    checked and timed beside the default (``<variant>_bit_exact``, ``nvfly_<variant>_tbps``, ``<variant>_vs_default``:
    > 1 the variant is faster); ``variant_names``: only those (None: all)."""
    rows = []
    for m, k in QUANTIZE_SHAPES:
        x = torch.randn(m, k, device="cuda").bfloat16()
        for granularity in ("row", "1x128", "128x128", "mx", "mxfp4"):
            def kernel(variant="default", granularity=granularity):
                if granularity == "mxfp4":
                    return quantize_mxfp4(x, "a", variant)
                return quantize_fp8(x, granularity, variant=variant)
            q_ref, s_ref = quantize(x, granularity)

            def exact(variant: str) -> bool:
                q, s = kernel(variant)
                return torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
            variants = [name for name, (granularities, _) in QUANTIZE_VARIANTS.items()
                        if granularity in granularities and (variant_names is None or name in variant_names)]
            exacts = {variant: exact(variant) for variant in ["default"] + variants}
            del q_ref, s_ref
            moved = quantize_bytes(m, k, granularity)
            src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            nvfly_ms = bench_ms(kernel)
            variant_ms = {variant: bench_ms(lambda variant=variant: kernel(variant)) for variant in variants}
            if variants:  # the default timed again after them, its faster time kept (no drift favours either)
                nvfly_ms = min(nvfly_ms, bench_ms(kernel))
            copy_ms = bench_ms(lambda: dst.copy_(src))
            torch_ms = bench_ms(lambda: quantize(x, granularity))
            del src, dst
            row = {"m": m, "k": k, "granularity": granularity, "bit_exact": exacts["default"], "bytes": moved,
                   "nvfly_ms": nvfly_ms, "copy_ms": copy_ms, "torch_ms": torch_ms,
                   "nvfly_tbps": moved / nvfly_ms / 1e9, "copy_tbps": 2 * (moved // 2) / copy_ms / 1e9,
                   "vs_copy": copy_ms / nvfly_ms, "vs_torch": torch_ms / nvfly_ms}
            for variant, ms in variant_ms.items():
                row.update({f"{variant}_bit_exact": exacts[variant], f"nvfly_{variant}_ms": ms,
                            f"nvfly_{variant}_tbps": moved / ms / 1e9, f"{variant}_vs_default": nvfly_ms / ms})
            rows.append(row)
            print(f"quantize {m:>5}x{k:>5} {granularity:>7}  bit-exact {exacts['default']}  nvfly "
                  f"{row['nvfly_tbps']:5.2f} TB/s  torch copy of the same bytes {row['copy_tbps']:5.2f} TB/s "
                  f"(x{row['vs_copy']:.2f})  x{row['vs_torch']:.1f} vs the torch reference", flush=True)
            for variant in variants:
                print(f"    variant {variant:>15}  bit-exact {exacts[variant]}  {row[f'nvfly_{variant}_tbps']:5.2f} "
                      f"TB/s (x{row[f'{variant}_vs_default']:.2f} the default)", flush=True)
    return rows


def quantize_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """All bit exact, and per granularity the lowest TB/s and fraction of the copy over the shapes of at least
    16 MB moved (the small ones measure the launch)."""
    summary: dict[str, Any] = {"quantize_all_bit_exact": all(v for r in rows for key, v in r.items()
                                                             if key.endswith("bit_exact"))}
    for granularity in sorted({r["granularity"] for r in rows}):
        large = [r for r in rows if r["granularity"] == granularity and r["bytes"] >= 16 << 20]
        if large:
            summary[f"quantize_min_tbps_{granularity}"] = min(r["nvfly_tbps"] for r in large)
            summary[f"quantize_min_vs_copy_{granularity}"] = min(r["vs_copy"] for r in large)
            for variant in QUANTIZE_VARIANTS:
                if f"nvfly_{variant}_tbps" in large[0]:
                    summary[f"quantize_min_tbps_{granularity}_{variant}"] = min(r[f"nvfly_{variant}_tbps"]
                                                                                 for r in large)
    return summary


# --grouped-mx: DeepSeek-V3 (E 256, top-8) at 4096 tokens (uniform: 128 rows an expert; topk8: a random router's
# ragged counts) and a masked decode batch of 128 tokens (benchmarks.grouped's cases and routing)
GROUPED_MX_CASES = [("DSv3 gate/up T4096", "forward", 256, 4096, 7168, 4096 * 8, "uniform"),
                    ("DSv3 gate/up T4096 routed", "forward", 256, 4096, 7168, 4096 * 8, "topk8"),
                    ("DSv3 down T4096", "forward", 256, 7168, 2048, 4096 * 8, "uniform"),
                    ("DSv3 masked decode T128", "masked", 256, 4096, 7168, 128 * 8, "uniform")]


def mx_experts(e: int, n: int, k: int, recipe: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random expert weights quantised expert by expert (all experts' fp32 weights at once would take 30 GB): b
    [E, K, N] e4m3 (mxfp8) or [E, K/2, N] packed e2m1 (mxfp4), column-major, scale_b [E, N, K/32] e8m0, and the
    dequantised weights in bf16 [E, K, N] (K-major), the bf16 peer's."""
    from nvfly.ops.scaled.quantize import dequantize_mx
    width = k // 2 if recipe == "mxfp4" else k
    q = torch.empty(e, n, width, dtype=torch.uint8, device="cuda")
    scales = torch.empty(e, n, k // 32, dtype=torch.uint8, device="cuda")
    w16 = torch.empty(e, n, k, dtype=torch.bfloat16, device="cuda")
    for g in range(e):
        qt, s = quantize(torch.randn(n, k, device="cuda"), "mxfp4" if recipe == "mxfp4" else "mx", operand="b")
        q[g], scales[g] = qt.t().view(torch.uint8), s
        w16[g] = (dequantize_mxfp4(qt.t(), s) if recipe == "mxfp4" else dequantize_mx(qt.t(), s)).bfloat16()
    dtype = torch.float4_e2m1fn_x2 if recipe == "mxfp4" else torch.float8_e4m3fn
    return q.view(dtype).mT, scales.view(torch.float8_e8m0fnu), w16.mT


def grouped_mx_rows(recipes: list[str], save: Any) -> list[dict[str, Any]]:
    """The --grouped-mx rows (the module docstring); ``save(rows)`` after every row."""
    from benchmarks.grouped import Case, group_sizes, offsets
    from nvfly.ops import grouped
    from nvfly.ops.scaled.quantize import dequantize_mx
    rows = []
    for name, kind, e, n, k, routed_rows, routing in progress(GROUPED_MX_CASES, "scaled_grouped_mx"):
        sizes = group_sizes(Case(name, kind, e, n, k, routed_rows, routing))
        masked = kind == "masked"
        if masked:  # a fixed capacity of twice the expected rows (benchmarks.grouped's)
            capacity = 8 * math.ceil(2 * routed_rows / e / 8)
            groups_of = torch.tensor([min(s, capacity) for s in sizes], dtype=torch.int32, device="cuda")
            tokens, routed = e * capacity, int(groups_of.sum())
        else:
            groups_of = offsets(sizes)
            tokens = routed = sum(sizes)
        a, sa = quantize(torch.randn(tokens, k, device="cuda"), "mx")
        sa = sa.view(torch.float8_e8m0fnu)
        a16 = dequantize_mx(a, sa).bfloat16()
        if masked:
            a, sa, a16 = a.view(e, capacity, k), sa.view(e, capacity, k // 32), a16.view(e, capacity, k)
        expected = routed_rows / e
        for recipe in recipes:
            b, sb, b16 = mx_experts(e, n, k, recipe)
            out = torch.full(tuple(a.shape[:-1]) + (n,), float("nan"), device="cuda", dtype=torch.bfloat16)
            if masked:
                def nvfly_mx():
                    return scaled.scaled_grouped_mm_masked(a, b, sa, sb, groups_of, out=out, expected_rows=expected)

                def bf16():
                    return grouped.grouped_mm_masked(a16, b16, groups_of, expected_rows=expected)
            else:
                def nvfly_mx():
                    return scaled.scaled_grouped_mm(a, b, sa, sb, groups_of, out=out)

                def bf16():
                    return grouped.grouped_mm(a16, b16, groups_of)
            ref = scaled.grouped_reference(a, b, sa, sb, groups_of, masked=masked)
            owned = ~ref.isnan()
            got, peer = nvfly_mx(), bf16()
            row = {"case": name, "layout": "masked" if masked else "contiguous", "experts": e, "n": n, "k": k,
                   "rows": routed, "routing": routing, "recipe": recipe, "scaling": f"grouped-{recipe}", "out": "bf16",
                   "nvfly_plan": scaled.describe_grouped("masked" if masked else "contiguous", e, a.shape[-2], n, k,
                                                         scaling=recipe, rows_per_group=expected),
                   "unwritten": int(got[owned].isnan().sum()), "rel_err": rel_err(got[owned], ref[owned]),
                   "max_err": max_err(got[owned], ref[owned]), "bf16_rel_err": rel_err(peer[owned], ref[owned])}
            del ref, owned, got, peer
            row["nvfly_ms"] = bench_ms(nvfly_mx)
            row["bf16_ms"] = bench_ms(bf16)
            flop = 2.0 * routed * n * k
            active = sum(1 for s in sizes if s)
            weight_bytes = active * n * (k // 2 if recipe == "mxfp4" else k) + active * n * k // 32
            mx_bytes = routed * (k + k // 32) + weight_bytes + 2 * routed * n
            row.update(nvfly_tflops=flop / row["nvfly_ms"] / 1e9, bf16_tflops=flop / row["bf16_ms"] / 1e9,
                       nvfly_tbps=mx_bytes / row["nvfly_ms"] / 1e9, vs_bf16=row["bf16_ms"] / row["nvfly_ms"])
            rows.append(row)
            save(rows)
            print(f"{name:<26} {recipe}  err {row['rel_err']:.1e} max {row['max_err']:.1e} (bf16 peer "
                  f"{row['bf16_rel_err']:.1e})  nvfly {row['nvfly_tflops']:6.1f} TFLOP/s {row['nvfly_tbps']:.2f} TB/s"
                  f"  bf16 grouped {row['bf16_tflops']:6.1f} x{row['vs_bf16']:.2f}  {row['nvfly_plan']}", flush=True)
            del b, sb, b16, out
            torch.cuda.empty_cache()
    return rows


def grouped_mx_main(args: argparse.Namespace) -> int:
    t_start = time.time()
    name = args.name if args.name != "scaled" else "scaled_grouped_mx"
    recipes = [r for r in (args.recipes or MX_RECIPES) if r in MX_RECIPES]

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"seconds": time.time() - t_start, "rows": len(rows),
                "max_rel_err": max((r["rel_err"] for r in rows), default=0.0),
                **{f"geomean_vs_bf16_{recipe}": geomean([r["vs_bf16"] for r in rows if r["recipe"] == recipe])
                   for recipe in recipes if any(r["recipe"] == recipe for r in rows)}}
    rows = grouped_mx_rows(recipes, lambda done: write_results(name, done, {"partial": True}))
    print(summary(rows))
    path = write_results(name, rows, {"summary": summary(rows)})
    plot(name, [f"{r['case']} {r['recipe']}" for r in rows],
         {"nvfly grouped MX": [r["nvfly_tflops"] for r in rows],
          "nvfly grouped bf16": [r["bf16_tflops"] for r in rows]}, "TFLOP/s")
    print("wrote", path)
    return 0


def quantize_main(args: argparse.Namespace) -> int:
    t_start = time.time()
    rows = quantize_rows(args.quantize_variants)
    summary = {"seconds": time.time() - t_start, **quantize_summary(rows)}
    print(summary)
    path = write_results(args.name if args.name != "scaled" else "scaled_quantize", rows, {"summary": summary})
    print("wrote", path)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="six shapes (< 3 min on the H200)")
    p.add_argument("--issue-suite", action="store_true",
                   help="issue 30's shapes: M 16, 128, 512, 4096, 16384 x DeepSeek-V3's and Llama-70B's (N, K), 35")
    p.add_argument("--no-triton", action="store_true")
    p.add_argument("--triton-shapes", type=int, default=None,
                   help="time Inductor's Triton scaled mm on the first N shapes (default: 1 with --quick, else 3)")
    p.add_argument("--shapes", nargs="*", default=None)
    p.add_argument("--recipes", nargs="*", default=None, choices=list(RECIPES),
                   help="default: all (--quick: all but tensor-fast)")
    p.add_argument("--name", default="scaled")
    p.add_argument("--no-quantize", action="store_true", help="skip the quantisation kernels' rows")
    p.add_argument("--quantize-variants", nargs="*", choices=sorted(QUANTIZE_VARIANTS), default=None,
                   help="the quantisation plan variants timed beside the defaults (default: all; none: give the "
                        "flag alone)")
    p.add_argument("--quantize-only", action="store_true",
                   help="only the quantisation kernels' rows (< 3 min on the H200 with every variant; default name "
                        "scaled_quantize)")
    p.add_argument("--issue-ahead", action="store_true",
                   help="also time the promoted mainloop issuing k-block k+1 before k's add (ScaledConfig."
                        "issue_ahead) on the heuristic's unswapped tensor/row/block plans (nvfly_ahead_ms)")
    p.add_argument("--no-alternatives", action="store_true",
                   help="skip the alternative configs (alternative_configs: the register epilogue, split K at small M)")
    p.add_argument("--block-tiles", action="store_true",
                   help="the block recipe's tiles over several weight blocks on BLOCK_TILE_SHAPES (module docstring)")
    p.add_argument("--a16", action="store_true",
                   help="MXFP4 weights x bf16 activations instead (the module docstring; --quick: ~3 min)")
    p.add_argument("--a16-m", nargs="*", type=int, default=A16_M, help="--a16's token counts")
    p.add_argument("--a16-variants", nargs="*", default=list(A16_VARIANTS), choices=list(A16_VARIANTS),
                   help="--a16's mainloop variants timed beside the default (A16_VARIANTS; default: all)")
    p.add_argument("--grouped-mx", action="store_true",
                   help="the grouped MX GEMM (MoE) on DeepSeek-V3 routing instead (the module docstring; ~3 min)")
    args = p.parse_args(argv)
    if args.grouped_mx:
        return grouped_mx_main(args)
    if args.a16:
        return a16_main(args)
    if args.quantize_only:
        return quantize_main(args)
    if args.block_tiles:
        args.recipes, args.no_quantize = args.recipes or ["block"], True
    if args.recipes is None:
        args.recipes = [r for r in RECIPES if not (args.quick and r == "tensor-fast")]
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else \
        (BLOCK_TILE_SHAPES if args.block_tiles else ISSUE_SHAPES if args.issue_suite else QUICK if args.quick
         else SUITE)
    triton_shapes = 0 if args.no_triton else (args.triton_shapes if args.triton_shapes is not None
                                              else 1 if args.quick else 3)
    rows = []
    t_start = time.time()
    block_ms: dict[tuple[int, int, int], float] = {}  # nvfly's block path per shape: the MX rows' peer
    for idx, (m, n, k) in progress(list(enumerate(shapes)), "scaled"):
        a16 = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        b16 = torch.randn(n, k, device="cuda").to(torch.bfloat16).t()
        bf16_ms = bench_ms(lambda: torch.mm(a16, b16))
        for recipe in args.recipes:
            fast = RECIPES[recipe][2]
            a, b, sa, sb = operands(m, n, k, recipe)
            reason = scaled.eligibility(a, b, sa, sb)
            if reason:
                print(f"{m}x{n}x{k} {recipe}: declined ({reason})")
                continue
            ref = scaled.reference(a, b, sa, sb)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            scaled.scaled_mm(a, b, sa, sb, out=out, use_fast_accum=fast)
            row = {"m": m, "n": n, "k": k, "recipe": recipe, "scaling": scaled.recipe(a, b, sa, sb), "out": "bf16",
                   "path": scaled.path(a, b, sa, sb, use_fast_accum=fast),
                   "rel_err": rel_err(out, ref), "max_err": max_err(out, ref)}
            cublas = None if recipe in MX_RECIPES else cublas_call(a, b, sa, sb, fast)  # no MX on Hopper
            if cublas is not None:
                theirs = cublas()
                row["cublas_rel_err"], row["cublas_max_err"] = rel_err(theirs, ref), max_err(theirs, ref)
            row["nvfly_ms"] = bench_ms(lambda: scaled.scaled_mm(a, b, sa, sb, out=out, use_fast_accum=fast))
            if recipe == "block":
                block_ms[(m, n, k)] = row["nvfly_ms"]
            if recipe in MX_RECIPES:
                if (m, n, k) not in block_ms:
                    ba, bb, bsa, bsb = operands(m, n, k, "block")
                    block_out = torch.empty_like(out)
                    block_ms[(m, n, k)] = bench_ms(lambda: scaled.scaled_mm(ba, bb, bsa, bsb, out=block_out))
                row["nvfly_block_ms"] = block_ms[(m, n, k)]
            if cublas is not None:
                row["cublas_ms"] = bench_ms(cublas)
            # --quick: the row and block targets, and every recipe's small-M rows (host-sensitive, microseconds)
            timed = not args.no_alternatives and (recipe in QUICK_ALTERNATIVES or not args.quick or m <= SWAP_MAX_M)
            alternatives = alternative_configs(m, n, k, recipe, args.issue_ahead, args.block_tiles) if timed else {}
            for name, (config, swap) in alternatives.items():
                other = torch.full_like(out, float("nan"))
                scaled.scaled_mm(a, b, sa, sb, out=other, config=config, swap=swap, use_fast_accum=fast)
                row[f"{name}_rel_err"] = rel_err(other, ref)
                row[f"nvfly_{name}_ms"] = bench_ms(
                    lambda: scaled.scaled_mm(a, b, sa, sb, out=other, config=config, swap=swap, use_fast_accum=fast))
                row[f"{name}_path"] = scaled.path(a, b, sa, sb, use_fast_accum=fast, config=config, swap=swap)
            if m <= SWAP_MAX_M and timed:  # small M is host-sensitive: also without host or launch gaps
                graph_rows(row, a, b, sa, sb, out, fast, cublas, alternatives)
            if idx < triton_shapes and not recipe.startswith("block") and not (args.quick and recipe != "row"):
                tri = triton_call(a, b, sa, sb, fast)
                if tri is not None:
                    row["triton_ms"] = bench_ms(tri)
            row["bf16_ms"] = bf16_ms
            flop = 2.0 * m * n * k
            for who in ("nvfly", "nvfly_block", "cublas", "triton", "bf16") + tuple(f"nvfly_{x}" for x in ALTERNATIVES):
                if f"{who}_ms" in row:
                    row[f"{who}_tflops"] = flop / row[f"{who}_ms"] / 1e9
            for who in ("cublas", "triton", "bf16"):
                if f"{who}_ms" in row:
                    row[f"vs_{who}"] = row[f"{who}_ms"] / row["nvfly_ms"]
            if "nvfly_block_ms" in row:
                row["vs_block"] = row["nvfly_block_ms"] / row["nvfly_ms"]
            for name in ALTERNATIVES:
                if f"nvfly_{name}_ms" in row:
                    row[f"{name}_vs_nvfly"] = row["nvfly_ms"] / row[f"nvfly_{name}_ms"]
                    if "cublas_ms" in row:
                        row[f"{name}_vs_cublas"] = row["cublas_ms"] / row[f"nvfly_{name}_ms"]
            rows.append(row)
            write_results(args.name, rows, {"partial": True})  # what a run cut short leaves
            print(f"{m:>5}x{n:>5}x{k:>5} {recipe:>11}  err {row['rel_err']:.1e} max {row['max_err']:.1e}"
                  + (f" (cuBLAS {row['cublas_rel_err']:.1e})" if "cublas_rel_err" in row else "")
                  + f"  nvfly {row['nvfly_tflops']:6.1f}"
                  + (f"  cuBLAS {row['cublas_tflops']:6.1f} x{row['vs_cublas']:.2f}" if "cublas_ms" in row else "")
                  + "".join(f"  {name} {row[f'nvfly_{name}_tflops']:6.1f} (err {row[f'{name}_rel_err']:.1e})"
                            for name in ALTERNATIVES if f"nvfly_{name}_ms" in row)
                  + (f"  Triton {row['triton_tflops']:6.1f} x{row['vs_triton']:.2f}" if "triton_ms" in row else "")
                  + (f"  graphs: x{row['graph_vs_cublas']:.2f}" if "graph_vs_cublas" in row else "")
                  + "".join(f" {name} x{row[f'{name}_graph_vs_cublas']:.2f}" for name in ALTERNATIVES
                            if f"{name}_graph_vs_cublas" in row)
                  + (f"  nvfly block {row['nvfly_block_tflops']:6.1f} x{row['vs_block']:.2f}" if "vs_block" in row
                     else "")
                  + f"  bf16 {row['bf16_tflops']:6.1f} TFLOP/s  {row['path']}", flush=True)
    summary: dict[str, Any] = {"seconds": time.time() - t_start, "rows": len(rows),
                               "max_rel_err": max(r["rel_err"] for r in rows)}
    for recipe in args.recipes:
        mine = [r for r in rows if r["recipe"] == recipe]
        summary[f"geomean_vs_cublas_{recipe}"] = geomean([r["vs_cublas"] for r in mine if "vs_cublas" in r])
        summary[f"geomean_vs_bf16_{recipe}"] = geomean([r["vs_bf16"] for r in mine])
        if recipe in MX_RECIPES:
            summary[f"geomean_vs_block_{recipe}"] = geomean([r["vs_block"] for r in mine])
    for name in ALTERNATIVES:  # the alternative against the heuristic's plan (> 1: faster) and against cuBLAS
        summary[f"geomean_{name}_vs_nvfly"] = geomean([r[f"{name}_vs_nvfly"] for r in rows if f"{name}_vs_nvfly" in r])
        summary[f"geomean_{name}_vs_cublas"] = geomean([r[f"{name}_vs_cublas"] for r in rows
                                                        if f"{name}_vs_cublas" in r])
    for name in ("",) + tuple(f"{x}_" for x in ALTERNATIVES):  # small M replayed from CUDA graphs
        ratios = [r[f"{name}graph_vs_cublas"] for r in rows if f"{name}graph_vs_cublas" in r]
        if ratios:
            summary[f"geomean_{name}graph_vs_cublas"] = geomean(ratios)
    summary["geomean_vs_triton"] = geomean([r["vs_triton"] for r in rows if "vs_triton" in r])
    quantized = [] if args.no_quantize else quantize_rows(args.quantize_variants)
    if quantized:
        summary.update(quantize_summary(quantized))
    print(summary)
    path = write_results(args.name, rows, {"summary": summary, "quantize": quantized})
    labels = [f"{r['m']}x{r['n']}x{r['k']} {r['recipe']}" for r in rows]
    plot(args.name, labels, {"nvfly": [r["nvfly_tflops"] for r in rows],
                             "cuBLAS _scaled_mm": [r.get("cublas_tflops", 0.0) for r in rows],
                             "bf16 torch.mm": [r["bf16_tflops"] for r in rows]}, "TFLOP/s")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
