"""The advisor: findings from a run's tables, and one recommended format and loss scale.

``recommend(run)`` reads the four tables (``precprof.tables``) and ``summary.json`` of a run and returns a
``Recommendation``: a number format (fp32, tf32, bf16, fp16, fp8), the GradScaler ``init_scale`` as a power of
two, a growth interval, the modules to keep in fp32, the FP8-eligible layers, and the ``Finding`` objects
behind them, each with the numbers it rests on and a one-sentence remedy. Every threshold is a field of
``AdvisorConfig``.

Facts the rules rely on (see ``precprof/tables.py``):

- gradient ``underflow_<fmt>``/``overflow_<fmt>`` counts are exact at the loss scale in effect (``scale``);
  ``absmax``/``absmin`` and histograms are unscaled;
- histogram exponent e = floor(log2|x|), so "what if the scale were 2^k" moves every bin to e + k. A bin then
  underflows fp16 entirely when 2^(e+k+1) <= 2^-25 (half fp16's smallest subnormal, where round-to-nearest-even
  gives 0); in the bin just above, only values sitting exactly on 2^-25 vanish, which a histogram cannot tell
  apart: shares computed by shifting are exact up to those boundary values and are reported as such.

The decision (issue 5): FP8 for the eligible layers on FP8 hardware (bf16 elsewhere), else bf16 where the
target runs it natively and no bf16 finding blocks it, else fp16 with the recommended loss scale and keep list
on hardware with fp16 tensor cores, else tf32 on Ampere+ or fp32.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import pandas as pd

from precprof import hardware as hw_mod
from precprof import tables as T
from precprof.formats import BF16, FP8_E4M3, FP8_E5M2, FP16, NumberFormat
from precprof.hardware import HardwareInfo

CRITICAL = "critical"
WARNING = "warning"
INFO = "info"
SEVERITIES: tuple[str, ...] = (CRITICAL, WARNING, INFO)
_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}

FORMATS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8")

Number = float | int | str | None


# ------------------------------------------------------------------------------------------- results
@dataclass
class Finding:
    """One observation about the run, with the evidence behind it.

    ``code`` is a stable snake_case id (tests and the report key on it); ``severity`` is "critical",
    "warning" or "info"; ``message`` quotes the numbers in plain sentences; ``remedy`` is one sentence;
    ``modules`` are qualified module names in forward order ("" is the root module); ``numbers`` holds the
    values the message quotes (JSON-safe: NaN becomes None).
    """

    code: str
    severity: str
    title: str
    message: str
    remedy: str
    modules: list[str] = field(default_factory=list)
    numbers: dict[str, Number] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (the shape stored in summary.json)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Finding:
        """Inverse of ``to_dict``; unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Recommendation:
    """The advisor's answer: which format, which loss scale, which layers stay fp32, and why.

    ``loss_scale`` is the GradScaler ``init_scale`` (a power of two) when the recommended format needs loss
    scaling (fp16), else None; ``fp16_loss_scale`` is the init_scale an fp16 run would use, always present.
    ``growth_interval`` is the GradScaler growth interval to use with ``loss_scale`` (None without scaling).
    ``keep_fp32`` lists modules to run outside autocast; ``fp8_layers`` the layers to convert when ``format``
    is "fp8" (the rest run in bf16). ``target`` names the hardware the plan is for.
    """

    format: str
    loss_scale: float | None
    fp16_loss_scale: float
    growth_interval: int | None
    keep_fp32: list[str] = field(default_factory=list)
    fp8_layers: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    target: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (stored as summary.json["recommendation"])."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recommendation:
        """Inverse of ``to_dict``; unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["findings"] = [Finding.from_dict(f) for f in d.get("findings", [])]
        return cls(**kw)

    def finding(self, code: str) -> Finding | None:
        """The finding with ``code``, or None."""
        return next((f for f in self.findings if f.code == code), None)

    def describe(self) -> str:
        """A few plain lines for a terminal: the plan, then the critical and warning findings."""
        plan = f"Recommended for {self.target}: {self.format}"
        if self.loss_scale is not None:
            k = _log2i(self.loss_scale)
            plan += f" with GradScaler(init_scale={_scale(k)} (2^{k})"
            if self.growth_interval is not None:
                plan += f", growth_interval={self.growth_interval}"
            plan += ")"
        lines = [plan]
        if self.keep_fp32:
            lines.append("Keep in fp32: " + ", ".join(_name(m) for m in self.keep_fp32))
        if self.fp8_layers:
            lines.append(f"FP8 layers ({len(self.fp8_layers)}): " + _listing(self.fp8_layers, 8))
        lines += [f"- {r}" for r in self.reasons]
        for f in self.findings:
            if f.severity != INFO:
                lines.append(f"[{f.severity}] {f.title}")
        return "\n".join(lines)


@dataclass
class AdvisorConfig:
    """Every threshold the advisor uses, with its default and why.

    Shares are fractions (0.01 = 1%). Loss scales are powers of two given by their log2.
    """

    # Loss scale: the largest 2^k with max|g| * 2^k < 65504 / 2^fp16_margin_log2. A margin of 2^2 leaves room
    # for one GradScaler growth step and for gradients larger than those seen on the sampled steps.
    fp16_margin_log2: int = 2
    # Clamp of the recommended loss scale. 2^32 is far above the 8..32K the 2018 paper used; it only stops a
    # run with vanishing gradients from producing an absurd scale.
    min_loss_scale_log2: int = -16
    max_loss_scale_log2: int = 32
    # Used when the run has no gradient statistics: GradScaler's own default init_scale, 2^16.
    default_loss_scale_log2: int = 16
    # Activation-gradient underflow in fp16: at or below ``fp16_underflow_ok`` it is negligible (the target of
    # the loss-scale rule); above ``fp16_underflow_block`` even at the recommended scale, fp16 is not advised.
    fp16_underflow_ok: float = 0.01
    fp16_underflow_block: float = 0.10
    # ...unless the values still lost at the recommended scale are negligible: in every module they carry at
    # most this share of the activation gradient's L2 norm (a layer whose gradients are all tiny is lost
    # entirely and fails this; a few far-out tail values in an otherwise healthy tensor pass it).
    fp16_underflow_norm_ok: float = 1e-3
    # Activations whose largest value is within 2^fp16_activation_headroom_log2 of 65504 are kept in fp32 too:
    # steps that were not sampled can be larger.
    fp16_activation_headroom_log2: int = 1
    # Forward activations that flush to zero in fp16 (no loss scale helps the forward pass).
    fp16_activation_underflow_warn: float = 0.01
    # fp16 is not worth it when more than this share of the matmul layers would have to stay in fp32.
    fp16_keep_share_max: float = 0.5
    # GradScaler's default growth interval; doubled (at least) when the scaler thrashed.
    default_growth_interval: int = 2000
    # Thrashing: at least this many skipped steps after the scaler first settled, with growth in between.
    thrash_min_skips: int = 2
    # Lost weight updates (updates below half an ulp of the weight in bf16/fp16): warn above this share.
    lost_update_warn: float = 0.01
    # bf16 is blocked when more than this share of nonzero gradient values underflow bf16 at scale 1.
    bf16_underflow_block: float = 0.01
    # FP8 eligibility: e4m3 (forward) and e5m2 (activation gradients) underflow shares under per-tensor
    # current scaling must both be at or below this.
    fp8_underflow_max: float = 0.01
    # Tensor-core alignment: dims multiple of 8 for fp16/bf16/tf32, of 16 for fp8.
    alignment: int = 8
    fp8_alignment: int = 16
    # Below this many parameters, fp32 may be as fast as mixed precision (launch-bound, not math-bound).
    small_model_params: int = 100_000_000
    # Mixed precision requested but not active: critical when at least this share of matmul layers still
    # produce float32 outputs (1.0: none is active), info when fewer do.
    mp_inactive_share: float = 1.0
    # Messages list at most this many modules by name ("and N more").
    max_listed_modules: int = 8
    # Non-finite gradients on steps GradScaler skipped are its business (a scale too high) unless the run of
    # skips drove the scale this many powers of two below the last scale at which a step was finite, or
    # lasted to the end of the run over at least ``nonfinite_persist_steps`` steps: overflow is gone after a
    # back-off or two, a nan from the model is not.
    nonfinite_backoff_log2: int = 4
    nonfinite_persist_steps: int = 8


# ------------------------------------------------------------------------------------------- helpers
_MATMUL_RE = re.compile(r"Linear|^Conv1D$|^Conv(Transpose)?[123]d$|Bilinear")
_EMBEDDING_RE = re.compile(r"Embedding")
_LOW_PRECISION = {"fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}
# summary["model"]["dims"] keys that are tensor dimensions (others, like n_layer, are counts).
_DIM_KEYS = (
    "n_embd",
    "vocab_size",
    "padded_vocab_size",
    "hidden_size",
    "intermediate_size",
    "n_inner",
    "d_model",
    "d_ff",
    "ffn_dim",
    "embed_dim",
    "dim",
)


def is_matmul_layer(module_type: str) -> bool:
    """True for module types whose forward is a matmul that autocast runs in low precision.

    Matches nn.Linear and its subclasses by name, Hugging Face's GPT-2 ``Conv1D`` (a transposed Linear),
    convolutions and Bilinear; not Embedding (a gather, which autocast leaves in the weight's dtype).
    """
    return bool(_MATMUL_RE.search(module_type or "")) and not _EMBEDDING_RE.search(module_type or "")


def _is_linear(module_type: str) -> bool:
    # HF GPT-2's Conv1D is a Linear with a transposed weight: same shapes, same FP8 treatment.
    return "Linear" in module_type or module_type == "Conv1D"


def _pct(share: float | None) -> str:
    if share is None or not math.isfinite(share):
        return "n/a"
    if share == 0:
        return "0%"
    p = share * 100
    return f"{p:.2g}%" if p < 0.01 else f"{p:.3g}%"


def _pow2(k: int) -> str:
    return f"2^{k} ({_scale(k)})"


def _scale(k: int) -> str:
    """2^k written out as GradScaler's init_scale is typed: an integer for k >= 0, else the exact decimal
    (Python's shortest round-trip form: 0.125, 0.0009765625, 9.313225746154785e-10)."""
    return str(2**k) if k >= 0 else repr(2.0**k)


def _log2i(x: float) -> int:
    return math.frexp(x)[1] - 1


def _g(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.3g}"


def _name(module: str) -> str:
    return module if module else "(root)"


def _listing(modules: list[str], limit: int) -> str:
    shown = ", ".join(_name(m) for m in modules[:limit])
    return shown + (f" and {len(modules) - limit} more" if len(modules) > limit else "")


def _num(x: Any) -> Number:
    """A JSON-safe scalar: numpy scalars to Python, NaN/inf to None."""
    if x is None or isinstance(x, str):
        return x
    if hasattr(x, "item"):
        x = x.item()
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int):
        return x
    x = float(x)
    return x if math.isfinite(x) else None


def _share(num: float, den: float) -> float | None:
    return float(num) / float(den) if den > 0 else None


def _dtype_has(df: pd.DataFrame, dtype: str) -> pd.Series:
    """Rows whose tensors included ``dtype`` (the dtype column joins several with "|")."""
    return df[T.DTYPE].str.split("|").map(lambda ds: dtype in ds).astype(bool)


def _is_descendant(child: str, parent: str) -> bool:
    return child != parent and (parent == "" or child.startswith(parent + "."))


def _innermost(modules: Iterable[str]) -> list[str]:
    """Drop modules that have a descendant in the set: the descendant is where the effect arises."""
    ms = list(dict.fromkeys(modules))
    return [m for m in ms if not any(_is_descendant(o, m) for o in ms)]


# ------------------------------------------------------------------------------------------- the run
@dataclass
class _Run:
    layers: pd.DataFrame
    hist: pd.DataFrame
    steps: pd.DataFrame
    summary: dict[str, Any]
    hw: HardwareInfo
    hw_is_target_preset: bool
    cfg: AdvisorConfig
    order: dict[str, int] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    def sort(self, modules: Iterable[str]) -> list[str]:
        return sorted(set(modules), key=lambda m: (self.order.get(m, 1 << 30), m))

    def kind(self, *kinds: str) -> pd.DataFrame:
        return self.layers[self.layers[T.TENSOR].isin(kinds)]

    @property
    def run_config(self) -> dict[str, Any]:
        c = self.summary.get(T.SUMMARY_CONFIG) or {}
        return dict(c) if isinstance(c, Mapping) else {}

    @property
    def precision(self) -> str:
        return str(self.run_config.get("precision") or "").lower()


_NUMERIC_LAYER_COLS = (
    T.STEP,
    T.ORDER,
    T.CALLS,
    *T.COUNT_COLUMNS,
    T.ABSMAX,
    T.ABSMIN,
    T.SCALE,
    T.LOST_UPDATE_BF16,
    T.LOST_UPDATE_FP16,
)


def _prepare(tables: Mapping[str, pd.DataFrame]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    layers = T.frame("layers", tables.get("layers", T.empty("layers")).copy())
    for c in _NUMERIC_LAYER_COLS:
        layers[c] = pd.to_numeric(layers[c], errors="coerce")
    for c in T.COUNT_COLUMNS:
        layers[c] = layers[c].fillna(0)
    layers[T.SCALE] = layers[T.SCALE].fillna(1.0)
    for c in (T.MODULE, T.MODULE_TYPE, T.TENSOR, T.PARAM, T.DTYPE):
        layers[c] = layers[c].fillna("").astype(str)
    hist = T.frame("histograms", tables.get("histograms", T.empty("histograms")).copy())
    for c in (T.STEP, T.EXPONENT, T.COUNT):
        hist[c] = pd.to_numeric(hist[c], errors="coerce")
    hist = hist.dropna(subset=[T.EXPONENT, T.COUNT])
    steps = T.frame("steps", tables.get("steps", T.empty("steps")).copy())
    for c in (T.STEP, T.LOSS, T.LOSS_SCALE, T.GRAD_NORM):
        steps[c] = pd.to_numeric(steps[c], errors="coerce")
    steps = steps.sort_values(T.STEP, kind="stable").reset_index(drop=True)
    return layers, hist, steps


def _nonzero(df: pd.DataFrame) -> float:
    """Finite nonzero values in the rows of ``df`` (the denominator of every share)."""
    return float((df[T.NUMEL] - df[T.ZEROS] - df[T.NAN] - df[T.INF]).clip(lower=0).sum())


def _exponent_counts(hist: pd.DataFrame, kinds: Iterable[str]) -> pd.Series:
    h = hist[hist[T.TENSOR].isin(tuple(kinds))]
    return h.groupby(T.EXPONENT)[T.COUNT].sum().astype(float)


def _shifted_underflow(counts: pd.Series, fmt: NumberFormat, k: int) -> tuple[float, float]:
    """(values that surely underflow ``fmt`` at scale 2^k, values in the boundary bin) from an exponent histogram.

    A bin e lies in [2^(e+k), 2^(e+k+1)) after scaling: it vanishes entirely when 2^(e+k+1) <= underflow_max.
    In the next bin up only values exactly equal to underflow_max vanish (round-to-nearest-even to 0).
    """
    if counts.empty:
        return 0.0, 0.0
    lim = _log2i(fmt.underflow_max)  # underflow_max is a power of two for every format
    e = counts.index.to_numpy()
    sure = float(counts[(e + k + 1) <= lim].sum())
    boundary = float(counts[(e + k) == lim].sum())
    return sure, boundary


def _lost_norm_share(hist: pd.DataFrame, fmt: NumberFormat, k: int) -> pd.Series:
    """Per module: the share of the L2 norm held by values that underflow ``fmt`` at scale 2^k.

    Estimated from the histogram, each value taken as 2^e (its bin's lower edge for every bin alike, so the
    ratio is within a factor of 2 of the truth): sqrt(sum over lost bins of count*4^e / sum over all of count*4^e).
    """
    if hist.empty:
        return pd.Series(dtype=float)
    e = hist[T.EXPONENT].to_numpy(dtype=float)
    energy = hist[T.COUNT].to_numpy(dtype=float) * 4.0**e
    lost = energy * ((e + k + 1) <= _log2i(fmt.underflow_max))
    df = pd.DataFrame({T.MODULE: hist[T.MODULE].to_numpy(), "energy": energy, "lost": lost})
    by = df.groupby(T.MODULE)[["energy", "lost"]].sum()
    by = by[by["energy"] > 0]
    return (by["lost"] / by["energy"]) ** 0.5


def _shifted_overflow(counts: pd.Series, fmt: NumberFormat, k: int) -> float:
    """Values that surely overflow ``fmt`` at scale 2^k (whole bins at or above overflow_min)."""
    if counts.empty:
        return 0.0
    e = counts.index.to_numpy()
    return float(counts[(2.0 ** (e + k)) >= fmt.overflow_min].sum())


# ------------------------------------------------------------------------------------------- analysis
@dataclass
class _Plan:
    """Intermediate results the decision needs."""

    findings: list[Finding] = field(default_factory=list)
    loss_scale_log2: int = 16
    grad_absmax: float | None = None
    underflow_now: float | None = None
    underflow_at_1: float | None = None
    underflow_at_rec: float | None = None
    keep_fp16: list[str] = field(default_factory=list)
    fp16_block: list[str] = field(default_factory=list)
    bf16_block: list[str] = field(default_factory=list)
    keep_bf16: list[str] = field(default_factory=list)
    fp8_eligible: list[str] = field(default_factory=list)
    fp8_checked: int = 0
    growth_interval: int = 2000
    matmul_layers: list[str] = field(default_factory=list)
    n_params: int | None = None

    def add(self, f: Finding) -> None:
        self.findings.append(f)


def _matmul_leaves(run: _Run) -> list[str]:
    acts = run.kind(T.ACTIVATION)
    mods = [m for m in acts[T.MODULE].unique() if is_matmul_layer(run.types.get(m, ""))]
    return run.sort(_innermost(mods))


def _rule_hardware(run: _Run, plan: _Plan) -> None:
    hw = run.hw
    label = hw.preset or hw.name
    cc = ".".join(map(str, hw.compute_capability)) if hw.compute_capability else None
    nums: dict[str, Number] = {"device": hw.device, "name": hw.name, "compute_capability": cc}
    if hw.device == "cpu":
        if hw.bf16_native:
            plan.add(
                Finding(
                    "bf16_native",
                    INFO,
                    f"bf16 is native on {label}",
                    f"This CPU ({hw.name}) has AVX512-BF16 or AMX: bf16 matmuls run in hardware.",
                    "Use bf16 autocast on this CPU to save memory and time.",
                    numbers=nums,
                )
            )
        else:
            plan.add(
                Finding(
                    "bf16_emulated",
                    WARNING,
                    f"bf16 is emulated on {label}",
                    f"This CPU ({hw.name}) has neither AVX512-BF16 nor AMX: bf16 autocast runs, but through "
                    "conversions to fp32, usually slower than plain fp32.",
                    "Train in fp32 on this CPU, or plan for a GPU with compute capability 8.0+ for bf16.",
                    numbers=nums,
                )
            )
    elif hw.bf16_native:
        plan.add(
            Finding(
                "bf16_native",
                INFO,
                f"bf16 is native on {label}",
                f"{hw.name} has compute capability {cc} (8.0+ has bf16 tensor cores).",
                "Prefer bf16 autocast: fp32's range, no loss scaling.",
                numbers=nums,
            )
        )
    else:
        plan.add(
            Finding(
                "bf16_unsupported",
                WARNING,
                f"No bf16 tensor cores on {label}",
                f"{hw.name} has compute capability {cc}; bf16 tensor cores need 8.0+ (Ampere), so bf16 "
                "would be emulated or refused.",
                "Use fp16 with a loss scale on this GPU.",
                numbers=nums,
            )
        )
    if hw.fp8_supported and hw.fp8_library:
        plan.add(
            Finding(
                "fp8_supported",
                INFO,
                f"FP8 tensor cores on {label}",
                f"{hw.name} has compute capability {cc} (8.9+ has FP8 tensor cores) and {hw.fp8_library} "
                "is available for FP8 training.",
                f"Convert the FP8-eligible linear layers with {hw.fp8_library}; keep the rest in bf16.",
                numbers={**nums, "fp8_library": hw.fp8_library},
            )
        )
    elif hw.fp8_supported:
        plan.add(
            Finding(
                "fp8_library_missing",
                WARNING,
                "FP8 hardware without an FP8 library",
                f"{hw.name} has compute capability {cc} (FP8 tensor cores) but neither torchao nor "
                "Transformer Engine is importable.",
                "Install torchao (pip install torchao) to train the eligible layers in FP8.",
                numbers=nums,
            )
        )
    if (
        not run.hw_is_target_preset
        and hw.tf32_supported
        and not hw.tf32_matmul_enabled
        and run.precision in ("fp32", "")
    ):
        plan.add(
            Finding(
                "tf32_off",
                WARNING,
                "TF32 is off on an Ampere+ GPU",
                f"{hw.name} (compute capability {cc}) runs fp32 matmuls on TF32 tensor cores only when "
                "allowed, and torch.backends.cuda.matmul.allow_tf32 is False "
                f"(float32_matmul_precision={hw.float32_matmul_precision!r}).",
                "Call torch.set_float32_matmul_precision('high') to run fp32 matmuls in TF32.",
                numbers={**nums, "float32_matmul_precision": hw.float32_matmul_precision},
            )
        )


def _rule_nonfinite(run: _Run, plan: _Plan) -> set[int]:
    """First module and step with nan/inf, forward and backward. Returns the steps with forward nan/inf."""
    bad = run.layers[(run.layers[T.NAN] + run.layers[T.INF]) > 0]
    fwd = bad[bad[T.TENSOR].isin((T.ACTIVATION, T.WEIGHT))]
    fwd_steps = {int(s) for s in fwd[T.STEP].unique()}
    if not fwd.empty:
        step = int(fwd[T.STEP].min())
        at = fwd[fwd[T.STEP] == step]
        origins = run.sort(_innermost(at[T.MODULE]))
        first = origins[0]
        row = at[at[T.MODULE] == first]
        nan, inf = int(row[T.NAN].sum()), int(row[T.INF].sum())
        kinds = sorted(set(row[T.TENSOR]))
        plan.add(
            Finding(
                "nonfinite_forward",
                CRITICAL,
                f"nan/inf first appears in the forward pass of {_name(first)}",
                f"At step {step}, the {'/'.join(kinds)} of {_name(first)} "
                f"({run.types.get(first, '?')}) holds {nan} nan and {inf} inf values; it is the first "
                f"module in forward order to do so ({len(fwd_steps)} sampled step(s) affected, "
                f"{at[T.MODULE].nunique()} module(s) at step {step}).",
                f"Inspect {_name(first)}'s inputs and weights at step {step}: a division, log or exp "
                "without a guard, or an fp16 overflow (keep it in fp32).",
                modules=[first],
                numbers={"step": step, "nan": nan, "inf": inf, "steps_affected": len(fwd_steps)},
            )
        )
    bwd = bad[bad[T.TENSOR].isin(T.GRADIENT_KINDS) & ~bad[T.STEP].isin(fwd_steps)]
    if bwd.empty:
        return fwd_steps
    streaks = _skip_streaks(run.steps)
    for step in sorted(int(s) for s in bwd[T.STEP].unique()):
        streak = next(((a, b) for a, b in streaks if a <= step <= b), None)
        if streak is not None and not _scaler_cannot_fix(run, streak):
            continue  # a scale too high: the scaler skipped the step and backed off, as it should
        at = bwd[bwd[T.STEP] == step]
        # Backward runs in reverse forward order: the first module to see a bad gradient is the last one.
        first = run.sort(_innermost(at[T.MODULE]))[-1]
        row = at[at[T.MODULE] == first]
        nan, inf = int(row[T.NAN].sum()), int(row[T.INF].sum())
        where = f"{_name(first)} ({run.types.get(first, '?')})"
        nums: dict[str, Number] = {"step": step, "nan": nan, "inf": inf}
        if streak is None:
            detail = (
                f"At step {step}, gradients of {where} hold {nan} nan and {inf} inf values while the forward "
                "pass was finite, and the optimizer step was not skipped for it."
            )
            remedy = (
                f"Check the loss and {_name(first)}'s backward at step {step} (e.g. sqrt or log near 0); "
                "with fp16 use a GradScaler so such steps are skipped."
            )
        else:
            a, b = streak
            scales = _scales(run.steps, a, b)
            nums.update({"skipped_from": a, "skipped_to": b, "skipped_steps": b - a + 1})
            first_seen = "" if step == a else f" (recorded first at sampled step {step})"
            detail = (
                f"From step {a}{first_seen}, gradients of {where} hold {nan} nan and {inf} inf values while the "
                f"forward pass was finite. GradScaler skipped every step from {a} to {b} ({b - a + 1} steps, "
                f"no weight update) and backed the scale off {scales}: an overflow would have been gone after "
                "a back-off or two, so the nan/inf comes from the backward computation, not from the scale."
            )
            remedy = (
                f"Check {_name(first)}'s backward from step {a} (sqrt or log near 0, a division by a small "
                "norm); a lower loss scale will not help."
            )
        plan.add(
            Finding(
                "nonfinite_backward",
                CRITICAL,
                f"nan/inf first appears in the backward pass at {_name(first)}",
                detail,
                remedy,
                modules=[first],
                numbers=nums,
            )
        )
        break
    return fwd_steps


def _skip_streaks(steps: pd.DataFrame) -> list[tuple[int, int]]:
    """Runs of consecutive skipped steps, as (first, last) step."""
    if steps.empty:
        return []
    skipped = sorted(int(s) for s in steps[steps[T.SKIPPED].fillna(False).astype(bool)][T.STEP])
    out: list[tuple[int, int]] = []
    for s in skipped:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _scale_at(steps: pd.DataFrame, step: int) -> float:
    rows = steps[steps[T.STEP] == step][T.LOSS_SCALE]
    return float(rows.iloc[0]) if len(rows) and pd.notna(rows.iloc[0]) else math.nan


def _scales(steps: pd.DataFrame, a: int, b: int) -> str:
    lo, hi = _scale_at(steps, b), _scale_at(steps, a)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo > 0 and hi > 0):
        return "(scale not recorded)"
    return f"from {_pow2(_log2i(hi))} to {_pow2(_log2i(lo))}"


def _scaler_cannot_fix(run: _Run, streak: tuple[int, int]) -> bool:
    """Whether a run of skipped steps is more than a scale too high (see AdvisorConfig.nonfinite_*)."""
    a, b = streak
    steps = run.steps
    lowest = _scale_at(steps, b)
    ok_before = steps[(steps[T.STEP] < a) & ~steps[T.SKIPPED].fillna(False).astype(bool)]
    last_ok = float(ok_before[T.LOSS_SCALE].iloc[-1]) if len(ok_before) else math.nan
    finite = math.isfinite(last_ok) and math.isfinite(lowest) and lowest > 0 and last_ok > 0
    if finite and math.log2(last_ok / lowest) >= run.cfg.nonfinite_backoff_log2:
        return True
    last_step = int(steps[T.STEP].max()) if not steps.empty else b
    return b == last_step and b - a + 1 >= run.cfg.nonfinite_persist_steps


def _rule_mixed_precision_active(run: _Run, plan: _Plan) -> None:
    requested = run.precision
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    if isinstance(capture, Mapping):
        req = capture.get("mixed_precision_requested")
        if isinstance(req, str) and req:
            requested = req.lower()
    low = next((dt for p, dt in _LOW_PRECISION.items() if requested.startswith(p)), None)
    if low is None or not plan.matmul_layers:
        return
    acts = run.kind(T.ACTIVATION)
    acts = acts[acts[T.MODULE].isin(plan.matmul_layers)]
    last = acts[acts[T.STEP] == acts[T.STEP].max()]
    fp32 = run.sort(last[last[T.DTYPE] == "float32"][T.MODULE])
    if not fp32:
        return
    share = len(fp32) / len(plan.matmul_layers)
    nums: dict[str, Number] = {
        "requested": requested,
        "fp32_layers": len(fp32),
        "matmul_layers": len(plan.matmul_layers),
        "share": share,
    }
    listing = _listing(fp32, run.cfg.max_listed_modules)
    seen = capture.get("autocast") if isinstance(capture, Mapping) else None
    autocast_off = isinstance(seen, Mapping) and seen.get("enabled") is False
    if autocast_off:
        nums["autocast_enabled"] = 0
    if share >= run.cfg.mp_inactive_share:
        plan.add(
            Finding(
                "mixed_precision_inactive",
                CRITICAL,
                f"{requested} was requested but is not active",
                f"The run asked for {requested}, yet all {len(fp32)} matmul layers produced float32 "
                f"outputs ({listing})"
                + ("; torch autocast was off during the forward pass" if autocast_off else "")
                + ": the run trained in fp32. accelerate, for one, ignores fp16=True on CPU.",
                "Wrap the forward pass in torch.autocast(device_type, dtype=...) on a device that supports "
                "it, or train on a GPU where the requested precision applies.",
                modules=fp32,
                numbers=nums,
            )
        )
    else:
        plan.add(
            Finding(
                "mixed_precision_partial",
                INFO,
                f"{len(fp32)} of {len(plan.matmul_layers)} matmul layers run in float32",
                f"With {requested} requested, {len(fp32)} of {len(plan.matmul_layers)} matmul layers "
                f"({_pct(share)}) still produced float32 outputs: {listing}.",
                "Nothing to do if these layers are kept in fp32 on purpose; otherwise check that they run "
                "inside autocast.",
                modules=fp32,
                numbers=nums,
            )
        )


def _rule_fp16_activations(run: _Run, plan: _Plan) -> None:
    cfg = run.cfg
    acts = run.kind(T.ACTIVATION)
    if acts.empty:
        return
    # What-if: exact fp16 overflow counts of tensors that were not fp16 (scale is 1 in the forward pass).
    whatif = acts[~_dtype_has(acts, "float16") & (acts[T.overflow_col("fp16")] > 0)]
    over = set(whatif[T.MODULE])
    # Observed: fp16 tensors already holding inf. The inf propagates downstream, so only the first module
    # of each step is the cause.
    seen = acts[_dtype_has(acts, "float16") & (acts[T.INF] > 0)]
    observed: set[str] = set()
    for _, at in seen.groupby(T.STEP):
        observed.add(run.sort(_innermost(at[T.MODULE]))[0])
    limit = FP16.max / 2.0**cfg.fp16_activation_headroom_log2
    per_mod = acts.groupby(T.MODULE).agg(
        absmax=(T.ABSMAX, "max"),
        overflow=(T.overflow_col("fp16"), "sum"),
        numel=(T.NUMEL, "sum"),
        inf=(T.INF, "sum"),
    )
    near = set(per_mod.index[(per_mod["absmax"] >= limit) & (per_mod["absmax"] < FP16.overflow_min)])
    near -= over | observed
    overflow_mods = run.sort(_innermost(over | observed))
    if overflow_mods:
        n_over = int(whatif[T.overflow_col("fp16")].sum())
        amax = float(per_mod.loc[overflow_mods, "absmax"].max())
        detail = "; ".join(
            f"{_name(m)}: max |x| {_g(per_mod.loc[m, 'absmax'])}, "
            f"{int(per_mod.loc[m, 'overflow'])} values over 65504"
            + (f", {int(per_mod.loc[m, 'inf'])} inf in fp16" if m in observed else "")
            for m in overflow_mods[: cfg.max_listed_modules]
        )
        plan.add(
            Finding(
                "fp16_activation_overflow",
                CRITICAL if observed else WARNING,
                f"Activations overflow fp16 in {len(overflow_mods)} module(s)",
                f"{len(overflow_mods)} module(s) produce activations beyond fp16's 65504 "
                f"({n_over} values in fp32/bf16 tensors would become inf"
                + (f"; {len(observed)} module(s) already produced inf in fp16" if observed else "")
                + f"): {detail}. No loss scale helps the forward pass.",
                "Use bf16, or keep these modules in fp32 (outside autocast) and normalise their output "
                "before the next fp16 matmul.",
                modules=overflow_mods,
                numbers={
                    "modules": len(overflow_mods),
                    "overflow_values": n_over,
                    "absmax": amax if math.isfinite(amax) else None,
                    "observed_inf_modules": len(observed),
                },
            )
        )
    near_mods = run.sort(_innermost(near))
    if near_mods:
        plan.add(
            Finding(
                "fp16_activation_near_overflow",
                WARNING,
                f"Activations within {2**cfg.fp16_activation_headroom_log2}x of fp16's limit",
                f"{len(near_mods)} module(s) reach |x| >= {_g(limit)} (65504 / "
                f"{2**cfg.fp16_activation_headroom_log2}): "
                + "; ".join(
                    f"{_name(m)}: {_g(per_mod.loc[m, 'absmax'])}" for m in near_mods[: cfg.max_listed_modules]
                )
                + ". Steps that were not sampled may overflow.",
                "Keep these modules in fp32 under fp16, or use bf16.",
                modules=near_mods,
                numbers={
                    "modules": len(near_mods),
                    "absmax": _num(per_mod.loc[near_mods, "absmax"].max()),
                    "limit": limit,
                },
            )
        )
    plan.keep_fp16 = run.sort(_innermost([*overflow_mods, *near_mods]))
    if plan.matmul_layers:
        kept = [m for m in plan.matmul_layers if any(m == k or _is_descendant(m, k) for k in plan.keep_fp16)]
        share = len(kept) / len(plan.matmul_layers)
        if share > cfg.fp16_keep_share_max:
            plan.fp16_block.append(
                f"fp16 would have to leave {len(kept)} of {len(plan.matmul_layers)} matmul layers "
                f"({_pct(share)}) in fp32 because their activations overflow"
            )
    # Forward underflow: activations flushing to zero in fp16 (no loss scale applies to the forward pass).
    lo = acts[~_dtype_has(acts, "float16")]
    nz = _nonzero(lo)
    uf = float(lo[T.underflow_col("fp16")].sum())
    uf_share = _share(uf, nz)
    if uf_share is not None and uf_share > cfg.fp16_activation_underflow_warn:
        by = lo.groupby(T.MODULE)[[T.underflow_col("fp16"), T.NUMEL]].sum()
        worst = by[by[T.underflow_col("fp16")] > 0].sort_values(T.underflow_col("fp16"), ascending=False)
        mods = run.sort(worst.index[: cfg.max_listed_modules])
        plan.add(
            Finding(
                "fp16_activation_underflow",
                WARNING,
                f"{_pct(uf_share)} of activation values flush to zero in fp16",
                f"{int(uf)} of {int(nz)} nonzero activation values ({_pct(uf_share)}) are at or below 2^-25 "
                f"and would become 0 in fp16; most in {_listing(mods, cfg.max_listed_modules)}.",
                "Keep these modules in fp32 or use bf16 (its range reaches 2^-133).",
                modules=mods,
                numbers={"underflow_values": int(uf), "nonzero_values": int(nz), "share": uf_share},
            )
        )


def _grad_absmax(run: _Run) -> tuple[float | None, float | None]:
    """(largest finite unscaled gradient magnitude, lower bound implied by fp16 gradients that became inf).

    An fp16 gradient that is inf at loss scale s was at least 65520/s before scaling.
    """
    g = run.kind(*T.GRADIENT_KINDS)
    if g.empty:
        return None, None
    finite = g[T.ABSMAX].dropna()
    finite = finite[(finite > 0) & finite.map(math.isfinite)]
    amax = float(finite.max()) if not finite.empty else None
    infs = g[(g[T.INF] > 0) & _dtype_has(g, "float16") & (g[T.SCALE] > 0)]
    bound = float((FP16.overflow_min / infs[T.SCALE]).max()) if not infs.empty else None
    return amax, bound


def _rule_loss_scale(run: _Run, plan: _Plan, fwd_bad_steps: set[int]) -> None:
    cfg = run.cfg
    # Gradients of a step whose forward pass was already non-finite are nan/inf garbage: size the scale on
    # the other steps.
    excluded = len(fwd_bad_steps)
    if excluded:
        run = replace(
            run,
            layers=run.layers[~run.layers[T.STEP].isin(fwd_bad_steps)],
            hist=run.hist[~run.hist[T.STEP].isin(fwd_bad_steps)],
        )
    amax, bound = _grad_absmax(run)
    gmax = max([x for x in (amax, bound) if x is not None], default=None)
    plan.grad_absmax = gmax
    limit = FP16.max / 2.0**cfg.fp16_margin_log2
    if gmax is None or gmax <= 0:
        k = cfg.default_loss_scale_log2
        plan.loss_scale_log2 = k
        plan.add(
            Finding(
                "fp16_loss_scale",
                INFO,
                f"fp16 loss scale {_pow2(k)}: no gradient statistics",
                (
                    f"All {excluded} sampled step(s) had a non-finite forward pass, so their gradients say "
                    "nothing about the loss scale"
                    if excluded
                    else "The run recorded no finite nonzero gradient"
                )
                + f"; the loss scale falls back to GradScaler's default start of {_pow2(k)}.",
                "Profile at least one sampled step with a backward pass to size the loss scale.",
                numbers={
                    "loss_scale_log2": k,
                    "loss_scale": 2.0**k,
                    "grad_absmax": None,
                    "steps_excluded": excluded,
                },
            )
        )
    else:
        k = math.floor(math.log2(limit / gmax))
        # log2 is rounded: settle the strict inequality max|g| * 2^k < limit exactly.
        while math.ldexp(gmax, k) >= limit:
            k -= 1
        while math.ldexp(gmax, k + 1) < limit:
            k += 1
        raw = k
        k = min(max(k, cfg.min_loss_scale_log2), cfg.max_loss_scale_log2)
        plan.loss_scale_log2 = k
        clamp = ""
        if k != raw:
            clamp = f" (clamped from 2^{raw} to the configured range 2^{cfg.min_loss_scale_log2}..2^{cfg.max_loss_scale_log2})"
        src = (
            f" (a lower bound: fp16 gradients became inf at scale {_g(FP16.overflow_min / bound)})"
            if bound is not None and bound >= (amax or 0)
            else ""
        )
        plan.add(
            Finding(
                "fp16_loss_scale",
                INFO,
                f"fp16 loss scale {_pow2(k)}",
                f"The largest gradient magnitude seen is {_g(gmax)}{src}"
                + (
                    f" (leaving out {excluded} sampled step(s) whose forward pass was already non-finite)"
                    if excluded
                    else ""
                )
                + f"; {_pow2(k)} is the largest power of "
                f"two that keeps it below 65504 / {2**cfg.fp16_margin_log2} = {_g(limit)} "
                f"(max|g| x 2^{k} = {_g(math.ldexp(gmax, k))}){clamp}.",
                f"Start GradScaler at init_scale={_scale(k)}.",
                numbers={
                    "loss_scale_log2": k,
                    "loss_scale": 2.0**k,
                    "grad_absmax": gmax,
                    "margin": 2.0**cfg.fp16_margin_log2,
                    "scaled_absmax": math.ldexp(gmax, k),
                    "steps_excluded": excluded,
                },
            )
        )
    _rule_fp16_underflow(run, plan)
    _rule_fp16_gradient_overflow(run, plan)
    _rule_scaler(run, plan)


def _rule_fp16_underflow(run: _Run, plan: _Plan) -> None:
    cfg = run.cfg
    k = plan.loss_scale_log2
    ag = run.kind(T.ACTIVATION_GRAD)
    counts = _exponent_counts(run.hist, (T.ACTIVATION_GRAD,))
    total = float(counts.sum())
    if ag.empty and total == 0:
        return
    # Now: exact counts at the scale in effect, on tensors that were not already fp16 (in an fp16 tensor the
    # flushed values are zeros already and cannot be told from true zeros).
    not16 = ag[~_dtype_has(ag, "float16")]
    nz_now = _nonzero(not16)
    now = _share(float(not16[T.underflow_col("fp16")].sum()), nz_now)
    is16 = ag[_dtype_has(ag, "float16")]
    zero16 = _share(float(is16[T.ZEROS].sum()), float(is16[T.NUMEL].sum()))
    scales = sorted({float(s) for s in not16[T.SCALE].unique()})
    sure1, _ = _shifted_underflow(counts, FP16, 0)
    sure_k, boundary_k = _shifted_underflow(counts, FP16, k)
    over_k = _shifted_overflow(counts, FP16, k)
    at1 = _share(sure1, total)
    atk = _share(sure_k, total)
    plan.underflow_now, plan.underflow_at_1, plan.underflow_at_rec = now, at1, atk
    wg = _exponent_counts(run.hist, (T.WEIGHT_GRAD,))
    wg_sure, _ = _shifted_underflow(wg, FP16, k)
    wg_share = _share(wg_sure, float(wg.sum()))
    norm = _lost_norm_share(run.hist[run.hist[T.TENSOR] == T.ACTIVATION_GRAD], FP16, k)
    norm_k = float(norm.max()) if not norm.empty else None
    norm_mod = str(norm.idxmax()) if not norm.empty else None
    residual_matters = norm_k is None or norm_k > cfg.fp16_underflow_norm_ok
    now_txt = (
        f"{_pct(now)} of {int(nz_now)} nonzero activation-gradient values flush to zero in fp16 at the scale "
        f"in effect ({', '.join(f'{s:g}' for s in scales)}; exact counts)"
        if now is not None
        else "the activation gradients were already fp16, so their flushed values are indistinguishable from zeros"
    )
    if zero16 is not None:
        now_txt += f"; fp16 activation gradients in this run are {_pct(zero16)} zeros"
    msg = (
        f"{now_txt[0].upper()}{now_txt[1:]}. From the exponent histograms ({int(total)} nonzero values): "
        f"{_pct(at1)} at scale 1 and {_pct(atk)} at the recommended scale {_pow2(k)}"
        + (
            f" (plus at most {int(boundary_k)} values lying exactly on 2^-25, which round to 0)"
            if boundary_k
            else ""
        )
        + (f"; {int(over_k)} values would overflow at that scale" if over_k else "")
        + "."
    )
    if (atk or 0) > cfg.fp16_underflow_ok and norm_k is not None and norm_mod is not None:
        msg += (
            f" The values still lost at {_pow2(k)} (all below 2^{_log2i(FP16.underflow_max) - k}) carry at most "
            f"{_pct(norm_k)} of a module's activation-gradient L2 norm ({_name(norm_mod)}; estimated from the "
            "histogram)"
            + (": a whole layer's gradients are lost." if residual_matters else ": a negligible tail.")
        )
    if (at1 or 0) > cfg.fp16_underflow_ok:
        msg += (
            " The 2018 Mixed Precision Training paper saw the same for SSD and recovered fp32 accuracy with a "
            "loss scale of 8."
        )
    if atk is not None and atk > cfg.fp16_underflow_block and residual_matters:
        severity = CRITICAL
        plan.fp16_block.append(
            f"{_pct(atk)} of activation-gradient values still underflow fp16 at {_pow2(k)}, the largest safe "
            f"loss scale, taking {_pct(norm_k)} of {_name(norm_mod or '')}'s gradient norm with them (the "
            "model's gradients span more binades than fp16 holds)"
        )
        remedy = "Use bf16 or fp32: no single fp16 loss scale covers these gradients' range."
    elif atk is not None and atk > cfg.fp16_underflow_ok and residual_matters:
        severity = WARNING
        remedy = f"Start GradScaler at {_scale(k)}, and consider bf16: {_pct(atk)} still underflows there."
    elif (at1 or 0) > cfg.fp16_underflow_ok or (now or 0) > cfg.fp16_underflow_ok:
        severity = WARNING
        remedy = f"Scale the loss: GradScaler(init_scale={_scale(k)}) brings the underflow to {_pct(atk)}" + (
            ", a negligible tail." if (atk or 0) > cfg.fp16_underflow_ok else "."
        )
    else:
        severity = INFO
        remedy = f"Nothing to fix; GradScaler(init_scale={_scale(k)}) keeps it at {_pct(atk)}."
    by_mod = run.hist[run.hist[T.TENSOR] == T.ACTIVATION_GRAD]
    worst: list[str] = []
    if not by_mod.empty and atk:
        lim = _log2i(FP16.underflow_max)
        sel = by_mod[(by_mod[T.EXPONENT] + k + 1) <= lim]
        worst = run.sort(sel.groupby(T.MODULE)[T.COUNT].sum().nlargest(cfg.max_listed_modules).index)
    plan.add(
        Finding(
            "fp16_gradient_underflow",
            severity,
            f"fp16 gradient underflow: {_pct(at1)} at scale 1, {_pct(atk)} at {_pow2(k)}",
            msg,
            remedy,
            modules=worst,
            numbers={
                "share_now": now,
                "share_at_scale_1": at1,
                "share_at_recommended": atk,
                "loss_scale_log2": k,
                "nonzero_values": int(total),
                "underflow_at_recommended": int(sure_k),
                "boundary_values_at_recommended": int(boundary_k),
                "overflow_at_recommended": int(over_k),
                "fp16_zero_share": zero16,
                "weight_grad_share_at_recommended": wg_share,
                "max_module_norm_share_at_recommended": norm_k,
                "max_norm_share_module": norm_mod,
            },
        )
    )


def _rule_fp16_gradient_overflow(run: _Run, plan: _Plan) -> None:
    g = run.kind(*T.GRADIENT_KINDS)
    g = g[(g[T.overflow_col("fp16")] > 0) | (_dtype_has(g, "float16") & (g[T.INF] > 0))]
    if g.empty:
        return
    mods = run.sort(g[T.MODULE])
    steps = sorted(int(s) for s in g[T.STEP].unique())
    n = int(g[T.overflow_col("fp16")].sum() + g[_dtype_has(g, "float16")][T.INF].sum())
    scales = sorted({float(s) for s in g[T.SCALE].unique()})
    plan.add(
        Finding(
            "fp16_gradient_overflow",
            WARNING,
            f"Gradients overflow fp16 at the scale in effect in {len(mods)} module(s)",
            f"On {len(steps)} sampled step(s) ({_listing([str(s) for s in steps], 6)}), {n} gradient values in "
            f"{_listing(mods, run.cfg.max_listed_modules)} overflow fp16 at loss scale "
            f"{', '.join(f'{s:g}' for s in scales)}; GradScaler skips those steps (and lowers its scale), loss "
            "scaling without an inf check would apply the inf/nan updates.",
            f"Start at the recommended loss scale {_pow2(plan.loss_scale_log2)}, which keeps the largest "
            "gradient below the limit.",
            modules=mods,
            numbers={"values": n, "steps": len(steps), "max_scale": max(scales)},
        )
    )


def _rule_scaler(run: _Run, plan: _Plan) -> None:
    cfg = run.cfg
    st = run.steps
    run_gi = run.run_config.get("growth_interval")
    run_gi = int(run_gi) if isinstance(run_gi, (int, float)) and run_gi > 0 else cfg.default_growth_interval
    plan.growth_interval = cfg.default_growth_interval
    if st.empty or st[T.LOSS_SCALE].isna().all():
        return
    skipped = st[T.SKIPPED].fillna(False).astype(bool)
    n = int(skipped.sum())
    k = plan.loss_scale_log2
    rec = 2.0**k
    scale = st[T.LOSS_SCALE]
    if n:
        sk = st[skipped]
        avoid = int((sk[T.LOSS_SCALE] > rec).sum())
        first_ok = st.index[~skipped]
        start = float(scale.iloc[0])
        settled = float(scale[~skipped].iloc[0]) if len(first_ok) else None
        msg = (
            f"The dynamic loss scaler skipped {n} of {len(st)} optimizer steps (scale started at {start:g}"
            + (f", first successful step at scale {settled:g}" if settled is not None else "")
            + f"). {avoid} of those skips happened at a scale above the recommended {_pow2(k)}: starting "
            f"GradScaler at {_scale(k)} avoids them"
            + (
                f"; the other {n - avoid} happened at or below it (gradient spikes, or non-finite values "
                "that no scale fixes)."
                if n - avoid
                else "."
            )
        )
        plan.add(
            Finding(
                "scaler_skipped_steps",
                WARNING,
                f"{n} optimizer steps skipped by the loss scaler",
                msg,
                f"Use GradScaler(init_scale={_scale(k)}).",
                numbers={
                    "skipped": n,
                    "steps": len(st),
                    "avoidable": avoid,
                    "start_scale": start,
                    "first_ok_scale": settled,
                    "recommended_scale": rec,
                },
            )
        )
    # Thrashing: after the first successful step, the scaler grows, overflows, backs off, again and again.
    ok_idx = st.index[~skipped]
    if len(ok_idx):
        after = st.loc[ok_idx[0] :]
        later_skips = int(skipped.loc[ok_idx[0] :].sum())
        grows = int((after[T.LOSS_SCALE].diff() > 0).sum())
        if later_skips >= cfg.thrash_min_skips and grows >= 1:
            new_gi = max(cfg.default_growth_interval, 2 * run_gi)
            plan.growth_interval = new_gi
            every = len(after) / later_skips
            plan.add(
                Finding(
                    "scaler_thrashing",
                    WARNING,
                    "The loss scaler thrashes: it grows, overflows and backs off repeatedly",
                    f"After its first successful step the scaler grew {grows} time(s) and skipped "
                    f"{later_skips} of {len(after)} steps (one every {every:.0f}) with growth_interval "
                    f"{run_gi}; each growth past the safe scale costs a step.",
                    f"Start at {_scale(k)} and raise growth_interval to {new_gi}.",
                    numbers={
                        "growths": grows,
                        "later_skips": later_skips,
                        "steps_after": len(after),
                        "growth_interval": run_gi,
                        "recommended_growth_interval": new_gi,
                    },
                )
            )


def _rule_lost_updates(run: _Run, plan: _Plan) -> None:
    cfg = run.cfg
    wu = run.kind(T.WEIGHT_UPDATE)
    if wu.empty:
        return
    for fmt, col, pure in (
        ("bf16", T.LOST_UPDATE_BF16, "bf16-pure"),
        ("fp16", T.LOST_UPDATE_FP16, "fp16-pure"),
    ):
        rows = wu[wu[col].notna()]
        if rows.empty:
            continue
        nz = float((rows[T.NUMEL] - rows[T.ZEROS]).clip(lower=0).sum())
        lost = float(rows[col].sum())
        share = _share(lost, nz)
        if share is None:
            continue
        by = (
            rows.assign(_nz=(rows[T.NUMEL] - rows[T.ZEROS]).clip(lower=0))
            .groupby(T.MODULE)[[col, "_nz"]]
            .sum()
        )
        by = by[by["_nz"] > 0]
        by_share = (by[col] / by["_nz"]).sort_values(ascending=False)
        worst = run.sort(by_share[by_share > cfg.lost_update_warn].index[: cfg.max_listed_modules])
        resolution = "2^-8" if fmt == "bf16" else "2^-11"
        is_pure = run.precision == pure
        # With fp32 master weights (autocast, fp32) this is a what-if: it only hurts a run that holds its
        # weights in the format, and it is the reason to keep fp32 master weights.
        if share > cfg.lost_update_warn and is_pure:
            severity = CRITICAL
        elif fmt == "fp16" and share <= cfg.lost_update_warn:
            continue  # fp16 master weights are rare; only worth a line when they lose updates
        else:
            severity = INFO
        plan.add(
            Finding(
                f"{fmt}_lost_updates",
                severity,
                f"{_pct(share)} of weight updates vanish with {fmt} master weights",
                f"On sampled steps, {int(lost)} of {int(nz)} nonzero weight-update elements ({_pct(share)}) are "
                f"smaller than half a {fmt} ulp of their weight (relative resolution {resolution}) and would be "
                f"lost if the weights were held in {fmt}"
                + (f" — as they are in this {pure} run" if is_pure else "")
                + (
                    "; worst: "
                    + ", ".join(
                        f"{_name(m)} {_pct(float(by_share[m]))}" for m in worst[: cfg.max_listed_modules]
                    )
                    if worst
                    else ""
                )
                + ". Mixed Precision Training (2018) keeps an fp32 master copy for this reason.",
                f"Keep fp32 master weights ({fmt} autocast does); do not train {pure}.",
                modules=worst,
                numbers={"lost": int(lost), "nonzero_updates": int(nz), "share": share},
            )
        )


def _rule_bf16_range(run: _Run, plan: _Plan) -> None:
    cfg = run.cfg
    counts = _exponent_counts(run.hist, T.GRADIENT_KINDS)
    total = float(counts.sum())
    sure, _ = _shifted_underflow(counts, BF16, 0)
    share = _share(sure, total)
    acts = run.kind(T.ACTIVATION)
    over = acts[(acts[T.overflow_col("bf16")] > 0) & ~_dtype_has(acts, "bfloat16")]
    if share is not None and share > cfg.bf16_underflow_block:
        plan.bf16_block.append(f"{_pct(share)} of gradient values underflow bf16 (below 2^-133)")
        plan.add(
            Finding(
                "bf16_gradient_underflow",
                CRITICAL,
                f"{_pct(share)} of gradients underflow bf16",
                f"{int(sure)} of {int(total)} nonzero gradient values are at or below 2^-134 and would become "
                "0 in bf16 (it has no loss scaling).",
                "Use fp16 with a loss scale or fp32 for this model.",
                numbers={"underflow_values": int(sure), "nonzero_values": int(total), "share": share},
            )
        )
    if not over.empty:
        mods = run.sort(_innermost(over[T.MODULE]))
        plan.keep_bf16 = mods
        plan.bf16_block.append(f"activations of {_listing(mods, 4)} overflow bf16")
        plan.add(
            Finding(
                "bf16_activation_overflow",
                CRITICAL,
                "Activations overflow bf16",
                f"{int(over[T.overflow_col('bf16')].sum())} activation values in "
                f"{_listing(mods, cfg.max_listed_modules)} exceed bf16's largest value (3.39e38).",
                "Find the module producing these values: they are near fp32's limit too.",
                modules=mods,
                numbers={"values": int(over[T.overflow_col("bf16")].sum())},
            )
        )


def _tokens_per_call(run: _Run) -> int | None:
    c = run.run_config
    b, t = c.get("batch_size"), c.get("seq_len")
    if isinstance(b, int) and b > 0:
        return b * (t if isinstance(t, int) and t > 0 else 1)
    return None


def _layer_dims(run: _Run) -> dict[str, dict[str, int]]:
    """Dimensions of linear layers ({"in", "out"}) and embeddings ({"num_embeddings", "dim"}).

    From the parameter shapes the Profiler records in summary["capture"]["modules"] when present (Linear
    weights are (out, in), HF Conv1D weights (in, out), Embedding weights (num, dim)). Otherwise inferred from
    numels: a (..., out) output with batch*seq tokens per call gives out = numel / (calls * tokens), and the
    other dim = weight numel / out; layers where that does not divide are left out.
    """
    out: dict[str, dict[str, int]] = {}
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    mods = capture.get("modules") if isinstance(capture, Mapping) else None
    for entry in mods if isinstance(mods, list) else []:
        if not isinstance(entry, Mapping):
            continue
        name, t = str(entry.get("name", "")), str(entry.get("type", ""))
        shape = (entry.get("params") or {}).get("weight")
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(v, int) for v in shape)):
            continue
        if _EMBEDDING_RE.search(t):
            out[name] = {"num_embeddings": shape[0], "dim": shape[1]}
        elif t == "Conv1D":
            out[name] = {"in": shape[0], "out": shape[1]}
        elif _is_linear(t):
            out[name] = {"in": shape[1], "out": shape[0]}
    tokens = _tokens_per_call(run)
    if tokens is None or run.layers.empty:
        return out
    first = run.layers[run.layers[T.STEP] == run.layers[T.STEP].min()]
    acts = first[first[T.TENSOR] == T.ACTIVATION].groupby(T.MODULE)[[T.NUMEL, T.CALLS]].sum()
    w = first[(first[T.TENSOR] == T.WEIGHT) & (first[T.PARAM] == "weight")].groupby(T.MODULE)[T.NUMEL].sum()
    for m, wn in w.items():
        m = str(m)
        t = run.types.get(m, "")
        if m in out or not (_is_linear(t) or _EMBEDDING_RE.search(t)) or m not in acts.index:
            continue
        numel, calls = int(acts.loc[m, T.NUMEL]), int(acts.loc[m, T.CALLS] or 1)
        per = calls * tokens
        if per <= 0 or numel % per:
            continue
        last = numel // per
        if last <= 0 or int(wn) % last:
            continue
        other = int(wn) // last
        out[m] = (
            {"num_embeddings": other, "dim": last} if _EMBEDDING_RE.search(t) else {"in": other, "out": last}
        )
    return out


