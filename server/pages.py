"""The HTML pages: runs, one run (live), compare, the capacity planner; and the files they
load (plotly.js's cartesian bundle, the page script and style, the icon).

Routes are thin: read plain data (server.read, server.page_queries, zerowatch.plan), build
figures (zerowatch.dashboards), render a template (dashboards.html, autoescaped). Pages take
the same read token rule as the JSON API. A live run's page polls
`/runs/{run_id}/figures.json?since=<last step>`, which answers with fresh figures only when
new steps arrived, and the page hands them to Plotly.react (an update, not a redraw).

Routes are plain `def`: queries, figures and templates are CPU and database work, which
FastAPI runs in its thread pool, so ingest and /metrics are not held up while a page is built.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Query
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from zerowatch.dashboards import compare as compare_figs
from zerowatch.dashboards import html
from zerowatch.dashboards import job as job_figs
from zerowatch.dashboards import plan as plan_figs
from zerowatch.dashboards import rank as rank_figs
from zerowatch.dashboards import run as run_figs
from zerowatch.dashboards import theme as th
from zerowatch.dashboards.data import RunView, Series, Straggler
from zerowatch.server import page_queries, rank_pages, read
from zerowatch.server.deps import DbDep, SettingsDep, require_read
from zerowatch.server.read import doctor, doctor_figures, jobs

from zerowatch import plan as planner

STATIC = Path(__file__).parent / "static"
#: plotly.js's cartesian bundle (npm plotly.js-cartesian-dist-min, the version the plotly
#: package embeds: a test holds them equal): every chart the pages draw is a scatter, bar
#: or heatmap, and a new tab parses 1.5 MB of it instead of the full 4.8 MB bundle.
PLOTLY_JS = STATIC / "plotly-cartesian.min.js"
STATUSES = ("running", "stalled", "finished", "failed")
#: Most runs one compare page shows.
MAX_COMPARE = 12
#: Browsers keep plotly.js for a year without asking again (pages ask for it with plotly's
#: version in the URL, so a new version is a new URL).
CACHE = {"Cache-Control": "public, max-age=31536000, immutable"}

router = APIRouter(include_in_schema=False, dependencies=[Depends(require_read)])

# plotly loads its validators on first use (~0.2 s): pay that when the server starts, not on
# the first page someone opens.
run_figs.step_breakdown(Series([0], [1.0]), {"forward": Series([0], [0.5])})


# -- helpers ----------------------------------------------------------------------------------


def _ago(ts: float | None, now: float | None = None) -> str:
    if not ts:
        return "never"
    secs = max((now or time.time()) - ts, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if secs >= size:
            return f"{secs / size:.0f} {unit} ago"
    return f"{secs:.0f} s ago"


def _offload(run: dict[str, Any]) -> str:
    parts = [
        name
        for name, key in (("optimizer", "offload_optimizer"), ("params", "offload_param"))
        if run.get(key) not in (None, "", "none")
    ]
    return " + ".join(parts) + " → cpu" if parts else "none"


def _page(template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(html.render(template, **context), status_code=status_code)


def _not_found(title: str, message: str) -> HTMLResponse:
    return _page("error.html", 404, title=title, message=message, nav="")


def _run_ids(raw: list[str]) -> list[str]:
    """`?runs=a,b&runs=c` -> [a, b, c]: commas and repeats both work; order kept, no repeats."""
    ids = (rid.strip() for part in raw for rid in part.split(","))
    return list(dict.fromkeys(rid for rid in ids if rid))  # linear, not quadratic, in the ids


# -- static files -------------------------------------------------------------------------------


@router.get("/static/plotly.min.js")
def plotly_js() -> FileResponse:
    """plotly.js, served here: pages need no CDN."""
    return FileResponse(PLOTLY_JS, media_type="text/javascript", headers=CACHE)


@router.get("/static/zerowatch.js")
def page_js() -> FileResponse:
    return FileResponse(STATIC / "zerowatch.js", media_type="text/javascript")


@router.get("/static/zerowatch.css")
def page_css() -> FileResponse:
    return FileResponse(STATIC / "zerowatch.css", media_type="text/css")


@router.get("/favicon.ico")
def favicon() -> FileResponse:
    return FileResponse(STATIC / "favicon.ico", media_type="image/x-icon", headers=CACHE)


# -- runs ---------------------------------------------------------------------------------------


def _run_row(run: dict[str, Any], now: float) -> dict[str, Any]:
    return {
        **run,
        "offload": _offload(run),
        "last_seen": run.get("last_event_at") or run.get("created_at"),
        "last_seen_ago": _ago(run.get("last_event_at") or run.get("created_at"), now),
    }


#: Runs on one page of the runs list (the rest on the next pages).
RUNS_PER_PAGE = 100


@router.get("/", response_class=HTMLResponse)
def runs_page(
    db: DbDep,
    settings: SettingsDep,
    project: Annotated[str | None, Query(max_length=200)] = None,
    status: Annotated[str | None, Query(max_length=20)] = None,
    tag: Annotated[str | None, Query(max_length=200)] = None,
    page: Annotated[int, Query(ge=1, le=100_000)] = 1,
) -> HTMLResponse:
    """The runs, RUNS_PER_PAGE a page: a table with filters and "compare selected"."""
    project, status, tag = project or None, status or None, tag or None
    now = time.time()
    runs = read.list_runs(db=db, project=project, status=status if status in STATUSES else None,
                          tag=tag, stalled_after_s=settings.stalled_after_s,
                          recent_steps=settings.recent_steps, now=now, ranks=False,
                          limit=RUNS_PER_PAGE + 1, offset=(page - 1) * RUNS_PER_PAGE)  # fmt: skip
    more = len(runs) > RUNS_PER_PAGE
    runs = runs[:RUNS_PER_PAGE]
    if status and status not in STATUSES:
        runs = []
    projects = sorted(set(page_queries.projects(db=db)) | ({project} if project else set()))
    return _page(
        "runs.html",
        recent=th.recent_label(settings.recent_steps),
        nav="runs",
        runs=[_run_row(r, now) for r in runs],
        projects=projects,
        statuses=STATUSES,
        filters={"project": project, "status": status, "tag": tag},
        page=page,
        pages={
            "prev": _page_link(project, status, tag, page - 1) if page > 1 else None,
            "next": _page_link(project, status, tag, page + 1) if more else None,
        },
    )


def _page_link(project: str | None, status: str | None, tag: str | None, page: int) -> str:
    """The runs page's URL of `page`, with the same filters."""
    query = {k: v for k, v in (("project", project), ("status", status), ("tag", tag)) if v}
    return "/?" + urlencode({**query, "page": page})


