"""Grouped GEMM (MoE experts): nvfly vs torch._grouped_mm (CUTLASS) vs Inductor max-autotune's grouped mm (Triton
templates), in one process.

Correctness first: each implementation's output against a float32 per-group reference (relative error, nvfly's
output poisoned with NaN before the call), then the median time of each (L2 flushed). Per row: TFLOP/s, TB/s of
the bytes that must move (tokens, the weights of the experts that got tokens, the output), the fraction of the
max(compute, memory) floor reached (bf16 dense ceiling 790 TFLOP/s, copy ceiling 4.3 TB/s, both measured on the
H200: ../shared/docs/anchors.md), and ratios to the peers. Cases (``CASES``): the forward (2-D tokens x 3-D
weights with offsets, F.linear-style [E, N, K] weights passed as w.mT), the fused gate/up SiLU projection (nvfly's
one kernel vs the peer's grouped mm then silu * mul), the masked layout (vs torch._grouped_mm 3-D x 3-D over the
whole capacity) and the weight gradient (2-D x 2-D grouped along K). Group sizes are whole rows (multiples of 8
for the weight gradient, where torch's kernel asserts on the device otherwise), not multiples of the tile.

Usage: python -m benchmarks.grouped [--quick] [--no-triton] [--triton-cases N] [--name grouped]. --quick: the
anchor rows (under 3 minutes on the H200, Inductor on the first case only). Writes
benchmarks/results/<name>_h200.json and .png.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_ms, geomean, plot, progress, rel_err, write_results  # noqa: E402
from nvfly.ops import grouped  # noqa: E402

PEAK_TFLOPS = 790.0   # bf16 dense matmul ceiling measured on the H200
PEAK_TBPS = 4.3       # device copy ceiling measured on the H200


@dataclass(frozen=True)
class Case:
    """One row: ``kind`` "forward", "gate_up" (N = 2I weights, I outputs), "masked" or "wgrad"; E experts, weights
    N x K, ``rows`` routed rows in all (tokens x top-k), ``routing`` "uniform", "zipf" (alpha 1.2) or "hot" (one
    expert takes 25%)."""
    name: str
    kind: str
    experts: int
    n: int
    k: int
    rows: int
    routing: str = "uniform"


QUICK = [
    Case("anchor E64 T15952", "forward", 64, 2048, 7168, 15952),
    Case("Qwen3 decode 8/expert", "forward", 128, 1536, 2048, 128 * 8),
    Case("Qwen3 256/expert", "forward", 128, 1536, 2048, 128 * 256),
    Case("DSv3 decode 4/expert", "forward", 256, 4096, 7168, 256 * 4),
    Case("DSv3 128/expert", "forward", 256, 4096, 7168, 256 * 128),
    Case("Mixtral 1024/expert", "forward", 8, 14336, 4096, 8 * 1024),
    Case("Qwen3 T4096 zipf", "forward", 128, 2048, 768, 4096 * 8, "zipf"),
    Case("Mixtral T4096 hot", "forward", 8, 28672, 4096, 4096 * 2, "hot"),
    Case("Qwen3 gate/up T512", "gate_up", 128, 1536, 2048, 512 * 8),
    Case("Qwen3 gate/up T4096", "gate_up", 128, 1536, 2048, 4096 * 8),
    Case("DSv3 masked decode", "masked", 256, 4096, 7168, 256 * 4),
    Case("Qwen3 wgrad T4096", "wgrad", 128, 768, 2048, 4096 * 8),
]
# the anchors' grouped suite: DeepSeek-V3 E256 top-8, Qwen3-30B-A3B E128 top-8, Mixtral E8 top-2, tokens x routing
MODELS = [("DSv3", 256, 8, [(4096, 7168), (7168, 2048)]), ("Qwen3", 128, 8, [(1536, 2048), (2048, 768)]),
          ("Mixtral", 8, 2, [(28672, 4096), (4096, 14336)])]
FULL = QUICK + [Case(f"{model} N{n} K{k} T{tokens} {routing}", "forward", e, n, k, tokens * top, routing)
                for model, e, top, shapes in MODELS for n, k in shapes for tokens in (64, 512, 4096, 16384)
                for routing in ("uniform", "zipf", "hot")]


def group_sizes(case: Case) -> list[int]:
    """Rows per expert for the case's routing summing to ``case.rows``: whole rows for the forward (its ragged dim,
    the tokens, is not a contiguous one), multiples of 8 where torch's kernel needs 16-byte groups (the weight
    gradient's ragged K); the remainder goes to the largest fractional shares."""
    e = case.experts
    align = 8 if case.kind == "wgrad" else 1
    if case.routing == "uniform":
        weights = torch.ones(e, dtype=torch.float64)
    elif case.routing == "zipf":
        weights = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 1.2
    else:
        weights = torch.full((e,), 0.75 / (e - 1), dtype=torch.float64)
        weights[0] = 0.25
    shares = weights / weights.sum() * (case.rows // align)
    units = shares.floor().long()
    left = case.rows // align - int(units.sum())
    units[(shares - units).argsort(descending=True, stable=True)[:left]] += 1
    return (units * align).tolist()


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()


def inductor_grouped_mm():
    """torch._grouped_mm compiled by Inductor max-autotune with only Triton templates as candidates."""
    import torch._inductor.config as cfg
    cfg.max_autotune_gemm_backends = "TRITON"

    def fn(a, b, offs):
        return torch._grouped_mm(a, b, offs)
    return torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)


