"""Attention's two products on one 64-row tile, the second with A from registers: S = Q @ K^T (both operands in
shared memory), then O = P @ V with P = scale * S (attention's softmax scale) rounded to the input type and fed
to wgmma from registers, the way FlashAttention-3 feeds P. One warpgroup in one block; the tiles reach their swizzled shared layouts through plain
loads and stores (the layouts come from ``sm90.operand_layout``), so the example needs no TMA descriptors.

Q is 64 x D and K is D x D, with D one 128-byte row (64 16-bit or 128 8-bit elements); V is D x 128, MN-major
(as attention stores it) or K-major (16-bit V only, since fp8 wgmma takes K-major operands only).
"""
import nvfly
from nvfly.arch import sm90
from nvfly.arch.ptx import smem_address
from nvfly.layout.tensor import make_tensor

SWIZZLE = 128
ROWS = 64  # one wgmma's M: the block's tile of Q
V_COLS = 128


@nvfly.kernel
def p_v_kernel(q: nvfly.Tensor, k: nvfly.Tensor, v: nvfly.Tensor, o: nvfly.Tensor, P_DTYPE: nvfly.Constexpr,
               V_DTYPE: nvfly.Constexpr, ACC: nvfly.Constexpr, V_MAJOR: nvfly.Constexpr, SCALE: nvfly.Constexpr):
    """q, k, v hold the raw bits of P_DTYPE / V_DTYPE elements (16- or 8-bit integers); o is f32."""
    size = P_DTYPE.itemsize
    depth = SWIZZLE // size
    s_atom = sm90.WgmmaAtom(depth, P_DTYPE, P_DTYPE, "K", "K", ACC)
    pv_atom = sm90.WgmmaAtom(V_COLS, P_DTYPE, V_DTYPE, "K", V_MAJOR, ACC, a_source="registers")
    q_layout = sm90.operand_layout(ROWS, depth, P_DTYPE, "K", SWIZZLE)
    k_layout = sm90.operand_layout(depth, depth, P_DTYPE, "K", SWIZZLE)
    v_layout = sm90.operand_layout(V_COLS, depth, V_DTYPE, V_MAJOR, SWIZZLE)
    q_lbo, q_sbo = sm90.descriptor_offsets(q_layout, P_DTYPE, "K", SWIZZLE)
    k_lbo, k_sbo = sm90.descriptor_offsets(k_layout, P_DTYPE, "K", SWIZZLE)
    v_lbo, v_sbo = sm90.descriptor_offsets(v_layout, V_DTYPE, V_MAJOR, SWIZZLE)
    k_offset = ROWS * depth * size
    v_offset = k_offset + depth * depth * size
    q_tile = nvfly.dynamic_shared_tensor(q.dtype, (ROWS * depth,))
    k_tile = nvfly.dynamic_shared_tensor(k.dtype, (depth * depth,), offset_bytes=k_offset)
    v_tile = nvfly.dynamic_shared_tensor(v.dtype, (V_COLS * depth,), offset_bytes=v_offset)
    tid = nvfly.thread_idx.x

    # the tiles into their canonical GMMA layouts: (row, k) for Q and K, (n, k) for V
    q_smem = make_tensor(q_tile, q_layout)
    for i in range(tid, ROWS * depth, 128):
        q_smem[i // depth, i % depth] = q[i // depth, i % depth]
    k_smem = make_tensor(k_tile, k_layout)
    for i in range(tid, depth * depth, 128):
        k_smem[i // depth, i % depth] = k[i // depth, i % depth]
    v_smem = make_tensor(v_tile, v_layout)
    for i in range(tid, V_COLS * depth, 128):
        v_smem[i % V_COLS, i // V_COLS] = v[i // V_COLS, i % V_COLS]
    sm90.fence_proxy_async()  # the generic-proxy stores before wgmma's async-proxy reads
    nvfly.syncthreads()

    base = smem_address(q_tile)
    s = sm90.Accumulator.undefined(s_atom)
    sm90.fence()
    for ks in nvfly.static_range(depth // s_atom.k):
        q_off = q_layout.inner((0, ks * s_atom.k)) * size
        k_off = k_layout.inner((0, ks * s_atom.k)) * size
        s = sm90.mma(s_atom, s, sm90.smem_descriptor(base + q_off, q_lbo, q_sbo, SWIZZLE),
                     sm90.smem_descriptor(base + k_offset + k_off, k_lbo, k_sbo, SWIZZLE), zero=ks == 0)
    sm90.commit_group()
    sm90.wait_group(0)

    p = s.map(lambda x, i: x * SCALE).to_a_fragments(pv_atom)
    out = sm90.Accumulator.undefined(pv_atom)
    sm90.fence()  # P's registers were written since the last wgmma
    for ks in nvfly.static_range(len(p)):
        v_off = v_layout.inner((0, ks * pv_atom.k)) * V_DTYPE.itemsize
        out = sm90.mma(pv_atom, out, p[ks], sm90.smem_descriptor(base + v_offset + v_off, v_lbo, v_sbo, SWIZZLE),
                       zero=ks == 0)
    sm90.commit_group()
    sm90.wait_group(0)

    warp = tid // 32
    lane = tid % 32
    for j in nvfly.static_range(V_COLS // 8):
        for h in nvfly.static_range(2):
            for e in nvfly.static_range(2):
                o[warp * 16 + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + e] = out[4 * j + 2 * h + e].to(nvfly.f32)


@nvfly.jit
def p_v_tile(q, k, v, acc=nvfly.f32, v_major="MN", scale=0.5):
    """O = round(scale * Q @ K^T) @ V in f32 for one 64-row tile (q 64 x D, k D x D, v D x 128; bf16, f16 or fp8,
    D = 128 bytes of elements); the rounding is to q's dtype, the accumulation in ``acc``.

    For fp8 P the A fragments hold S's columns in ``sm90.register_a_k_order``: V's rows are permuted to match
    here on the host (FlashAttention-3 does it in its transpose of V).
    """
    import torch
    from nvfly.frontend.dtypes import from_torch_name
    p_dtype = from_torch_name(str(q.dtype).removeprefix("torch."))
    v_dtype = from_torch_name(str(v.dtype).removeprefix("torch."))
    bits = torch.int16 if p_dtype.bits == 16 else torch.uint8
    v_bits = v.view(bits)
    if p_dtype.bits == 8:
        atom = sm90.WgmmaAtom(V_COLS, p_dtype, v_dtype, a_source="registers")
        order = sm90.register_a_k_order(atom)
        rows = [step + kk for step in range(0, v.shape[0], atom.k) for kk in order]
        v_bits = v_bits[rows]
    o = torch.empty(ROWS, V_COLS, dtype=torch.float32, device=q.device)
    p_v_kernel[1, 128](q.view(bits), k.view(bits), v_bits.contiguous(), o, P_DTYPE=p_dtype, V_DTYPE=v_dtype,
                       ACC=acc, V_MAJOR=v_major, SCALE=scale)
    return o
