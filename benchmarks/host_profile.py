"""Where the host time of a call goes: cProfile over many calls of each case of benchmarks/device_time.py.

Usage: python -m benchmarks.host_profile [--cases gemm] [--calls 2000] [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.device_time import cases  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="rmsnorm,topk,gemm")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for name, run_nvfly, _ in cases(set(args.cases.split(","))):
        run_nvfly()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            run_nvfly()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        print(f"==== {name}: {args.calls} calls\n{text.getvalue()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
