"""`zerowatch serve | demo | plan | alerts render | trace | upload | runs | doctor | selftest`.

The command line is thin: each subcommand parses its options (typer) and calls one function
of the module that owns the work, imported inside the subcommand so that `zerowatch --help`
stays fast and the server never pulls in torch.

Exit codes: 0 success, 1 the work failed (server unreachable, a run failed), 2 bad usage or
bad input (typer's own usage errors, a config mistake). Errors are printed as one line on
stderr, without a traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

if TYPE_CHECKING:
    from rich.table import Table

app = typer.Typer(
    name="zerowatch",
    help="See what ZeRO-sharded training does: engine, agent, server, dashboards, alerts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
alerts_app = typer.Typer(help="Prometheus alert rules for sharded training.", no_args_is_help=True)
app.add_typer(alerts_app, name="alerts")

EXIT_FAILED = 1
EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print `error: message` on stderr and exit with `code` (no traceback)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


DEFAULT_SERVER = "http://127.0.0.1:8321"
ServerOpt = Annotated[
    str | None,
    typer.Option(
        "--server", help="zerowatch server URL [env: ZEROWATCH_SERVER]", envvar="ZEROWATCH_SERVER"
    ),
]


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8321,
    db: Annotated[
        str | None,
        typer.Option(
            help="SQLAlchemy URL [env: ZEROWATCH_DB_URL; default: sqlite file ./zerowatch.db]",
            envvar="ZEROWATCH_DB_URL",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="Token required for ingest and delete [env: ZEROWATCH_TOKEN]",
            envvar="ZEROWATCH_TOKEN",
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Server processes on the port; more than 1 needs PostgreSQL (--db).",
        ),
    ] = 1,
    allowed_hosts: Annotated[
        str | None,
        typer.Option(
            help="Host names the server answers to, comma-separated, '*' for any [env: "
            "ZEROWATCH_ALLOWED_HOSTS; default: localhost, --host and this machine's names "
            "and addresses]",
        ),
    ] = None,
) -> None:
    """Run the zerowatch server (API, dashboards, /metrics)."""
    from zerowatch.server.app import serve as _serve
    from zerowatch.server.settings import Settings, SettingsError

    # uvicorn binds after start-up and reports a taken port after "startup complete": ask first.
    problem = _bind_problem(host, port)
    if problem:
        fail(problem, EXIT_USAGE)
    try:
        settings = Settings.from_env(db_url=db, token=token)
        typer.echo(
            f"zerowatch server on http://{host}:{port} (database {_shown_db(settings.db_url)})"
        )
        # Ctrl-C while the server's modules load and its database migrates ends the
        # process at once (nothing is served or half-written yet: SQLite and PostgreSQL
        # roll a migration back); uvicorn installs its own handler when it starts.
        signal.signal(signal.SIGINT, _exit_at_once)
        _serve(host=host, port=port, db_url=db, token=token, workers=workers,
               allowed_hosts=allowed_hosts)  # fmt: skip
    except SettingsError as e:
        fail(str(e), EXIT_USAGE)


def _exit_at_once(signum: int, _frame: object) -> None:
    os._exit(128 + signum)


def _bind_problem(host: str, port: int) -> str | None:
    """Why `zerowatch serve` could not listen on host:port now, or None if it could."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return f"port {port} on {host} is in use by another process: choose another with --port"
        return f"cannot listen on {host}:{port} ({e.strerror or e}): check --host and --port"
    return None


def _shown_db(db_url: str) -> str:
    """The database URL as `serve` prints it: a SQLite file's absolute path, no password."""
    from sqlalchemy.engine import make_url

    url = make_url(db_url)
    if url.drivername.startswith("sqlite") and url.database and url.database != ":memory:":
        url = url.set(database=str(Path(url.database).resolve()))
    return url.render_as_string(hide_password=True)


@app.command()
def upload(
    spool_dir: Annotated[
        Path, typer.Argument(help="Spool folder written by an agent with no server.")
    ],
    server: ServerOpt = None,
    token: Annotated[
        str | None,
        typer.Option(envvar="ZEROWATCH_TOKEN", help="Ingest token [env: ZEROWATCH_TOKEN]"),
    ] = None,
) -> None:
    """Send a local spool of events to a server (each step stored exactly once)."""
    from zerowatch.agent.upload import upload_spool

    if not spool_dir.is_dir():
        fail(f"spool folder not found: {spool_dir}", EXIT_USAGE)
    result = upload_spool(spool_dir, server=server or DEFAULT_SERVER, token=token)
    typer.echo(result.summary())
    if not result.ok:
        raise typer.Exit(EXIT_FAILED)


