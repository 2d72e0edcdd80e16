"""The Profiler on real models: it never changes training, and it covers every layer type it meets."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precprof
from precprof import tables as T
from precprof.models import build_model

VOCAB, SEQ, BATCH = 256, 32, 4


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if hasattr(out, "logits"):
        out = out.logits
    return out


def _train(
    make: Callable[[], nn.Module], precision: str, steps: int, profile: bool, sample_every: int = 1
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    prof = (
        precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=sample_every) if profile else None
    )
    if prof is not None:
        prof.attach()
    losses = []
    try:
        for x, y in _batches(steps):
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                logits = _logits(model, x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if prof is not None:
                prof.step(loss=loss.detach())
            losses.append(loss.item())
    finally:
        if prof is not None:
            prof.detach()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, prof


def _gpt_nano() -> nn.Module:
    return build_model("gpt-nano", vocab_size=VOCAB, seq_len=SEQ).module


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_profiler_does_not_change_training(precision: str) -> None:
    """Five steps of gpt-nano: losses and final weights bitwise equal with and without the profiler."""
    base_losses, base_weights, _ = _train(_gpt_nano, precision, 5, profile=False)
    prof_losses, prof_weights, prof = _train(_gpt_nano, precision, 5, profile=True)
    assert prof_losses == base_losses
    assert base_weights.keys() == prof_weights.keys()
    for k in base_weights:
        assert torch.equal(base_weights[k], prof_weights[k]), k
    layers = prof.tables()["layers"]
    assert sorted(set(layers[T.STEP])) == [0, 1, 2, 3, 4]
    if precision == "fp16":
        assert set(prof.tables()["steps"][T.LOSS_SCALE]) <= {2.0**16, 2.0**15, 2.0**14, 2.0**13}


def _linear_like_modules(model: nn.Module) -> set[str]:
    return {
        name
        for name, m in model.named_modules()
        if type(m).__name__ in ("Linear", "Conv1D", "Embedding") and next(m.parameters(), None) is not None
    }


def test_hf_gpt2_conv1d_layers_are_captured() -> None:
    pytest.importorskip("transformers")
    built = build_model(
        "hf:gpt2",
        {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": VOCAB, "n_positions": SEQ},
        vocab_size=VOCAB,
        seq_len=SEQ,
    )
    model = built.module
    _, _, prof = _train(lambda: model, "bf16", 1, profile=True)
    layers = prof.tables()["layers"]
    conv1d = {n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    assert len(conv1d) == 8  # c_attn, c_proj, c_fc, mlp.c_proj per block
    for kind in (T.ACTIVATION, T.ACTIVATION_GRAD, T.WEIGHT, T.WEIGHT_GRAD):
        got = set(layers[(layers[T.TENSOR] == kind) & (layers[T.MODULE_TYPE] == "Conv1D")][T.MODULE])
        assert got == conv1d, kind
    # Conv1D under CPU autocast runs addmm: its outputs are bf16
    c1 = layers[(layers[T.MODULE_TYPE] == "Conv1D") & (layers[T.TENSOR] == T.ACTIVATION)]
    assert set(c1[T.DTYPE]) == {"bfloat16"}


def test_llama_mini_every_parameter_has_a_gradient_row() -> None:
    def make() -> nn.Module:
        return build_model(
            "llama-mini", {"n_layer": 1, "n_embd": 32, "n_head": 2}, vocab_size=VOCAB, seq_len=SEQ
        ).module

    _, _, prof = _train(make, "fp16", 1, profile=True)
    layers = prof.tables()["layers"]
    model = make()
    names = {n for n, p in model.named_parameters()}
    got = {
        f"{m}.{p}" if m else p
        for m, p in layers[layers[T.TENSOR] == T.WEIGHT_GRAD][[T.MODULE, T.PARAM]].itertuples(index=False)
    }
    assert got == names
    assert _linear_like_modules(model) <= set(layers[T.MODULE])


def test_torch_compile_model_documented_behaviour() -> None:
    """A compiled model trains identically with the profiler and every tensor kind is captured.

    Dynamo traces the hooks' sampling check (one graph for sampled steps, one for the rest) and runs the
    recording itself eagerly (``torch.compiler.disable``), so sampled steps break the graph at captured modules.
    The backend is "eager" to keep the test fast; inductor behaves the same (checked by hand, see README).
    """
    torch._dynamo.reset()

    def make() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        return m

    x = torch.randn(4, 8)

    def run(profile: bool) -> tuple[list[float], Any, nn.Module]:
        torch._dynamo.reset()
        model = make()
        compiled = torch.compile(model, backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prof = precprof.Profiler(model, optimizer=opt, sample_every=1) if profile else None
        if prof:
            prof.attach()
        losses = []
        for _ in range(3):
            loss = compiled(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if prof:
                prof.step(loss=loss)
            losses.append(loss.item())
        if prof:
            prof.detach()
        return losses, prof, model

    base, _, _ = run(False)
    got, prof, _ = run(True)
    assert got == base
    t = prof.tables()
    assert t["steps"][T.STEP].tolist() == [0, 1, 2]
    # weight gradients come from parameter hooks, which compiled graphs honour
    layers = t["layers"]
    for kind, modules in (
        (T.ACTIVATION, {"0:input", "0", "1", "2"}),  # (0:input: the model's input, which 0 reads)
        (T.ACTIVATION_GRAD, {"0", "1", "2"}),
        (T.WEIGHT, {"0", "2"}),
        (T.WEIGHT_GRAD, {"0", "2"}),
    ):
        got_kind = layers[layers[T.TENSOR] == kind]
        assert set(got_kind[T.MODULE]) == modules, kind
        assert sorted(set(got_kind[T.STEP])) == [0, 1, 2], kind


@pytest.mark.parametrize("block_formats", [False, True])
def test_profiler_memory_is_under_one_percent_of_gpt_mini_parameters(block_formats: bool) -> None:
    """precprof's own persistent memory (statistics rows, update samples, memory tracking) on gpt-mini, with
    and without the block-format what-if (on by default for users)."""
    torch.manual_seed(0)
    model = build_model("gpt-mini", vocab_size=VOCAB, seq_len=SEQ).module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=block_formats) as prof:
        for x, y in _batches(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = _logits(model, x)
            F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert prof.buffer_bytes < 0.01 * param_bytes
    summary = prof.summary()
    assert summary["profiler_buffer_bytes"] == prof.buffer_bytes
    assert summary["profiler_buffer_share_of_params"] == prof.buffer_bytes / param_bytes
    mem = prof.tables()["memory"]
    own = mem[mem[T.COMPONENT] == T.PROFILER_BUFFERS][T.BYTES].tolist()
    # recorded on each sampled step (the histogram window may grow, the memory tracker's records go at detach)
    assert len(own) == 2 and own[-1] >= prof.buffer_bytes
    assert max(own) < 0.01 * param_bytes


def test_a_weight_its_parent_reads_without_calling_its_module_is_recorded() -> None:
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` directly, never calling ``out_proj``: its weight
    rows are recorded with its gradient's, the values it held when the step's forward began. A module that takes
    no part in the step (no forward, no gradient: an expert no token reached) records its weight too, at order
    -1 beside its weight-update rows (it had those alone)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 32)
            self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            self.spare = nn.Linear(32, 32)  # never used
            self.head = nn.Linear(32, VOCAB)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(self.emb(x)))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before: list[dict[str, torch.Tensor]] = []
    with precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False) as prof:
        for x, y in _batches(2):
            before.append({n: p.detach().clone() for n, p in model.named_parameters()})
            F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    layers = prof.tables()["layers"]
    for step, params in enumerate(before):
        rows = layers[layers[T.STEP] == step]
        pairs = {
            kind: {
                tuple(r) for r in rows[rows[T.TENSOR] == kind][[T.MODULE, T.PARAM]].itertuples(index=False)
            }
            for kind in (T.WEIGHT, T.WEIGHT_GRAD)
        }
        spare = {("spare", "weight"), ("spare", "bias")}
        assert pairs[T.WEIGHT] == pairs[T.WEIGHT_GRAD] | spare and not pairs[T.WEIGHT_GRAD] & spare
        assert ("block.self_attn.out_proj", "weight") in pairs[T.WEIGHT]
        for module, param in [("block.self_attn.out_proj", p) for p in ("weight", "bias")] + sorted(spare):
            w = params[f"{module}.{param}"]
            row = rows[(rows[T.MODULE] == module) & (rows[T.TENSOR] == T.WEIGHT) & (rows[T.PARAM] == param)]
            assert len(row) == 1 and row.iloc[0][T.ORDER] == -1
            row = row.iloc[0]
            assert row[T.NUMEL] == w.numel() and row[T.ZEROS] == int((w == 0).sum())
            assert row[T.ABSMAX] == float(w.abs().max())
            lost = int(((w != 0) & (w.to(torch.bfloat16) == 0)).sum())
            assert row["underflow_bf16"] == lost
    # the unused module's weight-update samples: every one "no update" (the optimizer skips a parameter without
    # a gradient)
    spare_rows = layers[layers[T.MODULE] == "spare"]
    assert set(spare_rows[T.TENSOR]) == {T.WEIGHT, T.WEIGHT_UPDATE}
    updates = spare_rows[spare_rows[T.TENSOR] == T.WEIGHT_UPDATE]
    assert (updates[T.ZEROS] == updates[T.NUMEL]).all()


class _Checkpointed(nn.Module):
    """An embedding, then a block of four modules run under ``torch.utils.checkpoint`` (``how``: None, or its
    ``use_reentrant``; "nested": a non-reentrant checkpoint inside another; "offload": ``save_on_cpu()`` inside
    a non-reentrant one), then a head: what Hugging Face's ``gradient_checkpointing`` does per decoder layer."""

    def __init__(self, how: bool | str | None) -> None:
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(VOCAB, 32)
        self.block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.emb(x)
        if self.how is None:
            h = self.block(h)
        elif isinstance(self.how, bool):
            h = checkpoint(self.block, h, use_reentrant=self.how)
        else:
            h = checkpoint(self._nested if self.how == "nested" else self._offloaded, h, use_reentrant=False)
        return self.head(h)

    def _nested(self, h: torch.Tensor) -> torch.Tensor:  # (a module after the inner one: recomputed past it)
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.block[1:3], self.block[0](h), use_reentrant=False)
        return self.block[3](h)

    def _offloaded(self, h: torch.Tensor) -> torch.Tensor:
        h = self.block[0](h)
        with torch.autograd.graph.save_on_cpu():
            h = self.block[1:3](h)
        return self.block[3](h)


