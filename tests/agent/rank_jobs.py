"""What each gloo rank runs in the agent's multi-rank tests: the real engine on the tiny
GPT, instrumented. Functions here are spawned by support.engine_harness.run_ranks, so they
take (rank, world, ...) and return picklable results."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import urllib3
from support.engine_scenarios import TINY, ds_config, make_model, micro_batches
from zerowatch.agent.spool import Spool

import zerowatch
from zerowatch.examples.gpt import GPTConfig

#: Fast shipping for tests: small flush interval, quick retries, short close.
FAST = {"flush_interval_s": 0.1, "retry_max_wait_s": 0.3, "http_timeout_s": 2.0,
        "close_timeout_s": 5.0}  # fmt: skip

#: The configurations the quantities tests cover: every stage, accumulation, overlap,
#: both offloads, mixed precision.
CASES: dict[str, dict[str, Any]] = {
    "stage0": ds_config(0),
    "stage1-offload": ds_config(1, offload_optimizer=True),
    "stage2-ga2-overlap": ds_config(2, ga=2, overlap=True),
    "stage3-bf16-offload": ds_config(
        3, ga=2, precision="bf16", overlap=True, offload_optimizer=True, offload_param=True
    ),
    "stage3": ds_config(3, overlap=True),
}


def train(engine: Any, run: Any, step: int, rank: int, world: int, cfg: GPTConfig = TINY) -> None:
    """One optimizer step of the usual loop, logging loss and tokens per micro-batch."""
    ga = engine.gradient_accumulation_steps
    for x, y in micro_batches(cfg, step, ga, world, rank):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if run is not None:
            run.log(loss=loss.item(), tokens=x.numel())


def instrumented_stages(
    rank: int, world: int, spool_root: str, server: str, steps: int
) -> dict[str, Any]:
    """Each case of CASES, `steps` steps, instrumented with `server` (which may be down)."""
    out = {}
    for name, config in CASES.items():
        engine, *_ = zerowatch.initialize(model=make_model(), config=config)
        with zerowatch.instrument(engine, server=server, run=name, spool_dir=spool_root,
                                  spans_every=2, **FAST) as run:  # fmt: skip
            for s in range(steps):
                train(engine, run, s, rank, world)
        out[name] = {
            "run_id": run.id,
            "stats": run.stats,
            "model_state": engine.model_state_bytes(),
            "theory": engine.theory().flat(),
            "num_parameters": engine.num_parameters,
            "persistent": engine.num_persistent_parameters,
            "zero_stage": engine.zero_stage,
            "ga": engine.gradient_accumulation_steps,
            "precision": engine.precision,
        }
    return out


def through_an_outage(rank: int, world: int, server: str, spool_root: str, flag: str,
                      extra_steps: int, max_steps: int) -> dict[str, Any]:  # fmt: skip
    """Train until the test drops `flag` (the server is back), then `extra_steps` more."""
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(3, overlap=True))
    steps, after = 0, 0
    with zerowatch.instrument(engine, server=server, run="outage", spool_dir=spool_root,
                              **FAST) as run:  # fmt: skip
        while steps < max_steps and after < extra_steps:
            train(engine, run, steps, rank, world)
            steps += 1
            time.sleep(0.03)  # a step of a real job takes a while; let the outage span some
            if Path(flag).exists():
                after += 1
    return {"run_id": run.id, "steps": steps, "stats": run.stats}


#: The model of the fault timing runs: a little larger than TINY.
SMALL = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=2, n_heads=2, tied=False)

#: For the fault timing runs: a request to the hanging server blocks this long.
HTTP_TIMEOUT_S = 3.0
CLOSE_TIMEOUT_S = 1.0


class TrainingThreadIO:
    """Counts HTTP requests and spool writes by the thread they run on while `watching`:
    the agent must leave both to its shipper thread, never to the training loop."""

    def __init__(self) -> None:
        self.watching = False
        self.on_training_thread: Counter[str] = Counter()
        self.elsewhere: Counter[str] = Counter()

    def install(self, setattr_: Any = setattr) -> None:
        """Wrap the methods (for good in a rank's process; pytest's monkeypatch.setattr
        undoes it after a test)."""
        for owner, name, what in (
            (urllib3.HTTPConnectionPool, "urlopen", "http"),
            (Spool, "append", "spool"),
        ):
            setattr_(owner, name, self._counted(getattr(owner, name), what))

    def _counted(self, fn: Any, what: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.watching:
                on_main = threading.current_thread() is threading.main_thread()
                (self.on_training_thread if on_main else self.elsewhere)[what] += 1
            return fn(*args, **kwargs)

        return counted


def _timed(engine: Any, run: Any, rank: int, world: int, n: int, start: int,
           io: TrainingThreadIO | None = None) -> list[float]:  # fmt: skip
    times = []
    if io is not None:
        io.watching = True
    for s in range(start, start + n):
        t0 = time.perf_counter()
        train(engine, run, s, rank, world, SMALL)
        times.append(time.perf_counter() - t0)
    if io is not None:
        io.watching = False
    return times


def step_times_under_faults(rank: int, world: int, urls: dict[str, str], spool_root: str,
                            steps: int, rounds: int) -> dict[str, Any]:  # fmt: skip
    """Step times of the same engine without the agent and with it, shipping to each server
    in `urls` (one answering 500s, one hanging, one down with a tiny spool bound), interleaved
    over `rounds` rounds, and the HTTP requests and spool writes made meanwhile, counted by
    the thread that made them."""
    # Steps of tens of milliseconds, so that scheduling jitter (a few ms on a shared
    # 2-core machine) does not swamp the comparison.
    engine, *_ = zerowatch.initialize(model=make_model(SMALL), config=ds_config(2, overlap=True))
    _timed(engine, None, rank, world, 3, 0)  # warm-up
    times: dict[str, list[float]] = {"none": [], **{k: [] for k in urls}}
    runs: dict[str, Any] = {}
    io = TrainingThreadIO()
    io.install()
    opts = {**FAST, "close_timeout_s": CLOSE_TIMEOUT_S, "http_timeout_s": HTTP_TIMEOUT_S}
    for name, url in urls.items():
        extra = {"max_spool_bytes": 20_000} if name == "full_spool" else {}
        runs[name] = zerowatch.instrument(engine, server=url, run=name,
                                          spool_dir=f"{spool_root}/{name}", **opts, **extra)  # fmt: skip
        engine.remove_observer(runs[name]._recorder)  # attached per round below
    step = 3
    for _ in range(rounds):
        times["none"] += _timed(engine, None, rank, world, steps, step)
        step += steps
        for name, run in runs.items():
            engine.add_observer(run._recorder)
            times[name] += _timed(engine, run, rank, world, steps, step, io)
            engine.remove_observer(run._recorder)
            step += steps
    t0 = time.perf_counter()
    for run in runs.values():
        run.close()
    return {
        "median": {k: statistics.median(v) for k, v in times.items()},
        "max": {k: max(v) for k, v in times.items()},
        "close_s": time.perf_counter() - t0,
        "io_on_training_thread": dict(io.on_training_thread),
        "io_on_shipper": dict(io.elsewhere),
        "stats": {k: r.stats for k, r in runs.items()},
        "run_ids": {k: r.id for k, r in runs.items()},
    }


#: The configurations the profiler cross-check runs: no overlap (every collective exposed)
#: and stage 3 with overlap (prefetched gathers, reduces under the backward).
PROFILED = {"stage1": ds_config(1), "stage3-overlap": ds_config(3, overlap=True)}
#: A model whose compute outweighs the instruments' per-range offsets (TINY's backward is
#: a few ms around 15 reduces): still a second or two per step on one CPU thread.
PROFILED_CFG = GPTConfig(vocab_size=256, seq_len=256, d_model=96, n_layers=2, n_heads=4,
                         tied=False)  # fmt: skip


def profiled_steps(rank: int, world: int, spool_root: str, steps: int) -> dict[str, Any]:
    """Each case of PROFILED, `steps` instrumented steps under torch.profiler (CPU
    activities). Returns per case the run id and, per step, every `zerowatch::<phase>`
    range the profiler saw as (name, start µs, end µs), bracketed by `test::step` ranges."""
    from torch.profiler import ProfilerActivity, profile, record_function

    out = {}
    for name, config in PROFILED.items():
        engine, *_ = zerowatch.initialize(model=make_model(PROFILED_CFG), config=config)
        train(engine, None, 0, rank, world, PROFILED_CFG)  # warm-up: outside profile and run
        with (
            zerowatch.instrument(engine, run=f"profiled-{name}", spool_dir=spool_root,
                                 spans_every=1, **FAST) as run,
            profile(activities=[ProfilerActivity.CPU]) as prof,
        ):  # fmt: skip
            for s in range(steps):
                with record_function(f"test::step {s}"):
                    train(engine, run, s + 1, rank, world, PROFILED_CFG)
        ranges = [
            (e.name, float(e.time_range.start), float(e.time_range.end))
            for e in prof.events()
            if e.name.startswith(("zerowatch::", "test::step"))
        ]
        out[name] = {"run_id": run.id, "ranges": ranges}
    return out
