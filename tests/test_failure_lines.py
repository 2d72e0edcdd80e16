"""A run that fails says so in one line, names the place in the user's own file and where the traceback is: before
the run directory exists, in each run of ``precprof compare``, under ``torch.compile``; and a run resumed after a
crash does not keep the crash's traceback.txt."""

from __future__ import annotations

import io
import logging
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import precprof
from precprof import _compat, cli, rundir
from precprof import tables as T
from precprof.errors import TRACEBACK_ENV
from precprof.training import Callback, TrainConfig, TrainRun, compiling, train
from precprof.training import torch_log as torch_log_module

TINY = ["--batch-size", "2", "--seq-len", "8", "--device", "cpu", "--no-progress", "--no-report"]


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def line_of(source: str, needle: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if needle in text)


BEFORE_TRAINING = textwrap.dedent(
    """
    from torch import nn

    class Net(nn.Module):
        def __init__(self, vocab_size, fail=False):
            super().__init__()
            if fail:
                raise ValueError("no such width")  # in the constructor
            self.emb, self.head = nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size)

        def forward(self, x):
            return self.head(self.emb(x))

    class RefusesTrainingMode(Net):
        def train(self, mode=True):
            raise RuntimeError("frozen on purpose")  # called by precprof while it prepares the model

    def net(vocab_size, fail=False):
        return Net(vocab_size, fail)

    def refuses(vocab_size):
        return RefusesTrainingMode(vocab_size)
    """
)


def test_a_model_failing_before_training_is_one_line_with_the_users_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that failed in what precprof does with it before training (its own ``train()`` raising, called by
    precprof) printed a traceback through typer's frames; a file that fails as it is imported named no line; a
    constructor's error dropped its traceback. Each is one line naming the user's line and how to see the
    traceback (no run directory exists for a traceback.txt): PRECPROF_TRACEBACK=1 prints it, the line last."""
    f = tmp_path / "mine.py"
    f.write_text(BEFORE_TRAINING)
    out = tmp_path / "run"
    hint = f"; {TRACEBACK_ENV}=1 prints its traceback"
    cases = [
        (
            f"{f}:refuses",
            [],
            "the model raised RuntimeError while precprof prepared it for training "
            f"(at {f}:{line_of(BEFORE_TRAINING, 'frozen on purpose')}, in train): frozen on purpose",
        ),
        (
            f"{f}:net",
            ["-a", "fail=true"],
            f"raised ValueError: no such width (at {f}:{line_of(BEFORE_TRAINING, 'no such width')}, in __init__)",
        ),
    ]
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\nwidth = undefined_name\n")
    cases.append(
        (f"{broken}:net", [], f"NameError: name 'undefined_name' is not defined (at {broken}:2, in <module>)")
    )
    for model, args, said in cases:
        rc, _, err = run_main(["train", "-m", model, *args, "--out", str(out), *TINY], capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith("precprof: error: ") and lines[0].endswith(said + hint), lines[0]
        assert not out.exists()
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    rc, _, err = run_main(["train", "-m", f"{f}:refuses", "--out", str(out), *TINY], capsys)
    assert rc == 2 and err.startswith("Traceback") and 'raise RuntimeError("frozen on purpose")' in err, err
    assert err.strip().splitlines()[-1].endswith(cases[0][2]), err  # the line last, without the hint


def test_a_run_resumed_after_a_crash_keeps_no_traceback_of_it(tmp_path: Path) -> None:
    """The built-in loop crashed and wrote traceback.txt; the job resumed from its checkpoint into the same
    directory and completed: the complete run kept the crash's traceback.txt beside its summary, as if it were
    the run's. The resumed attempt's claim removes it (precprof's own file; a user's file of that name stays)."""
    out = tmp_path / "run"
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def steps(prof: precprof.Profiler, numbers: range) -> None:
        with prof:
            for _ in numbers:
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                prof.step()

    first = precprof.Profiler(model, opt, sample_every=1, memory=False, out=out)
    steps(first, range(3))
    kept = rundir.write_traceback(out, "Traceback (most recent call last):\nRuntimeError: the crash\n")
    first.save(status=T.STATUS_INCOMPLETE, reason="RuntimeError: the crash")
    assert kept == out / T.TRACEBACK_FILE and kept.exists()
    again = precprof.Profiler(model, opt, sample_every=1, memory=False, out=out, resume=True, first_step=2)
    steps(again, range(2, 5))
    again.save()
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert not kept.exists()
    assert sorted(T.read_tables(out)["steps"][T.STEP]) == [0, 1, 2, 3, 4]
    kept.write_text("my own notes\n")  # a file of the user's under that name is never touched
    rundir.claim(out, resume=True).release()
    assert kept.read_text() == "my own notes\n"


FAILS_IN_BF16 = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, vocab_size):
            super().__init__()
            self.emb, self.head = nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size)
            self.wrong = nn.Linear(16, 8)

        def forward(self, x):
            h = self.emb(x)
            if x.shape[0] == 3 and torch.is_autocast_enabled("cpu"):  # a training batch of the bf16 run
                h = self.wrong(h)  # my bug: a layer of the wrong width
            return self.head(h)

    def net(vocab_size):
        return Net(vocab_size)
    """
)


