"""What each precision mode would take, from the memory table of one run (pure host computation).

``project(memory, summary)`` returns the ``summary.json`` block ``summary["memory"]``::

    {
      "measured_mode": "bf16",                # precision mode of the run (config, else the profiler's
                                              # precision_seen, else inferred from dtypes)
      "step": 9,                              # the measured step the numbers come from (the one that held the
                                              # most: representative_step)
      "n_params": 124439808,                  # unique parameter elements (under FSDP: this rank's shard)
      "measured": {component: bytes},         # per-component totals of that step (peaks: max over phases)
      "records": [                            # flat: pd.DataFrame(records) is the comparison table
        {"mode": "fp32", "component": "parameters", "bytes": 497759232, "source": "projected"},
        {"mode": "bf16", "component": "parameters", "bytes": 497759232, "source": "measured"},
        {"mode": "bf16", "component": "parameters", "bytes": 248879616, "source": "textbook"},
        ...
      ],
      "totals": [{"mode", "source", "bytes", "saving_vs_fp32"}],   # sums of records (peaks never in records)
      "textbook_claim": {"text": ..., "saving_low": 0.4, "saving_high": 0.5},
      "assumptions": ["...", ...],            # what the projection assumes, in words, for the report
      "unmeasured": {component: why},         # components assumed, not measured (optimizer_states without
                                              # an optimizer: a record of source "assumed" has their bytes)
      "model": {...},                         # MemoryTracker.model_facts(), when the run stored it
    }

``source`` is ``measured`` (the run's own mode only), ``assumed`` (the run's own mode, beside ``measured``: a
component it did not measure, never in ``totals``), ``projected`` (every mode in ``MODES``, the run's own
included, so that projected vs measured shows the model's error) or ``textbook`` (4N/2N: parameters, gradients,
optimizer states and activations; modes fp32/tf32 and the 16-bit ones). Components in records: parameters,
gradients, optimizer_states, master_weights, buffers, activations, autocast_weight_copies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from precprof import tables as T
from precprof.formats import LOW_PRECISION_DTYPES
from precprof.modes import AUTOCAST_MODES, FP32_STORAGE_MODES, FP64, PRECISIONS, PURE_MODES
from precprof.tables import LOSS_SCOPE
from precprof.taxonomy import CLASS_OTHER, LOW_UNDER_AUTOCAST, precision_trained

MODES: tuple[str, ...] = PRECISIONS
TEXTBOOK_CLAIM = (
    "Mixed precision halves parameters, gradients and activations (4N -> 2N bytes each) while optimizer "
    "states stay FP32, cutting total training memory by 40-50%."
)
TEXTBOOK_SAVING = (0.40, 0.50)
NO_OPTIMIZER = "no optimizer was given to the Profiler"
NO_OPTIMIZER_ASSUMPTION = (
    f"Optimizer states not measured ({NO_OPTIMIZER}): every mode is given Adam's, two fp32 moments per trained "
    "parameter element (8 bytes each), which no format changes; pass Profiler(model, optimizer=opt) to "
    "measure them."
)

# Floating dtypes whose storage a precision mode changes; float64 and integer/bool tensors never change, but in a
# run that trained in float64 (measured mode "fp64": ``_FP64_FLOATS``), whose float64 tensors each mode makes its own
_LOW_FLOATS = LOW_PRECISION_DTYPES
_MODE_FLOATS = _LOW_FLOATS | {"float32"}
_FP64_FLOATS = _MODE_FLOATS | {"float64"}


def _itemsize(name: str) -> int | None:
    import torch  # loaded already where tables are made; `precprof report` reads them without it

    dt = getattr(torch, name, None)
    return dt.itemsize if isinstance(dt, torch.dtype) else None


# bytes of an element of each float dtype a precision mode changes (a host-side table: the report reads it
# without torch)
FLOAT_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def outputs_from_matmul(summary: Mapping[str, Any]) -> bool:
    """Whether the capture found the matmul that made the model's output (``capture.output_head``): under
    autocast (and in a model cast to 16 bits) a matmul's output is 16-bit."""
    capture = summary.get(T.SUMMARY_CAPTURE)
    head = capture.get("output_head") if isinstance(capture, Mapping) else None
    return isinstance(head, Mapping) and bool(head.get("module") or head.get("param"))


