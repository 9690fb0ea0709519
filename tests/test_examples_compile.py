"""Every example compiles without a GPU, and its SASS has the instructions the design relies on."""
import pytest
import torch

import nvfly
from nvfly.examples.softmax import softmax
from nvfly.examples.tiled_transpose import transpose
from nvfly.examples.vector_add import add, add_kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_vector_add_vectorizes_to_16_byte_accesses(dtype):
    x = torch.randn(4096).to(dtype)
    (k,) = add.compile(x, x)
    assert k.name == "add_vec_kernel"
    assert k.cubin is not None and k.ptx.startswith("//")
    assert ".target sm_90a" in k.ptx
    assert k.count("LDG.E.128") == 2 and k.count("STG.E.128") == 1
    assert k.resources.spill_stores == 0 and k.resources.stack_bytes == 0


def test_vector_add_unaligned_length_uses_the_scalar_kernel():
    x = torch.randn(1001)
    (k,) = add.compile(x, x)
    assert k.name == "add_kernel"
    assert k.sass_opcodes()["LDG.E"] == 2 and k.count("LDG.E.128") == 0


def test_misaligned_tensor_gets_a_narrower_access():
    # a view that starts one element in: the base address is only 2-byte aligned
    base = torch.randn(4097).to(torch.bfloat16)
    x = base[1:]
    k = nvfly.compile(nvfly.Kernel(_vec_load_fn), x, x, 4096, VEC=8)
    assert k.count("LDG.E.128") == 0
    aligned = nvfly.compile(nvfly.Kernel(_vec_load_fn), base[:4096], base[:4096], 4096, VEC=8)
    assert aligned.count("LDG.E.128") == 1


def _vec_load_fn(x: nvfly.Tensor, out: nvfly.Tensor, n: nvfly.i32, VEC: nvfly.Constexpr):
    i = nvfly.thread_idx.x * VEC
    if i < n:
        out.store(x.load(i, width=VEC), i)


def test_softmax_uses_warp_shuffles_and_mufu():
    x = torch.randn(8, 4096).to(torch.bfloat16)
    (k,) = softmax.compile(x)
    assert k.count("SHFL.BFLY") >= 10
    assert k.count("MUFU.EX2") > 0
    assert k.count("LDG.E.128") >= 2
    assert k.resources.static_smem_bytes == 2 * 8 * 4
    assert k.resources.spill_stores == 0


def test_transpose_goes_through_shared_memory():
    x = torch.randn(100, 70)
    (k,) = transpose.compile(x)
    assert k.count("STS") >= 4 and k.count("LDS") >= 4
    assert k.count("BAR.SYNC") >= 1 or k.count("BAR") >= 1
    assert k.resources.static_smem_bytes == 32 * 33 * 4
    assert k.block == (32, 8, 1)


def test_sm80_target_compiles():
    x = torch.randn(4096).to(torch.float16)
    k = nvfly.compile(add_kernel, x, x, x, 4096, BLOCK=128, target="sm_80")
    assert ".target sm_80" in k.ptx
    assert k.cubin is not None


def test_compile_reports_resources_and_ptx():
    x = torch.randn(256)
    k = nvfly.compile(add_kernel, x, x, x, 256, BLOCK=128)
    summary = k.summary()
    assert summary["registers"] > 0 and summary["threads"] == 128
    assert "gpu.func @add_kernel" in k.mlir
    assert "llvm.func @add_kernel" in k.llvm_mlir
    assert ".maxntid 128, 1, 1" in k.ptx
