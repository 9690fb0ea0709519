"""The key-tile pieces the two wgmma decode kernels share (``mla_kernel``: one latent head, ``gqa_kernel``: a GQA
group's packed rows): a consumer thread's running state, a tile's masked scores, O's rescale plus P·V, and the
zeroed tail rows of a V tile. A thread's S/O accumulator elements follow ``softmax.row_of``."""
from __future__ import annotations

from typing import Any, NamedTuple

import nvfly
from nvfly.arch import sm90
from nvfly.arch.memory import store_shared
from nvfly.ops.attention.softmax import NEG_INF, row_of

ROW_BYTES = 128            # a 64-column box's row of 16-bit values: one 128-byte swizzle row
WARPGROUP = 128


class Running(NamedTuple):
    """A consumer thread's running state: its two rows' maxima (raw score units) and thread-partial sums, O (or
    its part of O), and the ring's position."""
    maxima: list
    sums: list
    acc: Any
    stage: Any


def mask_key_tile(scores: list, first_key: Any, seqlen: Any, positions: Any, causal: bool) -> list:
    """A wgmma S fragment's scores of one key tile (a thread's element i: key ``first_key`` + 8 (i // 4) + i % 2 of
    its row ``row_of(i)``) with keys at or past ``seqlen``, and with ``causal`` keys past the row's position
    (``positions[row]``), at -inf."""
    masked = list(scores)
    for i in nvfly.static_range(len(masked)):
        key = first_key + 8 * (i // 4) + i % 2
        keep = key < seqlen
        if causal:
            keep = keep & (key <= positions[row_of(i)])
        masked[i] = nvfly.select(keep, masked[i], NEG_INF)
    return masked


def rescaled_plus_pv(acc: Any, rescales: list, fragments: list, v_tile: Any, atom: Any, v_layout: Any,
                     v_desc: tuple) -> Any:
    """O (a wgmma accumulator) rescaled by its rows' factors, then P·V added: P from registers (``fragments``, one
    per k-step of ``atom``), V the shared tile at ``v_tile`` (``v_layout``, descriptor fields ``v_desc``); waits
    for the wgmmas."""
    acc = acc.map(lambda x, i: x * rescales[row_of(i)])
    sm90.fence()  # P's and O's registers were written since the last wgmma
    for ks in nvfly.static_range(len(fragments)):
        dv = sm90.smem_descriptor(v_tile + v_layout.inner((0, ks * atom.k)) * 2, *v_desc)
        acc = sm90.mma(atom, acc, fragments[ks], dv)
    sm90.commit_group()
    sm90.wait_group(0)
    return acc


@nvfly.func
def zero_tail_rows(tile, valid, thread, barrier, FIRST, BOXES, ROWS):
    """Zero rows [valid, ROWS) of the 64-column boxes FIRST .. FIRST + BOXES - 1 of the V tile at ``tile`` (a row of
    a box is 128 contiguous bytes, its swizzle a permutation within them), then order the writes before the
    warpgroup's wgmma and wait for its threads at named barrier ``barrier``."""
    SEGMENTS = ROWS * BOXES * 8  # 16-byte segments: rows x boxes x 8
    for i in nvfly.static_range(SEGMENTS // WARPGROUP):
        segment = thread + WARPGROUP * i
        row = segment // (8 * BOXES)
        box = FIRST + (segment // 8) % BOXES
        if row >= valid:
            store_shared(tile + box * (ROWS * ROW_BYTES) + row * ROW_BYTES + (segment % 8) * 16, [nvfly.i32(0)] * 4)
    sm90.fence_proxy_async()
    nvfly.named_barrier(barrier, WARPGROUP)
