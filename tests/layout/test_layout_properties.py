"""Property tests of the layout algebra against brute-force enumeration."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layout_strategies import (
    PROPERTY_SETTINGS, is_injective, layouts, nest, ref_index, ref_values, span, tileable_layouts, values,
)
from nvfly.layout import (
    Layout, LayoutError, LayoutLeft, LayoutRight, blocked_product, coalesce, complement, composition,
    filter, flat_divide, left_inverse, logical_divide, logical_product, make_layout, make_ordered_layout,
    raked_product, right_inverse, tile_to_shape, tiled_divide, zipped_divide,
)
from nvfly.layout.int_tuple import compatible, depth, flatten, idx2crd, product


@PROPERTY_SETTINGS
@given(layouts())
def test_call_matches_bruteforce(layout: Layout) -> None:
    for i in range(layout.size()):
        expected = ref_index(layout.shape, layout.stride, i)
        assert layout(i) == expected
        assert layout(idx2crd(i, layout.shape)) == expected
    # Past the domain, the last mode keeps counting (CuTe's unbounded last mode).
    assert layout(layout.size()) == ref_index(layout.shape, layout.stride, layout.size())


@PROPERTY_SETTINGS
@given(layouts())
def test_coalesce_preserves_function(layout: Layout) -> None:
    result = coalesce(layout)
    assert result.size() == layout.size()
    assert result.depth <= 1
    assert len(flatten(result.shape)) <= len(flatten(layout.shape))
    assert values(result) == ref_values(layout)
    by_mode = coalesce(layout, (1,) * layout.rank)
    assert by_mode.rank == layout.rank
    for mode, original in zip(by_mode, layout):
        assert mode.depth <= 1 and values(mode) == ref_values(original)


@PROPERTY_SETTINGS
@given(layouts())
def test_filter_keeps_the_image(layout: Layout) -> None:
    result = filter(layout)
    assert set(values(result)) == set(ref_values(layout))
    nonzero = [s for s, d in zip(flatten(layout.shape), flatten(layout.stride)) if d != 0]
    assert result.size() == product(tuple(nonzero))
    if result.size() > 1:
        assert 0 not in flatten(result.stride)


def _check_composition(a: Layout, b: Layout, result: Layout) -> None:
    """``result(i) == a(b(i))`` on b's domain (``a`` extended past its size by its last mode)."""
    assert compatible(b.shape, result.shape)
    for i in range(b.size()):
        assert result(i) == ref_index(a.shape, a.stride, b(i))


@PROPERTY_SETTINGS
@given(layouts(pow2=True), layouts(pow2=True, max_size=64))
def test_composition_power_of_two_always_admissible(a: Layout, b: Layout) -> None:
    # Composition distributes over the modes of b only when b is injective (CuTe's precondition).
    if not is_injective(filter(b)):
        return
    _check_composition(a, b, composition(a, b))


@PROPERTY_SETTINGS
@given(layouts(max_size=128), layouts(max_size=64, max_stride=12))
def test_composition_correct_or_rejected(a: Layout, b: Layout) -> None:
    if not is_injective(filter(b)):
        return
    try:
        result = composition(a, b)
    except LayoutError:
        return
    _check_composition(a, b, result)


@PROPERTY_SETTINGS
@given(layouts(pow2=True, max_leaves=3), st.data())
def test_composition_by_mode_tiler(a: Layout, data: st.DataObject) -> None:
    tiler = tuple(data.draw(layouts(pow2=True, max_leaves=2, max_size=16).filter(lambda t: is_injective(filter(t))))
                  for _ in range(a.rank))
    result = composition(a, tiler)
    assert result.rank == a.rank
    for mode, a_mode, t in zip(result, a, tiler):
        _check_composition(a_mode, t, mode)


