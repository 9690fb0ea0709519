"""Time skinny-GEMM configs on decode shapes against cuBLAS and the wgmma kernel (tuning aid for
gemm.skinny_plan.TARGET_CTAS_PER_SM / MIN_CHUNKS_PER_WARP / SkinnyConfig defaults and gemm.plan.SKINNY_MAX_M):
python -m benchmarks.gemm_skinny_configs [--shapes M,N,K ...] [--layout rowxcol|rowxrow] [--token-vectors]
[--tokens row|col] [--column-tokens loads,cp.async,registers,movmatrix] [--warps W,...] [--unroll U,...]
[--splits S,...].
rowxcol: B is the F.linear weight (column-major); rowxrow: B is [K, N] row-major (the cp.async + ldmatrix.trans
variant, whose ``unroll`` is its ring depth: gemm.skinny_plan.ROW_B_CONFIG), and --token-vectors adds each config with
SkinnyConfig.token_vectors on (k-permuted stages, tokens as 16-byte vectors) and reports the best of each side.
--tokens col: A is column-major (x.t() of a [K, M] tensor, its rows padded to a multiple of 8 tokens as matmul
needs), the tokens the kernels stage in shared memory; the layout printed then reads colxcol or colxrow.
--column-tokens (rowxcol with --tokens col): each config under each listed SkinnyConfig.column_tokens path (how the
column-major-B kernel reads column-major tokens), reporting the best of each. --warps/--unroll/--splits replace
the grid's values (e.g. --warps 8 --unroll 2,4 --splits 1,2,3,4: 8 configs) to keep a sweep short.
Every config's result is checked against a float32 reference before it is timed. Configs that SkinnyConfig.check
declines are listed and skipped; a config that fails to plan, compile or launch, or computes a wrong result, is
reported (FAILED) and skipped, and the exit status is 1."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_ms, rel_err  # noqa: E402
from nvfly.ops import gemm  # noqa: E402
from nvfly.ops.gemm.skinny_config import COLUMN_TOKENS, SkinnyConfig  # noqa: E402

SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (16, 4096, 14336), (8, 14336, 4096), (1, 28672, 4096),
          (16, 6144, 4096), (4, 1024, 8192)]
# (warps, unroll, splits) values of the config grids
GRID = ((4, 8, 16), (2, 4, 8), (1, 2, 3, 4, 6))
ROW_B_GRID = ((2, 4, 8), (2, 3, 4, 6, 8), (1, 2, 3, 4, 6, 8))
CONFIGS = [SkinnyConfig(w, u, s) for w, u, s in itertools.product(*GRID)]
# the whole grid: configs the kernel cannot take (SkinnyConfig.check, e.g. 8 warps x 8 stages = 256 KB of shared
# memory) are reported and skipped
ROW_B_CONFIGS = [SkinnyConfig(w, u, s) for w, u, s in itertools.product(*ROW_B_GRID)]


def sweep(row_b: bool, token_vectors: bool = False, column_tokens: tuple[str, ...] = (),
          grid: Optional[tuple] = None) -> tuple[list[SkinnyConfig], list[tuple[SkinnyConfig, str]]]:
    """(configs to time, [(declined config, why)]) for one layout; ``token_vectors``: each config also with
    SkinnyConfig.token_vectors on (right after it); ``column_tokens``: each config once per listed
    SkinnyConfig.column_tokens path (in that order); ``grid``: (warps, unroll, splits) values replacing the
    layout's grid (None keeps it; so does a None entry)."""
    configs = ROW_B_CONFIGS if row_b else CONFIGS
    if grid is not None:
        values = [given or default for given, default in zip(grid, ROW_B_GRID if row_b else GRID)]
        configs = [SkinnyConfig(w, u, s) for w, u, s in itertools.product(*values)]
    if token_vectors:
        configs = [c for cfg in configs for c in (cfg, dataclasses.replace(cfg, token_vectors=True))]
    if column_tokens:
        configs = [dataclasses.replace(cfg, column_tokens=path) for cfg in configs for path in column_tokens]
    run, declined = [], []
    for cfg in configs:
        why = cfg.check(row_b)
        if why:
            declined.append((cfg, why))
        else:
            run.append(cfg)
    return run, declined


