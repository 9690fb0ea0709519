"""Skinny GEMM for decode shapes (M <= 16): a memory-bound stream of the weight through mma.sync.

    out = act(alpha * A @ B + beta * C)       A: [(B,) M, K] (M <= 16), B: [(B,) K, N] column-major

With M this small the weight B dominates the traffic (N x K elements read once), so the kernel is built to
stream it at the memory roofline rather than to fill tensor cores. It computes the transposed product
out^T = W @ A^T with W = B^T ([N, K], K contiguous: the ``F.linear`` weight): W's rows are the A operand of
``mma.m16n8k16`` (16 output columns per warp), A's rows its B operand (8 tokens per mma, two mmas for M > 8).

K permutation. The k order inside a reduction is free, so each lane loads 16 bytes (8 consecutive k) of W
row g and of row g + 8 (g = lane / 4) at k offset 8 * (lane % 4) of a 32-wide k chunk and uses them as the
fragment values of two k16 mma steps; A's rows are loaded with the same mapping (``A_REGISTER_WORDS``,
``B_REGISTER_WORDS``). A warp's load instruction thus covers 16 rows x 64 contiguous bytes with no shared
memory and no shuffles. Rows past M or N are clamped (their results are never stored); only the last k chunk
(K % 32) is predicated and masked element by element, since garbage there would meet real data.

Parallelism. A CTA owns one group of 16 output columns (N rows of W); its warps split the CTA's K range in
groups of ``unroll`` chunks (``unroll`` KB of W in flight per warp) and reduce through shared memory. When
that gives too few CTAs for the memory system, ``splits`` CTAs share a group, each with its own K range: they
add fp32 partial sums into a zero-initialised workspace (``red.global.add``) and count arrivals on a
per-tile counter; the last CTA to arrive applies the epilogue, writes the output and resets its workspace
slice and counter to zero, so the next launch needs no memset and there is no second kernel. Workspaces are
cached per (device, stream): launches on one stream are ordered, so they may share one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

import nvfly
from nvfly.arch import sm80
from nvfly.arch.ptx import asm, asm_multi
from nvfly.frontend import dtypes
from nvfly.ops.gemm_kernel import Epilogue, activate
from nvfly.ops.rmsnorm import min_blocks_per_sm
from nvfly.runtime.torch_args import current_stream

MAX_M = 16              # two n8 mma tiles of tokens
ROWS = 16               # output columns (W rows) per CTA: the mma's M
CHUNK_K = 32            # k per chunk: 32 lanes x 16 bytes cover 16 rows x 32 k, two k16 mma steps
VECTOR = 8              # elements per lane per row per chunk (16 bytes)
TILE_SLOTS = ROWS * MAX_M  # fp32 workspace slots per output tile (16 columns x up to 16 tokens)

# mma fragment registers from the loaded 32-bit words (each word: two consecutive k of one row).
# A (W): register r of k16 step s is word 2 * s + offset of row g (half 0) or g + 8 (half 1), with
# (half, offset) = A_REGISTER_WORDS[r]; B (A's token row g): register r of step s is word 2 * s + r.
A_REGISTER_WORDS = ((0, 0), (1, 0), (0, 1), (1, 1))
B_REGISTER_WORDS = (0, 1)


@dataclass(frozen=True)
class SkinnyConfig:
    """warps: per CTA, splitting its K range; unroll: 32-wide k chunks a warp loads before its mmas (1 KB of W
    each); splits: CTAs per 16-column group, each reducing one K range (fp32 workspace when > 1)."""
    warps: int = 8
    unroll: int = 4
    splits: int = 1

    def check(self) -> Optional[str]:
        if not 1 <= self.warps <= 32:
            return f"warps={self.warps}: 1 to 32"
        if not 1 <= self.unroll <= 16:
            return f"unroll={self.unroll}: 1 to 16"
        if self.splits < 1:
            return f"splits={self.splits}: at least 1"
        return None


# ---------------------------------------------------------------------------------------------- index maps
def a_fragment_source(lane: int, register: int, half: int, step: int) -> tuple[int, int]:
    """(W row within the 16-row group, k within the 32-wide chunk) that lane ``lane`` puts in A register
    ``register`` (16-bit ``half``) of k16 step ``step`` (the kernel's loads and A_REGISTER_WORDS)."""
    row_half, offset = A_REGISTER_WORDS[register]
    word = 2 * step + offset
    return lane // 4 + 8 * row_half, VECTOR * (lane % 4) + 2 * word + half


def b_fragment_source(lane: int, register: int, half: int, step: int) -> tuple[int, int]:
    """(k within the chunk, token within the n8 tile) that lane ``lane`` puts in B register ``register``."""
    word = 2 * step + B_REGISTER_WORDS[register]
    return VECTOR * (lane % 4) + 2 * word + half, lane // 4


def c_fragment_target(lane: int, index: int) -> tuple[int, int]:
    """(W row within the group, token within the n8 tile) of accumulator ``index`` (PTX's C layout)."""
    return lane // 4 + 8 * (index // 2), 2 * (lane % 4) + index % 2


# ---------------------------------------------------------------------------------------------- device helpers
def load_stream(address: Any) -> list:
    """16 bytes of the streamed weight as four i32 words: read-only path, not kept in L1, 256-byte L2
    prefetch (every byte is read once)."""
    return asm_multi("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {$0, $1, $2, $3}, [$4];",
                     [dtypes.i32] * 4, [address], side_effects=False)


def load_stream_predicated(address: Any, valid: Any) -> list:
    """``load_stream`` where ``valid`` (i1) holds, else four zero words (nothing is read)."""
    return asm_multi("{ .reg .pred p; setp.ne.b32 p, $4, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; "
                     "mov.b32 $3, 0; @p ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$5]; }",
                     [dtypes.i32] * 4, [valid.to(dtypes.i32), address], side_effects=False)


def keep_first(words: list, valid: Any) -> list:
    """The words with every element from index ``valid`` on (two 16-bit elements a word, low half first)
    set to zero."""
    out = []
    for j, word in enumerate(words):
        mask = nvfly.select(valid >= 2 * j + 2, -1, nvfly.select(valid == 2 * j + 1, 0xFFFF, 0))
        out.append(word & mask)
    return out


def load_tokens(x_row: Any, kk: Any) -> list:
    """Eight consecutive k of one token row as four i32 words (one 16-byte load when K is contiguous)."""
    if isinstance(x_row.stride[0], int) and x_row.stride[0] == 1:
        return x_row.load(kk, width=VECTOR).bitcast(nvfly.i32).tolist()
    values = [x_row[kk + j] for j in range(VECTOR)]
    return nvfly.make_vector(values, x_row.dtype).bitcast(nvfly.i32).tolist()


def load_chunk(w_rows: tuple, x_rows: list, kk: Any) -> tuple:
    """One 32-wide k chunk at this lane's offset ``kk``: W rows g and g + 8, and each token tile's row g."""
    return [load_stream(w.address(kk)) for w in w_rows], [load_tokens(x, kk) for x in x_rows]


def load_tail_chunk(w_rows: tuple, x_rows: list, kk: Any, k: Any) -> tuple:
    """The last, partial chunk: nothing is read at or past K and those elements are zero in both operands
    (the padding of W's rows could hold NaN)."""
    valid = k - kk
    ws = [keep_first(load_stream_predicated(w.address(kk), valid > 0), valid) for w in w_rows]
    xs = []
    for x in x_rows:
        values = [x.load(kk + j, mask=kk + j < k) for j in range(VECTOR)]
        xs.append(nvfly.make_vector(values, x.dtype).bitcast(nvfly.i32).tolist())
    return ws, xs


def mma_chunk(accs: list, chunk: tuple, dtype: Any) -> list:
    """Accumulate one chunk: two k16 steps for each token tile."""
    w_words, x_words = chunk
    out = [list(a) for a in accs]
    for step in range(CHUNK_K // 16):
        a = [w_words[half][2 * step + offset] for half, offset in A_REGISTER_WORDS]
        for t in range(len(out)):
            b = [x_words[t][2 * step + r] for r in B_REGISTER_WORDS]
            out[t] = sm80.mma_m16n8k16(a, b, out[t], dtype)
    return out


def red_add(address: Any, value: Any) -> None:
    asm("red.relaxed.gpu.global.add.f32 [$0], $1;", [address, value])


def arrive(address: Any) -> Any:
    """Count this CTA in (acq_rel at GPU scope); the previous count."""
    return asm("atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;", [address], result=dtypes.i32)


def load_relaxed(address: Any) -> Any:
    return asm("ld.relaxed.gpu.global.f32 $0, [$1];", [address], result=dtypes.f32)


@nvfly.func
def finish(value, out, c_in, batch, row, col, alpha, beta, EPI):
    """out[batch, row, col] = act(alpha * value + beta * C_in[batch, row, col])."""
    if EPI.scaled:
        value = value * alpha
    if EPI.has_c:
        value = value + beta * c_in[batch, row, col].to(nvfly.f32)
    out[batch, row, col] = activate(value, EPI.activation).to(out.dtype)


# ---------------------------------------------------------------------------------------------- the kernel
@nvfly.kernel
def skinny_gemm_kernel(w: nvfly.Tensor, x: nvfly.Tensor, out: nvfly.Tensor, c_in, workspace, counters,
                       m: nvfly.i32, n: nvfly.i32, k: nvfly.i32, chunks_per_split: nvfly.i32, alpha: nvfly.f32,
                       beta: nvfly.f32, CFG: nvfly.Constexpr, M_TILES: nvfly.Constexpr, EPI: nvfly.Constexpr):
    """out[b] = act(alpha * x[b] @ w[b]^T + beta * C_in[b]): w [B, N, K] with K contiguous and 16-byte aligned
    rows, x [B, M, K], out and C_in [B, M, N]. Grid: (16-column groups x splits, batches)."""
    WARPS, UNROLL, SPLITS = CFG.warps, CFG.unroll, CFG.splits
    THREADS = WARPS * 32
    TOKENS = 8 * M_TILES
    TILE = ROWS * TOKENS
    min_blocks_per_sm(max(1, 512 // THREADS))  # a 128-register budget (64 spills the unrolled loads)
    dtype = w.dtype
    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    lane = nvfly.lane_idx()
    batch = nvfly.block_idx.y
    group = nvfly.block_idx.x // SPLITS
    split = nvfly.block_idx.x % SPLITS
    g = lane // 4
    kq = (lane % 4) * VECTOR
    # rows past N and tokens past M are clamped: they only feed results that are not stored
    w_rows = (w[batch, nvfly.minimum(group * ROWS + g, n - 1), :],
              w[batch, nvfly.minimum(group * ROWS + g + 8, n - 1), :])
    x_rows = [x[batch, nvfly.minimum(g + 8 * t, m - 1), :] for t in nvfly.static_range(M_TILES)]

    accs = [[nvfly.f32(0.0)] * 4 for _ in nvfly.static_range(M_TILES)]
    full_chunks = k // CHUNK_K
    c_begin = split * chunks_per_split
    c_end = nvfly.minimum(c_begin + chunks_per_split, full_chunks)
    groups = (c_end - c_begin) // UNROLL
    for gi in range(warp, groups, WARPS):
        first = c_begin + gi * UNROLL
        chunks = [load_chunk(w_rows, x_rows, (first + u) * CHUNK_K + kq) for u in nvfly.static_range(UNROLL)]
        for u in nvfly.static_range(UNROLL):
            accs = mma_chunk(accs, chunks[u], dtype)
    for c in range(c_begin + groups * UNROLL + warp, c_end, WARPS):
        accs = mma_chunk(accs, load_chunk(w_rows, x_rows, c * CHUNK_K + kq), dtype)
    if (split == SPLITS - 1) & (warp == WARPS - 1) & (full_chunks * CHUNK_K < k):
        accs = mma_chunk(accs, load_tail_chunk(w_rows, x_rows, full_chunks * CHUNK_K + kq, k), dtype)

    # every warp's fragments into shared memory as [warp][token][row], then one thread per output sums them
    partial = nvfly.shared_tensor(nvfly.f32, (WARPS * TILE,))
    for t in nvfly.static_range(M_TILES):
        for i in nvfly.static_range(4):
            row = g + 8 * (i // 2)
            token = 8 * t + 2 * (lane % 4) + i % 2
            partial[warp * TILE + token * ROWS + row] = accs[t][i]
    nvfly.syncthreads()
    tile = batch * ((n + ROWS - 1) // ROWS) + group
    totals = []
    for p in nvfly.static_range((TILE + THREADS - 1) // THREADS):
        e = p * THREADS + tid
        total = partial[nvfly.minimum(e, TILE - 1)]
        for v in nvfly.static_range(1, WARPS):
            total = total + partial[v * TILE + nvfly.minimum(e, TILE - 1)]
        token = e // ROWS
        col = group * ROWS + e % ROWS
        valid = (e < TILE) & (token < m) & (col < n)
        totals.append((total, token, col, valid, tile * TILE_SLOTS + e))
    if SPLITS == 1:
        for total, token, col, valid, slot in totals:
            if valid:
                finish(total, out, c_in, batch, token, col, alpha, beta, EPI)
    else:
        for total, token, col, valid, slot in totals:
            if valid:
                red_add(workspace.address(slot), total)
        nvfly.threadfence()  # this thread's sums are visible GPU-wide before the CTA counts itself in
        arrived = nvfly.shared_tensor(nvfly.i32, (1,))
        nvfly.syncthreads()
        if tid == 0:
            arrived[0] = arrive(counters.address(tile))
        nvfly.syncthreads()
        if arrived[0] == SPLITS - 1:  # the last CTA of this tile: every other split's sums are in
            nvfly.threadfence()
            for partial_sum, token, col, valid, slot in totals:
                if valid:
                    total = load_relaxed(workspace.address(slot))
                    workspace[slot] = 0.0
                    finish(total, out, c_in, batch, token, col, alpha, beta, EPI)
            if tid == 0:
                counters[tile] = 0


# ---------------------------------------------------------------------------------------------- host side
def reason(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """None when the skinny kernel can run ``a @ b`` (after ``gemm.eligibility`` accepted it), else why not."""
    if a.shape[-2] > MAX_M:
        return f"M={a.shape[-2]} exceeds {MAX_M}"
    n, batches = b.shape[-1], (b.shape[0] if b.dim() == 3 else 1)
    if b.stride(-2) != 1:
        return "B is not column-major (the weight's rows, B^T, must be K-contiguous)"
    if b.data_ptr() % 16 or (n > 1 and b.stride(-1) % VECTOR) or (batches > 1 and b.stride(0) % VECTOR):
        return "B^T's rows are not 16-byte aligned"
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


# CTAs per SM that K splits may fill up to (two 256-thread CTAs of up to 128 registers are resident per SM:
# one wave, no tail), and the fewest k chunks a warp should stream per split (a shorter split spends more on
# its start and reduction than it saves); to be tuned on the H200 (benchmarks/gemm_skinny_configs.py)
TARGET_CTAS_PER_SM = 2
MIN_CHUNKS_PER_WARP = 8


def default_config(n: int, k: int, batches: int, sms: int) -> SkinnyConfig:
    """Split K across CTAs up to TARGET_CTAS_PER_SM CTAs per SM, keeping each warp's share long."""
    cfg = SkinnyConfig()
    groups = math.ceil(n / ROWS) * batches
    chunks = math.ceil(k / CHUNK_K)
    wanted = TARGET_CTAS_PER_SM * sms // groups
    longest = max(1, chunks // (cfg.warps * MIN_CHUNKS_PER_WARP))
    return SkinnyConfig(cfg.warps, cfg.unroll, max(1, min(wanted, longest)))


def make_plan(m: int, n: int, k: int, batches: int, has_c: bool, activation: str, scaled: bool,
              config: Optional[SkinnyConfig], sms: int) -> SkinnyPlan:
    config = config or default_config(n, k, batches, sms)
    problem = config.check()
    if problem:
        raise ValueError(f"SkinnyConfig: {problem}")
    full_chunks = k // CHUNK_K
    # whole unroll groups per split, and no split without chunks (the tail chunk goes to the last split)
    per_split = max(config.unroll, math.ceil(math.ceil(full_chunks / config.splits) / config.unroll) * config.unroll)
    splits = max(1, math.ceil(full_chunks / per_split))
    config = SkinnyConfig(config.warps, config.unroll, splits)
    groups = math.ceil(n / ROWS)
    return SkinnyPlan(config, math.ceil(m / 8), m, n, k, per_split, (groups * splits, batches, 1), groups * batches,
                      Epilogue(has_c=has_c, activation=activation, scaled=scaled))


_WORKSPACES: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device, stream: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partial sums, i32 arrival counters) for ``tiles`` output tiles, zero between launches (each
    launch leaves them zeroed); one pair per (device, stream), grown as needed. Allocate outside CUDA graph
    capture (the first split call on a stream allocates)."""
    key = (device.index, stream)
    entry = _WORKSPACES.get(key)
    if entry is None or entry[1].numel() < tiles:
        size = max(tiles, 2 * entry[1].numel() if entry is not None else 0, 1024)
        entry = (torch.zeros(size * TILE_SLOTS, dtype=torch.float32, device=device),
                 torch.zeros(size, dtype=torch.int32, device=device))
        _WORKSPACES[key] = entry
    return entry


def launch(plan: SkinnyPlan, a3: torch.Tensor, b3: torch.Tensor, out3: torch.Tensor, c3: Optional[torch.Tensor],
           alpha: float, beta: float) -> None:
    """Run the planned GEMM on 3-D operands: a3 [B, M, K], b3 [B, K, N] (column-major), out3/c3 [B, M, N]."""
    cfg = plan.config
    w = b3.transpose(-1, -2)
    kernel = skinny_gemm_kernel[plan.grid, cfg.warps * 32]
    if cfg.splits == 1:
        kernel(w, a3, out3, c3, None, None, plan.m, plan.n, plan.k, plan.chunks_per_split, alpha, beta, cfg,
               plan.m_tiles, plan.epilogue)
        return
    stream = current_stream(a3.device.index)
    partials, counters = workspace(a3.device, stream, plan.tiles)
    kernel(w, a3, out3, c3, partials, counters, plan.m, plan.n, plan.k, plan.chunks_per_split, alpha, beta, cfg,
           plan.m_tiles, plan.epilogue, stream=stream)


def compile_kernel(m: int, k: int = 4096, n: int = 4096, dtype: Any = nvfly.bf16, out_dtype: Any = None,
                   has_c: bool = False, activation: str = "none", scaled: bool = False,
                   config: SkinnyConfig = SkinnyConfig(), x_contiguous: bool = True, target: str = "sm_90a") -> Any:
    """Compile the kernel for one problem class without a GPU; returns the CompiledKernel."""
    from nvfly.runtime.torch_args import TensorDesc
    w = TensorDesc(dtype, (1, n, k))
    x = TensorDesc(dtype, (1, m, k), None if x_contiguous else (m * k, 1, m))
    out = TensorDesc(out_dtype or dtype, (1, m, n))
    c = TensorDesc(dtype, (1, m, n), (0, 0, 1)) if has_c else None
    split = config.splits > 1
    partials = TensorDesc(nvfly.f32, (TILE_SLOTS * 1024,)) if split else None
    counters = TensorDesc(nvfly.i32, (1024,)) if split else None
    return skinny_gemm_kernel.compile(w, x, out, c, partials, counters, m, n, k, 64, 1.0, 0.0, CFG=config,
                                      M_TILES=math.ceil(m / 8),
                                      EPI=Epilogue(has_c=has_c, activation=activation, scaled=scaled),
                                      block=config.warps * 32, target=target)
