"""The server runs on a monitoring host without torch: importing it must not import torch,
the agent or the engine."""

from __future__ import annotations

import subprocess
import sys


def test_server_imports_no_torch_agent_or_engine() -> None:
    code = (
        "import sys, zerowatch.server.app, zerowatch.server.read; "
        "bad = [m for m in ('torch', 'zerowatch.agent', 'zerowatch.engine') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