@pytest.mark.parametrize("reentrant", [False, True, "nested", "offload"])
def test_a_checkpointed_block_is_recorded_once(reentrant: bool | str) -> None:
    """Activation checkpointing runs a block's forward again inside the backward pass; the step records what the
    same step without checkpointing records, every count and every call, the block-format what-if of every
    linear layer's operands included (the non-reentrant recomputation, the default of torch and of Hugging
    Face's gradient checkpointing, was recorded a second time: each of the block's activations twice; then
    still with a checkpoint nested in the block, or ``save_on_cpu()`` inside it, whose hooks hid the
    recomputation's), in forward order (a reentrant checkpoint's first pass runs without grad, and its blocks
    were ordered as the backward pass recomputed them, last first: the advisor named the wrong layer as the
    first to make a nan), and training is bitwise the same as without the profiler."""

    again: dict[bool | str | None, int] = {}

    def run(how: bool | str | None, profile: bool) -> tuple[pd.DataFrame | None, list[float]]:
        torch.manual_seed(0)
        model = _Checkpointed(how)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        prof = precprof.Profiler(model, optimizer=opt, sample_every=1, block_groups=1) if profile else None
        losses = []
        with prof if prof is not None else contextlib.nullcontext():
            for x, y in _batches(3):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
                if prof is not None:
                    prof.step()
        if prof is not None:
            again[how] = prof.summary()["checkpointed_forwards"]
        return (prof.tables()["layers"] if prof is not None else None), losses

    plain, plain_losses = run(None, True)
    checkpointed, losses = run(reentrant, True)
    assert plain is not None and checkpointed is not None
    key = [T.STEP, T.MODULE, T.TENSOR, T.PARAM]
    a = plain.sort_values(key).reset_index(drop=True)
    b = checkpointed.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
    assert set(a.loc[a[T.TENSOR] == T.ACTIVATION, T.CALLS]) == {1}
    assert losses == plain_losses == run(reentrant, False)[1]
    # the summary says the model checkpoints: the block's modules, run twice on each of the 3 sampled steps
    assert again[None] == 0 and again[reentrant] >= 3 * 4


