"""``precprof compare`` on runs as they are left: each run named in the progress lines as its directory is,
a run killed before it saved, one that stopped early, one missing a table or its summary.json."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import forks
import pytest
import torch

import precprof
from precprof import _atomic, cli, pipeline, rundir, training
from precprof import compare as C
from precprof import tables as T
from precprof.analysis import comparison as A
from precprof.analysis.comparison.runs import cut_short
from precprof.errors import RunNotSavedWarning
from precprof.training import Callback, TrainConfig, train

# the tests that read the module's fixtures' runs share one pytest-xdist worker, which trains them once (each
# worker given one of them trained them again: 5 s of CPU)
RUNS = pytest.mark.xdist_group("compare-runs-read")


def _config(**kw: Any) -> TrainConfig:
    """A run of a few steps of a one-layer gpt-nano, every step profiled."""
    base: dict[str, Any] = {
        "model": "gpt-nano",
        "model_args": {"n_layer": "1"},
        "steps": 2,
        "batch_size": 2,
        "seq_len": 16,
        "sample_every": 1,
        "progress": False,
        "report": False,
    }
    return TrainConfig(**{**base, **kw})


def test_each_runs_progress_line_names_its_variant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp16, fp16:none and fp16:advised each printed "gpt-nano fp16: step ...": which of them a slow or
    diverging line belonged to could not be told. Each run's line names it as its run directory does."""
    C.compare(_config(progress=True), "fp32,bf16,bf16:none", out=tmp_path)
    err = capsys.readouterr().err
    named = re.findall(r"^gpt-nano (\S+): step 2/2", err, flags=re.MULTILINE)
    assert named == ["fp32", "bf16", "bf16-none"], err
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted(named)


KILL_AFTER = 3  # the killed run's last step: every step is sampled and flushed
KILLED = textwrap.dedent(
    f"""
    import os, signal, sys, torch
    from precprof.training import Callback, TrainConfig, train
    class Kill(Callback):
        def on_step_end(self, run):
            if run.step == {KILL_AFTER}:
                run.profiler.tables()  # waits for the writer: every step so far is on disk
                os.kill(os.getpid(), signal.SIGKILL)
    torch.set_num_threads(int(sys.argv[2]))  # the fp32 run's: the data's entropy, a sum, follows the threads
    train(TrainConfig(model="gpt-nano", model_args={{"n_layer": "1"}}, precision="bf16", steps=8, batch_size=2,
                      seq_len=16, sample_every=1, progress=False, report=False, out=sys.argv[1]),
          callbacks=[Kill()])
    """
)


@pytest.fixture(scope="module")
def fp32_and_killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An fp32 run of 8 steps, and the same run in bf16 killed (SIGKILL) after step ``KILL_AFTER``: it never
    saved its tables or its summary.json, whose first version still says it is running."""
    root = tmp_path_factory.mktemp("killed")
    train(_config(steps=8, out=root / "fp32"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    threads = str(torch.get_num_threads())
    # a fork of the preloaded Python (tests/forks.py), killed by a real SIGKILL as a fresh process is
    res = forks.run([sys.executable, "-c", KILLED, str(root / "bf16"), threads], env=env, capture_output=True)
    assert res.returncode == -signal.SIGKILL, res.stderr.decode()[-2000:]
    return root / "fp32", root / "bf16"


@RUNS
def test_a_killed_run_is_read_as_its_report_reads_it(
    fp32_and_killed: tuple[Path, Path], tmp_path: Path
) -> None:
    """A SIGKILLed run's memory read 0 B and its status the first summary's "running (pid ...)": compare read
    memory from summary.json alone, which a killed run never wrote. Read from its stream, as the report reads it,
    its parameters are the model's fp32 weights and its status says after which step it was cut off."""
    fp32_dir, killed_dir = fp32_and_killed
    assert "running (pid" in T.read_summary(killed_dir)[T.SUMMARY_INCOMPLETE_REASON]
    comp, page = C.compare_runs([fp32_dir, killed_dir], out=tmp_path)
    killed = comp.run("bf16")
    n_params = T.read_summary(fp32_dir)[T.SUMMARY_MODEL]["n_params"]
    assert killed.memory[T.PARAMETERS] == 4 * n_params  # bf16 under autocast keeps fp32 weights
    parts = [c for c in killed.memory if c not in T.MEMORY_PEAK_COMPONENTS]
    assert T.ACTIVATIONS in parts and killed.memory_total == sum(killed.memory[c] for c in parts)
    assert killed.status == T.STATUS_INCOMPLETE
    assert killed.reason is not None and killed.reason.startswith(
        f"record ends after step {KILL_AFTER}: killed"
    )
    html = page.read_text()
    assert "running (pid" not in html and f"record ends after step {KILL_AFTER}: killed" in html


