"""Prefill attention without a GPU: the kernel compiles for sm_90a to HGMMA (register-A for P·V) without spills or
ptxas warnings, the causal tile arithmetic the kernel traces keeps exactly the visible keys, a float model of the
kernel's blocked online softmax (exp2, folded scale, P rounded to the input type) matches the float32 reference, and
bad arguments raise errors naming them."""
import collections
import math
import re
import struct

import pytest
import torch

import nvfly
from nvfly.ops import attention
from nvfly.ops.attention.prefill_api import masking
from nvfly.ops.attention.prefill_plan import (CONSUMER_REGS, HEAD_DIMS, MAX_SMEM, PRODUCER_REGS, PrefillPlan,
                                              block_inside_bounds, causal_offset, key_blocks, pipelined_loops,
                                              upper_inside_end)


def gmma_count(kernel, shape, a_from_registers):
    """HGMMA instructions of ``shape`` whose A operand is a register (``R.., R.., gdesc``) or a descriptor."""
    a_operand = r"R\d+, " if a_from_registers else ""
    return len(re.findall(rf"HGMMA\.{shape}\.F32\.BF16 R\d+, {a_operand}gdesc\[", kernel.sass()))


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dqk, dv", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_plans_compile_to_hgmma_without_spills(dqk, dv, causal):
    plan = attention.prefill_plan(dqk, dv, causal)
    kernel = attention.compile_prefill(plan)
    # in each of the unmasked and the masked loop, and with the overlap the pipeline's first S and last P·V
    traces = 2 + plan.overlap
    s_steps, pv_steps = dqk // 16, plan.block_n // 16
    assert gmma_count(kernel, f"64x{plan.block_n}x16", a_from_registers=False) == traces * s_steps
    assert gmma_count(kernel, f"64x{dv}x16", a_from_registers=True) == traces * pv_steps
    assert kernel.sass().count("HGMMA") == traces * (s_steps + pv_steps)
    assert "LDL" not in kernel.sass() and "STL" not in kernel.sass()
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert not kernel.warnings  # no serialised wgmma (C7515/C7511), setmaxnreg honoured
    assert kernel.count("UTMALDG.4D") >= 3  # Q, K, V (ptxas unrolls the producer loop)
    # the register budgets as planned: the producer gives registers back, the consumers take them
    assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {PRODUCER_REGS:#x} ;", kernel.sass())
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, {CONSUMER_REGS:#x} ;", kernel.sass())
    assert PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * plan.consumers <= 65536
    assert plan.smem_bytes(2) <= MAX_SMEM


def consumer_schedule(kernel):
    """The consumer's SASS as a sequence of events: S (a 64 x block_n HGMMA from shared memory), PV (register-A
    HGMMA), WAIT<n> (WARPGROUP.DEPBAR.LE n), EX2, SYNC/ARRIVE (named barriers other than 0), runs of one kind
    merged."""
    events = []
    for line in kernel.sass().splitlines():
        if "HGMMA" in line:
            event = "PV" if re.search(r"HGMMA\.\S+ R\d+, R\d+, gdesc", line) else "S"
        elif "WARPGROUP.DEPBAR.LE" in line:
            event = "WAIT" + re.search(r"gsb0, (0x\d+)", line).group(1)[-1]
        elif "MUFU.EX2" in line:
            event = "EX2"
        elif re.search(r"BAR\.SYNC\S* R\d+|BAR\.SYNC\S* 0x[12]\b", line):
            event = "SYNC"
        elif re.search(r"BAR\.ARV", line):
            event = "ARRIVE"
        else:
            continue
        if not events or events[-1][0] != event:
            events.append([event, 0])
        events[-1][1] += 1
    return [tuple(e) for e in events]


VARIANTS = [(True, False), (False, True), (False, False)]  # (True, True) at D 128 is the default plan's


@pytest.mark.parametrize("overlap, pingpong", VARIANTS)
def test_overlap_and_pingpong_variants_compile_and_schedule(overlap, pingpong):
    """Each variant of the D 128 causal plan compiles without spills or warnings within the consumers' register
    budget, and its SASS is scheduled as designed: with the overlap, each loop issues the next block's S then the
    pending P·V, waits for S alone (WAIT 1) and runs all of the block's exp2s before waiting for P·V (WAIT 0);
    without it, S and P·V each wait for everything. Ping-pong: each consumer syncs on its named barrier before
    issuing and arrives on the other's after."""
    plan = attention.prefill_plan(128, 128, True, overlap=overlap, pingpong=pingpong)
    kernel = attention.compile_prefill(plan)
    sass = kernel.sass()
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert "LDL" not in sass and "STL" not in sass and not kernel.warnings
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < CONSUMER_REGS
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, {CONSUMER_REGS:#x} ;", sass)
    events = consumer_schedule(kernel)
    kinds = [e for e, _ in events]
    steps, exps = 128 // 16, plan.block_n // 2  # HGMMAs of a GEMM; exp2s of a block (a thread's S elements)
    if overlap:
        # the pipeline's first S (waited for alone), two loops of (S, P·V, WAIT 1, exp2s, WAIT 0), the last P·V
        loop = ["S", "PV", "WAIT1", "EX2", "WAIT0"]
        if pingpong:
            loop = ["SYNC", "S", "PV", "ARRIVE", "WAIT1", "EX2", "WAIT0"]
        body = [k for k in kinds if k != "ARRIVE" or pingpong]
        text = " ".join(body)
        assert text.count(" ".join(loop)) == 2, events
        for i, (event, count) in enumerate(events):
            if event == "WAIT1":  # between the waits: every exp2 of the block and its 2 rescale factors
                assert events[i + 1] == ("EX2", exps + 2) and events[i + 2][0] == "WAIT0", events
        assert ("S", steps) in events and ("PV", steps) in events
        assert kinds.count("WAIT1") == 2 and gmma_count(kernel, "64x128x16", True) == 3 * steps
    else:
        assert "WAIT1" not in kinds and kinds.count("WAIT0") == 4  # S and P·V of each of the two loops
    if pingpong:
        # a sync per loop (without the overlap also one before the first S), as many arrives and consumer 0's first
        assert kinds.count("SYNC") == (2 if overlap else 3) and sass.count("BAR.ARV") == kinds.count("SYNC") + 1
    else:
        assert "SYNC" not in kinds and "BAR.ARV" not in sass


def test_plan_options_defaults_and_the_api_hook(monkeypatch):
    """The measured defaults (ping-pong at every bf16 head dim; the overlap above head dim 128 without mods or a
    BlockMask, whose kernels spill with it), a ping-pong plan needs two consumers, and ``plan_options`` reaches the
    plan ``prefill`` and ``prefill_varlen`` launch."""
    from nvfly.ops.attention import prefill_api
    assert [attention.prefill_plan(dqk, dv, False).overlap for dqk, dv in HEAD_DIMS] == [dqk > 128 for dqk, _ in
                                                                                        HEAD_DIMS]
    assert not any(attention.prefill_plan(dqk, dv, False, mods=True).overlap for dqk, dv in HEAD_DIMS)
    assert not any(attention.prefill_plan(dqk, dv, True, kv_block=128, q_block=128).overlap for dqk, dv in HEAD_DIMS)
    assert all(attention.prefill_plan(dqk, dv, True).pingpong for dqk, dv in HEAD_DIMS)
    with pytest.raises(ValueError, match="two consumer warpgroups"):
        PrefillPlan(128, 128, False, block_m=192, pingpong=True)
    _cpu_prefill(monkeypatch)
    plans = []
    monkeypatch.setattr(prefill_api, "_launch", lambda plan, *args: plans.append(plan))
    q, k, v = _inputs(b=1, sq=40, skv=40, hq=2, hkv=2, d=64)
    attention.prefill(q, k, v)
    with prefill_api.plan_options(overlap=True, pingpong=True):
        attention.prefill(q, k, v, causal=True)
        with prefill_api.plan_options(pingpong=False):
            attention.prefill(q, k, v)
        cu = torch.tensor([0, 40], dtype=torch.int32)
        attention.prefill_varlen(q[0], k[0], v[0], cu, cu)
    attention.prefill(q, k, v)
    assert [(p.overlap, p.pingpong, p.causal, p.varlen) for p in plans] == [
        (False, True, False, False), (True, True, True, False), (False, False, False, False),
        (True, True, False, True), (False, True, False, False)]


def test_fp16_and_no_lse_compile():
    kernel = attention.compile_prefill(PrefillPlan(64, 64, True), dtype=nvfly.f16, return_lse=False)
    assert re.search(r"HGMMA\.64x64x16\.F32 R\d+, R\d+, gdesc\[", kernel.sass())
    assert not kernel.warnings


WINDOWS = [(None, None), (None, 0), (3, 0), (0, 0), (2, None), (5, 2), (None, 4), (11, 1)]


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("bm, bn", [(8, 4), (8, 5), (4, 8)])  # as 128 x 128, 128 x 80 (D 256), and wider keys
def test_key_blocks_keep_exactly_the_visible_keys(alignment, bm, bn):
    """Blocks in [unmasked_start, unmasked_end) are visible to every row of the tile (no mask needed), blocks before
    start and from total on to none of its real rows (never loaded), for lengths around the block sizes, causal
    and sliding windows (left, right) of every kind."""
    for sq in (1, 3, 8, 9, 17):
        for skv in (1, 4, 5, 13, 24):
            for window in WINDOWS:
                b = masking(False, window, alignment)
                offset = causal_offset(sq, skv, alignment)

                def visible(row, key):
                    return (key < skv and (not b.causal or key <= row + offset + b.right)
                            and (not b.window or key >= row + offset - b.left))
                for m in range(-(-sq // bm)):
                    start, low, high, total = key_blocks(m, skv, b.causal, b.window, offset, b.left, b.right, bm, bn)
                    assert 0 <= start <= low <= high <= total <= -(-skv // bn)
                    for n in range(-(-skv // bn)):
                        keys = range(n * bn, n * bn + bn)
                        if low <= n < high:
                            assert all(visible(row, key) for row in range(m * bm, m * bm + bm) for key in keys)
                        if n < start or n >= total:
                            assert not any(visible(row, key) for row in range(m * bm, min(m * bm + bm, sq))
                                           for key in keys), (sq, skv, window, m, n)
                    # the overlapped walk: the first block (masked), then its loops: the same blocks in order, only
                    # fully visible ones without the mask, and all of those but the first
                    walk = [(start, True)] + [(n, masked) for first, end, masked
                                              in pipelined_loops(start, low, high, total) for n in range(first, end)]
                    assert [n for n, _ in walk] == list(range(start, total)) or start == total
                    assert all(masked == (not low <= n < high) for n, masked in walk[1:])
                    # the hoisted walk: blocks before ``both`` need only the lower bound, from unmasked_start on only
                    # the upper ones (the tail and causal)
                    upper = upper_inside_end(m, skv, b.causal, offset, b.right, bm, bn)
                    both = max(min(upper, low), start)
                    rows = range(m * bm, m * bm + bm)
                    for n in range(start, total):
                        keys = range(n * bn, n * bn + bn)
                        if n < both:
                            assert all(key < skv and (not b.causal or key <= row + offset + b.right)
                                       for row in rows for key in keys)
                        if n >= low:
                            assert all(not b.window or key >= row + offset - b.left for row in rows for key in keys)


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_block_inside_bounds_is_exact(alignment):
    """A BlockMask's listed block skips the positional bounds exactly when every key of it is visible to every row
    of the warp (16 rows; here 4 rows and 4- or 5-key blocks, every window kind, lengths around the blocks): never
    when some pair is masked (wrong results), always when none is (speed)."""
    for sq in (3, 8, 13):
        for skv in (4, 5, 13, 24):
            for window in WINDOWS:
                b = masking(False, window, alignment)
                offset = causal_offset(sq, skv, alignment)
                low, high = offset - b.left, offset + b.right

                def visible(row, key):
                    return (key < skv and (not b.causal or key <= row + high)
                            and (not b.window or key >= row + low))
                for bn in (4, 5):
                    for first_row in range(0, sq, 4):
                        for n in range(-(-skv // bn)):
                            inside = block_inside_bounds(first_row, 4, n * bn, bn, skv, b.causal, b.window, low,
                                                         high)
                            want = all(visible(row, key) for row in range(first_row, first_row + 4)
                                       for key in range(n * bn, n * bn + bn))
                            assert inside == want, (sq, skv, window, first_row, n, bn)


def tile_blocks(m, sq, skv, b, offset, bm, bn, block_mask, batch, head):
    """The kernel's walk over a tile's key blocks: (block, positional mask, mask_mod) in order — ``key_blocks``'s
    three loops, or a BlockMask's partial then full list, each listed block as kv_block / bn stages
    (``listed_block``)."""
    if block_mask is None:
        start, low, high, total = key_blocks(m, skv, b.causal, b.window, offset, b.left, b.right, bm, bn)
        return ([(n, True, True) for n in range(start, low)] + [(n, False, True) for n in range(low, high)]
                + [(n, True, True) for n in range(high, total)])
    q_block, kv_block = block_mask.BLOCK_SIZE
    parts = kv_block // bn
    walk = []
    for t, (num, indices) in enumerate(((block_mask.kv_num_blocks, block_mask.kv_indices),
                                        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices))):
        if num is None:
            continue
        bb, hh, qb = min(batch, num.shape[0] - 1), min(head, num.shape[1] - 1), m * bm // q_block
        for i in range(int(num[bb, hh, qb]) * parts):
            walk.append((int(indices[bb, hh, qb, i // parts]) * parts + i % parts, True, t == 0))
    return walk


def blocked_model(q, k, v, causal, scale, alignment, bm=16, bn=8, window=None, score_mod=None, mask_mod=None,
                  block_mask=None, cu_seqlens=None):
    """The kernel's algorithm in float32 on the CPU: tiles of ``bm`` rows walk ``tile_blocks``; rows and keys are
    read from the (packed) tensors from the sequence's start, past its end too (the next sequence's rows; zeros
    past the tensor, as TMA fills), and masked by the tail, causal and window bounds in masked blocks; the mods see
    the row and key clamped to the sequence; maxima in score units, exp2 with the scale (or log2 e after a
    score_mod) folded, sums rescaled, P rounded to the input type before P·V; then O / l and LSE. Padded (B, S, H,
    D) tensors, or packed (T, H, D) ones with ``cu_seqlens`` (q's, k's)."""
    packed = cu_seqlens is not None
    if packed:
        starts_q, starts_k = cu_seqlens[0].tolist(), cu_seqlens[1].tolist()
    else:
        starts_q = [i * q.shape[1] for i in range(q.shape[0] + 1)]
        starts_k = [i * k.shape[1] for i in range(k.shape[0] + 1)]
        q, k, v = q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
    hq, dv = q.shape[1], v.shape[2]
    hkv = k.shape[1]
    b = masking(causal, window, alignment)
    fold = math.log2(math.e) if score_mod is not None else scale / math.log(2.0)
    out = torch.zeros(q.shape[0], hq, dv)
    lse = torch.full((hq, q.shape[0]), float("-inf"))

    def rows_of(source, first, count):
        """``count`` rows of ``source`` from ``first``, zeros past its end."""
        tile = torch.zeros(count, *source.shape[1:])
        present = source[first:first + count]
        tile[:present.shape[0]] = present.float()
        return tile
    sequences = len(starts_q) - 1
    for seq in range(sequences):
        q0, k0 = starts_q[seq], starts_k[seq]
        sq, skv = starts_q[seq + 1] - q0, starts_k[seq + 1] - k0
        # padded sequences end at their tensor's end (TMA zero-fills); packed ones read on into the next sequence
        q_end, k_end = (q.shape[0], k.shape[0]) if packed else (q0 + sq, k0 + skv)
        offset = (skv - sq) if alignment == "bottom_right" else 0
        for h in range(hq):
            for m in range(-(-sq // bm)):
                rows = torch.arange(m * bm, m * bm + bm)
                qt = rows_of(q[:q_end, h], q0 + m * bm, bm)
                top = torch.full((bm,), float("-inf"))
                total = torch.zeros(bm)
                acc = torch.zeros(bm, dv)
                for n, masked, with_mask_mod in tile_blocks(m, sq, skv, b, offset, bm, bn, block_mask, seq, h):
                    keys = torch.arange(n * bn, n * bn + bn)
                    kv_h = h // (hq // hkv)
                    kt, vt = rows_of(k[:k_end, kv_h], k0 + n * bn, bn), rows_of(v[:k_end, kv_h], k0 + n * bn, bn)
                    s = qt @ kt.T
                    mod_rows = rows.clamp(max=sq - 1)[:, None]
                    mod_keys = (keys.clamp(0, skv - 1) if masked else keys)[None, :]
                    if score_mod is not None:
                        s = score_mod(s * scale, torch.tensor(seq), torch.tensor(h), mod_rows, mod_keys).float()
                    keep = torch.ones(bm, bn, dtype=torch.bool)
                    if masked:
                        keep = keep & (keys[None, :] < skv)
                        if b.causal:
                            keep = keep & (keys[None, :] <= rows[:, None] + offset + b.right)
                        if b.window:
                            keep = keep & (keys[None, :] >= rows[:, None] + offset - b.left)
                    mod = mask_mod if block_mask is None else block_mask.mask_mod
                    if mod is not None and with_mask_mod:
                        keep = keep & mod(torch.tensor(seq), torch.tensor(h), mod_rows, mod_keys).bool()
                    s = s.masked_fill(~keep, float("-inf"))
                    new_top = torch.maximum(top, s.max(dim=1).values)
                    reference = torch.where(new_top == float("-inf"), 0.0, new_top)
                    rescale = torch.exp2(top * fold - reference * fold)
                    p = torch.exp2(s * fold - (reference * fold)[:, None])
                    total = total * rescale + p.sum(dim=1)
                    acc = acc * rescale[:, None] + p.to(q.dtype).float() @ vt
                    top = new_top
                kept = total > 0
                valid = rows < sq
                out[q0 + rows[valid], h] = torch.where(kept[:, None], acc / total.clamp_min(1e-30)[:, None],
                                                       0.0)[valid]
                row_lse = (top * fold + torch.log2(total.clamp_min(1e-30))) * math.log(2.0)
                lse[h, q0 + rows[valid]] = torch.where(kept, row_lse, float("-inf"))[valid]
    if packed:
        return out, lse
    return out.reshape(sequences, -1, hq, dv), lse.reshape(hq, sequences, -1).transpose(0, 1).contiguous()


@pytest.mark.parametrize("sq, skv, causal, alignment, window", [
    (37, 37, True, "bottom_right", None), (64, 64, True, "bottom_right", None), (20, 45, True, "bottom_right", None),
    (45, 20, True, "bottom_right", None), (45, 20, True, "top_left", None), (20, 45, True, "top_left", None),
    (33, 19, False, "bottom_right", None), (50, 50, True, "bottom_right", (9, None)),
    (40, 70, False, "top_left", (13, 4)), (70, 40, False, "bottom_right", (20, -1)),
])
@pytest.mark.parametrize("bn", [8, 5])
def test_blocked_model_matches_the_reference(sq, skv, causal, alignment, window, bn):
    """Dv != Dqk as DeepSeek's 192/128; key blocks dividing the query tile or not (128 x 80 at D 256); sliding
    windows with and without causal (rows with no key in the window: zeros, LSE -inf)."""
    torch.manual_seed(sq * 100 + skv)
    q = torch.randn(1, sq, 4, 16).to(torch.bfloat16)
    k = torch.randn(1, skv, 2, 16).to(torch.bfloat16)
    v = torch.randn(1, skv, 2, 12).to(torch.bfloat16)
    scale = 16 ** -0.5
    out, lse = blocked_model(q, k, v, causal, scale, alignment, bn=bn, window=window)
    ref_out, ref_lse = attention.prefill_reference(q, k, v, causal=causal, scale=scale, causal_alignment=alignment,
                                                   window=window)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)


def test_visible_pairs_and_flops():
    from nvfly.ops.attention.prefill_api import visible_pairs
    for sq, skv in ((5, 5), (3, 7), (7, 3), (1, 1)):
        for alignment in ("bottom_right", "top_left"):
            offset = causal_offset(sq, skv, alignment)
            count = sum(1 for i in range(sq) for j in range(skv) if j <= i + offset)
            assert visible_pairs(sq, skv, True, alignment) == count
        assert visible_pairs(sq, skv, False) == sq * skv
        for window in WINDOWS:
            b = masking(False, window, "top_left")
            count = sum(1 for i in range(sq) for j in range(skv) if (not b.causal or j <= i + b.right)
                        and (not b.window or j >= i - b.left))
            assert visible_pairs(sq, skv, False, "top_left", window) == count
    assert attention.prefill_flops(1, 4096, 4096, 16, 128, 128, False) == 4 * 4096 * 4096 * 16 * 128
    assert attention.prefill_flops(1, 4096, 4096, 16, 128, 128, True) == 2 * 256 * 16 * 4096 * 4097 // 2


def _inputs(b=1, sq=8, skv=8, hq=4, hkv=2, d=64, dtype=torch.bfloat16):
    return (torch.zeros(b, sq, hq, d, dtype=dtype), torch.zeros(b, skv, hkv, d, dtype=dtype),
            torch.zeros(b, skv, hkv, d, dtype=dtype))


@pytest.mark.parametrize("change, argument, kind, message", [
    (lambda q, k, v: (q.float(), k, v), "q", TypeError, "dtype torch.float32 is not supported"),
    (lambda q, k, v: (q, k.half(), v), "k", TypeError, "differs from q's"),
    (lambda q, k, v: (q[0], k, v), "q", ValueError, "expected 4 dimensions"),
    (lambda q, k, v: (q, [k], v), "k", TypeError, "expected a torch.Tensor"),
    (lambda q, k, v: (q[..., :3, :], k, v), "q", ValueError, "3 query heads are not a multiple of k's 2"),
    (lambda q, k, v: (q, k[..., :32], v), "k", ValueError, "head dim 32 differs"),
    (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), "q", ValueError, "head dim 32 is not supported"),
    (lambda q, k, v: (q, k, v[:, :5]), "v", ValueError, "does not match k's"),
    (lambda q, k, v: (q, k, torch.zeros(1, 8, 2, 256, dtype=torch.bfloat16)), "v", ValueError,
     "head dim 256 with Dqk 64 is not supported"),
    (lambda q, k, v: (q, k[:, :, :, ::2].repeat(1, 1, 1, 2)[..., :64].transpose(-1, -2).contiguous()
                      .transpose(-1, -2), v), "k", ValueError, "last dimension must be contiguous"),
])
def test_argument_errors_name_the_argument(change, argument, kind, message):
    q, k, v = change(*_inputs())
    with pytest.raises(kind, match=rf"^attention\.prefill: {argument}: .*{re.escape(message)}"):
        attention.prefill(q, k, v)
    reason = attention.prefill_eligibility(q, k, v)
    assert reason is not None and reason.startswith(f"attention.prefill: {argument}: ")


def test_option_errors_and_eligibility_reasons():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"^attention\.prefill: scale: expected a positive"):
        attention.prefill(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match=r"^attention\.prefill: causal_alignment: expected one of"):
        attention.prefill(q, k, v, causal=True, causal_alignment="diagonal")
    with pytest.raises(ValueError, match=r"^attention\.prefill: q: on cpu"):
        attention.prefill(q, k, v)
    assert attention.prefill_eligibility(q, k, v) == "q is on cpu, not CUDA"


def _cpu_prefill(monkeypatch):
    """prefill on CPU tensors: no CUDA check, TMA descriptors holding their tensor's address in place of the
    driver's encoding."""
    from nvfly.ops.attention import prefill_api
    from nvfly.runtime.tma import TmaDescriptor

    def descriptor(tensor, box, swizzle=128):
        desc = TmaDescriptor(tensor, box, swizzle)
        desc.raw = struct.pack("<Q", tensor.data_ptr()).ljust(128, b"\0")
        return desc
    monkeypatch.setattr(prefill_api, "_require_cuda", lambda q, op: None)
    monkeypatch.setattr(prefill_api, "cached_descriptor", descriptor)


def test_host_path_launches_the_prefill_kernel(recorded_launches, monkeypatch):
    """prefill's host path on CPU tensors through the real binder (conftest's recorded_launches; TMA descriptors
    holding their tensor's address in place of the driver's encoding): grid (query tiles, Hq, B), the descriptors
    of q (a (B, H, S, D) view), k and v, out and lse passed; no launch without keys."""
    _cpu_prefill(monkeypatch)
    q, k, v = _inputs(b=2, sq=300, skv=77, hq=6, hkv=2, d=128)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    out, lse = attention.prefill(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 300, 6, 128) and lse.shape == (2, 6, 300) and lse.dtype == torch.float32
    assert [(name, grid) for name, grid, _ in recorded_launches] == [("attention_prefill_kernel", (3, 6, 2))]
    params = recorded_launches[0][2]
    packed = b"".join(p for p in params if isinstance(p, bytes))
    assert all(struct.pack("<Q", t.data_ptr()) in packed for t in (q, k, v))
    assert out.data_ptr() in params and lse.data_ptr() in params
    out, lse = attention.prefill(q, k[:, :0], v[:, :0], return_lse=True)
    assert len(recorded_launches) == 1 and (out == 0).all() and torch.isinf(lse).all()


# ---------------------------------------------------------------------------------------------- mods, windows,
# block masks, packed sequences
from nvfly.ops.attention import mods as M  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

SLOPES = torch.tensor(M.alibi_slopes(4))
DOCUMENTS = torch.zeros(2, 1000, dtype=torch.int32)
BIAS = torch.zeros(4, 63)
MOD_FAMILIES = {  # name: (plan, mods, attend_block traces)
    "d128-causal-window": (attention.prefill_plan(128, 128, True, window=True), M.Mods(), 3),
    "d64-window-softcap": (attention.prefill_plan(64, 64, False, window=True), M.Mods(M.soft_cap(30.0)), 3),
    "d128-causal-alibi": (attention.prefill_plan(128, 128, True), M.Mods(M.alibi(SLOPES)), 2),
    "d64-document": (attention.prefill_plan(64, 64, False), M.Mods(None, M.document_mask(DOCUMENTS)), 2),
    "d128-relative-bias-prefix": (attention.prefill_plan(128, 128, False),
                                  M.Mods(M.relative_position_bias(BIAS), M.prefix_lm(SLOPES)), 2),
    "d192-blockmask-window": (attention.prefill_plan(192, 128, False, kv_block=128, q_block=128),
                              M.Mods(None, M.sliding_window(300)), 2),
    "d128-blockmask256-causal-softcap": (attention.prefill_plan(128, 128, True, kv_block=256, q_block=256),
                                         M.Mods(M.soft_cap(20.0)), 2),
    "d128-varlen-causal-window": (attention.prefill_plan(128, 128, True, window=True, varlen=True), M.Mods(), 3),
    "d64-varlen-document": (attention.prefill_plan(64, 64, False, varlen=True),
                            M.Mods(None, M.document_mask(DOCUMENTS)), 2),
    "d256-causal-window-softcap": (attention.prefill_plan(256, 256, True, window=True, mods=True),
                                   M.Mods(M.soft_cap(30.0)), 3),
    "d256-blockmask-64key-stages": (attention.prefill_plan(256, 256, False, kv_block=128, q_block=128),
                                    M.Mods(None, M.sliding_window(300)), 2),
}


SLOW_FAMILIES = ("d128-relative-bias-prefix", "d128-blockmask256-causal-softcap",
                 "d64-varlen-document", "d256-causal-window-softcap")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_FAMILIES else name
                                  for name in MOD_FAMILIES])
def test_mod_window_blockmask_varlen_plans_compile_without_spills(name):
    """Each variant compiles to HGMMA (register-A P·V) once per attend_block trace (three loops: a window's left
    edge, fully visible, the diagonal and tail; a block mask's partial and full lists), with no spills and no ptxas
    warnings; the mods' code is in the kernel (the MUFU tanh, the captured tables' loads). Without a window the first loop is
    empty at trace time."""
    plan, mods, traces = MOD_FAMILIES[name]
    kernel = attention.compile_prefill(plan, mods=mods)
    traces += plan.overlap  # the overlap's first S and last P·V
    traces += plan.hoist and plan.window  # a hoisted window's left edge: a trace with its lower bound only
    s_steps, pv_steps = plan.dqk // 16, plan.block_n // 16
    assert gmma_count(kernel, f"64x{plan.block_n}x16", a_from_registers=False) == traces * s_steps
    assert gmma_count(kernel, f"64x{plan.dv}x16", a_from_registers=True) == traces * pv_steps
    assert "LDL" not in kernel.sass() and "STL" not in kernel.sass()
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert not kernel.warnings
    # soft-capping's tanh is the MUFU's, once per score of each softmax trace (block_n / 2 a thread), and its
    # division by the cap a product (no IEEE division per score)
    assert (kernel.sass_opcodes()["MUFU.TANH"] > 0) == ("softcap" in name)
    if "softcap" in name:
        assert kernel.sass_opcodes()["MUFU.TANH"] == traces * plan.block_n // 2
        assert "math.tanh" not in kernel.mlir and "div.rn.f32" not in kernel.ptx
    if M.captured_tensors(mods) or plan.kv_block or plan.varlen:
        assert kernel.sass_opcodes()["LDG.E"] > 0  # captured tables, block lists or cu_seqlens read in the kernel


def test_mods_fuse_into_ffma_and_mask_loads_run_under_the_gemm():
    """ALiBi's bias fuses with the scaled score into one FFMA a score, and the softmax's exponent is one FFMA a
    score (FADDs left: the row sums); a mask_mod's table loads (documents, BlockMask, causal) are issued before
    the wait for S, with no spills."""
    plan = attention.prefill_plan(128, 128, True)
    ops = attention.compile_prefill(plan, mods=M.Mods(M.alibi(SLOPES))).sass_opcodes()
    scores = 2 * plan.block_n // 2  # two softmax traces of block_n / 2 scores a thread
    assert ops["FFMA"] >= 2 * scores and ops["FADD"] <= scores + 16, ops
    # what is left of ALiBi a score: the distance's conversion (hoisted: q_idx and kv_idx affine, converted once)
    assert ops.get("I2FP.F32.S32", 0) == (4 if plan.hoist else scores)  # hoisted: the per-row parts only

    def causal_documents(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (DOCUMENTS[b, kv_idx] == DOCUMENTS[b, q_idx])
    plan = attention.prefill_plan(128, 128, True, kv_block=128, q_block=128)
    kernel = attention.compile_prefill(plan, mods=M.Mods(None, causal_documents))
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == 0 and not kernel.warnings
    sass = kernel.sass()
    first_s = sass.index("HGMMA.64x128x16.F32.BF16 R")
    wait = sass.index("WARPGROUP.DEPBAR", first_s)
    assert sass[first_s:wait].count("LDG.E") >= 8  # document ids of key columns (the rest: ptxas's order)


def flex(q, k, v, score_mod=None, block_mask=None, scale=None):
    """flex_attention on (B, S, H, D) tensors in float32 (eager, on the CPU) with its LSE."""
    out, lse = flex_attention(q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
                              score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_lse=True,
                              scale=scale)
    return out.transpose(1, 2), lse


def _case(sq=300, skv=300, hq=4, hkv=2, d=16, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(2, sq, hq, d).to(torch.bfloat16), torch.randn(2, skv, hkv, d).to(torch.bfloat16),
            torch.randn(2, skv, hkv, d).to(torch.bfloat16))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mod", ["soft_cap", "alibi", "relative_bias", "document", "prefix_lm", "window",
                                 "causal_window_blockmask"])
def test_reference_with_mods_is_flex_attention(mod):
    """prefill_reference's mods, windows and block masks mean what flex_attention's do (q_idx the row): the same
    outputs and LSE as flex on the same mods, with a BlockMask of the mask where there is one."""
    q, k, v = _case(sq=300, skv=260)
    documents = torch.randint(0, 3, (2, 300)).sort(dim=1).values.to(torch.int32)
    score_mod = mask_mod = None
    kwargs = {}
    if mod == "soft_cap":
        score_mod = M.soft_cap(2.0)
    elif mod == "alibi":
        score_mod = M.alibi(SLOPES)
    elif mod == "relative_bias":
        score_mod = M.relative_position_bias(torch.randn(4, 31))
    elif mod == "document":
        mask_mod = M.document_mask(documents)
    elif mod == "prefix_lm":
        mask_mod = M.prefix_lm(torch.tensor([5, 200], dtype=torch.int32))
    elif mod == "window":  # flash-attn's window (left 37, right 5), bottom-right aligned like its causal
        kwargs["window"] = (37, 5)

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx >= q_idx + 260 - 300 - 37) & (kv_idx <= q_idx + 260 - 300 + 5)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < 260)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, 2, 1, 300, 260, device="cpu")
    want, want_lse = flex(q, k, v, score_mod, block_mask)
    if mod == "window":
        got, lse = attention.prefill_reference(q, k, v, **kwargs)
    elif mod == "causal_window_blockmask":
        got, lse = attention.prefill_reference(q, k, v, block_mask=block_mask)
        assert int(block_mask.full_kv_num_blocks.sum()) > 0 and int(block_mask.kv_num_blocks.sum()) > 0
    else:
        got, lse = attention.prefill_reference(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    seen = torch.isfinite(lse)
    assert torch.equal(seen, torch.isfinite(want_lse)) or mod == "window"  # flex gives rows with no key lse -inf
    torch.testing.assert_close(got[seen.permute(0, 2, 1)[..., None].expand_as(got)],
                               want[seen.permute(0, 2, 1)[..., None].expand_as(want)], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse[seen], want_lse[seen], atol=1e-4, rtol=1e-4)


def test_varlen_reference_is_the_padded_reference():
    """prefill_reference with cu_seqlens: each packed sequence equals the reference of that sequence alone (causal
    both ways with a window, a mod whose b is the sequence); rows outside every sequence are 0 and -inf."""
    torch.manual_seed(3)
    lengths_q, lengths_k = [5, 0, 130, 1], [9, 4, 100, 1]
    q = torch.randn(sum(lengths_q) + 3, 4, 16).to(torch.bfloat16)
    k = torch.randn(sum(lengths_k), 2, 16).to(torch.bfloat16)
    v = torch.randn(sum(lengths_k), 2, 16).to(torch.bfloat16)
    cu_q = torch.tensor([0, 5, 5, 135, 136], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 113, 114], dtype=torch.int32)
    offsets = torch.tensor([0.5, 1.0, -1.0, 2.0])

    def per_sequence(score, b, h, q_idx, kv_idx):
        return score + offsets[b]
    for alignment in ("bottom_right", "top_left"):
        kwargs = dict(causal=True, causal_alignment=alignment, window=(40, None), score_mod=per_sequence)
        out, lse = attention.prefill_reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kwargs)
        for b in range(4):
            (q0, q1), (k0, k1) = cu_q[b:b + 2].tolist(), cu_k[b:b + 2].tolist()

            def shifted(score, bb, h, q_idx, kv_idx, b=b):
                return score + offsets[b]
            want, want_lse = attention.prefill_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                                         **dict(kwargs, score_mod=shifted))
            torch.testing.assert_close(out[q0:q1], want[0])
            torch.testing.assert_close(lse[:, q0:q1], want_lse[0])
        assert (out[136:] == 0).all() and torch.isinf(lse[:, 136:]).all()


def test_host_path_passes_varlen_offsets(recorded_launches, monkeypatch):
    """prefill_varlen launches (longest sequence's query tiles, Hq, B) with the packed tensors and both cu_seqlens;
    the window's left and right and the alignment are scalars of the launch."""
    _cpu_prefill(monkeypatch)
    q, k, v = torch.zeros(400, 6, 64, dtype=torch.bfloat16), torch.zeros(90, 2, 64, dtype=torch.bfloat16), \
        torch.zeros(90, 2, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 300, 301, 400], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 60, 90], dtype=torch.int32)
    out, lse = attention.prefill_varlen(q, k, v, cu_q, cu_k, causal=True, window=(17, None), return_lse=True)
    assert out.shape == (400, 6, 64) and lse.shape == (6, 400)
    assert [(name, grid) for name, grid, _ in recorded_launches] == [("attention_prefill_kernel", (3, 6, 3))]
    params = recorded_launches[0][2]
    assert cu_q.data_ptr() in params and cu_k.data_ptr() in params and out.data_ptr() in params
    assert params[-5:-1] == (3, 1, 17, 0)  # group, bottom-right, left, right


def test_host_path_passes_block_mask_tables(recorded_launches, monkeypatch):
    """A broadcast (1, 1) BlockMask's tables reach the kernel expanded to (B, Hq, ...) int32, partial and full."""
    _cpu_prefill(monkeypatch)
    q, k, v = _inputs(b=2, sq=300, skv=500, hq=4, hkv=2, d=128)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 200, 1, 1, 300, 500, device="cpu")
    out = attention.prefill(q, k, v, block_mask=mask)

    def out_pointer(params):
        return out.data_ptr()
    assert [(name, grid) for name, grid, _ in recorded_launches] == [("attention_prefill_kernel", (3, 4, 2))]
    params = recorded_launches[0][2]
    pointers = [p for p in params if isinstance(p, int) and p > 1 << 20]
    assert out_pointer(params) in pointers and len(pointers) == 1 + 4  # out and the four tables (no lse)


def _mask(q_len, kv_len, block=(128, 128)):
    return create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, 1, 1, q_len, kv_len, device="cpu",
                             BLOCK_SIZE=block)


