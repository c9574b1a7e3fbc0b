"""Statistics of one metric of one step over its ranks: `Stats`, and how they are computed.

Quantiles are linear interpolations between order statistics (numpy's default); ties for
the min or max name the lowest rank; the mean is math.fsum's. For the metrics that name
outliers (metric_table.OUTLIER_METRICS) the `top_k` ranks at either end are kept too.
The statistics (`STATS`) are the metric table's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class Stats:
    """One metric of one step over the step's ranks."""

    n: int
    min: float
    p10: float
    p50: float
    p90: float
    max: float
    mean: float
    min_rank: int
    max_rank: int
    #: {"hi": [[rank, value], ...] highest first, "lo": [...] lowest first} for outlier
    #: metrics; {"hist": [...], "sum": s} (latency histogram over ranks) for latency_s.
    extra: dict[str, Any] = field(default_factory=dict)

    def get(self, stat: str) -> float:
        return float(getattr(self, stat))


def quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics of an ascending, non-empty sequence."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stats_of(values: np.ndarray, ranks: np.ndarray, *, ends: bool, k: int) -> Stats | None:
    """The Stats of one step's column of a metric: `values[i]` is rank `ranks[i]`'s (NaN
    where the rank has none), ranks ascending. None when no rank has a value.

    One sort by (value, rank) gives the order statistics (`quantile`'s linear
    interpolation) and the ranks at the ends, the lowest rank among equal values; the mean
    is math.fsum's. With `ends`, the k highest and k lowest (rank, value) pairs go in
    `extra`."""
    have = ~np.isnan(values)
    if not have.all():
        values, ranks = values[have], ranks[have]
    n = len(values)
    if n == 0:
        return None
    order = np.lexsort((ranks, values))
    vals, rks = values[order], ranks[order]
    ordered = vals.tolist()
    top = ordered[-1]
    st = Stats(
        n=n,
        min=ordered[0],
        p10=quantile(ordered, 0.1),
        p50=quantile(ordered, 0.5),
        p90=quantile(ordered, 0.9),
        max=top,
        mean=math.fsum(ordered) / n,
        min_rank=int(rks[0]),
        max_rank=int(rks[int(np.searchsorted(vals, top, side="left"))]),
    )
    if ends and n > 1:
        tail_v, tail_r = vals[-k:], rks[-k:]
        hi = np.lexsort((tail_r, -tail_v))
        st.extra = {
            "hi": [[r, v] for r, v in zip(tail_r[hi].tolist(), tail_v[hi].tolist(), strict=True)],
            "lo": [[r, v] for r, v in zip(rks[:k].tolist(), ordered[:k], strict=True)],
        }
    return st


__all__ = ["Stats", "quantile", "stats_of"]
