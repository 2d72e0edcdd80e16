"""What a Profiler resumed at ``first_step`` (``Profiler(out, resume=True, first_step=N)``) takes from the steps
its earlier attempts recorded in the run directory's stream before ``first_step`` (the steps from it on are
recorded again, and supersede theirs):

- the dashboards, their skipped count (the killed job's points from the restart on are dropped);
- the reducer, their sampled steps (``sampled_steps_reduced`` counts the run's, not this process's);
- the budget's thinning and spacing, their budgeted samples, and the recent losses a loss spike is called against,
  their finished steps' (``Sampler.resumed``);
- which parameters had gradients on their sampled steps (``TrainedSeen.resumed``): a layer trained in an earlier
  attempt and frozen in the last was called frozen throughout (summary.json's ``modules[].frozen``), with no
  "had gradients on sampled steps" label, the capture's word being the last attempt's alone;
- which layers the block-format what-if evaluated, on how many sampled steps, and how many sampled steps evaluated
  none (``BlockDeal.resumed``): the turns go on with the layers not yet covered, and the coverage the summary
  states counts every attempt, as the findings do (from the tables). Not under torch.distributed, where only the
  writer rank reads the stream and every rank must take the same turns.

Never at the cost of the attach: a stream that cannot be read leaves each as a fresh run has it."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from precprof import parts
from precprof import tables as T
from precprof.capture.block_budget import BlockDeal
from precprof.capture.sampling import REASON_BUDGET, SPIKE_WINDOW, Sampler
from precprof.capture.trainable import TrainedSeen

# the block statistic whose presence says a row was evaluated (the recipes and orientations are evaluated together,
# and every evaluated row has a "row" orientation): one column of the seventy
_EVALUATED = T.block_col(T.BLOCK_RECIPES[0], "flushed", "row")


def _table(read: parts.StreamRead, name: str, first_step: int) -> pd.DataFrame:
    """The rows of table ``name`` before ``first_step``, every earlier attempt's."""
    table = parts.concat(read.tables.get(name) or [])
    kept = table.to_pandas() if table is not None else pd.DataFrame()
    return kept[kept[T.STEP] < first_step] if not kept.empty else kept


def _losses(steps: pd.DataFrame) -> list[float]:
    """The finite losses of the finished steps of ``steps``, in step order, as the sampler saw them (the last
    ``SPIKE_WINDOW``)."""
    if steps.empty or T.LOSS not in steps:
        return []
    done = T.given_losses(T.finished_steps(steps)).sort_values(T.STEP)
    loss = pd.to_numeric(done[T.LOSS], errors="coerce").to_numpy(dtype=float)
    return [float(x) for x in loss[np.isfinite(loss)][-SPIKE_WINDOW:]]


def _block_turns(blocks: BlockDeal, steps: pd.DataFrame, layers: pd.DataFrame) -> None:
    """What the earlier attempts' sampled steps evaluated of the block formats (``steps`` and ``layers``: their
    rows), handed to ``blocks``: a layer was evaluated on a step where its own operands (its weight, its output
    gradient) hold block statistics; a finished sampled step with none on any row evaluated none."""
    if layers.empty or _EVALUATED not in layers:
        return
    hit = layers[_EVALUATED].notna().to_numpy()
    if not hit.any():  # (the what-if was off)
        return
    step = pd.to_numeric(layers[T.STEP], errors="coerce").to_numpy()
    own = hit & T.texts(layers[T.TENSOR]).isin((T.WEIGHT, T.ACTIVATION_GRAD)).to_numpy()
    pairs = pd.DataFrame({"m": T.texts(layers[T.MODULE])[own].astype(str).to_numpy(), "s": step[own]})
    evaluated = pairs.drop_duplicates().groupby("m")["s"].size()
    evaluating = set(step[hit].tolist())
    controls = 0
    if T.SAMPLED in steps:
        done = T.finished_steps(steps)
        sampled = pd.to_numeric(done.loc[T.flags(done[T.SAMPLED]).to_numpy(), T.STEP], errors="coerce")
        controls = sum(s not in evaluating for s in sampled.tolist())
    blocks.resumed({str(m): int(n) for m, n in evaluated.items()}, len(evaluating), controls)


def go_on_from(
    path: Path,
    first_step: int,
    sampler: Sampler,
    reducer: Any,
    dashboards: Any,
    trained: TrainedSeen,
    blocks: BlockDeal | None = None,
) -> None:
    """Hand the earlier attempts' steps of the run directory ``path`` to each (the module docstring); ``reducer``
    and ``dashboards``: None where the run has none; ``blocks``: None where the turns are not to go on (the
    what-if off, torch.distributed)."""
    read, kept = None, pd.DataFrame()
    with contextlib.suppress(Exception):
        # (of the layers table only what TrainedSeen reads, its text columns as dictionaries: all of a long run's
        # hundred columns took 28 s and 2.5 GB at the attach, 1.2M rows of a 48-layer model's 500 sampled steps)
        read = parts.read_stream(
            path,
            ("steps", "layers"),
            T.STEP,
            dictionary={"layers": (T.MODULE, T.PARAM, T.TENSOR)},
            columns={"layers": (T.STEP, T.MODULE, T.PARAM, T.TENSOR, T.CALLS, _EVALUATED)},
        )
        kept = _table(read, "steps", first_step)
        if reducer is not None and T.SAMPLED in kept:
            reducer.earlier_samples = int(T.flags(kept[T.SAMPLED]).sum())
        if sampler.budgeted:  # (each attempt began its 200 dense ones, and its loss window empty)
            budgeted = (
                kept.loc[T.texts(kept[T.SAMPLE_REASON]) == REASON_BUDGET, T.STEP]
                if T.SAMPLE_REASON in kept
                else ()
            )
            sampler.resumed(budgeted, _losses(kept))
        if dashboards is not None:
            dashboards.resumed(kept, first_step)
    if read is not None:
        layers = pd.DataFrame()
        with contextlib.suppress(Exception):
            layers = _table(read, "layers", first_step)
            trained.resumed(layers)
        if blocks is not None:
            with contextlib.suppress(Exception):
                _block_turns(blocks, kept, layers)
