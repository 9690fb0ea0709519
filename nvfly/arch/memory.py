"""Cache-hinted global loads and stores, and the one vocabulary of cache hints that they and TMA share.

Hints: ``L2Policy`` (an L2 eviction priority: as a 64-bit policy operand of ``.L2::cache_hint``, either its
constant ``descriptor`` or a register from ``create_policy``; TMA loads take the same), ``L1Eviction`` (an
``.L1::`` eviction qualifier), ``non_coherent`` (``.nc``: the read-only path) and ``prefetch`` (``.L2::<n>B``).
``CacheHint`` pairs an L1 qualifier with an L2 policy for the Tensor-level ``load_hinted`` / ``store_hinted``.

Accesses: ``load_global`` / ``store_global`` (``ld.global`` / ``st.global`` of one or a vector of 32-bit words,
optionally predicated: a load where the predicate is false reads nothing and gives zeros) and ``store_shared``
(``st.shared``).
"""
from __future__ import annotations

import enum
from typing import Any, NamedTuple, Optional, Sequence, Union

from nvfly.arch.ptx import asm, asm_multi
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.tensor import Tensor
from nvfly.frontend.trace import traced
from nvfly.frontend.values import Scalar, as_value, make_vector


class L2Policy(str, enum.Enum):
    """An L2 eviction priority for the lines an access touches: a stream read once goes first, data every block
    re-reads last. Strings with the members' values ("evict_first", ...) are accepted where a policy is."""
    EVICT_FIRST = "evict_first"
    EVICT_NORMAL = "evict_normal"
    EVICT_LAST = "evict_last"

    @property
    def descriptor(self) -> int:
        """The 64-bit policy that ``createpolicy.fractional.L2::<priority>.b64 p, 1.0`` makes (CUTLASS's
        CacheHintSm90 values), usable as an immediate cache-hint operand."""
        return _DESCRIPTORS[self]

    @staticmethod
    def parse(value: Union["L2Policy", str], what: str) -> "L2Policy":
        """``value`` as an L2Policy; a CompileError naming ``what`` and the choices otherwise."""
        try:
            return L2Policy(value)
        except ValueError:
            raise CompileError(f"{what}: cache hint {value!r}: expected one of "
                               f"{', '.join(p.value for p in L2Policy)}") from None


_DESCRIPTORS = {L2Policy.EVICT_FIRST: 0x12F0000000000000, L2Policy.EVICT_NORMAL: 0x1000000000000000,
                L2Policy.EVICT_LAST: 0x14F0000000000000}


class L1Eviction(str, enum.Enum):
    """An L1 eviction qualifier of a global access (``.L1::<value>``)."""
    EVICT_NORMAL = "evict_normal"
    EVICT_FIRST = "evict_first"
    EVICT_LAST = "evict_last"
    EVICT_UNCHANGED = "evict_unchanged"
    NO_ALLOCATE = "no_allocate"


Policy = Union[L2Policy, str, Scalar]


@traced
def create_policy(priority: Union[L2Policy, str]) -> Scalar:
    """A register holding the L2 eviction policy ``priority`` for every line (``createpolicy.fractional.L2::
    <priority>.b64 p, 1.0``), to give to many accesses."""
    priority = L2Policy.parse(priority, "create_policy")
    return asm(f"createpolicy.fractional.L2::{priority.value}.b64 $0, 1.0;", result=dtypes.i64, side_effects=False)


def policy_operand(policy: Policy, what: str) -> Scalar:
    """The 64-bit operand of ``.L2::cache_hint``: a ``create_policy`` register, or an L2Policy's descriptor."""
    if isinstance(policy, Scalar):
        if policy.dtype != dtypes.i64:
            raise CompileError(f"{what}: a cache policy is an i64 (create_policy), got {policy.dtype.name}")
        return policy
    return as_value(L2Policy.parse(policy, what).descriptor, dtypes.i64)


