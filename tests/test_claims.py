"""What the advisor and the report claim is what the run measured: each test trains a tiny real run that has the
problem (nothing sampled, a hand-cast model, a CPU, a diverged fp16 run, a killed run, an fp32 run with a
scaler, a comparison) and checks the words the user reads against what was recorded.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import re
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import forks
import numpy as np
import pytest
import torch
from scenarios.loop import backward_and_step
from torch import nn

import precprof
from precprof import hardware
from precprof import tables as T
from precprof.analysis.advisor import AdvisorConfig, Finding
from precprof.report import filters, plots
from precprof.training import Callback, TrainConfig, TrainRun, train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"n_layer": 1, "n_embd": 32}


def tiny(out: Path, **kw: Any) -> Path:
    """A real ``precprof train`` run of a one-layer gpt-nano (batch 2 x 16), its report rendered."""
    cfg: dict[str, Any] = dict(
        model="gpt-nano",
        model_args=dict(TINY),
        steps=3,
        batch_size=2,
        seq_len=16,
        sample_every=1,
        progress=False,
        out=out,
        report=True,
    )
    cfg.update(kw)
    torch.manual_seed(0)
    train(TrainConfig(**cfg))
    return out


def section(page: str, sid: str) -> str:
    m = re.search(rf'<section id="{sid}">(.*?)</section>', page, re.S)
    assert m is not None, sid
    return m.group(1)


def words(fragment: str) -> str:
    """The text of an HTML fragment, as a reader sees it (tags out, entities decoded, spaces collapsed)."""
    text = re.sub(r"<[^>]+>", " ", re.sub(r"<img[^>]*>", " ", fragment))
    return re.sub(r"\s+", " ", html.unescape(text)).strip()


# ------------------------------------------------------------------------------------------------ item 8
def test_a_run_that_sampled_nothing_claims_no_measurement(tmp_path: Path) -> None:
    """``--sample-every 0``: no layer rows, so no gradient was measured against any format. The reasons say
    so; nothing says "the measured gradients do not underflow it", "the measurements allow" or "as measured"."""
    run = tiny(tmp_path / "s0", sample_every=0)
    assert T.read_tables(run)["layers"].empty
    # nor was autocast seen: not observed (null), where it said {"enabled": false}, autocast off
    assert T.read_summary(run)[T.SUMMARY_CAPTURE]["autocast"] is None
    rec = T.read_summary(run)[T.SUMMARY_RECOMMENDATION]
    reasons = " ".join(rec["reasons"])
    assert "do not underflow" not in reasons and "measurements allow" not in reasons
    assert "not measured" in reasons and "--sample-every" in reasons
    assert not rec.get("measured_format")
    scale = next(f for f in rec["findings"] if f["code"] == "fp16_loss_scale")
    assert "recorded no gradient" in scale["message"] and "--sample-every 0" in scale["message"]
    assert "no finite nonzero gradient" not in scale["message"]  # as if its gradients were all zero
    page = (run / T.REPORT_FILE).read_text()
    verdict = words(section(page, "verdict"))
    assert "as measured" not in verdict and "measurements allow" not in verdict
    assert "not measured" in verdict
    # where the format is chosen for the machine alone, the reason says the gradients were not measured
    big = precprof.recommend(run, hardware="h100", config=AdvisorConfig(small_model_params=0))
    assert big.format == "bf16"
    assert "do not underflow" not in " ".join(big.reasons)
    assert "not measured" in " ".join(big.reasons)


def test_a_run_whose_first_forward_failed_claims_no_measurement(tmp_path: Path) -> None:
    """The first layer's matmul fails on the first step (the data has 15 features, the layer takes 16): the run
    recorded the layer's weights and the model's input, no layer's output and no gradient. Nothing a format
    rule reads was measured, so no format is "what the measurements allow"."""

    class TwoLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    model = TwoLayers()
    prof = precprof.Profiler(model, optimizer=torch.optim.AdamW(model.parameters()), sample_every=1)
    with pytest.raises(RuntimeError), prof:
        model(torch.randn(4, 15))
    layers = prof.tables()["layers"]
    assert T.WEIGHT in set(layers[T.TENSOR]) <= {T.ACTIVATION, T.WEIGHT}  # weights, and the input at most
    assert T.texts(layers[layers[T.TENSOR] == T.ACTIVATION][T.MODULE]).str.endswith(T.INPUT_SUFFIX).all()
    rec = precprof.recommend(prof, config=AdvisorConfig(small_model_params=0))
    reasons = " ".join(rec.reasons)
    assert not rec.measured_format
    assert "no forward pass finished a layer" in reasons and "do not underflow" not in reasons
    # one layer's output is a measurement: a run whose second layer failed keeps its verdict
    bad_b = TwoLayers()
    bad_b.b = nn.Linear(15, 16)
    prof = precprof.Profiler(bad_b, sample_every=1)
    with pytest.raises(RuntimeError), prof:
        bad_b(torch.randn(4, 16))
    assert precprof.recommend(prof, config=AdvisorConfig(small_model_params=0)).measured_format == "bf16"


# ------------------------------------------------------------------------------------------------ item 9
class HandCast(nn.Module):
    """An fp32 model whose LayerNorm and softmax were cast to bf16 by hand (no autocast anywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.ln = nn.LayerNorm(32).to(torch.bfloat16)
        self.attn = nn.Softmax(dim=-1)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.inp(x).to(torch.bfloat16))
        return self.out((h * self.attn(h)).float())


def test_norm_and_softmax_cast_to_bf16_in_an_fp32_run_is_a_warning_that_names_them() -> None:
    """The softmax is named; torch's LayerNorm, which computes in fp32 inside, is said not to need it."""
    torch.manual_seed(0)
    model = HandCast()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1)
    with prof:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    rec = precprof.recommend(prof.tables(), summary={T.SUMMARY_CAPTURE: prof.summary()})
    found = [f for f in rec.findings if f.code == "bf16_fp32_ops"]
    assert len(found) == 1
    f = found[0]
    assert f.severity == "warning"
    # torch's LayerNorm computes in fp32 inside and rounds its output once (checked): said, not named
    x = torch.randn(8, 32).bfloat16() * 30
    ln = model.ln
    wide = nn.functional.layer_norm(x.float(), (32,), ln.weight.float(), ln.bias.float()).bfloat16()
    assert (ln(x).float() - wide.float()).abs().max() <= 2.0**-6  # within a bf16 unit at |y| < 4
    assert f.modules == ["attn"]
    assert (
        "attn" in f.message
        and "(ln also produced bfloat16 outputs, but torch's LayerNorm computes" in f.message
    )
    assert ".float()" in f.remedy


# ----------------------------------------------------------------------------------------------- item 10
def test_on_a_cpu_no_text_claims_bf16_is_faster_than_it_measured(tmp_path: Path) -> None:
    """One answer on a CPU with native bf16: the advisor's verdict for a small model is fp32, and neither its
    finding about the CPU nor ``precprof env`` says bf16 autocast saves time, which no single run measures:
    both point at ``precprof compare``, which times it."""
    run = tiny(tmp_path / "cpu", report=False)  # the advisor's answer is read, not the page
    cpu = dataclasses.replace(hardware.detect(torch.device("cpu")), bf16_native=True, name="AMD EPYC")
    rec = precprof.recommend(run, hardware=cpu)
    assert rec.format == "fp32"
    native = next(f for f in rec.findings if f.code == "bf16_native")
    said = f"{native.title} {native.message} {native.remedy}".lower()
    assert "is faster" not in said and "save memory and time" not in said
    assert "precprof compare" in said
    fmt, why = hardware.usual_format(cpu)
    assert fmt == rec.format == "fp32"
    assert "is faster than fp32" not in why and "precprof compare" in why


