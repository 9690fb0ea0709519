"""Hierarchical integer tuples (CuTe ``IntTuple``).

An ``IntTuple`` is an integer leaf (a static Python ``int`` or a dynamic traced integer,
see :mod:`nvfly.layout.arith`) or a Python ``tuple`` of ``IntTuple``. Shapes, strides and
coordinates of layouts are ``IntTuple``s. ``None`` inside a *coordinate* plays the role of
CuTe's underscore ``_``: it keeps the mode when slicing.

Coordinates follow CuTe's colexicographic convention: a 1-D index into a multi-modal shape
varies the leftmost mode fastest, and the last mode of a shape is not bounded (an index past
the size keeps counting in the last mode).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple, Union

from nvfly.layout import arith
from nvfly.layout.arith import IntLike, is_constant, is_static, require_static
from nvfly.layout.errors import LayoutError

__all__ = [
    "IntTuple", "is_tuple", "is_int", "is_static_tuple", "as_int_tuple", "flatten", "rank", "depth",
    "product", "product_each", "inner_product", "tuple_max", "prefix_product",
    "compact_col_major", "compact_row_major", "compact_order", "shape_div", "shape_min", "ceil_div",
    "elem_scale", "coalesce_shape", "congruent", "weakly_congruent", "compatible", "crd2idx",
    "idx2crd", "crd2crd", "has_none", "slice_", "dice", "repeat_like", "transform_leaf", "get",
]

IntTuple = Union[IntLike, Tuple[Any, ...]]


def is_tuple(x: Any) -> bool:
    """True for a (possibly nested) tuple."""
    return isinstance(x, tuple)


def is_int(x: Any) -> bool:
    """True for an integer leaf: a static ``int`` or a dynamic integer (anything but a tuple or None)."""
    return not isinstance(x, tuple) and x is not None


def is_static_tuple(t: IntTuple) -> bool:
    """True when every leaf of ``t`` is a static ``int``."""
    if isinstance(t, tuple):
        return all(is_static_tuple(e) for e in t)
    return is_static(t)


def as_int_tuple(x: Any, what: str = "int tuple") -> IntTuple:
    """Validate ``x`` as an ``IntTuple``, turning nested lists into tuples.

    Rejects ``None``, floats, bools and strings (a dynamic integer is any other object).
    """
    if isinstance(x, (tuple, list)):
        return tuple(as_int_tuple(e, what) for e in x)
    if x is None or isinstance(x, (bool, float, complex, str, bytes)):
        raise LayoutError(f"{what}: {x!r} is not an integer")
    return x


def flatten(t: IntTuple) -> Tuple[Any, ...]:
    """The leaves of ``t`` as a flat tuple (an integer becomes a 1-tuple)."""
    if isinstance(t, tuple):
        return tuple(leaf for e in t for leaf in flatten(e))
    return (t,)


def rank(t: IntTuple) -> int:
    """Number of top-level modes: ``len(t)`` for a tuple, 1 for an integer."""
    return len(t) if isinstance(t, tuple) else 1


def depth(t: IntTuple) -> int:
    """Nesting depth: 0 for an integer, ``1 + max(depth(modes))`` for a tuple."""
    if isinstance(t, tuple):
        return 1 + max((depth(e) for e in t), default=0)
    return 0


def get(t: IntTuple, *idx: int) -> IntTuple:
    """``t[i0][i1]...``; indexing an integer with 0 returns the integer (CuTe ``get<0>``)."""
    for i in idx:
        if isinstance(t, tuple):
            t = t[i]
        elif i != 0:
            raise LayoutError(f"get: index {i} out of range for the integer {t!r}")
    return t


def product(t: IntTuple) -> IntLike:
    """Product of all leaves (the size of a shape)."""
    if isinstance(t, tuple):
        result: IntLike = 1
        for e in t:
            result = arith.mul(result, product(e))
        return result
    return t


def product_each(t: IntTuple) -> Tuple[Any, ...]:
    """Tuple of the products of each top-level mode (an integer ``s`` gives ``(s,)``)."""
    if isinstance(t, tuple):
        return tuple(product(e) for e in t)
    return (t,)


def inner_product(a: IntTuple, b: IntTuple) -> IntLike:
    """Sum of products of corresponding leaves of two congruent tuples."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        if len(a) != len(b):
            raise LayoutError(f"inner_product: ranks differ: {a!r} vs {b!r}")
        result: IntLike = 0
        for x, y in zip(a, b):
            result = arith.add(result, inner_product(x, y))
        return result
    if isinstance(a, tuple) or isinstance(b, tuple):
        raise LayoutError(f"inner_product: {a!r} and {b!r} are not congruent")
    return arith.mul(a, b)


