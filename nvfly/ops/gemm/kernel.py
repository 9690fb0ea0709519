"""The Hopper GEMM kernel: persistent, warp-specialised, TMA + mbarrier ring + wgmma, fused epilogue.

One block per SM walks output tiles (grouped rasterisation for L2 reuse). Warpgroup 0 is the producer: one
thread keeps an N-stage shared-memory ring full with TMA loads of A and B k-blocks. Warpgroups 1..C are
consumers: each owns BM/C rows of the tile, waits for a stage, issues wgmma from shared memory, keeps one
wgmma group in flight and releases the previous stage (the mainloop the grouped and scaled kernels share:
nvfly.ops.common.mainloop), then runs the epilogue (alpha, beta * C_in, bias via C_in's broadcast strides,
activation, dtype conversion) while the producer already loads the next tile.
Registers are rebalanced with setmaxnreg (producer 40, consumers 232).

The kernel computes out[b] = act(alpha * A[b] @ B[b] + beta * C_in[b]) for every batch b; A and B may each
be K-major or MN-major (wgmma transposes 16-bit operands), tails in M, N, K come from TMA's zero fill and
masked stores. With ``split_k`` > 1 each split reduces its K range into an f32 workspace slice instead.

The tile schedule is nvfly.ops.common.scheduler's (the config's ``Tiling``: grouped rasterisation, split K,
clusters along M, the stream-K tail). Stream K (a ``workspace`` given; ``plan.stream_k_plan`` decides): the
blocks walk work units, first ``dp_tiles`` whole tiles (data-parallel waves), then each block one contiguous
range of ``block_iters`` k-blocks of the remaining tiles taken in order, so that a short last wave (or a single
partial wave) spreads over all SMs instead of leaving some idle; a block's range touches one or more tiles, each
a unit (``scheduler.unit_work``). A part of a tile that other blocks share is added by its consumer into the
tile's f32 workspace slot (``red.global.add.v4``) and counted in; the part counted last reads the sums back,
zeroes slot and count for the next launch and runs the normal epilogue (``fix_up``): one kernel, no memset, no
waiting on other blocks (so no deadlock whatever the residency).

Two epilogues (``GemmConfig.tma_store``), nvfly.ops.common.epilogue's: the register epilogue stores each
thread's fragments straight to global memory as 4-byte pairs (masked on tails); the TMA-store epilogue (16-bit
outputs) stages them in shared memory with ``stmatrix`` and stores them with TMA, draining while the consumer runs
the next tile's mainloop.
"""
from __future__ import annotations

import nvfly
from nvfly.arch import sm90
from nvfly.arch.ptx import smem_address
from nvfly.ops.common.epilogue import activate, check_store_descriptor, fix_up, stage_tile, store_tile
from nvfly.ops.common.gemm_config import (ARRIVAL_OFFSET, BARRIER_BYTES, CONSUMER_REGS, PRODUCER_REGS, GemmConfig,
                                          load_hint)
from nvfly.ops.common.mainloop import consume_k_blocks, fill_stage, init_ring, issue_k_block, load_boxes
from nvfly.ops.common.scheduler import Tiling, block_units, tile_grid, unit_work
from nvfly.ops.gemm.config import REDUCE_THREADS


