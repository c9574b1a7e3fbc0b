"""Crashes and divergence of a real 2-rank gloo job against a live server: an out-of-memory
error in one rank's forward crashes the run with the stack, the step, the phase and the
memory waterfall in a `crash` finding (the user's code sees the same exception); a NaN put
into one rank's gradient of one layer is traced to that rank and that layer; a NaN born in
one rank's forward is traced to the module that produced it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from crash_jobs import OOM_MESSAGE, nan_in_forward, nan_in_gradient, oom_in_forward
from support.engine_harness import run_ranks
from support.live_server import LiveServer

pytestmark = pytest.mark.slow

WORLD = 2


def _findings(server: LiveServer, run_id: str, kind: str) -> list[dict[str, Any]]:
    got = httpx.get(f"{server.api}/runs/{run_id}/findings", timeout=10).json()
    return [f for f in got["findings"] if f["kind"] == kind]


def test_out_of_memory_in_a_forward_crashes_the_run_with_stack_step_phase_and_waterfall(tmp_path):
    with LiveServer() as server:
        results = run_ranks(oom_in_forward, WORLD, server.url, str(tmp_path / "spool"), 1, 7,
                            "blocks.2.fc", timeout_s=120)  # fmt: skip
        assert results[1]["raised"] and results[1]["same"]  # the very exception raised
        assert results[1]["status"] == "crashed"
        run_id = results[0]["run_id"]
        run = httpx.get(f"{server.api}/runs/{run_id}", timeout=10).json()
        assert run["status"] == "crashed"
        by_rank = {r["rank"]: r for r in run["ranks"]}
        assert by_rank[1]["end_status"] == "crashed" and by_rank[1]["steps"] == 7
        (crash,) = _findings(server, run_id, "crash")
        assert crash["severity"] == "critical" and crash["ranks"] == [1]
        ev = crash["evidence"]
        assert (ev["type"], ev["step"], ev["phase"]) == ("OutOfMemoryError", 7, "forward")
        assert ev["message"] == OOM_MESSAGE
        assert "blow_up" in ev["stack"] and "crash_jobs.py" in ev["stack"]
        memory = ev["memory"]
        bars = memory["waterfall"]
        assert bars["theory"] > 0 and bars["model_state"] > 0
        assert bars["comm_buffers"] > 0  # the reduce bucket of the config
        assert bars["activations"] is None  # not measurable on a CPU
        assert memory["failed_allocation_bytes"] == 2 * 2**30
        assert memory["model_state"]["params"] > 0 and memory["device"] == "cpu"
        assert "step 7" in crash["message"] and "forward" in crash["message"]


def test_nan_in_one_ranks_gradient_names_that_rank_and_layer(tmp_path):
    with LiveServer() as server:
        results = run_ranks(nan_in_gradient, WORLD, server.url, str(tmp_path / "spool"), 1, 9,
                            "blocks.2.fc.weight", 11, timeout_s=120)  # fmt: skip
        run_id = results[0]["run_id"]
        (nan,) = _findings(server, run_id, "nonfinite")
        ev = nan["evidence"]
        assert nan["steps"][0] == 9 and ev["first_step"] == 9
        assert ev["first_rank"] == 1 and ev["first_module"] == "blocks.2.fc"
        assert ev["nonfinite_params"] == ["blocks.2.fc.weight"]
        assert nan["ranks"] == [1]
        # Each rank's local gradient norm before the reduction: rank 1's is not finite.
        norms = ev["local_grad_norms"]
        assert norms["1"] is None and norms["0"] > 0
        assert ev["departing_ranks"] == [1]
        assert ev["batch_ids"]["1"] == ["r1-s9-0", "r1-s9-1"]
        assert "rank 1 in blocks.2.fc" in nan["message"]


def test_nan_born_in_a_forward_is_traced_to_the_module_that_made_it(tmp_path):
    with LiveServer() as server:
        results = run_ranks(nan_in_forward, WORLD, server.url, str(tmp_path / "spool"), 1,
                            [6, 7], "blocks.1.fc", 10, timeout_s=120)  # fmt: skip
        run_id = results[0]["run_id"]
        (nan,) = _findings(server, run_id, "nonfinite")
        ev = nan["evidence"]
        assert ev["forward_module"] == "blocks.1.fc"
        assert ev["forward_rank"] == 1 and ev["forward_step"] == 7  # the step that repeated it
        # The origin: the module, not the gradients its NaN loss spoiled (all of rank 1's).
        assert ev["first_rank"] == 1 and ev["first_module"] == "blocks.1.fc"
        assert ev["grad_rank"] == 1 and ev["grad_module"] == "tok_emb"
        assert "rank 1 in blocks.1.fc" in nan["message"]
