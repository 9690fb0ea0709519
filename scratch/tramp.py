import time, torch, torch.nn.functional as F, sys
q1 = torch.randn(1, 4, 1, 16); kc = torch.randn(1, 1, 16, 16)
def t(fn, n=3000):
    best = 1e9
    for _ in range(7):
        s = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
    return best
f = lambda: F.scaled_dot_product_attention(q1, kc, kc, enable_gqa=True)
print("plain", t(f))
keys = sys.argv[1].split(",")
lib = torch._C._dispatch_library("IMPL", "aten", "", __file__, 1)
for key in keys:
    fall = torch.library.get_kernel("aten::scaled_dot_product_attention", key)
    def mk(fall):
        cb = fall.call_boxed
        def impl(ks, *a, **kw):
            return cb(ks, *a, **kw)
        return impl
    lib.impl("scaled_dot_product_attention", key, mk(fall), True)
print(keys, "trampoline", t(f))
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for _ in range(2000): f()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(5)
