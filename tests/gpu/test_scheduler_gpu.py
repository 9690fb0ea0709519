"""The tile scheduler's device functions on the GPU give the work units of their Python model, for every block."""
import pytest
import torch

from tests.test_scheduler_cpu import PROBES, device_work, probe_args, schedule_probe

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", PROBES)
def test_device_units_match_the_model(name):
    schedule = PROBES[name]
    args = probe_args(schedule, "cuda")
    cm = schedule.tiling.cluster  # blocks per cluster, along M or N
    schedule_probe.launch(*args, TILING=schedule.tiling, grid=schedule.grid, block=32,
                          cluster=(cm, 1, 1) if cm > 1 else None)
    expected = torch.full_like(args[0], -1, device="cpu")
    for (block, rank), units in device_work(schedule).items():
        for unit, work in zip(range(block, 10 ** 9, schedule.blocks), units):
            expected[unit * cm + rank] = torch.tensor([*work, block], dtype=torch.int32)
    assert torch.equal(args[0].cpu(), expected)
