"""What the capture summary says of the model and its optimizers beyond the rows (``ProfilerResults.summary``):
buffers held in low precision and how far their values may lie from fp32, FP8-emulating layers and the FP8
recipes torchao's layers run, the MX recipes of torchao's block-scaled layers, dropout layers,
each optimizer's settings (what torch.compile compiled: ``compiled_facts``)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precprof import _compat
from precprof.capture.update_carry import CarryProbe
from precprof.capture.update_carry import describe as describe_carries
from precprof.taxonomy import BLOCK_MODULE_TYPES, BLOCK_WEIGHT_TYPES, FP8_MODULE_TYPES, FP8_WEIGHT_TYPES

_ROUNDING_READ_MAX = 1 << 26  # elements: a larger 16-bit buffer is listed without reading its values


def buffer_rounding(buf: torch.Tensor) -> dict[str, Any]:
    """What a 16-bit floating buffer's values say about a cast that rounded them: ``exact`` when every finite
    value is one the cast cannot have changed: an integer the format holds exactly (0/1 masks, positions up to
    256 in bf16), or a value of at most half the format's significant bits (powers of two, 0.75, 1.5: a cast
    rounds a value of full fp32 precision to one of those once in 16 (bf16) or 32 (fp16), so a buffer of them was
    that short before the cast). Else ``rounding``: the largest half unit in the last place of any other value,
    how far each may lie from what it was before the cast. {} when the values cannot be read (on the meta
    device, a wrapper subclass, larger than ``_ROUNDING_READ_MAX``). One read of the buffer, at save."""
    bits = 7 if buf.dtype == torch.bfloat16 else 10  # stored mantissa bits
    normal_min = -126 if buf.dtype == torch.bfloat16 else -14
    try:
        if buf.numel() > _ROUNDING_READ_MAX or buf.is_meta:
            return {}
        with torch.no_grad():
            v = buf.detach().float().flatten()
            v = v[torch.isfinite(v) & (v != 0)]
            mant, exp = torch.frexp(v)  # v = mant * 2^exp, 0.5 <= |mant| < 1
            integer = (v == v.round()) & (v.abs() <= 2.0 ** (bits + 1))
            short = mant * 2.0 ** ((bits + 1) // 2)  # an integer for a value of at most half the bits
            inexact = ~integer & (short != short.round())
            if not bool(inexact.any()):
                return {"exact": True}
            top = int(exp[inexact].max()) - 1  # the binade [2^top, 2^(top+1)) of the largest such value
        return {"exact": False, "rounding": 2.0 ** (max(top, normal_min) - bits - 1)}
    except Exception:  # a buffer it cannot read is listed without what its values say
        return {}


def low_precision_buffers(model: nn.Module) -> list[dict[str, Any]]:
    """Floating buffers of the model's modules held in fp16 or bf16 (BatchNorm running statistics after
    ``model.half()``, a rotary embedding's frequencies after ``model.to(torch.bfloat16)``): their module, its
    type, and what their values say about the rounding (``buffer_rounding``; read here, at save). Every
    module's, the root's and containers' included (a model that keeps its rotary frequencies on itself and
    passes them to its layers), not the captured modules' alone."""
    out: list[dict[str, Any]] = []
    for name, module in _compat.named_modules(model):
        for bname, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.dtype in (torch.float16, torch.bfloat16):
                out.append(
                    {
                        "module": name,
                        "module_type": type(module).__name__,
                        "buffer": bname,
                        "dtype": str(buf.dtype).removeprefix("torch."),
                        **buffer_rounding(buf),
                    }
                )
    return out


def fp8_emulated(model: nn.Module) -> int:
    """How many of the model's torchao FP8 training layers (``runs_fp8``) emulate FP8
    (``Float8LinearConfig(emulate=True)``: the casts to FP8 are real, the matmuls run in high precision)."""
    return sum(bool(getattr(_fp8_config(m), "emulate", False)) for m in model.modules() if runs_fp8(m))


def _own_weight(module: nn.Module, types: frozenset[str]) -> torch.Tensor | None:
    """The module's own weight when its type's name is one of ``types`` (a torchao training weight ``quantize_``
    wrapped an nn.Linear's weight in, the module kept), else None. Read by name: torchao need not be imported."""
    weight = dict(module.named_parameters(recurse=False)).get("weight")
    return weight if type(weight).__name__ in types else None