@nvfly.kernel
def gemm_kernel(a_desc: nvfly.TmaDescriptor, b_desc: nvfly.TmaDescriptor, out: nvfly.Tensor, c_in, out_desc,
                m: nvfly.i32, n: nvfly.i32, k_tiles: nvfly.i32, batches: nvfly.i32, alpha: nvfly.f32,
                beta: nvfly.f32, workspace, counters, dp_tiles: nvfly.i32, block_iters: nvfly.i32,
                CFG: nvfly.Constexpr, A_MAJOR: nvfly.Constexpr, B_MAJOR: nvfly.Constexpr, EPI: nvfly.Constexpr):
    dtype = a_desc.info.dtype
    size = dtype.itemsize
    BM, BN, S, WGS = CFG.bm, CFG.bn, CFG.stages, CFG.consumers
    BK = CFG.bk(size)
    WG_M = CFG.wg_m
    ATOMS_M = WG_M // 64
    PINGPONG = CFG.pingpong
    BATCHED = a_desc.info.rank == 3
    atom = sm90.WgmmaAtom(BN, dtype, dtype, A_MAJOR, B_MAJOR)
    A_SW = a_desc.info.swizzle
    B_SW = b_desc.info.swizzle
    a_layout = sm90.operand_layout(BM, BK, dtype, A_MAJOR, A_SW)
    b_layout = sm90.operand_layout(BN, BK, dtype, B_MAJOR, B_SW)
    CM = CFG.cluster_m
    a_boxes = sm90.operand_boxes(a_layout, BM, BK, dtype, A_MAJOR, A_SW)[1][0]
    b_parts = sm90.operand_boxes(b_layout, BN, BK, dtype, B_MAJOR, B_SW, parts=CM)[1]
    a_lbo, a_sbo = sm90.descriptor_offsets(a_layout, dtype, A_MAJOR, A_SW)
    b_lbo, b_sbo = sm90.descriptor_offsets(b_layout, dtype, B_MAJOR, B_SW)
    A_BYTES = BM * BK * size
    STAGE_BYTES = A_BYTES + BN * BK * size

    STREAM_K = workspace is not None
    PARTS = 1 if PINGPONG else WGS  # consumer tiles per output tile (each has its own slot and count)
    if STREAM_K:
        check_stream_k(CFG)
        arrivals = nvfly.dynamic_shared_tensor(nvfly.i32, (WGS,), offset_bytes=ARRIVAL_OFFSET)
    bars = smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (2 * S,)))
    ring = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (S * STAGE_BYTES,), offset_bytes=BARRIER_BYTES))
    TMA_STORE = CFG.tma_store and not EPI.partial
    if TMA_STORE:
        check_store_descriptor(out_desc, CFG, BATCHED)
        staging = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (CFG.staging_bytes(),),
                                                           offset_bytes=CFG.ring_end(size)))
    # with a cluster, a stage is free only when the consumers of every block in it are done: each block's
    # B slice lands in all of them
    pipe = sm90.TmaPipeline(bars, S, STAGE_BYTES, consumer_arrivals=4 * (1 if PINGPONG else WGS) * CM)

    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    wg = warp // 4
    init_ring(pipe, tid, a_desc, b_desc, out_desc, TMA_STORE)
    if CM > 1:
        sm90.cluster_sync()  # every block's barriers exist before any multicast or remote arrive
    else:
        nvfly.syncthreads()
    rank = nvfly.block_rank_in_cluster() if CM > 1 else 0
    first_tile = nvfly.cluster_idx.x if CM > 1 else nvfly.block_idx.x
    tile_step = nvfly.grid_dim.x // CM

    TILING = Tiling(BM, BN, CFG.group_m, CFG.split_k, CM, stream_k=STREAM_K)
    tiles = tile_grid(m, n, batches, k_tiles, dp_tiles, block_iters, tile_step, None, None, TILING)
    num_units = block_units(first_tile, tiles, TILING)

    if wg == 0:
        sm90.setmaxnreg(PRODUCER_REGS, increase=False)
        if tid == 0:
            state = sm90.PipelineState.start(S)
            for tile in range(first_tile, num_units, tile_step):
                batch, tm, tn, split, k_begin, k_end, slot, contributors = unit_work(tile, tiles, rank, TILING)
                for kt in range(k_begin, k_end):
                    base, full = fill_stage(pipe, state, ring, STAGE_BYTES)
                    load_boxes(a_desc, a_boxes, tm * BM, kt * BK, A_MAJOR, base, full, batch if BATCHED else None,
                               cache_hint=load_hint(CFG, "A"))
                    for r in nvfly.static_range(CM):
                        if rank == r:  # this block loads slice r of B (for every block of the cluster)
                            load_boxes(b_desc, b_parts[r], tn * BN, kt * BK, B_MAJOR, base + A_BYTES, full,
                                       batch if BATCHED else None, multicast_mask=(1 << CM) - 1 if CM > 1 else None,
                                       cache_hint=load_hint(CFG, "B"))
                    state = state.advance()
    else:
        sm90.setmaxnreg(CONSUMER_REGS, increase=True)
        consumer = wg - 1
        a_part = 0 if PINGPONG else consumer  # which WG_M-row slice of the A tile this consumer reads
        lane = nvfly.lane_idx()
        warp_in_wg = warp % 4
        state = sm90.PipelineState.start(S)

        def k_block(accs, stage, state, kt, first):
            return issue_k_block(atom, accs, stage, a_layout, b_layout, a_part, (a_lbo, a_sbo, A_SW),
                                 (b_lbo, b_sbo, B_SW), A_BYTES, WG_M, BK, size, first)

        own_first, own_step = first_tile, tile_step
        if PINGPONG:
            # consumer c takes every other tile of this block, starting with its c-th; the ring holds the
            # other consumer's k-blocks in between
            first_k_blocks = k_tiles
            if STREAM_K:
                first_k_blocks = unit_work(first_tile, tiles, rank, TILING).k_blocks
            state = state.advance_by(consumer * first_k_blocks)
            own_first, own_step = first_tile + consumer * tile_step, 2 * tile_step
        turn = consumer  # ping-pong: the first tile of consumer 0 needs no turn
        for tile in range(own_first, num_units, own_step):
            batch, tm, tn, split, k_begin, k_end, slot, contributors = unit_work(tile, tiles, rank, TILING)
            if PINGPONG:
                if turn > 0:
                    nvfly.named_barrier(2 + consumer, 256)  # wait until the other consumer issued its wgmmas
                turn = turn + 1
            # the first k-block starts the accumulators (scale-d 0): no instruction but wgmma writes them
            accs = [sm90.Accumulator.undefined(atom) for _ in range(ATOMS_M)]
            # ping-pong: once this tile's wgmmas are issued, it is the other consumer's turn to issue
            accs, state = consume_k_blocks(pipe, state, ring, STAGE_BYTES, k_begin, k_end, lane, accs, k_block, CM,
                                           (lambda: nvfly.named_barrier_arrive(3 - consumer, 256)) if PINGPONG
                                           else None)
            if PINGPONG:  # skip the other consumer's next unit
                if STREAM_K:
                    state = state.advance_by(unit_work(tile + tile_step, tiles, rank, TILING).k_blocks)
                else:
                    state = state.advance_by(k_tiles)
            row0 = tm * BM + (0 if PINGPONG else consumer * WG_M) + warp_in_wg * 16 + lane // 4
            col0 = tn * BN + 2 * (lane % 4)
            out_batch = batch * CFG.split_k + split if EPI.partial else batch
            inside = (tm * BM + (WG_M if PINGPONG else (consumer + 1) * WG_M) <= m) & (tn * BN + BN <= n)
            values = accs
            finished = True
            if STREAM_K:
                # a part of a tile other blocks share: add it into the tile's workspace slot; the part counted
                # in last takes the whole sum and runs the epilogue
                values, finished = fix_up(accs, contributors > 1, workspace, counters,
                                          slot * PARTS + (0 if PINGPONG else consumer), arrivals, consumer,
                                          warp_in_wg, lane, contributors, ATOMS_M, BN)
            if finished:
                if TMA_STORE:
                    tile_row = tm * BM + (0 if PINGPONG else consumer * WG_M)
                    own = staging + consumer * (CFG.staging_bytes() // WGS)
                    # TMA clips the stores; only C reads are bounds-checked (one code copy: C is the rare case)
                    stage_tile(out_desc, c_in, values, own, batch, tile_row, tn * BN, row0, col0, m, n, alpha, beta,
                               consumer, warp_in_wg, lane, CFG, ATOMS_M, EPI, BATCHED, EPI.has_c)
                else:
                    store_tile(out, c_in, values, out_batch, row0, col0, m, n, alpha, beta, BN, ATOMS_M, EPI, inside)
        if TMA_STORE:
            if (warp_in_wg == 0) & (lane == 0):
                sm90.tma_store_wait(0, read_only=False)  # the block's shared memory outlives its last stores
    if CM > 1:
        sm90.cluster_sync()  # no block leaves while a peer may still multicast into it or arrive on it


def check_stream_k(cfg: GemmConfig) -> None:
    from nvfly.errors import CompileError
    if cfg.split_k != 1 or cfg.cluster_m != 1:
        raise CompileError("a stream-K tail (workspace given) needs split_k=1 and cluster_m=1")
    if 2 * cfg.stages * 8 > ARRIVAL_OFFSET:
        raise CompileError(f"{cfg.stages} stages: the ring's barriers would overlap the arrival counts")


@nvfly.kernel
def split_k_reduce_kernel(partials: nvfly.Tensor, out: nvfly.Tensor, c_in, m: nvfly.i32, n: nvfly.i32,
                          alpha: nvfly.f32, beta: nvfly.f32, SPLITS: nvfly.Constexpr, EPI: nvfly.Constexpr,
                          VEC: nvfly.Constexpr):
    """out[b] = act(alpha * sum_s partials[b * SPLITS + s] + beta * C_in[b]), VEC consecutive elements of a row per
    thread (VEC divides n, and out's rows start VEC-aligned: runtime.torch_args.vector_width)."""
    i = (nvfly.block_idx.x * REDUCE_THREADS + nvfly.thread_idx.x) * VEC
    batch = nvfly.block_idx.y
    if i < m * n:
        row = i // n
        col = i - row * n
        acc = partials.load(batch * SPLITS, row, col, width=VEC)
        for s in nvfly.static_range(1, SPLITS):
            acc = acc + partials.load(batch * SPLITS + s, row, col, width=VEC)
        if EPI.scaled or EPI.has_c or EPI.activation != "none":
            sums = []
            for j in nvfly.static_range(VEC):
                v = acc[j] if VEC > 1 else acc
                if EPI.scaled:
                    v = v * alpha
                if EPI.has_c:
                    v = v + beta * c_in[batch, row, col + j].to(nvfly.f32)
                sums.append(activate(v, EPI.activation))
            acc = nvfly.make_vector(sums) if VEC > 1 else sums[0]
        out.store(acc.to(out.dtype), batch, row, col)

