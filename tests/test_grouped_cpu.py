"""The grouped GEMM without a GPU: every layout, operand major-ness and epilogue compiles to HGMMA/UTMALDG code
within its register budget and without spills; the K tail's shared-memory addresses match the wgmma layout; plans,
argument checks (errors naming the argument), the host offset validation and the float32 reference."""
import re
from dataclasses import replace

import pytest
import torch

import nvfly
from nvfly.arch import sm90
from nvfly.ops import grouped
from nvfly.ops.common.gemm_config import SMEM_LIMIT, GemmConfig
from nvfly.ops.common.groups import table_bytes
from nvfly.ops.grouped.kernel import a_tail_offset
from nvfly.ops.grouped.plan import MAX_GROUPS, PINGPONG_TILE, fits, make_plan

VARIANTS = [("contiguous", "none", "K", "K"), ("contiguous", "none", "K", "MN"), ("masked", "none", "MN", "MN"),
            ("masked", "none", "K", "K"), ("masked", "none", "K", "MN"),
            ("kgrouped", "none", "MN", "MN"),
            ("contiguous", "silu_mul", "K", "K"), ("contiguous", "silu_mul", "K", "MN"),
            ("masked", "silu_mul", "K", "MN")]
TILES = [GemmConfig(128, 256, 4, 2, stream_k=False), GemmConfig(64, 128, 9, 1, stream_k=False)]


def check_kernel(k, mma):
    """A warp-specialised wgmma kernel as compiled: ``mma`` wgmmas (a SASS opcode prefix), TMA loads, both
    setmaxnreg, no spills, registers for every thread, no ptxas warnings."""
    ops = k.sass_opcodes()
    assert any(op.startswith(mma) for op in ops), sorted(ops)
    assert k.count("UTMALDG") > 0 and k.count("USETMAXREG") == 2
    assert k.resources.spill_stores == 0 and k.resources.stack_bytes == 0, k.resources
    assert k.resources.registers <= 65536 // k.threads
    assert not k.warnings, k.warnings  # no serialised wgmma, setmaxnreg honoured


# every variant on the 128x256 tile; the 64-row tile on one variant of each layout (all of them under --run-slow)
CASES = [(v, TILES[0]) for v in VARIANTS] + [
    pytest.param(v, TILES[1], marks=() if v in (VARIANTS[1], VARIANTS[5], VARIANTS[8]) else pytest.mark.slow)
    for v in VARIANTS]


@pytest.mark.parametrize("variant,config", CASES, ids=lambda x: "-".join(x) if isinstance(x, tuple) else
                         f"{x.bm}x{x.bn}")
def test_every_variant_compiles(variant, config):
    (k,) = grouped.compile_variants([variant], config=config)
    check_kernel(k, f"HGMMA.64x{config.bn}x16.F32.BF16")
    layout = variant[0]
    assert k.dynamic_smem_bytes == config.ring_end(2) + (table_bytes(8) if layout != "kgrouped" else 0)
    if layout == "kgrouped":  # the K tail is zeroed in shared memory and fenced for wgmma
        assert "fence.proxy.async.shared::cta" in k.ptx
    else:  # the group table: a block scan over the device sizes
        assert "shfl.sync.up" in k.ptx


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float16, None), (torch.bfloat16, torch.float32)])
def test_dtypes_compile(dtype, out_dtype):
    (k,) = grouped.compile_variants([("contiguous", "none", "K", "MN")], dtype=dtype, out_dtype=out_dtype,
                                    config=TILES[0])
    assert k.count("HGMMA") > 0 and k.resources.spill_stores == 0


def test_many_groups_compile_and_fit():
    """1024 groups: the table (and the scan's three groups a thread) fit next to the deepest ring."""
    plan = make_plan("contiguous", "none", "bf16", MAX_GROUPS, "K", "MN", 16384, 2048, 7168, 16, 132)
    assert plan.smem_bytes <= SMEM_LIMIT
    (k,) = grouped.compile_variants([("contiguous", "none", "K", "MN")], config=plan.config, groups=MAX_GROUPS)
    assert k.resources.spill_stores == 0 and k.dynamic_smem_bytes == plan.smem_bytes


@pytest.mark.parametrize("groups", [1, 3])
def test_odd_group_counts_compile(groups):
    """One group (no binary search step) and a count that is no power of two."""
    (k,) = grouped.compile_variants([("contiguous", "none", "K", "K")], config=TILES[0], groups=groups)
    assert k.resources.spill_stores == 0 and k.dynamic_smem_bytes == TILES[0].ring_end(2) + table_bytes(groups)


