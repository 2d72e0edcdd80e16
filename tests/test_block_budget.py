"""The block-format what-if fits a time budget by default: the layers are dealt into as many groups as keep
it within ``block_budget`` of the rest of a sampled step, from its measured cost."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import precprof
from precprof import pipeline
from precprof import tables as T
from precprof.capture import Profiler
from precprof.capture.block_budget import MAX_FACTOR, PRIOR_CALL_S, BlockBudget, TimerCalibration, is_control
from precprof.report.environment import block_setting as _block_setting


def test_the_groups_follow_the_median_estimate() -> None:
    b = BlockBudget(share=0.1, fixed=None, n_layers=12)
    assert b.groups == 12 and b.adaptive  # one layer per group until the cost is measured
    # gpt-mini on 2 CPU cores: every layer's what-if 340 ms, the rest of the step 587 ms
    ratio = b.estimate(step_s=0.587 + 0.340, block_s=0.340, evaluated_share=1.0)
    assert ratio == pytest.approx(0.340 / 0.587)
    assert not b.observe(0, ratio)  # the first sampled step warms up: not counted
    # fewer groups (more cost per step) wait for three estimates
    again = b.estimate(step_s=0.587 + 0.340 / 12, block_s=0.340 / 12, evaluated_share=1 / 12)
    assert again == pytest.approx(ratio)
    assert not b.observe(1, again) and not b.observe(2, again)
    assert b.observe(3, again) and b.groups == 6  # ceil(0.579 / 0.1)
    assert not b.observe(4, 40.0) and not b.observe(5, 40.0)  # the median is still 0.58
    # more groups (less cost) at once: the median of (0.58 x 3, 40 x 3) is 20.3
    assert b.observe(6, 40.0) and b.groups == 12  # one layer per group, no more
    assert b.history == [{"step": 3, "groups": 6, "from": 12}, {"step": 6, "groups": 12, "from": 6}]


def test_a_noisy_step_does_not_redeal() -> None:
    b = BlockBudget(share=0.1, fixed=None, n_layers=50, start=1)
    b.observe(0, 0.3)
    for step, r in enumerate([0.3, 0.3, 0.3, 9.0, 0.3], start=1):
        b.observe(step, r)
    assert b.groups == 3 and [h["groups"] for h in b.history] == [3]


def test_fewer_groups_wait_for_three_estimates_since_the_last_change() -> None:
    """A median that crosses the boundary between 3 and 4 groups back and forth: a 30-step gpt-nano run went
    3 -> 4 -> 3 on consecutive sampled steps, eight changes, as fewer groups waited for three estimates over the
    whole run, not since the last change (the README: "fewer wait for three")."""
    b = BlockBudget(share=0.1, fixed=None, n_layers=12)
    b.observe(0, 1.0)  # warm-up: not counted
    estimates = [0.25, 0.25, 0.25, 0.45, 0.45, 0.45, 0.25, 0.45, 0.25, 0.25]
    for step, r in enumerate(estimates, start=1):
        b.observe(step, r)
    # the medians of the estimates so far, by hand: .25 (step 3: 3 groups, the third estimate), .25, .25,
    # (.25 + .45) / 2 = .35 (step 6: 4 groups at once), then .25 at step 7 asks for 3 again, and waits for the
    # third estimate since step 6 (step 9, whose median is .25 again); step 10's .25 keeps 3
    assert b.history == [
        {"step": 3, "groups": 3, "from": 12},
        {"step": 6, "groups": 4, "from": 3},
        {"step": 9, "groups": 3, "from": 4},
    ]


def test_a_fixed_count_never_changes_and_estimates_need_data() -> None:
    b = BlockBudget(share=0.1, fixed=2, n_layers=8)
    for step in range(4):
        assert not b.observe(step, 50.0)
    assert b.groups == 2 and b.describe() == {"groups": 2, "adaptive": False}
    assert b.estimate(1.0, 0.0, 0.5) is None  # no what-if ran
    assert b.estimate(1.0, 0.2, 0.0) is None  # no layer evaluated
    assert b.estimate(0.1, 0.2, 1.0) is None  # nothing left for the rest of the step
    with pytest.raises(ValueError, match="block_budget"):
        BlockBudget(share=0.0, fixed=None, n_layers=3)
    with pytest.raises(ValueError, match="block_budget"):
        Profiler(nn.Linear(2, 2), block_budget=-1)


def _calibrated(steps: list[tuple[str, float, float]]) -> TimerCalibration:
    """A calibration fed sampled steps in order: ("c" control | "e" evaluating | "C"/"E" the same measuring
    memory, step seconds, timer seconds)."""
    cal = TimerCalibration()
    for kind, step_s, block_s in steps:
        if kind.lower() == "c":
            cal.control(step_s, memory=kind.isupper())
        else:
            cal.evaluated(step_s, block_s, memory=kind.isupper())
    return cal


def test_the_timer_is_scaled_by_what_evaluating_steps_add_over_controls() -> None:
    """Controls (steps evaluating no block format) time a sampled step without the what-if; the evaluating steps
    around each, beyond it, over what their timer read, scale the timer. Steps that measure memory are compared
    with their own kind, each control with its neighbours (a machine's drift cancels), and local ratios that
    disagree leave the factor as it was."""
    assert TimerCalibration().factor == 1.0  # nothing measured yet
    ev = ("e", 0.121, 0.010)
    three = [ev, ("c", 0.100, 0), ev, ("c", 0.101, 0), ev, ("c", 0.099, 0), ev]
    assert _calibrated(three).factor == pytest.approx(2.0, abs=0.11)  # (0.121 - ~0.100) / 0.010
    assert _calibrated(three[:-1]).factor == 1.0  # the last control has no step after it: two are not enough
    # a machine that slows down over the run: each control is read against its neighbours, not the run's median
    drift = []
    for i in range(4):
        base = 0.100 + 0.020 * i
        drift += [("e", base + 0.020, 0.010), ("c", base, 0), ("e", base + 0.020, 0.010)]
    assert _calibrated(drift).factor == pytest.approx(2.0)
    # a step that measures memory (capitals) is compared with its own kind only
    mixed = [
        ("e", 0.121, 0.010),
        ("E", 0.190, 0.010),
        ("c", 0.100, 0),
        ("e", 0.121, 0.010),
        ("C", 0.160, 0),
        ("E", 0.190, 0.010),
        ("c", 0.100, 0),
        ("e", 0.121, 0.010),
    ]
    # 2.1, 3.0 (the memory control against its own kind) and 2.1: the median is 2.1; read against the nearest
    # steps of either kind, the first control would give (0.1555 - 0.100) / 0.010 = 5.55
    assert _calibrated(mixed).factor == pytest.approx(2.1)
    # never below 1 (a timer that read more than the step gained), never above MAX_FACTOR
    assert _calibrated([("e", 0.101, 0.010), ("c", 0.100, 0)] * 3 + [("e", 0.101, 0.010)]).factor == 1.0
    assert _calibrated([("e", 0.200, 0.010), ("c", 0.100, 0)] * 3 + [("e", 0.200, 0.010)]).factor == 3.0
    # a timed what-if too small against the step does not calibrate
    assert _calibrated([("e", 0.110, 0.001), ("c", 0.100, 0)] * 3 + [("e", 0.110, 0.001)]).factor == 1.0
    # local ratios that disagree (a shared machine) leave the factor as it was
    cal = _calibrated(three)
    for control_s in (
        0.050,
        0.150,
        0.050,
        0.150,
        0.050,
    ):  # controls 50 ms either side of the steps around them
        cal.control(control_s, memory=False)
        cal.evaluated(0.121, 0.010, memory=False)
    assert cal.factor == pytest.approx(2.0, abs=0.11)
    # the budget reads the scaled timer: twice the timer, twice the estimate
    b = BlockBudget(share=0.1, fixed=None, n_layers=8)
    plain = b.estimate(0.121, 0.010, 0.5)
    scaled = b.estimate(0.121, 0.020, 0.5)
    assert plain is not None and scaled is not None and scaled > 2 * plain


def test_until_the_controls_agree_each_call_the_timer_read_adds_the_devices_prior() -> None:
    """On the CPU each call the timer read is taken to add ``PRIOR_CALL_S`` beyond its reading until the controls
    tell: at a factor of 1 a 10% budget let the what-if of tiny layers add 17-19% (calls of about 15 us, as many
    again around them), while a flat factor of 2 halved what a larger model's few long calls covered. Controls
    that agree replace it (lower too); ones that disagree leave it; a device with no measured prior counts 1."""
    cal = TimerCalibration()
    cal.use_prior("cpu")
    per_call = PRIOR_CALL_S["cpu"]
    assert cal.factor_for(67 * per_call, 67) == pytest.approx(2.0)  # tiny layers: calls as long as the prior
    assert cal.factor_for(0.040, 12) == pytest.approx(1.0 + 12 * per_call / 0.040)  # gpt-mini: 1.0045
    assert cal.factor_for(1e-4, 100) == MAX_FACTOR
    assert cal.factor_for(0.0, 0) == MAX_FACTOR  # nothing read: the last factor stays
    cal.factor_for(67 * per_call, 67)
    # local ratios 7.1, 2.1, -2.9, 5.1 and -0.9: their median deviation is 3
    noisy = [s for c in (0.050, 0.100, 0.150, 0.070, 0.130) for s in (("e", 0.121, 0.010), ("c", c, 0))]
    noisy.append(("e", 0.121, 0.010))
    for kind, step_s, block_s in noisy:
        if kind == "c":
            cal.control(step_s, memory=False)
        else:
            cal.evaluated(step_s, block_s, memory=False)
    assert not cal.told and cal.factor == pytest.approx(2.0)  # disagreeing controls say nothing
    told = TimerCalibration()
    told.use_prior("cpu")
    for kind, step_s, block_s in [("e", 0.1115, 0.010), ("c", 0.100, 0)] * 3 + [("e", 0.1115, 0.010)]:
        if kind == "c":
            told.control(step_s, memory=False)
        else:
            told.evaluated(step_s, block_s, memory=False)
    assert told.told and told.factor == pytest.approx(1.15)
    assert told.factor_for(1e-4, 100) == pytest.approx(1.15)  # the controls' factor, whatever the calls
    cuda = TimerCalibration()
    cuda.use_prior("cuda")
    assert cuda.factor_for(1e-4, 100) == 1.0
    # the Profiler gives its deal the model's device at attach and the timer's calls after each sampled step;
    # the summary and the report say whose factor it is
    prof = _run(3, block_budget=0.1)
    desc = prof._blocks.describe()
    assert desc["timer_factor_measured"] is False and 1.0 < desc["timer_factor"] <= MAX_FACTOR
    desc["control_steps"], desc["timer_factor"] = 3, 2.0
    assert "too uneven to tell: its timer's reading taken 2.0 times" in _block_setting(desc)
    desc["timer_factor_measured"] = True
    assert "2.0 times what its own timer reads" in _block_setting(desc)


def test_control_steps_are_the_3rd_the_5th_and_one_in_8() -> None:
    assert [k for k in range(40) if is_control(k)] == [2, 4, 10, 18, 26, 34]


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.relu(lin(x))
        return x


def _run(steps: int, **kw: object) -> Profiler:
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = Profiler(model, optimizer=opt, sample_every=1, memory=False, block_formats=True, **kw)  # type: ignore[arg-type]
    with prof:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(16, 32)).square().mean().backward()
            opt.step()
            prof.step()
    return prof


def _evaluated(prof: Profiler) -> dict[int, set[str]]:
    """Per step, the layers whose weight got block statistics."""
    layers = prof.tables()["layers"]
    w = layers[(layers[T.TENSOR] == T.WEIGHT) & layers[T.BLOCK_COLUMNS[0]].notna()]
    return {int(s): set(g[T.MODULE]) for s, g in w.groupby(T.STEP)}


def test_a_tight_budget_deals_one_layer_per_group_whatever_the_speed() -> None:
    """Any measured cost over a budget of 1e-9 of a step asks for more groups than layers: one each."""
    prof = _run(7, block_budget=1e-9)
    assert prof.block_groups == 4
    seen = _evaluated(prof)
    steps = [seen.get(s, set()) for s in range(7)]
    # one layer per sampled step, taking turns, but for the 3rd and 5th, which evaluate none (controls)
    assert [len(s) for s in steps] == [1, 1, 0, 1, 0, 1, 1]
    assert set().union(*steps[:6]) == {f"layers.{i}" for i in range(4)}
    assert steps[6] == steps[0]
    desc = prof.summary()["block_formats"]
    assert desc["adaptive"] and desc["groups"] == 4 and desc["changes"] == []
    assert desc["control_steps"] == 2 and desc["timer_factor"] >= 1.0
    text = _block_setting(desc)
    assert "every 4th sampled step" in text and "within <0.0001% of a sampled step" in text


def test_a_loose_budget_keeps_every_layer_on_every_step() -> None:
    prof = _run(8, block_budget=1e9)
    assert prof.block_groups == 1
    seen = _evaluated(prof)
    # one layer per sampled step until three estimates agree (steps 1, 3 and 5: 2 and 4 are controls), then
    # every layer
    assert [len(seen.get(s, ())) for s in range(8)] == [1, 1, 0, 1, 0, 1, 4, 4]
    assert prof.summary()["block_formats"]["changes"] == [{"step": 5, "groups": 1, "from": 4}]
    # (in turns before step 5, every layer from it: not "every linear layer on every sampled step")
    assert "the linear layers in turns, in 1 to 4 groups as the run went on (1 at its end)" in _block_setting(
        prof.summary()["block_formats"]
    )


@pytest.mark.parametrize(("steps", "budget"), [(7, 1e-9), (8, 1e9), (2, 1e-9)])
def test_the_summary_says_how_many_layers_were_covered_and_how_often(steps: int, budget: float) -> None:
    """The summary's and the report's coverage is the layers table's: layers whose operands got block
    statistics, and the fewest and most sampled steps that evaluated one."""
    prof = _run(steps, block_budget=budget)
    per_layer: dict[str, int] = {}
    for layers in _evaluated(prof).values():
        for name in layers:
            per_layer[name] = per_layer.get(name, 0) + 1
    counts = [per_layer.get(f"layers.{i}", 0) for i in range(4)]
    desc = prof.summary()["block_formats"]
    assert desc["layers"] == 4 and desc["layers_evaluated"] == sum(c > 0 for c in counts)
    assert desc["evaluations"] == [min(counts), max(counts)]
    text = _block_setting(desc)
    assert f"{desc['layers_evaluated']} of 4 linear layers evaluated" in text


class _TiedLM(nn.Module):
    """An embedding, a linear layer and an output head tied to the embedding: two linear layers and an
    embedding whose weight the head reads."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.emb(ids)))


def _coverage_of(make: Callable[[], nn.Module]) -> tuple[dict[str, Any], precprof.Profiler]:
    """The block what-if's summary of two sampled steps of a model ``make`` builds (token ids in, its layers in
    one group), and the Profiler."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Profiler(
        model, optimizer=opt, sample_every=1, memory=False, block_formats=True, block_groups=1
    ) as prof:
        for _ in range(2):
            model(torch.randint(0, 32, (4, 8))).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    desc: dict[str, Any] = prof.summary()["block_formats"]
    return desc, prof


def test_the_coverage_counts_linear_layers_apart_from_embeddings() -> None:
    """A GPT-2's report said "3 of 11 layers evaluated" beside the advisor's "3 of the 9 linear layers": the
    two embeddings, whose weights a tied head reads, were counted as layers. They are said apart."""
    desc, _ = _coverage_of(_TiedLM)
    assert (desc["layers"], desc["embeddings"]) == (2, 1)
    assert "of 2 linear layers evaluated (and 1 of 1 embeddings, whose weight a tied head reads)" in (
        _block_setting(desc)
    )


class _PositionLM(nn.Module):
    """A token and a position embedding, a linear layer and an output head, tied to the token embedding or not:
    two embeddings, of which one or none has a head reading its weight."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.pos = nn.Embedding(8, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.emb(ids) + self.pos(torch.arange(ids.shape[1]))))


@pytest.mark.parametrize("tie", [True, False])
def test_the_coverage_says_how_many_embeddings_a_tied_head_reads(tie: bool) -> None:
    """The Capture row said "(and 1 of 1 embeddings, whose weight a tied head reads)" for models with no tied
    head, and "0 of 2 embeddings, whose weight a tied head reads" for a GPT whose position embedding no head
    reads: every embedding was counted as tied. The row says how many of them a head is tied to."""
    torch.manual_seed(0)
    model = _PositionLM(tie)
    tied = sum(model.head.weight is e.weight for e in (model.emb, model.pos))
    assert tied == int(tie)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Profiler(
        model, optimizer=opt, sample_every=1, memory=False, block_formats=True, block_groups=1
    ) as prof:
        for _ in range(2):
            model(torch.randint(0, 32, (4, 8))).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    desc = prof.summary()["block_formats"]
    assert (desc["embeddings"], desc["embeddings_tied"]) == (2, tied)
    text = _block_setting(desc)
    assert "whose weight a tied head reads" not in text, text
    has = "; a head is tied to 1 of the 2" if tied else ", though no head is tied to one here"
    assert f"embeddings, evaluated in case a head is tied to their weight{has})" in text, text


class _Attention(nn.Module):
    """An embedding, an nn.MultiheadAttention (its out_proj an nn.Linear it never calls: it reads the weight as a
    function's), a linear layer and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(self.fc(h + self.attn(h, h, h, need_weights=False)[0]))


def test_the_coverage_counts_the_linear_layers_whose_forward_ran() -> None:
    """A TransformerEncoder's report read "7 of 7 linear layers evaluated" in its Capture row beside the block
    plan's "linear layers evaluated 5": the two nn.MultiheadAttention out_projs, whose forward never runs, were
    counted as evaluated whenever their group's turn came. Both count the linear layers that ran: fc and head."""
    desc, prof = _coverage_of(_Attention)
    assert (desc["layers"], desc["layers_evaluated"], desc["evaluations"]) == (2, 2, [2, 2])
    assert "2 of 2 linear layers evaluated" in _block_setting(desc)
    f = precprof.recommend(prof, hardware="b200").finding("block_format_plan")
    assert f is not None and f.numbers["checked"] == 2 and not f.numbers["not_evaluated"]


def test_a_reattached_profiler_keeps_what_its_budget_measured() -> None:
    prof = _run(4, block_budget=1e-9)
    assert prof.block_groups == 4
    with prof:
        assert prof.block_groups == 4
        assert sorted({s.block_group for s in prof._modules if isinstance(s.module, nn.Linear)}) == [
            0,
            1,
            2,
            3,
        ]


def test_the_block_plan_says_which_linear_layers_it_did_not_evaluate() -> None:
    """A tight budget on 2 sampled steps evaluates one of the 4 layers per step: the plan judged 2 and said
    "each of the 2 linear layers", as if the model had no others."""
    from precprof.analysis.advisor import recommend

    prof = _run(2, block_budget=1e-9)
    evaluated = set().union(*_evaluated(prof).values())
    assert 0 < len(evaluated) < 4
    rec = recommend(prof, hardware="b200")
    f = next(f for f in rec.findings if "not_evaluated" in f.numbers)
    assert f.numbers["checked"] == len(evaluated) and f.numbers["not_evaluated"] == 4 - len(evaluated)
    assert f"The what-if evaluated {len(evaluated)} of the 4 linear layers" in f.message
    missing = sorted({f"layers.{i}" for i in range(4)} - evaluated)
    assert all(m in f.message.split("did not reach", 1)[1] for m in missing)


def test_a_run_too_short_for_the_budget_to_widen_names_what_covers_its_layers() -> None:
    """Two sampled steps: the first warms up, the second makes the budget's one estimate, and the budget puts
    more layers in a group only on three, so a budget of 1e9 still evaluated one of the 4 layers a step. The
    finding said "a larger Profiler(block_budget=...) covers them", and the Environment row "as many groups as
    keep the what-if within 1e+11% of a sampled step" beside its 4 groups. Both say the groups were never
    widened, and the remedy they name, block_groups=1, evaluates every layer on both steps of a run as short.
    With the groups fixed by the user the budget plays no part, and the remedy does not name it."""
    from precprof.analysis.advisor import recommend

    prof = _run(2, block_budget=1e9)
    assert [len(layers) for _, layers in sorted(_evaluated(prof).items())] == [1, 1]
    desc = prof.summary()["block_formats"]
    assert (desc["groups"], desc["estimates"], desc["estimates_to_widen"]) == (4, 1, 3)
    f = recommend(prof, hardware="b200").finding("block_format_plan")
    assert f is not None and "The what-if evaluated 2 of the 4 linear layers" in f.message
    assert "a larger Profiler(block_budget=...) does not" in f.message
    assert "Profiler(block_groups=1) evaluates every layer on every sampled step" in f.message
    text = _block_setting(desc)
    assert "as many groups as keep" not in text, text
    assert (
        "one layer a group, as the block budget (1e+11% of a sampled step) starts, until 3 sampled steps"
        in text
    )
    assert "this run's measured it on 1" in text
    every = {f"layers.{i}" for i in range(4)}
    assert _evaluated(_run(2, block_groups=1)) == {0: every, 1: every}
    fixed = recommend(_run(2, block_groups=4), hardware="b200").finding("block_format_plan")
    assert fixed is not None and "did not reach" in fixed.message and "block_budget" not in fixed.message
    assert "more sampled steps" in fixed.message and "Profiler(block_groups=1)" in fixed.message


def test_a_plan_the_turns_did_not_cover_counts_and_names_every_linear_layer(tmp_path: Path) -> None:
    """4 sampled steps of a tight budget, the 3rd and 5th control steps: the turns reach 3 of the 4 layers. A run
    like it (2 of 9 reached) read "2 NVFP4 of the 2 linear layers ...; the rest of the model follows the format
    above" in the verdict, "Block formats on b200: 2 NVFP4" in the title and the verdict box, and "each is
    evaluated on every 10th sampled step, exactly" in the what-if section. Each says how many of the linear
    layers were evaluated, and the verdict names the others; the section says what the capture did."""
    from precprof.analysis.advisor import recommend

    prof = _run(4, block_budget=1e-9, out=tmp_path / "run")
    prof.save()
    seen = _evaluated(prof)
    per_layer = {m: sum(m in s for s in seen.values()) for m in (f"layers.{i}" for i in range(4))}
    missing = [m for m, n in per_layer.items() if not n]
    reached = 4 - len(missing)
    assert 0 < reached < 4
    controls = 4 - len(seen)  # sampled steps whose layers got no block statistics
    rec = recommend(prof, hardware="b200")
    f = rec.finding("block_format_plan")
    assert f is not None and f.title.endswith(f" of 4 linear layers, {len(missing)} not evaluated"), f.title
    reason = next(r for r in rec.reasons if r.startswith("Block formats on B200"))
    assert (
        f"of the 4 linear layers; the what-if did not reach the other {len(missing)} ({missing[0]})" in reason
    )
    assert f"not evaluated ({len(missing)}): {missing[0]}" in rec.describe()
    page = pipeline.rerender(tmp_path / "run", target="b200").read_text()
    box = page[page.index('id="block-unreached"') :]
    assert box.startswith(f'id="block-unreached">not evaluated ({len(missing)}): <code>{missing[0]}</code>')
    unit = "sampled step" if max(per_layer.values()) == 1 else "sampled steps"
    turns = (
        f"(the layers take turns in 4 groups: {reached} of the 4 linear layers were evaluated, each on at most "
        f"{max(per_layer.values())} {unit}; {controls} sampled step{'s' if controls != 1 else ''} evaluated none"
    )
    assert controls == prof.summary()["block_formats"]["control_steps"]  # the step begun and never run: none
    assert turns in page and "exactly)" not in page


def _steps(out: Path, steps: range, **kw: object) -> Profiler:
    """``_run``'s training over ``steps`` into the run directory ``out``, one layer a group (a tight budget)."""
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = Profiler(
        model, optimizer=opt, sample_every=1, memory=False, block_formats=True, block_budget=1e-9, out=out,
        first_step=steps[0], **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    with prof:
        for step in steps:
            opt.zero_grad(set_to_none=True)
            model(
                torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
            ).square().mean().backward()
            opt.step()
            prof.step()
    return prof


def test_a_resumed_run_goes_on_with_the_layers_its_turns_had_not_reached(tmp_path: Path) -> None:
    """A run resumed at step 4 started its turns over: its steps 4, 5 and 7 evaluated the groups of steps 0, 1
    and 3, and two of the layers never, and its report said "each over 2 of the 8 sampled steps" in the finding
    beside "2 of the 4 linear layers were evaluated, each on at most 1 sampled step" in the what-if table and the
    Environment (tester t5). The turns go on from what the earlier attempts evaluated (the layer they had not
    reached first), and the coverage counts every attempt's sampled steps, as the finding does."""
    from precprof.analysis.advisor import recommend

    out = tmp_path / "run"
    killed = _steps(out, range(6))  # preempted after step 5, its checkpoint at step 4
    killed._owned_run.release()
    assert _evaluated(killed) == {0: {"layers.0"}, 1: {"layers.1"}, 3: {"layers.2"}, 5: {"layers.3"}}
    prof = _steps(out, range(4, 8), resume=True)
    prof.save()
    layers = T.read_tables(out)["layers"]
    w = layers[(layers[T.TENSOR] == T.WEIGHT) & layers[T.BLOCK_COLUMNS[0]].notna()]
    seen = {int(s): set(g[T.MODULE]) for s, g in w.groupby(T.STEP)}
    # 0-3 the killed attempt's; from 4 on the one its turns had not reached, then in turn from the first
    assert seen == {
        0: {"layers.0"},
        1: {"layers.1"},
        3: {"layers.2"},
        4: {"layers.3"},
        5: {"layers.0"},
        7: {"layers.1"},
    }
    per_layer = w.groupby(T.MODULE)[T.STEP].nunique()
    desc = prof.summary()["block_formats"]
    assert (desc["layers"], desc["layers_evaluated"]) == (4, 4)
    assert desc["evaluations"] == [int(per_layer.min()), int(per_layer.max())] == [1, 2]
    assert desc["control_steps"] == 2  # steps 2 and 6, one of each attempt
    text = _block_setting(desc)
    assert "4 of 4 linear layers evaluated, each on 1 to 2 sampled steps" in text, text
    f = recommend(out, hardware="b200").finding("block_format_plan")
    assert f is not None and "each over 1 to 2 of the 8 sampled steps" in f.message, f.message
    page = pipeline.rerender(out, target="b200").read_text()
    assert "each was evaluated on 1 to 2 sampled steps; 2 sampled steps evaluated none" in page
