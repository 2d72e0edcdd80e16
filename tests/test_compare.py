"""precprof compare: variants, outcome classification, the verdict check, and one short real comparison."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from figure_checks import overlapping_tick_labels

import precprof
from precprof import compare as C
from precprof import tables as T
from precprof.analysis import comparison as A
from precprof.errors import UserError
from precprof.report import compare_page
from precprof.training import TrainConfig

STEPS = 12


# ------------------------------------------------------------------------------------------- variants
def test_parse_precisions() -> None:
    vs = A.parse_precisions("fp32, bf16,fp16,fp16:none,fp16:static:8192,fp16:advised")
    assert [v.label for v in vs] == ["fp32", "bf16", "fp16", "fp16-none", "fp16-static-8192", "fp16-advised"]
    assert vs[3] == A.Variant("fp16", "none")
    assert A.reference_index(vs) == 0
    assert A.reference_index(A.parse_precisions("bf16,tf32,fp16")) == 1
    assert A.reference_index(A.parse_precisions("bf16,fp16")) == 0
    # every digit of a static scale (":g" named 2^40 and 2^40 + 1 alike, "1.09951e+12": one directory)
    vs = A.parse_precisions("fp16:static:1099511627776,fp16:static:1099511627777,fp16:static:0.5")
    assert [v.label for v in vs] == [
        "fp16-static-1099511627776",
        "fp16-static-1099511627777",
        "fp16-static-0.5",
    ]
    with pytest.raises(UserError, match="fp16-static-8192 is listed twice"):
        A.parse_precisions("fp16:static:8192,fp16:static:8192.0")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("fp32,fp17", "unknown precision 'fp17'"),
        ("fp32,fp16:sometimes", "loss-scale"),
        ("fp32,fp32", "listed twice"),
        ("fp32,bf16:advised", "fp16 and fp16-pure only"),
        ("fp32", "at least two"),
    ],
)
def test_parse_precisions_rejects(spec: str, match: str) -> None:
    with pytest.raises(UserError, match=match):
        A.parse_precisions(spec)


# ------------------------------------------------------------------------------------------- outcomes
def run_result(label: str, initial: float, final: float, **kw: Any) -> A.RunResult:
    precision, _, scale = label.partition("-")
    base: dict[str, Any] = {
        "label": label,
        "precision": precision,
        "loss_scale": scale or "auto",
        "run_dir": f"/runs/{label}",
        "status": T.STATUS_COMPLETE,
        "reason": None,
        "steps": 100,
        "initial_loss": initial,
        "final_loss": final,
        "final_window": 10,
        "gap": None,
        "outcome": A.REFERENCE,
        "tokens_per_s": 1000.0,
        "speedup": None,
        "skipped_steps": 0,
        "first_nonfinite_step": None,
        "loss_scaling": "none" if scale in ("", "none") else scale,
        "final_scale": None,
        "init_scale": None,
        "scale_growths": 0,
        "scale_backoffs": 0,
        "last_scale_change_step": None,
        "steps_at_final_scale": 0,
        "machine": "cpu: AMD EPYC",
        "target": "AMD EPYC",
        "memory": {},
        "memory_total": 0,
        "recommendation": None,
        "wall_s": 1.0,
        "report": None,
    }
    base.update(kw)
    return A.RunResult(**base)


@pytest.mark.parametrize(
    ("initial", "final", "outcome", "gap"),
    [
        (5.0, 2.008, A.MATCHED, 0.004),
        (5.0, 2.1, A.BEHIND, 0.05),
        (5.0, 1.9, A.AHEAD, -0.05),
        (5.0, 4.5, A.STALLED, 1.25),  # removed 0.5 of the 3.0 the reference removed
        (5.0, math.nan, A.DIVERGED, None),
        (5.0, 9.0, A.DIVERGED, 3.5),
    ],
)
def test_classify(initial: float, final: float, outcome: str, gap: float | None) -> None:
    ref = run_result("fp32", 5.0, 2.0)
    got, g = A.classify(run_result("fp16-none", initial, final), ref, tolerance=0.02)
    assert got == outcome
    assert (g is None and gap is None) or g == pytest.approx(gap)


def _rec(fmt: str, scale: float | None, findings: list[tuple[str, str, str]]) -> dict[str, Any]:
    return {
        "format": fmt,
        "loss_scale": scale,
        "findings": [{"code": c, "severity": s, "title": t} for c, s, t in findings],
    }


def test_verdict_check_confirms_and_contradicts() -> None:
    rec = _rec(
        "fp16",
        8192.0,
        [
            ("fp16_gradient_underflow", "warning", "fp16 gradient underflow: 38% at scale 1, 0% at 2^13"),
            ("bf16_lost_updates", "warning", "bf16 would lose updates"),
        ],
    )
    ref = run_result("fp32", 5.0, 2.0, recommendation=rec)
    runs = [
        ref,
        run_result(
            "fp16",
            5.0,
            2.006,
            loss_scaling="dynamic",
            final_scale=2.0**13,
            scale_backoffs=3,
            last_scale_change_step=3,
            steps_at_final_scale=97,
        ),
        run_result("fp16-none", 5.0, 4.8),
        run_result("bf16", 5.0, 2.3),
    ]
    for r in runs[1:]:
        r.outcome, r.gap = A.classify(r, ref, 0.02)
    checks: dict[tuple[str | None, str], str] = {}
    for c in A.check_against_runs(runs, ref):
        checks[(c.run, c.status)] = checks.get((c.run, c.status), "") + c.text + "\n"
    # the recommendation (fp16 at 2^13) against the scaled fp16 run
    text = checks[("fp16", A.CONFIRMED)]
    assert (
        "Loss: the advisor, on the fp32 run's profile, recommends fp16 with init_scale 2^13: fp16 with dynamic "
        "loss scaling (settled at 2^13 after backing off 3 times, the last change at step 3 (97 steps at 2^13)) "
        "matched fp32 within 0.30%.\n"
    ) in text
    # the scale-1 underflow warning predicted the unscaled run's stall
    assert (
        "stalled" in checks[("fp16-none", A.CONFIRMED)]
        and "38% at scale 1" in checks[("fp16-none", A.CONFIRMED)]
    )
    # lost updates are a what-if for autocast bf16 (fp32 masters): no warning applies, the run fell behind
    assert "15.00% above fp32" in checks[("bf16", A.MISSED)]


def test_verdict_check_not_borne_out_and_unchecked() -> None:
    rec = _rec(
        "bf16", None, [("fp16_gradient_underflow", "warning", "fp16 gradient underflow: 9% at scale 1")]
    )
    ref = run_result("fp32", 5.0, 2.0, recommendation=rec)
    fp16 = run_result("fp16-none", 5.0, 2.01)
    fp16.outcome, fp16.gap = A.classify(fp16, ref, 0.02)
    checks = A.check_against_runs([ref, fp16], ref)
    assert [c.status for c in checks] == [A.NOT_MEASURED, A.NOT_BORNE_OUT]
    assert "no bf16 run in this comparison" in checks[0].text


def test_a_run_that_went_wrong_quotes_its_own_profiles_diagnosis() -> None:
    """A bf16 run whose nan came from the loss, outside the model, was marked "missed" with no word of its own
    profile's critical finding, which said so: the check quotes it beside the verdict (not the run_diverged
    finding, which only repeats that it diverged)."""
    ref = run_result("fp32", 5.0, 2.0, recommendation=_rec("bf16", None, []))
    own = _rec(
        "bf16",
        None,
        [
            (
                "nonfinite_forward",
                "critical",
                "nan/inf first appears in the loss, outside the recorded modules",
            ),
            ("run_diverged", "critical", "The run diverged: its loss is nan from step 10 on"),
            ("small_model", "info", "Small model"),
        ],
    )
    bf16 = run_result("bf16", 5.0, math.nan, first_nonfinite_step=10, recommendation=own)
    bf16.outcome, bf16.gap = A.classify(bf16, ref, 0.02)
    (c,) = [c for c in A.check_against_runs([ref, bf16], ref) if c.aspect == A.ASPECT_WARNINGS]
    assert c.status == A.MISSED
    assert c.text == (
        "Warnings for bf16: bf16 diverged: the loss became non-finite at step 10. The advisor's profile gave no "
        "warning for this format. Its own profile's critical finding: nan/inf first appears in the loss, outside "
        "the recorded modules."
    )
    # a run whose own profile only says that it diverged has nothing more to quote
    diverged_only = _rec("bf16", None, [("run_diverged", "critical", "The run diverged")])
    bare = run_result("bf16", 5.0, math.nan, first_nonfinite_step=10, recommendation=diverged_only)
    bare.outcome, bare.gap = A.classify(bare, ref, 0.02)
    (c,) = [c for c in A.check_against_runs([ref, bare], ref) if c.aspect == A.ASPECT_WARNINGS]
    assert "Its own profile" not in c.text


@pytest.mark.parametrize(
    ("final", "card", "said"),
    [
        (2.0 * (1 + 2.9e-5), "matched · +0.003%", "within 0.003%"),  # 0.0029%: its first significant digit
        (2.0 * (1 - 0.0061), "matched · −0.61%", "within 0.61%"),  # two decimals from 0.01% up
        (2.0 * 1.03, "behind · +3.00%", "ended 3.00% above fp32's loss"),
    ],
)
def test_a_gap_reads_the_same_in_the_header_and_the_check(final: float, card: str, said: str) -> None:
    """The header card said "bf16 matched · +0.003%" and the check "matched fp32 within 0.0029%" for one gap:
    both are written by one rule."""
    ref = run_result("fp32", 5.0, 2.0, recommendation=_rec("bf16", None, []))
    bf16 = run_result("bf16", 5.0, final)
    bf16.outcome, bf16.gap = A.classify(bf16, ref, 0.02)
    checks = A.check_against_runs([ref, bf16], ref)
    comp = A.Comparison([ref, bf16], "fp32", 0.02, checks, ["line"], {"model": "gpt-nano"}, recorded=True)
    page = compare_page.render(comp)
    headline = re.sub(r"<[^>]+>", " ", page.split('<ul class="headline">', 1)[1].split("</ul>", 1)[0])
    assert card in " ".join(headline.split())
    (c,) = [c for c in checks if c.aspect == A.ASPECT_WARNINGS]
    assert said in c.text, c.text


# ------------------------------------------------------------------------------------------- a real run
@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> tuple[A.Comparison, Path]:
    out = tmp_path_factory.mktemp("compare")
    base = TrainConfig(
        model="gpt-nano",
        model_args={"n_layer": 1},
        steps=STEPS,
        batch_size=4,
        seq_len=64,
        sample_every=4,
        progress=False,
        report=False,  # the per-run reports are the report's own tests; rendering three would triple the time
        seed=3,
    )
    return C.compare(base, "fp32,bf16,fp16", out=out), out


def _window_mean(run_dir: Path) -> tuple[float, float]:
    steps = T.read_tables(run_dir)["steps"].sort_values(T.STEP)
    loss = steps[T.LOSS].to_numpy(dtype=float)
    return float(loss[-max(5, len(loss) // 10) :].mean()), float(loss[0])


def test_each_run_has_its_directory_and_report(comparison: tuple[A.Comparison, Path]) -> None:
    comp, out = comparison
    assert [r.label for r in comp.runs] == ["fp32", "bf16", "fp16"]
    for r, (prec, scaling) in zip(
        comp.runs, [("fp32", "none"), ("bf16", "none"), ("fp16", "dynamic")], strict=True
    ):
        run_dir = out / r.label
        summary = T.read_summary(run_dir)
        assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
        assert summary[T.SUMMARY_CONFIG]["precision"] == prec
        assert summary[T.SUMMARY_CONFIG]["loss_scaling"] == scaling
        assert summary[T.SUMMARY_CONFIG]["seed"] == 3 and summary[T.SUMMARY_CONFIG]["steps"] == STEPS
        assert (run_dir / T.REPORT_FILE).exists() == (r.report is not None)


def test_numbers_match_the_run_directories(comparison: tuple[A.Comparison, Path]) -> None:
    comp, out = comparison
    ref_final, ref_first = _window_mean(out / "fp32")
    for r in comp.runs:
        final, first = _window_mean(out / r.label)
        assert r.final_loss == pytest.approx(final, rel=1e-12)
        # same weights and data: the first step's loss agrees to the precision of the format
        assert first == pytest.approx(ref_first, rel=1e-2)
        if r.label != "fp32":
            assert r.gap == pytest.approx((final - ref_final) / ref_final, rel=1e-9)
        steps = T.read_tables(out / r.label)["steps"]
        plain = steps[~steps[T.SAMPLED].astype(bool)]
        assert r.tokens_per_s == pytest.approx(
            float(np.median(plain[T.TOKENS] / 1.0)) / float(plain[T.TIME_S].median())
        )
        assert r.memory and r.memory[T.PARAMETERS] > 0
    saved = json.loads((out / C.COMPARE_JSON).read_text())
    assert saved["reference"] == "fp32"
    assert [r["label"] for r in saved["runs"]] == ["fp32", "bf16", "fp16"]
    assert [c["status"] for c in saved["checks"]]  # every line of the verdict check is stored


def test_comparison_page(comparison: tuple[A.Comparison, Path]) -> None:
    comp, out = comparison
    html = (out / C.COMPARE_HTML).read_text()
    assert html.count('src="data:image/png;base64,') == 2  # loss curves; memory and throughput
    for label in ("fp32", "bf16", "fp16"):
        assert f"<strong>{label}</strong>" in html
    assert 'href="fp32"' in html  # no per-run report here: the link goes to the run directory
    from precprof.hardware import cpu_fp16_native

    # fp16 throughput on a CPU that emulates fp16 (a machine with AVX512-FP16 has no such note; every run
    # has the note of how each run ran); the runs record the CPU they trained on, this one
    assert [r.fp16_native for r in comp.runs] == [cpu_fp16_native()] * 3
    assert any("has no fp16 arithmetic" in n for n in comp.notes) == (not cpu_fp16_native())
    assert any(n.startswith("How each run ran: ") for n in comp.notes)
    assert all(n.replace("'", "&#39;") in html for n in comp.notes)
    assert "Verdict check" in html and comp.checks[0].text.split(":")[0] in html.replace("&#39;", "'")
    # the page's definition of a final loss is what was computed: it said "the last tenth of the steps", and
    # averaged the last 5 of 8
    said = re.search(r"fp32's last (\d+) of (\d+)\)", html.replace("&#39;", "'"))
    assert said is not None, html
    window, of = int(said[1]), int(said[2])
    loss = T.read_tables(out / "fp32")["steps"].sort_values(T.STEP)[T.LOSS].to_numpy(dtype=float)
    assert of == len(loss) == STEPS and window > of // 10
    assert comp.runs[0].final_loss == pytest.approx(float(loss[-window:].mean()), rel=1e-12)
    assert all(r.tokens_per_s_basis == "unsampled steps" for r in comp.runs)
    assert "median step without per-layer capture (profiling excluded);" in html
    # one run timed only on profiled steps: not compared with the others' unprofiled ones
    mixed = dataclasses.replace(
        comp, runs=[comp.runs[0], dataclasses.replace(comp.runs[1], tokens_per_s_basis="all steps")]
    )
    assert compare_page.throughput_basis(mixed).endswith(
        "except for bf16, whose every step was profiled (its speed is not comparable)"
    )


def test_runs_recorded_elsewhere_are_compared_from_their_directories(
    comparison: tuple[A.Comparison, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``precprof compare RUN_DIR RUN_DIR ...``: runs of a user's own loop or of the callbacks could not be
    compared (the command only trained). Read from their directories they give the comparison the training
    gave, named by their precisions, fp32 the reference; the page says they were recorded on their own. Runs of
    different models are refused in one line."""
    from precprof.cli import main

    comp, out = comparison
    dirs = [str(out / label) for label in ("bf16", "fp16", "fp32")]
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *dirs, "--out", str(tmp_path / "cmp")])
    assert exit_info.value.code == 0
    assert f"comparison: {tmp_path / 'cmp' / C.COMPARE_HTML}" in capsys.readouterr().out
    saved = json.loads((tmp_path / "cmp" / C.COMPARE_JSON).read_text())
    assert saved["reference"] == "fp32" and saved["recorded"] is True
    trained = {r.label: r for r in comp.runs}
    for r in saved["runs"]:
        assert (
            r["final_loss"] == trained[r["label"]].final_loss and r["outcome"] == trained[r["label"]].outcome
        )
        assert r["loss_scaling"] == trained[r["label"]].loss_scaling
    html = (tmp_path / "cmp" / C.COMPARE_HTML).read_text()
    assert "Runs recorded on their own" in html and "Same model, data and seed" not in html
    other = tmp_path / "other"
    shutil.copytree(out / "bf16", other)
    summary = T.read_summary(other)
    summary[T.SUMMARY_MODEL] = {**summary[T.SUMMARY_MODEL], "name": "another-model"}
    T.write_summary(other, summary)
    with pytest.raises(
        UserError, match=r"these runs trained different models \(gpt-nano of [\d,]+ parameters; another"
    ):
        C.compare_runs([out / "fp32", other])
    with pytest.raises(
        UserError, match="nothing' does not exist: give the folder a precprof run was saved into"
    ):
        C.compare_runs([out / "fp32", tmp_path / "nothing"])


