"""Each hardware atom compiles to the instruction it stands for, with no local-memory spills."""
import pytest
import torch

import nvfly
from examples.mma_sync_tile import mma_tile_kernel
from examples.tma_copy import tma_copy_kernel
from examples.wgmma_tile_gemm import tile_gemm
from nvfly.arch import sm90
from nvfly.arch.ptx import smem_address
from nvfly.runtime.torch_args import TensorDesc


def no_spills(k):
    assert k.resources.spill_stores == 0 and k.resources.spill_loads == 0 and k.resources.stack_bytes == 0


def test_tma_load_and_store():
    x = TensorDesc(nvfly.bf16, (256, 256))
    desc = nvfly.TmaDescriptor(x, (64, 64))
    k = tma_copy_kernel.compile(desc, desc, torch.zeros(256, 256).to(torch.bfloat16), BOX_ROWS=64, BOX_COLS=64)
    assert k.count("UTMALDG.2D") == 1 and k.count("UTMASTG.2D") == 1
    assert k.count("SYNCS.ARRIVE.TRANS64") >= 1 and k.count("SYNCS.PHASECHK.TRANS64.TRYWAIT") >= 1
    no_spills(k)


@nvfly.kernel
def hinted_load_kernel(src: nvfly.TmaDescriptor, out: nvfly.Tensor, HINT: nvfly.Constexpr):
    tile = nvfly.dynamic_shared_tensor(nvfly.bf16, (64, 64), offset_bytes=1024)
    bar = smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (1,)))
    if nvfly.thread_idx.x == 0:
        sm90.mbarrier_init(bar, 1)
        sm90.fence_barrier_init()
        sm90.mbarrier_arrive_expect_tx(bar, 64 * 64 * 2)
        sm90.tma_load(src, smem_address(tile), (0, 0), bar, cache_hint=HINT)
    sm90.mbarrier_wait(bar, 0)


def test_tma_load_cache_hints():
    """A hinted TMA load carries .L2::cache_hint with the named 64-bit policy; an unknown hint is a CompileError
    naming the choices; TMA descriptors accept only the driver's L2 promotion sizes."""
    desc = nvfly.TmaDescriptor(TensorDesc(nvfly.bf16, (256, 256)), (64, 64))
    out = torch.zeros(4, 4).to(torch.bfloat16)
    for hint in sm90.CACHE_HINTS:
        k = hinted_load_kernel.compile(desc, out, HINT=hint)
        assert ".L2::cache_hint" in k.ptx and str(sm90.CACHE_HINTS[hint]) in k.ptx and k.count("UTMALDG.2D") == 1
        no_spills(k)
    assert ".L2::cache_hint" not in hinted_load_kernel.compile(desc, out, HINT=None).ptx
    with pytest.raises(nvfly.CompileError, match="evict_first"):
        hinted_load_kernel.compile(desc, out, HINT="keep")
    with pytest.raises(ValueError, match="l2_promotion=100"):
        nvfly.TmaDescriptor(TensorDesc(nvfly.bf16, (256, 256)), (64, 64), l2_promotion=100)


def test_wgmma_bf16_tiles_for_both_b_majors():
    a = torch.randn(256, 512).to(torch.bfloat16)
    b = torch.randn(512, 256).to(torch.bfloat16)
    for bb in (b, b.t().contiguous().t()):
        for bn in (64, 128, 256):
            (k,) = tile_gemm.compile(a, bb, BN=bn)
            assert k.count(f"HGMMA.64x{bn}x16.F32.BF16") >= 4
            assert not k.warnings
            no_spills(k)


@nvfly.kernel
def fp8_wgmma_kernel(out: nvfly.Tensor):
    atom = sm90.WgmmaAtom(128, nvfly.f8e4m3, nvfly.f8e4m3, "K", "K")
    smem = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (32768,)))
    layout = sm90.operand_layout(64, 128, nvfly.f8e4m3, "K", 128)
    lbo, sbo = sm90.descriptor_offsets(layout, nvfly.f8e4m3, "K", 128)
    acc = sm90.Accumulator.undefined(atom)
    sm90.fence()
    for ks in nvfly.static_range(4):
        off = layout.inner((0, ks * atom.k))
        acc = sm90.mma(atom, acc, sm90.smem_descriptor(smem + off, lbo, sbo, 128),
                       sm90.smem_descriptor(smem + 16384 + off, lbo, sbo, 128), zero=ks == 0)
    sm90.commit_group()
    sm90.wait_group(0)
    out[nvfly.thread_idx.x] = acc[0]


def test_fp8_wgmma_is_qgmma():
    k = fp8_wgmma_kernel.compile(torch.zeros(128))
    assert k.count("QGMMA.64x128x32.F32.E4M3.E4M3") == 4
    no_spills(k)


@nvfly.kernel
def stmatrix_kernel(x: nvfly.Tensor):
    buf = nvfly.shared_tensor(nvfly.bf16, (16, 16), align=128)
    lane = nvfly.lane_idx()
    regs = [x[lane * 4 + i] for i in nvfly.static_range(4)]
    sm90.stmatrix_x4(smem_address(buf.address(lane % 16, 8 * (lane // 16))), regs)
    sm90.fence_proxy_async()
    nvfly.syncwarp()
    x[lane] = buf[lane % 16, lane // 16].to(nvfly.i32)


def test_stmatrix_fences_elect_setmaxnreg_clusters():
    k = stmatrix_kernel.compile(torch.zeros(128, dtype=torch.int32), block=32)
    assert k.count("STSM.16.M88.4") == 1 and k.count("FENCE.VIEW.ASYNC.S") == 1
    from nvfly.ops import gemm
    from nvfly.ops.gemm import GemmConfig
    (g,) = gemm.api.compile_configs([GemmConfig(128, 256, 4, 2, cluster_m=2)])
    assert g.count("USETMAXREG") == 2 and g.count("UTMALDG.2D.MULTICAST") > 0
    assert g.count("UCGABAR_ARV") >= 1 and g.count("UCGABAR_WAIT") >= 1 and g.count("ELECT") >= 1


def test_sm80_cp_async_ldmatrix_mma_sync():
    a = torch.randn(64, 64).to(torch.bfloat16)
    bt = torch.randn(32, 64).to(torch.bfloat16)
    for target in ("sm_80", "sm_90a"):
        k = mma_tile_kernel.compile(a, bt, torch.zeros(64, 32), 4, block=32, target=target)
        assert k.count("LDGSTS.E.BYPASS.128") >= 2 and k.count("LDSM.16.M88.4") >= 2
        assert k.count("HMMA.16816.F32.BF16") >= 1
        no_spills(k)
