"""The Profiler's hooks: what runs inside the model's forward and backward and around the optimizer step.

On sampled steps, the operands a block-scaled GEMM would quantise also get the block-format what-if
(``precprof.stats.blocks``), unless the Profiler was made with ``block_formats=False``: the weight and the output
gradient of every linear layer (``taxonomy.is_linear_type``; an embedding's weight too, for tied heads), and
the output of any captured module that a linear layer then reads as its input (matched by tensor identity in
the linear layer's pre-hook, so each such tensor is read once however many layers read it; it is recorded
under the producing module's ``activation`` row). Nothing else: an activation no linear layer reads, a
weight gradient, a norm's weight, are never quantised by such a GEMM, and evaluating them would only cost.

Every hook returns None (a returned value would replace the module's output) and never synchronises with the
device. On steps that are not sampled each returns at once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from precprof import stats as st
from precprof import taxonomy
from precprof.capture.records import _iter_tensors, _local, _ModuleSlot, _ParamSlot
from precprof.capture.updates import UpdateSampler


def reads_block_operands(module_type: str) -> bool:
    """Modules whose own operands get the block-format what-if: linear layers (weight, output gradient and the
    input they read) and embeddings (their weight, for an output head tied to it)."""
    return taxonomy.is_linear_type(module_type) or "Embedding" in module_type


def _same_data(t: torch.Tensor) -> tuple[Any, ...]:
    """What identifies a tensor's values without reading them (host metadata, no sync): a wrapper that hands a
    layer a new tensor object viewing the same memory (FSDP2's forward hooks do) still matches the output that
    made it, as long as that output is alive (a weakref to it is kept beside), so its memory is not reused."""
    try:
        return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
    except (RuntimeError, NotImplementedError, TypeError):  # no storage to point at (a tensor subclass)
        return (id(t),)


class HookFactories:
    """The hook factories of ``Profiler``, with the state they share with it."""

    _buffer: st.StatsBuffer | None
    _sampling: bool
    _attached: bool
    _order_counter: int
    _step_has_data: bool
    _autocast_seen: dict[str, Any]
    _device: torch.device
    _updates: UpdateSampler | None
    _block_formats: bool  # also the block-format what-if of the linear layers' operands
    # the group of layers (_ModuleSlot.block_group) whose operands this sampled step evaluates
    _block_turn: int
    # this sampled step's module outputs a linear layer may read: id(tensor) -> (the tensor, its activation row)
    _block_outputs: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], int]]

    # ---------------------------------------------------------------------------------------- hooks
    # The hooks' first line is all Dynamo sees on steps that are not sampled (it guards on the flag, so a
    # compiled model gets one graph for sampled and one for other steps); the recording itself is excluded
    # from tracing, which breaks the graph at captured modules on sampled steps only.
    def _make_pre_hook(self, slot: _ModuleSlot) -> Any:
        mtype = type(slot.module).__name__
        gemm = taxonomy.is_linear_type(mtype)
        weight_blocks = self._block_formats and reads_block_operands(mtype)

        @torch.compiler.disable
        def record(module: nn.Module, args: Any) -> None:
            assert self._buffer is not None
            turn = slot.block_group == self._block_turn
            if gemm and slot.input is not None and args and isinstance(args[0], torch.Tensor):
                # the input this linear layer's GEMM would quantise: the output of the module that made it, or,
                # when no captured module did (an attention's output), a row of its own
                x = args[0]
                found = self._block_outputs.get(_same_data(x))
                made = found[0]() if found is not None else None
                if found is not None and made is not None:
                    if turn:  # read as the output that made it: several readers count it once
                        self._buffer.accumulate_blocks(_local(made), found[1])
                elif self._buffer.accumulate(_local(x), slot.input.index, blocks=turn):
                    slot.input.seen(x.dtype)
                    self._step_has_data = True
                    if slot.input_order < 0:
                        slot.input_order = self._order_counter
                        self._order_counter += 1
            if slot.called:
                return
            slot.called = True
            slot.order = self._order_counter
            self._order_counter += 1
            blocks = weight_blocks and turn
            for _, p, row in slot.weights:
                if (
                    p.is_floating_point()
                    and p.numel() > 0
                    and self._buffer.accumulate(_local(p), row.index, blocks=blocks)
                ):
                    row.seen(p.dtype)
                    self._step_has_data = True

        def pre_hook(module: nn.Module, args: Any) -> None:
            if self._sampling and torch.is_grad_enabled():
                record(module, args)
            return None

        return pre_hook

    def _make_fwd_hook(self, slot: _ModuleSlot) -> Any:
        act = slot.activation
        grad_row = slot.activation_grad
        # a linear layer's output gradient is an operand of its input- and weight-gradient GEMMs
        grad_blocks = self._block_formats and taxonomy.is_linear_type(type(slot.module).__name__)

        def grad_hook(g: torch.Tensor) -> None:
            buf = self._buffer
            if (
                buf is not None
                and g is not None
                and self._attached
                and buf.accumulate(
                    _local(g), grad_row.index, blocks=grad_blocks and slot.block_group == self._block_turn
                )
            ):
                grad_row.seen(g.dtype)
            return None

        @torch.compiler.disable
        def record(output: Any) -> None:
            assert self._buffer is not None
            any_tensor = False
            for t in _iter_tensors(output):
                if not self._buffer.accumulate(_local(t), act.index):
                    continue
                if self._block_formats and t.dim() >= 2:
                    self._block_outputs[_same_data(t)] = (weakref.ref(t), act.index)
                any_tensor = True
                if t.requires_grad:
                    t.register_hook(grad_hook)
                name = str(t.dtype).removeprefix("torch.")
                if name not in act.dtypes:
                    act.dtypes.append(name)
            if any_tensor:
                act.calls += 1
                self._step_has_data = True
                if not self._autocast_seen:
                    self._note_autocast(self._device.type)

        def fwd_hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._sampling and torch.is_grad_enabled():
                record(output)
            return None

        return fwd_hook

    def _note_autocast(self, device_type: str) -> None:
        try:
            enabled = torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type) if enabled else None
        except (AttributeError, TypeError, RuntimeError):
            enabled, dtype = False, None
        self._autocast_seen = {
            "enabled": bool(enabled),
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
            "device_type": device_type,
        }

    def _make_grad_acc_hook(self, ps: _ParamSlot) -> Any:
        row = ps.grad_row
        assert row is not None

        def hook(p: torch.Tensor) -> None:
            if not self._sampling or p.grad is None or self._buffer is None:
                return None
            if not self._buffer.accumulate(_local(p.grad), row.index, assign=True):
                return None
            row.calls = 1
            name = str(p.grad.dtype).removeprefix("torch.")
            if name not in row.dtypes:
                row.dtypes.append(name)
            self._step_has_data = True
            return None

        return hook

    def _opt_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._sampling and self._updates is not None:
            self._updates.before_step()
        return None

    def _opt_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._sampling and self._updates is not None and self._updates.after_step():
            self._step_has_data = True
        return None
