"""Nothing lost, no traceback: run directories, signals, full disks and damaged inputs, as a user meets them.

Signals are sent to real `precprof` processes; the full disk is a simulated ENOSPC (and a real tmpfs where
this machine lets the test mount one).
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from html import unescape
from pathlib import Path

import forks
import pandas as pd
import processes
import pytest
import torch

import precprof
from precprof import _atomic, _saving, cli, pipeline, rundir, runfiles
from precprof import tables as T
from precprof.capture import stream
from precprof.errors import RunNotSavedWarning, UserError
from precprof.training import TrainConfig, failure, train

TINY = ["--batch-size", "2", "--seq-len", "8", "--device", "cpu", "--no-progress"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def tiny_config(out: Path, **kw: object) -> TrainConfig:
    base: dict[str, object] = {
        "steps": 4,
        "batch_size": 2,
        "seq_len": 8,
        "device": "cpu",
        "progress": False,
        "out": out,
    }
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


def no_tmp_files(run_dir: Path) -> bool:
    return not [p for p in run_dir.iterdir() if _atomic.is_tmp(p) or p.suffix == ".tmp"]


# ------------------------------------------------------------------------------------- the run directory
def test_out_that_is_a_file_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "a-file"
    target.write_text("mine")
    t0 = time.perf_counter()
    rc, _, err = run_main(["train", "--out", str(target), *TINY, "--steps", "100000"], capsys)
    assert rc == 2 and time.perf_counter() - t0 < 30  # refused at once, not after 100000 steps
    assert "is a file, not a directory" in one_line_error(err)
    assert target.read_text() == "mine"


@pytest.mark.parametrize("where", ["/proc/precprof-test-run", "/proc/self/precprof/run"])
def test_out_that_cannot_be_created_is_refused_before_training(
    where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    rc, _, err = run_main(["train", "--out", where, *TINY, "--steps", "100000"], capsys)
    assert rc == 2
    assert one_line_error(err).startswith("precprof: error: --out ")


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("", "--out is empty"),
        (" ", "--out ' ' is blank"),
        ("x" * 300, "File name too long"),
        (os.fsdecode(b"run-\xff"), "not valid UTF-8"),
    ],
    ids=["empty", "blank", "300-characters", "not-utf-8"],
)
def test_out_names_that_cannot_hold_a_run_are_refused_before_training(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    needle: str,
) -> None:
    """`--out ""` wrote into the current directory, `--out " "` made a folder named " ", a 300-character name
    and a name that is not UTF-8 (pyarrow cannot open it) were tracebacks after training."""
    monkeypatch.chdir(tmp_path)
    for command in (["train"], ["compare", "--precisions", "fp32,bf16"]):
        rc, _, err = run_main([*command, "--out", name, *TINY, "--steps", "100000"], capsys)
        assert rc == 2
        line = one_line_error(err)
        assert needle in line and "--out" in line, line
        assert list(tmp_path.iterdir()) == []  # nothing created, here or under the name


_ASCII_LOCALE_NAMES = """
import os, sys
from precprof import rundir
assert sys.getfilesystemencoding() == "ascii", sys.getfilesystemencoding()
for name, option in (("runs/r\\xe9sum\\xe9", "out"), (os.fsdecode("runs/r\\xe9sum\\xe9".encode()), "--out")):
    try:
        rundir.check_name(name, option)
    except rundir.RunDirError as e:
        print(e)
    else:
        print("accepted", ascii(name))
print("ascii", rundir.check_name("runs/resume"), os.listdir("."))
"""


def test_a_non_ascii_out_where_file_names_are_ascii_is_refused_before_training(tmp_path: Path) -> None:
    """``LC_ALL=C PYTHONUTF8=0`` and ``--out runs/résumé``: the name passed the check (its surrogates round-trip
    to UTF-8), training ran, and Arrow refused the name at the save: a traceback, the stream empty, nothing of
    the run kept; ``Profiler(out="runs/résumé")`` was a raw UnicodeEncodeError from the check itself. Both are one
    line before anything is written, printable in that locale, naming both fixes."""
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    root = str(Path(precprof.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _ASCII_LOCALE_NAMES], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    for line, option in zip(lines, ("out", "--out"), strict=False):
        assert line.startswith(
            f"{option} 'runs/r\\xe9sum\\xe9': the name is not ASCII, and this Python's file "
        ), line
        assert line.endswith("; choose an ASCII name, or run with PYTHONUTF8=1 (Python's UTF-8 mode)"), line
    assert lines[2] == "ascii runs/resume []"  # an ASCII name passes; nothing was made


def test_a_data_file_whose_name_is_not_utf_8_trains_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The name goes into summary.json and the page: the run gave no report (rc 0) and `precprof report` on
    it was a traceback every time."""
    data = tmp_path / os.fsdecode(b"text-\xff.txt")
    data.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "run"
    rc, _, err = run_main(["train", "--out", str(out), "--data", str(data), *TINY, "--steps", "2"], capsys)
    assert rc == 0 and "Traceback" not in err, err
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE and not summary.get(T.SUMMARY_ERRORS)
    assert os.fsencode(summary[T.SUMMARY_CONFIG]["data"]["path"]) == os.fsencode(data)  # the name, exactly
    page = (out / T.REPORT_FILE).read_bytes().decode("utf-8")  # valid UTF-8: the byte shows as U+FFFD
    assert "text-\ufffd.txt" in page
    rc, _, err = run_main(["report", str(out)], capsys)
    assert rc == 0 and "Traceback" not in err, err


def test_an_existing_run_is_never_overwritten_silently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc, _, _ = run_main(
        ["train", "--out", str(out), *TINY, "--steps", "3", "--seed", "1", "--no-report"], capsys
    )
    assert rc == 0
    first = T.read_summary(out)
    (out / "notes.txt").write_text("the user's own file")
    rc, _, err = run_main(["train", "--out", str(out), *TINY, "--steps", "2", "--seed", "2"], capsys)
    assert rc == 2
    line = one_line_error(err)
    assert "already holds a precprof run (complete)" in line and "--overwrite" in line
    assert T.read_summary(out) == first  # untouched

    rc, _, _ = run_main(
        ["train", "--out", str(out), *TINY, "--steps", "2", "--seed", "2", "--overwrite", "--no-report"],
        capsys,
    )
    assert rc == 0
    second = T.read_summary(out)
    assert second[T.SUMMARY_CONFIG]["seed"] == 2 and len(T.read_tables(out)["steps"]) == 2
    assert (out / "notes.txt").read_text() == "the user's own file"  # only precprof's files are replaced


def test_overwrite_removes_the_reports_for_other_machines_of_the_run_it_replaces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`precprof report RUN --target h100` writes RUN/report-h100.html; --overwrite kept it, a page of the fp32
    run beside the bf16 run that replaced it. It goes with the run; a page of the user's own stays. So does the
    traceback.txt of a run that crashed; a user's own file of that name is never written over."""
    out = tmp_path / "run"
    rc, _, _ = run_main(["train", "--out", str(out), *TINY, "--steps", "2", "--no-report"], capsys)
    assert rc == 0
    rc, printed, _ = run_main(["report", str(out), "--target", "H100"], capsys)
    assert rc == 0 and Path(printed.strip()) == out / "report-h100.html"
    (out / "report-mine.html").write_text("<p>the user's own page</p>")
    assert rundir.write_traceback(out, "Traceback (most recent call last):\n") == out / T.TRACEBACK_FILE
    rc, _, _ = run_main(
        ["train", "--out", str(out), *TINY, "--steps", "2", "-p", "bf16", "--overwrite", "--no-report"],
        capsys,
    )
    assert rc == 0
    assert not (out / "report-h100.html").exists() and not (out / T.TRACEBACK_FILE).exists()
    assert (out / "report-mine.html").read_text() == "<p>the user's own page</p>"
    (out / T.TRACEBACK_FILE).write_text("my notes")
    assert rundir.write_traceback(out, "Traceback (most recent call last):\n") is None
    assert (out / T.TRACEBACK_FILE).read_text() == "my notes"


