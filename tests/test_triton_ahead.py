"""The compile in another process (``stats/triton_ahead.py``): it compiles for a GPU's target without a GPU,
into Triton's on-disk cache, so that the training's process then finds every kernel there.

On the CPU the other process compiles for sm_90 for real (ptxas comes with Triton); that the training's own
process on a GPU then hits the cache is ``test_stats_gpu``'s to show, where the real driver runs.

One spec's kernels are compiled once for the module (``sm90``: 4 row kernels and the block kernels, 6-7 s of CPU),
and its cache copied where a test needs it (a row kernel takes 1.5 s of CPU to compile for sm_90).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from precprof.stats import blocks, triton_ahead, triton_engine
from precprof.stats.layout import LAYOUT

pytestmark = [
    pytest.mark.skipif(
        triton_engine.triton_missing() is not None, reason=str(triton_engine.triton_missing())
    ),
    # under pytest-xdist, the module's tests on one worker: ``sm90``'s compile once (the mark only where
    # pytest-xdist, which knows it, runs the tests)
    *([pytest.mark.xdist_group("triton-ahead")] if os.environ.get("PYTEST_XDIST_WORKER") else []),
]


def _files(root: Path) -> set[str]:
    """The cache's files, without the markers of what precprof compiled ahead (``done_marker``)."""
    return {
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.parent.name != "precprof-ahead"
    }


def _spec(**kw: object) -> triton_ahead.Ahead:
    args: dict = dict(
        capability=(9, 0),
        layout=LAYOUT,
        dtypes=(torch.float32, torch.bfloat16),
        block=triton_engine.BLOCK,
        num_warps=triton_engine.NUM_WARPS,
        rare_after=triton_engine.RARE_AFTER,
        block_dtypes=(torch.float32,),
        recipes=tuple(blocks.RECIPES),
    )
    args.update(kw)
    return triton_ahead.Ahead(**args)


@pytest.fixture(scope="module")
def sm90(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str | None]:
    """A cache filled by the other process with ``_spec(dtypes=(torch.float32,))`` (the row kernels of one
    dtype, the block kernels): its folder (the tests copy it) and what ``compile_ahead`` said."""
    root = tmp_path_factory.mktemp("sm90")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(root))
        return root, triton_ahead.compile_ahead(_spec(dtypes=(torch.float32,)))


