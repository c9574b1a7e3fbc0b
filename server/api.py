"""The JSON API under /api/v1: thin routes over store.py (writes) and queries.py (reads)."""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from zerowatch.server import queries, store
from zerowatch.server.body import BodyRoute
from zerowatch.server.deps import (
    DbDep,
    LiveDep,
    SettingsDep,
    require_read,
    require_write,
)

from zerowatch import events as ev

router = APIRouter(prefix="/api/v1", route_class=BodyRoute)

Read = [Depends(require_read)]
Write = [Depends(require_write)]

RunId = Annotated[str, Path(min_length=1, max_length=store.MAX_RUN_ID_CHARS)]
INT32 = 2**31 - 1
INT63 = 2**63 - 1
Rank = Annotated[int | None, Query(ge=0, le=INT32, description="One rank; omitted: every rank.")]


def _not_found(run_id: str) -> HTTPException:
    return HTTPException(404, f"run {run_id!r} not found")


def _unknown_metric(e: queries.UnknownMetric) -> HTTPException:
    return HTTPException(422, [{"type": "value_error", "loc": ["query", "metric"], "msg": str(e)}])


def _unprocessable(e: store.BatchError) -> HTTPException:
    return HTTPException(422, [{"type": "value_error", "loc": list(e.loc), "msg": e.msg}])


# -- runs ---------------------------------------------------------------------------------


@router.post("/runs", dependencies=Write, status_code=201, tags=["runs"])
def create_run(
    run: ev.RunCreate, response: Response, db: DbDep, live: LiveDep, settings: SettingsDep
) -> dict[str, Any]:
    """Create a run (idempotent on run_id: 201 when new, 200 when it exists)."""
    try:
        _, created = store.create_run(db, run=run)
    except store.BatchError as e:
        raise _unprocessable(e) from None
    if not created:
        response.status_code = 200
    out = queries.get_run(
        db=db,
        run_id=run.run_id,
        stalled_after_s=settings.stalled_after_s,
        recent_steps=settings.recent_steps,
    )
    assert out is not None
    if out["stored_status"] == "running":
        live.register(out)
    return out


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
    runs = queries.list_runs(
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
    """One run: its config, status, per-rank progress and recent performance."""
    out = queries.get_run(
        db=db,
        run_id=run_id,
        stalled_after_s=settings.stalled_after_s,
        recent_steps=settings.recent_steps,
    )
    if out is None:
        raise _not_found(run_id)
    return out


@router.delete("/runs/{run_id}", dependencies=Write, tags=["runs"])
def delete_run(run_id: RunId, db: DbDep, live: LiveDep) -> dict[str, Any]:
    """Delete a run and everything stored for it."""
    if not store.delete_run(db, run_id=run_id):
        raise _not_found(run_id)
    live.drop(run_id)
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
    state = request.app.state
    ingestor, live, db = state.ingestor, state.live, state.db
    try:
        result = await ingestor.submit_async(run_id=run_id, batch=batch)
    except store.BatchError as e:
        raise _unprocessable(e) from None
    if result is None:
        raise _not_found(run_id)
    if result.accepted:
        if not live.known(run_id):
            run = await run_in_threadpool(
                lambda: queries.get_run(
                    db=db, run_id=run_id, stalled_after_s=state.settings.stalled_after_s
                )
            )
            if run is not None:
                live.register(run)
        ended_at = time.time() if result.status in ("finished", "failed") else None
        live.apply(
            run_id,
            result.new_steps,
            status=result.status,
            last_event_at=result.last_event_at,
            ended_at=ended_at,
        )
    return JSONResponse({"accepted": result.accepted, "duplicates": result.duplicates})


# -- reads --------------------------------------------------------------------------------


@router.get("/runs/{run_id}/metrics-catalog", dependencies=Read, tags=["series"])
def metrics_catalog(run_id: RunId, db: DbDep) -> dict[str, Any]:
    """The series names stored for a run, with their units."""
    out = queries.metrics_catalog(db=db, run_id=run_id)
    if out is None:
        raise _not_found(run_id)
    return out


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
    max_points: Annotated[int, Query(ge=2, le=20000)] = 500,
    step_from: Annotated[int | None, Query(ge=0, le=INT63)] = None,
    step_to: Annotated[int | None, Query(ge=0, le=INT63)] = None,
) -> dict[str, Any]:
    """One quantity over steps, per rank, downsampled keeping spikes (min/max per bucket)."""
    try:
        out = queries.series(
            db=db,
            run_id=run_id,
            metric=metric,
            rank=rank,
            max_points=max_points,
            step_from=step_from,
            step_to=step_to,
        )
    except queries.UnknownMetric as e:
        raise _unknown_metric(e) from None
    if out is None:
        raise _not_found(run_id)
    return out


@router.get("/runs/{run_id}/breakdown", dependencies=Read, tags=["series"])
def breakdown(
    run_id: RunId,
    db: DbDep,
    rank: Rank = None,
    max_points: Annotated[int, Query(ge=2, le=20000)] = 500,
) -> dict[str, Any]:
    """Step time per step split into phases (median over ranks, or one rank)."""
    out = queries.step_breakdown(db=db, run_id=run_id, rank=rank, max_points=max_points)
    if out is None:
        raise _not_found(run_id)
    return out


@router.get("/runs/{run_id}/heatmap", dependencies=Read, tags=["series"])
def heatmap(
    run_id: RunId,
    db: DbDep,
    metric: Annotated[str, Query(min_length=1, max_length=300)] = "step_time_s",
    max_steps: Annotated[int, Query(ge=1, le=5000)] = 200,
) -> dict[str, Any]:
    """A metric per rank over the newest steps (the straggler view)."""
    try:
        out = queries.rank_heatmap(db=db, run_id=run_id, metric=metric, max_steps=max_steps)
    except queries.UnknownMetric as e:
        raise _unknown_metric(e) from None
    if out is None:
        raise _not_found(run_id)
    return out


@router.get("/compare", dependencies=Read, tags=["series"])
def compare(
    db: DbDep,
    runs: Annotated[
        str, Query(min_length=1, max_length=4000, description="Comma-separated run ids.")
    ],
    metrics: Annotated[
        str | None,
        Query(max_length=4000, description="Comma-separated series metrics to add (medians)."),
    ] = None,
    window: Annotated[int, Query(ge=1, le=100000)] = 100,
) -> dict[str, Any]:
    """Runs side by side: model-state bytes, bytes per step per op, phase medians, samples/s."""
    run_ids = [r.strip() for r in runs.split(",") if r.strip()]
    metric_names = [x.strip() for x in (metrics or "").split(",") if x.strip()]
    if not run_ids:
        raise HTTPException(
            422, [{"type": "value_error", "loc": ["query", "runs"], "msg": "name at least one run"}]
        )
    try:
        return queries.compare(db=db, run_ids=run_ids, metrics=metric_names, window=window)
    except queries.UnknownMetric as e:
        raise HTTPException(
            422, [{"type": "value_error", "loc": ["query", "metrics"], "msg": str(e)}]
        ) from None


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
    out = queries.trace(
        db=db, run_id=run_id, step_from=lo, step_to=hi, max_steps=settings.max_trace_steps
    )
    if out is None:
        raise _not_found(run_id)
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
