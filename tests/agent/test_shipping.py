"""Shipping under faults, one process with a fake engine: a server answering 500s, hanging,
refusing the token or the batch size, and a spool that is full or cannot be written.
Training never waits on any of it, and nothing is lost that the bound did not drop (the
multi-rank tests against the real server are in test_multirank_faults.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest
from rank_jobs import TrainingThreadIO
from zerowatch.agent.upload import upload_spool

import zerowatch

FAST = {"flush_interval_s": 0.05, "retry_max_wait_s": 0.2, "http_timeout_s": 1.0}


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def wait_for(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def training_thread_io(monkeypatch):
    """HTTP requests and spool writes, counted by the thread that made them."""
    io = TrainingThreadIO()
    io.install(monkeypatch.setattr)
    return io


def watched_steps(engine, run, io: TrainingThreadIO, n: int = 30) -> list[float]:
    """Step times of `n` instrumented steps, with the agent's I/O counted meanwhile."""
    io.watching = True
    try:
        return step_times(engine, run, n)
    finally:
        io.watching = False


def step_times(engine, run=None, n: int = 30) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.train_step()
        if run is not None:
            run.log(loss=1.0)
        out.append(time.perf_counter() - t0)
    return out


def test_events_reach_the_server_gzipped_in_order_with_the_token(
    fake_engine, fake_server, spool_root
):
    server = fake_server("ok")
    with zerowatch.instrument(fake_engine, server=server.url, token="s3cret",
                              spool_dir=spool_root, **FAST) as run:  # fmt: skip
        step_times(fake_engine, run, 10)
    assert [e["step"] for e in server.steps()] == list(range(10))
    assert [k[1] for k in server.order] == list(range(11))  # 10 steps + the end, by seq
    assert server.events[(0, 10)]["kind"] == "end"
    assert server.runs and server.runs[0]["run_id"] == run.id
    event_posts = [h for h in server.headers if h.get("Content-Encoding") == "gzip"]
    assert event_posts and all(h["Authorization"] == "Bearer s3cret" for h in server.headers)
    assert not spool_root.exists() or not any(spool_root.rglob("*.jsonl"))


def test_server_answering_500_costs_training_nothing_and_loses_nothing(
    fake_engine, fake_server, spool_root, training_thread_io
):
    server = fake_server("500")
    run = zerowatch.instrument(fake_engine, server=server.url, spool_dir=spool_root, **FAST)
    with_agent = watched_steps(fake_engine, run, training_thread_io)
    assert wait_for(lambda: server.requests >= 3)  # it really tried
    # Every request and spool write ran on the shipper thread, none on the training loop; a
    # synchronous POST (with its retry waits) would also add >= 0.1 s to some step.
    assert training_thread_io.on_training_thread == {}
    assert training_thread_io.elsewhere["http"] >= 1  # (the count sees the client's requests)
    assert max(with_agent) < 0.1
    assert wait_for(lambda: run.stats["spooled"] >= 29)  # all but the open step, on disk
    server.mode = "ok"  # the server recovers before the end: the spool is replayed
    run.close()
    assert [e["step"] for e in server.steps()] == list(range(30))
    assert server.events[(0, 30)]["kind"] == "end"


def test_hanging_server_costs_training_nothing_and_the_spool_keeps_every_step(
    fake_engine, fake_server, spool_root, training_thread_io
):
    server = fake_server("hang")
    run = zerowatch.instrument(fake_engine, server=server.url, spool_dir=spool_root,
                               **{**FAST, "close_timeout_s": 0.5})  # fmt: skip
    with_agent = watched_steps(fake_engine, run, training_thread_io)
    # A request to this server blocks for http_timeout_s (1 s): none ran on the training
    # loop, and no step waited on one.
    assert training_thread_io.on_training_thread == {}
    assert max(with_agent) < 0.1
    assert wait_for(lambda: server.requests >= 1)  # it really tried
    t0 = time.monotonic()
    run.close()
    assert time.monotonic() - t0 < 0.5 + FAST["http_timeout_s"] + 2.0  # bounded, not hung
    good = fake_server("ok")
    result = upload_spool(spool_root, good.url)
    assert result.ok, result.summary()
    assert [e["step"] for e in good.steps()] == list(range(30))
    assert good.events[(0, 30)]["kind"] == "end"


