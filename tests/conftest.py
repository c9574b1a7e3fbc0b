"""Fixtures every test folder may use. Service starters (a live zerowatch server, a real
PostgreSQL, a real Prometheus) live in tests/support/, one module each."""

from __future__ import annotations

import pytest
from support.ports import free_port


@pytest.fixture
def port() -> int:
    return free_port()


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
