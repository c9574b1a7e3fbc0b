"""Strict JSON parsing of request bodies: what the store cannot hold is refused by name."""

from __future__ import annotations

import pytest
from zerowatch.server.body import BodyError, loads_strict


def test_a_nul_character_in_a_string_is_refused() -> None:
    with pytest.raises(BodyError, match="NUL"):
        loads_strict(b'{"name": "a\\u0000b"}')
    with pytest.raises(BodyError, match="NUL"):
        loads_strict(b'{"a\\u0000": 1}')


def test_an_escaped_backslash_before_u0000_is_plain_text() -> None:
    assert loads_strict(b'{"name": "C:\\\\u0000dir"}') == {"name": "C:\\u0000dir"}


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers_are_refused(token: bytes) -> None:
    with pytest.raises(BodyError, match="finite"):
        loads_strict(b'{"x": ' + token + b"}")
