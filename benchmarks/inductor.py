"""torch.compile(mode="max-autotune") with nvfly installed vs without it, in one process.

Models (Llama-3-8B sizes, bf16): the MLP block down(silu(gate(x)) * up(x)) with hidden 4096 and intermediate
14336, and the attention projections qkv (4096 -> 6144: 32 query and 8 key/value heads of 128) and o
(4096 -> 4096), at a few token counts. For each model and token count: eager, default Inductor max-autotune,
then max-autotune with nvfly installed; both compiled outputs are checked against eager (and a float32 model);
end-to-end median times (CUDA events, L2 flushed); the backend that won each GEMM and every candidate's time
(nvfly's decision log), and each GEMM's kernels timed alone (nvfly vs cuBLAS, torch.profiler). Autotuning is
trimmed for time, the same way for both: a few Triton configs per GEMM, no epilogue-fusion benchmarking, no
FX-graph cache (every GEMM is tuned in this run).

Usage: python -m benchmarks.inductor [--tokens 16 2048] [--models mlp attn] [--budget-s 210]
Writes benchmarks/results/inductor_h200.json (rows per model and token count: nvfly_ms, inductor_ms, ...).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nvfly.torch  # noqa: E402
from benchmarks.common import bench_ms, geomean, rel_err, write_results  # noqa: E402
from nvfly.torch.gemm_ops import clear_decisions, decisions  # noqa: E402

HIDDEN, INTER, HEAD, Q_HEADS, KV_HEADS = 4096, 14336, 128, 32, 8


class MLP(torch.nn.Module):
    """Llama's feed-forward block: gate, up and down projections with SiLU."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.up = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.down = torch.nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class AttentionProjections(torch.nn.Module):
    """Llama's attention projections without the attention between them: qkv, then o on the queries."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD, bias=False)
        self.o = torch.nn.Linear(Q_HEADS * HEAD, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, kv = self.qkv(x).split([Q_HEADS * HEAD, 2 * KV_HEADS * HEAD], dim=-1)
        return self.o(q), kv


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"mlp": MLP, "attn": AttentionProjections}


def autotune_patches(max_mm_configs: int) -> dict[str, Any]:
    import torch._inductor.config as cfg
    patches: dict[str, Any] = {"fx_graph_cache": False, "max_autotune_gemm_backends": "ATEN,TRITON",
                               "benchmark_epilogue_fusion": False}
    if hasattr(cfg.test_configs, "max_mm_configs"):  # fewer Triton configs per GEMM
        patches["test_configs.max_mm_configs"] = max_mm_configs
    return patches


def first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def compile_and_run(model: torch.nn.Module, x: torch.Tensor, with_nvfly: bool,
                    max_candidates: int) -> tuple[Callable[[], Any], torch.Tensor, float]:
    """(timed call, first output, compile seconds) of max-autotune with or without nvfly."""
    torch._dynamo.reset()  # a fresh compile: nothing reused from the other configuration
    if with_nvfly:
        nvfly.torch.install(max_candidates=max_candidates)
    else:
        nvfly.torch.uninstall()
    clear_decisions()
    fn = torch.compile(model, mode="max-autotune")
    t0 = time.perf_counter()
    out = first(fn(x)).clone()  # CUDA-graph replays overwrite outputs
    torch.cuda.synchronize()
    return lambda: fn(x), out, time.perf_counter() - t0


def backend(label: str | None) -> str | None:
    """"nvfly", "aten" or "triton" for a choice's label ("nvfly auto", "aten mm", "triton_mm_7")."""
    return label.replace("_", " ").split(" ")[0] if label else None


def kernel_only_ms(m: int, n: int, k: int) -> dict[str, float]:
    """GPU time of the kernels alone (torch.profiler) of nvfly's and cuBLAS's GEMM for one shape in the
    F.linear layout (A row-major, B = W^T): Inductor's timing of a choice also counts its per-call host path."""
    from benchmarks.device_time import kernel_times
    from nvfly.ops import gemm
    a = torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(n, k, device="cuda").bfloat16().t()
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    return {"nvfly": sum(kernel_times(lambda: gemm.matmul(a, b, out=y)).values()) / 1e3,
            "cublas": sum(kernel_times(lambda: torch.mm(a, b, out=y)).values()) / 1e3}


