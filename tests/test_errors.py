"""Errors name the user's file and line and say what is wrong in terms of the Python code."""
import os

import pytest
import torch

import nvfly
from nvfly import CompileError, LaunchError

HERE = os.path.abspath(__file__)
X = torch.randn(64)


def line_of(fn, text):
    import inspect
    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if text in line:
            return start + i
    raise AssertionError(text)


def compile_error(fn, *args, **kwargs):
    with pytest.raises(CompileError) as info:
        nvfly.compile(nvfly.Kernel(fn), *args, **kwargs)
    return info.value


def test_python_type_error_points_at_the_kernel_line():
    def kern(x: nvfly.Tensor):
        v = x[0]
        x[1] = v + "text"  # the bad line

    err = compile_error(kern, X)
    assert err.filename == HERE and err.lineno == line_of(kern, "the bad line")
    assert "TypeError" in str(err) or "cannot combine" in str(err)
    assert f"{HERE}:{err.lineno}" in str(err) and 'v + "text"' in str(err)


def test_traced_value_used_as_python_bool():
    def kern(x: nvfly.Tensor, n: nvfly.i32):
        i = nvfly.thread_idx.x
        if 0 < i < n:  # chained
            x[i] = 0.0

    err = compile_error(kern, X, 64)
    assert err.lineno == line_of(kern, "# chained")
    assert "Python bool" in err.message


def test_break_in_dynamic_loop_is_rejected_at_its_line():
    def kern(x: nvfly.Tensor, n: nvfly.i32):
        for i in range(n):
            if i > 3:
                break  # here
            x[i] = 0.0

    err = compile_error(kern, X, 64)
    assert err.lineno == line_of(kern, "break  # here")
    assert "static_range" in err.message


def test_loop_variable_changing_type_names_the_variable():
    def kern(x: nvfly.Tensor, n: nvfly.i32):
        acc = nvfly.i32(0)
        for i in range(n):
            acc = x[i]  # f32 now
        x[0] = acc

    err = compile_error(kern, X, 64)
    assert "'acc'" in err.message and "i32" in err.message and "f32" in err.message
    assert err.lineno == line_of(kern, "for i in range(n)")


def test_variable_defined_in_one_branch_only():
    def kern(x: nvfly.Tensor, n: nvfly.i32):
        if n > 3:
            y = x[0]
        x[1] = y  # use

    err = compile_error(kern, X, 64)
    assert "'y'" in err.message and "only one branch" in err.message
    assert err.lineno == line_of(kern, "# use")


def test_wrong_number_of_indices():
    def kern(x: nvfly.Tensor):
        x[0, 1] = 1.0  # rank

    err = compile_error(kern, X)
    assert "rank-1 tensor needs 1 indices" in err.message
    assert err.lineno == line_of(kern, "# rank")


def test_vector_access_needs_unit_stride():
    def kern(x: nvfly.Tensor):
        x.store(x.load(0, 0, width=4), 0, 0)  # vec

    err = compile_error(kern, torch.randn(8, 8).t())
    assert "static stride 1" in err.message and err.lineno == line_of(kern, "# vec")


def test_unsupported_annotation():
    def kern(x: list):
        pass

    with pytest.raises(CompileError) as info:
        nvfly.Kernel(kern)
    assert "parameter 'x'" in str(info.value) and "unsupported annotation" in str(info.value)


def test_launch_argument_errors_name_the_argument():
    @nvfly.kernel
    def kern(x: nvfly.Tensor[nvfly.bf16, 2], n: nvfly.i32):
        pass

    with pytest.raises(LaunchError, match=r"argument 'x': expected a bf16 tensor, got f32"):
        kern.compile(torch.randn(4, 4), 3)
    with pytest.raises(LaunchError, match=r"argument 'x': expected a rank-2 tensor, got rank 1"):
        kern.compile(torch.randn(4).to(torch.bfloat16), 3)
    with pytest.raises(LaunchError, match=r"argument 'x': expected a tensor, got int"):
        kern.compile(3, 3)
    with pytest.raises(LaunchError, match=r"argument 'n': expected a Python number"):
        kern.compile(torch.randn(4, 4).to(torch.bfloat16), "3")
    with pytest.raises(LaunchError, match=r"missing argument 'n'"):
        kern.compile(torch.randn(4, 4).to(torch.bfloat16))
    with pytest.raises(LaunchError, match=r"argument 'x': expected a CUDA tensor, got one on cpu"):
        kern[1, 32](torch.randn(4, 4).to(torch.bfloat16), 3)


def test_kernel_is_not_callable_directly():
    @nvfly.kernel
    def kern(x: nvfly.Tensor):
        pass

    with pytest.raises(TypeError, match=r"kern\[grid, block\]"):
        kern(X)


def test_unsupported_dtype_is_reported():
    @nvfly.kernel
    def kern(x: nvfly.Tensor):
        pass

    with pytest.raises(LaunchError, match="complex64"):
        kern.compile(torch.zeros(4, dtype=torch.complex64))


def test_a_kernel_name_that_is_not_a_ptx_identifier_is_refused():
    """The name becomes the PTX entry's: one ptxas or LLVM would reject is an error naming the argument, at once."""
    def body(x: nvfly.Tensor):
        x[0] = 1.0

    for bad in ("my.kernel", "a-b", "1st", "k\u00e9"):
        with pytest.raises(ValueError, match="name: a kernel name must be a PTX identifier"):
            nvfly.Kernel(body, name=bad)
    assert nvfly.Kernel(body, name="my_kernel_2").name == "my_kernel_2"
