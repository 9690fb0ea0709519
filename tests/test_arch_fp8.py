"""The e4m3 conversion atoms of ``nvfly.arch.floats``: compiled for sm_90a to the hardware conversion (and refused for
targets without it); on a GPU, every one of the 256 e4m3 bytes converted by both atoms to f16 and bf16 equals
torch's conversion (NaN where torch has NaN), which also pins the byte order."""
import pytest
import torch

import nvfly
from nvfly.arch.floats import convert_shared_e4m3x16, e4m3x4_to_16bit
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