@pytest.mark.parametrize("call, argument, kind, message", [
    (lambda q, k, v: attention.prefill(q, k, v, window=(3,)), "window", ValueError, "expected (left, right)"),
    (lambda q, k, v: attention.prefill(q, k, v, window=(-2, 0)), "window", ValueError, "non-negative"),
    (lambda q, k, v: attention.prefill(q, k, v, score_mod=3), "score_mod", TypeError, "expected a function"),
    (lambda q, k, v: attention.prefill(q, k, v, block_mask=object()), "block_mask", TypeError, "BlockMask"),
    (lambda q, k, v: attention.prefill(q, k, v, block_mask=_mask(8, 8, (128, 64))), "block_mask", ValueError,
     "KV block size 64 is not a multiple of the kernel's 128-key stage"),
    (lambda q, k, v: attention.prefill(q, k, v, block_mask=_mask(8, 8, (64, 128))), "block_mask", ValueError,
     "query block size 64 is not a multiple of the kernel's 128-row tile"),
    (lambda q, k, v: attention.prefill(q, *[t.repeat(1, 40, 1, 1) for t in (k, v)], block_mask=_mask(8, 8)),
     "block_mask", ValueError, "1 KV blocks of 128 cover 128 keys, the cache holds 320"),
    (lambda q, k, v: attention.prefill(torch.zeros(1, 300, 4, 64, dtype=torch.bfloat16), k, v,
                                       block_mask=_mask(128, 8)), "block_mask", ValueError, "cover 128 queries"),
    (lambda q, k, v: attention.prefill(q, k, v, score_mod=lambda s, b, h, i, j: s + SLOPES[h] + BIAS[h, j]
                                       + DOCUMENTS[b, i]), "score_mod", ValueError, "at most 2"),
])
def test_mod_and_block_mask_errors_name_the_argument(call, argument, kind, message):
    with pytest.raises(kind, match=rf"^attention\.prefill: {argument}: .*{re.escape(message)}"):
        call(*_inputs())


