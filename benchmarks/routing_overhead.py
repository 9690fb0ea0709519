"""Host cost of eager routing: each torch call timed in a loop, plain and under ``nvfly.torch.routing()``, in one
process ("eager + routing never slower than eager", issue 28).

A call's time is the host's: the loop issues ``--calls`` calls back to back without synchronizing (the GPU work of
these shapes is shorter than their host code, except where a row says nvfly runs it and its kernel is longer),
the best of ``--repeats`` loops. Columns:
- ``plain_us``: before routing was ever entered (torch alone);
- ``outside_us``: after routing blocks came and went, outside any (the routes are registered only inside blocks:
  this is what a program pays for having used routing; it should equal ``plain_us``);
- ``off_us``: inside a block, switched off there (``routing(False)`` nested): what a call of a registered route
  pays without routing in its thread (another thread's block holds the routes), the dispatcher's trampoline into the
  Python kernel and back to torch's; equal to ``plain_us`` where the route is not registered;
- ``routed_us``: inside ``nvfly.torch.routing()``; ``extra_us`` = routed - plain: for a declined call the trampoline,
  the signature, its decision's lookup and the fallthrough (``declined_us`` repeats it on declined rows), for an
  accepted one nvfly's host path in place of torch's;
- ``decision_us`` (declined rows whose route is registered): the routed kernel's own Python, called directly with a
  no-op fallthrough, switched on minus off: what the decision cache costs without the dispatcher around it (for a
  launch-bound call, the route's ``skip``: a few tensor reads, no signature);
- ``registered``: whether the op's route is registered inside the block (GEMM routes are not while the autotune
  database has no entry where nvfly wins: their calls cost nothing).
Each row says what routing did with the call (``nvfly``: "runs" or the reason it declined). Two more rows time a
``routing()`` block itself, empty: the outermost one (it registers the routes and removes them) and one nested in
another (a switch and a counter).

Usage: python -m benchmarks.routing_overhead [--quick | --full] [--cpu]   (--quick is the default: under 30 s;
or: nvfly bench routing_overhead).
Writes benchmarks/results/routing_overhead_h200.json.

``--cpu``: no GPU; the routes are registered on the CPU dispatch keys (``routing.on_keys``) and the cases run on
small CPU tensors, which nvfly declines: the declined path's host cost, printed (not written).

``--profile`` (printed, not written; under a minute on the H200): whole-model rows of ``benchmarks/models.py``
where routing cost time (issue 28): the Llama-3-8B layer's decode step (B 1, 32K cache), its speculative step
(Sq 4) and DeepSeek-like prefill SDPA (128 heads, Dqk 192 / Dv 128, 4K causal). For each, eager and routed
(inside one routing block) in turn over rounds: the host's µs a call (a loop of calls, one synchronize) and
do_bench's ms (medians and the rounds' spread); then torch.profiler's view of both: each aten op of the call that
has a route or is SDPA's (calls and CPU µs a call: what a routed op's trampoline, decision and fallthrough add)
and each GPU kernel (name, launches and µs a call: whether the fallthrough runs torch's very kernels); and what
routing decided for the calls. With ``--cpu`` the same on a small layer on CPU (no kernels).
``NVFLY_ROUTING_RMS_NORM=0`` in the environment measures the rows without the RMSNorm routes registered.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
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
            with routing.routing(False):
                off = min(off, host_us(call, calls, lambda: None))
            on = min(on, host_us(call, calls, lambda: None))
    return on - off


def decision(op: str, args: tuple, kwargs: dict) -> str:
    """What the route of ``op`` does with these arguments: "runs" or its reason to decline."""
    if not op:
        return "not routed"
    route = next(r for r in routing.routes() if r.op == op)
    reason = routing._decide(route, args, kwargs)
    return "runs" if reason is None else reason


def block_us(calls: int, repeats: int, nested: bool) -> float:
    """Host µs of an empty ``nvfly.torch.routing()`` block: the outermost one (registers and removes the routes) or,
    with ``nested``, one inside another."""
    def block() -> None:
        with nvfly.torch.routing():
            pass
    outer = nvfly.torch.routing() if nested else contextlib.nullcontext()
    with outer:
        block()
        return min(host_us(block, calls, lambda: None) for _ in range(repeats))


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="the default: the quick rows, 300-call loops (< 30 s)")
    p.add_argument("--full", action="store_true", help="more rows, longer loops")
    p.add_argument("--cpu", action="store_true", help="the declined path on CPU (module docstring)")
    p.add_argument("--profile", action="store_true", help="the layer rows' host cost per op and kernels (docstring)")
    p.add_argument("--calls", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--rounds", type=int, default=5, help="--profile: eager and routed rounds (their range printed)")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    calls = args.calls or (2000 if args.full else 300)
    repeats = args.repeats or (15 if args.full else 7)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cpu":
        torch.set_num_threads(1)  # the host path is single-threaded; CPU kernels' threads only add noise
    with routing.on_keys({"CUDA": "CPU", "AutogradCUDA": "AutogradCPU"}) if device == "cpu" \
            else contextlib.nullcontext():
        if args.profile:
            for name, fn in layer_cases(device):
                profile_case(name, fn, device, sync, args.rounds)
            return 0
        results = measure(cases(device, args.full), calls, repeats, sync)
    if device == "cuda":
        path = write_results("routing_overhead", results, {"calls": calls, "repeats": repeats})
        print("wrote", path)
    return 0


def measure(rows: list[Case], calls: int, repeats: int, sync: Callable[[], None]) -> list[dict[str, Any]]:
    plain = {}
    for name, fn, *_ in rows:  # before routing was ever entered: torch alone
        for _ in range(20):
            fn()
        sync()
        plain[name] = min(host_us(fn, calls, sync) for _ in range(repeats))
    results = []
    for name, fn, op, op_args, op_kwargs in rows:
        with nvfly.torch.routing():
            for _ in range(20):  # compiled, planned and decided before timing
                fn()
            outcome = decision(op, op_args, op_kwargs)
            registered = op in routing.installed()
        outside = off = routed = float("inf")
        for _ in range(repeats):  # outside routing, switched off inside a block, routed: interleaved
            outside = min(outside, host_us(fn, calls, sync))
            with nvfly.torch.routing():
                with nvfly.torch.routing(False):
                    off = min(off, host_us(fn, calls, sync))
                routed = min(routed, host_us(fn, calls, sync))
        declined = bool(op) and outcome != "runs"
        decided = decision_us(op, op_args, op_kwargs, calls, repeats) if declined and registered else None
        extra = routed - plain[name]
        results.append({"case": name, "op": op, "registered": registered, "plain_us": round(plain[name], 2),
                        "outside_us": round(outside, 2), "off_us": round(off, 2), "routed_us": round(routed, 2),
                        "extra_us": round(extra, 2), "declined_us": round(extra, 2) if declined else None,
                        "decision_us": None if decided is None else round(decided, 2), "nvfly": outcome})
        print(f"{name:30s} plain {plain[name]:7.2f}  outside {outside:7.2f}  off {off:7.2f}  routed {routed:7.2f} us  "
              f"extra {extra:+6.2f} us  decision {'-' if decided is None else f'{decided:+5.2f}'} us  "
              f"{'registered' if registered else 'not registered'}: {outcome[:60]}", flush=True)
    for name, nested in (("routing() block, outermost (registers, removes)", False),
                         ("routing() block, nested", True)):
        us = block_us(calls, repeats, nested)
        results.append({"case": name, "op": "", "block_us": round(us, 2)})
        print(f"{name:50s} {us:7.2f} us a block", flush=True)
    return results


# ---------------------------------------------------------------------------------------------- --profile
def layer_cases(device: str) -> list[tuple[str, Callable[[], Any]]]:
    """(name, call) of the models rows probed: the Llama layer's decode step (B 1) and speculative step (Sq 4) over
    a 32K cache, DeepSeek-like prefill SDPA; on CPU a small layer and small tensors (float32)."""
    from benchmarks.models import LlamaLayer
    gpu = device == "cuda"
    dtype = bf if gpu else torch.float32
    layer = (LlamaLayer() if gpu else LlamaLayer(64, 128, 16, 4, 1)).to(device, dtype).eval()
    context = 32768 if gpu else 64
    cache = tuple(torch.randn(1, layer.kv_heads, context, layer.head, device=device, dtype=dtype) for _ in range(2))
    x1, x4 = (torch.randn(1, s, layer.hidden, device=device, dtype=dtype) for s in (1, 4))
    heads, sq, dqk, dv = (128, 4096, 192, 128) if gpu else (4, 64, 24, 16)
    q, k = (torch.randn(1, heads, sq, dqk, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(1, heads, sq, dv, device=device, dtype=dtype)

    def no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return fn()
        return call
    return [("llama-decode layer B1", no_grad(lambda: layer(x1, context - 1, cache))),
            ("spec-decode layer B1 Sq4", no_grad(lambda: layer(x4, context - 4, cache))),
            (f"deepseek-prefill sdpa {heads}h {sq} {dqk}/{dv} causal",
             no_grad(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))]


def profile_case(name: str, fn: Callable[[], Any], device: str, sync: Callable[[], None], rounds: int = 5) -> None:
    """Prints eager vs routed of one call: host µs and do_bench ms over interleaved rounds, the aten ops' calls and
    CPU µs (the routed ones and SDPA's), the GPU kernels, and routing's decisions."""
    from benchmarks.common import interleaved_ms
    from nvfly.torch import attention_ops
    from nvfly.torch.gemm_ops import clear_decisions, decisions
    clear_decisions()
    attention_ops.forget_decisions()
    modes: dict[str, Callable[[], Any]] = {"eager": contextlib.nullcontext, "routed": nvfly.torch.routing}
    for around in modes.values():
        with around():
            for _ in range(3):  # compiled, planned and decided before timing
                fn()
    sync()
    calls = 20 if device == "cuda" else 200
    host: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode, around in modes.items():
            with around():
                host[mode].append(host_us(fn, calls, sync))
    print(f"\n== {name}")
    print("host us a call (loop of calls, one sync): " + "  ".join(
        f"{mode} {statistics.median(t):8.1f} [{min(t):.1f}-{max(t):.1f}]" for mode, t in host.items()))
    if device == "cuda":
        ms = interleaved_ms({mode: fn for mode in modes}, rounds, 10, 40, around=modes)
        print("do_bench ms (median [rounds' range]): " + "  ".join(
            f"{mode} {statistics.median(t):.4f} [{min(t):.4f}-{max(t):.4f}]" for mode, t in ms.items()))
    tables = {mode: profiled(fn, around, sync) for mode, around in modes.items()}
    ops, kernels = ({key for t in tables.values() for key in t[part]} for part in (0, 1))

    def extra(op: str) -> float:
        (ec, eu), (rc, ru) = (tables[mode][0].get(op, (0, 0.0)) for mode in modes)
        return ru * rc - eu * ec
    print(f"{'aten op (* routed now; the routed, SDPA and top 12)':52s} {'eager calls, us':>18s} "
          f"{'routed calls, us':>18s} {'extra us':>9s}")
    with nvfly.torch.routing():
        installed = set(routing.installed())
    shown = {op for op in ops if op in ROUTED_OPS or op.startswith(("aten::_scaled_dot", "aten::_fused"))}
    shown |= set(sorted(ops, key=lambda op: -abs(extra(op)))[:12])
    for op in sorted(shown, key=lambda op: -abs(extra(op))):
        (ec, eu), (rc, ru) = (tables[mode][0].get(op, (0, 0.0)) for mode in modes)
        mark = "*" if op in installed else " "
        print(f"{mark}{op[:51]:51s} {ec:8.2f} {eu:9.1f} {rc:8.2f} {ru:9.1f} {extra(op):+9.1f}")
    print(f"{'GPU kernel':80s} {'eager n, us':>15s} {'routed n, us':>15s}")
    for kernel in sorted(kernels, key=lambda k: -max(t[1].get(k, (0, 0.0))[1] for t in tables.values())):
        (ec, eu), (rc, ru) = (tables[mode][1].get(kernel, (0, 0.0)) for mode in modes)
        print(f"{kernel[:80]:80s} {ec:5.2f} {eu:9.1f} {rc:5.2f} {ru:9.1f}")
    if kernels:
        same = set(tables["eager"][1]) == set(tables["routed"][1])
        print(f"same kernels eager and routed: {same}")
    for d in decisions():
        if d.where == "eager":
            print(f"decision: {d.op} {d.shape}: {d.reason or 'nvfly ' + ', '.join(d.candidates)}")


PROFILED_CALLS = 10
ROUTED_OPS = {"aten::scaled_dot_product_attention", "aten::linear", "aten::matmul", "aten::mm", "aten::addmm",
              "aten::rms_norm", "aten::_fused_rms_norm"}  # what the probed calls reach that routing may route


def profiled(fn: Callable[[], Any], around: Callable[[], Any], sync: Callable[[], None]
             ) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]]]:
    """torch.profiler over ``PROFILED_CALLS`` calls of ``fn`` in ``around``: ({aten op: (calls a call, CPU µs an op
    call)}, {GPU kernel: (launches, µs) a call})."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with around():
        sync()
        with profile(activities=activities) as prof:
            for _ in range(PROFILED_CALLS):
                fn()
            sync()
    ops, kernels = {}, {}
    for e in prof.key_averages():
        calls = e.count / PROFILED_CALLS
        if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CUDA:
            us = getattr(e, "self_device_time_total", None)
            us = getattr(e, "self_cuda_time_total", 0.0) if us is None else us
            kernels[e.key] = (calls, us / PROFILED_CALLS)
        elif e.key.startswith("aten::"):
            ops[e.key] = (calls, e.cpu_time_total / e.count)
    return ops, kernels


if __name__ == "__main__":
    sys.exit(main())
