"""The model's output head, for ``StepHooks`` (``capture/hooks.py``, which this is a part of): the matmul that
produces the model's output, found once, on the first sampled step's training forward, from autograd's graph of
what the model returned (summary ``capture.output_head``; the block plan keeps that layer out of FP4).

The last linear layer in forward order is not always the head: a head tied to the embedding and computed in the
model's forward (``F.linear(x, self.wte.weight)``, no module of its own) left the last block's MLP layer named
as the head, and a model that runs another linear layer after its head (a value head, a probe) had that one
named. Here the graph is walked back from the model's output (its first non-scalar tensor with a graph: the
logits beside an in-model loss; else its loss), breadth first, to the first matmul on the way:

- the output of a captured linear layer (``_ModuleSlot.gemm``; its output's node, which the layer's forward hook
  kept on the walk's step until the model's forward returned: the node, not the tensor, which a model that
  returns its logits cast, ``logits.float()`` as accelerate's ``convert_outputs_to_fp32`` does under the HF
  Trainer's ``bf16=True``, has freed by then): that layer, ``{"module": name, "by": "output"}``, frozen or
  not;
- a matmul node of the graph (mm, addmm, bmm, ...) one of whose operands is a model's parameter of two or more
  dimensions, through layout nodes alone (a transpose, autocast's cast, a view): the module that owns that
  parameter, ``{"module": owner, "param": name, "by": "weight"}`` (the embedding, for a tied head computed by a
  function);
- a matmul node one of whose operands has no graph (a weight that does not train, which no ``AccumulateGrad``
  names, or a constant), its output no captured layer's: ``{"by": "unnamed"}``, the head is not known (a
  frozen head tied to the embedding, a frozen head the module filter left out). The walk had gone on past it to
  the first matmul on a trained weight: a LoRA adapter deep in the model named as the head;
- neither within ``MAX_NODES`` nodes (a compiled graph's single node, a model whose output comes from no matmul,
  a parameter under a wrapper that replaces it in the forward: FSDP's): ``None``, and the analysis keeps its
  rule of the last linear layer that ran.

A matmul between two activations (attention's, a contrastive model's ``image @ text.T``) is passed through. The
walk reads the graph's nodes on the host (``grad_fn``, ``next_functions``, ``AccumulateGrad.variable``): no
tensor value, no sync, no change to the graph; no node is kept once the model's forward returned (a node holds
its saved tensors). At most ``MAX_NODES`` nodes, on one sampled step of the run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from precprof import _compat
from precprof.capture.plan import CapturePlan
from precprof.capture.records import _iter_tensors

MAX_NODES = 512  # the walk's bound: a transformer's head is a few nodes from its logits, its loss a dozen
_NOT_WALKED: Any = object()

# the nodes of a matmul whose operand may be a parameter (F.linear's addmm or mm; matmul's bmm, mv, ...)
_MATMUL_NODES = (
    "MmBackward",
    "AddmmBackward",
    "BmmBackward",
    "BaddbmmBackward",
    "MvBackward",
    "AddmvBackward",
    "LinearBackward",
    "MatmulBackward",
)
# nodes between a parameter and the matmul that reads it that change no value: a transpose, autocast's cast, a
# view, an expand (a batched matmul's weight)
_LAYOUT_NODES = (
    "TBackward",
    "TransposeBackward",
    "PermuteBackward",
    "ToCopyBackward",
    "ViewBackward",
    "UnsafeViewBackward",
    "ReshapeAliasBackward",
    "ExpandBackward",
    "AliasBackward",
    "CloneBackward",
    "UnsqueezeBackward",
    "SqueezeBackward",
)
_LAYOUT_HOPS = 6  # layout nodes between a matmul and its parameter's AccumulateGrad, at most


def output_roots(output: Any) -> list[torch.Tensor]:
    """Where the walk starts: the model's first floating tensor with a graph that is not a scalar (the logits; an
    in-model loss returned beside them is left aside, as it may add an auxiliary loss's branch, a router's, as
    near as the head), else its first scalar (a model that returns its loss alone); [] when nothing it returned
    has a graph (a forward that raised)."""
    tensors = [t for t in _iter_tensors(output) if t.grad_fn is not None and not t.is_complex()]
    wide = [t for t in tensors if t.dim() > 0]
    return (wide or tensors)[:1]


def _matmul_weight(node: Any, params: Mapping[int, str]) -> str | None:
    """The parameter (its name among ``params``) a matmul node reads through layout nodes alone, if any."""
    for first, _ in node.next_functions:
        fn = first
        for _ in range(_LAYOUT_HOPS):
            if fn is None:
                break
            var = getattr(fn, "variable", None)  # a leaf's AccumulateGrad
            if isinstance(var, torch.Tensor):
                name = params.get(id(var)) if var.dim() >= 2 else None
                if name is not None:
                    return name
                break
            if not fn.name().startswith(_LAYOUT_NODES) or len(fn.next_functions) != 1:
                break
            fn = fn.next_functions[0][0]
    return None


def find_head(
    roots: list[torch.Tensor], outputs: Mapping[Any, str], params: Mapping[int, str], limit: int = MAX_NODES
) -> dict[str, str] | None:
    """The head of the graph behind ``roots`` (see the module docstring): ``outputs``, each captured linear layer's
    output node -> its name; ``params``, each parameter's ``id`` -> ``"owner.param"``. At most ``limit`` nodes.
    Host only, never syncs."""
    todo: deque[Any] = deque(t.grad_fn for t in roots)
    seen: set[int] = set()
    while todo and len(seen) < limit:
        node = todo.popleft()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        layer = outputs.get(node)
        if layer is not None:
            return {"module": layer, "by": "output"}
        if node.name().startswith(_MATMUL_NODES):
            name = _matmul_weight(node, params)
            if name is not None:
                owner, _, param = name.rpartition(".")
                return {"module": owner, "param": param, "by": "weight"}
            if any(fn is None for fn, _ in node.next_functions):  # (a frozen weight: the head, maybe)
                return {"by": "unnamed"}
        todo.extend(fn for fn, _ in node.next_functions)
    return None


class OutputHead:
    """The output-head part of ``capture.hooks.StepHooks``: ``output_head`` is the walk's answer once it ran
    (``find_head``; None: it found none), ``_NOT_WALKED`` until then."""

    plan: CapturePlan
    installed: bool
    # while the walk has not run, each linear layer's output node this step -> the layer's name, kept by its
    # forward hook (an inner layer's hook fires before its wrapper's, which returns the same tensor: the inner one
    # is the layer); emptied when the model's forward returns and at each step's start
    _head_nodes: dict[Any, str]
    output_head: Any

    def _walk_head(self, output: Any) -> None:
        """At the end of the model's outermost forward with grad on a sampled step, while the walk has not run:
        walk from what it returned (``find_head``)."""
        outputs, self._head_nodes = self._head_nodes, {}
        if (
            self.output_head is not _NOT_WALKED
            or not self.installed
            or _compat.backward_pass_id() is not None
        ):
            return
        roots = output_roots(output)
        if not roots:
            return
        self.output_head = find_head(roots, outputs, dict(self.plan.param_names))

    @property
    def head_found(self) -> dict[str, str] | None:
        """The walk's answer for the summary (None: it has not run, or found no head)."""
        return None if self.output_head is _NOT_WALKED else self.output_head
