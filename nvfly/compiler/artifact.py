"""A compiled kernel: its IR at each stage, PTX, cubin, resource report and everything a launch needs."""
from __future__ import annotations

import collections
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from nvfly.compiler import toolchain
from nvfly.frontend.function import AbiParam

# ptxas warnings that signal a slow kernel (serialised wgmma, ignored setmaxnreg, spills)
PERFORMANCE_WARNINGS = ("C7515", "C7511", "C7520", "C7508", "C7509", "C7510")


@dataclass
class Resources:
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    static_smem_bytes: int = 0
    barriers: int = 0

    @staticmethod
    def from_ptxas_log(log: str) -> "Resources":
        r = Resources()
        m = re.search(r"Used (\d+) registers", log)
        if m:
            r.registers = int(m.group(1))
        m = re.search(r"used (\d+) barriers", log)
        if m:
            r.barriers = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", log)
        if m:
            r.static_smem_bytes = int(m.group(1))
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        if m:
            r.stack_bytes, r.spill_stores, r.spill_loads = (int(g) for g in m.groups())
        return r


@dataclass
class CompiledKernel:
    """Everything about one compiled kernel; produced without a GPU, loaded by the runtime."""
    name: str
    target: str
    key: str
    abi: list[AbiParam]
    block: tuple[int, int, int]
    cluster: Optional[tuple[int, int, int]]
    dynamic_smem_bytes: int
    mlir: str
    llvm_mlir: str
    ptx: str
    cubin: Optional[bytes]
    ptxas_log: str = ""
    resources: Resources = field(default_factory=Resources)
    cooperative: bool = False  # launched with every block resident at once (``nvfly.cooperative``)
    dependent: bool = False  # launched as a programmatic dependent of the stream's previous kernel
    _sass: Optional[str] = field(default=None, repr=False)

    @property
    def warnings(self) -> list[str]:
        """ptxas's performance warnings (e.g. C7515 serialised wgmma), one line each."""
        return [line.strip() for line in self.ptxas_log.splitlines()
                if any(code in line for code in PERFORMANCE_WARNINGS)]

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def sass(self) -> str:
        """The cubin's SASS (runs cuobjdump once)."""
        if self._sass is None:
            if self.cubin is None:  # compiled without ptxas (the cache key says so): say how to get it
                raise toolchain.missing("ptxas")
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "kernel.cubin")
                with open(path, "wb") as f:
                    f.write(self.cubin)
                self._sass = toolchain.disassemble(path)
        return self._sass

    def sass_opcodes(self) -> collections.Counter:
        """Counts of SASS instructions by full opcode (e.g. ``LDG.E.128``, ``HGMMA.64x128x16.F32.BF16``)."""
        counts: collections.Counter = collections.Counter()
        for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.x]+)", self.sass()):
            counts[m.group(1)] += 1
        return counts

    def count(self, prefix: str) -> int:
        """How many SASS instructions start with ``prefix`` (e.g. ``"HGMMA"``, ``"LDG.E.128"``)."""
        return sum(n for op, n in self.sass_opcodes().items() if op == prefix or op.startswith(prefix + "."))

    def summary(self) -> dict[str, Any]:
        r = self.resources
        return {"name": self.name, "target": self.target, "threads": self.threads,
                "registers": r.registers, "spills": r.spill_stores + r.spill_loads, "stack": r.stack_bytes,
                "smem_static": r.static_smem_bytes, "smem_dynamic": self.dynamic_smem_bytes,
                "ptx_lines": self.ptx.count("\n"), "warnings": self.warnings}

    # ------------------------------------------------------------------ (de)serialisation for the disk cache
    def meta(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "key": self.key,
                "abi": [asdict(p) for p in self.abi], "block": list(self.block),
                "cluster": list(self.cluster) if self.cluster else None,
                "dynamic_smem_bytes": self.dynamic_smem_bytes, "ptxas_log": self.ptxas_log,
                "resources": asdict(self.resources), "cooperative": self.cooperative,
                "dependent": self.dependent}

    def files(self) -> dict[str, bytes]:
        out = {"meta.json": json.dumps(self.meta(), sort_keys=True).encode(),
               "kernel.mlir": self.mlir.encode(), "kernel.llvm.mlir": self.llvm_mlir.encode(),
               "kernel.ptx": self.ptx.encode()}
        if self.cubin is not None:
            out["kernel.cubin"] = self.cubin
        return out

    @staticmethod
    def from_files(files: dict[str, bytes]) -> "CompiledKernel":
        meta = json.loads(files["meta.json"])
        abi = [AbiParam(p["kind"], p["dtype"], _tuplify(p["source"])) for p in meta["abi"]]
        return CompiledKernel(
            name=meta["name"], target=meta["target"], key=meta["key"], abi=abi, block=tuple(meta["block"]),
            cluster=tuple(meta["cluster"]) if meta["cluster"] else None,
            dynamic_smem_bytes=meta["dynamic_smem_bytes"], mlir=files["kernel.mlir"].decode(),
            llvm_mlir=files["kernel.llvm.mlir"].decode(), ptx=files["kernel.ptx"].decode(),
            cubin=files.get("kernel.cubin"), ptxas_log=meta["ptxas_log"], resources=Resources(**meta["resources"]),
            cooperative=meta.get("cooperative", False), dependent=meta.get("dependent", False))


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x
