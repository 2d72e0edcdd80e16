"""fp16's forward-pass findings on real tiny training runs (CPU, seconds each): which module a value went out
of fp16's range in, and which layer the advice names, each checked by the test's own hooks and by training
the way the advice says."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from scenarios import huge_activations, raw_features, tiny_features
from scenarios.loop import ProfiledRun, regression_batches, train_profiled
from torch import nn

from precprof import tables as T


def _cast_to_inf(steps: int) -> tuple[list[torch.Tensor], int]:
    """The raw-feature batches of ``steps`` steps, and how many of their values a cast to fp16 makes inf."""
    xs = [raw_features.batches(step)[0] for step in range(steps)]
    return xs, sum(int(torch.isinf(x.half()).sum()) for x in xs)


@pytest.mark.usefixtures("block_formats_on")  # fc1's input, the model's, has a row of its own
def test_a_linear_whose_input_overflowed_in_the_cast_is_not_said_to_overflow_inside() -> None:
    """Raw features beyond 65504 fed to a Linear under fp16 autocast: the cast of its input makes inf, and the
    Linear's output rows that read one are inf. The finding said the Linear "turned inf inside ... an exp that
    overflowed, or a log or a division" and sent the user to F.log_softmax. It says now that the inf came from
    its input, which overflowed, and to scale that input down or run the layer in fp32; both, followed, keep the
    forward pass finite."""
    run, seen = raw_features.run("fp16", loss_scale=2.0**16)
    xs, over = _cast_to_inf(len(seen))
    # the test's own hook: fc1's inf rows are exactly the rows of its input that the cast made inf
    for x, y in zip(xs, seen, strict=True):
        assert y.dtype == torch.float16 and torch.equal(
            torch.isinf(y).any(dim=1), torch.isinf(x.half()).any(dim=1)
        )
    inf = sum(int(torch.isinf(y).sum()) for y in seen)
    assert over > 0 and inf > 0
    f = run.recommend("t4").finding("fp16_activation_overflow")
    assert f is not None and f.severity == "critical"
    assert "inside" not in f.message and "log_softmax" not in f.remedy
    # fc1's input row and fc1 are one module (the title said "in 2 module(s)" of the one layer hooked above)
    assert f.title == "Activations overflow fp16 in 1 module(s)" and f.numbers["modules"] == 1
    assert f.message.startswith("1 layer(s) read an input beyond fp16's 65504 (")
    # it happened (tester t1): said as such, not as a what-if
    assert (
        f"fc1:input: max |x| {max(float(x.abs().max()) for x in xs):.3g}, {over} values beyond 65504; fp16 autocast "
        "cast them to fp16 for the matmul of fc1, where they became inf;" in f.message
    )
    assert f.numbers["cast_inf_values"] == over and "would become inf" not in f.message
    assert f"fc1: {inf:,} inf in fp16 from its input, which overflowed fp16 (fc1:input)" in f.message
    # the model's own input: the layer reading it is told once what to do (it was told twice, in two ways)
    assert (
        "fc1:input is the model's own input: keep the layer reading it (fc1) in fp32, or normalise"
        in f.remedy
    )
    assert f.remedy.count("(fc1)") == 1

    _, seen_kept = raw_features.run("fp16", loss_scale=2.0**16, keep_fp32=["fc1"])
    assert all(bool(y.isfinite().all()) for y in seen_kept)
    normalised, seen_norm = raw_features.run("fp16", loss_scale=2.0**16, scale=1.0)
    assert all(bool(y.isfinite().all()) for y in seen_norm)
    assert not normalised.tables["steps"][T.SKIPPED].any() and normalised.losses[-1] < normalised.losses[0]


@pytest.mark.usefixtures("block_formats_on")  # fc1's input, the model's, has a row of its own
def test_a_layer_kept_in_fp32_that_fp16_still_needs_there_stays_in_the_keep_list() -> None:
    """The advice followed: fc1 kept in fp32 (outside autocast) reads the raw features unrounded and its outputs
    are finite. Its re-profile advised keep_fp32 = []: fc1 cast nothing to fp16, so nothing looked wrong, and a
    user pasting the new snippet dropped the wrapper and had the inf rows back. fc1 is judged on its own input and
    output now, which fp16 autocast would cast: it stays in the list, said to be kept already. head, kept as well
    though its values fit fp16, is said to be free to run under autocast again; followed, the run stays finite.
    Under bf16, whose range is fp32's, neither is kept, and the verdict says so."""
    run, seen = raw_features.run("fp16", loss_scale=2.0**16, keep_fp32=["fc1", "head"])
    xs, over = _cast_to_inf(len(seen))
    assert over > 0 and all(y.dtype == torch.float32 and bool(y.isfinite().all()) for y in seen)
    rec = run.recommend("t4")
    assert rec.format == "fp16" and rec.keep_fp32 == ["fc1"]
    f = rec.finding("fp16_kept_fp32")
    assert f is not None and f.severity == "info" and f.modules == ["fc1", "head"]
    assert (
        f"fc1: {over} values an fp16 cast makes inf in fc1's input and fc1's output (max |x| {max(float(x.abs().max()) for x in xs):.3g})"
        in (f.message)
    )
    assert "Keep fc1 in fp32 as this run already does (outside autocast)" in " ".join(rec.reasons)
    assert "head ran in fp32 outside autocast and may run under fp16 autocast again" in " ".join(rec.reasons)
    # head released, as the advice says: the forward pass, head's fp16 output and the loss, stays finite
    released, seen_released = raw_features.run("fp16", loss_scale=2.0**16, keep_fp32=["fc1"])
    assert all(bool(y.isfinite().all()) for y in seen_released)
    assert all(math.isfinite(loss) for loss in released.losses)
    bf16 = run.recommend("a100")
    assert bf16.format == "bf16" and bf16.keep_fp32 == []
    assert "fc1, head ran in fp32 outside autocast and may run under bf16 autocast again" in " ".join(
        bf16.reasons
    )