def test_a_folder_with_a_users_own_table_is_not_called_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out at a folder holding the user's own layers.parquet: it was refused as "already holds a precprof
    run (no summary)". It is refused still (the run would write over that file), saying which file and that it
    is no run."""
    out = tmp_path / "mine"
    out.mkdir()
    pd.DataFrame({"layer": ["a", "b"], "size": [1, 2]}).to_parquet(out / "layers.parquet")
    before = (out / "layers.parquet").read_bytes()
    rc, _, err = run_main(["train", "--out", str(out), *TINY, "--steps", "2"], capsys)
    assert rc == 2
    line = one_line_error(err)
    assert "holds layers.parquet, which a run writes over, but no precprof run (no summary.json)" in line
    assert "already holds a precprof run" not in line and "--overwrite" in line
    assert (out / "layers.parquet").read_bytes() == before and sorted(os.listdir(out)) == ["layers.parquet"]


def test_overwrite_is_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_main(["train", "--help"], capsys)
    assert rc == 0 and "--overwrite" in out


def test_default_run_directories_never_collide(tmp_path: Path) -> None:
    base = tmp_path / "runs" / "gpt-nano-fp32-20260101-000000"
    a = rundir.claim_new(base)
    b = rundir.claim_new(base)
    try:
        assert a.path == base and b.path == base.with_name(base.name + "-2")
        # a claim abandoned before anything was recorded (under torchrun: another rank failed before the first
        # step) leaves no empty directory behind, which a default name made
        a.abandon()
        assert not a.path.exists() and b.path.exists()
    finally:
        a.release()
        b.release()


def test_one_writer_per_directory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    held = rundir.claim(out)
    try:
        # this process holds it: "another precprof process (pid <its own>)" sent users looking for one
        with pytest.raises(rundir.RunDirError, match=r"a Profiler in this process is still writing") as e:
            rundir.claim(out, overwrite=True)
        assert "another precprof" not in str(e.value) and "that Profiler's detach() first" in str(e.value)
    finally:
        held.release()
    again = rundir.claim(out, overwrite=True)  # the lock went with the release
    again.release()


def test_two_processes_on_the_same_out(tmp_path: Path) -> None:
    """Both start at once: one trains and writes, the other is refused with one line; the directory holds
    one run, never files of both."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "precprof", "train", "--out", str(out), *TINY, "--steps", "8"]
    cmd += ["--no-report"]  # (the page is not read here)
    env = {**ENV, "OMP_NUM_THREADS": "1"}  # one intra-op thread, as the run alone below
    procs = [
        forks.popen(
            [*cmd, "--seed", str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for seed in (1, 2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read() if p.stderr else "") for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, err in results if rc == 2)
    assert "another precprof process" in loser or "already holds a precprof run" in loser
    summary = T.read_summary(out)
    steps = T.read_tables(out)["steps"]
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE and len(steps) == 8
    assert not (out / rundir.LOCK_FILE).exists()  # a finished run leaves no lock file
    # the steps table and the summary come from the same run
    assert summary[T.SUMMARY_FINAL]["final_loss"] == pytest.approx(float(steps[T.LOSS].iloc[-1]))
    winner_seed = summary[T.SUMMARY_CONFIG]["seed"]
    # this process keeps the threads torch started with (2 on 2 cores without pytest-xdist, whose workers inherit
    # conftest's OMP_NUM_THREADS=1): LayerNorm's backward on the CPU sums its weight and bias gradients in one
    # buffer per intra-op thread, and two threads' losses differed from one's at 1e-6 by step 16
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = train(tiny_config(tmp_path / "alone", steps=8, seed=winner_seed, report=False))
    finally:
        torch.set_num_threads(threads)
    assert steps[T.LOSS].tolist() == alone.steps[T.LOSS].tolist()


# -------------------------------------------------------------------------------------------- full disk
def test_disk_full_is_an_incomplete_run_with_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = runfiles.write_parquet

    def fill_the_disk(df: pd.DataFrame, path: Path) -> None:
        if "histograms" in str(path):
            Path(str(path)).write_bytes(b"PAR1 half a file")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(df, path)

    monkeypatch.setattr(runfiles, "write_parquet", fill_the_disk)
    out = tmp_path / "run"
    with pytest.warns(RunNotSavedWarning, match=f"{out} was not saved whole"):
        result = train(tiny_config(out))
    summary = T.read_summary(out)
    assert summary == result.summary
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    reason = summary[T.SUMMARY_INCOMPLETE_REASON]
    assert "No space left on device" in reason and "tables could not be written" in reason
    # the histograms' parts streamed while training are their record; the tables that were saved are whole
    assert "histograms.parquet: stream/ keeps steps 0-3 of them" in reason, reason
    assert "saved: steps.parquet, memory.parquet, layers.parquet" in reason, reason
    assert not (out / T.TABLE_FILES["histograms"]).exists()  # no half-written table under the real name
    assert no_tmp_files(out)
    read = T.read_run(out)
    assert read.streamed and len(read.tables["steps"]) == 4 and len(read.tables["histograms"])
    assert any("saved whole" in n for n in read.notices)


def small_disk(monkeypatch: pytest.MonkeyPatch, root: Path, size: int) -> None:
    """Make ``root`` behave as a file system of ``size`` bytes: a file written under it fails with ENOSPC when
    it is flushed (precprof's every file is written to a temporary name and fsynced before its rename,
    ``precprof._atomic``) while the files there, it included, take more than ``size``; removing files frees
    room. A real small file system needs root to mount (``test_disk_full_on_a_real_tmpfs``, which streams
    through the writer process). The file system made here is this process's alone: the stream's thread
    writes its parts here, as where its process cannot start."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs Linux's /proc/self/fd")
    monkeypatch.setattr(stream, "USE_PROCESS", False)
    real = os.fsync

    def fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if root in path.parents:
            used = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
            if used > size:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def assert_says_what_it_kept(out: Path, err: str) -> dict[str, object]:
    """The terminal names the run directory and the cause; summary.json keeps the configuration and says
    what was not saved; every file that is there reads back whole; no temporary file is left."""
    assert "Traceback" not in err, err
    assert f"precprof: error: {out} was not saved whole" in err and "No space left on device" in err, err
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert summary[T.SUMMARY_CONFIG]["steps"] == 12  # the configuration survives
    reason = summary[T.SUMMARY_INCOMPLETE_REASON]
    assert "No space left on device" in reason and reason in " ".join(err.split()), (reason, err)
    for name in T.TABLE_FILES.values():  # what is there is whole; what is not is named
        if (out / name).exists():
            pd.read_parquet(out / name)
        elif not (out / "stream").exists():
            assert name in reason.split("not saved:")[1], (name, reason)
    if not (out / T.REPORT_FILE).exists():
        assert T.REPORT_FILE in reason, reason
    assert no_tmp_files(out)
    return summary


@pytest.mark.parametrize("size", [120_000, 60_000, 12_000])
def test_a_disk_that_fills_up_keeps_what_fits_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """It exited 0 with nothing on the terminal: on 400 KiB no stream part and no table, on 600 KiB no report,
    on 120 KiB a summary.json of status and cause alone (the configuration gone). A disk of 120 kB here holds
    the tables and a trimmed summary but not the report; 60 kB the small tables; 12 kB a summary."""
    out = tmp_path / "run"
    small_disk(monkeypatch, out, size)
    with pytest.warns(UserWarning, match=r"stream of .* stopped writing.* No space left on device"):
        rc, stdout, err = run_main(["train", "--out", str(out), *TINY, "--steps", "12"], capsys)
    assert rc == 1, err
    summary = assert_says_what_it_kept(out, err)
    assert f"run directory: {out}" in stdout
    # every step is either in the directory (its tables, or the stream when they did not fit) or named lost
    kept = sorted(T.read_run(out).tables["steps"][T.STEP]) if T.is_run_dir(out) else []
    lost = re.search(r"steps (\d+)-(\d+) were not saved", summary[T.SUMMARY_INCOMPLETE_REASON])
    named = list(range(int(lost.group(1)), int(lost.group(2)) + 1)) if lost else []
    if kept or named:
        assert sorted(set(kept) | set(named)) == list(range(12)), (kept, named)
    if (out / T.TABLE_FILES["steps"]).exists():  # the loss curve, whole, whenever it fits
        assert kept == list(range(12))
    if size >= 60_000:
        assert kept, "the rows that fit are kept"


def test_compare_on_a_full_disk_says_so_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """compare.html that does not fit was a traceback; a run that did not fit passed in silence."""
    out = tmp_path / "cmp"
    monkeypatch.setattr(runfiles, "write_parquet", _no_room_for("layers"))
    real = _atomic.write_text

    def no_room_for_the_page(path: object, text: str) -> Path:
        if str(path).endswith("compare.html"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, text)  # type: ignore[arg-type]

    monkeypatch.setattr(_atomic, "write_text", no_room_for_the_page)
    argv = ["compare", "--out", str(out), "--precisions", "fp32,bf16", *TINY, "--steps", "2", "--no-report"]
    rc, _, err = run_main(argv, capsys)
    assert rc == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert f"precprof: error: {out / 'fp32'} was not saved whole" in lines[0], lines
    assert lines[-1].startswith(f"precprof: error: the comparison could not be written in {out}"), lines
    assert "No space left on device" in lines[-1], lines


def _no_room_for(table: str) -> object:
    real = runfiles.write_parquet

    def write_parquet(df: pd.DataFrame, path: Path) -> None:
        if f"{table}.parquet" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(df, path)

    return write_parquet


def test_a_full_disk_keeps_the_summary_before_the_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the tables fit and no summary.json does, the tables go: a run directory without its configuration
    cannot be read, or told from another."""
    out = tmp_path / "run"
    tables = train(tiny_config(tmp_path / "ref", steps=12, report=False)).summary
    ref = tmp_path / "ref"
    claimed = rundir.claim(out, summary={T.SUMMARY_CONFIG: tables[T.SUMMARY_CONFIG]})
    try:
        room = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        room += sum((ref / f).stat().st_size for f in T.TABLE_FILES.values()) + 500  # not a full summary
        small_disk(monkeypatch, out, room)
        with pytest.warns(UserWarning, match=f"{out} was not saved whole"):
            written = pipeline.finish_run(out, T.read_tables(ref), tables, render=True)
    finally:
        claimed.release()
    assert written[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    on_disk = T.read_summary(out)
    assert on_disk[T.SUMMARY_CONFIG] == tables[T.SUMMARY_CONFIG]
    assert on_disk[T.SUMMARY_INCOMPLETE_REASON] == written[T.SUMMARY_INCOMPLETE_REASON]
    assert "left out of summary.json" in written[T.SUMMARY_INCOMPLETE_REASON]
    assert no_tmp_files(out)


@pytest.mark.parametrize("crash", [None, "the loss went away"])
def test_a_save_that_could_not_write_is_not_the_next_saves_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash: str | None
) -> None:
    """A save that could not write (a full disk) kept its cause in the Profiler: the next save, written whole
    once room was made or into another directory, said "incomplete" with that old cause (each failed attempt
    appended, another directory's included), and so did prof.status (h69). A save's failure is its own; the
    cause of a crash stays the run's, in every save."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prof, losses = precprof.Profiler(model, opt, sample_every=2), []
    with contextlib.suppress(RuntimeError), prof:
        for _ in range(4):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
            losses.append(loss.item())
        if crash:
            raise RuntimeError(crash)
    full, room = tmp_path / "full", runfiles.write_parquet
    monkeypatch.setattr(runfiles, "write_parquet", _no_room_for("layers"))
    with pytest.warns(RunNotSavedWarning, match="No space left on device"):
        prof.save(full)
    assert prof.status[0] == T.STATUS_INCOMPLETE and "No space left on device" in str(prof.status[1])
    monkeypatch.setattr(runfiles, "write_parquet", room)  # room made
    expected = (T.STATUS_INCOMPLETE, f"RuntimeError: {crash}") if crash else (T.STATUS_COMPLETE, None)
    for run in (full, tmp_path / "other"):  # saved again, and into another directory
        prof.save(run)
        summary = T.read_summary(run)
        assert (summary[T.SUMMARY_STATUS], summary[T.SUMMARY_INCOMPLETE_REASON]) == expected
        assert prof.status == expected
        tables = T.read_tables(run)
        assert tables["steps"][T.LOSS].tolist() == pytest.approx(losses)
        assert sorted(set(tables["layers"][T.STEP])) == [0, 2]


def test_a_report_removed_for_the_summarys_room_makes_the_run_incomplete_at_the_users_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk with room for report.html but not for summary.json beside it: the page is removed so that the
    summary fits. The run said "complete" (incomplete_reason null), and its warning "was not saved whole: None"
    at precprof/capture/results.py's line, not at the user's prof.report() (t4). Now it is incomplete, saying
    the report was removed and why, training_finished still true, and the warning is at the user's line."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = tmp_path / "run"
    prof = precprof.Profiler(model, opt, out=out, sample_every=1)
    with prof:
        for _ in range(3):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    real = _atomic.write_bytes

    def no_room_beside_the_report(path: str | os.PathLike[str], data: bytes) -> Path:
        path = Path(path)
        if path.name == T.SUMMARY_FILE and (path.parent / T.REPORT_FILE).exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data)

    monkeypatch.setattr(_atomic, "write_bytes", no_room_beside_the_report)
    with pytest.warns(RunNotSavedWarning) as said:
        here = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        prof.report()
    [warning] = [w for w in said if issubclass(w.category, RunNotSavedWarning)]
    assert (warning.filename, warning.lineno) == (__file__, here), (warning.filename, warning.lineno)
    summary = T.read_summary(out)
    reason = summary[T.SUMMARY_INCOMPLETE_REASON]
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE and summary[T.SUMMARY_TRAINING_FINISHED], summary
    assert reason.startswith(f"{T.REPORT_FILE} was removed to make room for summary.json"), reason
    assert "No space left on device" in reason and f"not saved: {T.REPORT_FILE}" in reason, reason
    assert str(warning.message) == f"precprof: {out} was not saved whole: {reason}"
    assert prof.status == (T.STATUS_INCOMPLETE, reason)
    assert not (out / T.REPORT_FILE).exists() and no_tmp_files(out)
    assert T.read_tables(out)["steps"][T.STEP].tolist() == [0, 1, 2]


def test_each_smaller_summary_keeps_what_the_larger_one_had_but_its_bulk() -> None:
    full = {
        T.SUMMARY_CONFIG: {"steps": 3},
        T.SUMMARY_CAPTURE: {"modules": [1, 2], "device": "cpu"},
        T.SUMMARY_RECOMMENDATION: {"format": "bf16", "block_what_if": {"x": 1}, "findings": [1]},
        T.SUMMARY_MEMORY: {"a": 1},
        T.SUMMARY_STATUS: T.STATUS_COMPLETE,
    }
    levels = list(_saving.summary_levels(full))
    assert levels[0] == (full, [])  # the first is the whole summary, untouched by the later ones
    assert levels[-1] == (
        {T.SUMMARY_CONFIG: {"steps": 3}, T.SUMMARY_STATUS: T.STATUS_COMPLETE},
        [
            "recommendation.block_what_if",
            "memory",
            "capture.modules",
            "recommendation.findings",
            "capture",
            "recommendation",
        ],
    )
    assert full[T.SUMMARY_RECOMMENDATION]["findings"] == [1]


def test_disk_full_on_a_real_tmpfs(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A 1.5 MiB tmpfs: the tables fit in part; the run ends incomplete naming ENOSPC and nothing is half
    written. Needs root and permission to mount (skips otherwise). The training runs in this process (its
    stream's writer process writes to the tmpfs as in a ``precprof train`` of its own); ``capfd`` reads what
    either wrote to the terminal."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        out = mnt / "run"
        with pytest.warns(
            UserWarning, match=r"stream of .* stopped writing after step \d+ .* left: the stream"
        ):
            _, _, err = run_main(
                ["train", "--out", str(out), *TINY, "--steps", "60", "--sample-every", "1"], capfd
            )
        assert "Traceback" not in err, err
        summary = T.read_summary(out)
        assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE, summary.get(T.SUMMARY_INCOMPLETE_REASON)
        assert "No space left on device" in summary[T.SUMMARY_INCOMPLETE_REASON]
        assert no_tmp_files(out)
        for name in T.TABLE_FILES.values():  # what is there is whole
            if (out / name).exists():
                pd.read_parquet(out / name)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ---------------------------------------------------------------------------------------------- signals
def start_training(out: Path, *extra: str, command: str = "train") -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "precprof", command, "--out", str(out), *TINY, *extra]
    return forks.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def test_a_process_a_test_started_ends_with_the_test() -> None:
    """What the suite's autouse fixture does after each test: a process a test started and left running is
    killed (a failed test's 100,000-step training once ran on through the rest of a CI run)."""
    proc = processes.popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert processes.reap() == [proc.pid] and proc.returncode == -signal.SIGKILL
    assert processes.reap() == []


def wait_for(predicate: object, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    t0 = time.time()
    while not predicate():  # type: ignore[operator]
        if proc.poll() is not None:
            raise AssertionError(
                f"the process ended early ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}"
            )
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the run to start")
        time.sleep(0.1)


def communicate_or_dump(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    """The process's stderr once it ended; when it has not ended within ``timeout``, every thread's Python stack
    (``PYTHONFAULTHANDLER``: SIGABRT dumps them) in the failure, to say where it hung."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            err = proc.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            err = proc.communicate()[1]
        stacks = err.split("\nExtension modules:")[0][-8000:]  # faulthandler lists the loaded modules last
        raise AssertionError(
            f"still running {timeout:.0f} s after the signal; its threads:\n{stacks}"
        ) from None


def training_started(out: Path) -> bool:
    try:
        return "running (pid" in (T.read_summary(out).get(T.SUMMARY_INCOMPLETE_REASON) or "")
    except Exception:
        return False


def test_a_stream_that_stops_in_precprof_train_is_one_line_of_its_own(tmp_path: Path) -> None:
    """Tester t4: a ``precprof train`` whose stream stopped writing (its folder gone under it, as a disk error or
    a killed writer stops it) printed Python's two warning lines, attributed to ``precprof/__main__.py:20`` and
    its ``run()``, which is no line of the user's. It is the command's own line now, as its notes and errors are."""
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "precprof",
        "train",
        "--out",
        str(out),
        *TINY,
        "--steps",
        "40",
        "--sample-every",
        "1",
    ]
    env = {
        **ENV,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path]),
    }  # (this checkout's)
    proc = forks.popen(
        [*args, "--no-report"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    wait_for(lambda: len(list(out.glob("stream/*/*.steps.parquet"))) >= 2, proc)
    os.rename(out / "stream", tmp_path / "moved")  # (at once: the writer may be writing into it)
    err = communicate_or_dump(proc)
    assert proc.returncode == 1, err  # (the steps it wrote there are lost: the run is incomplete)
    lines = err.splitlines()
    said = [line for line in lines if "the stream stopped writing" in line]
    assert len(said) == 1 and said[0].startswith(
        "precprof: warning: the stream stopped writing after step"
    ), err
    assert "UserWarning" not in err and "__main__.py" not in err and "run()" not in err, err
    assert any(line.startswith("precprof: error: ") for line in lines), err  # (its save's line, as before)


@pytest.mark.parametrize(
    ("sig", "code", "word"),
    [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "Ctrl-C"), (signal.SIGHUP, 129, "hangup")],
)
def test_a_signal_saves_the_run(tmp_path: Path, sig: int, code: int, word: str) -> None:
    if signal.getsignal(sig) == signal.SIG_IGN:  # under nohup: the child ignores SIGHUP too, as it should
        pytest.skip(f"{signal.Signals(sig).name} is ignored here, and so by the training started from here")
    out = tmp_path / "run"
    proc = start_training(out, "--steps", "100000", "--sample-every", "1")
    # a step recorded (each sampled step streams a steps part): a fixed wait was too short on a busy machine
    wait_for(lambda: any(out.glob("stream/*/*.steps.parquet")), proc)
    proc.send_signal(sig)
    err = communicate_or_dump(proc)
    assert proc.returncode == code, err
    assert "Traceback" not in err and f"the partial run is in {out}" in err
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert (
        word in summary[T.SUMMARY_INCOMPLETE_REASON]
        and signal.Signals(sig).name in summary[T.SUMMARY_INCOMPLETE_REASON]
    )
    assert summary[T.SUMMARY_TRAINING_FINISHED] is False  # its banner says where it stopped
    steps = T.read_tables(out)["steps"]
    assert steps[T.LOSS].notna().sum() >= 1
    assert (out / T.REPORT_FILE).exists() and no_tmp_files(out)
    assert not (out / rundir.LOCK_FILE).exists()  # nobody holds the directory any more
    # where it stopped, of how many (a SIGKILL's page says it; a signal's said only "before the run stopped"):
    # the finished steps, as the summary counts them; a step the signal cut off is named apart
    banner = (out / T.REPORT_FILE).read_text().split('id="incomplete"', 1)[1].split("</div>", 1)[0]
    finished = steps[~T.flags(steps[T.CUT_OFF])]
    last, n = int(finished[T.STEP].max()), len(finished)
    assert n == summary[T.SUMMARY_FINAL]["steps_done"]
    assert (
        f"before the run stopped, after step {last:,} ({n:,} step{'s' if n != 1 else ''} of the 100,000 planned"
        in banner
    )


CRASHES = textwrap.dedent(
    """
    from torch import nn

    class Crashes(nn.Module):
        def __init__(self, vocab_size):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, 16)
            self.wrong = nn.Linear(32, 16)
            self.head = nn.Linear(16, vocab_size)
            self.calls = 0

        def forward(self, x):
            h = self.emb(x)  # recorded: the step it stops in has a row
            self.calls += 1
            if self.calls == 6:
                h = self.wrong(h)  # my bug: a layer of the wrong width, which torch's linear.py refuses
            return self.head(h)

    def crashes(vocab_size):
        return Crashes(vocab_size)
    """
)


def test_the_step_a_crash_cut_off_is_not_counted_as_done(tmp_path: Path) -> None:
    """A model whose forward raises mid-step: the steps table keeps that step's row, marked cut off, with no
    loss. The banner said "after step 25 (26 steps" and the header "steps 26" where the summary had 25 steps
    done; they count the finished steps now, and name the one cut off."""
    path = tmp_path / "crashy.py"
    path.write_text(CRASHES)
    out = tmp_path / "run"
    args = ["-m", "precprof", "train", "-m", f"{path}:crashes", "--out", str(out), *TINY, "--steps", "20"]
    args += ["--sample-every", "1"]
    proc = forks.run([sys.executable, *args], capture_output=True, text=True, env=ENV, timeout=600)
    error = "mat1 and mat2 shapes cannot be multiplied (16x16 and 32x16)"
    assert proc.returncode == 1 and error in proc.stderr, proc.stderr
    steps = T.read_tables(out)["steps"]
    cut = T.flags(steps[T.CUT_OFF])
    assert cut.sum() == 1 and (~cut).sum() >= 1 and steps[T.LOSS][cut].isna().all()
    done = T.read_summary(out)[T.SUMMARY_FINAL]["steps_done"]
    assert done == (~cut).sum()  # the summary's count: the finished steps
    cut_step = int(steps[T.STEP][cut].iloc[0])
    assert cut_step == int(steps[T.STEP].max()) == done  # steps 0 .. done - 1 finished
    # the model's error in one line, which says the step, the model's line and where its traceback is: a
    # traceback of torch's module calls around the model's line buried where the partial run was; the line is
    # the model's own, not that of torch's linear.py, which raised (h78)
    line = next(i for i, text in enumerate(CRASHES.splitlines(), 1) if "self.wrong(h)" in text)
    kept = out / T.TRACEBACK_FILE
    assert proc.stderr.strip().splitlines()[-3:] == [
        f"precprof: error: the model raised RuntimeError in the forward pass of step {cut_step} (at {path}:{line}, "
        f"in forward): {error}; its traceback is in {kept}",
        f"precprof: training stopped: the partial run is in {out} ({done} finished steps)",
        f"report: {out / T.REPORT_FILE}",
    ], proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"line {line}, in forward\n    h = self.wrong(h)" in kept.read_text()
    assert kept.read_text().endswith(f"RuntimeError: {error}\n")
    page = (out / T.REPORT_FILE).read_text()
    banner = page.split('id="incomplete"', 1)[1].split("</div>", 1)[0]
    assert (
        f"after step {cut_step - 1} ({done} step{'s' if done != 1 else ''} of the 20 planned; "
        f"step {cut_step} was cut off)" in banner
    ), banner
    header = page.split('<ul class="headline">', 1)[1].split("</ul>", 1)[0]
    assert f'<span class="k">steps</span><span class="v">{done}</span>' in header, header
    sampled = T.read_tables(out)["layers"][T.STEP].nunique()  # the cut-off step's records are kept
    assert f'<span class="k">sampled steps</span><span class="v">{sampled} (1 cut off)</span>' in header


class WrongWidth(torch.nn.Module):
    """A model's bugs: a layer of the wrong width (nn.Linear(32, 16) on 16 features), an error without a
    message."""

    def __init__(self) -> None:
        super().__init__()
        self.mid = torch.nn.Linear(16, 16)
        self.wrong = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError
        return self.wrong(self.mid(x))


def test_the_one_line_of_a_models_error_names_the_models_line_under_torch_compile_too() -> None:
    """The one line names the model's own line, not torch's linear.py that refused its layer of the wrong
    width (h78). Under torch.compile the layer is refused while Dynamo traces the model with fake tensors: its
    error, TorchRuntimeError, said "RuntimeError when making fake tensor call" (a page of explanation below),
    Dynamo's frames only in its traceback, and the line named no place; it names the model's RuntimeError and
    line. An error without a message ends at the place; a message's last full stop is not left before the
    terminal's "; its traceback is in ..."."""
    model = WrongWidth()
    source, first = inspect.getsourcelines(WrongWidth.forward)
    raise_line, call_line = (
        first + next(i for i, s in enumerate(source) if w in s) for w in ("raise", "wrong")
    )
    head = "the model raised {} in the forward pass of step 3 (at {}:{}, in forward)"
    with pytest.raises(RuntimeError) as eager:
        model(torch.zeros(2, 16))
    said = failure.keep(eager.value, model, "factory", None, 3, failure.FORWARD)
    assert said.blame == "model" and said.traceback is None
    expected = "mat1 and mat2 shapes cannot be multiplied (2x16 and 32x16)"
    assert said.text == head.format("RuntimeError", __file__, call_line) + f": {expected}", said.text
    with pytest.raises(ValueError) as bare:
        model(torch.zeros(16))
    said = failure.keep(bare.value, model, "factory", None, 3, failure.FORWARD)
    assert said.text == head.format("ValueError", __file__, raise_line), said.text
    try:
        with pytest.raises(RuntimeError) as traced:
            torch.compile(model, backend="eager")(torch.zeros(2, 16))
    finally:
        torch.compiler.reset()
    said = failure.keep(traced.value, model, "factory", None, 3, failure.FORWARD)
    assert said.blame == "model"
    head = head.replace("in the forward", "under torch.compile in the forward")
    assert said.text.startswith(head.format("RuntimeError", __file__, call_line) + ": "), said.text
    assert "fake tensor" not in said.text and not said.text.endswith("."), said.text
    # summary.json's cause too (the report's banner, compare's lines): the model's error, not Dynamo's
    cause = failure.reason(traced.value, model)
    assert cause.startswith("RuntimeError under torch.compile: a and b must have same reduction dim"), cause
    assert failure.reason(eager.value, model) == f"RuntimeError: {expected}"


EXITS = textwrap.dedent(
    """
    import os, sys
    from torch import nn

    class Exits(nn.Module):
        def __init__(self, vocab_size):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, 16)
            self.head = nn.Linear(16, vocab_size)
            self.calls = 0

        def forward(self, x):
            if x.shape[0] == 3:  # the training's batches (the checks before it run batches of 1 and 2)
                self.calls += 1
                if self.calls == 4:  # an early stop in the user's code, in the fourth step
                    code = os.environ["EXIT_WITH"]
                    sys.exit(int(code) if code.isdigit() else code)
            return self.head(self.emb(x))

    def exits(vocab_size):
        return Exits(vocab_size)
    """
)


@pytest.mark.parametrize(
    ("code", "rc", "said"),
    [
        ("0", 1, ["precprof: training stopped by sys.exit(0)"]),
        ("3", 3, ["precprof: training stopped by sys.exit(3)"]),
        ("stopping early", 1, ["stopping early", "precprof: training stopped by sys.exit"]),
    ],
)
def test_sys_exit_in_the_models_code_says_where_the_partial_run_is(
    tmp_path: Path, code: str, rc: int, said: list[str]
) -> None:
    """A model whose forward calls sys.exit(0) in the fourth step (an early stop): ``precprof train`` exited 0 with
    nothing on the terminal, its run saved incomplete ("SystemExit: 0") and named nowhere; sys.exit("text")
    printed the text alone (any other exception's traceback ends with "precprof: the partial run was saved to
    DIR"). Each says where the partial run is, as after Ctrl-C, and the exit code is not 0."""
    path = tmp_path / "exits.py"
    path.write_text(EXITS)
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "precprof",
        "train",
        "-m",
        f"{path}:exits",
        "--out",
        str(out),
        "--steps",
        "8",
    ]
    args += ["--batch-size", "3", "--seq-len", "8", "--device", "cpu", "--no-progress"]
    proc = forks.run(args, capture_output=True, text=True, env={**ENV, "EXIT_WITH": code}, timeout=600)
    assert proc.returncode == rc, proc.stderr
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    # the call and its line (compare's lines said "stopped after 3 of 8 steps: SystemExit")
    line = EXITS.splitlines().index("                sys.exit(int(code) if code.isdigit() else code)") + 1
    call = f"sys.exit({code}) in" if code.isdigit() else "sys.exit in"
    text = "" if code.isdigit() else f": {code}"
    assert summary[T.SUMMARY_INCOMPLETE_REASON] == f"{call} forward (exits.py, line {line}){text}"
    done = summary[T.SUMMARY_FINAL]["steps_done"]
    assert done == 3 == T.read_tables(out)["steps"][T.LOSS].notna().sum()  # the fourth never finished
    where = f": the partial run is in {out} ({done} finished steps)"
    expected = [*said[:-1], said[-1] + where, f"report: {out / T.REPORT_FILE}"]
    assert proc.stderr.strip().splitlines() == expected, proc.stderr
    assert (out / T.REPORT_FILE).exists() and proc.stdout == ""


def test_an_error_in_precprofs_own_code_keeps_its_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's model's error is one line and the file its traceback is in
    (test_the_step_a_crash_cut_off_is_not_counted_as_done); one raised in precprof's own code (here its gradient
    norm, handed a max_norm it cannot compare) is a bug to report: it keeps its traceback, which says so, and
    its copy is beside the partial run."""
    from precprof.training import loop

    real_norm, calls = loop.grad_norm_, []

    def norm(params: list[torch.Tensor], max_norm: float = 0.0) -> torch.Tensor:
        calls.append(1)
        return real_norm(params, "x" if len(calls) == 2 else max_norm)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "grad_norm_", norm)
    out = tmp_path / "run"
    with pytest.raises(TypeError) as info:
        cli.main(["train", "--out", str(out), *TINY, "--steps", "3", "--no-report"])
    kept = out / T.TRACEBACK_FILE
    assert info.value.__notes__ == [
        f"precprof: the partial run was saved to {out}",
        f"precprof: the error was raised in precprof's own code, a bug: please report it with {kept}",
    ]
    assert "in grad_norm_\n    if max_norm > 0:" in kept.read_text()
    assert "error" not in capsys.readouterr().err
    assert T.read_summary(out)[T.SUMMARY_FINAL]["steps_done"] == 1


STOPS_THE_SECOND_RUN = textwrap.dedent(
    """
    import os, sys
    from torch import nn

    class Stops(nn.Module):
        def __init__(self, vocab_size):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, 16)
            self.head = nn.Linear(16, vocab_size)

        def forward(self, x):
            if x.shape[0] == 3:  # the training's batches, counted over the runs of the process
                n = int(os.environ["FORWARDS"]) + 1
                os.environ["FORWARDS"] = str(n)
                if n == 6:  # the second run's third step
                    sys.exit()
            return self.head(self.emb(x))

    def stops(vocab_size):
        return Stops(vocab_size)
    """
)


def test_sys_exit_in_a_run_of_compare_says_what_each_run_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``precprof compare`` whose second run's model calls sys.exit() ended with nothing on the terminal, exit
    code 0, and no compare.html. The process still ends, as asked, once the runs so far are compared, the
    stopped one among them: the check lines say it stopped and where, the stopped run is named as ``precprof
    train`` names it, then the page and the run not trained; the exit code says the comparison did not finish."""
    path = tmp_path / "stops.py"
    path.write_text(STOPS_THE_SECOND_RUN)
    monkeypatch.setenv("FORWARDS", "0")
    out = tmp_path / "cmp"
    argv = ["compare", "-m", f"{path}:stops", "-p", "fp32,bf16,fp16", "--out", str(out), *TINY]
    rc, printed, err = run_main([*argv, "--batch-size", "3", "--steps", "3", "--no-report"], capsys)
    assert rc == 1, err
    line = STOPS_THE_SECOND_RUN.splitlines().index("                sys.exit()") + 1
    stopped = f"bf16 stopped after 2 of 3 steps: sys.exit() in forward (stops.py, line {line})"
    assert stopped in printed, printed
    assert err.strip().splitlines()[-4:] == [
        f"precprof: training of bf16 stopped by sys.exit(): the partial run is in {out / 'bf16'} (2 finished "
        "steps)",
        f"report: not rendered; `precprof report {out / 'bf16'}` renders it",
        f"comparison: {out / 'compare.html'}",
        "not run: fp16",
    ], err
    runs = {r["label"]: r for r in json.loads((out / "compare.json").read_text())["runs"]}
    assert sorted(runs) == ["bf16", "fp32"] and runs["bf16"]["stopped"] == stopped.removeprefix("bf16 ")
    assert runs["fp32"]["stopped"] == "" and not (out / "fp16").exists()


def test_ctrl_c_while_the_command_starts_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C while precprof's modules load (the first second of any command) printed a KeyboardInterrupt
    traceback and exited by the signal. ``-X importtime`` lists each module as it finishes loading: the
    signal is sent once typer (the command line's first import) has loaded, while the rest still loads."""
    out = tmp_path / "run"
    args = [sys.executable, "-X", "importtime", "-m", "precprof", "train", "--out", str(out), *TINY]
    proc = processes.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.split("|")[-1].strip() == "typer":
            proc.send_signal(signal.SIGINT)
            break
    _, rest = proc.communicate(timeout=120)
    err = "".join(ln for ln in [*seen, *rest.splitlines(keepends=True)] if "import time:" not in ln)
    assert proc.returncode == 130, err
    assert err.strip() == "precprof: interrupted", err
    assert not out.exists()


def test_a_released_lock_is_never_held_by_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished run removes its .precprof.lock (it stayed behind). A process that opened the old file just
    before it was removed, and locks it after, holds a lock on a file no one else sees: it must notice and
    lock the file that is there instead, or two processes would write one directory."""
    out = tmp_path / "run"
    rundir.claim(out).release()
    assert not (out / rundir.LOCK_FILE).exists()
    real = rundir.fcntl.flock
    swapped = []

    def flock_after_the_holder_left(fd: int, op: int) -> None:
        if not swapped:  # between our open and our flock, the holder released and removed the file ...
            swapped.append(os.fstat(fd).st_ino)
            (out / rundir.LOCK_FILE).unlink()
            (out / rundir.LOCK_FILE).write_text("")  # ... and another claimer made a new one
        real(fd, op)

    monkeypatch.setattr(rundir.fcntl, "flock", flock_after_the_holder_left)
    held = rundir.claim(out, overwrite=True)
    try:
        assert held._fd is not None
        assert os.fstat(held._fd).st_ino == os.stat(out / rundir.LOCK_FILE).st_ino != swapped[0]
    finally:
        held.release()


def test_a_second_ctrl_c_still_leaves_a_consistent_directory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start_training(out, "--steps", "100000", "--sample-every", "1")
    # a step recorded (each sampled step streams a steps part), as in test_a_signal_saves_the_run: the training
    # is in its loop (a fixed 1.5 s wait trained some 1.5 s of steps more, for nothing)
    wait_for(lambda: any(out.glob("stream/*/*.steps.parquet")), proc)
    proc.send_signal(signal.SIGINT)
    for _ in range(5):  # an impatient user
        time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert summary[T.SUMMARY_INCOMPLETE_REASON].startswith("interrupted (Ctrl-C")
    tabs = T.read_tables(out)
    assert summary[T.SUMMARY_FINAL]["steps_done"] == int(tabs["steps"][T.LOSS].notna().sum())
    assert no_tmp_files(out)


def test_sigkill_leaves_a_directory_that_says_it_is_incomplete(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start_training(out, "--steps", "100000")
    wait_for(lambda: training_started(out), proc)
    proc.kill()
    proc.wait(timeout=60)
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert "the process ended before it could save: killed" in summary[T.SUMMARY_INCOMPLETE_REASON]
    assert summary[T.SUMMARY_CONFIG]["steps"] == 100000  # what was running is on record
    # the kernel dropped the dead process's lock: the directory can be reused with --overwrite. Right after the
    # first summary the training starts processes (the C compiler's probes, the writer): killed then, a child
    # between its fork and its exec holds a copy of the lock's descriptor a moment longer (once in a suite on a
    # loaded machine), and the lock goes with that copy
    deadline = time.monotonic() + 10
    while True:
        try:
            rundir.claim(out, overwrite=True).release()
            break
        except rundir.RunDirError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_compare_interrupted_compares_the_runs_that_finished(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    # (no page is read here: the interrupted fp32 run's report is not rendered, 1.3 s of CPU)
    proc = start_training(
        out, "--precisions", "fp32,bf16", "--steps", "100000", "--no-report", command="compare"
    )
    # the reference (fp32) trains first: stop compare while it trains
    wait_for(lambda: training_started(out / "fp32"), proc)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert T.read_summary(out / "fp32")[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert not (out / "bf16").exists()  # the next run never started


def test_compare_sigterm_after_a_finished_run_writes_compare_html(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    proc = start_training(out, "--precisions", "fp32,bf16", "--steps", "3", "--no-report", command="compare")

    def second_running() -> bool:
        return training_started(out / "bf16")

    # fp32 (3 steps) finishes; bf16 then gets a long run by... it has 3 steps too: stop it as soon as it runs
    try:
        wait_for(second_running, proc, timeout=120)
    except AssertionError:
        pytest.skip("the second run finished before the signal could be sent")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    if proc.returncode == 0:
        pytest.skip("the second run finished before the signal arrived")
    assert proc.returncode == 143, err
    assert f"the runs that finished are compared in {out / 'compare.html'}" in err
    html = (out / "compare.html").read_text()
    assert "fp32" in html
    assert json.loads((out / "compare.json").read_text())


def test_ctrl_c_while_the_report_renders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "render_html", interrupted)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(out))
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert "interrupted before or while rendering report.html" in summary[T.SUMMARY_INCOMPLETE_REASON]
    assert f"precprof report {out}" in summary[T.SUMMARY_INCOMPLETE_REASON]
    assert len(T.read_tables(out)["steps"]) == 4 and not (out / T.REPORT_FILE).exists()
    assert T.SUMMARY_RECOMMENDATION in summary  # the analysis was done before rendering
    assert no_tmp_files(out)


def _no_room_for_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _atomic.write_text

    def write_text(path: object, text: str) -> Path:
        if str(path).endswith(T.REPORT_FILE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, text)  # type: ignore[arg-type]

    monkeypatch.setattr(_atomic, "write_text", write_text)


def _ctrl_c_while_the_report_renders(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "render_html", interrupted)


@pytest.mark.parametrize(
    "lose_the_report",
    [_no_room_for_the_report, _ctrl_c_while_the_report_renders],
    ids=["disk-full", "ctrl-c"],
)
def test_a_run_that_trained_every_step_and_lost_a_file_does_not_say_it_stopped(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    lose_the_report: object,
) -> None:
    """A run that trained all its steps and then could not write report.html (a full disk, Ctrl-C while it
    rendered) is incomplete, and its page said "This report covers the steps recorded before the run stopped,
    after step 3 (4 steps); the tables written before then are intact": it never stopped. summary.json says
    training ran to its end, and the page says so; a run that a signal or a crash stopped still says where."""
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        lose_the_report(m)  # type: ignore[operator]
        with contextlib.suppress(KeyboardInterrupt), warnings.catch_warnings():
            warnings.simplefilter("ignore", RunNotSavedWarning)
            train(tiny_config(out))
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE and not (out / T.REPORT_FILE).exists()
    assert summary[T.SUMMARY_TRAINING_FINISHED] is True
    rc, _, _ = run_main(["report", str(out)], capsys)
    assert rc == 0
    banner = (out / T.REPORT_FILE).read_text().split('id="incomplete"', 1)[1].split("</div>", 1)[0]
    banner = " ".join(unescape(re.sub(r"<[^>]+>", "", banner)).split())
    steps = T.read_tables(out)["steps"]
    last, n = int(steps[T.STEP].max()), len(steps)
    assert (n, last) == (4, 3)  # the 4 steps tiny_config plans, each finished
    assert (
        f"Training ran to its end, after step {last} ({n} steps): the run was not cut short, only some of its "
        "files could not be saved." in banner
    ), banner
    assert "stopped" not in banner, banner


def test_ctrl_c_while_the_tables_are_written_is_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C that lands while the finished run's tables are written is held until they are whole; it then
    stops the command (no report rendered, exit 130) instead of being forgotten (the run had said complete and
    exited 0 after rendering its report)."""
    from precprof import _signals

    write = _saving.Saving.write_tables

    def write_then_ctrl_c(self: _saving.Saving, tables: object) -> None:
        write(self, tables)  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(_saving.Saving, "write_tables", write_then_ctrl_c)
    out = tmp_path / "run"
    with _signals.handling(), pytest.raises(_signals.Interrupted) as info:
        train(tiny_config(out))
    assert info.value.exit_code == 130
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert "interrupted before or while rendering report.html" in summary[T.SUMMARY_INCOMPLETE_REASON]
    assert len(T.read_tables(out)["steps"]) == 4 and not (out / T.REPORT_FILE).exists()


def _ctrl_c() -> None:
    """A real SIGINT to this process, its handler run here (a loop's jump back runs pending signal handlers)."""
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):
        pass


def _a_run_that_trained_to_its_end_and_was_interrupted(out: Path) -> None:
    """What a Ctrl-C after the last step leaves: every planned step saved, its loss the summary's final loss,
    the run incomplete for its saving, not for its training."""
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert "interrupted before or while rendering report.html" in summary[T.SUMMARY_INCOMPLETE_REASON]
    assert summary[T.SUMMARY_TRAINING_FINISHED] is True
    steps = T.read_tables(out)["steps"]
    assert len(steps) == 4 == summary[T.SUMMARY_FINAL]["steps_done"]
    assert summary[T.SUMMARY_FINAL]["final_loss"] == pytest.approx(float(steps[T.LOSS].iloc[-1]))
    assert not (out / T.REPORT_FILE).exists() and no_tmp_files(out)
    said = cli._saved(out)
    assert said.startswith(f" after training finished: the run is in {out} (4 finished steps)"), said


def test_ctrl_c_while_the_finished_runs_tables_are_read_saves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C a moment after the last step, while the finished run's tables were read for its summary (before
    its save began, t4), saved nothing: summary.json still said "running (pid ...)", no tables, no report, and
    the terminal said the partial run was saved and how to render it. It is held until the run is saved whole,
    then stops the command as a Ctrl-C while the report renders does."""
    from precprof import _signals
    from precprof.capture import Profiler

    tables, sent = Profiler.tables, []

    def ctrl_c_then_tables(self: Profiler) -> dict[str, pd.DataFrame]:
        if not sent:
            sent.append(True)
            _ctrl_c()
        return tables(self)

    monkeypatch.setattr(Profiler, "tables", ctrl_c_then_tables)
    out = tmp_path / "run"
    with _signals.handling(), pytest.raises(_signals.Interrupted) as info:
        train(tiny_config(out))
    assert sent and info.value.exit_code == 130
    _a_run_that_trained_to_its_end_and_was_interrupted(out)


def test_ctrl_c_while_the_profiler_detaches_after_the_last_step_keeps_the_run_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while the Profiler detached after the last step (its last copy of the steps to the host) was
    the training's interrupt: the run said it stopped after an earlier step, training_finished false, and its
    final loss was an earlier step's, the steps table's last another (t4). The detach finishes first; the run
    is the finished one, interrupted while it was saved."""
    from precprof import _signals
    from precprof.capture import Profiler
    from precprof.stats import transfer

    detach, to_host, detaching, sent = Profiler.detach, transfer.to_host, [], []

    def detach_marked(self: Profiler) -> None:
        detaching.append(True)
        detach(self)

    def ctrl_c_in_the_copy(tensors: list[torch.Tensor]) -> object:
        copied = to_host(tensors)
        if detaching and not sent:  # the last steps taken off the pending list, not yet recorded
            sent.append(True)
            _ctrl_c()
        return copied

    monkeypatch.setattr(Profiler, "detach", detach_marked)
    monkeypatch.setattr(transfer, "to_host", ctrl_c_in_the_copy)
    out = tmp_path / "run"
    with _signals.handling(), pytest.raises(_signals.Interrupted) as info:
        train(tiny_config(out))
    assert sent and info.value.exit_code == 130
    _a_run_that_trained_to_its_end_and_was_interrupted(out)


