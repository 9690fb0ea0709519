"""Host tensors as kernels see them: ``nvfly.TensorDesc`` (a tensor with no memory, for compiling without a
GPU) and the recognition of torch tensors and their dtypes.

torch is never imported here: a tensor is recognised by type once the user's process has imported torch.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
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


def torch_dtype(t: Any) -> DType:
    """The nvfly dtype of a torch tensor."""
    name = str(t.dtype)
    return dtypes.from_torch_name(name[6:] if name.startswith("torch.") else name)
