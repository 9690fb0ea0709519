"""flex_attention's ``score_mod`` and ``mask_mod`` traced into the decode and prefill kernels.

The mods are plain Python functions with flex_attention's signatures,
``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx) -> bool``, written with
torch operations. The kernel calls them once per score element with ``ModValue``s wrapping its traced scalars;
a ModValue implements Python's operators and, through ``__torch_function__``, the torch functions in
``_torch_functions``, so ``torch.tanh(score / 50) * 50`` becomes the kernel's ``tanh`` (the MUFU unit's
``tanh.approx.f32``, FlashAttention-3's soft-cap; a division by a number is a product with its reciprocal). Tensors the functions
capture (closure cells, or globals they name) become kernel inputs: indexing one with traced indices
(``slopes[h]``, ``bias[h, kv_idx]``) is a load from the kernel's copy of it. In decode ``q_idx`` is the query's
position in its sequence (queries are aligned to the end), so mods written for a whole prefill mean the same in
decode; in prefill it is flex's index, the query's row (the same when Sq = Skv).

A mod is compiled once per function object (the compile key holds the functions): numbers it captures are
constants of that compilation, captured tensors are read at run time. A mod that serves calls with different
tensors (a cached mod per kind of mask, each call its own mask) takes them as arguments instead: the call passes
``captured=(t, ...)``, and the mods are called with them after their usual arguments,
``score_mod(score, b, h, q_idx, kv_idx, *captured)``, ``mask_mod(b, h, q_idx, kv_idx, *captured)`` (kernel inputs
like closure tensors: the compile key holds their number, the kernel's specialisation their dtypes, ranks and
alignment facts, as for any tensor argument; a new tensor does not recompile). Such an argument's ``shape`` gives
its extents (run-time values in the kernel): SDPA's per-query mask in decode finds its row from them.
"""
from __future__ import annotations

import contextlib
import types
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import nvfly
from nvfly.arch.floats import tanh_approx
from nvfly.frontend.values import Scalar, Vector

MAX_CAPTURED = 2  # captured tensors the kernel takes (kernel parameters ``captured0``, ``captured1``)


@dataclass(frozen=True)
class Mods:
    """The mods of a call (the decode and prefill kernels' Constexpr; equal by function identity). ``arguments``:
    how many tensors the call passes to the mods as trailing arguments (``captured=``); they come first among the
    kernel's captured tensors, then those the functions capture."""
    score_mod: Optional[Callable[..., Any]] = None
    mask_mod: Optional[Callable[..., Any]] = None
    arguments: int = 0

    @property
    def active(self) -> bool:
        """Whether the kernel traces a score_mod or a mask_mod."""
        return self.score_mod is not None or self.mask_mod is not None

    @property
    def name(self) -> str:
        names = [getattr(f, "__name__", "mod") for f in (self.score_mod, self.mask_mod) if f is not None]
        return "+".join(names) or "none"


def captured_tensors(mods: Mods) -> list:
    """The torch tensors the mods capture, in a fixed order: each function's closure cells, then the globals its
    code names (nested functions' code too), without repeats; a Python function found there (a mod composed of
    others, e.g. ``causal & document(b, h, q, kv)``) is searched the same way where it is found."""
    import torch
    found: list = []
    visited: list = []

    def names(code: Any) -> Iterator[str]:
        yield from code.co_names
        for const in code.co_consts:
            if hasattr(const, "co_names"):
                yield from names(const)

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor) and not any(value is t for t in found):
            found.append(value)
        elif isinstance(value, types.FunctionType) and not any(value is f for f in visited):
            search(value)

    def search(fn: types.FunctionType) -> None:
        visited.append(fn)
        for cell in fn.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                add(cell.cell_contents)
        for name in names(fn.__code__):
            add(fn.__globals__.get(name))

    for fn in (mods.score_mod, mods.mask_mod):
        if isinstance(fn, types.FunctionType):
            search(fn)
    return found


