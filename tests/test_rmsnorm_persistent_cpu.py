"""RMSNorm forward plans without a GPU: when forward_plan picks the persistent kernel, and that it, the row
kernel with the weight loaded early and the cache-hinted variants compile for sm_90a without spills, with the
loads where the design puts them (SASS order) and the grid the plan promises."""
import re

import pytest
import torch

import nvfly
from benchmarks import rmsnorm as bench
from nvfly.ops import rmsnorm
from nvfly.ops.rmsnorm import api as rmsnorm_api, plan as rmsnorm_plan
from nvfly.runtime.torch_args import vector_width

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SMS = 132


def compiled(fn, *args, **kwargs):
    with nvfly.compile_only() as kernels:
        fn(*args, **kwargs)
    (k,) = kernels
    return k


def assert_clean(k):
    assert k.cubin is not None and ".target sm_90a" in k.ptx
    assert k.resources.spill_stores == 0 and k.resources.spill_loads == 0, k.summary()
    assert k.resources.stack_bytes == 0 and k.count("LDL") == 0 and k.count("STL") == 0, k.summary()


def instructions(k):
    """The SASS as (address, instruction text) pairs."""
    return [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", k.sass())]


def loop_body(k):
    """The instructions of the kernel's one loop: from the target of its backward branch to that branch."""
    ins = instructions(k)
    back = [(int(m.group(1), 16), addr) for addr, text in ins
            if (m := re.search(r"\bBRA(?:\.U)? 0x([0-9a-f]+)", text)) and int(m.group(1), 16) < addr]
    assert len(back) == 1, back
    (start, end), = back
    return [text for addr, text in ins if start <= addr <= end]


def loads_before_first_store(texts):
    first_store = next(i for i, t in enumerate(texts) if re.search(r"\bSTG\b|\bSTG\.", t))
    return sum(1 for t in texts[:first_store] if re.search(r"\bLDG\.", t))


def tensors(m, n, dtype, variant):
    x = torch.empty(m, n, dtype=dtype)  # compiled for, never read
    w = torch.empty(n, dtype=dtype) if variant != "plain" else None
    r = torch.empty(m, n, dtype=dtype) if variant == "residual" else None
    return x, w, r


# ---------------------------------------------------------------------------------------------- the plan model
def test_forward_plan_takes_the_row_kernel_and_the_persistent_one_on_request():
    p = rmsnorm_plan.forward_plan(2048, 8, 16384, SMS)
    # rows of at most 8 KB: 2 vectors a thread (128 threads a row), else 8 (the row kernel) below SMS rows
    assert not p.persistent and (p.group, p.early_weight) == (128, True)
    assert rmsnorm_plan.forward_plan(4096, 8, 16384, SMS).group == 256
    assert rmsnorm_plan.forward_plan(8192, 8, 64, SMS).group == 128
    assert rmsnorm_plan.forward_plan(2048, 4, 16384, SMS).group == 256  # fp32: 8 KB rows
    assert rmsnorm_plan.forward_plan(4096, 4, 64, SMS).group == 128  # 16 KB: 8 vectors a thread
    # rows of 12 KB or more, 1024 rows or more (past the persistent kernel's rows): the two-pass kernel with
    # Inductor's hints (not with options that ask for another plan)
    for n, vec, m, threads in [(8192, 8, 16384, 512), (7168, 8, 4096, 512), (4096, 4, 16384, 512),
                               (16384, 8, 4096, 1024), (32768, 8, 1024, 1024)]:
        p = rmsnorm_plan.forward_plan(n, vec, m, SMS)
        assert p.two_pass and p.cache_hints == rmsnorm.LOAD_HINTS and p.threads == threads, (n, vec, m)
    assert not rmsnorm_plan.forward_plan(4096, 8, 16384, SMS).two_pass
    assert rmsnorm_plan.forward_plan(7168, 8, 1024, SMS, has_residual=True).two_pass  # with the residual, as before
    for other in [rmsnorm.ForwardOptions(target_vectors=8), rmsnorm.ForwardOptions(cache_hints=True)]:
        assert not rmsnorm_plan.forward_plan(8192, 8, 16384, SMS, options=other).two_pass
    assert rmsnorm_plan.forward_plan(65536, 8, 64, SMS).cache_hints == rmsnorm.LOAD_HINTS  # too long for registers
    four = rmsnorm.ForwardOptions(target_vectors=4)
    assert rmsnorm_plan.forward_plan(2048, 8, 16384, SMS, options=four).group == 64
    forced = rmsnorm.ForwardOptions(persistent=True)
    p = rmsnorm_plan.forward_plan(2048, 8, 16384, SMS, options=forced)
    # 4 vectors a thread (two tiles and the weight in registers), 2 rows of 64 threads, 5 blocks an SM (96 registers)
    assert p.persistent and (p.group, p.rows, p.threads, p.blocks_per_sm) == (64, 2, 128, 5)
    assert rmsnorm_plan.forward_plan(2048, 8, 16384, SMS, has_residual=True, options=forced).blocks_per_sm == 4
    assert rmsnorm_plan.forward_plan(8192, 8, 16384, SMS, options=forced).threads == 256
    assert rmsnorm_plan.forward_plan(16384, 8, 16384, SMS, options=forced).threads == 512
    # rows too long for two tiles in registers: declined; rows too long for registers take the two-pass kernel
    assert rmsnorm_plan.forward_plan(65536, 8, 65536, SMS).two_pass
    with pytest.raises(ValueError, match="persistent"):
        rmsnorm_plan.forward_plan(32768, 8, 65536, SMS, options=forced)
    few = rmsnorm_plan.forward_plan(2048, 8, 256, SMS, options=forced)
    assert few.persistent and (few.threads, few.blocks_per_sm) == (64, 10)  # few rows: a row a tile


def test_forward_plan_of_long_rows_by_their_count():
    """Rows over 8 KB (no residual), SMS to PERSISTENT_MAX_ROWS of them: under two an SM (rows up to 16 KB) the
    row kernel at 2 vectors a thread; else the persistent kernel where its blocks take 1.75 tiles or more each
    (the two-pass kernel where they would not); fewer rows, more rows and the residual keep the plans before."""
    few = rmsnorm_plan.forward_plan(7168, 8, SMS, SMS)
    assert not few.persistent and not few.two_pass and few.group == 512 and few.early_weight
    assert rmsnorm_plan.forward_plan(4096, 4, 256, SMS).group == 512  # fp32, 16 KB rows
    assert rmsnorm_plan.forward_plan(7168, 8, SMS - 1, SMS).group == 128  # fewer rows than SMs: 8 vectors a thread
    for n, m, threads, blocks_per_sm in [(7168, 462, 256, 2), (8192, 2048, 256, 2), (5120, 1024, 256, 2),
                                         (16384, 231, 512, 1), (16384, 384, 512, 1), (7168, 600, 256, 2)]:
        p = rmsnorm_plan.forward_plan(n, 8, m, SMS)
        assert p.persistent and (p.threads, p.rows, p.blocks_per_sm) == (threads, 1, blocks_per_sm), (n, m)
    # under 1.75 x 264 tiles: the two-pass kernel; under 1.75 x 132 tiles of 32 KB rows: the row kernel
    for n, m in [(7168, 461), (8192, 300), (7168, SMS * 2)]:
        p = rmsnorm_plan.forward_plan(n, 8, m, SMS)
        assert p.two_pass and p.cache_hints == rmsnorm.LOAD_HINTS and p.threads == 512, (n, m)
    for m in (SMS, 230):
        p = rmsnorm_plan.forward_plan(16384, 8, m, SMS)
        assert not p.two_pass and not p.persistent and (p.group, p.rows) == (256, 1)
    assert rmsnorm_plan.forward_plan(7168, 8, rmsnorm_plan.PERSISTENT_MAX_ROWS + 1, SMS).two_pass
    assert not rmsnorm_plan.forward_plan(7168, 8, 512, SMS, has_residual=True).persistent
    assert not rmsnorm_plan.forward_plan(4096, 8, 512, SMS).persistent  # 8 KB rows: the row kernel
    assert not rmsnorm_plan.forward_plan(7001, 1, 512, SMS, 32).persistent  # odd lengths: element accesses
    for other in [rmsnorm.ForwardOptions(target_vectors=8), rmsnorm.ForwardOptions(cache_hints=rmsnorm.LOAD_HINTS)]:
        p = rmsnorm_plan.forward_plan(7168, 8, 512, SMS, options=other)
        assert not p.persistent and not p.two_pass and p.group == 128


def test_row_kernel_loads_the_weight_early_where_registers_allow():
    options = rmsnorm.ForwardOptions()
    assert rmsnorm_plan.forward_plan(8192, 8, 256, SMS, options=options).early_weight
    # x, the residual and the weight at 8 vectors a thread spill: the weight stays after the reduction
    assert not rmsnorm_plan.forward_plan(8192, 8, 256, SMS, has_residual=True, options=options).early_weight
    four = rmsnorm.ForwardOptions(target_vectors=4)
    assert rmsnorm_plan.forward_plan(8192, 8, 16384, SMS, has_residual=True, options=four).early_weight
    before = rmsnorm.ForwardOptions(early_weight=False)
    assert not rmsnorm_plan.forward_plan(8192, 8, 256, SMS, options=before).early_weight


def test_forward_options_are_checked():
    for bad in [dict(block_threads=48), dict(block_threads=128.0), dict(block_threads=1024), dict(target_vectors=0),
                dict(target_vectors=9), dict(persistent=1), dict(persistent=None), dict(early_weight=None), dict(cache_hints="yes"),
                dict(two_pass=1), dict(two_pass_threads=64), dict(two_pass_threads=400), dict(two_pass_threads=2048),
                dict(two_pass_threads=256.0), dict(two_pass_vectors=0), dict(two_pass_vectors=9)]:
        with pytest.raises(ValueError, match=f"options.{next(iter(bad))}"):
            rmsnorm.ForwardOptions(**bad)
    with pytest.raises(ValueError, match="at most one of persistent, two_pass and bulk"):
        rmsnorm.ForwardOptions(persistent=True, two_pass=True)
    assert rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=448).two_pass_threads == 448  # 14 warps


