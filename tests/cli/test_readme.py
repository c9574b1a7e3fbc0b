"""The README, driven as written: every shell command it shows runs, in a fresh virtualenv
activated the way the README says, and the test fails when one of them stops working.

Commands are read from the README itself: the lines of its ```bash blocks, commands in the
comments of any block (the Prometheus config names `zerowatch alerts render --out ...`), and
inline code that starts with `zerowatch`, `torchrun` or `make`. Each runs as follows:

- `. .venv/bin/activate` (the README must show it) starts every other command's shell; the
  `.venv` is new: created without pip, borrowing the dependencies of the checkout's .venv
  (a .pth file), with zerowatch installed into it by `pip install --no-deps -e` (quietly:
  no setuptools warning) and the `torchrun` script that installing torch writes.
- `make TARGET`: `make -n TARGET` in the checkout (the target exists and its recipe expands;
  the real `make demo` and `make test` take minutes and have tests of their own).
- `zerowatch serve ...`: started and stopped once it prints the address and the database it
  opened. The one on port 8321 keeps running on a free port and is the README's server
  (`ZEROWATCH_SERVER`) for the other commands; the others get `--port` of a free port.
- `torchrun ...`: runs `train.py` (a stand-in for the user's script that prints its rank) on
  a free rendezvous port (PET_MASTER_PORT);
  a rendezvous across machines (`--rdzv-endpoint HOST:...`) runs `--help` only.
- every other command runs as written, its placeholders filled in: RUN (a simulated run the
  server holds), SPOOL_DIR (that run as an agent's spool), URL (the server).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.ports import free_port
from zerowatch.agent.codec import encode
from zerowatch.agent.spool import rank_dir_name

from zerowatch import simulate

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
ACTIVATE = re.compile(r"^(?:\.|source) \S*\.venv/bin/activate$")
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+ +)*(?:zerowatch|torchrun|make) \S")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
#: A stand-in for the user's training script in the README's torchrun lines.
# One write(2) per line: the ranks share the pipe, and print() may split a line in two.
TRAIN_PY = (
    "import os\n"
    "os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())\n"
)


def readme_commands(text: str) -> list[str]:
    """The shell commands the README shows, in order, each once."""
    found: list[str] = []
    for lang, body in FENCE.findall(text):
        for line in body.splitlines():
            code, _, comment = line.partition("#")
            if lang in ("bash", "sh", "shell"):
                found.append(code)
            found.append(comment)
    for span in re.findall(r"`([^`]+)`", FENCE.sub("", text)):
        found.append(span)
    commands = [" ".join(c.split()) for c in found]
    commands = [c for c in commands if COMMAND.match(c) or ACTIVATE.match(c)]
    return list(dict.fromkeys(commands))


def test_readme_commands_are_found() -> None:
    commands = readme_commands(README.read_text())
    assert any(ACTIVATE.match(c) for c in commands), "the README must say how to activate .venv"
    for expected in ("make demo", "zerowatch runs", "zerowatch trace RUN --out trace.json"):
        assert expected in commands, commands


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a new shell: no virtualenv active, nothing of zerowatch set."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env = {k: v for k, v in env.items() if not k.startswith("ZEROWATCH_")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not (
        Path(p, "zerowatch").exists() or Path(p, "activate").exists()
    )]  # fmt: skip
    return {**env, "PATH": os.pathsep.join(path), "COLUMNS": "200", **extra}


def _makefile_pip_env() -> dict[str, str]:
    """The variables the Makefile sets for its `pip install -e` (PIP_INSTALL)."""
    line = re.search(r"^PIP_INSTALL := (.*)$", (REPO / "Makefile").read_text(), re.M)
    assert line, "the Makefile installs through PIP_INSTALL"
    words = shlex.split(line.group(1))
    return dict(w.split("=", 1) for w in words[: words.index("$(BIN)/pip")])


def _fresh_venv(where: Path) -> str:
    """A new virtualenv at `where` as the README's set-up leaves it; returns the output of
    pip installing zerowatch the way the Makefile does."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", REPO],
        capture_output=True, text=True, timeout=120, env=_clean_env(**_makefile_pip_env()),
    )  # fmt: skip
    assert pip.returncode == 0, pip.stdout + pip.stderr
    # What installing torch writes into bin/: its console scripts, on this venv's python.
    (where / "bin" / "torchrun").write_text(
        f"#!{python}\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n"
    )
    (where / "bin" / "torchrun").chmod(0o755)
    return pip.stdout + pip.stderr


def _spool_of_a_simulated_run(root: Path, run_id: str) -> None:
    """An agent's spool (agent/spool.py layout) holding a short simulated 2-rank run."""
    spec = simulate.SimSpec(name="readme", world_size=2, step_time_s=0.05, spans_every=2)
    run = root / run_id
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(dataclasses.asdict(simulate.run_create(spec, run_id))))
    for rank in range(spec.world_size):
        (run / rank_dir_name(rank)).mkdir()
    for events in simulate.steps(spec, 4):
        for e in events:
            with (run / rank_dir_name(e.rank) / "00000000.jsonl").open("ab") as f:
                f.write(encode(e) + b"\n")


