"""The names the advice's texts use, on real tiny CPU training runs: the recommendation's field a text points to,
a layer's input row named as that layer's input, and no finding named that the report does not hold."""

from __future__ import annotations

import re
import warnings

import torch
from scenarios import lost_updates
from scenarios.loop import regression_batches, train_profiled
from torch import nn

import precprof
from precprof.analysis.advisor.text import _pct
from precprof.report import environment


class _Ffn(nn.Module):
    """A T5-style feed-forward block (wi, ReLU, wo) on a residual stream, then a head. wo reads the ReLU's output
    scaled by 60000 in fp32, made between modules by code in the forward (as T5's own cast to wo's dtype makes
    it): a cast of that input to fp16 makes inf, and kept in fp32 (outside autocast), wo reads it finite."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.wi = nn.Linear(64, 256)
        self.act = nn.ReLU()
        self.wo = nn.Linear(256, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(h + self.wo(self.act(self.wi(h)).float() * 60000.0))


def test_a_layer_kept_in_fp32_is_said_to_be_in_fp16_keep_fp32_and_its_input_row_is_its_input() -> None:
    """wo kept in fp32 (outside autocast) under fp16, its fp32 input beyond 65504: the fp16_kept_fp32 remedy said
    "keep_fp32 lists it", where the recommendation's keep_fp32 is the list of the format it recommends (bf16 on an
    A100: wo is not in it) and the list that holds wo is fp16_keep_fp32; and it said "55 values an fp16 cast makes
    inf in wo:input, wo", naming wo's input row as if it were a module of its own. The remedy names
    fp16_keep_fp32 now, which holds wo under either verdict, and the row is said to be wo's input."""
    torch.manual_seed(0)
    model = _Ffn()
    read: list[torch.Tensor] = []
    model.wo.register_forward_pre_hook(lambda mod, args: read.append(args[0].detach()))
    run = train_profiled(
        model,
        regression_batches(32, batch=32),
        nn.functional.mse_loss,
        precision="fp16",
        loss_scale=2.0**8,
        keep_fp32=["wo"],
        steps=3,
        lr=1e-6,
    )
    assert len(read) == 3 and all(x.dtype == torch.float32 and bool(x.isfinite().all()) for x in read)
    over = sum(int(torch.isinf(x.half()).sum()) for x in read)  # what a cast to fp16 makes inf of wo's input
    assert over > 0
    for hardware, fmt in (("t4", "fp16"), ("a100", "bf16")):
        rec = run.recommend(hardware)
        assert rec.format == fmt and "wo" in rec.fp16_keep_fp32
        assert ("wo" in rec.keep_fp32) == (fmt == "fp16")  # keep_fp32 is the recommended format's list
        f = rec.finding("fp16_kept_fp32")
        assert f is not None and f.modules == ["wo"]
        assert f.remedy.startswith(
            "Keep wo in fp32 (outside autocast) under fp16, as this run does: the recommendation's fp16_keep_fp32 "
            "lists it; "
        )
        assert not re.search(r"(?<!fp16_)keep_fp32 lists", f.remedy)
        assert (
            f"wo: {over} values an fp16 cast makes inf in wo's input and wo's output (max |x| " in f.message
        )
        assert "wo:input" not in f.title + f.message + f.remedy


