"""Python control flow on traced values lowers to scf ops with the right results; static flow folds away."""
import re

import torch

import nvfly

X = torch.randn(1024)


def compile_ir(fn, *args, **kwargs):
    return nvfly.compile(nvfly.Kernel(fn), *args, **kwargs)


def kernel_ops(k):
    """The op names of the traced kernel body, in order."""
    return re.findall(r"\b(scf\.\w+|arith\.\w+|llvm\.\w+|nvvm\.[\w.]+|gpu\.\w+)", k.mlir)


def test_dynamic_if_yields_values_in_variable_order():
    def kern(out: nvfly.Tensor, flag: nvfly.i32):
        a = nvfly.i32(11)
        b = nvfly.i32(22)
        if flag > 0:
            a, b = b, a
        out[0] = a
        out[1] = b

    k = compile_ir(kern, torch.zeros(2, dtype=torch.int32), 1)
    m = re.search(r"%(\d+):2 = scf\.if", k.mlir)
    assert m, k.mlir
    # then-branch yields (22, 11), else-branch (11, 22)
    yields = re.findall(r"scf\.yield (%[\w]+), (%[\w]+)", k.mlir)
    consts = dict(re.findall(r"(%c\w+) = arith\.constant (\d+) : i32", k.mlir))
    assert [(consts[a], consts[b]) for a, b in yields] == [("22", "11"), ("11", "22")]
    # the stores take the if's results in order: a first, then b
    stores = re.findall(r"llvm\.store (%[\w#]+)", k.mlir)
    assert stores == [f"%{m.group(1)}#0", f"%{m.group(1)}#1"]


def test_static_if_is_resolved_at_trace_time():
    def kern(out: nvfly.Tensor, MODE: nvfly.Constexpr):
        if MODE == "double":
            out[0] = 2.0
        else:
            out[0] = 1.0

    k = compile_ir(kern, torch.zeros(1), MODE="double")
    assert "scf.if" not in k.mlir
    assert "2.000000e+00" in k.mlir and "1.000000e+00" not in k.mlir


def test_dynamic_for_carries_values_and_reports_divisibility():
    def kern(x: nvfly.Tensor, out: nvfly.Tensor, n: nvfly.i32):
        acc = nvfly.f32(0.0)
        count = 0
        for k in range(0, n, 8):
            acc = acc + x.load(k, width=8).sum()
            count = count + 1
        out[0] = acc
        out[1] = count.to(nvfly.f32)

    k = compile_ir(kern, X, X, 1024)
    assert re.search(r"scf\.for %\w+ = %\w+ to %\w+ step %\w+ iter_args\(%\w+ = %\w+, %\w+ = %\w+\) "
                     r"-> \(f32, i32\)", k.mlir), k.mlir
    # k is a multiple of 8 and the base is 16-byte aligned: the 8 x f32 load is 16-byte aligned (2 x 128-bit)
    assert "vector<8xf32>" in k.mlir and "alignment = 16" in k.mlir
    assert k.count("LDG.E.128") >= 2 and k.sass_opcodes()["LDG.E"] == 0


def test_static_range_unrolls():
    def kern(out: nvfly.Tensor):
        total = nvfly.f32(0.0)
        for i in nvfly.static_range(4):
            total = total + out[i]
        out[4] = total

    k = compile_ir(kern, torch.zeros(8))
    assert "scf.for" not in k.mlir
    assert kernel_ops(k).count("llvm.load") == 4


def test_while_on_traced_condition_is_scf_while():
    def kern(out: nvfly.Tensor, n: nvfly.i32):
        i = nvfly.i32(1)
        steps = nvfly.i32(0)
        while i < n:
            i = i * 2
            steps = steps + 1
        out[0] = steps

    k = compile_ir(kern, torch.zeros(1, dtype=torch.int32), 100)
    assert "scf.while" in k.mlir and "scf.condition" in k.mlir


def test_while_on_python_condition_unrolls():
    def kern(out: nvfly.Tensor):
        offset = 16
        v = out[nvfly.lane_idx()]
        while offset > 0:
            v = v + nvfly.shfl_xor(v, offset)
            offset //= 2
        out[0] = v

    k = compile_ir(kern, torch.zeros(32))
    assert "scf.while" not in k.mlir
    assert k.count("SHFL.BFLY") == 5


def test_early_return_takes_the_rest_as_else():
    def kern(x: nvfly.Tensor, n: nvfly.i32):
        i = nvfly.thread_idx.x
        if i >= n:
            return
        x[i] = x[i] * 2.0

    k = compile_ir(kern, X, 1024)
    assert "scf.if" in k.mlir
    assert k.count("STG.E") == 1


def test_boolean_operators_and_conditional_expressions_on_traced_values():
    def kern(x: nvfly.Tensor, n: nvfly.i32):
        i = nvfly.thread_idx.x
        if i < n and not (i == 3) or i == 100:
            x[i] = 1.0 if i > 5 else 2.0

    k = compile_ir(kern, X, 1024)
    ops = kernel_ops(k)
    assert "arith.andi" in ops and "arith.ori" in ops and "arith.xori" in ops and "arith.select" in ops


def test_python_and_or_keep_python_semantics_on_python_values():
    def kern(x: nvfly.Tensor, A: nvfly.Constexpr, B: nvfly.Constexpr):
        v = A and B
        w = A or B
        x[0] = v + w

    k = compile_ir(kern, X, A=0, B=5)
    assert "5.000000e+00" in k.mlir  # (0 and 5) + (0 or 5) = 0 + 5


def test_nested_loops_and_branches():
    def kern(x: nvfly.Tensor, out: nvfly.Tensor, m: nvfly.i32, n: nvfly.i32):
        total = nvfly.f32(0.0)
        for i in range(m):
            row = nvfly.f32(0.0)
            for j in range(n):
                v = x[i * n + j]
                if v > 0.0:
                    row = row + v
                else:
                    row = row - v
            total = total + row
        out[0] = total

    k = compile_ir(kern, X, X, 32, 32)
    assert k.mlir.count("scf.for") == 2 and "scf.if" in k.mlir


def test_device_function_with_dynamic_control_flow():
    @nvfly.func
    def clamp_add(a, b, limit):
        s = a + b
        if s > limit:
            s = limit
        return s

    def kern(x: nvfly.Tensor):
        x[0] = clamp_add(x[0], x[1], 4.0)

    k = compile_ir(kern, X)
    assert "scf.if" in k.mlir


def test_list_mutated_in_dynamic_loop_is_carried():
    def kern(x: nvfly.Tensor, n: nvfly.i32):
        acc = [0.0, 0.0, 0.0, 0.0]
        for k in range(n):
            for j in nvfly.static_range(4):
                acc[j] = acc[j] + x[k * 4 + j]
        for j in nvfly.static_range(4):
            x[j] = acc[j]

    k = compile_ir(kern, X, 256)
    assert re.search(r"iter_args\((%\w+ = %\w+(, )?){4}\) -> \(f32, f32, f32, f32\)", k.mlir), k.mlir
