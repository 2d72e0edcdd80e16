"""The Profiler in a Lightning Fabric or Hugging Face accelerate loop, given what ``fabric.setup`` and
``accelerator.prepare`` return: the wrapped model and optimizer.

On a CPU Fabric turns 16-mixed into bf16 and accelerate runs fp16 in fp32; these runs take each framework's GPU
path (fp16 autocast and a GradScaler) with a CPU GradScaler, the way a user's GPU run goes. The scaler starts at
2^30, so that the first steps overflow and are skipped, and the scale changes from step to step.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import precprof
from precprof import runfiles
from precprof import tables as T
from precprof.analysis import advisor
from precprof.analysis.advisor import AdvisorConfig
from precprof.capture import given
from precprof.compare import compare_runs
from precprof.report import summarize as S

pytest.importorskip("lightning")

from lightning.fabric import Fabric
from lightning.fabric.plugins import MixedPrecision

STEPS = 8


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 16, generator=g) * 0.05, torch.randn(32, 4, generator=g) * 0.1


def high_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=4)


def fabric_fp16(scaler: torch.amp.GradScaler) -> Fabric:
    """Fabric's 16-mixed as on a GPU: fp16 autocast and ``scaler``."""
    return Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])


class Truth:
    """What the run did, read independently of precprof: per step the scale in effect, whether the inner
    optimizer stepped, and the last Linear's weight-gradient absmax (of its finite values) unscaled by the scale."""

    def __init__(self, optimizer: torch.optim.Optimizer, last: nn.Linear) -> None:
        self.last = last
        self.stepped = 0
        optimizer.register_step_post_hook(lambda *a: setattr(self, "stepped", self.stepped + 1))
        self.scales: list[float] = []
        self.skipped: list[bool] = []
        self.grad_absmax: list[float] = []

    def before(self, scaler: torch.amp.GradScaler) -> None:
        self.scales.append(float(scaler.get_scale()))
        self._stepped_before = self.stepped

    def after_backward(self) -> None:
        grad = self.last.weight.grad
        assert grad is not None
        self.grad_absmax.append(float(grad[grad.isfinite()].abs().max()) / self.scales[-1])

    def after_step(self) -> None:
        self.skipped.append(self.stepped == self._stepped_before)


def fabric_run(
    tmp_path: Path, give_scaler: bool, **prof_kwargs: Any
) -> tuple[Truth, precprof.Profiler, Path]:
    """``STEPS`` steps of Fabric 16-mixed, the Profiler given what ``fabric.setup`` returned."""
    scaler = high_scaler()
    fabric = fabric_fp16(scaler)
    raw = mlp()
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    model, opt = fabric.setup(raw, raw_opt)
    truth = Truth(raw_opt, raw[5])
    given = {"scaler": scaler} if give_scaler else {}
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, **given, **prof_kwargs)
    with prof:
        for step in range(STEPS):
            x, y = data(step)
            truth.before(scaler)
            loss = nn.functional.mse_loss(model(x), y) * 1e-3
            fabric.backward(loss)
            truth.after_backward()
            opt.step()
            opt.zero_grad()
            truth.after_step()
            prof.step(loss=loss.detach())
    assert any(truth.skipped) and not all(truth.skipped)  # the run skipped steps, and trained on others
    assert len(set(truth.scales)) > 1
    run_dir = tmp_path / "run"
    prof.save(run_dir)
    return truth, prof, run_dir


def weight_grad_absmax(layers: Any, module: str) -> list[float]:
    rows = layers[
        (layers[T.MODULE].astype(str) == module)
        & (layers[T.TENSOR].astype(str) == "weight_grad")
        & (layers[T.PARAM].astype(str) == "weight")
    ].sort_values(T.STEP)
    return [float(v) for v in rows["absmax"]]


def test_fabric_optimizer_keeps_the_scalers_skips_and_scale(tmp_path: Path) -> None:
    """Given Fabric's _FabricOptimizer (it takes its optimizer's class and passes its attributes through, so it
    seemed to be the optimizer): the GradScaler keys what it found by the inner optimizer, and the skipped steps
    read as not skipped, the scale as the one after ``update()``, the gradients unscaled by it (2x off), and a
    critical finding said an overflow's step was not skipped."""
    truth, prof, run_dir = fabric_run(tmp_path, give_scaler=True)
    steps = prof.tables()["steps"].sort_values(T.STEP)
    assert steps["skipped"].astype(bool).tolist() == truth.skipped
    assert steps["loss_scale"].astype(float).tolist() == truth.scales
    got = weight_grad_absmax(prof.tables()["layers"], "5")
    assert got == pytest.approx(truth.grad_absmax, rel=1e-6)
    rec = advisor.recommend(run_dir, config=AdvisorConfig(small_model_params=0))
    skips = rec.finding("scaler_skipped_steps")
    assert skips is not None and skips.numbers["skipped"] == sum(truth.skipped)
    assert not [f for f in rec.findings if "was not skipped" in f.message]