def _model_dims(run: _Run) -> dict[str, int]:
    """Tensor dimensions named in summary["model"] (flat, or under "dims"), plus the attention head dim."""
    model = run.summary.get(T.SUMMARY_MODEL) or {}
    if not isinstance(model, Mapping):
        return {}
    nested = model.get("dims")
    flat = {**model, **(nested if isinstance(nested, Mapping) else {})}
    dims = {
        k: v for k in _DIM_KEYS if isinstance(v := flat.get(k), int) and not isinstance(v, bool) and v > 0
    }
    width = flat.get("n_embd") or flat.get("hidden_size")
    heads = flat.get("n_head") or flat.get("num_attention_heads")
    if isinstance(width, int) and isinstance(heads, int) and heads > 0 and width % heads == 0:
        dims["head_dim"] = width // heads
    return dims


def _rule_alignment(run: _Run, plan: _Plan, dims: dict[str, dict[str, int]]) -> None:
    cfg = run.cfg
    a = cfg.alignment
    bad: dict[str, str] = {}
    for m, d in dims.items():
        off = [f"{lbl}={v}" for lbl, v in d.items() if v % a]
        if off:
            bad[m] = ", ".join(off)
    model_off = {k: v for k, v in _model_dims(run).items() if v % a}
    tokens = _tokens_per_call(run)
    tok_off = tokens is not None and tokens % a != 0
    if not (bad or model_off or tok_off):
        return
    parts = []
    if model_off:
        parts.append("model dims " + ", ".join(f"{k}={v}" for k, v in model_off.items()))
    if bad:
        parts.append(
            "layers "
            + "; ".join(f"{_name(m)} ({bad[m]})" for m in run.sort(bad)[: cfg.max_listed_modules])
            + (f" and {len(bad) - cfg.max_listed_modules} more" if len(bad) > cfg.max_listed_modules else "")
        )
    if tok_off:
        parts.append(f"batch x sequence = {tokens}")
    numbers: dict[str, Number] = {"alignment": a, "layers": len(bad), "tokens": tokens}
    numbers.update({f"dim_{k}": v for k, v in model_off.items()})
    plan.add(
        Finding(
            "tensor_core_alignment",
            WARNING if run.hw.device == "cuda" else INFO,
            f"Dimensions not a multiple of {a}",
            f"Tensor cores run fp16/bf16 matmuls at full speed when every dimension is a multiple of {a} "
            f"({cfg.fp8_alignment} for FP8); these are not: {'; '.join(parts)}.",
            f"Pad them to a multiple of {a} or 64 (nanoGPT pads GPT-2's vocabulary from 50257 to 50304).",
            modules=run.sort(bad),
            numbers=numbers,
        )
    )


