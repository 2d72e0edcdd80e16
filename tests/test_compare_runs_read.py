"""``precprof compare`` on runs as they are left: each run named in the progress lines as its directory is,
a run killed before it saved, one that stopped early, one missing a table or its summary.json."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from precprof import compare as C
from precprof.training import TrainConfig


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
