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

# The benches' dry runs train and compile in this process: on one intra-op thread (conftest's ``one_thread``), as
# their own processes would get it (conftest sets OMP_NUM_THREADS=1 for the processes tests start). With torch's
# two threads on 2 busy cores their OpenMP threads spun against each other: the dry run's identical compiled bf16
# runs took 5.4 s and 0.7 s, and its CPU time doubled.
pytestmark = pytest.mark.usefixtures("one_thread")


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
    # without a noise run the tolerance alone decides, and the outcome says so
    assert o["allowed_gap"] == 0.02 and math.isnan(o["bf16_seeds_gap"])
    assert b.decided_by(["x", "Not FP8: the speed decided: ..."]) == "speed"
    assert b.decided_by(["Not FP8: what FP8 would do to the numbers decided: ..."]) == "numbers"
    assert b.decided_by(["bf16: ..."]) is None


def test_fp8_matches_within_the_noise_of_two_bf16_seeds() -> None:
    """qwen2-2048 on the H200: fp8 ended 4.3% above bf16 (2% tolerance: no match), and 14% slower. Had a second
    bf16 seed ended 3% away, fp8's gap would be within twice that: a match, and still no gain."""
    b = _bench()
    bf16 = {"final_loss": 2.018, "step_time_median_s": 0.0444}
    fp8 = {"final_loss": 2.018 * 1.043, "step_time_median_s": 0.0517}
    advised_bf16 = {"measured_format": "bf16", "fp8_estimated_speedup": 0.86}
    alone = b.judge(advised_bf16, bf16, fp8, 0.02)
    assert not alone["fp8_matches_bf16"] and alone["allowed_gap"] == 0.02
    noisy = b.judge(advised_bf16, bf16, fp8, 0.02, {"final_loss": 2.018 * 0.97})  # 3% below: |gap| counts
    assert noisy["bf16_seeds_gap"] == pytest.approx(0.03) and noisy["allowed_gap"] == pytest.approx(0.06)
    assert noisy["fp8_matches_bf16"] and not noisy["fp8_pays"] and noisy["verdict_right"]
    # two seeds that agree leave the tolerance as the floor; a failed noise run counts as none
    quiet = b.judge(advised_bf16, bf16, fp8, 0.02, {"final_loss": 2.018 * 1.001})
    assert quiet["allowed_gap"] == 0.02 and not quiet["fp8_matches_bf16"]
    failed = b.judge(advised_bf16, bf16, fp8, 0.02, {"final_loss": math.nan})
    assert failed["allowed_gap"] == 0.02
    # fp8 far below bf16 (gpt2-small: 6.8% below) matches whatever the noise: only a worse loss counts
    assert b.judge(advised_bf16, bf16, {**fp8, "final_loss": 2.018 * 0.932}, 0.02)["fp8_matches_bf16"]


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
    assert set(rec) >= {"spec", "profile", "bf16", "fp8", "bf16_noise", "outcome"}, rec
    assert rec["bf16"]["seed"] == rec["fp8"]["seed"] == 0 and rec["bf16_noise"]["seed"] == 1
    assert rec["profile"]["wall_s"] > 0
    assert rec["profile"]["fp8_checked"] and rec["profile"]["measured_format"]
    for run in ("bf16", "fp8", "bf16_noise"):
        assert (
            rec[run]["steps"] == 8
            and len(rec[run]["loss"]) == 8
            and rec[run]["compiled"].startswith("compiled")
        )
    assert rec["outcome"]["fp8_matches_bf16"]  # the same bf16 run twice: the same losses
    o = rec["outcome"]
    assert o["final_loss_gap"] == 0 and o["bf16_seeds_gap"] > 0  # another seed: other weights and batches
    assert o["allowed_gap"] == max(data["tolerance"], data["noise_factor"] * o["bf16_seeds_gap"])
    assert set(rec["outcome"]) >= {"measured_speedup", "verdict_right", "advisor_recommended_fp8"}


def _layers_bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("fp8_layers", ROOT / "bench" / "fp8_layers.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_layer_bench_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    """bench/fp8_layers.py --dry-run: its plumbing (compile per shape and format, both timings, the JSON
    rewritten after each shape), with bf16 standing in for FP8 and, the CPU having no CUDA graphs, the host's
    wall time standing in for the graph replays, labelled so."""
    mod = _layers_bench()
    out = tmp_path / "layers.json"
    assert mod.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] and data["fp8_stand_in"] and data["compiled"]
    assert data["graph_stand_in"] == mod.CPU_FALLBACK and "stopped" not in data
    assert [(r["k"], r["n"]) for r in data["shapes"]] == list(mod.DRY_SHAPES)
    for r in data["shapes"]:
        assert "error" not in r, r
        for fmt in ("bf16", "fp8"):
            t = r[fmt]
            assert t["timing"] == mod.CPU_FALLBACK
            assert t["time_s"] == t["graph_s"] > 0 and t["eager_launch_s"] > 0
            assert t["first_call_s"] > 0 and t["tflops"] > 0
        assert r["speedup"] == pytest.approx(r["bf16"]["time_s"] / r["fp8"]["time_s"])
        assert r["speedup_eager_launch"] == pytest.approx(
            r["bf16"]["eager_launch_s"] / r["fp8"]["eager_launch_s"]
        )


def test_the_layer_bench_times_the_shapes_it_is_given_within_its_budget(tmp_path: Path) -> None:
    """--shapes K x N,...: those shapes alone, in that order; --budget-s stops starting shapes (the JSON says
    how many it measured); the models' shapes come first, qwen2-3072's among them."""
    mod = _layers_bench()
    assert mod.parse_shapes("3072x3072, 3072X1024") == ((3072, 3072), (3072, 1024))
    for bad in ("3072", "3072x", "ax1024", "0x8", "3072x1024,"):
        with pytest.raises(Exception, match="not K x N"):
            mod.parse_shapes(bad)
    with pytest.raises(SystemExit):
        mod.main(["--dry-run", "--out", str(tmp_path / "x.json"), "--shapes", "3072"])
    out = tmp_path / "shapes.json"
    assert mod.main(["--dry-run", "--out", str(out), "--shapes", "48x80"]) == 0
    data = json.loads(out.read_text())
    assert [(r["k"], r["n"], r["m"]) for r in data["shapes"]] == [(48, 80, 64)]
    assert "error" not in data["shapes"][0] and data["shapes"][0]["speedup"] > 0
    assert mod.main(["--dry-run", "--out", str(out), "--shapes", "48x80,16x16", "--budget-s", "-1"]) == 0
    data = json.loads(out.read_text())
    assert data["shapes"] == [] and data["stopped"] == "budget: 0 of 2 shapes measured"
    qwen2_3072 = [(3072, 3072), (3072, 1024), (3072, 8192), (8192, 3072), (3072, 32768)]
    assert mod.MODEL_SHAPES[-5:] == tuple(qwen2_3072)
    assert len(set(mod.MODEL_SHAPES + mod.GRID)) == len(mod.MODEL_SHAPES + mod.GRID) == 28
