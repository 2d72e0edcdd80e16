"""``precprof compare RUN_DIR ...`` of runs that differ in more than their precision, or whose reference did not
train, and the links from the page to each run: run directories built by hand, with the loss curves and the
settings each case needs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from precprof import compare as C
from precprof import tables as T
from precprof.analysis import comparison as A

STEPS = 20
# the settings the built-in loop records, as ``precprof train`` of gpt-nano records them
SETTINGS: dict[str, Any] = {
    "model": "gpt-nano",
    "model_args": {"n_layer": "2"},
    "optimizer": "adamw",
    "optimizer_class": "AdamW",
    "lr": 0.003,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "seed": 0,
    "steps": STEPS,
    "batch_size": 4,
    "seq_len": 32,
    "data": {"name": "synthetic", "kind": "markov_chain"},
    "loss_scaling": "none",
}


def _run(path: Path, precision: str, loss: list[float], **settings: Any) -> Path:
    """A finished run directory: its steps table (``loss``, one row a step) and a summary with the built-in
    loop's settings, ``settings`` over ``SETTINGS``; a report.html beside them, for the page to link."""
    n = len(loss)
    cols = {
        T.STEP: list(range(n)),
        T.LOSS: loss,
        T.LOSS_SCALE: [1.0] * n,
        T.SKIPPED: [False] * n,
        T.GRAD_NORM: [1.0] * n,
        T.TIME_S: [0.1] * n,
        T.SAMPLED: [False] * n,
        T.TOKENS: [128.0] * n,
    }
    rows = [dict(zip(cols, row, strict=True)) for row in zip(*cols.values(), strict=True)]
    T.write_tables(path, {"steps": T.frame("steps", rows)})
    T.write_summary(
        path,
        {
            T.SUMMARY_STATUS: T.STATUS_COMPLETE,
            T.SUMMARY_CONFIG: {**SETTINGS, "precision": precision, **settings},
            T.SUMMARY_HARDWARE: {"device": "cpu", "name": "Test CPU"},
        },
    )
    (path / T.REPORT_FILE).write_text("<html></html>")
    return path


def _falling(start: float, end: float) -> list[float]:
    """A loss that falls from ``start`` to ``end`` at step 1 and stays there: its final window's mean is ``end``."""
    return [start] + [end] * (STEPS - 1)


def _with_rec(run_dir: Path, findings: list[dict[str, str]]) -> None:
    """The run's summary with an advisor's recommendation (fp32, the small model's default) and ``findings``."""
    summary = T.read_summary(run_dir)
    summary[T.SUMMARY_RECOMMENDATION] = {"format": "fp32", "findings": findings}
    T.write_summary(run_dir, summary)


