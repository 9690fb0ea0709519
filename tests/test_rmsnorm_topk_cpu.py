"""RMSNorm and TopK without a GPU: every kernel variant compiles for sm_90a with 16-byte accesses and no
spills, the launch plans, eligibility reasons and argument errors, the custom ops' fake implementations and
autograd (on CPU they compute with torch), and routing, which must leave CPU calls untouched."""
import dataclasses
import itertools
import logging
import types

import pytest
import torch
import torch.nn.functional as F

import nvfly
import nvfly.torch.ops  # noqa: F401  (registers the nvfly:: custom ops)
from nvfly.ops import rmsnorm, topk
from nvfly.ops.topk import api as topk_api, plans as topk_plans, row as topk_row
from nvfly.ops.rmsnorm import api as rmsnorm_api, plan as rmsnorm_plan
from nvfly.runtime.torch_args import vector_width
from nvfly.torch.routing import Route, _routed, disable_routing, enable_routing, install_routing, installed, \
    register_route, routing, routing_enabled

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def compiled(fn, *args, **kwargs):
    with nvfly.compile_only() as kernels:
        fn(*args, **kwargs)
    return kernels


def sliced_kernels(x, k, largest=True):
    """The kernels of the slices + merge plan (``row_threshold=False``; the default for some of these shapes is the
    row-threshold plan) for a 2-D x, compiled without a GPU."""
    m, n = x.shape
    p = topk.plan(n, k, m, vector_width(n, (x,), x.element_size()), x.element_size(), 132,
                  row_threshold=False)
    with nvfly.compile_only() as kernels:
        topk_api.runner(p, m, n, k, largest)(x, torch.empty(m, k, dtype=x.dtype), torch.empty(m, k, dtype=torch.int64))
    return kernels


def assert_clean(k):
    assert k.cubin is not None and ".target sm_90a" in k.ptx
    assert k.resources.spill_stores == 0 and k.resources.spill_loads == 0, k.summary()
    assert k.resources.stack_bytes == 0, k.summary()


# ---------------------------------------------------------------------------------------------- RMSNorm compiles
@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2048, 4096, 7168, 8192, 16384, 128])
@pytest.mark.parametrize("variant", ["plain", "weight", "residual"])
def test_rms_norm_forward_compiles_to_16_byte_accesses(dtype, n, variant):
    x = torch.randn(64, n).to(dtype)
    w = torch.randn(n).to(dtype) if variant != "plain" else None
    r = torch.randn(64, n).to(dtype) if variant == "residual" else None
    (k,) = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r)
    assert k.name == "rms_norm_kernel"
    assert_clean(k)
    vec = 16 // x.element_size()
    p = rmsnorm.plan_of(x, w, r)
    assert k.block == (p.group * p.rows, 1, 1)
    vectors = -(-n // (p.group * vec))  # per thread: the row stays in registers between the two phases
    streams_in = 1 + (variant != "plain") + (variant == "residual")  # x, the weight, the residual
    assert k.count("LDG.E.128") == vectors * streams_in
    assert k.count("STG.E.128") == vectors * (2 if variant == "residual" else 1)
    assert k.count("LDG.E") == k.count("LDG.E.128")  # nothing narrower
    assert k.count("MUFU.RSQ") == 1


@pytest.mark.parametrize("n", [1001, 4097, 300_000])
def test_rms_norm_any_row_length(n):
    x = torch.randn(3, n).to(torch.bfloat16)
    (k,) = compiled(rmsnorm.rms_norm_forward, x, torch.randn(n).to(torch.bfloat16))
    assert_clean(k)
    if n == 300_000:  # too long for registers: the two-pass kernel (Inductor's cache hints), still 16-byte accesses
        wide = k.count("LDG.E.EL.128") + k.count("LDG.E.EF.128")
        assert k.name == "rms_norm_two_pass_kernel" and wide == k.count("LDG") > 0
    else:  # odd lengths: rows are not 16-byte aligned, element accesses
        assert k.name == "rms_norm_kernel" and k.count("LDG.E.128") == 0


def test_rms_norm_strided_rows_and_multi_dim_normalized_shape():
    base = torch.randn(8, 3, 4096 + 64).to(torch.bfloat16)
    x = base[..., :4096]  # rows 4160 elements apart
    (k,) = compiled(rmsnorm.rms_norm_forward, x, torch.randn(4096).to(torch.bfloat16))
    assert k.count("LDG.E.128") > 0
    (k2,) = compiled(rmsnorm.rms_norm_forward, torch.randn(4, 16, 128), None, None, None, (16, 128))
    assert_clean(k2)


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2048, 4096, 7168, 16384, 1001, 4097])
def test_rms_norm_backward_compiles(dtype, n):
    x = torch.randn(64, n).to(dtype)
    w = torch.randn(n).to(dtype)
    kernels = compiled(rmsnorm.rms_norm_backward, x, x, torch.rand(64), w, None, x)
    assert [k.name for k in kernels] == ["rms_norm_backward_kernel", "column_sum_kernel"]
    for k in kernels:
        assert_clean(k)
        assert k.count("LDG.E.128") > 0 or n % 8
    assert kernels[0].resources.registers <= 128


def test_rms_norm_plans():
    sms = 132
    p = rmsnorm_plan.row_plan(2048, 8, 65536, sms)
    assert (p.group, p.rows, p.threads) == (32, 4, 128)  # a warp a row, a warp per SM sub-partition
    assert rmsnorm_plan.row_plan(2048, 8, 65536, sms, block_threads=256).rows == 8
    assert rmsnorm_plan.row_plan(2048, 8, 256, sms).rows == 1  # few rows: one per block, so every SM gets work
    assert rmsnorm_plan.row_plan(2048, 8, 256, sms, block_threads=512).rows == 1
    assert rmsnorm_plan.row_plan(128, 8, 65536, sms).threads == 128  # 8 rows a warp
    assert rmsnorm_plan.row_plan(2048, 4, 16384, sms).rows == 2  # fp32: 64 threads a row
    assert rmsnorm_plan.row_plan(7168, 8, 4096, sms).group == 128  # 7 vectors a thread
    assert rmsnorm_plan.row_plan(8192, 8, 16384, sms).rows == 1  # bf16: 128 threads a row
    assert rmsnorm_plan.row_plan(8192, 8, 16384, sms, block_threads=512).rows == 4
    assert rmsnorm_plan.row_plan(8192, 4, 16384, sms).threads == 256  # the row's group fills more than the block
    # the persistent backward keeps blocks of 256 (it launches about two per SM)
    assert rmsnorm_plan.row_plan(2048, 8, 16384, sms, 2, 2, 1024, rmsnorm_plan.BACKWARD_ROW_BLOCK_THREADS).threads == 256
    assert rmsnorm_plan.row_plan(16384, 8, 4096, sms).group == 256
    assert rmsnorm_plan.row_plan(16384, 4, 4096, sms).group == 512  # fp32
    assert rmsnorm_plan.row_plan(32768, 8, 4, sms).group == 512 and rmsnorm_plan.row_plan(65536, 8, 4, sms).looped
    assert rmsnorm.backward_eligibility(torch.randn(2, 16384)) == "x is on cpu, not CUDA"
    assert "too long" in rmsnorm_api._backward_size_reason(32768, 8)


