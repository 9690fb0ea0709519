"""The tracing state: one MLIR module with one ``gpu.module`` holding the kernel being traced.

Device operations find the active ``KernelBuilder`` through ``current()``; every operation is created under the
location of the user's source line that asked for it, so verifier and lowering diagnostics map back to it.
"""
from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

from contextlib import contextmanager

from mlir import ir
from mlir.dialects import gpu, llvm

from nvfly.errors import CompileError, user_frame

_CURRENT: contextvars.ContextVar[Optional["KernelBuilder"]] = contextvars.ContextVar("nvfly_builder", default=None)

DYNAMIC_SMEM_SYMBOL = "__nvfly_dynamic_smem"
DYNAMIC_SMEM_ALIGN = 1024  # 128-byte swizzled TMA/wgmma tiles need 1024-byte aligned shared memory


def current() -> "KernelBuilder":
    builder = _CURRENT.get()
    if builder is None:
        raise CompileError("nvfly device operations can only be used inside an @nvfly.kernel while it is traced")
    return builder


def is_tracing() -> bool:
    return _CURRENT.get() is not None


F = TypeVar("F", bound=Callable[..., Any])


def traced(fn: F) -> F:
    """Run a device-op builder under the location of the user's calling line (outermost call wins)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        builder = current()
        if builder.location_depth:
            return fn(*args, **kwargs)
        builder.location_depth += 1
        try:
            with builder.user_location():
                return fn(*args, **kwargs)
        finally:
            builder.location_depth -= 1

    return wrapper  # type: ignore[return-value]


class KernelBuilder:
    """Owns the MLIR context and module of one kernel trace."""

    def __init__(self, name: str, target: str, arg_types: Sequence[ir.Type] | Callable[[], Sequence[ir.Type]],
                 block: tuple[int, int, int], cluster: Optional[tuple[int, int, int]] = None,
                 features: str = "+ptx81", opt_level: int = 3):
        self.name = name
        self.target = target
        self.block = block
        self.cluster = cluster
        self.location_depth = 0
        self.dynamic_smem_bytes = 0
        self.static_smem_count = 0
        self.kernel_attrs: dict[str, str] = {}
        self.cooperative = False  # launch with all blocks resident at once (``nvfly.cooperative``)
        self.dependent = False  # may start before the stream's previous kernel ends (``nvfly.wait_prior_grid``)
        self.context = ir.Context()
        self.context.allow_unregistered_dialects = False
        self._diagnostics: list[str] = []
        self.context.attach_diagnostic_handler(self._on_diagnostic)
        with self.context, ir.Location.unknown():
            self.module = ir.Module.create()
            self.module.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
            with ir.InsertionPoint(self.module.body):
                target_attr = ir.Attribute.parse(
                    f'#nvvm.target<chip = "{target}", features = "{features}", O = {opt_level}>')
                self.gpu_module = gpu.GPUModuleOp("nvfly", targets=ir.ArrayAttr.get([target_attr]))
                self.gpu_module.bodyRegion.blocks.append()
            self.module_body = self.gpu_module.bodyRegion.blocks[0]
            types = arg_types() if callable(arg_types) else arg_types
            with ir.InsertionPoint(self.module_body):
                self.func = gpu.GPUFuncOp(ir.FunctionType.get(list(types), []), sym_name=name, kernel=True,
                                          known_block_size=list(block))
            self.entry = self.func.add_entry_block()
        self._dyn_smem_global: Optional[Any] = None

    # ----------------------------------------------------------------- context management
    @contextmanager
    def activate(self) -> Iterator["KernelBuilder"]:
        token = _CURRENT.set(self)
        try:
            with self.context, ir.Location.unknown(), ir.InsertionPoint(self.entry):
                yield self
        finally:
            _CURRENT.reset(token)

    def user_location(self) -> ir.Location:
        frame = user_frame()
        if frame is None:
            return ir.Location.unknown()
        return ir.Location.file(frame.f_code.co_filename, frame.f_lineno, 0)

    def finish(self) -> None:
        with ir.InsertionPoint(self.entry):
            gpu.ReturnOp([])
        for key, value in self.kernel_attrs.items():
            self.func.operation.attributes[key] = ir.Attribute.parse(value)
        if self.cluster is not None:
            self.func.operation.attributes["nvvm.cluster_dim"] = ir.Attribute.parse(
                "array<i32: %d, %d, %d>" % self.cluster)
        self.verify()

    # ----------------------------------------------------------------- diagnostics
    def _on_diagnostic(self, diag: Any) -> bool:
        self._diagnostics.append((str(diag.location), str(diag.message)))
        return True

    def verify(self) -> None:
        self._diagnostics.clear()
        if self.module.operation.verify():
            return
        raise self.diagnostic_error("the traced kernel is not valid IR")

    def diagnostic_error(self, what: str) -> CompileError:
        """A CompileError naming the user's line of the first diagnostic that has one."""
        for loc_text, message in self._diagnostics:
            filename, lineno = _parse_file_location(loc_text)
            if filename:
                return CompileError(f"{what}: {message}", filename, lineno)
        details = "; ".join(m for _, m in self._diagnostics) or "no diagnostic"
        return CompileError(f"{what}: {details}")

    # ----------------------------------------------------------------- module-level symbols
    def dynamic_smem_base(self) -> ir.Value:
        """Address of the kernel's dynamic shared memory (an external, 1024-byte aligned ``.shared`` array)."""
        if self._dyn_smem_global is None:
            with ir.InsertionPoint.at_block_begin(self.module_body), ir.Location.unknown():
                self._dyn_smem_global = llvm.GlobalOp(
                    ir.Type.parse("!llvm.array<0 x i8>"), DYNAMIC_SMEM_SYMBOL,
                    ir.Attribute.parse("#llvm.linkage<external>"), addr_space=3, alignment=DYNAMIC_SMEM_ALIGN)
        return llvm.AddressOfOp(ir.Type.parse("!llvm.ptr<3>"), DYNAMIC_SMEM_SYMBOL).result

    def static_smem(self, nbytes: int, align: int) -> ir.Value:
        """Address of a new static shared-memory array of ``nbytes``."""
        self.static_smem_count += 1
        symbol = f"__nvfly_smem_{self.static_smem_count}"
        with ir.InsertionPoint.at_block_begin(self.module_body), ir.Location.unknown():
            llvm.GlobalOp(ir.Type.parse(f"!llvm.array<{nbytes} x i8>"), symbol,
                          ir.Attribute.parse("#llvm.linkage<internal>"), addr_space=3, alignment=align)
        return llvm.AddressOfOp(ir.Type.parse("!llvm.ptr<3>"), symbol).result

    def use_dynamic_smem(self, end_byte: int) -> None:
        self.dynamic_smem_bytes = max(self.dynamic_smem_bytes, end_byte)


def _parse_file_location(text: str) -> tuple[Optional[str], Optional[int]]:
    # MLIR prints file locations as loc("path":line:col)
    start = text.find('"')
    end = text.find('"', start + 1)
    if start < 0 or end < 0:
        return None, None
    rest = text[end + 1:].lstrip(":").split(":")
    try:
        return text[start + 1:end], int(rest[0].rstrip(")"))
    except (ValueError, IndexError):
        return None, None
