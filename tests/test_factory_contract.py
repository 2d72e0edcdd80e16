"""A ``--model file.py:factory`` model that breaks the output contract is told so in one line, exit code 2.

Logits of an integer dtype, logits or a loss detached from the parameters: the loss carries no gradient, and
torch's backward refused it at step 0 ("element 0 of tensors does not require grad and does not have a
grad_fn", exit 1) after the run directory was made. They are refused before training, with what is wrong and the
fix, as the output of a wrong shape is; met in training (a model that breaks the contract at a later step) the
line is followed by where the partial run is, saved as for any crash.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from precprof import cli
from precprof import tables as T
from precprof.errors import UserError
from precprof.training import Callback, TrainConfig, TrainRun, contract, train

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ["--batch-size", "2", "--seq-len", "8", "--no-progress", "--device", "cpu"]

MODELS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, vocab_size, mode, after):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 8)
        self.out = nn.Linear(8, vocab_size)
        self.mode, self.after, self.calls = mode, after, 0

    def forward(self, x):
        self.calls += 1
        logits = self.out(self.emb(x))
        if self.calls <= self.after:  # the passes before the contract breaks
            return logits
        if self.mode == "argmax":
            return logits.argmax(-1, keepdim=True).expand_as(logits).contiguous()
        if self.mode == "detach":
            return logits.detach()
        if self.mode == "int_loss":
            return torch.tensor(3)
        if self.mode == "item_loss":
            return torch.tensor(logits.float().mean().item())
        if self.mode == "dict":
            return {"hidden": logits, "aux": logits.mean()}
        return logits


def make(vocab_size, mode, after=0):
    return Net(vocab_size, mode, after)


class Unusual(nn.Module):
    def __init__(self, vocab_size, kind):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 8, sparse=kind in ("sparse", "tied"))
        self.out = nn.Linear(8, vocab_size)
        self.kind = kind
        if kind == "complex":
            self.filt = nn.Parameter(torch.ones(8, dtype=torch.complex64))
        if kind == "rope":  # a RoPE table held as a complex buffer (LLaMA's freqs_cis)
            self.register_buffer("freqs", torch.polar(torch.ones(8), torch.arange(8.0)), persistent=False)

    def forward(self, x):
        h = self.emb(x)
        if self.kind == "functional":  # a sparse gradient no layer announces
            h = torch.nn.functional.embedding(x, self.emb.weight, sparse=True)
        if self.kind == "complex":
            h = torch.fft.ifft(torch.fft.fft(h.float(), dim=-1) * self.filt, dim=-1).real.to(h.dtype)
        if self.kind == "rope":
            h = (h.float() * self.freqs).real.to(h.dtype)
        if self.kind == "tied":  # the embedding's weight read densely too: autograd sums a dense gradient
            return torch.nn.functional.linear(h, self.emb.weight)
        return self.out(h)


def unusual(vocab_size, kind):
    return Unusual(vocab_size, kind)
"""


def _train_argv(tmp_path: Path, factory: str, arg: str, *more: str) -> tuple[Path, list[str]]:
    """``precprof train`` of ``MODELS``' ``factory`` with its argument ``arg`` (``-a``), into ``tmp_path/run``: the
    run directory and the command line (``more`` after it)."""
    (tmp_path / "m.py").write_text(MODELS)
    out = tmp_path / "run"
    return out, ["train", "-m", f"{tmp_path / 'm.py'}:{factory}", "-a", arg, "--out", str(out), *more]


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    _, err = capsys.readouterr()
    return (e.value.code if isinstance(e.value.code, int) else 0), err


@pytest.mark.parametrize(
    ("mode", "needles"),
    [
        ("argmax", ["returned logits of dtype int64", "no gradient", "before any argmax"]),
        ("detach", ["returned logits that do not require grad", "remove the .detach()"]),
        ("int_loss", ["returned a loss of dtype int64", "as a float tensor"]),
        ("item_loss", ["returned a loss that does not require grad", ".item()"]),
        ("dict", ["returned dict with keys 'hidden', 'aux'", "under its key 'logits' or 'loss'"]),
    ],
)
def test_an_output_training_cannot_use_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str, needles: list[str]
) -> None:
    """Before: exit 1 at step 0's backward, torch's 'element 0 of tensors does not require grad', and a run
    directory of a run that never took a step; a dict without logits named none of its keys nor where the loop
    looks in it."""
    out, argv = _train_argv(tmp_path, "make", f"mode={mode}", "--steps", "2")
    rc, err = run_main([*argv, *TINY], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("precprof: error: "), err
    assert "element 0" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not out.exists()  # refused before its run directory was made


@pytest.mark.parametrize(
    ("mode", "needle"),
    [("detach", "returned logits that do not require grad"), ("dict", "returned dict with keys")],
)
def test_an_output_that_breaks_the_contract_in_training_says_where_the_partial_run_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str, needle: str
) -> None:
    """A model that breaks the contract from its 4th forward pass on (the measuring passes and a training step
    before it): the one line of what is wrong, then where the partial run is, as for any crash, exit 2. Detached
    logits were torch's error at the backward pass (exit 1); a dict met in training said its line alone, nothing
    of the run saved."""
    out, argv = _train_argv(tmp_path, "make", f"mode={mode}", "-a", "after=3")
    rc, err = run_main([*argv, "--steps", "3", "--no-report", *TINY], capsys)
    lines = err.strip().splitlines()
    summary = json.loads((out / T.SUMMARY_FILE).read_text())
    done = summary[T.SUMMARY_FINAL]["steps_done"]
    assert rc == 2 and 0 < done < 3, err
    assert len(lines) == 3 and needle in lines[0] and "element 0" not in err, err
    step = "step" if done == 1 else "steps"
    assert lines[1] == f"precprof: training stopped: the partial run is in {out} ({done} finished {step})"
    assert lines[2] == f"report: not rendered; `precprof report {out}` renders it"
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert needle in summary[T.SUMMARY_INCOMPLETE_REASON]


