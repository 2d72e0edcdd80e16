"""The progress bar on a terminal: its numbers are shown whole or not at all, at any width, and a terminal that
reads 0 columns gets plain lines. The bar writes to a real pseudo-terminal of a set size (no training)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import termios
from collections.abc import Iterator

import pytest

from precprof.training import TrainConfig
from precprof.training import progress as P

FIELDS = {"loss": "4.9156", "scale": "65536", "tok/s": "1,234"}
NUMBER = re.compile(r"(loss|scale|tok/s)=([\d.,]*\d)")


def _whole(line: str) -> None:
    """Each field in ``line`` is the whole of its value, never the start of it."""
    for key, value in NUMBER.findall(line):
        assert value == FIELDS[key], line


@pytest.mark.parametrize("width", [200, 110, 79, 59, 40, 20])
def test_the_line_gives_up_whole_parts_never_digits(width: int) -> None:
    for desc in ("gpt-nano fp16", "quirk:build fp16"):
        line = P.fit_line(desc, 10, 10, 24.3, 0.4, FIELDS, width)
        assert len(line) <= width, line
        _whole(line)
        assert "loss=4.9156" in line or width < 20, line
        assert "10/10" in line, line
        if "|" in line:  # the bar is the first to go: with it, every part is there
            assert all(f"{k}={v}" in line for k, v in FIELDS.items()) and "2.50s/step" in line, line


def test_the_line_drops_the_bar_then_the_step_time_first() -> None:
    # tqdm at 80 columns: "gpt-nano fp16: 100%|█| 10/10 [00:24<00:00,  2.50s/step, loss=4.9156, scale=6553"
    line = P.fit_line("gpt-nano fp16", 10, 10, 24.3, 0.4, FIELDS, 79)
    assert line == "gpt-nano fp16: 100% 10/10 [00:24<00:00, loss=4.9156, scale=65536, tok/s=1,234]"
    assert (
        P.fit_line("gpt-nano fp16", 10, 10, 24.3, 0.4, FIELDS, 59)
        == "gpt-nano fp16: 10/10 [loss=4.9156, scale=65536]"
    )


def test_a_factory_model_is_named_by_its_file_stem() -> None:
    assert P.short_name("/tmp/some/long/path/quirk.py:build", "factory") == "quirk:build"
    assert P.short_name("mypkg.models.gpt:make", "factory") == "gpt:make"
    assert P.short_name("hf:llama", "hf") == "hf:llama"
    assert P.short_name("gpt-nano", "builtin") == "gpt-nano"


def test_a_loss_scale_is_written_whole() -> None:
    assert P.scale_text(2.0**24) == "16777216"  # :g wrote 1.67772e+07
    assert P.scale_text(65536.0) == "65536" and P.scale_text(0.5) == "0.5"


@pytest.fixture
def terminal() -> Iterator[tuple[int, object]]:
    """A pseudo-terminal: its reading end, and its writing end as a text file."""
    master, slave = pty.openpty()
    file = os.fdopen(slave, "w", encoding="utf-8", buffering=1)
    yield master, file
    file.close()
    os.close(master)


def _size(file: object, cols: int, rows: int) -> None:
    fcntl.ioctl(file.fileno(), termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))  # type: ignore[attr-defined]


def _read(master: int) -> str:
    out = b""
    while select.select([master], [], [], 0.05)[0]:
        chunk = os.read(master, 65536)
        if not chunk:
            break
        out += chunk
    return out.decode("utf-8", errors="replace")


def _run(bar: object, steps: int) -> None:
    for _ in range(steps):
        bar.set_postfix(FIELDS, refresh=False)  # type: ignore[attr-defined]
        bar.update(1)  # type: ignore[attr-defined]
    bar.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("cols", [80, 60])
def test_the_bar_on_a_terminal_of_80_and_60_columns(terminal: tuple[int, object], cols: int) -> None:
    master, file = terminal
    _size(file, cols, 24)
    bar = P.progress(TrainConfig(steps=20), "quirk:build fp16", file)
    assert isinstance(bar, P.FittedBar)
    _run(bar, 20)
    lines = [ln.rstrip() for ln in re.split(r"[\r\n]+", _read(master)) if ln.strip()]
    assert lines and "20/20" in lines[-1], lines
    for line in lines:
        assert len(line) < cols, line
        _whole(line)
    assert "scale=65536" in lines[-1] and "loss=4.9156" in lines[-1], lines[-1]


def test_a_terminal_of_0_columns_gets_plain_lines(terminal: tuple[int, object]) -> None:
    # `script` without a window size: tqdm read -1 columns and rows there and drew nothing for the whole run
    master, file = terminal
    _size(file, 0, 0)
    bar = P.progress(TrainConfig(steps=20), "quirk:build fp16", file)
    assert isinstance(bar, P.LogProgress)
    _run(bar, 20)
    lines = [ln for ln in _read(master).splitlines() if ": step " in ln]
    assert [ln.split(": step ")[1].split()[0] for ln in lines] == ["10/20", "20/20"], lines