def test_the_other_process_fills_the_cache_and_a_second_finds_every_kernel_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sm90: tuple[Path, str | None]
) -> None:
    """Compiled for sm_90 in another process (no GPU, the interpreter off there): the row kernels of a dtype
    (4 variants), the block kernels and the weight-update samples' land in the cache given by TRITON_CACHE_DIR, with their cubins; the
    same spec compiled again writes nothing (every kernel a hit), and other rows (another block) are other
    kernels. (One dtype: each kernel's compile for sm_90 takes seconds of the suite.)"""
    filled, said = sm90
    assert said is None
    shutil.copytree(filled, tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fp32 = _spec(dtypes=(torch.float32,))
    first = _files(tmp_path)
    cubins = [f for f in first if f.endswith(".cubin")]
    assert len(cubins) >= 4 + 1, sorted(first)  # 4 row variants, at least one block kernel
    # every kernel that finishes in its last program: one ordered atomic (the counter of programs done) and
    # every other global atomic relaxed (at the default, acq_rel, each cost the program a fence: a launch of a
    # 768-value tensor took 12.8 us on an H200)
    row_ptx = [f for f in first if f.endswith(("_rows.ptx", "_rows_many.ptx"))]
    assert len(row_ptx) == 4, row_ptx
    for ptx in row_ptx + [f for f in first if f.endswith("_blocks.ptx")]:
        ops = re.findall(r"^\s*(?:@%p\d+\s+)?((?:atom|red)\.global\S*)", (tmp_path / ptx).read_text(), re.M)
        ordered = [op for op in ops if ".relaxed" not in op]
        assert [op for op in ordered if ".acq_rel" in op and ".add" in op] == ordered and len(ordered) == 1, (
            ptx,
            ordered,
        )
    # the weight-update samples' two kernels (``triton_updates``), for fp32 members: no arithmetic of theirs
    # flushes a subnormal update or weight to zero (as the torch path's does not)
    updates = [f for f in first if f.endswith(("_read.ptx", "_classify.ptx"))]
    assert len(updates) == 2, sorted(first)
    for ptx in updates:
        assert ".ftz" not in (tmp_path / ptx).read_text(), ptx
    t0 = time.perf_counter()
    assert triton_ahead.compile_ahead(fp32) is None
    again_s = time.perf_counter() - t0
    assert _files(tmp_path) == first
    assert triton_ahead.compile_ahead(_spec(block=2048, dtypes=(torch.float32,), block_dtypes=())) is None
    more = _files(tmp_path) - first
    assert len([f for f in more if f.endswith(".cubin")]) == 4  # the dtype's 4 row variants, anew
    assert again_s < 60  # a lookup, not a compile (no timing claim beyond "did not hang")


def test_a_failure_of_the_other_process_is_one_line_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target Triton cannot compile for (capability 0.0) fails in the other process; the caller gets a
    one-line reason, no exception, and the cache holds no kernel of it."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    why = triton_ahead.compile_ahead(_spec(capability=(0, 0), block_dtypes=()))
    assert why is not None and why.startswith("exit ") and "\n" not in why
    assert not [f for f in _files(tmp_path) if f.endswith(".cubin")]
    assert triton_ahead.compile_ahead(_spec(), timeout_s=0.01) is not None  # a timeout, reported
    unpicklable = _spec(recipes=(lambda: None,))
    why = triton_ahead.compile_ahead(unpicklable)
    assert why is not None and "\n" not in why and "pickle" in why.lower()


def test_the_other_process_compiles_at_the_lowest_priority() -> None:
    """The other process lowers its own priority first (its ptxas processes inherit it), so that its compiles
    take only the CPUs the training leaves: ``main`` says the niceness it compiled at."""
    import os
    import pickle
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import sys, precprof.stats.triton_ahead as t; sys.exit(t.main())"],
        input=pickle.dumps(_spec(dtypes=(), block_dtypes=())),
        env={
            k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PRECPROF_HELPER_NICENESS")
        },
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.decode().split() == ["0", "kernels", "at", "niceness", str(triton_ahead.NICENESS)]


def test_spec_of_names_what_the_rows_compile() -> None:
    """``spec_of`` takes the rows' layout and kernel shape, so that the other process compiles the very
    variants the training's process will ask for."""
    rows = triton_engine.TritonRows(torch.device("cpu"), LAYOUT, block=1024, num_warps=8, rare_after=False)
    spec = triton_ahead.spec_of(rows, (9, 0), [torch.float16], [torch.float16], blocks.RECIPES)
    assert (spec.layout, spec.block, spec.num_warps, spec.rare_after) == (LAYOUT, 1024, 8, False)
    assert not spec.planes  # (the rare values inline: tl.histogram)
    planes = triton_engine.TritonRows(torch.device("cpu"), LAYOUT)
    assert triton_ahead.spec_of(planes, (9, 0), [torch.float16], [], ()).planes == triton_engine.PLANES
    assert spec.dtypes == (torch.float16,) and spec.recipes == tuple(blocks.RECIPES)


def test_the_buffers_background_warm_runs_it_first_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sm90: tuple[Path, str | None]
) -> None:
    """``StatsBuffer``'s warm with ``ahead`` (the background warm on CUDA) runs the other process inside the
    compile lock, before its own compiles, and records it as the phase "ahead"; a failure there is
    ``ahead_error`` and the warm goes on (here: the interpreter's, the rows right either way)."""
    from precprof.stats import StatsBuffer

    # ``sm90``'s cache less one of its row kernels: the other process compiles that one, for sm_90, and finds
    # the others (the first dtype's row kernels of the warm's spec are the very kernels of ``sm90``'s)
    filled, said = sm90
    assert said is None
    shutil.copytree(filled, tmp_path, dirs_exist_ok=True)
    (gone,) = {p.parent for p in tmp_path.rglob("_rows_many.cubin")}
    shutil.rmtree(gone)
    assert not gone.exists()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    buf = StatsBuffer(2, "cpu", engine="triton", host_rows=False, dtypes=[torch.float32])
    part = buf.primary
    asked: list[triton_ahead.Ahead] = []
    real = triton_ahead.compile_ahead

    def ahead(spec: triton_ahead.Ahead, *a: object) -> str | None:
        asked.append(spec)
        # the other process really runs and compiles for sm_90, one dtype's four row kernels of what the warm
        # asked for (all of it, the three dtypes' row and block kernels, takes 20-35 s of the suite; the first
        # test compiles a whole spec): three found in the cache, the fourth compiled
        one = dataclasses.replace(spec, dtypes=spec.dtypes[:1], block_dtypes=())
        return real(one) if len(asked) == 1 else "exit 1: RuntimeError: no"

    monkeypatch.setattr(triton_ahead, "compile_ahead", ahead)
    for want_error in (None, "exit 1: RuntimeError: no"):
        buf._triton_warm(part, ahead=True)  # type: ignore[arg-type]
        assert buf.ahead_error == want_error
        phases = buf.warm_phases
        assert list(phases) == ["wait", "ahead", "compile", "load", "check"]
        assert phases["wait"][1] == phases["ahead"][0] and phases["ahead"][1] == phases["compile"][0]
    assert asked[0].dtypes == buf.dtypes and asked[0].layout == buf.layout  # the whole spec, asked for
    assert _files(tmp_path) == _files(filled)  # the first really compiled the missing kernel, for sm_90
    x = torch.linspace(-3, 3, 1000)
    buf.accumulate(x, 0)
    ref = StatsBuffer(1, "cpu", engine="c")
    ref.accumulate(x, 0)
    assert (buf.to_host()[0] == ref.to_host()[0]).all()


