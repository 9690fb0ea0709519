"""flex_attention under ``torch.compile``: nvfly as a backend of Inductor's flex_attention lowering.

    out = torch.compile(flex_attention)(q, k, v, score_mod=..., block_mask=..., kernel_options={"NVFLY": True})

``install()`` (``nvfly.torch.install()`` calls it) wraps the lowering Inductor registered for
``torch.ops.higher_order.flex_attention`` (re-registered in ``torch._inductor.lowering.lowerings``, torch is not
patched; ``uninstall()`` puts the original back). For a call the wrapper takes (``kernel_options["NVFLY"]`` true:
per call; or, after ``install(auto=True)``, any call the rule picks), it emits one call to the custom op
``nvfly::flex_attention`` (an ``ExternKernel`` fallback: portable to the FX-graph cache) and pops ``NVFLY`` from the
options before Inductor's own lowering sees them (torch 2.11/2.13 validate ``BACKEND``'s values, not other keys).
``NVFLY: False`` keeps Inductor's kernel.

The mods: Inductor hands the lowering the score_mod and mask_mod as ``Subgraph``s, aten-level FX graphs. Their
Python code (``GraphModule.code``) is the op's string argument; the op runs it with ``torch.ops.aten.*`` resolved to
``flex_ops``' translations (``_TorchShim``), so the same Python function is traced into nvfly's kernel (captured
buffers: the op's tensor-list arguments, closure cells of that function). A code string is compiled once per
process (the kernel cache keys on the function). The op returns the LSE in log2, the HOP's convention for
non-FLASH backends, so Inductor's flex backward runs from nvfly's forward.

Declined at lowering (Inductor's kernel runs, the reason is recorded in ``decisions()``, ``where="inductor"``): what
eager routing declines (``flex_ops.reason`` on example tensors of the lowering's static shapes), dynamic shapes,
graphs with tensor constants. At run time an nvfly failure computes the call by the float32 reference
(``prefill_reference``), with a warning.

Decode-sized calls (Sq <= 16) run nvfly's decode kernel, whose q_idx is the query's position: mods that read q_idx
get flex's row back (``path="decode_shifted"``: q_idx - (Skv - Sq), a (B,) int32 tensor the op makes once per
signature and captures, as eager routing does), unless the mods already capture two tensors (prefill then).

Auto rule (``install(auto=True)``, ``auto_reason``): nvfly's prefill for calls with Sq >= 512 (Inductor's Triton
flex kernel is FlashAttention-2-class, nvfly's prefill FA3-class: 1.4-4.6x on the mod rows), and decode-sized calls
that run on nvfly's decode kernel.
"""
from __future__ import annotations

import functools
import logging
import math
import operator
import threading
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from nvfly.ops import attention
from nvfly.ops.attention.plan import MAX_SQ
from nvfly.ops.attention.softmax import LOG2E
from nvfly.ops.common.opcall import OpCalls
from nvfly.runtime.torch_args import layout_key
from nvfly.torch import flex_ops
from nvfly.torch.gemm_ops import Decision, record
from nvfly.torch.library import operator as define_operator
from nvfly.torch.library import register_fake

log = logging.getLogger("nvfly")

OPTION = "NVFLY"
DEVICES = ("cuda",)  # where the lowering emits nvfly's op (the CPU tests add "cpu": the op's reference runs there)
# the auto rule: nvfly's prefill from Sq 512 (1.4-4.6x Inductor's Triton flex on the mod rows at 4K-16K), and its
# decode kernel at Sq <= 16 (8.1x / 14.6x on 32K-key decode steps); docs/torch-flex.md
AUTO_MIN_SQ = 512


# ---------------------------------------------------------------------------------------------- code -> callable
class _Packet:
    def __init__(self, packet: Any):
        self._packet = packet

    def __getattr__(self, overload: str) -> Callable[..., Any]:
        return flex_ops._function(getattr(self._packet, overload))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return flex_ops._function(self._packet.default)(*args, **kwargs)


class _Namespace:
    def __init__(self, namespace: Any):
        self._namespace = namespace

    def __getattr__(self, name: str) -> _Packet:
        return _Packet(getattr(self._namespace, name))


class _Ops:
    def __getattr__(self, name: str) -> _Namespace:
        return _Namespace(getattr(torch.ops, name))


class _TorchShim:
    """``torch`` for a graph's code: ``torch.ops.<ns>.<op>.<overload>`` is flex_ops' translation, the rest torch."""
    ops = _Ops()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@functools.lru_cache(maxsize=256)
