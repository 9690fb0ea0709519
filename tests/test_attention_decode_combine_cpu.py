"""Split-KV decode's two alternatives to the combine kernel's plain launch, without a GPU (issue 26):
``pdl_combine`` (the combine as the split kernel's programmatic dependent; also MLA's) and ``fixup_combine`` (the
last split CTA of each query tile merges the tile's partials). Their plan options (off by default and for one split),
their kernels compiled for sm_90a without spills over a spread of plans (bf16 and fp8, paged and contiguous, Sq 1-16,
GQA, d 64-256), the host path's launches, and the fix-up's counter and index arithmetic modelled in numpy (every
counter counted to the split count, every (row, column) of a tile merged once, empty rows zeros and -inf)."""
import numpy as np
import pytest
import torch

import nvfly
from nvfly.ops import attention
from nvfly.ops.attention import api
from nvfly.ops.attention import combine_kernel as C
from nvfly.ops.attention import mods as M
from nvfly.ops.attention import plan as P
from nvfly.ops.attention.mla_api import compile_mla
from nvfly.ops.attention.mla_plan import mla_plan

from tests.test_attention_decode_cpu import bf16, cpu_launches  # noqa: F401 (cpu_launches: a fixture)

OPTIONS = ("pdl_combine", "fixup_combine")


# ---------------------------------------------------------------------------------------------- plan options
def test_fixup_is_the_default_of_split_plans_and_pdl_replaces_it():
    """A split plan merges in its last CTA by default (plan.FIXUP_BY_DEFAULT), PDL asked for replaces it, False
    keeps the combine kernel; a plan of one split keeps neither (its kernel is the default's); asking for both
    raises, naming them; the benchmark's variants are the options."""
    llama = dict(batch=1, sq=1, kv_heads=8, group=4, dqk=128, dv=128, max_seqlen=131072, sm_count=132)
    default = P.decode_plan(**llama)
    assert default.splits > 1 and not default.pdl_combine and default.fixup_combine == P.FIXUP_BY_DEFAULT
    kernel = P.decode_plan(**llama, fixup_combine=False)
    assert not kernel.fixup_combine and not kernel.pdl_combine
    for option in OPTIONS:
        plan = P.decode_plan(**llama, **{option: True})
        assert getattr(plan, option) and P.DecodePlan(**{**plan.__dict__, option: False}) == kernel
        assert P.decode_plan(**llama, splits=1, **{option: True}) == P.decode_plan(**llama, splits=1)
    with pytest.raises(ValueError, match="pdl_combine and fixup_combine"):
        P.decode_plan(**llama, pdl_combine=True, fixup_combine=True)
    with pytest.raises(ValueError, match="pdl_combine and fixup_combine"):
        api.plan_options(pdl_combine=True, fixup_combine=True)
    assert api.DECODE_VARIANTS["pdl"] == {"pdl_combine": True}
    assert api.DECODE_VARIANTS["fixup"] == {"fixup_combine": True}
    assert api.DECODE_VARIANTS["combine_kernel"] == {"fixup_combine": False}
    assert not mla_plan(1, 1, 128, 32768, 132).pdl_combine
    assert mla_plan(1, 1, 128, 32768, 132, pdl_combine=True).pdl_combine
    assert not mla_plan(1, 1, 128, 32768, 132, splits=1, pdl_combine=True).pdl_combine


@pytest.mark.parametrize("sq,group,fp8", [(1, 4, False), (4, 4, True), (8, 4, True), (16, 6, False), (8, 6, True)])
def test_fixup_is_the_default_up_to_its_row_limit(sq, group, fp8):
    """Past FIXUP_MAX_ROWS packed rows a split plan keeps the combine kernel by default (the last CTA's serial merge
    of many rows measured slower); asked for, the fix-up is still planned there."""
    shape = dict(batch=1, sq=sq, kv_heads=8, group=group, dqk=128, dv=128, max_seqlen=131072, sm_count=132, fp8=fp8)
    default = P.decode_plan(**shape)
    assert default.splits > 1 and not default.pdl_combine
    assert default.fixup_combine == (sq * group <= P.FIXUP_MAX_ROWS)
    assert P.decode_plan(**shape, fixup_combine=True).fixup_combine


