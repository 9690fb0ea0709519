"""The shared device building blocks without a GPU: each compiles for sm_90a to the PTX instruction it names (and
ptxas takes it), bad arguments are CompileErrors, and the kernel library writes no inline PTX of its own."""
import ast
from pathlib import Path

import pytest

import nvfly
from nvfly.arch import gpu_scope, memory, reduce, warp
from nvfly.arch.floats import compare_mask, f16_to_f32, tanh_approx
from nvfly.arch.memory import CacheHint, L1Eviction, L2Policy
from nvfly.arch.ptx import smem_address

OPS = Path(__file__).resolve().parent.parent / "nvfly" / "ops"
RAW_PTX = {"asm", "asm_multi", "inline_asm", "inline_ptx"}


def test_no_inline_ptx_in_the_kernel_library():
    """No module under nvfly/ops imports or calls asm / asm_multi (or MLIR's inline_asm / inline_ptx): every
    instruction the kernels need beyond the language comes from a named building block in nvfly.arch."""
    found = []
    for path in sorted(OPS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Call):
                func = node.func
                names = [func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")]
            found += [f"{path.relative_to(OPS)}:{node.lineno}: {n}" for n in names if n in RAW_PTX]
    assert not found, found


def i32s(n):
    return nvfly.TensorDesc(nvfly.i32, (n,))


# ---------------------------------------------------------------------------------------------- warp votes and bits
@nvfly.kernel
def votes_and_bits(x: nvfly.Tensor, wide: nvfly.Tensor, out: nvfly.Tensor):
    tid = nvfly.thread_idx.x
    v = x[tid]
    w = wide[tid]
    votes = warp.ballot(v > 3)
    for i, relation in enumerate(warp.LANEMASKS):
        out[8 * tid + i] = (votes & warp.lanemask(relation)).bitcast(nvfly.i32)
    out[8 * tid + 5] = warp.popc(votes) + warp.popc(w)
    out[8 * tid + 6] = warp.highest_bit(v).bitcast(nvfly.i32)
    out[8 * tid + 7] = warp.highest_bit(w).bitcast(nvfly.i32)


def test_votes_lane_masks_and_bit_counts():
    k = nvfly.compile(votes_and_bits, i32s(32), nvfly.TensorDesc(nvfly.i64, (32,)), i32s(256), block=32)
    for instruction in ("vote.sync.ballot.b32", "%lanemask_eq", "%lanemask_lt", "%lanemask_le", "%lanemask_gt",
                        "%lanemask_ge", "popc.b32", "popc.b64", "bfind.u32", "bfind.u64"):
        assert instruction in k.ptx, instruction
    for opcode in ("VOTE.ANY", "POPC", "FLO.U32"):
        assert opcode in k.sass(), opcode


# ---------------------------------------------------------------------------------------------- reductions and scans
@nvfly.kernel
def scans_and_reductions(x: nvfly.Tensor, f: nvfly.Tensor, wide: nvfly.Tensor, out: nvfly.Tensor,
                         fout: nvfly.Tensor):
    tid = nvfly.thread_idx.x
    lane = tid & 31
    warp_id = tid >> 5
    v = x[tid]
    fv = f[tid]
    totals = nvfly.shared_tensor(nvfly.i32, (4,))
    ftotals = nvfly.shared_tensor(nvfly.f32, (4,))
    scratch = nvfly.shared_tensor(nvfly.f32, (8,))
    out[16 * tid + 0] = reduce.warp_scan(v, lane)
    out[16 * tid + 1] = reduce.warp_scan(v, lane, reverse=True)
    out[16 * tid + 2] = reduce.warp_scan(v, lane, exclusive=True)
    out[16 * tid + 3] = reduce.warp_scan(v, lane, "max", exclusive=True, reverse=True)
    out[16 * tid + 4] = reduce.warp_scan(v, lane, "min")
    out[16 * tid + 5] = reduce.block_scan(v, totals, lane, warp_id, 4, exclusive=True, reverse=True)
    out[16 * tid + 6] = (reduce.warp_max_i64(wide[tid]) >> 3).to(nvfly.i32)
    out[16 * tid + 7] = reduce.tree_reduce([v, v + 1, v + 2], nvfly.maximum)
    fout[8 * tid + 0] = reduce.warp_scan(fv, lane, "add", exclusive=True)
    fout[8 * tid + 1] = reduce.block_reduce(fv, scratch, 128, "max")
    fout[8 * tid + 2] = reduce.group_reduce(fv, scratch, 4, 0, warp_id, lane, 64)
    fout[8 * tid + 3] = reduce.group_reduce(fv, scratch, 0, 0, warp_id, lane, 16, "min")
    fout[8 * tid + 4] = reduce.block_scan(fv, ftotals, lane, warp_id, 4, "max")
    many = nvfly.shared_tensor(nvfly.f32, (8,))
    fout[8 * tid + 5], fout[8 * tid + 6] = reduce.block_reduce_many([fv, fv * 2.0], many, 128, "max")


def test_warp_and_block_scans_and_reductions():
    k = nvfly.compile(scans_and_reductions, i32s(128), nvfly.TensorDesc(nvfly.f32, (128,)),
                      nvfly.TensorDesc(nvfly.i64, (128,)), i32s(2048), nvfly.TensorDesc(nvfly.f32, (1024,)),
                      block=128)
    for instruction in ("shfl.sync.up.b32", "shfl.sync.down.b32", "shfl.sync.bfly.b32", "redux.sync.max.s32",
                        "redux.sync.max.u32", "bar.sync"):
        assert instruction in k.ptx, instruction
    assert k.resources.spill_stores == 0


def test_reduction_identities():
    assert reduce.identity_of("add", nvfly.f32) == 0
    assert reduce.identity_of("max", nvfly.f32) == float("-inf") and reduce.identity_of("min", nvfly.i32) == 2**31 - 1
    assert reduce.identity_of("max", nvfly.u32) == 0 and reduce.identity_of("min", nvfly.u32) == 2**32 - 1
    assert reduce.tree_reduce([1, 2, 3, 4, 5], max) == 5


# ---------------------------------------------------------------------------------------------- GPU-scope memory
@nvfly.kernel
def gpu_scope_memory(counts: nvfly.Tensor, sums: nvfly.Tensor, wide: nvfly.Tensor, out: nvfly.Tensor):
    tid = nvfly.thread_idx.x
    gpu_scope.red_add(counts.address(tid), 3)
    gpu_scope.red_add(wide.address(tid), nvfly.i64(5))
    gpu_scope.red_add(sums.address(4 * tid), [sums[0], 1.0, 2.0, 3.0])
    gpu_scope.red_add(sums.address(4 * tid + 1), 0.5)
    old = gpu_scope.atom_add(counts.address(0), 1) + gpu_scope.atom_add(counts.address(1), tid, "acq_rel")
    old = old + gpu_scope.arrive(counts.address(2))
    old = old + gpu_scope.load_relaxed(counts.address(3), nvfly.i32) + gpu_scope.load_acquire(counts.address(4),
                                                                                              nvfly.i32)
    pair = gpu_scope.load_relaxed(wide.address(2 * tid), nvfly.i64, 2)
    four = gpu_scope.load_relaxed(sums.address(4 * tid), nvfly.f32, 4)
    one = gpu_scope.load_relaxed(sums.address(tid), nvfly.f32)
    gpu_scope.store_relaxed(sums.address(4 * tid), four)
    gpu_scope.store_release(counts.address(5), old + (pair[0] + pair[1]).to(nvfly.i32))
    gpu_scope.store_relaxed(out.address(tid), one)
    gpu_scope.store_zeros_x4(sums.address(4 * tid + 128))


def test_gpu_scope_atomics_loads_and_stores():
    k = nvfly.compile(gpu_scope_memory, i32s(64), nvfly.TensorDesc(nvfly.f32, (1024,)),
                      nvfly.TensorDesc(nvfly.i64, (256,)), nvfly.TensorDesc(nvfly.f32, (64,)), block=64)
    for instruction in ("red.relaxed.gpu.global.add.u32", "red.relaxed.gpu.global.add.u64",
                        "red.relaxed.gpu.global.add.v4.f32", "red.relaxed.gpu.global.add.f32",
                        "atom.relaxed.gpu.global.add.u32", "atom.acq_rel.gpu.global.add.u32",
                        "ld.relaxed.gpu.global.b32", "ld.acquire.gpu.global.b32", "ld.relaxed.gpu.global.v2.b64",
                        "ld.relaxed.gpu.global.v4.f32", "ld.relaxed.gpu.global.f32", "st.relaxed.gpu.global.v4.f32",
                        "st.release.gpu.global.b32", "st.relaxed.gpu.global.f32", "st.global.v4.b32"):
        assert instruction in k.ptx, instruction
    assert "RED.E.ADD.F32x4" in k.sass() or "REDG.E.ADD.F32x4" in k.sass()


# ---------------------------------------------------------------------------------------------- cache-hinted accesses
@nvfly.kernel
def hinted_accesses(src: nvfly.Tensor, dst: nvfly.Tensor, n: nvfly.i32):
    tid = nvfly.thread_idx.x
    stream = memory.load_global(src.address(8 * tid), 4, non_coherent=True, l1=L1Eviction.NO_ALLOCATE,
                                prefetch=256)
    tail = memory.load_global(src.address(8 * tid + 4), 2, 8 * tid + 4 < n, l1="evict_last",
                              policy=L2Policy.EVICT_LAST)
    word = memory.load_global(src.address(tid), 1, tid < n)
    drop = memory.create_policy(L2Policy.EVICT_FIRST)
    memory.store_global(dst.address(8 * tid), stream, tid < n, l1=L1Eviction.NO_ALLOCATE, policy=drop)
    memory.store_global(dst.address(8 * tid + 4), [tail[0], word], policy=drop)
    stage = nvfly.shared_tensor(nvfly.i32, (256,))
    memory.store_shared(smem_address(stage, 16 * tid), stream)
    nvfly.syncthreads()
    hint = CacheHint(L1Eviction.EVICT_FIRST, memory.create_policy("evict_normal"))
    row = memory.load_hinted(src, (8 * tid,), 4, tid < n, hint)
    memory.store_hinted(dst, row + stage[tid], (8 * tid,), 4, None, hint)


def test_cache_hinted_vector_loads_and_stores():
    k = nvfly.compile(hinted_accesses, nvfly.TensorDesc(nvfly.i32, (2048,)), nvfly.TensorDesc(nvfly.i32, (2048,)),
                      1000, block=128)
    for instruction in ("ld.global.nc.L1::no_allocate.L2::256B.v4.u32",
                        "ld.global.L1::evict_last.L2::cache_hint.v2.u32", f"{L2Policy.EVICT_LAST.descriptor}",
                        "@p ld.global.b32", "createpolicy.fractional.L2::evict_first.b64",
                        "createpolicy.fractional.L2::evict_normal.b64",
                        "@p st.global.L1::no_allocate.L2::cache_hint.v4.u32", "st.global.L2::cache_hint.v2.u32",
                        "st.shared.v4.b32", "ld.global.L1::evict_first.L2::cache_hint.v4.u32",
                        "st.global.L1::evict_first.L2::cache_hint.v4.u32"):
        assert instruction in k.ptx, instruction
    assert "LDG.E.NA.LTC256B.128.CONSTANT" in k.sass() or "LDG.E.NA.128.CONSTANT" in k.sass()


# ---------------------------------------------------------------------------------------------- float compares, loops
@nvfly.kernel
def compares_and_loops(x: nvfly.Tensor, halves: nvfly.Tensor, out: nvfly.Tensor, fout: nvfly.Tensor,
                       n: nvfly.i32):
    tid = nvfly.thread_idx.x
    word = x[tid].bitcast(nvfly.u32)
    flags = compare_mask(word, nvfly.u32(0x3F803F80), "gtu", nvfly.bf16)
    flags = flags | compare_mask(word, nvfly.u32(0x3C003C00), "ltu", nvfly.f16)
    flags = flags | compare_mask(x[tid].bitcast(nvfly.f32), 1.5, "ge", nvfly.f32)
    out[tid] = flags.bitcast(nvfly.i32)
    total = f16_to_f32(halves[tid])
    for i in range(1, n):
        nvfly.no_unroll()
        total = total + f16_to_f32(halves[i])
    fout[tid] = total


def test_float_compare_masks_conversion_and_no_unroll():
    k = nvfly.compile(compares_and_loops, i32s(64), nvfly.TensorDesc(nvfly.i16, (64,)), i32s(64),
                      nvfly.TensorDesc(nvfly.f32, (64,)), 1000, block=64)
    for instruction in ("set.gtu.u32.bf16x2", "set.ltu.u32.f16x2", "set.ge.u32.f32", "cvt.f32.f16",
                        '.pragma "nounroll"'):
        assert instruction in k.ptx, instruction


@nvfly.kernel
def soft_capped(x: nvfly.Tensor, out: nvfly.Tensor):
    tid = nvfly.thread_idx.x
    out[tid] = tanh_approx(x[tid] * (1.0 / 30.0)) * 30.0


def test_tanh_approx_is_one_mufu_tanh():
    """The MUFU tanh: one ``tanh.approx.f32`` in the PTX, one MUFU.TANH in the SASS and no other MUFU (the
    correctly rounded ``nvfly.tanh`` is an ex2, a reciprocal and a polynomial)."""
    f32s = nvfly.TensorDesc(nvfly.f32, (64,))
    k = nvfly.compile(soft_capped, f32s, f32s, block=64)
    assert k.ptx.count("tanh.approx.f32") == 1
    mufu = {op: n for op, n in k.sass_opcodes().items() if op.startswith("MUFU")}
    assert mufu == {"MUFU.TANH": 1}
    with pytest.raises(nvfly.CompileError, match=r"tanh_approx \(tanh.approx.f32\) needs target sm_75"):
        nvfly.compile(soft_capped, f32s, f32s, block=64, target="sm_70")


# ---------------------------------------------------------------------------------------------- misuse
@nvfly.kernel
def misuse(x: nvfly.Tensor, f: nvfly.Tensor, CASE: nvfly.Constexpr):
    tid = nvfly.thread_idx.x
    cases = {
        "lanemask": lambda: warp.lanemask("below"),
        "popc": lambda: warp.popc(f[tid]),
        "highest_bit": lambda: warp.highest_bit(x[tid].to(nvfly.i16)),
        "scan_op": lambda: reduce.warp_scan(x[tid], tid & 31, "mul"),
        "warp_max_i64": lambda: reduce.warp_max_i64(x[tid]),
        "red_vector": lambda: gpu_scope.red_add(x.address(0), [x[0], x[1]]),
        "red_dtype": lambda: gpu_scope.red_add(x.address(0), x[0].to(nvfly.i16)),
        "atom_order": lambda: gpu_scope.atom_add(x.address(0), 1, "seq_cst"),
        "load_vector": lambda: gpu_scope.load_relaxed(x.address(0), nvfly.i32, 3),
        "load_width": lambda: gpu_scope.load_relaxed(x.address(0), nvfly.i64, 4),
        "words": lambda: memory.load_global(x.address(0), 3),
        "prefetch": lambda: memory.load_global(x.address(0), 4, prefetch=32),
        "l1": lambda: memory.store_global(x.address(0), [x[0]], l1="keep"),
        "policy": lambda: memory.create_policy("keep"),
        "policy_dtype": lambda: memory.load_global(x.address(0), 1, policy=x[0]),
        "predicate": lambda: memory.load_global(x.address(0), 1, f[0]),
        "shared_words": lambda: memory.store_shared(0, [x[0]] * 3),
        "compare": lambda: compare_mask(f[0], f[1], "bigger", nvfly.f32),
        "compare_dtype": lambda: compare_mask(x[0], x[1], "gt", nvfly.i32),
        "compare_operand": lambda: compare_mask(x[0], x[1], "gt", nvfly.f32),
        "f16": lambda: f16_to_f32(x[0]),
        "tanh": lambda: tanh_approx(x[0]),
        "no_unroll": nvfly.no_unroll,
        "group": lambda: reduce.group_reduce(f[0], f, 0, 0, 0, tid & 31, 48),
        "warps": lambda: reduce.block_scan(x[0], x, tid & 31, 0, 0),
    }
    cases[CASE]()


@pytest.mark.parametrize("case, message", [
    ("lanemask", "lanemask relation"), ("popc", "popc takes"), ("highest_bit", "highest_bit takes"),
    ("scan_op", "reduction op"), ("warp_max_i64", "warp_max_i64 takes an i64"), ("red_vector", "vectors of f32"),
    ("red_dtype", "red_add takes 32- or 64-bit"), ("atom_order", "atom_add order"), ("load_vector", "load_relaxed"),
    ("load_width", "at most 16 bytes"), ("words", "1, 2 or 4"), ("prefetch", "prefetch"), ("l1", "L1 eviction"),
    ("policy", "expected one of evict_first"), ("policy_dtype", "i64"), ("predicate", "predicate"),
    ("shared_words", "store_shared"), ("compare", "cmp must be"), ("compare_dtype", "compare_mask compares"),
    ("compare_operand", "compare_mask of f32"), ("f16", "f16_to_f32"), ("tanh", "tanh_approx takes an f32"), ("no_unroll", "dynamic loop"),
    ("group", "GROUP: expected a power of two"), ("warps", "WARPS: expected 1 to 32 warps"),
])
def test_bad_arguments_are_compile_errors(case, message):
    with pytest.raises(nvfly.CompileError, match=message):
        nvfly.compile(misuse, i32s(4), nvfly.TensorDesc(nvfly.f32, (4,)), CASE=case)
