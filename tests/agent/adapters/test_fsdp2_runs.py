"""An FSDP2 model (`fully_shard` on each Linear and the root) with AdamW on two gloo ranks,
in fp32 and under a bf16 mixed-precision policy, instrumented by
`zerowatch.instrument(model, optimizer=opt)`, against a live server."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.foreign_jobs import (
    assert_every_step_stored,
    fsdp2_worker,
    job_run_id,
    run_job,
    server_collective_purposes,
    server_run,
    server_series,
)
from support.live_server import LiveServer

pytestmark = pytest.mark.slow

STEPS = 4
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
PSI = 4 * (256 * 256 + 256)
CONFIGS = ["fp32", "bf16"]
#: Bytes per parameter element gathered and reduce-scattered (the policy's param dtype).
WIRE = {"fp32": 4, "bf16": 2}


@pytest.fixture(scope="module")
def job(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    out = tmp_path_factory.mktemp("fsdp2")
    yield run_job(fsdp2_worker, Path(out), server=server.url, configs=CONFIGS, steps=STEPS)


@pytest.mark.parametrize("config", CONFIGS)
def test_every_step_of_every_rank_reaches_the_server(
    job: Any, server: LiveServer, config: str
) -> None:
    assert_every_step_stored(server, job_run_id(job, config), STEPS)


@pytest.mark.parametrize("config", CONFIGS)
def test_run_records_fsdp2_mesh_and_mixed_precision_policy(
    job: Any, server: LiveServer, config: str
) -> None:
    run = server_run(server.api, job_run_id(job, config))
    assert run["engine"] == "fsdp2" and run["zero_stage"] == 3 and run["precision"] == config
    assert run["engine_info"]["mesh"] == {
        "device_type": "cpu", "shape": [2], "dim_names": [], "ranks": [0, 1],
    }  # fmt: skip
    dtype = {"fp32": "None", "bf16": "torch.bfloat16"}[config]
    assert run["engine_info"]["mp_policy"]["param_dtype"] == dtype
    # Four Linear layers and the root, all resharding after forward at instrument time.
    assert run["engine_info"]["sharded_modules"] == {
        "modules": 5, "kept_gathered_after_forward": 0,
    }  # fmt: skip
    assert run["config"]["fsdp2"]["optimizer"]["type"] == "AdamW"
    assert run["param_count"] == PSI and run["world_size"] == 2


@pytest.mark.parametrize("config", CONFIGS)
def test_reported_collective_bytes_equal_what_fsdp2_sent(
    job: Any, server: LiveServer, config: str
) -> None:
    run_id = job_run_id(job, config)
    for op in OPS:
        stored = server_series(server.api, run_id, f"collective.{op}.bytes", STEPS)
        for rank in (0, 1):
            counted = [step["bytes"].get(op, 0) for step in job[rank][config]["steps"]]
            reported = [int(v) for v in stored.get(rank, [0.0] * STEPS)]
            assert reported == counted, f"rank {rank} {op}"
    # Full sharding: parameters gathered in forward and again in backward, gradients
    # reduce-scattered once: 2 x and 1 x the model in the policy's dtype per step.
    for rank in (0, 1):  # nothing zerowatch has no name for (reduce, all-to-all, send)
        assert all(set(step["bytes"]) <= set(OPS) for step in job[rank][config]["steps"])
    wire = WIRE[config]
    assert job[0][config]["steps"][-1]["bytes"] == {
        "all_gather": 2 * wire * PSI, "reduce_scatter": wire * PSI,
    }  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS)
def test_phases_partition_the_step(job: Any, server: LiveServer, config: str) -> None:
    """Forward, backward and optimizer_step ran every step, inside the step's time."""
    run_id = job_run_id(job, config)
    step_time = server_series(server.api, run_id, "step_time_s", STEPS)
    phases = {p: server_series(server.api, run_id, f"phase.{p}", STEPS)
              for p in ("forward", "backward", "optimizer_step")}  # fmt: skip
    for rank in (0, 1):
        for i in range(STEPS):
            parts = [phases[p][rank][i] for p in phases]
            assert all(v > 0 for v in parts), (rank, i, parts)
            assert sum(parts) <= step_time[rank][i] * 1.001


@pytest.mark.parametrize("config", CONFIGS)
def test_all_gathers_are_parameter_fetches_and_reduce_scatters_gradient_reduction(
    job: Any, server: LiveServer, config: str
) -> None:
    run_id = job_run_id(job, config)
    counts = server_series(server.api, run_id, "collective.all_gather.count", STEPS)
    assert counts[0] == counts[1] == [8.0] * STEPS  # 4 layers, in forward and in backward
    purposes = server_collective_purposes(server.api, run_id)
    assert purposes == {("all_gather", "param_fetch"), ("reduce_scatter", "grad_reduce")}


@pytest.mark.parametrize("config", CONFIGS)
def test_model_state_is_the_local_shards_and_optimizer_state(
    job: Any, server: LiveServer, config: str
) -> None:
    """fp32: params, grads and optimizer states are the ZeRO-3 shards, equal to the theory.
    bf16: the fp32 shards are the master weights (equal to the theory); gradients stay fp32
    (twice the model's bf16 gradients); no low-precision parameter is held at rest."""
    run_id = job_run_id(job, config)
    shard = math.ceil(PSI / 2)
    expected = {"grads": 4 * shard, "optimizer_states": 8 * shard}
    expected["params" if config == "fp32" else "master_weights"] = 4 * shard
    for kind, value in expected.items():
        stored = server_series(server.api, run_id, f"memory.state.{kind}", STEPS)
        theory = server_series(server.api, run_id, f"memory.theory.{kind}", STEPS)
        for rank in (0, 1):
            assert stored[rank][-1] == value, (kind, rank)
            if (config, kind) != ("bf16", "grads"):
                assert theory[rank][-1] == value, (kind, rank)
    if config == "bf16":
        assert server_series(server.api, run_id, "memory.theory.grads", STEPS)[0][-1] == 2 * shard
        assert server_series(server.api, run_id, "memory.state.params", STEPS) == {}


@pytest.mark.parametrize("config", CONFIGS)
def test_closing_the_run_removes_every_hook_and_wrapper(job: Any, config: str) -> None:
    assert job[0][config]["restored"] and job[1][config]["restored"]
