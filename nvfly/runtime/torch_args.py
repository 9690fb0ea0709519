"""Host arguments to kernel specs and ABI values: torch tensors, nvfly.TensorDesc, TMA descriptors, scalars.

torch is never imported here: a tensor is recognised by type once the user's process has imported torch.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from nvfly.errors import LaunchError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.spec import Param, TensorAnnotation, TensorSpec, TmaSpec, check_tensor_annotation, \
    scalar_spec_of
from nvfly.frontend.tensor import row_major_strides


@dataclass(frozen=True)
class TensorDesc:
    """A tensor described without memory, for compiling with no GPU: dtype, shape, strides (row-major by
    default) and the base address alignment in bytes."""
    dtype: DType
    shape: tuple[int, ...]
    stride: Optional[tuple[int, ...]] = None
    align: int = 16

    def strides(self) -> tuple[int, ...]:
        return tuple(self.stride) if self.stride is not None else tuple(row_major_strides(self.shape))  # type: ignore


def torch_tensor_type() -> Optional[type]:
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def is_tensor(value: Any) -> bool:
    tt = torch_tensor_type()
    return (tt is not None and isinstance(value, tt)) or isinstance(value, TensorDesc)


def _torch_dtype(t: Any) -> DType:
    name = str(t.dtype)
    return dtypes.from_torch_name(name[6:] if name.startswith("torch.") else name)


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
            dt = _torch_dtype(value)
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
    if param.kind == "tma" or _is_tma(value):
        if not _is_tma(value):
            raise LaunchError(f"argument '{param.name}': expected an nvfly.TmaDescriptor, got "
                              f"{type(value).__name__}")
        return TmaSpec(value.info), value.device
    if param.kind == "tensor":
        raise LaunchError(f"argument '{param.name}': expected a tensor, got {type(value).__name__}")
    return scalar_spec_of(param, value), -1


def _is_tma(value: Any) -> bool:
    from nvfly.runtime.tma import TmaDescriptor
    return isinstance(value, TmaDescriptor)


def abi_values(sources: Sequence[tuple], args: Sequence[Any]) -> list[Any]:
    """The raw parameter values in ABI order (device addresses, dynamic extents/strides, scalars, TMA bytes)."""
    out: list[Any] = []
    for index, field in sources:
        value = args[index]
        if field == "ptr":
            out.append(value.data_ptr())
        elif field == "value":
            out.append(value)
        elif field == "tma":
            out.append(value.raw)
        elif field[0] == "shape":
            out.append(value.shape[field[1]])
        else:
            out.append(value.stride(field[1]))
    return out


def current_stream(device: int) -> int:
    """torch's current stream on ``device`` (raw handle)."""
    import torch
    return torch._C._cuda_getCurrentRawStream(device)


def fast_key(kinds: Sequence[str], args: Sequence[Any]) -> tuple:
    """A cheap key from raw argument values; equal keys imply equal specs (the reverse need not hold)."""
    tt = torch_tensor_type()
    key: list[Any] = []
    for kind, a in zip(kinds, args):
        if tt is not None and isinstance(a, tt):
            key.append((a.dtype, a.shape, a.stride(), a.data_ptr() & 15, a.get_device()))
        elif kind == "constexpr" or isinstance(a, bool) or not isinstance(a, (int, float)):
            key.append((a.info, a.device) if _is_tma(a) else a)
        elif isinstance(a, int):
            key.append((int, a & 15, -(1 << 31) <= a < (1 << 31)))  # the low bits decide the power-of-two fact
        else:
            key.append(float)
    return tuple(key)
