"""Llama layer decode step: plain vs minimal Python trampolines vs nvfly routing, interleaved (host us a step)."""
import time, torch, sys, contextlib
import nvfly.torch
from nvfly.torch import routing
from benchmarks.models import LlamaLayer
dev = "cuda" if torch.cuda.is_available() else "cpu"
if dev == "cuda":
    layer = LlamaLayer().to(dev, torch.bfloat16).eval(); ctx = 32768
    cache = tuple(torch.randn(1, 8, ctx, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(1, 1, 4096, device=dev, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize
    keys = {"rms": "CUDA", "sdpa": "AutogradCUDA"}
else:
    layer = LlamaLayer(64, 128, 16, 4, 1).eval(); ctx = 64
    cache = tuple(torch.randn(1, 1, ctx, 16) for _ in range(2)); x = torch.randn(1, 1, 64)
    sync = lambda: None
    keys = {"rms": "CPU", "sdpa": "AutogradCPU"}
f = lambda: layer(x, ctx - 1, cache)
def host_us(n=200):
    sync(); s = time.perf_counter()
    for _ in range(n): f()
    e = time.perf_counter(); sync()
    return (e - s) / n * 1e6

@contextlib.contextmanager
def minimal(ops):
    lib = torch._C._dispatch_library("IMPL", "aten", "", __file__, 1)
    for op, key in ops:
        cb = torch.library.get_kernel("aten::" + op, key).call_boxed
        def impl(ks, *a, cb=cb, **kw):
            return cb(ks, *a, **kw)
        lib.impl(op, key, impl, True)
    try:
        yield
    finally:
        lib.reset()

def nv():
    return routing.on_keys({"CUDA": "CPU", "AutogradCUDA": "AutogradCPU"}) if dev == "cpu" else contextlib.nullcontext()

@contextlib.contextmanager
def routed():
    with nv():
        with nvfly.torch.routing():
            yield
import importlib.util
from torch.utils.cpp_extension import load_inline
src = open("scratch/cxx/probe.py").read().split("r'''")[1].split("'''")[0]
cx = load_inline("nvfly_hop_probe", cpp_sources=src, functions=["hop", "reset"], verbose=False)
@contextlib.contextmanager
def cxx(ops):
    for op, key in ops:
        cx.hop("aten::" + op, key)
    try:
        yield
    finally:
        cx.reset()
@contextlib.contextmanager
def pyrouted():
    import os
    os.environ["NVFLY_ROUTING_NATIVE"] = "0"
    try:
        with nv():
            with nvfly.torch.routing():
                yield
    finally:
        del os.environ["NVFLY_ROUTING_NATIVE"]
variants = {
    "cxx_all3": lambda: cxx([("_fused_rms_norm", keys["rms"]), ("scaled_dot_product_attention", keys["sdpa"]), ("scaled_dot_product_attention", keys["rms"])]),
    "plain": contextlib.nullcontext,


    "hop_all3": lambda: minimal([("_fused_rms_norm", keys["rms"]), ("scaled_dot_product_attention", keys["sdpa"]), ("scaled_dot_product_attention", keys["rms"])]),
    "nvfly": routed,
    "nvfly_py": pyrouted,
}
res = {k: [] for k in variants}
with torch.no_grad():
    for v in variants.values():
        with v(): host_us(50)
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
        for k, v in variants.items():
            with v():
                host_us(20)
                res[k].append(host_us())
for k, ts in res.items():
    ts.sort()
    print(f"{k:10s} min {ts[0]:8.1f}  median {ts[len(ts)//2]:8.1f}  us a step")
