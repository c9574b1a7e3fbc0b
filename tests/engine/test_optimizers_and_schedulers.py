"""Optimizers from the config or passed in, and DeepSpeed's lr schedules (single process)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from support.engine_scenarios import TINY, ds_config, make_model, train_engine

import zerowatch
from zerowatch import ConfigError
from zerowatch.engine.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR


def _opt(lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]}
                            for _ in range(groups)], lr=lr)  # fmt: skip


def test_warmup_lr_log_and_linear() -> None:
    opt = _opt()
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.0  # iteration -1: the minimum
    for _ in range(4):
        s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(math.log(4) / math.log(10))
    lin = WarmupLR(_opt(), warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    for _ in range(6):
        lin.step()
    assert lin.get_last_lr() == [pytest.approx(0.5)]
    for _ in range(20):
        lin.step()
    assert lin.get_last_lr() == [1.0]


def test_warmup_decay_lr_reaches_zero_at_total_steps() -> None:
    s = WarmupDecayLR(_opt(), total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=10,
                      warmup_type="linear")  # fmt: skip
    lrs = []
    for _ in range(21):
        s.step()
        lrs.append(s.get_last_lr()[0])
    assert lrs[5] == pytest.approx(0.5) and lrs[10] == pytest.approx(1.0)
    assert lrs[15] == pytest.approx(0.5) and lrs[20] == 0.0


def test_warmup_cosine_lr_is_a_ratio_of_the_optimizer_lr() -> None:
    s = WarmupCosineLR(_opt(lr=0.2), total_num_steps=20, warmup_num_steps=4,
                       cos_min_ratio=0.1, warmup_type="linear")  # fmt: skip
    lrs = []
    for _ in range(20):
        s.step()
        lrs.append(s.get_last_lr()[0])
    assert lrs[2] == pytest.approx(0.2 * 0.5)
    assert lrs[4] == pytest.approx(0.2 * (0.1 + 0.9 * (1 + math.cos(math.pi / 16)) / 2))
    assert lrs[-1] == pytest.approx(0.2 * 0.1)


def test_scheduler_state_round_trips_and_groups_are_checked() -> None:
    s = WarmupLR(_opt(groups=2), warmup_max_lr=[1.0, 2.0], warmup_num_steps=5)
    s.step()
    s.step()
    t = WarmupLR(_opt(groups=2), warmup_max_lr=[1.0, 2.0], warmup_num_steps=5)
    t.load_state_dict(s.state_dict())
    assert t.get_last_lr() == s.get_last_lr()
    with pytest.raises(ConfigError, match=r"^scheduler\.params\.warmup_max_lr: "):
        WarmupLR(_opt(groups=2), warmup_max_lr=[1.0, 2.0, 3.0])


def test_passed_optimizer_with_param_groups_and_scheduler_callable() -> None:
    model = make_model()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    user_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)  # fmt: skip
    cfg = ds_config(2)
    del cfg["optimizer"]
    engine, opt, _, sched = zerowatch.initialize(
        model=model,
        config=cfg,
        optimizer=user_opt,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5**step),
    )
    assert opt is user_opt and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) >= engine.num_parameters
    train_engine(engine, TINY, 2, 1, 1, 0)
    assert engine.last_step is not None and engine.last_step.lr == pytest.approx(1.5e-3)
    assert sched.get_last_lr()[0] == pytest.approx(0.75e-3)


def test_json_config_path_with_scheduler(tmp_path: Path) -> None:
    cfg = ds_config(1, scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}})  # fmt: skip
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    engine, _, _, sched = zerowatch.initialize(model=make_model(), config=str(path))
    assert isinstance(sched, WarmupLR) and engine.get_lr() == [0.0]
    train_engine(engine, TINY, 3, 1, 1, 0)
    assert engine.get_lr()[0] == pytest.approx(1e-3 * math.log(3) / math.log(10))


def test_clear_errors_for_impossible_combinations() -> None:
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_param: "):
        zerowatch.initialize(model=make_model(), config=ds_config(2, offload_param=True))
    frozen_out = make_model()
    with pytest.raises(ValueError, match="in no param group"):
        zerowatch.initialize(model=frozen_out, config=ds_config(1),
                             model_parameters=[frozen_out.lm_head.weight])  # fmt: skip
    cfg = ds_config(1)
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "nesterov": True}}
    with pytest.raises(ConfigError, match=r"^optimizer\.params\.nesterov: "):
        zerowatch.initialize(model=make_model(), config=cfg)
