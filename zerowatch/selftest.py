"""`zerowatch selftest`: is this node's world fit for ZeRO training, and what does it give?

    torchrun --nproc-per-node 8 -m zerowatch.selftest [--json out.json] [--server URL]
    zerowatch selftest [--nproc-per-node N] ...        # launches the line above

Every rank of the job runs four checks in turn (NCCL on GPUs, gloo on CPU), and rank 0
prints one report:

1. **engine** — a small GPT (`zerowatch.examples.gpt`) trained a few steps through
   `zerowatch.initialize` at each ZeRO stage must end with the weights of a plain
   single-process `torch.optim.AdamW` run on the same global batches (rank r trains on
   part r of each global batch; rank 0 trains the reference on the whole of it). The
   measure is the largest per-tensor ``||engine - reference|| / ||reference||`` of the
   consolidated state dict, compared on rank 0 (the only rank sure to hold the whole
   dict) with `TOLERANCE`; the verdict is broadcast. fp32, TF32 off during the check.
2. **collectives** — all-reduce, all-gather, reduce-scatter and broadcast of a few sizes
   through `engine.comm.Comm` (the path the engine's own traffic takes: on gloo, its ring
   reduce-scatter and all-gather), timed per iteration after a warm-up (CUDA events on
   GPU, the host clock on CPU); each rank's median, averaged over ranks as nccl-tests
   averages its time. algbw = bytes / time, busbw = algbw x nccl-tests' factor, where bytes
   is the all-reduce buffer, the all-gather output, the reduce-scatter input.
3. **agent** — the median step of a small GPT at stage 2 without the agent, with
   `zerowatch.instrument` attached (spooling to a temporary folder, or shipping to
   `--server`), and their ratio. Plain steps are taken before and after the instrumented
   ones, so a drift of the machine's speed hits both sides.
4. **clocks** — each rank's `time.time()` against rank 0's. A round: rank 0 reads t0 and
   broadcasts; rank r reads t1 when it has the broadcast, t2 just before an all-gather;
   rank 0 reads t3 when the all-gather is back. Causality gives t2 - t3 <= offset <=
   t1 - t0 (rank r can receive nothing before rank 0 sent it, rank 0 nothing before rank r
   sent it), so the midpoint ((t1 - t0) + (t2 - t3)) / 2 is within half the round trip
   ``(t3 - t0) - (t2 - t1)`` of the truth; of a few rounds, the one with the shortest round
   trip is kept (NTP's rule; zerowatch/clocks.py, which the agent shares).

Exit code: 0 when the engine check passes (and the report reached `--server` when one was
given), 1 otherwise, on every rank; 2 for bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import logging
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import zerowatch
from zerowatch import clocks
from zerowatch.clocks import clock_estimate
from zerowatch.engine.comm import Comm, init_distributed
from zerowatch.engine.hooks import ObserverRegistry
from zerowatch.events import bus_bandwidth_factor
from zerowatch.examples.gpt import GPT, GPTConfig, random_batch
from zerowatch.plan import PlanError, parse_bytes
from zerowatch.units import fmt_bytes, fmt_rate, fmt_seconds

#: The engine passes a stage when its weights are this close to the reference's (relative).
TOLERANCE = 1e-4
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
#: Collective sizes (bytes) unless --sizes says otherwise.
GPU_SIZES = (2**20, 16 * 2**20, 64 * 2**20)
CPU_SIZES = (256 * 2**10, 2**20, 4 * 2**20)

# The engine check: small enough for any node, with buckets small enough that stages 2 and
# 3 split the model into several, and clipping that acts (global norms are about 1).
ENGINE_MODEL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
MICRO_BATCH = 2
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.5
BUCKET = 4096

# The agent's cost: a model whose step is long enough on the device to time.
AGENT_MODEL = {
    "cpu": GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=4),
    "cuda": GPTConfig(vocab_size=1024, seq_len=256, d_model=512, n_layers=4, n_heads=8),
}
AGENT_MICRO_BATCH = 8
AGENT_STAGE = 2


class UsageError(ValueError):
    """A bad option (the message names it)."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """What to run; `parse_args` builds it from the command line."""

    stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages the engine check trains."""
    steps: int = 5
    """Optimizer steps per stage in the engine check."""
    sizes: tuple[int, ...] | None = None
    """Collective sizes in bytes (None: `GPU_SIZES` on CUDA, `CPU_SIZES` on CPU)."""
    warmup: int = 5
    """Untimed iterations of each collective and size."""
    iters: int = 20
    """Timed iterations of each collective and size."""
    agent_steps: int = 10
    """Timed steps with the agent (and twice as many without)."""
    clock_rounds: int = 10
    """Round trips per clock estimate."""
    json_path: str | None = None
    """Where rank 0 writes the report as JSON."""
    server: str | None = None
    """A zerowatch server to send the report (and the agent check's steps) to."""
    token: str | None = None
    """The server's ingest token."""


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated integers, got {text!r}") from None


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(parse_bytes(s.strip(), "--sizes") for s in text.split(",") if s.strip())
    except PlanError as e:
        raise UsageError(str(e)) from None
    if not sizes:
        raise UsageError(f"--sizes: expected sizes like 1MiB,16MiB, got {text!r}")
    return sizes


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # raise instead of printing usage and exiting
        raise UsageError(message)