def _rule_fp8(run: _Run, plan: _Plan, dims: dict[str, dict[str, int]]) -> None:
    cfg = run.cfg
    linear = [m for m in plan.matmul_layers if _is_linear(run.types.get(m, ""))]
    if not linear:
        return
    e4, e5 = T.underflow_cs_col(FP8_E4M3.name), T.underflow_cs_col(FP8_E5M2.name)
    lay = run.layers[run.layers[T.MODULE].isin(linear)]
    rows: list[tuple[str, float | None, float | None, str]] = []
    for m in linear:
        mine = lay[lay[T.MODULE] == m]
        fwd = mine[mine[T.TENSOR].isin((T.ACTIVATION, T.WEIGHT))]
        bwd = mine[mine[T.TENSOR] == T.ACTIVATION_GRAD]
        f_share = _share(float(fwd[e4].sum()), _nonzero(fwd))
        b_share = _share(float(bwd[e5].sum()), _nonzero(bwd))
        why = ""
        if (mine[T.NAN] + mine[T.INF]).sum() > 0:
            why = "non-finite values"
        elif f_share is None or b_share is None:
            why = "no forward or backward statistics"
        elif f_share > cfg.fp8_underflow_max:
            why = f"e4m3 forward underflow {_pct(f_share)}"
        elif b_share > cfg.fp8_underflow_max:
            why = f"e5m2 gradient underflow {_pct(b_share)}"
        elif m in dims and any(v % cfg.fp8_alignment for v in dims[m].values()):
            why = f"dims {dims[m]['in']}x{dims[m]['out']} not multiples of {cfg.fp8_alignment}"
        rows.append((m, f_share, b_share, why))
    plan.fp8_checked = len(rows)
    plan.fp8_eligible = [m for m, _, _, why in rows if not why]
    bad = [(m, why) for m, _, _, why in rows if why]
    fmax = max((f for _, f, _, _ in rows if f is not None), default=None)
    bmax = max((b for _, _, b, _ in rows if b is not None), default=None)
    plan.add(
        Finding(
            "fp8_eligibility",
            WARNING if run.hw.fp8_supported and not plan.fp8_eligible else INFO,
            f"{len(plan.fp8_eligible)} of {len(rows)} linear layers are FP8-eligible",
            f"Under per-tensor current scaling (scale 2^floor(log2(fmax/amax)), Transformer Engine's "
            f"current-scaling recipe), a layer is eligible when at most {_pct(cfg.fp8_underflow_max)} of its "
            "nonzero weight and output values underflow e4m3 and of its output gradients underflow e5m2 "
            "(its input is the previous module's output, checked there). "
            f"{len(plan.fp8_eligible)} of {len(rows)} qualify; worst shares: e4m3 {_pct(fmax)}, e5m2 {_pct(bmax)}"
            + (
                ". Not eligible: " + "; ".join(f"{_name(m)} ({w})" for m, w in bad[: cfg.max_listed_modules])
                if bad
                else ""
            )
            + ".",
            ("Convert" if run.hw.fp8_supported else "On FP8 hardware (compute capability 8.9+), convert")
            + " the eligible layers to FP8 (torchao convert_to_float8_training with a module filter) and keep "
            "the others in bf16.",
            modules=plan.fp8_eligible,
            numbers={
                "eligible": len(plan.fp8_eligible),
                "checked": len(rows),
                "max_e4m3_share": fmax,
                "max_e5m2_share": bmax,
                "threshold": cfg.fp8_underflow_max,
            },
        )
    )


