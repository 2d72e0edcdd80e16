"""A copy of the model made while the Profiler is attached (``copy.deepcopy``: an EMA or SWA copy, a "best model
so far"; ``torch.save(model)``) works at any point of a step, and takes nothing of precprof's along: it is not
profiled, training is the same with or without it, and it keeps no Profiler alive."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import types
import weakref
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import precprof

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 + i))


def _hooks(model: nn.Module) -> list[Any]:
    """Every hook in the model's modules' and parameters' hook dictionaries."""
    found = [h for m in model.modules() for attr in _HOOK_DICTS for h in getattr(m, attr).values()]
    for p in model.parameters():
        found.extend((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())
    return found


def _precprof_objects(root: Any) -> list[Any]:
    """Objects of precprof's (its classes' instances, its functions) reachable from ``root`` by references,
    not through modules, classes or a function's globals."""
    seen: set[int] = set()
    todo, found = [root], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType)):
            continue
        seen.add(id(obj))
        function = isinstance(obj, (types.FunctionType, types.BuiltinFunctionType))
        owner = getattr(obj, "__module__", None) if function else type(obj).__module__
        if isinstance(owner, str) and owner.split(".")[0] == "precprof":
            found.append(obj)
        elif not function:
            todo.extend(gc.get_referents(obj))
    return found


def _check_copy(copied: nn.Module) -> None:
    """The copy holds no hook (it held a no-op in place of each of precprof's: 9 on a 3-layer MLP, kept forever,
    which ``torch.jit.script`` of the copy failed on), no hook's flag, nothing of precprof's, and trains."""
    assert _hooks(copied) == []
    assert not any(getattr(m, flags) for m in copied.modules() for flags in _HOOK_FLAGS)
    assert not any(vars(getattr(m, d)) for m in copied.modules() for d in _HOOK_DICTS + _HOOK_FLAGS)
    assert _precprof_objects(copied) == []
    copied(_batch(99)).square().mean().backward()
    assert all(p.grad is not None for p in copied.parameters())


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, nn.Module)
    return loaded


def _train(copy_at: str | None, steps: int = 4, **kwargs: Any) -> tuple[nn.Module, pd.DataFrame, list[Any]]:
    """Train ``_model()`` for ``steps`` steps under a Profiler, with copies of the model made at ``copy_at``
    (None: never; "between": after each ``prof.step()``; "forward": from a forward hook of the user's own on the
    first layer, during the step), each copy then run forward and backward. Returns the model, precprof's layer
    rows and the copies."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    copies: list[Any] = []

    def make_copies() -> None:
        copies.append(copy.deepcopy(model))
        copies.append(_saved_and_loaded(model))
        for c in copies[-2:]:
            c(_batch(98)).sum().backward()  # runs inside the sampled step when made in the forward hook

    def in_forward(module: nn.Module, args: Any, output: Any) -> None:
        handle.remove()  # a one-off: the user's own hook is not copied along
        make_copies()

    prof = precprof.Profiler(model, optimizer=opt, **kwargs)
    with prof:
        for i in range(steps):
            if copy_at == "forward":
                handle = model[0].register_forward_hook(in_forward)
            model(_batch(i)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
            if copy_at == "between":
                make_copies()
    return model, prof.tables()["layers"], copies


def _same_training(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_copies_between_sampled_steps() -> None:
    """Every step sampled, memory measured on one in two (its input watch stays on the model between steps):
    copies made between two sampled steps, when precprof's hooks are in place, doing nothing."""
    plain, rows, _ = _train(None, sample_every=1, memory_every=2)
    model, copied_rows, copies = _train("between", sample_every=1, memory_every=2)
    assert len(copies) == 8
    for c in copies:
        _check_copy(c)
    _same_training(plain, model)
    pd.testing.assert_frame_equal(copied_rows, rows)  # the copies' forwards and backwards recorded nothing


