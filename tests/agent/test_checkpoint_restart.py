"""A job killed after a checkpoint and restarted from it, on 2 real gloo ranks against a
live server: one job of two runs, the redone steps and the time lost shown, the save and
load timed per rank (seconds, bytes) and exposed in /metrics."""

from __future__ import annotations

import math

import httpx
import pytest
from restart_jobs import killed_after_checkpoint, restarted_from_checkpoint
from support.engine_harness import run_ranks
from support.live_server import LiveServer
from zerowatch.server.read.jobs import PARTS

pytestmark = pytest.mark.slow

WORLD = 2
SAVE_AT, KILLED_AT, STEPS = 4, 7, 10


def test_a_job_killed_after_a_checkpoint_and_restarted_is_one_job_with_its_lost_time(tmp_path):
    job, ckpt, spool = "pretrain-7b", str(tmp_path / "ckpt"), str(tmp_path / "spool")
    with LiveServer() as server:
        first = run_ranks(killed_after_checkpoint, WORLD, server.url, spool, job, ckpt, SAVE_AT,
                          KILLED_AT, timeout_s=120, may_die=frozenset({0, 1}))  # fmt: skip
        assert first == [None, None]  # both ranks were killed
        second = run_ranks(restarted_from_checkpoint, WORLD, server.url, spool, job, ckpt,
                           STEPS, timeout_s=120)  # fmt: skip

        got = httpx.get(f"{server.api}/jobs/{job}", timeout=10).json()
        assert got["job"] == job and got["restarts"] == 1
        a, b = got["runs"]
        assert b["run_id"] == second[0]["run_id"] and a["run_id"] != b["run_id"]
        assert (a["first_step"], a["last_step"], a["steps"]) == (0, KILLED_AT - 1, KILLED_AT)
        assert (b["first_step"], b["last_step"]) == (SAVE_AT, STEPS - 1)
        # Steps 4, 5 and 6 ran twice: the first run's copies are lost time.
        assert a["redone_steps"] == KILLED_AT - SAVE_AT == got["redone_steps"]
        assert b["redone_steps"] == 0 and a["redone_s"] > 0
        parts = got["parts"]
        assert set(parts) == set(PARTS)
        assert math.isclose(sum(parts.values()), got["wall_s"], rel_tol=1e-9)
        assert parts["redone"] == pytest.approx(a["redone_s"])
        assert parts["restart"] > 0 and parts["startup"] > 0
        assert 0 < got["goodput"] < 1
        assert got["goodput"] == pytest.approx(parts["productive"] / got["wall_s"])

        # The save (first run) and the load (second run), timed on every rank.
        (save,) = a["checkpoints"]
        (load,) = b["checkpoints"]
        assert (save["op"], save["step"], save["ranks"]) == ("save", SAVE_AT, WORLD)
        assert (load["op"], load["step"], load["ranks"]) == ("load", SAVE_AT, WORLD)
        assert save["tag"] == load["tag"] == f"global_step{SAVE_AT}"
        for call in (save, load):
            assert call["seconds"] > 0 and call["bytes"] > 0
            assert call["bandwidth_bytes_per_s"] == pytest.approx(call["bytes"] / call["seconds"])
        assert parts["checkpoint_save"] == pytest.approx(save["rank0_seconds"])
        assert parts["checkpoint_load"] == pytest.approx(load["rank0_seconds"])
        assert save["seconds"] >= save["rank0_seconds"] > 0
        per_run = httpx.get(f"{server.api}/runs/{a['run_id']}/checkpoints", timeout=10).json()
        assert per_run["job"] == job and per_run["checkpoints"] == [save]
        run_b = httpx.get(f"{server.api}/runs/{b['run_id']}", timeout=10).json()
        assert run_b["job"] == job

        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert (
            f'zerowatch_checkpoint_seconds{{op="save",project="default",run="{a["run_id"]}"}}'
            in text
        )
        assert (
            f'zerowatch_checkpoint_seconds{{op="load",project="default",run="{b["run_id"]}"}}'
            in text
        )
        assert (
            "zerowatch_checkpoint_bytes{" in text
            and "zerowatch_checkpoint_bandwidth_bytes_per_second{" in text
        )
        assert httpx.get(f"{server.api}/jobs/nope", timeout=10).status_code == 404

        # The job's page and the run page's way to it.
        page = httpx.get(f"{server.url}/jobs/{job}", timeout=10)
        assert page.status_code == 200
        assert f'data-run="{a["run_id"]}"' in page.text and f'data-run="{b["run_id"]}"' in page.text
        assert 'data-part="redone"' in page.text and f"{100 * got['goodput']:.1f}%" in page.text
        run_page = httpx.get(f"{server.url}/runs/{a['run_id']}", timeout=10).text
        assert f'href="/jobs/{job}"' in run_page
        assert httpx.get(f"{server.url}/jobs/nope", timeout=10).status_code == 404
