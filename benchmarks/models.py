"""Whole model pieces, eager torch vs the same code under ``nvfly.torch.routing()`` (no model change), in one process.

Cases (bf16, H200 sizes from docs/torch-attention.md):
- ``llama-prefill``: a Llama-3-8B decoder layer (RMSNorm, fused qkv, RoPE, causal SDPA with GQA 32/8, o, RMSNorm,
  SwiGLU MLP) on 4096 tokens, batch 1.
- ``llama-decode``: the same layer's decode step (one token a sequence: the new key and value written into a static
  32K cache, SDPA over the cache's first 32K positions), batch 1 and 32; also replayed from a CUDA graph (serving).
- ``minimax-decode``: a MiniMax-like 48/8 decode step's attention over a 32K cache, batch 1 and 16.
- ``deepseek-prefill``: DeepSeek-V3-like prefill attention (128 heads, Dqk 192 / Dv 128, causal, 4096 tokens).
- ``llama-train``: a training step of the Llama layer (forward and backward) on 4096 tokens: the gradients of
  every weight through the routed model are checked against eager's first.
- ``masked-sdpa``: SDPA with Hugging Face's masks for a padded batch: a (B, 1, 1, Skv) boolean padding mask and a
  (B, 1, Sq, Skv) bf16 additive causal + padding mask on Llama prefill shapes (B 2, 4096, 32/8), and a padding mask
  on a decode step (B 16, 8K cache): the mask read by nvfly's kernel vs torch's memory-efficient (or cuDNN) kernel.
- ``spec-decode``: a speculative-decoding verification step, Sq = 2, 4 or 8 query tokens (the drafts) over a 32K
  cache: the Llama layer on 4 tokens (B 1), SDPA alone on Llama's 32/8 heads (B 1 and 8; Sq 2 and 8 without
  ``--quick``), with a (B, 1, 1, Skv) boolean padding mask over a padded batch of 8, and with HF's eager mask for
  the step (``hf_mask("additive")``: (B, 1, Sq, Skv) bf16, the drafts' own causality and the padding, a row per
  query). Torch's kernels run each query head over its KV head at Sq >= 2 (cuDNN ~0.9 TB/s at Sq 4), nvfly's decode
  packs the group (docs/ops/attention.md): routing sends these to nvfly (unmasked rows record ``explain_sdpa``'s
  verdict with the decision). Without a mask the drafts attend to every cached key and to each other
  (``is_causal=False``, as the layer row does).
- ``gemma2-block``: a Gemma-2-9B-like block (``Gemma2Layer``: the Llama layer's pieces with flex_attention, tanh
  soft-capping 50 and a causal 4096-token window as a BlockMask, GELU-tanh gating; 16/8 heads of 256, hidden 3584)
  on 8K tokens: eager, routed, compiled (Inductor's Triton flex) and compiled with nvfly installed.
- ``flex``: flex_attention calls: a Gemma-2-9B-like prefill (16/8 heads, D 256, 8K tokens, tanh soft-capping 50,
  causal sliding window 4096 as a BlockMask) and MiniMax 48/8 / Llama 32/8 decode steps over 32K; eager, routed, and
  compiled with Inductor's Triton flex kernels (``flex_triton_ms``) or nvfly as the backend (``nvfly_ms``).

Every case first checks the routed output against eager (relative error < 2e-2) and records what routing decided
for each SDPA call (nvfly's kernel, or torch's with the reason). Each row: ``model``, ``phase``, ``eager_ms``,
``routed_ms`` and their ratio (``speedup`` = eager / routed), without ``--quick`` torch.compile's ms (default mode)
without (``inductor_ms``) and with ``nvfly.torch.install()`` (``nvfly_ms``: its graph passes and flex backend),
CUDA-graph replays for decode (``eager_graph_ms``, ``routed_graph_ms``). Eager and routed are timed in turn,
several rounds (``timed``: ``eager_ms``/``routed_ms`` the medians, ``speedup_range`` the rounds' least and greatest
ratio, ``ms_rounds`` each round's), the routed calls inside one ``nvfly.torch.routing()`` block a round, as a serving
loop runs under one (a block's own start, where the routes are registered, is timed by
``benchmarks/routing_overhead.py``, which with ``--profile`` also lists the layer rows' kernels and host cost per
op). ``other_ops``: what routing decided for the other routed calls that record a decision (GEMMs).

Usage: python -m benchmarks.models [--quick] [--cases llama-prefill ...]
       python -m benchmarks.models --cases flex --profile   (where compiled flex decode's time goes; no results)
Writes benchmarks/results/models_h200.json and models_h200.png.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import types
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nvfly.torch  # noqa: E402
from benchmarks.common import (bench_ms, geomean, interleaved_graph_ms, interleaved_ms, plot, rel_err,  # noqa: E402
                               write_results)
from nvfly.torch import attention_ops  # noqa: E402
from nvfly.torch.gemm_ops import clear_decisions, decisions  # noqa: E402

HIDDEN, INTER, HEAD, Q_HEADS, KV_HEADS, EPS = 4096, 14336, 128, 32, 8, 1e-5
MAX_REL_ERR = 2e-2
ROUNDS = {True: 5, False: 9}  # timed()'s rounds of eager and routed, by --quick


class LlamaLayer(torch.nn.Module):
    """A Llama-3-8B decoder layer written as a PyTorch user writes it (F.rms_norm, nn.Linear, SDPA); other sizes for
    host-path probes on CPU (``benchmarks/routing_overhead.py --profile --cpu``)."""

    def __init__(self, hidden: int = HIDDEN, inter: int = INTER, head: int = HEAD, q_heads: int = Q_HEADS,
                 kv_heads: int = KV_HEADS) -> None:
        super().__init__()
        self.hidden, self.head, self.q_heads, self.kv_heads = hidden, head, q_heads, kv_heads
        self.attn_norm = torch.nn.Parameter(torch.ones(hidden))
        self.qkv = torch.nn.Linear(hidden, (q_heads + 2 * kv_heads) * head, bias=False)
        self.o = torch.nn.Linear(q_heads * head, hidden, bias=False)
        self.mlp_norm = torch.nn.Parameter(torch.ones(hidden))
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)
        for linear in (self.qkv, self.o, self.gate_up, self.down):
            torch.nn.init.normal_(linear.weight, std=0.02)

    def forward(self, x: torch.Tensor, start: int = 0, cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                ) -> torch.Tensor:
        """x (B, S, hidden): the tokens at positions start.. start + S - 1. Without a cache: causal attention over
        the S tokens (prefill). With a (B, Hkv, Smax, D) cache pair (a decode step, S = 1, or S speculative drafts):
        the tokens' keys and values are written at their positions and their queries attend to the cache up to the
        last (drafts see each other: no mask; the position is a Python int, so the step can be captured in a CUDA
        graph)."""
        batch, tokens, _ = x.shape
        hidden, head, hq, hkv = self.hidden, self.head, self.q_heads, self.kv_heads
        positions = torch.arange(start, start + tokens, device=x.device)
        h = F.rms_norm(x, (hidden,), self.attn_norm, EPS)
        q, k, v = self.qkv(h).split([hq * head, hkv * head, hkv * head], dim=-1)
        q = rope(q.view(batch, tokens, hq, head), positions).transpose(1, 2)
        k = rope(k.view(batch, tokens, hkv, head), positions).transpose(1, 2)
        v = v.view(batch, tokens, hkv, head).transpose(1, 2)
        if cache is None:
            attn = self.attend(q, k, v)
        else:
            cache_k, cache_v = cache
            end = start + tokens
            cache_k[:, :, end - tokens:end] = k
            cache_v[:, :, end - tokens:end] = v
            attn = F.scaled_dot_product_attention(q, cache_k[:, :, :end], cache_v[:, :, :end], enable_gqa=True)
        x = x + self.o(attn.transpose(1, 2).reshape(batch, tokens, hq * head))
        gate, up = self.gate_up(F.rms_norm(x, (hidden,), self.mlp_norm, EPS)).chunk(2, dim=-1)
        return x + self.down(self.activate(gate) * up)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Prefill attention of (B, H, S, D) q, k, v: causal SDPA with GQA."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def activate(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)


class Gemma2Layer(LlamaLayer):
    """A Gemma-2-9B-like block in prefill (hidden 3584, 16 query heads and 8 KV heads of 256, MLP 14336, GELU-tanh
    gating): the Llama layer's pieces with flex_attention for its attention, tanh soft-capping of the scores and a
    causal sliding window as a BlockMask, over ``tokens`` tokens (other sizes for CPU tests)."""

    def __init__(self, tokens: int, window: int = 4096, softcap: float = 50.0, hidden: int = 3584,
                 inter: int = 14336, head: int = 256, q_heads: int = 16, kv_heads: int = 8,
                 device: str = "cuda") -> None:
        from torch.nn.attention.flex_attention import create_block_mask
        super().__init__(hidden, inter, head, q_heads, kv_heads)
        self.softcap = softcap

        def causal_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
        self.block_mask = create_block_mask(causal_window, None, None, tokens, tokens, device=device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention
        cap = self.softcap

        def soft_cap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
        return flex_attention(q, k, v, score_mod=soft_cap, block_mask=self.block_mask, enable_gqa=True)

    def activate(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 500000.0) -> torch.Tensor:
    """Rotary embedding of x (B, S, H, D) at ``positions`` (Llama's rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def routed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` in a routing block of its own (the correctness checks; timing runs inside one block: ``timed``)."""
    def call() -> Any:
        with nvfly.torch.routing():
            return fn()
    return call


def fresh_decisions() -> None:
    """Forget what was decided and recorded so far: the case's first routed call decides (and records) again."""
    clear_decisions()
    attention_ops.forget_decisions()


def sdpa_outcome() -> dict[str, Any]:
    """What routing decided for the SDPA calls so far: nvfly's kernels, or torch's reasons."""
    sdpa = [d for d in decisions() if d.op == "sdpa"]
    sdpa = [d for d in sdpa if d.where == "eager"]
    others = [d for d in decisions() if d.op != "sdpa" and d.where == "eager"]  # GEMMs (mm, addmm, ...)
    return {"nvfly_kernels": sorted({c for d in sdpa for c in d.candidates if d.reason is None}),
            "declined": sorted({d.reason for d in sdpa if d.reason}),
            "other_ops": sorted({f"{d.op}: " + (d.reason or f"nvfly {', '.join(d.candidates)}") for d in others})}


def torch_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  mask: Optional[torch.Tensor] = None) -> str:
    return attention_ops._torch_backend(q, k, v, q.shape[1] != k.shape[1], causal, mask)