def bound(fn: Optional[Callable[..., Any]], captured: tuple) -> Optional[Callable[..., Any]]:
    """``fn`` with the call's tensor arguments appended (for the references, which call the mods on torch tensors)."""
    if fn is None or not captured:
        return fn
    return lambda *args: fn(*args, *captured)


# ---------------------------------------------------------------------------------------------- tracing
_ACTIVE: list = []  # the captured-tensor map of the trace in progress: [(torch tensor, kernel tensor), ...]


@contextlib.contextmanager
def _capturing(mods: Mods, kernel_tensors: tuple) -> Iterator[None]:
    """While a mod is traced: indexing a captured torch tensor reads ``kernel_tensors`` (the kernel's parameters
    for them, in ``captured_tensors`` order)."""
    _ACTIVE.append(list(zip(captured_tensors(mods), kernel_tensors)))
    try:
        yield
    finally:
        _ACTIVE.pop()


def _raw(x: Any) -> Any:
    return x.value if isinstance(x, ModValue) else x


def _wrap(x: Any) -> Any:
    return ModValue(x) if isinstance(x, (Scalar, Vector)) else x


def _as_f32(x: Any) -> Any:
    """Floats as f32 (scores are f32; bf16 tables are widened on load)."""
    if isinstance(x, (Scalar, Vector)) and x.dtype.is_float and x.dtype != nvfly.f32:
        return x.to(nvfly.f32)
    return x


_PREFETCH: list = []  # the mod trace's loads to record or replay: [(loads, replay)]


@contextlib.contextmanager
def _prefetching(loads: Optional[list], replay: bool) -> Iterator[None]:
    """While a mod is traced: each table load's value is appended to ``loads`` (``replay`` False), or taken from
    its front instead of loading (True: the same mod on the same element, traced again after the first trace's
    loads were issued). ``loads`` None: loads as usual."""
    _PREFETCH.append((loads, replay))
    try:
        yield
    finally:
        _PREFETCH.pop()


def _load(kernel_tensor: Any, index: Any) -> "ModValue":
    loads, replay = _PREFETCH[-1] if _PREFETCH else (None, False)
    if loads is not None and replay:
        return ModValue(loads.pop(0))
    coords = index if isinstance(index, tuple) else (index,)
    value = _as_f32(kernel_tensor[tuple(_raw(c) for c in coords)])
    if loads is not None:
        loads.append(value)
    return ModValue(value)


def _index(tensor: Any, index: Any) -> "ModValue":
    for captured, kernel_tensor in (_ACTIVE[-1] if _ACTIVE else ()):
        if captured is tensor:
            return _load(kernel_tensor, index)
    raise TypeError("attention: a score_mod/mask_mod indexed a tensor it does not capture (pass tensors through "
                    "the function's closure or module globals)")


def _tanh(x: Any) -> Any:
    """tanh by the MUFU unit (one instruction; relative error <= 2^-10.987, FlashAttention-3's soft-cap): the
    correctly rounded ``nvfly.tanh`` costs an ex2, a reciprocal and a polynomial per score, as much as the softmax."""
    if isinstance(x, Scalar):
        return tanh_approx(x if x.dtype == nvfly.f32 else x.to(nvfly.f32))
    return nvfly.tanh(x)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _as_f32_operand(x: Any) -> Any:
    """An operand of an f32 product: numbers as floats, scalars converted to f32 (None: a vector)."""
    if _is_number(x):
        return float(x)
    if isinstance(x, Scalar):
        return x if x.dtype == nvfly.f32 else x.to(nvfly.f32)
    return None


