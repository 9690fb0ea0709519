"""The scaled (FP8) GEMM kernel: persistent, warp-specialised, TMA + mbarrier ring + fp8 wgmma, scales applied in
the mainloop (block recipes, promotion) or in the epilogue (tensor-wise and row-wise).

The kernel computes out[i, j] = scale(sum_k A[i, k] * B[j, k]) (+ bias) with A (M x K) and B (N x K) both K-major
e4m3/e5m2 (fp8 wgmma reads no transposed operand: exactly ``torch._scaled_mm``'s row-major a and column-major b).
The schedule is the dense GEMM's: one block per SM walks output tiles (nvfly.ops.common.scheduler, grouped
rasterisation; with ``ScaledConfig.stream_k`` a partial last wave dealt out as k ranges, shared tiles summed by
``nvfly.ops.common.epilogue.fix_up``, which also sums split K's splits with ``ScaledConfig.split_fix_up``);
warpgroup 0's first thread keeps a ring of 128-element k-blocks full with TMA loads; consumer warpgroups 1..C each
own bm/C rows of the tile. With ``ScaledConfig.cluster_n`` > 1 the blocks run in clusters along N: a cluster takes
adjacent tile columns of one tile row, each block TMA-loads its slice of the shared A tile into every block of the
cluster (multicast) and its own B tile, and frees a stage on every block's empty barrier (a cluster column past N is
computed and not stored).

Two mainloops (``ScaledEpilogue.promote``):
- accumulate: the wgmmas of every k-block add into one accumulator, one wgmma group in flight (the dense GEMM's
  mainloop: ``nvfly.ops.common.mainloop.consume_k_blocks``), the fastest and torch's ``use_fast_accum=True``;
- promote (DeepGEMM's scheme, the accuracy DeepSeek-V3 needs): each k-block of 128 is issued into a fresh
  accumulator, waited for, and added into an fp32 sum with one FFMA an element, times sa[row, kb] * sb[n-block, kb]
  for the block recipe (1x128 activations x 128x128 weights; a tile wider than a weight block reads one sb per run
  of gcd(bn, 128) columns). The tensor core's accumulator then never sums more than 128
  products (it keeps ~14 bits); the scale loads are issued under the wgmmas. Two consumer warpgroups overlap one's
  promotion with the other's wgmmas. With ``ScaledConfig.issue_ahead`` a consumer also issues k-block k+1 (into a
  second partial accumulator) before k's add, so that its own wgmmas run under its promotion. MX scales (an e8m0
  byte per 32 of K for each row of A and B, ``ScaledEpilogue.scale_k`` = 32) promote every wgmma k-step instead;
  MXFP4 weights (``ScaledConfig.packed_b``) arrive as packed e2m1, which the consumers convert into the stage's e4m3
  tile (exact, times 2^-6, folded into B's scales) before its wgmmas. All run as
  ``nvfly.ops.common.mainloop.promote_k_blocks`` with this kernel's k-block (or k-step) body and promotion.
The epilogue multiplies by the tensor-wise scale (sa * sb, read from device memory: no host sync) or the row-wise
scales (sa[row] * sb[col]) and adds the bias (``epilogue_value``); with ``ScaledConfig.tma_store`` (16-bit outputs)
it stages the tile in shared memory and TMA-stores it (the dense GEMM's ``stage_tile``), else it stores each
thread's fragments as 4-byte pairs (masked on tails).
"""
from __future__ import annotations

import functools

import nvfly
from nvfly.arch import sm90
from nvfly.arch.floats import convert_shared_e2m1x32, e8m0_to_f32
from nvfly.arch.memory import load_shared
from nvfly.arch.ptx import smem_address
from nvfly.ops.common.epilogue import check_store_descriptor, fix_up, stage_tile, store_tile
from nvfly.ops.common.gemm_config import ARRIVAL_OFFSET, BARRIER_BYTES, CONSUMER_REGS, PRODUCER_REGS, Epilogue
from nvfly.ops.common.mainloop import (consume_k_blocks, init_ring, issue_k_block, load_boxes, produce_tiles,
                                       promote_k_blocks)
