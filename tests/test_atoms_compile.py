"""Each hardware atom compiles to the instruction it stands for, with no local-memory spills, and refuses a
compile target that lacks it."""
import re

import pytest
import torch

import nvfly
from nvfly.arch import sm90
from nvfly.arch.memory import L2Policy
from nvfly.arch.ptx import smem_address
from nvfly.examples.mma_sync_tile import mma_tile_kernel
from nvfly.examples.tma_copy import tma_copy_kernel
from nvfly.examples.wgmma_register_a import p_v_tile
from nvfly.examples.wgmma_tile_gemm import tile_gemm
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
    for hint in L2Policy:
        k = hinted_load_kernel.compile(desc, out, HINT=hint.value)
        assert ".L2::cache_hint" in k.ptx and str(hint.descriptor) in k.ptx and k.count("UTMALDG.2D") == 1
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


def gmma_count(k, opcode, a_from_registers):
    """How many ``opcode`` instructions of the SASS read A from registers (``R.., R.., gdesc``) or from shared
    memory (``R.., gdesc``)."""
    a_operand = r"R\d+, " if a_from_registers else ""
    return len(re.findall(rf"{re.escape(opcode)} R\d+, {a_operand}gdesc\[", k.sass()))


@pytest.mark.parametrize("p_dtype, v_dtype, acc, v_major, s_opcode, pv_opcode", [
    (torch.bfloat16, torch.bfloat16, nvfly.f32, "MN", "HGMMA.64x64x16.F32.BF16", "HGMMA.64x128x16.F32.BF16"),
    (torch.bfloat16, torch.bfloat16, nvfly.f32, "K", "HGMMA.64x64x16.F32.BF16", "HGMMA.64x128x16.F32.BF16"),
    (torch.float16, torch.float16, nvfly.f16, "MN", "HGMMA.64x64x16.F16", "HGMMA.64x128x16.F16"),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, nvfly.f32, "K", "QGMMA.64x128x32.F32.E4M3.E4M3",
     "QGMMA.64x128x32.F32.E4M3.E4M3"),
    (torch.float8_e4m3fn, torch.float8_e5m2, nvfly.f16, "K", "QGMMA.64x128x32.F16.E4M3.E4M3",
     "QGMMA.64x128x32.F16.E4M3.E5M2"),
])
def test_register_a_wgmma(p_dtype, v_dtype, acc, v_major, s_opcode, pv_opcode):
    """P @ V with P from registers is one HGMMA/QGMMA per k-step whose A operand is a register (B transposed
    for an MN-major V), after the shared-memory S = Q @ K^T; fp8 and f16 accumulation are atoms like bf16."""
    depth = 128 // torch.empty(0, dtype=p_dtype).element_size()
    q = torch.zeros(64, depth).to(p_dtype)
    (k,) = p_v_tile.compile(q, torch.zeros(depth, depth).to(p_dtype), torch.zeros(depth, 128).to(v_dtype), acc=acc,
                            v_major=v_major)
    assert gmma_count(k, s_opcode, a_from_registers=False) == 4
    assert gmma_count(k, pv_opcode, a_from_registers=True) == 4
    assert (".tnspB" in k.sass()) == (v_major == "MN")
    assert not k.warnings
    no_spills(k)