def runs_fp8(module: nn.Module) -> bool:
    """Whether the module's GEMMs run torchao's FP8 training: a Float8Linear (``taxonomy.FP8_MODULE_TYPES``), or a
    layer whose weight ``quantize_(model, Float8TrainingOpConfig(...))`` made an FP8 training weight
    (``taxonomy.FP8_WEIGHT_TYPES``)."""
    return type(module).__name__ in FP8_MODULE_TYPES or _own_weight(module, FP8_WEIGHT_TYPES) is not None


def _fp8_config(module: nn.Module) -> Any:
    """The ``Float8LinearConfig`` an FP8 training layer runs: a Float8Linear's ``config``; for an nn.Linear whose
    weight ``quantize_`` wrapped, the one its weight's ``Float8TrainingOpConfig`` builds from its recipe name
    (``_float8_linear_config``), else that config itself (read as far as it has the attributes)."""
    weight = _own_weight(module, FP8_WEIGHT_TYPES)
    if weight is None:
        return getattr(module, "config", None)
    config = getattr(weight, "config", None)
    return getattr(config, "_float8_linear_config", config)


# the recipe every FP8 what-if assumes (``analysis.current_scaling``), whatever recipe the run's layers ran
FP8_WHATIF_RECIPE = (
    "per-tensor current scaling with power-of-two scales, scale = 2^floor(log2(fmax / max(amax, 1e-12))) "
    "(torchao's tensorwise recipe with round_scales_to_power_of_2, 1e-12 being its floor on amax)"
)

# the casts of torchao's Float8LinearConfig, by the tensor each casts (its ``cast_config_*`` attributes): those of
# the forward GEMM and of the two backward ones
_FP8_CASTS = {
    "input": "cast_config_input",
    "weight": "cast_config_weight",
    "grad_output": "cast_config_grad_output",
    "input_for_grad_weight": "cast_config_input_for_grad_weight",
    "weight_for_grad_input": "cast_config_weight_for_grad_input",
    "grad_output_for_grad_weight": "cast_config_grad_output_for_grad_weight",
}


def _word(value: Any) -> str:
    """An enum's value ("axiswise"), a dtype's name ("float8_e4m3fn"), else its text."""
    return str(getattr(value, "value", value)).removeprefix("torch.")


def fp8_recipe_of(config: Any) -> dict[str, Any]:
    """What a torchao ``Float8LinearConfig`` does, in plain values: ``scaling`` ("tensorwise": one scale per
    tensor; "rowwise": one per row, torchao's axiswise; "mixed" otherwise), each cast's granularity, FP8 dtype
    and whether it runs (``casts``: "disabled" where the GEMM stays in high precision, as rowwise_with_gw_hp's
    weight gradient), ``round_scales_to_power_of_2`` and ``emulate``. Read from the attributes, so that a
    config of another torchao version reads as far as it has them."""
    casts = {}
    for what, attr in _FP8_CASTS.items():
        cast = getattr(config, attr, None)
        if cast is None:
            continue
        kind = _word(getattr(cast, "scaling_type", ""))
        casts[what] = {
            "granularity": _word(getattr(cast, "scaling_granularity", "")),
            "dtype": _word(getattr(cast, "target_dtype", "")),
            **({"scaling_type": kind} if kind and kind != "dynamic" else {}),
        }
    used = {c["granularity"] for c in casts.values() if c.get("scaling_type") != "disabled"}
    scaling = "tensorwise" if used == {"tensorwise"} else "rowwise" if used == {"axiswise"} else "mixed"
    return {
        "scaling": scaling,
        "casts": casts,
        "round_scales_to_power_of_2": bool(getattr(config, "round_scales_to_power_of_2", False)),
        "emulate": bool(getattr(config, "emulate", False)),
    }


def fp8_recipes(model: nn.Module) -> list[dict[str, Any]]:
    """The FP8 recipes the model's torchao FP8 training layers run (``runs_fp8``), each once with the layers that
    run it (``layers``, by the capture's names): what ``fp8_recipe_of`` reads of their ``config``; for an
    nn.Linear whose weight ``quantize_`` made an FP8 training weight, with ``module_type`` and ``weight_type``
    naming them. [] when none runs FP8."""
    return _recipes(model, runs_fp8, _fp8_recipe_of_layer)


