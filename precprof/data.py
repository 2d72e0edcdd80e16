"""Token data for the built-in training loop: a learnable synthetic Markov chain, or a text file as bytes.

Every source yields batches of the same shape, which is also the batch contract of user models
(see ``precprof.models``): ``x`` and ``y`` are int64 tensors of shape (batch_size, seq_len) with token ids in
``[0, vocab_size)``, and ``y[:, t]`` is the token that follows ``x[:, t]`` (next-token targets). Both sources
use 256 tokens.

``synthetic`` samples sequences from a fixed, seeded first-order Markov chain over 256 states. Each state has
a few successors with random probabilities, so the chain is learnable (the loss falls from ln 256 ≈ 5.55 nats
toward the chain's entropy rate within a few hundred steps) and the best achievable loss is known exactly:
``entropy_rate_nats``, recorded in summary.json so that a run shows how close it got. The chain itself is the
same for every run (``CHAIN_SEED``); ``--seed`` changes only which sequences are drawn.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from precprof.errors import UserError
from precprof.footprint import HEADROOM, available_bytes, size_text

VOCAB_SIZE = 256
CHAIN_SEED = 0  # the synthetic task is fixed; the sampling seed is the run's --seed
DEFAULT_BRANCHING = 8


class TokenSource(Protocol):
    """What the training loop needs from a data source."""

    vocab_size: int

    def batch(self, batch_size: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 tensors of shape (batch_size, seq_len) on ``device``; y is x shifted by one token."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-able description for summary.json (name, vocab size, reference entropies)."""
        ...

    def check(self, seq_len: int) -> None:
        """Raise UserError when batches of ``seq_len`` tokens cannot be drawn (checked before training)."""
        ...