def test_register_a_fragment_layout():
    """The accumulator elements each A register packs sit, per the module doc's fragment maps, in the A
    fragment's row and at the column ``register_a_k_order`` names, for every lane."""
    for dtype in (nvfly.bf16, nvfly.f8e4m3):
        atom = sm90.WgmmaAtom(64, dtype, dtype, a_source="registers")
        order = sm90.register_a_k_order(atom)
        assert sorted(order) == list(range(atom.k))
        assert (order == tuple(range(atom.k))) == (dtype.bits == 16)
        per_register = 32 // dtype.bits
        for lane in range(32):
            for step in range(2):
                for r, elements in enumerate(sm90.a_fragment_elements(atom, step)):
                    assert len(elements) == per_register
                    for b, e in enumerate(elements):
                        j, h, low = e // 4, (e // 2) % 2, e % 2  # accumulator element 4j + 2h + low
                        acc_row, acc_col = lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + low
                        a_row = lane // 4 + 8 * (r % 2)
                        a_col = (8 * (r // 2) + 2 * (lane % 4) + b if dtype.bits == 16
                                 else 16 * (r // 2) + 4 * (lane % 4) + b)
                        assert acc_row == a_row and acc_col == step * atom.k + order[a_col]


def test_wgmma_atom_validation():
    with pytest.raises(nvfly.CompileError, match="a_major='K'"):
        sm90.WgmmaAtom(64, nvfly.bf16, nvfly.bf16, "MN", "K", a_source="registers")
    with pytest.raises(nvfly.CompileError, match="a_source"):
        sm90.WgmmaAtom(64, nvfly.bf16, nvfly.bf16, a_source="global")
    with pytest.raises(nvfly.CompileError, match="bf16 wgmma accumulates in f32 only"):
        sm90.WgmmaAtom(64, nvfly.bf16, nvfly.bf16, acc_dtype=nvfly.f16)
    with pytest.raises(nvfly.CompileError, match="f32 or f16"):
        sm90.WgmmaAtom(64, nvfly.f16, nvfly.f16, acc_dtype=nvfly.bf16)
    with pytest.raises(nvfly.CompileError, match="K-major"):
        sm90.WgmmaAtom(64, nvfly.f8e4m3, nvfly.f8e5m2, "K", "MN")
    with pytest.raises(nvfly.CompileError, match="cannot mix"):
        sm90.WgmmaAtom(64, nvfly.f8e4m3, nvfly.bf16)
    fp8 = sm90.WgmmaAtom(256, nvfly.f8e5m2, nvfly.f8e4m3, acc_dtype=nvfly.f16, a_source="registers")
    assert (fp8.k, fp8.acc_registers) == (32, 64)


@nvfly.kernel
def misused_register_a_kernel(out: nvfly.Tensor, A_SOURCE: nvfly.Constexpr):
    atom = sm90.WgmmaAtom(64, nvfly.bf16, nvfly.bf16, a_source=A_SOURCE)
    shared_atom = sm90.WgmmaAtom(64, nvfly.bf16, nvfly.bf16)
    desc = sm90.smem_descriptor(smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (8192,))), 16, 1024, 128)
    acc = sm90.Accumulator.zeros(shared_atom)
    a = desc if A_SOURCE == "registers" else acc.to_a_fragments(
        sm90.WgmmaAtom(64, nvfly.bf16, nvfly.bf16, a_source="registers"))[0]
    sm90.fence()
    acc = sm90.mma(atom, acc, a, desc)
    out[0] = acc[0]


def test_register_a_misuse_is_a_compile_error():
    with pytest.raises(nvfly.CompileError, match="takes an AFragment"):
        misused_register_a_kernel.compile(torch.zeros(4), A_SOURCE="registers")
    with pytest.raises(nvfly.CompileError, match="reads A from shared memory"):
        misused_register_a_kernel.compile(torch.zeros(4), A_SOURCE="shared")


def test_atoms_refuse_other_targets():
    """An sm_90a atom traced for another target is a CompileError naming the atom, its instruction, the need and
    the target, at the user's line; sm_90 atoms accept sm_90 and newer; sm_80 atoms reject older targets."""
    with pytest.raises(nvfly.CompileError, match=r"sm90\.fence \(wgmma\.fence\) needs target sm_90a; this kernel "
                                                 r"is compiled for sm_80") as err:
        fp8_wgmma_kernel.compile(torch.zeros(128), target="sm_80")
    assert err.value.filename == __file__
    assert "sm90.fence()" in open(__file__).read().splitlines()[err.value.lineno - 1]
    with pytest.raises(nvfly.CompileError, match=r"sm90\.fence .* needs target sm_90a; .* sm_100a"):
        fp8_wgmma_kernel.compile(torch.zeros(128), target="sm_100a")
    desc = nvfly.TmaDescriptor(TensorDesc(nvfly.bf16, (256, 256)), (64, 64))
    with pytest.raises(nvfly.CompileError, match=r"sm90\.fence_barrier_init \(fence\.mbarrier_init\) needs "
                                                 r"target sm_90 or newer; this kernel is compiled for sm_80"):
        hinted_load_kernel.compile(desc, torch.zeros(4, 4).to(torch.bfloat16), HINT=None, target="sm_80")
    assert hinted_load_kernel.compile(desc, torch.zeros(4, 4).to(torch.bfloat16), HINT=None,
                                      target="sm_90").count("UTMALDG.2D") == 1
    with pytest.raises(nvfly.CompileError, match=r"sm90\.setmaxnreg \(setmaxnreg\) needs target sm_90a; this kernel is "
                                                 r"compiled for sm_90\n"):
        setmaxnreg_kernel.compile(torch.zeros(4), target="sm_90")
    a = torch.randn(64, 64).to(torch.bfloat16)
    with pytest.raises(nvfly.CompileError, match=r"sm80\.cp_async \(cp\.async\) needs target sm_80 or newer"):
        mma_tile_kernel.compile(a, a[:32], torch.zeros(64, 32), 4, block=32, target="sm_75")
    with pytest.raises(nvfly.CompileError, match="not of the form"):
        fp8_wgmma_kernel.compile(torch.zeros(128), target="hopper")


@nvfly.kernel
def setmaxnreg_kernel(out: nvfly.Tensor):
    sm90.setmaxnreg(240, True)
    out[0] = 1.0


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