@pytest.mark.parametrize("cu_q, cu_k, max_q, argument, message", [
    ([0, 5, 3], [0, 4, 8], None, "cu_seqlens_q", "non-decreasing"),
    ([0, 5, 8], [0, 4, 9], None, "cu_seqlens_k", "beyond the 8 packed tokens"),
    ([0, 5, 8], [0, 4], None, "cu_seqlens_k", "2 offsets"),
    ([0, 5, 8], [0, 4, 8], 4, "max_seqlen_q", "shorter than a sequence of 5"),
])
def test_varlen_errors_name_the_argument(cu_q, cu_k, max_q, argument, message):
    q, k, v = (t[0] for t in _inputs())
    with pytest.raises(ValueError, match=rf"^attention\.prefill: {argument}: .*{re.escape(message)}"):
        attention.prefill_varlen(q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                                 max_q)
    with pytest.raises(TypeError, match=r"^attention\.prefill: cu_seqlens_q: expected int32"):
        attention.prefill_varlen(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k, dtype=torch.int32))


def test_untraceable_mods_point_at_the_users_line():
    def cumulative(score, b, h, q_idx, kv_idx):
        return torch.cumsum(score, 0)

    def branchy(b, h, q_idx, kv_idx):
        return kv_idx < 10 if q_idx > 5 else kv_idx > 3
    plan = attention.prefill_plan(64, 64, False)
    for mods, needle, code in ((M.Mods(cumulative), "cumsum is not supported", cumulative.__code__),
                               (M.Mods(None, branchy), "torch.where", branchy.__code__)):
        with pytest.raises(nvfly.CompileError, match=needle) as info:
            attention.compile_prefill(plan, mods=mods)
        assert info.value.filename == __file__ and info.value.lineno == code.co_firstlineno + 1