# ----------------------------------------------------------------------------------------------- item 11
def test_the_memory_saving_is_a_saving_of_the_peak_and_each_figure_is_named_once(tmp_path: Path) -> None:
    run = tiny(tmp_path / "mem", precision="bf16")
    mem = T.read_tables(run)["memory"]
    at_peak = T.memory_at(mem, T.MOMENT_PEAK)
    assert not at_peak.empty  # the built-in loop breaks the allocator's peak down
    last = at_peak[(at_peak[T.STEP] == at_peak[T.STEP].max()) & (at_peak[T.COMPONENT] != T.ALLOCATOR_CACHE)]
    peak = float(last[T.BYTES].sum())
    page = (run / T.REPORT_FILE).read_text()
    verdict = words(section(page, "verdict"))
    saving = re.search(r"expected memory saving (.*?)(?: Configuration to paste| Why|$)", verdict)
    assert saving is not None, verdict
    # the verdict's saving is of the allocator's peak, quoted as the memory section quotes it
    assert "peak" in saving.group(1) and filters.nbytes(peak) in saving.group(1), saving.group(1)
    memory = words(section(page, "memory"))
    assert filters.nbytes(peak) in memory
    # precprof's own buffers: one figure, named once on the page, not again in the environment
    env = words(section(page, "environment"))
    assert "profiler buffers" not in env.lower() and "profiler scratch" not in env.lower()
    assert memory.count("precprof's own buffers") == 1, memory
    # one measured total: the projection table does not repeat this run's measurement as a row of its own
    assert not re.search(r"\bbf16 measured\b", memory)
    # this peak is the optimizer step's (the logits 2.6% of it): the logits are not named as its lever
    assert 'id="memory-logits"' not in page


def test_logits_that_dominate_the_peak_are_named_as_its_lever(tmp_path: Path) -> None:
    run = tiny(tmp_path / "logits", precision="bf16", batch_size=8, seq_len=64, steps=2)
    mem = T.read_tables(run)["memory"]
    at_peak = T.memory_at(mem, T.MOMENT_PEAK)
    last = at_peak[(at_peak[T.STEP] == at_peak[T.STEP].max()) & (at_peak[T.COMPONENT] != T.ALLOCATOR_CACHE)]
    peak = float(last[T.BYTES].sum())
    memory = words(section((run / T.REPORT_FILE).read_text(), "memory"))
    # the logits (8 x 64 tokens x 256 classes, bf16 under autocast) and what follows from them, each figure as the
    # peak's parts have it: the outputs, the loss's saved tensors, and at most two fp32 tensors of the logits'
    # size among the temporaries allocated after forward
    logits = re.search(
        r"The model's outputs are this peak's lever ?, up to ([\d.]+)% of it: (.*?) Activation", memory
    )
    assert logits is not None, memory
    elements = 8 * 64 * 256
    part = last.groupby(T.texts(last[T.COMPONENT]) + ":" + T.texts(last[T.MODULE]))[T.BYTES].sum()
    outputs, loss, after = part["outputs:"], part["activations:(loss)"], part["temporaries:backward"]
    dtypes = T.texts(last[T.DTYPE])[last[T.COMPONENT] == T.OUTPUTS].tolist()
    assert outputs == 2 * elements and dtypes == ["bfloat16"]
    said = logits.group(2)
    assert f"{elements:,} elements ({filters.nbytes(outputs)})" in said, said
    assert (
        f"the loss saved for the backward pass ({filters.nbytes(loss)})" in said
        and filters.nbytes(4 * elements) + " each" in said
    )
    share = (outputs + loss + min(after, 8 * elements)) / peak
    assert share >= 0.25 and logits.group(1) + "%" == filters.pct(share), (logits.group(1), share)


# ----------------------------------------------------------------------------------------------- item 12
def test_a_diverged_fp16_run_counts_every_skipped_step_and_the_verdict_says_it_diverged(
    tmp_path: Path,
) -> None:
    run = tiny(tmp_path / "div", precision="fp16", lr=3.0, grad_clip=0.0, steps=16, sample_every=4)
    steps = T.read_tables(run)["steps"]
    skipped = int(T.flags(steps[T.SKIPPED]).sum())
    first_bad = int(steps[T.STEP][~np.isfinite(steps[T.LOSS].to_numpy(dtype=float))].min())
    assert first_bad < 11 and skipped > 1  # the run diverged and the scaler skipped steps on both sides
    rec = T.read_summary(run)[T.SUMMARY_RECOMMENDATION]
    f = next(f for f in rec["findings"] if f["code"] == "scaler_skipped_steps")
    before = int(T.flags(steps[T.SKIPPED][steps[T.STEP] < first_bad]).sum())
    assert f["numbers"]["skipped"] == before
    assert f["numbers"]["skipped_after_divergence"] == skipped - before
    assert f"{skipped:,}" in f["message"] and f"step {first_bad}" in f["message"]
    page = (run / T.REPORT_FILE).read_text()
    verdict = section(page, "verdict")
    assert 'id="verdict-diverged"' in verdict
    assert f"diverged at step {first_bad}" in words(verdict)


KILL_AT = 7  # sampled every 3rd step: steps 3 and 6 sampled, 1, 2, 4 and 5 not, once step 0 is left out
KILLED = textwrap.dedent(
    f"""
    import os, signal, sys, torch
    from precprof.training import Callback, TrainConfig, train
    class Kill(Callback):
        def on_step_end(self, run):
            if run.step == {KILL_AT}:
                run.profiler._recorded.sink.drain()  # every flush queued on disk (a sleep of 2 s waited)
                os.kill(os.getpid(), signal.SIGKILL)
    torch.set_num_threads(1)
    train(TrainConfig(model="gpt-nano", model_args={TINY!r}, steps=50, batch_size=2, seq_len=16,
                      sample_every=3, progress=False, out=sys.argv[1]), callbacks=[Kill()])
    """
)


