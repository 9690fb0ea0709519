"""Hopper atoms on the GPU: a TMA tiled copy with a 128-byte swizzle (round trip, and the shared tile read
through nvfly's swizzled layout), and a single-CTA TMA + mbarrier + wgmma GEMM tile for several shapes."""
import pytest
import torch

from examples.tma_copy import tma_copy
from examples.wgmma_tile_gemm import tile_gemm

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
    from examples.mma_sync_tile import mma_tile_gemm
    m, n, k = mnk
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    bt = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    c = mma_tile_gemm(a, bt)
    ref = a.float() @ bt.float().t()
    assert ((c - ref).norm() / ref.norm()).item() < 1e-5