def tuple_max(t: IntTuple) -> int:
    """Largest leaf of a static tuple."""
    return max(require_static(v, "tuple_max", "every element") for v in flatten(t))


def prefix_product(a: IntTuple, init: IntTuple = 1) -> IntTuple:
    """Exclusive prefix product of ``a`` (congruent to ``a``), column-major: ``(4,(2,3)) -> (1,(4,8))``."""
    if isinstance(a, tuple):
        if isinstance(init, tuple):
            if len(a) != len(init):
                raise LayoutError(f"prefix_product: ranks differ: {a!r} vs {init!r}")
            return tuple(prefix_product(x, i) for x, i in zip(a, init))
        result = []
        for k, v in enumerate(a):
            result.append(prefix_product(v, init))
            if k + 1 < len(a):  # no trailing product: it would be a dead op on dynamic values
                init = arith.mul(init, product(v))
        return tuple(result)
    if isinstance(init, tuple):
        raise LayoutError(f"prefix_product: integer {a!r} with tuple init {init!r}")
    return init


def _unflatten(flat: Sequence[Any], profile: IntTuple) -> IntTuple:
    """Rebuild a tuple congruent to ``profile`` from its leaves in order."""
    leaves = iter(flat)

    def build(p: IntTuple) -> IntTuple:
        if isinstance(p, tuple):
            return tuple(build(e) for e in p)
        return next(leaves)

    return build(profile)


def _compact(shape: IntTuple, current: IntLike, row_major: bool) -> IntTuple:
    leaves = flatten(shape)
    order = range(len(leaves) - 1, -1, -1) if row_major else range(len(leaves))
    strides: list = [0] * len(leaves)
    for k, i in enumerate(order):
        if is_constant(leaves[i], 1):
            continue
        strides[i] = current
        if k + 1 < len(leaves):  # no trailing product: it would be a dead op on dynamic values
            current = arith.mul(current, leaves[i])
    return _unflatten(strides, shape)


def compact_col_major(shape: IntTuple, current: IntLike = 1) -> IntTuple:
    """CuTe ``LayoutLeft`` strides: column-major compact, static size-1 modes get stride 0."""
    return _compact(shape, current, row_major=False)


def compact_row_major(shape: IntTuple, current: IntLike = 1) -> IntTuple:
    """CuTe ``LayoutRight`` strides: row-major compact, static size-1 modes get stride 0."""
    return _compact(shape, current, row_major=True)


def compact_order(shape: IntTuple, order: IntTuple) -> IntTuple:
    """Compact strides that visit the leaves of ``shape`` in increasing (static) ``order``.

    ``compact_order((2,2,2,2), (0,2,3,1)) == (1,4,8,2)``.
    """
    if not congruent(shape, order):
        raise LayoutError(f"compact_order: shape {shape!r} and order {order!r} are not congruent")
    flat_shape = flatten(shape)
    flat_order = tuple(require_static(o, "compact_order", "the order") for o in flatten(order))

    def build(s: IntTuple, o: IntTuple) -> IntTuple:
        if isinstance(o, tuple):
            return tuple(build(x, y) for x, y in zip(s, o))
        d: IntLike = 1
        for s2, o2 in zip(flat_shape, flat_order):
            if o2 < o:
                d = arith.mul(d, s2)
        return compact_col_major(s, d)

    return build(shape, order)


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _signum(a: int) -> int:
    return (a > 0) - (a < 0)


def shape_div(a: IntTuple, b: IntTuple, op: str = "shape_div") -> IntTuple:
    """CuTe ``shape_div``: divide shape ``a`` by ``b``, folding ``b`` across the modes of ``a``.

    ``shape_div((4,5,6), 40) == (1,1,3)``. For integers it enforces the divisibility condition
    ``a % b == 0 or b % a == 0`` (when static) and rounds away from zero (``shape_div(2, 8) == 1``).
    For dynamic operands this is ``ceil(a / b)``, which equals CuTe's result for non-negative
    values satisfying the divisibility condition.
    """
    if isinstance(a, tuple):
        if isinstance(b, tuple):
            if len(a) != len(b):
                raise LayoutError(f"{op}: ranks differ: {a!r} vs {b!r}")
            return tuple(shape_div(x, y, op) for x, y in zip(a, b))
        result = []
        for k, v in enumerate(a):
            result.append(shape_div(v, b, op))
            if k + 1 < len(a):
                b = shape_div(b, product(v), op)
        return tuple(result)
    if isinstance(b, tuple):
        return shape_div(a, product(b), op)
    if is_static(a) and is_static(b):
        if b == 0 or (a % b != 0 and b % a != 0):
            raise LayoutError(f"{op}: divisibility condition violated: neither of {a} and {b} divides the other")
        q = _trunc_div(a, b)
        return q if q != 0 else _signum(a) * _signum(b)
    return arith.ceil_div(a, b)


