"""How the advisor writes numbers: shares, powers of two, scales as GradScaler takes them, module lists."""

from __future__ import annotations

import math

from precprof import tables as T
from precprof.percent import share_3g


def _pct(share: float | None) -> str:
    if share is None or not math.isfinite(share):
        return "n/a"
    if share == 0:
        return "0%"
    p = share * 100
    if abs(p) < 1e-4:  # positional, as a reader compares shares (0.000053%, never 5.3e-05%), down to a bound
        return "<0.000001%" if abs(p) < 1e-6 else f"{_positional(p, 2)}%"
    if p < 0.01:
        return f"{p:.2g}%"
    return f"{share_3g(p)}%"


def _positional(x: float, digits: int) -> str:
    """``x`` to ``digits`` significant digits, written without an exponent (0.000053)."""
    r = float(f"{x:.{digits}g}")  # rounded first: 9.99e-5 is 0.00010, with its own number of places
    places = digits - 1 - math.floor(math.log10(abs(r)))
    return f"{r:.{max(places, 0)}f}"


def _pow2(k: int) -> str:
    return f"2^{k} ({_scale(k)})"


def _scale(k: int) -> str:
    """2^k written out as GradScaler's init_scale is typed: an integer for k >= 0, else the exact decimal
    (Python's shortest round-trip form: 0.125, 0.0009765625, 9.313225746154785e-10)."""
    return str(2**k) if k >= 0 else repr(2.0**k)


def _loss_scale_said(x: float) -> str:
    """A loss scale a run had, in words: "2^16 (65536)" for a power of two, else the scale itself, as GradScaler
    held it to fp32's 7 digits, with its log2 to two places: "1000 (2^9.97)", "953674.3 (2^19.86)" (rounded to a
    power of two it read as "2^20 (1048576)", a scale the run never had)."""
    if not (x > 0 and math.isfinite(x)):
        return _g(x)
    if math.frexp(x)[0] == 0.5:
        return _pow2(_log2i(x))
    return f"{x:.7g} (2^{math.log2(x):.2f})"


def _log2i(x: float) -> int:
    return math.frexp(x)[1] - 1


def _g(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.3g}"


def _scales(scales: list[float], limit: int = 6) -> str:
    """Loss scales seen, ascending, with their noun: "loss scale 1024", "loss scales 512, 1024", or their count
    and range when there are more than ``limit`` ("13 loss scales from 262144 to 1.07374e+09"; a run whose scale
    was set by hand every step may have thousands)."""
    if len(scales) == 1:
        return f"loss scale {scales[0]:g}"
    if len(scales) <= limit:
        return "loss scales " + ", ".join(f"{s:g}" for s in scales)
    return f"{len(scales)} loss scales from {scales[0]:g} to {scales[-1]:g}"


_name = T.module_in_prose  # a module's name as a sentence writes it ("16" quoted, a name and not a number)


def _listing(modules: list[str], limit: int) -> str:
    """Modules named as a sentence names them (``_name``), at most ``limit``, and how many more."""
    return _listed([_name(m) for m in modules], limit)


def _listed(items: list[str], limit: int) -> str:
    """``items`` (steps, words) as they are, at most ``limit``, and how many more."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
