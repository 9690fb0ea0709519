"""The local-threshold kernel (each block's own k-th bucket, one exchange) beside the default plan: correctness
against the documented order (stable sort), then interleaved CUDA-graph times (us)."""
import dataclasses
import statistics
import sys
import torch
sys.path.insert(0, ".")
from benchmarks.common import graph_ms
from benchmarks.topk import allocating_call
from nvfly.ops import topk
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.torch_args import vector_width


def local(p):
    return dataclasses.replace(p, local_threshold=True, one_launch=False, shared_finish=False, reversed_select=False,
                               cap=topk.ROW_CAP_MAX)


cases = [(torch.bfloat16, 1, 128256, 50, "randn"), (torch.bfloat16, 1, 151936, 50, "randn"),
         (torch.bfloat16, 1, 128256, 1, "randn"), (torch.bfloat16, 1, 128256, 8, "randn"),
         (torch.bfloat16, 1, 128256, 100, "randn"), (torch.bfloat16, 1, 128256, 200, "randn"),
         (torch.float32, 1, 128256, 50, "randn"), (torch.float32, 1, 151936, 50, "randn"),
         (torch.bfloat16, 4, 151936, 50, "randn"), (torch.bfloat16, 64, 128256, 50, "randn"),
         (torch.bfloat16, 1, 32000, 50, "randn"), (torch.bfloat16, 1, 128256, 50, "ints"),
         (torch.bfloat16, 1, 128256, 50, "masked"), (torch.bfloat16, 1, 128256, 50, "zeros")]
sms = plan_sm_count(0)
for dtype, m, n, k, kind in cases:
    if kind == "ints":
        x = torch.randint(-20, 20, (m, n), device="cuda").to(dtype)
    elif kind == "masked":  # 90% -inf
        x = torch.randn(m, n, device="cuda")
        x[torch.rand(m, n, device="cuda") < 0.9] = float("-inf")
        x = x.to(dtype)
    elif kind == "zeros":
        x = torch.zeros(m, n, device="cuda", dtype=dtype)
    else:
        x = torch.randn(m, n, device="cuda").to(dtype)
    isz = x.element_size()
    vec = vector_width(n, (x,), isz)
    p = topk.plan(n, k, m, vec, isz, sms)
    plans = {"default": p}
    row = topk.plan(n, k, m, vec, isz, sms, row_threshold=True)
    plans["local"] = local(row)
    if row.threads == 256:
        plans["local512"] = local(topk.row_plan(n, k, m, vec, isz, sms, threads=512))
    expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    calls, res = {}, {}
    for name, q in plans.items():
        if name != "default" and m * q.parts > sms * 2:
            continue
        calls[name] = allocating_call(topk._runner(q, m, n, k, True), x, k)
        ok = True
        for _ in range(3):
            v, i = calls[name]()
            ok &= bool(torch.equal(i, expected) and torch.equal(v, x.gather(1, expected)))
        res[name] = [ok]
    for _ in range(3):
        for name, call in calls.items():
            res[name].append(graph_ms(call) * 1e3)
    tg = graph_ms(lambda: torch.topk(x, k)) * 1e3
    print(f"{m}x{n} k={k} {str(dtype)[6:]} {kind} torch {tg:.1f} | " + " | ".join(
        f"{name}[{plans[name].parts}x{plans[name].threads}] ok={r[0]} {statistics.median(r[1:]):.2f} "
        f"({min(r[1:]):.2f}-{max(r[1:]):.2f}) x{tg / statistics.median(r[1:]):.2f}" for name, r in res.items()),
        flush=True)