def _multiply(a: Any, b: Any) -> "ModValue":
    """a * b; an f32 product remembers its factors, so that a sum it takes part in becomes one FMA (``_add``: what
    Triton, hence flex, does by default; PTX's mul.rn and add.rn forbid ptxas to fuse them), and a product times a
    number folds the number into its second factor."""
    if _is_number(a):
        a, b = b, a
    for affine, other in ((_affine_of(a), b), (_affine_of(b), a)):
        if affine is not None and affine[0] is not None:
            m = _as_f32(_raw(other))
            if isinstance(m, float) or (isinstance(m, Scalar) and m.dtype == nvfly.f32 and _affine_of(other) is None):
                return _affine_product(m, affine)  # an f32 product (an int one stays an int, unhoisted)
    if isinstance(a, ModValue) and a.product is not None and _is_number(b):
        # (m n) c as m (n c): the scaled score times a number is one multiply a score (n c, the scale times the
        # number, is the same for every score: computed once)
        m, n = a.product
        return _multiply(m, n * float(b))
    x, y = _as_f32(_raw(a)), _as_f32(_raw(b))
    out = x * y
    factors = (_as_f32_operand(x), _as_f32_operand(y))
    if isinstance(out, Scalar) and out.dtype == nvfly.f32 and all(f is not None for f in factors):
        return ModValue(out, factors)
    return _wrap(out)


def _affine_of(x: Any) -> Optional[tuple]:
    """x as (base, offset) (``ModValue.affine``): an affine ModValue's, an int's (None, x); else None."""
    if isinstance(x, ModValue):
        return x.affine
    if isinstance(x, int) and not isinstance(x, bool):
        return (None, x)
    return None


def _affine_difference(a: Any, b: Any, subtract: bool) -> Optional[tuple]:
    """(base, offset) of a + b (a - b) when both are affine or ints and one of them affine, else None. The bases'
    sum is the same traced op for every score sharing them (one a row and block after CSE)."""
    fa, fb = _affine_of(a), _affine_of(b)
    if fa is None or fb is None or (fa[0] is None and fb[0] is None):
        return None
    (base_a, offset_a), (base_b, offset_b) = fa, fb
    if base_b is None:
        base = base_a
    elif base_a is None:
        base = -base_b if subtract else base_b
    else:
        base = base_a - base_b if subtract else base_a + base_b
    return base, (offset_a - offset_b if subtract else offset_a + offset_b)


def _affine_product(m: Any, affine: tuple) -> "ModValue":
    """m * (base + offset) for an f32 (or number) m and an affine int: m * float(base) once (shared by the scores
    with the same base and m) and one FMA (an add for a number m) a score, instead of an int add and an int-to-float
    conversion (MUFU-rate) a score; two roundings instead of one (|error| <= ulp(m * base) / 2)."""
    base, offset = affine
    scaled = m * base.to(nvfly.f32)
    if _is_number(m):
        return ModValue(scaled + float(m) * offset)
    return ModValue(nvfly.fma(m, float(offset), scaled))


def _add(a: Any, b: Any, subtract: bool = False) -> "ModValue":
    """a + b (a - b), with a product among them (``_multiply``) and an f32 other term fused into one FMA; affine
    ints (``ModValue.affine``) stay affine."""
    x, y = _as_f32(_raw(a)), _as_f32(_raw(b))
    affine = _affine_difference(a, b, subtract)
    if affine is not None:
        return ModValue(x - y if subtract else x + y, affine=affine)
    product_a = a.product if isinstance(a, ModValue) else None
    product_b = b.product if isinstance(b, ModValue) else None
    if product_b is not None and _as_f32_operand(x) is not None:  # x +- m n
        m, n = product_b
        return ModValue(nvfly.fma(-m if subtract else m, n, _as_f32_operand(x)))
    if product_a is not None and _as_f32_operand(y) is not None:  # m n +- y
        m, n = product_a
        y = _as_f32_operand(y)
        return ModValue(nvfly.fma(m, n, -y if subtract else y))
    return _wrap(x - y if subtract else x + y)


