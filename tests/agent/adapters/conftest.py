"""A live zerowatch server shared by the DeepSpeed and FSDP2 adapter tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.live_server import LiveServer


@pytest.fixture(scope="package")
def server() -> Iterator[LiveServer]:
    with LiveServer() as srv:
        yield srv
