"""Adapter for the bundled ZeRO engine (zerowatch.engine): it speaks the hooks natively."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from zerowatch.agent.adapters.base import JobInfo, StepStats

from zerowatch import theory


def matches(obj: Any) -> bool:
    """The bundled engine, or anything shaped like it (observer registry + model-state bytes)."""
    return all(
        hasattr(obj, name)
        for name in ("add_observer", "remove_observer", "zero_stage", "model_state_bytes")
    )


def _frozen(kind: type) -> bool:
    """Whether instances of `kind` are frozen dataclasses (cannot change once made)."""
    params = getattr(kind, "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


def _stats_of(last: Any) -> StepStats:
    """The agent's StepStats of the engine's record of one optimizer step (None: none yet)."""
    if last is None:
        return StepStats()
    raw_norm = getattr(last, "grad_norm", None)
    norm = _finite_or_none(raw_norm)
    return StepStats(
        grad_norm=norm,
        clipped=bool(getattr(last, "clipped", False)),
        loss_scale=_finite_or_none(getattr(last, "loss_scale", None)),
        skipped=bool(getattr(last, "skipped", False)),
        lr=_finite_or_none(getattr(last, "lr", None)),
        nonfinite=bool(getattr(last, "nonfinite", False))
        or (raw_norm is not None and norm is None),
        local_grads=getattr(last, "local_grads", None),
    )


def _offload_device(config: Any, key: str) -> str:
    try:
        device = getattr(config.zero_optimization, key).device
    except AttributeError:
        return "none"
    return "cpu" if str(device) == "cpu" else "none"


def _finite_or_none(x: Any) -> float | None:
    if x is None:
        return None
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _engine_info(e: Any) -> dict[str, Any]:
    """The engine's class and, for the bundled engine, the collective calls each stage
    makes per step at a range of bucket sizes (zerowatch/rehearse/counts.py: arithmetic,
    no collective): the doctor prices other stages and bucket sizes with them."""
    info: dict[str, Any] = {"class": type(e).__qualname__}
    if hasattr(e, "trained_params"):
        from zerowatch.rehearse import collective_calls

        calls = collective_calls(e)
        if calls is not None:
            info["collective_calls"] = calls
    return info


class ZeroWatchEngineAdapter:
    """zerowatch.engine.ZeroEngine -> EngineAdapter."""

    name = "zerowatch"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        #: The kind of step record last found frozen (`step_stats_later`).
        self._frozen_kind: type | None = None

    def info(self) -> JobInfo:
        e = self.engine
        config: Any = getattr(e, "config", None)
        config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
        world = int(getattr(e, "world_size", 1))
        stage = int(e.zero_stage)
        precision = str(getattr(e, "precision", "fp32"))
        n_params = int(getattr(e, "num_parameters", 0))
        persistent = int(getattr(e, "num_persistent_parameters", 0) or 0)
        ga = int(getattr(e, "gradient_accumulation_steps", 1) or 1)
        try:
            theory_flat = dict(e.theory().flat())
        except Exception:
            theory_flat = {}
        return JobInfo(
            engine=self.name,
            rank=int(getattr(e, "rank", 0)),
            world_size=world,
            device=str(getattr(e, "device", "cpu")),
            zero_stage=stage,
            precision=precision,
            offload_optimizer=_offload_device(config, "offload_optimizer"),
            offload_param=_offload_device(config, "offload_param"),
            config=config_dict,
            param_count=n_params,
            persistent_params=persistent,
            micro_batch_size=int(getattr(e, "micro_batch_size", 1) or 1),
            gradient_accumulation_steps=ga,
            theory=theory_flat,
            theory_comm=theory.comm_bytes_per_step(
                n_params,
                world,
                stage,
                precision=precision,
                gradient_accumulation_steps=ga,
                persistent_params=persistent,
            ),
            engine_info=_engine_info(e),
            global_step=int(getattr(e, "global_steps", 0) or 0),
        )

    def rehearse(self) -> dict[str, Any]:
        """What the doctor measures beside the steps (zerowatch/rehearse: each stage's
        communication path, the link's bandwidth), to merge into
        `engine_info["collective_calls"]`; {} where nothing is measured. Collectives on the
        engine's process group: every rank calls it at the same point."""
        if not hasattr(self.engine, "trained_params"):
            return {}
        from zerowatch.rehearse import rehearse

        return rehearse(self.engine)

    def attach(self, observer: Any) -> None:
        self.engine.add_observer(observer)
        self._local_grads(True)

    def detach(self, observer: Any) -> None:
        self.engine.remove_observer(observer)
        self._local_grads(False)

    def _local_grads(self, on: bool) -> None:
        """The engine notes each rank's gradients before the reduction (a norm pass per
        bucket) only while the agent is there to read them (forensics)."""
        local = getattr(self.engine, "local_grads", None)
        if local is not None:
            local.enabled = on
            if not on:
                local.discard()

    def model_state_bytes(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self.engine.model_state_bytes().items()}

    def step_stats(self) -> StepStats:
        return _stats_of(getattr(self.engine, "last_step", None))

    def step_nonfinite(self) -> bool:
        """Whether the step that just ended had a non-finite gradient (cheap: a flag of the
        engine's record; the recorder arms its forward tracer on it)."""
        return bool(getattr(getattr(self.engine, "last_step", None), "nonfinite", False))

    def step_stats_later(self) -> StepStats | Callable[[], StepStats]:
        """`step_stats()` of the step that just ended, or a callable that reads it later
        (on the shipper thread, where the recorder builds the step's event). The bundled
        engine records each optimizer step in a new frozen dataclass (`engine.last_step`),
        so holding it is all the step's end does on the training thread; a record of
        another kind (an engine shaped like it that may change it in place) is read now."""
        last = getattr(self.engine, "last_step", None)
        kind = type(last)
        if kind is not self._frozen_kind:  # (asked once per kind of record)
            if not _frozen(kind):
                return _stats_of(last)
            self._frozen_kind = kind
        return functools.partial(_stats_of, last)

    def _comm(self) -> Any:
        """The engine's comm module object (zerowatch.engine.comm.Comm), or None when the
        job is one process."""
        if int(getattr(self.engine, "world_size", 1)) <= 1:
            return None
        return getattr(self.engine, "comm", None)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        comm = self._comm()
        return obj if comm is None else comm.broadcast_object(obj, src=src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        comm = self._comm()
        return [obj] if comm is None else list(comm.all_gather_object(obj))

    def torch_device(self) -> Any:
        import torch

        return torch.device(getattr(self.engine, "device", "cpu"))


__all__ = ["ZeroWatchEngineAdapter", "matches"]
