"""Each rank's local gradients before the reduction: where a non-finite gradient came from.

Once the reducers have summed the ranks' gradients, a NaN on one rank is a NaN on all of
them, and the global norm says only that the step went wrong. Before the sum, each rank's
own gradients still say which rank and which parameters produced it. So, as a reducer
hands a bucket (a segment's flat gradients) to its collective, `LocalGrads.add` folds the
bucket's per-parameter norms into one `torch._foreach_norm` (one pass over the bucket, no
synchronisation: the norms stay tensors on the device); the step's end takes them
(`take`), and whoever reads the step record later (the agent, on its shipper thread)
turns them into this rank's local gradient norm and, on a step whose norms are not
finite, the parameters that were not (`LocalGradReport.read`).

Accumulated micro-batches (stages 2 and 3 reduce every micro-batch) are folded by their
squares: the local norm is then that of the micro-batches' gradients taken together, not
of their sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from zerowatch.engine.flat import Segment


@dataclass(frozen=True)
class LocalGradReport:
    """One step's local gradient norms of one rank, read when asked (`read`).

    Attributes:
        names: per bucket, its parameters' names.
        norms: per bucket, a 1-D tensor of those parameters' local gradient norms.
        order: parameter name -> its position in the model's forward order.
        divisor: what the reduced buckets' gradients are multiplied by (the loss scale over
            the accumulation steps and the predivide factor): the norms are divided by it.
    """

    names: tuple[tuple[str, ...], ...]
    norms: tuple[torch.Tensor, ...]
    order: dict[str, int]
    divisor: float = 1.0

    def read(self) -> dict[str, Any]:
        """{"local_grad_norm": float (nan/inf when some gradient was not finite),
        "nonfinite_params": names earliest in forward order first (empty when finite)}."""
        sq = 0.0
        bad: list[str] = []
        for names, norms in zip(self.names, self.norms, strict=True):
            values = norms.float().tolist()
            for name, v in zip(names, values, strict=True):
                if math.isfinite(v):
                    sq += v * v
                else:
                    bad.append(name)
                    sq += v if v != v else math.inf  # nan stays nan, inf stays inf
        bad.sort(key=lambda n: self.order.get(n, len(self.order)))
        norm = math.sqrt(sq) / self.divisor if sq == sq else math.nan
        return {"local_grad_norm": norm,
                "nonfinite_params": bad}  # fmt: skip


class LocalGrads:
    """Collects the per-parameter norms of the buckets a step reduces (module docstring).

    Args:
        order: parameter name -> position in forward order (module.named_parameters()).
    """

    def __init__(self, order: dict[str, int]) -> None:
        self.order = order
        #: Off until an observer that reads the norms asks for them (the agent's adapter):
        #: the bare engine pays no norm pass.
        self.enabled = False
        self._names: list[tuple[str, ...]] = []
        self._norms: list[torch.Tensor] = []

    def add(self, seg: Segment, flat: torch.Tensor) -> None:
        """Note the local gradients of `seg`, laid out in `flat` (before its collective)."""
        if not self.enabled or not seg.slots:
            return
        views = [flat.narrow(0, s.offset, s.numel) for s in seg.slots]
        norms = torch._foreach_norm(views)  # one pass, no synchronisation
        self._names.append(tuple(s.name for s in seg.slots))
        self._norms.append(torch.stack(list(norms)))

    def take(self, divisor: float = 1.0) -> LocalGradReport | None:
        """The step's report (None when nothing was reduced); starts the next step's."""
        if not self._names:
            return None
        report = LocalGradReport(tuple(self._names), tuple(self._norms), self.order,
                                 divisor or 1.0)  # fmt: skip
        self._names, self._norms = [], []
        return report

    def discard(self) -> None:
        self._names, self._norms = [], []


__all__ = ["LocalGradReport", "LocalGrads"]
