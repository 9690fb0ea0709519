"""flex_attention from PyTorch: eager ``flex_attention`` under ``nvfly.torch.routing()`` runs nvfly's prefill or
decode kernels, with the score/mask mods translated from the FX graphs torch hands over.

Where the call is caught: eager ``torch.nn.attention.flex_attention.flex_attention`` validates its arguments and
calls the flex_attention higher-order op (``torch._higher_order_ops.flex_attention.flex_attention``) through a
``torch.compile(backend="eager")``-wrapped function, so the op receives the mods as FX ``GraphModule``s (dynamo's
graphs: ``operator.*`` and ``torch.*`` calls; under autograd, ``create_fw_bw_graph``'s aten graphs), the captured
tensors as ``score_mod_other_buffers``/``mask_mod_other_buffers`` and the BlockMask as ``BlockMask.as_tuple()``.
``install()`` registers a ``py_impl`` of that op for the ``CUDA`` dispatch key (below autograd: a call needing
gradients runs flex's own ``FlexAttentionAutogradOp``, whose forward reaches it and whose backward is torch's,
fed the LSE nvfly returns in the op's convention, log2). Outside an enabled ``routing()`` block, when nvfly
declines and when nvfly raises, it calls the op's own ``CompositeExplicitAutograd`` kernel (``sdpa_dense``), which
is what the op ran before. ``uninstall()`` removes the registration.

Which kernel: decode for Sq <= 16, prefill otherwise. Decode's q_idx is the query's position (queries aligned to
the end of the keys), flex's the row: mods that read q_idx get ``q_idx - shift[b]`` with ``shift`` a (B,) int32
tensor of Skv - Sq (one more captured tensor; mods already capturing two, or Python-function mods, go to prefill,
whose q_idx is flex's row). No causal flag: flex says causal with its mask_mod/BlockMask. Routing rule: always
when eligible (eager flex is a dense math path that materializes the scores; nvfly's fused kernels beat it at
every size).

The mods: ``graph_callable`` turns an FX graph back into a Python function ``mod(score, b, h, q_idx, kv_idx)``
interpreting the graph node by node (``operator``/``torch``/aten calls to the same Python operations), so the same
function runs on torch tensors (the CPU tests, the references) and on nvfly's traced ``ModValue``s (the kernels).
The captured tensors are its closure cells, which ``nvfly.ops.attention.mods`` finds and passes to the kernel. One
function per graph code (structural: a recreated graph of the same code reuses the compiled kernel); its cells are
set to the call's tensors under a lock for the duration of the call.
"""
from __future__ import annotations

import functools
import logging
import operator
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from nvfly import settings
from nvfly.ops import attention
from nvfly.ops.attention.mods import MAX_CAPTURED
from nvfly.ops.attention.plan import MAX_SQ
from nvfly.ops.attention.softmax import LN2
from nvfly.ops.common.opcall import OpCalls
from nvfly.runtime.torch_args import layout_key
from nvfly.torch import routing
from nvfly.torch.gemm_ops import Decision, record

log = logging.getLogger("nvfly")

_FLOATS = (torch.bfloat16, torch.float16)
_NO_MASK_BLOCK = 1 << 30  # flex's _LARGE_SPARSE_BLOCK_SIZE: the block mask flex makes when none is given


class Unsupported(Exception):
    """A graph node ``graph_callable`` cannot translate (the reason is the message)."""


# ---------------------------------------------------------------------------------------------- FX -> callable
def _index(tensor: Any, indices: Any) -> Any:
    return tensor[tuple(indices) if isinstance(indices, (list, tuple)) else indices]


def _to(x: Any, dtype: Any = None, *_: Any, **kwargs: Any) -> Any:
    """A dtype conversion: floats stay (the kernel computes in f32), bool is ``!= 0``; integers are declined."""
    dtype = kwargs.get("dtype", dtype)
    if dtype is None or not isinstance(dtype, torch.dtype) or dtype.is_floating_point:
        return x
    if dtype == torch.bool:
        return x != 0
    if isinstance(x, Tensor) and not x.is_floating_point():
        return x.to(dtype)
    raise Unsupported(f"a conversion to {dtype}")


def _constant(value: Any) -> Callable[..., Any]:
    return lambda *_, **__: value