@pytest.mark.parametrize(
    ("kind", "args", "needles"),
    [
        (
            "sparse",
            [],
            ["emb.weight gets a sparse gradient", "--optimizer adamw cannot", "use --optimizer sgd,"],
        ),
        ("sparse", ["--optimizer", "sgd", "--weight-decay", "0.1"], ["SGD cannot add weight decay", "0, or"]),
        (
            "complex",
            ["--precision", "fp16"],
            ["filt is complex64", "GradScaler cannot unscale", "bf16 or fp32"],
        ),
        (
            "complex",
            ["--precision", "bf16-pure"],
            ["casts every parameter and buffer to bf16", "drop its imaginary part"],
        ),
        ("rope", ["--precision", "bf16-pure"], ["freqs is complex64", "drop its imaginary part"]),
    ],
)
def test_parameters_the_optimizer_or_precision_cannot_train_are_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, args: list[str], needles: list[str]
) -> None:
    """Before: nn.Embedding(sparse=True) crashed every run at step 0 in the loop's grad norm (exit 1, 143 lines
    of torch's dispatcher list, "a bug: please report it"), and AdamW or SGD's weight decay would have refused
    the sparse gradient next; a complex parameter under fp16's GradScaler died after step 0 the same way
    (torch's unscale has no complex kernel), and bf16-pure dropped its imaginary part without a word."""
    out, argv = _train_argv(tmp_path, "unusual", f"kind={kind}", "--steps", "2")
    rc, err = run_main([*argv, *args, *TINY], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("precprof: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not out.exists()  # refused before its run directory was made


@pytest.mark.parametrize(("kind", "optimizer"), [("sparse", "sgd"), ("tied", "adamw")])
def test_a_sparse_embedding_trains_with_an_optimizer_that_takes_its_gradient(
    tmp_path: Path, kind: str, optimizer: str
) -> None:
    """SGD takes sparse gradients, clipped (a small --grad-clip) and recorded at the norm of the dense gradient,
    computed apart; an embedding whose weight is also read densely (a tied head) gets a dense gradient, and
    AdamW trains it (the check before training asks autograd, not the layer's flag)."""
    (tmp_path / "m.py").write_text(MODELS)
    norms: list[float] = []

    class DenseNorm(Callback):
        def after_backward(self, run: TrainRun) -> None:
            grads = [p.grad for p in run.model.parameters() if p.grad is not None]
            assert any(g.is_sparse for g in grads) == (kind == "sparse")
            norms.append(math.sqrt(sum(float(g.to_dense().double().square().sum()) for g in grads)))

    config = TrainConfig(
        model=f"{tmp_path / 'm.py'}:unusual",
        model_args={"kind": kind},
        optimizer=optimizer,
        grad_clip=1e-3,
        steps=2,
        batch_size=2,
        seq_len=8,
        device="cpu",
        progress=False,
        report=False,
        out=tmp_path / "run",
    )
    result = train(config, callbacks=[DenseNorm()])
    assert result.summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert result.steps[T.GRAD_NORM].tolist() == pytest.approx(norms, rel=1e-5)
    assert len(norms) == 2 and min(norms) > 1e-3  # clipping was on at every step


def test_a_sparse_gradient_no_layer_announced_is_refused_at_step_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """F.embedding(..., sparse=True) on a dense layer's weight: nothing says so before training; step 0's
    gradients do, before AdamW meets them (its RuntimeError was "a bug in precprof's own code")."""
    out, argv = _train_argv(tmp_path, "unusual", "kind=functional")
    rc, err = run_main([*argv, "--steps", "2", "--no-report", *TINY], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 3, err
    assert "emb.weight gets a sparse gradient" in lines[0] and "use --optimizer sgd," in lines[0]
    assert lines[1] == f"precprof: training stopped: the partial run is in {out} (0 finished steps)"


@pytest.mark.parametrize(("kind", "refused"), [("sparse", True), ("tied", False)])
def test_a_sparse_gradient_under_fsdp_is_refused_before_training(kind: str, refused: bool) -> None:
    """Under torchrun with --distributed fsdp2 (or fsdp1) a sparse embedding died in step 0's backward (reviewer
    h108: fsdp2's chunk_cat and fsdp1's flattening have no sparse kernel; checked with torchrun on 2 gloo ranks):
    refused before training in one line, whatever the optimizer; a tied head's dense gradient is not refused."""
    namespace: dict[str, object] = {}
    exec(MODELS, namespace)
    model = namespace["unusual"](16, kind)
    ids = torch.randint(0, 16, (2, 8))

    def forward_loss(batch: int) -> torch.Tensor:
        return model(ids[:batch]).float().pow(2).mean()

    def check(sharded: str) -> None:
        contract.sparse_gradients("m.py:unusual", model, forward_loss, 2, "sgd", 0.0, sharded)

    check("")  # SGD without weight decay takes it outside FSDP
    if not refused:
        check("fsdp2")
        return
    for strategy in ("fsdp2", "fsdp1"):
        with pytest.raises(
            UserError, match=f"emb.weight gets a sparse gradient .* --distributed {strategy} cannot"
        ):
            check(strategy)
    assert all(p.grad is None for p in model.parameters())  # the pass set no gradient
