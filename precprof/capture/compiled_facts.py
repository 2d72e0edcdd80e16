"""What of a run ``torch.compile`` compiled, in the capture summary's words (``ProfilerResults.summary``): the
parts of the Profiler's model that run compiled (``compiled``) and with which backend, its modules that
``torch.compiler.disable`` keeps eager inside them, and what else of the loop Dynamo compiled during the run,
outside the model's source files (``compiled_elsewhere``: a compiled optimizer step, a compiled loss). A sampled
step runs all of it eagerly (the ``force_eager`` stance is the whole process's), which the report's
torch.compile row says (``report/compiled_row.py``)."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Mapping

import torch
from torch import nn

from precprof import _compat

_LISTED = 4  # names listed before "and N more"
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OPTIM = os.path.join(_TORCH, "optim") + os.sep
_RESUME = "torch_dynamo_resume_in_"  # the frames Dynamo makes to resume a function after a graph break


def compiled_parts(model: nn.Module) -> str | None:
    """What of ``model`` runs under ``torch.compile``, in words: the whole model (a ``torch.compile(model)``
    or ``model.compile()``), or how many of its modules (regional compilation, as torchtitan compiles each
    block), and the modules inside those that ``torch.compiler.disable`` keeps eager ("but head
    (torch.compiler.disable: ...)"); None when nothing is. Sampled steps run those eagerly (``force_eager``)."""
    if _compat.is_compiled(model):
        return "the whole model" + _backend_said([model]) + _disabled_said(model, [model])
    parts = [m for m in model.modules() if m is not model and _compat.is_compiled(m)]
    if not parts:
        return None
    return f"{len(parts)} of its modules (regional{_backend_said(parts, ', ')})" + _disabled_said(
        model, parts
    )


def _backend_said(modules: list[nn.Module], lead: str = " (") -> str:
    """ ", backend eager" (in parentheses by default) when every one of ``modules`` says the same backend (the
    report tells inductor, whose kernels draw their own random numbers, from backends that run torch's ops)."""
    names = {_compat.compile_backend(m) for m in modules}
    if len(names) != 1 or None in names:
        return ""
    return f"{lead}backend {names.pop()}" + (")" if lead == " (" else "")


def _disabled_said(model: nn.Module, compiled: list[nn.Module]) -> str:
    """ " but head (torch.compiler.disable: ...)": the outermost modules inside the ``compiled`` ones whose forward
    ``torch.compiler.disable`` wraps, by the model's names ("" without any). Dynamo never compiles them: they
    run eagerly on every step, a graph break on each side."""
    inside = {id(m) for c in compiled for m in c.modules()}
    off = {id(m) for m in model.modules() if id(m) in inside and _compat.compile_disabled(m)}
    # ``torch.compiler.disable(module)`` is a wrapper, left out of the model's names: its module takes the name
    off |= {id(getattr(m, "_orig_mod", m)) for m in model.modules() if id(m) in off}
    names = [name for name, m in _compat.named_modules(model) if name and id(m) in off]
    names = [n for n in names if not any(n.startswith(f"{o}.") for o in names)]
    if not names:
        return ""
    listed = ", ".join(names[:_LISTED]) + (
        f" and {len(names) - _LISTED} more modules" if len(names) > _LISTED else ""
    )
    return (
        f" but {listed} (torch.compiler.disable: Dynamo does not compile "
        f"{'it' if len(names) == 1 else 'them'}, and every step runs {'it' if len(names) == 1 else 'them'} "
        "eagerly)"
    )


def compiled_elsewhere(model: nn.Module, before: Mapping[types.CodeType, int] | None) -> list[str]:
    """What Dynamo compiled since ``before`` (``_compat.compiled_entries`` at the run's first step: a code object
    counts where it holds more compiled entries now) outside the source files of the model's classes and of the
    packages they come from, in words: "the optimizer's step" (anything of ``torch.optim``), a function's name
    and file ("loss_fn (train.py)"), a frame resumed after a graph break by its function's name; at most
    ``_LISTED`` and "N more". Code of ``torch`` itself outside ``torch.optim`` counts as the model's (its
    layers). [] where Dynamo's record cannot be read. Read at the summary, never in a step."""
    now = _compat.compiled_entries()
    if now is None or before is None:
        return []
    own = _model_sources(model)
    said: dict[str, None] = {}
    for code, n in now.items():
        path = os.path.abspath(code.co_filename)
        models = (path in own[0] or path.startswith(own[1])) and not path.startswith(_OPTIM)
        if n <= before.get(code, 0) or models:
            continue
        said[_code_said(code, path)] = None
    names = list(said)
    return names[:_LISTED] + ([f"{len(names) - _LISTED} more"] if len(names) > _LISTED else [])


def _model_sources(model: nn.Module) -> tuple[set[str], tuple[str, ...]]:
    """The files of the classes of ``model``'s modules (every class of each one's MRO) and of the functions that
    replaced their forwards, and the folders of the packages those classes come from (transformers' for a
    Hugging Face model: its helpers compile after a graph break inside the model); torch's folder always."""
    files: set[str] = set()
    folders = {_TORCH}
    for m in model.modules():
        files |= _wrapper_files(getattr(m, "__dict__", {}).get("forward"))
        for cls in type(m).__mro__:
            module = sys.modules.get(cls.__module__)
            path = getattr(module, "__file__", None)
            if path:
                files.add(os.path.abspath(path))
            top = getattr(sys.modules.get(cls.__module__.partition(".")[0]), "__file__", None)
            if "." in cls.__module__ and top:  # a package's module: the package's folder
                folders.add(os.path.dirname(os.path.abspath(str(top))) + os.sep)
    return files, tuple(folders)


def _wrapper_files(fn: object) -> set[str]:
    """The files of a forward that replaced a module's and of every function it wraps (``__wrapped__``, as
    ``functools.wraps`` and Accelerate's mixed-precision wrapper leave it; a callable object by its ``__call__``):
    all of them run as the model's forward. Only the innermost was counted: Accelerate's wrapper, compiled by its
    dynamo plugin, was named as code outside the model (reviewer r3)."""
    files: set[str] = set()
    for _ in range(32):  # (a cycle of __wrapped__)
        if fn is None:
            break
        fn = getattr(fn, "__func__", fn)  # a bound method's function
        code = getattr(fn, "__code__", None)
        if code is None and callable(fn):
            code = getattr(type(fn).__call__, "__code__", None)
        if isinstance(code, types.CodeType):
            files.add(os.path.abspath(code.co_filename))
        fn = getattr(fn, "__wrapped__", None)
    return files


def _code_said(code: types.CodeType, path: str) -> str:
    """A compiled code object in words: "the optimizer's step" for ``torch.optim``'s, else its function's
    qualified name and file ("Trainer.loss (train.py)", a nested one by its own name), a resumed frame by the function it resumes."""
    if path.startswith(_OPTIM):
        return (
            "the learning-rate scheduler's step"
            if os.path.basename(path) == "lr_scheduler.py"
            else "the optimizer's step"
        )
    name = code.co_name
    if name.startswith(_RESUME):
        name = name[len(_RESUME) :].rpartition("_at_")[0] or name
    else:  # a nested function by its own name, not its enclosing one's ("loss_fn", not "main.<locals>.loss_fn")
        name = str(getattr(code, "co_qualname", name)).rpartition("<locals>.")[2]
    return f"{name} ({os.path.basename(path)})"
