"""Run-time side of the AST rewrite: Python control flow on traced values becomes ``scf`` ops.

The rewriter (``ast_rewrite``) turns each ``if``/``for ... in range``/``while`` of a kernel into a call of one of
the functions here, with the branch or loop body as a nested function that takes and returns the variables the
body assigns. When the condition or bounds are Python values, the code runs as plain Python (compile-time
branches and loops); when they are traced, the variables that flow through become ``scf`` results and
loop-carried values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from mlir import ir
from mlir.dialects import scf

from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.language import select
from nvfly.frontend.trace import traced
from nvfly.frontend.values import Scalar, Undefined, Vector, _Traced, as_value, condition, constant, python_dtype


# ---------------------------------------------------------------------------------------------- flattening
@dataclass
class _Leaf:
    """How one Python value crosses a region boundary: as IR values (with a rebuild function) or unchanged."""
    values: list[ir.Value]
    rebuild: Optional[Callable[[Sequence[ir.Value]], Any]]  # None: a static value passed through unchanged
    static: Any = None


def _flatten(value: Any, name: str, promote_numbers: bool) -> _Leaf:
    if isinstance(value, Scalar):
        dt = value.dtype
        return _Leaf([value.value], lambda vs: Scalar(vs[0], dt))
    if isinstance(value, Vector):
        dt = value.dtype
        return _Leaf([value.value], lambda vs: Vector(vs[0], dt))
    if isinstance(value, (bool, int, float)) and promote_numbers:
        return _flatten(constant(value, python_dtype(value)), name, promote_numbers)
    if isinstance(value, (tuple, list)):
        parts = [_flatten(v, f"{name}[{i}]", promote_numbers) for i, v in enumerate(value)]
        if all(p.rebuild is None for p in parts):
            return _Leaf([], None, value)
        kind = type(value)

        def rebuild(vs: Sequence[ir.Value]) -> Any:
            out, pos = [], 0
            for p in parts:
                n = len(p.values)
                out.append(p.static if p.rebuild is None else p.rebuild(vs[pos:pos + n]))
                pos += n
            return kind(out) if kind in (tuple, list) else kind(*out)

        return _Leaf([v for p in parts for v in p.values], rebuild)
    flatten = getattr(value, "__nvfly_flatten__", None)
    if flatten is not None:
        vals, rebuild = flatten()
        return _Leaf(list(vals), rebuild)
    return _Leaf([], None, value)


def _types(leaf: _Leaf) -> list[ir.Type]:
    return [v.type for v in leaf.values]


def _match(leaf_value: Any, template: _Leaf, name: str, where: str) -> list[ir.Value]:
    """IR values of ``leaf_value`` laid out like ``template`` (Python numbers become constants of its types)."""
    if template.rebuild is None:
        if leaf_value is not template.static and leaf_value != template.static:
            raise CompileError(f"variable '{name}' is a compile-time value that {where} changes "
                               f"({template.static!r} -> {leaf_value!r}); make it a traced value before")
        return []
    if isinstance(leaf_value, (bool, int, float)) and len(template.values) == 1:
        dt = None if isinstance(template.values[0].type, ir.VectorType) else dtypes.from_mlir(
            template.values[0].type)
        if dt is not None:
            return [constant(leaf_value, dt).value]
    got = _flatten(leaf_value, name, promote_numbers=True)
    want = _types(template)
    if _types(got) != want:
        raise CompileError(f"variable '{name}' changes type in {where}: "
                           f"{_describe(want)} before, {_describe(_types(got))} after")
    return got.values


def _describe(types: Sequence[ir.Type]) -> str:
    return ", ".join(str(t) for t in types) or "no device value"


# ---------------------------------------------------------------------------------------------- if
def _is_traced(x: Any) -> bool:
    return isinstance(x, _Traced)


@traced
def if_(cond: Any, then_fn: Callable[..., tuple], else_fn: Optional[Callable[..., tuple]],
        names: Sequence[str], values: Sequence[Any]) -> tuple:
    """``if cond: then else: else`` over the variables ``names`` (their values before the statement)."""
    if not _is_traced(cond):
        branch = then_fn if cond else else_fn
        return tuple(branch(*values)) if branch is not None else tuple(values)
    c = condition(cond)
    probe = scf.IfOp(c.value, [], has_else=True)
    with ir.InsertionPoint(probe.then_block):
        then_out = tuple(then_fn(*values))
    with ir.InsertionPoint(probe.else_block):
        else_out = tuple(else_fn(*values)) if else_fn is not None else tuple(values)

    results: list[Any] = [None] * len(names)
    carried: list[tuple[int, _Leaf, list[ir.Value], list[ir.Value]]] = []
    for i, name in enumerate(names):
        t, e = then_out[i], else_out[i]
        if isinstance(t, Undefined) or isinstance(e, Undefined):
            results[i] = Undefined(name, "it is assigned in only one branch of an if on a traced condition")
            continue
        if not _is_traced(t) and not _is_traced(e) and _flatten(t, name, False).rebuild is None \
                and _flatten(e, name, False).rebuild is None and (t is e or _safe_equal(t, e)):
            results[i] = t
            continue
        if _flatten(t, name, True).rebuild is None and _flatten(e, name, True).rebuild is None:
            results[i] = Undefined(name, "the two branches of an if on a traced condition leave different "
                                         "compile-time values in it")
            continue
        # the types come from a traced side when there is one (a Python number on the other side adopts them)
        template = _flatten(e if _is_traced(e) and not _is_traced(t) else t, name, promote_numbers=True)
        with ir.InsertionPoint(probe.then_block):
            tv = _match(t, template, name, "the then-branch")
        with ir.InsertionPoint(probe.else_block):
            ev = _match(e, template, name, "the else-branch")
        carried.append((i, template, tv, ev))

    result_types = [v.type for _, _, tv, _ in carried for v in tv]
    real = scf.IfOp(c.value, result_types, has_else=True, ip=ir.InsertionPoint(probe))
    for src, dst, vals in ((probe.then_block, real.then_block, [v for *_, tv, _ in carried for v in tv]),
                           (probe.else_block, real.else_block, [v for *_, ev in carried for v in ev])):
        for op in list(src.operations):
            dst.append(op)
        with ir.InsertionPoint(dst):
            scf.YieldOp(vals)
    probe.operation.erase()
    pos = 0
    for i, template, tv, _ in carried:
        n = len(tv)
        results[i] = template.rebuild(list(real.results)[pos:pos + n]) if template.rebuild else template.static
        pos += n
    return tuple(results)


def _safe_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except CompileError:
        return False


@traced
def ifexp(cond: Any, then_fn: Callable[[], Any], else_fn: Callable[[], Any]) -> Any:
    """``a if cond else b``: a select of both values when the condition is traced."""
    if not _is_traced(cond):
        return then_fn() if cond else else_fn()
    return select(cond, then_fn(), else_fn())


@traced
def and_(lhs: Any, rhs_fn: Callable[[], Any]) -> Any:
    """``a and b``: short-circuit on Python values, ``&`` of i1 values when traced."""
    if not _is_traced(lhs):
        return rhs_fn() if lhs else lhs
    rhs = rhs_fn()
    if not _is_traced(rhs):
        return condition(lhs) if rhs else False
    return condition(lhs) & condition(rhs)


@traced
def or_(lhs: Any, rhs_fn: Callable[[], Any]) -> Any:
    """``a or b``: short-circuit on Python values, ``|`` of i1 values when traced."""
    if not _is_traced(lhs):
        return lhs if lhs else rhs_fn()
    rhs = rhs_fn()
    if not _is_traced(rhs):
        return True if rhs else condition(lhs)
    return condition(lhs) | condition(rhs)


@traced
def not_(value: Any) -> Any:
    if not _is_traced(value):
        return not value
    return ~condition(value)


# ---------------------------------------------------------------------------------------------- loops
def _carry(names: Sequence[str], values: Sequence[Any]) -> tuple[list[int], list[_Leaf]]:
    idx = [i for i, v in enumerate(values) if not isinstance(v, Undefined)]
    return idx, [_flatten(values[i], names[i], promote_numbers=True) for i in idx]


def _loop_results(names: Sequence[str], values: Sequence[Any], idx: list[int], leaves: list[_Leaf],
                  results: Sequence[ir.Value], what: str, changed: set[int]) -> tuple:
    out: list[Any] = [Undefined(n, f"it is first assigned inside a {what}; define it before the loop to carry "
                                   f"it out") for n in names]
    pos = 0
    for i, leaf in zip(idx, leaves):
        n = len(leaf.values)
        if i in changed:
            out[i] = Undefined(names[i], f"a {what} changes this compile-time value")
        else:
            out[i] = leaf.rebuild(results[pos:pos + n]) if leaf.rebuild else leaf.static
        pos += n
    return tuple(out)


def _rebuild_args(names: Sequence[str], values: Sequence[Any], idx: list[int], leaves: list[_Leaf],
                  args: Sequence[ir.Value]) -> list[Any]:
    current = list(values)
    pos = 0
    for i, leaf in zip(idx, leaves):
        n = len(leaf.values)
        current[i] = leaf.rebuild(args[pos:pos + n]) if leaf.rebuild else leaf.static
        pos += n
    return current


def _yield_values(names: Sequence[str], out: Sequence[Any], idx: list[int], leaves: list[_Leaf],
                  what: str) -> tuple[list[ir.Value], set[int]]:
    """The values a loop body yields, and the carried compile-time values it changed (undefined after it)."""
    values: list[ir.Value] = []
    changed: set[int] = set()
    for i, leaf in zip(idx, leaves):
        if leaf.rebuild is None:
            if out[i] is not leaf.static and not _safe_equal(out[i], leaf.static):
                changed.add(i)
            continue
        values.extend(_match(out[i], leaf, names[i], what))
    return values, changed


def _index_dtype(*bounds: Any) -> dtypes.DType:
    dt = dtypes.i32
    for b in bounds:
        if isinstance(b, Scalar):
            if not b.dtype.is_int or b.dtype.kind == "bool":
                raise CompileError(f"range() bounds must be integers, got {b.dtype.name}")
            if b.dtype.bits > dt.bits:
                dt = b.dtype
        elif isinstance(b, int) and not -(1 << 31) <= b < (1 << 31):
            dt = dtypes.i64
        elif not isinstance(b, int):
            raise CompileError(f"range() bounds must be integers, got {type(b).__name__}")
    return dt


@traced
def for_range(bounds: tuple, body: Callable[..., tuple], names: Sequence[str], values: Sequence[Any]) -> tuple:
    """``for i in range(*bounds): body`` as ``scf.for`` carrying the variables the body assigns."""
    if len(bounds) == 1:
        start, stop, step = 0, bounds[0], 1
    elif len(bounds) == 2:
        start, stop, step = bounds[0], bounds[1], 1
    elif len(bounds) == 3:
        start, stop, step = bounds
    else:
        raise CompileError(f"range expected 1 to 3 arguments, got {len(bounds)}")
    if isinstance(step, int) and step <= 0:
        raise CompileError("a dynamic range() needs a positive step (iterate forward and index backward, or use "
                           "nvfly.static_range for a compile-time loop)")
    dt = _index_dtype(start, stop, step)
    lb, ub, st = (as_value(b, dt) for b in (start, stop, step))
    idx, leaves = _carry(names, values)
    inits = [v for leaf in leaves for v in leaf.values]
    loop = scf.ForOp(lb.value, ub.value, st.value, inits)
    with ir.InsertionPoint(loop.body):
        iv_div = _iv_divisor(start, step, lb, st)
        iv = Scalar(loop.induction_variable, dt, iv_div)
        args = _rebuild_args(names, values, idx, leaves, list(loop.inner_iter_args))
        out = tuple(body(iv, *args))
        yielded, changed = _yield_values(names, out, idx, leaves, "the loop body")
        scf.YieldOp(yielded)
    return _loop_results(names, values, idx, leaves, list(loop.results), "dynamic for loop", changed)


def _iv_divisor(start: Any, step: Any, lb: Scalar, st: Scalar) -> int:
    import math
    ds = start if isinstance(start, int) else lb.divisor
    dstep = step if isinstance(step, int) else st.divisor
    return math.gcd(abs(ds), abs(dstep)) if (ds or dstep) else 1


@traced
def while_(cond_fn: Callable[..., Any], body: Callable[..., tuple], names: Sequence[str],
           values: Sequence[Any]) -> tuple:
    """``while cond: body``: a Python loop while the condition is a Python bool, else ``scf.while``."""
    first = cond_fn(*values)
    if not _is_traced(first):
        current = tuple(values)
        keep_going = first
        while True:
            if _is_traced(keep_going):
                raise CompileError("the condition of this while loop became a traced value after the first "
                                   "iteration: start its variables as traced values (e.g. nvfly.i32(0)) to make "
                                   "it a dynamic loop")
            if not keep_going:
                return current
            current = tuple(body(*current))
            keep_going = cond_fn(*current)
    idx, leaves = _carry(names, values)
    inits = [v for leaf in leaves for v in leaf.values]
    types = [v.type for v in inits]
    op = scf.WhileOp(types, inits)
    before = op.before.blocks.append(*types)
    after = op.after.blocks.append(*types)
    with ir.InsertionPoint(before):
        args = _rebuild_args(names, values, idx, leaves, list(before.arguments))
        c = condition(cond_fn(*args))
        scf.ConditionOp(c.value, list(before.arguments))
    with ir.InsertionPoint(after):
        args = _rebuild_args(names, values, idx, leaves, list(after.arguments))
        out = tuple(body(*args))
        yielded, changed = _yield_values(names, out, idx, leaves, "the while body")
        scf.YieldOp(yielded)
    return _loop_results(names, values, idx, leaves, list(op.results), "dynamic while loop", changed)
