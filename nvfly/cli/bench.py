"""``nvfly bench [SUITE [ARGS...]]``: list the benchmark suites, or run one.

The suites are developer tools that live in a checkout's ``benchmarks/`` (they write their results, a JSON file
and a plot, to its ``benchmarks/results/``, next to the numbers the README quotes), so they are not shipped in
the wheel: ``nvfly bench SUITE`` runs ``python -m benchmarks.SUITE ARGS`` in the checkout it is run from (or the
one nvfly is installed from, with ``pip install -e``). Every suite times kernels, so every one needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from nvfly.cli.usage import UsageError, help_text

# suite -> what it measures; each is benchmarks/<suite>.py in a checkout
SUITES = {
    "gemm": "GEMM vs cuBLAS and Inductor's Triton templates on the anchor shapes",
    "rmsnorm": "RMSNorm forward and backward vs eager torch and Inductor",
    "topk": "TopK vs torch.topk on sampling and MoE-routing shapes",
    "grouped": "grouped GEMM (MoE) vs torch._grouped_mm and Inductor's Triton grouped mm (--quick: anchors)",
    "scaled": "FP8 scaled GEMM (tensor/row-wise, 1x128 x 128x128 blocks) vs cuBLAS _scaled_mm, Triton and bf16",
    "attention": "decode attention (--decode) vs SDPA's backends and flex_attention, in TB/s",
    "models": "Llama-3-8B layer (prefill, decode, training), MiniMax decode, DeepSeek prefill: eager vs routed",
    "inductor": "torch.compile max-autotune with nvfly installed vs without, on Llama-sized blocks",
    "launch_overhead": "host time of a cached launch: nvfly vs Triton and torch",
    "routing_overhead": "host time of an eager call under nvfly.torch.routing(): plain, switched off, routed",
    "device_time": "where a call's time goes: kernels vs host",
    "host_profile": "cProfile of the host side of a call",
    "gemm_configs": "GEMM configs side by side on a few shapes (tuning aid)",
    "gemm_skinny_configs": "skinny-GEMM configs on decode shapes (tuning aid)",
    "profile_cases": "one workload inside a profiler window, for Nsight Compute",
}


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("bench", help="list the benchmark suites, or run one (needs a GPU)",
                                 description=help_text(__doc__))
    parser.add_argument("suite", nargs="?", help="the suite to run; leave out to list them")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the suite's own options (see SUITE --help)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.suite is None:
        _list_suites()
        return 0
    if args.suite not in SUITES:
        raise UsageError("nvfly bench", f"no suite named {args.suite!r} (suites: {', '.join(SUITES)})")
    import nvfly
    if not nvfly.gpu_available():
        raise UsageError("nvfly bench", f"suite {args.suite!r} times kernels on a GPU, and no CUDA GPU is usable "
                                        "here (nvfly demo and nvfly explain work without one)")
    checkout = find_checkout()
    if checkout is None:
        raise UsageError("nvfly bench", "the suites run from a nvfly checkout (git clone it, cd into it, "
                                        "pip install -e '.[bench]'); none was found here")
    return subprocess.run([sys.executable, "-m", f"benchmarks.{args.suite}", *args.args], cwd=checkout).returncode


def find_checkout() -> Optional[Path]:
    """The nvfly checkout holding ``benchmarks/``: the working directory or a folder above it, else the one nvfly
    is imported from (an editable install)."""
    here = Path.cwd().resolve()
    package_root = Path(__file__).resolve().parents[2]
    for folder in [here, *here.parents, package_root]:
        if (folder / "benchmarks" / "common.py").is_file() and (folder / "nvfly").is_dir():
            return folder
    return None


def _list_suites() -> None:
    console = Console(highlight=False)
    table = Table(title="benchmark suites (each needs a CUDA GPU): nvfly bench SUITE [--help]", title_justify="left")
    table.add_column("suite", overflow="fold")
    table.add_column("what it measures", overflow="fold")
    for name, summary in SUITES.items():
        table.add_row(name, summary)
    console.print(table)
    checkout = find_checkout()
    console.print(f"Suites run from the checkout at {checkout}." if checkout else
                  "Suites run from a nvfly checkout (they write to its benchmarks/results/); none was found here.")
