"""What a layer is, for mixed precision: one classification of modules, and one test of whether mixed
precision is active.

Autocast treats modules by what they compute: matmuls (Linear, convolutions, Hugging Face's ``Conv1D``)
run in the low precision; softmax, layer and group normalisation and losses run in fp32; element-wise
functions and BatchNorm follow their input; embeddings are gathers in the weight's dtype. The same rules apply
to a live module (``kind_of``) and to the ``module_type`` column of the tables (``kind_of_type``): a module's
kind is decided by its type name first, so the two agree for every type the capture records; a live module
adds what only it can tell (a subclass of ``nn.Linear`` under another name, a leaf holding a >= 2-D weight).

What reads the tables (the advisor, `precprof report`) needs no torch: the functions of a live module import it
when called, with a module in hand.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from torch import nn

from precprof import tables as T
from precprof.modes import FP64, PRECISIONS
from precprof.schema import texts

MATMUL = "matmul"  # autocast runs it in the low precision: its inputs and outputs are 16-bit
NORM = "norm"  # LayerNorm, RMSNorm, GroupNorm (autocast keeps fp32), BatchNorm, InstanceNorm (it does not)
SOFTMAX = "softmax"  # softmax and log-softmax: fp32 under autocast
LOSS = "loss"  # losses: fp32 under autocast
ELEMENTWISE = "elementwise"  # activation functions, dropout: follow their input (a matmul output)
EMBEDDING = "embedding"  # a gather: the weight's dtype
OTHER = "other"  # containers and modules doing functional math: unknown
KINDS = (MATMUL, NORM, SOFTMAX, LOSS, ELEMENTWISE, EMBEDDING, OTHER)
FP32_UNDER_AUTOCAST = frozenset({NORM, SOFTMAX, LOSS})

# How autocast treats what a module saves for backward (the memory projection's view of the kinds)
CLASS_MATMUL = "matmul"  # saves the inputs of a matmul: 16-bit under autocast
CLASS_ELEMENTWISE = "elementwise"  # activation functions, dropout, BatchNorm: follow their input
CLASS_FP32 = "fp32"  # LayerNorm, GroupNorm, RMSNorm, softmax, losses: autocast runs them in fp32
CLASS_OTHER = "other"  # anything else (composite modules doing functional math): assumed unchanged
LOW_UNDER_AUTOCAST = frozenset({CLASS_MATMUL, CLASS_ELEMENTWISE})

# Norms autocast has no rule for, on any device: they run in their input's dtype (a 16-bit conv output stays
# 16-bit, and so does what they save for backward); torchvision's FrozenBatchNorm2d is a scale and a shift
_NORMS_FOLLOWING_INPUT = re.compile(r"BatchNorm|InstanceNorm")

FP8_DIM_MULTIPLE = 16  # float8 matmuls need both dimensions (and the tokens per call) divisible by 16

# torch's parametrizations (torch.nn.utils.parametrizations), the modules under a layer's
# ``parametrizations.<name>`` that compute its weight from the tensors it holds: weight_norm's and spectral_norm's
# rescale a weight, they normalise no activation (what the ``Norm`` in their names would have said)
_PARAMETRIZATIONS = re.compile(r"^_(WeightNorm|SpectralNorm|Orthogonal)$")

_BY_NAME: tuple[tuple[str, re.Pattern[str]], ...] = (
    (OTHER, _PARAMETRIZATIONS),
    (EMBEDDING, re.compile(r"Embedding")),
    (LOSS, re.compile(r"Loss$")),
    (NORM, re.compile(r"Norm")),
    (SOFTMAX, re.compile(r"^(Log)?Softmax|^Softmin$")),
    (MATMUL, re.compile(r"Linear|^Conv1D$|^Conv(Transpose)?[123]d$|^Bilinear$")),
    (
        ELEMENTWISE,
        re.compile(
            r"^(ReLU6?|GELU|NewGELUActivation|GELUActivation|SiLU|Mish|Tanh|Sigmoid|LeakyReLU|ELU|Hardswish"
            r"|Hardtanh|Softplus|Identity|Dropout[123]?d?)$|Activation$|GELU"
        ),
    ),
)


# Modules whose backward writes an exact zero wherever their forward dropped or clipped a value: a ReLU where its
# unit was off, a dropout where it dropped one, a max-pool off each window's max, a hard clamp beyond its range. A
# zero in a gradient that passed back through one may be its, not a value that underflowed. (GELU, SiLU, tanh:
# their slope is never exactly 0.)
_BACKWARD_ZEROS = re.compile(
    r"^(ReLU6?|Hardtanh|Hardsigmoid|Hardswish|Threshold|Hardshrink|Softshrink|(Feature)?AlphaDropout"
    r"|Dropout[123]?d?|(Adaptive|Fractional)?MaxPool[123]d)$"
)


def writes_backward_zeros(module_type: str) -> bool:
    """Whether a module of this type writes exact zeros into the gradient its backward passes on
    (``_BACKWARD_ZEROS``)."""
    return bool(_BACKWARD_ZEROS.match(module_type or ""))


@functools.cache
def _matmul_types() -> tuple[type[nn.Module], ...]:
    from torch import nn

    return (
        nn.Linear,
        nn.Bilinear,
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
    )


@functools.lru_cache(maxsize=4096)
def kind_of_type(module_type: str) -> str:
    """The kind of a module from its class name (the tables' ``module_type``): one of ``KINDS``. Cached: the
    block-format deal asks it of every module each time it deals (a sampled step's host work)."""
    name = module_type or ""
    for kind, pattern in _BY_NAME:
        if pattern.search(name):
            return kind
    return OTHER


# the container of a parametrized layer's parametrizations (``<layer>.parametrizations.weight``): its output is
# the weight the layer computes with
PARAMETRIZATION_LIST = "ParametrizationList"


def is_parametrization_type(module_type: str) -> bool:
    """Whether a module of this type is one of torch's parametrizations (``_WeightNorm``, ``_SpectralNorm``,
    ``_Orthogonal``): it computes a layer's weight, its output is that weight."""
    return bool(_PARAMETRIZATIONS.match(module_type or ""))


def type_name(module: nn.Module) -> str:
    """A module's type as its code names it: a TorchScript submodule (``torch.jit.script(nn.Linear(...))``) is
    a ``RecursiveScriptModule``, whose ``original_name`` is the class it was scripted from (a linear layer
    typed so was left out of the linear layers' analyses)."""
    name = type(module).__name__
    original = getattr(module, "original_name", None) if name == "RecursiveScriptModule" else None
    return original if isinstance(original, str) and original else name


def kind_of(module: nn.Module) -> str:
    """The kind of a live module: its type name's kind, refined by its class and weight where the name says
    nothing (a renamed ``nn.Linear`` subclass, a leaf with a >= 2-D weight is a matmul)."""
    import torch
    from torch import nn

    kind = kind_of_type(type_name(module))
    if kind != OTHER:
        return kind
    if isinstance(module, _matmul_types()):
        return MATMUL
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return EMBEDDING
    if isinstance(module, nn.modules.loss._Loss):
        return LOSS
    if not any(True for _ in module.children()):
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() >= 2:
            return MATMUL
    return OTHER


def autocast_class(module: nn.Module) -> str:
    """How autocast treats what ``module`` saves for backward: matmul | elementwise | fp32 | other (LayerNorm,
    GroupNorm, RMSNorm, softmax and losses run in fp32; BatchNorm and InstanceNorm follow their input, as
    activation functions do; embeddings and containers are other)."""
    kind = kind_of(module)
    if kind == NORM and _NORMS_FOLLOWING_INPUT.search(type(module).__name__):
        return CLASS_ELEMENTWISE
    if kind in FP32_UNDER_AUTOCAST:
        return CLASS_FP32
    if kind == MATMUL:
        return CLASS_MATMUL
    if kind == ELEMENTWISE:
        return CLASS_ELEMENTWISE
    return CLASS_OTHER


def is_matmul_type(module_type: str) -> bool:
    """True for module types whose forward is a matmul that autocast runs in low precision."""
    return kind_of_type(module_type) == MATMUL


def is_linear_type(module_type: str) -> bool:
    """A matmul with a Linear's (in, out) weight, which FP8 recipes convert: ``nn.Linear`` and its subclasses
    by name, and Hugging Face GPT-2's ``Conv1D`` (a Linear with a transposed weight); not convolutions."""
    return is_matmul_type(module_type) and ("Linear" in module_type or module_type == "Conv1D")


def tied_weight_ids(model: nn.Module) -> set[int]:
    """ids of the embedding weights of ``model`` (an output head sharing one is tied to it)."""
    from torch import nn

    return {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def routed_expert(module: str) -> bool:
    """Whether ``module`` is one of a mixture of experts' routed experts held as modules: a path under a
    container named for them (``mlp.experts.3.up_proj``, Switch's ``experts.expert_0.wi``, DeepSpeed's
    ``deepspeed_experts.0``). Each gets the tokens the router sends it, not the batch x sequence the other
    layers see; a shared expert (``shared_expert``, ``shared_experts``), which every token goes through, is
    not one. The name alone cannot tell a multi-gate mixture's experts, which see every token: the advisor
    also asks that the tokens per call differ from the batch's."""
    for seg in module.split(".")[:-1]:
        low = seg.lower()
        if low.startswith("shared"):
            return False
        if low in ("expert", "experts") or low.startswith("expert_") or low.endswith("_experts"):
            return True
    return False


PARAMETRIZED = (
    "Parametrized"  # torch.nn.utils.parametrize names a parametrized Linear's class ParametrizedLinear
)


def fp8_convertible_type(module_type: str) -> bool:
    """Module types a float8 conversion swaps: ``nn.Linear`` and its subclasses by name. Hugging Face's
    ``Conv1D`` is a Linear in what it computes but not an ``nn.Linear``: torchao and Transformer Engine leave it
    alone, so it stays in bf16. A Linear whose weight a parametrization computes (``weight_norm``,
    ``spectral_norm``: its class is ``ParametrizedLinear``) cannot be swapped: torchao's conversion fails on it
    ("cannot assign 'torch.FloatTensor' as parameter 'weight'"), and a swap would drop the parametrization."""
    return (
        is_linear_type(module_type) and module_type != "Conv1D" and not module_type.startswith(PARAMETRIZED)
    )


def fp8_ineligible_reason(
    in_features: int | None, out_features: int | None, tied: bool = False, tokens: int | None = None
) -> str:
    """Why a Linear of this shape cannot run as a float8 matmul; "" when it can.

    The one FP8 eligibility rule, shared by the advisor and ``--precision fp8`` (``convert_fp8``): the layer is
    not tied to an embedding (the shared weight is used as a gather too, and a conversion that swaps the head
    would untie it), its shape is known, both dimensions are multiples of 16, and so are the tokens per call
    (the leading dimensions of its input, batch x sequence) when they are known.
    """
    m = FP8_DIM_MULTIPLE
    if tied:
        return "tied to an embedding"
    if in_features is None or out_features is None:
        return "weight shape unknown"
    if in_features % m or out_features % m:
        return f"dims {in_features}x{out_features} not multiples of {m}"
    if tokens is not None and tokens % m:
        return f"{tokens} tokens per call, not a multiple of {m}"
    return ""


def fp8_eligible_shape(
    in_features: int | None, out_features: int | None, tied: bool = False, tokens: int | None = None
) -> bool:
    """Whether a Linear of this shape can run as a float8 matmul; see ``fp8_ineligible_reason``."""
    return not fp8_ineligible_reason(in_features, out_features, tied, tokens)


# how a layer's weight is computed rather than held, by the names of the parameters it holds instead (the old,
# hook-based torch.nn.utils.weight_norm and spectral_norm; the class of a parametrized layer says its own)
PARAMETRIZATION = "a parametrization, as weight_norm's"
WEIGHT_NORM_HOOK = "torch.nn.utils.weight_norm's forward pre-hook, from weight_g and weight_v"
SPECTRAL_NORM_HOOK = "torch.nn.utils.spectral_norm's forward pre-hook, from weight_orig"


def computed_weight_of(module_type: str, params: Collection[str]) -> str:
    """How the weight of a layer of this type holding these parameters is computed, not held ("" when it is a
    parameter of its own, or the layer holds none): from the tables' ``module_type`` and the parameter names
    the capture records (``summary["capture"]["modules"]``); ``fp8_eligible`` tells it of a live module."""
    if module_type.startswith(PARAMETRIZED):
        return PARAMETRIZATION
    if "weight" in params:
        return ""
    if {"weight_g", "weight_v"} <= set(params):
        return WEIGHT_NORM_HOOK
    return SPECTRAL_NORM_HOOK if "weight_orig" in params else ""


def fp8_eligible(module: nn.Module, tied: set[int], tokens: int | None = None) -> bool:
    """Whether ``module`` (an ``nn.Linear``) can be converted to float8 training; ``tied`` is
    ``tied_weight_ids(model)``; see ``fp8_ineligible_reason``. A Linear whose weight is computed at each forward
    cannot (``computed_weight_of``): by a parametrization, or by the forward pre-hook of the old
    ``torch.nn.utils.weight_norm`` or ``spectral_norm``, which deletes the weight parameter and sets a plain
    tensor in its place. torchao's conversion fails on it ("cannot assign 'torch.FloatTensor' as parameter
    'weight'"), and a swap would drop what computes the weight."""
    from torch import nn
    from torch.nn.utils import parametrize

    return (
        isinstance(module, nn.Linear)
        and not parametrize.is_parametrized(module)
        and isinstance(module._parameters.get("weight"), nn.Parameter)
        and fp8_eligible_shape(module.in_features, module.out_features, id(module.weight) in tied, tokens)
    )


def fp8_eligible_names(model: nn.Module, tokens: int | None = None) -> list[str]:
    """Qualified names of the layers of ``model`` that ``convert_fp8`` converts (``fp8_eligible``), in
    ``named_modules`` order: the live-model side of the advisor's ``fp8_layers``. An ``nn.MultiheadAttention``'s
    ``out_proj`` is not one: the attention reads its weight and bias itself and never calls it, so a swap would
    change nothing of what runs (its matmul stays in bf16, as the in_proj_weight's)."""
    from torch import nn

    tied = tied_weight_ids(model)
    never_called = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    return [
        name
        for name, m in model.named_modules()
        if id(m) not in never_called and fp8_eligible(m, tied, tokens)
    ]


# ---------------------------------------------------------------------------------- mixed precision active
# The precision settings of the frameworks -> precprof's modes (precprof.modes.Precision, and fp64): Lightning's
# and Fabric's ``precision=``, the Lightning callback's and a Fabric loop's (``Profiler`` given ``fabric.setup``'s)
LIGHTNING_PRECISIONS: dict[str, str] = {
    "32-true": "fp32",
    "32": "fp32",
    "64-true": "fp64",
    "16-mixed": "fp16",
    "bf16-mixed": "bf16",
    "16-true": "fp16-pure",
    "bf16-true": "bf16-pure",
    "transformer-engine": "fp8",
    "transformer-engine-float16": "fp8",
}
# accelerate's ``mixed_precision=`` (an ``Accelerator``'s, or ``accelerate launch``'s), an accelerate loop's
ACCELERATE_PRECISIONS: dict[str, str] = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}
FRAMEWORK_PRECISIONS: dict[str, dict[str, str]] = {
    "Fabric": LIGHTNING_PRECISIONS,
    "accelerate": ACCELERATE_PRECISIONS,
}

LOW_PRECISION_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}  # what autocast computes in


def requested_low_dtype(requested: str) -> str | None:
    """The dtype a requested precision ("bf16", "fp16-pure", "16-mixed" mapped by the caller) computes
    matmuls in; None for fp32, tf32, fp64 or nothing requested."""
    req = (requested or "").lower()
    return next((dt for p, dt in LOW_PRECISION_DTYPE.items() if req.startswith(p)), None)


# the dtypes autocast computes nothing in: float32 ops it does not list stay float32, float64 ops it leaves alone
FULL_PRECISION_DTYPES: tuple[str, ...] = ("float32", "float64")


def narrowest_dtype(text: str) -> str:
    """The one dtype an activation row stands for, where a module called more than once in a step joins the
    dtypes of its calls ("bfloat16|float32": called inside autocast and outside it; "float32|float64": fed
    float32 and float64 inputs): the first of them that is neither float32 nor float64 (a 16- or 8-bit dtype
    one of its calls ran in: the low precision reached that layer), else float32, else float64; "" for a row
    without its dtype. Every reader that classes a layer by its dtype (mixed precision active or not, a float32
    layer, a float64 layer) goes by this, so that each layer is in one class: a float64 layer's every output
    was float64, a float32 layer's none was 16-bit."""
    parts = [p for p in text.split("|") if p]
    low = [p for p in parts if p not in FULL_PRECISION_DTYPES]
    return low[0] if low else next((d for d in FULL_PRECISION_DTYPES if d in parts), "")


def narrowest_dtypes(dtypes: pd.Series) -> pd.Series:
    """``narrowest_dtype`` of each row of a dtype column (missing values as ""), decided once per distinct
    value."""
    col = texts(dtypes).astype(object)
    return col.map({v: narrowest_dtype(str(v)) for v in col.unique()}).astype(object)


def matmul_activation_dtypes(layers: pd.DataFrame) -> dict[str, str]:
    """Activation dtype per matmul layer at the last sampled step ({} when none was recorded): the narrowest of
    a layer called with several (``narrowest_dtype``)."""
    if layers.empty:
        return {}
    acts = layers[layers[T.TENSOR] == T.ACTIVATION]
    acts = acts[acts[T.MODULE_TYPE].map(lambda t: is_matmul_type(str(t)))]
    if acts.empty:
        return {}
    last = acts[acts[T.STEP] == acts[T.STEP].max()]
    return dict(zip(last[T.MODULE], narrowest_dtypes(last[T.DTYPE]), strict=True))


def float32_matmul_layers(layers: pd.DataFrame) -> tuple[list[str], int]:
    """(matmul layers whose activations were float32 at the last sampled step, how many matmul layers there
    were): with a low precision requested, the layers where it is not active."""
    dtypes = matmul_activation_dtypes(layers)
    return sorted(m for m, d in dtypes.items() if d == "float32"), len(dtypes)


# the module types whose matmuls run in FP8: torchao's float8 training layer (convert_to_float8_training swaps
# nn.Linear for it). Transformer Engine's te.Linear is named "Linear", like nn.Linear: its type says nothing.
FP8_MODULE_TYPES: frozenset[str] = frozenset({"Float8Linear"})
# the weight types of torchao's float8 training applied by ``quantize_(model, Float8TrainingOpConfig(...))``: the
# ``nn.Linear`` stays, its weight (and bias) becomes a tensor subclass whose matmuls cast their operands to FP8 as a
# ``Float8Linear``'s do (its ``config`` holds the recipe, a ``Float8LinearConfig`` within)
FP8_WEIGHT_TYPES: frozenset[str] = frozenset({"Float8TrainingWeightWrapperTensor"})
# the module types whose matmuls run in a block-scaled format: torchao's MX training layers (0.18's
# ``MXFP8Linear`` of ``torchao.prototype.moe_training``, earlier releases' ``MXLinear``), each GEMM quantising its
# operands in blocks of 32 values with one power-of-two scale each, and 0.18's ``NVFP4Linear`` (``quantize_`` with
# ``NVFP4TrainingConfig`` swaps nn.Linear for it: blocks of 16 FP4 values with an E4M3 scale each, its kernels
# Triton's alone, on CUDA)
BLOCK_MODULE_TYPES: frozenset[str] = frozenset({"MXFP8Linear", "MXLinear", "NVFP4Linear"})
# the weight types of torchao's MX training applied by ``quantize_(model, MXFP8TrainingOpConfig(...))``: the
# ``nn.Linear`` stays, its weight becomes a tensor subclass whose matmuls quantise their operands as an
# ``MXFP8Linear``'s do (its ``config`` holds the recipe)
BLOCK_WEIGHT_TYPES: frozenset[str] = frozenset({"MXFP8TrainingWeightWrapperTensor"})


def fp8_linear_layers(layers: pd.DataFrame, recorded: Collection[str] = ()) -> tuple[list[str], int]:
    """(linear layers whose module type runs its GEMMs in FP8, or that the capture recorded as running an FP8
    recipe (``recorded``: the layers of ``capture.fp8_recipe``, an ``nn.Linear`` whose weight torchao's
    ``quantize_`` made an FP8 training weight among them), how many linear layers there were), from the layers
    table: what confirms that an fp8 run's FP8 GEMMs ran, which the dtypes cannot (a Float8Linear's output is
    bf16 under autocast, as a bf16 layer's)."""
    return _linear_layers_of(layers, FP8_MODULE_TYPES, recorded)


def block_linear_layers(layers: pd.DataFrame, recorded: Collection[str] = ()) -> tuple[list[str], int]:
    """(linear layers whose module type runs its GEMMs in an MX format, or that the capture recorded as running
    one (``recorded``: the layers of ``capture.block_recipe``, an ``nn.Linear`` whose weight torchao's
    ``quantize_`` made an MX training weight among them), how many linear layers there were): what confirms
    that an MX run's block-scaled GEMMs ran (an MXFP8Linear's output has its input's dtype)."""
    return _linear_layers_of(layers, BLOCK_MODULE_TYPES, recorded)


def _linear_layers_of(
    layers: pd.DataFrame, kinds: frozenset[str], recorded: Collection[str] = ()
) -> tuple[list[str], int]:
    """(linear layers of a module type in ``kinds`` or named in ``recorded``, how many linear layers there
    were), from the layers table."""
    if layers.empty or T.MODULE_TYPE not in layers:
        return [], 0
    types = layers[[T.MODULE, T.MODULE_TYPE]].drop_duplicates()
    # a missing type reads as "" (pandas 3's astype(str) keeps NaN a NaN; a column of NaN alone is float64)
    types = types[texts(types[T.MODULE_TYPE]).map(is_linear_type)]
    named = set(recorded)
    found = sorted(
        {
            str(m)
            for m, t in zip(types[T.MODULE], types[T.MODULE_TYPE], strict=True)
            if str(t) in kinds or str(m) in named
        }
    )
    return found, int(types[T.MODULE].nunique())


def mixed_precision_check(requested: str, layers: pd.DataFrame) -> dict[str, Any]:
    """Whether the requested low precision is what the matmul layers ran in.

    Returns ``{"mixed_precision_requested", "mixed_precision_active", "matmul_layers_float32",
    "matmul_layers"}`` for summary.json's ``capture`` block. Active means: a low precision was requested and
    at least one matmul layer produced a tensor in something other than float32 or float64 (in one of its calls:
    ``narrowest_dtype``).
    """
    dtypes = matmul_activation_dtypes(layers)
    n = len(dtypes)
    # a float64 layer is no more active than a float32 one: autocast leaves float64 ops alone (a layer of
    # several dtypes, by the narrowest: active where one of its calls ran in 16 bits)
    full = [d for d in dtypes.values() if d in FULL_PRECISION_DTYPES]
    active = requested_low_dtype(requested) is not None and n > 0 and len(full) < n
    return {
        "mixed_precision_requested": requested,
        "mixed_precision_active": active,
        "matmul_layers_float32": sum(d == "float32" for d in full),
        "matmul_layers": n,
    }


def low_precision_seen(layers: pd.DataFrame) -> bool:
    """Whether any module produced a 16-bit or 8-bit floating tensor (autocast or a pure mode was active), in any
    of its calls (``narrowest_dtype``)."""
    if layers.empty:
        return False
    low = ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
    return bool(narrowest_dtypes(layers[T.DTYPE]).isin(low).any())


def summary_requested(summary: Mapping[str, Any], default: str = "") -> str:
    """The precision a run asked for: the capture block's ``mixed_precision_requested`` when set (the
    integrations record the framework's request there), else ``default``."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    req = capture.get("mixed_precision_requested") if isinstance(capture, Mapping) else None
    return req.lower() if isinstance(req, str) and req else default


def precision_trained(summary: Mapping[str, Any], asked: str) -> str:
    """The precision mode a run trained in: the one the profiler saw it train in (``capture.precision_seen``: its
    autocast, layers and parameters' dtypes; ``with_precision_seen``'s off the layers) where that is one of the
    modes (``precprof.modes``), "fp64" (a float64 model, which autocast leaves alone) or ``asked`` is "", else
    ``asked`` (what its configuration asked for; a run recorded before ``precision_seen`` was). They differ where
    the framework trained in another than it was asked for (accelerate trains ``TrainingArguments(fp16=True)`` in
    fp32 on a CPU; ``--precision bf16`` trains a float64 model in float64): what the run trained in is the seen
    one, and only the precision check and its finding speak of the request."""
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    seen = str(capture.get("precision_seen") or "") if isinstance(capture, Mapping) else ""
    return seen if seen and (seen in PRECISIONS or seen == FP64 or not asked) else asked


_LOW_MODES = {"bfloat16": "bf16", "float16": "fp16"}
PRECISION_FROM_LAYERS = "layers"  # capture.precision_from of a precision read off the layers' dtypes


def precision_in_layers(layers: pd.DataFrame) -> str:
    """The precision mode a layers table's dtypes show, named as ``Profiler.precision_seen`` names the one its
    hooks saw: a pure mode ("bf16-pure") where most parameter elements (the weight rows, each parameter once)
    are 16-bit, "fp64" where they are float64 and no module made 16-bit activations (autocast leaves float64 ops
    alone; where it cast a float32 part, its mode), autocast's ("bf16", "fp16")
    where a module with parameters produced 16-bit activations, else "fp32"; "" where the table cannot tell: no rows, or torchao's FP8 or block-format layers (their modes are no
    dtype)."""
    if layers.empty or not {T.TENSOR, T.DTYPE, T.MODULE}.issubset(layers.columns):
        return ""
    if (
        T.MODULE_TYPE in layers
        and texts(layers[T.MODULE_TYPE]).isin(FP8_MODULE_TYPES | BLOCK_MODULE_TYPES).any()
    ):
        return ""
    kinds, dtypes = texts(layers[T.TENSOR]), texts(layers[T.DTYPE])
    weights = layers[(kinds == T.WEIGHT).to_numpy()]
    if T.PARAM in weights:
        weights = weights.drop_duplicates([T.MODULE, T.PARAM])
    sizes = pd.to_numeric(weights[T.NUMEL], errors="coerce").groupby(texts(weights[T.DTYPE])).sum()
    main = str(sizes.idxmax()) if len(sizes) and sizes.max() > 0 else ""
    if main in _LOW_MODES:
        return f"{_LOW_MODES[main]}-pure"
    acts = dtypes[((kinds == T.ACTIVATION) & layers[T.MODULE].isin(set(weights[T.MODULE]))).to_numpy()]
    low = acts[acts.isin(_LOW_MODES)]
    if main == "float64" and not len(low):  # (16-bit activations: autocast cast the float32 part, its mode)
        return FP64
    if len(low):
        return _LOW_MODES[str(low.value_counts().idxmax())]
    return "fp32" if len(acts) or len(weights) else ""


def with_precision_seen(summary: Mapping[str, Any], layers: pd.DataFrame) -> dict[str, Any]:
    """``summary`` with the precision its layers' dtypes show (``precision_in_layers``) as ``capture``'s
    ``precision_seen`` where its capture block has none: a run killed before it saved, whose first summary was
    written before any forward pass (its report named no precision); ``capture.precision_from`` is then
    ``PRECISION_FROM_LAYERS``. "fp32" is "tf32" where the run's machine had TF32 matmuls on, as
    ``precision_seen`` says on a GPU."""
    capture = summary.get(T.SUMMARY_CAPTURE)
    capture = capture if isinstance(capture, Mapping) else {}
    if "precision_seen" in capture or not (seen := precision_in_layers(layers)):
        return dict(summary)
    hw = summary.get(T.SUMMARY_HARDWARE)
    if (
        seen == "fp32"
        and isinstance(hw, Mapping)
        and hw.get("device") == "cuda"
        and hw.get("tf32_matmul_enabled")
    ):
        seen = "tf32"
    return {
        **summary,
        T.SUMMARY_CAPTURE: {**capture, "precision_seen": seen, "precision_from": PRECISION_FROM_LAYERS},
    }
