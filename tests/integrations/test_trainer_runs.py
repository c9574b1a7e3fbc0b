"""The Hugging Face Trainer, Lightning and Accelerate, for real, on two gloo ranks under
torchrun, each watched by zerowatch's integration, against a live server.

One torchrun launch trains every variant in turn (tests/integrations/variants.py runs the
example scripts of docs/integrations.md, zerowatch/examples/integrations/), each as its own
run: importing the libraries costs more than training the tiny GPT-2 for 10 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.foreign_jobs import assert_every_step_stored, server_run, server_series
from support.live_server import LiveServer
from support.ports import free_port

# DeepSpeed builds its CPU ops on first use: conftest builds them before the tests.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("deepspeed_ops")]

STEPS = 10
HF = ["hf-ddp", "hf-fsdp2", "hf-deepspeed-zero2", "hf-deepspeed-zero3"]
LIGHTNING = ["lightning-ddp", "lightning-fsdp", "lightning-deepspeed"]
ACCELERATE = ["accelerate-ddp", "accelerate-fsdp2", "accelerate-deepspeed-zero2"]
VARIANTS = HF + LIGHTNING + ACCELERATE
#: What each variant's run is recorded as: (engine, ZeRO stage).
ENGINE = {
    "hf-ddp": ("ddp", 0), "hf-fsdp2": ("fsdp2", 3), "hf-deepspeed-zero2": ("deepspeed", 2),
    "hf-deepspeed-zero3": ("deepspeed", 3), "lightning-ddp": ("ddp", 0),
    "lightning-fsdp": ("fsdp1", 3), "lightning-deepspeed": ("deepspeed", 2),
    "accelerate-ddp": ("ddp", 0), "accelerate-fsdp2": ("fsdp2", 3),
    "accelerate-deepspeed-zero2": ("deepspeed", 2),
}  # fmt: skip
#: Variants that cannot run on CPU: what the library said (found in the variant's error or
#: skip), and where it decides (installed transformers 5.24, accelerate 1.15, lightning 2.6).
CPU_REFUSED = {
    "lightning-deepspeed": (
        "The DeepSpeed strategy is only supported on CUDA GPUs but `CPUAccelerator` is used.",
        "lightning/pytorch/strategies/deepspeed.py:342-346, DeepSpeedStrategy.setup_environment",
    ),
    "lightning-fsdp": (
        "The strategy `fsdp` requires a GPU accelerator, but received `accelerator='cpu'`.",
        "lightning/pytorch/trainer/connectors/accelerator_connector.py:431-439, "
        "_check_strategy_and_fallback: FSDPStrategy with any accelerator but cuda/gpu",
    ),
    # Accelerate applies an FSDP plugin only to GPU-like distributed types
    # (accelerate/state.py:986-1015: MULTI_GPU, MULTI_NPU, MULTI_XPU, ...). Without a GPU
    # its state is NO (not distributed) unless use_cpu=True makes it MULTI_CPU, which is not
    # among them either: the Trainer refuses the first, and the second trains plain DDP
    # with the FSDP config silently dropped (trainer.py:875, is_fsdp_enabled False).
    "hf-fsdp2": (
        "Using fsdp only works in distributed training.",
        "transformers/trainer.py:477-478: args.parallel_mode is not DISTRIBUTED, since "
        "without a GPU Accelerate's state is DistributedType.NO (accelerate/state.py:815)",
    ),
    "accelerate-fsdp2": (
        "Accelerate chose distributed_type=NO",
        "accelerate/state.py:986-1015 applies the FSDP plugin to GPU-like distributed types "
        "only; with no GPU the state is NO (state.py:815), or MULTI_CPU with cpu=True: "
        "prepare returns the model unsharded (or in DDP), without an error",
    ),
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with LiveServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def job(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("integrations")
    env = {**os.environ, "ZEROWATCH_SERVER": server.url, "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(Path(__file__).with_name("variants.py")), str(out), *VARIANTS]  # fmt: skip
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]


def _variant(job: list[dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    """Both ranks' results for `variant`; skips a variant the library refuses on CPU."""
    results = [rank[variant] for rank in job]
    said = [r.get("error") or r.get("skipped") for r in results if "error" in r or "skipped" in r]
    if said and variant in CPU_REFUSED and all(CPU_REFUSED[variant][0] in s for s in said):
        words, where = CPU_REFUSED[variant]
        pytest.skip(f"{variant} cannot run on CPU: {words!r} ({where})")
    assert not said, said[0]
    return results


def _run_id(results: list[dict[str, Any]]) -> str:
    ids = {r["run_id"] for r in results}
    assert len(ids) == 1, f"ranks disagree on the run id: {ids}"
    return str(ids.pop())


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_step_of_every_rank_is_stored_once(
    job: list[dict[str, Any]], server: LiveServer, variant: str
) -> None:
    results = _variant(job, variant)
    run_id = _run_id(results)
    assert [r["status"] for r in results] == ["finished", "finished"]
    assert_every_step_stored(server, run_id, STEPS)
    run = server_run(server.api, run_id)
    assert (run["engine"], run["zero_stage"], run["world_size"]) == (*ENGINE[variant], 2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_stored_loss_and_learning_rate_are_what_the_trainer_logged(
    job: list[dict[str, Any]], server: LiveServer, variant: str
) -> None:
    results = _variant(job, variant)
    run_id = _run_id(results)
    # The Hugging Face Trainer counts steps from 1, zerowatch (like Lightning) from 0.
    first = 1 if variant.startswith("hf-") else 0
    for metric in ("loss", "lr"):
        stored = server_series(server.api, run_id, metric, STEPS)
        for rank, result in enumerate(results):
            logged = {e["step"] - first: e[metric] for e in result["logged"]}
            assert sorted(logged) == list(range(STEPS)), f"rank {rank} logged {sorted(logged)}"
            assert stored[rank] == [logged[s] for s in range(STEPS)], f"rank {rank} {metric}"


@pytest.mark.parametrize("variant", HF)
def test_hf_grad_norm_is_what_the_trainer_logged(
    job: list[dict[str, Any]], server: LiveServer, variant: str
) -> None:
    results = _variant(job, variant)
    stored = server_series(server.api, _run_id(results), "grad_norm", STEPS)
    for rank, result in enumerate(results):
        logged = [e["grad_norm"] for e in sorted(result["logged"], key=lambda e: e["step"])]
        assert stored[rank] == logged, f"rank {rank}"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if ENGINE[v][0] == "ddp"])
def test_ddp_gradient_all_reduce_is_seen_through_the_communication_hook(
    job: list[dict[str, Any]], server: LiveServer, variant: str
) -> None:
    """Every step all-reduces each fp32 gradient once (DDP's buckets, through the hook the
    adapter registers); a loss averaged for logging adds a few bytes at most."""
    results = _variant(job, variant)
    run_id = _run_id(results)
    grads = 4 * server_run(server.api, run_id)["param_count"]
    stored = server_series(server.api, run_id, "collective.all_reduce.bytes", STEPS)
    for rank in (0, 1):
        assert all(grads <= b <= grads + 64 for b in stored[rank]), (rank, grads, stored[rank])


def test_importing_zerowatch_imports_no_training_library() -> None:
    code = (
        "import sys, zerowatch, zerowatch.integrations, zerowatch.agent\n"
        "zerowatch.instrument; zerowatch.initialize\n"
        "for lib in ('transformers', 'accelerate', 'lightning', 'deepspeed', 'torch'):\n"
        "    assert lib not in sys.modules, lib + ' imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