def test_a_linear_whose_input_was_not_recorded_is_not_said_to_overflow_inside() -> None:
    """The same run with block formats off records fc1's input row too (the model's input, which the cast made
    inf), and says so. A run recorded before, with no row for fc1's input (its rows and its capture.gemm_inputs
    entry taken out here): which of its input or its sums went beyond 65504 the run cannot tell, and an exp, a log
    or a division a Linear does not have."""
    run, seen = raw_features.run("fp16", loss_scale=2.0**16)
    inf = sum(int(torch.isinf(y).sum()) for y in seen)
    now = run.recommend("t4").finding("fp16_activation_overflow")
    assert (
        now is not None
        and f"fc1: {inf:,} inf in fp16 from its input, which overflowed fp16 (fc1:input)" in (now.message)
    )
    layers = run.tables["layers"]
    capture = run.summary[T.SUMMARY_CAPTURE]
    older = ProfiledRun(
        {**run.tables, "layers": layers[~layers[T.MODULE].str.endswith(T.INPUT_SUFFIX)]},
        {
            **run.summary,
            T.SUMMARY_CAPTURE: {
                **capture,
                "gemm_inputs": {m: r for m, r in capture["gemm_inputs"].items() if r},
                "model_inputs": [],
            },
        },
        run.losses,
    )
    f = older.recommend("t4").finding("fp16_activation_overflow")
    assert f is not None and "inside" not in f.message and "log_softmax" not in f.remedy
    assert f.title == "Activations overflow fp16 in 1 module(s)"
    assert f"fc1: {inf:,} inf in fp16 though its largest finite value is " in f.message
    assert (
        "its input held a value beyond 65504 that the cast to fp16 made inf, or one of its sums" in f.message
    )
    assert "a layer whose input or sums overflow fp16 (fc1) needs that input scaled down" in f.remedy