def test_copies_during_a_sampled_step() -> None:
    """Copies made from the user's forward hook, in the middle of a sampled step's forward, and run forward and
    backward before the step ends."""
    plain, rows, _ = _train(None, sample_every=1)
    model, copied_rows, copies = _train("forward", sample_every=1)
    for c in copies:
        _check_copy(c)
    _same_training(plain, model)
    pd.testing.assert_frame_equal(copied_rows, rows)


def test_copies_on_unsampled_steps() -> None:
    plain, rows, _ = _train(None, steps=5, sample_every=2)
    model, copied_rows, copies = _train("forward", steps=5, sample_every=2)
    for c in copies:
        _check_copy(c)
    _same_training(plain, model)
    pd.testing.assert_frame_equal(copied_rows, rows)


def test_averaged_model_made_mid_run() -> None:
    """``AveragedModel`` (SWA; an EMA the same way) deep-copies the model: made between two sampled steps, it
    averages the weights it is given, by hand: the mean of each step's weights."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshots: list[list[torch.Tensor]] = []
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1)
    with prof:
        for i in range(4):
            model(_batch(i)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
            if i == 0:
                swa = AveragedModel(model)
            swa.update_parameters(model)
            snapshots.append([p.detach().clone() for p in model.parameters()])
            swa(_batch(50 + i))  # the averaged model evaluated beside the training
    for averaged, steps in zip(swa.module.parameters(), zip(*snapshots, strict=True), strict=True):
        torch.testing.assert_close(averaged, torch.stack(steps).mean(0), rtol=0, atol=1e-7)
    _check_copy(swa.module)


class _CopiesItsDict(nn.Sequential):
    """A model class with its own ``__deepcopy__``, which copies the instance's ``__dict__`` as it is (an
    instance attribute of precprof's on the module went along, and the copy then pickled as the original)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _CopiesItsDict:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            object.__setattr__(new, k, copy.deepcopy(v, memo))
        return new


class _PicklesItsDict(nn.Sequential):
    """A model class with its own ``__getstate__``: its ``__dict__`` as it is."""

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__


