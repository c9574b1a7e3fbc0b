"""Fixtures every test folder may use. Service starters (a live zerowatch server, a real
PostgreSQL, a real Prometheus) live in tests/support/, one module each."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
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
