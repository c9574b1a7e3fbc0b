"""Faults during 2-rank runs of the real engine: the real server killed in the middle of the
run and started again, and servers that answer 500s, hang, or are down with the spool at its
bound. Training goes on at full speed; every step reaches the server exactly once, except
what the spool bound dropped, which is counted and reported."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from rank_jobs import CLOSE_TIMEOUT_S, HTTP_TIMEOUT_S, step_times_under_faults, through_an_outage
from support.engine_harness import run_ranks
from support.live_server import LiveServer
from zerowatch.agent.upload import upload_spool

pytestmark = pytest.mark.slow

WORLD = 2


def _runs_named(server: LiveServer, name: str) -> list[dict[str, Any]]:
    try:
        runs = httpx.get(f"{server.api}/runs", timeout=5).json()["runs"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return [r for r in runs if r["name"] == name]


def test_server_killed_mid_run_and_restarted_stores_every_step_of_every_rank_once(tmp_path):
    flag = tmp_path / "server-is-back"
    with LiveServer() as server:
        seen: dict[str, Any] = {}

        def outage() -> None:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:  # until both ranks have stored a few steps
                runs = _runs_named(server, "outage")
                ranks = runs[0]["ranks"] if runs else []
                if len(ranks) == WORLD and min(r["steps"] for r in ranks) >= 3:
                    seen["before_kill"] = [r["steps"] for r in ranks]
                    break
                time.sleep(0.1)
            server.kill()  # SIGKILL: a crash, mid-run
            time.sleep(2.0)  # the ranks keep training meanwhile
            server.start()
            flag.touch()

        chaos = threading.Thread(target=outage, daemon=True)
        chaos.start()
        results = run_ranks(through_an_outage, WORLD, server.url, str(tmp_path / "spool"),
                            str(flag), 8, 400, timeout_s=120)  # fmt: skip
        chaos.join(30)
        assert "before_kill" in seen, "the ranks never reached the server before the kill"
        run_id = results[0]["run_id"]
        run = httpx.get(f"{server.api}/runs/{run_id}", timeout=10).json()
        assert run["status"] == "finished"
        for rank, res in enumerate(results):
            steps = res["steps"]
            assert steps > seen["before_kill"][rank] + 8  # the run went on through the outage
            assert res["stats"]["spooled"] > 0  # the agent really had to spool
            assert res["stats"]["dropped_events"] == 0
            (stored,) = (r for r in run["ranks"] if r["rank"] == rank)
            assert (stored["steps"], stored["last_step"], stored["end_status"]) == (
                steps, steps - 1, "finished"
            )  # fmt: skip
        # Replays that overlapped what the server already had were dropped by (run, rank, seq).
        assert not any((tmp_path / "spool").rglob("*.jsonl"))


def test_500s_hangs_and_a_full_spool_cost_training_nothing(tmp_path, fake_server):
    failing, hanging = fake_server("500"), fake_server("hang")
    with LiveServer() as server:
        server.stop()  # down for the full-spool variant; started for the upload below
        urls = {"error_500": failing.url, "hang": hanging.url, "full_spool": server.url}
        # 8 rounds of 3 steps per variant, interleaved: machine noise hits all alike.
        results = run_ranks(step_times_under_faults, WORLD, urls, str(tmp_path / "spool"), 3, 8,
                            timeout_s=180)  # fmt: skip
        for rank, res in enumerate(results):
            # Every request and every spool write of the 72 instrumented steps ran on the
            # shipper thread; the training loop made none.
            assert res["io_on_training_thread"] == {}, (rank, res["io_on_training_thread"])
            assert res["io_on_shipper"].get("http", 0) > 0, (rank, res["io_on_shipper"])
            assert res["io_on_shipper"].get("spool", 0) > 0, (rank, res["io_on_shipper"])
            for name in urls:
                # One request to the hanging server takes 3 s (HTTP_TIMEOUT_S), its retries
                # longer: a step that had waited on one would show it. (Scheduling noise on
                # a loaded 2-core machine reaches ~1 s.) What the shipper's work costs the
                # step time is measured by bench/agent_overhead.py --fault.
                assert res["max"][name] < 2.0, (
                    f"rank {rank}, {name}: a step took {res['max'][name]:.2f} s"
                )
            # close() is bounded even against the hanging server: per run, its timeout plus
            # at most one request in flight.
            assert res["close_s"] < len(urls) * (CLOSE_TIMEOUT_S + HTTP_TIMEOUT_S + 1) + 2
            assert res["stats"]["full_spool"]["dropped_events"] > 0
            for name in ("error_500", "hang"):
                assert res["stats"][name]["dropped_events"] == 0
        assert failing.requests > 3 and hanging.requests >= 1  # both were really tried
        # What the spool kept reaches the (now running) real server; the drops are reported.
        server.start()
        for name in urls:
            result = upload_spool(tmp_path / "spool" / name, server.url)
            assert result.ok, result.summary()
            run = httpx.get(f"{server.api}/runs/{results[0]['run_ids'][name]}", timeout=10).json()
            for rank, res in enumerate(results):
                (stored,) = (r for r in run["ranks"] if r["rank"] == rank)
                recorded = res["stats"][name]["steps"]
                dropped = res["stats"][name]["dropped_events"]
                assert stored["end_status"] == "finished"
                assert stored["dropped_events"] == dropped
                assert stored["steps"] == recorded - dropped