CTRL_C_WHILE_RENDERING = textwrap.dedent(
    """
    import os, signal, sys, weakref
    from precprof import cli, pipeline

    real = pipeline.render_html

    def ctrl_c(_=None):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs here (a loop's jump back runs pending signal handlers)
            pass

    def render_html(*args, **kwargs):
        if sys.argv[1] == "swallowed":  # the handler runs in a weakref callback, which swallows its exception
            class Dropped:
                pass

            dropped = Dropped()
            ref = weakref.ref(dropped, ctrl_c)
            del dropped
        else:
            ctrl_c()
        return real(*args, **kwargs)

    pipeline.render_html = render_html
    cli.main(sys.argv[2:])
    """
)


@pytest.mark.parametrize("landed", ["in-the-render", "swallowed"])
def test_ctrl_c_while_the_report_renders_names_the_run_and_how_to_render_it(
    tmp_path: Path, landed: str
) -> None:
    """A real SIGINT while ``precprof train`` renders the finished run's report printed "interrupted (Ctrl-C,
    SIGINT)" alone: no run directory, no way to the report that summary.json says ``precprof report`` renders
    (the save of a finished run was outside what records where the run is). One that landed in a weakref callback
    (a real Ctrl-C 1.5 s into the render) printed Python's "Exception ignored ... Traceback ... Interrupted", let
    the render finish and the run be saved complete, and said "interrupted" alone all the same. Each now names
    the run directory as its summary describes the run, and its report or how to render it."""
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-c",
        CTRL_C_WHILE_RENDERING,
        landed,
        "train",
        "--out",
        str(out),
        *TINY,
        "--steps",
        "4",
    ]
    proc = forks.run(args, capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 130, proc.stderr
    summary = T.read_summary(out)
    done = summary[T.SUMMARY_FINAL]["steps_done"]
    assert done == 4 == len(T.read_tables(out)["steps"])  # the steps the run planned, all finished
    if landed == "swallowed":  # the render went on: the run is whole, and the terminal says so
        assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE and (out / T.REPORT_FILE).exists()
        said = f"once the run was saved whole: the run is in {out} ({done} finished steps)"
        report = f"report: {out / T.REPORT_FILE}"
    else:
        assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE and not (out / T.REPORT_FILE).exists()
        assert f"`precprof report {out}` renders it" in summary[T.SUMMARY_INCOMPLETE_REASON]
        said = f"after training finished: the run is in {out} ({done} finished steps)"
        report = f"report: not rendered; `precprof report {out}` renders it"
    assert proc.stderr.strip().splitlines() == [f"interrupted (Ctrl-C, SIGINT) {said}", report], proc.stderr


# ---------------------------------------------------------------------------- models that cannot train
NARROW = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Narrow(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 16)
            self.head = nn.Linear(16, 64)  # 64 classes; the data's byte tokens go up to 255

        def forward(self, x):
            return self.head(self.emb(x))

    class Empty(nn.Module):
        def forward(self, x):
            return torch.zeros(*x.shape, 256, requires_grad=True)

    def narrow():
        return Narrow()

    def empty():
        return Empty()
    """
)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("narrow", "the model's logits have 64 classes but the data has 256 token ids"),
        ("empty", "has no trainable parameters"),
    ],
)
def test_models_that_cannot_train_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], factory: str, message: str
) -> None:
    path = tmp_path / "mymodels.py"
    path.write_text(NARROW)
    rc, _, err = run_main(
        ["train", "-m", f"{path}:{factory}", "--out", str(tmp_path / "r"), *TINY, "--steps", "2"], capsys
    )
    assert rc == 2
    assert message in one_line_error(err)


# ------------------------------------------------------------------------------ damaged run directories
@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "good"
    train(tiny_config(out, report=False))
    return out


def damaged_copy(good: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(good, copy)
    return copy


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (
            lambda d: (d / "summary.json").write_text((d / "summary.json").read_text()[:200]),
            "summary.json is damaged (not valid JSON",
        ),
        (
            lambda d: (d / "summary.json").write_text(json.dumps({"config": 42, "status": "complete"})),
            "summary.json is damaged: 'config' should be an object, found 42",
        ),
        (lambda d: (d / "summary.json").write_bytes(b"\xff\xfe\x00garbage"), "summary.json is damaged"),
        (
            lambda d: (d / "layers.parquet").write_bytes((d / "layers.parquet").read_bytes()[:300]),
            "layers.parquet is damaged",
        ),
        (lambda d: (d / "steps.parquet").write_text("not parquet at all"), "steps.parquet is damaged"),
    ],
    ids=["truncated-summary", "config-42", "binary-summary", "truncated-parquet", "text-parquet"],
)
def test_report_on_a_damaged_run_directory_is_one_line(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: object, expected: str
) -> None:
    run_dir = damaged_copy(good_run, tmp_path)
    damage(run_dir)  # type: ignore[operator]
    rc, _, err = run_main(["report", str(run_dir)], capsys)
    assert rc == 2
    line = one_line_error(err)
    assert expected in line and str(run_dir) in line


@pytest.mark.parametrize("table", list(T.TABLE_FILES))
def test_report_on_a_foreign_table_is_one_line(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str
) -> None:
    """A Parquet file of someone else's under a table's name: memory's was an IndexError, layers' and steps'
    rendered silently as an empty run."""
    run_dir = damaged_copy(good_run, tmp_path)
    pd.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"]}).to_parquet(run_dir / T.TABLE_FILES[table])
    rc, _, err = run_main(["report", str(run_dir)], capsys)
    assert rc == 2
    line = one_line_error(err)
    assert f"{run_dir / T.TABLE_FILES[table]} is not a precprof {table} table" in line, line
    assert "columns a, b" in line and "delete it" in line, line


def test_report_on_a_run_from_a_newer_precprof_says_so(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = damaged_copy(good_run, tmp_path)
    summary = T.read_summary(run_dir)
    T.write_summary(run_dir, {**summary, T.SUMMARY_VERSION: "99.1.0"})
    rc, out, err = run_main(["report", str(run_dir)], capsys)
    assert rc == 0 and out.strip() == str(run_dir / T.REPORT_FILE)
    line = one_line_error(err)
    assert "precprof 99.1.0" in line and f"this is precprof {precprof.__version__}" in line, line
    assert "upgrade precprof" in line, line
    assert "was written by precprof 99.1.0" in (run_dir / T.REPORT_FILE).read_text()  # the page says it too


@pytest.mark.parametrize("version", ["0.0.1", precprof.__version__])
def test_report_on_a_run_an_older_precprof_advised_advises_again(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], version: str
) -> None:
    """``precprof report`` rendered the recommendation stored in the run: a run advised by an older precprof
    kept its verdict after an upgrade that fixed the advisor (today's wrong Adam verdict, say). Over an older
    version's advice it now advises again, for the machine the run recorded, and says so on the terminal and
    in the page; summary.json keeps what was stored. The same version's advice is rendered as stored."""
    run_dir = damaged_copy(good_run, tmp_path)
    summary = T.read_summary(run_dir)
    stale = {**summary[T.SUMMARY_RECOMMENDATION], "reasons": ["A STALE REASON FROM AN OLD ADVISOR"]}
    T.write_summary(run_dir, {**summary, T.SUMMARY_VERSION: version, T.SUMMARY_RECOMMENDATION: stale})
    rc, out, err = run_main(["report", str(run_dir)], capsys)
    assert rc == 0 and out.strip() == str(run_dir / T.REPORT_FILE)
    html = (run_dir / T.REPORT_FILE).read_text()
    assert T.read_summary(run_dir)[T.SUMMARY_RECOMMENDATION] == stale
    if version == precprof.__version__:
        assert err == "" and "A STALE REASON FROM AN OLD ADVISOR" in html
        return
    line = one_line_error(err)
    assert "was advised by precprof 0.0.1" in line and f"this precprof ({precprof.__version__})" in line, line
    assert "A STALE REASON FROM AN OLD ADVISOR" not in html and "was advised by precprof 0.0.1" in html
    fresh = precprof.recommend(run_dir)
    assert fresh.reasons and all(r in unescape(html) for r in fresh.reasons)


def test_report_to_an_unwritable_place_is_one_line(
    good_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    rc, _, err = run_main(["report", str(good_run), "--out", "/proc/x.html"], capsys)
    assert rc == 2
    assert one_line_error(err).startswith("precprof: error: cannot write /proc/x.html")


def test_report_with_a_missing_table_says_so_in_the_page(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = damaged_copy(good_run, tmp_path)
    (run_dir / "layers.parquet").unlink()
    rc, _, _ = run_main(["report", str(run_dir)], capsys)
    assert rc == 0
    html = (run_dir / T.REPORT_FILE).read_text()
    assert 'id="missing-tables"' in html and "<code>layers.parquet</code>" in html


def test_report_without_a_summary_says_what_it_cannot_say(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run directory whose summary.json was deleted rendered "Precision report · model · run" with no notice,
    a verdict for the machine rendering it, and "not recorded (a run from the user's own script)" as the command
    line of a precprof train run. The page and the terminal say the summary is missing and what the page cannot
    say without it."""
    run_dir = damaged_copy(good_run, tmp_path)
    (run_dir / T.SUMMARY_FILE).unlink()
    rc, _, err = run_main(["report", str(run_dir)], capsys)
    assert rc == 0
    assert err.strip() == (
        f"precprof: note: {run_dir} has no summary.json: the report is read from the tables alone, which do not "
        "say which model the run trained, the precision it asked for, how it was started, whether it finished or "
        "the machine it recorded on; its verdict is planned for the machine that rendered the report (or the one "
        "--target named)"
    )
    page = (run_dir / T.REPORT_FILE).read_text()
    banner = page.split('id="missing-tables">', 1)[1].split("</div>", 1)[0]
    text = " ".join(unescape(re.sub(r"<[^>]+>", "", banner)).split())
    assert text.startswith("Missing from the run directory: summary.json: the report is read from the tables")
    assert "which records it, is missing" in page and "a run from the user's own script" not in page


def test_gradients_too_large_for_any_fp16_scale_still_get_a_verdict_and_a_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGD at lr 1e6 without clipping: gradients so large that the fp16 scale would be below 1. The advisor
    used to recurse forever writing 2^-k, losing the recommendation and the report."""
    out = tmp_path / "huge"
    rc, _, err = run_main(
        [
            "train",
            "--out",
            str(out),
            *TINY,
            "--steps",
            "4",  # (the advice is the same at 12: fp16 ruled out, its scale 2^-16)
            "--lr",
            "1e6",
            "--optimizer",
            "sgd",
            "--grad-clip",
            "0",
        ],
        capsys,
    )
    assert rc == 0, err
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE and not summary.get(T.SUMMARY_ERRORS)
    assert summary[T.SUMMARY_RECOMMENDATION]["format"] and (out / T.REPORT_FILE).exists()
    rc, _, err = run_main(["report", str(out)], capsys)
    assert rc == 0 and "Traceback" not in err


@pytest.mark.parametrize("streamed", [True, False])
def test_a_crash_in_a_sampled_step_is_not_a_divergence(tmp_path: Path, streamed: bool) -> None:
    """A healthy fp32 loop whose own code raises mid-step (after the forward pass of a sampled step): the step
    it cut off keeps what it recorded, but it has no loss. Read as a nan loss, it had the report and compare say
    the run diverged at its last step."""
    from torch import nn

    from precprof.analysis.comparison.runs import read_run
    from precprof.compare import Variant

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
    out = tmp_path / "run"
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, out=out if streamed else None)
    with pytest.raises(RuntimeError, match="user bug"), prof:
        for step in range(10):
            loss = nn.functional.cross_entropy(model(x), y)
            if step == 6:
                raise RuntimeError("user bug at step 6")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    prof.save(out, status=T.STATUS_INCOMPLETE, reason="RuntimeError: user bug at step 6")
    steps = T.read_tables(out)["steps"]
    assert T.flags(steps[T.CUT_OFF]).tolist() == [False] * 6 + [True]  # step 6: recorded, never finished
    layers = T.read_tables(out)["layers"]
    assert 6 in set(layers[T.STEP])  # what the cut-off step reached is kept
    assert T.nonfinite_loss_tail(steps) is None
    rec = precprof.recommend(out)
    assert not [f.code for f in rec.findings if f.severity != "info"], rec.findings
    assert "diverged" not in " ".join(rec.reasons)
    page = precprof.report.render.render_run_dir(out).read_text()
    body = re.sub(r"<(style|script)>.*?</\1>", " ", page, flags=re.S)
    text = re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", body)))
    assert "diverged" not in text and "loss nan" not in text and "loss not finite" not in text
    got = read_run(Variant("fp32", "fp32"), out)
    assert got.first_nonfinite_step is None and got.final_loss == pytest.approx(
        float(steps[T.LOSS].iloc[5]), rel=0.2
    )


def test_tables_written_at_interpreter_exit_are_written(tmp_path: Path) -> None:
    """A run saved at interpreter exit (the bare callbacks' atexit after a crash): Arrow converted a table of
    more than a hundred rows per column on a pool of Python threads, which an exiting interpreter refuses
    ("cannot schedule new futures after interpreter shutdown"), so such a run was lost and its report blamed a
    kill. The tables are converted on the calling thread."""
    code = textwrap.dedent(
        f"""
        import atexit
        import concurrent.futures.thread  # imported by then in a training process (transformers, torch)
        import numpy as np, pandas as pd
        from precprof import tables as T

        n = 20_000
        h = pd.DataFrame({{T.STEP: np.zeros(n, dtype=np.int64), T.MODULE: "m", T.TENSOR: T.ACTIVATION,
                          T.PARAM: "", T.EXPONENT: np.arange(n) % 200 - 100, T.COUNT: np.ones(n, dtype=np.int64)}})
        atexit.register(lambda: T.write_tables({str(tmp_path)!r}, {{"histograms": h}}))
        """
    )
    proc = forks.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    got = pd.read_parquet(tmp_path / "histograms.parquet")
    assert len(got) == 20_000 and int(got[T.COUNT].sum()) == 20_000


def test_a_run_this_process_has_not_saved_is_named_as_ours_when_resumed(tmp_path: Path) -> None:
    """Detached, not saved, then resumed in the same process (a notebook's next cell): the refusal said
    "another precprof process (pid <this one>) is writing this run directory". Attached, it is this process's
    Profiler writing it; detached, the resume continues its run."""
    import precprof

    model, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    first = precprof.Profiler(model, out=tmp_path / "run", sample_every=1).attach()
    model(torch.randn(2, 4)).sum().backward()
    first.step()
    with pytest.raises(UserError, match="a Profiler in this process is still writing this run directory"):
        precprof.Profiler(other, out=tmp_path / "run", resume=True, first_step=1).attach()
    first.detach()
    with precprof.Profiler(model, out=tmp_path / "run", resume=True, first_step=1) as again:
        model(torch.randn(2, 4)).sum().backward()
        again.step()
    assert again.tables()["steps"]["step"].tolist() == [0, 1]


_HOLDS_A_RUN = """
import sys, time
from precprof import rundir
run = rundir.claim(sys.argv[1])
print("claimed", flush=True)
time.sleep(60)
"""


def test_a_run_directory_being_written_is_refused_as_such_before_any_overwrite_advice(tmp_path: Path) -> None:
    """A second writer on a live run directory was told "already holds a precprof run (incomplete) ... add
    --overwrite", which was then refused for the lock. The lock is said first, with the writer's pid; and from
    Python the advice to replace a run names ``overwrite=True``, not the CLI's flag."""
    out = tmp_path / "run"
    holder = forks.popen([sys.executable, "-c", _HOLDS_A_RUN, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        for overwrite in (False, True):
            with pytest.raises(rundir.RunDirError) as e:
                rundir.claim(out, overwrite=overwrite)
            msg = str(e.value)
            assert f"another precprof process (pid {holder.pid}) is writing this run directory" in msg, msg
            assert "overwrite" not in msg
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(
        UserError, match=r"already holds a precprof run \(incomplete\); .* pass overwrite=True"
    ):
        precprof.Profiler(torch.nn.Linear(2, 2), out=out).attach()
