"""Attention. Decode: softmax(q kᵀ scale + mods) v over a (paged, ragged) KV cache at the HBM roofline, with
split-KV, GQA packing and flex_attention-style score and mask mods traced into the kernel. Prefill: the compute-bound
case on TMA and wgmma (FlashAttention-3's structure), with causal and sliding-window tile skipping, the same mods, flex
BlockMasks and packed variable-length sequences (``prefill_varlen``), and fp8 (e4m3) inputs with per-tensor
descales. MLA decode: DeepSeek-V2/V3's 576-column latent cache (V its first 512 columns) on TMA and wgmma, through
``decode`` or ``decode_mla``.

Modules: ``api`` (decode's host functions re-exported here), ``plan`` (plans and the split heuristic),
``decode_kernel``, ``combine_kernel`` and ``block_mask_kernel`` (device code), ``mods`` (score_mod/mask_mod
tracing and the shipped examples), ``checks`` (the host checks the three share); ``prefill_api``, ``prefill_plan``
and ``prefill_kernel`` likewise for prefill, ``mla_api``, ``mla_plan`` and ``mla_kernel`` for MLA decode;
``softmax`` (the wgmma kernels' online softmax step). docs/ops/attention.md explains the design.
"""
from nvfly.ops.attention.api import (bound_decode, bytes_moved, compile_kernels, compile_mask_tables, decode,
                                    eligibility, reference)
from nvfly.ops.attention.mla_api import compile_mla, decode_mla, mla_bytes, mla_eligibility, mla_flops
from nvfly.ops.attention.mla_plan import MlaPlan, mla_plan
from nvfly.ops.attention.mods import (Mods, alibi, alibi_slopes, document_mask, prefix_lm, relative_position_bias,
                                     sliding_window, soft_cap)
from nvfly.ops.attention.plan import DecodePlan, MaskTablesPlan, decode_plan, num_splits
from nvfly.ops.attention.prefill_api import (compile_prefill, prefill, prefill_eligibility, prefill_flops,
                                             prefill_reference, prefill_varlen)
from nvfly.ops.attention.prefill_plan import PrefillPlan, prefill_plan

__all__ = ["DecodePlan", "MaskTablesPlan", "MlaPlan", "Mods", "PrefillPlan", "alibi", "alibi_slopes",
           "bound_decode", "bytes_moved", "compile_kernels", "compile_mask_tables", "compile_mla",
           "compile_prefill", "decode", "decode_mla", "decode_plan", "document_mask", "eligibility",
           "mla_bytes", "mla_eligibility", "mla_flops", "mla_plan", "num_splits", "prefill",
           "prefill_eligibility", "prefill_flops", "prefill_plan", "prefill_reference", "prefill_varlen",
           "prefix_lm", "reference", "relative_position_bias", "sliding_window", "soft_cap"]