def _flushed(calls: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The nonzero values of fc1's inputs that a cast to fp16 makes 0 (a real cast)."""
    x = torch.cat([inp.flatten() for inp, _ in calls])
    return int(((x.half() == 0) & (x != 0)).sum())


def test_tiny_activations_name_the_layer_that_casts_them_to_fp16() -> None:
    """A unit conversion scales the input by 1e-7 and fc1 reads it: a quarter of its values flush when fp16
    autocast casts fc1's input. fp16_activation_underflow said "Keep these modules in fp32" of the conversion,
    which already is fp32: followed, fc1 still casts its output and the re-profile finds the same. It names fc1
    now, the layer that casts; followed, fc1 computes from the fp32 values and the finding is gone."""
    run, seen = tiny_features.run("fp32")
    flushed = _flushed(seen)
    f = run.recommend("t4").finding("fp16_activation_underflow")
    assert f is not None and f.modules == ["units"] and f.numbers["underflow_values"] == flushed > 0
    assert f.remedy.startswith(
        "Keep fc1 in fp32 (outside autocast): fc1 casts its input (the output of units) to fp16, "
    )
    assert "(keeping units in fp32 instead changes nothing" in f.remedy

    # the old advice, followed: units was fp32 already; fc1 still casts its input and computes in fp16
    units, seen_units = tiny_features.run("fp16", loss_scale=2.0**16, keep_fp32=["units"])
    assert all(inp.dtype == torch.float32 and out.dtype == torch.float16 for inp, out in seen_units)
    assert _flushed(seen_units) == flushed  # the same inputs, the same values cast
    again = units.recommend("t4").finding("fp16_activation_underflow")
    assert again is not None and again.remedy.split(", flushing")[0] == f.remedy.split(", flushing")[0]
    # the new advice: fc1 computes in fp32 from the unflushed input, as the fp32 run did, and nothing is found
    kept, seen_kept = tiny_features.run("fp16", loss_scale=2.0**16, keep_fp32=["fc1"])
    assert all(out.dtype == torch.float32 for _, out in seen_kept)
    assert torch.equal(seen_kept[0][1], seen[0][1])  # step 0: the same weights, the same output
    assert kept.recommend("t4").finding("fp16_activation_underflow") is None


def _flushed_share(ts: list[torch.Tensor]) -> float:
    """The share of the nonzero values of ``ts`` that a cast to fp16 makes 0 (a real cast)."""
    x = torch.cat([t.flatten() for t in ts])
    nonzero = x[x != 0]
    return float((nonzero.half() == 0).sum()) / nonzero.numel()


def test_the_layer_the_underflow_remedy_names_is_in_the_keep_list() -> None:
    """fp16_activation_underflow said "Keep fc1 in fp32" beside keep_fp32 = [] (and an fp16 snippet without it):
    the keep list took the layers whose activations overflow alone. What fc1 casts to fp16 (its input, the
    conversion's output), cast to fp16 by the test, flushes more than the 1% the finding warns at: fc1 is in the
    list, with that share in the remedy, and stays there in the re-profile of the run that keeps it, where the
    finding is gone. The share is of its input: the remedy said "22.2% of the nonzero values it casts" of a layer
    whose input lost 66.6%, dividing by its output's values too, which it computes in fp16 and does not cast."""
    run, seen = tiny_features.run("fp32")
    share = _flushed_share([inp for inp, _ in seen])
    both = _flushed_share([t for call in seen for t in call])  # the share the remedy gave, input and output
    assert share > 0.01 and f"{both * 100:.3g}" != f"{share * 100:.3g}"
    rec = run.recommend("t4")
    f = rec.finding("fp16_activation_underflow")
    assert f is not None and rec.format == "fp16" and rec.keep_fp32 == ["fc1"]
    assert (
        f"fc1 casts its input (the output of units) to fp16, flushing {share * 100:.3g}% of that input's nonzero "
        "values" in f.remedy
    )
    assert "Keep fc1 in fp32: autocast would cast activations to fp16 there that flush to zero" in " ".join(
        rec.reasons
    )
    bf16 = run.recommend("a100")
    assert bf16.format == "bf16" and bf16.keep_fp32 == [] and bf16.fp16_keep_fp32 == ["fc1"]
    kept, _ = tiny_features.run("fp16", loss_scale=2.0**16, keep_fp32=["fc1"])
    again = kept.recommend("t4")
    assert again.finding("fp16_activation_underflow") is None and again.keep_fp32 == ["fc1"]


def test_a_wide_layer_kept_in_fp32_whose_input_would_flush_stays_kept() -> None:
    """fc1 1024 wide, kept in fp32, reads the tiny input: a cast to fp16 would flush as much of it as of the
    narrow fc1's, but its output has 32 times as many values, none flushed. Judged on both in one share, fc1
    flushed less than 1% and was said to "run under fp16 autocast again": followed, autocast casts its input and
    the values are lost. Its input is judged on its own now, and fc1 stays in the keep list."""
    run, seen = tiny_features.run("fp16", loss_scale=2.0**16, keep_fp32=["fc1"], width=1024)
    assert all(inp.dtype == out.dtype == torch.float32 for inp, out in seen)
    share = _flushed_share([inp for inp, _ in seen])
    assert share > 0.01 and _flushed_share([out for _, out in seen]) == 0
    assert _flushed_share([t for call in seen for t in call]) < 0.01  # the share of both, which hid it
    rec = run.recommend("t4")
    f = rec.finding("fp16_kept_fp32")
    assert f is not None and rec.keep_fp32 == ["fc1"] and "may run under fp16 autocast again" not in f.remedy
    assert (
        f"fc1: the cast of its input to fp16 would flush {share * 100:.3g}% of that input's nonzero values"
        in (f.message)
    )


def test_tiny_activations_without_the_readers_recorded_name_no_layer() -> None:
    """A run recorded by an older precprof has no record of which layer reads which module's output: the remedy
    says to keep the layers that read the values in fp32, and that this run cannot name them."""
    run, _ = tiny_features.run("fp32")
    del run.summary[T.SUMMARY_CAPTURE]["gemm_inputs"]
    f = run.recommend("t4").finding("fp16_activation_underflow")
    assert f is not None and "Keep these modules in fp32" not in f.remedy
    assert f.remedy.startswith("Keep the layers that read these values in fp32 (outside autocast)")
    assert "this run did not record which layer reads which module's output" in f.remedy


class _DropoutAfterOverflow(nn.Module):
    """huge_activations' net with a dropout after ``amplify``, whose outputs go beyond 65504: the dropout passes
    them on (and scales them by 1/(1-p))."""

    def __init__(self) -> None:
        super().__init__()
        self.net = huge_activations.HugeActivationNet()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.net
        return n.head(n.norm(self.drop(n.amplify(torch.relu(n.embed(x))))))


def _dropout_run(precision: str, keep: list[str]) -> tuple[ProfiledRun, dict[str, list[torch.Tensor]]]:
    """_DropoutAfterOverflow trained 3 steps (always from the same weights), and the outputs of amplify and of
    the dropout, call by call."""
    torch.manual_seed(0)
    model = _DropoutAfterOverflow()
    seen: dict[str, list[torch.Tensor]] = {"net.amplify": [], "drop": []}
    for name in seen:
        model.get_submodule(name).register_forward_hook(
            lambda mod, args, y, name=name: seen[name].append(y.detach())
        )
    run = train_profiled(
        model,
        regression_batches(huge_activations.N_IN),
        huge_activations.mse,
        precision=precision,
        loss_scale=2.0**16 if precision == "fp16" else None,
        keep_fp32=keep,
        steps=3,
    )
    return run, seen


def _over_fp16(ys: list[torch.Tensor]) -> int:
    """How many finite values of ``ys`` a cast to fp16 makes inf."""
    return sum(int((y.isfinite() & y.half().isinf()).sum()) for y in ys)


class _WideThenHead(nn.Module):
    """wide: a Linear whose weights are 1e6 times the usual, kept in fp32 by the test (its output beyond 65504, of
    both signs); head: a Linear under fp16 autocast that reads it, so autocast casts its input to fp16."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide, self.head = nn.Linear(16, 32), nn.Linear(32, 1)
        with torch.no_grad():
            self.wide.weight.mul_(1e6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.wide(x))


@pytest.mark.usefixtures("block_formats_on")  # head's input row and what it reads are recorded
def test_an_fp32_input_that_overflowed_in_autocasts_cast_is_said_as_what_happened() -> None:
    """An fp32 tensor beyond 65504 (wide's output, wide kept out of autocast) read by a Linear under fp16 autocast:
    the cast of its input to fp16 makes inf of both signs, and head's output is nan on every step (inf - inf),
    every step skipped. fp16_activation_overflow said "[warning] ... values in fp32/bf16 tensors would become
    inf", a what-if, as it says of a bf16 run, since head held nan, not inf (tester t1). The overflow happened:
    critical now, and said as what happened, the values counted by the test's own hooks."""
    model = _WideThenHead()
    seen: dict[str, list[torch.Tensor]] = {"wide": [], "head": []}
    for name in seen:
        getattr(model, name).register_forward_hook(lambda m, a, y, n=name: seen[n].append(y.detach().clone()))
    run = train_profiled(
        model,
        regression_batches(16),
        nn.functional.mse_loss,
        precision="fp16",
        loss_scale=2.0**16,
        steps=3,
        keep_fp32=["wide"],
    )
    over = sum(int((y.isfinite() & y.half().isinf()).sum()) for y in seen["wide"])
    assert over > 0 and all(y.dtype == torch.float32 for y in seen["wide"])
    assert all(y.dtype == torch.float16 and bool(y.isnan().all()) for y in seen["head"])
    assert bool(run.tables["steps"][T.SKIPPED].all())
    f = run.recommend("t4").finding("fp16_activation_overflow")
    assert f is not None and f.severity == "critical" and f.numbers["observed_inf_modules"] == 0
    assert f.numbers["cast_inf_values"] == f.numbers["overflow_values"] == over
    assert "would become inf" not in f.message
    assert (
        f"({over:,} values in fp32/bf16 tensors became inf where fp16 autocast cast them to fp16" in f.message
    )
    nan = sum(int(y.isnan().sum()) for y in seen["head"])
    assert (
        f"fp16 autocast cast them to fp16 for the matmul of head, where they became inf, and its fp16 output held "
        f"{nan:,} nan and 0 inf on those steps" in f.message
    )
    # the same tensor in a bf16 run: a what-if, as before
    bf16 = train_profiled(
        _WideThenHead(),
        regression_batches(16),
        nn.functional.mse_loss,
        precision="bf16",
        steps=3,
        keep_fp32=["wide"],
    )
    f = bf16.recommend("t4").finding("fp16_activation_overflow")
    assert f is not None and f.severity == "warning" and "would become inf" in f.message
    assert "cast_inf_values" not in f.numbers


def test_a_dropout_that_passes_an_overflow_on_is_kept_through_the_layer_that_feeds_it() -> None:
    """A dropout after a layer whose outputs go beyond 65504 holds them too, and fp16's keep list named it beside
    the layer: "keep_fp32 = ['net.amplify', 'drop']". A dropout computes in its input's dtype: kept in fp32 alone,
    its input still overflowed in fp16 first. The list names the layer that feeds it, and kept alone that one
    keeps the dropout's values finite (the test's own hook on the dropout). The finding counted the dropout's
    copies of the layer's values as overflows of their own (T5's wo and the dropout after it: 292 values said,
    146 made): it counts the layer's and says the dropout's beside them."""
    run, seen32 = _dropout_run("fp32", [])
    own, passed = _over_fp16(seen32["net.amplify"]), _over_fp16(seen32["drop"])
    assert own > 0 and passed > own  # the dropout's 1/(1-p) lifts more of them beyond 65504
    rec = run.recommend("t4")
    assert rec.format == "fp16" and rec.keep_fp32 == ["net.amplify"]
    f = rec.finding("fp16_activation_overflow")
    assert f is not None and f.modules == ["net.amplify"] and f.title.endswith("in 1 module(s)")
    assert f.numbers["overflow_values"] == own and f.numbers["passed_on_modules"] == 1
    assert f"({own} values in fp32/bf16 tensors would become inf)" in f.message
    assert (
        f"{own} values an fp16 cast makes inf (drop, after it, passes them on, scaled up by a dropout's 1/(1-p): "
        f"{passed} an fp16 cast makes inf there, not counted again)" in f.message
    )
    # the dropout kept in fp32 alone: its input was inf already
    _, seen_drop = _dropout_run("fp16", ["drop"])
    assert all(y.dtype == torch.float32 for y in seen_drop["drop"])
    assert any(bool(torch.isinf(y).any()) for y in seen_drop["drop"])
    # the layer that feeds it: the dropout computes in fp32 and its values stay finite
    kept, seen_kept = _dropout_run("fp16", ["net.amplify"])
    assert all(y.dtype == torch.float32 and bool(y.isfinite().all()) for y in seen_kept["drop"])
    assert all(math.isfinite(loss) for loss in kept.losses)


def test_a_dropout_holding_the_inf_it_passed_on_is_not_near_overflow() -> None:
    """In fp16, amplify overflows and the dropout after it holds its inf, beside finite values up to 65504: it
    was listed as "within 2x of fp16's limit", a warning that reads "without overflowing". Its overflow is
    amplify's, which the overflow finding names."""
    run, seen = _dropout_run("fp16", [])
    assert all(bool(y.isinf().any()) and y.dtype == torch.float16 for y in seen["drop"])
    rec = run.recommend("t4")
    f = rec.finding("fp16_activation_overflow")
    assert f is not None and f.modules == ["net.amplify"]
    near = rec.finding("fp16_activation_near_overflow")
    assert near is None or "drop" not in near.modules


@pytest.mark.usefixtures("block_formats_on")  # head's input, the model's, has a row of its own
def test_a_kept_layer_whose_values_flush_a_little_is_said_to_flush_that_much() -> None:
    """head, kept in fp32, reads a batch of which 1 value in 256 lies below fp16's smallest subnormal: the cast
    to fp16 flushes 0.39% of its input, within the 1% the forward rules allow, so fp16 may have it back, and that
    was said as "none flushed: it fits fp16". The share is said as a real cast to fp16 flushes it, counted by the
    test on the batches it trained on (the same on every step)."""
    torch.manual_seed(0)
    head = nn.Linear(32, 8)
    model = nn.Sequential()
    model.add_module("head", head)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 32, generator=g) + 4.0  # (no value near zero by chance)
        x.view(-1)[::256] = 1e-9
        return x, torch.randn(8, 8, generator=g)

    run = train_profiled(
        model, batch, nn.functional.mse_loss, precision="fp16", loss_scale=2.0**8, keep_fp32=["head"], steps=2
    )
    x = torch.cat([batch(s)[0] for s in range(2)])
    flushed = float(((x.half() == 0) & (x != 0)).sum()) / float((x != 0).sum())
    assert flushed == 1 / 256
    f = run.recommend("t4").finding("fp16_kept_fp32")
    assert f is not None and "none flushed" not in f.message
    assert (
        f"the cast of its input to fp16 would flush {flushed * 100:.3g}% of that input's nonzero values, and 0% "
        "of its output's would flush as it computes it in fp16, within the 1% the forward rules allow: it fits "
        "fp16" in f.message
    )


def _norm_between_run(
    precision: str, keep: list[str]
) -> tuple[ProfiledRun, list[torch.Tensor], list[torch.Tensor]]:
    """A Linear whose weights are 1e-9 of the usual, so its outputs lie below fp16's floor, then a LayerNorm without
    a weight (its eps leaves them small), a ReLU and two more Linear layers; trained 3 steps at a learning rate
    too small to move the tiny weights. Returns the run, the first Linear's outputs and the second's inputs (the
    test's own hooks)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.LayerNorm(32, elementwise_affine=False),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 1),
    )
    with torch.no_grad():
        model[0].weight.mul_(1e-9)
        model[0].bias.mul_(1e-9)
    outputs: list[torch.Tensor] = []
    inputs: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda mod, args, y: outputs.append(y.detach()))
    model[3].register_forward_hook(lambda mod, args, y: inputs.append(args[0].detach()))
    run = train_profiled(
        model,
        regression_batches(16),
        nn.functional.mse_loss,
        precision=precision,
        loss_scale=2.0**16 if precision == "fp16" else None,
        keep_fp32=keep,
        steps=3,
        lr=1e-12,
    )
    return run, outputs, inputs


def test_a_norm_between_the_layers_that_cast_tiny_values_keeps_them_in_the_list() -> None:
    """Tiny activations flow from Linear 0 through a LayerNorm without a weight and a ReLU into Linear 3: 0
    computes its output in fp16 and 3 casts its input there, each flushing more than 1% (a real cast of the fp32
    run's values, by the test). The LayerNorm is read by no matmul, and that alone made the remedy the generic
    "keep the layers that read these values in fp32" and fp16's keep list empty, dropping 0 and 3. Both are named
    and kept now, with their shares, and the LayerNorm is said apart; followed, the finding is gone."""
    run, outputs, inputs = _norm_between_run("fp32", [])
    out0, in3 = _flushed_share(outputs), _flushed_share(inputs)
    assert out0 > 0.01 and in3 > 0.01
    rec = run.recommend("t4")
    f = rec.finding("fp16_activation_underflow")
    assert f is not None and "1" in f.modules and rec.fp16_keep_fp32 == ["0", "3"]
    assert f.remedy.startswith(
        f'Keep "0", "3" in fp32 (outside autocast): "0" computes its output in fp16, where {out0 * 100:.3g}% of '
        f'its nonzero values flush; "3" casts its input (the output of "2") to fp16, flushing {in3 * 100:.3g}% of '
        "that "
        "input's nonzero values"
    )
    assert 'no matmul layer reads the output of "1" directly' in f.remedy
    kept, outputs, inputs = _norm_between_run("fp16", ["0", "3"])
    assert all(t.dtype == torch.float32 for t in [*outputs, *inputs])
    assert kept.recommend("t4").finding("fp16_activation_underflow") is None


class _GruLm(nn.Module):
    """An embedding, a 3-layer GRU, a dropout and a head: CPU autocast leaves nn.GRU in fp32 (CUDA's runs cuDNN's in fp16)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 64)
        self.rnn = nn.GRU(64, 64, num_layers=3, dropout=0.1, batch_first=True)
        self.drop, self.head = nn.Dropout(0.1), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.rnn(self.emb(x))[0]))


