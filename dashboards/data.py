"""The plain data the figure builders take: a series over steps, points over message size, a
rank-by-step grid. Pages fill these from the server's queries; tests build them by hand.

Standard library only, so that the figure builders stay pure functions of plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Series:
    """One quantity over steps (already downsampled): `values[i]` at `steps[i]`; None is a gap."""

    steps: Sequence[int] = ()
    values: Sequence[float | None] = ()

    def __post_init__(self) -> None:
        if len(self.steps) != len(self.values):
            raise ValueError(
                f"Series: steps and values differ in length ({len(self.steps)} != {len(self.values)})"
            )

    def __bool__(self) -> bool:
        return any(v is not None for v in self.values)

    @property
    def last(self) -> float | None:
        for v in reversed(self.values):
            if v is not None:
                return v
        return None


@dataclass(frozen=True)
class SizePoints:
    """Collective calls of one op as (bytes per call, bus bandwidth) points: the nccl-tests view."""

    sizes: Sequence[float] = ()
    busbw: Sequence[float] = ()
    steps: Sequence[int] = ()

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.busbw):
            raise ValueError("SizePoints: sizes and busbw differ in length")


@dataclass(frozen=True)
class RankGrid:
    """A quantity per rank (rows) over step buckets (columns): `z[i][j]` is rank `ranks[i]`
    at step `steps[j]` (the first step of the bucket)."""

    ranks: Sequence[int] = ()
    steps: Sequence[int] = ()
    z: Sequence[Sequence[float | None]] = ()
    #: Ranks per row: a wide run's rows are blocks of `block` ranks (ranks[i] the first),
    #: each cell the block's maximum.
    block: int = 1
    #: Where a click on row i goes (the view of the row's rank with the most of the
    #: quantity over the steps shown: on a block, the rank that makes it stand out), or empty.
    links: Sequence[str] = ()

    def __post_init__(self) -> None:
        if len(self.z) != len(self.ranks):
            raise ValueError(f"RankGrid: {len(self.z)} rows for {len(self.ranks)} ranks")
        for i, row in enumerate(self.z):
            if len(row) != len(self.steps):
                raise ValueError(
                    f"RankGrid: row of rank {self.ranks[i]} has {len(row)} cells for {len(self.steps)} steps"
                )


@dataclass(frozen=True)
class Straggler:
    """The rank that stands out: its mean where it stood out, and the run's median
    (read.series.outliers computes both; the page only shows them)."""

    rank: int
    mean: float
    median: float

    @property
    def excess(self) -> float:
        """How much slower than the median rank, as a fraction (0.28 = 28 % slower)."""
        return self.mean / self.median - 1.0 if self.median > 0 else 0.0


@dataclass(frozen=True)
class Quantiles:
    """One quantity over a run's ranks at one step: the rollups' order statistics."""

    min: float
    p10: float
    p50: float
    p90: float
    max: float


@dataclass(frozen=True)
class RankDistribution:
    """One quantity over a run's `n` ranks at one step, sorted ascending: the value at
    `positions[i]` (the place in that order, 0 to n - 1) is `values[i]`, held by rank
    `ranks[i]`, or None where the point is a quantile (p10, median, p90) and not one rank.

    From the rollups, not the ranks' rows: a run of up to 32 ranks has every rank here (the
    rollups keep the 16 ranks at each end); a wider one its 16 lowest and 16 highest ranks
    with the p10, median and p90 between them, so its cost does not grow with the ranks.
    """

    n: int
    step: int
    positions: Sequence[float] = ()
    values: Sequence[float] = ()
    ranks: Sequence[int | None] = ()

    def __post_init__(self) -> None:
        if not len(self.positions) == len(self.values) == len(self.ranks):
            raise ValueError("RankDistribution: positions, values and ranks differ in length")

    @property
    def every_rank(self) -> bool:
        """Whether every rank is a point (nothing between the points is interpolated)."""
        return len(self.values) == self.n and all(r is not None for r in self.ranks)


@dataclass(frozen=True)
class RunSummary:
    """One run as the figures of the compare page need it (read.compare's figures)."""

    run_id: str
    name: str
    zero_stage: int = 0
    world_size: int = 1
    #: Measured model-state bytes per rank by kind (device + host), as the agent reported.
    model_state: dict[str, float] = field(default_factory=dict)
    #: The ZeRO theory's model-state bytes per rank by kind.
    model_state_theory: dict[str, float] = field(default_factory=dict)
    #: Mean collective bytes (nccl-tests size) per step per rank, by op.
    comm_bytes: dict[str, float] = field(default_factory=dict)
    #: The theory's collective bytes per step, by op.
    comm_bytes_theory: dict[str, float] = field(default_factory=dict)
    #: Seconds per phase per step (median over ranks and steps; phases nest).
    phases: dict[str, float] = field(default_factory=dict)
    #: Seconds per exclusive part of the step (events.STEP_PARTS; they add up to the step).
    parts: dict[str, float] = field(default_factory=dict)
    #: Communication compute hid (beside the parts, not in their sum).
    hidden_comm_s: float | None = None
    step_time_s: float | None = None
    #: The mean step time over ranks and steps: what the stacked parts add up to.
    step_time_mean_s: float | None = None
    samples_per_s: float | None = None

    @property
    def label(self) -> str:
        return f"{self.name} (stage {self.zero_stage})"


@dataclass
class RunView:
    """Everything the run page draws, for one run, at the sampled steps."""

    run: dict[str, Any]
    steps: list[int] = field(default_factory=list)
    #: Sampled steps inside the drawn range with no rollup (yet): gaps in the lines.
    missing_steps: list[int] = field(default_factory=list)
    step_time: Series = field(default_factory=Series)
    phases: dict[str, Series] = field(default_factory=dict)
    #: The exclusive parts (events.STEP_PARTS), means over ranks: they add up to
    #: `step_time_mean`. Empty for runs whose agent does not send them.
    parts: dict[str, Series] = field(default_factory=dict)
    step_time_mean: Series = field(default_factory=Series)
    #: Communication compute hid (mean over ranks): beside the parts, not in their sum.
    hidden_comm: Series = field(default_factory=Series)
    #: The distribution over ranks per step: {metric: {stat: Series}} for step time, busy
    #: time, exposed communication, each phase (`phase.<p>`) and each collective's latency
    #: and bus bandwidth (`collective.<op>.latency_s`, `.busbw`); stats min, p10, p50, p90,
    #: max (the rollups').
    spread: dict[str, dict[str, Series]] = field(default_factory=dict)
    #: Ranks that stand out over the sampled window, each {"rank", "host", "what", "value",
    #: "median", "unit"}: slowest busy time, highest memory peak, lowest bus bandwidth.
    outliers: list[dict[str, Any]] = field(default_factory=list)
    exposed_comm: Series = field(default_factory=Series)
    latency: dict[str, Series] = field(default_factory=dict)
    busbw: dict[str, Series] = field(default_factory=dict)
    sizes: dict[str, SizePoints] = field(default_factory=dict)
    #: Memory at the newest step that measured it: the peak (highest phase peak) over
    #: ranks, the model state the median rank holds by kind, each phase's peak over ranks.
    memory_peak: RankDistribution | None = None
    memory_state: dict[str, float] = field(default_factory=dict)
    memory_phases: dict[str, Quantiles] = field(default_factory=dict)
    theory: dict[str, float] = field(default_factory=dict)
    #: The device capacity the agents reported (None: none did, e.g. a CPU run).
    capacity_bytes: float | None = None
    #: The allocator's reserved bytes at that step, (median rank, highest rank); None where
    #: not reported (a CPU run).
    memory_reserved: tuple[float, float] | None = None
    offload: dict[str, Series] = field(default_factory=dict)
    grad_norm: Series = field(default_factory=Series)
    loss: Series = field(default_factory=Series)
    lr: Series = field(default_factory=Series)
    loss_scale: Series = field(default_factory=Series)
    clipped_steps: list[int] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    heat: RankGrid = field(default_factory=RankGrid)
    #: The rank that stands out in busy time, as the server's read model found it.
    straggler: Straggler | None = None
    #: The newest step any rank stored (-1: none yet).
    last_step: int = -1

    @property
    def peak_bytes(self) -> float | None:
        """The highest memory peak of any rank at the newest step that measured memory."""
        return max(self.memory_peak.values, default=None) if self.memory_peak else None

    @property
    def exposed_share(self) -> float | None:
        e, s = self.exposed_comm.last, self.step_time.last
        return e / s if e is not None and s else None


__all__ = ["Quantiles", "RankDistribution", "RankGrid", "RunSummary", "RunView", "Series", "SizePoints",
           "Straggler"]  # fmt: skip
