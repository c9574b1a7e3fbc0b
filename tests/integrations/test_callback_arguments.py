"""The Trainer callbacks check their arguments when they are made, not mid-training."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("library", ["transformers", "lightning"])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"project": ""}, r"^project: expected a non-empty string"),
        ({"run": " "}, r"^run: expected a non-empty run name"),
        ({"tags": "a,b"}, r"^tags: expected a list of strings"),
    ],
)
def test_bad_arguments_are_refused_by_name(library: str, kwargs: dict, message: str) -> None:
    module = importlib.import_module(f"zerowatch.integrations.{library}")
    with pytest.raises(ValueError, match=message):
        module.ZeroWatchCallback(**kwargs)