def test_fixup_weights_fit_the_ring_or_the_plan_says_why():
    """The fix-up's weights (tile rows x (splits + 1) f32) go over the ring: every default depth holds 64 rows of
    128 splits; a forced shallow ring that cannot raises where asked for."""
    for dqk, dv, fp8_cache in ((64, 64, False), (64, 64, True), (128, 128, True), (256, 256, False)):
        plan = P.decode_plan(1, 16, 1, 4, dqk, dv, 1 << 20, 132, fp8=fp8_cache, splits=P.MAX_SPLITS,
                             fixup_combine=True)
        assert plan.fixup_combine and plan.tile_rows * (P.MAX_SPLITS + 1) * 4 == plan.fixup_bytes <= plan.ring_bytes
    with pytest.raises(ValueError, match="fixup_combine's weights"):
        P.decode_plan(1, 16, 1, 4, 64, 64, 1 << 20, 132, fp8=True, stages=2, splits=P.MAX_SPLITS,
                      fixup_combine=True)
    # by default such a plan keeps the combine kernel instead
    assert not P.decode_plan(1, 16, 1, 4, 64, 64, 1 << 20, 132, fp8=True, stages=2, splits=P.MAX_SPLITS).fixup_combine


# ---------------------------------------------------------------------------------------------- compiled kernels
PLANS = {
    # name: decode_plan keyword arguments (B 1, 8 KV heads unless given)
    "sq1-g4-d128-fp8-128k": dict(sq=1, group=4, dqk=128, dv=128, max_seqlen=131072, fp8=True),
    "sq1-g4-d128-bf16-paged16": dict(sq=1, group=4, dqk=128, dv=128, max_seqlen=4096, paged=True, page_size=16,
                                     splits=7),
    "sq1-g6-d128-bf16-32k": dict(sq=1, group=6, dqk=128, dv=128, max_seqlen=32768),
    "sq2-g4-d64-fp8-paged64": dict(sq=2, group=4, dqk=64, dv=64, max_seqlen=8192, fp8=True, paged=True,
                                   page_size=64, splits=5),
    "sq4-g8-d128-fp8-32rows": dict(sq=4, group=8, dqk=128, dv=128, max_seqlen=65536, fp8=True),
    "sq8-g4-d128-fp8-warp32": dict(sq=8, group=4, dqk=128, dv=128, max_seqlen=131072, fp8=True),
    "sq16-g4-d128-bf16-64rows": dict(sq=16, group=4, dqk=128, dv=128, max_seqlen=32768),
    "sq16-g8-d128-bf16-two-tiles-paged128": dict(sq=16, group=8, dqk=128, dv=128, max_seqlen=16384, paged=True,
                                                 page_size=128, splits=3),
    "sq2-g8-d256-bf16-8-warps": dict(sq=2, group=8, dqk=256, dv=256, max_seqlen=32768),
    "sq1-g8-d192-fp8-swapped": dict(sq=1, group=8, dqk=192, dv=192, max_seqlen=32768, fp8=True),
    "sq3-g5-d64-bf16-padding-rows": dict(sq=3, group=5, dqk=64, dv=64, max_seqlen=16384, splits=128),
}