def setup(case: Case):
    """(implementations by name, reference fn, flop, bytes) of a case; each implementation returns its output."""
    sizes = group_sizes(case)
    total = sum(sizes)
    e, n, k = case.experts, case.n, case.k
    active = sum(1 for s in sizes if s)
    bf16 = torch.bfloat16
    if case.kind in ("forward", "gate_up"):
        a = torch.randn(total, k, device="cuda").to(bf16)
        w = (torch.randn(e, n, k, device="cuda") / math.sqrt(k)).to(bf16)  # F.linear style [E, N, K]
        b = w.mT
        offs = offsets(sizes)
        out_n = n // 2 if case.kind == "gate_up" else n
        out = torch.full((total, out_n), float("nan"), device="cuda", dtype=bf16)
        fuse = "silu_mul" if case.kind == "gate_up" else "none"

        def torch_fn(mm=torch._grouped_mm):
            y = mm(a, b, offs)
            return torch.nn.functional.silu(y[:, :n // 2]) * y[:, n // 2:] if fuse == "silu_mul" else y
        impls = {"nvfly": lambda: grouped.grouped_mm(a, b, offs, out=out, fuse=fuse), "torch": torch_fn}
        flop = 2.0 * total * n * k
        nbytes = 2.0 * (total * k + active * n * k + total * out_n)
        return impls, lambda: grouped.reference(a, b, offs, fuse=fuse), flop, nbytes, (a, b, offs, fuse)
    if case.kind == "masked":
        capacity = 8 * math.ceil(2 * case.rows / e / 8)  # a fixed capacity of twice the expected rows
        counts = torch.tensor([min(s, capacity) for s in sizes], dtype=torch.int32).cuda()
        a = torch.randn(e, capacity, k, device="cuda").to(bf16)
        b = (torch.randn(e, n, k, device="cuda") / math.sqrt(k)).to(bf16).mT
        out = torch.full((e, capacity, n), float("nan"), device="cuda", dtype=bf16)
        impls = {"nvfly": lambda: grouped.grouped_mm_masked(a, b, counts, out=out, expected_rows=case.rows / e),
                 "torch": lambda: torch._grouped_mm(a, b)}
        flop = 2.0 * int(counts.sum()) * n * k
        nbytes = 2.0 * (int(counts.sum()) * (k + n) + active * n * k)
        return impls, lambda: grouped.reference(a, b, counts, masked=True), flop, nbytes, None
    # wgrad: dW_g = x_g^T dy_g, a = x^T [K, T] (M-contiguous), b = dy [T, N]
    x = torch.randn(total, k, device="cuda").to(bf16)
    dy = torch.randn(total, n, device="cuda").to(bf16)
    a, b = x.mT, dy
    offs = offsets(sizes)
    out = torch.full((e, k, n), float("nan"), device="cuda", dtype=bf16)
    impls = {"nvfly": lambda: grouped.grouped_mm(a, b, offs, out=out), "torch": lambda: torch._grouped_mm(a, b, offs)}
    flop = 2.0 * total * n * k
    nbytes = 2.0 * (total * (k + n) + e * k * n)
    return impls, lambda: grouped.reference(a, b, offs), flop, nbytes, (a, b, offs, "none")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="the anchor rows only (under 3 minutes)")
    p.add_argument("--no-triton", action="store_true", help="leave out Inductor max-autotune's grouped mm")
    p.add_argument("--triton-cases", type=int, default=None,
                   help="time Inductor on the first N forward cases (default: 1 with --quick, all forward cases)")
    p.add_argument("--name", default="grouped", help="results file stem: benchmarks/results/<name>_h200.json")
    args = p.parse_args(argv)
    cases = QUICK if args.quick else FULL
    triton_cases = args.triton_cases if args.triton_cases is not None else (1 if args.quick else len(cases))
    rows = []
    t_start = time.time()
    forward_seen = 0
    for case in progress(cases, "grouped"):
        impls, reference, flop, nbytes, peer_args = setup(case)
        ref = reference()
        owned = ~ref.isnan()
        row = {"case": case.name, "kind": case.kind, "E": case.experts, "N": case.n, "K": case.k, "rows": case.rows,
               "routing": case.routing, "dtype": "bf16"}
        if case.kind != "wgrad" and peer_args is not None:
            a, b, offs, fuse = peer_args
            row["nvfly_plan"] = grouped.describe("contiguous", case.experts, a.shape[0],
                                                 case.n // 2 if fuse != "none" else case.n, case.k, fuse=fuse,
                                                 b_major="K")
        use_inductor = (not args.no_triton and case.kind == "forward" and forward_seen < triton_cases
                        and hasattr(torch, "_grouped_mm"))
        if case.kind == "forward":
            forward_seen += 1
        if use_inductor:
            compiled = inductor_grouped_mm()
            a, b, offs, _ = peer_args
            impls["inductor"] = lambda: compiled(a, b, offs)
        for name, fn in impls.items():
            out = fn()
            torch.cuda.synchronize()
            # the owned rows (torch's masked peer computes the whole capacity)
            row[f"{name}_rel_err"] = rel_err(out.float()[owned], ref[owned])
        del ref, owned
        for name, fn in impls.items():
            ms = bench_ms(fn)
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = flop / ms / 1e9
            row[f"{name}_tbps"] = nbytes / ms / 1e9
        floor_ms = max(flop / (PEAK_TFLOPS * 1e9), nbytes / (PEAK_TBPS * 1e9))
        row["floor_ms"] = floor_ms
        row["bound"] = "compute" if flop / (PEAK_TFLOPS * 1e9) >= nbytes / (PEAK_TBPS * 1e9) else "memory"
        for name in impls:
            row[f"{name}_of_floor"] = floor_ms / row[f"{name}_ms"]
        row["vs_torch"] = row["torch_ms"] / row["nvfly_ms"]
        if "inductor_ms" in row:
            row["vs_inductor"] = row["inductor_ms"] / row["nvfly_ms"]
        rows.append(row)
        print(f"{case.name:<28} {case.kind:<8} nvfly {row['nvfly_tflops']:6.1f} TF {row['nvfly_tbps']:5.2f} TB/s "
              f"({row['nvfly_of_floor']:.0%} of the {row['bound']} floor, err {row['nvfly_rel_err']:.1e})  "
              f"torch {row['torch_tflops']:6.1f} TF  x{row['vs_torch']:.2f}"
              + (f"  inductor {row['inductor_tflops']:6.1f} TF x{row['vs_inductor']:.2f}" if "vs_inductor" in row
                 else ""), flush=True)
        del impls, reference, peer_args, out
        torch.cuda.empty_cache()
    summary = {"geomean_vs_torch": geomean([r["vs_torch"] for r in rows]),
               "min_vs_torch": min(r["vs_torch"] for r in rows),
               "geomean_vs_inductor": geomean([r["vs_inductor"] for r in rows if "vs_inductor" in r]),
               "geomean_of_floor": geomean([r["nvfly_of_floor"] for r in rows]),
               "max_rel_err": max(r["nvfly_rel_err"] for r in rows), "rows": len(rows),
               "seconds": time.time() - t_start}
    print(summary)
    path = write_results(args.name, rows, {"summary": summary, "peak_tflops": PEAK_TFLOPS, "peak_tbps": PEAK_TBPS})
    series = {"nvfly": [r["nvfly_of_floor"] for r in rows], "torch._grouped_mm": [r["torch_of_floor"] for r in rows]}
    if any("inductor_of_floor" in r for r in rows):
        series["Inductor (Triton)"] = [r.get("inductor_of_floor", 0.0) for r in rows]
    plot(args.name, [r["case"] for r in rows], series, "fraction of the max(compute, memory) floor")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
