"""The wheel ships the report templates: build it, install it into a fresh virtual environment (``--no-deps``
on top of the already-installed dependencies) and render a report from there, outside the repository.

The build runs on a copy of the sources in a temporary folder (no build/ or egg-info in the shared tree),
without build isolation (no network needed) and without the build-requirements check: pyproject lists
``wheel``, which setuptools >= 70.1 no longer needs and which need not be installed.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from report_fixtures import gpt_layers, recommendation_dict, synthetic_run

from precprof import tables as T

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = {p.name for p in (ROOT / "reports" / "templates").iterdir() if p.suffix in (".j2", ".css", ".js")}


def build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in ("precprof", "reports"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    dist = tmp / "dist"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--skip-dependency-check",
            "--outdir",
            str(dist),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (wheel,) = dist.glob("precprof-*.whl")
    return wheel


def make_venv(venv: Path) -> Path:
    """A fresh virtual environment that sees this interpreter's installed dependencies but not precprof.

    ``--system-site-packages`` would expose the *base* interpreter's packages, which lack torch when the tests
    themselves run inside a virtual environment (as .ci/run does). Instead the running environment's
    site-packages go into a .pth file: a plain path line adds the folder without processing the .pth files in
    it, so the editable install of precprof there stays invisible, and the wheel installed into the new
    environment's own site-packages comes first on sys.path.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (inner,) = (venv / "lib").glob("python3*/site-packages")
    outer = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if Path(p).is_dir()]
    (inner / "_precprof_test_deps.pth").write_text("".join(f"{p}\n" for p in outer))
    return venv


def test_wheel_ships_templates_and_renders_outside_the_repo(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"precprof/templates/{t}" for t in TEMPLATES} <= names
    assert "precprof/report/render.py" in names and "precprof/py.typed" in names
    # every module of the source tree is in the wheel (a package missing from pyproject's list would not be)
    sources = {
        p.relative_to(ROOT).as_posix() for ext in ("*.py", "*.c") for p in (ROOT / "precprof").rglob(ext)
    }
    assert sources <= names, sorted(sources - names)

    venv = make_venv(tmp_path / "venv")
    py = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )

    run_dir = tmp_path / "elsewhere" / "run"
    tabs, summary = synthetic_run("fp16", layers=gpt_layers(n_layer=1), steps=4, sample_every=2)
    summary[T.SUMMARY_RECOMMENDATION] = recommendation_dict()
    T.write_tables(run_dir, tabs)
    T.write_summary(run_dir, summary)

    probe = textwrap.dedent(
        """
        import json, sys
        import precprof
        from precprof.report import render_run_dir, templates_dir
        out = render_run_dir(sys.argv[1], out=sys.argv[2])
        print(json.dumps({"precprof": precprof.__file__, "templates": str(templates_dir()), "out": str(out)}))
        """
    )
    cwd = tmp_path / "elsewhere"
    res = subprocess.run(
        [str(py), "-c", probe, str(run_dir), str(cwd / "api.html")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    info = json.loads(res.stdout.strip().splitlines()[-1])
    site = (venv / "lib").resolve()
    assert Path(info["precprof"]).resolve().is_relative_to(site), info
    assert Path(info["templates"]).resolve().is_relative_to(site), info
    assert not Path(info["templates"]).resolve().is_relative_to(ROOT.resolve())

    # the console script of the wheel: precprof report RUN_DIR
    subprocess.run([str(venv / "bin" / "precprof"), "report", str(run_dir)], cwd=cwd, check=True, timeout=300)
    for page in (cwd / "api.html", run_dir / T.REPORT_FILE):
        text = page.read_text()
        assert 'id="verdict"' in text and 'id="environment"' in text and text.count("<img ") == 6
        assert 'class="fmt fmt-fp16">FP16' in text