class _InnerMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


class _BlockAroundACheckpoint(nn.Module):
    """A norm, an inner MLP (checkpointed reentrantly, or not) and an output layer that reads the MLP's output."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.ln, self.inner, self.out = nn.LayerNorm(16), _InnerMLP(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.ln(x)
        h = (
            self.inner(h)
            if self.reentrant is None
            else checkpoint(self.inner, h, use_reentrant=self.reentrant)
        )
        return x + self.out(h)


def test_a_layer_after_a_reentrant_checkpoint_reads_the_output_its_last_module_made() -> None:
    """A linear layer after a reentrant checkpoint reads the output of the block's last module, made in the
    checkpoint's first pass (without grad), which was not kept for the lookup: the layer recorded a row of its
    own for its input (``out:input``) and its GEMM's input was not the module's output, unlike the same model
    without the checkpoint."""

    def inputs(reentrant: bool | None) -> tuple[dict[str, Any], set[str]]:
        torch.manual_seed(0)
        model = _BlockAroundACheckpoint(reentrant)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with precprof.Profiler(model, optimizer=opt, sample_every=1, block_groups=1, memory=False) as prof:
            for _ in range(2):
                model(torch.randn(4, 16, requires_grad=True)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        return prof.summary()["gemm_inputs"], set(prof.tables()["layers"][T.MODULE])

    (plain, plain_rows), (got, rows) = inputs(None), inputs(True)
    assert got["out"] == plain["out"] == ["inner.b"]
    assert T.input_module("out") not in rows and T.input_module("out") not in plain_rows


class _CheckpointsABlock(nn.Module):
    """``_BlockAroundACheckpoint`` (its inner MLP checkpointed reentrantly, or not at all) run under a checkpoint
    of its own (``outer``: its ``use_reentrant``; None: none), then a head."""

    def __init__(self, outer: bool | None, inner: bool | None) -> None:
        super().__init__()
        self.outer = outer
        self.block, self.head = _BlockAroundACheckpoint(inner), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.block(x) if self.outer is None else checkpoint(self.block, x, use_reentrant=self.outer)
        return self.head(h)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")  # (the inner first pass)
@pytest.mark.parametrize("outer", [False, True])
def test_a_reentrant_checkpoint_inside_another_checkpoint_is_recorded_once(outer: bool) -> None:
    """A reentrant checkpoint inside a block an outer checkpoint runs again records what the same model without
    checkpoints records, every count, call and block column, and the same GEMM inputs: inside a non-reentrant
    one, the inner block's first layer read its input (the norm's output, made again by the outer
    recomputation and let go of before the inner one ran) as a row of its own (``inner.a:input``); inside a
    reentrant one, the inner first pass inside the outer's was read as the step's forward (each inner
    activation twice), and the outer block's output layer read a row of its own (``out:input``)."""

    def run(outer: bool | None, inner: bool | None) -> tuple[pd.DataFrame, dict[str, Any]]:
        torch.manual_seed(0)
        model = _CheckpointsABlock(outer, inner)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with precprof.Profiler(model, optimizer=opt, sample_every=1, block_groups=1, memory=False) as prof:
            for _ in range(2):
                model(torch.randn(4, 16, requires_grad=True)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        key = [T.STEP, T.MODULE, T.TENSOR, T.PARAM]
        layers = prof.tables()["layers"].sort_values(key).reset_index(drop=True)
        return layers, prof.summary()["gemm_inputs"]

    (plain, plain_inputs), (got, inputs) = run(None, None), run(outer, True)
    pd.testing.assert_frame_equal(got, plain)
    assert inputs == plain_inputs
    assert inputs["block.inner.a"] == ["block.ln"] and inputs["block.out"] == ["block.inner.b"]


class _ReadsAComputedTensor(nn.Module):
    """``b`` reads a tensor no module made (``tanh(a(x)) + 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # alive while ``b`` runs
        return self.head(self.b(torch.tanh(h) + 1))


def test_an_empty_batch_does_not_match_a_layer_input_to_another_module_output() -> None:
    """Every empty tensor's data pointer is 0: on a step with an empty batch (an MoE expert given no token, a
    last empty batch) ``b``'s input matched ``a``'s output by memory, and ``b`` was said to read ``a`` for the
    whole run (its FP8 verdict judged on ``a``'s rows)."""
    torch.manual_seed(0)
    model = _ReadsAComputedTensor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for batch in (8, 0, 8):
            model(torch.randn(batch, 16)).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    inputs = prof.summary()["gemm_inputs"]
    assert inputs.get("b", []) == [] and inputs["head"] == ["b"]