def _forward(code: str) -> Callable[..., Any]:
    namespace = {"torch": _TorchShim(), "operator": operator, "inf": math.inf, "nan": math.nan,
                 "device": torch.device, "math": math}
    exec(compile(code, "<nvfly flex mod>", "exec"), namespace)  # noqa: S102 - the graph's own FX code
    return namespace["forward"]


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


_CALLABLES: dict = {}
_LOCK = threading.Lock()


def code_callable(kind: str, code: str, buffers: tuple, shift: Optional[Tensor] = None) -> Callable[..., Any]:
    """The mod whose FX code is ``code`` as a function of flex's signature capturing ``buffers`` (cells set per
    call: call under ``flex_ops.CALL_LOCK``); with ``shift`` (a (B,) int32 tensor: decode's Skv - Sq) the code sees
    ``q_idx - shift[b]``, flex's row, where decode's q_idx is the query's position (``flex_ops.graph_callable``)."""
    key = (kind, code, len(buffers), shift is not None)
    with _LOCK:
        fn = _CALLABLES.get(key)
        if fn is None:
            forward = _forward(code)
            fn = _CALLABLES[key] = flex_ops.mod_function(kind, lambda args: _first(forward(None, *args)), len(buffers),
                                                         shift is not None)
    flex_ops._set_buffers(fn, buffers, shift)
    return fn


# ---------------------------------------------------------------------------------------------- the custom op
@define_operator("flex_attention")
def flex_attention_op(query: Tensor, key: Tensor, value: Tensor, kv_num_blocks: Optional[Tensor],
                      kv_indices: Optional[Tensor], full_kv_num_blocks: Optional[Tensor],
                      full_kv_indices: Optional[Tensor], score_buffers: list[Tensor], mask_buffers: list[Tensor],
                      score_code: str, mask_code: str, scale: float, q_block: int, kv_block: int, path: str,
                      needs_lse: bool) -> list[Tensor]:
    """flex_attention's HOP by nvfly: query (B, Hq, Sq, D), key/value (B, Hkv, Skv, D) -> [out (B, Hq, Sq, Dv)],
    and with ``needs_lse`` (the graph reads the LSE) [out, lse (B, Hq, Sq) float32 in log2]; out is the
    (B, Hq, Sq, Dv) view of (B, Sq, Hq, Dv) memory. The HOP's other outputs (max_scores, an unread LSE) are the
    lowering's empty buffers, which Inductor drops: nothing is allocated for them per call. ``score_code``/
    ``mask_code``: the mods' FX code ("" for none); the tables None without a block mask; ``path``: "prefill",
    "decode" (nvfly's kernels) or "decode_shifted" (decode, the mods reading q_idx given flex's row: position -
    (Skv - Sq)). Every argument is positional: the dispatcher parses keyword arguments slowly (~1 µs
    each). The call's host work is cached per signature (``_FlexSignature``)."""
    tables = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    try:  # without kv_num_blocks there is no block mask: the other tables are not read
        signature = (layout_key(query), layout_key(key), layout_key(value),
                     kv_num_blocks is not None and tuple(map(layout_key, tables)),
                     tuple(map(layout_key, score_buffers)) if score_buffers else (),
                     tuple(map(layout_key, mask_buffers)) if mask_buffers else (), score_code, mask_code, q_block,
                     kv_block, path, needs_lse)
        call = _SIGNATURES.get(signature)
    except (AttributeError, TypeError):  # not tensors: planned for this call alone
        signature = call = None
    if call is None:
        call = _FlexSignature(score_code, mask_code, q_block, kv_block, path, needs_lse, kv_num_blocks is not None)
        _SIGNATURES.remember(signature, call)
    return call.run(query, key, value, tables, score_buffers, mask_buffers, scale)


