"""Grouped GEMM (MoE experts): nvfly vs torch._grouped_mm (CUTLASS) vs Inductor max-autotune's grouped mm (Triton
templates), in one process.

Correctness first: each implementation's output against a float32 per-group reference (relative error over the
elements the reference owns, nvfly's output poisoned with NaN before the call), then the median time of each (L2
flushed). Per row: TFLOP/s, TB/s of the bytes that must move (tokens, the weights of the experts that got tokens,
the output), the fraction of the max(compute, memory) floor reached (bf16 dense ceiling 790 TFLOP/s, copy ceiling
4.3 TB/s, both measured on the H200: ../shared/docs/anchors.md), and ratios to the peers (vs_torch, vs_triton).
Rows carry issue #29's keys: the shape (``experts``, ``tokens`` before the top-k fan-out, ``top_k``, ``rows`` routed
in all (the TFLOP/s are of these), ``n``, ``k`` (the experts' weights N x K, the forward's output and reduction
sizes, whatever the pass), ``routing``, ``layout`` "contiguous" / "masked", ``pass`` "forward" / "gate_up" / "dgrad" /
"wgrad"), ``nvfly_ms``, ``nvfly_tflops``, ``torch_ms`` (torch._grouped_mm) and ``triton_ms`` (Inductor max-autotune's
Triton grouped mm, with ``triton_compile_s`` on the row that compiled the shape or ``triton_left_out`` saying why
not). Passes (``Case``): the forward (2-D tokens x 3-D weights with offsets, F.linear-style [E, N, K] weights passed
as w.mT), the fused gate/up SiLU projection (nvfly's one kernel vs the peer's grouped mm then silu * mul), the
input gradient (dy [rows, N] x the same weights [E, N, K], N-contiguous: the forward's shape with N and K swapped),
the weight gradient (2-D x 2-D grouped along K), and the masked layout of the forward (vs torch._grouped_mm 3-D x 3-D
over the whole capacity, twice the expected rows). Group sizes are whole rows (multiples of 8 for the weight
gradient, where torch's kernel asserts on the device otherwise), not multiples of the tile.

The full suite (``FULL``, the default; ``--full``): the anchors' grouped suite, DeepSeek-V3 E256 top-8, Qwen3-30B-A3B
E128 top-8 and Mixtral E8 top-2, both expert weights each (gate/up w13, down) x tokens 64, 512, 4096, 16384 x
uniform, Zipf 1.2 and one-hot (25%) routing x the forward contiguous and masked, the input and weight gradients and
(w13) the fused gate/up: 324 rows (uniform groups are 128-aligned at 4096 and 16384 tokens, Zipf and one-hot ragged).
Inductor's grouped mm on the contiguous forward rows, one compile a shape (24) serving its three routings, as many
shapes as ``--budget-s`` allows (~23 s a compile), the 4096-token ones of every model first. ``--tokens`` and
``--passes`` pick a part of it (e.g. ``--passes forward --tokens 64,16384,512``: Inductor on the shapes the default
budget leaves out).

MoE-layer rows (``--moe``, ``MOE_CASES``): a whole MoE layer (router softmax/top-k, token permutation, gate/up
grouped GEMM with SiLU * mul, down grouped GEMM, weighted un-permutation) timed in one process as (a) the eager
layer a user writes on ``torch._grouped_mm`` (``torch_moe``, modelled on torchtitan's ``_run_experts_grouped_mm``
with a fused w13), (b) nvfly eagerly: the same code under ``nvfly.torch.routing()`` ("nvfly_route": a block per
call; "nvfly_route_held": one block around all the calls, forward only),
``nvfly.ops.moe.moe`` ("nvfly_moe", forward only), the layer on nvfly's kernels throughout, forward and backward
(the router and shuffles as ``torch.ops.nvfly.moe_*``, differentiable and traceable, and
``torch.ops.nvfly.grouped_mm``) with the fused gate/up ("nvfly_ops", ``nvfly_moe``) and without it
("nvfly_ops_unfused": autograd saves the gate/up activations instead of recomputing them), (c) ``torch.compile`` (default mode) of (a) and (d) of the nvfly-ops layer (fused for the
forward rows, unfused for forward+backward: ``compiled_nvfly_layer``). Outputs are checked against the float32
layer (``nvfly.ops.moe.reference``) and, forward+backward, every gradient against the eager layer's; nvfly_ms is
the fastest nvfly eager version (named in ``nvfly_version``).

Weight-gradient variants (``--wgrad-variants``): the K-grouped weight gradient on each of the kernel's K-grouped
tiles (``plan.kgrouped_variants``) next to torch._grouped_mm, correctness first.

Forward variants (``--variants``, ``VARIANT_CASES``): the compute-bound forward rows (the E64 T15952 anchor, Qwen3
256/expert, Mixtral 1024/expert and Mixtral hot), or with ``--tokens``, ``--models`` or ``--routings`` the full
suite's contiguous forward rows (e.g. ``--tokens 512,16384 --routings hot``: the one-hot rows), on each of the
forward's candidate tiles (``plan.forward_variants``: the heuristic's "current", the TMA-store epilogue, 2-block
clusters along M multicasting B or along N multicasting A, each with and without the TMA store, 256 x 128, 128 x 128
and ping-pong 128 x 128 with the TMA store) next to torch._grouped_mm and Inductor max-autotune's Triton grouped mm: every
output against the float32 reference first (poisoned with NaN), then the times interleaved over rounds (each
round times every implementation once, so that clock drift lands on all alike; the median round is kept).

FP8 rows (``--fp8``, ``FP8_QUICK``/``FP8_FULL``): DeepSeek-V3's experts (E256 top-8) at 4096 tokens and decode
batches, contiguous and masked, on ``nvfly.ops.scaled.scaled_grouped_mm``: its block path (1x128 x 128x128, the
heuristic's tile, which issues ahead at 128 rows, the serial one and ``FP8_BLOCK_VARIANTS``: staged activation
scales, the TMA-store epilogue, 192- and 160-wide tiles, clusters multicasting A) and its row-wise path next to
torch._scaled_grouped_mm (row-wise, what torch runs on sm90) and the bf16 grouped GEMMs (nvfly's and torch._grouped_mm) of the same routing; errors against
float32 references first.

Usage: python -m benchmarks.grouped [--quick | --full] [--tokens T,..] [--passes P,..] [--moe] [--moe-layers NAME]
[--no-compile] [--moe-profile CALLS] [--wgrad-variants] [--variants] [--fp8] [--no-triton] [--triton-cases N]
[--budget-s S] [--name grouped]. Without --quick: the full suite (about 7.5 minutes on the H200 with the default
--budget-s 440: ~0.7 s a row, ~40 s of nvfly compiles, ~23 s an Inductor compile of a shape: its 40 to 54 Triton
configs compiled and timed; the rows so far are written every 25 rows). --quick: the anchor rows (25 s on the H200,
Inductor on the first case only; 185 s with --triton-cases 8). --variants: the forward variants alone (a few
minutes: Inductor's autotuning of the four rows is most of it; --no-triton leaves it out). --fp8 --quick: the five
FP8 anchor rows (a few minutes: the 4096-token rows compile and time the FP8_BLOCK_VARIANTS too). --moe alone: the
MoE-layer rows only; with --quick or --full: both. Writes benchmarks/results/<name>_h200.json and .png (default
name: grouped, grouped_moe, grouped_wgrad, grouped_variants or grouped_fp8).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_ms, geomean, interleaved_ms, plot, progress, rel_err, time_impls, \
    write_results  # noqa: E402
from nvfly.ops import grouped  # noqa: E402

PEAK_TFLOPS = 790.0   # bf16 dense matmul ceiling measured on the H200
PEAK_TBPS = 4.3       # device copy ceiling measured on the H200


@dataclass(frozen=True)
class Case:
    """One row: the layer's GEMM ``gemm_pass`` ("forward"; "gate_up": the forward of the gate/up weights, N = 2I,
    I outputs, SiLU * mul fused; "dgrad": the input gradient dy [rows, N] x W [E, N, K], the forward's shape with
    N and K swapped and the weights N-contiguous; "wgrad": the weight gradient x^T dy, grouped along K) in the
    ``layout`` "contiguous" (tokens sorted by expert, ragged offsets) or "masked" (a fixed capacity per expert, the
    forward only); E experts of weights N x K (``n``, ``k``: the forward's output and reduction sizes whatever the
    pass), ``rows`` routed rows in all (tokens x top-k; ``top_k`` None where the case does not know its tokens),
    ``routing`` "uniform", "zipf" (alpha 1.2), "hot" (one expert takes 25%) or "topk<k>" (each of rows / k tokens
    picks k distinct experts at random, seed 0: a real router's ragged counts, ~mean +- sqrt(mean) rows an expert)."""
    name: str
    gemm_pass: str
    experts: int
    n: int
    k: int
    rows: int
    routing: str = "uniform"
    top_k: Optional[int] = None
    layout: str = "contiguous"

    @property
    def tokens(self) -> Optional[int]:
        """Tokens before the top-k fan-out, where the case knows its top-k."""
        return self.rows // self.top_k if self.top_k else None

    def row_keys(self) -> dict:
        """The row's shape keys (issue #29's names, and the routed rows the TFLOP/s are of)."""
        return {"case": self.name, "experts": self.experts, "tokens": self.tokens, "top_k": self.top_k,
                "rows": self.rows, "n": self.n, "k": self.k, "routing": self.routing, "layout": self.layout,
                "pass": self.gemm_pass}


PASSES = ("forward", "gate_up", "dgrad", "wgrad")
QUICK = [
    Case("anchor E64 T15952", "forward", 64, 2048, 7168, 15952),
    Case("Qwen3 decode 8/expert", "forward", 128, 1536, 2048, 128 * 8, top_k=8),
    Case("Qwen3 256/expert", "forward", 128, 1536, 2048, 128 * 256, top_k=8),
    Case("DSv3 decode 4/expert", "forward", 256, 4096, 7168, 256 * 4, top_k=8),
    Case("DSv3 128/expert", "forward", 256, 4096, 7168, 256 * 128, top_k=8),
    Case("Mixtral 1024/expert", "forward", 8, 14336, 4096, 8 * 1024, top_k=2),
    Case("Qwen3 T4096 zipf", "forward", 128, 2048, 768, 4096 * 8, "zipf", 8),
    Case("Mixtral T4096 hot", "forward", 8, 28672, 4096, 4096 * 2, "hot", 2),
    Case("Qwen3 gate/up T512", "gate_up", 128, 1536, 2048, 512 * 8, top_k=8),
    Case("Qwen3 gate/up T4096", "gate_up", 128, 1536, 2048, 4096 * 8, top_k=8),
    Case("DSv3 masked decode", "forward", 256, 4096, 7168, 256 * 4, top_k=8, layout="masked"),
    Case("Qwen3 wgrad T4096", "wgrad", 128, 768, 2048, 4096 * 8, top_k=8),
]
# the anchors' grouped suite (../shared/docs/anchors.md): DeepSeek-V3 E256 top-8, Qwen3-30B-A3B E128 top-8, Mixtral
# E8 top-2, each (N, K) of its experts (gate/up w13 first, then down) x tokens x routing, every pass of the layer:
# the forward contiguous and masked, the fused gate/up (w13 only), the input and the weight gradients. A shape's
# rows (routings, passes) run together: Inductor compiles a shape once for its three routings (its autotuning runs
# on even synthetic offsets, whatever the routing). The token counts in FULL_TOKENS' order: the compiles the
# budget allows (--budget-s) go to the prefill shapes of every model first, then decode, 16K and 512.
MODELS = [("DSv3", 256, 8, [(4096, 7168), (7168, 2048)]), ("Qwen3", 128, 8, [(1536, 2048), (2048, 768)]),
          ("Mixtral", 8, 2, [(28672, 4096), (4096, 14336)])]
MODEL_NAMES = tuple(model for model, *_ in MODELS)
FULL_TOKENS = (4096, 64, 16384, 512)
ROUTINGS = ("uniform", "zipf", "hot")
FULL_PASSES = [("forward", "contiguous"), ("gate_up", "contiguous"), ("forward", "masked"), ("dgrad", "contiguous"),
               ("wgrad", "contiguous")]


def full_cases(tokens_of: Sequence[int] = FULL_TOKENS, passes: Sequence[str] = PASSES,
               models: Optional[Sequence[str]] = None, routings: Sequence[str] = ROUTINGS) -> list[Case]:
    """The full suite (``FULL``), or its rows of the given token counts, passes, models (default: all) and
    routings."""
    cases = []
    for tokens in tokens_of:
        for model, e, top, shapes in MODELS:
            if models is not None and model not in models:
                continue
            for index, (n, k) in enumerate(shapes):
                for routing in ROUTINGS:
                    if routing not in routings:
                        continue
                    for gemm_pass, layout in FULL_PASSES:
                        if gemm_pass not in passes or (gemm_pass == "gate_up" and index):  # gate/up: w13 only
                            continue
                        label = "masked" if layout == "masked" else gemm_pass
                        cases.append(Case(f"{model} N{n} K{k} T{tokens} {routing} {label}", gemm_pass, e, n, k,
                                          tokens * top, routing, top, layout))
    return cases


FULL = full_cases()


def group_sizes(case: Case) -> list[int]:
    """Rows per expert for the case's routing summing to ``case.rows``: whole rows where the ragged dim is the
    tokens (not a contiguous one), multiples of 8 where torch's kernel needs 16-byte groups (the weight gradient's
    ragged K); the remainder goes to the largest fractional shares."""
    e = case.experts
    align = 8 if case.gemm_pass == "wgrad" else 1
    if case.routing.startswith("topk"):
        top = int(case.routing[len("topk"):])
        picks = torch.rand(case.rows // top, e, generator=torch.Generator().manual_seed(0)).topk(top, dim=1).indices
        return torch.bincount(picks.flatten(), minlength=e).tolist()
    if case.routing == "uniform":
        weights = torch.ones(e, dtype=torch.float64)
    elif case.routing == "zipf":
        weights = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 1.2
    elif case.routing == "hot":
        weights = torch.full((e,), 0.75 / (e - 1), dtype=torch.float64)
        weights[0] = 0.25
    else:
        raise ValueError(f"case.routing: {case.routing!r} is not uniform, zipf, hot or topk<k>")
    shares = weights / weights.sum() * (case.rows // align)
    units = shares.floor().long()
    left = case.rows // align - int(units.sum())
    units[(shares - units).argsort(descending=True, stable=True)[:left]] += 1
    return (units * align).tolist()


def masked_capacity(case: Case) -> int:
    """The masked layout's rows an expert: a fixed capacity of twice the expected rows (a multiple of 8)."""
    return 8 * math.ceil(2 * case.rows / case.experts / 8)


def offsets(sizes: list[int], device: str = "cuda") -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def inductor_grouped_mm():
    """torch._grouped_mm compiled by Inductor max-autotune with only Triton templates as candidates, afresh (dynamo's
    caches reset: each shape compiles once on the same code object, and past torch._dynamo.config.recompile_limit
    dynamo would fall back to eager torch._grouped_mm without a word)."""
    import torch._inductor.config as cfg
    cfg.max_autotune_gemm_backends = "TRITON"
    torch._dynamo.reset()

    def fn(a, b, offs):
        return torch._grouped_mm(a, b, offs)
    return torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)


@dataclass
class Setup:
    """A case on the device: ``impls`` by name (each returns its output), the float32 ``reference``, the flop and the
    bytes that must move, nvfly's ``operands`` (a, b, offs; masked: the counts for offs) and ``plan``, what nvfly
    runs (``grouped.describe``)."""
    impls: dict
    reference: Callable[[], torch.Tensor]
    flop: float
    nbytes: float
    operands: Optional[tuple]
    plan: str


def setup(case: Case, device: str = "cuda") -> Setup:
    """The case's operands, implementations and reference on ``device`` (nvfly's outputs poisoned with NaN; nvfly
    runs on CUDA only, the rest anywhere torch._grouped_mm does)."""
    sizes = group_sizes(case)
    total = sum(sizes)
    e, n, k = case.experts, case.n, case.k
    active = sum(1 for s in sizes if s)
    bf16 = torch.bfloat16
    if case.layout == "masked":
        if case.gemm_pass != "forward":
            raise ValueError(f"case.gemm_pass: the masked layout is the forward's, got {case.gemm_pass!r}")
        capacity = masked_capacity(case)
        counts = torch.tensor([min(s, capacity) for s in sizes], dtype=torch.int32, device=device)
        a = torch.randn(e, capacity, k, device=device).to(bf16)
        b = (torch.randn(e, n, k, device=device) / math.sqrt(k)).to(bf16).mT
        out = torch.full((e, capacity, n), float("nan"), device=device, dtype=bf16)
        impls = {"nvfly": lambda: grouped.grouped_mm_masked(a, b, counts, out=out, expected_rows=case.rows / e),
                 "torch": lambda: torch._grouped_mm(a, b)}
        routed = int(counts.sum())
        return Setup(impls, lambda: grouped.reference(a, b, counts, masked=True), 2.0 * routed * n * k,
                     2.0 * (routed * (k + n) + active * n * k), (a, b, counts),
                     grouped.describe("masked", e, capacity, n, k, b_major="K", rows_per_group=case.rows / e))
    if case.layout != "contiguous":
        raise ValueError(f"case.layout: {case.layout!r} is not contiguous or masked")
    offs = offsets(sizes, device)
    flop = 2.0 * total * n * k
    if case.gemm_pass in ("forward", "gate_up"):
        a = torch.randn(total, k, device=device).to(bf16)
        w = (torch.randn(e, n, k, device=device) / math.sqrt(k)).to(bf16)  # F.linear style [E, N, K]
        b = w.mT
        fuse = "silu_mul" if case.gemm_pass == "gate_up" else "none"
        out_n = n // 2 if fuse == "silu_mul" else n
        out = torch.full((total, out_n), float("nan"), device=device, dtype=bf16)

        def torch_fn():
            y = torch._grouped_mm(a, b, offs)
            return torch.nn.functional.silu(y[:, :n // 2]) * y[:, n // 2:] if fuse == "silu_mul" else y
        impls = {"nvfly": lambda: grouped.grouped_mm(a, b, offs, out=out, fuse=fuse), "torch": torch_fn}
        return Setup(impls, lambda: grouped.reference(a, b, offs, fuse=fuse), flop,
                     2.0 * (total * k + active * n * k + total * out_n), (a, b, offs),
                     grouped.describe("contiguous", e, total, out_n, k, fuse=fuse, b_major="K"))
    if case.gemm_pass == "dgrad":
        # dx = dy W: dy [T, N] x the forward's weights [E, N, K] as they are (N-contiguous for this product)
        dy = torch.randn(total, n, device=device).to(bf16)
        w = (torch.randn(e, n, k, device=device) / math.sqrt(n)).to(bf16)
        out = torch.full((total, k), float("nan"), device=device, dtype=bf16)
        impls = {"nvfly": lambda: grouped.grouped_mm(dy, w, offs, out=out),
                 "torch": lambda: torch._grouped_mm(dy, w, offs)}
        return Setup(impls, lambda: grouped.reference(dy, w, offs), flop,
                     2.0 * (total * n + active * n * k + total * k), (dy, w, offs),
                     grouped.describe("contiguous", e, total, k, n, b_major="MN"))
    if case.gemm_pass != "wgrad":
        raise ValueError(f"case.gemm_pass: {case.gemm_pass!r} is not one of {PASSES}")
    # wgrad: dW_g = x_g^T dy_g, a = x^T [K, T] (M-contiguous), b = dy [T, N]
    x = torch.randn(total, k, device=device).to(bf16)
    dy = torch.randn(total, n, device=device).to(bf16)
    a, b = x.mT, dy
    out = torch.full((e, k, n), float("nan"), device=device, dtype=bf16)
    impls = {"nvfly": lambda: grouped.grouped_mm(a, b, offs, out=out), "torch": lambda: torch._grouped_mm(a, b, offs)}
    return Setup(impls, lambda: grouped.reference(a, b, offs), flop, 2.0 * (total * (k + n) + e * k * n), (a, b, offs),
                 grouped.describe("kgrouped", e, k, n, total))


# ---------------------------------------------------------------------------------------------- weight gradient
WGRAD_CASES = [Case("Qwen3 wgrad T4096", "wgrad", 128, 768, 2048, 4096 * 8, top_k=8),
               Case("Qwen3 wgrad T4096 zipf", "wgrad", 128, 768, 2048, 4096 * 8, "zipf", 8),
               Case("Qwen3 gate/up wgrad T4096", "wgrad", 128, 1536, 2048, 4096 * 8, top_k=8),
               Case("DSv3 down wgrad T4096", "wgrad", 256, 7168, 2048, 4096 * 8, top_k=8)]


def wgrad_variants(cases: Sequence[Case], device: str = "cuda") -> list[dict]:
    """Each case (WGRAD_CASES, or the full suite's weight-gradient rows picked by --tokens, --models and
    --routings) on every K-grouped tile and on torch._grouped_mm: errors first (a variant off the reference is not
    timed), then times interleaved over VARIANT_ROUNDS rounds (the median round), with the TB/s of the bytes that
    must move (at few tokens an expert: the output's). ``device``: CUDA (nvfly's), or another for tests."""
    from nvfly.ops.grouped.plan import kgrouped_variants
    rows = []
    for case in progress(cases, "grouped wgrad"):
        s = setup(case, device)
        (a, b, offs), flop = s.operands, s.flop
        impls = {"torch": s.impls["torch"]}
        variants = kgrouped_variants(case.experts)
        # one output for every variant (DeepSeek-V3's is 15 GB), poisoned before each variant's checked call
        out = torch.empty((case.experts, case.k, case.n), device=device, dtype=torch.bfloat16)
        for name, config in variants.items():
            impls[name] = lambda config=config: grouped.grouped_mm(a, b, offs, out=out, config=config)
        ref = s.reference()
        row = {**case.row_keys(), "heuristic": s.plan, "variants": {n: describe_config(c) for n, c in variants.items()}}
        for name, fn in impls.items():
            out.fill_(float("nan"))
            row[f"{name}_rel_err"] = chunked_rel_err(fn(), ref)
        del ref
        timed = {name: fn for name, fn in impls.items() if row[f"{name}_rel_err"] < 2e-2}
        for name, runs in interleaved_ms(timed, VARIANT_ROUNDS).items():
            ms = sorted(runs)[len(runs) // 2]
            row[f"{name}_ms"], row[f"{name}_ms_runs"] = ms, runs
            row[f"{name}_tflops"] = flop / ms / 1e9
            row[f"{name}_tbps"] = s.nbytes / ms / 1e9
            if name != "torch" and "torch_ms" in row:
                row[f"{name}_vs_torch"] = row["torch_ms"] / ms
        rows.append(row)
        print(f"{case.name:<28} torch {row.get('torch_tbps', 0):4.2f} TB/s  " + "  ".join(
            f"{name} {row.get(name + '_tbps', 0):4.2f} TB/s x{row.get(name + '_vs_torch', 0):.2f} "
            f"(err {row[name + '_rel_err']:.1e})" for name in variants), flush=True)
        del impls, s, a, b, offs, out
        torch.cuda.empty_cache()
    return rows


VARIANT_CASES = [case for case in QUICK if case.name in ("anchor E64 T15952", "Qwen3 256/expert", "Mixtral 1024/expert",
                                                          "Mixtral T4096 hot")]
VARIANT_ROUNDS = 3


def forward_variant_rows(cases: Sequence[Case], triton_cases: int) -> list[dict]:
    """Each case (VARIANT_CASES, or the full suite's contiguous forward rows picked by --tokens, --models and
    --routings) on every forward variant, torch._grouped_mm and (the first ``triton_cases`` rows) Inductor's Triton
    grouped mm: errors first (a variant off the reference is not timed), then interleaved times."""
    from nvfly.ops.grouped.api import plan_of
    from nvfly.ops.grouped.plan import forward_variants
    rows = []
    for index, case in enumerate(progress(cases, "grouped variants")):
        s = setup(case)
        (a, b, offs), flop, reference = s.operands, s.flop, s.reference
        shape = (a.shape[0], case.n)
        default = plan_of("contiguous", a, b, shape, case.experts, "none", None)
        variants = forward_variants(default.config, case.experts, "contiguous", default.b_major)
        impls = {"torch": s.impls["torch"]}
        if index < triton_cases and hasattr(torch, "_grouped_mm"):
            compiled = inductor_grouped_mm()
            impls["triton"] = lambda compiled=compiled: compiled(a, b, offs)
        outs = {}
        for name, config in variants.items():
            outs[name] = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
            impls[name] = lambda config=config, out=outs[name]: grouped.grouped_mm(a, b, offs, out=out, config=config)
        row = {**case.row_keys(), "variants": {name: describe_config(c) for name, c in variants.items()}}
        ref = reference()
        owned = ~ref.isnan()
        for name, fn in impls.items():
            row[f"{name}_rel_err"] = rel_err(fn().float()[owned], ref[owned])
        del ref, owned
        timed = {name: fn for name, fn in impls.items() if row[f"{name}_rel_err"] < 2e-2}
        times = interleaved_ms(timed, VARIANT_ROUNDS)
        for name, runs in times.items():
            ms = sorted(runs)[len(runs) // 2]
            row[f"{name}_ms"], row[f"{name}_ms_runs"] = ms, runs
            row[f"{name}_tflops"] = flop / ms / 1e9
        for name in variants:
            if f"{name}_ms" not in row:
                continue
            for peer in ("torch", "triton", "current"):
                if f"{peer}_ms" in row and peer != name:
                    row[f"{name}_vs_{peer}"] = row[f"{peer}_ms"] / row[f"{name}_ms"]
        rows.append(row)
        print(f"{case.name:<22} torch {row.get('torch_tflops', 0):6.1f} TF"
              + (f"  triton {row['triton_tflops']:6.1f} TF" if "triton_tflops" in row else "") + "  " + "  ".join(
                  f"{name} {row.get(name + '_tflops', 0):6.1f} TF x{row.get(name + '_vs_torch', 0):.2f} "
                  f"(err {row[name + '_rel_err']:.1e})" for name in variants), flush=True)
        del impls, outs, s, a, b, offs, reference
        torch.cuda.empty_cache()
    return rows


def describe_config(cfg) -> str:
    clusters = f", {cfg.cluster_m}-block clusters" if cfg.cluster_m > 1 else ""
    staged = (f" ({cfg.store_slices * cfg.store_tiles} slice buffers over {cfg.store_tiles} tiles)"
              if cfg.tma_store and cfg.store_slices * cfg.store_tiles > 1 else "")
    return (f"{cfg.bm}x{cfg.bn} {'ping-pong' if cfg.pingpong else 'cooperative'}, {cfg.stages} stages"
            f"{', TMA store' + staged if cfg.tma_store else ''}{clusters}")


def variant_summary(rows: list[dict]) -> dict:
    """Per variant: geomeans against torch, Inductor and the current plan, and the worst row against torch."""
    names = list(rows[0]["variants"])
    summary = {}
    for name in names:
        for peer in ("torch", "triton", "current"):
            values = [r[f"{name}_vs_{peer}"] for r in rows if f"{name}_vs_{peer}" in r]
            if values:
                summary[f"geomean_{name}_vs_{peer}"] = geomean(values)
        summary[f"min_{name}_vs_torch"] = min((r.get(f"{name}_vs_torch", 0.0) for r in rows), default=0.0)
    summary["max_rel_err"] = max(r[f"{name}_rel_err"] for r in rows for name in names)
    return summary


# ---------------------------------------------------------------------------------------------- the MoE layer
@dataclass(frozen=True)
class MoeCase:
    """One MoE-layer row: E experts, top-k, hidden size, expert intermediate size, tokens; ``backward``: also time
    forward+backward (gradients of x and every weight)."""
    layer: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: int
    backward: bool
    note: str = ""


MOE_CASES = [MoeCase("DeepSeek-V3-like", 256, 8, 7168, 2048, 4096, True),
             MoeCase("DeepSeek-V3-like", 256, 8, 7168, 2048, 64, False),
             MoeCase("Qwen3-30B-A3B-like", 128, 8, 2048, 768, 4096, True),
             MoeCase("Qwen3-30B-A3B-like", 128, 8, 2048, 768, 64, False)]


def route_tokens(x: torch.Tensor, router_weight: torch.Tensor, top_k: int):
    """The router and the permutation of the eager layers: softmax over float32 logits (DeepSeek-V3's gate runs in
    float32; one routing for every version, so outputs compare), top-k renormalised, token copies sorted by expert
    (stable argsort), the experts' cumulative ends counted on the device (no host sync). Returns (rows, offs, the
    token of each row, its routing weight)."""
    experts = router_weight.shape[0]
    probs = torch.softmax(x.float() @ router_weight.float().mT, dim=-1)
    weights, ids = torch.topk(probs, top_k)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // top_k
    return x[token], offs, token, weights.reshape(-1)[order]


def combine(y: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, tokens: int) -> torch.Tensor:
    """The weighted un-permutation: each token's expert outputs times their routing weights, summed in float32."""
    out = torch.zeros(tokens, y.shape[-1], dtype=torch.float32, device=y.device)
    return out.index_add(0, token, y.float() * weight.unsqueeze(-1)).to(y.dtype)


def torch_moe(x, router_weight, w13, w2, top_k):
    """The eager MoE layer on torch._grouped_mm (w13 [E, 2I, H]: gate rows then up rows; w2 [E, H, I])."""
    rows, offs, token, weight = route_tokens(x, router_weight, top_k)
    gate, up = torch._grouped_mm(rows, w13.mT, offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.mT, offs=offs)
    return combine(y, token, weight, x.shape[0])


def nvfly_layer_routing(x, router_weight, top_k):
    """The router and the permutation on nvfly's kernels as differentiable, traceable operators
    (``torch.ops.nvfly.moe_route`` / ``moe_permute``: ``nvfly.torch.moe_ops``), from the eager layer's float32
    logits. Returns (rows, offs, slots, routing weights)."""
    weights, ids = torch.ops.nvfly.moe_route(x.float() @ router_weight.float().mT, top_k)
    rows, offs, slots = torch.ops.nvfly.moe_permute(x, ids, router_weight.shape[0])
    return rows, offs, slots, weights


def nvfly_moe(x, router_weight, w13, w2, top_k):
    """The layer on nvfly's kernels, forward and backward: the router and shuffles (``nvfly::moe_*``, whose
    gradients run on the same kernels) and nvfly's differentiable grouped-GEMM op, the gate/up projection and
    SiLU * mul in one kernel (its backward recomputes gate/up)."""
    rows, offs, slots, weights = nvfly_layer_routing(x, router_weight, top_k)
    hidden = torch.ops.nvfly.grouped_mm(rows, w13.mT, offs, fuse="silu_mul")
    return torch.ops.nvfly.moe_unpermute(torch.ops.nvfly.grouped_mm(hidden, w2.mT, offs), slots, weights)


def nvfly_moe_unfused(x, router_weight, w13, w2, top_k):
    """The same without the fused epilogue (gate/up out, SiLU * mul on torch): autograd saves the [rows, 2I]
    activations instead of recomputing them, as the eager layer does."""
    rows, offs, slots, weights = nvfly_layer_routing(x, router_weight, top_k)
    gate, up = torch.ops.nvfly.grouped_mm(rows, w13.mT, offs).chunk(2, dim=-1)
    y = torch.ops.nvfly.grouped_mm(torch.nn.functional.silu(gate) * up, w2.mT, offs)
    return torch.ops.nvfly.moe_unpermute(y, slots, weights)


HOST_BOUND_TOKENS = 256  # --moe-profile profiles the rows of at most this many tokens (host-bound on the H200)


def host_profile(label: str, fn, calls: int, top: int = 30) -> None:
    """cProfile of ``calls`` calls of ``fn`` after a synchronize: where a host-bound version's host time goes
    (``--moe-profile``), printed by internal time."""
    import cProfile
    import io
    import pstats
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(f"==== host profile: {label}, {calls} calls\n{text.getvalue()}", flush=True)


def moe_layer_row(case: MoeCase, compile_too: bool, profile_calls: int = 0) -> list[dict]:
    """The case's rows (forward; forward+backward when ``case.backward``): every version checked, then timed;
    ``profile_calls``: the forward versions' host profiles too (rows of at most HOST_BOUND_TOKENS tokens)."""
    import nvfly.torch
    from nvfly.ops import moe
    e, h, inter, k, t = case.experts, case.hidden, case.inter, case.top_k, case.tokens
    bf16 = torch.bfloat16
    torch._dynamo.reset()  # each case compiles afresh (no automatic dynamic shapes from an earlier case)
    x = torch.randn(t, h, device="cuda").to(bf16)
    router = (torch.randn(e, h, device="cuda") / math.sqrt(h)).to(bf16)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda") / math.sqrt(h)).to(bf16)
    w2 = (torch.randn(e, h, inter, device="cuda") / math.sqrt(inter)).to(bf16)
    args = (x, router, w13, w2)

    def routed(*a):
        with nvfly.torch.routing():
            return torch_moe(*a, k)
    forward = {"eager": lambda *a: torch_moe(*a, k), "nvfly_route": routed,
               "nvfly_route_held": lambda *a: torch_moe(*a, k),
               "nvfly_moe": lambda *a: moe.moe(*a, k), "nvfly_ops": lambda *a: nvfly_moe(*a, k),
               "nvfly_ops_unfused": lambda *a: nvfly_moe_unfused(*a, k)}
    # nvfly_route enters routing() on every call (a block's start and end register and remove the routes:
    # routing_overhead.py); nvfly_route_held inside one block around all its calls, as a model's forward holds one
    # block for all its layers
    around = {"nvfly_route_held": nvfly.torch.routing}
    errors = {}
    if compile_too:
        forward["compiled"] = torch.compile(lambda *a: torch_moe(*a, k))
        forward["compiled_nvfly"] = torch.compile(lambda *a: nvfly_moe(*a, k))
    ref = moe.reference(x, router, w13, w2, k)
    base = {"layer": case.layer, "experts": e, "top_k": k, "hidden": h, "inter": inter, "tokens": t,
            "note": case.note}
    rows = []
    fwd = dict(base, **{"pass": "forward", "compiled_nvfly_layer": "fused"})
    with torch.no_grad():
        for name, fn in list(forward.items()):
            try:
                with around.get(name, contextlib.nullcontext)():
                    fwd[f"{name}_rel_err"] = rel_err(fn(*args).float(), ref)
            except Exception as exc:  # a version that fails is reported, not timed
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
                del forward[name]
        del ref
        for name, fn in forward.items():
            with around.get(name, contextlib.nullcontext)():
                fwd[f"{name}_ms"] = bench_ms(lambda fn=fn: fn(*args))
        if profile_calls and t <= HOST_BOUND_TOKENS:
            for name, fn in forward.items():
                with around.get(name, contextlib.nullcontext)():
                    host_profile(f"{case.layer} T{t} forward {name}", lambda fn=fn: fn(*args), profile_calls)
    rows.append(finish_moe_row(fwd, errors))
    if case.backward:
        if compile_too:  # training: the layer that saves its gate/up activations (no recompute in the backward)
            forward["compiled_nvfly"] = torch.compile(lambda *a: nvfly_moe_unfused(*a, k))
        rows.append(moe_backward_row(dict(base, **{"pass": "forward+backward", "compiled_nvfly_layer": "unfused"}),
                                     forward, args))
    return rows


def moe_backward_row(row: dict, forward: dict, args: tuple) -> dict:
    """Forward+backward of every version (torch.autograd.grad: no accumulation into .grad); each version's
    gradients of x and the three weights against the eager layer's."""
    import nvfly.torch
    leaves = [a.detach().requires_grad_() for a in args]
    grad_out = torch.randn_like(args[0])
    errors = {}

    def step(name, fn):
        def run():
            out = fn(*leaves)
            return torch.autograd.grad(out, leaves, grad_out)
        if name == "nvfly_route":  # the backward runs under the route too (on the calling thread)
            def routed_run():
                with nvfly.torch.routing():
                    return run()
            return routed_run
        return run
    # nvfly_moe: inference; nvfly_route_held: the forward row's comparison of block costs
    steps = {name: step(name, fn) for name, fn in forward.items() if name not in ("nvfly_moe", "nvfly_route_held")}
    want = steps["eager"]()
    for name, fn in list(steps.items()):
        if name == "eager":
            continue
        try:
            got = fn()
            row[f"{name}_grad_rel_err"] = max(chunked_rel_err(g, w) for g, w in zip(got, want))
            del got
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            del steps[name]
    del want
    for name, fn in steps.items():
        row[f"{name}_ms"] = bench_ms(fn)
    return finish_moe_row(row, errors)


def chunked_rel_err(out: torch.Tensor, ref: torch.Tensor, chunk_elements: int = 1 << 26) -> float:
    """``rel_err`` over the elements ``ref`` owns (not NaN: the masked layout's rows past a group's count, which
    nvfly leaves unwritten and torch's peer computes), a slice of the first dimension of about ``chunk_elements`` at
    a time (float64 copies of a DeepSeek-V3 weight gradient would take 60 GB); inf where ``out`` is NaN on an
    owned element."""
    step = max(1, chunk_elements // max(1, math.prod(out.shape[1:])))
    num = den = 0.0
    for o, r in zip(out.detach().split(step), ref.detach().split(step)):
        owned = ~r.isnan()
        o, r = o[owned].double(), r[owned].double()
        if torch.isnan(o).any():
            return math.inf
        num += float((o - r).square().sum())
        den += float(r.square().sum())
    return math.sqrt(num / max(den, 1e-300))


def finish_moe_row(row: dict, errors: dict) -> dict:
    """nvfly_ms (the fastest nvfly eager version), the ratios, the failures; prints the row."""
    eager_versions = [v for v in ("nvfly_route", "nvfly_route_held", "nvfly_moe", "nvfly_ops", "nvfly_ops_unfused")
                      if f"{v}_ms" in row]
    if eager_versions:
        best = min(eager_versions, key=lambda v: row[f"{v}_ms"])
        row["nvfly_version"] = best
        row["nvfly_ms"] = row[f"{best}_ms"]
        row["nvfly_vs_eager"] = row["eager_ms"] / row["nvfly_ms"]
    if "compiled_ms" in row:
        if "compiled_nvfly_ms" in row:
            row["compiled_nvfly_vs_compiled"] = row["compiled_ms"] / row["compiled_nvfly_ms"]
        if "nvfly_ms" in row:
            row["nvfly_vs_compiled"] = row["compiled_ms"] / row["nvfly_ms"]
    if errors:
        row["errors"] = errors
    times = "  ".join(f"{v} {row[v + '_ms']:.3f}" for v in ("eager", "nvfly_route", "nvfly_route_held", "nvfly_moe",
                                                             "nvfly_ops",
                                                             "nvfly_ops_unfused", "compiled", "compiled_nvfly")
                      if v + "_ms" in row)
    print(f"{row['layer']:<20} T{row['tokens']:<5} {row['pass']:<16} ms: {times}  "
          f"nvfly x{row.get('nvfly_vs_eager', 0):.2f} eager, "
          f"compiled+nvfly x{row.get('compiled_nvfly_vs_compiled', 0):.2f} compiled"
          + (f"  FAILED: {errors}" if errors else ""), flush=True)
    return row


def moe_rows(layers: str, compile_too: bool, profile_calls: int = 0) -> list[dict]:
    rows = []
    for case in progress([c for c in MOE_CASES if layers.lower() in c.layer.lower()], "grouped moe"):
        rows += moe_layer_row(case, compile_too, profile_calls)
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------- FP8 (--fp8)
# DeepSeek-V3's experts (E256 top-8, hidden 7168, expert width 2048: gate/up N = 4096, down K = 2048) at 4096 tokens
# and at decode batches, contiguous (tokens sorted by expert) and masked (a fixed capacity per expert)
FP8_QUICK = [
    Case("DSv3 gate/up T4096", "forward", 256, 4096, 7168, 4096 * 8, top_k=8),
    Case("DSv3 down T4096", "forward", 256, 7168, 2048, 4096 * 8, top_k=8),
    Case("DSv3 gate/up decode T32", "forward", 256, 4096, 7168, 32 * 8, top_k=8),
    Case("DSv3 masked decode T128", "forward", 256, 4096, 7168, 128 * 8, top_k=8, layout="masked"),
    Case("DSv3 gate/up T4096 routed", "forward", 256, 4096, 7168, 4096 * 8, "topk8", 8),
]
FP8_FULL = FP8_QUICK + [
    Case("DSv3 gate/up T4096 zipf", "forward", 256, 4096, 7168, 4096 * 8, "zipf", 8),
    Case("DSv3 gate/up T16384", "forward", 256, 4096, 7168, 16384 * 8, top_k=8),
    Case("DSv3 gate/up T512", "forward", 256, 4096, 7168, 512 * 8, top_k=8),
    Case("DSv3 down decode T128", "forward", 256, 7168, 2048, 128 * 8, top_k=8),
    Case("DSv3 masked T4096", "forward", 256, 4096, 7168, 4096 * 8, top_k=8, layout="masked"),
]


# ratio -> (the implementation it divides the time of, the one it divides by): > 1 where the second is faster
FP8_RATIOS = {"vs_torch_row": ("torch_row", "nvfly"), "vs_nvfly_bf16": ("nvfly_bf16", "nvfly"),
              "vs_torch_bf16": ("torch_bf16", "nvfly"), "default_vs_serial": ("nvfly_serial", "nvfly"),
              "row_vs_torch_row": ("torch_row", "nvfly_row")}
# the block path's candidate 128-row tiles timed beside the default (issue #30): name -> ScaledConfig fields (the ring
# then as deep as fits next to the group table), each also a "<name>_vs_default" ratio (staged: the activation
# scales TMA-loaded into the stage, on the contiguous rows in 16-byte-aligned boxes of bm + 4); store: the TMA-store
# epilogue (rows inside their group); wide: 128 x 192 in order (three 64-column weight-block runs, no third
# accumulator); cluster: 2-block clusters along N, each block loading half of the shared A tile and multicasting
# it; stream: the weights' loads evict_first, the tokens' evict_last; skip: a consumer whose half of a group's last
# tile is empty only releases its stages
FP8_BLOCK_VARIANTS = {
    "nvfly_store": dict(bm=128, bn=128, consumers=2, issue_ahead=True, tma_store=True),
    "nvfly_wide": dict(bm=128, bn=192, consumers=2),
    "nvfly_wide_store": dict(bm=128, bn=192, consumers=2, tma_store=True),
    "nvfly_cluster_store": dict(bm=128, bn=128, consumers=2, issue_ahead=True, tma_store=True, cluster_n=2),
    "nvfly_wide_cluster_store": dict(bm=128, bn=192, consumers=2, tma_store=True, cluster_n=2),
    "nvfly_wide_cluster_store_staged": dict(bm=128, bn=192, consumers=2, tma_store=True, cluster_n=2,
                                            staged_scales=True),
    "nvfly_cluster_store_staged": dict(bm=128, bn=128, consumers=2, issue_ahead=True, tma_store=True, cluster_n=2,
                                       staged_scales=True),
    "nvfly_stream_store": dict(bm=128, bn=128, consumers=2, issue_ahead=True, tma_store=True, stream_b=True),
    "nvfly_wide_cluster_store_staged_skip": dict(bm=128, bn=192, consumers=2, tma_store=True, cluster_n=2,
                                                 staged_scales=True, skip_empty=True),
}
FP8_RATIOS.update({f"{name[len('nvfly_'):]}_vs_default": ("nvfly", name) for name in FP8_BLOCK_VARIANTS})


def fp8_experts(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random expert weights quantised expert by expert (the fp32 weights of all experts at once would not fit):
    e4m3 b [E, K, N] column-major and its 128 x 128 block scales [E, K/128, N/128]."""
    from nvfly.ops.scaled.quantize import quantize
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(e, math.ceil(k / 128), math.ceil(n / 128), device="cuda")
    for g in range(e):
        qt, s = quantize(torch.randn(n, k, device="cuda"), "128x128", operand="b")
        q[g], scales[g] = qt.t(), s
    return q.transpose(-2, -1), scales


def fp8_setup(case: Case):
    """(implementations by name, their references by name, flop, bytes, plan) of an FP8 case. nvfly's block path
    (1x128 tokens x 128x128 weights, DeepSeek-V3's recipe; also without issuing ahead where its 128-row tile runs), its
    row-wise path (per token x per expert channel, promoted as torch's default), torch._scaled_grouped_mm
    (row-wise: what torch runs on sm90) and the bf16 grouped GEMMs (nvfly's and torch._grouped_mm) of the same
    routing; the row-wise scales are random, over the same fp8 bytes."""
    from nvfly.ops import scaled
    from nvfly.ops.scaled import ScaledConfig
    from nvfly.ops.scaled.grouped_plan import deepest
    from nvfly.ops.scaled.quantize import quantize
    sizes = group_sizes(case)
    e, n, k = case.experts, case.n, case.k
    active = sum(1 for s in sizes if s)
    bf16 = torch.bfloat16
    b, sb = fp8_experts(e, n, k)
    sb_row = torch.rand(e, n, device="cuda") + 0.5
    b16 = b.to(bf16)
    masked = case.layout == "masked"
    if masked:
        capacity = masked_capacity(case)
        counts = torch.tensor([min(s, capacity) for s in sizes], dtype=torch.int32).cuda()
        rows, groups_of = e * capacity, counts
        routed = int(counts.sum())
    else:
        rows, groups_of = sum(sizes), offsets(sizes)
        routed = rows
    x = torch.randn(rows, k, device="cuda")
    a, sa = quantize(x, "1x128")
    sa_row = torch.rand(rows, device="cuda") + 0.5
    a16 = x.to(bf16)
    if masked:
        a, sa, sa_row, a16 = (a.view(e, capacity, k), sa.reshape(e, capacity, -1), sa_row.view(e, capacity),
                              a16.view(e, capacity, k))
    out = torch.full(tuple(a.shape[:-1]) + (n,), float("nan"), device="cuda", dtype=bf16)
    expected = case.rows / e
    if masked:
        def nvfly_fp8(sa_, sb_, config=None):
            return scaled.scaled_grouped_mm_masked(a, b, sa_, sb_, counts, out=out, config=config,
                                                   expected_rows=expected)
        impls = {"nvfly_bf16": lambda: grouped.grouped_mm_masked(a16, b16, counts, expected_rows=expected),
                 "torch_bf16": lambda: torch._grouped_mm(a16, b16)}
    else:
        def nvfly_fp8(sa_, sb_, config=None):
            return scaled.scaled_grouped_mm(a, b, sa_, sb_, groups_of, out=out, config=config)
        impls = {"nvfly_bf16": lambda: grouped.grouped_mm(a16, b16, groups_of),
                 "torch_bf16": lambda: torch._grouped_mm(a16, b16, groups_of)}
    impls["nvfly"] = lambda: nvfly_fp8(sa, sb)
    plan = scaled.describe_grouped("masked" if masked else "contiguous", e, a.shape[-2], n, k, rows_per_group=expected)
    if expected > 64:
        serial = deepest(ScaledConfig(128, 128, 2, 2), e)  # (the default issues ahead on this tile)
        impls["nvfly_serial"] = lambda: nvfly_fp8(sa, sb, serial)
        for name, fields in FP8_BLOCK_VARIANTS.items():
            impls[name] = functools.partial(nvfly_fp8, sa, sb, deepest(ScaledConfig(stages=2, **fields), e))
    impls["nvfly_row"] = lambda: nvfly_fp8(sa_row, sb_row)
    impls["torch_row"] = lambda: torch._scaled_grouped_mm(a, b, sa_row, sb_row, offs=None if masked else groups_of,
                                                          out_dtype=bf16)
    block_ref = lambda: scaled.grouped_reference(a, b, sa, sb, groups_of, masked=masked)  # noqa: E731
    row_ref = lambda: scaled.grouped_reference(a, b, sa_row, sb_row, groups_of, masked=masked)  # noqa: E731
    bf16_ref = lambda: grouped.reference(a16, b16, groups_of, masked=masked)  # noqa: E731
    refs = {"nvfly": block_ref, "nvfly_serial": block_ref, "nvfly_row": row_ref, "torch_row": row_ref,
            "nvfly_bf16": bf16_ref, "torch_bf16": bf16_ref, **{name: block_ref for name in FP8_BLOCK_VARIANTS}}
    flop = 2.0 * routed * n * k
    nbytes = routed * k + active * n * k + 2.0 * routed * n
    return impls, refs, flop, nbytes, plan


def fp8_rows(cases: list[Case]) -> tuple[list[dict], dict]:
    """The FP8 grouped rows: every implementation's error against its float32 reference (owned rows; a peer that
    raises is left out, with its error), then TFLOP/s, TB/s of the fp8 bytes that must move, and ratios."""
    rows = []
    for case in progress(cases, "grouped_fp8"):
        impls, refs, flop, nbytes, plan = fp8_setup(case)
        row = {**case.row_keys(), "dtype": "e4m3", "nvfly_plan": plan}
        refs_done: dict = {}
        for name in list(impls):
            try:
                got = impls[name]().float()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - torch's kernel may not run this on this card
                row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                del impls[name]
                continue
            key = refs[name]
            if key not in refs_done:
                refs_done.clear()  # one reference alive at a time: they are large
                refs_done[key] = key()
            ref = refs_done[key]
            owned = ~ref.isnan()
            row[f"{name}_rel_err"] = rel_err(got[owned], ref[owned])
            del got, owned
        refs_done.clear()
        time_impls(row, impls, flop, nbytes)
        row.update({ratio: row[f"{slower}_ms"] / row[f"{faster}_ms"] for ratio, (slower, faster) in FP8_RATIOS.items()
                    if f"{slower}_ms" in row and f"{faster}_ms" in row})
        rows.append(row)
        print(f"{case.name:<26} nvfly {row['nvfly_tflops']:7.1f} TF {row['nvfly_tbps']:5.2f} TB/s "
              f"(err {row['nvfly_rel_err']:.1e}) "
              + "  ".join(f"{p} {row[p + '_tflops']:.0f} TF" for p in ("nvfly_serial", *FP8_BLOCK_VARIANTS,
                                                                        "nvfly_row", "torch_row", "nvfly_bf16",
                                                                        "torch_bf16")
                          if f"{p}_tflops" in row), flush=True)
        del impls, refs
        torch.cuda.empty_cache()
    summary = {key: geomean([r[key] for r in rows if key in r]) for key in FP8_RATIOS}
    summary["dsv3_t4096_tflops"] = {r["case"]: r["nvfly_tflops"] for r in rows if "T4096" in r["case"]}
    summary["max_rel_err"] = max(r["nvfly_rel_err"] for r in rows)
    return rows, summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="the anchor rows only (25 s; 3 minutes with --triton-cases 8)")
    p.add_argument("--full", action="store_true",
                   help="the anchors' grouped suite, FULL (the default without --quick, --moe, --fp8 or the variants)")
    p.add_argument("--tokens", default="", help="the full suite's rows of these token counts only (e.g. 64,16384)")
    p.add_argument("--passes", default="", help=f"the full suite's rows of these passes only (of {', '.join(PASSES)})")
    p.add_argument("--models", default="",
                   help=f"the full suite's rows of these models only (of {', '.join(MODEL_NAMES)})")
    p.add_argument("--routings", default="",
                   help=f"the full suite's rows of these routings only (of {', '.join(ROUTINGS)})")
    p.add_argument("--moe", action="store_true", help="the MoE-layer rows (alone, or after --quick's or --full's)")
    p.add_argument("--moe-layers", default="", help="only the MoE layers whose name contains this (e.g. qwen3)")
    p.add_argument("--no-compile", action="store_true", help="MoE rows without the torch.compile versions")
    p.add_argument("--moe-profile", type=int, default=0, metavar="CALLS",
                   help="print a cProfile of CALLS calls of each forward version of the host-bound MoE rows")
    p.add_argument("--wgrad-variants", action="store_true",
                   help="the K-grouped weight gradient on each of the kernel's K-grouped tiles vs torch (alone): "
                        "WGRAD_CASES, or with --tokens, --models or --routings the full suite's weight-gradient rows")
    p.add_argument("--variants", action="store_true",
                   help="the compute-bound forward rows on each forward variant vs torch and Inductor (alone)")
    p.add_argument("--fp8", action="store_true",
                   help="the grouped FP8 rows alone (DeepSeek-V3 experts; with --quick: five, a few minutes)")
    p.add_argument("--no-triton", action="store_true", help="leave out Inductor max-autotune's grouped mm")
    p.add_argument("--triton-cases", type=int, default=None,
                   help="time Inductor on the first N forward shapes, each compiled once for its routings (default: "
                        "1 with --quick, else every shape --budget-s allows)")
    p.add_argument("--budget-s", type=float, default=440.0,
                   help="without --quick: Inductor compiles a new shape only while the run's projected seconds stay "
                        "within this (default 440: the full suite in one device call under 9 minutes; 0: no limit)")
    p.add_argument("--name", default=None, help="results file stem: benchmarks/results/<name>_h200.json "
                   "(default grouped; grouped_moe for --moe alone, grouped_wgrad for --wgrad-variants)")
    args = p.parse_args(argv)
    t_start = time.time()
    if args.wgrad_variants:
        name = args.name or "grouped_wgrad"
        if args.passes not in ("", "wgrad"):
            p.error(f"--passes: --wgrad-variants times the weight gradient only, got {args.passes!r}")
        picked = args.tokens or args.models or args.routings
        rows = wgrad_variants(suite_of(argparse.Namespace(**{**vars(args), "passes": "wgrad"}), p) if picked
                              else WGRAD_CASES)
        variants = list(rows[0]["variants"])
        summary = {}
        for v in variants:
            timed = [r[f"{v}_vs_torch"] for r in rows if f"{v}_vs_torch" in r]
            summary[f"geomean_{v}_vs_torch"] = geomean(timed) if timed else None
            summary[f"min_{v}_vs_torch"] = min(timed, default=None)
            summary[f"untimed_{v}"] = len(rows) - len(timed)  # off the reference (or torch failed)
        summary["seconds"] = time.time() - t_start
        print(summary)
        path = write_results(name, rows, {"summary": summary})
        plot(name, [r["case"] for r in rows], {v: [r.get(f"{v}_tbps", 0.0) for r in rows]
                                               for v in ["torch"] + variants}, "TB/s of the bytes that must move")
        print("wrote", path)
        return 0
    if args.variants:
        name = args.name or "grouped_variants"
        picked = args.tokens or args.models or args.routings
        cases = ([c for c in suite_of(argparse.Namespace(**{**vars(args), "passes": "forward"}), p)
                  if c.layout == "contiguous"] if picked else VARIANT_CASES)
        triton_cases = 0 if args.no_triton else (args.triton_cases if args.triton_cases is not None else len(cases))
        rows = forward_variant_rows(cases, triton_cases)
        summary = variant_summary(rows)
        summary["seconds"] = time.time() - t_start
        print(summary)
        path = write_results(name, rows, {"summary": summary})
        peers = [p for p in ("torch", "triton") if any(f"{p}_tflops" in r for r in rows)]
        plot(name, [r["case"] for r in rows], {v: [r.get(f"{v}_tflops", 0.0) for r in rows]
                                               for v in peers + list(rows[0]["variants"])}, "TFLOP/s")
        print("wrote", path)
        return 0
    if args.fp8:
        name = args.name or "grouped_fp8"
        rows, summary = fp8_rows(FP8_QUICK if args.quick else FP8_FULL)
        summary["seconds"] = time.time() - t_start
        print(summary)
        path = write_results(name, rows, {"summary": summary})
        plot(name, [r["case"] for r in rows], {p: [r.get(f"{p}_tflops", 0.0) for r in rows]
                                               for p in ("nvfly", "nvfly_row", "torch_row", "nvfly_bf16",
                                                         "torch_bf16")}, "TFLOP/s")
        print("wrote", path)
        return 0
    if args.quick and (args.full or args.tokens or args.passes):
        p.error("--quick takes the anchor rows: --full, --tokens and --passes pick the full suite's")
    rows, summary = [], {}
    extra = {"peak_tflops": PEAK_TFLOPS, "peak_tbps": PEAK_TBPS}
    if args.quick or args.full or not args.moe:
        def checkpoint(so_far: list[dict]) -> None:  # the rows so far, overwritten by the run's end
            write_results(args.name or "grouped", so_far, {"summary": {"partial": len(so_far)}, **extra})
        rows, summary = grouped_rows(QUICK if args.quick else suite_of(args, p), args, t_start, checkpoint)
    moe = moe_rows(args.moe_layers, not args.no_compile, args.moe_profile) if args.moe else []
    if moe:
        summary["moe"] = {key: [r.get(key) for r in moe] for key in ("layer", "tokens", "pass", "nvfly_vs_eager",
                                                                      "compiled_nvfly_vs_compiled")}
    summary["seconds"] = time.time() - t_start
    print(summary)
    name = args.name or ("grouped" if rows else "grouped_moe")
    path = write_results(name, rows + moe, {"summary": summary, **extra})
    if rows:
        series = {"nvfly": [r["nvfly_of_floor"] for r in rows],
                  "torch._grouped_mm": [r["torch_of_floor"] for r in rows]}
        if any("triton_of_floor" in r for r in rows):
            series["Inductor (Triton)"] = [r.get("triton_of_floor", 0.0) for r in rows]
        plot(name, [r["case"] for r in rows], series, "fraction of the max(compute, memory) floor")
    else:
        labels = [f"{r['layer']} T{r['tokens']} {r['pass']}" for r in moe]
        plot(name, labels, {v: [r.get(f"{v}_ms", 0.0) for r in moe]
                            for v in ("eager", "nvfly", "compiled", "compiled_nvfly")}, "ms (lower is better)")
    print("wrote", path)
    return 0


CHECKPOINT_ROWS = 25


class TritonBudget:
    """Whether Inductor may compile one more forward shape: while the run's projected seconds (those spent, the
    compile, and the rows left at the mean seconds of the rows so far, their compiles left out) stay within
    ``seconds`` (0: no limit). Before a compile is measured one is taken to cost ``COMPILE_S`` (torch 2.11 on the
    H200: ~23 s a shape, 185 s for --quick --triton-cases 8 against 25 s with one), before a row is measured
    ``ROW_S``."""
    COMPILE_S = 30.0
    ROW_S = 1.0

    def __init__(self, seconds: float, start: float):
        self.seconds = seconds
        self.start = start
        self.compiles: list[float] = []
        self.rows: list[float] = []

    def allows(self, rows_left: int, now: float) -> bool:
        if not self.seconds:
            return True
        compile_s = max(self.compiles, default=self.COMPILE_S)
        row_s = sum(self.rows) / len(self.rows) if self.rows else self.ROW_S
        return now - self.start + compile_s + rows_left * row_s <= self.seconds


def suite_of(args, parser: argparse.ArgumentParser) -> list[Case]:
    """FULL, or its rows of ``--tokens``, ``--passes``, ``--models`` and ``--routings``."""
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t] or list(FULL_TOKENS)
    except ValueError:
        parser.error(f"--tokens: expected token counts separated by commas, got {args.tokens!r}")
    picked = {flag: [v for v in value.split(",") if v] or list(known) for flag, value, known in (
        ("--passes", args.passes, PASSES), ("--models", args.models, MODEL_NAMES),
        ("--routings", args.routings, ROUTINGS))}
    for name, values, known in (("--tokens", tokens, FULL_TOKENS), ("--passes", picked["--passes"], PASSES),
                                ("--models", picked["--models"], MODEL_NAMES),
                                ("--routings", picked["--routings"], ROUTINGS)):
        unknown = [v for v in values if v not in known]
        if unknown:
            parser.error(f"{name}: {unknown} not in the full suite's {list(known)}")
    if not (args.tokens or args.passes or args.models or args.routings):
        return FULL
    return full_cases([t for t in FULL_TOKENS if t in tokens], picked["--passes"], picked["--models"],
                      picked["--routings"])


def grouped_rows(cases: list[Case], args, start: float,
                 checkpoint: Optional[Callable[[list[dict]], None]] = None) -> tuple[list[dict], dict]:
    """The grouped-GEMM rows of ``cases`` and their summary. Inductor's Triton grouped mm on the plain contiguous
    forward rows: compiled once a shape (kept for the shape's next rows: its other routings), on the first
    ``args.triton_cases`` shapes while ``args.budget_s`` allows (``TritonBudget``; rows it leaves out say why, a
    compile that fails says how). ``checkpoint``: called with the rows so far every ``CHECKPOINT_ROWS`` rows (a run
    cut short keeps them)."""
    triton_cases = args.triton_cases if args.triton_cases is not None else (1 if args.quick else len(cases))
    budget = TritonBudget(0.0 if args.quick else args.budget_s, start)
    rows = []
    compiled, compiled_shape, compile_error, shapes_seen = None, None, None, []
    for index, case in enumerate(progress(cases, "grouped")):
        row_start = time.time()
        s = setup(case)
        impls = dict(s.impls)
        row = {**case.row_keys(), "dtype": "bf16", "nvfly_plan": s.plan}
        compile_s = 0.0
        if case.gemm_pass == "forward" and case.layout == "contiguous" and not args.no_triton \
                and hasattr(torch, "_grouped_mm"):
            shape = (case.experts, case.n, case.k, case.rows)
            if shape != compiled_shape:
                compiled, compiled_shape, compile_error = None, None, None
                if shape not in shapes_seen:
                    shapes_seen.append(shape)
                if len(shapes_seen) > triton_cases:
                    row["triton_left_out"] = f"--triton-cases {triton_cases}"
                elif not budget.allows(len(cases) - index, row_start):
                    row["triton_left_out"] = f"--budget-s {budget.seconds:g}"
                else:
                    t0 = time.time()
                    compiled_shape = shape  # compiled once, or failed once, for the shape's routings
                    try:
                        compiled = inductor_grouped_mm()
                        compiled(*s.operands)  # max-autotune's compile and autotuning
                        torch.cuda.synchronize()
                    except Exception as exc:  # noqa: BLE001 - a failed compile is reported, the rows go on
                        compiled, compile_error = None, f"{type(exc).__name__}: {exc}"[:300]
                    compile_s = time.time() - t0
                    budget.compiles.append(compile_s)
                    row["triton_compile_s"] = compile_s
            if compiled is not None:
                impls["triton"] = functools.partial(compiled, *s.operands)
            elif compile_error:
                row["triton_error"] = compile_error
        ref = s.reference()
        for name, fn in impls.items():
            out = fn()
            torch.cuda.synchronize()
            row[f"{name}_rel_err"] = chunked_rel_err(out, ref)  # the owned rows (torch's masked peer computes all)
            del out
        del ref
        time_impls(row, impls, s.flop, s.nbytes)
        compute_ms, memory_ms = s.flop / (PEAK_TFLOPS * 1e9), s.nbytes / (PEAK_TBPS * 1e9)
        row["floor_ms"] = floor_ms = max(compute_ms, memory_ms)
        row["bound"] = "compute" if compute_ms >= memory_ms else "memory"
        for name in impls:
            row[f"{name}_of_floor"] = floor_ms / row[f"{name}_ms"]
        row["vs_torch"] = row["torch_ms"] / row["nvfly_ms"]
        if "triton_ms" in row:
            row["vs_triton"] = row["triton_ms"] / row["nvfly_ms"]
        rows.append(row)
        print(f"{case.name:<40} nvfly {row['nvfly_tflops']:6.1f} TF {row['nvfly_tbps']:5.2f} TB/s "
              f"({row['nvfly_of_floor']:.0%} of the {row['bound']} floor, err {row['nvfly_rel_err']:.1e})  "
              f"torch {row['torch_tflops']:6.1f} TF  x{row['vs_torch']:.2f}"
              + (f"  triton {row['triton_tflops']:6.1f} TF x{row['vs_triton']:.2f}" if "vs_triton" in row else "")
              + (f" (compiled in {compile_s:.0f} s)" if compile_s else ""), flush=True)
        del impls, s
        torch.cuda.empty_cache()
        budget.rows.append(time.time() - row_start - compile_s)
        if checkpoint is not None and len(rows) % CHECKPOINT_ROWS == 0:
            checkpoint(rows)
    return rows, grouped_summary(rows)


def grouped_summary(rows: list[dict]) -> dict:
    """Geomeans and worst rows against torch._grouped_mm and Inductor's Triton grouped mm (issue #29's targets:
    >= 1.1x and >= 1.25x geomean, no row below 1.0x), nvfly's fraction of the floor (and on the memory-bound rows of
    at most 64 rows an expert: >= 90%), the same per pass and layout, and what Inductor's compiles covered."""
    def ratios(subset: list[dict]) -> dict:
        small = [r["nvfly_of_floor"] for r in subset if r["rows"] <= 64 * r["experts"] and r["bound"] == "memory"]
        return {"rows": len(subset), "geomean_vs_torch": geomean([r["vs_torch"] for r in subset]),
                "min_vs_torch": min(r["vs_torch"] for r in subset),
                "triton_rows": sum(1 for r in subset if "vs_triton" in r),
                "geomean_vs_triton": geomean([r["vs_triton"] for r in subset if "vs_triton" in r]),
                "min_vs_triton": min((r["vs_triton"] for r in subset if "vs_triton" in r), default=float("nan")),
                "geomean_of_floor": geomean([r["nvfly_of_floor"] for r in subset]),
                "min_of_memory_floor_le64": min(small, default=float("nan"))}
    summary = ratios(rows)
    summary["max_rel_err"] = max(r["nvfly_rel_err"] for r in rows)
    summary["triton_compiles"] = sum(1 for r in rows if "triton_compile_s" in r)
    summary["triton_errors"] = sum(1 for r in rows if "triton_error" in r and "triton_compile_s" in r)
    summary["triton_compile_s"] = sum(r.get("triton_compile_s", 0.0) for r in rows)
    summary["triton_left_out"] = sum(1 for r in rows if "triton_left_out" in r)
    summary["by_pass"] = {f"{p} {layout}": ratios(subset) for p in PASSES for layout in ("contiguous", "masked")
                          if (subset := [r for r in rows if r["pass"] == p and r["layout"] == layout])}
    return summary


if __name__ == "__main__":
    sys.exit(main())
