"""The JSON API under /api/v1: thin routes over store.py (writes) and read/ (reads)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any, TypeVar

import pydantic
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.models import Schema
from fastapi.responses import JSONResponse, PlainTextResponse
from zerowatch.server import heartbeats, ingest_path, read, store
from zerowatch.server.auth import request_headers
from zerowatch.server.body import BodyRoute
from zerowatch.server.deps import DbDep, SettingsDep, require_read, require_write
from zerowatch.server.read import compare as compare_read
from zerowatch.server.read import doctor, jobs
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


# -- the answers every route shares: 404 for an unknown run, 422 naming what was refused ------


def _not_found(run_id: str) -> HTTPException:
    return HTTPException(404, f"run {run_id!r} not found")


def _unprocessable(loc: Sequence[str | int], msg: str) -> HTTPException:
    """A 422 in FastAPI's own validation shape, naming where the input was refused."""
    return HTTPException(422, [{"type": "value_error", "loc": list(loc), "msg": msg}])


def _found(out: T | None, run_id: str) -> T:
    """`out`, or a 404 naming the run when the read found no such run."""
    if out is None:
        raise _not_found(run_id)
    return out


@contextlib.contextmanager
def _refused(loc: str = "metric") -> Iterator[None]:
    """Turn a refused input into a 422 naming it: a read's query parameter (`loc` for an
    unknown metric, `ranks` for a bad selection) or a stored body's field."""
    try:
        yield
    except read.UnknownMetric as e:
        raise _unprocessable(["query", loc], str(e)) from None
    except read.BadSelection as e:
        raise _unprocessable(["query", "ranks"], str(e)) from None
    except store.BatchError as e:
        raise _unprocessable(e.loc, e.msg) from None


def _of_run(read_fn: Callable[..., T | None], run_id: str, **kwargs: Any) -> T:
    """`read_fn(run_id=run_id, **kwargs)`: a 404 when there is no such run, a 422 naming
    the query parameter the read refused."""
    with _refused():
        out = read_fn(run_id=run_id, **kwargs)
    return _found(out, run_id)


# -- runs ---------------------------------------------------------------------------------


@router.post("/runs", dependencies=Write, status_code=201, tags=["runs"])
def create_run(
    run: ev.RunCreate, response: Response, db: DbDep, settings: SettingsDep
) -> dict[str, Any]:
    """Create a run (idempotent on run_id: 201 when new, 200 when it exists); answers the
    run's record (GET /runs/{run_id} adds its ranks and recent performance)."""
    with _refused():
        _, created = store.create_run(db, run=run)
    if not created:
        response.status_code = 200
    return _of_run(read.run_record, run.run_id, db=db, stalled_after_s=settings.stalled_after_s)


@router.get("/runs", dependencies=Read, tags=["runs"])
def list_runs(
    db: DbDep,
    settings: SettingsDep,
    project: Annotated[str | None, Query(max_length=500)] = None,
    status: Annotated[ev.RunStatus | None, Query()] = None,
    tag: Annotated[str | None, Query(max_length=500)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=INT32)] = 0,
) -> dict[str, Any]:
    """Runs, newest first, filtered by project, status and tag: `limit` of them after the
    first `offset`."""
    runs = read.list_runs(
        db=db,
        project=project,
        status=status,
        tag=tag,
        limit=limit,
        offset=offset,
        stalled_after_s=settings.stalled_after_s,
        recent_steps=settings.recent_steps,
    )
    return {"runs": runs}


@router.get("/runs/{run_id}", dependencies=Read, tags=["runs"])
def get_run(run_id: RunId, db: DbDep, settings: SettingsDep) -> dict[str, Any]:
    """One run: its config, status, rank summary and recent performance."""
    return _of_run(read.get_run, run_id, db=db, stalled_after_s=settings.stalled_after_s,
                   recent_steps=settings.recent_steps)  # fmt: skip


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
    return _of_run(read.ranks_of, run_id, db=db, host=host, rank_from=rank_from,
                   rank_to=rank_to, limit=limit)  # fmt: skip


@router.get("/runs/{run_id}/hosts", dependencies=Read, tags=["runs"])
def hosts(run_id: RunId, db: DbDep) -> dict[str, Any]:
    """A run's hosts and the ranks on each."""
    return _of_run(read.hosts_of, run_id, db=db)