def _full(*args: Any, **kwargs: Any) -> Any:
    shape, value = (args + (None, None))[:2]
    if shape not in ((), [], None):
        raise Unsupported(f"a full() of shape {shape}")
    return value


def _where(cond: Any, a: Any, b: Any) -> Any:
    if isinstance(cond, bool):  # a folded condition
        return a if cond else b
    return torch.where(cond, a, b)


_METHODS: dict[str, Callable[..., Any]] = {
    "tanh": torch.tanh, "exp": torch.exp, "abs": torch.abs, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "log": torch.log, "neg": torch.neg, "clamp": torch.clamp, "where": _where,
    "__getitem__": _index, "to": _to, "float": _to, "bfloat16": _to, "half": _to,
    "new_ones": _constant(True), "new_zeros": _constant(False),
    "logical_and": operator.and_, "logical_or": operator.or_, "logical_not": operator.invert,
    # operators as methods (torch 2.11's Dynamo records ``a == b`` on tensors as ``a.__eq__(b)``)
    "__eq__": operator.eq, "__ne__": operator.ne, "__lt__": operator.lt, "__le__": operator.le,
    "__gt__": operator.gt, "__ge__": operator.ge, "__and__": operator.and_, "__or__": operator.or_,
    "__invert__": operator.invert, "__neg__": operator.neg, "__add__": operator.add, "__sub__": operator.sub,
    "__mul__": operator.mul, "__truediv__": operator.truediv, "__radd__": lambda a, b: b + a,
    "__rsub__": lambda a, b: b - a, "__rmul__": lambda a, b: b * a, "__rtruediv__": lambda a, b: b / a,
    "__rand__": lambda a, b: b & a, "__ror__": lambda a, b: b | a,
}


def _aten_table() -> dict:
    aten = torch.ops.aten
    binary = {aten.add: operator.add, aten.sub: operator.sub, aten.mul: operator.mul, aten.div: operator.truediv,
              aten.ge: operator.ge, aten.gt: operator.gt, aten.le: operator.le, aten.lt: operator.lt,
              aten.eq: operator.eq, aten.ne: operator.ne, aten.bitwise_and: operator.and_,
              aten.logical_and: operator.and_, aten.bitwise_or: operator.or_, aten.logical_or: operator.or_,
              aten.remainder: operator.mod, aten.floor_divide: operator.floordiv,
              aten.minimum: torch.minimum, aten.maximum: torch.maximum}
    unary = {aten.tanh: torch.tanh, aten.exp: torch.exp, aten.exp2: torch.exp2, aten.log: torch.log,
             aten.log2: torch.log2, aten.sqrt: torch.sqrt, aten.rsqrt: torch.rsqrt, aten.erf: torch.erf,
             aten.sin: torch.sin, aten.cos: torch.cos, aten.sigmoid: torch.sigmoid, aten.abs: torch.abs,
             aten.neg: operator.neg, aten.bitwise_not: operator.invert, aten.logical_not: operator.invert,
             aten.clone: lambda x, **_: x, aten.alias: lambda x: x, aten.detach: lambda x: x}
    table: dict = {}
    for packet, fn in {**binary, **unary}.items():
        table[packet] = fn
    table.update({aten.where: _where, aten.clamp: torch.clamp, aten.index: _index,
                  aten._to_copy: _to, aten.to: _to, aten.full: _full, aten.scalar_tensor: lambda v, **_: v,
                  aten.lift_fresh_copy: lambda x: x, aten.new_ones: _constant(True),
                  aten.new_zeros: _constant(False)})
    if hasattr(torch.ops, "prims") and hasattr(torch.ops.prims, "convert_element_type"):
        table[torch.ops.prims.convert_element_type] = _to
    return table


_ATEN: dict = {}


def _traced_torch_functions() -> dict:
    """The torch functions nvfly's ModValue implements (the mods' tracer's table)."""
    from nvfly.ops.attention import mods
    if not mods._FUNCTIONS:
        mods._FUNCTIONS.update(mods._torch_functions())
    return mods._FUNCTIONS


