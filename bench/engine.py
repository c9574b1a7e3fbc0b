"""Engine benchmark: zerowatch's ZeRO stages next to torch DDP, FSDP2, ZeroRedundancyOptimizer
and DeepSpeed ZeRO 0-3, on 2 gloo ranks of this machine's CPU.

    .venv/bin/python bench/engine.py                    # the table in BENCHMARKS.md
    .venv/bin/python bench/engine.py --no-deepspeed     # without the deepspeed extra
    .venv/bin/python bench/engine.py --floor            # + stage 3's floor (DDP + one all-gather)

Every contender trains the same small GPT (zerowatch.examples.gpt; d_model 256 by default)
with AdamW, gradient clipping 1.0, fp32, on the same batches. All contenders live in the same
two processes and take turns (interleaved): each repeat runs every contender for one warm-up
step and `--steps` timed steps, so drift in the machine's load hits all of them alike. The
table reports the median step time over all repeats (wall clock, and CPU time of the rank's
process over all its threads, which being descheduled on a shared machine does not
inflate), and the model-state bytes each rank holds at the end of a backward, before the
optimizer step, when every framework holds its gradients (parameters, gradients,
optimizer state, master weights and the frameworks' own persistent buffers: every tensor
storage reachable from the model, the optimizer and the engine, counted once), all also as
ratios to DDP.

With `--floor` one more contender takes its turns: an all-gather of all Ψ parameters (fp32,
each rank contributing its half, through the engine's own comm module: on gloo its ring over
send/recv). ZeRO-3 moves 3Ψ per step where DDP moves 2Ψ (an all-reduce is a
reduce-scatter and an all-gather), so DDP's step plus one more all-gather of Ψ is what
stage 3 would take if it added nothing but that traffic and hid none of it: the row
"floor" prints that sum next to the stages.

DeepSpeed runs with DS_ACCELERATOR=cpu on gloo; its CPU-offload Adam is a C++ op built with
gcc on first use (cached in TORCH_EXTENSIONS_DIR). It is optional (`pip install
'zerowatch[deepspeed]'`): without it, its rows say so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions")
)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from zerowatch.examples.gpt import GPT, GPTConfig, random_batch

LR, CLIP = 1e-3, 1.0


# -- measuring what a trainer holds ---------------------------------------------------------


def held_bytes(*roots: Any, max_depth: int = 6) -> int:
    """Bytes of every tensor storage reachable from `roots` (modules, optimizers, engines),
    each storage counted once. Follows module parameters/buffers/grads (and DeepSpeed's
    `ds_tensor` shards), optimizer state, containers and the attributes of framework
    objects (torch.distributed, deepspeed, zerowatch)."""
    seen_obj: set[int] = set()
    storages: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        if hasattr(t, "_local_tensor"):  # DTensor (FSDP2): its local shard
            t = t._local_tensor
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if st.nbytes():
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())

    def walk(obj: Any, depth: int) -> None:
        if obj is None or depth > max_depth or id(obj) in seen_obj:
            return
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            add(obj)
            if obj.grad is not None:
                add(obj.grad)
            ds = getattr(obj, "ds_tensor", None)
            if isinstance(ds, torch.Tensor):
                add(ds)
            return
        if isinstance(obj, nn.Module):
            for t in [*obj.parameters(), *obj.buffers()]:
                walk(t, depth + 1)
        if isinstance(obj, torch.optim.Optimizer):
            walk(obj.state, depth + 1)
            walk(obj.param_groups, depth + 1)
        if isinstance(obj, dict):
            for v in list(obj.values()):
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in list(obj):
                walk(v, depth + 1)
        mod = type(obj).__module__ or ""
        if mod.startswith(("zerowatch", "deepspeed", "torch.distributed", "torch.optim")) and \
                hasattr(obj, "__dict__"):  # fmt: skip
            for v in list(vars(obj).values()):
                walk(v, depth + 1)

    for r in roots:
        walk(r, 0)
    return sum(storages.values())


# -- contenders ------------------------------------------------------------------------------


class Trainer:
    """One contender: `backward(x, y)` then `update()` train one step; `roots` are what it
    holds (measured between the two, when every framework holds its gradients)."""

    def __init__(self, backward: Callable[[torch.Tensor, torch.Tensor], None],
                 update: Callable[[], None], roots: list[Any]) -> None:  # fmt: skip
        self.backward, self.update, self.roots = backward, update, roots

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.backward(x, y)
        self.update()


def _model(cfg: GPTConfig) -> nn.Module:
    torch.manual_seed(0)
    return GPT(cfg)


def ddp(cfg: GPTConfig, zero_optimizer: bool = False) -> Trainer:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(cfg), gradient_as_bucket_view=True)
    opt: torch.optim.Optimizer
    if zero_optimizer:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def backward(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y).backward()

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return Trainer(backward, update, [model, opt])


def fsdp2(cfg: GPTConfig) -> Trainer:
    from torch.distributed.fsdp import fully_shard

    model = _model(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def backward(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y).backward()

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return Trainer(backward, update, [model, opt])


def ds_config(cfg: GPTConfig, stage: int, offload: bool, micro_batch: int) -> dict[str, Any]:
    """One config for zerowatch and DeepSpeed alike (DeepSpeed's "auto" sizes for d_model)."""
    h = cfg.d_model
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 2_000_000,
        "allgather_bucket_size": 2_000_000,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def zerowatch_engine(cfg: GPTConfig, stage: int, offload: bool, micro_batch: int) -> Trainer:
    import zerowatch

    engine, *_ = zerowatch.initialize(model=_model(cfg),
                                      config=ds_config(cfg, stage, offload, micro_batch))  # fmt: skip

    return Trainer(lambda x, y: engine.backward(engine(x, y)), engine.step,
                   [engine, engine.module, engine.optimizer])  # fmt: skip


def deepspeed_engine(cfg: GPTConfig, stage: int, offload: bool, micro_batch: int) -> Trainer:
    import deepspeed

    config = ds_config(cfg, stage, offload, micro_batch)
    if offload:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
    else:  # FusedAdam is CUDA-only: DeepSpeed's documented switch to torch's AdamW
        config["optimizer"]["params"]["torch_adam"] = True
    model = _model(cfg)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=config, dist_init_required=False)  # fmt: skip

    return Trainer(lambda x, y: engine.backward(engine(x, y)), engine.step,
                   [engine, engine.module, opt])  # fmt: skip


