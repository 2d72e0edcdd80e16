"""The recommendation as code to paste: plain PyTorch, Hugging Face, Lightning, FSDP and torchao.

Pure text generation from the recommendation's dict form (``Recommendation.to_dict()``, the shape stored in
summary.json), so that the report can show it without importing the advisor. Module names are user data: they
appear in the code only as Python string literals (``repr``), never in comments or as code.

Every snippet assumes the names of a training script: ``model``, ``optimizer``, ``loader`` (yielding
``inputs, targets``) and ``loss_fn``; ``device_type`` is set at the top to the target's device type
(``"cuda"``, or ``"cpu"`` for a plan made for a CPU; a recommendation that does not say is for CUDA), so that the
code can be tried on another device by changing one line.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from typing import Any

FRAMEWORKS: tuple[str, ...] = ("pytorch", "hf", "lightning", "fsdp", "torchao")

LABELS: dict[str, str] = {
    "pytorch": "PyTorch",
    "hf": "Hugging Face Trainer",
    "lightning": "Lightning",
    "fsdp": "FSDP",
    "torchao": "torchao (FP8)",
}

SNIPPET_FORMATS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8")

_FORMAT_LABEL = {"fp32": "FP32", "tf32": "TF32", "bf16": "BF16", "fp16": "FP16", "fp8": "FP8"}

_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp8": "torch.bfloat16"}

_DEFAULT_SCALE = 2.0**16

_DEFAULT_GROWTH = 2000

_HEAD = "# assumes model, optimizer, loader (inputs, targets) and loss_fn from your training script"

_RUN_IN_FP32 = '''\
def run_in_fp32(module):
    """Run ``module`` outside autocast, in float32: its floating-point inputs are cast to float32."""
    forward = module.forward

    def _cast(x):
        return x.float() if torch.is_tensor(x) and x.is_floating_point() else x

    def fp32_forward(*args, **kwargs):
        with torch.autocast(device_type, enabled=False):
            return forward(*[_cast(a) for a in args], **{k: _cast(v) for k, v in kwargs.items()})

    module.forward = fp32_forward
    return module'''

# torchao's FP8 layers beat bf16 only compiled (the speed the advisor estimates is compiled FP8 against compiled
# bf16); eager, their casts run as separate kernels and a step is slower than bf16's
_COMPILE_NOTE = "FP8 beats BF16 only compiled (eager, it is slower than BF16)"

_TF32 = """\
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
torch.set_float32_matmul_precision("high")"""


def frameworks(fmt: str) -> tuple[str, ...]:
    """The frameworks a snippet exists for: torchao only for fp8."""
    return FRAMEWORKS if fmt == "fp8" else tuple(f for f in FRAMEWORKS if f != "torchao")


def scale_literal(value: Any) -> str:
    """``value`` as a Python expression: ``2.0**k`` for a positive power of two, else the exact float."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = _DEFAULT_SCALE
    if not math.isfinite(x):
        return f'float("{x!r}")'
    m, e = math.frexp(x)
    if x > 0 and m == 0.5:
        return f"2.0**{e - 1}"
    return repr(x)


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return default


def _comment(text: str) -> list[str]:
    """``text`` as comment lines of at most 110 characters."""
    return ["# " + line for line in textwrap.wrap(text, 108, break_on_hyphens=False)]


def _names(values: Any) -> list[str]:
    return [str(v) for v in values or []]


def _list_literal(names: list[str], brackets: str = "[]") -> str:
    if not names:
        return "set()" if brackets == "{}" else "[]"
    items = [repr(n) for n in names]
    one = brackets[0] + ", ".join(items) + brackets[1]
    if len(one) <= 80:
        return one
    return brackets[0] + "\n" + "".join(f"    {i},\n" for i in items) + brackets[1]


