"""The server runs on a monitoring host without torch: importing it must not import torch,
the agent or the engine. And the server and the dashboards import only what the dependency
rules of docs/architecture.md give them."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_server_imports_no_torch_agent_or_engine() -> None:
    code = (
        "import sys, zerowatch.server.app, zerowatch.server.read, zerowatch.plan, "
        "zerowatch.predict; "
        "bad = [m for m in ('torch', 'zerowatch.agent', 'zerowatch.engine') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _rule(package: str) -> set[str]:
    """The packages of ours that docs/architecture.md's dependency rules give `package`:
    the names after `package ->`, up to the parenthesis."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rules = text.split("## Dependency rules", 1)[1].split("```")[1]
    line = re.search(rf"^{package}\s+->\s*([^(\n]*)", rules, re.MULTILINE)
    assert line, f"no rule for {package} in docs/architecture.md"
    return {name.strip() for name in line.group(1).split(",") if name.strip()}


def _ours(path: Path) -> set[tuple[str, int]]:
    """(zerowatch's package or module, line) of each import of ours in `path`, at any depth
    (imports inside functions count): `zerowatch.plan.x` -> "plan"; the face's own names
    (`from zerowatch import __version__`) -> "the face"."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = (
                [f"zerowatch.{a.name}" for a in node.names]
                if node.module == "zerowatch"
                else [node.module]
            )
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "zerowatch":
                part = parts[1] if len(parts) > 1 and not parts[1].startswith("__") else "the face"
                found.add((part, node.lineno))
    return found


def test_server_and_dashboards_import_only_what_the_rules_allow() -> None:
    assert {"plan", "predict"} <= _rule("server")
    bad = []
    for package in ("server", "dashboards"):
        allowed = _rule(package) | {package, "the face"}
        for path in sorted((ROOT / package).rglob("*.py")):
            for part, line in sorted(_ours(path)):
                if part not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: zerowatch.{part}")
    assert not bad, "imports the dependency rules do not allow:\n" + "\n".join(bad)


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "import zerowatch\n"
        "from zerowatch import __version__, plan\n"
        "from zerowatch.server.read import rollups\n"
        "def f():\n"
        "    import zerowatch.agent.run\n"
    )
    assert _ours(path) == {
        ("the face", 1),
        ("the face", 2),
        ("plan", 2),
        ("server", 3),
        ("agent", 5),
    }
