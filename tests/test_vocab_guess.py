"""A factory's model's vocabulary, read from its embeddings: the token embedding, not the first one."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from torch import nn

from precprof import cli
from precprof import tables as T
from precprof.errors import UserError
from precprof.models import build_model
from precprof.models.base import guess_vocab

pytestmark = pytest.mark.usefixtures("one_thread")

# a valid model whose position table comes first (HF Whisper's encoder embed_positions does, in modules() order)
POS_FIRST = (
    "import torch\n"
    "from torch import nn\n"
    "class Net(nn.Module):\n"
    "    def __init__(self, vocab, positions, width=8):\n"
    "        super().__init__()\n"
    "        self.pos = nn.Embedding(positions, width)\n"
    "        self.tok = nn.Embedding(vocab, width)\n"
    "        self.out = nn.Linear(width, vocab)\n"
    "    def forward(self, x):\n"
    "        return self.out(self.tok(x) + self.pos(torch.arange(x.shape[1])))\n"
    "def build(vocab_size, seq_len):\n"
    "    return Net(vocab_size, seq_len)\n"
    "def fixed(positions=300):  # takes no vocab_size: 300 positions, 256 tokens\n"
    "    return Net(256, positions)\n"
    "def small(positions=100):  # 100 tokens: no embedding takes the data's 256\n"
    "    return Net(100, positions)\n"
)


def test_the_token_embedding_is_told_from_a_position_table_declared_before_it(tmp_path: Path) -> None:
    """The first nn.Embedding was taken as the vocabulary: a model whose position table (seq_len rows) came
    first was refused at --seq-len 32 ("a vocabulary of 32 tokens but the data uses 256", though it embeds 256),
    and at --seq-len 300 recorded vocab_size=300. The embedding of the vocab_size the factory was given, the one
    tied to an output head, or the only one is the token embedding; of several others, the largest bounds them."""
    f = tmp_path / "pos_first.py"
    f.write_text(POS_FIRST)
    for seq_len in (32, 300):
        built = build_model(f"{f}:build", vocab_size=256, seq_len=seq_len)
        assert built.vocab_size == 256 and not built.vocab_from_logits
    pos, tok = nn.Embedding(300, 4), nn.Embedding(256, 4)
    head = nn.Linear(4, 256, bias=False)
    head.weight = tok.weight
    guess = guess_vocab(nn.ModuleDict({"pos": pos, "tok": tok, "head": head}))
    assert (guess.size, guess.name, guess.sure) == (256, "tok", True)  # tied to the head
    guess = guess_vocab(nn.ModuleDict({"pos": pos, "tok": tok}))
    assert (guess.size, guess.name, guess.sure) == (
        300,
        "pos",
        False,
    )  # the largest: a bound, not the vocabulary
    assert guess_vocab(nn.ModuleDict({"pos": nn.Embedding(32, 4)})).sure
    assert guess_vocab(nn.Linear(2, 2)).size is None
    # several embeddings, none known: recorded unknown until the logits say it
    built = build_model(f"{f}:fixed", vocab_size=256, seq_len=8)
    assert built.vocab_size is None and built.vocab_from_logits
    assert built.with_logits_vocab((2, 8, 256)).vocab_size == 256
    # refused only when no embedding takes the data's ids, naming the one that bounds them
    with pytest.raises(
        UserError, match=r"vocabulary of at most 100 tokens \(its largest nn.Embedding, 'tok'"
    ):
        build_model(f"{f}:small", {"positions": 20}, vocab_size=256, seq_len=8)


class _ClosedPipe(io.StringIO):
    """A stdout whose reader went away (`precprof train ... | true`)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_run_records_the_vocabulary_of_its_logits_where_embeddings_leave_it_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """summary.json's model.vocab_size (and the alignment finding's "vocab_size=300") came from a position
    table of 300 rows; where the embeddings cannot say, the logits' classes do. The run prints to a closed
    stdout: it exited 1 with no message (click's reading of a broken pipe), though the run was saved whole; it
    exits 0, silently."""
    f = tmp_path / "pos_first.py"
    f.write_text(POS_FIRST)
    out = tmp_path / "run"
    argv = [
        "train",
        "-m",
        f"{f}:fixed",
        "--out",
        str(out),
        "--steps",
        "1",
        "--batch-size",
        "1",
        "--seq-len",
        "8",
    ]
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--no-progress", "--no-report", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 0, err
    assert "Traceback" not in err and "error" not in err
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert summary[T.SUMMARY_MODEL]["vocab_size"] == 256


def test_a_run_not_saved_whole_fails_though_stdout_is_closed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that trained but could not be saved whole (a full disk) exits 1 and says so on stderr, also where
    stdout's reader left: the closed pipe's first write, "final loss ...", had ended the command with exit 0 and
    no word of the lost files (reviewer h86)."""
    import pandas as pd

    from precprof import training
    from precprof.training.loop import TrainResult

    summary = {T.SUMMARY_STATUS: T.STATUS_INCOMPLETE, T.SUMMARY_INCOMPLETE_REASON: "disk full", "final": {}}
    monkeypatch.setattr(training, "train", lambda config: TrainResult(tmp_path, 1.0, pd.DataFrame(), summary))
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--steps", "2", "--no-progress", "--no-report", "--device", "cpu"])
    assert e.value.code == cli.EXIT_NOT_SAVED == 1
    assert f"precprof: error: {tmp_path} was not saved whole: disk full" in capsys.readouterr().err
