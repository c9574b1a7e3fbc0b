"""/metrics stays bounded whatever the world size: a 4,096-rank run exposes at most 1,000
series and 200 KB, and its straggler is one of the ranks exposed by name."""

from __future__ import annotations

from pathlib import Path

from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.metrics import exposition

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
