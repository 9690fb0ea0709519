"""The TMA producer/consumer pipeline: an N-stage shared-memory ring guarded by full/empty mbarriers.

Stage ``s`` of the ring has two barriers: ``full[s]`` completes when the producer's TMA bytes for the stage
have landed (one arrival with an expected transaction count), ``empty[s]`` when every consumer has released
the stage. A ``PipelineState`` (stage index and phase bit) walks the ring; it is a traced value that dynamic
loops carry.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from mlir import ir

from nvfly.arch.sm90.sync import (
    fence_barrier_init, mbarrier_arrive, mbarrier_arrive_expect_tx, mbarrier_init, mbarrier_wait,
)
from nvfly.frontend import dtypes
from nvfly.frontend.language import select
from nvfly.frontend.values import Scalar, as_value


class PipelineState:
    """Position in the ring: ``stage`` in [0, stages) and the ``phase`` parity of the barriers' current pass."""

    def __init__(self, stage: Any, phase: Any, stages: int):
        self.stage = stage
        self.phase = phase
        self.stages = stages

    @staticmethod
    def start(stages: int) -> "PipelineState":
        return PipelineState(as_value(0, dtypes.i32), as_value(0, dtypes.i32), stages)

    def advance(self) -> "PipelineState":
        nxt = self.stage + 1
        wrap = nxt == self.stages
        return PipelineState(select(wrap, 0, nxt), select(wrap, self.phase ^ 1, self.phase), self.stages)

    def advance_by(self, steps: Any) -> "PipelineState":
        """The state ``steps`` positions further (``steps`` may be traced)."""
        total = self.stage + steps
        return PipelineState(total % self.stages, self.phase ^ ((total // self.stages) & 1), self.stages)

    def __nvfly_flatten__(self) -> tuple[list[ir.Value], Callable[[Sequence[ir.Value]], "PipelineState"]]:
        stages = self.stages
        return ([as_value(self.stage, dtypes.i32).value, as_value(self.phase, dtypes.i32).value],
                lambda vs: PipelineState(Scalar(vs[0], dtypes.i32), Scalar(vs[1], dtypes.i32), stages))


class TmaPipeline:
    """Barriers of an N-stage ring at shared address ``barriers`` (2 * stages * 8 bytes: full, then empty; with
    ``chunks`` > 1, (chunks + 1) * stages * 8: ``chunks`` full barriers a stage, then the empty ones).

    ``consumer_arrivals``: how many arrivals release a stage (e.g. one per consumer warp). ``chunks``: full
    barriers a stage, each armed for its own part of the stage's bytes (``producer_expect(state, chunk, bytes)``),
    so that a consumer starts on the stage's first part while the rest is still landing.
    """

    def __init__(self, barriers: Scalar, stages: int, stage_bytes: int, consumer_arrivals: int, chunks: int = 1):
        self.barriers = barriers
        self.stages = stages
        self.stage_bytes = stage_bytes
        self.consumer_arrivals = consumer_arrivals
        self.chunks = chunks

    def full(self, stage: Any, chunk: Any = 0) -> Scalar:
        if self.chunks == 1:
            return self.barriers + stage * 8
        return self.barriers + (stage * self.chunks + chunk) * 8

    def empty(self, stage: Any) -> Scalar:
        return self.barriers + (stage + self.stages * self.chunks) * 8

    def init(self) -> None:
        """Initialise every barrier (call from one thread, then a block barrier)."""
        for s in range(self.stages):
            for c in range(self.chunks):
                mbarrier_init(self.full(s, c), 1)
            mbarrier_init(self.empty(s), self.consumer_arrivals)
        fence_barrier_init()

    def producer_acquire(self, state: PipelineState) -> None:
        """Wait until the stage is free (passes at once on the first pass over a fresh ring)."""
        mbarrier_wait(self.empty(state.stage), state.phase ^ 1)

    def producer_expect(self, state: PipelineState, chunk: Any = 0, nbytes: Any = None) -> None:
        """Arm the stage's full barrier (of ``chunk``) for ``stage_bytes`` (``nbytes``) of TMA, before issuing the
        loads that complete on it."""
        mbarrier_arrive_expect_tx(self.full(state.stage, chunk), self.stage_bytes if nbytes is None else nbytes)

    def consumer_wait(self, state: PipelineState, chunk: Any = 0) -> None:
        mbarrier_wait(self.full(state.stage, chunk), state.phase)

    def consumer_release(self, state: PipelineState) -> None:
        mbarrier_arrive(self.empty(state.stage))