def test_row_block_threads_hold_the_most_warps_whatever_the_registers():
    """Registers are allocated per SM sub-partition, so blocks of one warp per sub-partition (ROW_BLOCK_THREADS)
    let an SM hold as many warps as any block size can at every register count; 256-thread blocks lose 4 warps
    when a sub-partition holds an odd number (the bf16 rows of 2048 of issue 6: 88 registers)."""
    for registers in range(1, 256):
        best = max(rmsnorm_plan.resident_warps(registers, threads) for threads in (32, 64, 128, 256, 512, 1024))
        assert rmsnorm_plan.resident_warps(registers, rmsnorm_plan.ROW_BLOCK_THREADS) == best, registers
    assert [rmsnorm_plan.resident_warps(88, threads) for threads in (64, 128, 256, 512)] == [20, 20, 16, 16]
    assert rmsnorm_plan.resident_warps(32, 128) == 64 and rmsnorm_plan.resident_warps(16, 32) == 32  # warp and block limits
    assert rmsnorm_plan.resident_warps(56, 128) == 36 and rmsnorm_plan.resident_warps(128, 256) == 16


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [2048, 4096, 7168, 8192])
@pytest.mark.parametrize("variant", ["weight", "residual"])
@pytest.mark.parametrize("early_weight", [True, False])
def test_rms_norm_block_plans_compile_clean_and_the_default_holds_the_most_warps(dtype, n, variant, early_weight):
    """At the benchmark's 16384 rows, the row kernel at 8 vectors a thread under the default block and blocks of
    128, 256 and 512 threads (those ``benchmarks/rmsnorm.py --compare-plans`` times) compiles without spills and launches the
    plan's block; with the registers each kernel compiled to, the default's block lets an SM hold the most warps."""
    m = 16384
    x = torch.empty(m, n, dtype=dtype)  # compiled for, never read
    w = torch.empty(n, dtype=dtype)
    r = torch.empty(m, n, dtype=dtype) if variant == "residual" else None
    vec = 16 // x.element_size()
    warps = {}
    for block_threads in (rmsnorm_plan.ROW_BLOCK_THREADS, 128, 256, 512):
        options = rmsnorm.ForwardOptions(block_threads=block_threads, target_vectors=8, early_weight=early_weight)
        (k,) = compiled(rmsnorm.rms_norm_forward, x, w, 1e-6, r, want_rstd=False, options=options)
        assert k.name == "rms_norm_kernel"
        assert_clean(k)
        assert k.count("LDL") == 0 and k.count("STL") == 0, k.summary()
        p = rmsnorm_plan.row_plan(n, vec, m, 132, block_threads=block_threads)
        assert k.block == (p.threads, 1, 1) == (max(p.group, block_threads), 1, 1)
        warps[p.threads] = rmsnorm_plan.resident_warps(k.resources.registers, p.threads)
    assert warps[rmsnorm_plan.row_plan(n, vec, m, 132).threads] == max(warps.values()), warps
    if (dtype, n, variant, early_weight) == (torch.bfloat16, 2048, "weight", False):  # issue 6: 20 warps, not 16
        assert warps[128] > warps[256], warps


def test_rms_norm_backward_keeps_256_thread_blocks():
    x = torch.empty(16384, 2048, dtype=torch.bfloat16)
    kernels = compiled(rmsnorm.rms_norm_backward, x, x, torch.empty(16384), torch.empty(2048, dtype=torch.bfloat16))
    assert kernels[0].name == "rms_norm_backward_kernel" and kernels[0].block == (256, 1, 1)


# ---------------------------------------------------------------------------------------------- TopK compiles
@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(128, 2), (256, 8), (256, 1), (8, 8), (1000, 32), (512, 16)])
def test_topk_warp_kernel_compiles(dtype, n, k):
    x = torch.randn(4096, n).to(dtype)
    (kern,) = compiled(topk.topk, x, k)
    assert kern.name == "topk_warp_kernel"
    assert_clean(kern)
    if n % (16 // x.element_size()) == 0:
        assert kern.count("LDG.E.128") >= 1
    # one warp max per round: one redux.sync of the packed 32-bit ranks, or two of the 64-bit ones (high words,
    # then the low words where the high word is the warp's); one shuffle: the warp index, made uniform
    assert kern.count("REDUX") == (2 * k if dtype == torch.float32 else k) and kern.count("SHFL") <= 1


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,m", [(151936, 50, 256), (128256, 1024, 256), (151936, 2048, 64), (4096, 33, 64),
                                   (32768, 8, 4096)])
def test_topk_streaming_kernel_compiles(dtype, n, k, m):
    x = torch.randn(m, n).to(dtype)
    kernels = sliced_kernels(x, k)
    p = topk.plan(n, k, m, 16 // x.element_size(), x.element_size(), 132, row_threshold=False)
    assert [kern.name for kern in kernels] == ["topk_radix_kernel"] + ["topk_merge_kernel"] * (p.parts > 1)
    for kern in kernels:
        assert_clean(kern)
    kern = kernels[0]
    assert kern.dynamic_smem_bytes == p.smem_bytes <= 227 * 1024
    assert kern.count("LDG.E.128") >= p.unroll
    for feature in ("ATOMS.ADD", "BAR.RED.OR", "VOTE.ANY", "SHFL"):
        assert kern.count(feature) > 0, feature


def test_topk_few_rows_split_then_merge():
    x = torch.randn(1, 151936).to(torch.bfloat16)
    first, merge = sliced_kernels(x, 1024)
    assert (first.name, merge.name) == ("topk_radix_kernel", "topk_merge_kernel")
    for kern in (first, merge):
        assert_clean(kern)
    p = topk.plan(151936, 1024, 1, 8, 2, 132, row_threshold=False)
    assert merge.dynamic_smem_bytes == p.merge_smem_bytes <= 227 * 1024 and p.merge_cap >= p.parts * 1024
    assert merge.count("LDG.E.128") >= topk_plans.SWEEP  # the ranks, two a load, straight into shared memory
    assert "set.gtu" not in merge.ptx and merge.count("ATOMS.ADD") == 0  # no stream: one select, the sort
    assert topk.plan(151936, 1024, 1, 8, 2, 132, row_threshold=False).parts > 1
    assert topk.plan(151936, 1024, 256, 8, 2, 132, row_threshold=False).parts == 1


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,m,largest", [(128256, 50, 1, True), (151936, 1024, 1, False), (151936, 50, 1, False),
                                           (128256, 1024, 64, True), (151936, 2048, 1, True)])
