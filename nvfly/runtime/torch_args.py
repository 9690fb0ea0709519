"""Host arguments to kernel specs and ABI values: torch tensors, nvfly.TensorDesc, TMA descriptors, scalars.

torch is never imported here: a tensor is recognised by type once the user's process has imported torch.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from nvfly.errors import LaunchError
from nvfly.frontend.spec import Param, TensorAnnotation, TensorSpec, TmaSpec, check_tensor_annotation, \
    scalar_spec_of
from nvfly.runtime.tensor_desc import TensorDesc, is_tensor, torch_dtype, torch_tensor_type
from nvfly.runtime.tma import TmaDescriptor


def tensor_spec(param: Param, value: Any, need_cuda: bool) -> tuple[TensorSpec, int]:
    """The spec of a tensor argument and its device index (-1 when not on a GPU). Validates it."""
    ann = param.annotation if isinstance(param.annotation, TensorAnnotation) else None
    if isinstance(value, TensorDesc):
        if need_cuda:
            raise LaunchError(f"argument '{param.name}': a TensorDesc can be compiled but not launched")
        spec = TensorSpec.of(value.dtype, value.shape, value.strides(), value.align, ann)
        device = -1
    else:
        tt = torch_tensor_type()
        if tt is None or not isinstance(value, tt):
            raise LaunchError(f"argument '{param.name}': expected a tensor, got {type(value).__name__}")
        try:
            dt = torch_dtype(value)
        except TypeError as exc:
            raise LaunchError(f"argument '{param.name}': {exc}") from None
        device = value.get_device()
        if need_cuda and device < 0:
            raise LaunchError(f"argument '{param.name}': expected a CUDA tensor, got one on {value.device}")
        address = value.data_ptr() if value.device.type != "meta" else 0
        spec = TensorSpec.of(dt, tuple(value.shape), tuple(value.stride()), address, ann)
    check_tensor_annotation(param, spec)
    return spec, device


def arg_spec(param: Param, value: Any, need_cuda: bool) -> tuple[Any, int]:
    """(spec, device index or -1) of one argument."""
    if param.kind == "tensor" or (param.kind == "auto" and is_tensor(value)):
        return tensor_spec(param, value, need_cuda)
    if param.kind == "tma" or isinstance(value, TmaDescriptor):
        if not isinstance(value, TmaDescriptor):
            raise LaunchError(f"argument '{param.name}': expected an nvfly.TmaDescriptor, got "
                              f"{type(value).__name__}")
        return TmaSpec(value.info), value.device
    if param.kind == "tensor":
        raise LaunchError(f"argument '{param.name}': expected a tensor, got {type(value).__name__}")
    return scalar_spec_of(param, value), -1


def auto_key(value: Any) -> tuple[Any, Any]:
    """(key part, raw value) of an argument to an unannotated parameter (see launcher.make_binder)."""
    tt = torch_tensor_type()
    if tt is not None and isinstance(value, tt):
        p, s, t = value.data_ptr(), value.shape, value.stride()
        return (value.dtype, s, t, p & 15, value.get_device()), (p, s, t)
    if isinstance(value, TmaDescriptor):
        return (value.info, value.device), value.raw
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value, value
    if isinstance(value, int):
        return (value & 15, -(1 << 31) <= value < (1 << 31)), value
    return float, value


def layout_key(t: Any) -> Optional[tuple]:
    """What of a torch tensor (or None) decides an op's launch plan: shape, strides, dtype, device and the base
    address modulo 16 (vector widths, TMA), not its contents or address; a cache key part."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def vector_width(n: int, tensors: Sequence[Any], itemsize: int) -> int:
    """The widest vector (16 bytes of ``itemsize`` elements at most) that divides the row length ``n`` and keeps
    every row start of every tensor (None: a new contiguous one) aligned: its address and each stride of a leading
    dimension with more than one index. Rows are the last dimension, taken as contiguous."""
    vec = 16 // itemsize
    while vec > 1:
        if n % vec == 0 and all(t is None or _rows_aligned(t, vec) for t in tensors):
            return vec
        vec //= 2
    return 1


def _rows_aligned(t: Any, vec: int) -> bool:
    """Whether every row of ``t`` starts on a ``vec``-element boundary (16 bytes at most)."""
    return t.data_ptr() % min(16, vec * t.element_size()) == 0 and \
        all(stride % vec == 0 for extent, stride in zip(t.shape[:-1], t.stride()[:-1]) if extent > 1)


def current_stream(device: int) -> int:
    """torch's current stream on ``device`` (raw handle)."""
    import torch
    return torch._C._cuda_getCurrentRawStream(device)


def stream_int(stream: Any) -> int:
    """A raw stream handle from a torch.cuda.Stream, a cuda.bindings CUstream or an int."""
    handle = getattr(stream, "cuda_stream", stream)
    return int(handle)
