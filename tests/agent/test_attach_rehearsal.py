"""What `instrument()` adds to the run's engine_info from the adapter's rehearsal (the
bundled engine's: zerowatch/rehearse) before the run is created: merged beside the counted
calls; nothing from an adapter without one; a failure is the agent's error, not the
training's."""

from __future__ import annotations

from typing import Any

from zerowatch.agent.adapters import JobInfo
from zerowatch.agent.attach import _with_rehearsal
from zerowatch.agent.errors import AgentHealth

TABLE = {"reduce_bucket_size": 600, "bucket_sizes": [600], "calls": {"1": {"all_gather": [2]}}}
LINK = {"op": "reduce_scatter", "message_bytes": 8 << 20, "latency_s": 0.01, "busbw": 4e8}


def _job(**engine_info: Any) -> JobInfo:
    return JobInfo(engine="zerowatch", rank=0, world_size=2, device="cpu", zero_stage=1,
                   precision="fp32", engine_info={"class": "ZeroEngine", **engine_info})  # fmt: skip


class _Rehearsing:
    def __init__(self, got: Any) -> None:
        self.got = got

    def rehearse(self) -> dict[str, Any]:
        if isinstance(self.got, Exception):
            raise self.got
        return dict(self.got)


def test_the_rehearsal_is_merged_beside_the_counted_calls() -> None:
    health = AgentHealth()
    got = _with_rehearsal(_Rehearsing({"management_s": {"1": 0.001}, "link": LINK}),  # type: ignore[arg-type]
                          _job(collective_calls=TABLE), health)  # fmt: skip
    calls = got.engine_info["collective_calls"]
    assert calls == {**TABLE, "management_s": {"1": 0.001}, "link": LINK}
    assert got.engine_info["class"] == "ZeroEngine" and health.errors == 0


def test_nothing_is_added_without_a_rehearsal_or_a_table() -> None:
    health = AgentHealth()
    job = _job(collective_calls=TABLE)
    assert _with_rehearsal(object(), job, health) is job  # type: ignore[arg-type]
    assert _with_rehearsal(_Rehearsing({}), job, health) is job  # type: ignore[arg-type]
    bare = _job()
    assert _with_rehearsal(_Rehearsing({"link": LINK}), bare, health) is bare  # type: ignore[arg-type]
    assert health.errors == 0


def test_a_failing_rehearsal_is_the_agents_error_and_the_run_goes_on() -> None:
    health = AgentHealth()
    job = _job(collective_calls=TABLE)
    got = _with_rehearsal(_Rehearsing(RuntimeError("gloo: connection reset")), job, health)  # type: ignore[arg-type]
    assert got is job
    assert health.errors == 1
