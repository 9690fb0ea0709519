"""Tensors = engine + layout (CuTe's idea): a base in global or shared memory, or registers, viewed through a
layout from ``nvfly.layout``.

``t[coord]`` reads, ``t[coord] = v`` writes, ``t[None, 3]`` slices (``None`` keeps a mode, like CuTe's
``_``), ``t.tile(tiler, coord)`` and ``t.partition(thread_layout, idx)`` give the part one block or thread
owns. Offsets are computed by the layout: static parts fold at trace time, dynamic ones emit the fewest ops.
Register fragments (``make_fragment``) are Python lists of traced values indexed by static coordinates.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

from mlir import ir

from nvfly.errors import CompileError
from nvfly.frontend.dtypes import DType
from nvfly.frontend.tensor import Tensor, gep
from nvfly.frontend.values import Scalar, Vector, as_value
from nvfly.layout.layout import Layout, local_partition, local_tile, slice_and_offset
from nvfly.layout.swizzle import ComposedLayout

AnyLayout = Union[Layout, ComposedLayout]


class LayoutTensor:
    """Memory (``base``: a frontend Tensor giving pointer, dtype, space, alignment) viewed through ``layout``,
    starting ``offset`` elements in."""

    def __init__(self, base: Tensor, layout: AnyLayout, offset: Any = 0):
        self.base = base
        self.layout = layout
        self.offset = offset

    @property
    def dtype(self) -> DType:
        return self.base.dtype

    @property
    def shape(self) -> Any:
        return self.layout.shape

    def __repr__(self) -> str:
        return f"LayoutTensor<{self.base.space} {self.dtype.name} {self.layout}>"

    def element_offset(self, coord: Any) -> Any:
        """The element offset of ``coord`` from the base (a ComposedLayout applies its swizzle to its own
        offset plus the inner layout's, so slices of swizzled layouts keep their offset inside)."""
        return _add(self.layout(coord), self.offset)

    def _flat(self, off: Any) -> Tensor:
        return Tensor(gep(self.base.ptr, off, self.dtype), self.dtype, (1,), (1,), self.base.space,
                      _align_of(self.base.align, off, self.dtype.itemsize), self.base.index_dtype)

    def __getitem__(self, coord: Any) -> Any:
        if _has_none(coord):
            sub = slice_and_offset(coord, self.layout)
            return LayoutTensor(self.base, sub.layout, _add(self.offset, sub.offset))
        return self._flat(self.element_offset(coord)).load(0)

    def __setitem__(self, coord: Any, value: Any) -> None:
        self._flat(self.element_offset(coord)).store(as_value(value, self.dtype), 0)

    def load_vector(self, coord: Any, width: int) -> Vector:
        """``width`` consecutive elements starting at ``coord`` (the layout must keep them contiguous)."""
        return self._flat(self.element_offset(coord)).load(0, width=width)

    def store_vector(self, coord: Any, value: Vector) -> None:
        self._flat(self.element_offset(coord)).store(value, 0)

    def tile(self, tiler: Any, coord: Any) -> "LayoutTensor":
        """The tile at ``coord`` of this tensor divided by ``tiler`` (CuTe ``local_tile``)."""
        part = local_tile(self.layout, tiler, coord)
        return LayoutTensor(self.base, part.layout, _add(self.offset, part.offset))

    def partition(self, thread_layout: Layout, thread_idx: Any) -> "LayoutTensor":
        """The elements thread ``thread_idx`` owns when ``thread_layout`` threads tile this tensor."""
        part = local_partition(self.layout, thread_layout, thread_idx)
        return LayoutTensor(self.base, part.layout, _add(self.offset, part.offset))


def layout_of(t: Tensor) -> Layout:
    """A frontend tensor's own layout: its shape and strides."""
    return Layout(t.shape, t.stride)


def make_tensor(base: Tensor, layout: Optional[AnyLayout] = None) -> LayoutTensor:
    """View ``base`` (a global or shared Tensor) through ``layout`` (default: its own, ``layout_of(base)``)."""
    if not isinstance(base, Tensor):
        raise CompileError(f"make_tensor takes a global or shared tensor, got {type(base).__name__}")
    return LayoutTensor(base, layout_of(base) if layout is None else layout)


class Fragment:
    """Registers: one traced value per coordinate of a static layout (built by ``make_fragment``)."""

    def __init__(self, layout: Layout, dtype: DType, values: list[Any]):
        if not layout.is_static():
            raise CompileError(f"a register fragment needs a static layout, got {layout}")
        self.layout = layout
        self.dtype = dtype
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def _index(self, coord: Any) -> int:
        idx = self.layout(coord)
        if not isinstance(idx, int):
            raise CompileError("register fragments are indexed with static coordinates (use nvfly.static_range)")
        return idx

    def __getitem__(self, coord: Any) -> Any:
        return self.values[self._index(coord)]

    def __setitem__(self, coord: Any, value: Any) -> None:
        self.values[self._index(coord)] = as_value(value, self.dtype)

    def __nvfly_flatten__(self) -> tuple[list[ir.Value], Callable[[Sequence[ir.Value]], "Fragment"]]:
        layout, dtype = self.layout, self.dtype
        vals = [as_value(v, dtype).value for v in self.values]
        return vals, lambda vs: Fragment(layout, dtype, [Scalar(v, dtype) for v in vs])


def make_fragment(layout: Layout, dtype: DType, fill: Any = 0) -> Fragment:
    """A register fragment of ``layout``'s cosize elements, all ``fill``."""
    n = layout.cosize()
    return Fragment(layout, dtype, [as_value(fill, dtype) for _ in range(n)])


def _has_none(coord: Any) -> bool:
    if coord is None:
        return True
    if isinstance(coord, tuple):
        return any(_has_none(c) for c in coord)
    return False


def _is_zero(x: Any) -> bool:
    return isinstance(x, int) and x == 0


def _add(a: Any, b: Any) -> Any:
    if _is_zero(a):
        return b
    if _is_zero(b):
        return a
    return a + b


def _align_of(base_align: int, offset: Any, itemsize: int) -> int:
    import math
    div = offset if isinstance(offset, int) else offset.divisor
    return math.gcd(base_align, (abs(div) or (1 << 12)) * itemsize) if div else base_align

