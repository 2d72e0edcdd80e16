"""What the Profiler records, decided once at attach: the captured modules and parameters, the buffer row of
every tensor they produce, and which rows can hold block-format statistics. The hooks then only look up a
module's slot and add into its rows (``capture/hooks.py``).

Which modules: by default every leaf module plus every module that owns parameters directly; otherwise the
modules whose qualified name matches one of the ``fnmatch`` patterns, or whose type is one of the types
given, each with the parametrizations of its parameters (``<name>.parametrizations.weight`` of a layer under
``weight_norm``: the layer's real parameters, recorded as a run without a filter records them). Per captured
module, rows for its output (``activation``) and the output's gradient (``activation_grad``); per parameter it
owns (the first owner of a tied parameter), a ``weight`` row and, when it can have a gradient (floating point),
a ``weight_grad`` row, frozen or not: a parameter frozen at attach and unfrozen later (gradual unfreezing) has
its gradient read from then on (a row nothing is read into is not written); a matmul layer (a linear layer or a
convolution) also gets a row for its input, written when no captured module produced it (``T.input_module``:
the model's own batch, a function's output), with block formats on or off.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from precprof import _compat, taxonomy
from precprof import tables as T
from precprof._notice import notice
from precprof.capture.records import RowTable, _ModuleSlot, _ParamSlot, calls_key
from precprof.errors import UserError

ModuleFilter = Sequence[str | type[nn.Module]] | None


def reads_block_operands(module_type: str) -> bool:
    """Modules whose own operands get the block-format what-if: linear layers (weight, output gradient and the
    input they read) and embeddings (their weight, for an output head tied to it)."""
    return taxonomy.is_linear_type(module_type) or "Embedding" in module_type


def refuse_lazy(model: nn.Module) -> None:
    """A one-line error for a model whose lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``) have not run yet:
    their parameters have no shape to plan rows, memory or kernels for, and became real ones in place later
    (precprof crashed on them at attach, and ``precprof train``'s memory check did)."""
    lazy = [name for name, p in model.named_parameters() if is_lazy(p)]
    if lazy:
        raise UserError(
            f"the model has {len(lazy)} uninitialized parameter(s) of lazy modules ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): run one forward pass on an example batch before attaching "
            "precprof (for precprof train: in the model's factory), so that they have their shapes"
        )


def leave_out_input_names(plan: CapturePlan, warn: bool = True) -> None:
    """Leave out of ``plan`` a module whose name ends in ``T.INPUT_SUFFIX`` (a ModuleDict key "fc:input", torch
    allows ":" in a name), and its parameters, with a warning naming it: the tables name a layer's input that a
    function computed "<layer>:input", and its rows and histograms would merge with those of the layer "fc"'s
    input, its counts going to the wrong row. Left out, not refused: the rest is profiled, training goes on."""
    clash = {s.name for s in plan.modules if s.name.endswith(T.INPUT_SUFFIX)}
    if not clash:
        return
    first = sorted(clash)[0]
    if warn:
        notice(
            f"precprof: module {first!r}{f' (and {len(clash) - 1} more)' if len(clash) > 1 else ''} is not "
            f"profiled: its name ends in {T.INPUT_SUFFIX!r}, which precprof's tables give a layer's input rows (the "
            f"input of {first.removesuffix(T.INPUT_SUFFIX)!r}, where a function computed it), and its rows would "
            "merge with those; rename it to have it profiled",
        )
    plan.modules = [s for s in plan.modules if s.name not in clash]
    plan.params = [p for p in plan.params if p.module not in clash]


def reads_norm_input(module: nn.Module, module_type: str) -> bool:
    """Whether a sampled step reads ``module``'s input into a row of its own (``T.input_module``) where no captured
    module made it as it is (``GemmInputs._norm_input``): a norm that holds no module (a "PreNorm" wrapper's output
    is its sublayer's). In a pre-norm transformer that input is a residual sum, which no module returns and no
    other row holds; a hand-written RMSNorm squares it in its dtype, and in fp16 a value of |x| >= 256 squares to
    inf and zeroes the norm's row. torch's own norms (``norm_input_dtypes``) are read where that input is fp16
    alone: they compute in fp32 inside, and what their input row tells is the fp16 residual stream's range. The
    advisor's norm and residual-stream rules alone read these rows (``evidence.norm_inputs_aside``)."""
    return taxonomy.kind_of_type(module_type) == taxonomy.NORM and next(module.children(), None) is None


# the floating dtypes whose inputs a user's own norm reads (``reads_norm_input``), and a torch norm's
FLOATING = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point)
_FP16 = frozenset({torch.float16})


