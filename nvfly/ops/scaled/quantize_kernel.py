"""Quantisation to fp8 with amax scales (nvfly.ops.scaled.quantize's scale choice, bit for bit): memory-bound, x
read once (values held in registers between the amax and the stores), 16-byte non-coherent loads with several in
flight per thread before any reduction.

Each thread moves chunks of 8 consecutive elements (one 16-byte ``ld.global.nc.v4`` of bf16/fp16, two of fp32;
``PLAN.chunk`` 16: twice that; K a multiple of 16, so a chunk never crosses a row's end). A group is
``PLAN.group_rows`` x ``PLAN.group_cols`` elements (group_cols 0: a whole row). Small groups (1x128, MX's 1x32)
take group_cols / chunk lanes each and each thread ``PLAN.unroll`` groups, all loads issued before the butterfly
amax (16-bit x: two groups a butterfly, ``PLAN.pair_groups``); large ones (a row, a 128x128 block) one block each,
every thread loading its ``PLAN.chunks`` chunks before the block's amax (rows longer than threads x chunks x chunk
elements: ``PLAN.sweeps`` passes, the values read again for the stores). scale = max(amax, AMAX_FLOOR) * (1 /
FP8_MAX) (an fp32 multiply, as the reference; MX: a power of two) and q = fp8(x / scale) rounded to nearest even,
saturating (the reference's clamp), the quotient ``div.rn.f32``'s: MX multiplies by the scale's exact reciprocal,
fp8 scales divide through one reciprocal per group (``arch.floats.divide``; a scale that is inf or NaN by
``div.rn.f32``). A chunk's fp8 values are stored as 32-bit words of four (``q`` passed as int32 words); MXFP4:
its e2m1 codes as words of eight (``PLAN.e2m1_pairs``: rounded in bf16x2). Loads and stores stream (L1
no_allocate, L2 evict_first; ``PLAN.hints`` False: plain): every byte is touched once (long rows' sweeps: twice,
the first read left in L2).
"""
from __future__ import annotations

from dataclasses import dataclass

import nvfly
from nvfly.arch.floats import (bf16x2_to_e2m1x8, divide, division_reciprocal, f32_to_e2m1, f32x2_to_fp8x2,
                               max_abs_x2, max_x2, permute_bytes)
from nvfly.arch.memory import L1Eviction, L2Policy, load_global, store_global
from nvfly.arch.reduce import block_reduce

CHUNK = 8  # elements a thread loads at once: 16 bytes of bf16/fp16, 32 of fp32
STREAM_L1 = L1Eviction.NO_ALLOCATE
STREAM_L2 = L2Policy.EVICT_FIRST
FLT_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class QuantizePlan:
    """group_rows x group_cols groups (group_cols 0: whole rows); per_warp: group_cols / chunk lanes per group (a
    power of two up to 32), each thread ``unroll`` groups, else one block of ``threads`` per group, each thread
    ``chunks`` chunks of ``chunk`` elements per sweep, ``sweeps`` sweeps (1: the values stay in registers); loads:
    16-byte loads per chunk (chunk 8: 2 for fp32 x); fp8: the target dtype's name ("e2m1": MXFP4);
    inv_fp8_max (1 / the dtype's largest value), amax_floor: the scale choice; mx_emax >= 0: MX scales instead (an
    e8m0 byte per group, 2^(floor(log2 amax) - mx_emax), OCP's rule), the scale tensor then uint8; e2m1_pairs
    (MXFP4): bf16 x's groups without a NaN rounded two values an instruction (``bf16x2_to_e2m1x8``; fp16 and fp32
    x keep the f32 rounding)."""
    group_rows: int
    group_cols: int
    per_warp: bool
    threads: int
    fp8: str
    inv_fp8_max: float
    amax_floor: float
    mx_emax: int = -1
    unroll: int = 1
    chunks: int = 1
    sweeps: int = 1
    loads: int = 1
    groups_per_row: int = 0  # per_warp: K's groups, a constant (a multiply, not a division, per group); 0: from cols
    e2m1_pairs: bool = False
    chunk: int = CHUNK  # elements a thread loads at once (8 or 16: 16 or 32 bytes of bf16, two 16-byte loads)
    min_blocks: int = 0  # > 0: ptxas asked to fit that many blocks per SM (without it, it may sink loads past shuffles)
    pair_groups: bool = True  # per_warp, 16-bit x: two groups' amaxes reduced in one packed word (_paired_amaxes)
    hints: bool = True  # x's loads and the values' stores streaming (L1 no_allocate, L2 evict_first); False: plain


