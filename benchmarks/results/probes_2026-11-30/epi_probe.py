"""M = 128 rows on 64-row tiles (register epilogue): the default beside the same tile with the TMA-store epilogue,
and a 128-row tile covering M as narrow as one wave allows; do_bench / CUDA graphs, ratios to cuBLAS."""
import math
import statistics
import sys
from dataclasses import replace

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tmp_device")
from benchmarks.common import bench_ms, graph_ms, rel_err  # noqa: E402
from benchmarks.gemm import FULL_SUITE  # noqa: E402
from modes import operand, plan_of, set_mode  # noqa: E402
from nvfly.ops import gemm  # noqa: E402
from nvfly.ops.gemm_kernel import GemmConfig  # noqa: E402

set_mode("new")
for m, n, k in FULL_SUITE:
    if m != 128:
        continue
    for layout in ("rowxcol", "rowxrow"):
        am, bmj = layout.split("x")
        p = plan_of(m, n, k, am, bmj, "new", device="cuda")
        if p is None or p.swap or p.config.tma_store or p.config.split_k != 1:
            continue
        major = p.b_major
        cfg = p.config
        vs = [("default", None)]
        tma = gemm.deepest_ring(replace(cfg, tma_store=True, store_buffers=1), 2, major, most=cfg.stages)
        if tma is not None:
            vs.append((f"{tma.bm}x{tma.bn}s{tma.stages}tma", tma))
        step = 16 if major == "K" else 32
        width = step * math.ceil(n / (step * 132))
        if width <= 256 and math.ceil(n / width) >= 0.8 * 132:
            wide = gemm.deepest_ring(replace(GemmConfig(128, width, gemm.MAX_STAGES, 2, tma_store=True, store_buffers=1),
                                             stream_b=cfg.stream_b), 2, major)
            if wide is not None:
                vs.append((f"128x{wide.bn}s{wide.stages}tma", wide))
        a, b = operand(m, k, am), operand(k, n, bmj)
        ref = a.float() @ b.float()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        t = {nm: [] for nm, _ in vs}
        g = {nm: [] for nm, _ in vs}
        cub, gcub = [], []
        for _ in range(2):
            cub.append(bench_ms(lambda: torch.mm(a, b)))
            gcub.append(graph_ms(lambda: torch.mm(a, b), calls=16, replays=10))
            for nm, c in vs:
                out.fill_(float("nan"))
                gemm.matmul(a, b, out=out, config=c)
                assert rel_err(out, ref) < 1e-2, (layout, m, n, k, nm)
                t[nm].append(bench_ms(lambda: gemm.matmul(a, b, out=out, config=c)))
                g[nm].append(graph_ms(lambda: gemm.matmul(a, b, out=out, config=c), calls=16, replays=10))
        c0, g0 = statistics.median(cub), statistics.median(gcub)
        cells = [f"{layout} {m}x{n}x{k}: cuBLAS {c0 * 1e3:.1f}/{g0 * 1e3:.1f} | default is {cfg.bm}x{cfg.bn}s{cfg.stages}"
                 f"{'B' if cfg.stream_b else ''}"]
        for nm, _ in vs:
            tm, gm = statistics.median(t[nm]), statistics.median(g[nm])
            cells.append(f"{nm} {tm * 1e3:.1f}/{gm * 1e3:.1f} ({c0 / tm:.3f}/{g0 / gm:.3f})")
        print(" | ".join(cells), flush=True)
