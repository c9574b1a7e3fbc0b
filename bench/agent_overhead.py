"""What the in-process agent costs a training step: the same 2-rank gloo training with and
without `zerowatch.instrument`, interleaved in one run, per ZeRO stage.

    python bench/agent_overhead.py                  # stages 0-3, a server on a free port
    python bench/agent_overhead.py --no-server      # the agent spools to disk instead
    python bench/agent_overhead.py --fault 500      # a server answering 500 to everything
    python bench/agent_overhead.py --fault hang     # a server that never answers
    python bench/agent_overhead.py --deep-layers 0  # without the 48-layer stage-3 row
    python bench/agent_overhead.py --cuda           # one rank on the GPU (NCCL, world size 1)

For each stage every rank builds one engine (a small GPT) and one instrumented run shipping
to a real `zerowatch serve` on 127.0.0.1. Then, `--repeats` times, it trains `--steps`
steps with the agent detached from the engine and `--steps` with it attached (the order
alternates between repeats, so drift hits both alike), timing every step by wall clock,
by the process's CPU time over all threads (the agent's shipper thread included) and by
the training thread's own CPU time ("loop"). It prints, per stage, the median step time
with and without the agent and the three ratios (the goal: at most 1.01 at stage 3), and
what the agent holds in memory: the steps in its bounded queue (peak and bound), the mean
size of an event and of a queued step ("draft KiB": the queue holds each step's draft, its
raw boundaries and collective records, until the shipper thread builds the event). A last row trains stage 3 on a model of the same width with
`--deep-layers` blocks (48): the agent's callbacks grow with the number of modules, so this
row shows whether its share of the step stays put when they do.

The agent's own CPU is also measured directly: every engine callback is counted and the
training thread's CPU time inside it summed ("hooks"), less what the timing itself costs a
callback. That cost is measured the same way inside training, around an observer that does
nothing, in blocks of steps of its own (a third variant beside plain and agent): between
the engine's kernels, which evict the CPU's caches, reading the clock costs several times
what it does in a tight loop. "us/cb" is the callbacks' CPU over their number (the work at
the step boundaries included; building the step's event from its draft is the shipper
thread's, in "shipper ms"). On a machine shared with other work the wall clock carries the noise
of being descheduled; the CPU times do not.

Attaching and detaching one run keeps start-up (the run-id broadcast, the shipper thread,
the run's creation on the server) out of the figures; the shipper keeps working between blocks, so shipping a block's events
can spill into the next block: a small bias toward 1 (shipping one event costs ~0.1 ms of
the shipper thread, next to step times of tens of milliseconds).

The shipper posts once per flush interval whatever it holds, so the cost of a POST is
shared by the steps of one interval. Only one block in three is instrumented here, so at
the default interval each POST would carry a third of the steps it carries when every step
is instrumented, and "shipper ms" per instrumented step would count each POST three times
over. The instrumented run's interval is therefore the default times the number of
variants (6 s for 2 ranks): a POST carries the steps of 2 s of instrumented training, as in
a run instrumented throughout. The shipper's CPU is read once everything the measured steps
handed it has been shipped (a last, partial interval's POST included).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
#: The blocks interleaved per repeat: without the agent, with it, with a do-nothing observer.
VARIANTS = ("plain", "agent", "empty")
#: What each step is timed by: wall clock, the process's CPU time over all its threads (the
#: agent's shipper included), the training thread's own CPU time.
KINDS = ("wall", "cpu", "loop")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def world(args: argparse.Namespace) -> int:
    """Ranks to spawn: two gloo ranks on CPU; with --cuda one NCCL rank, since NCCL refuses
    two ranks on one GPU ("Duplicate GPU detected") and these machines lend one."""
    return 1 if getattr(args, "cuda", False) else WORLD


def run_ranks(measure_rank: Any, args: argparse.Namespace) -> tuple[list[Any], float]:
    """Start a server (unless --no-server), spawn WORLD ranks of `measure_rank(rank, args,
    port, server, spool_dir, tmp)`, and return what each rank saved as rank<r>.pt, with the
    wall-clock seconds the ranks took."""
    with tempfile.TemporaryDirectory(prefix="zerowatch-bench-") as tmp:
        work = Path(tmp)
        server_proc: Any = None
        if args.fault != "none":
            server_proc, server = start_faulty_server(args.fault)
        elif args.no_server:
            server = None
        else:
            server_proc, server = start_server(work)
        try:
            port = free_port()
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=measure_rank,
                                 args=(r, args, port, server, str(work / "spool"), tmp))
                     for r in range(world(args))]  # fmt: skip
            t0 = time.perf_counter()
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
            wall = time.perf_counter() - t0
            if any(proc.exitcode != 0 for proc in procs):
                raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
            ranks = [torch.load(work / f"rank{r}.pt", weights_only=False)
                     for r in range(world(args))]  # fmt: skip
        finally:
            if isinstance(server_proc, subprocess.Popen):
                server_proc.terminate()
                server_proc.wait(10)
            elif server_proc is not None:
                server_proc.shutdown()
    return ranks, wall


def start_server(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`zerowatch serve` on a free port with a throwaway SQLite file."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROWATCH_")}
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerowatch.cli", "serve", "--port", str(port),
         "--db", f"sqlite:///{workdir / 'bench.db'}"],
        cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {(workdir / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def start_faulty_server(fault: str) -> tuple[ThreadingHTTPServer, str]:
    """A server on a free port that answers every request with a 500 (`fault="500"`) or
    holds it without answering (`"hang"`): the agent must spool and retry in the
    background while training goes on."""

    class Faulty(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if fault == "hang":
                time.sleep(3600)
            self.send_response(500)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"boom")

        do_GET = do_POST

        def log_message(self, *_: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Faulty)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def ds_config(stage: int, micro_batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "overlap_comm": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }


class Accounted:
    """The recorder as the engine's observer, with the CPU time of every callback summed
    (`time.thread_time` of the calling thread: the training thread, or a backend thread
    completing an async collective) and the callbacks counted."""

    def __init__(self, recorder: Any) -> None:
        self.cpu_s = 0.0
        self.calls = 0
        for name in ("on_phase_start", "on_phase_end", "on_collective", "on_collective_launch",
                     "on_offload"):  # fmt: skip
            setattr(self, name, self._timed(getattr(recorder, name)))

    def _timed(self, fn: Any) -> Any:
        def call(*a: Any) -> None:
            t0 = time.thread_time()
            fn(*a)
            self.cpu_s += time.thread_time() - t0
            self.calls += 1

        return call


def queued_size(build: Any) -> int:
    """Bytes a queued step holds until the shipper builds its event: the recorder's draft
    (the step's raw phase boundaries and collective records, its memory and optimizer
    stats), walked object by object; what it shares with the agent (phase codes, clock,
    probes) and small ints and strings (shared by the interpreter) are not counted."""
    import functools
    import types

    from zerowatch.agent.probes import CollectiveAggregator
    from zerowatch.agent.probes.phases import PhaseCodes

    root = build.args[0] if isinstance(build, functools.partial) and build.args else build
    seen: set[int] = set()
    shared = (PhaseCodes, CollectiveAggregator, type, types.ModuleType, types.FunctionType,
              types.MethodType, str)  # fmt: skip

    def size(obj: Any) -> int:
        if id(obj) in seen or isinstance(obj, shared) or obj is None:
            return 0
        if isinstance(obj, int) and -5 <= obj <= 256:
            return 0
        if type(obj).__name__ in ("HostClock", "CudaClock"):
            return 0
        seen.add(id(obj))
        n = sys.getsizeof(obj)
        if isinstance(obj, dict):
            n += sum(size(k) + size(v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            n += sum(size(x) for x in obj)
        elif hasattr(obj, "__dict__"):
            n += size(vars(obj))
        elif hasattr(obj, "__slots__"):
            n += sum(size(getattr(obj, a)) for a in obj.__slots__ if hasattr(obj, a))
        return n

    return size(root)


class _Empty:
    """An observer that does nothing (its callbacks, timed, calibrate the timing)."""

    def on_phase_start(self, *_: Any) -> None:
        pass

    on_phase_end = on_collective = on_collective_launch = on_offload = on_phase_start


def measure_stage(rank: int, stage: int, layers: int, args: argparse.Namespace,
                  server: str | None, spool: str) -> dict[str, Any]:  # fmt: skip
    """One stage on this rank: interleaved blocks with and without the agent, and with a
    do-nothing observer (the timing's own cost per callback)."""
    import zerowatch
    from zerowatch.examples.gpt import GPT, GPTConfig, random_batch

    cfg = GPTConfig(vocab_size=512, seq_len=args.seq, d_model=args.d_model,
                    n_layers=layers, n_heads=4)  # fmt: skip
    torch.manual_seed(0)
    engine, *_ = zerowatch.initialize(model=GPT(cfg), config=ds_config(stage, args.micro_batch))
    from zerowatch.agent.config import AgentConfig

    # One block in len(VARIANTS) is instrumented: a POST per len(VARIANTS) default intervals
    # carries the instrumented steps that one POST carries in a run instrumented throughout.
    interval = AgentConfig().flush_interval(dist.get_world_size()) * len(VARIANTS)
    run = zerowatch.instrument(engine, server=server, run=f"overhead-stage{stage}-{layers}l",
                               project="bench", spool_dir=spool,
                               flush_interval_s=interval)  # fmt: skip
    recorder = run._recorder
    first_event: list[Any] = []
    submit = run._transport.submit

    kept = 0
    draft_sizes: list[int] = []

    def keep(build: Any) -> None:
        # The recorder hands over each step as a callable that the shipper thread calls to
        # build its StepEvent; keep a sample of the events it builds, with and without
        # spans (every 10th step).
        nonlocal kept
        if kept < 2:  # the two warm-up steps, before anything is timed
            draft_sizes.append(queued_size(build))
        if kept < 20:
            kept += 1

            def built() -> Any:
                event = build()
                first_event.append(event)
                return event

            submit(built)
        else:
            submit(build)

    recorder._emit = keep
    engine.remove_observer(recorder)
    accounted = Accounted(recorder)
    empty = Accounted(_Empty())
    log_cpu = 0.0
    x, y = random_batch(cfg, args.micro_batch, seed=rank)

    def steps(n: int, with_agent: bool) -> list[tuple[float, float, float]]:
        """(wall, process CPU over all threads, training-thread CPU) seconds per step."""
        nonlocal log_cpu
        times = []
        for _ in range(n):
            t0, c0, l0 = time.perf_counter(), time.process_time(), time.thread_time()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if with_agent:
                value = loss.item()
                t_log = time.thread_time()
                run.log(loss=value, tokens=x.numel())
                log_cpu += time.thread_time() - t_log
            else:
                loss.item()
            times.append((time.perf_counter() - t0, time.process_time() - c0,
                          time.thread_time() - l0))  # fmt: skip
        return times

    steps(3, False)  # warm-up
    # Start-up stays out of the figures: two instrumented steps, shipped (the run's
    # creation, the first connection), before the shipper's CPU clock is first read.
    engine.add_observer(recorder)
    steps(2, False)
    engine.remove_observer(recorder)
    shipper = run._transport._thread
    shipped = run._transport.stats
    deadline = time.monotonic() + 30
    while shipped.sent + shipped.spooled < shipped.submitted and time.monotonic() < deadline:
        time.sleep(0.05)
    shipper_clock = time.pthread_getcpuclockid(shipper.ident) if shipper.ident else None
    shipper_cpu0 = time.clock_gettime(shipper_clock) if shipper_clock is not None else 0.0
    plain: list[tuple[float, float, float]] = []
    agent: list[tuple[float, float, float]] = []
    for r in range(args.repeats):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            if variant == "agent":
                engine.add_observer(accounted)
                agent += steps(args.steps, True)
                engine.remove_observer(accounted)
            elif variant == "empty":
                engine.add_observer(empty)
                steps(args.steps, False)
                engine.remove_observer(empty)
            else:
                plain += steps(args.steps, False)
    # What the measured steps handed over is shipped (or spooled) before the clock is read.
    deadline = time.monotonic() + interval + 30
    while shipped.sent + shipped.spooled < shipped.submitted and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.add_observer(recorder)
    shipper_cpu = (
        time.clock_gettime(shipper_clock) - shipper_cpu0 if shipper_clock is not None else 0.0
    )
    run.close()
    event_bytes = 0
    if first_event:  # mean in-memory size of a StepEvent, as the shipper builds it
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        copies = [copy.deepcopy(e) for _ in range(10) for e in first_event]
        event_bytes = (tracemalloc.get_traced_memory()[0] - before) // len(copies)
        tracemalloc.stop()
    per_call_timer = empty.cpu_s / max(empty.calls, 1)
    hooks_cpu = (accounted.cpu_s - accounted.calls * per_call_timer) / max(len(agent), 1)
    return {
        **{f"plain_{k}": statistics.median(t[i] for t in plain) for i, k in enumerate(KINDS)},
        **{f"agent_{k}": statistics.median(t[i] for t in agent) for i, k in enumerate(KINDS)},
        "stats": run.stats,
        # The agent's own CPU per instrumented step: its engine callbacks and run.log (on
        # whatever thread ran them), and its shipper thread (encode, gzip, POST).
        "hooks_cpu": hooks_cpu + log_cpu / max(len(agent), 1),
        "callback_us": 1e6 * hooks_cpu / max(accounted.calls / max(len(agent), 1), 1),
        "timer_us": per_call_timer * 1e6,
        "callbacks": accounted.calls / max(len(agent), 1),
        "shipper_cpu": shipper_cpu / max(len(agent), 1),
        "event_bytes": event_bytes,
        "draft_bytes": sum(draft_sizes) // max(len(draft_sizes), 1),
        "queue_size": run.config.queue_size,
    }


def measure_rank(rank: int, args: argparse.Namespace, port: int, server: str | None,
                 spool: str, out: str) -> None:  # fmt: skip
    torch.set_num_threads(1)
    backend = "nccl" if args.cuda else "gloo"
    if args.cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world(args), timeout=timedelta(seconds=300))  # fmt: skip
    results = {v: measure_stage(rank, v[0], v[1], args, server, spool) for v in variants(args)}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def variants(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(stage, layers) per row: every stage at --layers, then stage 3 at --deep-layers."""
    rows = [(stage, args.layers) for stage in args.stages]
    if args.deep_layers and args.deep_layers != args.layers:
        rows.append((3, args.deep_layers))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--steps", type=int, default=5, help="steps per block")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--deep-layers", type=int, default=48,
                   help="also stage 3 with this many layers of the same width (0: not)")  # fmt: skip
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--no-server", action="store_true", help="spool to disk, no server")
    p.add_argument("--fault", choices=("none", "500", "hang"), default="none",
                   help="ship to a server that answers 500s or never answers")  # fmt: skip
    p.add_argument("--foreign", default="", help="also deepspeed,fsdp2 (agent_overhead_foreign.py)")
    p.add_argument("--cuda", action="store_true",
                   help="one NCCL rank on the GPU instead of two gloo ranks on the CPU")  # fmt: skip
    args = p.parse_args()
    args.stages = [int(s) for s in args.stages.split(",")]

    ranks, wall = run_ranks(measure_rank, args)

    print(f"agent overhead: {world(args)} {'NCCL rank on ' + torch.cuda.get_device_name() if args.cuda else 'gloo ranks'}, GPT d_model={args.d_model} layers={args.layers} "
          f"seq={args.seq} micro-batch={args.micro_batch}, {args.repeats} repeats x "
          f"{args.steps} steps per variant, {where(args)}, "
          f"{wall:.0f} s")  # fmt: skip
    print(f"{'stage':>5}  {'layers':>6}  {'plain ms':>9}  {'agent ms':>9}  {'wall':>6}  {'CPU ms':>7}  "
          f"{'CPU':>6}  {'loop':>6}  {'hooks ms':>8}  {'callbacks':>9}  {'us/cb':>5}  {'shipper ms':>10}  {'agent %':>7}  {'event KiB':>9}  {'draft KiB':>9}  {'queue peak':>10}  "
          f"{'queue bound MiB':>15}  {'sent':>5}  {'spooled':>7}  {'dropped':>7}")  # fmt: skip
    for v in variants(args):
        stage, layers = v
        per_rank = [r[v] for r in ranks]

        def med(key: str, rows: list[dict[str, Any]] = per_rank) -> float:
            return statistics.median(r[key] for r in rows)

        ratio = {k: med(f"agent_{k}") / med(f"plain_{k}") for k in KINDS}
        event = max(r["event_bytes"] for r in per_rank)
        draft = max(r["draft_bytes"] for r in per_rank)
        peak = max(r["stats"]["queue_peak"] for r in per_rank)
        bound = per_rank[0]["queue_size"] * max(event, draft) / 2**20
        sent = sum(r["stats"]["sent"] for r in per_rank)
        spooled = sum(r["stats"]["spooled"] for r in per_rank)
        dropped = sum(r["stats"]["dropped_events"] for r in per_rank)
        print(f"{stage:>5}  {layers:>6}  {med('plain_wall') * 1e3:>9.2f}  {med('agent_wall') * 1e3:>9.2f}  "
              f"{ratio['wall']:>6.3f}  {med('plain_cpu') * 1e3:>7.2f}  {ratio['cpu']:>6.3f}  "
              f"{ratio['loop']:>6.3f}  {med('hooks_cpu') * 1e3:>8.3f}  "
              f"{med('callbacks'):>9.0f}  {med('callback_us'):>5.2f}  "
              f"{med('shipper_cpu') * 1e3:>10.3f}  "
              f"{100 * (med('hooks_cpu') + med('shipper_cpu')) / med('plain_cpu'):>7.2f}  "
              f"{event / 1024:>9.1f}  {draft / 1024:>9.1f}  {peak:>10}  {bound:>15.1f}  "
              f"{sent:>5}  {spooled:>7}  {dropped:>7}")  # fmt: skip
    for v in variants(args):
        per_rank = [r[v] for r in ranks]
        calls = statistics.median(r["callbacks"] for r in per_rank)
        timer = statistics.median(r["timer_us"] for r in per_rank)
        print(
            f"stage {v[0]}, {v[1]} layers: {calls:.0f} engine callbacks per step; hooks ms "
            f"excludes the timing's own {timer:.2f} us per callback, measured around a "
            f"do-nothing observer in training ({calls * timer / 1e3:.3f} ms per step)"
        )
    if args.cuda:
        print(nvml_cost_line())
    if args.foreign:  # DeepSpeed and FSDP2, measured the same way by the companion script
        from agent_overhead_foreign import run as run_foreign

        run_foreign(argparse.Namespace(**{**vars(args), "engines": args.foreign.split(","),
                                          "stages": [s for s in args.stages if s > 0] or [3]}))  # fmt: skip


def nvml_cost_line(n: int = 100, nvml: Any = None, device: Any = None) -> str:
    """The GPU probe's cost: one NVML sample of the rank's GPU (every reading the agent
    takes), timed n times back to back on this thread; at one sample a second its cost per
    second is one sample's. `nvml` (default `pynvml`) and `device` (default cuda:0) let a
    scripted stand-in be measured the same way."""
    import time

    from zerowatch.agent.errors import AgentHealth
    from zerowatch.agent.probes import gpu

    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        ident = gpu.device_identity(device if device is not None else torch.device("cuda", 0))
        reader = gpu.NvmlReader(nvml, gpu.nvml_handle(nvml, ident), AgentHealth())
    except Exception as e:  # no pynvml, no driver
        return f"NVML sampling: not measured ({type(e).__name__}: {e})"
    reader.sample()  # the error counts' zero, the NVLink counters' first reading
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        sample = reader.sample()
    wall, cpu = (time.perf_counter() - wall0) / n, (time.thread_time() - cpu0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        gpu.summarize([sample], samples=1)
    fold = (time.perf_counter() - t0) / n
    have = sorted(k for k in sample.__slots__ if getattr(sample, k) is not None and k != "time")
    reader.close()
    return (
        f"NVML sampling: {wall * 1e3:.3f} ms per sample ({cpu * 1e3:.3f} ms CPU) on the "
        f"sampler thread = {wall * 1e3:.3f} ms per second at 1 Hz ({wall * 100:.3f}% of a "
        f"core); {fold * 1e6:.1f} us per step on the shipper thread to fold; readings "
        f"supported: {', '.join(have)}"
    )


def where(args: argparse.Namespace) -> str:
    if args.fault != "none":
        return f"a server that {'answers 500s' if args.fault == '500' else 'never answers'}"
    return "no server (spool)" if args.no_server else "server on 127.0.0.1"


if __name__ == "__main__":
    main()