def test_a_recurrent_layer_cpu_autocast_left_in_fp32_is_said_for_the_target(tmp_path: Any) -> None:
    """A GRU LM under fp16 autocast and a GradScaler on a CPU, whose autocast runs nn.GRU in fp32: advised for an
    H100, the underflow finding left out "emb, rnn, whose gradients an fp16 run holds in fp32", where CUDA's
    autocast runs the GRU in fp16; and the precision check said "1 of 3 modules ... produce float16 activations"
    and nothing of the GRU, 2 x its weights' values FLOPs a token, 94% of the matmul layers' (reviewer t3)."""
    import json

    import pandas as pd

    import precprof
    from precprof.report import summarize

    model = _GruLm()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with precprof.Profiler(
        model, optimizer=opt, scaler=scaler, sample_every=1, out=tmp_path, overwrite=True
    ) as prof:
        for _ in range(2):
            x = torch.randint(0, 64, (4, 33), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x[:, :-1])
            loss = nn.functional.cross_entropy(out.float().reshape(-1, 64), x[:, 1:].reshape(-1))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    prof.save()
    with torch.autocast("cpu", dtype=torch.float16):
        assert (
            model.rnn(model.emb(x))[0].dtype == torch.float32
            and model.head(x.float().new_ones(1, 64)).dtype == torch.float16
        )
    h100 = precprof.recommend(tmp_path, hardware="h100").finding("fp16_gradient_underflow")
    assert h100 is not None and "an fp16 run holds in fp32" not in h100.message
    assert (
        "whose gradients this run held in fp32 (autocast on this run's cpu; on the H100 autocast runs the recurrent "
        "layers (rnn) in fp16" in h100.message
    )
    cpu = precprof.recommend(tmp_path, hardware="cpu").finding("fp16_gradient_underflow")
    assert cpu is not None and "rnn" in cpu.message and "autocast on this run's cpu" not in cpu.message
    summary = json.loads((tmp_path / "summary.json").read_text())
    layers = pd.read_parquet(tmp_path / "layers.parquet")
    verdict = summarize.precision_check(layers, pd.read_parquet(tmp_path / "memory.parquet"), summary)[
        "verdict"
    ]
    weights = sum(p.numel() for n, p in model.rnn.named_parameters() if n.startswith("weight"))
    share = weights / (weights + model.head.weight.numel())
    assert verdict.startswith("Mixed precision is active: 1 of 3 modules with parameters produce float16")
    assert (
        f"Not in float16: the matmul layer rnn (GRU), holding {100 * share:.3g}% of the matmul layers' weight values, "
        "ran in float32 (autocast on cpu left it there)." in verdict
    )


