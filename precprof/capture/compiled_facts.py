"""What of a run ``torch.compile`` compiled, in the capture summary's words (``ProfilerResults.summary``): the
parts of the Profiler's model that run compiled (``compiled``) and with which backend, and its modules that
``torch.compiler.disable`` keeps eager inside them. A sampled step runs all of it eagerly (the ``force_eager``
stance is the whole process's), which the report's torch.compile row says (``report/compiled_row.py``)."""

from __future__ import annotations

from torch import nn

from precprof import _compat

_LISTED = 4  # names listed before "and N more"


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
