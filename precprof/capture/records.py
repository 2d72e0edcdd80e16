"""What the Profiler keeps per buffer row, module, parameter and pending step, and the small helpers its hooks
and flush share."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from torch import nn

from precprof import _compat
from precprof import tables as T
from precprof.capture.trainable import TrainedSeen

MAX_PENDING_STEPS = 256  # steps kept on the device between flushes when sampling is rare or off
# a run streamed to disk flushes its unsampled steps at least this often (seconds): a kill loses at most these
# (one sync, a few rows, on an unsampled step; sampled steps are flushed anyway)
STREAM_STEPS_EVERY_S = 10.0


@dataclass(frozen=True)
class RowInfo:
    """What one buffer row holds: the module, the kind of tensor and the parameter (fixed at attach)."""

    index: int
    module: str
    module_type: str
    tensor: str
    param: str = ""


# dtype name -> its bit in RowTable.dtype_bits, in the order dtypes were first seen (process-wide: names only)
_NAME_BITS: dict[str, int] = {}
_DTYPE_NAMES: list[str] = []
_DTYPE_BITS: dict[torch.dtype, int] = {}  # the same, keyed by the dtype itself (the hooks' lookup)


def name_bit(name: str) -> int:
    """The bit of the dtype named ``name`` in :attr:`RowTable.dtype_bits` (registered on first use)."""
    bit = _NAME_BITS.get(name)
    if bit is None:
        bit = _NAME_BITS[name] = 1 << len(_DTYPE_NAMES)
        _DTYPE_NAMES.append(name)
    return bit


def dtype_bit(dtype: torch.dtype) -> int:
    """The bit of ``dtype`` in :attr:`RowTable.dtype_bits`."""
    bit = _DTYPE_BITS.get(dtype)
    if bit is None:
        bit = _DTYPE_BITS[dtype] = name_bit(str(dtype).removeprefix("torch."))
    return bit


_DTYPE_TEXT: dict[int, str] = {}  # dtype bits -> "float32|bfloat16"


def dtype_names(bits: int) -> list[str]:
    """The dtype names of a :attr:`RowTable.dtype_bits` entry, in the order they were first seen."""
    return [name for i, name in enumerate(_DTYPE_NAMES) if bits >> i & 1]


def dtype_text_of(bits: int) -> str:
    """A :attr:`RowTable.dtype_bits` entry as the layers table writes it ("float32|bfloat16")."""
    text = _DTYPE_TEXT.get(bits)
    if text is None:
        text = _DTYPE_TEXT[bits] = "|".join(dtype_names(bits))
    return text


class RowTable:
    """The buffer rows' descriptions (``info``, fixed at attach) and, per sampled step, what each row took:
    ``calls`` (tensors, or for a module's activation row forward calls), ``dtype_bits`` (``dtype_bit`` of
    each dtype seen) and, for a linear layer's activation row, ``numel_gcd`` (the largest number dividing the
    output elements of each call: its calls' tokens per call, for FP8's rule; 0: none). Plain lists: the hooks update one entry in tens of nanoseconds, and a sampled step
    starts by replacing them (``begin_step``)."""

    def __init__(self) -> None:
        self.info: list[RowInfo] = []
        self.calls: list[int] = []
        self.dtype_bits: list[int] = []
        self.numel_gcd: list[int] = []
        self._columns: dict[str, np.ndarray] | None = None

    def new(self, module: str, module_type: str, tensor: str, param: str = "") -> int:
        index = len(self.info)
        self.info.append(RowInfo(index, module, module_type, tensor, param))
        self.calls.append(0)
        self.dtype_bits.append(0)
        self.numel_gcd.append(0)
        return index

    def __len__(self) -> int:
        return len(self.info)

    def begin_step(self) -> None:
        n = len(self.info)
        self.calls = [0] * n
        self.dtype_bits = [0] * n
        self.numel_gcd = [0] * n

    def seen(self, row: int, dtype: torch.dtype) -> None:
        """One tensor of ``dtype`` in ``row``."""
        self.calls[row] += 1
        self.dtype_bits[row] |= _DTYPE_BITS.get(dtype) or dtype_bit(dtype)

    def dtypes(self, row: int) -> list[str]:
        return dtype_names(self.dtype_bits[row])

    def dtype_text(self, row: int) -> str:
        """The dtypes seen in ``row``, as the layers table writes them ("float32|bfloat16")."""
        return dtype_text_of(self.dtype_bits[row])

    @property
    def known_dtypes(self) -> tuple[str, ...]:
        """The dtype names that ``dtype_bits`` index (bit i: the i-th; process-wide), for a decoder in another
        process (the stream's writer)."""
        return tuple(_DTYPE_NAMES)

    def columns(self) -> dict[str, np.ndarray]:
        """The rows' fixed descriptions as arrays (module, module type, tensor, param as object arrays; whether
        each is a gradient), made once: a sampled step's columns index them."""
        if self._columns is None or len(self._columns["module"]) != len(self.info):
            self._columns = {
                "module": np.array([r.module for r in self.info], dtype=object),
                "module_type": np.array([r.module_type for r in self.info], dtype=object),
                "tensor": np.array([r.tensor for r in self.info], dtype=object),
                "param": np.array([r.param for r in self.info], dtype=object),
                "gradient": np.array([r.tensor in T.GRADIENT_KINDS for r in self.info], dtype=bool),
            }
        return self._columns


@dataclass
class _ModuleSlot:
    name: str
    module: nn.Module
    activation: int  # its rows (RowTable indices)
    activation_grad: int
    weights: list[tuple[str, nn.Parameter, int]]
    module_type: str = ""
    # its parameters recorded under another module (a tied or shared weight: the first owner's rows), by name:
    # that module's name
    shared: dict[str, str] = field(default_factory=dict)
    # its parameters whose first owner is a module not captured (a head tied to an embedding a module filter left
    # out): recorded here, and the owner named, by parameter name: (owner's name, owner's type)
    shared_outside: dict[str, tuple[str, str]] = field(default_factory=dict)
    gemm: bool = False  # a linear layer (taxonomy.is_linear_type)
    # a matmul whose input autocast casts (taxonomy.is_matmul_type: linear layers and convolutions): the
    # captured module whose output it read is recorded (``input_from``), block formats on or off
    reads_input: bool = False
    block_group: int = (
        0  # the sampled steps whose block-format what-if reads this module's operands (hooks.py)
    )
    # a matmul's input when no captured module produced it (T.input_module): the model's own batch, a function's
    # output; a norm's input when no captured module made it (``plan.reads_norm_input``; -1: neither)
    input: int = -1
    # the dtypes of the inputs that row reads (``plan.norm_input_dtypes``: a torch norm's fp16 inputs alone)
    input_dtypes: frozenset[torch.dtype] = frozenset()
    # whether its input gets the block-format what-if (a linear layer with block formats on; not a convolution)
    input_blocks: bool = False
    # the rows of the captured modules whose outputs its GEMM read as its input (``input`` has the others): what
    # the block what-if judges as the layer's input operand, and the tensors an fp16 autocast would cast to fp16
    # (summary capture.gemm_inputs)
    input_from: set[int] = field(default_factory=set)
    # a module whose output it read had run more often in a sampled step than it (``GemmInputs._made_again``):
    # it reads its own input (``input``) from then on
    maker_repeated: bool = False
    # its input row held a tensor the model itself was called with (summary capture.model_inputs): no module of
    # the model computed it, the layer reading it is the one to keep in fp32
    model_input: bool = False
    # per sampled step (reset by StepHooks): forward order of the module and of its input row (-1: not called;
    # a forward without grad counts: a reentrant checkpoint's first pass), and whether a forward with grad ran
    order: int = -1
    input_order: int = -1
    ran: bool = False
    # the row of the module whose output a reentrant checkpoint's first pass gave it (-1: none; -2: a norm's input
    # of a dtype its row leaves unread), for the recomputation's lookup (``StepHooks._first_pass_input``)
    first_from: int = -1
    # the shapes of its calls at the first sampled step it ran in (``call_shape``), for the modules whose output
    # does not tell their matmuls' (``calls_key``): listed under that key in summary capture.modules. None for others
    call_shapes: list[tuple[int, ...]] | None = None
    call_shapes_key: str = ""
    call_shapes_done: bool = False  # a sampled step before this one recorded them


@dataclass
class _ParamSlot:
    module: str
    param: str
    tensor: nn.Parameter
    grad_row: int  # -1: no gradient row (an integer parameter: it can have no gradient)
    update_index: int  # row in the weight-update buffer (-1: not tracked)
    sample_stride: int = 1
    sample_len: int = 0


@dataclass
class _PendingStep:
    step: int
    loss: torch.Tensor | float | None
    scale: torch.Tensor | float
    found_inf: torch.Tensor | None
    grad_norm: torch.Tensor | float | None
    time_s: float
    sampled: bool
    tokens: int | None
    reason: str = ""  # why the step was sampled (capture.sampling), "" when it was not
    cut_off: bool = False  # the step in progress when the profiler was detached mid-step (T.CUT_OFF)
    compiled: bool = False  # Dynamo compiled in the step, left out of the run's time (T.COMPILED)
    # of several optimizers under one scaler, those it skipped: sum of 2^k over their places k (T.SKIPPED_OPTIMIZERS)
    skipped_each: torch.Tensor | None = None


_PLAIN_TYPES = frozenset({torch.Tensor, nn.Parameter})


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallel), and the tensor inside a wrapper that holds the
    values as they are (torchao's float8 weight for FSDP2's all-gather, ``WeightWithDynamicFloat8CastTensor``:
    its ``data_ptr()`` is 0, its values those of the bf16 or fp32 tensor it wraps); any other tensor as it
    is (another wrapper subclass, such as torchao's NF4 weight, whose values are not in one tensor, is then
    skipped and counted: ``stats.buffer.unreadable``)."""
    to_local = getattr(t, "to_local", None)
    if callable(to_local):
        t = to_local()
    if type(t) in _PLAIN_TYPES or not hasattr(t, "__tensor_flatten__"):
        return t
    return _values_inside(t)


def _readable(t: torch.Tensor) -> torch.Tensor:
    """What the engines read of ``t``: a nested tensor's elements as one plain tensor (``_compat.nested_values``;
    one it cannot gather stays nested, to be skipped and counted: ``stats.buffer.unreadable``), else
    ``_local(t)``."""
    if t.is_nested:
        values = _compat.nested_values(t)
        return values if values is not None else t
    return t if type(t) in _PLAIN_TYPES else _local(t)


def _values_inside(t: torch.Tensor) -> torch.Tensor:
    """The one tensor inside wrapper ``t`` with ``t``'s shape and dtype, when every other tensor inside is a
    scalar (a scale); else ``t``."""
    try:
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = [x for x in (getattr(t, n, None) for n in names) if isinstance(x, torch.Tensor)]
    except Exception:  # a wrapper that cannot say what it holds
        return t
    same = [x for x in inner if x.shape == t.shape and x.dtype == t.dtype]
    if len(same) != 1 or any(x.numel() > 1 for x in inner if x is not same[0]):
        return t
    return _local(same[0])


def _same_data(t: torch.Tensor) -> tuple[Any, ...]:
    """What identifies a tensor's values without reading them (host metadata, no sync): a wrapper that hands a
    layer a new tensor object viewing the same memory (FSDP2's forward hooks do) still matches the output that
    made it, as long as that output is alive (a weakref to it is kept beside), so its memory is not reused. An
    empty tensor has no memory to view (its data pointer is 0, every empty tensor's): it is only itself."""
    try:
        if t.numel() == 0:
            return (id(t),)
        return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
    except (RuntimeError, NotImplementedError, TypeError):  # no storage to point at (a tensor subclass)
        return (id(t),)


def _iter_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Floating and complex tensors inside a module output (tensor, tuple/list, dict, ModelOutput, a
    dataclass), depth-limited. A complex one is yielded to be skipped and counted (``StatsBuffer.accumulate``):
    a module's output that precprof cannot read is said, not dropped without a word."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield obj
        return
    if depth > 3:
        return
    if isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _iter_tensors(o, depth + 1)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _iter_tensors(o, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _iter_tensors(getattr(obj, f.name, None), depth + 1)


def held_scalar(t: torch.Tensor) -> torch.Tensor | float | None:
    """A step's loss, kept until the next flush without a sync: its first element (None when it has none). A
    plain CPU tensor's is read at once, as a Python float (one op, which waits for nothing; the copy below took
    four small ops, 44 us of an unsampled ``prof.step()`` after a training step). A device tensor's is copied on
    the device: the value waits there for the next flush, and a loop may reuse the tensor (a loss accumulator
    zeroed in place after ``step()``: every unsampled step read 0)."""
    n = t.numel()
    if not n:
        return None
    if type(t) is torch.Tensor and t.is_cpu:  # (``t.device`` makes a device object: 22 us)
        return float(t.item() if n == 1 else t.reshape(-1)[0].item())
    return t.detach().clone() if t.dim() == 0 else t.detach().reshape(-1)[0].clone()


class HostFloats:
    """Python floats of a mix of None, numbers and 0-dim device tensors: the tensors are stacked (as float64,
    on the first one's device) into :attr:`device`, which the caller copies to the host with the rest of
    its data, then hands to :meth:`values`."""

    def __init__(self, values: list[Any]) -> None:
        self._out = [
            math.nan if v is None else (math.nan if isinstance(v, torch.Tensor) else float(v)) for v in values
        ]
        self._idx = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        self.device: torch.Tensor | None = None
        if self._idx:
            dev = values[self._idx[0]].device
            self.device = torch.stack(
                [values[i].detach().reshape(()).to(dev, torch.float64) for i in self._idx]
            )

    def values(self, host: np.ndarray | None) -> list[float]:
        """The floats, ``host`` being the host copy of :attr:`device` (None when that is None)."""
        out = list(self._out)
        if host is not None:
            for i, v in zip(self._idx, host.tolist(), strict=True):
                out[i] = float(v)
        return out


def after_closure(
    args: Any, kwargs: Any, fn: Callable[[], None], each: Callable[[], None] | None = None
) -> tuple[Any, Any] | None:
    """For an optimizer's step pre-hook (``args`` hold the optimizer first): the step's closure wrapped to call
    ``fn`` once, when it first returns, as the new (args, kwargs) the hook returns; None for a step without a
    closure. ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS) runs the forward and backward
    inside the step, after its pre-hooks: what they read of the step (its gradients, where the optimizer's phase
    begins) is there only once the closure has run, before any update (LBFGS calls it again after updates).
    ``each``: called at each evaluation (LBFGS's several, Lightning's one)."""
    if kwargs.get("closure") is not None:
        closure, where = kwargs["closure"], "kwargs"
    elif len(args) > 1 and callable(args[1]):
        closure, where = args[1], "args"
    else:
        return None
    done = False

    def wrapped() -> Any:
        nonlocal done
        if each is not None:
            each()
        out = closure()
        if not done:
            done = True
            fn()
        return out

    if where == "kwargs":
        return args, {**kwargs, "closure": wrapped}
    return (args[0], wrapped, *args[2:]), kwargs


def _weights_key(params: Sequence[torch.Tensor]) -> tuple[Any, ...] | None:
    """What decides where ``_read_weights`` reads each parameter (its type, dtype, device and size), read by
    C-level maps (a sampled step's parameters are hundreds of tensors); None when one is a wrapper subclass
    (DTensor: its local shard is a new object each step), whose reading is decided each time."""
    if not set(map(type, params)) <= _PLAIN_TYPES:
        return None
    return (
        tuple(map(attrgetter("dtype"), params)),
        tuple(map(attrgetter("device"), params)),
        tuple(map(torch.Tensor.numel, params)),
    )


def autocast_state(device_type: str) -> dict[str, Any]:
    """Whether autocast is on for ``device_type`` now, and its dtype."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if enabled else None
    except (AttributeError, TypeError, RuntimeError):
        enabled, dtype = False, None
    return {
        "enabled": bool(enabled),
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
        "device_type": device_type,
    }


def module_entries(plan: Any, trained: TrainedSeen) -> list[dict[str, Any]]:
    """summary.json's ``capture.modules``: ``module_entry`` of each module of ``plan`` (none without a plan)."""
    return [module_entry(slot, trained) for slot in (plan.modules if plan is not None else [])]


def module_entry(slot: _ModuleSlot, trained: TrainedSeen) -> dict[str, Any]:
    """A captured module as summary.json's ``capture.modules`` lists it: its name, type and parameters' shapes,
    those of its parameters frozen throughout (``frozen``: requires_grad False on every sampled step and when the
    summary is written, and no gradient on any sampled step; only where some are), per parameter whose
    requires_grad changed, its runs of sampled steps (``trainable_changed``: ``runs`` of ``[first, last,
    requires_grad, had_gradient]`` and ``end``, its requires_grad then; ``trained`` as the sampled steps saw
    them: ``capture/trainable.py``), the shapes of its calls where they were recorded (``call_shapes``, under its
    ``calls_key``), and an embedding's ``padding_idx`` where it has one (torch passes that row no gradient)."""
    entry: dict[str, Any] = {
        "name": slot.name,
        "type": slot.module_type,
        "params": {pname: list(p.shape) for pname, p, _ in slot.weights},
    }
    frozen = [pname for pname, p, _ in slot.weights if trained.frozen(slot.name, pname, p)]
    if frozen:
        entry["frozen"] = frozen
    changed = {pname: runs for pname, p, _ in slot.weights if (runs := trained.runs(slot.name, pname, p))}
    if changed:
        entry["trainable_changed"] = changed
    if slot.call_shapes:
        entry[slot.call_shapes_key] = [list(c) for c in slot.call_shapes]
    padding = getattr(slot.module, "padding_idx", None)
    if isinstance(slot.module, (nn.Embedding, nn.EmbeddingBag)) and isinstance(padding, int):
        entry["padding_idx"] = padding
    return entry


# the keys summary capture.modules lists the shapes of a module's calls under (``calls_key``)
ATTENTION_CALLS, INPUT_SHAPES = "attention_calls", "input_shapes"


def calls_key(module: nn.Module) -> str:
    """Under which key the shapes of ``module``'s calls are recorded, for the modules whose output does not tell
    the shapes of their matmuls ("" for the others): an nn.MultiheadAttention's (``attention_call``: a
    cross-attention's key and value projections and score matmuls read the memory's tokens, not the query's),
    a transposed convolution's input shape (its GEMM runs over its input's positions, which its stride and
    padding make fewer than its output's), a recurrent layer's input shape (its gates read every token of its
    input, which its output, holding the final states too, does not count alone)."""
    if isinstance(module, nn.MultiheadAttention):
        return ATTENTION_CALLS
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.RNNBase)):
        return INPUT_SHAPES
    return ""


def call_shape(slot: _ModuleSlot, module: nn.Module, args: Any, kwargs: Any, x: Any) -> tuple[int, ...]:
    """The shape of a call of ``slot``'s module with ``args`` and ``kwargs`` (``x``: its input) that its
    ``calls_key`` names; () where it cannot be read (a nested tensor). A recurrent layer's packed sequence: the
    shape of its data, (tokens, features)."""
    if slot.call_shapes_key == ATTENTION_CALLS:
        return attention_call(module, args, kwargs)
    if isinstance(x, nn.utils.rnn.PackedSequence):
        x = x.data
    return tuple(x.shape) if isinstance(x, torch.Tensor) and not x.is_nested else ()


def attention_call(module: nn.Module, args: Any, kwargs: Any) -> tuple[int, int, int]:
    """(batch, query length, key length) of a call of nn.MultiheadAttention ``module`` with ``args`` and
    ``kwargs`` (query and key by position or keyword; (L, N, E), (N, L, E) when batch_first, or unbatched (L, E));
    (0, 0, 0) where they cannot be read (a nested tensor)."""
    q = args[0] if args else (kwargs or {}).get("query")
    k = args[1] if len(args) > 1 else (kwargs or {}).get("key")
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.is_nested or k.is_nested:
        return 0, 0, 0
    if q.dim() == k.dim() == 2:
        return 1, q.shape[0], k.shape[0]
    if q.dim() != 3 or k.dim() != 3:
        return 0, 0, 0
    b = 0 if getattr(module, "batch_first", False) else 1
    return q.shape[b], q.shape[1 - b], k.shape[1 - b]


def input_keyword(module: nn.Module) -> str | None:
    """The name of the first argument of ``module``'s forward (``input`` for ``nn.Linear``): its input when the
    module is called with it by keyword (``self.fc(input=h)``). None when the forward has none it can name."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    first = params[0] if params else None
    if first is None or first.kind not in (first.POSITIONAL_OR_KEYWORD, first.KEYWORD_ONLY):
        return None
    return first.name


def sample_stride(numel: int, per_param: int, row: int) -> int:
    """The stride of a parameter's sample of at most ``per_param`` of its ``numel`` elements, whose rows (its
    elements along dimension 0: a weight's output features) are ``row`` long: the smallest stride that keeps within
    ``per_param`` and spreads the sample across the columns. Every column when the sample has as many elements as
    a row; else no gap between sampled columns over 2.5 times an even spread's (a 256 x 256 weight's stride of 256
    read its first column alone, and the stride one more, 257, read column k at sample k: the first 256 columns of
    any wider weight, a 768 x 768 one's first third; an embedding's first features, or a weight whose columns differ,
    stood for all of it). The sample's elements are every stride-th one: rows follow evenly. Made once per
    parameter, at attach (a few candidates, each one pass over at most ``per_param`` indices)."""
    base = max(1, -(-numel // per_param))
    if row <= 1 or base >= numel:
        return base
    best, best_gap = base, math.inf
    for stride in range(base, base + min(row, 4096) + 1):
        k = -(-numel // stride)
        cols = np.unique(np.arange(k, dtype=np.int64) * stride % row)
        if k >= row:  # a sample as long as a row: every column
            if len(cols) == row:
                return stride
            continue
        gap = float(np.diff(np.append(cols, cols[0] + row)).max()) * k / row  # 1: an even spread
        if gap <= 2.5:
            return stride
        if gap < best_gap:
            best, best_gap = stride, gap
    return best
