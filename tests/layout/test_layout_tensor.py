"""Layout tensors over kernel tensors (``nvfly.layout.tensor``)."""
from __future__ import annotations

import torch

import nvfly
from nvfly.layout.tensor import make_tensor


@nvfly.kernel
def copy_kernel(x: nvfly.Tensor, out: nvfly.Tensor, VIEW: nvfly.Constexpr):
    src = make_tensor(x) if VIEW else x
    i = nvfly.thread_idx.x
    out[i] = src[i // 16, i % 16]


def test_make_tensor_defaults_to_the_tensors_own_layout() -> None:
    """Through its own layout (shape and strides, ``layout_of``) a tensor is addressed exactly as directly."""
    x = torch.zeros(8, 16)
    for t in (x, x.t().contiguous().t()):
        direct = copy_kernel.compile(t, torch.zeros(128), VIEW=False)
        viewed = copy_kernel.compile(t, torch.zeros(128), VIEW=True)
        assert viewed.ptx == direct.ptx
