"""When FP8 pays: an estimate of the speed per-tensor (tensorwise) FP8 brings to a whole training step, from the
GEMM shapes of its linear layers. An estimate, never a measurement of the run: the report says so.

A linear layer of forward shape (M tokens, K = in_features, N = out_features) runs three GEMMs of 2 M K N FLOPs
each (forward, input gradient, weight gradient), and in FP8 casts its input (M x K), weight (K x N) and output
gradient (M x N): each read for its amax and written in FP8, twice for the transposes. So, in units of one
bf16 M K N of GEMM work (6 FLOPs at bf16's rate):

    a converted layer, bf16:   W = M K N
    a converted layer, FP8:    g W + cast (M K + K N + M N)
    the rest of the step:      rest (M K + M N) per linear layer, converted or not, unchanged by FP8

``g`` is the FP8 GEMM's time over bf16's, 0.5 from the tensor cores' rates (989 against 1979 dense TFLOPS on an
H100 or H200). ``cast`` is what casting one element costs; ``rest`` is what the step's other work (attention,
norms, activations, residuals, the loss, the optimizer, the embedding: memory-bound work that grows with the
tokens and the widths, as M K + M N does, while a GEMM grows as M K N) costs per element of a linear layer's
input and output. A linear layer FP8 does not convert (``others``: an output head tied to its embedding, or one
a 16 does not divide) runs its GEMMs in bf16 in both. The step's speedup is then

    (W_all + rest A_all) / (W_all + rest A_all - (1 - g) W_conv + cast C_conv)

the time in converted GEMMs FP8 saves, less its casts, over the whole step: at most 1 / (1 - share / 2), share
being the converted GEMMs' part of a bf16 step. The converted layers on their own run at 1 / (g + cast / I), I
the intensity M K N / (M K + K N + M N) summed over them: they gain only above I = cast / (1 - g).

``cast`` takes in all FP8 adds to a converted layer, the casts' memory traffic and whatever else its kernels
cost; ``cast`` and ``rest`` are measured: ``fit`` solves for them from the whole-step measurements in ``MEASURED``
whose ``role`` is "fit" (gpt2-small and a Qwen2 config on an H200, torch 2.11, torchao 0.17, both compiled);
"check" measurements must come out on their side of 1 (tests/test_fp8_speed.py); "reference" ones, other
stacks, are reported beside the estimate, which lies below each of them. Fitted: cast = 1008 units, some 6,000
bf16 FLOPs per element: 9 ps at the 660 TFLOPS qwen2-2048's bf16 step implies, 44 bytes of the H200's 4.8 TB/s,
several times the 6 to 8 bytes torchao's roofline counts (torchao/testing/training/roofline_utils.py); so a
converted layer gains only above an intensity of about 2,000 (Llama3-8B's layers lie between 745 and 2,294).
rest = 1168 units, some 40 bytes per element of the linear layers' inputs and outputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Shape = tuple[int, int, int]  # forward (M tokens, K = in_features, N = out_features) of one call

# FP8 GEMM time over bf16's: the tensor cores' dense rates (H100 and H200: 1979 against 989 TFLOPS)
GEMM_RATIO = 0.5


@dataclass(frozen=True)
class Measurement:
    """One measured FP8 (tensorwise, compiled) against bf16 (compiled) speedup: bf16 time / FP8 time.

    ``scope``: "linear" (one linear layer's forward and backward, its neighbours' work included) or "step" (a
    whole training step, attention and the optimizer included). ``shapes``: the forward (M, K, N) of the
    linear layers FP8 converted, one per layer and call; ``others``: those it left in bf16. ``role``: "fit"
    (sets the constants), "check" (must fall on its side of 1) or "reference" (another stack: reported)."""

    name: str
    scope: str
    device: str
    shapes: tuple[Shape, ...]
    speedup: float
    source: str
    others: tuple[Shape, ...] = ()
    role: str = "reference"


@dataclass(frozen=True)
class Constants:
    """The model's constants, in units of one bf16 M K N of GEMM work: ``gemm`` (FP8 GEMM time / bf16's),
    ``cast`` (per element FP8 casts), ``rest`` (per element of a linear layer's input and output: the step's
    other work), ``fitted_on`` (the measurements they were solved from) and ``device`` (theirs)."""

    gemm: float
    cast: float
    rest: float
    fitted_on: tuple[str, ...]
    device: str

    @property
    def break_even(self) -> float:
        """The intensity above which converted layers run faster in FP8 (the rest of the step aside)."""
        return self.cast / (1 - self.gemm)


def intensity(m: int, k: int, n: int) -> float:
    """M K N / (M K + K N + M N): GEMM work per element FP8 casts, the quantity a layer's FP8 speed follows."""
    return m * k * n / (m * k + k * n + m * n)


def _sums(shapes: Iterable[Shape]) -> tuple[float, float, float]:
    """(GEMM work M K N, elements of inputs and outputs M K + M N, elements cast M K + K N + M N), summed."""
    w = a = c = 0.0
    for m, k, n in shapes:
        w += m * k * n
        a += m * k + m * n
        c += m * k + k * n + m * n
    return w, a, c


