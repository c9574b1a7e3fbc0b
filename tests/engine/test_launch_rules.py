"""Where a rank trains and how it joins the job, as torchrun, SLURM and Open MPI users expect.

One process plays rank r of a job of 8, 64 or 4,096 ranks through torch's fake process
group; `torch.cuda` is patched to show a node of 8 GPUs (or 1 per task under SLURM). A group
"made with backend B" is the fake group with the backend and backend config torch itself
records for B on a CUDA machine (`BackendConfig`), so the engine sees what it would see.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from zerowatch.engine import comm, launch
from zerowatch.engine.engine import pick_device

WORLDS = [8, 64, 4096]
GPUS_PER_NODE = 8


@dataclass
class FakeCuda:
    """What the patched `torch.cuda` answers, and the devices the code asked for."""

    count: int = GPUS_PER_NODE
    current: int = 0
    set_to: list[int] = field(default_factory=list)

    def set_device(self, device: Any) -> None:
        index = device.index if isinstance(device, torch.device) else int(device)
        self.set_to.append(index)
        self.current = index


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: fake.count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    return fake


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher variable of the machine running the tests leaks into them."""
    names = [n for n in os.environ if n.startswith(("SLURM_", "OMPI_"))]
    for name in [*names, *launch.TORCHRUN_VARIABLES]:
        monkeypatch.setenv(name, "")  # so that undo also removes what the code under test set
        monkeypatch.delenv(name)
    launch._reset_once()


@pytest.fixture
def group() -> Iterator[Callable[..., None]]:
    """`group(world, rank, backend)`: join a fake job as if `init_process_group(backend)` had
    run on a CUDA machine; destroyed after the test."""

    def make(world: int, rank: int, backend: str | None) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        name = c10d.Backend(backend or "undefined")
        saved = torch._C._get_accelerator
        torch._C._get_accelerator = lambda: torch.device("cuda")  # no-backend default: CUDA's
        try:
            config = str(c10d.BackendConfig(name))
        finally:
            torch._C._get_accelerator = saved
        pg = dist.group.WORLD
        c10d._world.pg_map[pg] = (str(name), c10d._world.pg_map[pg][1])
        c10d._world.pg_backend_config[pg] = config

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def torchrun_env(mp: pytest.MonkeyPatch, world: int, rank: int) -> None:
    for k, v in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank % GPUS_PER_NODE,
                 "LOCAL_WORLD_SIZE": GPUS_PER_NODE, "MASTER_ADDR": "node0",
                 "MASTER_PORT": 29511}.items():  # fmt: skip
        mp.setenv(k, str(v))


def slurm_env(mp: pytest.MonkeyPatch, world: int, rank: int) -> None:
    """`srun --ntasks-per-node=8` over world/8 nodes: this task is `rank`."""
    nodes = world // GPUS_PER_NODE
    for k, v in {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": rank,
                 "SLURM_NTASKS": world, "SLURM_STEP_NUM_TASKS": world,
                 "SLURM_LOCALID": rank % GPUS_PER_NODE, "SLURM_NODEID": rank // GPUS_PER_NODE,
                 "SLURM_STEP_TASKS_PER_NODE": f"{GPUS_PER_NODE}(x{nodes})",
                 "SLURM_STEP_NODELIST": f"gpu[{0:04d}-{nodes - 1:04d}]",
                 "SLURM_JOB_NODELIST": f"gpu[{0:04d}-{nodes - 1:04d}],login1",
                 "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.9"}.items():  # fmt: skip
        mp.setenv(k, str(v))


def openmpi_env(mp: pytest.MonkeyPatch, world: int, rank: int) -> None:
    for k, v in {"OMPI_COMM_WORLD_RANK": rank, "OMPI_COMM_WORLD_SIZE": world,
                 "OMPI_COMM_WORLD_LOCAL_RANK": rank % GPUS_PER_NODE,
                 "OMPI_COMM_WORLD_LOCAL_SIZE": GPUS_PER_NODE,
                 "MASTER_ADDR": "node0"}.items():  # fmt: skip
        mp.setenv(k, str(v))


