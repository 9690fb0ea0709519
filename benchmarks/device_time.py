"""Where a call's time goes: do_bench median vs the GPU time of its kernels (torch.profiler) vs host time.

A do_bench median far above the kernels' own time means the call waits on the host (Python, launches,
allocations, syncs) or on something outside its kernels; this tells which.
Usage: python -m benchmarks.device_time [--cases rmsnorm,topk,gemm]
Writes benchmarks/results/device_time_h200.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_ms, write_results  # noqa: E402


def kernel_times(fn: Callable[[], Any], calls: int = 20) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:80]] += event.device_time_total / calls if hasattr(event, "device_time_total") \
                else event.cuda_time_total / calls
    return dict(totals)


def host_us(fn: Callable[[], Any], calls: int = 200) -> float:
    """Host microseconds per call, the GPU left to run behind."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def cases(which: set[str]) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """(name, nvfly call, torch call) per case."""
    out = []
    if "rmsnorm" in which:
        from nvfly.ops import rmsnorm
        for m, n in ((256, 2048), (256, 4096), (256, 8192), (16384, 2048), (32, 4096)):
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            out.append((f"rmsnorm {m}x{n}", lambda x=x, w=w: rmsnorm.rms_norm(x, w, 1e-6),
                        lambda x=x, w=w, n=n: torch.nn.functional.rms_norm(x, (n,), w, 1e-6)))
    if "topk" in which:
        from nvfly.ops import topk
        for m, n, k in ((64, 128, 8), (4096, 128, 2), (4096, 128, 8), (1, 151936, 1024), (1, 128256, 50)):
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            out.append((f"topk {m}x{n} k{k}", lambda x=x, k=k: topk.topk(x, k),
                        lambda x=x, k=k: torch.topk(x, k)))
    if "gemm" in which:
        from nvfly.ops import gemm
        for m, n, k in ((1, 4096, 4096), (16, 4096, 4096), (64, 6144, 4096), (336, 4104, 1024)):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
            out.append((f"gemm {m}x{n}x{k}", lambda a=a, b=b: gemm.matmul(a, b), lambda a=a, b=b: a @ b))
    if "gemm_op" in which:  # through the op Inductor's code calls, with a Llama attention block's operands
        import nvfly.torch  # noqa: F401  (defines torch.ops.nvfly)
        for m, n, k, lead in ((2048, 4096, 4096, 6144), (2048, 6144, 4096, 4096), (16, 6144, 4096, 4096),
                              (2048, 14336, 4096, 4096)):
            a = torch.randn(m, lead, device="cuda", dtype=torch.bfloat16)[:, :k]
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            out.append((f"nvfly::mm_out {m}x{n}x{k} lda {lead}",
                        lambda a=a, b=b, y=y: torch.ops.nvfly.mm_out(a, b, y, config="auto"),
                        lambda a=a, b=b, y=y: torch.mm(a, b, out=y)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="rmsnorm,topk,gemm")
    args = parser.parse_args(argv)
    rows = []
    for name, run_nvfly, run_torch in cases(set(args.cases.split(","))):
        row: dict[str, Any] = {"case": name}
        for who, fn in (("nvfly", run_nvfly), ("torch", run_torch)):
            kernels = kernel_times(fn)
            row[f"{who}_bench_us"] = bench_ms(fn) * 1e3
            row[f"{who}_kernel_us"] = sum(kernels.values())
            row[f"{who}_host_us"] = host_us(fn)
            row[f"{who}_kernels"] = kernels
        print(f"{name:28s} nvfly bench {row['nvfly_bench_us']:7.1f} kernels {row['nvfly_kernel_us']:7.1f} "
              f"host {row['nvfly_host_us']:6.1f} | torch bench {row['torch_bench_us']:7.1f} kernels "
              f"{row['torch_kernel_us']:7.1f} host {row['torch_host_us']:6.1f} | {row['nvfly_kernels']}", flush=True)
        rows.append(row)
    print("results:", write_results("device_time", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
