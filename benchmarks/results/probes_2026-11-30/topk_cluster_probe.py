# Recorded probe, kept as run on 2026-11-30 (then it imported nvfly.ops.topk_cluster, now topk_cluster_kernel.py here).
"""Probe: the cluster kernel (one cluster of 8 x 1024 threads a row) against the default plan and the
512-thread row plans, bf16 randn rows, each checked against the stable sort first."""
import json, os, sys, torch
sys.path.insert(0, os.getcwd())
from benchmarks.common import bench_ms, graph_ms
from nvfly.ops import topk
import topk_cluster_kernel as topk_cluster  # (this folder, on sys.path when run as a script from here)
from nvfly.runtime.torch_args import vector_width

def wrap(run, x, k):
    m = x.shape[0]
    def call():
        v = torch.empty((m, k), dtype=x.dtype, device=x.device); i = torch.empty((m, k), dtype=torch.int64, device=x.device)
        run(x, v, i); return v, i
    return call

rows = []
for m, n, k in [(1,128256,50),(1,128256,1024),(1,151936,50),(1,151936,1024),(4,151936,1024),(16,151936,1024),(64,128256,50),(64,128256,1024),(64,151936,1024)]:
    x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    vec = vector_width(n, (x,), 2)
    variants = {"default": wrap(topk._runner(topk.plan(n, k, m, vec, 2, 132), m, n, k, True), x, k),
                "cluster": wrap(topk_cluster.runner(m, n, k, vec, True), x, k)}
    if m > 1:
        variants["t512"] = wrap(topk._runner(topk.row_plan(n, k, m, vec, 2, 132 // 2 if m == 64 else 132, threads=512), m, n, k, True), x, k)
    expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    row = {"M": m, "N": n, "k": k, "torch_graph_us": graph_ms(lambda: torch.topk(x, k)) * 1e3, "torch_us": bench_ms(lambda: torch.topk(x, k)) * 1e3}
    for name, call in variants.items():
        try:
            v, i = call()
            ok = bool(torch.equal(i, expected) and torch.equal(v, x.gather(1, expected)))
            row[name] = {"ok": ok, "us": bench_ms(call) * 1e3 if ok else None, "graph_us": graph_ms(call) * 1e3 if ok else None}
        except Exception as exc:  # noqa
            row[name] = {"error": repr(exc)[:300]}
    rows.append(row)
    print(f"{m}x{n} k={k}: torch {row['torch_graph_us']:.1f} ({row['torch_us']:.1f}) | " + " | ".join(
        f"{nm} " + (f"{r['graph_us']:.1f} ({r['us']:.1f}) x{row['torch_graph_us']/r['graph_us']:.2f} (x{row['torch_us']/r['us']:.2f})" if r.get('graph_us') else str(r)[:200])
        for nm, r in row.items() if isinstance(r, dict)), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "topk_cluster_probe.json"), "w"), indent=1)