def parse_args(argv: Sequence[str] | None = None) -> Options:
    """The options of `python -m zerowatch.selftest` (and of `zerowatch selftest`).

    Raises:
        UsageError: naming the bad option.
    """
    p = _Parser(prog="zerowatch.selftest", description="Check this node's world for ZeRO.")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages of the engine check")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per stage")
    p.add_argument("--sizes", default=None, help="collective sizes, e.g. 1MiB,16MiB,64MiB")
    p.add_argument("--warmup", type=int, default=5, help="untimed collective iterations")
    p.add_argument("--iters", type=int, default=20, help="timed collective iterations")
    p.add_argument("--agent-steps", type=int, default=10, help="timed steps with the agent")
    p.add_argument("--clock-rounds", type=int, default=10, help="round trips per clock")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument("--server", default=os.environ.get("ZEROWATCH_SERVER") or None,
                   help="zerowatch server URL [env: ZEROWATCH_SERVER]")  # fmt: skip
    p.add_argument("--token", default=os.environ.get("ZEROWATCH_TOKEN") or None,
                   help="ingest token [env: ZEROWATCH_TOKEN]")  # fmt: skip
    a = p.parse_args(argv)
    stages = _ints(a.stages, "--stages")
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise UsageError(f"--stages: each stage must be 0, 1, 2 or 3, got {a.stages!r}")
    for name in ("steps", "iters", "agent_steps", "clock_rounds"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(a, name)}")
    if a.warmup < 0:
        raise UsageError(f"--warmup: expected >= 0, got {a.warmup}")
    return Options(
        stages=stages, steps=a.steps, sizes=_sizes(a.sizes) if a.sizes else None,
        warmup=a.warmup, iters=a.iters, agent_steps=a.agent_steps, clock_rounds=a.clock_rounds,
        json_path=a.json_path, server=a.server, token=a.token,
    )  # fmt: skip


# -- 1. the engine against the reference ------------------------------------------------------


def engine_config(stage: int) -> dict[str, Any]:
    """The DeepSpeed-style config of the engine check at `stage`."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
            "stage3_prefetch_bucket_size": BUCKET,
            "stage3_param_persistence_threshold": 2 * ENGINE_MODEL.d_model,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
    }


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: MICRO_BATCH rows per rank, rank r's rows r*MICRO_BATCH on."""
    return random_batch(ENGINE_MODEL, MICRO_BATCH * world_size, seed=1000 + step)


