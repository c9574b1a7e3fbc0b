"""The package as a training node gets it: a wheel built from the tree holds every part (the
agent, the server's pages, plotly.js, migrations and alert rules); a 2-rank job under
torchrun trains and spools from that wheel alone with none of the server's dependencies
importable, and the spool is uploaded to a server from the development install."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("fastapi", "starlette", "sqlalchemy", "alembic", "uvicorn", "plotly", "pydantic",
               "msgspec", "jinja2", "psycopg", "prometheus_client")  # fmt: skip

#: Put in every Python process of the job (sitecustomize, on PYTHONPATH): the server's
#: packages cannot be imported.
BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in SERVER_ONLY:
                raise ImportError(f"{name} is a server dependency")
    sys.meta_path.insert(0, Block())
    """
)
AGENT_ONLY = textwrap.dedent(
    """
    import sys
    import zerowatch
    from zerowatch.examples.gpt import GPT, GPTConfig, random_batch
    assert zerowatch.__file__.startswith(sys.argv[2]), zerowatch.__file__
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerowatch.initialize(model=GPT(cfg), config=config)
    with zerowatch.instrument(engine, spool_dir=sys.argv[1], run="wheel") as run:
        for s in range(3):
            x, y = random_batch(cfg, 2, seed=s)
            engine.backward(engine(x, y))
            engine.step()
    blocked = sorted(m for m in sys.modules if m.split(".")[0] in SERVER_ONLY)
    print("rank", engine.rank, "steps", run.stats["steps"], "spooled", run.stats["spooled"],
          "run", run.id, "server modules", blocked)
    """
)


def test_the_wheel_holds_every_part_and_its_agent_needs_no_server_dependency(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(ROOT)], check=True, cwd=tmp_path, timeout=300)  # fmt: skip
    (wheel,) = dist.glob("zerowatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for part in ("zerowatch/agent/attach.py", "zerowatch/server/static/plotly-cartesian.min.js",
                 "zerowatch/server/static/zerowatch.js", "zerowatch/dashboards/templates/run.html",
                 "zerowatch/alerts/rules.yml", "zerowatch/engine/engine.py",
                 "zerowatch/server/migrations/versions/0009_jobs_and_checkpoints.py"):  # fmt: skip
        assert part in names, part
    assert not any(n.startswith(("tests/", "bench/")) for n in names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, timeout=300)  # fmt: skip
    (site / "sitecustomize.py").write_text(f"SERVER_ONLY = {SERVER_ONLY!r}\n" + BLOCKER)
    script = tmp_path / "agent_only.py"
    script.write_text(f"SERVER_ONLY = {SERVER_ONLY!r}\n" + AGENT_ONLY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROWATCH_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = str(site)
    spool = tmp_path / "spool"
    out = subprocess.run(
        [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(script), str(spool), str(site)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("rank ")]
    assert len(lines) == 2 and all("steps 3 spooled 4" in x and "server modules []" in x
                                   for x in lines), out.stdout  # fmt: skip
    run_id = lines[0].split(" run ")[1].split()[0]

    # Uploaded from the development install (the server's side).
    from support.live_server import LiveServer

    with LiveServer() as server:
        up = subprocess.run([sys.executable, "-P", "-m", "zerowatch.cli", "upload",
                             str(spool / run_id), "--server", server.url],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
        assert up.returncode == 0, up.stderr[-2000:]
        got = httpx.get(f"{server.api}/runs/{run_id}", timeout=10).json()
        assert got["world_size"] == 2 and got["status"] == "finished"
        assert sorted((r["rank"], r["steps"]) for r in got["ranks"]) == [(0, 3), (1, 3)]