class _FlexSignature:
    """The op's calls of one signature (the layouts of every tensor argument and the static arguments): the mods'
    functions and nvfly's kernel call, made on the first call (decode: ``attention.bound_decode``, its checks and
    plan done then), so a later call binds its tensors and launches. The kernel call takes and returns the op's
    (B, H, S, D) views (decode's bound call reads their addresses: no transposes per call). A first call that fails
    (not CUDA, a check) makes every call of the signature compute by the float32 reference."""

    def __init__(self, score_code: str, mask_code: str, q_block: int, kv_block: int, path: str, needs_lse: bool,
                 masked: bool):
        self.score_code, self.mask_code = score_code, mask_code
        self.block_size = (q_block, kv_block)
        self.path, self.needs_lse = path, needs_lse
        self.plain = not score_code and not masked  # no functions whose cells a call sets: no lock
        self.launch: Optional[Callable[..., Any]] = None
        self.failed = False
        self.shift: Optional[Tensor] = None  # decode_shifted: (B,) int32 Skv - Sq (static in a compiled graph)

    def _shift(self, q: Tensor, k: Tensor) -> Optional[Tensor]:
        if self.path != "decode_shifted":
            return None
        if self.shift is None:
            self.shift = torch.full((q.shape[0],), k.shape[2] - q.shape[2], dtype=torch.int32, device=q.device)
        return self.shift

    def _mods(self, q: Tensor, k: Tensor, tables: tuple, score_buffers: list, mask_buffers: list) -> tuple:
        """(score_mod, block_mask) of this call (q, k (B, H, S, D)): the functions' cells hold its buffers (under
        CALL_LOCK)."""
        shift = self._shift(q, k)
        score = code_callable("score", self.score_code, tuple(score_buffers), shift) if self.score_code else None
        if tables[0] is None:
            return score, None
        from torch.nn.attention.flex_attention import BlockMask, noop_mask
        block_mask = BlockMask.__new__(BlockMask)
        block_mask.seq_lengths = (q.shape[2], k.shape[2])
        block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices = (
            tables)
        block_mask.BLOCK_SIZE = self.block_size
        block_mask.mask_mod = (code_callable("mask", self.mask_code, tuple(mask_buffers), shift) if self.mask_code
                               else noop_mask)
        return score, block_mask

    def _first(self, q: Tensor, k: Tensor, v: Tensor, score: Any, block_mask: Any) -> None:
        """The kernel call of the signature (decode's bound call; prefill's own cache serves ``prefill``); raises
        where nvfly's op cannot run (not CUDA: their checks say so)."""
        needs_lse = self.needs_lse
        if self.path != "prefill":
            self.launch = attention.bound_decode(q, k, v, causal=False, score_mod=score, block_mask=block_mask,
                                                 return_lse=needs_lse, heads_first=True)
            return

        def prefill(q: Tensor, k: Tensor, v: Tensor, scale: float, block_mask: Any) -> Any:
            result = attention.prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                                       score_mod=score, block_mask=block_mask, return_lse=needs_lse, validate=False)
            return (result[0].transpose(1, 2), result[1]) if needs_lse else result.transpose(1, 2)
        self.launch = prefill

    def _compute(self, q: Tensor, k: Tensor, v: Tensor, score: Any, block_mask: Any, scale: float) -> Any:
        """out (B, Hq, Sq, Dv) over (B, Sq, Hq, Dv) memory, and the LSE (natural log) when read."""
        if not self.failed:
            try:
                if self.launch is None:
                    self._first(q, k, v, score, block_mask)
                return self.launch(q, k, v, scale, block_mask)
            except Exception as exc:  # an nvfly failure never breaks the model: the float32 reference runs
                self.failed = True
                if q.device.type == "cuda":
                    log.warning("nvfly: flex_attention (compiled) raised %s: %s; computed by the float32 "
                                "reference", type(exc).__name__, exc)
        # decode_shifted's mods take positions (decode's q_idx): decode's reference gives them those
        reference = attention.reference if self.path == "decode_shifted" else attention.prefill_reference
        options = {"causal": False} if self.path == "decode_shifted" else {}
        out, lse = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, score_mod=score,
                             block_mask=block_mask, **options)
        out = out.to(q.dtype).transpose(1, 2)
        return (out, lse) if self.needs_lse else out

    def run(self, query: Tensor, key: Tensor, value: Tensor, tables: tuple, score_buffers: list, mask_buffers: list,
            scale: float) -> list[Tensor]:
        if self.plain:
            result = self._compute(query, key, value, None, None, scale)
        else:
            with flex_ops.CALL_LOCK:
                score, block_mask = self._mods(query, key, tables, score_buffers, mask_buffers)
                result = self._compute(query, key, value, score, block_mask, scale)
        if not self.needs_lse:
            return [result]
        out, lse = result
        return [out, lse.mul_(LOG2E)]


_SIGNATURES: OpCalls[_FlexSignature] = OpCalls()


def _fake(query: Tensor, key: Tensor, value: Tensor, kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor],
          full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor], score_buffers: list[Tensor],
          mask_buffers: list[Tensor], score_code: str, mask_code: str, scale: float, q_block: int, kv_block: int,
          path: str, needs_lse: bool) -> list[Tensor]:
    batch, hq, sq, _ = query.shape
    out = query.new_empty((batch, sq, hq, value.shape[3])).transpose(1, 2)
    return [out, query.new_empty((batch, hq, sq), dtype=torch.float32)] if needs_lse else [out]