def _fp8_recipe_of_layer(module: nn.Module) -> dict[str, Any]:
    """``fp8_recipe_of`` the FP8 training layer's config, its module's and weight's types added for a layer
    ``quantize_`` left an nn.Linear (a Float8Linear's recipe names no type, as runs before these did)."""
    weight = _own_weight(module, FP8_WEIGHT_TYPES)
    recipe = fp8_recipe_of(_fp8_config(module))
    if weight is None:
        return recipe
    return {**recipe, "module_type": type(module).__name__, "weight_type": type(weight).__name__}


def _recipes(
    model: nn.Module, runs: Callable[[nn.Module], bool], recipe_of: Callable[[nn.Module], dict[str, Any]]
) -> list[dict[str, Any]]:
    """The recipes ``recipe_of`` reads of the model's modules that ``runs`` picks, each once with the layers
    that run it (``layers``, by the capture's names)."""
    out: list[dict[str, Any]] = []
    for name, m in _compat.named_modules(model):
        if not runs(m):
            continue
        recipe = recipe_of(m)
        same = next((r for r in out if {k: v for k, v in r.items() if k != "layers"} == recipe), None)
        if same is None:
            out.append({**recipe, "layers": [name]})
        else:
            same["layers"].append(name)
    return out


# torchao 0.18's MXFP8Linear, and the MX training weight ``quantize_(model, MXFP8TrainingOpConfig())`` gives an
# nn.Linear, fix their recipe's element format and block size in code (E4M3 elements, blocks of 32, for every
# GEMM), as its NVFP4Linear does (E2M1 elements, blocks of 16); earlier releases' MXLinear holds them in its
# ``config`` (``MXLinearConfig``). (element, block size, format)
_BLOCK_FIXED = {
    "MXFP8Linear": ("float8_e4m3fn", 32, "mxfp8"),
    "MXFP8TrainingWeightWrapperTensor": ("float8_e4m3fn", 32, "mxfp8"),
    "NVFP4Linear": ("float4_e2m1fn_x2", 16, "nvfp4"),
}


def _block_weight(module: nn.Module) -> torch.Tensor | None:
    """The module's own weight when it is one of torchao's MX training weights (``taxonomy.BLOCK_WEIGHT_TYPES``:
    ``quantize_`` wraps an nn.Linear's weight in one and keeps the module), else None. Read by its type's name:
    torchao need not be imported."""
    return _own_weight(module, BLOCK_WEIGHT_TYPES)


def runs_block_format(module: nn.Module) -> bool:
    """Whether the module's GEMMs run torchao's MX training: an MX layer (``taxonomy.BLOCK_MODULE_TYPES``), or a
    layer whose weight ``quantize_`` made an MX training weight."""
    return type(module).__name__ in BLOCK_MODULE_TYPES or _block_weight(module) is not None


def _mx_format(element: str) -> str:
    """The MX format an element dtype makes ("float8_e4m3fn" -> "mxfp8", "float4_e2m1fn_x2" -> "mxfp4")."""
    for bits, name in (("8", "mxfp8"), ("6", "mxfp6"), ("4", "mxfp4")):
        if element.startswith((f"float{bits}", f"fp{bits}")):
            return name
    return "mx"


def block_recipe_of(module: nn.Module) -> dict[str, Any]:
    """What a torchao MX or NVFP4 training layer (``runs_block_format``) runs, in plain values: its ``format``
    ("mxfp8", "nvfp4"),
    the element dtype and block size of its operands, ``scale_rounding`` ("rceil": the scale rounded up, as
    cuBLAS computes it; "floor": the OCP spec's; None where the layer does not say), whether its weight gradient
    GEMM runs in high precision (``wgrad_with_hp``) and whether it is ``emulated`` (the casts are real, the
    matmuls run in high precision). Read from the module's attributes, else its ``config`` (its MX training
    weight's, ``weight_type`` naming that weight's type, for a layer ``quantize_`` left an nn.Linear), so that a
    layer of another torchao version reads as far as it has them."""
    weight = _block_weight(module)
    config = getattr(module if weight is None else weight, "config", None)
    element, block, fixed = _BLOCK_FIXED.get(type(module if weight is None else weight).__name__, (None,) * 3)
    element = _word(getattr(config, "elem_dtype", element))
    block = getattr(config, "block_size", block)

    def setting(name: str) -> Any:
        return getattr(module, name, getattr(config, name, None))

    rounding = setting("scale_calculation_mode")
    return {
        "format": fixed or _mx_format(element),
        "module_type": type(module).__name__,
        "element": element,
        "block_size": int(block) if isinstance(block, int) else None,
        "scale_rounding": _word(rounding).lower() if rounding is not None else None,
        "wgrad_with_hp": bool(setting("wgrad_with_hp")),
        "emulated": _word(setting("kernel_preference")).lower() == "emulated",
        **({"weight_type": type(weight).__name__} if weight is not None else {}),
    }