def test_topk_slice_variants_compile(dtype, n, k, m, largest):
    """Every first-pass shape the suite's few-row plans make (256 threads, unroll 1 to 4; 512 for k = 2048), with
    the candidate flags (one packed compare per two 16-bit values, unordered included), and their merges: clean,
    registers for 2 blocks (the merge's 512 threads: one block a row, its shared memory holds every rank)."""
    x = torch.randn(m, n).to(dtype)
    itemsize = x.element_size()
    p = topk.plan(n, k, m, 16 // itemsize, itemsize, 132, row_threshold=False)
    first, merge = sliced_kernels(x, k, largest)
    assert (first.name, merge.name) == ("topk_radix_kernel", "topk_merge_kernel")
    for kern in (first, merge):
        assert_clean(kern)
        assert kern.resources.registers <= 65536 // (topk_plans.BLOCKS_PER_SM * 256)
    assert first.dynamic_smem_bytes == p.smem_bytes and merge.dynamic_smem_bytes == p.merge_smem_bytes
    if p.threads == topk_plans.SLICE_THREADS:
        assert topk_plans.BLOCKS_PER_SM * (p.smem_bytes + 1024) <= topk_plans.SM_SMEM_BYTES
    assert first.count("LDG.E.128") >= p.unroll
    compare = {torch.bfloat16: "u32.bf16x2", torch.float16: "u32.f16x2", torch.float32: "u32.f32"}[dtype]
    assert f"set.{'gtu' if largest else 'ltu'}.{compare}" in first.ptx
    if dtype != torch.float32:
        assert first.count("HSET2") == p.unroll * 4  # one per 16-byte load's word
    assert "set.gtu" not in merge.ptx and "set.ltu" not in merge.ptx  # ranks, loaded as they are


def test_topk_plans_for_the_sampling_suite():
    """The slices + merge plans of the sampling suite, and which of them the row-threshold plan replaces by
    default (k >= ROW_THRESHOLD_MIN_K, ROW_THRESHOLD_MIN_PARTS slices, or 512-thread blocks: all of them), with
    which blocks (``row_threads``): one row of f32 with k = 1024 (16-bit keys: the exact finish, 256) and 64 rows
    (two slices a row, one block an SM, one launch) take 512 threads; 256 rows of one slice take two slices when k = 1024 (the radix kernel when k = 50)."""
    sms = 132
    for n in (128256, 151936):
        for vec, itemsize in ((8, 2), (4, 4)):
            p = topk.plan(n, 50, 1, vec, itemsize, sms, row_threshold=False)
            assert p.parts >= 60 and p.unroll <= 2  # one row: a slice of 2048 elements per block, 60+ SMs
            p = topk.plan(n, 1024, 1, vec, itemsize, sms, row_threshold=False)
            assert 8 <= p.parts and p.parts * 1024 <= topk_plans.MERGE_RANKS  # k = 1024: a merge of 16K ranks at most
            assert all(topk.plan(n, k, 1, vec, itemsize, sms).row_threshold for k in (50, 1024))
            assert topk.plan(n, 50, 1, vec, itemsize, sms).threads == 256
            assert topk.plan(n, 1024, 1, vec, itemsize, sms).threads == (256 if itemsize == 2 else 512)
            for k in (50, 1024):
                p = topk.plan(n, k, 64, vec, itemsize, sms, row_threshold=False)
                assert p.parts == 4 and p.threads == 256  # 256 blocks: two per SM
                p = topk.plan(n, k, 64, vec, itemsize, sms)
                assert p.row_threshold and p.threads == 512 and p.parts == 2 and p.one_launch  # 128 blocks
                p = topk.plan(n, k, 256, vec, itemsize, sms)
                if k == 50:
                    assert not p.row_threshold and p.parts == 1 and p.threads == 256
                    assert p.unroll == 64 // (vec * itemsize)
                else:
                    assert p.row_threshold and p.parts == 2 and p.threads == 256 and not p.one_launch
    assert not topk.plan(4096, 1024, 256, 8, 2, sms).row_threshold  # rows shorter than ROW_SPLIT_MIN_N: one slice
    assert topk.plan(151936, 1024, 16, 8, 2, sms).threads == 256  # 16 slices a row
    assert topk.plan(151936, 2048, 1, 8, 2, sms, row_threshold=False).threads == 512  # 2 blocks of 256 would not fit


def test_topk_compare_plans_variants_compile():
    """``benchmarks.topk --compare-plans``: the plans with fewer slices and the row-threshold plan compile
    clean."""
    from benchmarks import topk as bench
    x = torch.randn(1, 151936).to(torch.bfloat16)
    with nvfly.compile_only() as kernels:
        calls = bench.plan_variants(x, 1024)
        for call in calls.values():
            call()
    p = topk.plan(151936, 1024, 1, 8, 2, 132, row_threshold=False)
    assert list(calls) == ["default", "slices", f"parts<={p.parts // 2}", "parts=1", "row-threshold", "one-launch",
                           "two-level"]
    assert [topk.plan(151936, 1024, 1, 8, 2, 132, cap, False).parts for cap in (p.parts // 2, 1)] == [p.parts // 2, 1]
    assert {kern.name for kern in kernels} == {"topk_radix_kernel", "topk_merge_kernel", "topk_row_histogram_kernel",
                                               "topk_row_select_kernel", "topk_row_one_launch_kernel",
                                               "topk_row_two_level_kernel"}
    for kern in kernels:
        assert_clean(kern)


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,m,largest", [(151936, 50, 1, True), (128256, 1024, 1, False), (151936, 1024, 64, True),
                                           (151936, 2048, 1, True), (30_001, 33, 3, False)])
def test_topk_row_threshold_kernels_compile(dtype, n, k, m, largest):
    """``plan(..., row_threshold=True)``: the histogram and select kernels (with the last block's select, sort
    and whole-row stream) compile clean, without local memory, with registers and shared memory for 2 blocks."""
    x = torch.randn(m, n).to(dtype)
    itemsize = x.element_size()
    vec = vector_width(n, (x,), itemsize)
    p = topk.plan(n, k, m, vec, itemsize, 132, row_threshold=True, one_launch=False)
    assert p.row_threshold and not p.one_launch
    with nvfly.compile_only() as kernels:
        topk_api.runner(p, m, n, k, largest)(x, torch.empty(m, k, dtype=dtype), torch.empty(m, k, dtype=torch.int64))
    assert [kern.name for kern in kernels] == ["topk_row_histogram_kernel", "topk_row_select_kernel"]
    for kern in kernels:
        assert_clean(kern)
        assert kern.count("LDL") == 0 and kern.count("STL") == 0
        assert kern.resources.registers <= 65536 // (topk_plans.BLOCKS_PER_SM * 256)
    histogram, select = kernels
    assert histogram.count("ATOMS") > 0 and histogram.count("REDG") > 0  # shared counts, then global adds
    assert select.dynamic_smem_bytes == p.smem_bytes
    assert select.count("ATOMG") > 0 and select.count("VOTE.ANY") > 0 and select.count("MEMBAR") > 0
    # the last block's counting finish: the list in 16-byte relaxed loads, the crowded-bucket vote
    assert "ld.relaxed.gpu.global.v2.b64" in select.ptx and select.count("BAR.RED.OR") >= 1
    if vec > 1:
        assert histogram.count("LDG.E.128") >= p.unroll and select.count("LDG.E.128") >= 2 * p.unroll


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,m,largest", [(151936, 50, 1, True), (128256, 1024, 1, False), (151936, 2048, 1, True),
                                           (40_000, 1, 1, False)])