register_fake("flex_attention", _fake)


# ---------------------------------------------------------------------------------------------- the lowering
_STATE = {"original": None, "auto": False}


def _static(node: Any) -> Optional[tuple]:
    try:
        return tuple(int(s) for s in node.get_size())
    except (TypeError, ValueError):
        return None


def _example(node: Any) -> Tensor:
    """An empty-strided tensor on the meta-like device of ``node`` (its size, stride, dtype) for the checks."""
    size = _static(node)
    stride = tuple(int(s) for s in node.get_stride())
    return torch.empty_strided(size, stride, dtype=node.get_dtype(), device="meta")


def _decline(query: Any, key: Any, why: str) -> None:
    record(Decision("inductor", "flex_attention", _static(query) or (), f"q {query.get_size()} k {key.get_size()} "
                    f"{query.get_dtype()}", reason=why))


def lowering_reason(query: Any, key: Any, value: Any, subgraph: Any, block_mask: tuple, kernel_options: dict,
                    score_buffers: tuple, mask_buffers: tuple) -> tuple[Optional[str], str]:
    """(None or why Inductor's kernel runs, the op's path: ``kernel_path``)."""
    if any(_static(n) is None for n in (query, key, value)):
        return "dynamic shapes (nvfly plans on static ones)", ""
    device = query.get_device()
    if device is None or device.type not in DEVICES:
        return f"q is on {getattr(device, 'type', device)}, not CUDA", ""
    if kernel_options.get("OUTPUT_MAX"):
        return "max scores are requested: nvfly returns the LSE only", ""
    if kernel_options.get("BACKEND") == "FLASH":
        return "BACKEND='FLASH' is asked for (its LSE is natural log, nvfly's op returns the others' log2)", ""
    q, k, v = (_example(n) for n in (query, key, value))
    score_gm = subgraph.graph_module
    mask_gm = block_mask[-1].graph_module
    masked = int(block_mask[-3]) != flex_ops._NO_MASK_BLOCK
    for name, gm in (("score_mod", score_gm), ("mask_mod", mask_gm if masked else None)):
        if gm is None:
            continue
        if any(n.op == "get_attr" for n in gm.graph.nodes):
            return f"{name} holds a tensor constant (nvfly takes captured tensors as inputs)", ""
    buffers = tuple(_example(b) for b in score_buffers) + tuple(_example(b) for b in mask_buffers)
    tables = tuple(block_mask[2:10])
    mask = None
    if masked:
        from torch.nn.attention.flex_attention import BlockMask
        mask = BlockMask.__new__(BlockMask)
        mask.seq_lengths = (q.shape[2], k.shape[2])
        nums = [None if t is None else _example(t) for t in tables[:4]]
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices = nums
        mask.BLOCK_SIZE = (int(block_mask[-3]), int(block_mask[-2]))
        mask.mask_mod = mask_gm
    call = flex_ops.FlexCall(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             None if flex_ops._is_identity_score(score_gm) else score_gm, mask_gm if masked else None,
                             mask, 1.0, buffers[:len(score_buffers)], buffers[len(score_buffers):], False)
    why = flex_ops.reason_on_meta(call)
    return why, kernel_path(call)


def kernel_path(call: flex_ops.FlexCall) -> str:
    """The op's ``path`` for a call: nvfly's decode kernel where eager routing runs it (Sq <= 16; "decode_shifted"
    when the mods read q_idx), else prefill."""
    if not flex_ops._uses_decode(call):
        return "prefill"
    return "decode_shifted" if flex_ops._reads_q_idx(call) else "decode"


def auto_reason(sq: int, kernel: str) -> Optional[str]:
    """None when ``install(auto=True)`` gives a call nvfly runs on ``kernel`` (``kernel_path``) with ``sq`` query rows
    to nvfly, else why Inductor's kernel keeps it."""
    if sq >= AUTO_MIN_SQ or (sq <= MAX_SQ and kernel.startswith("decode")):
        return None
    if sq <= MAX_SQ:
        return (f"the auto rule takes Sq < {AUTO_MIN_SQ} only on nvfly's decode kernel (these mods, reading q_idx "
                "with two captured tensors, run its prefill kernel here, not measured against Inductor's)")
    return (f"the auto rule leaves {MAX_SQ} < Sq < {AUTO_MIN_SQ} to Inductor (nvfly's prefill on short sequences is "
            "not measured against its flex kernel)")


def _wants(kernel_options: dict, query: Any) -> Optional[bool]:
    option = kernel_options.get(OPTION)
    if option is not None:
        return bool(option)
    if not _STATE["auto"]:
        return False
    size = _static(query)
    return size is not None and (size[2] >= AUTO_MIN_SQ or size[2] <= MAX_SQ)


