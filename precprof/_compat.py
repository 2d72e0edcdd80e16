"""Every private torch API precprof touches, in one place, each with the fallback for a torch without it.

When torch changes one of these, this is the one file to update; every function degrades to "unknown"
(None, empty) rather than failing, except where the fallback is stated.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import logging
import os
import sys
import traceback
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

_P = ParamSpec("_P")
_T = TypeVar("_T")

# ------------------------------------------------------------------------------------------- GradScaler


def scaler_enabled(scaler: Any) -> bool:
    """Whether a GradScaler scales at all (``GradScaler(enabled=False)`` passes everything through)."""
    return bool(getattr(scaler, "_enabled", True))


def scaler_growth_interval(scaler: Any) -> int | None:
    """A dynamic scaler's growth interval; None without a scaler, for a disabled one (``GradScaler(enabled=False)``
    has none: ``get_growth_interval()`` raises, as nanoGPT's scaler outside fp16), or one that does not say."""
    get = getattr(scaler, "get_growth_interval", None)
    if scaler is None or not callable(get) or not scaler_enabled(scaler):
        return None
    try:
        return int(get())
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None


def scaler_scale_tensor(scaler: Any) -> torch.Tensor | None:
    """The scaler's current scale as its device tensor (reading it does not sync); None before the first
    ``scale()`` call or for a disabled scaler."""
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) and scaler_enabled(scaler) else None


def scaler_scale_now(scaler: Any) -> torch.Tensor | float | None:
    """The scale the scaler's next ``scale()`` multiplies by, without a sync: its device tensor, or before its first
    ``scale()`` call (which makes that tensor) its ``init_scale``; None for a disabled scaler or one that does not say."""
    scale = scaler_scale_tensor(scaler)
    if scale is not None:
        return scale
    init = getattr(scaler, "_init_scale", None)
    return float(init) if isinstance(init, (int, float)) and scaler_enabled(scaler) else None


def scaler_found_inf(scaler: Any, optimizers: Sequence[Any] | None = None) -> list[torch.Tensor] | None:
    """The found-inf flags ``unscale_`` left per optimizer and device (what ``step()`` skips each optimizer's step
    on), before ``update()`` clears them: of every optimizer the scaler holds, or of ``optimizers`` only (None
    when the scaler has unscaled none of them since its last update; every one where this torch does not say
    which optimizer a flag is of)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return []
    if optimizers is not None:  # (``get``: the states are a defaultdict, which a lookup would fill)
        states = {k: s for k, s in ((id(o), states.get(id(o))) for o in optimizers) if s is not None}
        if not any(s.get("found_inf_per_device") for s in states.values()):
            return None
    found: list[torch.Tensor] = []
    for state in states.values():
        found.extend(state.get("found_inf_per_device", {}).values())
    return found


def scaler_found_inf_each(scaler: Any, optimizers: Sequence[Any]) -> list[list[torch.Tensor]]:
    """Of each of ``optimizers`` in turn, the found-inf flags ``unscale_`` left (one per device; none for one the
    scaler has not unscaled since its last update)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return [[] for _ in optimizers]
    # (``get``: the states are a defaultdict, which a lookup would fill)
    return [list(((states.get(id(o)) or {}).get("found_inf_per_device") or {}).values()) for o in optimizers]


class LowPrecisionGradScaler(torch.amp.GradScaler):
    """A GradScaler that accepts fp16 gradients (fp16-pure): they are unscaled in place, in fp16.

    torch's GradScaler refuses fp16 gradients because unscaling them in fp16 flushes values below 2^-24 to
    zero; in the pure mode that loss is part of what is being measured, as in apex's pure-fp16 (O3) mode.
    """

    def _unscale_grads_(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


# ------------------------------------------------------------------------------------------- autograd


def tensor_version(x: torch.Tensor) -> int | None:
    """The in-place version counter of ``x``; None for inference tensors, which have none."""
    try:
        return int(x._version)
    except RuntimeError:
        return None


def nested_values(x: torch.Tensor) -> torch.Tensor | None:
    """The elements of the nested tensor ``x`` (``torch.nested``, strided or jagged layout) as one plain tensor,
    one after another: ``(total, *rest)`` when they differ in their first dimension alone (a padded batch's
    sequences: a block of the last dimension is one element's, as in the tensor), else flat. Its values as they
    are, no copy, when its storage holds its elements alone, one after another; else a contiguous copy first (a
    view of one, a jagged tensor with holes). The sizes are host metadata: no sync. None when its layout cannot
    say (an op it lacks)."""
    try:
        if not x.is_contiguous():
            x = x.contiguous()
        values = x.values()
        if x.layout is torch.jagged:
            return values if x._ragged_idx == 1 else values.reshape(-1)  # type: ignore[attr-defined]
        sizes = x._nested_tensor_size()  # (elements, dims) on the host
        if (
            sizes.dim() == 2
            and sizes.shape[0] > 0
            and sizes.shape[1] >= 2
            and bool((sizes[:, 1:] == sizes[0, 1:]).all())
        ):
            return values.view(int(sizes[:, 0].sum()), *(int(n) for n in sizes[0, 1:]))
        return values.reshape(-1)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def shape_of(x: torch.Tensor) -> tuple[Any, ...]:
    """``x``'s shape, hashable; a strided nested tensor's (which has none: ``.shape`` raises) its elements'
    shapes (host metadata, no sync)."""
    if x.is_nested and x.layout is torch.strided:
        return tuple(map(tuple, x._nested_tensor_size().tolist()))
    return tuple(x.shape)


def coalesced_values(g: torch.Tensor) -> torch.Tensor:
    """The values of the sparse COO tensor ``g`` once coalesced, one row a distinct index with its duplicates
    summed (the vector norm of ``g``'s values is then ``g``'s norm), then zero rows to ``g``'s nnz. Without
    ``coalesce()``: it reads the count of distinct indices back to the host, a sync on a GPU. Fallback (a torch
    without ``_indices``/``_values``): ``g.coalesce().values()``."""
    try:
        if g.is_coalesced():
            return g._values()
        idx, vals = g._indices(), g._values()
    except (AttributeError, RuntimeError):
        return g.coalesce().values()
    if idx.shape[1] < 2:
        return vals
    flat = idx[0]
    for d in range(1, idx.shape[0]):  # each index as one number, in the sparse dimensions' row-major order
        flat = flat * g.shape[d] + idx[d]
    order = flat.argsort()
    ranked = flat[order]
    # each entry's place among the distinct indices (0, 1, ...): the count of changes before it, in sorted order
    group = torch.cat([ranked.new_zeros(1), (ranked[1:] != ranked[:-1]).cumsum(0)])
    return torch.zeros_like(vals).index_add_(0, group, vals[order])


def _functorch_wrapped_test() -> Callable[[torch.Tensor], bool]:
    """torch's test of whether a tensor is a ``torch.func`` transform's wrapper (``grad``'s, ``vmap``'s: a plain
    ``torch.Tensor`` to every other test, without a storage, whose ``data_ptr()`` raises); one that says no where
    this torch has none."""
    fn = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return fn if callable(fn) else lambda x: False


# whether ``x`` is a torch.func transform's wrapper (a C call: 0.4 us), asked of a tensor a hook is about to read
is_functorch_wrapped = _functorch_wrapped_test()

_NO_QUERY = object()


def top_saved_tensors_hooks() -> Any:
    """The (pack, unpack) pair on top of autograd's saved-tensor hook stack, None when the stack is empty, or
    ``NO_QUERY`` on a torch that cannot tell (then the caller assumes its own pair is on top)."""
    fn = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
    return fn(False) if fn is not None else _NO_QUERY


NO_QUERY = _NO_QUERY


def checkpoint_segment() -> Any:
    """The pack hook of the non-reentrant activation checkpoint whose first forward is running now (one object
    per checkpointed call: it names the segment), None outside one or where this torch does not say. Its
    ``_checkpoint_hook`` keeps only the segment's inputs; the backward pass runs the segment again to remake the
    rest."""
    top = top_saved_tensors_hooks()
    if top is None or top is _NO_QUERY:
        return None
    pack = top[0]
    name = getattr(pack, "__qualname__", "")
    return pack if name.startswith("_checkpoint_hook.") and pack.__module__ == _CHECKPOINT_MODULE else None


_CHECKPOINT_MODULE = "torch.utils.checkpoint"

# ------------------------------------------------------------------------------------------- FSDP


def fsdp_root_uses_orig_params(root: Any) -> bool:
    """FSDP1: whether the root was wrapped with ``use_orig_params=True``."""
    return bool(getattr(root, "_use_orig_params", False))


def default_store() -> Any:
    """The default process group's key-value store (under torchrun its rendezvous store, which outlives a rank
    that left); None without a group, or where this torch keeps it elsewhere. Reading it is no collective."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # no group, or no distributed support
        return None


def ddp_bucket_bytes(ddp: Any) -> int | None:
    """DDP: the bytes of its gradient buckets on this rank, the sum of the ``bucket_sizes`` (bytes, "a, b, ...")
    of its logging data, host-side facts it keeps (no sync). None where this torch does not give them
    (``_get_ddp_logging_data`` is a prototype interface)."""
    try:
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes")
        return sum(int(s) for s in str(sizes).split(",")) if sizes else None
    except Exception:  # another torch's DDP: no figure rather than a failed save
        return None


def join_enabled(obj: Any) -> bool:
    """Whether ``obj`` (a ``torch.distributed.algorithms.Joinable``: DDP, ZeroRedundancyOptimizer) was put in an
    enabled join context for uneven inputs (``model.join()``, ``Join([...])``): torch keeps that in the object's
    ``_join_config``, set when the context is made and never cleared. False for anything else."""
    return bool(getattr(getattr(obj, "_join_config", None), "enable", False))


def fsdp2_policy(module: Any) -> tuple[Any, Any]:
    """FSDP2 (``fully_shard``): the module's MixedPrecisionPolicy and its parameter group (either None when
    this torch keeps them elsewhere)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    state = get_state() if get_state is not None else None
    return getattr(state, "_mp_policy", None), getattr(state, "_fsdp_param_group", None)


