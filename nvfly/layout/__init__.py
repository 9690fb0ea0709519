"""CuTe-style layout algebra (pure Python, static and traced integers).

* :mod:`~nvfly.layout.int_tuple` — hierarchical int tuples, ``crd2idx`` / ``idx2crd``.
* :mod:`~nvfly.layout.arith` — integer helpers that fold static values and emit minimal ops.
* :mod:`~nvfly.layout.layout` — :class:`Layout` and the algebra (composition, complement,
  inverses, divides, products, ``local_tile`` / ``local_partition``).
* :mod:`~nvfly.layout.swizzle` — :class:`Swizzle`, :class:`ComposedLayout`, GMMA smem atoms.
"""
from nvfly.layout.arith import is_dynamic, is_static
from nvfly.layout.errors import LayoutError
from nvfly.layout.int_tuple import (
    ceil_div, compatible, congruent, crd2idx, idx2crd, inner_product, prefix_product, product,
    product_each, shape_div, weakly_congruent,
)
from nvfly.layout.layout import (
    ComposedLayoutBase, Layout, LayoutLeft, LayoutRight, LayoutSlice, blocked_product, coalesce,
    complement, composition, cosize, depth, filter, filter_zeros, flat_divide, flat_product, flatten, left_inverse,
    local_partition, local_tile, logical_divide, logical_product, make_layout, make_ordered_layout,
    max_common_vector, rank, raked_product, right_inverse, size, slice_and_offset, tile_to_shape,
    tiled_divide, tiled_product, zipped_divide, zipped_product,
)
from nvfly.layout.swizzle import ComposedLayout, Swizzle, make_swizzle_atom

__all__ = [
    "LayoutError", "is_static", "is_dynamic",
    "ceil_div", "compatible", "congruent", "crd2idx", "idx2crd", "inner_product", "prefix_product",
    "product", "product_each", "shape_div", "weakly_congruent",
    "Layout", "ComposedLayoutBase", "LayoutLeft", "LayoutRight", "LayoutSlice", "make_layout",
    "make_ordered_layout", "size", "cosize", "rank", "depth", "flatten", "coalesce", "filter", "filter_zeros",
    "composition", "complement", "right_inverse", "left_inverse", "max_common_vector",
    "logical_divide", "zipped_divide", "tiled_divide", "flat_divide", "logical_product",
    "zipped_product", "tiled_product", "flat_product", "blocked_product", "raked_product",
    "tile_to_shape", "slice_and_offset", "local_tile", "local_partition",
    "Swizzle", "ComposedLayout", "make_swizzle_atom",
]
