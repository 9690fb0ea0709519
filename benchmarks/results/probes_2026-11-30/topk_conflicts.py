"""TopK row-threshold kernel times on bell-shaped (randn) vs bucket-spread data: do the histogram's shared-memory
atomics on the few hot buckets of a bell-shaped row cost the time?"""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.device_time import kernel_times  # noqa: E402
from nvfly.ops import topk  # noqa: E402

torch.manual_seed(0)
for m, n, k in [(64, 128256, 1024), (64, 151936, 1024), (1, 151936, 1024)]:
    for dt in (torch.bfloat16, torch.float32):
        normal = torch.randn(m, n, device="cuda").to(dt)
        # magnitudes 2^-60..2^60 with random signs: the keys' top 11 bits spread over ~1000 buckets
        spread = ((torch.rand(m, n, device="cuda") * 120 - 60).exp2() * torch.randn(m, n, device="cuda").sign()).to(dt)
        cells = []
        for name, x in (("randn", normal), ("spread", spread)):
            v, _ = topk.topk(x, k)
            assert torch.equal(v, torch.topk(x, k).values), (m, n, k, dt, name)
            t = kernel_times(lambda: topk.topk(x, k))
            cells.append(f"{name}: " + ", ".join(f"{key.split('(')[0][:34]} {us:.2f}" for key, us in t.items()))
        print(f"{m}x{n} k={k} {dt}: " + " | ".join(cells), flush=True)