@pytest.mark.parametrize("rows", [64, 128])
def test_k_tail_offsets_match_the_wgmma_layout(rows):
    """zero_k_tail's addresses: each K row of a 64-row chunk of the MN-major A tile is one 128-byte line holding
    exactly that chunk's elements of the row."""
    layout = sm90.operand_layout(rows, 64, nvfly.bf16, "MN", 128)
    for r in range(rows):
        for c in range(64):
            byte = layout((r, c)) * 2
            line = a_tail_offset(r // 64 * 64, c, 64, 128, 2)
            assert line <= byte < line + 128


def test_tma_coordinates_of_group_boundaries_are_declined():
    """A group boundary that would be a TMA coordinate of a contiguous dimension (an illegal instruction unless a
    multiple of 16 bytes; the offsets are on the device) is declined: column-major tokens, K-contiguous
    weight-gradient operands, a fused N-contiguous B whose up columns start off 16 bytes; the plan refuses them."""
    from nvfly.ops.grouped.api import _coordinate_reason
    tokens = torch.randn(64, 32).bfloat16()
    w = torch.randn(4, 32, 48).bfloat16()
    assert _coordinate_reason("contiguous", tokens, w, "none", 48) is None
    assert _coordinate_reason("contiguous", tokens, w.mT.contiguous().mT, "none", 48) is None
    assert _coordinate_reason("contiguous", tokens.t().contiguous().t(), w, "none", 48).startswith(
        "a: column-major tokens")
    x, dy = torch.randn(64, 16).bfloat16(), torch.randn(64, 48).bfloat16()  # the weight gradient x.mT @ dy
    assert _coordinate_reason("kgrouped", x.mT, dy, "none", 48) is None
    assert _coordinate_reason("kgrouped", x.mT.contiguous(), dy, "none", 48).startswith("a: K-contiguous")
    assert _coordinate_reason("kgrouped", x.mT, dy.mT.contiguous().mT, "none", 48).startswith("b: K-contiguous")
    gate_up = torch.randn(4, 32, 2 * 12).bfloat16()  # I = 12: 24 bytes
    assert "column I = 12" in _coordinate_reason("contiguous", tokens, gate_up, "silu_mul", 12)
    assert _coordinate_reason("contiguous", tokens, gate_up.mT.contiguous().mT, "silu_mul", 12) is None
    assert _coordinate_reason("contiguous", tokens, torch.randn(4, 32, 32).bfloat16(), "silu_mul", 16) is None
    for layout, majors in (("contiguous", ("MN", "K")), ("kgrouped", ("K", "MN")), ("kgrouped", ("MN", "K"))):
        with pytest.raises(ValueError, match="a_major/b_major"):
            make_plan(layout, "none", "bf16", 4, *majors, 1024, 1024, 1024, 256, 132)


def test_heuristic_tiles():
    decode = make_plan("contiguous", "none", "bf16", 128, "K", "MN", 1024, 1536, 2048, 8, 132)
    assert (decode.config.bm, decode.config.consumers) == (64, 1) and decode.config.stages >= 8
    prefill = make_plan("contiguous", "none", "bf16", 64, "K", "MN", 15952, 2048, 7168, 249, 132)
    assert (prefill.config.bm, prefill.config.bn, prefill.config.consumers) == (128, 256, 2)
    assert prefill.grid == 132 and prefill.k_tiles == 7168 // 64
    fused = make_plan("contiguous", "silu_mul", "bf16", 8, "K", "MN", 8192, 14336, 4096, 1024, 132)
    assert fused.config.bn == 256 and fused.n == 14336
    few = make_plan("masked", "none", "bf16", 4, "K", "K", 256, 512, 1024, 256, 132)
    assert few.config.bn == 128 and few.grid == 4 * 2 * 4  # an upper bound of 32 tiles: 32 blocks
    # Mixtral's 1024 rows over 8 experts: ~192 wide tiles (1.5 waves) take the ping-pong tile; 8192 rows (~8
    # waves) and the masked layout keep the wide one
    short = make_plan("contiguous", "none", "bf16", 8, "K", "MN", 1024, 4096, 14336, 128, 132)
    assert replace(short.config, stages=PINGPONG_TILE.stages) == PINGPONG_TILE and short.grid == 132
    for layout, m, rows in (("contiguous", 8192, 1024), ("masked", 512, 256)):
        assert make_plan(layout, "none", "bf16", 8, "K", "MN", m, 4096, 14336, rows, 132).config.bn == 256


# the forward's candidate tiles (benchmarks.grouped --variants) for the anchor's 64 groups of ~249 rows
ANCHOR = dict(layout="contiguous", fuse="none", dtype="bf16", groups=64, a_major="K", b_major="K", m=15952, n=2048,
              k=7168, rows_per_group=249, sms=132)


def anchor_variants():
    from nvfly.ops.grouped.plan import forward_variants
    return forward_variants(make_plan(**ANCHOR).config, 64, "contiguous", "K")


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("name", ["current", "tma-store", "cluster2", "cluster2-tma", "cluster2n", "cluster2n-tma",
                                  "256x128-tma", "128x128-tma", "pingpong-tma", "skip-empty"])
@pytest.mark.parametrize("variant", [("contiguous", "none", "K", "K"), ("masked", "none", "K", "MN"),
                                     ("contiguous", "silu_mul", "K", "MN")], ids="-".join)
def test_forward_variants_compile(name, variant):
    """Each forward variant compiles to HGMMA without spills: stmatrix + UTMASTG next to the masked register stores
    (a slice across a group's end) where it stores by TMA, multicast B loads and cluster barriers where it runs
    clusters; the staging buffers, then the group table, after the ring."""
    config = anchor_variants()[name]
    if variant[1] == "silu_mul" and config.cluster_m > 1:
        pytest.skip("the fused tile runs without clusters along M (make_plan refuses it)")
    (k,) = grouped.compile_variants([variant], config=config, groups=64)
    check_kernel(k, f"HGMMA.64x{config.bn}x16.F32.BF16")
    assert k.dynamic_smem_bytes == config.smem_bytes(2) + table_bytes(64) <= SMEM_LIMIT
    assert (k.count("UTMASTG") > 0) == config.tma_store and (k.count("STSM") > 0) == config.tma_store
    assert k.count("STG.E") > 0  # the register epilogue (the only one, or the ragged slices')
    clustered = config.cluster_m * config.cluster_n > 1
    assert ("MULTICAST" in k.sass()) == clustered and (k.count("UCGABAR_ARV") > 0) == clustered


def test_forward_variants_plans():
    """The variants keep the heuristic's tile as "current", fit next to the table of 64 (and 1024) groups; the
    store box is 2-D for the contiguous output, 3-D for the masked; a cluster launches whole clusters."""
    variants = anchor_variants()
    assert variants["current"] == make_plan(**ANCHOR).config
    assert set(variants) == {"current", "tma-store", "cluster2", "cluster2-tma", "cluster2n", "cluster2n-tma",
                             "256x128-tma", "128x128-tma", "pingpong-tma", "skip-empty"}
    for name, config in variants.items():
        plan = make_plan(**ANCHOR, config=config)
        cluster = config.cluster_m * config.cluster_n
        assert plan.smem_bytes <= SMEM_LIMIT and plan.grid % cluster == 0 and plan.grid <= 132
        assert plan.store_box == ((config.wg_m, 64) if config.tma_store else None)
        masked = make_plan("masked", "none", "bf16", 64, "K", "K", 512, 2048, 7168, 249, 132, config)
        assert masked.store_box == ((1, config.wg_m, 64) if config.tma_store else None)
    from nvfly.ops.grouped.plan import forward_variants
    many = forward_variants(make_plan(**ANCHOR).config, MAX_GROUPS, "contiguous", "K")
    assert set(many) == set(variants)  # fewer stages where the table of 1024 groups needs the room
    assert all(make_plan(**{**ANCHOR, "groups": MAX_GROUPS}, config=c).smem_bytes <= SMEM_LIMIT for c in many.values())
    assert set(forward_variants(make_plan(**ANCHOR).config, 8, "kgrouped", "MN")) == \
        {"current", "tma-store", "256x128-tma", "128x128-tma", "pingpong-tma"}  # the K-grouped layout: no cluster
    cluster = make_plan(**ANCHOR, config=variants["cluster2"])
    # B in two halves, one per block of the cluster; the launch's bound counts whole cluster rows
    assert cluster.b_box == (1, 128, 64) and cluster.a_box == (128, 64) and cluster.grid == 132
    along_n = make_plan(**ANCHOR, config=variants["cluster2n"])  # A in two halves
    assert along_n.a_box == (64, 64) and along_n.b_box == (1, 256, 64) and along_n.grid == 132
    fused = make_plan(**{**ANCHOR, "fuse": "silu_mul", "n": 1024}, config=variants["tma-store"])
    assert fused.store_box == (64, 64)  # the output tile: 128 of the 256 B columns


KGROUPED = ("kgrouped", "none", "MN", "MN")


SMALL_K_TILES = ("pingpong-tma-2buf", "pingpong-tma-ring2", "pingpong-tma-2buf-ring2", "128x256-tma-4buf",
                 "128x256-tma-4buf-ring2", "256x128-tma-2buf", "256x128-tma-2buf-ring2")


@pytest.mark.parametrize("tile,out_dtype", [("heuristic", torch.float32), ("pingpong-tma", None),
                                            ("pingpong-register", None), ("cooperative-tma", None)]
                         + [(tile, None) for tile in SMALL_K_TILES])
def test_kgrouped_epilogues_compile(tile, out_dtype):
    """The weight gradient's ping-pong consumers and TMA-store epilogue (``kgrouped_variants``; the cooperative
    register tile is test_every_variant_compiles'): no spills, stmatrix + UTMASTG where the config stores by TMA
    (the heuristic's stores 32-bit outputs through registers), the staging buffer after the ring; the small-K
    candidates' staging rings (store_tiles 2) wait for all but their other buffers' groups."""
    from nvfly.ops.grouped.plan import kgrouped_variants
    config = None if tile == "heuristic" else kgrouped_variants(8)[tile]
    (k,) = grouped.compile_variants([KGROUPED], config=config, out_dtype=out_dtype)
    plan = make_plan(*KGROUPED[:2], "bf16", 8, *KGROUPED[2:], 4096, 4096, 4096, 4096, 132, config,
                     4 if out_dtype else 2)
    check_kernel(k, f"HGMMA.64x{plan.config.bn}x16.F32.BF16")
    assert plan.config.pingpong == tile.startswith(("heuristic", "pingpong"))
    assert plan.config.tma_store == ("-tma" in tile)
    cfg = plan.config
    if cfg.tma_store:
        slices = cfg.bn // cfg.store_width
        assert k.count("UTMASTG") == slices and k.count("STSM") == cfg.bn // 16 * (cfg.wg_m // 64)
        ring = cfg.store_slices * cfg.store_tiles
        waits = {int(w) for w in re.findall(r"cp\.async\.bulk\.wait_group\.read (\d+);", k.ptx)}
        # the ring's slices wait for all but ring - 1 groups; a tile restarting at buffer 0 waits for all of them
        # (and, with fewer buffers than slices, for all but store_buffers - 1 within the tile)
        assert waits == ({ring - 1} if cfg.store_tiles > 1 else {0} | ({cfg.store_slices - 1}
                                                                        if cfg.store_slices < slices else set()))
    assert k.dynamic_smem_bytes == plan.smem_bytes <= SMEM_LIMIT
    assert (k.count("UTMASTG") > 0) == plan.config.tma_store and (k.count("STSM") > 0) == plan.config.tma_store
    assert "fence.proxy.async.shared::cta" in k.ptx  # the K tail


def test_kgrouped_plans():
    """The heuristic's weight-gradient tile, its 32-bit-output fallback, the store box; its ping-pong TMA-store tile
    fits every layout (the ragged ones store a slice across a group's end through registers); which outputs a TMA
    descriptor covers."""
    from dataclasses import replace
    from nvfly.ops.grouped.api import _tma_storable
    from nvfly.ops.grouped.plan import KGROUPED_TILE
    plan = make_plan("kgrouped", "none", "bf16", 128, "MN", "MN", 2048, 768, 32768, 2048, 132)
    assert (plan.config.bm, plan.config.bn, plan.config.pingpong, plan.config.tma_store) == (128, 128, True, True)
    assert plan.store_box == (1, 128, 64) and plan.store_swizzle == 128 and plan.grid == 132
    f32 = make_plan("kgrouped", "none", "bf16", 128, "MN", "MN", 2048, 768, 32768, 2048, 132, None, 4)
    assert f32.config.pingpong and not f32.config.tma_store and f32.store_box is None
    for layout in ("contiguous", "masked"):
        assert fits(replace(KGROUPED_TILE, stages=4), 8, layout, "K") is None
    assert fits(replace(KGROUPED_TILE, stages=4), 8, "kgrouped", "MN") is None
    assert _tma_storable(None, (4, 64, 200), torch.bfloat16)
    assert not _tma_storable(None, (4, 64, 196), torch.bfloat16)  # 392-byte rows
    assert not _tma_storable(torch.empty(4, 200, 64).mT, (4, 64, 200), torch.bfloat16)
    assert _tma_storable(torch.empty(4, 64, 208, dtype=torch.bfloat16)[..., :200], (4, 64, 200), torch.bfloat16)


def test_configs_are_checked():
    assert fits(GemmConfig(128, 128, 6, 2, pingpong=True), 8, "contiguous", "K") is None
    assert "without K splits" in fits(GemmConfig(128, 256, 4, 2, split_k=2), 8, "contiguous", "K")
    assert fits(GemmConfig(128, 256, 4, 2, cluster_m=2), 8, "masked", "K") is None
    assert "K-grouped tiles take none" in fits(GemmConfig(128, 256, 4, 2, cluster_m=2), 8, "kgrouped", "MN")
    with pytest.raises(ValueError, match="fused gate/up tile runs without clusters along M"):
        make_plan("contiguous", "silu_mul", "bf16", 8, "K", "K", 1024, 1024, 1024, 128, 132,
                  GemmConfig(128, 256, 4, 2, cluster_m=2, stream_k=False))
    assert fits(GemmConfig(128, 256, 4, 2, stream_k=False), 8, "contiguous", "K") is None
    skip = GemmConfig(128, 256, 4, 2, stream_k=False, skip_empty=True)
    assert fits(skip, 8, "masked", "K") is None
    assert "skip_empty" in fits(skip, 8, "kgrouped", "MN")
    assert "skip_empty" in fits(GemmConfig(128, 128, 6, 2, pingpong=True, skip_empty=True), 8, "contiguous", "K")
    # the table costs shared memory: a ring that just fits the GEMM may not fit 1024 groups' table
    full = GemmConfig(128, 128, 7, 2)
    assert full.check(2) is None
    assert full.ring_end(2) + table_bytes(MAX_GROUPS) > SMEM_LIMIT and fits(full, MAX_GROUPS, "contiguous", "K")
    with pytest.raises(ValueError, match="config: bn=120: the fused gate/up tile"):
        make_plan("contiguous", "silu_mul", "bf16", 8, "K", "K", 1024, 1024, 1024, 128, 132,
                  GemmConfig(128, 120, 4, 2, stream_k=False))


def _operands(t=64, e=4, k=32, n=48, dtype=torch.bfloat16):
    a = torch.randn(t, k).to(dtype)
    b = torch.randn(e, k, n).to(dtype)
    offs = torch.tensor([10, 10, 40, 64][:e], dtype=torch.int32)
    return a, b, offs


@pytest.mark.parametrize("call,match,kind", [
    (lambda a, b, o: grouped.check(a.float(), b.float(), o), "a: dtype torch.float32 is not supported", TypeError),
    (lambda a, b, o: grouped.check(a, b.half(), o), "b: dtype", TypeError),
    (lambda a, b, o: grouped.check(a, b[:, :16], o), "do not multiply", ValueError),
    (lambda a, b, o: grouped.check(a, b, o.long()), "offs: expected a 1-D int32", TypeError),
    (lambda a, b, o: grouped.check(a, b, None), "offs: expected", TypeError),
    (lambda a, b, o: grouped.check(a, b, o[:3]), "offs: 3 groups, b has 4", ValueError),
    (lambda a, b, o: grouped.check(a, b, o, out_dtype=torch.int8), "out_dtype", TypeError),
    (lambda a, b, o: grouped.check(a, b, o, out=torch.empty(64, 47, dtype=torch.bfloat16)), "out: expected shape",
     ValueError),
    (lambda a, b, o: grouped.check(a, b[:, :, :47], o, fuse="silu_mul"), "2 \\* I", ValueError),
    (lambda a, b, o: grouped.check(a, b, o, fuse="gelu"), "fuse", ValueError),
    (lambda a, b, o: grouped.check(a.view(4, 16, 32), b[0], o), "3-D a with a 2-D b", ValueError),
    (lambda a, b, o: grouped.check(a.view(4, 16, 32), b, o), "offs: 3-D x 3-D", ValueError),
    (lambda a, b, o: grouped.check(a.view(4, 16, 32)[:2], b, None), "b: 4 groups, a has 2", ValueError),
    (lambda a, b, o: grouped.check(a, b, torch.zeros(2000, dtype=torch.int32)), "1 to 1024", ValueError),
])
def test_bad_input_names_the_argument(call, match, kind):
    a, b, offs = _operands()
    with pytest.raises(kind, match=match):
        call(a, b, offs)


def test_grouped_mm_errors_name_the_op():
    a, b, offs = _operands()
    with pytest.raises(TypeError, match="^nvfly.ops.grouped.grouped_mm: offs"):
        grouped.grouped_mm(a, b, offs.float())
    with pytest.raises(ValueError, match="^nvfly.ops.grouped.grouped_mm: a is on cpu, not CUDA"):
        grouped.grouped_mm(a, b, offs)
    with pytest.raises(ValueError, match="^nvfly.ops.grouped.grouped_mm_masked: a, b: the masked layout"):
        grouped.grouped_mm_masked(a, b, offs)


def test_layouts_and_shapes():
    a, b, offs = _operands()
    assert grouped.check(a, b, offs) == ("contiguous", (64, 48), 4)
    assert grouped.check(a, b, offs, fuse="silu_mul") == ("contiguous", (64, 24), 4)
    wgrad_a, wgrad_b = torch.randn(16, 64).bfloat16(), torch.randn(64, 48).bfloat16()
    assert grouped.check(wgrad_a, wgrad_b, offs) == ("kgrouped", (4, 16, 48), 4)
    assert grouped.check(a.view(4, 16, 32), b, offs, masked=True) == ("masked", (4, 16, 48), 4)
    assert grouped.check(a.view(4, 16, 32), b) == ("batched", (4, 16, 48), 4)
    assert grouped.eligibility(a, b, offs) == "a is on cpu, not CUDA"
    assert grouped.eligibility(a, b, offs.long()).startswith("offs: expected a 1-D int32")


def test_validate_offsets():
    grouped.validate_offsets(torch.tensor([0, 5, 5, 9], dtype=torch.int32), 9)
    with pytest.raises(ValueError, match=r"offs: offsets must not decrease, offs\[2\] = 3 < 5"):
        grouped.validate_offsets(torch.tensor([0, 5, 3, 9], dtype=torch.int32), 9)
    with pytest.raises(ValueError, match="offs: the last offset 10 is beyond the 9 rows"):
        grouped.validate_offsets(torch.tensor([0, 5, 10], dtype=torch.int32), 9)
    with pytest.raises(ValueError, match="counts: count 17 of group 1 is outside"):
        grouped.validate_offsets(torch.tensor([3, 17], dtype=torch.int32), 16, masked=True, name="counts")


def test_reference_matches_per_group_products():
    a, b, offs = _operands()
    ref = grouped.reference(a, b, offs)
    assert torch.allclose(ref[0:10], a[0:10].float() @ b[0].float())
    assert torch.allclose(ref[10:40], a[10:40].float() @ b[2].float())
    fused = grouped.reference(a, b, offs, fuse="silu_mul")
    full = a[40:].float() @ b[3].float()
    assert torch.allclose(fused[40:], torch.nn.functional.silu(full[:, :24]) * full[:, 24:])
    wgrad = grouped.reference(a.t(), a, offs)  # [32, 64] x [64, 32] grouped along the 64
    assert torch.equal(wgrad[1], torch.zeros(32, 32)) and torch.allclose(wgrad[3], a[40:].float().t() @ a[40:].float())
    masked = grouped.reference(a.view(4, 16, 32), b, torch.tensor([3, 0, 16, 20], dtype=torch.int32), masked=True)
    assert masked[0, 3:].isnan().all() and masked[1].isnan().all() and not masked[2].isnan().any()


def test_describe():
    text = grouped.describe("contiguous", 128, 1024, 1536, 2048)
    assert text.startswith("grouped contiguous: 64x128 tile on 1 consumer")


# ---------------------------------------------------------------------------------------------- torch glue, MoE
def test_custom_op_fake_autograd_and_route():
    """nvfly::grouped_mm traces (its fake checks like the op), differentiates (CPU: torch's kernels run it), and the
    _grouped_mm route is registered."""
    import nvfly.torch  # noqa: F401
    from nvfly.torch import routing
    a, b, offs = _operands()
    meta = torch.ops.nvfly.grouped_mm(a.to("meta"), b.to("meta"), offs.to("meta"), fuse="silu_mul")
    assert meta.shape == (64, 24) and meta.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="nvfly::grouped_mm: b: shape"):
        torch.ops.nvfly.grouped_mm(a.to("meta"), b[:, :8].to("meta"), offs.to("meta"))
    a.requires_grad_()
    b.requires_grad_()
    torch.ops.nvfly.grouped_mm(a, b, offs, fuse="silu_mul").float().square().sum().backward()
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    grouped.reference(a32, b32, offs, fuse="silu_mul").square().sum().backward()
    for got, want in ((a.grad, a32.grad), (b.grad, b32.grad)):
        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2
    assert "aten::_grouped_mm" in [r.op for r in routing.routes()]


