"""The package as a training node gets it, from a fresh clone: `make wheel` in a `git clone`
of the committed tree builds a wheel that holds every part (the agent, the server's pages,
plotly.js, migrations and alert rules); a new virtual environment with torch and none of the
server's dependencies installs it with pip, offline; a 2-rank job under torchrun trains and
spools from it (no server running), and the spool is uploaded with `zerowatch upload` from
the development environment (.venv) to a live server, where the run arrives whole.

The new environment's packages are the development environment's own, linked (no download):
a folder holding torch, the wheel's requirements and the `train` extra's (what a training
image brings: numpy, orjson, zlib-ng, urllib3, ...), each with everything it requires, put on
the new environment's path by a .pth file, the way an image's packages are installed. pip
then installs the wheel with `--no-index`: it finds every requirement already there. jinja2
(torch's) and pydantic (typer's) are requirements of those, not only of the server."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: What only the server needs: none of it may be importable where the job runs.
SERVER_ONLY = ("fastapi", "starlette", "sqlalchemy", "alembic", "uvicorn", "plotly", "msgspec",
               "psycopg", "prometheus_client", "swagger_ui_bundle")  # fmt: skip
#: What the training environment holds before the wheel: torch, and the requirements of the
#: wheel and of its `train` extra (read from the wheel below).
IMAGE = ("torch",)

#: The folders the wheel installs (pyproject.toml's package-dir): folder -> import name.
PACKAGE_DIRS = {"zerowatch": "zerowatch", "agent": "zerowatch/agent", "server": "zerowatch/server",
                "dashboards": "zerowatch/dashboards", "alerts": "zerowatch/alerts",
                "integrations": "zerowatch/integrations"}  # fmt: skip


def _in_wheel(path: str) -> str:
    """Where a file of the tree lies in the wheel."""
    top, _, rest = path.partition("/")
    return f"{PACKAGE_DIRS[top]}/{rest}"


AGENT_ONLY = textwrap.dedent(
    """
    import importlib.util, sys
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
    server = sorted(m for m in SERVER_ONLY if importlib.util.find_spec(m) is not None)
    print("rank", engine.rank, "steps", run.stats["steps"], "spooled", run.stats["spooled"],
          "run", run.id, "server packages", server)
    """
)


def _closure(requirements: list[str]) -> dict[str, md.Distribution]:
    """The installed distributions that `requirements` need, each with what it requires
    (markers evaluated here, no extras), by normalized name."""
    out: dict[str, md.Distribution] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name) in out:
            continue
        dist = md.distribution(req.name)
        out[canonicalize_name(req.name)] = dist
        todo += [Requirement(r) for r in dist.requires or []]
    return out


def _link_packages(dists: dict[str, md.Distribution], into: Path) -> None:
    """Links every top-level file and folder of `dists` (modules, packages, .dist-info)
    into `into`: an image's site-packages, made of the development environment's."""
    into.mkdir()
    for dist in dists.values():
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            src = Path(str(dist.locate_file(top)))
            if src.exists() and not (into / top).exists():
                (into / top).symlink_to(src)


def _wheel_requirements(wheel: Path, extra: str) -> list[str]:
    """The wheel's own requirements and its `extra`'s, from its METADATA."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = z.read(name).decode()
    out = []
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                req.marker = None
                out.append(str(req))
    return out


def test_a_fresh_clones_wheel_trains_and_spools_without_the_server_and_uploads(tmp_path):
    # The committed tree, as CI and a user get it, and its Makefile's wheel (with this
    # environment's pip and setuptools: no download).
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    subprocess.run(["make", "-s", "-C", str(clone), "wheel", f"VENV={sys.prefix}"],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    (wheel,) = (clone / "dist").glob("zerowatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for part in ("zerowatch/agent/attach.py", "zerowatch/server/static/plotly-cartesian.min.js",
                 "zerowatch/server/static/zerowatch.js", "zerowatch/dashboards/templates/run.html",
                 "zerowatch/alerts/rules.yml", "zerowatch/engine/engine.py",
                 "zerowatch/server/migrations/versions/0009_jobs_and_checkpoints.py"):  # fmt: skip
        assert part in names, part
    assert not any(n.startswith(("tests/", "bench/")) for n in names)
    # Every module of the package's folders (pyproject.toml lists the packages one by one).
    tracked = subprocess.run(["git", "-C", str(clone), "ls-files", "*.py"], check=True,
                             capture_output=True, text=True).stdout.split()  # fmt: skip
    missing = [f for f in tracked if f.split("/")[0] in PACKAGE_DIRS
               and _in_wheel(f) not in names]  # fmt: skip
    assert not missing, f"not in the wheel (pyproject.toml's packages): {missing}"

    # A new environment: torch and the requirements, none of the server's.
    image = _closure([*IMAGE, *_wheel_requirements(wheel, "train")])
    assert not {canonicalize_name(n) for n in SERVER_ONLY} & set(image), sorted(image)
    _link_packages(image, tmp_path / "image")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)  # fmt: skip
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True,
                               timeout=60).stdout.strip())  # fmt: skip
    (site / "image.pth").write_text(f"{tmp_path / 'image'}\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-index", str(wheel)], check=True, timeout=300)  # fmt: skip

    job = tmp_path / "job"
    job.mkdir()
    script = job / "agent_only.py"
    script.write_text(f"SERVER_ONLY = {SERVER_ONLY!r}\n" + AGENT_ONLY)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ZEROWATCH_", "TORCHELASTIC", "PYTHON"))}  # fmt: skip
    spool = tmp_path / "spool"
    out = subprocess.run(
        [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(spool), str(site)],
        capture_output=True, text=True, env=env, cwd=job, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("rank ")]
    assert len(lines) == 2 and all("steps 3 spooled 4" in x and "server packages []" in x
                                   for x in lines), out.stdout  # fmt: skip
    run_id = lines[0].split(" run ")[1].split()[0]

    # Uploaded from the development environment (the server's side) to a live server.
    from support.live_server import LiveServer

    with LiveServer() as server:
        up = subprocess.run([sys.executable, "-P", "-m", "zerowatch.cli", "upload",
                             str(spool / run_id), "--server", server.url],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
        assert up.returncode == 0, up.stderr[-2000:]
        got = httpx.get(f"{server.api}/runs/{run_id}", timeout=10).json()
        assert got["world_size"] == 2 and got["status"] == "finished"
        assert sorted((r["rank"], r["steps"]) for r in got["ranks"]) == [(0, 3), (1, 3)]
