"""Host overhead of a cached kernel launch: nvfly next to Triton and torch, in the same process.

Each launcher issues N launches of a tiny kernel back to back; the GPU work is negligible, so the time per
launch is the host's. Also the suites' timing floor: ``bench_ms`` (do_bench, L2 flushed) of the same tiny kernels,
the least any one-kernel op can measure there (e.g. MoE routing's torch.topk, 14.4 us, can be beaten by at most its
ratio to this floor). A second row: the host time of an op call with two launches, attention decode (B=1, 32K
keys, 48/8 heads, D 128, bf16; a few hundred calls, fewer than the launch queue holds, so the GPU never blocks the
host), beside its do_bench time eager and replayed from a CUDA graph (their gap is the host cost do_bench sees);
a third: the same for the decode step of ``benchmarks/attention.py``'s window4096-blockmask row (B=16, 8K, 32/8,
a flex BlockMask: the tables launch, decode and combine).
Usage: python -m benchmarks.launch_overhead   (or: nvfly bench launch_overhead)
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nvfly  # noqa: E402
from benchmarks.common import bench_ms, write_results  # noqa: E402


@nvfly.kernel
def tiny_add(x: nvfly.Tensor, y: nvfly.Tensor, out: nvfly.Tensor, n: nvfly.i32):
    i = nvfly.block_idx.x * 128 + nvfly.thread_idx.x
    if i < n:
        out[i] = x[i] + y[i]


def per_launch_us(launch, n: int = 20000, repeats: int = 7) -> float:
    for _ in range(200):
        launch()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            launch()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        samples.append((t1 - t0) / n * 1e6)
    return statistics.median(samples)


def decode_row(masked: bool = False) -> dict:
    """Host and do_bench time per call of an attention decode step (module docstring); ``masked``: the block-mask
    row's step instead."""
    from nvfly.ops import attention
    if masked:
        from benchmarks.attention import window_block_mask
        batch, skv, hq, calls = 16, 8192, 32, 100  # 3 launches a call: 300 stay within the launch queue
        kwargs = {"block_mask": window_block_mask(batch, 1, skv, 4096)}
        name = "attention decode B=16 8K 32/8 D128 bf16, window-4096 BlockMask (3 launches)"
    else:
        batch, skv, hq, calls, kwargs = 1, 32768, 48, 200, {}
        name = "attention decode B=1 32K 48/8 D128 bf16 (2 launches)"
    q = torch.randn(batch, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, skv, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)

    def call():
        attention.decode(q, k, v, out=out, validate=False, **kwargs)
    call()
    torch.cuda.synchronize()
    row = {"kernel": name, "nvfly_us": per_launch_us(call, n=calls, repeats=15)}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    row["bench_ms_eager_us"] = bench_ms(call) * 1e3
    row["bench_ms_graph_us"] = bench_ms(graph.replay) * 1e3
    for key, value in row.items():
        if key != "kernel":
            print(f"{'decode ' + key:>24}: {value:6.2f} us")
    return {key: round(value, 3) if key != "kernel" else value for key, value in row.items()}


def main(argv=None) -> int:
    import triton
    import triton.language as tl

    @triton.jit
    def triton_add(x, y, o, n, B: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(o + i, tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)

    x = torch.randn(1024, device="cuda")
    y = torch.randn_like(x)
    out = torch.empty_like(x)
    n = x.numel()
    launch_nvfly = tiny_add[8, 128]
    launch_nvfly(x, y, out, n)
    assert torch.equal(out, x + y)
    out.zero_()
    triton_add[(8,)](x, y, out, n, B=128)
    assert torch.equal(out, x + y)

    (launcher,) = tiny_add._launchers.values()
    key, raw = tiny_add._binder((x, y, out, n))
    stream = torch.cuda.current_stream().cuda_stream
    results = {
        "nvfly_us": per_launch_us(lambda: launch_nvfly(x, y, out, n)),
        "nvfly_prebound_us": per_launch_us(lambda: launcher.launch((8, 1, 1), stream, raw)),
        "nvfly_launch_method_us": per_launch_us(lambda: tiny_add.launch(x, y, out, n, grid=8, block=128)),
        "triton_us": per_launch_us(lambda: triton_add[(8,)](x, y, out, n, B=128)),
        "torch_add_out_us": per_launch_us(lambda: torch.add(x, y, out=out)),
    }
    results["bench_ms_floor_nvfly_us"] = bench_ms(lambda: launch_nvfly(x, y, out, n)) * 1e3
    results["bench_ms_floor_triton_us"] = bench_ms(lambda: triton_add[(8,)](x, y, out, n, B=128)) * 1e3
    results["bench_ms_floor_torch_zero_us"] = bench_ms(lambda: out.zero_()) * 1e3
    t0 = time.perf_counter()
    for _ in range(100000):
        tiny_add._binder((x, y, out, n))
    results["nvfly_bind_only_us"] = (time.perf_counter() - t0) / 100000 * 1e6
    for k, v in results.items():
        print(f"{k:>24}: {v:6.2f} us")
    rows = [{"kernel": "add 1024 f32 (4 args)", **{k: round(v, 3) for k, v in results.items()},
             "nvfly_over_triton": round(results["nvfly_us"] / results["triton_us"], 3)}, decode_row(),
            decode_row(masked=True)]
    print("wrote", write_results("launch_overhead", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
