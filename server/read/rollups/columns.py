"""Metric columns: one step's metrics over its ranks (`StepColumns`, what a rollup is
computed from), and the columns of a group of stored rank-steps (`Block`, what the
fresh-steps cache holds and server processes share).

Both come from `vocabulary.rank_table`, the one definition of a rank-step's metrics; the
rows' path (rows.py) and the cache's (`Found.columns`) give a step the same columns, to
the last bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
from zerowatch.server.read.metric_table import N_BUCKETS
from zerowatch.server.read.vocabulary import rank_table


@dataclass(slots=True)
class StepColumns:
    """One step's metrics over some of its ranks: `table[name][i]` is rank `ranks[i]`'s
    value (NaN: none); per collective op the latency histogram summed over those ranks and
    every row's latency sum (added up exactly once the step is whole)."""

    ranks: np.ndarray  # int64, ascending
    table: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]  # op -> N_BUCKETS int64
    latency_sums: dict[str, list[float]]

    def merged(self, other: StepColumns) -> StepColumns:
        """These ranks and `other`'s (disjoint) together, ranks ascending."""
        ranks = np.concatenate([self.ranks, other.ranks])
        order = np.argsort(ranks, kind="stable")
        n_self, n = len(self.ranks), len(ranks)
        table = {}
        for name in {**self.table, **other.table}:
            col = np.full(n, np.nan)
            if name in self.table:
                col[:n_self] = self.table[name]
            if name in other.table:
                col[n_self:] = other.table[name]
            table[name] = col[order]
        counts = {op: c.copy() for op, c in self.counts.items()}
        for op, c in other.counts.items():
            counts[op] = counts[op] + c if op in counts else c.copy()
        sums = {op: list(v) for op, v in self.latency_sums.items()}
        for op, v in other.latency_sums.items():
            sums.setdefault(op, []).extend(v)
        return StepColumns(ranks[order], table, counts, sums)


@dataclass(slots=True)
class Block:
    """The metrics of the rank-steps of one written group.

    `values[j, i]` is metric `names[j]` of rank-step i (NaN: none); `hists[op][i]` the
    latency histogram of rank-step i's rows of that op (zeros where it has none), and
    `latency_sums[op]` the `latency_sum_s` of every row of that op with the rank-step it
    belongs to (what a rollup's histogram and its sum add up over ranks). Arrays, not lists:
    the cache holds a hundred thousand rank-steps, and the garbage collector walks every
    list it holds."""

    names: list[str]
    values: np.ndarray  # (metrics, rank-steps) float64
    hists: dict[str, np.ndarray]  # op -> (rank-steps, N_BUCKETS) int64
    latency_sums: dict[str, tuple[np.ndarray, np.ndarray]]  # op -> (values, rank-step index)


def block_of(
    rows: Sequence[Sequence[Any]],
    colls: Sequence[Sequence[Sequence[Any]]],
    *,
    row_columns: Sequence[str],
    coll_columns: Sequence[str],
) -> Block:
    """The Block of rank-steps given as the ingest writer stored them: `rows[i]` a steps
    row, `colls[i]` its collectives rows, tuples in the order of `row_columns` and
    `coll_columns` (JSON columns as Python values)."""
    row_index = {c: i for i, c in enumerate(row_columns)}
    coll_index = {c: i for i, c in enumerate(coll_columns)}
    table = rank_table(rows, colls, row_index=row_index, coll_index=coll_index)
    names = list(table)
    values = np.array([table[n] for n in names]) if names else np.empty((0, len(rows)))
    hists: dict[str, np.ndarray] = {}
    sums: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    flat = [c for cs in colls for c in cs]
    if flat:
        at = np.array([i for i, cs in enumerate(colls) for _ in cs], dtype=np.int64)
        by_position = list(zip(*flat, strict=True))
        ops = by_position[coll_index["op"]]
        op_of = np.array(ops, dtype=object)
        lats = np.array(by_position[coll_index["latency_sum_s"]], dtype=np.float64)
        # Checked at ingest: one count per bucket (store.validate_batch).
        buckets = np.fromiter(
            chain.from_iterable(by_position[coll_index["buckets"]]),
            dtype=np.int64,
            count=len(flat) * N_BUCKETS,
        ).reshape(len(flat), N_BUCKETS)
        for op in dict.fromkeys(ops):
            sel = np.flatnonzero(op_of == op)
            h = hists[op] = np.zeros((len(rows), N_BUCKETS), dtype=np.int64)
            np.add.at(h, at[sel], buckets[sel])
            sums[op] = (lats[sel], at[sel])
    return Block(names, values, hists, sums)


@dataclass(slots=True)
class Found:
    """The rank-steps of one step a cache holds, among those asked for: `ranks`
    (ascending) and, per block, `(block, at, pos)`: rank-step `at[i]` of the block is rank
    `ranks[pos[i]]`'s."""

    ranks: np.ndarray
    parts: list[tuple[Block, np.ndarray, np.ndarray]]

    def columns(self) -> StepColumns:
        """The StepColumns of these rank-steps: what the rows of those ranks give
        (rows.columns_from_rows)."""
        n = len(self.ranks)
        row_of: dict[str, int] = {}  # metric -> its row in `values`, first seen first
        for block, _, _ in self.parts:
            for name in block.names:
                row_of.setdefault(name, len(row_of))
        values = np.full((len(row_of), n), np.nan)
        hists: dict[str, np.ndarray] = {}
        sums: dict[str, list[float]] = {}
        for block, at, pos in self.parts:
            # One assignment a block (a step's ranks come in a hundred blocks or more).
            rows = np.array([row_of[name] for name in block.names], dtype=np.intp)
            values[np.ix_(rows, pos)] = block.values[:, at]
            held = None
            for op, h in block.hists.items():
                total = hists.get(op)
                if total is None:
                    total = hists[op] = np.zeros(N_BUCKETS, dtype=np.int64)
                    sums[op] = []
                total += h[at].sum(axis=0)
                if held is None:
                    held = np.zeros(len(h), dtype=bool)
                    held[at] = True
                lats, owners = block.latency_sums[op]
                sums[op].extend(lats[held[owners]].tolist())
        cols = {name: values[i] for name, i in row_of.items() if not np.isnan(values[i]).all()}
        return StepColumns(self.ranks.copy(), cols, hists, sums)


__all__ = ["Block", "Found", "StepColumns", "block_of"]