def test_comparing_recorded_runs_into_a_folder_with_a_comparison_is_refused_without_overwrite(
    comparison: tuple[A.Comparison, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``precprof compare runs/cmp/fp32 runs/cmp/bf16`` (no --out: the folder holding the runs) wrote over the
    comparison of three runs that ``precprof compare --out runs/cmp`` had made there, without a word. It is
    refused in one line, as the training form refuses a run in --out, and nothing is written; --overwrite
    replaces it."""
    from precprof.cli import main

    _, trained = comparison
    cmp = tmp_path / "cmp"
    shutil.copytree(trained, cmp)
    before = {f: (cmp / f).read_bytes() for f in (C.COMPARE_JSON, C.COMPARE_HTML)}
    dirs = [str(cmp / "fp32"), str(cmp / "bf16")]
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *dirs])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{cmp} already holds a comparison" in err and "add --overwrite" in err, err
    assert {f: (cmp / f).read_bytes() for f in before} == before
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *dirs, "--overwrite"])
    assert exit_info.value.code == 0
    labels = [r["label"] for r in json.loads((cmp / C.COMPARE_JSON).read_text())["runs"]]
    assert sorted(labels) == ["bf16", "fp32"]


def test_a_run_whose_steps_are_too_uneven_gets_no_speed(
    comparison: tuple[A.Comparison, Path], tmp_path: Path
) -> None:
    """A machine busy with other work: steps of 0.02 s and 1.4 s in one run, and three identical comparisons
    gave bf16 at 8.2x, 0.04x and 15x fp32's throughput, flipping the speed verdict. A run whose counted steps'
    middle half spans more than ``MAX_STEP_TIME_SPREAD`` of their median gets no speed-up, and the checks say
    why."""
    from precprof.analysis.throughput import throughput

    _, out = comparison
    even = _retimed(out / "fp32", tmp_path / "fp32", 0.010)
    uneven = _retimed(out / "bf16", tmp_path / "bf16", 0.010, every_third=70)  # one step in three 70x slower
    steps = T.read_tables(uneven)["steps"].sort_values(T.STEP)
    timed = steps.iloc[1:]
    timed = timed.loc[~timed[T.SAMPLED].astype(bool), T.TIME_S].to_numpy(dtype=float)
    spread = (np.quantile(timed, 0.75) - np.quantile(timed, 0.25)) / np.median(timed)
    assert throughput(steps)["step_time_spread"] == pytest.approx(spread) and spread > A.MAX_STEP_TIME_SPREAD
    comp, _ = C.compare_runs([even, uneven], out=tmp_path / "cmp")
    r = comp.run("bf16")
    assert r.speedup is None and r.speed_not_taken.startswith("bf16's step times were too uneven to compare")
    speed = [c.text for c in comp.checks if c.aspect == "speed" and c.run == "bf16"]
    assert speed and all("too uneven to compare" in t for t in speed), speed
    assert comp.run("fp32").speedup == 1.0  # the reference, even


def test_comparison_loss_plots_tick_labels_never_run_together(comparison: tuple[A.Comparison, Path]) -> None:
    """The loss curves of runs of 250,000 steps: the steps read 50k, 100k, apart from one another."""
    comp, _ = comparison
    long = [dataclasses.replace(r, curve_steps=[s * 10_000 for s in r.curve_steps]) for r in comp.runs]
    fig = compare_page.loss_figure(dataclasses.replace(comp, runs=long))
    assert overlapping_tick_labels(fig) == []
    assert any(t.get_text().endswith("k") for t in fig.axes[0].get_xticklabels())


def test_the_relative_loss_panel_says_when_no_other_run_recorded_a_loss() -> None:
    """Reviewer r2: with no run besides the reference holding a loss, the "Loss relative to fp32" panel was an
    empty +-2% band on a step axis from 0 to 1. It says that no other run recorded a loss, and draws no axis."""
    comp = _four_runs()
    runs = [r if r.label == comp.reference else dataclasses.replace(r, curve_loss=[]) for r in comp.runs]
    rel = compare_page.loss_figure(dataclasses.replace(comp, runs=runs)).axes[1]
    assert [t.get_text() for t in rel.texts] == ["no other run recorded a loss"]
    assert not rel.axison and not rel.lines and not rel.patches
    assert rel.get_title() == "Loss relative to fp32 (smoothed)"
    rel = compare_page.loss_figure(comp).axes[1]  # runs with a loss: drawn as before
    assert rel.axison and len(rel.lines) > 1 and not rel.texts


def _diverged_comparison() -> A.Comparison:
    """fp32, bf16 within 0.1% of it, and a run whose loss went 5.5, 7.1, 381, ... 3.4e9, then nan."""
    steps = list(range(12))
    ref = [5.5 - 0.1 * s for s in steps]
    blown = [5.5, 7.1, 381.0, 5.7e3, 1.6e6, 3.4e9] + [math.nan] * 6
    runs = [
        run_result("fp32", 5.5, ref[-1], curve_steps=steps, curve_loss=ref),
        run_result(
            "bf16", 5.5, ref[-1], curve_steps=steps, curve_loss=[v * 1.001 for v in ref], outcome=A.MATCHED
        ),
        run_result(
            "diverge",
            5.5,
            math.nan,
            precision="bf16",
            curve_steps=steps,
            curve_loss=blown,
            outcome=A.DIVERGED,
            first_nonfinite_step=6,
        ),
    ]
    return A.Comparison(runs, "fp32", 0.02, [], [], {"model": "gpt-nano"}, recorded=True)


def test_a_diverged_run_leaves_the_loss_plots_readable() -> None:
    """A run whose loss went to 3.4e9, then nan: the other runs were flat lines under it on a linear loss axis,
    the relative plot's axis read "+6e+10%" and its label was cut at the image's left edge. The loss axis is
    logarithmic; the relative axis is scaled to the band and the runs that did not diverge, and the diverged
    run's legend entry says from which step it leaves it."""
    comp = _diverged_comparison()
    fig = compare_page.loss_figure(comp)
    ax_loss, ax_rel = fig.axes
    assert ax_loss.get_yscale() == "log" and ax_loss.get_ylim()[1] > 3.4e9
    lo, hi = ax_rel.get_ylim()
    bf16 = 1.001 - 1  # bf16's loss over fp32's, less one, at every step
    assert lo < -0.02 and bf16 < 0.02 < hi < 0.05
    # the diverged run is above the axis from step 1: 7.1 / 5.4 - 1 = 31%
    assert hi < 7.1 / 5.4 - 1
    legend = [t.get_text() for t in ax_rel.get_legend().get_texts()]
    assert "diverge (diverged: above the axis from step 1)" in legend, legend
    assert "loss not finite" in [t.get_text() for t in ax_loss.get_legend().get_texts()]
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax_rel.get_yticklabels()]
    assert "+2%" in ticks and not any("e" in t for t in ticks), ticks
    renderer = fig.canvas.get_renderer()
    for label in (ax_loss.yaxis.label, ax_rel.yaxis.label):
        box = label.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width, label.get_text()
    caption = compare_page.render(comp).split('<section id="loss">', 1)[1].split("</figcaption>", 1)[0]
    assert "a run that diverged is left out of its scale" in caption


def test_a_run_whose_loss_was_never_finite_is_marked_on_the_loss_plot() -> None:
    """Tester t5: the loss plot's legend said "loss not finite" for a run whose every loss was nan, and drew its
    mark at loss 0, below the axis the other run scaled: no mark was seen. It is drawn inside the axis."""
    steps = list(range(12))
    ref = [5.5 - 0.1 * s for s in steps]
    runs = [
        run_result("fp32", 5.5, ref[-1], curve_steps=steps, curve_loss=ref),
        run_result(
            "nan",
            math.nan,
            math.nan,
            precision="bf16",
            curve_steps=steps,
            curve_loss=[math.nan] * len(steps),
            outcome=A.DIVERGED,
            first_nonfinite_step=0,
        ),
    ]
    comp = A.Comparison(runs, "fp32", 0.02, [], [], {"model": "gpt-nano"}, recorded=True)
    fig = compare_page.loss_figure(comp)
    ax_loss = fig.axes[0]
    assert "loss not finite" in [t.get_text() for t in ax_loss.get_legend().get_texts()]
    (mark,) = [ln for ln in ax_loss.get_lines() if ln.get_marker() == "X"]
    fig.canvas.draw()
    ((px, py),) = mark.get_transform().transform(np.column_stack(mark.get_data()))
    box = ax_loss.get_window_extent()
    assert box.x0 <= px <= box.x1 and box.y0 <= py <= box.y1, ((px, py), box)


def test_a_loss_spike_at_a_skipped_step_leaves_the_relative_plot_readable() -> None:
    """An fp16 run whose loss at step 7 was 1e6 times the others', a step its GradScaler skipped: the relative
    plot was scaled to +100,000,000% by that one point, every curve flat on 0%. The axis is scaled without the
    points a skipped step enters (of 100 steps, the moving average of 4, centred, takes it into steps 6 to 9),
    the run's legend entry says where, and the caption says so."""
    steps = list(range(100))
    ref = [5.0 - 0.02 * s for s in steps]
    fp16 = [v * 1.01 for v in ref]
    fp16[7] = ref[7] * 1e6
    comp = A.Comparison(
        [
            run_result("fp32", 5.0, ref[-1], curve_steps=steps, curve_loss=ref),
            run_result(
                "fp16",
                5.0,
                fp16[-1],
                curve_steps=steps,
                curve_loss=fp16,
                outcome=A.MATCHED,
                loss_scaling="dynamic",
                skipped_steps=1,
                skipped_at=[7],
            ),
        ],
        "fp32",
        0.02,
        [],
        [],
        {"model": "gpt-nano"},
        recorded=True,
    )
    fig = compare_page.loss_figure(comp)
    ax_rel = fig.axes[1]
    lo, hi = ax_rel.get_ylim()
    # 1% above fp32 elsewhere, inside the 2% band: the axis is the band's, padded by 8%
    assert lo == pytest.approx(-0.02 - 0.08 * 0.04) and hi == pytest.approx(0.02 + 0.08 * 0.04)
    legend = [t.get_text() for t in ax_rel.get_legend().get_texts()]
    assert "fp16 (off the axis at 4 steps by a skipped step's loss)" in legend, legend
    fig.canvas.draw()
    box = ax_rel.yaxis.label.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.y0 >= 0 and box.y1 <= fig.bbox.height
    caption = compare_page.render(comp).split('<section id="loss">', 1)[1].split("</figcaption>", 1)[0]
    assert "so are the steps a loss scaler skipped" in caption


def test_comparison_page_escapes_user_text(comparison: tuple[A.Comparison, Path]) -> None:
    comp, out = comparison
    evil = A.Comparison(
        runs=comp.runs,
        reference=comp.reference,
        tolerance=comp.tolerance,
        checks=comp.checks,
        summary_lines=comp.summary_lines,
        config={"model": "<script>alert(1)</script>"},
    )
    html = compare_page.render(evil, base_dir=out)
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


# ---------------------------------------------------------------------------- the verdict, proved by training
def test_advised_loss_scale_is_trained_and_checked(tmp_path: Path) -> None:
    """Gradients 2^-20 as large as usual (tests/compare_models.py): unscaled fp16 stalls, as the fp32 profile
    predicts; fp16 trained at the advisor's init_scale matches fp32."""
    base = TrainConfig(
        model=str(Path(__file__).parent / "compare_models.py") + ":tiny_gradient_lm",
        optimizer="sgd",
        lr=2e5,  # SGD on gradients 2^-20 as large: a learning rate 2^20-ish larger trains like a normal model
        steps=40,
        batch_size=4,
        seq_len=16,
        sample_every=10,
        progress=False,
        report=False,
    )
    comp = C.compare(base, "fp32,fp16:none,fp16:advised,bf16", out=tmp_path)
    ref, unscaled, advised, _ = comp.runs
    rec = T.read_summary(tmp_path / "fp32")[T.SUMMARY_RECOMMENDATION]
    # the advised run started at the advisor's scale
    cfg = T.read_summary(tmp_path / "fp16-advised")[T.SUMMARY_CONFIG]
    assert cfg["init_scale"] == rec["fp16_loss_scale"] == advised.init_scale
    assert cfg["loss_scaling"] == "dynamic"
    assert unscaled.outcome == A.STALLED and advised.outcome == A.MATCHED
    # unscaled fp16: every step's gradients vanished, the weights never moved, the loss stayed put
    steps = T.read_tables(tmp_path / "fp16-none")["steps"]
    assert abs(steps[T.LOSS].iloc[-1] - steps[T.LOSS].iloc[0]) < 0.02 < ref.initial_loss - ref.final_loss
    by_run = {c.run: c for c in comp.checks if c.run and "advisor sized" in c.text}
    assert by_run["fp16-advised"].status == A.CONFIRMED
    unscaled_check = next(c for c in comp.checks if c.run == "fp16-none")
    assert unscaled_check.status == A.CONFIRMED and "had warned" in unscaled_check.text
    assert "fp16 gradient underflow" in unscaled_check.text
    # without the fp32 run, bf16 is the reference, and the advisor on its profile keeps fp32 (a model this small):
    # unscaled fp16's stall behind bf16 measures nothing of fp32's loss (it "confirmed" fp32)
    no_fp32 = A.analyse(
        [(A.Variant("bf16"), tmp_path / "bf16"), (A.Variant("fp16", "none"), tmp_path / "fp16-none")]
    )
    assert no_fp32.reference == "bf16" and (no_fp32.run("bf16").recommendation or {})["format"] == "fp32"
    assert no_fp32.run("fp16-none").outcome == A.STALLED
    (loss,) = [c for c in no_fp32.checks if c.aspect == A.ASPECT_LOSS]
    assert loss.status == A.NOT_MEASURED, loss
    assert "no fp32 or tf32 run, so no loss of fp32 was measured" in loss.text, loss.text
    # with it, fp32 is the reference, and the same stall confirms keeping fp32
    with_fp32 = A.analyse(
        [(A.Variant("fp32"), tmp_path / "fp32"), (A.Variant("fp16", "none"), tmp_path / "fp16-none")]
    )
    assert (with_fp32.run("fp32").recommendation or {})["format"] == "fp32"
    (loss,) = [c for c in with_fp32.checks if c.aspect == A.ASPECT_LOSS]
    assert (loss.status, loss.text) == (
        A.CONFIRMED,
        "Loss: the advisor's default for a model this small is fp32; the measurements allowed bf16; no run in "
        "another format matched fp32's loss (fp16-none).",
    )


def test_an_advised_fp16_run_where_fp16_is_ruled_out_checks_the_ruling(tmp_path: Path) -> None:
    """Gradients 2^-60 as large as usual: the fp32 profile rules fp16 out (at the loss scale the largest gradient
    allows, most of them still flush). The check said "the advisor sized fp16's loss scale at init_scale ...", a
    scale it had ruled out, and the run was described as "at the advised init_scale". Both say now that fp16 was
    ruled out and no scale advised; trained at that scale, fp16 falls behind fp32, which confirms the ruling."""
    base = TrainConfig(
        model=str(Path(__file__).parent / "compare_models.py") + ":tiny_gradient_lm",
        model_args={"grad_scale_log2": -60},
        optimizer="sgd",
        lr=2e5 * 2.0**40,  # SGD on gradients 2^-60 as large: fp32 trains like a normal model
        steps=30,
        batch_size=4,
        seq_len=16,
        sample_every=10,
        progress=False,
        report=False,
    )
    comp = C.compare(base, "fp32,fp16:advised", out=tmp_path)
    _, advised = comp.runs
    rec = T.read_summary(tmp_path / "fp32")[T.SUMMARY_RECOMMENDATION]
    assert rec["fp16_ruled_out"] and advised.init_scale == rec["fp16_loss_scale"]
    # the runs' own tables: fp32's loss fell, fp16's barely moved
    fell = {r: T.read_tables(tmp_path / r)["steps"][T.LOSS] for r in ("fp32", "fp16-advised")}
    assert (
        10 * (fell["fp16-advised"].iloc[0] - fell["fp16-advised"].iloc[-1])
        < fell["fp32"].iloc[0] - fell["fp32"].iloc[-1]
    )
    assert advised.outcome in (A.STALLED, A.BEHIND), advised.outcome
    (check,) = [c for c in comp.checks if c.aspect == A.ASPECT_LOSS_SCALE]
    assert check.status == A.CONFIRMED and "advisor sized fp16" not in check.text
    assert check.text.startswith("Loss scale: the advisor ruled fp16 out on the fp32 profile")
    assert "advised init_scale" not in " ".join(comp.summary_lines)
    assert "the scale the advisor sized though it ruled fp16 out" in A.describe_run(advised)


# ------------------------------------------------------------------------------------------- the command
def test_cli_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from precprof.cli import main

    args = ["compare", "-m", "gpt-nano", "-a", "n_layer=1", "--precisions", "fp32,bf16", "--steps", "6"]
    args += ["--batch-size", "2", "--seq-len", "16", "--no-progress", "--no-report", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "matched fp32" in out and f"comparison: {tmp_path / C.COMPARE_HTML}" in out
    assert (tmp_path / C.COMPARE_HTML).exists() and T.is_run_dir(tmp_path / "bf16")
    saved = json.loads((tmp_path / C.COMPARE_JSON).read_text())
    assert saved["config"]["steps"] == 6 and saved["config"]["model_args"] == {"n_layer": "1"}
    # a run this short records every step: its speeds are of profiled steps, and the page says so (it said
    # "profiling excluded")
    assert all(r["tokens_per_s_basis"] == "all steps" for r in saved["runs"])
    steps = T.read_tables(tmp_path / "bf16")["steps"]
    assert steps[T.SAMPLED].astype(bool).all()
    html = (tmp_path / C.COMPARE_HTML).read_text()
    assert (
        "profiling excluded" not in html and "every step of these runs recorded per-layer statistics" in html
    )
    # nor is a speed taken from such steps: a profiled step's time is much of it precprof's, whose cost differs
    # by format (identical comparisons gave bf16 at 1.44x and 0.88x fp32, unprofiled 0.4-0.9x)
    speed = [c for c in saved["checks"] if c["aspect"] == "speed"]
    assert speed and all(c["status"] == "not measured" for c in speed), speed
    assert all("every step of fp32 and bf16 was profiled" in c["text"] for c in speed)


def test_cli_compare_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from precprof.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--precisions", "fp32"])
    assert exit_info.value.code == 2
    assert "at least two precisions" in capsys.readouterr().err


# ---------------------------------------------------------------- what the runs measured, stated as measured
def _tokens_per_s(run_dir: Path) -> float:
    """Median tokens / median time of the steps without layer capture, straight from steps.parquet."""
    steps = T.read_tables(run_dir)["steps"]
    plain = steps[~steps[T.SAMPLED].astype(bool)]
    return float(plain[T.TOKENS].median()) / float(plain[T.TIME_S].median())


def _machine(run_dir: Path) -> str:
    hw = T.read_summary(run_dir)[T.SUMMARY_HARDWARE]
    return f"{hw['device']}: {hw['name']}"


def _retimed(run_dir: Path, dest: Path, step_s: float, every_third: float = 1.0) -> Path:
    """A copy of ``run_dir`` whose unprofiled steps took ``step_s`` seconds (each third one ``every_third`` times
    that) and its profiled ones 4x ``step_s``. The fixture's own step times are the machine's: with other work
    on its 2 cores a run's steps spread over 600% of their median, and its speed was, rightly, not compared; a
    test of what a speed makes of a recommendation reads step times it chose."""
    shutil.copytree(run_dir, dest)
    tables = T.read_tables(dest)
    steps = tables["steps"].sort_values(T.STEP).reset_index(drop=True)
    profiled = steps[T.SAMPLED].astype(bool)
    slow = (steps.index % 3 == 1) & ~profiled
    steps[T.TIME_S] = np.where(profiled, 4 * step_s, np.where(slow, every_third * step_s, step_s))
    T.write_tables(dest, {**tables, "steps": steps})
    return dest


def _timed(
    comparison: tuple[A.Comparison, Path], tmp_path: Path, fp32_s: float, bf16_s: float
) -> A.Comparison:
    """The fixture's fp32 and bf16 runs compared from copies whose steps took ``fp32_s`` and ``bf16_s`` seconds."""
    _, out = comparison
    runs = [_retimed(out / label, tmp_path / label, s) for label, s in (("fp32", fp32_s), ("bf16", bf16_s))]
    return C.compare_runs(runs, out=tmp_path / "cmp")[0]


def test_a_scaler_that_never_changed_says_so(comparison: tuple[A.Comparison, Path]) -> None:
    comp, out = comparison
    fp16 = comp.run("fp16")
    scales = T.read_tables(out / "fp16")["steps"][T.LOSS_SCALE].to_numpy(dtype=float)
    assert len(scales) == STEPS and (scales == 2.0**16).all()  # the default init_scale, never moved
    assert (fp16.final_scale, fp16.scale_growths, fp16.scale_backoffs) == (2.0**16, 0, 0)
    said = f"fp16 with dynamic loss scaling (stayed at 2^16, never changed in {STEPS} steps)"
    assert A.describe_run(fp16) == said
    assert any(line.startswith(said) for line in comp.summary_lines)
    assert "settled" not in (out / C.COMPARE_JSON).read_text()
    assert f"dynamic · stayed at 2^16, never changed in {STEPS} steps" in (out / C.COMPARE_HTML).read_text()


def test_warnings_are_those_the_profile_gave(comparison: tuple[A.Comparison, Path]) -> None:
    """Each run's warnings line quotes every warning (or critical) the fp32 profile's advisor gave for its
    format, read here from summary.json, and says "no warning for this format" only when it gave none."""
    comp, out = comparison
    findings = T.read_summary(out / "fp32")[T.SUMMARY_RECOMMENDATION]["findings"]
    for label in ("bf16", "fp16"):
        given = [
            f["title"]
            for f in findings
            if f["code"].startswith(label + "_")
            and ((f.get("numbers") or {}).get("demoted_from") or f["severity"]) in ("warning", "critical")
        ]
        lines = " ".join(c.text for c in comp.checks if c.text.startswith(f"Warnings for {label}:"))
        assert lines
        assert all(t in lines for t in given)
        assert ("no warning for this format" in lines) == (not given)


@pytest.mark.parametrize(
    ("bf16_s", "said", "short"),
    [  # against fp32's steps of 10 ms
        (0.0125, "0.80", "slower than fp32"),
        (0.0095, "1.05", "below the 1.10x that counts as a gain"),
        (0.008, "1.25", ""),
    ],
)
def test_recommended_format_slower_than_fp32_is_not_confirmed(
    comparison: tuple[A.Comparison, Path], tmp_path: Path, bf16_s: float, said: str, short: str
) -> None:
    """The issue's case: a bf16 recommendation for this machine, and bf16 timed against fp32 here (on a CPU,
    usually slower). The speed line states the measured ratio and is confirmed only at 1.10x or more."""
    comp = _timed(comparison, tmp_path, 0.010, bf16_s)
    bf16 = comp.run("bf16")
    ratio = _tokens_per_s(tmp_path / "bf16") / _tokens_per_s(tmp_path / "fp32")
    assert ratio == pytest.approx(0.010 / bf16_s, rel=1e-12)
    assert bf16.speedup == pytest.approx(ratio, rel=1e-12)
    here = T.read_summary(tmp_path / "fp32")[T.SUMMARY_HARDWARE]["name"]
    rec = {"format": "bf16", "target": here, "findings": []}
    checks = A.check_against_runs(*_with_rec(comp.runs, rec))
    loss = next(c for c in checks if c.aspect == A.ASPECT_LOSS)
    speed = next(c for c in checks if c.aspect == A.ASPECT_SPEED)
    assert loss.status == (A.CONFIRMED if bf16.outcome in (A.MATCHED, A.AHEAD) else A.CONTRADICTED)
    assert loss.text.startswith(
        f"Loss: the advisor, on the fp32 run's profile, recommends bf16 for {here}: bf16 "
    )
    ran = f"Speed: bf16 ran at {said}x fp32's throughput on this machine ({_machine(tmp_path / 'bf16')})"
    if not short:
        assert (speed.status, speed.text) == (A.CONFIRMED, f"{ran}, a gain (1.10x or more counts as a gain).")
    else:
        assert (speed.status, speed.text) == (
            A.CONTRADICTED,
            f"{ran}, the machine the advisor planned for: {short}, not the gain recommending bf16 assumes "
            "(1.10x or more counts as a gain).",
        )


def test_advice_for_another_machine_is_not_measured_here(
    comparison: tuple[A.Comparison, Path], tmp_path: Path
) -> None:
    """The advisor's plan for an A100 (fp32 by default for a model this small, bf16 allowed by the
    measurements): the CPU's throughput says nothing about an A100's."""
    _, out = comparison
    comp = _timed(comparison, tmp_path, 0.010, 0.0125)
    bf16 = comp.run("bf16")
    rec = precprof.recommend(out / "fp32", hardware="a100").to_dict()
    assert (rec["format"], rec["measured_format"], rec["target"]) == ("fp32", "bf16", "a100")
    assert bf16.outcome == A.MATCHED  # same seed and data, 12 steps: bf16 tracks fp32 within 2%
    check = next(c for c in A.check_against_runs(*_with_rec(comp.runs, rec)) if c.run == "bf16")
    assert (check.status, check.aspect) == (A.NOT_MEASURED, A.ASPECT_SPEED)
    assert check.text == (
        "Speed: the advisor's default for a model this small is fp32; the measurements allowed bf16; the bf16 run "
        "matched fp32's loss and ran at 0.80x fp32's throughput on this machine "
        f"({_machine(out / 'bf16')}); the advisor planned for a100, whose speed this comparison did not measure."
    )


def _recorded_fp16(run_dir: Path, native: bool | None) -> None:
    """Make ``run_dir``'s summary.json say its CPU had fp16 arithmetic (``native``), or say nothing of it (None:
    a run recorded before precprof recorded it)."""
    summary = T.read_summary(run_dir)
    hw = summary[T.SUMMARY_HARDWARE]
    hw.pop("fp16_native", None)
    if native is not None:
        hw["fp16_native"] = native
    T.write_summary(run_dir, summary)


def test_a_speed_without_fp32_or_of_emulated_fp16_judges_no_verdict(
    comparison: tuple[A.Comparison, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tester h104: ``precprof compare runs/bf16 runs/fp16`` (no fp32 run; fp16 emulated on this CPU) said
    "[confirmed] Speed: ... keep fp32" of fp16 at 1.06x bf16's throughput, and "[contradicted] ... a gain that the
    recommendation forgoes" of a noisy 1.52x, beside the page's note that fp16's throughput here says nothing. A
    speed against bf16 measures nothing of keeping fp32, and an emulated format's speed judges nothing: not
    measured, saying why. The speed-up itself is kept (the page draws it, with the note).

    Whether fp16 was emulated is the recording CPU's, from its summary.json: the machine reading the runs is made
    to say the opposite, and does not count. A run recorded before summary.json said has its speed left unjudged
    whatever this machine's CPU, and the sentence says the record is missing (read on a machine with fp16
    arithmetic, such a run was taken as native without a word)."""
    from precprof import hardware

    _, out = comparison
    timed = {
        p: _retimed(out / p, tmp_path / p, s) for p, s in (("fp32", 0.010), ("bf16", 0.010), ("fp16", 0.008))
    }
    emulated = (
        "the CPU fp16 trained on has no fp16 arithmetic (AVX512-FP16 / AMX-FP16) and torch emulates it, so fp16's "
        "throughput says nothing of fp16's speed"
    )
    unrecorded = (
        "fp16's summary.json does not record whether the CPU it trained on has fp16 arithmetic (AVX512-FP16 / "
        "AMX-FP16; it was recorded before precprof did), without which torch emulates it, so fp16's throughput is "
        "not taken for fp16's speed"
    )
    no_fp32 = "this comparison has no fp32 or tf32 run, so no speed of fp32 was measured (bf16 is the reference for want of one)"
    # (recorded, this machine's): the recorded flag wins; without one (an older run) the speed is left unjudged
    # whatever this machine's
    for recorded, here in ((False, True), (True, False), (None, False), (None, True)):
        _recorded_fp16(timed["fp16"], recorded)
        monkeypatch.setattr(hardware, "cpu_fp16_native", lambda here=here: here)
        native = bool(recorded)
        why = emulated if recorded is not None else unrecorded
        # the tester's case, through ``precprof compare RUN_DIR RUN_DIR`` (its page once: it takes a second)
        pair = [timed["bf16"], timed["fp16"]]
        comp = (
            C.compare_runs(pair, out=tmp_path / "cmp")[0]
            if (recorded, here) == (False, True)
            else A.analyse([(A.Variant("bf16"), pair[0]), (A.Variant("fp16"), pair[1])])
        )
        bf16, fp16 = comp.runs
        assert fp16.fp16_native is recorded
        assert comp.reference == "bf16" and (bf16.recommendation or {})["format"] == "fp32"
        assert fp16.outcome == A.MATCHED and fp16.speedup == pytest.approx(1.25)
        assert any("has no fp16 arithmetic" in n for n in comp.notes) == (recorded is False)
        assert any("does not record whether the CPU it trained on" in n for n in comp.notes) == (
            recorded is None
        )
        speed = [c for c in comp.checks if c.aspect == A.ASPECT_SPEED and c.run == "fp16"]
        assert [c.status for c in speed] == [A.NOT_MEASURED], speed
        assert speed[0].text.endswith(
            f"the fp16 run matched bf16's loss and ran at 1.25x bf16's throughput on this machine "
            f"({_machine(timed['fp16'])}); {no_fp32}" + ("." if native else f"; {why}.")
        ), speed[0].text
        assert fp16.emulated == ("" if native else why)
        if recorded is None:
            continue
        # against fp32, emulated fp16's gain judges nothing; an fp16 this CPU computes would forgo one
        comp = A.analyse([(A.Variant("fp32"), timed["fp32"]), (A.Variant("fp16"), timed["fp16"])])
        (speed,) = [c for c in comp.checks if c.aspect == A.ASPECT_SPEED and c.run == "fp16"]
        assert comp.run("fp16").speedup == pytest.approx(1.25)
        assert speed.status == (A.CONTRADICTED if native else A.NOT_MEASURED), speed
        assert speed.text.endswith(
            "a gain (1.10x or more counts as a gain) that the recommendation forgoes."
            if native
            else f"; {emulated}."
        ), speed.text


def _with_rec(runs: list[A.RunResult], rec: dict[str, Any]) -> tuple[list[A.RunResult], A.RunResult]:
    """The fixture's runs with a copy of the reference that carries ``rec`` (the shared runs stay as they are)."""
    ref = dataclasses.replace(runs[0], recommendation=rec)
    return [ref, *runs[1:]], ref


SMALL = {"format": "fp32", "measured_format": "bf16", "target": "AMD EPYC", "findings": []}


@pytest.mark.parametrize(
    ("rec", "speedup", "status", "tail"),
    [
        (SMALL, 1.32, A.OVERRIDDEN, ": the measured gain overrides the default, use bf16."),
        (SMALL, 1.05, A.CONFIRMED, ": no gain worth it (below the 1.10x that counts as a gain), keep fp32."),
        (SMALL, 0.78, A.CONFIRMED, ": no gain worth it (slower than fp32), keep fp32."),
        (
            {**SMALL, "target": "a100"},
            1.32,
            A.NOT_MEASURED,
            "; the advisor planned for a100, whose speed this comparison did not measure.",
        ),
    ],
)
def test_small_model_default_against_measured_speed(
    rec: dict[str, Any], speedup: float, status: str, tail: str
) -> None:
    ref = run_result("fp32", 5.0, 2.0, recommendation=rec)
    low = run_result("bf16", 5.0, 2.01, speedup=speedup)
    low.outcome, low.gap = A.classify(low, ref, 0.02)
    (check, *_) = A.check_against_runs([ref, low], ref)
    assert check.status == status and check.aspect == A.ASPECT_SPEED
    assert check.text == (
        "Speed: the advisor's default for a model this small is fp32; the measurements allowed bf16; the bf16 run "
        f"matched fp32's loss and ran at {speedup:.2f}x fp32's throughput on this machine (cpu: AMD EPYC){tail}"
    )


def test_a_run_in_the_references_own_format_is_no_rival_format() -> None:
    """A rerun of an fp32 run that ran 1.5x faster (a quieter machine) was read as a rival format: "a gain ...
    that the recommendation forgoes" (contradicted), from noise. A run in the reference's own precision measures
    no format's speed or loss: not measured, and said so; a run cut short besides says why in its own sentence."""
    ref = run_result("fp32", 5.0, 2.0, recommendation=SMALL)
    rerun = run_result("fp32-rerun", 5.0, 2.0, loss_scale="auto", loss_scaling="none", speedup=1.5)
    rerun.outcome, rerun.gap = A.classify(rerun, ref, 0.02)
    loss, speed, *_ = A.check_against_runs([ref, rerun], ref)
    assert (loss.status, loss.aspect, speed.status, speed.aspect) == (
        A.NOT_MEASURED,
        A.ASPECT_LOSS,
        A.NOT_MEASURED,
        A.ASPECT_SPEED,
    )
    lead = "the advisor's default for a model this small is fp32; the measurements allowed bf16"
    assert loss.text == (
        f"Loss: {lead}; no run in this comparison sets another format against it: fp32-rerun trained in fp32, as "
        "fp32 did."
    )
    assert speed.text == (
        f"Speed: {lead}; fp32-rerun trained in fp32, as fp32 did: its 1.50x fp32's throughput is the machine's or "
        "the run's, no format's gain."
    )
    short = run_result("bf16", 5.0, 2.0, speedup=1.5, stopped="stopped after 5 of 100 steps: interrupted")
    short.outcome, short.gap = A.classify(short, ref, 0.02)
    cut = "Not whole runs: bf16 stopped after 5 of 100 steps: interrupted; a loss short of a run's end is not the loss"
    (loss, *_) = A.check_against_runs([ref, short], ref)
    assert loss.status == A.NOT_MEASURED
    assert loss.text == f"Loss: {lead}; no other run sets it against precision alone. {cut} it ends at."
    (loss, *_) = A.check_against_runs([ref, rerun, short], ref)
    assert loss.status == A.NOT_MEASURED
    assert loss.text == (
        f"Loss: {lead}; fp32-rerun trained in fp32, as fp32 did; no run in another format sets it against precision "
        f"alone. {cut} it ends at."
    )


@pytest.mark.parametrize("speedup", [0.88, 1.34])
def test_a_run_whose_precision_is_not_recorded_settles_no_check(speedup: float) -> None:
    """Reviewer r2: two fp32 runs, one of ``sample_every=0`` (its precision not recorded), had "[confirmed] Speed:
    ... ran at 0.88x fp32's throughput ... keep fp32" (1.34x: "[contradicted] ... a gain that the recommendation
    forgoes") and "[confirmed] Warnings for u: ... As the advisor expected (no warning for this format)", of a
    format the page said it did not know. Every check that needs the run's format is not measured, saying why."""
    unknown = "not recorded (no sampled step recorded it)"
    warned = {"code": "bf16_lost_updates", "severity": "warning", "title": "bf16 loses updates"}
    for rec in (SMALL, {"format": "bf16", "target": "AMD EPYC", "findings": [warned]}):
        ref = run_result("fp32", 5.0, 2.0, recommendation=rec)
        u = run_result("u", 5.0, 2.0, precision=A.PRECISION_UNKNOWN, speedup=speedup)
        u.outcome, u.gap = A.classify(u, ref, 0.02)
        checks = A.check_against_runs([ref, u], ref)
        assert all(c.status == A.NOT_MEASURED for c in checks), checks
        mine = [c for c in checks if c.run == "u"]
        assert mine and all(unknown in c.text for c in mine), mine
        assert not any(
            "this format" in c.text or "keep fp32" in c.text or "a gain (" in c.text for c in checks
        )
    (warn,) = [c for c in checks if c.aspect == A.ASPECT_WARNINGS]
    assert warn.text.endswith(
        f"The precision it trained in is {unknown}, so the advisor's warnings for a format are not checked "
        "against it."
    ), warn.text
    # a reference whose precision is not recorded: a bf16 run's speed against it is no gain over a known format
    ref = run_result("u", 5.0, 2.0, precision=A.PRECISION_UNKNOWN, recommendation={**SMALL, "format": "bf16"})
    low = run_result("bf16", 5.0, 2.0, speedup=speedup)
    low.outcome, low.gap = A.classify(low, ref, 0.02)
    (speed,) = [c for c in A.check_against_runs([ref, low], ref) if c.aspect == A.ASPECT_SPEED]
    assert speed.status == A.NOT_MEASURED and speed.text.endswith(
        f"the precision u trained in is {unknown}."
    ), speed.text


def test_an_fp32_verdict_without_an_fp32_run_is_not_confirmed_on_loss() -> None:
    """bf16 the reference for want of an fp32 run, the advisor on its profile recommending fp32, an fp16 run that
    fell behind bf16: "[confirmed] Loss: ... no run in another format matched bf16's loss (fp16)", while nothing
    trained in fp32. That fp16 did worse than bf16 says nothing of whether fp32 does better: not measured, saying
    why. The same runs with an fp32 (or tf32) reference, or a verdict for bf16, the reference's own format, still
    confirm it."""
    for rec, lead in (
        ({"format": "fp32", "findings": []}, "the advisor, on the bf16 run's profile, recommends fp32"),
        (SMALL, "the advisor's default for a model this small is fp32; the measurements allowed bf16"),
    ):
        ref = run_result("bf16", 5.0, 2.0, recommendation=rec)
        fp16 = run_result("fp16", 5.0, 2.5, loss_scaling="dynamic")
        fp16.outcome, fp16.gap = A.classify(fp16, ref, 0.02)
        assert fp16.outcome == A.BEHIND
        (loss,) = [c for c in A.check_against_runs([ref, fp16], ref) if c.aspect == A.ASPECT_LOSS]
        assert (loss.status, loss.run) == (A.NOT_MEASURED, "bf16")
        assert loss.text == (
            f"Loss: {lead}; this comparison has no fp32 or tf32 run, so no loss of fp32 was measured (bf16 is the "
            "reference for want of one): that fp16 did not match bf16's loss says nothing of fp32's."
        )
    # a reference in the recommended format, or in full precision, sets the other formats against it
    for ref_label, fmt in (("fp32", "fp32"), ("tf32", "fp32"), ("fp32", "tf32"), ("bf16", "bf16")):
        ref = run_result(ref_label, 5.0, 2.0, recommendation={"format": fmt, "findings": []})
        fp16 = run_result("fp16", 5.0, 2.5, loss_scaling="dynamic")
        fp16.outcome, fp16.gap = A.classify(fp16, ref, 0.02)
        (loss,) = [c for c in A.check_against_runs([ref, fp16], ref) if c.aspect == A.ASPECT_LOSS]
        assert loss.status == A.CONFIRMED, (ref_label, fmt, loss)
        assert loss.text.endswith(f"; no run in another format matched {ref_label}'s loss (fp16)."), loss.text


@pytest.mark.parametrize(
    ("speedup", "status", "text"),
    [
        (1.32, A.CONFIRMED, ", a gain (1.10x or more counts as a gain)."),
        (
            1.05,
            A.CONTRADICTED,
            ", the machine the advisor planned for: below the 1.10x that counts as a gain, not the gain "
            "recommending bf16 assumes (1.10x or more counts as a gain).",
        ),
        (
            0.78,
            A.CONTRADICTED,
            ", the machine the advisor planned for: slower than fp32, not the gain recommending bf16 assumes "
            "(1.10x or more counts as a gain).",
        ),
    ],
)
def test_recommended_format_speed(speedup: float, status: str, text: str) -> None:
    ref = run_result(
        "fp32", 5.0, 2.0, recommendation={"format": "bf16", "target": "AMD EPYC", "findings": []}
    )
    low = run_result("bf16", 5.0, 2.01, speedup=speedup)
    low.outcome, low.gap = A.classify(low, ref, 0.02)
    loss, speed, warnings = A.check_against_runs([ref, low], ref)
    assert (loss.status, loss.aspect) == (A.CONFIRMED, A.ASPECT_LOSS)
    assert (speed.status, speed.aspect) == (status, A.ASPECT_SPEED)
    assert (
        speed.text
        == f"Speed: bf16 ran at {speedup:.2f}x fp32's throughput on this machine (cpu: AMD EPYC){text}"
    )
    assert warnings.text == (
        "Warnings for bf16: bf16 matched fp32 within 0.50%. As the advisor expected (no warning for this format)."
    )


def test_warnings_beside_the_point_are_quoted_not_hidden() -> None:
    """The fp32 profile's fp16 warning about scale 1 (demoted to information: the verdict was bf16) is quoted for
    the scaled fp16 run with why it does not bear on its loss; bf16's speed warning is checked on speed."""
    under = "fp16 gradient underflow: 3% at scale 1 (what fp16 would do; the verdict is bf16)"
    rec = {
        "format": "bf16",
        "target": "AMD EPYC",
        "findings": [
            {
                "code": "fp16_gradient_underflow",
                "severity": "info",
                "title": under,
                "numbers": {"demoted_from": "warning"},
            },
            {"code": "fp16_loss_scale", "severity": "info", "title": "fp16 loss scale 2^15 (32768)"},
            {"code": "bf16_emulated", "severity": "warning", "title": "bf16 is emulated on AMD EPYC"},
        ],
    }
    ref = run_result("fp32", 5.0, 2.0, recommendation=rec)
    fp16 = run_result(
        "fp16", 5.0, 2.01, loss_scaling="dynamic", final_scale=2.0**16, steps_at_final_scale=100, speedup=0.5
    )
    bf16 = run_result("bf16", 5.0, 2.01, speedup=0.78)
    for r in (fp16, bf16):
        r.outcome, r.gap = A.classify(r, ref, 0.02)
    checks = {
        (c.run, c.aspect, c.text.split(":")[0]): c for c in A.check_against_runs([ref, fp16, bf16], ref)
    }
    c = checks[("fp16", A.ASPECT_WARNINGS, "Warnings for fp16")]
    assert c.status == A.CONFIRMED
    assert c.text == (
        "Warnings for fp16: fp16 with dynamic loss scaling (stayed at 2^16, never changed in 100 steps) matched "
        "fp32 within 0.50%. As the advisor expected: the profile's fp16 warnings do not bear on this run's loss: "
        f"{under} (about fp16 at loss scale 1; this run scaled its loss)."
    )
    c = checks[("bf16", A.ASPECT_SPEED, "Warnings for bf16")]
    assert c.status == A.CONFIRMED
    assert c.text == (
        "Warnings for bf16: the advisor had warned: bf16 is emulated on AMD EPYC; bf16 ran at 0.78x fp32's "
        "throughput on this machine (cpu: AMD EPYC), slower than fp32."
    )
    # the same fp16 run without loss scaling: the scale-1 warning is about it, and did not come true
    bare = run_result("fp16-none", 5.0, 2.01)
    bare.outcome, bare.gap = A.classify(bare, ref, 0.02)
    (c,) = [c for c in A.check_against_runs([ref, bare], ref) if c.run == "fp16-none"]
    assert c.status == A.NOT_BORNE_OUT
    assert c.text.endswith(f"The advisor had warned ({under}), yet it did not hurt this run.")
    # where the advice scales fp16's loss, the unscaled run is told so, the warning quoted once (it read twice in
    # one paragraph: "The advisor had warned (...)" and "the profile found ...")
    ref = run_result("fp32", 5.0, 2.0, recommendation={**rec, "fp16_loss_scale": 2.0**15})
    (c,) = [c for c in A.check_against_runs([ref, bare], ref) if c.run == "fp16-none"]
    assert c.text.count(under) == 1
    assert c.text.endswith(
        f"The advisor had warned ({under}), yet it did not hurt this run. This run scaled no loss; the advisor's "
        "fp16 advice scales it (GradScaler at init_scale 2^15). Its own profile gave no warning for it."
    )


def test_an_unscaled_fp16_run_is_not_what_the_advisor_expected(tmp_path: Path) -> None:
    """gpt-nano in fp32 and in fp16 without loss scaling: the fp32 profile advises fp16 with a GradScaler (at
    scale 1 some gradients flush) and gives no fp16 warning; the unscaled run matches fp32 over these steps, and
    its own profile warns that its gradients flushed. The check read "[confirmed] ... As the advisor expected (no
    warning for this format)": it says now that the run did not scale its loss as advised, checks nothing of the
    advice, and quotes the run's own warnings, read here from its summary.json."""
    base = TrainConfig(
        model="gpt-nano",
        model_args={"n_layer": 1},
        steps=STEPS,
        batch_size=4,
        seq_len=64,
        sample_every=4,
        progress=False,
        report=False,
        seed=3,
    )
    comp = C.compare(base, "fp32,fp16:none", out=tmp_path)
    rec = T.read_summary(tmp_path / "fp32")[T.SUMMARY_RECOMMENDATION]
    assert not rec["fp16_ruled_out"] and rec["fp16_loss_scale"] > 1 and not A.format_warnings(rec, "fp16")
    unscaled = comp.run("fp16-none")
    assert unscaled.loss_scaling == "none" and unscaled.outcome == A.MATCHED
    own = [
        f["title"]
        for f in T.read_summary(tmp_path / "fp16-none")[T.SUMMARY_RECOMMENDATION]["findings"]
        if f["code"].startswith("fp16_") and f["severity"] in ("warning", "critical")
    ]
    assert own  # its gradients ran into fp16's floor at scale 1
    (check,) = [c for c in comp.checks if c.aspect == A.ASPECT_WARNINGS]
    assert check.status == A.NOT_MEASURED and "As the advisor expected" not in check.text
    under = next(f["title"] for f in rec["findings"] if f["code"] == "fp16_gradient_underflow")
    assert (
        "This run scaled no loss; the advisor's fp16 advice scales it (GradScaler at init_scale "
        f"2^{round(math.log2(rec['fp16_loss_scale']))}; the profile found {under}), so this run does not check "
        "that advice." in check.text
    )
    assert check.text.endswith(f" Its own profile warned: {'; '.join(own)}.")


def test_an_unscaled_fp16_run_does_not_check_a_recommended_fp16() -> None:
    """The advisor recommends fp16 with a loss scale, and the one fp16 run scaled none: its loss says nothing of
    the recommendation, matched or not."""
    rec = {**_rec("fp16", 2.0**16, []), "fp16_loss_scale": 2.0**16, "target": "AMD EPYC"}
    ref = run_result("fp32", 5.0, 2.0, recommendation=rec)
    bare = run_result("fp16-none", 5.0, 2.01)
    bare.outcome, bare.gap = A.classify(bare, ref, 0.02)
    (loss,) = [c for c in A.check_against_runs([ref, bare], ref) if c.aspect == A.ASPECT_LOSS]
    assert loss.status == A.NOT_MEASURED
    assert loss.text.endswith(
        "This run scaled no loss; the advisor's fp16 advice scales it (GradScaler at init_scale 2^16), so this run "
        "does not check it."
    )


def _hand_built_run(path: Path, scales: list[float]) -> Path:
    """A run directory with only what read_run needs: a steps table and a summary (dynamic fp16 scaling)."""
    n = len(scales)
    skipped = [b < a for a, b in itertools.pairwise(scales)] + [False]
    steps = {
        T.STEP: list(range(n)),
        T.LOSS: list(np.linspace(5.0, 2.0, n)),
        T.LOSS_SCALE: scales,
        T.SKIPPED: skipped,  # a step that overflowed backs the scale off for the next one
        T.GRAD_NORM: [1.0] * n,
        T.TIME_S: [0.1] * n,
        T.SAMPLED: [False] * n,
        T.TOKENS: [64.0] * n,
    }
    T.write_tables(
        path,
        {
            "steps": T.frame(
                "steps", [dict(zip(steps, row, strict=True)) for row in zip(*steps.values(), strict=True)]
            )
        },
    )
    T.write_summary(
        path,
        {
            T.SUMMARY_STATUS: T.STATUS_COMPLETE,
            T.SUMMARY_CONFIG: {"precision": "fp16", "loss_scaling": "dynamic", "init_scale": scales[0]},
            T.SUMMARY_HARDWARE: {"device": "cpu", "name": "Test CPU"},
        },
    )
    return path


@pytest.mark.parametrize(
    ("scales", "final", "backoffs", "growths", "said"),
    [
        (
            [2.0**16, 2.0**15, 2.0**14] + [2.0**13] * 17,
            2.0**13,
            3,
            0,
            "settled at 2^13 after backing off 3 times, the last change at step 3 (17 steps at 2^13)",
        ),
        (
            [2.0**13] * 18 + [2.0**14] * 2,
            2.0**14,
            0,
            1,
            "ended at 2^14 after growing once, the last change at step 18 (2 steps at 2^14)",
        ),
        (
            [2.0**16] + [2.0**15] * 11 + [2.0**16] * 8,
            2.0**16,
            1,
            1,
            "settled at 2^16 after backing off once and growing once, the last change at step 12 (8 steps at 2^16)",
        ),
    ],
)
def test_loss_scale_history(
    tmp_path: Path, scales: list[float], final: float, backoffs: int, growths: int, said: str
) -> None:
    """Scale histories a few real CPU steps do not produce (20 steps: the final window is 5)."""
    r = A.read_run(A.Variant("fp16"), _hand_built_run(tmp_path / "fp16", scales))
    assert (r.final_scale, r.scale_backoffs, r.scale_growths, r.final_window) == (final, backoffs, growths, 5)
    assert r.skipped_steps == backoffs
    assert r.skipped_at == [i - 1 for i in range(1, len(scales)) if scales[i] < scales[i - 1]]
    assert A.describe_run(r) == f"fp16 with dynamic loss scaling ({said})"


def test_recorded_runs_of_different_lengths_compare_at_the_last_step_all_finished(tmp_path: Path) -> None:
    """Two fp32 runs of one seed, 6 and 18 steps: compared as they were, the longer one was "ahead" by what
    12 more steps of training gave it. Up to step 5, the last both finished, they are the same run."""
    from precprof.training import train

    for name, steps in (("short", 6), ("long", 18)):
        train(
            TrainConfig(
                model="gpt-nano",
                model_args={"n_layer": "1"},
                steps=steps,
                batch_size=2,
                seq_len=16,
                sample_every=3,
                progress=False,
                report=False,
                out=tmp_path / name,
            )
        )
    comp, _ = C.compare_runs([tmp_path / "short", tmp_path / "long"], out=tmp_path / "cmp")
    short, long = comp.runs
    assert long.steps == short.steps == 6 and long.final_loss == short.final_loss
    assert long.outcome == A.MATCHED
    assert comp.notes[0].startswith("The runs trained for different numbers of steps (short: 6, long: 18)")
    assert "up to step 5" in comp.notes[0]


def test_recorded_runs_of_different_data_and_batches_say_so(tmp_path: Path) -> None:
    """A run on a text file and one on the synthetic data, at two batch sizes, compared: the page ranked their
    losses and tabled their memory side by side, and dropped the differing settings from its setup without a
    word. The notes open with what the runs differ in besides their precision."""
    from precprof.training import train

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    for name, data, batch in (("a", "synthetic", 2), ("b", str(text), 4)):
        train(
            TrainConfig(
                model="gpt-nano",
                model_args={"n_layer": "1"},
                steps=3,
                batch_size=batch,
                seq_len=16,
                data=data,
                sample_every=3,
                progress=False,
                report=False,
                out=tmp_path / name,
            )
        )
    comp, page = C.compare_runs([tmp_path / "a", tmp_path / "b"], out=tmp_path / "cmp")
    note = comp.notes[0]
    assert note.startswith("These runs differ in more than their precision: data: a synthetic, b ")
    assert "corpus.txt" in note and "batch size: a 2, b 4" in note and "sequence length" not in note
    assert "differ in more than their precision" in page.read_text()


def _four_runs(**kw: Any) -> A.Comparison:
    """fp32 and three more runs, two of them bf16 with the default loss scaling (two recorded bf16 runs), with
    loss curves, memory and a long status reason, for the page and its figures."""
    steps = list(range(40))
    runs = [
        run_result(
            label,
            5.0,
            2.0,
            precision=prec,
            loss_scale="auto",
            curve_steps=steps,
            curve_loss=[5.0 - 0.075 * s + 0.01 * i for s in steps],
            memory={T.PARAMETERS: 2**21, T.GRADIENTS: 2**21},
            memory_total=2**22,
            **kw,
        )
        for i, (label, prec) in enumerate(
            [("fp32", "fp32"), ("nano_bf16", "bf16"), ("fp16", "fp16"), ("nano_int", "bf16")]
        )
    ]
    runs[3] = dataclasses.replace(
        runs[3], status=T.STATUS_INCOMPLETE, reason="interrupted (terminated, SIGTERM) after a long while"
    )
    return A.Comparison(runs, "fp32", 0.02, [], [], {"model": "gpt-nano"}, recorded=True)


def test_two_runs_of_one_format_look_different() -> None:
    """Two bf16 runs with the default loss scaling (two recorded runs, nano_bf16 and nano_int) had the same
    orange and the same solid line in both loss plots and the throughput bars: the second gets another shade
    and another line style; the first of each format keeps its format's colour."""
    from matplotlib.colors import to_hex

    from precprof.modes import MODE_COLORS

    comp = _four_runs()
    styles = compare_page.run_styles(comp.runs)
    got = [styles[id(r)] for r in comp.runs]
    assert got[:3] == [(MODE_COLORS["fp32"], "-"), (MODE_COLORS["bf16"], "-"), (MODE_COLORS["fp16"], "-")]
    assert got[3][0] != MODE_COLORS["bf16"] and got[3][1] != "-"
    assert len(set(got)) == 4
    fig = compare_page.loss_figure(comp)
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines() if not ln.get_label().startswith("_")}
    assert (to_hex(lines["nano_int"].get_color()), lines["nano_int"].get_linestyle()) != (
        to_hex(lines["nano_bf16"].get_color()),
        lines["nano_bf16"].get_linestyle(),
    )
    bars = compare_page.resources_figure(comp).axes[1].patches
    assert len({to_hex(b.get_facecolor()) for b in bars}) == 4  # four runs, four bar colours


@pytest.mark.parametrize(
    ("bases", "title"),
    [
        (["unsampled steps"] * 4, "Throughput\n(steps without layer capture)"),
        (["all steps"] * 4, "Throughput\n(all steps, profiling included)"),
        (["all steps", "all steps", "unsampled steps", "unsampled steps"], "capture; *: all, profiled)"),
    ],
)
def test_throughput_panel_says_which_steps_were_timed(bases: list[str], title: str) -> None:
    """The throughput panel was titled 'steps without layer capture' when every step was profiled."""
    comp = _four_runs()
    comp.runs[:] = [
        dataclasses.replace(r, tokens_per_s_basis=b) for r, b in zip(comp.runs, bases, strict=True)
    ]
    ax = compare_page.resources_figure(comp).axes[1]
    assert ax.get_title().endswith(title)
    marked = [t.get_text().endswith(" *") for t in ax.texts]
    assert marked == ([b == "all steps" for b in bases] if len(set(bases)) > 1 else [False] * 4)


def test_compare_page_caption_matches_its_stacked_plots() -> None:
    html = compare_page.render(_four_runs())
    caption = html.split('<section id="loss">', 1)[1].split("</figcaption>", 1)[0]
    assert "Top: the loss of each step" in caption and "Bottom: each run" in caption
    assert "Left:" not in caption and "Right:" not in caption


def test_the_memory_tables_total_adds_up_its_parts_and_the_peak_stands_apart() -> None:
    """The table had an "allocator peak" column among the parts, then "total": the parts' sum, without the peak,
    with no caption. fp32's total (3.23 MiB) read above its allocator peak (3.15 MiB) as if one were wrong."""
    runs = [
        dataclasses.replace(
            r, memory={**r.memory, T.ALLOCATOR_PEAK: 3 * 2**20}, memory_total=sum(r.memory.values())
        )
        for r in _four_runs().runs
    ]
    html = compare_page.render(dataclasses.replace(_four_runs(), runs=runs))
    table = html.split('<section id="resources">', 1)[1].split("</table>", 1)[0]
    heads = [re.sub(r"<[^>]+>", " ", h).split() for h in re.findall(r"<th>(.*?)</th>", table)]
    assert [h[0] for h in heads] == ["run", "parameters", "gradients", "total", "allocator"], heads
    assert (
        " ".join(heads[3]) == "total these parts" and " ".join(heads[4]) == "allocator peak not in the total"
    )
    row = re.findall(r"<td[^>]*>(.*?)</td>", table.split("<tbody>", 1)[1].split("</tr>", 1)[0])
    assert row[1:] == ["2.00 MiB", "2.00 MiB", "4.00 MiB", "3.00 MiB"], row
    assert "the total adds up these parts" in table and "most the allocator held at once" in table


def test_a_speed_the_page_says_does_not_compare_draws_no_bar() -> None:
    """Every step of fp32 and bf16 profiled: the runs table and the verdict check said their speeds do not
    compare, and the throughput panel drew bf16's bar at 8.9x fp32's. A run whose speed is not compared with the
    reference's has no bar; the panel and the caption say so."""
    comp = _four_runs()
    why = "every step of fp32 and nano_bf16 was profiled: their speeds do not compare"
    comp.runs[1] = dataclasses.replace(comp.runs[1], tokens_per_s=8921.0, speed_not_taken=why)
    comp.runs[2] = dataclasses.replace(comp.runs[2], tokens_per_s=2000.0, speedup=2.0)
    ax = compare_page.resources_figure(comp).axes[1]
    assert [b.get_width() for b in ax.patches] == [1000.0, 0.0, 2000.0, 1000.0]
    texts = [t.get_text() for t in ax.texts]
    assert texts[1] == " no bar: not timed\n as fp32 was" and texts[2] == " 2,000 (2.00×)"
    caption = compare_page.render(comp).split('<section id="resources">', 1)[1].split("</figcaption>", 1)[0]
    assert caption.endswith(f"with the speed-up over fp32. No bar for nano_bf16: {why}.")


@pytest.mark.parametrize("fastest", [87_409.0, 106_152.0, 1.9e6, 1_234.0])
def test_the_throughput_axis_ticks_stay_apart_and_inside_the_figure(fastest: float) -> None:
    """Tester t5: runs of about 1e5 tokens/s had the throughput axis read "0 50000 100000150000200000", its labels
    run together and the last past the panel's edge, at every page width (the figure is drawn at one). Few ticks,
    written short: 50k, 1.2M."""
    comp = _four_runs(tokens_per_s=fastest / 1.21)
    comp.runs[2] = dataclasses.replace(comp.runs[2], tokens_per_s=fastest, speedup=1.21)
    fig = compare_page.resources_figure(comp)
    ax = fig.axes[1]
    assert overlapping_tick_labels(fig, gap_px=4.0) == []
    renderer = fig.canvas.get_renderer()
    lo, hi = ax.get_xlim()
    labels = [t.label1 for t in ax.xaxis.get_major_ticks() if t.label1.get_text() and lo <= t.get_loc() <= hi]
    assert 2 <= len(labels) <= 5, [t.get_text() for t in labels]
    assert all(len(t.get_text()) <= 5 for t in labels), [t.get_text() for t in labels]
    for t in labels:
        box = t.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width, t.get_text()
    if fastest > 1e5:
        assert any(t.get_text().endswith(("k", "M")) for t in labels), [t.get_text() for t in labels]


def test_the_reference_of_uneven_steps_draws_no_bar_and_the_others_draw_theirs() -> None:
    """fp32's step times were too uneven to compare: the throughput panel drew fp32's bar alone, the one speed
    that said nothing, and "no bar: does not compare with fp32" for the others, whose speeds the runs table
    listed (619 and 135 tokens/s); the caption said the same sentence once per run. The reference gets no bar,
    the others theirs, without a speed-up over it, and the caption says why once. The memory table, of runs
    without an allocator peak, no longer explains one."""
    plain = [0.02, 0.03, 1.40, 0.02, 1.35, 0.03, 0.02, 1.50]  # a machine busy with other work
    spread = (np.quantile(plain, 0.75) - np.quantile(plain, 0.25)) / np.median(plain)
    assert spread > A.MAX_STEP_TIME_SPREAD
    comp = _four_runs()
    ref = comp.runs[0] = dataclasses.replace(comp.runs[0], tokens_per_s=275.0, step_time_spread=spread)
    for i, tps in ((1, 619.0), (2, 135.0), (3, 600.0)):
        r = dataclasses.replace(comp.runs[i], tokens_per_s=tps, step_time_spread=0.2, speedup=None)
        comp.runs[i] = dataclasses.replace(r, speed_not_taken=A.speed_not_taken(r, ref))
        assert "fp32's step times were too uneven" in comp.runs[i].speed_not_taken
    ax = compare_page.resources_figure(comp).axes[1]
    assert [b.get_width() for b in ax.patches] == [0.0, 619.0, 135.0, 600.0]
    assert [t.get_text() for t in ax.texts] == [" no bar: uneven step times", " 619", " 135", " 600"]
    section = compare_page.render(comp).split('<section id="resources">', 1)[1].split("</section>", 1)[0]
    caption = section.split("</figcaption>", 1)[0]
    assert caption.count("No bar") == 1 and "speed-up over fp32" not in caption.replace(
        "no speed-up over", ""
    )
    assert (
        f"No bar for fp32, and no speed-up over it: fp32&#39;s step times were too uneven to compare (the "
        f"middle half of them spans {spread:.0%} of their median" in caption
    )
    assert not any(T.ALLOCATOR_PEAK in r.memory for r in comp.runs) and "allocator peak" not in section


def test_the_memory_totals_stay_inside_the_panel() -> None:
    """The largest run's total ("10.8 MiB") ran into the memory panel's frame: every total is drawn inside it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    comp = _four_runs()
    # gpt-nano's parts (fp32: 10.8 MiB, a total of three digits beside the longest bar)
    parts = {T.PARAMETERS: 1.89, T.GRADIENTS: 1.89, T.OPTIMIZER_STATES: 3.79, T.ACTIVATIONS: 3.24}
    memory = {c: v * 2**20 for c, v in parts.items()}
    comp.runs[:] = [
        dataclasses.replace(r, memory=memory, memory_total=sum(memory.values())) for r in comp.runs
    ]
    fig = compare_page.resources_figure(comp)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    right = ax.get_window_extent(renderer).x1
    totals = [t for t in ax.texts if t.get_text().endswith("MiB")]
    assert totals and all(t.get_window_extent(renderer).x1 < right for t in totals)


def test_runs_without_measured_memory_draw_their_throughput() -> None:
    """Runs of a loop without the memory tracker: the figure's legend of no memory part raised ValueError
    (matplotlib's ncol=0), and no compare.html was written; then it drew a memory panel of '0 KiB' bars on a
    1e-9 axis beside the throughput. The throughput is the figure, its bars named by run."""
    comp = _four_runs()
    comp.runs[:] = [dataclasses.replace(r, memory={}, memory_total=0) for r in comp.runs]
    fig = compare_page.resources_figure(comp)
    (ax,) = fig.axes
    assert [b.get_width() for b in ax.patches] == [1000.0] * 4
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fp32", "nano_bf16", "fp16", "nano_int"]
    assert ax.get_title().startswith("Throughput") and not fig.legends


def test_runs_without_a_measured_throughput_draw_no_throughput_of_zero() -> None:
    """Loops that pass no token counts: the throughput panel drew '0' for every run on an empty 0-1 axis, beside
    a runs table of '—' and a caption about tokens per second and speed-ups."""
    comp = _four_runs()
    comp.runs[:] = [dataclasses.replace(r, tokens_per_s=math.nan, speedup=None) for r in comp.runs]
    fig = compare_page.resources_figure(comp)
    assert len(fig.axes) == 1 and fig.axes[0].get_title().startswith("Memory per component")
    caption = compare_page.render(comp).split('<section id="resources">', 1)[1].split("</figcaption>", 1)[0]
    assert "tokens per second" not in caption and "throughput" not in caption.lower()
    assert "Throughput not measured: the runs recorded no token counts" in compare_page.render(comp)


def _resources_heading(html: str) -> tuple[str, str]:
    """The memory and throughput section's link in the page's navigation, and its heading."""
    nav = re.search(r'<a href="#resources">(.*?)</a>', html)
    h2 = re.search(r'<section id="resources">\s*<h2>(.*?)</h2>', html)
    assert nav is not None and h2 is not None
    return nav.group(1), h2.group(1)


@pytest.mark.parametrize(
    ("memory", "tokens", "title", "none"),
    [
        (True, True, "Memory and throughput", None),
        (True, False, "Memory", None),
        (False, True, "Throughput", "No memory was measured."),
        (False, False, "Memory and throughput", "No memory was measured, and no run recorded token counts"),
    ],
)
def test_the_memory_and_throughput_section_is_titled_by_what_the_runs_measured(
    memory: bool, tokens: bool, title: str, none: str | None
) -> None:
    """A loop that passes no token counts measures no throughput: the section was still '4. Memory and
    throughput', in the navigation too, over a figure and a table of memory alone."""
    comp = _four_runs()
    comp.runs[:] = [
        dataclasses.replace(
            r,
            memory=r.memory if memory else {},
            memory_total=r.memory_total if memory else 0,
            tokens_per_s=r.tokens_per_s if tokens else math.nan,
        )
        for r in comp.runs
    ]
    html = compare_page.render(comp)
    assert _resources_heading(html) == (f"4. {title}", f"4. {title}")
    section = html.split('<section id="resources">', 1)[1].split("</section>", 1)[0]
    assert ("<figure>" in section) == (memory or tokens)
    assert ('<p class="none">' in section) == (none is not None)
    if none is not None:
        assert f'<p class="none">{none}' in section


def test_a_run_without_a_measured_throughput_beside_others_says_so() -> None:
    comp = _four_runs()
    comp.runs[2] = dataclasses.replace(comp.runs[2], tokens_per_s=math.nan, speedup=None)
    ax = compare_page.resources_figure(comp).axes[1]
    assert [t.get_text() for t in ax.texts][2] == " not measured"


def test_the_memory_caption_names_the_step_the_figure_and_table_show() -> None:
    """The caption said 'each run's last sampled step' under a figure of 'the largest measured step' (the
    projection's representative step): in a run measured on steps 0-17 whose last sampled step was 19."""
    section = (
        compare_page.render(_four_runs()).split('<section id="resources">', 1)[1].split("</section>", 1)[0]
    )
    assert "last sampled step" not in section
    assert section.count("largest measured step") == 2
    assert "(the largest measured step)" in compare_page.resources_figure(_four_runs()).axes[0].get_title()


def test_a_note_on_how_runs_run_is_said_once_per_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    """`precprof compare` of fp16, fp16:none and fp16:advised said "this CPU has no fp16 arithmetic" three times
    (tester t1): within ``notes_once`` (compare's runs) each note is printed once; a lone ``train`` says its own."""
    from precprof.training import loop

    with loop.notes_once():
        for _ in range(3):
            loop._note("this CPU has no fp16 arithmetic")
        loop._note("another note")
    loop._note("this CPU has no fp16 arithmetic")
    err = capsys.readouterr().err
    assert err.count("precprof: note: this CPU has no fp16 arithmetic") == 2
    assert err.count("another note") == 1