def _function(target: Any) -> Callable[..., Any]:
    """The Python function a ``call_function`` node's target runs as."""
    if not _ATEN:
        _ATEN.update(_aten_table())
    if isinstance(target, torch._ops.OpOverload):
        packet = target.overloadpacket
        if packet in _ATEN:
            fn = _ATEN[packet]
            if packet in (torch.ops.aten.add, torch.ops.aten.sub):
                return lambda a, b, alpha=1: fn(a, b if alpha == 1 else b * alpha)
            if packet is torch.ops.aten.div:
                def div(a: Any, b: Any, rounding_mode: Optional[str] = None) -> Any:
                    if rounding_mode is not None:
                        raise Unsupported(f"aten.div with rounding_mode={rounding_mode!r}")
                    return a / b
                return div
            return fn
        raise Unsupported(f"{target}")
    if target is operator.getitem:
        return _index
    if getattr(target, "__module__", "") in ("_operator", "operator") or target in _traced_torch_functions():
        return target
    raise Unsupported(f"{getattr(target, '__name__', target)}")


def _constant_of(gm: torch.fx.GraphModule, target: str) -> Any:
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    if isinstance(value, Tensor) and value.dim() == 0:
        return value.item()  # a folded scalar: a number of the compilation
    raise Unsupported(f"a graph attribute {target} that is not a scalar (capture tensors as inputs)")


def interpret(gm: torch.fx.GraphModule, args: tuple) -> Any:
    """Run ``gm``'s graph on ``args`` node by node with Python operations (torch tensors or ModValues alike)."""
    env: dict = {}
    inputs = iter(args)

    def load(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: env[n])

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(inputs)
        elif node.op == "get_attr":
            env[node] = _constant_of(gm, node.target)
        elif node.op == "call_function":
            env[node] = _function(node.target)(*load(node.args), **load(node.kwargs))
        elif node.op == "call_method":
            method = _METHODS.get(node.target)
            if method is None:
                raise Unsupported(f"the method .{node.target}()")
            env[node] = method(*load(node.args), **load(node.kwargs))
        elif node.op == "output":
            out = load(node.args[0])
            return out[0] if isinstance(out, (tuple, list)) else out
        else:
            raise Unsupported(f"a {node.op} node")
    raise Unsupported("a graph without output")


def check_graph(gm: Any) -> Optional[str]:
    """None when ``interpret`` can run every node of ``gm`` (a GraphModule), else what it cannot."""
    try:
        for node in gm.graph.nodes:
            if node.op == "call_function":
                _function(node.target)
            elif node.op == "call_method":
                if node.target not in _METHODS:
                    raise Unsupported(f"the method .{node.target}()")
            elif node.op == "get_attr":
                _constant_of(gm, node.target)
            elif node.op not in ("placeholder", "output"):
                raise Unsupported(f"a {node.op} node")
    except Unsupported as exc:
        return f"the mod uses {exc}, which nvfly's mods do not translate"
    return None


def reads_input(fn: Any, position: int) -> bool:
    """Whether the mod (a GraphModule, or a Python function: assumed to) uses its ``position``-th argument."""
    if not isinstance(fn, torch.fx.GraphModule):
        return True
    placeholders = [n for n in fn.graph.nodes if n.op == "placeholder"]
    return position < len(placeholders) and bool(placeholders[position].users)


def _is_identity_score(gm: Any) -> bool:
    """Whether a score_mod is flex's default (its ``_identity``, or a graph returning its score input)."""
    if not isinstance(gm, torch.fx.GraphModule):
        from torch.nn.attention import flex_attention as flex
        return gm is getattr(flex, "_identity", None)
    nodes = list(gm.graph.nodes)
    out = nodes[-1]
    return out.op == "output" and _first(out.args[0]) is nodes[0] and nodes[0].op == "placeholder"


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) else x


_FACTORY_LOCK = threading.Lock()
_CALLABLES: dict = {}
CALL_LOCK = threading.RLock()  # held while a call's closure cells hold its buffers


