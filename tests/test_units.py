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


@pytest.mark.parametrize(("s", "text"), [
    (1.0, "1.00 s"), (0.9997, "1.00 s"), (0.0009996, "1.00 ms"), (0.5, "500 ms"),
    (12.0, "12.0 s"), (119.96, "2.00 min"), (200.0, "3.33 min"), (100_000.0, "27.8 h"),
    (100e-6, "100 µs"), (2e-9, "2.00 ns"), (0.0, "0 s"), (-1.5, "-1.50 s"),
    (None, "–"), (float("inf"), "–"),
])  # fmt: skip
def test_a_duration_prints_in_the_unit_that_fits_after_rounding(s, text) -> None:  # type: ignore[no-untyped-def]
    """The run page's headline once showed a one-second step as "1e+03 ms"."""
    assert fmt_seconds(s) == text


def test_rates_and_counts_pick_their_prefix_after_rounding() -> None:
    assert fmt_rate(999.96e6, "B/s") == "1 GB/s"
    assert fmt_rate(12e12, "B/s") == "12 TB/s"
    assert fmt_rate(999.6, "") == "1 k"
    assert fmt_count(999_999) == "1M"
    assert "e+" not in fmt_rate(999.99e9, "B/s") + fmt_count(999.9e9)
