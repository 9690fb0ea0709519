# Recorded probe, kept as run on 2026-11-30 (it lived at nvfly/ops/topk_cluster.py then; not part of nvfly): correct
# (154/154 GPU cases) but 1.4-2x slower than the default plan at one row and 3-5x slower at 64 rows
# (benchmarks/results/topk_cluster_probe_h200.log). Why is not measured: the remote (DSMEM) loads cost more than
# estimated (16-byte loads instead of 4-byte ones for the histogram saved ~3 us, and k = 1024 is still ~8 us
# slower than k = 50, whose only difference is ~1K remote 8-byte loads a block and the ranking of the outputs),
# and 16K elements an SM count into one SM's shared-memory histogram (2K in the default plan's 63 blocks).
# Profile (ncu: the DSMEM and barrier.cluster stalls) before building on it.
"""TopK of a few long rows of 16-bit values, one thread-block cluster a row, in one launch (``TopkPlan.cluster``).

The row-threshold plans (``topk_row``) meet across a row's blocks through global memory: a histogram added in L2,
arrival counters polled in L2, a candidate list that the row's last block alone selects from and sorts. At one
row of 128K-152K (sampling) those round trips and the single finishing block are most of the ~9-14 us. Here a
row's CLUSTER blocks (8: the portable cluster size) hold the whole row in registers (STEPS 16-byte loads a
thread) and meet through distributed shared memory and ``barrier.cluster`` instead:

1. every block counts its slice's order keys (``topk.order_key``) by their top HIST_BITS bits in shared memory
   (COPIES interleaved copies, as ``topk_row``) and sums the copies;
2. cluster barrier; every block adds up the blocks' histograms (DSMEM loads) and locates the bucket B of the
   k-th largest key (``locate_bucket``); 16-bit keys leave 5 bits below the bucket, so
3. every block counts its keys in B by those 5 bits (32 counters); cluster barrier; from the blocks' 32 counts
   every block knows the k-th largest key K* exactly, how many keys equal to K* the result takes (t), and how
   many of them lie in lower blocks (lower columns);
4. the block's outputs are its keys above K* and, of its keys equal to K*, the first ones in column order while
   the row's count stays within t (ties go to the lowest index, as the module doc of ``topk`` says): exactly k
   over the cluster, whatever the ties (an all-equal row too);
5. cluster barrier; every block copies all outputs (k ranks, DSMEM) and places each of its own at the number of
   ranks above it (warps split the list; shared atomics add up the counts), and writes values and indices.

No workspace, nothing to clean, no cooperative launch: clusters are scheduled whole, so rows need not fit the GPU
at once. Four cluster barriers and no global round trip beyond reading x and writing the result.
"""
from __future__ import annotations

from typing import Any

import nvfly
from nvfly.arch.ptx import asm, asm_multi, smem_address
from nvfly.arch.sm90 import cluster_arrive, cluster_sync, cluster_wait
from nvfly.frontend.language import atomic_add
from nvfly.ops.topk import (HIST, HIST_BITS, ballot, highest_bit, locate_bucket, order_key, rank64,
                            warp_inclusive_sum)
from nvfly.ops.topk_row import COPIES, write_result

CLUSTER = 8          # blocks a row: the largest portable cluster
THREADS = 1024
MAX_STEPS = 4        # 16-byte loads a thread holds in registers: rows up to CLUSTER * THREADS * 8 * 4 = 256K
LOW_BITS = 16 - HIST_BITS  # key bits below the first-level bucket of a 16-bit key: 32 second-level counters


def dsmem_load_u32(address: Any, block: Any) -> Any:
    """The 32-bit word at shared address ``address`` of block ``block`` of the cluster."""
    return asm("{ .reg .b32 remote; mapa.shared::cluster.u32 remote, $1, $2; ld.shared::cluster.u32 $0, [remote]; }",
               [address, block], nvfly.i32)


def dsmem_load_v4(address: Any, block: Any) -> list[Any]:
    """The four 32-bit words at the 16-byte aligned shared address ``address`` of block ``block`` of the cluster."""
    return asm_multi("{ .reg .b32 remote; mapa.shared::cluster.u32 remote, $4, $5; "
                     "ld.shared::cluster.v4.u32 {$0, $1, $2, $3}, [remote]; }", [nvfly.i32] * 4, [address, block])


