"""The e4m3 conversion atoms of ``nvfly.arch.floats``: compiled for sm_90a to the hardware conversion (and refused for
targets without it); on a GPU, every one of the 256 e4m3 bytes converted by both atoms to f16 and bf16 equals
torch's conversion (NaN where torch has NaN), which also pins the byte order; permute_bytes (prmt) picks the bytes
its selector names."""
import pytest
import torch

import nvfly
from nvfly.arch.floats import convert_shared_e4m3x16, e4m3x4_to_16bit, permute_bytes
from nvfly.arch.ptx import smem_address


@nvfly.kernel
def e4m3_table_kernel(src: nvfly.Tensor, words: nvfly.Tensor, shared: nvfly.Tensor, DTYPE: nvfly.Constexpr):
    """src: the 256 e4m3 bytes as 64 i32 words; words[128] and shared[128]: i32 words of two DTYPE values each,
    from ``e4m3x4_to_16bit`` (thread t: word t) and from ``convert_shared_e4m3x16`` (thread t < 16: bytes
    16t..16t + 15, values 0-7 to the low 16 bytes and 8-15 to the high ones of its 32)."""
    tid = nvfly.thread_idx.x
    source = nvfly.shared_tensor(nvfly.i32, (64,), align=16)
    target = nvfly.shared_tensor(nvfly.i32, (128,), align=16)
    pair = e4m3x4_to_16bit(src[tid], DTYPE)
    words[2 * tid] = pair[0]
    words[2 * tid + 1] = pair[1]
    source[tid] = src[tid]
    nvfly.syncthreads()
    if tid < 16:
        convert_shared_e4m3x16(smem_address(source) + 16 * tid, smem_address(target) + 32 * tid,
                               smem_address(target) + 32 * tid + 16, DTYPE)
    nvfly.syncthreads()
    shared[tid] = target[tid]
    shared[tid + 64] = target[tid + 64]


def table_args(device="cpu"):
    src = torch.arange(256, dtype=torch.uint8, device=device).view(torch.int32)
    return src, torch.zeros(128, dtype=torch.int32, device=device), torch.zeros(128, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [nvfly.f16, nvfly.bf16])
def test_conversions_compile_to_the_hardware_cvt(dtype):
    kernel = e4m3_table_kernel.compile(*table_args(), DTYPE=dtype, block=64, target="sm_90a")
    assert kernel.count("F2FP.F16.E4M3.UNPACK_B") == 2 + 8  # two a word: one word, then the 16 bytes' four
    assert kernel.count("STS.128") == 2 and kernel.count("LDS.128") >= 1


def test_conversions_need_sm_89():
    with pytest.raises(nvfly.CompileError, match=r"floats\.e4m3x4_to_16bit \(cvt\.rn\.f16x2\.e4m3x2\) needs target "
                                                 r"sm_89 or newer; this kernel is compiled for sm_80"):
        e4m3_table_kernel.compile(*table_args(), DTYPE=nvfly.f16, block=64, target="sm_80")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_e4m3_value_converts_exactly(dtype):
    src, words, shared = table_args("cuda")
    e4m3_table_kernel[1, 64](src, words, shared, DTYPE=nvfly.f16 if dtype == torch.float16 else nvfly.bf16)
    torch.cuda.synchronize()
    want = torch.arange(256, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn).to(dtype)
    for got in (words, shared):
        torch.testing.assert_close(got.view(dtype), want, rtol=0, atol=0, equal_nan=True)


@nvfly.kernel
def permute_kernel(src: nvfly.Tensor, out: nvfly.Tensor, SELECTOR: nvfly.Constexpr):
    """out[t] = permute_bytes(src[2t], src[2t + 1], SELECTOR)."""
    tid = nvfly.thread_idx.x
    out[tid] = permute_bytes(src[2 * tid], src[2 * tid + 1], SELECTOR)


def permute_args(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (64 * 8,), dtype=torch.uint8, generator=gen).to(device).view(torch.int32)
    return src, torch.zeros(32, dtype=torch.int32, device=device)


def test_permute_bytes_compiles_to_prmt_and_checks_its_selector():
    kernel = permute_kernel.compile(*permute_args(), SELECTOR=0x6420, block=32, target="sm_90a")
    assert kernel.count("PRMT") >= 1
    with pytest.raises(nvfly.CompileError, match="permute_bytes: selector 0x8420 must pick bytes 0-7"):
        permute_kernel.compile(*permute_args(), SELECTOR=0x8420, block=32, target="sm_90a")


@pytest.mark.gpu
@pytest.mark.parametrize("selector", [0x6420, 0x7531, 0x3210, 0x0077])
def test_permute_bytes_picks_the_bytes(selector):
    src, out = permute_args("cuda")
    permute_kernel[1, 32](src, out, SELECTOR=selector)
    torch.cuda.synchronize()
    pairs = src.view(torch.uint8)[:256].view(32, 8)  # the 8 bytes of src[2t] (0-3) and src[2t + 1] (4-7)
    want = torch.stack([pairs[:, (selector >> 4 * i) & 7] for i in range(4)], dim=1)
    assert torch.equal(out.view(torch.uint8).view(32, 4), want)
