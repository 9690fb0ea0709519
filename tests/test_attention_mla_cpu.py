"""MLA decode without a GPU: every variant (16, 64, 128 heads; Sq 1 and 2; paged and contiguous; split and not)
compiles for sm_90a to the planned HGMMAs (S from shared memory, P V register-A in one consumer warpgroup and from the
shared P tile in the other) without spills or ptxas warnings, within the planned registers and shared memory; the
layouts the kernel relies on hold (V is the K tile's first 512 columns as an MN-major operand; P's register stores
land where the shared P operand reads them); the split and mask arithmetic keeps exactly the visible keys, and a
float32 model of the kernel's arithmetic matches the reference; the host path launches the kernel (and the
combine); bad arguments raise errors naming them, through decode_mla and decode."""
import importlib
import math
import re
import struct

import pytest
import torch

import nvfly
from nvfly.arch.sm90.wgmma import a_fragment_elements
from nvfly.ops import attention
from nvfly.ops.attention import mla_api
from nvfly.ops.attention.mla_kernel import layouts, p_store_offset

DQK, DV = 576, 512
MP = importlib.import_module("nvfly.ops.attention.mla_plan")  # the package exports the function mla_plan


def hgmma(kernel, shape, a_from_registers):
    a_operand = r"R\d+, " if a_from_registers else ""
    return len(re.findall(rf"HGMMA\.{shape}\.F32(?:\.BF16)? R\d+, {a_operand}gdesc\[", kernel.sass()))


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("sq", [1, 2])
@pytest.mark.parametrize("paged", [False, True])
def test_variants_compile_to_hgmma_without_spills(heads, sq, paged):
    splits = 1 if (heads + sq) % 2 else 6  # both the direct store and the split partials + combine
    plan = MP.MlaPlan(sq, heads, paged, 64 if paged else 0, True, splits)
    kernels = attention.compile_mla(plan)
    kernel = kernels[0]
    sass = kernel.sass()
    assert hgmma(kernel, "64x64x16", a_from_registers=False) == 2 * DQK // 16  # unmasked and masked loops
    assert hgmma(kernel, "64x256x16", a_from_registers=True) == 2 * MP.BLOCK_N // 16
    assert hgmma(kernel, "64x256x16", a_from_registers=False) == 2 * MP.BLOCK_N // 16
    assert "LDL" not in sass and "STL" not in sass
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert not kernel.warnings  # no serialised wgmma (C7515/C7511), setmaxnreg honoured
    assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {MP.PRODUCER_REGS:#x} ;", sass)
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, {MP.CONSUMER_REGS:#x} ;", sass)
    tiles = kernel.count("UTMALDG.4D")  # a tile's 9 boxes (ptxas may unroll the producer's loop)
    assert kernel.count("UTMALDG.3D") == 9 and tiles >= 9 and tiles % 9 == 0  # and Q's 9
    assert len(kernels) == (2 if splits > 1 else 1)


@pytest.mark.parametrize("chunked, evict_first", [(False, False), (True, True)])
def test_load_variants_compile(chunked, evict_first):
    """The plan's load options (the default is chunked, no hint): one full barrier a stage or one a 64-column box
    (the scores' loop waits for each box before its four k-steps, the value warpgroup for the four boxes of its V
    half), and the evict-first hint on the key tiles' TMA loads; the same HGMMAs, no spills, no warnings."""
    plan = MP.MlaPlan(1, 128, True, 64, True, 1, chunked=chunked, evict_first=evict_first)
    kernel = attention.compile_mla(plan)[0]
    assert kernel.count("HGMMA") == 2 * (DQK // 16 + 2 * MP.BLOCK_N // 16)
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == 0 and not kernel.warnings
    waits = kernel.count("SYNCS.PHASECHK.TRANS64.TRYWAIT")
    default = attention.compile_mla(MP.MlaPlan(1, 128, True, 64, True, 1, chunked=not chunked))[0]
    fewer, more = sorted([waits, default.count("SYNCS.PHASECHK.TRANS64.TRYWAIT")])
    assert more - fewer >= 2 * (MP.BOXES - 1 + 4 - 1)  # per loop (unmasked, masked): 9 waits for 1, 4 for 1
    assert kernel.ptx.count(".L2::cache_hint") == (MP.BOXES if evict_first else 0)


def test_chunked_ring_barriers():
    """TmaPipeline with chunks: a stage's full barriers side by side, the empty ones after all of them; one chunk is
    the plain ring's layout; the kernel's barrier area holds Q's and the chunked ring's."""
    from nvfly.arch import sm90
    ring = sm90.TmaPipeline(0, 2, 100, 8, chunks=9)
    assert [ring.full(1, c) for c in range(9)] == [8 * (9 + c) for c in range(9)]
    assert [ring.empty(s) for s in range(2)] == [8 * 18, 8 * 19]
    plain = sm90.TmaPipeline(0, 2, 100, 8)
    assert [plain.full(1), plain.empty(0), plain.empty(1)] == [8, 16, 24]
    assert 8 * (1 + (MP.BOXES + 1) * MP.STAGES) <= MP.BARRIER_BYTES


def test_fp16_compiles():
    kernel = attention.compile_mla(MP.MlaPlan(1, 128, True, 128, False, 1), dtype=nvfly.f16)[0]
    assert re.search(r"HGMMA\.64x256x16\.F32 R\d+, R\d+, gdesc\[", kernel.sass())
    assert not kernel.warnings and kernel.resources.spill_stores == 0


def test_budgets():
    assert MP.PRODUCER_REGS * 128 + MP.CONSUMER_REGS * 256 <= 65536
    assert MP.SMEM_BYTES <= MP.MAX_SMEM
    assert all(offset % 1024 == 0 for offset in (MP.Q_OFFSET, MP.RING_OFFSET, MP.P_OFFSET))


def test_v_is_the_k_tiles_first_512_columns():
    """The K tile, K-major (keys x 576), and V, MN-major (512 columns x keys), lay out the same bytes: P V reads V
    from the tile S read K from."""
    lay = layouts(nvfly.bf16)
    assert all(lay.k_layout.inner((key, column)) == lay.v_layout.inner((column, key))
               for key in range(MP.BLOCK_N) for column in range(DV))
    assert lay.v_desc[0] == MP.BLOCK_N * 128  # 64-column chunks of the tile: N = 256 spans four of them


def hardware_swizzle_128(byte_offset):
    """What a 128-byte-swizzled wgmma operand or TMA box of a 1024-byte aligned tile holds at canonical byte offset
    ``byte_offset``: the 16-byte chunk (bits 4-6) XORed with the row within 8 (bits 7-9)."""
    return byte_offset ^ (((byte_offset >> 7) & 7) << 4)


def test_p_stores_match_the_shared_p_operand():
    """The softmax warpgroup stores register r of P's k-step s (rows w16 + l/4 + 8(r%2), columns 16s + 8(r//2) +
    2(l%4)) where the hardware's swizzle puts the canonical K-major (row, column) the value warpgroup's descriptor
    reads; those are the accumulator elements a_fragment_elements packs, so the descriptor-A P is the register-A P."""
    lay = layouts(nvfly.bf16)
    for row in range(MP.BLOCK_M):
        for column in range(MP.BLOCK_N):
            canonical = lay.p_layout.inner((row, column)) * 2  # the descriptor's view: rows of 128 bytes
            assert canonical == row * 128 + column * 2
            assert p_store_offset(lay, row, column) == hardware_swizzle_128(canonical)
    seen = set()
    for thread in range(128):
        warp, lane = thread // 32, thread % 32
        for step in range(4):
            for reg, (lo, hi) in enumerate(a_fragment_elements(lay.pv_registers, step)):
                row = 16 * warp + lane // 4 + 8 * (reg % 2)
                column = 16 * step + 8 * (reg // 2) + 2 * (lane % 4)
                for element, col in ((lo, column), (hi, column + 1)):  # the accumulator's own (row, column)
                    assert (16 * warp + lane // 4 + 8 * ((element // 2) % 2), 8 * (element // 4) + 2 * (lane % 4)
                            + element % 2) == (row, col)
                    seen.add(lay.p_layout.inner((row, col)))
    assert seen == set(range(MP.BLOCK_M * MP.BLOCK_N))


@pytest.mark.parametrize("sq", [1, 2, 5, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_split_and_mask_arithmetic_keeps_the_visible_keys(sq, causal):
    """For lengths around tile edges and any split count: the splits' tiles cover the sequence's once; tiles before
    unmasked_end keep every key of every query row, and each later tile masks some key of some row."""
    for seqlen in [0, 1, 2, 15, 63, 64, 65, 127, 128, 129, 1000]:
        n_blocks = -(-seqlen // MP.BLOCK_N)
        for splits in [1, 2, 3, 7, 64]:
            tiles = [n for s in range(splits) for n in range(*MP.split_blocks(seqlen, splits, s))]
            assert tiles == list(range(n_blocks))
        middle = MP.unmasked_end(seqlen, sq, causal)
        for n in range(n_blocks):
            keys = range(n * MP.BLOCK_N, (n + 1) * MP.BLOCK_N)
            visible = all(key < seqlen and (not causal or key <= seqlen - sq + t) for key in keys for t in range(sq))
            assert visible == (n < middle), (seqlen, n)


def kernel_model(q, cache, table, seqlens, causal, splits, scale):
    """The MLA kernel's arithmetic in float32 on CPU tensors: per (sequence, row block, split) the 64 packed rows'
    tiles of the split as the kernel reads them (paged: the page from the table, the whole 576 columns, NaN past the
    length left in), mask only from ``unmasked_end`` on, V rows past the length zeroed there, the online softmax
    with P rounded to the input type, the value half rescaled by the softmax half's factors; then the combine
    (with one split: the normalised rows directly)."""
    batch, sq, hq, _ = q.shape
    rows_total = sq * hq
    scale_log2 = scale / math.log(2.0)
    partial_o = torch.zeros(splits, batch, rows_total, DV)
    partial_lse = torch.full((splits, batch, rows_total), float("-inf"))
    for b in range(batch):
        seqlen = int(seqlens[b])
        middle = MP.unmasked_end(seqlen, sq, causal)
        for m in range(-(-rows_total // MP.BLOCK_M)):
            packed = torch.arange(m * MP.BLOCK_M, (m + 1) * MP.BLOCK_M)
            valid_rows = packed < rows_total
            qt = torch.zeros(MP.BLOCK_M, DQK)
            qt[valid_rows] = q[b].reshape(rows_total, DQK)[packed[valid_rows]].float()
            positions = seqlen - sq + packed // hq
            for split in range(splits):
                begin, end = MP.split_blocks(seqlen, splits, split)
                top = torch.full((MP.BLOCK_M,), float("-inf"))
                total = torch.zeros(MP.BLOCK_M)
                acc = torch.zeros(MP.BLOCK_M, DV)
                for n in range(begin, end):
                    keys = torch.arange(n * MP.BLOCK_N, (n + 1) * MP.BLOCK_N)
                    if table is None:
                        tile = torch.zeros(MP.BLOCK_N, DQK)  # TMA's zero fill past the capacity
                        inside = keys < cache.shape[1]
                        tile[inside] = cache[b, keys[inside], 0].float()
                    else:
                        page = int(table[b, n * MP.BLOCK_N // cache.shape[1]])
                        first = n * MP.BLOCK_N % cache.shape[1]
                        tile = cache[page, first:first + MP.BLOCK_N, 0].float()
                    s = qt @ tile.T
                    values = tile[:, :DV].clone()
                    if n >= middle:
                        keep = (keys[None, :] < seqlen) & ((keys[None, :] <= positions[:, None]) if causal else True)
                        s = torch.where(keep, s, float("-inf"))
                        values[keys >= seqlen] = 0.0
                    new_top = torch.maximum(top, s.max(dim=1).values)
                    reference = torch.where(new_top == float("-inf"), 0.0, new_top) if n >= middle else new_top
                    rescale = torch.exp2(top * scale_log2 - reference * scale_log2)
                    p = torch.exp2(s * scale_log2 - (reference * scale_log2)[:, None])
                    total = total * rescale + p.sum(dim=1)
                    p16 = p.to(q.dtype).float()
                    acc[:, :DV // 2] = acc[:, :DV // 2] * rescale[:, None] + p16 @ values[:, :DV // 2]
                    acc[:, DV // 2:] = acc[:, DV // 2:] * rescale[:, None] + p16 @ values[:, DV // 2:]
                    top = new_top
                kept = total > 0
                o = torch.where(kept[:, None], acc / total.clamp_min(1e-30)[:, None], 0.0)
                row_lse = torch.where(kept, (top * scale_log2 + torch.log2(total.clamp_min(1e-30))) * math.log(2.0),
                                      float("-inf"))
                partial_o[split, b, packed[valid_rows]] = o[valid_rows]
                partial_lse[split, b, packed[valid_rows]] = row_lse[valid_rows]
    top = partial_lse.max(dim=0).values
    weights = torch.exp(partial_lse - torch.where(top == float("-inf"), 0.0, top))
    total = weights.sum(dim=0)
    out = (weights[..., None] * partial_o).sum(dim=0) / torch.where(total > 0, total, 1.0)[..., None]
    lse = torch.where(total > 0, top + torch.log(total.clamp_min(1e-30)), float("-inf"))
    return out.view(batch, sq, hq, DV), lse.view(batch, sq, hq).transpose(1, 2)


@pytest.mark.parametrize("sq, hq, paged, causal, splits", [
    (1, 16, True, True, 1), (2, 16, False, True, 3), (4, 32, True, False, 2), (3, 24, False, True, 5),
])
def test_kernel_model_matches_the_reference(sq, hq, paged, causal, splits):
    """The kernel's tiling, masking and combine reproduce the float32 reference on ragged lengths around tile edges
    (0, 1, 63, 64, 65, 200) with NaN in every cache row past a length (read, masked and zeroed, never mixed in)."""
    gen = torch.Generator().manual_seed(sq * 100 + hq)
    lengths = [0, 1, 63, 64, 65, 200]
    batch = len(lengths)
    q = torch.randn(batch, sq, hq, DQK, generator=gen).bfloat16()
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    if paged:
        pages_per = 4  # 256 tokens, pages of 64
        cache = torch.randn(batch * pages_per, 64, 1, DQK, generator=gen).bfloat16()
        table = torch.randperm(batch * pages_per, generator=gen).view(batch, pages_per).to(torch.int32)
        slots = torch.arange(pages_per * 64)
        for b, n in enumerate(lengths):
            cache[table[b, slots[n:] // 64].long(), slots[n:] % 64] = float("nan")
    else:
        cache = torch.randn(batch, 230, 1, DQK, generator=gen).bfloat16()
        table = None
        for b, n in enumerate(lengths):
            cache[b, n:] = float("nan")
    scale = DQK ** -0.5
    got, got_lse = kernel_model(q, cache, table, seqlens, causal, splits, scale)
    clean = torch.nan_to_num(cache, nan=0.0)
    want, want_lse = attention.reference(q, clean, clean[..., :DV], cache_seqlens=seqlens, block_table=table,
                                         causal=causal)
    assert not got.isnan().any()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(got_lse), empty) and empty.any()
    torch.testing.assert_close(got_lse[~empty], want_lse[~empty], atol=2e-3, rtol=1e-3)


def test_plan_options():
    default = MP.mla_plan(1, 1, 128, 32768, 132, paged=True, page_size=64)
    assert default.chunked and not default.evict_first and default.full_barriers == MP.BOXES
    varied = MP.mla_plan(1, 1, 128, 32768, 132, paged=True, page_size=64, chunked=False, evict_first=True)
    assert (varied.chunked, varied.evict_first, varied.full_barriers, varied.splits) == (False, True, 1, default.splits)


def test_plan_splits_and_grid():
    v3 = MP.mla_plan(1, 1, 128, 32768, 132, paged=True, page_size=64)
    assert v3.m_blocks == 2 and v3.splits > 1 and v3.grid(1) == (2 * v3.splits, 1)
    assert MP.mla_plan(128, 1, 128, 32768, 132).splits == 1  # 256 CTAs already fill the 132 SMs
    assert MP.mla_plan(1, 2, 16, 4096, 132, splits=3).splits == 3
    assert MP.mla_plan(2, 16, 16, 4096, 132).m_blocks == 4


def test_bytes_and_flops():
    q = torch.zeros(2, 2, 16, DQK, dtype=torch.bfloat16)
    seqlens = torch.tensor([100, 0])
    assert attention.mla_bytes(q, seqlens, 128) == 2 * (q.numel() + 2 * 2 * 16 * DV + 100 * DQK)
    assert attention.mla_flops(q, seqlens, 128) == 2 * (DQK + DV) * 16 * (99 + 100)
    assert attention.mla_flops(q, seqlens, 128, causal=False) == 2 * (DQK + DV) * 16 * 200


# ---------------------------------------------------------------------------------------------- host path
def cache(pages, page):
    return torch.zeros(pages, page, 1, DQK, dtype=torch.bfloat16)


@pytest.fixture
def cpu_launches(recorded_launches, monkeypatch):
    """decode_mla's host path on CPU tensors through the real binder (TMA descriptors holding their tensor's
    address in place of the driver's encoding), on a 132-SM device."""
    from nvfly.runtime.tma import TmaDescriptor

    def descriptor(tensor, box, swizzle=128):
        desc = TmaDescriptor(tensor, box, swizzle)
        desc.raw = struct.pack("<Q", tensor.data_ptr()).ljust(128, b"\0")
        return desc
    monkeypatch.setattr(mla_api, "require_cuda", lambda q, op: None)
    monkeypatch.setattr(mla_api, "sm_count", lambda device: 132)
    monkeypatch.setattr(mla_api, "cached_descriptor", descriptor)
    mla_api._CALLS.clear()  # cached calls hold prepared launches bound to earlier tests' recorders
    yield recorded_launches
    mla_api._CALLS.clear()


def test_host_path_launches_the_mla_kernel(cpu_launches):
    q = torch.zeros(3, 1, 128, DQK, dtype=torch.bfloat16)
    k = cache(3 * 4, 64)
    table = torch.randperm(12).view(3, 4).to(torch.int32)
    seqlens = torch.tensor([256, 0, 100], dtype=torch.int32)
    out, lse = attention.decode(q, k, k[..., :DV], block_table=table, cache_seqlens=seqlens, splits=1,
                                return_lse=True)
    assert out.shape == (3, 1, 128, DV) and lse.shape == (3, 128, 1)
    assert [(name, grid) for name, grid, _ in cpu_launches] == [("attention_mla_kernel", (2, 3, 1))]
    params = cpu_launches[0][2]
    packed = b"".join(p for p in params if isinstance(p, bytes))
    assert struct.pack("<Q", q.data_ptr()) in packed and struct.pack("<Q", k.data_ptr()) in packed
    assert all(t.data_ptr() in params for t in (table, seqlens, out, lse))


def test_host_path_splits_then_combines(cpu_launches):
    q = torch.zeros(1, 2, 16, DQK, dtype=torch.bfloat16)
    k = torch.zeros(1, 4096, 1, DQK, dtype=torch.bfloat16)
    out = attention.decode_mla(q, k)
    plan = MP.mla_plan(1, 2, 16, 4096, 132)
    assert plan.splits > 1 and plan.m_blocks == 1
    assert [(name, grid) for name, grid, _ in cpu_launches] == [
        ("attention_mla_kernel", (plan.splits, 1, 1)), ("attention_combine_kernel", (2 * 16 * 4 // 4, 1, 1))]
    assert out.data_ptr() in cpu_launches[1][2]  # a warp per (row, 128 columns): 4 a row


def test_host_path_caches_the_call(cpu_launches, monkeypatch):
    """A signature's second call checks and plans nothing (the checks are not called again), launches the same
    kernels through the prepared launches with the new call's tensors, and reads the same default lengths (a
    constant tensor: no fill kernel a call)."""
    q = torch.zeros(2, 1, 128, DQK, dtype=torch.bfloat16)
    k = torch.zeros(2, 1024, 1, DQK, dtype=torch.bfloat16)
    first = attention.decode_mla(q, k, splits=3, validate=False)
    checks, check = [], mla_api._check
    monkeypatch.setattr(mla_api, "_check", lambda *args: checks.append(args) or check(*args))
    q2 = torch.zeros_like(q)
    out = torch.empty(2, 1, 128, DV, dtype=torch.bfloat16)
    attention.decode_mla(q2, k, splits=3, validate=False, out=out)  # a new signature (out): checked
    assert len(checks) == 1
    second = attention.decode_mla(q2, k, splits=3, validate=False)
    assert len(checks) == 1 and second.data_ptr() != first.data_ptr()
    names = [name for name, _, _ in cpu_launches]
    assert names == ["attention_mla_kernel", "attention_combine_kernel"] * 3
    seqlens = [next(p for p in params if p not in (first.data_ptr(), second.data_ptr(), out.data_ptr())
                    and isinstance(p, int) and p > 1 << 20) for name, _, params in cpu_launches[::2]]
    assert len(set(seqlens)) == 1
    assert struct.pack("<Q", q2.data_ptr()) in b"".join(p for p in cpu_launches[4][2] if isinstance(p, bytes))
    assert second.data_ptr() in cpu_launches[5][2]
    with pytest.raises(ValueError, match=r"^attention\.decode_mla: scale: .*positive"):
        attention.decode_mla(q2, k, splits=3, validate=False, scale=-1.0)


def test_plan_options_reach_the_host_path(cpu_launches):
    """Calls inside ``plan_options`` plan (and cache) their own variant beside the default's."""
    q = torch.zeros(1, 1, 16, DQK, dtype=torch.bfloat16)
    k = torch.zeros(1, 256, 1, DQK, dtype=torch.bfloat16)
    attention.decode_mla(q, k, splits=1)
    with mla_api.plan_options(chunked=False, evict_first=True):
        attention.decode_mla(q, k, splits=1)
    plans = sorted((c.plan.chunked, c.plan.evict_first) for c in mla_api._CALLS.values())
    assert plans == [(False, True), (True, False)] and len(cpu_launches) == 2


def test_prepared_launches_pack_what_the_full_path_packed(cpu_launches):
    """The same tensors again: the prepared launches of the MLA kernel and the combine pack exactly the bytes the
    first call's full launch path packed (the same descriptors, lengths, partials, scalars)."""
    q = torch.zeros(1, 1, 128, DQK, dtype=torch.bfloat16)
    k = cache(64, 64)
    table = torch.randperm(64).view(1, 64).to(torch.int32)
    out = torch.empty(1, 1, 128, DV, dtype=torch.bfloat16)
    attention.decode_mla(q, k, block_table=table, out=out, validate=False)
    first = list(cpu_launches)
    cpu_launches.clear()
    for _ in range(2):
        attention.decode_mla(q, k, block_table=table, out=out, validate=False)
    assert [name for name, _, _ in first] == ["attention_mla_kernel", "attention_combine_kernel"]
    assert cpu_launches == first * 2


def test_splits_model():
    """mla_splits: the least waves x (longest split's tiles + prologue + partial), the fewest splits among
    equals; never more than the tiles, the SMs or MAX_SPLITS."""
    assert MP.mla_splits(2, 132, 512) == 64  # B 1, 128 heads, 32K: 8 tiles a split on 128 SMs
    assert MP.mla_splits(64, 132, 64) == 2  # B 32, 128 heads, 4K
    assert MP.mla_splits(256, 132, 64) == 1  # B 128: two waves already
    assert MP.mla_splits(32, 132, 512) == 4  # B 32, 16 heads, 32K
    assert MP.mla_splits(1, 132, 3) == 3 and MP.mla_splits(1, 132, 1) == 1
    for ctas in (1, 2, 3, 8, 64, 200):
        for n_blocks in (1, 7, 64, 512, 2048):
            splits = MP.mla_splits(ctas, 132, n_blocks)
            assert 1 <= splits <= min(n_blocks, 132, MP.MAX_SPLITS)


# ---------------------------------------------------------------------------------------------- errors
def inputs():
    return torch.zeros(2, 1, 16, DQK, dtype=torch.bfloat16), torch.zeros(2, 128, 1, DQK, dtype=torch.bfloat16)


@pytest.mark.parametrize("change, argument, kind, message", [
    (lambda q, k: (q.float(), k, None, {}), "q", TypeError, "not supported"),
    (lambda q, k: (q, k.half(), None, {}), "k_cache", TypeError, "differs"),
    (lambda q, k: (q.expand(2, 17, 16, DQK), k, None, {}), "q", ValueError, "1 to 16"),
    (lambda q, k: (q, k.expand(2, 128, 2, DQK), None, {}), "k_cache", ValueError, "one latent KV head"),
    (lambda q, k: (q, k, torch.zeros(2, 128, 1, DV, dtype=torch.bfloat16), {}), "v_cache", ValueError,
     r"k_cache\[..., :512\]"),
    (lambda q, k: (q, k, k[..., 64:], {}), "v_cache", ValueError, "same storage"),
    (lambda q, k: (q, k[:1], None, {}), "k_cache", ValueError, "sequences"),
    (lambda q, k: (q, torch.zeros(8, 32, 1, DQK, dtype=torch.bfloat16), None,
                   {"block_table": torch.zeros(2, 4, dtype=torch.int32)}), "k_cache", ValueError, "multiple of 64"),
    (lambda q, k: (q, k, None, {"block_table": torch.zeros(2, 4)}), "block_table", TypeError, "int32"),
    (lambda q, k: (q, k, None, {"cache_seqlens": torch.zeros(3, dtype=torch.int32)}), "cache_seqlens", ValueError,
     "3 lengths"),
    (lambda q, k: (q, k, None, {"scale": -1.0}), "scale", ValueError, "positive"),
])
def test_argument_errors_name_the_argument(change, argument, kind, message):
    q, k = inputs()
    q, k, v, kwargs = change(q, k)
    with pytest.raises(kind, match=rf"^attention\.decode_mla: {argument}: .*{message}"):
        attention.decode_mla(q, k, v, **kwargs)
    if v is not None:  # through decode: its name, the same check
        with pytest.raises(kind, match=rf"^attention\.decode: {argument}: .*{message}"):
            attention.decode(q, k, v, **kwargs)


def test_decode_refuses_what_mla_has_no_code_for():
    q, k = inputs()
    with pytest.raises(ValueError, match=r"^attention\.decode: score_mod: not supported with MLA"):
        attention.decode(q, k, k[..., :DV], score_mod=lambda s, b, h, qi, ki: s)
    reason = attention.eligibility(q, k, k[..., :DV], mask_mod=lambda b, h, qi, ki: qi >= ki)
    assert "not supported with MLA" in reason
    assert attention.eligibility(q, k, k[..., :DV]) == "q is on cpu, not CUDA"
    assert "same storage" in attention.eligibility(q, k, k[..., :DV].clone())
    attention.api.check_arguments(q, k, k[..., :DV])  # the fake's checks pass the MLA call
    with pytest.raises(ValueError, match="decode_mla: q: on cpu"):
        attention.decode_mla(q, k)