def shape_min(a: IntLike, b: IntLike, op: str = "shape_min") -> IntLike:
    """Minimum of two shape integers; a static 1 wins without evaluating the other operand."""
    if is_constant(a, 1) or is_constant(b, 1):
        return 1
    if is_static(a) and is_static(b):
        return min(a, b)
    raise LayoutError(f"{op}: min({a}, {b}) of a dynamic extent cannot be decided at trace time; "
                      "make the extent static or apply the operation by mode (tuple tiler) so the "
                      "dynamic mode is not split")


def ceil_div(a: IntTuple, b: IntTuple) -> IntTuple:
    """CuTe ``ceil_div`` on int tuples: element-wise for two tuples (missing modes of ``b`` are 1),
    folded across the modes of ``a`` for a tuple ``a`` and an integer ``b``."""
    if isinstance(a, tuple):
        if isinstance(b, tuple):
            if len(a) < len(b):
                raise LayoutError(f"ceil_div: {b!r} has more modes than {a!r}")
            b = b + (1,) * (len(a) - len(b))
            return tuple(ceil_div(x, y) for x, y in zip(a, b))
        result = []
        for k, v in enumerate(a):
            result.append(ceil_div(v, b))
            if k + 1 < len(a):
                b = ceil_div(b, product(v))
        return tuple(result)
    if isinstance(b, tuple):
        return ceil_div(a, product(b))
    return arith.ceil_div(a, b)


def elem_scale(a: IntTuple, b: IntTuple) -> IntTuple:
    """Scale each leaf-mode of ``a`` by the product of the corresponding mode of ``b``."""
    if isinstance(a, tuple):
        if not isinstance(b, tuple) or len(a) != len(b):
            raise LayoutError(f"elem_scale: {a!r} and {b!r} are not congruent")
        return tuple(elem_scale(x, y) for x, y in zip(a, b))
    return arith.mul(a, product(b))


def coalesce_shape(shape: IntTuple) -> IntTuple:
    """CuTe ``coalesce(Shape)``: flatten and multiply neighbouring leaves that are both static or
    both dynamic; returns an integer when a single leaf remains."""
    leaves = flatten(shape)
    result = [leaves[0]]
    for v in leaves[1:]:
        if is_static(result[-1]) == is_static(v):
            result[-1] = arith.mul(result[-1], v)
        else:
            result.append(v)
    return result[0] if len(result) == 1 else tuple(result)


def congruent(a: IntTuple, b: IntTuple) -> bool:
    """True when ``a`` and ``b`` have the same hierarchical profile."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(congruent(x, y) for x, y in zip(a, b))
    return not isinstance(a, tuple) and not isinstance(b, tuple)


def weakly_congruent(a: IntTuple, b: IntTuple) -> bool:
    """True when the profile of ``a`` is a coarsening of that of ``b`` (partial order ``a <= b``)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(weakly_congruent(x, y) for x, y in zip(a, b))
    return not isinstance(a, tuple)