def norm_input_dtypes(module: nn.Module) -> frozenset[torch.dtype]:
    """The dtypes of the inputs a norm's row reads (``reads_norm_input``): every floating dtype for a norm of the
    user's code, fp16 alone for torch's own, which compute in fp32 inside."""
    return _FP16 if type(module).__module__.startswith("torch.") else FLOATING


# torch's norms without running statistics, which compute their statistics in fp32 inside for 16-bit inputs (the
# CPU's kernels in opmath, CUDA's in acc_type) and round only their outputs, each with its functional form for
# ``_fp32_inside_here``: a subclass that overrides forward is the user's code
_FP32_INSIDE: tuple[tuple[type[nn.Module], Any], ...] = (
    (nn.LayerNorm, lambda x: nn.functional.layer_norm(x, (2,))),
    (nn.GroupNorm, lambda x: nn.functional.group_norm(x, 1)),
    (nn.RMSNorm, lambda x: nn.functional.rms_norm(x, (2,))),
)


@functools.cache
def _fp32_inside_here(i: int) -> bool:
    """Whether this torch's ``_FP32_INSIDE[i]`` computes in fp32 inside, asked of its kernel: an fp16 row of +-300
    squares to inf in fp16 (300^2 > 65504), which zeroes a norm that squares in fp16, and normalises to +-1 in
    fp32. (A torch whose RMSNorm squared in its input's dtype would have its RMSNorms judged as a user's are.)"""
    norm = _FP32_INSIDE[i][1]
    with torch.no_grad():
        y = norm(torch.tensor([[300.0, -300.0]], dtype=torch.float16))
    return bool(torch.isfinite(y).all()) and float(y.abs().min()) > 0.5


