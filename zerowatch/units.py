"""How zerowatch writes quantities for people: one formatter per unit, used by the CLI
(`zerowatch plan`, `zerowatch demo`), the pages and the charts alike.

The convention:

- **Bytes are binary** (KiB, MiB, GiB, TiB: powers of 1024), everywhere a byte count is
  shown: memory against a device's capacity (which drivers and `nvidia-smi` count in
  binary units; an "80 GB" H100 holds 80 GiB), and bytes communicated or offloaded, so that
  two figures side by side are always in the same unit. The ZeRO paper counts in decimal
  GB; its worked figures are checked in bytes (tests/test_plan.py), not in print.
- **Rates and counts are decimal**: bandwidth in GB/s (10^9 bytes per second, as nccl-tests
  reports algbw and busbw and as links are sold), parameters as 7B, 350M.
- **Durations** pick ns, µs, ms, s, min or h, after rounding to three significant digits
  (a step of 0.9997 s is "1.00 s").

Input is always accepted in either form (`80GiB` or `80GB`, see zerowatch.plan.parse_bytes);
only the output follows the convention. Standard library only.
"""

from __future__ import annotations

import math

#: A gibibyte (2^30 bytes): chart axes of byte quantities are in GiB.
GIB = 2**30
#: A gigabyte (10^9 bytes): bandwidth axes are in GB/s.
GB = 10**9

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: float | None, zero: str | None = None) -> str:
    """A byte count in binary units, three significant digits: 1.5 GiB, 300 MiB, 12 KiB.

    Args:
        n: bytes (may be negative: a shortfall); None or not finite prints "–".
        zero: what to print for exactly 0 (a table's "-" for "none"); default "0 B".

    Returns:
        The count in the largest unit that keeps it at or above 1 (whole numbers from 100
        up, never an exponent).
    """
    if n is None or not math.isfinite(n):
        return "–"
    if n == 0 and zero is not None:
        return zero
    sign, value = ("-" if n < 0 else ""), abs(float(n))
    unit = _BINARY[0]
    for unit in _BINARY:
        if value < 1024 or unit == _BINARY[-1]:
            break
        value /= 1024
    if unit == "B" or value >= 100:
        return f"{sign}{value:.0f} {unit}"
    return f"{sign}{value:.3g} {unit}"


def _sig3(x: float) -> float:
    """`x` rounded to three significant digits: the unit is picked after rounding, so that
    999.7 ms prints as 1.00 s, not as 1e+03 ms."""
    return float(f"{x:.3g}")


#: Duration units, smallest first: (name, seconds in one, the rounded value it stops at).
_DURATIONS = (("ns", 1e-9, 1e-6), ("µs", 1e-6, 1e-3), ("ms", 1e-3, 1.0), ("s", 1.0, 120.0), ("min", 60.0, 7200.0),
              ("h", 3600.0, math.inf))  # fmt: skip


def fmt_seconds(s: float | None) -> str:
    """A duration to three significant digits in the unit that fits: 850 µs, 12.3 ms,
    1.00 s, 3.20 min, 5.00 h (trailing zeros kept: "1.00 s" says the precision; a step of
    0.9997 s is "1.00 s", never "1e+03 ms"); 0 prints "0 s"; None or not finite "–"."""
    if s is None or not math.isfinite(s):
        return "–"
    if s == 0:
        return "0 s"
    sign, r = ("-" if s < 0 else ""), _sig3(abs(float(s)))
    name, scale = next((n, k) for n, k, stop in _DURATIONS if r < stop)
    return f"{sign}{f'{r / scale:#.3g}'.rstrip('.')} {name}"


def fmt_rate(x: float | None, unit: str = "/s") -> str:
    """A rate with a decimal prefix: 1.23 k/s, 95.1 GB/s (with unit="B/s"); the prefix is
    picked after rounding to three digits (999.9 M/s prints 1 G/s, never 1e+03 M/s)."""
    if x is None or not math.isfinite(x):
        return "–"
    r = _sig3(x)
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(r) >= scale:
            return f"{_sig3(r / scale):g} {prefix}{unit}"
    return f"{r:g} {unit}"


def fmt_count(n: float) -> str:
    """A count with a decimal suffix: 70B, 1.5T, 350M, 2K (the suffix picked after rounding
    to three digits: 999,999 prints 1M)."""
    r = _sig3(n)
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if r >= scale:
            return f"{_sig3(r / scale):g}{suffix}"
    return f"{r:g}"


__all__ = ["GB", "GIB", "fmt_bytes", "fmt_count", "fmt_rate", "fmt_seconds"]
