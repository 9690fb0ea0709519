"""RMSNorm: nvfly vs eager torch (F.rms_norm -> aten::_fused_rms_norm) vs Inductor, in one process.

Correctness first (relative error against a float64 reference on fresh random inputs), then the median time of
each (the three timed in turn, ``--rounds`` times over, the median of the rounds kept: long rows at the DRAM
roofline differ by less than one reading's noise), and the bandwidth: bytes read + written (x, weight, y; also the
residual and x + residual for the fused add; dy, x, weight, dx for the backward) per second, next to a
device-to-device copy of the same number of bytes timed the same way in the same run (``pct_of_copy``: the copy's
time over nvfly's) and to the card's large-copy bandwidth (``pct_of_peak_copy``: about 4.3 TB/s; each row's
``copy_tbps`` says what a copy of its size reaches). ``--graphs`` adds each one's time replayed from CUDA graphs:
a few-microsecond launch's do_bench time also holds the host's launch path (Inductor's wrapper code, nvfly's).
Usage: python -m benchmarks.rmsnorm [--quick] [--graphs] [--shapes M,N ...] [--rounds R]   (or: nvfly bench rmsnorm)
Writes benchmarks/results/rmsnorm_h200.json and rmsnorm_h200.png.

``--compare-plans``: nvfly's forward under the default plan and each of PLAN_VARIANTS (the row kernel as it was,
with the weight loaded with the row, with 4 or 2 vectors a thread, with cache hints, other block sizes; the
persistent kernel), side by side with eager torch and Inductor, on the quick suite's shapes and the fused-add
shapes (or --shapes); every plan's output is checked before anything is timed. Writes
benchmarks/results/rmsnorm_plans_h200.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (bench_ms, geomean, graph_ms, interleaved_ms, plot, progress, rel_err,  # noqa: E402
                               write_results)
import nvfly  # noqa: E402
from nvfly.ops import rmsnorm  # noqa: E402
from nvfly.ops.rmsnorm import plan as rmsnorm_plan  # noqa: E402

COPY_TBPS = 4.3  # measured device copy bandwidth of the H200 on a large copy (reads + writes)
SUITE_M = [1, 32, 256, 4096, 16384, 65536]
SUITE_N = [2048, 4096, 7168, 8192, 16384]
FUSED_ADD = [(4096, 4096), (16384, 8192), (65536, 2048)]
BACKWARD = [(4096, 2048), (16384, 4096), (16384, 8192), (4096, 16384)]
EPS = 1e-6
# --compare-plans: the forward's plan choices timed side by side (the default plan is timed first, as "default")
PLAN_VARIANTS = {
    "rows before": rmsnorm.ForwardOptions(target_vectors=8, early_weight=False),  # the plan before 2026-11-29
    "rows 8 vectors": rmsnorm.ForwardOptions(target_vectors=8),  # the weight loaded with the row
    "rows 4 vectors": rmsnorm.ForwardOptions(target_vectors=4),
    "rows 2 vectors": rmsnorm.ForwardOptions(target_vectors=2),  # Inductor's shape: more warps
    "rows hints": rmsnorm.ForwardOptions(cache_hints=True),
    "rows before 64": rmsnorm.ForwardOptions(block_threads=64, target_vectors=8, early_weight=False),
    "rows before 256": rmsnorm.ForwardOptions(block_threads=256, target_vectors=8, early_weight=False),
    "persistent": rmsnorm.ForwardOptions(persistent=True),
    "persistent hints": rmsnorm.ForwardOptions(persistent=True, cache_hints=True),
    # the two-pass kernel (Inductor's structure: a block a row, the row read twice, few registers, many warps);
    # "two-pass" takes the fewest threads that cover the row in one step of 2 vectors a thread
    "two-pass": rmsnorm.ForwardOptions(two_pass=True),
    "two-pass hints": rmsnorm.ForwardOptions(two_pass=True, cache_hints=True),
    "two-pass 256": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=256),
    "two-pass 512": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=512),
    "two-pass 1024": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=1024),
    "two-pass 256x4": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=256, two_pass_vectors=4),
    "two-pass 1024x1": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=1024, two_pass_vectors=1),
    # 14 warps: a 7168-element bf16 row in one unmasked step (512 threads leave 64 idle); measured no faster
    "two-pass 448": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=448, cache_hints=rmsnorm.LOAD_HINTS),
    # the bulk-copy kernel: rows streamed into a shared-memory ring by bulk copies, a block a row at a time
    "bulk": rmsnorm.ForwardOptions(bulk=True),
    "bulk 4 stages": rmsnorm.ForwardOptions(bulk=True, bulk_stages=4),
    "bulk 1 block": rmsnorm.ForwardOptions(bulk=True, bulk_blocks_per_sm=1),
    "bulk 128x4": rmsnorm.ForwardOptions(bulk=True, bulk_threads=128, bulk_blocks_per_sm=4),
    "bulk 512": rmsnorm.ForwardOptions(bulk=True, bulk_threads=512),
    "bulk 2 stages": rmsnorm.ForwardOptions(bulk=True, bulk_stages=2),
    "bulk 2 stages 1 block": rmsnorm.ForwardOptions(bulk=True, bulk_stages=2, bulk_blocks_per_sm=1),
    # Inductor's reduction loop: 512 threads, 8-byte accesses, 2048 (4096) columns a step
    "two-pass 512x1 8B": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=512, two_pass_vectors=1,
                                                vector_bytes=8),
    "two-pass 512x2 8B": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=512, two_pass_vectors=2,
                                                vector_bytes=8),
    "rows 8B": rmsnorm.ForwardOptions(vector_bytes=8),
    # Inductor's cache hints: loads hinted (the two-pass's first read evict_last in L1 and L2), stores plain
    "rows load hints": rmsnorm.ForwardOptions(cache_hints=rmsnorm.LOAD_HINTS),
    "two-pass load hints": rmsnorm.ForwardOptions(two_pass=True, cache_hints=rmsnorm.LOAD_HINTS),
    "two-pass 512x4 8B load hints": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=512, two_pass_vectors=4,
                                                           vector_bytes=8, cache_hints=rmsnorm.LOAD_HINTS),
}
PLAN_MAX_ERR = 1e-2  # --compare-plans: max |y - reference| / max |reference| (bf16 rounding: about 4e-3)


def _allow_recompiles() -> None:
    """Every shape is compiled statically (Inductor at its best): allow one graph per shape."""
    import torch._dynamo.config as dynamo_config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 4096)


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def _torch_forward(n: int, fused_add: bool):
    """Eager torch's forward (with the unfused residual add when ``fused_add``): fn(x, r, w) or fn(x, w)."""
    if fused_add:
        def run_torch(x, r, w):
            h = x + r
            return F.rms_norm(h, (n,), w, EPS), h
    else:
        def run_torch(x, w):
            return F.rms_norm(x, (n,), w, EPS)
    return run_torch