def test_a_killed_run_claims_no_cost_of_a_sampled_step_from_too_few_steps(tmp_path: Path) -> None:
    """A run killed after a handful of steps has one or two steps of each kind: no ratio of their times is a
    measured cost of profiling, and the page gives none (it says how many steps of each kind were timed)."""
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    # a fork of the preloaded Python (tests/forks.py), killed by a real SIGKILL as a fresh process is
    res = forks.run([sys.executable, "-c", KILLED, str(out)], env=env, capture_output=True, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr.decode()[-2000:]
    page = precprof.report.render.render_run_dir(out).read_text()
    assert "The run was cut off" in page
    headline = words(page.split('<ul class="headline">', 1)[1].split("</ul>", 1)[0])
    assert "× an unsampled one" not in headline, headline
    assert "not measured" in headline


def test_an_fp32_run_with_a_dynamic_scaler_gets_no_fp16_warning(tmp_path: Path) -> None:
    """``--precision fp32 --loss-scale dynamic``: the run never trained in fp16, its measurements allow bf16
    here, so what fp16 would lose is information, as in any fp32 run."""
    # batch 8 x 64: gradients small enough that more than 1% of them would vanish in fp16 at scale 1
    run = tiny(tmp_path / "fp32dyn", loss_scale="dynamic", batch_size=8, seq_len=64, steps=2, report=False)
    rec = precprof.recommend(run, config=AdvisorConfig(small_model_params=0))
    assert rec.measured_format == "bf16"
    warned = [f.code for f in rec.findings if f.code.startswith("fp16_") and f.severity != "info"]
    assert warned == []


def test_compare_page_says_what_ran_and_no_signed_zero(tmp_path: Path) -> None:
    """A real comparison in one process: its setup names no distributed strategy (none ran), and a gap too
    small for two decimals is never written as -0.00%."""
    from precprof.compare import compare

    base = TrainConfig(
        model="gpt-nano",
        model_args=dict(TINY),
        steps=3,
        batch_size=2,
        seq_len=16,
        sample_every=1,
        progress=False,
        report=False,
    )
    comparison = compare(base, "fp32,bf16", out=tmp_path / "cmp")
    page = (tmp_path / "cmp" / "compare.html").read_text()
    setup = words(section(page, "setup"))
    assert "ddp" not in setup and "distributed" not in setup
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["reference"] == "fp32"
    assert comparison.run("bf16").gap is not None
    for gap in (-1e-7, -4e-5, 0.0, 3e-6):
        assert filters.signed_pct(gap) not in ("-0.00%", "+0.00%", "-0%")
    assert filters.signed_pct(-0.0123) == "−1.23%" and filters.signed_pct(0.0004) == "+0.04%"
    assert filters.signed_pct(-4e-5) == "−0.004%"
    assert "-0.00%" not in page and "+0.00%" not in page


def test_a_static_scale_a_little_too_high_is_blamed_on_the_scale_not_the_model(tmp_path: Path) -> None:
    """Static 2^24: every step skipped, and the finite gradients recorded (0.00307 at the most) fit fp16 at
    that scale, as every finite one must. Skips that persist to the end were read as the model's own nan/inf:
    a critical "nan/inf first appears in the backward pass", "a lower loss scale will not help", and "backed the
    scale off from 2^24 to 2^24". A scale that never backs off proves nothing by persisting; gradients within
    2^4 of the limit are an overflow's (a rerun at 2^18, two advices on, skips 9 of 10, and 2^15 none)."""
    run = tiny(tmp_path / "st24", precision="fp16", loss_scale="static:16777216", steps=10, report=False)
    assert T.flags(T.read_tables(run)["steps"][T.SKIPPED]).all()
    codes = {f.code: f for f in precprof.recommend(run).findings}
    assert "nonfinite_backward" not in codes
    skipped = codes["scaler_skipped_steps"]
    assert "from the model" not in skipped.message and "static (it never backs off)" in skipped.message
    overflow = codes["fp16_gradient_overflow"]
    assert overflow.severity == "warning" and "at loss scale 1.67772e+07;" in overflow.message
    assert codes["fp16_loss_scale"].numbers["loss_scale_log2"] < 24


@pytest.mark.parametrize("loss_scale", ["static:1e30", "dynamic"])
def test_a_loss_scale_far_too_high_is_blamed_on_the_scale_not_the_model(
    tmp_path: Path, loss_scale: str
) -> None:
    """fp16 at a scale of 1e30, static or dynamic (backing off from it): every gradient overflows, none is finite,
    every step is skipped. Persisting skips had the advisor say the nan/inf came from the model's backward and
    "a lower loss scale will not help", and size a start from a lower bound as if it were a fix. A rerun at 2^15
    trains with no skip: the scale was the cause."""
    run = tiny(
        tmp_path / "huge", precision="fp16", loss_scale=loss_scale, init_scale=1e30, steps=10, report=False
    )
    steps = T.read_tables(run)["steps"]
    assert T.flags(steps[T.SKIPPED]).all()
    rec = precprof.recommend(run)
    codes = {f.code: f for f in rec.findings}
    assert "nonfinite_backward" not in codes
    skipped = codes["scaler_skipped_steps"]
    assert "not the cause" not in skipped.remedy and "from the model" not in skipped.message
    assert ("static (it never backs off)" in skipped.message) == loss_scale.startswith("static")
    overflow = codes["fp16_gradient_overflow"]
    assert "at the most" in overflow.remedy and "lower bound" in overflow.remedy
    assert ("never lowers" in overflow.message) == loss_scale.startswith("static")
    if loss_scale == "dynamic":  # (the rerun is the same for either: run once)
        fixed = tiny(tmp_path / "fixed", precision="fp16", loss_scale="static:32768", steps=3, report=False)
        assert not T.flags(T.read_tables(fixed)["steps"][T.SKIPPED]).any()


def _gelu_mlp(n_in: int, hidden: int, n_out: int) -> torch.nn.Module:
    """Linear, GELU, Linear, GELU, Linear; seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(n_in, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, n_out),
    )


def test_a_model_cast_to_fp16_in_a_users_loop_trains_in_fp16_and_is_warned(tmp_path: Path) -> None:
    """``model.half()`` with fp32 master weights by hand, no autocast, no scaler: the profiler saw "fp16-pure",
    a quarter of the fp16 activation gradients were flushed, and the finding was demoted to information titled
    "what fp16 would do", as for a run that never trained in fp16. It stays a warning."""
    model = _gelu_mlp(32, 64, 1).half()
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-3)
    with precprof.Profiler(model, sample_every=1, out=tmp_path / "half") as prof:
        for _ in range(4):
            x, y = torch.randn(64, 32), torch.randn(64, 1)
            loss = (model(x.half()).float() - y).pow(2).mean() * 1e-4  # gradients small enough to flush
            loss.backward()
            for m, p in zip(master, model.parameters(), strict=True):
                m.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, model.parameters(), strict=True):
                    p.copy_(m)
            opt.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    prof.save()
    summary = json.loads((tmp_path / "half" / "summary.json").read_text())
    assert summary["capture"]["precision_seen"] == "fp16-pure"
    grads = prof.tables()["layers"]
    grads = grads[grads[T.TENSOR] == T.ACTIVATION_GRAD]
    assert grads[T.ZEROS].sum() / grads[T.NUMEL].sum() > 0.05  # flushed: the fp32 reference has no zeros
    (f,) = [f for f in precprof.recommend(tmp_path / "half").findings if f.code == "fp16_gradient_underflow"]
    assert f.severity == "warning" and "what fp16 would do" not in f.title and "demoted_from" not in f.numbers


def test_a_grad_scaler_in_a_bf16_loop_is_said_to_have_nothing_to_do(tmp_path: Path) -> None:
    """bf16 autocast with a dynamic GradScaler (growth every 2 steps): its scale grew from 2^16 to 2^25 in 20
    steps and nothing said the scaler was needless. An fp16 run's scaler gets no such finding. In an fp64 model
    (``model.double()``) the finding said the scaled gradients would "overflow fp32 itself": they are float64,
    and it names the dtype the run's weight gradients were recorded in."""
    found = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
        double = dtype is torch.float64
        model = model.double() if double else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", growth_interval=2)
        out = tmp_path / str(dtype).split(".")[-1]
        steps = 4 if double else 20
        with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=5, out=out) as prof:
            for _ in range(steps):
                with torch.autocast("cpu", dtype=dtype, enabled=not double):
                    x, y = torch.randn(8, 16, dtype=dtype if double else None), torch.randn(8, 1)
                    loss = (model(x).to(y.dtype) - y).pow(2).mean()
                backward_and_step(loss, opt, scaler)
                opt.zero_grad()
                prof.step(loss=loss.detach())
        if not double:  # (the fp64 run is advised from the Profiler: no run directory to write)
            prof.save()
        found[dtype] = {f.code: f for f in precprof.recommend(prof if double else out).findings}
        steps = prof.tables()["steps"]
        if dtype is torch.bfloat16:
            assert not T.flags(steps[T.SKIPPED]).any() and steps[T.LOSS_SCALE].iloc[-1] == 2.0**25
    f = found[torch.bfloat16]["scaler_unneeded"]
    assert f.severity == "info" and "bf16 run" in f.title
    assert (
        "scaled its loss: the scale started at 2^16 (65536) and grew to 2^25 (33554432) over 20 steps."
        in f.message
    )
    assert "until the scaled gradients overflow fp32 itself" in f.message
    assert f.numbers == {"start_scale": 2.0**16, "last_scale": 2.0**25}
    assert "scaler_unneeded" not in found[torch.float16]
    f = found[torch.float64]["scaler_unneeded"]
    assert "fp64 run" in f.title and "fp64 has a wider exponent range than fp32's" in f.message
    assert "until the scaled gradients overflow fp64 itself" in f.message and "fp32 itself" not in f.message


