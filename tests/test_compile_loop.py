"""The built-in loop runs each mode as its users would for speed (issue 34, item 4): ``--compile`` /
``--no-compile``, fp8 compiled by default (torchao's float8 training is fast only compiled), the others eager;
``precprof compare`` records and says how each run ran. On the CPU, inductor's C++ backend compiles a tiny MLP
(FP8 needs a GPU: its default is checked, and its refusal here is the plan's clear error)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from precprof import cli
from precprof import tables as T
from precprof.compare import compare
from precprof.errors import UserError
from precprof.training import TrainConfig, compiling, train

TINY = {"model": "mlp", "model_args": {"hidden": 32, "n_embd": 16}, "batch_size": 2, "seq_len": 16}


def _config(out: Path, **kw: object) -> TrainConfig:
    base: dict[str, object] = {**TINY, "steps": 3, "device": "cpu", "progress": False, "report": False}
    return TrainConfig(out=out, **{**base, **kw})  # type: ignore[arg-type]


def test_each_mode_compiles_as_its_users_run_it() -> None:
    assert compiling.should_compile(None, "fp8")  # fast only compiled
    for mode in ("fp32", "tf32", "bf16", "fp16", "bf16-pure", "fp16-pure"):
        assert not compiling.should_compile(None, mode), mode
    assert compiling.should_compile(True, "fp32") and not compiling.should_compile(False, "fp8")
    assert "fast only compiled" in compiling.note("fp8", compiled=False)
    assert compiling.note("fp8", compiled=True) == "" == compiling.note("bf16", compiled=False)
    assert compiling.describe(None, True, "fp8") == "compiled (torch.compile), the default for fp8"
    assert compiling.describe(False, False, "bf16") == "eager, --no-compile"
    # once the run ran: how many steps ran the compiled model (a sampled step runs it eagerly), and why not all
    assert compiling.ran(None, True, "fp8", 1, 1) == {
        "steps_run_compiled": 0,
        "compiled": "ran no step compiled: torch.compile wrapped the model (the default for fp8), but its one "
        "step was sampled, and a sampled step runs it eagerly (for the hooks)",
    }
    assert compiling.ran(True, True, "bf16", 5, 1)["compiled"] == (
        "compiled (torch.compile), --compile: 4 of 5 steps ran compiled, the 1 sampled one eagerly (for the hooks)"
    )
    # a torch without compiler stances (before 2.6) runs a sampled step compiled
    assert compiling.ran(True, True, "bf16", 5, 5, eager_when_sampled=False) == {
        "steps_run_compiled": 5,
        "compiled": "compiled (torch.compile), --compile",
    }
    assert compiling.ran(None, False, "bf16", 5, 5) == {
        "steps_run_compiled": 0,
        "compiled": "eager, the default for bf16",
    }
    assert (
        compiling.ran_note({"compile": False, "steps_run_compiled": 0, "compiled": "eager, --no-compile"}, 1)
        == ""
    )


def test_the_options_reach_the_config(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from precprof import training

    seen: list[TrainConfig] = []

    def record(config: TrainConfig, **_: object) -> None:
        seen.append(config)
        raise KeyboardInterrupt  # stop before anything trains: the configuration is what is checked

    monkeypatch.setattr(training, "train", record)
    for flag, want in (("--compile", True), ("--no-compile", False), (None, None)):
        with pytest.raises(SystemExit):
            cli.main(["train", "--steps", "1", "--no-progress", "--device", "cpu", *([flag] if flag else [])])
        capsys.readouterr()
        assert seen[-1].compile is want, flag


def test_fp8_is_refused_on_the_cpu_before_anything_is_built(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"--precision fp8 needs an NVIDIA GPU with FP8 tensor cores"):
        train(_config(tmp_path / "fp8", precision="fp8"))
    assert not (tmp_path / "fp8").exists()


def test_a_compiled_run_on_the_cpu(tmp_path: Path) -> None:
    """--compile on a CPU run: inductor compiles the model the loop calls, the run says so, and it trains as
    the eager run does (same losses to float precision)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = train(_config(tmp_path / "c", compile=True, sample_every=0))
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo compiled the forward (and its backward)
    eager = train(_config(tmp_path / "e", sample_every=0))
    cfg = json.loads((tmp_path / "c" / T.SUMMARY_FILE).read_text())[T.SUMMARY_CONFIG]
    assert cfg["compile"] is True and cfg["compile_requested"] is True
    assert cfg["compiled"] == "compiled (torch.compile), --compile" and cfg["steps_run_compiled"] == 3
    ecfg = eager.summary[T.SUMMARY_CONFIG]
    assert ecfg["compile"] is False and ecfg["compiled"] == "eager, the default for fp32"
    assert compiled.steps[T.LOSS].tolist() == pytest.approx(eager.steps[T.LOSS].tolist(), rel=1e-5)