def _divide(a: Any, b: Any) -> "ModValue":
    """a / b, by a Python number as a product with its reciprocal (within 1.5 ulp; IEEE division by a constant is a
    reciprocal and a Newton step with a slow path, per score)."""
    raw = _as_f32(_raw(a))
    if isinstance(raw, (Scalar, Vector)) and raw.dtype.is_float and _is_number(b) and b != 0:
        return _multiply(a, 1.0 / b)
    return _wrap(raw / _as_f32(_raw(b)))


def _binary(op: Callable[[Any, Any], Any]) -> Callable[..., "ModValue"]:
    def apply(a: Any, b: Any, *_: Any, **__: Any) -> "ModValue":
        return _wrap(op(_as_f32(_raw(a)), _as_f32(_raw(b))))
    return apply


def _arguments_only(op: Callable[[Any, Any], "ModValue"]) -> Callable[..., "ModValue"]:
    def apply(a: Any, b: Any, *_: Any, **__: Any) -> "ModValue":
        return op(a, b)
    return apply


def _unary(op: Callable[[Any], Any]) -> Callable[..., "ModValue"]:
    def apply(a: Any, *_: Any, **__: Any) -> "ModValue":
        return _wrap(op(_as_f32(_raw(a))))
    return apply


def _where(cond: Any, a: Any, b: Any) -> "ModValue":
    return _wrap(nvfly.select(_raw(cond), _as_f32(_raw(a)), _as_f32(_raw(b))))


def _clamp(x: Any, min: Any = None, max: Any = None) -> "ModValue":  # noqa: A002 - torch's keyword names
    value = _raw(x)
    if min is not None:
        value = nvfly.maximum(value, _raw(min))
    if max is not None:
        value = nvfly.minimum(value, _raw(max))
    return _wrap(value)


def _torch_functions() -> dict:
    import operator

    import torch
    Tensor = torch.Tensor
    return {
        torch.tanh: _unary(_tanh), Tensor.tanh: _unary(_tanh),
        torch.exp: _unary(nvfly.exp), Tensor.exp: _unary(nvfly.exp),
        torch.exp2: _unary(nvfly.exp2), torch.log: _unary(nvfly.log), torch.log2: _unary(nvfly.log2),
        torch.sqrt: _unary(nvfly.sqrt), torch.rsqrt: _unary(nvfly.rsqrt), torch.erf: _unary(nvfly.erf),
        torch.sin: _unary(nvfly.sin), torch.cos: _unary(nvfly.cos),
        torch.sigmoid: _unary(lambda x: 1.0 / (1.0 + nvfly.exp(-x))),
        torch.abs: _unary(abs), Tensor.abs: _unary(abs), torch.neg: _unary(operator.neg),
        torch.where: _where, torch.clamp: _clamp, Tensor.clamp: _clamp,
        torch.minimum: _binary(nvfly.minimum), torch.maximum: _binary(nvfly.maximum),
        torch.add: _arguments_only(_add), torch.sub: _arguments_only(lambda a, b: _add(a, b, True)),
        torch.mul: _arguments_only(_multiply), torch.div: _arguments_only(_divide),
        torch.logical_and: _binary(operator.and_), torch.logical_or: _binary(operator.or_),
        torch.logical_not: _unary(lambda x: ~x),
        Tensor.__getitem__: _index,
    }


_FUNCTIONS: dict = {}