def test_persistent_grid_is_the_resident_blocks_or_the_tiles(recorded_launches):
    rmsnorm_api._FORWARD.clear()  # plans cached by other tests hold launchers that would not record
    w = torch.randn(2048).to(torch.bfloat16)
    forced = rmsnorm.ForwardOptions(persistent=True)
    rmsnorm.rms_norm_forward(torch.randn(16384, 2048).to(torch.bfloat16), w, options=forced)
    rmsnorm.rms_norm_forward(torch.randn(1001, 2048).to(torch.bfloat16), w, options=forced)  # 501 tiles of 2 rows
    (name, grid, _), (name2, grid2, _) = recorded_launches
    assert name == name2 == "rms_norm_persistent_kernel"
    assert grid == (5 * SMS, 1, 1) and grid2 == (501, 1, 1)
    rmsnorm_api._FORWARD.clear()


# ---------------------------------------------------------------------------------------------- the kernels compile
@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2048, 4096, 7168, 8192, 16384, 1001])
@pytest.mark.parametrize("variant", ["plain", "weight", "residual"])
def test_persistent_kernel_compiles_clean_and_prefetches_the_next_tile(dtype, n, variant):
    """No spills at the plan's blocks per SM, which the registers must allow together; 16-byte accesses (element
    ones for the odd row length); one barrier a tile where a row spans warps; and the next tile's loads issued in
    the loop before this tile's first store (the software pipeline)."""
    m = 16384
    x, w, r = tensors(m, n, dtype, variant)
    forced = rmsnorm.ForwardOptions(persistent=True)
    vec = vector_width(n, (x, w, r), x.element_size())
    if -(-n // (vec * rmsnorm_plan.MAX_GROUP)) > rmsnorm_plan.PERSISTENT_VECTORS_PER_THREAD:  # fp32 rows of 16384
        with pytest.raises(ValueError, match="do not fit the persistent kernel"):
            rmsnorm.rms_norm_forward(x, w, 1e-6, r, options=forced)
        return
    k = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r, options=forced)
    p = rmsnorm.plan_of(x, w, r, options=forced)
    assert k.name == "rms_norm_persistent_kernel" and p.persistent
    assert_clean(k)
    assert k.block == (p.threads, 1, 1)
    assert rmsnorm_plan.resident_warps(k.resources.registers, p.threads) >= p.blocks_per_sm * p.threads // 32
    vectors = -(-n // (p.group * p.vec))
    streams = 1 + (variant == "residual")  # x and the residual, loaded before the loop and in it
    loads = vectors * (2 * streams + (variant != "plain"))
    wide = p.vec * x.element_size() == 16
    assert k.count("LDG.E.128") == (loads if wide else 0)
    assert k.count("STG.E.128") == (vectors * streams if wide else 0)
    assert k.count("BAR.SYNC") == (p.group > 32)
    assert k.count("MUFU.RSQ") == 1
    assert loads_before_first_store(loop_body(k)) == vectors * streams


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("n", [2048, 8192])
@pytest.mark.parametrize("variant", ["weight", "residual"])
@pytest.mark.parametrize("persistent", [True, False])
def test_cache_hints_mark_every_access(n, variant, persistent):
    """x, the residual and both outputs stream past L1 (LDG/STG .NA), the weight is kept (LDG .EL); the L2
    policies go in the access descriptors, not extra instructions."""
    x, w, r = tensors(16384 if persistent else 64, n, torch.bfloat16, variant)  # 64 rows: the row kernel
    hinted = rmsnorm.ForwardOptions(persistent=persistent, cache_hints=True)
    k = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r, options=hinted)
    plain = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r, options=rmsnorm.ForwardOptions(persistent=persistent))
    assert_clean(k)
    p = rmsnorm.plan_of(x, w, r, options=hinted)
    vectors = -(-n // (p.group * p.vec))
    streams = 1 + (variant == "residual")
    assert k.count("LDG.E.EL.128") == vectors
    assert k.count("LDG.E.NA.128") == vectors * streams * (2 if persistent else 1)
    assert k.count("STG.E.NA.128") == vectors * streams
    assert k.count("LDG.E.128") == k.count("STG.E.128") == 0
    assert k.count("LDG") == plain.count("LDG") and k.count("STG") == plain.count("STG")


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2048, 7168, 8192])
def test_row_kernel_issues_the_weight_loads_before_any_store(dtype, n):
    """The SASS finding behind EARLY_WEIGHT: loaded after the reduction, the weight's loads sit between the
    stores (each waits for the store before it); loaded early, every load precedes the first store."""
    x, w, _ = tensors(64, n, dtype, "weight")  # fewer rows than SMs: the row kernel whatever the row length
    early = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, options=rmsnorm.ForwardOptions())
    late = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6,
                    options=rmsnorm.ForwardOptions(early_weight=False))
    for k in (early, late):
        assert k.name == "rms_norm_kernel"
        assert_clean(k)
    texts = [t for _, t in instructions(early)]
    assert loads_before_first_store(texts) == early.count("LDG") == late.count("LDG")
    late_texts = [t for _, t in instructions(late)]
    assert loads_before_first_store(late_texts) <= late.count("LDG") // 2 + 1


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("n", [2048, 4096, 7168, 8192, 16384])
@pytest.mark.parametrize("fused_add", [False, True])
def test_compare_plans_variants_compile_clean(n, fused_add, config_sample):
    """Every plan ``benchmarks/rmsnorm.py --compare-plans`` times at its 16384 rows compiles without spills (the
    bulk variants that do not apply, declined: 128 threads for rows over 4096)."""
    x, w, r = tensors(16384, n, torch.bfloat16, "residual" if fused_add else "weight")
    chosen = config_sample(bench.PLAN_VARIANTS.values())  # every variant under --run-slow
    for name, options in bench.PLAN_VARIANTS.items():
        if options not in chosen:
            continue
        try:
            p = rmsnorm.plan_of(x, w, r, options=options)
        except ValueError:
            assert name == "bulk 128x4" and n > 4096
            continue
        k = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r, want_rstd=False, options=options)
        assert_clean(k)
        kernel = "rms_norm_two_pass_kernel" if p.two_pass else "rms_norm_persistent_kernel" if p.persistent else \
            "rms_norm_bulk_kernel" if p.bulk else "rms_norm_kernel"
        assert k.name == kernel and k.block == (p.threads, 1, 1), name


