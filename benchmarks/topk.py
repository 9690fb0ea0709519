"""TopK: nvfly vs torch.topk, in one process, on the suite's sampling and MoE-routing shapes.

Correctness first: values equal to torch.topk's, the same selected indices (identical order when k > 32, where
torch's sort is stable), and exactly the documented stable-sort order. Then the median time of each; the
bandwidth counts one read of the input (the floor for any TopK). Inductor is not timed: it lowers topk to the
same aten kernel. Usage: python -m benchmarks.topk [--quick] [--graphs] [--shapes M,N,K ...]   (or: nvfly bench
topk). Writes benchmarks/results/topk_h200.json and topk_h200.png.

``--graphs``: both also replayed from CUDA graphs (``graph_ms``: no per-call event floor, warm L2, as under
torch.compile's reduce-overhead mode); the do_bench columns stay the headline. The floor matters on the small
routing rows: a one-element ``zero_()`` measures 3.6 us under do_bench, torch.topk 64x128 14.4 us
(git show 7b6b5ce:benchmarks/results/bench_floor_h200.log).

``--compare-plans``: per sampling shape (bf16; ``--shapes`` for others), the default plan and, for rows cut into
slices, the slices + merge plan (``row_threshold=False``) with all, half and one of its slices, the
row-threshold plan (``topk.plan(..., row_threshold=True)``, ``nvfly/ops/topk/row.py``) and its opt-in two-level
select (``two-level``: ``topk.plan(..., row_threshold=True, two_level=True)``); each is checked against the
documented order before it is timed. ``--graphs`` adds their times from CUDA graphs, ``--kernels`` their kernels'
GPU time (e.g. the row-threshold plan in one cooperative launch against two: ``--compare-plans --graphs --kernels
--shapes 1,151936,50 1,151936,1024``). Writes benchmarks/results/topk_plans_h200.json (and its printed table:
topk_plans_h200.log).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_ms, geomean, graph_ms, plot, progress, write_results  # noqa: E402
from nvfly.ops import topk  # noqa: E402
from nvfly.ops.topk import api as topk_api  # noqa: E402
from nvfly.runtime.torch_args import vector_width  # noqa: E402
from nvfly.runtime.driver import plan_sm_count  # noqa: E402

SAMPLING = [(m, n, k) for m in (1, 64, 256) for n in (128256, 151936) for k in (50, 1024)]
ROUTING = [(m, n, k) for m in (64, 4096, 16384) for n in (128, 256) for k in (2, 8)]
ANCHOR = [(4096, 32768, 8)]  # anchors.md: torch.topk bf16 1.06 ms


def check(x: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor) -> dict:
    ref_v, ref_i = torch.topk(x, k)
    stable_v, stable_i = torch.sort(x, dim=-1, descending=True, stable=True)
    same_values = bool(torch.equal(values, ref_v))
    same_set = bool(torch.equal(indices.sort(-1).values, ref_i.sort(-1).values))
    return {"values_match_torch": same_values, "indices_match_torch": bool(torch.equal(indices, ref_i)),
            "index_sets_match_torch": same_set, "matches_stable_sort": bool(torch.equal(indices, stable_i[:, :k]))}


def run(m: int, n: int, k: int, dtype: torch.dtype, kind: str, graphs: bool = False) -> dict:
    x = torch.randn(m, n, device="cuda").to(dtype)
    values, indices = topk.topk(x, k)
    row = {"M": m, "N": n, "k": k, "dtype": str(dtype).replace("torch.", ""), "kind": kind,
           **check(x, k, values, indices)}
    row["nvfly_ms"] = bench_ms(lambda: topk.topk(x, k))
    row["torch_ms"] = bench_ms(lambda: torch.topk(x, k))
    row["vs_torch"] = row["torch_ms"] / row["nvfly_ms"]
    if graphs:  # both replayed from CUDA graphs: the GPU time per call without the per-call event floor
        row["nvfly_graph_ms"] = graph_ms(lambda: topk.topk(x, k))
        row["torch_graph_ms"] = graph_ms(lambda: torch.topk(x, k))
        if row["nvfly_graph_ms"] and row["torch_graph_ms"]:
            row["vs_torch_graph"] = row["torch_graph_ms"] / row["nvfly_graph_ms"]
    read = m * n * x.element_size()
    row["nvfly_tbps"] = read / row["nvfly_ms"] / 1e9
    row["torch_tbps"] = read / row["torch_ms"] / 1e9
    return row


def plan_variants(x: torch.Tensor, k: int) -> dict:
    """name -> call() of the current implementation under its default plan and, when rows are cut into
    slices, with half the slices and with none (``topk.plan``'s max_parts), the row-threshold plan (in two
    launches, and in one where its blocks fit the GPU at once) and its two-level select."""
    m, n = x.shape
    vec = vector_width(n, (x,), x.element_size())
    sms = plan_sm_count(x.get_device())
    shape = (n, k, m, vec, x.element_size(), sms)
    plans = {"default": topk.plan(*shape)}
    sliced = topk.plan(*shape, row_threshold=False)
    if not sliced.warp and sliced.parts > 1:
        plans.update({"slices": sliced, f"parts<={sliced.parts // 2}": topk.plan(*shape, sliced.parts // 2, False),
                      "parts=1": topk.plan(*shape, 1, False),
                      "row-threshold": topk.plan(*shape, row_threshold=True, one_launch=False)})
        one = topk.plan(*shape, row_threshold=True)
        if one.one_launch:
            plans["one-launch"] = one
        plans["two-level"] = topk.plan(*shape, row_threshold=True, two_level=True)
    return {name: allocating_call(topk_api.runner(p, m, n, k, True), x, k) for name, p in plans.items()}


def allocating_call(run: Callable[..., None], x: torch.Tensor, k: int) -> Callable[[], tuple]:
    """call() -> (values, indices): ``run(x, values, indices)`` into fresh outputs, as topk.topk allocates them."""
    m = x.shape[0]

    def call():
        values = torch.empty((m, k), dtype=x.dtype, device=x.device)
        indices = torch.empty((m, k), dtype=torch.int64, device=x.device)
        run(x, values, indices)
        return values, indices
    return call


def compare_plans(cases: list[tuple[int, int, int]], graphs: bool = False, kernels: bool = False) -> int:
    """--compare-plans: one line per shape: torch.topk, the default plan (*) and its variants (``graphs``: a
    second line of each replayed from CUDA graphs; ``kernels``: a third with the GPU time of their kernels, from
    torch.profiler, back to back, taken after every shape's other timings: CUDA graphs replayed after the profiler
    has run in a process measured ~0.5 us a launch slower: git show 7b6b5ce:benchmarks/results/topk_notes.md)."""
    from benchmarks.device_time import kernel_times
    rows = []
    profiled = []  # (row, its variants) for the kernel times, after every other timing
    t_start = time.time()
    for m, n, k in cases:
        x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
        calls = plan_variants(x, k)
        row = {"M": m, "N": n, "k": k, "dtype": "bfloat16", "torch_ms": bench_ms(lambda: torch.topk(x, k))}
        for name, call in calls.items():
            values, indices = call()
            row[f"{name}_correct"] = bool(torch.equal(indices, expected) and torch.equal(values, x.gather(1, expected)))
            row[f"{name}_ms"] = bench_ms(call) if row[f"{name}_correct"] else None
            if graphs and row[f"{name}_correct"]:
                row[f"{name}_graph_ms"] = graph_ms(call)
        if graphs:
            row["torch_graph_ms"] = graph_ms(lambda: torch.topk(x, k))
        rows.append(row)
        if kernels:
            profiled.append((row, calls))
        print(f"{m:>6}x{n:<7} k={k:<5} torch {row['torch_ms'] * 1e3:7.1f} us | " + " | ".join(
            f"{name}{'*' if name == 'default' else ''} " +
            (f"{row[f'{name}_ms'] * 1e3:7.1f} us x{row['torch_ms'] / row[f'{name}_ms']:5.2f}"
             if row[f"{name}_ms"] else "MISMATCH") for name in calls), flush=True)
        if graphs:
            print(f"{'graphs':>22} torch {row['torch_graph_ms'] * 1e3:7.1f} us | " + " | ".join(
                f"{name} {row[f'{name}_graph_ms'] * 1e3:7.1f} us x{row['torch_graph_ms'] / row[f'{name}_graph_ms']:5.2f}"
                for name in calls if row.get(f"{name}_graph_ms")), flush=True)
        torch.cuda.empty_cache()
    for row, calls in profiled:
        for name, call in calls.items():
            if row[f"{name}_correct"]:
                row[f"{name}_kernels_us"] = kernel_times(call, calls=50)
        print(f"{row['M']:>6}x{row['N']:<7} k={row['k']:<5} kernels " + " | ".join(
            f"{name} {sum(row[f'{name}_kernels_us'].values()):5.2f} us ({len(row[f'{name}_kernels_us'])})"
            for name in calls if f"{name}_kernels_us" in row), flush=True)
    timed = [r for r in rows if r["default_ms"]]
    summary = {"all_correct": all(v for r in rows for key, v in r.items() if key.endswith("_correct")),
               "default_geomean_vs_torch": geomean([r["torch_ms"] / r["default_ms"] for r in timed]),
               "default_min_vs_torch": min((r["torch_ms"] / r["default_ms"] for r in timed), default=None),
               "seconds": time.time() - t_start}
    print(summary)
    print("wrote", write_results("topk_plans", rows, {"summary": summary}))
    return 0 if summary["all_correct"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="bf16 only")
    p.add_argument("--shapes", nargs="*", default=None, help="M,N,K triples (bf16)")
    p.add_argument("--graphs", action="store_true",
                   help="also time both replayed from CUDA graphs (no per-call event floor, warm L2: "
                        "torch.compile's reduce-overhead mode)")
    p.add_argument("--kernels", action="store_true",
                   help="--compare-plans: also each plan's kernel time (torch.profiler), the launch gaps left out")
    p.add_argument("--compare-plans", action="store_true",
                   help="the default plan and fewer slices, on the sampling shapes")
    args = p.parse_args(argv)
    if args.compare_plans:
        return compare_plans([tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SAMPLING,
                             args.graphs, args.kernels)
    if args.shapes:
        cases = [(*(int(v) for v in s.split(",")), torch.bfloat16, "custom") for s in args.shapes]
    else:
        cases = [(m, n, k, torch.bfloat16, "sampling") for m, n, k in SAMPLING]
        cases += [(m, n, k, torch.bfloat16, "routing") for m, n, k in ROUTING]
        cases += [(m, n, k, torch.bfloat16, "anchor") for m, n, k in ANCHOR]
        if not args.quick:  # sampling logits and router logits are often fp32
            cases += [(m, n, k, torch.float32, "sampling") for m, n, k in SAMPLING]
            cases += [(m, n, k, torch.float32, "routing") for m, n, k in ROUTING]
    rows = []
    t_start = time.time()
    for m, n, k, dtype, kind in progress(cases, "topk"):
        row = run(m, n, k, dtype, kind, args.graphs)
        rows.append(row)
        ok = row["values_match_torch"] and row["index_sets_match_torch"] and row["matches_stable_sort"]
        print(f"{kind:>8} {m:>6}x{n:<7} k={k:<5} {row['dtype']:>8}  {'ok' if ok else 'MISMATCH'}  nvfly "
              f"{row['nvfly_ms'] * 1e3:8.1f} us  torch {row['torch_ms'] * 1e3:8.1f} us  x{row['vs_torch']:.2f}"
              + (f"  graphs: x{row['vs_torch_graph']:.2f}" if "vs_torch_graph" in row else ""), flush=True)
        torch.cuda.empty_cache()
    summary = {kind: {"geomean_vs_torch": geomean([r["vs_torch"] for r in rows if r["kind"] == kind]),
                      "min_vs_torch": min((r["vs_torch"] for r in rows if r["kind"] == kind), default=None)}
               for kind in sorted({r["kind"] for r in rows})}
    for kind in summary:
        graphed = [r["vs_torch_graph"] for r in rows if r["kind"] == kind and "vs_torch_graph" in r]
        if graphed:
            summary[kind].update({"geomean_vs_torch_graph": geomean(graphed), "min_vs_torch_graph": min(graphed)})
    summary["all_correct"] = all(r["values_match_torch"] and r["index_sets_match_torch"] and
                                 r["matches_stable_sort"] for r in rows)
    summary["seconds"] = time.time() - t_start
    print(summary)
    path = write_results("topk", rows, {"summary": summary})
    labels = [f"{r['M']}x{r['N']} k{r['k']} {r['dtype']}" for r in rows]
    plot("topk", labels, {"nvfly": [r["vs_torch"] for r in rows], "torch": [1.0] * len(rows)},
         "speed-up over torch.topk")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