def output_bytes(by_dtype: Mapping[str, float], target: str, current: str, head_matmul: bool) -> float:
    """Bytes of the model's outputs (the logits the loop holds until backward ends), measured per dtype in a run
    of mode ``current``, in mode ``target``: fp32 and tf32 hold every float output in fp32; a pure mode and
    autocast keep a 16-bit output 16-bit; an fp32 output stays fp32 where the run was in that family already
    (the model's own code made it fp32: ``logits.float()``), and becomes 16-bit in it from an fp32 run when the
    output came from a matmul (``head_matmul``: ``outputs_from_matmul``), else stays fp32. Other dtypes as
    measured, but for float64 outputs of a run that trained in float64 (``current`` "fp64"), which fp32 holds in 4
    bytes and the 16-bit modes as the fp32 ones (fp64 itself: as measured)."""
    if current == FP64 and target == FP64:
        return float(sum(float(b) for b in by_dtype.values()))
    same_family = (target in PURE_MODES and current in PURE_MODES) or (
        target in AUTOCAST_MODES and current in AUTOCAST_MODES
    )
    total = 0.0
    for dt, b in by_dtype.items():
        size = FLOAT_BYTES.get(str(dt)) or (8 if current == FP64 and str(dt) == "float64" else None)
        if not size:
            total += float(b)
            continue
        e = float(b) / size
        if target in FP32_STORAGE_MODES:
            total += 4 * e
        elif size == 2 or (not same_family and head_matmul):
            total += 2 * e
        else:
            total += 4 * e
    return total


def textbook(
    n_params: int, optimizer_state_bytes: int | None = None, n_trainable: int | None = None
) -> dict[str, Any]:
    """The textbook table: bytes of parameters, gradients and optimizer states, FP32 vs mixed precision.

    Parameters 4N bytes in FP32 and 2N in mixed precision, gradients the same of the ``n_trainable`` elements
    trained (all N when not given: a LoRA model's frozen base has no gradient, and the table gave 4N of them
    beside a measured adapters' few); optimizer states stay FP32 (8 bytes a trained element for Adam's two
    moments unless ``optimizer_state_bytes`` says otherwise); activations halve (scaled by
    ``activation_factor``, since they do not depend on N). ``records`` has one flat record per mode and
    component ({"mode", "component", "bytes", "source": "textbook"}): fp32/tf32 use the FP32 column, bf16, fp16,
    bf16-pure and fp16-pure the mixed one; fp8 has no textbook row.
    """
    trained = n_params if n_trainable is None else n_trainable
    opt = 8 * trained if optimizer_state_bytes is None else int(optimizer_state_bytes)
    per = {
        "fp32": {T.PARAMETERS: 4 * n_params, T.GRADIENTS: 4 * trained, T.OPTIMIZER_STATES: opt},
        "mixed": {T.PARAMETERS: 2 * n_params, T.GRADIENTS: 2 * trained, T.OPTIMIZER_STATES: opt},
    }
    records = [
        {"mode": mode, "component": comp, "bytes": b, "source": "textbook"}
        for mode in MODES
        if mode != "fp8"
        for comp, b in per["fp32" if mode in FP32_STORAGE_MODES else "mixed"].items()
    ]
    return {
        "n_params": n_params,
        "n_trainable": trained,
        "bytes": per,
        "activation_factor": {"fp32": 1.0, "mixed": 0.5},
        "claim": TEXTBOOK_CLAIM,
        "saving_range": TEXTBOOK_SAVING,
        "records": records,
    }


