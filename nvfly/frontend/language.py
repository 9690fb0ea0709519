"""Device intrinsics available inside kernels: ids, warps (shuffles, votes, reductions), barriers, atomics, shared
memory, math, kernel attributes, printf."""
from __future__ import annotations

import math as _pymath
from typing import Any, Callable, Sequence, Union

from mlir import ir
from mlir.dialects import arith, gpu, llvm, math as mmath, nvvm

from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.tensor import IntLike, Tensor, row_major_strides
from nvfly.frontend.trace import current, traced
from nvfly.frontend.values import Scalar, Vector, _Traced, as_value, condition, constant, make_vector

Value = Union[Scalar, Vector]


# ---------------------------------------------------------------------------------------------- ids
def _sreg(reader: Callable[..., ir.Value], bound: int | None = None) -> Scalar:
    kwargs = {}
    if bound is not None:
        kwargs["range"] = ir.Attribute.parse(f"#llvm.constant_range<i32, 0, {bound}>")
    return Scalar(reader(ir.IntegerType.get_signless(32), **kwargs), dtypes.i32)


class _Dim3:
    """``.x``/``.y``/``.z`` of a special register triple (thread_idx, block_idx, ...)."""

    def __init__(self, what: str, readers: tuple[Callable, Callable, Callable], bounded_by_block: bool = False,
                 static_block: bool = False):
        self._what = what
        self._readers = readers
        self._bounded = bounded_by_block
        self._static_block = static_block

    def _get(self, axis: int) -> Union[Scalar, int]:
        builder = current()
        if self._static_block:
            return builder.block[axis]
        with builder.user_location():
            bound = builder.block[axis] if self._bounded else None
            if bound == 1 and self._bounded:
                return 0
            return _sreg(self._readers[axis], bound)

    @property
    def x(self) -> Any:
        return self._get(0)

    @property
    def y(self) -> Any:
        return self._get(1)

    @property
    def z(self) -> Any:
        return self._get(2)

    def __repr__(self) -> str:
        return f"nvfly.{self._what}"


thread_idx = _Dim3("thread_idx", (nvvm.read_ptx_sreg_tid_x, nvvm.read_ptx_sreg_tid_y, nvvm.read_ptx_sreg_tid_z),
                   bounded_by_block=True)
block_idx = _Dim3("block_idx", (nvvm.read_ptx_sreg_ctaid_x, nvvm.read_ptx_sreg_ctaid_y, nvvm.read_ptx_sreg_ctaid_z))
grid_dim = _Dim3("grid_dim", (nvvm.read_ptx_sreg_nctaid_x, nvvm.read_ptx_sreg_nctaid_y, nvvm.read_ptx_sreg_nctaid_z))
block_dim = _Dim3("block_dim", (nvvm.read_ptx_sreg_ntid_x, nvvm.read_ptx_sreg_ntid_y, nvvm.read_ptx_sreg_ntid_z),
                  static_block=True)
cluster_idx = _Dim3("cluster_idx", (nvvm.read_ptx_sreg_clusterid_x, nvvm.read_ptx_sreg_clusterid_y,
                                    nvvm.read_ptx_sreg_clusterid_z))
cluster_dim = _Dim3("cluster_dim", (nvvm.read_ptx_sreg_cluster_nctaid_x, nvvm.read_ptx_sreg_cluster_nctaid_y,
                                    nvvm.read_ptx_sreg_cluster_nctaid_z))
block_idx_in_cluster = _Dim3("block_idx_in_cluster", (nvvm.read_ptx_sreg_cluster_ctaid_x,
                                                      nvvm.read_ptx_sreg_cluster_ctaid_y,
                                                      nvvm.read_ptx_sreg_cluster_ctaid_z))


@traced
def block_rank_in_cluster() -> Scalar:
    """Linear rank of this block in its cluster (``%cluster_ctarank``)."""
    return _sreg(nvvm.read_ptx_sreg_cluster_ctarank)


@traced
def linear_thread_idx() -> IntLike:
    bx, by, _ = current().block
    tid: Any = thread_idx.x
    if by > 1 or current().block[2] > 1:
        tid = tid + thread_idx.y * bx + thread_idx.z * (bx * by)
    return tid