# -- the device ------------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", ["nccl", None, "cpu:gloo,cuda:nccl", "cpu:fake,cuda:fake"])
def test_a_group_that_carries_cuda_trains_on_the_local_rank_gpu(
    backend: str | None, world: int, cuda: FakeCuda, group: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    rank = world - 3
    torchrun_env(monkeypatch, world, rank)
    group(world, rank, backend)
    assert pick_device() == torch.device("cuda", rank % GPUS_PER_NODE)
    assert cuda.set_to == [rank % GPUS_PER_NODE]


@pytest.mark.parametrize("world", WORLDS)
def test_a_gloo_group_on_a_cuda_machine_trains_on_the_cpu_and_says_so_once(
    world: int, cuda: FakeCuda, group: Callable[..., None], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    torchrun_env(monkeypatch, world, 1)
    group(world, 1, "gloo")
    with caplog.at_level(logging.INFO, logger="zerowatch.engine"):
        assert pick_device() == torch.device("cpu")
        assert pick_device() == torch.device("cpu")
    said = [r.getMessage() for r in caplog.records if "gloo" in r.getMessage()]
    assert len(said) == 1 and "CPU" in said[0], said
    assert cuda.set_to == []


@pytest.mark.parametrize("world", WORLDS)
def test_srun_with_one_gpu_per_task_uses_that_gpu(
    world: int, cuda: FakeCuda, group: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda.count = 1  # SLURM's gres binding: each task sees its own GPU as cuda:0
    rank = world - 2
    slurm_env(monkeypatch, world, rank)
    group(world, rank, "cpu:gloo,cuda:nccl")
    assert pick_device() == torch.device("cuda", 0)
    assert cuda.set_to == [0]


@pytest.mark.parametrize("world", WORLDS)
def test_mpirun_places_each_rank_on_its_local_gpu(
    world: int, cuda: FakeCuda, group: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    rank = world - 1
    openmpi_env(monkeypatch, world, rank)
    group(world, rank, "nccl")
    assert pick_device() == torch.device("cuda", rank % GPUS_PER_NODE)
    assert cuda.set_to == [rank % GPUS_PER_NODE]


def test_a_current_device_elsewhere_warns_and_follows_local_rank(
    cuda: FakeCuda, group: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    torchrun_env(monkeypatch, 64, 13)
    group(64, 13, "nccl")
    cuda.current = 2
    with pytest.warns(UserWarning, match=r"cuda:2.*cuda:5"):
        assert pick_device() == torch.device("cuda", 5)
    assert cuda.set_to == [5]


def test_a_spawned_group_without_launcher_variables_keeps_the_scripts_device(
    cuda: FakeCuda, group: Callable[..., None]
) -> None:
    """mp.spawn with a file:// rendezvous: no variable says which GPU is local, so the
    device the script set stays."""
    group(8, 3, None)
    cuda.current = 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pick_device() == torch.device("cuda", 3)
    assert cuda.set_to == []


# -- where this process sits -----------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    ("env", "launcher", "master"),
    [
        (torchrun_env, "torchrun", "node0"),
        (slurm_env, "slurm", "gpu0000"),
        (openmpi_env, "openmpi", "node0"),
    ],
)
def test_each_launcher_places_the_process(
    env: Callable[..., None], launcher: str, master: str, world: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    rank = world - 5
    env(monkeypatch, world, rank)
    place = launch.placement()
    assert (place.launcher, place.rank, place.world_size) == (launcher, rank, world)
    assert (place.local_rank, place.local_world_size) == (rank % 8, 8)
    assert place.master_addr == master
    assert place.master_port == (29511 if launcher == "torchrun" else 29500)


def test_no_launcher_is_one_rank() -> None:
    place = launch.placement()
    assert (place.launcher, place.rank, place.world_size, place.local_rank) == ("none", 0, 1, 0)


def test_slurm_tasks_per_node_of_uneven_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm_env(monkeypatch, 64, 0)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8(x2),3,5(x3)")
    for node, tasks in [(0, 8), (1, 8), (2, 3), (3, 5), (5, 5)]:
        monkeypatch.setenv("SLURM_NODEID", str(node))
        assert launch.placement().local_world_size == tasks


def test_a_batch_script_without_srun_is_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch runs the script as task 0 of the allocation (SLURM_PROCID=0, SLURM_NTASKS=8)
    but starts no other task: only an srun step (SLURM_STEP_ID) places ranks."""
    slurm_env(monkeypatch, 8, 0)
    for name in ["SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE",
                 "SLURM_STEP_NODELIST"]:  # fmt: skip
        monkeypatch.delenv(name)
    assert launch.placement().world_size == 1


@pytest.mark.parametrize(
    ("env", "missing"),
    [({"RANK": "3"}, "WORLD_SIZE"),
     ({"WORLD_SIZE": "8"}, "RANK"),
     ({"RANK": "3", "WORLD_SIZE": "8"}, "LOCAL_RANK"),
     ({"RANK": "x", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, "RANK"),
     ({"OMPI_COMM_WORLD_RANK": "3"}, "OMPI_COMM_WORLD_SIZE"),
     ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8"}, "OMPI_COMM_WORLD_LOCAL_RANK"),
     ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "3"}, "SLURM_NTASKS"),
     ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, "SLURM_LOCALID")],
)  # fmt: skip
def test_a_partial_environment_names_the_missing_variable(
    env: dict[str, str], missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(launch.LaunchError, match=rf"\b{missing}\b"):
        launch.placement()


@pytest.mark.parametrize(
    ("env", "drop", "set_", "missing"),
    [(torchrun_env, "MASTER_ADDR", {}, "MASTER_ADDR"),
     (torchrun_env, "MASTER_PORT", {}, "MASTER_PORT"),
     (openmpi_env, "MASTER_ADDR", {}, "MASTER_ADDR"),
     (slurm_env, "", {"SLURM_STEP_NODELIST": "r[1-2]-n[01-04]"}, "MASTER_ADDR")],
)  # fmt: skip
def test_a_rank_without_a_rendezvous_address_names_the_missing_variable(
    env: Callable[..., None], drop: str, set_: dict[str, str], missing: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    env(monkeypatch, 16, 9)
    if drop:
        monkeypatch.delenv(drop)
    for k, v in set_.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("joined"))
    with pytest.raises(launch.LaunchError, match=rf"\b{missing}\b"):
        comm.init_distributed()


# -- joining the job -------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("env", [torchrun_env, slurm_env, openmpi_env])
def test_init_distributed_joins_with_the_launchers_rank_and_both_backends(
    env: Callable[..., None], world: int, cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    rank = world - 7
    env(monkeypatch, world, rank)
    if env is slurm_env:
        cuda.count = 1
    joined: dict[str, Any] = {}

    def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
        joined.update(kwargs, backend=backend, set_to=list(cuda.set_to),
                      env={k: os.environ.get(k) for k in ["MASTER_ADDR", "MASTER_PORT"]})  # fmt: skip

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    comm.init_distributed()
    assert joined["backend"] == "cpu:gloo,cuda:nccl"
    assert (joined["rank"], joined["world_size"]) == (rank, world)
    assert joined["set_to"] == [rank % cuda.count]  # bound before the first collective
    assert joined["env"]["MASTER_ADDR"] == ("gpu0000" if env is slurm_env else "node0")
    assert joined["env"]["MASTER_PORT"] is not None


def test_init_distributed_on_cpu_joins_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    openmpi_env(monkeypatch, 8, 2)
    joined: dict[str, Any] = {}
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend=None, **k: joined.update(k, backend=backend))  # fmt: skip
    comm.init_distributed()
    assert (joined["backend"], joined["rank"], joined["world_size"]) == ("gloo", 2, 8)


# -- the collectives' backend ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "ring"),
    [("gloo", True), ("cpu:gloo,cuda:nccl", True), ("nccl", False), (None, False)],
)
def test_the_gloo_ring_serves_cpu_tensors_whenever_gloo_carries_them(
    backend: str | None, ring: bool, group: Callable[..., None]
) -> None:
    group(8, 0, backend)
    assert comm._use_ring(None) is ring


@pytest.mark.parametrize(
    ("backend", "through_gpu"),
    [("nccl", True), (None, True), ("cpu:gloo,cuda:nccl", False), ("gloo", False)],
)
def test_cpu_tensors_go_by_the_gpu_where_the_group_has_no_cpu_backend(
    backend: str | None, through_gpu: bool, cuda: FakeCuda, group: Callable[..., None]
) -> None:
    """A group made with "nccl" (or with no backend on a CUDA machine) has nothing to reduce
    a CPU tensor with: Comm's all_reduce and broadcast take it through the GPU."""
    from zerowatch.engine.hooks import ObserverRegistry

    group(8, 0, backend)
    assert comm.Comm(ObserverRegistry()).cpu_through_gpu is through_gpu