def plan_of(name, option):
    spec = dict(PLANS[name])
    spec.setdefault("kv_heads", 8)
    return P.decode_plan(batch=1, sm_count=132, **spec, **{option: True})


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("name", PLANS)
def test_options_compile_without_spills(name, option):
    """Each plan's kernels: no local memory, the CTAs an SM the plan counts on, the plan's shared memory (the
    fix-up's weights go over the ring); pdl: the split kernel triggers its dependents (one PREEXIT) and the combine
    is a dependent launch that waits (griddepcontrol.wait) before its loads; fixup: no combine kernel, one counter
    arrival (acq_rel atom) between fences and GPU-scope loads of the partials."""
    plan = plan_of(name, option)
    assert plan.splits > 1 and getattr(plan, option)
    kernels = attention.compile_kernels(plan, M.Mods(), dtype=nvfly.bf16, batch=2, kv_heads=2, seqlen=4096)
    main = kernels[0]
    ops = main.sass_opcodes()
    assert not any(op.startswith(("LDL", "STL")) for op in ops), sorted(ops)
    assert main.resources.spill_stores == main.resources.spill_loads == main.resources.stack_bytes == 0
    assert main.resources.registers * plan.threads * P.ctas_per_sm(plan) <= P.REGISTERS_PER_SM
    assert main.dynamic_smem_bytes == plan.smem_bytes and plan.fixup_bytes <= plan.ring_bytes
    assert not main.dependent
    if option == "pdl_combine":
        assert len(kernels) == 2 and "griddepcontrol.launch_dependents;" in main.ptx and ops["PREEXIT"] == 1
        combine = kernels[1]
        assert combine.dependent and combine.ptx.count("griddepcontrol.wait;") == 1
        assert combine.ptx.index("griddepcontrol.wait;") < combine.ptx.index("ld.global")
        assert not any(op.startswith(("LDL", "STL")) for op in combine.sass_opcodes())
    else:
        assert len(kernels) == 1 and "griddepcontrol" not in main.ptx
        assert main.ptx.count("atom.acq_rel.gpu.global.add.u32") == 1 and ops["ATOMG.E.ADD.STRONG.GPU"] == 1
        assert main.ptx.count("fence.acq_rel.gpu;") == 2
        assert ops["LDG.E.128.STRONG.GPU"] >= 1 and ops["LDG.E.STRONG.GPU"] >= 1  # partial O, LSE past L1


@pytest.mark.parametrize("dv", [64, 128, 256, 512])
def test_dependent_combine_compiles_as_the_plain_one_after_its_wait(dv):
    """The DEPENDENT combine is the plain combine with one griddepcontrol.wait (and the dependent launch flag)."""
    rows, splits = 96, 9
    args = (nvfly.TensorDesc(nvfly.f32, (splits * rows, dv)), nvfly.TensorDesc(nvfly.f32, (splits * rows,)),
            nvfly.TensorDesc(nvfly.bf16, (2, 3, 16, dv)), nvfly.TensorDesc(nvfly.f32, (2, 16, 3)), rows, 16, splits)
    plain, dependent = (C.attention_combine_kernel.compile(*args, SQ=3, DV=dv, DEPENDENT=flag, block=C.WARPS * 32,
                                                           target="sm_90a") for flag in (False, True))
    assert not plain.dependent and dependent.dependent
    assert "griddepcontrol" not in plain.ptx and dependent.ptx.count("griddepcontrol.wait;") == 1
    assert dependent.resources.spill_stores == dependent.resources.stack_bytes == 0
    wide = "LDG.E.128" if C.chunk_columns(dv) == 128 else "LDG.E.64"
    assert plain.sass_opcodes()[wide] == dependent.sass_opcodes()[wide]


def test_mla_pdl_compiles():
    """MLA's kernel triggers its dependents and its combine waits; no local memory in either."""
    plan = mla_plan(1, 1, 128, 32768, 132, pdl_combine=True)
    main, combine = compile_mla(plan, batch=1, seqlen=32768)
    assert "griddepcontrol.launch_dependents;" in main.ptx and combine.dependent
    for kernel in (main, combine):
        assert not any(op.startswith(("LDL", "STL")) for op in kernel.sass_opcodes())


