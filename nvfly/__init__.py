"""nvfly: GPU kernels in Python, traced into upstream MLIR, compiled to PTX/cubin, launched on torch tensors.

    @nvfly.kernel
    def add(x: nvfly.Tensor, y: nvfly.Tensor, out: nvfly.Tensor, n: nvfly.i32, BLOCK: nvfly.Constexpr):
        i = nvfly.block_idx.x * BLOCK + nvfly.thread_idx.x
        if i < n:
            out[i] = x[i] + y[i]

    add[(n + 255) // 256, 256](x, y, out, n, BLOCK=256)
"""
from nvfly.errors import CompileError, CudaError, LaunchError, NvflyError, ToolchainError
from nvfly.frontend.dtypes import DType, bf16, f8e4m3, f8e5m2, f16, f32, f64, i1, i8, i16, i32, i64, u8, u32
from nvfly.frontend.function import DeviceFunction
from nvfly.frontend.language import (
    assume_divisible, atomic_add, block_dim, block_idx, block_idx_in_cluster, block_rank_in_cluster, cluster_dim,
    cluster_idx, cooperative, cos, count_leading_zeros, dynamic_shared_tensor, erf, exp, exp2, fma, grid_dim,
    lane_idx, launch_dependents, linear_thread_idx, log, log2, maximum, min_blocks_per_sm, minimum, named_barrier,
    named_barrier_arrive, no_unroll, printf, redux_sync, rsqrt, select, shared_tensor, shfl_down, shfl_idx, shfl_up,
    shfl_xor, sin, sqrt, static_range, syncthreads, syncthreads_or, syncwarp, tanh, thread_idx, threadfence, vote_any,
    wait_prior_grid, warp_idx, warp_reduce,
)
from nvfly.frontend.spec import Constexpr, TensorAnnotation
from nvfly.frontend.spec import TensorType as Tensor
from nvfly.frontend.values import Scalar, Vector, full, make_vector
from nvfly.jit import JitFunction, Kernel, PreparedLaunch, compile, compile_only
from nvfly.runtime.tma import TmaDescriptor
from nvfly.runtime.tensor_desc import TensorDesc
from nvfly.version import __version__


def kernel(fn=None, *, name=None):
    """Decorator: a GPU kernel. Launch with ``k[grid, block](*args)``; compile with ``nvfly.compile(k, ...)``."""
    if fn is None:
        return lambda f: Kernel(f, name=name)
    return Kernel(fn, name=name)


def jit(fn):
    """Decorator: a host function that launches kernels; ``f.compile(*args)`` compiles them without a GPU."""
    return JitFunction(fn)


def func(fn):
    """Decorator: a device helper called from kernels (inlined; its control flow may depend on traced values)."""
    return DeviceFunction(fn)


def gpu_available() -> bool:
    """Whether a CUDA device can run nvfly kernels in this process."""
    from nvfly.runtime.driver import unavailable_reason
    return unavailable_reason() is None
