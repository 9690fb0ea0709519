"""SDPA inside ``torch.compile`` on nvfly: graph passes (docs/torch-attention.md).

    nvfly.torch.install()                        # (also nvfly's max-autotune GEMM choices)
    model = torch.compile(model)                 # any mode: SDPA nodes nvfly wins become nvfly's custom ops

When Dynamo and AOTAutograd trace ``F.scaled_dot_product_attention``, torch's composite picks a backend on the fake
inputs and the post-grad graph holds its kernel: ``aten._scaled_dot_product_flash_attention``,
``_scaled_dot_product_efficient_attention`` or ``_scaled_dot_product_cudnn_attention`` on (B, H, S, D) tensors. The
pass (``config.post_grad_custom_pre_pass``: before Inductor's own post-grad passes, and apart from the
``post_grad_custom_post_pass`` slot nvfly's GEMM hooks may use; chained with any pass already there) replaces each
such node whose only used output is the attention output (an inference graph; a training graph also saves the
logsumexp for torch's backward and keeps its kernel) and which the eager rule accepts — the same ``_sdpa_reason``, with the backend torch
picked read from the node, its attention bias as the mask — by ``torch.ops.nvfly.attention_decode`` (Sq <= 16) or
``attention_prefill`` (top-left causal) on the (B, S, H, D) views, the bias as the op's ``attn_mask``, and a
permute back. Inductor emits the custom op as an extern call
(its fake gives the shapes), so the compiled code, FX-graph cache and AOTInductor call nvfly by name. A node left
to torch is logged with its reason and recorded (``Decision("inductor", "sdpa", ...)``, shown by ``explain_sdpa``).
At run time the ops compute a call nvfly declines or fails on with the float32 reference in torch (never an error).

Training graphs: a pre-grad pass (``config.pre_grad_custom_pass``) replaces the ``F.scaled_dot_product_attention``
calls whose inputs require grad, and which the eager rule accepts with gradients, by ``nvfly.attention_prefill``
before AOTAutograd: the joint graph then holds nvfly's forward and the op's registered backward, torch's flash or
memory-efficient backward kernel on nvfly's LSE (as the eager route runs them).

The passes' ``uuid()`` (nvfly's toolchain fingerprint and the rewrite's version, plus the chained passes') is in the
FX-graph cache key, so a cached graph is reused only with the same nvfly.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import operator
import warnings
from typing import Any, Iterator, Optional

import torch
from torch._inductor import config as inductor_config

from nvfly import settings
from nvfly.compiler import toolchain
from nvfly.ops.attention.plan import MAX_SQ
from nvfly.torch import attention_ops
from nvfly.torch.gemm_ops import Decision, record
from nvfly.torch.inductor import ChainedPass

log = logging.getLogger("nvfly")

VERSION = 1  # of the rewrite: part of uuid()
SWAP_S_H = [0, 2, 1, 3]  # (B, H, S, D) <-> (B, S, H, D)
aten = torch.ops.aten
# the fused SDPA kernels a traced SDPA decomposes to -> torch's name of that backend
FUSED = {
    aten._scaled_dot_product_flash_attention.default: "flash",
    aten._scaled_dot_product_efficient_attention.default: "efficient",
    aten._scaled_dot_product_cudnn_attention.default: "cudnn",
}


class SdpaPass(ChainedPass):
    """The post-grad pass: runs the pass(es) it replaced, then rewrites the SDPA nodes nvfly wins."""

    def run(self, graph: torch.fx.Graph) -> None:
        rewrite(graph)

    def own_uuid(self) -> str:
        return "nvfly-sdpa-" + _fingerprint()


class SdpaTrainingPass(ChainedPass):
    """The pre-grad pass: runs the pass(es) it replaced, then rewrites the SDPA calls that need gradients and that
    nvfly wins (``rewrite_training``)."""

    def run(self, graph: torch.fx.Graph) -> None:
        rewrite_training(graph)

    def own_uuid(self) -> str:
        return "nvfly-sdpa-training-" + _fingerprint()


def _fingerprint() -> str:
    """What decides the rewritten graphs: nvfly's toolchain and sources, codegen settings, the rewrite's version."""
    blob = json.dumps([toolchain.fingerprint(), settings.codegen_fingerprint(), VERSION], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


_SLOTS = (("post_grad_custom_pre_pass", SdpaPass), ("pre_grad_custom_pass", SdpaTrainingPass))


def install() -> None:
    """Rewrite SDPA in graphs compiled from now on (idempotent)."""
    for slot, kind in _SLOTS:
        if _find(slot, kind) is None:
            setattr(inductor_config, slot, kind(getattr(inductor_config, slot)))


def uninstall() -> None:
    """Stop rewriting (graphs compiled before keep calling nvfly's ops). Removes the passes wherever they sit in the
    chains of wrapping passes."""
    for slot, kind in _SLOTS:
        current = getattr(inductor_config, slot)
        if isinstance(current, kind):
            setattr(inductor_config, slot, current.prior)
            continue
        while current is not None and hasattr(current, "prior"):
            if isinstance(current.prior, kind):
                current.prior = current.prior.prior
                break
            current = current.prior


def installed() -> bool:
    return all(_find(slot, kind) is not None for slot, kind in _SLOTS)


def _find(slot: str, kind: type) -> Optional[ChainedPass]:
    current = getattr(inductor_config, slot)
    while current is not None:
        if isinstance(current, kind):
            return current
        current = getattr(current, "prior", None)
    return None


# ---------------------------------------------------------------------------------------------- the rewrite
def rewrite(graph: torch.fx.Graph) -> int:
    """Replace the SDPA nodes of ``graph`` that nvfly runs; returns how many."""
    replaced = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in FUSED:
            arguments = _arguments(node)
            reason = _reason(node, arguments)
            if reason is None:
                try:
                    _replace(graph, node, arguments)
                    replaced += 1
                except Exception as exc:  # the graph is unchanged (_replace mutates it last): torch's kernel stays
                    reason = f"the rewrite raised {type(exc).__name__}: {exc}"
            _record(node, arguments, reason)
            if reason is not None:
                log.debug("nvfly: compiled SDPA %s stays on torch: %s", node.name, reason)
    if replaced:
        graph.eliminate_dead_code()
        graph.lint()
    return replaced


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (q/k/v as ``query``/``key``/``value``)."""
    schema = node.target._schema
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    positional = [a for a in schema.arguments if not a.kwarg_only]
    bound.update({a.name: value for a, value in zip(positional, node.args)})
    bound.update(node.kwargs)
    return bound


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else None


def _reason(node: torch.fx.Node, arguments: dict[str, Any]) -> Optional[str]:
    """None when nvfly runs this SDPA node, else why not."""
    users = list(node.users)
    if not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in users):
        return ("the graph uses the kernel's other outputs (its logsumexp: a training graph, whose backward keeps "
                "torch's kernels)")
    bias = arguments.get("attn_bias")
    if bias is not None and not isinstance(_val(bias), torch.Tensor):
        return "the attention bias has no traced value (meta['val'])"
    if arguments.get("dropout_p", 0.0):
        return f"dropout_p={arguments['dropout_p']} (nvfly has no dropout)"
    scale = arguments.get("scale")
    if scale is not None and not (isinstance(scale, float) and scale > 0):
        return f"scale={scale!r} is not a positive number known when compiling"
    q, k, v = (_val(arguments[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k or v has no traced value (meta['val'])"
    tensors = (q, k, v) if bias is None else (q, k, v, _val(bias))
    if any(isinstance(s, torch.SymInt) for t in tensors for s in (*t.shape, *t.stride(), t.storage_offset())):
        return "dynamic shapes (nvfly's SDPA rewrite takes static sizes and strides)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() == 4 and t.storage_offset() * t.element_size() % 16:
            return f"{name} starts {t.storage_offset()} elements into its buffer: not 16-byte aligned for TMA"
    hq, hkv = q.shape[1], k.shape[1] if k.dim() == 4 else 0
    try:
        with stand_ins(*tensors) as (q, k, v, *mask):
            return attention_ops._sdpa_reason(q, k, v, bool(arguments.get("is_causal", False)), hq != hkv, False,
                                              backend=FUSED[node.target], mask=mask[0] if mask else None)
    except Exception as exc:  # a broken check declines
        return f"eligibility check raised {type(exc).__name__}: {exc}"


@contextlib.contextmanager
def stand_ins(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Tensors with the sizes, strides, storage offsets, dtypes, devices and requires_grad of a graph's traced values
    (static: SymInts are declined before), made by a private FakeTensorMode with every other dispatch mode off, for
    the eager eligibility rule to run its checks on. The rule views its inputs; on the graph's own fake tensors a
    view would run in whatever fake mode is active, which in Inductor's passes need not be theirs ("Mixing fake
    modes NYI" in the pre-grad pass on torch 2.11), and could add guards to their shape environment."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes(), FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # data_ptr of a FakeTensor (alignment reads the storage offset)
        yield tuple(_stand_in(t) for t in tensors)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    shape, strides, offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()
    extent = offset + (1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0)
    storage = torch.empty(extent, dtype=t.dtype, device=t.device)
    return storage.as_strided(shape, strides, offset).requires_grad_(t.requires_grad)


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, arguments: dict[str, Any]) -> None:
    """The node by nvfly's op on (B, S, H, D) views and a permute back: the traced values first (what can fail), the
    graph changed after them."""
    q, k, v = (arguments[name] for name in ("query", "key", "value"))
    is_causal, scale = bool(arguments.get("is_causal", False)), arguments.get("scale")
    bias = arguments.get("attn_bias")  # the graph's mask as it reaches torch's kernel (a boolean one made additive)
    traced = _val(q)
    if traced.shape[2] <= MAX_SQ:
        op = torch.ops.nvfly.attention_decode.default
        kwargs = {"scale": scale, "causal": is_causal}
    else:
        op = torch.ops.nvfly.attention_prefill.default
        kwargs = {"causal": is_causal, "scale": scale, "causal_alignment": "top_left"}
    with _own_mode(traced):
        view_vals = [_val(t).transpose(1, 2) for t in (q, k, v)]
        out_val, lse_val = op(*view_vals, **kwargs, **({} if bias is None else {"attn_mask": _val(bias)}))
        result_val = out_val.transpose(1, 2)
    if bias is not None:
        kwargs["attn_mask"] = bias
    with graph.inserting_before(node):
        views = []
        for t, val in zip((q, k, v), view_vals):
            view = graph.call_function(aten.permute.default, (t, SWAP_S_H))  # post-grad graphs hold no transpose
            view.meta["val"] = val
            views.append(view)
        call = graph.call_function(op, tuple(views), kwargs)
        call.meta["val"] = (out_val, lse_val)
        out = graph.call_function(operator.getitem, (call, 0))
        out.meta["val"] = out_val
        result = graph.call_function(aten.permute.default, (out, SWAP_S_H))
        result.meta["val"] = result_val
    for user in list(node.users):  # every user is getitem(node, 0) (_reason checked)
        user.replace_all_uses_with(result)
        graph.erase_node(user)
    graph.erase_node(node)


@contextlib.contextmanager
def _own_mode(value: torch.Tensor) -> Iterator[None]:
    """The fake mode of a traced value (not whichever is active, which may differ), other dispatch modes off."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes(), getattr(value, "fake_mode", None) or contextlib.nullcontext():
        yield


def _record(node: torch.fx.Node, arguments: dict[str, Any], reason: Optional[str]) -> None:
    q, k, v = (_val(arguments.get(name)) for name in ("query", "key", "value"))
    if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        shape = (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
        shape = tuple(int(s) if not isinstance(s, torch.SymInt) else -1 for s in shape)
        problem = (f"q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} {q.dtype} "
                   f"is_causal={bool(arguments.get('is_causal', False))} (torch picked {FUSED[node.target]})")
        kernel = "decode" if q.shape[2] <= MAX_SQ else "prefill"
    else:
        shape, problem, kernel = (), f"node {node.name}", ""
    record(Decision("inductor", "sdpa", shape, problem, reason=reason, candidates=() if reason else (kernel,)))


# ---------------------------------------------------------------------------------------------- training graphs
def rewrite_training(graph: torch.fx.Graph) -> int:
    """Replace the ``F.scaled_dot_product_attention`` calls of a Dynamo graph (pre-grad: torch functions, fake
    ``example_value``s) whose inputs require grad and which the eager rule accepts by ``nvfly.attention_prefill``
    (top-left causal) on the (B, S, H, D) views: AOTAutograd then traces its forward and its registered backward
    (torch's flash or memory-efficient backward kernel on nvfly's LSE) into the joint graph. Calls without gradients
    are left to the post-grad pass, which knows the kernel torch picked. Returns how many were replaced."""
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch._C._nn.scaled_dot_product_attention:
            continue
        arguments = _sdpa_arguments(node)
        q, k, v = (_example(arguments.get(name)) for name in ("query", "key", "value"))
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            continue
        if not (q.requires_grad or k.requires_grad or v.requires_grad):
            continue
        reason = _training_reason(arguments, q, k, v)
        _record_training(node, arguments, q, k, v, reason)
        if reason is None:
            _replace_training(graph, node, arguments)
            replaced += 1
        else:
            log.debug("nvfly: compiled SDPA %s (training) stays on torch: %s", node.name, reason)
    if replaced:
        graph.lint()
    return replaced


SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def _sdpa_arguments(node: torch.fx.Node) -> dict[str, Any]:
    arguments = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    arguments.update(zip(SDPA_PARAMETERS, node.args))
    arguments.update(node.kwargs)
    return arguments


def _example(x: Any) -> Any:
    return (x.meta.get("example_value", x.meta.get("val")) if isinstance(x, torch.fx.Node) else None)


def _training_reason(arguments: dict[str, Any], q: Any, k: Any, v: Any) -> Optional[str]:
    if arguments["attn_mask"] is not None:
        return ("attn_mask with gradients (nvfly's prefill has a masked backward only through the float32 "
                "reference: torch's kernel keeps it)")
    if arguments["dropout_p"]:
        return f"dropout_p={arguments['dropout_p']} (nvfly has no dropout)"
    flags = (arguments["is_causal"], arguments["enable_gqa"], arguments["scale"])
    if any(isinstance(f, torch.fx.Node) for f in flags):
        return "is_causal, enable_gqa or scale is a traced value, not a constant"
    scale = arguments["scale"]
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        return f"scale={scale!r} is not a positive number known when compiling"
    if any(isinstance(s, torch.SymInt) for t in (q, k, v) for s in (*t.shape, *t.stride(), t.storage_offset())):
        return "dynamic shapes (nvfly's SDPA rewrite takes static sizes and strides)"
    if q.dim() == 4 and q.shape[2] <= MAX_SQ:
        return f"Sq = {q.shape[2]} needs gradients: nvfly's decode has no backward"
    try:
        with stand_ins(q, k, v) as (q, k, v):
            return attention_ops._sdpa_reason(q, k, v, bool(arguments["is_causal"]), bool(arguments["enable_gqa"]),
                                              True)
    except Exception as exc:  # a broken check declines
        return f"eligibility check raised {type(exc).__name__}: {exc}"


def _replace_training(graph: torch.fx.Graph, node: torch.fx.Node, arguments: dict[str, Any]) -> None:
    with graph.inserting_before(node):
        views = [graph.call_function(torch.transpose, (arguments[name], 1, 2)) for name in ("query", "key", "value")]
        call = graph.call_function(torch.ops.nvfly.attention_prefill.default, tuple(views),
                                   {"causal": bool(arguments["is_causal"]), "scale": arguments["scale"],
                                    "causal_alignment": "top_left"})
        out = graph.call_function(operator.getitem, (call, 0))
        result = graph.call_function(torch.transpose, (out, 1, 2))
    for new in (*views, call, out, result):
        new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "source_fn_stack")})
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def _record_training(node: torch.fx.Node, arguments: dict[str, Any], q: Any, k: Any, v: Any,
                     reason: Optional[str]) -> None:
    if q.dim() == k.dim() == v.dim() == 4:
        shape = tuple(int(s) if not isinstance(s, torch.SymInt) else -1
                      for s in (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]))
    else:
        shape = ()
    problem = (f"q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} {q.dtype} "
               f"is_causal={bool(arguments['is_causal'])} (training)")
    record(Decision("inductor", "sdpa", shape, problem, reason=reason, candidates=() if reason else ("prefill",)))
