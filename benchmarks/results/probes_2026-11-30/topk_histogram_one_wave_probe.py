"""The histogram launch in one wave (its own slicing) beside the select's slicing: interleaved CUDA-graph times (us)
and do_bench, correctness against the documented order."""
import dataclasses
import statistics
import sys
import torch
sys.path.insert(0, ".")
from benchmarks.common import bench_ms, graph_ms
from benchmarks.topk import allocating_call
from nvfly.ops import topk
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.torch_args import vector_width

cases = [(torch.bfloat16, 256, 128256, 1024), (torch.bfloat16, 256, 128256, 256), (torch.bfloat16, 224, 128256, 1024),
         (torch.bfloat16, 256, 151936, 1024), (torch.float32, 256, 128256, 1024), (torch.float32, 256, 151936, 1024),
         (torch.float16, 256, 128256, 1024)]
for dtype, m, n, k in cases:
    x = torch.randn(m, n, device="cuda").to(dtype)
    isz = x.element_size()
    p = topk.plan(n, k, m, vector_width(n, (x,), isz), isz, plan_sm_count(0))
    plans = {"select's slices": dataclasses.replace(p, hist_parts=0, hist_slice_len=0), "one wave": p}
    expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    calls = {name: allocating_call(topk._runner(q, m, n, k, True), x, k) for name, q in plans.items()}
    res = {}
    for name, call in calls.items():
        v, i = call()
        res[name] = [bool(torch.equal(i, expected) and torch.equal(v, x.gather(1, expected)))]
    for _ in range(3):
        for name, call in calls.items():
            res[name].append(graph_ms(call) * 1e3)
    do = {name: bench_ms(call) * 1e3 for name, call in calls.items()}
    tg = graph_ms(lambda: torch.topk(x, k)) * 1e3
    td = bench_ms(lambda: torch.topk(x, k)) * 1e3
    print(f"{m}x{n} k={k} {str(dtype)[6:]} parts={p.parts} hist_parts={p.hist_parts} torch graph {tg:.1f} do_bench {td:.1f} | "
          + " | ".join(f"{name} ok={r[0]} graph {statistics.median(r[1:]):.1f} ({min(r[1:]):.1f}-{max(r[1:]):.1f}) "
                       f"x{tg / statistics.median(r[1:]):.2f} do_bench {do[name]:.1f} x{td / do[name]:.2f}"
                       for name, r in res.items()), flush=True)
    del x, expected
    torch.cuda.empty_cache()
