"""The epilogues of the wgmma GEMMs (dense, grouped, scaled split-K partials), after the activation (``activate``).

The register epilogue (``store_tile``) stores each thread's accumulator fragments straight to global memory as
4-byte pairs (masked on tails). The TMA-store epilogue (``stage_tile``, 16-bit outputs: the dense GEMM and the
K-grouped weight gradient) writes the fragments with ``stmatrix`` into a per-consumer staging buffer laid out like
the output TMA box (column slices of W = 64/32/16 elements, 128/64/32-byte swizzle: the 8 rows one stmatrix matrix
writes land in 8 different 16-byte bank groups), fences the generic proxy against the async one, syncs the
consumer's 128 threads on a named barrier and lets one thread issue a TMA store per slice (TMA clips tails). A
slice buffer is reused only after ``cp.async.bulk.wait_group.read``, so a tile's stores drain while the consumer
runs the next tile's mainloop; a tile's first slice waits for every store of the previous tile, unless the config's
``store_tiles`` buffers the slices of several tiles (then each slice waits only for its buffer's last store).
Stream K (dense and scaled): ``fix_up`` adds a shared tile's part into its workspace slot, and the part counted in
last takes the sums into the epilogue.
"""
from __future__ import annotations

from typing import Any

import nvfly
from nvfly.arch import sm90
from nvfly.arch.gpu_scope import arrive, load_relaxed, red_add, store_zeros_x4
from nvfly.ops.common.gemm_config import STORE_BARRIER, StagedStore, store_box


