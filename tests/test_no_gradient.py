"""Layers whose weights got no gradient (finding ``no_gradient``): every weight-gradient value exactly zero on
every sampled step of a run whose optimizer stepped. A torchao FP8 run whose loss was weighted by 1e-20 left every
Float8Linear weight gradient 0 on every step (its e5m2 casts flushed the output gradients, under torchao's floor on
amax), and the page read as a healthy run: no finding said that nothing trained. A gradient zero only before the
weights first moved (a zero-initialised LoRA B under a warmup from 0) is no such layer. Real runs on the CPU, the
gradients read by the tests' own code after each backward."""

from __future__ import annotations

import contextlib
import re
from html import unescape
from pathlib import Path

import pytest
import torch
from torch import nn

import precprof
from precprof.analysis.advisor import AdvisorConfig
from precprof.report.render import render_run_dir

ALL = AdvisorConfig(small_model_params=0)


class _Mlp(nn.Module):
    """fc1 -> ReLU -> fc2 -> GELU -> head; with ``dead``, fc1's bias of -1000 turns every ReLU unit off."""

    def __init__(self, dead: bool) -> None:
        super().__init__()
        self.fc1, self.act = nn.Linear(16, 32), nn.ReLU()
        self.fc2, self.gelu, self.head = nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1)
        if dead:
            with torch.no_grad():
                self.fc1.bias.fill_(-1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gelu(self.fc2(self.act(self.fc1(x)))))


def _train(
    model: nn.Module,
    dims: tuple[int, int] = (16, 1),
    weight: float = 1.0,
    steps: int = 3,
    warmup: int = 0,
    lrs: list[float] | None = None,
    starts: dict[str, int] | None = None,
    profiled: bool = True,
    autocast: bool = True,
    weight_decay: float = 0.01,
) -> tuple[precprof.Profiler, list[dict[str, int]]]:
    """``steps`` sampled steps under bf16 autocast with AdamW on random (in, out) = ``dims`` data, the loss
    weighted by ``weight``, the learning rate rising linearly from 0 over ``warmup`` steps where given (the HF
    Trainer's warmup), the modules (or parameters) in ``starts`` in a param group of their own whose learning
    rate is 0 before the step given; returns the Profiler and, per step, the nonzero values of each trained layer's weight
    gradient as backward left it (read before the optimizer steps). ``lrs`` gets each step's learning rate. Without
    ``profiled`` the same loop runs with the Profiler neither attached nor stepped; without ``autocast``, in fp32;
    ``weight_decay``: AdamW's (its default, 0.01, moves a weight whose gradient is zero)."""
    torch.manual_seed(0)
    starts = starts or {}
    named = dict(model.named_parameters())
    late = {m: [named[m]] if m in named else list(model.get_submodule(m).parameters()) for m in starts}
    rest = [p for p in model.parameters() if all(p is not q for ps in late.values() for q in ps)]
    opt = torch.optim.AdamW(
        [{"params": rest}, *({"params": ps} for ps in late.values())], lr=1e-3, weight_decay=weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        [
            lambda s: min(1.0, s / warmup) if warmup else 1.0,
            *(lambda s, at=at: float(s >= at) for at in starts.values()),
        ],
    )
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    nonzero: list[dict[str, int]] = []
    with prof if profiled else contextlib.nullcontext():
        for _ in range(steps):
            x, y = torch.randn(64, dims[0]), torch.randn(64, dims[1])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            loss = weight * (out.float() - y).pow(2).mean()
            loss.backward()
            weights = [
                (n.removesuffix(".weight"), p)
                for n, p in model.named_parameters()
                if n.endswith("weight") and p.requires_grad
            ]
            nonzero.append({n: int((p.grad != 0).sum()) for n, p in weights})
            if lrs is not None:
                lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if profiled:
                prof.step(loss=loss.detach())
    return prof, nonzero


