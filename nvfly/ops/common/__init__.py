"""Parts the op families share: per-stream scratch, the host op-call mechanism, the persistent tile scheduler, and the
wgmma GEMMs' (dense, grouped, scaled) config, mainloop and register epilogue."""