@traced
def lane_idx() -> Scalar:
    return _sreg(nvvm.read_ptx_sreg_laneid, 32)


@traced
def warp_idx() -> IntLike:
    """Warp index in the block, made warp-uniform (a shuffle from lane 0) so branches on it stay uniform."""
    tid = linear_thread_idx()
    if isinstance(tid, int):
        return tid // 32
    return shfl_idx(tid >> 5, 0)


# ---------------------------------------------------------------------------------------------- shuffles
_FULL_MASK = -1


_SHFL_MODE = {"XOR": "bfly", "DOWN": "down", "UP": "up", "IDX": "idx"}


def _shuffle(value: Any, offset: IntLike, mode: str, width: int) -> Any:
    """CUDA ``__shfl_*_sync(0xffffffff, value, offset, width)`` semantics: ``width`` lanes form a segment."""
    if width & (width - 1) or not 1 <= width <= 32:
        raise CompileError(f"shuffle width must be a power of two up to 32, got {width}")
    v = as_value(value)
    if isinstance(v, Vector):
        return _map_lanes(v, lambda s: _shuffle(s, offset, mode, width))
    dt, i32 = v.dtype, dtypes.i32
    if dt.bits == 64:  # two 32-bit halves
        halves = Vector(llvm.bitcast(ir.VectorType.get([2], i32.mlir()), v.value), i32)
        joined = make_vector([_shuffle(halves[0], offset, mode, width), _shuffle(halves[1], offset, mode, width)],
                             i32)
        return Scalar(llvm.bitcast(dt.mlir(), joined.value), dt)
    if dt.bits == 32:
        bits = v.value if not dt.is_float else arith.bitcast(i32.mlir(), v.value)
    else:  # narrower types travel in the low bits of an i32
        narrow = arith.bitcast(ir.IntegerType.get_signless(dt.bits), v.value) if dt.is_float else v.value
        bits = arith.extui(i32.mlir(), narrow)
    # the c operand: segment mask in bits 8..12, clamp lane in bits 0..4 (0 for shfl.up)
    c = ((32 - width) << 8) | (0 if mode == "UP" else 31)
    out = llvm.inline_asm(i32.mlir(), [bits, as_value(offset, i32).value],
                          f"shfl.sync.{_SHFL_MODE[mode]}.b32 $0, $1, $2, {c}, -1;", "=r,r,r",
                          has_side_effects=True)
    if dt.bits == 32:
        return Scalar(out if not dt.is_float else arith.bitcast(dt.mlir(), out), dt)
    narrow_out = arith.trunci(ir.IntegerType.get_signless(dt.bits), out)
    return Scalar(arith.bitcast(dt.mlir(), narrow_out) if dt.is_float else narrow_out, dt)


def _map_lanes(v: Vector, fn: Callable[[Scalar], Scalar]) -> Vector:
    return make_vector([fn(v[i]) for i in range(v.size)], v.dtype)


@traced
def shfl_xor(value: Any, lane_mask: IntLike, width: int = 32) -> Any:
    """The value held by lane ``lane ^ lane_mask`` (butterfly), within groups of ``width`` lanes."""
    return _shuffle(value, lane_mask, "XOR", width)


@traced
def shfl_down(value: Any, delta: IntLike, width: int = 32) -> Any:
    return _shuffle(value, delta, "DOWN", width)


@traced
def shfl_up(value: Any, delta: IntLike, width: int = 32) -> Any:
    return _shuffle(value, delta, "UP", width)


@traced
def shfl_idx(value: Any, lane: IntLike, width: int = 32) -> Any:
    """The value held by lane ``lane`` of the group (a broadcast)."""
    return _shuffle(value, lane, "IDX", width)