def test_route_takes_the_weight_gradient_to_the_ops_rules():
    """The K-grouped weight gradient (2-D x 2-D) goes on to the op's rules like the forward (its tile measured
    faster than torch's); what the route itself declines is bias and another out_dtype."""
    from nvfly.torch.grouped_ops import _route_eligibility
    a, b, offs = _operands()
    wgrad = (torch.randn(16, 64).bfloat16(), torch.randn(64, 48).bfloat16(), offs)
    assert _route_eligibility(*wgrad) == "a is on cpu, not CUDA"
    assert _route_eligibility(a, b, offs) == "a is on cpu, not CUDA"
    assert _route_eligibility(a, b, offs, bias=torch.zeros(48)).startswith("bias")


def test_custom_ops_pass_opcheck():
    a, b, offs = (t.float() if t.dtype != torch.int32 else t for t in _operands())
    torch.library.opcheck(torch.ops.nvfly.grouped_mm.default, (a, b, offs), {"fuse": "silu_mul"})
    torch.library.opcheck(torch.ops.nvfly.grouped_mm.default, (a.t().contiguous(), a, offs))
    torch.library.opcheck(torch.ops.nvfly.grouped_mm_masked.default, (a.view(4, 16, 32), b, offs.clamp_max(16)))
    torch.library.opcheck(torch.ops.nvfly.grouped_mm_out.default, (a, b, offs, torch.empty(64, 48)))