# Modules whose forward is the forward of the one module they wrap, by class name, with the attribute that holds
# it: torch.compile's OptimizedModule, DDP, DataParallel, torch.distributed's activation-checkpoint wrappers, and
# Lightning Fabric's _FabricModule (``fabric.setup``'s; it holds the same module in ``_original_module`` too).
# precprof names a wrapped module as if the wrapper were not there (``module.layers.0`` under DDP, a block's
# ``_orig_mod`` under torch.compile are ``layers.0``), so that the same model reads the same with or without
# them and two such runs compare layer by layer. FSDP1's FullyShardedDataParallel is not among them: it owns the
# FlatParameter its layers' weights are views of.
_WRAPS = {
    "OptimizedModule": "_orig_mod",
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
    "OffloadWrapper": "_checkpoint_wrapped_module",
    "_FabricModule": "_forward_module",
}


def wrapped_attr(module: Any) -> str | None:
    """The attribute through which ``module`` wraps another module (see ``_WRAPS``); None for any other module."""
    attr = _WRAPS.get(type(module).__name__)
    children = getattr(module, "_modules", None)
    return (
        attr if attr is not None and isinstance(children, dict) and children.get(attr) is not None else None
    )


def named_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``model.named_modules()`` (each module once, in registration order) without the wrappers of ``_WRAPS``:
    a wrapped module takes its wrapper's name and the wrapper itself is left out."""
    clean: dict[str, str] = {}
    wraps: dict[str, str | None] = {}
    out = []
    for raw, module in model.named_modules():
        parent, _, last = raw.rpartition(".")
        if not raw:
            name = ""
        elif wraps.get(parent) == last:
            name = clean[parent]
        else:
            base = clean.get(parent, parent)
            name = f"{base}.{last}" if base else last
        clean[raw] = name
        wraps[raw] = wrapped_attr(module)
        if wraps[raw] is None:
            out.append((name, module))
    return out


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside the wrappers of ``_WRAPS`` and FSDP1's ``FullyShardedDataParallel`` at the root."""
    for _ in range(8):
        attr = wrapped_attr(model)
        if attr is None and type(model).__name__ == "FullyShardedDataParallel":
            attr = "_fsdp_wrapped_module"
        inner = getattr(model, attr, None) if attr else None
        if not isinstance(inner, torch.nn.Module) or inner is model:
            break
        model = inner
    return model


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer whose step hooks fire inside a training framework's wrapper of it: Fabric's _FabricOptimizer
    and Lightning's LightningOptimizer take its class and pass every attribute through to it (the hook registry
    too, so that they seem to have one), accelerate's AcceleratedOptimizer subclasses torch's Optimizer without
    one; each holds it in ``optimizer``. A wrapper is an object without a hook registry in its own ``__dict__``;
    an optimizer with one of its own is not unwrapped (a Lookahead that holds its base optimizer steps itself)."""
    for _ in range(8):
        if "_optimizer_step_pre_hooks" in getattr(optimizer, "__dict__", {}):
            break
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _wrappers(obj: Any) -> Iterator[Any]:
    """The framework wrappers around the user's model or optimizer ``obj`` (``_WRAPS``, ``unwrapped_optimizer``),
    outermost first; not the model or optimizer inside them."""
    for _ in range(8):
        attr = wrapped_attr(obj) if isinstance(obj, torch.nn.Module) else None
        inner = getattr(obj, attr, None) if attr else unwrapped_optimizer(obj) if obj is not None else None
        if inner is None or inner is obj:
            return
        yield obj
        obj = inner


def _held_scaler(wrapper: Any) -> tuple[Any, str]:
    """The GradScaler a framework's wrapper holds, and where: accelerate's AcceleratedOptimizer in ``scaler``,
    Fabric's _FabricModule and _FabricOptimizer in their strategy's precision plugin. Read from the wrapper's own
    ``__dict__``, never through the ``__getattr__`` by which it answers for the user's model or optimizer."""
    own = getattr(wrapper, "__dict__", {})
    precision = getattr(own.get("_strategy"), "precision", None)
    for scaler, where in (
        (own.get("scaler"), "scaler"),
        (getattr(precision, "scaler", None), "_strategy.precision.scaler"),
    ):
        if callable(getattr(scaler, "scale", None)) and callable(getattr(scaler, "update", None)):
            return scaler, where
    return None, ""


def wrapper_scaler(*given: Any) -> tuple[Any, str | None]:
    """The GradScaler that the wrapper of a given model or optimizer scales the loss with (Fabric's and accelerate's
    fp16 do it themselves, out of the loop's sight), with where it was found ("AcceleratedOptimizer.scaler");
    (None, None) where none holds one."""
    for obj in given:
        for wrapper in _wrappers(obj):
            scaler, where = _held_scaler(wrapper)
            if scaler is not None:
                return scaler, f"{type(wrapper).__name__}.{where}"
    return None, None


def _held_precision(wrapper: Any) -> tuple[str, str, str] | None:
    """The precision setting a framework's wrapper holds: (framework, setting, where). accelerate's
    AcceleratedOptimizer in its ``accelerator_state.mixed_precision`` ("no", "fp16", "bf16", "fp8"), Fabric's
    _FabricModule and _FabricOptimizer in their strategy's precision plugin's ``precision`` ("bf16-mixed",
    "32-true", ...). Read from the wrapper's own ``__dict__``, as ``_held_scaler`` reads; None where it holds
    none, or reading it failed (accelerate's state reset since)."""
    own = getattr(wrapper, "__dict__", {})
    for framework, holder, attr, where in (
        ("accelerate", own.get("accelerator_state"), "mixed_precision", "accelerator_state.mixed_precision"),
        (
            "Fabric",
            getattr(own.get("_strategy"), "precision", None),
            "precision",
            "_strategy.precision.precision",
        ),
    ):
        if holder is None:
            continue
        try:
            value = getattr(holder, attr, None)
        except Exception:  # a property of a state torn down: nothing said
            continue
        value = getattr(value, "value", value)  # an enum's value (accelerate's PrecisionType)
        if isinstance(value, str) and value:
            return framework, value, where
    return None


def wrapper_precision(*given: Any) -> tuple[str, str, str] | None:
    """The precision the wrapper of a given model or optimizer was set to train in, as (framework, its setting,
    where it was read: "AcceleratedOptimizer.accelerator_state.mixed_precision"), the first found in the order
    ``wrapper_scaler`` looks; None where no wrapper says one."""
    for obj in given:
        for wrapper in _wrappers(obj):
            held = _held_precision(wrapper)
            if held is not None:
                framework, value, where = held
                return framework, value, f"{type(wrapper).__name__}.{where}"
    return None


def drops(module: Any) -> bool:
    """Whether ``module`` is one of torch's dropout modules (``nn.Dropout``, ``Dropout1d/2d/3d``,
    ``AlphaDropout``, ...: their private base ``_DropoutNd``) with a drop probability above 0."""
    base = getattr(getattr(torch.nn.modules, "dropout", None), "_DropoutNd", None)
    p = getattr(module, "p", None)
    return base is not None and isinstance(module, base) and isinstance(p, (int, float)) and p > 0


