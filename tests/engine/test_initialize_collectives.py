"""`initialize` issues only what training needs (every rank starts from rank 0's state: its
broadcasts), and what the doctor measures beyond the steps (zerowatch/rehearse: the
stages' calls, their rehearsed paths, the link's probe) arrives in the run's engine_info
when the agent attaches. Collectives are counted at the one seam, engine/comm.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engine_harness import run_ranks
from support.engine_scenarios import TINY, ds_config, make_model, train_engine

import zerowatch
from zerowatch.engine.comm import Comm
from zerowatch.examples.gpt import GPT

pytestmark = pytest.mark.slow


class _Counted:
    """Every collective through `Comm._run` (the engine's, the rehearsal's, the agent's), by op."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self._run = Comm._run
        counted = self

        def run(comm: Comm, op: str, *args: Any, **kwargs: Any) -> Any:
            counted.ops.append(op)
            return counted._run(comm, op, *args, **kwargs)

        Comm._run = run  # type: ignore[method-assign]

    def take(self) -> list[str]:
        out, self.ops = self.ops, []
        return out


def _engine_info(spool: Path) -> dict[str, Any]:
    """The engine_info of the run the agent spooled (the RunCreate the server would get)."""
    (run_file,) = spool.glob("*/run.json")
    return dict(json.loads(run_file.read_text())["engine_info"])


def _jobs(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ.pop("ZEROWATCH_SERVER", None)
    counted = _Counted()
    out: dict[str, Any] = {}
    for name, stage, rehearse in (("stage1", 1, True), ("stage3", 3, True),
                                  ("stage1-no-rehearsal", 1, False)):  # fmt: skip
        torch.manual_seed(0)
        counted.take()
        engine, *_ = zerowatch.initialize(model=make_model(TINY), config=ds_config(stage))
        at_init = counted.take()
        with zerowatch.instrument(engine, run=name, spool_dir=f"{root}/{name}",
                                  rehearse=rehearse):  # fmt: skip
            at_attach = counted.take()
            train_engine(engine, TINY, 2, 1, world, rank)
        engine.destroy()
        out[name] = {"init": at_init, "attach": at_attach,
                     "info": _engine_info(Path(root) / name)}  # fmt: skip
    # A model built under zero.Init: its calls and the link, no rehearsed paths.
    config = ds_config(3)
    with zerowatch.zero.Init(config_dict_or_path=config):
        model = GPT(TINY)
    engine, *_ = zerowatch.initialize(model=model, config=config)
    with zerowatch.instrument(engine, run="init", spool_dir=f"{root}/init"):
        train_engine(engine, TINY, 1, 1, world, rank)
    engine.destroy()
    out["init"] = {"info": _engine_info(Path(root) / "init")}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_jobs, 2, str(tmp_path_factory.mktemp("spool")), timeout_s=180)


@pytest.mark.parametrize("name", ["stage1", "stage3"])
def test_initialize_issues_only_the_broadcasts_of_the_initial_state(
    name: str, ranks: list[dict[str, Any]]
) -> None:
    for r in ranks:
        assert r[name]["init"], "rank 0's state reaches every rank"
        assert set(r[name]["init"]) == {"broadcast"}, r[name]["init"]


@pytest.mark.parametrize("name", ["stage1", "stage3"])
def test_the_doctors_inputs_arrive_when_the_agent_attaches(
    name: str, ranks: list[dict[str, Any]]
) -> None:
    for r in ranks:
        calls = r[name]["info"]["collective_calls"]
        assert set(calls["calls"]) == {"0", "1", "2", "3"}
        assert calls["calls"]["1"]["reduce_scatter"]
        assert set(calls["management_s"]) == {"0", "1", "2", "3"}
        assert all(v >= 0 for v in calls["management_s"].values())
        link = calls["link"]
        assert link["op"] == "reduce_scatter" and link["busbw"] > 0
        # The rehearsal's collectives went through the seam, at attach.
        assert {"reduce_scatter", "all_gather", "all_reduce"} <= set(r[name]["attach"])


def test_without_the_rehearsal_the_counts_still_arrive(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        calls = r["stage1-no-rehearsal"]["info"]["collective_calls"]
        assert set(calls["calls"]) == {"0", "1", "2", "3"}
        assert "management_s" not in calls and "link" not in calls
        assert "reduce_scatter" not in r["stage1-no-rehearsal"]["attach"]


def test_a_model_built_under_init_is_not_rehearsed_but_its_link_is_probed(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        calls = r["init"]["info"]["collective_calls"]
        assert set(calls["calls"]) == {"0", "1", "2", "3"}
        assert "management_s" not in calls
        assert calls["link"]["busbw"] > 0
