"""The FastAPI application: `create_app(settings)` and `serve(...)` for `zerowatch serve`.

The app owns, on `app.state`: the `Settings`, the `Database` (opened and migrated when the
app is created), the `Ingestor` (group commit, ingest.py), the `HeartbeatWriter`
(heartbeats.py), the `RollupWorker` (read/rollups/worker.py), the `ReadGate` (read_gate.py:
the writers wait while reads run) and the `Admission` bound on what agents POST
(admission.py). The read model's caches belong to the `Database` (`db.caches`, tuned by
`Settings.read`: read/rollups/caches.py), which hands them to the ingest writer, the store,
the worker and the readers. The events door (ingest_path.py) sits in front of the
middleware stack (`App.__call__`) and answers agents' event batches; every other request
goes through FastAPI. Nothing a read answers lives only in this process: /metrics, run status and pages
come from the database, so several server processes (`zerowatch serve --workers N`, or
servers on one PostgreSQL database behind a load balancer) answer alike. Routes: the JSON
API (api.py) under /api/v1, `/metrics`, `/healthz`, `/docs`, and the HTML pages
(pages.py); every response carries the security headers of security.py (a
Content-Security-Policy among them).

Errors are JSON `{"detail": ...}`: validation problems are 422 with the location of each bad
field (`loc`) and a one-line `message`; a URL holding a NUL is 400; a database that is
down, restarting or out of disk is a 503 or 507 naming the cause, with Retry-After
(db_errors.py); ingest past the admission bound is a 503 with Retry-After (admission.py);
anything unforeseen is logged and answered 500 without internals (the schemathesis test
holds that none is reachable).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DBAPIError
from starlette.concurrency import run_in_threadpool
from zerowatch.server import api, errors
from zerowatch.server.admission import Admission, AdmissionMiddleware
from zerowatch.server.db import Database
from zerowatch.server.deps import require_read
from zerowatch.server.edge import (
    TrustedHosts,
    deadline_protocol,
    default_allowed_hosts,
    parse_hosts,
)
from zerowatch.server.heartbeats import HeartbeatWriter
from zerowatch.server.ingest import Ingestor
from zerowatch.server.ingest_path import IngestFastPath
from zerowatch.server.metrics import exposition
from zerowatch.server.read.rollups import Retention, RollupWorker
from zerowatch.server.read_gate import ReadGate, ReadGateMiddleware
from zerowatch.server.security import SecurityHeadersMiddleware
from zerowatch.server.settings import Settings, SettingsError, get_settings

import zerowatch

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _install_error_handlers(app: FastAPI) -> None:
    """The answers of validation and database errors (errors.py, shared with the events
    door)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return errors.validation_answer(exc.errors())

    @app.exception_handler(DBAPIError)
    async def _db_failed(request: Request, exc: DBAPIError) -> JSONResponse:
        return errors.database_answer(exc, request.method, request.url.path)


class RejectNulMiddleware:
    """400 for a URL whose path or query holds a NUL (PostgreSQL text cannot store one)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (
            b"%00" in scope.get("query_string", b"")
            or "\x00" in scope.get("path", "")
            or b"%00" in scope.get("raw_path", b"")
        ):
            response = JSONResponse(
                {"detail": "the URL must not contain NUL characters (%00)"}, status_code=400
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


_DOCS_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>zerowatch API</title>
<link rel="stylesheet" href="/_swagger/swagger-ui.css">
<link rel="icon" href="/_swagger/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/_swagger/swagger-ui-bundle.js"></script>
<script src="/static/swagger-init.js"></script>
</body>
</html>
"""


def _install_docs(app: FastAPI) -> None:
    """/docs from the installed Swagger UI bundle (no CDN: the server may have no internet),
    started by a script file, not an inline one (the Content-Security-Policy of
    server/security.py runs scripts from the server only). /openapi.json works either way.
    """
    from fastapi.responses import FileResponse, HTMLResponse

    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        swagger_ui_path = None
    if swagger_ui_path is None:

        @app.get("/docs", include_in_schema=False)
        async def no_docs() -> Response:
            return HTMLResponse(
                "<p>Swagger UI is not installed (pip install swagger-ui-bundle-v2); the API "
                'is described at <a href="/openapi.json">/openapi.json</a>.</p>'
            )

        return
    from fastapi.staticfiles import StaticFiles

    app.mount("/_swagger", StaticFiles(directory=swagger_ui_path), name="swagger-ui")
    init = Path(__file__).parent / "static" / "swagger-init.js"

    @app.get("/static/swagger-init.js", include_in_schema=False)
    async def docs_init() -> Response:
        return FileResponse(init, media_type="text/javascript")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return HTMLResponse(_DOCS_HTML)


