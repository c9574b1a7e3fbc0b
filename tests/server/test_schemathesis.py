"""No request can make the server answer 500: schemathesis generates valid and invalid
requests for every operation of the server's own OpenAPI schema (bounded examples), on
SQLite and on PostgreSQL.

Half of the generated path run ids are swapped for a run that exists and holds steps (with
a wide world, so generated ranks often fit), so that ingest, series, compare and trace are
exercised past their 404."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, configuration, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from zerowatch.server.app import create_app
from zerowatch.server.settings import Settings

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=2, stage=3, spans_every=2)
RUN = dataclasses.replace(simulate.run_create(SPEC, run_id="known-run"), world_size=100_000)
METRICS = ["step_time_s", "phase.forward", "collective.all_gather.busbw", "memory.peak.forward",
           "offload.d2h.bandwidth", "scalars.x", "grad_norm"]  # fmt: skip
EXAMPLES = 15


@pytest.fixture(autouse=True)
def _storage_outside_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """schemathesis keeps its cache and crash reports under `.schemathesis/` of the working
    directory, hypothesis its examples and constants under `.hypothesis/`: both go to the
    test's temporary folder, so that the tests leave the working tree as they found it."""
    monkeypatch.chdir(tmp_path)
    configuration.set_hypothesis_home_dir(tmp_path / ".hypothesis")
    yield
    configuration.set_hypothesis_home_dir(None)


def _seed(client: TestClient) -> None:
    client.post("/api/v1/runs", json=dataclasses.asdict(RUN))
    for evs in simulate.steps(SPEC, 6):
        client.post(f"/api/v1/runs/{RUN.run_id}/events",
                    json={"schema_version": ev.SCHEMA_VERSION, "run_id": RUN.run_id,
                          "events": [dataclasses.asdict(e) for e in evs]})  # fmt: skip


def _steer(case: schemathesis.Case, n: int) -> None:
    """Point some cases at the stored run (and a valid metric) to get past 404/422."""
    if case.method.upper() == "DELETE":
        return  # keep the known run for the other operations
    if case.path_parameters and "run_id" in case.path_parameters and n % 2 == 0:
        case.path_parameters["run_id"] = RUN.run_id
        if isinstance(case.body, dict):
            case.body["run_id"] = RUN.run_id
    if isinstance(case.query, dict) and "metric" in case.query and n % 3 == 0:
        case.query["metric"] = METRICS[n % len(METRICS)]
    if isinstance(case.query, dict) and "runs" in case.query and n % 3 == 0:
        case.query["runs"] = f"{RUN.run_id},{case.query['runs']}"


def test_no_request_gets_a_server_error(db_url: str) -> None:
    app = create_app(Settings(db_url=db_url, max_batch_bytes=256 * 1024))
    with TestClient(app) as client:
        _seed(client)
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        operations = [r.ok() for r in schema.get_all_operations()]
        assert len(operations) >= 12
        counter = itertools.count()
        codes: Counter[int] = Counter()
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(max_examples=EXAMPLES, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))  # fmt: skip
                def run(case: schemathesis.Case) -> None:
                    _steer(case, next(counter))
                    response = case.call_and_validate(checks=[not_a_server_error])
                    codes[response.status_code] += 1

                try:
                    run()
                except Unsatisfiable:
                    # No invalid request exists for an operation without inputs.
                    assert mode is GenerationMode.NEGATIVE, operation.label
        assert codes[200] > 50 and sum(codes.values()) > 300, codes
