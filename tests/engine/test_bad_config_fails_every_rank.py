"""A config mistake stops every rank of a multi-rank job with its ConfigError (naming the
key) before any rank waits on a collective that its peers will never join."""

from __future__ import annotations

from typing import Any

import pytest
from support.engine_harness import run_ranks
from support.engine_scenarios import ds_config, make_model

import zerowatch
from zerowatch import ConfigError

pytestmark = pytest.mark.slow


def _with(stage: int, path: tuple[str, ...], value: Any) -> dict[str, Any]:
    cfg = ds_config(stage)
    node = cfg
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return cfg


#: name -> (config, the key path its error must start with)
MISTAKES: dict[str, tuple[dict[str, Any], str]] = {
    "nvme offload": (_with(3, ("zero_optimization", "offload_param", "device"), "nvme"),
                     "zero_optimization.offload_param.device"),
    "misspelt key": (_with(2, ("zero_optimization", "reduce_bucket_sise"), 100),
                     "zero_optimization.reduce_bucket_sise"),
    "param offload below stage 3": (ds_config(2, offload_param=True),
                                    "zero_optimization.offload_param"),
    "unknown optimizer": (_with(1, ("optimizer", "type"), "Lamb"), "optimizer.type"),
    "unknown scheduler": ({**ds_config(1), "scheduler": {"type": "OneCycle", "params": {}}},
                          "scheduler.type"),
}  # fmt: skip


def _try_each(rank: int, world: int) -> dict[str, tuple[str, str]]:
    out = {}
    for name, (config, _) in MISTAKES.items():
        try:
            zerowatch.initialize(model=make_model(), config=config)
        except Exception as e:  # reported to the test, which checks the type
            out[name] = (type(e).__name__, str(e))
        else:
            out[name] = ("", "no error")
    return out


@pytest.fixture(scope="module")
def errors() -> list[dict[str, tuple[str, str]]]:
    # A rank stuck in a collective would hit this timeout and fail the fixture.
    return run_ranks(_try_each, 2, timeout_s=30)


@pytest.mark.parametrize("name", list(MISTAKES))
def test_every_rank_fails_with_the_config_error_naming_the_key(
    name: str, errors: list[dict[str, tuple[str, str]]]
) -> None:
    key = MISTAKES[name][1]
    for rank, found in enumerate(errors):
        kind, message = found[name]
        assert kind == ConfigError.__name__, f"rank {rank}, {name}: {kind}: {message}"
        assert message.startswith(key), f"rank {rank}, {name}: {message}"
