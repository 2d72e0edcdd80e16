"""When FP8 pays: an estimate of the speed per-tensor (tensorwise) FP8 brings to a whole training step, from the
GEMM shapes of its linear layers. An estimate, never a measurement of the run: the report says so.

Each linear layer's forward and backward (three GEMMs, and in FP8 the casts of its input, weight and output
gradient) was timed alone on an H200, in bf16 autocast and as torchao's ``Float8Linear``, both compiled, at 28
shapes and 8,192 tokens a call, as CUDA graph replays: the GPU's time, without the host's launches
(``LAYER_TIMES``, from ``bench/fp8_layers.py``). A step is then

    bf16:  the sum of its linear layers' bf16 times + rest (M K + M N) per linear layer
    FP8:   the same, each converted layer's bf16 time replaced by its FP8 time

``rest`` is what the step's other work (attention, norms, activations, residuals, the loss, the optimizer, the
embedding: memory-bound work that grows with the tokens and the widths, as M K + M N does) costs per element of
a linear layer's input and output. It is the model's one fitted constant: least squares on the bf16 times of
the whole steps in ``MEASURED`` whose ``role`` is "fit" (three models on an H200, torch 2.11, torchao 0.17,
compiled): 15.9 ps. A shape the table lacks takes the time per M K N of its four nearest timed shapes (in log
K and log N; four of one to eight neighbours predict the table's own speedups best, left out one at a time: 7.0%
RMS error, 7.0% with six, 8.1% with two, ``leave_one_out``), and a layer of other than 8,192 tokens scales with
them. FP8 is no single rate: at 8,192 tokens the large GEMMs ran at 1.38-1.62x in FP8, 2048 x 2048 at 1.03x,
layers with a 1024-wide side at 0.71-1.09x and those with a 768-wide one at 0.66-0.86x, so the table, not a
formula of the intensity, decides.

What the fit leaves: the three steps come out at 0.96x (measured 0.75x), 1.12x (0.86x) and 1.25x (1.25x);
each left out of the fit (its constant from the other two) at 0.95x, 1.10x and 1.24x. qwen2-2048 is a known
miss (``Measurement.miss``): on the wrong side of 1 and of the advisor's 1.1x threshold, so the advisor would
say FP8 for a step FP8 slowed. Its layers' GPU times say FP8 saves 5.8 ms of their 24.2 ms, yet its FP8 step
took 7.3 ms more than bf16's: what FP8 costs a whole step beyond its layers' GPU time (the host's launches of
its extra kernels, most likely, which a step of small layers does not hide) the model has no term for.
gpt2-small's steps have small layers too and may be host-bound the same way: estimated 0.96x, they stay under 1
(measured 0.75x, 0.75x without precprof) but err by 0.21 towards FP8. "check" measurements must fall on their
side of 1 and of the advisor's threshold (tests/test_fp8_speed.py); "reference" ones, other stacks, are
reported beside it. qwen2-3072 (Llama-3.2-3B's blocks), a check: out of sample it missed at 1.06x / 1.09x
(the call-by-call table, interpolated from four and then two neighbours); with its shapes timed as graphs it
is estimated at 1.17x (measured 1.19x).

History: until 2026-11-27 the estimate had two fitted constants (a cast cost per element and ``rest``) fitted
on gpt2-small and qwen2-2048 alone. It reproduced them by construction, and the third model, qwen2 with
Llama3-8B's block shapes, refuted it: estimated 1.01x, measured 1.25x (``bench/results/README_h200_2026-11-27b.md``).
Then the table of 2026-11-27 (``bench/results/fp8_layers_nvidia-h200_2026-11-27.json``, 23 shapes) timed
each layer call by call from Python: for small shapes that is the host's launch rate, not the GPU's (2048 x
2048 at 0.47x there, 1.03x as graphs), and it reproduced the host-bound small steps while it missed
qwen2-3072; it was replaced by graph replays (``..._2026-11-27c.json``), which judge the GPU-bound steps and
miss the host-bound qwen2-2048.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Shape = tuple[int, int, int]  # forward (M tokens, K = in_features, N = out_features) of one call

# tokens per call of LAYER_TIMES
TABLE_TOKENS = 8 * 1024
# (K, N) -> (bf16, FP8) microseconds of one linear layer's forward and backward at TABLE_TOKENS tokens, fp32
# weights, bf16 autocast against torchao 0.17 Float8Linear (tensorwise), both torch.compile'd: CUDA graph
# replays (the GPU's time, no host launches), median of 3 repeats of 20 calls, on an NVIDIA H200, torch 2.11,
# triton 3.6 (bench/results/fp8_layers_nvidia-h200_2026-11-27c.json, its time_s)
LAYER_TIMES: dict[tuple[int, int], tuple[float, float]] = {
    (768, 2304): (139, 172),
    (768, 768): (63, 95),
    (768, 3072): (176, 206),
    (3072, 768): (177, 220),
    (2048, 2048): (286, 277),
    (2048, 8192): (1223, 887),
    (8192, 2048): (1224, 850),
    (2048, 32768): (4948, 3474),
    (4096, 4096): (1211, 843),
    (4096, 1024): (289, 294),
    (4096, 14336): (4317, 2853),
    (14336, 4096): (4305, 2789),
    (4096, 32768): (10111, 6464),
    (3072, 3072): (653, 527),
    (3072, 1024): (223, 253),
    (3072, 8192): (1821, 1293),
    (8192, 3072): (1849, 1242),
    (3072, 32768): (7738, 4876),
    (1024, 1024): (85, 119),
    (1024, 4096): (289, 298),
    (1024, 16384): (1242, 1144),
    (2048, 1024): (154, 175),
    (2048, 4096): (554, 470),
    (2048, 16384): (2466, 1873),
    (4096, 16384): (4992, 3283),
    (8192, 1024): (565, 524),
    (8192, 4096): (2438, 1668),
    (8192, 16384): (10178, 6297),
}
TABLE_DEVICE = "NVIDIA H200"
# how many timed shapes a shape the table lacks is interpolated from: the count of 1 to 8 whose leave-one-out
# error of a layer's FP8 speedup over the table is least (``leave_one_out``; 4: 7.0% RMS, 6 had 7.0%, 2 8.1%)
_NEAREST = 4


@dataclass(frozen=True)
class Measurement:
    """One measured FP8 (tensorwise, compiled) against bf16 (compiled) speedup: bf16 time / FP8 time.

    ``scope``: "linear" (one linear layer's forward and backward, its neighbours' work included) or "step" (a
    whole training step, attention and the optimizer included). ``shapes``: the forward (M, K, N) of the
    linear layers FP8 converted, one per layer and call; ``others``: those it left in bf16. ``role``: "fit"
    (sets ``rest`` from ``bf16_s``, the bf16 step's time), "check" (must fall on its side of 1) or "reference"
    (another stack: reported). ``cite``: where to find it, in a few words (``source`` says it all). ``miss``:
    for a "fit" or "check" step the estimate is known to get wrong, why (tests/test_fp8_speed.py asserts the
    miss as it stands, so that a change of it is seen)."""

    name: str
    scope: str
    device: str
    shapes: tuple[Shape, ...]
    speedup: float
    source: str
    others: tuple[Shape, ...] = ()
    role: str = "reference"
    bf16_s: float | None = None
    cite: str = ""
    miss: str = ""


@dataclass(frozen=True)
class Constants:
    """The model's fitted constant ``rest`` (seconds per element of a linear layer's input and output: the
    step's other work), ``fitted_on`` (the measurements it was solved from) and ``device`` (theirs and the
    layer table's)."""

    rest: float
    fitted_on: tuple[str, ...]
    device: str


def intensity(m: int, k: int, n: int) -> float:
    """M K N / (M K + K N + M N): GEMM work per element FP8 casts."""
    return m * k * n / (m * k + k * n + m * n)


def _interpolate(
    table: dict[tuple[int, int], tuple[float, float]], k: int, n: int, nearest: int
) -> tuple[float, float]:
    """(bf16, FP8) microseconds at TABLE_TOKENS tokens of a (k, n) ``table`` lacks: the geometric mean of the
    time per M K N of its ``nearest`` timed shapes in (log K, log N), weighted by inverse squared distance."""
    lk, ln = math.log2(k), math.log2(n)
    near = sorted(((math.log2(tk) - lk) ** 2 + (math.log2(tn) - ln) ** 2, tk, tn) for tk, tn in table)[
        :nearest
    ]
    wsum = lb = lf = 0.0
    for d2, tk, tn in near:
        w = 1.0 / d2
        tb, tf = table[(tk, tn)]
        lb += w * math.log(tb / (tk * tn))
        lf += w * math.log(tf / (tk * tn))
        wsum += w
    return math.exp(lb / wsum) * k * n, math.exp(lf / wsum) * k * n


def layer_times(m: int, k: int, n: int) -> tuple[float, float]:
    """(bf16, FP8) seconds of one linear layer's forward and backward of forward shape (m, k, n): from
    ``LAYER_TIMES`` for a timed (k, n), else interpolated from its ``_NEAREST`` nearest timed shapes (their
    time per M K N); scaled by m / TABLE_TOKENS."""
    hit = LAYER_TIMES.get((k, n))
    tb, tf = hit if hit is not None else _interpolate(LAYER_TIMES, k, n, _NEAREST)
    return tb * 1e-6 * m / TABLE_TOKENS, tf * 1e-6 * m / TABLE_TOKENS


@dataclass(frozen=True)
class LeaveOneOut:
    """How well the interpolation predicts the table from itself: each timed shape's bf16 and FP8 times
    interpolated from the others. ``bf16``, ``fp8``, ``speedup``: the RMS of the log of predicted / timed
    (0.18: about 18%) of the bf16 time, the FP8 time and their ratio; ``worst``: the (K, N) whose speedup erred
    most and by how much (log); ``interior``: the speedup's RMS over the shapes whose K and N both lie inside
    the others' range (interpolated, not extrapolated)."""

    nearest: int
    bf16: float
    fp8: float
    speedup: float
    worst: tuple[int, int, float]
    interior: float


def leave_one_out(
    nearest: int = _NEAREST, table: dict[tuple[int, int], tuple[float, float]] | None = None
) -> LeaveOneOut:
    """The interpolation from ``nearest`` shapes judged on ``table`` (``LAYER_TIMES``), one shape left out at a
    time."""
    table = LAYER_TIMES if table is None else table
    eb: list[float] = []
    ef: list[float] = []
    er: list[float] = []
    inner: list[float] = []
    worst = (0, 0, 0.0)
    for (k, n), (tb, tf) in table.items():
        rest = {kn: t for kn, t in table.items() if kn != (k, n)}
        pb, pf = _interpolate(rest, k, n, nearest)
        eb.append(math.log(pb / tb))
        ef.append(math.log(pf / tf))
        er.append(math.log((pb / pf) / (tb / tf)))
        if abs(er[-1]) > abs(worst[2]):
            worst = (k, n, er[-1])
        ks, ns = [kn[0] for kn in rest], [kn[1] for kn in rest]
        if min(ks) < k < max(ks) and min(ns) < n < max(ns):
            inner.append(er[-1])

    def rms(e: list[float]) -> float:
        return math.sqrt(sum(v * v for v in e) / len(e)) if e else math.nan

    return LeaveOneOut(nearest, rms(eb), rms(ef), rms(er), worst, rms(inner))


def _sums(shapes: Iterable[Shape]) -> tuple[float, float, float]:
    """(bf16 seconds, FP8 seconds, elements of inputs and outputs M K + M N), summed over the layers."""
    b = f = a = 0.0
    for m, k, n in shapes:
        tb, tf = layer_times(m, k, n)
        b += tb
        f += tf
        a += m * k + m * n
    return b, f, a


def fit(measurements: Iterable[Measurement]) -> Constants:
    """``rest`` from the whole-step measurements whose role is "fit": the bf16 step is the sum of its linear
    layers' bf16 times plus rest times their inputs' and outputs' elements; least squares on the relative error
    of each step's bf16 time, so each weighs alike."""
    num = den = 0.0
    names: list[str] = []
    devices: set[str] = set()
    for ms in measurements:
        if ms.role != "fit" or ms.scope != "step" or ms.bf16_s is None:
            continue
        b, _, a = _sums(ms.shapes + ms.others)
        num += (ms.bf16_s - b) * a / ms.bf16_s**2
        den += a * a / ms.bf16_s**2
        names.append(ms.name)
        devices.add(ms.device)
    if not names:
        raise ValueError(
            "a whole-step measurement with its bf16 step time is needed to fit the FP8 speed model"
        )
    return Constants(num / den, tuple(names), ", ".join(sorted(devices | {TABLE_DEVICE})))


def _blocks(n: int, block: Sequence[tuple[int, int]], tokens: int) -> tuple[Shape, ...]:
    return tuple((tokens, k, n_out) for _ in range(n) for k, n_out in block)


_TOKENS = 8 * 1024
# precprof's built-in gpt2-small: c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj in each of 12 blocks; the output
# head (768 -> 50257) is tied to the token embedding (and 50257 is no multiple of 16): it stays in bf16
GPT2_SMALL = _blocks(12, ((768, 2304), (768, 768), (768, 3072), (3072, 768)), _TOKENS)
GPT2_SMALL_HEAD = ((_TOKENS, 768, 50257),)
# bench/fp8_vs_bf16.py's qwen2-2048 (hidden 2048, intermediate 8192, 16 heads of 128 and 16 key-value heads, 4
# layers): q, k, v, o (2048 -> 2048), gate, up (2048 -> 8192), down (8192 -> 2048); its untied output head
# (2048 -> 32768) is converted too (29 Float8Linear in the run)
QWEN2_2048 = _blocks(4, ((2048, 2048),) * 4 + ((2048, 8192),) * 2 + ((8192, 2048),), _TOKENS)
QWEN2_2048_HEAD = ((_TOKENS, 2048, 32768),)
# Llama3-8B's blocks: q, o (4096 -> 4096), k, v (4096 -> 1024: 8 key-value heads of 128), gate, up (4096 ->
# 14336), down (14336 -> 4096)
_LLAMA3_BLOCK = (
    (4096, 4096),
    (4096, 1024),
    (4096, 1024),
    (4096, 4096),
    (4096, 14336),
    (4096, 14336),
    (14336, 4096),
)
# bench/fp8_vs_bf16.py's qwen2-4096: 4 of those blocks and an untied head 4096 -> 32768, all 29 converted
QWEN2_4096 = (*_blocks(4, _LLAMA3_BLOCK, _TOKENS), (_TOKENS, 4096, 32768))
_LLAMA3_8B = _blocks(32, _LLAMA3_BLOCK, _TOKENS)
# bench/fp8_vs_bf16.py's qwen2-3072, Llama-3.2-3B's blocks (hidden 3072, intermediate 8192, 24 heads of 128, 8
# key-value heads: k, v 3072 -> 1024), 4 of them and an untied head 3072 -> 32768, all 29 converted
_LLAMA32_3B_BLOCK = (
    (3072, 3072),
    (3072, 1024),
    (3072, 1024),
    (3072, 3072),
    (3072, 8192),
    (3072, 8192),
    (8192, 3072),
)
QWEN2_3072 = (*_blocks(4, _LLAMA32_3B_BLOCK, _TOKENS), (_TOKENS, 3072, 32768))
_H200_BENCH = (
    "bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27.json (bench/fp8_vs_bf16.py, 2026-11-27: NVIDIA H200, "
    "torch 2.11, triton 3.6, torchao 0.17 Float8Linear tensorwise, precprof's loop with the Profiler recording "
    "steps only, torch.compile on the whole model, batch 8 x 1024, median step after 20 of 300)"
)

MEASURED: tuple[Measurement, ...] = (
    Measurement(
        "gpt2-small, precprof's built-in model",
        "step",
        "NVIDIA H200",
        GPT2_SMALL,
        0.05442013350000252 / 0.07228337099999749,
        f"{_H200_BENCH}: 48 Float8Linear, bf16 54.4 ms against fp8 72.3 ms a step",
        GPT2_SMALL_HEAD,
        "fit",
        0.05442013350000252,
        cite="bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27.json",
    ),
    Measurement(
        "qwen2-2048, Hugging Face Qwen2 from a config",
        "step",
        "NVIDIA H200",
        QWEN2_2048 + QWEN2_2048_HEAD,
        0.04436811050004508 / 0.05170462099999895,
        "the same bench run, the same file: 29 Float8Linear, bf16 44.4 ms against fp8 51.7 ms a step",
        (),
        "fit",
        0.04436811050004508,
        cite="bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27.json",
        miss="its layers' GPU times (graph replays) say FP8 saves 5.8 ms of their 24.2 ms, yet its FP8 step took "
        "7.3 ms more: estimated 1.12x, above the advisor's 1.1x (it says FP8), measured 0.86x; what FP8 costs "
        "the step beyond its layers' GPU time (most likely the host's launches) the model has no term for",
    ),
    Measurement(
        "qwen2-4096, Hugging Face Qwen2 with Llama3-8B's block shapes",
        "step",
        "NVIDIA H200",
        QWEN2_4096,
        0.1122165825000252 / 0.08947757049998017,
        "bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27b.json (the same bench, its second run of the day, 200 "
        "steps): 29 Float8Linear, bf16 112.2 ms against fp8 89.5 ms a step, matching losses",
        (),
        "fit",
        0.1122165825000252,
        cite="bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27b.json",
    ),
    Measurement(
        "qwen2-3072, Hugging Face Qwen2 with Llama-3.2-3B's block shapes",
        "step",
        "NVIDIA H200",
        QWEN2_3072,
        0.061928149000010535 / 0.05184392649999836,
        "bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27c.json (the same bench, its third run of the day, 200 "
        "steps): 29 Float8Linear, bf16 61.9 ms against fp8 51.8 ms a step, fp8's loss within the noise of two "
        "bf16 seeds; not fitted on (its five shapes timed in the layer table since)",
        (),
        "check",
        0.061928149000010535,
        cite="bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27c.json",
    ),
    Measurement(
        "gpt2-small without precprof",
        "step",
        "NVIDIA H200",
        GPT2_SMALL,
        24.4 / 32.6,
        "measured by this project on an H200, 2026-11-26 (torch 2.11, torchao 0.17, 48 Float8Linear): batch "
        "8 x 1024, fused AdamW, torch.compile on the whole model, median of 15 steps without precprof, bf16 "
        "24.4 ms against fp8 32.6 ms a step",
        GPT2_SMALL_HEAD,
        "check",
        cite="this project's H200 run of 2026-11-26",
    ),
    Measurement(
        "Llama3-8B, torchtitan",
        "step",
        "8x NVIDIA H100",
        _LLAMA3_8B,
        7689.5 / 6150,
        "torchao README (pytorch/ao commit 2f688a0f9, 2025-08), Training benchmarks: Llama3-8B, batch 1 x 8192, "
        "torch.compile, FSDP2, tensorwise with float8 all-gather 7689.5 tokens/s against bf16's 6150 (+25%); "
        "another stack: FSDP2's float8 all-gather halves the weights' communication, which this model leaves "
        "out; its output head (4096 -> 128256) counted as left in bf16",
        ((_TOKENS, 4096, 128256),),
        cite="torchao README, training benchmarks: FSDP2 with float8 all-gather",
    ),
    Measurement(
        "torchao Float8Linear, small shapes",
        "linear",
        "NVIDIA H100",
        ((1024, 2048, 1024),),
        0.80,
        "torchao README, torchao/float8/README.md, section Performance, example 1 (pytorch/ao commit "
        "e850b90d2, 2025): M, K, N = 1024, 2048, 1024, benchmark speedup 0.80, tensorwise scaling, compiled; "
        "GPU kernel time of LayerNorm, Linear, Sigmoid (benchmarks/float8/float8_roofline.py), no step around it",
        cite="torchao/float8/README.md, Performance",
    ),
    Measurement(
        "torchao Float8Linear, large shapes",
        "linear",
        "NVIDIA H100",
        ((4096, 8192, 16384),),
        1.39,
        "the same README, example 2: M, K, N = 4096, 8192, 16384, benchmark speedup 1.39",
        cite="torchao/float8/README.md, Performance",
    ),
)
CONSTANTS: Constants = fit(MEASURED)
# the range of intensities (at TABLE_TOKENS tokens) of the timed shapes: a step's converted layers beyond it
# are extrapolated
TABLE_INTENSITY: tuple[float, float] = (
    min(intensity(TABLE_TOKENS, k, n) for k, n in LAYER_TIMES),
    max(intensity(TABLE_TOKENS, k, n) for k, n in LAYER_TIMES),
)

# the slowest and fastest FP8 layer of the table (bf16 time / FP8 time)
TABLE_SPEEDUPS: tuple[float, float] = (
    min(b / f for b, f in LAYER_TIMES.values()),
    max(b / f for b, f in LAYER_TIMES.values()),
)


@dataclass(frozen=True)
class Estimate:
    """FP8's estimated speed on a training step whose ``layers`` linear layers (one per call) FP8 converts and
    ``others`` it leaves in bf16: ``speedup`` (bf16 step time / FP8's), ``layers_speedup`` (the converted layers
    alone), ``gemm_share`` (the converted layers' estimated share of a bf16 step), ``intensity`` (M K N / (M K +
    K N + M N) summed over the converted layers), ``beyond`` ("below" or "above" when that intensity lies
    outside the timed shapes', else ""), ``timed`` (how many converted layers have a shape the table timed)
    and ``constants``."""

    speedup: float
    layers_speedup: float
    gemm_share: float
    intensity: float
    beyond: str
    layers: int
    others: int
    timed: int
    constants: Constants

    def explain(self) -> str:
        """How the estimate was reached, in two sentences the report shows."""
        c = self.constants
        lo, hi = TABLE_SPEEDUPS
        kept = (
            f", the {self.others} linear layer{'s' if self.others > 1 else ''} left in bf16"
            if self.others
            else ""
        )
        if self.timed == self.layers:
            timed = "all at shapes timed"
        elif self.timed == 0:
            timed = "none at a shape timed: each interpolated from the nearest timed shapes"
        else:
            timed = f"{self.timed} at shapes timed, the others interpolated from the nearest timed shapes"
        missed = _misses()
        return (
            f"FP8 would run the {self.layers} converted linear layers' forward and backward at "
            f"{self.layers_speedup:.2f}x of bf16's speed, by each shape's bf16 and FP8 times measured alone on an "
            f"{TABLE_DEVICE} as CUDA graph replays, the GPU's time without the host's launches ({timed}): FP8 halves a GEMM's time at the tensor cores' rate, but its casts and "
            f"extra kernels cost more than that saves on small GEMMs (the timed layers ran from {lo:.2f}x to "
            f"{hi:.2f}x). These layers take an estimated {self.gemm_share * 100:.0f}% of a bf16 step; the rest "
            f"(attention, norms, the "
            f"optimizer{kept}: {c.rest * 1e12:.1f} ps per element of each linear layer's input and output) FP8 "
            f"leaves as it is, so the step would run at {self.speedup:.2f}x.{missed}"
        )


def _misses() -> str:
    """The steps the estimate is known to miss, as a sentence for ``explain``."""
    out = []
    for m in MEASURED:
        est = estimate(m.shapes, m.others) if m.miss else None
        if est is not None:
            out.append(f"{m.name.split(',')[0]} ran at {m.speedup:.2f}x, estimated {est.speedup:.2f}x")
    if not out:
        return ""
    return (
        " Whole steps whose FP8 cost more than their layers' GPU times show have misled the estimate towards FP8 "
        f"({'; '.join(out)})."
    )


def layer_speedup(m: int, k: int, n: int) -> float:
    """The estimated FP8 speedup of one converted linear layer of forward shape (m, k, n), its forward and
    backward alone (no rest of the step around it)."""
    tb, tf = layer_times(m, k, n)
    return tb / tf


def estimate(
    shapes: Iterable[Shape], others: Iterable[Shape] = (), constants: Constants = CONSTANTS
) -> Estimate | None:
    """FP8's estimated speedup of a training step whose linear layers of these forward (tokens, in, out) shapes,
    one per layer and call, FP8 converts, while those of ``others`` stay in bf16. None without converted layers.
    """
    conv = [s for s in shapes if all(v > 0 for v in s)]
    if not conv:
        return None
    kept = [s for s in others if all(v > 0 for v in s)]
    cb, cf, ca = _sums(conv)
    ob, _, oa = _sums(kept)
    bf16 = cb + ob + constants.rest * (ca + oa)
    fp8 = bf16 - cb + cf
    w = c = 0.0
    for m, k, n in conv:
        w += m * k * n
        c += m * k + k * n + m * n
    i = w / c
    lo, hi = TABLE_INTENSITY
    beyond = "below" if i < lo * 0.999 else ("above" if i > hi * 1.001 else "")
    return Estimate(
        speedup=bf16 / fp8,
        layers_speedup=cb / cf,
        gemm_share=cb / bf16,
        intensity=i,
        beyond=beyond,
        layers=len(conv),
        others=len(kept),
        timed=sum((k, n) in LAYER_TIMES for _, k, n in conv),
        constants=constants,
    )


def sources() -> str:
    """Where the estimate's numbers come from, briefly: the layer table, then each measurement with what the
    estimate makes of it (``Measurement.source`` says the rest, in this module)."""
    role = {"fit": "fitted", "check": "checked", "reference": "reference"}
    out = []
    for m in MEASURED:
        est = estimate(m.shapes, m.others)
        value = None if est is None else (est.speedup if m.scope == "step" else est.layers_speedup)
        got = f", estimated {value:.2f}x" if value is not None else ""
        what = "a step" if m.scope == "step" else "one layer"
        how = role.get(m.role, m.role) + (", a known miss" if m.miss else "")
        out.append(f"{m.name} ({m.device}, {what} {m.speedup:.2f}x{got}; {how}; {m.cite})")
    return (
        f"layer times from bench/results/fp8_layers_nvidia-h200_2026-11-27c.json ({len(LAYER_TIMES)} shapes at "
        f"{TABLE_TOKENS} tokens on an {TABLE_DEVICE}, torch 2.11, torchao 0.17 Float8Linear tensorwise, both "
        f"compiled, timed as CUDA graph replays: the GPU's time); measured: {'; '.join(out)}. Each source in full: analysis/fp8_speed.py."
    )