def mod_function(kind: str, evaluate: Callable[[tuple], Any], count: int, shifted: bool) -> Callable[..., Any]:
    """A function of the mod's signature (a score_mod when ``kind`` is "score", else a mask_mod) returning
    ``evaluate`` of its arguments followed by its ``count`` buffers, the closure cells buffer0/buffer1 (set per call:
    ``_set_buffers``); ``shifted``: ``evaluate`` sees ``q_idx - shift[b]`` (decode's positions back to flex's rows;
    the cell ``shift`` holds a (B,) int32 tensor of Skv - Sq, a kernel input like the buffers). Eager routing's
    functions interpret an FX graph (``graph_callable``), the compiled op's run its code (``flex_compile``)."""
    buffer0 = buffer1 = shift = None  # noqa: F841 - the cells; set per call (_set_buffers)

    if kind == "score":
        def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - flex's signature
            row = q_idx - shift[b] if shifted else q_idx
            return evaluate((score, b, h, row, kv_idx) + (buffer0, buffer1)[:count])
        return score_mod

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - flex's signature
        row = q_idx - shift[b] if shifted else q_idx
        return evaluate((b, h, row, kv_idx) + (buffer0, buffer1)[:count])
    return mask_mod


def _set_buffers(fn: Callable[..., Any], buffers: tuple, shift: Any = None) -> None:
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    cells["buffer0"].cell_contents = buffers[0] if buffers else None
    cells["buffer1"].cell_contents = buffers[1] if len(buffers) > 1 else None
    if "shift" in cells:
        cells["shift"].cell_contents = shift


def graph_callable(kind: str, gm: Any, buffers: tuple = (), shift: Any = None) -> Callable[..., Any]:
    """``gm`` (a score_mod graph when ``kind`` is "score", a mask_mod graph for "mask") as a Python function of
    flex's signature that captures ``buffers`` (at most ``MAX_CAPTURED`` tensors, appended to the graph's inputs);
    with ``shift`` (a (B,) int32 tensor) the graph sees ``q_idx - shift[b]`` (for decode, whose q_idx is the
    position). A plain Python function without buffers or shift is returned as it is. Call under ``CALL_LOCK``: the
    function is shared by every graph of the same code and its cells hold the latest call's tensors."""
    if not isinstance(gm, torch.fx.GraphModule):
        if buffers or shift is not None:
            raise Unsupported("a Python mod with separate buffers or a shifted q_idx")
        return gm
    if len(buffers) > MAX_CAPTURED:
        raise Unsupported(f"{len(buffers)} captured tensors (nvfly's kernels take {MAX_CAPTURED})")
    key = (kind, gm.code, len(buffers), shift is not None, tuple(_constant_key(gm)))
    with _FACTORY_LOCK:
        fn = _CALLABLES.get(key)
        if fn is None:
            fn = _CALLABLES[key] = mod_function(kind, functools.partial(interpret, gm), len(buffers),
                                                shift is not None)
    _set_buffers(fn, buffers, shift)
    return fn


