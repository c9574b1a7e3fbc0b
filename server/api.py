"""The JSON API under /api/v1: thin routes over store.py (writes) and read/ (reads)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from zerowatch.server import read, store
from zerowatch.server.body import BodyRoute
from zerowatch.server.deps import DbDep, SettingsDep, require_read, require_write
from zerowatch.server.read import compare as compare_read
from zerowatch.server.read import series as series_read
from zerowatch.server.read import trace as trace_read

from zerowatch import events as ev

router = APIRouter(prefix="/api/v1", route_class=BodyRoute)

Read = [Depends(require_read)]
Write = [Depends(require_write)]

RunId = Annotated[str, Path(min_length=1, max_length=store.MAX_RUN_ID_CHARS)]
INT32 = 2**31 - 1
INT63 = 2**63 - 1
Rank = Annotated[int | None, Query(ge=0, le=INT32, description="One rank.")]
Ranks = Annotated[
    str | None,
    Query(max_length=2000, description='Ranks and ranges, e.g. "0-7,12"; "stats" (default): '
          "the statistics over every rank."),
]  # fmt: skip
Host = Annotated[str | None, Query(max_length=500, description="The ranks of one host.")]
Top = Annotated[
    int | None,
    Query(ge=1, le=series_read.MAX_SELECTED_RANKS,
          description="The K ranks that stand out in the range (worst first)."),
]  # fmt: skip
MaxPoints = Annotated[int, Query(ge=2, le=20000)]
StepBound = Annotated[int | None, Query(ge=0, le=INT63)]
T = TypeVar("T")


def _found(out: T | None, run_id: str) -> T:
    """`out`, or a 404 naming the run when the read found no such run."""
    if out is None:
        raise HTTPException(404, f"run {run_id!r} not found")
    return out


@contextlib.contextmanager
def _query_errors(loc: str = "metric") -> Iterator[None]:
    """Turn a read's complaint about its query into a 422 naming the parameter."""
    try:
        yield
    except read.UnknownMetric as e:
        raise HTTPException(
            422, [{"type": "value_error", "loc": ["query", loc], "msg": str(e)}]
        ) from None
    except read.BadSelection as e:
        raise HTTPException(
            422, [{"type": "value_error", "loc": ["query", "ranks"], "msg": str(e)}]
        ) from None


def _unprocessable(e: store.BatchError) -> HTTPException:
    return HTTPException(422, [{"type": "value_error", "loc": list(e.loc), "msg": e.msg}])


# -- runs ---------------------------------------------------------------------------------


@router.post("/runs", dependencies=Write, status_code=201, tags=["runs"])
def create_run(
    run: ev.RunCreate, response: Response, db: DbDep, settings: SettingsDep
) -> dict[str, Any]:
    """Create a run (idempotent on run_id: 201 when new, 200 when it exists)."""
    try:
        _, created = store.create_run(db, run=run)
    except store.BatchError as e:
        raise _unprocessable(e) from None
    if not created:
        response.status_code = 200
    out = read.get_run(
        db=db,
        run_id=run.run_id,
        stalled_after_s=settings.stalled_after_s,
        recent_steps=settings.recent_steps,
    )
    return _found(out, run.run_id)