def _lowering(query: Any, key: Any, value: Any, subgraph: Any, block_mask: tuple, scale: float,
              kernel_options: dict, score_mod_other_buffers: tuple = (), mask_mod_other_buffers: tuple = ()) -> Any:
    original = _STATE["original"]
    explicit = OPTION in kernel_options
    wants = _wants(kernel_options, query)
    options = {k: v for k, v in kernel_options.items() if k != OPTION}
    if wants:
        try:
            # computed inputs (a projection's view) realized as buffers: their strides are what the op gets
            from torch._inductor.ir import ExternKernel
            query, key, value = (ExternKernel.realize_input(t) for t in (query, key, value))
            why, kernel = lowering_reason(query, key, value, subgraph, block_mask, kernel_options,
                                          score_mod_other_buffers, mask_mod_other_buffers)
        except Exception as exc:
            why, kernel = f"the lowering check raised {type(exc).__name__}: {exc}", ""
        if why is None and not explicit:
            why = auto_reason(_static(query)[2], kernel)
        if why is None:
            try:
                return _emit(query, key, value, subgraph, block_mask, scale, score_mod_other_buffers,
                             mask_mod_other_buffers, kernel)
            except Exception as exc:
                why = f"emitting nvfly's op raised {type(exc).__name__}: {exc}"
        _decline(query, key, why)
        if explicit:
            log.info("nvfly: flex_attention compiled by Inductor: %s", why)
    return original(query, key, value, subgraph, block_mask, scale, options, score_mod_other_buffers,
                    mask_mod_other_buffers)


def _emit(query: Any, key: Any, value: Any, subgraph: Any, block_mask: tuple, scale: float, score_buffers: tuple,
          mask_buffers: tuple, kernel: str) -> Any:
    from torch._inductor.lowering import empty_strided, fallback_handler
    score_gm = subgraph.graph_module
    masked = int(block_mask[-3]) != flex_ops._NO_MASK_BLOCK
    mask_gm = block_mask[-1].graph_module
    score_code = "" if flex_ops._is_identity_score(score_gm) else score_gm.code
    mask_code = mask_gm.code if masked and flex_ops._masks(mask_gm) else ""
    tables = list(block_mask[2:6]) if masked else [None] * 4
    handler = fallback_handler(torch.ops.nvfly.flex_attention.default, add_to_fallback_set=False)
    needs_lse = _reads_lse()
    outputs = handler(query, key, value, *tables, list(score_buffers), list(mask_buffers), score_code, mask_code,
                      float(scale), int(block_mask[-3]), int(block_mask[-2]), kernel, needs_lse)
    record(Decision("inductor", "flex_attention", _static(query) or (), f"q {query.get_size()} k {key.get_size()} "
                    f"{query.get_dtype()}", candidates=(kernel,), winner=kernel))
    # what the op does not return: buffers no kernel writes and (unread) no user keeps, so Inductor drops them
    batch, hq, sq, _ = query.get_size()

    def unread() -> Any:
        return empty_strided([batch, hq, sq], None, dtype=torch.float32, device=query.get_device())
    return outputs[0], outputs[1] if needs_lse else unread(), unread()


def _reads_lse() -> bool:
    """Whether the graph reads the LSE of the flex_attention node being lowered (training saves it for the backward,
    ``return_lse``/``return_aux`` return it; an inference call's graph reads the output alone): unknown counts as
    read."""
    from torch._inductor.virtualized import V
    node = getattr(V.graph, "current_node", None)
    if node is None:
        return True
    return any(user.target is not operator.getitem or user.args[1] != 0 for user in node.users)


def install(auto: bool = False) -> None:
    """Wrap Inductor's flex_attention lowering (idempotent): ``kernel_options={"NVFLY": True}`` picks nvfly per call;
    ``auto``: also calls the auto rule picks."""
    from torch._inductor.lowering import lowerings
    hop = torch.ops.higher_order.flex_attention
    _STATE["auto"] = auto
    if _STATE["original"] is None:
        _STATE["original"] = lowerings[hop]
        lowerings[hop] = _lowering


def uninstall() -> None:
    """Put Inductor's own lowering back."""
    from torch._inductor.lowering import lowerings
    if _STATE["original"] is not None:
        lowerings[torch.ops.higher_order.flex_attention] = _STATE["original"]
        _STATE["original"] = None
    _STATE["auto"] = False


def installed() -> bool:
    return _STATE["original"] is not None