def _static_fp16_run(out: Path, scale: float) -> tuple[Finding, float]:
    """The GELU MLP under fp16 autocast at a static loss scale, its loss x 1e-6, 4 steps: its
    fp16_gradient_underflow, and the share of exact zeros among its layers' output gradients (the test's own
    hooks; a GELU writes no exact zero in backward, so each is a flush)."""
    model = _gelu_mlp(16, 32, 4)
    seen: list[torch.Tensor] = []

    def keep(mod: nn.Module, args: object, y: torch.Tensor) -> None:
        y.register_hook(lambda g: seen.append(g.detach().flatten()))

    for m in model:
        m.register_forward_hook(keep)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10**9)
    scaler.set_growth_factor(1.0)
    scaler.set_backoff_factor(1.0)
    g = torch.Generator().manual_seed(1)
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, out=out) as prof:
        for _ in range(4):
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (model(x).float() - y).pow(2).mean() * 1e-6
            backward_and_step(loss, opt, scaler)
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    prof.save()
    (f,) = [f for f in precprof.recommend(out).findings if f.code == "fp16_gradient_underflow"]
    return f, float((torch.cat(seen) == 0).float().mean())


def test_zeros_a_larger_scale_does_not_have_are_warned_of_not_nothing_to_fix(tmp_path: Path) -> None:
    """fp16 autocast at a static scale of 1024 and a tiny loss: 5.2% of the fp16 activation gradients are zeros,
    and a rerun at 2^32 has none (they were flushed). The finding said "Nothing to fix ... 0% of the values
    recorded flush", then that the zeros may hold flushes. Those gradients run into fp16's floor at 1024, with
    fewer flushes than the 20% that called them "flushed to zero": a warning says so now, and that the
    recommended scale lifts them. The rerun at that scale is told "Nothing to fix"."""
    f, zeros = _static_fp16_run(tmp_path / "run", 1024.0)
    again, none = _static_fp16_run(tmp_path / "rerun", 2.0**32)
    assert zeros > 0.01 and none == 0.0
    assert f.severity == "warning" and f.numbers["fp16_flushed"] and "Nothing to fix" not in f.remedy
    assert f.title.startswith("fp16 gradients run into fp16's floor at loss scale 1024: ")
    assert f.remedy.startswith("Scale the loss: GradScaler(init_scale=4294967296), ")
    assert f.numbers["fp16_zero_share"] == pytest.approx(zeros, rel=1e-6)
    assert again.severity == "info" and again.remedy.startswith("Nothing to fix")


@pytest.mark.parametrize("per_micro_batch", [True, False])
def test_prof_step_per_micro_batch_is_told(tmp_path: Path, per_micro_batch: bool) -> None:
    """Gradient accumulation over 4 micro-batches with ``prof.step()`` after each: 12 "steps" for 3 optimizer
    steps, 9 sampled steps with half-accumulated gradients and no update, and no word anywhere, though the
    optimizer's hooks saw it did not step. Called once per optimizer step, nothing is said."""
    model = _gelu_mlp(16, 32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, out=tmp_path / "run") as prof:
        for _ in range(3):
            for _ in range(4):
                loss = model(torch.randn(8, 16)).square().mean() / 4
                loss.backward()
                if per_micro_batch:
                    prof.step(loss=loss.detach())
            opt.step()
            opt.zero_grad()
            if not per_micro_batch:
                prof.step(loss=loss.detach())
    prof.save()
    found = {f.code: f for f in precprof.recommend(tmp_path / "run").findings}
    if not per_micro_batch:
        assert "steps_without_update" not in found
        return
    f = found["steps_without_update"]
    # the optimizer stepped after prof.step() of micro-batches 3, 7 and 11, inside steps 4 and 8 (and after the
    # last one, in a step the with block ended with nothing but that optimizer step: no step is made of it); 10 of
    # the 12 sampled steps with gradients saw no update
    layers = prof.tables()["layers"]
    assert sorted(set(layers.loc[layers[T.TENSOR] == T.WEIGHT_UPDATE, T.STEP])) == [4, 8]
    assert f.numbers == {"steps_without_update": 10, "sampled_steps_with_grads": 12}
    assert f.severity == "warning" and "once per optimizer step" in f.remedy


@pytest.mark.parametrize("per_micro_batch", [True, False])
def test_prof_step_per_micro_batch_sampled_only_between_optimizer_steps_is_told(
    tmp_path: Path, per_micro_batch: bool
) -> None:
    """Gradient accumulation over 2 micro-batches, ``prof.step()`` after each, ``sample_every=2`` (tester t2): every
    sampled step is a first micro-batch, no sampled step reads a weight update, and nothing said so: the rule
    needed updates on other sampled steps, and the page said "weight updates read on up to 256 elements of each
    parameter". The capture knows which sampled steps read gradients and saw no optimizer step
    (``capture.loop_order``): the finding fires from that, and the page says no update was read, and why. Called
    once per optimizer step, nothing is said and the updates are read."""
    out = tmp_path / "run"
    model = _gelu_mlp(16, 32, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with precprof.Profiler(model, optimizer=opt, sample_every=2, out=out) as prof:
        for i in range(16):
            loss = model(torch.randn(8, 16)).square().mean() / 2
            loss.backward()
            if (i + 1) % 2 == 0:
                opt.step()
                opt.zero_grad()
            if per_micro_batch or (i + 1) % 2 == 0:
                prof.step(loss=loss.detach())
    prof.save()
    layers = prof.tables()["layers"]
    updated = set(layers.loc[layers[T.TENSOR] == T.WEIGHT_UPDATE, T.STEP])
    found = {f.code: f for f in precprof.recommend(out).findings}
    page = words(prof.report(out).read_text())
    row = page[page.index("weight updates read on") :][:400]
    if not per_micro_batch:
        assert updated and "steps_without_update" not in found
        assert (
            "optimizer_not_stepped"
            not in json.loads((out / "summary.json").read_text())["capture"]["loop_order"]
        )
        assert row.startswith("weight updates read on up to 256 elements of each parameter")
        return
    assert not updated
    f = found["steps_without_update"]
    assert f.severity == "warning" and "once per optimizer step" in f.remedy
    # sampled steps 0, 2, ..., 14 (the 8 first micro-batches) read gradients; the optimizer stepped in none of them
    assert f.numbers == {"steps_without_update": 8, "sampled_steps_with_grads": 8}
    assert "no weight update was read" in f.message
    assert row.startswith(
        "weight updates read on none: the optimizer the Profiler was given stepped on none of the 8"
    )
    assert "once per micro-batch" in row


def _accumulating_run(
    out: Path, scaler: Any, loss_of: Any, micro_batches: int = 6, late: bool = False
) -> tuple[list[int], list[float]]:
    """Optimizer steps of 3 micro-batches each, ``prof.step()`` after every micro-batch (the optimizer steps after
    the third, before its prof.step(), as under accelerate's ``accumulate``; ``late``: after it, in the next
    micro-batch's step before its forward); ``loss_of(model, micro, x, y)`` makes a micro-batch's loss. Returns the
    precprof steps at which the optimizer really stepped, and the loss scale in effect at each."""
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    at: list[int] = []
    scales: list[float] = []
    step = [0]
    opt.register_step_post_hook(lambda *a: at.append(step[0]))
    g = torch.Generator().manual_seed(1)
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, out=out) as prof:
        for micro in range(micro_batches):
            x, y = torch.randn(8, 16, generator=g) * 0.05, torch.randn(8, 4, generator=g) * 0.1
            loss = loss_of(model, micro, x, y)
            scales.append(scaler.get_scale() if scaler is not None else 1.0)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if late:
                prof.step(loss=loss.detach())
                step[0] += 1
            if micro % 3 == 2:  # the third micro-batch: the optimizer steps
                if scaler is None:
                    opt.step()
                else:
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
            if not late:
                prof.step(loss=loss.detach())
                step[0] += 1
    prof.save()
    return at, scales


