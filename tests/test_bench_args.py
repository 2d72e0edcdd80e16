"""The CPU benches' command lines: a configuration name they do not know is one line naming it and the known
ones, before any model is built (bench/overhead.py raised a KeyError traceback after building its model)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("bench", "argv", "says"),
    [
        (
            "overhead",
            ["--configs", "baseline,precprof"],
            "unknown configuration precprof; choose from baseline,",
        ),
        (
            "host_cost",
            ["--configs", "baseline,sampeld"],
            "unknown configuration sampeld; choose from baseline,",
        ),
        (
            "host_cost",
            ["--configs", "baseline", "--cprofile", "sampled"],
            "--cprofile 'sampled' is not among --configs (baseline)",
        ),
    ],
)
def test_an_unknown_configuration_is_one_line(
    bench: str, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _load(bench)
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if ": error: " in ln]) == 1, err  # (argparse's usage above it)
