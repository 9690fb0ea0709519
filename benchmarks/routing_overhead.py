"""Host cost of eager routing: each torch call timed in a loop, plain and under ``nvfly.torch.routing()``, in one
process ("eager + routing never slower than eager", issue 28).

A call's time is the host's: the loop issues ``--calls`` calls back to back without synchronizing (the GPU work of
these shapes is shorter than their host code, except where a row says nvfly runs it and its kernel is longer),
the best of ``--repeats`` loops. ``plain_us``: before any route is registered (torch alone); ``off_us``: routes
installed, switched off (what every call of a routed op pays once nvfly routing is installed: the dispatcher's
trampoline into the Python kernel and back to torch's); ``routed_us``: inside ``nvfly.torch.routing()``, loops
interleaved with the switched-off ones. Each row says what routing did with the call (``nvfly``: "runs" or the
reason it declined, from the route's own eligibility): ``extra_us`` (routed - plain) is then the cost of a declined
call (the trampoline, the signature and its decision's lookup, the fallthrough) or of an accepted one (nvfly's host
path in place of torch's). ``decision_us`` (declined rows): the routed kernel's own Python, called directly with a
no-op fallthrough, switched on minus off: what the decision cache costs without the dispatcher around it.

Usage: python -m benchmarks.routing_overhead [--quick | --full] [--cpu]   (--quick is the default: under 30 s;
or: nvfly bench routing_overhead).
Writes benchmarks/results/routing_overhead_h200.json.

``--cpu``: no GPU; the routes are registered on the CPU dispatch keys (what ``install_routing`` does on CUDA's) and
the cases run on small CPU tensors, which nvfly declines: the declined path's host cost, printed (not written).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nvfly.torch  # noqa: E402
from benchmarks.common import write_results  # noqa: E402
from nvfly.torch import routing  # noqa: E402

bf = torch.bfloat16
# a case: (name, the call, the aten overload it reaches, that overload's arguments as the route receives them)
Case = tuple[str, Callable[[], Any], str, tuple, dict]


def cases(device: str, full: bool) -> list[Case]:
    """The quick rows (launch-bound shapes of a decoder layer), and with ``full`` a few more. On CPU the sizes are
    cut and the dtype is float32 (the host path depends on neither, and CPU kernels of bf16 would hide it)."""
    gpu = device == "cuda"
    big, kv, sp, heads, d = (4096, 4096, 512, 32, 128) if gpu else (16, 16, 17, 4, 16)
    dtype = bf if gpu else torch.float32
    r = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    a, w, small = r(8, big), r(big, big), r(64, 64) if gpu else r(4, 4)
    x, g = r(8, big), torch.ones(big, device=device, dtype=dtype)
    q1, kc = r(1, heads, 1, d), r(1, heads // 4, kv, d)
    qp, kp = r(1, heads, sp, d), r(1, heads // 4, sp, d)
    logits = r(8, 128)
    sdpa = "aten::scaled_dot_product_attention"
    rows: list[Case] = [
        (f"mm 8x{big}x{big}", lambda: a @ w, "aten::mm", (a, w), {}),
        (f"mm {small.shape[0]}x{small.shape[0]}x{small.shape[0]}", lambda: small @ small, "aten::mm", (small, small), {}),
        (f"linear 8x{big}x{big}", lambda: F.linear(a, w), "aten::mm", (a, w.t()), {}),
        (f"rms_norm 8x{big}", lambda: F.rms_norm(x, (big,), g, 1e-6), "aten::_fused_rms_norm", (x, [big], g, 1e-6),
         {}),
        (f"sdpa decode 1x{heads}/{heads // 4} {kv}", lambda: F.scaled_dot_product_attention(q1, kc, kc, enable_gqa=True), sdpa,
         (q1, kc, kc, None, 0.0, False), {"scale": None, "enable_gqa": True}),
        (f"sdpa prefill {qp.shape[2]} causal",
         lambda: F.scaled_dot_product_attention(qp, kp, kp, is_causal=True, enable_gqa=True), sdpa,
         (qp, kp, kp, None, 0.0, True), {"scale": None, "enable_gqa": True}),
        ("topk 8x128 k8", lambda: torch.topk(logits, 8), "aten::topk", (logits, 8, -1, True, True), {}),
        ("add (not routed)", lambda: x + x, "", (), {}),
    ]
    if full:
        bias, b3 = r(big), r(4, 64, 64)
        wide = r(256, big)
        q4, k32 = r(1, 48, 4, d), r(1, 8, 32768 if gpu else 16, d)
        logits64 = r(64, 128)
        rows += [
            (f"linear+bias 8x{big}x{big}", lambda: F.linear(a, w, bias), "aten::addmm", (bias, a, w.t()), {}),
            ("bmm 4x64x64x64", lambda: torch.bmm(b3, b3), "aten::bmm", (b3, b3), {}),
            (f"rms_norm 256x{big}", lambda: F.rms_norm(wide, (big,), g, 1e-6), "aten::_fused_rms_norm",
             (wide, [big], g, 1e-6), {}),
            (f"sdpa decode 1x48/8 Sq 4 {k32.shape[2]}", lambda: F.scaled_dot_product_attention(q4, k32, k32,
                                                                                             enable_gqa=True),
             sdpa, (q4, k32, k32, None, 0.0, False), {"scale": None, "enable_gqa": True}),
            ("topk 64x128 k8", lambda: torch.topk(logits64, 8), "aten::topk", (logits64, 8, -1, True, True), {}),
        ]
    return rows


def route_on_cpu() -> None:
    """Register every route on the CPU dispatch keys (AutogradCUDA's on AutogradCPU), falling through to torch's CPU
    kernels, as ``install_routing`` does on CUDA's: a harness for the declined path without a GPU."""
    routing.install_routing()  # the routes' registry (CUDA's registrations are absent on a CPU build)
    library = torch.library.Library("aten", "IMPL")
    keys = {"CUDA": "CPU", "AutogradCUDA": "AutogradCPU"}
    pending = {}
    for route in routing.routes():
        try:
            pending[route] = torch.library.get_kernel(route.op, keys[route.dispatch_key])
        except (KeyError, RuntimeError):
            continue
    for route, fallthrough in pending.items():
        cpu = dataclasses.replace(route, dispatch_key=keys[route.dispatch_key])
        library.impl(route.op.split("::", 1)[1], routing._routed(cpu, fallthrough), cpu.dispatch_key,
                     with_keyset=True)
    route_on_cpu.library = library  # kept alive: the registrations last as long as the Library object


def host_us(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / calls * 1e6


class _NoTorch:
    """A fallthrough that does nothing: the routed kernel's own Python, timed alone."""

    @staticmethod
    def call_boxed(keyset: Any, *args: Any, **kwargs: Any) -> None:
        return None


def decision_us(op: str, args: tuple, kwargs: dict, calls: int, repeats: int) -> float:
    """Host µs of a declined call's Python decision: the route's kernel called directly (no dispatcher, torch's
    kernel a no-op), switched on minus switched off."""
    route = next(r for r in routing.routes() if r.op == op)
    impl = routing._routed(route, _NoTorch)
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)  # read by the fallthrough only
    call = lambda: impl(keyset, *args, **kwargs)  # noqa: E731
    with routing.routing():
        call()
    on = off = float("inf")
    for _ in range(repeats):
        off = min(off, host_us(call, calls, lambda: None))
        with routing.routing():
            on = min(on, host_us(call, calls, lambda: None))
    return on - off


def decision(op: str, args: tuple, kwargs: dict) -> str:
    """What the route of ``op`` does with these arguments: "runs" or its reason to decline."""
    if not op:
        return "not routed"
    route = next(r for r in routing.routes() if r.op == op)
    reason = routing._decide(route, args, kwargs)
    return "runs" if reason is None else reason


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="the default: the quick rows, 300-call loops (< 30 s)")
    p.add_argument("--full", action="store_true", help="more rows, longer loops")
    p.add_argument("--cpu", action="store_true", help="the declined path on CPU (module docstring)")
    p.add_argument("--calls", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    calls = args.calls or (2000 if args.full else 300)
    repeats = args.repeats or (15 if args.full else 7)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cpu":
        torch.set_num_threads(1)  # the host path is single-threaded; CPU kernels' threads only add noise
    rows = cases(device, args.full)
    plain = {}
    for name, fn, *_ in rows:  # before any route is registered: torch alone
        for _ in range(20):
            fn()
        sync()
        plain[name] = min(host_us(fn, calls, sync) for _ in range(repeats))
    if device == "cpu":
        route_on_cpu()
    else:
        routing.install_routing()
    results = []
    for name, fn, op, op_args, op_kwargs in rows:
        with routing.routing():
            for _ in range(20):  # compiled, planned and decided before timing
                fn()
            outcome = decision(op, op_args, op_kwargs)
        off, routed = float("inf"), float("inf")
        for _ in range(repeats):  # switched off (the routes' Python trampoline alone) and on, interleaved
            off = min(off, host_us(fn, calls, sync))
            with routing.routing():
                routed = min(routed, host_us(fn, calls, sync))
        declined = op and outcome != "runs"
        decided = decision_us(op, op_args, op_kwargs, calls, repeats) if declined else None
        results.append({"case": name, "op": op, "plain_us": round(plain[name], 2), "off_us": round(off, 2),
                        "routed_us": round(routed, 2), "extra_us": round(routed - plain[name], 2),
                        "decision_us": None if decided is None else round(decided, 2), "nvfly": outcome})
        print(f"{name:30s} plain {plain[name]:7.2f} us  switched off {off:7.2f} us  routed {routed:7.2f} us  "
              f"extra {routed - plain[name]:+6.2f} us  decision {'-' if decided is None else f'{decided:+5.2f}'} us"
              f"  {outcome[:70]}", flush=True)
    if device == "cuda":
        path = write_results("routing_overhead", results, {"calls": calls, "repeats": repeats})
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
