"""A CTA's arrival on a per-tile counter of a zeroed workspace (``scratch.workspace``): the step of a reduction across
CTAs in one launch (split-KV attention's fix-up combine; the skinny and wgmma GEMMs' split K inline the same steps)
where each CTA has written its part and the CTA that counts itself in last finishes the tile."""
from __future__ import annotations

import nvfly
from nvfly.arch.gpu_scope import arrive


@nvfly.func
def last_to_arrive(counters, index, arrived, contributors):
    """Whether this CTA is the last of ``contributors`` to count itself in on ``counters[index]`` (u32, GPU
    scope), uniform over the CTA: every thread fences its earlier global writes (visible GPU-wide before the count),
    thread 0 counts in and shares the previous count through ``arrived`` (one i32 of shared memory); the last CTA
    fences again before it reads the others' writes. Its caller zeroes ``counters[index]`` for the next launch."""
    nvfly.threadfence()
    nvfly.syncthreads()
    if nvfly.thread_idx.x == 0:
        arrived[0] = arrive(counters.address(index))
    nvfly.syncthreads()
    last = arrived[0] == contributors - 1
    if last:
        nvfly.threadfence()
    return last
