"""nvfly's layering: the import-linter contracts of pyproject.toml ([tool.importlinter]: layers in order, no import
circles, op families independent, no torch below the runtime), each run with ``lint-imports``, and the size of
nvfly's files."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 1000

CONTRACTS = [
    "layers",
    "acyclic",
    "acyclic-ops",
    "op-families",
    "no-torch-below-runtime",
]


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    """``lint-imports`` on this checkout's nvfly (not on an installed copy)."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed (pip install import-linter: the 'test' extra has it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([exe, "--no-cache", "--no-logo", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("contract", CONTRACTS)
def test_contract_is_kept(contract):
    result = lint_imports("--contract", contract)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_contract_is_tested():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    tested = {c if isinstance(c, str) else c.values[0] for c in CONTRACTS}
    assert {c["id"] for c in config["contracts"]} == tested


def test_a_broken_contract_fails(tmp_path):
    """The runner sees nvfly's imports: a contract the code breaks (ops import the front end) fails."""
    config = tmp_path / "broken.toml"
    config.write_text('[tool.importlinter]\nroot_package = "nvfly"\n\n[[tool.importlinter.contracts]]\n'
                      'id = "broken"\nname = "ops never import the front end"\ntype = "forbidden"\n'
                      'source_modules = ["nvfly.ops"]\nforbidden_modules = ["nvfly.frontend"]\n')
    result = lint_imports(str(config))
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout + result.stderr


def test_no_file_over_1000_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "nvfly").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
