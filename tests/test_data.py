"""Data sources: the Markov chain's stationary distribution and entropy rate against an independent numpy
computation, sampled sequences against the chain, and byte-level text windows against the file."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from precprof import data as data_module
from precprof.data import VOCAB_SIZE, ByteTextData, MarkovChainData, load_data
from precprof.errors import UserError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def chain() -> MarkovChainData:
    return MarkovChainData(seed=3)


def test_transition_matrix_is_stochastic_and_sparse(chain: MarkovChainData) -> None:
    p = chain.transition.numpy()
    assert p.shape == (VOCAB_SIZE, VOCAB_SIZE)
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-12)
    assert ((p > 0).sum(1) == chain.branching).all()
    # the (i + 1) mod V edge that makes the chain irreducible
    assert (p[np.arange(VOCAB_SIZE), (np.arange(VOCAB_SIZE) + 1) % VOCAB_SIZE] > 0).all()


def test_stationary_and_entropy_rate_match_numpy(chain: MarkovChainData) -> None:
    p = chain.transition.numpy()
    # independent: the left eigenvector of P for eigenvalue 1
    w, v = np.linalg.eig(p.T)
    pi = np.real(v[:, np.argmin(np.abs(w - 1))])
    pi = pi / pi.sum()
    np.testing.assert_allclose(chain.stationary.numpy(), pi, atol=1e-10)
    with np.errstate(divide="ignore", invalid="ignore"):
        row_h = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    assert chain.entropy_rate_nats == pytest.approx(float(pi @ row_h), rel=1e-10)
    # learnable: well below the uniform loss
    assert chain.entropy_rate_nats < math.log(VOCAB_SIZE) - 2


def test_samples_follow_the_chain(chain: MarkovChainData) -> None:
    x = MarkovChainData(seed=11).sample(512, 65)
    p = chain.transition
    probs = p[x[:, :-1], x[:, 1:]]
    assert (probs > 0).all(), "a sampled transition has probability 0"
    # the mean negative log-likelihood of sampled transitions estimates the entropy rate
    nll = -probs.log()
    stderr = float(nll.std()) / math.sqrt(nll.numel())
    assert abs(float(nll.mean()) - chain.entropy_rate_nats) < 4 * stderr
    # first states follow the stationary distribution: compare the mean index (a cheap moment check)
    idx = torch.arange(VOCAB_SIZE, dtype=torch.float64)
    mean_pi = float((chain.stationary * idx).sum())
    sd_pi = math.sqrt(float((chain.stationary * (idx - mean_pi) ** 2).sum()))
    assert abs(float(x[:, 0].double().mean()) - mean_pi) < 4 * sd_pi / math.sqrt(512)


def test_batch_shapes_shift_and_seeds(chain: MarkovChainData) -> None:
    a = MarkovChainData(seed=5)
    x, y = a.batch(4, 16, CPU)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    b = MarkovChainData(seed=5)
    assert torch.equal(b.batch(4, 16, CPU)[0], x)
    c = MarkovChainData(seed=6)
    assert not torch.equal(c.batch(4, 16, CPU)[0], x)
    # the task (the chain) does not depend on the sampling seed
    assert torch.equal(a.transition, c.transition)
    assert chain.describe()["entropy_rate_nats"] == pytest.approx(a.entropy_rate_nats)


def test_bad_chain_arguments() -> None:
    with pytest.raises(UserError):
        MarkovChainData(vocab_size=1)
    with pytest.raises(UserError):
        MarkovChainData(vocab_size=8, branching=9)


def test_byte_text_windows(tmp_path: Path) -> None:
    text = ("the quick brown fox jumps over the lazy dog. " * 40).encode()
    path = tmp_path / "t.txt"
    path.write_bytes(text)
    data = ByteTextData(path, seed=1)
    x, y = data.batch(8, 32, CPU)
    assert x.shape == (8, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert x.dtype == y.dtype == torch.int64  # the model contract, though the file is held as uint8
    assert data.tokens.dtype == torch.uint8 and data.tokens.numel() == len(text)
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        window = bytes([*row_x, row_y[-1]])
        assert window in text
    counts = np.bincount(np.frombuffer(text, dtype=np.uint8), minlength=256).astype(float)
    q = counts[counts > 0] / counts.sum()
    assert data.unigram_entropy_nats == pytest.approx(float(-(q * np.log(q)).sum()), rel=1e-12)
    assert data.describe()["bytes"] == len(text)


def test_text_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        load_data(str(tmp_path / "missing.txt"))
    short = tmp_path / "short.txt"
    short.write_bytes(b"abcdef")
    data = ByteTextData(short)
    with pytest.raises(UserError, match="seq-len"):
        data.batch(2, 16, CPU)


def test_the_smallest_files_and_an_empty_name_are_each_said_as_they_are(tmp_path: Path) -> None:
    """A file of one byte value has entropy 0, printed "-0.0000" (summary.json -0.0: -(0 * log 1)); a 2-byte file
    was "a text file of a few KB or more is needed" (17 bytes train at --seq-len 16, and a 2-byte one at
    --seq-len 1) where a 3-byte one named the --seq-len it is short of; --data '' was "'.' is a directory"
    (tester t5)."""
    same = tmp_path / "a.txt"
    same.write_bytes(b"a" * 17)
    entropy = ByteTextData(same).unigram_entropy_nats
    assert entropy == 0.0 and math.copysign(1.0, entropy) == 1.0 and f"{entropy:.4f}" == "0.0000"
    assert ByteTextData(same).describe()["unigram_entropy_nats"] == 0.0
    short = tmp_path / "s.txt"
    for text, fix in ((b"ab", "use a longer file or --seq-len 1 or less$"), (b"a", "use a longer file$")):
        short.write_bytes(text)
        data = load_data(str(short))
        n = f"{len(text)} byte{'s' if len(text) > 1 else ''}"
        with pytest.raises(UserError, match=f"has {n}, fewer than --seq-len \\+ 1 = 17; {fix}"):
            data.check(16)
    short.write_bytes(b"ab")
    x, y = load_data(str(short)).batch(2, 1, CPU)  # the smallest run: --seq-len 1 from 2 bytes
    assert x.tolist() == [[97], [97]] and y.tolist() == [[98], [98]]
    with pytest.raises(UserError, match=r"^--data '' names no file; give the path of a text file") as info:
        load_data("")
    assert "directory" not in str(info.value) and "'.'" not in str(info.value)


def test_load_data_dispatch(tmp_path: Path) -> None:
    assert isinstance(load_data("synthetic"), MarkovChainData)
    f = tmp_path / "a.txt"
    f.write_text("hello world, hello precprof")
    assert isinstance(load_data(str(f)), ByteTextData)


def test_data_that_is_not_a_readable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each is one line naming the path and what to give instead (the CLI prints it without a traceback)."""
    cases: list[tuple[str, str]] = [
        (str(tmp_path), r"is a directory; give a text file \(read as bytes\) or 'synthetic'"),
        ("/dev/null", r"is not a regular file \(a device, pipe or socket\)"),
    ]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases.append(
        (str(empty), r"is empty; give a text file of a few KB or more \(read as bytes\) or 'synthetic'")
    )
    if hasattr(os, "mkfifo"):  # reading a FIFO would wait for a writer forever
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        cases.append((str(fifo), "is not a regular file"))
    for spec, message in cases:
        with pytest.raises(UserError, match=message) as info:
            load_data(spec)
        assert repr(spec) in str(info.value) and "\n" not in str(info.value)

    locked = tmp_path / "locked.txt"
    locked.write_text("some text " * 100)
    real_open = Path.open

    def denied(self: Path, *args: object, **kwargs: object) -> object:  # chmod 000, for anyone but root
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(UserError, match=r"cannot be read \(Permission denied\); check its permissions"):
        load_data(str(locked))


