"""The checks of ``Profiler``'s arguments, at its construction (before anything is claimed or hooked), and of the
callbacks' Profiler arguments at theirs (``precprof.integrations``): a value of the wrong type or out of range is
a one-line TypeError or ValueError naming the argument, the value and what it takes, not an error from deep in
the first sampled step (``update_sample=0`` divided by zero there), nor a value taken silently
(``sample_every=1.5`` sampled steps 0 and 3; ``scaler="dynamic"`` was ignored). ``prof.step()``'s arguments are
checked by ``step_values``: host checks of what is passed (a tensor's element count is host metadata), no sync.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from precprof import tables as T
from precprof.export.wandb import BesideTrainer


def _said(caller: str, name: str, value: Any) -> str:
    return f"{caller}({name}={value!r:.80})"


def _plain(value: Any) -> Any:
    """A numpy scalar or 0-d array, or a 0-d tensor, as the Python number it holds (read once, at construction: a
    value from a config file, ``np.int64`` or ``torch.tensor(2)``, worked as one before the checks); a whole
    float (``2.0``, ``max_steps / 100``) as an int; anything else as it is."""
    numpy = isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0
    if numpy or (isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex()):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _whole(value: Any) -> bool:
    """An integer, not a bool (``True`` is no number of steps)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(low: int, what: str, optional: str = "") -> Callable[[str, str, Any], Any]:
    """A check of a whole number >= ``low`` (None allowed where ``optional`` says what it means)."""

    def check(caller: str, name: str, given: Any) -> Any:
        if given is None and optional:
            return None
        value = _plain(given)
        if not _whole(value):
            fix = "; round it: int(...)" if _real(value) else ""
            raise TypeError(
                f"{_said(caller, name, given)}: expected a whole number >= {low} ({what})"
                + (f" or None ({optional})" if optional else "")
                + f", got {type(given).__name__}{fix}"
            )
        if value < low:
            raise ValueError(
                f"{_said(caller, name, value)}: expected a whole number >= {low} ({what})"
                + (f" or None ({optional})" if optional else "")
            )
        return int(value)

    return check


def _positive(what: str, optional: str = "", most: float | None = None) -> Callable[[str, str, Any], Any]:
    """A check of a finite number > 0, and at most ``most`` where given (None allowed where ``optional`` says what
    it means)."""
    bound = f" and <= {most:g}" if most is not None else ""

    def check(caller: str, name: str, given: Any) -> Any:
        if given is None and optional:
            return None
        value = _plain(given)
        if not _real(value):
            raise TypeError(
                f"{_said(caller, name, given)}: expected a finite number > 0{bound} ({what})"
                + (f" or None ({optional})" if optional else "")
                + f", got {type(given).__name__}"
            )
        if not (math.isfinite(value) and value > 0 and (most is None or value <= most)):
            raise ValueError(f"{_said(caller, name, given)}: expected a finite number > 0{bound} ({what})")
        return value

    return check


def _flag(optional: str = "") -> Callable[[str, str, Any], Any]:
    """A check of True or False (0 and 1 too; None where ``optional`` says what it means): a string ("no") was
    taken as True."""

    def check(caller: str, name: str, given: Any) -> Any:
        if given is None and optional:
            return None
        value = _plain(given)  # (np.True_, a 0-d bool tensor: the bool it holds)
        if isinstance(value, bool) or (_whole(value) and value in (0, 1)):
            return bool(value)
        raise TypeError(
            f"{_said(caller, name, given)}: expected True or False"
            + (f" or None ({optional})" if optional else "")
            + f", got {type(given).__name__}"
        )

    return check


