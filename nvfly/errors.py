"""nvfly's error types. Compile errors point at the user's Python file and line, not at nvfly or MLIR internals."""
from __future__ import annotations

import linecache
import os
import sys
import types
from typing import Optional

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class NvflyError(Exception):
    """Base class of every error nvfly raises on purpose."""


class CompileError(NvflyError):
    """A kernel cannot be traced or compiled. ``filename``/``lineno`` name the user's source line."""

    def __init__(self, message: str, filename: Optional[str] = None, lineno: Optional[int] = None,
                 col: Optional[int] = None):
        self.message = message
        self.filename = filename
        self.lineno = lineno
        self.col = col
        super().__init__(self._render())

    def _render(self) -> str:
        if not self.filename or not self.lineno:
            return self.message
        text = f"{self.filename}:{self.lineno}: {self.message}"
        line = linecache.getline(self.filename, self.lineno)
        if line.strip():
            text += "\n    " + line.rstrip().lstrip()
            if self.col is not None:
                indent = len(line) - len(line.lstrip())
                caret_at = max(0, self.col - indent)
                text += "\n    " + " " * caret_at + "^"
        return text


class ToolchainError(NvflyError):
    """An external tool (ptxas, cuobjdump) is missing or failed."""


class LaunchError(NvflyError, ValueError):
    """A kernel launch was given arguments it cannot take (wrong dtype, device, rank, alignment, ...)."""


class CudaError(NvflyError, RuntimeError):
    """A CUDA driver call failed."""

    def __init__(self, what: str, code: int, name: str):
        self.what, self.code, self.name = what, code, name
        super().__init__(f"{what} failed: {name} ({code})")


def is_internal_file(filename: str) -> bool:
    """True for nvfly's own sources and the MLIR bindings: frames a user error should not point at."""
    if filename.startswith(_PACKAGE_DIR):
        return True
    return f"{os.sep}mlir{os.sep}" in filename or filename.startswith("<frozen")


def user_frame(frame: Optional[types.FrameType] = None) -> Optional[types.FrameType]:
    """The innermost frame outside nvfly (the user's kernel code being traced)."""
    frame = frame or sys._getframe(1)
    while frame is not None and is_internal_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def user_traceback_location(tb: Optional[types.TracebackType]) -> tuple[Optional[str], Optional[int]]:
    """The deepest traceback entry in user code: where a traced kernel went wrong."""
    found: tuple[Optional[str], Optional[int]] = (None, None)
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not is_internal_file(filename) and not filename.startswith("<"):
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found