def held_per_step(memory: pd.DataFrame) -> pd.Series:
    """Bytes each measured step held (its components' own sizes; peaks and precprof's own buffers left out),
    indexed by step, in step order: the steps with parameter rows where any has them (a step without is
    partial)."""
    held = T.memory_at(memory) if not memory.empty else memory  # not the parts of the allocator's peak
    if held.empty:
        return pd.Series(dtype=float)
    have = held[held[T.COMPONENT] == T.PARAMETERS]
    if not have.empty:
        held = held[held[T.STEP].isin(have[T.STEP])]
    steps = pd.Index(sorted(held[T.STEP].unique()))
    held = held[~held[T.COMPONENT].isin(T.MEMORY_PEAK_COMPONENTS | {T.PROFILER_BUFFERS})]
    b = pd.to_numeric(held[T.BYTES], errors="coerce").fillna(0)
    return b.groupby(held[T.STEP]).sum().reindex(steps, fill_value=0.0).astype(float)


def representative_step(memory: pd.DataFrame) -> int | None:
    """The measured step whose memory stands for the run: the one that held the most, the latest among equals;
    None without memory rows. Not simply the last measured step: a step is measured when its inputs have new
    shapes, and that is often a loader's smaller last batch (``drop_last=False``)."""
    per = held_per_step(memory)
    if per.empty:
        return None
    return int(per[per == per.max()].index.max())


def _step_rows(memory: pd.DataFrame, moment: str = "") -> pd.DataFrame:
    """The memory rows of the representative step at ``moment``: each component's own size by default (not the
    parts of the peak)."""
    return _rows_at(memory, representative_step(memory), moment)


def _rows_at(memory: pd.DataFrame, step: int | None, moment: str = "") -> pd.DataFrame:
    """``_step_rows`` of the representative ``step``, found by the caller."""
    held = T.memory_at(memory, moment) if not memory.empty else memory
    return held if step is None else held[held[T.STEP] == step]


def _cast_copy_elements(memory: pd.DataFrame, step: int | None) -> float:
    """Elements of the representative ``step``'s 16-bit activations that autocast copied from an fp32 tensor the
    step holds anyway (``T.MOMENT_CAST_COPIES``; none in a run recorded before them): in fp32, and in a pure
    mode, the one tensor is saved once, so those copies take nothing there."""
    rows = _rows_at(memory, step, T.MOMENT_CAST_COPIES)
    rows = rows[rows[T.MODULE].astype(str) != LOSS_SCOPE] if not rows.empty else rows
    return _elements(rows)[0] if not rows.empty else 0.0


def _components(at_step: pd.DataFrame) -> dict[str, int]:
    """Bytes per component of one step's memory rows (a peak: its largest phase; any other: its rows summed)."""
    measured: dict[str, int] = {}
    if not at_step.empty:
        for c, rows in at_step.groupby(T.COMPONENT):
            b = pd.to_numeric(rows[T.BYTES], errors="coerce").fillna(0)
            measured[str(c)] = int(b.max() if c in T.MEMORY_PEAK_COMPONENTS else b.sum())
    return measured


def measured_components(memory: pd.DataFrame) -> dict[str, int]:
    """Bytes per component on the ``representative_step`` of the memory table, as ``project`` records them in
    summary.json's ``memory["measured"]``: from the table, for a reader of a run that never saved its summary
    (killed: its memory is in the parts it streamed), as the report reads it."""
    return _components(_step_rows(memory))


def infer_mode(memory: pd.DataFrame, at_step: pd.DataFrame | None = None) -> str:
    """The precision mode a memory table looks like: pure when parameters are 16-bit and so are the gradients
    (a frozen 16-bit base with fp32 adapters, LoRA's usual recipe, is not pure: its gradients are fp32), autocast
    when saved activations are, else fp32 (tf32 and fp8 cannot be told apart from fp32 and bf16 by memory
    alone). ``at_step``: the table's ``_step_rows`` where the caller has them."""
    at_step = _step_rows(memory) if at_step is None else at_step
    if at_step.empty:
        return "fp32"

    def dominant_low(component: str) -> str | None:
        rows = at_step[at_step[T.COMPONENT] == component]
        low = rows[rows[T.DTYPE].isin(["bfloat16", "float16"])]
        if low.empty or low[T.BYTES].sum() * 2 < rows[T.BYTES].sum():
            return None
        by = low.groupby(T.DTYPE)[T.BYTES].sum()
        return "bf16" if by.idxmax() == "bfloat16" else "fp16"

    pure = dominant_low(T.PARAMETERS)
    # a master copy (tensors the optimizer holds that are not the model's) has fp32 gradients of its own: a
    # 16-bit model trained through fp32 masters is pure however many of the gradient bytes are the masters'
    masters = at_step[at_step[T.COMPONENT] == T.MASTER_WEIGHTS]
    has_master = bool(pd.to_numeric(masters[T.BYTES], errors="coerce").fillna(0).sum() > 0)
    trained_fp32 = (
        not has_master and (at_step[T.COMPONENT] == T.GRADIENTS).any() and dominant_low(T.GRADIENTS) is None
    )
    if pure is not None and not trained_fp32:
        return f"{pure}-pure"
    acts = at_step[at_step[T.COMPONENT].isin([T.ACTIVATIONS, T.AUTOCAST_WEIGHT_COPIES])]
    low = acts[acts[T.DTYPE].isin(["bfloat16", "float16"])]
    if not low.empty:
        return "bf16" if low.groupby(T.DTYPE)[T.BYTES].sum().idxmax() == "bfloat16" else "fp16"
    return "fp32"


