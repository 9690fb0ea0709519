"""The bitonic sort of a block's k kept ranks in registers, and the sorted output written from them.

Each thread holds R consecutive entries (``sort_per_thread``: 4 for 1024 entries over 256 threads; 128 or fewer
stay in one warp); strides below R swap in the thread, below 32R through warp shuffles, larger ones through shared
memory (1024 entries: 6 barriers for the 55 stages).
"""
from __future__ import annotations

import nvfly
from nvfly.ops.topk.keys import ABSENT, rank_index


# ---------------------------------------------------------------------------------------------- the sort
def sort_per_thread(size: int, threads: int) -> int:
    """Entries per thread of the register bitonic sort of ``size`` entries: at least 4 (or all of a warp's
    share when fewer), so that strides below 4 stay in registers and those below 128 within a warp."""
    return max(1, size // threads, min(4, size // 32))


def bitonic_stages(size: int) -> list[tuple[int, int]]:
    """(block, stride) of each compare-exchange stage of a bitonic sort of ``size`` (a power of two) entries:
    entry i meets entry i ^ stride and keeps the larger when i is the lower one and (i & block) == 0."""
    stages = []
    block = 2
    while block <= size:
        stride = block // 2
        while stride >= 1:
            stages.append((block, stride))
            stride //= 2
        block *= 2
    return stages


@nvfly.func
def sort_descending(buf, spare, kept, tid, lane, SIZE, THREADS):
    """``buf[:kept]`` followed by ABSENT up to ``SIZE`` in decreasing order, in registers: thread t holds entries
    [t*R, (t+1)*R) (R = ``sort_per_thread``). Strides below R are exchanged within the thread, strides up to
    32R by warp shuffles, larger ones through shared memory (``spare`` and ``buf`` in turn: one barrier each).
    Returns this thread's R sorted entries."""
    R = sort_per_thread(SIZE, THREADS)
    first = tid * R
    active = first < SIZE
    items = [buf.load(first + j, mask=first + j < kept, other=ABSENT) for j in nvfly.static_range(R)]
    exchanges = 0
    for block, stride in bitonic_stages(SIZE):
        # entry first + j is in a descending run when (first + j) & block == 0: for a block smaller than R
        # j decides (first is a multiple of R), for a larger one first does (j < R adds no carry past bit R)
        descending = (first & block) == 0
        if stride < R:
            for j in nvfly.static_range(R):
                if j & stride == 0:
                    a, b = items[j], items[j | stride]
                    larger, smaller = nvfly.maximum(a, b), nvfly.minimum(a, b)
                    if block < R:
                        items[j], items[j | stride] = (larger, smaller) if j & block == 0 else (smaller, larger)
                    else:
                        items[j] = nvfly.select(descending, larger, smaller)
                        items[j | stride] = nvfly.select(descending, smaller, larger)
        else:
            if stride < 32 * R:
                lower = (lane & (stride // R)) == 0
                others = [nvfly.shfl_xor(items[j], stride // R) for j in nvfly.static_range(R)]
            else:
                area = spare if exchanges % 2 == 0 else buf
                exchanges += 1
                for j in nvfly.static_range(R):
                    area.store(items[j], first + j, mask=active)
                nvfly.syncthreads()
                lower = (first & stride) == 0
                others = [area.load((first + j) ^ stride, mask=active, other=ABSENT) for j in nvfly.static_range(R)]
            for j in nvfly.static_range(R):
                keep_larger = lower == descending  # (stride >= R: the block is larger than R)
                items[j] = nvfly.select(keep_larger, nvfly.maximum(items[j], others[j]),
                                        nvfly.minimum(items[j], others[j]))
    return items


# ---------------------------------------------------------------------------------------------- the output
@nvfly.func
def write_sorted(x, values, indices, buf, kept_buf, kept, k, row, tid, lane, K_POW2, THREADS):
    """Sort the ``kept`` candidates of ``buf`` and write the first k: indices and the values gathered by index."""
    items = sort_descending(buf, kept_buf, kept, tid, lane, K_POW2, THREADS)
    first = tid * sort_per_thread(K_POW2, THREADS)
    for j in nvfly.static_range(len(items)):
        if first + j < k:
            index = rank_index(items[j])
            indices[row, first + j] = index.to(nvfly.i64)
            values[row, first + j] = x[row, index]
