"""Hopper (sm_90a) atoms: TMA copies, mbarriers and pipelines, wgmma (A from shared memory or registers; bf16,
f16, fp8), fences, clusters, setmaxnreg. Each atom refuses other compile targets (``nvfly.arch.target``)."""
from nvfly.arch.sm90.pipeline import PipelineState, TmaPipeline
from nvfly.arch.sm90.sync import (
    cluster_arrive, cluster_sync, cluster_wait, elect_one, fence_barrier_init, fence_proxy_async,
    mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_arrive_remote, mbarrier_expect_tx, mbarrier_init,
    mbarrier_wait, setmaxnreg,
)
from nvfly.arch.sm90.tma import (bulk_load, tma_load, tma_prefetch_descriptor, tma_store, tma_store_commit,
                                  tma_store_wait)
from nvfly.arch.sm90.wgmma import (
    AFragment, Accumulator, TmaBox, WgmmaAtom, choose_swizzle, commit_group, descriptor_offsets, fence, mma,
    a_fragment_elements, operand_boxes, operand_layout, register_a_k_order, smem_descriptor, stmatrix_x4, wait_group,
)
