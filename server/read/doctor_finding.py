"""A finding of the doctor (its JSON shape: doctor.py) and the few ways the checks word
their figures (shares as percentages, a rank's host), shared by every check module."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from zerowatch.server.read.doctor_evidence import Evidence
from zerowatch.server.read.rollups import Stats

SEVERITIES = ("critical", "warning", "info")


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One thing the doctor found (doctor.py's docstring: the JSON shape)."""

    kind: str
    severity: str
    message: str
    suggestion: str
    steps: tuple[int, int]
    ranks: tuple[int, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)
    prediction: dict[str, Any] | None = None
    #: The run page's chart that shows the evidence (its element id is chart-<chart>).
    chart: str = "breakdown"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "ranks": list(self.ranks),
            "steps": list(self.steps),
            "message": self.message,
            "suggestion": self.suggestion,
            "evidence": self.evidence,
            "prediction": self.prediction,
            "chart": self.chart,
        }


def pct(x: float) -> str:
    """A share as a whole percentage."""
    return f"{x:.0%}"


def share_text(x: float) -> str:
    """A share as a percentage, "under 1%" rather than "0%"."""
    return pct(x) if x >= 0.01 else "under 1%"


def ordered(per: dict[int, Stats] | None, stat: str = "p50") -> list[tuple[int, float]]:
    """(step, one statistic over ranks) of a metric's rollups, by step."""
    return sorted((step, st.get(stat)) for step, st in (per or {}).items())


def typical(per: dict[int, Stats] | None, attr: str) -> int | None:
    """The rank most often at one end (`attr`: "min_rank" or "max_rank") over the steps."""
    got = Counter(int(getattr(st, attr)) for st in (per or {}).values())
    return got.most_common(1)[0][0] if got else None


def sentence(text: str) -> str:
    """`text` with its first letter capitalised (the rest as it is) and a full stop."""
    return text[:1].upper() + text[1:] + "."


def host_of(e: Evidence, rank: int) -> str:
    """ " on <host>" for a rank whose host is known, else nothing."""
    h = e.hosts.get(rank)
    return f" on {h}" if h else ""


__all__ = ["SEVERITIES", "Finding", "host_of", "ordered", "pct", "sentence", "share_text",
           "typical"]  # fmt: skip