# -- one run --------------------------------------------------------------------------------------


def _summary(view: RunView, named: dict[str, Any] | None = None) -> dict[str, str]:
    """The tiles' texts; `named`: the doctor's figures (read/doctor_figures.py), whose
    straggler the tile shows (without them, the tile is left as is)."""
    run = view.run
    # Over the same steps as the step-time tile (the run's recent figures), the median rank.
    exposed = doctor_figures.exposed_share(run.get("recent") or {}, 0)
    out = {
        "steps": str(view.last_step + 1 if view.last_step >= 0 else 0),
        "step-time": th.fmt_seconds(run.get("step_time_s")),
        "samples": th.fmt_rate(run.get("samples_per_s"), ""),
        "tokens": th.fmt_rate(run.get("tokens_per_s"), ""),
        "mfu": f"{run['mfu']:.1%}" if run.get("mfu") is not None else "–",
        "exposed": exposed.text,
        "peak": th.fmt_bytes(view.peak_bytes),
        "last-seen": _ago(run.get("last_event_at") or run.get("created_at")),
    }
    if named is not None:
        out["straggler"] = named["straggler"]["text"] if "straggler" in named else "none"
    return out


def _doctors_straggler(view: RunView, named: dict[str, Any]) -> None:
    """The rank heatmap names the doctor's straggler (the tile's figure), not its own."""
    lag = named.get("straggler") or {}
    view.straggler = (Straggler(rank=int(lag["rank"]), mean=float(lag["value"]), median=1.0)
                      if lag.get("rank") is not None else None)  # fmt: skip