@router.delete("/runs/{run_id}", dependencies=Write, tags=["runs"])
def delete_run(run_id: RunId, db: DbDep) -> dict[str, Any]:
    """Delete a run and everything stored for it."""
    if not store.delete_run(db, run_id=run_id):
        raise _not_found(run_id)
    return {"deleted": run_id}


# -- ingest -------------------------------------------------------------------------------


@dataclasses.dataclass
class IngestAnswer:
    """What a batch did: events newly stored, and events already held (replays)."""

    accepted: int
    duplicates: int


#: The events route's body in the OpenAPI description: the route reads it through the
#: events door's decoder, not as a FastAPI body parameter (see `describe_event_batch`).
_EVENT_BATCH_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/EventBatch"}}},
    }
}


@router.post(
    "/runs/{run_id}/events",
    dependencies=Write,
    tags=["ingest"],
    response_model=IngestAnswer,
    responses={404: {"description": "unknown run"}, 413: {"description": "batch too large"}},
    openapi_extra=_EVENT_BATCH_BODY,
)
async def ingest(run_id: RunId, request: Request) -> JSONResponse:
    """Store a batch of events (gzip allowed); idempotent on (run, rank, seq)."""
    # The app's edge answers this request itself (server/ingest_path.py); this route is
    # the same door (ingest_path.store_batch) for an app served without that edge.
    headers = request_headers(request.scope["headers"])
    result = await ingest_path.store_batch(request.app.state, run_id, headers, request.receive)
    return JSONResponse({"accepted": result.accepted, "duplicates": result.duplicates})


def describe_event_batch(openapi: dict[str, Any]) -> None:
    """Add `events.EventBatch` and the schemas it refers to (pydantic's, as FastAPI makes
    them for a body parameter) to an OpenAPI description's components."""
    ref = "#/components/schemas/{model}"
    schema = pydantic.TypeAdapter(ev.EventBatch).json_schema(ref_template=ref)
    schemas = {**schema.pop("$defs", {}), "EventBatch": schema}
    components = openapi.setdefault("components", {}).setdefault("schemas", {})
    for name, value in schemas.items():  # written out as FastAPI writes its own (no nulls)
        components[name] = jsonable_encoder(Schema(**value), by_alias=True, exclude_none=True)


@router.post(
    "/runs/{run_id}/heartbeats",
    dependencies=Write,
    tags=["ingest"],
    responses={404: {"description": "unknown run"}},
)
def heartbeat(run_id: RunId, batch: ev.HeartbeatBatch, request: Request) -> dict[str, Any]:
    """Keep each rank's newest heartbeat (its last step, phase, collectives, stack)."""
    writer: heartbeats.HeartbeatWriter = request.app.state.heartbeats
    with _refused():
        stored = writer.submit(run_id=run_id, batch=batch)
    return {"stored": _found(stored, run_id)}


# -- reads --------------------------------------------------------------------------------


@router.get("/runs/{run_id}/metrics-catalog", dependencies=Read, tags=["series"])
def metrics_catalog(run_id: RunId, db: DbDep) -> dict[str, Any]:
    """The metric names stored for a run, with their units."""
    return _of_run(read.metrics_catalog, run_id, db=db)


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
    with _refused():
        selection = read.Selection.parse(rank=rank, ranks=ranks, host=host, top=top)
    return _of_run(series_read.series, run_id, db=db, metric=metric, selection=selection,
                   max_points=max_points, step_from=step_from, step_to=step_to)  # fmt: skip


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
    return _of_run(series_read.outliers_of, run_id, db=db, metric=metric, k=k,
                   step_from=step_from, step_to=step_to)  # fmt: skip


@router.get("/runs/{run_id}/breakdown", dependencies=Read, tags=["series"])
def breakdown(
    run_id: RunId, db: DbDep, rank: Rank = None, max_points: MaxPoints = 500
) -> dict[str, Any]:
    """Step time per step: exclusive parts (they add up), phases, exposed and hidden comm."""
    return _of_run(read.step_breakdown, run_id, db=db, rank=rank, max_points=max_points)


