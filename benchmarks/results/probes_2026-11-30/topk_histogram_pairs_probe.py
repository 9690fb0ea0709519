"""Recorded probe, kept as run on 2026-11-30 (from tmp_device/, beside a copy of 99b2b68's topk_row.py). Probe: the row histogram with packed 16-bit key pairs (this tree) against 99b2b68's (tmp_device/topk_row_base.py),
same plans, one process, interleaved; bf16 randn rows checked against the stable sort first."""
import os, sys, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tmp_device"))
from benchmarks.common import bench_ms, graph_ms
from nvfly.ops import topk, topk_row
import topk_row_base
from nvfly.runtime.torch_args import vector_width

def wrap(run, x, k):
    m = x.shape[0]
    def call():
        v = torch.empty((m, k), dtype=x.dtype, device=x.device); i = torch.empty((m, k), dtype=torch.int64, device=x.device)
        run(x, v, i); return v, i
    return call

for m, n, k in [(1,128256,50),(1,151936,1024),(64,128256,50),(64,128256,1024),(64,151936,1024),(256,128256,1024),(256,151936,1024)]:
  for dt in (torch.bfloat16, torch.float16):
    if dt == torch.float16 and m != 64: continue
    x = torch.randn(m, n, device="cuda").to(dt)
    p = topk.plan(n, k, m, vector_width(n, (x,), 2), 2, 132)
    calls = {"base": wrap(topk_row_base.runner(p, m, k, True), x, k), "packed": wrap(topk_row.runner(p, m, k, True), x, k)}
    expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    res = {}
    for rep in range(2):
        for name, call in calls.items():
            v, i = call()
            assert torch.equal(i, expected) and torch.equal(v, x.gather(1, expected)), name
            res.setdefault(name, []).append((graph_ms(call) * 1e3, bench_ms(call) * 1e3))
    tg = graph_ms(lambda: torch.topk(x, k)) * 1e3
    print(f"{m}x{n} k={k} {str(dt)[6:]} [{p.threads}t {p.parts}p{' 1L' if p.one_launch else ''}] torch graph {tg:.1f} | " + " | ".join(
        f"{nm} graphs {min(g for g, _ in r):.1f} (reps {', '.join(f'{g:.1f}' for g, _ in r)}) do_bench {min(b for _, b in r):.1f} x{tg / min(g for g, _ in r):.2f}" for nm, r in res.items()), flush=True)
