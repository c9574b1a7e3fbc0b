"""`ZeroWatchCallback` for Lightning's `Trainer` (DDP, FSDP and DeepSpeed strategies).

    from zerowatch.integrations.lightning import ZeroWatchCallback

    trainer = L.Trainer(strategy="ddp", callbacks=[ZeroWatchCallback(run="gpt-ddp")])

When training starts (`on_train_start`, after the strategy wrapped the model) the callback
instruments what the strategy built (`trainer.strategy.model`): a DDP module, an FSDP
(`FullyShardedDataParallel`) module or a DeepSpeed engine, with the first optimizer. Every
rank does so and the ranks agree on one run, as `zerowatch.instrument` always does.

Per step it logs into the step: `loss` (what `training_step` returned on this rank), `lr`
(the first optimizer's learning rate when the step ran, read before the optimizer step) and
`epoch`. The agent counts steps from 0, as Lightning's `global_step` does before the step.
`on_train_end` closes the run as finished, `on_exception` as failed. The callback never
stops training: if it cannot instrument, it logs why and does nothing.
"""

from __future__ import annotations

import numbers
from typing import Any

from lightning.pytorch.callbacks import Callback
from zerowatch.integrations._common import RunSettings, close, log


class ZeroWatchCallback(Callback):  # type: ignore[misc]
    """Instrument a Lightning Trainer's training with zerowatch.

    Args:
        server: the zerowatch server URL; default `$ZEROWATCH_SERVER` (none: a local spool
            for `zerowatch upload`).
        run: a human-readable run name.
        project: the project the run belongs to.
        tags: free-form labels.
        token: the ingest token; default `$ZEROWATCH_TOKEN`.
        **options: more `zerowatch.instrument` keywords (spool_dir, AgentConfig fields).

    Raises:
        ValueError: naming the argument, for a bad project, run name or tags.
    """

    def __init__(self, server: str | None = None, run: str | None = None,
                 project: str = "default", tags: list[str] | None = None,
                 token: str | None = None, **options: Any) -> None:  # fmt: skip
        self.settings = RunSettings(server, run, project, tags, token, options)
        #: This rank's `zerowatch.agent.Run` while training (None before, or if it could
        #: not attach).
        self.run: Any = None
        self._lr: float | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.run is not None and not self.run.closed:
            return
        from zerowatch.agent.adapters.accelerate import adapter_for

        optimizers = list(getattr(trainer, "optimizers", None) or [])
        try:
            target = adapter_for(trainer.strategy.model, optimizers[0] if optimizers else None)
        except Exception as e:
            log.warning("zerowatch: not instrumenting this training run: %s", e)
            return
        self.run = self.settings.instrument(target)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        groups = getattr(optimizer, "param_groups", None) or []
        lr = groups[0].get("lr") if groups else None
        self._lr = float(lr) if isinstance(lr, numbers.Real) else None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if self.run is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        scalars: dict[str, Any] = {"epoch": trainer.current_epoch}
        if loss is not None and getattr(loss, "numel", lambda: 1)() == 1:
            scalars["loss"] = loss.detach() if hasattr(loss, "detach") else loss
        if self._lr is not None:
            scalars["lr"] = self._lr
        self.run.log(**scalars)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        close(self.run)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        close(self.run, "failed", f"{type(exception).__name__}: {exception}")


__all__ = ["ZeroWatchCallback"]
