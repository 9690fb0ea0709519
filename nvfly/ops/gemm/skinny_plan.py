"""The skinny GEMM's host side: which B layouts it takes (``reason``), its split-K heuristic
(``default_config``), its plan per call signature (``make_plan``) and the prepared launch (``prepared_launch``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

import nvfly
from nvfly.ops.common import scratch
from nvfly.ops.gemm.config import Epilogue
from nvfly.ops.gemm.skinny_config import CHUNK_K, COLS_ROW_B, MAX_M, ROWS, VECTOR, SkinnyConfig
from nvfly.ops.gemm.skinny_kernel import skinny_gemm_kernel
from nvfly.runtime.torch_args import current_stream


def b_major(b: torch.Tensor) -> str:
    """'col' when B's columns (W's rows) are K-contiguous, 'row' when B's rows are N-contiguous."""
    return "col" if b.stride(-2) == 1 else "row"


def reason(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """None when the skinny kernel can run ``a @ b`` (after ``gemm.eligibility`` accepted it), else why not."""
    if a.shape[-2] > MAX_M:
        return f"M={a.shape[-2]} exceeds {MAX_M}"
    n, batches = b.shape[-1], (b.shape[0] if b.dim() == 3 else 1)
    if b.stride(-2) == 1:
        if b.data_ptr() % 16 or (n > 1 and b.stride(-1) % VECTOR) or (batches > 1 and b.stride(0) % VECTOR):
            return "B^T's rows are not 16-byte aligned"
        return None
    if b.stride(-1) != 1:
        return "B is neither column- nor row-major"
    k = b.shape[-2]
    if n % VECTOR:
        return f"B is row-major and N={n} is not a multiple of {VECTOR} (16-byte row vectors)"
    if b.data_ptr() % 16 or (k > 1 and b.stride(-2) % VECTOR) or (batches > 1 and b.stride(0) % VECTOR):
        return "B's rows are not 16-byte aligned"
    return None


@dataclass(frozen=True)
class SkinnyPlan:
    """Launch parameters of one skinny GEMM signature (cached by ``gemm.matmul``)."""
    config: SkinnyConfig
    m_tiles: int
    m: int
    n: int
    k: int
    chunks_per_split: int
    grid: tuple[int, int, int]
    tiles: int
    epilogue: Epilogue
    row_b: bool = False

    @property
    def tile_slots(self) -> int:
        return (COLS_ROW_B if self.row_b else ROWS) * MAX_M


# CTAs per SM that K splits may fill up to (two 256-thread CTAs of up to 128 registers are resident per SM:
# one wave, no tail), and the fewest k chunks a warp should stream per split (a shorter split spends more on
# its start and reduction than it saves); not yet swept on the H200 (docs/ops/gemm.md, "Skinny kernel")
TARGET_CTAS_PER_SM = 2
MIN_CHUNKS_PER_WARP = 8
# column-major B: how column-major tokens are read by default (SkinnyConfig.column_tokens; tokens that the path
# cannot take fall back to "loads" at trace time): the fastest of the four on the H200 (docs/ops/gemm.md)
COLUMN_B_TOKENS = "registers"
# row-major B: 8 warps, each with a 2-stage ring (64 KB of shared memory per CTA), tokens as 16-byte vectors.
# Its split rule scales a warp's fewest chunks per split with the square of the token tiles: each split adds an
# M x N fp32 reduction and a larger M already keeps more loads in flight per CTA (the sweep: docs/ops/gemm.md)
ROW_B_CONFIG = SkinnyConfig(warps=8, unroll=2, token_vectors=True)
ROW_B_MIN_CHUNKS_PER_WARP = 4


def default_config(m: int, n: int, k: int, batches: int, sms: int, row_b: bool = False) -> SkinnyConfig:
    """Split K across CTAs up to TARGET_CTAS_PER_SM CTAs per SM, keeping each warp's share long."""
    cfg = ROW_B_CONFIG if row_b else SkinnyConfig(column_tokens=COLUMN_B_TOKENS)
    groups = math.ceil(n / (COLS_ROW_B if row_b else ROWS)) * batches
    chunks = math.ceil(k / CHUNK_K)
    wanted = TARGET_CTAS_PER_SM * sms // groups
    per_warp = ROW_B_MIN_CHUNKS_PER_WARP * math.ceil(m / 8) ** 2 if row_b else MIN_CHUNKS_PER_WARP
    longest = max(1, chunks // (cfg.warps * per_warp))
    return replace(cfg, splits=max(1, min(wanted, longest)))


def make_plan(m: int, n: int, k: int, batches: int, has_c: bool, activation: str, scaled: bool,
              config: Optional[SkinnyConfig], sms: int, row_b: bool = False) -> SkinnyPlan:
    config = config or default_config(m, n, k, batches, sms, row_b)
    problem = config.check(row_b)
    if problem:
        raise ValueError(f"config={config}: {problem}" + (" (row-major B)" if row_b else ""))
    epilogue = Epilogue(has_c=has_c, activation=activation, scaled=scaled)
    if row_b:
        # unroll = ring stages per warp; every chunk (the last one partial) is staged, zero-filled past K
        chunks = max(1, math.ceil(k / CHUNK_K))
        per_split = math.ceil(chunks / min(config.splits, chunks))
        splits = math.ceil(chunks / per_split)
        config = replace(config, splits=splits)
        groups = math.ceil(n / COLS_ROW_B)
        return SkinnyPlan(config, math.ceil(m / 8), m, n, k, per_split, (groups * splits, batches, 1),
                          groups * batches, epilogue, True)
    full_chunks = k // CHUNK_K
    # whole unroll groups per split, and no split without chunks (the tail chunk goes to the last split)
    per_split = max(config.unroll, math.ceil(math.ceil(full_chunks / config.splits) / config.unroll) * config.unroll)
    splits = max(1, math.ceil(full_chunks / per_split))
    config = replace(config, splits=splits)
    groups = math.ceil(n / ROWS)
    return SkinnyPlan(config, math.ceil(m / 8), m, n, k, per_split, (groups * splits, batches, 1), groups * batches,
                      epilogue)


def one_batch(t: torch.Tensor) -> torch.Tensor:
    """A 2-D operand as a batch of one with batch stride 0: static in the kernel's specialisation, so that a batch's
    view keeps the operand's alignment (unsqueeze's stride, M for column-major tokens, may be odd, and the staged
    tokens need 16-byte aligned batches: ``tokens_stageable``)."""
    return t.as_strided((1, *t.shape), (0, *t.stride()))


def prepared_launch(plan: SkinnyPlan, shape: tuple) -> Callable[..., None]:
    """``run(a, b, c, out, alpha, beta)`` for one call signature of ``plan`` (2-D or 3-D operands of output
    shape ``shape``; c None or broadcastable): a prepared launch, so a call costs little more than the driver's."""
    cfg = plan.config
    kernel = skinny_gemm_kernel.prepared(plan.grid, cfg.warps * 32)
    batched = len(shape) == 3

    def run(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], out: torch.Tensor, alpha: float,
            beta: float) -> None:
        if kernel.warm:  # the generated launch reads only addresses: the kernel's views start where these do
            w, a3, out3, c3 = b, a, out, c
        else:
            a3, b3, out3 = (a, b, out) if batched else (one_batch(a), b.unsqueeze(0), out.unsqueeze(0))
            c3 = None if c is None else c.expand(shape) if batched else c.expand(shape).unsqueeze(0)
            w = b3 if plan.row_b else b3.transpose(-1, -2)
        if cfg.splits == 1:
            kernel(w, a3, out3, c3, None, None, plan.m, plan.n, plan.k, plan.chunks_per_split, alpha, beta, cfg,
                   plan.m_tiles, plan.epilogue, plan.row_b)
            return
        stream = current_stream(a.device.index)
        partials, counters = scratch.workspace(a.device, stream, plan.tiles, plan.tile_slots)
        kernel(w, a3, out3, c3, partials, counters, plan.m, plan.n, plan.k, plan.chunks_per_split, alpha, beta, cfg,
               plan.m_tiles, plan.epilogue, plan.row_b, stream=stream)
    return run


def compile_kernel(m: int, k: int = 4096, n: int = 4096, dtype: Any = nvfly.bf16, out_dtype: Any = None,
                   has_c: bool = False, activation: str = "none", scaled: bool = False,
                   config: SkinnyConfig = SkinnyConfig(), x_contiguous: bool = True, row_b: bool = False,
                   x_k_stride: Optional[int] = None, target: str = "sm_90a") -> Any:
    """Compile the kernel for one problem class without a GPU; returns the CompiledKernel. ``x_contiguous``
    False: column-major tokens, k elements ``x_k_stride`` (default M) apart."""
    from nvfly.runtime.torch_args import TensorDesc
    w = TensorDesc(dtype, (1, k, n) if row_b else (1, n, k))
    x_k_stride = x_k_stride or m
    x = TensorDesc(dtype, (1, m, k), None if x_contiguous else (x_k_stride * k, 1, x_k_stride))
    out = TensorDesc(out_dtype or dtype, (1, m, n))
    c = TensorDesc(dtype, (1, m, n), (0, 0, 1)) if has_c else None
    split = config.splits > 1
    slots = (COLS_ROW_B if row_b else ROWS) * MAX_M
    partials = TensorDesc(nvfly.f32, (slots * 1024,)) if split else None
    counters = TensorDesc(nvfly.i32, (1024,)) if split else None
    return skinny_gemm_kernel.compile(w, x, out, c, partials, counters, m, n, k, 64, 1.0, 0.0, CFG=config,
                                      M_TILES=math.ceil(m / 8),
                                      EPI=Epilogue(has_c=has_c, activation=activation, scaled=scaled),
                                      ROW_B=row_b, block=config.warps * 32, target=target)
