"""The package as a training node gets it: a wheel built from the tree holds every part (the
agent, the server's pages, plotly.js, migrations and alert rules), and the agent trains and
spools from that wheel alone with none of the server's dependencies importable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("fastapi", "starlette", "sqlalchemy", "alembic", "uvicorn", "plotly", "pydantic",
               "msgspec", "jinja2", "psycopg", "prometheus_client")  # fmt: skip

AGENT_ONLY = textwrap.dedent(
    """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in SERVER_ONLY:
                raise ImportError(f"{name} is a server dependency")
    sys.meta_path.insert(0, Block())
    import zerowatch
    from zerowatch.examples.gpt import GPT, GPTConfig, random_batch
    assert zerowatch.__file__.startswith(sys.argv[2]), zerowatch.__file__
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerowatch.initialize(model=GPT(cfg), config=config)
    with zerowatch.instrument(engine, spool_dir=sys.argv[1]) as run:
        for s in range(3):
            x, y = random_batch(cfg, 2, seed=s)
            engine.backward(engine(x, y))
            engine.step()
    print("steps", run.stats["steps"], "spooled", run.stats["spooled"])
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
    script = tmp_path / "agent_only.py"
    script.write_text(f"SERVER_ONLY = {SERVER_ONLY!r}\n" + AGENT_ONLY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROWATCH_")}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "-P", str(script), str(tmp_path / "spool"), str(site)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "steps 3 spooled 4" in out.stdout
