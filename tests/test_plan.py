"""The capacity planner against zerowatch.theory and the ZeRO paper's worked figures, and
`zerowatch plan` as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zerowatch import theory
from zerowatch.cli import app
from zerowatch.plan import (
    PlanError,
    parse_bandwidth,
    parse_bytes,
    parse_count,
    plan,
)
from zerowatch.units import fmt_bytes

GIB = 2**30
GB = 10**9


def by_layout(result, stage: int, offload: str = "none"):  # type: ignore[no-untyped-def]
    return next(r for r in result.rows if r.stage == stage and r.offload == offload)


def test_mixed_precision_adam_holds_16_bytes_per_parameter_under_ddp() -> None:
    psi = 70 * 10**9
    row = by_layout(plan(psi, gpus=8, gpu_memory=80 * GIB, precision="bf16"), 0)
    # 2 bytes of bf16 parameters + 2 of gradients + 12 of optimizer state (fp32 master + m + v)
    assert row.model_states == {
        "params": 2 * psi,
        "grads": 2 * psi,
        "optimizer_states": 8 * psi,
        "master_weights": 4 * psi,
    }
    assert row.model_state_bytes == 16 * psi == 1_120_000_000_000  # 1.12 TB per rank
    assert fmt_bytes(row.model_state_bytes) == "1.02 TiB"  # printed in binary units
    assert not row.fits


@pytest.mark.parametrize(("stage", "formula", "paper_gb"), [
    (0, lambda p, n: 16 * p, 120.0),
    (1, lambda p, n: 4 * p + 12 * p / n, 31.4),
    (2, lambda p, n: 2 * p + 14 * p / n, 16.6),
    (3, lambda p, n: 16 * p / n, 1.9),
])  # fmt: skip
def test_per_rank_model_states_match_the_zero_paper_for_7_5b_on_64_gpus(
    stage, formula, paper_gb
) -> None:  # type: ignore[no-untyped-def]
    psi, n = 7_500_000_000, 64
    row = by_layout(
        plan(psi, gpus=n, gpu_memory=32 * GB, nodes=8, precision="fp16", offload="none"), stage
    )
    assert row.model_state_bytes == formula(psi, n)
    assert round(row.model_state_bytes / GB, 1) == paper_gb


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    ("psi", "gpus", "nodes"), [(1_000_003, 3, 1), (7 * 10**9, 16, 2), (125_000_000, 1, 1)]
)
def test_every_row_agrees_with_theory(precision: str, psi: int, gpus: int, nodes: int) -> None:
    result = plan(
        psi, gpus=gpus, gpu_memory=80 * GIB, nodes=nodes, precision=precision, bandwidth=50 * GB
    )
    assert len(result.rows) == 8
    for row in result.rows:
        states = theory.model_state_bytes(psi, gpus, row.stage, precision=precision,
                                          offload_optimizer=row.offload_optimizer, offload_param=row.offload_param)  # fmt: skip
        assert row.model_states == states.device
        assert row.host_bytes_per_rank == states.host_total
        assert row.host_bytes_per_node == states.host_total * gpus // nodes
        sizes = theory.comm_bytes_per_step(psi, gpus, row.stage, precision=precision)
        assert row.comm_sizes == sizes
        assert row.comm_bytes == theory.comm_traffic_bytes(sizes, gpus)
        assert row.comm_time_s == pytest.approx(row.comm_bytes / (50 * GB))
        assert row.device_bytes == states.device_total + sum(row.buffers.values())
        assert row.headroom_bytes == 80 * GIB - row.device_bytes
        assert row.fits == (row.device_bytes <= 80 * GIB)


def test_communication_is_2_psi_per_rank_for_stages_0_to_2_and_3_psi_for_stage_3() -> None:
    psi, n = 10**9, 8
    result = plan(
        psi, gpus=n, gpu_memory=80 * GIB, precision="bf16", offload="none", bandwidth=100 * GB
    )
    sent = {r.stage: r.comm_bytes for r in result.rows}
    # ring collectives: a rank sends (n-1)/n of each 2-byte element it moves
    assert sent == {0: round(2 * psi * 2 * 7 / 8), 1: round(2 * psi * 2 * 7 / 8),
                    2: round(2 * psi * 2 * 7 / 8), 3: round(3 * psi * 2 * 7 / 8)}  # fmt: skip
    assert by_layout(result, 3).comm_time_s == pytest.approx(3 * psi * 2 * 7 / 8 / (100 * GB))


def test_buffers_follow_the_config_and_stage() -> None:
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1e6, "allgather_bucket_size": 2e6,
                                 "stage3_max_live_parameters": 3e6, "stage3_prefetch_bucket_size": 1e6, "overlap_comm": True}}  # fmt: skip
    result = plan(10**9, gpus=4, gpu_memory=80 * GIB, precision="bf16", config=cfg)
    assert by_layout(result, 0).buffers == {
        "reduce_bucket": 2 * 2 * 10**6,
        "allgather_bucket": 0,
        "live_params": 0,
    }
    assert by_layout(result, 2).buffers == {
        "reduce_bucket": 2 * 2 * 10**6,
        "allgather_bucket": 2 * 2 * 10**6,
        "live_params": 0,
    }
    assert by_layout(result, 3).buffers == {
        "reduce_bucket": 2 * 2 * 10**6,
        "allgather_bucket": 0,
        "live_params": 2 * 3 * 10**6,
    }
    # never more than the model itself, and nothing to reduce on one rank
    small = plan(1000, gpus=2, gpu_memory=GIB)
    assert by_layout(small, 3).buffers["live_params"] == 2 * 1000
    assert all(sum(r.buffers.values()) == 0 for r in plan(1000, gpus=1, gpu_memory=GIB).rows)


@pytest.mark.parametrize(("psi", "gpus", "memory", "offload", "stage", "where"), [
    (125_000_000, 8, 80 * GIB, "both", 0, "none"),         # small: plain data parallel
    (7_500_000_000, 64, 40 * GB, "both", 1, "none"),       # paper model: stage 1 is enough at 40 GB
    (7_500_000_000, 64, 32 * GB, "both", 2, "none"),       # ... but not at 32 GB
    (13 * 10**9, 8, 40 * GIB, "both", 3, "none"),          # stage 3 before any offload
    (70 * 10**9, 8, 80 * GIB, "both", 3, "optimizer"),     # 70B on one 8x80GiB node: ZeRO-3 + CPU offload
    (70 * 10**9, 8, 32 * GIB, "both", 3, "optimizer+params"),
    (7 * 10**9, 8, 80 * GIB, "cpu", 1, "optimizer"),       # only offload rows compared
])  # fmt: skip
def test_recommendation_is_the_cheapest_layout_that_fits(
    psi, gpus, memory, offload, stage, where
) -> None:  # type: ignore[no-untyped-def]
    result = plan(psi, gpus=gpus, gpu_memory=memory, offload=offload, precision="bf16")
    rec = result.recommended
    assert rec is not None and (rec.stage, rec.offload) == (stage, where)
    assert rec.fits
    assert all(not r.fits for r in result.rows[: result.rows.index(rec)])


def test_when_nothing_fits_it_says_how_many_gpus_would() -> None:
    result = plan(70 * 10**9, gpus=8, gpu_memory=80 * GIB, offload="none", precision="bf16")
    assert result.recommended is None and result.min_gpus is not None
    more = plan(70 * 10**9, gpus=result.min_gpus, gpu_memory=80 * GIB, offload="none")
    fewer = plan(70 * 10**9, gpus=result.min_gpus - 1, gpu_memory=80 * GIB, offload="none")
    assert by_layout(more, 3).fits and not by_layout(fewer, 3).fits


def test_host_memory_limits_offload_layouts() -> None:
    psi = 70 * 10**9
    roomy = plan(psi, gpus=8, gpu_memory=80 * GIB, host_memory=2 * 10**12)
    tight = plan(psi, gpus=8, gpu_memory=80 * GIB, host_memory=10**12)
    assert (
        by_layout(roomy, 3, "optimizer").host_bytes_per_node == 16 * psi
    )  # 16 bytes/param on the host
    assert roomy.recommended is not None and roomy.recommended.offload == "optimizer"
    assert tight.recommended is None


def test_a_deepspeed_config_gets_its_own_row(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                              "reduce_bucket_size": "auto", "stage3_max_live_parameters": 2e9},
        "gradient_accumulation_steps": 2,
    }))  # fmt: skip
    result = plan(70 * 10**9, gpus=8, gpu_memory=80 * GIB, config=path, precision="bf16")
    row = result.config_row
    assert row is not None and (row.stage, row.offload) == (3, "optimizer+params")
    assert row.buffers["live_params"] == 2 * 2 * 10**9
    assert result.inputs.gradient_accumulation_steps == 2
    assert row.comm_sizes == theory.comm_bytes_per_step(
        70 * 10**9, 8, 3, precision="bf16", gradient_accumulation_steps=2
    )
    assert any("reduce_bucket_size" in n for n in result.notes)
    assert json.loads(json.dumps(result.to_dict()))["config_row"]["offload"] == "optimizer+params"


def test_the_config_precision_wins_over_the_option() -> None:
    result = plan(
        10**9, gpus=2, gpu_memory=80 * GIB, precision="bf16", config={"fp16": {"enabled": True}}
    )
    assert result.inputs.precision == "fp16"
    fp32 = plan(10**9, gpus=2, gpu_memory=80 * GIB, precision="bf16", config={})
    assert (
        fp32.inputs.precision == "fp32" and by_layout(fp32, 0).model_states["params"] == 4 * 10**9
    )


@pytest.mark.parametrize(("text", "value"), [
    ("70e9", 70 * 10**9), ("7B", 7 * 10**9), ("7b", 7 * 10**9), ("1.5T", 1_500_000_000_000),
    ("350M", 350_000_000), ("125000000", 125_000_000), (" 13 B ", 13 * 10**9),
])  # fmt: skip
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize(("text", "value"), [
    ("80GiB", 80 * GIB), ("80GB", 80 * GB), ("80gib", 80 * GIB), ("512MiB", 512 * 2**20), ("1.5TB", 1.5e12), ("40 GiB", 40 * GIB),
])  # fmt: skip
def test_parse_bytes(text: str, value: float) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(("text", "value"), [
    ("100GB/s", 100e9), ("400Gbit/s", 50e9), ("400Gb/s", 50e9), ("400Gbps", 50e9), ("25GiB/s", 25 * GIB), ("900 GB/s", 900e9),
])  # fmt: skip
def test_parse_bandwidth(text: str, value: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize(("func", "text"), [
    (parse_count, "7X"), (parse_count, "seven"), (parse_count, "0"), (parse_count, ""),
    (parse_bytes, "80"), (parse_bytes, "80G"), (parse_bytes, "eighty GiB"), (parse_bytes, "0GB"),
    (parse_bandwidth, "100"), (parse_bandwidth, "100GB"), (parse_bandwidth, "fast"),
])  # fmt: skip
def test_bad_numbers_are_plan_errors(func, text: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError, match=r"^--"):
        func(text)


runner = CliRunner()


def test_cli_plan_recommends_zero3_with_cpu_offload_for_70b_on_8x80gib() -> None:
    result = runner.invoke(
        app,
        [
            "plan",
            "--params",
            "70e9",
            "--gpus",
            "8",
            "--gpu-memory",
            "80GiB",
            "--bandwidth",
            "100GB/s",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Recommended: stage 3, optimizer offload to CPU" in result.output
    assert "1.02 TiB" in result.output  # the DDP row: 1.12e12 bytes
    for stage in "0123":
        assert f"\n  {stage} " in result.output


def test_cli_plan_json_and_config(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                "bf16": {"enabled": True},
            }
        )
    )
    result = runner.invoke(
        app,
        [
            "plan",
            "--params",
            "7B",
            "--gpus",
            "4",
            "--gpu-memory",
            "24GB",
            "--config",
            str(path),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["recommended"]["stage"], data["recommended"]["offload"]) == (2, "optimizer")
    assert (data["config_row"]["stage"], data["config_row"]["offload"]) == (2, "optimizer")
    table = runner.invoke(
        app,
        ["plan", "--params", "7B", "--gpus", "4", "--gpu-memory", "24GB", "--config", str(path)],
    )
    assert (
        table.exit_code == 0
        and f"Your config ({path}): stage 2, optimizer offload to CPU" in table.output
    )


@pytest.mark.parametrize(("args", "message"), [
    (["--params", "7X"], "error: --params: expected a parameter count"),
    (["--params", "7B", "--gpu-memory", "80"], "error: --gpu-memory: expected a size with a unit"),
    (["--params", "7B", "--bandwidth", "fast"], "error: --bandwidth: expected a rate"),
    (["--params", "7B", "--offload", "disk"], "error: --offload: expected none, cpu or both"),
    (["--params", "7B", "--precision", "fp8"], "error: --precision: expected fp32, bf16 or fp16"),
    (["--params", "7B", "--gpus", "0"], "error: --gpus: expected >= 1"),
    (["--params", "7B", "--gpus", "8", "--nodes", "3"], "error: --nodes: 8 GPUs do not split evenly over 3 nodes"),
    (["--params", "7B", "--config", "/nonexistent.json"], "error: --config: file not found"),
])  # fmt: skip
def test_cli_plan_bad_input_exits_2_naming_the_option(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_cli_plan_config_mistake_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    )
    result = runner.invoke(app, ["plan", "--params", "7B", "--config", str(path)])
    assert result.exit_code == 2
    assert (
        'error: zero_optimization.offload_param.device: expected "cpu" or "none", got "nvme"'
        in result.output
    )
    assert "Traceback" not in result.output


def test_cli_plan_host_memory_names_the_host_as_the_limit() -> None:
    result = runner.invoke(
        app, ["plan", "--params", "70e9", "--gpus", "8", "--gpu-memory", "80GiB",
              "--host-memory", "512GiB"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Nothing fits" in result.output
    assert "host memory per node" in result.output
    roomy = runner.invoke(
        app, ["plan", "--params", "70e9", "--gpus", "8", "--gpu-memory", "80GiB",
              "--host-memory", "2TiB"],
    )  # fmt: skip
    assert "Recommended: " in roomy.output