#: The contender that times one all-gather of Ψ (`--floor`); not a trainer, not in the table.
GATHER = "one all-gather of Ψ"


def all_gather_of_psi(cfg: GPTConfig) -> Trainer:
    """One all-gather of every parameter (fp32) through zerowatch's comm module, as stage 3
    issues them: each rank gives its half of the flat parameters."""
    from zerowatch.engine.comm import Comm
    from zerowatch.engine.hooks import ObserverRegistry

    comm = Comm(ObserverRegistry())
    psi = sum(p.numel() for p in _model(cfg).parameters())
    full = torch.zeros(psi + psi % comm.world_size)
    shard = full.narrow(0, comm.rank * (full.numel() // comm.world_size),
                        full.numel() // comm.world_size).clone()  # fmt: skip

    def gather() -> None:
        comm.all_gather(full, shard, purpose="other")

    return Trainer(lambda x, y: None, gather, [])


def contenders(args: argparse.Namespace) -> dict[str, Callable[[], Trainer]]:
    cfg = gpt_config(args)
    mb = args.micro_batch
    out: dict[str, Callable[[], Trainer]] = {
        "torch DDP": lambda: ddp(cfg),
        "torch ZeroRedundancyOptimizer": lambda: ddp(cfg, zero_optimizer=True),
        "torch FSDP2 (fully_shard)": lambda: fsdp2(cfg),
    }
    if args.floor:
        out[GATHER] = lambda: all_gather_of_psi(cfg)
    variants = [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True)]
    for stage, off in variants:
        suffix = f"stage {stage}" + (" + CPU offload" if off else "")
        out[f"zerowatch {suffix}"] = lambda s=stage, o=off: zerowatch_engine(cfg, s, o, mb)
        if not args.no_deepspeed:
            out[f"DeepSpeed {suffix}"] = lambda s=stage, o=off: deepspeed_engine(cfg, s, o, mb)
    return out


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                     n_layers=args.layers, n_heads=args.d_model // 64, tied=True)  # fmt: skip


# -- the run ---------------------------------------------------------------------------------


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_file: str) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    cfg = gpt_config(args)
    trainers: dict[str, Trainer] = {}
    errors: dict[str, str] = {}
    for name, build in contenders(args).items():
        if args.only and name != GATHER and not any(o.lower() in name.lower() for o in args.only):
            continue
        try:
            trainers[name] = build()
        except Exception as e:  # a contender that cannot run here is reported, not fatal
            errors[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            if rank == 0 and args.verbose:
                traceback.print_exc()
        dist.barrier()
    times: dict[str, list[float]] = {n: [] for n in trainers}
    cpu: dict[str, list[float]] = {n: [] for n in trainers}
    batches = [random_batch(cfg, args.micro_batch * world, seed=s) for s in range(args.steps + 1)]
    lo, hi = rank * args.micro_batch, (rank + 1) * args.micro_batch
    for rep in range(args.repeats):
        order = list(trainers)
        order = order[rep % len(order) :] + order[: rep % len(order)]  # rotate the start
        for name in order:
            trainer = trainers[name]
            for i, (x, y) in enumerate(batches):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                trainer.step(x[lo:hi], y[lo:hi])
                c1 = time.process_time()
                dist.barrier()
                if i > 0:  # the first step of each turn is a warm-up
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(c1 - c0)
        if rank == 0:
            print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    memory = {}
    x, y = batches[0]
    for name, t in trainers.items():  # one more step, measured after its backward
        dist.barrier()
        t.backward(x[lo:hi], y[lo:hi])
        memory[name] = held_bytes(*t.roots)
        t.update()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": times, "cpu": cpu, "memory": memory})
    if rank == 0:
        result = {"config": vars(args), "params": sum(p.numel() for p in _model(cfg).parameters()),
                  "ranks": gathered, "errors": errors}  # fmt: skip
        Path(out_file).write_text(json.dumps(result))
    dist.destroy_process_group()


def table(result: dict[str, Any]) -> str:
    r0 = result["ranks"][0]
    med = {n: statistics.median(ts) * 1e3 for n, ts in r0["times"].items() if ts}
    # CPU time of the busier rank (all its threads): robust to being descheduled.
    cpu = {n: max(statistics.median(r["cpu"][n]) for r in result["ranks"]) * 1e3 for n in med}
    mem = {n: max(r["memory"][n] for r in result["ranks"]) for n in r0["memory"]}
    base_t, base_c, base_m = (d.get("torch DDP") for d in (med, cpu, mem))

    def ratio(v: float, base: float | None) -> str:
        return f"{v / base:.2f}" if base else "–"

    lines = ["| contender | step ms (median) | × DDP | CPU ms per step | × DDP "
             "| model state per rank (MiB) | × DDP |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    gather = med.pop(GATHER, None)
    if gather is not None and base_t:
        # DDP's step plus one more all-gather of Ψ: stage 3's traffic with nothing hidden.
        gather_cpu = cpu[GATHER]
        floor, floor_cpu = base_t + gather, (base_c or 0.0) + gather_cpu
        lines.append(f"| floor: DDP + one all-gather of Ψ ({gather:.1f} ms, CPU {gather_cpu:.1f} ms) "
                     f"| {floor:.1f} | {ratio(floor, base_t)} | {floor_cpu:.1f} | "
                     f"{ratio(floor_cpu, base_c)} | | |")  # fmt: skip
    for n in med:
        lines.append(f"| {n} | {med[n]:.1f} | {ratio(med[n], base_t)} | {cpu[n]:.1f} | "
                     f"{ratio(cpu[n], base_c)} | {mem[n] / 2**20:.1f} | {ratio(mem[n], base_m)} |")  # fmt: skip
    for name, err in result["errors"].items():
        lines.append(f"| {name} | did not run: {err} | | | | | |")
    lines += ["", *goals(med, cpu, floor if gather is not None and base_t else None)]
    return "\n".join(lines)


def goals(med: dict[str, float], cpu: dict[str, float], floor: float | None) -> list[str]:
    """The ratios the engine is held to, from this run (wall clock; CPU in brackets)."""
    pairs = [("zerowatch stage 3", "torch DDP", 1.25),
             ("zerowatch stage 3", "DeepSpeed stage 3", 0.85),
             ("zerowatch stage 3 + CPU offload", "DeepSpeed stage 3 + CPU offload", 0.9),
             *((f"zerowatch stage {s}", "torch DDP", 1.05) for s in (0, 1, 2))]  # fmt: skip
    out = []
    for a, b, goal in pairs:
        if a in med and b in med:
            out.append(f"{a} / {b}: {med[a] / med[b]:.2f} (CPU {cpu[a] / cpu[b]:.2f}); "
                       f"goal <= {goal}")  # fmt: skip
    if floor and "zerowatch stage 3" in med:
        out.append(f"zerowatch stage 3 / floor: {med['zerowatch stage 3'] / floor:.2f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps per contender per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--only", nargs="*", help="run only contenders whose name contains these")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--floor", action="store_true",
                   help="also time one all-gather of Ψ and print DDP + it (stage 3's floor)")  # fmt: skip
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--json", default="", help="also write the raw results here")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_file = args.json or f"/tmp/zerowatch-bench-engine-{os.getpid()}.json"
    try:
        mp.spawn(rank_main, args=(2, port, args, out_file), nprocs=2)
    except mp.ProcessExitedException as e:
        # A gloo teardown abort after the results were written does not void them.
        if not Path(out_file).exists():
            raise
        print(f"note: a rank exited abnormally after writing its results ({e})", file=sys.stderr)
    result = json.loads(Path(out_file).read_text())
    print(f"GPT d_model={args.d_model} layers={args.layers} vocab={args.vocab} seq={args.seq_len} "
          f"micro-batch={args.micro_batch}/rank, {result['params'] / 1e6:.2f}M params, 2 gloo ranks, "
          f"{args.repeats} repeats x {args.steps} steps, fp32 AdamW, clip {CLIP}")  # fmt: skip
    print(table(result))


if __name__ == "__main__":
    main()
