"""`zerowatch runs` keeps run ids whole at any terminal width, so that an id can be copied
into `zerowatch trace`: other columns are dropped first."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from support.live_server import LiveServer

from zerowatch import simulate

IDS = ("demo-stage3-d4b2c154ee5e", "a-rather-long-run-name-from-a-sweep-0123456789abcdef")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with LiveServer() as s:
        for i, run_id in enumerate(IDS):
            spec = simulate.SimSpec(name=f"run{i}", project="front-door-project")
            body = dataclasses.asdict(simulate.run_create(spec, run_id=run_id))
            assert httpx.post(f"{s.api}/runs", json=body, timeout=10).status_code == 201
        yield s


def runs_at(width: int, server: LiveServer) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "zerowatch.cli", "runs", "--server", server.url],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS=str(width)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("width", [200, 80, 60, 30])
def test_runs_keeps_every_id_whole(width: int, server: LiveServer) -> None:
    out = runs_at(width, server)
    for run_id in IDS:
        assert run_id in out, out
    assert "…" not in out
    if width >= len(max(IDS, key=len)) + 4:  # a table, within the terminal
        assert max(len(line) for line in out.splitlines()) <= width


def test_runs_narrower_than_an_id_prints_the_ids_one_a_line(server: LiveServer) -> None:
    assert sorted(runs_at(30, server).splitlines()) == sorted(IDS)


def test_runs_on_a_wide_terminal_shows_every_column(server: LiveServer) -> None:
    header = runs_at(200, server).splitlines()[1]
    for column in ("id", "name", "project", "status", "stage", "world", "steps", "step time"):
        assert column in header, header


def test_runs_on_a_narrow_terminal_drops_the_project_before_the_status(
    server: LiveServer,
) -> None:
    out = runs_at(80, server)
    assert "front-door-project" not in out and "status" in out, out


def test_runs_at_80_columns_says_which_columns_it_left_out(server: LiveServer) -> None:
    """At 80 columns the table lost the project, world, steps and step time without a word."""
    out = runs_at(80, server)
    assert max(len(line) for line in out.splitlines()) <= 80
    note = " ".join(out.split("Left out to fit 80 columns:", 1)[1].split())
    assert note.startswith("project, stage, world, steps, step time (s) (a wider terminal"), out
    header = out.splitlines()[1]
    assert all(c in header for c in ("id", "name", "status")), header
    # Narrower than an id: the ids alone on stdout, the note on stderr.
    proc = subprocess.run(
        [sys.executable, "-m", "zerowatch.cli", "runs", "--server", server.url],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="30"),
    )  # fmt: skip
    assert "Left out" not in proc.stdout and "name, project, status" in proc.stderr


def test_runs_at_80_columns_keeps_the_step_time_of_demo_runs() -> None:
    """Demo-sized ids at 80 columns: the step time is kept and the world, steps and project
    are the ones left out (the step time went first before)."""
    from zerowatch import cli

    rows = [{"id": f"demo-stage{s}-1dda7f43b770", "status": "finished", "name": f"demo-stage{s}",
             "steps": "100", "stage": str(s), "step time (s)": "0.054", "world": "2",
             "project": "demo"} for s in (1, 2, 3)]  # fmt: skip
    table, left_out = cli._runs_table(rows, width=80)
    assert table is not None
    assert [c.header for c in table.columns] == ["id", "name", "status", "stage", "step time (s)"]
    assert left_out == ["project", "world", "steps"]