def test_a_failed_run_of_compare_says_its_error_and_where_its_traceback_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bf16 run of ``precprof compare`` fails on its first step: the comparison goes on and ends with check
    lines saying "bf16 stopped after 0 of 2 steps: RuntimeError", its traceback.txt named nowhere. A line says
    the run's error as ``precprof train`` says it, the model's line among it, and where its traceback is."""
    f = tmp_path / "bf16bug.py"
    f.write_text(FAILS_IN_BF16)
    out = tmp_path / "cmp"
    args = ["compare", "-m", f"{f}:net", "-p", "fp32,bf16", "--steps", "2", "--out", str(out), *TINY]
    rc, stdout, err = run_main([*args, "--batch-size", "3"], capsys)  # the checks before training run 1 and 2
    assert rc == 0, err
    kept = out / "bf16" / T.TRACEBACK_FILE
    assert kept.exists() and not (out / "fp32" / T.TRACEBACK_FILE).exists()
    line = line_of(FAILS_IN_BF16, "my bug")
    head = (
        f"precprof: bf16 failed: the model raised RuntimeError in the forward pass of step 0 (at {f}:{line}, "
    )
    said = [ln for ln in err.splitlines() if ln.startswith(head)]
    assert len(said) == 1 and said[0].endswith(f"; its traceback is in {kept}"), err
    assert "in forward): mat1 and mat2 shapes cannot be multiplied" in said[0]
    assert "comparison: " in stdout


LOGGED = "precprof-test: torch warned in step 0"
COMPILED = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, vocab_size):
            super().__init__()
            self.emb, self.head = nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size)
            self.wrong = nn.Linear(16, 8)
            self.traced = 0

        def forward(self, x):
            h = self.emb(x)
            if torch.compiler.is_compiling():  # the training's steps (the checks before it run eagerly)
                self.traced += 1
                if self.traced >= 2:
                    h = self.wrong(h)  # my bug, from step 1 on: a layer of the wrong width
            return self.head(h)

    def net(vocab_size):
        return Net(vocab_size)
    """
)


@pytest.fixture
def torch_log() -> Iterator[io.StringIO]:
    """What torch's own terminal handlers print in the test (they write to the stderr of when torch started)."""
    buf = io.StringIO()
    handlers = _compat.torch_log_handlers()
    assert handlers, "this torch keeps no handlers of its own"
    streams = [h.setStream(buf) for h in handlers]
    filters = [list(h.filters) for h in handlers]
    yield buf
    assert [list(h.filters) for h in handlers] == filters  # the logging as it was
    for h, stream in zip(handlers, streams, strict=True):
        h.setStream(stream)


class WarnsInStep0(Callback):
    def after_backward(self, run: TrainRun) -> None:
        if run.step == 0:
            logging.getLogger("torch._dynamo").warning(LOGGED)


