"""Row softmax: one block per row, an online max/sum per thread, warp shuffles, then shared memory across warps."""
import nvfly


@nvfly.func
def merge(m, s, m_other, s_other):
    """Merge two (max, sum of exp2(x - max)) pairs; an empty side (max = -inf, sum = 0) adds nothing."""
    m_new = nvfly.maximum(m, m_other)
    # exp2(m - m_new) would be exp2(-inf - -inf) = NaN for two empty sides: scale by 1 when m is the max
    scale = nvfly.select(m == m_new, 1.0, nvfly.exp2(m - m_new))
    scale_other = nvfly.select(m_other == m_new, 1.0, nvfly.exp2(m_other - m_new))
    return m_new, s * scale + s_other * scale_other


@nvfly.func
def block_reduce_max_sum(m, s, scratch_m, scratch_s, WARPS):
    """Combine per-thread (max, sum of exp(x - max)) pairs over the block; every thread gets the result."""
    offset = 16
    while offset > 0:  # compile-time loop: offset is a Python int
        m, s = merge(m, s, nvfly.shfl_xor(m, offset), nvfly.shfl_xor(s, offset))
        offset //= 2
    warp = nvfly.warp_idx()
    if nvfly.lane_idx() == 0:
        scratch_m[warp] = m
        scratch_s[warp] = s
    nvfly.syncthreads()
    m = scratch_m[0]
    s = scratch_s[0]
    for w in nvfly.static_range(1, WARPS):
        m, s = merge(m, s, scratch_m[w], scratch_s[w])
    return m, s


@nvfly.kernel
def softmax_kernel(x: nvfly.Tensor, out: nvfly.Tensor, VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr):
    row = nvfly.block_idx.x
    n = x.shape[1]
    log2e = 1.4426950408889634
    tid = nvfly.thread_idx.x
    m = nvfly.f32(-float("inf"))
    s = nvfly.f32(0.0)
    # pass 1: online max and sum of exp, in base 2
    for start in range(tid * VEC, n, THREADS * VEC):
        v = x.load(row, start, width=VEC).to(nvfly.f32) * log2e
        m_new = nvfly.maximum(m, v.max())
        s = s * nvfly.exp2(m - m_new) + nvfly.exp2(v - m_new).sum()
        m = m_new
    scratch_m = nvfly.shared_tensor(nvfly.f32, (THREADS // 32,))
    scratch_s = nvfly.shared_tensor(nvfly.f32, (THREADS // 32,))
    m, s = block_reduce_max_sum(m, s, scratch_m, scratch_s, THREADS // 32)
    inv = 1.0 / s
    # pass 2: normalise
    for start in range(tid * VEC, n, THREADS * VEC):
        v = x.load(row, start, width=VEC).to(nvfly.f32) * log2e
        out.store((nvfly.exp2(v - m) * inv).to(out.dtype), row, start)


@nvfly.jit
def softmax(x):
    """Softmax over the last dimension of a 2-D tensor whose rows hold a multiple of 16 bytes."""
    import torch
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got {x.dim()} dimensions")
    vec = 16 // x.element_size()
    if x.shape[1] % vec or x.stride(1) != 1:
        raise ValueError(f"x: rows must be contiguous and hold a multiple of {vec} elements")
    out = torch.empty_like(x)
    softmax_kernel[x.shape[0], 256](x, out, VEC=vec, THREADS=256)
    return out
