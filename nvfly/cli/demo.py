"""``nvfly demo``: compile the kernel library and three examples for a target (and, with a GPU, run each and
check it against torch), then say what the SASS shows: tensor-core and TMA instructions, 16-byte vector
accesses, no register spills."""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import nvfly
import nvfly.examples
from nvfly import settings
from nvfly.cli.usage import UsageError, help_text
from nvfly.compiler import toolchain
from nvfly.version import __version__

HOPPER = "sm_90a"
TARGETS = (HOPPER, "sm_80")  # the targets nvfly is built for: Hopper, and Ampere where it is cheap

# SASS instruction families the demo counts, and what each one shows
SASS_FAMILIES = {
    "HGMMA": "Hopper tensor cores (wgmma)",
    "HMMA": "tensor cores (mma.sync)",
    "UTMALDG": "TMA loads",
    "UTMASTG": "TMA stores",
    "LDG.E.128": "16-byte vector loads",
    "STG.E.128": "16-byte vector stores",
    "LDSM": "ldmatrix",
    "STSM": "stmatrix",
    "SHFL": "warp shuffles",
    "MUFU": "special-function unit (exp2, rsqrt)",
}
TENSOR_CORE = ("HGMMA", "HMMA")
TMA = ("UTMALDG", "UTMASTG")


@dataclass(frozen=True)
class DemoCase:
    """One thing the demo compiles: ``compile(target)`` returns its kernels; on a GPU, ``check()`` runs it and
    returns (max abs error against torch, tolerance)."""
    name: str
    shows: str
    compile: Callable[[str], list]
    check: Callable[[], tuple[float, float]]
    needs: Optional[str] = None  # the one target it compiles for, when it needs that chip's instructions


def demo_cases() -> list[DemoCase]:
    """The library's ops and three examples, each with the inputs it is compiled and checked on."""
    import torch

    from nvfly.examples import softmax, tiled_transpose, vector_add
    from nvfly.jit import compile_only
    from nvfly.ops import gemm, rmsnorm, topk
    from nvfly.ops.gemm import api, plan, skinny_plan

    def compiled_call(fn: Callable, make: Callable[[str], tuple]) -> Callable[[str], list]:
        """Compile the kernels a call of ``fn`` launches, without running them."""
        def compile_for(target: str) -> list:
            with compile_only(target) as kernels:
                fn(*make("cpu"))
            return kernels
        return compile_for

    def checked(fn: Callable, reference: Callable, make: Callable[[str], tuple],
                tolerance: float) -> Callable[[], tuple[float, float]]:
        def check() -> tuple[float, float]:
            args = make("cuda")
            out = fn(*args)
            torch.cuda.synchronize()
            return (out.float() - reference(*args).float()).abs().max().item(), tolerance
        return check

    def bf16(*shape: int, device: str) -> Any:
        return torch.randn(*shape, device=device).to(torch.bfloat16)

    def gemm_inputs(device: str) -> tuple:
        return bf16(2048, 4096, device=device), bf16(4096, 4096, device=device)

    def decode_inputs(device: str) -> tuple:  # 16 tokens through an F.linear weight: the skinny kernel
        return bf16(16, 4096, device=device), bf16(14336, 4096, device=device).t()

    def rmsnorm_inputs(device: str) -> tuple:
        return bf16(4096, 8192, device=device), bf16(8192, device=device)

    def topk_inputs(device: str) -> tuple:
        return bf16(4096, 256, device=device), 8

    def add_inputs(device: str) -> tuple:
        return bf16(1 << 20, device=device), bf16(1 << 20, device=device)

    def softmax_inputs(device: str) -> tuple:
        return (bf16(512, 4096, device=device),)

    def transpose_inputs(device: str) -> tuple:
        return (torch.randn(1000, 777, device=device),)

    def gemm_compile(target: str) -> list:
        a, b = gemm_inputs("cpu")
        config = plan.default_config(a.shape[0], b.shape[1], a.shape[1])
        return api.compile_configs([config], majors=[("K", "MN")], target=target)

    def rms_reference(x: Any, w: Any) -> Any:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()

    def matmul_reference(a: Any, b: Any) -> Any:
        return a.float() @ b.float()

    return [
        DemoCase("gemm", "library GEMM 2048x4096x4096: TMA + wgmma, warp-specialised", gemm_compile,
                 checked(gemm.matmul, matmul_reference, gemm_inputs, 2.0), needs=HOPPER),
        DemoCase("gemm decode", "library GEMM for 16 tokens: mma.sync, memory-bound",
                 lambda target: [skinny_plan.compile_kernel(16, 4096, 14336, target=target)],
                 checked(gemm.matmul, matmul_reference, decode_inputs, 2.0)),
        DemoCase("rmsnorm", "library RMSNorm 4096x8192",
                 compiled_call(lambda x, w: rmsnorm.rms_norm(x, w, 1e-6), rmsnorm_inputs),
                 checked(lambda x, w: rmsnorm.rms_norm(x, w, 1e-6), rms_reference, rmsnorm_inputs, 5e-2)),
        DemoCase("topk", "library TopK, k=8 of 256 (MoE routing)", compiled_call(topk.topk, topk_inputs),
                 checked(lambda x, k: topk.topk(x, k)[0], lambda x, k: torch.topk(x, k)[0], topk_inputs, 0.0)),
        DemoCase("vector_add", "example: 16-byte vector loads and a tail",
                 lambda target: vector_add.add.compile(*add_inputs("cpu"), target=target),
                 checked(vector_add.add, lambda x, y: x + y, add_inputs, 0.0)),
        DemoCase("softmax", "example: warp shuffles and a block reduction",
                 lambda target: softmax.softmax.compile(*softmax_inputs("cpu"), target=target),
                 checked(softmax.softmax, lambda x: torch.softmax(x.float(), -1), softmax_inputs, 1e-2)),
        DemoCase("tiled_transpose", "example: a shared-memory tile",
                 lambda target: tiled_transpose.transpose.compile(*transpose_inputs("cpu"), target=target),
                 checked(tiled_transpose.transpose, lambda x: x.t(), transpose_inputs, 0.0)),
    ]


