"""What the agent costs a DeepSpeed or FSDP2 training step: the same 2-rank gloo training
with and without `zerowatch.instrument`, interleaved in one run.

    DS_ACCELERATOR=cpu python bench/agent_overhead_foreign.py           # DeepSpeed ZeRO-1..3, FSDP2
    python bench/agent_overhead_foreign.py --engines fsdp2              # no DeepSpeed needed
    python bench/agent_overhead_foreign.py --no-server                  # spool to disk instead

The companion of bench/agent_overhead.py (the bundled engine), with the same method: every
rank builds the engine (DeepSpeed from `deepspeed.initialize`, or a small GPT with
`fully_shard` on each block and the root plus AdamW) and one instrumented run shipping to
a real `zerowatch serve` on 127.0.0.1. Then, `--repeats` times, it trains `--steps` steps
with the adapter detached and `--steps` with it attached (the order alternates between
repeats; by default 60 repeats of one step, so that a burst of load from elsewhere on the
machine falls on both variants alike), timing every step (wall clock, and the rank's CPU time over all its threads),
and prints the median step time of each and their ratio (the goal: at most 1.01), plus
the CPU-time ratio of the training thread alone ("loop": hooks and wrappers, without the
agent's shipper thread), and how many collectives a step makes (each costs the wrapper's
per-call time, printed first). On a
machine shared with other work the wall-clock ratio carries the noise of being
descheduled; the CPU-time ratio does not, and still counts the agent's shipper thread.

Detaching a foreign-engine adapter removes everything it put in place (its module and
optimizer hooks, the wrapped `engine.backward` / `engine.step`, and the torch.distributed
wrappers), so the "plain" steps run exactly the engine's own code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_overhead import run_ranks

WORLD = 2


def _gpt(args: argparse.Namespace) -> tuple[Any, Any]:
    from zerowatch.examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, seq_len=args.seq, d_model=args.d_model,
                    n_layers=args.layers, n_heads=4)  # fmt: skip
    torch.manual_seed(0)
    return GPT(cfg), cfg


def _time_blocks(args: argparse.Namespace, one_step: Any, attach: Any, detach: Any
                 ) -> dict[str, float]:  # fmt: skip
    """Median step wall time and process CPU time with the adapter detached and attached,
    interleaved. CPU time (all threads of the rank, the agent's shipper included) is the
    steadier figure on a shared machine: being descheduled costs wall time, not CPU time."""

    def steps(n: int, wall: list[float], cpu: list[float], thread: list[float]) -> None:
        for _ in range(n):
            t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
            one_step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            thread.append(time.thread_time() - h0)

    detach()
    steps(3, [], [], [])  # warm-up
    plain: tuple[list[float], list[float], list[float]] = ([], [], [])
    agent: tuple[list[float], list[float], list[float]] = ([], [], [])
    for r in range(args.repeats):
        for with_agent in (False, True) if r % 2 == 0 else (True, False):
            if with_agent:
                attach()
                steps(args.steps, *agent)
                detach()
            else:
                steps(args.steps, *plain)
    attach()
    return {"plain": statistics.median(plain[0]), "agent": statistics.median(agent[0]),
            "plain_cpu": statistics.median(plain[1]), "agent_cpu": statistics.median(agent[1]),
            "plain_thread": statistics.median(plain[2]),
            "agent_thread": statistics.median(agent[2])}  # fmt: skip


def _collectives_per_step(one_step: Any, adapter: Any) -> float:
    """How many collectives zerowatch sees in one step (the wrapper's call rate)."""
    calls = [0]

    class Count:
        def on_collective(self, record: Any) -> None:
            calls[0] += 1

    counter = Count()
    adapter.board.observers.add(counter)
    try:
        for _ in range(3):
            one_step()
    finally:
        adapter.board.observers.remove(counter)
    return calls[0] / 3


def _deepspeed_job(model: Any, variant: str, args: argparse.Namespace, server: str | None,
                   spool: str) -> tuple[Any, Any]:  # fmt: skip
    """A DeepSpeed engine over `model`: (its run, one training step)."""
    import deepspeed

    import zerowatch

    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": int(variant[-1]), "overlap_comm": True},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=model.parameters())  # fmt: skip
    run = zerowatch.instrument(engine, server=server, project="bench",
                               run=f"overhead-ds-{variant}", spool_dir=spool)  # fmt: skip

    def step(x: Any, y: Any) -> Any:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return run, step


def _fsdp2_job(model: Any, server: str | None, spool: str) -> tuple[Any, Any]:
    """`fully_shard` on each block and the root, AdamW: (its run, one training step)."""
    from torch.distributed.fsdp import fully_shard

    import zerowatch

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = zerowatch.instrument(model, optimizer=opt, server=server, project="bench",
                               run="overhead-fsdp2", spool_dir=spool)  # fmt: skip

    def step(x: Any, y: Any) -> Any:
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return run, step


def measure_rank(rank: int, args: argparse.Namespace, port: int, server: str | None,
                 spool: str, out: str) -> None:  # fmt: skip
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    from zerowatch.examples.gpt import random_batch

    results: dict[str, dict[str, float]] = {}
    for engine_name in args.engines:
        variants = [f"zero{s}" for s in args.stages] if engine_name == "deepspeed" else ["full"]
        for variant in variants:
            model, cfg = _gpt(args)
            x, y = random_batch(cfg, args.micro_batch, seed=rank)
            if engine_name == "deepspeed":
                run, train_step = _deepspeed_job(model, variant, args, server, spool)
            else:
                run, train_step = _fsdp2_job(model, server, spool)
            adapter, recorder = run._adapter, run._recorder

            def one_step(run: Any = run, train_step: Any = train_step, x: Any = x,
                         y: Any = y) -> None:  # fmt: skip
                loss = train_step(x, y)
                if run._adapter.board.observers:
                    run.log(loss=loss.item(), tokens=x.numel())
                else:
                    loss.item()

            timing = _time_blocks(args, one_step, lambda a=adapter, r=recorder: a.attach(r),
                                  lambda a=adapter, r=recorder: a.detach(r))  # fmt: skip
            timing["calls"] = _collectives_per_step(one_step, adapter)  # attached again
            run.close()
            results[f"{engine_name} {variant}"] = {**timing, **run.stats}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def wrapper_cost_us(calls: int = 20000) -> float:
    """Microseconds zerowatch adds to one collective call: its torch.distributed wrapper,
    the purpose lookup and the agent's per-step aggregation, around a no-op collective
    (in this process, no process group: the wrapper is told the group has two ranks)."""
    from zerowatch.agent.adapters import dist_wrap
    from zerowatch.agent.adapters.foreign import PhaseBoard
    from zerowatch.agent.probes import CollectiveAggregator

    def noop(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    hub = dist_wrap._Hub()
    hub.world = lambda group: 2  # type: ignore[assignment,method-assign]
    wrapped = hub.wrap(noop, dist_wrap.SPECS["all_reduce"])
    board = PhaseBoard()
    hub.taps = (board.tap,)
    aggregator = CollectiveAggregator()

    class Sink:
        def on_collective(self, record: Any) -> None:
            aggregator.record(record)

    board.observers.add(Sink())
    board.start("backward")
    t = torch.ones(8)
    cost = []
    for fn in (noop, wrapped):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(t)
        cost.append((time.perf_counter() - t0) / calls)
    return (cost[1] - cost[0]) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="deepspeed,fsdp2")
    p.add_argument("--stages", default="1,2,3", help="DeepSpeed ZeRO stages")
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--steps", type=int, default=1, help="steps per block (1: alternate every step)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--no-server", action="store_true", help="spool to disk, no server")
    args = p.parse_args()
    args.engines = [e for e in args.engines.split(",") if e]
    args.stages = [int(s) for s in args.stages.split(",")]
    run(args)


def run(args: argparse.Namespace) -> None:
    """Measure and print, for `args.engines` ("deepspeed", "fsdp2") and DeepSpeed's
    `args.stages`; bench/agent_overhead.py calls this for its `--foreign` engines."""
    if "deepspeed" in args.engines:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    ranks, wall = run_ranks(measure_rank, args)

    print(f"agent overhead on foreign engines: {WORLD} gloo ranks, GPT d_model={args.d_model} "
          f"layers={args.layers} seq={args.seq} micro-batch={args.micro_batch}, "
          f"{args.repeats} repeats x {args.steps} steps per variant, "
          f"{'no server (spool)' if args.no_server else 'server on 127.0.0.1'}, {wall:.0f} s")  # fmt: skip
    print(f"zerowatch's cost per collective call (wrapper + aggregation, no-op collective): "
          f"{wrapper_cost_us():.1f} us")  # fmt: skip
    header = (f"{'engine':<15}  {'plain ms':>9}  {'agent ms':>9}  {'ratio':>6}  "
              f"{'plain cpu ms':>12}  {'agent cpu ms':>12}  {'cpu ratio':>9}  "
              f"{'loop cpu ratio':>14}  {'calls/step':>10}  {'sent':>5}  {'dropped':>7}")  # fmt: skip
    print(header)
    for name in ranks[0]:
        per_rank = [r[name] for r in ranks]
        med = {k: statistics.median(r[k] for r in per_rank)
               for k in ("plain", "agent", "plain_cpu", "agent_cpu", "plain_thread",
                         "agent_thread", "calls")}  # fmt: skip
        sent = sum(int(r.get("sent", 0)) for r in per_rank)
        dropped = sum(int(r.get("dropped_events", 0)) for r in per_rank)
        print(f"{name:<15}  {med['plain'] * 1e3:>9.2f}  {med['agent'] * 1e3:>9.2f}  "
              f"{med['agent'] / med['plain']:>6.3f}  {med['plain_cpu'] * 1e3:>12.2f}  "
              f"{med['agent_cpu'] * 1e3:>12.2f}  {med['agent_cpu'] / med['plain_cpu']:>9.3f}  "
              f"{med['agent_thread'] / med['plain_thread']:>14.3f}  {med['calls']:>10.0f}  "
              f"{sent:>5}  {dropped:>7}")  # fmt: skip


if __name__ == "__main__":
    main()