@router.get("/runs/{run_id}/heatmap", dependencies=Read, tags=["series"])
def heatmap(
    run_id: RunId,
    db: DbDep,
    metric: Annotated[str, Query(min_length=1, max_length=300)] = "step_time_s",
    max_steps: Annotated[int, Query(ge=1, le=5000)] = 200,
    agg: Annotated[str, Query(pattern="^(max|median)$")] = "max",
) -> dict[str, Any]:
    """A metric per rank, or per block of ranks for a wide run, over the newest steps."""
    return _of_run(read.rank_heatmap, run_id, db=db, metric=metric, max_steps=max_steps,
                   agg=agg)  # fmt: skip


@router.get("/runs/{run_id}/findings", dependencies=Read, tags=["doctor"])
def findings(run_id: RunId, db: DbDep, settings: SettingsDep) -> dict[str, Any]:
    """What is wrong with a run and what to change (the doctor), most severe first."""
    return _of_run(doctor.findings, run_id, db=db, recent_steps=settings.recent_steps)


@router.get("/runs/{run_id}/checkpoints", dependencies=Read, tags=["runs"])
def checkpoints(run_id: RunId, db: DbDep) -> dict[str, Any]:
    """The run's checkpoint saves and loads: per call, the slowest rank's seconds, the
    bytes of every rank and the bandwidth."""
    return _of_run(jobs.run_checkpoints, run_id, db=db)


@router.get("/jobs/{job}", dependencies=Read, tags=["runs"])
def job(
    job: Annotated[str, Path(min_length=1, max_length=store.MAX_JOB_CHARS)], db: DbDep
) -> dict[str, Any]:
    """The runs of one job across its restarts, and where its time went: productive steps,
    redone steps, checkpoint saves and loads, hangs, restarts (goodput)."""
    out = jobs.get_job(db=db, job=job)
    if out is None:
        raise HTTPException(404, f"job {job!r} not found")
    return out


@router.get("/compare", dependencies=Read, tags=["series"])
def compare(
    db: DbDep,
    settings: SettingsDep,
    runs: Annotated[
        str, Query(min_length=1, max_length=4000, description="Comma-separated run ids.")
    ],
    metrics: Annotated[
        str | None,
        Query(max_length=4000, description="Comma-separated metrics to add (medians)."),
    ] = None,
    window: Annotated[
        int | None,
        Query(
            ge=1,
            le=100000,
            description="Newest steps each figure is over (default: the "
            "server's recent_steps, the window of every run's recent figures).",
        ),
    ] = None,
) -> dict[str, Any]:
    """Runs side by side: model state, bytes per step per op, step parts, samples/s."""
    run_ids = [r.strip() for r in runs.split(",") if r.strip()]
    metric_names = [x.strip() for x in (metrics or "").split(",") if x.strip()]
    if not run_ids:
        raise _unprocessable(["query", "runs"], "name at least one run")
    with _refused("metrics"):
        return compare_read.compare(db=db, run_ids=run_ids, metrics=metric_names,
                                    window=window or settings.recent_steps)  # fmt: skip


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
    out = _of_run(trace_read.trace, run_id, db=db, step_from=lo, step_to=hi,
                  max_steps=settings.max_trace_steps, max_spans=settings.max_trace_spans)  # fmt: skip
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:60]
    headers = {"Content-Disposition": f'inline; filename="zerowatch-{safe}.trace.json"'}
    cut = out["metadata"]["cut"]
    if cut:  # the spans stopped at max_trace_spans: say so beside the body's metadata
        headers["X-Zerowatch-Trace-Cut"] = f"{cut['spans_left_out']} spans left out"
    return JSONResponse(out, headers=headers)


@router.get(
    "/alerts/rules.yml", dependencies=Read, tags=["alerts"], response_class=PlainTextResponse
)
def alert_rules() -> PlainTextResponse:
    """The Prometheus recording and alerting rules (default settings), as YAML."""
    try:
        from zerowatch.alerts import AlertSettings, render_rules
    except ImportError as e:
        raise HTTPException(
            503, f"alert rules are not available in this installation: {e}"
        ) from None
    return PlainTextResponse(render_rules(AlertSettings()), media_type="application/yaml")


__all__ = ["router"]
