"""``precprof compare`` on runs as they are left: each run named in the progress lines as its directory is,
a run killed before it saved, one that stopped early, one missing a table or its summary.json."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from precprof import compare as C
from precprof import tables as T
from precprof.training import TrainConfig, train


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
    torch.set_num_threads(1)
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
    res = subprocess.run([sys.executable, "-c", KILLED, str(root / "bf16")], env=env, capture_output=True)
    assert res.returncode == -signal.SIGKILL, res.stderr.decode()[-2000:]
    return root / "fp32", root / "bf16"


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
    assert killed.reason is not None and killed.reason.startswith(f"cut off after step {KILL_AFTER}: killed")
    html = page.read_text()
    assert "running (pid" not in html and f"cut off after step {KILL_AFTER}" in html