class _Plan:
    """The fields a snippet needs, read defensively from the dict (an edited summary.json may hold anything)."""

    def __init__(self, rec: Mapping[str, Any], fmt: str) -> None:
        self.fmt = fmt
        # fp16's code beside a verdict of another format keeps what fp16 needs, not that format's list; the code of
        # the format the measurements allow, beside the small model's fp32, what that format needs and converts
        # (a summary written before a field existed has the verdict's alone)
        other = fmt != rec.get("format")
        measured = other and fmt == rec.get("measured_format")
        keep = (
            "fp16_keep_fp32" if other and fmt == "fp16" else "measured_keep_fp32" if measured else "keep_fp32"
        )
        self.keep = _names(rec.get(keep, rec.get("keep_fp32")))
        self.fp8 = _names(rec.get("measured_fp8_layers" if measured else "fp8_layers", rec.get("fp8_layers")))
        scale = rec.get("loss_scale") if rec.get("format") == "fp16" else None
        self.scale = scale_literal(scale if scale is not None else rec.get("fp16_loss_scale", _DEFAULT_SCALE))
        self.growth = _int(rec.get("growth_interval"), _DEFAULT_GROWTH)
        if self.growth <= 0:
            self.growth = _DEFAULT_GROWTH
        self.device = '"cpu"' if rec.get("device") == "cpu" else '"cuda"'  # a Python literal
        # fp16's code for a plan whose measurements rule fp16 out: its scale is no recommendation
        self.ruled_out = fmt == "fp16" and rec.get("format") != "fp16" and bool(rec.get("fp16_ruled_out"))
        # fp16's scale sized on a lower bound of the largest gradient (it came with inf or nan): an upper limit
        self.at_most = fmt == "fp16" and bool(rec.get("fp16_loss_scale_at_most"))
        self.said = "sized" if self.ruled_out or self.at_most else "recommended"
        # the layers the run already trains in torchao's low-precision layers (layer -> "fp8" or a block format);
        # a summary written before running_formats has the block plan's MX layers alone
        running = rec.get("running_formats")
        if not isinstance(running, Mapping):
            running = (rec.get("block_what_if") or {}).get("running")
        running = running if isinstance(running, Mapping) else {}
        # its FP8 layers (torchao's float8 training), which a snippet of another format takes out of FP8
        self.fp8_run = [str(m) for m, f in running.items() if f == "fp8"]
        # its block-format layers (torchao's MX and NVFP4 layers) and their formats, which the block plan covers
        self.block_run = {str(m): str(f) for m, f in running.items() if f != "fp8"}
        self.running = len(self.block_run)
        # those of them whose weight quantize_ made a torchao training weight (the module left an nn.Linear)
        self.wrapped = set(_names(rec.get("wrapped_weight_layers")))
        self.fp8_wrapped = [m for m in self.fp8_run if m in self.wrapped]

    @property
    def dtype(self) -> str:
        return _DTYPE[self.fmt]

    @property
    def autocast(self) -> bool:
        return self.fmt in _DTYPE

    def keep_block(self, getter: str = "model.get_submodule") -> list[str]:
        if not self.keep or not self.autocast:
            return []
        return [
            "",
            "",
            _RUN_IN_FP32,
            "",
            "",
            f"keep_fp32 = {_list_literal(self.keep)}",
            "for name in keep_fp32:",
            f"    run_in_fp32({getter}(name))",
        ]

    def fp8_import(self) -> list[str]:
        """FP8's import: torchao's ``convert_to_float8_training``, or, for a run that converted its FP8 layers
        with ``quantize_``, ``quantize_`` and its config where more layers are to convert (none where none is)."""
        if not self.fp8_wrapped:
            return ["from torchao.float8 import convert_to_float8_training"]
        if not self._fp8_to_convert():
            return []
        return [
            "from torchao.prototype.moe_training.config import Float8TrainingOpConfig",
            "from torchao.quantization import quantize_",
        ]

    def _fp8_to_convert(self) -> list[str]:
        """The eligible layers this run does not train in FP8 yet."""
        return [m for m in self.fp8 if m not in self.fp8_run]

    def fp8_block(self, target: str = "model") -> list[str]:
        if self.fp8_wrapped:
            return self._fp8_kept(target)
        lines = [
            f"fp8_layers = {_list_literal(self.fp8, '{}')}",
            "convert_to_float8_training(",
            f"    {target}, module_filter_fn=lambda mod, fqn: fqn in fp8_layers",
            ")",
        ]
        if not self.fp8:
            lines.insert(0, "# the recommendation lists no FP8-eligible layer: nothing is converted")
        return lines

    def _fp8_kept(self, target: str) -> list[str]:
        """FP8's code for a run that already trains layers in FP8 through ``quantize_`` (their weights torchao's FP8
        training weights, the modules nn.Linear): those stay as converted; the eligible layers not in FP8 yet are
        converted the same way (``convert_to_float8_training`` would swap such a layer for a Float8Linear around
        its FP8 training weight, casting it to FP8 twice); the run's FP8 layers the plan finds not eligible are
        named, to take out of the conversion."""
        modules = len(self.fp8_run) - len(self.fp8_wrapped)
        how = f"{len(self.fp8_wrapped)} through quantize_ (Float8TrainingOpConfig: FP8 training weights)"
        if modules:
            how += f", {modules} as Float8Linear (convert_to_float8_training)"
        lines = _comment(
            f"FP8 already: this run trains {len(self.fp8_run)} layer(s) in FP8 with torchao, {how}; keep those "
            "conversions, which this code does not repeat"
        )
        lines += [f"fp8_in_this_run = {_list_literal(self.fp8_run)}"]
        more = self._fp8_to_convert()
        if more:
            lines += _comment(
                "the eligible layers not in FP8 yet: convert them with quantize_ as well (convert_to_float8_training "
                "would swap a quantize_ layer for a Float8Linear around its FP8 training weight, casting it twice)"
            )
            lines += [
                f"fp8_layers = {_list_literal(more, '{}')}",
                "quantize_(  # with the config your quantize_ call used",
                f"    {target}, Float8TrainingOpConfig(), filter_fn=lambda mod, fqn: fqn in fp8_layers",
                ")",
            ]
        elif self.fp8:
            lines += ["# every FP8-eligible layer already trains in FP8: nothing more to convert"]
        else:
            lines += ["# the recommendation lists no FP8-eligible layer: nothing more to convert"]
        leave = [m for m in self.fp8_run if m not in self.fp8]
        if leave:
            lines += _comment(
                "the plan finds these FP8 layers of the run not FP8-eligible: leave them out of the filter that "
                "converted them"
            )
            lines += [f"fp8_not_eligible = {_list_literal(leave)}"]
        return lines

    def block_kept(self) -> list[str]:
        """For a format other than FP32 (whose heading says it), what its code does to the layers this run trains
        in a block format (torchao's MX and NVFP4 layers): it keeps them so, as autocast does not undo their
        conversion; to train them as the code trains the rest, the conversion goes, named by how it was made;
        [] for a run without them."""
        if self.fmt == "fp32" or not self.block_run:
            return []
        made: dict[str, int] = {}
        for m, f in self.block_run.items():
            how = (
                "quantize_ with MXFP8TrainingOpConfig"
                if m in self.wrapped
                else "NVFP4Linear (quantize_ with NVFP4TrainingConfig)"
                if f == "nvfp4"
                else "MXFP8Linear"
            )
            made[how] = made.get(how, 0) + 1
        formats = "/".join(dict.fromkeys(f.upper() for f in self.block_run.values()))
        said = ", ".join(f"{how} for {n}" for how, n in made.items())
        return [
            *_comment(
                f"Block formats kept: this run trains the {len(self.block_run)} layer(s) below in {formats} with "
                "torchao's MX or NVFP4 layers, and this code keeps them so (autocast does not undo that "
                "conversion: such a layer quantises its matmuls' operands in blocks with autocast or without). To "
                f"train them as the rest, remove the conversion that made them ({said}); the block-format "
                "finding says which format suits each"
            ),
            f"block_format_in_this_run = {_list_literal(list(self.block_run))}",
        ]

    def conversions(self) -> list[str]:
        """What a snippet says of the run's own torchao conversions: the FP8 ones it undoes (``fp8_undone``),
        the block-format ones it keeps (``block_kept``)."""
        return [*self.fp8_undone(), *self.block_kept()]

    def fp8_undone(self) -> list[str]:
        """For a format other than FP8, what it asks of the layers this run trained in FP8 (torchao's float8
        training): they leave it, which autocast and run_in_fp32 do not do (a Float8Linear casts its operands to
        FP8 inside autocast or out of it); [] for FP8's code or a run without FP8 layers."""
        if self.fmt == "fp8" or not self.fp8_run:
            return []
        return [
            f"# No FP8: this run trained the {len(self.fp8_run)} layer(s) below with torchao's float8 "
            "training; remove the",
            "# convert_to_float8_training (or quantize_ with Float8TrainingOpConfig) call that converted them (a "
            "converted",
            "# layer casts its matmuls' operands to FP8 with autocast or without)",
            f"fp8_in_this_run = {_list_literal(self.fp8_run)}",
        ]

    def scaler(self, cls: str = "torch.amp.GradScaler", device: str = "device_type") -> str:
        return f"{cls}({device}, init_scale={self.scale}, growth_interval={self.growth})"


