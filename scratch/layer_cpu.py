import time, torch, cProfile, pstats, sys
import nvfly.torch
from nvfly.torch import routing
from benchmarks.models import LlamaLayer
layer = LlamaLayer(64, 128, 16, 4, 1).to("cpu", torch.float32).eval()
cache = tuple(torch.randn(1, 1, 64, 16, dtype=torch.float32) for _ in range(2))
x = torch.randn(1, 1, 64, dtype=torch.float32)
f = lambda: layer(x, 63, cache)
def t(n=300):
    best = 1e9
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
    return best
with torch.no_grad():
    print("eager", t()); print("eager", t())
    with routing.on_keys({"CUDA": "CPU", "AutogradCUDA": "AutogradCPU"}):
        with nvfly.torch.routing():
            print("routed", t()); print("routed", t())
            if len(sys.argv) > 1:
                pr = cProfile.Profile(); pr.enable()
                for _ in range(300): f()
                pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
    print("eager", t())