def forward_row(m: int, n: int, dtype: torch.dtype, fused_add: bool, rounds: int = 1, graphs: bool = False) -> dict:
    x = torch.randn(m, n, device="cuda").to(dtype)
    w = torch.randn(n, device="cuda").to(dtype)
    r = torch.randn(m, n, device="cuda").to(dtype) if fused_add else None
    run_torch = _torch_forward(n, fused_add)
    if fused_add:
        def run_nvfly():
            return rmsnorm.rms_norm(x, w, EPS, residual=r)
        args = (x, r, w)
        moved = 4 * m * n * x.element_size() + n * w.element_size()  # x, r read; y, x + r written
    else:
        def run_nvfly():
            return rmsnorm.rms_norm(x, w, EPS)
        args = (x, w)
        moved = 2 * m * n * x.element_size() + n * w.element_size()
    compiled = torch.compile(run_torch, dynamic=False)
    out = run_nvfly()
    y = out[0] if fused_add else out
    ref_in = (x + r) if fused_add else x
    row = {"M": m, "N": n, "dtype": str(dtype).replace("torch.", ""), "variant": "fused_add" if fused_add else
           "forward", "rel_err": rel_err(y, _reference(ref_in, w))}
    if fused_add:
        row["residual_exact"] = bool(torch.equal(out[1], x + r))
    compiled(*args)
    _time(row, run_nvfly, lambda: run_torch(*args), lambda: compiled(*args), rounds, graphs)
    return _bandwidth(row, moved)


