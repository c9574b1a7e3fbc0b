"""zerowatch.theory against the ZeRO paper's formulas (Rajbhandari et al., 2019).

Ψ parameters, N ranks, mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter
(fp16/bf16 parameters and gradients; fp32 master weights, momentum and variance):
stage 0 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N. Communication per
rank and step: 2Ψ for stages 0-2, 3Ψ for stage 3.
"""

from __future__ import annotations

import math

import pytest

from zerowatch import theory

PSI, N = 7_500_000_000, 64


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize(("stage", "expected"), [
    (0, 16 * PSI),
    (1, 4 * PSI + 12 * PSI // N),
    (2, 2 * PSI + 14 * PSI // N),
    (3, 16 * PSI // N),
])  # fmt: skip
def test_mixed_precision_stages_follow_the_paper(precision: str, stage: int, expected: int) -> None:
    assert PSI % N == 0
    assert theory.model_state_bytes(PSI, N, stage, precision=precision).total == expected


def test_paper_figure_7_5b_on_64_gpus() -> None:
    gb = [theory.model_state_bytes(PSI, N, s, precision="fp16").total / 1e9 for s in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_mixed_precision_splits_2_2_12_by_kind() -> None:
    b = theory.model_state_bytes(100, 4, 0, precision="bf16")
    assert b.device == {"params": 200, "grads": 200, "optimizer_states": 800, "master_weights": 400}
    assert b.host_total == 0


@pytest.mark.parametrize(("stage", "expected"), [
    (0, {"params": 4 * PSI, "grads": 4 * PSI, "optimizer_states": 8 * PSI, "master_weights": 0}),
    (1, {"params": 4 * PSI, "grads": 4 * PSI, "optimizer_states": 8 * PSI // N, "master_weights": 0}),
    (2, {"params": 4 * PSI, "grads": 4 * PSI // N, "optimizer_states": 8 * PSI // N, "master_weights": 0}),
    (3, {"params": 4 * PSI // N, "grads": 4 * PSI // N, "optimizer_states": 8 * PSI // N, "master_weights": 0}),
])  # fmt: skip
def test_fp32_parameters_are_their_own_master_weights(stage: int, expected: dict[str, int]) -> None:
    b = theory.model_state_bytes(PSI, N, stage, precision="fp32")
    assert b.device == expected
    assert b.total == sum(expected.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_rank_holds_everything_at_every_stage(precision: str) -> None:
    totals = {theory.model_state_bytes(1000, 1, s, precision=precision).total for s in range(4)}
    assert totals == {16 * 1000}
    assert theory.comm_bytes_per_step(1000, 1, 3, precision=precision) == {}


def test_uneven_division_pads_the_last_shard() -> None:
    psi, n = 1001, 4  # ceil(1001 / 4) = 251 elements per shard
    assert theory.shard(psi, n) == 251
    s1 = theory.model_state_bytes(psi, n, 1, precision="bf16").device
    assert s1 == {
        "params": 2 * psi,
        "grads": 2 * psi,
        "optimizer_states": 8 * 251,
        "master_weights": 4 * 251,
    }
    s3 = theory.model_state_bytes(psi, n, 3, precision="bf16")
    assert s3.total == 16 * 251
    assert s3.total * n >= 16 * psi and s3.total * n - 16 * psi < 16 * n


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_offload_moves_states_master_and_fp32_grad_shard_to_the_host(stage: int) -> None:
    psi, n = 1200, 4
    part = psi // n
    on_device = theory.model_state_bytes(psi, n, stage, precision="bf16")
    off = theory.model_state_bytes(psi, n, stage, precision="bf16", offload_optimizer=True)
    assert off.device["optimizer_states"] == 0 and off.device["master_weights"] == 0
    assert off.device["params"] == on_device.device["params"]
    assert off.device["grads"] == on_device.device["grads"]
    assert off.host == {
        "params": 0,
        "grads": 4 * part,
        "optimizer_states": 8 * part,
        "master_weights": 4 * part,
    }


def test_optimizer_offload_does_nothing_at_stage_0() -> None:
    assert theory.model_state_bytes(1000, 4, 0, offload_optimizer=True).host_total == 0


def test_parameter_offload_keeps_the_shard_on_the_host_at_stage_3_only() -> None:
    psi, n = 1200, 4
    b = theory.model_state_bytes(
        psi, n, 3, precision="bf16", offload_optimizer=True, offload_param=True
    )
    assert b.device == {
        "params": 0,
        "grads": 2 * psi // n,
        "optimizer_states": 0,
        "master_weights": 0,
    }
    assert b.host["params"] == 2 * psi // n
    assert b.host_total == (2 + 4 + 8 + 4) * psi // n
    assert theory.model_state_bytes(psi, n, 2, offload_param=True).host_total == 0


def test_persistent_parameters_stay_whole_at_stage_3() -> None:
    psi, n, pers = 10_000, 4, 1000
    b = theory.model_state_bytes(psi, n, 3, precision="bf16", persistent_params=pers)
    assert b.device["params"] == 2 * ((psi - pers) // n + pers)
    sizes = theory.comm_bytes_per_step(psi, n, 3, precision="bf16", persistent_params=pers)
    assert sizes == {
        "all_gather": 2 * 2 * (psi - pers),
        "reduce_scatter": 2 * (psi - pers),
        "all_reduce": 2 * pers,
    }


def test_flat_form_prefixes_host_kinds() -> None:
    b = theory.model_state_bytes(1200, 4, 2, precision="bf16", offload_optimizer=True)
    flat = b.flat()
    assert flat["host_optimizer_states"] == 8 * 300 and "host_params" not in flat
    assert flat["params"] == 2 * 1200


@pytest.mark.parametrize(("stage", "elements"), [(0, 2), (1, 2), (2, 2), (3, 3)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [2, 8, 64])
def test_bytes_a_rank_sends_are_2_psi_or_3_psi(
    stage: int, elements: int, precision: str, n: int
) -> None:
    psi = 10**6
    p = theory.PARAM_BYTES[precision]
    sizes = theory.comm_bytes_per_step(psi, n, stage, precision=precision)
    # ring collectives: each rank sends (n-1)/n of every element it all-gathers or
    # reduce-scatters; an all-reduce is one of each
    assert theory.comm_traffic_bytes(sizes, n) == round(elements * psi * p * (n - 1) / n)
    assert theory.paper_comm_volume(psi, stage) == elements * psi


def test_collective_sizes_by_stage() -> None:
    psi, p = 1000, 2
    assert theory.comm_bytes_per_step(psi, 4, 0, precision="bf16") == {"all_reduce": p * psi}
    assert theory.comm_bytes_per_step(psi, 4, 1, precision="bf16") == {
        "reduce_scatter": p * psi,
        "all_gather": p * psi,
    }
    assert theory.comm_bytes_per_step(psi, 4, 2, precision="bf16") == {
        "reduce_scatter": p * psi,
        "all_gather": p * psi,
    }
    assert theory.comm_bytes_per_step(psi, 4, 3, precision="bf16") == {
        "all_gather": 2 * p * psi,
        "reduce_scatter": p * psi,
    }


def test_gradient_accumulation_multiplies_per_micro_batch_collectives_only() -> None:
    psi, ga = 1000, 4
    s1 = theory.comm_bytes_per_step(psi, 4, 1, precision="bf16", gradient_accumulation_steps=ga)
    s2 = theory.comm_bytes_per_step(psi, 4, 2, precision="bf16", gradient_accumulation_steps=ga)
    s3 = theory.comm_bytes_per_step(psi, 4, 3, precision="bf16", gradient_accumulation_steps=ga)
    assert s1 == {"reduce_scatter": 2 * psi, "all_gather": 2 * psi}  # reduced once, on the boundary
    assert s2 == {"reduce_scatter": ga * 2 * psi, "all_gather": 2 * psi}
    assert s3 == {"all_gather": ga * 2 * 2 * psi, "reduce_scatter": ga * 2 * psi}


@pytest.mark.parametrize(("bad", "match"), [
    ({"stage": 4}, "^stage: expected 0, 1, 2 or 3"),
    ({"precision": "fp8"}, "^precision: expected one of"),
])  # fmt: skip
def test_bad_arguments_name_themselves(bad: dict[str, object], match: str) -> None:
    kwargs: dict[str, object] = {"stage": 1, "precision": "bf16", **bad}
    with pytest.raises(ValueError, match=match):
        theory.model_state_bytes(100, 2, **kwargs)  # type: ignore[arg-type]


def test_seventy_billion_needs_1_12_tb_per_rank_under_ddp() -> None:
    total = theory.model_state_bytes(70 * 10**9, 8, 0, precision="bf16").total
    assert math.isclose(total, 1.12e12)
