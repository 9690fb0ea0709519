"""Decode attention's fp8 KV scales and flex ``BlockMask`` on the host: argument checks (errors name the argument),
the tables the kernel reads, and the block mask as the float32 reference applies it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from nvfly.ops.attention.decode_kernel import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL
from nvfly.ops.attention.plan import BLOCK_N, MaskTablesPlan
from nvfly.runtime.torch_args import layout_key

if TYPE_CHECKING:
    import torch

OP = "attention.decode"
FP8 = "torch.float8_e4m3fn"


def error(kind: type, argument: str, message: str, op: str = OP) -> Exception:
    """``kind`` with a message naming the op and the argument (``op``: decode's unless prefill's)."""
    return kind(f"{op}: {argument}: {message}")


# ---------------------------------------------------------------------------------------------- fp8 scales
def check_scales(k_scale: Any, v_scale: Any, q: Any, k_cache: Any) -> None:
    """Scales only with fp8 caches; float32 tensors of shape (), (1,) or (Hkv,) on q's device."""
    import torch
    hkv = k_cache.shape[2]
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            continue
        if str(k_cache.dtype) != FP8:
            raise error(ValueError, name, f"given for {k_cache.dtype} caches; scales dequantise {FP8} caches")
        if not isinstance(t, torch.Tensor):
            raise error(TypeError, name, f"expected a float32 torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise error(TypeError, name, f"expected float32, got {t.dtype}")
        if tuple(t.shape) not in ((), (1,), (hkv,)):
            raise error(ValueError, name, f"shape {tuple(t.shape)}; expected () or (1,) (per tensor) or ({hkv},) "
                                          "(per KV head)")
        if t.device != q.device:
            raise error(ValueError, name, f"on {t.device}, q on {q.device}")


def per_head(scale: Optional["torch.Tensor"], hkv: int, device: Any) -> "torch.Tensor":
    """A scale (None: 1) as one float32 value per KV head."""
    import torch
    if scale is None:
        return torch.ones(hkv, dtype=torch.float32, device=device)
    return scale.reshape(-1).expand(hkv)


def kernel_scales(k_scale: Optional["torch.Tensor"], v_scale: Optional["torch.Tensor"], hkv: int,
                  device: Any) -> "torch.Tensor":
    """The kernel's kv_scales: (2, Hkv) float32, K's row then V's (no host sync: graph capture works)."""
    import torch
    return torch.stack([per_head(k_scale, hkv, device), per_head(v_scale, hkv, device)])


# ---------------------------------------------------------------------------------------------- block mask
def _sliced(block_mask: Any) -> bool:
    """Whether the block mask's mask_mod is torch's placeholder for a mask sliced with ``block_mask[:, :, i]``."""
    return getattr(block_mask.mask_mod, "__name__", "") == "_sliced_mask_mod_error"


def _own_mask_mod(block_mask: Any) -> bool:
    """Whether the block mask carries a mask_mod of its own (not flex's no-op, not the sliced placeholder)."""
    from torch.nn.attention.flex_attention import noop_mask
    return block_mask.mask_mod is not noop_mask and not _sliced(block_mask)


def mask_mod_of(block_mask: Any, mask_mod: Optional[Callable[..., Any]] = None) -> Optional[Callable[..., Any]]:
    """The mask of the block mask's partial blocks: ``mask_mod`` when given, else the block mask's own (None for
    flex's no-op)."""
    if mask_mod is not None:
        return mask_mod
    return block_mask.mask_mod if _own_mask_mod(block_mask) else None


def _pairs(block_mask: Any) -> list:
    """(name, kv_num_blocks, kv_indices, state) of the partial blocks and, where given, the full ones."""
    pairs = [("kv_num_blocks", block_mask.kv_num_blocks, block_mask.kv_indices, BLOCK_PARTIAL)]
    if block_mask.full_kv_num_blocks is not None:
        pairs.append(("full_kv_num_blocks", block_mask.full_kv_num_blocks, block_mask.full_kv_indices, BLOCK_FULL))
    return pairs


def check_block_mask(block_mask: Any, mask_mod: Any, q: Any, hkv: int, capacity: int, read: bool = False,
                     op: str = OP, kv_stage: int = BLOCK_N, query_rows: int = 0) -> None:
    """A BlockMask the kernel honours: (1 or B, 1 or Hq) masks, int32 tables on q's device, KV blocks of a multiple
    of ``kv_stage`` keys covering the cache; decode (``query_rows`` 0): one query block; prefill: query blocks of a
    multiple of its ``query_rows``-row tiles covering Sq; ``read``: its block numbers in range (a device sync)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask
    if not isinstance(block_mask, BlockMask):
        raise error(TypeError, "block_mask", f"expected a flex_attention BlockMask, got {type(block_mask).__name__}",
                    op)
    batch, sq, hq, _ = q.shape
    q_block, kv_block = int(block_mask.BLOCK_SIZE[0]), int(block_mask.BLOCK_SIZE[1])
    if kv_block % kv_stage:
        raise error(ValueError, "block_mask", f"KV block size {kv_block} is not a multiple of the kernel's "
                                              f"{kv_stage}-key stage (create the mask with BLOCK_SIZE=(128, 128))", op)
    if query_rows and q_block % query_rows:
        raise error(ValueError, "block_mask", f"query block size {q_block} is not a multiple of the kernel's "
                                              f"{query_rows}-row tile (create the mask with BLOCK_SIZE=(128, 128))", op)
    if mask_mod is not None and _own_mask_mod(block_mask) and mask_mod is not block_mask.mask_mod:
        raise error(ValueError, "mask_mod", "differs from the block mask's own mask_mod, which its partial blocks "
                                            "apply; pass mask_mod=None", op)
    if mask_mod is None and _sliced(block_mask):
        raise error(ValueError, "block_mask", "a sliced mask's mask_mod is torch's placeholder; pass mask_mod= "
                                              "(q_idx: the query's position) or set block_mask.mask_mod", op)
    query_blocks = -(-sq // q_block) if query_rows else 1
    for name, num, indices, _ in _pairs(block_mask):
        if num.dim() != 3 or num.shape[0] not in (1, batch) or num.shape[1] not in (1, hq):
            raise error(ValueError, "block_mask", f"{name} shape {tuple(num.shape)}; expected (1 or {batch}, 1 or "
                                                  f"{hq}, {'query blocks' if query_rows else 1})", op)
        if not query_rows and num.shape[2] != 1:
            raise error(ValueError, "block_mask", f"{num.shape[2]} query blocks; decode takes one covering the "
                                                  "Sq queries (create the mask with Q_LEN = Sq, or slice one)", op)
        if num.shape[2] < query_blocks:
            raise error(ValueError, "block_mask", f"{num.shape[2]} query blocks of {q_block} cover "
                                                  f"{num.shape[2] * q_block} queries, q has {sq}", op)
        if indices is None or tuple(indices.shape[:3]) != tuple(num.shape) or indices.dim() != 4:
            raise error(ValueError, "block_mask", f"{name}'s indices do not match its shape {tuple(num.shape)}", op)
        if num.dtype != torch.int32 or indices.dtype != torch.int32:
            raise error(TypeError, "block_mask", f"{name} and its indices must be int32", op)
        if num.device != q.device or indices.device != q.device:
            raise error(ValueError, "block_mask", f"on {num.device}, q on {q.device}", op)
        if indices.shape[3] * kv_block < capacity:
            raise error(ValueError, "block_mask", f"{indices.shape[3]} KV blocks of {kv_block} cover "
                                                  f"{indices.shape[3] * kv_block} keys, the cache holds {capacity}", op)
    if read:
        check_block_numbers(block_mask, op)


def check_block_numbers(block_mask: Any, op: str = OP) -> None:
    """A checked BlockMask's counts and listed block numbers in range: reads them (a device sync)."""
    import torch
    for name, num, indices, _ in _pairs(block_mask):
        if num.numel():
            blocks = indices.shape[3]
            listed = torch.arange(blocks, device=num.device) < num.long()[..., None]
            if int(num.min()) < 0 or int(num.max()) > blocks or bool(
                    (listed & ((indices < 0) | (indices >= blocks))).any()):
                raise error(ValueError, "block_mask", f"{name} or its indices out of range (0..{blocks})", op)


def block_mask_key(block_mask: Any) -> Optional[tuple]:
    """What a BlockMask adds to a decode call's signature (None without one): its type, block size, mask_mod and
    its tables' layouts; raises AttributeError for an object that is no BlockMask (the checks then explain)."""
    if block_mask is None:
        return None
    return (type(block_mask), tuple(block_mask.BLOCK_SIZE), block_mask.mask_mod,
            layout_key(block_mask.kv_num_blocks), layout_key(block_mask.kv_indices),
            layout_key(block_mask.full_kv_num_blocks), layout_key(block_mask.full_kv_indices))


def mask_tables_plan(block_mask: Any, batch: int, hq: int, hkv: int) -> MaskTablesPlan:
    """The tables kernel's plan for a checked BlockMask of a (batch, Hq, Hkv) call."""
    num = block_mask.kv_num_blocks
    return MaskTablesPlan(hq // hkv, int(block_mask.BLOCK_SIZE[1]), num.shape[0] < batch, num.shape[1] < hq,
                          block_mask.full_kv_num_blocks is not None)


def mask_table_shapes(block_mask: Any, batch: int, hq: int, hkv: int, capacity: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of the decode kernel's block-mask tables (``block_mask_tables``)."""
    return (batch, hq, block_mask.kv_indices.shape[3]), (batch, hkv, -(-capacity // BLOCK_N)), (batch, hkv)


def block_mask_tables(block_mask: Any, batch: int, hq: int, hkv: int, seqlens: "torch.Tensor",
                      capacity: int) -> list:
    """The decode kernel's [kv_state (B, Hq, KV blocks), stage_list (B, Hkv, stages), stage_count (B, Hkv)], int32,
    by torch operations (no sync): their definition, which ``block_mask_kernel`` computes in one launch for decode
    and ``bytes_moved`` reads. A KV head's CTA reads the stages of the blocks that are non-empty for any head of its
    group, within its sequence (the first stage_count entries of stage_list, ascending; the kernel's table orders
    the others differently); each row then masks by its own head's state."""
    import torch
    device = seqlens.device
    state = None
    for _, num, indices, value in _pairs(block_mask):
        blocks = indices.shape[3]
        listed = torch.arange(blocks, device=device) < num.long()  # (B', H', blocks): the first num entries
        index = indices[:, :, 0].long().clamp(0, blocks - 1)       # unlisted entries may hold anything
        dense = torch.zeros(listed.shape, dtype=torch.int32, device=device).scatter_reduce(
            -1, index, listed.to(torch.int32) * value, "amax")
        state = dense if state is None else torch.maximum(state, dense)
    kv_state = state.expand(batch, hq, state.shape[2]).contiguous()
    stages = -(-capacity // BLOCK_N)
    stage_block = torch.arange(stages, device=device) * BLOCK_N // int(block_mask.BLOCK_SIZE[1])
    read = (kv_state.view(batch, hkv, hq // hkv, -1)[..., stage_block] != BLOCK_EMPTY).any(2)
    read &= torch.arange(stages, device=device) < (seqlens.long()[:, None, None] + BLOCK_N - 1) // BLOCK_N
    stage_count = read.sum(-1, dtype=torch.int32)
    stage_list = torch.argsort((~read).to(torch.int32), dim=-1, stable=True).to(torch.int32)
    return [kv_state, stage_list, stage_count.contiguous()]


def reference_block_keep(block_mask: Any, mask_mod: Optional[Callable[..., Any]], b: int, hq: int,
                         positions: "torch.Tensor", kv: "torch.Tensor", query_blocks: bool = False) -> "torch.Tensor":
    """(Hq, Sq, L) bool: the keys the block mask (its partial blocks masked by ``mask_mod_of(block_mask, mask_mod)``)
    keeps for sequence b's queries at ``positions`` (1, Sq, 1) and keys ``kv`` (1, 1, L), written from flex's
    definition (independent of ``block_mask_tables``). Decode's queries are all in query block 0; with
    ``query_blocks`` (prefill) query q_idx = position is in block q_idx // BLOCK_SIZE[0]."""
    import torch
    q_block, kv_block = int(block_mask.BLOCK_SIZE[0]), int(block_mask.BLOCK_SIZE[1])
    length = kv.shape[-1]
    rows = positions.shape[1] if query_blocks else 1
    in_blocks = {}
    for name, num, indices, _ in _pairs(block_mask):
        listed = torch.zeros(hq, rows, length, dtype=torch.bool, device=kv.device)
        bb = b if num.shape[0] > 1 else 0
        for h in range(hq):
            hh = h if num.shape[1] > 1 else 0
            for qb in range(-(-rows // q_block) if query_blocks else 1):
                for block in indices[bb, hh, qb, :int(num[bb, hh, qb])].tolist():
                    listed[h, qb * q_block:(qb + 1) * q_block, block * kv_block:(block + 1) * kv_block] = True
        in_blocks[name] = listed
    keep = in_blocks["kv_num_blocks"]
    mask_mod = mask_mod_of(block_mask, mask_mod)
    if mask_mod is not None:
        heads = torch.arange(hq, device=kv.device)[:, None, None]
        keep = keep & mask_mod(torch.tensor(b, device=kv.device), heads, positions, kv).bool()
    return keep | in_blocks.get("full_kv_num_blocks", torch.zeros_like(keep))