def test_moe_layer_matches_the_reference_eager_and_compiled():
    """The layer's routing, permutation and weighted un-permutation (CPU: the pieces fall back to torch)."""
    from nvfly.ops import moe
    gen = torch.Generator().manual_seed(1)
    t, h, inter, e, k = 40, 64, 32, 8, 2
    x = torch.randn(t, h, generator=gen).bfloat16()
    router = torch.randn(e, h, generator=gen).bfloat16()
    w_gate_up = (torch.randn(e, 2 * inter, h, generator=gen) / 8).bfloat16()
    w_down = (torch.randn(e, h, inter, generator=gen) / 6).bfloat16()
    ref = moe.reference(x, router, w_gate_up, w_down, k)
    out = moe.moe(x, router, w_gate_up, w_down, k)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    compiled = torch.compile(lambda *args: moe.moe(*args, k), backend="eager")
    assert torch.equal(compiled(x, router, w_gate_up, w_down), out)
    rows, offs, slots = moe.permute(x, torch.tensor([[3, 1], [1, 0], [3, 3]]), 4)
    assert offs.tolist() == [1, 3, 3, 6] and slots.tolist() == [3, 1, 2, 0, 4, 5]
    assert torch.equal(rows, x[[1, 0, 1, 0, 2, 2]])


