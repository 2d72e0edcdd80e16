"""FP8 advice for gpt-nano (its ``lm_head`` is tied to the token embedding), from real tiny runs on the CPU.

The advisor and ``--precision fp8`` (``precprof.training.convert_fp8``) must agree on which layers can run in
FP8: one rule, ``precprof.taxonomy.fp8_ineligible_reason``. Before issue 15, the tied head had no weight
shape of its own in the run (the Profiler records a shared weight once, under the embedding), escaped the
multiple-of-16 check, and a 0.5M-parameter gpt-nano with ``n_embd=100`` got ``format=fp8`` with
``fp8_layers=['lm_head']``, the one layer ``--precision fp8`` refuses.

- ``train_run(path, n_embd=100)``: every dimension off the multiple of 16 and the head tied: nothing is
  eligible, and the advice is not fp8;
- ``train_run(path)`` (gpt-nano's n_embd=96): every dimension a multiple of 16, the head still tied: the other
  16 layers are eligible, but its GEMMs are too small for FP8 to pay;
- ``live_model(n_embd)``: the same model, live, for the layer-by-layer check against ``convert_fp8``;
- ``train_run(path, model=WIDE_MLP_GPT)`` (issue 34): gpt-nano whose ``mlp.c_fc`` layers feed a SiLU widely
  spread pre-activations (``wide_mlp_gpt``): the activation's derivative far out on the negative side decays
  as x e^x, so a few percent of each ``c_fc`` output gradient's values lie more than 2^33 below its largest
  and flush to zero in e5m2 under current scaling, while they carry a negligible share of its norm: the tail
  of tiny gradient values GPT-2's ``c_fc`` layers had on an H200 (12-21% of their values flushed; torch's CPU
  GELU backward returns exact zeros that far out, so SiLU stands in for it here). The rule before issue 34
  ruled every ``c_fc`` out (more than 1% of the values flushed); judged by the norm they are eligible.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from precprof.analysis.advisor import Recommendation, recommend
from precprof.data import load_data
from precprof.models import build_model
from precprof.models.gpt import GPT, GPTConfig
from precprof.pipeline import rerender
from precprof.training import TrainConfig, train

BATCH, SEQ = 4, 32  # 128 tokens per call: a multiple of 16
TARGET = "h100"


def _args(n_embd: int | None) -> dict[str, int]:
    return {} if n_embd is None else {"n_embd": n_embd}


C_FC_GAIN = 75.0  # gpt-nano's c_fc pre-activations have a std of about 0.2: about 15 with this gain
WIDE_MLP_GPT = f"{Path(__file__).resolve()}:wide_mlp_gpt"


def wide_mlp_gpt(vocab_size: int, seq_len: int, c_fc_gain: float = C_FC_GAIN) -> nn.Module:
    """gpt-nano (precprof's GPT, 4 layers, n_embd 96) with SiLU in its MLPs and every ``mlp.c_fc`` weight
    ``c_fc_gain`` times larger: the activation's inputs spread over about +-45, so its derivative, and the
    output gradient of ``c_fc``, run far below the rest on the negative side."""
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=max(seq_len, 64)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.c_fc.weight"):
                p.mul_(c_fc_gain)
    for block in model.transformer.h:
        block.mlp.gelu = nn.SiLU()
    return model


def train_run(
    out: Path,
    n_embd: int | None = None,
    steps: int = 3,
    model: str = "gpt-nano",
    seed: int = 0,
    render: bool = True,
) -> Path:
    """Train gpt-nano (or ``model``) for ``steps`` steps in fp32 on the CPU, every step sampled; returns the run
    directory, its report rendered for the target (``precprof report RUN --target h100``) where ``render`` (a
    page takes a second or two of the suite: the runs whose page no test reads are advised from the directory)."""
    cfg = TrainConfig(
        model=model,
        model_args=_args(n_embd),
        steps=steps,
        batch_size=BATCH,
        seq_len=SEQ,
        device="cpu",
        out=out,
        sample_every=1,
        progress=False,
        report=False,
        seed=seed,
    )
    run_dir = train(cfg).run_dir
    if render:
        rerender(run_dir, target=TARGET)
    return Path(run_dir)


def advice(run_dir: Path, **kw: object) -> Recommendation:
    """The advisor's recommendation for the target, from the run directory (tables and summary.json)."""
    return recommend(run_dir, hardware=TARGET, **kw)  # type: ignore[arg-type]


def live_model(n_embd: int | None = None) -> nn.Module:
    """The model ``train_run`` trains, built the same way (the synthetic data's vocabulary)."""
    data = load_data("synthetic", seed=0)
    return build_model("gpt-nano", _args(n_embd), vocab_size=data.vocab_size, seq_len=SEQ).module
