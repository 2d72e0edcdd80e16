"""The environment's "torch.compile" row: what of the run ran compiled, and on which steps, in words.

A sampled step runs ``torch.compile``d code eagerly (precprof sets ``torch.compiler``'s ``force_eager`` stance
for it, and a stance is the whole process's), so the row says which steps ran compiled by what the run
recorded: none sampled (every step compiled), every one sampled (none compiled), or some of each; it names
the memory section's activations only where that section shows some, and the setting that samples fewer
steps as the run set it (``precprof train``'s flag, the Profiler's or the callback's argument). What else of the
loop Dynamo compiled (``capture.compiled_elsewhere``: the optimizer's step, a loss) the sampled steps ran eagerly
too: the row names it, beside the model or in its place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from precprof import tables as T
from precprof.report import filters as F


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _map(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def memory_shows_activations(capture: Mapping[str, Any]) -> bool:
    """Whether the memory section shows measured activations, by the capture's facts: not where
    ``Profiler(memory=False)`` turned memory off, the breakdown failed, or no sampled step measured it."""
    if capture.get("memory_enabled") is False or capture.get("memory_error"):
        return False
    steps = capture.get("memory_steps")
    return not isinstance(steps, Mapping) or bool(steps.get("measured_steps"))


def _unsampled_said(steps: list[int], most: int = 4) -> str:
    """The steps in words: "unsampled step 2", "unsampled steps 2, 5", "12 unsampled steps (2, 5, 9, ...)"."""
    if len(steps) == 1:
        return f"unsampled step {F.count(steps[0])}"
    listed = ", ".join(F.count(s) for s in steps[:most])
    if len(steps) <= most:
        return f"unsampled steps {listed}"
    return f"{F.count(len(steps))} unsampled steps ({listed}, ...)"


def compiled_row(capture: Mapping[str, Any], cfg: Mapping[str, Any]) -> str:
    """The "torch.compile" row's text ("" where the run recorded nothing compiled). ``capture``: the summary's
    capture; ``cfg``: its config (the built-in loop's says whether it compiled the model, ``compile``)."""
    what = capture.get("compiled") or ("the whole model" if cfg.get("compile") else None)
    sampled, recorded = _int(capture.get("sampled_steps")), _int(capture.get("steps_recorded"))
    if not what:
        return _other_compiled(capture, sampled)
    what = str(what)
    if sampled == 0:
        return (
            f"{what}: every step ran compiled (no step was sampled, and only a sampled step runs it eagerly, for "
            "the hooks)"
        )
    memory = memory_shows_activations(capture)
    if sampled is not None and recorded and sampled >= recorded:
        eager = (
            "losses, statistics, step times and the activations the memory section shows"
            if memory
            else "losses, statistics and step times"
        )
        return (
            f"{what}: every step was sampled, and a sampled step runs it eagerly (for the hooks): no step of this "
            f"run ran compiled, so its {eager} are eager PyTorch's (sample fewer steps to see compiled ones: {T.sample_every_setting(cfg)} with N "
            "above 1)" + _random_note(capture, what)
        )
    text = (
        f"{what}: the steps not sampled ran compiled; the sampled ones ran it eagerly (for the hooks), so their "
        "statistics are eager PyTorch's values, their time is eager's"
    )
    if memory:
        text += (
            ", and so are the activations the memory section shows (the compiled graph saves others for its "
            "backward: inductor's partitioner recomputes some and keeps others)"
        )
    elsewhere = _elsewhere(capture)  # (a run whose every step was sampled compiled nothing: none)
    if elsewhere and sampled:
        n = f"{F.count(sampled)} sampled step{'s' if sampled != 1 else ''}"
        text += (
            f". torch.compile also compiled {elsewhere}; a sampled step runs every compiled function of the loop "
            "eagerly (the force_eager stance precprof sets for it is the whole process's), so on the "
            f"{n} that code ran eagerly too, and what it computed there (a loss, a weight update, a helper of "
            "the model's in a file of its own) is eager PyTorch's"
        )
    return text + _random_note(capture, what)


def _elsewhere(capture: Mapping[str, Any]) -> str:
    """What Dynamo compiled during the run outside the model's source files (``capture.compiled_elsewhere``), in
    words: "code outside the model's source files (the optimizer's step, loss_fn (train.py))"; "" without any."""
    names = [str(n) for n in capture.get("compiled_elsewhere") or [] if n]
    return f"code outside the model's source files ({', '.join(names)})" if names else ""


def _random_note(capture: Mapping[str, Any], what: str) -> str:
    """The dropout layers' masks, which inductor's kernels draw otherwise than eager PyTorch ("" without any, or
    under a backend that runs torch's own ops: eager and aot_eager draw the masks an eager step draws)."""
    dropout = _int(capture.get("dropout_layers")) or 0
    if not dropout or ("backend " in what and "backend inductor" not in what):
        return ""
    return (
        f"; the model has {F.count(dropout)} dropout layer{'s' if dropout != 1 else ''}: inductor's kernels draw "
        "their own random numbers, so an eager step draws other masks and leaves the random-number state "
        "elsewhere, and from the first sampled step on this run trained on other masks than it would have "
        "without precprof (not bitwise it)"
    )


def _other_compiled(capture: Mapping[str, Any], sampled: int | None) -> str:
    """Where the Profiler's model is not compiled but Dynamo compiled in steps not sampled (the sampler's
    ``compiled_steps``, the steps table's ``compiled`` column): something else of the loop is, and the sampled
    steps ran it eagerly too, since the stance they run under is the process's ("" otherwise)."""
    sampling = _map(capture.get("sampling"))
    steps = [s for s in (_int(v) for v in sampling.get("compiled_steps") or []) if s is not None]
    if not steps or not sampled:
        return ""
    n = f"{F.count(sampled)} sampled step{'s' if sampled != 1 else ''}"
    # what Dynamo compiled outside the model's source files, where the capture could tell
    names = ", ".join(str(x) for x in capture.get("compiled_elsewhere") or [] if x)
    names = names or "a loss, the optimizer's step, a model the Profiler was not given"
    return (
        f"not the Profiler's model, but torch.compile compiled in {_unsampled_said(steps)}: something else "
        f"this loop runs is compiled ({names}). A sampled "
        "step runs every compiled function of the loop eagerly (the force_eager stance precprof sets for it is "
        f"the whole process's), so on the {n} that code ran eagerly, and what it computed there (a loss, a "
        "weight update) is eager PyTorch's; the steps not sampled ran it compiled"
    )