def _sqrt_at_zero(model: nn.Linear, micro: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """At micro-batch 0 a loss whose gradient is inf and whose value is finite: sqrt of an output that is
    exactly 0 (the input and the bias are 0); a mean square after."""
    if micro:
        return (model(x) - y).square().mean()
    with torch.no_grad():
        model.bias.zero_()
    return model(torch.zeros_like(x)).clamp_min(0).sqrt().mean()


def _fp16_square(model: nn.Linear, micro: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        pred = model(x)
    return (pred.float() - y).square().mean()


def test_nan_inf_at_a_micro_batch_is_not_said_of_an_optimizer_step(tmp_path: Path) -> None:
    """``prof.step()`` per micro-batch and an inf gradient at micro-batch 0: a critical finding said "the optimizer
    step was not skipped" for a step where no optimizer step ran at all. It says so, and names the optimizer step
    that took the gradients in."""
    at, _ = _accumulating_run(tmp_path / "run", None, _sqrt_at_zero)
    assert at == [2, 5]  # independently, by the optimizer's own hook
    found = {f.code: f for f in precprof.recommend(tmp_path / "run").findings}
    f = found["nonfinite_backward"]
    assert f.numbers["step"] == 0 and f.numbers["optimizer_step"] == at[0]
    assert "was not skipped for it" not in f.message
    assert "no optimizer step ran at step 0" in f.message
    assert f"the next optimizer step, at step {at[0]}, was not skipped" in f.message


def _sqrt_at_three(model: nn.Linear, micro: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _sqrt_at_zero(model, 0 if micro == 3 else 1, x, y)


def test_nan_inf_after_a_late_optimizer_step_is_said_of_the_next_one(tmp_path: Path) -> None:
    """``prof.step()`` per micro-batch with the optimizer stepping after it (tester h107): the step of micro-batch 3
    records an optimizer step that ran before its forward, on micro-batches 0-2. An inf gradient at micro-batch 3
    was said to be in a step whose "optimizer step was not skipped for it"; it went to the next optimizer step."""
    with pytest.warns(UserWarning, match="stepped before the model's forward"):
        at, _ = _accumulating_run(tmp_path / "run", None, _sqrt_at_three, micro_batches=9, late=True)
    assert at == [3, 6, 9]  # independently, by the optimizer's own hook: before the forward of steps 3 and 6
    f = {f.code: f for f in precprof.recommend(tmp_path / "run").findings}["nonfinite_backward"]
    assert f.numbers["step"] == 3 and f.numbers["optimizer_step"] == 6
    assert "was not skipped for it" not in f.message
    assert "the optimizer step recorded at step 3 ran before its forward" in f.message
    assert "the next optimizer step, at step 6, was not skipped" in f.message


def test_one_optimizer_step_before_a_forward_leaves_the_later_steps_their_own(tmp_path: Path) -> None:
    """An optimizer step before the forward once (step 3: step 2's gradients stepped late), the loop regular
    otherwise (reviewer h108): an inf gradient at step 6, which GradScaler skipped at step 6, was said to have "went
    to a later one, and the next optimizer step, at step 7, was not skipped", as if every step from 3 on stepped
    late. The steps that did are listed (``capture.loop_order``'s ``at``), and step 6 is its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    skipped = []
    prof = precprof.Profiler(model, opt, scaler=scaler, sample_every=1, memory=False, out=tmp_path)
    with pytest.warns(UserWarning) as warned, prof:
        for step in range(8):
            if step == 3:  # step 2's gradients, stepped before step 3's forward
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            out = model(torch.randn(5, 4))
            if step == 6:
                out.register_hook(lambda g: g * math.inf)
            scaler.scale(out.pow(2).mean()).backward()
            if step != 2:
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                skipped.append(scaler.get_scale() < before)  # independently: the scale backed off
            prof.step(loss=out.detach().pow(2).mean())
    prof.save()
    said = " ".join(str(w.message) for w in warned)
    assert "sampled step 3 holds 2 steps" in said and "in sampled step 3 SGD stepped before" in said
    assert skipped[5] and sum(skipped) == 1  # step 6's optimizer step (the 6th the loop made) was skipped
    order = prof.summary()["loop_order"]["optimizer_before_forward"]
    assert order["at"] == [3] and order["steps"] == 1
    steps = prof.tables()["steps"]
    assert steps.loc[steps[T.SKIPPED].astype(bool), T.STEP].tolist() == [6]
    found = {f.code: f for f in precprof.recommend(tmp_path).findings}
    assert "nonfinite_backward" not in found  # GradScaler skipped the step whose gradients held inf


def test_an_overflow_at_a_micro_batch_is_the_skipped_optimizer_steps(tmp_path: Path) -> None:
    """fp16 and a GradScaler at 2^22, ``prof.step()`` per micro-batch: gradients overflow from micro-batch 0 on,
    and GradScaler skips the optimizer steps that take them in. A critical finding said micro-batch 0's "optimizer
    step was not skipped", and the scaler's counted the micro-batches as optimizer steps that went through ("first
    successful step at scale 4.2e6", where every optimizer step at that scale was skipped)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22)
    at, scales = _accumulating_run(tmp_path / "run", scaler, _fp16_square, micro_batches=12)
    optimizer_steps = [2, 5, 8, 11]  # the third micro-batch of each
    skipped = [s for s in optimizer_steps if s not in at]
    assert at and skipped and skipped[0] == 2  # the first overflow was taken in by a skipped step
    found = {f.code: f for f in precprof.recommend(tmp_path / "run").findings}
    assert not [f for f in found.values() if "was not skipped" in f.message]
    f = found["scaler_skipped_steps"]
    assert f.numbers["skipped"] == len(skipped) and f.numbers["steps"] == len(optimizer_steps)
    assert f.numbers["first_ok_scale"] == scales[at[0]] and f.numbers["start_scale"] == scales[0]


class _TinyLM(nn.Module):
    """An embedding, a residual fp16 branch and a head: under fp16 autocast the embedding's output gradient is
    the fp32 residual sum's (as in any GPT), the branch's and the head's are fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(h + self.fc(h))


def test_an_fp16_run_whose_every_gradient_flushed_is_told_the_scale_for_it(tmp_path: Path) -> None:
    """fp16 autocast without loss scaling and a loss of 1e-9 of its size: every fp16 gradient flushes, and
    so every gradient computed from them is zero, the embedding's fp32 one too. The rule for "every gradient
    flushed" wanted every activation gradient fp16, so this run (any GPT's shape) got GradScaler's default 2^16
    "which lifts a gradient at fp16's flush point (2^-25) to 0.5" (it lifts it to 2^-9), beside a finding that
    said no gradient was measured. Checked by hooks of the test's own: every activation gradient an exact zero,
    the embedding's fp32."""
    torch.manual_seed(0)
    model = _TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[torch.Tensor] = []

    def keep(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: grads.append(g.detach().clone()))

    for m in model.children():
        m.register_forward_hook(keep)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, out=tmp_path / "run") as prof:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(torch.randint(0, 32, (4, 8)))
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, 32), torch.randint(0, 32, (32,)))
            (loss * 1e-9).backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    prof.save()
    assert all(int(g.count_nonzero()) == 0 for g in grads)
    assert {g.dtype for g in grads} == {torch.float16, torch.float32}
    rec = precprof.recommend(tmp_path / "run")
    found = {f.code: f for f in rec.findings}
    assert found["fp16_loss_scale"].numbers["loss_scale_log2"] == 24
    assert "every gradient flushed" in found["fp16_loss_scale"].title
    assert "GradScaler(init_scale=16777216), which lifts a gradient at fp16's flush point (2^-25) to 0.5" in (
        found["fp16_gradient_underflow"].remedy
    )


