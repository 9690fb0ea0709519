"""Hardware atoms: copy and MMA instructions, barriers and fences, as small validated descriptors and
functions that emit them inside kernels. ``sm90`` (Hopper: TMA, mbarrier, wgmma, clusters, setmaxnreg) and
``sm80`` (Ampere: cp.async, ldmatrix, mma.sync); ``ptx`` holds what both share.

The device building blocks of the kernel library, for any target the language compiles for: ``warp`` (ballot,
lane masks, popc, bfind), ``reduce`` (warp, group and block reductions and scans), ``gpu_scope`` (GPU-scope
atomics, loads and stores), ``memory`` (cache-hinted global loads and stores, the L2Policy / L1Eviction hints TMA
shares, shared-memory vector stores) and ``floats`` (float compare masks, f16 -> f32, e4m3 -> f16 / bf16, the MUFU tanh)."""
