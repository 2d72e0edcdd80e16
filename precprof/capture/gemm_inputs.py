"""The inputs of a sampled step's matmul layers, for ``StepHooks`` (``capture/hooks.py``, which this is a part
of): a linear layer's input is the output of the module that made it (``capture.gemm_inputs``: autocast casts
it, an FP8 or block-format GEMM would quantise it), found by object, else by the memory it views (a wrapper's
new tensor object over the same memory); when no captured module made it (an attention's output, the model's
own input), a row of its own (``:input``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from precprof import _compat
from precprof import stats as st
from precprof.capture.records import RowTable, _local, _ModuleSlot, _same_data


class GemmInputs:
    """The matmul-input part of ``capture.hooks.StepHooks``."""

    rows: RowTable
    buffer: st.StatsBuffer
    has_data: bool
    order: int
    _model_inputs: set[int]
    _block_outputs: dict[int, tuple[weakref.ref[torch.Tensor], int]]
    _outputs_made: list[tuple[weakref.ref[torch.Tensor], int]]
    _outputs_by_data: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], int]]
    _indexed: int
    _add: Callable[[torch.Tensor, int], bool]  # ``GradientReads._add``

    def _gemm_input(self, slot: _ModuleSlot, x: torch.Tensor, turn: bool) -> None:
        """The input a matmul reads (autocast casts it; a linear layer's GEMM would quantise it): the output of
        the module that made it, or, with block formats on, when no captured module did (an attention's output),
        a linear layer's row of its own."""
        found = self._block_outputs.get(id(x))
        made = found[0]() if found is not None else None
        if made is not x:
            found = self._output_by_data(x)
            made = found[0]() if found is not None else None
        if made is None and slot.first_from >= 0 and _compat.backward_pass_id() is not None:
            # a reentrant recomputation's input, remade by an outer checkpoint and let go: its first pass's maker
            found, made = (weakref.ref(x), slot.first_from), x
        if found is not None and made is not None:
            slot.input_from.add(found[1])
            if turn and slot.input >= 0:  # read as the output that made it: several readers count it once
                self.buffer.accumulate_blocks(_local(made), found[1])
        elif slot.input >= 0 and self._add(local := _local(x), slot.input):
            if turn:
                self.buffer.accumulate_blocks(local, slot.input)
            self.rows.seen(slot.input, x.dtype)
            self.has_data = True
            slot.model_input |= id(x) in self._model_inputs
            if slot.input_order < 0:
                slot.input_order = self.order
                self.order += 1

    def _first_pass_input(self, slot: _ModuleSlot, x: torch.Tensor) -> None:
        """A reentrant checkpoint's first pass gives a matmul ``x``: the module that made it is kept for the
        recomputation (``first_from``), whose input an outer checkpoint may have made again and let go of."""
        found = self._block_outputs.get(id(x))
        if found is None or found[0]() is not x:
            found = self._output_by_data(x)
        if found is not None and found[0]() is not None:
            slot.first_from = found[1]

    def _output_by_data(self, x: torch.Tensor) -> tuple[weakref.ref[torch.Tensor], int] | None:
        """The output registered this step over the memory ``x`` views (``_same_data``), a later one winning as
        by object; the index grows over the outputs registered since it was last looked at."""
        index, made = self._outputs_by_data, self._outputs_made
        for entry in made[self._indexed :]:
            t = entry[0]()
            if t is not None:
                index[_same_data(t)] = entry
        self._indexed = len(made)
        return index.get(_same_data(x))
