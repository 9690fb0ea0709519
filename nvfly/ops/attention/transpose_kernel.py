"""fp8 prefill's V transpose: V (B, Skv, Hkv, Dv) bytes, any strides with a contiguous last dimension, into the
(B, Dv, Hkv, Skv rounded up to 16) copy that the fp8 P·V wgmma reads K-major (``prefill_api.transposed_values``),
with the keys of every 16 permuted into the order of P's fp8 register fragments (``sm90.register_a_k_order``) and
zeros past Skv.

A thread owns one 4-byte column (four Dv values) of ``GROUPS`` groups of 16 keys of one (batch, kv head): it loads
the column of each key (a warp's load reads whole key rows, 64-128 contiguous bytes of each), regroups the bytes in
registers with byte permutes (``group_columns``: six ``prmt`` for every four output words, the key permutation
folded in) and stores, for each of its four Dv values, 16 keys as one 16-byte vector (two of them: a whole 32-byte
sector of the output row). The transpose needs no shared memory, so no bank conflicts and no barrier.

The index mapping (``thread_coordinates``, ``group_columns``) is plain arithmetic on its arguments: the kernel runs
it on traced values, ``transposed_model`` on torch tensors (the CPU tests check that model bit for bit against the
torch copy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import nvfly
from nvfly.arch import sm90
from nvfly.arch.floats import permute_bytes
from nvfly.arch.memory import L1Eviction, L2Policy, load_global, store_global

THREADS = 256
GROUPS = 2  # groups of 16 keys per thread: two 16-byte stores fill a 32-byte sector of an output row
GROUP = 16
# within every 16 keys, output column c holds key ORDER[c] (4q + 2i + j holds key 8i + 2q + j)
ORDER = sm90.register_a_k_order(sm90.WgmmaAtom(16, nvfly.f8e4m3, nvfly.f8e4m3, a_source="registers"))[:GROUP]


@dataclass(frozen=True)
class TransposePlan:
    """The launch of one Dv: ``words`` 4-byte columns per key row, threads laid out (key chunk, column) with the
    column fastest, ``keys_per_block`` keys of one (batch, kv head) per block."""
    dv: int

    @property
    def words(self) -> int:
        return self.dv // 4

    @property
    def keys_per_block(self) -> int:
        return THREADS // self.words * GROUPS * GROUP

    def grid(self, batch: int, heads: int, keys: int) -> tuple[int, int, int]:
        return (-(-keys // self.keys_per_block), heads, batch)


def transpose_plan(dv: int) -> TransposePlan:
    """The plan of a head dim: a multiple of 4 bytes whose 4-byte columns divide a block (Dv 4 to 1024, powers of
    two; fp8 prefill's are 64, 128 and 256)."""
    if dv % 4 or dv > 4 * THREADS or THREADS % (dv // 4):
        raise ValueError(f"v: head dim {dv}: the transpose takes powers of two from 4 to {4 * THREADS}")
    return TransposePlan(dv)


def thread_coordinates(plan: TransposePlan, tile: Any, thread: Any) -> tuple[Any, Any]:
    """(first key, 4-byte column) of ``thread`` in the block of key tile ``tile`` (ints, traced values or tensors)."""
    return tile * plan.keys_per_block + thread // plan.words * (GROUPS * GROUP), thread % plan.words


def group_columns(words: Sequence[Any], permute: Callable[[Any, Any, int], Any]) -> list[list[Any]]:
    """The output of one group: ``words[k]`` holds bytes 0-3 (four Dv values) of key k of the group; result[e][q]
    is word q of the 16 bytes of Dv value e, whose byte b is key ``ORDER[4q + b]``. ``permute(low, high,
    selector)``: ``prmt``'s byte gather."""
    out: list[list[Any]] = [[None] * 4 for _ in range(4)]
    for q in range(4):
        a, b, c, d = (words[ORDER[4 * q + i]] for i in range(4))
        low = (permute(a, b, 0x5140), permute(a, b, 0x7362))   # [a0 b0 a1 b1], [a2 b2 a3 b3]
        high = (permute(c, d, 0x5140), permute(c, d, 0x7362))  # [c0 d0 c1 d1], [c2 d2 c3 d3]
        for e in range(4):
            out[e][q] = permute(low[e // 2], high[e // 2], 0x7632 if e % 2 else 0x5410)
    return out


@nvfly.kernel
def transpose_values_kernel(v: nvfly.Tensor, out: nvfly.Tensor, skv: nvfly.i32, keys: nvfly.i32,
                            PLAN: nvfly.Constexpr):
    """v (B, Skv, Hkv, Dv) and out (B, Dv, Hkv, keys) uint8; block (key tile, kv head, batch)."""
    b, h = nvfly.block_idx.z, nvfly.block_idx.y
    first, column = thread_coordinates(PLAN, nvfly.block_idx.x, nvfly.thread_idx.x)
    loaded = [load_global(v.address(b, first + k, h, 4 * column), 1, first + k < skv, non_coherent=True,
                          l1=L1Eviction.NO_ALLOCATE, policy=L2Policy.EVICT_FIRST)
              for k in nvfly.static_range(GROUPS * GROUP)]
    for g in nvfly.static_range(GROUPS):
        columns = group_columns(loaded[GROUP * g:GROUP * (g + 1)], permute_bytes)
        start = first + GROUP * g
        for e in nvfly.static_range(4):
            store_global(out.address(b, 4 * column + e, h, start), columns[e], start < keys)


def transposed_model(v: "Any") -> "Any":
    """The kernel's mapping run on the CPU: uint8 v (B, Skv, Hkv, Dv) -> (B, Dv, Hkv, Skv rounded up to 16), every
    block and thread's loads, byte permutes and stores evaluated on torch tensors (for the tests)."""
    import torch
    batch, skv, heads, dv = v.shape
    plan = transpose_plan(dv)
    keys = -(-skv // GROUP) * GROUP
    tiles = plan.grid(batch, heads, keys)[0]
    padded = torch.zeros(batch, tiles * plan.keys_per_block, heads, dv, dtype=torch.uint8)
    padded[:, :skv] = v  # the predicated loads: zeros past Skv
    words = padded.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # (B, keys, H, Dv / 4), little-endian
    out = torch.full((batch, dv, heads, keys // 4), -1, dtype=torch.int64)  # -1: a word no thread wrote
    thread = torch.arange(THREADS)
    for tile in range(tiles):
        first, column = thread_coordinates(plan, tile, thread)
        loaded = [words[:, first + k, :, column] for k in range(GROUPS * GROUP)]  # each (threads, B, H)
        for g in range(GROUPS):
            columns = group_columns(loaded[GROUP * g:GROUP * (g + 1)], _permute_model)
            start = first + GROUP * g
            valid = start < keys
            for e in range(4):
                for q in range(4):
                    out[:, (4 * column + e)[valid], :, (start // 4 + q)[valid]] = columns[e][q][valid]
    if (out < 0).any():
        raise AssertionError("transposed_model: an output word no thread stored")
    return out.to(torch.int32).view(torch.uint8).view(batch, dv, heads, keys)


def _permute_model(low: Any, high: Any, selector: int) -> Any:
    """``prmt.b32`` on unsigned 32-bit values (ints or int64 tensors)."""
    both = low | (high << 32)
    result = 0
    for i in range(4):
        result = result | (((both >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i))
    return result
