"""Time GEMM configs side by side on a few shapes (tuning aid): python -m benchmarks.gemm_configs"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_ms, rel_err  # noqa: E402
from nvfly.ops import gemm  # noqa: E402
from nvfly.ops.gemm_kernel import GemmConfig  # noqa: E402

SHAPES = [(8192, 8192, 8192), (4096, 32768, 512), (1024, 7168, 2048), (4096, 4096, 4096), (4096, 24576, 1536)]
CONFIGS = [GemmConfig(128, 256, 4, 2), GemmConfig(128, 256, 3, 2), GemmConfig(128, 256, 4, 2, cluster_m=2),
           GemmConfig(128, 128, 6, 2, pingpong=True), GemmConfig(64, 256, 5, 2, pingpong=True),
           GemmConfig(128, 128, 4, 2, pingpong=True)]


def main(argv=None) -> int:
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
        ref = a.float() @ b.float()
        cublas = bench_ms(lambda: torch.mm(a, b))
        line = [f"{m}x{n}x{k}: cuBLAS {2 * m * n * k / cublas / 1e9:.0f}"]
        for cfg in CONFIGS:
            out = gemm.matmul(a, b, config=cfg)
            assert rel_err(out, ref) < 1e-2
            ms = bench_ms(lambda: gemm.matmul(a, b, config=cfg, out=out))
            line.append(f"{cfg.bm}x{cfg.bn}s{cfg.stages}c{cfg.cluster_m}{'pp' if cfg.pingpong else ''} "
                        f"{2 * m * n * k / ms / 1e9:.0f}")
        print(" | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