def test_dynamos_log_of_a_compiled_models_error_goes_into_the_traceback_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_log: io.StringIO
) -> None:
    """A compiled model whose layer of the wrong width Dynamo refuses on fake tensors: torch logged the error
    and 20 lines of its frames ("failed while attempting to run meta for aten.mm.default") above precprof's one
    line, which says that error. They go into traceback.txt after the traceback; a warning torch logs in a step
    that ends is printed, as it was (after the step); torch's handlers keep no filter of precprof's."""
    f = tmp_path / "compiled.py"
    f.write_text(COMPILED)
    # Dynamo traces the model as inductor's would (its fake tensors log the error); no C++ compile
    monkeypatch.setattr(compiling, "compile_model", lambda m: torch.compile(m, backend="eager"))
    monkeypatch.setattr(compiling, "check_can_compile", lambda device: None)
    config = TrainConfig(
        model=f"{f}:net",
        steps=3,
        batch_size=2,
        seq_len=8,
        device="cpu",
        progress=False,
        report=False,
        sample_every=0,
        compile=True,
        out=tmp_path / "run",
    )
    try:
        with pytest.raises(RuntimeError) as info:
            train(config, callbacks=[WarnsInStep0()])
    finally:
        torch.compiler.reset()
    kept = (tmp_path / "run" / T.TRACEBACK_FILE).read_text()
    assert info.value.precprof_failure.text.startswith("the model raised RuntimeError under torch.compile")  # type: ignore[attr-defined]
    printed = torch_log.getvalue()
    assert "failed while attempting to run meta" in kept and "failed while attempting" not in printed, printed
    assert LOGGED in printed and LOGGED not in kept


def test_torchs_log_is_not_held_where_the_user_asked_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TORCH_LOGS set (the user asked torch for its logs: `TORCH_LOGS=+dynamo`), torch's lines print as they
    come, a compile that hangs included: nothing is held back until the step ends (reviewer h83)."""
    handler = logging.StreamHandler(io.StringIO())
    monkeypatch.setattr(_compat, "torch_log_handlers", lambda: [handler])
    monkeypatch.setenv("TORCH_LOGS", "+dynamo")
    held = torch_log_module.Held.of_torch(True)
    assert handler.filters == []
    held.close()
    monkeypatch.delenv("TORCH_LOGS")
    held = torch_log_module.Held.of_torch(True)
    assert len(handler.filters) == 1  # held where nobody asked for torch's log
    held.close()
    assert handler.filters == []


def test_the_writing_rank_keeps_the_failing_ranks_traceback_when_it_was_interrupted_or_failed_too(
    tmp_path: Path,
) -> None:
    """Reviewer r1: a rank whose model raised says "rank 0 writes its traceback into RUN/traceback.txt" and leaves
    it in the group's store; rank 0 wrote it there only where its own error was the lost peer. Interrupted (torchrun's
    SIGTERM while rank 0 was in a long forward) it wrote no traceback.txt, and failing on its own error too (a bug
    every rank hits) the file held rank 0's alone: the failing rank's traceback was nowhere. It is in the file in
    both cases, after rank 0's own where it has one."""
    from precprof.training import failure

    theirs = 'Traceback (most recent call last):\n  File "model.py", line 10, in forward\nRuntimeError: rank 1 bad\n'
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    assert failure.peers_too(None, interrupted, 0, (1, theirs)) is None
    text = (interrupted / T.TRACEBACK_FILE).read_text()
    assert text.endswith("# rank 1's, which failed first:\n" + theirs) and "rank 0" not in text

    both = tmp_path / "both"
    both.mkdir()
    try:
        raise RuntimeError("rank 0 bad")
    except RuntimeError as e:
        kept = failure.keep(e, nn.Linear(1, 1), "builtin", both, 3, failure.FORWARD)
    assert kept.traceback is not None and "rank 1 bad" not in kept.traceback.read_text()
    kept = failure.peers_too(kept, both, 0, (1, theirs))
    assert kept is not None and kept.traceback is not None
    text = kept.traceback.read_text()
    assert "# rank 0's:\n" in text and text.index("rank 0 bad") < text.index("# rank 1's, which failed too:")
    assert text.endswith(theirs) and kept.trace in text
    assert kept.where() == f"its traceback is in {kept.traceback} (then rank 1's)"
    assert failure.peers_too(kept, both, 0, None) is kept  # no traceback in the store: as it was