def test_topk_row_one_launch_kernel_compiles(dtype, n, k, m, largest):
    """A row whose slices fit one block an SM: one cooperative launch (``topk_row_one_launch_kernel``) whose blocks
    count their slices (shared counts, global adds), wait for the row's other blocks (an acquire spin on the
    arrival counter) and select; clean, no local memory, its shared memory the select's and the counts' side by
    side, within one SM's."""
    x = torch.randn(m, n).to(dtype)
    itemsize = x.element_size()
    vec = vector_width(n, (x,), itemsize)
    p = topk.plan(n, k, m, vec, itemsize, 132)
    assert p.row_threshold and p.one_launch and m * p.parts <= 132
    with nvfly.compile_only() as kernels:
        topk_api.runner(p, m, n, k, largest)(x, torch.empty(m, k, dtype=dtype), torch.empty(m, k, dtype=torch.int64))
    (kern,) = kernels
    assert kern.name == "topk_row_one_launch_kernel" and kern.cooperative
    assert_clean(kern)
    assert kern.count("LDL") == 0 and kern.count("STL") == 0
    assert kern.dynamic_smem_bytes == topk_row.one_launch_smem_bytes(p.cap, p.k_pow2, p.threads) <= \
        topk_plans.SM_SMEM_BYTES
    assert "ld.acquire.gpu.global.b32" in kern.ptx and "ld.relaxed.gpu.global.b32" in kern.ptx  # the wait, the hist
    # a shared finish: every block leaves through a relaxed count, the last to leave cleans up
    assert ("atom.relaxed.gpu.global.add.u32" in kern.ptx) == (p.shared_finish or p.exact_stride > 0)
    assert p.shared_finish == (k >= topk_plans.SHARED_FINISH_MIN_K)
    # the exact finish (16-bit keys): the totals and the block's keys' earlier counts, read after a second wait
    assert (p.exact_stride > 0) == (itemsize == 2)
    waits = 1 + (p.exact_stride > 0) + p.shared_finish  # the row's blocks: counted, (placed,) (appended)
    assert kern.ptx.count("ld.acquire.gpu.global.b32") == waits
    assert kern.count("ATOMS") > 0 and kern.count("REDG") > 0 and kern.count("ATOMG") > 0


def test_topk_one_launch_plan_choice():
    """One launch where the row's slices fit one block an SM (M = 1 sampling rows, M = 64 in two slices of 512
    threads); two where they do not (M = 3, 16), with the two-level select, or when asked; asking for one where it cannot be is an error that says why."""
    sms = 132
    assert topk.plan(151936, 1024, 1, 8, 2, sms).one_launch and topk.plan(128256, 50, 1, 4, 4, sms).one_launch
    assert not topk.plan(151936, 1024, 3, 8, 2, sms).one_launch
    assert not topk.plan(151936, 50, 16, 8, 2, sms).one_launch
    assert topk.plan(151936, 50, 64, 8, 2, sms).one_launch  # two slices of 512 threads a row: 128 blocks
    assert not topk.plan(151936, 1024, 1, 8, 2, sms, row_threshold=True, two_level=True).one_launch
    assert not topk.plan(151936, 1024, 1, 8, 2, sms, one_launch=False).one_launch
    assert not topk.plan(151936, 50, 1, 8, 2, 64).one_launch  # 75 slices on 64 SMs
    with pytest.raises(ValueError, match="one_launch: 3 rows of 75 slices need 225 resident blocks"):
        topk.plan(151936, 1024, 3, 8, 2, sms, one_launch=True)
    # every block of a row writes a share of its k in one launch from k = 256; the row's last block below, and in two
    assert [topk.plan(151936, k, 1, 8, 2, sms).shared_finish for k in (50, 255, 256, 1024, 2048)] == [
        False, False, True, True, True]
    assert topk.plan(128256, 1024, 64, 8, 2, sms).shared_finish
    assert not topk.plan(151936, 1024, 3, 8, 2, sms).shared_finish
    assert not topk.plan(151936, 1024, 1, 8, 2, sms, one_launch=False).shared_finish


@pytest.mark.parametrize("m,n,k", [(64, 1100, 8), (1, 151936, 1024), (1, 128256, 50), (2, 65536, 64),
                                   (3, 1000, 50), (16, 4097, 8), (64, 5000, 64)])
def test_topk_exact_tables_do_not_overlap_any_rows_list(m, n, k):
    """Each row of a one-launch plan picks the list or the exact finish while the launch runs, so one row's
    exact-finish table must not overlap another row's candidate list (64 x 1100 bf16 rows wrote tables into rows
    2 and 3's lists: the GPU tier's intermittent TopK fault); every table lies inside the workspace."""
    p = topk.plan(n, k, m, 4, 2, 132)
    if not p.exact_stride:
        pytest.skip("a plan without the exact finish")
    rows = types.SimpleNamespace(shape=(m, n))
    words = topk_plans.LIST_WORDS
    tables = [(topk_row.exact_table_index(rows, r, 0, 0, p.exact_stride),
               topk_row.exact_table_index(rows, r, topk_plans.EXACT_BINS - 1, p.exact_stride - 1,
                                          p.exact_stride) + 1) for r in range(m)]
    lists = [(r * words, r * words + 2 * p.row_cap) for r in range(m)]
    end = topk_plans.exact_table_rows(m, p.exact_stride) * words
    for lo, hi in tables:
        assert 0 <= lo < hi <= end
        assert all(hi <= a or b <= lo for a, b in lists)
    assert all(b <= c or d <= a for (a, b), (c, d) in itertools.combinations(tables, 2))


def test_topk_exact_finish_plan_choice():
    """The exact finish (``TopkPlan.exact_stride``: parts rounded up to a power of two, at least 4) in one-launch
    plans of 16-bit keys whose slices fit a block's buffer, with blocks of 256 at one row (512 for f32); not for
    f32, two launches, slices of several sweeps (64 rows in two slices), or when asked not to; asking for it where
    it cannot run is an error that says why."""
    sms = 132
    p = topk.plan(128256, 50, 1, 8, 2, sms)
    assert p.one_launch and p.parts == 63 and p.exact_stride == 64 and p.threads == 256
    assert topk.plan(151936, 1024, 1, 8, 2, sms).exact_stride == 128  # 75 slices of 256
    assert topk.plan(151936, 1024, 1, 8, 2, sms).threads == 256
    assert topk.plan(65536, 64, 2, 8, 2, sms).exact_stride == 32
    assert topk.plan(8192, 64, 1, 8, 2, sms, row_threshold=True).exact_stride == 4  # 4 slices
    f32 = topk.plan(151936, 1024, 1, 4, 4, sms)
    assert f32.exact_stride == 0 and f32.threads == 512
    assert topk.plan(151936, 1024, 3, 8, 2, sms).exact_stride == 0  # two launches
    assert topk.plan(151936, 50, 64, 8, 2, sms).exact_stride == 0  # slices of many sweeps
    assert topk.plan(128256, 50, 1, 8, 2, sms, exact=False).exact_stride == 0
    assert topk.plan(128256, 1024, 1, 8, 2, sms, exact=False).threads == 512  # (fp16: the list path's blocks)
    with pytest.raises(ValueError, match="exact: needs a one-launch plan"):
        topk.plan(128256, 50, 1, 4, 4, sms, exact=True)