def dsmem_load_u64(address: Any, block: Any) -> Any:
    """The 64-bit word at shared address ``address`` of block ``block`` of the cluster."""
    return asm("{ .reg .b32 remote; mapa.shared::cluster.u32 remote, $1, $2; ld.shared::cluster.u64 $0, [remote]; }",
               [address, block], nvfly.i64)


def smem_bytes(k_pow2: int) -> int:
    """The kernel's shared memory (``shared_layout``)."""
    return shared_layout(k_pow2)[-1]


def shared_layout(k_pow2: int) -> list[int]:
    """Byte offsets of: the copies' counts, the block's histogram, the cluster's (three parts: the row's, the
    sums this block owns, what ``locate_bucket`` zeroes), lane sums, warp sums, the 32 second-level counts, the state, the block's outputs, the row's outputs,
    their positions; and the end."""
    sizes = [4 * HIST * COPIES, 4 * HIST, 12 * HIST, 4 * THREADS, 4 * 64, 4 * 32, 4 * 8, 8 * k_pow2, 8 * k_pow2,
             4 * k_pow2]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


@nvfly.func
def slice_keys(loads, s, VEC, LARGEST):
    """The order keys of load ``s``'s VEC elements."""
    return [order_key(loads[s][e] if VEC > 1 else loads[s], LARGEST) for e in nvfly.static_range(VEC)]