def test_refused_token_sends_everything_to_the_spool_for_upload(
    fake_engine, fake_server, spool_root
):
    server = fake_server("401")
    with zerowatch.instrument(fake_engine, server=server.url, spool_dir=spool_root, **FAST) as run:
        step_times(fake_engine, run, 5)
    assert server.requests == 1  # asked once (the RunCreate), then never again
    good = fake_server("ok")
    assert upload_spool(spool_root / run.id, good.url).ok
    assert len(good.steps()) == 5


def test_batches_over_the_size_limit_are_split(fake_engine, fake_server, spool_root):
    server = fake_server("ok", max_batch=3)
    with zerowatch.instrument(fake_engine, server=server.url, spool_dir=spool_root,
                              **{**FAST, "flush_interval_s": 5.0, "batch_max_events": 10}) as run:  # fmt: skip
        step_times(fake_engine, run, 12)
    assert [e["step"] for e in server.steps()] == list(range(12))
    assert run.stats["dropped_events"] == 0


def test_full_spool_drops_are_counted_reported_and_training_goes_on(
    fake_engine, fake_server, spool_root
):
    url = closed_port_url()  # nothing listens: the server is down the whole run
    run = zerowatch.instrument(fake_engine, server=url, spool_dir=spool_root,
                               max_spool_bytes=40_000, **FAST)  # fmt: skip
    times = step_times(fake_engine, run, 40)
    run.close()
    assert max(times) < 0.1
    dropped = run.stats["dropped_events"]
    assert 0 < dropped < 40
    good = fake_server("ok")
    assert upload_spool(spool_root, good.url).ok
    steps = good.steps()
    assert len(steps) == 40 - dropped
    assert [e["step"] for e in steps] == list(range(len(steps)))  # the oldest are kept
    end = good.events[(0, 40)]
    assert end["kind"] == "end" and end["dropped_events"] == dropped


def test_unwritable_spool_loses_events_but_not_training(fake_engine, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    run = zerowatch.instrument(fake_engine, spool_dir=not_a_dir, **FAST)  # no server either
    times = step_times(fake_engine, run, 10)
    run.close()
    assert max(times) < 0.1
    assert run.stats["dropped_events"] == 11  # 10 steps and the end event
    assert run.stats["agent_errors"] == 0


def test_upload_of_a_spool_twice_stores_each_step_once(fake_engine, fake_server, spool_root):
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, **FAST) as run:
        step_times(fake_engine, run, 7)
    segs = list((spool_root / run.id).rglob("*.jsonl"))
    assert segs and json.loads((spool_root / run.id / "run.json").read_text())["run_id"] == run.id
    good = fake_server("ok")
    first, second = upload_spool(spool_root, good.url), upload_spool(spool_root, good.url)
    assert first.ok and second.ok
    assert (first.accepted, first.duplicates) == (8, 0)
    assert (second.accepted, second.duplicates) == (0, 8)
    assert "8 events" in first.summary()


def test_upload_of_a_folder_that_is_not_a_spool_fails_clearly(tmp_path, fake_server):
    result = upload_spool(tmp_path, fake_server("ok").url)
    assert not result.ok and "run.json" in result.summary()


def test_torn_last_line_is_skipped_on_upload(fake_engine, fake_server, spool_root):
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, **FAST) as run:
        step_times(fake_engine, run, 3)
    seg = sorted((spool_root / run.id).rglob("*.jsonl"))[-1]
    with open(seg, "ab") as f:
        f.write(b'{"kind":"step","rank":0,"se')  # a crash mid-write
    good = fake_server("ok")
    assert upload_spool(spool_root, good.url).ok
    assert len(good.steps()) == 3


