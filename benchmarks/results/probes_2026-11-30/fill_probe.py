"""Probe: small-M tiles that put one block on (nearly) every SM, against the swapped default, with and without
L2 eviction hints, side by side with cuBLAS (do_bench cold L2 / CUDA graph warm)."""
import math
import statistics
import sys
from dataclasses import replace

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, graph_ms, rel_err  # noqa: E402
from benchmarks.gemm_configs import operand  # noqa: E402
from nvfly.ops import gemm  # noqa: E402
from nvfly.ops.gemm_kernel import GemmConfig  # noqa: E402

SHAPES = [(64, 10240, 8192), (64, 32768, 512), (64, 24576, 1536), (64, 28672, 4096), (64, 6144, 4096),
          (32, 32768, 512), (48, 14336, 4096), (64, 4096, 4096), (64, 2112, 7168), (128, 7168, 2048),
          (128, 4096, 4096), (128, 6144, 4096), (16, 4096, 14336)]
LAYOUTS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["rowxcol", "rowxrow"]
SMS = 132


def fill_tile(m, n, b_major, bm):
    row_tiles = math.ceil(m / bm)
    step = 8 if b_major == "K" else 16
    bn = min(256, step * math.ceil(n / (step * (SMS // row_tiles))))
    cfg = GemmConfig(bm, bn, gemm.MAX_STAGES, 1 if bm == 64 else 2, tma_store=bn % 16 == 0, store_buffers=1)
    return gemm.deepest_ring(cfg, 2, b_major)


def variants(m, n, k, b_major):
    out = [("default", None, None)]
    if m <= 64:
        out.append(("swapH", replace(gemm.small_m_config(m, n, k, 1, 2, SMS), streamed="A"), True))
    for bm in ((64,) if m <= 64 else (128, 64)):
        cfg = fill_tile(m, n, b_major, bm)
        if cfg is not None:
            tag = f"{cfg.bm}x{cfg.bn}s{cfg.stages}"
            out.append((tag, cfg, False))
            out.append((tag + "H", replace(cfg, streamed="B"), False))
    return out


for layout in LAYOUTS:
    am, bmj = layout.split("x")
    for m, n, k in SHAPES:
        a, b = operand(m, k, am), operand(k, n, bmj)
        ref = a.float() @ b.float()
        vs = variants(m, n, k, "K" if bmj == "col" else "MN")
        times = {name: [] for name, _, _ in vs}
        gtimes = {name: [] for name, _, _ in vs}
        paths = {}
        cub, gcub = [], []
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        for rnd in range(3):
            cub.append(bench_ms(lambda: torch.mm(a, b)))
            gcub.append(graph_ms(lambda: torch.mm(a, b), calls=16, replays=10))
            for name, cfg, swap in vs:
                kw = dict(config=cfg, swap=swap) if cfg is not None else {}
                try:
                    out.fill_(float("nan"))
                    gemm.matmul(a, b, out=out, **kw)
                except Exception as e:  # noqa: BLE001
                    times[name].append(float("nan"))
                    gtimes[name].append(float("nan"))
                    paths[name] = f"failed: {e}"[:100]
                    continue
                err = rel_err(out, ref)
                assert err < 1e-2, (layout, m, n, k, name, err)
                paths[name] = gemm.path(a, b, **kw)
                times[name].append(bench_ms(lambda: gemm.matmul(a, b, out=out, **kw)))
                gtimes[name].append(graph_ms(lambda: gemm.matmul(a, b, out=out, **kw), calls=16, replays=10))
        c, gc = statistics.median(cub), statistics.median(gcub)
        cells = [f"{layout} {m}x{n}x{k}: cuBLAS {c * 1e3:.1f}/{gc * 1e3:.1f} us"]
        for name, _, _ in vs:
            t, g = statistics.median(times[name]), statistics.median(gtimes[name])
            cells.append(f"{name}[{paths[name]}] {t * 1e3:.1f}/{g * 1e3:.1f} ({c / t:.3f}/{gc / g:.3f})")
        print(" | ".join(cells), flush=True)
