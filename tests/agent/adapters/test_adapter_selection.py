"""instrument() picks the adapter from the object it is given, and says what it needs."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from zerowatch.agent.adapters import select_adapter
from zerowatch.agent.adapters.fsdp2 import FSDP2Adapter


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    # A group left by an earlier test is that test's leak: fail here rather than skip.
    assert not dist.is_initialized(), "a process group is already initialised in this process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fully_sharded_model_selects_fsdp2_with_its_optimizer(one_rank_group: None) -> None:
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters())
    adapter = select_adapter(model, optimizer=opt)
    assert isinstance(adapter, FSDP2Adapter)
    info = adapter.info()
    assert (info.engine, info.zero_stage, info.param_count) == ("fsdp2", 3, 72)


def test_fully_sharded_model_without_optimizer_names_the_argument(one_rank_group: None) -> None:
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(8, 8))
    with pytest.raises(TypeError, match=r"^optimizer: .*instrument\(fsdp_model, optimizer=opt\)"):
        select_adapter(model)


class _BundledLike:
    """Duck-typed like the bundled engine."""

    zero_stage = 2

    def add_observer(self, obs: Any) -> None: ...

    def remove_observer(self, obs: Any) -> None: ...

    def model_state_bytes(self) -> dict[str, int]:
        return {}


def test_optimizer_given_to_another_engine_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"^optimizer: a zerowatch engine takes no optimizer="):
        select_adapter(_BundledLike(), optimizer=object())


def test_unknown_object_lists_the_supported_engines() -> None:
    with pytest.raises(TypeError, match="supported: deepspeed, fsdp2, ddp, accelerate, zerowatch"):
        select_adapter(torch.nn.Linear(2, 2))


def test_selecting_an_adapter_never_imports_the_training_libraries() -> None:
    code = (
        "import sys; from zerowatch.agent.adapters import select_adapter\n"
        "try:\n    select_adapter(object())\nexcept TypeError:\n    pass\n"
        "for lib in ('deepspeed', 'accelerate', 'transformers', 'lightning'):\n"
        "    assert lib not in sys.modules, lib + ' imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("adapter", ["deepspeed", "fsdp2", "ddp"])
def test_foreign_adapters_never_load_the_bundled_engine(adapter: str) -> None:
    """Instrumenting a DeepSpeed, FSDP2 or DDP job needs the observer interface (engine/hooks.py),
    not the bundled engine: importing zerowatch.engine runs none of it."""
    code = (
        f"import sys, zerowatch.agent.adapters.{adapter}\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('zerowatch.engine.'))\n"
        "assert loaded == ['zerowatch.engine.hooks'], loaded\n"
        "from zerowatch.engine import CollectiveRecord, initialize\n"  # still there on demand
        "assert 'zerowatch.engine.engine' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
