"""Decode attention: nvfly vs SDPA (each backend that accepts the inputs: cuDNN, flash, efficient, math, via
``torch.nn.attention.sdpa_kernel``) vs ``torch.compile``d flex_attention (its Triton decode), in one process.

For each shape, correctness first (nvfly against the float32 reference of ``nvfly.ops.attention.reference`` on fresh
random inputs), then the median time of each (``do_bench``, L2 flushed between calls) and the bandwidth: bytes of
q, k, v read and o written per second (``bytes_moved``). Every sequence has the whole cache (peers have no ragged
lengths); paged rows time nvfly on a shuffled page table and the peers on the contiguous cache of the same bytes
(none of them takes pages). Queries are the cache's last Sq positions (causal aligned to the end: SDPA gets
``causal_lower_right``, flex a block mask); mod rows give the same function to nvfly and flex (flex's q_idx is the
query's index, so it is shifted to the position) and SDPA is not timed on them. The ``window4096-blockmask`` row
gives nvfly the window as a flex BlockMask (its empty blocks not read; TB/s on the bytes of the blocks read, for
every column) and flex the window's mask_mod. ``--fp8`` adds each row's shape with fp8 (e4m3) K/V caches and
per-head scales (``kv`` = "fp8"; nvfly only, no peer takes fp8 caches; TB/s on the bytes moved, K/V at 1 byte).
Usage: python benchmarks/attention.py --decode [--quick] [--sq 1 4 8] [--layouts ...] [--models ...] [--no-mods]
[--no-flex] [--fp8] [--name NAME]; paged layouts run at Sq = 1; ``--layouts bhsd`` (not a default row) keeps the
cache heads-first, as the compiled flex op and SDPA's route bind it.
Writes benchmarks/results/attention_decode_h200.json and .png.
``--decode-variants NAME ...`` also times (after checking) nvfly with each named plan variant of
``api.DECODE_VARIANTS`` beside the default, in turn (three rounds, medians: ``nvfly_<variant>_ms``/``_tbs``/``_err``,
and each plan's stages/row_warps/warp_tiles/splits/swapped); with ``--quick`` the rows are the suite's contiguous
rows of ``--models`` at ``--sq`` and the quick paged row (at Sq 1), fp8 only with ``--fp8`` (e.g. ``--decode
--models llama8b --no-mods --fp8 --decode-variants stages4 rows16 warp32 --quick``: 10 rows, ~2 min; the split-KV
combine's launch: ``--decode --quick --sq 1 --no-flex --decode-variants pdl fixup``, with ``--fp8`` for fp8 caches).
The decode default runs the warpgroup-MMA GQA kernel at 16-bit d 128, 16 < Sq·G <= 64; beside it the decode kernel
(``mma_sync``), the wgmma kernel at every Sq·G <= 64 (``wgmma``) and with its split plans' combine as a programmatic
dependent launch (``wgmma_pdl``): ``--decode --quick --sq 1 2 4 8 16 --no-flex --no-mods --decode-variants mma_sync
wgmma wgmma_pdl``; at 96/128 rows on two consumer warpgroups: ``--decode-variants wgmma_wide`` at ``--sq 16``.
Writes benchmarks/results/attention_decode_variants_h200.json after every row.

MLA decode (``--decode --mla [--quick] [--no-flex]``): DeepSeek's latent cache (one KV head of 576 columns, V its
first 512) at Sq = 1, B 1/32/128, 128 heads (V3) and 16, S 4K and 32K, nvfly on shuffled pages of 64 tokens. The
peers see the same problem as one head of Hq query rows (MQA absorbed: q (B, 1, Hq, 576), k = the cache (B, 1, S,
576), v its first 512 columns as a view; no expanded copy): SDPA efficient and math, and compiled flex_attention.
Correctness first (nvfly's first sequence against a float32 computation), then the median times, and nvfly's
replayed from a CUDA graph of 8 calls (``nvfly_graph_ms``: no launch or host cost, a warm L2); TB/s count the
cache once (576 columns a key) plus q and o (``mla_bytes``), TFLOP/s 2 · (576 + 512) per (query head, key)
(``mla_flops``). ``--mla-variants`` also times (after checking) nvfly's kernel with each combination of
``MlaPlan.chunked`` and ``.evict_first`` (``nvfly_<variant>_ms``: stage, chunked, stage_evict, chunked_evict; their
geomean speed over the default plan's in the summary). Writes benchmarks/results/attention_mla_h200.json and .png.

Prefill (``--prefill [--quick] [--prefill-models ...] [--no-flex] [--name NAME]``): the prefill suite of ../shared/docs/anchors.md (B·S = 16K tokens at
H·D = 2048 for D 64/128/256, GQA 32/8 and 64/8, DeepSeek-like Dqk 192/Dv 128 H 128, MiniMax-like 48/8), each
non-causal and causal (Sq = Skv, so SDPA's and flex's causal masks are nvfly's). Correctness first: nvfly's last
``CHECK_ROWS`` query rows of the first sequence and first two KV heads' query heads against the float32 reference
(the whole problem's reference would not fit), then nvfly, SDPA per backend (cuDNN, flash, efficient) and compiled
flex_attention timed in the same process; TFLOP/s count the unmasked work only (``prefill_flops``: causal about
halves it). Shapes nvfly declines (its eligibility reason in ``nvfly_skipped``) still time the peers. Mod rows
(``--mods``, the default; with ``--prefill-models`` only if it names ``mods``): causal GQA 32/8 at B 4 x 4K and GQA
64/8 at one 16K sequence (``--quick``: the first only) with soft-capping, ALiBi, a 1024-key sliding window (nvfly's
``window``), 4 documents a sequence (nvfly: a BlockMask of the mask), a relative-position bias table (256 distances
each way, per head) and, not causal, prefix-LM (a random prefix of a quarter to a half of each sequence; nvfly: a
BlockMask of the mask) against compiled flex_attention with the same functions and its BlockMask; TFLOP/s on the
pairs the mask keeps. Varlen rows (not with ``--quick``; with
``--prefill-models`` only if it names ``varlen``): 8 sequences of mixed lengths (63 to 6011 tokens) packed along S,
GQA 32/8 D 128, non-causal and causal, nvfly's ``prefill_varlen`` against SDPA on a nested (jagged) tensor of the
same sequences and flex over the packed tokens with a document mask. ``--quick`` times flex on the mod rows only.
``--prefill-variants`` also times (after checking) nvfly's kernel with each combination of ``PrefillPlan.overlap``
and ``.pingpong`` (``nvfly_<variant>_ms``: serial, overlap, pingpong, overlap_pingpong; their geomeans against cuDNN
in the summary); ``nvfly_ms`` is the default plan's.
Writes benchmarks/results/attention_prefill_h200.json and .png.

FP8 prefill (``--prefill --fp8 [--quick]``): nvfly's e4m3 prefill (q, k, v quantised per tensor, descale = amax /
448 rounded up to a power of two, bf16 out) at B·S = 16K tokens, H·D = 2048 for D 128 at 16K and 4K, D 64 and 256
at 16K, and GQA 64/8 at 16K (with ``--quick`` D 128 16K only), each non-causal and causal, next to nvfly's bf16
prefill and cuDNN's bf16 SDPA on the same (dequantised) values (torch has no fp8 SDPA), in one process.
Correctness first: the last ``CHECK_ROWS`` rows of the first sequence against the float32 reference of the
dequantised inputs (fp8 P: within ``FP8_TOLERANCE``).
``nvfly_fp8_ms`` is the whole call, including its pass that transposes V (``transpose_ms``, timed alone too, with
its bandwidth ``transpose_gbps`` and the torch strided copy it replaced, ``transpose_torch_ms``;
``fp8_kernel_estimate_tflops``: on the call's time less the pass's);
``--prefill-variants`` also times (after checking) each of ``PREFILL_FP8_VARIANTS`` (``nvfly_fp8_<variant>_ms``, and
``fp8_<variant>_kernel_estimate_tflops``): the overlap variants, ``wide`` (D 128's 192-key blocks, 128 elsewhere,
with the softmax's row maxima by a tree), ``wide_chain`` (the same by the chain), ``tree_max`` (128 keys, tree) and
``wide_poly2``/``wide_poly4`` (wide with 2 or 4 of every 16 exp2 by a polynomial on the FMA pipe, not MUFU),
``poly2``/``poly4``/``tree_poly2`` (the same at 128 keys); ``--per-head-descales`` the call with the same factors
as (B, Hkv) descales (``nvfly_fp8_per_head_ms``: ``PrefillPlan.per_head_descales``).
Writes benchmarks/results/attention_prefill_fp8_h200.json and .png.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_ms, geomean, graph_ms, interleaved_ms, plot, rel_err, write_results  # noqa: E402
from nvfly.ops import attention  # noqa: E402
from nvfly.ops.attention import api as attention_api  # noqa: E402
from nvfly.ops.attention import mods as M  # noqa: E402
from nvfly.ops.attention.gqa_plan import gqa_declined, gqa_plan  # noqa: E402
from nvfly.ops.attention.mla_api import plan_options as mla_plan_options  # noqa: E402
from nvfly.ops.attention.plan import swap_declined  # noqa: E402
from nvfly.ops.attention.prefill_api import plan_options, transposed_values, transposed_values_torch  # noqa: E402
from nvfly.runtime.driver import plan_sm_count  # noqa: E402

# (name, batch, skv, hq, hkv, d): the decode suite of ../shared/docs/anchors.md
SUITE = [("llama8b", 1, 131072, 32, 8, 128), ("llama8b", 32, 4096, 32, 8, 128), ("llama8b", 128, 4096, 32, 8, 128),
         ("llama70b", 64, 8192, 64, 8, 128), ("minimax", 1, 32768, 48, 8, 128), ("minimax", 16, 32768, 48, 8, 128),
         ("minimax", 64, 8192, 48, 8, 128)]
QUICK = [(("llama8b", 1, 131072, 32, 8, 128), 1, "bshd"), (("minimax", 16, 32768, 48, 8, 128), 1, "bshd"),
         (("minimax", 16, 32768, 48, 8, 128), 4, "bshd"), (("llama8b", 32, 4096, 32, 8, 128), 1, "paged16")]
LAYOUTS = ("bshd", "paged16", "paged64")  # the default rows
# "bhsd": the contiguous cache in heads-first memory ((B, H, S, D), as flex and SDPA hold it) passed as decode's
# (B, S, H, D) view: what the compiled flex op and SDPA's route bind (``attention.bound_decode(heads_first=True)``)
LAYOUT_CHOICES = LAYOUTS + ("bhsd",)
MOD_SHAPE = ("llama8b", 16, 8192, 32, 8, 128)
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")


def make_mods(hq: int) -> dict[str, dict[str, Any]]:
    slopes = torch.tensor(M.alibi_slopes(hq), device="cuda")
    return {"softcap50": {"score_mod": M.soft_cap(50.0)}, "alibi": {"score_mod": M.alibi(slopes)},
            "window4096": {"mask_mod": M.sliding_window(4096)}, "window4096-blockmask": {}}


def window_block_mask(batch: int, sq: int, skv: int, window: int) -> Any:
    """The sliding window as a BlockMask for the Sq queries at the end of skv-key sequences (mask_mod: positions)."""
    from torch.nn.attention.flex_attention import create_block_mask
    mask_mod = M.sliding_window(window)

    def at_positions(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + skv - sq, kv_idx)
    block_mask = create_block_mask(at_positions, batch, None, sq, skv, device="cuda")
    block_mask.mask_mod = mask_mod
    return block_mask


def paged(k: torch.Tensor, v: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cache as shuffled pages of ``page`` tokens and its block table."""
    batch, skv = k.shape[:2]
    pages = skv // page
    order = torch.randperm(batch * pages, device="cuda")
    k_pages = torch.empty(batch * pages, page, *k.shape[2:], dtype=k.dtype, device="cuda")
    v_pages = torch.empty(batch * pages, page, *v.shape[2:], dtype=v.dtype, device="cuda")
    as_bits = (lambda t: t.view(torch.uint8)) if k.element_size() == 1 else (lambda t: t)  # fp8: copy bytes
    as_bits(k_pages)[order] = as_bits(k).reshape(batch * pages, page, *k.shape[2:])
    as_bits(v_pages)[order] = as_bits(v).reshape(batch * pages, page, *v.shape[2:])
    return k_pages, v_pages, order.view(batch, pages).to(torch.int32)