def _loop(plan: _Plan) -> list[str]:
    lines = ["for inputs, targets in loader:", "    optimizer.zero_grad(set_to_none=True)"]
    if plan.autocast:
        lines += [
            f"    with torch.autocast(device_type, dtype={plan.dtype}):",
            "        loss = loss_fn(model(inputs), targets)",
        ]
    else:
        lines += ["    loss = loss_fn(model(inputs), targets)"]
    if plan.fmt == "fp16":
        lines += [
            "    scaler.scale(loss).backward()",
            "    scaler.unscale_(optimizer)  # true gradients from here: clip them here if you clip",
            "    scaler.step(optimizer)  # skips the step when a gradient is inf or nan",
            "    scaler.update()",
        ]
    else:
        lines += ["    loss.backward()", "    optimizer.step()"]
    return lines


def _pytorch(plan: _Plan) -> list[str]:
    fmt = plan.fmt
    out = ["import torch"]
    if fmt == "fp8":
        out += plan.fp8_import()
    out += ["", _HEAD, f"device_type = {plan.device}"]
    if fmt == "fp32" and plan.running:
        out += [
            f"# FP32 for all but the {plan.running} block-format layer(s) the run converted (torchao's MX or NVFP4 layers):",
            "# no autocast and no GradScaler; for those layers see the block-format finding",
        ]
    elif fmt == "fp32" and plan.fp8_run:  # the loop stays, the conversion goes (plan.fp8_undone)
        out += ["# FP32: no autocast and no GradScaler"]
    elif fmt == "fp32":
        out += ["# FP32: no autocast and no GradScaler, the loop stays as it is"]
    elif fmt == "tf32":
        out += ["# TF32: FP32 weights and activations, matmuls and convolutions on TF32 tensor cores", _TF32]
    elif fmt == "bf16":
        out += ["# BF16 autocast: no GradScaler (BF16 has FP32's range)"]
    elif fmt == "fp16":
        out += [f"# FP16 autocast with a GradScaler at the {plan.said} initial scale and growth interval"]
    else:
        out += ["# FP8 training for the eligible layers (torchao), BF16 autocast for the rest", ""]
        out += plan.fp8_block()
    out += plan.conversions()
    out += plan.keep_block()
    if fmt == "fp8":
        out += ["", f"model = torch.compile(model)  # {_COMPILE_NOTE}"]
    if fmt == "fp16":
        out += ["", f"scaler = {plan.scaler()}"]
    out += ["", *_loop(plan)]
    return out


