"""What the doctor needs from a bundled-engine job beyond its steps.

The doctor prices other stages and bucket sizes for a run of the bundled engine
(zerowatch/predict.py, docs/doctor.md) from three things the steps do not show, which the
agent sends in the run's `engine_info["collective_calls"]`:

- `collective_calls`: the calls each stage makes per step at a range of bucket sizes
  (counts.py; pure arithmetic over the parameters' shapes, no collective);
- `rehearse(...)["management_s"]`: each stage's communication path on the training thread,
  rehearsed with the real collectives on the job's process group (paths.py);
- `rehearse(...)["link"]`: the link's bus bandwidth with one large message (link.py).

`zerowatch.instrument(engine)` runs them when it attaches to a bundled engine, on every
rank (`instrument(..., rehearse=False)` leaves the rehearsal and the probe out; the counts
are always sent). `initialize` runs none of them: training needs none. The rehearsal runs
only with more than one rank on the CPU (on a GPU the host's bookkeeping runs ahead of the
device and the doctor does not price it), and not for a model built under
zerowatch.zero.Init: stage 3's path holds every unit gathered at once, the whole model
that Init exists to avoid, and stages 0-2 keep the whole model on every rank, which such a
model is built not to need (the link is probed: it holds 12 MiB). The doctor reads what
arrives and prices without what does not (docs/doctor.md).

Everything here works on stand-ins of the engine's parameters (layout.py): the engine's own
tensors and observers are untouched, and its hooks see nothing.
"""

from __future__ import annotations

from typing import Any

from zerowatch.rehearse import counts, layout, link, paths


def collective_calls(engine: Any) -> dict[str, Any] | None:
    """The calls table (counts.collective_calls) of a bundled engine; None for an object
    without its layout (an engine shaped like it)."""
    lay = layout.of_engine(engine)
    return None if lay is None else counts.collective_calls(lay)


def rehearse(engine: Any) -> dict[str, Any]:
    """{"management_s": {"<stage>": seconds}, "link": {...}}, each where measured (more
    than one rank on the CPU; see the module docstring). A collective sequence on the
    engine's process group: every rank calls it at the same point."""
    lay = layout.of_engine(engine)
    if lay is None:
        return {}
    out: dict[str, Any] = {}
    partitioned = bool(getattr(engine, "built_partitioned", False))
    manage = None if partitioned else paths.management_s(lay, engine.comm)
    if manage is not None:
        out["management_s"] = {str(stage): v for stage, v in manage.items()}
    probe = link.link_bandwidth(engine.comm, device=lay.device, dtype=lay.dtype)
    if probe is not None:
        out["link"] = probe
    return out


__all__ = ["collective_calls", "rehearse"]
