"""`make demo` installs again only when pyproject.toml changed: a second run goes straight to
the demo (no pip, so no installer output)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dry_run(cwd: Path, target: str) -> str:
    proc = subprocess.run(["make", "-n", target], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_demo_reinstalls_only_after_pyproject_changes(tmp_path: Path) -> None:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"  # the venv made on first use
    python.parent.mkdir(parents=True)
    python.touch(mode=0o755)

    first = dry_run(tmp_path, "demo")
    assert "pip install" in first and "zerowatch demo" in first

    # The install, with pip's part left out.
    subprocess.run(["make", "install", "PIP_INSTALL=true"], cwd=tmp_path, check=True)
    second = dry_run(tmp_path, "demo")
    assert "pip install" not in second and "zerowatch demo" in second

    later = time.time() + 5
    os.utime(tmp_path / "pyproject.toml", (later, later))
    assert "pip install" in dry_run(tmp_path, "demo")
