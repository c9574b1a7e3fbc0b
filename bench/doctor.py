"""Do the doctor's predictions hold? Run a configuration, take the predicted changes, run
each changed configuration, and print predicted against measured step time and per-rank
model-state memory.

    python bench/doctor.py [--stage 3,1] [--max-changes N] [--steps 52] [--repeat 1]

It starts a zerowatch server (temp SQLite), trains the example GPT with 2 gloo ranks on CPU
(tests/support/doctor_job.py, one run at a time), reads `GET /api/v1/runs/{id}/findings`,
and takes every prediction the findings carry: the stage_choice finding's candidates (every
other stage and offload, and a quarter and four times the run's reduce_bucket_size, each
predicted by the planner calibrated on this run) and the latency_bound_collectives finding's
bucket size (one run each where two name the same change; `--max-changes N`: the first N,
in the findings' order). It does so from each base stage of
`--stage` in turn (default 3, then 1: the changes down from stage 3 and up from stage 1),
a table each and a line over all. Measured step time: the statistic the doctor calibrates
on, for the base and the changes alike: the median over the run's window (the steps after
the warm-up) of the per-step median over ranks; memory: the median over steps of the
fullest rank's device model-state bytes (`memory.state.<kind>` of the kinds held on the
device, max over ranks). Each run costs a few seconds of two CPU cores. It prints the time
and the load average at its start and end, the base run's contention (predict.contention:
1 with the host to itself), and runs the base configuration once more at the end: the
spread of the base runs is the noise the predictions are judged against. `--repeat K` runs
K rounds of the base and every change, interleaved (each round runs the base, then the
changes, in the reverse order every other round), and compares the medians (the
predictions of each round's base run, the measurements of each change: the same statistic
on both sides), so that a burst of load from another job, or a run caught on a slow spell
of the host, moves one run of K, not the table. A run that shared its cores with another
process (contention above UNDISTURBED, as predict.contention works it out from the run's
own clocks: the doctor's predictions are for the job with the host to itself) is left out
of its medians while another run of the same configuration is not, base rounds and
changes alike, and marked with * in the table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from zerowatch.server.read.doctor_settings import DoctorSettings

JOB = Path(__file__).parents[1] / "tests" / "support" / "doctor_job.py"
#: Steps that fill the doctor's window after its warm-up steps (DoctorSettings): a step of
#: the bench model varies by a third from one to the next and the host has slow spells of
#: about a second, so the run's median is taken over as many steps as the doctor reads.
WHOLE_WINDOW = DoctorSettings().warmup_steps + DoctorSettings().window_steps
MODEL = ["--d-model", "128", "--seq-len", "64", "--micro-batch", "8"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train(url: str, args: list[str], steps: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(JOB),
           "--server", url, "--steps", str(steps), *MODEL, *args]  # fmt: skip
    out = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    run_id = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("run ")][-1]
    for _ in range(100):
        run = httpx.get(f"{url}/api/v1/runs/{run_id}", timeout=30).json()
        if run["rank_summary"]["finished"] == 2:
            break
        time.sleep(0.2)
    return run_id


#: A run whose contention (predict.contention) is above this shared its cores with another
#: process: the doctor's replays call the runs at or below it undisturbed.
UNDISTURBED = 1.05


def _window_median(url: str, run_id: str, metric: str, window: list[int]) -> float | None:
    """The median over the window's steps of the per-step median over ranks (None: no such
    metric), as the doctor reads a run (doctor_evidence.Evidence.median)."""
    got = httpx.get(f"{url}/api/v1/runs/{run_id}/series", params={"metric": metric},
                    timeout=30).json()  # fmt: skip
    vals = [v for st, v in zip(got["steps"], got["stats"]["p50"], strict=True)
            if window[0] <= st <= window[1] and v is not None]  # fmt: skip
    return float(statistics.median(vals)) if vals else None


def _measured(url: str, run_id: str) -> tuple[float, float, float]:
    """(step time, device model-state bytes, contention): the step time as the doctor
    measures a run it predicts from (the median over the steps of its window, after the
    warm-up steps, of the per-step median over ranks), so that both sides of a comparison
    are one statistic; the contention as predict.contention works it out from the same
    medians (the step less its waits over the CPU its threads used; 1: the host to
    itself)."""
    window = httpx.get(f"{url}/api/v1/runs/{run_id}/findings", timeout=30).json()["window"]
    step = _window_median(url, run_id, "step_time_s", window)
    assert step is not None
    exposed = _window_median(url, run_id, "exposed_comm_s", window) or 0.0
    cpu = [_window_median(url, run_id, m, window) for m in ("thread_cpu_s", "other_cpu_s")]
    own = sum(max(c, 0.0) for c in cpu if c is not None)
    contention = (step - exposed) / own if None not in cpu and own > 0 else 1.0
    state = 0.0  # device model state: the kinds not offloaded to the host
    for kind in ("params", "grads", "optimizer_states", "master_weights"):
        mem = httpx.get(f"{url}/api/v1/runs/{run_id}/series",
                        params={"metric": f"memory.state.{kind}"}, timeout=30).json()  # fmt: skip
        state += statistics.median(mem["stats"]["max"]) if mem["stats"]["max"] else 0.0
    return step, float(state), max(contention, 1.0)


def _undisturbed(contention: list[float]) -> list[int]:
    """The runs to compare: those at or below UNDISTURBED, or all when none is."""
    kept = [i for i, c in enumerate(contention) if c <= UNDISTURBED]
    return kept or list(range(len(contention)))


def _args_for(config: dict[str, Any], base: list[str]) -> list[str]:
    """Job arguments for a DeepSpeed fragment applied to the base configuration."""
    z = dict(config.get("zero_optimization", {}))
    args = list(base)
    if "stage" in z:
        args += ["--stage", str(z.pop("stage"))]
    off = z.pop("offload_optimizer", None)
    if off is not None:
        args += ["--offload", off["device"]]
    par = z.pop("offload_param", None)
    if par is not None:
        z["offload_param"] = par
    if z:
        args += ["--config-json", json.dumps(z)]
    return args


def _base(url: str, a: argparse.Namespace, stage: str) -> list[tuple[float, float]]:
    """One base configuration: its rounds, its table; (step error, memory error) per change."""
    base = ["--stage", stage, *a.extra.split()]
    base_steps: list[float] = []
    contention: list[float] = []
    preds_of: dict[str, list[list[dict[str, Any]]]] = {}  # per round
    measured_of: dict[str, list[tuple[float, float, float]]] = {}
    changes: list[dict[str, Any]] = []
    now_state = 0.0
    for r in range(max(a.repeat, 1)):
        base_id = _train(url, base, a.steps)
        now_step, now_state, now_c = _measured(url, base_id)
        base_steps.append(now_step)
        contention.append(now_c)
        found = httpx.get(f"{url}/api/v1/runs/{base_id}/findings", timeout=30).json()
        if r == 0:
            _print_counted_calls(url, base_id)
        preds: list[dict[str, Any]] = []
        for f in found["findings"]:
            if r == 0:
                print(f"[{f['severity']}] {f['kind']}: {f['message']}")
            preds += f["evidence"].get("candidates", [])
            if f["prediction"] and f["kind"] != "stage_choice":
                preds.append(f["prediction"])
        if r == 0:
            unique = list({p["change"]: p for p in preds}.values())
            changes = unique[: a.max_changes] if a.max_changes else unique
        for pred in preds:
            preds_of.setdefault(pred["change"], [[] for _ in range(max(a.repeat, 1))])[r].append(
                pred
            )
        # Every other round runs the changes in the reverse order, so that no change always
        # runs right after the base or last in a round (a drift of the host's speed over a
        # round then moves the changes alike, not one more than another).
        for change in changes if r % 2 == 0 else changes[::-1]:
            run_id = _train(url, _args_for(change["config"], base), a.steps)
            measured_of.setdefault(change["change"], []).append(_measured(url, run_id))
    base_steps.append(_measured(url, _train(url, base, a.steps))[0])
    rounds = _undisturbed(contention)
    runs = ", ".join(f"{s * 1e3:.1f}" for s in base_steps)
    print(f"\nbase: stage {stage} {' '.join(a.extra.split())}: step "
          f"{statistics.median(base_steps[i] for i in rounds) * 1e3:.1f} ms (runs: {runs} ms, "
          f"the last after the changes), model state {now_state / 2**20:.2f} MiB")  # fmt: skip
    print("contention (step less its waits over the CPU its threads used; 1: the host to "
          f"itself): {', '.join(f'{c:.2f}' for c in contention)}; runs above {UNDISTURBED} "
          "(shared cores) are left out of the medians on both sides while another is not "
          "(* below)")  # fmt: skip
    manage = [p["basis"]["management_s_now"] for ps in preds_of.values() for r in rounds
              for p in ps[r] if "management_s_now" in p["basis"]]  # fmt: skip
    if manage:
        print(f"the base's communication path on the training thread (communication phases "
              f"outside the collective waits): {statistics.median(manage) * 1e3:.1f} ms a "
              "step")  # fmt: skip
    print(f"\n{'change':<40} {'step pred':>9} {'measured':>9} {'err':>6}   "
          f"{'state pred':>10} {'measured':>9} {'err':>6}")  # fmt: skip
    errs: list[tuple[float, float]] = []
    for change in changes:
        name = change["change"]
        mine = [p for r in rounds for p in preds_of[name][r]]
        pred_step = statistics.median(p["step_time_s"] for p in mine)
        pred_state = statistics.median(p["model_state_bytes"] for p in mine)
        got = measured_of[name]
        kept = _undisturbed([c for _, _, c in got])
        step = statistics.median(got[i][0] for i in kept)
        state = statistics.median(m for _, m, _ in got)
        es, em = pred_step / step - 1, pred_state / state - 1
        errs.append((es, em))
        runs = ("  (" + ", ".join(f"{s * 1e3:.1f}{'' if i in kept else '*'}"
                                  for i, (s, _, _) in enumerate(got)) + ")"
                if len(got) > 1 or not kept else "")  # fmt: skip
        print(f"{name:<40} {pred_step * 1e3:>7.1f}ms {step * 1e3:>7.1f}ms "
              f"{es:>+6.0%}   {pred_state / 2**20:>8.2f}Mi "
              f"{state / 2**20:>7.2f}Mi {em:>+6.0%}{runs}")  # fmt: skip
    _summary(errs)
    return errs


def _print_counted_calls(url: str, run_id: str) -> None:
    """The calls a step of each stage makes at the run's bucket size, as the agent counted
    them when it attached (engine_info["collective_calls"]), which the predictions use."""
    info = httpx.get(f"{url}/api/v1/runs/{run_id}", timeout=30).json().get("engine_info") or {}
    table = info.get("collective_calls")
    if not table:
        print("collective calls: not counted by the engine (predictions from bytes alone)")
        return
    at = table["bucket_sizes"].index(table["reduce_bucket_size"])
    by_stage = "; ".join(
        f"stage {st}: " + ", ".join(f"{op} {calls[at]}" for op, calls in sorted(ops.items()))
        for st, ops in sorted(table["calls"].items())
    )
    print(f"collective calls a step as the engine counts them (reduce_bucket_size "
          f"{table['reduce_bucket_size']:,}): {by_stage}")  # fmt: skip
    rehearsed = table.get("management_s")
    if rehearsed:
        print("each stage's communication path on the training thread as the agent rehearsed "
              "it when it attached (zerowatch/rehearse/paths.py): " + ", ".join(
                  f"stage {st} {v * 1e3:.2f} ms" for st, v in sorted(rehearsed.items())))  # fmt: skip


def _summary(errs: list[tuple[float, float]], prefix: str = "") -> None:
    if not errs:
        print(f"{prefix}no change predicted")
        return
    step = [abs(e) for e, _ in errs]
    print(f"{prefix}{len(errs)} changes: step time within 15%: {sum(e <= 0.15 for e in step)}/"
          f"{len(errs)} (median error {statistics.median(step):.0%}); memory within 5%: "
          f"{sum(abs(m) <= 0.05 for _, m in errs)}/{len(errs)}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--stage", default="3,1",
                   help="the base configurations' stages, one table each (default: 3 and 1, "
                   "so that the changes go both ways)")  # fmt: skip
    p.add_argument("--steps", type=int, default=WHOLE_WINDOW,
                   help="steps a run (default: the doctor's warm-up and whole window, so "
                   "that each run's statistic is the median of as many steps as the doctor "
                   "reads)")  # fmt: skip
    p.add_argument(
        "--max-changes",
        type=int,
        default=None,
        help="take the N first predicted changes (default: every one)",
    )
    p.add_argument("--extra", default="", help="more job arguments for the base run")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of (base run, every change): predictions and measurements "
                   "are the medians over the rounds")  # fmt: skip
    a = p.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    tmp = tempfile.mkdtemp(prefix="zw-bench-doctor-")
    with Path(tmp, "server.log").open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "zerowatch.cli", "serve", "--port", str(port), "--db",
             f"sqlite:///{tmp}/z.db"], stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            _bench(url, a)
        except Exception:
            if server.poll() is not None:
                print(f"the server exited ({server.returncode}); its log: {tmp}/server.log")
            raise
        finally:
            server.terminate()
            server.wait()


def _bench(url: str, a: argparse.Namespace) -> None:
    for _ in range(100):
        try:
            httpx.get(f"{url}/healthz", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    errs: list[tuple[float, float]] = []
    for stage in a.stage.split(","):
        print(f"\n== base: stage {stage}")
        errs += _base(url, a, stage.strip())
    if len(a.stage.split(",")) > 1:
        _summary(errs, prefix="\nall bases: ")
    print(f"{time.strftime('%H:%M UTC', time.gmtime())}, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip


if __name__ == "__main__":
    main()