def block_recipes(model: nn.Module) -> list[dict[str, Any]]:
    """The MX recipes the model's torchao MX training layers run (``runs_block_format``), each once with the
    layers that run it (``layers``, by the capture's names): what ``block_recipe_of`` reads. [] when none is
    one."""
    return _recipes(model, runs_block_format, block_recipe_of)


def main_float_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype holding most of ``model``'s parameter elements (float32 for a model without any)."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return max(sizes, key=lambda d: sizes[d]) if sizes else torch.float32


def float64_run(main: torch.dtype, model: nn.Module, autocast_on: bool) -> bool:
    """Whether a run trains in float64 (``precision_seen``'s "fp64"): float64 holds most of ``model``'s parameter
    elements (``main``, ``main_float_dtype``), and autocast, when on, has no float32 parameter to run in 16 bits
    (a model mixing float64 and float32 layers under autocast trains in its mode; the float64 layers are named
    by the advisor's ``float64_layers``)."""
    if main != torch.float64:
        return False
    return not autocast_on or not any(p.dtype == torch.float32 for p in model.parameters())


def low_precision_linear(model: nn.Module) -> str | None:
    """The precision the model's torchao training layers run their GEMMs in: "fp8" with an FP8 training layer (a
    Float8Linear, or an nn.Linear whose weight ``quantize_`` made an FP8 training weight), else the MX formats of
    its MX layers ("mxfp8"; "mxfp8+mxfp4" for two), else None."""
    modules = list(model.modules())
    if any(runs_fp8(m) for m in modules):
        return "fp8"
    formats = {block_recipe_of(m)["format"] for m in modules if runs_block_format(m)}
    return "+".join(sorted(formats)) or None


def dropped_biases(model: nn.Module) -> list[dict[str, Any]]:
    """The nn.Linear layers (and subclasses: ``own_forward`` where their forward is their own, which may add the bias
    itself) whose bias their torchao training weight leaves out: ``quantize_`` made the weight one
    of torchao's training weights (``taxonomy.BLOCK_WEIGHT_TYPES``, ``FP8_WEIGHT_TYPES``), whose
    ``__torch_function__`` computes nn.Linear's ``F.linear(input, weight, bias)``; torchao 0.18's MX one
    (``MXFP8TrainingWeightWrapperTensor``, every ``MXFP8TrainingOpConfig`` recipe) returns the matmul alone, so
    the bias is neither added nor trained (its gradient stays None), where its FP8 one and its MXFP8Linear and
    NVFP4Linear modules add theirs. Told by trying it (``_drops_bias``), so that a torchao that adds the bias is
    not said to drop it. Each: ``layer``, ``weight_type``, ``config`` (its config's class), ``function`` (the
    weight type's ``__torch_function__``), the bias's ``values`` and largest |value| (``absmax``; None where not
    read: a DTensor's shards). One 32 x 32 matmul on the CPU per weight type and config, and one read of each
    such bias, at save."""
    out: list[dict[str, Any]] = []
    tried: dict[tuple[type, str], bool | None] = {}
    for name, m in _compat.named_modules(model):
        weight = _own_weight(m, BLOCK_WEIGHT_TYPES | FP8_WEIGHT_TYPES)
        bias = getattr(m, "bias", None)
        if weight is None or not isinstance(bias, torch.Tensor) or not isinstance(m, nn.Linear):
            continue
        config = getattr(weight, "config", None)
        key = (type(weight), repr(config))
        if key not in tried:
            tried[key] = _drops_bias(weight)
        if not tried[key]:
            continue
        cls = type(weight)
        out.append(
            {
                "layer": name,
                "weight_type": cls.__name__,
                "config": type(config).__name__,
                "function": f"{cls.__module__}.{cls.__qualname__}.__torch_function__",
                "values": _compat.global_numel(bias),
                "absmax": _absmax(bias),
                # a forward of its own may add the bias itself, or pass it to F.linear as nn.Linear's does: not run
                "own_forward": not _runs_linear_forward(m),
            }
        )
    return out