@traced
def warp_reduce(value: Any, op: str = "add", width: int = 32) -> Any:
    """Butterfly reduction over ``width`` lanes; every lane gets the result. ``op``: add, max, min."""
    combine = {"add": lambda a, b: a + b, "max": maximum, "min": minimum}
    if op not in combine:
        raise CompileError(f"warp_reduce op must be one of {sorted(combine)}, got {op!r}")
    if width & (width - 1) or not 1 <= width <= 32:
        raise CompileError(f"warp_reduce width must be a power of two up to 32, got {width}")
    offset = width // 2
    while offset:
        value = combine[op](value, shfl_xor(value, offset, width))
        offset //= 2
    return value


_REDUX_KINDS = {"add": "ADD", "and": "AND", "or": "OR", "xor": "XOR"}


@traced
def redux_sync(value: Any, op: str = "max") -> Scalar:
    """Reduction of a 32-bit integer over the (whole, converged) warp in one ``redux.sync`` (sm_80+); every
    lane gets the result. ``op``: add, min, max (signed or unsigned after the value's dtype), and, or, xor."""
    v = as_value(value)
    if not isinstance(v, Scalar) or not v.dtype.is_int or v.dtype.bits != 32:
        raise CompileError(f"redux_sync takes a 32-bit integer scalar, got {getattr(v, 'dtype', v)}")
    if op in ("min", "max"):
        kind = ("U" if not v.dtype.is_signed else "") + op.upper()
    elif op in _REDUX_KINDS:
        kind = _REDUX_KINDS[op]
    else:
        raise CompileError(f"redux_sync op must be one of add, min, max, and, or, xor; got {op!r}")
    out = nvvm.redux_sync(ir.IntegerType.get_signless(32), v.value, getattr(nvvm.ReduxKind, kind),
                          constant(_FULL_MASK, dtypes.i32).value)
    return Scalar(out, v.dtype)


@traced
def vote_any(pred: Any) -> Scalar:
    """True in every lane when ``pred`` holds in some lane of the (whole, converged) warp (``vote.sync.any``)."""
    p = as_value(pred, dtypes.i1)
    out = nvvm.vote_sync(ir.IntegerType.get_signless(1), constant(_FULL_MASK, dtypes.i32).value, p.value,
                         nvvm.VoteSyncKind.any)
    return Scalar(out, dtypes.i1)


# ---------------------------------------------------------------------------------------------- barriers
@traced
def syncthreads() -> None:
    """Barrier over the whole block (``bar.sync 0``)."""
    gpu.barrier()


@traced
def syncthreads_or(pred: Any) -> Scalar:
    """Barrier over the block that also ORs ``pred`` over all its threads (``bar.red.or``, CUDA's
    ``__syncthreads_or``): every thread gets the same answer, so a branch on it stays block-uniform."""
    p = as_value(pred, dtypes.i1).to(dtypes.i32)
    out = nvvm.barrier(ir.IntegerType.get_signless(32), reduction_op=ir.Attribute.parse("#nvvm.reduction<or>"),
                       reduction_predicate=p.value)
    return Scalar(out, dtypes.i32) != 0


@traced
def named_barrier(barrier_id: IntLike, num_threads: int) -> None:
    """Barrier over ``num_threads`` threads (a multiple of 32) on hardware barrier ``barrier_id`` (1..15)."""
    if num_threads % 32:
        raise CompileError(f"named_barrier needs a multiple of 32 threads, got {num_threads}")
    nvvm.barrier(None, barrier_id=as_value(barrier_id, dtypes.i32).value,
                 number_of_threads=constant(num_threads, dtypes.i32).value)


@traced
def named_barrier_arrive(barrier_id: IntLike, num_threads: int) -> None:
    """Arrive on hardware barrier ``barrier_id`` without waiting (``bar.arrive``): signals threads that wait
    on it with ``named_barrier(barrier_id, num_threads)``."""
    if num_threads % 32:
        raise CompileError(f"named_barrier_arrive needs a multiple of 32 threads, got {num_threads}")
    nvvm.barrier_arrive(constant(num_threads, dtypes.i32).value, barrier_id=as_value(barrier_id, dtypes.i32).value)


@traced
def syncwarp() -> None:
    nvvm.inline_ptx([], [], [], "bar.warp.sync -1;")


@traced
def threadfence() -> None:
    nvvm.inline_ptx([], [], [], "fence.acq_rel.gpu;")


