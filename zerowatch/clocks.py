"""Each rank's clock against rank 0's, from round trips over the job's own process group.

A round: rank 0 reads t0 and broadcasts; rank r reads t1 when it has the broadcast, t2 just
before an all-gather; rank 0 reads t3 when the all-gather is back. Causality gives
t2 - t3 <= offset <= t1 - t0 (rank r can receive nothing before rank 0 sent it, rank 0
nothing before rank r sent it), so the midpoint ((t1 - t0) + (t2 - t3)) / 2 is within half
the round trip (t3 - t0) - (t2 - t1) of the truth. Of a few rounds, the one with the
shortest round trip is kept (NTP's rule). The first round also lines the ranks up (whoever
came late to the broadcast shows a long round trip, which the rule drops).

Used by `zerowatch selftest` (the clocks section) and by the agent, which subtracts its
rank's offset from every time it sends, so the steps and spans of several nodes line up on
rank 0's clock. The collectives are callables (a Comm's, an engine adapter's
`broadcast_object` / `all_gather_object`), so this module needs nothing but the standard
library.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Broadcast = Callable[..., Any]
AllGather = Callable[[Any], list[Any]]


def clock_estimate(t0: float, t1: float, t2: float, t3: float) -> tuple[float, float]:
    """(offset, round trip) of one round: rank r's clock minus rank 0's, within half the
    round trip (t0, t3 read on rank 0; t1, t2 on rank r)."""
    return ((t1 - t0) + (t2 - t3)) / 2, (t3 - t0) - (t2 - t1)


def measure(
    broadcast_object: Broadcast,
    all_gather_object: AllGather,
    *,
    rank: int,
    rounds: int,
    now: Callable[[], float] | None = None,
    barrier: Callable[[], Any] | None = None,
) -> list[tuple[float, float]] | None:
    """Every rank calls it together. Returns, on rank 0, (offset, round trip) per rank from
    its round with the shortest round trip (rank 0's is (0, 0)); None on the other ranks.

    Args:
        broadcast_object: `fn(obj, src=0) -> obj` over the job's group.
        all_gather_object: `fn(obj) -> [obj of each rank]` over the same group.
        rank: this rank in that group.
        rounds: round trips (at least 1).
        now: the clock compared; default `time.time`, looked up at the call (the clock the
            agent stamps its events with).
        barrier: called before each round when given (lines the ranks up).
    """
    now = now or time.time
    marks: list[tuple[float, list[Any], float]] = []
    for _ in range(max(int(rounds), 1)):
        if barrier is not None:
            barrier()
        t0 = now()
        broadcast_object(None, src=0)
        t1 = now()
        t2 = now()
        gathered = all_gather_object((t1, t2))
        t3 = now()
        marks.append((t0, gathered, t3))
    if rank != 0:
        return None
    table = [(0.0, 0.0)]
    for r in range(1, len(marks[0][1])):
        estimates = [clock_estimate(t0, got[r][0], got[r][1], t3) for t0, got, t3 in marks]
        table.append(min(estimates, key=lambda e: e[1]))
    return table


def offset_to_rank0(
    broadcast_object: Broadcast,
    all_gather_object: AllGather,
    *,
    rank: int,
    rounds: int,
    now: Callable[[], float] | None = None,
) -> tuple[float, float]:
    """This rank's (offset, round trip) to rank 0: `measure`, then rank 0's table broadcast
    (one more collective). Every rank calls it together."""
    table = measure(broadcast_object, all_gather_object, rank=rank, rounds=rounds, now=now)
    table = broadcast_object(table, src=0)
    offset, rtt = table[rank]
    return float(offset), float(rtt)


__all__ = ["clock_estimate", "measure", "offset_to_rank0"]
