"""/metrics stays bounded whatever the world size: a 4,096-rank run exposes at most 1,000
series and 200 KB, and its straggler is one of the ranks exposed by name."""

from __future__ import annotations

from pathlib import Path

from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.metrics import exposition
from zerowatch.server.read import rollups

from zerowatch import events as ev
from zerowatch import simulate


def _series_of(text: str, run_id: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln and not ln.startswith("#") and run_id in ln]


def test_a_4096_rank_run_exposes_at_most_1000_series_and_200_kb(tmp_path: Path) -> None:
    db = Database.open(f"sqlite:///{tmp_path / 'z.db'}")
    sizes = {}
    families: dict[int, set[str]] = {}
    try:
        for world, straggler in ((4096, 3001), (2, 1)):
            spec = simulate.SimSpec(world_size=world, stage=3, straggler_rank=straggler,
                                    straggler_factor=1.5, spans_every=0)  # fmt: skip
            rc = simulate.run_create(spec)
            store.create_run(db, run=rc)
            for events in simulate.steps(spec, 2):
                store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
            text = exposition(db, grace_s=300).decode()
            lines = _series_of(text, rc.run_id)
            sizes[world] = (len(lines), sum(len(ln) + 1 for ln in lines))
            busy = [ln for ln in lines if ln.startswith("zerowatch_busy_seconds{")]
            assert any(f'rank="{straggler}"' in ln for ln in busy), busy
            families[world] = {ln.split("{")[0] for ln in lines}
    finally:
        db.close()
    assert families[4096] == families[2]
    n, nbytes = sizes[4096]
    assert n <= 1000 and nbytes <= 200_000, sizes
    assert n <= sizes[2][0] * 2, sizes  # the same families; only the outlier ranks differ


def test_a_run_with_nothing_rolled_up_in_a_backlog_shows_its_statistics_once_one_is(
    tmp_path: Path,
) -> None:
    """A recovery storm's first seconds: no step rolled up, a backlog of dirty steps. The
    scrape keeps the run's own series and leaves the rank statistics (a newest step
    computed from thousands of rank rows) until the compactor rolls a step up."""
    db = Database.open(f"sqlite:///{tmp_path / 'z.db'}")
    try:
        spec = simulate.SimSpec(name="storm", world_size=8, stage=3)
        rc = simulate.run_create(spec)
        store.create_run(db, run=rc)
        events = [simulate.step_event(spec, r, s) for s in range(4) for r in range(8)]
        store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
        quiet = exposition(db, grace_s=60).decode()
        assert (
            f'zerowatch_step_time_seconds{{project="default",rank="",run="{rc.run_id}",stat="p50"}}'
            in quiet
        )
        many = [simulate.step_event(spec, r, s) for s in range(4, 4_200) for r in range(1)]
        store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, many))
        storm = exposition(db, grace_s=60).decode()
        assert "zerowatch_step_time_seconds{" not in storm
        assert f'zerowatch_steps_total{{project="default",run="{rc.run_id}"}}' in storm
        rollups.RollupWorker(db).run_once(settle=False)
        after = exposition(db, grace_s=60).decode()
        assert f'run="{rc.run_id}",stat="p50"' in after
    finally:
        db.close()