def _model_case(batch, sq, skv, seed):
    torch.manual_seed(seed)
    return (torch.randn(batch, sq, 4, 16).to(torch.bfloat16), torch.randn(batch, skv, 2, 16).to(torch.bfloat16),
            torch.randn(batch, skv, 2, 12).to(torch.bfloat16))


def _assert_model_matches(got, got_lse, want, want_lse):
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(got_lse[finite], want_lse[finite], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["softcap-documents", "alibi-causal-window", "relative-bias-prefix"])
def test_blocked_model_with_mods_matches_the_reference(case):
    """The kernel's mod handling (score_mod on the scaled score with log2 e folded, mask_mod in every block, the
    mods' indices clamped to the sequence in masked blocks, tails and key-less rows) equals the reference."""
    q, k, v = _model_case(2, 45, 37, seed=len(case))
    ids = torch.tensor([[0] * 10 + [1] * 20 + [2] * 15, [0] * 30 + [1] * 15], dtype=torch.int32)
    kwargs = {"softcap-documents": dict(score_mod=M.soft_cap(1.5), mask_mod=M.document_mask(ids), causal=False),
              "alibi-causal-window": dict(score_mod=M.alibi(SLOPES), causal=True, window=(11, None)),
              "relative-bias-prefix": dict(score_mod=M.relative_position_bias(torch.randn(4, 9)),
                                           mask_mod=M.prefix_lm(torch.tensor([3, 40], dtype=torch.int32)))}[case]
    kwargs.setdefault("causal", False)
    got, got_lse = blocked_model(q, k, v, scale=0.25, alignment="top_left", **kwargs)
    want, want_lse = attention.prefill_reference(q, k, v, scale=0.25, causal_alignment="top_left", **kwargs)
    _assert_model_matches(got, got_lse, want, want_lse)


