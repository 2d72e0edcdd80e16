"""What the advisor returns: findings (code, severity, modules, numbers, remedy) and one recommendation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from precprof.analysis import snippets as _snippets
from precprof.analysis.advisor.text import _listing, _log2i, _name, _scale

CRITICAL = "critical"

WARNING = "warning"

INFO = "info"

SEVERITIES: tuple[str, ...] = (CRITICAL, WARNING, INFO)

_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}

FORMATS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8")

Number = float | int | str | None


@dataclass
class Finding:
    """One observation about the run, with the evidence behind it.

    ``code`` is a stable snake_case id (tests and the report key on it); ``severity`` is "critical",
    "warning" or "info"; ``message`` quotes the numbers in plain sentences; ``remedy`` is one sentence;
    ``modules`` are qualified module names in forward order ("" is the root module); ``numbers`` holds the
    values the message quotes (JSON-safe: NaN becomes None). ``method`` says how the numbers were measured and
    what the thresholds rest on, where that takes more than the message's own words: the message reads on its
    own, and the report folds the method under it ("" where the message says it all; left out of the dict then).
    """

    code: str
    severity: str
    title: str
    message: str
    remedy: str
    modules: list[str] = field(default_factory=list)
    numbers: dict[str, Number] = field(default_factory=dict)
    method: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (the shape stored in summary.json); no ``method`` key where there is none."""
        d = asdict(self)
        if not self.method:
            del d["method"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Finding:
        """Inverse of ``to_dict``; unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Recommendation:
    """The advisor's answer: which format, which loss scale, which layers stay fp32, and why.

    ``loss_scale`` is the GradScaler ``init_scale`` (a power of two) when the recommended format needs loss
    scaling (fp16), else None; ``fp16_loss_scale`` is the init_scale an fp16 run would use, always present;
    ``fp16_ruled_out``: the measurements rule fp16 out (the reasons say why), so that init_scale is no advice.
    ``fp16_loss_scale_at_most``: the run's largest gradients came with inf or nan (fp16 overflow), so it
    measured the largest gradient only as a lower bound and ``fp16_loss_scale`` (``loss_scale`` too) is the most
    a start can be, not a scale known to fit: a dynamic GradScaler started there or lower backs off until steps
    go through.
    ``fp16_keep_fp32``: the modules an fp16 run would run outside autocast, whatever the format (``keep_fp32``
    when it is fp16): what fp16 needs besides its loss scale, beside a verdict of another format.
    ``measured_keep_fp32``: the modules ``measured_format`` keeps in fp32 (``keep_fp32`` when it is the format),
    and ``measured_fp8_layers`` the layers it converts when it is "fp8" (``fp8_layers`` when it is the format),
    for its code beside the small model's fp32 default.
    ``growth_interval`` is the GradScaler growth interval to use with ``loss_scale`` (None without scaling).
    ``keep_fp32`` lists modules to run outside autocast; ``fp8_layers`` the layers to convert when ``format``
    is "fp8" (the rest run in bf16). ``block_plan`` maps each matmul layer to the block-scaled format it can
    train in on a target with such formats (Blackwell: "nvfp4", "mxfp4", "mxfp8", or "bf16" where none
    qualifies; rules/blocks.py), empty elsewhere or when the run has no block-format statistics. ``target`` names the hardware the plan is for, ``device`` its device type ("cuda" or "cpu").
    ``measured_format`` is
    the format the measurements allow on the target; it differs from ``format`` when the guide's default
    (fp32 for a model under ``AdvisorConfig.small_model_params``) holds it back, and a measured speed or memory
    gain (``precprof compare``) is the evidence that overrides the default.
    """

    format: str
    loss_scale: float | None
    fp16_loss_scale: float
    growth_interval: int | None
    keep_fp32: list[str] = field(default_factory=list)
    fp8_layers: list[str] = field(default_factory=list)
    block_plan: dict[str, str] = field(default_factory=dict)
    # the block-scaled what-if as data, for the report (rules/blocks.what_if_data); empty without block columns
    block_what_if: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    target: str = ""
    measured_format: str = ""
    # the target's device type, "cuda" or "cpu" (the snippets' device_type); "" in summaries written before it
    device: str = ""
    fp16_ruled_out: bool = False
    fp16_loss_scale_at_most: bool = False
    fp16_keep_fp32: list[str] = field(default_factory=list)
    measured_keep_fp32: list[str] = field(default_factory=list)
    measured_fp8_layers: list[str] = field(default_factory=list)
    # the linear layers the run already trains in a low-precision format of torchao's, layer -> "fp8" (its float8
    # training: a Float8Linear, or an nn.Linear whose weight quantize_ made an FP8 training weight) or the block
    # format of its MX and NVFP4 layers; what a snippet of another format takes out of the conversion, or keeps
    running_formats: dict[str, str] = field(default_factory=dict)
    # the layers of running_formats whose weight torchao's quantize_ made a training weight, the module left an
    # nn.Linear (Float8TrainingOpConfig, MXFP8TrainingOpConfig), rather than a module of torchao's (Float8Linear,
    # MXFP8Linear, NVFP4Linear): a snippet names the call that converted them, and converts more the same way
    wrapped_weight_layers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (stored as summary.json["recommendation"])."""
        d = asdict(self)
        d["findings"] = [f.to_dict() for f in self.findings]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recommendation:
        """Inverse of ``to_dict``; unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["findings"] = [Finding.from_dict(f) for f in d.get("findings", [])]
        return cls(**kw)

    def snippet(self, framework: str = "pytorch", format: str | None = None) -> str:
        """The code that sets this plan up in ``framework`` ("pytorch", "hf", "lightning", "fsdp", or "torchao"
        when the format is fp8), as the report shows it; ``format`` (e.g. ``measured_format``) asks for
        another format's code with this plan's loss scale and module lists. Raises ValueError for an unknown
        framework or format."""
        return _snippets.snippet(self.to_dict(), framework, format)

    def finding(self, code: str) -> Finding | None:
        """The finding with ``code``, or None."""
        return next((f for f in self.findings if f.code == code), None)

    def describe(self) -> str:
        """A few plain lines for a terminal: the plan, then the critical and warning findings."""
        plan = f"Recommended for {self.target}: {self.format}"
        if self.loss_scale is not None:
            ls = self.loss_scale
            # A recommendation read back from an edited summary.json may hold any scale: only a positive
            # power of two is written as 2^k.
            pow2 = isinstance(ls, (int, float)) and math.isfinite(ls) and ls > 0 and math.frexp(ls)[0] == 0.5
            k = _log2i(ls) if pow2 else None
            plan += (
                f" with GradScaler(init_scale={_scale(k)} (2^{k})"
                if k is not None
                else f" with GradScaler(init_scale={ls!r}"
            )
            if self.growth_interval is not None:
                plan += f", growth_interval={self.growth_interval}"
            plan += ")"
            if self.fp16_loss_scale_at_most:
                plan += ", init_scale at the most (the largest gradient is known only as a lower bound)"
        lines = [plan]
        if self.keep_fp32:
            lines.append("Keep in fp32: " + ", ".join(_name(m) for m in self.keep_fp32))
        if self.fp8_layers:
            lines.append(f"FP8 layers ({len(self.fp8_layers)}): " + _listing(self.fp8_layers, 8))
        if self.block_plan:
            by: dict[str, list[str]] = {}
            for m, fmt in self.block_plan.items():
                by.setdefault(fmt, []).append(m)
            lines.append(
                "Block formats: "
                + "; ".join(f"{fmt} ({len(ms)}): {_listing(ms, 4)}" for fmt, ms in by.items())
                + _unreached(self.block_what_if.get("not_evaluated"))
            )
        lines += [f"- {r}" for r in self.reasons]
        for f in self.findings:
            if f.severity != INFO:
                lines.append(f"[{f.severity}] {f.title}")
        return "\n".join(lines)


def _unreached(modules: Any) -> str:
    """The text's words on the linear layers the block what-if did not reach ("" when none): beside the plan's
    groups, which name the layers it evaluated alone."""
    if not isinstance(modules, list) or not modules:
        return ""
    return f"; not evaluated ({len(modules)}): {_listing([str(m) for m in modules], 4)}"
