"""The precprof command: user mistakes give exit code 2 and one line on stderr; train, env and report work."""

from __future__ import annotations

import dataclasses
import gc
import html
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import forks
import pytest

from precprof import cli
from precprof import tables as T
from precprof.footprint import size_text

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "8", "--no-progress", "--device", "cpu"]


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out, err = capsys.readouterr()
    code = e.value.code
    return (code if isinstance(code, int) else 0), out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "error" in lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])


FACTORY = "def make(**kw):\n    raise RuntimeError('the factory failed on purpose')\n"


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["train", "--model", "gpt-9000"], ["unknown model", "gpt-nano", "llama-mini"]),
        (["train", "--precision", "fp64"], ["--precision", "fp16-pure"]),
        (["train", "--precision", "tf32", "--device", "cpu"], ["tf32", "compute capability 8.0"]),
        (["train", "--precision", "fp8", "--device", "cpu"], ["fp8", "8.9"]),
        (["train", "--model-arg", "n_layer"], ["KEY=VALUE"]),
        (["train", "--model-arg", "n_lyer=2"], ["n_lyer", "n_layer"]),
        (["train", "--model-arg", "n_layer=two"], ["n_layer", "integer"]),
        (["train", "--loss-scale", "static:x"], ["static:N"]),
        (["train", "--loss-scale", "static:1e39"], ["static:1e39", "3.4e+38"]),
        (["train", "--init-scale", "inf"], ["--init-scale", "inf", "3.4e+38"]),
        (["train", "--init-scale", "1e39"], ["--init-scale", "1e+39", "fp32"]),
        (["train", "--growth-factor", "inf"], ["--growth-factor", "finite", "inf"]),
        (["train", "--backoff-factor", "nan"], ["--backoff-factor", "nan"]),
        (["train", "--weight-decay", "inf"], ["--weight-decay", "finite", "inf"]),
        (["compare", "--precisions", "fp32,fp16:static:1e39"], ["static:1e39", "3.4e+38"]),
        (["compare", "--precisions", "fp32,fp16", "--init-scale", "inf"], ["--init-scale", "inf"]),
        (["train", "--steps", "0"], ["--steps"]),
        (["train", "--steps", "many"], ["--steps"]),
        # torch's seed is 64 bits: a raw "ValueError: Overflow when unpacking long long" traceback (tester t5)
        (["train", "--seed", str(2**64)], ["--seed", "[-2**63, 2**64-1]", str(2**64)]),
        (["train", "--seed", str(-(2**63) - 1)], ["--seed", "[-2**63, 2**64-1]"]),
        (["train", "--bogus"], ["--bogus"]),
        (["train", "--data", "/no/such/file.txt"], ["no such file"]),
        (["frobnicate"], ["frobnicate"]),
        # a path that is not there, a file, a folder of no run: each said as it is ("/no/such/run" was "not a
        # precprof run directory (no summary.json or tables in it)", h76)
        (["report", "/no/such/run"], ["'/no/such/run' does not exist"]),
        (["report", __file__], ["is a file, not a precprof run directory"]),
        (["report", "/"], ["'/' is not a precprof run directory"]),
        (["report"], ["Missing argument"]),
    ],
)
def test_user_mistakes_exit_2_with_one_line(
    args: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    if args[0] in ("train", "compare"):
        args = [args[0], *TINY, *args[1:]]  # the last occurrence of an option wins
    rc, _, err = run_main(args, capsys)
    assert_one_line_error(rc, err, *needles)


def test_the_seeds_accepted_are_the_ones_torch_takes() -> None:
    """``--seed`` is refused in one line outside the range torch's generators take, and only there; under torchrun
    rank r's data is seeded ``seed + r``, kept in that range as torch reads it (modulo 2**64: -1 is 2**64-1)."""
    import torch

    from precprof.errors import UserError
    from precprof.training.config import TrainConfig, data_seed

    for seed in (-(2**63), 2**64 - 1):
        TrainConfig(seed=seed).validate()
        torch.Generator().manual_seed(seed)
    for seed in (-(2**63) - 1, 2**64):
        with pytest.raises(UserError, match=r"--seed must be an integer in \[-2\*\*63, 2\*\*64-1\]"):
            TrainConfig(seed=seed).validate()
        with pytest.raises(ValueError, match="Overflow"):
            torch.Generator().manual_seed(seed)
    assert data_seed(5, 0) == 5 and data_seed(-5, 2) == -3 and data_seed(2**64 - 1, 1) == 0
    draws = [
        torch.randint(0, 2**30, (4,), generator=torch.Generator().manual_seed(s)) for s in (-1, 2**64 - 1)
    ]
    assert torch.equal(*draws)  # torch reads -1 as 2**64 - 1: the wrap keeps each rank's data


@pytest.mark.parametrize("engine", ["bogus", "triton"])
def test_an_engine_that_cannot_run_is_refused_before_the_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], engine: str
) -> None:
    """``PRECPROF_STATS_ENGINE=bogus`` (or triton on a CPU, outside Triton's interpreter) was said in one line, but
    at attach, after the run directory was made: a 0-step incomplete run stayed there and refused the corrected
    rerun without --overwrite. Refused before anything is written."""
    monkeypatch.setenv("PRECPROF_STATS_ENGINE", engine)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "run"
    rc, _, err = run_main(["train", *TINY, "--out", str(out)], capsys)
    assert_one_line_error(
        rc, err, f"PRECPROF_STATS_ENGINE={engine!r}" if engine == "bogus" else "TRITON_INTERPRET=1"
    )
    assert not out.exists()


def test_factory_that_raises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "fac.py"
    f.write_text(FACTORY)
    rc, _, err = run_main(["train", "--model", f"{f}:make", *TINY], capsys)
    assert_one_line_error(rc, err, "the factory failed on purpose", "RuntimeError")


Y_MODEL = (
    "import torch.nn.functional as F\n"
    "from torch import nn\n"
    "class Net(nn.Module):\n"
    "    def __init__(self, vocab_size):\n"
    "        super().__init__()\n"
    "        self.emb, self.out = nn.Embedding(vocab_size, 16), nn.Linear(16, vocab_size)\n"
    "    def forward(self, x, y):  # the targets, under another name than the contract's\n"
    "        return F.cross_entropy(self.out(self.emb(x)).flatten(0, 1), y.flatten())\n"
    "def make(vocab_size):\n"
    "    return Net(vocab_size)\n"
)


def test_a_forward_with_a_parameter_the_loop_does_not_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """forward(x, y): the loop passes the targets as ``targets=`` only. That was a TypeError's traceback on the
    first step, exit 1 and a run directory of no steps; it is one line naming the parameter and the fix, before
    any run directory exists. Renamed to targets, the same model trains."""
    f = tmp_path / "ymodel.py"
    f.write_text(Y_MODEL)
    out = tmp_path / "run"
    rc, _, err = run_main(["train", "--model", f"{f}:make", "--out", str(out), *TINY], capsys)
    assert_one_line_error(rc, err, "forward(x, y) has a required parameter 'y'", "rename 'y' to targets")
    assert not out.exists()
    f.write_text(Y_MODEL.replace("x, y)", "x, targets)").replace("y.flatten", "targets.flatten"))
    argv = ["train", "--model", f"{f}:make", "--out", str(out), *TINY, "--no-report"]
    rc, _, err = run_main(argv, capsys)
    assert rc == 0, err
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE


SMALL_VOCAB = (
    "from torch import nn\n"
    "def fixed(width=16):  # takes no vocab_size\n"
    "    return nn.Sequential(nn.Embedding(10, width), nn.Linear(width, 10))\n"
    "def takes(vocab_size, width=16):\n"
    "    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))\n"
)


