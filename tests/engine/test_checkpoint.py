"""Save at step 10, load into a fresh engine, train 10 more: identical to 20 uninterrupted
steps. The consolidated state dict (rank 0's) loads into the plain model and computes the
same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.engine_harness import run_ranks
from support.engine_scenarios import TINY, ds_config, engine_run, make_model, train_engine

import zerowatch
from zerowatch.examples.gpt import GPT

pytestmark = pytest.mark.slow

SCHEDULE = {"type": "WarmupDecayLR",
            "params": {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_max_lr": 1e-2}}  # fmt: skip
CASES = {
    "stage1-fp32-ga2": ds_config(1, ga=2, scheduler=SCHEDULE),
    "stage2-fp16-offload": ds_config(2, precision="fp16", offload_optimizer=True),
    "stage3-bf16-offload-all": ds_config(
        3, precision="bf16", offload_optimizer=True, offload_param=True, scheduler=SCHEDULE
    ),
}


def _resume(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, cfg in CASES.items():
        ga = cfg["gradient_accumulation_steps"]
        whole = engine_run(rank, world, cfg, steps=20).state_dict
        first, *_ = zerowatch.initialize(model=make_model(), config=cfg)
        train_engine(first, TINY, 10, ga, world, rank)
        first.save_checkpoint(str(Path(root) / name))
        torch.manual_seed(1234)  # a differently initialised model: everything must come from disk
        second, *_ = zerowatch.initialize(model=GPT(TINY), config=cfg)
        second.load_checkpoint(str(Path(root) / name))
        steps_after_load = second.global_steps
        train_engine(second, TINY, 10, ga, world, rank, start=10)
        out[name] = {"whole": whole, "resumed": second.consolidated_state_dict(),
                     "steps_after_load": steps_after_load, "steps": second.global_steps}  # fmt: skip
    # Consolidated weights into the plain model: same outputs as the stage-3 engine.
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(3, ga=1))
    train_engine(engine, TINY, 3, 1, world, rank)
    state = engine.consolidated_state_dict()  # rank 0's; {} on rank 1
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    with torch.no_grad():
        got = engine(x)  # a collective at stage 3: every rank runs it
        if rank == 0:
            plain = GPT(TINY)
            plain.load_state_dict(state)
            out["outputs"] = (got, plain(x))
    out["consolidated_elsewhere"] = state if rank else None
    bf16, *_ = zerowatch.initialize(model=make_model(), config=ds_config(3, precision="bf16"))
    written = bf16.save_16bit_model(str(Path(root) / "hf"))
    out["saved_16bit"] = written and torch.load(Path(root) / "hf" / "pytorch_model.bin")
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_resume, 2, str(tmp_path_factory.mktemp("ckpt")), timeout_s=120)


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_equals_uninterrupted_run(case: str, results: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        res = results[rank][case]
        assert res["steps_after_load"] == 10 and res["steps"] == 20
    # Rank 0's consolidated weights hold every rank's parts; rank 1 gets none.
    res = results[0][case]
    assert res["whole"] and res["whole"].keys() == res["resumed"].keys()
    for key, want in res["whole"].items():
        assert torch.equal(res["resumed"][key], want), f"{case}: {key} differs after resume"
    assert results[1][case]["whole"] == {} and results[1][case]["resumed"] == {}


def test_consolidated_state_dict_loads_into_plain_model(results: list[dict[str, Any]]) -> None:
    engine_out, plain_out = results[0]["outputs"]
    torch.testing.assert_close(engine_out, plain_out, rtol=0, atol=1e-6)
    assert results[1]["consolidated_elsewhere"] == {}  # only rank 0 holds the model


def test_load_names_what_is_missing_or_different(tmp_path: Path) -> None:
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(2))
    engine.save_checkpoint(str(tmp_path), tag="t")
    file = tmp_path / "t" / "zero_rank0.pt"
    saved = torch.load(file, weights_only=False)
    # Saved by 4 ranks (resharded on load, tests/engine/test_checkpoint_reshard.py), but
    # three of the parts are not there.
    torch.save({**saved, "world_size": 4}, file)
    with pytest.raises(
        FileNotFoundError, match=r"zero_rank1\.pt does not exist .*saved by 4 ranks"
    ):
        engine.load_checkpoint(str(tmp_path), tag="t")
    torch.save({**saved, "zero_stage": 1}, file)
    with pytest.raises(ValueError, match=r"zero_stage 1 in .* engine has 2"):
        engine.load_checkpoint(str(tmp_path), tag="t")
    torch.save({**saved, "layout": saved["layout"][1:]}, file)
    with pytest.raises(ValueError, match="different model or bucket layout"):
        engine.load_checkpoint(str(tmp_path), tag="t")


def test_save_16bit_model_writes_full_bf16_weights_on_rank_zero(
    results: list[dict[str, Any]],
) -> None:
    saved = results[0]["saved_16bit"]
    assert results[1]["saved_16bit"] is False
    plain = make_model().state_dict()
    assert set(saved) == set(plain)
    for k, v in saved.items():
        assert v.shape == plain[k].shape and v.dtype == torch.bfloat16, k


def _load_with_a_file_missing_on_rank_one(rank: int, world: int, root: str) -> str:
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(2))
    engine.save_checkpoint(root, tag="t")
    engine.comm.barrier()
    if rank == 0:
        (Path(root) / "t" / "zero_rank1.pt").unlink()
    engine.comm.barrier()
    try:
        engine.load_checkpoint(root, tag="t")
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


@pytest.mark.slow
def test_a_rank_that_cannot_load_fails_every_rank_instead_of_leaving_them_waiting(
    tmp_path: Path,
) -> None:
    # Without the agreement rank 0 waits in the next collective for as long as rank 1 lives,
    # then fails with a connection error that does not say why.
    r0, r1 = run_ranks(_load_with_a_file_missing_on_rank_one, 2, str(tmp_path), timeout_s=30)
    assert r1.startswith("FileNotFoundError: load_checkpoint:") and "zero_rank1.pt" in r1
    assert r0.startswith("RuntimeError: load_checkpoint: rank 1 could not load:"), r0
