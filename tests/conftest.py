"""Shared test configuration: GPU-marked tests skip without CUDA; small helpers for single-threaded runs."""

from __future__ import annotations

import gc
import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import processes
import pytest
import torch

# The processes tests start (``precprof train``, the stream's workers, the benches' dry runs) train tiny models on
# a machine whose cores the pytest workers already share: one intra-op thread each, never two spinning OpenMP
# threads per process on 2 cores; and so do the tests in this process (torch started before the variable was set:
# its thread count is set here too), which took about a tenth more CPU with two (tests/test_capture.py and three
# more under -n 2, 71-72 s against 77-80 s of user time) and a compiled run's time swung 5x from one run to the next
# (tests/test_bench_fp8.py). The C kernel's multi-threaded paths are tested with their threads set
# (tests/test_stats.py's threads=2 and 3, tests/test_block_engines.py's threads=2), not with torch's default.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# Runs the tests compare on speed are trained while the suite's other workers come and go: the load a run was timed
# under differs from its twin's by a core or more, and compare (rightly) takes no speed-up then. The measurement is
# off for the suite (tests/test_machine_load.py turns it on), in this process and those it starts.
os.environ["PRECPROF_MACHINE_LOAD"] = "0"

# Without CUDA the Triton engine's kernels run on CPU tensors in Triton's interpreter. It must be chosen before
# anything imports triton (transformers and lightning do): set after, nested @triton.jit calls fail.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The block-format what-if costs about a third of a sampled step (bench/overhead.py measures it); the suite
# keeps to its time budget by leaving it off in profiled runs that do not test it. The tests that do
# (test_block_engines.py, test_block_advice.py's real run) turn it on with the ``block_formats_on`` fixture.
os.environ.setdefault("PRECPROF_BLOCK_FORMATS", "0")

# precprof's helper processes (the stream's writer, the Triton compile beside the training) lower their priority to
# take only the CPU the training leaves; under pytest-xdist every core is a busy worker, so a helper at niceness 19
# got next to none, and a test waiting on its writer waited for the other worker's test (42 s of wall time for 17 of
# CPU). The tests of the lowering itself unset it.
os.environ.setdefault("PRECPROF_HELPER_NICENESS", "0")


@pytest.fixture(autouse=True)
def _no_started_process_outlives_its_test() -> Iterator[None]:
    """The processes a test started with ``processes.popen`` are killed when it ends (a failed one too)."""
    yield
    processes.reap()


_REAL_EXIT = sys.exit


@pytest.fixture(autouse=True)
def _sys_exit_as_it_was() -> Iterator[None]:
    """``sys.exit`` put back after each test: ``wandb.init`` (the dashboards' tests) replaces it for the rest of the
    process with a hook whose default code is 0, so a model's ``sys.exit()`` in a later test of the same worker
    raised ``SystemExit(0)`` and read "sys.exit(0)" (test_faults' compare test failed after them in CI)."""
    sys.exit = _REAL_EXIT  # (a module-scoped fixture's wandb.init may have replaced it before the test began)
    yield
    sys.exit = _REAL_EXIT