def test_a_factory_with_too_few_tokens_is_told_a_fix_that_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A factory's model of 10 tokens for data of 256. "use --model-arg vocab_size=256" was said to a factory
    without a vocab_size parameter, where following it raised "unexpected keyword argument"; it is said only to
    a factory that takes vocab_size and was given a smaller one, where following it trains."""
    f = tmp_path / "vocab.py"
    f.write_text(SMALL_VOCAB)
    rc, _, err = run_main(["train", "--model", f"{f}:fixed", *TINY], capsys)
    assert_one_line_error(rc, err, "vocabulary of 10 tokens but the data uses 256", "vocab_size parameter")
    assert "--model-arg vocab_size" not in err
    rc, _, err = run_main(["train", "--model", f"{f}:takes", "-a", "vocab_size=10", *TINY], capsys)
    assert_one_line_error(rc, err, "vocabulary of 10 tokens", "use --model-arg vocab_size=256")
    out = tmp_path / "run"
    rc, _, err = run_main(
        ["train", "-m", f"{f}:takes", "-a", "vocab_size=256", "--out", str(out), *TINY, "--no-report"], capsys
    )
    assert rc == 0, err


DEEP_FACTORY = (
    "from torch import nn\n"
    "from layers_of_mine import Block\n"
    "def needs(vocab_size, width, *, depth):\n"
    "    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))\n"
    "def deep(vocab_size, width=16):\n"
    "    return nn.Sequential(nn.Embedding(vocab_size, width), Block(width))\n"
)
LAYERS_OF_MINE = (
    "from torch import nn\n"
    "class Block(nn.Module):\n"
    "    def __init__(self, width):\n"
    "        super().__init__()\n"
    "        self.fc = nn.Linear(width, width * 'two')  # the user's bug\n"
)


def test_a_factory_missing_an_argument_or_failing_deep_inside_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A factory parameter without a default that no -a gave: Python's "missing 1 required positional argument:
    'width'" did not say how to give it. A factory that fails in the user's own code a few calls down: the one
    line kept only the exception, not where in their files it was raised."""
    (tmp_path / "layers_of_mine.py").write_text(LAYERS_OF_MINE)
    f = tmp_path / "deep.py"
    f.write_text(DEEP_FACTORY)
    rc, _, err = run_main(["train", "--model", f"{f}:needs", *TINY], capsys)
    assert_one_line_error(rc, err, "needs width, depth", "pass -a width=VALUE -a depth=VALUE")
    rc, _, err = run_main(["train", "--model", f"{f}:deep", *TINY], capsys)
    line = next(i for i, text in enumerate(LAYERS_OF_MINE.splitlines(), 1) if "the user's bug" in text)
    assert_one_line_error(
        rc, err, "raised TypeError", f"(at {tmp_path / 'layers_of_mine.py'}:{line}, in __init__)"
    )


ECHO_FACTORY = "def echo(**kw):\n    raise ValueError(repr(sorted(kw.items())))\n"


def test_model_args_that_read_as_numbers_but_are_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """-a name=007 reached the factory as the int 7, and there was no way to pass a string of digits. A number
    with leading zeros stays the string it is, and quotes keep a string; plain numbers, booleans and none are
    converted as before. A built-in model's integer setting still takes 01 as 1."""
    f = tmp_path / "echo.py"
    f.write_text(ECHO_FACTORY)
    given = ["name=007", "code='12'", 'tag="true"', "n=12", "x=-0.5", "flag=true", "nothing=none", "zero=0"]
    rc, _, err = run_main(
        ["train", "--model", f"{f}:echo", *(a for g in given for a in ("-a", g)), *TINY], capsys
    )
    got = {"code": "12", "flag": True, "n": 12, "name": "007", "nothing": None, "tag": "true", "x": -0.5}
    got |= {"zero": 0, "seq_len": 8, "vocab_size": 256}  # the last two: what precprof passes
    assert_one_line_error(rc, err, f"raised ValueError: {sorted(got.items())!r}")
    from precprof.models import build_model

    built = build_model(
        "gpt-nano", {"n_layer": "01", "n_embd": "32", "n_head": "2"}, vocab_size=256, seq_len=8
    )
    assert sum(type(m).__name__ == "GPTBlock" for m in built.module.modules()) == 1