class ModValue:
    """A traced scalar as the mods see it: Python operators and the torch functions of ``_torch_functions``.
    ``affine`` (the prefill kernel's hoisted q_idx and kv_idx, and sums and differences of them and ints): (base,
    offset), an int ``base + offset`` whose base (a traced i32) is shared by many scores and whose offset is a
    Python int: a comparison becomes one compare of the base with a constant, a product with an f32 one FMA
    (``_affine_product``); indexing a tensor reads ``value`` (the kernel's, clamped to the sequence)."""
    __slots__ = ("value", "product", "affine")

    def __init__(self, value: Any, product: Optional[tuple] = None, affine: Optional[tuple] = None):
        self.value = value
        self.product = product  # (m, n) when value = m * n (f32): a sum with it is one FMA
        self.affine = affine

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if not _FUNCTIONS:
            _FUNCTIONS.update(_torch_functions())
        handler = _FUNCTIONS.get(func)
        if handler is None:
            name = getattr(func, "__name__", repr(func))
            raise TypeError(f"attention: torch.{name} is not supported in a score_mod/mask_mod (supported: "
                            f"arithmetic, comparisons, &, |, ~, tensor indexing, "
                            f"{', '.join(sorted({getattr(f, '__name__', '?') for f in _FUNCTIONS}))})")
        return handler(*args, **(kwargs or {}))

    def __bool__(self) -> bool:
        raise TypeError("attention: a score_mod/mask_mod branched on a traced value; use torch.where, &, | and ~")

    def _op(self, other: Any, op: Callable[[Any, Any], Any], reverse: bool = False) -> "ModValue":
        a, b = _as_f32(self.value), _as_f32(_raw(other))
        return _wrap(op(b, a) if reverse else op(a, b))

    def _compare(self, other: Any, op: Callable[[Any, Any], Any]) -> "ModValue":
        """self op other; affine: (base_a - base_b) op (offset_b - offset_a), a compare with a constant."""
        difference = _affine_difference(self, other, True)
        if difference is None:
            return self._op(other, op)
        base, offset = difference
        return _wrap(op(base, -offset))

    def __add__(self, o: Any) -> "ModValue": return _add(self, o)
    def __radd__(self, o: Any) -> "ModValue": return _add(o, self)
    def __sub__(self, o: Any) -> "ModValue": return _add(self, o, True)
    def __rsub__(self, o: Any) -> "ModValue": return _add(o, self, True)
    def __mul__(self, o: Any) -> "ModValue": return _multiply(self, o)
    def __rmul__(self, o: Any) -> "ModValue": return _multiply(o, self)
    def __truediv__(self, o: Any) -> "ModValue": return _divide(self, o)
    def __rtruediv__(self, o: Any) -> "ModValue": return self._op(o, lambda a, b: a / b, True)
    def __floordiv__(self, o: Any) -> "ModValue": return self._op(o, lambda a, b: a // b)
    def __mod__(self, o: Any) -> "ModValue": return self._op(o, lambda a, b: a % b)
    def __lt__(self, o: Any) -> "ModValue": return self._compare(o, lambda a, b: a < b)
    def __le__(self, o: Any) -> "ModValue": return self._compare(o, lambda a, b: a <= b)
    def __gt__(self, o: Any) -> "ModValue": return self._compare(o, lambda a, b: a > b)
    def __ge__(self, o: Any) -> "ModValue": return self._compare(o, lambda a, b: a >= b)
    def __eq__(self, o: Any) -> "ModValue": return self._compare(o, lambda a, b: a == b)  # type: ignore[override]
    def __ne__(self, o: Any) -> "ModValue": return self._compare(o, lambda a, b: a != b)  # type: ignore[override]
    def __and__(self, o: Any) -> "ModValue": return self._op(o, lambda a, b: a & b)
    def __rand__(self, o: Any) -> "ModValue": return self._op(o, lambda a, b: a & b, True)
    def __or__(self, o: Any) -> "ModValue": return self._op(o, lambda a, b: a | b)
    def __ror__(self, o: Any) -> "ModValue": return self._op(o, lambda a, b: a | b, True)
    def __invert__(self) -> "ModValue": return _wrap(~self.value)
    def __neg__(self) -> "ModValue": return _wrap(-self.value)
    def __abs__(self) -> "ModValue": return _wrap(abs(self.value))

    __hash__ = None  # type: ignore[assignment]


class ModTensor:
    """A tensor passed to the mods as an argument (``captured=``), as they see it in the kernel: indexing it with
    traced indices (or ints) is a load, floats widened to f32."""
    __slots__ = ("tensor",)

    def __init__(self, tensor: Any):
        self.tensor = tensor

    def __getitem__(self, index: Any) -> "ModValue":
        return _load(self.tensor, index)

    @property
    def shape(self) -> tuple:
        """The tensor's extents: ints where static, traced values where known at run time only."""
        return tuple(_wrap(extent) for extent in self.tensor.shape)


def _arguments(mods: Mods, captured: tuple) -> tuple:
    """The mods' tensor arguments (the first ``mods.arguments`` kernel tensors) as ModTensors."""
    return tuple(ModTensor(t) for t in captured[:mods.arguments])


def _indices(q_idx: Any, kv_idx: Any, affine: Optional[tuple]) -> tuple:
    """q_idx and kv_idx as ModValues, with ``affine``'s (base, offset) pairs if given."""
    q_affine, kv_affine = affine or (None, None)
    return ModValue(q_idx, affine=q_affine), ModValue(kv_idx, affine=kv_affine)


def apply_score_mod(mods: Mods, captured: tuple, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any,
                    scale: Any = None, affine: Optional[tuple] = None) -> Any:
    """The score after ``mods.score_mod`` (f32), or ``score`` without one; ``captured``: the kernel's captured
    tensors (the mods' arguments, then the tensors of ``captured_tensors(mods)``); ``scale``: the mod sees
    ``score * scale`` (a product: a bias the mod adds fuses with it into one FMA); ``affine``: None, or q_idx's
    and kv_idx's (base, offset) (``ModValue.affine``)."""
    if mods.score_mod is None:
        return score if scale is None else score * scale
    value = ModValue(score) if scale is None else _multiply(score, scale)
    with _capturing(mods, captured[mods.arguments:]):
        out = _raw(mods.score_mod(value, ModValue(b), ModValue(h), *_indices(q_idx, kv_idx, affine),
                                  *_arguments(mods, captured)))
    return out.to(nvfly.f32) if isinstance(out, Scalar) else nvfly.f32(float(out))


def apply_mask_mod(mods: Mods, captured: tuple, b: Any, h: Any, q_idx: Any, kv_idx: Any,
                   affine: Optional[tuple] = None, loads: Optional[list] = None, replay: bool = False) -> Any:
    """Whether ``mods.mask_mod`` keeps the element (an i1), or None without one; ``affine`` as in
    ``apply_score_mod``; ``loads``: a list the element's table loads are appended to, or with ``replay`` taken
    from (in the same order: the loads of an earlier trace of the same element, issued under a GEMM)."""
    if mods.mask_mod is None:
        return None
    with _capturing(mods, captured[mods.arguments:]), _prefetching(loads, replay):
        out = _raw(mods.mask_mod(ModValue(b), ModValue(h), *_indices(q_idx, kv_idx, affine),
                                 *_arguments(mods, captured)))
    if not isinstance(out, Scalar):
        return nvfly.i1(bool(out)) if isinstance(out, bool) else out
    return out if out.dtype == nvfly.i1 else out != 0


# ---------------------------------------------------------------------------------------------- shipped examples
def soft_cap(cap: float) -> Callable[..., Any]:
    """Gemma-2-style tanh soft-capping: cap * tanh(score / cap)."""
    import torch

    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap
    return tanh_softcap


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's per-head slopes 2**(-8 (h + 1) / heads) (power-of-two head counts, as in the paper)."""
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def alibi(slopes: Any) -> Callable[..., Any]:
    """ALiBi: score + slopes[h] * (kv_idx - q_idx), ``slopes`` a float tensor of one slope per query head (a
    captured tensor: a kernel input)."""
    def alibi_bias(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi_bias


def relative_position_bias(bias: Any) -> Callable[..., Any]:
    """A learned relative-position bias (T5-like, without buckets): score + bias[h, clamp(kv_idx - q_idx, -(R - 1),
    R - 1) + R - 1], ``bias`` a float tensor (heads, 2R - 1) of one value per head and distance (a captured tensor:
    a kernel input); distances beyond R - 1 share the last entry."""
    import torch
    reach = (bias.shape[1] - 1) // 2

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -reach, reach) + reach]
    return relative_bias


