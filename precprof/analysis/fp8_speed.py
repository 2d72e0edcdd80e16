"""When FP8 pays: an estimate of the speed per-tensor (tensorwise) FP8 training brings to linear layers of given
GEMM shapes, from measured FP8/bf16 speedups. An estimate, never a measurement of the run: the report says so.

A linear layer of forward shape (M tokens, K = in_features, N = out_features) runs three GEMMs of 2MKN FLOPs
each (forward, input gradient, weight gradient). FP8 halves their tensor-core time (H100: 1979 against 989 dense
TFLOPS) but adds casts: its input (M x K), weight (K x N) and output gradient (M x N) are each read for their
amax and written in FP8, twice for the transposes. The GEMM time grows as M*K*N and the casts' as
M*K + K*N + M*N, so whether FP8 pays follows their ratio, the layer's intensity

    I = M K N / (M K + K N + M N)      (elements of GEMM work per element cast)

torchao states it this way ("bf16_gemm_time - fp8_gemm_time > fp8_overhead_time": speedup < 1 for small shapes,
> 1 for large ones). ``MEASURED`` holds published and measured speedups with where each comes from; a layer's
speed is interpolated in log(I) between the two single-layer measurements (``LINEAR``) and held at their value
outside them (``Estimate.beyond`` says which side). The whole-step measurements check the estimate: gpt2-small
on an H200 (FP8 slower) and Llama3-8B on 8 H100s (FP8 faster) fall on the right sides of 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    """One measured FP8 (tensorwise, compiled) against bf16 (compiled) speedup: bf16 time / FP8 time.

    ``scope``: "linear" (one linear layer's forward and backward, its neighbours' work included) or "step" (a
    whole training step, attention and the optimizer included). ``shapes``: the forward (M, K, N) of the
    linear layers it ran (each layer once per block)."""

    name: str
    scope: str
    device: str
    shapes: tuple[tuple[int, int, int], ...]
    speedup: float
    source: str


def intensity(m: int, k: int, n: int) -> float:
    """M K N / (M K + K N + M N): GEMM work per element FP8 casts, the quantity FP8's speed follows."""
    return m * k * n / (m * k + k * n + m * n)


def _flops_weighted_intensity(shapes: Iterable[tuple[int, int, int]]) -> float:
    shapes = list(shapes)
    w = [m * k * n for m, k, n in shapes]
    return math.exp(sum(wi * math.log(intensity(*s)) for wi, s in zip(w, shapes, strict=True)) / sum(w))


_LLAMA3_8B = tuple(
    (8192, k, n)
    for k, n in (
        (4096, 4096),
        (4096, 1024),
        (4096, 1024),
        (4096, 4096),
        (4096, 14336),
        (4096, 14336),
        (14336, 4096),
    )
)
_GPT2_SMALL = ((8192, 768, 2304), (8192, 768, 768), (8192, 768, 3072), (8192, 3072, 768))

MEASURED: tuple[Measurement, ...] = (
    Measurement(
        "torchao Float8Linear, small shapes",
        "linear",
        "NVIDIA H100",
        ((1024, 2048, 1024),),
        0.80,
        "torchao README, torchao/float8/README.md, section Performance, example 1 (pytorch/ao commit "
        "e850b90d2, 2025): M, K, N = 1024, 2048, 1024, benchmark speedup 0.80, tensorwise scaling, compiled",
    ),
    Measurement(
        "torchao Float8Linear, large shapes",
        "linear",
        "NVIDIA H100",
        ((4096, 8192, 16384),),
        1.39,
        "the same README, example 2: M, K, N = 4096, 8192, 16384, benchmark speedup 1.39",
    ),
    Measurement(
        "Llama3-8B, torchtitan",
        "step",
        "8x NVIDIA H100",
        _LLAMA3_8B,
        7689.5 / 6150,
        "torchao README (pytorch/ao commit 2f688a0f9, 2025-08), Training benchmarks: Llama3-8B, batch 1 x 8192, "
        "torch.compile, FSDP2, tensorwise with float8 all-gather 7689.5 tokens/s against bf16's 6150 (+25%)",
    ),
    Measurement(
        "gpt2-small, precprof's built-in model",
        "step",
        "NVIDIA H200",
        _GPT2_SMALL,
        24.4 / 32.6,
        "measured by this project on an H200, 2026-11-26 (torch 2.11, torchao 0.17, 48 Float8Linear): batch "
        "8 x 1024, fused AdamW, torch.compile on the whole model, median of 15 steps without precprof, bf16 "
        "24.4 ms against fp8 32.6 ms a step",
    ),
)
LINEAR: tuple[tuple[float, float], ...] = tuple(
    sorted((intensity(*m.shapes[0]), m.speedup) for m in MEASURED if m.scope == "linear")
)


@dataclass(frozen=True)
class Estimate:
    """FP8's estimated speed on some linear layers: ``speedup`` (bf16 time / FP8 time of their GEMMs and casts,
    weighted by their FLOPs), ``intensity`` (FLOPs-weighted geometric mean of I), ``beyond`` ("below" or
    "above" when some layer lies outside the measured intensities and got the nearest measured speedup, else
    "")."""

    speedup: float
    intensity: float
    beyond: str
    layers: int


def layer_speedup(m: int, k: int, n: int) -> tuple[float, str]:
    """The estimated FP8 speedup of one linear layer of forward shape (m, k, n), and "below"/"above" when its
    intensity lies outside the measured ones (the nearest measurement's speedup is used)."""
    i = intensity(m, k, n)
    (i0, s0), (i1, s1) = LINEAR[0], LINEAR[-1]
    if i <= i0:
        return s0, "below" if i < i0 else ""
    if i >= i1:
        return s1, "above" if i > i1 else ""
    return s0 + (s1 - s0) * math.log(i / i0) / math.log(i1 / i0), ""


def estimate(shapes: Iterable[tuple[int, int, int]]) -> Estimate | None:
    """FP8's estimated speedup on linear layers of these forward (tokens, in, out) shapes: each layer's GEMM time
    in bf16 taken as proportional to its FLOPs, in FP8 as that over its own speedup. None without layers."""
    shapes = [s for s in shapes if all(v > 0 for v in s)]
    if not shapes:
        return None
    bf16 = fp8 = 0.0
    sides = set()
    for m, k, n in shapes:
        s, side = layer_speedup(m, k, n)
        bf16 += m * k * n
        fp8 += m * k * n / s
        if side:
            sides.add(side)
    beyond = "below" if "below" in sides else ("above" if sides else "")
    return Estimate(bf16 / fp8, _flops_weighted_intensity(shapes), beyond, len(shapes))


def sources() -> str:
    """Where the estimate's numbers come from, in one sentence per measurement."""
    return " ".join(f"{m.name} ({m.device}, {m.speedup:.2f}x): {m.source}." for m in MEASURED)