def test_compare_says_how_each_mode_ran(tmp_path: Path) -> None:
    comparison = compare(
        _config(tmp_path / "unused", steps=2, sample_every=1), "fp32,bf16", out=tmp_path / "cmp"
    )
    how = {r.label: r.compiled for r in comparison.runs}
    assert how == {"fp32": "eager, the default for fp32", "bf16": "eager, the default for bf16"}
    assert any(
        n.startswith("How each run ran: fp32 eager, the default for fp32; bf16 eager")
        for n in comparison.notes
    )
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["compiled"] for r in saved["runs"]] == [
        "eager, the default for fp32",
        "eager, the default for bf16",
    ]
    assert saved["config"]["compile_requested"] is None
    assert "How each run ran" in (tmp_path / "cmp" / "compare.html").read_text()


def test_a_compiled_run_whose_every_step_was_sampled_says_none_ran_compiled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--compile` on a short run whose every step is sampled: a sampled step runs eagerly, so no step ran
    compiled, while the page said "compiled (torch.compile)" beside eager losses and step times. It says so, and
    so do summary.json (its config said "compiled (torch.compile), --compile"), the terminal (it said nothing) and
    the comparison (it said each run ran compiled, its first step left out of the throughput as the compile's)."""
    from precprof.analysis.comparison import Variant, analyse
    from precprof.report.environment import capture_rows

    capsys.readouterr()
    train(_config(tmp_path / "c", compile=True, sample_every=1))
    summary = T.read_summary(tmp_path / "c")
    cfg = summary[T.SUMMARY_CONFIG]
    assert cfg["compile"] is True and cfg["compile_requested"] is True  # torch.compile wrapped the model
    none_ran = (
        "ran no step compiled: torch.compile wrapped the model (--compile), but all 3 steps were sampled, and a "
        "sampled step runs it eagerly (for the hooks)"
    )
    assert cfg["steps_run_compiled"] == 0 and cfg["compiled"] == none_ran
    assert (
        f"precprof: note: this run {none_ran}; --sample-every N with N above 1 runs the steps not sampled compiled"
        in capsys.readouterr().err
    )
    row = dict(capture_rows(summary[T.SUMMARY_CAPTURE], summary[T.SUMMARY_CONFIG]))["torch.compile"]
    assert row.startswith(
        "the whole model: every step was sampled, and a sampled step runs it eagerly (for the hooks): no step "
        "of this run ran compiled"
    )
    # said once (it had begun "the steps not sampled ran compiled"), with the built-in loop's own flag
    assert "steps not sampled" not in row and "--sample-every N with N above 1" in row
    # some steps unsampled: it said nothing at all of the sampled steps running eagerly (a user's loop did)
    # (the default interval of a compiled run of 4 steps: every second step, so that the others run it compiled; it
    # was 1, and fp8, compiled by default, ran no step compiled in a run of fewer than 150 steps)
    train(_config(tmp_path / "s", compile=True, steps=4))
    summary = T.read_summary(tmp_path / "s")
    assert T.read_tables(tmp_path / "s")["steps"][T.SAMPLED].tolist() == [True, False, True, False]
    cfg = summary[T.SUMMARY_CONFIG]
    assert cfg["steps_run_compiled"] == 2 and cfg["compiled"] == (
        "compiled (torch.compile), --compile: 2 of 4 steps ran compiled, the 2 sampled ones eagerly (for the hooks)"
    )
    # the page's Run group says it in the one "compiled" row ("compile: yes" beside "steps run compiled: 0" read
    # as a contradiction, and five rows said compiling, reviewer r2)
    from precprof.report.environment import config_rows

    said = [label for label, _ in config_rows(cfg)]
    assert "compiled" in said and not {"compile", "compile requested", "steps run compiled"} & set(said), said
    assert "ran no step compiled" not in capsys.readouterr().err
    # the comparison says how each ran, runs that ran alike once; nothing compiled in a run that ran none
    shutil.copytree(tmp_path / "c", tmp_path / "c2")
    comparison = analyse([(Variant("fp32", name=n), tmp_path / n) for n in ("c", "c2", "s")])
    how = next(n for n in comparison.notes if n.startswith("How each run ran"))
    assert how == (
        f"How each run ran: c and c2 {none_ran}; s {cfg['compiled']}. Each mode runs as its users run it for "
        "speed (fp8 only compiled, by default); the steps in which torch.compile compiled are left out of the "
        "throughput."
    )
    assert how not in comparison.page_only  # the terminal says it too
    row = dict(capture_rows(summary[T.SUMMARY_CAPTURE], summary[T.SUMMARY_CONFIG]))["torch.compile"]
    assert row.startswith(
        "the whole model: the steps not sampled ran compiled; the sampled ones ran it eagerly"
    )
    assert "no step of this run ran" not in row
    # the memory a sampled step measures is eager's too (tester h61: a checkpointed compiled graph saved 8% less)
    assert "and so are the activations the memory section shows" in row
    train(_config(tmp_path / "e", sample_every=1))  # eager: nothing to say
    summary = T.read_summary(tmp_path / "e")
    assert "torch.compile" not in dict(capture_rows(summary[T.SUMMARY_CAPTURE], summary[T.SUMMARY_CONFIG]))
