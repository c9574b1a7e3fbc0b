"""Helpers of the server tests: request bodies as the agent sends them, and a simulated run
created through the API."""

from __future__ import annotations

import dataclasses
import gzip
import json
from typing import Any

from zerowatch import events as ev
from zerowatch import simulate


def asdict(obj: Any) -> Any:
    return dataclasses.asdict(obj)


def batch_body(run_id: str, events: list[Any], **extra: Any) -> dict[str, Any]:
    return {"schema_version": ev.SCHEMA_VERSION, "run_id": run_id,
            "events": [asdict(e) for e in events], **extra}  # fmt: skip


def gz(body: Any) -> bytes:
    return gzip.compress(json.dumps(body).encode())


def post_events(
    client: Any, run_id: str, events: list[Any], headers: dict[str, str] | None = None
) -> Any:
    """POST a gzip batch, as the agent does."""
    return client.post(
        f"/api/v1/runs/{run_id}/events",
        content=gz(batch_body(run_id, events)),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json", **(headers or {})},
    )


def create_sim_run(
    client: Any, spec: simulate.SimSpec, headers: dict[str, str] | None = None
) -> str:
    rc = simulate.run_create(spec)
    r = client.post("/api/v1/runs", json=asdict(rc), headers=headers or {})
    assert r.status_code == 201, r.text
    return rc.run_id