def test_a_dead_relu_leaves_the_layers_on_both_sides_without_a_weight_gradient() -> None:
    """Every unit of ``act`` off: fc1's output gradient is zero (ReLU's backward writes a zero wherever its unit
    was off) and so is fc2's input, so both weight gradients are zero, while head's is not. The finding names
    fc1 and fc2, each with the cause the run shows."""
    prof, nonzero = _train(_Mlp(dead=True))
    dead = [m for m in nonzero[0] if all(step[m] == 0 for step in nonzero)]
    assert dead == ["fc1", "fc2"] and all(step["head"] > 0 for step in nonzero)
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient")
    assert f is not None and f.severity == "critical" and f.modules == dead
    assert f.numbers["no_gradient_layers"] == 2 and f.numbers["weight_gradient_layers"] == 3
    assert f.numbers["sampled_steps_with_grads"] == 3 and f.numbers["optimizer_steps_sampled"] == 3
    assert f.numbers["fp8_flushed_layers"] == 0
    assert f.title == "No gradient reached the weights of 2 of 3 layers"
    assert "of 2 layer(s) (fc1, fc2) was an exact zero on all 3 sampled step(s)" in f.message
    assert (
        "The gradient stopped at act (ReLU)" in f.message and "every unit was off, a dead ReLU" in f.message
    )
    assert "The input of fc2 was zero everywhere on every sampled step (the output of act)" in f.message


def test_a_dead_relu_under_a_warmup_from_0_counts_the_optimizer_steps_that_moved_weights() -> None:
    """A warmup from 0: step 0's learning rate is 0, and that optimizer step moved nothing. The dead ReLU's layers
    are still found, critical, and the optimizer steps the finding counts are those with a nonzero learning
    rate (step 0 was counted too)."""
    lrs: list[float] = []
    prof, nonzero = _train(_Mlp(dead=True), warmup=2, lrs=lrs)
    assert lrs[0] == 0 and all(lr > 0 for lr in lrs[1:])
    assert all(step["fc1"] == 0 and step["fc2"] == 0 for step in nonzero)
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient")
    assert f is not None and f.severity == "critical" and f.modules == ["fc1", "fc2"]
    assert f.numbers["optimizer_steps_sampled"] == sum(lr > 0 for lr in lrs) == 2
    assert "while the optimizer stepped on 2 sampled step(s) with a nonzero learning rate" in f.message