def sliding_window(window: int) -> Callable[..., Any]:
    """Keys at most ``window - 1`` positions before the query (with causal: the last ``window`` keys)."""
    def sliding_window_mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window
    return sliding_window_mask


def prefix_lm(prefix_lengths: Any) -> Callable[..., Any]:
    """Prefix-LM without causal: every query sees its sequence's first ``prefix_lengths[b]`` keys, and the keys up
    to its own position (call with causal=False)."""
    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_lengths[b]) | (kv_idx <= q_idx)
    return prefix_lm_mask


def document_mask(document_ids: Any) -> Callable[..., Any]:
    """Keys of the query's own document: ``document_ids`` (batch, cache length) int32, the document of each key
    position."""
    def document_mask_mod(b, h, q_idx, kv_idx):
        return document_ids[b, kv_idx] == document_ids[b, q_idx]
    return document_mask_mod



def _mask_index(varies: tuple, b: Any, h: Any, q_idx: Any, kv_idx: Any, mask: Any, rows_at_end: bool) -> tuple:
    """The index of a (B or 1, H or 1, Sq or 1, Skv or 1) mask: 0 along its broadcast dimensions. ``rows_at_end``:
    ``q_idx`` is the query's position at the end of the keys (decode), and the mask has a row per query and a column
    per key: its row is the position minus Skv - Sq (the mask's run-time extents)."""
    if rows_at_end:
        q_idx = q_idx - (mask.shape[3] - mask.shape[2])
    return tuple(i if v else 0 for i, v in zip((b, h, q_idx, kv_idx), varies))