from nvfly.ops.common.scheduler import Tiling, block_units, tile_grid, unit_work
from nvfly.ops.scaled.config import BK, BLOCKWISE, MX, SCALE_BLOCK, weight_runs

PARTIAL = Epilogue(partial=True)
STAGED = Epilogue()  # the TMA-store epilogue stages values already scaled (``scaled_values``)


@nvfly.kernel
def scaled_mm_kernel(a_desc: nvfly.TmaDescriptor, b_desc: nvfly.TmaDescriptor, out: nvfly.Tensor, out_desc, sa_desc,
                     scale_a: nvfly.Tensor, scale_b: nvfly.Tensor, bias, m: nvfly.i32, n: nvfly.i32,
                     k_tiles: nvfly.i32, workspace, counters, dp_tiles: nvfly.i32, block_iters: nvfly.i32,
                     CFG: nvfly.Constexpr, EPI: nvfly.Constexpr):
    dtype = a_desc.info.dtype
    BM, BN, S, WGS = CFG.bm, CFG.bn, CFG.stages, CFG.consumers
    WG_M = CFG.wg_m
    ATOMS_M = WG_M // 64
    atom = sm90.WgmmaAtom(BN, dtype, nvfly.f8e4m3 if CFG.packed_b else b_desc.info.dtype, "K", "K")
    tiles_of = k_major_tiles(BM, BN, dtype)
    b_boxes = tiles_of[3]
    CN = CFG.cluster_n
    # a cluster along N: block r loads slice r of the A tile for every block of the cluster (multicast)
    a_parts = sm90.operand_boxes(tiles_of[0], BM, BK, dtype, "K", 128, parts=CN)[1]
    A_BYTES = BM * BK
    STAGE_BYTES = CFG.stage_bytes
    ring, pipe = fp8_ring(CFG)
    TMA_STORE = CFG.tma_store and not EPI.partial
    staging = None
    if TMA_STORE:
        check_store_descriptor(out_desc, CFG, False)
        staging = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (CFG.staging_bytes(),),
                                                           offset_bytes=CFG.ring_end))

    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    wg = warp // 4
    # tiles shared by several blocks (stream K's k ranges, or split K's splits with split_fix_up) add up in the
    # workspace; without one, split K writes partials (EPI.partial) for the reduce kernel
    FIX_UP = workspace is not None
    SPLIT_FIX_UP = FIX_UP and CFG.split_fix_up
    check_fix_up(CFG, EPI, FIX_UP)
    if FIX_UP:  # each consumer's arrival count, after the ring's barriers
        arrivals = nvfly.dynamic_shared_tensor(nvfly.i32, (WGS,), offset_bytes=ARRIVAL_OFFSET)
    init_ring(pipe, tid, a_desc, b_desc, out_desc, TMA_STORE)
    if CN > 1:
        sm90.cluster_sync()  # every block's barriers exist before any multicast or remote arrive
    else:
        nvfly.syncthreads()
    rank = nvfly.block_rank_in_cluster() if CN > 1 else 0
    TILING = Tiling(BM, BN, CFG.group_m, CFG.split_k, stream_k=FIX_UP and not SPLIT_FIX_UP, split_fix_up=SPLIT_FIX_UP,
                    cluster_n=CN)
    first_tile = nvfly.cluster_idx.x if CN > 1 else nvfly.block_idx.x
    tile_step = nvfly.grid_dim.x // CN
    tiles = tile_grid(m, n, 1, k_tiles, dp_tiles, block_iters, tile_step, None, None, TILING)
    num_units = block_units(first_tile, tiles, TILING)

    if wg == 0:
        sm90.setmaxnreg(PRODUCER_REGS, increase=False)
        if tid == 0:
            def tile_loads(work):
                def load(kt, base, full):
                    for r in nvfly.static_range(CN):
                        if CN == 1 or rank == r:
                            load_boxes(a_desc, a_parts[r], work.tile_m * BM, kt * BK, "K", base, full,
                                       multicast_mask=(1 << CN) - 1 if CN > 1 else None)
                    if CFG.packed_b:  # e2m1 pairs: one unswizzled BN x 64-byte box, behind the e4m3 tile
                        sm90.tma_load(b_desc, base + A_BYTES + BN * BK, (work.tile_n * BN, kt * (BK // 2)), full)
                    else:
                        load_boxes(b_desc, b_boxes, work.tile_n * BN, kt * BK, "K", base + A_BYTES, full)
                    if CFG.staged_scales:  # the tile rows' sa[:, kt], from scale_a viewed as (K/128, M)
                        sm90.tma_load(sa_desc, base + CFG.scales_offset, (kt, work.tile_m * BM), full)
                return work.k_begin, work.k_end, load

            produce_tiles(pipe, ring, STAGE_BYTES, S, first_tile, num_units, tile_step, tiles, TILING, tile_loads,
                          rank)
    else:
        sm90.setmaxnreg(CONSUMER_REGS, increase=True)
        consumer = wg - 1
        lane = nvfly.lane_idx()
        warp_in_wg = warp % 4
        alpha = 1.0
        if EPI.scaling == "tensor":
            alpha = scale_a[0] * scale_b[0]
        state = sm90.PipelineState.start(S)
        for tile in range(first_tile, num_units, tile_step):
            work = unit_work(tile, tiles, rank, TILING)
            tm, tn = work.tile_m, work.tile_n
            row0 = tm * BM + consumer * WG_M + warp_in_wg * 16 + lane // 4
            col0 = tn * BN + 2 * (lane % 4)
            # the k-block's promotion scales
            scales_of = functools.partial(promotion_scales, scale_a, scale_b, row0, col0, m=m, n=n, BN=BN,
                                          ATOMS_M=ATOMS_M, EPI=EPI, past_n=CN > 1)
            if CFG.staged_scales:  # sa from the stage: the thread's first row's word in its slot
                scales_of = functools.partial(scales_of, staged_row=CFG.scales_offset + 4 * (row0 - tm * BM))
            accs, state = fp8_mainloop(pipe, state, ring, atom, tiles_of, consumer, work.k_begin, work.k_end, lane,
                                       tid, scales_of, CFG, EPI)
            inside = (tm * BM + (consumer + 1) * WG_M <= m) & (tn * BN + BN <= n)
            finished = True
            if FIX_UP:  # a tile other blocks share: its sums complete in the part counted in last (the dense GEMM's)
                accs, finished = fix_up(accs, work.contributors > 1, workspace, counters, work.slot * WGS + consumer,
                                        arrivals, consumer, warp_in_wg, lane, work.contributors, ATOMS_M, BN)
            if finished:
                store_consumer_tile(out, out_desc, accs, scale_a, scale_b, bias, staging,
                                    work.split, tm, tn, row0, col0, m, n, alpha, consumer, warp_in_wg, lane, inside,
                                    CFG, ATOMS_M, EPI, TMA_STORE)
        if TMA_STORE:
            if (warp_in_wg == 0) & (lane == 0):
                sm90.tma_store_wait(0, read_only=False)  # the block's shared memory outlives its last stores
    if CN > 1:
        sm90.cluster_sync()  # no block leaves while a peer may still multicast into it or arrive on it


def check_fix_up(cfg, epi, fix_up: bool) -> None:
    """Split K's outputs are either partials for the reduce kernel or sums that meet in the workspace: a
    ``split_fix_up`` config with splits needs the workspace, and partials none."""
    from nvfly.errors import CompileError
    if cfg.split_fix_up and cfg.split_k > 1 and not fix_up:
        raise CompileError("split_fix_up: the splits add up in the workspace, but none was given")
    if fix_up and epi.partial:
        raise CompileError("a workspace with partial outputs: split K's partials go to the reduce kernel, not the "
                           "fix-up")


@nvfly.func
def store_consumer_tile(out, out_desc, accs, scale_a, scale_b, bias, staging, split, tm, tn, row0, col0, m, n, alpha,
                        consumer, warp_in_wg, lane, inside, CFG, ATOMS_M, EPI, TMA_STORE):
    """The consumer's epilogue of tile (tm, tn): split-K partials (unscaled f32 sums into out[split], the dense
    GEMM's partial store), the TMA-store epilogue (scaled in registers with reads clamped into range, staged,
    stored by TMA, which clips) or the register epilogue (unchecked inside the output, masked on its edges)."""
    BM, BN, WG_M = CFG.bm, CFG.bn, CFG.wg_m
    if EPI.partial:
        store_tile(out, None, accs, split, row0, col0, m, n, 1.0, 0.0, BN, ATOMS_M, PARTIAL, inside)
    elif TMA_STORE:
        values = scaled_values(accs, scale_a, scale_b, bias, row0, col0, m, n, alpha, BN, ATOMS_M, EPI)
        stage_tile(out_desc, None, values, staging + consumer * (CFG.staging_bytes() // CFG.consumers), 0,
                   tm * BM + consumer * WG_M, tn * BN, row0, col0, m, n, 1.0, 0.0, consumer, warp_in_wg, lane, CFG,
                   ATOMS_M, STAGED, False, False)
    elif inside:
        store_scaled(out, accs, scale_a, scale_b, bias, row0, col0, m, n, alpha, BN, ATOMS_M, EPI, False)
    else:
        store_scaled(out, accs, scale_a, scale_b, bias, row0, col0, m, n, alpha, BN, ATOMS_M, EPI, True)


def fp8_mainloop(pipe, state, ring, atom, tiles_of, consumer, k_begin, k_end, lane, tid, scales_of, CFG, EPI) -> tuple:
    """A consumer's k-blocks [k_begin, k_end) of one tile of the fp8 kernels from the ``fp8_ring`` (``tiles_of``:
    ``k_major_tiles``): promoted (``EPI.promote``: each k-block, or each k-step of MX scales, into fresh accumulators,
    added into fp32 sums times ``scales_of(kt=...)``, ``promotion_scales`` of the tile) or accumulated in the tensor
    core. Returns (the accumulators, the state after the tile)."""
    a_layout, b_layout, _, _, a_desc_fields, b_desc_fields = tiles_of
    WG_M = CFG.wg_m
    ATOMS_M = WG_M // 64
    A_BYTES = CFG.bm * BK
    STAGE_BYTES = CFG.stage_bytes
    if EPI.promote:
        # promotions per k-block: MX scales change every wgmma k-step, the others every k-block
        STEPS = BK // EPI.scale_k

        def fresh_k_block(stage, state, kt, step):
            if STEPS > 1:
                part = issue_k_step(atom, stage, a_layout, b_layout, consumer, a_desc_fields, b_desc_fields, A_BYTES,
                                    WG_M, ATOMS_M, step)
                return part, scales_of(kt=kt * STEPS + step)
            part = issue_k_block(atom, [sm90.Accumulator.undefined(atom) for _ in range(ATOMS_M)], stage, a_layout,
                                 b_layout, consumer, a_desc_fields, b_desc_fields, A_BYTES, WG_M, BK, 1, True)
            if CFG.staged_scales:  # the activation scales from the stage (promotion_scales' staged_row)
                return part, scales_of(kt=kt, stage=stage)
            return part, scales_of(kt=kt)  # the scales load while the wgmmas run

        def add_partial(sums, partial):
            # issued ahead, or a k-step's: the partial was waited for with wgmmas in flight, or in a loop
            part, scales = partial
            return promote(sums, fenced(part) if CFG.issue_ahead or STEPS > 1 else part, scales, ATOMS_M, EPI)

        def convert_b(stage):  # MXFP4: the stage's packed e2m1 B into its e4m3 tile, before the wgmmas
            convert_packed_b(stage + A_BYTES, tid - 128, CFG.bn, CFG.consumers)

        # issue_ahead: k-block k+1's wgmmas are issued before k's fp32 add, into the other of two partials
        sums = [sm90.Accumulator.zeros(atom) for _ in range(ATOMS_M)]
        accs, state = promote_k_blocks(pipe, state, ring, STAGE_BYTES, k_begin, k_end, lane, sums, fresh_k_block,
                                       add_partial, CFG.issue_ahead, STEPS, convert_b if CFG.packed_b else None,
                                       CFG.cluster_n)
    else:
        def accumulate(accs, stage, state, kt, first):
            return issue_k_block(atom, accs, stage, a_layout, b_layout, consumer, a_desc_fields, b_desc_fields,
                                 A_BYTES, WG_M, BK, 1, first)

        # the first k-block starts the accumulators (scale-d 0): no instruction but wgmma writes them
        accs = [sm90.Accumulator.undefined(atom) for _ in range(ATOMS_M)]
        accs, state = consume_k_blocks(pipe, state, ring, STAGE_BYTES, k_begin, k_end, lane, accs, accumulate,
                                       CFG.cluster_n, None)
    return accs, state


def k_major_tiles(bm: int, bn: int, dtype) -> tuple:
    """The fp8 kernels' A (bm rows) and B (bn rows) tiles of a k-block, K-major in 128-byte swizzle: (A's layout,
    B's, A's TMA boxes, B's, A's wgmma descriptor fields (leading and stride byte offsets, swizzle), B's)."""
    layouts = [sm90.operand_layout(rows, BK, dtype, "K", 128) for rows in (bm, bn)]
    boxes = [sm90.operand_boxes(layout, rows, BK, dtype, "K", 128)[1][0] for layout, rows in zip(layouts, (bm, bn))]
    fields = [sm90.descriptor_offsets(layout, dtype, "K", 128) + (128,) for layout in layouts]
    return layouts[0], layouts[1], boxes[0], boxes[1], fields[0], fields[1]


def fp8_ring(cfg, scale_pad: int = 0) -> tuple:
    """The fp8 kernels' ring in dynamic shared memory (its barriers first): (its shared address, its TmaPipeline,
    released by the 4 warps of each of ``cfg.consumers`` consumer warpgroups of each block of the cluster);
    ``scale_pad``: rows the staged scales' box loads beyond bm (the grouped contiguous layout's SCALE_ALIGN)."""
    bars = smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (2 * cfg.stages,)))
    ring = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (cfg.stages * cfg.stage_bytes,),
                                                    offset_bytes=BARRIER_BYTES))
    # a cluster's stage is free once the consumers of all its blocks are done: each A slice lands in all of them
    return ring, sm90.TmaPipeline(bars, cfg.stages, cfg.load_bytes + 4 * scale_pad,
                                  consumer_arrivals=4 * cfg.consumers * cfg.cluster_n)


