"""The run's named figures: step time, exposed share and straggler, one definition each.

A figure is a number with its label ("step time"), the statistic it is over which steps and
ranks ("median over the run's newest 20 steps of each step's median rank") and the text
every surface prints ("89.2 ms"). The run page's tiles, the doctor's findings, the findings
API (`figures`) and `zerowatch doctor` take these objects, so a label means one number:

- step time: the run's recent figure (read/runs.py `recent`, the run resource's
  `step_time_s`, also the runs list's, compare's and the demo summary's);
- exposed share: the same recent figures' exposed communication over their step time (the
  median rank's);
- straggler: the doctor's straggler finding (doctor_ranks.straggler): the rank, and the
  median over the doctor's window of its busy time over each step's median rank; "none"
  where the doctor names no straggler.

A finding that needs another statistic (the exposed time of the rank that waits least, a
window of its own, a prediction) says it in other words, never under these labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zerowatch.dashboards.theme import fmt_seconds, recent_stat


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One named figure of a run."""

    key: str
    label: str
    stat: str
    value: float | None
    text: str
    #: The rank a straggler figure names (None: none, or not a straggler figure).
    rank: int | None = None

    def cite(self) -> str:
        """How a sentence states it: "step time 89.2 ms (median over ...)"."""
        return f"{self.label} {self.text} ({self.stat})"

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "stat": self.stat, "value": self.value,
                "text": self.text, "rank": self.rank}  # fmt: skip


def step_time(recent: dict[str, Any], steps: int) -> Figure:
    """The run's step time over its newest `steps` steps (`recent`: read/runs.py's)."""
    value = recent.get("step_time_s")
    return Figure(key="step_time_s", label="step time", stat=recent_stat(steps), value=value,
                  text=fmt_seconds(value))  # fmt: skip


def exposed_share(recent: dict[str, Any], steps: int) -> Figure:
    """The share of the step that communication compute did not hide: the recent exposed
    time over the recent step time, both the median rank's."""
    exposed, step = recent.get("exposed_comm_s"), recent.get("step_time_s")
    share = exposed / step if exposed is not None and step else None
    if share is not None and not math.isfinite(share):
        share = None
    return Figure(key="exposed_share", label="exposed share",
                  stat=f"communication compute did not hide over the step, each the "
                  f"{recent_stat(steps)}",
                  value=share, text=f"{share:.0%}" if share is not None else "–")  # fmt: skip


def straggler_stat(window: tuple[int, int], threshold: float) -> str:
    """The straggler figure's statistic over the doctor's `window` of steps."""
    return (f"busy time over the median rank's, the median over steps {window[0]:,}–"
            f"{window[1]:,} of each step's ratio; a rank is named above {threshold:g}x")  # fmt: skip


def straggler(
    rank: int | None, ratio: float | None, window: tuple[int, int], threshold: float
) -> Figure:
    """The doctor's straggler: `rank` at `ratio` times the median rank's busy time, or none."""
    named = rank is not None and ratio is not None
    return Figure(key="straggler", label="straggler", stat=straggler_stat(window, threshold),
                  value=ratio if named else None, rank=rank if named else None,
                  text=f"rank {rank} ({ratio - 1:+.0%})" if named and ratio is not None
                  else "none")  # fmt: skip


__all__ = ["Figure", "exposed_share", "step_time", "straggler", "straggler_stat"]
