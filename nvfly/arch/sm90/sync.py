"""sm_90 synchronisation atoms: mbarriers, fences, elect.sync, cluster barriers, setmaxnreg.

mbarrier addresses are 32-bit shared-memory addresses (``nvfly.arch.ptx.smem_address``).
``mbarrier_init`` and ``mbarrier_arrive`` exist on sm_80 too; the rest need sm_90 (setmaxnreg: sm_90a).
"""
from __future__ import annotations

from typing import Any

from mlir import ir
from mlir.dialects import nvvm

from nvfly.arch.ptx import asm
from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.arch.target import requires
from nvfly.frontend.trace import current, traced
from nvfly.frontend.values import Scalar


# ---------------------------------------------------------------------------------------------- mbarrier
@traced
def mbarrier_init(bar: Scalar, count: int) -> None:
    """Initialise an 8-byte mbarrier expecting ``count`` arrivals per phase (``mbarrier.init``)."""
    asm("mbarrier.init.shared::cta.b64 [$0], $1;", [bar, count])


@traced
def mbarrier_arrive(bar: Scalar) -> None:
    """One arrival on a local mbarrier (release, CTA scope)."""
    asm("mbarrier.arrive.shared::cta.b64 _, [$0];", [bar])


@requires("sm_90", "mapa + mbarrier.arrive.shared::cluster")
def mbarrier_arrive_remote(bar: Scalar, cta_rank: Any) -> None:
    """One arrival on the mbarrier at the same offset in block ``cta_rank`` of the cluster.

    Release semantics at CTA scope (the default) suffice to free a stage: a cluster-scope release would make
    the arriving warp wait for all its earlier memory operations to be visible cluster-wide.
    """
    asm("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, $0, $1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}", [bar, cta_rank])


@requires("sm_90", "mbarrier.arrive.expect_tx")
def mbarrier_arrive_expect_tx(bar: Scalar, tx_bytes: Any) -> None:
    """Arrive and add ``tx_bytes`` to the transactions the current phase waits for (TMA completes them)."""
    asm("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", [bar, tx_bytes])


@requires("sm_90", "mbarrier.expect_tx")
def mbarrier_expect_tx(bar: Scalar, tx_bytes: Any) -> None:
    """Add ``tx_bytes`` to the current phase's transaction count without arriving."""
    asm("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [$0], $1;", [bar, tx_bytes])


@requires("sm_90", "mbarrier.try_wait.parity")
def mbarrier_wait(bar: Scalar, parity: Any) -> None:
    """Spin until the phase with ``parity`` (0/1) of the mbarrier has completed (``try_wait.parity``)."""
    # PTX labels are scoped by the braces, so every inlined copy may reuse LAB_WAIT
    asm("{\n.reg .pred done;\nLAB_WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n"
        "@!done bra LAB_WAIT;\n}", [bar, parity])


# ---------------------------------------------------------------------------------------------- fences
@requires("sm_90", "fence.mbarrier_init")
def fence_barrier_init() -> None:
    """Make mbarrier initialisation visible to the async proxy and the cluster (after init, before use)."""
    asm("fence.mbarrier_init.release.cluster;")


@requires("sm_90", "fence.proxy.async")
def fence_proxy_async() -> None:
    """Order this thread's generic-proxy shared-memory writes before later async-proxy (TMA, wgmma) reads."""
    asm("fence.proxy.async.shared::cta;")


# ---------------------------------------------------------------------------------------------- warps and groups
@requires("sm_90", "elect.sync")
def elect_one() -> Scalar:
    """True in exactly one active lane of the warp (``elect.sync``): the lane that issues a warp's TMA."""
    return Scalar(nvvm.elect_sync(ir.IntegerType.get_signless(1)), dtypes.i1)


@requires("sm_90a", "setmaxnreg")
def setmaxnreg(count: int, increase: bool) -> None:
    """Raise or lower this warpgroup's register budget (``setmaxnreg``; multiples of 8 in [24, 256]).

    Needs a register bound at kernel entry: kernels using it should set ``min_blocks_per_sm``.
    """
    if count % 8 or not 24 <= count <= 256:
        raise CompileError(f"setmaxnreg takes a multiple of 8 in [24, 256], got {count}")
    current().kernel_attrs.setdefault("nvvm.minctasm", "1 : i32")
    action = nvvm.SetMaxRegisterAction.increase if increase else nvvm.SetMaxRegisterAction.decrease
    nvvm.setmaxregister(count, action)


@requires("sm_90", "barrier.cluster.arrive")
def cluster_arrive() -> None:
    asm("barrier.cluster.arrive.aligned;")


@requires("sm_90", "barrier.cluster.wait")
def cluster_wait() -> None:
    asm("barrier.cluster.wait.aligned;")


@requires("sm_90", "barrier.cluster")
def cluster_sync() -> None:
    """Barrier over every thread of every block in the cluster."""
    cluster_arrive()
    cluster_wait()
