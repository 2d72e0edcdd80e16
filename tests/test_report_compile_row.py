"""The report's torch.compile row and overhead card say what each run did (tester h94): with ``memory=False``
the row named "the activations the memory section shows" beside a section that recorded none; with every step
sampled it said the unsampled steps ran compiled and then that none did, and named the CLI's ``--sample-every``
in a loop of the user's own; with no step sampled it said "the sampled ones ran it eagerly", and the header
withheld the overhead it had measured ("0 sampled, 299 unsampled steps timed: 3 of each needed"); a compiled
loss or optimizer step beside an uncompiled model, which the sampled steps ran eagerly too, had no row at all.

Tiny real runs of Dynamo's eager backend: a compile is a trace, no kernels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import precprof
from precprof import _compat
from precprof import tables as T
from precprof.report import filters as F
from precprof.report.context import _headline, _no_memory_why
from precprof.report.environment import capture_rows


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _run(
    steps: int,
    compile_model: bool = True,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    compile_step: bool = False,
    **kw: Any,
) -> precprof.Profiler:
    """``steps`` steps of SGD on a tiny model, compiled (``backend="eager"``) or not, with ``loss_fn`` (the
    mean square by default) and the optimizer's step compiled or not, under a Profiler given the model the
    loop calls; ``kw``: the Profiler's."""
    import torch._dynamo

    torch._dynamo.reset()
    model = _model()
    run = torch.compile(model, backend="eager") if compile_model else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    opt_step = torch.compile(opt.step, backend="eager") if compile_step else opt.step
    g = torch.Generator().manual_seed(1)
    loss_of = loss_fn or (lambda out: out.pow(2).mean())
    with precprof.Profiler(run, optimizer=opt, **kw) as prof:
        for _ in range(steps):
            loss = loss_of(run(torch.randn(4, 8, generator=g)))
            loss.backward()
            opt_step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    return prof


def _row(prof: precprof.Profiler, cfg: dict[str, Any] | None = None) -> str:
    return dict(capture_rows(prof.summary(), cfg or {})).get("torch.compile", "")


def test_the_compile_row_names_memory_only_where_the_memory_section_shows_some() -> None:
    """``Profiler(memory=False)``: no memory section's activations to be eager's; with memory on, there are."""
    off = _row(_run(3, sample_every=2, memory=False))
    assert off == (
        "the whole model (backend eager): the steps not sampled ran compiled; the sampled ones ran it eagerly "
        "(for the hooks), so their statistics are eager PyTorch's values, their time is eager's"
    )
    on = _row(_run(3, sample_every=2))
    assert on.startswith(off) and ", and so are the activations the memory section shows" in on


def test_every_step_sampled_says_none_ran_compiled_and_names_the_runs_own_setting() -> None:
    """``sample_every=1``: no step ran compiled, said once, with the setting as the run sets it: the Profiler's
    argument in a loop of the user's own, ``--sample-every`` for ``precprof train`` (its config's command line),
    PrecprofCallback's under the callbacks."""
    prof = _run(2, sample_every=1, memory=False)
    row = _row(prof)
    assert row == (
        "the whole model (backend eager): every step was sampled, and a sampled step runs it eagerly (for the "
        "hooks): no step of this run ran compiled, so its losses, statistics and step times are eager PyTorch's "
        "(sample fewer steps to see compiled ones: Profiler(sample_every=N) with N above 1)"
    )
    assert "steps not sampled" not in row and "--sample-every" not in row
    cli = _row(prof, {"command_line": "precprof train --compile --sample-every 1", "compile": True})
    assert cli.endswith("(sample fewer steps to see compiled ones: --sample-every N with N above 1)")
    hf = _row(prof, {"source": "transformers.Trainer"})
    assert hf.endswith(
        "(sample fewer steps to see compiled ones: PrecprofCallback(sample_every=N) with N above 1)"
    )


def test_no_step_sampled_says_every_step_ran_compiled() -> None:
    """``sample_every=0``: no sampled step ran the model eagerly; it said the sampled ones did."""
    assert _row(_run(3, sample_every=0, memory=False)) == (
        "the whole model (backend eager): every step ran compiled (no step was sampled, and only a sampled step "
        "runs it eagerly, for the hooks)"
    )