class _Lora(nn.Module):
    """A frozen layer and a LoRA pair beside it, B zero-initialised as peft's: A's weight gradient (B's weight
    times the output gradient, times the input) is zero until B has moved."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 1).requires_grad_(False)
        self.lora_a, self.lora_b = nn.Linear(16, 4, bias=False), nn.Linear(4, 1, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def test_a_zero_initialised_lora_b_under_a_warmup_from_0_is_no_layer_without_a_gradient() -> None:
    """The HF Trainer's warmup starts at a learning rate of 0, so B moves at step 1's update only, and A's weight
    gradient is zero on steps 0 and 1: the two steps a short run samples by default. no_gradient called this
    healthy LoRA run critical ('these weights did not learn', tester h73): a gradient zero only before the
    weights first moved is no layer without one."""
    lrs: list[float] = []
    prof, nonzero = _train(_Lora(), steps=2, warmup=2, lrs=lrs)
    assert lrs[0] == 0 < lrs[1]
    assert [step["lora_a"] for step in nonzero] == [0, 0] and all(step["lora_b"] > 0 for step in nonzero)
    assert precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient") is None


def test_layers_behind_a_weight_of_zeros_are_said_so_and_left_out_once_it_moved() -> None:
    """LoRA's B in a param group whose learning rate is 0 before step 2: A's gradient is zero on steps 0 to 2
    (B's weight is zero at each forward), past the other layers' first update. B moves at step 2's update, so
    A gets a gradient from step 3 on: A is no layer without a gradient, and no finding says so."""
    model = _Lora()
    prof, nonzero = _train(model, starts={"lora_b": 2})
    assert [step["lora_a"] for step in nonzero] == [0, 0, 0]
    assert bool((model.lora_b.weight != 0).any())  # moved by step 2's update
    assert precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient") is None


def test_layers_behind_a_weight_of_zeros_whose_learning_rate_was_0_are_a_warning(tmp_path: Path) -> None:
    """B's learning rate 0 on every sampled step (a warmup of its own that starts later): A got no gradient on
    any, B's weight stayed zero. The finding says the gradient stopped at B's weight of zeros and why it did not
    move, as a warning: the verdict box does not say the run did not learn."""
    model = _Lora()
    prof, nonzero = _train(model, starts={"lora_b": 99})
    assert all(step["lora_a"] == 0 for step in nonzero) and not bool((model.lora_b.weight != 0).any())
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient")
    assert f is not None and f.severity == "warning" and f.modules == ["lora_a"]
    assert f.title == "No gradient reached the weights of 1 of 2 layers: a weight of zeros stopped it"
    assert (
        "The gradient stopped at lora_b (Linear), whose weight was exactly zero on every sampled step"
        in f.message
    )
    assert "its learning rate was 0 on every sampled step" in f.message
    assert f.remedy.startswith("Nothing, if the learning rate of lora_b is meant to start later")
    prof.save(tmp_path / "run")
    page = render_run_dir(tmp_path / "run").read_text()
    assert 'id="verdict-no-gradient"' not in page


def test_layers_behind_a_frozen_weight_of_zeros_are_critical() -> None:
    """B zero-initialised and frozen: it never moves, and A never gets a gradient."""
    model = _Lora()
    model.lora_b.requires_grad_(False)
    prof, nonzero = _train(model)
    assert all(step["lora_a"] == 0 for step in nonzero) and not bool((model.lora_b.weight != 0).any())
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient")
    assert f is not None and f.severity == "critical" and f.modules == ["lora_a"]
    assert "lora_b (Linear), whose weight was exactly zero on every sampled step" in f.message
    assert "it is frozen (it has no gradient of its own), so it does not move" in f.message
    assert "Let the weight of lora_b train" in f.remedy


class _ReZeroBlock(nn.Module):
    """A residual branch behind a gate the block holds itself, zero-initialised (ReZero: x + alpha * f(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(32, 32), nn.GELU()
        self.alpha = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.alpha * self.act(self.fc(x))


class _ReZero(nn.Module):
    """inp -> a ReZero block -> head; with ``root``, a second gate of zeros the model holds itself, around a
    branch ``side`` of its own: out = head(block(h) + beta * side(h))."""

    def __init__(self, root: bool = False) -> None:
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(16, 32), _ReZeroBlock(), nn.Linear(32, 1)
        self.side = nn.Linear(32, 32) if root else None
        self.beta = nn.Parameter(torch.zeros(1)) if root else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        out = self.block(h)
        if self.side is not None and self.beta is not None:
            out = out + self.beta * self.side(h)
        return self.head(out)


@pytest.mark.parametrize("alpha", ["frozen", "idle", "late", "root"])
def test_a_rezero_gate_of_zeros_is_named_by_its_parameter_name(alpha: str) -> None:
    """ReZero's gate, ``self.alpha = nn.Parameter(torch.zeros(1))`` held by the block itself, in x + alpha * f(x):
    while alpha is 0 the branch's layer gets a zero weight gradient. The gate is no module's weight, so
    no_gradient blamed the head ('the gradient stopped at head (Linear) ... what its backward passed back to
    block.fc was zero everywhere', which it was not) and told the user to look for a dead ReLU. It names the
    gate by its full parameter name and why it did not move (frozen; a learning rate of 0 on every sampled
    step, a warning); a gate that moved on a sampled step leaves its branch out ('late'); a gate the model holds
    at its root is named by its own name ('root')."""
    model = _ReZero(root=alpha == "root")
    if alpha in ("frozen", "root"):
        model.block.alpha.requires_grad_(False)
        if model.beta is not None:
            model.beta.requires_grad_(False)
    starts = {"block.alpha": 99 if alpha == "idle" else 2} if alpha in ("idle", "late") else None
    prof, nonzero = _train(model, starts=starts)
    assert [step["block.fc"] for step in nonzero] == [0, 0, 0] and all(step["head"] > 0 for step in nonzero)
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient")
    if alpha == "late":  # alpha moved at step 2's update: block.fc gets a gradient from step 3 on
        assert bool((model.block.alpha != 0).any()) and f is None
        return
    assert f is not None and "head" not in f.message
    assert (
        "The gradient stopped at block.alpha, a parameter held by block (_ReZeroBlock) itself, which was exactly "
        "zero on every sampled step" in f.message
    )
    assert "passes back zeros to block.fc until it moves" in f.message
    if alpha == "idle":
        assert f.severity == "warning" and f.modules == ["block.fc"]
        assert "its learning rate was 0 on every sampled step" in f.message
        assert f.remedy.startswith("Nothing, if the learning rate of block.alpha is meant to start later")
        return
    assert f.severity == "critical" and "it is frozen (it has no gradient of its own)" in f.message
    assert f.remedy.startswith("Let block.alpha" + (", beta" if alpha == "root" else "") + " train")
    if alpha == "root":
        assert all(step["side"] == 0 for step in nonzero) and f.modules == ["block.fc", "side"]
        assert "The gradient stopped at beta, a parameter held by (model) (_ReZero) itself" in f.message
        assert "zeros to side until it moves" in f.message
    else:
        assert f.modules == ["block.fc"]


class _AuxHead(nn.Module):
    """fc1 -> head, and an auxiliary head ``aux`` on the same features; the model holds two parameters of zeros of
    its own that multiply nothing: ``offset``, frozen, added to the features, and ``shift``, added to aux's
    output. With ``first``, aux is called before head."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.fc1, self.head, self.aux = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 2)
        self.offset = nn.Parameter(torch.zeros(16), requires_grad=False)
        self.shift = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc1(x)) + self.offset
        aux = self.aux(h) + self.shift if self.first else None
        out = self.head(h)
        return out, self.aux(h) + self.shift if aux is None else aux


@pytest.mark.parametrize("first", [False, True])
def test_a_parameter_of_zeros_that_multiplies_nothing_is_no_gate(first: bool) -> None:
    """An auxiliary head whose loss is weighted 0 gets no gradient, and the model holds vectors of zeros that are
    only added (reviewer h78): no_gradient called the frozen offset a ReZero gate ('the gradient stopped at
    offset ... the branch it multiplies passes back zeros to aux') and told the user to let it train, which
    would not give aux a gradient. With aux called last, the finding says what it said before gates were named:
    nothing after aux received a gradient. Called before head, neither the frozen vector (no gradient of its
    own to show that it multiplies the branch, and no scalar) nor ``shift`` under a learning rate of 0 (its
    gradient, aux's output gradient summed, is zero, as no gate's is) is named; nor is head, the next module in
    forward order, said to have stopped aux's gradient: it reads the trunk beside aux, and the run cannot tell."""
    torch.manual_seed(0)
    model = _AuxHead(first)
    rest = [p for n, p in model.named_parameters() if p.requires_grad and n != "shift"]
    opt = torch.optim.AdamW([{"params": rest}, {"params": [model.shift], "lr": 0.0}], lr=1e-3)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with prof:
        for _ in range(3):
            out, aux = model(torch.randn(16, 8))
            loss = out.pow(2).mean() + 0.0 * aux.pow(2).mean()  # the auxiliary loss switched off
            loss.backward()
            assert model.aux.weight.grad is not None and not bool(model.aux.weight.grad.any())
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    assert not bool(model.shift.any())
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient")
    assert f is not None and f.severity == "critical" and f.modules == ["aux"]
    for name in ("offset", "shift", "ReZero"):
        assert name not in f.message and name not in f.remedy
    assert "a loss term weighted 0" in f.message
    if not first:
        assert "No module recorded after aux received a nonzero gradient either" in f.message
        return
    # head, called after aux, reads the trunk beside it: its backward never reaches aux (it said 'the gradient
    # stopped at head (Linear) ... what its backward passed back to aux was zero everywhere')
    assert "stopped at head" not in f.message and "passed back to aux" not in f.message
    assert (
        "The output gradient of aux held no nonzero value, while that of head (Linear), recorded after aux in "
        "forward order, did: no module passed aux a nonzero gradient, and the run does not tell whether head "
        "reads its output" in f.message
    )
    assert "or sits beside it (a parallel branch: then the loss does not depend on it" in f.message


def test_fp8_eligibility_says_an_output_gradient_of_zeros_was_recorded() -> None:
    """fc1's output gradient behind the dead ReLU was recorded on every step, every value zero: the FP8 rule held
    it back for "no backward statistics", which read as a gradient not recorded (the torchao run's layers 0 and 2,
    whose output gradients the last layer's FP8 cast had flushed, read the same)."""
    prof, _ = _train(_Mlp(dead=True))
    tables = prof.tables()
    grads = tables["layers"][
        (tables["layers"]["module"] == "fc1") & (tables["layers"]["tensor"] == "activation_grad")
    ]
    assert len(grads) == 3 and (grads["zeros"] == grads["numel"]).all()
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("fp8_eligibility")
    assert f is not None and "fc1" not in f.modules
    assert (
        "fc1 (every recorded value of its output gradient was zero: what FP8 does to it is not measured)"
        in (f.message)
    )
    assert "no backward statistics" not in f.message


def test_a_healthy_run_has_no_layer_without_a_gradient() -> None:
    prof, nonzero = _train(_Mlp(dead=False))
    assert all(n > 0 for step in nonzero for n in step.values())
    assert precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient") is None


def _fp8_mlp(convert: bool, quantize: bool = False) -> tuple[nn.Module, list[torch.Tensor]]:
    """The 3-layer MLP of the torchao run, converted with convert_to_float8_training where ``convert``, its
    weights made torchao's FP8 training weights by ``quantize_(model, Float8TrainingOpConfig())`` (torchao 0.18's
    rowwise recipe; the modules stay nn.Linear) where ``quantize``; and the list its last layer's output gradients
    go to (the test's own hook)."""
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16, bias=False)
    )
    if convert:
        float8.convert_to_float8_training(model)
    if quantize:
        config = pytest.importorskip("torchao.prototype.moe_training.config")
        pytest.importorskip("torchao.quantization").quantize_(model, config.Float8TrainingOpConfig())
    grads: list[torch.Tensor] = []
    model[4].register_full_backward_hook(lambda m, gi, go: grads.append(go[0].detach().float().clone()))
    return model, grads


def test_a_torchao_fp8_run_whose_casts_flushed_every_gradient_says_no_gradient_reached_its_weights() -> None:
    """A loss weighted by 1e-20 makes output gradients of about 1e-23, under torchao's floor on amax (1e-12):
    its e5m2 cast (torchao's own scale, below) flushes every one, so the last layer's weight gradient is 0 and so
    is the gradient it passes back. Every Float8Linear weight gradient was 0 on every step (read after each
    backward); the finding names the three layers and says FP8 flushed them, from the last layer's output
    gradient."""
    utils = pytest.importorskip("torchao.float8.float8_utils")
    model, grads = _fp8_mlp(convert=True)
    assert [type(m).__name__ for m in model[::2]] == ["Float8Linear"] * 3
    prof, nonzero = _train(model, dims=(32, 16), weight=1e-20, steps=2)
    assert all(n == 0 for step in nonzero for n in step.values())
    largest = max(float(g.abs().max()) for g in grads)
    for g in grads:  # torchao's own scale for the output gradient, and a real e5m2 cast after it
        scale = utils.amax_to_scale(g.abs().max(), torch.float8_e5m2)
        assert 0 < float(g.abs().max()) < 1e-12 and bool(
            ((g * scale).to(torch.float8_e5m2).float() == 0).all()
        )
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient")
    assert f is not None and f.severity == "critical" and f.modules == ["0", "2", "4"]
    assert f.title == "No gradient reached the weights of 3 of 3 layers: FP8 flushed it"
    assert f.numbers["fp8_flushed_layers"] == 3 and f.numbers["sampled_steps_with_grads"] == 2
    assert f.numbers["fp8_output_gradient_max"] == pytest.approx(largest, rel=1e-2)  # recorded in bf16
    assert 'FP8 flushed them: the output gradient of "4" (torchao Float8Linear) never exceeded' in f.message
    assert 'the gradient it passed back was zero too, which left "0", "2" without one' in f.message
    assert "leave them out of convert_to_float8_training" in f.remedy


def test_a_run_whose_weights_quantize_made_fp8_reads_as_fp8_with_its_layers() -> None:
    """``quantize_(model, Float8TrainingOpConfig())`` keeps each nn.Linear and wraps its weight in torchao's
    Float8TrainingWeightWrapperTensor, whose matmuls cast to FP8 as a Float8Linear's do: such a run read as bf16
    (the precision check without a word of FP8, "FP8 did not run" where fp8 was asked for), its FP8 eligibility
    without its layers' rowwise recipe, and no_gradient found no FP8 cause for the gradients the recipe's e4m3
    casts flushed. The run reads as fp8, names its layers and their recipe, and the Profiler leaves its training
    bitwise as it is."""
    summarize = pytest.importorskip("precprof.report.summarize")
    model, _ = _fp8_mlp(convert=False, quantize=True)
    assert [type(m.weight).__name__ for m in model[::2]] == ["Float8TrainingWeightWrapperTensor"] * 3
    assert [type(m).__name__ for m in model[::2]] == ["Linear"] * 3
    prof, nonzero = _train(model, dims=(32, 16), weight=1e-20, steps=2)
    assert all(n == 0 for step in nonzero for n in step.values())
    bare, _ = _fp8_mlp(convert=False, quantize=True)
    _train(bare, dims=(32, 16), weight=1e-20, steps=2, profiled=False)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), bare.parameters(), strict=True))
    capture = prof.summary()
    assert capture["precision_seen"] == "fp8"
    (recipe,) = capture["fp8_recipe"]
    assert recipe["layers"] == ["0", "2", "4"] and recipe["scaling"] == "rowwise"
    assert (recipe["module_type"], recipe["weight_type"]) == ("Linear", "Float8TrainingWeightWrapperTensor")
    assert recipe["casts"]["grad_output"]["dtype"] == "float8_e4m3fn" and recipe["round_scales_to_power_of_2"]
    for summary in ({"capture": capture}, {"capture": capture, "config": {"precision": "fp8"}}):
        check = summarize.precision_check(prof.tables()["layers"], prof.tables()["memory"], summary)
        assert check["ok"] and check["banner"] == "" and "Float8Linear" not in check["verdict"]
        assert (
            "FP8 GEMMs ran: 3 of 3 linear layers are nn.Linear with torchao's Float8TrainingWeightWrapperTensor "
            "weight (quantize_)" in check["verdict"]
        )
    rec = precprof.recommend(prof, hardware="h100", config=ALL)
    f = rec.finding("no_gradient")
    assert f is not None and f.modules == ["0", "2", "4"] and f.numbers["fp8_flushed_layers"] == 3
    assert (
        'FP8 flushed them: the output gradient of "4" (nn.Linear with torchao\'s FP8 training weight (quantize_)) '
        "never exceeded" in f.message
    )
    assert "the FP8 E4M3 cast of its backward" in f.message
    assert (
        "the output gradient of every nn.Linear with torchao's FP8 training weight (quantize_) exceeds"
        in (f.remedy)
    )
    assert "leave them out of quantize_ with filter_fn" in f.remedy
    eligibility = rec.finding("fp8_eligibility")
    assert (
        eligibility is not None
        and '3 layer(s) ("0", "2", "4") ran torchao\'s rowwise recipe' in eligibility.message
    )
    # without autocast (the loop's own: it asks nothing of the activations) the run read as fp32; its FP8 GEMMs ran
    prof, _ = _train(_fp8_mlp(convert=False, quantize=True)[0], dims=(32, 16), steps=1, autocast=False)
    assert prof.summary()["precision_seen"] == "fp8"
    check = summarize.precision_check(
        prof.tables()["layers"], prof.tables()["memory"], {"capture": prof.summary()}
    )
    assert check["ok"] and check["banner"] == "" and "NOT active" not in check["verdict"]
    assert check["verdict"].startswith(
        "No autocast: every activation of a module with parameters is float32. FP8 GEMMs ran: 3 of 3 linear "
        "layers are nn.Linear with torchao's Float8TrainingWeightWrapperTensor weight (quantize_) (they cast "
        "their input, weight and output gradient to FP8 for their matmuls; their outputs keep their input's "
        "dtype, float32 here)."
    )