# ---------------------------------------------------------------------------------------------- atomics
@traced
def atomic_add(t: Tensor, index: Any, value: Any) -> Scalar:
    """``old = t[index]; t[index] += value`` atomically (relaxed ordering, ``atom.add``); returns ``old``.
    ``t``: a global or shared tensor of integers (i32, u32, i64); ``index`` as for ``t[index]``."""
    if not isinstance(t, Tensor) or not t.dtype.is_int or t.dtype.bits not in (32, 64):
        raise CompileError(f"atomic_add needs a tensor of 32- or 64-bit integers, got {getattr(t, 'dtype', t)}")
    v = as_value(value, t.dtype)
    old = llvm.AtomicRMWOp(llvm.AtomicBinOp.add, t.address(index), v.value, llvm.AtomicOrdering.monotonic)
    return Scalar(old.result, t.dtype)


# ---------------------------------------------------------------------------------------------- shared memory
@traced
def shared_tensor(dtype: DType, shape: Sequence[int], align: int = 16) -> Tensor:
    """A static shared-memory array (row-major), private to the block."""
    shape = tuple(shape)
    if not all(isinstance(s, int) and s > 0 for s in shape):
        raise CompileError(f"shared_tensor needs a static positive shape, got {shape}")
    nbytes = _pymath.prod(shape) * dtype.itemsize
    ptr = current().static_smem(nbytes, align)
    return Tensor(ptr, dtype, shape, row_major_strides(shape), "shared", align)


@traced
def dynamic_shared_tensor(dtype: DType, shape: Sequence[int], offset_bytes: int = 0) -> Tensor:
    """A view of the kernel's dynamic shared memory at ``offset_bytes`` (1024-byte aligned base).

    The launch reserves as many bytes as the largest view needs, above 48 KB too.
    """
    shape = tuple(shape)
    if not all(isinstance(s, int) and s > 0 for s in shape):
        raise CompileError(f"dynamic_shared_tensor needs a static positive shape, got {shape}")
    nbytes = _pymath.prod(shape) * dtype.itemsize
    builder = current()
    builder.use_dynamic_smem(offset_bytes + nbytes)
    base = builder.dynamic_smem_base()
    from nvfly.frontend.tensor import gep
    ptr = gep(base, offset_bytes, dtypes.i8)
    align = _pymath.gcd(1024, offset_bytes) if offset_bytes else 1024
    return Tensor(ptr, dtype, shape, row_major_strides(shape), "shared", align)


# ---------------------------------------------------------------------------------------------- math
def _unary_math(name: str, op: Callable[[ir.Value], ir.Value], x: Any, ptx_f32: str | None = None) -> Any:
    v = as_value(x, dtypes.f32 if isinstance(x, (int, float)) else None)
    if not v.dtype.is_float:
        raise CompileError(f"{name} needs a floating-point value, got {v.dtype.name}")
    if v.dtype.is_fp8:
        raise CompileError(f"{name}: convert fp8 to f16/bf16/f32 first")
    if ptx_f32 is not None and v.dtype == dtypes.f32:
        if isinstance(v, Vector):
            return _map_lanes(v, lambda lane: _ptx_f32(ptx_f32, lane))
        return _ptx_f32(ptx_f32, v)
    return v._wrap(op(v.value), v.dtype)


def _ptx_f32(instruction: str, v: Scalar) -> Scalar:
    """One f32 PTX instruction (the hardware approximations the MUFU unit runs, flushing denormals)."""
    f32 = ir.F32Type.get()
    out = llvm.inline_asm(f32, [v.value], f"{instruction} $0, $1;", "=f,f")
    return Scalar(out, dtypes.f32)


@traced
def exp2(x: Any) -> Any:
    """2**x (f32: one ``ex2.approx.ftz.f32``; rel. error ~2**-22)."""
    return _unary_math("exp2", mmath.exp2, x, "ex2.approx.ftz.f32")


@traced
def log2(x: Any) -> Any:
    """log2(x) (f32: one ``lg2.approx.ftz.f32``)."""
    return _unary_math("log2", mmath.log2, x, "lg2.approx.ftz.f32")