class Shell:
    """Runs a README command in bash, in `cwd`, after the README's activation line."""

    def __init__(self, cwd: Path, activate: str, env: dict[str, str]) -> None:
        self.cwd, self.activate, self.env = cwd, activate, env

    def script(self, command: str) -> list[str]:
        return ["bash", "-c", f"set -e\n{self.activate}\n{command}"]

    def run(self, command: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.script(command), cwd=self.cwd, env=self.env, capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip

    @staticmethod
    def stop(proc: subprocess.Popen[str]) -> None:
        """Stop a started command and its children (its own process group), by its pid."""
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def serve(self, command: str) -> tuple[subprocess.Popen[str], str]:
        """Start a `zerowatch serve` command; returns it and its first line of output."""
        proc = subprocess.Popen(
            self.script(command), cwd=self.cwd, env=self.env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        assert proc.stdout is not None
        first = proc.stdout.readline()
        if not first.startswith("zerowatch server on"):
            self.stop(proc)
            pytest.fail(f"{command!r} printed {first + proc.stdout.read()!r}")
        return proc, first


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A working folder with a fresh `.venv`; pip's output when zerowatch was installed."""
    cwd = tmp_path_factory.mktemp("readme")
    yield cwd, _fresh_venv(cwd / ".venv")


@pytest.mark.slow
def test_installing_zerowatch_prints_no_setuptools_warning(fresh: tuple[Path, str]) -> None:
    _, pip_output = fresh
    assert "Warning" not in pip_output and "deprecated" not in pip_output, pip_output


@pytest.mark.slow
def test_every_command_the_readme_shows_works_as_written(fresh: tuple[Path, str]) -> None:
    cwd, _ = fresh
    commands = readme_commands(README.read_text())
    activate = next(c for c in commands if ACTIVATE.match(c))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    run_id = "readme-run-0123456789abcdef"
    _spool_of_a_simulated_run(cwd / "spool", run_id)
    (cwd / "train.py").write_text(TRAIN_PY)

    without = subprocess.run(["bash", "-c", "zerowatch --help"], env=_clean_env(), cwd=cwd,
                             capture_output=True, text=True)  # fmt: skip
    assert without.returncode == 127, "zerowatch must need the activation the README shows"
    # torchrun's default rendezvous port (29500) may be another job's on this machine.
    shell = Shell(cwd, activate, _clean_env(ZEROWATCH_SERVER=url, PET_MASTER_PORT=str(free_port())))

    def filled(c: str) -> str:
        c = c.replace("8321", str(port)).replace("http://monitor:", "http://127.0.0.1:")
        c = re.sub(r"\bRUN\b", run_id, c)
        return re.sub(r"\bURL\b", url, re.sub(r"\bSPOOL_DIR\b", "spool", c))

    serves = [c for c in commands if re.search(r"(^| )zerowatch serve", c)]
    main_serve = next(c for c in serves if "--port 8321" in c)
    server, first = shell.serve(filled(main_serve))
    try:
        assert f":{port} (database sqlite:///{cwd / 'zerowatch.db'})" in first, first
        for _ in range(100):
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        ran = {activate, main_serve}
        for c in serves:
            if c in ran:
                continue
            other, first = shell.serve(
                filled(c) + ("" if "--port" in c else f" --port {free_port()}")
            )
            shell.stop(other)
            ran.add(c)
        # The spool first: it puts the run RUN on the server.
        for c in sorted(commands, key=lambda c: not c.startswith("zerowatch upload")):
            if c in ran:
                continue
            ran.add(c)
            if c.startswith("make "):
                proc = subprocess.run(["make", "-n", *shlex.split(c)[1:]], cwd=REPO,
                                      capture_output=True, text=True, timeout=60)  # fmt: skip
            elif c.startswith("torchrun ") and "--rdzv-endpoint" in c:
                proc = shell.run(c.replace("torchrun ", "torchrun --help ", 1))
            elif c.startswith("torchrun ") and "zerowatch.selftest" in c:
                # A node's eight GPUs are two CPU ranks here.
                proc = shell.run(re.sub(r"--nproc-per-node \d+", "--nproc-per-node 2", c),
                                 timeout_s=180)  # fmt: skip
            elif c.startswith(("zerowatch ", "torchrun ")):
                proc = shell.run(filled(c), timeout_s=120)
            else:
                pytest.fail(f"the README shows a command this test does not know: {c!r}")
            assert proc.returncode == 0, (
                f"{c!r} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
            if c == "zerowatch runs":
                assert run_id in proc.stdout, proc.stdout
            if c.startswith("torchrun --nproc-per-node") and "train.py" in c:
                assert "rank 0 of" in proc.stdout, proc.stdout
            if "selftest" in c:
                assert "zerowatch selftest" in proc.stdout and ": PASS" in proc.stdout, proc.stdout
    finally:
        shell.stop(server)
    assert ran == set(commands)
    trace = json.loads((cwd / "trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
    assert "groups:" in (cwd / "zerowatch-rules.yml").read_text()