@pytest.mark.parametrize(
    ("model", "arg"),
    [
        ("gpt-nano", "n_head=0"),
        ("gpt-nano", "n_embd=0"),
        ("llama-mini", "n_head=0"),
        ("llama-mini", "n_embd=0"),
        ("cnn-bn", "kernel_size=0"),
        ("cnn-bn", "channels=0"),
        ("mlp", "hidden=0"),
    ],
)
def test_a_zero_model_size_is_one_line_before_anything_is_built(
    model: str, arg: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """n_head=0 was a ZeroDivisionError traceback, n_embd=0 and kernel_size=0 failed in the first forward and
    left a partial run, llama-mini's n_embd=0 trained a model of 0 parameters: each is refused as a negative
    size is, in one line, and no run directory is made. n_layer=0 (the embedding and the head alone) still
    builds."""
    out = tmp_path / "run"
    rc, _, err = run_main(["train", "--model", model, "-a", arg, "--out", str(out), *TINY], capsys)
    assert_one_line_error(rc, err, f"--model-arg {arg}: must be at least 1")
    assert not out.exists()
    from precprof.models import build_model

    built = build_model(model, {"n_layer": "0"}, vocab_size=256, seq_len=8)
    assert [type(m).__name__ for m in built.module.modules()].count("Linear") == 1  # the head


IMAGE_MODEL = (
    "from torch import nn\n"
    "def make(**kw):\n"
    "    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(288, 10))\n"
)
LAZY_MODEL = (
    "from torch import nn\n"
    "def make(**kw):\n"
    "    return nn.Sequential(nn.Embedding(256, 16), nn.LazyLinear(256))\n"
)


def test_a_model_that_is_no_language_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An image model from a factory: its first forward pass fails on the token ids the loop feeds it. That was
    a hundred lines of traceback ending in conv2d's complaint; it is one line that says what precprof train
    feeds, what it trains, and where another model goes. The memory estimate met the failure first: the run is
    refused there, before a run directory of no steps is made."""
    f = tmp_path / "vision.py"
    f.write_text(IMAGE_MODEL)
    out = tmp_path / "run"
    rc, _, err = run_main(["train", "--model", f"{f}:make", "--out", str(out), *TINY], capsys)
    assert_one_line_error(rc, err, "forward pass raised RuntimeError:", "here (2, 8)", "precprof.Profiler")
    assert not out.exists()


BROKEN_LM = (
    "from torch import nn\n"
    "def make(**kw):\n"
    "    return nn.Sequential(nn.Embedding(256, 16), nn.Linear(17, 256))  # a bug of its own: 17, not 16\n"
)


def test_a_language_models_own_bug_keeps_its_traceback(tmp_path: Path) -> None:
    """A model with an embedding is a language model: its first forward pass failing is its own bug. Refused
    before training in one line (below), it keeps its exception and traceback as the error's cause, for a
    caller of training.train and a debugger; it is not told to go profile elsewhere."""
    from precprof import training
    from precprof.errors import UserError

    f = tmp_path / "broken.py"
    f.write_text(BROKEN_LM)
    cfg = training.TrainConfig(
        model=f"{f}:make", steps=2, batch_size=2, seq_len=8, progress=False, report=False
    )
    with pytest.raises(UserError, match="mat1 and mat2 shapes cannot be multiplied") as info:
        training.train(dataclasses.replace(cfg, out=str(tmp_path / "run")))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.__cause__.__traceback__ is not None
    assert "precprof.Profiler" not in str(info.value)
    assert not (tmp_path / "run").exists()


DICT_MODEL = (
    "from torch import nn\n"
    "class Net(nn.Module):\n"
    "    def __init__(self, vocab_size):\n"
    "        super().__init__()\n"
    "        self.emb, self.out = nn.Embedding(vocab_size, 16), nn.Linear(16, vocab_size)\n"
    "    def forward(self, batch):\n"
    "        return self.out(self.emb(batch['input_ids']))  # a Hugging Face style batch\n"
    "def make(vocab_size):\n"
    "    return Net(vocab_size)\n"
)


def test_a_forward_that_fails_on_the_batch_is_refused_before_the_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A forward that reads a dict batch (batch['input_ids']) fails on the token ids precprof train feeds it. The
    memory estimate ran it first and let it go: 40 lines of traceback through typer followed, after a run
    directory whose report showed a run that never took a step. It is one line before anything is written,
    with the exception, the line of the user's file, and what the loop calls the model with; not what the model
    must return, which a failure inside its forward has nothing to do with (``test_the_output_contract_...``)."""
    f = tmp_path / "dict_model.py"
    f.write_text(DICT_MODEL)
    out = tmp_path / "run"
    rc, _, err = run_main(["train", "--model", f"{f}:make", "--out", str(out), *TINY], capsys)
    line = next(i for i, text in enumerate(DICT_MODEL.splitlines(), 1) if "input_ids" in text)
    lines = [x for x in err.strip().splitlines() if x.startswith("precprof")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in (
        "raised IndexError: too many indices for tensor of dimension 2",
        f"(at {f}:{line}, in forward)",
        "model(x) with x the token ids in [0, 256), an int64 tensor (batch_size, seq_len), here (2, 8)",
    ):
        assert needle in lines[0], (needle, lines[0])
    assert "it must return logits" not in lines[0]  # raised inside the forward: nothing to do with its output
    assert "precprof.Profiler" not in lines[0]  # it has an embedding: a language model with a bug
    assert not out.exists()


BATCH_SIZED = (
    "import torch\n"
    "from torch import nn\n"
    "class LSTMLM(nn.Module):\n"
    "    def __init__(self, vocab_size, batch_size):\n"
    "        super().__init__()\n"
    "        self.emb, self.rnn = nn.Embedding(vocab_size, 8), nn.LSTM(8, 8, batch_first=True)\n"
    "        self.register_buffer('h0', torch.zeros(1, batch_size, 8))  # its initial state: the training batch's\n"
    "        self.register_buffer('c0', torch.zeros(1, batch_size, 8))\n"
    "        self.out = nn.Linear(8, vocab_size)\n"
    "    def forward(self, x):\n"
    "        return self.out(self.rnn(self.emb(x), (self.h0, self.c0))[0])\n"
    "def make(vocab_size, batch_size):\n"
    "    return LSTMLM(vocab_size, batch_size)\n"
)


def test_a_model_that_fails_only_at_the_estimates_batch_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An LSTM language model whose initial state is sized for the training batch fails at the memory estimate's
    batch 1 and trains at its own: the check of the forward pass refused it ("here (1, 16)", for a run of batch
    8). The pass is checked at the run's batch size: the run trains, its estimate unmeasured."""
    f = tmp_path / "batch_sized.py"
    f.write_text(BATCH_SIZED)
    out = tmp_path / "run"
    args = ["train", "--model", f"{f}:make", "-a", "batch_size=2", "--out", str(out), *TINY, "--no-report"]
    rc, _, err = run_main(args, capsys)
    assert rc == 0 and "error" not in err, err
    assert len(T.read_tables(out)["steps"]) == int(TINY[TINY.index("--steps") + 1])


VOCAB_FIRST = (
    "from torch import nn\n"
    "class Net(nn.Module):\n"
    "    def __init__(self, vocab_size):\n"
    "        super().__init__()\n"
    "        self.emb, self.out = nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size)\n"
    "    def forward(self, x):\n"
    "        return self.out(self.emb(x)).transpose(1, 2)  # (batch, vocab, seq), as a conv head makes them\n"
    "def make(vocab_size):\n"
    "    return Net(vocab_size)\n"
)


def test_logits_of_vocab_by_seq_are_refused_or_said_ambiguous(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Logits (batch, vocab, seq_len) were refused at --seq-len 8, but at --seq-len 256, the data's vocabulary,
    they have the shape (batch, seq_len, vocab) has and trained as such, silently, a loss of the wrong axis.
    precprof cannot tell the two apart there: it says so in one note naming the fix, and trains (a model that
    does return (batch, seq_len, vocab) at seq_len 256 is right). At --seq-len 8 the refusal comes before the
    run directory is made."""
    f = tmp_path / "vocab_first.py"
    f.write_text(VOCAB_FIRST)
    out = tmp_path / "run8"
    rc, _, err = run_main(["train", "--model", f"{f}:make", "--out", str(out), *TINY], capsys)
    assert_one_line_error(
        rc, err, "returned Tensor of shape (2, 256, 8)", "expected logits of shape (2, 8, vocab"
    )
    assert not out.exists()
    out = tmp_path / "run256"
    argv = ["train", "--model", f"{f}:make", "--out", str(out), "--no-report", *TINY, "--seq-len", "256"]
    rc, _, err = run_main(argv, capsys)
    notes = [x for x in err.splitlines() if "cannot tell" in x]
    assert rc == 0 and len(notes) == 1, err
    assert notes[0].startswith("precprof: note: ") and "logits of shape (batch_size, 256, 256)" in notes[0]
    assert "return logits.transpose(1, 2), and a --seq-len other than 256 lets precprof check" in notes[0]
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE


def test_a_forward_that_fails_only_under_the_estimates_hooks_trains(tmp_path: Path) -> None:
    """The estimate measures under saved-tensor hooks; a forward that refuses them (torch.func does) fails
    there and not in a plain pass: check_forward runs the pass again without them and lets training go on,
    the estimate left unmeasured. The same forward without the guard is refused (the check is the pass's)."""
    import torch
    from torch import nn

    from precprof import footprint
    from precprof.errors import UserError
    from precprof.models import BuiltModel
    from precprof.training import contract

    model = nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))
    refuse = [False]

    def forward_loss(batch: int) -> torch.Tensor:
        x = torch.randint(0, 256, (batch, 8))
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks under this forward"):
            out = model(x.float() if refuse[0] else x)  # float ids: a plain pass fails too
        return torch.nn.functional.cross_entropy(out.reshape(-1, 256), x.reshape(-1))

    fp = footprint.estimate(model, batch_size=2, optimizer="sgd", forward_loss=forward_loss)
    assert (fp.measured, fp.failed_at) == (False, 1)
    assert "no hooks under this forward" in fp.note
    built = BuiltModel(model, "f.py:make", "factory", 256, None)
    contract.check_forward(built, model, forward_loss, fp.failed_at, 2, 8, 256)  # no error: it runs plainly
    refuse[0] = True
    with pytest.raises(UserError, match="forward pass raised RuntimeError"):
        contract.check_forward(built, model, forward_loss, 1, 2, 8, 256)


def test_a_built_in_model_that_cannot_run_at_the_sizes_given_is_refused_before_the_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """cnn-bn at --batch-size 1 --seq-len 1 gives its BatchNorm1d one value per channel, which training mode
    refuses: torch's 95-line traceback, exit 1, after a run directory of 0 steps that refused the corrected rerun
    (a factory's model failing so was already one line). One line naming the sizes and both fixes, before the
    run directory (each fix trains: tester t5's batch 2 x seq 1 and batch 1 x seq 2)."""
    cnn = ["--model", "cnn-bn", "-a", "channels=8", "-a", "n_layer=1", *TINY, "--steps", "1", "--no-report"]
    out = tmp_path / "run"
    argv = ["train", *cnn, "--batch-size", "1", "--seq-len", "1", "--out", str(out)]
    rc, _, err = run_main(argv, capsys)
    assert_one_line_error(
        rc,
        err,
        "cnn-bn cannot train at --batch-size 1 x --seq-len 1",
        "ValueError: Expected more than 1 value per channel when training",
        "BatchNorm1d",
        "use --batch-size 2 or --seq-len 2",
    )
    assert not out.exists()


def test_a_built_in_model_failing_at_every_size_keeps_its_traceback() -> None:
    """A built-in model's forward failing at the run's batch and at a larger one too is no size's fault but
    precprof's bug: left to training, which keeps its traceback (check_forward returns); one that runs at the
    larger batch is the size's, refused in one line."""
    import torch
    from torch import nn

    from precprof.errors import UserError
    from precprof.models import BuiltModel
    from precprof.training import contract

    model = nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))
    built = BuiltModel(model, "gpt-nano", "builtin", 256, None)
    below = [2]

    def forward_loss(batch: int) -> torch.Tensor:
        if batch < below[0]:
            raise RuntimeError(f"fails below batch {below[0]}")
        x = torch.randint(0, 256, (batch, 4))
        return torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1))

    with pytest.raises(
        UserError, match=r"gpt-nano cannot train at --batch-size 1 x --seq-len 4: .* below batch 2"
    ):
        contract.check_forward(built, model, forward_loss, 1, 1, 4, 256)
    below[0] = 100
    contract.check_forward(built, model, forward_loss, 1, 1, 4, 256)  # left to training