@pytest.mark.parametrize("kind", ["create_block_mask", "random"])
def test_blocked_model_with_block_masks_matches_the_reference(kind):
    """The kernel's BlockMask walk (each tile's query block's partial list with the mask_mod and positional bounds,
    then its full list; KV blocks of two ring stages, query blocks of two tiles) equals the reference's flex
    semantics."""
    from torch.nn.attention.flex_attention import BlockMask
    sq, skv, q_block, kv_block = 70, 90, 32, 16  # the model's tiles: 16 rows x 8 keys
    q, k, v = _model_case(2, sq, skv, seed=7)
    if kind == "create_block_mask":
        def causal_window(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + 20) & (q_idx + 20 - kv_idx < 60 + 10 * b)
        mask = create_block_mask(causal_window, 2, None, sq, skv, device="cpu", BLOCK_SIZE=(q_block, kv_block))
        assert int(mask.full_kv_num_blocks.sum()) > 0
    else:
        rng = torch.Generator().manual_seed(3)
        q_blocks, kv_blocks = -(-sq // q_block), -(-skv // kv_block)
        order = torch.argsort(torch.rand(2, 4, q_blocks, kv_blocks, generator=rng), dim=-1).to(torch.int32)
        listed = torch.randint(0, kv_blocks + 1, (2, 4, q_blocks), generator=rng, dtype=torch.int32)
        cut = (listed.float() * torch.rand(listed.shape, generator=rng)).to(torch.int32)
        full = torch.stack([torch.roll(row, -int(n)) for row, n in zip(order.view(-1, kv_blocks), cut.view(-1))])

        def stripes(b, h, q_idx, kv_idx):  # partial blocks: the first ``cut`` of a random order; full: the next
            return (q_idx + 2 * kv_idx + h) % 3 != 0
        mask = BlockMask.from_kv_blocks(cut, order, listed - cut, full.view_as(order),
                                        BLOCK_SIZE=(q_block, kv_block), mask_mod=stripes, seq_lengths=(sq, skv))
    got, got_lse = blocked_model(q, k, v, causal=False, scale=0.25, alignment="bottom_right", block_mask=mask)
    want, want_lse = attention.prefill_reference(q, k, v, scale=0.25, block_mask=mask)
    _assert_model_matches(got, got_lse, want, want_lse)


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_blocked_model_packed_matches_the_reference(alignment):
    """Packed sequences as the kernel reads them (each from its cu_seqlens row, on into the next sequence's rows,
    dropped by the tail mask; finite rows after the last one) with causal, a window and a mod whose b is the
    sequence, against the reference sequence by sequence."""
    torch.manual_seed(5)
    lengths_q, lengths_k = [37, 0, 50, 1, 20], [20, 9, 61, 1, 0]
    q = torch.randn(sum(lengths_q) + 3, 4, 16).to(torch.bfloat16)
    k = torch.randn(sum(lengths_k) + 3, 2, 16).to(torch.bfloat16)
    v = torch.randn(sum(lengths_k) + 3, 2, 12).to(torch.bfloat16)
    cu_q = torch.tensor([0, 37, 37, 87, 88, 108], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 29, 90, 91, 91], dtype=torch.int32)
    offsets = torch.tensor([0.5, 1.0, -1.0, 2.0, 0.0])

    def per_sequence(score, b, h, q_idx, kv_idx):
        return score + offsets[b] * (kv_idx - q_idx) / 8
    kwargs = dict(causal=True, window=(15, None), score_mod=per_sequence)
    got, got_lse = blocked_model(q, k, v, scale=0.25, alignment=alignment, cu_seqlens=(cu_q, cu_k), **kwargs)
    want, want_lse = attention.prefill_reference(q, k, v, scale=0.25, causal_alignment=alignment, cu_seqlens_q=cu_q,
                                                 cu_seqlens_k=cu_k, **kwargs)
    _assert_model_matches(got[:108], got_lse[:, :108], want[:108], want_lse[:, :108])


