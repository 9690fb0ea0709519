"""Probe (2026-12-01): RMSNorm forward plans beside Inductor on the long-row suite shapes, interleaved over rounds:
the two-pass kernel at other blocks (448 threads: a 7168 row in one unmasked step) and a one-step kernel that holds
the row in registers. Output: benchmarks/results/rmsnorm_blocks_probe_h200.log. Run from the repo root."""
import functools, statistics, sys, time
import torch
import torch.nn.functional as F
import nvfly
from nvfly.ops import rmsnorm as R
from nvfly.ops.rmsnorm import (load_step, store_vector, block_sum, step_columns, cache_policy, KEEP_L1, STREAM_L1,
                               SM_MAX_WARPS)
from benchmarks.common import bench_ms

EPS = 1e-6


@nvfly.kernel
def keep_kernel(x: nvfly.Tensor, weight: nvfly.Tensor, y: nvfly.Tensor, eps: nvfly.f32,
                N: nvfly.Constexpr, VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr, VECTORS: nvfly.Constexpr,
                HINT: nvfly.Constexpr):
    """One step holds the row: loaded once (x and the weight), reduced, normalised from registers."""
    nvfly.min_blocks_per_sm(SM_MAX_WARPS * 32 // THREADS)
    row = nvfly.block_idx.x
    lane = nvfly.thread_idx.x
    columns = step_columns(0, lane, N, VEC, THREADS, VECTORS)
    hint = None
    if HINT == "stream":
        hint = (STREAM_L1, cache_policy("evict_first"))
    if HINT == "first":
        hint = ("L1::evict_first", cache_policy("evict_normal"))
    xs = load_step(x, row, columns, VEC, hint)
    ws = load_step(weight, None, columns, VEC, (KEEP_L1, cache_policy("evict_last")))
    squares = nvfly.full(VEC, 0.0, nvfly.f32)
    for xv in xs:
        xf = xv.to(nvfly.f32)
        squares = nvfly.fma(xf, xf, squares)
    scratch = nvfly.shared_tensor(nvfly.f32, (THREADS // 32,))
    rstd = nvfly.rsqrt(block_sum(squares.sum(), scratch, THREADS) * (1.0 / N) + eps)
    for v, (col, mask) in enumerate(columns):
        store_vector(y, xs[v].to(nvfly.f32) * rstd * ws[v].to(nvfly.f32), (row, col), VEC, mask, None)


def keep_runner(x, w, threads, vectors, hint):
    m, n = x.shape
    vec = 16 // x.element_size()
    assert threads * vectors * vec >= n
    launch = keep_kernel.prepared(m, threads)
    def run():
        y = torch.empty_like(x)
        launch.launch(x, w, y, EPS, n, vec, threads, vectors, hint)
        return y
    return run


def variants(x, w):
    m, n = x.shape
    vec = 16 // x.element_size()
    out = {"default": functools.partial(R.rms_norm_forward, x, w, EPS, want_rstd=False)}
    def tp(threads, vectors):
        o = R.ForwardOptions(two_pass=True, two_pass_threads=threads, two_pass_vectors=vectors,
                             cache_hints=R.LOAD_HINTS)
        return functools.partial(R.rms_norm_forward, x, w, EPS, want_rstd=False, options=o)
    vectors_row = n // vec
    for threads, vectors in [(vectors_row // 2, 2), (vectors_row, 1), (vectors_row // 4, 4)]:
        if 128 <= threads <= 1024 and threads % 32 == 0 and R.plan_of(x, w, options=R.ForwardOptions(
                two_pass=True, two_pass_threads=threads, two_pass_vectors=vectors)).threads != R.plan_of(x, w).threads:
            out[f"tp {threads}x{vectors}"] = tp(threads, vectors)
    for threads, vectors in [(vectors_row // 2, 2), (vectors_row, 1)]:
        if 128 <= threads <= 1024 and threads % 32 == 0:
            for hint in ("plain", "stream", "first"):
                out[f"keep {threads}x{vectors} {hint}"] = keep_runner(x, w, threads, vectors, hint)
    return out


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    shapes = [(4096, 7168, torch.bfloat16), (16384, 7168, torch.bfloat16), (65536, 7168, torch.bfloat16),
              (4096, 8192, torch.bfloat16), (65536, 8192, torch.bfloat16), (4096, 4096, torch.float32),
              (16384, 8192, torch.bfloat16)]
    import torch._dynamo.config as dc
    dc.recompile_limit = dc.cache_size_limit = 4096
    for m, n, dtype in shapes:
        x = torch.randn(m, n, device="cuda").to(dtype)
        w = torch.randn(n, device="cuda").to(dtype)
        ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS) * w.double())
        runs = variants(x, w)
        for name, run in list(runs.items()):
            torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            out = run()
            y = out[0] if isinstance(out, tuple) else out
            err = float(((y.double() - ref).abs().amax(1) / ref.abs().amax(1)).max())
            if not err < 1e-2:
                print(f"{m}x{n} {name}: WRONG max_err {err}")
                del runs[name]
        compiled = torch.compile(lambda a, b: F.rms_norm(a, (n,), b, EPS), dynamic=False)
        compiled(x, w)
        runs["inductor"] = lambda: compiled(x, w)
        times = {k: [] for k in runs}
        for _ in range(rounds):
            for k, run in runs.items():
                times[k].append(bench_ms(run))
        ind = statistics.median(times["inductor"])
        print(f"--- {m}x{n} {str(dtype)[6:]}: inductor {1e3*ind:.2f} us (spread {1e3*(max(times['inductor'])-min(times['inductor'])):.2f})")
        for k, t in times.items():
            med = statistics.median(t)
            ratios = sorted(ti_i / ti for ti, ti_i in zip(t, times["inductor"]))
            print(f"  {k:<22} {1e3*med:8.2f} us  x{ind/med:.4f} vs inductor  per-round ratios "
                  f"{' '.join(f'{r:.3f}' for r in ratios)}", flush=True)
        del x, w, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