def test_the_output_contract_is_said_only_where_the_failure_is_not_raised_inside_the_forward() -> None:
    """An fp16 LSTM that torch's oneDNN cannot run on the CPU (reviewer h100) was told "it must return logits
    (batch_size, seq_len, vocab_size), a scalar loss, ...", which has nothing to do with an op failing inside
    the forward and sent the user to look at the output. The hint stays where the failure is the contract's: the
    call of the model itself, or reading what its forward returned."""
    import torch
    from torch import nn

    from precprof.models import BuiltModel
    from precprof.training import contract

    model = nn.Sequential(nn.Embedding(256, 16), nn.Linear(17, 256))  # an op inside the forward fails
    built = BuiltModel(model, "f.py:make", "factory", 256, None)
    x = torch.zeros(2, 8, dtype=torch.long)

    class Output:
        @property
        def logits(self) -> torch.Tensor:
            raise ValueError("no logits")

    def caught(run: Callable[[], object]) -> BaseException:
        with pytest.raises(Exception) as info:
            run()
        return info.value

    def read_output() -> object:
        model[0](x)
        return Output().logits  # reading what the forward returned fails

    said = (
        "; it must return logits (batch_size, seq_len, vocab_size), a scalar loss, or an output with .logits"
    )
    inside = caught(lambda: model(x))
    assert contract.raised_in_forward(inside)
    assert said not in str(contract.forward_failed(built, inside, (2, 8), 256))
    for e in (caught(lambda: model(x, x)), caught(read_output)):  # the call itself; the output's reading
        assert not contract.raised_in_forward(e)
        assert said in str(contract.forward_failed(built, e, (2, 8), 256))


def test_a_model_with_lazy_modules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """nn.LazyLinear before its first forward pass: precprof's memory check, and attach in a user's loop, read
    its uninitialized parameters and crashed. A one-line error names them and the fix."""
    f = tmp_path / "lazy.py"
    f.write_text(LAZY_MODEL)
    rc, _, err = run_main(["train", "--model", f"{f}:make", *TINY], capsys)
    assert_one_line_error(
        rc, err, "2 uninitialized parameter(s) of lazy modules (1.weight, 1.bias)", "factory"
    )
    import torch
    from torch import nn

    from precprof.capture import Profiler
    from precprof.errors import UserError

    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(3))
    with pytest.raises(UserError, match=r"run one forward pass on an example batch before attaching"):
        Profiler(model).attach()
    model(torch.zeros(2, 4))  # the fix: its shapes known, it attaches and records the lazy layer
    with Profiler(model, sample_every=1) as prof:
        model(torch.zeros(2, 4)).sum().backward()
        prof.step()
    layers = prof.tables()["layers"]
    assert set(layers.loc[layers[T.MODULE] == "1", T.TENSOR]) >= {T.WEIGHT, T.ACTIVATION, T.WEIGHT_GRAD}


def test_a_config_that_keeps_its_own_vocabulary_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """hf:gpt2 keeps GPT2Config's vocabulary for the data's 256 tokens (hf:llama its 32,000) without a word, and
    its loss starts near ln of that vocabulary, not ln 256: the run says which vocabulary it trains with, and how
    to size it to the data; given -a vocab_size, nothing is said."""
    transformers = pytest.importorskip("transformers")
    v = transformers.GPT2Config().vocab_size
    base = ["train", "-m", "hf:gpt2", "-a", "n_layer=1", "-a", "n_embd=16", "-a", "n_head=2", "--steps", "1"]
    base += ["--batch-size", "2", "--seq-len", "8", "--device", "cpu", "--no-report"]
    rc, _, err = run_main([*base, "--out", str(tmp_path / "own")], capsys)
    assert rc == 0, err
    assert (
        f"precprof: note: hf:gpt2 keeps its config's vocabulary of {v:,} tokens, and the data's has 256: its loss "
        f"starts near ln {v} = {math.log(v):.2f} rather than ln 256 = {math.log(256):.2f} (-a vocab_size=256 sizes "
        "the model to the data)"
    ) in err.splitlines()
    first = float(T.read_tables(tmp_path / "own")["steps"][T.LOSS].iloc[0])
    assert first == pytest.approx(math.log(v), abs=0.1)  # GPT-2's initialisation: logits near 0
    rc, _, err = run_main([*base, "-a", "vocab_size=256", "--out", str(tmp_path / "sized")], capsys)
    assert rc == 0 and "keeps its config's vocabulary" not in err, err


def test_a_text_file_s_run_ends_with_its_byte_entropy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A synthetic run's last line gives the chain's floor beside its final loss; a --data FILE run's gave
    nothing to read it against. It gives the file's byte entropy: the loss of a model that ignores context."""
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog; " * 40)
    counts = Counter(text.read_bytes())
    n = sum(counts.values())
    entropy = -sum(c / n * math.log(c / n) for c in counts.values())
    argv = ["train", "--data", str(text), "--out", str(tmp_path / "run"), "-a", "n_layer=1", *TINY]
    argv += ["--no-report"]
    rc, out, err = run_main(argv, capsys)
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("final loss"))
    assert line.endswith(
        f" (the file's byte entropy, the loss without context: {entropy:.4f}); skipped steps: 0"
    )


def test_report_unknown_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    T.write_summary(tmp_path, {T.SUMMARY_STATUS: T.STATUS_COMPLETE})
    rc, _, err = run_main(["report", str(tmp_path), "--target", "z80"], capsys)
    assert_one_line_error(rc, err, "z80", "v100", "h100")


