"""The doctor on real training runs: the example GPT under torchrun, 2 gloo ranks on CPU,
each run made to go wrong in one way (tests/support/doctor_job.py), shipping to a live
server. Each run gets the finding expected and no other warning or critical finding.

The runs go one after the other (a few seconds each): run side by side on a 2-core machine
they would slow each other down unevenly and make stragglers of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.live_server import LiveServer
from support.ports import free_port

pytestmark = pytest.mark.slow

JOB = Path(__file__).parents[1] / "support" / "doctor_job.py"
#: A model big enough that compute, not noise, sets a step (about 60 ms on one CPU core).
MODEL = ("--d-model", "128", "--seq-len", "64", "--micro-batch", "8", "--steps", "12")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with LiveServer() as s:
        yield s


def _train(server: LiveServer, tmp_path: Path, *args: str) -> list[dict]:
    """Train one faulty run to its end; its findings once its steps are all stored."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(JOB),
           "--server", server.url, *MODEL, *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = tmp_path / "train.log"
    with log.open("wb") as out:
        code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=240)
    text = log.read_text(errors="replace")
    assert code.returncode == 0, text[-3000:]
    run_id = [ln.split()[1] for ln in text.splitlines() if ln.startswith("run ")][-1]
    deadline = time.monotonic() + 30
    while True:  # the agents flush on close; wait for every rank-step to be stored
        run = httpx.get(f"{server.api}/runs/{run_id}", timeout=30).json()
        if run["rank_summary"]["finished"] == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    got = httpx.get(f"{server.api}/runs/{run_id}/findings", timeout=30)
    assert got.status_code == 200, got.text
    return got.json()["findings"]


def _loud(found: list[dict]) -> set[str]:
    return {f["kind"] for f in found if f["severity"] in ("warning", "critical")}


def test_a_clean_run_has_no_warning(server: LiveServer, tmp_path: Path) -> None:
    found = _train(server, tmp_path, "--stage", "2")
    assert _loud(found) == set(), found


def test_one_rank_slow_in_its_forward_is_a_compute_straggler(
    server: LiveServer, tmp_path: Path
) -> None:
    found = _train(server, tmp_path, "--stage", "2", "--slow-rank", "1",
                   "--slow-forward-s", "0.1")  # fmt: skip
    assert _loud(found) == {"straggler"}, found
    (f,) = [f for f in found if f["kind"] == "straggler"]
    assert f["ranks"] == [1] and f["evidence"]["part"] == "compute"
    assert "compute" in f["message"] and "forward" in f["message"]


def test_a_sleep_between_steps_on_every_rank_is_an_input_stall(
    server: LiveServer, tmp_path: Path
) -> None:
    found = _train(server, tmp_path, "--stage", "2", "--input-sleep-s", "0.05")
    assert _loud(found) == {"input_stall"}, found


def test_tiny_buckets_make_latency_bound_collectives(server: LiveServer, tmp_path: Path) -> None:
    # Stage 3: a reduce bucket of 500 elements splits the all-reduce of the persistent
    # parameters into many tiny calls, beside reduce-scatters of ~170 KiB.
    found = _train(server, tmp_path, "--stage", "3", "--reduce-bucket-size", "500",
                   "--prefetch-bucket-size", "5e7")  # fmt: skip
    assert _loud(found) == {"latency_bound_collectives"}, found
    (f,) = [f for f in found if f["kind"] == "latency_bound_collectives"]
    assert "reduce_bucket_size" in f["prediction"]["config"]["zero_optimization"]


def test_every_collective_small_is_latency_bound_against_the_links_bandwidth(
    server: LiveServer, tmp_path: Path
) -> None:
    # Stage 2, a model of small parameters (d_model 16) and 600-element buckets: every
    # reduce-scatter and all-gather carries ~600 elements (2.4 KiB), so no op of the run
    # has larger messages to compare with; the engine's probe of the link at
    # initialization (a reduce-scatter of 8 MiB) shows what the link reaches.
    found = _train(server, tmp_path, "--stage", "2", "--reduce-bucket-size", "600",
                   "--d-model", "16", "--layers", "8")  # fmt: skip
    (f,) = [f for f in found if f["kind"] == "latency_bound_collectives"
            and f["evidence"]["op"] == "reduce_scatter"]  # fmt: skip
    assert f["severity"] == "warning", found
    assert f["evidence"]["message_bytes"] < 4096
    assert f["evidence"]["reference"] == "rehearsal"
    assert f["evidence"]["reference_message_bytes"] >= 8 << 20
    assert f["message"].startswith("reduce_scatter: ")
    assert "reduce_bucket_size (now 600 elements)" in f["suggestion"]
    assert "reduce_bucket_size" in f["prediction"]["config"]["zero_optimization"]
    assert f["prediction"]["step_time_s"] < f["prediction"]["step_time_now_s"]


def test_an_fp16_run_whose_loss_scale_collapses(server: LiveServer, tmp_path: Path) -> None:
    found = _train(server, tmp_path, "--stage", "2", "--precision", "fp16", "--overflow",
                   "--steps", "16")  # fmt: skip
    assert _loud(found) == {"loss_scale"}, found
    assert found[0]["kind"] == "loss_scale" and found[0]["severity"] == "critical"
