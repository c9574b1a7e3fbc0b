"""Trains several variants one after another in the same torchrun ranks, each as its own
zerowatch run, and writes what each rank saw: `variants.py OUT_DIR VARIANT...`.

Variants: `hf-<strategy>` (zerowatch.examples.integrations.hf_trainer), `lightning-<strategy>`
(...lightning_trainer), `accelerate-<strategy>` (...accelerate_loop). One launch for all of
them: importing torch, transformers, DeepSpeed and Lightning costs more than training the
tiny model. Writes OUT_DIR/rank-<r>.json: {variant: {"run_id", "logged": [{"step", ...}]}
or {"skipped": reason}}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any


def _reset_accelerate(environ: dict[str, str]) -> None:
    """Forget the previous variant's Accelerate state (DeepSpeed / FSDP plugins), and the
    environment variables an Accelerator sets for them (ACCELERATE_USE_FSDP, ...)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(environ)


def hf(strategy: str, out: Path, server: str) -> dict[str, Any]:
    from zerowatch.examples.integrations import hf_trainer

    trainer = hf_trainer.train(strategy, steps=10, server=server, output_dir=str(out / "hf"))
    callback = next(c for c in trainer.callback_handler.callbacks
                    if type(c).__name__ == "ZeroWatchCallback")  # fmt: skip
    logged = [
        {"step": e["step"], "loss": e["loss"], "lr": e["learning_rate"],
         "grad_norm": e.get("grad_norm"), "epoch": e["epoch"]}
        for e in trainer.state.log_history if "loss" in e
    ]  # fmt: skip
    return {"run_id": callback.run.id, "status": callback.run.status, "logged": logged}


def lightning(strategy: str, out: Path, server: str) -> dict[str, Any]:
    from zerowatch.examples.integrations import lightning_trainer

    trainer, model = lightning_trainer.train(strategy, steps=10, server=server,
                                             root_dir=str(out / "lightning"))  # fmt: skip
    callback = next(c for c in trainer.callbacks if type(c).__name__ == "ZeroWatchCallback")
    return {"run_id": callback.run.id, "status": callback.run.status, "logged": model.logged}


#: The Accelerate distributed type each plugin strategy asks for.
ACCELERATE_TYPE = {"fsdp2": "FSDP", "deepspeed-zero2": "DEEPSPEED"}


def accelerate(strategy: str, out: Path, server: str) -> dict[str, Any]:
    from zerowatch.examples.integrations import accelerate_loop

    # Accelerate does not refuse a plugin it will not apply: it falls back to another
    # distributed type without a word. Ask it first, and report what it chose.
    chosen = accelerate_loop.accelerator_for(strategy).distributed_type.name
    _reset_accelerate(ENVIRON)
    if chosen != ACCELERATE_TYPE.get(strategy, chosen):
        return {"skipped": f"Accelerate chose distributed_type={chosen}"}
    run, logged = accelerate_loop.train(strategy, steps=10, server=server)
    return {"run_id": run.id, "status": run.status, "logged": logged}


KINDS = {"hf": hf, "lightning": lightning, "accelerate": accelerate}
ENVIRON = dict(os.environ)


def main() -> None:
    out, variants = Path(sys.argv[1]), sys.argv[2:]
    server = os.environ["ZEROWATCH_SERVER"]
    rank = int(os.environ.get("RANK", "0"))
    results: dict[str, Any] = {}
    for variant in variants:
        kind, strategy = variant.split("-", 1)
        try:
            results[variant] = KINDS[kind](strategy, out, server)
        except Exception:
            results[variant] = {"error": traceback.format_exc()}
        finally:
            _reset_accelerate(ENVIRON)
        (out / f"rank-{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
