"""`ZeroWatchCallback` for the Hugging Face `Trainer`: one line in the code people have.

    from zerowatch.integrations.transformers import ZeroWatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ZeroWatchCallback(run="gpt2-zero3")])
    trainer.train()

When training begins (`on_train_begin`, after the Trainer has prepared its model) the
callback instruments what the Trainer built (`trainer.model_wrapped` and its optimizer,
through agent/adapters/accelerate.py's `adapter_for`): a DeepSpeed engine (`TrainingArguments(deepspeed=...)`), an
FSDP2 model (`fsdp_config={"fsdp_version": 2}`), a DDP model, or the bare model of a
single-process job. Under `torchrun` every rank's callback does so and the ranks agree on
one run over the process group, as `zerowatch.instrument` always does.

What the Trainer logs (`on_log`, on every rank: the Trainer averages the loss over ranks
before it logs) goes into the step that just ended: `loss`, `learning_rate` (stored as the
step's learning rate), `grad_norm` (the step's gradient norm) and `epoch`. The agent counts
steps from 0: the Trainer's `global_step` N (1-based) is zerowatch's step N - 1.

`on_train_end` closes the run as finished; a program that dies of an uncaught exception
closes it as failed. The callback never stops training: if it cannot instrument, it logs
why and does nothing.

The callback gets no Trainer from the callback API (only the unwrapped model), so it finds
the Trainer whose `on_train_begin` called it on the call stack.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any

from transformers import Trainer, TrainerCallback
from zerowatch.integrations._common import RunSettings, close, log

#: Trainer log keys -> `run.log` keys.
LOGGED = {"loss": "loss", "learning_rate": "lr", "grad_norm": "grad_norm", "epoch": "epoch"}
#: How far up the stack the Trainer may be from `on_train_begin`.
_MAX_FRAMES = 16


def _calling_trainer() -> Trainer | None:
    """The Trainer on the call stack (the one whose training loop is calling back)."""
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


def instrument_target(trainer: Trainer) -> Any:
    """The adapter of what a Trainer whose training has begun built: its wrapped model (a
    DeepSpeed engine, an FSDP2 or DDP module, or the model) with its optimizer."""
    from zerowatch.agent.adapters.accelerate import adapter_for

    return adapter_for(trainer.model_wrapped, trainer.optimizer)


class ZeroWatchCallback(TrainerCallback):  # type: ignore[misc]
    """Instrument a Hugging Face Trainer's training with zerowatch.

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

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None and not self.run.closed:
            return
        trainer = _calling_trainer()
        if trainer is None:
            log.warning("zerowatch: on_train_begin was not called by a Trainer; not instrumenting")
            return
        try:
            target = instrument_target(trainer)
        except Exception as e:
            log.warning("zerowatch: not instrumenting this training run: %s", e)
            return
        self.run = self.settings.instrument(target)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:  # fmt: skip
        if self.run is None or not logs:
            return
        scalars = {
            LOGGED[k]: v for k, v in logs.items()
            if k in LOGGED and isinstance(v, numbers.Real) and not isinstance(v, bool)
        }  # fmt: skip
        if scalars:
            self.run.log(**scalars)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        close(self.run)


__all__ = ["LOGGED", "ZeroWatchCallback"]
