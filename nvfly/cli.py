"""``nvfly`` command line: ``demo`` compiles (and, with a GPU, runs and checks) the examples and kernel library;
``bench SUITE`` runs a benchmark suite from ``benchmarks/``; ``explain M N K`` shows how a GEMM is served."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any, Callable

SASS_FEATURES = ("HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "SYNCS", "LDG.E.128", "STG.E.128", "SHFL", "MUFU",
                 "LDSM", "STSM", "LDGSTS", "HMMA", "BAR")


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo_cases() -> list[tuple[str, Callable[[str], list], Callable[[Any], tuple]]]:
    """(name, compile(target) -> kernels, run(device) -> (max_abs_err, tolerance)) for each example."""
    import torch
    sys.path.insert(0, _project_root())
    from examples import softmax, tiled_transpose, vector_add

    def add_inputs(device: Any) -> tuple:
        x = torch.randn(1 << 20, device=device).to(torch.bfloat16)
        return x, torch.randn_like(x)

    def softmax_inputs(device: Any) -> tuple:
        return (torch.randn(512, 4096, device=device).to(torch.bfloat16),)

    def transpose_inputs(device: Any) -> tuple:
        return (torch.randn(1000, 777, device=device),)

    def check(fn: Callable, ref: Callable, make: Callable, tol: float) -> Callable:
        def run(device: Any) -> tuple:
            args = make(device)
            out = fn(*args)
            torch.cuda.synchronize()
            err = (out.float() - ref(*args).float()).abs().max().item()
            return err, tol
        return run

    from nvfly.jit import compile_only
    from nvfly.ops import gemm, rmsnorm, topk
    from nvfly.ops.gemm import api, plan, skinny_plan

    def compiled(fn: Callable, make: Callable, target: str) -> list:
        with compile_only(target) as kernels:
            fn(*make("cpu"))
        return kernels

    def gemm_inputs(device: Any) -> tuple:
        return (torch.randn(2048, 4096, device=device).to(torch.bfloat16),
                torch.randn(4096, 4096, device=device).to(torch.bfloat16))

    def decode_inputs(device: Any) -> tuple:  # 16 tokens through an F.linear weight: the skinny kernel
        return (torch.randn(16, 4096, device=device).to(torch.bfloat16),
                torch.randn(14336, 4096, device=device).to(torch.bfloat16).t())

    def rmsnorm_inputs(device: Any) -> tuple:
        return torch.randn(4096, 8192, device=device).to(torch.bfloat16), torch.randn(8192, device=device).to(
            torch.bfloat16)

    def topk_inputs(device: Any) -> tuple:
        return torch.randn(4096, 256, device=device).to(torch.bfloat16), 8

    def rms_ref(x: Any, w: Any) -> Any:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()

    def gemm_compile(t: str) -> list:
        a, b = gemm_inputs("cpu")
        cfg = plan.default_config(a.shape[0], b.shape[1], a.shape[1])
        return api.compile_configs([cfg], majors=[("K", "MN")], target=t)

    return [
        ("gemm (library)", gemm_compile,
         check(lambda a, b: gemm.matmul(a, b), lambda a, b: a.float() @ b.float(), gemm_inputs, 2.0)),
        ("gemm decode (library)", lambda t: [skinny_plan.compile_kernel(16, 4096, 14336, target=t)],
         check(lambda a, b: gemm.matmul(a, b), lambda a, b: a.float() @ b.float(), decode_inputs, 2.0)),
        ("rmsnorm (library)", lambda t: compiled(lambda x, w: rmsnorm.rms_norm(x, w, 1e-6), rmsnorm_inputs, t),
         check(lambda x, w: rmsnorm.rms_norm(x, w, 1e-6), rms_ref, rmsnorm_inputs, 5e-2)),
        ("topk (library)", lambda t: compiled(topk.topk, topk_inputs, t),
         check(lambda x, k: topk.topk(x, k)[0], lambda x, k: torch.topk(x, k)[0], topk_inputs, 0.0)),
        ("vector_add", lambda t: vector_add.add.compile(*add_inputs("cpu"), target=t),
         check(vector_add.add, lambda x, y: x + y, add_inputs, 0.0)),
        ("softmax", lambda t: softmax.softmax.compile(*softmax_inputs("cpu"), target=t),
         check(softmax.softmax, lambda x: torch.softmax(x.float(), -1), softmax_inputs, 1e-2)),
        ("tiled_transpose", lambda t: tiled_transpose.transpose.compile(*transpose_inputs("cpu"), target=t),
         check(tiled_transpose.transpose, lambda x: x.t(), transpose_inputs, 0.0)),
    ]


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    import nvfly
    console = Console()
    gpu = nvfly.gpu_available()
    console.print(f"nvfly {nvfly.__version__}: target {args.target}; GPU: "
                  f"{'yes, compiling, running and checking' if gpu else 'no, compiling only'}")
    table = Table(title="kernels")
    for col in ("example", "kernel", "regs", "spills", "smem", "SASS features", "compile s", "check"):
        table.add_column(col)
    failures = 0
    for name, compile_fn, run_fn in demo_cases():
        t0 = time.perf_counter()
        kernels = compile_fn(args.target)
        dt = time.perf_counter() - t0
        verdict = "-"
        if gpu:
            err, tol = run_fn("cuda")
            ok = err <= tol
            failures += not ok
            verdict = f"{'ok' if ok else 'FAIL'} (max err {err:.2e})"
        for k in kernels:
            ops = k.sass_opcodes()
            feats = ", ".join(f"{f}×{n}" for f in SASS_FEATURES
                              if (n := sum(c for op, c in ops.items() if op == f or op.startswith(f + "."))))
            table.add_row(name, k.name, str(k.resources.registers),
                          str(k.resources.spill_stores + k.resources.spill_loads),
                          str(k.resources.static_smem_bytes + k.dynamic_smem_bytes), feats, f"{dt:.2f}", verdict)
    console.print(table)
    return 1 if failures else 0


def cmd_bench(args: argparse.Namespace) -> int:
    sys.path.insert(0, _project_root())
    module = importlib.import_module(f"benchmarks.{args.suite}")
    return int(module.main(args.rest) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nvfly", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile the examples (and run them on a GPU); report SASS features")
    demo.add_argument("--target", default="sm_90a")
    bench = sub.add_parser("bench", help="run benchmarks/<suite>.py")
    bench.add_argument("suite")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    explain = sub.add_parser("explain", add_help=False,
                             help="for a GEMM shape: nvfly's candidates, their times, the winner, why nvfly lost")
    explain.add_argument("rest", nargs=argparse.REMAINDER)
    args, unknown = parser.parse_known_args(argv)
    if args.command == "explain":  # its options (and --help) are nvfly.torch.explain's
        from nvfly.torch.explain import main as explain_main
        return explain_main(unknown + args.rest)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "demo":
        return cmd_demo(args)
    return cmd_bench(args)


if __name__ == "__main__":
    sys.exit(main())
