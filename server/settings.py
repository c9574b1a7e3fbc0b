"""Server settings: one frozen dataclass, read from the environment once.

Every knob has a default that works on a laptop (a SQLite file in the working directory, no
token, open reads). `Settings.from_env()` reads `ZEROWATCH_*` variables; `get_settings()`
caches that so the app, `/metrics` and the pages agree on one object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any

from zerowatch.server.read.rollups.tuning import ReadTuning

DEFAULT_DB_URL = "sqlite:///./zerowatch.db"


class SettingsError(ValueError):
    """A setting has a value the server cannot use; the message names the setting."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How one zerowatch server behaves."""

    #: SQLAlchemy URL: `sqlite:///path.db` (WAL mode) or `postgresql+psycopg://user@host/db`.
    db_url: str = DEFAULT_DB_URL
    #: Bearer token required for ingest and delete; None = no token needed.
    token: str | None = None
    #: Whether reads (runs, series, compare, trace, pages) need the token too.
    read_requires_token: bool = False
    #: A running run with no event for this long reports status "stalled".
    stalled_after_s: float = 120.0
    #: Finished and failed runs stay in /metrics this long after their last event, so that
    #: Prometheus sees the final values; then they drop out and cardinality stays bounded.
    finished_grace_s: float = 300.0
    #: A run that sent nothing for this long leaves /metrics even though it never ended
    #: (a job killed without its end event); it comes back with its next event.
    forget_silent_after_s: float = 86400.0
    #: Request bodies (after gzip decompression too) above this many bytes get 413.
    max_batch_bytes: int = 16 * 2**20
    #: Keep the raw spans of every n-th step among those the agent sampled (1 = all of them).
    trace_sample_every: int = 1
    #: Steps (per rank) that the "recent" step time and samples/s of a run are taken over.
    recent_steps: int = 20
    #: Most steps one trace export may cover.
    max_trace_steps: int = 200
    #: Most spans in one trace export (the sampled steps' phase, collective and offload
    #: slices); beyond them the export is cut and says so (X-Zerowatch-Trace-Cut).
    max_trace_spans: int = 250_000
    #: How often the roll-up worker rolls dirty steps up, and how long a step's first rank
    #: waits for the others before its first rollup (reads are exact either way).
    rollup_interval_s: float = 0.5
    rollup_settle_s: float = 0.5
    #: A step that not every rank has reached is rolled up once nobody wrote to it for
    #: this long (a rank died or its agent is offline); one that all have, after the
    #: settle time. Up to then reads compute it from its rows.
    rollup_incomplete_s: float = 30.0
    #: Retention of per-rank rows: every step of the newest `retention_full_steps` steps,
    #: every `retention_every`-th before them (0 keeps every step). Rollups stay whole.
    retention_full_steps: int = 10_000
    retention_every: int = 10
    #: Outlier ranks per run that /metrics exposes with a `rank` label.
    metrics_top_k: int = 8
    #: Live runs one /metrics scrape exposes at most, the most recently active first (the
    #: rest are counted in zerowatch_metrics_runs_left_out).
    metrics_max_runs: int = 256
    #: Ingest requests the server holds at once (admitted and not yet answered: reading,
    #: parsing, waiting for the writer). One more gets 503 with Retry-After before its body
    #: is read (server/admission.py), so agents replaying their spools all at once cannot
    #: grow the writer's queue, or memory, without bound.
    ingest_max_pending: int = 128
    #: Host names the server answers to (comma-separated; "*": any). `zerowatch serve`
    #: defaults to localhost, the address it binds and this machine's names and addresses
    #: (server/edge.py); an app built directly answers any host unless told.
    allowed_hosts: str = "*"
    #: DELETE of a run without a configured token (a server without `token` otherwise
    #: refuses deletes: any page a browser opens could send one).
    allow_delete_without_token: bool = False
    #: Seconds a connection has to send a request's head, and then its body, before it is
    #: closed (`zerowatch serve`; server/edge.py).
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    #: The read path's tuning: sizes, ages, batches and lock ids of the rollups and their
    #: caches (server/read/rollups/tuning.py; not read from the environment).
    read: ReadTuning = field(default_factory=ReadTuning)

    def __post_init__(self) -> None:
        if not self.db_url:
            raise SettingsError("db_url: must not be empty")
        for name in ("stalled_after_s", "finished_grace_s", "forget_silent_after_s",
                     "head_timeout_s", "body_timeout_s"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("rollup_interval_s", "rollup_settle_s", "rollup_incomplete_s"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("retention_full_steps", "metrics_top_k"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("max_batch_bytes", "trace_sample_every", "recent_steps", "max_trace_steps",
                     "retention_every", "ingest_max_pending", "metrics_max_runs",
                     "max_trace_spans"):  # fmt: skip
            if getattr(self, name) < 1:
                raise SettingsError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.token == "":
            object.__setattr__(self, "token", None)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from `ZEROWATCH_<NAME>` variables (e.g. ZEROWATCH_DB_URL), then overrides.

        Raises:
            SettingsError: a variable does not parse as its setting's type.
        """
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "read":
                continue
            raw = env.get(f"ZEROWATCH_{f.name.upper()}")
            if raw is None:
                continue
            values[f.name] = _parse(f.name, raw, cls.__dataclass_fields__[f.name].default)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(name: str, raw: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise SettingsError(
            f"ZEROWATCH_{name.upper()}: expected {type(default).__name__}, got {raw!r}"
        ) from None
    return raw


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment on first use."""
    return Settings.from_env()


__all__ = ["DEFAULT_DB_URL", "Settings", "SettingsError", "get_settings"]
