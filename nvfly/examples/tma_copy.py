"""TMA tiled copy: global -> shared (128-byte swizzle) -> global, and a second read of the shared tile through
nvfly's swizzled layout, which must agree with where the hardware put each element."""
import nvfly
from nvfly.arch import sm90
from nvfly.arch.ptx import smem_address
from nvfly.layout import make_swizzle_atom, tile_to_shape
from nvfly.layout.tensor import make_tensor

BAR_BYTES = 1024  # the barrier sits before the tile; the tile stays 1024-byte aligned for the swizzle


@nvfly.kernel
def tma_copy_kernel(src: nvfly.TmaDescriptor, dst: nvfly.TmaDescriptor, out: nvfly.Tensor,
                    BOX_ROWS: nvfly.Constexpr, BOX_COLS: nvfly.Constexpr):
    tile = nvfly.dynamic_shared_tensor(out.dtype, (BOX_ROWS, BOX_COLS), offset_bytes=BAR_BYTES)
    bar = smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (1,)))
    tid = nvfly.thread_idx.x
    row0 = nvfly.block_idx.y * BOX_ROWS
    col0 = nvfly.block_idx.x * BOX_COLS
    if tid == 0:
        sm90.mbarrier_init(bar, 1)
        sm90.fence_barrier_init()
    nvfly.syncthreads()
    if tid == 0:
        sm90.mbarrier_arrive_expect_tx(bar, BOX_ROWS * BOX_COLS * out.dtype.itemsize)
        sm90.tma_load(src, smem_address(tile), (row0, col0), bar)
    sm90.mbarrier_wait(bar, 0)
    # read the swizzled tile element by element through the layout
    swizzled = make_tensor(tile, tile_to_shape(make_swizzle_atom(128, out.dtype.bits), (BOX_ROWS, BOX_COLS)))
    m, n = out.shape[0], out.shape[1]
    for i in range(tid, BOX_ROWS * BOX_COLS, 128):
        r = i // BOX_COLS
        c = i % BOX_COLS
        if (row0 + r < m) & (col0 + c < n):
            out[row0 + r, col0 + c] = swizzled[r, c]
    if tid == 0:
        sm90.tma_store(dst, smem_address(tile), (row0, col0))
        sm90.tma_store_commit()
        sm90.tma_store_wait(0)


@nvfly.jit
def tma_copy(x, box=(64, 64)):
    """(x copied by TMA round trip, x read through the swizzled layout) for a 2-D 16-bit tensor."""
    import torch
    rows, cols = box
    y = torch.empty_like(x)
    z = torch.empty_like(x)
    src = nvfly.TmaDescriptor(x, box, swizzle=128)
    dst = nvfly.TmaDescriptor(y, box, swizzle=128)
    grid = ((x.shape[1] + cols - 1) // cols, (x.shape[0] + rows - 1) // rows)
    tma_copy_kernel[grid, 128](src, dst, z, BOX_ROWS=rows, BOX_COLS=cols)
    return y, z
