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
