"""CuTe layouts and the layout algebra.

A :class:`Layout` is a pair of congruent int tuples ``shape:stride`` and denotes the function
from coordinates to indices ``crd -> sum(crd_i * stride_i)``. A 1-D integer coordinate is
first split colexicographically over the shape, so every layout is also a function from
integers to integers on its domain ``[0, size)``.

The algebra follows CuTe (``include/cute/layout.hpp``) exactly: ``coalesce``, ``composition``,
``complement``, the inverses, and the divides / products that tile and partition layouts.
Shapes and strides may hold dynamic (traced) integers wherever CuTe allows them; operations
that must inspect a value (sorting strides, checking divisibility, ...) need static values and
raise :class:`~nvfly.layout.errors.LayoutError` otherwise. See :mod:`nvfly.layout.arith`.

A *tiler* (the second argument of ``composition``, the divides and the products) is a
``Layout``, an integer ``n`` (meaning the layout ``n:1``), ``None`` (leave the mode alone), or a
tuple of tilers applied mode by mode.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Tuple, Union

from nvfly.layout import arith
from nvfly.layout import int_tuple as it
from nvfly.layout.arith import IntLike, is_constant, is_static, require_static
from nvfly.layout.errors import LayoutError
from nvfly.layout.int_tuple import IntTuple

__all__ = [
    "Layout", "ComposedLayoutBase", "LayoutSlice", "LayoutLeft", "LayoutRight", "make_layout",
    "make_ordered_layout", "size", "cosize", "rank", "depth", "flatten", "coalesce", "filter_zeros",
    "filter", "composition", "complement", "right_inverse", "left_inverse", "max_common_vector",
    "logical_divide", "zipped_divide", "tiled_divide", "flat_divide", "logical_product",
    "zipped_product", "tiled_product", "flat_product", "blocked_product", "raked_product",
    "tile_to_shape", "slice_and_offset", "local_tile", "local_partition",
]


class _Major:
    """Tag selecting compact column-major (``LayoutLeft``) or row-major (``LayoutRight``) strides."""

    def __init__(self, name: str, strides: Callable[[IntTuple], IntTuple]):
        self._name = name
        self.strides = strides

    def __repr__(self) -> str:
        return self._name


#: Compact column-major strides (the default): the leftmost mode has stride 1.
LayoutLeft = _Major("LayoutLeft", it.compact_col_major)
#: Compact row-major strides: the rightmost mode has stride 1.
LayoutRight = _Major("LayoutRight", it.compact_row_major)


def _format(t: Any) -> str:
    if isinstance(t, tuple):
        return "(" + ",".join(_format(e) for e in t) + ")"
    return str(t)


def _check_leaves(t: IntTuple) -> IntTuple:
    for v in it.flatten(t):
        if isinstance(v, (Layout, ComposedLayoutBase)):
            raise LayoutError(f"Layout: a layout cannot be an extent or a stride (got {v}); "
                              "use make_layout(L0, L1, ...) to concatenate layouts")
    return t


@dataclass(frozen=True, eq=False, repr=False)
class Layout:
    """A CuTe layout ``shape:stride``.

    ``Layout(shape)`` uses compact column-major strides (static size-1 modes get stride 0, as in
    CuTe). Calling a layout maps a coordinate to an index: ``L(i)`` for a 1-D index, ``L(i, j)``
    or ``L((i, j))`` for a multi-dimensional one; a coordinate containing ``None`` slices the
    layout instead (like CuTe's ``_``) and returns the sub-layout of the kept modes.
    Equality and hashing are only defined for fully static layouts.
    """

    shape: IntTuple
    stride: IntTuple = None  # None: compact column-major (LayoutLeft)

    def __post_init__(self) -> None:
        shape = _check_leaves(it.as_int_tuple(self.shape, "Layout shape"))
        for s in it.flatten(shape):
            if is_static(s) and s < 1:
                raise LayoutError(f"Layout shape {_format(shape)}: static extents must be positive, got {s}")
        if self.stride is None:
            stride = it.compact_col_major(shape)
        else:
            stride = _check_leaves(it.as_int_tuple(self.stride, "Layout stride"))
        if not it.congruent(shape, stride):
            raise LayoutError(f"Layout: shape {_format(shape)} and stride {_format(stride)} are not congruent")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "stride", stride)

    # ------------------------------------------------------------------ structure
    @property
    def rank(self) -> int:
        """Number of top-level modes."""
        return it.rank(self.shape)

    @property
    def depth(self) -> int:
        """Nesting depth of the shape (0 for an integral shape)."""
        return it.depth(self.shape)

    def size(self) -> IntLike:
        """Size of the domain: the product of the shape."""
        return it.product(self.shape)

    def cosize(self) -> IntLike:
        """Size of the codomain: ``1 + max L(i)`` (strides taken in absolute value when static;
        dynamic strides are assumed non-negative)."""
        stride = it.transform_leaf(self.stride, lambda d: abs(d) if is_static(d) else d)
        return arith.add(it.crd2idx(arith.sub(self.size(), 1), self.shape, stride), 1)

    def is_static(self) -> bool:
        """True when every extent and stride is a Python ``int``."""
        return it.is_static_tuple(self.shape) and it.is_static_tuple(self.stride)

    def __len__(self) -> int:
        return self.rank

    def __getitem__(self, i: int) -> "Layout":
        """Sub-layout of mode ``i`` (mode 0 of an integral layout is the layout itself)."""
        if isinstance(self.shape, tuple):
            return Layout(self.shape[i], self.stride[i])
        if i not in (0, -1):
            raise IndexError(f"mode {i} out of range for the rank-1 layout {self}")
        return self

    def __iter__(self) -> Iterator["Layout"]:
        return (self[i] for i in range(self.rank))

    def get(self, *idx: int) -> "Layout":
        """Nested sub-layout: ``get(i, j) == self[i][j]``."""
        layout = self
        for i in idx:
            layout = layout[i]
        return layout

    # ------------------------------------------------------------------ mappings
    def __call__(self, *crd: Any) -> Any:
        """``crd2idx`` of the coordinate, or the slice when the coordinate contains ``None``."""
        if not crd:
            raise LayoutError("Layout(): a coordinate is required")
        c = crd[0] if len(crd) == 1 else tuple(crd)
        if it.has_none(c):
            return Layout(it.slice_(c, self.shape), it.slice_(c, self.stride))
        return it.crd2idx(c, self.shape, self.stride)

    def crd2idx(self, crd: IntTuple) -> IntLike:
        """Index of a (1-D or hierarchical) coordinate."""
        return it.crd2idx(crd, self.shape, self.stride)

    def idx2crd(self, idx: IntLike) -> IntTuple:
        """Hierarchical coordinate of an index in the codomain (``(idx // d) % s`` per leaf;
        the inverse of the layout for compact layouts). CuTe ``get_hier_coord``."""
        return it.idx2crd(idx, self.shape, self.stride)

    get_hier_coord = idx2crd

    def get_flat_coord(self, idx: IntLike) -> IntTuple:
        """Like :meth:`idx2crd`, with each top-level mode's coordinate flattened to a 1-D index."""
        hier = self.idx2crd(idx)
        if isinstance(self.shape, tuple):
            return tuple(it.crd2idx(c, s) for c, s in zip(hier, self.shape))
        return hier

    def compose(self, *tilers: Any) -> "Layout":
        """``composition(self, tiler)``; several arguments form a by-mode tiler."""
        return composition(self, tilers[0] if len(tilers) == 1 else tuple(tilers))

    def with_shape(self, *shape: Any) -> "Layout":
        """Reinterpret the domain with a new shape: ``composition(self, Layout(shape))``."""
        return composition(self, Layout(shape[0] if len(shape) == 1 else tuple(shape)))

    # ------------------------------------------------------------------ printing / comparison
    def __str__(self) -> str:
        return f"{_format(self.shape)}:{_format(self.stride)}"

    def __repr__(self) -> str:
        return f"Layout({self.shape!r}, {self.stride!r})"

    def _require_static(self, op: str) -> None:
        if not self.is_static():
            raise LayoutError(f"{op} is only defined for static layouts, {self} has dynamic extents or strides")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        self._require_static("Layout equality")
        other._require_static("Layout equality")
        return self.shape == other.shape and self.stride == other.stride

    def __hash__(self) -> int:
        self._require_static("Layout hashing")
        return hash((self.shape, self.stride))


class ComposedLayoutBase(ABC):
    """Interface of layouts that wrap an inner :class:`Layout` (e.g. a swizzled ``ComposedLayout``).

    The divides, products, ``composition`` with a tiler, ``tile_to_shape`` and the partitioning
    helpers act on the inner layout through :meth:`map_inner`.
    """

    @abstractmethod
    def map_inner(self, fn: Callable[[Layout], Layout]) -> "ComposedLayoutBase":
        """The same wrapper around ``fn(inner layout)``."""

    @abstractmethod
    def slice_and_offset(self, crd: Any) -> "LayoutSlice":
        """Slice the inner layout at ``crd`` (``None`` keeps a mode)."""


AnyLayout = Union[Layout, ComposedLayoutBase]


class LayoutSlice(NamedTuple):
    """A sub-layout and the offset of its origin: the result of slicing / partitioning."""

    layout: AnyLayout
    offset: IntLike


def _as_tiler_layout(tiler: Any, op: str) -> Layout:
    """A non-tuple tiler as a layout: a ``Layout`` as is, an integer ``n`` as ``n:1``."""
    if isinstance(tiler, Layout):
        return tiler
    if isinstance(tiler, ComposedLayoutBase) or not it.is_int(tiler):
        raise LayoutError(f"{op}: expected a Layout, an integer or a tuple of those as tiler, got {tiler!r}")
    return Layout(tiler)


# ---------------------------------------------------------------------- construction

def make_layout(*args: Any) -> Layout:
    """Build a layout.

    * ``make_layout(shape)`` / ``make_layout(shape, stride)``;
    * ``make_layout(shape, LayoutLeft | LayoutRight)``: compact column- / row-major;
    * ``make_layout(L0, L1, ...)``: concatenation of layouts, each one becoming a mode.
    """
    if args and all(isinstance(a, Layout) for a in args):
        return Layout(tuple(a.shape for a in args), tuple(a.stride for a in args))
    if len(args) == 1:
        return Layout(args[0])
    if len(args) == 2:
        shape, stride = args
        if isinstance(stride, _Major):
            return Layout(shape, stride.strides(shape))
        return Layout(shape, stride)
    raise LayoutError(f"make_layout: expected (shape[, stride]) or layouts, got {args!r}")


def make_ordered_layout(shape: IntTuple, order: Any = LayoutLeft) -> Layout:
    """Compact layout whose strides follow ``order``: ``LayoutLeft`` (or ``None``), ``LayoutRight``,
    or a static int tuple congruent to ``shape`` giving the rank of each mode (lower = smaller stride)."""
    shape = it.as_int_tuple(shape, "make_ordered_layout shape")
    if order is None:
        order = LayoutLeft
    if isinstance(order, _Major):
        return Layout(shape, order.strides(shape))
    return Layout(shape, it.compact_order(shape, order))


def _append_to_rank(layout: Layout, r: int) -> Layout:
    """Pad ``layout`` with ``1:0`` modes up to rank ``r``."""
    if layout.rank >= r:
        return layout
    shape = layout.shape if isinstance(layout.shape, tuple) else (layout.shape,)
    stride = layout.stride if isinstance(layout.stride, tuple) else (layout.stride,)
    pad = r - len(shape)
    return Layout(shape + (1,) * pad, stride + (0,) * pad)


# ---------------------------------------------------------------------- queries

def size(x: Any) -> IntLike:
    """Size of a layout's domain, or the product of an int tuple."""
    if isinstance(x, (Layout, ComposedLayoutBase)):
        return x.size()
    return it.product(x)


def cosize(layout: AnyLayout) -> IntLike:
    """Size of a layout's codomain."""
    return layout.cosize()


def rank(x: Any) -> int:
    """Number of top-level modes of a layout or int tuple."""
    if isinstance(x, (Layout, ComposedLayoutBase)):
        return x.rank
    return it.rank(x)


def depth(x: Any) -> int:
    """Nesting depth of a layout's shape or of an int tuple."""
    if isinstance(x, (Layout, ComposedLayoutBase)):
        return x.depth
    return it.depth(x)


def flatten(x: Any) -> Any:
    """Flatten a layout (depth <= 1, same function) or an int tuple."""
    if isinstance(x, Layout):
        return Layout(it.flatten(x.shape), it.flatten(x.stride))
    return it.flatten(x)


# ---------------------------------------------------------------------- coalesce / filter

def _bw_coalesce(old_shape: Sequence[Any], old_stride: Sequence[Any],
                 new_shape: IntLike, new_stride: IntLike) -> Layout:
    """Fold flat modes, back to front, onto the front of the stack ``new_shape:new_stride``.

    A static size-1 mode is dropped; ``s0:d0`` followed by ``s1:s0*d0`` merges into ``s0*s1:d0``
    (only when provably equal, i.e. static); otherwise the mode is prepended.
    """
    shapes, strides = [new_shape], [new_stride]
    for s, d in zip(reversed(old_shape), reversed(old_stride)):
        if is_constant(s, 1):
            continue
        if len(shapes) == 1 and is_constant(shapes[0], 1):
            shapes[0], strides[0] = s, d
            continue
        # s*d, only when known at trace time: never emit an op just to compare it.
        extent = 0 if is_constant(d, 0) else (s * d if is_static(s) and is_static(d) else None)
        if extent is not None and is_static(shapes[0]) and is_static(strides[0]) and extent == strides[0]:
            shapes[0], strides[0] = arith.mul(s, shapes[0]), d
        else:
            shapes.insert(0, s)
            strides.insert(0, d)
    if len(shapes) == 1:
        return Layout(1, 0) if is_constant(shapes[0], 1) else Layout(shapes[0], strides[0])
    return Layout(tuple(shapes), tuple(strides))


def _by_mode(op: str, layout: Layout, profile: Tuple[Any, ...], fn: Callable[[Layout, Any], Layout],
             keep_rest: bool = True) -> Layout:
    if len(profile) > layout.rank:
        raise LayoutError(f"{op}: the profile/tiler {profile!r} has more modes than the layout {layout}")
    modes = [fn(layout[i], p) for i, p in enumerate(profile)]
    if keep_rest:
        modes += [layout[i] for i in range(len(profile), layout.rank)]
    return make_layout(*modes)


def coalesce(layout: Layout, profile: Any = None) -> Layout:
    """Simplify ``layout`` to the fewest modes with the same function on ``[0, size)``.

    The result has depth <= 1. With a tuple ``profile`` coalescing is applied per mode at the
    leaves of the profile (``coalesce(((2,(1,6)):(1,(6,2))), (1,1)) == (2,6):(1,2)``).
    """
    if isinstance(profile, tuple):
        return _by_mode("coalesce", layout, profile, coalesce)
    flat_shape, flat_stride = it.flatten(layout.shape), it.flatten(layout.stride)
    return _bw_coalesce(flat_shape[:-1], flat_stride[:-1], flat_shape[-1], flat_stride[-1])


def _coalesce_x(layout: Layout) -> Layout:
    """Coalesce preserving the function also outside the domain (CuTe ``detail::coalesce_x``)."""
    flat_shape, flat_stride = it.flatten(layout.shape), it.flatten(layout.stride)
    last = 2 if is_constant(flat_shape[-1], 1) else flat_shape[-1]
    return _bw_coalesce(flat_shape[:-1], flat_stride[:-1], last, flat_stride[-1])


def filter_zeros(layout: Layout) -> Layout:
    """Replace the extent of every static stride-0 mode by 1."""
    def zero_out(s: IntTuple, d: IntTuple) -> IntTuple:
        if isinstance(s, tuple):
            return tuple(zero_out(x, y) for x, y in zip(s, d))
        return 1 if is_constant(d, 0) else s

    return Layout(zero_out(layout.shape, layout.stride), layout.stride)


def filter(layout: Layout, profile: Any = None) -> Layout:  # noqa: A001 - CuTe's name
    """Remove stride-0 and size-1 modes and coalesce: the layout of the distinct elements."""
    if isinstance(profile, tuple):
        return _by_mode("filter", layout, profile, filter)
    return coalesce(filter_zeros(layout))


# ---------------------------------------------------------------------- composition

def _composition_impl(lshape: IntTuple, lstride: IntTuple, rshape: IntTuple, rstride: IntTuple) -> Layout:
    """``A o B`` for a flat, coalesced ``A = lshape:lstride`` (CuTe ``detail::composition_impl``)."""
    if isinstance(rshape, tuple):
        return make_layout(*(_composition_impl(lshape, lstride, s, d) for s, d in zip(rshape, rstride)))
    if is_constant(rstride, 0):
        return Layout(rshape, rstride)
    if not isinstance(lshape, tuple):
        return Layout(rshape, arith.mul(rstride, lstride))

    def mod_out(shapes: Sequence[Any], rest_shape: IntLike) -> Tuple[list, IntLike]:
        # Keep the first rest_shape elements: shape (s0, s1, ...) % rest_shape.
        kept = []
        for s in shapes:
            kept.append(it.shape_min(s, rest_shape, "composition"))
            rest_shape = it.shape_div(rest_shape, s, "composition")
        return kept, rest_shape

    if is_constant(rstride, 1):
        shape_1, rest_shape = mod_out(lshape[:-1], rshape)
        return _bw_coalesce(shape_1, lstride[:-1], rest_shape, lstride[-1])

    # Divide out the stride: every rstride-th element of A.
    shape_1, rest_stride = [], rstride
    for s in lshape[:-1]:
        shape_1.append(it.shape_div(s, rest_stride, "composition"))
        rest_stride = it.shape_div(rest_stride, s, "composition")
    stride_1 = [arith.mul(d, it.shape_div(s0, s1, "composition")) for d, s0, s1 in zip(lstride[:-1], lshape[:-1], shape_1)]
    shape_2, rest_shape = mod_out(shape_1, rshape)
    return _bw_coalesce(shape_2, stride_1, rest_shape, arith.mul(rest_stride, lstride[-1]))


def composition(lhs: AnyLayout, rhs: Any) -> Any:
    """Functional composition ``R = lhs o rhs``: ``R(c) == lhs(rhs(c))`` for every ``c`` in
    ``rhs``'s domain, with ``shape(R)`` compatible with ``shape(rhs)``.

    ``rhs`` may be a tiler: a tuple composes mode by mode (modes of ``lhs`` beyond the tiler are
    dropped, as in CuTe), an integer ``n`` means ``n:1`` and ``None`` keeps the mode. Raises
    :class:`LayoutError` when the stride/shape divisibility conditions fail.
    """
    if rhs is None:
        return lhs
    if isinstance(lhs, ComposedLayoutBase):
        return lhs.map_inner(lambda inner: composition(inner, rhs))
    if isinstance(rhs, tuple):
        return _by_mode("composition", lhs, rhs, composition, keep_rest=False)
    rhs = _as_tiler_layout(rhs, "composition")
    flat = _coalesce_x(lhs)
    return _composition_impl(flat.shape, flat.stride, rhs.shape, rhs.stride)


# ---------------------------------------------------------------------- complement / inverses

def complement(layout: Layout, cotarget: Any = None) -> Layout:
    """The layout of the "rest" of ``layout`` up to ``cotarget``.

    The result ``R`` is ordered (increasing strides), its image is disjoint from the image of
    ``layout`` (except 0) and ``(layout, R)`` covers ``[0, size(cotarget))`` when ``layout``
    tiles it. ``cotarget`` is an integer or a shape (whose static factors keep the result
    static); it defaults to ``cosize(layout)``. Needs static strides when the filtered layout
    has more than one mode.
    """
    filt = filter(layout)
    if cotarget is None:
        cotarget = filt.cosize()
    elif isinstance(cotarget, Layout):
        cotarget = cotarget.shape
    if is_constant(filt.stride, 0):
        return Layout(it.coalesce_shape(cotarget))
    shapes = list(it.flatten(filt.shape))
    strides = list(it.flatten(filt.stride))
    if len(strides) > 1:
        for d in strides:
            require_static(d, "complement", f"every stride of {layout}")
    result_shape: list = []
    result_stride: list = [1]
    while True:
        i = strides.index(min(strides)) if len(strides) > 1 else 0
        new_shape = arith.floordiv(strides[i], result_stride[-1])
        if is_constant(new_shape, 0):
            raise LayoutError(f"complement: {layout} is not injective, or one of its strides is smaller than "
                              "the extent of the mode with the next smaller stride")
        result_shape.append(new_shape)
        new_stride = arith.mul(strides[i], shapes[i])
        del strides[i], shapes[i]
        if not strides:
            break
        result_stride.append(new_stride)
    rest_shape = it.coalesce_shape(it.ceil_div(cotarget, new_stride))
    rest_stride = it.compact_col_major(rest_shape, new_stride)
    return coalesce(Layout((*result_shape, rest_shape), (*result_stride, rest_stride)))


def right_inverse(layout: Optional[Layout]) -> Optional[Layout]:
    """A layout ``R`` with ``layout(R(i)) == i`` for all ``i < size(R)`` (the largest such
    compact chain, found from stride 1). Static layouts only."""
    if layout is None:
        return None
    flat = coalesce(layout)
    flat._require_static("right_inverse")
    shapes = it.flatten(flat.shape)
    strides = it.flatten(flat.stride)
    rstride = it.compact_col_major(shapes)
    astride = [abs(d) for d in strides]
    chosen: list = []
    next_stride = 1
    while next_stride in astride:
        i = astride.index(next_stride)
        chosen.append(i)
        next_stride = shapes[i] * astride[i]
    if not chosen:
        return Layout(1, 0)
    r_shape = tuple(shapes[i] for i in chosen)
    r_stride = tuple((1 if strides[i] > 0 else -1) * rstride[i] for i in chosen)
    if len(chosen) == 1:
        return Layout(r_shape[0], r_stride[0])
    return Layout(r_shape, r_stride)


def left_inverse(layout: Optional[Layout]) -> Optional[Layout]:
    """A layout ``L`` with ``L(layout(i)) == i`` for all ``i < size(layout)``, for an injective
    static layout: ``right_inverse(make_layout(layout, complement(layout)))``."""
    if layout is None:
        return None
    return right_inverse(make_layout(layout, complement(layout)))


def max_common_vector(a: Layout, b: Layout) -> int:
    """Largest ``n`` such that the first ``n`` elements of the codomain of ``b`` correspond to
    the same logical coordinates in ``a`` (contiguous in both): the safe vector width."""
    common = coalesce(composition(a, right_inverse(b)))
    shape0, stride0 = it.get(common.shape, 0), it.get(common.stride, 0)
    if is_static(shape0) and is_constant(stride0, 1):
        return shape0
    return 1


# ---------------------------------------------------------------------- divide

def logical_divide(layout: AnyLayout, tiler: Any) -> Any:
    """Split ``layout`` by ``tiler``: ``layout o (tiler, complement(tiler, shape(layout)))``.

    Mode 0 of the result holds the elements selected by the tiler (the tile), mode 1 iterates
    over the tiles. A tuple tiler divides mode by mode (other modes are kept):
    ``((TileM,RestM), (TileN,RestN), L, ...)``.
    """
    if tiler is None:
        return layout
    if isinstance(layout, ComposedLayoutBase):
        return layout.map_inner(lambda inner: logical_divide(inner, tiler))
    if isinstance(tiler, tuple):
        return _by_mode("logical_divide", layout, tiler, logical_divide)
    tiler = _as_tiler_layout(tiler, "logical_divide")
    return composition(layout, make_layout(tiler, complement(tiler, layout.shape)))


def _tile_unzip(layout: Layout, tiler: Any) -> Layout:
    """Gather the (tile, rest) pairs found at the leaves of ``tiler`` into ``((tiles...), (rests..., extra...))``."""
    if not isinstance(tiler, tuple):
        if tiler is None:
            return make_layout(Layout(1, 0), layout)
        return layout
    if len(tiler) > layout.rank:
        raise LayoutError(f"tiler {tiler!r} has more modes than the layout {layout}")
    split = [_tile_unzip(layout[i], t) for i, t in enumerate(tiler)]
    tiles = make_layout(*(s[0] for s in split))
    rests = make_layout(*(s[1] for s in split), *(layout[i] for i in range(len(tiler), layout.rank)))
    return make_layout(tiles, rests)


def _modes(layout: Layout) -> list:
    return list(layout) if isinstance(layout.shape, tuple) else [layout]


def zipped_divide(layout: AnyLayout, tiler: Any) -> Any:
    """``logical_divide`` with the tiles gathered in mode 0 and the rests in mode 1:
    ``((TileM,TileN), (RestM,RestN,L,...))``."""
    if isinstance(layout, ComposedLayoutBase):
        return layout.map_inner(lambda inner: zipped_divide(inner, tiler))
    return _tile_unzip(logical_divide(layout, tiler), tiler)


def tiled_divide(layout: AnyLayout, tiler: Any) -> Any:
    """``zipped_divide`` with the rest mode unpacked: ``((TileM,TileN), RestM, RestN, L, ...)``."""
    if isinstance(layout, ComposedLayoutBase):
        return layout.map_inner(lambda inner: tiled_divide(inner, tiler))
    result = zipped_divide(layout, tiler)
    return make_layout(result[0], *_modes(result[1]))


def flat_divide(layout: AnyLayout, tiler: Any) -> Any:
    """``zipped_divide`` with both modes unpacked: ``(TileM, TileN, RestM, RestN, L, ...)``."""
    if isinstance(layout, ComposedLayoutBase):
        return layout.map_inner(lambda inner: flat_divide(inner, tiler))
    result = zipped_divide(layout, tiler)
    return make_layout(*_modes(result[0]), *_modes(result[1]))


# ---------------------------------------------------------------------- product

def logical_product(block: AnyLayout, tiler: Any) -> Any:
    """Reproduce ``block`` over ``tiler``: ``(block, complement(block, size(block)*cosize(tiler)) o tiler)``.

    Mode 0 is the block, mode 1 the arrangement of its copies. A tuple tiler multiplies mode by
    mode.
    """
    if tiler is None:
        return block
    if isinstance(block, ComposedLayoutBase):
        return block.map_inner(lambda inner: logical_product(inner, tiler))
    if isinstance(tiler, tuple):
        return _by_mode("logical_product", block, tiler, logical_product)
    tiler = _as_tiler_layout(tiler, "logical_product")
    rest = complement(block, arith.mul(block.size(), tiler.cosize()))
    return make_layout(block, composition(rest, tiler))


def zipped_product(block: AnyLayout, tiler: Any) -> Any:
    """``logical_product`` gathered as ``((M,N), (TileM,TileN,L,...))``."""
    if isinstance(block, ComposedLayoutBase):
        return block.map_inner(lambda inner: zipped_product(inner, tiler))
    return _tile_unzip(logical_product(block, tiler), tiler)


def tiled_product(block: AnyLayout, tiler: Any) -> Any:
    """``zipped_product`` with mode 1 unpacked: ``((M,N), TileM, TileN, L, ...)``."""
    if isinstance(block, ComposedLayoutBase):
        return block.map_inner(lambda inner: tiled_product(inner, tiler))
    result = zipped_product(block, tiler)
    return make_layout(result[0], *_modes(result[1]))


def flat_product(block: AnyLayout, tiler: Any) -> Any:
    """``zipped_product`` with both modes unpacked: ``(M, N, TileM, TileN, L, ...)``."""
    if isinstance(block, ComposedLayoutBase):
        return block.map_inner(lambda inner: flat_product(inner, tiler))
    result = zipped_product(block, tiler)
    return make_layout(*_modes(result[0]), *_modes(result[1]))


def _rank_sensitive_product(block: Layout, tiler: Any, block_first: bool) -> Layout:
    tiler = _as_tiler_layout(tiler, "blocked_product" if block_first else "raked_product")
    r = max(block.rank, tiler.rank)
    result = logical_product(_append_to_rank(block, r), _append_to_rank(tiler, r))
    first, second = (result[0], result[1]) if block_first else (result[1], result[0])
    zipped = make_layout(*(make_layout(first[i], second[i]) for i in range(r)))
    return coalesce(zipped, (1,) * r)


def blocked_product(block: AnyLayout, tiler: Layout) -> Any:
    """Tile ``block`` as contiguous blocks arranged by ``tiler``, mode by mode:
    mode ``i`` of the result is ``(block_i, tiler_i)`` (then coalesced per mode). Rank-sensitive:
    the result has rank ``max(rank(block), rank(tiler))``."""
    if isinstance(block, ComposedLayoutBase):
        return block.map_inner(lambda inner: blocked_product(inner, tiler))
    return _rank_sensitive_product(block, tiler, block_first=True)


def raked_product(block: AnyLayout, tiler: Layout) -> Any:
    """Like :func:`blocked_product` but interleaving (raking) the copies of ``block``:
    mode ``i`` of the result is ``(tiler_i, block_i)`` (a cyclic distribution)."""
    if isinstance(block, ComposedLayoutBase):
        return block.map_inner(lambda inner: raked_product(inner, tiler))
    return _rank_sensitive_product(block, tiler, block_first=False)


def tile_to_shape(block: AnyLayout, trg_shape: IntTuple, order: Any = LayoutLeft) -> Any:
    """Repeat ``block`` (e.g. a swizzle atom) to fill ``trg_shape``; the copies are arranged in
    ``order`` (``LayoutLeft``, ``LayoutRight`` or a per-mode order tuple). Each mode of
    ``trg_shape`` must be a multiple of the block's extent in that mode."""
    if isinstance(block, ComposedLayoutBase):
        return block.map_inner(lambda inner: tile_to_shape(inner, trg_shape, order))
    trg_shape = it.as_int_tuple(trg_shape, "tile_to_shape target shape")
    r = it.rank(trg_shape)
    if block.rank > r:
        raise LayoutError(f"tile_to_shape: block {block} has more modes than the target shape {_format(trg_shape)}")
    padded = _append_to_rank(block, r)
    block_shape = it.product_each(padded.shape)
    target_shape = it.product_each(trg_shape)
    for t, b in zip(target_shape, block_shape):
        if is_static(t) and is_static(b) and t % b != 0:
            raise LayoutError(f"tile_to_shape: block shape {_format(block_shape)} does not divide "
                              f"the target shape {_format(target_shape)}")
    product_shape = it.ceil_div(target_shape, block_shape)
    return coalesce(blocked_product(padded, make_ordered_layout(product_shape, order)), product_shape)


# ---------------------------------------------------------------------- slicing / partitioning

def slice_and_offset(crd: Any, layout: AnyLayout) -> LayoutSlice:
    """Slice ``layout`` at ``crd`` (``None`` keeps a mode): the sub-layout of the kept modes and
    the index of the fixed coordinates."""
    if isinstance(layout, ComposedLayoutBase):
        return layout.slice_and_offset(crd)
    return LayoutSlice(Layout(it.slice_(crd, layout.shape), it.slice_(crd, layout.stride)),
                       it.crd2idx(crd, layout.shape, layout.stride))


def _fit_coord(coord: Any, mode_shape: IntTuple, op: str) -> Any:
    """Pad a tuple coordinate with ``None`` up to the rank of ``mode_shape`` (CuTe ``append<R>(coord, _)``)."""
    if not isinstance(coord, tuple):
        return coord
    if not isinstance(mode_shape, tuple):
        if len(coord) != 1:
            raise LayoutError(f"{op}: coordinate {coord!r} has more modes than {_format(mode_shape)}")
        return coord[0]
    if len(coord) > len(mode_shape):
        raise LayoutError(f"{op}: coordinate {coord!r} has more modes than {_format(mode_shape)}")
    return coord + (None,) * (len(mode_shape) - len(coord))


def _dice_layout(proj: Any, layout: Layout) -> Layout:
    return Layout(it.dice(proj, layout.shape), it.dice(proj, layout.stride))


def local_tile(layout: AnyLayout, tiler: Any, coord: Any, proj: Any = None) -> LayoutSlice:
    """The tile of ``layout`` at tile coordinate ``coord`` (CuTe ``local_tile`` / ``inner_partition``).

    ``zipped_divide(layout, tiler)`` is sliced with the whole tile mode kept and ``coord``
    indexing the rest mode (a tuple ``coord`` may contain ``None`` to keep a rest mode, and is
    padded with ``None``; an integer indexes the rest mode 1-D). ``proj`` (a tuple of 1/None)
    first drops the tiler and coordinate modes marked ``None`` (CuTe ``Step<_1,X,_1>``).
    ``coord`` may be dynamic: the offset is then emitted with the arith helpers.

    Returns ``LayoutSlice(tile_layout, offset)``.
    """
    if proj is not None:
        tiler, coord = it.dice(proj, tiler), it.dice(proj, coord)
    tiled = zipped_divide(layout, tiler)
    r0 = rank(tiled[0])
    tile_crd = (None,) * r0 if r0 > 1 else None
    return slice_and_offset((tile_crd, _fit_coord(coord, tiled[1].shape, "local_tile")), tiled)


def local_partition(layout: AnyLayout, thread_layout: Layout, thread_idx: IntLike, proj: Any = None) -> LayoutSlice:
    """The elements of ``layout`` owned by thread ``thread_idx`` (CuTe ``local_partition``).

    ``layout`` is divided by the shape of ``thread_layout`` (one element per thread per tile);
    the thread's coordinate in that tile is ``thread_layout.get_flat_coord(thread_idx)`` (so
    the thread layout's strides give the thread order) and the result keeps the rest modes:
    the layout of the elements this thread owns, plus the offset of its first one.
    ``thread_idx`` may be dynamic. ``proj`` drops thread-layout modes marked ``None``.

    Returns ``LayoutSlice(thread_layout_of_values, offset)``.
    """
    if proj is not None:
        thread_layout = _dice_layout(proj, thread_layout)
    tiler = it.product_each(thread_layout.shape)
    coord = thread_layout.get_flat_coord(thread_idx)
    tiled = zipped_divide(layout, tiler)
    r1 = rank(tiled[1])
    rest_crd = (None,) * r1 if r1 > 1 else None
    return slice_and_offset((_fit_coord(coord, tiled[0].shape, "local_partition"), rest_crd), tiled)
