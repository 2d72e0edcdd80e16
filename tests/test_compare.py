"""precprof compare: variants, outcome classification, the verdict check, and one short real comparison."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

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
        "settled_scale": None,
        "init_scale": None,
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
        run_result("fp16", 5.0, 2.006, loss_scaling="dynamic", settled_scale=2.0**13),
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
    assert "recommends fp16 with init_scale 2^13" in text and "matched fp32 within 0.3%" in text
    assert "settled at 2^13" in text
    # the scale-1 underflow warning predicted the unscaled run's stall
    assert (
        "stalled" in checks[("fp16-none", A.CONFIRMED)]
        and "38% at scale 1" in checks[("fp16-none", A.CONFIRMED)]
    )
    # lost updates are a what-if for autocast bf16 (fp32 masters): no warning applies, the run fell behind
    assert "15.0% above fp32" in checks[("bf16", A.MISSED)]


def test_verdict_check_not_borne_out_and_unchecked() -> None:
    rec = _rec(
        "bf16", None, [("fp16_gradient_underflow", "warning", "fp16 gradient underflow: 9% at scale 1")]
    )
    ref = run_result("fp32", 5.0, 2.0, recommendation=rec)
    fp16 = run_result("fp16-none", 5.0, 2.01)
    fp16.outcome, fp16.gap = A.classify(fp16, ref, 0.02)
    checks = A.check_against_runs([ref, fp16], ref)
    assert [c.status for c in checks] == [A.UNCHECKED, A.NOT_BORNE_OUT]
    assert "no bf16 run in this comparison" in checks[0].text


# ------------------------------------------------------------------------------------------- a real run
@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> tuple[A.Comparison, Path]:
    out = tmp_path_factory.mktemp("compare")
    base = TrainConfig(
        model="gpt-nano",
        model_args={"n_layer": 1},
        steps=STEPS,
        batch_size=2,
        seq_len=16,
        sample_every=4,
        progress=False,
        report=False,  # the per-run reports are the report's own tests; rendering three would triple the time
        seed=3,
    )
    return C.compare(base, "fp32,bf16,fp16:none", out=out), out


def _window_mean(run_dir: Path) -> tuple[float, float]:
    steps = T.read_tables(run_dir)["steps"].sort_values(T.STEP)
    loss = steps[T.LOSS].to_numpy(dtype=float)
    return float(loss[-max(5, len(loss) // 10) :].mean()), float(loss[0])


def test_each_run_has_its_directory_and_report(comparison: tuple[A.Comparison, Path]) -> None:
    comp, out = comparison
    assert [r.label for r in comp.runs] == ["fp32", "bf16", "fp16-none"]
    for r, (prec, scaling) in zip(
        comp.runs, [("fp32", "none"), ("bf16", "none"), ("fp16", "none")], strict=True
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
    assert [r["label"] for r in saved["runs"]] == ["fp32", "bf16", "fp16-none"]
    assert [c["status"] for c in saved["checks"]]  # every line of the verdict check is stored


def test_comparison_page(comparison: tuple[A.Comparison, Path]) -> None:
    comp, out = comparison
    html = (out / C.COMPARE_HTML).read_text()
    assert html.count('src="data:image/png;base64,') == 2  # loss curves; memory and throughput
    for label in ("fp32", "bf16", "fp16-none"):
        assert f"<strong>{label}</strong>" in html
    assert 'href="fp32"' in html  # no per-run report here: the link goes to the run directory
    from precprof.hardware import cpu_fp16_native

    assert bool(comp.notes) == (not cpu_fp16_native())  # fp16 throughput on a CPU that emulates fp16
    assert all(n.replace("'", "&#39;") in html for n in comp.notes)
    assert "Verdict check" in html and comp.checks[0].text.split(":")[0] in html.replace("&#39;", "'")


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
    comp = C.compare(base, "fp32,fp16:none,fp16:advised", out=tmp_path)
    ref, unscaled, advised = comp.runs
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


def test_cli_compare_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from precprof.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--precisions", "fp32"])
    assert exit_info.value.code == 2
    assert "at least two precisions" in capsys.readouterr().err


def test_small_model_default_is_checked_against_the_measured_speed(tmp_path: Path) -> None:
    """A small model gets fp32 by default with the format its measurements allow; compare times that format:
    faster by at least SMALL_MODEL_MIN_SPEEDUP and matching, the measurement overrides the default, else the
    default stands. Real runs; the status follows the speed measured here."""
    base = TrainConfig(
        model="gpt-nano", steps=12, batch_size=4, seq_len=32, sample_every=4, progress=False, report=False
    )
    comp = C.compare(base, "fp32,bf16", out=tmp_path)
    ref, low = comp.runs
    # the advice for a machine with native bf16 (this one may have none): fp32 by default, bf16 measured safe
    rec = precprof.recommend(tmp_path / "fp32", hardware="a100").to_dict()
    assert rec["format"] == "fp32" and rec["measured_format"] == "bf16"
    ref.recommendation = rec
    checks = A.check_against_runs(comp.runs, ref)
    check = next(c for c in checks if "default for a model this small" in c.text)
    assert check.run == low.label and low.speedup is not None
    if low.outcome in (A.MATCHED, A.AHEAD) and low.speedup >= A.SMALL_MODEL_MIN_SPEEDUP:
        assert check.status == A.OVERRIDDEN and "use bf16" in check.text
    else:
        assert check.status == A.CONFIRMED and "keep fp32" in check.text
