"""bench/fp8_vs_bf16.py, the GPU proof of the FP8 verdict (issue 34): its judgement of two runs, and its
plumbing end to end on the CPU (bf16 standing in for fp8, which needs a GPU), so that the GPU's scarce minutes
go to measuring."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("fp8_vs_bf16", ROOT / "bench" / "fp8_vs_bf16.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_the_verdict_is_judged_against_the_outcome() -> None:
    b = _bench()
    bf16 = {"final_loss": 4.00, "step_time_median_s": 0.0244}
    slower = {"final_loss": 4.04, "step_time_median_s": 0.0326}  # gpt2-small on the H200: matches, slower
    faster = {"final_loss": 4.04, "step_time_median_s": 0.0200}
    off = {"final_loss": 4.50, "step_time_median_s": 0.0200}  # faster, but its loss is 12.5% worse
    not_fp8 = {"measured_format": "bf16", "fp8_estimated_speedup": 0.9}
    fp8 = {"measured_format": "fp8", "fp8_estimated_speedup": 1.3}
    o = b.judge(not_fp8, bf16, slower, 0.02)
    assert o["fp8_matches_bf16"] and not o["fp8_pays"] and o["verdict_right"]
    assert o["measured_speedup"] == pytest.approx(0.0244 / 0.0326) and o["final_loss_gap"] == pytest.approx(
        0.01
    )
    assert not b.judge(not_fp8, bf16, faster, 0.02)["verdict_right"]  # FP8 paid: it should have been advised
    assert b.judge(fp8, bf16, faster, 0.02)["verdict_right"]
    o = b.judge(fp8, bf16, off, 0.02)
    assert not o["fp8_matches_bf16"] and not o["fp8_pays"] and not o["verdict_right"]
    failed = b.judge(fp8, bf16, {"final_loss": math.nan, "step_time_median_s": math.nan}, 0.02)
    assert not failed["fp8_pays"] and not failed["verdict_right"]
    assert b.decided_by(["x", "Not FP8: the speed decided: ..."]) == "speed"
    assert b.decided_by(["Not FP8: what FP8 would do to the numbers decided: ..."]) == "numbers"
    assert b.decided_by(["bf16: ..."]) is None


@pytest.mark.slow
def test_the_dry_run_writes_every_stage(tmp_path: Path) -> None:
    b = _bench()
    out = tmp_path / "fp8_vs_bf16.json"
    argv = [
        "--dry-run",
        "--out",
        str(out),
        "--steps",
        "8",
        "--profile-steps",
        "3",
        "--work",
        str(tmp_path / "w"),
    ]
    assert b.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] and data["fp8_stand_in"] and data["steps"] == 8
    (rec,) = data["models"].values()
    assert set(rec) >= {"spec", "profile", "bf16", "fp8", "outcome"}, rec
    assert rec["profile"]["fp8_checked"] and rec["profile"]["measured_format"]
    for run in ("bf16", "fp8"):
        assert (
            rec[run]["steps"] == 8
            and len(rec[run]["loss"]) == 8
            and rec[run]["compiled"].startswith("compiled")
        )
    assert rec["outcome"]["fp8_matches_bf16"]  # the same bf16 run twice: the same losses
    assert set(rec["outcome"]) >= {"measured_speedup", "verdict_right", "advisor_recommended_fp8"}