def modules_and_parameters(model: torch.nn.Module) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``model.modules()`` and ``model.parameters()`` in one walk (the walk ``parameters()`` makes itself: each
    module's own ``_parameters``, each parameter once, at its first module): half the host time of the two."""
    modules = tuple(model.modules())
    params = (p for m in modules for p in m._parameters.values() if p is not None)
    return modules, tuple(dict.fromkeys(params))


def is_compile_wrapper(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (``OptimizedModule``): its forward is the wrapped
    module's, captured under the same name."""
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def global_numel(p: torch.Tensor) -> int:
    """The elements of the parameter(s) ``p`` stands for over every rank: an FSDP1 ``FlatParameter``'s
    original parameters (its own numel is this rank's shard, padding included: half the model on 2 ranks, which
    the advisor's model-size rules and ``compare``'s same-model check read); a DTensor's numel is global."""
    numels = getattr(p, "_numels", None)
    if isinstance(numels, (tuple, list)) and numels and all(isinstance(n, int) for n in numels):
        return int(sum(numels))
    return int(p.numel())


def shard_padding(t: torch.Tensor) -> int:
    """The elements FSDP1 pads at the end of this rank's shard of a ``FlatParameter`` (``_shard_numel_padded``)
    so that every rank holds as many: zeros no optimizer moves. 0 for any other tensor, and for a flat
    parameter not sharded now (its numel not its shard's, ``_sharded_size``)."""
    pad = getattr(t, "_shard_numel_padded", 0)
    sharded = getattr(t, "_sharded_size", None)
    if isinstance(pad, int) and pad > 0 and isinstance(sharded, torch.Size) and t.numel() == sharded.numel():
        return pad
    return 0


def flat_param_shard(p: torch.Tensor) -> torch.Tensor | None:
    """FSDP1 (``use_orig_params=False``): this rank's stored shard of a ``FlatParameter`` (``_local_shard``, the
    values the optimizer steps, in their storage dtype), without the padding at its end (``_shard_numel_padded``),
    whether the parameter is sharded now or gathered for the forward, when its ``.data`` is the whole unsharded
    parameter (its ``MixedPrecision`` param_dtype copy). Under ``NO_SHARD`` the shard is the whole parameter. A
    view, no copy and no sync. None for any other tensor, and before FSDP's lazy initialisation (first forward)."""
    shard = getattr(p, "_local_shard", None)
    pad = getattr(p, "_shard_numel_padded", None)
    if not isinstance(shard, torch.Tensor) or not isinstance(pad, int) or shard.dim() != 1:
        return None
    return shard[: shard.numel() - pad] if 0 < pad <= shard.numel() else shard


def is_compiled(module: Any) -> bool:
    """Whether ``module`` runs under ``torch.compile``: its wrapper, compiled in place (``module.compile()``
    sets the call it makes instead of its own), or its forward replaced by a compiled one (``module.forward =
    torch.compile(module.forward)``); not one ``torch.compiler.disable`` wraps (:func:`compile_disabled`), whose
    wrapper Dynamo marks as it marks a compiled one."""
    return not compile_disabled(module) and (
        is_compile_wrapper(module)
        or getattr(module, "_compiled_call_impl", None) is not None
        or _compiled_forward(module) is not None
    )


def _compiled_forward(module: Any) -> Any:
    """The compiled function an instance's ``forward`` was replaced by, or None."""
    forward = getattr(module, "__dict__", {}).get("forward")
    return forward if getattr(forward, "_torchdynamo_orig_callable", None) is not None else None


def compile_disabled(module: Any) -> bool:
    """Whether ``torch.compiler.disable`` keeps Dynamo off ``module``'s forward, which then runs eagerly inside a
    compiled model: its forward replaced by a disabled one (``m.forward = torch.compiler.disable(m.forward)``),
    its class's forward or the class itself decorated (that disables its ``_call_impl``), or the module wrapped
    (``torch.compiler.disable(module)``: Dynamo's wrapper with no compiler). Dynamo marks each such function
    ``_torchdynamo_disable``; a forward read without running a descriptor."""
    cls = type(module)
    for fn in (
        getattr(module, "__dict__", {}).get("forward"),
        inspect.getattr_static(cls, "forward", None),
        inspect.getattr_static(cls, "_call_impl", None),
    ):
        if getattr(fn, "_torchdynamo_disable", False) is True:
            return True
    ctx = getattr(module, "dynamo_ctx", None)
    return is_compile_wrapper(module) and ctx is not None and getattr(ctx, "callback", False) is None


def compile_backend(module: Any) -> str | None:
    """The name of the backend ``module`` is compiled with ("inductor", "eager", "aot_eager", a custom
    backend's function name), read from Dynamo's wrapper of it (``torch.compile(module)``) or from the call
    ``module.compile()`` set; None when it is not compiled or this torch keeps it elsewhere."""
    callback = getattr(getattr(module, "dynamo_ctx", None), "callback", None)
    if callback is None:
        call = getattr(module, "_compiled_call_impl", None) or _compiled_forward(module)
        for cell in getattr(call, "__closure__", None) or ():
            try:
                found = getattr(cell.cell_contents, "callback", None)
            except ValueError:  # an empty cell
                continue
            if found is not None:
                callback = found
                break
    backend = callback
    for _ in range(8):  # Dynamo's wrappers around the backend the user named
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        backend = inner
    if backend is None:
        return None
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return str(name) if name else None


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` as a tensor on it reports it: an accelerator with its index (``cuda`` -> ``cuda:N``, N the
    current device), the CPU without one (``cpu:0`` -> ``cpu``). State kept per device and keyed by this matches
    the tensors' own ``.device``, so ``cuda`` and ``cuda:0`` never make two entries."""
    d = torch.device(device)
    if d.type == "cpu":
        return torch.device("cpu")
    if d.index is not None or d.type == "meta":
        return d
    current = getattr(getattr(torch, d.type, None), "current_device", None)
    if callable(current):
        try:
            return torch.device(d.type, int(current()))
        except Exception:  # no such device here: leave the name as it is
            return d
    return d


# ------------------------------------------------------------------------------------------- memory


_CUDA_COUNTERS = (
    ("allocated_bytes", "current"),
    ("allocated_bytes", "peak"),
    ("reserved_bytes", "current"),
    ("reserved_bytes", "peak"),
    ("allocation", "allocated"),
    ("allocation", "freed"),
)


def cuda_memory_counters(index: int) -> dict[str, int]:
    """The CUDA caching allocator's counters of device ``index`` that precprof reads, by torch's flat names
    (``"allocated_bytes.all.current"``, ``...peak``, ``"reserved_bytes.all.current"``, ``...peak``,
    ``"allocation.all.allocated"``, ``...freed``); {} before CUDA is initialised. A host read, no sync.

    One call into torch's C++ (~25 us): ``torch.cuda.memory_stats`` (and ``memory_allocated`` etc., which call
    it) flattens and sorts every counter in Python (~400 us); at the hooks of a sampled gpt2-small step on an
    H100 that was 237 ms of a 670 ms step."""
    fn = getattr(torch._C, "_cuda_memoryStats", None)
    if fn is None:  # a torch without it: the public, slower read
        stats = torch.cuda.memory_stats(index)
        return {f"{g}.all.{k}": int(stats.get(f"{g}.all.{k}", 0)) for g, k in _CUDA_COUNTERS}
    if not torch.cuda.is_initialized():
        return {}
    nested = fn(index)
    return {f"{g}.all.{k}": int(nested.get(g, {}).get("all", {}).get(k, 0)) for g, k in _CUDA_COUNTERS}


def cuda_history_enabled() -> bool:
    """Whether the CUDA caching allocator is recording its history (anyone's ``_record_memory_history``);
    False on a torch that cannot tell."""
    fn = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(fn()) if fn is not None else False


# what the history need not record: a free's completion (the replay reads the request, where the allocator's
# allocated bytes drop) and the snapshot's own mark. A third of a step's entries fewer to record, convert into
# dicts and read: on an H200 a gpt2-small step's snapshot took 1.2 ms instead of 1.9 (2,108 entries, not 3,161)
HISTORY_SKIPPED = ("free_completed", "snapshot")


def cuda_record_history(on: bool, max_entries: int) -> None:
    """Turn the CUDA allocator's history of allocations and frees on (no stack traces, and none of the actions
    in ``HISTORY_SKIPPED`` where torch can leave them out: the cheap setting) or off (which also empties it). A
    host call: nothing waits for the device."""
    if on:
        record = torch.cuda.memory._record_memory_history
        try:
            record(
                "all",
                context=None,
                stacks="python",
                max_entries=max_entries,
                skip_actions=list(HISTORY_SKIPPED),
            )
        except TypeError:  # an older torch, without skip_actions (2.11 has it): every action
            record("all", context=None, stacks="python", max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(None)


def cuda_snapshot() -> dict[str, Any]:
    """The CUDA allocator's segments, blocks and recorded history (``torch.cuda.memory._snapshot()``); host
    only."""
    snap = torch.cuda.memory._snapshot()
    return snap if isinstance(snap, dict) else {}


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off through a block that makes many short-lived objects and lets
    them all go before it ends (the CUDA allocator's snapshot: a dict per event), then left as it was. While
    they are alive, their count sets off collections that move them into the oldest generation, and the
    oldest generation's growth sets off a full collection, which walks every object of the process: 70-220 ms
    with torch and transformers loaded on this machine's CPU. Freed before the collector is back, they leave
    its counts where they were."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def profiler_running() -> bool:
    """Whether a torch.profiler (or autograd profiler) is running in this thread."""
    fn = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    return bool(fn()) if fn is not None else False


def program_profiler_running() -> bool:
    """Whether a torch.profiler of the program's own runs (``torch.profiler.profile``,
    ``torch.autograd.profiler.profile``: the flag their start sets, which ``profiler_memory_start`` does not).
    One started while precprof's runs joins precprof's session, which stopping would end, its events with it."""
    module = sys.modules.get("torch.autograd.profiler")
    return bool(getattr(module, "_is_profiler_enabled", False))


def profiler_memory_start() -> None:
    """Start torch.profiler for memory events only: CPU activity, ``profile_memory=True``, no shapes, stacks
    or flops. Raises RuntimeError when it cannot (another profiler runs, no Kineto)."""
    from torch._C._profiler import (
        ProfilerActivity,
        ProfilerConfig,
        ProfilerState,
        RecordScope,
        _ExperimentalConfig,
    )

    cfg = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    activities = {ProfilerActivity.CPU}
    with _kineto_quiet():
        torch.autograd._prepare_profiler(cfg, activities)
        # only record_function ranges are recorded as ops (the phase markers), not every aten op: a tenth of
        # the events to collect; allocations are reported whatever the scopes
        torch.autograd._enable_profiler(cfg, activities, {RecordScope.USER_SCOPE})  # type: ignore[call-arg]


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """Kineto prints two lines per profiler start and stop (``USDT ... profiler_start``, ``profiler_stop``):
    two a sampled step in a loop's output. Its log level is read once, when the first profiler starts, from
    ``KINETO_LOG_LEVEL``: set (where the environment does not) for that start and taken back after, so the
    environment a program reads is unchanged. A profiler the program started first keeps its own level."""
    if _KINETO_LOG_LEVEL in os.environ:
        yield
        return
    os.environ[_KINETO_LOG_LEVEL] = "6"  # errors only
    try:
        yield
    finally:
        os.environ.pop(_KINETO_LOG_LEVEL, None)


_KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"


def profiler_memory_stop(marker: str) -> tuple[list[tuple[int, int, int, str]], list[int]]:
    """Stop what ``profiler_memory_start`` started. Returns the allocator events ((time ns, address, signed
    bytes: > 0 allocated, < 0 freed, device type)) and the start times of ``record_function(marker)`` ranges,
    both unordered."""
    from torch._C._profiler import _EventType

    result = torch.autograd._disable_profiler()
    allocs: list[tuple[int, int, int, str]] = []
    marks: list[int] = []
    stack = list(result.experimental_event_tree())
    while stack:
        e = stack.pop()
        kind = e.typed[0]
        fields: Any = e.typed[1]
        if kind == _EventType.Allocation:
            if fields.alloc_size:
                allocs.append(
                    (int(e.start_time_ns), int(fields.ptr), int(fields.alloc_size), fields.device.type)
                )
        elif kind == _EventType.TorchOp and e.name == marker:
            marks.append(int(e.start_time_ns))
        stack.extend(e.children)
    return allocs, marks


# ------------------------------------------------------------------------------------------ compile


def never_traced(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """``fn`` never traced by Dynamo: called from ``torch.compile``d code (``prof.step()`` inside a compiled
    train step), the graph breaks there and ``fn`` runs eagerly, as written. Traced, a step's bookkeeping could not
    turn the next sampled step eager (a stance cannot be set from inside a compiled region), and Dynamo traced the
    hooks and fed precprof's C kernel from traced code (a segfault). torch's own lazy form of
    ``torch.compiler.disable``, which imports torch._dynamo at the first call (any backward pass has by then),
    not at precprof's import (a second there).

    Outside compiled code (no Dynamo frame callback set, nothing being traced) ``fn`` is called as it is:
    Dynamo's wrapper, which sets and restores the callback around each call, cost 28 us of an unsampled
    ``prof.step()`` after a training step (3 us for the plain call). Dynamo, tracing this wrapper, reads
    ``is_compiling()`` as True and breaks the graph at the disabled call, as it did at ``fn``."""
    disable = getattr(torch, "_disable_dynamo", None)
    if disable is None:
        return fn
    disabled = disable(fn)
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    callback = getattr(frames, "get_eval_frame_callback", None)  # None outside a compiled region
    if callback is None:
        return disabled
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def outside_dynamo(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        if not is_compiling() and callback() is None:
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    return outside_dynamo


def force_eager() -> Any:
    """Run ``torch.compile``d code eagerly from now on (``torch.compiler.set_stance("force_eager")``), for a
    sampled step: its hooks then run as written, without graph breaks or recompiles, and the compiled graphs
    of the other steps stay as they are. Returns what :func:`restore_stance` needs; None when nothing was
    changed: Dynamo not loaded (then nothing is compiled), a torch without stances (before 2.6), a stance of
    force_eager already, or a call from inside a compiled region."""
    return _swap_stance(lambda now: now.stance != "force_eager", "force_eager")


def let_compile() -> Any:
    """The stance ``default`` in place of a ``fail_on_recompile`` in force (its other settings kept): for the
    step in which a compiled model compiles for the first time because precprof's sampled steps ran it eagerly,
    which without precprof would have compiled it before the loop forbade recompiles. Returns what
    :func:`restore_stance` needs to put ``fail_on_recompile`` back; None when no such stance is in force."""
    return _swap_stance(lambda now: now.stance == "fail_on_recompile", "default")


def _swap_stance(when: Callable[[Any], bool], stance: str) -> Any:
    """Set Dynamo's stance to ``stance`` (its other settings kept) if ``when(the stance now)``; returns the
    stance before and the one set, or None."""
    ef = sys.modules.get("torch._dynamo.eval_frame")
    if ef is None:
        return None
    try:
        prior = ef._stance
        if not when(prior):
            return None
        ours = ef.DynamoStance(stance, prior.skip_guard_eval_unsafe, prior.backend)
        ef._set_stance(ours)
        return prior, ours
    except (AttributeError, RuntimeError, TypeError):
        return None


def stance() -> Any:
    """Dynamo's stance in force now (an object the stance setters replace, never change); None while Dynamo
    is not loaded."""
    ef = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(ef, "_stance", None)


def compiles() -> int | None:
    """A count that moves whenever Dynamo compiles in this process (``torch._dynamo.utils.counters``): the frames
    it compiled (every compile and recompile, a failed one too) plus the graphs it made, since a ``fullgraph=True``
    frame moves the graphs alone (torch 2.13); None while Dynamo is not loaded (nothing compiled). Only its
    changes mean anything."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    try:
        counters = utils.counters
        return int(counters["frames"].get("total", 0)) + int(counters["stats"].get("unique_graphs", 0))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def compiled_entries() -> dict[types.CodeType, int] | None:
    """The code objects Dynamo holds compiled code for now (compiled since the last ``torch._dynamo.reset()``),
    each with its number of cache entries (one a compile its guards keep apart from the others): a frame a
    ``torch.compile``d function or model ran, and each frame a graph break resumed in. {} while Dynamo is not
    loaded; None on a torch without that record."""
    frames = sys.modules.get("torch._dynamo.convert_frame")
    if frames is None:
        return {}
    frame_ops = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    entries: Any = getattr(frame_ops, "_debug_get_cache_entry_list", None)
    try:
        codes = [ref() for ref in frames.input_codes.seen]
        counted = {code: len(entries(code)) for code in codes if isinstance(code, types.CodeType)}
    except (AttributeError, RuntimeError, TypeError):
        return None
    return {code: n for code, n in counted.items() if n}


_UNREAD: Any = object()  # (``compiled_code``'s entries not read yet)


def compiled_code(held: Any = _UNREAD) -> bool:
    """Whether Dynamo holds compiled code now: a code object it compiled since the last ``torch._dynamo.reset()``
    still has a cache entry (a model compiled and run before the Profiler attached). False while Dynamo is not
    loaded; on a torch without that record, whether :func:`compiles` ever moved. ``held``: what
    :func:`compiled_entries` returned just now (read again without it)."""
    if held is _UNREAD:
        held = compiled_entries()
    return bool(held) if held is not None else bool(compiles())


def restore_stance(token: Any) -> str | None:
    """Undo :func:`force_eager` or :func:`let_compile` (``token`` is what it returned), if the stance is still
    the one it set. A stance set since (the loop's own ``torch.compiler.set_stance``) is the loop's and stays:
    its name is returned (None otherwise). Restoring it unasked had undone a loop's ``fail_on_recompile`` for
    the rest of the run."""
    if token is None:
        return None
    prior, ours = token
    ef = sys.modules.get("torch._dynamo.eval_frame")
    if ef is None:
        return None
    now = getattr(ef, "_stance", None)
    if now is not ours:
        return str(getattr(now, "stance", ""))
    with contextlib.suppress(AttributeError, RuntimeError, TypeError):
        ef._set_stance(prior)
    return None


def traced_error(e: BaseException) -> tuple[BaseException, list[traceback.FrameSummary]]:
    """The model's own error under ``e`` and the frames of the model's code Dynamo was tracing when it raised
    ``e`` (its ``real_stack``, outermost first; the traceback holds Dynamo's frames only). A layer of the wrong
    width in a ``torch.compile``d model is refused while Dynamo runs it on fake tensors, which raises Dynamo's
    ``TorchRuntimeError`` ("RuntimeError when making fake tensor call", then a page of explanation), the
    model's RuntimeError ("a and b must have same reduction dim ...") the innermost of its contexts. ``(e,
    frames)`` for another of Dynamo's errors, ``(e, [])`` for any other error."""
    stack = getattr(e, "real_stack", None)
    frames = list(stack) if isinstance(stack, traceback.StackSummary) else []
    exc = sys.modules.get("torch._dynamo.exc")
    dynamos, fake_call = getattr(exc, "TorchDynamoException", None), getattr(exc, "TorchRuntimeError", None)
    if not (isinstance(dynamos, type) and isinstance(fake_call, type) and isinstance(e, fake_call)):
        return e, frames
    inner, seen = e, {id(e)}
    while inner.__context__ is not None and id(inner.__context__) not in seen:
        inner = inner.__context__
        seen.add(id(inner))
    return (inner if not isinstance(inner, dynamos) else e), frames


def torch_log_handlers() -> list[logging.Handler]:
    """The handlers that print torch's own log records on the terminal: the ``StreamHandler`` each logger torch
    registers (``torch``, ``torch._dynamo``, ``torch._inductor``...) gets from ``torch._logging`` (its
    ``TORCH_LOGS_OUT`` files, and handlers of anyone else's, left out); [] where this torch keeps no such set."""
    internal = sys.modules.get("torch._logging._internal")
    made = getattr(internal, "handlers", None)
    try:
        return [h for h in list(made or ()) if type(h) is logging.StreamHandler]
    except TypeError:  # not a collection of handlers in this torch
        return []


# ------------------------------------------------------------------------------------------- hooks


def queue_backward_callback(fn: Any) -> bool:
    """Run ``fn()`` when the backward pass now running ends (autograd's own queue, which DDP and FSDP use too);
    False when it cannot be queued (no backward is running, or this torch has no such queue)."""
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return False
    try:
        queue(fn)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    return True


_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)
_TOP_SAVED_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def object_collective_device(group: Any) -> torch.device:
    """The device torch's object collectives (``all_gather_object``) put their tensors on for ``group``: "cpu"
    under gloo, the current CUDA device under NCCL (``distributed_c10d._get_object_coll_device``); where this
    torch does not have it, CUDA's current device when CUDA runs, else the CPU."""
    import torch.distributed.distributed_c10d as c10d

    pick = getattr(c10d, "_get_object_coll_device", None)
    if pick is not None:
        return torch.device(pick(group))
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def backward_pass_id() -> int | None:
    """The id of the backward pass now running (autograd's graph task: a new one each ``backward()``, a nested
    one for a reentrant checkpoint's), None outside one or where this torch does not say."""
    if _GRAPH_TASK is None:
        return None
    task = int(_GRAPH_TASK())
    return task if task >= 0 else None


def recomputing() -> bool:
    """Whether a non-reentrant activation checkpoint (``torch.utils.checkpoint(use_reentrant=False)``, torch's
    default and Hugging Face's gradient checkpointing) is running its block's forward again, inside a backward
    pass, to remake what it did not keep: the modules it runs ran in the step's forward, whose outputs were
    read then (the same values). Told by the saved-tensor hooks it pushes for that run (``_recomputation_hook``,
    on top of the stack); False outside a backward pass, and where this torch does not say. A reentrant
    checkpoint's forward runs under ``no_grad`` and its recomputation is the only run the hooks read."""
    if _GRAPH_TASK is None or _TOP_SAVED_HOOKS is None or _GRAPH_TASK() < 0:  # (every forward hook asks)
        return False
    try:
        top = _TOP_SAVED_HOOKS(False)
    except (RuntimeError, TypeError):
        return False
    if (
        not top
    ):  # no hooks: a reentrant checkpoint's recomputation (its first forward ran without grad), or none
        return False
    if "_recomputation_hook" in getattr(top[0], "__qualname__", ""):
        return True
    # someone's hooks over the recomputation's: a checkpoint nested in the block (its own pair, pushed again as
    # the block is recomputed), ``save_on_cpu()`` inside it. The recomputation is a frame further up
    frame: Any = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "recompute_fn" and code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
    return False


def reentrant_first_pass() -> bool:
    """Whether a reentrant activation checkpoint (``checkpoint(use_reentrant=True)``) is running its block's
    first forward (without grad), which the backward pass runs again with grad: its ``CheckpointFunction.forward``
    is a frame up the stack, and autograd records its node (``ctx.next_functions``; none under ``no_grad`` or
    without an input that requires grad: then no backward runs it again, and this pass is the only one). A
    checkpoint without a node inside another's first pass (itself under that one's ``no_grad``) runs again
    with the outer one: every enclosing checkpoint is asked. Only asked for forwards without grad inside a
    model's forward with grad, or inside a backward pass (an outer checkpoint running its block again)."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            ctx = frame.f_locals.get("ctx")
            try:
                if ctx is None or ctx.next_functions:
                    return True
            except (AttributeError, RuntimeError):
                return True
        frame = frame.f_back
    return False


def reentrant_segment() -> Any:
    """The autograd context of the innermost reentrant activation checkpoint (``checkpoint(use_reentrant=True)``)
    whose first forward (without grad) is running now and which the backward pass will run again with grad (its
    node has next functions, as in ``reentrant_first_pass``): one object per checkpointed call, naming the
    segment. None outside one, and where this torch does not say (its ``CheckpointFunction.forward`` is not a
    frame up the stack)."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            ctx = frame.f_locals.get("ctx")
            try:
                return ctx if ctx is not None and ctx.next_functions else None
            except (AttributeError, RuntimeError):
                return None
        frame = frame.f_back
    return None


_MODULE_CALL = getattr(torch.nn.Module._call_impl, "__code__", None)


def calls_on_stack(module: torch.nn.Module) -> int:
    """How many calls of ``module`` are running on this thread: the frames of torch's ``Module._call_impl`` for it
    up the stack (a hook of the module counts the call it runs in). 0 where this torch's calls leave no such frame.
    A walk of the whole stack: asked only when a model's call begins inside one its hooks recorded."""
    found = 0
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _MODULE_CALL and frame.f_locals.get("self") is module:
            found += 1
        frame = frame.f_back
    return found


def _checkpoint_file() -> str:
    """The file of ``torch.utils.checkpoint``, whose non-reentrant ``recompute_fn`` runs a block again."""
    import torch.utils.checkpoint

    return torch.utils.checkpoint.__file__


_CHECKPOINT_FILE = _checkpoint_file()
_REENTRANT_FORWARD = getattr(
    getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "forward", None), "__code__", None
)


# selective activation checkpointing's forward mode (``create_selective_checkpoint_contexts``), which keeps the
# outputs of the ops its policy saves in a cache of its own, out of autograd's saved-tensor hooks
_CACHING_MODE = getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None)
_DISPATCH_DEPTH = getattr(torch._C, "_len_torch_dispatch_stack", None)
_DISPATCH_AT = getattr(torch._C, "_get_dispatch_stack_at", None)


def policy_caches() -> list[Any]:
    """The caches of the selective activation checkpoints whose forward is running now (each the ``storage`` of
    a ``_CachingTorchDispatchMode`` on the dispatch mode stack, innermost last): per op, the outputs its policy
    keeps for the backward pass, each in a ``_VersionWrapper`` (``.val``), in the order the op ran (a dict of
    them by call index; a list on torch 2.4). Empty when none runs, or where this torch does not say."""
    if _CACHING_MODE is None or _DISPATCH_DEPTH is None or _DISPATCH_AT is None:
        return []
    n = _DISPATCH_DEPTH()
    if not n:  # (every module's forward asks on a sampled step: one C call)
        return []
    modes = (_DISPATCH_AT(i) for i in range(n))
    return [m.storage for m in modes if isinstance(m, _CACHING_MODE) and isinstance(m.storage, dict)]


def cached_tensors(entry: Any) -> list[torch.Tensor]:
    """The tensors of one entry of a ``policy_caches`` cache: an op's outputs, each in a ``_VersionWrapper``, in
    the op's own nesting (a tuple, a list); none for an op the policy recomputes, or one the backward used."""
    if isinstance(entry, (tuple, list)):
        return [t for e in entry for t in cached_tensors(e)]
    val = getattr(entry, "val", None)
    return [val] if isinstance(val, torch.Tensor) else []


def reserve_hook_ids(n: int) -> range:
    """``n`` hook ids of ``RemovableHandle``'s counter, for hooks added straight into torch's hook dictionaries:
    no one else's hook gets them."""
    first = RemovableHandle.next_id
    RemovableHandle.next_id += n
    return range(first, RemovableHandle.next_id)


def add_grad_hook(t: torch.Tensor, hook_id: int, hook: Any) -> None:
    """``t.register_hook(hook)`` under ``hook_id`` (from :func:`reserve_hook_ids`) without the
    ``RemovableHandle`` it makes and returns (3.2 us a call against 0.8 us, on every module output of a sampled
    step): for a plain tensor that requires grad, what ``Tensor.register_hook`` does, step by step; anything
    else through it. The hook stays as long as ``t`` does, as a registered hook whose handle is dropped."""
    if type(t) is not torch.Tensor or not hasattr(t, "_backward_hooks"):
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:  # (OrderedDict imported once, at module level: an import per output cost 0.3 us)
        t._backward_hooks = hooks = OrderedDict()
        fn = t.grad_fn
        if fn is not None:
            fn._register_hook_dict(t)
    hooks[hook_id] = hook


# what a copy of a module holds in place of a hook of precprof's (``uncopied``)
_NO_OP_HOOK = contextlib.nullcontext().__exit__


def _copied_hook(memo: Any) -> Any:
    return _NO_OP_HOOK


def _pickled_hook(protocol: Any) -> Any:
    return getattr, (contextlib.nullcontext(), "__exit__")


_LEFT_BEHIND_BY_COPIES = {"__deepcopy__": _copied_hook, "__reduce_ex__": _pickled_hook}


def uncopied(hook: Callable[_P, _T]) -> Callable[_P, _T]:
    """``hook``, called as it is, in a form that a copy of the module it is on leaves behind.

    A copy of a module (``copy.deepcopy``: ``AveragedModel``'s SWA or EMA copy, a "best model so far"; pickle:
    ``torch.save(model)``) copies its hook dictionaries, and with them any hook of precprof's in place then
    (during a sampled step, and between two sampled steps in a row, which keep them). Copied, a hook failed the
    copy (a closure does not pickle; a bound method deep-copied precprof's state, ctypes pointers and all) or
    would have tied the copy to the Profiler. A module holding such hooks has its hook dictionaries copied
    without them (:class:`CopiesLeaveOut`); where a dictionary is copied some other way (``OrderedDict(d)``,
    then a copy of that), the hook itself is a ``functools.partial`` whose ``__deepcopy__`` and
    ``__reduce_ex__``, which ``copy`` and ``pickle`` look up on the object itself, give the copy a no-op of the
    standard library instead: ``nullcontext().__exit__`` takes any arguments and returns None, as a hook that
    changes nothing must. The copy is not profiled, holds nothing of precprof's, and a pickled model loads where
    precprof is not installed. A partial calls its function straight from C: about 20 ns more a call."""
    wrapped = functools.partial(hook)
    wrapped.__dict__ = _LEFT_BEHIND_BY_COPIES  # one dictionary for all: nothing is ever set in it
    return wrapped


def _is_uncopied(hook: Any) -> bool:
    return type(hook) is functools.partial and hook.__dict__ is _LEFT_BEHIND_BY_COPIES


# a module's dictionary of hooks for each that flags some of them by id (the hooks' options)
_FLAGS_OF = {
    "_forward_pre_hooks_with_kwargs": "_forward_pre_hooks",
    "_forward_hooks_with_kwargs": "_forward_hooks",
    "_forward_hooks_always_called": "_forward_hooks",
}


class _CopiedWithout:
    """The ``__deepcopy__`` and the ``__reduce_ex__`` of one dictionary of a module's hooks (or of the flags of
    some of them: ``with_kwargs``, ``always_call``) while it holds hooks of precprof's: a copy, deep or by
    pickle, is a plain ``OrderedDict`` of the entries that are not precprof's. ``copy`` and ``pickle`` look both
    up on the object itself, so they are instance attributes of the dictionary: however the module is copied
    (torch's ``Module.__getstate__``, or a class's own ``__deepcopy__`` or ``__getstate__`` that copies its
    ``__dict__``), its dictionaries are copied by them, and their copies hold nothing of precprof's. One object
    for both names (``copy`` passes the memo, a dict; ``pickle`` the protocol, an int)."""

    __slots__ = ("hooks", "target")

    def __init__(self, target: OrderedDict[Any, Any], hooks: OrderedDict[Any, Any]) -> None:
        self.target = weakref.ref(target)
        self.hooks = weakref.ref(hooks)  # the hooks it holds, or flags

    def _entries(self) -> list[tuple[Any, Any]]:
        target, hooks = self.target(), self.hooks()
        ours = {k for k, h in hooks.items() if _is_uncopied(h)} if hooks is not None else set()
        return [(k, v) for k, v in target.items() if k not in ours] if target is not None else []

    def __call__(self, memo_or_protocol: Any) -> Any:
        if not isinstance(memo_or_protocol, dict):  # pickle, copy.copy: a reduce, as OrderedDict's own
            return OrderedDict, (), None, None, iter(self._entries())
        memo = memo_or_protocol
        out: OrderedDict[Any, Any] = OrderedDict()
        memo[id(self.target())] = out
        for k, v in self._entries():
            out[copy.deepcopy(k, memo)] = copy.deepcopy(v, memo)
        return out


class CopiesLeaveOut:
    """Copies of the modules of ``where`` (``copy.deepcopy``, pickle) leave out their hooks of precprof's
    (``uncopied``) and those hooks' flags, in the dictionaries named beside each module (``_forward_hooks``,
    ``_forward_hooks_always_called``...), from :meth:`put` until :meth:`take` once the hooks are gone: a copy
    made during a sampled step held one no-op per hook forever, every forward of it through torch's hooks path,
    and ``torch.jit.script`` of it failed on them ("Compiled functions can't take variable number of
    arguments"). Several users of one module (two Profilers, a callback's hook) share what the first put there;
    it comes off a dictionary of hooks and its flags' when no hook of precprof's is left in it. Made once, for
    the modules' dictionaries as they are (one the module is given later leaves the hooks' no-ops in copies,
    ``uncopied``): putting it on and taking it off are two entries a dictionary."""

    def __init__(self, where: Sequence[tuple[Any, Sequence[str]]]) -> None:
        # the dictionaries named: each one's own attributes, and what copies it
        self._put: list[tuple[dict[str, Any], _CopiedWithout]] = []
        # per dictionary of hooks named or flagged: it, and its own attributes and all its flags' (anyone's)
        self._take: list[tuple[OrderedDict[Any, Any], list[dict[str, Any]]]] = []
        for module, names in where:
            state = getattr(module, "__dict__", {})
            for name in names:
                target, held = state.get(name), state.get(_FLAGS_OF.get(name, name))
                if type(target) is OrderedDict and type(held) is OrderedDict:
                    self._put.append((target.__dict__, _CopiedWithout(target, held)))
            for name in dict.fromkeys(_FLAGS_OF.get(n, n) for n in names):
                held = state.get(name)
                family = [held, *(state.get(f) for f, of in _FLAGS_OF.items() if of == name)]
                if type(held) is OrderedDict:
                    self._take.append((held, [d.__dict__ for d in family if type(d) is OrderedDict]))

    def put(self) -> None:
        """On each dictionary named that has none yet."""
        for own, guard in self._put:
            if "__deepcopy__" not in own:
                own["__deepcopy__"] = own["__reduce_ex__"] = guard

    def take(self) -> None:
        """Off each dictionary of hooks named that holds none of precprof's any more, and off its flags'."""
        for held, owns in self._take:
            if any(map(_is_uncopied, held.values())):
                continue  # (another part's, a callback's, still there)
            for own in owns:
                if own and isinstance(own.get("__deepcopy__"), _CopiedWithout):
                    del own["__deepcopy__"], own["__reduce_ex__"]


class UncopiedHook:
    """A forward hook of precprof's on one module (``register_uncopied``), which copies of the module leave out;
    ``remove()`` as a ``RemovableHandle``'s."""

    def __init__(self, handle: Any, copies: CopiesLeaveOut) -> None:
        self._handle = handle
        self._copies: CopiesLeaveOut | None = copies
        copies.put()

    def remove(self) -> None:
        if self._copies is not None:
            self._handle.remove()
            self._copies.take()
            self._copies = None


def register_uncopied(module: Any, hook: Callable[..., Any], *, pre: bool, **kwargs: Any) -> UncopiedHook:
    """``module.register_forward_pre_hook(hook, **kwargs)`` (``pre``) or ``register_forward_hook``, left out of
    copies of the module (``uncopied``, ``CopiesLeaveOut``)."""
    register = module.register_forward_pre_hook if pre else module.register_forward_hook
    handle = register(uncopied(hook), **kwargs)
    hooks = "_forward_pre_hooks" if pre else "_forward_hooks"
    names = _hook_dicts(hooks, bool(kwargs.get("with_kwargs")), bool(kwargs.get("always_call")))
    return UncopiedHook(handle, CopiesLeaveOut([(module, names)]))


def _hook_dicts(hooks: str, kwargs: bool, always: bool) -> list[str]:
    """The dictionaries of a module that a hook put in ``hooks`` (``_forward_pre_hooks``, ``_forward_hooks``)
    and its flags go into."""
    pre = hooks == "_forward_pre_hooks"
    names = [hooks]
    if kwargs:
        names.append("_forward_pre_hooks_with_kwargs" if pre else "_forward_hooks_with_kwargs")
    if always and not pre:
        names.append("_forward_hooks_always_called")
    return names


class HookSet:
    """Module forward hooks and parameter post-accumulate-grad hooks installed and removed in bulk, once per
    sampled step: straight into the hook dictionaries that ``register_forward_pre_hook``,
    ``register_forward_hook`` and ``register_post_accumulate_grad_hook`` fill, under ids reserved once from
    ``RemovableHandle``'s counter (so they never collide with anyone's), without a ``RemovableHandle`` per hook
    per step (thousands of objects per sampled step, and the garbage collections they set off). Where a torch
    lacks those dictionaries, the public ``register_*`` calls and their handles. A frozen parameter's hook is
    kept in its dictionary too, and fires once the parameter is unfrozen (gradual unfreezing). A copy of a
    module leaves its hooks out (:class:`CopiesLeaveOut`, :func:`uncopied`); a copy of a parameter never takes
    its hooks (torch's ``Parameter.__deepcopy__`` and ``__reduce_ex__`` leave them).

    The modules' hooks can step aside for a while, the parameters' staying (:meth:`step_aside`, :meth:`step_back`):
    torch's fast paths (``nn.TransformerEncoderLayer``'s in eval mode) refuse a module holding any forward hook,
    and an evaluation run through those hooks gave other values than the same one without precprof.

    Each hook runs after every other hook of its dictionary, whenever that one was registered (:meth:`keep_last`):
    precprof reads what the next layer is fed and the gradient that reaches it, past the user's hooks, as it
    does of hooks registered before ``attach()``."""

    def __init__(
        self,
        modules: list[tuple[Any, Any, Any, bool]],
        params: list[tuple[torch.Tensor, Any]],
        kwargs_pre: Any = None,
        kwargs_entries: Sequence[int] = (),
    ) -> None:
        # (module, pre-hook or None, forward hook or None, always_call)
        self._modules = [
            (
                m,
                uncopied(pre) if pre is not None else None,
                uncopied(post) if post is not None else None,
                always,
            )
            for m, pre, post, always in modules
        ]
        self._params = params  # (parameter, hook)
        # the entries whose pre-hook also takes the forward's keyword arguments, (module, args, kwargs): the first
        # of the module ``kwargs_pre`` (a model that is one captured layer has a second, which need not) and
        # those of ``kwargs_entries``
        first = next((k for k, (m, _, _, _) in enumerate(modules) if m is kwargs_pre), None)
        self._kwargs_at = set(kwargs_entries) | ({first} if first is not None else set())
        self._ids = reserve_hook_ids(2 * len(modules) + len(params))
        self._direct = all(
            isinstance(getattr(m, "_forward_pre_hooks", None), dict)
            and isinstance(getattr(m, "_forward_pre_hooks_with_kwargs", None), dict)
            and isinstance(getattr(m, "_forward_hooks", None), dict)
            and isinstance(getattr(m, "_forward_hooks_always_called", None), dict)
            for m, _, _, _ in modules
        ) and all(hasattr(p, "_post_accumulate_grad_hooks") for p, _ in params)
        self._handles: list[Any] = []  # (the parameters' hooks where they are registered by the public calls)
        self._module_handles: dict[int, list[Any]] = {}  # (and the modules', by entry)
        self._off: set[int] = set()  # the entries whose hooks stepped aside (``step_aside``)
        self._entries_of: dict[int, list[int]] | None = (
            None  # a module's id -> its entries (``take_modules``)
        )
        # put on and taken off with the hooks: the dictionaries they and their flags go into
        where: list[tuple[Any, list[str]]] = []
        for k, (m, pre, post, always) in enumerate(modules):
            names = _hook_dicts("_forward_pre_hooks", k in self._kwargs_at, False) if pre is not None else []
            where.append(
                (m, names + (_hook_dicts("_forward_hooks", False, always) if post is not None else []))
            )
        self._copies = CopiesLeaveOut(where)
        self.installed = False
        # ``RemovableHandle``'s counter when the hooks were last known to be behind every other (``keep_last``)
        self._ids_seen = -1
        _HOOK_SETS.add(self)

    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        self._copies.put()
        for k in range(len(self._modules)):
            self._put(k)
        if not self._direct:
            for p, hook in self._params:
                # the public call refuses a frozen parameter: hooked at the first install after it is unfrozen
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(hook))
            return
        ids = iter(self._ids[2 * len(self._modules) :])
        for p, hook in self._params:
            hooks = p._post_accumulate_grad_hooks
            if hooks is None:
                hooks = p._post_accumulate_grad_hooks = OrderedDict()
            hooks[next(ids)] = hook
        self._ids_seen = RemovableHandle.next_id  # (each hook now at the end of its dictionary)

    def remove(self) -> None:
        if not self.installed:
            return
        self.installed = False
        for k in range(len(self._modules)):
            self._take(k)
        self._off.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._direct:
            for (p, _), i in zip(self._params, self._ids[2 * len(self._modules) :], strict=True):
                hooks = p._post_accumulate_grad_hooks
                if hooks is not None:
                    hooks.pop(i, None)
        self._copies.take()

    def step_aside(self, keep: Any = None) -> None:
        """The installed modules' forward hooks come off until :meth:`step_back`, but ``keep``'s (the model's own,
        whose post-hook puts them back) and the parameters' hooks: a dictionary entry each."""
        if not self.installed:
            return
        for k, (m, _, _, _) in enumerate(self._modules):
            if m is not keep and k not in self._off:
                self._off.add(k)
                self._take(k)

    def take_modules(self, ids: set[int]) -> list[int]:
        """The installed entries of the modules whose ids are ``ids``, not aside already, taken off until
        :meth:`put_modules` (``fused_path_aside``); returns them."""
        if not self.installed:
            return []
        if self._entries_of is None:
            self._entries_of = {}
            for k, (m, _, _, _) in enumerate(self._modules):
                self._entries_of.setdefault(id(m), []).append(k)
        taken = [k for i in ids for k in self._entries_of.get(i, ()) if k not in self._off]
        for k in taken:
            self._off.add(k)
            self._take(k)
        return taken

    def put_modules(self, entries: Sequence[int]) -> None:
        """The entries :meth:`take_modules` took off, back in place (those a :meth:`step_back` or :meth:`remove`
        has not seen to since)."""
        back = [k for k in entries if k in self._off]
        self._off.difference_update(back)
        if self.installed:
            for k in back:
                self._put(k)

    def step_back(self) -> None:
        """The hooks ``step_aside`` took off, back in place (in each dictionary after any hook added since); the
        global hooks of fused calls that raised removed (``fused_path_aside``)."""
        _remove_spent()
        off, self._off = self._off, set()
        if off and self.installed:
            for k in sorted(off):
                self._put(k)

    def keep_last(self) -> None:
        """Each installed hook moved behind any hook added after it to its dictionary (precprof's other hooks
        aside), by a re-insertion: it runs after the user's hooks, registered before ``attach()`` or after. A
        forward hook registered after attach that replaces the output (``out * 2``) ran after precprof's read on
        the first sampled step, whose hooks went in at attach, and before it on the next ones, whose hooks went
        back in at the end of each dictionary (as they do after an evaluation under no_grad takes them aside); a
        pre-hook that replaces the input too, and a parameter's hook that changes its gradient where precprof reads
        it in its own hook (torch.distributed). Called before each forward of the model; nothing to do, the usual
        case, while ``RemovableHandle``'s counter, which every hook registered through torch moves, is where it
        was (one comparison). Where this torch has no hook dictionaries, hooks run in the order registered."""
        added = RemovableHandle.next_id
        if added == self._ids_seen or not self.installed:
            return
        self._ids_seen = added
        if not self._direct:
            return
        # (each dictionary's last key looked at first: a scan that moves nothing is 0.1 us an entry)
        ids = iter(self._ids)
        for m, pre, post, _ in self._modules:
            i, j = next(ids), next(ids)
            if pre is not None and (hooks := m._forward_pre_hooks) and next(reversed(hooks)) != i:
                _behind_others(hooks, i)
            if post is not None and (hooks := m._forward_hooks) and next(reversed(hooks)) != j:
                _behind_others(hooks, j)
        for (p, _), i in zip(self._params, ids, strict=True):
            hooks = p._post_accumulate_grad_hooks
            if hooks and next(reversed(hooks)) != i:
                _behind_others(hooks, i)

    def _put(self, k: int) -> None:
        """Entry ``k``'s forward hooks into its module's dictionaries (by the public calls where torch has none)."""
        m, pre, post, always = self._modules[k]
        if not self._direct:
            handles = self._module_handles.setdefault(k, [])
            if pre is not None:
                handles.append(m.register_forward_pre_hook(pre, with_kwargs=k in self._kwargs_at))
            if post is not None:
                handles.append(m.register_forward_hook(post, always_call=always))
            return
        i, j = self._ids[2 * k], self._ids[2 * k + 1]
        if pre is not None:
            m._forward_pre_hooks[i] = pre
            if k in self._kwargs_at:
                m._forward_pre_hooks_with_kwargs[i] = True
        if post is not None:
            m._forward_hooks[j] = post
            if always:
                m._forward_hooks_always_called[j] = True

    def _take(self, k: int) -> None:
        """Entry ``k``'s forward hooks out of its module's dictionaries (none there: nothing)."""
        if not self._direct:
            for h in self._module_handles.pop(k, []):
                h.remove()
            return
        m = self._modules[k][0]
        i, j = self._ids[2 * k], self._ids[2 * k + 1]
        m._forward_pre_hooks.pop(i, None)
        m._forward_pre_hooks_with_kwargs.pop(i, None)
        m._forward_hooks.pop(j, None)
        m._forward_hooks_always_called.pop(j, None)


# every HookSet alive, whose hooks (ids) ``keep_last`` of another does not pass
_HOOK_SETS: weakref.WeakSet[HookSet] = weakref.WeakSet()


def _precprofs(key: int, hook: Any) -> bool:
    """Whether a hook dictionary's entry is precprof's: a module's (``uncopied``) or a HookSet's parameter's."""
    return _is_uncopied(hook) or any(key in s._ids for s in _HOOK_SETS)


# torch's modules whose forward takes a fused path only when no module of theirs holds a forward (pre-)hook
_FUSED_TYPES: tuple[type[torch.nn.Module], ...] = (torch.nn.TransformerEncoderLayer,)
# the calls running with their modules' hooks aside (``fused_path_aside``), by module: the call's arguments, what
# puts the hooks back
_ASIDE_CALLS: dict[int, tuple[int, Callable[[], None]]] = {}
_SPENT: list[Any] = []  # their global hooks, done, not removed yet (``fused_path_aside``)


def _remove(handle: Any) -> None:
    handle.remove()


def _remove_spent() -> None:
    while _SPENT:
        _SPENT.pop().remove()


def has_fused_path(module: Any) -> bool:
    """Whether torch gives ``module`` a fused path that any forward hook of its modules refuses: an
    ``nn.TransformerEncoderLayer`` running torch's own forward (in eval mode: ``_transformer_encoder_layer_fwd``).
    torch's ``nn.MultiheadAttention`` and ``nn.TransformerEncoder`` look at no hook, ``nn.TransformerDecoderLayer``
    has no such path."""
    return any(
        isinstance(module, t) and getattr(type(module), "forward", None) is t.forward for t in _FUSED_TYPES
    )


def takes_fused_path(layer: Any, args: Any, kwargs: Any) -> bool:
    """Whether the ``nn.TransformerEncoderLayer`` ``layer`` called with ``args`` and ``kwargs`` now takes torch's
    fused path when no forward hook is in its modules: torch's own conditions (``TransformerEncoderLayer.forward``,
    torch 2.x) but the hooks'. One it cannot tell (an attribute another torch lacks) counts as taken: its hooks then
    step aside, and the call runs as without precprof either way."""
    kwargs = kwargs or {}
    src = args[0] if args else kwargs.get("src")
    if not isinstance(src, torch.Tensor):
        return False
    mask = args[1] if len(args) > 1 else kwargs.get("src_mask")
    padding = args[2] if len(args) > 2 else kwargs.get("src_key_padding_mask")
    try:
        attn = layer.self_attn
        if (
            not torch.backends.mha.get_fastpath_enabled()
            or src.dim() != 3
            or layer.training
            or not attn.batch_first
            or attn.in_proj_bias is None
            or not attn._qkv_same_embed_dim
            or not layer.activation_relu_or_gelu
            or layer.norm1.eps != layer.norm2.eps
            or (src.is_nested and (padding is not None or mask is not None))
            or attn.num_heads % 2 == 1
            or torch.is_autocast_enabled()  # (as torch asks it: CUDA's autocast alone)
        ):
            return False
        tensors = (
            src,
            attn.in_proj_weight,
            attn.in_proj_bias,
            attn.out_proj.weight,
            attn.out_proj.bias,
            layer.norm1.weight,
            layer.norm1.bias,
            layer.norm2.weight,
            layer.norm2.bias,
            layer.linear1.weight,
            layer.linear1.bias,
            layer.linear2.weight,
            layer.linear2.bias,
        )
        devices = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
        if torch.overrides.has_torch_function(tensors) or not all(t.device.type in devices for t in tensors):
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    except AttributeError:
        return True


def fused_path_aside(module: Any, args: Any, kwargs: Any) -> bool:
    """For a pre-hook of precprof's on a module that ``has_fused_path``: whether this call of ``module`` runs with
    precprof's forward hooks of its modules aside (every ``HookSet``'s), so that torch's fused path runs as without
    precprof (the hooks refuse it, and the slow path gives other values: a frozen encoder in eval mode under
    ``no_grad`` inside the training forward). They are taken off when it ``takes_fused_path`` and no hook of
    another's is there (which refuses it anyway), by the first of precprof's pre-hooks to run (the others, which
    torch calls all the same, are told so), and put back when the call returns or raises, by a global forward
    hook, always called, that removes itself (torch looks at the modules' own dictionaries)."""
    _remove_spent()
    key = id(module)
    running = _ASIDE_CALLS.get(key)
    if running is not None:
        if running[0] == id(args):
            return True
        running[1]()  # (a call a KeyboardInterrupt cut short: no hook was called at its end)
    if not takes_fused_path(module, args, kwargs):
        return False
    modules = list(module.modules())
    for m in modules:
        for hooks in (getattr(m, "_forward_pre_hooks", None), getattr(m, "_forward_hooks", None)):
            if hooks and not all(_precprofs(k, h) for k, h in hooks.items()):
                return False
    ids = {id(m) for m in modules}
    taken = [(s, s.take_modules(ids)) for s in list(_HOOK_SETS)]
    handle: Any = None

    def back() -> None:
        # (torch calls an always-called hook of a forward that raised while it loops over the dictionary that
        # holds it: removed at the next call then)
        (_SPENT.append if sys.exc_info()[1] is not None else _remove)(handle)
        _ASIDE_CALLS.pop(key, None)
        for hookset, entries in taken:
            hookset.put_modules(entries)

    def returned(m: Any, _args: Any, _output: Any = None) -> None:
        if m is module:
            back()

    handle = torch.nn.modules.module.register_module_forward_hook(returned, always_call=True)
    _ASIDE_CALLS[key] = (id(args), back)
    return True


def _behind_others(hooks: dict[int, Any], key: int) -> None:
    """``key``'s hook re-inserted at the end of ``hooks`` where a hook not precprof's follows it; in place."""
    for k in reversed(hooks):
        if k == key:
            return
        if not _precprofs(k, hooks[k]):
            break
    else:
        return
    hook = hooks.pop(key, None)
    if hook is not None:
        hooks[key] = hook
