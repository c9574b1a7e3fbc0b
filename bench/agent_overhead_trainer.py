"""What zerowatch's Hugging Face Trainer callback costs a training step: the same 2-rank
gloo Trainer run with the agent attached and detached, step by step, in one run.

    DS_ACCELERATOR=cpu python bench/agent_overhead_trainer.py               # DDP, ZeRO-2, ZeRO-3
    python bench/agent_overhead_trainer.py --strategies ddp                # no DeepSpeed needed
    python bench/agent_overhead_trainer.py --no-server                     # spool to disk instead

The Trainer companion of bench/agent_overhead_foreign.py, with the same method. Every rank
trains a GPT-2 (`GPT2Config`, 4 layers, n_embd 256, sequence 64, 4 sequences a rank) with
the real `Trainer` and `ZeroWatchCallback` (shipping to a real `zerowatch serve` on
127.0.0.1), logging every step. A second callback alternates the steps: on "plain" steps
the adapter is detached (its hooks, wrapped methods and torch.distributed wrappers gone)
and the zerowatch callback does nothing, on "agent" steps everything is on, the order of
each pair alternating, so that a burst of load from elsewhere falls on both alike. A step
is timed from one `on_step_begin` to the next, so the callback's own `on_log` is inside.
It prints the median step time of each variant (wall clock, the rank's CPU time over all
its threads, and the training thread's CPU time: "loop"), and their ratios.

DDP's gradient all-reduce goes through the communication hook the adapter registers
(dist_wrap.allreduce_seen), which stays on the DDP module once registered: on "plain" steps
it is the plain all-reduce it calls (what DDP's own does), not DDP's C++ default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_overhead import WORLD, run_ranks


def _toggle_callback(zerowatch_cb: Any, warmup: int) -> Any:
    """A TrainerCallback that detaches / re-attaches the agent every step and times steps."""
    from transformers import TrainerCallback

    class Toggle(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: dict[str, list[tuple[float, float, float]]] = {"plain": [], "agent": []}
            self.run: Any = None
            self.variant: str | None = None
            self.mark: tuple[float, float, float] | None = None
            self.n = 0

        def _set(self, variant: str) -> None:
            run = self.run
            if variant == "plain" and zerowatch_cb.run is not None:
                run._adapter.detach(run._recorder)
                zerowatch_cb.run = None
            elif variant == "agent" and zerowatch_cb.run is None:
                run._adapter.attach(run._recorder)
                zerowatch_cb.run = run
            self.variant = variant

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = (time.perf_counter(), time.process_time(), time.thread_time())
            if self.run is None:
                self.run = zerowatch_cb.run
            if self.mark is not None and self.variant is not None and self.n > warmup:
                self.times[self.variant].append(
                    tuple(b - a for a, b in zip(self.mark, now, strict=True))  # type: ignore[arg-type]
                )
            self.n += 1
            # Pairs (plain, agent) then (agent, plain): each variant first half the time.
            pair, second = divmod(self.n, 2)
            first = "plain" if pair % 2 == 0 else "agent"
            other = "agent" if first == "plain" else "plain"
            self._set(other if second else first)
            self.mark = (time.perf_counter(), time.process_time(), time.thread_time())

    return Toggle()


def measure_rank(rank: int, args: argparse.Namespace, port: int, server: str | None,
                 spool_dir: str, tmp: str) -> None:  # fmt: skip
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})  # fmt: skip
    torch.set_num_threads(1)
    from accelerate.state import AcceleratorState
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback
    from zerowatch.integrations.transformers import ZeroWatchCallback

    from zerowatch.examples.integrations.hf_trainer import RandomTokens, strategy_args

    steps = 2 * args.repeats + args.warmup + 2
    out: dict[str, Any] = {}
    for strategy in args.strategies:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=4,
                                           vocab_size=512, n_positions=args.seq))  # fmt: skip
        zw = ZeroWatchCallback(server=server, run=f"bench-{strategy}", spool_dir=spool_dir)
        toggle = _toggle_callback(zw, args.warmup)
        trainer = Trainer(
            model=model,
            args=TrainingArguments(
                output_dir=str(Path(tmp) / strategy), max_steps=steps,
                per_device_train_batch_size=args.micro_batch, learning_rate=1e-4,
                max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=strategy == "ddp", ddp_backend="gloo", disable_tqdm=True,
                **strategy_args(strategy),
            ),
            train_dataset=RandomTokens(n=steps * args.micro_batch * WORLD, seq_len=args.seq,
                                       vocab=512),
            callbacks=[zw, toggle],
        )  # fmt: skip
        trainer.remove_callback(PrinterCallback)  # the logs of every step, on every rank
        trainer.train()
        stats = toggle.run.stats if toggle.run is not None else {}
        med = {
            f"{v}{suffix}": statistics.median(t[i] for t in toggle.times[v])
            for v in ("plain", "agent")
            for i, suffix in enumerate(("", "_cpu", "_thread"))
        }
        out[strategy] = {**med, "sent": stats.get("sent", 0),
                         "dropped_events": stats.get("dropped_events", 0)}  # fmt: skip
        AcceleratorState._reset_state(reset_partial_state=True)
    torch.save(out, Path(tmp) / f"rank{rank}.pt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", default="ddp,deepspeed-zero2,deepspeed-zero3")
    p.add_argument("--repeats", type=int, default=40, help="steps of each variant")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--no-server", action="store_true", help="spool to disk, no server")
    p.add_argument("--fault", default="none", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.strategies = [s for s in args.strategies.split(",") if s]
    if any(s.startswith("deepspeed") for s in args.strategies):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    ranks, wall = run_ranks(measure_rank, args)

    print(f"agent overhead under the Hugging Face Trainer: {WORLD} gloo ranks, GPT-2 "
          f"n_embd={args.d_model} layers={args.layers} seq={args.seq} "
          f"batch={args.micro_batch}/rank, {args.repeats} steps per variant, "
          f"{'no server (spool)' if args.no_server else 'server on 127.0.0.1'}, {wall:.0f} s")  # fmt: skip
    print(f"{'strategy':<16}  {'plain ms':>9}  {'agent ms':>9}  {'ratio':>6}  "
          f"{'plain cpu ms':>12}  {'agent cpu ms':>12}  {'cpu ratio':>9}  "
          f"{'loop cpu ratio':>14}  {'sent':>5}  {'dropped':>7}")  # fmt: skip
    for name in ranks[0]:
        per_rank = [r[name] for r in ranks]
        med = {k: statistics.median(r[k] for r in per_rank)
               for k in ("plain", "agent", "plain_cpu", "agent_cpu", "plain_thread",
                         "agent_thread")}  # fmt: skip
        sent = sum(int(r.get("sent", 0)) for r in per_rank)
        dropped = sum(int(r.get("dropped_events", 0)) for r in per_rank)
        print(f"{name:<16}  {med['plain'] * 1e3:>9.2f}  {med['agent'] * 1e3:>9.2f}  "
              f"{med['agent'] / med['plain']:>6.3f}  {med['plain_cpu'] * 1e3:>12.2f}  "
              f"{med['agent_cpu'] * 1e3:>12.2f}  {med['agent_cpu'] / med['plain_cpu']:>9.3f}  "
              f"{med['agent_thread'] / med['plain_thread']:>14.3f}  {sent:>5}  {dropped:>7}")  # fmt: skip


if __name__ == "__main__":
    main()