# ---------------------------------------------------------------------------------------------- the two-pass kernel
def test_two_pass_plan_covers_the_row_in_one_step_or_takes_the_options():
    two_pass = rmsnorm.ForwardOptions(two_pass=True)
    p = rmsnorm_plan.forward_plan(8192, 8, 16384, SMS, options=two_pass)
    # the fewest threads that take the row in one step of 2 vectors: 512 for bf16 rows of 8192 (as Inductor's block)
    assert p.two_pass and not p.persistent and (p.threads, p.rows, p.vectors) == (512, 1, 2)
    assert rmsnorm_plan.forward_plan(7168, 8, 16384, SMS, options=two_pass).threads == 512
    assert rmsnorm_plan.forward_plan(16384, 8, 16384, SMS, options=two_pass).threads == 1024
    assert rmsnorm_plan.forward_plan(2048, 8, 16384, SMS, options=two_pass).threads == 128
    assert rmsnorm_plan.forward_plan(8192, 4, 16384, SMS, options=two_pass).threads == 1024  # fp32
    # rows too long for registers take it without the option, in several steps of 1024 threads
    long_rows = rmsnorm_plan.forward_plan(300_000, 8, 64, SMS)
    assert long_rows.two_pass and (long_rows.threads, long_rows.vectors) == (1024, 2)
    # narrow accesses (odd lengths): as many more a step as the row kernel's budget allows them
    assert rmsnorm_plan.forward_plan(1001, 1, 64, SMS, 32, options=two_pass).vectors == 8
    assert rmsnorm_plan.forward_plan(1002, 2, 64, SMS, 16, options=two_pass).vectors == 4
    chosen = rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=256, two_pass_vectors=4, cache_hints=True)
    p = rmsnorm_plan.forward_plan(8192, 8, 16384, SMS, has_residual=True, options=chosen)
    assert (p.threads, p.vectors, p.cache_hints) == (256, 4, True)