def test_a_file_larger_than_memory_is_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 10_000)
    monkeypatch.setattr(data_module, "available_bytes", lambda device: 5_000)
    with pytest.raises(
        UserError, match=r"more than the .* of memory available to hold it; use a smaller file"
    ):
        load_data(str(big))
    monkeypatch.setattr(data_module, "available_bytes", lambda device: None)  # unknown: nothing refused
    assert load_data(str(big)).tokens.numel() == 10_000


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads a chmod 000 file")
def test_a_real_unreadable_file(tmp_path: Path) -> None:
    locked = tmp_path / "locked.txt"
    locked.write_text("some text " * 100)
    locked.chmod(0)
    try:
        with pytest.raises(UserError, match=r"cannot be read \(Permission denied\); check its permissions"):
            load_data(str(locked))
    finally:
        locked.chmod(0o600)


def test_the_chains_description_does_not_depend_on_the_number_of_threads() -> None:
    """``precprof compare`` reads two runs' data as different when their descriptions differ: the entropy rate
    (a linear solve and a sum in float64) ended in another last bit with 1 thread than with 2 (1.7182123191963319
    against ...317), and runs recorded with different thread counts were said to train on different data."""
    threads = torch.get_num_threads()
    try:
        described = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            chain = MarkovChainData(vocab_size=VOCAB_SIZE, seed=0)
            described.append(chain.describe())
            exact = float((chain.stationary * data_module._entropy_nats(chain.transition)).sum())
            assert chain.entropy_rate_nats == pytest.approx(exact, rel=1e-11)
    finally:
        torch.set_num_threads(threads)
    assert described[0] == described[1] == described[2]
