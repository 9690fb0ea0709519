# Recorded probe, kept as run on 2026-11-30 at a706959 (+ the fp32 warp max); row_plan's `threads` was an int then.
"""Probe: row-threshold plans with 512-thread blocks, and more or fewer slices, against the default plan.
bf16 (and fp32 at M=64) randn rows; each variant checked against the stable sort before it is timed."""
import dataclasses, json, os, sys, torch
sys.path.insert(0, os.getcwd())
from benchmarks.common import bench_ms, graph_ms
from nvfly.ops import topk
from nvfly.runtime.torch_args import vector_width

def call_of(p, x, k):
    m, n = x.shape
    run = topk._runner(p, m, n, k, True)
    def call():
        v = torch.empty((m, k), dtype=x.dtype, device=x.device); i = torch.empty((m, k), dtype=torch.int64, device=x.device)
        run(x, v, i); return v, i
    return call

rows = []
cases = [(1,128256,50),(1,128256,1024),(1,151936,50),(1,151936,1024),(64,128256,50),(64,128256,1024),(64,151936,1024),(256,128256,1024),(256,151936,1024)]
for m, n, k in cases:
  for dt in ((torch.bfloat16, torch.float32) if m == 64 else (torch.bfloat16,)):
    x = torch.randn(m, n, device="cuda").to(dt)
    vec = vector_width(n, (x,), x.element_size()); e = x.element_size()
    variants = {"default": topk.plan(n, k, m, vec, e, 132)}
    if m == 1:
        variants["t512"] = topk.row_plan(n, k, m, vec, e, 132, threads=512)
        variants["t512-2launch"] = topk.row_plan(n, k, m, vec, e, 132, threads=512, one_launch=False)
    elif m == 64:
        variants["t256-8parts"] = topk.row_plan(n, k, m, vec, e, 264)
        variants["t512-2parts"] = topk.row_plan(n, k, m, vec, e, 66, threads=512)
        variants["t512-2parts-1launch"] = dataclasses.replace(variants["t512-2parts"], one_launch=True)
        variants["t256-2parts-1launch"] = dataclasses.replace(topk.row_plan(n, k, m, vec, e, 66), one_launch=True)
    else:
        variants["t256-2parts"] = topk.row_plan(n, k, m, vec, e, 264)
        variants["t512-2parts"] = topk.row_plan(n, k, m, vec, e, 264, threads=512)
    expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    row = {"M": m, "N": n, "k": k, "dtype": str(dt)[6:], "torch_graph_us": graph_ms(lambda: torch.topk(x, k)) * 1e3}
    for name, p in variants.items():
        try:
            call = call_of(p, x, k)
            v, i = call()
            ok = bool(torch.equal(i, expected) and torch.equal(v, x.gather(1, expected)))
            row[name] = {"ok": ok, "parts": p.parts, "threads": p.threads, "one": p.one_launch, "row": p.row_threshold,
                         "us": bench_ms(call) * 1e3 if ok else None, "graph_us": graph_ms(call) * 1e3 if ok else None}
        except Exception as exc:  # noqa
            row[name] = {"error": repr(exc)[:300]}
    rows.append(row)
    print(f"{m}x{n} k={k} {row['dtype']}: torch graph {row['torch_graph_us']:.1f} | " + " | ".join(
        f"{nm} " + (f"{r['graph_us']:.1f} ({r['us']:.1f}) x{row['torch_graph_us']/r['graph_us']:.2f} [{r['parts']}p {r['threads']}t{' 1L' if r['one'] else ''}]" if r.get('graph_us') else str(r)[:120])
        for nm, r in row.items() if isinstance(r, dict)), flush=True)
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "topk_threads_probe.json"), "w"), indent=1)
