"""What the guides under docs/ (and the README) tell a user holds: the server addresses
they show are where `zerowatch serve` listens, and the warning filter docs/deepspeed.md
gives silences torch's deprecation lines that DeepSpeed's collectives print."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

from zerowatch import cli

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: An address given to the agent: instrument(server=...), $ZEROWATCH_SERVER, --server.
SERVER_URL = re.compile(r"""(?:server=|ZEROWATCH_SERVER=|--server )["']?https?://[\w.-]+:(\d+)""")

#: How torch 2.13 words it, from the module DeepSpeed's calls reach it through.
TORCH_NOTE = ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
              "`torch.distributed.all_gather_single` instead.")  # fmt: skip
EMIT = f"""
import warnings
{{setup}}
for _ in range(3):
    warnings.warn_explicit({TORCH_NOTE!r}, FutureWarning, "c10d_logger.py", 83,
                           module="torch.distributed.c10d_logger", registry={{{{}}}})
warnings.warn_explicit("another note", FutureWarning, "other.py", 1, module="mine")
"""


def test_every_server_address_in_the_guides_is_on_the_port_zerowatch_serve_listens_on():
    default = inspect.signature(cli.serve).parameters["port"].default
    found = [(p.name, port) for p in GUIDES for port in SERVER_URL.findall(p.read_text())]
    assert ("deepspeed.md", str(default)) in found
    assert [f for f in found if f[1] != str(default)] == []


def _stderr(code: str, env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60, check=True).stderr  # fmt: skip


def test_the_deepspeed_guides_warning_filter_silences_torchs_deprecation_lines_only():
    text = (ROOT / "docs" / "deepspeed.md").read_text()
    (value,) = re.findall(r'export PYTHONWARNINGS="([^"]+)"', text)
    (line,) = [ln for ln in text.splitlines() if ln.startswith("warnings.filterwarnings(")]
    bare = _stderr(EMIT.format(setup=""), {"PYTHONWARNINGS": ""})
    assert bare.count("is deprecated") == 3 and "another note" in bare  # every call prints
    for stderr in (_stderr(EMIT.format(setup=""), {"PYTHONWARNINGS": value}),
                   _stderr(EMIT.format(setup=line), {"PYTHONWARNINGS": ""})):  # fmt: skip
        assert "is deprecated" not in stderr
        assert "another note" in stderr
