import time, torch, torch.nn.functional as F
import nvfly.torch
from nvfly.torch import routing
q1 = torch.randn(1, 4, 1, 16); kc = torch.randn(1, 1, 16, 16)
f = lambda: F.scaled_dot_product_attention(q1, kc, kc, enable_gqa=True)
def t(fn, n=3000):
    best = 1e9
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
    return best
print("plain", t(f))
with routing.on_keys({"CUDA": "CPU", "AutogradCUDA": "AutogradCPU"}):
    with nvfly.torch.routing():
        print("routed", t(f))
        with nvfly.torch.routing(False):
            print("off", t(f))
        import cProfile, pstats
        pr = cProfile.Profile(); pr.enable()
        for _ in range(2000): f()
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
print("plain", t(f))