def two_pass_budget(p, variant, dtype, n):
    """The registers the kernel targets: a full SM (32) where its estimate fits, else at least 32 warps (64)."""
    streams = (1 + (variant == "residual"), 1 + (variant != "plain") + (variant == "residual"))
    estimate = rmsnorm_plan.two_pass_registers(*streams, p.vectors, p.vec, torch.empty((), dtype=dtype).element_size(),
                                          -(-n // (p.threads * p.vectors * p.vec)))
    return rmsnorm_plan.FULL_SM_REGISTERS if estimate <= rmsnorm_plan.FULL_SM_REGISTERS else 64


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2048, 7168, 8192, 16384, 1001, 4097, 300_000])
@pytest.mark.parametrize("variant", ["plain", "weight", "residual"])
@pytest.mark.parametrize("want_rstd", [True, False])
def test_two_pass_kernel_compiles_clean_within_its_register_budget(dtype, n, variant, want_rstd):
    """No local memory and the registers of its budget; 16-byte accesses (element ones for odd lengths); one
    barrier (the block reduction) and one rsqrt; a row of one step issues every load before its first store."""
    x, w, r = tensors(16384 if n < 300_000 else 64, n, dtype, variant)
    options = rmsnorm.ForwardOptions(two_pass=True)
    k = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r, want_rstd=want_rstd, options=options)
    p = rmsnorm.plan_of(x, w, r, options=options)
    assert k.name == "rms_norm_two_pass_kernel" and k.block == (p.threads, 1, 1)
    assert_clean(k)
    assert k.resources.registers <= two_pass_budget(p, variant, dtype, n), k.summary()
    wide = p.vec * x.element_size() == 16
    assert (k.count("LDG.E.128") == k.count("LDG")) if wide else k.count("LDG.E.128") == 0
    assert k.count("BAR.SYNC") == 1 and k.count("MUFU.RSQ") == 1
    streams_in = 1 + (variant != "plain") + 2 * (variant == "residual")  # x twice, weight, residual twice
    vectors = -(-n // (p.threads * p.vec))  # a thread's vectors of the row
    if vectors <= p.vectors:  # one step: no loop
        texts = [t for _, t in instructions(k)]
        assert k.count("LDG") == vectors * (streams_in + 1) == loads_before_first_store(texts)


@pytest.mark.parametrize("threads", [448, 160])
def test_two_pass_blocks_of_any_warp_count(threads):
    """Blocks of 14 and 5 warps: the block sum reads the warps' partial sums over the next power of two of lanes
    (the lanes past the last warp add zero), one barrier. 448 threads (a 7168-element bf16 row in one step)
    keep the registers of 4 blocks: 56 warps an SM."""
    x, w, r = tensors(4096, 7168, torch.bfloat16, "weight")
    k = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r, want_rstd=False, options=rmsnorm.ForwardOptions(
        two_pass=True, two_pass_threads=threads, cache_hints=rmsnorm.LOAD_HINTS))
    assert_clean(k)
    assert k.block == (threads, 1, 1) and k.count("BAR.SYNC") == 1
    if threads == 448:
        assert rmsnorm_plan.resident_warps(k.resources.registers, threads) == 56, k.summary()
    assert k.count("SHFL.BFLY") == 5 + (4 if threads == 448 else 3)  # the warp's sum, then 16 (8) lanes


