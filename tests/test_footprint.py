"""The memory estimate made before training: measured activations against the Profiler's own memory table,
the refusal of a run that cannot fit, and a measuring pass that leaves training untouched."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof.errors import UserError
from precprof.models import build_model
from precprof.training import footprint as FP
from precprof.training import loss_from_output

pytestmark = pytest.mark.usefixtures("one_thread")


def gpt_nano(seq: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return build_model("gpt-nano", {}, vocab_size=256, seq_len=seq).module


def forward_loss(model: nn.Module, batch: int, seq: int) -> torch.Tensor:
    seq_ids = torch.randint(0, 256, (batch, seq + 1))
    return loss_from_output(model(seq_ids[:, :-1]), seq_ids[:, 1:], 256)


def test_saved_activations_match_the_profilers_memory_table() -> None:
    """Independent: the Profiler's MemoryTracker counts the activations a real training step saves (per
    module, per storage). At batch 8 the estimate from batch 1, times 8, must be within 15% of it."""
    batch, seq = 8, 64
    model = gpt_nano(seq)
    per_sample = FP.saved_activation_bytes(model, lambda: forward_loss(model, 1, seq))
    prof = precprof.Profiler(model, sample_every=1)
    with prof:
        with prof.memory_scope():
            loss = forward_loss(model, batch, seq)
        loss.backward()
        prof.step(loss=loss.detach())
    mem = prof.tables()["memory"]
    measured = int(mem[mem[T.COMPONENT] == T.ACTIVATIONS][T.BYTES].sum())
    assert measured > 0
    assert per_sample * batch == pytest.approx(measured, rel=0.15)


def test_the_measuring_pass_changes_nothing() -> None:
    """Random state, BatchNorm running statistics and gradients are as they were: training is unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    rng = torch.get_rng_state()
    stats = model[1].running_mean.clone(), model[1].running_var.clone(), int(model[1].num_batches_tracked)
    n = FP.saved_activation_bytes(model, lambda: model(torch.randn(4, 8)).sum())
    assert n > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model[1].running_mean, stats[0]) and torch.equal(model[1].running_var, stats[1])
    assert int(model[1].num_batches_tracked) == stats[2]
    assert all(p.grad is None for p in model.parameters())


def test_refusal_names_the_parts_and_a_batch_that_fits() -> None:
    model = gpt_nano()
    fp = FP.estimate(
        model, batch_size=100_000, optimizer="adamw", forward_loss_one=lambda: forward_loss(model, 1, 64)
    )
    n_params = sum(p.numel() for p in model.parameters())
    assert (fp.parameters, fp.gradients, fp.optimizer_states) == (4 * n_params, 4 * n_params, 8 * n_params)
    available = 2**30
    with pytest.raises(UserError) as info:
        FP.check_fits(fp, available, what="gpt-nano at batch 100000", where="this machine")
    msg = str(info.value)
    assert "\n" not in msg and "gpt-nano at batch 100000 needs at least" in msg
    assert "parameters" in msg and "optimizer states" in msg and "activations" in msg
    fits = fp.largest_batch(available)
    assert f"use --batch-size {fits} or less" in msg
    ok = FP.Footprint(fp.parameters, fp.gradients, fp.optimizer_states, fp.activations_per_sample, fits)
    too_many = FP.Footprint(
        fp.parameters, fp.gradients, fp.optimizer_states, fp.activations_per_sample, fits + 1
    )
    FP.check_fits(ok, available, what="", where="")  # the suggested batch passes, one more does not
    with pytest.raises(UserError):
        FP.check_fits(too_many, available, what="", where="")
    FP.check_fits(fp, None, what="", where="")  # unknown memory: nothing refused


def test_a_model_too_large_even_alone() -> None:
    fp = FP.Footprint(
        parameters=8 * 2**30,
        gradients=8 * 2**30,
        optimizer_states=16 * 2**30,
        activations_per_sample=1,
        batch_size=1,
    )
    with pytest.raises(UserError, match="the model alone does not fit"):
        FP.check_fits(fp, 16 * 2**30, what="x", where="this machine")


def test_sgd_keeps_one_state_per_parameter() -> None:
    model = nn.Linear(10, 10)
    fp = FP.estimate(
        model, batch_size=1, optimizer="sgd", forward_loss_one=lambda: model(torch.randn(1, 10)).sum()
    )
    assert fp.optimizer_states == 4 * 110


def test_available_memory_is_read_on_this_machine() -> None:
    avail = FP.available_bytes(torch.device("cpu"))
    assert avail is None or 0 < avail < 2**50


@pytest.mark.slow
def test_gpt2_medium_at_batch_512_is_refused_before_training(tmp_path: pytest.TempPathFactory) -> None:
    """The run that the out-of-memory killer used to end at 24 GB with no message: one line, exit 2, no run
    directory, in seconds."""
    out = tmp_path / "run"  # type: ignore[operator]
    t0 = time.perf_counter()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "precprof",
            "train",
            "-m",
            "gpt2-medium",
            "--batch-size",
            "512",
            "--seq-len",
            "1024",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "gpt2-medium at batch 512 x seq 1024 in fp32 needs at least" in lines[0]
    assert "--batch-size" in lines[0] and not out.exists()  # type: ignore[attr-defined]
    assert time.perf_counter() - t0 < 240
