"""The compiled kernel's cache: private, keyed by what the build depends on, built once across processes, and
never loading a library this user did not build. Every test uses its own cache folder (PRECPROF_CACHE_DIR)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import kernel_required

from precprof import _cpu_kernel, _kernel_cache

CC = _cpu_kernel.find_compiler()
needs_cc = pytest.mark.skipif(CC is None and not kernel_required(), reason="no C compiler here")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("PRECPROF_CACHE_DIR", str(d))
    monkeypatch.setattr(_kernel_cache, "_fallback", None)
    return d


def fake_compile(out: Path) -> None:
    out.write_bytes(b"a library")


def test_the_cache_folder_is_private(cache: Path) -> None:
    assert _kernel_cache.cache_dir() == cache
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700


def test_a_folder_others_can_write_is_not_used(cache: Path) -> None:
    cache.mkdir()
    os.chmod(cache, 0o777)
    with pytest.warns(RuntimeWarning, match="writable by other users"):
        d = _kernel_cache.cache_dir()
    assert d != cache and stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_a_folder_of_another_owner_is_not_used(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(_kernel_cache, "_uid", lambda: os.getuid() + 1)  # as if someone else owned it
    with pytest.warns(RuntimeWarning, match="is owned by uid"):
        assert _kernel_cache.cache_dir() != cache


def test_a_symlinked_folder_is_not_used(cache: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    cache.symlink_to(target)
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        assert _kernel_cache.cache_dir() != cache


def test_a_planted_library_is_rebuilt_never_loaded(cache: Path) -> None:
    built = _kernel_cache.build("stats", "k1", fake_compile)
    assert built.read_bytes() == b"a library"
    built.write_bytes(b"planted")  # same name, other content
    calls: list[Path] = []

    def compile_again(out: Path) -> None:
        calls.append(out)
        fake_compile(out)

    assert not _kernel_cache.trusted(built)
    again = _kernel_cache.build("stats", "k1", compile_again)
    assert calls and again.read_bytes() == b"a library"
    # a library placed with a forged record is not trusted either when others could have written it
    os.chmod(again, 0o766)
    assert not _kernel_cache.trusted(again)


@needs_cc
def test_a_planted_shared_library_never_runs(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real shared library whose constructor writes a marker, planted under the kernel's exact name: loading
    the kernel must rebuild it, so the marker never appears."""
    assert CC is not None
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.c"
    src.write_text(
        textwrap.dedent(
            f"""
            #include <stdio.h>
            __attribute__((constructor)) static void evil(void) {{
                FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}
            }}
            """
        )
    )
    key = _cpu_kernel.cache_key(CC)
    cache.mkdir(mode=0o700)
    planted = cache / f"stats_{key}.so"
    subprocess.run([CC, "-shared", "-fPIC", str(src), "-o", str(planted)], check=True)
    monkeypatch.setattr(_cpu_kernel, "_tried", False)
    monkeypatch.setattr(_cpu_kernel, "_lib", None)
    lib = _cpu_kernel.load()
    assert lib is not None and hasattr(lib, "pp_call")  # the real kernel, rebuilt
    assert not marker.exists()


@needs_cc
def test_concurrent_processes_build_once(cache: Path) -> None:
    """Three processes (torchrun ranks) start on an empty cache together: one compiles, all load it."""
    probe = textwrap.dedent(
        """
        from precprof import _cpu_kernel, _kernel_cache
        real = _cpu_kernel._compile
        def counting(cc, src, out):
            with open(__import__("os").environ["COUNT_FILE"], "a") as f:
                f.write("x")
            real(cc, src, out)
        _cpu_kernel._compile = counting
        lib = _cpu_kernel.load()
        print("loaded" if lib is not None and lib.pp_openmp() in (0, 1) else _cpu_kernel.status())
        """
    )
    count = cache.parent / "count"
    env = {**os.environ, "PRECPROF_CACHE_DIR": str(cache), "COUNT_FILE": str(count)}
    procs = [
        subprocess.Popen([sys.executable, "-c", probe], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert outs == ["loaded"] * 3
    assert count.read_text() == "x"
    assert len(list(cache.glob("stats_*.so"))) == 1 and not list(cache.glob(".stats-build-*"))


def test_the_compiler_version_is_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernel_cache, "compiler_identity", lambda cc: "/usr/bin/cc gcc 12.2.0")
    a = _cpu_kernel.cache_key("cc")
    monkeypatch.setattr(_kernel_cache, "compiler_identity", lambda cc: "/usr/bin/cc gcc 13.1.0")
    assert _cpu_kernel.cache_key("cc") != a


@needs_cc
def test_compiler_identity_names_the_version() -> None:
    assert CC is not None
    ident = _kernel_cache.compiler_identity(CC)
    assert os.path.realpath(shutil.which(CC) or CC) in ident and any(ch.isdigit() for ch in ident)


def test_the_kernel_is_built_when_the_profiler_attaches(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler runs inside a training step: the first sampled step finds the kernel ready."""
    import torch
    from torch import nn

    import precprof
    from precprof import stats

    monkeypatch.setattr(stats, "_kernel_state", {})  # as in a fresh process
    monkeypatch.setattr(_cpu_kernel, "_tried", False)
    monkeypatch.setattr(_cpu_kernel, "_lib", None)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    prof = precprof.Profiler(model, sample_every=1, memory=False)
    assert "lib" not in stats._kernel_state
    with prof:
        ready = "lib" in stats._kernel_state
        monkeypatch.setattr(_kernel_cache, "build", lambda *a, **k: pytest.fail("compiled inside a step"))
        monkeypatch.setattr(_cpu_kernel, "_compile", lambda *a, **k: pytest.fail("compiled inside a step"))
        model(torch.randn(4, 8)).sum().backward()
        prof.step()
    assert ready
    assert not prof.tables()["layers"].empty


def test_env_says_whether_the_kernel_is_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    from precprof import cli, stats

    with pytest.raises(SystemExit):
        cli.main(["env"])
    out = capsys.readouterr().out
    assert "CPU statistics engine:" in out
    engine = stats.engine_status()
    assert ("C kernel" in out) == (engine["cpu"] == "c")
    if engine["cpu"] != "c":
        assert str(engine["reason"]) in out
