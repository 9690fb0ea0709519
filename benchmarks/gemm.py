"""GEMM: nvfly vs cuBLAS (torch.mm) vs Inductor max-autotune (Triton templates only), in one process.

Correctness first (relative error vs a float32 reference on fresh random inputs, poisoned outputs), then the
median time of each. Usage: python -m benchmarks.gemm [--quick] [--no-triton] [--shapes M,N,K ...]
[--layout rowxcol] [--compare-paths] [--name gemm_part] [--full-suite] [--repeat N]. Every shape runs in all four
operand majors (row-major only with --quick; one layout with --layout); --full-suite: the anchors' 112 dense shapes;
--repeat N: nvfly and cuBLAS timed N times in turn on fresh operands, medians kept (single rows move up to 10%).
Each row names the nvfly kernel that ran (``path``); --compare-paths also times the wgmma kernel where the skinny
one ran (``wgmma_ms``). --layout rowxcol is the F.linear case (the skinny kernel's). --rerun-below 0.95 --repeat 3
[--rerun-from FILE]: only the rows (shape and layout) of a results file (default: the whole suite's) under that
ratio, e.g. to confirm which rows really lag. Writes benchmarks/results/gemm_h200.json and gemm_h200.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import RESULTS, bench_ms, geomean, plot, progress, rel_err, write_results  # noqa: E402
from nvfly.ops import gemm  # noqa: E402

# the anchor shapes (../shared/docs/anchors.md) first, then more of the suite
ANCHORS = [(4096, 4096, 4096), (8192, 8192, 8192), (128, 8192, 8192), (1024, 7168, 2048), (4096, 14336, 4096),
           (2048, 28672, 8192), (16, 4096, 4096)]
SUITE = ANCHORS + [(1, 4096, 4096), (64, 6144, 4096), (512, 28672, 4096), (2048, 4096, 14336),
                   (16384, 8192, 8192), (4096, 10240, 8192), (128, 8192, 28672), (2048, 2112, 7168),
                   (4096, 24576, 1536), (4096, 32768, 512), (512, 7168, 16384), (16384, 4096, 7168),
                   (16, 4096, 14336), (336, 4104, 1024), (512, 2112, 7168)]
MAJORS = [("row", "row"), ("row", "col"), ("col", "row"), ("col", "col")]
# the whole dense suite of ../shared/docs/anchors.md: every M with every model's (N, K) (--full-suite; long: pair it
# with --layout and --no-triton)
FULL_SUITE_M = [1, 16, 64, 128, 512, 2048, 4096, 16384]
FULL_SUITE_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),  # Llama-3-8B
                 (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672),  # Llama-3-70B
                 (2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]  # DeepSeek-V3
FULL_SUITE = [(m, n, k) for m in FULL_SUITE_M for n, k in FULL_SUITE_NK]


def make(m, n, k, majors, dtype=torch.bfloat16):
    a = torch.randn(m, k, device="cuda").to(dtype) if majors[0] == "row" else \
        torch.randn(k, m, device="cuda").to(dtype).t()
    b = torch.randn(k, n, device="cuda").to(dtype) if majors[1] == "row" else \
        torch.randn(n, k, device="cuda").to(dtype).t()
    return a, b


def rerun_cases(path: str, below: float) -> list[tuple[int, tuple[int, int, int], tuple[str, str]]]:
    """(index, shape, majors) of the rows of a results file whose nvfly/cuBLAS ratio was under ``below``."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    return [(i, (r["M"], r["N"], r["K"]), tuple(r["layout"].split("x"))) for i, r in enumerate(rows)
            if r["vs_cublas"] < below]