def _constant_key(gm: torch.fx.GraphModule) -> list:
    return [(n.target, _constant_of(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"]


# ---------------------------------------------------------------------------------------------- the call
@dataclass(frozen=True)
class FlexCall:
    """What the flex_attention op was called with, in nvfly's terms: (B, S, H, D) views, the mods (graphs or
    functions), the BlockMask (None for flex's no-mask default) and the LSE / max requests."""
    q: Tensor
    k: Tensor
    v: Tensor
    score_mod: Any
    mask_mod: Any
    block_mask: Any
    scale: float
    score_buffers: tuple
    mask_buffers: tuple
    needs_max: bool


def _block_mask(block_mask: tuple) -> Any:
    """A BlockMask from ``BlockMask.as_tuple()`` (its layout: Q_LEN, KV_LEN, kv_num_blocks, kv_indices,
    full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, [2.13: four
    dq_* orders,] Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod), None for flex's no-mask default."""
    from torch.nn.attention.flex_attention import BlockMask
    q_block, kv_block = int(block_mask[-3]), int(block_mask[-2])
    if q_block == _NO_MASK_BLOCK and kv_block == _NO_MASK_BLOCK:
        return None
    mask = BlockMask.__new__(BlockMask)
    (mask.seq_lengths, (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
                        mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)) = (
        (int(block_mask[0]), int(block_mask[1])), block_mask[2:10])
    mask.BLOCK_SIZE = (q_block, kv_block)
    mask.mask_mod = block_mask[-1]
    return mask


def flex_call(query: Tensor, key: Tensor, value: Tensor, score_mod: Any, block_mask: tuple, scale: float,
              kernel_options: dict, score_mod_other_buffers: tuple = (),
              mask_mod_other_buffers: tuple = ()) -> FlexCall:
    mask = _block_mask(block_mask)
    return FlexCall(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                    None if _is_identity_score(score_mod) else score_mod,
                    None if mask is None else mask.mask_mod, mask, float(scale),
                    tuple(score_mod_other_buffers), tuple(mask_mod_other_buffers),
                    bool(kernel_options.get("OUTPUT_MAX", False)))


def _kernel_mods(call: FlexCall, decode: bool = False) -> tuple[Any, Any, Any]:
    """(score_mod, mask_mod, block_mask) as nvfly's functions take them: translated callables, the block mask with
    the translated mask_mod as its own (None when flex's mask has no mask_mod of its own). ``decode``: mods that
    read q_idx get it shifted back from decode's positions to flex's rows."""
    shift = None
    if decode and _reads_q_idx(call):
        q = call.q
        shift = torch.full((q.shape[0],), call.k.shape[1] - q.shape[1], dtype=torch.int32, device=q.device)
    score = None if call.score_mod is None else graph_callable("score", call.score_mod, call.score_buffers, shift)
    mask = None
    block_mask = call.block_mask
    if block_mask is not None:
        mask = graph_callable("mask", call.mask_mod, call.mask_buffers, shift) if _masks(call.mask_mod) else None
        block_mask = _with_mask_mod(block_mask, mask)
    return score, mask, block_mask


def _masks(mask_mod: Any) -> bool:
    """Whether a mask_mod (graph or function) may drop keys: flex's noop_mask graph returns a constant True."""
    from torch.nn.attention.flex_attention import noop_mask
    if mask_mod is noop_mask:
        return False
    if isinstance(mask_mod, torch.fx.GraphModule):
        out = _first(list(mask_mod.graph.nodes)[-1].args[0])
        if not isinstance(out, torch.fx.Node):
            return out is not True
        ones = out.target == "new_ones" if out.op == "call_method" else (
            isinstance(out.target, torch._ops.OpOverload) and out.target.overloadpacket is torch.ops.aten.new_ones)
        return not ones
    return True


def _with_mask_mod(block_mask: Any, mask: Any) -> Any:
    from torch.nn.attention.flex_attention import BlockMask, noop_mask
    copy = BlockMask.__new__(BlockMask)
    copy.__dict__.update(block_mask.__dict__)
    copy.mask_mod = noop_mask if mask is None else mask
    return copy


def _reads_q_idx(call: FlexCall) -> bool:
    mask_reads = call.block_mask is not None and _masks(call.mask_mod) and reads_input(call.mask_mod, 2)
    return mask_reads or (call.score_mod is not None and reads_input(call.score_mod, 3))


def _uses_decode(call: FlexCall) -> bool:
    """Decode for Sq <= 16. Its q_idx is the query's position, flex's the row: mods that read q_idx get a shifted
    q_idx (``_kernel_mods``), which needs graphs (not Python functions) and one more captured tensor."""
    if call.q.shape[1] > MAX_SQ:
        return False
    if not _reads_q_idx(call):
        return True
    mods = [m for m in (call.score_mod, call.mask_mod if call.block_mask is not None and _masks(call.mask_mod)
                        else None) if m is not None]
    captured = len({id(t) for t in call.score_buffers + call.mask_buffers})
    return all(isinstance(m, torch.fx.GraphModule) for m in mods) and captured < MAX_CAPTURED


def reason(call: FlexCall, grad: bool) -> Optional[str]:
    """None when nvfly computes this call, else why torch's flex runs it."""
    if call.q.device.type != "cuda":
        return f"q is on {call.q.device.type}, not CUDA"
    return _reason(call, grad, on_device=True)


def reason_on_meta(call: FlexCall) -> Optional[str]:
    """``reason`` for meta tensors of the call's shapes and strides (Inductor's lowering; no device, no addresses:
    the strides' 16-byte rule is checked here, the base addresses' at run time)."""
    for name, t in (("q", call.q), ("k", call.k), ("v", call.v)):
        if any(s * t.element_size() % 16 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
            return f"{name}: strides {tuple(t.stride())} are not multiples of 16 bytes (TMA, cp.async)"
    return _reason(call, False, on_device=False)


def _reason(call: FlexCall, grad: bool, on_device: bool) -> Optional[str]:
    q, k, v = call.q, call.k, call.v
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: nvfly takes bfloat16 or float16, all alike"
    if call.needs_max:
        return "max scores are requested (return_aux max_scores): nvfly returns the LSE only"
    if k.shape[0] != q.shape[0]:
        return f"k has batch {k.shape[0]}, q {q.shape[0]} (flex's broadcast KV batch is not supported)"
    if grad and any(isinstance(t, Tensor) and t.requires_grad for t in call.score_buffers):
        return "a captured tensor of the score_mod requires grad (its gradient is torch's flex's)"
    for name, mod in (("score_mod", call.score_mod), ("mask_mod", call.mask_mod if call.block_mask is not None
                                                         and _masks(call.mask_mod) else None)):
        if isinstance(mod, torch.fx.GraphModule):
            bad = check_graph(mod)
            if bad:
                return f"{name}: {bad}"
    for name, buffers in (("score_mod", call.score_buffers), ("mask_mod", call.mask_buffers)):
        if len(buffers) > MAX_CAPTURED:
            return f"{name} captures {len(buffers)} tensors (nvfly's kernels take {MAX_CAPTURED})"
    if len(call.score_buffers) + len(call.mask_buffers) > MAX_CAPTURED:
        return (f"the mods capture {len(call.score_buffers) + len(call.mask_buffers)} tensors (nvfly's kernels "
                f"take {MAX_CAPTURED})")
    off_device = f"q is on {q.device.type}, not CUDA"
    with CALL_LOCK:
        try:
            score, mask, block_mask = _kernel_mods(call)
        except Unsupported as exc:
            return f"the mods cannot be translated: {exc}"
        if _uses_decode(call):
            score, _, decode_mask = _kernel_mods(call, decode=True)
            declined = attention.eligibility(q, k, v, score_mod=score, block_mask=decode_mask)
            if declined is None or (not on_device and declined == off_device):
                return None
            decode_reason = f"decode declines ({declined}); "
        else:
            decode_reason = ""
        declined = attention.prefill_eligibility(q, k, v, scale=call.scale, score_mod=score, block_mask=block_mask)
    if declined is None or (not on_device and declined == off_device):
        return None
    return f"{decode_reason}nvfly's prefill declines: {declined}"


def run(call: FlexCall) -> tuple[Tensor, Tensor, Tensor]:
    """(out (B, Hq, Sq, Dv), lse (B, Hq, Sq) float32 in log2 — the flex op's convention for its non-FLASH
    backends, which flex's wrapper multiplies by ln 2 and its backward reads —, an empty max_scores)."""
    with CALL_LOCK:
        decode = _uses_decode(call)
        score, _, block_mask = _kernel_mods(call, decode)
        if decode:
            out, lse = attention.decode(call.q, call.k, call.v, scale=call.scale, causal=False, score_mod=score,
                                        block_mask=block_mask, return_lse=True, validate=False)
        else:
            out, lse = attention.prefill(call.q, call.k, call.v, scale=call.scale, score_mod=score,
                                         block_mask=block_mask, return_lse=True, validate=False)
    return out.transpose(1, 2), lse / LN2, lse.new_empty(0)


# ---------------------------------------------------------------------------------------------- the route
_DECIDED: OpCalls[tuple[Optional[str]]] = OpCalls()  # signature -> (why torch's flex runs it, or None)


def _signature(call: FlexCall, grad: bool) -> tuple:
    mask = call.block_mask
    tables = () if mask is None else (mask.BLOCK_SIZE, tuple(layout_key(t) for t in (
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)))
    return (layout_key(call.q), layout_key(call.k), layout_key(call.v), _mod_key(call.score_mod),
            _mod_key(call.mask_mod if mask is not None else None), tables, call.needs_max, grad,
            tuple(layout_key(t) if isinstance(t, Tensor) else t for t in call.score_buffers + call.mask_buffers))


def _mod_key(mod: Any) -> Any:
    return mod.code if isinstance(mod, torch.fx.GraphModule) else mod


def _record(call: FlexCall, why: Optional[str]) -> None:
    q, k, v = call.q, call.k, call.v
    shape = (q.shape[0], q.shape[2], k.shape[2], q.shape[1], k.shape[1], q.shape[3], v.shape[3])
    kernel = "decode" if why is None and _uses_decode(call) else "prefill"
    problem = (f"q {tuple(q.transpose(1, 2).shape)} k {tuple(k.transpose(1, 2).shape)} {q.dtype} on {q.device} "
               f"score_mod={'yes' if call.score_mod is not None else 'no'} "
               f"block_mask={'no' if call.block_mask is None else call.block_mask.BLOCK_SIZE}")
    record(Decision("eager", "flex_attention", shape, problem, reason=why, candidates=() if why else (kernel,)))


def decide(call: FlexCall) -> Optional[str]:
    """The routing decision for ``call`` (remembered and recorded once per signature)."""
    if any(type(t) is not Tensor for t in (call.q, call.k, call.v)):  # FakeTensor, FunctionalTensor: a trace
        return f"q is a {type(call.q).__name__}, not a plain tensor (traced calls keep torch's flex)"
    grad = torch.is_grad_enabled()
    signature = _signature(call, grad)
    decided = _DECIDED.get(signature)
    if decided is None:
        try:
            why = reason(call, grad)
        except Exception as exc:  # a broken check declines
            why = f"eligibility check raised {type(exc).__name__}: {exc}"
        decided = (why,)
        _DECIDED.remember(signature, decided)
        _record(call, why)
    return decided[0]


def forget_decisions() -> None:
    """Decide every flex signature again (tests start from none)."""
    _DECIDED.clear()


def _routed(torch_kernel: Callable[..., Any]) -> Callable[..., Any]:
    def flex_attention_nvfly(*args: Any) -> Any:
        if routing.routing_enabled():
            call = None
            try:
                call = flex_call(*args)
                why = decide(call)
            except Exception as exc:
                why = f"reading the call raised {type(exc).__name__}: {exc}"
            if why is None:
                try:
                    return run(call)
                except Exception as exc:  # an nvfly failure never breaks the model: torch's flex runs it
                    why = f"nvfly raised {type(exc).__name__}: {exc}"
                    log.warning("nvfly: flex_attention fell back to torch: %s", why)
                    try:  # decline this signature from now on
                        _DECIDED.remember(_signature(call, torch.is_grad_enabled()), (why,))
                        _record(call, why)
                    except Exception:  # noqa: BLE001 - bookkeeping never breaks the call
                        log.debug("nvfly: flex_attention: recording the failure failed", exc_info=True)
            else:
                level = logging.INFO if settings.get("debug") else logging.DEBUG
                log.log(level, "nvfly: flex_attention stays on torch: %s", why)
        return torch_kernel(*args)
    return flex_attention_nvfly


_INSTALLED: dict = {}  # dispatch key -> the kernel registered there


def _hop() -> Any:
    from torch._higher_order_ops.flex_attention import flex_attention
    return flex_attention


def install(keys: tuple = ("CUDA",)) -> None:
    """Register the route on the flex_attention op for ``keys`` (idempotent; ``routing()``/``install_routing``
    call it). It falls through to the op's CompositeExplicitAutograd kernel when routing is off."""
    from torch._C import DispatchKey
    try:
        hop = _hop()
        torch_kernel = hop.py_kernels[DispatchKey.CompositeExplicitAutograd]
    except (ImportError, AttributeError, KeyError) as exc:  # a torch without flex_attention: nothing to route
        log.debug("nvfly: not routing flex_attention: %s", exc)
        return
    for name in keys:
        key = getattr(DispatchKey, name)
        if key in _INSTALLED or key in hop.py_kernels:
            continue
        kernel = _routed(torch_kernel)
        hop.py_impl(key)(kernel)
        _INSTALLED[key] = kernel


def uninstall() -> None:
    """Remove the route: the op dispatches as torch shipped it."""
    hop = _hop()
    for key, kernel in list(_INSTALLED.items()):
        if hop.py_kernels.get(key) is kernel:
            del hop.py_kernels[key]
        del _INSTALLED[key]
    cache = getattr(hop, "_dispatch_cache", None)
    if cache is not None:
        cache.clear()


def installed() -> bool:
    return bool(_INSTALLED)


__all__ = ["FlexCall", "Unsupported", "check_graph", "decide", "flex_call", "forget_decisions", "graph_callable",
           "install", "installed", "interpret", "reason", "reason_on_meta", "run", "uninstall"]

