"""Do the doctor's predictions hold? Run a configuration, take the predicted changes, run
each changed configuration, and print predicted against measured step time and per-rank
model-state memory.

    python bench/doctor.py [--stage 3] [--max-changes 6] [--steps 12] [--repeat 1]

It starts a zerowatch server (temp SQLite), trains the example GPT with 2 gloo ranks on CPU
(tests/support/doctor_job.py, one run at a time), reads `GET /api/v1/runs/{id}/findings`,
and takes every prediction the findings carry: the stage_choice finding's candidates (every
other stage and offload, each predicted by the planner calibrated on this run) and the
latency_bound_collectives finding's bucket size. Measured step time: the run's recent median
(the run resource's `step_time_s`); memory: the median over steps of the fullest rank's
device model-state bytes (`memory.state.<kind>` of the kinds held on the device,
max over ranks). Keep it short on a shared machine: each
run costs a few seconds of two CPU cores. It prints the time and the load average at its
start and end, and runs the base configuration once more at the end: the spread of the base
runs is the noise the predictions are judged against. `--repeat K` runs K rounds of the base
and every change, interleaved, and compares the medians (the predictions of each round's
base run, the measurements of each change), so that a burst of load from another job moves
one run of K, not the table. It also prints the stage-3 parameter management the base
run measured and the same predictions without that term, judged on the same measurements.
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

JOB = Path(__file__).parents[1] / "tests" / "support" / "doctor_job.py"
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


def _measured(url: str, run_id: str) -> tuple[float, float]:
    run = httpx.get(f"{url}/api/v1/runs/{run_id}", timeout=30).json()
    state = 0.0  # device model state: the kinds not offloaded to the host
    for kind in ("params", "grads", "optimizer_states", "master_weights"):
        mem = httpx.get(f"{url}/api/v1/runs/{run_id}/series",
                        params={"metric": f"memory.state.{kind}"}, timeout=30).json()  # fmt: skip
        state += statistics.median(mem["stats"]["max"]) if mem["stats"]["max"] else 0.0
    return float(run["step_time_s"]), float(state)


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--stage", default="3")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-changes", type=int, default=6)
    p.add_argument("--extra", default="", help="more job arguments for the base run")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of (base run, every change): predictions and measurements "
                   "are the medians over the rounds")  # fmt: skip
    a = p.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    tmp = tempfile.mkdtemp(prefix="zw-bench-doctor-")
    server = subprocess.Popen(
        [sys.executable, "-m", "zerowatch.cli", "serve", "--port", str(port), "--db",
         f"sqlite:///{tmp}/z.db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(100):
            try:
                httpx.get(f"{url}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
        base = ["--stage", a.stage, *a.extra.split()]
        base_steps: list[float] = []
        preds_of: dict[str, list[dict[str, Any]]] = {}
        measured_of: dict[str, list[tuple[float, float]]] = {}
        changes: list[dict[str, Any]] = []
        for r in range(max(a.repeat, 1)):
            base_id = _train(url, base, a.steps)
            now_step, now_state = _measured(url, base_id)
            base_steps.append(now_step)
            found = httpx.get(f"{url}/api/v1/runs/{base_id}/findings", timeout=30).json()
            preds: list[dict[str, Any]] = []
            for f in found["findings"]:
                if r == 0:
                    print(f"[{f['severity']}] {f['kind']}: {f['message']}")
                preds += f["evidence"].get("candidates", [])
                if f["prediction"] and f["kind"] != "stage_choice":
                    preds.append(f["prediction"])
            if r == 0:
                changes = preds[: a.max_changes]
            for pred in preds:
                preds_of.setdefault(pred["change"], []).append(pred)
            for change in changes:
                run_id = _train(url, _args_for(change["config"], base), a.steps)
                measured_of.setdefault(change["change"], []).append(_measured(url, run_id))
        base_steps.append(_measured(url, _train(url, base, a.steps))[0])
        runs = ", ".join(f"{s * 1e3:.1f}" for s in base_steps)
        print(f"\nbase: stage {a.stage} {' '.join(a.extra.split())}: step "
              f"{statistics.median(base_steps[:-1]) * 1e3:.1f} ms (runs: {runs} ms, the last "
              f"after the changes), model state {now_state / 2**20:.2f} MiB")  # fmt: skip
        manage = [p["basis"]["stage3_management_s_now"] for ps in preds_of.values() for p in ps
                  if "stage3_management_s_now" in p["basis"]]  # fmt: skip
        if manage:
            print(f"stage 3's parameter management (communication phases outside the "
                  f"collective waits): {statistics.median(manage) * 1e3:.1f} ms a step")  # fmt: skip
        print(f"\n{'change':<40} {'step pred':>9} {'measured':>9} {'err':>6}   "
              f"{'state pred':>10} {'measured':>9} {'err':>6}")  # fmt: skip
        step_errs, mem_errs, without_errs = [], [], []
        for change in changes:
            name = change["change"]
            pred_step = statistics.median(p["step_time_s"] for p in preds_of[name])
            # The same prediction without stage 3's parameter management term (the model
            # before it), judged against the same measurements.
            pred_without = statistics.median(
                p["step_time_s"] + p["basis"].get("stage3_management_s_now", 0.0)
                - p["basis"].get("stage3_management_s_new", 0.0) for p in preds_of[name]
            )  # fmt: skip
            pred_state = statistics.median(p["model_state_bytes"] for p in preds_of[name])
            step = statistics.median(s for s, _ in measured_of[name])
            state = statistics.median(m for _, m in measured_of[name])
            es, em = pred_step / step - 1, pred_state / state - 1
            step_errs.append(abs(es))
            without_errs.append(abs(pred_without / step - 1))
            mem_errs.append(abs(em))
            runs = ("  (" + ", ".join(f"{s * 1e3:.1f}" for s, _ in measured_of[name]) + ")"
                    if len(measured_of[name]) > 1 else "")  # fmt: skip
            print(f"{name:<40} {pred_step * 1e3:>7.1f}ms {step * 1e3:>7.1f}ms "
                  f"{es:>+6.0%}   {pred_state / 2**20:>8.2f}Mi "
                  f"{state / 2**20:>7.2f}Mi {em:>+6.0%}{runs}")  # fmt: skip
        if step_errs:
            print(f"\n{len(step_errs)} changes: step time within 15%: "
                  f"{sum(e <= 0.15 for e in step_errs)}/{len(step_errs)} (median error "
                  f"{statistics.median(step_errs):.0%}); memory within 5%: "
                  f"{sum(e <= 0.05 for e in mem_errs)}/{len(mem_errs)}")  # fmt: skip
            print(f"without the stage-3 parameter management term: step time within 15%: "
                  f"{sum(e <= 0.15 for e in without_errs)}/{len(without_errs)} (median error "
                  f"{statistics.median(without_errs):.0%})")  # fmt: skip
        print(f"{time.strftime('%H:%M UTC', time.gmtime())}, load "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
