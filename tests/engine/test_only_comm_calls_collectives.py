"""Only zerowatch/engine/comm.py calls torch.distributed collectives (as DeepSpeed checks
for deepspeed.comm). The agent may wrap torch.distributed for engines it does not own in
exactly one listed file."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("zerowatch", "agent", "server", "dashboards", "alerts", "integrations")
ALLOWED = {"zerowatch/engine/comm.py", "agent/adapters/dist_wrap.py"}
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast_object_list",
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "all_gather_coalesced", "gather", "gather_object", "scatter", "scatter_object_list",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "send_object_list", "recv_object_list",
}  # fmt: skip


#: The modules that define the collective functions.
MODULES = {"torch.distributed", "torch.distributed.distributed_c10d"}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = set(MODULES)  # names bound to a module that defines the collectives
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if f"{node.module}.{a.name}" in MODULES:
                    aliases.add(a.asname or a.name)
                if node.module in MODULES and a.name in COLLECTIVES:
                    found.append(f"{path}:{node.lineno}: imports {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = ast.unparse(node.value)
            if base in aliases:
                found.append(f"{path}:{node.lineno}: {base}.{node.attr}")
    return found


def test_no_module_but_comm_calls_torch_distributed_collectives() -> None:
    bad = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in ALLOWED:
                bad += _violations(path)
    assert not bad, "collectives outside engine/comm.py:\n" + "\n".join(bad)


def test_the_check_catches_a_direct_call(tmp_path: Path) -> None:
    src = tmp_path / "rogue.py"
    src.write_text("import torch.distributed as dist\ndist.all_reduce(t)\n"
                   "from torch.distributed import barrier\n"
                   "import torch.distributed.distributed_c10d as c10d\nc10d.broadcast(t, 0)\n"
                   "from torch.distributed import distributed_c10d\n"
                   "distributed_c10d.all_gather_into_tensor(a, b)\n"
                   "torch.distributed.reduce_scatter_tensor(a, b)\n")  # fmt: skip
    assert len(_violations(src)) == 5
    assert _violations(ROOT / "zerowatch/engine/comm.py")  # the allowed file does call them