def test_topk_reversed_select_plan_choice():
    """The two-launch plan's select takes the slices in reverse order once the rows outgrow the L2 (the histogram
    launch's last slices are still cached): 256x128256 bf16 (63 MB) and fp32 from 128 rows, not 128 bf16 rows
    (31 MB), nor one launch or the two-level select; its kernel then maps its blocks from the grid's far end."""
    sms = 132
    big = topk.plan(128256, 1024, 256, 8, 2, sms)
    assert big.row_threshold and not big.one_launch and big.reversed_select
    assert topk.plan(128256, 1024, 128, 4, 4, sms).reversed_select
    assert not topk.plan(128256, 1024, 128, 8, 2, sms).reversed_select
    assert not topk.plan(128256, 1024, 256, 8, 2, sms, row_threshold=True, two_level=True).reversed_select
    assert not topk.plan(151936, 1024, 1, 8, 2, sms).reversed_select
    x = torch.randn(4, 4096).to(torch.bfloat16)
    p = topk.plan(4096, 64, 4, 8, 2, sms, row_threshold=True, one_launch=False)
    ptx = {}
    for reverse in (False, True):
        with nvfly.compile_only() as kernels:
            topk_api.row_runner(dataclasses.replace(p, reversed_select=reverse), 4, 64, True)(
                x, torch.empty(4, 64, dtype=x.dtype), torch.empty(4, 64, dtype=torch.int64))
        ptx[reverse] = kernels[1].ptx
    assert "%nctaid.x" in ptx[True] and "%nctaid.x" not in ptx[False]


def test_topk_histogram_launch_in_one_wave():
    """Where the select's slices would take the histogram launch (three 64 KB blocks an SM) over one wave, it cuts
    the rows into fewer, longer slices of its own: one a row at 256x128256, none of its own at 192 rows or in one
    launch."""
    sms = 132
    p = topk.plan(128256, 1024, 256, 8, 2, sms)
    assert p.parts == 2 and p.hist_parts == 1 and p.hist_slice_len >= 128256 and p.hist_slice_len % (p.threads * 8) == 0
    assert topk.plan(151936, 1024, 256, 4, 4, sms).hist_parts == 1
    assert topk.plan(128256, 1024, 192, 8, 2, sms).hist_parts == 0
    assert topk.plan(128256, 1024, 64, 8, 2, sms).hist_parts == 0  # one launch


@pytest.mark.sweep(pairs=False)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,m,largest", [(151936, 50, 1, True), (128256, 1024, 1, False), (151936, 1024, 64, True),
                                           (151936, 2048, 1, True), (262144, 1024, 3, False), (30_001, 33, 3, False),
                                           (8192, 1, 1, True)])
def test_topk_row_two_level_kernels_compile(dtype, n, k, m, largest):
    """``plan(..., row_threshold=True, two_level=True)``: the histogram kernel and the two-level select (its
    second-level counts and global adds, the last block's relaxed loads, one sweep with two ballot appends, the
    counting and select paths, the sort and the whole-row stream) compile clean, without local memory, with
    registers and shared memory for 2 blocks."""
    x = torch.randn(m, n).to(dtype)
    itemsize = x.element_size()
    vec = vector_width(n, (x,), itemsize)
    p = topk.plan(n, k, m, vec, itemsize, 132, row_threshold=True, two_level=True)
    assert p.row_threshold and p.two_level
    with nvfly.compile_only() as kernels:
        topk_api.runner(p, m, n, k, largest)(x, torch.empty(m, k, dtype=dtype), torch.empty(m, k, dtype=torch.int64))
    assert [kern.name for kern in kernels] == ["topk_row_histogram_kernel", "topk_row_two_level_kernel"]
    for kern in kernels:
        assert_clean(kern)
        assert kern.count("LDL") == 0 and kern.count("STL") == 0, kern.summary()
        assert kern.resources.registers <= 65536 // (topk_plans.BLOCKS_PER_SM * 256)
    select = kernels[1]
    assert select.dynamic_smem_bytes == p.smem_bytes
    assert topk_plans.BLOCKS_PER_SM * (p.smem_bytes + 1024) <= topk_plans.SM_SMEM_BYTES
    assert select.count("ATOMG") > 0 and select.count("VOTE.ANY") > 0 and select.count("MEMBAR") > 0
    assert select.count("REDG") > 0 and "ld.relaxed.gpu.global.b32" in select.ptx  # the second level's adds, loads
    assert "ld.relaxed.gpu.global.v2.b64" in select.ptx  # the list, two ranks a load
    assert select.count("ATOMS") > 0
    if vec > 1:
        assert select.count("LDG.E.128") >= 2 * p.unroll


