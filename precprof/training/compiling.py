"""Whether the built-in loop compiles the model: each mode runs as its users run it for speed.

``--compile`` / ``--no-compile`` decide; without either, only the modes that are fast only compiled compile:
fp8, whose torchao float8 training casts each linear layer's operands in kernels that only ``torch.compile``
fuses (torchao's README: "enable torch.compile for competitive performance"; measured on an H200 with gpt2-small
at 8 x 1024 tokens: an unsampled fp8 step took 112.7 ms eager against bf16's 41.6 ms, and 32.6 ms compiled).
The other modes stay eager by default: their kernels are the same eager or compiled, the first compiled step
costs seconds to minutes, and the comparison of precisions (``precprof compare``) says how each ran.

The model is compiled whole (``torch.compile(model)``, inductor), after the Profiler's module and the
optimizer are set up on the module itself: the Profiler watches the plain module's names, the loop calls the
compiled one.

A sampled step runs the compiled model eagerly (the Profiler's ``force_eager`` stance, torch 2.6 and later), so
only the steps not sampled run it compiled: a run whose every step is sampled (``--sample-every 1``) runs none
compiled (a compiled run's default interval is 2 at least: ``config.default_sample_every``). summary.json says how many did (``steps_run_compiled``, ``ran``) and the
terminal says it when none did (``ran_note``).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from precprof.errors import UserError
from precprof.modes import Precision

if TYPE_CHECKING:  # torch only where a model is compiled: precprof compare's checks and --help need none
    import torch
    from torch import nn

# the modes that compile when neither --compile nor --no-compile is given
COMPILED_BY_DEFAULT: frozenset[str] = frozenset({Precision.FP8.value})


def should_compile(requested: bool | None, precision: str) -> bool:
    """``requested`` (True, False) as given, or, when None (neither option), whether ``precision`` is one of
    the modes that are fast only compiled (``COMPILED_BY_DEFAULT``)."""
    return bool(requested) if requested is not None else precision in COMPILED_BY_DEFAULT


def check_can_compile(device: torch.device) -> None:
    """UserError, before anything is built, when ``torch.compile`` cannot run here: Python 3.13+ before torch
    2.6, or, on the CPU, no C++ compiler for inductor's C++ backend."""
    import torch

    if sys.version_info >= (3, 13) and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6):
        raise UserError(
            f"--compile needs torch 2.6+ on Python {sys.version_info.major}.{sys.version_info.minor} "
            f"(this is torch {torch.__version__}); pass --no-compile"
        )
    if device.type == "cpu":
        cxx = os.environ.get("CXX")
        if not (cxx and shutil.which(cxx)) and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            raise UserError(
                "--compile on the CPU needs a C++ compiler for inductor's C++ backend (g++, clang++ or $CXX), "
                "and none was found; install one or pass --no-compile"
            )


def compile_model(model: nn.Module) -> nn.Module:
    """``torch.compile(model)`` with inductor, the default backend (a compiled wrapper; parameters, buffers and
    submodules stay the module's own).

    Dynamo's caches are reset first: the built-in loop owns the process, and ``precprof compare`` trains one
    model after another in it, whose frames (the same model class, other modules: fp8's Float8Linear) would
    otherwise count as recompiles of the earlier ones' and, past ``recompile_limit``, run eager."""
    import torch

    torch.compiler.reset()
    return torch.compile(model)  # type: ignore[return-value]


def describe(
    requested: bool | None, compiled: bool, precision: str, ran: int | None = None, steps: int | None = None
) -> str:
    """How the run was compiled, in the words summary.json and the comparison use: "compiled (torch.compile),
    the default for fp8", "eager, --no-compile", ...; once it ran (``ran`` of its ``steps`` finished steps ran
    the compiled model), how many steps ran compiled where not all did, and why: "compiled (torch.compile),
    --compile: 8 of 10 steps ran compiled, the 2 sampled ones eagerly (for the hooks)", or "ran no step
    compiled: torch.compile wrapped the model (--compile), but all 4 steps were sampled, ..."."""
    why = (
        "--compile"
        if requested is True
        else "--no-compile"
        if requested is False
        else f"the default for {precision}"
    )
    if not compiled:
        return f"eager, {why}"
    if ran is None or not steps or ran >= steps:
        return f"compiled (torch.compile), {why}"
    eager = steps - ran
    if ran == 0:
        every = f"all {steps} steps were" if steps > 1 else "its one step was"
        return (
            f"ran no step compiled: torch.compile wrapped the model ({why}), but {every} sampled, and a sampled "
            "step runs it eagerly (for the hooks)"
        )
    return (
        f"compiled (torch.compile), {why}: {ran} of {steps} steps ran compiled, the {eager} sampled "
        f"{'ones' if eager > 1 else 'one'} eagerly (for the hooks)"
    )


def summary(requested: bool | None, compiled: bool, precision: str) -> dict[str, object]:
    """summary.json's config entries before the run: ``compile`` (whether the loop compiled the model, wrapped
    in ``torch.compile``; not whether a step ran it compiled), ``compile_requested`` (True, False, or None for
    the mode's default), ``steps_run_compiled`` (None until the run ran: ``ran``) and ``compiled``
    (``describe``)."""
    return {
        "compile": compiled,
        "compile_requested": requested,
        "steps_run_compiled": None,
        "compiled": describe(requested, compiled, precision),
    }


def ran(
    requested: bool | None,
    compiled: bool,
    precision: str,
    steps: int,
    sampled: int,
    eager_when_sampled: bool = True,
) -> dict[str, object]:
    """summary.json's config entries once the run ran ``steps`` finished steps, ``sampled`` of them sampled:
    ``steps_run_compiled``, how many steps ran the compiled model (0 for an eager run): those not sampled, a
    sampled step runs it eagerly (``eager_when_sampled``: not on a torch without compiler stances, before 2.6,
    where it runs compiled, the hooks traced), and ``compiled`` (``describe``) with it."""
    n = (steps - sampled if eager_when_sampled else steps) if compiled else 0
    return {"steps_run_compiled": n, "compiled": describe(requested, compiled, precision, n, steps)}


def ran_note(config: Mapping[str, Any], sample_every: int | None) -> str:
    """A line for the terminal when the loop compiled the model but no step ran it compiled (``config``: the
    summary's, after ``ran``), what to pass to run some compiled; "" otherwise."""
    if not config.get("compile") or config.get("steps_run_compiled") != 0:
        return ""
    text = f"this run {config.get('compiled')}"
    if sample_every == 1:
        text += "; --sample-every N with N above 1 runs the steps not sampled compiled"
    return text


def note(precision: str, compiled: bool) -> str:
    """A line for the terminal when a mode that is fast only compiled runs eager ("" otherwise)."""
    if precision in COMPILED_BY_DEFAULT and not compiled:
        return (
            f"--no-compile with {precision}: torchao's float8 training is fast only compiled (measured on an "
            "H200, gpt2-small: an eager fp8 step took 2.7x a bf16 one); this run's speed says little about FP8's"
        )
    return ""