def test_runs_that_differ_in_optimizer_lr_and_clipping_say_so_and_do_not_blame_the_advisor(
    tmp_path: Path,
) -> None:
    """fp32, bf16, and bf16 trained with SGD at a learning rate of 20 without clipping: the third diverged, and
    the page marked the advisor "MISSED" for it; its Setup left optimizer, learning rate and clipping out, and
    nothing on the page said the runs differed in more than precision. The note and the Setup say each setting
    and each run's value; that run's checks say the comparison does not isolate precision for it, and its
    speed is not compared."""
    fp32 = _run(tmp_path / "fp32", "fp32", _falling(5.5, 5.0))
    _with_rec(fp32, [])
    bf16 = _run(tmp_path / "bf16", "bf16", _falling(5.5, 5.0))
    sgd = _run(
        tmp_path / "sgd",
        "bf16",
        [5.5, 7.0, 381.0] + [float("nan")] * (STEPS - 3),
        optimizer="sgd",
        optimizer_class="SGD",
        lr=20.0,
        grad_clip=0.0,
    )
    comp, page = C.compare_runs([fp32, bf16, sgd], out=tmp_path / "cmp")
    r = comp.run("sgd")
    assert r.outcome == A.DIVERGED and r.first_nonfinite_step == 3
    assert r.setup_differs == ["optimizer", "learning rate", "gradient clipping"]
    assert comp.run("bf16").setup_differs == []
    assert comp.notes[0].startswith(
        "These runs differ in more than their precision: optimizer: fp32 AdamW, bf16 AdamW, sgd SGD; "
        "learning rate: fp32 0.003, bf16 0.003, sgd 20; gradient clipping: fp32 1, bf16 1, sgd 0. "
    )
    mine = [c for c in comp.checks if c.run == "sgd"]
    assert mine and all(c.status == A.NOT_MEASURED for c in mine), mine
    assert any(
        "This comparison does not isolate precision for sgd: its optimizer, learning rate and gradient "
        "clipping differ from fp32's" in c.text
        for c in mine
    )
    assert not any(c.status == A.MISSED for c in comp.checks)
    # bf16 trained as fp32 did: checked as before
    assert any(
        c.run == "bf16" and c.status == A.CONFIRMED and c.aspect == A.ASPECT_WARNINGS for c in comp.checks
    )
    # its tokens per second (128 tokens in 0.1 s, as fp32's) are not a speed-up of 1.0: not compared
    assert r.speedup is None and r.speed_not_taken.startswith("sgd's optimizer, learning rate and gradient")
    assert comp.run("bf16").speedup == 1.0
    html = page.read_text()
    setup = html.split('<section id="setup">', 1)[1]
    rows = dict(re.findall(r'<th scope="row">(.*?)</th><td>(.*?)</td>', setup))
    assert rows["optimizer"] == "differs by run: fp32 AdamW, bf16 AdamW, sgd SGD"
    assert rows["learning rate"] == "differs by run: fp32 0.003, bf16 0.003, sgd 20"
    assert rows["gradient clipping"] == "differs by run: fp32 1, bf16 1, sgd 0"
    assert rows["weight decay"] == "0"  # shared, said without the optimizer's row
    assert "differs by run" not in rows["batch"]
    # the headline cards: the run set up differently says so beside its outcome (a card read "behind +1e8%"
    # while the page withdrew the verdict)
    cards = html.split("</ul>", 1)[0]
    assert re.search(r'<span class="k">sgd</span><span class="v">diverged · set up differently</span>', cards)
    assert re.search(r'<span class="k">bf16</span><span class="v">matched · [^<]*</span>', cards)
    assert "set up differently" not in cards.split('<span class="k">bf16</span>')[1].split("</li>")[0]


def test_runs_that_differ_in_model_settings_seed_and_steps(tmp_path: Path) -> None:
    """Model settings (a loss multiplied by 1e-6 or 1e-3) and a seed make two runs of other setups; the steps
    do not: runs of different lengths are compared on the steps both finished, and the Setup says each run's."""
    a = _run(tmp_path / "a", "fp16", _falling(5.5, 5.0), model_args={"shrink": "1e-6"})
    b = _run(tmp_path / "b", "bf16", _falling(5.5, 5.0), model_args={"shrink": "1e-3"}, seed=1)
    c = _run(tmp_path / "c", "fp32", _falling(5.5, 5.0) + [5.0] * 10, steps=STEPS + 10)
    comp, page = C.compare_runs([a, b, c], out=tmp_path / "cmp")
    assert comp.reference == "fp32"
    assert comp.run("fp16").setup_differs == ["model settings"]
    assert comp.run("bf16").setup_differs == ["model settings", "seed"]
    assert (
        "model settings: fp16 shrink=1e-6, bf16 shrink=1e-3, fp32 n_layer=2; seed: fp16 0, bf16 1, fp32 0. "
        in comp.notes[0]
    )
    assert "steps" not in comp.notes[0].split(". ")[0]
    rows = dict(re.findall(r'<th scope="row">(.*?)</th><td>(.*?)</td>', page.read_text()))
    assert rows["steps"] == f"differs by run: fp16 {STEPS}, bf16 {STEPS}, fp32 {STEPS + 10}"


def test_a_run_stopped_short_gives_its_steps_run_beside_those_planned(tmp_path: Path) -> None:
    """A bf16 run planned for 200 steps and stopped by Ctrl-C after 15: the note said it trained 15 and the Setup
    "steps: differs by run: fp32 20, bf16 200" (h76). The Setup gives both counts of the run stopped short."""
    a = _run(tmp_path / "a", "fp32", _falling(5.5, 5.0))
    b = _run(tmp_path / "b", "bf16", _falling(5.5, 5.0)[:15], steps=200)
    summary = T.read_summary(b)
    summary.update(
        {T.SUMMARY_STATUS: T.STATUS_INCOMPLETE, T.SUMMARY_INCOMPLETE_REASON: "interrupted (Ctrl-C, SIGINT)"}
    )
    T.write_summary(b, summary)
    _, page = C.compare_runs([a, b], out=tmp_path / "cmp")
    rows = dict(re.findall(r'<th scope="row">(.*?)</th><td>(.*?)</td>', page.read_text()))
    assert rows["steps"] == f"differs by run: fp32 {STEPS}, bf16 15 of 200 planned"


