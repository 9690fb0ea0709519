"""Small kernels written in the DSL, each a module to read top to bottom: ``vector_add`` (vector loads and a
tail), ``softmax`` (warp shuffles, a block reduction), ``tiled_transpose`` (shared memory), ``tma_copy`` (TMA),
``wgmma_tile_gemm`` and ``wgmma_register_a`` (Hopper tensor cores), ``mma_sync_tile`` (Ampere tensor cores).
``nvfly demo`` compiles the first three beside the kernel library."""