@traced
def exp(x: Any) -> Any:
    return _unary_math("exp", mmath.exp, x)


@traced
def log(x: Any) -> Any:
    return _unary_math("log", mmath.log, x)


@traced
def sqrt(x: Any) -> Any:
    return _unary_math("sqrt", mmath.sqrt, x)


@traced
def rsqrt(x: Any) -> Any:
    """1/sqrt(x) (f32: one ``rsqrt.approx.ftz.f32``)."""
    return _unary_math("rsqrt", mmath.rsqrt, x, "rsqrt.approx.ftz.f32")


@traced
def tanh(x: Any) -> Any:
    return _unary_math("tanh", mmath.tanh, x)


@traced
def erf(x: Any) -> Any:
    return _unary_math("erf", mmath.erf, x)


@traced
def sin(x: Any) -> Any:
    return _unary_math("sin", mmath.sin, x)


@traced
def cos(x: Any) -> Any:
    return _unary_math("cos", mmath.cos, x)


def _common(*values: Any) -> list[Value]:
    """The operands converted to one dtype (promoted) and one shape (scalars broadcast to the vector's size)."""
    traced_vals = [v for v in values if isinstance(v, _Traced)]
    dt = traced_vals[0].dtype
    for v in traced_vals[1:]:
        dt = dtypes.promote(dt, v.dtype)
    if any(isinstance(v, float) for v in values) and dt.is_int:
        dt = dtypes.f32
    size = next((v.size for v in traced_vals if isinstance(v, Vector)), None)
    out: list[Value] = []
    for v in values:
        x = as_value(v, dt)
        if size is not None and isinstance(x, Scalar):
            from nvfly.frontend.values import full
            x = full(size, x, dt)
        out.append(x)
    return out


@traced
def fma(a: Any, b: Any, c: Any) -> Any:
    """a*b + c (one rounding for floats)."""
    if not any(isinstance(v, _Traced) for v in (a, b, c)):
        return a * b + c
    x, y, z = _common(a, b, c)
    if not x.dtype.is_float:
        return x * y + z
    return x._wrap(mmath.fma(x.value, y.value, z.value), x.dtype)


def _minmax(a: Any, b: Any, float_op: Callable, sint_op: Callable, uint_op: Callable) -> Any:
    x, y = _common(a, b)
    dt = x.dtype
    if dt.is_float:
        return x._wrap(float_op(x.value, y.value), dt)
    return x._wrap((sint_op if dt.is_signed else uint_op)(x.value, y.value), dt)


@traced
def maximum(a: Any, b: Any) -> Any:
    """Elementwise max; NaN if either float operand is NaN (like torch.maximum)."""
    if not isinstance(a, _Traced) and not isinstance(b, _Traced):
        return max(a, b)
    return _minmax(a, b, arith.maximumf, arith.maxsi, arith.maxui)


@traced
def minimum(a: Any, b: Any) -> Any:
    """Elementwise min; NaN if either float operand is NaN (like torch.minimum)."""
    if not isinstance(a, _Traced) and not isinstance(b, _Traced):
        return min(a, b)
    return _minmax(a, b, arith.minimumf, arith.minsi, arith.minui)


@traced
def select(cond: Any, a: Any, b: Any) -> Any:
    """``a`` where ``cond`` else ``b`` (both are evaluated)."""
    c = condition(cond)
    if not isinstance(a, _Traced) and not isinstance(b, _Traced):
        a = as_value(a)
    x, y = _common(a, b)
    return x._wrap(arith.select(c.value, x.value, y.value), x.dtype)


@traced
def count_leading_zeros(x: Any) -> Scalar:
    """Leading zero bits of an integer scalar (its width for 0), as i32 (CUDA's ``__clz``/``__clzll``)."""
    v = as_value(x)
    if not isinstance(v, Scalar) or not v.dtype.is_int:
        raise CompileError(f"count_leading_zeros takes an integer scalar, got {getattr(v, 'dtype', v)}")
    out = llvm.intr_ctlz(v.value, False)
    if v.dtype.bits > 32:
        out = arith.trunci(ir.IntegerType.get_signless(32), out)
    elif v.dtype.bits < 32:
        out = arith.extui(ir.IntegerType.get_signless(32), out)
    return Scalar(out, dtypes.i32)