def test_a_reference_that_did_not_train_gives_way_to_one_that_did(tmp_path: Path) -> None:
    """fp16 without loss scaling, every gradient flushed to zero: its loss never fell. Given first, with no fp32
    run, it was the reference, and the run that trained was "behind +90766%" of it. The first run the rule
    allows that trained is the reference, and a note says why."""
    flushed = _run(tmp_path / "flushed", "fp16", [5.5e-6] * STEPS)
    partial = _run(tmp_path / "partial", "fp16", _falling(5.5e-3, 4.4e-3))
    comp, page = C.compare_runs([flushed, partial], out=tmp_path / "cmp")
    assert comp.reference == "partial"
    assert comp.run("flushed").outcome == A.STALLED
    removed = (5.5e-3 - 4.4e-3) / 5.5e-3  # the share of its first loss the partial run removed: 20%
    assert (
        "flushed, the reference by the rule (fp32, then tf32, else the first run), did not train: its loss went "
        f"5.5e-06 → 5.5e-06 and removed none of its first loss, while partial removed {removed:.1%} of its own. "
        "The reference is partial, the next run the rule allows that did."
    ) in comp.notes
    assert "reference that did not train" not in page.read_text().split('<section id="check">')[0]


def test_a_reference_the_rule_requires_is_kept_and_flagged(tmp_path: Path) -> None:
    """The only fp32 run diverged: the rule keeps it as the reference (the others are compared with fp32), and the
    page says it did not train; no check judges the advisor by the outcomes against it."""
    fp32 = _run(tmp_path / "fp32", "fp32", [5.5] * 10 + [float("nan")] * (STEPS - 10))
    _with_rec(fp32, [])
    bf16 = _run(tmp_path / "bf16", "bf16", _falling(5.5, 5.0))
    comp, page = C.compare_runs([bf16, fp32], out=tmp_path / "cmp")
    assert (
        comp.reference == "fp32" and comp.run("fp32").did_not_train == "its loss became non-finite at step 10"
    )
    assert any(
        n.startswith("The reference, fp32, did not train: its loss became non-finite at step 10.")
        for n in comp.notes
    )
    assert [c.status for c in comp.checks if c.run == "bf16"] == [A.NOT_MEASURED]
    headline = page.read_text().split('<section id="check">')[0]
    assert '<span class="k">fp32</span><span class="v">reference that did not train</span>' in headline


def test_a_reference_whose_profile_sized_a_loss_scale_stays(tmp_path: Path) -> None:
    """A run trained at the loss scale the advisor sized on the first run's profile: that profile is the
    yardstick, stalled or not, and is flagged."""
    flushed = _run(tmp_path / "flushed", "bf16", [5.5] * STEPS)
    advised = _run(tmp_path / "advised", "fp16", _falling(5.5, 4.4))
    comp = A.analyse([(A.Variant("bf16"), flushed), (A.Variant("fp16", "advised"), advised)])
    assert comp.reference == "bf16" and comp.run("bf16").did_not_train.startswith("its loss went 5.5 → 5.5")
    assert comp.notes[0].startswith("The reference, bf16, did not train")


def test_the_page_links_each_run_relatively_and_keeps_working_when_moved(tmp_path: Path) -> None:
    """compare.html in runs/cmp linked runs/bf16's report by its absolute file:// URL: the folder copied to another
    machine, every link pointed at a path that no longer existed."""
    runs = tmp_path / "runs"
    a = _run(runs / "fp32", "fp32", _falling(5.5, 5.0))
    b = _run(runs / "bf16", "bf16", _falling(5.5, 5.0))
    (b / T.REPORT_FILE).unlink()  # no report: the link goes to the run directory
    _, page = C.compare_runs([a, b], out=runs / "cmp")
    html = page.read_text()
    assert "file://" not in html
    assert 'href="../fp32/report.html"' in html and 'href="../bf16"' in html
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(runs, moved)
    shutil.rmtree(runs)
    hrefs = re.findall(
        r'<td data-label="report"><a href="([^"]+)"', (moved / "cmp" / C.COMPARE_HTML).read_text()
    )
    assert len(hrefs) == 2 and all((moved / "cmp" / h).exists() for h in hrefs), hrefs
