"""DeepSpeed's C++ ops on CPU, built once before the tests that need them, where it shows.

On a CPU (DS_ACCELERATOR=cpu) DeepSpeed compiles two ops the first time a process uses
them: its shared-memory collectives (`deepspeed_shm_comm`, at `init_distributed`) and, with
the optimizer offloaded, its CPU Adam (`cpu_adam`). Each takes a minute or more of a 2-core
machine, inside the first test that happens on it: under that test's timeout, and silent,
since the ranks' output is captured. tests/conftest.py therefore builds both here once the
tests are collected and before any runs, where the session has a test that asks for them
(`deepspeed_ops` fixture), and says so on the terminal. The ops go into
TORCH_EXTENSIONS_DIR, the repository's `.torch_extensions/` unless set (the Makefile's
too), which every test's ranks inherit; a second session finds them built in a few seconds.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: DeepSpeed's names of the builders, and what each op is.
OPS = {"ShareMemCommBuilder": "shared-memory collectives", "CPUAdamBuilder": "CPU Adam"}

#: Run in a child process: importing DeepSpeed sets up its accelerator for the process.
_BUILD = """
import sys
from deepspeed.accelerator import get_accelerator
for name in sys.argv[1:]:
    builder = get_accelerator().create_op_builder(name)
    if builder is not None:
        builder.load(verbose=False)
"""


def extensions_dir() -> Path:
    """Where torch builds and finds the ops: TORCH_EXTENSIONS_DIR, set for the session to
    the repository's `.torch_extensions/` unless given (as the Makefile does)."""
    return Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions")))


def _built(where: Path) -> bool:
    names = {"ShareMemCommBuilder": "deepspeed_shm_comm", "CPUAdamBuilder": "cpu_adam"}
    return all((where / n / f"{n}.so").is_file() for n in (names[b] for b in OPS))


def build(echo: Callable[[str], None], timeout_s: float = 1200.0) -> bool:
    """Build (or find built) DeepSpeed's CPU ops, saying what it does through `echo`.

    Returns:
        True where the ops are ready; False where DeepSpeed is not installed or the build
        failed (its output's tail is echoed; the tests that need the ops then fail on it).
    """
    if importlib.util.find_spec("deepspeed") is None:
        return False
    where = extensions_dir()
    what = " and ".join(OPS.values())
    fresh = not _built(where)
    if fresh:
        echo(f"Building DeepSpeed's {what} ops into {where} for the DeepSpeed tests (once; "
             "a few minutes on 2 cores)...")  # fmt: skip
    t0 = time.monotonic()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(where)}
    try:
        done = subprocess.run([sys.executable, "-c", _BUILD, *OPS], env=env, capture_output=True,
                              text=True, timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired:
        echo(f"DeepSpeed's {what} ops: not built after {timeout_s:.0f} s")
        return False
    if done.returncode != 0:
        echo(f"DeepSpeed's {what} ops failed to build (exit {done.returncode}):\n"
             + (done.stdout + done.stderr)[-3000:])  # fmt: skip
        return False
    took = time.monotonic() - t0
    echo(f"DeepSpeed's {what} ops: {'built' if fresh else 'ready'} in {took:.0f} s ({where})")
    return True


__all__ = ["OPS", "build", "extensions_dir"]