# ---------------------------------------------------------------------------------------------- host path
def test_host_path_fixup_launches_one_kernel_with_zeroed_counters(cpu_launches):
    """fixup: the decode kernel alone, on the plan's grid, with the stream's zeroed workspace counters (one a
    (sequence, KV head, query tile)); pdl: the decode kernel then the dependent combine (cuLaunchKernelEx)."""
    from nvfly.ops.common import scratch
    k, v = bf16(64, 64, 8, 128), bf16(64, 64, 8, 128)
    table = torch.randperm(64).view(1, 64).to(torch.int32)
    q = bf16(1, 8, 48, 128)
    with api.plan_options(fixup_combine=True):
        out = attention.decode(q, k, v, block_table=table, return_lse=True)[0]
    plan = P.decode_plan(1, 8, 8, 6, 128, 128, 4096, 132, paged=True, page_size=64, fixup_combine=True)
    assert plan.splits > 1 and plan.fixup_combine
    assert [(name, grid) for name, grid, _ in cpu_launches] == [("attention_decode_kernel", (plan.splits, 8, 1))]
    counters = scratch.workspace(q.device, 0, plan.fixup_counters(1, 8), 0)[1]
    assert counters.data_ptr() in cpu_launches[0][2] and out.data_ptr() in cpu_launches[0][2]
    assert int(counters.abs().sum()) == 0
    cpu_launches.clear()
    with api.plan_options(pdl_combine=True):
        attention.decode(q, k, v, block_table=table)
    assert [name for name, _, _ in cpu_launches] == ["attention_decode_kernel", "attention_combine_kernel"]


# ---------------------------------------------------------------------------------------------- fix-up model
def split_ctas(plan, batch, kv_heads):
    """(split, m_tile, hkv, b) of every CTA of the plan's grid (blockIdx.x = split * m_tiles + m_tile)."""
    grid = plan.grid(batch, kv_heads)
    for b in range(grid[2]):
        for hkv in range(grid[1]):
            for x in range(grid[0]):
                yield x // plan.m_tiles, x % plan.m_tiles, hkv, b


@pytest.mark.parametrize("name", PLANS)
def test_fixup_counters_count_every_split_once(name):
    """Each (sequence, KV head, query tile) has its own counter (``fixup_counter``, within ``fixup_counters``) and
    every split CTA of it, and no other, counts in there: the count reaches the split count exactly once."""
    plan = plan_of(name, "fixup_combine")
    batch, kv_heads = 3, 2
    counts = np.zeros(plan.fixup_counters(batch, kv_heads), dtype=int)
    owners = {}
    for split, m_tile, hkv, b in split_ctas(plan, batch, kv_heads):
        index = P.fixup_counter(b, hkv, m_tile, kv_heads, plan.m_tiles)
        assert owners.setdefault(index, (b, hkv, m_tile)) == (b, hkv, m_tile)
        counts[index] += 1
    assert (counts == plan.splits).all()