def _hf(plan: _Plan) -> list[str]:
    fmt = plan.fmt
    out = ["import torch", "from transformers import Trainer, TrainingArguments", ""]
    out += ["# assumes model and train_dataset from your training script"]
    flags = {
        "bf16": "bf16=True",
        "fp16": "fp16=True",
        "tf32": "tf32=True",
        "fp8": "bf16=True, torch_compile=True",
    }
    if fmt == "fp8":
        out[1:1] = plan.fp8_import()
        out += [
            "# FP8 for the eligible layers (torchao) before building the Trainer, BF16 autocast for the rest"
        ]
        out += [*plan.fp8_block(), ""]
    if plan.keep and plan.autocast:
        out += [f"device_type = {plan.device}", *plan.keep_block(), ""]
    if fmt == "fp32":
        out += ["# FP32 is the Trainer's default: no bf16/fp16 flag"]
    out += plan.conversions()
    if fmt == "fp8":
        out += [f"# torch_compile=True: {_COMPILE_NOTE}"]
    args = ['output_dir="out"'] + ([flags[fmt]] if fmt in flags else [])
    out += ["args = TrainingArguments(" + ", ".join(args) + ")"]
    out += ["trainer = Trainer(model=model, args=args, train_dataset=train_dataset)"]
    if fmt == "fp16":
        out += [
            "# TrainingArguments has no init_scale: the Trainer's GradScaler starts at 2**16 with growth_interval",
            f"# 2000; replace it before train() to start at the {plan.said} scale",
            f"trainer.accelerator.scaler = {plan.scaler(device=plan.device)}",
        ]
    out += ["trainer.train()"]
    return out