@nvfly.func
def _load(x, row, col, valid, PLAN, REREAD=False):
    """The chunk of 8 elements at (row, col) as 32-bit words (zeros where ``valid`` is false: nothing is read);
    REREAD: read again later, so left in L2 at normal priority."""
    words = []
    for h in nvfly.static_range(PLAN.loads):
        words += load_global(x.address(row, col + h * (PLAN.chunk // PLAN.loads)), 4, valid, non_coherent=True,
                             l1=STREAM_L1 if PLAN.hints else None,
                             policy=(L2Policy.EVICT_NORMAL if REREAD else STREAM_L2) if PLAN.hints else None)
    return words


@nvfly.func
def _store_values(address, words, valid, PLAN):
    """The quantised words stored streaming (PLAN.hints: L1 no_allocate, L2 evict_first; else plain)."""
    store_global(address, words, valid, l1=STREAM_L1 if PLAN.hints else None, policy=STREAM_L2 if PLAN.hints else None)


@nvfly.func
def _values(x, words):
    v = nvfly.make_vector(words, nvfly.i32).bitcast(x.dtype).to(nvfly.f32)
    return [v[e] for e in range(len(words) * 32 // x.dtype.bits)]


@nvfly.func
def _amax(x, words, amax, PLAN):
    """max(amax, the chunk's largest magnitude): 16-bit pairs compared packed (exact: the max is one of them)."""
    if x.dtype.bits == 16:
        pair = nvfly.make_vector([max_abs_x2(words, x.dtype)], nvfly.i32).bitcast(x.dtype).to(nvfly.f32)
        return nvfly.maximum(amax, nvfly.maximum(pair[0], pair[1]))
    for v in _values(x, words):
        amax = nvfly.maximum(amax, abs(v))
    return amax


@nvfly.func
def _paired_amaxes(x, chunks, LANES, PLAN):
    """PLAN.pair_groups and 16-bit x: the amaxes of the per-warp groups (one chunk of ``chunks`` a lane, LANES lanes
    a group) on every lane, two groups at a time, their maxima packed in one word through the butterfly (``max.NaN``
    on the pair: exact, the f32 max of the same values), half the shuffles and maxima; the rest (fp32 x, an odd
    last group) are left to the caller's f32 reduction."""
    amaxes = []
    paired = len(chunks) // 2 * 2 if x.dtype.bits == 16 and PLAN.pair_groups else 0
    for i in nvfly.static_range(0, paired, 2):
        first, second = max_abs_x2(chunks[i], x.dtype), max_abs_x2(chunks[i + 1], x.dtype)
        # (first's low, second's low) against (first's high, second's high): each group's largest in its half
        most = max_x2(permute_bytes(first, second, 0x5410), permute_bytes(first, second, 0x7632), x.dtype)
        offset = LANES // 2
        while offset:  # warp_reduce's butterfly
            most = max_x2(most, nvfly.shfl_xor(most, offset, LANES), x.dtype)
            offset //= 2
        pair = nvfly.make_vector([most], nvfly.i32).bitcast(x.dtype).to(nvfly.f32)
        amaxes += [pair[0], pair[1]]
    return amaxes


@nvfly.func
def _quantized(values, s, inv, PLAN, FAST):
    """``values`` / s as f32: MX, times the exact reciprocal ``inv`` of the power of two s (the quotient itself);
    else ``divide`` by s with ``inv = division_reciprocal(s)`` (FAST: s finite) or ``div.rn.f32`` (s inf or NaN)."""
    if PLAN.mx_emax >= 0:
        return [v * inv for v in values]
    if FAST:
        return [divide(v, s, inv) for v in values]
    return [v / s for v in values]


@nvfly.func
def _store_quantized(x, q32, words, row, col, valid, s, inv, PLAN, FAST=True):
    """A chunk's values (``words`` as loaded) divided by the scale s and stored from element (row, col): a 32-bit
    word of fp8 per 4 values, or of e2m1 codes per 8 (the lowest nibble first)."""
    if PLAN.fp8 == "e2m1" and PLAN.e2m1_pairs and FAST and x.dtype == nvfly.bf16:
        codes = [bf16x2_to_e2m1x8(words[4 * i:4 * i + 4], inv) for i in range(len(words) // 4)]
        _store_values(q32.address(row, col // 8), codes, valid, PLAN)
        return
    y = _quantized(_values(x, words), s, inv, PLAN, FAST)
    if PLAN.fp8 == "e2m1":
        codes = [f32_to_e2m1(v, not FAST) for v in y]
        packed = []
        for i in nvfly.static_range(len(y) // 8):
            word = codes[8 * i]
            for e in nvfly.static_range(1, 8):
                word = word | (codes[8 * i + e] << (4 * e))
            packed.append(word)
        _store_values(q32.address(row, col // 8), packed, valid, PLAN)
    else:
        dtype = nvfly.f8e4m3 if PLAN.fp8 == "f8e4m3" else nvfly.f8e5m2
        pairs = [f32x2_to_fp8x2(y[2 * p], y[2 * p + 1], dtype) for p in range(len(y) // 2)]
        words = nvfly.make_vector(pairs).bitcast(nvfly.i32).tolist()
        _store_values(q32.address(row, col // 4), words, valid, PLAN)


@nvfly.func
def _store_group_part(x, q32, spots, s, inv, fast, PLAN):
    """The chunks ``spots`` ((row, col, valid, words)) of one group quantised by its scale s. ``fast`` (``_scale``'s)
    false: fp8 scales inf or NaN, divided by ``div.rn.f32`` instead of ``divide``; MXFP4 groups holding a NaN, the
    e2m1 rounding checking for it (MXFP8 has no slow case)."""
    if (PLAN.mx_emax >= 0 and PLAN.fp8 != "e2m1") or fast:  # MXFP8: a constant condition, no branch
        for row, col, valid, words in spots:
            _store_quantized(x, q32, words, row, col, valid, s, inv, PLAN)
    else:
        for row, col, valid, words in spots:
            _store_quantized(x, q32, words, row, col, valid, s, inv, PLAN, False)


@nvfly.func
def _scale(amax, PLAN):
    """(the f32 scale s, the value stored in the scale tensor, the reciprocal the values are multiplied by: MX's
    exact 1 / s, else ``division_reciprocal(s)``; whether the group takes the fast path: amax not NaN (MX), s
    finite (fp8))."""
    if PLAN.mx_emax >= 0:
        # e8m0: the biased exponent of amax less emax, in [0, 254]; 2^(byte - 127) (byte 0: the subnormal 2^-127),
        # its reciprocal 2^(127 - byte) (byte 254: the subnormal 2^-127), both exact
        byte = nvfly.minimum(nvfly.maximum(((amax.bitcast(nvfly.i32) >> 23) & 0xFF) - PLAN.mx_emax, 0), 254)
        s = nvfly.select(byte == 0, nvfly.i32(0x00400000), byte << 23).bitcast(nvfly.f32)
        inv = nvfly.select(byte == 254, nvfly.i32(0x00400000), (254 - byte) << 23).bitcast(nvfly.f32)
        return s, byte.to(nvfly.u8), inv, amax == amax
    s = nvfly.maximum(amax, PLAN.amax_floor) * PLAN.inv_fp8_max
    return s, s, division_reciprocal(s), s <= FLT_MAX


@nvfly.func
def _block_chunk(c, grow, gcol, gcols, rows, cols, PLAN):
    """(row, col, valid) of the group's chunk ``c`` (row-major over the group's rows of gcols / chunk chunks)."""
    if PLAN.group_rows == 1:
        row = grow
        col = gcol * gcols + c * PLAN.chunk
        valid = (row < rows) & (col < cols)
    else:
        per_row = PLAN.group_cols // PLAN.chunk
        r = c // per_row
        row = grow * PLAN.group_rows + r
        col = gcol * gcols + (c - r * per_row) * PLAN.chunk
        valid = (r < PLAN.group_rows) & (row < rows) & (col < cols)
    return row, col, valid


@nvfly.kernel
def quantize_kernel(x: nvfly.Tensor, q32: nvfly.Tensor, scale: nvfly.Tensor, rows: nvfly.i32, cols: nvfly.i32,
                    PLAN: nvfly.Constexpr):
    """x (rows, cols) 16/32-bit -> q32 (rows, cols / 4) fp8 words (e2m1: (rows, cols / 8)) and scale (rows /
    group_rows, cols / group_cols), indexed [group row, group column] through its strides."""
    tid = nvfly.thread_idx.x
    if PLAN.min_blocks:
        nvfly.min_blocks_per_sm(PLAN.min_blocks)
    if PLAN.per_warp:
        LANES = PLAN.group_cols // PLAN.chunk  # lanes per group
        GROUPS = PLAN.threads // LANES  # groups per block and unroll step
        groups_per_row = PLAN.groups_per_row or (cols + PLAN.group_cols - 1) // PLAN.group_cols
        lane_col = (tid % LANES) * PLAN.chunk
        # every load first (unroll x 16..32 bytes in flight per thread), then the reductions and stores; no branch
        # before the shuffles: a warp may hold groups of two rows, or past the last row (masked to 0)
        spots = []
        for u in nvfly.static_range(PLAN.unroll):
            group = (nvfly.block_idx.x * PLAN.unroll + u) * GROUPS + tid // LANES
            row = group // groups_per_row
            gcol = group - row * groups_per_row
            col = gcol * PLAN.group_cols + lane_col
            valid = (row < rows) & (col < cols)
            spots.append((row, gcol, col, valid, _load(x, row, col, valid, PLAN)))
        paired = _paired_amaxes(x, [words for _, _, _, _, words in spots], LANES, PLAN)
        for i, (row, gcol, col, valid, words) in enumerate(spots):
            amax = paired[i] if i < len(paired) else nvfly.warp_reduce(_amax(x, words, 0.0, PLAN), "max", LANES)
            s, stored, inv, fast = _scale(amax, PLAN)
            if (tid % LANES == 0) & (row < rows):
                scale[row, gcol] = stored
            _store_group_part(x, q32, [(row, col, valid, words)], s, inv, fast, PLAN)
    else:
        scratch = nvfly.shared_tensor(nvfly.f32, (PLAN.threads // 32,))
        gcols = cols if PLAN.group_cols == 0 else PLAN.group_cols
        groups_per_row = 1 if PLAN.group_cols == 0 else (cols + PLAN.group_cols - 1) // PLAN.group_cols
        grow = nvfly.block_idx.x // groups_per_row
        gcol = nvfly.block_idx.x - grow * groups_per_row
        SPAN = PLAN.chunks * PLAN.threads  # chunks per sweep
        if PLAN.sweeps == 1:  # the group in registers: one read
            spots = []
            for i in nvfly.static_range(PLAN.chunks):
                row, col, valid = _block_chunk(i * PLAN.threads + tid, grow, gcol, gcols, rows, cols, PLAN)
                spots.append((row, col, valid, _load(x, row, col, valid, PLAN)))
            amax = 0.0
            for row, col, valid, words in spots:
                amax = _amax(x, words, amax, PLAN)
            s, stored, inv, fast = _scale(block_reduce(amax, scratch, PLAN.threads, "max"), PLAN)
            if tid == 0:
                scale[grow, gcol] = stored
            _store_group_part(x, q32, spots, s, inv, fast, PLAN)
        else:  # longer rows: the amax sweeping the row, then the values read again (from L2) for the stores
            amax = 0.0
            for sweep in range(PLAN.sweeps):
                for i in nvfly.static_range(PLAN.chunks):
                    row, col, valid = _block_chunk(sweep * SPAN + i * PLAN.threads + tid, grow, gcol, gcols, rows,
                                                   cols, PLAN)
                    amax = _amax(x, _load(x, row, col, valid, PLAN, True), amax, PLAN)
            s, stored, inv, fast = _scale(block_reduce(amax, scratch, PLAN.threads, "max"), PLAN)
            if tid == 0:
                scale[grow, gcol] = stored
            for sweep in range(PLAN.sweeps):
                for i in nvfly.static_range(PLAN.chunks):
                    row, col, valid = _block_chunk(sweep * SPAN + i * PLAN.threads + tid, grow, gcol, gcols, rows,
                                                   cols, PLAN)
                    spot = (row, col, valid, _load(x, row, col, valid, PLAN))
                    _store_group_part(x, q32, [spot], s, inv, fast, PLAN)
