"""Server-side downsampling that keeps spikes: min/max per bucket.

A chart of 100,000 steps drawn at 1,000 pixels shows at most about two values per pixel
column, the lowest and the highest; averaging would flatten exactly the spikes (a grad-norm
jump, a straggling step) that someone opened the chart to find. So the steps are cut into
`max_points // 2` equal buckets and each bucket keeps its minimum and its maximum, in step
order, with their real step numbers (the M4 idea without the first/last points). The first
and last point of the series are always kept so the x-range stays true.
"""

from __future__ import annotations

from collections.abc import Sequence


def minmax_downsample(
    steps: Sequence[int], values: Sequence[float], max_points: int
) -> tuple[list[int], list[float]]:
    """Reduce a series to at most `max_points` points, keeping each bucket's extremes.

    Args:
        steps: x values, ascending.
        values: y values, same length.
        max_points: the most points to return (>= 2).

    Returns:
        (steps, values), a subsequence of the input.
    """
    n = len(steps)
    if n <= max_points:
        return list(steps), list(values)
    max_points = max(max_points, 2)
    n_buckets = max(1, (max_points - 2) // 2)
    keep: list[int] = [0]
    inner = n - 2
    for b in range(n_buckets):
        lo = 1 + b * inner // n_buckets
        hi = 1 + (b + 1) * inner // n_buckets
        if lo >= hi:
            continue
        i_min = i_max = lo
        v_min = v_max = values[lo]
        for i in range(lo + 1, hi):
            v = values[i]
            if v < v_min:
                v_min, i_min = v, i
            elif v > v_max:
                v_max, i_max = v, i
        if i_min == i_max:
            keep.append(i_min)
        else:
            keep.extend(sorted((i_min, i_max)))
    keep.append(n - 1)
    return [steps[i] for i in keep], [values[i] for i in keep]


__all__ = ["minmax_downsample"]
