"""The compiled kernel's cache: private, keyed by what the build depends on, built once across processes, and
never loading a library this user did not build. Every test uses its own cache folder (PRECPROF_CACHE_DIR)
and starts from a process state where the kernel was never loaded."""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import forks
import pytest
from conftest import kernel_required

from precprof import stats
from precprof import tables as T
from precprof.stats import engine
from precprof.stats import kernel as _cpu_kernel
from precprof.stats import kernel_cache as _kernel_cache

CC = _cpu_kernel.find_compiler()
# without a compiler these skip, except in CI (CI or PRECPROF_REQUIRE_KERNEL=1), where they fail
needs_cc = pytest.mark.skipif(CC is None and not kernel_required(), reason="no C compiler here")
posix_only = pytest.mark.skipif(sys.platform == "win32", reason="POSIX owners, modes and FIFOs")


def compiler() -> str:
    """The C compiler, for the tests marked ``needs_cc``: they run without one only where it is required."""
    if CC is None:
        pytest.fail(
            "no C compiler (cc, gcc or clang) on the PATH: required here (CI or PRECPROF_REQUIRE_KERNEL=1)"
        )
    return CC


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("PRECPROF_CACHE_DIR", str(d))
    monkeypatch.setattr(_kernel_cache, "_fallback", None)
    monkeypatch.setattr(_kernel_cache, "_refused", None)
    return d


