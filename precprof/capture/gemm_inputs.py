"""The inputs of a sampled step's matmul layers, for ``StepHooks`` (``capture/hooks.py``, which this is a part
of): a matmul layer's input (a linear layer's or a convolution's) is the output of the module that made it
(``capture.gemm_inputs``: autocast casts it, an FP8 or block-format GEMM would quantise a linear layer's),
found by object, else by the memory it views (a wrapper's new tensor object over the same memory); when no
captured module made it (an attention's output, the model's own input, an ``F.interpolate`` between modules), a
row of its own (``:input``), block formats on or off. An output changed in place between its maker's forward
hook and the layer's pre-hook (``h[0, 3] += 3e4``, a residual added with ``+=``, ``masked_fill_``) is no longer
what its maker's row holds: told by its version counter (host metadata, no sync), it is read as the layer's own
input. So is an output whose maker ran more often in the step than the layer reading it (T5 applies one dropout
to the embeddings and again to the encoder's output, which the cross-attention's k and v read; a model that
reuses one ``self.act`` after each layer): the maker's row adds up outputs the layer never read, so the layer
reads its own input from then on, on that step (the maker already ran more often) or from the next one (it ran
again after).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from precprof import _compat
from precprof import stats as st
from precprof.capture.records import RowTable, _ModuleSlot, _readable, _same_data

# a module output a matmul may read, kept at its maker's forward hook: the tensor, the maker's activation row, and
# the tensor's version then (``_compat.tensor_version``: an in-place change since moves it)
Made = tuple[weakref.ref[torch.Tensor], int, int | None]


def made_entry(t: torch.Tensor, act: int) -> Made:
    """The entry of ``t``, an output of the module whose activation row is ``act``, as it is now."""
    return weakref.ref(t), act, _compat.tensor_version(t)


class GemmInputs:
    """The matmul-input part of ``capture.hooks.StepHooks``."""

    rows: RowTable
    buffer: st.StatsBuffer
    has_data: bool
    order: int
    _model_inputs: set[int]
    _block_outputs: dict[int, Made]
    _outputs_made: list[Made]
    _outputs_by_data: dict[tuple[Any, ...], Made]
    _indexed: int
    # this step's (reader's activation row, maker's activation row) pairs read by maker, with the reader's slot
    _read_from: dict[tuple[int, int], _ModuleSlot]
    _add: Callable[[torch.Tensor, int], bool]  # ``GradientReads._add``

    def _gemm_input(self, slot: _ModuleSlot, x: torch.Tensor, turn: bool) -> None:
        """The input a matmul reads (autocast casts it; a linear layer's GEMM would quantise it): the output of
        the module that made it, or, when no captured module did (the model's own batch, an attention's output)
        or it changed in place since, the layer's row of its own, a convolution's as a linear layer's. Only a
        linear layer's gets the block-format what-if (``input_blocks``, and ``turn``: its group's step)."""
        got = self._made_as_is(slot, x)
        if got is None and slot.first_from >= 0 and _compat.backward_pass_id() is not None:
            # a reentrant recomputation's input, remade by an outer checkpoint and let go: its first pass's maker
            got = (slot.first_from, x)
        if got is not None:
            self._read_made(slot, got[0])
            if turn and slot.input_blocks:  # read as the output that made it: several readers count it once
                self.buffer.accumulate_blocks(_readable(got[1]), got[0])
        else:
            self._own_input(slot, x, turn and slot.input_blocks)

    def _norm_input(self, slot: _ModuleSlot, x: torch.Tensor) -> None:
        """A norm's input (``CapturePlan.of``: what its statistics square): the output of the module that made it
        as it is, which that module's row holds (recorded, as a matmul's, and not read twice), else its own row
        (a pre-norm residual sum, which no module returns)."""
        got = self._made_as_is(slot, x)
        if got is not None:
            self._read_made(slot, got[0])
        else:
            self._own_input(slot, x)

    def _made_as_is(self, slot: _ModuleSlot, x: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """The activation row of the captured module whose output ``x`` is, and that output; None when none made
        it, when it changed in place since its maker's hook (the maker's row holds it as it was, the reader reads
        it as it is now), or when the maker ran again before ``slot`` read it (``_made_again``)."""
        found = self._maker_of(x)
        made = found[0]() if found is not None else None
        if found is None or made is None or found[2] != _compat.tensor_version(x):
            return None
        return None if self._made_again(slot, found[1]) else (found[1], made)

    def _read_made(self, slot: _ModuleSlot, row: int) -> None:
        """``slot``'s layer read the output of the module whose activation row is ``row`` (its ``input_from``)."""
        slot.input_from.add(row)
        self._read_from[(slot.activation, row)] = slot

    def _own_input(self, slot: _ModuleSlot, x: torch.Tensor, blocks: bool = False) -> None:
        """``x`` read into the row of ``slot``'s own input (``T.input_module``): a matmul's or a norm's that no
        captured module made as it is."""
        if slot.input >= 0 and self._add(local := _readable(x), slot.input):
            if blocks:
                self.buffer.accumulate_blocks(local, slot.input, read=True)
            self.rows.seen(slot.input, x.dtype)
            self.has_data = True
            slot.model_input |= id(x) in self._model_inputs
            if slot.input_order < 0:
                slot.input_order = self.order
                self.order += 1

    def _made_again(self, slot: _ModuleSlot, act: int) -> bool:
        """Whether the layer of ``slot`` reads its own input rather than the output of the module whose
        activation row is ``act``: that module already ran more often in this step than the layer, this call
        included (its row adds up outputs the layer never read), or did on an earlier sampled step."""
        calls = self.rows.calls
        slot.maker_repeated |= calls[act] > calls[slot.activation] + 1
        return slot.maker_repeated

    def _note_makers_again(self) -> None:
        """At the step's end: a layer whose input's maker ran more often in the step than the layer (it ran
        again after the layer read its output: a shared ``self.act``) reads its own input from the next sampled
        step on. The analysis leaves this step's row of that maker out of the layer's input."""
        calls = self.rows.calls
        for (reader, maker), slot in self._read_from.items():
            slot.maker_repeated |= calls[maker] > calls[reader]
        self._read_from.clear()

    def _first_pass_input(self, slot: _ModuleSlot, x: torch.Tensor) -> None:
        """A reentrant checkpoint's first pass gives a matmul ``x``: the module that made it is kept for the
        recomputation (``first_from``), whose input an outer checkpoint may have made again and let go of; not
        when it was changed in place since that module made it. A norm's input of a dtype its row leaves unread
        (torch's norms read fp16 alone) is marked -2: no row, so no place in the forward order."""
        if not slot.reads_input and x.dtype not in slot.input_dtypes:
            slot.first_from = -2
            return
        found = self._maker_of(x)
        if found is not None and found[0]() is not None and found[2] == _compat.tensor_version(x):
            slot.first_from = found[1]

    def _maker_of(self, x: torch.Tensor) -> Made | None:
        """The entry of the output registered this step that ``x`` is: by object, else by the memory it views."""
        found = self._block_outputs.get(id(x))
        return found if found is not None and found[0]() is x else self._output_by_data(x)

    def _output_by_data(self, x: torch.Tensor) -> Made | None:
        """The output registered this step over the memory ``x`` views (``_same_data``), a later one winning as
        by object; the index grows over the outputs registered since it was last looked at."""
        index, made = self._outputs_by_data, self._outputs_made
        for entry in made[self._indexed :]:
            t = entry[0]()
            if t is not None:
                index[_same_data(t)] = entry
        self._indexed = len(made)
        return index.get(_same_data(x))
