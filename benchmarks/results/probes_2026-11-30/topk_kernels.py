"""Per-kernel times (torch.profiler, mean us) of nvfly's TopK and torch.topk on the rows under 5x."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.device_time import kernel_times  # noqa: E402
from nvfly.ops import topk  # noqa: E402
from nvfly.runtime.driver import plan_sm_count  # noqa: E402

for m, n, k, dt in [(64, 128256, 1024, torch.bfloat16), (64, 151936, 1024, torch.bfloat16), (64, 128256, 50, torch.bfloat16),
                    (256, 128256, 1024, torch.bfloat16), (1, 151936, 1024, torch.bfloat16), (1, 128256, 50, torch.bfloat16),
                    (64, 151936, 1024, torch.float32), (64, 128, 8, torch.float32)]:
    x = torch.randn(m, n, device="cuda").to(dt)
    p = topk.plan(n, k, m, 16 // x.element_size(), x.element_size(), plan_sm_count(0))
    ours = kernel_times(lambda: topk.topk(x, k))
    theirs = kernel_times(lambda: torch.topk(x, k))
    fmt = lambda d: ", ".join(f"{name[:50]} {us:.2f}" for name, us in d.items())  # noqa: E731
    print(f"{m}x{n} k={k} {dt}: plan parts={p.parts} row_threshold={p.row_threshold} one_launch={p.one_launch} "
          f"| nvfly {sum(ours.values()):.2f} us: {fmt(ours)} | torch {sum(theirs.values()):.2f} us: {fmt(theirs)}",
          flush=True)