def sdpa_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
               backends: tuple[str, ...] = SDPA_BACKENDS) -> dict[str, Callable[[], Any]]:
    """SDPA per backend of ``backends`` on (B, H, S, D) views, causal aligned to the end (or not at all); the
    backends that refuse the inputs are left out."""
    from torch.nn.attention.bias import causal_lower_right
    sq, skv = q.shape[1], k.shape[1]
    mask = causal_lower_right(sq, skv) if causal and sq > 1 else None
    return backend_calls(backends, "", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                         enable_gqa=True)


def backend_calls(backends: tuple[str, ...], label: str, *args: Any, **kwargs: Any) -> dict[str, Callable[[], Any]]:
    """``F.scaled_dot_product_attention(*args, **kwargs)`` under each SDPA backend of ``backends`` that takes them
    (a call each, run once here; the others are named as not run, ``label`` after the backend's name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    calls = {}
    for name in backends:
        backend = getattr(SDPBackend, {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                                       "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}[name])

        def call(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(*args, **kwargs)
        try:
            call()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a backend that does not take these inputs is not timed
            print(f"    sdpa {name}{label}: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
            continue
        calls[name] = call
    return calls


_FLEX: dict = {}  # the compiled flex_attention, made once a process


def flex_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: dict[str, Any],
              causal: bool = True) -> Optional[Callable]:
    """torch.compile'd flex_attention with the same causal alignment (or none) and mods (q_idx shifted to the
    position)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "flex" not in _FLEX:
        _FLEX["flex"] = torch.compile(flex_attention, dynamic=False)
    sq, skv = q.shape[1], k.shape[1]
    shift = skv - sq
    user_mask, user_score = mods.get("mask_mod"), mods.get("score_mod")

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx + shift if causal else kv_idx >= 0
        return keep & user_mask(b, h, q_idx + shift, kv_idx) if user_mask is not None else keep

    score_mod = None
    if user_score is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return user_score(score, b, h, q_idx + shift, kv_idx)
    block_mask = (create_block_mask(mask_mod, None, None, sq, skv, device="cuda") if causal or user_mask is not None
                  else None)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    fn = _FLEX["flex"]

    def call():
        return fn(qt, kt, vt, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    try:
        call()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        print(f"    flex: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
        return None
    return call


def plan_of(shape: tuple, sq: int, layout: str, kv: str, options: dict[str, Any], mod: str = "none"
            ) -> dict[str, Any]:
    """The decode plan's choices for a row (every sequence the whole cache) under plan options ``options``."""
    name, batch, skv, hq, hkv, d = shape
    page = int(layout[len("paged"):]) if layout.startswith("paged") else 0
    with attention_api.plan_options(**options):
        wgmma, wide = attention_api.wgmma_choice(attention_api.current_plan_options(), sq, hq // hkv, kv == "fp8")
    options = {key: value for key, value in options.items() if key not in ("wgmma", "wgmma_wide")}
    # the warpgroup-MMA GQA kernel where decode would choose it and it takes the row, else the decode kernel's plan
    if wgmma:
        declined = gqa_declined(sq, hq // hkv, d, d, "torch.bfloat16", kv == "fp8", mod != "none", bool(page),
                                page, wide)
        if not declined:
            plan = gqa_plan(batch, sq, hkv, hq // hkv, skv, plan_sm_count(0), bool(page), page,
                            pdl_combine=bool(options.get("pdl_combine")), wide=wide, fp8=kv == "fp8")
            return {"kernel": "wgmma", "stages": plan.stages, "splits": plan.splits, "consumers": plan.consumers,
                    **({"combine": "pdl"} if plan.pdl_combine else {})}
    plan = attention.decode_plan(batch, sq, hkv, hq // hkv, d, d, skv, plan_sm_count(0), bool(page), page,
                                 fp8=kv == "fp8", **options)
    chosen = {"stages": plan.stages, "row_warps": plan.row_warps, "warp_tiles": plan.warp_tiles,
              "splits": plan.splits, "swapped": int(plan.swapped)}
    if plan.pdl_combine or plan.fixup_combine:  # how the splits' partials are merged, where not the combine kernel's
        chosen["combine"] = "pdl" if plan.pdl_combine else "fixup"
    if options.get("swapped") and not plan.swapped:  # why the row ran the plan without it
        chosen["swap_declined"] = swap_declined(sq, hq // hkv, options.get("row_warps", 0),
                                                options.get("warp_tiles", 0))
    return chosen


def run_row(shape: tuple, sq: int, layout: str, mod: str, with_flex: bool, kv: str = "bf16",
            variants: tuple[str, ...] = ()) -> dict[str, Any]:
    """One row; ``variants``: names of ``api.DECODE_VARIANTS`` checked, then timed in turn beside the default."""
    name, batch, skv, hq, hkv, d = shape
    torch.manual_seed(0)
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    k = torch.randn(batch, skv, hkv, d, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    v = torch.randn(batch, skv, hkv, d, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    mods = make_mods(hq)[mod] if mod != "none" else {}
    flex_mods = mods
    if mod == "window4096-blockmask":
        mods, flex_mods = {"block_mask": window_block_mask(batch, sq, skv, 4096)}, make_mods(hq)["window4096"]
    if kv == "fp8":
        scales = torch.rand(2, hkv, device="cuda") + 0.5
        mods = {**mods, "k_scale": scales[0], "v_scale": scales[1]}
    if layout == "bhsd":  # the same values in heads-first memory, as decode's (B, S, H, D) view
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    nk, nv, table = paged(k, v, int(layout[len("paged"):])) if layout.startswith("paged") else (k, v, None)
    out = attention.decode(q, nk, nv, block_table=table, **mods)
    want, _ = attention.reference(q, nk, nv, block_table=table, **mods)
    err = rel_err(out.float(), want)
    row: dict[str, Any] = {"model": name, "batch": batch, "sq": sq, "skv": skv, "hq": hq, "hkv": hkv, "d": d,
                           "layout": layout, "mod": mod, "kv": kv, "nvfly_err": err, "ok": err < 2e-2}
    for variant in variants:
        options = attention_api.DECODE_VARIANTS[variant]
        with attention_api.plan_options(**options):
            out.fill_(float("nan"))
            attention.decode(q, nk, nv, block_table=table, out=out, **mods)
        row[f"nvfly_{variant}_err"] = rel_err(out.float(), want)
        row["ok"] = row["ok"] and row[f"nvfly_{variant}_err"] < 2e-2
        row[f"{variant}_plan"] = plan_of(shape, sq, layout, kv, options, mod)
    del want, out
    nbytes = attention.bytes_moved(q, nk, nv, block_table=table, block_mask=mods.get("block_mask"))
    row["nvfly_ms"] = bench_ms(lambda: attention.decode(q, nk, nv, block_table=table, validate=False, **mods))
    row["nvfly_tbs"] = nbytes / row["nvfly_ms"] / 1e9
    if variants:  # their differences are a few percent: the default and each variant in turn, three rounds
        row["default_plan"] = plan_of(shape, sq, layout, kv, {}, mod)
        def call():
            attention.decode(q, nk, nv, block_table=table, validate=False, **mods)
        calls = {f"nvfly_{variant}": call for variant in ("default", *variants)}
        # the same call, each variant's plan options around its measurement (not around every call)
        around = {f"nvfly_{variant}": (lambda options=attention_api.DECODE_VARIANTS[variant]:
                                       attention_api.plan_options(**options)) for variant in variants}
        # 50 ms a measurement (hundreds of calls of 0.05-1 ms): nine rows of six plans stay within ~3 minutes
        for key, times in interleaved_ms(calls, VARIANT_ROUNDS, warmup_ms=10, rep_ms=50, around=around).items():
            row[f"{key}_ms"] = sorted(times)[len(times) // 2]
            row[f"{key}_tbs"] = nbytes / row[f"{key}_ms"] / 1e9
    if not mods and kv == "bf16":
        for peer, call in sdpa_calls(q, k, v).items():
            row[f"{peer}_ms"] = bench_ms(call)
    if with_flex and kv == "bf16":
        call = flex_call(q, k, v, flex_mods)
        if call is not None:
            row["flex_ms"] = bench_ms(call)
    for key in [key for key in row if key.endswith("_ms") and not key.startswith("nvfly")]:
        row[key[:-3] + "_tbs"] = nbytes / row[key] / 1e9
        row["vs_" + key[:-3]] = row[key] / row["nvfly_ms"]
    return row


# ---------------------------------------------------------------------------------------------- MLA decode
# (name, batch, skv, hq): DeepSeek-V3 (128 heads; V2-Lite and TP-8 V3 shards have 16)
MLA_SUITE = [(f"mla{hq}", batch, skv, hq) for hq in (128, 16) for batch in (1, 32, 128) for skv in (4096, 32768)]
MLA_QUICK = [("mla128", 1, 32768, 128), ("mla128", 32, 4096, 128), ("mla128", 128, 4096, 128),
             ("mla16", 32, 32768, 16)]
MLA_PAGE = 64
MLA_BACKENDS = ("efficient", "math")  # flash and cuDNN take head dims up to 256
# --mla-variants: nvfly's kernel with each combination of the plan's load options (the default is one of them), and
# the default's with its combine as a programmatic dependent launch (pdl, where the plan splits)
MLA_VARIANTS = {"stage": dict(chunked=False, evict_first=False), "chunked": dict(chunked=True, evict_first=False),
                "stage_evict": dict(chunked=False, evict_first=True),
                "chunked_evict": dict(chunked=True, evict_first=True), "pdl": dict(pdl_combine=True)}


def mla_error(q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor) -> float:
    """nvfly's relative error on the first sequence against float32 softmax(q kᵀ / sqrt(576)) v (Sq = 1: every key
    visible)."""
    rows = q[0].reshape(-1, 576).float()
    keys = cache[0, :, 0].float()
    weights = torch.softmax(rows @ keys.T * 576 ** -0.5, dim=-1)
    return rel_err(out[0].reshape(-1, 512).float(), weights @ keys[:, :512])


def run_mla_row(shape: tuple, with_flex: bool, variants: bool = False) -> dict[str, Any]:
    name, batch, skv, hq = shape
    torch.manual_seed(0)
    q = torch.randn(batch, 1, hq, 576, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(batch, skv, 1, 576, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(batch * skv // MLA_PAGE, device="cuda")  # the cache as shuffled pages
    pages = torch.empty(batch * skv // MLA_PAGE, MLA_PAGE, 1, 576, device="cuda", dtype=torch.bfloat16)
    pages[order] = cache.reshape(-1, MLA_PAGE, 1, 576)
    table = order.view(batch, -1).to(torch.int32)
    row: dict[str, Any] = {"model": name, "batch": batch, "sq": 1, "skv": skv, "hq": hq, "hkv": 1, "dqk": 576,
                           "dv": 512, "layout": f"paged{MLA_PAGE}"}
    out = torch.full((batch, 1, hq, 512), float("nan"), dtype=q.dtype, device="cuda")
    attention.decode(q, pages, pages[..., :512], block_table=table, out=out)
    row["nvfly_err"] = mla_error(q, cache, out)
    row["ok"] = row["nvfly_err"] < 2e-2 and not out.isnan().any().item()
    row["splits"] = attention.mla_plan(batch, 1, hq, skv, plan_sm_count(0), True, MLA_PAGE).splits
    row["nvfly_ms"] = bench_ms(lambda: attention.decode_mla(q, pages, block_table=table, validate=False))
    # replayed from a CUDA graph (no launch or host cost, warm L2: the cache of a small row partly stays in L2)
    graph = graph_ms(lambda: attention.decode_mla(q, pages, block_table=table, validate=False), calls=8, replays=10)
    if graph is not None:
        row["nvfly_graph_ms"] = graph
    if variants:  # checked, then timed in turn (three rounds, medians): their differences are a few percent
        calls = {}
        for variant, options in MLA_VARIANTS.items():
            with mla_plan_options(**options):
                out.fill_(float("nan"))
                attention.decode_mla(q, pages, block_table=table, out=out)
                row[f"nvfly_{variant}_err"] = mla_error(q, cache, out)
                row["ok"] = row["ok"] and row[f"nvfly_{variant}_err"] < 2e-2 and not out.isnan().any().item()

            def call(options=options):
                with mla_plan_options(**options):
                    attention.decode_mla(q, pages, block_table=table, validate=False)
            calls[f"nvfly_{variant}"] = call
        for name, times in interleaved_ms(calls, VARIANT_ROUNDS).items():
            row[f"{name}_ms"] = sorted(times)[len(times) // 2]
    # the peers ((B, S, H, D) arguments): one head of Hq query rows over the contiguous cache and its V view
    rows_q, values = q.view(batch, hq, 1, 576), cache[..., :512]
    for peer, call in sdpa_calls(rows_q, cache, values, False, MLA_BACKENDS).items():
        row[f"{peer}_ms"] = bench_ms(call)
    if with_flex:
        call = flex_call(rows_q, cache, values, {}, False)
        if call is not None:
            row["flex_ms"] = bench_ms(call)
    nbytes = attention.mla_bytes(q, None, skv)
    flops = attention.mla_flops(q, None, skv)
    for key in [key for key in row if key.endswith("_ms")]:
        row[key[:-3] + "_tbs"] = nbytes / row[key] / 1e9
        row[key[:-3] + "_tflops"] = flops / row[key] / 1e9
        if not key.startswith("nvfly"):
            row["vs_" + key[:-3]] = row[key] / row["nvfly_ms"]
    return row


def run_mla(args: argparse.Namespace, argv: Optional[list[str]]) -> int:
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = 256  # one flex compile per shape
    rows, started = [], time.time()
    for shape in MLA_QUICK if args.quick else MLA_SUITE:
        row = run_mla_row(shape, not args.no_flex, args.mla_variants)
        rows.append(row)
        peers = "  ".join(f"{key[:-4]} {row[key]:.2f}" for key in row if key.endswith("_tbs") and key != "nvfly_tbs")
        graph = f" graph {row['nvfly_graph_tbs']:.2f}" if "nvfly_graph_tbs" in row else ""
        print(f"{row['model']:>7} B{row['batch']:<3} Skv{row['skv']:<6} splits {row['splits']:<3} "
              f"err {row['nvfly_err']:.1e}  nvfly {row['nvfly_tbs']:.2f} TB/s {row['nvfly_tflops']:.0f} TFLOP/s"
              f"{graph}  (TB/s: {peers})", flush=True)
        torch.cuda.empty_cache()
    summary = {"seconds": time.time() - started, "all_ok": all(r["ok"] for r in rows),
               "min_nvfly_tbs": min(r["nvfly_tbs"] for r in rows),
               "max_nvfly_tflops": max(r["nvfly_tflops"] for r in rows),
               **{f"geomean_vs_{peer}": geomean([r[f"vs_{peer}"] for r in rows if f"vs_{peer}" in r])
                  for peer in (*MLA_BACKENDS, "flex") if any(f"vs_{peer}" in r for r in rows)}}
    for variant in (MLA_VARIANTS if args.mla_variants else ()):  # each variant's TB/s over the default's
        summary[f"geomean_{variant}_vs_default"] = geomean([r["nvfly_ms"] / r[f"nvfly_{variant}_ms"] for r in rows])
    print(summary)
    command = "python benchmarks/attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    name = args.name or "attention_mla"
    path = write_results(name, rows, {"summary": summary, "command": command, "card": torch.cuda.get_device_name()})
    labels = [f"{r['model']} B{r['batch']} {r['skv'] // 1024}K" for r in rows]
    series = {"nvfly": [r["nvfly_tbs"] for r in rows]}
    for peer in (*MLA_BACKENDS, "flex"):
        if any(f"{peer}_tbs" in r for r in rows):
            series[peer] = [r.get(f"{peer}_tbs", 0.0) for r in rows]
    plot(name, labels, series, "TB/s (the cache once + q + o)")
    print("wrote", path)
    return 0 if summary["all_ok"] else 1


# ---------------------------------------------------------------------------------------------- prefill
# (name, batch, s, hq, hkv, dqk, dv): the prefill suite of ../shared/docs/anchors.md
PREFILL_SUITE = ([(f"d{d}", 16384 // s, s, 2048 // d, 2048 // d, d, d) for d in (64, 128, 256)
                  for s in (1024, 2048, 4096, 8192, 16384)]
                 + [("gqa32/8", 4, 4096, 32, 8, 128, 128), ("gqa64/8", 1, 16384, 64, 8, 128, 128),
                    ("deepseek", 1, 4096, 128, 128, 192, 128), ("minimax", 1, 32768, 48, 8, 128, 128)])
PREFILL_QUICK = [("d128", 4, 4096, 32, 32, 128, 128), ("d128", 2, 8192, 16, 16, 128, 128),
                 ("d128", 1, 16384, 16, 16, 128, 128), ("d64", 8, 2048, 32, 32, 64, 64),
                 ("gqa64/8", 1, 16384, 64, 8, 128, 128)]
# --prefill-variants: nvfly's kernel with each combination of the plan's overlap options (the default is one of them)
# and issue 27's hoisting (PrefillPlan.hoist: positional bounds per row, the mods' indices affine), the mask_mod's
# loads under S with its compares after the wait (prefetch_mask), 192-key blocks at D 64 and 176 at D 128 (wide) and 1
# or 2 of every 16 exp2 by a cubic on the FMA pipe (poly_exp2), O's rescale skipped on a warp vote when no row maximum
# rose (lazy_rescale), the persistent LPT schedule (persistent: a CTA an SM, longest causal tiles first, heads grouped
# for L2; the default's other options); pick some with --only-variants
PREFILL_VARIANTS = {"serial": dict(overlap=False, pingpong=False), "overlap": dict(overlap=True, pingpong=False),
                    "pingpong": dict(overlap=False, pingpong=True),
                    "overlap_pingpong": dict(overlap=True, pingpong=True),
                    "hoist": dict(hoist=True), "hoist_prefetch": dict(hoist=True, prefetch_mask=True),
                    "wide_hoist": dict(wide=True, hoist=True), "poly1_hoist": dict(poly_exp2=1, hoist=True),
                    "poly2_hoist": dict(poly_exp2=2, hoist=True), "lazy_hoist": dict(lazy_rescale=True, hoist=True),
                    "wide_lazy_hoist": dict(wide=True, lazy_rescale=True, hoist=True),
                    "poly4_lazy_hoist": dict(poly_exp2=4, lazy_rescale=True, hoist=True),
                    "wide_poly2_lazy_hoist": dict(wide=True, poly_exp2=2, lazy_rescale=True, hoist=True),
                    "persistent": dict(persistent=True),
                    "persistent_table": dict(persistent=True, unit_table=True)}
# fp8's: the same, and D 128's 192-key blocks (PrefillPlan.block_n; other head dims keep 128) with the row maxima by
# a tree (wide) or by the chain (wide_chain), the tree at 128 keys (tree_max), and 2 or 4 of every 16 exp2 by the
# polynomial on the FMA pipe (PrefillPlan.poly_exp2), at 192 keys (wide_poly*) or 128 (poly*, tree_poly2)
PREFILL_FP8_VARIANTS = {**{name: PREFILL_VARIANTS[name] for name in ("serial", "overlap", "pingpong",
                                                                       "overlap_pingpong")},
                        "wide": dict(wide=True), "wide_chain": dict(wide=True, tree_max=False),
                        "tree_max": dict(tree_max=True), "wide_poly2": dict(wide=True, poly_exp2=2),
                        "wide_poly4": dict(wide=True, poly_exp2=4), "poly2": dict(wide=False, poly_exp2=2),
                        "poly4": dict(wide=False, poly_exp2=4),
                        "tree_poly2": dict(wide=False, tree_max=True, poly_exp2=2)}
VARIANT_ROUNDS = 3
PREFILL_BACKENDS = ("cudnn", "flash", "efficient")  # math would materialise S: not a peer at these sizes
CHECK_ROWS = 256
# the mod rows (causal but prefix-LM's): Llama-like GQA at 4K (--quick: this one only) and GQA 64/8 at one 16K sequence
PREFILL_MOD_SHAPES = (("gqa32/8", 4, 4096, 32, 8, 128, 128), ("gqa64/8", 1, 16384, 64, 8, 128, 128))
# the varlen rows (packed sequences, prefill_varlen): GQA 32/8 D 128, 8 sequences of mixed lengths
VARLEN_SHAPE = ("varlen", 8, 0, 32, 8, 128, 128)
VARLEN_LENGTHS = (6011, 131, 2048, 777, 4096, 1500, 63, 3217)
PREFILL_MODS = ("softcap50", "alibi", "window1024", "documents", "prefixlm", "relbias")
NON_CAUSAL_MODS = ("prefixlm",)  # its mask has its own causal part beyond the prefix
WINDOW = 1024
RELATIVE_REACH = 256  # the relative-position bias table's distances: (heads, 2 * reach - 1)
# --prefill --fp8: (name, batch, s, hq, hkv, dqk, dv)
PREFILL_FP8_SUITE = [("d128", 1, 16384, 16, 16, 128, 128), ("d128", 4, 4096, 16, 16, 128, 128),
                     ("d64", 1, 16384, 32, 32, 64, 64), ("d256", 1, 16384, 8, 8, 256, 256),
                     ("gqa64/8", 1, 16384, 64, 8, 128, 128)]
PREFILL_FP8_QUICK = PREFILL_FP8_SUITE[:1]
FP8_TOLERANCE = 6e-2  # P rounded to e4m3: about 2.5 % relative error on random V (tests/gpu/test_attention_prefill_fp8)


def prefill_mods(mod: str, batch: int, s: int, hq: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(nvfly's keyword arguments, flex's mods) of a mod row: the same functions; the window is nvfly's first-class
    ``window`` and flex's mask_mod; the documents (4 per sequence, random lengths) and prefix-LM's mask a BlockMask
    of the mask for nvfly and the same mask_mod for flex (which builds its BlockMask)."""
    if mod == "softcap50":
        return {"score_mod": M.soft_cap(50.0)}, {"score_mod": M.soft_cap(50.0)}
    if mod == "alibi":
        slopes = torch.tensor(M.alibi_slopes(hq), device="cuda")
        return {"score_mod": M.alibi(slopes)}, {"score_mod": M.alibi(slopes)}
    if mod == "window1024":
        return {"window": (WINDOW - 1, 0)}, {"mask_mod": M.sliding_window(WINDOW)}
    gen = torch.Generator(device="cuda").manual_seed(1)
    if mod == "relbias":
        table = torch.randn(hq, 2 * RELATIVE_REACH - 1, device="cuda", generator=gen)
        return {"score_mod": M.relative_position_bias(table)}, {"score_mod": M.relative_position_bias(table)}
    from torch.nn.attention.flex_attention import create_block_mask
    if mod == "prefixlm":
        prefixes = torch.randint(s // 4, s // 2 + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
        prefix = M.prefix_lm(prefixes)
        return ({"block_mask": create_block_mask(prefix, batch, None, s, s, device="cuda")},
                {"mask_mod": prefix})
    cuts = torch.sort(torch.randint(1, s, (batch, 3), device="cuda", generator=gen), dim=1).values
    ids = (torch.arange(s, device="cuda")[None, :, None] >= cuts[:, None, :]).sum(-1).to(torch.int32)
    documents = M.document_mask(ids)

    def causal_documents(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & documents(b, h, q_idx, kv_idx)
    return ({"block_mask": create_block_mask(causal_documents, batch, None, s, s, device="cuda")},
            {"mask_mod": documents})


def kept_pairs(nvfly_mods: dict[str, Any], flex_mods: dict[str, Any], batch: int, s: int, causal: bool) -> int:
    """(query, key) pairs of one head kept by causal and the mask, summed over the batch (the mask evaluated)."""
    if "window" in nvfly_mods:
        return batch * attention.prefill_flops(1, s, s, 1, 1, 0, causal, window=nvfly_mods["window"]) // 2
    mask_mod = flex_mods.get("mask_mod")
    if mask_mod is None:
        return batch * attention.prefill_flops(1, s, s, 1, 1, 0, causal) // 2
    rows, keys = torch.arange(s, device="cuda")[:, None], torch.arange(s, device="cuda")[None, :]
    total = 0
    for b in range(batch):
        keep = mask_mod(torch.tensor(b, device="cuda"), torch.tensor(0, device="cuda"), rows, keys)
        total += int((keep & (keys <= rows) if causal else keep).sum())
    return total


def shifted(mods: dict[str, Any], shift: int) -> dict[str, Any]:
    """The mods for the last rows of a sequence as their own queries: q_idx moved by ``shift``; a block mask
    replaced by its mask_mod (it is built from it)."""
    out = {key: value for key, value in mods.items() if key not in ("score_mod", "mask_mod", "block_mask")}
    score_mod, mask_mod = mods.get("score_mod"), mods.get("mask_mod")
    if "block_mask" in mods:
        mask_mod = mods["block_mask"].mask_mod
    if score_mod is not None:
        out["score_mod"] = lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h, q_idx + shift, kv_idx)
    if mask_mod is not None:
        out["mask_mod"] = lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + shift, kv_idx)
    return out


def prefill_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, causal: bool,
                  mods: Optional[dict[str, Any]] = None) -> float:
    """nvfly's relative error on the last CHECK_ROWS queries of sequence 0 and the query heads of its first two KV
    heads (Sq = Skv: those rows see the same keys as in the whole problem, bottom-right aligned; the mods see their
    rows' indices in the whole sequence)."""
    heads = 2 * (q.shape[2] // k.shape[2])
    rows = min(CHECK_ROWS, q.shape[1])
    want, _ = attention.prefill_reference(q[:1, -rows:, :heads], k[:1, :, :2], v[:1, :, :2], causal=causal,
                                          **shifted(mods or {}, q.shape[1] - rows))
    return rel_err(out[:1, -rows:, :heads].float(), want)


def run_prefill_row(shape: tuple, causal: bool, with_flex: bool, mod: str = "none",
                    variants: Optional[dict[str, dict]] = None) -> dict[str, Any]:
    """One bf16 row; ``variants``: the PREFILL_VARIANTS timed (after checking) beside the default plan."""
    name, batch, s, hq, hkv, dqk, dv = shape
    torch.manual_seed(0)
    q = torch.randn(batch, s, hq, dqk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, s, hkv, dqk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, s, hkv, dv, device="cuda", dtype=torch.bfloat16)
    row: dict[str, Any] = {"model": name, "batch": batch, "sq": s, "skv": s, "hq": hq, "hkv": hkv, "dqk": dqk,
                           "dv": dv, "causal": causal, "mod": mod}
    mods, flex_mods = prefill_mods(mod, batch, s, hq) if mod != "none" else ({}, {})
    flops = 2 * (dqk + dv) * hq * kept_pairs(mods, flex_mods, batch, s, causal)
    reason = attention.prefill_eligibility(q, k, v, **mods)
    if reason is None:
        out = torch.full((batch, s, hq, dv), float("nan"), dtype=q.dtype, device="cuda")
        attention.prefill(q, k, v, causal=causal, out=out, **mods)
        row["nvfly_err"] = prefill_error(q, k, v, out, causal, mods)
        row["ok"] = row["nvfly_err"] < 2e-2 and not out.isnan().any().item()  # every row written
        del out
        calls = {"nvfly": lambda: attention.prefill(q, k, v, causal=causal, validate=False, **mods)}
        for variant, options in (variants or {}).items():
            with plan_options(**options):
                out = torch.full((batch, s, hq, dv), float("nan"), dtype=q.dtype, device="cuda")
                attention.prefill(q, k, v, causal=causal, out=out, **mods)
                row[f"nvfly_{variant}_err"] = prefill_error(q, k, v, out, causal, mods)
                row["ok"] = row["ok"] and row[f"nvfly_{variant}_err"] < 2e-2 and not out.isnan().any().item()
                del out

            def call(options=options):
                with plan_options(**options):
                    attention.prefill(q, k, v, causal=causal, validate=False, **mods)
            calls[f"nvfly_{variant}"] = call
        # the variants' differences are a few percent: time them in turn, three rounds, medians
        for name, times in interleaved_ms(calls, VARIANT_ROUNDS if variants else 1).items():
            row[f"{name}_ms"] = sorted(times)[len(times) // 2]
    else:
        row["nvfly_skipped"] = reason
    if mod == "none":
        for peer, call in sdpa_calls(q, k, v, causal, PREFILL_BACKENDS).items():
            row[f"{peer}_ms"] = bench_ms(call)
    if with_flex:
        call = flex_call(q, k, v, flex_mods, causal)
        if call is not None:
            row["flex_ms"] = bench_ms(call)
    for key in [key for key in row if key.endswith("_ms")]:
        row[key[:-3] + "_tflops"] = flops / row[key] / 1e9
        if not key.startswith("nvfly") and "nvfly_ms" in row:
            row["vs_" + key[:-3]] = row[key] / row["nvfly_ms"]
    return row


def run_prefill_varlen_row(causal: bool, with_flex: bool) -> dict[str, Any]:
    """The packed sequences of ``VARLEN_LENGTHS`` (``prefill_varlen``), against SDPA on the same sequences as a
    nested (jagged) tensor and flex_attention over the packed tokens with a document mask; TFLOP/s of the pairs
    kept inside each sequence. Correctness: each sequence's last CHECK_ROWS rows (the query heads of its first two
    KV heads) against the float32 reference of that sequence."""
    name, batch, _, hq, hkv, dqk, dv = VARLEN_SHAPE
    lengths = VARLEN_LENGTHS[:batch]
    total = sum(lengths)
    torch.manual_seed(0)
    q = torch.randn(total, hq, dqk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, hkv, dqk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, hkv, dv, device="cuda", dtype=torch.bfloat16)
    starts = [sum(lengths[:i]) for i in range(batch + 1)]
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    longest = max(lengths)
    row: dict[str, Any] = {"model": name, "batch": batch, "sq": longest, "skv": longest, "hq": hq, "hkv": hkv,
                           "dqk": dqk, "dv": dv, "causal": causal, "mod": "none", "lengths": list(lengths),
                           "total_tokens": total}
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lengths)
    flops = 2 * (dqk + dv) * hq * pairs
    out = torch.full((total, hq, dv), float("nan"), dtype=q.dtype, device="cuda")
    attention.prefill_varlen(q, k, v, cu, cu, longest, longest, causal=causal, out=out)
    heads = 2 * (hq // hkv)
    errors = []
    for b in range(batch):
        first, end = starts[b], starts[b + 1]
        rows = min(CHECK_ROWS, end - first)
        want, _ = attention.prefill_reference(q[None, end - rows:end, :heads], k[None, first:end, :2],
                                              v[None, first:end, :2], causal=causal)
        errors.append(rel_err(out[None, end - rows:end, :heads].float(), want))
    row["nvfly_err"] = max(errors)
    row["ok"] = row["nvfly_err"] < 2e-2 and not out.isnan().any().item()
    del out
    row["nvfly_ms"] = bench_ms(lambda: attention.prefill_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                                                validate=False))
    offsets = cu.to(torch.int64)
    nested = [torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in (q, k, v)]
    for peer, call in backend_calls(PREFILL_BACKENDS, " (nested)", *nested, is_causal=causal, enable_gqa=True).items():
        row[f"{peer}_ms"] = bench_ms(call)
    if with_flex:
        documents = torch.bucketize(torch.arange(total, device="cuda"), cu[1:], right=True).to(torch.int32)
        call = flex_call(q[None], k[None], v[None], {"mask_mod": M.document_mask(documents[None])}, causal)
        if call is not None:
            row["flex_ms"] = bench_ms(call)
    for key in [key for key in row if key.endswith("_ms")]:
        row[key[:-3] + "_tflops"] = flops / row[key] / 1e9
        if not key.startswith("nvfly"):
            row["vs_" + key[:-3]] = row[key] / row["nvfly_ms"]
    return row


def run_prefill(args: argparse.Namespace, argv: Optional[list[str]]) -> int:
    suite = [shape for shape in (PREFILL_QUICK if args.quick else PREFILL_SUITE)
             if args.prefill_models is None or shape[0] in args.prefill_models]
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = 256  # one flex compile per shape
    cases = [(shape, causal, "none") for shape in suite for causal in (False, True)]
    if args.mods and (args.prefill_models is None or "mods" in args.prefill_models):
        cases += [(shape, mod not in NON_CAUSAL_MODS, mod) for shape in PREFILL_MOD_SHAPES[:1 if args.quick else 2]
                  for mod in PREFILL_MODS]
    if not args.quick and (args.prefill_models is None or "varlen" in args.prefill_models):
        cases += [(VARLEN_SHAPE, causal, "none") for causal in (False, True)]
    variants = {name: options for name, options in PREFILL_VARIANTS.items()
                if args.prefill_variants and (not args.only_variants or name in args.only_variants)}
    rows, started = [], time.time()
    for shape, causal, mod in cases:
        # --quick times flex on the mod rows only (its compiles are most of the time; SDPA is the plain rows' peer)
        with_flex = not args.no_flex and (mod != "none" or not args.quick)
        row = (run_prefill_varlen_row(causal, with_flex) if shape is VARLEN_SHAPE else
               run_prefill_row(shape, causal, with_flex, mod, variants))
        rows.append(row)
        peers = "  ".join(f"{key[:-7]} {row[key]:.0f}" for key in row
                          if key.endswith("_tflops") and key != "nvfly_tflops")
        mine = (f"err {row['nvfly_err']:.1e}  nvfly {row['nvfly_tflops']:.0f} TFLOP/s" if "nvfly_ms" in row
                else f"nvfly: {row['nvfly_skipped']}")
        print(f"{row['model']:>9} B{row['batch']:<3} S{row['sq']:<6} {row['hq']}/{row['hkv']} "
              f"{row['dqk']}/{row['dv']} {'causal' if causal else 'full':>6} {mod:>10}  {mine}  ({peers})",
              flush=True)
        torch.cuda.empty_cache()
    timed = [r for r in rows if "nvfly_ms" in r]
    summary = {"seconds": time.time() - started, "all_ok": all(r["ok"] for r in timed),
               "declined": len(rows) - len(timed),
               **{f"geomean_vs_{peer}": geomean([r[f"vs_{peer}"] for r in timed if f"vs_{peer}" in r])
                  for peer in (*PREFILL_BACKENDS, "flex") if any(f"vs_{peer}" in r for r in timed)}}
    for variant in variants:  # each variant's geomean against cuDNN, and against flex on the mod rows
        summary[f"geomean_{variant}_vs_cudnn"] = geomean([r["cudnn_ms"] / r[f"nvfly_{variant}_ms"] for r in timed
                                                         if "cudnn_ms" in r and f"nvfly_{variant}_ms" in r])
        if any("flex_ms" in r and r["mod"] != "none" for r in timed):
            summary[f"geomean_mods_{variant}_vs_flex"] = geomean([r["flex_ms"] / r[f"nvfly_{variant}_ms"]
                                                                  for r in timed if "flex_ms" in r
                                                                  and r["mod"] != "none"
                                                                  and f"nvfly_{variant}_ms" in r])
    if any("vs_flex" in r and r["mod"] != "none" for r in timed):
        summary["geomean_mods_vs_flex"] = geomean([r["vs_flex"] for r in timed
                                                   if "vs_flex" in r and r["mod"] != "none"])
    print(summary)
    command = "python benchmarks/attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    path = write_results(args.name or "attention_prefill", rows,
                         {"summary": summary, "command": command, "card": torch.cuda.get_device_name()})
    labels = [f"{r['model']} B{r['batch']} S{r['sq'] // 1024}K {r['hq']}/{r['hkv']} {'c' if r['causal'] else 'f'}"
              + (f" {r['mod']}" if r["mod"] != "none" else "") for r in rows]
    series = {"nvfly": [r.get("nvfly_tflops", 0.0) for r in rows]}
    for variant in variants:
        series[f"nvfly {variant}"] = [r.get(f"nvfly_{variant}_tflops", 0.0) for r in rows]
    for peer in (*PREFILL_BACKENDS, "flex"):
        if any(f"{peer}_tflops" in r for r in rows):
            series[peer] = [r.get(f"{peer}_tflops", 0.0) for r in rows]
    plot(args.name or "attention_prefill", labels, series, "TFLOP/s (unmasked work)")
    print("wrote", path)
    return 0 if summary["all_ok"] else 1


def quantised_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, its per-tensor descale as a one-element float32 tensor): a power of two, the least with which
    x / descale is within e4m3's ±448 (so that the dequantised values are exact in bf16, the peers' inputs)."""
    descale = torch.exp2(torch.ceil(torch.log2(x.float().abs().amax().clamp_min(1e-12) / 448.0))).reshape(1)
    return (x.float() / descale).to(torch.float8_e4m3fn), descale


def run_prefill_fp8_row(shape: tuple, causal: bool, variants: Optional[dict[str, dict]] = None,
                        per_head: bool = False) -> dict[str, Any]:
    """One fp8 row; ``variants``: the PREFILL_FP8_VARIANTS timed (after checking) beside the default plan;
    ``per_head``: the call with the same factors as (B, Hkv) descales too (``nvfly_fp8_per_head``, the per-head
    plan)."""
    variants = variants or {}
    name, batch, s, hq, hkv, dqk, dv = shape
    torch.manual_seed(0)
    (q, qd), (k, kd), (v, vd) = (quantised_e4m3(torch.randn(batch, s, h, d, device="cuda"))
                                 for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv)))
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    # bf16 peers on the same values (exact in bf16: e4m3's 3 mantissa bits times a power of two)
    qb, kb, vb = ((t.float() * d).to(torch.bfloat16) for t, d in ((q, qd), (k, kd), (v, vd)))
    row: dict[str, Any] = {"model": name, "batch": batch, "sq": s, "skv": s, "hq": hq, "hkv": hkv, "dqk": dqk,
                           "dv": dv, "causal": causal}
    flops = attention.prefill_flops(batch, s, s, hq, dqk, dv, causal)
    reason = attention.prefill_eligibility(q, k, v)
    if reason is None:
        out = torch.full((batch, s, hq, dv), float("nan"), dtype=torch.bfloat16, device="cuda")
        attention.prefill(q, k, v, causal=causal, out=out, **descales)
        row["nvfly_fp8_err"] = prefill_error(qb, kb, vb, out, causal)
        row["ok"] = row["nvfly_fp8_err"] < FP8_TOLERANCE and not out.isnan().any().item()
        del out
        row["nvfly_fp8_ms"] = bench_ms(lambda: attention.prefill(q, k, v, causal=causal, **descales))
        row["transpose_ms"] = bench_ms(lambda: transposed_values(v))
        row["transpose_torch_ms"] = bench_ms(lambda: transposed_values_torch(v))  # the strided copy it replaced
        moved = v.numel() + batch * hkv * dv * -(-s // 16) * 16  # bytes read and written
        row["transpose_gbps"] = moved / row["transpose_ms"] / 1e6
        timed = [(variant, options, descales) for variant, options in variants.items()]
        if per_head:
            timed.append(("per_head", {}, {name: d.expand(batch, hkv).contiguous() for name, d in descales.items()}))
        for variant, options, given in timed:
            with plan_options(**options):
                out = torch.full((batch, s, hq, dv), float("nan"), dtype=torch.bfloat16, device="cuda")
                attention.prefill(q, k, v, causal=causal, out=out, **given)
                row[f"nvfly_fp8_{variant}_err"] = prefill_error(qb, kb, vb, out, causal)
                row["ok"] = (row["ok"] and row[f"nvfly_fp8_{variant}_err"] < FP8_TOLERANCE
                             and not out.isnan().any().item())
                del out
                row[f"nvfly_fp8_{variant}_ms"] = bench_ms(lambda: attention.prefill(q, k, v, causal=causal,
                                                                                    **given))
    else:
        row["nvfly_fp8_skipped"] = reason
        row["ok"] = False
    row["nvfly_bf16_ms"] = bench_ms(lambda: attention.prefill(qb, kb, vb, causal=causal, validate=False))
    for peer, call in sdpa_calls(qb, kb, vb, causal, ("cudnn",)).items():
        row[f"{peer}_bf16_ms"] = bench_ms(call)
    for key in [key for key in row if key.endswith("_ms") and not key.startswith("transpose")]:
        row[key[:-3] + "_tflops"] = flops / row[key] / 1e9
        if not key.startswith("nvfly_fp8") and "nvfly_fp8_ms" in row:
            row["fp8_vs_" + key[:-3]] = row[key] / row["nvfly_fp8_ms"]
    if "nvfly_fp8_ms" in row:  # what an in-kernel transpose could reach: the call's time less the pass's
        row["fp8_kernel_estimate_tflops"] = flops / (row["nvfly_fp8_ms"] - row["transpose_ms"]) / 1e9
        for variant in [*variants, *(["per_head"] if per_head else [])]:
            row[f"fp8_{variant}_kernel_estimate_tflops"] = (flops / (row[f"nvfly_fp8_{variant}_ms"]
                                                                     - row["transpose_ms"]) / 1e9)
    return row


def run_prefill_fp8(args: argparse.Namespace, argv: Optional[list[str]]) -> int:
    rows, started = [], time.time()
    variants = {name: options for name, options in PREFILL_FP8_VARIANTS.items()
                if args.prefill_variants and (not args.only_variants or name in args.only_variants)}
    for shape in (PREFILL_FP8_QUICK if args.quick else PREFILL_FP8_SUITE):
        for causal in (False, True):
            row = run_prefill_fp8_row(shape, causal, variants, args.per_head_descales)
            rows.append(row)
            timed = "  ".join(f"{key[:-7]} {row[key]:.0f}" for key in row if key.endswith("_tflops"))
            mine = (f"err {row['nvfly_fp8_err']:.1e}  V transpose {row['transpose_ms']:.3f} ms "
                    f"({row['transpose_gbps']:.0f} GB/s; torch copy {row['transpose_torch_ms']:.3f}) of "
                    f"{row['nvfly_fp8_ms']:.3f}" if "nvfly_fp8_ms" in row
                    else f"nvfly fp8: {row['nvfly_fp8_skipped']}")
            print(f"{row['model']:>9} B{row['batch']:<3} S{row['sq']:<6} {row['hq']}/{row['hkv']} {row['dqk']}/"
                  f"{row['dv']} {'causal' if causal else 'full':>6}  {mine}  TFLOP/s: {timed}", flush=True)
            torch.cuda.empty_cache()
    timed = [r for r in rows if "nvfly_fp8_ms" in r]
    summary = {"seconds": time.time() - started, "all_ok": all(r["ok"] for r in rows),
               **{f"geomean_fp8_vs_{peer}": geomean([r[f"fp8_vs_{peer}"] for r in timed if f"fp8_vs_{peer}" in r])
                  for peer in ("nvfly_bf16", "cudnn_bf16")}}
    for r in timed:
        if r["model"] == "d128" and r["sq"] == 16384:
            summary[f"d128_16k_{'causal' if r['causal'] else 'full'}_fp8_tflops"] = r["nvfly_fp8_tflops"]
            for key in [key for key in r if key.startswith("fp8_") and key.endswith("_kernel_estimate_tflops")]:
                summary[f"d128_16k_{'causal' if r['causal'] else 'full'}_{key}"] = r[key]
    print(summary)
    command = "python benchmarks/attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    name = args.name or "attention_prefill_fp8"
    path = write_results(name, rows, {"summary": summary, "command": command,
                                      "card": torch.cuda.get_device_name()})
    labels = [f"{r['model']} B{r['batch']} S{r['sq'] // 1024}K {r['hq']}/{r['hkv']} {'c' if r['causal'] else 'f'}"
              for r in rows]
    series = {label: [r.get(f"{key}_tflops", 0.0) for r in rows] for label, key in
              (("nvfly fp8", "nvfly_fp8"), ("nvfly bf16", "nvfly_bf16"), ("cuDNN bf16", "cudnn_bf16"))}
    plot(name, labels, series, "TFLOP/s (unmasked work)")
    print("wrote", path)
    return 0 if summary["all_ok"] else 1


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser()
    suites = p.add_mutually_exclusive_group(required=True)
    suites.add_argument("--decode", action="store_true", help="the decode suite")
    suites.add_argument("--prefill", action="store_true", help="the prefill suite")
    p.add_argument("--quick", action="store_true",
                   help="decode: six rows: B1 128K, B16 48/8 32K at Sq 1 and 4, B32 4K paged 16, soft-cap and "
                        "block-mask rows; prefill: five shapes (D 128 at 4K, 8K, 16K, D 64 at 2K, GQA 64/8 16K), "
                        "each non-causal and causal, and the four mod rows (flex timed on those only)")
    p.add_argument("--sq", type=int, nargs="*", default=[1, 4, 8], help="query tokens of the suite's rows")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUT_CHOICES)
    p.add_argument("--models", nargs="*", default=None, choices=sorted({shape[0] for shape in SUITE}),
                   help="only these rows of the suite (the whole suite takes over 10 minutes with flex)")
    p.add_argument("--prefill-models", nargs="*", default=None,
                   choices=sorted({shape[0] for shape in PREFILL_SUITE} | {"mods", "varlen"}),
                   help="prefill: only these rows, 'mods' for the mod rows, 'varlen' for the packed sequences' (the "
                        "whole suite with flex takes longer than one 10-minute run)")
    p.add_argument("--mods", action=argparse.BooleanOptionalAction, default=True,
                   help="the mod rows (prefill: soft-cap, ALiBi, sliding window, documents)")
    p.add_argument("--no-flex", action="store_true", help="skip flex_attention (its compiles take a while)")
    p.add_argument("--prefill-variants", action="store_true",
                   help="prefill: also time nvfly with each combination of the plan's overlap and ping-pong options "
                        "(PREFILL_VARIANTS; with --fp8 PREFILL_FP8_VARIANTS, 192-key blocks too; correctness "
                        "checked for each) in the same process: nvfly_<variant>_ms")
    p.add_argument("--only-variants", nargs="*", default=None, metavar="NAME",
                   help="with --prefill-variants: only these of PREFILL_VARIANTS (with --fp8 of "
                        "PREFILL_FP8_VARIANTS)")
    p.add_argument("--mla", action="store_true", help="decode: the MLA suite (DeepSeek's 576/512 latent cache) "
                                                       "instead; with --quick four rows")
    p.add_argument("--mla-variants", action="store_true",
                   help="with --mla: also time nvfly's kernel with each combination of MlaPlan.chunked and "
                        ".evict_first (MLA_VARIANTS; correctness checked for each): nvfly_<variant>_ms")
    p.add_argument("--decode-variants", nargs="+", default=(), metavar="NAME",
                   choices=[name for name in attention_api.DECODE_VARIANTS if name != "default"],
                   help="decode: also time nvfly with these plan variants (api.DECODE_VARIANTS; correctness checked "
                        "for each) beside the default, three rounds in turn: nvfly_<variant>_ms; with --quick the "
                        "suite's contiguous rows of --models at --sq and the quick paged row (fp8 only with --fp8); "
                        "writes "
                        "attention_decode_variants (or --name) after every row")
    p.add_argument("--fp8", action="store_true", help="decode: also each row's shape with fp8 (e4m3) K/V caches "
                                                       "(nvfly only); prefill: the fp8 prefill suite instead")
    p.add_argument("--per-head-descales", action="store_true",
                   help="with --prefill --fp8: also check and time each row with the same descales as (B, Hkv) "
                        "tensors (the per-head plan): nvfly_fp8_per_head_ms")
    p.add_argument("--name", default=None, help="results file stem (benchmarks/results/<name>_h200; default "
                                                 "attention_decode or attention_prefill)")
    args = p.parse_args(argv)
    if args.prefill and args.fp8:
        return run_prefill_fp8(args, argv)
    if args.prefill:
        return run_prefill(args, argv)
    if args.mla:
        return run_mla(args, argv)
    args.name = args.name or ("attention_decode_variants" if args.decode_variants else "attention_decode")
    if args.quick and args.decode_variants:
        cases = [(shape, sq, "bshd", "none") for shape in SUITE for sq in args.sq
                 if args.models is None or shape[0] in args.models]
        cases += [(shape, sq, layout, "none") for shape, sq, layout in QUICK  # the paged row (B32 4K paged 16)
                  if layout != "bshd" and sq in args.sq and (args.models is None or shape[0] in args.models)]
    elif args.quick:
        cases = [(shape, sq, layout, "none") for shape, sq, layout in QUICK]
        cases += [(MOD_SHAPE, 1, "bshd", "softcap50"), (MOD_SHAPE, 1, "bshd", "window4096-blockmask")]
    else:
        cases = [(shape, sq, layout, "none") for shape in SUITE for sq in args.sq for layout in args.layouts
                 if (not layout.startswith("paged") or sq == 1) and (args.models is None or shape[0] in args.models)]
        if args.mods:
            cases += [(MOD_SHAPE, 1, "bshd", mod) for mod in make_mods(MOD_SHAPE[3])]
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = 256  # one flex compile per shape
    if args.fp8 and args.quick and args.decode_variants:
        cases = [(*case, "fp8") for case in cases]
    elif args.fp8:
        cases = [(*case, kv) for case in cases for kv in ("bf16", "fp8")]
    else:
        cases = [(*case, "bf16") for case in cases]
    rows, started = [], time.time()
    command = "python benchmarks/attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    for shape, sq, layout, mod, kv in cases:
        row = run_row(shape, sq, layout, mod, not args.no_flex, kv, tuple(args.decode_variants))
        rows.append(row)
        # a row at a time: what ran is kept if the run is cut short
        write_results(args.name, rows, {"command": command, "card": torch.cuda.get_device_name(), "partial": True})
        peers = "  ".join(f"{key[:-4]} {row[key]:.2f}" for key in row if key.endswith("_tbs") and key != "nvfly_tbs")
        graph = f" graph {row['nvfly_graph_tbs']:.2f}" if "nvfly_graph_tbs" in row else ""
        print(f"{row['model']:>9} B{row['batch']:<3} Skv{row['skv']:<6} {row['hq']}/{row['hkv']} sq{sq} {layout:>7} "
              f"{mod:>10} {kv}  err {row['nvfly_err']:.1e}  nvfly {row['nvfly_tbs']:.2f} TB/s  ({peers})", flush=True)
        torch.cuda.empty_cache()
    bf16 = [r for r in rows if r["kv"] == "bf16"]
    summary = {"seconds": time.time() - started, "all_ok": all(r["ok"] for r in rows),
               "min_nvfly_tbs_sq1": min((r["nvfly_tbs"] for r in bf16 if r["sq"] == 1), default=None),
               "min_nvfly_tbs_sq_gt1": min((r["nvfly_tbs"] for r in bf16 if r["sq"] > 1), default=None),
               "min_nvfly_tbs_fp8": min((r["nvfly_tbs"] for r in rows if r["kv"] == "fp8"), default=None),
               **{f"geomean_vs_{peer}": geomean([r[f"vs_{peer}"] for r in rows if f"vs_{peer}" in r])
                  for peer in (*SDPA_BACKENDS, "flex") if any(f"vs_{peer}" in r for r in rows)}}
    for variant in args.decode_variants:
        summary[f"geomean_{variant}_vs_default"] = geomean([r[f"nvfly_{variant}_tbs"] / r["nvfly_default_tbs"]
                                                            for r in rows])
    print(summary)
    path = write_results(args.name, rows, {"summary": summary, "command": command,
                                           "card": torch.cuda.get_device_name()})
    labels = [f"B{r['batch']} {r['skv'] // 1024}K {r['hq']}/{r['hkv']} sq{r['sq']} {r['layout']} {r['mod']}"
              + (" fp8" if r["kv"] == "fp8" else "") for r in rows]
    series = {"nvfly": [r["nvfly_tbs"] for r in rows]}
    for peer in (*SDPA_BACKENDS, "flex"):
        if any(f"{peer}_tbs" in r for r in rows):
            series[peer] = [r.get(f"{peer}_tbs", 0.0) for r in rows]
    plot(args.name, labels, series, "TB/s (q + k + v + o)")
    print("wrote", path)
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