@dataclass
class KernelReport:
    """What the demo found in one compiled kernel."""
    case: str
    kernel: str
    registers: int
    spill_bytes: int
    smem_bytes: int
    sass: dict[str, int]  # instruction family -> count, for the families of SASS_FAMILIES present
    compile_s: float
    check: Optional[str]  # "ok (max err ...)" / "FAIL (...)" on a GPU, else None

    @staticmethod
    def of(case: str, kernel: Any, compile_s: float, check: Optional[str]) -> "KernelReport":
        r = kernel.resources
        counts = {family: n for family in SASS_FAMILIES if (n := kernel.count(family))}
        return KernelReport(case, kernel.name, r.registers, r.spill_stores + r.spill_loads,
                            r.static_smem_bytes + kernel.dynamic_smem_bytes, counts, round(compile_s, 3), check)


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("demo", help="compile the kernel library and examples; say what the SASS shows",
                                 description=help_text(__doc__))
    parser.add_argument("--target", choices=TARGETS,
                        help=f"compile target (default: NVFLY_ARCH, else {HOPPER}); on sm_80 the Hopper-only "
                             "kernels are listed, not compiled")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    target = args.target or settings.get("arch") or HOPPER
    if target not in TARGETS:
        raise UsageError("nvfly demo", f"NVFLY_ARCH={target} is not a demo target (choose from {', '.join(TARGETS)})")
    console = Console(stderr=args.json, highlight=False)  # with --json, stdout carries only the document
    console.print(f"nvfly {__version__} demo: compiling the kernel library and examples for {target}")
    started = time.perf_counter()
    with _progress(console) as progress:
        loading = progress.add_task("loading torch, MLIR and the kernel library", total=None)
        toolchain.require("ptxas")  # the demo reads SASS: without ptxas, say how to get it before compiling
        gpu = nvfly.gpu_available()
        cases = demo_cases()
        progress.remove_task(loading)
        task = progress.add_task("compiling", total=len(cases))
        reports: list[KernelReport] = []
        skipped: list[DemoCase] = []
        for case in cases:
            progress.update(task, description=f"compiling {case.name}, reading its SASS")
            if case.needs and case.needs != target:
                skipped.append(case)
                progress.advance(task)
                continue
            t0 = time.perf_counter()
            kernels = case.compile(target)
            compile_s = time.perf_counter() - t0
            verdict = _check(case) if gpu else None
            reports += [KernelReport.of(case.name, k, compile_s, verdict) for k in kernels]
            progress.advance(task)
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps({"version": __version__, "target": target, "gpu": gpu, "seconds": round(elapsed, 2),
                          "kernels": [vars(r) for r in reports],
                          "not_compiled": {c.name: f"{c.needs} only" for c in skipped}}, indent=1))
    else:
        console.print(_table(reports, gpu))
        for line in _summary(reports, skipped, target, gpu, elapsed):
            console.print(line, soft_wrap=True)  # whole lines: paths and commands stay unbroken
    return 1 if any(r.check and not r.check.startswith("ok") for r in reports) else 0