def test_topk_slice_plan_model():
    """Pure-Python model of the plans: the slices cover every row exactly once, start on vector boundaries,
    the merge stays within MERGE_RANKS, and the candidate buffer holds an iteration's appends on top of k."""
    import itertools
    sms = 132
    for n, k, m, (vec, itemsize) in itertools.product(
            (33, 1000, 1025, 4097, 32768, 100_003, 128256, 151936, 262144), (33, 50, 100, 512, 1024, 2047, 2048),
            (1, 2, 7, 64, 132, 256, 4096), ((8, 2), (4, 2), (1, 2), (4, 4), (2, 4), (1, 4))):
        if k > n:
            continue
        p = topk.plan(n, k, m, vec, itemsize, sms, row_threshold=False)
        assert not p.warp
        per_iter = p.threads * vec * p.unroll
        assert 1 <= p.unroll <= topk_plans.unroll_limit(vec, itemsize)
        assert p.slice_len % (p.threads * vec) == 0 and p.slice_len % vec == 0
        assert (p.parts - 1) * p.slice_len < n <= p.parts * p.slice_len  # every slice non-empty, the row covered
        covered = []
        for part in range(p.parts):
            start, stop = part * p.slice_len, min((part + 1) * p.slice_len, n)
            iterations = -(-(stop - start) // per_iter)
            covered += [c for it in range(iterations) for c in range(start + it * per_iter,
                                                                     start + (it + 1) * per_iter) if c < stop]
        assert covered == list(range(n))
        assert p.parts == 1 or p.parts * k <= topk_plans.MERGE_RANKS
        assert p.parts <= max(1, topk_plans.BLOCKS_PER_SM * sms // m)
        assert p.cap - per_iter >= 2 * p.k_pow2 and p.cap % p.threads == 0  # room for k survivors + an iteration
        assert p.smem_bytes <= 227 * 1024
        assert topk_plans.HIST % p.threads == 0
        if p.parts > 1:  # the merge holds all of a row's ranks (and the sort's k_pow2) in shared memory
            assert p.merge_cap >= max(p.parts * k, p.k_pow2) and p.merge_smem_bytes <= 227 * 1024
            assert p.merge_vec == (2 if p.parts * k % 2 == 0 else 1)


def _order_key_model(bits, width, largest):
    sign = 1 << (width - 1)
    full = (1 << width) - 1
    key = bits ^ (full if bits & sign else sign)
    return key if largest else key ^ full


def test_topk_fast_reject_model():
    """The device's threshold value (``key_value``) and vector reject, modelled in Python over bf16, f16 and f32
    bit patterns: whenever every element of a vector is strictly below the threshold's value as floats (above
    it when smallest), each element's key is strictly below the threshold's key, so it ranks below the threshold
    whatever the indices; NaN and the ABSENT threshold (key 0) reject nothing."""
    import math
    import random
    import struct

    def as_float(bits, fmt):
        if fmt == "f32":
            return struct.unpack("<f", struct.pack("<I", bits))[0]
        if fmt == "bf16":
            return struct.unpack("<f", struct.pack("<I", bits << 16))[0]
        return float(torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16)[0])

    def order_key(bits, fmt, largest):
        width = 32 if fmt == "f32" else 16
        if math.isnan(as_float(bits, fmt)):
            key = (1 << width) - 1
            return key if largest else 0
        return _order_key_model(bits, width, largest)

    def key_value(key, fmt, largest):  # mirrors topk.key_value
        width = 32 if fmt == "f32" else 16
        full = (1 << width) - 1
        if not largest:
            key ^= full
        sign = 1 << (width - 1)
        bits = key ^ sign if key & sign else ~key & full
        return as_float(bits, fmt)

    def rejected(values, threshold, largest):  # mirrors vector_may_take: NaN-propagating extreme, then compare
        extreme = math.nan if any(math.isnan(v) for v in values) else (max(values) if largest else min(values))
        return extreme < threshold if largest else extreme > threshold

    rng = random.Random(0)
    for fmt in ("bf16", "f16", "f32"):
        width = 32 if fmt == "f32" else 16
        special = [0, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7C00, 0xFC00, 0x7E00, 0x0001, 0x8001] if width == 16 \
            else [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 1, 0x80000001]
        patterns = special + [rng.getrandbits(width) for _ in range(400)]
        for largest in (True, False):
            assert math.isnan(key_value(0, fmt, largest))  # ABSENT's key: compares false, rejects nothing
            keys = [order_key(b, fmt, largest) for b in patterns]
            for tkey in keys + [0, 1, (1 << width) - 1]:
                value = key_value(tkey, fmt, largest)
                for _ in range(40):
                    vector = rng.sample(patterns, 4)
                    if rejected([as_float(b, fmt) for b in vector], value, largest):
                        assert all(order_key(b, fmt, largest) < tkey for b in vector), (fmt, largest, tkey, vector)
            for b, key in zip(patterns, keys):  # key_value inverts order_key (up to the NaN payload)
                v, back = as_float(b, fmt), key_value(key, fmt, largest)
                assert (math.isnan(v) and math.isnan(back)) or v == back


@pytest.mark.parametrize("n,k", [(4097, 2048), (100_003, 50), (33, 33)])
def test_topk_odd_lengths_compile(n, k):
    for kern in compiled(topk.topk, torch.randn(2, n).to(torch.float16), k, largest=False):
        assert_clean(kern)


def test_topk_other_dims_and_shapes_on_meta_free_paths():
    x = torch.randn(4, 300, 6)
    kernels = compiled(topk.topk, x, 5, 1)
    assert len(kernels) == 1
    assert compiled(topk.topk, torch.randn(3, 0), 0) == []


# ---------------------------------------------------------------------------------------------- eligibility, errors
def test_eligibility_reasons():
    x = torch.randn(8, 64)
    assert "not CUDA" in rmsnorm.eligibility(x)
    assert "dtype" in rmsnorm.eligibility(x.double())
    assert "weight:" in rmsnorm.eligibility(x, torch.randn(32), None, (64,))
    assert "residual" in rmsnorm.eligibility(x, None, torch.randn(8, 32))
    assert "empty" in rmsnorm.eligibility(torch.randn(0, 64))
    assert "not CUDA" in topk.eligibility(x, 4)
    assert "dtype" in topk.eligibility(x.long(), 4)
    assert "k:" in topk.eligibility(x, 65)
    assert "k:" in topk.eligibility(torch.randn(2, 4096), 4096)  # above 2048
    assert "last dimension" in topk.eligibility(x, 4, 0)
    assert "empty" in topk.eligibility(x, 0)
    assert "not CUDA" in rmsnorm.backward_eligibility(x)


def test_argument_errors_name_the_argument():
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match="x:"):
        rmsnorm.rms_norm([1, 2])
    with pytest.raises(ValueError, match="weight:"):
        rmsnorm.rms_norm(x, torch.randn(8), normalized_shape=(16,))
    with pytest.raises(ValueError, match="normalized_shape:"):
        rmsnorm.rms_norm(x, normalized_shape=(4, 8))
    with pytest.raises(ValueError, match="residual:"):
        rmsnorm.rms_norm(x, residual=torch.randn(4, 8))
    with pytest.raises(ValueError, match="eps:"):
        rmsnorm.rms_norm(x, eps=-1.0)
    for block_threads in (96, 16, 1024, True, 128.0):
        with pytest.raises(ValueError, match="options.block_threads:"):
            rmsnorm.rms_norm_forward(x, options=rmsnorm.ForwardOptions(block_threads=block_threads))
    with pytest.raises(ValueError, match="options:"):
        rmsnorm.rms_norm_forward(x, options="persistent")
    with pytest.raises(ValueError, match="rstd:"):
        rmsnorm.rms_norm_backward(x, x, torch.randn(3))
    with pytest.raises(ValueError, match="grad_out:"):
        rmsnorm.rms_norm_backward(torch.randn(4, 8), x, torch.randn(4))
    with pytest.raises(TypeError, match="x:"):
        topk.topk(x.int(), 2)
    with pytest.raises(ValueError, match="k:"):
        topk.topk(x, 17)
    with pytest.raises(ValueError, match="k:"):
        topk.topk(x, -1)
    with pytest.raises(ValueError, match="dim:"):
        topk.topk(x, 2, dim=2)