# ---------------------------------------------------------------------------------------------- issue 27's options
def softmax_traces(kernel):
    """Per ``attend_block`` trace, the SASS opcodes (without modifiers) from its S GEMM's last HGMMA (mask code
    issued under S included) to its first P·V HGMMA, and where its first S wait is."""
    lines = kernel.sass().splitlines()
    traces = []
    for i, line in enumerate(lines):
        if re.search(r"HGMMA\.64x\d+x16\S* R\d+, gdesc\[.*gsb0", line):
            end = next(j for j in range(i, len(lines)) if re.search(r"HGMMA\.\S+ R\d+, R\d+, gdesc", lines[j]))
            wait = next(j for j in range(i, end) if "WARPGROUP.DEPBAR" in lines[j])
            opcodes = (re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
                       for line in lines[i + 1:end])
            ops = [m.group(1).split(".")[0] for m in opcodes if m]
            traces.append((collections.Counter(ops), sum("LDG" in line for line in lines[i:wait])))
    return traces


def _causal_documents(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (DOCUMENTS[b, kv_idx] == DOCUMENTS[b, q_idx])


HOISTED = {  # the benchmark's mod rows' plans (D 128 causal), a window mask_mod and D 64 causal
    "causal": (attention.prefill_plan(128, 128, True), M.Mods()),
    "window": (attention.prefill_plan(128, 128, True, window=True), M.Mods()),
    "alibi": (attention.prefill_plan(128, 128, True, mods=True), M.Mods(M.alibi(SLOPES))),
    "softcap": (attention.prefill_plan(128, 128, True, mods=True), M.Mods(M.soft_cap(50.0))),
    "documents": (attention.prefill_plan(128, 128, True, kv_block=128, q_block=128, mods=True),
                  M.Mods(None, _causal_documents)),
    "window-mask-mod": (attention.prefill_plan(128, 128, True, mods=True), M.Mods(None, M.sliding_window(1024))),
    "d64-causal": (attention.prefill_plan(64, 64, True), M.Mods()),
}


@pytest.mark.parametrize("name", HOISTED)
def test_hoisted_plans_run_less_code_a_score(name):
    """``hoist`` and ``prefetch_mask`` compile without spills to the same GEMMs (a window: one more trace) and
    less code in the softmax traces: one compare and one select a score and bound (positional bounds against
    per-row limits; a window's edge blocks with one bound where the other holds for the tile), ALiBi without a
    per-score int-to-float conversion, the mask_mod's loads all before S's wait and no verdict bits to unpack."""
    import dataclasses
    plan, mods = HOISTED[name]
    base = attention.compile_prefill(dataclasses.replace(plan, hoist=False, prefetch_mask=False), mods=mods)
    kernel = attention.compile_prefill(dataclasses.replace(plan, hoist=True, prefetch_mask=True), mods=mods)
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert not kernel.warnings and "LDL" not in kernel.sass() and "STL" not in kernel.sass()
    scores = plan.block_n // 2
    before, after = softmax_traces(base), softmax_traces(kernel)
    # a window's left edge: a trace with its lower bound only (blocks inside the causal bound) and one with both
    assert len(after) == len(before) + (name == "window")
    assert kernel.count("HGMMA") * len(before) == base.count("HGMMA") * len(after)
    sizes = sorted(sum(ops.values()) for ops, _ in after)
    assert sizes[-1] < max(sum(ops.values()) for ops, _ in before) - 60  # the heaviest (masked) trace lighter
    # the traces a tile runs (a large window's: lower bound only, none, upper bounds only) lighter in all
    assert sum(sizes) - (sizes[-1] if name == "window" else 0) < sum(sum(ops.values()) for ops, _ in before) - 100
    for ops, _ in after:
        assert ops["FSEL"] <= max(old["FSEL"] for old, _ in before)
        assert ops["I2FP"] <= 4 and ops["R2P"] == 0
    if name in ("causal", "d64-causal", "window"):  # one select a score a trace (two before: the tail's and the
        selects = sorted(ops["FSEL"] for ops, _ in after)  # diagonal's), but a small window's both-bounds edge
        assert selects[-1 - (name == "window")] <= scores + 8
    if name == "documents":  # the 32 key columns' and 2 rows' document ids, all issued under S
        assert max(loads for _, loads in after) >= 34


@pytest.mark.parametrize("options, block_n, exp2", [
    (dict(wide=True), 192, 2 * (96 + 2)), (dict(wide=True, poly_exp2=2), 192, 2 * (96 - 12 + 2)),
    (dict(poly_exp2=1, hoist=True), 128, 2 * (64 - 4 + 2)), (dict(wide=True, d=128), 176, 2 * (88 + 2))])
def test_wide_and_polynomial_plans(options, block_n, exp2):
    """bf16 D 64 with ``wide`` (192-key stages: 64x192 S, P·V 12 k-steps), D 128 (176 keys) and ``poly_exp2``
    (that many of every 16 exp2 by the cubic, off MUFU) compile without spills; wide applies to D 64 and 128
    without a BlockMask only."""
    options = dict(options)
    d = options.pop("d", 64)
    plan = attention.prefill_plan(d, d, True, **options)
    assert plan.block_n == block_n and plan.smem_bytes(2) <= MAX_SMEM
    kernel = attention.compile_prefill(plan)
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == 0 and not kernel.warnings
    assert gmma_count(kernel, f"64x{block_n}x16", a_from_registers=False) == 2 * d // 16
    assert gmma_count(kernel, f"64x{d}x16", a_from_registers=True) == 2 * block_n // 16
    assert kernel.sass_opcodes()["MUFU.EX2"] == exp2  # two softmax traces: the scores' and the rows' rescales
    assert attention.prefill_plan(128, 128, True, wide=True).block_n == 176  # FA3's non-causal D 128 tile
    assert attention.prefill_plan(96, 96, True, wide=True).block_n == 128
    assert attention.prefill_plan(64, 64, True, wide=True, kv_block=128, q_block=128).block_n == 128


@pytest.mark.parametrize("d, causal", [(128, False), (64, True)])
def test_lazy_rescale_branches_around_o_multiplies(d, causal):
    """``lazy_rescale``: in each softmax trace a warp vote on the rows' maxima and O's Dv / 2 multiplies a thread
    behind the branch it decides; no spills; off with the overlap."""
    plan = attention.prefill_plan(d, d, causal, lazy_rescale=True, hoist=True)
    kernel = attention.compile_prefill(plan)
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == 0 and not kernel.warnings
    lines = [line for line in kernel.sass().splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    votes = [i for i, line in enumerate(lines) if "VOTE.ANY" in line]
    assert len(votes) == 2  # the unmasked and the masked trace
    for i in votes:
        branch = next(j for j in range(i, len(lines)) if re.search(r"@!?P\d BRA", lines[j]))
        target = int(re.search(r"BRA 0x([0-9a-f]+)", lines[branch]).group(1), 16)
        skipped = [line for line in lines[branch + 1:]
                   if int(re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1), 16) < target]
        assert sum("FMUL" in line for line in skipped) >= d // 2
    assert not attention.prefill_plan(256, 256, True, lazy_rescale=True).lazy_rescale  # D 256: the overlap
