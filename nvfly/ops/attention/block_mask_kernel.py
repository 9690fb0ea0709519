"""A flex BlockMask's tables for the decode kernel, in one launch: what ``kv_options.block_mask_tables`` defines with
about forty torch operations (each a launch and several microseconds of host time per call).

Grid (Hkv, B): one CTA per (sequence, KV head) owns the rows of kv_state of its group's G query heads and its row of
stage_list. It clears its kv_state rows, marks the blocks of each head's partial list (kv_num_blocks first entries
of kv_indices) BLOCK_PARTIAL and then those of its full list BLOCK_FULL (a barrier between: full wins, as
``block_mask_tables``' maximum), then ranks the stages within the sequence whose block is non-empty for a head of
the group by a block scan, chunk by chunk: the i-th such stage goes to stage_list[i] (ascending), the others to the
end of the row (descending), and stage_count gets their number. kv_state is read back by the CTA that wrote it,
after a barrier (global memory, ordered for the block by ``bar.sync``).
"""
from __future__ import annotations

import nvfly
from nvfly.arch.reduce import block_scan
from nvfly.ops.attention.decode_kernel import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL
from nvfly.ops.attention.plan import BLOCK_N

THREADS = 128
WARPS = THREADS // 32


@nvfly.func
def mark_blocks(num, indices, kv_state, b, hkv, blocks, tid, value, TABLES):
    """kv_state[b, h, block] = ``value`` for the first num[., ., 0] entries of each group head's ``indices`` row
    (a broadcast mask's row 0; block numbers clamped into the table, counts to its length)."""
    mb = 0 if TABLES.batch_broadcast else b
    for j in nvfly.static_range(TABLES.group):
        head = hkv * TABLES.group + j
        mh = 0 if TABLES.head_broadcast else head
        listed = nvfly.minimum(num[mb, mh, 0], blocks)
        for i in range(tid, listed, THREADS):
            block = nvfly.maximum(nvfly.minimum(indices[mb, mh, 0, i], blocks - 1), 0)
            kv_state[b, head, block] = value


@nvfly.kernel
def block_mask_tables_kernel(num, indices, full_num, full_indices, seqlens: nvfly.Tensor, kv_state: nvfly.Tensor,
                             stage_list: nvfly.Tensor, stage_count: nvfly.Tensor, blocks: nvfly.i32,
                             stages: nvfly.i32, TABLES: nvfly.Constexpr):
    """num/indices: the BlockMask's kv_num_blocks (B', H', 1) and kv_indices (B', H', 1, blocks), full_num/
    full_indices its full_kv_* or None (``TABLES.full``), int32, B' and H' 1 or B and Hq (``TABLES``: a
    ``MaskTablesPlan``); seqlens (B,) int32. Writes kv_state (B, Hq, blocks), stage_list (B, Hkv, stages) and
    stage_count (B, Hkv), int32 (module docstring)."""
    G = TABLES.group
    hkv = nvfly.block_idx.x
    b = nvfly.block_idx.y
    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    lane = nvfly.lane_idx()
    totals = nvfly.shared_tensor(nvfly.i32, (WARPS,))
    for j in nvfly.static_range(G):
        for block in range(tid, blocks, THREADS):
            kv_state[b, hkv * G + j, block] = BLOCK_EMPTY
    nvfly.syncthreads()
    mark_blocks(num, indices, kv_state, b, hkv, blocks, tid, BLOCK_PARTIAL, TABLES)
    if TABLES.full:
        nvfly.syncthreads()
        mark_blocks(full_num, full_indices, kv_state, b, hkv, blocks, tid, BLOCK_FULL, TABLES)
    nvfly.syncthreads()
    limit = nvfly.minimum((seqlens[b] + BLOCK_N - 1) // BLOCK_N, stages)  # the sequence's stages
    listed = nvfly.i32(0)
    for first in range(0, stages, THREADS):
        stage = first + tid
        block = nvfly.minimum(stage * BLOCK_N // TABLES.kv_block, blocks - 1)
        read = kv_state[b, hkv * G, block] != BLOCK_EMPTY
        for j in nvfly.static_range(1, G):
            read = read | (kv_state[b, hkv * G + j, block] != BLOCK_EMPTY)
        read = read & (stage < limit)
        rank = block_scan(nvfly.select(read, 1, 0), totals, lane, warp, WARPS, exclusive=True)
        total = totals[0]
        for w in nvfly.static_range(1, WARPS):
            total = total + totals[w]
        if stage < stages:
            slot = nvfly.select(read, listed + rank, stages - 1 - (first - listed) - (tid - rank))
            stage_list[b, hkv, slot] = stage
        listed = listed + total
        nvfly.syncthreads()  # every thread read the totals before the next chunk writes them
    if tid == 0:
        stage_count[b, hkv] = listed
