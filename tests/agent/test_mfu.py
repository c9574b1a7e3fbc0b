"""MFU without hand input: the device's peak from its name, the model's FLOPs per token from
the module (6·N + 12·L·H·T, embeddings out, experts by their top-k), and no MFU at all
rather than a wrong one (an unknown device, an MFU above 1)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from zerowatch.agent import attach, flops
from zerowatch.agent.recorder import launcher_node
from zerowatch.agent.spool import read_events, segments

import zerowatch
from zerowatch.examples.gpt import GPT, GPTConfig

H100 = "NVIDIA H100 80GB HBM3"
CFG = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=3, n_heads=4, tied=True)


def _steps(run: zerowatch.agent.Run) -> list[dict]:
    out = []
    for seg in segments(run.spool_path / f"rank-{run.rank:05d}"):
        out.extend(obj for _, obj in read_events(seg) if obj["kind"] == "step")
    return out


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        (H100, "bf16", 989.5e12),
        (H100, "fp16", 989.5e12),
        (H100, "tf32", 494.5e12),
        (H100, "fp32", 67e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 NVL", "bf16", 835.5e12),
        ("NVIDIA A100-SXM4-40GB", "bf16", 312e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
        ("NVIDIA A100-PCIE-40GB", "fp32", 19.5e12),
        ("NVIDIA A100 80GB PCIe", "fp16", 312e12),
        ("NVIDIA H200", "bf16", 989.5e12),
        ("NVIDIA H200 NVL", "bf16", 835.5e12),
        ("NVIDIA B200", "bf16", 2250e12),
        ("NVIDIA GeForce RTX 4090", "bf16", None),
        ("Tesla T4", "fp16", None),
        ("", "bf16", None),
        (H100, "fp8", None),
    ],
)
def test_peak_flops_come_from_the_table_by_device_name_and_dtype(name, dtype, peak):
    assert flops.peak_flops(name, dtype) == peak


def test_the_small_gpt_counts_6n_without_its_position_table_plus_attention():
    model = GPT(CFG)
    got = flops.model_flops(model)
    trainable = sum(p.numel() for p in model.parameters())  # tied: the token table once
    # The token table is the LM head's weight too (a matmul): it stays; positions go.
    n = trainable - CFG.seq_len * CFG.d_model
    assert got == flops.ModelFlops(params=n, num_layers=3, hidden_size=32, seq_len=32)
    assert got.per_token() == 6 * n + 12 * 3 * 32 * 32
    untied = GPT(GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=3, n_heads=4,
                           tied=False))  # fmt: skip
    n_untied = sum(p.numel() for p in untied.parameters()) - (64 + 32) * 32
    assert flops.model_flops(untied).params == n_untied  # type: ignore[union-attr]


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 32, bias=False), nn.Linear(32, 8, bias=False)


class _MoE(nn.Module):
    """A Mixtral-shaped sparse block: a router and 8 experts, 2 active per token."""

    def __init__(self, top_k: int | None) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8, bias=False)
        self.experts = nn.ModuleList(_Expert() for _ in range(8))
        if top_k is not None:
            self.top_k = top_k


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = 1
        self.wg = nn.Linear(8, 8, bias=False)


class _DeepSpeedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(_Expert() for _ in range(8))
        self.num_local_experts = 8


class _DeepSpeedMoE(nn.Module):
    """DeepSpeed's MOELayer shape: a top-k gate (`k`) and an Experts module holding the list."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = _Gate()
        self.experts = _DeepSpeedExperts()


def test_experts_count_by_their_top_k_and_an_unknown_top_k_gives_no_count():
    moe = nn.Sequential(nn.Embedding(100, 8), _MoE(top_k=2))
    got = flops.model_flops(moe)
    assert got is not None and got.moe
    expert = 2 * 8 * 32
    assert got.params == 8 * 8 + 2 * expert  # router + 2 of the 8 experts; no embedding
    assert flops.model_flops(nn.Sequential(_MoE(top_k=None))) is None
    ds = flops.model_flops(_DeepSpeedMoE())
    assert ds is not None and ds.moe and ds.params == 8 * 8 + expert  # top-1 of 8
    hidden = _MoE(top_k=2)
    hidden.num_experts = 8
    hidden.experts = None  # type: ignore[assignment]  # experts out of sight: no count
    assert flops.model_flops(hidden) is None


def _gpt_engine(fake_engine, monkeypatch, device: str, precision: str = "bf16"):
    model = GPT(CFG)
    fake_engine.module = model
    fake_engine.precision = precision
    fake_engine.num_parameters = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(attach, "device_name", lambda _device: device)
    return model


def test_mfu_of_the_small_gpt_on_an_h100_is_the_formula_over_the_table_peak(
    fake_engine, spool_root, monkeypatch
):
    model = _gpt_engine(fake_engine, monkeypatch, H100)
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        for _ in range(3):
            fake_engine.train_step()
            run.log(tokens=8 * CFG.seq_len)
    per_token = 6 * (sum(p.numel() for p in model.parameters()) - 32 * 32) + 12 * 3 * 32 * 32
    steps = _steps(run)
    assert len(steps) == 3
    for s in steps:
        assert s["tokens_per_s"] == pytest.approx(8 * CFG.seq_len / s["step_time_s"])
        assert s["mfu"] == pytest.approx(s["tokens_per_s"] * per_token / 989.5e12, rel=1e-12)


def test_an_unknown_device_has_no_mfu_and_a_hand_peak_overrides_the_table(
    fake_engine, spool_root, monkeypatch
):
    _gpt_engine(fake_engine, monkeypatch, "NVIDIA GeForce RTX 4090")
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        fake_engine.train_step()
        run.log(tokens=256)
    (s,) = _steps(run)
    assert s["tokens_per_s"] > 0 and s["mfu"] is None
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, peak_flops=1e12,
                              flops_per_token=1e6) as run:  # fmt: skip
        fake_engine.train_step()
        run.log(tokens=256)
    (s,) = _steps(run)
    assert s["mfu"] == pytest.approx(s["tokens_per_s"] * 1e6 / 1e12)


def test_an_mfu_above_one_is_refused_and_logged_once_with_its_inputs(
    fake_engine, spool_root, monkeypatch, caplog
):
    _gpt_engine(fake_engine, monkeypatch, H100)
    caplog.set_level(logging.WARNING, logger="zerowatch.agent")
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, peak_flops=1.0) as run:
        for _ in range(3):
            fake_engine.train_step()
            run.log(tokens=256)
    assert [s["mfu"] for s in _steps(run)] == [None, None, None]
    warned = [r.getMessage() for r in caplog.records if "MFU" in r.getMessage()]
    assert len(warned) == 1
    assert "tokens/s" in warned[0] and "peak FLOP/s 1" in warned[0] and H100 in warned[0]


def test_fp32_matmuls_are_priced_at_tf32_only_where_torch_allows_it():
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert flops.matmul_dtype("fp32") == "fp32"
        matmul.allow_tf32 = True
        assert flops.matmul_dtype("fp32") == "tf32"
    finally:
        matmul.allow_tf32 = before
    assert flops.matmul_dtype("bf16") == "bf16"


def test_the_node_comes_from_the_launcher():
    assert launcher_node({"GROUP_RANK": "3", "SLURM_NODEID": "7"}) == 3
    assert launcher_node({"SLURM_NODEID": "7"}) == 7
    assert launcher_node({}) == -1
