"""Hopper atoms on the GPU: a TMA tiled copy with a 128-byte swizzle (round trip, and the shared tile read
through nvfly's swizzled layout), a single-CTA TMA + mbarrier + wgmma GEMM tile for several shapes, and the MUFU
tanh's error bound."""
import pytest
import torch

import nvfly
from nvfly.arch.floats import tanh_approx

from nvfly.examples.tma_copy import tma_copy
from nvfly.examples.wgmma_tile_gemm import tile_gemm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(64, 64), (300, 200), (1024, 512)])
@pytest.mark.parametrize("box", [(64, 64), (128, 64), (32, 64)])
def test_tma_copy_round_trip_and_swizzle_layout(hopper, shape, box):
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    y, z = tma_copy(x, box)
    assert torch.equal(y, x)
    assert torch.equal(z, x)  # nvfly's swizzle layout reads each element where TMA stored it


@pytest.mark.parametrize("bn", [64, 128, 256])
@pytest.mark.parametrize("b_major", ["MN", "K"])
@pytest.mark.parametrize("mnk", [(64, 64, 64), (192, 384, 512), (130, 200, 1000), (512, 512, 4096)])
def test_wgmma_tile_gemm(hopper, bn, b_major, mnk):
    m, n, k = mnk
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
    if b_major == "K":
        b = b.t().contiguous().t()
    if (k * 2) % 16 or (n * 2) % 16:
        pytest.skip("TMA needs 16-byte strides")
    c = tile_gemm(a, b, BN=bn, stages=3)
    ref = a.float() @ b.float()
    err = ((c - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err


@pytest.mark.parametrize("mnk", [(16, 8, 16), (64, 32, 128), (256, 128, 512)])
def test_mma_sync_tile_gemm(hopper, mnk):
    from nvfly.examples.mma_sync_tile import mma_tile_gemm
    m, n, k = mnk
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    bt = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    c = mma_tile_gemm(a, bt)
    ref = a.float() @ bt.float().t()
    assert ((c - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("p_dtype, v_dtype, acc, v_major", [
    (torch.bfloat16, torch.bfloat16, "f32", "MN"), (torch.bfloat16, torch.bfloat16, "f32", "K"),
    (torch.float16, torch.float16, "f16", "MN"), (torch.float16, torch.float16, "f32", "K"),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, "f32", "K"), (torch.float8_e4m3fn, torch.float8_e5m2, "f16", "K"),
    (torch.float8_e5m2, torch.float8_e5m2, "f32", "K"),
])
def test_wgmma_register_a_p_v(hopper, p_dtype, v_dtype, acc, v_major):
    """O = round(scale * Q @ K^T) @ V with P fed to wgmma from registers matches torch: the register-A
    fragment layout, the accumulator-to-fragment packing and (fp8) register_a_k_order are right. Small integer
    inputs make S exact, so P's rounding is torch's and an f32 O is exact."""
    import nvfly
    from nvfly.examples.wgmma_register_a import p_v_tile
    depth = 128 // torch.empty(0, dtype=p_dtype).element_size()
    gen = torch.Generator().manual_seed(0)

    def ints(*shape):
        return torch.randint(-1, 2, shape, generator=gen).float()

    q, k, v = ints(64, depth), ints(depth, depth), ints(depth, 128)
    o = p_v_tile(q.to(p_dtype).cuda(), k.to(p_dtype).cuda(), v.to(v_dtype).cuda(), acc=getattr(nvfly, acc),
                 v_major=v_major, scale=0.5)
    p = (0.5 * (q @ k.t())).to(torch.float16 if acc == "f16" else torch.float32).to(p_dtype).float()
    ref = p @ v
    if acc == "f32":
        assert torch.equal(o.cpu(), ref)
    else:
        torch.testing.assert_close(o.cpu(), ref, rtol=2e-3, atol=0.5)


@nvfly.kernel
def tanh_approx_kernel(x: nvfly.Tensor, out: nvfly.Tensor, n: nvfly.i32):
    i = nvfly.block_idx.x * 256 + nvfly.thread_idx.x
    if i < n:
        out[i] = tanh_approx(x[i])


def test_tanh_approx_error_bound(hopper):
    """The MUFU tanh (attention's soft-cap) within its documented relative error 2^-10.987 of float64's tanh, on
    random values over the range soft-capping sees, tiny ones and the saturated tails; odd, tanh(0) = 0."""
    x = torch.cat([torch.randn(1 << 20, device="cuda") * 4, torch.randn(4096, device="cuda") * 1e-4,
                   torch.tensor([0.0, 1e-30, 9.0, -9.0, 30.0, -30.0, 1e4], device="cuda")])
    out = torch.full_like(x, float("nan"))
    tanh_approx_kernel[(x.numel() + 255) // 256, 256](x, out, x.numel())
    want = torch.tanh(x.double())
    rel = ((out.double() - want).abs() / want.abs().clamp_min(1e-38))[want != 0]
    assert rel.max().item() <= 2.0 ** -10.987, rel.max().item()
    assert out[-7].item() == 0.0 and out[-1].item() == 1.0
