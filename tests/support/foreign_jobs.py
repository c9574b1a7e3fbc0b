"""Two-rank gloo jobs on DeepSpeed and FSDP2, instrumented by zerowatch, for the adapter
tests and the overhead benchmark.

    results = run_job(deepspeed_worker, out_dir, server=url, configs=DEEPSPEED_CONFIGS, steps=4)

Each rank writes `<out_dir>/<job>-rank<r>.json`: per configuration the run id, and per step
the bytes of every collective the engine made, counted by `ProcessGroupCounter` (a wrapper
on the process group's own methods, one layer below the torch.distributed functions that
zerowatch wraps, so the two counts are independent), DeepSpeed's wall-clock timers, and
the adapter's model-state bytes and theory.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.ports import free_port

#: ProcessGroup method -> (zerowatch op, index of the argument that is the nccl-tests size).
_PG_METHODS: dict[str, tuple[str, int]] = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "all_gather_single": ("all_gather", 0),
    "_allgather_base": ("all_gather", 0),
    "allgather": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "broadcast": ("broadcast", 0),
    # Outside zerowatch's vocabulary: counted so a test sees when an engine uses them.
    "reduce": ("reduce", 0),
    "gather": ("gather", 1),
    "scatter": ("scatter", 1),
    "alltoall": ("all_to_all", 1),
    "alltoall_base": ("all_to_all", 1),
    "send": ("send", 0),
    "recv": ("recv", 0),
}


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return int(value.numel()) * int(value.element_size())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class ProcessGroupCounter:
    """Bytes per op of every collective issued to a gloo process group in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved: dict[str, Any] = {}

    def install(self) -> None:
        import torch.distributed as dist

        pg = dist.ProcessGroup
        for name, (op, index) in _PG_METHODS.items():
            orig = getattr(pg, name, None)
            if orig is None:
                continue
            self._saved[name] = pg.__dict__[name]  # the raw descriptor, to restore as it was

            def counted(self_pg: Any, *args: Any, _orig: Any = orig, _op: str = op,
                        _i: int = index, **kwargs: Any) -> Any:  # fmt: skip
                if self_pg.size() > 1:
                    with self._lock:
                        self.bytes[_op] += _nbytes(args[_i]) if len(args) > _i else 0
                        self.calls[_op] += 1
                return _orig(self_pg, *args, **kwargs)

            setattr(pg, name, counted)

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, orig in self._saved.items():
            setattr(dist.ProcessGroup, name, orig)
        self._saved.clear()

    def take(self) -> dict[str, int]:
        """Bytes per op since the last take."""
        with self._lock:
            out = {k: v for k, v in self.bytes.items() if v}
            self.bytes.clear()
            self.calls.clear()
        return out


def _restored(obj: Any, methods: tuple[str, ...]) -> bool:
    """No zerowatch wrapper left on `obj` or on torch.distributed's functions."""
    import torch.distributed as dist
    from zerowatch.agent.adapters import dist_wrap

    wrapped = [m for m in methods if m in vars(obj)]
    leftover = [n for n in dist_wrap.SPECS if getattr(getattr(dist, n, None), "__zerowatch__", 0)]
    return not wrapped and not leftover and not dist_wrap.installed()


def _hooks(model: Any, opt: Any) -> list[int]:
    """How many hooks the root module and the optimizer hold."""
    return [len(model._forward_pre_hooks), len(model._forward_hooks),
            len(model._backward_pre_hooks), len(opt._optimizer_step_pre_hooks),
            len(opt._optimizer_step_post_hooks)]  # fmt: skip


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip


def mlp(width: int = 256, depth: int = 4, seed: int = 0) -> Any:
    """A small MLP: big enough that a forward takes milliseconds, small enough for CI."""
    import torch

    torch.manual_seed(seed)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


#: name -> zero_optimization section; stage-3 thresholds at 0 so parameters are fetched.
DEEPSPEED_CONFIGS: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0,
    },
    "zero2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "zero2_accumulate2": {"stage": 2},
}
#: Gradient accumulation steps per configuration (default 1).
DEEPSPEED_ACCUMULATION: dict[str, int] = {"zero2_accumulate2": 2}


