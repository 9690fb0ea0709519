"""From a traced kernel module to PTX and a cubin, as named stages.

1. ``lower``: upstream passes take gpu/nvgpu/nvvm/scf/arith/memref IR to the LLVM dialect.
2. ``patch``: LLVM-dialect fixes the upstream lowering cannot express: TMA descriptor parameters become
   128-byte ``byval`` grid constants (``.param .align 64 .b8 p[128]``).
3. ``ptx``: ``gpu-module-to-binary{format=isa}`` (LLVM NVPTX backend, libdevice linked when found).
4. ``cubin``: ``ptxas`` (or none, and the driver JIT-compiles the PTX at load time).

With ``NVFLY_DUMP_DIR`` set, the IR after every pass and each stage's output are written there.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Optional

from mlir import ir, passmanager
from mlir.dialects import gpu

from nvfly import settings
from nvfly.compiler import toolchain
from nvfly.compiler.artifact import CompiledKernel, Resources
from nvfly.errors import CompileError
from nvfly.frontend.function import TracedKernel

LOWER_PASSES = (
    "strip-debuginfo",
    "convert-nvgpu-to-nvvm",
    "convert-scf-to-cf",
    "convert-nvvm-to-llvm",
    "expand-strided-metadata",
    "lower-affine",
    "convert-gpu-to-nvvm{use-bare-ptr-memref-call-conv=true index-bitwidth=64}",
    "canonicalize",
    "cse",
    "reconcile-unrealized-casts",
)


def ir_key(traced: TracedKernel, module_text: str) -> str:
    """Content hash of everything that determines the binary."""
    blob = json.dumps({"ir": module_text, "target": traced.target, "tma_params": traced.tma_params,
                       "cooperative": traced.cooperative, "dependent": traced.dependent,
                       "toolchain": toolchain.fingerprint(), "settings": settings.codegen_fingerprint()},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _dump(dump_dir: Optional[str], name: str, text: str | bytes) -> None:
    if not dump_dir:
        return
    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, name), "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)


def lower(traced: TracedKernel, dump_dir: Optional[str]) -> None:
    pm = passmanager.PassManager.parse("builtin.module(gpu.module(" + ",".join(LOWER_PASSES) + "))")
    if dump_dir:
        pm.enable_ir_printing(print_after_all=True, tree_printing_dir_path=os.path.join(dump_dir, "passes"))
    try:
        pm.run(traced.module.operation)
    except ir.MLIRError as exc:
        raise _lowering_error(traced, exc) from None


def _lowering_error(traced: TracedKernel, exc: Exception) -> CompileError:
    err = traced.builder.diagnostic_error("lowering failed")
    if err.filename is None:
        return CompileError(f"lowering {traced.name} failed: {exc}")
    return err


def patch(traced: TracedKernel) -> None:
    """Give TMA descriptor parameters the by-value grid-constant ABI (set after convert-gpu-to-nvvm)."""
    if not traced.tma_params:
        return
    for op in traced.module.body.operations:
        if op.operation.name != "gpu.module":
            continue
        for inner in op.regions[0].blocks[0].operations:
            attrs = inner.operation.attributes
            if inner.operation.name != "llvm.func" or "nvvm.kernel" not in attrs:
                continue
            nargs = len(inner.regions[0].blocks[0].arguments)
            old = list(ir.ArrayAttr(attrs["arg_attrs"])) if "arg_attrs" in attrs else [ir.DictAttr.get({})] * nargs
            new = []
            for i in range(nargs):
                entries = {na.name: na.attr for na in ir.DictAttr(old[i])}
                if i in traced.tma_params:
                    entries["llvm.byval"] = ir.TypeAttr.get(ir.Type.parse("!llvm.array<128 x i8>"))
                    entries["llvm.align"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 64)
                    entries["nvvm.grid_constant"] = ir.UnitAttr.get()
                new.append(ir.DictAttr.get(entries))
            attrs["arg_attrs"] = ir.ArrayAttr.get(new)


def to_ptx(traced: TracedKernel) -> str:
    pm = passmanager.PassManager.parse("builtin.module(gpu-module-to-binary{format=isa})")
    try:
        pm.run(traced.module.operation)
    except ir.MLIRError as exc:
        raise CompileError(f"PTX generation for {traced.name} failed: {exc}") from None
    for op in traced.module.body.operations:
        if op.operation.name == "gpu.binary":
            for obj in ir.ArrayAttr(op.operation.attributes["objects"]):
                return bytes(gpu.ObjectAttr(obj).object).decode()
    raise CompileError(f"PTX generation for {traced.name} produced no object")


def compile_traced(traced: TracedKernel, key: Optional[str] = None) -> CompiledKernel:
    """Run every stage on a traced kernel (its module is consumed)."""
    dump_dir = settings.get("dump_dir")
    if dump_dir:
        dump_dir = os.path.join(dump_dir, f"{traced.name}-{(key or 'nokey')[:12]}")
    with traced.builder.context, ir.Location.unknown():
        mlir_text = str(traced.module)
        key = key or ir_key(traced, mlir_text)
        _dump(dump_dir, "kernel.mlir", mlir_text)
        lower(traced, dump_dir)
        patch(traced)
        llvm_text = str(traced.module)
        _dump(dump_dir, "kernel.llvm.mlir", llvm_text)
        ptx = to_ptx(traced)
    _dump(dump_dir, "kernel.ptx", ptx)
    cubin, log = _assemble(ptx, traced.target)
    if cubin is not None:
        _dump(dump_dir, "kernel.cubin", cubin)
    return CompiledKernel(name=traced.name, target=traced.target, key=key, abi=traced.abi, block=traced.block,
                          cluster=traced.cluster, dynamic_smem_bytes=traced.dynamic_smem_bytes, mlir=mlir_text,
                          llvm_mlir=llvm_text, ptx=ptx, cubin=cubin, ptxas_log=log,
                          resources=Resources.from_ptxas_log(log), cooperative=traced.cooperative,
                          dependent=traced.dependent)


def _assemble(ptx: str, target: str) -> tuple[Optional[bytes], str]:
    if toolchain.ptxas_path() is None:
        return None, ""
    extra = settings.get("ptxas_options").split()
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "kernel.ptx")
        cubin_path = os.path.join(tmp, "kernel.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        log = toolchain.run_ptxas(ptx_path, cubin_path, target, settings.get("opt_level"), extra)
        with open(cubin_path, "rb") as f:
            return f.read(), log
