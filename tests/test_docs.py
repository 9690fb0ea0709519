"""The README's and the user guide's code runs: each document's ```python blocks, in order, as one script.

A block fenced ```python gpu needs a GPU: it runs only where one is usable. The script keeps every block at its
line of the document (the rest blanked), so a failure points at the document's line, and kernels defined in a
block have source for nvfly to trace.
"""
import re
import runpy
from pathlib import Path

import pytest

import nvfly
from nvfly import settings

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", "docs/guide.md"]
FENCE = re.compile(r"^```python( gpu)?\n(.*?)^```$", re.M | re.S)


def script_of(text: str, gpu: bool) -> tuple[str, int]:
    """The document with everything but its runnable python blocks blanked; and how many blocks it runs."""
    lines = [""] * (text.count("\n") + 1)
    runs = 0
    for block in FENCE.finditer(text):
        if block.group(1) and not gpu:
            continue
        first = text.count("\n", 0, block.start(2))
        for offset, line in enumerate(block.group(2).splitlines()):
            lines[first + offset] = line
        runs += 1
    return "\n".join(lines), runs


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_python_block_runs(document, tmp_path, monkeypatch):
    script, runs = script_of((ROOT / document).read_text(), nvfly.gpu_available())
    assert runs, f"{document} has no python block"
    path = tmp_path / (Path(document).stem + "_blocks.py")
    path.write_text(script)
    monkeypatch.chdir(tmp_path)  # the blocks must not depend on the checkout's folder
    runpy.run_path(str(path), run_name="__main__")


def test_the_guide_names_every_setting():
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert [s.env for s in settings.describe() if s.env not in guide] == []
