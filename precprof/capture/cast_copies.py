"""Which 16-bit activations a forward under autocast saved that an fp32 run would not hold: autocast's copies of
one fp32 tensor made for several ops (a transformer's q, k and v projections each cast the normalised hidden
states they share; gate and up the same), or of an fp32 tensor another op saved as it is (a softmax keeps its
fp32 output, the matmul after it a 16-bit copy). In fp32 every one of those ops saves the one tensor, counted
once. The memory projection doubled each copy for fp32: a tiny Llama's activations projected 1.79 MiB where its
fp32 run saved 1.48 MiB.

A copy is told by its autograd node: autocast's cast is ``ToCopyBackward0``, whose input is the node (and
output) that made the fp32 tensor; a saved fp32 tensor is named by its own node and output. A view shares its
base's storage, in either precision: both are followed back through view nodes (a linear layer's 3-D input is
cast, then viewed as 2-D for the matmul, which saves the view). A copy that is not a view (``.clone()``,
``reshape`` of an expanded tensor: repeat_kv's keys) is a tensor of its own in fp32 too. The nodes are held
(a node's Python object, made anew when none holds it, may come back at another address) only while one
forward records: ``CastSources`` is made anew for each, so nothing of the graph outlives its forward here.
Host only.
"""

from __future__ import annotations

from typing import Any

import torch

from precprof.capture.storage import dtype_name

_COPY_NODE = "ToCopyBackward0"
# the nodes of views: their output is their input's storage (a reshape that copied is a clone before its view)
_VIEW_NODES = frozenset(
    [
        "ViewBackward0",
        "ReshapeAliasBackward0",
        "UnsafeViewBackward0",
        "ExpandBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "UnsqueezeBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "AsStridedBackward0",
        "AliasBackward0",
    ]
)
_SIXTEEN_BITS = (torch.float16, torch.bfloat16)
_HELD = "held"  # the fp32 tensor itself was saved


class CastSources:
    """The fp32 tensors a recording forward saved or autocast copied, and what came of their 16-bit copies."""

    __slots__ = ("_sources",)

    def __init__(self) -> None:
        # per fp32 tensor (its node and output): _HELD, or the first copy's (module, dtype, bytes): fp32 would
        # save the tensor in that copy's place, unless it is saved as it is too
        self._sources: dict[tuple[Any, int], Any] = {}

    def saved(self, t: torch.Tensor, module: str, nbytes: int, shared: dict[tuple[str, str], int]) -> None:
        """An activation ``t`` of ``nbytes`` saved under ``module`` (a storage not counted before); ``shared``:
        per (module, dtype), the bytes of saved 16-bit copies fp32 would not hold (``SavedGroup.shared``)."""
        if t.dtype == torch.float32:
            key = _base(t.grad_fn, t.output_nr)
            if key is not None:
                first = self._sources.get(key)
                self._sources[key] = _HELD
                if isinstance(first, tuple):  # its copy was saved earlier: fp32 saves the tensor itself, once
                    _add(shared, *first)
        elif t.dtype in _SIXTEEN_BITS:
            made = _base(t.grad_fn, t.output_nr)
            if made is None or type(made[0]).__name__ != _COPY_NODE:
                return
            source = _base(*made[0].next_functions[0])
            if source is None:
                return
            copy = (module, dtype_name(t.dtype), nbytes)
            if source in self._sources:  # the tensor saved, or copied already: fp32 holds it once
                _add(shared, *copy)
            else:
                self._sources[source] = copy


def _base(node: Any, output: int) -> tuple[Any, int] | None:
    """The node and output that made the storage of the tensor ``node``'s output ``output`` is (the views
    followed back to their base); None for a tensor autograd does not track."""
    while node is not None and type(node).__name__ in _VIEW_NODES:
        node, output = node.next_functions[0]
    return None if node is None else (node, output)


def _add(shared: dict[tuple[str, str], int], module: str, dtype: str, nbytes: int) -> None:
    shared[(module, dtype)] = shared.get((module, dtype), 0) + nbytes
