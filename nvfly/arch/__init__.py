"""Hardware atoms: copy and MMA instructions, barriers and fences, as small validated descriptors and
functions that emit them inside kernels. ``sm90`` (Hopper: TMA, mbarrier, wgmma, clusters, setmaxnreg) and
``sm80`` (Ampere: cp.async, ldmatrix, mma.sync); ``ptx`` holds what both share."""