def _rule_small_model(run: _Run, plan: _Plan) -> None:
    model = run.summary.get(T.SUMMARY_MODEL) or {}
    n = model.get("n_params") if isinstance(model, Mapping) else None
    if not isinstance(n, int):
        w = run.kind(T.WEIGHT)
        if w.empty:
            return
        first = w[w[T.STEP] == w[T.STEP].min()]
        n = int(first.drop_duplicates([T.MODULE, T.PARAM])[T.NUMEL].sum())
    plan.n_params = n
    if n >= run.cfg.small_model_params:
        return
    plan.add(
        Finding(
            "small_model",
            INFO,
            f"Small model: {n / 1e6:.3g}M parameters",
            f"The model has {n} parameters, below {run.cfg.small_model_params / 1e6:g}M: its matmuls are "
            "small, so the step time is often bound by kernel launches and memory traffic rather than math, "
            "and mixed precision may not speed it up.",
            "Time a few steps in fp32 and in the recommended format; keep fp32 if it is not faster.",
            numbers={"n_params": n, "threshold": run.cfg.small_model_params},
        )
    )


# ------------------------------------------------------------------------------------------- entry point
def _load(
    source: Any, summary: Mapping[str, Any] | None
) -> tuple[Mapping[str, pd.DataFrame], dict[str, Any]]:
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_dir():
            raise FileNotFoundError(f"run directory {str(path)!r} does not exist")
        return T.read_tables(path), dict(summary if summary is not None else T.read_summary(path))
    if isinstance(source, Mapping):
        return source, dict(summary or {})
    if callable(getattr(source, "tables", None)):
        # a Profiler: its summary() is the "capture" part of summary.json (module shapes, autocast seen)
        s = dict(summary or {})
        if T.SUMMARY_CAPTURE not in s and callable(getattr(source, "summary", None)):
            s[T.SUMMARY_CAPTURE] = source.summary()
        return source.tables(), s
    raise TypeError(
        f"recommend() takes a run directory, a dict of tables or a Profiler, not {type(source)!r}"
    )


