"""The one way zerowatch prints quantities: bytes binary, rates and counts decimal."""

from __future__ import annotations

import pytest

from zerowatch.units import fmt_bytes, fmt_count, fmt_rate, fmt_seconds


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (300 * 2**20, "300 MiB"),
    (80 * 2**30, "80 GiB"), (1000 * 2**30, "1000 GiB"), (1023.9 * 2**30, "1024 GiB"),
    (16 * 70 * 10**9, "1.02 TiB"), (-3 * 2**30, "-3 GiB"), (None, "–"), (float("nan"), "–"),
])  # fmt: skip
def test_bytes_print_in_binary_units_without_exponents(n, text) -> None:  # type: ignore[no-untyped-def]
    assert fmt_bytes(n) == text


def test_zero_bytes_may_print_as_a_dash_in_tables() -> None:
    assert fmt_bytes(0, "-") == "-"
    assert fmt_bytes(1, "-") == "1 B"


def test_rates_counts_and_durations() -> None:
    assert fmt_rate(95.1e9, "B/s") == "95.1 GB/s"
    assert fmt_count(7e9) == "7B"
    assert (fmt_seconds(850e-6), fmt_seconds(0.0123), fmt_seconds(1.25)) == (
        "850 µs", "12.3 ms", "1.25 s",
    )  # fmt: skip