def _frozen_low_bytes(params: pd.DataFrame, n_frozen: int, seen_mode: str) -> int:
    """Bytes of 16-bit parameters that are frozen ones (at most 2 bytes per frozen element), in a run that is
    not pure (its trained parameters are fp32); 0 otherwise."""
    if n_frozen <= 0 or seen_mode in PURE_MODES or params.empty:
        return 0
    low = params[params[T.DTYPE].isin(["bfloat16", "float16"])]
    return int(min(pd.to_numeric(low[T.BYTES], errors="coerce").fillna(0).sum(), 2 * n_frozen))


def _elements(rows: pd.DataFrame, floats: frozenset[str] = _MODE_FLOATS) -> tuple[float, int]:
    """(elements of mode-dependent floats, the dtypes ``floats``, bytes of everything else) in ``rows``."""
    elems = 0.0
    fixed = 0
    for dt, b in zip(rows[T.DTYPE], rows[T.BYTES], strict=True):
        size = _itemsize(str(dt))
        if str(dt) in floats and size:
            elems += int(b) / size
        else:
            fixed += int(b)
    return elems, fixed


def _run_mode(summary: Mapping[str, Any], inferred: str) -> tuple[str, str]:
    """(the run's precision mode, where it comes from, in words): the one the profiler saw it train in
    (``capture.precision_seen``, what the report's header says) where its configuration asked for none or for
    another one the run did not train in (accelerate's fp16 on a CPU trains in fp32: the projection's measured mode
    was fp16; a float64 model's "fp64", whatever was asked: autocast leaves it alone), else its configuration's,
    else the one its memory looks like (``inferred``: ``infer_mode``'s)."""
    config = summary.get(T.SUMMARY_CONFIG) or {}
    asked = str(config.get("precision", "")) if isinstance(config, Mapping) else ""
    asked = asked if asked in MODES else ""
    mode = precision_trained(summary, asked)
    if (mode in MODES or mode == FP64) and mode != asked:
        return mode, (
            f" (as the profiler saw the run train; {asked} was asked for)"
            if asked
            else " (as the profiler saw the run train)"
        )
    if asked:
        return asked, ""
    return inferred, " (inferred from dtypes)"


def _assumed_states(summary: Mapping[str, Any], n_trainable: int) -> int | None:
    """Bytes of optimizer states assumed for a run whose Profiler was given no optimizer (its states were not
    measured, yet they exist and take the same bytes in every mode): Adam's two fp32 moments per trained
    element, as the textbook counts them. None when an optimizer was given, or the run does not say."""
    capture = summary.get(T.SUMMARY_CAPTURE)
    if not isinstance(capture, Mapping) or "optimizer" not in capture or capture["optimizer"] is not None:
        return None
    return 8 * n_trainable