def fixup_model(plan, partial_o, partial_lse, batch, hq, seqlen=1):
    """fixup_tile's index arithmetic and merge in numpy, for every (b, hkv, m_tile): the warps' rows (a row each,
    once) give the weights, 1 / their sum and the LSE; the threads' items (4 columns of a row each, once) sum the
    splits. Returns (out [B, Sq, Hq, Dv], lse [B, Hq, Sq], how often each output element was written)."""
    sq, group, dv, splits, tile_rows = plan.sq, plan.group, plan.dv, plan.splits, plan.tile_rows
    rows = batch * sq * hq
    out = np.full((batch, sq, hq, dv), np.nan)
    lse = np.full((batch, hq, sq), np.nan)
    written = np.zeros((batch, sq, hq, dv), dtype=int)
    warps = plan.threads // 32

    def coords(packed, hkv):
        valid = packed < sq * group
        packed = min(packed, sq * group - 1)
        return hkv * group + packed % group, packed // group, valid

    for b in range(batch):
        for hkv in range(hq // group):
            for m_tile in range(plan.m_tiles):
                weights = np.full((tile_rows, splits), np.nan)
                inverse = np.full(tile_rows, np.nan)
                for warp in range(warps):
                    for i in range(tile_rows // warps):
                        row = warp + i * warps
                        head, token, valid = coords(m_tile * tile_rows + row, hkv)
                        slot = (b * sq + token) * hq + head
                        lses = partial_lse[np.arange(splits) * rows + slot]
                        top = lses.max()
                        reference = 0.0 if top == -np.inf else top
                        weights[row] = np.exp(lses - reference)
                        total = weights[row].sum()
                        inverse[row] = 1 / max(total, 1e-30) if total > 0 else 0.0
                        if valid:
                            lse[b, head, token] = reference + np.log(max(total, 1e-30)) if total > 0 else -np.inf
                vectors = dv // 4
                items = tile_rows * vectors // plan.threads
                assert items * plan.threads == tile_rows * vectors
                for tid in range(plan.threads):
                    for i in range(items):
                        item = tid + i * plan.threads
                        row, column = item // vectors, item % vectors * 4
                        head, token, valid = coords(m_tile * tile_rows + row, hkv)
                        slot = (b * sq + token) * hq + head
                        acc = sum(weights[row, s] * partial_o[s * rows + slot, column:column + 4]
                                  for s in range(splits))
                        if valid:
                            out[b, token, head, column:column + 4] = acc * inverse[row]
                            written[b, token, head, column:column + 4] += 1
    return out, lse, written


@pytest.mark.parametrize("name", ["sq1-g4-d128-bf16-paged16", "sq2-g4-d64-fp8-paged64", "sq3-g5-d64-bf16-padding-rows",
                                  "sq16-g8-d128-bf16-two-tiles-paged128"])
def test_fixup_model_merges_as_the_combine(name):
    """fixup_tile's arithmetic on random partials (some rows empty in every split: LSE -inf, zeros) writes every
    output element once and equals the combine kernel's merge (test_attention_decode_cpu.combine); empty rows give
    zeros and -inf."""
    from tests.test_attention_decode_cpu import combine
    plan = plan_of(name, "fixup_combine")
    plan = P.DecodePlan(**{**plan.__dict__, "splits": min(plan.splits, 9)})
    batch, hkv = 2, 2
    hq = hkv * plan.group
    rows = batch * plan.sq * hq
    gen = np.random.default_rng(0)
    partial_o = gen.standard_normal((plan.splits * rows, plan.dv))
    partial_lse = gen.standard_normal(plan.splits * rows) * 3
    partial_lse[gen.random(plan.splits * rows) < 0.3] = -np.inf  # empty splits of a row
    empty = [(0, 0, 0), (1, plan.sq - 1, hq - 1)]  # (b, token, head) rows empty in every split
    for b, token, head in empty:
        slots = np.arange(plan.splits) * rows + (b * plan.sq + token) * hq + head
        partial_lse[slots] = -np.inf
        partial_o[slots] = 0.0
    partial_o[partial_lse == -np.inf] = 0.0  # what an empty split writes
    out, lse, written = fixup_model(plan, partial_o, partial_lse, batch, hq)
    assert (written == 1).all()
    outs = [torch.from_numpy(partial_o[s * rows:(s + 1) * rows]).view(batch, plan.sq, hq, plan.dv)
            for s in range(plan.splits)]
    lses = [torch.from_numpy(partial_lse[s * rows:(s + 1) * rows]).view(batch, plan.sq, hq).permute(0, 2, 1)
            for s in range(plan.splits)]
    want_out, want_lse = combine(outs, lses)
    np.testing.assert_allclose(out, want_out.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse.numpy(), rtol=1e-12, atol=1e-12)
    for b, token, head in empty:
        assert (out[b, token, head] == 0).all() and lse[b, head, token] == -np.inf
