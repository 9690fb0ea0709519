"""Run one named workload a few times inside a profiler window, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --target-processes all --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python -m benchmarks.profile_cases CASE

Each case is warmed up (compilation, autotuning and first launches outside the window), checked against a float32
reference, then launched ``--repeat`` times between ``cudaProfilerStart`` and ``cudaProfilerStop`` so that only
those launches are profiled. ``--list`` names the cases."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import rel_err  # noqa: E402


def _gemm(m: int, n: int, k: int, layout: str, cublas: bool = False) -> Callable[[], torch.Tensor]:
    """nvfly's matmul (or, with ``cublas``, torch.mm: the peer to profile beside it) of one layout."""
    from benchmarks.gemm_skinny_configs import tokens
    from nvfly.ops import gemm
    a = tokens(m, k, "row" if layout[:3] == "row" else "col")
    b = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    b = b.t() if layout[-3:] == "col" else b.t().contiguous()
    ref = a.float() @ b.float()
    run = (lambda: torch.mm(a, b)) if cublas else (lambda: gemm.matmul(a, b))
    assert rel_err(run(), ref) < 1e-2
    return run


def _rmsnorm(m: int, n: int, inductor: bool) -> Callable[[], torch.Tensor]:
    from nvfly.ops import rmsnorm
    x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, device="cuda").to(torch.bfloat16)
    ref = torch.nn.functional.rms_norm(x.float(), (n,), w.float(), 1e-6)
    if inductor:
        fn = torch.compile(lambda x, w: torch.nn.functional.rms_norm(x, (n,), w, 1e-6), dynamic=False)
        run = lambda: fn(x, w)  # noqa: E731
    else:
        run = lambda: rmsnorm.rms_norm(x, w, 1e-6)  # noqa: E731
    assert rel_err(run(), ref) < 1e-2
    return run


def _topk(m: int, n: int, k: int) -> Callable[[], tuple]:
    from nvfly.ops import topk
    x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    values, _ = topk.topk(x, k)
    assert torch.equal(values, torch.topk(x, k).values)
    return lambda: topk.topk(x, k)


CASES: dict[str, Callable[[], Callable]] = {
    "gemm-colxcol-16x4096x14336": lambda: _gemm(16, 4096, 14336, "colxcol"),
    "gemm-rowxcol-16x4096x14336": lambda: _gemm(16, 4096, 14336, "rowxcol"),
    "gemm-colxrow-16x4096x14336": lambda: _gemm(16, 4096, 14336, "colxrow"),
    "gemm-rowxrow-16x4096x14336": lambda: _gemm(16, 4096, 14336, "rowxrow"),
    "gemm-rowxcol-336x4104x1024": lambda: _gemm(336, 4104, 1024, "rowxcol"),
    "gemm-rowxcol-336x4104x1024-cublas": lambda: _gemm(336, 4104, 1024, "rowxcol", cublas=True),
    # the weak class of 2026-11-29 (M 256-1024, a partial last wave) and the unsteady 8192^3 colxcol, with cuBLAS
    "gemm-rowxcol-336x6144x4096": lambda: _gemm(336, 6144, 4096, "rowxcol"),
    "gemm-rowxcol-336x6144x4096-cublas": lambda: _gemm(336, 6144, 4096, "rowxcol", cublas=True),
    "gemm-rowxcol-1024x2112x7168": lambda: _gemm(1024, 2112, 7168, "rowxcol"),
    "gemm-rowxcol-1024x2112x7168-cublas": lambda: _gemm(1024, 2112, 7168, "rowxcol", cublas=True),
    "gemm-colxcol-8192x8192x8192": lambda: _gemm(8192, 8192, 8192, "colxcol"),
    "gemm-colxcol-8192x8192x8192-cublas": lambda: _gemm(8192, 8192, 8192, "colxcol", cublas=True),
    # M = 64 with split K (2026-11-30): the main kernel and its reduce beside cuBLAS's single kernel
    "gemm-rowxcol-64x4096x4096": lambda: _gemm(64, 4096, 4096, "rowxcol"),
    "gemm-rowxcol-64x4096x4096-cublas": lambda: _gemm(64, 4096, 4096, "rowxcol", cublas=True),
    "gemm-rowxcol-64x2112x7168": lambda: _gemm(64, 2112, 7168, "rowxcol"),  # split K 4: the vectorised reduce
    "gemm-rowxcol-64x2112x7168-cublas": lambda: _gemm(64, 2112, 7168, "rowxcol", cublas=True),
    # the 0.89-0.94x band of short kernels (2026-11-30): swapped K = 512, and M = 128 on 64x128 tiles
    "gemm-rowxrow-64x32768x512": lambda: _gemm(64, 32768, 512, "rowxrow"),
    "gemm-rowxrow-64x32768x512-cublas": lambda: _gemm(64, 32768, 512, "rowxrow", cublas=True),
    "gemm-colxcol-128x7168x2048": lambda: _gemm(128, 7168, 2048, "colxcol"),
    "gemm-colxcol-128x7168x2048-cublas": lambda: _gemm(128, 7168, 2048, "colxcol", cublas=True),
    # the swapped kernel streaming weights (2026-11-30: ~3.6 TB/s against cuBLAS's ~4.0)
    "gemm-rowxcol-64x10240x8192": lambda: _gemm(64, 10240, 8192, "rowxcol"),
    "gemm-rowxcol-64x10240x8192-cublas": lambda: _gemm(64, 10240, 8192, "rowxcol", cublas=True),
    "rmsnorm-16384x2048": lambda: _rmsnorm(16384, 2048, False),
    "rmsnorm-16384x2048-inductor": lambda: _rmsnorm(16384, 2048, True),
    "rmsnorm-16384x7168": lambda: _rmsnorm(16384, 7168, False),
    "rmsnorm-16384x7168-inductor": lambda: _rmsnorm(16384, 7168, True),
    "rmsnorm-256x7168": lambda: _rmsnorm(256, 7168, False),
    "rmsnorm-256x7168-inductor": lambda: _rmsnorm(256, 7168, True),
    "rmsnorm-16384x8192": lambda: _rmsnorm(16384, 8192, False),
    "rmsnorm-16384x8192-inductor": lambda: _rmsnorm(16384, 8192, True),
    "topk-1x151936-k1024": lambda: _topk(1, 151936, 1024),
    "topk-1x151936-k50": lambda: _topk(1, 151936, 50),
    "topk-64x151936-k1024": lambda: _topk(64, 151936, 1024),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", nargs="?", choices=sorted(CASES))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    if args.list or not args.case:
        print("\n".join(sorted(CASES)))
        return 0
    torch.manual_seed(0)
    run = CASES[args.case]()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.repeat):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
