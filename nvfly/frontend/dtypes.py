"""Scalar element types.

A ``DType`` is a frozen descriptor: its name, bit width and kind, the MLIR type it lowers to, and the name of the
matching torch dtype (by name only: the front end never imports torch). Calling a dtype converts a traced value
(``nvfly.f32(x)``) or makes a constant (``nvfly.i32(7)``); a dtype is also the annotation of a scalar kernel
parameter (``n: nvfly.i32``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlir import ir


@dataclass(frozen=True)
class DType:
    name: str
    bits: int
    kind: str  # "int" (signed), "uint", "float" or "bool"
    torch_name: str
    mlir_name: str

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind in ("int", "uint", "bool")

    @property
    def is_signed(self) -> bool:
        return self.kind == "int"

    @property
    def is_fp8(self) -> bool:
        return self.is_float and self.bits == 8

    @property
    def itemsize(self) -> int:
        return max(1, self.bits // 8)

    def mlir(self) -> ir.Type:
        """The MLIR type (needs an active ``ir.Context``)."""
        return ir.Type.parse(self.mlir_name)

    def __call__(self, value: Any) -> Any:
        from nvfly.frontend.values import convert
        return convert(value, self)

    def __repr__(self) -> str:
        return f"nvfly.{self.name}"

    def __reduce__(self) -> str:
        return self.name


i1 = DType("i1", 1, "bool", "bool", "i1")
i8 = DType("i8", 8, "int", "int8", "i8")
i16 = DType("i16", 16, "int", "int16", "i16")
i32 = DType("i32", 32, "int", "int32", "i32")
i64 = DType("i64", 64, "int", "int64", "i64")
u8 = DType("u8", 8, "uint", "uint8", "i8")
u32 = DType("u32", 32, "uint", "uint32", "i32")
f16 = DType("f16", 16, "float", "float16", "f16")
bf16 = DType("bf16", 16, "float", "bfloat16", "bf16")
f32 = DType("f32", 32, "float", "float32", "f32")
f64 = DType("f64", 64, "float", "float64", "f64")
f8e4m3 = DType("f8e4m3", 8, "float", "float8_e4m3fn", "f8E4M3FN")
f8e5m2 = DType("f8e5m2", 8, "float", "float8_e5m2", "f8E5M2")

ALL: tuple[DType, ...] = (i1, i8, i16, i32, i64, u8, u32, f16, bf16, f32, f64, f8e4m3, f8e5m2)
BY_NAME: dict[str, DType] = {d.name: d for d in ALL}
BY_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in ALL}


def from_torch_name(name: str) -> DType:
    """The nvfly dtype of a torch dtype name such as ``"bfloat16"`` (``str(torch.bfloat16)`` minus ``torch.``)."""
    try:
        return BY_TORCH_NAME[name]
    except KeyError:
        raise TypeError(f"torch dtype {name!r} has no nvfly equivalent "
                        f"(supported: {', '.join(sorted(BY_TORCH_NAME))})") from None


def from_mlir(t: ir.Type) -> DType:
    text = str(t)
    for d in ALL:
        if d.mlir_name == text and d.kind != "uint":
            return d
    raise TypeError(f"MLIR type {text} has no nvfly dtype")


def promote(a: DType, b: DType) -> DType:
    """The common type of a binary operation (C-like: floats win, then the wider type; f16 with bf16 gives f32)."""
    if a == b:
        return a
    if a.is_float and b.is_float:
        if a.bits == b.bits:
            return f32
        return a if a.bits > b.bits else b
    if a.is_float:
        return a
    if b.is_float:
        return b
    if a.kind == "bool":
        return b
    if b.kind == "bool":
        return a
    return a if a.bits >= b.bits else b