def triton_mm():
    """torch.mm compiled by Inductor max-autotune with only Triton templates as candidates."""
    import torch._inductor.config as cfg
    cfg.max_autotune_gemm_backends = "TRITON"
    return torch.compile(torch.mm, mode="max-autotune-no-cudagraphs", dynamic=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="anchor shapes, row-major operands only")
    p.add_argument("--no-triton", action="store_true")
    p.add_argument("--triton-shapes", type=int, default=len(ANCHORS), help="time Triton on the first N shapes")
    p.add_argument("--shapes", nargs="*", default=None)
    p.add_argument("--full-suite", action="store_true", help="all 112 shapes of the anchors' dense suite")
    p.add_argument("--repeat", type=int, default=1, help="time nvfly and cuBLAS this many times in turn, each on "
                                                         "fresh operands, and keep the medians")
    p.add_argument("--layout", default=None, help="one A x B layout for every shape, e.g. rowxcol")
    p.add_argument("--compare-paths", action="store_true", help="also time the wgmma kernel where skinny ran")
    p.add_argument("--name", default="gemm", help="results file stem: benchmarks/results/<name>_h200.json (and .png), "
                                                   "so that a partial run does not replace the suite's")
    p.add_argument("--rerun-below", type=float, default=None, metavar="RATIO",
                   help="time only the rows of --rerun-from whose nvfly/cuBLAS ratio was under RATIO (with their "
                        "layouts), e.g. --rerun-below 0.95 --repeat 3")
    p.add_argument("--rerun-from", default=os.path.join(RESULTS, "gemm_full_h200.json"),
                   help="the results file --rerun-below reads (default: the whole suite's)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat: expected at least 1, got {args.repeat}")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else \
        (ANCHORS if args.quick else FULL_SUITE if args.full_suite else SUITE)
    majors_list = [tuple(args.layout.split("x"))] if args.layout else [("row", "row")] if args.quick else MAJORS
    cases = [(idx, shape, majors) for idx, shape in enumerate(shapes) for majors in majors_list]
    if args.rerun_below is not None:
        cases = rerun_cases(args.rerun_from, args.rerun_below)
        args.triton_shapes = 0  # the rows' indices are not the anchors'
    tmm = None if args.no_triton else triton_mm()
    rows = []
    t_start = time.time()
    for idx, (m, n, k), majors in progress(cases, "gemm"):
        a, b = make(m, n, k, majors)
        reason = gemm.eligibility(a, b)
        if reason:
            print(f"{m}x{n}x{k} {majors}: declined ({reason})")
            continue
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm.matmul(a, b, out=out)
        err = rel_err(out, a.float() @ b.float())
        row = {"M": m, "N": n, "K": k, "layout": f"{majors[0]}x{majors[1]}", "dtype": "bf16",
               "rel_err": err, "path": gemm.path(a, b)}
        nvfly_runs, cublas_runs = [], []
        for run in range(args.repeat):
            if run:  # fresh operands, in fresh allocations (placement can move a large row by 10%)
                a, b = make(m, n, k, majors)
            nvfly_runs.append(bench_ms(lambda: gemm.matmul(a, b, out=out)))
            cublas_runs.append(bench_ms(lambda: torch.mm(a, b, out=out)))
        row["nvfly_ms"] = statistics.median(nvfly_runs)
        row["cublas_ms"] = statistics.median(cublas_runs)
        if args.repeat > 1:
            row["nvfly_ms_runs"], row["cublas_ms_runs"] = nvfly_runs, cublas_runs
        if args.compare_paths and row["path"].startswith("skinny"):
            row["wgmma_ms"] = bench_ms(lambda: gemm.matmul(a, b, out=out, skinny=False))
        if tmm is not None and idx < args.triton_shapes and majors == ("row", "row"):
            tmm(a, b)
            row["triton_ms"] = bench_ms(lambda: tmm(a, b))
        flop = 2.0 * m * n * k
        row["nvfly_tflops"] = flop / row["nvfly_ms"] / 1e9
        row["cublas_tflops"] = flop / row["cublas_ms"] / 1e9
        row["vs_cublas"] = row["cublas_ms"] / row["nvfly_ms"]
        if "triton_ms" in row:
            row["vs_triton"] = row["triton_ms"] / row["nvfly_ms"]
        rows.append(row)
        print(f"{m:>6}x{n:>6}x{k:>6} {row['layout']:>7}  err {err:.1e}  nvfly {row['nvfly_tflops']:6.1f}  "
              f"cuBLAS {row['cublas_tflops']:6.1f} TFLOP/s  x{row['vs_cublas']:.2f}  {row['path']} "
              f"{row['nvfly_ms'] * 1e3:.1f} us vs cuBLAS {row['cublas_ms'] * 1e3:.1f} us"
              + (f"  wgmma {row['wgmma_ms'] * 1e3:.1f} us" if "wgmma_ms" in row else "")
              + (f"  Triton x{row['vs_triton']:.2f}" if "vs_triton" in row else ""), flush=True)
    summary = {"geomean_vs_cublas": geomean([r["vs_cublas"] for r in rows]),
               "min_vs_cublas": min(r["vs_cublas"] for r in rows),
               "geomean_vs_triton": geomean([r["vs_triton"] for r in rows if "vs_triton" in r]),
               "max_rel_err": max(r["rel_err"] for r in rows), "seconds": time.time() - t_start,
               "geomean_vs_cublas_by_layout": {
                   layout: geomean([r["vs_cublas"] for r in rows if r["layout"] == layout])
                   for layout in sorted({r["layout"] for r in rows})},
               "geomean_vs_cublas_m_below_512": geomean([r["vs_cublas"] for r in rows if r["M"] < 512]),
               "geomean_vs_cublas_m_512_up": geomean([r["vs_cublas"] for r in rows if r["M"] >= 512]),
               "rows_below_0.9_vs_cublas": sum(r["vs_cublas"] < 0.9 for r in rows), "rows": len(rows)}
    labels = [f"{r['M']}x{r['N']}x{r['K']} {r['layout']}" for r in rows]
    summary["below_0.9_vs_cublas"] = {label: round(r["vs_cublas"], 3) for label, r in zip(labels, rows)
                                      if r["vs_cublas"] < 0.9}
    print(summary)
    path = write_results(args.name, rows, {"summary": summary})
    plot(args.name, labels, {"nvfly": [r["nvfly_tflops"] for r in rows],
                             "cuBLAS": [r["cublas_tflops"] for r in rows]}, "TFLOP/s")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