def issue_k_step(atom, base, a_layout, b_layout, consumer, a_fields, b_fields, a_bytes, wg_m, atoms_m, ks) -> list:
    """Issue wgmma k-step ``ks`` (atom.k of K; may be traced) of the stage at ``base`` into fresh accumulators
    (committed, not waited for): the k-block's issue, both operands' start moved by the step's bytes along K (K-major
    128-byte rows of fp8: k bytes in, for A and B alike)."""
    assert all(layout.inner((0, s * atom.k)) == s * atom.k for layout in (a_layout, b_layout)
               for s in range(BK // atom.k)), "k-steps at k bytes into the swizzled rows"
    return issue_k_block(atom, [sm90.Accumulator.undefined(atom) for _ in range(atoms_m)], base + ks * atom.k, a_layout,
                         b_layout, consumer, a_fields, b_fields, a_bytes, wg_m, atom.k, 1, True)


@nvfly.func
def convert_packed_b(tile, thread, BN, WGS):
    """MXFP4: the consumers' threads (``thread`` counts them from 0) convert B's packed e2m1 tile (BN rows of 64
    bytes behind the e4m3 tile at ``tile``) into the e4m3 tile (times 2^-6) in wgmma's 128-byte swizzle (16-byte
    segment s of row r at segment s ^ (r % 8)), each thread 16 packed bytes at a time; then make the writes visible
    to wgmma (the async proxy) and wait for all of them."""
    THREADS = 128 * WGS
    CHUNKS = BN * BK // 2 // 16
    for i in nvfly.static_range((CHUNKS + THREADS - 1) // THREADS):
        chunk = thread + i * THREADS
        if CHUNKS % THREADS == 0 or chunk < CHUNKS:
            row = chunk // 4
            seg = 2 * (chunk % 4)
            dst = tile + row * BK
            convert_shared_e2m1x32(tile + BN * BK + chunk * 16, dst + (seg ^ (row % 8)) * 16,
                                   dst + ((seg + 1) ^ (row % 8)) * 16)
    sm90.fence_proxy_async()
    nvfly.named_barrier(1, THREADS)


def promotion_scales(scale_a, scale_b, row0, col0, kt, m, n, BN, ATOMS_M, EPI, a_group=None, b_group=None,
                     stage=None, staged_row=None, past_n=False) -> list:
    """The k-block's promotion scales for the thread's elements: block, one per row and run of the tile's columns
    (sa[row, kt] * sb[the run's column block, kt], row-major: ``weight_runs`` runs, each in one weight block; reads
    of a run past n clamped to the last block); block1x128 and MX (``kt`` then counts 32-wide k-steps, the e8m0
    bytes decoded), the rows' sa then the columns' sb (element 4j + 2h + c: column 8j + c); tensor/row-wise, none
    (applied in the epilogue).
    ``a_group``/``b_group``: the group whose scales a batched (3-D) scale_a/scale_b holds first (None: 2-D).
    ``stage``/``staged_row`` (block, ``ScaledConfig.staged_scales``): sa[row, kt] is the f32 word at shared address
    stage + staged_row + 4 (64i + 8h) (the tile's rows past m are TMA's zeros, never stored).
    ``past_n``: the tile may lie wholly past n (a cluster's last column): every column read is clamped."""
    rows = [nvfly.minimum(row0 + 64 * i + 8 * h, m - 1) for i in range(ATOMS_M) for h in range(2)]
    if EPI.scaling == "block":
        runs = weight_runs(BN)
        width = BN // runs
        # col0 is the tile's first column plus at most 6, inside its first run; a one-run tile starts inside n
        # unless it is a cluster's past n
        sbs = [batched(scale_b, b_group, col0 // SCALE_BLOCK if runs == 1 and not past_n else
                       nvfly.minimum((col0 + width * r) // SCALE_BLOCK, (n - 1) // SCALE_BLOCK), kt)
               for r in range(runs)]
        if stage is not None:
            row_scales = [load_shared(stage + staged_row + 4 * (64 * i + 8 * h))[0].bitcast(nvfly.f32)
                          for i in range(ATOMS_M) for h in range(2)]
        else:
            row_scales = [batched(scale_a, a_group, row, kt) for row in rows]
        return [sa * sb for sa in row_scales for sb in sbs]
    if EPI.scaling in MX:  # e8m0 bytes; a K tail's zero-filled k-steps take the last step's scales
        kt = nvfly.minimum(kt, scale_a.shape[-1] - 1)
        b_factor = 64.0 if EPI.scaling == "mxfp4" else 1.0  # converted e2m1 is e4m3 times 2^-6
        return [e8m0_to_f32(batched(scale_a, a_group, row, kt)) for row in rows] + \
            [e8m0_to_f32(batched(scale_b, b_group, nvfly.minimum(col0 + 8 * j + c, n - 1), kt)) * b_factor
             for j in range(BN // 8) for c in range(2)]
    if EPI.scaling == "block1x128":
        return [scale_a[row, kt] for row in rows] + [scale_b[nvfly.minimum(col0 + 8 * j + c, n - 1), kt]
                                                     for j in range(BN // 8) for c in range(2)]
    return []


def batched(t, group, *index):
    """``t[index]``, or ``t[group, *index]`` of a batched tensor (``group`` not None)."""
    return t[index] if group is None else t[(group,) + index]


def fenced(part: list) -> list:
    """A waited-for partial's registers, read no earlier than here: without the fence LLVM may hoist its adds above
    the wait_group (e.g. out of both arms of an if), and ptxas then serialises every wgmma to keep them correct."""
    return [acc.fence() for acc in part]


def promote(sums: list, part: list, scales: list, ATOMS_M: int, EPI) -> list:
    """sums + part, each element times its promotion scales (``promotion_scales``), one FFMA an element: block,
    element 4j + 2h + c times row h's product with its column run's (``scale_index``); block1x128 and MX, times
    the row's scale times the column's."""
    if EPI.scaling == "block":
        runs = len(scales) // (2 * ATOMS_M)
        return [sums[i].map(lambda v, e, i=i: nvfly.fma(part[i][e], scales[scale_index(i, e, runs, sums[i].n)], v))
                for i in range(ATOMS_M)]
    if EPI.scaling == "block1x128" or EPI.scaling in MX:
        rows = 2 * ATOMS_M
        return [sums[i].map(lambda v, e, i=i: nvfly.fma(part[i][e], scales[2 * i + (e // 2) % 2]
                                                        * scales[rows + 2 * (e // 4) + e % 2], v))
                for i in range(ATOMS_M)]
    return [sums[i].map(lambda v, e, i=i: v + part[i][e]) for i in range(ATOMS_M)]


def scale_index(atom_i: int, e: int, runs: int, bn: int) -> int:
    """Block scales: the index in ``promotion_scales``' list (row-major, ``runs`` per row) of accumulator element e of
    64-row atom ``atom_i`` (row 8h, column 8j + c of the thread's: e = 4j + 2h + c)."""
    return (2 * atom_i + (e // 2) % 2) * runs + 8 * (e // 4) // (bn // runs)


def row_terms(scale_a, bias, row0, m, alpha, ATOMS_M, EPI, MASKED) -> tuple:
    """The thread's rows (2 per atom: row0 + 64i + 8h) and their epilogue terms: (rows, scales (sa[row], or alpha),
    biases (along rows: ``bias_rows``; else empty)); with MASKED the reads are clamped into range."""
    rows, scales, biases = [], [], []
    for i in range(ATOMS_M):
        for h in range(2):
            row = row0 + 64 * i + 8 * h
            rows.append(row)
            safe_row = nvfly.minimum(row, m - 1) if MASKED else row
            scales.append(scale_a[safe_row] if EPI.scaling == "row" else alpha)
            if EPI.bias and EPI.bias_rows:
                biases.append(bias[safe_row].to(nvfly.f32))
    return rows, scales, biases


def column_terms(scale_b, bias, col, n, EPI, MASKED) -> tuple:
    """Column pair (col, col + 1)'s epilogue terms: (sb (row-wise; else empty), biases along columns (else
    empty)); with MASKED the reads are clamped into range."""
    scales, biases = [], []
    for e in range(2):
        safe_col = nvfly.minimum(col + e, n - 1) if MASKED else col + e
        if EPI.scaling == "row":
            scales.append(scale_b[safe_col])
        if EPI.bias and not EPI.bias_rows:
            biases.append(bias[safe_col].to(nvfly.f32))
    return scales, biases


def epilogue_value(v, r, e, row_scales, row_biases, col_scales, col_biases, EPI):
    """Accumulator element v of the thread's row r and column pair element e, scaled (tensor/row-wise: block scales
    were applied in the mainloop) and biased."""
    if EPI.scaling not in BLOCKWISE:
        v = v * row_scales[r]
        if EPI.scaling == "row":
            v = v * col_scales[e]
    if EPI.bias:
        v = v + (row_biases[r] if EPI.bias_rows else col_biases[e])
    return v


def scaled_values(accs, scale_a, scale_b, bias, row0, col0, m, n, alpha, BN, ATOMS_M, EPI) -> list:
    """The consumer's fragments scaled and biased (``epilogue_value``, reads clamped into range), in the
    accumulators' order (element 4j+2h+e of atom i: (row0 + 64i + 8h, col0 + 8j + e)): the TMA-store epilogue's."""
    rows, row_scales, row_biases = row_terms(scale_a, bias, row0, m, alpha, ATOMS_M, EPI, True)
    values = [[None] * (BN // 2) for _ in range(ATOMS_M)]
    for j in range(BN // 8):
        col_scales, col_biases = column_terms(scale_b, bias, col0 + 8 * j, n, EPI, True)
        for r in range(2 * ATOMS_M):
            for e in range(2):
                x = 4 * j + 2 * (r % 2) + e
                values[r // 2][x] = epilogue_value(accs[r // 2][x], r, e, row_scales, row_biases, col_scales,
                                                   col_biases, EPI)
    return values


@nvfly.func
def store_scaled(out, accs, scale_a, scale_b, bias, row0, col0, m, n, alpha, BN, ATOMS_M, EPI, MASKED):
    """Scale, add the bias, convert and write the consumer's fragments: element 4j+2h+e of atom i is
    (row0 + 64i + 8h, col0 + 8j + e). Without MASKED (the tile lies inside the output) nothing is bounds-checked;
    with it, scale and bias reads are clamped into range and stores masked."""
    vec = isinstance(out.stride[1], int) and out.stride[1] == 1
    rows, row_scales, row_biases = row_terms(scale_a, bias, row0, m, alpha, ATOMS_M, EPI, MASKED)
    # column by column: a column pair's scales and bias are read once and live only while it is stored
    for j in nvfly.static_range(BN // 8):
        col = col0 + 8 * j
        col_scales, col_biases = column_terms(scale_b, bias, col, n, EPI, MASKED)
        for r in nvfly.static_range(2 * ATOMS_M):
            row = rows[r]
            if not MASKED or row < m:
                values = [epilogue_value(accs[r // 2][4 * j + 2 * (r % 2) + e], r, e, row_scales, row_biases,
                                         col_scales, col_biases, EPI) for e in range(2)]
                if vec and (not MASKED or col + 1 < n):
                    out.store(nvfly.make_vector(values).to(out.dtype), row, col)
                else:
                    if not MASKED or col < n:
                        out[row, col] = values[0].to(out.dtype)
                    if not MASKED or col + 1 < n:
                        out[row, col + 1] = values[1].to(out.dtype)


@nvfly.kernel
def scaled_reduce_kernel(partials: nvfly.Tensor, out: nvfly.Tensor, scale_a: nvfly.Tensor, scale_b: nvfly.Tensor,
                         bias, m: nvfly.i32, n: nvfly.i32, SPLITS: nvfly.Constexpr, SCALING: nvfly.Constexpr,
                         VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr):
    """Split K's second step, in the caller's orientation: out[r, c] = scale(sum_s partials[s, r, c]) (+ bias[c]),
    VEC consecutive columns per thread (VEC divides n). Scales as the caller gives them: one element each
    ("tensor"), or sa per row and sb per column ("row"); block scales: none left to apply."""
    i = (nvfly.block_idx.x * THREADS + nvfly.thread_idx.x) * VEC
    if i < m * n:
        row = i // n
        col = i - row * n
        acc = partials.load(0, row, col, width=VEC)
        for s in nvfly.static_range(1, SPLITS):
            acc = acc + partials.load(s, row, col, width=VEC)
        if SCALING == "tensor":
            row_scale = scale_a[0] * scale_b[0]
        elif SCALING == "row":
            row_scale = scale_a[row]
        values = []
        for e in nvfly.static_range(VEC):
            v = acc[e] if VEC > 1 else acc
            if SCALING not in BLOCKWISE:  # block scales were applied in the mainloop
                v = v * row_scale
            if SCALING == "row":
                v = v * scale_b[col + e]
            if bias is not None:
                v = v + bias[col + e].to(nvfly.f32)
            values.append(v)
        if VEC > 1:
            out.store(nvfly.make_vector(values).to(out.dtype), row, col)
        else:
            out[row, col] = values[0].to(out.dtype)