def test_server_and_token_default_to_the_environment(
    fake_engine, fake_server, spool_root, monkeypatch
):
    server = fake_server("ok")
    monkeypatch.setenv("ZEROWATCH_SERVER", server.url)
    monkeypatch.setenv("ZEROWATCH_TOKEN", "from-env")
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, **FAST) as run:
        step_times(fake_engine, run, 2)
    assert run.server == server.url and len(server.steps()) == 2
    assert all(h["Authorization"] == "Bearer from-env" for h in server.headers)


def test_zerowatch_upload_command_sends_a_spool(fake_engine, fake_server, spool_root):
    from typer.testing import CliRunner

    from zerowatch.cli import app

    with zerowatch.instrument(fake_engine, spool_dir=spool_root, **FAST) as run:
        step_times(fake_engine, run, 3)
    good = fake_server("ok")
    result = CliRunner().invoke(app, ["upload", str(spool_root / run.id), "--server", good.url])
    assert result.exit_code == 0, result.output
    assert "4 stored" in result.output and len(good.steps()) == 3
    down = CliRunner().invoke(app, ["upload", str(spool_root), "--server", closed_port_url()])
    assert down.exit_code == 1 and "error" in down.output


def test_a_server_that_lost_the_run_gets_it_created_again(fake_engine, fake_server, spool_root):
    server = fake_server("ok")
    with zerowatch.instrument(fake_engine, server=server.url, spool_dir=spool_root, **FAST) as run:
        step_times(fake_engine, run, 3)
        assert wait_for(lambda: len(server.steps()) >= 2)
        server.runs.clear()  # restarted on an empty database
        step_times(fake_engine, run, 3)
    assert [e["step"] for e in server.steps()] == list(range(6))
    assert [r["run_id"] for r in server.runs] == [run.id]
    assert run.stats["dropped_events"] == 0


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs: writes past it fail with ENOSPC, like a full disk (needs root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                              capture_output=True, text=True)  # fmt: skip
        error = done.stderr.strip() if done.returncode else ""
    except OSError as e:
        error = str(e)
    if error:
        pytest.skip(f"cannot mount a tmpfs here ({error}); the spool-bound test covers drops")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_loses_events_not_training_and_reports_the_loss(
    fake_engine, fake_server, full_disk
):
    server = fake_server("500")  # unreachable during training: everything goes to the spool
    run = zerowatch.instrument(fake_engine, server=server.url, spool_dir=full_disk, **FAST)
    times = step_times(fake_engine, run, 100)
    assert max(times) < 0.1
    assert wait_for(lambda: run.stats["dropped_events"] > 0)  # ENOSPC, not the spool bound
    server.mode = "ok"  # back before the end: the spool is replayed, then the end event sent
    run.close()
    dropped = run.stats["dropped_events"]
    steps = server.steps()
    assert 0 < dropped < 100 and len(steps) == 100 - dropped
    stored = [e["step"] for e in steps]
    assert stored == sorted(set(stored))  # in order, each once; those lost are just absent
    end = server.events[(0, 100)]
    assert end["kind"] == "end" and end["dropped_events"] == dropped


def test_the_queue_is_bounded_when_the_shipper_is_stuck(fake_engine, fake_server, spool_root):
    server = fake_server("hang")
    run = zerowatch.instrument(fake_engine, server=server.url, spool_dir=spool_root,
                               queue_size=10, flush_interval_s=0.05, http_timeout_s=2.0,
                               close_timeout_s=0.2)  # fmt: skip
    step_times(fake_engine, run, 2)  # one event out: the shipper asks the server...
    assert wait_for(lambda: server.requests >= 1)  # ...and is now stuck in that request
    times = step_times(fake_engine, run, 30)
    assert max(times) < 0.1
    assert run.stats["queue_peak"] <= 10
    assert run.stats["dropped_events"] >= 30 - 10 - 1  # past the bound: dropped, counted
    run.close()
