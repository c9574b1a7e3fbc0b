"""FSDP2 on GPUs (NCCL; two ranks where the machine has two GPUs, else one), instrumented,
against a live server: phases timed with CUDA events and the allocator's peaks per phase.
Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.foreign_jobs import fsdp2_worker, run_job, server_run, server_series
from support.live_server import LiveServer

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = 4
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


@pytest.fixture(scope="module")
def job(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = min(torch.cuda.device_count(), 2)
    out = tmp_path_factory.mktemp("fsdp2-cuda")
    ranks = run_job(fsdp2_worker, Path(out), server=server.url, configs=["cuda"], steps=STEPS,
                    world=world)  # fmt: skip
    return [r["cuda"] for r in ranks]


def test_fsdp2_on_cuda_stores_every_step_with_allocator_peaks_per_phase(
    job: Any, server: LiveServer
) -> None:
    (run_id,) = {r["run_id"] for r in job}
    run = server_run(server.api, run_id)
    world = len(job)
    assert run["engine"] == "fsdp2" and run["engine_info"]["mesh"]["device_type"] == "cuda"
    assert sorted((r["rank"], r["steps"]) for r in run["ranks"]) == [
        (rank, STEPS) for rank in range(world)
    ]
    for phase in ("forward", "backward", "optimizer_step"):
        times = server_series(server.api, run_id, f"phase.{phase}", STEPS)
        peaks = server_series(server.api, run_id, f"memory.peak.{phase}", STEPS)
        for rank in range(world):
            assert all(t > 0 for t in times[rank]), (phase, rank, times[rank])
            assert all(p > 0 for p in peaks[rank]), (phase, rank, peaks[rank])
    capacity = server_series(server.api, run_id, "memory.capacity", STEPS)
    assert capacity[0][-1] >= torch.cuda.get_device_properties(0).total_memory * 0.5


def test_fsdp2_on_cuda_reports_the_bytes_nccl_was_asked_to_move(
    job: Any, server: LiveServer
) -> None:
    if len(job) < 2:
        pytest.skip("one GPU: a one-rank job sends nothing")
    (run_id,) = {r["run_id"] for r in job}
    for op in OPS:
        stored = server_series(server.api, run_id, f"collective.{op}.bytes", STEPS)
        for rank in (0, 1):
            counted = [step["bytes"].get(op, 0) for step in job[rank]["steps"]]
            assert [int(v) for v in stored.get(rank, [0.0] * STEPS)] == counted, (op, rank)