def test_fabric_scaler_not_given_is_found_on_its_wrappers(tmp_path: Path) -> None:
    """Fabric's 16-mixed scales the loss with its own GradScaler (``fabric._precision.scaler``, private): not given
    it, the Profiler read the gradients 2^30x too large, said the run "scaled no loss", and took the skipped
    steps for trained ones. It is found on Fabric's wrappers, and the summary says where."""
    truth, prof, run_dir = fabric_run(tmp_path, give_scaler=False)
    steps = prof.tables()["steps"].sort_values(T.STEP)
    assert steps["skipped"].astype(bool).tolist() == truth.skipped
    assert steps["loss_scale"].astype(float).tolist() == truth.scales
    got = weight_grad_absmax(prof.tables()["layers"], "5")
    assert got == pytest.approx(truth.grad_absmax, rel=1e-6)
    capture = prof.summary()
    assert capture["scaler"] == "GradScaler" and capture["scaler_enabled"]
    assert capture["scaler_from"] == "_FabricModule._strategy.precision.scaler"  # the model's wrapper first
    rec = advisor.recommend(run_dir, config=AdvisorConfig(small_model_params=0))
    assert rec.finding("fp16_no_loss_scaling") is None and rec.finding("scaler_skipped_steps") is not None


def test_accelerate_scaler_not_given_is_found_on_its_optimizer(tmp_path: Path) -> None:
    """accelerate's fp16 (its GPU path: native autocast and a GradScaler) with the Profiler given the
    AcceleratedOptimizer and no scaler: the one in ``AcceleratedOptimizer.scaler`` is read, and the environment
    says it was found there."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    acc.native_amp = True  # what accelerate sets on a GPU; on a CPU it runs fp16 in fp32
    acc.scaler = scaler = high_scaler()
    raw = mlp()
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    model, opt = acc.prepare(raw, raw_opt)
    truth = Truth(raw_opt, raw[5])
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for step in range(STEPS):
            x, y = data(step)
            truth.before(scaler)
            loss = nn.functional.mse_loss(model(x), y) * 1e-3
            acc.backward(loss)
            truth.after_backward()
            opt.step()
            opt.zero_grad()
            truth.after_step()
            prof.step(loss=loss.detach())
    assert any(truth.skipped) and not all(truth.skipped)
    steps = prof.tables()["steps"].sort_values(T.STEP)
    assert steps["skipped"].astype(bool).tolist() == truth.skipped
    assert steps["loss_scale"].astype(float).tolist() == truth.scales
    assert weight_grad_absmax(prof.tables()["layers"], "5") == pytest.approx(truth.grad_absmax, rel=1e-6)
    assert prof.summary()["scaler_from"] == "AcceleratedOptimizer.scaler"
    page = prof.report(tmp_path / "run").read_text()
    assert "found in AcceleratedOptimizer.scaler (not given to the Profiler)" in page
    assert verification_line(page).startswith(
        'Asked for fp16 (accelerate\'s mixed_precision="fp16"). Mixed precision is active'
    )


def bf16_run(out: Path, fabric: Fabric | None, **prof_kwargs: Any) -> precprof.Profiler:
    """3 steps in bf16 autocast, through Fabric's bf16-mixed when ``fabric`` is given (the Profiler given
    ``fabric.setup``'s model), else by hand."""
    model: nn.Module = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if fabric is not None:
        model, opt = fabric.setup(model, opt)
    with precprof.Profiler(
        model, optimizer=opt, sample_every=1, memory=False, out=out, **prof_kwargs
    ) as prof:
        for step in range(3):
            x, y = data(step)
            if fabric is not None:
                loss = nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    pred = model(x)
                loss = nn.functional.mse_loss(pred.float(), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    prof.save()
    return prof


def test_fabric_module_is_named_as_the_users_model(tmp_path: Path) -> None:
    """Given ``fabric.setup``'s _FabricModule, every layer was "_forward_module.<name>" and the model
    "_FabricModule": ``modules=`` by the model's own names was refused, and ``precprof compare`` refused the same
    model profiled without Fabric as a different model. Fabric's wrapper is left out like DDP's now."""
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    wrapped = bf16_run(tmp_path / "fabric", fabric)
    plain = bf16_run(tmp_path / "plain", None)
    own = {name for name, _ in mlp().named_modules() if name}
    names = set(wrapped.tables()["layers"][T.MODULE].astype(str))
    assert own <= names and not any(n.startswith("_forward_module") for n in names)
    assert names == set(plain.tables()["layers"][T.MODULE].astype(str))
    assert wrapped.summary()["model_class"] == plain.summary()["model_class"] == "Sequential"
    _, page = compare_runs([tmp_path / "fabric", tmp_path / "plain"], out=tmp_path / "cmp")
    assert page.exists()
    only = bf16_run(tmp_path / "only3", fabric, modules=["3"])
    assert set(only.tables()["layers"][T.MODULE].astype(str)) == {
        "3",
        "3:input",
    }  # (3 reads a module not captured)


def test_fabric_scaler_is_found_on_its_module(tmp_path: Path) -> None:
    """The Profiler given Fabric's _FabricModule alone (no optimizer, no scaler): the GradScaler of Fabric's
    16-mixed is found on the module, and its skipped steps and scale are read."""
    scaler = high_scaler()
    fabric = fabric_fp16(scaler)
    raw = mlp()
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    model, opt = fabric.setup(raw, raw_opt)
    truth = Truth(raw_opt, raw[5])
    with precprof.Profiler(model, sample_every=1, memory=False) as prof:
        for step in range(STEPS):
            x, y = data(step)
            truth.before(scaler)
            fabric.backward(nn.functional.mse_loss(model(x), y) * 1e-3)
            opt.step()
            opt.zero_grad()
            truth.after_step()
            prof.step()
    assert any(truth.skipped)
    steps = prof.tables()["steps"].sort_values(T.STEP)
    assert steps["skipped"].astype(bool).tolist() == truth.skipped
    assert steps["loss_scale"].astype(float).tolist() == truth.scales
    assert prof.summary()["scaler_from"] == "_FabricModule._strategy.precision.scaler"


def verification_line(page: str) -> str:
    """The report's precision verification line, as text."""
    start = page.index('<p class="verdict-line')
    return html.unescape(re.sub(r"<[^>]+>", "", page[start : page.index("</p>", start)]))


def test_accelerate_fp16_ignored_on_cpu_is_said(tmp_path: Path) -> None:
    """``Accelerator(mixed_precision="fp16")`` on a CPU trains in fp32 without a word from accelerate. Given what
    ``accelerator.prepare`` returned, the Profiler recorded no request: no finding, and the page said "Seen: fp32
    (what the run trained in; nothing asked for a precision)". The request is read off the AcceleratedOptimizer
    now, as the HF Trainer callback records ``fp16=True``: the finding says fp16 is not active, and so does
    the page's verification (its line, "Asked for fp16 (accelerate's ...)", in the test above)."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    raw = mlp()
    model, opt = acc.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))
    assert acc.scaler is None and not acc.native_amp  # accelerate's CPU path: fp32
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for step in range(2):
            x, y = data(step)
            out = model(x)
            acc.backward(nn.functional.mse_loss(out, y))
            opt.step()
            opt.zero_grad()
            prof.step()
    assert out.dtype == torch.float32
    capture = prof.summary()
    assert capture["precision_seen"] == "fp32"
    assert capture["mixed_precision_requested"] == "fp16"
    assert capture["mixed_precision_from"] == "AcceleratedOptimizer.accelerator_state.mixed_precision"
    prof.save(tmp_path / "run")
    summary = runfiles.read_summary(tmp_path / "run")
    inactive = [f for f in summary["recommendation"]["findings"] if f["code"] == "mixed_precision_inactive"]
    assert inactive and inactive[0]["title"] == "fp16 was requested but is not active"
    assert 'The run asked for fp16 (accelerate\'s mixed_precision="fp16")' in inactive[0]["message"]
    tables = prof.tables()
    check = S.precision_check(tables["layers"], tables["memory"], summary)  # the page's verification line
    assert check["asked"] and not check["ok"] and check["requested"] == "fp16"
    assert check["asked_as"] == 'accelerate\'s mixed_precision="fp16"'
    assert check["verdict"].startswith("Mixed precision was asked for (fp16) but is NOT active")


def test_fabric_precision_is_the_runs_request(tmp_path: Path) -> None:
    """Fabric's precision plugin says what the run asked for (the Profiler already read its GradScaler there):
    the page said "nothing asked for a precision" of ``Fabric(precision="bf16-mixed")``. A full-precision setting
    (Fabric's default) asks for nothing: a loop of its own may turn autocast on itself."""
    prof = bf16_run(tmp_path / "run", Fabric(accelerator="cpu", devices=1, precision="bf16-mixed"))
    summary = runfiles.read_summary(tmp_path / "run")
    assert summary["capture"]["mixed_precision_requested"] == "bf16"
    assert summary["capture"]["mixed_precision_from"] == "_FabricModule._strategy.precision.precision"
    tables = prof.tables()
    check = S.precision_check(tables["layers"], tables["memory"], summary)
    assert check["asked"] and check["ok"] and check["requested"] == "bf16"
    assert check["asked_as"] == 'Fabric\'s precision="bf16-mixed"'
    assert not [f for f in summary["recommendation"]["findings"] if f["code"].startswith("mixed_precision")]
    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        cpu16 = Fabric(accelerator="cpu", devices=1, precision="16-mixed")  # Lightning's bf16-mixed on a CPU
    for precision, fabric, asked in (
        ("16-mixed", cpu16, "bf16"),
        ("16-mixed plugin", fabric_fp16(high_scaler()), "fp16"),
        ("32-true", Fabric(accelerator="cpu", devices=1, precision="32-true"), None),
    ):
        raw = mlp()
        model, opt = fabric.setup(raw, torch.optim.AdamW(raw.parameters()))
        said = given.asked_precision(model, None), given.asked_precision(raw, opt)
        assert [s.get("mixed_precision_requested") for s in said] == [asked, asked], precision