def test_the_same_run_in_bf16_gets_its_gradients() -> None:
    """Unconverted, bf16 holds those gradients of 1e-23: every weight gradient has nonzero values, no finding."""
    model, _ = _fp8_mlp(convert=False)
    prof, nonzero = _train(model, dims=(32, 16), weight=1e-20, steps=2)
    assert all(n > 0 for step in nonzero for n in step.values())
    assert precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient") is None


class _Routed(nn.Module):
    """Two experts, every token routed to the first: the second is called on no token, as a loop calling each
    expert with the tokens routed to it does."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts[0](x) + self.experts[1](x[:0]).sum()  # no token: an empty batch, summed to 0
        return self.head(out)


@pytest.mark.parametrize("weight_decay", [0.01, 0.0])
def test_an_expert_no_token_reached_is_named_with_its_cause(weight_decay: float) -> None:
    """An expert called on no token: its weight gradient is zero on every step. Under AdamW's weight decay
    (0.01) its weight moves all the same; with weight_decay=0 (precprof train's default) AdamW applies exactly 0
    and it never moves, which the run's own update rows show (update_rms 0, no update on every sampled
    element): the finding said "weight decay or momentum alone moved them" of both. It says what the rows show."""
    model = _Routed()
    before = model.experts[1].weight.detach().clone()
    prof, nonzero = _train(model, weight_decay=weight_decay)
    assert [m for m in nonzero[0] if all(step[m] == 0 for step in nonzero)] == ["experts.1"]
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient")
    assert f is not None and f.modules == ["experts.1"]
    assert "No token reached experts.1 on any sampled step (an expert the router sent none to)" in f.message
    assert f.remedy.startswith("Balance the router's load")
    moved = not torch.equal(before, model.experts[1].weight)
    assert moved == (weight_decay > 0)
    said = (
        "these weights did not learn; weight decay or momentum alone moved them (a sampled update changed them "
        "on 3 sampled step(s))"
        if moved
        else "these weights did not learn; they did not move either: every sampled element's update was zero "
        "on each of the 3 sampled step(s) that recorded one"
    )
    assert said in f.message, f.message
    assert moved == ("moved them" in f.message)


class _DenseMoE(nn.Module):
    """Two experts run densely on every token, each output multiplied by its routing mask (as a dense MoE does),
    expert 1 never routed (its router bias -10): its output gradient is exactly zero, made by the mask multiply,
    while its sum with expert 0's reaches ``ln`` and ``head``. The experts sit in a module of their own (``moe``,
    which holds no parameter and is not recorded) or, ``flat``, beside ``ln`` in the model itself."""

    def __init__(self, flat: bool) -> None:
        super().__init__()
        router, experts = nn.Linear(16, 2), nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        with torch.no_grad():
            router.bias.copy_(torch.tensor([0.0, -10.0]))
        self.moe = None if flat else nn.ModuleDict({"router": router, "experts": experts})
        self.router, self.e0, self.e1 = (router, *experts) if flat else (None, None, None)
        self.ln, self.head = nn.LayerNorm(16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            router, experts = self.moe["router"], list(self.moe["experts"])
        else:
            router, experts = self.router, [self.e0, self.e1]
        p, idx = router(x).float().softmax(-1).max(-1)
        mixed = sum(e(x) * ((idx == i) * p)[:, None] for i, e in enumerate(experts))
        return self.head(self.ln(x + mixed))


@pytest.mark.parametrize("flat", [False, True])
def test_a_mask_between_a_layer_and_the_next_module_is_not_blamed_on_that_module(flat: bool) -> None:
    """A dense MoE's unrouted expert: no_gradient said 'the gradient stopped at ln (LayerNorm) ... what its
    backward passed back to moe.experts.1 was zero everywhere', which it was not: ln's backward feeds the sum of
    both experts' outputs, and expert 0 gets a nonzero gradient through it; the zero is the mask multiply's.
    Where a module's own code runs between them (moe, calling the experts) it names that module; where the
    experts sit beside ln, it says expert 0 got a nonzero gradient with nothing recorded between it and ln."""
    prof, nonzero = _train(_DenseMoE(flat))
    e1, e0 = ("e1", "e0") if flat else ("moe.experts.1", "moe.experts.0")
    assert all(step[e1] == 0 and step[e0] > 0 for step in nonzero)
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient")
    assert f is not None and f.modules == [e1]
    assert "The gradient stopped at ln" not in f.message and "backward passed back to" not in f.message
    assert (
        f"The output gradient of {e1} held no nonzero value, while that of ln (LayerNorm), the next module "
        f"recorded after {e1} in forward order, did; the run does not tell that ln's backward zeroed it: "
        in f.message
    ), f.message
    assert "a function between them may have zeroed the gradient (a mask, a routing weight" in f.message
    if flat:
        assert (
            "e0, called by the same module as e1 and before ln, got a nonzero gradient while no module recorded "
            "between e0 and ln did" in f.message
        )
    else:
        assert (
            "moe, which calls moe.experts.1, runs code of its own between moe.experts.1 and ln" in f.message
        )


class _Segments(nn.Module):
    """Token embeddings plus a segment embedding with padding_idx=0 that is fed only 0, the padding id (reviewer
    h100): torch passes that row no gradient, so seg never learns."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.seg = nn.Embedding(32, 8), nn.Embedding(4, 8, padding_idx=0)
        self.head = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(x) + self.seg(torch.zeros_like(x)))


