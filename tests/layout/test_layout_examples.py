"""Known results from the CuTe documentation (media/docs/cpp/cute/02_layout_algebra.md and the
earlier media/docs/cute/02_layout_algebra.md) and CuTe's layout.hpp comments."""
from __future__ import annotations

import pytest

from nvfly.layout import (
    Layout, LayoutError, LayoutLeft, LayoutRight, blocked_product, coalesce, complement, composition,
    cosize, depth, filter, flat_divide, flat_product, flatten, left_inverse, local_partition, local_tile,
    logical_divide, logical_product, make_layout, make_ordered_layout, max_common_vector, rank,
    raked_product, right_inverse, size, slice_and_offset, tile_to_shape, tiled_divide, tiled_product,
    zipped_divide, zipped_product,
)


def L(shape, stride=None) -> Layout:  # noqa: N802 - short constructor for the tables below
    return Layout(shape, stride)


def test_construction_and_printing() -> None:
    assert str(L((4, 2), (1, 4))) == "(4,2):(1,4)"
    assert L((4, 2)) == L((4, 2), (1, 4))
    assert L((2, (3, 4))).stride == (1, (2, 6))
    assert L((1, 4)).stride == (0, 1)  # CuTe LayoutLeft: static size-1 modes get stride 0
    assert make_layout((4, 2), LayoutRight) == L((4, 2), (2, 1))
    assert make_layout((4, 2), LayoutLeft) == L((4, 2), (1, 4))
    assert make_layout(L(4, 2), L(3, 8)) == L((4, 3), (2, 8))
    assert make_layout(L(4, 2)) == L((4,), (2,))
    assert str(L((8,), (1,))) == "(8):(1)"
    assert repr(L((4, 2), (1, 4))) == "Layout((4, 2), (1, 4))"
    assert L([2, [3, 4]], [1, [2, 6]]).shape == (2, (3, 4))
    assert hash(L((4, 2))) == hash(L((4, 2), (1, 4)))


def test_ordered_layouts() -> None:
    # layout.hpp: make_ordered_layout(Shape<_2,_2,_2,_2>{}, Step<_0,_2,_3,_1>{}) -> (_2,_2,_2,_2):(_1,_4,_8,_2)
    assert make_ordered_layout((2, 2, 2, 2), (0, 2, 3, 1)) == L((2, 2, 2, 2), (1, 4, 8, 2))
    assert make_ordered_layout((3, 4), LayoutRight) == L((3, 4), (4, 1))
    assert make_ordered_layout((3, (2, 4)), (1, (0, 2))) == L((3, (2, 4)), (2, (1, 6)))


@pytest.mark.parametrize("bad", [
    lambda: L((4, 2), (1,)), lambda: L((0, 2)), lambda: L((2.0, 2)), lambda: L(None),
    lambda: L((True, 2)), lambda: L((L(2), 2)),
])
def test_invalid_layouts(bad) -> None:
    with pytest.raises(LayoutError):
        bad()


def test_queries_and_modes() -> None:
    layout = L((2, (3, 4)), (12, (1, 3)))
    assert size(layout) == 24 and rank(layout) == 2 and depth(layout) == 2
    assert cosize(layout) == 24 and cosize(L((4, 2), (2, 8))) == 15
    assert layout[1] == L((3, 4), (1, 3)) and layout.get(1, 0) == L(3, 1)
    assert [str(m) for m in layout] == ["2:12", "(3,4):(1,3)"]
    assert len(layout) == 2 and L(5, 2)[0] == L(5, 2)
    assert flatten(layout) == L((2, 3, 4), (12, 1, 3))
    assert layout(1, (2, 3)) == 12 + 2 + 9 == layout((1, (2, 3))) == layout((1, 11))
    assert layout(7) == layout((1, 3)) == 12 + 3
    assert layout(None, (2, 3)) == L(((2,)), ((12,)))
    assert L((4, 8), (1, 4)).idx2crd(13) == (1, 3)
    assert L((32, 8), (8, 1)).get_flat_coord(9) == (1, 1)
    assert L((4, 2), (1, 4)).with_shape(2, 4) == L((2, 4), (1, 2))


def test_coalesce_examples() -> None:
    layout = L((2, (1, 6)), (1, (6, 2)))
    assert coalesce(layout) == L(12, 1)
    assert coalesce(layout, (1, 1)) == L((2, 6), (1, 2))
    assert coalesce(L((4, 1), (1, 0))) == L(4, 1)
    assert coalesce(L((1, 1), (3, 5))) == L(1, 0)
    assert filter(L((4, 3, 2), (1, 0, 4))) == L(8, 1)
    assert filter(L((3, 1), (0, 5))) == L(1, 0)