def modules_filter(caller: str, name: str, value: Any) -> Any:
    """``modules=``: None, or patterns (``fnmatch``) and module types, as a list; one pattern or one type given
    alone is that one (a string was iterated as its characters: "1*" selected every module through "*")."""
    if value is None:
        return None
    if isinstance(value, (str, type)):
        value = [value]
    elif not isinstance(value, Iterable) or isinstance(value, (bytes, Mapping)):
        raise TypeError(
            f"{_said(caller, name, value)}: expected None, a name pattern such as 'transformer.h.*.mlp', a module "
            "type such as torch.nn.Linear, or a list of them"
        )
    items = list(value)
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(
                f"{_said(caller, name, value)}: {item!r:.60} is neither a name pattern (a str such as "
                "'transformer.h.*.mlp') nor a module type (a torch.nn.Module subclass such as torch.nn.Linear)"
            )
    if not items:
        raise ValueError(
            f"{_said(caller, name, value)}: selects no module; leave it out (None) to profile every layer"
        )
    return items


def _reducer(caller: str, name: str, value: Any) -> Any:
    if isinstance(value, str) and value == "auto":
        return value
    if value is None or (not isinstance(value, str) and callable(getattr(value, "reduce_rows", None))):
        return value
    raise TypeError(
        f"{_said(caller, name, value)}: expected 'auto' (ranks combined under torch.distributed), None (this "
        "process only) or a precprof.capture.reducer.RankReducer"
    )


def _scaler(caller: str, name: str, value: Any) -> Any:
    # (a GradScaler's state_dict, a dict, has an update() too: a scaler scales and unscales)
    if value is None or all(callable(getattr(value, m, None)) for m in ("update", "scale", "unscale_")):
        return value
    raise TypeError(
        f"{_said(caller, name, value)}: expected a torch.amp.GradScaler (or None), got {type(value).__name__}; "
        "for a fixed scale of your own ((loss * s).backward()) pass loss_scale=s"
    )


flag = _flag()  # True or False (0 and 1 too, numpy's and a 0-d tensor's): a callback's own ``report``


def _tensorboard(caller: str, name: str, value: Any) -> Any:
    # (what the dashboard makes of it, a directory checked and a writer made, waits for the Profiler: a callback
    # made creates nothing on disk; the type is checked here, where a callback's argument is given)
    if value is None or isinstance(value, (str, os.PathLike)) or hasattr(value, "add_scalar"):
        return value
    raise TypeError(
        f"{_said(caller, name, value)}: expected a log directory or a torch.utils.tensorboard.SummaryWriter, "
        f"got {type(value).__name__}"
    )


def _wandb(caller: str, name: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, BesideTrainer)) or hasattr(value, "log"):
        return value
    raise TypeError(
        f"{_said(caller, name, value)}: expected True (the current wandb.run), a wandb run object or "
        f"precprof.export.wandb.BesideTrainer(run), got {type(value).__name__}"
    )


def run_dir(caller: str, name: str, value: Any) -> Any:
    """A run directory argument (``out``): None, a path (str or os.PathLike), or a claimed ``RunDir`` (what
    ``rundir.claim`` returns: it has a ``path``); ``out=123`` was a TypeError from pathlib, naming no argument."""
    if (
        value is None
        or isinstance(value, (str, os.PathLike))
        or isinstance(getattr(value, "path", None), Path)
    ):
        return value
    raise TypeError(
        f"{_said(caller, name, value)}: expected a run directory's path (a str or a Path), got {type(value).__name__}"
    )


# every Profiler argument checked here, by name: what the check returns is the value the Profiler keeps
CHECKS: dict[str, Callable[[str, str, Any], Any]] = {
    "scaler": _scaler,
    "sample_every": _integer(
        0, "sample every N-th step; 0 records steps only", "as many as overhead_budget allows"
    ),
    "overhead_budget": _positive("the share of the run's time precprof may add: 0.03 for 3%", most=1.0),
    "modules": modules_filter,
    "memory": _flag(),
    "memory_every": _integer(
        1, "1: every sampled step", "every 4th, spacing out to every 32nd while they agree"
    ),
    "memory_peak": _flag("on CUDA, off on the CPU"),
    "reset_peak_memory": _flag(),
    "weight_updates": _flag(),
    "update_sample": _integer(1, "elements sampled per parameter, 256"),
    "chunk": _integer(0, "values per pass of the statistics, 0: a tensor at once", "the default"),
    "first_step": _integer(0, "the number of the first step, a checkpoint's step when resuming"),
    "reducer": _reducer,
    "loss_scale": _positive("a manual static loss scale", "none"),
    "block_formats": _flag("on unless PRECPROF_BLOCK_FORMATS=0"),
    "block_groups": _integer(1, "1: every layer on every sampled step", "as many as block_budget allows"),
    "block_budget": _positive("the share of a sampled step the block what-if may add, 0.1"),
    "resume": _flag("as left out; the callbacks then continue a run when training resumes from a checkpoint"),
    "overwrite": _flag(),
    "compile_beside": _flag(),
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "out": run_dir,
}


