"""Attention for decode: softmax(q kᵀ scale + mods) v over a (paged, ragged) KV cache at the HBM roofline, with
split-KV, GQA packing and flex_attention-style score and mask mods traced into the kernel.

Modules: ``api`` (the host functions re-exported here), ``plan`` (plans and the split heuristic),
``decode_kernel`` and ``combine_kernel`` (device code), ``mods`` (score_mod/mask_mod tracing and the shipped
examples); docs/ops/attention.md explains the design.
"""
from nvfly.ops.attention.api import bytes_moved, compile_kernels, decode, eligibility, reference
from nvfly.ops.attention.mods import Mods, alibi, alibi_slopes, document_mask, prefix_lm, sliding_window, soft_cap
from nvfly.ops.attention.plan import DecodePlan, decode_plan, num_splits

__all__ = ["DecodePlan", "Mods", "alibi", "alibi_slopes", "bytes_moved", "compile_kernels", "decode", "decode_plan",
           "document_mask", "eligibility", "num_splits", "prefix_lm", "reference", "sliding_window", "soft_cap"]
