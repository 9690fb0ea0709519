"""Host-side TMA descriptors: ``cuTensorMapEncodeTiled`` into a 128-byte, 64-byte aligned buffer, passed to
kernels by value (a ``__grid_constant__`` parameter)."""
from __future__ import annotations

import collections
import ctypes
from typing import Any, Optional, Sequence

from nvfly.errors import LaunchError
from nvfly.frontend.dtypes import DType
from nvfly.frontend.tma_types import SWIZZLE_BYTES, TmaDescriptorType, TmaInfo
from nvfly.runtime import driver
from nvfly.runtime.tensor_desc import TensorDesc, torch_dtype

_DATA_TYPE = {"f16": "FLOAT16", "bf16": "BFLOAT16", "f32": "FLOAT32", "f64": "FLOAT64", "i32": "INT32",
              "i64": "INT64", "u8": "UINT8", "i8": "UINT8", "f8e4m3": "UINT8", "f8e5m2": "UINT8",
              "i16": "UINT16", "u32": "UINT32"}
_SWIZZLE = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}


def check_tma_layout(what: str, dtype: DType, shape: Sequence[int], stride: Sequence[int], address: int,
                     box: Sequence[int], swizzle: int) -> None:
    """Raise LaunchError when TMA cannot describe this tensor/box (the hardware's rules, in user terms)."""
    rank = len(shape)
    if not 1 <= rank <= 5:
        raise LaunchError(f"{what}: TMA handles rank 1 to 5 tensors, got rank {rank}")
    if len(box) != rank:
        raise LaunchError(f"{what}: the box {tuple(box)} must have one extent per dimension ({rank})")
    if dtype.name not in _DATA_TYPE:
        raise LaunchError(f"{what}: TMA cannot copy {dtype.name} elements")
    if stride[-1] != 1:
        raise LaunchError(f"{what}: TMA needs the last dimension contiguous (stride 1), got strides {tuple(stride)}")
    if address % 16:
        raise LaunchError(f"{what}: TMA needs a 16-byte aligned base address, got {address:#x}")
    for d in range(rank - 1):
        if (stride[d] * dtype.itemsize) % 16:
            raise LaunchError(f"{what}: TMA needs every stride but the last to be a multiple of 16 bytes; "
                              f"dimension {d} has {stride[d] * dtype.itemsize} bytes")
    for d, b in enumerate(box):
        if not 1 <= b <= 256:
            raise LaunchError(f"{what}: box extents must be 1..256, got {b} in dimension {d}")
    inner_bytes = box[-1] * dtype.itemsize
    if inner_bytes % 16:
        raise LaunchError(f"{what}: the box's last extent must span a multiple of 16 bytes, got {inner_bytes}")
    if swizzle not in SWIZZLE_BYTES:
        raise LaunchError(f"{what}: swizzle must be one of {SWIZZLE_BYTES} bytes, got {swizzle}")
    if swizzle and inner_bytes > swizzle:
        raise LaunchError(f"{what}: with a {swizzle}-byte swizzle the box's last extent may span at most "
                          f"{swizzle} bytes, got {inner_bytes}")


L2_PROMOTIONS = (0, 64, 128, 256)  # bytes an L2 miss of a TMA load fetches at least (0: no promotion)


class TmaDescriptor(TmaDescriptorType):
    """A TMA descriptor for a tensor and a box (in the tensor's dimension order, outermost first).

    Out-of-bounds elements of a box read as zero, and are not written by TMA stores. The descriptor holds
    the tensor's address, not the tensor: keep the tensor alive until kernels using it have been queued.
    """

    def __init__(self, tensor: Any, box: Sequence[int], swizzle: int = 128, l2_promotion: int = 128):
        box = tuple(int(b) for b in box)
        if l2_promotion not in L2_PROMOTIONS:
            raise ValueError(f"l2_promotion={l2_promotion!r}: expected one of {L2_PROMOTIONS} (bytes; 0: none)")
        if isinstance(tensor, TensorDesc):
            dtype, shape, stride, address, device = tensor.dtype, tensor.shape, tensor.strides(), 0, -1
        else:
            dtype = torch_dtype(tensor)
            shape, stride = tuple(tensor.shape), tuple(tensor.stride())
            address, device = tensor.data_ptr(), tensor.get_device()
        stride = _canonical_strides(shape, stride, dtype.itemsize)
        check_tma_layout("TMA descriptor", dtype, shape, stride, address, box, swizzle)
        self.info = TmaInfo(dtype, len(shape), box, swizzle)
        self.device = device
        self.raw: Optional[bytes] = None
        if device >= 0:
            # the driver encodes in the current context: threads of Inductor's compile pool or of autograd
            # may have none yet
            driver.make_current(device)
            self.raw = _encode(dtype, shape, stride, address, box, swizzle, l2_promotion)

    def __repr__(self) -> str:
        return f"nvfly.TmaDescriptor({self.info.dtype.name}, box={self.info.box}, swizzle={self.info.swizzle})"


def _canonical_strides(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Strides with those of extent-1 dimensions (never used to address) replaced by valid TMA strides."""
    out = list(stride)
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] == 1:
            if d == len(shape) - 1:
                out[d] = 1
            else:
                span = out[d + 1] * shape[d + 1] * itemsize
                out[d] = max(16, -(-span // 16) * 16) // itemsize
    return tuple(out)


_CACHE: "collections.OrderedDict[tuple, TmaDescriptor]" = collections.OrderedDict()
_CACHE_LIMIT = 1024


def cached_descriptor(tensor: Any, box: Sequence[int], swizzle: int = 128) -> TmaDescriptor:
    """``TmaDescriptor(tensor, box, swizzle)``, reused while address, shape, strides and dtype match.

    A descriptor depends only on those (not on the tensor object), so a reused address is harmless.
    """
    key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.get_device(),
           tuple(box), swizzle)
    desc = _CACHE.get(key)
    if desc is None:
        desc = TmaDescriptor(tensor, box, swizzle)
        _CACHE[key] = desc
        if len(_CACHE) > _CACHE_LIMIT:
            _CACHE.popitem(last=False)
    return desc


def _encode(dtype: DType, shape: Sequence[int], stride: Sequence[int], address: int, box: Sequence[int],
            swizzle: int, l2_promotion: int) -> bytes:
    cu = driver._cu()
    rank = len(shape)
    data_type = getattr(cu.CUtensorMapDataType, "CU_TENSOR_MAP_DATA_TYPE_" + _DATA_TYPE[dtype.name])
    global_dim = [cu.cuuint64_t(int(s)) for s in reversed(shape)]
    global_strides = [cu.cuuint64_t(int(s) * dtype.itemsize) for s in reversed(stride[:-1])]
    box_dim = [cu.cuuint32_t(b) for b in reversed(box)]
    element_strides = [cu.cuuint32_t(1)] * rank
    tmap = driver.check(cu.cuTensorMapEncodeTiled(
        data_type, rank, address, global_dim, global_strides, box_dim, element_strides,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(cu.CUtensorMapSwizzle, "CU_TENSOR_MAP_SWIZZLE_" + _SWIZZLE[swizzle]),
        getattr(cu.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_L2_{l2_promotion}B"
                if l2_promotion else "CU_TENSOR_MAP_L2_PROMOTION_NONE"),
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return ctypes.string_at(int(tmap.getPtr()), 128)