@pytest.mark.parametrize("n", [7168, 8192])
@pytest.mark.parametrize("variant", ["weight", "residual"])
def test_two_pass_kernel_holds_a_full_sm_of_warps(n, variant):
    """The point of the kernel: bf16 rows in Inductor's block (512 threads) and 32 registers, 64 warps an SM (the
    row kernel: 16); with the residual (three streams in the second pass) 48 warps at least."""
    x, w, r = tensors(16384, n, torch.bfloat16, variant)
    k = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r, want_rstd=False,
                 options=rmsnorm.ForwardOptions(two_pass=True))
    assert k.block == (512, 1, 1)
    assert rmsnorm_plan.resident_warps(k.resources.registers, 512) >= (64 if variant == "weight" else 48), k.summary()


@pytest.mark.parametrize("variant", ["weight", "residual"])
def test_two_pass_cache_hints_keep_x_for_the_second_read(variant):
    """First read kept in L1 (LDG .EL, as the weight), second read evicted first (.EF), stores past L1 (.NA)."""
    x, w, r = tensors(16384, 8192, torch.bfloat16, variant)
    k = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r,
                 options=rmsnorm.ForwardOptions(two_pass=True, cache_hints=True))
    assert_clean(k)
    streams = 1 + (variant == "residual")
    assert k.count("LDG.E.EL.128") == 2 * streams + 2  # 2 vectors a thread of x (and the residual), the weight
    assert k.count("LDG.E.EF.128") == 2 * streams
    assert k.count("STG.E.NA.128") == 2 * streams
    assert k.count("LDG.E.128") == k.count("STG.E.128") == 0