def test_a_skip_the_scaler_grew_into_is_not_blamed_on_its_start(tmp_path: Path) -> None:
    """A dynamic GradScaler that starts where every step goes through, grows (growth_interval 1) until the
    weight gradient of 1.0, which autocast computes in fp16, overflows (at 2^16), backs off, grows again: each
    skip was called avoidable by starting at the recommended scale, which grows back into the same overflow.
    They are growth probes; the remedy does not name a start."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**13, growth_interval=1)
    scales, skipped = [], []
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, out=tmp_path / "run") as prof:
        for _ in range(8):
            x = torch.ones(4, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = out.float().sum() / 4  # each output's gradient 0.25: the weights' 1.0
            scales.append(scaler.get_scale())
            backward_and_step(loss, opt, scaler)
            skipped.append(scaler.get_scale() < scales[-1])
            opt.zero_grad()
            prof.step(loss=loss.detach())
    prof.save()
    assert skipped[:3] == [False] * 3 and scales[3] == 2.0**16 and skipped[3]  # through, then grew into it
    assert sum(skipped) >= 2
    f = next(f for f in precprof.recommend(tmp_path / "run").findings if f.code == "scaler_skipped_steps")
    assert f.numbers["skipped"] == sum(skipped)
    assert f.numbers["avoidable"] == 0 and f.numbers["growth_probes"] == sum(skipped)
    assert "growth probing its ceiling" in f.message and "init_scale" not in f.remedy


class _FiniteGradients(Callback):
    """Whether each step's gradients were all finite, as the backward left them (scaled): the test's own look."""

    def __init__(self) -> None:
        self.finite: list[bool] = []

    def after_backward(self, run: TrainRun) -> None:
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        self.finite.append(all(bool(torch.isfinite(g).all()) for g in grads))


def test_a_gradient_norm_nan_on_every_step_is_not_said_to_be_unrecorded(tmp_path: Path) -> None:
    """A static loss scale of 2^40: every step's gradients overflow fp16, the built-in loop's clipping norm is nan
    and the scaler skips the step. The gradient-norm plot said "no gradient norm recorded"; it says the norm was
    not finite on every step. A loop that passed no norm still has none recorded."""
    seen = _FiniteGradients()
    cfg = dict(model="gpt-nano", model_args=dict(TINY), steps=3, batch_size=2, seq_len=16, sample_every=1)
    torch.manual_seed(0)
    train(
        TrainConfig(
            **cfg, precision="fp16", loss_scale="static:1099511627776", progress=False, out=tmp_path / "r"
        ),
        callbacks=[seen],
    )
    steps = T.read_tables(tmp_path / "r")["steps"]
    assert seen.finite == [False] * 3 and T.flags(steps[T.SKIPPED]).all()
    fig = plots.training_figure(steps)
    assert fig is not None
    assert [t.get_text() for t in fig.axes[2].texts] == [
        "not finite (nan/inf)\non every step\n(every step skipped)"
    ]

    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, out=tmp_path / "none") as prof:
        for _ in range(3):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()  # no grad_norm, and no clip_grad_norm_ to note one from
    prof.save()
    fig = plots.training_figure(T.read_tables(tmp_path / "none")["steps"])
    assert fig is not None and [t.get_text() for t in fig.axes[2].texts] == ["no gradient norm recorded"]


def _one_spike_run(
    out: Path,
    init_scale: float = 2.0**12,
    steps: int = 10,
    spike: int = 5,
    sample_every: int = 1,
    factor: float = 1e6,
) -> tuple[list[float], list[bool]]:
    """A dynamic GradScaler at ``init_scale`` (2^12: every step goes through) that never grows (growth_interval
    2000), whose loss at step ``spike`` is multiplied by ``factor``: 1e6, a gradient spike; nan, a bad batch
    (its loss nan). Returns each step's scale and whether it was skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2000)
    scales, skipped = [], []
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=sample_every, out=out) as prof:
        for step in range(steps):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                out_ = model(x)
            loss = out_.float().square().mean() * (factor if step == spike else 1.0)
            scales.append(scaler.get_scale())
            backward_and_step(loss, opt, scaler)
            skipped.append(scaler.get_scale() < scales[-1])
            opt.zero_grad()
            prof.step(loss=loss.detach())
    prof.save()
    return scales, skipped


def test_a_skip_at_the_scale_steps_went_through_at_is_a_spike_not_growth_probing(tmp_path: Path) -> None:
    """A skip at the starting scale, after steps went through at it, was called 'growth probing' ('came after
    the scaler grew past 4096', and the remedy was about growth_interval)."""
    scales, skipped = _one_spike_run(tmp_path / "run")
    assert skipped == [s == 5 for s in range(10)] and scales[5] == max(scales[:5])  # never grew
    found = {f.code: f for f in precprof.recommend(tmp_path / "run").findings}
    f = found["scaler_skipped_steps"]
    assert f.numbers["skipped"] == 1 and f.numbers["growth_probes"] == 0
    assert "grew" not in f.message and "growth" not in f.remedy
    assert "happened above the recommended 2^" in f.message
    assert "but at or below a scale earlier steps had gone through at" in f.message