def test_composition_examples() -> None:
    assert composition(L((6, 2), (8, 2)), L((4, 3), (3, 1))) == L(((2, 2), 3), ((24, 2), 8))
    assert composition(L(20, 2), L((5, 4), (4, 1))) == L((5, 4), (8, 2))
    assert composition(L((10, 2), (16, 4)), L((5, 4), (1, 5))) == L((5, (2, 2)), (16, (80, 4)))
    a = L((12, (4, 8)), (59, (13, 1)))
    assert composition(a, (L(3, 4), L(8, 2))) == L((3, (2, 4)), (236, (26, 1)))
    assert composition(a, (3, 8)) == L((3, (4, 2)), (59, (13, 1)))
    # The stride-divisibility condition fails: 4 elements strided by 3 out of (4,6):(1,5).
    with pytest.raises(LayoutError, match="divisib"):
        composition(L((4, 6), (1, 5)), L(4, 3))


def test_complement_examples() -> None:
    assert complement(L(4, 1), 24) == L(6, 4)
    assert complement(L(6, 4), 24) == L(4, 1)
    assert complement(L((4, 6), (1, 4)), 24) == L(1, 0)
    assert complement(L(4, 2), 24) == L((2, 3), (1, 8))
    assert complement(L((2, 4), (1, 6)), 24) == L(3, 2)
    assert complement(L((2, 2), (1, 6)), 24) == L((3, 2), (2, 12))
    assert complement(L(4, 2)) == L(2, 1)
    with pytest.raises(LayoutError, match="injective"):
        complement(L((2, 2), (1, 1)), 8)


def test_inverse_examples() -> None:
    assert right_inverse(L((4, 2), (2, 1))) == L((2, 4), (4, 1))
    assert right_inverse(L(4, 2)) == L(1, 0)
    assert left_inverse(L(4, 2)) == L((2, 4), (4, 1))
    assert right_inverse(L((2, 3), (3, 1))) == L((3, 2), (2, 1))
    assert max_common_vector(L((8, 4), (1, 8)), L((8, 4), (1, 8))) == 32
    assert max_common_vector(L((8, 4), (1, 8)), L((8, 4), (4, 1))) == 1
    assert max_common_vector(L((8, 4), (4, 1)), L((8, 4), (4, 1))) == 32


def test_logical_divide_examples() -> None:
    assert logical_divide(L((4, 2, 3), (2, 1, 8)), L(4, 2)) == L(((2, 2), (2, 3)), ((4, 1), (2, 8)))
    assert logical_divide(L(16, 3), L(4, 1)) == L((4, 4), (3, 12))
    assert logical_divide(L(16, 3), L(4, 4)) == L((4, 4), (12, 3))
    assert logical_divide(L(16, 3), L(4, 2)) == L((4, (2, 2)), (6, (3, 24)))
    assert logical_divide(L(16, 3), L((2, 2), (4, 1))) == L(((2, 2), (2, 2)), ((12, 3), (6, 24)))
    a = L((9, (4, 8)), (59, (13, 1)))
    tiler = (L(3, 3), L((2, 4), (1, 8)))
    divided = logical_divide(a, tiler)
    assert divided[0][0] == L(3, 177) and divided[1][0] == L((2, 4), (13, 2))
    zipped = zipped_divide(a, tiler)
    assert zipped[0] == composition(a, tiler) == L((3, (2, 4)), (177, (13, 2)))
    assert size(zipped[1]) == 12


def test_divide_flavour_examples() -> None:
    layout = L((12, 32, 6), (1, 128, 0))
    assert logical_divide(layout, (4, 8)) == L(((4, 3), (8, 4), 6), ((1, 4), (128, 1024), 0))
    assert zipped_divide(layout, (4, 8)) == L(((4, 8), (3, 4, 6)), ((1, 128), (4, 1024, 0)))
    assert tiled_divide(layout, (4, 8)) == L(((4, 8), 3, 4, 6), ((1, 128), 4, 1024, 0))
    assert flat_divide(layout, (4, 8)) == L((4, 8, 3, 4, 6), (1, 128, 4, 1024, 0))
    layout = L((12, (4, 8), 6), (1, (32, 512), 0))
    assert logical_divide(layout, (4, 8)) == L(((4, 3), ((4, 2), 4), 6), ((1, 4), ((32, 512), 1024), 0))
    assert zipped_divide(layout, (4, 8)) == L(((4, (4, 2)), (3, 4, 6)), ((1, (32, 512)), (4, 1024, 0)))
    raked = L(((3, 2), (4, 2)), ((16, 1), (4, 2)))
    subtile = (L(2, 3), L(2, 4))
    assert logical_divide(raked, subtile) == L(((2, 3), (2, 4)), ((1, 16), (2, 4)))
    assert zipped_divide(raked, subtile) == L(((2, 2), (3, 4)), ((1, 2), (16, 4)))


