"""``precprof.recommend()`` given what is no run, or a target it cannot plan for: one clear error, never a verdict
(a folder holding no run's files was planned for as a run that sampled nothing, "fp16 with scale 65536" on a V100;
``hardware=70`` planned for the recording machine)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import precprof
from precprof import tables as T


def test_a_folder_of_no_run_is_refused_as_precprof_report_refuses_it(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("not a run")
    for target in (None, "v100", "h100"):
        with pytest.raises(FileNotFoundError) as e:
            precprof.recommend(tmp_path, hardware=target)
        assert str(e.value) == T.not_a_run_dir(tmp_path) and "not a precprof run directory" in str(e.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        precprof.recommend(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="is a file"):
        precprof.recommend(tmp_path / "x.txt")


def test_read_tables_refuses_what_recommend_refuses(tmp_path: Path) -> None:
    """``precprof.tables.read_tables()`` of a mistyped path, a file, or a folder of no run returned four empty
    tables (t4), where ``recommend()`` of the same says what is wrong: the same one line, as FileNotFoundError."""
    (tmp_path / "x.txt").write_text("not a run")
    for path in (tmp_path / "gone", tmp_path / "x.txt", tmp_path):
        with pytest.raises(FileNotFoundError) as e:
            T.read_tables(path)
        assert str(e.value) == T.not_a_run_dir(path) != ""
    T.write_summary(tmp_path / "run", {"status": "complete"})  # a run with no table yet: four empty ones
    assert {k: len(v) for k, v in T.read_tables(tmp_path / "run").items()} == dict.fromkeys(T.TABLE_FILES, 0)


def test_a_target_that_is_no_preset_name_or_hardwareinfo_is_refused() -> None:
    tables = {name: T.empty(name) for name in T.TABLES}
    assert isinstance(tables["layers"], pd.DataFrame)
    with pytest.raises(
        TypeError, match=r"hardware= takes a preset name \(.*h100.*\), a HardwareInfo or None"
    ):
        precprof.recommend(tables, hardware=70)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown hardware target 'h1000'"):
        precprof.recommend(tables, hardware="h1000")
    assert precprof.recommend(tables, hardware="v100").format == "fp16"


def test_an_empty_table_is_a_fresh_one_each_time_and_a_runs_memo_is_its_own() -> None:
    """``tables.empty`` copies one frame built once: what a caller adds to one never reaches the next. What the
    advisor computes once per run (``_Run.memo``) is computed once per run and key, and a second run computes
    its own (a user's two runs in one process share nothing)."""
    from precprof import hardware as hw
    from precprof.analysis.advisor import AdvisorConfig
    from precprof.analysis.advisor.evidence import _prepare, _Run

    first = T.empty("layers")
    first["added"] = 1
    assert "added" not in T.empty("layers") and list(T.empty("layers").columns) == list(T.TABLES["layers"])

    def run() -> _Run:
        layers, hist, steps = _prepare({})
        return _Run(
            layers,
            hist,
            steps,
            {},
            hw.preset("cpu"),
            False,
            AdvisorConfig(),
        )

    calls: list[int] = []
    a, b = run(), run()
    assert a.memo("k", lambda: calls.append(1) or 1) == 1 and a.memo("k", lambda: calls.append(2) or 2) == 1
    assert b.memo("k", lambda: calls.append(3) or 3) == 3
    assert calls == [1, 3]


def test_a_config_that_is_no_advisor_config_is_refused_in_one_line() -> None:
    """``config={"small_model_params": 1}`` was an AttributeError from deep in the advisor."""
    tables = {name: T.empty(name) for name in T.TABLES}
    with pytest.raises(TypeError) as e:
        precprof.recommend(tables, config={"small_model_params": 1})  # type: ignore[arg-type]
    assert str(e.value) == (
        "recommend(config=...) takes a precprof.analysis.advisor.AdvisorConfig or None (the defaults), not dict: "
        "pass config=AdvisorConfig(**{'small_model_params': 1})"
    )
