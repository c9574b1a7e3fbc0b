"""Checks beyond the JSON schema, made before anything of a request is written: a new run's
fields (its id's alphabet, its world size, text and list sizes) and an event batch (the run
id in the body matches the URL, ranks lie inside the world size, a histogram has one count
per bucket, sizes the server bounds). Each raises `BatchError` naming the field, as FastAPI's
validation errors do.
"""

from __future__ import annotations

import re

from zerowatch.server.read.metric_table import N_BUCKETS

from zerowatch import events as ev


class BatchError(ValueError):
    """A request body that validated against the schema but is still wrong.

    `loc` is the path of the offending field, as in FastAPI's validation errors.
    """

    def __init__(self, loc: tuple[str | int, ...], msg: str) -> None:
        super().__init__(f"{'.'.join(map(str, loc))}: {msg}")
        self.loc = loc
        self.msg = msg


def check_schema_version(version: int) -> None:
    """Raise BatchError unless `version` is the one this server speaks."""
    if version != ev.SCHEMA_VERSION:
        raise BatchError(
            ("body", "schema_version"),
            f"unsupported schema_version {version}; this server speaks {ev.SCHEMA_VERSION}",
        )


MAX_RUN_ID_CHARS = 200
MAX_WORLD_SIZE = 1_000_000
MAX_JOB_CHARS = 200
#: Spans one step event may carry: the agent's own cap (agent/config.py max_spans_per_step
#: default 4,096) with room for an agent set higher; the trace export reads what is stored.
MAX_SPANS_PER_STEP = 16_384
#: Checkpoint calls one event may carry (an agent sends the few since its last event).
MAX_CHECKPOINTS_PER_EVENT = 64
#: A new run's text fields: at most this many characters (what a page, /metrics and a
#: list answer carry per run stays small, whatever a client sends).
RUN_TEXT_LIMITS = {"name": 200, "project": 100, "job": MAX_JOB_CHARS, "engine": 64,
                   "torch_version": 64, "zerowatch_version": 64}  # fmt: skip
#: A new run's lists: (entries, characters an entry).
RUN_LIST_LIMITS = {"tags": (64, 100), "hosts": (4096, 255)}


#: A run id's alphabet: it is a path segment of every URL of the run (no "/", "%", "?",
#: "#", space), a Prometheus label and a file name in the agents' spools.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def validate_run_id(run_id: str, loc: tuple[str | int, ...] = ("path", "run_id")) -> None:
    """Raise BatchError unless `run_id` is 1-200 characters of `RUN_ID_PATTERN`."""
    if not run_id or len(run_id) > MAX_RUN_ID_CHARS:
        raise BatchError(loc, f"must be 1 to {MAX_RUN_ID_CHARS} characters")
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise BatchError(loc, "must be letters, digits, '.', '_' and '-', starting with a "
                              f"letter or digit; got {run_id[:60]!r}")  # fmt: skip


def validate_run_create(run: ev.RunCreate) -> None:
    """Checks beyond the schema for a new run; raise BatchError naming the field."""
    check_schema_version(run.schema_version)
    validate_run_id(run.run_id, ("body", "run_id"))
    if not 1 <= run.world_size <= MAX_WORLD_SIZE:
        raise BatchError(
            ("body", "world_size"), f"must be 1 to {MAX_WORLD_SIZE}, got {run.world_size}"
        )
    if run.zero_stage not in (0, 1, 2, 3):
        raise BatchError(("body", "zero_stage"), f"must be 0, 1, 2 or 3, got {run.zero_stage}")
    if run.param_count < 0:
        raise BatchError(("body", "param_count"), f"must be >= 0, got {run.param_count}")
    for name, limit in RUN_TEXT_LIMITS.items():
        value = getattr(run, name)
        if len(value) > limit:
            raise BatchError(("body", name), f"at most {limit} characters, got {len(value)}")
    for name, (count, chars) in RUN_LIST_LIMITS.items():
        values = getattr(run, name)
        if len(values) > count:
            raise BatchError(("body", name), f"at most {count} entries, got {len(values)}")
        for i, value in enumerate(values):
            if len(value) > chars:
                raise BatchError(("body", name, i), f"at most {chars} characters, got {len(value)}")


def validate_batch(batch: ev.EventBatch, *, run_id: str, world_size: int) -> None:
    """Checks beyond the schema; raise BatchError naming the field."""
    check_schema_version(batch.schema_version)
    if batch.run_id != run_id:
        raise BatchError(
            ("body", "run_id"), f"batch is for run {batch.run_id!r} but was posted to {run_id!r}"
        )
    for i, e in enumerate(batch.events):
        loc: tuple[str | int, ...] = ("body", "events", i)
        if not 0 <= e.rank < world_size:
            raise BatchError(
                (*loc, "rank"), f"rank {e.rank} outside the run's world_size {world_size}"
            )
        if e.seq < 0:
            raise BatchError((*loc, "seq"), f"must be >= 0, got {e.seq}")
        if len(e.checkpoints) > MAX_CHECKPOINTS_PER_EVENT:
            raise BatchError((*loc, "checkpoints"), f"at most {MAX_CHECKPOINTS_PER_EVENT}, "
                                                    f"got {len(e.checkpoints)}")  # fmt: skip
        if isinstance(e, ev.EndEvent):
            if e.time != e.time or abs(e.time) == float("inf"):
                raise BatchError((*loc, "time"), "must be a finite number")
            continue
        if e.step < 0:
            raise BatchError((*loc, "step"), f"must be >= 0, got {e.step}")
        if e.spans is not None and len(e.spans) > MAX_SPANS_PER_STEP:
            raise BatchError((*loc, "spans"), f"at most {MAX_SPANS_PER_STEP} spans a step "
                                              f"(the agent's max_spans_per_step), got {len(e.spans)}")  # fmt: skip
        for j, c in enumerate(e.collectives):
            if len(c.buckets) != N_BUCKETS:
                raise BatchError(
                    (*loc, "collectives", j, "buckets"),
                    f"expected {N_BUCKETS} counts (one per LATENCY_BUCKETS bucket, +Inf last), "
                    f"got {len(c.buckets)}",
                )
            if c.count < 0 or c.bytes < 0 or min(c.buckets) < 0:
                raise BatchError((*loc, "collectives", j), "count, bytes and buckets must be >= 0")


__all__ = [
    "MAX_CHECKPOINTS_PER_EVENT",
    "MAX_JOB_CHARS",
    "MAX_RUN_ID_CHARS",
    "MAX_SPANS_PER_STEP",
    "MAX_WORLD_SIZE",
    "RUN_ID_PATTERN",
    "RUN_LIST_LIMITS",
    "RUN_TEXT_LIMITS",
    "BatchError",
    "check_schema_version",
    "validate_batch",
    "validate_run_create",
    "validate_run_id",
]