def test_the_skips_a_lower_start_avoids_are_said_to_be_those_before_the_first_step_through(
    tmp_path: Path,
) -> None:
    """A dynamic GradScaler started at 2^24 backs off to 2^18, where the first step goes through; later skips
    (a gradient spike among them) come at scales steps had gone through at, still above the recommended scale.
    The message said "6 of those skips happened at a scale above the recommended 2^15 ...; the other 2 happened at
    or below a scale earlier steps had gone through at", which read as the other 2 being at or below 2^15; all 8
    were above it. The 6 are the skips before the first step that went through, and the message says so."""
    scales, skipped = _one_spike_run(tmp_path / "run", init_scale=2.0**24, steps=20, spike=15, sample_every=2)
    first_ok = skipped.index(False)
    later = [t for t in range(first_ok + 1, len(scales)) if skipped[t]]
    assert first_ok and later and all(skipped[:first_ok])
    f = next(f for f in precprof.recommend(tmp_path / "run").findings if f.code == "scaler_skipped_steps")
    rec = f.numbers["recommended_scale"]
    # independently: every skip, before the first step through and after it, was above the recommended scale; the
    # later ones at a scale a step had gone through at before them
    assert all(s > rec for s, k in zip(scales, skipped, strict=True) if k)
    assert all(
        scales[t] <= max(s for s, k in zip(scales[:t], skipped[:t], strict=True) if not k) for t in later
    )
    assert f.numbers["avoidable"] == first_ok and f.numbers["spikes"] == len(later)
    assert (
        f"{first_ok} of those skips came before the first step that went through, each at a scale above the "
        f"recommended 2^{int(math.log2(rec))}" in f.message
    )
    assert (
        f"the other {len(later)} happened above it but at or below a scale earlier steps had gone through at"
        in f.message
    )


def _nan_batch_skip(out: Path, **kw: Any) -> tuple[Finding, list[bool]]:
    """``_one_spike_run`` with a nan loss at step ``spike`` (a bad batch), sampled every 4th step so that the
    step itself is not sampled (only the steps table has its loss): its scaler_skipped_steps finding, and whether
    each step was skipped."""
    _, skipped = _one_spike_run(out, sample_every=4, factor=math.nan, **kw)
    steps = T.read_tables(out)["steps"].set_index(T.STEP)
    spike = kw.get("spike", 5)
    assert skipped[spike] and math.isnan(steps.loc[spike, T.LOSS]) and not steps.loc[spike, T.SAMPLED]
    return next(f for f in precprof.recommend(out).findings if f.code == "scaler_skipped_steps"), skipped


def test_a_skip_on_a_nan_loss_is_said_as_one_and_gets_no_init_scale_remedy(tmp_path: Path) -> None:
    """One nan batch in an fp16 GradScaler run (its step not sampled), every other step through at 2^12: the
    finding said "All 1 happened at or below the recommended 2^16 (gradient spikes, or non-finite values that no
    scale fixes)" and told to "Use GradScaler(init_scale=65536)" while its own numbers said avoidable 0, spikes
    0, from_model 0; started above the recommended scale (a resumed run's 2^15 below the scale it went on at),
    the remedy said "the scaler backed off from a gradient spike". The steps table has the step's loss: nan, which
    no loss scale avoids; the remedy names the step's batch (user-tester t5)."""
    f, skipped = _nan_batch_skip(tmp_path / "low")
    assert skipped == [s == 5 for s in range(10)]
    assert f.numbers["avoidable"] == 0 and f.numbers["spikes"] == 0 and f.numbers["from_model"] == 0
    assert "spike" not in f.message and "spike" not in f.remedy and "init_scale" not in f.remedy
    assert f.remedy.startswith("Find the batch at step 5, whose loss was nan")
    assert "It came on a step whose loss was nan (step 5)" in f.message
    assert (
        f.numbers["skipped"] == 1
        and f.numbers["nonfinite_loss"] == 1
        and f.numbers["nonfinite_loss_step"] == 5
    )
    # started above the recommended scale, where the gradients fit all the same: the skip at a scale steps had
    # gone through at was called a gradient spike
    rec = f.numbers["recommended_scale"]
    f, skipped = _nan_batch_skip(tmp_path / "high", init_scale=2 * rec)
    assert skipped == [s == 5 for s in range(10)]
    assert f.numbers["recommended_scale"] == rec and f.numbers["start_scale"] == 2 * rec
    assert "spike" not in f.message and "spike" not in f.remedy and "init_scale" not in f.remedy
    assert f.remedy.startswith("Find the batch at step 5, whose loss was nan")
    assert f.numbers["spikes"] == 0 and f.numbers["avoidable"] == 0 and f.numbers["nonfinite_loss"] == 1


def test_a_gradient_spike_at_or_below_the_recommended_scale_gets_no_init_scale_remedy(tmp_path: Path) -> None:
    """A finite loss 1e9 times the others' at step 5 (not sampled), every other step through at 2^12, below the
    recommended scale: its gradients overflow at any scale a start would use, and the remedy said "Use
    GradScaler(init_scale=...)" all the same, though no skip was avoidable (user-tester t5's finding's other
    case)."""
    scales, skipped = _one_spike_run(tmp_path / "run", sample_every=4, factor=1e9)
    assert skipped == [s == 5 for s in range(10)]
    f = next(f for f in precprof.recommend(tmp_path / "run").findings if f.code == "scaler_skipped_steps")
    assert scales[5] <= f.numbers["recommended_scale"] and f.numbers["avoidable"] == 0
    assert "nonfinite_loss" not in f.numbers and "init_scale" not in f.remedy
    assert f.remedy.startswith("Nothing to change at the start: no initial scale avoids these skips")


def test_a_nan_batch_leaves_the_init_scale_remedy_of_the_skips_a_lower_start_avoids(tmp_path: Path) -> None:
    """The negative of the test above: started at 2^24, the scaler skips until it backs off to a scale that
    fits, a lower start avoids those, and the remedy still says init_scale; the nan batch at step 15 is counted
    apart and named."""
    f, skipped = _nan_batch_skip(tmp_path / "run", init_scale=2.0**24, steps=20, spike=15)
    rec, first_ok = f.numbers["recommended_scale"], skipped.index(False)
    assert first_ok and all(skipped[:first_ok]) and skipped[15]
    assert f.numbers["avoidable"] == first_ok and f.numbers["nonfinite_loss"] == 1
    assert f.remedy.startswith(f"Use GradScaler(init_scale={int(rec)}).")
    assert "Find the batch at step 15, whose loss was nan" in f.remedy
    assert "1 of those skips came on a step whose loss was nan (step 15)" in f.message