@app.command()
def demo(
    stages: Annotated[str, typer.Option(help="ZeRO stages to run, comma-separated.")] = "1,2,3",
    world_size: Annotated[int, typer.Option(help="Ranks per run (torchrun, gloo on CPU).")] = 2,
    steps: Annotated[int, typer.Option(help="Optimizer steps per run.")] = 100,
    port: Annotated[int, typer.Option(help="Server port (0: a free one).")] = 8321,
    db: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL (default: sqlite file ./zerowatch-demo.db).")
    ] = None,
    server: Annotated[
        str | None, typer.Option(help="Use this running server instead of starting one.")
    ] = None,
    no_serve: Annotated[
        bool, typer.Option("--no-serve", help="Stop the server when the runs end.")
    ] = False,
) -> None:
    """The main job: a server, instrumented multi-rank CPU runs per stage, a summary."""
    from zerowatch.demo import run_demo

    try:
        stage_list = [int(s) for s in stages.split(",") if s.strip()]
    except ValueError:
        fail(f"--stages: expected comma-separated integers, got {stages!r}", EXIT_USAGE)
    if not stage_list or any(s not in (0, 1, 2, 3) for s in stage_list):
        fail(f"--stages: each stage must be 0, 1, 2 or 3, got {stages!r}", EXIT_USAGE)
    if world_size < 1:
        fail(f"--world-size: expected >= 1, got {world_size}", EXIT_USAGE)
    code = run_demo(
        stages=stage_list, world_size=world_size, steps=steps, port=port, db_url=db,
        server=server, serve=not no_serve,
    )  # fmt: skip
    raise typer.Exit(code)


