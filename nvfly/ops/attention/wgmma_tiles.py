"""The key-tile pieces the two wgmma decode kernels share (``mla_kernel``: one latent head, ``gqa_kernel``: a GQA
group's packed rows): a consumer thread's running state, a tile's masked scores, O's rescale plus P·V, and the
zeroed tail rows of a V tile; for fp8 caches, an e4m3 tile converted to a 16-bit K-major one and a 16-bit tile
rescaled to f16 in place; a key's page and row in a paged cache. A thread's S/O accumulator elements follow
``softmax.row_of``."""
from __future__ import annotations

from typing import Any, NamedTuple

import nvfly
from nvfly.arch import sm90
from nvfly.arch.floats import store_e4m3x16
from nvfly.arch.memory import load_shared, store_shared
from nvfly.ops.attention.softmax import NEG_INF, row_of

ROW_BYTES = 128            # a 64-column box's row of 16-bit values: one 128-byte swizzle row
WARPGROUP = 128


def page_and_row(plan: Any, block_table: Any, b: Any, key: Any) -> tuple[Any, Any]:
    """The TMA coordinates of sequence ``b``'s key ``key`` in the cache: (its page from the block table, the row
    in that page) for a paged plan, else (``b``, ``key``) of the (B, S, H, D) cache."""
    if plan.paged:  # the table's load is in flight while the stage frees up
        return block_table[b, key // plan.page_size], key % plan.page_size
    return b, key


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


def fp8_tile_addresses(index: Any, rows: int) -> tuple:
    """The 16-byte segment a warpgroup's conversion (``convert_fp8_tile``) handles ``index``-th of a ``rows`` x 128
    e4m3 tile: (row, byte offset in the fp8 tile, offsets of its f16 columns' two halves in the 16-bit tile). The
    fp8 tile is one TMA box of 128-byte rows, 128-byte swizzled (segment s of row r at 128 r + 16 (s ^ r % 8)); the
    16-bit tile is K-major as a 16-bit TMA load gives it (64-column boxes of ``rows`` 128-byte rows, 128-byte
    swizzled): fp8 segment s holds f16 segments 2 s and 2 s + 1 of the row (of box s // 4). 16 consecutive indices
    cover rows 2i and 2i + 1, each quarter-warp (8 lanes, one 16-byte shared access's phase) segments 0-3 of one row
    and 4-7 of the other, so that its loads and its stores each hit 8 distinct 16-byte bank groups. Plain
    arithmetic: ints here, traced values in the kernel."""
    m = index % 16
    row = 2 * (index // 16) + (m // 4) % 2
    segment = m % 4 + 4 * (((m // 4) ^ (m // 8)) % 2)
    swizzle = row % 8
    column_box = (segment // 4) * (rows * ROW_BYTES) + row * ROW_BYTES
    return (row, row * ROW_BYTES + (segment ^ swizzle) * 16, column_box + ((2 * (segment % 4)) ^ swizzle) * 16,
            column_box + ((2 * (segment % 4) + 1) ^ swizzle) * 16)


@nvfly.func
def convert_fp8_tile(source, target, thread, valid, ROWS, THREADS):
    """The ROWS x 128 e4m3 tile at ``source`` as the f16 K-major tile at ``target`` (``fp8_tile_addresses``'s
    layouts), rows at or past ``valid`` (None: none) zero (the bytes past a sequence may hold NaN): THREADS threads
    (whole warpgroups; ``thread`` the caller's index among them) each convert ROWS x 8 / THREADS segments, all their
    16-byte loads first (one shared-memory latency, not one a segment: the conversion of K is on the key tile's
    critical path), then order their writes before the async proxy's (wgmma's) reads; the caller's named barrier
    follows."""
    segments = [fp8_tile_addresses(thread + THREADS * i, ROWS) for i in nvfly.static_range(ROWS * 8 // THREADS)]
    loaded = [load_shared(source + fp8_offset, 4) for _, fp8_offset, _, _ in segments]
    for (row, _, low, high), words in zip(segments, loaded):
        if valid is not None:  # e4m3 0x00 is +0
            words = [nvfly.select(row < valid, word, 0) for word in words]
        store_e4m3x16(words, target + low, target + high, nvfly.f16)
    sm90.fence_proxy_async()


@nvfly.func
def scale_to_f16(tile, values, scale, thread, BYTES, THREADS):
    """The 16-bit tile of BYTES bytes at shared address ``tile`` (``values``: a shared tensor of its elements) times
    ``scale``, rounded to f16 in place (each 16-byte segment where it was: any swizzle is kept) by THREADS threads
    (``thread`` the caller's index among them), then its writes ordered before the async proxy (wgmma) reads them:
    the caller's named barrier follows."""
    for i in nvfly.static_range(BYTES // 16 // THREADS):
        segment = thread + THREADS * i
        scaled = (values.load(8 * segment, width=8).to(nvfly.f32) * scale).to(nvfly.f16)
        store_shared(tile + 16 * segment, scaled.bitcast(nvfly.i32).tolist())
    sm90.fence_proxy_async()