def test_the_overhead_of_a_run_that_sampled_no_step_is_what_prof_step_took() -> None:
    """``sample_every=0``: the header's overhead is what prof.step() took on every step (the summary's
    ``overhead_every_step``), measured on the unsampled steps alone; it was withheld for want of 3 timed
    sampled steps, which such a run never has."""
    prof = _run(5, compile_model=False, sample_every=0, memory=False)
    capture = prof.summary()
    sampling = capture["sampling"]
    assert sampling["overhead"] == sampling["overhead_every_step"] > 0 and sampling["overhead_sampled"] == 0
    pct = F.pct(sampling["overhead_every_step"])
    head = dict(_headline({T.SUMMARY_CAPTURE: capture}, prof.tables()["steps"], T.empty("layers")))
    assert (
        head["precprof's overhead"]
        == f"{pct} of the run's time (no step sampled; prof.step() on every step {pct})"
    )
    # from fewer than 3 timed steps (the first is not timed), not measured, and the count it needed
    few = _run(3, compile_model=False, sample_every=0, memory=False)
    head = dict(_headline({T.SUMMARY_CAPTURE: few.summary()}, few.tables()["steps"], T.empty("layers")))
    assert head["precprof's overhead"] == "not measured (no step sampled; 2 steps timed: 3 needed)"
    # what such a run could not measure names the setting of a loop of the user's own, not the CLI's flag
    rec = precprof.recommend(few, hardware="h100", summary={})
    said = " ".join([*rec.reasons, *(f.message for f in rec.findings)])
    assert "Profiler(sample_every=0) records none" in said and "profile with Profiler(sample_every=N)" in said
    assert "--sample-every" not in said
    # and the CLI's flag where the built-in loop recorded it, the callback's argument under a Trainer
    cli = precprof.recommend(
        few, hardware="h100", summary={T.SUMMARY_CONFIG: {"command_line": "precprof train"}}
    )
    assert "(--sample-every 0 records none)" in " ".join(cli.reasons)
    hf = precprof.recommend(
        few, hardware="h100", summary={T.SUMMARY_CONFIG: {"source": T.SOURCE_TRANSFORMERS}}
    )
    assert "PrecprofCallback(sample_every=N)" in " ".join(hf.reasons)
    unsampled = {"memory_steps": {"sampled_steps": 0, "measured_steps": 0}}
    assert _no_memory_why({T.SUMMARY_CAPTURE: unsampled}).startswith(
        "Memory is measured on sampled steps, and no step was sampled (Profiler(sample_every=0) samples none)"
    )
    # a run of 2 steps, whose summary has no overhead at all, said nothing
    two = _run(2, compile_model=False, sample_every=0, memory=False)
    assert two.summary()["sampling"]["overhead"] is None
    head = dict(_headline({T.SUMMARY_CAPTURE: two.summary()}, two.tables()["steps"], T.empty("layers")))
    assert head["precprof's overhead"] == "not measured (no step sampled; 1 step timed: 3 needed)"


def test_a_compiled_loss_beside_an_uncompiled_model_says_the_sampled_steps_ran_it_eagerly() -> None:
    """A compiled loss function, the Profiler's model not compiled: Dynamo compiled in the first unsampled
    step (the sampled steps run it eagerly: the stance is the process's), and the row says so."""
    loss_fn = torch.compile(lambda out: out.pow(2).mean(), backend="eager")
    prof = _run(4, compile_model=False, loss_fn=loss_fn, sample_every=2, memory=False)
    capture = prof.summary()
    assert capture["compiled"] is None and capture["sampling"]["compiled_steps"] == [1]
    assert _row(prof) == (
        "not the Profiler's model, but torch.compile compiled in unsampled step 1: something else this loop "
        "runs is compiled (<lambda> (test_report_compile_row.py)). A sampled step "
        "runs every compiled function of the loop eagerly (the force_eager stance precprof sets for it is the "
        "whole process's), so on the 2 sampled steps that code ran eagerly, and what it computed there (a loss, "
        "a weight update) is eager PyTorch's; the steps not sampled ran it compiled"
    )
    # nothing compiled, or nothing sampled to run it eagerly: no row
    assert _row(_run(3, compile_model=False, sample_every=2, memory=False)) == ""
    assert _row(_run(3, compile_model=False, loss_fn=loss_fn, sample_every=0, memory=False)) == ""


