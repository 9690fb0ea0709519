"""Rewrites a kernel's Python source so that its control flow can run on traced values.

- ``if``            -> ``rt.if_(cond, then_fn, else_fn, names, values)``
- ``for i in range(...)`` -> ``rt.for_range(bounds, body_fn, names, values)`` (always a dynamic ``scf.for``;
  ``nvfly.static_range`` or any other iterable stays a compile-time Python loop)
- ``while``         -> ``rt.while_(cond_fn, body_fn, names, values)``
- ``a and b`` / ``a or b`` / ``not a`` / ``x if c else y`` -> ``rt.and_`` / ``rt.or_`` / ``rt.not_`` / ``rt.ifexp``

``names`` are the variables the statement assigns (including containers assigned through ``x[i] = ...``); the
body functions take and return them, so the run time can turn them into ``scf`` results and loop-carried values.
An ``if`` whose then-branch ends in a bare ``return`` takes the rest of the block as its else-branch.
Line numbers are kept, so errors and IR locations point at the user's source.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Any, Callable

from nvfly.errors import CompileError

RT = "__nvfly_rt__"


def _rt(attr: str) -> ast.expr:
    return ast.Attribute(value=ast.Name(id=RT, ctx=ast.Load()), attr=attr, ctx=ast.Load())


class _AssignedNames(ast.NodeVisitor):
    """Names a block of statements (re)binds in its own scope, in first-assignment order."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def _add(self, name: str) -> None:
        if name not in self.names and name != RT:
            self.names.append(name)

    def _target(self, node: ast.expr) -> None:
        if isinstance(node, ast.Name):
            self._add(node.id)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                self._target(elt)
        elif isinstance(node, ast.Starred):
            self._target(node.value)
        elif isinstance(node, (ast.Subscript, ast.Attribute)):
            # x[i] = v / x.a = v mutate x: carry x so the mutation stays inside the region that made v
            base = node.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                self._add(base.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._target(t)
        self.visit(node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target)
        self.visit(node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._target(node.target)
            self.visit(node.value)

    def visit_For(self, node: ast.For) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._target(node.target)
        self.visit(node.value)

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            if item.optional_vars is not None:
                self._target(item.optional_vars)
        self.generic_visit(node)

    # other scopes
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        pass

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        pass

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        pass

    def visit_ListComp(self, node: ast.ListComp) -> None:
        pass

    visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_ListComp  # type: ignore[assignment]


def assigned_names(stmts: list[ast.stmt]) -> list[str]:
    finder = _AssignedNames()
    for s in stmts:
        finder.visit(s)
    return finder.names


class _Jumps(ast.NodeVisitor):
    """Finds return/break/continue that would leave a block (not those inside nested loops or functions)."""

    def __init__(self) -> None:
        self.found: list[ast.stmt] = []

    def visit_Return(self, node: ast.Return) -> None:
        self.found.append(node)

    def visit_Break(self, node: ast.Break) -> None:
        self.found.append(node)

    def visit_Continue(self, node: ast.Continue) -> None:
        self.found.append(node)

    def visit_For(self, node: ast.For) -> None:
        # break/continue inside an inner loop stay inside it; return still escapes
        inner = _Jumps()
        for s in node.body + node.orelse:
            inner.visit(s)
        self.found.extend(n for n in inner.found if isinstance(n, ast.Return))

    visit_While = visit_For  # type: ignore[assignment]

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        pass

    visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = visit_FunctionDef  # type: ignore[assignment]


def _jumps(stmts: list[ast.stmt]) -> list[ast.stmt]:
    finder = _Jumps()
    for s in stmts:
        finder.visit(s)
    return finder.found


def _function_def(name: str, params: list[str], body: list[ast.stmt]) -> ast.FunctionDef:
    fields: dict[str, Any] = dict(
        name=name, body=body, decorator_list=[], returns=None,
        args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=p) for p in params], kwonlyargs=[], kw_defaults=[],
                           defaults=[]))
    if "type_params" in ast.FunctionDef._fields:  # Python >= 3.12
        fields["type_params"] = []
    return ast.FunctionDef(**fields)


def _place(roots: list[Any], at: ast.AST, whole_span: bool) -> None:
    """Give generated nodes the position of the user's node they replace (user nodes keep their own).

    Statements take only its first line (so a traceback shows the ``if``/``for`` line, not its body).
    """
    end_line = at.end_lineno if whole_span else at.lineno
    end_col = at.end_col_offset if whole_span else at.col_offset
    for root in roots:
        for n in ast.walk(root):
            if "lineno" in n._attributes and getattr(n, "lineno", None) is None:
                n.lineno, n.end_lineno, n.col_offset, n.end_col_offset = at.lineno, end_line, at.col_offset, end_col


def _locate(stmts: list[ast.stmt], at: ast.stmt) -> list[ast.stmt]:
    _place(stmts, at, whole_span=False)
    return stmts


