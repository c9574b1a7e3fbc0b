"""The Trainer callback closes its run as finished when training ends and as failed when
the program dies of an uncaught exception (a one-process Trainer, the agent spooling)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from zerowatch.agent.spool import read_events, segments

SCRIPT = """
import sys, torch
from transformers import Trainer, TrainingArguments
from zerowatch.examples.integrations.hf_trainer import RandomTokens, tiny_gpt2
from zerowatch.integrations.transformers import ZeroWatchCallback

class Breaks(torch.nn.Module):
    def __init__(self, at):
        super().__init__()
        self.gpt, self.at, self.calls = tiny_gpt2(), at, 0
    def forward(self, input_ids, labels):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("the loss went to the moon")
        return self.gpt(input_ids=input_ids, labels=labels)

at = int(sys.argv[1])
args = TrainingArguments(output_dir="out", max_steps=4, per_device_train_batch_size=2,
                         logging_steps=1, save_strategy="no", report_to=[], use_cpu=True)
trainer = Trainer(model=Breaks(at), args=args, train_dataset=RandomTokens(16, 8, 256),
                  callbacks=[ZeroWatchCallback(run="status", spool_dir="spool")])
trainer.train()
"""


def _end_and_steps(spool: Path) -> tuple[dict, int]:
    (run_dir,) = spool.iterdir()
    events = [obj for seg in segments(run_dir / "rank-00000") for _, obj in read_events(seg)]
    ends = [e for e in events if e["kind"] == "end"]
    assert len(ends) == 1, ends
    return ends[0], sum(e["kind"] == "step" for e in events)


@pytest.mark.parametrize(("breaks_at", "status", "steps"), [(0, "finished", 4), (3, "failed", 2)])
def test_run_ends_finished_or_failed_with_training(
    tmp_path: Path, breaks_at: int, status: str, steps: int
) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(breaks_at)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert (proc.returncode == 0) == (status == "finished"), proc.stderr[-3000:]
    end, stored = _end_and_steps(tmp_path / "spool")
    assert end["status"] == status and stored == steps
    if status == "failed":
        assert end["error"] == "RuntimeError: the loss went to the moon"