def test_train_then_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    rc, stdout, _ = run_main(
        ["train", "--out", str(out), "--precision", "bf16", "-a", "n_layer=1", *TINY, "--no-report"], capsys
    )
    assert rc == 0
    assert f"run directory: {out}" in stdout and "final loss" in stdout
    summary = T.read_summary(out)
    # the advisor's plan is printed at the end and is the one in summary.json
    rec = summary[T.SUMMARY_RECOMMENDATION]
    assert f"Recommended for {rec['target']}: {rec['format']}" in stdout
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert summary[T.SUMMARY_CONFIG]["precision"] == "bf16"
    assert summary[T.SUMMARY_CONFIG]["model_args"] == {"n_layer": "1"}
    assert summary[T.SUMMARY_CONFIG]["command_line"].startswith("precprof ")
    assert summary[T.SUMMARY_MODEL]["n_layer"] == 1
    try:
        import precprof.report.render  # noqa: F401
    except ImportError:
        rc, _, err = run_main(["report", str(out)], capsys)
        assert_one_line_error(rc, err, "renderer")
        return
    target = tmp_path / "again.html"
    rc, stdout, _ = run_main(["report", str(out), "--out", str(target), "--target", "v100"], capsys)
    assert rc == 0 and target.exists() and str(target) in stdout
    assert target.read_text().lstrip().lower().startswith("<!doctype html")


def strict_json(text: str) -> object:
    """``text`` parsed as standard JSON: a bare NaN or Infinity (Python's own spelling) is refused."""

    def refuse(constant: str) -> object:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def page_text(path: Path) -> str:
    """What a reader of an HTML page sees: its text without styles, scripts, tags or repeated spaces, and
    without the minute it was generated at."""
    body = re.sub(r"<(style|script)[^>]*>.*?</\1>", " ", path.read_text(), flags=re.S)
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", body))).strip()
    return re.sub(r"generated \d{4}-\d\d-\d\d \d\d:\d\d( UTC)?", "generated", text)  # (compare's has no UTC)