def _entropy_nats(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last dim (0 log 0 = 0); +0.0, not -0.0, for a single value (a file of
    one byte value was said to have entropy "-0.0000")."""
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    return 0.0 - (p * logp).sum(-1)


class MarkovChainData:
    """Sequences from a seeded random first-order Markov chain over ``vocab_size`` states.

    Each state moves to ``branching`` distinct successors with Dirichlet(1) probabilities; one successor of
    state i is always (i + 1) mod V, which makes the chain irreducible, so its stationary distribution π is
    unique. Sequences start from π, hence every position is distributed as π and the best possible expected
    next-token loss is the entropy rate H = Σ_i π_i H(P_i) at every position (``entropy_rate_nats``).

    Sampling runs on the CPU from a ``torch.Generator`` seeded with ``seed``; batches are then copied to the
    device (asynchronously from pinned memory on CUDA: no host sync).
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        branching: int = DEFAULT_BRANCHING,
        seed: int = 0,
        chain_seed: int = CHAIN_SEED,
    ) -> None:
        if vocab_size < 2:
            raise UserError(f"synthetic data needs at least 2 tokens, got vocab_size={vocab_size}")
        if not 1 <= branching <= vocab_size:
            raise UserError(f"synthetic data: branching must be in [1, {vocab_size}], got {branching}")
        self.vocab_size = vocab_size
        self.branching = branching
        self.seed = seed
        self.chain_seed = chain_seed
        g = torch.Generator().manual_seed(chain_seed)
        v = vocab_size
        succ = torch.empty(v, branching, dtype=torch.int64)
        for i in range(v):
            # (i + 1) mod V first, then branching-1 other distinct states
            others = torch.randperm(v - 1, generator=g)[: branching - 1]
            others = (others + i + 2) % v  # skips i + 1 (mod V); may include i itself (a self-loop)
            succ[i, 0] = (i + 1) % v
            succ[i, 1:] = others
        # Dirichlet(1) weights: normalised exponential draws
        w = -torch.log(torch.rand(v, branching, generator=g, dtype=torch.float64).clamp_min(1e-300))
        probs = w / w.sum(1, keepdim=True)
        self.successors = succ
        self.probs = probs
        self.cumprobs = probs.cumsum(1).to(torch.float64)
        self.cumprobs[:, -1] = 1.0  # exact, so that u < 1 always finds a successor
        transition = torch.zeros(v, v, dtype=torch.float64)
        transition.scatter_add_(1, succ, probs)
        self.transition = transition
        self.stationary = _stationary(transition)
        # to 12 significant digits: the linear solve and the sum end in other last bits with another number of
        # threads, and runs that compare their data (``precprof compare``) read a different chain from a digit
        self.entropy_rate_nats = float(f"{float((self.stationary * _entropy_nats(transition)).sum()):.12g}")
        self._cum_stationary = self.stationary.cumsum(0)
        self._cum_stationary[-1] = 1.0
        self._gen = torch.Generator().manual_seed(seed)

    def sample(self, batch_size: int, length: int) -> torch.Tensor:
        """``batch_size`` sequences of ``length`` states (int64, CPU), each started from π."""
        g = self._gen
        out = torch.empty(batch_size, length, dtype=torch.int64)
        u0 = torch.rand(batch_size, 1, generator=g, dtype=torch.float64)
        # clamp: float rounding of the cumulative sum must never index past the last state
        state = torch.searchsorted(self._cum_stationary, u0).squeeze(1).clamp_max(self.vocab_size - 1)
        out[:, 0] = state
        # (length-1, batch, 1): u[t - 1] is contiguous, as searchsorted wants
        u = torch.rand(length - 1, batch_size, 1, generator=g, dtype=torch.float64)
        for t in range(1, length):
            k = torch.searchsorted(self.cumprobs[state], u[t - 1]).squeeze(1)
            state = self.successors[state, k.clamp_max(self.branching - 1)]
            out[:, t] = state
        return out

    def batch(self, batch_size: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (batch_size, seq_len); see the module docstring."""
        seq = self.sample(batch_size, seq_len + 1)
        return _to_device(seq, device)

    def check(self, seq_len: int) -> None:
        """Any length can be sampled."""

    def describe(self) -> dict[str, Any]:
        return {
            "name": "synthetic",
            "kind": "markov_chain",
            "vocab_size": self.vocab_size,
            "branching": self.branching,
            "chain_seed": self.chain_seed,
            "entropy_rate_nats": self.entropy_rate_nats,
            "uniform_loss_nats": math.log(self.vocab_size),
        }


class ByteTextData:
    """A text file read as bytes (256 tokens); batches are random windows drawn with a seeded generator.

    ``unigram_entropy_nats`` (the byte-frequency entropy of the file) is recorded as a reference: a model that
    ignores context reaches about that loss; anything below it was learned from context.
    """

    def __init__(self, path: str | Path, seed: int = 0) -> None:
        if isinstance(path, str) and not path:  # Path("") is ".", which was said to be a directory
            raise UserError(
                "--data '' names no file; give the path of a text file (read as bytes) or 'synthetic'"
            )
        self.path = Path(path)
        self.vocab_size = VOCAB_SIZE
        # uint8: one byte of memory per byte of text (int64 took eight); batch() widens only its windows
        self.tokens = _read_text_file(self.path)
        counts = torch.bincount(self.tokens, minlength=VOCAB_SIZE).to(torch.float64)
        self.unigram_entropy_nats = float(_entropy_nats(counts / counts.sum()))
        self._gen = torch.Generator().manual_seed(seed)

    def check(self, seq_len: int) -> None:
        n = self.tokens.numel()
        if n < seq_len + 1:
            shorter = f" or --seq-len {n - 1} or less" if n >= 2 else ""  # a window is --seq-len + 1 bytes
            raise UserError(
                f"--data: {str(self.path)!r} has {n} byte{'' if n == 1 else 's'}, fewer than --seq-len + 1 = "
                f"{seq_len + 1}; use a longer file{shorter}"
            )

    def batch(self, batch_size: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (batch_size, seq_len) from random offsets of the file."""
        self.check(seq_len)
        n = self.tokens.numel()
        starts = torch.randint(0, n - seq_len, (batch_size, 1), generator=self._gen)
        seq = self.tokens[starts + torch.arange(seq_len + 1)].to(torch.int64)
        return _to_device(seq, device)

    def describe(self) -> dict[str, Any]:
        return {
            "name": "text",
            "path": str(self.path),
            "bytes": int(self.tokens.numel()),
            "vocab_size": self.vocab_size,
            "unigram_entropy_nats": self.unigram_entropy_nats,
            "uniform_loss_nats": math.log(self.vocab_size),
        }


def load_data(spec: str, *, seed: int = 0) -> TokenSource:
    """The data source named by ``--data``: "synthetic" or the path of a text file (read as bytes)."""
    if spec == "synthetic":
        return MarkovChainData(seed=seed)
    return ByteTextData(spec, seed=seed)


def _read_text_file(p: Path) -> torch.Tensor:
    """The bytes of ``p`` as a uint8 tensor (one element per byte). UserError, one line, for what is not a
    readable, non-empty regular file that fits in the memory available; one too short for the run's --seq-len
    is ``ByteTextData.check``'s to say (2 bytes train at --seq-len 1)."""
    shown = repr(str(p))
    try:
        if p.is_dir():
            raise UserError(f"--data {shown} is a directory; give a text file (read as bytes) or 'synthetic'")
        if not p.exists():
            raise UserError(f"--data: no such file: {shown} (use 'synthetic' or the path of a text file)")
        if not p.is_file():  # reading a FIFO would wait for a writer, a device might never end
            raise UserError(
                f"--data {shown} is not a regular file (a device, pipe or socket); give a text file (read as "
                "bytes) or 'synthetic'"
            )
        with p.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            avail = available_bytes(torch.device("cpu"))
            if avail is not None and size > HEADROOM * avail:
                raise UserError(
                    f"--data {shown} is {size_text(size)}, more than the {size_text(avail)} of memory "
                    "available to hold it; use a smaller file"
                )
            buf = bytearray(size)  # read in place: read_bytes() and a copy would take twice the file's size
            n = f.readinto(buf) or 0
    except OSError as e:
        hint = "; check its permissions" if isinstance(e, PermissionError) else ""
        raise UserError(f"--data {shown} cannot be read ({e.strerror or e}){hint}") from None
    del buf[n:]  # a file that shrank since fstat
    if n == 0:
        raise UserError(
            f"--data {shown} is empty; give a text file of a few KB or more (read as bytes) or 'synthetic'"
        )
    return torch.frombuffer(buf, dtype=torch.uint8)


def _stationary(transition: torch.Tensor) -> torch.Tensor:
    """Stationary distribution π (π P = π, Σπ = 1) of an irreducible chain, by a linear solve in float64."""
    v = transition.shape[0]
    a = transition.T - torch.eye(v, dtype=transition.dtype)
    a[-1] = 1.0  # replace one (redundant) balance equation by the normalisation
    b = torch.zeros(v, dtype=transition.dtype)
    b[-1] = 1.0
    pi = torch.linalg.solve(a, b)
    return pi.clamp_min(0) / pi.clamp_min(0).sum()


def _to_device(seq: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device.type == "cuda":
        # pinned memory + non_blocking: the copy does not wait for the GPU to drain
        seq = seq.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        seq = seq.to(device)
    # contiguous, as any DataLoader batch is: a model's ``targets.view(-1)`` (nanoGPT, minGPT) refuses a slice
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
