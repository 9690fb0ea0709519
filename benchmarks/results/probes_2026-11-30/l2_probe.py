"""Probe: TMA L2 promotion (128 / 256 / none) and eviction hints on the GEMM band, side by side with cuBLAS."""
import statistics
import sys
from dataclasses import replace

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, graph_ms, rel_err  # noqa: E402
from benchmarks.gemm_configs import operand  # noqa: E402
from nvfly.ops import gemm  # noqa: E402

SHAPES = [(64, 32768, 512), (64, 24576, 1536), (64, 10240, 8192), (64, 28672, 4096), (64, 6144, 4096),
          (32, 32768, 512), (48, 14336, 4096), (128, 7168, 2048), (336, 4104, 1024), (1024, 7168, 2048),
          (4096, 4096, 4096), (8192, 8192, 8192)]
if len(sys.argv) > 1:
    SHAPES = [tuple(int(x) for x in s.split("x")) for s in sys.argv[1].split(",")]
LAYOUTS = ["rowxcol", "rowxrow"]


def variants(m, n, k):
    swapped = m <= 64 < n
    out = [("p128", 128, None), ("p256", 256, None), ("none", 0, None)]
    if swapped:
        cfg = replace(gemm.small_m_config(m, n, k, 1, 2, 132), stream_a=True)
        out += [("hint", 128, cfg), ("hint256", 256, cfg)]
    return out, swapped


for layout in LAYOUTS:
    am, bm = layout.split("x")
    for m, n, k in SHAPES:
        a, b = operand(m, k, am), operand(k, n, bm)
        ref = a.float() @ b.float()
        vs, swapped = variants(m, n, k)
        times = {name: [] for name, _, _ in vs}
        gtimes = {name: [] for name, _, _ in vs}
        cub, gcub = [], []
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        for rnd in range(3):
            cub.append(bench_ms(lambda: torch.mm(a, b)))
            gcub.append(graph_ms(lambda: torch.mm(a, b), calls=16, replays=10))
            for name, promo, cfg in vs:
                gemm.TMA_L2_PROMOTION = promo
                gemm._CALLS.clear()
                kw = dict(config=cfg, swap=True) if cfg is not None else {}
                out.fill_(float("nan"))
                gemm.matmul(a, b, out=out, **kw)
                err = rel_err(out, ref)
                assert err < 1e-2, (layout, m, n, k, name, err)
                times[name].append(bench_ms(lambda: gemm.matmul(a, b, out=out, **kw)))
                gtimes[name].append(graph_ms(lambda: gemm.matmul(a, b, out=out, **kw), calls=16, replays=10))
        gemm.TMA_L2_PROMOTION = 128
        gemm._CALLS.clear()
        c, gc = statistics.median(cub), statistics.median(gcub)
        cells = [f"{layout} {m}x{n}x{k}: cuBLAS {c * 1e3:.1f}/{gc * 1e3:.1f} us"]
        for name, _, _ in vs:
            t, g = statistics.median(times[name]), statistics.median(gtimes[name])
            cells.append(f"{name} {t * 1e3:.1f}/{g * 1e3:.1f} ({c / t:.3f}/{gc / g:.3f})")
        print(" | ".join(cells), flush=True)
