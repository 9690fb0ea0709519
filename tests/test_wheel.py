"""nvfly as a user installs it: build the wheel, install it into a fresh virtual environment and run ``nvfly demo``
and ``nvfly explain`` from a folder outside the checkout, so nothing can come from the checkout's files.

To stay fast the new environment sees this interpreter's packages (torch, the MLIR bindings, NVIDIA's tool wheels)
through a .pth file, and the wheel is installed without its dependencies; its own nvfly comes first on sys.path.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict, Path]:
    """(the fresh environment's bin folder, the environment to run it in, a folder outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy, so that building leaves no build/ or egg-info in the checkout
    shutil.copytree(ROOT / "nvfly", source / "nvfly", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp / "dist").glob("nvfly-*.whl")

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {"nvfly/cli/__init__.py", "nvfly/cli/demo.py", "nvfly/examples/vector_add.py"} <= names
    assert "Requires-Dist: nvidia-cuda-nvcc" in metadata

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                              "-q", "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"], tmp, dict(os.environ)).stdout.strip())
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "outer_packages.pth").write_text("\n".join(sorted(outer)) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", "")
    env["COLUMNS"] = "80"
    away = tmp / "elsewhere"
    away.mkdir()
    return venv / "bin", env, away


def test_the_installed_nvfly_is_the_wheels(installed):
    bin_dir, env, away = installed
    where = _run([str(bin_dir / "python"), "-c", "import nvfly.examples; print(nvfly.examples.__file__)"], away, env)
    assert where.stdout.startswith(str(bin_dir.parent)), where.stdout + where.stderr
    version = _run([str(bin_dir / "nvfly"), "--version"], away, env)
    assert version.returncode == 0 and version.stdout.startswith("nvfly "), version.stderr


def test_demo_from_the_wheel(installed):
    bin_dir, env, away = installed
    demo = _run([str(bin_dir / "nvfly"), "demo"], away, env)
    assert demo.returncode == 0 and "Traceback" not in demo.stderr, demo.stdout + demo.stderr
    out = demo.stdout
    assert "Compiled 7 kernels for sm_90a" in out
    assert "Tensor cores: HGMMA×" in out and "TMA: UTMALDG×" in out and "no kernel spills registers" in out
    assert str(bin_dir.parent) in out  # the example it points at is the installed one
    assert max(len(line) for line in out.splitlines() if "│" in line) <= 80  # the table fits 80 columns


def test_explain_and_bench_from_the_wheel(installed):
    bin_dir, env, away = installed
    explain = _run([str(bin_dir / "nvfly"), "explain", "16", "4096", "4096"], away, env)
    assert explain.returncode == 0 and "verdict:" in explain.stdout, explain.stdout + explain.stderr
    suites = _run([str(bin_dir / "nvfly"), "bench"], away, env)
    assert suites.returncode == 0 and "Suites run from a nvfly checkout" in suites.stdout, suites.stderr