def test_two_pass_kernel_strided_rows():
    """Rows 4160 elements apart, starting 16 bytes in (x and the residual): still 16-byte accesses."""
    base = torch.empty(64, 4096 + 64, dtype=torch.bfloat16)
    x, r = base[:, 8:4096 + 8], base[:, 16:4096 + 16]
    w = torch.empty(4096, dtype=torch.bfloat16)
    options = rmsnorm.ForwardOptions(two_pass=True)
    assert rmsnorm.plan_of(x, w, r, options=options).vec == 8
    k = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r, options=options)
    assert_clean(k)
    assert k.name == "rms_norm_two_pass_kernel" and k.count("LDG.E.128") == k.count("LDG") > 0


# ---------------------------------------------------------------------------------------------- the bulk-copy kernel
def test_bulk_plan_sizes_block_ring_and_blocks_per_sm():
    """The fewest threads holding the row in 4 vectors, two blocks an SM up to 256 threads (one above), as many
    stages as the shared memory of the SM's blocks holds (up to 8); what cannot be done is declined, named."""
    def bulk(n, itemsize=2, residual=False, **options):
        return rmsnorm_plan.bulk_plan(n, 16 // itemsize, itemsize, residual, rmsnorm.ForwardOptions(bulk=True, **options))

    p = bulk(8192)
    assert (p.threads, p.blocks_per_sm, p.stages, p.bulk) == (256, 2, 6, True)
    assert 2 * (p.stages * 16384 + rmsnorm_plan.BULK_BARRIER_BYTES) <= rmsnorm_plan.BULK_SMEM_PER_SM
    assert (bulk(8192, residual=True).stages, bulk(2048).threads, bulk(2048).stages) == (3, 128, 8)
    assert (bulk(16384).threads, bulk(16384).blocks_per_sm, bulk(16384).stages) == (512, 1, 6)
    assert bulk(8192, bulk_stages=3).stages == 3
    assert (bulk(4096, bulk_threads=128, bulk_blocks_per_sm=4).stages) == 6
    with pytest.raises(ValueError, match="over the kernel's 4 vectors"):
        bulk(8192, bulk_threads=128, bulk_blocks_per_sm=4)
    with pytest.raises(ValueError, match="options.bulk: rows of 1001"):
        rmsnorm_plan.bulk_plan(1001, 1, 2, False, rmsnorm.ForwardOptions(bulk=True))
    with pytest.raises(ValueError, match="options.bulk: rows of 16384 elements on 1024 threads"):
        bulk(16384, itemsize=4)
    with pytest.raises(ValueError, match="128 registers"):
        bulk(8192, bulk_threads=512, bulk_blocks_per_sm=2)
    for bad, field in [(dict(bulk_threads=96), "bulk_threads"), (dict(bulk_stages=1), "bulk_stages"),
                       (dict(bulk_blocks_per_sm=5), "bulk_blocks_per_sm"), (dict(two_pass=True), "at most one")]:
        with pytest.raises(ValueError, match=field):
            rmsnorm.ForwardOptions(bulk=True, **bad)


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2048, 7168, 8192, 16384])
@pytest.mark.parametrize("variant", ["plain", "weight", "residual"])
def test_bulk_kernel_compiles_clean_with_one_copy_a_row(dtype, n, variant):
    """No local memory; rows come in by bulk copies (UBLKCP: the ring's first fill and one refill a row, twice with
    the residual) and are read from shared memory in 16-byte vectors; the weight is the only global load; two
    barriers (the ring's start and the row's reduction); 16-byte stores."""
    x, w, r = tensors(16384, n, dtype, variant)
    options = rmsnorm.ForwardOptions(bulk=True)
    try:
        p = rmsnorm.plan_of(x, w, r, options=options)
    except ValueError:
        assert dtype == torch.float32 and n == 16384
        return
    k = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r, options=options)
    assert k.name == "rms_norm_bulk_kernel" and k.block == (p.threads, 1, 1)
    assert_clean(k)
    copies = 1 + (variant == "residual")
    assert k.count("UBLKCP") >= copies * (p.stages + 1)
    assert k.count("LDS") == k.count("LDS.128") > 0
    assert k.count("LDG") == k.count("LDG.E.128") == (-(-n // (p.vec * p.threads)) if variant != "plain" else 0)
    assert k.count("BAR.SYNC") == 2 and k.count("MUFU.RSQ") == 1
    assert k.count("STG.E.128") >= 1 and k.count("STG") - k.count("STG.E.128") <= 1  # the rstd's
    assert k.resources.registers <= 65536 // (p.threads * p.blocks_per_sm)


def test_suite_times_each_in_turn_and_keeps_the_median_of_the_rounds(monkeypatch):
    """benchmarks/rmsnorm.py's timing: nvfly, torch and Inductor measured round-robin (a drift lands on all three),
    each the median of its rounds, every round's Inductor / nvfly ratio kept, and a row under Inductor reported
    with the rounds' range."""
    import benchmarks.common as common
    readings = {"nvfly": iter([10.0, 30.0, 11.0]), "torch": iter([20.0, 21.0, 22.0]),
                "inductor": iter([9.0, 33.0, 10.0])}
    order = []

    def fake_bench_ms(fn, *timing):  # interleaved_ms passes its warm-up and repetition ms
        order.append(fn())
        return next(readings[order[-1]])
    monkeypatch.setattr(common, "bench_ms", fake_bench_ms)
    row = {"variant": "forward", "M": 4, "N": 8, "dtype": "bfloat16"}
    bench._time(row, lambda: "nvfly", lambda: "torch", lambda: "inductor", 3, graphs=False)
    assert order == ["nvfly", "torch", "inductor"] * 3
    assert (row["nvfly_ms"], row["torch_ms"], row["inductor_ms"]) == (11.0, 21.0, 10.0)
    assert row["vs_inductor_rounds"] == [0.9, 1.1, 10.0 / 11.0]
    row["vs_inductor"] = row["inductor_ms"] / row["nvfly_ms"]
    assert bench._below(row) == {"vs_inductor": 10.0 / 11.0, "rounds": [0.9, 1.1], "graph": None}
