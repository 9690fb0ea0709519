"""Unit and property tests of nvfly.layout.int_tuple and nvfly.layout.arith on static values."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layout_strategies import PROPERTY_SETTINGS, layouts
from nvfly.layout import arith
from nvfly.layout.errors import LayoutError
from nvfly.layout.int_tuple import (
    ceil_div, coalesce_shape, compact_col_major, compact_order, compact_row_major, compatible, congruent,
    crd2crd, crd2idx, depth, dice, elem_scale, flatten, get, has_none, idx2crd, inner_product,
    prefix_product, product, product_each, rank, repeat_like, shape_div, shape_min, slice_, tuple_max,
    weakly_congruent,
)


def test_structure() -> None:
    t = (2, (3, (4, 5)), 6)
    assert flatten(t) == (2, 3, 4, 5, 6) and flatten(7) == (7,)
    assert rank(t) == 3 and rank(7) == 1
    assert depth(t) == 3 and depth(7) == 0 and depth((1, 2)) == 1
    assert product(t) == 720 and product(()) == 1
    assert product_each(t) == (2, 60, 6) and product_each(5) == (5,)
    assert inner_product((2, (3, 4)), (5, (6, 7))) == 10 + 18 + 28
    assert tuple_max(t) == 6
    assert get(t, 1, 1, 0) == 4 and get(7, 0) == 7
    assert repeat_like(t, 0) == (0, (0, (0, 0)), 0)
    assert elem_scale((2, 3), (4, (2, 3))) == (8, 18)


def test_prefix_and_compact_strides() -> None:
    assert prefix_product((4, (2, 3))) == (1, (4, 8))
    assert prefix_product((2, 3, 4), 5) == (5, 10, 30)
    assert compact_col_major((4, (2, 3))) == (1, (4, 8))
    assert compact_col_major((1, 4, 1, 2)) == (0, 1, 0, 4)
    assert compact_row_major((4, (2, 3))) == (6, (3, 1))
    assert compact_order((2, 3, 4), (2, 0, 1)) == (12, 1, 3)
    with pytest.raises(LayoutError):
        compact_order((2, 3), (0, (1, 2)))


def test_shape_div_and_ceil_div() -> None:
    assert shape_div((4, 5, 6), 40) == (1, 1, 3)
    assert shape_div((6, 2), 2) == (3, 2) and shape_div((6, 2), 12) == (1, 1)
    assert shape_div((3, 6, 2, 8), 72) == (1, 1, 1, 4)
    assert shape_div(2, 8) == 1 and shape_div(8, 2) == 4 and shape_div(0, 4) == 0
    assert shape_div((4, 6), (2, 3)) == (2, 2) and shape_div(12, (2, 3)) == 2
    with pytest.raises(LayoutError, match="divisibility"):
        shape_div(6, 4)
    assert shape_min(1, 7) == 1 and shape_min(5, 3) == 3
    assert ceil_div(10, 4) == 3 and ceil_div((10, 7), (4, 2)) == (3, 4) and ceil_div((10, 7), (4,)) == (3, 7)
    assert ceil_div((4, 5, 6), 40) == (1, 1, 3)
    assert coalesce_shape((2, (3, 4))) == 24


def test_congruence() -> None:
    assert congruent((1, (2, 3)), (4, (5, 6))) and not congruent((1, 2), (1, (2, 3)))
    assert weakly_congruent(1, (2, 3)) and weakly_congruent((1, 2), (3, (4, 5)))
    assert not weakly_congruent((1, (2, 3)), (4, 5))
    assert compatible(24, (4, 6)) and compatible((4, 6), (4, (2, 3))) and not compatible((4, (2, 3)), (4, 6))
    assert not compatible(12, (4, 6))


def test_coordinates() -> None:
    shape = (2, (3, 4))
    assert crd2idx((1, (2, 3)), shape) == 1 + 2 * 2 + 3 * 6
    assert crd2idx(17, shape) == 17 and crd2idx((1, 8), shape) == 17
    assert idx2crd(17, shape) == (1, (2, 2))
    assert idx2crd(17, 24) == 17
    assert idx2crd((1, 11), shape) == (1, (2, 3))
    assert crd2crd((1, 11), shape, (2, (3, 4))) == (1, (2, 3))
    assert crd2idx((None, 3), (4, 5), (1, 4)) == 12
    assert idx2crd(13, (4, 8), (8, 1)) == (1, 5)  # (idx // d) % s per mode: inverts compact layouts


def test_slicing() -> None:
    assert has_none((1, (None, 2))) and not has_none((1, (2, 3)))
    assert slice_((None, (1, None)), (4, (2, 3))) == (4, 3)
    assert slice_((None, None), (4, (2, 3))) == (4, (2, 3))
    assert slice_(None, (4, (2, 3))) == ((4, (2, 3)),)
    assert dice((1, None, 1), (128, 128, 64)) == (128, 64)
    assert dice((None, (1, None)), (4, (2, 3))) == (2,)


@PROPERTY_SETTINGS
@given(layouts())
def test_idx2crd_crd2idx_round_trip(layout) -> None:
    shape = layout.shape
    for i in range(product(shape)):
        crd = idx2crd(i, shape)
        assert congruent(crd, shape) or not isinstance(shape, tuple)
        assert crd2idx(crd, shape) == i
    leaves = flatten(shape)
    for crd in itertools.islice(itertools.product(*(range(s) for s in leaves)), 64):
        assert crd2idx(crd, leaves, compact_col_major(leaves)) == crd2idx(crd, leaves)


def test_arith_folding_on_static_values() -> None:
    assert arith.add(3, 4) == 7 and arith.sub(3, 4) == -1 and arith.mul(3, 4) == 12
    assert arith.floordiv(13, 4) == 3 and arith.mod(13, 4) == 1 and arith.ceil_div(13, 4) == 4
    assert arith.shift_right(40, 3) == 5 and arith.shift_right(5, -3) == 40 and arith.shift_left(5, 2) == 20
    assert arith.bit_and(13, 6) == 4 and arith.bit_xor(13, 6) == 11
    assert arith.gcd_static(12, 18) == 6
    assert arith.log2_exact(64) == 6 and arith.log2_exact(48) is None and arith.log2_exact(0) is None
    with pytest.raises(LayoutError, match="zero"):
        arith.floordiv(3, 0)
    with pytest.raises(LayoutError, match="zero"):
        arith.mod(3, 0)


@given(st.integers(0, 10**6), st.integers(1, 10**3))
def test_arith_matches_python(a: int, b: int) -> None:
    assert arith.floordiv(a, b) == a // b and arith.mod(a, b) == a % b
    assert arith.ceil_div(a, b) == -(-a // b)