def _copies_at(when: str, cls: type[nn.Sequential]) -> tuple[nn.Module, list[nn.Module]]:
    """A model of class ``cls`` trained 4 steps, sampled on every other one, with copies of it made ``when``:
    "between" two sampled steps (precprof's hooks in place, doing nothing), "sampled" inside a sampled step
    (after its backward), "unsampled" inside a step that is not (no hook of precprof's at all). Each time a
    deep copy, a ``torch.save``/``torch.load`` and an ``AveragedModel``."""
    torch.manual_seed(0)
    model = cls(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    copies: list[nn.Module] = []
    sampled = {"between": (0, 1, 2, 3), "sampled": (0, 2), "unsampled": (0, 2)}[when]
    with precprof.Profiler(model, sample_every=1 if when == "between" else 2, memory_every=2) as prof:
        for i in range(4):
            assert prof.sampling == (i in sampled)
            model(_batch(i)).square().mean().backward()
            if when != "between" and prof.sampling == (when == "sampled"):
                copies += [copy.deepcopy(model), _saved_and_loaded(model), AveragedModel(model).module]
            prof.step()
            if when == "between" and i == 1:
                assert _hooks(model)  # precprof's, kept between the two sampled steps
                copies += [copy.deepcopy(model), _saved_and_loaded(model), AveragedModel(model).module]
    return model, copies


@pytest.mark.parametrize("cls", [nn.Sequential, _CopiesItsDict, _PicklesItsDict])
@pytest.mark.parametrize("when", ["between", "sampled", "unsampled"])
def test_a_copy_scripts_and_exports_as_the_model_does(when: str, cls: type[nn.Sequential]) -> None:
    """``torch.jit.script`` of a copy made with precprof's hooks in failed on the no-ops it kept in their place
    ("Compiled functions can't take variable number of arguments"); scripted and exported, a copy made at any
    point of a step, of any model class, computes what the model does, and holds no hook."""
    model, copies = _copies_at(when, cls)
    x = _batch(7)
    want = model(x)
    for c in copies:
        _check_copy(c)
        torch.testing.assert_close(torch.jit.script(c)(x), want, rtol=0, atol=0)
        torch.testing.assert_close(torch.export.export(c, (x,)).module()(x), want, rtol=0, atol=0)
    dicts = [getattr(m, d) for m in model.modules() for d in _HOOK_DICTS + _HOOK_FLAGS]
    assert _hooks(model) == [] and not any(map(vars, dicts))  # the model as it was, after detach


@pytest.mark.parametrize("cls", [_CopiesItsDict, _PicklesItsDict])
def test_a_copy_of_a_class_that_copies_its_dict_saves_its_own_weights(cls: type[nn.Sequential]) -> None:
    """A copy made with precprof's hooks in, by a class's own ``__deepcopy__`` (or ``__getstate__``), changed,
    then saved: it loads with its own weights, not the original's, before and after the original is gone."""
    model, copies = _copies_at("between", cls)
    copied = copies[0]
    with torch.no_grad():
        for k, p in enumerate(copied.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + k)
    want = [p.detach().clone() for p in copied.parameters()]
    originals = [p.detach().clone() for p in model.parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(want, originals, strict=True))
    for loaded in (_saved_and_loaded(copied), pickle.loads(pickle.dumps(copied))):
        _check_copy(loaded)
        for p, w in zip(loaded.parameters(), want, strict=True):
            assert torch.equal(p, w)
    del model
    gc.collect()
    for p, w in zip(_saved_and_loaded(copied).parameters(), want, strict=True):
        assert torch.equal(p, w)


def test_copy_keeps_no_profiler_alive() -> None:
    model = _model()
    prof = precprof.Profiler(model, sample_every=1)
    prof.attach()
    for i in range(2):
        model(_batch(i)).square().mean().backward()
        prof.step()
    assert _precprof_objects(model)  # the hooks kept between the two sampled steps are found
    copied = copy.deepcopy(model)
    loaded = _saved_and_loaded(model)
    assert b"precprof" not in pickle.dumps(model)  # a pickled model loads where precprof is not installed
    prof.detach()
    gone = weakref.ref(prof)
    del prof
    gc.collect()
    assert gone() is None
    assert _hooks(model) == [] and copied is not None and loaded is not None


def test_optimizer_copied_between_sampled_steps() -> None:
    """The optimizers' step hooks: torch's ``Optimizer.__getstate__`` leaves every hook out of a copy."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for i in range(2):
            model(_batch(i)).square().mean().backward()
            opt.step()
            prof.step()
        assert opt._optimizer_step_pre_hooks  # precprof's, kept between the two sampled steps
        for c in (copy.deepcopy(opt), _saved_and_loaded_optimizer(opt)):
            assert not c._optimizer_step_pre_hooks and not c._optimizer_step_post_hooks
            assert _precprof_objects(c) == []


def _saved_and_loaded_optimizer(opt: torch.optim.Optimizer) -> Any:
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_a_copy_of_the_grad_scaler_while_profiled_has_its_own_update() -> None:
    """precprof wraps ``scaler.update`` on the instance while attached: ``copy.deepcopy(scaler)`` gave a copy whose
    ``update()`` ran the original scaler's, and ``torch.save(scaler)`` failed ("Can't pickle local object"). A
    copy or a pickle has the class's own ``update`` now, and precprof's wrapper goes at detach."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, memory=False) as prof:
        for i in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(_batch(i)).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            copied = copy.deepcopy(scaler)
            buf = io.BytesIO()
            torch.save(scaler, buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=False)
            for other in (copied, loaded):
                assert "update" not in vars(other) and "__getstate__" not in vars(other)
                assert other.update.__func__ is torch.amp.GradScaler.update  # its own, bound to it
                assert other.get_scale() == scaler.get_scale()
            prof.step(loss=loss)
    assert "update" not in vars(scaler) and "__getstate__" not in vars(scaler)
