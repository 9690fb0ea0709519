"""Swizzles, swizzled (composed) layouts and the Hopper GMMA shared-memory layout atoms.

``Swizzle(B, M, S)`` is CuTe's ``Swizzle<B,M,S>``: it xors the ``B`` bits found ``S`` positions
above bit ``M`` into bits ``[M, M+B)``::

    0bxxxxxxxxxxxxxxxYYYxxxxxxxZZZxxxx   y = x ^ ((x & yyy_mask) >> S)
                                 ^--^ M: least-significant bits kept as is
                  ^-^       ^-^      B: number of bits in each mask
                    ^---------^      S: distance between the masks

A :class:`ComposedLayout` ``outer o offset o inner`` maps a coordinate ``c`` to
``outer(offset + inner(c))``; with a swizzle as ``outer`` it describes swizzled shared memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

from nvfly.layout import arith
from nvfly.layout import int_tuple as it
from nvfly.layout.arith import IntLike, is_static
from nvfly.layout.errors import LayoutError
from nvfly.layout.layout import ComposedLayoutBase, Layout, LayoutSlice

__all__ = ["Swizzle", "ComposedLayout", "make_swizzle_atom"]


@dataclass(frozen=True)
class Swizzle:
    """CuTe ``Swizzle<bits, base, shift>``: ``y = x ^ ((x & yyy_mask) >> shift)``.

    A bijection on the non-negative integers that only permutes values within aligned blocks
    of ``size()`` elements. A negative ``shift`` moves the mask bits left instead of right.
    """

    bits: int
    base: int
    shift: int

    def __post_init__(self) -> None:
        for name in ("bits", "base", "shift"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise LayoutError(f"Swizzle: {name} must be a static int, got {value!r}")
        if self.bits < 0 or self.base < 0:
            raise LayoutError(f"Swizzle: bits and base must be >= 0, got bits={self.bits}, base={self.base}")
        if abs(self.shift) < self.bits:
            raise LayoutError(f"Swizzle: |shift| must be >= bits (the masks overlap), got {self}")

    @property
    def yyy_mask(self) -> int:
        """The source bits (moved by ``shift`` onto the ``zzz`` bits)."""
        return ((1 << self.bits) - 1) << (self.base + max(0, self.shift))

    @property
    def zzz_mask(self) -> int:
        """The destination bits."""
        return ((1 << self.bits) - 1) << (self.base - min(0, self.shift))

    def __call__(self, offset: IntLike) -> IntLike:
        """Swizzle an offset. A dynamic offset emits exactly one ``&``, one shift and one ``^``
        (nothing for ``bits == 0``)."""
        if self.bits == 0:
            return offset
        moved = arith.shift_right(arith.bit_and(offset, self.yyy_mask), self.shift)
        return arith.bit_xor(offset, moved)

    def size(self) -> int:
        """Period of the swizzle: it permutes each aligned block of this many offsets."""
        return 1 << (self.bits + self.base + abs(self.shift))

    def cosize(self) -> int:
        """Same as :meth:`size` (a swizzle is a bijection of each period)."""
        return self.size()

    def __str__(self) -> str:
        return f"Sw<{self.bits},{self.base},{self.shift}>"


Outer = Union[Swizzle, Layout]


@dataclass(frozen=True, eq=False, repr=False)
class ComposedLayout(ComposedLayoutBase):
    """``outer o offset o inner``: ``c -> outer(offset + inner(c))`` (CuTe ``ComposedLayout``).

    The domain is that of ``inner``; layout operations that take a tiler (composition, the
    divides and products, ``tile_to_shape``, ``local_tile``, ``local_partition``) act on
    ``inner``. Slicing folds the fixed coordinates into ``offset`` (offsets cannot be pulled out
    of a swizzle), so a slice of a composed layout has offset 0.
    """

    outer: Outer
    offset: IntLike
    inner: Layout

    def __post_init__(self) -> None:
        if not isinstance(self.outer, (Swizzle, Layout)):
            raise LayoutError(f"ComposedLayout: outer must be a Swizzle or a Layout, got {self.outer!r}")
        if not isinstance(self.inner, Layout):
            raise LayoutError(f"ComposedLayout: inner must be a Layout, got {self.inner!r}")

    @property
    def shape(self) -> Any:
        """Shape of the domain (the inner layout's shape)."""
        return self.inner.shape

    @property
    def rank(self) -> int:
        """Number of top-level modes of the domain."""
        return self.inner.rank

    @property
    def depth(self) -> int:
        """Nesting depth of the domain's shape."""
        return self.inner.depth

    def size(self) -> IntLike:
        """Size of the domain."""
        return self.inner.size()

    def cosize(self) -> IntLike:
        """Codomain size of the inner layout plus the offset (a swizzle permutes within its
        period, so this bounds the codomain when the inner cosize is a multiple of the period)."""
        return arith.add(self.offset, self.inner.cosize())

    def __getitem__(self, i: int) -> "ComposedLayout":
        return ComposedLayout(self.outer, self.offset, self.inner[i])

    def __len__(self) -> int:
        return self.rank

    def __call__(self, *crd: Any) -> Any:
        """``outer(offset + inner(crd))``; a coordinate with ``None`` slices instead."""
        if not crd:
            raise LayoutError("ComposedLayout(): a coordinate is required")
        c = crd[0] if len(crd) == 1 else tuple(crd)
        if it.has_none(c):
            return self.slice_and_offset(c).layout
        return self.outer(arith.add(self.offset, self.inner.crd2idx(c)))

    def map_inner(self, fn: Callable[[Layout], Layout]) -> "ComposedLayout":
        return ComposedLayout(self.outer, self.offset, fn(self.inner))

    def slice_and_offset(self, crd: Any) -> LayoutSlice:
        sub = Layout(it.slice_(crd, self.inner.shape), it.slice_(crd, self.inner.stride))
        offset = arith.add(self.offset, self.inner.crd2idx(crd))
        return LayoutSlice(ComposedLayout(self.outer, offset, sub), 0)

    def is_static(self) -> bool:
        """True when the offset and the inner layout (and an outer layout) are static."""
        outer_static = not isinstance(self.outer, Layout) or self.outer.is_static()
        return is_static(self.offset) and self.inner.is_static() and outer_static

    def __str__(self) -> str:
        return f"{self.outer} o {self.offset} o {self.inner}"

    def __repr__(self) -> str:
        return f"ComposedLayout({self.outer!r}, {self.offset!r}, {self.inner!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ComposedLayout):
            return NotImplemented
        if not (self.is_static() and other.is_static()):
            raise LayoutError("ComposedLayout equality is only defined for static layouts")
        return (self.outer, self.offset, self.inner) == (other.outer, other.offset, other.inner)

    def __hash__(self) -> int:
        if not self.is_static():
            raise LayoutError("ComposedLayout hashing is only defined for static layouts")
        return hash((self.outer, self.offset, self.inner))


_SWIZZLE_BITS = {16: 0, 32: 1, 64: 2, 128: 3}


def make_swizzle_atom(mode_bytes: int, element_bits: int, k_major: bool = True) -> ComposedLayout:
    """The Hopper GMMA shared-memory layout atom, in units of elements.

    ``mode_bytes`` selects the swizzle mode: 128, 64, 32 (``SW128``/``SW64``/``SW32``) or 16
    (``INTER``: interleaved, no swizzle). The atom is 8 rows of ``mode_bytes`` bytes
    (``(8, n):(n, 1)`` K-major, ``(n, 8):(1, n)`` MN-major, ``n = mode_bytes * 8 // element_bits``),
    i.e. CUTLASS ``GMMA::Layout_{K,MN}_{INTER,SW32,SW64,SW128}_Atom<T>``.

    CUTLASS's ``Swizzle<B,4,3>`` acts on *byte* addresses; here the swizzle is rescaled to act on
    *element* offsets so that ``atom(crd)`` is the element offset from a base aligned to
    1024 bytes (the swizzle period): ``Swizzle<B, 4 + 3 - log2(element_bits), 3>``, e.g.
    ``Sw<3,3,3> o 0 o (8,64):(64,1)`` for 16-bit K-major SW128.
    """
    if mode_bytes not in _SWIZZLE_BITS:
        raise LayoutError(f"make_swizzle_atom: mode_bytes must be one of 16 (INTER), 32, 64, 128; got {mode_bytes!r}")
    log2_bits = arith.log2_exact(element_bits) if isinstance(element_bits, int) else None
    if log2_bits is None or element_bits > 128:
        raise LayoutError(f"make_swizzle_atom: element_bits must be a power of two <= 128, got {element_bits!r}")
    n = mode_bytes * 8 // element_bits
    layout = Layout((8, n), (n, 1)) if k_major else Layout((n, 8), (1, n))
    return ComposedLayout(Swizzle(_SWIZZLE_BITS[mode_bytes], 7 - log2_bits, 3), 0, layout)