def computes_fp32_inside(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's norms that compute in fp32 inside (``_FP32_INSIDE``, asked of this
    torch's kernel once), its forward torch's (summary capture.norms_fp32_inside)."""
    return any(
        isinstance(module, c) and type(module).forward is c.forward and _fp32_inside_here(i)
        for i, (c, _) in enumerate(_FP32_INSIDE)
    )


def can_have_grad(p: nn.Parameter) -> bool:
    """Whether ``p`` can ever have a gradient: a floating-point (or complex) parameter, whether it requires one
    now or not (a layer frozen at attach may be unfrozen later)."""
    return p.is_floating_point() or p.is_complex()


def selected(name: str, module: nn.Module, module_filter: ModuleFilter) -> bool:
    """Whether ``module`` (named ``name``) is captured under ``module_filter`` (see the module docstring)."""
    if module_filter is None:
        has_children = next(module.children(), None) is not None
        has_params = next(module.parameters(recurse=False), None) is not None
        return (not has_children) or has_params
    for f in module_filter:
        if isinstance(f, str):
            if fnmatch.fnmatchcase(name, f):
                return True
        elif isinstance(module, f):
            return True
    return False


def parametrization_of(name: str, module: nn.Module, chosen: set[str]) -> bool:
    """Whether ``module`` (named ``name``) holds the parametrization of a parameter of a module in ``chosen``
    (``0.parametrizations.weight`` of ``weight_norm(nn.Linear)`` named ``0``): the layer's real parameters
    (``original0``, ``original1``) live there, not in the layer, and its output is the weight the layer uses."""
    if not isinstance(module, parametrize.ParametrizationList):
        return False
    owner, _, attr = name.rpartition(".")[0].rpartition(".")
    return attr == "parametrizations" and owner in chosen


def _check_filter(
    model: nn.Module, module_filter: Sequence[str | type[nn.Module]], captured: list[str]
) -> None:
    """A filter that selects no module is a one-line UserError naming a few of the model's modules as precprof
    names them (its own names: DDP's ``module.``, torch.compile's ``_orig_mod.`` and FSDP1's
    ``_fsdp_wrapped_module.`` are not part of them); a pattern that matches nothing, beside others that do, is
    a warning."""
    said = ", ".join(f if isinstance(f, str) else f.__name__ for f in module_filter)
    if not captured:
        names = [n for n, _ in _compat.named_modules(model) if n][:6]
        raise UserError(
            f"Profiler(modules=[{said}]) selects no module of the model; its modules are named "
            + (", ".join(names) if names else "(none: it has no submodule)")
            + " (the model's own names, without a wrapper's prefix such as module. or _orig_mod.); "
            "patterns are fnmatch patterns such as 'transformer.h.*.attn'"
        )
    idle = [
        f
        for f in module_filter
        if isinstance(f, str) and not any(fnmatch.fnmatchcase(n, f) for n in captured)
    ]
    if idle:
        warnings.warn(
            f"precprof: Profiler(modules=...) pattern(s) {', '.join(map(repr, idle))} match no module of the model "
            "(its own names, without a wrapper's prefix such as module. or _orig_mod.)",
            stacklevel=6,
        )


@dataclass
class CapturePlan:
    """The captured modules (``modules``, in registration order), parameters (``params``) and their rows."""

    modules: list[_ModuleSlot] = field(default_factory=list)
    params: list[_ParamSlot] = field(default_factory=list)
    rows: RowTable = field(default_factory=RowTable)
    block_formats: bool = False
    # the model's modules and parameters when the plan was made, and each one's name (by ``id``): what ``stale``
    # compares
    held: tuple[nn.Parameter, ...] = ()
    held_modules: tuple[nn.Module, ...] = ()
    param_names: list[tuple[int, str]] = field(default_factory=list)
    module_names: list[tuple[int, str]] = field(default_factory=list)
    deals: int = 0  # how many times the block groups were dealt (what a hook's cache of a group is keyed on)
    _types: dict[str, str] | None = field(default=None, repr=False, compare=False)
    _order: tuple[list[tuple[int, int]], dict[str, int]] | None = field(
        default=None, repr=False, compare=False
    )

    @classmethod
    def of(
        cls, model: nn.Module, module_filter: ModuleFilter, block_formats: bool, check: bool = True
    ) -> CapturePlan:
        """The plan of ``model``; ``check``: a filter that selects nothing is an error (at attach, not when a
        model changed mid-run is planned again)."""
        refuse_lazy(model)
        plan = cls(block_formats=block_formats)
        rows = plan.rows
        owner: dict[int, str] = {}  # each captured parameter's first owner
        first: dict[int, tuple[str, str]] = {}  # each parameter's first owner, captured or not: (name, type)
        chosen: set[str] = set()
        for name, module in _compat.named_modules(model):  # by their own names, under DDP or torch.compile
            mtype = taxonomy.type_name(module)
            plan.module_names.append((id(module), name))
            for pname, p in module.named_parameters(recurse=False):
                if id(p) not in first:
                    first[id(p)] = (name, mtype)
                    plan.param_names.append((id(p), f"{name}.{pname}" if name else pname))
            # a filter that picks a layer picks its parametrized weight with it (parents come first)
            picked = module_filter is not None and parametrization_of(name, module, chosen)
            if not (picked or selected(name, module, module_filter)):
                continue
            chosen.add(name)
            key = calls_key(module)  # whether it records its calls' shapes, and under which key
            slot = _ModuleSlot(
                name=name,
                module=module,
                activation=rows.new(name, mtype, T.ACTIVATION),
                activation_grad=rows.new(name, mtype, T.ACTIVATION_GRAD),
                weights=[],
                module_type=mtype,
                gemm=taxonomy.is_linear_type(mtype),
                reads_input=taxonomy.is_matmul_type(mtype),
                call_shapes=[] if key else None,
                call_shapes_key=key,
            )
            # (autocast casts what a convolution reads as it does a linear layer's input; block-scaled GEMMs read
            # a linear layer's alone)
            if slot.reads_input or reads_norm_input(module, mtype):
                itype = T.INPUT_MODULE_TYPE if slot.reads_input else T.NORM_INPUT_MODULE_TYPE
                slot.input = rows.new(T.input_module(name), itype, T.ACTIVATION)
                slot.input_dtypes = FLOATING if slot.reads_input else norm_input_dtypes(module)
                slot.input_blocks = block_formats and slot.gemm
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in owner:
                    slot.shared[pname] = owner[id(p)]
                    continue
                owner[id(p)] = name
                if first[id(p)][0] != name:
                    slot.shared_outside[pname] = first[id(p)]
                slot.weights.append((pname, p, rows.new(name, mtype, T.WEIGHT, pname)))
                grad_row = rows.new(name, mtype, T.WEIGHT_GRAD, pname) if can_have_grad(p) else -1
                plan.params.append(_ParamSlot(name, pname, p, grad_row, -1))
            plan.modules.append(slot)
        if module_filter is not None and check:
            _check_filter(model, module_filter, [s.name for s in plan.modules])
        # (said at attach; a plan made again mid-run leaves it out too)
        leave_out_input_names(plan, warn=check)
        plan.held_modules, plan.held = _compat.modules_and_parameters(model)
        rows.begin_step()
        return plan

    def stale(self, model: nn.Module) -> bool:
        """Whether ``model``'s parameters or modules are no longer those the plan was made for: one taken out,
        added or replaced by another object (``remove_parametrizations``, an adapter injected; torchao's
        ``convert_to_float8_training``, which swaps each ``nn.Linear`` for a new module holding the same
        parameters, the old one's hooks then never called), compared object by object (their values, dtypes and
        devices may change: the hooks read them as they are). Host only."""
        modules, params = _compat.modules_and_parameters(model)
        return not (_same(modules, self.held_modules) and _same(params, self.held))

    def block_rows(self) -> list[int]:
        """The rows the hooks may add block-format statistics to, each given a slot of the block accumulator:
        module outputs (a linear layer may read them), linear layers' own inputs and output gradients, and
        the matrix weights of the modules whose operands a block-scaled GEMM reads. None without block
        formats."""
        if not self.block_formats:
            return []
        out = []
        for slot in self.modules:
            out.append(slot.activation)
            if slot.input_blocks:
                out.append(slot.input)
            if slot.gemm:
                out.append(slot.activation_grad)
            if reads_block_operands(slot.module_type):
                out += [row for _, p, row in slot.weights if p.dim() >= 2]
        return out

    def block_slots(self) -> list[_ModuleSlot]:
        """The modules whose operands get the block-format what-if."""
        return [s for s in self.modules if reads_block_operands(s.module_type)]

    def deal_block_groups(self, groups: int) -> list[int]:
        """Deal the layers whose operands get the block-format what-if into ``groups`` groups of about equal
        cost: largest first, each to the lightest group so far (ties to the lowest group, so every rank deals
        alike). A layer's cost is the sum of its weight's dimensions (in + out features for a linear layer:
        what its input and output gradient add per token; the weight itself is a small share). Returns each
        group's load."""
        loads = [0] * groups
        self.deals += 1

        def cost(slot: _ModuleSlot) -> int:
            return max((sum(p.shape) for _, p, _ in slot.weights if p.dim() == 2), default=1)

        for slot in sorted(self.block_slots(), key=lambda s: -cost(s)):  # stable: model order among equals
            g = loads.index(min(loads))
            slot.block_group = g
            loads[g] += cost(slot)
        return loads

    def norm_facts(self) -> dict[str, Any]:
        """The summary's facts on norms (capture.norm_inputs_from, capture.norms_fp32_inside)."""
        fp32 = [s.name for s in self.modules if computes_fp32_inside(s.module)]
        return {"norm_inputs_from": self.norm_inputs_from(), "norms_fp32_inside": fp32}

    def norm_inputs_from(self) -> dict[str, list[str]]:
        """Per norm whose input row is read (``reads_norm_input``), the captured modules whose outputs, as they made
        them, it received on some sampled step (summary capture.norm_inputs_from); a norm that received only sums
        no module returns (a pre-norm residual stream) is not among them."""
        return {
            s.name: sorted({self.rows.info[r].module for r in s.input_from})
            for s in self.modules
            if s.input >= 0 and not s.reads_input and s.input_from
        }

    def module_types(self) -> dict[str, str]:
        """Module name -> its type, made once (the modules are fixed at attach)."""
        if self._types is None or len(self._types) != len(self.modules):
            self._types = {s.name: s.module_type for s in self.modules}
        return self._types

    def order(self) -> dict[str, int]:
        """Module name -> forward order in the step just recorded (-1: not called), input rows included: the
        dictionary of the step before while no order changed (the steps' rows share it; nothing changes it)."""
        orders = [(s.order, s.input_order) for s in self.modules]
        if self._order is not None and self._order[0] == orders:
            return self._order[1]
        out = {s.name: s.order for s in self.modules}
        out |= {T.input_module(s.name): s.input_order for s in self.modules if s.input >= 0}
        self._order = (orders, out)
        return out


def iter_module_names(model: nn.Module) -> Iterable[str]:
    """Qualified names of the modules a default Profiler captures, in registration order."""
    return [name for name, m in _compat.named_modules(model) if selected(name, m, None)]


BLOCK_FORMATS_ENV = "PRECPROF_BLOCK_FORMATS"


def block_formats_from_env() -> bool:
    """``PRECPROF_BLOCK_FORMATS``: "0", "false", "no" or "off" turn the block-format what-if off; on otherwise."""
    return os.environ.get(BLOCK_FORMATS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _same(now: tuple[Any, ...], held: tuple[Any, ...]) -> bool:
    """Whether two sequences hold the same objects, in the same order."""
    return len(now) == len(held) and all(a is b for a, b in zip(now, held, strict=True))
