"""An Ampere-style warp GEMM tile: cp.async into shared memory, ldmatrix, mma.sync m16n8k16 (bf16 -> f32).

C[16, 8] = A[16, K] @ B[K, 8] per warp (A row-major, B given as Bt[8, K]); each block of one warp computes
one 16 x 8 tile.
"""
import nvfly
from nvfly.arch import sm80
from nvfly.arch.ptx import smem_address


@nvfly.kernel
def mma_tile_kernel(a: nvfly.Tensor, bt: nvfly.Tensor, c: nvfly.Tensor, k_steps: nvfly.i32):
    sa = nvfly.shared_tensor(nvfly.bf16, (16, 16), align=128)
    sb = nvfly.shared_tensor(nvfly.bf16, (8, 16), align=128)
    lane = nvfly.lane_idx()
    m0 = nvfly.block_idx.y * 16
    n0 = nvfly.block_idx.x * 8
    acc = [0.0, 0.0, 0.0, 0.0]
    for ks in range(k_steps):
        k0 = ks * 16
        # 32 lanes x 16 bytes fill A's 16 x 16 tile; lanes 0..15 fill B's 8 x 16 tile
        r = lane // 2
        half = (lane % 2) * 8
        sm80.cp_async(smem_address(sa.address(r, half)), a.address(m0 + r, k0 + half))
        if lane < 16:
            sm80.cp_async(smem_address(sb.address(r, half)), bt.address(n0 + r, k0 + half))
        sm80.cp_async_commit()
        sm80.cp_async_wait(0)
        nvfly.syncwarp()
        i = lane // 8
        a_frag = sm80.ldmatrix_x4(smem_address(sa.address(lane % 8 + 8 * (i % 2), 8 * (i // 2))))
        b_frag = sm80.ldmatrix_x4(smem_address(sb.address(lane % 8, 8 * (i % 2))))
        acc = sm80.mma_m16n8k16(a_frag, b_frag[:2], acc, nvfly.bf16)
        nvfly.syncwarp()
    row = m0 + lane // 4
    col = n0 + 2 * (lane % 4)
    c[row, col] = acc[0]
    c[row, col + 1] = acc[1]
    c[row + 8, col] = acc[2]
    c[row + 8, col + 1] = acc[3]


@nvfly.jit
def mma_tile_gemm(a, bt, target=None):
    """C = A @ Bt.T (f32) for bf16 A [M, K] and Bt [N, K], M % 16 == N % 8 == K % 16 == 0."""
    import torch
    m, k = a.shape
    n = bt.shape[0]
    c = torch.empty((m, n), dtype=torch.float32, device=a.device)
    mma_tile_kernel[(n // 8, m // 16), 32](a, bt, c, k // 16)
    return c
