"""Bytes of tensors as memory holds them: each storage once (by address), wrapper tensors (torchao's Float8,
DTensor) by the plain tensors inside them, optimizer state walked to a bounded depth; which saved tensors are
autocast's copies of a weight."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from precprof import _compat, taxonomy
from precprof import tables as T
from precprof.capture.peak import END, Label

# A storage is known by its address alone: CUDA's unified virtual addressing keeps host and device (and
# device-to-device) addresses apart, and an int key keeps the tracker's own footprint small.
StorageKey = int


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_PLAIN = (torch.Tensor, nn.Parameter)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the dtype column's spelling)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t`` itself, or for a wrapper subclass (torchao's Float8 tensors, DTensor) the tensors inside it, or for
    a sparse tensor its values and indices (``nn.Embedding(sparse=True)``'s gradient)."""
    if t.layout is not torch.strided:
        yield from _sparse_parts(t)
        return
    if type(t) in _PLAIN or not hasattr(t, "__tensor_flatten__"):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for n in names:
        inner = getattr(t, n)
        if isinstance(inner, torch.Tensor):
            yield from _plain_tensors(inner)


def _sparse_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dense tensors a sparse tensor is made of (COO: indices and values; CSR and the other compressed
    layouts: their two index tensors and values); none for another layout."""
    try:
        if t.layout is torch.sparse_coo:
            return t._indices(), t._values()
        if t.layout in (torch.sparse_csr, torch.sparse_bsr):
            return t.crow_indices(), t.col_indices(), t.values()
        if t.layout in (torch.sparse_csc, torch.sparse_bsc):
            return t.ccol_indices(), t.row_indices(), t.values()
    except (RuntimeError, NotImplementedError):
        pass
    return ()


def _leaves(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """``t`` itself, a plain dense tensor (without a generator), or ``_plain_tensors(t)``."""
    return (t,) if type(t) in _PLAIN and t.layout is torch.strided else _plain_tensors(t)


def _storage(t: torch.Tensor) -> tuple[StorageKey, int] | None:
    """(key, nbytes) of the storage under ``t``; None where there is no real storage (meta, fake, sparse)."""
    try:
        if t.is_meta:
            return None
        s = t.untyped_storage()
        ptr = s.data_ptr()
        nbytes = s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if nbytes == 0 or ptr == 0:
        return None
    return int(ptr), int(nbytes)


class StorageMemo:
    """``_storage`` of tensors read before, by their id, data pointer and size: the parameters, buffers and
    optimizer states a sampled step's memory rows read several times, step after step (``untyped_storage()``
    makes a Python object per call). Holds no tensor; an entry whose tensor is gone is replaced when its id
    comes back with another data pointer or size (a state freed and made anew, in another dtype, where the
    allocator put the old one's bytes: the suite met it), and the memo is emptied when it grows past ``limit``
    entries."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._entries: dict[int, tuple[int, int, tuple[StorageKey, int] | None]] = {}
        self._limit = limit

    def __call__(self, t: torch.Tensor) -> tuple[StorageKey, int] | None:
        try:
            ptr, nbytes = t.data_ptr(), t.nbytes
        except (RuntimeError, NotImplementedError, TypeError):
            return _storage(t)
        hit = self._entries.get(id(t))
        if hit is not None and hit[0] == ptr and hit[1] == nbytes:
            return hit[2]
        if len(self._entries) >= self._limit:
            self._entries.clear()
        st = _storage(t)
        self._entries[id(t)] = (ptr, nbytes, st)
        return st


def _by_dtype(
    tensors: Iterable[torch.Tensor],
    exclude: set[StorageKey] | None = None,
    storage: Any = None,
) -> dict[str, int]:
    """Bytes per dtype name, each storage once (storages in ``exclude`` skipped; ``exclude`` is not changed).
    ``storage``: how a storage is found (``_storage``, or a ``StorageMemo``)."""
    storage = storage or _storage
    seen: set[StorageKey] = set()
    out: dict[str, int] = {}
    for t in tensors:
        for leaf in _leaves(t):
            st = storage(leaf)
            if st is None:
                continue
            key, nbytes = st
            if key in seen or (exclude is not None and key in exclude):
                continue
            seen.add(key)
            name = dtype_name(leaf.dtype)
            out[name] = out.get(name, 0) + nbytes
    return out


def module_tensors(modules: Iterable[nn.Module]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters and the buffers of ``modules`` (a model's ``named_modules()``, listed once), each tensor
    once and in the order ``model.parameters()`` and ``model.buffers()`` give them, without walking the
    module tree again (a walk of 200 modules costs 0.2 ms). Each module's own ``_parameters`` and ``_buffers``
    are read now: a parameter replaced since the modules were listed is the new one."""
    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    seen: set[int] = set()
    for m in modules:
        for t in m._parameters.values():
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                params.append(t)
    seen.clear()
    for m in modules:
        for b in m._buffers.values():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                buffers.append(b)
    return params, buffers


_PLAIN_TYPES = frozenset(_PLAIN)


def _fingerprint(tensors: list[torch.Tensor]) -> tuple[list[int], list[int], list[int]] | None:
    """The objects (ids), data pointers and sizes of plain tensors: what their storages are, without a storage
    object per tensor. None where one is a wrapper subclass (its storages are inside it) or has no data."""
    if not set(map(type, tensors)) <= _PLAIN_TYPES:
        return None
    try:
        return (
            list(map(id, tensors)),
            list(map(torch.Tensor.data_ptr, tensors)),
            [t.nbytes for t in tensors],
        )
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class Steady:
    """A value computed from tensors that usually outlive many steps (parameters, buffers, optimizer states),
    computed again only when they changed: other objects, or the same ones on other storages (``p.data = ...``,
    a model moved, a state made). Holds no tensor: their ids, data pointers and sizes. A tensor freed and
    replaced by a new object at the same address, of the same size, on a storage of another size would not be
    seen: the optimizer states and parameters that this holds are updated in place."""

    def __init__(self) -> None:
        self._key: tuple[list[int], list[int], list[int]] | None = None
        self._value: Any = None

    def get(self, tensors: list[torch.Tensor], compute: Any) -> Any:
        """``compute()``, or its value for the same ``tensors`` last time."""
        key = _fingerprint(tensors)
        if key is None or key != self._key:
            self._value = compute()
            self._key = key
        return self._value


def steady_bytes(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    opt_params: list[torch.Tensor],
    states: list[torch.Tensor],
    storage: Any,
) -> dict[str, dict[str, int]]:
    """Bytes per dtype of the model's parameters and buffers, the optimizer's master weights (its tensors that
    are not the model's parameters: the fp32 copy of a pure-bf16 model) and states, each storage once and in
    one component only (a buffer sharing a parameter's storage counts as the parameter)."""
    keys = _storage_keys(params, storage)
    out = {
        T.PARAMETERS: _by_dtype(params, storage=storage),
        T.BUFFERS: _by_dtype(buffers, exclude=keys, storage=storage),
    }
    if opt_params or states:
        masters = [p for p in opt_params if not (_storage_keys([p], storage) & keys)]
        out[T.MASTER_WEIGHTS] = _by_dtype(masters, storage=storage)
        exclude = keys | _storage_keys(masters, storage)
        out[T.OPTIMIZER_STATES] = _by_dtype(states, exclude=exclude, storage=storage)
    return out


def _storage_keys(tensors: Iterable[torch.Tensor], storage: Any = None) -> set[StorageKey]:
    """The storages under ``tensors`` (wrapper subclasses by the tensors inside them)."""
    storage = storage or _storage
    out: set[StorageKey] = set()
    for t in tensors:
        for leaf in _leaves(t):
            st = storage(leaf)
            if st is not None:
                out.add(st[0])
    return out


def state_tensors(state: Mapping[Any, Any]) -> list[torch.Tensor]:
    """The tensors of an optimizer's ``state`` (``_state_tensors`` of each entry), in one list; the usual entry,
    a dict of plain tensors (Adam's step, exp_avg, exp_avg_sq), without a generator."""
    out: list[torch.Tensor] = []
    for s in state.values():
        if type(s) is dict and set(map(type, s.values())) <= _PLAIN_TYPES:
            out += s.values()
        else:
            out += _state_tensors(s)
    return out


# where a wrapper keeps the optimizer that does the step: ZeroRedundancyOptimizer's ``optim``, accelerate's
# AcceleratedOptimizer's ``optimizer``, Lightning's LightningOptimizer's ``_optimizer``
WRAPPED_OPTIMIZER = ("optim", "optimizer", "_optimizer")


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors of ``optimizer.state`` and of the ``state`` of the optimizer it wraps (``WRAPPED_OPTIMIZER``),
    each dictionary once: ZeroRedundancyOptimizer's own ``state`` stays empty while the optimizer it wraps holds
    this rank's shard of the states (precprof counted 0 bytes of them); accelerate's and Lightning's wrappers
    show the wrapped one's ``state`` as theirs (one dictionary, read once)."""
    out: list[torch.Tensor] = []
    seen: list[Any] = []
    opt = optimizer
    for _ in range(4):  # a wrapper of a wrapper, a few deep
        state = getattr(opt, "state", None)
        if isinstance(state, Mapping) and not any(state is s for s in seen):
            seen.append(state)
            out += state_tensors(state)
        inner = next(
            (i for i in (getattr(opt, a, None) for a in WRAPPED_OPTIMIZER) if _is_optimizer(i, opt)), None
        )
        if inner is None:
            break
        opt = inner
    return out


def sharded_states(optimizers: Iterable[Any]) -> bool:
    """Whether an optimizer keeps only this rank's shard of its states (ZeroRedundancyOptimizer)."""
    return any(type(o).__name__ == "ZeroRedundancyOptimizer" for o in optimizers)


def _is_optimizer(inner: Any, outer: Any) -> bool:
    return (
        inner is not None
        and inner is not outer
        and hasattr(inner, "param_groups")
        and hasattr(inner, "state")
    )


def _state_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside an optimizer state entry (dicts and lists of them, a few levels deep)."""
    if depth == 0 and type(obj) is dict and all(isinstance(v, torch.Tensor) for v in obj.values()):
        yield from obj.values()  # the usual entry (Adam's step, exp_avg, exp_avg_sq): no recursion
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, Mapping):
        for v in obj.values():
            yield from _state_tensors(v, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _state_tensors(v, depth + 1)


def _sizeof(obj: Any, memo: set[int], depth: int = 0) -> int:
    """Host bytes of the tracker's own containers, each object once (deep into containers, strings and
    numbers; shallow for anything else, and modules and tensors are the user's, not counted)."""
    if id(obj) in memo or isinstance(obj, (nn.Module, torch.Tensor)):
        return 0
    memo.add(id(obj))
    size = sys.getsizeof(obj)
    if depth > 6:
        return size
    if isinstance(obj, Mapping):
        size += sum(_sizeof(k, memo, depth + 1) + _sizeof(v, memo, depth + 1) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        if set(map(type, obj)) <= _SCALARS:  # storage addresses, sizes: summed without a call per item
            return size + sum(map(sys.getsizeof, obj))
        size += sum(_sizeof(v, memo, depth + 1) for v in obj)
    return size


_SCALARS = frozenset({int, float, str, bool})


def _tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors of any dtype inside a forward's arguments or output (tuples, lists, dicts, ModelOutput),
    depth-limited."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)


def _held_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors an object holds in its attributes, containers and their attributes, a few levels deep, each
    object once, depth first (precprof's own statistics buffers and scratch). Modules are not entered. One loop
    over a stack rather than a generator per object: read at the end of every step that measures memory, where
    the recursive walk of a 100-layer stack's buffers (some 700 objects) took 1.4 ms on the project's CPU, this
    one 0.9."""
    memo: set[int] = set()
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        o, depth = stack.pop()
        if type(o) in _LEAVES or depth > 4 or id(o) in memo or isinstance(o, nn.Module):
            continue
        memo.add(id(o))
        if isinstance(o, torch.Tensor):
            yield o
            continue
        if isinstance(o, Mapping):
            inside: list[Any] = list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            inside = list(o)
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            inside = list(vars(o).values())
        elif hasattr(o, "__slots__"):
            inside = [getattr(o, name, None) for name in getattr(type(o), "__slots__", ())]
        else:
            continue
        stack.extend((v, depth + 1) for v in reversed(inside))  # (the first attribute walked first)


# what ``_held_tensors`` need not look into: no tensor is inside
_LEAVES = frozenset({int, float, bool, str, bytes, type(None), torch.device, torch.dtype})


# grad_fn names of pure views between a saved tensor and the cast that made it.
_VIEW_NODES = frozenset(
    {
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "AsStridedBackward0",
        "AliasBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
    }
)
_MAX_VIEW_DEPTH = 8


# autograd node type -> _OTHER_NODE, _VIEW_NODE or _TO_COPY_NODE (a node type per op: its name read once)
_OTHER_NODE, _VIEW_NODE, _TO_COPY_NODE = 0, 1, 2
_NODE_KINDS: dict[type, int] = {}


def _node_kind(fn: Any) -> int:
    kind = _NODE_KINDS.get(type(fn))
    if kind is None:
        name = fn.name()
        kind = (
            _VIEW_NODE if name in _VIEW_NODES else _TO_COPY_NODE if name == "ToCopyBackward0" else _OTHER_NODE
        )
        # one type per op (not a Python Function's node, whose type many share): its kind is its type's
        if type(fn).__name__ == name:
            _NODE_KINDS[type(fn)] = kind
    return kind


def is_weight_copy(t: torch.Tensor, module: nn.Module | None, param_keys: set[StorageKey]) -> bool:
    """Whether a saved tensor is a cast of a parameter (autocast's low-precision weight copy): its grad_fn is
    ``ToCopyBackward0`` of a parameter's ``AccumulateGrad`` (``param_keys``), possibly behind views; a frozen
    parameter's cast has no graph and is matched against ``module``'s (the running module's) frozen
    parameters by shape and dtype. Host only."""
    fn = t.grad_fn
    if fn is not None and _node_kind(fn) == _OTHER_NODE:  # most saved tensors: an op's output
        return False
    if fn is None:
        # A frozen weight's cast has no graph: match it against the running module's frozen parameters.
        if t.requires_grad or module is None or t.is_nested:  # (a nested tensor is no parameter's cast)
            return False
        for p in module.parameters(recurse=False):
            if p.requires_grad or p.dtype == t.dtype or p.numel() != t.numel():
                continue
            if p.shape == t.shape or (p.dim() == 2 and tuple(p.shape) == tuple(t.shape)[::-1]):
                return True
        return False
    for _ in range(_MAX_VIEW_DEPTH):
        if _node_kind(fn) != _VIEW_NODE:
            break
        nxt = fn.next_functions
        if not nxt or nxt[0][0] is None:
            return False
        fn = nxt[0][0]
    if _node_kind(fn) != _TO_COPY_NODE or not fn.next_functions:
        return False
    src = fn.next_functions[0][0]
    var = getattr(src, "variable", None)  # AccumulateGrad of a leaf
    if not isinstance(var, torch.Tensor):
        return False
    st = _storage(var)
    return st is not None and st[0] in param_keys


def model_sizes(model: nn.Module) -> dict[str, Any]:
    """``n_params`` (unique parameter elements: shared storages once, as in the parameters rows),
    ``n_trainable``, ``sparse_grad_numel`` (of those, the elements whose gradient is sparse),
    ``matmul_weight_numel`` (elements of >=2-D weights of matmul modules: what autocast casts)
    and ``module_classes`` (module name -> ``taxonomy.autocast_class``)."""
    seen: set[int] = set()
    n = n_train = 0
    for p in model.parameters():
        st = _storage(p)
        key = st[0] if st is not None else id(p)
        if key not in seen:  # shared storages once, as in the parameters rows
            seen.add(key)
            n += p.numel()
            n_train += p.numel() if p.requires_grad else 0
    # trained elements whose gradient is sparse (nn.Embedding(sparse=True), nn.EmbeddingBag(sparse=True)): it
    # holds the rows a step looked up and their indices, not an element per parameter element
    sparse = {
        (st[0] if (st := _storage(p)) is not None else id(p)): p.numel()
        for m in model.modules()
        if getattr(m, "sparse", False) is True
        for p in m.parameters(recurse=False)
        if p.requires_grad
    }
    seen = set()
    classes: dict[str, str] = {}
    matmul = 0
    for name, mod in _compat.named_modules(model):
        cls = taxonomy.autocast_class(mod)
        classes[name] = cls
        if cls != taxonomy.CLASS_MATMUL:
            continue
        for p in mod.parameters(recurse=False):
            st = _storage(p)
            key = st[0] if st is not None else id(p)
            if p.dim() >= 2 and key not in seen:
                seen.add(key)
                matmul += p.numel()
    return {
        "n_params": n,
        "n_trainable": n_train,
        "matmul_weight_numel": matmul,
        "sparse_grad_numel": sum(sparse.values()),
        "module_classes": classes,
    }


def persistent_labels(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    optimizers: Sequence[Any],
    own: Callable[[], Iterable[Any]] | None,
    storage: Any,
    steady: Steady | None = None,
) -> dict[StorageKey, Label]:
    """The storages that outlive a step, each labelled with the first component that holds it: the model's
    parameters and buffers, the optimizer's master weights and states, gradients that exist, precprof's own
    buffers (the objects ``own()`` returns). Host only. ``steady``: the labels of the parameters, buffers,
    master weights and states are those of the last call while those tensors are (10 ms a call for gpt2-small
    and AdamW's 740 storages, on a CPU of the project's machine, against 0.5 ms to see that they are)."""

    def put(out: dict[StorageKey, Label], component: str, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            for leaf in _plain_tensors(t):
                st = storage(leaf)
                if st is not None and st[0] not in out:
                    out[st[0]] = Label(component, "", dtype_name(leaf.dtype), END, st[1])

    opt_params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    states = [t for o in optimizers for t in optimizer_state_tensors(o)]

    def lasting() -> dict[StorageKey, Label]:
        out: dict[StorageKey, Label] = {}
        put(out, T.PARAMETERS, params)
        put(out, T.BUFFERS, buffers)
        put(out, T.MASTER_WEIGHTS, opt_params)
        put(out, T.OPTIMIZER_STATES, states)
        return out

    out = (
        lasting() if steady is None else dict(steady.get([*params, *buffers, *opt_params, *states], lasting))
    )
    put(out, T.GRADIENTS, (p.grad for p in opt_params if p.grad is not None))
    put(out, T.GRADIENTS, (p.grad for p in params if p.grad is not None))
    if own is not None:
        put(out, T.PROFILER_BUFFERS, (t for o in own() for t in _held_tensors(o)))
    return out


class SavedGroup:
    """Saved tensors of forwards that were alive together: de-duplication set and byte totals."""

    __slots__ = ("bytes", "seen", "shared", "spans")

    def __init__(self) -> None:
        self.seen: set[StorageKey] = set()
        self.bytes: dict[tuple[str, str, str], int] = {}  # (component, module, dtype) -> bytes
        # of those activations, the 16-bit copies fp32 would not hold (capture.cast_copies): (module, dtype) -> bytes
        self.shared: dict[tuple[str, str], int] = {}
        # storages the step did not make (its data): the byte ranges of them saved so far, merged and sorted
        self.spans: dict[StorageKey, list[tuple[int, int]]] = {}

    def total(self) -> int:
        return sum(self.bytes.values())

    def copy(self) -> SavedGroup:
        out = SavedGroup()
        out.seen, out.bytes, out.shared = set(self.seen), dict(self.bytes), dict(self.shared)
        out.spans = {k: list(v) for k, v in self.spans.items()}
        return out

    def cover(self, key: StorageKey, lo: int, hi: int) -> int:
        """Add the bytes ``[lo, hi)`` of the storage at ``key`` to what is saved of it; returns how many of them
        were not saved before (overlapping views of one storage count once)."""
        spans = self.spans.setdefault(key, [])
        new = hi - lo
        merged: list[tuple[int, int]] = []
        start, end = lo, hi
        for a, b in spans:  # disjoint ranges
            if b < lo or a > hi:
                merged.append((a, b))
                continue
            new -= max(0, min(b, hi) - max(a, lo))
            start, end = min(a, start), max(b, end)
        merged.append((start, end))
        spans[:] = sorted(merged)
        return max(new, 0)


def span(t: torch.Tensor, nbytes: int) -> tuple[int, int]:
    """The bytes of its storage (of ``nbytes``) that ``t`` reaches: from its first element to the end of its
    last one (a contiguous view: its own bytes; a strided one: the gaps between its elements too)."""
    size = t.element_size()
    if t.numel() == 0:
        return 0, 0
    if t.is_nested:  # (a strided one, which has no shape: its elements are the storage it holds)
        return 0, nbytes
    lo = int(t.storage_offset()) * size
    last = sum((int(n) - 1) * abs(int(s)) for n, s in zip(t.shape, t.stride(), strict=True))
    return lo, min(lo + (last + 1) * size, nbytes)
