"""The CUDA driver through ``cuda.bindings.driver``: init, torch's primary context, modules, launches."""
from __future__ import annotations

import functools
import threading
from typing import Any, Optional

from nvfly.errors import CudaError

_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _cu() -> Any:
    from cuda.bindings import driver
    return driver


def check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings result tuple; raise CudaError on a failing status."""
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    code = int(status)
    if code != 0:
        cu = _cu()
        try:
            name = cu.CUresult(code).name
        except ValueError:
            name = "CUDA_ERROR"
        raise CudaError(what, code, name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@functools.lru_cache(maxsize=None)
def _init() -> Optional[str]:
    """Initialise the driver once; returns why it is unusable, or None."""
    try:
        check(_cu().cuInit(0), "cuInit")
    except CudaError as exc:
        return str(exc)
    except Exception as exc:  # no driver library on this machine
        return f"{type(exc).__name__}: {exc}"
    return None


def unavailable_reason() -> Optional[str]:
    """None when a CUDA device can be used, else why not."""
    why = _init()
    if why:
        return why
    if device_count() == 0:
        return "no CUDA device"
    return None


def device_count() -> int:
    if _init():
        return 0
    return int(check(_cu().cuDeviceGetCount(), "cuDeviceGetCount"))


def _require_driver() -> None:
    why = _init()
    if why:
        raise CudaError(f"CUDA driver unusable ({why})", 100, "CUDA_ERROR_NO_DEVICE")


@functools.lru_cache(maxsize=None)
def compute_capability(device: int) -> tuple[int, int]:
    _require_driver()
    cu = _cu()
    a = cu.CUdevice_attribute
    major = check(cu.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "attribute")
    minor = check(cu.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "attribute")
    return int(major), int(minor)


def target_of(device: int) -> str:
    """The compile target for a device: sm_90a on Hopper (wgmma, setmaxnreg need the ``a`` variant)."""
    major, minor = compute_capability(device)
    return f"sm_{major}{minor}a" if major == 9 else f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def device_attribute(device: int, name: str) -> int:
    _require_driver()
    cu = _cu()
    return int(check(cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, name), device), name))


def sm_count(device: int) -> int:
    """Streaming multiprocessors of ``device`` (what persistent grids are sized by)."""
    return device_attribute(device, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")


def plan_l2_bytes(device: int) -> int:
    """The L2 size launch plans are made for: ``device``'s, or an H100/H200's 50 MiB for a CPU tensor."""
    return device_attribute(device, "CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE") if device >= 0 else 50 << 20


def plan_sm_count(device: int) -> int:
    """The SM count launch plans are made for: ``device``'s, or an H100/H200's 132 for a CPU tensor (device -1:
    compiling without a GPU)."""
    return sm_count(device) if device >= 0 else 132


@functools.lru_cache(maxsize=None)
def primary_context(device: int) -> Any:
    """The device's primary context (the one torch's runtime uses), retained for the process's life."""
    return check(_cu().cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")


def make_current(device: int) -> None:
    """Make the primary context of ``device`` current on this thread if it is not."""
    cu = _cu()
    ctx = primary_context(device)
    cur = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if cur is None or int(cur) != int(ctx):
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


# shared memory a CTA may use (static and dynamic together) without the opt-in attribute
DEFAULT_SMEM_BYTES = 48 * 1024


def smem_opt_in(static: int, dynamic: int) -> bool:
    """Whether a launch with ``static`` + ``dynamic`` bytes of shared memory needs the opt-in attribute (set by
    LoadedFunction, to the dynamic size, up to the device's opt-in maximum)."""
    return static + dynamic > DEFAULT_SMEM_BYTES


class LoadedFunction:
    """A kernel function loaded into one device's primary context."""

    __slots__ = ("module", "function", "device")

    def __init__(self, image: bytes, name: str, device: int, dynamic_smem_bytes: int):
        cu = _cu()
        with _lock:
            make_current(device)
            self.module = check(cu.cuModuleLoadData(image), f"cuModuleLoadData({name})")
            self.function = check(cu.cuModuleGetFunction(self.module, name.encode()), f"cuModuleGetFunction({name})")
        self.device = device
        static = check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                             self.function), "cuFuncGetAttribute")
        if smem_opt_in(static, dynamic_smem_bytes):
            limit = device_attribute(device, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
            if static + dynamic_smem_bytes > limit:
                raise CudaError(f"{name} needs {static} + {dynamic_smem_bytes} bytes of static and dynamic shared "
                                f"memory; the device allows {limit}", 1, "CUDA_ERROR_INVALID_VALUE")
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(self.function, attr, dynamic_smem_bytes), "cuFuncSetAttribute")


def stream_handle(handle: int) -> Any:
    return _cu().CUstream(handle)


def launch(fn: LoadedFunction, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
           stream: Any, params_address: int) -> None:
    status = _cu().cuLaunchKernel(fn.function, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem,
                                  stream, params_address, 0)
    if int(status[0] if isinstance(status, tuple) else status) != 0:
        check(status, "cuLaunchKernel")


def launch_with(fn: LoadedFunction, config: Any, params_address: int) -> None:
    """cuLaunchKernelEx of ``fn`` with a ``launch_config``."""
    check(_cu().cuLaunchKernelEx(config, fn.function, params_address, 0), "cuLaunchKernelEx")


def launch_config(grid: tuple[int, int, int], block: tuple[int, int, int], cluster: Optional[tuple[int, int, int]],
                  cooperative: bool, dependent: bool, smem: int, stream: Any) -> Any:
    """cuLaunchKernelEx's CUlaunchConfig: a cluster shape, a cooperative launch (every block resident at once)
    and/or a programmatic dependent launch (``dependent``: it may start while the stream's previous kernel runs,
    and waits for it at ``griddepcontrol.wait``). Building one costs the host tens of microseconds in cuda-python,
    more than the launch: ``Launcher`` keeps one a (grid, stream)."""
    cu = _cu()
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    config.hStream = stream
    attrs = []
    if cluster is not None:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
        attrs.append(attr)
    if cooperative:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attr.value.cooperative = 1
        attrs.append(attr)
    if dependent:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    config.attrs = attrs
    config.numAttrs = len(attrs)
    return config