def _include_pages(app: FastAPI) -> None:
    """Add the HTML pages (server/pages.py's router)."""
    from zerowatch.server import pages

    app.include_router(pages.router)


#: Allocations between two collections of the youngest generation while the app runs.
GC_GEN0_THRESHOLD = 50_000
#: Seconds an idle connection stays open: longer than the agents' longest flush interval
#: (agent/config.py MAX_FLUSH_INTERVAL_S, 30 s at 7,680 ranks and more), so that each agent
#: POSTs over one connection for the whole run instead of opening one per POST (uvicorn's
#: default, 5 s, is shorter than the interval of any job of 1,280 ranks or more).
KEEP_ALIVE_S = 35


class App(FastAPI):
    """The FastAPI app behind its edge: the Host check (server/edge.py), then the events
    door (server/ingest_path.py) in front of its middleware stack: agents' event batches
    are answered there; every other request goes through FastAPI as usual."""

    ingest_fast_path: IngestFastPath
    #: The outermost ASGI callable: TrustedHosts over the events door (create_app).
    edge: Any

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.edge(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's OpenAPI description, with the events route's body (api.py)."""
        if self.openapi_schema is None:
            api.describe_event_batch(super().openapi())
        return self.openapi_schema  # type: ignore[return-value]


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the zerowatch server app: open (and migrate) the database, wire the routes.

    Args:
        settings: how the server behaves; default `get_settings()` (the environment).

    Returns:
        The FastAPI application (serve it with uvicorn).
    """
    settings = settings or get_settings()
    db = Database.open(settings.db_url, tuning=settings.read)
    gate = ReadGate(max_wait_s=settings.read.gate_max_wait_s)
    rollup_worker = RollupWorker(
        db,
        gate=gate,
        interval_s=settings.rollup_interval_s,
        settle_s=settings.rollup_settle_s,
        incomplete_s=settings.rollup_incomplete_s,
        retention=Retention(
            full_steps=settings.retention_full_steps, every=settings.retention_every
        ),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        rollup_worker.start()
        # What start-up built (modules, the schema, the app) lives as long as the process:
        # keep it out of the collector's full passes, which would otherwise walk all of it
        # now and then in the middle of a request (some 65 ms on a query's p95).
        gc.collect()
        gc.freeze()
        # Ingest builds some hundred short-lived containers per rank-step (parsed JSON, the
        # event dataclasses, row tuples): with the default threshold (700) the collector
        # runs every few rank-steps, and its older generations after them. At 50,000 the
        # event loop spends 52 us of CPU a rank-step at 4,096 ranks instead of 66
        # (in-process); cyclic garbage is still collected, a little later.
        thresholds = gc.get_threshold()
        gc.set_threshold(GC_GEN0_THRESHOLD, *thresholds[1:])
        yield
        gc.set_threshold(*thresholds)
        gc.unfreeze()  # an app that ends (tests start many) leaves nothing pinned behind
        try:
            ingestor.close()
            await run_in_threadpool(beats.close)
            await run_in_threadpool(rollup_worker.close)
        finally:
            db.close()  # whatever failed above: SQLite's -wal goes only when it closes

    app = App(
        docs_url=None,  # served by _install_docs
        redoc_url=None,  # ReDoc loads its script from a CDN, which the CSP refuses
        title="zerowatch",
        version=zerowatch.__version__,
        description="Observability for ZeRO-sharded training: runs, ingest, series, compare, trace.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.db = db
    app.state.rollup_worker = rollup_worker
    app.state.ingestor = ingestor = Ingestor(
        db, trace_sample_every=settings.trace_sample_every, gate=gate
    )
    app.state.heartbeats = beats = HeartbeatWriter(db)
    app.state.read_gate = gate
    app.state.admission = admission = Admission(settings.ingest_max_pending)
    app.ingest_fast_path = IngestFastPath(functools.partial(FastAPI.__call__, app), app.state)
    app.edge = TrustedHosts(app.ingest_fast_path, parse_hosts(settings.allowed_hosts))
    _install_error_handlers(app)
    app.add_middleware(RejectNulMiddleware)
    app.add_middleware(AdmissionMiddleware, admission=admission, token=settings.token)
    app.add_middleware(SecurityHeadersMiddleware)
    app.add_middleware(ReadGateMiddleware, gate=gate)  # outermost: the whole read counts
    app.include_router(api.router)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, Any]:
        """Liveness: the process answers and its database too.

        `pid` lets a launcher (`zerowatch demo`) tell its own server from another one that
        holds the port."""
        # With reads closed (read_requires_token), it says no more than up or down: no pid,
        # version or driver error (which names the database's host and port).
        private = settings.read_requires_token
        try:
            with db.read() as conn:
                conn.exec_driver_sql("SELECT 1")
        except Exception as e:
            why = "unavailable" if private else str(e)[:200]
            return JSONResponse({"status": "error", "database": why}, status_code=503)  # type: ignore[return-value]
        if private:
            return {"status": "ok"}
        return {
            "status": "ok",
            "database": db.dialect,
            "version": zerowatch.__version__,
            "pid": os.getpid(),
        }

    # /metrics names runs and projects: a read, closed with the others by read_requires_token
    # (Prometheus then sends the token: `authorization: {credentials: <token>}`).
    @app.get(
        "/metrics",
        tags=["metrics"],
        response_class=Response,
        dependencies=[Depends(require_read)],
    )
    def metrics() -> Response:
        """Prometheus text exposition of the live runs."""
        body = exposition(
            db,
            grace_s=settings.finished_grace_s,
            forget_after_s=settings.forget_silent_after_s,
            top_k=settings.metrics_top_k,
            max_runs=settings.metrics_max_runs,
        )
        return Response(body, media_type=PROMETHEUS_CONTENT_TYPE)

    _install_docs(app)
    _include_pages(app)
    return app


def app_from_env() -> FastAPI:
    """The app with settings from the environment (uvicorn's factory for --workers)."""
    return create_app(Settings.from_env())


def serve(
    host: str = "127.0.0.1",
    port: int = 8321,
    db_url: str | None = None,
    token: str | None = None,
    workers: int = 1,
    allowed_hosts: str | None = None,
) -> None:
    """Run the server with uvicorn (blocks). None for db_url/token: from the environment.

    `allowed_hosts` (comma-separated, "*" for any): the Host names it answers to; default
    `$ZEROWATCH_ALLOWED_HOSTS`, else localhost, `host` and this machine's names and
    addresses (server/edge.py). Each connection gets the head and body deadlines of the
    settings (`head_timeout_s`, `body_timeout_s`).

    `workers` > 1 starts that many processes on one port (uvicorn's workers); they share
    nothing but the database, which must then be PostgreSQL (SQLite allows one writer
    process: it stays the single-process default).

    Raises:
        SettingsError: several workers on SQLite.
    """
    import uvicorn

    if allowed_hosts is None and not os.environ.get("ZEROWATCH_ALLOWED_HOSTS"):
        allowed_hosts = default_allowed_hosts(host)
    extra = {"allowed_hosts": allowed_hosts} if allowed_hosts is not None else {}
    settings = Settings.from_env(db_url=db_url, token=token, **extra)
    protocol = deadline_protocol(settings.head_timeout_s, settings.body_timeout_s) or "auto"
    _raise_open_files_limit()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if workers > 1:
        if settings.db_url.startswith("sqlite"):
            raise SettingsError(
                "--workers: several server processes need PostgreSQL (ZEROWATCH_DB_URL="
                "postgresql+psycopg://...); SQLite serves one process"
            )
        # The workers build their apps from the environment: hand them these settings.
        os.environ["ZEROWATCH_DB_URL"] = settings.db_url
        if settings.token:
            os.environ["ZEROWATCH_TOKEN"] = settings.token
        os.environ["ZEROWATCH_ALLOWED_HOSTS"] = settings.allowed_hosts
        Database.open(settings.db_url).close()  # migrate once, before the workers race
        uvicorn.run(
            "zerowatch.server.app:app_from_env",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_level="info",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            http=protocol,
        )
        return
    app = create_app(settings)
    uvicorn.run(
        app, host=host, port=port, log_level="info", access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S, http=protocol,
    )  # fmt: skip


def _raise_open_files_limit() -> None:
    """Every agent keeps a connection open (KEEP_ALIVE_S): a process may hold one per rank
    of a job, beyond the usual soft limit of 1,024 open files. Raise the soft limit to the
    hard one (capped at 1,048,576), as far as the system allows."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = 1_048_576 if hard == resource.RLIM_INFINITY else min(hard, 1_048_576)
    if soft != resource.RLIM_INFINITY and soft < cap:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (cap, hard))


__all__ = ["app_from_env", "create_app", "serve"]