def winners() -> list[dict[str, Any]]:
    """Per GEMM tuned with nvfly installed: shape, candidates, every backend's time, the winner, and the
    kernels' own times outside Inductor."""
    rows = []
    for d in decisions():
        if d.where != "inductor":
            continue
        nvfly_times = {k: v for k, v in d.timings_ms.items() if k.startswith("nvfly")}
        rows.append({"op": d.op, "shape_bmnk": list(d.shape), "winner": d.winner, "declined": d.reason,
                     "backend": backend(d.winner),
                     "best_nvfly_ms": min(nvfly_times.values()) if nvfly_times else None,
                     "best_other_ms": min((v for k, v in d.timings_ms.items() if k not in nvfly_times),
                                          default=None),
                     "timings_ms": d.timings_ms,
                     "kernel_only_ms": kernel_only_ms(*d.shape[1:]) if d.shape[0] == 1 and not d.reason else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 2048])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mlp", "attn"])
    p.add_argument("--max-candidates", type=int, default=4, help="nvfly configs per GEMM")
    p.add_argument("--max-mm-configs", type=int, default=6, help="Triton configs per GEMM")
    p.add_argument("--budget-s", type=float, default=210, help="skip the remaining cases after this long")
    args = p.parse_args(argv)
    import torch._inductor.config as inductor_config

    t_start = time.time()
    rows: list[dict[str, Any]] = []
    skipped = []
    torch.manual_seed(0)
    with inductor_config.patch(autotune_patches(args.max_mm_configs)), torch.no_grad():
        for name in args.models:
            model = MODELS[name]().cuda().bfloat16().eval()
            reference = MODELS[name]().cuda().float().eval()
            reference.load_state_dict(model.state_dict())
            for tokens in args.tokens:
                if time.time() - t_start > args.budget_s:
                    skipped.append(f"{name}@{tokens}")
                    continue
                x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
                eager = first(model(x))
                ref = first(reference(x.float()))
                row: dict[str, Any] = {"model": f"llama3-8b-{name}", "tokens": tokens, "dtype": "bf16",
                                       "eager_ms": bench_ms(lambda: model(x))}
                for label, with_nvfly in (("inductor", False), ("nvfly", True)):
                    call, out, compile_s = compile_and_run(model, x, with_nvfly, args.max_candidates)
                    row[f"{label}_ms"] = bench_ms(call)
                    row[f"{label}_compile_s"] = compile_s
                    row[f"{label}_rel_err"] = rel_err(out, ref)
                    row[f"{label}_vs_eager_rel_err"] = rel_err(out, eager)
                row["gemms"] = winners()
                row["runtime_fallbacks"] = [d.reason for d in decisions() if d.where == "op"]  # should be empty
                nvfly.torch.uninstall()
                row["speedup_vs_inductor"] = row["inductor_ms"] / row["nvfly_ms"]
                row["same_as_eager"] = max(row["inductor_vs_eager_rel_err"], row["nvfly_vs_eager_rel_err"]) < 2e-2
                rows.append(row)
                won = ", ".join(f"{g['op']}{g['shape_bmnk'][1:]}: {g['winner']}" for g in row["gemms"])
                print(f"{row['model']:>18} x{tokens:<5} eager {row['eager_ms']:.4f} ms  inductor "
                      f"{row['inductor_ms']:.4f} ms  with nvfly {row['nvfly_ms']:.4f} ms "
                      f"(x{row['speedup_vs_inductor']:.2f}, err {row['nvfly_rel_err']:.1e}"
                      f"{'' if row['same_as_eager'] else ' MISMATCH'})  compile {row['inductor_compile_s']:.0f}s/"
                      f"{row['nvfly_compile_s']:.0f}s  winners: {won}", flush=True)
    gemms = [g for r in rows for g in r["gemms"]]
    summary = {"geomean_speedup_vs_inductor": geomean([r["speedup_vs_inductor"] for r in rows]),
               "gemms_won_by_nvfly": sum(1 for g in gemms if (g["winner"] or "").startswith("nvfly")),
               "gemms_tuned": len(gemms), "all_same_as_eager": all(r["same_as_eager"] for r in rows),
               "skipped_for_time": skipped, "seconds": time.time() - t_start}
    print(summary)
    print("wrote", write_results("inductor", rows, {"summary": summary}))
    return 0 if summary["all_same_as_eager"] else 1


if __name__ == "__main__":
    sys.exit(main())