@pytest.fixture
def block_formats_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profilers made in the test evaluate the block formats (the suite's default is off, see above)."""
    monkeypatch.setenv("PRECPROF_BLOCK_FORMATS", "1")


@pytest.fixture
def interpreter_loads(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Every address Triton's interpreter loads from in the test (masked-off lanes not counted), how often."""
    from triton.runtime import interpreter

    reads: Counter[int] = Counter()
    real = interpreter.InterpreterBuilder.create_masked_load

    def counted(self: object, ptrs: Any, mask: Any, *args: object) -> object:
        reads.update(ptrs.data[mask.data].tolist())
        return real(self, ptrs, mask, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counted)
    return reads


# Modules whose module- or session-scoped fixtures train or start processes for seconds (the distributed run,
# the real runs of the report's pages, the fp8 runs): under pytest-xdist each worker given one of their tests ran
# those fixtures again (the distributed run twice, 18 s each). Their tests go to one worker, per group; the two
# report modules share theirs, since both read ``real_run``'s runs from the worker's base directory.
SHARED_FIXTURES = {
    "test_distributed.py": "distributed",
    "test_fp8_eligibility.py": "fp8-runs",
    "test_report.py": "report-runs",
    "test_report_browser.py": "report-runs",
    "test_compare.py": "compare-runs",
    "test_export.py": "export-runs",
    "test_block_training.py": "block-training-runs",
}


def _compile_sources() -> None:
    """Byte-compile precprof and the tests' modules into their ``__pycache__`` once, before any worker starts.
    The suite starts hundreds of Python processes that import precprof (``precprof train``, the stream's writer,
    the benches' dry runs); where PYTHONDONTWRITEBYTECODE is set (the 2-core machine of these numbers sets it)
    none of them keeps the bytecode it compiles, and each compiled precprof from its sources again, about 0.3 s
    a process: tests/test_faults.py took 71-74 s under -n 2 without these files, 62-67 s with them. A read-only
    tree is left as it is; Python checks each file against its source's time and size."""
    import compileall
    import contextlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for name in ("precprof", "tests"):
        with contextlib.suppress(OSError):
            compileall.compile_dir(root / name, quiet=2)


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compiles the sources (``_compile_sources``). Under ``--dist loadgroup`` a pytest-xdist worker names
    each grouped test ``nodeid@group`` by writing ``item._nodeid``; pytest 9.2 reads node ids from elsewhere
    (pytest-xdist issue 1386), so the groups are silently not kept (the GPU tests would share the device with
    others, the fixtures above run twice). Refuse, with the fix, rather than run ungrouped."""
    if not hasattr(config, "workerinput"):
        _compile_sources()
    if config.getoption("dist", "no") != "loadgroup" or hasattr(config, "workerinput"):
        return
    import inspect

    from xdist import remote

    try:
        writes = "_nodeid" in inspect.getsource(remote.WorkerInteractor.pytest_collection_modifyitems)
        reads = "_nodeid" in inspect.getsource(pytest.Item.nodeid.fget)  # type: ignore[attr-defined]
    except (OSError, TypeError, AttributeError):  # installed without sources, or changed: nothing to tell
        return
    if writes and not reads:
        raise pytest.UsageError(
            f"pytest {pytest.__version__} drops pytest-xdist's test groups (xdist issue 1386): "
            "install the test extra's pytest (pip install 'pytest<9.2')"
        )


def pytest_collection_finish(session: pytest.Session) -> None:
    """The objects of every import the collection made (torch, pandas, matplotlib, transformers: some 400,000)
    moved out of the garbage collector's reach: each of its full collections read them all again, a fifth of the
    suite's CPU (test_report.py: 20 s of 75). They live as long as the process anyway; what the tests make is
    collected as before."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Given back to the collector before the interpreter ends: nanobind (Triton's bindings) counts the objects
    of its own still alive then, and printed each frozen one as leaked."""
    gc.unfreeze()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (its loadgroup names nodes by them)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [item for item in items if "gpu" in item.keywords]
    for item in items:
        group = SHARED_FIXTURES.get(item.path.name)
        if group is not None and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        # under pytest-xdist (-n, --dist loadgroup) the GPU tests share one worker: they measure the device's
        # memory and time, which tests running beside them on the same device would change
        for item in gpu:
            item.add_marker(pytest.mark.xdist_group("gpu"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Run a module's tiny models on one CPU thread, restoring the setting afterwards.

    Intra-op parallelism brings nothing to models this small, and on a shared, busy machine two spinning
    OpenMP threads made a gpt-nano step 20x slower than one.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps a process-wide AcceleratorState that refuses a second, different mixed_precision:
    reset it after every test that created one, so that tests of Trainer/Accelerator run in any order."""
    yield
    import sys

    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


def kernel_required() -> bool:
    """Whether a missing C kernel fails its tests instead of skipping them: where CI is set (CI services set
    CI=true; an empty value, 0, false and no count as unset) or PRECPROF_REQUIRE_KERNEL=1 (.ci/run sets it).
    The suite must never pass in CI without having run the kernel."""
    ci = os.environ.get("CI", "").strip().lower()
    return os.environ.get("PRECPROF_REQUIRE_KERNEL") == "1" or ci not in ("", "0", "false", "no")
