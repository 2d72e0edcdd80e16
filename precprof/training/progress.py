"""The training loop's progress display: a live bar on a terminal, plain lines elsewhere.

On a terminal the bar's line is fitted to the window: parts are given up whole, the bar first, then the
step time, the percentage, the clock, tok/s and the loss scale, so that a number is shown whole or not at all
(tqdm cut the line at the window's edge, inside a number: a loss scale of 65536 read "scale=6553" at 80
columns). A terminal whose size reads 0 columns (``script`` without a window size, some CI ptys,
``docker exec -t``) gets the plain lines a pipe gets: tqdm drew nothing there for the whole run.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.std import Bar
from tqdm.std import tqdm as _tqdm

from precprof.training.config import TrainConfig

# the parts of the bar's line, in the order they are given up when the line is too wide for the window
# (the loss and the step count last of all)
_DROP_ORDER = ("bar", "rate", "percent", "clock", "tok/s", "scale", "desc", "loss")
_MIN_BAR = 5  # a narrower bar tells nothing: the line goes without it


def short_name(name: str, kind: str) -> str:
    """The model's name in the progress lines: ``quirk:build`` for ``path/to/quirk.py:build`` and
    ``module:make`` for ``package.module:make`` (the full spec is in summary.json); other names as they are."""
    if kind != "factory":
        return name
    target, _, attr = name.rpartition(":")
    if target.endswith(".py") or "/" in target or "\\" in target:
        stem = Path(target).stem
    else:
        stem = target.rpartition(".")[2]
    return f"{stem}:{attr}" if stem and attr else name


def scale_text(scale: float) -> str:
    """The loss scale in the progress lines, whole: ``16777216`` (``:g`` wrote 2^24 as 1.67772e+07)."""
    scale = float(scale)
    return f"{scale:.0f}" if scale.is_integer() and abs(scale) < 1e15 else f"{scale:g}"


def terminal_columns(file: Any) -> int:
    """The width of the terminal ``file`` writes to, in columns; 0 where it has none or reads 0."""
    try:
        return max(0, os.get_terminal_size(file.fileno()).columns)
    except (AttributeError, ValueError, OSError):
        return 0


def fit_line(
    desc: str,
    n: int,
    total: int,
    elapsed_s: float,
    rate: float | None,
    fields: dict[str, str],
    width: int,
    ascii: bool = False,
) -> str:
    """The progress line of step ``n`` of ``total``, at most ``width`` characters where it can be: the parts of
    tqdm's line (``desc: 40%|███   | 4/10 [00:02<00:03, 1.91step/s, loss=4.9156, scale=65536, tok/s=1,234]``),
    given up whole in ``_DROP_ORDER`` until it fits, never cut. ``rate``: steps per second (None: unknown);
    ``fields``: the postfix, name to text (loss, scale, tok/s)."""
    dropped: set[str] = set()
    line = ""
    for part in (None, *_DROP_ORDER):
        if part is not None:
            if not _has(part, desc, rate, fields):
                continue
            dropped.add(part)
        line = _line(desc, n, total, elapsed_s, rate, fields, dropped)
        if "bar" not in dropped:
            room = width - len(line) - 2  # the bar and its two "|" take the place of a space
            if total and room >= _MIN_BAR:
                bar = Bar(n / total, room, charset=Bar.ASCII if ascii else Bar.UTF)
                return _line(desc, n, total, elapsed_s, rate, fields, dropped, f"{bar}")
        elif len(line) <= width:
            return line
    return line  # the step count alone, wider than the window


def _has(part: str, desc: str, rate: float | None, fields: dict[str, str]) -> bool:
    if part == "desc":
        return bool(desc)
    if part == "rate":
        return bool(rate)
    if part in ("bar", "percent", "clock"):
        return True
    return part in fields


def _line(
    desc: str,
    n: int,
    total: int,
    elapsed_s: float,
    rate: float | None,
    fields: dict[str, str],
    dropped: set[str],
    bar: str = "",
) -> str:
    """The line with ``bar`` after the percentage (none: ""), less the parts ``dropped``."""
    inner = []
    if "clock" not in dropped:
        remaining = _tqdm.format_interval((total - n) / rate) if rate and total else "?"
        inner.append(f"{_tqdm.format_interval(elapsed_s)}<{remaining}")
    if rate and "rate" not in dropped:
        inner.append(f"{1 / rate:.2f}s/step" if rate < 1 else f"{rate:.2f}step/s")
    inner += [f"{k}={v}" for k, v in fields.items() if k not in dropped]
    parts = [f"{desc}:" if desc and "desc" not in dropped else ""]
    percent = f"{100 * n / total:3.0f}%" if total and "percent" not in dropped else ""
    parts.append(f"{percent}|{bar}|" if percent and bar else percent)
    parts.append(f"{n}/{total}" + (f" [{', '.join(inner)}]" if inner else ""))
    return " ".join(p for p in parts if p)


class FittedBar(_tqdm):  # type: ignore[misc]
    """tqdm's bar whose line is ``fit_line``'s, to the terminal's width at each refresh (a resized window is
    followed; one that comes to read 0 columns keeps the last width read)."""

    def __init__(self, total: int, desc: str, file: Any) -> None:
        try:
            rows = os.get_terminal_size(file.fileno()).lines
        except (AttributeError, ValueError, OSError):
            rows = 0
        self._fields: dict[str, str] = {}
        self._cols = terminal_columns(file) or 80
        # ncols and nrows given: tqdm reads no window size of its own (a size of 0 made it draw nothing)
        super().__init__(
            total=total,
            desc=desc,
            unit="step",
            file=file,
            leave=True,
            ncols=self._cols,
            nrows=rows if rows >= 2 else 24,
        )

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        self._fields = {str(k): str(v) for k, v in {**dict(ordered_dict or {}), **kwargs}.items()}
        super().set_postfix(ordered_dict, refresh=refresh, **kwargs)

    def __str__(self) -> str:
        d = self.format_dict
        self._cols = terminal_columns(self.fp) or self._cols
        rate = d[
            "rate"
        ]  # the recent steps' (tqdm's moving average); the whole run's at close, as tqdm's line has
        if rate is None and d["elapsed"] and self.n > self.initial:
            rate = (self.n - self.initial) / d["elapsed"]
        # one column less than the window: a line that fills it wraps the cursor to the next line on some terminals
        return fit_line(
            self.desc,
            self.n,
            self.total,
            d["elapsed"],
            rate,
            self._fields,
            self._cols - 1,
            bool(self.ascii),
        )


class LogProgress:
    """The progress bar's stand-in when stderr is not a terminal (a log file, a pipe, a batch job): one plain
    line every ``every`` steps and at the last, with the step, the loss and the throughput, instead of a
    carriage-return update per step."""

    def __init__(self, total: int, desc: str, every: int, file: Any) -> None:
        self.total, self.desc, self.every, self.file = total, desc, every, file
        self.n, self.postfix, self.t0 = 0, "", time.perf_counter()

    def set_postfix(self, postfix: dict[str, str], refresh: bool = False) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in postfix.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            pct = 100 * self.n // max(self.total, 1)
            elapsed = time.perf_counter() - self.t0
            line = f"{self.desc}: step {self.n}/{self.total} ({pct}%)"
            line += f", {self.postfix}" if self.postfix else ""
            try:
                print(f"{line}, {elapsed:.0f}s", file=self.file, flush=True)
            except BrokenPipeError:  # the reader left (`2>&1 | head`): training goes on, unprinted
                self.every = self.total + 1

    def close(self) -> None:
        pass


class NoProgress:
    def set_postfix(self, postfix: dict[str, str], refresh: bool = False) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(config: TrainConfig, name: str, file: Any = None) -> Any:
    """A live bar on a terminal (``FittedBar``) or in a notebook (tqdm's widget); elsewhere, and on a terminal
    that reads 0 columns, a plain line about every 10% of the steps (a multiple of ``refresh_every``, so that
    each line has the loss and throughput of its own step). ``file``: where it writes (stderr)."""
    file = sys.stderr if file is None else file
    if not config.progress:
        return NoProgress()
    if "ipykernel" in sys.modules and not _isatty(
        file
    ):  # a Jupyter kernel's stderr: tqdm.auto draws a widget
        from tqdm.auto import tqdm

        return tqdm(total=config.steps, desc=name, unit="step", file=file, dynamic_ncols=True, leave=True)
    if _isatty(file) and terminal_columns(file) > 0:
        return FittedBar(config.steps, name, file)
    tenth = -(-config.steps // 10)
    every = config.refresh_every * max(1, -(-tenth // config.refresh_every))
    return LogProgress(config.steps, name, every, file)


def _isatty(file: Any) -> bool:
    isatty = getattr(file, "isatty", None)
    return bool(callable(isatty) and isatty())