def _runs_linear_forward(module: nn.Module) -> bool:
    """Whether the module's forward is nn.Linear's own, ``F.linear(input, self.weight, self.bias)``: a module
    that adds its bias itself keeps it whatever its weight's F.linear does."""
    own = inspect.getattr_static(type(module), "forward", None)
    return own is nn.Linear.forward and "forward" not in vars(module)


def _drops_bias(weight: torch.Tensor) -> bool | None:
    """Whether ``F.linear`` with a weight of ``weight``'s type and config leaves the bias out: tried with a 32 x 32
    zero weight, zero input and a bias of ones on the CPU in fp32 (an output of zeros: left out; of ones: added),
    the config's kernels emulated (its own may run on Blackwell GPUs alone); None when the try fails or gives
    neither. No random numbers drawn, nothing of the model's touched."""
    config = getattr(weight, "config", None)
    try:
        preference = getattr(config, "kernel_preference", None)
        if preference is not None and dataclasses.is_dataclass(config) and not isinstance(config, type):
            config = dataclasses.replace(config, kernel_preference=type(preference)["EMULATED"])
        zeros = torch.zeros(32, 32, dtype=torch.float32, device="cpu")
        probe = type(weight)(zeros, config)  # type: ignore[call-arg]
        with torch.no_grad():
            y = F.linear(zeros, probe, torch.ones(32, dtype=torch.float32, device="cpu"))
        if bool((y == 0).all()):
            return True
        return False if bool((y == 1).all()) else None
    except Exception:  # a weight type that cannot be built this way: nothing is said of it
        return None


def _absmax(t: torch.Tensor) -> float | None:
    """The largest |value| of ``t`` (a sync: at save); None for a DTensor (its values lie on every rank) or a
    tensor that cannot be read."""
    if hasattr(t, "to_local") or t.numel() == 0:
        return None
    try:
        with torch.no_grad():
            return float(t.detach().abs().max())
    except Exception:
        return None


def model_class_name(model: nn.Module) -> str:
    """The model's class name as its user wrote it: FSDP2's ``fully_shard`` swaps the class for a subclass of
    its own (``FSDPLlamaForCausalLM``), whose first base other than ``FSDPModule`` is the model's."""
    cls = type(model)
    bases = [c for c in cls.__mro__[1:] if c.__name__ != "FSDPModule"]
    if cls.__name__.startswith("FSDP") and any(c.__name__ == "FSDPModule" for c in cls.__mro__) and bases:
        return bases[0].__name__
    return cls.__name__


# a Hugging Face config's dimensions that the ``model`` block of summary.json records
_MODEL_DIM_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "n_embd",
    "n_inner",
    "n_head",
    "n_layer",
    "vocab_size",
)


def model_info(model: nn.Module, name: str | None = None) -> dict[str, Any]:
    """The ``model`` block of summary.json of a model precprof did not build (the callbacks', a Profiler's in
    the user's own loop): name, kind ("hf" with a Hugging Face config, else "user"), class, parameter count
    (every rank's) and, from a Hugging Face config, its dimensions."""
    config = getattr(model, "config", None)
    dims: dict[str, int] = {}
    if config is not None:
        for k in _MODEL_DIM_KEYS:
            v = getattr(config, k, None)
            if isinstance(v, int) and not isinstance(v, bool):
                dims[k] = v
    cls = type(model)
    return {
        "name": name or getattr(config, "name_or_path", None) or model_class_name(model),
        "kind": "hf" if config is not None else "user",
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "n_params": sum(_compat.global_numel(p) for p in model.parameters()),
        **dims,
    }


def dropout_layers(model: nn.Module) -> int:
    """Dropout modules that drop something (p > 0): a compiled run's sampled steps, run eagerly, draw other
    random numbers than inductor's kernels do."""
    return sum(1 for m in model.modules() if _compat.drops(m))


_NO_FORWARD = inspect.getattr_static(nn.Module, "forward")  # nn.Module's own, which raises: no forward


def modules_without_forward(model: nn.Module) -> list[str]:
    """The model's modules with no forward of their own (``nn.ModuleList``, ``nn.ModuleDict``): their parent's
    forward calls their children, so a function that computed a child's input ran there, and keeping one of them
    in fp32 by its forward keeps nothing."""
    return [
        name
        for name, m in _compat.named_modules(model)
        # looked up without running a descriptor (a TorchScript module's forward raises when read off its class)
        if name
        and inspect.getattr_static(type(m), "forward", None) is _NO_FORWARD
        and "forward" not in vars(m)
    ]