def _locate_expr(expr: ast.expr, at: ast.expr) -> ast.expr:
    _place([expr], at, whole_span=True)
    return expr


def _is_range_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range" \
        and not node.keywords


class _Rewriter(ast.NodeTransformer):
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.counter = 0

    def _error(self, node: ast.AST, message: str) -> CompileError:
        return CompileError(message, self.filename, getattr(node, "lineno", None))

    def _fresh(self, kind: str) -> str:
        self.counter += 1
        return f"__nvfly_{kind}_{self.counter}"

    # ------------------------------------------------------------------ statement lists
    def _block(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        stmts = self._early_returns(stmts)
        out: list[ast.stmt] = []
        for s in stmts:
            r = self.visit(s)
            if isinstance(r, list):
                out.extend(r)
            elif r is not None:
                out.append(r)
        return out or [ast.Pass()]

    def _early_returns(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        """``if c: ...; return`` followed by more statements becomes ``if c: ... else: <rest>``."""
        for i, s in enumerate(stmts):
            if isinstance(s, ast.If) and not s.orelse and s.body and isinstance(s.body[-1], ast.Return) \
                    and s.body[-1].value is None and i + 1 < len(stmts) and not _jumps(s.body[:-1]):
                rest = self._early_returns(stmts[i + 1:])
                body = s.body[:-1] or [ast.Pass()]
                new_if = ast.If(test=s.test, body=body, orelse=rest)
                ast.copy_location(new_if, s)
                return stmts[:i] + [new_if]
        return stmts

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.body = self._block(node.body)
        return node

    def _names_tuple(self, names: list[str], ctx: ast.expr_context) -> ast.Tuple:
        return ast.Tuple(elts=[ast.Name(id=n, ctx=ctx) for n in names], ctx=ctx)

    def _values_tuple(self, names: list[str]) -> ast.Tuple:
        # rt.get(lambda: x) yields x, or a marker when x is not bound yet
        return ast.Tuple(elts=[
            ast.Call(func=_rt("get"), args=[ast.Constant(n), ast.Lambda(
                args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
                body=ast.Name(id=n, ctx=ast.Load()))], keywords=[])
            for n in names], ctx=ast.Load())

    def _def(self, name: str, params: list[str], body: list[ast.stmt], returns: list[str]) -> ast.FunctionDef:
        ret = ast.Return(value=self._names_tuple(returns, ast.Load()))
        return _function_def(name, params, body + [ret])

    def _assign_result(self, names: list[str], call: ast.expr) -> ast.stmt:
        if not names:
            return ast.Expr(value=call)
        return ast.Assign(targets=[self._names_tuple(names, ast.Store())], value=call)

    # ------------------------------------------------------------------ if
    def visit_If(self, node: ast.If) -> Any:
        node.test = self.visit(node.test)
        if _jumps(node.body) or _jumps(node.orelse):
            # Python-only if: the branches leave the block; a traced condition gets a clear error
            node.test = ast.Call(func=_rt("static_condition"), args=[node.test, ast.Constant(
                "return/break/continue inside an if on a traced condition is not supported "
                "(only a bare `return` ending the then-branch is)")], keywords=[])
            node.body = self._block(node.body)
            node.orelse = self._block(node.orelse) if node.orelse else []
            return node
        names = assigned_names(node.body + node.orelse)
        then_name, else_name = self._fresh("then"), self._fresh("else")
        then_def = self._def(then_name, names, self._block(node.body), names)
        stmts: list[ast.stmt] = [then_def]
        else_ref: ast.expr = ast.Constant(None)
        if node.orelse:
            stmts.append(self._def(else_name, names, self._block(node.orelse), names))
            else_ref = ast.Name(id=else_name, ctx=ast.Load())
        call = ast.Call(func=_rt("if_"), args=[
            node.test, ast.Name(id=then_name, ctx=ast.Load()), else_ref,
            ast.Tuple(elts=[ast.Constant(n) for n in names], ctx=ast.Load()), self._values_tuple(names)],
            keywords=[])
        stmts.append(self._assign_result(names, call))
        return _locate(stmts, node)

    # ------------------------------------------------------------------ for
    def visit_For(self, node: ast.For) -> Any:
        if not _is_range_call(node.iter):
            node.iter = self.visit(node.iter)
            node.body = self._block(node.body)
            node.orelse = self._block(node.orelse) if node.orelse else []
            return node
        if node.orelse:
            raise self._error(node, "for-else is not supported on a dynamic range loop")
        if not isinstance(node.target, ast.Name):
            raise self._error(node, "the variable of a range() loop must be a single name")
        jumps = _jumps(node.body)
        if jumps:
            raise self._error(jumps[0], "return/break/continue is not supported in a dynamic range() loop; use "
                                        "nvfly.static_range for a compile-time loop, or a while loop with a flag")
        iv = node.target.id
        names = [n for n in assigned_names(node.body) if n != iv]
        body_name = self._fresh("body")
        body_def = self._def(body_name, [iv] + names, self._block(node.body), names)
        bounds = ast.Tuple(elts=[self.visit(a) for a in node.iter.args], ctx=ast.Load())
        call = ast.Call(func=_rt("for_range"), args=[
            bounds, ast.Name(id=body_name, ctx=ast.Load()),
            ast.Tuple(elts=[ast.Constant(n) for n in names], ctx=ast.Load()), self._values_tuple(names)],
            keywords=[])
        return _locate([body_def, self._assign_result(names, call)], node)

    # ------------------------------------------------------------------ while
    def visit_While(self, node: ast.While) -> Any:
        if node.orelse:
            raise self._error(node, "while-else is not supported in kernels")
        if _jumps(node.body):
            node.test = ast.Call(func=_rt("static_condition"), args=[self.visit(node.test), ast.Constant(
                "return/break/continue inside a while loop on a traced condition is not supported")], keywords=[])
            node.body = self._block(node.body)
            return node
        names = assigned_names(node.body)
        cond_name, body_name = self._fresh("cond"), self._fresh("body")
        cond_def = _function_def(cond_name, names, [ast.Return(value=self.visit(node.test))])
        body_def = self._def(body_name, names, self._block(node.body), names)
        call = ast.Call(func=_rt("while_"), args=[
            ast.Name(id=cond_name, ctx=ast.Load()), ast.Name(id=body_name, ctx=ast.Load()),
            ast.Tuple(elts=[ast.Constant(n) for n in names], ctx=ast.Load()), self._values_tuple(names)],
            keywords=[])
        return _locate([cond_def, body_def, self._assign_result(names, call)], node)

    # ------------------------------------------------------------------ expressions
    def _thunk(self, expr: ast.expr) -> ast.Lambda:
        return ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
                          body=expr)

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.expr:
        values = [self.visit(v) for v in node.values]
        fn = "and_" if isinstance(node.op, ast.And) else "or_"
        result = values[-1]
        for v in reversed(values[:-1]):
            result = ast.Call(func=_rt(fn), args=[v, self._thunk(result)], keywords=[])
        return _locate_expr(result, node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.expr:
        node.operand = self.visit(node.operand)
        if isinstance(node.op, ast.Not):
            return _locate_expr(ast.Call(func=_rt("not_"), args=[node.operand], keywords=[]), node)
        return node

    def visit_IfExp(self, node: ast.IfExp) -> ast.expr:
        call = ast.Call(func=_rt("ifexp"), args=[
            self.visit(node.test), self._thunk(self.visit(node.body)), self._thunk(self.visit(node.orelse))],
            keywords=[])
        return _locate_expr(call, node)

    def visit_Lambda(self, node: ast.Lambda) -> ast.Lambda:
        node.body = self.visit(node.body)
        return node


def rewrite(fn: Callable[..., Any]) -> Callable[[Any], Callable[..., Any]]:
    """Compile a rewritten copy of ``fn``; returns ``make(rt)`` that builds it with the run-time module ``rt``.

    ``make`` re-reads ``fn``'s closure cells on every call, so a trace sees their current values.
    """
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise CompileError(f"cannot read the source of {fn.__qualname__} ({exc}); kernels must be defined in a "
                           f"file") from None
    filename = fn.__code__.co_filename
    tree = ast.parse(source)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise CompileError(f"{fn.__qualname__} is not a plain function definition", filename,
                           fn.__code__.co_firstlineno)
    fdef.decorator_list = []
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)
    fdef = _Rewriter(filename).visit(fdef)
    freevars = list(fn.__code__.co_freevars)
    factory = _function_def("__nvfly_factory__", [RT] + freevars,
                            [fdef, ast.Return(value=ast.Name(id=fdef.name, ctx=ast.Load()))])
    ast.copy_location(factory, fdef)
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    flags = fn.__code__.co_flags & _FUTURE_FLAGS
    code = compile(module, filename, "exec", flags=flags, dont_inherit=True)
    factory_code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    factory_fn = types.FunctionType(factory_code, fn.__globals__, "__nvfly_factory__")

    def make(rt: Any) -> Callable[..., Any]:
        cells = [c.cell_contents for c in (fn.__closure__ or ())]
        made = factory_fn(rt, *cells)
        made.__defaults__ = fn.__defaults__
        made.__kwdefaults__ = fn.__kwdefaults__
        return made

    return make


def _future_flags() -> int:
    import __future__
    return getattr(__future__, "annotations").compiler_flag


_FUTURE_FLAGS = _future_flags()


def get(name: str, thunk: Callable[[], Any]) -> Any:
    """The value of a variable, or a marker when it is not bound yet (used by rewritten code)."""
    from nvfly.frontend.values import Undefined
    try:
        return thunk()
    except NameError:
        return Undefined(name, "it is not defined before this point")


def static_condition(cond: Any, message: str) -> Any:
    from nvfly.frontend.values import _Traced
    if isinstance(cond, _Traced):
        raise CompileError(message)
    return cond

