"""On the GPU: argument errors in the caller's order with the op's name, the fakes' parity with the ops on CUDA
tensors (where the ops' checks are the only ones before nvfly runs), and one plan per signature."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nvfly.torch.ops  # noqa: F401  (defines torch.ops.nvfly)
from nvfly.ops import gemm, rmsnorm, topk
from nvfly.ops.gemm import api as gemm_api
from nvfly.ops.rmsnorm import api as rmsnorm_api
from nvfly.ops.topk import api as topk_api

pytestmark = pytest.mark.gpu


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda").to(dtype)


def _error(fn):
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    return info.type, str(info.value)


def test_gemm_errors_on_cuda_name_the_argument(hopper):
    a = _t(64, 64)
    assert _error(lambda: gemm.matmul(a, _t(32, 64))) == (
        ValueError, "nvfly.ops.gemm.matmul: b: shape (32, 64) and a's (64, 64) do not multiply (K is 64 in a, 32 in b)")
    assert _error(lambda: gemm.matmul(a, _t(64, 64).cpu())) == (ValueError, "nvfly.ops.gemm.matmul: b is on cpu, "
                                                                             "a on cuda:0")
    odd = _t(64, 1023)
    assert _error(lambda: gemm.path(odd, _t(1023, 64)))[1].startswith("nvfly.ops.gemm.path: a: stride 1023")
    assert gemm.path(a, _t(64, 64)).startswith(("wgmma", "skinny"))


@pytest.mark.parametrize("op,make,kwargs", [
    ("mm", lambda: (_t(64, 64), _t(32, 64)), {}),
    ("addmm", lambda: (_t(7), _t(64, 64), _t(64, 64)), {}),
    ("linear", lambda: (_t(4, 64), _t(32, 48)), {}),
    ("mm_out", lambda: (_t(64, 64), _t(64, 64), _t(64, 63)), {}),
    ("rms_norm", lambda: (_t(4, 64), [64], _t(32)), {}),
    ("rms_norm", lambda: (_t(4, 64), [64]), {"eps": -1.0}),
    ("topk", lambda: (_t(4, 64), 65), {}),
])
def test_fakes_raise_what_the_ops_raise_on_cuda(op, make, kwargs):
    args = make()
    with pytest.raises((TypeError, ValueError)) as real:
        getattr(torch.ops.nvfly, op)(*args, **kwargs)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises((TypeError, ValueError)) as fake:
            getattr(torch.ops.nvfly, op)(*fake_args, **kwargs)
    assert (real.type, str(real.value)) == (fake.type, str(fake.value))
    assert str(real.value).startswith(f"nvfly::{op}: ")


def test_one_plan_per_signature(hopper):
    for cache in (gemm_api._CALLS, rmsnorm_api._FORWARD, topk_api._TOPK):
        cache.clear()
    for _ in range(3):
        gemm.matmul(_t(256, 128), _t(128, 256))
        rmsnorm.rms_norm(_t(8, 4096), _t(4096))
        topk.topk(_t(8, 4096), 8)
    assert len(gemm_api._CALLS) == len(rmsnorm_api._FORWARD) == len(topk_api._TOPK) == 1
    torch.cuda.synchronize()