def _qualifiers(what: str, words: int, l1: Optional[Union[L1Eviction, str]], policy: Optional[Policy]) -> str:
    if words not in (1, 2, 4):
        raise CompileError(f"{what} moves 1, 2 or 4 32-bit words, got {words}")
    text = ""
    if l1 is not None:
        try:
            text += f".L1::{L1Eviction(l1).value}"
        except ValueError:
            raise CompileError(f"{what}: L1 eviction {l1!r}: expected one of "
                               f"{', '.join(e.value for e in L1Eviction)}") from None
    return text + ("" if policy is None else ".L2::cache_hint")


def _register_list(first: int, n: int) -> str:
    text = ", ".join(f"${first + i}" for i in range(n))
    return text if n == 1 else "{" + text + "}"


def _word_type(words: int) -> str:
    # the spellings of the kernels' loads and stores: one word as .b32, vectors as .u32 (the same bits to ptxas)
    return ".b32" if words == 1 else f".v{words}.u32"


def _predicate(valid: Any) -> Scalar:
    """The access's predicate as the 32-bit operand of ``setp.ne.b32``: an i1, or a 32-bit integer (nonzero)."""
    v = as_value(valid)
    if isinstance(v, Scalar) and v.dtype == dtypes.i1:
        return v.to(dtypes.i32)
    if not isinstance(v, Scalar) or not v.dtype.is_int or v.dtype.bits != 32:
        raise CompileError(f"an access predicate is a boolean (i1) or a 32-bit integer, got {getattr(v, 'dtype', v)}")
    return v


@traced
def load_global(address: Any, words: int = 1, valid: Any = None, non_coherent: bool = False,
                l1: Optional[Union[L1Eviction, str]] = None, policy: Optional[Policy] = None,
                prefetch: Optional[int] = None) -> Any:
    """``words`` (1, 2 or 4) 32-bit words at the global ``address`` (aligned to their size) as i32: one Scalar,
    or a list for a vector (``ld.global[.nc][.L1::<l1>][.L2::cache_hint][.L2::<prefetch>B]``). ``valid`` (i1):
    where it is false nothing is read and the words are zero. ``non_coherent``: the read-only path (data no
    thread writes during the kernel); ``l1``: an L1Eviction; ``policy``: an L2 eviction policy (L2Policy or a
    ``create_policy`` register); ``prefetch``: 64, 128 or 256 bytes of L2 prefetch."""
    text = "ld.global" + (".nc" if non_coherent else "") + _qualifiers("load_global", words, l1, policy)
    if prefetch is not None:
        if prefetch not in (64, 128, 256):
            raise CompileError(f"load_global: prefetch must be 64, 128 or 256 bytes, got {prefetch!r}")
        text += f".L2::{prefetch}B"
    inputs: list[Any] = [] if valid is None else [_predicate(valid)]
    inputs.append(address)
    if policy is not None:
        inputs.append(policy_operand(policy, "load_global"))
    at = words + (0 if valid is None else 1)  # the address operand: after the results and the predicate
    load = (f"{text}{_word_type(words)} {_register_list(0, words)}, [${at}]"
            f"{'' if policy is None else f', ${at + 1}'};")
    if valid is not None:
        zeros = " ".join(f"mov.b32 ${i}, 0;" for i in range(words))
        load = f"{{ .reg .pred p; setp.ne.b32 p, ${words}, 0; {zeros} @p {load} }}"
    if words == 1:
        return asm(load, inputs, dtypes.i32, side_effects=False)
    return asm_multi(load, [dtypes.i32] * words, inputs, side_effects=False)


