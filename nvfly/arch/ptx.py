"""Emitting PTX instructions from kernels: inline assembly with typed operands, and shared-memory addresses."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from mlir import ir
from mlir.dialects import llvm

from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.tensor import Tensor
from nvfly.frontend.values import Scalar, as_value

_CONSTRAINT = {8: "h", 16: "h", 32: "r", 64: "l"}


def _constraint(dtype: DType) -> str:
    if dtype == dtypes.f32:
        return "f"
    if dtype == dtypes.f64:
        return "d"
    return _CONSTRAINT[max(16, dtype.bits)]


def _operand(value: Any) -> tuple[ir.Value, str]:
    if isinstance(value, ir.Value):
        t = value.type
        if isinstance(t, ir.IntegerType):
            return value, _CONSTRAINT[max(16, ir.IntegerType(t).width)]
        if str(t).startswith("!llvm.ptr"):
            return value, "l"
        raise CompileError(f"inline PTX operand of type {t} is not supported")
    v = as_value(value, dtypes.i32 if isinstance(value, int) else None)
    return v.value, _constraint(v.dtype)


def asm(text: str, inputs: Sequence[Any] = (), result: Optional[DType] = None, side_effects: bool = True) -> Any:
    """Emit one PTX snippet. Operands are ``$0..``: the result first (if any), then the inputs.

    Inputs may be Scalars, Python ints (as i32) or raw MLIR values (integers or pointers).
    """
    operands: list[ir.Value] = []
    constraints: list[str] = []
    if result is not None:
        constraints.append("=" + _constraint(result))
    for x in inputs:
        v, c = _operand(x)
        operands.append(v)
        constraints.append(c)
    res_type = result.mlir() if result is not None else None
    out = llvm.inline_asm(res_type, operands, text, ",".join(constraints), has_side_effects=side_effects)
    return Scalar(out, result) if result is not None else None


def asm_multi(text: str, results: Sequence[DType], inputs: Sequence[Any] = (), side_effects: bool = True,
              tied: bool = False) -> list[Scalar]:
    """Like ``asm`` with several results (``$0..$r-1``), then the inputs. With ``tied``, the last r inputs
    are the initial values of the results (read-write operands, e.g. accumulators)."""
    constraints = ["=" + _constraint(d) for d in results]
    operands: list[ir.Value] = []
    body = list(inputs)
    if tied:
        body, initial = body[:-len(results)], body[-len(results):]
    for x in body:
        v, c = _operand(x)
        operands.append(v)
        constraints.append(c)
    if tied:
        for i, (x, d) in enumerate(zip(initial, results)):
            operands.append(as_value(x, d).value)
            constraints.append(str(i))
    struct = ir.Type.parse("!llvm.struct<(" + ", ".join(d.mlir_name for d in results) + ")>")
    out = llvm.inline_asm(struct, operands, text, ",".join(constraints), has_side_effects=side_effects)
    return [Scalar(llvm.extractvalue(d.mlir(), out, [i]), d) for i, d in enumerate(results)]


def smem_address(target: Any, offset_bytes: Any = 0) -> Scalar:
    """The 32-bit shared-memory address of a shared Tensor (or of a ``!llvm.ptr<3>``), plus ``offset_bytes``."""
    if isinstance(target, Tensor):
        if target.space != "shared":
            raise CompileError(f"expected a shared-memory tensor, got one in {target.space} memory")
        ptr = target.ptr
    else:
        ptr = target
    address = Scalar(llvm.ptrtoint(ir.IntegerType.get_signless(32), ptr), dtypes.i32,
                     target.align if isinstance(target, Tensor) else 1)
    if isinstance(offset_bytes, int) and offset_bytes == 0:
        return address
    return address + offset_bytes