def _refine(view: RunView, run_id: str, figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Traces the page refines after drawing, where sampling steps could miss a spike.

    The charts draw sampled steps (fast for any run size); when the run holds more steps than
    were sampled, the page then fetches the gradient norm, downsampled keeping every bucket's
    minimum and maximum (the series API), and swaps it into its trace: a one-step grad-norm
    spike in a million-step run stays visible. The norm is global, so rank 0's is the run's.
    """
    steps = view.steps
    if "training" not in figures or not steps or len(steps) >= steps[-1] - steps[0] + 1:
        return []
    url = (
        f"/api/v1/runs/{quote(run_id, safe='')}/series"
        f"?metric=grad_norm&ranks=0&max_points={page_queries.MAX_POINTS}"
    )
    return [{"chart": "training", "trace": 0, "url": url}]


def _fmt_metric(metric: str, value: float | None) -> str:
    if metric.startswith("memory."):
        return th.fmt_bytes(value)
    if metric.endswith(".busbw"):
        return th.fmt_rate(value, "B/s")
    return th.fmt_seconds(value)


def _outlier_rows(view: RunView, run_id: str) -> list[dict[str, Any]]:
    """The run page's table of ranks that stand out, each linking to its rank view and to
    its node's view."""
    rid = quote(run_id, safe="")
    return [
        {
            "rank": o["rank"],
            "rank_url": f"/runs/{rid}/ranks/{o['rank']}",
            "host": o["host"],
            "host_url": f"/runs/{rid}/hosts/{quote(o['host'], safe='')}" if o["host"] else None,
            "what": o["what"],
            "value": _fmt_metric(o["metric"], o["value"]),
            "median": _fmt_metric(o["metric"], o["median"]),
            "ratio": f"{o['ratio']:.2f}×",
        }
        for o in view.outliers
    ]


def _findings(db: Any, run_id: str, view: RunView, recent_steps: int) -> Any:
    """The doctor's findings for the run page, reused while the run is unchanged (the
    database's memo: read/findings_memo.py)."""
    key = (run_id, view.last_step, view.run.get("last_event_at"), recent_steps)
    return db.caches.findings.get(
        key, lambda: doctor.findings(db=db, run_id=run_id, recent_steps=recent_steps)
    )


def _view(db: Any, settings: Any, run_id: str) -> RunView | None:
    return page_queries.run_view(db=db, run_id=run_id, stalled_after_s=settings.stalled_after_s,
                                 recent_steps=settings.recent_steps)  # fmt: skip


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(run_id: str, db: DbDep, settings: SettingsDep) -> HTMLResponse:
    """One run: step breakdown, collectives, memory, offload, training signals, ranks."""
    view = _view(db, settings, run_id)
    if view is None:
        return _not_found("Run not found", f"No run with id {run_id!r} is stored here.")
    run = view.run
    found = _findings(db, run_id, view, settings.recent_steps)
    named = (found or {}).get("figures") or {}
    _doctors_straggler(view, named)
    figures = run_figs.figures(view)
    summary = _summary(view, named)
    return _page(
        "run.html",
        recent=th.recent_label(settings.recent_steps),
        findings=[
            {**f, "anchor": f"chart-{f['chart']}" if f["chart"] in figures else None}
            for f in (found or {}).get("findings", [])
        ],
        nav="runs",
        run=run,
        offload=_offload(run),
        last_step=view.last_step,
        live_url=f"/runs/{run_id}/figures.json",
        summary={
            "step_time_s": run.get("step_time_s"),
            "samples_per_s": run.get("samples_per_s"),
            "tokens_per_s": run.get("tokens_per_s"),
            "mfu": summary["mfu"],
            "exposed_share": summary["exposed"],
            "peak_bytes": view.peak_bytes,
            "straggler": summary["straggler"],
            "last_seen_ago": summary["last-seen"],
        },
        named={k: v["stat"] for k, v in named.items()},
        charts=[{"id": k, "wide": w} for k, w in run_figs.CHARTS if k in figures],
        outliers=_outlier_rows(view, run_id),
        notes=run_figs.missing_notes(view, figures),
        figures=html.figures_payload(figures),
        refine=_refine(view, run_id, figures),
        config_json=json.dumps(run.get("config") or {}, indent=2, sort_keys=True, default=str),
    )


@router.get("/runs/{run_id}/figures.json")
def run_figures(
    run_id: str,
    db: DbDep,
    settings: SettingsDep,
    since: Annotated[int, Query(ge=-1, le=2**62)] = -1,
) -> JSONResponse:
    """A run's figures for a live page: new figures only when steps after `since` arrived.

    Whether any did is read first, cheaply (the run row and the rollups' newest step): an
    open page of a quiet run asks every few seconds, and building the figures of a wide run
    costs a read of its newest rank rows (the heatmap)."""
    run = read.get_run(db=db, run_id=run_id, stalled_after_s=settings.stalled_after_s,
                       recent_steps=1, ranks=False)  # fmt: skip
    if run is None:
        return JSONResponse({"detail": f"run {run_id!r} not found"}, status_code=404)
    last_step = int(run["steps"]) - 1
    status = run["status"]
    body: dict[str, Any] = {
        "run_id": run_id,
        "status": status,
        "status_color": th.STATUS_COLORS.get(status, "#636e72"),
        "last_step": last_step,
        "changed": False,
        "summary": {"last-seen": _ago(run.get("last_event_at") or run.get("created_at"))},
        "figures": {},
        "refine": [],
    }
    view = _view(db, settings, run_id) if last_step > since else None
    if view is not None:
        # The doctor's figures, once per version of the run (its memo), for the straggler.
        named = (_findings(db, run_id, view, settings.recent_steps) or {}).get("figures") or {}
        _doctors_straggler(view, named)
        figures = run_figs.figures(view)
        body.update(status=view.run["status"], last_step=view.last_step,
                    changed=view.last_step > since, summary=_summary(view, named),
                    figures=html.figures_payload(figures),
                    refine=_refine(view, run_id, figures))  # fmt: skip
        body["status_color"] = th.STATUS_COLORS.get(body["status"], "#636e72")
    return JSONResponse(json.loads(html.script_json(body)))


# -- compare ----------------------------------------------------------------------------------------


def _summaries(db: Any, settings: Any, ids: list[str]) -> tuple[list[Any], list[str]]:
    found, missing = [], []
    for rid in ids:
        got = page_queries.run_summary(db=db, run_id=rid, window=settings.recent_steps,
                                       stalled_after_s=settings.stalled_after_s)  # fmt: skip
        if got is None:
            missing.append(rid)
        else:
            found.append(got)
    return found, missing


@router.get("/compare", response_class=HTMLResponse)
def compare_page(
    db: DbDep,
    settings: SettingsDep,
    runs: Annotated[list[str] | None, Query(max_length=4000)] = None,
) -> HTMLResponse:
    """Runs side by side: model-state bytes, bytes communicated, phases, throughput."""
    ids = _run_ids(runs or [])[:MAX_COMPARE]
    found, missing = _summaries(db, settings, ids)
    summaries = [s for _, s in found]
    figures = compare_figs.figures(summaries) if summaries else {}
    rows = [
        {
            **run,
            "offload": _offload(run),
            "model_state_bytes": sum(s.model_state.values()) or None,
            "model_state_theory_bytes": sum(s.model_state_theory.values()) or None,
            "comm_bytes": sum(s.comm_bytes.values()) or None,
            "step_time_s": s.step_time_s,
            "samples_per_s": s.samples_per_s,
        }
        for run, s in found
    ]
    return _page(
        "compare.html",
        recent=th.recent_label(settings.recent_steps),
        nav="compare",
        runs=rows,
        missing=missing,
        charts=[{"id": k, "wide": w} for k, w in compare_figs.CHARTS if k in figures],
        figures=html.figures_payload(figures),
    )


# -- capacity planner ---------------------------------------------------------------------------------

PLAN_DEFAULTS = {"params": "7B", "gpus": "8", "nodes": "1", "gpu_memory": "80GiB",
                 "precision": "bf16", "offload": "both", "bandwidth": ""}  # fmt: skip
_Short = Annotated[str | None, Query(max_length=64)]


def _stage_plan(row: planner.PlanRow) -> plan_figs.StagePlan:
    return plan_figs.StagePlan(
        stage=row.stage, offload=row.offload,
        device={k: float(v) for k, v in row.model_states.items()},
        buffers={k: float(v) for k, v in row.buffers.items()},
        host_bytes=float(row.host_bytes_per_rank), comm_bytes=float(sum(row.comm_sizes.values())),
        traffic_bytes=float(row.comm_bytes), comm_time_s=row.comm_time_s, fits=row.fits,
    )  # fmt: skip


@router.get("/plan", response_class=HTMLResponse)
def plan_page(
    params: _Short = None,
    gpus: _Short = None,
    nodes: _Short = None,
    gpu_memory: _Short = None,
    precision: _Short = None,
    offload: _Short = None,
    bandwidth: _Short = None,
) -> HTMLResponse:
    """The capacity planner: per-rank memory and communication of every stage."""
    given = {"params": params, "gpus": gpus, "nodes": nodes, "gpu_memory": gpu_memory,
             "precision": precision, "offload": offload, "bandwidth": bandwidth}  # fmt: skip
    form = {k: (v if v is not None else PLAN_DEFAULTS[k]).strip() for k, v in given.items()}
    context: dict[str, Any] = {"nav": "plan", "form": form, "rows": [], "charts": [],
                               "figures": {}, "error": None, "has_time": False,
                               "headroom_pct": 0}  # fmt: skip
    try:
        for key in ("gpus", "nodes"):
            if not form[key].isdigit():
                raise planner.PlanError(f"{key}: expected a whole number, got {form[key]!r}")
        memory = planner.parse_bytes(form["gpu_memory"], "gpu_memory")
        rate = (
            planner.parse_bandwidth(form["bandwidth"], "bandwidth") if form["bandwidth"] else None
        )
        result = planner.plan(
            planner.parse_count(form["params"], "params"), gpus=int(form["gpus"]),
            gpu_memory=memory, nodes=int(form["nodes"]), precision=form["precision"],
            offload=form["offload"], bandwidth=rate,
        )  # fmt: skip
    except (planner.PlanError, ValueError, OverflowError) as e:
        context["error"] = str(e)
        return _page("plan.html", 422, **context)
    rows = [_stage_plan(r) for r in result.rows]
    figures = plan_figs.figures(rows, memory, rate)
    context.update(
        rows=[
            {
                "label": r.label,
                "device_bytes": r.device_total,
                "host_bytes": r.host_bytes or None,
                "comm_bytes": r.traffic_bytes,
                "comm_seconds": r.comm_time_s,
                "fits": r.fits,
            }
            for r in rows
        ],
        has_time=rate is not None,
        charts=[{"id": k, "wide": w} for k, w in plan_figs.CHARTS],
        figures=html.figures_payload(figures),
        recommended=_stage_plan(result.recommended).label if result.recommended else None,
        min_gpus=result.min_gpus,
    )
    return _page("plan.html", **context)


# -- one rank, one node -------------------------------------------------------------------------


def _ratio(value: float | None) -> str:
    return f"{value:.2f}× median" if value is not None else "–"


@router.get("/jobs/{job}", response_class=HTMLResponse)
def job_page(job: str, db: DbDep) -> HTMLResponse:
    """One job across its restarts: its runs, goodput and where its time went."""
    view = jobs.get_job(db=db, job=job)
    if view is None:
        return _not_found("Job not found", f"No run of a job named {job!r} is stored here.")
    wall = view["wall_s"]
    parts = [
        {"key": key, "label": label, "seconds": view["parts"][key],
         "share": f"{100 * view['parts'][key] / wall:.1f}%" if wall > 0 else "–"}
        for key, (label, _) in job_figs.PARTS.items()
    ]  # fmt: skip
    lost = sum(view["parts"][k] for k in ("redone", "checkpoint_load", "hang", "restart"))
    goodput = view["goodput"]
    return _page(
        "job.html",
        nav="runs",
        job=view,
        parts=parts,
        lost=lost,
        goodput=f"{100 * goodput:.1f}%" if goodput is not None else "–",
        figures=html.figures_payload({"job": job_figs.job_figure(view)}),
    )


@router.get("/runs/{run_id}/ranks/{rank}", response_class=HTMLResponse)
def rank_page(run_id: str, rank: int, db: DbDep, settings: SettingsDep) -> HTMLResponse:
    """One rank: step and busy time, parts, collectives, memory, training vs the median rank."""
    view = rank_pages.rank_view(db=db, run_id=run_id, rank=rank,
                                stalled_after_s=settings.stalled_after_s,
                                recent_steps=settings.recent_steps)  # fmt: skip
    if view is None:
        return _not_found("Rank not found", f"No run with id {run_id!r} and a rank {rank} "
                                            "is stored here.")  # fmt: skip
    figures = rank_figs.rank_figures(view)
    busy = [v for v in view.busy.values if v is not None]
    return _page(
        "rank.html",
        nav="runs",
        run=view.run,
        rank=view.rank,
        host=view.host,
        local_rank=view.local_rank,
        steps=len(view.steps),
        mean_busy_s=sum(busy) / len(busy) if busy else None,
        ratio=_ratio(view.busy_ratio),
        memory_step=view.memory_step,
        gpu=rank_figs.gpu_text(view.gpu),
        charts=[{"id": k, "wide": w} for k, w in rank_figs.RANK_CHARTS if k in figures],
        figures=html.figures_payload(figures),
    )


@router.get("/runs/{run_id}/hosts/{host:path}", response_class=HTMLResponse)
def host_page(run_id: str, host: str, db: DbDep, settings: SettingsDep) -> HTMLResponse:
    """One node: busy time of each of its ranks vs the median rank, and a table of them."""
    view = rank_pages.host_view(db=db, run_id=run_id, host=host,
                                stalled_after_s=settings.stalled_after_s,
                                recent_steps=settings.recent_steps)  # fmt: skip
    if view is None:
        return _not_found("Node not found", f"No run with id {run_id!r} and a host {host!r} "
                                            "is stored here.")  # fmt: skip
    figures = rank_figs.host_figures(view)
    medians = [v for v in view.busy_median.values if v is not None]
    top = view.ranks[0] if view.ranks else None
    return _page(
        "host.html",
        nav="runs",
        run=view.run,
        host=view.host,
        steps=len(view.steps),
        median_busy_s=sum(medians) / len(medians) if medians else None,
        slowest=f"rank {top.rank} ({_ratio(top.ratio)})" if top and top.ratio else "–",
        ranks=[
            {
                "rank": r.rank,
                "local_rank": r.local_rank,
                "mean_busy_s": r.mean_busy_s,
                "ratio": _ratio(r.ratio),
                "gpu": rank_figs.gpu_text(r.gpu),
            }
            for r in view.ranks
        ],
        charts=[{"id": k, "wide": w} for k, w in rank_figs.HOST_CHARTS if k in figures],
        figures=html.figures_payload(figures),
    )


__all__ = ["router"]
