"""How a relative change is written as a percentage: one rule for the report's pages and the comparison's
sentences, so that a run's gap reads the same in the header card and in the verdict check ("+0.003%" in one
and "0.0029%" in the other, for one gap)."""

from __future__ import annotations

import math


def change_pct(x: float, *, signed: bool = True) -> str:
    """A relative change ``x`` (0.0123 for 1.23%) as a percentage: two decimals (``+1.23%``), or the first
    significant digit below 0.01% (``−0.004%``); ``0%`` for exactly nothing, never a signed zero such as
    -0.00%. ``signed``: with its sign (``+``, ``−``), else its size alone ("within 0.004%")."""
    if x == 0:
        return "0%"
    p = 100 * x
    sign = ("+" if p > 0 else "−") if signed else ""
    a = abs(p)
    if a >= 0.01 or not math.isfinite(a):
        return f"{sign}{a:.2f}%"
    return f"{sign}{a:.{-math.floor(math.log10(a))}f}%"


def share_3g(p: float) -> str:
    """A percentage ``p`` of a share to 3 significant digits ("43.3"), without its "%"; never "100" for a share
    short of all values (99.973 is "99.97", 99.99999999 ">99.9999"): a reader takes 100% for every value."""
    said = f"{p:.3g}"
    if p < 100 <= float(said):
        for places in range(2, 7):
            if (said := f"{p:.{places}f}") != f"{100:.{places}f}":
                return said
        return ">99.9999"
    return said