# ---------------------------------------------------------------------------------------------- custom ops
def test_custom_op_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(4, 6, 8, dtype=torch.bfloat16)
        w = torch.empty(8, dtype=torch.bfloat16)
        y, rstd = torch.ops.nvfly.rms_norm(x, [8], w, 1e-6)
        assert y.shape == x.shape and y.dtype == x.dtype and rstd.shape == (4, 6, 1) and rstd.dtype == torch.float32
        y, h, rstd = torch.ops.nvfly.fused_add_rms_norm(x, x, [6, 8], None, None)
        assert h.shape == x.shape and rstd.shape == (4, 1, 1)
        gx, gw = torch.ops.nvfly.rms_norm_backward(x, x, [8], rstd.new_empty(4, 6, 1), w, None, [True, True])
        assert gx.shape == x.shape and gw.shape == w.shape and gw.dtype == w.dtype
        v, i = torch.ops.nvfly.topk(x, 3, 1, False, True)
        assert v.shape == (4, 3, 8) and v.dtype == x.dtype and i.dtype == torch.int64


@pytest.mark.parametrize("args", [
    lambda x, w, r: (torch.ops.nvfly.rms_norm.default, (x, [8], w, 1e-6)),
    lambda x, w, r: (torch.ops.nvfly.rms_norm.default, (x, [6, 8], None, None)),
    lambda x, w, r: (torch.ops.nvfly.fused_add_rms_norm.default, (x, r, [8], w, 1e-5)),
    lambda x, w, r: (torch.ops.nvfly.topk.default, (x, 3, -1, True, True)),
    lambda x, w, r: (torch.ops.nvfly.topk.default, (x, 2, 1, False, True)),
    lambda x, w, r: (torch.ops.nvfly.rms_norm_backward.default,
                     (r.detach(), x.detach(), [8], torch.rand(4, 6, 1) + 0.5, w.detach(), None, [True, True])),
])
def test_custom_ops_pass_opcheck_on_cpu(args):
    x = torch.randn(4, 6, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    r = torch.randn(4, 6, 8, requires_grad=True)
    op, op_args = args(x, w, r)
    torch.library.opcheck(op, op_args)


def test_custom_op_gradients_in_float64():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.nvfly.rms_norm(a, [5], b, 1e-6)[0], (x, w))
    assert torch.autograd.gradcheck(lambda a, c, b: torch.ops.nvfly.fused_add_rms_norm(a, c, [5], b, 1e-6)[:2],
                                    (x, r, w))


def test_custom_ops_compute_like_torch_on_cpu():
    x = torch.randn(5, 64)
    w = torch.randn(64)
    y, _ = torch.ops.nvfly.rms_norm(x, [64], w, 1e-6)
    assert torch.allclose(y, F.rms_norm(x, (64,), w, 1e-6), atol=1e-5)
    ties = torch.tensor([[1.0, 3.0, 3.0, float("nan"), 2.0, 3.0]])
    v, i = torch.ops.nvfly.topk(ties, 4)
    assert i.tolist() == [[3, 1, 2, 5]] and torch.isnan(v[0, 0])
    v, i = torch.ops.nvfly.topk(ties, 3, largest=False)
    assert i.tolist() == [[0, 4, 1]]


# ---------------------------------------------------------------------------------------------- routing
def test_routing_switch():
    assert not routing_enabled()
    with routing():
        assert routing_enabled()
        with routing(False):
            assert not routing_enabled()
        assert routing_enabled()
    assert not routing_enabled()
    enable_routing()
    try:
        assert routing_enabled()
    finally:
        disable_routing()
    assert not routing_enabled()


def test_routing_block_keeps_backward_on_the_calling_thread():
    """Autograd's device threads would not see the switch (a contextvar): an enabled block turns them off."""
    assert torch._C._is_multithreading_enabled()
    with routing():
        assert not torch._C._is_multithreading_enabled()
        with routing(False):
            assert not routing_enabled()
    assert torch._C._is_multithreading_enabled()


def test_routing_leaves_cpu_calls_untouched():
    install_routing()
    install_routing()  # idempotent, and registers nothing: routing() blocks do, while they last
    assert "aten::topk" not in installed()
    x = torch.randn(6, 300)
    w = torch.randn(300)
    expected = (torch.topk(x, 7), F.rms_norm(x, (300,), w))
    with routing():
        assert "aten::topk" in installed() and "aten::_fused_rms_norm" in installed()
        got = (torch.topk(x, 7), F.rms_norm(x, (300,), w))
    assert torch.equal(got[0].values, expected[0].values) and torch.equal(got[0].indices, expected[0].indices)
    assert torch.equal(got[1], expected[1])


def test_routed_implementation_declines_and_survives_failures(caplog):
    """The routed kernel, driven on CPU with the CPU kernel as its fallthrough: declines and errors use it."""
    calls = []

    def run(x, k, dim=-1, largest=True, sorted=True):
        calls.append(k)
        if k == 3:
            raise RuntimeError("boom")
        return torch.zeros(1), torch.zeros(1, dtype=torch.int64)

    route = Route("aten::topk", lambda x, k, *a: None if k != 2 else "k is two", run, "CPU")
    impl = _routed(route, torch.library.get_kernel("aten::topk", "CPU"))
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    x = torch.randn(2, 10)
    reference = torch.topk(x, 3)
    assert torch.equal(impl(keyset, x, 3, -1, True, True)[1], reference.indices)  # switched off: no call
    assert calls == []
    with routing(), caplog.at_level(logging.DEBUG, logger="nvfly"):
        assert impl(keyset, x, 1, -1, True, True)[0].shape == (1,)  # eligible: nvfly's result
        assert torch.equal(impl(keyset, x, 2, -1, True, True)[1], torch.topk(x, 2).indices)  # declined
        assert torch.equal(impl(keyset, x, 3, -1, True, True)[1], reference.indices)  # raised: fell back
    assert calls == [1, 3]
    assert "k is two" in caplog.text and "boom" in caplog.text


def test_register_route_is_a_registry_for_other_ops():
    from nvfly.torch import routing as routing_module
    never = lambda *args: "never eligible"  # noqa: E731
    register_route("nvfly_registry_test_op", never, lambda *args: None)  # never installed: popped below
    try:
        (route,) = [r for r in routing_module.routes() if r.op == "aten::nvfly_registry_test_op"]
        assert route.dispatch_key == "CUDA" and route.eligibility is never
    finally:
        routing_module._ROUTES.pop(("aten::nvfly_registry_test_op", "CUDA"))


# ---------------------------------------------------------------------------------------------- per-call host path
@pytest.fixture
def fake_launches(recorded_launches):
    """recorded_launches (conftest) with the ops' plan caches cleared before and after."""
    for cache in (rmsnorm_api._FORWARD, rmsnorm_api._BACKWARD, topk_api._TOPK):
        cache.clear()
    yield recorded_launches
    for cache in (rmsnorm_api._FORWARD, rmsnorm_api._BACKWARD, topk_api._TOPK):
        cache.clear()


def _weights(call):
    return [v for v in (call.__closure__ or ()) and [c.cell_contents for c in call.__closure__]
            if isinstance(v, torch.Tensor)]


