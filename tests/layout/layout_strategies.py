"""Hypothesis strategies and brute-force references for the layout property tests."""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from nvfly.layout import Layout
from nvfly.layout.int_tuple import flatten

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ref_index(shape: Any, stride: Any, i: int) -> int:
    """Brute-force layout function: split ``i`` colexicographically over the flattened shape
    (the last leaf unbounded) and dot with the flattened strides."""
    shapes, strides = flatten(shape), flatten(stride)
    total = 0
    for s, d in zip(shapes[:-1], strides[:-1]):
        total += (i % s) * d
        i //= s
    return total + i * strides[-1]


def ref_values(layout: Layout) -> List[int]:
    """``[layout(i) for i in range(size)]`` computed by brute force."""
    return [ref_index(layout.shape, layout.stride, i) for i in range(layout.size())]


def values(layout: Any) -> List[int]:
    """``[layout(i) for i in range(size)]`` computed by the implementation."""
    return [layout(i) for i in range(layout.size())]


def is_injective(layout: Layout) -> bool:
    vals = ref_values(layout)
    return len(set(vals)) == len(vals)


@st.composite
def leaf_extents(draw: Any, max_leaves: int = 4, max_size: int = 256, pow2: bool = False) -> List[int]:
    """1..max_leaves extents in 1..8 whose product stays <= max_size."""
    n = draw(st.integers(1, max_leaves))
    extents, budget = [], max_size
    for _ in range(n):
        limit = max(1, min(8, budget))
        if pow2:
            choices = [v for v in (1, 2, 4, 8) if v <= limit]
            s = draw(st.sampled_from(choices))
        else:
            s = draw(st.integers(1, limit))
        extents.append(s)
        budget //= s
    return extents


@st.composite
def nest(draw: Any, shapes: Sequence[int], strides: Sequence[int]) -> Layout:
    """Group flat (shape, stride) leaves into a layout of depth <= 2 (order kept)."""
    groups: List[Tuple[Any, Any]] = []
    i = 0
    while i < len(shapes):
        k = draw(st.integers(1, len(shapes) - i))
        if k == 1 and draw(st.booleans()):
            groups.append((shapes[i], strides[i]))
        else:
            groups.append((tuple(shapes[i:i + k]), tuple(strides[i:i + k])))
        i += k
    if len(groups) == 1 and not isinstance(groups[0][0], tuple) and draw(st.booleans()):
        return Layout(groups[0][0], groups[0][1])
    return Layout(tuple(g[0] for g in groups), tuple(g[1] for g in groups))


@st.composite
def layouts(draw: Any, max_leaves: int = 4, max_size: int = 256, max_stride: int = 40, pow2: bool = False) -> Layout:
    """Random static layouts: extents 1..8, depth <= 2, strides in [0, max_stride] (or powers of
    two and 0 with ``pow2``), including non-compact and non-injective ones."""
    shapes = draw(leaf_extents(max_leaves, max_size, pow2))
    if pow2:
        stride_st = st.sampled_from([0, 1, 2, 4, 8, 16, 32, 64])
    else:
        stride_st = st.integers(0, max_stride)
    if draw(st.integers(0, 3)) == 0:
        strides = _compact_in_order(shapes, draw(st.permutations(range(len(shapes)))))
    else:
        strides = [draw(stride_st) for _ in shapes]
    return draw(nest(shapes, strides))


def _compact_in_order(shapes: Sequence[int], order: Sequence[int]) -> List[int]:
    strides = [0] * len(shapes)
    current = 1
    for i in order:
        strides[i] = current
        current *= shapes[i]
    return strides


@st.composite
def tileable_layouts(draw: Any, max_leaves: int = 3, max_span: int = 512, pow2: bool = False) -> Layout:
    """Injective layouts whose sorted modes form a divisible chain (``d_{k+1}`` a multiple of
    ``s_k * d_k``): exactly the layouts that a complement completes to a compact layout."""
    n = draw(st.integers(1, max_leaves))
    gap_st = st.sampled_from([1, 2, 4]) if pow2 else st.integers(1, 3)
    extent_st = st.sampled_from([2, 4, 8]) if pow2 else st.integers(2, 6)
    order = draw(st.permutations(range(n)))
    shapes, strides = [0] * n, [0] * n
    span = 1
    for i in order:
        s = draw(extent_st)
        d = span * draw(gap_st)
        if d * s > max_span:
            s, d = 1, 0
        shapes[i], strides[i] = s, d
        span = max(span, d * s)
    return draw(nest(shapes, strides))


def span(layout: Layout) -> int:
    """Extent of the sorted chain of a tileable layout: the smallest size it tiles."""
    return max([s * d for s, d in zip(flatten(layout.shape), flatten(layout.stride))] + [1])