def test_summary_and_compare_json_are_standard_json_read_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose every step is sampled has no unsampled step time: summary.json held a bare NaN there (and
    compare.json wherever a figure was NaN), which JSON.parse, jq and strict parsers refuse. Both files are
    standard JSON; the report and the comparison of the new files read as those of the old ones did."""
    from precprof import runfiles
    from precprof.training import TrainConfig, train

    def old_writer(doc: object, places_key: object = None) -> str:  # summary.json as precprof wrote it before
        return json.dumps(doc, indent=2, default=runfiles._json_default, allow_nan=True) + "\n"

    runs = [tmp_path / "fp32", tmp_path / "bf16"]
    cmp = tmp_path / "cmp"

    def pages() -> list[str]:
        assert run_main(["report", str(runs[0])], capsys)[0] == 0
        assert run_main(["compare", *map(str, runs), "--out", str(cmp), "--overwrite"], capsys)[0] == 0
        return [page_text(runs[0] / T.REPORT_FILE), page_text(cmp / "compare.html")]

    with monkeypatch.context() as m:
        m.setattr(runfiles, "json_text", old_writer)
        for out in runs:
            config = TrainConfig(
                model_args={"n_layer": "1"},
                steps=3,
                batch_size=2,
                seq_len=8,
                device="cpu",
                progress=False,
                report=False,
                out=out,
            )  # (pages() renders the page it reads; one layer: a quarter of the rows to sample and draw)
            train(dataclasses.replace(config, precision=out.name))
        before = pages()
    for out in runs:
        old = (out / T.SUMMARY_FILE).read_text()
        with pytest.raises(ValueError, match="not JSON: NaN"):
            strict_json(old)
        T.write_summary(out, json.loads(old))  # Python's json reads the old file's NaN as the float it was
        doc = strict_json((out / T.SUMMARY_FILE).read_text())
        assert isinstance(doc, dict) and T.read_tables(out)["steps"][T.SAMPLED].all()  # no unsampled step
        assert (
            doc["final"]["step_time_unsampled_median_s"] is None and doc["final"]["sampled_step_cost"] is None
        )
    assert pages() == before
    strict_json((cmp / "compare.json").read_text())


def test_non_finite_figures_are_written_as_json_and_read_back() -> None:
    """A figure not measured (NaN) is null; a loss that is NaN (a run that diverged) is "NaN", which null would
    hide (jq's `null < 3` is true); an infinity (an SQNR of a cast that lost nothing) is "Infinity". Read back,
    each is the float it was; a setting the user typed ("Infinity" as --out) stays the text it is."""
    summary = {
        T.SUMMARY_CONFIG: {"out": "Infinity", "lr": 0.003},
        T.SUMMARY_FINAL: {"final_loss": math.nan, "sampled_step_cost": math.nan, "wall_s": 2.5},
        T.SUMMARY_RECOMMENDATION: {"block_what_if": [{"sqnr_db": [math.inf, -math.inf, 31.5]}]},
    }
    with tempfile.TemporaryDirectory() as d:
        T.write_summary(d, summary)
        doc = strict_json((Path(d) / T.SUMMARY_FILE).read_text())
        back = T.read_summary(d)
    assert doc == {
        T.SUMMARY_CONFIG: {"out": "Infinity", "lr": 0.003},
        T.SUMMARY_FINAL: {"final_loss": "NaN", "sampled_step_cost": None, "wall_s": 2.5},
        T.SUMMARY_RECOMMENDATION: {"block_what_if": [{"sqnr_db": ["Infinity", "-Infinity", 31.5]}]},
        T.SUMMARY_NONFINITE: [
            "/final/final_loss",
            "/recommendation/block_what_if/0/sqnr_db/0",
            "/recommendation/block_what_if/0/sqnr_db/1",
        ],
    }
    assert (
        math.isnan(back[T.SUMMARY_FINAL]["final_loss"]) and back[T.SUMMARY_FINAL]["sampled_step_cost"] is None
    )
    assert back[T.SUMMARY_RECOMMENDATION]["block_what_if"][0]["sqnr_db"] == [math.inf, -math.inf, 31.5]
    assert back[T.SUMMARY_CONFIG] == {"out": "Infinity", "lr": 0.003}
    assert T.SUMMARY_NONFINITE not in back  # the places of the texts are the file's, not the run's
    with (
        tempfile.TemporaryDirectory() as d
    ):  # a summary written before the places were listed reads as before
        del doc[T.SUMMARY_NONFINITE]
        (Path(d) / T.SUMMARY_FILE).write_text(json.dumps(doc))
        earlier = T.read_summary(d)
    assert (
        math.isnan(earlier[T.SUMMARY_FINAL]["final_loss"])
        and earlier[T.SUMMARY_CONFIG] == back[T.SUMMARY_CONFIG]
    )
    assert earlier[T.SUMMARY_RECOMMENDATION] == back[T.SUMMARY_RECOMMENDATION]


def test_modules_named_nan_and_infinity_stay_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A module may be named NaN or Infinity (an attribute, a ModuleDict key): summary.json writes its name as
    it writes a non-finite figure, and read it back as a float ('keep inf in FP32', a block-format row named
    nan). It lists the places of its figures: names stay names, figures read back as floats."""
    import torch
    from torch import nn

    import precprof

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.NaN = nn.Linear(16, 64)
            self.Infinity = nn.Linear(64, 64)  # outputs beyond fp16's 65504: the fp16 findings name it
            self.head = nn.Linear(64, 1)
            with torch.no_grad():
                self.Infinity.weight.mul_(1e5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(nn.functional.layer_norm(self.Infinity(torch.relu(self.NaN(x))), (64,)))

    torch.manual_seed(0)
    model, run = Net(), tmp_path / "run"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, block_formats=True)
    with prof:
        for _ in range(3):
            x = torch.randn(64, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    prof.save(run)
    assert run_main(["report", str(run)], capsys)[0] == 0
    summary = T.read_summary(run)
    names = [m["name"] for m in summary[T.SUMMARY_CAPTURE]["modules"]]
    assert names[:2] == ["NaN", "Infinity"]
    assert summary[T.SUMMARY_RECOMMENDATION]["fp16_keep_fp32"] == ["Infinity"]
    # (no ratio: fp16 without a scaler sent every update to nan, and those steps are left out, by layer name)
    assert {"NaN", "Infinity"} <= set(summary[T.SUMMARY_WEIGHT_UPDATES]["nonfinite_steps"])
    assert "keep Infinity in FP32" in page_text(run / T.REPORT_FILE)
    doc = strict_json((run / T.SUMMARY_FILE).read_text())
    assert (
        isinstance(doc, dict) and doc[T.SUMMARY_NONFINITE]
    )  # the block-format SQNRs of casts losing nothing
    for place in doc[T.SUMMARY_NONFINITE]:
        keys = [int(k) if k.isdigit() else k for k in place.split("/")[1:]]
        text, figure = doc, summary
        for k in keys:
            text, figure = text[k], figure[k]
        assert text in ("NaN", "Infinity", "-Infinity")
        assert math.isnan(figure) if text == "NaN" else figure == float(text)


def test_ctrl_c_exits_130_and_names_the_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from precprof import training
    from precprof.training import loop  # noqa: F401  (the module whose grad_norm_ the loop calls)

    real_norm, calls = training.grad_norm_, []

    def norm_then_ctrl_c(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 3:  # Ctrl-C in the middle of the third step
            raise KeyboardInterrupt
        return real_norm(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(training.loop, "grad_norm_", norm_then_ctrl_c)
    out = tmp_path / "partial"
    rc, _, err = run_main(["train", "--out", str(out), *TINY, "--steps", "5"], capsys)
    assert rc == 130
    assert f"interrupted (Ctrl-C, SIGINT): the partial run is in {out}" in err
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert summary[T.SUMMARY_INCOMPLETE_REASON] == "interrupted (Ctrl-C, SIGINT)"
    steps = T.read_tables(out)["steps"]  # two finished steps and the one cut short (no loss recorded)
    assert steps[T.LOSS].notna().tolist() == [True, True, False] and (out / T.REPORT_FILE).exists()


def test_a_ctrl_c_run_does_not_blame_the_loop_for_the_step_it_cut_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C between the third step's backward and its optimizer step: the report said "1 of 3 steps have no
    loss: the loop passed none" and the weight gradients were "not read on 1 sampled step(s)" (a loop taking its
    gradients with torch.autograd.grad): both the cut-off step, of the built-in loop, which passes its loss. The
    console named the run directory alone, not the report it rendered."""
    from precprof import training
    from precprof.training import loop  # noqa: F401  (the module whose grad_norm_ the loop calls)

    real_norm, calls = training.grad_norm_, []

    def norm_then_ctrl_c(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_norm(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(training.loop, "grad_norm_", norm_then_ctrl_c)
    out = tmp_path / "partial"
    rc, _, err = run_main(["train", "--out", str(out), *TINY, "--steps", "5", "--sample-every", "1"], capsys)
    assert rc == 130
    steps = T.read_tables(out)["steps"]
    done = int((~steps[T.CUT_OFF].astype(bool)).sum())
    assert (
        done == 2
        and f"the partial run is in {out} ({done} finished steps)\nreport: {out / T.REPORT_FILE}" in err
    )
    assert not T.read_summary(out)[T.SUMMARY_CAPTURE].get("weight_grads_unread_steps")
    page = " ".join((out / T.REPORT_FILE).read_text().split())
    assert "the loop passed none" not in page and "not read on 1 sampled step" not in page
    assert "Step 2 has no loss: the run was cut off during it (a crash or Ctrl-C)." in page


def test_env(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_main(["env"], capsys)
    assert rc == 0
    assert "torch" in out and "usual format here:" in out and "NVML:" in out
    rc, out, _ = run_main(["env", "--json"], capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["hardware"]["device"] in ("cpu", "cuda")
    assert doc["usual_format"]["format"] in ("fp32", "bf16", "fp16")


def test_the_command_line_moves_what_it_imported_out_of_the_garbage_collectors_reach(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process is precprof's own: the objects of its imports (pandas, matplotlib, torch: hundreds of
    thousands) are frozen, which each full collection read again (a tenth of a large report's rendering). Not
    where a Python calls ``main([...])`` itself: its collector stays as it was (each call froze its garbage)."""
    gc.unfreeze()  # (this worker's own, conftest.py's, given back below)
    try:
        rc, _, _ = run_main(["env", "--json"], capsys)
        assert rc == 0 and gc.get_freeze_count() == 0
        monkeypatch.setattr(sys, "argv", ["precprof", "env", "--json"])
        with pytest.raises(SystemExit) as info:
            cli.main()  # as the console script calls it
        capsys.readouterr()
        assert info.value.code in (0, None) and gc.get_freeze_count() > 100_000
    finally:
        gc.freeze()


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_main([], capsys)
    assert rc == 0 and "train" in out and "report" in out
    rc, out, _ = run_main(["--version"], capsys)
    assert rc == 0 and out.startswith("precprof ")
    rc, out, _ = run_main(["train", "--help"], capsys)
    assert rc == 0 and "--precision" in out and "--loss-scale" in out


def test_the_sample_every_help_says_what_0_records(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--sample-every``'s help said the interval and its default, not that 0 records the steps alone (no
    sampled step: no layer statistics), as the Profiler's argument and the README say (tester t4)."""
    monkeypatch.setenv("COLUMNS", "200")
    rc, out, _ = run_main(["train", "--help"], capsys)
    words = " ".join(out.replace("│", " ").split())
    assert rc == 0
    assert "0 records the steps only (loss, time): no step is sampled, no layer statistics" in words
    assert "every second step at least when the model is compiled" in words


def test_python_dash_m_and_exit_code() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run(
        [sys.executable, "-m", "precprof", "--version"], capture_output=True, text=True, env=env, timeout=120
    )
    assert ok.returncode == 0 and ok.stdout.startswith("precprof ")
    bad = subprocess.run(
        [sys.executable, "-m", "precprof", "train", "--precision", "fp64"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_the_commands_say_what_they_do_under_python_dash_OO() -> None:
    """``python -OO`` strips docstrings, and typer took the commands' descriptions from them: ``precprof --help``
    listed train, env, report, compare and export with nothing beside them, and ``precprof train --help`` had
    no line saying what it does (the commands' texts are help= strings now)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    top = subprocess.run(
        [sys.executable, "-OO", "-m", "precprof", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert top.returncode == 0, top.stderr
    assert "Precision profiler for mixed-precision PyTorch training." in top.stdout
    for command, says in [
        ("train", "Train a model with the profiler attached"),
        ("env", "Versions, device capabilities"),
        ("report", "Render (or re-render) report.html"),
        ("compare", "Train the same model, data and seed once per precision"),
        ("export", "Write a run's loss, loss scale"),
    ]:
        (line,) = [ln for ln in top.stdout.splitlines() if f" {command} " in ln]
        assert says in line, (command, line)
    one = subprocess.run(
        [sys.executable, "-OO", "-m", "precprof", "report", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert one.returncode == 0 and "Render (or re-render) report.html of a run directory." in one.stdout


def test_train_and_compare_accept_the_same_training_options() -> None:
    """Every TrainConfig field the command line sets is an option of both commands, spelled alike; only the
    precision choice differs (one mode against a list)."""
    import dataclasses

    import typer

    from precprof.training import TrainConfig

    group = typer.main.get_command(cli.app)
    options = {
        name: {o for p in group.commands[name].params for o in p.opts}  # type: ignore[attr-defined]
        for name in ("train", "compare")
    }
    only_train = options["train"] - options["compare"]
    only_compare = options["compare"] - options["train"]
    assert only_train == {"--precision", "-p", "--loss-scale"} - options["compare"]
    assert only_compare == {"--precisions", "--tolerance", "runs"}  # runs: the run directories to compare
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    set_by_cli = fields - {"precision", "loss_scale", "refresh_every", "command_line", "model_args"}
    for name in ("train", "compare"):
        params = {p.name for p in group.commands[name].params}  # type: ignore[attr-defined]
        assert set_by_cli <= params, (name, set_by_cli - params)


def test_compare_hands_every_training_option_to_its_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from precprof import compare as comparing

    seen: list[object] = []

    def record(config: object, variants: object, **kwargs: object) -> None:
        seen.append(config)
        raise KeyboardInterrupt  # stop before training: only the configuration matters here

    monkeypatch.setattr(comparing, "compare", record)
    argv = [
        "compare",
        "--growth-factor",
        "4",
        "--backoff-factor",
        "0.25",
        "--distributed",
        "fsdp2",
        "--sample-every",
        "3",
        "--overwrite",
        "--out",
        str(tmp_path / "c"),
        *TINY,
    ]
    rc, _, _ = run_main(argv, capsys)
    assert rc == 130
    (config,) = seen
    assert (config.growth_factor, config.backoff_factor, config.distributed) == (4.0, 0.25, "fsdp2")  # type: ignore[attr-defined]
    assert (config.sample_every, config.overwrite, config.steps) == (3, True, 2)  # type: ignore[attr-defined]


HELP_COMMANDS = [[], ["train"], ["report"], ["compare"], ["env"]]


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("command", HELP_COMMANDS, ids=lambda c: c[0] if c else "precprof")
def test_help_reads_cleanly(
    command: list[str], columns: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # typer >= 0.2x showed <bool> after every flag, {run_dir} in report's usage line, and cut the long
    # tokens of a help text (the --out default) with an ellipsis
    monkeypatch.setenv("COLUMNS", str(columns))
    rc, out, _ = run_main([*command, "--help"], capsys)
    assert rc == 0
    assert max(len(line) for line in out.splitlines()) <= columns
    assert "<bool>" not in out and "{" not in out and "…" not in out, out
    if command == ["report"]:
        assert "Usage: precprof report [OPTIONS] RUN_DIR" in out
    if command == ["train"]:
        words = " ".join(out.replace("│", " ").split())
        assert "(default: a new one in runs/, named after the model, the precision and the time)" in words


def test_progress_in_a_log_file_is_plain_lines(tmp_path: Path) -> None:
    # no TTY: a line about every 10% of the steps, not a carriage-return update per step
    log = tmp_path / "log.txt"
    # (a step in ten sampled: which steps are sampled is not what the lines are about; a fork of the preloaded
    # Python, tests/forks.py, whose stdout and stderr are the file, as a fresh process's are)
    args = [*TINY, "--steps", "30", "--sample-every", "10", "--progress", "--no-report", "-a", "n_layer=1"]
    with log.open("wb") as f:
        rc = forks.run(
            [sys.executable, "-m", "precprof", "train", "--out", str(tmp_path / "run"), *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=120,
        ).returncode
    text = log.read_bytes()
    assert rc == 0, text
    assert b"\r" not in text and len(text) < 4096, text
    steps = [line for line in text.decode().splitlines() if ": step " in line]
    assert [line.split(": step ")[1].split()[0] for line in steps] == ["10/30", "20/30", "30/30"]
    assert all("loss=" in line and "tok/s=" in line for line in steps)


def test_the_first_progress_line_leaves_the_warm_up_step_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first line's tok/s counted the first step, which warms up (allocations, kernels; on a GPU compiles
    and autotunes): it said 1,171 tok/s on an H200. Here the first step takes 1.5 s longer than it would."""
    from precprof import training

    SLOW_S = 1.5

    class SlowFirstStep(training.Callback):
        def after_backward(self, run: training.TrainRun) -> None:
            if run.step == 0:
                time.sleep(SLOW_S)

    config = training.TrainConfig(
        steps=4,
        batch_size=2,
        seq_len=8,
        device="cpu",
        progress=True,
        refresh_every=2,
        report=False,
        out=tmp_path / "run",
        sample_every=0,
    )
    training.train(config, callbacks=[SlowFirstStep()])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ": step " in ln]
    assert [ln.split(": step ")[1].split()[0] for ln in lines] == ["2/4", "4/4"], lines
    rate = float(re.search(r"tok/s=([\d,.]+)", lines[0]).group(1).replace(",", ""))  # type: ignore[union-attr]
    # with the first step: 2 steps x 16 tokens in more than 1.5 s, under 21.4 tok/s; without it, the second
    # step's 16 tokens alone (21.4 tok/s would take a 0.75 s step on this tiny model, some 10 ms a step)
    assert rate > 2 * 16 / SLOW_S, lines[0]


def test_train_prints_its_memory_estimate_before_the_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The estimate was only in summary.json: a user sizing a batch saw it after the run, or in a refusal."""
    from precprof import training

    config = training.TrainConfig(
        steps=2, batch_size=2, seq_len=8, device="cpu", progress=True, report=False, out=tmp_path / "run"
    )
    training.train(config)
    err = capsys.readouterr().err.splitlines()
    estimate = json.loads((tmp_path / "run" / "summary.json").read_text())["config"]["memory_estimate"]
    first_step = next(i for i, ln in enumerate(err) if ": step " in ln)
    memory = [i for i, ln in enumerate(err) if ln.startswith("precprof: memory: about ")]
    assert len(memory) == 1 and memory[0] < first_step, err
    line = err[memory[0]]
    assert (
        f"activations {size_text(estimate['activations'])}: saved {size_text(estimate['saved_activations'])}, "
        f"outputs {size_text(estimate['outputs'])}, backward temporaries "
        f"{size_text(estimate['backward_temporaries'])})" in line
    ), line
    assert f"about {size_text(estimate['total'])} at a step's peak" in line, line


def test_options_a_run_does_not_use_are_said_and_not_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """-p bf16 --init-scale 1024 trained without a scaler, said nothing, and summary.json recorded init_scale
    1024; --distributed fsdp2 outside torchrun trained one plain process without a word. Each is a note, and
    the unused scale is not recorded. An fp16 run, which scales dynamically, records it and has no note."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    unused = tmp_path / "bf16"
    rc, _, err = run_main(
        [
            "train",
            "-p",
            "bf16",
            "--init-scale",
            "1024",
            "--distributed",
            "fsdp2",
            "--out",
            str(unused),
            *TINY,
            "--no-report",
        ],
        capsys,
    )
    assert rc == 0
    notes = [ln for ln in err.splitlines() if ln.startswith("precprof: note: ")]
    assert notes == [
        "precprof: note: --init-scale 1024 sets dynamic loss scaling, which this run does not use (-p bf16 scales "
        "no loss; --loss-scale dynamic would): ignored, and not recorded in summary.json",
        "precprof: note: --distributed fsdp2 applies under torchrun (torchrun --nproc_per_node N -m precprof "
        "train ...); this is one process, trained without it",
    ]
    assert set(T.read_tables(unused)["steps"][T.LOSS_SCALE]) == {1.0}  # no scaler: the loss went unscaled
    cfg = T.read_summary(unused)[T.SUMMARY_CONFIG]
    assert [cfg[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")] == [
        None
    ] * 4
    used = tmp_path / "fp16"
    argv = ["train", "-p", "fp16", "--init-scale", "1024", "--out", str(used), *TINY, "--no-report"]
    rc, _, err = run_main(argv, capsys)
    assert rc == 0 and "dynamic loss scaling" not in err
    assert T.read_tables(used)["steps"][T.LOSS_SCALE].iloc[0] == 1024.0
    assert T.read_summary(used)[T.SUMMARY_CONFIG]["init_scale"] == 1024.0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_out_that_cannot_be_created_is_refused_before_the_model_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--out /proc/nope: as root, /proc's permissions allow a new folder and the file system refuses it; the
    refusal came after the model was built and its memory estimate printed. It comes before the build."""
    from precprof.training import loop

    def build_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr(loop, "build_model", build_model)
    rc, _, err = run_main(["train", "--out", "/proc/nope/run", *TINY], capsys)
    assert_one_line_error(rc, err, "--out /proc/nope/run: ", "choose another --out")
    assert not os.path.exists("/proc/nope")


def test_without_the_progress_bar_the_fp16_emulation_note_is_still_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--no-progress (a batch job's, a CI's) also dropped the note that this CPU emulates fp16, 15x slower than
    fp32: the run that needed the warning most ran without it. The bar goes; the note stays. (The CPU is made
    one without fp16 arithmetic: whether this one has it is the machine's.)"""
    from precprof import hardware, training

    monkeypatch.setattr(hardware, "cpu_fp16_native", lambda: False)
    config = training.TrainConfig(
        steps=1,
        batch_size=2,
        seq_len=8,
        device="cpu",
        precision="fp16",
        progress=False,
        report=False,
        out=tmp_path / "run",
        sample_every=0,
    )
    training.train(config)
    err = capsys.readouterr().err.splitlines()
    assert [ln for ln in err if "no fp16 arithmetic" in ln and "about 15x slower" in ln], err
    assert not [ln for ln in err if ": step " in ln], err  # no progress line


def test_train_and_compare_print_nothing_of_torch_s_own(tmp_path: Path) -> None:
    """Every `precprof train` on a CPU printed torch's CPUAllocator.cpp:245 warning (the memory profiler of a
    sampled step sees a block freed that was allocated before it started), and `compare` two Kineto lines
    (USDT ... profiler_start/stop) per sampled step.

    train runs in a fresh Python: c10's log level is read as torch loads, which a fork of tests/forks.py's
    preloaded Python has done (at ERROR). Kineto's is read when the first profiler starts: compare's runs are a
    fork's, which starts its first profiler as a fresh process does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--steps", "4", "--sample-every", "2", "--device", "cpu", "--no-progress", "--no-report"]
    for start, args in (
        (subprocess.run, ["train", "--out", str(tmp_path / "run"), "--batch-size", "8", "--seq-len", "64"]),
        (forks.run, ["compare", "--out", str(tmp_path / "cmp"), "--precisions", "fp32,bf16", *TINY]),
    ):
        res = start(  # type: ignore[operator]
            [sys.executable, "-m", "precprof", *args, *common],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr
        assert "CPUAllocator" not in res.stderr and "USDT" not in res.stderr, res.stderr
        assert res.stderr.strip() == "", res.stderr


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("gpt-nano", "gpt-nano"),
        ("path/to/my_model.py:build", "my_model-build"),
        ("my_model.py:my_model", "my_model"),
        ("package.my_model:build", "my_model-build"),
        ("hf:gpt2", "hf-gpt2"),
    ],
)
def test_default_run_dir_name(model: str, name: str) -> None:
    from precprof.training import TrainConfig
    from precprof.training.config import default_out_dir

    out = default_out_dir(TrainConfig(model=model), root="nowhere")
    assert out.name.startswith(f"{name}-fp32-") and out.parent == Path("nowhere")


MY_MODEL = """from torch import nn


def build(vocab_size, seq_len):
    return nn.Sequential(nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size))
"""


def test_factory_run_dir_is_named_after_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_model.py").write_text(MY_MODEL)
    monkeypatch.chdir(tmp_path)
    rc, stdout, err = run_main(["train", "--model", "my_model.py:build", *TINY, "--no-report"], capsys)
    assert rc == 0, err
    (run,) = (tmp_path / "runs").iterdir()
    assert (
        run.name.startswith("my_model-build-fp32-") and f"run directory: {Path('runs') / run.name}" in stdout
    )


NANOGPT_LIKE = """import torch
from torch import nn
from torch.nn import functional as F


class GPT(nn.Module):
    # nanoGPT's and minGPT's contract: forward(idx, targets=None) -> (logits, loss), targets read with .view
    def __init__(self, vocab_size):
        super().__init__()
        self.wte, self.lm_head = nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size)

    def forward(self, idx, targets=None):
        logits = self.lm_head(self.wte(idx))
        if targets is None:
            return logits[:, [-1], :], None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def build(vocab_size, seq_len):
    return GPT(vocab_size)
"""


def test_a_nanogpt_style_factory_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """karpathy's nanoGPT ``GPT`` as ``--model file.py:factory``: the loop's targets were a slice of the batch,
    which nanoGPT's ``targets.view(-1)`` refuses (a traceback), and its ``(logits, loss)`` tuple was refused
    ("expected logits ... or a scalar loss"). It trains, on the loss the model computed."""
    (tmp_path / "nano.py").write_text(NANOGPT_LIKE)
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_main(["train", "--model", "nano.py:build", *TINY, "--no-report", "--out", "run"], capsys)
    assert rc == 0, err
    steps = T.read_tables(tmp_path / "run")["steps"]
    assert len(steps) == 2 and steps[T.LOSS].notna().all()


def test_a_factory_imports_its_neighbours_and_a_package_in_the_current_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model proj/model.py:build`` whose file imports a module beside it failed ("No module named 'layers'"),
    where ``python proj/model.py`` finds it; ``--model proj.model:build`` from the folder that holds ``proj``
    failed too. Both import as Python would."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "__init__.py").write_text("")
    (proj / "layers_of_a_test.py").write_text("from torch import nn\n\nWIDTH = 8\n")
    (proj / "model.py").write_text(
        "from torch import nn\n"
        "try:\n    from layers_of_a_test import WIDTH\nexcept ImportError:\n"
        "    from proj.layers_of_a_test import WIDTH\n\n\n"
        "def build(vocab_size, seq_len):\n"
        "    return nn.Sequential(nn.Embedding(vocab_size, WIDTH), nn.Linear(WIDTH, vocab_size))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), str(proj))])
    for spec, out in (("proj/model.py:build", "a"), ("proj.model:build", "b")):
        rc, _, err = run_main(["train", "--model", spec, *TINY, "--no-report", "--out", out], capsys)
        assert rc == 0, (spec, err)


def test_a_ctrl_c_while_the_command_is_being_built_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C in the first second, after the command line's modules loaded and before its command ran (while
    typer built it), was a KeyboardInterrupt traceback: "precprof: interrupted" and 130, as at any moment."""
    import precprof.__main__ as entry

    def interrupted(app: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.typer.main, "get_command", interrupted)
    monkeypatch.setattr(sys, "argv", ["precprof", "env"])
    with pytest.raises(SystemExit) as e:
        entry.main()
    assert e.value.code == 130 and capsys.readouterr().err == "precprof: interrupted\n"