@router.get("/runs", dependencies=Read, tags=["runs"])
def list_runs(
    db: DbDep,
    settings: SettingsDep,
    project: Annotated[str | None, Query(max_length=500)] = None,
    status: Annotated[ev.RunStatus | None, Query()] = None,
    tag: Annotated[str | None, Query(max_length=500)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """Runs, newest first, filtered by project, status and tag."""
    runs = read.list_runs(
        db=db,
        project=project,
        status=status,
        tag=tag,
        limit=limit,
        stalled_after_s=settings.stalled_after_s,
        recent_steps=settings.recent_steps,
    )
    return {"runs": runs}


@router.get("/runs/{run_id}", dependencies=Read, tags=["runs"])
def get_run(run_id: RunId, db: DbDep, settings: SettingsDep) -> dict[str, Any]:
    """One run: its config, status, rank summary and recent performance."""
    out = read.get_run(
        db=db,
        run_id=run_id,
        stalled_after_s=settings.stalled_after_s,
        recent_steps=settings.recent_steps,
    )
    return _found(out, run_id)


@router.get("/runs/{run_id}/ranks", dependencies=Read, tags=["runs"])
def ranks(
    run_id: RunId,
    db: DbDep,
    host: Host = None,
    rank_from: Annotated[int | None, Query(ge=0, le=INT32)] = None,
    rank_to: Annotated[int | None, Query(ge=0, le=INT32)] = None,
    limit: Annotated[int, Query(ge=1, le=100000)] = 1000,
) -> dict[str, Any]:
    """A run's ranks: host, local rank, progress and how each ended."""
    out = read.ranks_of(
        db=db, run_id=run_id, host=host, rank_from=rank_from, rank_to=rank_to, limit=limit
    )
    return _found(out, run_id)


@router.get("/runs/{run_id}/hosts", dependencies=Read, tags=["runs"])
def hosts(run_id: RunId, db: DbDep) -> dict[str, Any]:
    """A run's hosts and the ranks on each."""
    return _found(read.hosts_of(db=db, run_id=run_id), run_id)


@router.delete("/runs/{run_id}", dependencies=Write, tags=["runs"])
def delete_run(run_id: RunId, db: DbDep) -> dict[str, Any]:
    """Delete a run and everything stored for it."""
    if not store.delete_run(db, run_id=run_id):
        raise HTTPException(404, f"run {run_id!r} not found")
    return {"deleted": run_id}


# -- ingest -------------------------------------------------------------------------------


@dataclasses.dataclass
class IngestAnswer:
    """What a batch did: events newly stored, and events already held (replays)."""

    accepted: int
    duplicates: int


@router.post(
    "/runs/{run_id}/events",
    dependencies=Write,
    tags=["ingest"],
    response_model=IngestAnswer,
    responses={404: {"description": "unknown run"}, 413: {"description": "batch too large"}},
)
async def ingest(run_id: RunId, batch: ev.EventBatch, request: Request) -> JSONResponse:
    """Store a batch of events (gzip allowed); idempotent on (run, rank, seq)."""
    # The hot path: the batch joins the writer thread's next group; the loop awaits it.
    try:
        result = await request.app.state.ingestor.submit_async(run_id=run_id, batch=batch)
    except store.BatchError as e:
        raise _unprocessable(e) from None
    _found(result, run_id)
    assert result is not None
    return JSONResponse({"accepted": result.accepted, "duplicates": result.duplicates})


# -- reads --------------------------------------------------------------------------------


@router.get("/runs/{run_id}/metrics-catalog", dependencies=Read, tags=["series"])
def metrics_catalog(run_id: RunId, db: DbDep) -> dict[str, Any]:
    """The metric names stored for a run, with their units."""
    return _found(read.metrics_catalog(db=db, run_id=run_id), run_id)


@router.get("/runs/{run_id}/series", dependencies=Read, tags=["series"])
def series(
    run_id: RunId,
    db: DbDep,
    metric: Annotated[
        str,
        Query(
            min_length=1,
            max_length=300,
            description="e.g. step_time_s, phase.forward, collective.all_gather.busbw",
        ),
    ],
    rank: Rank = None,
    ranks: Ranks = None,
    host: Host = None,
    top: Top = None,
    max_points: MaxPoints = 500,
    step_from: StepBound = None,
    step_to: StepBound = None,
) -> dict[str, Any]:
    """One quantity over steps: rank statistics (default) or the selected ranks' series."""
    with _query_errors():
        selection = read.Selection.parse(rank=rank, ranks=ranks, host=host, top=top)
        out = series_read.series(
            db=db,
            run_id=run_id,
            metric=metric,
            selection=selection,
            max_points=max_points,
            step_from=step_from,
            step_to=step_to,
        )
    return _found(out, run_id)


@router.get("/runs/{run_id}/outliers", dependencies=Read, tags=["series"])
def outliers(
    run_id: RunId,
    db: DbDep,
    metric: Annotated[str, Query(min_length=1, max_length=300)] = "busy_s",
    k: Annotated[int, Query(ge=1, le=series_read.MAX_SELECTED_RANKS)] = 8,
    step_from: StepBound = None,
    step_to: StepBound = None,
) -> dict[str, Any]:
    """The K ranks that stand out in a metric over a range of steps, with their hosts."""
    with _query_errors():
        out = series_read.outliers_of(
            db=db, run_id=run_id, metric=metric, k=k, step_from=step_from, step_to=step_to
        )
    return _found(out, run_id)


@router.get("/runs/{run_id}/breakdown", dependencies=Read, tags=["series"])
def breakdown(
    run_id: RunId, db: DbDep, rank: Rank = None, max_points: MaxPoints = 500
) -> dict[str, Any]:
    """Step time per step: exclusive parts (they add up), phases, exposed and hidden comm."""
    out = read.step_breakdown(db=db, run_id=run_id, rank=rank, max_points=max_points)
    return _found(out, run_id)


@router.get("/runs/{run_id}/heatmap", dependencies=Read, tags=["series"])
def heatmap(
    run_id: RunId,
    db: DbDep,
    metric: Annotated[str, Query(min_length=1, max_length=300)] = "step_time_s",
    max_steps: Annotated[int, Query(ge=1, le=5000)] = 200,
    agg: Annotated[str, Query(pattern="^(max|median)$")] = "max",
) -> dict[str, Any]:
    """A metric per rank, or per block of ranks for a wide run, over the newest steps."""
    with _query_errors():
        out = read.rank_heatmap(db=db, run_id=run_id, metric=metric, max_steps=max_steps,
                                agg=agg)  # fmt: skip
    return _found(out, run_id)


@router.get("/compare", dependencies=Read, tags=["series"])
def compare(
    db: DbDep,
    runs: Annotated[
        str, Query(min_length=1, max_length=4000, description="Comma-separated run ids.")
    ],
    metrics: Annotated[
        str | None,
        Query(max_length=4000, description="Comma-separated metrics to add (medians)."),
    ] = None,
    window: Annotated[int, Query(ge=1, le=100000)] = 100,
) -> dict[str, Any]:
    """Runs side by side: model state, bytes per step per op, step parts, samples/s."""
    run_ids = [r.strip() for r in runs.split(",") if r.strip()]
    metric_names = [x.strip() for x in (metrics or "").split(",") if x.strip()]
    if not run_ids:
        raise HTTPException(
            422, [{"type": "value_error", "loc": ["query", "runs"], "msg": "name at least one run"}]
        )
    with _query_errors("metrics"):
        return compare_read.compare(db=db, run_ids=run_ids, metrics=metric_names, window=window)


@router.get("/runs/{run_id}/trace", dependencies=Read, tags=["trace"])
def trace(
    run_id: RunId,
    db: DbDep,
    settings: SettingsDep,
    steps: Annotated[
        str | None,
        Query(max_length=60, pattern=r"^\d{0,18}:\d{0,18}$", description="A:B (inclusive)"),
    ] = None,
) -> JSONResponse:
    """The run's steps as Chrome-trace / Perfetto JSON (one process per rank)."""
    lo = hi = None
    if steps:
        a, b = steps.split(":")
        lo = int(a) if a else None
        hi = int(b) if b else None
    out = _found(
        trace_read.trace(
            db=db, run_id=run_id, step_from=lo, step_to=hi, max_steps=settings.max_trace_steps
        ),
        run_id,
    )
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:60]
    return JSONResponse(
        out, headers={"Content-Disposition": f'inline; filename="zerowatch-{safe}.trace.json"'}
    )


@router.get(
    "/alerts/rules.yml", dependencies=Read, tags=["alerts"], response_class=PlainTextResponse
)
async def alert_rules() -> PlainTextResponse:
    """The Prometheus recording and alerting rules (default settings), as YAML."""
    try:
        from zerowatch.alerts import AlertSettings, render_rules
    except ImportError as e:
        raise HTTPException(
            503, f"alert rules are not available in this installation: {e}"
        ) from None
    text = await run_in_threadpool(lambda: render_rules(AlertSettings()))
    return PlainTextResponse(text, media_type="application/yaml")


__all__ = ["router"]
