"""Swizzles, composed layouts and the GMMA shared-memory atoms."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layout_strategies import PROPERTY_SETTINGS
from nvfly.layout import (
    ComposedLayout, Layout, LayoutError, LayoutRight, Swizzle, composition, local_partition, local_tile,
    logical_divide, make_swizzle_atom, size, tile_to_shape, zipped_divide,
)


@st.composite
def swizzles(draw: st.DrawFn) -> Swizzle:
    bits = draw(st.integers(0, 3))
    base = draw(st.integers(0, 4))
    shift = draw(st.integers(max(bits, 1), 4)) * draw(st.sampled_from([1, -1]))
    return Swizzle(bits, base, shift)


@PROPERTY_SETTINGS
@given(swizzles(), st.integers(0, 3))
def test_swizzle_is_a_bijection_on_each_period(sw: Swizzle, block: int) -> None:
    n = sw.size()
    assert n == 1 << (sw.bits + sw.base + abs(sw.shift))
    image = [sw(block * n + x) for x in range(n)]
    assert sorted(image) == list(range(block * n, (block + 1) * n))
    assert all(sw(sw(x)) == x for x in range(n))  # an xor of disjoint bit fields is an involution


def test_swizzle_bits() -> None:
    sw = Swizzle(3, 4, 3)
    assert sw.yyy_mask == 0b1110000000 and sw.zzz_mask == 0b0001110000
    assert sw(0b1010000000) == 0b1010000000 ^ 0b0001010000
    assert str(sw) == "Sw<3,4,3>" and sw.cosize() == 1024
    assert Swizzle(2, 0, -3).yyy_mask == 0b11 and Swizzle(2, 0, -3).zzz_mask == 0b11000
    for bad in ((1, 4, 0), (-1, 4, 3), (3, 4, 2)):
        with pytest.raises(LayoutError):
            Swizzle(*bad)


def _cutlass_byte_offset(mode_bytes: int, element_bits: int, k_major: bool, row: int, col: int) -> int:
    """CUTLASS's GMMA atoms in bits, ``Sw<B,4,3> o smem_ptr o (8, W):(W, 1)`` (K-major) or
    ``(W, 8):(1, W)`` (MN-major), W = mode_bytes*8: the swizzle acts on the byte address."""
    width = mode_bytes * 8
    bit_offset = (row * width + col * element_bits) if k_major else (col * width + row * element_bits)
    return Swizzle({16: 0, 32: 1, 64: 2, 128: 3}[mode_bytes], 4, 3)(bit_offset // 8)


@pytest.mark.parametrize("mode_bytes", [16, 32, 64, 128])
@pytest.mark.parametrize("element_bits", [8, 16, 32, 64])
@pytest.mark.parametrize("k_major", [True, False])
def test_atoms_match_cutlass_byte_swizzle(mode_bytes: int, element_bits: int, k_major: bool) -> None:
    atom = make_swizzle_atom(mode_bytes, element_bits, k_major)
    n = mode_bytes * 8 // element_bits
    assert atom.shape == ((8, n) if k_major else (n, 8))
    assert atom.inner == (Layout((8, n), (n, 1)) if k_major else Layout((n, 8), (1, n)))
    rows, cols = atom.shape
    offsets = set()
    for r, c in itertools.product(range(rows), range(cols)):
        expected_bytes = _cutlass_byte_offset(mode_bytes, element_bits, k_major, r, c)
        assert atom(r, c) * element_bits // 8 == expected_bytes
        offsets.add(atom(r, c))
    assert offsets == set(range(8 * n))


def test_known_sw128_offsets() -> None:
    # 16-bit K-major SW128: row r of 64 elements = 8 chunks of 16 bytes; chunk j lands at j ^ (r % 8).
    atom = make_swizzle_atom(128, 16)
    assert str(atom) == "Sw<3,3,3> o 0 o (8,64):(64,1)"
    assert (atom(0, 0), atom(0, 8), atom(1, 0), atom(1, 8), atom(7, 0), atom(7, 63)) == (0, 8, 72, 64, 504, 455)
    for r, c in itertools.product(range(8), range(64)):
        assert atom(r, c) == r * 64 + ((c // 8) ^ r) * 8 + c % 8
    # SW64 and SW32 (16-bit): the xor uses the row bits above the 128-byte line.
    sw64, sw32 = make_swizzle_atom(64, 16), make_swizzle_atom(32, 16)
    for r, c in itertools.product(range(8), range(32)):
        assert sw64(r, c) == r * 32 + ((c // 8) ^ ((r >> 1) & 3)) * 8 + c % 8
    for r, c in itertools.product(range(8), range(16)):
        assert sw32(r, c) == r * 16 + ((c // 8) ^ ((r >> 2) & 1)) * 8 + c % 8
    # MN-major SW128 (16-bit): (64,8):(1,64), the K index plays the role of the row.
    mn = make_swizzle_atom(128, 16, k_major=False)
    assert str(mn) == "Sw<3,3,3> o 0 o (64,8):(1,64)"
    for m, k in itertools.product(range(64), range(8)):
        assert mn(m, k) == k * 64 + ((m // 8) ^ k) * 8 + m % 8
    assert str(make_swizzle_atom(16, 16)) == "Sw<0,3,3> o 0 o (8,8):(8,1)"
    assert str(make_swizzle_atom(128, 32)) == "Sw<3,2,3> o 0 o (8,32):(32,1)"


def test_atom_validation() -> None:
    for args in ((96, 16), (128, 12), (128, 256), (128, 0)):
        with pytest.raises(LayoutError):
            make_swizzle_atom(*args)


def test_composed_layout_basics() -> None:
    sw = Swizzle(2, 0, 2)
    composed = ComposedLayout(sw, 3, Layout((4, 4), (4, 1)))
    assert size(composed) == 16 and composed.rank == 2 and composed.cosize() == 19
    assert composed(1, 2) == sw(3 + 6)
    assert composed[1] == ComposedLayout(sw, 3, Layout(4, 1))
    assert composition(composed, (2, 2)) == ComposedLayout(sw, 3, Layout((2, 2), (4, 1)))
    sliced = composed(1, None)
    assert sliced == ComposedLayout(sw, 3 + 4, Layout((4,), (1,)))
    assert [sliced(i) for i in range(4)] == [composed(1, i) for i in range(4)]
    layout_outer = ComposedLayout(Layout(16, 2), 0, Layout((4, 4)))
    assert layout_outer(3, 1) == 2 * 7
    with pytest.raises(LayoutError):
        ComposedLayout(sw, 0, (4, 4))  # type: ignore[arg-type]
    assert hash(composed) == hash(ComposedLayout(Swizzle(2, 0, 2), 3, Layout((4, 4), (4, 1))))


@pytest.mark.parametrize("mode_bytes,element_bits", [(128, 16), (64, 16), (128, 8), (32, 32)])
@pytest.mark.parametrize("order", [None, LayoutRight])
def test_tile_to_shape_with_atoms(mode_bytes: int, element_bits: int, order: object) -> None:
    atom = make_swizzle_atom(mode_bytes, element_bits)
    rows, cols = atom.shape
    target = (rows * 4, cols * 2)
    smem = tile_to_shape(atom, target) if order is None else tile_to_shape(atom, target, order)
    assert isinstance(smem, ComposedLayout) and smem.outer == atom.outer
    assert (smem[0].size(), smem[1].size()) == target
    grid = Layout((4, 2)) if order is None else Layout((4, 2), (2, 1))
    atom_size = size(atom)
    for m, k in itertools.product(range(target[0]), range(target[1])):
        # Each atom copy is a contiguous, aligned block: the swizzle never crosses atoms.
        assert smem(m, k) == atom(m % rows, k % cols) + atom_size * grid(m // rows, k // cols)


def test_partitioning_a_swizzled_layout() -> None:
    smem = tile_to_shape(make_swizzle_atom(128, 16), (64, 64))
    tile = local_tile(smem, (16, 64), (2, 0))
    assert tile.offset == 0 and isinstance(tile.layout, ComposedLayout)
    for m, k in itertools.product(range(16), range(64)):
        assert tile.layout(m, k) == smem(32 + m, k)
    threads = Layout((16, 8), (8, 1))
    owned = []
    for t in range(128):
        part = local_partition(smem, threads, t)
        assert part.offset == 0
        owned += [part.layout(i) for i in range(size(part.layout))]
        assert part.layout(0) == smem(t // 8, t % 8)
    assert sorted(owned) == list(range(64 * 64))
    divided = zipped_divide(smem, (8, 64))
    assert isinstance(divided, ComposedLayout) and divided[0].shape == (8, 64)
    assert logical_divide(smem, None) is smem