def tokens(m: int, k: int, major: str, device: str = "cuda") -> torch.Tensor:
    """A [M, K] in bf16: row-major, or column-major with 16-byte k strides (M padded to a multiple of 8)."""
    if major == "row":
        return torch.randn(m, k, device=device).to(torch.bfloat16)
    return torch.randn(k, -(-m // 8) * 8, device=device).to(torch.bfloat16)[:, :m].t()


def try_config(a, b, out, ref, cfg) -> tuple[float, None] | tuple[None, str]:
    """(median ms, None) for one config, or (None, why) when it fails to plan, compile or launch, or computes a
    wrong result; the sweep goes on either way."""
    try:
        out.fill_(float("nan"))
        gemm.matmul(a, b, out=out, config=cfg)
        torch.cuda.synchronize()  # launch errors surface here, at this config
        err = rel_err(out, ref)
        if not err < 1e-2:
            return None, f"wrong result: relative error {err:.3g}"
        return bench_ms(lambda: gemm.matmul(a, b, out=out, config=cfg)), None
    except Exception as exc:  # a ValueError (plan), nvfly.CompileError, nvfly.LaunchError, CudaError, ...
        return None, f"{type(exc).__name__}: {exc}"


def names(text: str) -> tuple[str, ...]:
    return tuple(name for name in text.split(",") if name)


def integers(text: str) -> tuple[int, ...]:
    return tuple(int(value) for value in text.split(",") if value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=None)
    p.add_argument("--layout", default="rowxcol", choices=("rowxcol", "rowxrow"))
    p.add_argument("--token-vectors", action="store_true",
                   help="rowxrow: also time each config with SkinnyConfig.token_vectors on")
    p.add_argument("--tokens", default="row", choices=("row", "col"),
                   help="A's major: col for column-major tokens (the layout becomes colxcol or colxrow)")
    p.add_argument("--column-tokens", type=names, default=(),
                   help="rowxcol with --tokens col: time each config under each of these SkinnyConfig.column_tokens "
                        f"paths (comma-separated: {','.join(COLUMN_TOKENS)})")
    for field in ("warps", "unroll", "splits"):
        p.add_argument(f"--{field}", type=integers, default=None,
                       help=f"comma-separated {field} values replacing the config grid's")
    args = p.parse_args(argv)
    row_b = args.layout == "rowxrow"
    if args.token_vectors and not row_b:
        p.error("--token-vectors is an option of the row-major-B kernel: use it with --layout rowxrow")
    if args.column_tokens and (row_b or args.tokens != "col"):
        p.error("--column-tokens is an option of the column-major-B kernel for column-major tokens: use it with "
                "--layout rowxcol --tokens col")
    unknown = [path for path in args.column_tokens if path not in COLUMN_TOKENS]
    if unknown:
        p.error(f"--column-tokens {','.join(unknown)}: not among {','.join(COLUMN_TOKENS)}")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    configs, declined = sweep(row_b, args.token_vectors, args.column_tokens, (args.warps, args.unroll, args.splits))
    for cfg, why in declined:
        print(f"skipped {cfg}: {why}", flush=True)
    failures = 0
    for m, n, k in shapes:
        a = tokens(m, k, args.tokens)
        b = torch.randn(k, n, device="cuda").to(torch.bfloat16) if row_b else \
            torch.randn(n, k, device="cuda").to(torch.bfloat16).t()
        ref = a.float() @ b.float()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cublas = bench_ms(lambda: torch.mm(a, b, out=out))
        wgmma = bench_ms(lambda: gemm.matmul(a, b, out=out, skinny=False))
        auto = bench_ms(lambda: gemm.matmul(a, b, out=out))
        layout = f"{args.tokens}x{args.layout[-3:]}"
        print(f"{m}x{n}x{k} {layout}: cuBLAS {cublas * 1e3:.1f} us  wgmma {wgmma * 1e3:.1f} us  "
              f"default ({gemm.path(a, b)}) {auto * 1e3:.1f} us  weight {2 * n * k / cublas / 1e6:.0f} GB/s (cuBLAS)",
              flush=True)
        results = []
        for cfg in configs:
            if m > 8 and cfg.unroll > 4 and not row_b and args.tokens == "row":
                continue  # 16 tokens x 8 chunks do not fit the 128-register budget (staged tokens do)
            ms, why = try_config(a, b, out, ref, cfg)
            if why:
                failures += 1
                print(f"    FAILED {cfg}: {why}", flush=True)
            else:
                results.append((ms, cfg))
        for ms, cfg in sorted(results, key=lambda r: r[0])[:8]:
            print(f"    {ms * 1e3:6.1f} us  x{cublas / ms:.2f} vs cuBLAS  {2 * n * k / ms / 1e6:5.0f} GB/s  {cfg}")
        if args.token_vectors:
            for on in (False, True):
                side = [r for r in results if r[1].token_vectors == on]
                if side:
                    ms, cfg = min(side, key=lambda r: r[0])
                    print(f"    best with token_vectors={on}: {ms * 1e3:.1f} us  x{cublas / ms:.2f} vs cuBLAS  {cfg}")
        for path in args.column_tokens:
            side = [r for r in results if r[1].column_tokens == path]
            if side:
                ms, cfg = min(side, key=lambda r: r[0])
                print(f"    best with column_tokens={path}: {ms * 1e3:.1f} us  x{cublas / ms:.2f} vs cuBLAS  {cfg}")
    if failures:
        print(f"{failures} config runs failed (see FAILED above)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