def checked(args: Mapping[str, Any], caller: str = "Profiler") -> dict[str, Any]:
    """``args`` (Profiler arguments by name) with every one ``CHECKS`` knows checked, as the Profiler keeps them;
    the first wrong one is a one-line TypeError or ValueError naming it, its value and what it takes."""
    out = dict(args)
    for name, value in args.items():
        check = CHECKS.get(name)
        if check is not None:
            out[name] = check(caller, name, value)
    if out.get("loss_scale") is not None and out.get("scaler") is not None:
        raise ValueError(
            f"{caller}(loss_scale=...) declares a manual static loss scale; with a GradScaler (scaler=) leave it out"
        )
    return out


def step_values(loss: Any, grad_norm: Any, tokens: Any) -> None:
    """``prof.step()``'s arguments, checked on the host (a tensor's element count is metadata: no sync): a loss
    or gradient norm of more than one element was recorded as its first, negative tokens as a negative
    throughput, a string loss failed at the next flush. The hot path: a plain type test for the usual ones."""
    if loss is not None and type(loss) is not float:
        _one_number("loss", loss)
    if grad_norm is not None and type(grad_norm) is not float:
        _one_number("grad_norm", grad_norm)
    if tokens is None or (type(tokens) is int and tokens >= 0):
        return
    if isinstance(tokens, torch.Tensor) and tokens.numel() == 1:
        if tokens.device.type != "cpu" or tokens.item() >= 0:  # (a device tensor's value: a sync, unread)
            return
        raise ValueError(f"prof.step(tokens={tokens!r}): expected the number of tokens the step ran, >= 0")
    tokens = _plain(tokens)  # (a numpy scalar or 0-d array: mask.sum().numpy())
    if not _real(tokens):
        raise TypeError(
            f"prof.step(tokens={tokens!r:.60}): expected the number of tokens the step ran (an int >= 0), "
            f"got {type(tokens).__name__}"
        )
    if not (tokens >= 0 and math.isfinite(tokens)):
        raise ValueError(f"prof.step(tokens={tokens!r}): expected the number of tokens the step ran, >= 0")


def _one_number(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"prof.step({name}=tensor of shape {list(value.shape)}): expected one number; pass the step's "
                f"scalar {name} (a mean: {name}.mean())"
            )
    elif isinstance(value, np.ndarray):  # a loss computed with numpy: a 0-d array is a number
        if value.ndim != 0 or not _real(value.item()):
            raise ValueError(
                f"prof.step({name}=array of shape {list(value.shape)}, {value.dtype}): expected one number; pass "
                f"the step's scalar {name} (float({name}.mean()))"
            )
    elif not _real(value):
        raise TypeError(
            f"prof.step({name}={value!r:.60}): expected a number or a one-element tensor, got {type(value).__name__}"
        )


STATUSES = (T.STATUS_COMPLETE, T.STATUS_INCOMPLETE)


def save_status(status: Any, reason: Any) -> None:
    """``prof.save(status=, reason=)``: None (the run's own), or one of ``STATUSES``; a reason is a str."""
    if status is not None and status not in STATUSES:
        raise ValueError(
            f"save(status={status!r:.60}): expected {T.STATUS_COMPLETE!r} or {T.STATUS_INCOMPLETE!r} (with "
            "reason='why'), or None: the run's own"
        )
    if reason is not None and not isinstance(reason, str):
        raise TypeError(
            f"save(reason={reason!r:.60}): expected a str saying why the run is incomplete, or None"
        )