def optimizer_class(optimizers: Sequence[Any]) -> str | None:
    """The optimizers' classes in words ("Muon + AdamW"), each once; None without one."""
    return " + ".join(dict.fromkeys(type(o).__name__ for o in optimizers)) or None


def optimizer_settings(
    optimizers: list[Any], params: Sequence[Any] = (), scaled: bool = False, carry: CarryProbe | None = None
) -> dict[str, Any] | None:
    """What the advisor reads of the optimizers: their classes ("Muon + AdamW"), and over the parameter groups
    of the Adams among them (of all of them when none is an Adam) the smallest ``eps`` and the largest
    second-moment decay (``betas[1]``), the settings that decide whether Adam's update divides by zero in fp16
    (Muon's own ``eps`` is no Adam's); a setting held as a tensor (a tensor ``lr`` or ``betas``) is left out
    rather than read from the device. Beside an optimizer that is no Adam, ``adam_modules`` names the captured
    modules (``params``: the plan's parameter slots) whose parameters an Adam holds, so that a finding about
    Adam speaks of its parameters only. With several optimizers under a loss scaler (``scaled``), ``each`` holds each
    one's class and modules, in the list's order (the steps table's ``skipped_optimizers`` names them by place).
    ``carries``: the optimizers that may carry the remainder of an update their weight could not take, with what
    says so (``update_carry.describe``; ``carry``: what the update sample's probe measured), where one does.
    None without an optimizer."""
    if not optimizers:
        return None
    adams = [o for o in optimizers if "Adam" in type(o).__name__]
    groups = [g for o in adams or optimizers for g in getattr(o, "param_groups", None) or []]
    eps = [g["eps"] for g in groups if isinstance(g.get("eps"), (int, float))]
    betas = [g.get("betas") for g in groups]
    beta2 = [
        b[1] for b in betas if isinstance(b, (tuple, list)) and len(b) > 1 and isinstance(b[1], (int, float))
    ]
    out: dict[str, Any] = {
        "class": optimizer_class(optimizers),
        "eps": float(min(eps)) if eps else None,
        "beta2": float(max(beta2)) if beta2 else None,
    }
    carries = describe_carries(optimizers, carry)
    if carries:
        out["carries"] = carries
    if adams and len(adams) < len(optimizers):
        held = {id(p) for o in adams for g in o.param_groups for p in g["params"]}
        out["adam_class"] = " + ".join(dict.fromkeys(type(o).__name__ for o in adams))
        out["adam_modules"] = sorted({ps.module for ps in params if id(ps.tensor) in held})
    if (
        scaled and len(optimizers) > 1
    ):  # each in its place in the list (the steps table's ``skipped_optimizers``)
        out["each"] = [
            {
                "class": type(o).__name__,
                "modules": sorted({ps.module for ps in params if id(ps.tensor) in own}),
            }
            for o in optimizers
            if (own := {id(p) for g in getattr(o, "param_groups", None) or [] for p in g["params"]})
            is not None
        ]
    return out


def resumed_optimizer_changes(
    previous: Any, first_step: int, optimizers: Sequence[Any]
) -> list[dict[str, Any]]:
    """The optimizer changes a resumed run keeps (``optimizer_changes`` of ``previous``, the capture summary of
    the run it continues, before ``first_step``: the later ones' steps are replaced), and one more at
    ``first_step`` when the run goes on with another optimizer than it had there (a second ``fit`` that makes
    its optimizer anew: a new Profiler, which the old one's hooks never saw)."""
    if not isinstance(previous, dict) or first_step <= 0:  # (from step 0 on, every step is replaced)
        return []
    changes = [c for c in previous.get("optimizer_changes") or () if isinstance(c, dict)]
    changes = [c for c in changes if isinstance(c.get("step"), int)]  # (in step order, as recorded)
    kept = [c for c in changes if c["step"] < first_step]
    dropped = changes[len(kept) :]
    settings = previous.get("optimizer")
    was = dropped[0].get("from") if dropped else settings.get("class") if isinstance(settings, dict) else None
    now = optimizer_class(optimizers)
    if was is not None and was != now:
        kept.append({"step": first_step, "from": was, "to": now})
    return kept