@PROPERTY_SETTINGS
@given(tileable_layouts(), st.integers(1, 4))
def test_complement_completes_tileable_layouts(a: Layout, k: int) -> None:
    cotarget = span(a) * k
    comp = complement(a, cotarget)
    comp_values = values(comp)
    assert comp_values == sorted(set(comp_values))  # ordered: strictly increasing
    assert not set(comp_values[1:]) & set(ref_values(a))
    whole = make_layout(a, comp)
    assert sorted(values(whole)) == list(range(cotarget))


@PROPERTY_SETTINGS
@given(layouts(max_leaves=3), st.integers(1, 300))
def test_complement_general_properties(a: Layout, cotarget: int) -> None:
    # Without the divisible-chain precondition CuTe's complement is still ordered and disjoint
    # (it may just not reach the cotarget); a rejected layout raises LayoutError.
    if not is_injective(filter(a)):
        return
    try:
        comp = complement(a, cotarget)
    except LayoutError:
        return
    comp_values = values(comp)
    assert comp_values == sorted(set(comp_values))
    assert not set(comp_values[1:]) & set(ref_values(a))
    whole = values(make_layout(filter(a), comp))
    assert len(whole) == len(set(whole))


@PROPERTY_SETTINGS
@given(layouts())
def test_right_inverse(layout: Layout) -> None:
    inverse = right_inverse(layout)
    for i in range(inverse.size()):
        assert layout(inverse(i)) == i
    if sorted(ref_values(layout)) == list(range(layout.size())):  # a permutation of [0, size)
        assert inverse.size() == layout.size()


@PROPERTY_SETTINGS
@given(tileable_layouts())
def test_left_inverse(layout: Layout) -> None:
    inverse = left_inverse(layout)
    for i in range(layout.size()):
        assert inverse(layout(i)) == i


@st.composite
def layout_of_size(draw: st.DrawFn, total: int) -> Layout:
    """A random power-of-two layout of the given power-of-two size (strides may be 0)."""
    extents = []
    while total > 1:
        s = draw(st.sampled_from([v for v in (2, 4, 8) if total % v == 0]))
        extents.append(s)
        total //= s
    extents = extents or [1]
    strides = [draw(st.sampled_from([0, 1, 2, 4, 8, 16, 32])) for _ in extents]
    return draw(nest(extents, strides))


@PROPERTY_SETTINGS
@given(tileable_layouts(pow2=True, max_span=64), st.sampled_from([1, 2, 4]), st.data())
def test_logical_divide_permutes_the_layout(tiler: Layout, k: int, data: st.DataObject) -> None:
    a = data.draw(layout_of_size(span(tiler) * k))
    divided = logical_divide(a, tiler)
    assert divided.size() == a.size()
    assert Counter(values(divided)) == Counter(ref_values(a))
    assert values(divided[0]) == values(composition(a, tiler))


@PROPERTY_SETTINGS
@given(tileable_layouts(pow2=True, max_leaves=2, max_span=8), tileable_layouts(pow2=True, max_leaves=2, max_span=8),
       st.data())
def test_divide_flavours_are_regroupings(t0: Layout, t1: Layout, data: st.DataObject) -> None:
    m0 = data.draw(layout_of_size(span(t0) * data.draw(st.sampled_from([1, 2]))))
    m1 = data.draw(layout_of_size(span(t1) * data.draw(st.sampled_from([1, 2]))))
    a = make_layout(m0, m1, Layout(2, 1000))
    tiler = (t0, t1)
    logical = logical_divide(a, tiler)
    zipped = zipped_divide(a, tiler)
    tiled = tiled_divide(a, tiler)
    flat = flat_divide(a, tiler)
    assert Counter(values(logical)) == Counter(ref_values(a))
    assert zipped[0].shape == composition(a, tiler).shape
    sizes = [logical[0][0].size(), logical[1][0].size(), logical[0][1].size(), logical[1][1].size(), 2]
    for tm, tn, rm, rn, l in itertools.product(*(range(s) for s in sizes)):
        expected = logical(((tm, rm), (tn, rn), l))
        assert zipped(((tm, tn), (rm, rn, l))) == expected
        assert tiled(((tm, tn), rm, rn, l)) == expected
        assert flat((tm, tn, rm, rn, l)) == expected