_EXIT_SCRIPT = r"""
import atexit, sys, time
import torch
from precprof.stats import StatsBuffer, buffer, triton_ahead
torch.cuda.get_device_capability = lambda device=None: (9, 0)  # the other process compiles for an H100's target
buf = StatsBuffer(2, "cpu", engine="triton", host_rows=False, dtypes=[torch.float32])
said = []
# registered before the compile's own exit handler, so run after it (atexit runs the last registered first)
atexit.register(lambda: said.append(("after", buf.warm_error, thread.is_alive())) or print(said))
thread = buffer._start_beside(buf._warm_beside, buf.primary, True)  # the compile beside a CUDA training
t0 = time.monotonic()
while not triton_ahead._RUNNING and time.monotonic() - t0 < 60:
    time.sleep(0.01)
print("child", [p.pid for p in triton_ahead._RUNNING], flush=True)
sys.exit(0)  # the training ends while the other process compiles
"""


def test_an_exit_during_the_compile_beside_the_training_ends_it_first(tmp_path: Path) -> None:
    """A process that exits while its kernels compile in another process (a 3-step run; the compile takes
    seconds to tens of them): the other process is killed at once instead of compiling on for nobody, the
    thread waiting for it skips its own compile and ends before the interpreter finalises (a daemon thread left
    inside Triton's C++ aborted an H200's process at exit: "terminate called without an active exception"),
    and the process exits 0. With an empty cache the compile would take many seconds; the exit takes the
    imports' time."""
    import subprocess
    import sys

    # the rows on the CPU in Triton's interpreter; the other process compiles for sm_90 into an empty cache
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    (child,) = [line for line in lines if line.startswith("child")]
    pids = [int(p) for p in re.findall(r"\d+", child)]
    assert len(pids) == 1, lines
    # the handler after the compile's: the thread ended, the warm said why
    assert lines[-1] == repr([("after", f"RuntimeError: {triton_ahead.CANCELLED}", False)]), lines
    # the other process was killed, not left compiling (an orphan is reparented and reaped: gone, or a zombie)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pids[0]}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the other process {pids[0]} is still running after the exit")
    assert not [f for f in _files(tmp_path) if f.endswith(".cubin")]  # it compiled nothing to the end


def test_a_spec_compiled_into_this_cache_before_starts_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sm90: tuple[Path, str | None]
) -> None:
    """The other process's start and imports took 7 s of a warm-cache run on an H200 (66 steps unsampled): a
    spec an earlier run compiled into the same Triton cache (its marker there, left after the compile) starts
    none. Another cache, or a spec that differs, compiles as before; a wiped cache takes the marker with it."""
    import subprocess

    filled, said = sm90
    assert said is None
    shutil.copytree(filled, tmp_path / "warm")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "warm"))
    fp32 = _spec(dtypes=(torch.float32,))
    marker = triton_ahead.done_marker(fp32)
    assert marker is not None and marker.is_file() and marker.parent.parent == tmp_path / "warm"
    started: list[object] = []
    real = subprocess.Popen

    def popen(*a: object, **k: object) -> object:
        started.append(a)
        return real(*a, **k)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "Popen", popen)
    assert triton_ahead.compile_ahead(fp32) is None and started == []  # warm: no process
    other = _spec(dtypes=(torch.float32,), num_warps=8, block_dtypes=())
    assert triton_ahead.done_marker(other) != marker
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cold"))
    assert triton_ahead.done_marker(fp32) != marker
    assert triton_ahead.compile_ahead(_spec(dtypes=(), block_dtypes=())) is None and len(started) == 1
    assert triton_ahead.done_marker(_spec(dtypes=(), block_dtypes=())).is_file()  # type: ignore[union-attr]


def test_an_exit_waits_for_a_compile_already_inside_the_process_and_says_so() -> None:
    """A compile beside the training already inside this process at exit (Triton's C++, here a sleep standing
    in for it) is waited for rather than abandoned to finalisation, and the wait is said in one line, so that
    it does not read as a hang; the process exits 0 once it is done."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from precprof.stats import buffer\n"
        "buffer._start_beside(time.sleep, 2.5)\n"
        "time.sleep(0.2)\n"
    )
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "precprof: finishing its statistics kernels' compile before the exit (at most 60 s)"
    )
    assert took >= 2.5  # it waited for the thread
