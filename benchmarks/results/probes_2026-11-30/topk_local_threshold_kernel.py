"""Measured and not kept (topk_local_threshold_probe_h200.log): one launch for small k, each block appending its
slice's elements at or above its own k-th key's bucket, the row's last block selecting from that list. Lived in
nvfly/ops/topk_row.py at 7c8bd54 with two helper changes: ``count_slice(..., LOCAL=True)`` stored the slice's bucket
totals in the shared ``hist[:HIST]`` instead of adding them to the row's global histogram, and
``publish_candidates(..., claim=None)`` added ``claim`` to the appends (CAP + 1 marking a block whose candidates did
not fit) and wrote no entry past the list's end. Plan: ``dataclasses.replace(row_plan, local_threshold=True,
one_launch=False, shared_finish=False, cap=ROW_CAP_MAX)``; runner: grid (m, parts), (counters, candidates) of
``topk_row.workspace``. Kept for reference only (not importable as it stands)."""


@nvfly.kernel
def topk_row_local_kernel(x: nvfly.Tensor, values: nvfly.Tensor, indices: nvfly.Tensor, counters: nvfly.Tensor,
                          candidates: nvfly.Tensor, k: nvfly.i32, slice_len: nvfly.i32, VEC: nvfly.Constexpr,
                          UNROLL: nvfly.Constexpr, THREADS: nvfly.Constexpr, CAP: nvfly.Constexpr,
                          K_POW2: nvfly.Constexpr, LARGEST: nvfly.Constexpr):
    nvfly.min_blocks_per_sm(1)
    row, tid, lane, warp, start, stop = block_slice(x, slice_len)
    smem = shared_state(CAP, K_POW2, THREADS, tid)
    buf, kept_buf, hist, lane_sums, warp_sums, warp_lows, state = smem
    counts = nvfly.dynamic_shared_tensor(nvfly.i32, (HIST * COPIES,), one_launch_counts_offset(CAP, K_POW2, THREADS))
    first_loads = count_slice(x, hist, counts, row, start, stop, tid, VEC, UNROLL, THREADS, LARGEST, True)
    nvfly.syncthreads()
    bucket, above, in_bucket = locate_bucket(hist, lane_sums, warp_sums, 0, HIST, k, tid, lane, warp, THREADS)
    whole = above + in_bucket < k  # a slice of fewer than k elements: all of it
    lowest = nvfly.select(whole, 0, bucket.bitcast(nvfly.u32) << ((32 if x.dtype == nvfly.f32 else 16) - HIST_BITS))
    mine = nvfly.select(whole, stop - start, above + in_bucket)
    if mine <= CAP:
        stage_candidates(x, row, start, stop, lowest, buf, state, tid, lane, VEC, UNROLL, THREADS, LARGEST, None,
                         first_loads)
    nvfly.syncthreads()
    claim = nvfly.select(mine <= CAP, mine, CAP + 1)  # (more than CAP in all: the last block streams the row)
    if publish_candidates(candidates, counters, hist, buf, state, row, tid, THREADS, nvfly.grid_dim.y - 1, claim):
        nvfly.threadfence()
        count = load_relaxed_i32(counters.address(2 * row + 1))
        if count <= CAP:
            load_list(candidates, buf, warp_sums, row, count, tid, lane, warp, THREADS)
            if tid == 0:
                state[0] = count
            nvfly.syncthreads()
            select_top(*smem, k, highest_index_bit(x), tid, lane, warp, THREADS)
        else:
            stream_top(x, row, 0, x.shape[1], k, smem, tid, VEC, UNROLL, THREADS, CAP, K_POW2, LARGEST)
        write_sorted(x, values, indices, buf, kept_buf, state[0], k, row, tid, lane, K_POW2, THREADS)
        if tid < 2:
            counters[2 * row + tid] = 0
