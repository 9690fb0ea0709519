import time, torch, torch.nn.functional as F
q1 = torch.randn(1, 4, 1, 16); kc = torch.randn(1, 1, 16, 16)
def t(fn, n=3000):
    best = 1e9
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
    return best
print("plain F", t(lambda: F.scaled_dot_product_attention(q1, kc, kc, enable_gqa=True)))
op = torch.ops.aten.scaled_dot_product_attention.default
print("op", t(lambda: op(q1, kc, kc, enable_gqa=True)))
for key in ("AutogradCPU", "CPU", "CompositeImplicitAutograd"):
    try:
        k = torch.library.get_kernel("aten::scaled_dot_product_attention", key)
    except Exception as e:
        print(key, e); continue
    ks = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    print(key, type(k), t(lambda: k.call_boxed(ks, q1, kc, kc, None, 0.0, False, scale=None, enable_gqa=True)))
print("redispatch", t(lambda: op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), q1, kc, kc, enable_gqa=True)))
