"""An FSDP2 job on two gloo ranks that clips with `torch.nn.utils.clip_grad_norm_`: the
run records the norm that call returned as the step's grad norm, and whether it clipped;
closing the run gives torch back its own function and leaves the warnings filters as
they were."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.foreign_jobs import run_job, server_series
from support.fsdp2_clip_job import MAX_NORMS, fsdp2_clip_worker
from support.live_server import LiveServer

pytestmark = pytest.mark.slow

STEPS = len(MAX_NORMS)


@pytest.fixture(scope="module")
def job(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    out = tmp_path_factory.mktemp("fsdp2-clip")
    results = run_job(fsdp2_clip_worker, Path(out), server=server.url, configs=["fp32"],
                      steps=STEPS, batch=16)  # fmt: skip
    yield [r["fp32"] for r in results]


def test_stored_grad_norm_is_what_clip_grad_norm_returned(job: Any, server: LiveServer) -> None:
    assert job[0]["run_id"] == job[1]["run_id"]
    stored = server_series(server.api, job[0]["run_id"], "grad_norm", STEPS)
    for rank in (0, 1):
        returned = [s["norm"] for s in job[rank]["steps"]]
        assert all(n is not None and n > 0 for n in returned[:-1])
        # The last step does not clip (its only call is before its forward): no value.
        assert returned[-1] is None
        expected = [n if n is not None else 0.0 for n in returned]  # 0.0: nothing stored
        assert stored[rank] == pytest.approx(expected, rel=1e-6), rank
    # The norm is global: both ranks saw the same one.
    assert [s["norm"] for s in job[0]["steps"]] == [s["norm"] for s in job[1]["steps"]]


def test_clipped_is_norm_above_max_norm(job: Any) -> None:
    for rank in (0, 1):
        for i, s in enumerate(job[rank]["steps"]):
            stats = s["stats"]
            assert stats["nonfinite"] is False
            if s["norm"] is None:
                assert stats == {"grad_norm": None, "clipped": False, "nonfinite": False}
                continue
            assert stats["grad_norm"] == pytest.approx(s["norm"], rel=1e-6)
            assert stats["clipped"] == (s["norm"] > s["max_norm"]), (rank, i)
    clipped = [s["stats"]["clipped"] for s in job[0]["steps"]]
    assert clipped == [False, True, False, True, False]
    assert all(math.isfinite(s["norm"]) for s in job[0]["steps"][:-1])


def test_closing_the_run_restores_clip_grad_norm(job: Any) -> None:
    assert job[0]["clip_restored"] and job[1]["clip_restored"]


def test_warning_filters_are_the_scripts_own_throughout(job: Any) -> None:
    """No filter is left in place between steps or after the run, yet the backward-hook
    note the adapter's own hook causes never reaches the script."""
    for rank in (0, 1):
        assert job[rank]["filters_unchanged_during"], rank
        assert job[rank]["filters_unchanged_after"], rank
        assert job[rank]["notes_shown"] == 0, rank
