"""The mainloop of the warp-specialised TMA + wgmma GEMMs (dense, grouped, scaled): the producer's k-block loads into
the shared-memory ring and the consumers' k-block loop over it.

The producer (one thread) walks its tiles' k-blocks (``produce_tiles``): ``fill_stage`` claims the next stage of the ring (waits until
the consumers released it, expects its bytes on its full barrier), ``load_boxes`` issues an operand's TMA boxes into
it. A consumer warpgroup walks the same k-blocks with ``consume_k_blocks``: it waits for each stage, issues its
wgmmas (the per-k-block body is the kernel's: ``issue_k_block`` from shared memory, after whatever the kernel does
to the stage first) and keeps one wgmma group in flight, releasing a stage once its wgmmas are done. A promoting
mainloop (FP8 block and MX scales) walks them with ``promote_k_blocks`` instead: each k-block (or each of its
k-steps) into fresh accumulators, added into fp32 sums once done, optionally with the next k-block issued ahead.
``init_ring`` sets the ring up (thread 0); ``operand_box`` is the host side: the TMA box and swizzle of an
operand's k-block.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import nvfly
from nvfly.arch import sm90
from nvfly.ops.common.scheduler import unit_work


@functools.lru_cache(maxsize=None)
def operand_box(rows: int, bk: int, dtype: Any, major: str, rank: int, parts: int = 1) -> tuple[tuple[int, ...], int]:
    """(TMA box, swizzle) of an operand viewed as [(B,) MN, K] (K-major) or [(B,) K, MN] (MN-major): one
    k-block of ``rows`` rows (split in ``parts`` slices) and a batch of 1."""
    swizzle = sm90.choose_swizzle(rows // parts, dtype, major)  # each slice a whole number of swizzle rows
    layout = sm90.operand_layout(rows, bk, dtype, major, swizzle)
    box, _ = sm90.operand_boxes(layout, rows, bk, dtype, major, swizzle, parts)
    return (1,) * (rank - 2) + tuple(box), swizzle


@nvfly.func
def init_ring(pipe, tid, a_desc, b_desc, out_desc, PREFETCH_OUT):
    """Thread ``tid`` 0 initialises the ring's barriers and prefetches the operands' TMA descriptors (and the
    output's, with ``PREFETCH_OUT``: a TMA-store epilogue)."""
    if tid == 0:
        pipe.init()
        sm90.tma_prefetch_descriptor(a_desc)
        sm90.tma_prefetch_descriptor(b_desc)
        if PREFETCH_OUT:
            sm90.tma_prefetch_descriptor(out_desc)


def fill_stage(pipe: Any, state: Any, ring: Any, stage_bytes: int) -> tuple[Any, Any]:
    """The producer claims ``state``'s stage: waits until the consumers released it and expects its bytes on its
    full barrier. Returns (the stage's shared address, its full barrier) for the TMA loads."""
    pipe.producer_acquire(state)
    pipe.producer_expect(state)
    return ring + state.stage * stage_bytes, pipe.full(state.stage)


@nvfly.func
def produce_tiles(pipe, ring, stage_bytes, S, first, units, step, tiles, TILING, tile_loads, rank):
    """The producer thread's walk over its work units (``first``, ``first + step``, ... below ``units``, of the
    scheduler's ``tiles``; ``rank``: the block's in its cluster, 0 without one): ``tile_loads(work)`` (the kernel's,
    once a unit) returns the unit's k-blocks (k_begin, k_end) and ``load(kt, base, full)``, which issues k-block kt's
    TMA boxes into the stage at shared address ``base``; each k-block claims the ring's next stage first
    (``fill_stage``)."""
    state = sm90.PipelineState.start(S)
    for tile in range(first, units, step):
        k_begin, k_end, load = tile_loads(unit_work(tile, tiles, rank, TILING))
        for kt in range(k_begin, k_end):
            base, full = fill_stage(pipe, state, ring, stage_bytes)
            load(kt, base, full)
            state = state.advance()


def load_boxes(desc: Any, boxes: Any, mn: Any, k: Any, major: str, smem: Any, full: Any, batch: Any = None,
               multicast_mask: Optional[int] = None, cache_hint: Optional[str] = None) -> None:
    """TMA-load an operand's ``boxes`` (``sm90.operand_boxes``) of the k-block at row ``mn`` and column ``k`` of the
    operand ([(batch,) MN, K] K-major, [(batch,) K, MN] MN-major) into the stage at shared address ``smem``,
    completing on barrier ``full``."""
    for box in boxes:
        mm = mn + box.mn_offset
        kk = k + box.k_offset
        coords = (mm, kk) if major == "K" else (kk, mm)
        sm90.tma_load(desc, smem + box.smem_offset, coords if batch is None else (batch,) + coords, full,
                      multicast_mask=multicast_mask, cache_hint=cache_hint)


@nvfly.func
def consume_k_blocks(pipe, state, ring, stage_bytes, k_begin, k_end, lane, accs, k_block, CLUSTER, before_drain):
    """A consumer's k-blocks [k_begin, k_end) of one tile (at least one), one wgmma group in flight. For each:
    wait for its stage, then ``k_block(accs, stage, state, kt, first)`` (the kernel's per-k-block body: issue the
    k-block's wgmmas from the stage at shared address ``stage`` into ``accs`` and commit them; ``first``: the
    tile's first k-block, which starts the accumulators) returns the accumulators; once k-block kt + 1 is issued,
    kt's wgmmas are done and its stage is released (``release_stage``, on every block of a ``CLUSTER``).
    ``before_drain()`` (None: nothing) runs after the last issue, before waiting for it. Returns (accumulators,
    the state after the tile)."""
    pipe.consumer_wait(state)
    accs = k_block(accs, ring + state.stage * stage_bytes, state, k_begin, True)
    prev = state
    state = state.advance()
    for kt in range(k_begin + 1, k_end):
        pipe.consumer_wait(state)
        accs = k_block(accs, ring + state.stage * stage_bytes, state, kt, False)
        sm90.wait_group(1)  # the previous k-block's wgmmas are done: its stage is free
        if lane == 0:
            release_stage(pipe, prev, CLUSTER)
        prev = state
        state = state.advance()
    if before_drain is not None:
        before_drain()
    sm90.wait_group(0)
    if lane == 0:
        release_stage(pipe, prev, CLUSTER)
    return accs, state


@nvfly.func
def promote_k_blocks(pipe, state, ring, stage_bytes, k_begin, k_end, lane, sums, k_block, promote, AHEAD, STEPS,
                     prepare, CLUSTER):
    """A consumer's k-blocks [k_begin, k_end) of one tile (at least one), each issued into fresh accumulators and
    added into ``sums`` (DeepGEMM's promotion). For each: wait for its stage, run ``prepare(stage)`` on it (None:
    nothing; e.g. converting an operand in shared memory), then ``k_block(stage, state, kt, step)`` (the kernel's
    per-k-block body) issues wgmmas of k-block kt from the stage at shared address ``stage``, commits them and
    returns their partial; once its wgmmas are done, ``promote(sums, partial)`` returns the new sums, and the stage
    is released after its last partial. ``STEPS``: partials per k-block (each ``step`` in [0, STEPS) a slice of its
    K, done before the next is issued: scales that change within a k-block, e.g. MX's per 32 of K; a loop, not
    unrolled, so that only one step's scales live); 1: the whole k-block at once (``step`` 0). Without AHEAD each
    k-block is done before the next is issued. With AHEAD (STEPS 1 only) k-block k + 1 is issued before k is
    promoted, so that the promotion runs under wgmmas: two partials in flight, the k-blocks taken in pairs so that
    each partial keeps its registers (handing one on as the other would copy registers still in flight, and ptxas
    would serialise wgmma). Stages are released on every block of a ``CLUSTER`` (``release_stage``). Returns (sums,
    the state after the tile)."""
    if STEPS > 1:
        for kt in range(k_begin, k_end):
            stage = wait_stage(pipe, state, ring, stage_bytes, prepare)
            for step in range(STEPS):
                partial = k_block(stage, state, kt, step)
                sm90.wait_group(0)
                sums = promote(sums, partial)
            if lane == 0:
                release_stage(pipe, state, CLUSTER)
            state = state.advance()
    elif AHEAD:
        partial_a, state_a = issue_stage(pipe, state, ring, stage_bytes, k_block, prepare, k_begin), state
        state = state.advance()
        for pair in range(k_begin + 1, k_end - 1, 2):
            partial_b, state_b = issue_stage(pipe, state, ring, stage_bytes, k_block, prepare, pair), state
            state = state.advance()
            sums = retire(pipe, state_a, lane, sums, partial_a, promote, 1, CLUSTER)
            partial_a, state_a = issue_stage(pipe, state, ring, stage_bytes, k_block, prepare, pair + 1), state
            state = state.advance()
            sums = retire(pipe, state_b, lane, sums, partial_b, promote, 1, CLUSTER)
        # one k-block left after the pairs, or none: two endings (handing partial_b on as partial_a would copy
        # registers still in flight)
        if (k_end - k_begin) % 2 == 0:
            partial_b, state_b = issue_stage(pipe, state, ring, stage_bytes, k_block, prepare, k_end - 1), state
            state = state.advance()
            sums = retire(pipe, state_a, lane, sums, partial_a, promote, 1, CLUSTER)
            sums = retire(pipe, state_b, lane, sums, partial_b, promote, 0, CLUSTER)
        else:
            sums = retire(pipe, state_a, lane, sums, partial_a, promote, 0, CLUSTER)
    else:
        for kt in range(k_begin, k_end):
            partial = issue_stage(pipe, state, ring, stage_bytes, k_block, prepare, kt)
            sm90.wait_group(0)
            if lane == 0:
                release_stage(pipe, state, CLUSTER)
            state = state.advance()
            sums = promote(sums, partial)
    return sums, state


@nvfly.func
def skip_k_blocks(pipe, state, k_begin, k_end, lane, CLUSTER):
    """A consumer's k-blocks [k_begin, k_end) of a tile it has no rows of: wait for each stage (a release may not run
    ahead of the loads it frees, or it would count towards a later pass of the ring) and release it (on every block
    of a ``CLUSTER``) without reading it. Returns the state after the tile."""
    for kt in range(k_begin, k_end):
        pipe.consumer_wait(state)
        if lane == 0:
            release_stage(pipe, state, CLUSTER)
        state = state.advance()
    return state


def wait_stage(pipe: Any, state: Any, ring: Any, stage_bytes: int, prepare: Any) -> Any:
    """Wait for ``state``'s stage and run ``prepare`` (None: nothing) on its shared address, which it returns
    (``promote_k_blocks``)."""
    pipe.consumer_wait(state)
    stage = ring + state.stage * stage_bytes
    if prepare is not None:
        prepare(stage)
    return stage


def issue_stage(pipe: Any, state: Any, ring: Any, stage_bytes: int, k_block: Any, prepare: Any, kt: Any) -> Any:
    """Wait for ``state``'s stage and run the per-k-block body ``k_block`` on it, whole (``promote_k_blocks``)."""
    return k_block(wait_stage(pipe, state, ring, stage_bytes, prepare), state, kt, 0)


@nvfly.func
def retire(pipe, state, lane, sums, partial, promote, PENDING, CLUSTER):
    """Wait until at most PENDING wgmma groups are in flight (``partial``'s are done), release ``state``'s stage (on
    every block of a ``CLUSTER``) and promote the partial into the sums."""
    sm90.wait_group(PENDING)
    if lane == 0:
        release_stage(pipe, state, CLUSTER)
    return promote(sums, partial)


def release_stage(pipe: Any, state: Any, cluster: int) -> None:
    """Free a stage: on this block's empty barrier, and on every peer's of a cluster (whose producers multicast
    their operand slices into it)."""
    if cluster == 1:
        pipe.consumer_release(state)
        return
    for r in range(cluster):
        sm90.mbarrier_arrive_remote(pipe.empty(state.stage), r)


def issue_k_block(atom: Any, accs: list, base: Any, a_layout: Any, b_layout: Any, consumer: Any,
                  a_desc: tuple[int, int, int], b_desc: tuple[int, int, int], a_bytes: int, wg_m: int, bk: int,
                  size: int, first: bool) -> list:
    """Issue one k-block of wgmmas for a consumer from the stage at shared address ``base`` and commit them.

    ``a_desc``/``b_desc``: (leading byte offset, stride byte offset, swizzle) of the operand descriptors.
    """
    sm90.fence()
    for ks in range(bk // atom.k):
        b_off = b_layout.inner((0, ks * atom.k)) * size
        db = sm90.smem_descriptor(base + a_bytes + b_off, *b_desc)
        for i in range(len(accs)):
            da = sm90.smem_descriptor(base + _a_offset(a_layout, consumer, wg_m, i, ks * atom.k, size), *a_desc)
            accs[i] = sm90.mma(atom, accs[i], da, db, zero=first and ks == 0)
    sm90.commit_group()
    return accs


def _a_offset(layout: Any, consumer: Any, wg_m: int, atom_i: int, k: int, size: int) -> Any:
    """Byte offset of a consumer's i-th 64-row A slice at column k (consumer may be traced)."""
    static_part = layout.inner((64 * atom_i, k)) * size
    per_consumer = layout.inner((wg_m, 0)) * size
    return static_part + consumer * per_consumer if per_consumer else static_part