@nvfly.func
def activate(x, KIND):
    if KIND == "relu":
        x = nvfly.maximum(x, 0.0)
    elif KIND == "gelu_tanh":
        x = 0.5 * x * (1.0 + nvfly.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif KIND == "silu":
        x = x / (1.0 + nvfly.exp2(x * -1.4426950408889634))
    return x


def _unit_stride(t: Any, dim: int) -> bool:
    """Whether dimension ``dim`` of a traced tensor is statically contiguous (allows vector stores)."""
    return isinstance(t.stride[dim], int) and t.stride[dim] == 1


@nvfly.func
def store_tile(out, c_in, accs, batch, row0, col0, m, n, alpha, beta, BN, ATOMS_M, EPI, inside):
    """Write the consumer's fragments (``store_fragments``): where the tile lies ``inside`` the output (a traced
    condition: the common case), without bounds checks; else masked to [0, m) x [0, n)."""
    if inside:
        store_fragments(out, c_in, accs, batch, row0, col0, m, n, alpha, beta, BN, ATOMS_M, EPI, False)
    else:
        store_fragments(out, c_in, accs, batch, row0, col0, m, n, alpha, beta, BN, ATOMS_M, EPI, True)


@nvfly.func
def store_fragments(out, c_in, accs, batch, row0, col0, m, n, alpha, beta, BN, ATOMS_M, EPI, MASKED):
    """Write the consumer's fragments: element 4j+2h+e of atom i is (row0 + 64i + 8h, col0 + 8j + e).

    Without MASKED (the tile lies inside the output) no element is bounds-checked.
    """
    vec = _unit_stride(out, 2)
    for i in nvfly.static_range(ATOMS_M):
        for h in nvfly.static_range(2):
            row = row0 + 64 * i + 8 * h
            if not MASKED or row < m:
                for j in nvfly.static_range(BN // 8):
                    col = col0 + 8 * j
                    v0 = accs[i][4 * j + 2 * h]
                    v1 = accs[i][4 * j + 2 * h + 1]
                    if not EPI.partial:
                        if EPI.scaled:
                            v0 = v0 * alpha
                            v1 = v1 * alpha
                        if EPI.has_c:
                            if not MASKED or col < n:
                                v0 = v0 + beta * c_in[batch, row, col].to(nvfly.f32)
                            if not MASKED or col + 1 < n:
                                v1 = v1 + beta * c_in[batch, row, col + 1].to(nvfly.f32)
                        v0 = activate(v0, EPI.activation)
                        v1 = activate(v1, EPI.activation)
                    if vec and (not MASKED or col + 1 < n):
                        out.store(nvfly.make_vector([v0, v1]).to(out.dtype), batch, row, col)
                    else:
                        if not MASKED or col < n:
                            out[batch, row, col] = v0.to(out.dtype)
                        if not MASKED or col + 1 < n:
                            out[batch, row, col + 1] = v1.to(out.dtype)


def staging_offset(row: Any, chunk: Any, row_bytes: int) -> Any:
    """Byte offset of 16-byte chunk ``chunk`` of row ``row`` in a staging slice of ``row_bytes``-byte rows
    swizzled as TMA's ``row_bytes`` swizzle (CUTLASS Swizzle<B,4,3> on byte offsets from a 1024-aligned base:
    address bits 4.. XOR bits 7..)."""
    offset = row * row_bytes
    return offset + ((chunk ^ ((offset >> 7) & (row_bytes // 16 - 1))) << 4)


def staging_ring_slot(staged: Any, s: int, slices: int, ring: int) -> Any:
    """The staging buffer of slice ``s`` (of ``slices`` a tile) of a consumer's tile after ``staged`` others when
    the slices rotate through ``ring`` buffers (``store_tiles`` > 1): the consumer's slice count modulo the ring, so
    the store that read the buffer last is ``ring`` stores back (``tests/test_grouped_cpu.py`` models the waits)."""
    return (staged * slices + s) % ring


def staging_lane_xor(lane_row: Any, lane: Any, row_bytes: int) -> Any:
    """For stmatrix lane ``lane`` giving the address of row ``lane_row``: the byte term X with
    staging_offset(lane_row, j + lane // 16, row_bytes) == lane_row * row_bytes + ((16 * j) ^ X) for every
    even chunk j (the swizzle XOR of the row, and the lane's chunk j + lane // 16 = j ^ (lane // 16))."""
    return ((((lane_row * row_bytes) >> 7) & (row_bytes // 16 - 1)) ^ (lane // 16)) << 4


def check_store_descriptor(desc: Any, cfg: StagedStore, batched: bool) -> None:
    """The output descriptor the TMA-store epilogue needs: 16-bit, one (wg_m, store_width) box per slice with
    the matching swizzle (see ``store_box``)."""
    from nvfly.errors import CompileError
    if desc is None or not hasattr(desc, "info"):
        raise CompileError("tma_store needs the output's TMA descriptor (out_desc)")
    box, swizzle = store_box(cfg, batched)
    info = desc.info
    if info.dtype.itemsize != 2 or tuple(info.box) != box or info.swizzle != swizzle:
        raise CompileError(f"out_desc: expected a 16-bit descriptor with box {box} and swizzle {swizzle}, got "
                           f"{info.dtype.name} box {tuple(info.box)} swizzle {info.swizzle}")


@nvfly.func
def stage_tile(out_desc, c_in, accs, own, batch, tile_row, tile_col, row0, col0, m, n, alpha, beta, consumer,
               warp_in_wg, lane, CFG, ATOMS_M, EPI, BATCHED, MASKED, staged=None):
    """The TMA-store epilogue of one consumer tile (see the module doc). ``own``: this consumer's staging
    buffers (store_slices x store_tiles slices of wg_m x W elements, W = store_width), ``tile_row``/``tile_col``:
    the consumer's first output row and column; ``row0``/``col0``: this thread's fragment origin (as store_tile);
    ``staged``: the tiles this consumer staged before (``CFG.store_tiles`` > 1 only: its slices continue the
    rotation through the buffers, each waiting only for the store that last read its buffer, store_tiles tiles
    back, instead of every store of the previous tile).

    stmatrix.x4 stores four 8x8 matrices: for accumulator column group j (even) and row half h, matrix
    q = 2 * jj + h holds accumulator elements 4 (j + jj) + 2 h + {0, 1}, i.e. the register order is the
    accumulator order 4j .. 4j + 7; lane l gives the row address of matrix l // 8: row 16 w + l % 16, column
    chunk j + l // 16 (jj = l // 16, h = (l // 8) % 2).
    """
    W = CFG.store_width
    ROW_BYTES = W * 2
    SLICE_BYTES = CFG.wg_m * ROW_BYTES
    NB = CFG.store_slices
    NS = CFG.bn // W
    dtype = out_desc.info.dtype
    RING = NB * CFG.store_tiles  # staging buffers of this consumer
    if RING > NB and staged is None:
        from nvfly.errors import CompileError
        raise CompileError("stage_tile: store_tiles > 1 needs the consumer's count of staged tiles (staged)")
    issuer = (warp_in_wg == 0) & (lane == 0)
    lane_row = warp_in_wg * 16 + lane % 16
    lane_base = own + lane_row * ROW_BYTES
    lane_x = staging_lane_xor(lane_row, lane, ROW_BYTES)
    for s in nvfly.static_range(NS):
        if RING > NB:
            # slice number staged * NS + s of this consumer: the store that read its buffer last is RING slices
            # (one group each) back, so at most RING - 1 newer groups may still be reading
            b = staging_ring_slot(staged, s, NS, RING)
            if issuer:
                sm90.tma_store_wait(RING - 1, read_only=True)
            nvfly.named_barrier(STORE_BARRIER + consumer, 128)
        else:
            b = s % NB
            if s == 0 or s >= NB:
                # the slice buffer's previous TMA store (this tile's slice s - NB, or the previous tile's) has
                # read it
                if issuer:
                    sm90.tma_store_wait(0 if s == 0 else NB - 1, read_only=True)
                nvfly.named_barrier(STORE_BARRIER + consumer, 128)
        for i in nvfly.static_range(ATOMS_M):
            for jj in nvfly.static_range(W // 16):
                j = s * (W // 8) + 2 * jj
                regs = []
                for q in nvfly.static_range(4):
                    e = 4 * j + 2 * q
                    v0 = accs[i][e]
                    v1 = accs[i][e + 1]
                    if EPI.scaled:
                        v0 = v0 * alpha
                        v1 = v1 * alpha
                    if EPI.has_c:
                        row = row0 + 64 * i + 8 * (q % 2)
                        col = col0 + 8 * (j + q // 2)
                        if not MASKED or (row < m) & (col < n):
                            v0 = v0 + beta * c_in[batch, row, col].to(nvfly.f32)
                        if not MASKED or (row < m) & (col + 1 < n):
                            v1 = v1 + beta * c_in[batch, row, col + 1].to(nvfly.f32)
                    v0 = activate(v0, EPI.activation)
                    v1 = activate(v1, EPI.activation)
                    regs.append(nvfly.make_vector([v0, v1]).to(dtype).bitcast(nvfly.i32)[0])
                sm90.stmatrix_x4(lane_base + (b * SLICE_BYTES + 64 * i * ROW_BYTES) + (((2 * jj) << 4) ^ lane_x),
                                 regs)
        sm90.fence_proxy_async()  # the stmatrix writes before the TMA engine's reads
        nvfly.named_barrier(STORE_BARRIER + consumer, 128)
        if issuer:
            coords = (tile_row, tile_col + s * W)
            sm90.tma_store(out_desc, own + b * SLICE_BYTES, (batch,) + coords if BATCHED else coords)
            sm90.tma_store_commit()


@nvfly.func
def fix_up(accs, partial, workspace, counters, index, arrivals, consumer, warp_in_wg, lane, contributors, ATOMS_M,
           BN):
    """Stream-K fix-up of one consumer tile: (values for the epilogue, whether to run it). A ``partial`` unit
    (uniform over the warpgroup) adds its fragments into workspace slot ``index`` (each thread's 16-byte vectors
    2 KB apart, so the warpgroup's adds are coalesced) and counts itself in on ``counters[index]``; the unit
    that counts in last reads the complete sums back, zeroes the slot and the count for the next launch, and runs
    the epilogue with them. Whole tiles keep their accumulators."""
    VECTORS = BN // 8  # 16-byte vectors per atom row of fragments
    first = index * (ATOMS_M * 64 * BN) + 4 * (warp_in_wg * 32 + lane)
    if partial:
        for i in nvfly.static_range(ATOMS_M):
            for q in nvfly.static_range(VECTORS):
                red_add(workspace.address(first + 512 * (i * VECTORS + q)), [accs[i][4 * q + e] for e in range(4)])
        nvfly.threadfence()  # this thread's adds are visible GPU-wide before the warpgroup counts itself in
        nvfly.named_barrier(STORE_BARRIER + consumer, 128)
        if (warp_in_wg == 0) & (lane == 0):
            arrivals[consumer] = arrive(counters.address(index))
        nvfly.named_barrier(STORE_BARRIER + consumer, 128)
    last = partial & (arrivals[consumer] == contributors - 1)
    values = [[accs[i][e] for e in range(BN // 2)] for i in range(ATOMS_M)]
    if last:  # (a branch, not selects: the sums replace the accumulators, so both are never live at once)
        nvfly.threadfence()
        values = []
        for i in nvfly.static_range(ATOMS_M):
            row = []
            for q in nvfly.static_range(VECTORS):
                row += load_relaxed(workspace.address(first + 512 * (i * VECTORS + q)), nvfly.f32, 4)
            values.append(row)
        for j in nvfly.static_range(ATOMS_M * VECTORS):
            store_zeros_x4(workspace.address(first + 512 * j))
        if (warp_in_wg == 0) & (lane == 0):
            counters[index] = 0
    return values, (~partial) | last