def _backoff_run(out: Path) -> tuple[list[float], list[bool]]:
    """A dynamic GradScaler started far too high (2^30, growth_interval 4) on a small MLP: it skips twice, goes
    through at 2^28, skips there and again after backing off to 2^27, settles at 2^26 and grows back to 2^27 after
    4 good steps. Returns each step's scale and whether it was skipped (the inner optimizer did not step)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepped = [0]
    opt.register_step_post_hook(lambda *a: stepped.__setitem__(0, stepped[0] + 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=4)
    scales, skipped = [], []
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, out=out) as prof:
        for step in range(12):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 16, generator=g) * 0.05, torch.randn(32, 4, generator=g) * 0.1
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(x)
            loss = nn.functional.mse_loss(pred.float(), y) * 1e-3
            scales.append(scaler.get_scale())
            before = stepped[0]
            backward_and_step(loss, opt, scaler)
            skipped.append(stepped[0] == before)
            opt.zero_grad()
            prof.step(loss=loss.detach())
    prof.save()
    return scales, skipped


def test_a_skip_below_a_scale_that_went_through_is_no_growth_probe_nor_thrashing(tmp_path: Path) -> None:
    """A skip after a backoff, at a scale below one a step had gone through at, was called growth probing ("came
    after the scaler grew past ...": the highest scale that had gone through was lost at skipped steps), and a
    growth late in the run that cost no step was said to thrash ("each growth past the safe scale costs a step")
    because skips before it were counted with it."""
    scales, skipped = _backoff_run(tmp_path / "run")
    first_ok = skipped.index(False)
    # independently: a probe is a skip above every scale a step had gone through at before it
    probes = sum(
        1
        for t in range(first_ok + 1, len(scales))
        if skipped[t] and scales[t] > max(s for s, k in zip(scales[:t], skipped[:t], strict=True) if not k)
    )
    # a growth costs a step when a step is skipped at the grown scale before the scale changes again
    grown = [t for t in range(first_ok + 1, len(scales)) if scales[t] > scales[t - 1]]
    costly = 0
    for t in grown:
        end = next((u for u in range(t + 1, len(scales)) if scales[u] != scales[t]), len(scales))
        costly += any(skipped[t:end])
    below = [t for t in range(first_ok + 1, len(scales)) if skipped[t] and scales[t] < scales[first_ok]]
    assert below and grown and sum(skipped[first_ok:]) >= 2  # the run has what the advisor misread
    assert probes == 0 and costly == 0
    found = {f.code: f for f in precprof.recommend(tmp_path / "run").findings}
    f = found["scaler_skipped_steps"]
    assert f.numbers["skipped"] == sum(skipped) and f.numbers["growth_probes"] == probes
    assert "grew" not in f.message and "at or below a scale earlier steps had gone through at" in f.message
    assert "scaler_thrashing" not in found


def test_an_overflow_on_one_sampled_step_is_not_said_to_be_on_every_one(tmp_path: Path) -> None:
    """The overflow's remedy said 'every sampled step overflowed' where 1 of 10 did: the advice rests on it."""
    _, skipped = _one_spike_run(tmp_path / "run")
    found = {f.code: f for f in precprof.recommend(tmp_path / "run").findings}
    ov = found["fp16_gradient_overflow"]
    assert ov.numbers["steps"] == 1
    assert "every sampled step overflowed" not in ov.remedy
    assert (
        f"the {sum(skipped)} of {len(skipped)} sampled step(s) that overflowed ({skipped.index(True)})"
        in ov.remedy
    )


def test_a_bf16_run_that_diverged_gets_no_critical_fp16_finding(tmp_path: Path) -> None:
    """A bf16 run that diverges (SGD at learning rate 20: the loss grows to 1e23, then nan) blows its gradients up
    across 40 binades: "no fp16 loss scale fits" was a critical fp16_gradient_underflow, beside the same run's
    other fp16 findings shown as what fp16 would do. It is one of those: information, keeping its severity in
    ``demoted_from`` for compare."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=20.0)
    g = torch.Generator().manual_seed(0)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, out=tmp_path / "run") as prof:
        for _ in range(12):
            ids = torch.randint(0, 64, (8, 16), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(ids)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, 64), ids.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    prof.save()
    losses = prof.tables()["steps"][T.LOSS].to_numpy()
    assert np.nanmax(losses) > 1e20 and np.isnan(losses[-1])  # it diverged
    found = {f.code: f for f in precprof.recommend(tmp_path / "run").findings}
    assert found["run_diverged"].severity == "critical"
    assert not [f for code, f in found.items() if code.startswith("fp16_") and f.severity != "info"]
    underflow = found["fp16_gradient_underflow"]
    # a warning before it was demoted: fp16 keeps 0, 1 and 3 in fp32 (their activations overflow), and the
    # gradients those layers compute in fp32 are left out of what fp16 would flush
    assert underflow.numbers["demoted_from"] == "warning" and "(what fp16 would do" in underflow.title


def _flushing_fp16_run(out: Path, precision: torch.dtype = torch.float16) -> precprof.Profiler:
    """A GELU MLP trained 3 steps under ``precision`` autocast with no loss scaler, its loss weighted by 1e-6: in
    fp16 about half its activation gradients flush."""
    model = _gelu_mlp(16, 32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, out=out) as prof:
        for _ in range(3):
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
            with torch.autocast("cpu", dtype=precision):
                loss = (model(x).float() - y).pow(2).mean() * 1e-6
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    return prof


# the two tests that read ``flushing_fp16`` share one pytest-xdist worker, which trains and renders it once
FLUSHING = pytest.mark.xdist_group("claims-flushing-fp16")


@pytest.fixture(scope="module")
def flushing_fp16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    """``_flushing_fp16_run``'s fp16 run, trained and its page rendered once for the two tests that read them:
    its layers table and the page's text."""
    out = tmp_path_factory.mktemp("flushing") / "run"
    prof = _flushing_fp16_run(out)
    return prof.tables()["layers"], html.unescape(re.sub(r"<[^>]+>", "", prof.report(out).read_text()))


@FLUSHING
def test_an_fp16_runs_whatif_says_where_its_losses_are(flushing_fp16: tuple[Any, str]) -> None:
    """An fp16 run that flushed half its activation gradients: the what-if's FP16 columns read 0% for them (a
    second cast loses nothing), and nothing on the table said the loss is in the zeros fp16 made. A note names
    each kind held in fp16 with its share of zeros, computed here from the layers table."""
    layers, page = flushing_fp16
    ag = layers[(layers[T.TENSOR] == T.ACTIVATION_GRAD) & (layers[T.DTYPE] == "float16")]
    share = ag[T.ZEROS].sum() / ag[T.NUMEL].sum()
    assert share > 0.05
    assert f"Held in fp16 by this run already: activation gradients ({filters.pct(share)} zeros)" in page


@FLUSHING
def test_the_timeline_is_not_said_to_show_what_fp16_flushed(
    tmp_path: Path, flushing_fp16: tuple[Any, str]
) -> None:
    """The what-if's note on tensors an fp16 run held in fp16 said "the timeline above and the findings say how
    much" fp16 flushed, beside a timeline whose activation-gradient row was white: it counts underflow of the
    recorded values, and an fp16 value that flushed was recorded as a zero. The same run in bf16, whose gradients
    the layers table's fp16 columns count, shows what fp16 would flush there; the fp16 run's rows count nothing.
    The note and the timeline's caption say the timeline cannot show it, and name the findings that can."""
    bf16 = _flushing_fp16_run(tmp_path / "bf16", torch.bfloat16).tables()["layers"]
    ag = bf16[bf16[T.TENSOR] == T.ACTIVATION_GRAD]
    assert ag[T.underflow_col("fp16")].sum() / ag[T.NUMEL].sum() > 0.2  # what fp16 flushes of these gradients
    layers, page = flushing_fp16
    ag = layers[(layers[T.TENSOR] == T.ACTIVATION_GRAD) & (layers[T.DTYPE] == "float16")]
    assert ag[T.ZEROS].sum() / ag[T.NUMEL].sum() > 0.2
    assert (
        ag[T.underflow_col("fp16")].sum() == ag[T.INF].sum() == ag[T.NAN].sum() == 0
    )  # the timeline's counts
    assert "the timeline above and the findings say how much" not in page
    assert (
        "The timeline above cannot show the flushes either: it counts these values as these columns do; what the "
        "run can tell of the activation gradients fp16 flushed is in the findings fp16_gradient_underflow and "
        "fp16_no_loss_scaling." in page
    )
    assert (
        "The row of the activation gradients cannot show what fp16 flushed there: this run held them in fp16"
        in page
    )