def backward_row(m: int, n: int, dtype: torch.dtype, rounds: int = 1, graphs: bool = False) -> dict:
    x = torch.randn(m, n, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
    dy = torch.randn(m, n, device="cuda").to(dtype)
    _, rstd = torch.ops.aten._fused_rms_norm(x, [n], w, EPS)

    def run_torch(dy, x, rstd, w):
        return torch.ops.aten._fused_rms_norm_backward(dy, x, [n], rstd, w, [True, True])

    def run_nvfly():
        return rmsnorm.rms_norm_backward(dy, x, rstd.reshape(-1), w)

    compiled = torch.compile(run_torch, dynamic=False)
    gx, gw = run_nvfly()
    ref_x, ref_w = run_torch(dy.double(), x.double(), rstd.double(), w.double())
    row = {"M": m, "N": n, "dtype": str(dtype).replace("torch.", ""), "variant": "backward",
           "rel_err": max(rel_err(gx, ref_x), rel_err(gw, ref_w))}
    compiled(dy, x, rstd, w)
    _time(row, run_nvfly, lambda: run_torch(dy, x, rstd, w), lambda: compiled(dy, x, rstd, w), rounds, graphs)
    return _bandwidth(row, 3 * m * n * x.element_size() + 2 * n * w.element_size())


def _time(row: dict, run_nvfly, run_torch, run_inductor, rounds: int, graphs: bool) -> None:
    """nvfly's, eager torch's and Inductor's median times, interleaved over ``rounds`` (the median of the rounds'
    medians); with several rounds, also each round's Inductor / nvfly ratio (``vs_inductor_rounds``). With
    ``graphs``, each also replayed from a CUDA graph (``*_graph_ms``, ``vs_inductor_graph``): a few-microsecond
    kernel's do_bench time holds the host's launch path too (Inductor's wrapper, nvfly's), the graph's does not."""
    fns = {"nvfly": run_nvfly, "torch": run_torch, "inductor": run_inductor}
    times = interleaved_ms(fns, rounds)
    for impl, t in times.items():
        row[f"{impl}_ms"] = statistics.median(t)
    if rounds > 1:
        row["vs_inductor_rounds"] = [i / n for i, n in zip(times["inductor"], times["nvfly"])]
    if graphs:
        for impl, fn in fns.items():
            row[f"{impl}_graph_ms"] = graph_ms(fn)
        _graph_ratios(row)


def _graph_ratios(row: dict) -> None:
    """``vs_inductor_graph`` and ``vs_torch_graph`` of a row's CUDA-graph times (none where a capture failed)."""
    for peer in ("inductor", "torch"):
        if row["nvfly_graph_ms"] and row[f"{peer}_graph_ms"]:
            row[f"vs_{peer}_graph"] = row[f"{peer}_graph_ms"] / row["nvfly_graph_ms"]


def _ratio_range(row: dict) -> list[float]:
    """The lowest and highest Inductor / nvfly ratio over the rounds (the median's alone with one round)."""
    rounds = row.get("vs_inductor_rounds") or [row["vs_inductor"]]
    return [min(rounds), max(rounds)]


def _below(row: dict) -> dict:
    """A row's ratios to Inductor: the median and the rounds' range under do_bench, and from CUDA graphs."""
    return {"vs_inductor": row["vs_inductor"], "rounds": _ratio_range(row), "graph": row.get("vs_inductor_graph")}


def _graph_line(row: dict) -> str:
    if "vs_inductor_graph" not in row:
        return ""
    return (f"  graphs: nvfly {1e3 * row['nvfly_graph_ms']:.2f} us, inductor {1e3 * row['inductor_graph_ms']:.2f}"
            f" x{row['vs_inductor_graph']:.3f}")


def _round_range(row: dict) -> str:
    low, high = _ratio_range(row)
    return f" (rounds {low:.3f}-{high:.3f})" if "vs_inductor_rounds" in row else ""


@functools.lru_cache(maxsize=None)
def copy_ms(moved: int) -> float:
    """Median time of a device-to-device copy that reads and writes ``moved`` bytes in all (timed like the kernels)."""
    src = torch.randn(max(1, moved // 4), device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    return bench_ms(lambda: dst.copy_(src))


def _bandwidth(row: dict, moved: int) -> dict:
    row["bytes"] = moved
    for impl in ("nvfly", "torch", "inductor"):
        row[f"{impl}_tbps"] = moved / row[f"{impl}_ms"] / 1e9
    row["copy_ms"] = copy_ms(moved)
    row["copy_tbps"] = moved / row["copy_ms"] / 1e9
    row["pct_of_copy"] = 100 * row["copy_ms"] / row["nvfly_ms"]
    row["pct_of_peak_copy"] = 100 * row["nvfly_tbps"] / COPY_TBPS
    row["vs_torch"] = row["torch_ms"] / row["nvfly_ms"]
    row["vs_inductor"] = row["inductor_ms"] / row["nvfly_ms"]
    return row


def _poison(*shapes_dtypes: tuple) -> None:
    """Free NaN-filled blocks of the sizes about to be allocated, so that an output element no kernel wrote is
    NaN (torch's caching allocator hands the same blocks back)."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape, dtype in shapes_dtypes]
    del blocks


def plan_rows(m: int, n: int, dtype: torch.dtype, fused_add: bool, only: Optional[list[str]] = None,
              rounds: int = 1, graphs: bool = False) -> list[dict]:
    """nvfly's forward (with a weight; with the residual add when ``fused_add``) under the default plan and each of
    PLAN_VARIANTS, one row each, with eager torch's and Inductor's times on the same inputs. Correctness first:
    every plan's output (allocated over NaN) must be within PLAN_MAX_ERR of the float64 reference, row by row,
    and x + residual exact, before anything is timed. A variant whose plan is an earlier one's is left out, as is
    one that does not apply to the shape (the persistent kernel for rows too long for it), and those not in
    ``only`` (if given)."""
    x = torch.randn(m, n, device="cuda").to(dtype)
    w = torch.randn(n, device="cuda").to(dtype)
    r = torch.randn(m, n, device="cuda").to(dtype) if fused_add else None
    reference = _reference(x + r if fused_add else x, w)
    moved = (4 if fused_add else 2) * m * n * x.element_size() + n * w.element_size()
    rows, runs, plans = [], [], []
    for name, options in {"default": rmsnorm.ForwardOptions(), **PLAN_VARIANTS}.items():
        if only and name != "default" and name not in only:
            continue
        try:
            p = rmsnorm.plan_of(x, w, r, options=options)
        except ValueError:
            continue
        if p in plans:
            continue
        run = functools.partial(rmsnorm.rms_norm_forward, x, w, EPS, r, want_rstd=False, options=options)
        with nvfly.compile_only() as kernels:  # records the kernel the plan launches: its block and registers
            run()
        (kernel,) = kernels
        threads = kernel.block[0]
        _poison(((m, n), dtype), ((m, n), dtype))
        y, h, _ = run()
        row = {"M": m, "N": n, "dtype": str(dtype).replace("torch.", ""), "variant": "fused_add" if fused_add else
               "forward", "plan": name, "default": name == "default", "options": dataclasses.asdict(options),
               "kernel": kernel.name, "threads": threads, "blocks_per_sm": p.blocks_per_sm,
               "early_weight": p.early_weight, "registers": kernel.resources.registers,
               "resident_warps": rmsnorm_plan.resident_warps(kernel.resources.registers, threads),
               "rel_err": rel_err(y, reference),
               "max_err": float(((y.double() - reference).abs().amax(1) / reference.abs().amax(1)).max())}
        if p.persistent:  # its grid holds blocks_per_sm blocks per SM, whatever more the registers allow
            row["resident_warps"] = min(row["resident_warps"], p.blocks_per_sm * threads // 32)
        if fused_add:
            row["residual_exact"] = bool(torch.equal(h, x + r))
        assert row["max_err"] < PLAN_MAX_ERR and row.get("residual_exact", True), row  # NaN fails too
        rows.append(row)
        runs.append(run)
        plans.append(p)
    run_torch = _torch_forward(n, fused_add)
    args = (x, r, w) if fused_add else (x, w)
    compiled = torch.compile(run_torch, dynamic=False)
    compiled(*args)
    peers = {"torch": lambda: run_torch(*args), "inductor": lambda: compiled(*args)}
    fns = {**{row["plan"]: run for row, run in zip(rows, runs)}, **peers}
    times = {name: statistics.median(t) for name, t in interleaved_ms(fns, rounds).items()}
    graphed = {name: graph_ms(fn) for name, fn in fns.items()} if graphs else {}
    for row in rows:
        row["nvfly_ms"], row["torch_ms"], row["inductor_ms"] = times[row["plan"]], times["torch"], times["inductor"]
        if graphs:
            row["nvfly_graph_ms"], row["inductor_graph_ms"] = graphed[row["plan"]], graphed["inductor"]
            row["torch_graph_ms"] = graphed["torch"]
            _graph_ratios(row)
        _bandwidth(row, moved)
    return rows


def compare_plans(shapes: list[tuple[int, int]], fused_add_shapes: list[tuple[int, int]],
                  only: Optional[list[str]] = None, name: str = "rmsnorm_plans", rounds: int = 1,
                  graphs: bool = False) -> int:
    """--compare-plans: one line per shape and plan, the default first (marked *), then torch and Inductor; each
    timed in turn ``rounds`` times over (and from CUDA graphs with ``graphs``)."""
    _allow_recompiles()
    rows = []
    t_start = time.time()
    for variant, m, n in [("forward", m, n) for m, n in shapes] + [("fused_add", m, n) for m, n in fused_add_shapes]:
        shape_rows = plan_rows(m, n, torch.bfloat16, variant == "fused_add", only, rounds, graphs)
        rows += shape_rows
        best = min(r["nvfly_ms"] for r in shape_rows)
        for r in shape_rows:
            r["vs_best"] = r["nvfly_ms"] / best
            print(f"{variant:>9} {m:>6}x{n:<6} bf16 {r['plan']:<16}{'*' if r['default'] else ' '} "
                  f"{r['kernel']:<26} {r['threads']:>4} threads {r['registers']:>3} regs {r['resident_warps']:>2} "
                  f"warps/SM  {1e3 * r['nvfly_ms']:8.1f} us {r['pct_of_copy']:3.0f}% of copy  "
                  f"x{r['vs_inductor']:.3f} vs inductor  x{r['vs_torch']:.2f} vs torch{_graph_line(r)}", flush=True)
        print(f"{variant:>9} {m:>6}x{n:<6} bf16 torch {1e3 * shape_rows[0]['torch_ms']:.1f} us, inductor "
              f"{1e3 * shape_rows[0]['inductor_ms']:.1f} us", flush=True)
        torch.cuda.empty_cache()
    defaults = [r for r in rows if r["default"]]
    big = [r for r in defaults if r["variant"] == "forward" and r["M"] >= 4096]
    summary = {"default_geomean_vs_best": geomean([r["vs_best"] for r in defaults]),
               "default_max_vs_best": max(r["vs_best"] for r in defaults),
               "default_min_pct_of_copy_M_ge_4096": min((r["pct_of_copy"] for r in big), default=None),
               "default_min_vs_inductor": min(r["vs_inductor"] for r in defaults),
               "best_plan": {f"{r['variant']} {r['M']}x{r['N']}": r["plan"] for r in rows if r["vs_best"] == 1},
               "seconds": time.time() - t_start}
    print(summary)
    print("wrote", write_results(name, rows, {"summary": summary, "copy_tbps": COPY_TBPS, "rounds": rounds}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="M in {256, 16384} only, no fp32, no backward")
    p.add_argument("--name", default="rmsnorm", help="results file stem: benchmarks/results/<name>_h200.json (and "
                                                      ".png), so that a partial run does not replace the suite's")
    p.add_argument("--shapes", nargs="*", default=None, help="M,N pairs (forward, bf16)")
    p.add_argument("--fused-add-shapes", nargs="*", default=None,
                   help="--compare-plans: M,N pairs of the fused add (default: the suite's, or none with --shapes)")
    p.add_argument("--rounds", type=int, default=3,
                   help="time nvfly (each plan), torch and Inductor in turn this many times over, the median kept")
    p.add_argument("--graphs", action="store_true",
                   help="also replay each from CUDA graphs (no host launch path in the time, a warm L2)")
    p.add_argument("--plans", nargs="*", default=None, help="--compare-plans: only these variants (and the default)")
    p.add_argument("--compare-plans", action="store_true",
                   help="time nvfly's forward under each plan variant next to torch and Inductor (quick-suite and "
                        "fused-add shapes)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds: expected 1 or more, got {args.rounds}")
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    else:
        shapes = [(m, n) for m in ([256, 16384] if args.quick or args.compare_plans else SUITE_M) for n in SUITE_N]
    if args.compare_plans:
        fused = FUSED_ADD if args.fused_add_shapes is None and not args.shapes else \
            [tuple(int(v) for v in s.split(",")) for s in args.fused_add_shapes or []]
        unknown = set(args.plans or []) - set(PLAN_VARIANTS)
        if unknown:
            p.error(f"--plans: unknown {sorted(unknown)}; known: {sorted(PLAN_VARIANTS)}")
        return compare_plans(shapes, fused, args.plans, "rmsnorm_plans" if args.name == "rmsnorm" else args.name,
                             args.rounds, args.graphs)
    _allow_recompiles()
    cases = [("forward", m, n, torch.bfloat16) for m, n in shapes]
    if not args.quick and not args.shapes:
        cases += [("forward", m, n, torch.float32) for m, n in [(4096, 4096), (16384, 8192)]]
        cases += [("fused_add", m, n, torch.bfloat16) for m, n in FUSED_ADD]
        cases += [("backward", m, n, torch.bfloat16) for m, n in BACKWARD]
    rows = []
    t_start = time.time()
    for variant, m, n, dtype in progress(cases, "rmsnorm"):
        row = backward_row(m, n, dtype, args.rounds, args.graphs) if variant == "backward" else \
            forward_row(m, n, dtype, variant == "fused_add", args.rounds, args.graphs)
        rows.append(row)
        print(f"{variant:>9} {m:>6}x{n:<6} {row['dtype']:>8}  err {row['rel_err']:.1e}  nvfly "
              f"{row['nvfly_tbps']:5.2f} TB/s ({row['pct_of_copy']:3.0f}% of copy)  torch {row['torch_tbps']:5.2f}"
              f"  inductor {row['inductor_tbps']:5.2f}  x{row['vs_torch']:.2f} vs torch  x{row['vs_inductor']:.3f}"
              f" vs inductor{_round_range(row)}{_graph_line(row)}", flush=True)
        torch.cuda.empty_cache()
    big = [r for r in rows if r["variant"] == "forward" and r["M"] >= 4096]
    summary = {"geomean_vs_torch": geomean([r["vs_torch"] for r in rows]),
               "geomean_vs_inductor": geomean([r["vs_inductor"] for r in rows]),
               "min_vs_inductor": min(r["vs_inductor"] for r in rows),
               "min_pct_of_copy_M_ge_4096": min((r["pct_of_copy"] for r in big), default=None),
               "min_pct_of_peak_copy_M_ge_4096": min((r["pct_of_peak_copy"] for r in big), default=None),
               "max_rel_err": max(r["rel_err"] for r in rows), "seconds": time.time() - t_start,
               "geomean_vs_inductor_graph": geomean([r.get("vs_inductor_graph") for r in rows]),
               "min_vs_inductor_graph": min((r["vs_inductor_graph"] for r in rows if "vs_inductor_graph" in r),
                                            default=None),
               # rows under Inductor (median or graphs), with the rounds' range of the ratio: within it, a tie
               "below_inductor": {f"{r['variant']} {r['M']}x{r['N']} {r['dtype']}": _below(r) for r in rows
                                  if r["vs_inductor"] < 1 or r.get("vs_inductor_graph", 1) < 1}}
    print(summary)
    path = write_results(args.name, rows, {"summary": summary, "copy_tbps": COPY_TBPS, "rounds": args.rounds})
    labels = [f"{r['variant'][:3]} {r['M']}x{r['N']} {r['dtype']}" for r in rows]
    plot(args.name, labels, {"nvfly": [r["nvfly_tbps"] for r in rows], "torch": [r["torch_tbps"] for r in rows],
                             "inductor": [r["inductor_tbps"] for r in rows]}, "TB/s (read + write)")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
