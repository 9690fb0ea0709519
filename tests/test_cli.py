"""The ``nvfly`` command line: every user mistake is one line on stderr, exit code 2 and no traceback; ``--version``,
the suite list, ``explain``'s notes; ``nvfly.ops``'s exports. In-process through ``main(argv)`` (fast), plus two
runs of the real command."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nvfly.cli import bench, main
from nvfly.compiler import toolchain

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")

MISTAKES = [
    pytest.param([], "the following arguments are required: COMMAND", id="no-command"),
    pytest.param(["nosuch"], "invalid choice: 'nosuch'", id="unknown-command"),
    pytest.param(["demo", "--frobnicate"], "unrecognized arguments: --frobnicate", id="unknown-option"),
    pytest.param(["demo", "--target", "foo"], "argument --target: invalid choice: 'foo'", id="demo-target-foo"),
    pytest.param(["demo", "--target"], "argument --target: expected one argument", id="demo-target-missing"),
    pytest.param(["demo", "extra"], "unrecognized arguments: extra", id="demo-extra-argument"),
    pytest.param(["explain", "0", "-1", "5"], "argument M: expected a positive integer, got 0", id="explain-0-1-5"),
    pytest.param(["explain", "16", "4096"], "the following arguments are required: K", id="explain-missing-k"),
    pytest.param(["explain", "16", "4096", "4k"], "argument K: expected a positive integer, got '4k'",
                 id="explain-not-a-number"),
    pytest.param(["explain", "16", "4096", "4096", "--batches", "0"],
                 "argument --batches: expected a positive integer, got 0", id="explain-batches-0"),
    pytest.param(["explain", "16", "4096", "4096", "--majors", "K"], "argument --majors: expected two of K/MN",
                 id="explain-majors"),
    pytest.param(["explain", "16", "4096", "4096", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'",
                 id="explain-dtype"),
    pytest.param(["explain", "16", "4096", "4096", "--device", "x"], "argument --device: expected a device index",
                 id="explain-device"),
    pytest.param(["explain", "16", "4096", "4096", "--benchmark"], "--benchmark times the candidates and torch on "
                 "a CUDA GPU", id="explain-benchmark-without-gpu", marks=NO_GPU),
    pytest.param(["bench", "nosuch"], "no suite named 'nosuch' (suites: gemm, rmsnorm", id="bench-nosuch"),
    pytest.param(["bench", "gemm"], "suite 'gemm' times kernels on a GPU, and no CUDA GPU is usable here",
                 id="bench-gemm-without-gpu", marks=NO_GPU),
]


def _one_line_error(capsys, argv: list, rc: int) -> str:
    err = capsys.readouterr().err
    assert rc == 2, (argv, err)
    assert "Traceback" not in err and err.endswith("\n") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv, message", MISTAKES)
def test_a_mistake_is_one_line_and_exit_code_2(capsys, argv, message):
    err = _one_line_error(capsys, argv, main(argv))
    assert message in err and " error: " in err


def test_an_unknown_nvfly_arch_is_a_mistake_of_the_demo(capsys, monkeypatch):
    monkeypatch.setenv("NVFLY_ARCH", "sm_75")
    err = _one_line_error(capsys, ["demo"], main(["demo"]))
    assert "NVFLY_ARCH=sm_75 is not a demo target (choose from sm_90a, sm_80)" in err


def test_a_missing_ptxas_says_how_to_get_it(capsys, monkeypatch):
    monkeypatch.setattr(toolchain, "ptxas_path", lambda: None)
    err = _one_line_error(capsys, ["demo"], main(["demo"]))
    assert err.startswith("nvfly: error: ptxas not found: pip install nvidia-cuda-nvcc")
    assert "NVFLY_PTXAS" in err


def test_a_missing_torch_says_how_to_get_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails as where it is not installed
    err = _one_line_error(capsys, ["explain"], main(["explain", "16", "4096", "4096"]))
    assert err.startswith("nvfly: error: this command runs on torch tensors: pip install torch")


def test_ptxas_lookup_honours_nvfly_ptxas_then_path_then_the_wheel(monkeypatch, tmp_path):
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    toolchain.ptxas_path.cache_clear()
    try:
        monkeypatch.setenv("NVFLY_PTXAS", str(fake))
        assert toolchain.ptxas_path() == str(fake)
        toolchain.ptxas_path.cache_clear()
        monkeypatch.delenv("NVFLY_PTXAS")
        monkeypatch.setenv("PATH", str(tmp_path))
        assert toolchain.ptxas_path() == str(fake)
        toolchain.ptxas_path.cache_clear()
        monkeypatch.setenv("PATH", "")
        monkeypatch.setattr(toolchain, "_cuda_homes", lambda: [])
        wheel = toolchain.ptxas_path()  # the nvidia-cuda-nvcc wheel's, where it is installed
        assert wheel is None or wheel.endswith(os.path.join("nvidia", "cu13", "bin", "ptxas"))
    finally:
        toolchain.ptxas_path.cache_clear()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("nvfly ")


def test_bare_bench_lists_every_suite_and_says_they_need_a_gpu(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "each needs a CUDA GPU" in out
    for suite in bench.SUITES:
        assert f"│ {suite} " in out


def test_every_suite_of_the_checkout_is_listed():
    in_checkout = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if "\ndef main(" in p.read_text()}
    assert set(bench.SUITES) == in_checkout


def test_explain_says_why_its_columns_are_empty(capsys):
    assert main(["explain", "16", "4096", "4096"]) == 0
    out = capsys.readouterr().out
    assert "measured ms is empty" in out and "--benchmark" in out
    if not torch.cuda.is_available():
        assert "database ms is empty" in out
    assert max(len(line) for line in out.splitlines() if "│" in line) <= 80  # the table fits 80 columns
    assert main(["explain", "16", "4096", "4096", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shape"] == {"batches": 1, "m": 16, "n": 4096, "k": 4096}


def test_explain_grouped_defaults_to_each_layouts_usual_majors(capsys):
    """The weight gradient's usual operands are x^T and dy (both MN-major): without --majors it is explained as
    nvfly runs it, not declined for the GEMM's K,K default."""
    assert main(["explain", "4096", "4096", "256", "--groups", "8", "--layout", "kgrouped"]) == 0
    assert "nvfly runs: grouped kgrouped" in capsys.readouterr().out
    assert main(["explain", "4096", "4096", "256", "--groups", "8", "--layout", "kgrouped", "--majors", "K,K"]) == 0
    assert "nvfly declines" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["explain", "0", "-1", "5"], ["bench", "nosuch"]])
def test_the_real_command_shows_no_traceback(argv, tmp_path):
    """As a user runs it: a fresh interpreter, from another folder."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "nvfly.cli", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_nvfly_ops_exports_the_ops_and_keeps_the_packages():
    import nvfly
    import nvfly.ops
    from nvfly.ops import matmul, rms_norm, topk
    from nvfly.ops.gemm import api as gemm_api
    from nvfly.ops.rmsnorm import api as rmsnorm_api
    from nvfly.ops.topk import api as topk_api

    assert matmul is gemm_api.matmul and rms_norm is rmsnorm_api.rms_norm
    assert topk is sys.modules["nvfly.ops.topk"] and topk.plan and topk.topk is topk_api.topk
    from nvfly.ops import grouped_mm
    from nvfly.ops.grouped import api as grouped_api
    assert grouped_mm is grouped_api.grouped_mm
    assert sorted(nvfly.ops.__all__) == ["grouped_mm", "matmul", "rms_norm", "topk"]
    with pytest.raises(nvfly.NvflyError):  # the package called is the function, refusing a CPU tensor
        topk(torch.tensor([[3.0, 1.0, 2.0]]), 2)
    with pytest.raises(AttributeError):
        nvfly.ops.nosuch  # noqa: B018