def _hardware(hardware: str | HardwareInfo | None, summary: Mapping[str, Any]) -> tuple[HardwareInfo, bool]:
    if isinstance(hardware, HardwareInfo):
        return hardware, hardware.preset is not None
    if isinstance(hardware, str):
        return hw_mod.preset(hardware), True
    recorded = summary.get(T.SUMMARY_HARDWARE)
    if isinstance(recorded, Mapping) and recorded.get("device"):
        return HardwareInfo.from_dict(dict(recorded)), False
    return hw_mod.detect(), False


def recommend(
    tables_or_run_dir: Any,
    hardware: str | HardwareInfo | None = None,
    config: AdvisorConfig | None = None,
    summary: Mapping[str, Any] | None = None,
) -> Recommendation:
    """Recommend a number format, a loss scale and the layers to keep in fp32, with the findings behind them.

    ``tables_or_run_dir``: a run directory, a dict of the four tables (``Profiler.tables()``), or a Profiler.
    ``hardware``: None plans for the machine the run was recorded on (summary["hardware"], else this one); a
    preset name ("v100", "t4", "a100", "l4", "h100", "cpu") or a ``HardwareInfo`` plans for that target.
    ``summary``: summary.json's content (read from the run directory when omitted). Pure host-side pandas work.
    """
    cfg = config or AdvisorConfig()
    tables, summ = _load(tables_or_run_dir, summary)
    layers, hist, steps = _prepare(tables)
    hw, is_preset = _hardware(hardware, summ)
    run = _Run(layers, hist, steps, summ, hw, is_preset, cfg)
    if not layers.empty:
        run.order = layers.groupby(T.MODULE)[T.ORDER].min().fillna(1 << 30).astype(int).to_dict()
        run.types = layers.groupby(T.MODULE)[T.MODULE_TYPE].first().to_dict()
    plan = _Plan(loss_scale_log2=cfg.default_loss_scale_log2, growth_interval=cfg.default_growth_interval)
    plan.matmul_layers = _matmul_leaves(run)
    dims = _layer_dims(run)

    _rule_hardware(run, plan)
    fwd_bad = _rule_nonfinite(run, plan)
    _rule_mixed_precision_active(run, plan)
    _rule_fp16_activations(run, plan)
    _rule_loss_scale(run, plan, fwd_bad)
    _rule_lost_updates(run, plan)
    _rule_bf16_range(run, plan)
    _rule_fp8(run, plan, dims)
    _rule_alignment(run, plan, dims)
    _rule_small_model(run, plan)

    rec = _decide(run, plan)
    rec.findings = sorted(plan.findings, key=lambda f: _SEVERITY_RANK.get(f.severity, 9))
    for f in rec.findings:
        f.numbers = {k: _num(v) for k, v in f.numbers.items()}
    return rec