def timed(row: dict[str, Any], eager: Callable[[], Any], quick: bool, compile_too: bool = False,
          graphs: bool = False,
          compile_fn: Optional[Callable[[str], Callable[[], Any]]] = None) -> dict[str, Any]:
    """Times ``eager`` outside and inside routing (and, ``compile_too``, compiled) into ``row``; ``compile_fn(name)``
    makes a compiled call on a code object of that name (default: ``torch.compile`` of ``eager``'s code under the
    name). Eager and routed are timed in turn, ``ROUNDS`` times over, each inside one routing block (as a serving
    loop runs under one): ``eager_ms`` and ``routed_ms`` are the medians of the rounds, ``speedup_range`` the least
    and greatest ratio of one round's, so drift during the run (clocks, the host) lands on both and the noise shows.
    The two compiled variants are timed in turn the same way (``nvfly_vs_inductor_range``)."""
    warm, rep = (10, 40) if quick else (25, 100)
    times = interleaved_ms({"eager": eager, "routed": eager}, ROUNDS[quick], warm, rep,
                           around={"routed": nvfly.torch.routing})
    row["eager_ms"], row["routed_ms"] = (statistics.median(times[name]) for name in ("eager", "routed"))
    row["speedup"] = row["eager_ms"] / row["routed_ms"]
    ratios = [e / r for e, r in zip(times["eager"], times["routed"])]
    row["speedup_range"] = [min(ratios), max(ratios)]
    row["ms_rounds"] = {name: [round(t, 4) for t in ts] for name, ts in times.items()}
    if compile_too:  # torch.compile (default mode) without nvfly, then with nvfly.torch.install()
        compile_fn = compile_fn or (lambda name: torch.compile(_own_code(eager, name)))
        torch._dynamo.reset()
        calls = {}
        for key, with_nvfly in (("inductor", False), ("nvfly", True)):
            # each variant on its own code object (its own Dynamo cache: no reset between them, both stay callable)
            with nvfly_installed() if with_nvfly else contextlib.nullcontext():
                calls[key] = compile_fn(f"{row['case'].replace('-', '_')}_{key}")
                out = calls[key]()  # compiled now, while nvfly's passes are (or are not) installed
            row[f"{key}_rel_err_vs_eager"] = max(rel_err(o, e) for o, e in zip(as_list(out), as_list(eager())))
        times = interleaved_ms(calls, ROUNDS[quick], warm, rep)
        for key, values in times.items():
            row[f"{key}_ms"] = statistics.median(values)
        compiled_ratios = [i / n for i, n in zip(times["inductor"], times["nvfly"])]
        row["nvfly_vs_inductor"] = row["inductor_ms"] / row["nvfly_ms"]
        row["nvfly_vs_inductor_range"] = [min(compiled_ratios), max(compiled_ratios)]
        row["nvfly_sdpa"] = sorted({d.reason or f"nvfly {', '.join(d.candidates)}" for d in decisions()
                                            if d.where == "inductor" and d.op == "sdpa"})
    if graphs:  # a serving loop replays the step from a CUDA graph: no host time; the two graphs' replays in turn
        graphed = interleaved_graph_ms({"eager": eager, "routed": eager}, around={"routed": nvfly.torch.routing})
        row["eager_graph_ms"], row["routed_graph_ms"] = graphed["eager"], graphed["routed"]
        if row["eager_graph_ms"] and row["routed_graph_ms"]:
            row["graph_speedup"] = row["eager_graph_ms"] / row["routed_graph_ms"]
    return row


