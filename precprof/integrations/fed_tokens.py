"""The token ids a training micro-batch fed the model, for a framework callback's token counts (Lightning's).

The count is the input of the model's token embedding (``token_embedding``) at its first call in the
micro-batch, read by a forward pre-hook on it: what the model looked up, not the batch, which often holds the
targets too (a ``(B, T + 1)`` block sliced into inputs and targets holds ``B`` ids more than were fed). A model
without an embedding: the batch's first integer tensor (``first_token_count``).

torch.compile: Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``), so a
graph compiled before the hook was added (the same model class trained earlier in the process: a notebook cell
before) runs on without it, and the hook sees only the steps precprof runs eagerly (the sampled ones). The
batch then counted the targets as well, without a word (8 x 17 ids for the 8 x 16 fed). Instead, on a
micro-batch whose embedding hook ran eagerly, the tensor it looked up is found, by identity, among the batch's
tensors and the inputs of the compiled wrappers (``OptimizedModule``) around the embedding, whose own hooks run
outside the compiled code on every step: from then on, a micro-batch whose embedding hook did not run counts
that input. Where none was found (the ids made inside the compiled code), or no eager micro-batch came yet, the
micro-batch's tokens are unknown (``UNKNOWN``), never the batch's. Host metadata only (``numel``), no sync;
nothing of this runs inside code Dynamo traces (a hook it traces in sets the count alone, with no guard on the
rest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from precprof import _compat
from precprof.integrations._common import first_token_count

UNKNOWN = -1  # ``take``'s count of a micro-batch whose fed ids cannot be known
_Key = tuple[Any, ...]  # where an input came from: ("batch", 0), ("wrapper", 0, "arg", 0), ...


# names of the embedding tables that hold positions, not tokens (nanoGPT's wpe, Hugging Face's position_embeddings
# and embed_positions, T5's relative_attention_bias): a character-level model's (65 rows) is smaller than them
_POSITION_NAMES = ("wpe", "pos", "relative")


def token_embedding(module: nn.Module) -> nn.Embedding | None:
    """The model's token embedding: the ``nn.Embedding`` whose weight an ``nn.Linear`` shares (a tied output
    head); else the one with the most rows (the vocabulary, larger than the token-type tables) of those not named
    as a position table (``_POSITION_NAMES``), else of all; the first such in module order; None without one.
    A position table's input is one sequence's positions: counted as the tokens fed, a batch of B sequences read
    as 1/B of its tokens."""
    found: dict[int, tuple[str, nn.Embedding]] = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.Embedding):
            found.setdefault(id(m), (name, m))
    heads = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    # the module's own name, not its path: "composer.tok_emb" holds "pos" in its parent's name
    tokens = [
        (n, e)
        for n, e in found.values()
        if not any(p in n.rpartition(".")[2].lower() for p in _POSITION_NAMES)
    ]
    for picked in (
        [(n, e) for n, e in found.values() if id(e.weight) in heads],
        tokens,
        list(found.values()),
    ):
        if picked:
            return max(picked, key=lambda t: t[1].num_embeddings)[1]  # max: the first of the largest
    return None


class FedTokens:
    """The ids each training micro-batch fed the model's token embedding (see the module's docstring):
    ``attach(model)``, then per micro-batch ``begin(batch)`` and ``take(batch)``; ``remove()`` at the end."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._embedding: nn.Embedding | None = None
        self._compiled = False  # a compiled wrapper around the embedding, or a compiled LightningModule
        self._fed: int | None = None  # ids the embedding looked up in this micro-batch (its first call)
        self._inputs: dict[int, _Key] = {}  # this micro-batch's candidate inputs: id(tensor) -> where from
        self._counts: dict[_Key, int] = {}  # their element counts
        self._called: set[int] = set()  # the wrappers called in this micro-batch (their first call counts)
        self._source: _Key | None = None  # the input the embedding looked up, found on an eager micro-batch
        self._seen = False  # the embedding's hook ran in this fit

    def attach(self, model: nn.Module) -> None:
        """Hooks on ``model``'s token embedding and on the compiled wrappers around it."""
        self.remove()
        self._embedding = embedding = token_embedding(model)
        self._source, self._seen = None, False
        if embedding is None:
            self._compiled = False
            return
        self._handles.append(_compat.register_uncopied(embedding, self._embedding_input, pre=True))
        wrappers = [
            m
            for m in model.modules()
            if _compat.is_compile_wrapper(m) and any(x is embedding for x in m.modules())
        ]
        for k, w in enumerate(wrappers):
            hook = self._wrapper_input(k)
            self._handles.append(_compat.register_uncopied(w, hook, pre=True, with_kwargs=True))
        # (Lightning's ``from_compiled``: ``trainer.fit(torch.compile(module))`` compiles its training_step)
        self._compiled = bool(wrappers) or getattr(model, "_compiler_ctx", None) is not None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def begin(self, batch: Any) -> None:
        """A training micro-batch begins: its batch's integer tensors are candidates."""
        self._fed = None
        self._inputs.clear()
        self._counts.clear()
        self._called.clear()
        if self._embedding is not None:
            self._note(("batch",), batch, depth=2)

    def take(self, batch: Any) -> int | None:
        """The ids the micro-batch fed the model; ``UNKNOWN`` where the embedding ran out of the hook's sight
        (in a graph compiled without it) and no input it looked up on an eager micro-batch came again; None for
        a batch without token ids."""
        fed, self._fed = self._fed, None
        if fed is not None:
            return fed
        if self._embedding is None:
            return first_token_count(batch)
        if self._source is not None and self._source in self._counts:
            return self._counts[self._source]
        if self._seen or self._compiled:
            return UNKNOWN
        return first_token_count(batch)  # an embedding training never called: the batch's ids

    def _note(self, key: _Key, value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool:
                self._inputs.setdefault(id(value), key)
                self._counts.setdefault(key, int(value.numel()))
        elif depth > 0 and isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self._note((*key, i), v, depth - 1)
        elif depth > 0 and isinstance(value, Mapping):
            for name, v in value.items():
                if isinstance(name, str):
                    self._note((*key, name), v, depth - 1)

    def _wrapper_input(self, k: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            # (inside code Dynamo traces, nothing: no guard on these dictionaries)
            if torch.compiler.is_compiling() or not module.training or k in self._called:
                return
            self._called.add(k)
            self._note(("wrapper", k, "args"), args, depth=1)
            self._note(("wrapper", k, "kwargs"), kwargs, depth=1)

        return hook

    def _embedding_input(self, module: Any, args: Any) -> None:
        if self._fed is None and module.training and args and isinstance(args[0], torch.Tensor):
            self._fed = int(args[0].numel())
            if not torch.compiler.is_compiling():  # an eager call: which input it looked up
                self._seen = True
                self._source = self._inputs.get(id(args[0]))