def _lightning(plan: _Plan) -> list[str]:
    fmt = plan.fmt
    out = ["import lightning as L", "import torch"]
    if fmt == "fp8":
        out += plan.fp8_import()
    if fmt == "fp16":
        out.append("from lightning.pytorch.plugins import MixedPrecision")
    out += ["", "# assumes model (a LightningModule) and loader from your training script"]
    if fmt == "tf32":
        out += [_TF32, ""]
    if fmt == "fp8":
        out += ["# in your LightningModule's configure_model (or before fit): FP8 for the eligible layers"]
        out += [*plan.fp8_block(), ""]
    if plan.conversions():
        out += [*plan.conversions(), ""]
    if plan.keep and plan.autocast:
        out += [f"device_type = {plan.device}", *plan.keep_block(), ""]
    if fmt == "fp8":
        out += [f"model = torch.compile(model)  # {_COMPILE_NOTE}"]
    if fmt == "fp16":
        out += [
            f"# precision='16-mixed' with the {plan.said} GradScaler (Trainer(precision=...) would start at 2**16)",
            f"scaler = {plan.scaler(device=plan.device)}",
            f'trainer = L.Trainer(plugins=[MixedPrecision("16-mixed", {plan.device}, scaler=scaler)])',
        ]
    else:
        precision = {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed", "fp8": "bf16-mixed"}[fmt]
        out += [f'trainer = L.Trainer(precision="{precision}")']
    if fmt == "fp8":
        out += [
            '# or Trainer(precision="transformer-engine"): Transformer Engine FP8 for every nn.Linear,'
            " without the layer filter"
        ]
    out += ["trainer.fit(model, loader)"]
    return out


def _fsdp(plan: _Plan) -> list[str]:
    fmt = plan.fmt
    out = ["import torch", "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP"]
    out += ["from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard"]
    if fmt == "fp8":
        out += plan.fp8_import()
    if fmt == "fp16":
        out.append("from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler")
    out += ["", "# assumes model from your training script, in an initialised process group"]
    if fmt == "tf32":
        out += [_TF32, ""]
    if fmt == "fp8":
        out += ["# FP8 for the eligible layers, before sharding", *plan.fp8_block(), ""]
    if plan.conversions():
        out += [*plan.conversions(), ""]
    keep = plan.keep and plan.autocast
    if keep:
        out += [f"keep_fp32 = {_list_literal(plan.keep)}", ""]
    if not plan.autocast:
        out += [f"# {_FORMAT_LABEL[fmt]}: no mixed-precision policy", "# FSDP1", "model = FSDP(model)"]
        out += ["# FSDP2 (fully_shard): shard each block, then the root", "# fully_shard(model)"]
    else:
        dt = plan.dtype
        out += [
            "# FSDP1: compute in the low dtype, reduce gradients and keep buffers in FP32",
            f"mp = MixedPrecision(param_dtype={dt}, reduce_dtype=torch.float32, buffer_dtype=torch.float32)",
        ]
        if keep:
            out += [
                "# the kept modules get their own FSDP unit in FP32 (wrap them before the root)",
                "fp32_mp = MixedPrecision(param_dtype=torch.float32, cast_forward_inputs=True)",
                "for name in keep_fp32:",
                "    parent, _, child = name.rpartition('.')",
                "    owner = model.get_submodule(parent)",
                "    setattr(owner, child, FSDP(owner.get_submodule(child), mixed_precision=fp32_mp))",
            ]
        out += ["model = FSDP(model, mixed_precision=mp)", ""]
        out += [
            "# FSDP2 (fully_shard) instead of FSDP1:",
            f"# policy = MixedPrecisionPolicy(param_dtype={dt}, reduce_dtype=torch.float32)",
        ]
        if keep:
            out += [
                "# fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)",
                "# for name in keep_fp32:",
                "#     fully_shard(model.get_submodule(name), mp_policy=fp32_policy)",
            ]
        out += ["# fully_shard(model, mp_policy=policy)  # after each block, as for any fully_shard model"]
    if fmt == "fp8":
        out += ["", f"model = torch.compile(model)  # after sharding; {_COMPILE_NOTE}"]
    if fmt == "fp16":
        out += ["", "# FP16 needs a GradScaler that knows about sharded gradients"]
        out += [f"scaler = {plan.scaler('ShardedGradScaler', device=plan.device)}"]
        out += ["# then the loop as in plain PyTorch: scaler.scale(loss).backward(), step, update"]
    return out


def _torchao(plan: _Plan) -> list[str]:
    out = ["import torch", *plan.fp8_import(), ""]
    out += ["# FP8 training for the eligible layers; the other layers run under BF16 autocast"]
    out += plan.fp8_block()
    out += plan.block_kept()
    out += [f"model = torch.compile(model)  # {_COMPILE_NOTE}"]
    return out


_BUILDERS = {"pytorch": _pytorch, "hf": _hf, "lightning": _lightning, "fsdp": _fsdp, "torchao": _torchao}


def snippet(rec: Mapping[str, Any], framework: str = "pytorch", fmt: str | None = None) -> str:
    """The code that sets up ``rec``'s format (or ``fmt``) in ``framework``, as one string ending in a newline.

    When the measurements allow another format than the recommended one (``measured_format``), a comment
    says so; ``snippet(rec, framework, rec["measured_format"])`` gives the code for that one. fp16's code for a
    recommendation that rules fp16 out (``fp16_ruled_out``) says so in a comment above it, and that its scale is
    the most a start can be (``fp16_loss_scale_at_most``) likewise, never calling it the recommended one.
    """
    fmt = str(rec.get("format") or "") if fmt is None else fmt
    if fmt not in SNIPPET_FORMATS:
        raise ValueError(f"no snippet for format {fmt!r}; expected one of {', '.join(SNIPPET_FORMATS)}")
    if framework not in frameworks(fmt):
        raise ValueError(f"no {fmt} snippet for {framework!r}; expected one of {', '.join(frameworks(fmt))}")
    plan = _Plan(rec, fmt)
    lines = _BUILDERS[framework](plan)
    if plan.ruled_out:
        # asked for by name: the code is given, without passing its scale off as one that works
        lines = [
            "# precprof: the measurements rule FP16 out for this model (the recommendation's reasons say why);",
            "# the GradScaler below starts at the scale sized on the largest gradient, which does not make it fit",
            *lines,
        ]
    elif plan.at_most:
        lines = [
            "# precprof: this run's largest gradients came with inf or nan (fp16 overflow), so init_scale below",
            "# is the most a start can be, not a scale known to fit: the GradScaler backs off until steps pass",
            *lines,
        ]
    measured = str(rec.get("measured_format") or "")
    if fmt == rec.get("format") and measured in SNIPPET_FORMATS and measured != fmt:
        lines = [
            f"# precprof: {_FORMAT_LABEL[fmt]} is the default for a model this small; the measurements allow "
            f"{_FORMAT_LABEL[measured]}",
            f"# (measure its gain with `precprof compare`; its code is the {_FORMAT_LABEL[measured]} snippet)",
            *lines,
        ]
    return "\n".join(lines) + "\n"


def snippets(rec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, code) for every framework, then for the format the measurements allow when it differs."""
    fmt = str(rec.get("format") or "")
    if fmt not in SNIPPET_FORMATS:
        return []
    out = [(LABELS[f], snippet(rec, f)) for f in frameworks(fmt)]
    measured = str(rec.get("measured_format") or "")
    if measured in SNIPPET_FORMATS and measured != fmt:
        label = _FORMAT_LABEL[measured]
        out += [
            (f"{LABELS[f]}: {label}, as measured", snippet(rec, f, measured)) for f in frameworks(measured)
        ]
    return out