@functools.lru_cache(maxsize=None)
def tensor_mask(varies: tuple, rows_at_end: bool = False) -> Callable[..., Any]:
    """A mask_mod taking SDPA's boolean attn_mask as its argument (``captured=(mask,)``; True or nonzero = the key
    takes part), a (B or 1, H or 1, Sq or 1, Skv or 1) tensor: ``varies`` says which of its four dimensions are
    not broadcast; ``rows_at_end`` (decode, a mask with a row per query and a column per key): the queries are the
    last Sq of the keys (``_mask_index``). One function per pattern, so one compilation serves every call's mask."""
    def sdpa_bool_mask(b, h, q_idx, kv_idx, mask):
        return mask[_mask_index(varies, b, h, q_idx, kv_idx, mask, rows_at_end)] != 0
    return sdpa_bool_mask


# The lowest finite score an additive mask leaves. The softmax's exponent is one FFMA, exp2(fma(s, log2e,
# -fl(max * log2e))), which keeps the rounding error of max * log2e (half an ulp of it) in the exponent: at HF's
# bf16/float32 finfo.min (and at -1e38) that is ~1e31, so a block whose keys are all finfo.min gives exp2 = inf,
# then inf * 0 = NaN. At -1e6 the error is below 0.07 (p within 5% of 1 there, and 0 next to any real key); -inf
# (a masked key) stays -inf.
BIAS_FLOOR = -1.0e6


@functools.lru_cache(maxsize=None)
def tensor_bias(varies: tuple, rows_at_end: bool = False) -> Callable[..., Any]:
    """A score_mod adding SDPA's additive (float) attn_mask, its argument (``captured=(bias,)``), to the scaled
    score, a (B or 1, H or 1, Sq or 1, Skv or 1) tensor with ``varies`` and ``rows_at_end`` as in ``tensor_mask``;
    finite sums below ``BIAS_FLOOR`` are raised to it."""
    import torch

    def sdpa_additive_mask(score, b, h, q_idx, kv_idx, bias):
        value = score + bias[_mask_index(varies, b, h, q_idx, kv_idx, bias, rows_at_end)]
        return torch.where((value < BIAS_FLOOR) & (value > float("-inf")), BIAS_FLOOR, value)
    return sdpa_additive_mask
