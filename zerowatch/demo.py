"""`zerowatch demo`: the main job, end to end on one CPU machine.

1. Start a zerowatch server on SQLite (unless `--server` names a running one): on the port
   asked for, or on a free one, said on the console, when another process holds it. The
   runs go only to that child: it must be alive and be the one answering /healthz (by pid).
2. For each requested ZeRO stage, launch an instrumented multi-rank training of a small
   GPT-like model with torchrun (gloo on CPU): `zerowatch.examples.train`.
3. Follow each run's progress from the server (the steps every rank has stored).
4. Print a summary per stage (step time, samples/s, model-state bytes per rank measured
   against the ZeRO theory, bytes communicated per step) and the dashboard addresses.

Everything here talks to the server over HTTP and to training through subprocesses, so this
module imports neither torch nor the server (of zerowatch, only the formatters of
zerowatch.units).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from zerowatch.units import fmt_bytes

console = Console()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind `host:port` now (SO_REUSEADDR, as uvicorn binds)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class ServerStartError(RuntimeError):
    """The demo's own server did not come up; the message says why and what to change."""


def _healthz(url: str) -> dict[str, Any] | None:
    """The body of a 200 answer to `url`/healthz; None for no answer or another status."""
    try:
        resp = httpx.get(f"{url}/healthz", timeout=2)
        body = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else {}


def wait_for_own_server(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Wait until the server at `url` answers /healthz and is `proc`, still alive.

    Any server may answer on the port: one that held it first takes the requests while the
    child fails to bind. The child is known by its pid, which /healthz reports.

    Raises:
        ServerStartError: the child exited, another process answers on the port, or nothing
            answered in time.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(
                f"the server exited with code {proc.returncode} before it was ready"
                " (a port in use? choose another with --port)"
            )
        health = _healthz(url)
        if health is not None:
            if health.get("pid") == proc.pid and proc.poll() is None:
                return
            raise ServerStartError(
                f"another server answers on {url}, not the demo's own (pid {proc.pid}):"
                " choose a free port with --port"
            )
        time.sleep(0.2)
    raise ServerStartError(f"the server at {url} did not answer /healthz within {timeout_s:.0f} s")


def _wait_healthy(url: str, timeout_s: float = 10.0) -> None:
    """Wait until a server the user named (`--server`) answers /healthz."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _healthz(url) is not None:
            return
        time.sleep(0.2)
    raise ServerStartError(f"the server at {url} did not answer /healthz within {timeout_s:.0f} s")


@contextlib.contextmanager
def _server(
    port: int, db_url: str, log_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A `zerowatch serve` subprocess on 127.0.0.1, stopped by its pid on exit.

    The server runs in a process group of its own, so a terminal's Ctrl-C reaches the demo
    alone and the demo stops its server with exactly one SIGTERM. Two signals could reach
    uvicorn in either order (the terminal's SIGINT and the demo's stop, or Ctrl-C pressed
    twice), and it takes a SIGINT after another signal as "quit now", skipping the app's
    shutdown, which closes the database (without it SQLite's `-wal` file, tens of MB after
    a demo, stays behind)."""
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerowatch.cli", "serve", "--host", "127.0.0.1",
             "--port", str(port), "--db", db_url],
            stdout=log, stderr=subprocess.STDOUT, process_group=0,
        )  # fmt: skip
        try:
            wait_for_own_server(url, proc)
            yield url, proc
        finally:
            _stop_server(proc, log_path)


def _stop_server(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 15.0) -> None:
    """SIGTERM, and wait for the server to close its database, deaf to another Ctrl-C or
    stop signal meanwhile (it would leave the server running); SIGKILL after `timeout_s`,
    said."""
    with _handling(STOP_SIGNALS, signal.SIG_IGN):
        if not _stop(proc, signal.SIGTERM, timeout_s):
            console.print(
                f"[yellow]warning:[/] the server did not stop within {timeout_s:.0f} s and was "
                f"killed; its database may keep a -wal file until it is opened again "
                f"(log: {log_path})"
            )