def deepspeed_worker(rank: int, world: int, port: int, out_dir: str, server: str | None,
                     configs: list[str], steps: int, batch: int,
                     instrument: bool = True) -> None:  # fmt: skip
    """One rank: each DeepSpeed configuration in turn, instrumented, `steps` steps each."""
    _join(rank, world, port)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    import zerowatch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    counter = ProcessGroupCounter()
    results: dict[str, Any] = {}
    for name in configs:
        model = mlp()
        accumulate = DEEPSPEED_ACCUMULATION.get(name, 1)
        # Without offload, torch's Adam: DeepSpeed's FusedAdam is a C++ op it builds on first
        # use (~40 s on CI), and the optimizer is not what these jobs test. With offload it
        # must be its DeepSpeedCPUAdam.
        offload = "offload_optimizer" in DEEPSPEED_CONFIGS[name]
        adam = {"lr": 1e-3, **({} if offload else {"torch_adam": True})}
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": accumulate,
            "optimizer": {"type": "Adam", "params": adam},
            "zero_optimization": {**DEEPSPEED_CONFIGS[name], "reduce_bucket_size": 200_000,
                                  "allgather_bucket_size": 200_000},
            "wall_clock_breakdown": True,
            "steps_per_print": 10_000,
        }  # fmt: skip
        engine, _, _, _ = deepspeed.initialize(
            model=model, config=config, model_parameters=model.parameters()
        )
        run = None
        if instrument:
            run = zerowatch.instrument(engine, server=server, run=f"ds-{name}",
                                       spool_dir=Path(out_dir) / "spool", spans_every=0,
                                       flush_interval_s=0.1)  # fmt: skip
        counter.install()
        per_step = []
        gen = torch.Generator().manual_seed(1 + rank)
        for _ in range(steps):  # optimizer steps, of `accumulate` micro-batches each
            counter.take()
            t0 = time.perf_counter()
            for _ in range(accumulate):
                x = torch.randn(batch, 256, generator=gen)
                loss = engine(x).pow(2).mean()
                engine.backward(loss)
                if run is not None:
                    run.log(loss=loss.item())
                engine.step()
            wall = time.perf_counter() - t0
            per_step.append({"bytes": counter.take(), "wall_s": wall,
                             "timers_ms": dict(engine.get_wall_clock_timers() or {})})  # fmt: skip
        counter.uninstall()
        result: dict[str, Any] = {"steps": per_step}
        if run is not None:
            # A checkpoint saved and loaded back: each rank's agent times both.
            engine.save_checkpoint(str(Path(out_dir) / f"ckpt-{name}"), tag="last")
            engine.load_checkpoint(str(Path(out_dir) / f"ckpt-{name}"), tag="last")
            adapter = run._adapter
            result.update(run_id=run.id, model_state=adapter.model_state_bytes(),
                          theory=adapter.info().theory)  # fmt: skip
            run.close()
            result["restored"] = _restored(engine, ("forward", "backward", "step",
                                                    "allreduce_gradients", "save_checkpoint",
                                                    "load_checkpoint"))  # fmt: skip
        results[name] = result
        engine.destroy()
    Path(out_dir, f"deepspeed-rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def fsdp2_worker(rank: int, world: int, port: int, out_dir: str, server: str | None,
                 configs: list[str], steps: int, batch: int,
                 instrument: bool = True) -> None:  # fmt: skip
    """One rank: an FSDP2 model (each Linear and the root fully sharded), AdamW; on CPU with
    gloo, or on this rank's GPU with NCCL when the configurations are named "cuda..."."""
    _join(rank, world, port)
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import zerowatch

    torch.set_num_threads(1)
    cuda = any(name.startswith("cuda") for name in configs)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    counter = ProcessGroupCounter()
    results: dict[str, Any] = {}
    for name in configs:
        model = mlp().to(device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if name == "bf16" else None
        kw = {"mp_policy": policy} if policy is not None else {}
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        hooks_before = _hooks(model, opt)
        run = None
        if instrument:
            run = zerowatch.instrument(model, optimizer=opt, server=server, run=f"fsdp2-{name}",
                                       spool_dir=Path(out_dir) / "spool", spans_every=1,
                                       flush_interval_s=0.1)  # fmt: skip
        counter.install()
        per_step = []
        gen = torch.Generator().manual_seed(1 + rank)
        for _ in range(steps):
            x = torch.randn(batch, 256, generator=gen).to(device)
            counter.take()
            t0 = time.perf_counter()
            loss = model(x).pow(2).mean()
            loss.backward()
            if run is not None:
                run.log(loss=loss.item())
            opt.step()
            opt.zero_grad()
            per_step.append({"bytes": counter.take(), "wall_s": time.perf_counter() - t0})
        counter.uninstall()
        result: dict[str, Any] = {"steps": per_step}
        if run is not None:
            adapter = run._adapter
            result.update(run_id=run.id, model_state=adapter.model_state_bytes(),
                          theory=adapter.info().theory)  # fmt: skip
            run.close()
            result["restored"] = _restored(model, ()) and _hooks(model, opt) == hooks_before
        results[name] = result
    Path(out_dir, f"fsdp2-rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def wrapping_worker(rank: int, world: int, port: int, out_dir: str, *_: Any) -> None:
    """One rank: every wrapped torch.distributed collective, sync and async, under a tap."""
    _join(rank, world, port)
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from zerowatch.agent.adapters import dist_wrap

    # A one-rank run earlier in the process: its group's size must not outlive it.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    solo = dist_wrap.CollectiveTap(lambda op: "other", lambda rec: None)
    solo.open()
    dist.all_reduce(torch.ones(1))
    solo.close()
    dist.destroy_process_group()

    dist.init_process_group("gloo", rank=rank, world_size=world)
    names = [n for n in dist_wrap.SPECS if hasattr(dist, n)]
    originals = {n: (getattr(dist, n), getattr(c10d, n)) for n in names}
    purposes = {"all_gather": "param_fetch", "reduce_scatter": "grad_reduce",
                "all_reduce": "other", "broadcast": "other"}  # fmt: skip
    records: list[Any] = []
    tap = dist_wrap.CollectiveTap(purposes.__getitem__, records.append)
    tap.open()
    t = torch.ones(1000)  # 4000 bytes
    half = torch.empty(500)

    def gathered() -> Any:
        return torch.empty(2000)

    cases: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(t),
        "all_reduce_async": lambda: dist.all_reduce(t, async_op=True),
        "all_gather_single": lambda: dist.all_gather_single(gathered(), t),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered(), t),
        "all_gather_into_tensor_async": lambda: dist.all_gather_into_tensor(
            gathered(), t, async_op=True),
        "all_gather_list": lambda: dist.all_gather([torch.empty(1000), torch.empty(1000)], t),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(half, t),
        "reduce_scatter_tensor_async": lambda: dist.reduce_scatter_tensor(half, t, async_op=True),
        "broadcast": lambda: dist.broadcast(t, src=0),
        "broadcast_object_list": lambda: dist.broadcast_object_list([{"a": 1}], src=0),
        "agent_broadcast_object": lambda: dist_wrap.broadcast_object({"a": 1}),
    }  # fmt: skip
    out: dict[str, Any] = {}
    for name, call in cases.items():
        records.clear()
        work = call()
        is_work = isinstance(work, dist.Work)
        if is_work:
            time.sleep(0.01)
            work.wait()
        deadline = time.monotonic() + 5
        while is_work and not records and time.monotonic() < deadline:
            time.sleep(0.005)  # the future's callback may report just after wait() returns
        out[name] = {"is_work": is_work, "records": [
            {"op": r.op, "purpose": r.purpose, "nbytes": r.nbytes, "world_size": r.world_size,
             "async_op": r.async_op, "latency_s": r.end - r.start, "exposed_s": r.exposed_s}
            for r in records]}  # fmt: skip
    tap.close()
    records.clear()
    dist.all_reduce(t)
    out["after_close"] = {
        "records": len(records),
        "restored": all(
            getattr(dist, n) is a and getattr(c10d, n) is b for n, (a, b) in originals.items()
        ),
    }
    Path(out_dir, f"wrapping-rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def server_series(api: str, run_id: str, metric: str, n_steps: int) -> dict[int, list[float]]:
    """A stored metric per rank as a list over steps 0..n_steps-1 (no value stored: 0)."""
    import httpx

    r = httpx.get(f"{api}/runs/{run_id}/series", params={"metric": metric, "max_points": 20000, "ranks": "0-255"},
                  timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    out: dict[int, list[float]] = {}
    for s in r.json()["series"]:
        values = [0.0] * n_steps
        for step, value in zip(s["steps"], s["values"], strict=True):
            values[step] = value
        out[s["rank"]] = values
    return out


def server_collective_purposes(api: str, run_id: str) -> set[tuple[str, str]]:
    """(op, purpose) of every collective slice in the run's trace export (sampled steps)."""
    import httpx

    r = httpx.get(f"{api}/runs/{run_id}/trace", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    slices = body["traceEvents"] if isinstance(body, dict) else body
    return {(e["args"]["op"], e["args"]["purpose"]) for e in slices
            if e.get("cat") == "collective"}  # fmt: skip


def job_run_id(job: Any, config: str) -> str:
    """The run id every rank of `job` reported for `config` (they must agree)."""
    ids = {rank[config]["run_id"] for rank in job}
    assert len(ids) == 1, f"ranks disagree on the run id: {ids}"
    return str(ids.pop())


def server_run(api: str, run_id: str) -> dict[str, Any]:
    """GET /runs/{id}."""
    import httpx

    r = httpx.get(f"{api}/runs/{run_id}", timeout=30)
    assert r.status_code == 200, f"{r.status_code} {r.text}"
    return dict(r.json())


def assert_every_step_stored(server: Any, run_id: str, steps: int, world: int = 2) -> None:
    """Every rank of the run stored `steps` steps (0 .. steps-1) and finished cleanly."""
    run = server_run(server.api, run_id)
    ranks = sorted(run["ranks"], key=lambda r: r["rank"])
    assert [(r["rank"], r["steps"], r["last_step"]) for r in ranks] == [
        (rank, steps, steps - 1) for rank in range(world)
    ], server.log_tail()
    assert all(r["end_status"] == "finished" and r["agent_errors"] == 0 for r in ranks)


def run_job(worker: Callable[..., None], out_dir: Path, *, server: str | None,
            configs: list[str], steps: int, batch: int = 64, world: int = 2,
            instrument: bool = True, timeout_s: float = 600.0) -> list[dict[str, Any]]:  # fmt: skip
    """Spawn `world` gloo ranks of `worker`; each rank's results, in rank order. Ranks
    still running after `timeout_s` (one waiting on a peer that hangs) are killed and the
    job fails, so that a hang fails the test instead of stalling the suite."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.spawn(worker, args=(world, free_port(), str(out_dir), server, configs, steps,
                                 batch, instrument), nprocs=world, join=False)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):  # raises when a rank fails
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
            raise TimeoutError(f"{worker.__name__}: ranks still running after {timeout_s:.0f} s")
    job = worker.__name__.removesuffix("_worker")
    return [json.loads(Path(out_dir, f"{job}-rank{r}.json").read_text()) for r in range(world)]


__all__ = [
    "DEEPSPEED_ACCUMULATION",
    "DEEPSPEED_CONFIGS",
    "ProcessGroupCounter",
    "deepspeed_worker",
    "fsdp2_worker",
    "mlp",
    "run_job",
    "server_collective_purposes",
    "server_run",
    "server_series",
    "wrapping_worker",
]
