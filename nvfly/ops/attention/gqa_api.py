"""The warpgroup-MMA GQA decode kernel's host side (``decode``'s default past 16 packed rows, fp8 caches past 32):
the call of one signature (its plan, TMA descriptors and launches: the kernel, then the split-KV combine) and a
compile helper for tests without a GPU. ``decode`` runs its own checks first and comes here only for the calls
``gqa_plan.gqa_declined`` accepts; the rest keep the decode kernel."""
from __future__ import annotations

from typing import Any

import nvfly
from nvfly.ops.attention.calls import CallBuffers
from nvfly.ops.attention.combine_kernel import compile_combine, launch_combine, prepared_combine
from nvfly.ops.attention.gqa_kernel import attention_gqa_wgmma_kernel
from nvfly.ops.attention.gqa_plan import BLOCK_N, BOX_COLUMNS, HEAD_DIM, SWIZZLE, GqaPlan
from nvfly.ops.attention.kv_options import kernel_scales
from nvfly.ops.attention.softmax import LN2
from nvfly.runtime.tma import cached_descriptor


def boxes(sq: int, group: int, fp8: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The TMA boxes of q (B, Sq, Hq, 128): a KV head's Sq x G query rows, one 128-byte swizzle row wide; and of K
    and V (B or pages, S, Hkv, 128): 64 keys of one KV head, as wide (fp8: all 128 columns)."""
    return (1, sq, group, BOX_COLUMNS), (1, BLOCK_N, 1, SWIZZLE if fp8 else BOX_COLUMNS)


class GqaCall(CallBuffers):
    """The launches of one decode call signature on the wgmma GQA kernel: what depends only on the signature,
    computed once (the plan, the outputs' shapes, the prepared launches, the partials' size); ``run`` allocates
    the outputs, binds the call's tensors and launches. It answers ``decode``'s ``_DecodeCall`` interface."""

    def __init__(self, plan: GqaPlan, q: Any, cache_seqlens: Any, capacity: int, pages: int, return_lse: bool,
                 prepared: bool):
        from nvfly.ops.common import scratch
        batch, sq, hq, _ = q.shape
        super().__init__(q, (batch, sq, hq, HEAD_DIM), return_lse, cache_seqlens, capacity, "decode cache_seqlens")
        self.plan, self.pages, self.hq = plan, pages, hq
        self.cuda = q.device.type == "cuda"
        self.reads_values = cache_seqlens is not None or plan.paged
        self.default_scale = HEAD_DIM ** -0.5
        self.rows = batch * sq * hq
        self.slots = plan.splits * self.rows if plan.splits > 1 else 0
        self.row_partials = scratch.row_partials
        self.boxes = boxes(sq, plan.group, plan.fp8)
        self.main = self.combine = None
        if prepared:
            self.main = attention_gqa_wgmma_kernel.prepared(plan.grid(batch, hq // plan.group), plan.threads)
            if self.slots:
                self.combine = prepared_combine(self.rows, HEAD_DIM)

    def run(self, q: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any, out: Any, k_scale: Any,
            v_scale: Any, captured: Any, scale: Any, block_mask: Any = None) -> Any:
        from nvfly.runtime.torch_args import current_stream
        device = q.device
        out, lse = self.outputs(device, out)
        plan = self.plan
        seqlens = self.lengths(device, cache_seqlens)
        scale_log2 = (self.default_scale if scale is None else float(scale)) / LN2
        descriptors = (cached_descriptor(q, self.boxes[0], SWIZZLE), cached_descriptor(k, self.boxes[1], SWIZZLE),
                       cached_descriptor(v, self.boxes[1], SWIZZLE))
        grid = plan.grid(self.batch, self.hq // plan.group)
        scales = kernel_scales(k_scale, v_scale, k.shape[2], device) if plan.fp8 else None
        if self.slots:
            partial_o, partial_lse = self.row_partials(device, current_stream(device.index), self.slots, HEAD_DIM)
            args = (*descriptors, block_table, seqlens, None, None, partial_o, partial_lse, scales, self.batch,
                    self.hq, scale_log2)
        else:
            args = (*descriptors, block_table, seqlens, out, lse, None, None, scales, self.batch, self.hq,
                    scale_log2)
        if self.main is None:
            attention_gqa_wgmma_kernel[grid, plan.threads](*args, PLAN=plan)
        else:
            self.main(*args, plan)
        if self.slots:
            launch_combine(self.combine, partial_o, partial_lse, out, lse, self.rows, self.hq, plan.splits,
                           q.shape[1], HEAD_DIM, plan.pdl_combine)
        return (out, lse) if self.lse_shape is not None else out

    def reads_addresses(self) -> bool:
        """False: ``run`` builds its TMA descriptors from the tensors' shapes and strides, so ``bound_decode``'s
        heads-first launches pass it decode's layout (transposed views) on every call."""
        return False


def compile_gqa(plan: GqaPlan, dtype: Any = nvfly.bf16, batch: int = 2, kv_heads: int = 8, seqlen: int = 1024,
                return_lse: bool = True, target: str = "sm_90a") -> list:
    """The wgmma GQA kernel (and the combine kernel with splits) for ``plan`` compiled without a GPU:
    [CompiledKernel, ...]. A paged plan gets seqlen / page_size pages per sequence; an fp8 plan e4m3 K and V and
    per-head scales."""
    from nvfly.runtime.tensor_desc import TensorDesc
    q_box, kv_box = boxes(plan.sq, plan.group, plan.fp8)
    hq = kv_heads * plan.group
    q = nvfly.TmaDescriptor(TensorDesc(dtype, (batch, plan.sq, hq, HEAD_DIM)), q_box, SWIZZLE)
    if plan.paged:
        pages = seqlen // plan.page_size
        shape = (batch * pages, plan.page_size, kv_heads, HEAD_DIM)
        table = TensorDesc(nvfly.i32, (batch, pages))
    else:
        shape, table = (batch, seqlen, kv_heads, HEAD_DIM), None
    kv_dtype = nvfly.f8e4m3 if plan.fp8 else dtype
    k = nvfly.TmaDescriptor(TensorDesc(kv_dtype, shape), kv_box, SWIZZLE)
    v = nvfly.TmaDescriptor(TensorDesc(kv_dtype, shape), kv_box, SWIZZLE)
    scales = TensorDesc(nvfly.f32, (2, kv_heads)) if plan.fp8 else None
    seqlens = TensorDesc(nvfly.i32, (batch,))
    split = plan.splits > 1
    rows = batch * plan.sq * hq
    out = None if split else TensorDesc(dtype, (batch, plan.sq, hq, HEAD_DIM))
    lse = TensorDesc(nvfly.f32, (batch, hq, plan.sq)) if return_lse and not split else None
    partial_o = TensorDesc(nvfly.f32, (plan.splits * rows, HEAD_DIM)) if split else None
    partial_lse = TensorDesc(nvfly.f32, (plan.splits * rows,)) if split else None
    kernels = [attention_gqa_wgmma_kernel.compile(q, k, v, table, seqlens, out, lse, partial_o, partial_lse, scales,
                                                  batch, hq, 0.18, PLAN=plan, block=plan.threads, target=target)]
    if split:
        kernels.append(compile_combine(
            partial_o, partial_lse, TensorDesc(dtype, (batch, plan.sq, hq, HEAD_DIM)),
            TensorDesc(nvfly.f32, (batch, hq, plan.sq)) if return_lse else None, rows, hq, plan.splits, plan.sq,
            HEAD_DIM, plan.pdl_combine, target))
    return kernels


__all__ = ["GqaCall", "boxes", "compile_gqa"]
