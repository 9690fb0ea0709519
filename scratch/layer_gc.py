import time, torch, gc, sys
import nvfly.torch
from nvfly.torch import routing
from benchmarks.models import LlamaLayer
layer = LlamaLayer(64, 128, 16, 4, 1).to("cpu", torch.float32).eval()
cache = tuple(torch.randn(1, 1, 64, 16) for _ in range(2))
x = torch.randn(1, 1, 64)
f = lambda: layer(x, 63, cache)
def t(n=300):
    best = 1e9
    for _ in range(7):
        s = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
    return best
print(len(gc.get_objects()), gc.get_count(), gc.get_threshold())
with torch.no_grad():
    for gcon in (True, False, True, False):
        gc.enable() if gcon else gc.disable()
        e = t()
        with routing.on_keys({"CUDA": "CPU", "AutogradCUDA": "AutogradCPU"}):
            with nvfly.torch.routing():
                r = t()
        print(f"gc {gcon}: eager {e:.0f} routed {r:.0f}")
