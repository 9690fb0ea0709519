"""TopK one-launch plans from CUDA graphs: the module as it is beside copies launched as programmatic dependents
(wait after the smem setup; and also triggering the next launch at the start). Graph times interleaved."""
import importlib.util
import statistics
import sys
import torch
sys.path.insert(0, ".")
from benchmarks.common import bench_ms, graph_ms
from benchmarks.topk import allocating_call
from benchmarks.topk_finish_probe import row_plan
from nvfly.ops import topk_row


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


mods = {"current": topk_row, "pdl": load("tmp_device/topk_row_pdl.py", "pdl"),
        "pdl_trig": load("tmp_device/topk_row_pdl_trig.py", "pdl_trig")}
shapes = [(1, 128256, 50), (1, 128256, 1024), (1, 151936, 50), (1, 151936, 1024), (4, 151936, 50), (1, 32000, 50)]
for dtype in (torch.bfloat16, torch.float32):
    for m, n, k in shapes:
        x = torch.randn(m, n, device="cuda").to(dtype)
        p = row_plan(x, k)
        expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
        calls = {name: allocating_call(mod.runner(p, m, k, True), x, k) for name, mod in mods.items()}
        ok = {}
        for name, call in calls.items():
            for _ in range(3):
                v, i = call()
            ok[name] = bool(torch.equal(i, expected) and torch.equal(v, x.gather(1, expected)))
        graphs = {name: [] for name in calls}
        for _ in range(4):
            for name, call in calls.items():
                graphs[name].append(graph_ms(call) * 1e3)
        do = {name: bench_ms(call) * 1e3 for name, call in calls.items()}
        tg = graph_ms(lambda: torch.topk(x, k)) * 1e3
        print(f"{m}x{n} k={k} {str(dtype)[6:]} one_launch={p.one_launch} torch graph {tg:.1f} | " + " | ".join(
            f"{name}{'' if ok[name] else ' WRONG'} graph {statistics.median(g):.2f} ({min(g):.2f}-{max(g):.2f}) "
            f"do_bench {do[name]:.1f}" for name, g in graphs.items()), flush=True)
