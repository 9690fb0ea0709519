"""Layouts with dynamic (traced) integers: the ops emitted, their results, and the errors raised
where a static value is required. ``Dyn`` refuses bool()/int()/hash()/comparisons, so any
attempt of the layout code to evaluate a dynamic value fails these tests."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layout_strategies import PROPERTY_SETTINGS, layouts, ref_index
from layout_tracer import Dyn, Tracer, value_of
from nvfly.layout import (
    Layout, LayoutError, Swizzle, coalesce, complement, composition, local_partition, local_tile,
    logical_divide, make_swizzle_atom, right_inverse, size, tile_to_shape, zipped_divide,
)
from nvfly.layout import arith
from nvfly.layout.int_tuple import ceil_div, flatten, idx2crd, shape_div, transform_leaf


@pytest.fixture
def tracer() -> Tracer:
    return Tracer()


def test_2d_coordinate_emits_one_mul_and_one_add(tracer: Tracer) -> None:
    i, j = tracer.var(3), tracer.var(5)
    result = Layout((4, 8), (8, 1))(i, j)
    assert tracer.ops == ["mul", "add"]
    assert result.value == 3 * 8 + 5


def test_static_parts_fold(tracer: Tracer) -> None:
    x = tracer.var(9)
    assert arith.add(x, 0) is x and arith.add(0, x) is x and arith.sub(x, 0) is x
    assert arith.mul(x, 1) is x and arith.mul(1, x) is x
    assert arith.mul(x, 0) == 0 and arith.mul(0, x) == 0 and arith.mod(x, 1) == 0
    assert arith.floordiv(x, 1) is x and arith.shift_right(x, 0) is x and arith.bit_xor(x, 0) is x
    assert arith.bit_and(x, 0) == 0 and arith.floordiv(0, x) == 0 and arith.mod(0, x) == 0
    assert arith.ceil_div(x, 1) is x
    assert tracer.ops == []
    assert Layout((4, 8), (0, 1))(tracer.var(2), x) is x  # stride 0 and stride 1: nothing emitted
    assert tracer.ops == []


def test_power_of_two_division_becomes_shift_and_mask(tracer: Tracer) -> None:
    x = tracer.var(1000)
    q, r = arith.floordiv(x, 64), arith.mod(x, 64)
    assert tracer.ops == ["shr", "and"] and (q.value, r.value) == (1000 // 64, 1000 % 64)
    tracer.reset()
    c = arith.ceil_div(x, 128)
    assert tracer.ops == ["add", "shr"] and c.value == 8
    tracer.reset()
    q3 = arith.floordiv(x, 3)
    assert tracer.ops == ["floordiv"] and q3.value == 333


def test_1d_index_into_power_of_two_shape(tracer: Tracer) -> None:
    layout = Layout((4, (2, 4)), (8, (32, 1)))
    for i in range(32):
        tracer.reset()
        result = layout(tracer.var(i))
        assert set(tracer.ops) <= {"and", "shr", "mul", "add"}
        assert result.value == ref_index(layout.shape, layout.stride, i)


def test_non_power_of_two_shapes_use_div_and_mod(tracer: Tracer) -> None:
    layout = Layout((3, 5), (5, 1))
    for i in range(15):
        tracer.reset()
        assert layout(tracer.var(i)).value == layout(i)
        assert {"mod", "floordiv"} <= set(tracer.ops)


def test_thread_index_to_coordinate(tracer: Tracer) -> None:
    threads = Layout((32, 4), (4, 1))
    for t in range(128):
        tracer.reset()
        crd = threads.get_flat_coord(tracer.var(t))
        assert set(tracer.ops) <= {"shr", "and"}
        assert value_of(crd) == threads.get_flat_coord(t) == ((t >> 2) & 31, t & 3)
    assert value_of(idx2crd(tracer.var(77), (4, (2, 8)))) == idx2crd(77, (4, (2, 8)))


@PROPERTY_SETTINGS
@given(layouts(), st.data())
def test_dynamic_coordinates_match_static(layout: Layout, data: st.DataObject) -> None:
    tracer = Tracer()
    i = data.draw(st.integers(0, layout.size() - 1))
    assert value_of(layout(tracer.var(i))) == layout(i)
    # A full hierarchical coordinate costs one mul per stride not in {0, 1} and one add per
    # additional non-zero term: nothing else.
    tracer.reset()
    crd = transform_leaf(idx2crd(i, layout.shape), tracer.var)
    assert value_of(layout(crd)) == layout(i)
    strides = flatten(layout.stride)
    assert tracer.count("mul") == sum(d not in (0, 1) for d in strides)
    assert tracer.count("add") == max(0, sum(d != 0 for d in strides) - 1)
    assert len(tracer.ops) == tracer.count("mul") + tracer.count("add")


def test_global_tile_with_dynamic_extents(tracer: Tracer) -> None:
    m, k = tracer.var(200), tracer.var(96)  # partial tiles in both modes
    g = Layout((m, k), (k, 1))
    tiled = zipped_divide(g, (128, 64))
    assert tiled[0].shape == (128, 64) and tiled[0].stride[0] is k and tiled[0].stride[1] == 1
    assert value_of(tiled[1].shape) == (2, 2)
    assert value_of(tiled[1].stride) == (128 * 96, 64)
    assert not {"floordiv", "mod"} & set(tracer.ops)
    for bm, bk in itertools.product(range(2), range(2)):
        tracer.reset()
        tile = local_tile(g, (128, 64), (tracer.var(bm), tracer.var(bk)))
        assert tile.layout.shape == (128, 64) and tile.layout.stride[0] is k and tile.layout.stride[1] == 1
        assert tile.offset.value == bm * 128 * 96 + bk * 64
        # Exactly: two ceil_divs (add + shr each), the tile-row stride 128*K, and the offset
        # bm*(128*K) + bk*64. No dead ops, no division.
        assert Counter(tracer.ops) == Counter({"add": 3, "shr": 2, "mul": 3})
    # A K-loop view: keep the K tiles, fix the M tile.
    view = local_tile(g, (128, 64), (tracer.var(1), None))
    assert value_of(view.layout.shape) == (128, 64, 2) and value_of(view.layout.stride) == (96, 1, 64)
    assert view.offset.value == 128 * 96


def test_logical_divide_of_dynamic_extent(tracer: Tracer) -> None:
    n = tracer.var(1000)
    divided = logical_divide(Layout(n, 1), 256)
    assert divided.shape[0] == 256 and value_of(divided.shape[1]) == 4 and divided.stride == (1, 256)
    assert value_of(complement(Layout(256, 1), n).shape) == 4
    assert value_of(ceil_div((n, 7), 256)) == (4, 7)
    assert value_of(shape_div(n, 8)) == 125


def test_partition_of_dynamic_stride_tile(tracer: Tracer) -> None:
    k = tracer.var(96)
    tile = Layout((128, 64), (k, 1))
    threads = Layout((32, 4), (4, 1))
    for t in (0, 1, 5, 127):
        tracer.reset()
        part = local_partition(tile, threads, tracer.var(t))
        assert value_of(part.layout.shape) == (4, 16)
        assert value_of(part.layout.stride) == (32 * 96, 4)
        assert part.offset.value == ((t >> 2) & 31) * 96 + (t & 3)
        assert not {"floordiv", "mod"} & set(tracer.ops)


def test_partition_with_dynamic_thread_index_matches_static(tracer: Tracer) -> None:
    smem = Layout((64, 32), (32, 1))
    threads = Layout((16, 8), (8, 1))
    for t in range(128):
        static = local_partition(smem, threads, t)
        dynamic = local_partition(smem, threads, tracer.var(t))
        assert dynamic.layout == static.layout
        assert dynamic.offset.value == static.offset
        assert static.offset == smem((t // 8, t % 8))


def test_swizzle_emits_and_shift_xor(tracer: Tracer) -> None:
    sw = Swizzle(3, 4, 3)
    for x in (0, 5, 129, 1023, 4097):
        tracer.reset()
        y = sw(tracer.var(x))
        assert tracer.ops == ["and", "shr", "xor"]
        assert y.value == sw(x)
    tracer.reset()
    assert Swizzle(0, 4, 3)(x := tracer.var(7)) is x and tracer.ops == []
    assert Swizzle(2, 0, -3)(tracer.var(6)).value == Swizzle(2, 0, -3)(6)
    assert "shl" in tracer.ops


def test_swizzled_layout_with_dynamic_coordinates(tracer: Tracer) -> None:
    atom = make_swizzle_atom(128, 16)
    for r, c in itertools.product(range(8), range(0, 64, 7)):
        tracer.reset()
        assert atom(tracer.var(r), tracer.var(c)).value == atom(r, c)
        assert set(tracer.ops) <= {"mul", "add", "and", "shr", "xor"}
    smem = tile_to_shape(atom, (128, 64))
    for bm in range(2):
        sub = local_tile(smem, (64, 64), (tracer.var(bm), 0))
        static = local_tile(smem, (64, 64), (bm, 0))
        assert sub.offset == 0 and static.offset == 0
        for m, k in itertools.product(range(0, 64, 9), range(0, 64, 5)):
            assert sub.layout(m, k).value == static.layout(m, k) == smem(bm * 64 + m, k)


def test_dynamic_size_cosize_and_coalesce(tracer: Tracer) -> None:
    m, k = tracer.var(6), tracer.var(10)
    g = Layout((m, k), (k, 1))
    assert size(g).value == 60 and g.cosize().value == 60
    assert not g.is_static()
    c = coalesce(Layout((4, 1, m), (1, 7, 4)))
    assert c.shape[0] == 4 and c.shape[1] is m and c.stride == (1, 4)  # dynamic modes are not merged
    assert str(Layout((m, 4), (1, m))) == "(Dyn(6),4):(1,Dyn(6))"


def test_operations_needing_static_values_raise(tracer: Tracer) -> None:
    m = tracer.var(64)
    with pytest.raises(LayoutError, match="complement"):
        complement(Layout((4, 8), (m, 1)), 1024)
    with pytest.raises(LayoutError, match="right_inverse"):
        right_inverse(Layout((4, 8), (1, m)))
    with pytest.raises(LayoutError, match="composition"):
        composition(Layout((m, 4), (1, m)), Layout(8, 1))
    with pytest.raises(LayoutError, match="static"):
        Swizzle(m, 4, 3)
    with pytest.raises(LayoutError, match="shift"):
        arith.shift_right(8, m)
    with pytest.raises(LayoutError, match="gcd"):
        arith.gcd_static(m, 8)
    with pytest.raises(LayoutError, match="static"):
        _ = Layout((m, 4)) == Layout((m, 4))
    with pytest.raises(LayoutError, match="static"):
        hash(Layout(m, 1))


def test_dyn_refuses_evaluation(tracer: Tracer) -> None:
    x = tracer.var(3)
    for evaluate in (bool, int, hash, abs, lambda v: v < 1, lambda v: v == 1):
        with pytest.raises(AssertionError):
            evaluate(x)
    assert isinstance(x + 1, Dyn)