def _progress(console: Console) -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    transient=True, disable=not console.is_terminal)  # a log gets no bar, nor its blank line


def _check(case: DemoCase) -> str:
    err, tolerance = case.check()
    return f"{'ok' if err <= tolerance else 'FAIL'} (max err {err:.1e})"


def _table(reports: list[KernelReport], gpu: bool) -> Table:
    """One row per kernel, folded (never cut) to fit 80 columns."""
    table = Table(title="compiled kernels", title_justify="left")
    table.add_column("case / kernel", min_width=24, overflow="fold")  # the longest kernel name, unfolded
    for column, justify in (("regs", "right"), ("spills", "right"), ("smem", "right"), ("SASS highlights", "left")):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    if gpu:
        table.add_column("check", overflow="fold")
    for r in reports:
        row = [f"{r.case}\n[dim]{r.kernel}[/dim]", str(r.registers), str(r.spill_bytes), _kib(r.smem_bytes),
               ", ".join(f"{family}×{n}" for family, n in r.sass.items())]
        table.add_row(*row, *([r.check or ""] if gpu else []))
    return table


def _kib(size: int) -> str:
    return f"{size / 1024:.0f}K" if size >= 1024 else str(size)


def _summary(reports: list[KernelReport], skipped: list[DemoCase], target: str, gpu: bool,
             elapsed: float) -> list[str]:
    """The closing lines: what was compiled, what the SASS proves, what was left out, what to run next."""
    def where(families: tuple[str, ...]) -> str:
        found = [f"{family}×{r.sass[family]} in {r.case}" for r in reports for family in families
                 if family in r.sass]
        return ", ".join(found) or "none"

    spilling = sorted({r.case for r in reports if r.spill_bytes})
    vectorised = sorted({r.case for r in reports if "LDG.E.128" in r.sass or "STG.E.128" in r.sass})
    lines = [f"Compiled {len(reports)} kernels for {target} in {elapsed:.0f} s (ptxas, then cuobjdump for SASS).",
             f"Tensor cores: {where(TENSOR_CORE)}.",
             f"TMA: {where(TMA)}." if target == HOPPER else "TMA: Hopper only, not on this target.",
             f"16-byte vector accesses in {len(vectorised)} of {len({r.case for r in reports})} cases; "
             + (f"register spills in {', '.join(spilling)}." if spilling else "no kernel spills registers.")]
    if skipped:
        lines.append(f"{HOPPER} only, so not compiled for {target}: "
                     + ", ".join(f"{c.name} ({c.shows})" for c in skipped) + ".")
    if gpu:
        failed = [r.case for r in reports if r.check and not r.check.startswith("ok")]
        lines.append(f"Checked against torch on the GPU: {'FAILED: ' + ', '.join(failed) if failed else 'all ok'}.")
    else:
        lines.append("No GPU here, so nothing ran; on a GPU the demo also runs each kernel and checks it against "
                     "torch.")
    example = os.path.join(os.path.dirname(nvfly.examples.__file__), "vector_add.py")
    lines += ["Next: nvfly explain 16 4096 4096   how a GEMM shape is served",
              "      nvfly bench                  the benchmark suites",
              f"      {example}   a kernel to read"]
    return lines