def test_product_examples() -> None:
    assert logical_product(L((2, 2), (4, 1)), L(6, 1)) == L(((2, 2), (2, 3)), ((4, 1), (2, 8)))
    tile, matrix_of_tiles = L((2, 2), (1, 2)), L((3, 4), (4, 1))
    assert logical_product(tile, matrix_of_tiles) == L(((2, 2), (3, 4)), ((1, 2), (16, 4)))
    assert blocked_product(tile, matrix_of_tiles) == L(((2, 3), 8), ((1, 16), 2))
    assert raked_product(tile, matrix_of_tiles) == L(((3, 2), (4, 2)), ((16, 1), (4, 2)))
    assert zipped_product(tile, matrix_of_tiles) == L(((2, 2), (3, 4)), ((1, 2), (16, 4)))
    assert tiled_product(tile, matrix_of_tiles) == L(((2, 2), 3, 4), ((1, 2), 16, 4))
    assert flat_product(tile, matrix_of_tiles) == L((2, 2, 3, 4), (1, 2, 16, 4))
    # The 2x5 row-major block over a 3x4 column-major arrangement (mode 0 coalesced).
    assert blocked_product(L((2, 5), (5, 1)), L((3, 4), (1, 3))) == L((6, (5, 4)), (5, (1, 30)))
    # Blocked product table from the CuTe docs, row by row.
    blocked = blocked_product(tile, matrix_of_tiles)
    assert [blocked(2, n) for n in range(8)] == [16, 18, 20, 22, 24, 26, 28, 30]
    raked = raked_product(tile, matrix_of_tiles)
    assert [raked(3, n) for n in range(8)] == [1, 5, 9, 13, 3, 7, 11, 15]


def test_tile_to_shape_examples() -> None:
    assert tile_to_shape(L((2, 2), (1, 2)), (4, 6)) == L(((2, 2), (2, 3)), ((1, 4), (2, 8)))
    assert tile_to_shape(L((2, 2), (1, 2)), (4, 6), LayoutRight) == L(((2, 2), 6), ((1, 12), 2))
    assert tile_to_shape(L(4, 1), (8, 3)) == L((8, 3), (1, 8))
    with pytest.raises(LayoutError, match="does not divide"):
        tile_to_shape(L((2, 2), (1, 2)), (5, 4))


def test_local_tile_examples() -> None:
    gmem = L((8, 24))  # column-major 8x24
    tile = local_tile(gmem, (4, 8), (1, 2))
    assert tile.layout == L((4, 8), (1, 8)) and tile.offset == 4 + 16 * 8
    # A tile index may also be 1-D (colexicographic over the tile grid).
    assert local_tile(gmem, (4, 8), 5) == (L((4, 8), (1, 8)), 4 + 16 * 8)
    # None keeps the rest mode: all the K tiles of row-block 1.
    a = L((16, 32), (32, 1))
    kept = local_tile(a, (8, 16), (1, None))
    assert kept.layout == L((8, 16, 2), (32, 1, 16)) and kept.offset == 8 * 32
    # Projection (CuTe Step<_1,X,_1>): drop the N mode of a (M,N,K) tiler and coordinate.
    gemm_tile = local_tile(a, (8, 4, 16), (1, 3, None), proj=(1, None, 1))
    assert gemm_tile == kept
    with pytest.raises(LayoutError):
        local_tile(a, (8, 16), (1, 1, 1))


def test_local_partition_examples() -> None:
    smem = L((8, 8), (8, 1))
    threads = L((4, 2), (2, 1))  # thread t sits at row t // 2, column t % 2
    for t in range(8):
        part = local_partition(smem, threads, t)
        assert part.layout == L((2, 4), (32, 2))
        assert part.offset == smem((t // 2, t % 2))
    owned = {part_value for t in range(8)
             for part_value in (lambda p: [p.offset + p.layout(i) for i in range(size(p.layout))])(
                 local_partition(smem, threads, t))}
    assert owned == set(range(64))
    # A projected partition ignores the thread layout's second mode.
    col = local_partition(smem, L((4, 2), (1, 4)), 6, proj=(1, None))
    assert col == (L((2, 8), (32, 1)), 2 * 8)


def test_slice_and_offset() -> None:
    layout = L((3, (2, 5)), (10, (1, 2)))
    assert slice_and_offset((1, (None, 3)), layout) == (L((2,), (1,)), 10 + 6)
    assert slice_and_offset((None, 4), layout) == (L((3,), (10,)), layout((0, 4)))


def test_dynamic_equality_is_refused() -> None:
    class Opaque:
        def __mul__(self, other):
            return self

        __rmul__ = __mul__

    with pytest.raises(LayoutError, match="static"):
        _ = L((4, Opaque()), (1, 4)) == L((4, 2))
    with pytest.raises(LayoutError, match="static"):
        hash(L((4, Opaque())))