@traced
def assume_divisible(x: Scalar, divisor: int) -> Scalar:
    """Promise that ``x`` is a multiple of ``divisor`` (enables vector accesses); nothing is checked."""
    if not isinstance(x, Scalar) or not x.dtype.is_int:
        raise CompileError("assume_divisible takes a traced integer")
    return Scalar(x.value, x.dtype, x.divisor * divisor // _pymath.gcd(x.divisor, divisor))


# ---------------------------------------------------------------------------------------------- kernel attributes
@traced
def min_blocks_per_sm(count: int) -> None:
    """Ask ptxas to fit ``count`` blocks per SM (``.minnctapersm``), i.e. to cap the registers per thread at
    about ``65536 / (count * block threads)``. Call it once, anywhere in the kernel body."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise CompileError(f"min_blocks_per_sm takes a positive Python int, got {count!r}")
    current().kernel_attrs["nvvm.minctasm"] = f"{count} : i32"


@traced
def cooperative() -> None:
    """Launch this kernel cooperatively: every block of its grid resident at once, so that blocks may wait for
    each other (a barrier across blocks); a grid that cannot be resident together fails to launch (CUDA's
    "cooperative launch too large") instead of hanging. Call it once, anywhere in the kernel body."""
    current().cooperative = True


@traced
def wait_prior_grid() -> None:
    """Wait here until the stream's previous kernel has ended and its writes are visible (``griddepcontrol.wait``),
    and launch this kernel as its programmatic dependent: its blocks may start while that kernel still runs, so
    the work before this call (shared-memory setup, index math) hides the launch gap. Before it, read or write no
    global memory another kernel of the stream may touch. Where this kernel could not start early (a copy before it,
    a previous kernel already ended), the wait returns at once."""
    current().dependent = True
    nvvm.griddepcontrol(nvvm.GridDepActionKind.wait)


@traced
def launch_dependents() -> None:
    """Let the stream's next kernel, if it is a programmatic dependent (``wait_prior_grid``), start launching now;
    it still waits for this kernel's end before it reads (``griddepcontrol.launch_dependents``). Without this call
    it launches when this kernel's blocks have ended."""
    nvvm.griddepcontrol(nvvm.GridDepActionKind.launch_dependents)


# ---------------------------------------------------------------------------------------------- printf
@traced
def printf(fmt: str, *args: Any) -> None:
    """Device printf (C format string); f16/bf16 are printed as f32, i1/i8/i16 as i32."""
    vals = []
    for a in args:
        v = as_value(a)
        if isinstance(v, Vector):
            raise CompileError("printf takes scalars; index the vector")
        if v.dtype.is_float and v.dtype.bits < 32:
            v = v.to(dtypes.f32)
        elif v.dtype.is_int and v.dtype.bits < 32:
            v = v.to(dtypes.i32)
        vals.append(v.value)
    gpu.printf(ir.StringAttr.get(fmt), *vals)


@traced
def no_unroll() -> None:
    """Keep ptxas from unrolling the dynamic loop (``range``, ``while``) whose body this call opens
    (``.pragma "nounroll";``), e.g. where unrolled copies of the body would spill registers."""
    owner = ir.InsertionPoint.current.block.owner
    if owner is None or owner.operation.name not in ("scf.for", "scf.while"):
        raise CompileError("nvfly.no_unroll() belongs in the body of a dynamic loop (range() or while on a traced "
                           "condition), before its other statements")
    llvm.inline_asm(None, [], '.pragma "nounroll";', "", has_side_effects=True)


def static_range(*args: int) -> range:
    """A compile-time loop: the body is unrolled at trace time with Python ints."""
    for a in args:
        if not isinstance(a, int):
            raise CompileError("static_range bounds must be Python ints (Constexpr); use range() for a dynamic loop")
    return range(*args)
