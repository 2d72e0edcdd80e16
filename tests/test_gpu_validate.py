"""bench/gpu_validate.py runs end to end in its dry run: every stage ran or says why not, and the JSON has what
a GPU session will fill in (so the GPU's scarce minutes go to measuring, not debugging)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import forks
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_exercises_every_stage(tmp_path: Path) -> None:
    """Its Pythons (the script's own, and host_cost.py, overhead.py, the first-step scripts and pytest's
    collection it starts) are forks of one that has imported torch and precprof (tests/forked_children.py):
    each fresh one spent 3-4 s of CPU importing them; the test reads what they measured, not how they start."""
    out = tmp_path / "gpu_validate.json"
    script = [str(ROOT / "bench" / "gpu_validate.py"), "--dry-run", "--out", str(out)]
    r = forks.run(
        [sys.executable, str(ROOT / "tests" / "forked_children.py"), *script],
        capture_output=True,
        text=True,
        timeout=900,  # 55 s on 2 quiet cores; a loaded machine took over 300 s
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
        "memory_cost",
        "compile",
        "tests",
    ]
    for name, rec in stages.items():
        assert rec["status"] in ("ok", "skipped"), (name, rec)
        assert rec["status"] == "ok" or rec["reason"], name
    for name in ("syncs", "compile"):
        assert stages[name]["status"] == "skipped" and "CUDA" in stages[name]["reason"]
    assert stages["profile"]["cpu_top"] and "cumulative" in stages["profile"]["cprofile_cumulative"]
    memory_step = stages["profile"]["memory_step"]  # a step the tracker was told to measure, profiled
    assert memory_step["measured"] and memory_step["step_s"] > 0
    assert (
        "gpu_validate.py"
        in memory_step["cprofile_cumulative"].split("filename:lineno(function)")[1].splitlines()[1]
    )
    assert len(stages["env"]["source_sha256"]) == 64
    files = stages["tests"]["files"]
    assert "test_stats_gpu.py" in files and "test_triton_block.py" in files
    assert all(f["rc"] == 0 and f["collected"] > 0 for f in files.values())
    row = stages["kernels"]["rows"][0]
    assert (
        row["numel"] == 1 << 16
        and row["sum_gbps"] > 0
        and row["rows_c_gbps"] > 0
        and row["blocks_c_gbps"] > 0
    )
    assert stages["first_step"]["warm"]["status"] == "skipped"  # the CPU: nothing compiles, "warm" is "cold"
    first = stages["first_step"]["cold"]
    assert len(first["steps_s"]) >= 6 and sum(first["sampled"]) >= 3
    assert first["worst_step_over_later_sampled"] > 0 and first["sampling"]["first_sampled_step"] is not None
    assert first["worst_first_step_over_plain"] > 0  # against the "plain" run, without precprof
    host = stages["host"]["host_cost"]
    assert host["inspected_tensors_per_sampled_step"] > 0 and host["host_us_per_tensor"] is not None
    profiled = host["cprofile"]  # the steps themselves, the outermost call first
    assert profiled["config"] == "memory each" and profiled["steps"] == 2 and profiled["wall_s_profiled"] > 0
    assert "host_cost.py" in profiled["cumulative"].split("filename:lineno(function)")[1].splitlines()[1]
    assert all(isinstance(r["gc"], dict) for r in host["results"].values())
    results = stages["overhead"]["overhead"]["results"]
    assert set(results) == {"baseline", "precprof_1", "precprof_10", "precprof_auto"}
    assert results["precprof_10"]["phases"]["sampled"]["profiler_step_host_s"] >= 0
    assert results["precprof_auto"]["sampling"]["mode"] == "budget"
    # the GPU's second call (the budget over longer blocks) is the same call with other numbers, not run here
    budget = stages["overhead"]["budget"]
    assert budget["status"] == "skipped" and budget["reason"] == "dry run"
    configs = budget["args"][budget["args"].index("--configs") + 1].split(",")
    assert configs == ["baseline", "precprof_auto"] and set(configs) <= set(results)
    for precision in ("bf16", "fp32"):
        mem = stages["memory"][precision]
        # every byte of the peak in one part (on the CPU: the profiler's replay, as the built-in loop runs it)
        assert mem["parts_at_peak"]["parameters"] > 0 and mem["parts_bytes"] == mem["allocator_peak"]
    check_memory_cost(stages["memory_cost"])


def check_memory_cost(rec: dict) -> None:
    """The memory_cost stage's dry run (read from the every-stage run above, 1-2 s of it): whole sampled
    steps with and without each part of the memory tracking, the measured one's parts timed from outside
    (torch.profiler's source on the CPU), the CUDA history's own calls skipped with the reason."""
    assert rec["status"] == "ok", rec
    api = rec["api"]
    assert "max_entries" in api["_record_memory_history"] and "mempool_id" in api["memory_snapshot"]
    assert api["precprof_enable_call"]["kwargs"]["context"] is None  # no stack traces: the cheap setting

    def number(x: object) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    configs = {c for pair in rec["diffs"].values() for c in pair}  # every configuration a difference reads
    for kind in ("transformer", "tiny"):
        model = rec[kind]
        assert configs <= set(model["configs"])
        for name, c in model["configs"].items():
            assert c["status"] == "ok", (kind, name, c)
            assert all(number(c[k]) and c[k] >= 0 for k in ("step_s", "host_s", "step_call_s")), (kind, name)
            assert c["step_s"] > 0 and len(c["step_s_all"]) == model["timed_steps"]
        shares = {n: c["measured_share"] for n, c in model["configs"].items()}
        assert shares["measured"] == 1.0 and shares["measured_no_peak"] == 1.0
        assert shares["memory_unmeasured"] == 0.0 and shares["no_memory"] == 0.0
        assert set(model["added_s"]) == set(rec["diffs"])
        assert all(number(v) for d in model["added_s"].values() for v in d.values())
        ins = model["configs"]["measured"]["instrumented"]
        assert ins["source"] == "ProfilerMemory" and ins["replayed_events"] > 0
        parts = ins["parts"]
        for k in (
            "source_start_s",
            "source_stop_s",
            "profiler_memory_stop_s",
            "replay_s",
            "tracker_end_step_s",
        ):
            assert number(parts[k]) and parts[k] > 0, (kind, k, parts)
        # the parts nest: what is left of each enclosing call is never below zero
        for k in ("conversion_s", "finish_other_s", "end_step_rows_s", "begin_step_other_s"):
            assert number(parts[k]) and parts[k] >= 0, (kind, k, parts)
        assert parts["tracker_end_step_s"] >= parts["source_stop_s"] >= parts["profiler_memory_stop_s"]
        assert (
            model["history_calls"]["status"].startswith("skipped")
            and "CUDA" in model["history_calls"]["status"]
        )


def _gpu_validate() -> Any:
    """bench/gpu_validate.py as a module (it imports nothing this process has not: no torch start of its own)."""
    spec = importlib.util.spec_from_file_location("gpu_validate", ROOT / "bench" / "gpu_validate.py")
    assert spec is not None and spec.loader is not None
    gpu_validate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_validate)
    return gpu_validate


def test_a_bad_stage_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Its ``main`` in this process (argparse's exit, as the command line gets it): no second torch to start."""
    with pytest.raises(SystemExit) as exit_:
        _gpu_validate().main(["--dry-run", "--stages", "env,nope"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "unknown stage(s) nope" in err


def test_the_row_kernel_fit_finds_the_fixed_cost_and_the_slow_launches() -> None:
    """The profile stage pairs each row kernel's device time (torch.profiler's kernel events, in the order they
    ran, other kernels among them) with the tensor it read, and fits per dtype a cost a launch and a rate: from
    launches made to cost 5 us + 1 us per 200,000 values exactly, it finds them, and names the launch that took
    three times its share (a second read of its blocks)."""
    from types import SimpleNamespace

    gpu_validate = _gpu_validate()

    events, launched, t = [], [], 0.0
    sizes = [768, 10**6, 4 * 10**6, 10**7, 2 * 10**6, 5 * 10**6]
    for i, n in enumerate(sizes):
        us = (5 + n / 200e3) * (3 if i == 5 else 1)
        events.append(
            SimpleNamespace(
                name="_rows", device_type="DeviceType.CUDA", time_range=SimpleNamespace(start=t, end=t + us)
            )
        )
        events.append(
            SimpleNamespace(
                name="gemm",
                device_type="DeviceType.CUDA",
                time_range=SimpleNamespace(start=t + us, end=t + us + 9),
            )
        )
        launched.append((n, "float32", (n,)))
        t += us + 10
    clean = gpu_validate._row_kernel_fit(events[:-2], launched[:-1])
    assert clean["kernels"] == clean["launches"] == 5
    assert clean["float32"]["fixed_us"] == pytest.approx(5, abs=1e-6)
    assert clean["float32"]["gelem_per_s"] == pytest.approx(200, rel=1e-9)
    assert clean["float32"]["over_2x_fit"] == 0 and clean["float32"]["smallest"]["elements"] == 768
    slow = gpu_validate._row_kernel_fit(events, launched)["float32"]
    assert slow["over_2x_fit"] == 1 and slow["over_2x_fit_shapes"][0]["shape"] == [5 * 10**6]
    assert (
        gpu_validate._row_kernel_fit(events, launched[:-1])["note"] == "kernels and launches do not pair up"
    )