def test_a_compiled_model_beside_a_compiled_optimizer_step_says_the_sampled_steps_ran_both_eagerly() -> None:
    """``torch.compile(model)`` and ``torch.compile(opt.step)`` (tester t3): the row said only that the sampled
    steps ran the model eagerly, where their weight updates were eager's too. The capture names what Dynamo
    compiled in the run outside the model's source files (``compiled_elsewhere``), and the row says both; a
    compiled loss is named by its function and file, and nothing is where only the model is compiled."""
    prof = _run(4, compile_step=True, sample_every=2, memory=False)
    capture = prof.summary()
    assert capture["compiled"] == "the whole model (backend eager)"
    assert capture["compiled_elsewhere"] == ["the optimizer's step"]
    assert _row(prof) == (
        "the whole model (backend eager): the steps not sampled ran compiled; the sampled ones ran it eagerly "
        "(for the hooks), so their statistics are eager PyTorch's values, their time is eager's. torch.compile "
        "also compiled code outside the model's source files (the optimizer's step); a sampled step runs every "
        "compiled function of the loop eagerly (the force_eager stance precprof sets for it is the whole "
        "process's), so on the 2 sampled steps that code ran eagerly too, and what it computed there (a loss, a "
        "weight update, a helper of the model's in a file of its own) is eager PyTorch's"
    )

    def squared(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    loss = _run(4, loss_fn=torch.compile(squared, backend="eager"), sample_every=2, memory=False)
    assert loss.summary()["compiled_elsewhere"] == ["squared (test_report_compile_row.py)"]
    # the model alone, or the model compiled with nothing sampled (every step ran all of it compiled): no more
    assert _run(4, sample_every=2, memory=False).summary()["compiled_elsewhere"] == []
    assert "also compiled" not in _row(_run(3, compile_step=True, sample_every=0, memory=False))


def test_a_wrapper_of_the_models_forward_in_another_file_is_the_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accelerate's mixed precision replaces the model's forward with its ``convert_outputs_to_fp32`` wrapper (a
    function in its own file whose ``__wrapped__`` is an object wrapping the forward), and its dynamo plugin then
    compiles the model: the wrapper's frame is the one Dynamo compiles. Only the innermost function of the chain
    counted as the model's: "torch.compile also compiled code outside the model's source files (forward
    (operations.py))" of a run that compiled the model alone (reviewer r3). Every function of the chain is the
    model's forward."""
    import importlib
    import types

    import torch._dynamo

    (tmp_path / "wrapping.py").write_text(
        "import functools\n\n"
        "class Outputs:\n"
        "    def __init__(self, forward):\n"
        "        self.forward = forward\n"
        "        functools.update_wrapper(self, forward)\n\n"
        "    def __call__(self, *args, **kwargs):\n"
        "        return self.forward(*args, **kwargs).float()\n\n"
        "def wrap(forward):\n"
        "    inner = Outputs(forward)\n\n"
        "    def forward(*args, **kwargs):\n"
        "        return inner(*args, **kwargs)\n\n"
        "    forward.__wrapped__ = inner\n"
        "    return forward\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    wrapping = importlib.import_module("wrapping")
    torch._dynamo.reset()
    model = _model()
    model.forward = types.MethodType(wrapping.wrap(type(model).forward), model)
    run = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with precprof.Profiler(run, optimizer=opt, sample_every=2, memory=False) as prof:
        for _ in range(4):
            loss = run(torch.randn(4, 8, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    compiled = {c.co_filename for c in (_compat.compiled_entries() or {})}
    assert str(tmp_path / "wrapping.py") in compiled  # Dynamo compiled the wrapper's frame
    assert prof.summary()["compiled_elsewhere"] == []
    assert "also compiled" not in _row(prof)


def test_modules_under_torch_compiler_disable_are_named_beside_the_compiled_model() -> None:
    """A module's forward under ``torch.compiler.disable`` inside a compiled model (tester t3): the summary
    said "the whole model", where that module never ran compiled; it names it, however it was disabled (its
    forward replaced, its class's forward decorated, the module wrapped). A model not compiled whose module is
    disabled is no "regional" compile (Dynamo marks a disabled forward as it marks a compiled one)."""

    class Disabled(nn.Linear):
        @torch.compiler.disable
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    def replaced(model: nn.Module) -> nn.Module:
        model[2].forward = torch.compiler.disable(model[2].forward)
        return model

    def decorated(model: nn.Module) -> nn.Module:
        model[2] = Disabled(16, 4)
        return model

    def wrapped(model: nn.Module) -> nn.Module:
        model[2] = torch.compiler.disable(model[2])
        return model

    said = (
        "the whole model (backend eager) but 2 (torch.compiler.disable: Dynamo does not compile it, and every "
        "step runs it eagerly)"
    )
    for disable in (replaced, decorated, wrapped):
        assert (
            precprof.Profiler(torch.compile(disable(_model()), backend="eager")).summary()["compiled"] == said
        )
        assert precprof.Profiler(disable(_model())).summary()["compiled"] is None
    # trained: the row says it as the summary does, and the model's graph breaks around it are no one else's
    model = replaced(_model())
    run = torch.compile(model, backend="eager")
    with precprof.Profiler(run, sample_every=2, memory=False) as prof:
        for x in torch.randn(4, 4, 8).unbind():
            run(x).sum().backward()
            prof.step()
    capture = prof.summary()
    assert capture["compiled"] == said and capture["compiled_elsewhere"] == []
    assert _row(prof).startswith(said + ": the steps not sampled ran compiled")
