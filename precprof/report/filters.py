"""Jinja filters: every number in the report is formatted here, so the page reads the same everywhere.

Each filter takes a raw value (int, float, NaN, None, numpy scalar) and returns text; missing values become an
em dash. ``sortkey`` gives the raw number the page's small sorting script compares.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from markupsafe import Markup, escape

from precprof.percent import change_pct, share_3g
from precprof.tables import INPUT_SUFFIX, module_label

MISSING = "—"


def _float(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None if v is None else float(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def num(v: Any, digits: int = 3) -> str:
    """A number with ``digits`` significant digits; scientific notation for very small or large values."""
    f = _float(v)
    if f is None:
        return MISSING if not isinstance(v, str) else v
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if f == 0:
        return "0"
    if f.is_integer() and abs(f) < 1e15:
        return f"{int(f):,}"
    a = abs(f)
    if a < 1e-3 or a >= 1e9:
        return f"{f:.{digits - 1}e}"
    if a >= 10**digits:  # 1,560 rather than 1.56e+03: the digits before the point are kept, rounded
        return f"{f:,.0f}"
    return f"{f:.{digits}g}"


def count(v: Any) -> str:
    """An integer count with thousands separators."""
    f = _float(v)
    if f is None:
        return MISSING
    if math.isinf(f):
        return "inf"
    return f"{round(f):,}"


def pct(v: Any) -> str:
    """A share in [0, 1] as a percentage with 3 significant digits; tiny nonzero shares stay visible."""
    f = _float(v)
    if f is None:
        return MISSING
    if f == 0:
        return "0%"
    p = 100 * f
    if abs(p) < 1e-4:
        return "<0.0001%"
    return f"{share_3g(p)}%"


def signed_pct(v: Any) -> str:
    """A signed relative change as a percentage (``percent.change_pct``): ``+1.23%``, ``−0.004%``, ``0%``."""
    f = _float(v)
    return MISSING if f is None else change_pct(f)


_BYTE_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def nbytes(v: Any) -> str:
    """Bytes in IEC units (KiB, MiB, GiB) with 3 significant digits, trailing zeros kept: 1000 to 1023 of a unit, which would round to
    4 digits ("1e+03 KiB" in ``.3g``), are written in the next unit ("0.98 MiB"), or as "1,020 TiB" in the last."""
    f = _float(v)
    if f is None:
        return MISSING
    sign = "-" if f < 0 else ""
    f = abs(f)
    for i, (div, unit) in enumerate(_BYTE_UNITS):
        if f >= div:
            if f / div >= 999.5 and i:  # rounds to 1000 or more: the unit above reads 0.977 to 1
                div, unit = _BYTE_UNITS[i - 1]
            x = f / div
            return f"{sign}{x:,.0f} {unit}" if x >= 999.5 else f"{sign}{_three_digits(x)} {unit}"
    return f"{sign}{f:.0f} B"


def _three_digits(x: float) -> str:
    """``x`` (at least 1, below 999.5) to 3 significant digits, its trailing zeros kept: "20.0", not "20", beside
    a "20.5" of another figure on the same page reads as the same precision."""
    places = 2 - math.floor(math.log10(float(f"{x:.3g}")))
    return f"{x:.{max(places, 0)}f}"


def pow2(v: Any) -> str:
    """A loss scale: ``32768 (2^15)`` for powers of two, the number otherwise."""
    f = _float(v)
    if f is None:
        return MISSING
    if f > 0 and math.isfinite(f):
        k = math.log2(f)
        if abs(k - round(k)) < 1e-9:
            return f"{num(f)} (2^{round(k)})"
    return num(f)


def pow2_range(lo: Any, hi: Any) -> str:
    """The loss scales a row was counted at, from ``lo`` to ``hi``: one as ``pow2`` writes it where they are the
    same; else both, "2^19 … 2^28" where they are powers of two (the numbers where they are not: "1,000 …
    4,000"), and "—" without either."""
    a, b = _float(lo), _float(hi)
    if a is None or b is None or a == b:
        return pow2(lo if a is not None else hi)

    def short(f: float) -> str:
        if f > 0 and math.isfinite(f) and abs((k := math.log2(f)) - round(k)) < 1e-9:
            return f"2^{round(k)}"
        return num(f)

    return f"{short(a)} … {short(b)}"


def log2mag(v: Any) -> str:
    """A magnitude with its binade and its place in it, ``x = 2^e · m`` with 1 <= m < 2, m cut (not rounded) to
    three decimals: ``65,504 (2^15 · 1.999)``, fp16's largest finite value, reads apart from ``65,536 (2^16)``,
    its first beyond (a log2 to one decimal wrote both 2^16.0); helps read values against format windows."""
    f = _float(v)
    if f is None:
        return MISSING
    if f <= 0 or math.isinf(f):
        return num(f)
    # a magnitude is never a count: 1.53e+14, not 152,500,279,705,600 (a wide cell in the per-layer table)
    text = f"{f:.2e}" if f >= 1e6 else num(f)
    m, e = math.frexp(f)  # f = m * 2^e exactly, 0.5 <= m < 1
    if m == 0.5:
        return f"{text} (2^{e - 1})"
    # (no-break spaces: a narrow cell breaks before the binade, never inside it)
    return f"{text} (2^{e - 1}\u00a0·\u00a0{math.floor(2 * m * 1000) / 1000:.3f})"


def sci(v: Any) -> str:
    """A ratio spanning orders of magnitude, always as mantissa and power of ten with 2 significant digits
    (``1.9e-3``, ``4.4e-1``): a column of them reads by their exponents, which ``num`` would write as 0.0019
    beside 2.3e-04."""
    f = _float(v)
    if f is None:
        return MISSING
    if f == 0 or math.isinf(f):
        return num(f)
    m, e = f"{f:.1e}".split("e")
    return f"{m}e{int(e)}"


def sortkey(v: Any) -> str:
    """The raw number for the page's sorting script ("" for missing, so those sort last)."""
    f = _float(v)
    if f is None:
        return ""
    if math.isinf(f):
        return "1e308" if f > 0 else "-1e308"
    # "0", not "0.0": the key is in every cell of a table of thousands of rows
    if f.is_integer() and abs(f) < 1e15:
        return str(int(f))
    return repr(f)


_CSS_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.-_()/#%+")


def css_string(v: Any) -> Markup:
    """``v`` as a quoted CSS string for a ``<style>`` element: every character but letters, digits and a few
    plain marks as a CSS escape, so that nothing in it can end the string or the element (``"``, ``\\``,
    ``</style>``). Markup: autoescape must not turn its quotes into entities, which a style element does not
    decode."""
    body = "".join(c if c in _CSS_PLAIN else f"\\{ord(c):x} " for c in str(v))
    return Markup(f'"{body}"')


def plain(v: Any) -> str:
    """A config/environment value as text: lists joined, dicts as k=v, bools as yes/no."""
    if v is None:
        return MISSING
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return num(v)
    if isinstance(v, Mapping):
        return ", ".join(f"{k}={plain(x)}" for k, x in v.items()) or MISSING
    if isinstance(v, (list, tuple, set)):
        return (
            ", ".join(plain(x) for x in v) or MISSING
        )  # every item: a list cut short hides what a reader needs
    return str(v)


def cmdline(v: Any) -> str:
    """A command line given as a string or an argv list."""
    if isinstance(v, Sequence) and not isinstance(v, str):
        return shlex.join(str(x) for x in v)
    return MISSING if v is None else str(v)


FILTERS: dict[str, Callable[..., str]] = {
    "num": num,
    "count": count,
    "pct": pct,
    "signed_pct": signed_pct,
    "nbytes": nbytes,
    "pow2": pow2,
    "pow2_range": pow2_range,
    "log2mag": log2mag,
    "sci": sci,
    "sortkey": sortkey,
    "css_string": css_string,
    "plain": plain,
    "cmdline": cmdline,
    "module": module_label,
}


def module_count(mods: Sequence[str], always: bool = True) -> str:
    """How many modules a finding's list names, counted as its title counts them: a layer's own input row
    ("fc:input") goes with the layer, so a list of 246 rows under "164 module(s)" reads "164 modules in 246
    rows". "" when ``always`` is False and every row is a module of its own."""
    n = len({str(m).removesuffix(INPUT_SUFFIX) for m in mods})
    if n == len(mods):
        return f"{n} module{'s' if n != 1 else ''}" if always else ""
    return (
        f"{n} module{'s' if n != 1 else ''} in {len(mods)} rows (a layer's input row counted with the layer)"
    )


FILTERS["module_count"] = module_count


def share_class(v: Any) -> str:
    """CSS class of a lost-share cell: ``bad`` from 1%, ``warn`` from 0.01%, ``some`` above 0, ``zero``."""
    f = _float(v)
    if f is None:
        return "na"
    if f >= 0.01:
        return "bad"
    if f >= 1e-4:
        return "warn"
    return "some" if f > 0 else "zero"


FILTERS["share_class"] = share_class


def step_runs(runs: Sequence[Sequence[Any]]) -> str:
    """ "0-3, 12-15" (with en dashes; "7" for a run of one step) of runs ``[first, last, ...]`` of steps."""
    return ", ".join(f"{r[0]}\u2013{r[1]}" if r[1] != r[0] else f"{r[0]}" for r in runs)


def ordinal(v: Any) -> str:
    """2nd, 3rd, 11th, 22nd."""
    n = int(v)
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


FILTERS["ordinal"] = ordinal


# before a capital that follows a small letter or digit, or that starts a word after an acronym (GELU|Activation)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def type_name(v: Any) -> Markup:
    """A module type that may wrap between its words (``NonDynamically<wbr>Quantizable<wbr>Linear``), each part
    escaped: a table's type cell takes the width of its longest word, not of the whole name (nn.MultiheadAttention's
    out_proj type printed over the next column of a stacked per-layer table, and widened the table past the page)."""
    return Markup("<wbr>").join(escape(p) for p in _CAMEL.split(str(v)))


FILTERS["type_name"] = type_name


def dotted(v: Any) -> Markup:
    """A dotted module name that may wrap after each dot (``<wbr>``), never inside a part; each part escaped.
    A filter, not a macro: the per-layer tables call it in each of their thousands of rows."""
    return Markup(".<wbr>").join(escape(p) for p in str(v).split("."))


FILTERS["dotted"] = dotted


def share_cells(shares: Sequence[Any]) -> Markup:
    """The cells of a what-if row's lost shares: each with its ``share_class``, its ``sortkey`` and its ``pct``
    (one filter call per row: the per-layer what-if table has a dozen of them in each of thousands of rows)."""
    return Markup(
        "".join(
            f'<td class="{escape(share_class(s))}" data-v="{escape(sortkey(s))}">{escape(pct(s))}</td>'
            for s in shares
        )
    )


FILTERS["share_cells"] = share_cells


def row_open(loop: Any, cls: str = "", *, first_rows: int) -> Markup:
    """The ``<tr>`` of a long table's row (class "long"): past the first ``first_rows`` it is marked "extra" from
    the start, which the page hides where its script runs (the button shows the rest); ``cls``: the row's own
    classes. ``loop``: the template's loop (its 1-based ``index``)."""
    c = (str(cls) + (" extra" if loop.index > first_rows else "")).strip()
    return Markup(f'<tr class="{escape(c)}">') if c else Markup("<tr>")
