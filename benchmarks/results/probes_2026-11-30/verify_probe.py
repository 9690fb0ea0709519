"""Old (HEAD) vs new small-M plans on every full-suite row (M <= 128) whose plan changed, beside cuBLAS, in one
process: do_bench (cold L2) and CUDA graphs (warm), median of rounds."""
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tmp_device")
from benchmarks.common import bench_ms, graph_ms, rel_err  # noqa: E402
from benchmarks.gemm import FULL_SUITE  # noqa: E402
from modes import operand, plan_of, set_mode  # noqa: E402
from nvfly.ops import gemm  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "2"))
LAYOUTS = {16: ["rowxrow", "colxrow"], 64: ["rowxcol", "rowxrow", "colxcol"], 128: ["rowxcol", "rowxrow"]}
rows = []
t0 = time.time()
for m, n, k in FULL_SUITE:
    if m not in LAYOUTS:
        continue
    for layout in LAYOUTS[m]:
        am, bm = layout.split("x")
        a, b = operand(m, k, am), operand(k, n, bm)
        plans = {}
        for mode in ("old", "fill", "new"):
            p = plan_of(m, n, k, am, bm, mode, device="cuda")
            key = (getattr(p, "config", p), getattr(p, "swap", None))
            plans.setdefault(key, mode)
        if len(plans) == 1:
            continue
        modes = list(plans.values())
        ref = a.float() @ b.float()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        t = {md: [] for md in modes}
        g = {md: [] for md in modes}
        cub, gcub = [], []
        paths = {}
        for _ in range(ROUNDS):
            cub.append(bench_ms(lambda: torch.mm(a, b)))
            gcub.append(graph_ms(lambda: torch.mm(a, b), calls=16, replays=10))
            for md in modes:
                set_mode(md)
                out.fill_(float("nan"))
                gemm.matmul(a, b, out=out)
                err = rel_err(out, ref)
                assert err < 1e-2, (layout, m, n, k, md, err)
                p = plan_of(m, n, k, am, bm, md, device="cuda")
                c = p.config
                paths[md] = f"{'swap:' if p.swap else ''}{c.bm}x{c.bn}s{c.stages}k{c.split_k}" \
                            f"{'A' if c.stream_a else ''}{'B' if c.stream_b else ''}"
                t[md].append(bench_ms(lambda: gemm.matmul(a, b, out=out)))
                g[md].append(graph_ms(lambda: gemm.matmul(a, b, out=out), calls=16, replays=10))
        c, gc = statistics.median(cub), statistics.median(gcub)
        row = {"M": m, "N": n, "K": k, "layout": layout, "cublas_ms": c, "cublas_graph_ms": gc}
        cells = [f"{layout} {m}x{n}x{k}: cuBLAS {c * 1e3:.1f}/{gc * 1e3:.1f}"]
        for md in modes:
            tm, gm = statistics.median(t[md]), statistics.median(g[md])
            row[md] = {"config": paths[md], "ms": tm, "graph_ms": gm, "vs_cublas": c / tm, "vs_cublas_graph": gc / gm}
            cells.append(f"{md}[{paths[md]}] {tm * 1e3:.1f}/{gm * 1e3:.1f} ({c / tm:.3f}/{gc / gm:.3f})")
        rows.append(row)
        print(" | ".join(cells), flush=True)
set_mode("new")
out_dir = os.environ.get("OUT", ".")
json.dump({"meta": {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                    "card": torch.cuda.get_device_name(), "commit": os.environ.get("NVFLY_COMMIT"),
                    "command": "python tmp_device/verify_probe.py (old vs new small-M plans)",
                    "seconds": time.time() - t0}, "rows": rows},
          open(os.path.join(out_dir, "gemm_small_m_plans.json"), "w"), indent=1)


def gm_(xs):
    return statistics.geometric_mean(xs) if xs else float("nan")


for key in ("vs_cublas", "vs_cublas_graph"):
    old = [r["old"][key] for r in rows]
    new = [r["new"][key] if "new" in r else r["fill"][key] for r in rows]
    print(f"{key}: old geomean {gm_(old):.3f} min {min(old):.3f} | new geomean {gm_(new):.3f} min {min(new):.3f}")