@app.command()
def plan(
    params: Annotated[str, typer.Option(help="Model parameters, e.g. 70e9 or 7B.")],
    gpus: Annotated[int, typer.Option(help="GPUs (data-parallel ranks) in all.")] = 8,
    gpu_memory: Annotated[str, typer.Option(help="Memory per GPU, e.g. 80GiB.")] = "80GiB",
    nodes: Annotated[int, typer.Option(help="Machines the GPUs are spread over.")] = 1,
    offload: Annotated[
        str, typer.Option(help="Offload: none or cpu (or 'both' to compare).")
    ] = "both",
    precision: Annotated[str, typer.Option(help="fp32, bf16 or fp16.")] = "bf16",
    bandwidth: Annotated[
        str | None, typer.Option(help="Interconnect bus bandwidth per GPU, e.g. 100GB/s.")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="A DeepSpeed JSON config to evaluate.")
    ] = None,
    host_memory: Annotated[
        str | None, typer.Option(help="CPU memory per node, e.g. 1TiB (checks offload fits).")
    ] = None,
    hidden_size: Annotated[
        int | None, typer.Option(help='Model hidden size (resolves "auto" buckets in --config).')
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Capacity planner: per-rank memory and communication for each ZeRO stage."""
    from zerowatch.config import ConfigError
    from zerowatch.plan import PlanError, plan_from_cli

    try:
        text = plan_from_cli(
            params=params, gpus=gpus, gpu_memory=gpu_memory, nodes=nodes, offload=offload,
            precision=precision, bandwidth=bandwidth, config=config, as_json=as_json,
            host_memory=host_memory, hidden_size=hidden_size,
        )  # fmt: skip
    except (PlanError, ConfigError) as e:
        fail(str(e), EXIT_USAGE)
    typer.echo(text)


@alerts_app.command("render")
def alerts_render(
    out: Annotated[
        Path | None, typer.Option(help="Write the rule file here (default: stdout).")
    ] = None,
    settings: Annotated[Path | None, typer.Option(help="YAML/JSON file of alert settings.")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Override one setting, e.g. --set step_time_regression_ratio=1.2"
        ),
    ] = None,
) -> None:
    """Render the Prometheus recording and alerting rules."""
    from zerowatch.alerts import AlertSettings, SettingsError, render_rules

    try:
        cfg = AlertSettings.load(settings, overrides=set_ or [])
    except SettingsError as e:
        fail(str(e), EXIT_USAGE)
    text = render_rules(cfg)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}", err=True)


@app.command()
def selftest(
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node",
            min=1,
            help="Ranks to launch (default: one per GPU, 2 without CUDA).",
        ),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the report here as JSON.")
    ] = None,
    server: ServerOpt = None,
    stages: Annotated[str, typer.Option(help="ZeRO stages of the engine check.")] = "0,1,2,3",
    steps: Annotated[int, typer.Option(help="Optimizer steps per stage.")] = 5,
    sizes: Annotated[
        str | None,
        typer.Option(help="Collective sizes (default: 1MiB,16MiB,64MiB; on CPU 256KiB,1MiB,4MiB)."),
    ] = None,
    warmup: Annotated[int, typer.Option(help="Untimed iterations per collective.")] = 5,
    iters: Annotated[int, typer.Option(help="Timed iterations per collective.")] = 20,
    agent_steps: Annotated[int, typer.Option(help="Timed steps with the agent.")] = 10,
    clock_rounds: Annotated[int, typer.Option(help="Round trips per clock estimate.")] = 10,
) -> None:
    """Check this node: the engine against plain AdamW, collective bandwidth, the agent's
    cost, clock offsets (torchrun on this machine; exit 1 when the engine check fails)."""
    from zerowatch.selftest import UsageError, launch, parse_args

    argv = [
        "--stages", stages, "--steps", str(steps), "--warmup", str(warmup),
        "--iters", str(iters), "--agent-steps", str(agent_steps),
        "--clock-rounds", str(clock_rounds),
        *(["--sizes", sizes] if sizes else []),
        *(["--json", str(json_path.resolve())] if json_path else []),
        *(["--server", server] if server else []),
    ]  # fmt: skip
    try:
        parse_args(argv)
    except UsageError as e:
        fail(str(e), EXIT_USAGE)
    raise typer.Exit(EXIT_FAILED if launch(nproc_per_node, argv) else 0)


def _get(server: str, path: str, **params: str) -> object:
    import httpx

    try:
        resp = httpx.get(server.rstrip("/") + path, params=params or None, timeout=30)
    except httpx.HTTPError as e:
        fail(f"cannot reach {server}: {e}")
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        fail(f"{resp.status_code} from {server}{path}: {detail}")
    return resp.json()


@app.command()
def trace(
    run: Annotated[str, typer.Argument(help="Run id.")],
    steps: Annotated[str | None, typer.Option(help="Step range A:B (B exclusive).")] = None,
    out: Annotated[Path | None, typer.Option(help="Write here (default: stdout).")] = None,
    server: ServerOpt = None,
) -> None:
    """Export a run as Chrome-trace / Perfetto JSON (open in ui.perfetto.dev)."""
    import json

    params = {"steps": steps} if steps else {}
    data = _get(server or DEFAULT_SERVER, f"/api/v1/runs/{run}/trace", **params)
    text = json.dumps(data)
    if out is None:
        typer.echo(text)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}", err=True)


@app.command()
def doctor(
    run: Annotated[str, typer.Argument(help="Run id.")],
    server: ServerOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON the API gives.")] = False,
    fail_on: Annotated[
        str | None,
        typer.Option(help="Exit 1 when a finding is this severe or more: warning or critical."),
    ] = None,
) -> None:
    """What is wrong with a run and what to change: the doctor's findings."""
    import json
    from urllib.parse import quote

    if fail_on not in (None, "warning", "critical"):
        fail(f"--fail-on: expected warning or critical, got {fail_on!r}", EXIT_USAGE)
    data = _get(server or DEFAULT_SERVER, f"/api/v1/runs/{quote(run, safe='')}/findings")
    found = data.get("findings", []) if isinstance(data, dict) else []
    named = (data.get("figures") if isinstance(data, dict) else None) or {}
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(_render_findings(run, found, named))
    levels = {"warning": ("warning", "critical"), "critical": ("critical",)}.get(fail_on or "", ())
    if any(f.get("severity") in levels for f in found):
        raise typer.Exit(EXIT_FAILED)


def _render_findings(
    run: str, found: list[dict[str, object]], named: dict[str, dict[str, object]]
) -> str:
    """The run's named figures (the run page's tiles: each "label text (statistic)"), then
    the findings as plain text, most severe first (as the server orders them)."""
    import json

    from zerowatch.units import fmt_bytes, fmt_seconds

    figures = [f"  {f.get('label')} {f.get('text')} ({f.get('stat')})" for f in named.values()]
    if not found:
        return "\n".join([f"{run}: nothing to report.", *figures])
    lines = [f"{run}: {len(found)} finding(s)", *figures]
    for f in found:
        ranks = f.get("ranks") or []
        steps = f.get("steps") or []
        where = f" ranks {', '.join(map(str, ranks))}" if ranks else ""  # type: ignore[call-overload]
        span = f" steps {steps[0]}-{steps[1]}" if len(steps) == 2 else ""  # type: ignore[arg-type,index]
        lines.append("")
        lines.append(f"[{str(f.get('severity', '')).upper()}] {f.get('kind')}{where}{span}")
        lines.append(f"  {f.get('message')}")
        lines.append(f"  -> {f.get('suggestion')}")
        pred = f.get("prediction")
        if isinstance(pred, dict):
            lines.append(
                f"  predicted: {fmt_seconds(pred.get('step_time_s'))} a step (now "
                f"{fmt_seconds(pred.get('step_time_now_s'))}), "
                f"{fmt_bytes(pred.get('model_state_bytes'))} of model state per rank; config: "
                + json.dumps(pred.get("config"))
            )
    return "\n".join(lines)


@app.command()
def runs(
    server: ServerOpt = None,
    project: Annotated[str | None, typer.Option(help="Only this project.")] = None,
    status: Annotated[
        str | None, typer.Option(help="running, finished, failed or stalled.")
    ] = None,
) -> None:
    """List the runs a server holds."""
    from rich.console import Console

    params = {k: v for k, v in (("project", project), ("status", status)) if v}
    data = _get(server or DEFAULT_SERVER, "/api/v1/runs", **params)
    items = data.get("runs", data) if isinstance(data, dict) else data
    rows = []
    for r in items:  # type: ignore[union-attr]
        steps_stored = max((x.get("steps", 0) for x in r.get("ranks", [])), default=0)
        st = r.get("step_time_s")
        rows.append({
            "id": str(r["run_id"]), "status": str(r.get("status", "")),
            "name": str(r.get("name", "")), "steps": str(steps_stored),
            "stage": str(r.get("zero_stage", "")),
            "step time (s)": f"{st:.3f}" if isinstance(st, (int, float)) else "-",
            "world": str(r.get("world_size", "")), "project": str(r.get("project", "")),
        })  # fmt: skip
    console = Console()
    table, left_out = _runs_table(rows, width=console.width)
    note = (f"Left out to fit {console.width} columns: {', '.join(left_out)} (a wider "
            "terminal, or COLUMNS=200, shows them)." if left_out else "")  # fmt: skip
    if table is None:  # narrower than the longest id: the ids alone, one a line
        typer.echo("\n".join(r["id"] for r in rows))
        if note:
            typer.echo(note, err=True)
    else:
        console.print(table)
        if note:
            console.print(note, markup=False, highlight=False, style="dim")


#: `zerowatch runs` columns in the order they are dropped last to first when the terminal is
#: narrow (what tells runs apart and how fast they step before the rest); the id is never
#: cut, so it can be copied into `zerowatch trace`. What was dropped is said under the table.
_RUNS_COLUMNS = ("id", "status", "name", "step time (s)", "stage", "steps", "world", "project")
_SHOWN_ORDER = ("id", "name", "project", "status", "stage", "world", "steps", "step time (s)")


def _runs_table(rows: list[dict[str, str]], *, width: int) -> tuple[Table | None, list[str]]:
    """A rich Table of `rows` with as many columns as fit `width` whole, the id always
    (None when not even the id column fits), and the columns left out, in table order."""
    from rich.table import Table

    def natural(col: str) -> int:  # the cell with its padding and left border
        return max([len(col)] + [len(r[col]) for r in rows]) + 3

    kept = list(_RUNS_COLUMNS)
    while kept and sum(natural(c) for c in kept) + 1 > width:
        kept.pop()
    left_out = [c for c in _SHOWN_ORDER if c not in kept and c != "id"]
    if not kept:
        return None, left_out
    table = Table()
    for col in (c for c in _SHOWN_ORDER if c in kept):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(*(r[c] for c in _SHOWN_ORDER if c in kept))
    return table, left_out


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()
