"""bench/gpu_validate.py runs end to end in its dry run: every stage ran or says why not, and the JSON has what
a GPU session will fill in (so the GPU's scarce minutes go to measuring, not debugging)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_exercises_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "gpu_validate.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,  # 40 s on 2 quiet cores; a loaded machine took over 300 s
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    stages = data["stages"]
    assert list(stages) == [
        "env",
        "host",
        "overhead",
        "first_step",
        "kernels",
        "profile",
        "syncs",
        "memory",
        "compile",
        "tests",
    ]
    for name, rec in stages.items():
        assert rec["status"] in ("ok", "skipped"), (name, rec)
        assert rec["status"] == "ok" or rec["reason"], name
    for name in ("syncs", "compile"):
        assert stages[name]["status"] == "skipped" and "CUDA" in stages[name]["reason"]
    assert stages["profile"]["cpu_top"] and "cumulative" in stages["profile"]["cprofile_cumulative"]
    assert len(stages["env"]["source_sha256"]) == 64
    files = stages["tests"]["files"]
    assert "test_stats_gpu.py" in files and "test_triton_block.py" in files
    assert all(f["rc"] == 0 and f["collected"] > 0 for f in files.values())
    row = stages["kernels"]["rows"][0]
    assert (
        row["numel"] == 1 << 20
        and row["sum_gbps"] > 0
        and row["rows_c_gbps"] > 0
        and row["blocks_c_gbps"] > 0
    )
    for label in ("cold", "warm"):
        first = stages["first_step"][label]
        assert len(first["steps_s"]) >= 6 and sum(first["sampled"]) >= 3
        assert (
            first["worst_step_over_later_sampled"] > 0 and first["sampling"]["first_sampled_step"] is not None
        )
    host = stages["host"]["host_cost"]
    assert host["inspected_tensors_per_sampled_step"] > 0 and host["host_us_per_tensor"] is not None
    results = stages["overhead"]["overhead"]["results"]
    assert set(results) == {"baseline", "precprof_1", "precprof_10", "precprof_auto"}
    assert results["precprof_10"]["phases"]["sampled"]["profiler_step_host_s"] >= 0
    assert results["precprof_auto"]["sampling"]["mode"] == "budget"
    for precision in ("bf16", "fp32"):
        mem = stages["memory"][precision]
        # every byte of the peak in one part (on the CPU: the profiler's replay, as the built-in loop runs it)
        assert mem["parts_at_peak"]["parameters"] > 0 and mem["parts_bytes"] == mem["allocator_peak"]


def test_a_bad_stage_is_one_line() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--dry-run", "--stages", "env,nope"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "unknown stage(s) nope" in r.stderr