def test_explain_covers_grouped_mm():
    from nvfly.torch.grouped_ops import explain_grouped
    text = explain_grouped(64, 16384, 2048, 7168)
    assert "nvfly runs: grouped contiguous: 128x256 tile on 2 consumers" in text
    assert "(256 rows a group: compute tiles, 256 output columns wide)" in text  # why the heuristic took it
    assert "1-2 waves on 132 SMs" in explain_grouped(8, 1024, 4096, 14336)  # the wave rule's ping-pong tile
    assert "<= 64: memory-bound" in explain_grouped(256, 4096, 4096, 7168)
    # the weight gradient of 64 tokens top-8 over 256 experts: 2 tokens a group, the wide staged tile (as it runs)
    assert grouped.describe("kgrouped", 256, 7168, 4096, 512).startswith("grouped kgrouped: 128x256 tile")
    assert "nvfly declines: fuse" in explain_grouped(8, 512, 256, 1024, layout="kgrouped", fuse="silu_mul")
    assert "A MN-major, B MN-major" in explain_grouped(8, 512, 256, 1024, layout="kgrouped", b_major="MN")
    assert "nvfly declines: a_major/b_major" in explain_grouped(8, 512, 256, 1024, layout="kgrouped", b_major="K")


@pytest.fixture
def compile_grouped_mm(aten_max_autotune):
    """torch.compile(max-autotune) of torch._grouped_mm on CPU with only ATen (and nvfly) to choose from."""
    from torch._inductor.utils import run_and_get_code

    def run(a, b, offs):
        fn = torch.compile(lambda a, b, o: torch._grouped_mm(a, b, o), mode="max-autotune-no-cudagraphs")
        out, code = run_and_get_code(fn, a, b, offs)
        assert torch.allclose(out.float(), torch._grouped_mm(a, b, offs).float())
        return "\n".join(code)
    return run


def test_inductor_grouped_mm_candidates(compile_grouped_mm, monkeypatch):
    """max-autotune's grouped mm: declined on CPU with the reason; when eligible (patched), nvfly's candidates join
    ATen's, and a winner is emitted as nvfly::grouped_mm_out (which runs torch on CPU, so the result stays right)."""
    import nvfly.torch
    from nvfly.torch import inductor
    from nvfly.torch.gemm_ops import clear_decisions, decisions
    a, b, offs = _operands()
    nvfly.torch.install()
    assert "nvfly" not in compile_grouped_mm(a, b, offs)
    (d,) = [d for d in decisions() if d.where == "inductor"]
    assert d.op == "grouped_mm" and d.reason == "a is on cpu, not CUDA"

    clear_decisions()
    torch._dynamo.reset()
    monkeypatch.setattr(inductor.grouped, "eligibility", lambda *args, **kwargs: None)
    monkeypatch.setattr(inductor.NvflyCaller, "_compile", lambda self, operands: None)
    monkeypatch.setattr(inductor.NvflyCaller, "benchmark", lambda self, *args, out: 1e-6)
    code = compile_grouped_mm(a, b, offs)
    assert "torch.ops.nvfly.grouped_mm_out.default(" in code and "config='auto'" in code
    (d,) = [d for d in decisions() if d.where == "inductor"]
    assert d.candidates[0] == "auto" and len(d.candidates) == 4 and d.winner == "nvfly auto"


def test_benchmark_moe_layers_agree():
    """benchmarks.grouped's MoE layers (eager torch._grouped_mm and nvfly's ops, here on their torch fallback): the
    float32 layer's output, and the same gradients."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    import nvfly.torch  # noqa: F401  (torch.ops.nvfly.grouped_mm)
    from benchmarks.grouped import chunked_rel_err, nvfly_moe, torch_moe
    from nvfly.ops import moe
    t, h, inter, e, k = 40, 64, 32, 8, 2
    args = [torch.randn(t, h).bfloat16(), (torch.randn(e, h) / 8).bfloat16(),
            (torch.randn(e, 2 * inter, h) / 8).bfloat16(), (torch.randn(e, h, inter) / 6).bfloat16()]
    ref = moe.reference(*args, k)
    leaves = [a.requires_grad_() for a in args]
    grad = torch.randn(t, h).bfloat16()
    grads = []
    for layer in (torch_moe, nvfly_moe):
        out = layer(*leaves, k)
        assert chunked_rel_err(out, ref) < 2e-2
        grads.append(torch.autograd.grad(out, leaves, grad))
    for got, want in zip(*grads):
        assert chunked_rel_err(got, want) < 2e-2


def test_benchmark_variant_rows_plan():
    """benchmarks.grouped --variants: its four compute-bound forward rows, and with --tokens/--routings the full
    suite's contiguous forward rows (here the one-hot ones), each variant planned for its operands (meta tensors:
    the benchmark's shapes and majors) within the shared memory and the SMs."""
    import argparse

    from benchmarks.grouped import VARIANT_CASES, describe_config, group_sizes, suite_of
    from nvfly.ops.grouped.api import plan_of
    from nvfly.ops.grouped.plan import forward_variants
    assert [c.name for c in VARIANT_CASES] == ["anchor E64 T15952", "Qwen3 256/expert", "Mixtral 1024/expert",
                                               "Mixtral T4096 hot"]
    picked = argparse.Namespace(tokens="512,16384", passes="forward", models="", routings="hot")
    hot = [c for c in suite_of(picked, argparse.ArgumentParser()) if c.layout == "contiguous"]
    assert len(hot) == 12 and {c.routing for c in hot} == {"hot"} and {c.gemm_pass for c in hot} == {"forward"}
    for case in VARIANT_CASES + hot:
        rows = sum(group_sizes(case))
        a = torch.empty(rows, case.k, dtype=torch.bfloat16, device="meta")
        b = torch.empty(case.experts, case.n, case.k, dtype=torch.bfloat16, device="meta").mT
        default = plan_of("contiguous", a, b, (rows, case.n), case.experts, "none", None)
        assert default.b_major == "K"
        for name, config in forward_variants(default.config, case.experts, "contiguous", "K").items():
            plan = plan_of("contiguous", a, b, (rows, case.n), case.experts, "none", config)
            assert plan.config == config and plan.smem_bytes <= SMEM_LIMIT and plan.grid <= 132, (case, name)
            assert describe_config(config).startswith(f"{config.bm}x{config.bn} ")


