"""DeepSpeed ZeRO-1, -2, -3, -2 with CPU offload and -2 accumulating gradients over two
micro-batches, on two gloo ranks, instrumented by `zerowatch.instrument(engine)`, against a
live server.

One job runs all four configurations (DeepSpeed is imported once per rank); each rank
counts the bytes its process group was asked to move, one layer below the functions
zerowatch wraps, and records DeepSpeed's own wall-clock timers after every step.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deepspeed  # the dev extra installs it: a missing DeepSpeed fails here, not skips
import pytest
from support.foreign_jobs import (
    DEEPSPEED_ACCUMULATION,
    DEEPSPEED_CONFIGS,
    assert_every_step_stored,
    deepspeed_worker,
    job_run_id,
    run_job,
    server_run,
    server_series,
)
from support.live_server import LiveServer

# DeepSpeed builds its CPU ops on first use: conftest builds them before the tests.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("deepspeed_ops")]

STEPS = 6
CONFIGS = list(DEEPSPEED_CONFIGS)
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
#: Parameters of support.foreign_jobs.mlp(): four 256x256 Linear layers.
PSI = 4 * (256 * 256 + 256)


@pytest.fixture(scope="module")
def job(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        out = tmp_path_factory.mktemp("deepspeed")
        yield run_job(deepspeed_worker, Path(out), server=server.url, configs=CONFIGS,
                      steps=STEPS, batch=512)  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = saved


@pytest.mark.parametrize("config", CONFIGS)
def test_every_step_of_every_rank_reaches_the_server(
    job: Any, server: LiveServer, config: str
) -> None:
    assert_every_step_stored(server, job_run_id(job, config), STEPS)


@pytest.mark.parametrize("config", CONFIGS)
def test_run_records_deepspeed_version_config_and_theory(
    job: Any, server: LiveServer, config: str
) -> None:
    run = server_run(server.api, job_run_id(job, config))
    zero = DEEPSPEED_CONFIGS[config]
    assert run["engine"] == "deepspeed"
    assert run["engine_info"]["version"] == deepspeed.__version__
    assert run["zero_stage"] == zero["stage"]
    assert run["offload_optimizer"] == ("cpu" if "offload_optimizer" in zero else "none")
    assert run["config"]["zero_optimization"]["stage"] == zero["stage"]
    accumulate = DEEPSPEED_ACCUMULATION.get(config, 1)
    assert run["config"]["gradient_accumulation_steps"] == accumulate
    assert run["engine_info"]["gradient_accumulation_steps"] == accumulate
    assert run["world_size"] == 2 and run["param_count"] == PSI
    assert run["theory"] == job[0][config]["theory"]


@pytest.mark.parametrize("config", CONFIGS)
def test_reported_collective_bytes_equal_what_the_engine_sent(
    job: Any, server: LiveServer, config: str
) -> None:
    run_id = job_run_id(job, config)
    for op in OPS:
        stored = server_series(server.api, run_id, f"collective.{op}.bytes", STEPS)
        for rank in (0, 1):
            counted = [step["bytes"].get(op, 0) for step in job[rank][config]["steps"]]
            reported = [int(v) for v in stored.get(rank, [0.0] * STEPS)]
            assert reported == counted, f"{config} rank {rank} {op}"
    # Something was sent every step (the check above cannot pass on empty series alone),
    # and nothing zerowatch has no name for (reduce, all-to-all, point-to-point).
    for rank in (0, 1):
        assert all(step["bytes"] for step in job[rank][config]["steps"])
        assert all(set(step["bytes"]) <= set(OPS) for step in job[rank][config]["steps"])


@pytest.mark.parametrize("config", CONFIGS)
def test_phase_times_agree_with_deepspeed_wall_clock_timers(
    job: Any, server: LiveServer, config: str
) -> None:
    """zerowatch's forward, backward and optimizer_step against DeepSpeed's fwd, bwd and
    step (`engine.get_wall_clock_timers()` after each step), step by step: the median
    step agrees within 10%. (A single step can differ by milliseconds when the process
    is descheduled between zerowatch's hook and DeepSpeed's timer call on a busy machine;
    the median is robust to that, a sum over a few steps is not.)"""
    run_id = job_run_id(job, config)
    for phase, timer in (("forward", "fwd"), ("backward", "bwd"), ("optimizer_step", "step")):
        stored = server_series(server.api, run_id, f"phase.{phase}", STEPS)
        for rank in (0, 1):
            theirs = [step["timers_ms"][timer] / 1e3 for step in job[rank][config]["steps"]]
            ours = stored[rank]
            assert all(t > 0 for t in theirs) and all(o > 0 for o in ours)
            gaps = [abs(o - t) / t for o, t in zip(ours, theirs, strict=True)]
            assert statistics.median(gaps) <= 0.10, (
                f"{config} rank {rank}: zerowatch {phase} "
                f"{[round(o * 1e3, 2) for o in ours]} ms, DeepSpeed {timer} "
                f"{[round(t * 1e3, 2) for t in theirs]} ms"
            )


#: Measured model state per rank at a step's end, in units of (Ψ, Ψ/N) bytes per element.
_FULL, _SHARD = 4 * PSI, 4 * math.ceil(PSI / 2)
MEASURED = {
    "zero1": {"params": _FULL, "optimizer_states": 2 * _SHARD, "master_weights": _SHARD},
    "zero2": {"params": _FULL, "optimizer_states": 2 * _SHARD, "master_weights": _SHARD},
    "zero3": {"params": _SHARD, "optimizer_states": 2 * _SHARD, "master_weights": _SHARD,
              "grads": _SHARD},
    "zero2_offload": {"params": _FULL, "host_optimizer_states": 2 * _SHARD,
                      "host_master_weights": _SHARD, "host_grads": _SHARD},
    "zero2_accumulate2": {"params": _FULL, "optimizer_states": 2 * _SHARD,
                          "master_weights": _SHARD},
}  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS)
def test_model_state_is_measured_beside_the_theory(
    job: Any, server: LiveServer, config: str
) -> None:
    """What DeepSpeed holds at a step's end, from its own buffers, next to the ZeRO model.

    Parameters, optimizer states and (stage 3, offload) the gradient partitions equal the
    theory. Two differences are DeepSpeed's: it keeps an fp32 master partition even when
    training in fp32 (the model counts none: there the fp32 parameters are the master), and
    stages 1-2 free their gradients inside engine.step(), before the step's end."""
    run_id = job_run_id(job, config)
    theory = job[0][config]["theory"]
    for kind, expected in MEASURED[config].items():
        stored = server_series(server.api, run_id, f"memory.state.{kind}", STEPS)
        for rank in (0, 1):
            assert stored[rank][-1] == expected, f"{config} rank {rank}: {kind}"
        if kind.endswith("master_weights") and config != "zero2_offload":
            assert theory[kind] == 0
        else:
            assert theory[kind] == expected, f"{config}: theory {kind}"
    for kind in ("grads", "host_grads", "params", "host_params", "optimizer_states",
                 "host_optimizer_states", "master_weights", "host_master_weights"):  # fmt: skip
        if kind not in MEASURED[config]:
            assert server_series(server.api, run_id, f"memory.state.{kind}", STEPS) == {}, kind
    stored_theory = server_series(server.api, run_id, "memory.theory.params", STEPS)
    assert stored_theory[0][-1] == theory["params"] > 0


@pytest.mark.parametrize("config", CONFIGS)
def test_closing_the_run_restores_the_engine_and_torch_distributed(job: Any, config: str) -> None:
    assert job[0][config]["restored"] and job[1][config]["restored"]


@pytest.mark.parametrize("config", CONFIGS)
def test_deepspeed_checkpoint_save_and_load_are_timed_on_every_rank(
    job: Any, server: LiveServer, config: str
) -> None:
    import httpx

    run_id = job_run_id(job, config)
    calls = httpx.get(f"{server.api}/runs/{run_id}/checkpoints", timeout=10).json()["checkpoints"]
    assert [(c["op"], c["step"], c["tag"], c["ranks"]) for c in calls] == [
        ("save", STEPS, "last", 2), ("load", STEPS, "last", 2)]  # fmt: skip
    for call in calls:
        # DeepSpeed writes (and reads) every rank's optimizer partition: Adam's two moments
        # and the fp32 parameters of its part, at least 3 x 4 bytes x PSI / 2 a rank.
        assert call["seconds"] > 0 and call["bytes"] >= 3 * 4 * PSI