@contextlib.contextmanager
def compiling(with_nvfly: bool) -> Iterator[None]:
    """A fresh Dynamo cache, and nvfly's graph passes installed in the block (or not)."""
    torch._dynamo.reset()
    with nvfly_installed() if with_nvfly else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def nvfly_installed() -> Iterator[None]:
    """nvfly's graph passes and backends installed in the block."""
    nvfly.torch.install()
    try:
        yield
    finally:
        nvfly.torch.uninstall()


def as_list(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def checked(row: dict[str, Any], eager_out: torch.Tensor, nvfly_out: torch.Tensor) -> dict[str, Any]:
    row["rel_err_vs_eager"] = rel_err(nvfly_out, eager_out)
    row["same_as_eager"] = row["rel_err_vs_eager"] < MAX_REL_ERR
    return row


# ---------------------------------------------------------------------------------------------- cases
def llama_prefill(quick: bool, compile_too: bool) -> list[dict[str, Any]]:
    layer = LlamaLayer().cuda().bfloat16().eval()
    tokens = 4096
    x = torch.randn(1, tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = lambda: layer(x)  # noqa: E731
        nvfly_call = routed(eager)
        fresh_decisions()
        row = checked({"case": "llama-prefill", "batch": 1, "tokens": tokens}, eager(), nvfly_call())
        row.update(sdpa_outcome())
        q = torch.empty(1, Q_HEADS, tokens, HEAD, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(1, KV_HEADS, tokens, HEAD, device="cuda", dtype=torch.bfloat16)
        row["torch_sdpa_backend"] = torch_backend(q, k, k, True)
        return [timed(row, eager, quick, compile_too)]


def llama_decode(quick: bool, compile_too: bool) -> list[dict[str, Any]]:
    layer = LlamaLayer().cuda().bfloat16().eval()
    rows = []
    context = 32768
    for batch in (1, 32):
        cache = tuple(torch.randn(batch, KV_HEADS, context, HEAD, device="cuda", dtype=torch.bfloat16)
                      for _ in range(2))
        x = torch.randn(batch, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            eager = lambda: layer(x, context - 1, cache)  # noqa: E731
            nvfly_call = routed(eager)
            fresh_decisions()
            row = checked({"case": "llama-decode", "batch": batch, "context": context}, eager(), nvfly_call())
            row.update(sdpa_outcome())
            q = torch.empty(batch, Q_HEADS, 1, HEAD, device="cuda", dtype=torch.bfloat16)
            row["torch_sdpa_backend"] = torch_backend(q, cache[0], cache[1], False)
            rows.append(timed(row, eager, quick, compile_too, graphs=True))
        del cache
    return rows


def attention_rows(case: str, shapes: list[tuple[int, int, int, int, int, int, int]], causal: bool,
                   quick: bool, graphs: bool, mask: Optional[str] = None,
                   compile_too: bool = False) -> list[dict[str, Any]]:
    """SDPA alone on (batch, Hq, Hkv, Sq, Skv, Dqk, Dv); ``mask``: an attn_mask of ``hf_mask``'s kind; with
    ``compile_too`` also compiled without and with nvfly."""
    rows = []
    for batch, hq, hkv, sq, skv, dqk, dv in shapes:
        q = torch.randn(batch, hq, sq, dqk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, hkv, skv, dqk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, hkv, skv, dv, device="cuda", dtype=torch.bfloat16)
        attn_mask = None if mask is None else hf_mask(mask, batch, sq, skv)
        eager = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,  # noqa
                                                       enable_gqa=hq != hkv)
        nvfly_call = routed(eager)
        fresh_decisions()
        row = checked({"case": case, "batch": batch, "heads": f"{hq}/{hkv}", "sq": sq, "skv": skv,
                       "head_dims": f"{dqk}/{dv}", "causal": causal, "attn_mask": mask}, eager(), nvfly_call())
        row.update(sdpa_outcome())
        row["torch_sdpa_backend"] = torch_backend(q, k, v, causal, attn_mask)
        if mask is None:  # what `nvfly explain --sdpa` says of the shape
            row["explain"] = nvfly.torch.explain_sdpa(batch, hq, hkv, sq, skv, dqk, dv, is_causal=causal).verdict()
        rows.append(timed(row, eager, quick, compile_too, graphs=graphs))
        del q, k, v
    return rows


def minimax_decode(quick: bool, compile_too: bool) -> list[dict[str, Any]]:
    return attention_rows("minimax-decode", [(1, 48, 8, 1, 32768, 128, 128), (16, 48, 8, 1, 32768, 128, 128)],
                          False, quick, graphs=True, compile_too=compile_too)


def deepseek_prefill(quick: bool, compile_too: bool) -> list[dict[str, Any]]:
    return attention_rows("deepseek-prefill", [(1, 128, 128, 4096, 4096, 192, 128)], True, quick, graphs=False,
                          compile_too=compile_too)


def hf_mask(kind: str, batch: int, sq: int, skv: int) -> torch.Tensor:
    """Hugging Face's SDPA masks for a padded batch (sequence b's last b * 64 keys are padding): "padding" boolean
    (B, 1, 1, Skv); "additive" bf16 (B, 1, Sq, Skv) causal + padding with finfo.min (the eager mask of HF models)."""
    keys = torch.arange(skv, device="cuda")
    valid = keys[None, :] < (skv - 64 * torch.arange(batch, device="cuda"))[:, None]  # (B, Skv)
    if kind == "padding":
        return valid[:, None, None, :]
    causal = keys[None, :] <= torch.arange(sq, device="cuda")[:, None] + skv - sq  # (Sq, Skv)
    keep = (valid[:, None, :] & causal[None])[:, None]
    return torch.zeros(keep.shape, dtype=torch.bfloat16, device="cuda").masked_fill(~keep, -3.0e38)


def masked_sdpa(quick: bool, compile_too: bool) -> list[dict[str, Any]]:
    """SDPA with HF's masks (the mask read by nvfly's kernel; torch runs its memory-efficient or cuDNN kernel), also
    compiled: the graph's attention bias becomes the nvfly op's attn_mask."""
    return (attention_rows("masked-prefill-padding", [(2, 32, 8, 4096, 4096, 128, 128)], False, quick, False,
                           "padding", compile_too)
            + attention_rows("masked-prefill-additive", [(2, 32, 8, 4096, 4096, 128, 128)], False, quick, False,
                             "additive", compile_too)
            + attention_rows("masked-decode-padding", [(16, 32, 8, 1, 8192, 128, 128)], False, quick, True,
                             "padding", compile_too))


def spec_decode(quick: bool, compile_too: bool) -> list[dict[str, Any]]:
    """Speculative decoding's verification step: the Llama layer on 4 draft tokens at the end of a 32K cache, then
    SDPA alone at Sq 4 (Sq 2 and 8 too without ``--quick``) and with a padding mask over a padded batch."""
    context, drafts = 32768, 4
    layer = LlamaLayer().cuda().bfloat16().eval()
    cache = tuple(torch.randn(1, KV_HEADS, context, HEAD, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(1, drafts, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = lambda: layer(x, context - drafts, cache)  # noqa: E731
        nvfly_call = routed(eager)
        fresh_decisions()
        row = checked({"case": "spec-decode-layer", "batch": 1, "sq": drafts, "context": context}, eager(),
                      nvfly_call())
        row.update(sdpa_outcome())
        q = torch.empty(1, Q_HEADS, drafts, HEAD, device="cuda", dtype=torch.bfloat16)
        row["torch_sdpa_backend"] = torch_backend(q, cache[0], cache[1], False)
        row["explain"] = nvfly.torch.explain_sdpa(1, Q_HEADS, KV_HEADS, drafts, context, HEAD).verdict()
        rows = [timed(row, eager, quick, compile_too, graphs=True)]
    del cache
    torch.cuda.empty_cache()
    shapes = [(batch, Q_HEADS, KV_HEADS, sq, context, HEAD, HEAD)
              for batch, sq in ([(1, 4), (8, 4)] if quick else [(1, 2), (1, 4), (1, 8), (8, 4)])]
    batched = [(8, Q_HEADS, KV_HEADS, drafts, context, HEAD, HEAD)]
    return (rows + attention_rows("spec-decode", shapes, False, quick, graphs=True)
            + attention_rows("spec-decode-padding", batched, False, quick, True, "padding")
            + attention_rows("spec-decode-hf-mask", batched, False, quick, True, "additive"))


def llama_train(quick: bool, compile_too: bool) -> list[dict[str, Any]]:
    layer = LlamaLayer().cuda().bfloat16().train()
    tokens = 4096
    x = torch.randn(1, tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(1, tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    params = list(layer.parameters())

    forward = lambda: layer(x)  # noqa: E731

    def step(forward: Callable[[], torch.Tensor] = forward) -> list[torch.Tensor]:
        return list(torch.autograd.grad(forward(), params, grad))

    def compiled_step(name: str) -> Callable[[], Any]:
        compiled = torch.compile(_own_code(forward, name))  # the forward; its backward compiles at the first grad
        return lambda: step(compiled)

    nvfly_step = routed(step)
    fresh_decisions()
    eager_grads, nvfly_grads = step(), nvfly_step()
    row: dict[str, Any] = {"case": "llama-train", "batch": 1, "tokens": tokens}
    row["grad_rel_err_vs_eager"] = max(rel_err(n, e) for n, e in zip(nvfly_grads, eager_grads))
    row["rel_err_vs_eager"] = row["grad_rel_err_vs_eager"]
    row["same_as_eager"] = row["grad_rel_err_vs_eager"] < MAX_REL_ERR
    row.update(sdpa_outcome())
    q = torch.empty(1, Q_HEADS, tokens, HEAD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(1, KV_HEADS, tokens, HEAD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    row["torch_sdpa_backend"] = torch_backend(q, k, k, True)
    return [timed(row, step, quick, compile_too, compile_fn=compiled_step)]


FLEX_SHAPES = [  # (case, batch, Hq, Hkv, Sq, Skv, Dqk, Dv, tanh soft-cap, mask: None, "causal" or a causal window)
    ("gemma2-flex-prefill", 1, 16, 8, 8192, 8192, 256, 256, 50.0, 4096),  # Gemma-2-9B-like attention
    ("deepseek-flex-prefill", 1, 128, 128, 4096, 4096, 192, 128, None, "causal"),  # DeepSeek-V3-like (issue 28)
    ("minimax-flex-decode", 1, 48, 8, 1, 32768, 128, 128, None, None),
    ("llama-flex-decode", 1, 32, 8, 1, 32768, 128, 128, None, None)]


def flex_case(quick: bool, compile_too: bool) -> list[dict[str, Any]]:
    """flex_attention as a user calls it: eager (torch's dense path), routed (nvfly's kernels, the mods traced from
    flex's graphs), and under torch.compile: Inductor's Triton flex kernels (``flex_triton_ms``) and nvfly as the
    backend (``kernel_options={"NVFLY": True}``). The Gemma-2-like row: tanh soft-capping 50 and a causal
    sliding window of 4096 as a BlockMask (8K tokens, D 256); the DeepSeek-V3-like row: 128 heads, Dqk 192 / Dv 128,
    causal as a BlockMask (4K tokens)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    rows = []
    for case, batch, hq, hkv, sq, skv, dqk, dv, cap, mask in FLEX_SHAPES:
        q = torch.randn(batch, hq, sq, dqk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, hkv, skv, dqk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, hkv, skv, dv, device="cuda", dtype=torch.bfloat16)
        kwargs: dict[str, Any] = {"enable_gqa": hq != hkv}
        if cap is not None:
            kwargs["score_mod"] = lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)
        if mask is not None:
            window = skv if mask == "causal" else mask

            def causal_window(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
            kwargs["block_mask"] = create_block_mask(causal_window, None, None, sq, skv, device="cuda")
        eager = lambda: flex_attention(q, k, v, **kwargs)  # noqa: E731
        nvfly_call = routed(eager)
        fresh_decisions()
        row = checked({"case": case, "batch": batch, "heads": f"{hq}/{hkv}", "sq": sq, "skv": skv,
                       "head_dims": f"{dqk}/{dv}", "softcap": cap, "mask": mask}, eager(), nvfly_call())
        flex = [d for d in decisions() if d.op == "flex_attention" and d.where == "eager"]
        row.update({"torch_sdpa_backend": "flex_attention (eager: dense math)",
                    "nvfly_kernels": sorted({c for d in flex for c in d.candidates if d.reason is None}),
                    "declined": sorted({d.reason for d in flex if d.reason})})
        timed(row, eager, quick)
        if compile_too:
            compiled_flex(row, q, k, v, kwargs, eager, graphs=sq <= 16, rounds=3 if quick else 5)
            print(f"{case}: compiled flex (Triton) {row.get('flex_triton_ms', row.get('flex_triton_error'))}, "
                  f"nvfly backend {row.get('nvfly_ms', row.get('nvfly_error'))}; reduce-overhead: Triton "
                  f"{row.get('flex_triton_graph_ms')}, nvfly {row.get('nvfly_graph_ms')}", flush=True)
        rows.append(row)
        del q, k, v
    return rows


def gemma2_block(quick: bool, compile_too: bool) -> list[dict[str, Any]]:
    """The Gemma-2-like block (``Gemma2Layer``) on 8K tokens: eager (flex_attention's dense path), routed (nvfly's
    kernels for the attention), torch.compile (Inductor's Triton flex kernel: ``inductor_ms``, also given as
    ``flex_triton_ms``) and torch.compile with ``nvfly.torch.install()`` (nvfly's flex backend by the auto rule)."""
    tokens = 8192
    layer = Gemma2Layer(tokens).cuda().bfloat16().eval()
    x = torch.randn(1, tokens, layer.hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = lambda: layer(x)  # noqa: E731
        nvfly_call = routed(eager)
        fresh_decisions()
        row = checked({"case": "gemma2-block", "batch": 1, "tokens": tokens, "softcap": layer.softcap,
                       "window": 4096}, eager(), nvfly_call())
        flex = [d for d in decisions() if d.op == "flex_attention" and d.where == "eager"]
        row.update({"torch_sdpa_backend": "flex_attention (eager: dense math)",
                    "nvfly_kernels": sorted({c for d in flex for c in d.candidates if d.reason is None}),
                    "declined": sorted({d.reason for d in flex if d.reason})})
        timed(row, eager, quick, compile_too)
    if "inductor_ms" in row:
        row["flex_triton_ms"] = row["inductor_ms"]
    return [row]


def _flex_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any],
               options: Optional[dict[str, Any]]) -> Any:
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(q, k, v, kernel_options=options, **kwargs)


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` (its closure and defaults too) on a copy of its code object: Dynamo keeps its cache per code object
    (what the call runs is traced inline into it), so each variant's compiled entries and guards stay apart and
    their timings can interleave."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)


def compiled_flex(row: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any],
                  eager: Callable[[], Any], graphs: bool, rounds: int) -> None:
    """Compiled flex_attention into ``row``: Inductor's Triton flex kernels (``flex_triton_ms``) and nvfly as the
    backend (``nvfly_ms``), timed interleaved (medians of ``rounds``: the host's drift lands on both); with
    ``graphs`` (decode rows) also both under ``mode="reduce-overhead"`` (CUDA graphs: no host time per call,
    ``*_graph_ms``; K and V marked static, as a serving loop's cache), as a serving loop runs decode steps."""
    torch._dynamo.reset()
    variants = ["flex_triton", "nvfly"] + (["flex_triton_graph", "nvfly_graph"] if graphs else [])
    if graphs:  # the KV cache at a fixed address, as a serving loop keeps it (else each replay copies it in first)
        for cache in (k, v):
            torch._dynamo.mark_static_address(cache)
    calls = {}
    for key in variants:
        mode = "reduce-overhead" if key.endswith("_graph") else None
        options = {"NVFLY": True} if key.startswith("nvfly") else None
        compiled = torch.compile(_own_code(_flex_call, f"flex_{key}"), mode=mode)
        call = lambda compiled=compiled, options=options: compiled(q, k, v, kwargs, options)  # noqa: E731
        try:
            # nvfly's passes installed while the nvfly variants compile (no Dynamo reset: the others' entries stay)
            with nvfly_installed() if key.startswith("nvfly") else contextlib.nullcontext():
                for _ in range(3 if mode else 1):  # reduce-overhead records its graph on a later call
                    out = call()
            row[f"{key}_rel_err_vs_eager"] = rel_err(out.clone(), eager())
            calls[key] = call
        except Exception as exc:  # noqa: BLE001 - a peer that cannot compile this shape: recorded, not fatal
            row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    times = interleaved_ms(calls, rounds, 10, 40)
    for key, values in times.items():
        row[f"{key}_ms"] = statistics.median(values)
    for suffix in ("", "_graph"):
        if row.get(f"flex_triton{suffix}_ms") and row.get(f"nvfly{suffix}_ms"):
            row[f"nvfly_vs_flex_triton{suffix}"] = row[f"flex_triton{suffix}_ms"] / row[f"nvfly{suffix}_ms"]


def flex_profile(case: str = "minimax-flex-decode", calls: int = 20) -> None:
    """Where a compiled flex_attention call's time goes (``--profile``, < 60 s): for ``case`` of ``FLEX_SHAPES``,
    Inductor's Triton flex and nvfly as its backend, each: do_bench's ms (as ``flex_case``), the host's enqueue
    time per call (``calls`` calls, no sync inside: equal to the ms when the call is host-bound), and
    torch.profiler's table over ``calls`` calls (the CPU-side ops by self time, then the CUDA kernels); for nvfly
    also cProfile's functions by own time; eager ``nvfly.ops.attention.decode`` on the same tensors is the floor
    (its kernels alone), and ``nvfly::flex_attention`` called directly the op's own share of the compiled call."""
    import cProfile
    import io
    import pstats
    from torch.nn.attention.flex_attention import flex_attention
    from torch.profiler import ProfilerActivity, profile
    from benchmarks.device_time import host_us
    from nvfly.ops import attention
    _, batch, hq, hkv, sq, skv, dqk, dv, _, _ = next(shape for shape in FLEX_SHAPES if shape[0] == case)
    q = torch.randn(batch, hq, sq, dqk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, hkv, skv, dqk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, hkv, skv, dv, device="cuda", dtype=torch.bfloat16)
    calls_of = {"eager nvfly decode": lambda: attention.decode(q.transpose(1, 2), k.transpose(1, 2),
                                                              v.transpose(1, 2), causal=False),
                # the op alone, as the compiled graph calls it (no mask: block sizes 2**30; the LSE unread)
                "nvfly::flex_attention op": lambda: torch.ops.nvfly.flex_attention.default(
                    q, k, v, None, None, None, None, [], [], "", "", d ** -0.5, 1 << 30, 1 << 30, "decode", False)}
    for key, options in (("compiled flex (Triton)", None), ("compiled flex (nvfly)", {"NVFLY": True})):
        with compiling(options is not None):
            compiled = torch.compile(flex_attention)
            call = lambda compiled=compiled, options=options: compiled(  # noqa: E731
                q, k, v, kernel_options=options, enable_gqa=hq != hkv)
            call()
        calls_of[key] = call
    for key, call in calls_of.items():
        host = host_us(call, calls)
        ms = bench_ms(call, 10, 40)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        table = prof.key_averages()
        print(f"==== {case} {key}: do_bench {ms * 1e3:.1f} us, host enqueue {host:.1f} us per call")
        print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        print(table.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60), flush=True)
        if key == "compiled flex (nvfly)":  # the Python side of the host time, function by function
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(10 * calls):
                call()
            profiler.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
            print(f"==== {case} {key}: cProfile over {10 * calls} calls\n{text.getvalue()}", flush=True)


CASES: dict[str, Callable[[bool, bool], list[dict[str, Any]]]] = {
    "llama-prefill": llama_prefill, "llama-decode": llama_decode, "minimax-decode": minimax_decode,
    "deepseek-prefill": deepseek_prefill, "llama-train": llama_train, "masked-sdpa": masked_sdpa,
    "spec-decode": spec_decode, "flex": flex_case, "gemma2-block": gemma2_block}


def model_and_phase(case: str) -> tuple[str, str]:
    """The results' ``model`` and ``phase`` of a case name (e.g. "llama-decode": ("llama", "decode"))."""
    phase = next((p for p in ("train", "decode", "prefill") if p in case), "prefill")
    return case.split("-")[0], phase


def label(row: dict[str, Any]) -> str:
    sq = row.get("sq")
    return f"{row['case']} B{row['batch']}" + (f" Sq{sq}" if sq and 1 < sq <= 16 else "")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter timing, no torch.compile columns (< 90 s)")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--profile", action="store_true", help="with --cases flex: where a compiled decode call's time "
                   "goes (torch.profiler, host enqueue time; writes nothing; < 60 s)")
    args = p.parse_args(argv)
    if args.profile:
        if args.cases != ["flex"]:
            p.error("--profile profiles the flex decode rows: pass --cases flex")
        for case in ("minimax-flex-decode", "llama-flex-decode"):
            flex_profile(case)
        return 0
    t_start = time.time()
    torch.manual_seed(0)
    nvfly.torch.install_routing()
    rows: list[dict[str, Any]] = []
    for name in args.cases:
        for row in CASES[name](args.quick, not args.quick):
            row["model"], row["phase"] = model_and_phase(row["case"])
            rows.append(row)
            extra = f"  graph x{row['graph_speedup']:.2f}" if row.get("graph_speedup") else ""
            extra += (f"  compiled {row['inductor_ms']:.3f} ms, with nvfly {row['nvfly_ms']:.3f} ms "
                      f"({'; '.join(row['nvfly_sdpa']) or 'no SDPA rewrite'})" if row.get("inductor_ms") else "")
            print(f"{label(row):>22}  eager {row['eager_ms']:.3f} ms  routed {row['routed_ms']:.3f} ms "
                  f"(x{row['speedup']:.2f}, rounds x{row['speedup_range'][0]:.2f}-{row['speedup_range'][1]:.2f}, "
                  f"err {row['rel_err_vs_eager']:.1e}"
                  f"{'' if row['same_as_eager'] else ' MISMATCH'}){extra}  torch picks {row['torch_sdpa_backend']}; "
                  f"nvfly: {row['nvfly_kernels'] or 'none'}; declined: {row['declined'] or 'none'}"
                  + (f"; other routed ops: {row['other_ops']}" if row.get("other_ops") else ""), flush=True)
        torch.cuda.empty_cache()
    summary = {"geomean_speedup": geomean([r["speedup"] for r in rows]),
               "all_same_as_eager": all(r["same_as_eager"] for r in rows), "seconds": time.time() - t_start}
    print(summary)
    print("wrote", write_results("models", rows, {"summary": summary, "quick": args.quick}))
    series = {"routed nvfly": [r["speedup"] for r in rows]}
    for key, name in (("inductor_ms", "torch.compile"), ("nvfly_ms", "torch.compile + nvfly.install()")):
        if any(key in r for r in rows):
            series[name] = [r["eager_ms"] / r[key] if r.get(key) else 0 for r in rows]
    print("wrote", plot("models", [label(r) for r in rows], series, "speedup over eager torch"))
    return 0 if summary["all_same_as_eager"] else 1


if __name__ == "__main__":
    sys.exit(main())