def _decide(run: _Run, plan: _Plan) -> Recommendation:
    hw, cfg = run.hw, run.cfg
    target = hw.preset or hw.name
    k = plan.loss_scale_log2
    reasons: list[str] = []
    bf16_ok = hw.bf16_native
    where = f"{hw.name}" + (
        f" (compute capability {'.'.join(map(str, hw.compute_capability))})" if hw.compute_capability else ""
    )
    fmt: str
    if hw.fp8_supported and hw.fp8_library and plan.fp8_eligible and bf16_ok and not plan.bf16_block:
        fmt = "fp8"
        reasons.append(
            f"{where} has FP8 tensor cores and {hw.fp8_library}: {len(plan.fp8_eligible)} of "
            f"{plan.fp8_checked} linear layers keep e4m3/e5m2 underflow at or below "
            f"{_pct(cfg.fp8_underflow_max)} under per-tensor current scaling, so they can run in FP8; "
            "the rest runs in bf16 autocast."
        )
    elif bf16_ok and not plan.bf16_block:
        fmt = "bf16"
        why = "runs bf16 natively"
        if hw.fp8_supported and not plan.fp8_eligible and plan.fp8_checked:
            why += f", and none of its {plan.fp8_checked} linear layers is FP8-eligible"
        reasons.append(
            f"{where} {why}; bf16 has fp32's exponent range, so no loss scale is needed and the measured "
            "gradients do not underflow it."
        )
    elif hw.fp16_tensor_cores and not plan.fp16_block:
        fmt = "fp16"
        if not bf16_ok:
            reasons.append(f"{where} has fp16 tensor cores but no native bf16.")
        else:
            reasons.append("bf16 is ruled out: " + "; ".join(plan.bf16_block) + ".")
    elif hw.tf32_supported:
        fmt = "tf32"
    else:
        fmt = "fp32"
    if fmt in ("tf32", "fp32"):
        blocks = []
        if not bf16_ok:
            blocks.append(f"{where} has no native bf16")
        elif plan.bf16_block:
            blocks.append("bf16 is ruled out: " + "; ".join(plan.bf16_block))
        if not hw.fp16_tensor_cores:
            blocks.append("it has no fp16 tensor cores")
        elif plan.fp16_block:
            blocks.append("fp16 is ruled out: " + "; ".join(plan.fp16_block))
        reasons.append(
            "; ".join(blocks)
            + (
                ". TF32 keeps fp32's range and speeds up its matmuls (set_float32_matmul_precision('high'))."
                if fmt == "tf32"
                else ", so fp32 is the safe choice."
            )
        )
    if fmt == "fp16":
        gm = plan.grad_absmax
        reasons.append(
            f"Start GradScaler at init_scale={_scale(k)} (2^{k}): the largest gradient seen, {_g(gm)}, times "
            f"2^{k} stays below 65504 / {2**cfg.fp16_margin_log2}; activation-gradient underflow falls from "
            f"{_pct(plan.underflow_at_1)} at scale 1 to {_pct(plan.underflow_at_rec)}."
        )
        if plan.keep_fp16:
            reasons.append(
                f"Keep {_listing(plan.keep_fp16, cfg.max_listed_modules)} in fp32: their activations "
                "overflow or come within 2x of fp16's 65504."
            )
        reasons.append("Keep fp32 master weights and optimizer states (autocast with an fp32 model does).")
    if plan.n_params is not None and plan.n_params < cfg.small_model_params and fmt not in ("fp32", "tf32"):
        reasons.append(
            f"The model is small ({plan.n_params / 1e6:.3g}M parameters): if {fmt} is not faster in practice, "
            "fp32 is just as good."
        )
    keep = {"fp16": plan.keep_fp16, "bf16": plan.keep_bf16, "fp8": plan.keep_bf16}.get(fmt, [])
    return Recommendation(
        format=fmt,
        loss_scale=2.0**k if fmt == "fp16" else None,
        fp16_loss_scale=2.0**k,
        growth_interval=plan.growth_interval if fmt == "fp16" else None,
        keep_fp32=list(keep),
        fp8_layers=list(plan.fp8_eligible) if fmt == "fp8" else [],
        reasons=reasons,
        target=target,
    )