def test_benchmark_topk_routing_is_ragged():
    """benchmarks.grouped's "topk8" routing: every token's 8 experts counted once (rows in all), seeded (the same
    sizes each run), and ragged as a router's (groups whose last 128-row tile is partial)."""
    from benchmarks.grouped import Case, group_sizes
    case = Case("routed", "forward", 256, 4096, 7168, 4096 * 8, "topk8")
    sizes = group_sizes(case)
    assert len(sizes) == 256 and sum(sizes) == 4096 * 8 and max(sizes) <= 4096 and sizes == group_sizes(case)
    assert sum(1 for s in sizes if s % 128) > 100


# ---------------------------------------------------------------------------------------------- benchmarks.grouped
ISSUE_KEYS = ("experts", "tokens", "n", "k", "routing", "layout", "pass")


def test_benchmark_full_suite():
    """benchmarks.grouped's full suite is the anchors' grouped suite: three models x both expert weights x tokens
    64..16K x three routings, every pass (the fused gate/up on w13 only); rows carry issue #29's shape keys, tokens
    before the top-k fan-out; a shape's rows run together (Inductor compiles it once for its routings), the
    4096-token shapes of every model first."""
    from benchmarks.grouped import FULL, FULL_TOKENS, MODELS, ROUTINGS, group_sizes
    assert len(FULL) == 324 and len({c.name for c in FULL}) == 324
    counts = {}
    for c in FULL:
        counts[c.gemm_pass, c.layout] = counts.get((c.gemm_pass, c.layout), 0) + 1
    assert counts == {("forward", "contiguous"): 72, ("forward", "masked"): 72, ("dgrad", "contiguous"): 72,
                      ("wgrad", "contiguous"): 72, ("gate_up", "contiguous"): 36}
    models = {(e, top): shapes for _, e, top, shapes in MODELS}
    assert models == {(256, 8): [(4096, 7168), (7168, 2048)], (128, 8): [(1536, 2048), (2048, 768)],
                      (8, 2): [(28672, 4096), (4096, 14336)]}
    for c in FULL:
        keys = c.row_keys()
        assert set(ISSUE_KEYS) <= set(keys) and keys["rows"] == c.rows
        assert keys["tokens"] * c.top_k == c.rows and keys["tokens"] in FULL_TOKENS and c.routing in ROUTINGS
        assert (c.n, c.k) in models[c.experts, c.top_k]
        assert c.gemm_pass != "gate_up" or (c.n, c.k) == models[c.experts, c.top_k][0]
    forward = [(c.experts, c.n, c.k, c.rows) for c in FULL if c.gemm_pass == "forward" and c.layout == "contiguous"]
    runs = [s for i, s in enumerate(forward) if i == 0 or forward[i - 1] != s]
    assert len(runs) == len(set(runs)) == 24 and all(forward.count(s) == 3 for s in runs)
    assert [rows // top for (e, _, _, rows), top in zip(runs[:6], [8, 8, 8, 8, 2, 2])] == [4096] * 6
    for c in FULL[:81:7] + FULL[-27:]:  # every model and pass; group sizes sum to the rows (wgrad's in 8s)
        sizes = group_sizes(c)
        assert len(sizes) == c.experts and sum(sizes) == c.rows
        assert c.gemm_pass != "wgrad" or all(s % 8 == 0 for s in sizes)


def _full_suite_operands(case):
    """The operands nvfly gets in benchmarks.grouped's setup, as meta tensors: (layout, a, b, output shape, fuse,
    rows per group for the heuristic)."""
    from benchmarks.grouped import masked_capacity
    e, n, k, rows = case.experts, case.n, case.k, case.rows

    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")
    if case.layout == "masked":
        cap = masked_capacity(case)
        return "masked", meta(e, cap, k), meta(e, n, k).mT, (e, cap, n), "none", rows / e
    if case.gemm_pass in ("forward", "gate_up"):
        fuse = "silu_mul" if case.gemm_pass == "gate_up" else "none"
        return "contiguous", meta(rows, k), meta(e, n, k).mT, (rows, n // 2 if fuse != "none" else n), fuse, None
    if case.gemm_pass == "dgrad":
        return "contiguous", meta(rows, n), meta(e, n, k), (rows, k), "none", None
    return "kgrouped", meta(rows, k).mT, meta(rows, n), (e, k, n), "none", None


def _full_suite_kernels() -> dict:
    """(config, groups, layout, majors, fuse) -> the first full-suite row that runs that kernel; every row checked
    (its operands pass nvfly's checks, its plan fits the shared memory and the SMs)."""
    from benchmarks.grouped import FULL
    from nvfly.ops.grouped.api import _coordinate_reason, _layout_reason, check, plan_of
    kernels = {}
    for case in FULL:
        layout, a, b, shape, fuse, rows_per_group = _full_suite_operands(case)
        offs = torch.empty(case.experts, dtype=torch.int32, device="meta")
        assert check(a, b, offs, None, None, fuse, layout == "masked")[:2] == (layout, shape), case.name
        assert (_layout_reason(a, b, offs, "offs") or _coordinate_reason(layout, a, b, fuse, shape[-1])) is None
        plan = plan_of(layout, a, b, shape, case.experts, fuse, None, rows_per_group)
        assert plan.smem_bytes <= SMEM_LIMIT and plan.grid <= 132, case.name
        kernels.setdefault((plan.config, case.experts, layout, plan.a_major, plan.b_major, fuse), case.name)
    return kernels


def test_benchmark_full_suite_plans():
    """Every full-suite row is one nvfly runs: its operands (the input gradient's weights N-contiguous included)
    pass the checks and its plan fits; 33 kernels in all (``test_benchmark_full_suite_compiles`` builds them)."""
    assert len(_full_suite_kernels()) == 33


@pytest.mark.slow
def test_benchmark_full_suite_compiles():
    """The full suite's 33 kernels compile without spills or ptxas warnings (~40 s)."""
    for (config, groups, layout, a_major, b_major, fuse), name in _full_suite_kernels().items():
        (k,) = grouped.compile_variants([(layout, fuse, a_major, b_major)], config=config, groups=groups)
        check_kernel(k, "HGMMA.64x")


@pytest.mark.parametrize("routing", ["uniform", "zipf", "hot"])
def test_benchmark_passes_on_cpu(routing):
    """benchmarks.grouped's setup of every pass and layout on tiny CPU operands: torch._grouped_mm (the peer) against
    the float32 per-group reference over the rows the reference owns (the masked peer computes the whole capacity),
    the flop of the routed (masked: counted) rows."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    from benchmarks.grouped import FULL_PASSES, Case, chunked_rel_err, masked_capacity, setup
    for gemm_pass, layout in FULL_PASSES:
        case = Case("tiny", gemm_pass, 8, 48, 32, 64 * 2, routing, 2, layout)
        s = setup(case, "cpu")
        ref, out = s.reference(), s.impls["torch"]()
        assert chunked_rel_err(out, ref) < 1e-2, (gemm_pass, layout)
        width = 24 if gemm_pass == "gate_up" else 32 if gemm_pass == "dgrad" else 48
        expected = {"masked": (8, masked_capacity(case), 48), "wgrad": (8, 32, 48)}.get(
            layout if layout == "masked" else gemm_pass, (128, width))
        assert tuple(ref.shape) == tuple(out.shape) == expected, (gemm_pass, layout)
        routed = 128 if layout == "contiguous" else int((~ref[:, :, 0].isnan()).sum())
        assert s.flop == 2.0 * routed * 48 * 32 and s.plan.startswith("grouped ")


def test_benchmark_rel_err_owned():
    """chunked_rel_err: over the elements the reference owns (its NaN rows skipped), in slices, inf where the output
    is NaN on an owned element."""
    from benchmarks.common import rel_err
    from benchmarks.grouped import chunked_rel_err
    ref = torch.randn(5, 7, 3)
    out = ref + 1e-3 * torch.randn(5, 7, 3)
    assert chunked_rel_err(out, ref, chunk_elements=21) == pytest.approx(rel_err(out, ref), rel=1e-9)
    ref[2, 4:] = float("nan")
    out[2, 4:] = float("nan")
    owned = ~ref.isnan()
    assert chunked_rel_err(out, ref, chunk_elements=1) == pytest.approx(rel_err(out[owned], ref[owned]), rel=1e-9)
    out[0, 0, 0] = float("nan")
    assert chunked_rel_err(out, ref) == float("inf")


def test_benchmark_triton_budget():
    """TritonBudget: a compile only while the seconds spent, the compile (the longest so far) and the rows left at
    their mean stay within the budget; 0 is no limit."""
    from benchmarks.grouped import TritonBudget
    budget = TritonBudget(100.0, start=0.0)
    assert budget.allows(rows_left=70, now=0.0) and not budget.allows(rows_left=71, now=0.0)  # 30 s + 1 s a row
    budget.compiles += [10.0, 20.0]
    budget.rows += [0.5, 1.5]
    assert budget.allows(rows_left=20, now=60.0) and not budget.allows(rows_left=21, now=60.0)
    assert TritonBudget(0.0, start=0.0).allows(rows_left=10 ** 6, now=10 ** 6)


def test_benchmark_arguments():
    """--tokens, --passes, --models and --routings pick a part of the full suite (in its order; its rows' keys);
    unknown values, --quick with --full, --tokens or --passes, and --wgrad-variants with another pass are usage
    errors."""
    import argparse
    from benchmarks.grouped import FULL, main, suite_of
    parser = argparse.ArgumentParser()
    every = dict(tokens="", passes="", models="", routings="")
    assert suite_of(argparse.Namespace(**every), parser) is FULL
    part = suite_of(argparse.Namespace(**{**every, "tokens": "16384,64", "passes": "forward"}), parser)
    assert part == [c for c in FULL if c.tokens in (64, 16384) and c.gemm_pass == "forward"] and len(part) == 72
    weak = suite_of(argparse.Namespace(tokens="64,512", passes="wgrad", models="DSv3,Qwen3", routings="uniform,zipf"),
                    parser)
    assert weak == [c for c in FULL if c.tokens in (64, 512) and c.gemm_pass == "wgrad" and c.experts in (128, 256)
                    and c.routing in ("uniform", "zipf")] and len(weak) == 16
    for argv in (["--tokens", "100"], ["--passes", "backward"], ["--tokens", "x"], ["--quick", "--full"],
                 ["--quick", "--tokens", "64"], ["--models", "Llama"], ["--routings", "hot,flat"],
                 ["--wgrad-variants", "--passes", "forward"]):
        with pytest.raises(SystemExit):
            main(argv)


def test_benchmark_rows_on_cpu(monkeypatch):
    """benchmarks.grouped's row loop on a tiny suite on the CPU (torch._grouped_mm standing in for nvfly and for
    Inductor's compile, fixed times): every row carries issue #29's keys and nvfly/torch times, Inductor's on the
    contiguous forward rows, compiled once a shape (on its first routing) within --triton-cases and --budget-s, and
    rows it leaves out say why, a failed compile too; the summary per pass and layout; checkpoints every 25 rows."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    import argparse
    from benchmarks import grouped as bench
    monkeypatch.setattr(bench, "MODELS", [("tiny", 8, 2, [(48, 32), (32, 48)])])
    cases = bench.full_cases((16,))
    assert len(cases) == 15 + 12
    real_setup = bench.setup

    def cpu_setup(case):
        s = real_setup(case, "cpu")
        s.impls["nvfly"] = s.impls["torch"]
        return s
    compiles = []
    failing = []

    def fake_compile():
        compiles.append(1)
        if failing:
            raise RuntimeError("no valid choice")
        return lambda a, b, offs: torch._grouped_mm(a, b, offs)

    def fake_times(row, impls, flop, nbytes):
        for name in impls:
            row[f"{name}_ms"] = {"nvfly": 1.0, "torch": 1.5, "triton": 2.0}[name]
            row[f"{name}_tflops"] = flop / row[f"{name}_ms"] / 1e9
            row[f"{name}_tbps"] = nbytes / row[f"{name}_ms"] / 1e9
    monkeypatch.setattr(bench, "setup", cpu_setup)
    monkeypatch.setattr(bench, "inductor_grouped_mm", fake_compile)
    monkeypatch.setattr(bench, "time_impls", fake_times)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    saved = []

    def run(**flags):
        compiles.clear()
        args = argparse.Namespace(**{"quick": False, "no_triton": False, "triton_cases": None, "budget_s": 0.0,
                                     **flags})
        return bench.grouped_rows(cases, args, start=0.0, checkpoint=lambda rows: saved.append(len(rows)))
    rows, summary = run()
    assert len(rows) == len(cases) and len(compiles) == 2 and saved == [25]
    for row in rows:
        assert set(ISSUE_KEYS) <= set(row) and row["nvfly_rel_err"] < 1e-2 and row["vs_torch"] == 1.5
        assert row["tokens"] == row["rows"] // 2 and row["nvfly_ms"] and row["torch_ms"]
        plain = row["pass"] == "forward" and row["layout"] == "contiguous"
        assert ("triton_ms" in row) == plain and ("triton_compile_s" in row) == (plain and row["routing"] == "uniform")
    assert summary["rows"] == len(rows) and summary["triton_rows"] == 6 and summary["triton_compiles"] == 2
    assert summary["geomean_vs_triton"] == pytest.approx(2.0) and summary["min_vs_torch"] == pytest.approx(1.5)
    assert set(summary["by_pass"]) == {"forward contiguous", "forward masked", "gate_up contiguous",
                                       "dgrad contiguous", "wgrad contiguous"}
    rows, summary = run(triton_cases=1)
    assert len(compiles) == 1 and summary["triton_rows"] == 3
    assert {r["triton_left_out"] for r in rows if "triton_left_out" in r} == {"--triton-cases 1"}
    rows, summary = run(budget_s=1e-6)
    assert not compiles and summary["triton_left_out"] == 6 and summary["triton_rows"] == 0
    failing.append(True)
    rows, summary = run()
    assert len(compiles) == 2 and summary["triton_errors"] == 2 and summary["triton_rows"] == 0
    assert len(rows) == len(cases) and [r.get("triton_error") for r in rows if r["pass"] == "forward" and
                                        r["layout"] == "contiguous"] == ["RuntimeError: no valid choice"] * 6
    rows, summary = run(no_triton=True)
    assert not compiles and not any("triton_ms" in r or "triton_left_out" in r for r in rows)


def test_benchmark_main_writes(monkeypatch, tmp_path):
    """benchmarks.grouped --full: the suite's rows (here two fake ones) and summary in <name>_h200.json, the
    fraction-of-floor plot with Inductor's series in <name>_h200.png."""
    import json
    from benchmarks import grouped as bench
    seen = {}

    def fake_rows(cases, args, start, checkpoint=None):
        seen["cases"] = cases
        rows = [{**case.row_keys(), "nvfly_of_floor": 0.9, "torch_of_floor": 0.8, **({"triton_of_floor": 0.85}
                                                                                   if i == 0 else {})}
                for i, case in enumerate(cases[:2])]
        checkpoint(rows)
        return rows, {"rows": 2}
    monkeypatch.setattr(bench, "grouped_rows", fake_rows)
    monkeypatch.setenv("NVFLY_RESULTS_DIR", str(tmp_path))
    assert bench.main(["--full", "--tokens", "64", "--passes", "wgrad", "--name", "grouped_try"]) == 0
    assert len(seen["cases"]) == 18 and {c.gemm_pass for c in seen["cases"]} == {"wgrad"}
    doc = json.loads((tmp_path / "grouped_try_h200.json").read_text())
    assert doc["meta"]["summary"]["rows"] == 2 and doc["rows"][0]["pass"] == "wgrad"
    assert (tmp_path / "grouped_try_h200.png").stat().st_size > 0


def test_benchmark_wgrad_variants_pick_the_suite(monkeypatch, tmp_path):
    """--wgrad-variants: WGRAD_CASES by default, with --tokens/--models/--routings the full suite's weight-gradient
    rows (their keys unchanged); the summary per variant leaves out a variant's untimed rows."""
    import json
    from benchmarks import grouped as bench
    seen = []

    def fake_variants(cases):
        seen.append(list(cases))
        return [{**c.row_keys(), "variants": {"a": "", "b": ""}, "torch_tbps": 1.0, "a_tbps": 2.0, "a_vs_torch": 2.0,
                 **({"b_vs_torch": 0.5, "b_tbps": 0.5} if i else {})} for i, c in enumerate(cases[:2])]
    monkeypatch.setattr(bench, "wgrad_variants", fake_variants)
    monkeypatch.setenv("NVFLY_RESULTS_DIR", str(tmp_path))
    assert bench.main(["--wgrad-variants", "--name", "wgrad_try"]) == 0
    assert seen[-1] == bench.WGRAD_CASES
    assert bench.main(["--wgrad-variants", "--tokens", "64,512", "--models", "DSv3,Qwen3", "--routings",
                       "uniform,zipf", "--name", "wgrad_try"]) == 0
    assert len(seen[-1]) == 16 and all(c in bench.FULL and c.gemm_pass == "wgrad" for c in seen[-1])
    summary = json.loads((tmp_path / "wgrad_try_h200.json").read_text())["meta"]["summary"]
    assert summary["geomean_a_vs_torch"] == 2.0 and summary["min_b_vs_torch"] == 0.5 and summary["untimed_b"] == 1


@pytest.mark.parametrize("slices,ring", [(1, 2), (2, 4), (4, 8), (2, 6), (4, 4 * 3)])
def test_staging_ring_never_overwrites_a_pending_store(slices, ring):
    """The store_tiles ring's slots (``staging_ring_slot``) and waits (``wait_group.read ring - 1`` before each
    slice): with stores that complete only when waited for, a slice's buffer is never one a pending store still
    reads, and every buffer is used."""
    from nvfly.ops.common.epilogue import staging_ring_slot
    pending, used = [], set()  # the buffers of the committed, unread store groups, oldest first
    for staged in range(7):
        for s in range(slices):
            del pending[:max(0, len(pending) - (ring - 1))]  # wait_group.read ring - 1
            slot = staging_ring_slot(staged, s, slices, ring)
            assert slot not in pending, (staged, s, slot, pending)
            pending.append(slot)
            used.add(slot)
    assert used == set(range(ring))


def test_benchmark_wgrad_variant_rows_on_cpu(monkeypatch):
    """--wgrad-variants' rows on the CPU (torch._grouped_mm standing in for each variant, fixed times): every
    variant's error against the reference, one that is off is not timed, the others' TB/s and ratio to torch."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    from benchmarks import grouped as bench
    from nvfly.ops.grouped.plan import kgrouped_variants

    def fake_grouped_mm(a, b, offs, out, config):
        out.copy_(torch._grouped_mm(a, b, offs))
        if config == kgrouped_variants(4)["pingpong-register"]:
            out.add_(1.0)  # off the reference
        return out
    monkeypatch.setattr(bench.grouped, "grouped_mm", fake_grouped_mm)
    monkeypatch.setattr(bench, "interleaved_ms", lambda fns, rounds: {name: [2.0, 1.0, 3.0] if name == "torch"
                                                                      else [1.0] * rounds for name in fns})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    case = bench.Case("tiny wgrad", "wgrad", 4, 48, 32, 64, top_k=2)
    (row,) = bench.wgrad_variants([case], "cpu")
    names = list(kgrouped_variants(4))
    assert list(row["variants"]) == names and row["case"] == "tiny wgrad" and row["torch_ms"] == 2.0
    assert row["pingpong-register_rel_err"] > 0.1 and "pingpong-register_ms" not in row
    for name in names:
        if name != "pingpong-register":
            assert row[f"{name}_rel_err"] < 1e-2 and row[f"{name}_vs_torch"] == 2.0 and row[f"{name}_tbps"] > 0