@traced
def store_global(address: Any, words: Sequence[Any], valid: Any = None,
                 l1: Optional[Union[L1Eviction, str]] = None, policy: Optional[Policy] = None) -> None:
    """Store 1, 2 or 4 32-bit ``words`` at the global ``address`` (aligned to their size)
    (``st.global[.L1::<l1>][.L2::cache_hint]``); nothing where ``valid`` (i1) is false. ``l1`` and ``policy`` as
    for ``load_global``."""
    words = list(words)
    text = "st.global" + _qualifiers("store_global", len(words), l1, policy) + _word_type(len(words))
    inputs: list[Any] = [] if valid is None else [_predicate(valid)]
    first = len(inputs)  # the address operand, then the words, then the policy
    inputs += [address, *words]
    if policy is not None:
        inputs.append(policy_operand(policy, "store_global"))
    store = (f"{text} [${first}], {_register_list(first + 1, len(words))}"
             f"{'' if policy is None else f', ${first + 1 + len(words)}'};")
    if valid is not None:
        store = f"{{ .reg .pred p; setp.ne.b32 p, $0, 0; @p {store} }}"
    asm(store, inputs)


@traced
def load_shared(address: Any, words: int = 1) -> list:
    """Load 1, 2 or 4 32-bit words from the 32-bit shared-memory ``address`` (aligned to their size)
    (``ld.shared[.v2|.v4].b32``)."""
    if words not in (1, 2, 4):
        raise CompileError(f"load_shared loads 1, 2 or 4 32-bit words, got {words}")
    if words == 1:  # one result: a scalar asm (LLVM takes no one-field struct from inline asm)
        return [asm("ld.shared.b32 $0, [$1];", [address], dtypes.i32)]
    return asm_multi(f"ld.shared.v{words}.b32 {_register_list(0, words)}, [${words}];", [dtypes.i32] * words,
                     [address])


def store_shared(address: Any, words: Sequence[Any]) -> None:
    """Store 1, 2 or 4 32-bit ``words`` at the 32-bit shared-memory ``address`` (aligned to their size)
    (``st.shared[.v2|.v4].b32``)."""
    words = list(words)
    if len(words) not in (1, 2, 4):
        raise CompileError(f"store_shared stores 1, 2 or 4 32-bit words, got {len(words)}")
    vector = "" if len(words) == 1 else f".v{len(words)}"
    asm(f"st.shared{vector}.b32 [$0], {_register_list(1, len(words))};", [address, *words])


class CacheHint(NamedTuple):
    """The hints of a Tensor-level access (``load_hinted`` / ``store_hinted``): an L1 eviction qualifier and an
    L2 policy."""
    l1: L1Eviction
    policy: Policy


def _hinted_words(t: Tensor, width: int, hint: Optional[CacheHint]) -> int:
    """How many 32-bit words a hinted access of ``width`` elements moves; 0 when it stays a plain access (no
    hint, or not an 8- or 16-byte vector)."""
    words = width * t.dtype.itemsize // 4
    return words if hint is not None and words in (2, 4) else 0


@traced
def load_hinted(t: Tensor, coord: tuple, width: int, mask: Any = None, hint: Optional[CacheHint] = None) -> Any:
    """``t.load(*coord, width=width, mask=mask)``; with ``hint`` and an 8- or 16-byte vector, one cache-hinted
    ``ld.global`` instead (zeros where ``mask`` is false: nothing is read). Narrower accesses stay plain."""
    words = _hinted_words(t, width, hint)
    if hint is None or not words:
        return t.load(*coord, width=width, mask=mask)
    valid = None if mask is None else _predicate(mask)
    loaded = load_global(t.address(*coord), words, valid, l1=hint.l1, policy=hint.policy)
    return make_vector(loaded, dtypes.i32).bitcast(t.dtype)


@traced
def store_hinted(t: Tensor, value: Any, coord: tuple, width: int, mask: Any = None,
                 hint: Optional[CacheHint] = None) -> None:
    """``t.store(value, *coord, mask=mask)`` of ``width`` elements; with ``hint`` and an 8- or 16-byte vector,
    one cache-hinted ``st.global``."""
    value = value.to(t.dtype)
    words = _hinted_words(t, width, hint)
    if hint is None or not words:
        t.store(value, *coord, mask=mask)
        return
    parts = value.bitcast(dtypes.i32).tolist()
    valid = None if mask is None else _predicate(mask)
    store_global(t.address(*coord), parts, valid, l1=hint.l1, policy=hint.policy)
