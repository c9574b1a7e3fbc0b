"""Which job a run belongs to: the name given, else the launcher's job id (what a restart
keeps), else none; a bad name is refused naming the argument."""

from __future__ import annotations

import pytest
from zerowatch.agent.attach import job_key

import zerowatch

LAUNCHER = ("ZEROWATCH_JOB", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


@pytest.mark.parametrize(
    "given,env,want",
    [
        ("mine", {"ZEROWATCH_JOB": "env", "SLURM_JOB_ID": "42"}, "mine"),
        (None, {"ZEROWATCH_JOB": "env", "SLURM_JOB_ID": "42"}, "env"),
        (None, {"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "abc"}, "slurm-42"),
        (None, {"TORCHELASTIC_RUN_ID": "abc"}, "torchrun-abc"),
        (None, {"TORCHELASTIC_RUN_ID": "none"}, ""),  # torchrun's placeholder: no job
        (None, {}, ""),
    ],
)
def test_the_job_is_the_name_given_else_the_launchers_job_id(monkeypatch, given, env, want):
    for key in LAUNCHER:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert job_key(given) == want


@pytest.mark.parametrize("bad", ["", "   ", "x" * 201, 7])
def test_a_bad_job_name_is_refused_naming_the_argument(fake_engine, spool_root, bad):
    with pytest.raises(ValueError, match=r"^job: "):
        zerowatch.instrument(fake_engine, spool_dir=spool_root, job=bad)
