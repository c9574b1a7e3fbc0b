"""Min/max-per-bucket downsampling keeps spikes, order and the ends of the range."""

from __future__ import annotations

import random

from zerowatch.server.downsample import minmax_downsample


def test_short_series_are_returned_whole() -> None:
    assert minmax_downsample([1, 2, 3], [5.0, 6.0, 7.0], 10) == ([1, 2, 3], [5.0, 6.0, 7.0])


def test_spikes_and_dips_survive_and_points_stay_in_order() -> None:
    rng = random.Random(0)
    xs = list(range(100_000))
    ys = [1.0 + rng.uniform(-0.01, 0.01) for _ in xs]
    ys[31_337], ys[77_001] = 50.0, -3.0
    dx, dy = minmax_downsample(xs, ys, 500)
    assert len(dx) <= 500
    assert dx == sorted(dx) and dx[0] == 0 and dx[-1] == 99_999
    assert 31_337 in dx and 77_001 in dx
    assert max(dy) == 50.0 and min(dy) == -3.0
    assert all(ys[x] == y for x, y in zip(dx, dy, strict=True))