@RUNS
def test_a_killed_runs_report_says_its_process_ended_not_that_it_runs(
    fp32_and_killed: tuple[Path, Path], tmp_path: Path
) -> None:
    """Tester t1: after a run killed with SIGKILL, ``precprof report RUN`` drew a page whose banner said "running
    (pid 18707, started ...)" of a process that was gone. No process holds the directory (its lock is free): the
    page says that process ended before it could save, naming it; summary.json stays as the run wrote it."""
    _, killed_dir = fp32_and_killed
    said = T.read_summary(killed_dir)[T.SUMMARY_INCOMPLETE_REASON]
    pid = re.match(r"running \((pid \d+, started [^)]*)\)", said)
    assert pid is not None and rundir.live_writer(killed_dir) is None
    page = pipeline.rerender(killed_dir, out=tmp_path / "report.html").read_text()
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))
    assert "Incomplete run." in text and "running (pid" not in text
    assert f"The process that recorded it ({pid.group(1)}) ended before it could save" in text
    assert T.read_summary(killed_dir)[T.SUMMARY_INCOMPLETE_REASON] == said  # never rewritten


@pytest.fixture(scope="module")
def fp32_and_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two complete runs of 6 steps, fp32 and bf16, to copy and damage."""
    root = tmp_path_factory.mktemp("runs")
    for precision in ("fp32", "bf16"):
        train(_config(steps=6, precision=precision, out=root / precision))
    return root / "fp32", root / "bf16"


@RUNS
def test_a_run_without_its_steps_table_is_named_not_failed(
    fp32_and_bf16: tuple[Path, Path], tmp_path: Path
) -> None:
    """A complete run whose steps.parquet was deleted was "failed" (the page's chip and outcome, beside "status
    complete") and "did not finish" on the terminal, the missing file named nowhere. It is "not compared", and
    the check lines, the runs table and a note name the missing file, as its report does."""
    fp32_dir, bf16_dir = fp32_and_bf16
    damaged = tmp_path / "no-steps"
    shutil.copytree(bf16_dir, damaged)
    (damaged / "steps.parquet").unlink()
    comp, page = C.compare_runs([fp32_dir, damaged], out=tmp_path / "cmp")
    bf16 = comp.run("bf16")
    assert bf16.outcome == A.UNCOMPARED and bf16.status == T.STATUS_COMPLETE
    assert bf16.missing == ["steps.parquet"]
    bf16_lines = [c for c in comp.checks if c.run in ("bf16", None) or "bf16" in c.text]
    assert bf16_lines and all(c.status == A.NOT_MEASURED for c in bf16_lines), bf16_lines
    assert all("steps.parquet" in c.text and "did not finish" not in c.text for c in bf16_lines), bf16_lines
    assert any(
        n.startswith(f"Missing from bf16's run directory ({damaged}): steps.parquet.") for n in comp.notes
    )
    html = page.read_text()
    text = " ".join(re.sub(r"<[^>]+>", " ", html.split("</style>", 1)[1]).split())
    assert "bf16 not compared" in text and 'class="oc-failed"' not in html and "did not finish" not in text
    assert "missing from its run directory: steps.parquet" in text


@RUNS
def test_a_run_without_summary_json_is_said_to_have_none(
    fp32_and_bf16: tuple[Path, Path], tmp_path: Path
) -> None:
    """A gpt-nano run whose summary.json was deleted, beside a gpt-nano run: compare refused them as "different
    models (gpt-nano of 496,704 parameters; a model)". Compared, the run goes by its folder, a note says it has no
    summary.json and what that leaves unchecked, and no line of the verdict check is confirmed by it."""
    fp32_dir, bf16_dir = fp32_and_bf16
    bare = tmp_path / "no-summary"
    shutil.copytree(bf16_dir, bare)
    (bare / T.SUMMARY_FILE).unlink()
    comp, page = C.compare_runs([fp32_dir, bare], out=tmp_path / "cmp")
    run = comp.run("no-summary")
    ours = T.read_tables(bf16_dir)["steps"][T.LOSS].to_numpy(dtype=float)
    assert run.steps == len(ours) and run.final_loss == pytest.approx(ours[-5:].mean(), rel=1e-12)
    assert run.status == "unknown" and run.reason == "no summary.json in its run directory"
    assert comp.notes[0].startswith(
        "no-summary has no summary.json: its model, precision and settings are not"
    )
    lines = [c for c in comp.checks if c.run == "no-summary" or "no-summary" in c.text]
    assert lines and all(c.status == A.NOT_MEASURED for c in lines), lines
    assert all("no-summary has no summary.json" in c.text.replace("No-summary", "no-summary") for c in lines)
    assert "has no summary.json" in page.read_text()


def _headline(html: str) -> str:
    return " ".join(
        re.sub(r"<[^>]+>", " ", html.split('<ul class="headline">', 1)[1].split("</ul>", 1)[0]).split()
    )


@RUNS
def test_runs_that_stopped_early_or_ran_fewer_steps_confirm_nothing(
    fp32_and_killed: tuple[Path, Path], fp32_and_bf16: tuple[Path, Path], tmp_path: Path
) -> None:
    """A bf16 run killed after 4 of 8 steps "[confirmed] matched fp32", and so did a complete bf16 run of 6
    steps beside fp32's 8: each compared on the first steps, which the terminal never said, while the page's
    chip gave fp32's loss at that step as its final loss. Their check lines are "not measured" and say why, and
    the chips say where the reference's loss is taken and that the run stopped early."""
    fp32_dir, killed_dir = fp32_and_killed
    _, bf16_dir = fp32_and_bf16
    loss = T.read_tables(fp32_dir)["steps"].sort_values(T.STEP)[T.LOSS].to_numpy(dtype=float)
    for i, (other, stopped, last) in enumerate(
        (
            (
                killed_dir,
                f"bf16 stopped (its record ends after {KILL_AFTER + 1} of 8 steps): killed",
                KILL_AFTER,
            ),
            (bf16_dir, "bf16 ran 6 steps and fp32 8", 5),
        )
    ):
        comp, page = C.compare_runs([fp32_dir, other], out=tmp_path / f"cmp{i}")
        fp32 = comp.run("fp32")
        assert fp32.final_loss == pytest.approx(loss[: last + 1][-5:].mean(), rel=1e-12)
        assert comp.run("bf16").outcome == A.MATCHED  # over the steps both ran, which is all it shows
        lines = [c for c in comp.checks if c.aspect != A.ASPECT_SPEED]
        assert lines and all(c.status == A.NOT_MEASURED for c in lines), lines
        said = f"{stopped}; compared up to step {last}, the last step every run finished"
        assert all(said in c.text for c in lines), (said, lines)
        headline = _headline(page.read_text())
        assert f"up to step {last}, where the runs are compared (it ran 8 steps)" in headline, headline
        assert ("stopped (its record ends after" in headline) == (other == killed_dir), headline
        if other == killed_dir:  # two runs killed: the reason once, each run's record where it ends
            killed = comp.run("bf16")
            twin = dataclasses.replace(killed, label="bf16b")
            assert cut_short(killed, twin).startswith(
                f"bf16 stopped (its record ends after {KILL_AFTER + 1} of 8 steps) and bf16b (its record ends after "
                f"{KILL_AFTER + 1} of 8 steps), both killed"
            )


@RUNS
def test_a_run_that_trained_every_step_and_lost_its_report_is_compared_as_whole(
    fp32_and_bf16: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 run that trained its 6 steps and could not write report.html (a full disk) is incomplete, and
    compare listed it among "not whole runs: bf16 stopped after 6 steps: report.html could not be written ...; a
    loss short of a run's end is not the loss it ends at": its loss is the loss it ends at. Its check lines are
    those of the same run saved whole."""
    fp32_dir, bf16_dir = fp32_and_bf16
    real = _atomic.write_text

    def no_room_for_the_report(path: Any, text: str) -> Path:
        if str(path).endswith(T.REPORT_FILE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, text)

    with monkeypatch.context() as m, pytest.warns(RunNotSavedWarning):
        m.setattr(_atomic, "write_text", no_room_for_the_report)
        lost = tmp_path / "lost" / "bf16"
        train(_config(steps=6, precision="bf16", out=lost, report=True))
    summary = T.read_summary(lost)
    assert (
        summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
        and "report.html" in summary[T.SUMMARY_INCOMPLETE_REASON]
    )
    whole, _ = C.compare_runs([fp32_dir, bf16_dir], out=tmp_path / "cmp-whole")
    comp, _ = C.compare_runs([fp32_dir, lost], out=tmp_path / "cmp-lost")
    assert comp.run("bf16").status == T.STATUS_INCOMPLETE and comp.run("bf16").stopped == ""
    lines = [(c.status, c.text) for c in comp.checks if c.aspect != A.ASPECT_SPEED]
    assert lines and lines == [(c.status, c.text) for c in whole.checks if c.aspect != A.ASPECT_SPEED]
    assert not any("stopped" in text or "not whole runs" in text for _, text in lines), lines


@RUNS
def test_the_terminal_says_the_notes_its_check_lines_do_not(
    fp32_and_killed: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``precprof compare`` printed its check lines alone: an fp32 run missing memory.parquet, a bf16 run killed
    after step 3 and a bf16 run of another seed left the terminal silent on the missing file and the other seed,
    which only the page's notes said (no browser on a training box). The terminal prints each note the check
    lines do not say, once, and not the one they do (the runs compared up to step 3), nor how each run ran where
    all ran eager."""
    fp32_dir, killed_dir = fp32_and_killed
    damaged = tmp_path / "fp32"
    shutil.copytree(fp32_dir, damaged)
    (damaged / "memory.parquet").unlink()
    train(_config(steps=8, precision="bf16", seed=7, out=tmp_path / "seed7"))
    dirs = [damaged, killed_dir, tmp_path / "seed7"]
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", *map(str, dirs), "--out", str(tmp_path / "cmp")])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out.splitlines()
    checks = [ln for ln in out if ln.startswith("[")]
    notes = [ln.removeprefix("note: ") for ln in out if ln.startswith("note: ")]
    assert len(checks) + len(notes) + 1 == len(out) and out[-1].startswith("comparison: ")
    assert any(
        f"bf16 stopped (its record ends after {KILL_AFTER + 1} of 8 steps): killed" in ln for ln in checks
    ), checks
    assert any("compared up to step 3, the last step every run finished" in ln for ln in checks), checks
    page_notes = json.loads((tmp_path / "cmp" / "compare.json").read_text())["notes"]
    assert set(notes) <= set(page_notes) and len(set(notes)) == len(notes), (notes, page_notes)
    left_out = ("The runs trained for different numbers of steps", "How each run ran: fp32 eager")
    assert [n for n in page_notes if n not in notes] == [n for n in page_notes if n.startswith(left_out)]
    seeds = {d.name: T.read_summary(d)[T.SUMMARY_CONFIG]["seed"] for d in dirs}
    assert seeds == {"fp32": 0, "bf16": 0, "seed7": 7}
    assert any("seed: fp32 0, bf16 0, seed7 7." in n for n in notes), notes
    assert any(n.startswith(f"Missing from fp32's run directory ({damaged}): memory.parquet.") for n in notes)


class CtrlC(Callback):
    """Ctrl-C after step ``at``, as the training loop meets it: a KeyboardInterrupt between steps."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, run: Any) -> None:
        if run.step == self.at:
            raise KeyboardInterrupt


def _cut(out: Path, at: int, **kw: Any) -> Path:
    """A run of 8 planned steps stopped by Ctrl-C after step ``at``."""
    with pytest.raises(KeyboardInterrupt):
        train(_config(steps=8, out=out, **kw), callbacks=[CtrlC(at)])
    return out


def test_two_runs_cut_by_ctrl_c_say_why_they_stopped_once(tmp_path: Path) -> None:
    """Two runs cut by Ctrl-C, compared: each check line said "stopped after 3 of 8 steps: interrupted (Ctrl-C,
    SIGINT); fp32 stopped after 5 of 8 steps: interrupted (Ctrl-C, SIGINT)". It says how far each ran, and why
    both stopped once."""
    fp32 = _cut(tmp_path / "fp32", 4)
    bf16 = _cut(tmp_path / "bf16", 2, precision="bf16")
    done = {d.name: len(T.read_tables(d)["steps"]) for d in (fp32, bf16)}
    assert done == {"fp32": 5, "bf16": 3}
    reason = T.read_summary(fp32)[T.SUMMARY_INCOMPLETE_REASON]
    assert reason == T.read_summary(bf16)[T.SUMMARY_INCOMPLETE_REASON] == "interrupted (Ctrl-C, SIGINT)"
    comp, _ = C.compare_runs([fp32, bf16], out=tmp_path / "cmp")
    lines = [c.text for c in comp.checks if c.aspect != A.ASPECT_SPEED]
    assert lines
    said = f"bf16 stopped after 3 of 8 steps and fp32 after 5 of 8 steps, both {reason}"
    for text in lines:
        assert said in text and text.count(reason) == 1, text


def test_compare_cut_by_ctrl_c_prints_the_check_lines_of_the_runs_that_finished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``precprof compare --precisions fp32,bf16`` stopped by Ctrl-C while bf16 trained wrote compare.html of the
    fp32 run, and the terminal said only "interrupted (Ctrl-C, SIGINT): the runs that finished are compared in
    ...": no check line, as a whole comparison prints. It prints the page's check lines, then that line."""
    real = training.train

    def bf16_cut(config: TrainConfig, **kw: Any) -> Any:
        if config.precision == "bf16":
            kw["callbacks"] = [CtrlC(1)]
        return real(config, **kw)

    monkeypatch.setattr(training, "train", bf16_cut)
    args = ["compare", "-m", "gpt-nano", "-a", "n_layer=1", "--precisions", "fp32,bf16", "--steps", "4"]
    args += ["--batch-size", "2", "--seq-len", "16", "--no-progress", "--no-report", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 130
    out, err = capsys.readouterr()
    assert (
        f"interrupted (Ctrl-C, SIGINT): the runs that finished are compared in {tmp_path / C.COMPARE_HTML}"
        in err
    )
    page = json.loads((tmp_path / C.COMPARE_JSON).read_text())
    assert [r["label"] for r in page["runs"]] == ["fp32"]
    lines = [f"[{c['status']}] {c['text']}" for c in page["checks"]]
    assert lines and out.splitlines()[: len(lines)] == lines, out


def test_a_run_stopped_after_one_step_reads_as_english(tmp_path: Path) -> None:
    """ "stopped after 1 of 3 step" and "(1 finished steps)": the plural follows the planned steps where they are
    given, the finished ones otherwise."""
    from types import SimpleNamespace

    from precprof.analysis.comparison import runs

    read: Any = SimpleNamespace(streamed=False)
    said = [
        runs._stopped(T.STATUS_INCOMPLETE, "RuntimeError: x", read, done, planned, {})
        for done, planned in [(1, 3), (1, None), (2, None), (0, 3)]
    ]
    assert said == [
        "stopped after 1 of 3 steps: RuntimeError",
        "stopped after 1 step: RuntimeError",
        "stopped after 2 steps: RuntimeError",
        "stopped after 0 of 3 steps: RuntimeError",
    ]
    (tmp_path / T.SUMMARY_FILE).write_text(
        json.dumps({T.SUMMARY_STATUS: T.STATUS_INCOMPLETE, T.SUMMARY_FINAL: {"steps_done": 1}})
    )
    assert f"the partial run is in {tmp_path} (1 finished step)\n" in cli._saved(tmp_path)


@RUNS
def test_a_diverged_run_sets_no_common_step_and_hides_no_miss(
    fp32_and_killed: tuple[Path, Path], tmp_path: Path
) -> None:
    """An fp16 run that died (its loss nan from step 1, 4 steps) cut fp32's and bf16's 8 steps to its own 4: bf16
    was "not measured, compared up to step 3", and the Loss line was "[confirmed] no run in another format matched
    fp32's loss (fp16)" while bf16, unmeasured, may have. A diverged run is compared on the steps it ran and sets
    no common step: bf16 and fp32 are compared whole, as without it."""
    fp32_dir, _ = fp32_and_killed
    train(_config(steps=8, precision="bf16", out=tmp_path / "bf16"))
    dead = tmp_path / "fp16"
    train(_config(steps=4, precision="fp16", loss_scale="none", lr=1e4, grad_clip=0.0, out=dead))
    assert T.read_tables(dead)["steps"][T.LOSS].isna().tolist() == [False, True, True, True]
    alone, _ = C.compare_runs([fp32_dir, tmp_path / "bf16"], out=tmp_path / "cmp-alone")
    comp, _ = C.compare_runs([fp32_dir, tmp_path / "bf16", dead], out=tmp_path / "cmp")
    fp32, bf16 = comp.run("fp32"), comp.run("bf16")
    assert fp32.steps == bf16.steps == 8 and fp32.final_loss == alone.run("fp32").final_loss
    assert (bf16.outcome, bf16.gap) == (alone.run("bf16").outcome, alone.run("bf16").gap)
    assert comp.run("fp16").outcome == A.DIVERGED and comp.run("fp16").first_nonfinite_step == 1
    # bf16's lines are those it has without the dead run: none says it was cut short
    said = {(c.status, c.text) for c in comp.checks if c.run == "bf16"}
    assert said == {(c.status, c.text) for c in alone.checks if c.run == "bf16"}, said
    assert not any("compared up to step" in c.text for c in comp.checks), comp.checks
    assert any(
        "fp16: 4): each is compared on its steps up to step 7, the last all of them finished but fp16, which ended "
        "with a non-finite loss before it" in n
        for n in comp.notes
    ), comp.notes


def _own_loop_run(out: Path, steps: int, inf_at: int | None = None, loss: bool = True) -> Path:
    """A Profiler in a loop of its own over a tiny Linear: the loss it hands ``prof.step`` is inf at ``inf_at`` (a
    batch that overflowed, which the next steps recover from), or none at all (``loss=False``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for i in range(steps):
            value = torch.nn.functional.mse_loss(model(x), y)
            value.backward()
            opt.step()
            opt.zero_grad()
            if loss:
                prof.step(loss=float("inf") if i == inf_at else value.detach())
            else:
                prof.step()
    prof.save(out)
    return out


def test_a_run_that_recovered_from_an_inf_loss_or_recorded_none_still_sets_the_common_step(
    tmp_path: Path,
) -> None:
    """Reviewer h93: one inf loss at step 2 of a 5-step run that then recovered made it "diverged": it set no common
    step, and was compared "matched" against the 8-step reference's loss 3 steps later; a run that recorded no loss
    at all was said to be one "whose loss went non-finite". A run that ended finite, and one without a loss, set
    the common step as before."""
    ref = _own_loop_run(tmp_path / "ref", 8)
    for name, kw in (("recovered", {"inf_at": 2}), ("no-loss", {"loss": False})):
        run = _own_loop_run(tmp_path / name, 5, **kw)
        comp, _ = C.compare_runs([ref, run], out=tmp_path / f"cmp-{name}")
        assert {r.compared_until for r in comp.runs} == {4}, (name, comp.runs)
        assert not any("non-finite" in n for n in comp.notes), comp.notes


@RUNS
def test_compare_json_leaves_each_runs_block_figures_per_layer_in_its_summary(
    fp32_and_bf16: tuple[Path, Path], tmp_path: Path
) -> None:
    """compare.json carried each run's whole recommendation, its block-format figures per linear layer with it
    (tester h104: 16 MB for two runs of a 48-layer model, 4 MB of them a run's copy of its summary.json's): they stay
    in the run's summary.json, which the comparison never read them from, counted."""
    C.compare_runs(list(fp32_and_bf16), out=tmp_path)
    compared = json.loads((tmp_path / C.COMPARE_JSON).read_text())
    for run, run_dir in zip(compared["runs"], fp32_and_bf16, strict=True):
        own = T.read_summary(run_dir)[T.SUMMARY_RECOMMENDATION]
        layers = own["block_what_if"]["layers"]
        assert layers  # the run evaluated its linear layers' block formats
        kept = run["recommendation"]["block_what_if"]
        assert "layers" not in kept and kept["layers_in_summary"] == len(layers)
        assert {k: v for k, v in kept.items() if k != "layers_in_summary"} == {
            k: v for k, v in own["block_what_if"].items() if k != "layers"
        }
        assert run["recommendation"]["findings"] == own["findings"]


STOPPED = textwrap.dedent(
    """
    import contextlib, sys, torch, precprof
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fail_at = int(sys.argv[2])
    prof = precprof.Profiler(model, optimizer=opt, out=sys.argv[1], sample_every=1)
    with contextlib.suppress(ValueError), prof:
        for step in range(4):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
            if step == fail_at:
                raise ValueError("a bug in the loop; lower the lr")
    if fail_at < 0:
        prof.save()
    """
)


def test_a_run_an_exception_stopped_reads_with_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``with Profiler(out=...)`` block that raised writes its cause into summary.json (``capture.unsaved``);
    compare read every run with only its stream as killed ("cut off after step 2: killed before it saved its
    tables"), though the run said why it stopped; and it took the stopped run, whose summary records its model's
    class and not its size, for another model than the saved run's ("these runs trained different models")."""
    monkeypatch.setattr(sys, "argv", ["-c", str(tmp_path / "fp32"), "-1"])
    exec(STOPPED, {"__name__": "saved_run"})  # saved here: its lock is released
    # stopped in a process of its own, which ends: no one holds its run
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    res = forks.run([sys.executable, "-c", STOPPED, str(tmp_path / "stopped"), "2"], env=env)
    assert res.returncode == 0
    comp, _ = C.compare_runs([tmp_path / "fp32", tmp_path / "stopped"], out=tmp_path / "cmp")
    (stopped,) = [r for r in comp.runs if r.status == T.STATUS_INCOMPLETE]
    # (the exception's own "; " kept: the cause is cut where precprof's words after it begin, reviewer r2)
    assert stopped.reason == "cut off after step 2: ValueError: a bug in the loop; lower the lr"
    assert "killed" not in stopped.reason and stopped.stopped == "stopped after 3 steps: ValueError"


def test_a_killed_compiled_run_says_the_steps_that_ran_compiled() -> None:
    """A --compile run killed before it saved keeps the config written before training, "compiled (torch.compile),
    --compile", though every step was sampled and a sampled step runs the model eagerly: compare said it ran
    compiled (reviewer r2). The steps that ran compiled are counted from its steps table."""
    import pandas as pd

    from precprof.analysis.comparison.runs import _compiled

    # (as the first summary.json of precprof train holds them, written before training)
    cfg = {"compile": True, "steps_run_compiled": None, "compiled": "compiled (torch.compile), --compile"}
    every = pd.DataFrame({T.STEP: range(4), T.SAMPLED: [True] * 4})
    assert _compiled(cfg, every, streamed=True).startswith("ran no step compiled: every step was sampled")
    some = pd.DataFrame({T.STEP: range(4), T.SAMPLED: [True, False, True, False]})
    assert "--compile: 2 of 4 steps ran compiled" in _compiled(cfg, some, streamed=True)
    # a saved run's own words stand
    assert _compiled({**cfg, "steps_run_compiled": 2}, some, streamed=False) == cfg["compiled"]


def test_a_run_still_recording_goes_by_the_precision_its_layers_show(tmp_path: Path) -> None:
    """Tester t7: a Profiler's run compared while it still records (its first summary names no precision) went
    by "run" beside the other run's precision, "run, fp32" for two fp32 runs, and read "the run run has no
    recommendation to check". It goes by its layers' precision, as its report does: two fp32 runs, by their
    folders."""

    def loop(out: Path, steps: int) -> precprof.Profiler:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        prof = precprof.Profiler(model, opt, sample_every=1, memory=False, out=out).attach()
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
        return prof

    done = loop(tmp_path / "b", 4)
    done.detach()
    done.save()
    live = loop(tmp_path / "a", 3)
    live.report()  # a look mid-run: every step so far on disk, summary.json still "running"
    try:
        comp, _ = C.compare_runs([tmp_path / "a", tmp_path / "b"], out=tmp_path / "cmp")
        assert [r.label for r in comp.runs] == ["a", "b"]
        assert all(r.precision == "fp32" for r in comp.runs)
    finally:
        live.detach()
        live.save()


def test_a_run_that_recorded_no_loss_is_not_called_diverged(tmp_path: Path) -> None:
    """Tester t5: a run whose loop called ``prof.step()`` without ``loss=`` was "diverged: the loss became
    non-finite at step 0", a red tile and a "[missed]" warnings check, though its own report said no loss was
    recorded; its summary.json's final_loss_avg10 was "NaN", what a run that diverged reached. It has no loss to
    compare: its lines are not measured and say so; as the first run the reference rule allows, it is passed
    over for one that has a loss."""
    ref = _own_loop_run(tmp_path / "ref", 6)
    run = _own_loop_run(tmp_path / "noloss", 6, loss=False)
    final = T.read_summary(run)[T.SUMMARY_FINAL]
    assert final["final_loss"] is None and final["final_loss_avg10"] is None, final
    for order, name in (([ref, run], "cmp"), ([run, ref], "cmp-first")):
        comp, _ = C.compare_runs(order, out=tmp_path / name)
        assert comp.reference == "ref", comp.reference
        mine = comp.run("noloss")
        assert mine.outcome == A.NO_LOSS and mine.first_nonfinite_step is None and not mine.curve_loss, mine
        said = [c.text for c in comp.checks] + comp.summary_lines + comp.notes
        assert not any("diverged" in t or "non-finite" in t for t in said), said
        assert all(c.status == A.NOT_MEASURED for c in comp.checks if c.run == "noloss"), comp.checks
        assert any("noloss has no loss to compare" in t for t in said), said
        page = (tmp_path / name / C.COMPARE_HTML).read_text()
        assert 'class="oc-no-loss-recorded"' in page, page
    first = [n for n in comp.notes if n.startswith("noloss, the reference by the rule")]
    assert first and "has no loss to compare with: its loop called prof.step() without loss=" in first[0], (
        comp.notes
    )


def test_runs_whose_precision_is_not_recorded_say_so_in_words(tmp_path: Path) -> None:
    """Tester t5: runs of ``Profiler(sample_every=0)`` record no precision (no sampled step saw one), and the
    comparison's lines put the word "run" in its place: "b trained in run, as a did", "Warnings for b: run
    matched a ...". They say it is not recorded."""

    def loop(out: Path) -> Path:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(8, 4), torch.randn(8, 4)
        with precprof.Profiler(model, optimizer=opt, sample_every=0) as prof:
            for _ in range(6):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                prof.step(loss=loss.detach())
        prof.save(out)
        return out

    comp, _ = C.compare_runs([loop(tmp_path / "a"), loop(tmp_path / "b")], out=tmp_path / "cmp")
    assert [r.label for r in comp.runs] == ["a", "b"], comp.runs
    said = [c.text for c in comp.checks] + comp.summary_lines
    assert not any(re.search(r"\bin run\b|\brun (matched|diverged|ended|with)\b", t) for t in said), said
    assert any("b (its precision not recorded: no sampled step recorded it) matched a" in t for t in said), (
        said
    )
    same = [t for t in said if "sets another format against it" in t]
    assert (
        same
        and "the precision b trained in is not recorded (no sampled step recorded it), nor is a's" in same[0]
    ), same
