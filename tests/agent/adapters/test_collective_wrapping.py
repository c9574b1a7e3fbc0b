"""dist_wrap: torch.distributed's collectives, wrapped for a run's life on two gloo ranks.

Every wrapped function reports its op and nccl-tests size once (the deprecated spellings
call the new ones inside torch: counted once), async work is still a `Work` and is timed
from its future with the blocked time as exposed, the agent's own object collectives are
not counted, and closing the tap puts the original functions back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.foreign_jobs import run_job, wrapping_worker

pytestmark = pytest.mark.slow

#: case -> (op, nccl-tests size in bytes, async)
EXPECTED = {
    "all_reduce": ("all_reduce", 4000, False),
    "all_reduce_async": ("all_reduce", 4000, True),
    "all_gather_single": ("all_gather", 8000, False),
    "all_gather_into_tensor": ("all_gather", 8000, False),
    "all_gather_into_tensor_async": ("all_gather", 8000, True),
    "all_gather_list": ("all_gather", 8000, False),
    "reduce_scatter_single": ("reduce_scatter", 4000, False),
    "reduce_scatter_tensor_async": ("reduce_scatter", 4000, True),
    "broadcast": ("broadcast", 4000, False),
}
PURPOSE = {"all_gather": "param_fetch", "reduce_scatter": "grad_reduce",
           "all_reduce": "other", "broadcast": "other"}  # fmt: skip


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("wrapping")
    return run_job(wrapping_worker, Path(out), server=None, configs=[], steps=0)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_each_collective_is_reported_once_with_its_size(
    ranks: list[dict[str, Any]], case: str
) -> None:
    op, nbytes, async_op = EXPECTED[case]
    for rank in ranks:
        got = rank[case]
        assert got["is_work"] == async_op
        assert len(got["records"]) == 1, got
        (rec,) = got["records"]
        assert (rec["op"], rec["nbytes"], rec["async_op"], rec["world_size"]) == (
            op, nbytes, async_op, 2,
        )  # fmt: skip
        assert rec["purpose"] == PURPOSE[op]
        assert 0 <= rec["exposed_s"] <= rec["latency_s"] + 1e-6
        if not async_op:
            assert rec["exposed_s"] == pytest.approx(rec["latency_s"])


def test_object_collectives_are_not_counted(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["broadcast_object_list"]["records"] == []
        assert rank["agent_broadcast_object"]["records"] == []


def test_closing_restores_torch_distributed(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["after_close"] == {"records": 0, "restored": True}
