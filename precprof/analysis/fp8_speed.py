"""When FP8 pays: an estimate of the speed per-tensor (tensorwise) FP8 brings to a whole training step, from the
GEMM shapes of its linear layers. An estimate, never a measurement of the run: the report says so.

Each linear layer's forward and backward (three GEMMs, and in FP8 the casts of its input, weight and output
gradient) was timed alone on an H200, in bf16 autocast and as torchao's ``Float8Linear``, both compiled, at 28
shapes and 8,192 tokens a call (``bench/fp8_layers.py``, ``bench/results/fp8_layers_nvidia-h200_2026-11-27c.json``),
two ways: as CUDA graph replays, the GPU's time alone (``LAYER_TIMES_GPU``), and launched call after call from
Python (``LAYER_TIMES_LAUNCH``), about the larger of the host's launch time and the GPU's: for small shapes the
host's, where FP8's casts launch more kernels. With each table a step is

    bf16:  the sum of its linear layers' bf16 times + rest (M K + M N) per linear layer
    FP8:   the same, each converted layer's bf16 time replaced by its FP8 time

``rest`` is what the step's other work (attention, norms, activations, the loss, the optimizer: memory-bound
work that grows with the tokens and the widths, as M K + M N does) costs per element of a linear layer's input
and output: each table's one fitted constant, least squares on the bf16 times of the whole steps in
``MEASURED`` whose ``role`` is "fit" (three models on an H200, torch 2.11, torchao 0.17, compiled): 8.9 ps with
the call-by-call table, 15.9 ps with the graphs.

The estimate is a bracket: ``speedup_launch_bound`` (the call-by-call table: a step its host's launches bound)
and ``speedup_gpu_bound`` (the graph table: a step whose host keeps ahead of the GPU). ``speedup``, which the
advisor's verdict uses, is the lower end: FP8 is advised only when even that clears the threshold. Steps of
small layers ran host-bound (gpt2-small 0.72x to 0.96x, measured 0.75x), those of large layers GPU-bound
(qwen2-4096 1.24x to 1.25x, measured 1.25x).

A layer that runs fewer than the three GEMMs timed counts that share of its times (``GEMMS``): a frozen layer
(no weight gradient: a LoRA model's base layers) runs its forward and input-gradient GEMMs, two thirds, and one
without an output gradient either its forward alone, a third. The three do the same work (2 M K N FLOPs each) and
cast tensors of the same sizes, but were not timed apart: an approximation, which a measurement would replace.

A shape the table lacks takes the time per M K N of its four nearest timed shapes (in log K and log N), and a
layer of other than 8,192 tokens scales with them (a host-bound call would not: away from 8,192 tokens the
launch-bound end is rougher). Four of one to eight neighbours predict each table's own speedups best, left out
one at a time (``leave_one_out``): 7.0% RMS error on the graphs (six 7.0%, two 8.1%), 16.0% call by call (five
16.1%, eight 16.1%; its launch floors, not the interpolation, err). FP8 is no single rate: as graphs at 8,192
tokens the large GEMMs ran at 1.38-1.62x in FP8, 2048 x 2048 at 1.03x, layers with a 1024-wide side at
0.71-1.09x and those with a 768-wide one at 0.66-0.86x (call by call 0.49-1.56x), so the table decides.

What it leaves (tests/test_fp8_speed.py): every "fit" and "check" step's verdict falls on its measured side of 1
and of the advisor's 1.1x; no known miss (``Measurement.miss``). The measured value lies inside the bracket for
gpt2-small (0.72x to 0.96x: 0.75x, and 0.75x without precprof), outside it for the others: qwen2-2048 below
(0.92x to 1.12x: 0.86x; its FP8 step cost more than even its layers' launches timed alone show), qwen2-4096
just above (1.240x to 1.251x: 1.254x), qwen2-3072, a check not fitted on, above (1.10x to 1.17x: 1.19x), its
verdict FP8 right by a hair (1.103x against 1.1x). Each fit step left out of the fit (its constants from the
other two) keeps its verdict: 0.71x, 0.92x, 1.24x. "reference" measurements, other stacks, are reported beside.

History: until 2026-11-27 the estimate had two fitted constants (a cast cost per element and ``rest``) fitted
on gpt2-small and qwen2-2048 alone; qwen2 with Llama3-8B's block shapes refuted it (estimated 1.01x, measured
1.25x: ``bench/results/README_h200_2026-11-27b.md``). Then a per-shape table timed call by call
(``..._2026-11-27.json``, 23 shapes) reproduced the host-bound small steps and missed qwen2-3072 (1.06x for
1.19x); one of CUDA graph replays (``..._2026-11-27c.json``) judged the GPU-bound steps and missed qwen2-2048
(1.12x for 0.86x). Now both timings of that file bracket a step, and the verdict takes the lower end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Shape = tuple[int, int, int]  # forward (M tokens, K = in_features, N = out_features) of one call
# the GEMMs of one call's forward and backward the layer tables timed: forward, input gradient, weight gradient
GEMMS = 3
Table = dict[tuple[int, int], tuple[float, float]]

# tokens per call of the layer tables
TABLE_TOKENS = 8 * 1024
# (K, N) -> (bf16, FP8) microseconds of one linear layer's forward and backward at TABLE_TOKENS tokens, fp32
# weights, bf16 autocast against torchao 0.17 Float8Linear (tensorwise), both torch.compile'd, median of 3
# repeats of 20 calls, on an NVIDIA H200, torch 2.11, triton 3.6 (bench/results/fp8_layers_nvidia-h200_2026-11-27c.json,
# each as {(r["k"], r["n"]): (round(r["bf16"][key] * 1e6), round(r["fp8"][key] * 1e6))}):
# CUDA graph replays, the GPU's time without the host's launches (its graph_s)
LAYER_TIMES_GPU: Table = {
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
# the same calls launched one after another from Python: about max(host, GPU) a call (its eager_launch_s)
LAYER_TIMES_LAUNCH: Table = {
    (768, 2304): (647, 1046),
    (768, 768): (769, 1028),
    (768, 3072): (557, 1130),
    (3072, 768): (806, 1252),
    (2048, 2048): (756, 1094),
    (2048, 8192): (1218, 1301),
    (8192, 2048): (1287, 1228),
    (2048, 32768): (5094, 3665),
    (4096, 4096): (1239, 963),
    (4096, 1024): (602, 967),
    (4096, 14336): (4424, 2972),
    (14336, 4096): (4538, 3063),
    (4096, 32768): (10174, 6662),
    (3072, 3072): (709, 864),
    (3072, 1024): (553, 848),
    (3072, 8192): (1912, 1367),
    (8192, 3072): (1977, 1415),
    (3072, 32768): (7690, 5158),
    (1024, 1024): (721, 971),
    (1024, 4096): (743, 823),
    (1024, 16384): (1243, 1216),
    (2048, 1024): (791, 1151),
    (2048, 4096): (648, 967),
    (2048, 16384): (2495, 1990),
    (4096, 16384): (5128, 3480),
    (8192, 1024): (805, 1082),
    (8192, 4096): (2622, 1800),
    (8192, 16384): (10292, 6594),
}
TABLE_DEVICE = "NVIDIA H200"
# how many timed shapes a shape the table lacks is interpolated from, for both tables: the count of 1 to 8 whose
# leave-one-out error of a layer's FP8 speedup is least on each (``leave_one_out``; graphs: 4 7.0% RMS, 6 7.0%,
# 2 8.1%; call by call: 4 16.0%, 5 16.1%, 8 16.1%)
_NEAREST = 4


@dataclass(frozen=True)
class Measurement:
    """One measured FP8 (tensorwise, compiled) against bf16 (compiled) speedup: bf16 time / FP8 time.

    ``scope``: "linear" (one linear layer's forward and backward, its neighbours' work included) or "step" (a
    whole training step, attention and the optimizer included). ``shapes``: the forward (M, K, N) of the
    linear layers FP8 converted, one per layer and call; ``others``: those it left in bf16. ``role``: "fit"
    (sets ``rest`` from ``bf16_s``, the bf16 step's time), "check" (its verdict must fall on its side of 1 and
    of the threshold) or "reference" (another stack: reported). ``cite``: where to find it, in a few words
    (``source`` says it all). ``miss``: for a "fit" or "check" step whose verdict the estimate is known to get
    wrong, why (tests/test_fp8_speed.py asserts the miss as it stands, so that a change of it is seen)."""

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
    """The model's fitted constants, one per layer table: ``rest_launch_bound`` and ``rest_gpu_bound``
    (seconds per element of a linear layer's input and output: the step's other work), ``fitted_on`` (the
    measurements they were solved from) and ``device`` (theirs and the layer tables')."""

    rest_launch_bound: float
    rest_gpu_bound: float
    fitted_on: tuple[str, ...]
    device: str


def intensity(m: int, k: int, n: int) -> float:
    """M K N / (M K + K N + M N): GEMM work per element FP8 casts."""
    return m * k * n / (m * k + k * n + m * n)


def _interpolate(table: Table, k: int, n: int, nearest: int) -> tuple[float, float]:
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


def layer_times(m: int, k: int, n: int, table: Table, gemms: int = GEMMS) -> tuple[float, float]:
    """(bf16, FP8) seconds of one linear layer's forward and backward of forward shape (m, k, n) by ``table``
    (``LAYER_TIMES_LAUNCH`` or ``LAYER_TIMES_GPU``): its row for a timed (k, n), else interpolated from its
    ``_NEAREST`` nearest timed shapes (their time per M K N); scaled by m / TABLE_TOKENS, and by gemms / GEMMS
    for a layer that runs fewer of the three GEMMs (2 frozen, 1 without an output gradient)."""
    hit = table.get((k, n))
    tb, tf = hit if hit is not None else _interpolate(table, k, n, _NEAREST)
    share = m / TABLE_TOKENS * gemms / GEMMS
    return tb * 1e-6 * share, tf * 1e-6 * share


@dataclass(frozen=True)
class LeaveOneOut:
    """How well the interpolation predicts a table from itself: each timed shape's bf16 and FP8 times
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


def leave_one_out(nearest: int, table: Table) -> LeaveOneOut:
    """The interpolation from ``nearest`` shapes judged on ``table``, one shape left out at a time."""
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


def _sums(
    shapes: Iterable[Shape], table: Table, gemms: Sequence[int] | None = None
) -> tuple[float, float, float]:
    """(bf16 seconds, FP8 seconds, elements of inputs and outputs M K + M N), summed over the layers, each
    running ``gemms``' count of GEMMs (all three when not given)."""
    b = f = a = 0.0
    shapes = list(shapes)
    for (m, k, n), g in zip(shapes, gemms if gemms is not None else [GEMMS] * len(shapes), strict=True):
        tb, tf = layer_times(m, k, n, table, g)
        b += tb
        f += tf
        a += m * k + m * n
    return b, f, a


def _rest(steps: Sequence[Measurement], table: Table) -> float:
    """Least squares on the relative error of each step's bf16 time, so each weighs alike: the bf16 step is the
    sum of its linear layers' bf16 times by ``table`` plus rest times their inputs' and outputs' elements."""
    num = den = 0.0
    for ms in steps:
        assert ms.bf16_s is not None
        b, _, a = _sums(ms.shapes + ms.others, table)
        num += (ms.bf16_s - b) * a / ms.bf16_s**2
        den += a * a / ms.bf16_s**2
    return num / den


def fit(measurements: Iterable[Measurement]) -> Constants:
    """Each table's ``rest`` from the whole-step measurements whose role is "fit" (``_rest``)."""
    steps = [m for m in measurements if m.role == "fit" and m.scope == "step" and m.bf16_s is not None]
    if not steps:
        raise ValueError(
            "a whole-step measurement with its bf16 step time is needed to fit the FP8 speed model"
        )
    return Constants(
        _rest(steps, LAYER_TIMES_LAUNCH),
        _rest(steps, LAYER_TIMES_GPU),
        tuple(m.name for m in steps),
        ", ".join(sorted({m.device for m in steps} | {TABLE_DEVICE})),
    )


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
assert LAYER_TIMES_LAUNCH.keys() == LAYER_TIMES_GPU.keys()
# the range of intensities (at TABLE_TOKENS tokens) of the timed shapes: a step's converted layers beyond it
# are extrapolated
TABLE_INTENSITY: tuple[float, float] = (
    min(intensity(TABLE_TOKENS, k, n) for k, n in LAYER_TIMES_GPU),
    max(intensity(TABLE_TOKENS, k, n) for k, n in LAYER_TIMES_GPU),
)


def _speedups(table: Table) -> tuple[float, float]:
    return min(b / f for b, f in table.values()), max(b / f for b, f in table.values())


# the slowest and fastest FP8 layer of each table (bf16 time / FP8 time)
TABLE_SPEEDUPS_LAUNCH: tuple[float, float] = _speedups(LAYER_TIMES_LAUNCH)
TABLE_SPEEDUPS_GPU: tuple[float, float] = _speedups(LAYER_TIMES_GPU)


@dataclass(frozen=True)
class Estimate:
    """FP8's estimated speed on a training step whose ``layers`` linear layers (one per call) FP8 converts and
    ``others`` it leaves in bf16, a bracket: ``speedup_launch_bound`` (bf16 step time / FP8's by the call-by-call
    table: a step its host's launches bound) and ``speedup_gpu_bound`` (by the graph table: a step whose host
    keeps ahead of the GPU); ``speedup``, the lower of the two, decides. ``layers_launch_bound`` and
    ``layers_gpu_bound``: the converted layers alone; ``gemm_share_launch_bound`` and ``gemm_share_gpu_bound``:
    their share of a bf16 step; ``layers_speedup`` and ``gemm_share``: those of the end ``speedup`` is.
    ``flops_share``: the converted layers' share of the FLOPs (2 M K N) of all the GEMMs it counts.
    ``intensity``: M K N / (M K + K N + M N) summed over the converted layers; ``beyond``: "below" or "above"
    when it lies outside the timed shapes', else ""; ``timed``: how many converted layers have a shape the
    tables timed."""

    speedup_launch_bound: float
    speedup_gpu_bound: float
    layers_launch_bound: float
    layers_gpu_bound: float
    gemm_share_launch_bound: float
    gemm_share_gpu_bound: float
    flops_share: float
    intensity: float
    beyond: str
    layers: int
    others: int
    timed: int
    constants: Constants

    @property
    def speedup(self) -> float:
        """The conservative end: the lower of the two."""
        return min(self.speedup_launch_bound, self.speedup_gpu_bound)

    @property
    def _launch_end(self) -> bool:
        return self.speedup_launch_bound <= self.speedup_gpu_bound

    @property
    def layers_speedup(self) -> float:
        return self.layers_launch_bound if self._launch_end else self.layers_gpu_bound

    @property
    def gemm_share(self) -> float:
        return self.gemm_share_launch_bound if self._launch_end else self.gemm_share_gpu_bound

    def explain(self, converted: str = "", kept: str = "") -> str:
        """How the estimate was reached, in two sentences the report shows. ``converted`` and ``kept`` say what
        its GEMMs are ("the 5 converted linear layers", "the 4 GEMMs left in bf16 (4 attention projections)");
        by default they are counted as linear layers, one GEMM each."""
        c = self.constants
        converted = converted or f"the {self.layers} converted linear layer{'s' if self.layers > 1 else ''}"
        if not kept and self.others:
            kept = f"the {self.others} linear layer{'s' if self.others > 1 else ''} left in bf16"
        if self.timed == self.layers:
            timed = "all at shapes timed"
        elif self.timed == 0:
            timed = "none at a shape timed: each interpolated from the nearest timed shapes"
        else:
            timed = f"{self.timed} at shapes timed, the others interpolated from the nearest timed shapes"
        (ll, lh), (gl, gh) = TABLE_SPEEDUPS_LAUNCH, TABLE_SPEEDUPS_GPU
        flops = f", {self.flops_share * 100:.3g}% of the FLOPs of the GEMMs counted," if self.others else ""
        return (
            f"FP8 would run the forward and backward of {converted} at "
            f"{self.layers_launch_bound:.2f}x of bf16's speed launched call by call from Python and at "
            f"{self.layers_gpu_bound:.2f}x as CUDA graph replays (the GPU's time alone), by each shape's bf16 and "
            f"FP8 times measured alone on an {TABLE_DEVICE} ({timed}): FP8 halves a GEMM's time at the tensor "
            "cores' rate, but its casts and extra kernels cost more than that saves on small GEMMs (the timed "
            f"layers ran from {ll:.2f}x to {lh:.2f}x call by call, {gl:.2f}x to {gh:.2f}x as graphs). These "
            f"layers{flops} take an estimated {self.gemm_share_launch_bound * 100:.0f}% or "
            f"{self.gemm_share_gpu_bound * 100:.0f}% of a bf16 step (call by call, as graphs); the rest (attention, "
            f"norms, the optimizer{', ' + kept if kept else ''}: {c.rest_launch_bound * 1e12:.1f} or "
            f"{c.rest_gpu_bound * 1e12:.1f} ps per element of each GEMM's input and output) FP8 leaves as it is, so "
            "the step would run at "
            f"{self.speedup_launch_bound:.2f}x if the host's launches bound it, {self.speedup_gpu_bound:.2f}x if "
            f"the host keeps ahead of the GPU; the verdict takes the lower, {self.speedup:.2f}x.{_misses()}"
        )


def _misses() -> str:
    """The steps whose verdict the estimate is known to miss, as a sentence for ``explain``."""
    out = []
    for m in MEASURED:
        est = estimate(m.shapes, m.others) if m.miss else None
        if est is not None:
            out.append(
                f"{m.name.split(',')[0]} ran at {m.speedup:.2f}x, estimated {est.speedup_launch_bound:.2f}x to "
                f"{est.speedup_gpu_bound:.2f}x"
            )
    return f" Known to mislead: {'; '.join(out)}." if out else ""


def layer_speedup(m: int, k: int, n: int, table: Table) -> float:
    """The estimated FP8 speedup of one converted linear layer of forward shape (m, k, n) by ``table``, its
    forward and backward alone (no rest of the step around it)."""
    tb, tf = layer_times(m, k, n, table)
    return tb / tf


def _known(shapes: Iterable[Shape], gemms: Sequence[int] | None) -> tuple[list[Shape], list[int]]:
    """The shapes with every dimension known, and the GEMMs each runs (all three when ``gemms`` is None)."""
    shapes = list(shapes)
    pairs = zip(shapes, gemms if gemms is not None else [GEMMS] * len(shapes), strict=True)
    known = [(s, g) for s, g in pairs if all(v > 0 for v in s)]
    return [s for s, _ in known], [g for _, g in known]


def estimate(
    shapes: Iterable[Shape],
    others: Iterable[Shape] = (),
    constants: Constants = CONSTANTS,
    gemms: Sequence[int] | None = None,
    others_gemms: Sequence[int] | None = None,
) -> Estimate | None:
    """FP8's estimated speedup of a training step whose linear layers of these forward (tokens, in, out) shapes,
    one per layer and call, FP8 converts, while those of ``others`` stay in bf16. ``gemms`` and ``others_gemms``:
    how many of the three GEMMs each runs (2 frozen, 1 without an output gradient; all three when not given).
    None without converted layers."""
    conv, conv_g = _known(shapes, gemms)
    if not conv:
        return None
    kept, kept_g = _known(others, others_gemms)

    def end(table: Table, rest: float) -> tuple[float, float, float]:
        """(step speedup, layers' speedup, their share of a bf16 step) by ``table``."""
        cb, cf, ca = _sums(conv, table, conv_g)
        ob, _, oa = _sums(kept, table, kept_g)
        bf16 = cb + ob + rest * (ca + oa)
        return bf16 / (bf16 - cb + cf), cb / cf, cb / bf16

    launch = end(LAYER_TIMES_LAUNCH, constants.rest_launch_bound)
    gpu = end(LAYER_TIMES_GPU, constants.rest_gpu_bound)
    w = c = 0.0
    for m, k, n in conv:
        w += m * k * n
        c += m * k + k * n + m * n
    i = w / c
    # the FLOPs of the GEMMs each call runs
    run = sum(m * k * n * g for (m, k, n), g in zip(conv, conv_g, strict=True))
    flops_share = run / (run + sum(m * k * n * g for (m, k, n), g in zip(kept, kept_g, strict=True)))
    lo, hi = TABLE_INTENSITY
    beyond = "below" if i < lo * 0.999 else ("above" if i > hi * 1.001 else "")
    return Estimate(
        speedup_launch_bound=launch[0],
        speedup_gpu_bound=gpu[0],
        layers_launch_bound=launch[1],
        layers_gpu_bound=gpu[1],
        gemm_share_launch_bound=launch[2],
        gemm_share_gpu_bound=gpu[2],
        flops_share=flops_share,
        intensity=i,
        beyond=beyond,
        layers=len(conv),
        others=len(kept),
        timed=sum((k, n) in LAYER_TIMES_GPU for _, k, n in conv),
        constants=constants,
    )


def sources() -> str:
    """Where the estimate's numbers come from, briefly: the layer tables, then each measurement with what the
    estimate makes of it, its launch-bound to its GPU-bound end (``Measurement.source`` says the rest, in this
    module)."""
    role = {"fit": "fitted", "check": "checked", "reference": "reference"}
    out = []
    for m in MEASURED:
        est = estimate(m.shapes, m.others)
        if est is None:
            got = ""
        elif m.scope == "step":
            got = f", estimated {est.speedup_launch_bound:.2f}x to {est.speedup_gpu_bound:.2f}x"
        else:
            got = f", estimated {est.layers_launch_bound:.2f}x to {est.layers_gpu_bound:.2f}x"
        what = "a step" if m.scope == "step" else "one layer"
        how = role.get(m.role, m.role) + (", a known miss" if m.miss else "")
        out.append(f"{m.name} ({m.device}, {what} {m.speedup:.2f}x{got}; {how}; {m.cite})")
    return (
        f"layer times from bench/results/fp8_layers_nvidia-h200_2026-11-27c.json ({len(LAYER_TIMES_GPU)} shapes "
        f"at {TABLE_TOKENS} tokens on an {TABLE_DEVICE}, torch 2.11, torchao 0.17 Float8Linear tensorwise, both "
        "compiled, timed call by call and as CUDA graph replays); measured: "
        f"{'; '.join(out)}. Each source in full: analysis/fp8_speed.py."
    )
