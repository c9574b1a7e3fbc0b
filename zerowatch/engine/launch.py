"""Where this process sits in the job: its rank, the job's size, its local rank, its device.

A launcher says so in environment variables. The first family present wins:

    torchrun (and the DeepSpeed launcher, `accelerate launch`, torch.distributed.launch):
        RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    Open MPI's mpirun:
        OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
        OMPI_COMM_WORLD_LOCAL_SIZE; MASTER_ADDR from the user (mpirun -x MASTER_ADDR)
    SLURM's srun (a job step: SLURM_STEP_ID is set):
        SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_LOCALID,
        SLURM_STEP_TASKS_PER_NODE (else SLURM_NTASKS_PER_NODE); MASTER_ADDR, else the first
        host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), where task 0 runs
    none of them: one rank (a plain `python train.py`).

Open MPI comes before SLURM because mpirun inside an allocation inherits the allocation's
SLURM variables, which then describe the batch step, not this process. A batch script runs
as SLURM_PROCID=0 of SLURM_NTASKS tasks without starting the others, so SLURM variables
place ranks only inside an srun step. SLURM and Open MPI jobs rendezvous on MASTER_PORT,
else 29500 (torchrun's default). A family that is only partly there is an error naming the
missing variable: a job whose ranks each trained alone would look like it worked.

The device: cuda:(local_rank % torch.cuda.device_count()). A node whose processes each see
every GPU gives local rank r GPU r; SLURM's per-task binding (each task sees one GPU) gives
every task cuda:0. `bind_device` makes it the current device, as DeepSpeed and Accelerate do
(torch.cuda.set_device(local_rank)), also when the script or a framework made the process
group, so that NCCL's communicator and every default-device allocation land there.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

log = logging.getLogger("zerowatch.engine")

#: The variables torchrun sets for each worker (and the rendezvous it shares with them).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")  # fmt: skip
#: The rendezvous port of SLURM and Open MPI jobs without MASTER_PORT (torchrun's default).
DEFAULT_MASTER_PORT = 29500


class LaunchError(ValueError):
    """The environment describes a job only in part; the message names what is missing."""


@dataclass(frozen=True)
class Placement:
    """This process's place in the job, as its launcher describes it."""

    #: "torchrun", "openmpi", "slurm" or "none" (a plain process: one rank).
    launcher: str
    rank: int
    world_size: int
    #: The rank among this node's processes: it picks the GPU.
    local_rank: int
    #: This node's processes; None where the launcher does not say.
    local_world_size: int | None
    #: The host of rank 0's rendezvous store; None where the environment does not give it
    #: (`rendezvous()` then names the variable to set).
    master_addr: str | None
    master_port: int | None
    #: Why master_addr is None, for the error (a SLURM node list too involved to read).
    master_addr_note: str = ""


def placement(environ: Mapping[str, str] | None = None) -> Placement:
    """This process's place, from `environ` (default: os.environ); see the module docstring.

    Raises:
        LaunchError: a launcher's variables are there only in part, or are not integers.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return _openmpi(env)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return _slurm(env)
    if int(env.get("SLURM_NTASKS", "1") or "1") > 1:
        log_once("SLURM_NTASKS is above 1 but this process was not started by srun (no "
                 "SLURM_STEP_ID): it trains as one rank; start the tasks with srun or torchrun")  # fmt: skip
    return Placement("none", 0, 1, 0, 1, None, None)


def local_device(place: Placement | None = None) -> torch.device:
    """This process's GPU: cuda:(local_rank % device_count)."""
    place = placement() if place is None else place
    return torch.device("cuda", place.local_rank % max(torch.cuda.device_count(), 1))


def bind_device(place: Placement | None = None) -> torch.device:
    """Make this process's GPU the current CUDA device, and return it.

    Without launcher variables nothing says which GPU is local (a single process, or ranks
    started with mp.spawn that set their own device): the current device stays. A current
    device other than cuda:0 (the default) and other than the local one was set by someone
    on purpose: it is still moved to the local one, like DeepSpeed and Accelerate do, with a
    warning naming both.
    """
    place = placement() if place is None else place
    current = torch.cuda.current_device()
    if place.launcher == "none":
        return torch.device("cuda", current)
    device = local_device(place)
    if current not in (0, device.index):
        warnings.warn(f"the current CUDA device is cuda:{current}, but local rank "
                      f"{place.local_rank} of {place.launcher} trains on {device} "
                      f"(local_rank % {torch.cuda.device_count()} GPUs): moving to {device}",
                      stacklevel=2)  # fmt: skip
    torch.cuda.set_device(device)
    return device


def rendezvous(place: Placement) -> tuple[str, int]:
    """The rank-0 store's (MASTER_ADDR, MASTER_PORT) for `place`.

    Raises:
        LaunchError: the address or port is not known (the message names the variable).
    """
    if place.master_addr is None:
        note = f" ({place.master_addr_note})" if place.master_addr_note else ""
        raise LaunchError(f"MASTER_ADDR: not set; rank {place.rank} of {place.world_size} "
                          f"({place.launcher}) needs the host of rank 0{note}; export "
                          "MASTER_ADDR=<rank 0's host> (and MASTER_PORT)")  # fmt: skip
    if place.master_port is None:
        raise LaunchError(f"MASTER_PORT: not set; rank {place.rank} of {place.world_size} "
                          f"({place.launcher}) needs the port of rank 0's store")  # fmt: skip
    return place.master_addr, place.master_port