#: What stops the demo: Ctrl-C, `kill`, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _handling(signals: tuple[signal.Signals, ...], handler: Any) -> Iterator[None]:
    """`handler` for `signals` inside the block (signals are the main thread's alone:
    elsewhere, nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _pick_port(port: int) -> int:
    """`port`, or a free one (said on the console) when it is 0 or taken."""
    if port == 0:
        return _free_port()
    if port_is_free(port):
        return port
    free = _free_port()
    console.print(
        f"port {port} is in use by another process; the demo's server takes port {free}"
        " instead (choose one with --port)"
    )
    return free


@dataclass
class StageRun:
    stage: int
    #: A tag unique to this launch, by which the demo finds the run the agents created.
    tag: str
    run_id: str | None = None
    returncode: int | None = None
    log_path: Path | None = None


def _launch(
    stage: int, tag: str, *, world_size: int, steps: int, server: str, log_path: Path
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(world_size), "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()),
        "-m", "zerowatch.examples.train",
        "--stage", str(stage), "--steps", str(steps), "--server", server,
        "--tag", tag, "--name", f"demo-stage{stage}", "--project", "demo",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with log_path.open("wb") as log:  # the child holds its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _stop(proc: subprocess.Popen[bytes], sig: int, timeout_s: float = 15.0) -> bool:
    """Stop a child by its pid: `sig`, then SIGKILL after `timeout_s`. Returns whether it
    stopped by itself (or had already)."""
    if proc.poll() is not None:
        return True
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False
    return True


def _stored_steps(client: httpx.Client, sr: StageRun) -> int:
    """Steps stored for the slowest rank of the launch's run (0 until the run exists)."""
    try:
        resp = client.get("/api/v1/runs", params={"tag": sr.tag})
    except httpx.HTTPError:
        return 0
    runs = resp.json().get("runs", []) if resp.status_code == 200 else []
    if not runs:
        return 0
    sr.run_id = runs[0]["run_id"]
    ranks = runs[0].get("ranks", [])
    return min((r.get("steps", 0) for r in ranks), default=0)


def _summary_table(compare: dict[str, Any], runs: list[StageRun]) -> Table:
    table = Table(title="zerowatch demo: one model, several ZeRO stages")
    for col in ("stage", "step time", "samples/s", "state/rank", "theory/rank", "ratio",
                "comm/step"):  # fmt: skip
        table.add_column(col, justify="right")
    by_id = {r["run"]["run_id"]: r for r in compare.get("runs", [])}
    for sr in runs:
        r = by_id.get(sr.run_id, {})
        state = r.get("model_state_bytes") or {}
        measured, theory = state.get("measured_total"), state.get("theory_total")
        ratio = f"{measured / theory:.2f}" if measured and theory else "-"
        comm = (r.get("comm_bytes_per_step") or {}).get("measured") or {}
        st = r.get("step_time_s")
        sps = r.get("samples_per_s")
        table.add_row(
            str(sr.stage),
            f"{st * 1000:.1f} ms" if st else "-",
            f"{sps:.1f}" if sps else "-",
            fmt_bytes(measured),
            fmt_bytes(theory),
            ratio,
            fmt_bytes(sum(comm.values()) if comm else None),
        )
    windows = {tuple(r.get("window") or ()) for r in by_id.values()} - {(), (None, None)}
    if windows:  # what "step time" is, as the runs list, run and compare pages say it
        n = max(b - a + 1 for a, b in windows)
        table.caption = (
            f"step time, samples/s: median over each run's newest {n} steps of "
            "each step's median rank (the job's samples/s), as on the pages"
        )
    return table


#: The contention (the step, less its collective waits, over the CPU time the job's threads
#: used: the doctor's `basis.contention`) from which the demo says the host was busy: the
#: doctor's own line (DoctorSettings.stage_choice_min_gain, 10%), above which its finding on
#: the run page says the times are for the host to itself.
CONTENDED = 1.10


def _contention(client: httpx.Client, run_id: str) -> float | None:
    """How contended the run's host was, as the server's doctor measured it (None where no
    finding carries it: a GPU run, an agent without the CPU clocks, no prediction made)."""
    try:
        resp = client.get(f"/api/v1/runs/{run_id}/findings")
        found = resp.json().get("findings", []) if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    values = [((f.get("prediction") or {}).get("basis") or {}).get("contention")
              for f in found if isinstance(f, dict)]  # fmt: skip
    known = [float(v) for v in values if isinstance(v, (int, float))]
    return max(known, default=None)


