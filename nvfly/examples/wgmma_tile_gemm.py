"""A single-CTA tiled-MMA GEMM tile: TMA loads into an mbarrier ring, one warpgroup issuing wgmma (bf16 -> f32).

C[M, N] = A[M, K] @ B[K, N] with A row-major and B row-major (MN-major operand) or column-major (K-major).
Each block computes one 64 x BN tile (BN = 8..256); thread 0 keeps the ring full. Every layout fact (the swizzled shared
layouts, TMA boxes, descriptor offsets) comes from ``nvfly.arch.sm90`` and ``nvfly.layout``.
"""
import nvfly
from nvfly.arch import sm90
from nvfly.arch.ptx import smem_address

BK = 64
SWIZZLE = 128


def tile_plan(BM, BN, b_major, dtype):
    """Static facts of one stage: layouts, boxes, byte sizes."""
    a_layout = sm90.operand_layout(BM, BK, dtype, "K", SWIZZLE)
    b_layout = sm90.operand_layout(BN, BK, dtype, b_major, SWIZZLE)
    a_box, (a_boxes,) = sm90.operand_boxes(a_layout, BM, BK, dtype, "K", SWIZZLE)
    b_box, (b_boxes,) = sm90.operand_boxes(b_layout, BN, BK, dtype, b_major, SWIZZLE)
    a_bytes = BM * BK * dtype.itemsize
    b_bytes = BN * BK * dtype.itemsize
    return dict(a_layout=a_layout, b_layout=b_layout, a_box=a_box, b_box=b_box, a_boxes=a_boxes,
                b_boxes=b_boxes, a_bytes=a_bytes, b_bytes=b_bytes, stage_bytes=a_bytes + b_bytes)


@nvfly.kernel
def wgmma_tile_kernel(a_desc: nvfly.TmaDescriptor, b_desc: nvfly.TmaDescriptor, c: nvfly.Tensor,
                      k_tiles: nvfly.i32, BM: nvfly.Constexpr, BN: nvfly.Constexpr, B_MAJOR: nvfly.Constexpr,
                      STAGES: nvfly.Constexpr):
    plan = tile_plan(BM, BN, B_MAJOR, nvfly.bf16)
    atom = sm90.WgmmaAtom(BN, nvfly.bf16, nvfly.bf16, "K", B_MAJOR)
    a_lbo, a_sbo = sm90.descriptor_offsets(plan["a_layout"], nvfly.bf16, "K", SWIZZLE)
    b_lbo, b_sbo = sm90.descriptor_offsets(plan["b_layout"], nvfly.bf16, B_MAJOR, SWIZZLE)
    stage_bytes = plan["stage_bytes"]
    ring = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (STAGES * stage_bytes,), offset_bytes=1024))
    pipe = sm90.TmaPipeline(smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (2 * STAGES,))), STAGES,
                            stage_bytes, consumer_arrivals=1)
    tid = nvfly.thread_idx.x
    m0 = nvfly.block_idx.y * BM
    n0 = nvfly.block_idx.x * BN
    if tid == 0:
        pipe.init()
    nvfly.syncthreads()

    def load_stage(state, kt):
        base = ring + state.stage * stage_bytes
        pipe.producer_expect(state)
        for box in plan["a_boxes"]:
            sm90.tma_load(a_desc, base + box.smem_offset, (m0 + box.mn_offset, kt * BK + box.k_offset),
                          pipe.full(state.stage))
        for box in plan["b_boxes"]:
            coords = (n0 + box.mn_offset, kt * BK + box.k_offset) if B_MAJOR == "K" else \
                (kt * BK + box.k_offset, n0 + box.mn_offset)
            sm90.tma_load(b_desc, base + plan["a_bytes"] + box.smem_offset, coords, pipe.full(state.stage))

    # prologue: thread 0 fills the ring
    if tid == 0:
        for s in nvfly.static_range(STAGES):
            if s < k_tiles:
                load_stage(sm90.PipelineState(s, 0, STAGES), s)

    consume = sm90.PipelineState.start(STAGES)
    acc = sm90.Accumulator.zeros(atom)
    for kt in range(k_tiles):
        pipe.consumer_wait(consume)
        base = ring + consume.stage * stage_bytes
        sm90.fence()
        for k in nvfly.static_range(BK // atom.k):
            a_off = plan["a_layout"].inner((0, k * atom.k)) * 2
            b_off = plan["b_layout"].inner((0, k * atom.k)) * 2
            da = sm90.smem_descriptor(base + a_off, a_lbo, a_sbo, SWIZZLE)
            db = sm90.smem_descriptor(base + plan["a_bytes"] + b_off, b_lbo, b_sbo, SWIZZLE)
            acc = sm90.mma(atom, acc, da, db)
        sm90.commit_group()
        sm90.wait_group(0)
        # the stage is read: thread 0 refills it with k-tile kt + STAGES
        nvfly.named_barrier(1, 128)
        if (tid == 0) & (kt + STAGES < k_tiles):
            load_stage(consume, kt + STAGES)
        consume = consume.advance()

    # epilogue: each thread writes its fragment (row, col) elements
    warp = tid // 32
    lane = tid % 32
    m, n = c.shape[0], c.shape[1]
    for j in nvfly.static_range(BN // 8):
        for h in nvfly.static_range(2):
            row = m0 + warp * 16 + lane // 4 + 8 * h
            col = n0 + 8 * j + 2 * (lane % 4)
            if (row < m) & (col < n):
                c[row, col] = acc[4 * j + 2 * h]
            if (row < m) & (col + 1 < n):
                c[row, col + 1] = acc[4 * j + 2 * h + 1]


@nvfly.jit
def tile_gemm(a, b, BN=128, stages=3):
    """C = A @ B (f32 out) for bf16 A (row-major) and B (row-major or column-major), one tile per block."""
    import torch
    BM = 64
    m, k = a.shape
    n = b.shape[1]
    b_major = "MN" if b.stride(1) == 1 else "K"
    c = torch.empty((m, n), dtype=torch.float32, device=a.device)
    a_desc = nvfly.TmaDescriptor(a, sm90.operand_boxes(sm90.operand_layout(BM, BK, nvfly.bf16, "K"), BM, BK,
                                                       nvfly.bf16, "K", SWIZZLE)[0])
    b_layout = sm90.operand_layout(BN, BK, nvfly.bf16, b_major)
    b_box = sm90.operand_boxes(b_layout, BN, BK, nvfly.bf16, b_major, SWIZZLE)[0]
    b_desc = nvfly.TmaDescriptor(b.t() if b_major == "K" else b, b_box)
    grid = ((n + BN - 1) // BN, (m + BM - 1) // BM)
    wgmma_tile_kernel[grid, 128](a_desc, b_desc, c, (k + BK - 1) // BK, BM=BM, BN=BN, B_MAJOR=b_major,
                                 STAGES=stages)
    return c