class _Stream(nn.Module):
    """Six 64-wide Linear blocks on a residual stream that grows 10x a block (h = 10 (h + relu(block(h)))), then
    a head: under fp16 autocast the stream, added between the modules, passes 65504 before blocks.5."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(6)])
        self.out = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = 10.0 * (h + torch.relu(block(h)))
        return self.out(h)


def _stream_run(keep: list[str]) -> tuple[ProfiledRun, list[torch.Tensor]]:
    """_Stream trained 2 steps under fp16 autocast with ``keep`` outside it; and what blocks.5 read (the test's
    own hook)."""
    torch.manual_seed(0)
    model = _Stream()
    read: list[torch.Tensor] = []
    model.blocks[5].register_forward_hook(lambda mod, args, y: read.append(args[0].detach()))
    run = train_profiled(
        model,
        regression_batches(32, batch=32),
        nn.functional.mse_loss,
        precision="fp16",
        loss_scale=2.0**16,
        keep_fp32=keep,
        steps=2,
        lr=1e-12,
    )
    return run, read


@pytest.mark.usefixtures("block_formats_on")  # the stream's rows between the modules have rows of their own
def test_a_kept_layer_behind_an_overflowing_residual_stream_is_never_said_to_fit_fp16() -> None:
    """Tester t1: the advice on a residual stream that overflows fp16 between modules went round in a circle.
    Kept blocks.5 and the head in fp32: blocks.4 under autocast hands the stream fp16, which is inf before
    blocks.5 reads it, and every value after is nan; both were said to "fit fp16" (their largest value n/a, a nan
    compares False with the limit) and to run under autocast again. Kept blocks.4 as well: the forward pass is
    finite, but blocks.4 was released, its own values fitting fp16, and followed, the stream is fp16 and inf
    again. Now a layer with nan/inf or no largest value is never released, one whose input the code between
    modules made inf in fp16 stays kept, said to be beyond keep_fp32's reach, with bf16 named; and a layer whose
    fp32 output hands that code the fp32 it needs stays kept. The advice, followed, is the run it was given by."""
    run, read = _stream_run(["blocks.5", "out"])
    assert all(x.dtype == torch.float16 and bool(torch.isinf(x).any()) for x in read)
    rec = run.recommend("t4")
    f = rec.finding("fp16_kept_fp32")
    assert (
        f is not None and "fits fp16" not in f.message and "may run under fp16 autocast again" not in f.remedy
    )
    assert f.numbers["released"] == 0 and f.modules == ["blocks.5", "out"]
    assert "blocks.5: its input, made between modules" in f.message
    assert "keeping blocks.5 in fp32 cannot make that input finite" in f.message
    assert "out: " in f.message and "what fp16 would make of its values is not measured" in f.message
    assert "the inf in blocks.5's input is made between modules" in f.remedy and "use bf16" in f.remedy
    keep = rec.fp16_keep_fp32
    assert keep == ["blocks.4", "blocks.5", "out"]

    followed, read = _stream_run(keep)
    assert all(x.dtype == torch.float32 and bool(x.isfinite().all()) for x in read)
    assert max(float(x.abs().max()) for x in read) > 65504  # fp32 only because blocks.4 hands it fp32
    again = followed.recommend("t4")
    g = again.finding("fp16_kept_fp32")
    assert (
        g is not None and g.numbers["released"] == 0 and "may run under fp16 autocast again" not in g.remedy
    )
    assert "blocks.4: its own values fit fp16" in g.message and "this one could hand it fp16" in g.message
    assert again.fp16_keep_fp32 == keep