def fit(measurements: Iterable[Measurement], gemm: float = GEMM_RATIO) -> Constants:
    """``cast`` and ``rest`` from the whole-step measurements whose role is "fit", by least squares (exact for
    two). Each is linear in them: speedup s = T / (T - (1 - g) W_conv + cast C_conv), T = W_all + rest A_all,
    gives cast (s C_conv) + rest ((s - 1) A_all) = (1 - s) W_all + s (1 - g) W_conv; each equation divided by
    W_all, so each step weighs alike."""
    rows: list[tuple[float, float, float]] = []
    names: list[str] = []
    devices: set[str] = set()
    for ms in measurements:
        if ms.role != "fit" or ms.scope != "step":
            continue
        wc, ac, cc = _sums(ms.shapes)
        wo, ao, _ = _sums(ms.others)
        s, wa = ms.speedup, wc + wo
        rows.append((s * cc / wa, (s - 1) * (ac + ao) / wa, ((1 - s) * wa + s * (1 - gemm) * wc) / wa))
        names.append(ms.name)
        devices.add(ms.device)
    if len(rows) < 2:
        raise ValueError("two whole-step measurements are needed to fit the FP8 speed model")
    # normal equations of the 2 x 2 least-squares problem
    s11 = sum(r[0] * r[0] for r in rows)
    s12 = sum(r[0] * r[1] for r in rows)
    s22 = sum(r[1] * r[1] for r in rows)
    b1 = sum(r[0] * r[2] for r in rows)
    b2 = sum(r[1] * r[2] for r in rows)
    det = s11 * s22 - s12 * s12
    cast, rest = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
    return Constants(gemm, cast, rest, tuple(names), ", ".join(sorted(devices)))


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
_LLAMA3_8B = _blocks(
    32,
    ((4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)),
    _TOKENS,
)
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
    ),
    Measurement(
        "torchao Float8Linear, large shapes",
        "linear",
        "NVIDIA H100",
        ((4096, 8192, 16384),),
        1.39,
        "the same README, example 2: M, K, N = 4096, 8192, 16384, benchmark speedup 1.39",
    ),
)
CONSTANTS: Constants = fit(MEASURED)
# the intensities (summed over the converted layers) of the fitted steps: the estimate interpolates between them
FITTED_INTENSITY: tuple[float, float] = (
    min(_sums(m.shapes)[0] / _sums(m.shapes)[2] for m in MEASURED if m.role == "fit"),
    max(_sums(m.shapes)[0] / _sums(m.shapes)[2] for m in MEASURED if m.role == "fit"),
)


@dataclass(frozen=True)
class Estimate:
    """FP8's estimated speed on a training step whose ``layers`` linear layers (one per call) FP8 converts and
    ``others`` it leaves in bf16: ``speedup`` (bf16 step time / FP8's), ``layers_speedup`` (the converted layers'
    GEMMs and casts alone), ``gemm_share`` (the converted GEMMs' estimated share of a bf16 step: the speedup is
    at most 1 / (1 - gemm_share / 2)), ``intensity`` (M K N / (M K + K N + M N) summed over the converted
    layers), ``beyond`` ("below" or "above" when that intensity lies outside the fitted measurements', else "")
    and ``constants``."""

    speedup: float
    layers_speedup: float
    gemm_share: float
    intensity: float
    beyond: str
    layers: int
    others: int
    constants: Constants

    def explain(self) -> str:
        """How the estimate was reached, in two sentences the report shows."""
        c = self.constants
        kept = (
            f", the {self.others} linear layer{'s' if self.others > 1 else ''} left in bf16"
            if self.others
            else ""
        )
        return (
            f"FP8 would run the {self.layers} converted linear layers' GEMMs and casts at {self.layers_speedup:.2f}x "
            f"of bf16's speed: it halves their GEMMs' time, but casting each input, weight and output gradient "
            f"costs {c.cast:.0f} units of GEMM work (M K N) per element, so a layer gains only where its intensity "
            f"M K N / (M K + K N + M N) exceeds {c.break_even:.0f}, and theirs is {self.intensity:.0f}. Their GEMMs "
            f"take an estimated {self.gemm_share * 100:.0f}% of a bf16 step; the rest (attention, norms, the "
            f"optimizer{kept}: {c.rest:.0f} units per element of each linear layer's input and output) FP8 leaves "
            f"as it is, so the step would run at {self.speedup:.2f}x."
        )


def layer_speedup(m: int, k: int, n: int, constants: Constants = CONSTANTS) -> float:
    """The estimated FP8 speedup of one converted linear layer of forward shape (m, k, n), its GEMMs and casts
    alone (no rest of the step around it): 1 / (g + cast / I)."""
    return 1.0 / (constants.gemm + constants.cast / intensity(m, k, n))


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
    wc, ac, cc = _sums(conv)
    wo, ao, _ = _sums(kept)
    bf16 = wc + wo + constants.rest * (ac + ao)
    fp8 = bf16 - (1 - constants.gemm) * wc + constants.cast * cc
    i = wc / cc
    lo, hi = FITTED_INTENSITY
    beyond = "below" if i < lo * 0.999 else ("above" if i > hi * 1.001 else "")
    return Estimate(
        speedup=bf16 / fp8,
        layers_speedup=wc / (constants.gemm * wc + constants.cast * cc),
        gemm_share=wc / bf16,
        intensity=i,
        beyond=beyond,
        layers=len(conv),
        others=len(kept),
        constants=constants,
    )


def sources() -> str:
    """Where the estimate's numbers come from, in one sentence per measurement."""
    role = {"fit": "fitted", "check": "checked", "reference": "reference"}
    out = []
    for m in MEASURED:
        est = estimate(m.shapes, m.others)
        got = f", estimated {est.speedup:.2f}x" if est is not None and m.role != "fit" else ""
        out.append(f"{m.name} ({m.device}, {m.speedup:.2f}x{got}; {role.get(m.role, m.role)}): {m.source}.")
    return " ".join(out)