@nvfly.kernel
def topk_cluster_kernel(x: nvfly.Tensor, values: nvfly.Tensor, indices: nvfly.Tensor, k: nvfly.i32,
                        STEPS: nvfly.Constexpr, VEC: nvfly.Constexpr, K_POW2: nvfly.Constexpr,
                        LARGEST: nvfly.Constexpr):
    """Cluster ``row`` (CLUSTER blocks of THREADS, block ``part`` holding columns [part * SLICE, (part + 1) *
    SLICE), SLICE = THREADS * VEC * STEPS) writes the k largest of its row in order (module doc)."""
    nvfly.min_blocks_per_sm(1)
    WARPS = THREADS // 32
    SLICE = THREADS * VEC * STEPS
    part = nvfly.block_rank_in_cluster().bitcast(nvfly.i32)
    row = nvfly.block_idx.x // CLUSTER
    tid = nvfly.thread_idx.x
    lane = tid & 31
    warp = tid >> 5
    n = x.shape[1]
    at = shared_layout(K_POW2)
    counts = nvfly.dynamic_shared_tensor(nvfly.i32, (HIST * COPIES,), at[0])
    block_hist = nvfly.dynamic_shared_tensor(nvfly.i32, (HIST,), at[1])
    row_hist = nvfly.dynamic_shared_tensor(nvfly.i32, (3 * HIST,), at[2])
    lane_sums = nvfly.dynamic_shared_tensor(nvfly.i32, (THREADS,), at[3])
    warp_sums = nvfly.dynamic_shared_tensor(nvfly.i32, (64,), at[4])
    low_counts = nvfly.dynamic_shared_tensor(nvfly.i32, (32,), at[5])
    state = nvfly.dynamic_shared_tensor(nvfly.i32, (8,), at[6])  # [0] outputs, [1] K*, [2] ties to take
    mine = nvfly.dynamic_shared_tensor(nvfly.i64, (K_POW2,), at[7])
    ranks = nvfly.dynamic_shared_tensor(nvfly.i64, (K_POW2,), at[8])
    positions = nvfly.dynamic_shared_tensor(nvfly.i32, (K_POW2,), at[9])

    first_col = part * SLICE + tid * VEC
    loads = [x.load(row, first_col + s * THREADS * VEC, width=VEC, mask=first_col + s * THREADS * VEC < n)
             for s in nvfly.static_range(STEPS)]
    for j in nvfly.static_range(HIST * COPIES // (4 * THREADS)):
        counts.store(nvfly.full(4, 0, nvfly.i32), (j * THREADS + tid) * 4)
    for j in nvfly.static_range((K_POW2 + THREADS - 1) // THREADS):
        if j * THREADS + tid < K_POW2:
            positions[j * THREADS + tid] = 0
    if tid < 32:
        low_counts[tid] = 0
    if tid == 0:
        state[0] = 0
    nvfly.syncthreads()

    # 1. the block's histogram of the top key bits
    copy = tid % COPIES
    for s in nvfly.static_range(STEPS):
        if first_col + s * THREADS * VEC < n:
            for key in slice_keys(loads, s, VEC, LARGEST):
                atomic_add(counts, (key >> LOW_BITS).bitcast(nvfly.i32) * COPIES + copy, 1)
    nvfly.syncthreads()
    for j in nvfly.static_range(HIST // THREADS):
        bucket = j * THREADS + tid
        total = nvfly.i32(0)
        for c in nvfly.static_range(COPIES // 4):
            four = counts.load(bucket * COPIES + 4 * c, width=4)
            total = total + four[0] + four[1] + four[2] + four[3]
        block_hist[bucket] = total
    cluster_sync()

    # 2. the row's histogram, in two rounds of 16-byte DSMEM loads (a remote request costs the same at any width,
    # so as few as possible): block p sums buckets [p * OWN, (p + 1) * OWN) over the cluster, then every block
    # reads all the sums from their owners
    OWN = HIST // CLUSTER
    partial = counts  # (the copies are summed: free)
    if tid < CLUSTER * OWN // 4:
        source = tid // (OWN // 4)
        chunk = tid % (OWN // 4)
        words = dsmem_load_v4(smem_address(block_hist, (part * OWN + 4 * chunk) * 4), source)
        for u in nvfly.static_range(4):
            partial[source * OWN + 4 * chunk + u] = words[u]
    nvfly.syncthreads()
    if tid < OWN:
        total = nvfly.i32(0)
        for q in nvfly.static_range(CLUSTER):
            total = total + partial[q * OWN + tid]
        row_hist[HIST + tid] = total
    cluster_sync()
    if tid < HIST // 4:
        owner = tid // (OWN // 4)
        chunk = tid % (OWN // 4)
        words = dsmem_load_v4(smem_address(row_hist, (HIST + 4 * chunk) * 4), owner)
        for u in nvfly.static_range(4):
            row_hist[owner * OWN + 4 * chunk + u] = words[u]
    nvfly.syncthreads()
    # (locate_bucket zeroes the third part: the second is read by the other blocks until the next cluster barrier)
    bucket, above, in_bucket = locate_bucket(row_hist, lane_sums, warp_sums, 0, 2 * HIST, k, tid, lane, warp,
                                             THREADS)

    # 3. the block's keys in that bucket, by their low bits
    for s in nvfly.static_range(STEPS):
        if first_col + s * THREADS * VEC < n:
            for key in slice_keys(loads, s, VEC, LARGEST):
                if (key >> LOW_BITS).bitcast(nvfly.i32) == bucket:
                    atomic_add(low_counts, (key & 31).bitcast(nvfly.i32), 1)
    cluster_sync()
    if warp == 0:
        in_row = nvfly.i32(0)
        lower = nvfly.i32(0)  # in the blocks of lower columns
        for q in nvfly.static_range(CLUSTER):
            c = dsmem_load_u32(smem_address(low_counts, lane * 4), q)
            in_row = in_row + c
            lower = lower + nvfly.select(q < part, c, 0)
        suffix = in_row  # keys of the bucket at this lane's low bits or above
        for step in nvfly.static_range(5):
            moved = nvfly.shfl_down(suffix, 1 << step)
            suffix = suffix + nvfly.select(lane + (1 << step) < 32, moved, 0)
        needed = k - above
        owner = highest_bit(ballot(suffix >= needed)).bitcast(nvfly.i32)  # K*'s low bits
        if lane == owner:
            taken = needed - (suffix - in_row)  # keys equal to K* in the result
            state[1] = (bucket << LOW_BITS) | lane
            state[2] = nvfly.minimum(nvfly.maximum(taken - lower, 0), low_counts[lane])
    nvfly.syncthreads()

    # 4. the block's outputs: keys above K*, and its first ``take`` keys equal to K* in column order
    kth = state[1].bitcast(nvfly.u32)
    take = state[2]
    # the column order of the keys equal to K*: (step, thread, element); per step a block scan of the threads'
    # counts (a few shuffles and one barrier, whether or not the block takes only some of them)
    tie_base = []
    for s in nvfly.static_range(STEPS):
        in_slice = first_col + s * THREADS * VEC < n
        ties = nvfly.i32(0)
        for key in slice_keys(loads, s, VEC, LARGEST):
            ties = ties + ((key == kth) & in_slice).to(nvfly.i32)
        inclusive = warp_inclusive_sum(ties, lane)
        tie_base.append(inclusive - ties)
        if lane == 31:
            lane_sums[s * WARPS + warp] = inclusive
    nvfly.syncthreads()
    earlier = nvfly.i32(0)  # the ties of the earlier steps
    for s in nvfly.static_range(STEPS):
        total = nvfly.select(lane < WARPS, lane_sums[s * WARPS + nvfly.minimum(lane, WARPS - 1)], 0)
        scanned = warp_inclusive_sum(total, lane)
        tie_base[s] = tie_base[s] + earlier + nvfly.shfl_idx(scanned - total, warp)
        earlier = earlier + nvfly.shfl_idx(scanned, 31)
    outputs = []
    for s in nvfly.static_range(STEPS):
        col = first_col + s * THREADS * VEC
        order = tie_base[s]
        for e, key in enumerate(slice_keys(loads, s, VEC, LARGEST)):
            tie = key == kth
            outputs.append(((col < n) & ((key > kth) | (tie & (order < take))), key, col + e))
            order = order + tie.to(nvfly.i32)
    mine_count = nvfly.i32(0)
    for flag, _, _ in outputs:
        mine_count = mine_count + flag.to(nvfly.i32)
    inclusive = warp_inclusive_sum(mine_count, lane)
    warp_base = nvfly.i32(0)
    if lane == 31:
        warp_base = atomic_add(state, 0, inclusive)
    slot = nvfly.shfl_idx(warp_base, 31) + inclusive - mine_count
    for flag, key, col in outputs:
        if flag:
            mine[slot] = rank64(key, col)
        slot = slot + flag.to(nvfly.i32)
    cluster_sync()

    # 5. all the outputs of the row (block by block), each of this block's placed among them
    if tid < CLUSTER:
        warp_sums[tid] = dsmem_load_u32(smem_address(state, 0), tid)
    nvfly.syncthreads()
    sizes = [warp_sums[q] for q in nvfly.static_range(CLUSTER)]
    for j in nvfly.static_range((K_POW2 + THREADS - 1) // THREADS):
        i = j * THREADS + tid
        if i < k:
            first = nvfly.i32(0)
            owner = nvfly.i32(0)
            seen = nvfly.i32(0)
            for q in nvfly.static_range(CLUSTER):
                past = i >= seen
                owner = nvfly.select(past, q, owner)
                first = nvfly.select(past, seen, first)
                seen = seen + sizes[q]
            ranks[i] = dsmem_load_u64(smem_address(mine, (i - first) * 8), owner)
    cluster_arrive()  # this block reads no other block's shared memory after this
    nvfly.syncthreads()
    mine_total = state[0]
    CHUNK = max(8, K_POW2 // WARPS)  # ranks a warp compares a group of 32 outputs with
    chunks = (k + CHUNK - 1) // CHUNK
    for pair in range(warp, ((mine_total + 31) >> 5) * chunks, WARPS):
        group = pair // chunks
        chunk_start = (pair - group * chunks) * CHUNK
        output = group * 32 + lane
        me = mine[nvfly.minimum(output, mine_total - 1)]
        higher = nvfly.i32(0)
        for j in range(chunk_start, nvfly.minimum(chunk_start + CHUNK, k), 4):
            for u in nvfly.static_range(4):
                r = ranks[nvfly.minimum(j + u, k - 1)]
                higher = higher + ((r > me) & (j + u < k)).to(nvfly.i32)
        if output < mine_total:
            atomic_add(positions, output, higher)
    nvfly.syncthreads()
    for i in range(tid, mine_total, THREADS):
        write_result(x, values, indices, mine[i], row, positions[i], LARGEST)
    cluster_wait()  # the other blocks are done reading this one's shared memory


def fits(n: int, vec: int, itemsize: int) -> bool:
    """Whether rows of n elements (``vec`` a 16-byte access) fit a cluster's registers, for 16-bit values."""
    return itemsize == 2 and n <= CLUSTER * THREADS * vec * MAX_STEPS


def runner(m: int, n: int, k: int, vec: int, largest: bool) -> Any:
    """``run(rows, values, indices)``: one launch of m clusters."""
    k_pow2 = max(2, 1 << (k - 1).bit_length())
    steps = -(-n // (CLUSTER * THREADS * vec))
    launch = topk_cluster_kernel.prepared((m * CLUSTER, 1, 1), THREADS, cluster=(CLUSTER, 1, 1))
    tail = (k, steps, vec, k_pow2, largest)
    return lambda rows, values, indices: launch.launch(rows, values, indices, *tail)