def project(
    memory: pd.DataFrame, summary: Mapping[str, Any], facts: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Measured, projected and textbook bytes per component for every precision mode (pure host computation).

    ``memory`` is the memory table (its ``representative_step`` is used), ``summary`` the run's summary (its
    ``config["precision"]``, else ``capture["precision_seen"]``, names the measured mode; else it is inferred
    from dtypes), ``facts``
    ``MemoryTracker.model_facts()`` (default: ``summary["memory"]["model"]``). Returns the dict described in
    the module docstring; ``assumptions`` lists, in words, what the projection takes for granted.
    """
    mem_block = summary.get(T.SUMMARY_MEMORY)
    if facts is None and isinstance(mem_block, Mapping):
        facts = mem_block.get("model")
    facts = dict(facts or {})
    # the representative step, and the mode the memory looks like, found once
    step = representative_step(memory)
    at_step = _rows_at(memory, step)
    inferred = infer_mode(memory, at_step)
    mode, said = _run_mode(summary, inferred)

    def comp(name: str) -> pd.DataFrame:
        return at_step[at_step[T.COMPONENT] == name] if not at_step.empty else at_step

    measured = _components(at_step)

    # a float64 run's float64 tensors follow the mode: fp32 holds each in 4 bytes, not the 8 measured
    floats = _FP64_FLOATS if mode == FP64 else _MODE_FLOATS
    p_elems, p_fixed = _elements(comp(T.PARAMETERS), floats)
    n_params = int(facts.get("n_params", round(p_elems)))
    n_trainable = int(facts.get("n_trainable", n_params))
    # requires_grad changed during the run (a layer unfrozen, frozen again): those that trained on the step measured
    at = T.trainable_at(summary, step)
    n_trainable = at if at is not None else n_trainable
    # Under FSDP a rank holds its shard of the parameters, their gradients and states: the parameters measured
    # are the shard, and the model's counts scale to it (the gradients were the whole model's, the world size
    # times what a rank holds)
    capture = summary.get(T.SUMMARY_CAPTURE)
    dist = capture.get("distributed") if isinstance(capture, Mapping) else None
    if (
        isinstance(dist, Mapping)
        and str(dist.get("wrapper")) in ("FSDP1", "FSDP2")
        and 0 < p_elems < n_params
    ):
        n_trainable = round(n_trainable * p_elems / n_params)
        n_params = round(p_elems)
    g_elems, g_fixed = _elements(comp(T.GRADIENTS), floats)
    # a sparse gradient (nn.Embedding(sparse=True)) holds the rows the step looked up, as measured: values that
    # follow the mode and indices that do not (in g_fixed), not an element per parameter element; its values are
    # what the measured float gradients hold beyond the dense ones
    sparse = min(int(facts.get("sparse_grad_numel") or 0), n_trainable)
    grad_elems = n_trainable - sparse + min(max(g_elems - (n_trainable - sparse), 0.0), sparse)
    # frozen parameters held in 16-bit beside fp32 trained ones (a bf16 base under fp32 LoRA adapters): kept as
    # measured in every mode that does not make the weights 16-bit anyway
    frozen_low = _frozen_low_bytes(comp(T.PARAMETERS), n_params - n_trainable, inferred)
    b_elems, b_fixed = _elements(comp(T.BUFFERS), floats)
    o_elems, o_fixed = _elements(comp(T.OPTIMIZER_STATES), floats)
    m_elems, m_fixed = _elements(comp(T.MASTER_WEIGHTS), floats)
    acts = comp(T.ACTIVATIONS)
    classes: Mapping[str, str] = facts.get("module_classes") or {}
    copies_elems = _elements(comp(T.AUTOCAST_WEIGHT_COPIES))[0]
    cast_copies = _cast_copy_elements(memory, step)
    matmul_numel = facts.get("matmul_weight_numel")
    # What the tensors show, which may differ from what was asked for (accelerate ignores fp16 on a CPU).
    seen_mode = inferred if not at_step.empty else mode
    measured_autocast = mode in AUTOCAST_MODES and seen_mode in AUTOCAST_MODES
    measured_pure = mode in PURE_MODES and seen_mode in PURE_MODES
    inactive = (mode in AUTOCAST_MODES and not measured_autocast) or (
        mode in PURE_MODES and not measured_pure
    )

    def activations(target: str) -> float:
        # autocast's 16-bit copies of an fp32 tensor saved anyway: none in fp32 or a pure mode (each of q, k and v
        # saved its own copy of their one input; an fp32 run saves the input once)
        total = 0.0 if target in AUTOCAST_MODES else -(4 if target in FP32_STORAGE_MODES else 2) * cast_copies
        for module, dt, b in zip(acts[T.MODULE], acts[T.DTYPE], acts[T.BYTES], strict=True):
            dt, b = str(dt), int(b)
            size = _itemsize(dt)
            if dt not in floats or not size:
                total += b  # masks, indices, float64 (but in a float64 run): no mode changes them
                continue
            e = b / size
            if module == LOSS_SCOPE:
                # the loop's loss computed in fp32 (logits.float(), or autocast's fp32 rule for losses) stays
                # fp32 in every mode; one computed on 16-bit logits (a model cast to 16 bits, no upcast) saves
                # 16-bit, which fp32 (and autocast, whose losses run in fp32) holds in fp32
                low_kept = target in PURE_MODES or (target in AUTOCAST_MODES and measured_autocast)
                total += 2 * e if dt in _LOW_FLOATS and low_kept else 4 * e
                continue
            if target in FP32_STORAGE_MODES:
                total += 4 * e
            elif target in PURE_MODES:
                # a pure run's fp32 tensors are fp32 by the model's own code (a norm that upcasts, a loss on
                # logits.float() inside the model): a whole-model cast leaves them in fp32
                total += 4 * e if measured_pure and dt == "float32" else 2 * e
            elif measured_autocast:
                # The measured mix is the autocast mix: 16-bit stays 2 bytes, fp32 stays 4.
                total += 2 * e if dt in _LOW_FLOATS else 4 * e
            else:
                total += 2 * e if classes.get(str(module), CLASS_OTHER) in LOW_UNDER_AUTOCAST else 4 * e
        return total

    def weight_copies(target: str) -> float:
        if target not in ("bf16", "fp16"):
            return (
                0.0  # fp32/pure: no casts; fp8 (torchao): the fp32 weight is saved, fp8 casts are transient
            )
        if measured_autocast and mode != "fp8":
            return 2 * copies_elems
        if matmul_numel is not None:
            return 2.0 * float(matmul_numel)
        return 0.0

    assumed_states = _assumed_states(summary, n_trainable)
    checkpointed = (
        int((capture or {}).get("checkpointed_forwards") or 0) if isinstance(capture, Mapping) else 0
    )
    projected: dict[str, dict[str, float]] = {}
    for target in MODES:
        low = target in PURE_MODES
        param_b = (2 if low else 4) * p_elems + p_fixed
        if frozen_low and not low:
            param_b = 4 * (p_elems - frozen_low / 2) + frozen_low + p_fixed
        grad_b = float((2 if low else 4) * grad_elems + g_fixed)
        state_b = float(4 * o_elems + o_fixed if assumed_states is None else assumed_states)
        if measured_pure and low:  # as measured: with a master copy's fp32 gradients, where it has one
            param_b = float(measured.get(T.PARAMETERS, param_b))
            grad_b = float(measured.get(T.GRADIENTS, grad_b))
            # torch's optimizers keep their states in the parameter's dtype: 16-bit over 16-bit weights
            state_b = float(measured.get(T.OPTIMIZER_STATES, state_b))
        projected[target] = {
            T.PARAMETERS: param_b,
            T.GRADIENTS: grad_b,
            T.OPTIMIZER_STATES: state_b,
            T.MASTER_WEIGHTS: 4 * m_elems + m_fixed if low and measured_pure else 0.0,
            T.BUFFERS: (2 if low else 4) * b_elems + b_fixed,
            T.ACTIVATIONS: activations(target),
            T.AUTOCAST_WEIGHT_COPIES: weight_copies(target),
        }
    # a float64 run's own mode, no mode of the built-in loop: projected as measured, what the other modes' peaks
    # are scaled from (memory_summary.projected_peaks)
    targets = (*MODES, FP64) if mode == FP64 else MODES
    if mode == FP64:
        projected[FP64] = {c: float(measured.get(c, 0)) for c in projected["fp32"]}

    tb = textbook(n_params, int(projected["fp32"][T.OPTIMIZER_STATES]), n_trainable)
    act32 = projected["fp32"][T.ACTIVATIONS]
    act_fixed = sum(
        int(b) for dt, b in zip(acts[T.DTYPE], acts[T.BYTES], strict=True) if str(dt) not in floats
    )
    records: list[dict[str, Any]] = []
    for target in targets:
        for c, b in projected[target].items():
            records.append({"mode": target, "component": c, "bytes": round(b), "source": "projected"})
        if target == mode:
            for c in projected[target]:
                records.append(
                    {"mode": target, "component": c, "bytes": int(measured.get(c, 0)), "source": "measured"}
                )
    if assumed_states is not None:  # beside what was measured: the verdict's "this run" counts it too
        records.append(
            {"mode": mode, "component": T.OPTIMIZER_STATES, "bytes": assumed_states, "source": "assumed"}
        )
    for r in tb["records"]:
        records.append(r)
    for target in MODES:
        if target == "fp8":
            continue
        factor = tb["activation_factor"]["fp32" if target in FP32_STORAGE_MODES else "mixed"]
        records.append(
            {
                "mode": target,
                "component": T.ACTIVATIONS,
                "bytes": round(act_fixed + factor * (act32 - act_fixed)),
                "source": "textbook",
            }
        )

    sums: dict[tuple[str, str], int] = {}
    for r in records:
        if r["source"] == "assumed":
            continue
        k = (r["mode"], r["source"])
        sums[k] = sums.get(k, 0) + int(r["bytes"])
    totals = []
    for (m, src), b in sums.items():
        ref = sums.get(("fp32", "textbook" if src == "textbook" else "projected"))
        saving = 1 - b / ref if ref else math.nan
        totals.append({"mode": m, "source": src, "bytes": b, "saving_vs_fp32": saving})

    assumptions = [
        f"measured mode: {mode}{said}",
        *(
            [
                # (a mode of the user's own loop was seen, not asked for: ``_run_mode``'s ``said``)
                f"{mode} was {'seen' if said else 'asked for'} but the measured tensors look like {seen_mode}: "
                "mixed precision was not active, so the projection treats the run as measured in fp32 storage."
            ]
            if inactive
            else []
        ),
        *(
            [
                f"The {frozen_low // 2:,} frozen parameter elements held in 16-bit stay so in every mode: "
                "only the trained ones follow it."
            ]
            if frozen_low
            else []
        ),
        "tf32 stores everything in fp32 (it only changes matmul arithmetic), so it takes what fp32 takes.",
        "Parameters and gradients: 4 bytes per element, 2 in the pure modes; buffers follow the parameters.",
        *(
            [
                f"Sparse gradients ({sparse:,} trained elements, nn.Embedding(sparse=True)): the rows a step "
                "looked up, as measured; their values follow the mode, their indices take the same bytes in "
                "every mode."
            ]
            if sparse
            else []
        ),
        "Optimizer states stay fp32 in every mode (4 bytes per state element, step counters as measured), "
        "but for the pure modes of a pure run: those keep the states as measured (torch's optimizers keep them "
        "in the parameters' dtype, precprof.optim in fp32).",
        "Pure modes as in the built-in loop: no fp32 master copy of the weights (precprof.optim keeps fp32 "
        "states and rounds each update into the 16-bit weight); a master copy measured in a pure run is kept, "
        "with its fp32 gradients, for the pure modes.",
        "Activations under autocast: "
        + (
            "the run's own dtype mix (16-bit tensors stay 2 bytes, fp32 ones stay 4)."
            if measured_autocast
            else "tensors saved by matmul modules (Linear, Conv, Conv1D), by activation/dropout modules and by "
            "BatchNorm and InstanceNorm (autocast has no rule for them: they follow their 16-bit input) become "
            "16-bit; those saved by LayerNorm, GroupNorm, RMSNorm, softmax and losses, and by any other module "
            "(attention blocks doing functional math, the model itself), stay fp32 — conservative where those "
            "modules save matmul inputs."
        ),
        "Activations at fp32: every 16-bit saved tensor becomes fp32, but for autocast's 16-bit copies of an "
        "fp32 tensor the step keeps anyway (saved by another op as it is, or copied for another: q, k and v "
        "each save their own copy of their one input), which fp32 saves once"
        + (f" ({round(4 * cast_copies):,} bytes of fp32 left out here)" if cast_copies else "")
        + "; pure modes: every float saved tensor is 16-bit, those copies left out the same way"
        + (
            ", but for the fp32 tensors this pure run saved (a norm that upcasts, a loss computed in fp32 inside "
            "the model), which its code keeps in fp32 in either pure mode."
            if measured_pure
            else "."
        ),
        *(
            [
                "This run trained in float64 (its parameters are float64: model.double()): its float64 "
                "parameters, gradients, optimizer states, buffers and saved activations take 4 bytes per element "
                "in fp32 and tf32 and 2 in the 16-bit modes, as its float32 ones; fp64, the run's own, is projected as "
                "measured."
            ]
            if mode == FP64
            else []
        ),
        ("Masks and indices" if mode == FP64 else "Masks, indices and float64 tensors")
        + " take the same bytes in every mode. What the loss saves (module "
        f"{LOSS_SCOPE!r}, measured under Profiler.memory_scope()) stays fp32 where it was fp32 (the built-in loop "
        "computes it in fp32, logits.float(), in every mode; autocast runs losses in fp32); a loss this run "
        "computed on 16-bit logits saved 16-bit tensors, which fp32 and autocast hold in fp32 and the pure modes "
        "in 16 bits.",
        "The model's outputs (the logits, in the allocator's peak only): fp32 in fp32 and tf32; 16-bit ones stay "
        "16-bit in the 16-bit modes; fp32 ones stay fp32 there, but from an fp32 run"
        + (
            ", where the output came from a matmul, as here, they become 16-bit (a model that upcasts its "
            "logits itself, logits.float(), keeps them fp32: then the 16-bit peaks are low by half their size)."
            if outputs_from_matmul(summary)
            else " they stay fp32 (no matmul was found to make them): an upper bound."
        ),
        "Autocast weight copies: 2 bytes per element of every matmul weight whose copy backward keeps "
        + (
            "(as measured)."
            if measured_autocast and mode != "fp8"
            else "(all of them: an upper bound"
            + (
                f"; this run checkpoints activations ({checkpointed:,} module forwards run again), and a "
                "checkpointed segment's copies are made again in its backward and freed with it, so the peaks of "
                "the autocast modes count more copies than live at once)."
                if checkpointed
                else ")."
            )
        ),
        "fp8 means torchao Float8Linear under bf16 autocast: it saves the high-precision input and the fp32 "
        "weight for backward and casts to fp8 on the fly, so activations are those of bf16 autocast and no "
        "weight copy is kept.",
        "Textbook: parameters and gradients 4N -> 2N, optimizer states unchanged, activations halved; no "
        "master weights, no weight copies"
        + (
            f"; the gradients' N is the {n_trainable:,} of {n_params:,} parameters that train"
            + (
                f" on step {step}, the step measured (requires_grad changed during the run)"
                if at is not None
                else ""
            )
            + " (a frozen one has no gradient)."
            if n_trainable < n_params
            else "."
        ),
    ]
    if assumed_states is not None:
        assumptions.insert(1, NO_OPTIMIZER_ASSUMPTION)
    return {
        "measured_mode": mode,
        "step": int(at_step[T.STEP].iloc[0]) if not at_step.empty else None,
        "n_params": n_params,
        "measured": measured,
        "records": records,
        "totals": totals,
        "textbook_claim": {
            "text": TEXTBOOK_CLAIM,
            "saving_low": TEXTBOOK_SAVING[0],
            "saving_high": TEXTBOOK_SAVING[1],
        },
        "assumptions": assumptions,
        "unmeasured": {T.OPTIMIZER_STATES: NO_OPTIMIZER} if assumed_states is not None else {},
        # the model's output came from a matmul (``output_bytes``: the peak's outputs in a 16-bit mode)
        "outputs_from_matmul": outputs_from_matmul(summary),
        "model": facts,
    }