def reference_state(steps: int, world_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The plain model after `steps` steps of torch AdamW on the whole global batches."""
    torch.manual_seed(0)
    model = GPT(ENGINE_MODEL).to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    for s in range(steps):
        x, y = global_batch(s, world_size)
        opt.zero_grad()
        model(x.to(device), y.to(device)).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def engine_state(stage: int, steps: int, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Train the engine at `stage` on this rank's part of each global batch; its
    consolidated state dict (whole on rank 0; other ranks may get an empty dict)."""
    torch.manual_seed(0)
    engine, *_ = zerowatch.initialize(model=GPT(ENGINE_MODEL), config=engine_config(stage))
    lo = rank * MICRO_BATCH
    for s in range(steps):
        x, y = global_batch(s, world_size)
        loss = engine(x[lo : lo + MICRO_BATCH], y[lo : lo + MICRO_BATCH])
        engine.backward(loss)
        engine.step()
    state = engine.consolidated_state_dict()
    engine.destroy()
    return state


def compare_states(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> tuple[float, str]:
    """The largest per-tensor ||got - want|| / ||want|| and its key; infinite for a key
    that one side lacks or a shape that differs, NaN where the engine's weights are not
    finite."""
    missing = sorted(set(got) ^ set(want))
    if missing:
        return math.inf, f"missing {missing[0]}"
    worst, key = 0.0, ""
    for k, w in want.items():
        g = got[k].float().cpu()
        if g.shape != w.shape:
            return math.inf, f"shape of {k}"
        err = float((g - w.float()).norm() / w.float().norm().clamp_min(1e-12))
        if not err <= worst:  # NaN wins, so a broken engine is never hidden
            worst, key = err, k
            if math.isnan(err):
                break
    return worst, key


def stage_verdict(stage: int, got: dict[str, torch.Tensor],
                  want: dict[str, torch.Tensor]) -> dict[str, Any]:  # fmt: skip
    """One stage's row of the report: its error, the tensor it is worst on, pass or fail."""
    err, key = compare_states(got, want)
    return {"stage": stage, "max_rel_error": _finite(err), "worst_tensor": key,
            "pass": err < TOLERANCE}  # fmt: skip


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    """fp32 matmuls and convolutions in full precision while the block runs. torch 2.9 and
    later have `fp32_precision` and refuse a mix of it with the older `allow_tf32`."""
    sides: tuple[Any, ...] = (torch.backends.cuda.matmul, torch.backends.cudnn)
    name = "fp32_precision" if hasattr(sides[0], "fp32_precision") else "allow_tf32"
    old = [getattr(side, name) for side in sides]
    for side in sides:
        setattr(side, name, "ieee" if name == "fp32_precision" else False)
    try:
        yield
    finally:
        for side, value in zip(sides, old, strict=True):
            setattr(side, name, value)


def check_engine(comm: Comm, opts: Options, device: torch.device) -> dict[str, Any]:
    """Section 1 of the report (the same on every rank)."""
    rows = []
    with _no_tf32():
        want = reference_state(opts.steps, comm.world_size, device) if comm.rank == 0 else {}
        for stage in opts.stages:
            got = engine_state(stage, opts.steps, comm.rank, comm.world_size)
            rows.append(stage_verdict(stage, got, want) if comm.rank == 0 else None)
    rows = comm.broadcast_object(rows)
    return {"pass": all(r["pass"] for r in rows), "tolerance": TOLERANCE, "steps": opts.steps,
            "stages": rows}  # fmt: skip


# -- 2. collectives -------------------------------------------------------------------------


def _launch(comm: Comm, op: str, numel: int, device: torch.device) -> Any:
    """A function that runs `op` once on buffers of `numel` float32 elements in all (the
    nccl-tests size; numel divides by the world size)."""
    n = comm.world_size
    big = torch.zeros(numel, device=device)  # zeros: sums repeated in place stay finite
    small = torch.zeros(numel // n, device=device)
    if op == "all_reduce":
        return lambda: comm.all_reduce(big, purpose="other")
    if op == "all_gather":
        return lambda: comm.all_gather(big, small, purpose="other")
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(small, big, purpose="other")
    return lambda: comm.broadcast(big, 0, purpose="other")


def time_collective(comm: Comm, op: str, numel: int, device: torch.device, *, warmup: int,
                    iters: int) -> float:  # fmt: skip
    """This rank's median seconds of one `op` (CUDA events read once at the end on GPU)."""
    run = _launch(comm, op, numel, device)
    for _ in range(warmup):
        run()
    comm.barrier()
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        torch.cuda.synchronize()
        marks[0].record()
        for i in range(iters):
            run()  # synchronous: the current stream waits for the collective
            marks[i + 1].record()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth_row(op: str, nbytes: int, seconds: float, world_size: int) -> dict[str, Any]:
    """One collective's row: time, algbw = bytes / time, busbw = algbw x nccl-tests' factor."""
    factor = bus_bandwidth_factor(op, world_size)
    algbw = nbytes / seconds if seconds > 0 else math.inf
    return {"op": op, "bytes": nbytes, "time_s": seconds, "algbw_Bps": _finite(algbw),
            "busbw_Bps": _finite(algbw * factor), "factor": factor}  # fmt: skip


def check_collectives(comm: Comm, opts: Options, device: torch.device) -> list[dict[str, Any]]:
    """Section 2 of the report (on every rank; empty for one rank, which sends nothing)."""
    n = comm.world_size
    if n == 1:
        return []
    sizes = opts.sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    cases = [(op, max(n, size // 4 // n * n)) for size in sizes for op in OPS]
    mine = [time_collective(comm, op, numel, device, warmup=opts.warmup, iters=opts.iters)
            for op, numel in cases]  # fmt: skip
    every = comm.all_gather_object(mine)
    return [bandwidth_row(op, numel * 4, statistics.fmean(t[i] for t in every), n)
            for i, (op, numel) in enumerate(cases)]  # fmt: skip


# -- 3. the agent's cost --------------------------------------------------------------------


def check_agent(comm: Comm, opts: Options, device: torch.device, name: str) -> dict[str, Any]:
    """Section 3: median step time at stage 2 without and with the agent, and the ratio."""
    cfg = AGENT_MODEL[device.type if device.type in AGENT_MODEL else "cpu"]
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": AGENT_MICRO_BATCH, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": AGENT_STAGE, "overlap_comm": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
    engine, *_ = zerowatch.initialize(model=GPT(cfg), config=config)
    x, y = random_batch(cfg, AGENT_MICRO_BATCH, seed=comm.rank)

    def steps(k: int, run: Any = None) -> list[float]:
        times = []
        for _ in range(k):
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            value = loss.item()
            if run is not None:
                run.log(loss=value, tokens=x.numel())
            times.append(time.perf_counter() - t0)
        return times

    spool = tempfile.mkdtemp(prefix="zerowatch-selftest-")
    try:
        steps(5)  # warm-up
        plain = steps(opts.agent_steps)
        with _quiet_spool(opts.server is None):
            run = zerowatch.instrument(
                engine, server=opts.server, token=opts.token, run=f"{name}-agent",
                project="selftest", tags=["selftest", f"stage{AGENT_STAGE}"], spool_dir=spool,
                num_layers=cfg.n_layers, hidden_size=cfg.d_model, seq_len=cfg.seq_len,
            )  # fmt: skip
            with run:
                steps(2, run)  # the agent's own warm-up (its first steps build its state)
                with_agent = steps(opts.agent_steps, run)
        plain += steps(opts.agent_steps)
        run_id = run.id
    finally:
        engine.destroy()
        shutil.rmtree(spool, ignore_errors=True)
    every = comm.all_gather_object((statistics.median(plain), statistics.median(with_agent)))
    plain_s = statistics.fmean(p for p, _ in every)
    agent_s = statistics.fmean(a for _, a in every)
    return {"stage": AGENT_STAGE, "steps": opts.agent_steps, "model": _model_text(cfg),
            "plain_step_s": plain_s, "agent_step_s": agent_s, "ratio": agent_s / plain_s,
            "shipped_to": opts.server, "run_id": run_id}  # fmt: skip


@contextlib.contextmanager
def _quiet_spool(quiet: bool) -> Iterator[None]:
    """Without a server the agent spools to a folder that is removed afterwards: keep its
    notes on where the spool is and how to upload it (stderr, warnings) off the console."""
    if not quiet:
        yield
        return
    agent_log = logging.getLogger("zerowatch.agent")
    level = agent_log.level
    agent_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        agent_log.setLevel(level)


def _model_text(cfg: GPTConfig) -> str:
    return f"GPT d{cfg.d_model} x{cfg.n_layers} seq{cfg.seq_len} batch{AGENT_MICRO_BATCH}"


# -- 4. clocks ------------------------------------------------------------------------------


def check_clocks(comm: Comm, opts: Options, hosts: list[str]) -> list[dict[str, Any]]:
    """Section 4 (on rank 0; other ranks get an empty list): each rank's offset from rank 0
    from the round with the shortest round trip (zerowatch.clocks)."""
    table = clocks.measure(comm.broadcast_object, comm.all_gather_object, rank=comm.rank,
                           rounds=opts.clock_rounds, barrier=comm.barrier)  # fmt: skip
    if table is None:
        return []
    return [{"rank": r, "host": hosts[r], "offset_s": offset, "round_trip_s": rtt}
            for r, (offset, rtt) in enumerate(table)]  # fmt: skip


# -- the report -----------------------------------------------------------------------------


def _finite(x: float) -> float | None:
    """`x`, or None where it is not finite (JSON and the server take finite numbers only)."""
    return x if math.isfinite(x) else None


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _backend(device: torch.device) -> str:
    """The default group's backend for `device`'s tensors ("nccl" of "cpu:gloo,cuda:nccl")."""
    name = str(torch.distributed.get_backend())
    by_device = dict(p.split(":", 1) for p in name.split(",") if ":" in p)
    return by_device.get(device.type, name)


def describe_world(comm: Comm, device: torch.device) -> dict[str, Any]:
    """Who is in the job: ranks, backend, each rank's host and device."""
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU ({platform.machine() or 'unknown'})")  # fmt: skip
    ranks = comm.all_gather_object((socket.gethostname(), name))
    devices: dict[str, int] = {}
    for _, d in ranks:
        devices[d] = devices.get(d, 0) + 1
    backend = _backend(device) if comm.enabled else "none"
    return {"world_size": comm.world_size, "backend": backend, "devices": devices,
            "hosts": len({h for h, _ in ranks}), "rank_hosts": [h for h, _ in ranks],
            "torch": torch.__version__, "zerowatch": zerowatch.__version__}  # fmt: skip


def run_selftest(comm: Comm, opts: Options) -> dict[str, Any]:
    """Every check on this rank of the job; the report (whole on rank 0)."""
    device = _device()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    name = comm.broadcast_object(f"selftest-{stamp}")
    world = describe_world(comm, device)
    report: dict[str, Any] = {"name": name, "world": world}
    report["engine"] = check_engine(comm, opts, device)
    report["collectives"] = check_collectives(comm, opts, device)
    report["agent"] = check_agent(comm, opts, device, name)
    report["clocks"] = {"rounds": opts.clock_rounds,
                        "ranks": check_clocks(comm, opts, world["rank_hosts"])}  # fmt: skip
    report["pass"] = report["engine"]["pass"]
    return report


def render(report: dict[str, Any]) -> str:
    """The report as one plain-text table (what rank 0 prints)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    w = report["world"]
    verdict = "PASS" if report["pass"] else "FAIL"
    table = Table(
        title=f"zerowatch selftest {report['name']}: {verdict}", box=box.SIMPLE_HEAD,
        caption="busbw, algbw: nccl-tests' definitions, 1 GB/s = 10^9 B/s; clocks: offset "
                "from rank 0 within ± half the round trip",
    )  # fmt: skip
    for col in ("section", "item", "measured", "detail"):
        table.add_column(col, justify="left" if col != "measured" else "right")
    devices = ", ".join(f"{k} × {v}" for k, v in w["devices"].items())
    rows: list[list[tuple[str, str, str]]] = [[
        ("ranks", f"{w['world_size']}", f"{w['backend']}, {w['hosts']} host(s)"),
        ("devices", devices, ""),
        ("versions", f"torch {w['torch']}", f"zerowatch {w['zerowatch']}"),
    ]]  # fmt: skip
    e = report["engine"]
    rows.append([
        (f"ZeRO-{s['stage']}", _sci(s["max_rel_error"]),
         f"{'pass' if s['pass'] else 'FAIL'} (< {e['tolerance']:g}; worst {s['worst_tensor']})")
        for s in e["stages"]
    ])  # fmt: skip
    rows.append([
        (f"{c['op']} {fmt_bytes(c['bytes'])}", f"busbw {fmt_rate(c['busbw_Bps'], 'B/s')}",
         f"algbw {fmt_rate(c['algbw_Bps'], 'B/s')}, {fmt_seconds(c['time_s'])}")
        for c in report["collectives"]
    ] or [("(one rank)", "-", "nothing to send")])  # fmt: skip
    a = report["agent"]
    rows.append([
        (f"ZeRO-{a['stage']} step", f"× {a['ratio']:.3f}",
         f"{fmt_seconds(a['agent_step_s'])} with, {fmt_seconds(a['plain_step_s'])} without "
         f"the agent (median of {a['steps']})"),
    ])  # fmt: skip
    rows.append([
        (f"rank {c['rank']}", f"{c['offset_s'] * 1e3:+.3f} ms",
         (f"± {c['round_trip_s'] * 1e3 / 2:.3f} ms (round trip {c['round_trip_s'] * 1e3:.3f} ms)"
          if c["rank"] else "the reference") + f", {c['host']}")
        for c in report["clocks"]["ranks"]
    ])  # fmt: skip
    for section, items in zip(("world", "engine", "collectives", "agent", "clocks"), rows,
                              strict=True):  # fmt: skip
        for i, (item, measured, detail) in enumerate(items):
            table.add_row(section if i == 0 else "", item, measured, detail,
                          end_section=i == len(items) - 1)  # fmt: skip
    out = io.StringIO()
    console = Console(file=out, width=140, color_system=None, highlight=False, soft_wrap=True)
    console.print(table)
    server = report.get("server")
    if server:
        if server.get("error"):
            console.print(f"server: not sent to {server['url']}: {server['error']}")
        else:
            console.print(f"server: report {server['url']}/runs/{server['run_id']}, "
                          f"agent steps {server['url']}/runs/{report['agent']['run_id']}")  # fmt: skip
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").splitlines())


def _sci(x: float | None) -> str:
    return "not finite" if x is None else f"{x:.2e}"


# -- the server -----------------------------------------------------------------------------


def headline_tags(report: dict[str, Any]) -> list[str]:
    """The run's tags: the verdict and the numbers one reads first."""
    tags = ["selftest", f"engine:{'pass' if report['engine']['pass'] else 'fail'}",
            f"world:{report['world']['world_size']}", f"backend:{report['world']['backend']}",
            f"agent_ratio:{report['agent']['ratio']:.3f}"]  # fmt: skip
    for op in OPS:
        rows = [c for c in report["collectives"] if c["op"] == op and c["busbw_Bps"]]
        if rows:
            top = max(rows, key=lambda c: c["bytes"])
            tags.append(f"busbw_{op}_GBps:{top['busbw_Bps'] / 1e9:.3g}")
    offsets = [abs(c["offset_s"]) for c in report["clocks"]["ranks"]]
    tags.append(f"clock_offset_max_ms:{max(offsets, default=0.0) * 1e3:.3f}")
    return tags


def send_report(report: dict[str, Any], server: str, token: str | None) -> str:
    """Store the report on `server` as a run of project "selftest": its tags carry the
    headline numbers, `engine_info.selftest` the whole report; its one rank ends
    "finished" when the engine check passed, "failed" when not. Returns the run id.

    Raises:
        httpx.HTTPError: the server could not be reached or refused the report.
    """
    import httpx

    base = server.rstrip("/") + "/api/v1"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    run_id = f"{report['name']}-{uuid.uuid4().hex[:6]}"
    w = report["world"]
    body = {
        "run_id": run_id, "name": report["name"], "project": "selftest",
        "tags": headline_tags(report), "world_size": 1, "engine": "zerowatch",
        "engine_info": {"selftest": report}, "hosts": sorted(set(w["rank_hosts"])),
        "torch_version": w["torch"], "zerowatch_version": w["zerowatch"],
        "started_at": time.time(),
    }  # fmt: skip
    end = {"kind": "end", "rank": 0, "seq": 0, "time": time.time(),
           "status": "finished" if report["pass"] else "failed",
           "error": None if report["pass"] else "the engine does not match the reference"}  # fmt: skip
    with httpx.Client(timeout=30, headers=headers) as client:
        client.post(f"{base}/runs", json=body).raise_for_status()
        client.post(f"{base}/runs/{run_id}/events",
                    json={"run_id": run_id, "events": [end]}).raise_for_status()  # fmt: skip
    return run_id


def finish(report: dict[str, Any], opts: Options) -> int:
    """Rank 0: send, print and write the report; the exit code."""
    code = 0 if report["pass"] else 1
    if opts.server:
        report["server"] = {"url": opts.server.rstrip("/")}
        try:
            report["server"]["run_id"] = send_report(report, opts.server, opts.token)
        except Exception as e:  # any failure to deliver is reported, not raised
            report["server"]["error"] = f"{type(e).__name__}: {e}"
            code = 1
    print(render(report), flush=True)
    if opts.json_path:
        with open(opts.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """`torchrun ... -m zerowatch.selftest`: the checks on this rank; the exit code."""
    try:
        opts = parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_distributed()
    comm = Comm(ObserverRegistry())
    report = run_selftest(comm, opts)
    code = finish(report, opts) if comm.rank == 0 else 0
    code = comm.broadcast_object(code)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return int(code)


def launch(nproc_per_node: int | None, argv: Sequence[str]) -> int:
    """`zerowatch selftest`: torchrun this module on `nproc_per_node` ranks of this machine
    (default: one per GPU, or 2 on CPU); torchrun's exit code."""
    n = nproc_per_node or torch.cuda.device_count() or 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(n), "-m", "zerowatch.selftest", *argv]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


__all__ = [
    "TOLERANCE",
    "Options",
    "UsageError",
    "bandwidth_row",
    "clock_estimate",
    "compare_states",
    "launch",
    "main",
    "parse_args",
    "reference_state",
    "render",
    "run_selftest",
    "send_report",
]


if __name__ == "__main__":
    sys.exit(main())