@pytest.mark.parametrize("padding_row", [0.0, 0.5])
def test_an_embedding_fed_only_its_padding_idx_is_named_as_such(padding_row: float) -> None:
    """seg's weight gradient is zero on every step while its output gradient is not. The finding said 'the output
    gradient and the input of seg held nonzero values' and blamed a custom backward or a hook, and its remedy
    spoke of ReLUs and masks: the input is integer ids, which the run never records. The capture records the
    embedding's padding_idx; with the padding row of zeros torch gives it, seg's output is zero everywhere and the
    finding says it looked up only its padding_idx. With a padding row set to 0.5 its output tells nothing, and
    the finding says only what the run records: no claim about the input."""
    torch.manual_seed(0)
    model = _Segments()
    with torch.no_grad():
        model.seg.weight[0].fill_(padding_row)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with prof:
        for _ in range(3):
            x = torch.randint(0, 32, (4, 8))
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            assert model.seg.weight.grad is not None and not bool(model.seg.weight.grad.any())
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    entry = next(e for e in prof.summary()["modules"] if e["name"] == "seg")
    assert entry["padding_idx"] == 0
    f = precprof.recommend(prof, hardware="h100", config=ALL).finding("no_gradient")
    assert f is not None and f.severity == "critical" and f.modules == ["seg"]
    assert "the input of seg held nonzero values" not in f.message
    if padding_row == 0.0:
        assert (
            "The embedding seg (padding_idx=0) looked up only its padding_idx: its output was zero everywhere on "
            "every sampled step" in f.message
        )
        assert "torch passes the padding_idx row no gradient by construction" in f.message
        assert (
            f.remedy.startswith("Feed seg the ids meant for it (its padding_idx row")
            and "ReLU" not in f.remedy
        )
    else:
        assert "padding_idx=0" not in f.message
        assert (
            "The output gradient of seg held nonzero values, and the run does not record its input (an "
            "embedding's are integer ids)" in f.message
        )
        assert "ids that were all an embedding's padding_idx" in f.message