def compatible(a: IntTuple, b: IntTuple) -> bool:
    """True when every coordinate of shape ``a`` is also a coordinate of shape ``b``
    (same size at every leaf of ``a``). Needs static sizes."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(compatible(x, y) for x, y in zip(a, b))
    if isinstance(a, tuple):
        return False
    size_b = product(b)
    return require_static(a, "compatible", "the shape") == require_static(size_b, "compatible", "the shape")


def crd2idx(crd: IntTuple, shape: IntTuple, stride: IntTuple | None = None) -> IntLike:
    """Map a coordinate to an index: ``sum(c_i * d_i)``.

    ``crd`` may be hierarchical (congruent to ``shape``) or an integer at any level, which is
    split colexicographically over that level's shape (the last mode is not bounded).
    ``None`` leaves of ``crd`` (sliced modes) contribute 0. ``stride`` defaults to the compact
    column-major strides of ``shape``.
    """
    if stride is None:
        stride = compact_col_major(shape)
    if crd is None:
        return 0
    if isinstance(crd, tuple):
        if not isinstance(shape, tuple) or len(crd) != len(shape) or len(shape) != rank(stride):
            raise LayoutError(f"crd2idx: coordinate {crd!r} does not match shape {shape!r}")
        result: IntLike = 0
        for c, s, d in zip(crd, shape, stride):
            result = arith.add(result, crd2idx(c, s, d))
        return result
    if isinstance(shape, tuple):
        if not isinstance(stride, tuple) or len(shape) != len(stride):
            raise LayoutError(f"crd2idx: shape {shape!r} and stride {stride!r} are not congruent")
        result = 0
        for s, d in zip(shape[:-1], stride[:-1]):
            size_s = product(s)
            result = arith.add(result, crd2idx(arith.mod(crd, size_s), s, d))
            crd = arith.floordiv(crd, size_s)
        return arith.add(result, crd2idx(crd, shape[-1], stride[-1]))
    if isinstance(stride, tuple):
        raise LayoutError(f"crd2idx: integer shape {shape!r} with tuple stride {stride!r}")
    return arith.mul(crd, stride)


def idx2crd(idx: IntTuple, shape: IntTuple, stride: IntTuple | None = None) -> IntTuple:
    """Split an index into a coordinate congruent to ``shape``: ``(idx // d_i) % s_i`` per leaf.

    Without ``stride`` this is the inverse of the compact column-major ``crd2idx`` (an integer
    ``shape`` returns ``idx`` unchanged). With a layout's strides it inverts compact layouts
    (CuTe ``Layout::get_hier_coord``).
    """
    if isinstance(idx, tuple):
        if not isinstance(shape, tuple) or len(idx) != len(shape):
            raise LayoutError(f"idx2crd: index {idx!r} does not match shape {shape!r}")
        strides = stride if stride is not None else (None,) * len(shape)
        return tuple(idx2crd(i, s, d) for i, s, d in zip(idx, shape, strides))
    if isinstance(shape, tuple):
        if stride is None:
            stride = compact_col_major(shape)
        if not isinstance(stride, tuple) or len(shape) != len(stride):
            raise LayoutError(f"idx2crd: shape {shape!r} and stride {stride!r} are not congruent")
        return tuple(idx2crd(idx, s, d) for s, d in zip(shape, stride))
    if stride is None:
        return idx
    if is_constant(shape, 1):
        return 0
    return arith.mod(arith.floordiv(idx, stride), shape)


def crd2crd(crd: IntTuple, src_shape: IntTuple, dst_shape: IntTuple) -> IntTuple:
    """Convert a coordinate of ``src_shape`` into the equivalent coordinate of ``dst_shape``."""
    if isinstance(crd, tuple) and isinstance(src_shape, tuple) and isinstance(dst_shape, tuple):
        if not len(crd) == len(src_shape) == len(dst_shape):
            raise LayoutError(f"crd2crd: ranks of {crd!r}, {src_shape!r}, {dst_shape!r} differ")
        return tuple(crd2crd(c, s, d) for c, s, d in zip(crd, src_shape, dst_shape))
    return idx2crd(crd2idx(crd, src_shape), dst_shape)


def has_none(crd: Any) -> bool:
    """True when ``None`` (CuTe's ``_``) appears at a leaf of ``crd``."""
    if isinstance(crd, tuple):
        return any(has_none(c) for c in crd)
    return crd is None


def _filter_by(crd: Any, t: IntTuple, keep_none: bool, op: str) -> Tuple[Any, ...]:
    if isinstance(crd, tuple):
        if not isinstance(t, tuple) or len(crd) != len(t):
            raise LayoutError(f"{op}: coordinate {crd!r} does not match {t!r}")
        return tuple(v for c, s in zip(crd, t) for v in _filter_by(c, s, keep_none, op))
    return (t,) if (crd is None) == keep_none else ()


def slice_(crd: Any, t: IntTuple) -> Tuple[Any, ...]:
    """Keep the parts of ``t`` paired with ``None`` in ``crd`` (CuTe ``slice``), as a flat-at-top tuple."""
    return _filter_by(crd, t, keep_none=True, op="slice")


def dice(crd: Any, t: IntTuple) -> Tuple[Any, ...]:
    """Keep the parts of ``t`` paired with a non-``None`` entry of ``crd`` (CuTe ``dice``)."""
    return _filter_by(crd, t, keep_none=False, op="dice")


def repeat_like(t: IntTuple, value: Any) -> IntTuple:
    """A tuple congruent to ``t`` with every leaf replaced by ``value``."""
    if isinstance(t, tuple):
        return tuple(repeat_like(e, value) for e in t)
    return value


def transform_leaf(t: IntTuple, fn: Callable[[Any], Any]) -> IntTuple:
    """Apply ``fn`` to every leaf of ``t``, keeping the profile."""
    if isinstance(t, tuple):
        return tuple(transform_leaf(e, fn) for e in t)
    return fn(t)
