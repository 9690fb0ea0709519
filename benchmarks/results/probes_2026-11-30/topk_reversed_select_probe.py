"""Where the reversed select launch pays: the two-launch row-threshold plan with and without reversed_select,
interleaved CUDA-graph times (us), over row bytes around the L2 size."""
import dataclasses
import statistics
import sys
import torch
sys.path.insert(0, ".")
from benchmarks.common import graph_ms
from benchmarks.topk import allocating_call
from nvfly.ops import topk, topk_row
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.torch_args import vector_width

cases = [(torch.bfloat16, m, 128256, 1024) for m in (67, 100, 128, 160, 192, 224, 256, 384)]
cases += [(torch.bfloat16, 256, 128256, 256), (torch.bfloat16, 192, 128256, 256), (torch.bfloat16, 256, 151936, 1024),
          (torch.float32, 96, 128256, 1024), (torch.float32, 128, 128256, 1024), (torch.float32, 192, 128256, 1024),
          (torch.float16, 256, 128256, 1024), (torch.bfloat16, 1024, 32000, 1024), (torch.bfloat16, 2048, 32000, 512)]
for dtype, m, n, k in cases:
    x = torch.randn(m, n, device="cuda").to(dtype)
    isz = x.element_size()
    p = topk.plan(n, k, m, vector_width(n, (x,), isz), isz, plan_sm_count(0))
    mb = m * n * isz / 2**20
    if not p.row_threshold or p.one_launch or p.two_level:
        print(f"{m}x{n} k={k} {str(dtype)[6:]} {mb:.0f} MB: not a two-launch row plan, skipped", flush=True)
        continue
    expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    calls = {f"reversed={r}": allocating_call(topk_row.runner(dataclasses.replace(p, reversed_select=r), m, k, True),
                                              x, k) for r in (False, True)}
    res = {}
    for name, call in calls.items():
        v, i = call()
        res[name] = [bool(torch.equal(i, expected) and torch.equal(v, x.gather(1, expected)))]
    for _ in range(3):
        for name, call in calls.items():
            res[name].append(graph_ms(call) * 1e3)
    tg = graph_ms(lambda: torch.topk(x, k)) * 1e3
    print(f"{m}x{n} k={k} {str(dtype)[6:]} {mb:.0f} MB parts={p.parts} threads={p.threads} default={p.reversed_select}"
          f" torch {tg:.1f} | " + " | ".join(
        f"{name} ok={r[0]} {statistics.median(r[1:]):.1f} ({min(r[1:]):.1f}-{max(r[1:]):.1f}) x{tg / statistics.median(r[1:]):.2f}"
        for name, r in res.items()), flush=True)
    del x, expected
    torch.cuda.empty_cache()