@pytest.mark.parametrize("dead", [True, False])
def test_the_verdict_box_says_when_layers_got_no_gradient(dead: bool, tmp_path: Path) -> None:
    """The verdict box read as a healthy run's beside weights that did not learn: it says how many layers got no
    gradient and points to the finding, and says nothing of it for a run whose every layer got one."""
    prof, nonzero = _train(_Mlp(dead=dead))
    assert any(n == 0 for n in nonzero[0].values()) == dead
    prof.save(tmp_path / "run")
    page = render_run_dir(tmp_path / "run").read_text()
    verdict = page[page.index('<section id="verdict">') :]
    verdict = re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", verdict[: verdict.index("</section>")])))
    said = "No gradient reached the weights of 2 of 3 layers on any sampled step. They did not learn"
    assert (said in verdict) == dead
    assert ("the format above rests on the other layers' gradients" in verdict) == dead
    assert 'id="verdict-master-weights"' not in page  # (no weight held in bf16)


def test_a_weight_gradient_the_fp16_gemm_flushed_is_said_to_be_fp16s(block_formats_on: None) -> None:
    """Tester t1: under fp16 autocast a layer's output gradient held two nonzero values, 2^-24 each, and its input
    none beyond 0.4: every product lies below 2^-25, and the weight-gradient GEMM, in fp16, rounds each entry to
    zero. The finding said "what zeroed their weight gradients the run does not tell (a custom backward, a hook
    that zeroed them)". It names fp16's flush now, with the bound it read from the run, and fp16's remedy."""
    torch.manual_seed(0)
    fc1 = nn.Linear(16, 8)
    model = nn.Sequential()
    model.add_module("fc1", fc1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pick = torch.zeros(32, 8)
    pick[3, 1] = pick[17, 5] = 2.0**-24  # the loss's gradient: fc1's output gradient, exact in fp16
    grads: list[torch.Tensor] = []
    fp32: list[int] = []
    xs: list[torch.Tensor] = []

    def keep_grad(mod: nn.Module, args: object, y: torch.Tensor) -> None:
        y.register_hook(grads.append)

    fc1.register_forward_hook(keep_grad)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with prof:
        for step in range(3):
            x = (torch.rand(32, 16, generator=torch.Generator().manual_seed(step)) - 0.5) * 0.8
            xs.append(x)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = (out.float() * pick).sum()
            loss.backward()
            assert fc1.weight.grad is not None and not bool(fc1.weight.grad.any())  # fp16's GEMM: all zero
            fp32.append(int((grads[-1].float().t() @ x != 0).sum()))  # the same GEMM in fp32
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    assert all(g.dtype == torch.float16 and int((g != 0).sum()) == 2 for g in grads) and min(fp32) > 0
    f = precprof.recommend(prof, hardware="t4", config=ALL).finding("no_gradient")
    assert f is not None and f.modules == ["fc1"]
    assert "custom backward" not in f.message and "a hook" not in f.message
    bound = max(2 * 2.0**-24 * float(x.abs().max()) for x in xs)
    assert (
        f"The output gradient and the input of fc1 held nonzero values, but every entry of their weight gradient "
        f"is at most {bound:.3g}" in f.message
    )
    assert (
        "the weight-gradient GEMM, which fp16 autocast runs in fp16, holds such an entry as zero" in f.message
    )
    assert f.remedy.startswith("Scale the loss more, or train in bf16")
