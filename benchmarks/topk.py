"""TopK: nvfly vs torch.topk, in one process, on the suite's sampling and MoE-routing shapes.

Correctness first: values equal to torch.topk's, the same selected indices (identical order when k > 32, where
torch's sort is stable), and exactly the documented stable-sort order. Then the median time of each; the
bandwidth counts one read of the input (the floor for any TopK). Inductor is not timed: it lowers topk to the
same aten kernel. Usage: python -m benchmarks.topk [--quick] [--shapes M,N,K ...]   (or: nvfly bench topk)
Writes benchmarks/results/topk_h200.json and topk_h200.png.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_ms, geomean, plot, write_results  # noqa: E402
from nvfly.ops import topk  # noqa: E402

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


def run(m: int, n: int, k: int, dtype: torch.dtype, kind: str) -> dict:
    x = torch.randn(m, n, device="cuda").to(dtype)
    values, indices = topk.topk(x, k)
    row = {"M": m, "N": n, "k": k, "dtype": str(dtype).replace("torch.", ""), "kind": kind,
           **check(x, k, values, indices)}
    row["nvfly_ms"] = bench_ms(lambda: topk.topk(x, k))
    row["torch_ms"] = bench_ms(lambda: torch.topk(x, k))
    row["vs_torch"] = row["torch_ms"] / row["nvfly_ms"]
    read = m * n * x.element_size()
    row["nvfly_tbps"] = read / row["nvfly_ms"] / 1e9
    row["torch_tbps"] = read / row["torch_ms"] / 1e9
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="bf16 only")
    p.add_argument("--shapes", nargs="*", default=None, help="M,N,K triples (bf16)")
    args = p.parse_args(argv)
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
    for m, n, k, dtype, kind in cases:
        row = run(m, n, k, dtype, kind)
        rows.append(row)
        ok = row["values_match_torch"] and row["index_sets_match_torch"] and row["matches_stable_sort"]
        print(f"{kind:>8} {m:>6}x{n:<7} k={k:<5} {row['dtype']:>8}  {'ok' if ok else 'MISMATCH'}  nvfly "
              f"{row['nvfly_ms'] * 1e3:8.1f} us  torch {row['torch_ms'] * 1e3:8.1f} us  x{row['vs_torch']:.2f}",
              flush=True)
        torch.cuda.empty_cache()
    summary = {kind: {"geomean_vs_torch": geomean([r["vs_torch"] for r in rows if r["kind"] == kind]),
                      "min_vs_torch": min((r["vs_torch"] for r in rows if r["kind"] == kind), default=None)}
               for kind in sorted({r["kind"] for r in rows})}
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