def test_a_what_if_names_fp32_lost_updates_only_where_that_finding_fires() -> None:
    """An fp32 MLP trained with AdamW at 1e-5: 3 of its 31,878 intended updates did not land in its fp32 weights
    (the truth, read around optimizer.step()), far below the 1% at which fp32_lost_updates warns, and it does not
    fire; bf16_lost_updates' message said of them "did not land in the run's own fp32 weights either
    (fp32_lost_updates)", naming a finding the report does not hold. It gives their share against that
    threshold now, and names fp32_lost_updates where it fires (the updates clipped to a norm of 1e-6)."""
    run, truth = lost_updates.run_layers(torch.float32, lr=1e-5)
    stuck, intended = int(truth["stuck"].sum()), int(truth["intended"].sum())
    assert 0 < stuck < 0.01 * intended
    rec = run.recommend()
    assert rec.finding("fp32_lost_updates") is None
    for f in rec.findings:
        assert "fp32_lost_updates" not in f.title + f.message + f.remedy + f.method
    whatif = rec.finding("bf16_lost_updates")
    assert whatif is not None and whatif.numbers["lost_in_fp32"] == stuck
    assert (
        f" {stuck} of them did not land in the run's own fp32 weights either ({_pct(stuck / intended)} of the "
        "updates, each parameter at its size: below the 1% at which precprof warns that fp32 weights do not train)."
        in whatif.message
    )

    clipped, truth = lost_updates.run_layers(torch.float32, lr=1e-2, sgd=True, clip=1e-6)
    rec = clipped.recommend()
    assert rec.finding("fp32_lost_updates") is not None
    whatif = rec.finding("bf16_lost_updates")
    assert whatif is not None
    assert (
        f" {int(truth['stuck'].sum()):,} of them did not land in the run's own fp32 weights either "
        "(fp32_lost_updates)." in whatif.message
    )


def _two_optimizers(second_steps: bool) -> dict[str, object]:
    """A tiny MLP trained 4 steps by an SGD over its matrices, the only optimizer given to the Profiler, and an
    AdamW over its biases (``second_steps``: the loop steps it too; else it is made and never stepped, as a slip
    that leaves the biases in no optimizer that steps). Returns the capture's summary."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    mats = torch.optim.SGD([p for p in model.parameters() if p.dim() == 2], lr=0.1)
    vecs = torch.optim.AdamW([p for p in model.parameters() if p.dim() == 1], lr=1e-3)
    biases = [p.detach().clone() for p in model.parameters() if p.dim() == 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with precprof.Profiler(
            model, optimizer=mats, memory=False, block_formats=False, sample_every=1
        ) as prof:
            for _ in range(4):
                model(torch.randn(4, 8)).square().mean().backward()
                mats.step()
                if second_steps:
                    vecs.step()
                mats.zero_grad()
                vecs.zero_grad()
                prof.step()
    moved = [
        not torch.equal(b, p)
        for b, p in zip(biases, [p for p in model.parameters() if p.dim() == 1], strict=True)
    ]
    assert moved == [second_steps, second_steps]  # the loop's own check: the AdamW stepped the biases, or not
    return prof.summary()


def test_parameters_a_second_optimizer_steps_are_not_said_to_be_in_no_optimizer() -> None:
    """Two optimizers, an SGD over the matrices (given to the Profiler) and an AdamW over the biases (not given),
    both stepping: the environment's row read "trainable not in optimizer 0=bias, 2=bias", the biases the AdamW
    held and stepped (tester t2). They are said apart now, as stepped by an optimizer the Profiler was not given;
    a bias no optimizer steps (the AdamW made and never stepped) is still said to be in no optimizer followed."""
    capture = _two_optimizers(second_steps=True)
    assert "trainable_not_in_optimizer" not in capture
    assert capture["trainable_in_optimizer_not_given"] == {"0": ["bias"], "2": ["bias"]}
    rows = dict(environment.capture_rows(capture, {}))
    assert rows["stepped by another optimizer"] == (
        "0.bias, 2.bias: held by an optimizer the Profiler was not given, which stepped them; their updates were "
        "not read"
    )
    assert not any("not in" in label or "no optimizer" in label for label in rows)
    assert not any(re.search(r"\b\w+=\S", v) for v in rows.values())

    idle = _two_optimizers(second_steps=False)
    assert idle["trainable_not_in_optimizer"] == {"0": ["bias"], "2": ["bias"]}
    assert "trainable_in_optimizer_not_given" not in idle
    rows = dict(environment.capture_rows(idle, {}))
    assert rows["trainable, in no optimizer followed"].startswith("0.bias, 2.bias: in no param group of the ")
    assert "stepped by another optimizer" not in rows