@pytest.fixture
def fresh(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """As in a new process: the kernel not tried yet (restored after the test)."""
    monkeypatch.delenv("PRECPROF_CPU_KERNEL", raising=False)
    monkeypatch.setattr(_cpu_kernel, "_tried", False)
    monkeypatch.setattr(_cpu_kernel, "_lib", None)
    monkeypatch.setattr(_cpu_kernel, "_status", {"in_use": False, "reason": "not loaded yet"})
    monkeypatch.setattr(engine, "_kernel_state", {})
    return cache


def fake_compile(out: Path) -> None:
    out.write_bytes(b"a library")


def evil_library(tmp_path: Path, out: Path) -> Path:
    """Compile a real shared library whose constructor writes a marker file when it is loaded; the marker."""
    cc = compiler()
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
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return marker


# -- the folder ----------------------------------------------------------------------------------------------


@posix_only
def test_the_cache_folder_is_private(cache: Path) -> None:
    assert _kernel_cache.cache_dir() == cache
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert _kernel_cache.refusal() is None


@posix_only
def test_a_folder_others_can_write_is_not_used(cache: Path) -> None:
    cache.mkdir()
    os.chmod(cache, 0o777)
    with pytest.warns(RuntimeWarning, match="writable by other users") as caught:
        d = _kernel_cache.cache_dir()
    assert str(cache) in str(caught[0].message)  # the warning names the folder
    assert d != cache and stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert "writable by other users" in (_kernel_cache.refusal() or "")
    # the fallback is made once per process, and builds work in it
    assert _kernel_cache.cache_dir() == d
    assert _kernel_cache.build("stats", "k1", fake_compile).parent == d
    assert not list(cache.iterdir())


@posix_only
def test_a_folder_of_another_owner_is_not_used(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(_kernel_cache, "_uid", lambda: os.getuid() + 1)  # as if someone else owned it
    with pytest.warns(RuntimeWarning, match="is owned by uid"):
        assert _kernel_cache.cache_dir() != cache


@posix_only
def test_a_symlinked_folder_is_not_used(cache: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    cache.symlink_to(target)
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        assert _kernel_cache.cache_dir() != cache


@posix_only
def test_a_folder_others_could_rename_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a parent that others can write without the sticky bit, another user could move the folder away and
    put theirs in its place; /tmp's sticky bit forbids that."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("PRECPROF_CACHE_DIR", str(shared / "cache"))
    monkeypatch.setattr(_kernel_cache, "_fallback", None)
    with pytest.warns(RuntimeWarning, match="which other users can write"):
        assert _kernel_cache.cache_dir() != shared / "cache"
    os.chmod(shared, 0o1777)
    assert _kernel_cache.cache_dir() == shared / "cache"


@posix_only
def test_the_fallback_happens_whatever_the_warning_filters(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -W error`` (pytest's ``filterwarnings = error``) and a cache folder that cannot be used (a file
    there, a read-only HOME): the fallback's warning became an exception inside ``Profiler.attach()``, which never
    attached (``precprof train`` called it a bug in precprof). The fallback happens, the warning is shown (not
    raised), once, attributed to the user's line that attached, and it says what is wrong with the folder."""
    import torch

    import precprof

    fresh.write_text("")  # a file where the folder should be
    # no compile here (seconds): a compiler that fails leaves the torch-op path, after the fallback folder
    monkeypatch.setattr(_cpu_kernel, "_compile", lambda *a: (_ for _ in ()).throw(OSError("no compile here")))
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")
        prof = precprof.Profiler(model, sample_every=1, memory=False).attach()  # the user's line
        model(torch.randn(2, 4)).sum().backward()
        prof.step()
        prof.detach()
    said = [w for w in caught if "kernel cache" in str(w.message)]
    assert len(said) == 1 and said[0].category is RuntimeWarning
    assert f"the kernel cache {fresh} is not a directory; building in the private folder" in str(
        said[0].message
    )
    assert said[0].filename == __file__ and "the user's line" in linecache.getline(__file__, said[0].lineno)
    fallback = _kernel_cache.cache_dir()
    assert fallback != fresh and fallback.is_dir() and "is not a directory" in str(_kernel_cache.refusal())
    assert prof.tables()["steps"][T.STEP].tolist() == [0]


# -- what is loaded ------------------------------------------------------------------------------------------


@posix_only
def test_a_planted_library_is_rebuilt_never_loaded(cache: Path) -> None:
    built = _kernel_cache.build("stats", "k1", fake_compile)
    assert built.read_bytes() == b"a library"
    assert stat.S_IMODE(os.stat(built).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(built.with_suffix(".sha256")).st_mode) == 0o600
    built.write_bytes(b"planted")  # same name, other content
    calls: list[Path] = []

    def compile_again(out: Path) -> None:
        calls.append(out)
        fake_compile(out)

    assert not _kernel_cache.trusted(built)
    again = _kernel_cache.build("stats", "k1", compile_again)
    assert calls and again.read_bytes() == b"a library"
    assert _kernel_cache.trusted(again)
    # the right content, but a file others could have written, is not trusted either
    os.chmod(again, 0o766)
    assert not _kernel_cache.trusted(again)


@posix_only
def test_a_symlink_to_a_trusted_library_is_not_trusted(cache: Path, tmp_path: Path) -> None:
    real = _kernel_cache.build("stats", "k1", fake_compile)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    (other / real.name).symlink_to(real)
    shutil.copy(real.with_suffix(".sha256"), other / real.with_suffix(".sha256").name)
    assert _kernel_cache.trusted(real) and not _kernel_cache.trusted(other / real.name)


@posix_only
def test_a_planted_fifo_neither_hangs_nor_loads(cache: Path) -> None:
    cache.mkdir(mode=0o700)
    os.mkfifo(cache / "stats_k1.so")
    os.mkfifo(cache / "stats_k1.sha256")
    lib = _kernel_cache.build("stats", "k1", fake_compile)
    assert lib.read_bytes() == b"a library" and stat.S_ISREG(os.lstat(lib).st_mode)


@needs_cc
@posix_only
@pytest.mark.parametrize("record", ["none", "forged, writable by others"])
def test_a_planted_shared_library_never_runs(fresh: Path, tmp_path: Path, record: str) -> None:
    """A real shared library whose constructor writes a marker, planted under the kernel's exact name, with no
    record of this user's build or with a forged one that others could have written: loading the kernel
    rebuilds it, so the marker never appears."""
    fresh.mkdir(mode=0o700)
    planted = fresh / f"stats_{_cpu_kernel.cache_key(compiler())}.so"
    marker = evil_library(tmp_path, planted)
    if record != "none":
        with open(planted, "rb") as f:
            planted.with_suffix(".sha256").write_text(_kernel_cache._sha256(f) + "\n")
        os.chmod(planted.with_suffix(".sha256"), 0o666)
    lib = _cpu_kernel.load()
    assert lib is not None and hasattr(lib, "pp_call")  # the real kernel, rebuilt
    assert not marker.exists()
    assert _kernel_cache.trusted(planted)  # the rebuilt one, with this user's record


@needs_cc
@posix_only
def test_concurrent_processes_build_once(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three processes (torchrun ranks) start on an empty cache together: one compiles, the others wait on
    the lock and load its library. (Forks of tests/forks.py's Python, which has imported torch and not loaded
    the kernel: processes of their own, each with its own lock, without a fresh Python's 2 s of CPU apiece.)"""
    compiler()
    probe = textwrap.dedent(
        """
        import os, sys, time
        from precprof.stats import kernel as _cpu_kernel
        count, ready, go = sys.argv[1:]
        assert not _cpu_kernel._tried  # (a fork of a Python that loaded it would load no other)
        real = _cpu_kernel._compile
        def counting(cc, src, out):
            with open(count, "a") as f:
                f.write("x")
            time.sleep(1.0)  # a slow compiler: the others arrive while it runs
            real(cc, src, out)
        _cpu_kernel._compile = counting
        with open(ready, "a") as f:
            f.write("r")
        while not os.path.exists(go):
            time.sleep(0.01)
        lib = _cpu_kernel.load()
        st = _cpu_kernel.status()
        print(st["path"] if lib is not None and lib.pp_openmp() in (0, 1) else st)
        """
    )
    count, ready, go = tmp_path / "count", tmp_path / "ready", tmp_path / "go"
    env = {**os.environ, "PRECPROF_CACHE_DIR": str(cache)}
    env.pop("PRECPROF_CPU_KERNEL", None)
    # read when the kernel loads, not as precprof or torch load: the worker's server serves the probes
    monkeypatch.setattr(forks, "_RUNTIME_ENV", forks._RUNTIME_ENV | {"PRECPROF_CACHE_DIR"})
    args = [sys.executable, "-c", probe, str(count), str(ready), str(go)]
    procs = [forks.popen(args, env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        import time

        deadline = time.monotonic() + 240
        while (not ready.exists() or len(ready.read_text()) < 3) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a probe process died before the start"
            time.sleep(0.05)
        go.touch()
        outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    libs = list(cache.glob("stats_*.so"))
    assert len(libs) == 1 and outs == [str(libs[0])] * 3
    assert count.read_text() == "x"  # one build
    assert not list(cache.glob(".stats-build-*"))  # its private folder removed


@posix_only
def test_the_lock_has_a_fallback_without_fcntl(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernel_cache, "fcntl", None)
    monkeypatch.setattr(_kernel_cache, "msvcrt", None)
    assert _kernel_cache.trusted(_kernel_cache.build("stats", "k1", fake_compile))


# -- the key ---------------------------------------------------------------------------------------------------


def test_the_compiler_version_is_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernel_cache, "compiler_identity", lambda cc: "/usr/bin/cc gcc 12.2.0")
    a = _cpu_kernel.cache_key("cc")
    monkeypatch.setattr(_kernel_cache, "compiler_identity", lambda cc: "/usr/bin/cc gcc 13.1.0")
    assert _cpu_kernel.cache_key("cc") != a


@posix_only
def test_a_new_compiler_version_changes_the_key(tmp_path: Path) -> None:
    """Through the real ``--version`` call: a compiler upgraded in place (same path) gets a new key."""
    fake = tmp_path / "fakecc"

    def install(version: str) -> None:
        fake.write_text(f"#!/bin/sh\necho 'fakecc (Fake) {version}'\n")
        fake.chmod(0o755)

    install("12.2.0")
    old = _cpu_kernel.cache_key(str(fake))
    assert _cpu_kernel.cache_key(str(fake)) == old  # stable
    install("13.1.0")
    assert _cpu_kernel.cache_key(str(fake)) != old
    assert "fakecc (Fake) 13.1.0" in _kernel_cache.compiler_identity(str(fake))


def test_the_openmp_runtime_is_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernel_cache, "compiler_identity", lambda cc: "/usr/bin/cc gcc 12.2.0")
    monkeypatch.setattr(_cpu_kernel, "_openmp_identity", lambda cc: "/usr/lib/libgomp.so.1.0.0 290392 1")
    a = _cpu_kernel.cache_key("cc")
    monkeypatch.setattr(_cpu_kernel, "_openmp_identity", lambda cc: "/usr/lib/libgomp.so.1.0.0 290400 2")
    assert _cpu_kernel.cache_key("cc") != a


@needs_cc
def test_compiler_identity_names_the_version() -> None:
    cc = compiler()
    ident = _kernel_cache.compiler_identity(cc)
    assert os.path.realpath(shutil.which(cc) or cc) in ident and any(ch.isdigit() for ch in ident)


# -- when it is built, and what precprof env says ----------------------------------------------------------


def test_the_kernel_is_built_when_the_profiler_attaches(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler runs inside a training step: attach() builds the kernel, the first sampled step finds it
    ready."""
    import torch
    from torch import nn

    import precprof

    compiles: list[Path] = []
    real = _cpu_kernel._compile

    def counting(cc: str, src: Path, out: Path) -> None:
        compiles.append(out)
        real(cc, src, out)

    monkeypatch.setattr(_cpu_kernel, "_compile", counting)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    prof = precprof.Profiler(model, sample_every=1, memory=False)
    assert "lib" not in engine._kernel_state and not compiles
    with prof:
        ready = "lib" in engine._kernel_state
        built_at_attach = list(compiles)
        monkeypatch.setattr(_kernel_cache, "build", lambda *a, **k: pytest.fail("compiled inside a step"))
        monkeypatch.setattr(_cpu_kernel, "_compile", lambda *a, **k: pytest.fail("compiled inside a step"))
        model(torch.randn(4, 8)).sum().backward()
        prof.step()
    assert ready
    if CC is not None or kernel_required():
        assert len(built_at_attach) == 1 and _cpu_kernel.status()["in_use"]
        assert list(fresh.glob("stats_*.so"))  # in the test's cache, never the user's
    assert not prof.tables()["layers"].empty


def _env(*args: str, capsys: pytest.CaptureFixture[str]) -> str:
    from precprof import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["env", *args])
    assert e.value.code in (0, None)
    return capsys.readouterr().out


def test_env_says_whether_the_kernel_is_in_use(fresh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _env(capsys=capsys)
    assert f"CPU kernel cache: {fresh}" in out
    assert "statistics engine (PRECPROF_STATS_ENGINE=auto):\n  CPU: " in out
    engine = stats.engine_status()
    assert ("C kernel" in out) == (engine["cpu"] == "c")
    if engine["cpu"] == "c":
        assert f"{engine['path']}, threads: " in out
        assert str(engine["path"]).startswith(str(fresh))
        # (it said "not created yet" of the folder it had just built the kernel in)
        assert f"CPU kernel cache: {fresh} (private to this user)" in out
    else:
        assert str(engine["reason"]) in out
        assert not kernel_required(), engine["reason"]


def test_env_json_names_the_engine_and_its_cache(fresh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(_env("--json", capsys=capsys))
    engine = doc["stats_engine"]
    assert engine["cpu"] in ("c", "torch") and "reason" in engine
    if engine["cpu"] == "c":
        assert engine["cache"] == str(fresh) and "cache_refused" not in engine
        assert engine["in_use"] is True and engine["threads"]


def test_env_says_when_the_kernel_is_disabled(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PRECPROF_CPU_KERNEL", "0")
    out = _env(capsys=capsys)
    assert "  CPU: torch ops (C kernel: disabled by PRECPROF_CPU_KERNEL=0)" in out
    assert "  CUDA: " in out


@posix_only
def test_env_says_when_the_cache_folder_is_refused(fresh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh.mkdir()
    os.chmod(fresh, 0o777)
    builds = CC is not None or kernel_required()  # without a compiler nothing is built, so nothing warns
    with (
        pytest.warns(RuntimeWarning, match="writable by other users") if builds else contextlib.nullcontext()
    ):
        out = _env(capsys=capsys)
    assert f"CPU kernel cache: {fresh} (not used: it is writable by other users (mode 777)" in out
    engine = stats.engine_status()
    if engine["cpu"] == "c":
        assert "writable by other users" in str(engine["cache_refused"])
        assert not str(engine["path"]).startswith(str(fresh))


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``XDG_CACHE_HOME=relcache`` (or a literal ``~/x``) made a kernel cache, and a build, in each working folder;
    the XDG spec says to ignore a relative value."""
    monkeypatch.delenv("PRECPROF_CACHE_DIR", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    for relative in ("relcache", "~/tilde"):
        monkeypatch.setenv("XDG_CACHE_HOME", relative)
        assert _kernel_cache.default_dir() == Path.home() / ".cache" / "precprof"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _kernel_cache.default_dir() == tmp_path / "precprof"


def test_env_before_the_cache_exists(fresh: Path) -> None:
    from precprof import hardware

    assert f"CPU kernel cache: {fresh} (not created yet" in hardware.env_report()
    assert not fresh.exists()  # env_report only looks


def test_a_notice_under_an_error_filter_is_shown_once_per_place() -> None:
    """Under an "error" filter a notice is shown, not raised; it was shown on every call from one place (a per-step
    path repeated it each step), where "default" shows it once (reviewer r1)."""
    from precprof._notice import notice

    for error in (True, False):
        with warnings.catch_warnings(record=True) as log:
            warnings.resetwarnings()
            warnings.simplefilter("error" if error else "default")
            for _ in range(3):
                notice(f"precprof: one notice from one place ({error})")
        assert len(log) == 1, (error, [str(w.message) for w in log])
