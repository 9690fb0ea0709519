"""TMA (the bulk tensor copy engine): global <-> shared tile copies driven by host-built descriptors.

Coordinates are given in the tensor's dimension order (outermost first, like torch) and in elements; a copy
moves one descriptor box. Loads complete on an mbarrier (``complete_tx``); stores are tracked by bulk groups.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from nvfly.arch.memory import Policy, policy_operand
from nvfly.arch.ptx import asm
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.tma_types import TmaDescriptorValue
from nvfly.arch.target import requires
from nvfly.frontend.values import Scalar, as_value


def _coords(desc: TmaDescriptorValue, coords: Sequence[Any]) -> list[Any]:
    if len(coords) != desc.info.rank:
        raise CompileError(f"a rank-{desc.info.rank} TMA descriptor takes {desc.info.rank} coordinates, "
                           f"got {len(coords)}")
    return list(reversed(coords))  # PTX lists the innermost dimension first


def _placeholders(first: int, n: int) -> str:
    return ", ".join(f"${first + i}" for i in range(n))


@requires("sm_90", "cp.async.bulk.tensor")
def tma_load(desc: TmaDescriptorValue, smem: Scalar, coords: Sequence[Any], bar: Scalar,
             multicast_mask: Optional[Any] = None, cache_hint: Optional[Policy] = None) -> None:
    """Copy the box at ``coords`` into shared memory at ``smem``; its bytes complete on ``bar``.

    With ``multicast_mask`` (a 16-bit mask of cluster ranks) the box lands at the same offset in each
    block of the mask, completing on each block's ``bar``. ``cache_hint`` (an ``nvfly.arch.memory.L2Policy``
    or its name, or a ``create_policy`` register) sets the L2 eviction priority of the lines it reads.
    """
    c = _coords(desc, coords)
    rank = len(c)
    args: list[Any] = [smem, desc.ptr, *c, bar]
    coord_list = _placeholders(2, rank)
    text = (f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes"
            f"{'' if multicast_mask is None else '.multicast::cluster'}{'' if cache_hint is None else '.L2::cache_hint'}"
            f" [$0], [$1, {{{coord_list}}}], [${2 + rank}]")
    if multicast_mask is not None:
        args.append(as_value(multicast_mask, dtypes.i32).to(dtypes.i16))  # the mask operand is 16 bits
        text += f", ${len(args) - 1}"
    if cache_hint is not None:
        args.append(policy_operand(cache_hint, "tma_load"))
        text += f", ${len(args) - 1}"
    asm(text + ";", args)


@requires("sm_90", "cp.async.bulk")
def bulk_load(smem: Scalar, src: Any, nbytes: Any, bar: Scalar) -> None:
    """Copy ``nbytes`` (a multiple of 16) of contiguous global memory at ``src`` (16-byte aligned) into shared
    memory at ``smem`` (16-byte aligned); the bytes complete on ``bar``. The non-tensor bulk copy: no descriptor,
    one instruction for a whole row."""
    asm("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        [smem, src, nbytes, bar])


@requires("sm_90", "cp.async.bulk.tensor")
def tma_store(desc: TmaDescriptorValue, smem: Scalar, coords: Sequence[Any]) -> None:
    """Copy a box from shared memory at ``smem`` to global memory at ``coords`` (out-of-bounds parts are
    skipped). Complete with ``tma_store_commit`` + ``tma_store_wait``."""
    c = _coords(desc, coords)
    rank = len(c)
    asm(f"cp.async.bulk.tensor.{rank}d.global.shared::cta.bulk_group [$0, {{{_placeholders(1, rank)}}}], "
        f"[${1 + rank}];", [desc.ptr, *c, smem])


@requires("sm_90", "cp.async.bulk.commit_group")
def tma_store_commit() -> None:
    asm("cp.async.bulk.commit_group;")


@requires("sm_90", "cp.async.bulk.wait_group")
def tma_store_wait(pending: int = 0, read_only: bool = True) -> None:
    """Wait until at most ``pending`` committed store groups are outstanding (``read_only``: only until their
    shared-memory source may be overwritten)."""
    asm(f"cp.async.bulk.wait_group{'.read' if read_only else ''} {pending};")


@requires("sm_90", "prefetch.tensormap")
def tma_prefetch_descriptor(desc: TmaDescriptorValue) -> None:
    asm("prefetch.tensormap [$0];", [desc.ptr])