def busy_host_note(client: httpx.Client, runs: list[StageRun]) -> str | None:
    """A warning for the summary when the host was busy during some run (another process on
    its cores, or the job itself waiting): then the step times above are slower than this
    machine gives and may not rank the stages as they would. None on a quiet host."""
    busy = {sr.stage: c for sr in runs if sr.run_id
            and (c := _contention(client, sr.run_id)) is not None and c > CONTENDED}  # fmt: skip
    if not busy:
        return None
    each = ", ".join(f"ZeRO-{stage} {c:.2f}x" for stage, c in busy.items())
    return (f"The host was busy: outside their collective waits the steps took longer than"
            f" the job's threads ran on the CPU ({each}): they waited for cores (another"
            " process on this machine?). The step times above are slower than this machine"
            " gives and may not rank the stages as a quiet host would; the run pages say"
            " more.")  # fmt: skip


def run_demo(
    *,
    stages: list[int],
    world_size: int = 2,
    steps: int = 30,
    port: int = 8321,
    db_url: str | None = None,
    server: str | None = None,
    serve: bool = True,
) -> int:
    """Run the demo; returns the process exit code (0 when every run succeeded)."""
    workdir = Path(tempfile.mkdtemp(prefix="zerowatch-demo-"))
    with contextlib.ExitStack() as stack:
        # SIGTERM and SIGHUP end the demo as Ctrl-C does, through the clean-up that stops
        # the training and the server it started (the server, in a process group of its
        # own, would run on).
        stack.enter_context(_handling((signal.SIGTERM, signal.SIGHUP), _interrupt))
        if server is None:
            port = _pick_port(port)
            db = db_url or f"sqlite:///{Path.cwd() / 'zerowatch-demo.db'}"
            try:
                url, _ = stack.enter_context(_server(port, db, workdir / "server.log"))
            except ServerStartError as e:
                log_tail = (workdir / "server.log").read_text(errors="replace")[-1500:]
                console.print(f"[red]error:[/] {e} (log: {workdir / 'server.log'})")
                console.print(log_tail, markup=False, highlight=False)
                return 1
            console.print(f"zerowatch server on {url} (database {db})")
        else:
            url = server.rstrip("/")
            try:
                _wait_healthy(url)
            except ServerStartError as e:
                console.print(f"[red]error:[/] {e}")
                return 1

        launch = uuid.uuid4().hex[:8]
        runs = [StageRun(stage=s, tag=f"demo-{launch}-stage{s}") for s in stages]
        client = stack.enter_context(httpx.Client(base_url=url, timeout=10))
        progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console,
        )  # fmt: skip
        with progress:
            for sr in runs:
                sr.log_path = workdir / f"stage{sr.stage}.log"
                task = progress.add_task(f"ZeRO-{sr.stage} x{world_size} ranks", total=steps)
                proc = _launch(sr.stage, sr.tag, world_size=world_size, steps=steps,
                               server=url, log_path=sr.log_path)  # fmt: skip
                try:
                    while proc.poll() is None:
                        progress.update(task, completed=_stored_steps(client, sr))
                        time.sleep(0.5)
                except BaseException:  # Ctrl-C or an error here: leave no training behind
                    _stop(proc, signal.SIGINT)  # torchrun stops its workers on SIGINT
                    raise
                sr.returncode = proc.returncode
                # The agents flush at close; give the last batch a moment to land.
                deadline = time.monotonic() + 10
                while _stored_steps(client, sr) < steps and time.monotonic() < deadline:
                    time.sleep(0.2)
                progress.update(task, completed=_stored_steps(client, sr))

        failed = [sr for sr in runs if sr.returncode != 0]
        for sr in failed:
            console.print(
                f"[red]ZeRO-{sr.stage} failed[/] (exit {sr.returncode}); log: {sr.log_path}"
            )
            if sr.log_path and sr.log_path.exists():
                console.print(sr.log_path.read_text(errors="replace")[-3000:])
        ok = [sr for sr in runs if sr.returncode == 0 and sr.run_id]
        if ok:
            ids = ",".join(str(r.run_id) for r in ok)
            resp = client.get("/api/v1/compare", params={"runs": ids})
            compare = resp.json() if resp.status_code == 200 else {}
            console.print(_summary_table(compare, ok))
            note = busy_host_note(client, ok)
            if note:
                console.print(f"[yellow]warning:[/] {note}", highlight=False)
            for sr in ok:
                console.print(f"ZeRO-{sr.stage} run:  {url}/runs/{sr.run_id}", soft_wrap=True)
            console.print(f"compare:    {url}/compare?runs={ids}", soft_wrap=True)
            console.print(f"all runs:   {url}/")
        if server is None and serve and ok:
            console.print("Serving the dashboards; press Ctrl-C to stop.")
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
        return 1 if failed else 0


__all__ = ["busy_host_note", "run_demo"]