@PROPERTY_SETTINGS
@given(tileable_layouts(max_span=64), st.integers(1, 4))
def test_divide_then_matching_product_round_trip(tiler: Layout, k: int) -> None:
    # CuTe layout-algebra doc: logical_divide(N:1, B) and logical_product(B, (N/size(B)):1)
    # are the same layout (B plus the layout of its repetitions).
    n = span(tiler) * k
    divided = logical_divide(Layout(n), tiler)
    multiplied = logical_product(tiler, Layout(n // tiler.size()))
    assert divided.size() == multiplied.size() == n
    assert values(divided) == values(multiplied)
    assert values(divided[1]) == values(complement(tiler, n))


@st.composite
def compact_rank2(draw: st.DrawFn) -> Layout:
    m, n = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    return make_layout((m, n), draw(st.sampled_from([LayoutLeft, LayoutRight])))


@PROPERTY_SETTINGS
@given(compact_rank2(), layouts(max_leaves=2, max_size=24, max_stride=8), st.booleans())
def test_blocked_and_raked_products(block: Layout, tiler: Layout, tiler_rank2: bool) -> None:
    if tiler_rank2 and tiler.rank == 1:
        tiler = make_layout(tiler, Layout(2, tiler.cosize()))
    if tiler.rank > 2:
        return
    tiler2 = tiler if tiler.rank == 2 else make_layout(tiler, Layout(1, 0))
    bm, bn = block[0].size(), block[1].size()
    tm, tn = tiler2[0].size(), tiler2[1].size()
    blocked = blocked_product(block, tiler)
    raked = raked_product(block, tiler)
    for result in (blocked, raked):
        assert result.rank == 2
        assert result.size() == block.size() * tiler.size()
        assert (result[0].size(), result[1].size()) == (bm * tm, bn * tn)
    for am, an, xm, xn in itertools.product(range(bm), range(bn), range(tm), range(tn)):
        expected = block((am, an)) + block.size() * tiler2((xm, xn))
        assert blocked((am + bm * xm, an + bn * xn)) == expected
        assert raked((xm + tm * am, xn + tn * an)) == expected


@PROPERTY_SETTINGS
@given(compact_rank2(), st.integers(1, 3), st.integers(1, 3), st.sampled_from([LayoutLeft, LayoutRight]))
def test_tile_to_shape(block: Layout, km: int, kn: int, order: object) -> None:
    bm, bn = block[0].size(), block[1].size()
    result = tile_to_shape(block, (bm * km, bn * kn), order)
    assert result.rank == 2 and (result[0].size(), result[1].size()) == (bm * km, bn * kn)
    tiles = make_ordered_layout((km, kn), order)
    for m, n in itertools.product(range(bm * km), range(bn * kn)):
        assert result((m, n)) == block((m % bm, n % bn)) + block.size() * tiles((m // bm, n // bn))


def test_hypothesis_layouts_cover_hierarchy() -> None:
    # The strategies must actually produce nested layouts and non-injective ones.
    from hypothesis import find
    assert depth(find(layouts(), lambda l: l.depth == 2).shape) == 2
    assert not is_injective(find(layouts(), lambda l: not is_injective(l)))


@pytest.mark.parametrize("shape", [(2, 3), ((2, 2), 3), (4, (2, 3), 2)])
def test_right_inverse_of_compact_permutations(shape: object) -> None:
    for order in itertools.permutations(range(len(flatten(shape)))):
        flat = flatten(shape)
        strides, current = [0] * len(flat), 1
        for i in order:
            strides[i], current = current, current * flat[i]
        layout = Layout(flat, tuple(strides))
        inverse = right_inverse(layout)
        assert [layout(inverse(i)) for i in range(layout.size())] == list(range(layout.size()))
        assert [inverse(layout(i)) for i in range(layout.size())] == list(range(layout.size()))