# -- the launchers ---------------------------------------------------------------------------


def _int(env: Mapping[str, str], name: str, family: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is not None:
            return default
        raise LaunchError(f"{name}: not set, but {family} is ({_present(env, family)}); "
                          "set it or launch with torchrun")  # fmt: skip
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}: expected an integer, got {raw!r}") from None


def _present(env: Mapping[str, str], family: str) -> str:
    prefix = {"torchrun": TORCHRUN_VARIABLES, "Open MPI": ("OMPI_COMM_WORLD_",),
              "SLURM": ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS")}[family]  # fmt: skip
    return ", ".join(sorted(k for k in env if k.startswith(prefix))) or "nothing"


def _checked(place: Placement, names: tuple[str, str, str]) -> Placement:
    rank, world, local = names
    if place.world_size < 1:
        raise LaunchError(f"{world}: expected at least 1, got {place.world_size}")
    if not 0 <= place.rank < place.world_size:
        raise LaunchError(f"{rank}: expected 0 to {world}-1 = {place.world_size - 1}, "
                          f"got {place.rank}")  # fmt: skip
    if place.local_rank < 0:
        raise LaunchError(f"{local}: expected 0 or more, got {place.local_rank}")
    return place


def _port(env: Mapping[str, str], default: int | None) -> int | None:
    return _int(env, "MASTER_PORT", "torchrun") if env.get("MASTER_PORT") else default


def _torchrun(env: Mapping[str, str]) -> Placement:
    f = "torchrun"
    rank, world = _int(env, "RANK", f), _int(env, "WORLD_SIZE", f)
    local = _int(env, "LOCAL_RANK", f, 0 if world == 1 else None)
    local_world = _int(env, "LOCAL_WORLD_SIZE", f) if env.get("LOCAL_WORLD_SIZE") else None
    place = Placement(f, rank, world, local, local_world, env.get("MASTER_ADDR") or None,
                      _port(env, None))  # fmt: skip
    return _checked(place, ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _openmpi(env: Mapping[str, str]) -> Placement:
    f, p = "Open MPI", "OMPI_COMM_WORLD_"
    rank, world = _int(env, p + "RANK", f), _int(env, p + "SIZE", f)
    local = _int(env, p + "LOCAL_RANK", f)
    local_world = _int(env, p + "LOCAL_SIZE", f) if env.get(p + "LOCAL_SIZE") else None
    place = Placement("openmpi", rank, world, local, local_world,
                      env.get("MASTER_ADDR") or None, _port(env, DEFAULT_MASTER_PORT),
                      "Open MPI does not give it: mpirun -x MASTER_ADDR=<host of rank 0>")  # fmt: skip
    return _checked(place, (p + "RANK", p + "SIZE", p + "LOCAL_RANK"))


def _slurm(env: Mapping[str, str]) -> Placement:
    f = "SLURM"
    rank = _int(env, "SLURM_PROCID", f)
    world = (_int(env, "SLURM_STEP_NUM_TASKS", f) if env.get("SLURM_STEP_NUM_TASKS")
             else _int(env, "SLURM_NTASKS", f))  # fmt: skip
    local = _int(env, "SLURM_LOCALID", f)
    addr, note = env.get("MASTER_ADDR") or None, ""
    if addr is None:
        name = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
        nodes = env.get(name, "")
        addr = first_host(nodes)
        if addr is None:
            note = f"its first host cannot be read from {name}={nodes!r}"
    place = Placement("slurm", rank, world, local, _slurm_local_world(env), addr,
                      _port(env, DEFAULT_MASTER_PORT), note)  # fmt: skip
    return _checked(place, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))


def _slurm_local_world(env: Mapping[str, str]) -> int | None:
    """This node's tasks: SLURM_STEP_TASKS_PER_NODE ("8(x2),3": 8, 8, 3) at SLURM_NODEID,
    else SLURM_NTASKS_PER_NODE; None when neither reads."""
    counts: list[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            counts = []
            break
        counts += [int(m[1])] * int(m[2] or 1)
    node = env.get("SLURM_NODEID", "")
    if counts and node.isdigit() and int(node) < len(counts):
        return counts[int(node)]
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    return int(per_node) if per_node.isdigit() else None


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list ("gpu[003-006,9],login1" -> "gpu003"), or None
    when it is not of the simple forms `host` and `prefix[ranges]`."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    m = re.fullmatch(r"([A-Za-z0-9._-]+)(?:\[(\d+)(?:-\d+)?(?:,\d+(?:-\d+)?)*\])?",
                     nodelist[:end])  # fmt: skip
    if m is None:
        return None
    return m[1] + (m[2] or "")


# -- one line per process --------------------------------------------------------------------

_SAID: set[str] = set()


def log_once(message: str) -> None:
    """Log `message` at INFO the first time this process says it."""
    if message not in _SAID:
        _SAID.add(message)
        log.info(message)


def _reset_once() -> None:
    """Forget what was said (tests)."""
    _SAID.clear()


__all__ = [
    "DEFAULT_MASTER_PORT",
    "TORCHRUN_VARIABLES",
    "LaunchError",
    "Placement",
    "bind_device",
    "first_host",
    "local_device",
    "log_once",
    "placement",
    "rendezvous",
]
