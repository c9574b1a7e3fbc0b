"""The engine on one GPU, case by case, ending with one table (`make gpu-check`, docs/gpu.md).

    python bench/gpu_check.py                 # on CUDA; every case skips without it
    python bench/gpu_check.py --device cpu    # the same cases on the CPU: a smoke test

Cases (each trains the tiny GPT of the engine tests and compares the final weights with
torch.optim.AdamW training the plain model, on the same device):

* `pytest -m gpu`: every test file holding a `gpu` mark, in a subprocess;
* stages 0-3, with and without optimizer / parameter offload, one process (stage 3 with
  offload_param in fp32 among them);
* a one-rank group made by the script with "nccl", with no backend, and with
  "cpu:gloo,cuda:nccl": the engine must pick the GPU for each (on --device cpu: "gloo");
* torch's own flight recorder of an NCCL group, read as a stalled heartbeat reads it;
* two processes sharing the GPU over gloo, for the stages whose collectives gloo accepts on
  CUDA tensors (probed first): the engine's multi-rank path (reduce-scatter, all-gather,
  the CUDA-event timing of asynchronous work) on CUDA tensors. The engine trains on the CPU
  under a gloo group, so these ranks place it on the GPU themselves.

Exit status 1 when a case fails; skipped cases (no CUDA, gloo refusing an op) do not fail.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# tests/ for the engine tests' scenarios; not the root: zerowatch comes installed (its
# subpackages live in other folders of the tree: pyproject's package-dir).
sys.path.insert(0, str(ROOT / "tests"))
#: Run Python without the working directory on sys.path (3.11+), for the same reason.
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from support.engine_harness import run_ranks  # noqa: E402
from support.engine_scenarios import (  # noqa: E402
    CLIP,
    LR,
    MICRO_BATCH,
    TINY,
    WEIGHT_DECAY,
    ds_config,
    make_model,
    max_relative_error,
    micro_batches,
)

import zerowatch  # noqa: E402
from zerowatch.examples.gpt import random_batch  # noqa: E402

#: Relative weight error tolerated against the reference on the same device (the engine's
#: flat buffers and the offloaded CPU step round differently from the plain model's).
TOLERANCE = 1e-4
#: Each rank's collective timeout in the two-process cases (a refused op must not hang).
RANK_TIMEOUT_S = 120.0
#: The `gpu` tests' limit, so that the table comes within make gpu-check's 330 s (the
#: agent's overhead benchmark follows it within the 8 minutes).
PYTEST_TIMEOUT_S = 200.0
OFFLOADS: dict[int, list[tuple[str, ...]]] = {
    0: [()], 1: [(), ("offload_optimizer",)], 2: [(), ("offload_optimizer",)],
    3: [(), ("offload_optimizer",), ("offload_param",), ("offload_optimizer", "offload_param")],
}  # fmt: skip
#: The collectives each stage sends per step (zerowatch/rehearse/counts.py), beside the set-up broadcast.
STAGE_OPS = {0: {"all_reduce"}, 1: {"all_reduce", "reduce_scatter", "all_gather"},
             2: {"all_reduce", "reduce_scatter", "all_gather"},
             3: {"all_reduce", "reduce_scatter", "all_gather"}}  # fmt: skip


@dataclass
class Row:
    case: str
    device: str
    error: float | None
    result: str  # PASS, FAIL or SKIP (with the reason after a colon)
    seconds: float


# -- training ------------------------------------------------------------------------------


def reference_state(device: torch.device, steps: int, world: int = 1) -> dict[str, torch.Tensor]:
    """The plain model and torch AdamW on `device`, the same global batches as the engine."""
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for s in range(steps):
        x, y = random_batch(TINY, MICRO_BATCH * world, seed=1000 + s)
        opt.zero_grad()
        model(x.to(device), y.to(device)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def engine_state(config: dict[str, Any], steps: int, world: int = 1, rank: int = 0,
                 ) -> tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]:  # fmt: skip
    """Train the engine; (its device, its consolidated fp32 weights on the CPU: rank 0's,
    {} on the other ranks, and what this rank holds whole, in fp32 on the CPU)."""
    engine, *_ = zerowatch.initialize(model=make_model(), config=config)
    for s in range(steps):
        for x, y in micro_batches(TINY, s, 1, world, rank):
            engine.backward(engine(x, y))
            engine.step()
    state = {k: v.cpu() for k, v in engine.consolidated_state_dict().items()}
    local = {k: v.detach().float().cpu()
             for k, v in engine.module.state_dict().items() if v.numel()}  # fmt: skip
    device = str(engine.device)
    engine.destroy()
    return device, state, local


def config_name(stage: int, offload: tuple[str, ...]) -> str:
    return f"stage{stage}-{'+'.join(offload) or 'no_offload'}-fp32"


# -- the cases ------------------------------------------------------------------------------


def timed(case: str, device: str, fn: Callable[[], tuple[str, float | None, str]]) -> Row:
    t0 = time.perf_counter()
    try:
        dev, err, result = fn()
    except Exception as e:  # a case's failure is a row, not the end of the check
        traceback.print_exc()
        dev, err, result = device, None, f"FAIL: {type(e).__name__}: {str(e)[:80]}"
    return Row(case, dev, err, result, time.perf_counter() - t0)


def verdict(err: float, device: str, want: str) -> str:
    if not device.startswith(want):
        return f"FAIL: trained on {device}, not {want}"
    return "PASS" if err < TOLERANCE else f"FAIL: error above {TOLERANCE:g}"


def pytest_case(device: str) -> Row:
    """Every test file that holds a `gpu` mark (collecting only those: the rest of the suite
    needs packages a GPU machine may not have)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text())  # fmt: skip
    t0 = time.perf_counter()
    cmd = [sys.executable, *SAFE_PATH, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    try:
        proc = subprocess.run([*cmd, *files], cwd=ROOT, text=True, capture_output=True,
                              timeout=PYTEST_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        print(e.stdout, e.stderr, flush=True)
        return Row(f"pytest -m gpu ({len(files)} files)", device, None,
                   f"FAIL: over {PYTEST_TIMEOUT_S:.0f} s", time.perf_counter() - t0)  # fmt: skip
    print(proc.stdout[-4000:] + proc.stderr[-2000:], flush=True)
    last = (proc.stdout.strip().splitlines() or [""])[-1].strip("= ")
    ok = proc.returncode == 0
    return Row(f"pytest -m gpu ({len(files)} files)", device, None,
               ("PASS: " if ok else "FAIL: ") + last[:70], time.perf_counter() - t0)  # fmt: skip


def single_process_cases(device: torch.device, steps: int) -> list[Row]:
    want = reference_state(device, steps)
    rows = []
    for stage, choices in OFFLOADS.items():
        for off in choices:
            cfg = ds_config(stage, **dict.fromkeys(off, True))

            def run(cfg: dict[str, Any] = cfg) -> tuple[str, float | None, str]:
                dev, got, _ = engine_state(cfg, steps)
                err, _ = max_relative_error(got, want)
                return dev, err, verdict(err, dev, device.type)

            rows.append(timed(config_name(stage, off), device.type, run))
    return rows


def one_rank_group_cases(device: torch.device, steps: int, tmp: Path) -> list[Row]:
    """A one-rank group that the script made, as Accelerate or Lightning would."""
    want = reference_state(device, steps)
    backends: list[str | None] = ["nccl", None, "cpu:gloo,cuda:nccl"]
    if device.type == "cpu":
        backends = ["gloo"]
    rows = []
    for i, backend in enumerate(backends):

        def run(backend: str | None = backend, i: int = i) -> tuple[str, float | None, str]:
            kwargs: dict[str, Any] = {} if backend is None else {"backend": backend}
            dist.init_process_group(init_method=f"file://{tmp}/one-rank-{i}", rank=0,
                                    world_size=1, **kwargs)  # fmt: skip
            try:
                dev, got, _ = engine_state(ds_config(3, offload_optimizer=True), steps)
            finally:
                dist.destroy_process_group()
            err, _ = max_relative_error(got, want)
            return dev, err, verdict(err, dev, device.type)

        name = f"one-rank group {backend or 'with no backend'!r}, stage3+offload_optimizer"
        rows.append(timed(name, device.type, run))
    return rows


def torch_flight_case(device: torch.device, tmp: Path) -> Row:
    """torch's own flight recorder of an NCCL group (on --device cpu: gloo), as a stalled
    rank's heartbeat carries it (agent/heartbeat.py)."""

    def run() -> tuple[str, float | None, str]:
        from zerowatch.agent.heartbeat import torch_flight

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/flight", rank=0,
                                world_size=1)  # fmt: skip
        try:
            dist.all_reduce(torch.ones(1024, device=device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            entries = torch_flight() or []
        finally:
            dist.destroy_process_group()
        ops = [e["op"] for e in entries]
        ok = f"{backend}:all_reduce" in ops
        return device.type, None, "PASS" if ok else f"FAIL: entries {ops[:4]}"

    return timed(f"torch flight recorder entries ({device.type})", device.type, run)


def _gloo_rank(rank: int, world: int, device_type: str, steps: int,
               configs: dict[str, dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """One of two ranks sharing the GPU over gloo: probe which collectives gloo accepts on
    CUDA tensors, then train each stage whose collectives it accepts."""
    accepted = {"all_reduce", "reduce_scatter", "all_gather"}
    if device_type == "cuda":
        from zerowatch.engine import engine as engine_module

        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        # Under gloo the engine picks the CPU: place it on the GPU to run its collectives
        # on CUDA tensors (gloo stages them through host memory).
        engine_module.pick_device = lambda: device  # type: ignore[assignment]
        accepted = set()
        from zerowatch.engine import comm as comm_module

        probes: dict[str, Callable[[], Any]] = {
            "all_reduce": lambda: dist.all_reduce(torch.ones(4, device=device)),
            "reduce_scatter": lambda: comm_module._reduce_scatter(
                torch.empty(2, device=device), torch.ones(4, device=device)),
            "all_gather": lambda: comm_module._all_gather(
                torch.empty(4, device=device), torch.ones(2, device=device)),
        }  # fmt: skip
        for op, probe in probes.items():
            try:
                probe()
                accepted.add(op)
            except (RuntimeError, ValueError, NotImplementedError) as e:
                print(f"rank {rank}: gloo refuses CUDA {op}: {e}", flush=True)
        torch.cuda.synchronize()
    out: dict[str, Any] = {"accepted": sorted(accepted), "runs": {}}
    for name, cfg in configs.items():
        stage = cfg["zero_optimization"]["stage"]
        if STAGE_OPS[stage] <= accepted:
            t0 = time.perf_counter()
            dev, state, local = engine_state(cfg, steps, world, rank)
            out["runs"][name] = (dev, state, local, time.perf_counter() - t0)
    return out


def two_process_gloo_cases(device: torch.device, steps: int) -> list[Row]:
    configs = {config_name(stage, off): ds_config(stage, **dict.fromkeys(off, True))
               for stage in OFFLOADS for off in OFFLOADS[stage][:2]}  # fmt: skip
    t0 = time.perf_counter()
    try:
        ranks = run_ranks(_gloo_rank, 2, device.type, steps, configs, timeout_s=RANK_TIMEOUT_S)
    except RuntimeError as e:
        traceback.print_exc()
        return [Row("2 ranks over gloo", device.type, None, f"FAIL: {str(e)[:80]}",
                    time.perf_counter() - t0)]  # fmt: skip
    want = reference_state(device, steps, world=2)
    rows = []
    for name in configs:
        case = f"2 ranks over gloo, {name}"
        if name not in ranks[0]["runs"]:
            stage = configs[name]["zero_optimization"]["stage"]
            refused = ", ".join(sorted(STAGE_OPS[stage] - set(ranks[0]["accepted"])))
            rows.append(Row(case, device.type, None, f"SKIP: gloo takes no CUDA {refused}", 0.0))
            continue
        dev, got, _, seconds = ranks[0]["runs"][name]
        err, _ = max_relative_error(got, want)
        # Rank 1 gets no consolidated copy: what it holds whole must be rank 0's weights.
        local = ranks[1]["runs"][name][2]
        same, _ = max_relative_error(local, {k: got[k] for k in local})
        result = verdict(err, dev, device.type)
        if same != 0.0 and result == "PASS":
            result = "FAIL: the ranks disagree"
        rows.append(Row(case, dev, err, result, seconds))
    return rows


# -- the table ------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    head = ("case", "device", "max rel err", "result", "s")
    cells = [(r.case, r.device, "-" if r.error is None else f"{r.error:.2e}", r.result,
              f"{r.seconds:.1f}") for r in rows]  # fmt: skip
    widths = [max(len(str(c[i])) for c in [head, *cells]) for i in range(len(head))]
    lines = ["  ".join(str(c[i]).ljust(widths[i]) for i in range(len(head))) for c in [head]]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c[i]).ljust(widths[i]) for i in range(len(head))) for c in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-pytest", action="store_true", help="leave out `pytest -m gpu`")
    args = parser.parse_args(argv)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # the one-process cases are no launcher's ranks
    # torch's flight recorder is sized when the process's first group is made (as
    # zerowatch.init_distributed sizes it): before any case makes one.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")
    device = torch.device(args.device)
    rows: list[Row] = []
    if not args.no_pytest:
        rows.append(pytest_case(args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        rows.append(Row("engine cases", "cuda", None, "SKIP: no CUDA", 0.0))
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            rows += single_process_cases(device, args.steps)
            rows += one_rank_group_cases(device, args.steps, Path(tmp))
            rows.append(torch_flight_case(device, Path(tmp)))
            rows += two_process_gloo_cases(device, args.steps)
    if device.type == "cuda" and torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table(rows), flush=True)
    failed = [r for r in rows if r.result.startswith("FAIL")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
