"""Fixtures every test folder may use. Service starters (a live zerowatch server, a real
PostgreSQL, a real Prometheus) live in tests/support/, one module each.

Before the first test, where the session has one that asks for `deepspeed_ops`, DeepSpeed's
CPU ops are built (support/deepspeed_ops.py), with a line on the terminal: outside every
test's timeout, and not silent.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
from support import deepspeed_ops as ds_ops
from support.browser import launch_chromium
from support.ports import free_port


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium for the whole session (see support.browser)."""
    try:
        with launch_chromium() as b:
            yield b
    except FileNotFoundError as e:
        pytest.fail(str(e))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests on machines without CUDA."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """Every process the tests start builds and finds torch's C++ extensions in one place
    (support.deepspeed_ops.extensions_dir)."""
    ds_ops.extensions_dir()


def _echo(config: pytest.Config) -> Any:
    """A function that writes a line on the terminal, past pytest's output capture."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def echo(line: str) -> None:
        with capture.global_and_fixture_disabled() if capture else nullcontext():
            if reporter is not None:
                reporter.write_line(line)
            else:
                print(line, file=sys.stderr, flush=True)

    return echo


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build DeepSpeed's CPU ops once, before the tests, where a collected test asks for
    them (the `deepspeed_ops` fixture)."""
    if session.config.option.collectonly:
        return
    if any("deepspeed_ops" in getattr(item, "fixturenames", ()) for item in session.items):
        ds_ops.build(_echo(session.config))


@pytest.fixture(scope="session")
def deepspeed_ops() -> Path:
    """DeepSpeed's CPU ops, built before the session's first test (pytest_collection_finish):
    the folder they are in. A test (or its module) that runs DeepSpeed on CPU asks for it."""
    return ds_ops.extensions_dir()