def _calls():
    bf = torch.bfloat16
    w = torch.randn(256).to(bf)
    return [
        ("rms 2-D", lambda: (torch.randn(8, 256).to(bf),), lambda x: rmsnorm.rms_norm(x, w, 1e-6)),
        ("rms 3-D rstd", lambda: (torch.randn(2, 3, 256).to(bf),), lambda x: rmsnorm.rms_norm_forward(x, w)),
        ("rms strided", lambda: (torch.randn(8, 300).to(bf)[:, :256],), lambda x: rmsnorm.rms_norm(x, w)),
        ("rms residual", lambda: (torch.randn(8, 256).to(bf), torch.randn(8, 256).to(bf)),
         lambda x, r: rmsnorm.rms_norm_forward(x, w, 1e-5, r)),
        ("rms backward", lambda: (torch.randn(8, 256).to(bf), torch.randn(8, 256).to(bf), torch.rand(8)),
         lambda dy, x, rstd: rmsnorm.rms_norm_backward(dy, x, rstd, w)),
        ("topk warp", lambda: (torch.randn(64, 128).to(bf),), lambda x: topk.topk(x, 8)),
        ("topk dim 0", lambda: (torch.randn(128, 6).to(bf),), lambda x: topk.topk(x, 4, 0)),
        ("topk split", lambda: (torch.randn(1, 151936).to(bf),), lambda x: topk.topk(x, 1024)),
    ]


def test_topk_f16_rows_keep_the_list_path(fake_launches):
    """One bf16 row of 128256 with k = 1024 launches the exact finish's plan (63 slices of 256 threads); one fp16
    row the list path's (32 slices of 512: f16's first-level buckets are 1/32 octave, too narrow for the exact
    finish's window on most rows)."""
    for dtype, parts in ((torch.bfloat16, 63), (torch.float16, 32)):
        topk.topk(torch.randn(1, 128256).to(dtype), 1024)
        name, grid, _ = fake_launches[-1]
        assert name == "topk_row_one_launch_kernel" and tuple(grid)[:2] == (1, parts), (dtype, grid)


@pytest.mark.parametrize("name,make,call", _calls(), ids=[c[0] for c in _calls()])
def test_repeat_calls_launch_what_a_first_call_would(fake_launches, name, make, call):
    """The second call of a signature takes the prepared fast path; its launches (grid and every packed
    parameter) are those the full path makes for the same arguments as a first call."""
    first, second = make(), make()
    out1 = call(*first)
    n = len(fake_launches)
    out2 = call(*second)
    fast = fake_launches[n:]
    assert len(fast) == n > 0
    for cache in (rmsnorm_api._FORWARD, rmsnorm_api._BACKWARD, topk_api._TOPK):
        cache.clear()
    out3 = call(*second)
    reference = fake_launches[2 * n:]
    # the outputs are fresh allocations: map their addresses before comparing
    flat = lambda out: [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]  # noqa: E731
    moved = {a.data_ptr(): b.data_ptr() for a, b in zip(flat(out3), flat(out2))}
    known = set(moved.values()) | {t.data_ptr() for t in second} | {w.data_ptr() for w in _weights(call)}

    def scratch_as_one(params, mapping):  # scratch buffers (the only other addresses) differ between calls
        params = tuple(mapping.get(v, v) if type(v) is int else v for v in params)
        return tuple("scratch" if type(v) is int and v >= 1 << 32 and v not in known else v for v in params)
    for (k1, g1, p1), (k2, g2, p2) in zip(fast, reference):
        assert (k1, g1) == (k2, g2)
        assert scratch_as_one(p1, {}) == scratch_as_one(p2, moved)
    for a, b in zip(flat(out2), flat(out3)):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    del out1


def test_cached_signatures_still_check_arguments(fake_launches):
    x = torch.randn(4, 16)
    rmsnorm.rms_norm(x, eps=1e-6)
    with pytest.raises(ValueError, match="eps:"):
        rmsnorm.rms_norm(x, eps=-1e-6)
    with pytest.raises(ValueError, match="eps:"):
        rmsnorm.rms_norm(x, eps=True)
    rmsnorm.rms_norm_forward(x, options=rmsnorm.ForwardOptions(block_threads=128))
    with pytest.raises(ValueError, match="options:"):
        rmsnorm.rms_norm_forward(x, options={"block_threads": 128})
    topk.topk(x, 1)
    with pytest.raises(ValueError, match="k:"):
        topk.topk(x, True)
    with pytest.raises(TypeError, match="weight:"):
        rmsnorm.rms_norm(x, [1.0] * 16)
    assert len(rmsnorm_api._FORWARD) == 2 and len(topk_api._TOPK) == 1  # two forward signatures (options)


# ---------------------------------------------------------------------------------------------- language primitives
def test_warp_block_and_atomic_primitives_compile():
    @nvfly.kernel
    def primitives(x: nvfly.Tensor, out: nvfly.Tensor, counter: nvfly.Tensor):
        nvfly.min_blocks_per_sm(2)
        tid = nvfly.thread_idx.x
        v = x[tid]
        out[0] = nvfly.redux_sync(v.bitcast(nvfly.u32), "max").bitcast(nvfly.i32)
        out[1] = nvfly.redux_sync(v, "add")
        if nvfly.vote_any(v > 3):
            out[2] = nvfly.count_leading_zeros(v.to(nvfly.i64))
        if nvfly.syncthreads_or(v == 7):
            nvfly.atomic_add(counter, 0, 1)
    k = nvfly.compile(primitives, nvfly.TensorDesc(nvfly.i32, (128,)), nvfly.TensorDesc(nvfly.i32, (4,)),
                      nvfly.TensorDesc(nvfly.i32, (1,)), block=128)
    for instruction in ("redux.sync.max.u32", "redux.sync.add.s32", "vote.sync.any", "clz.b64", "bar.red.or",
                        "atom.global.add", ".minnctapersm 2"):
        assert instruction in k.ptx, instruction
    for instruction in ("REDUX.MAX", "REDUX.SUM", "VOTE.ANY", "BAR.RED.OR"):
        assert instruction in k.sass(), instruction


def test_primitive_misuse_is_a_compile_error():
    @nvfly.kernel
    def bad(x: nvfly.Tensor):
        x[0] = nvfly.redux_sync(x[0], "mul")
    with pytest.raises(nvfly.CompileError, match="redux_sync op"):
        nvfly.compile(bad, nvfly.TensorDesc(nvfly.i32, (4,)))


def test_eager_rms_norm_route_declines_launch_bound_calls():
    """An eager RMSNorm moving under RMS_NORM_EAGER_BYTES stays on torch (nvfly's host path costs more than its
    kernel saves there); a larger one goes on to the op's rules."""
    from nvfly.torch import routing as R
    small = torch.empty(64, 4096, dtype=torch.bfloat16, device="meta")
    large = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")
    assert "launch-bound" in R._launch_bound(small, 2)
    assert R._launch_bound(large, 2) is None and R._launch_bound(large[:4096], 2) is None  # 64 MiB: the floor
    assert "launch-bound" in R._launch_bound(large[:2048], 3)  # the backward's three tensors: 48 MiB
