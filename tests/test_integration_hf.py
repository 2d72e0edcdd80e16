"""Hugging Face Trainer + PrecprofCallback on a tiny GPT-2 built from a config (random weights), on the CPU."""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import re
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import forks
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from cast_counts import CastCounts
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.pytorch_utils import Conv1D

from precprof import tables as T
from precprof.errors import UserError
from precprof.integrations.hf import PrecprofCallback, profile_trainer
from precprof.rundir import RunDirError

VOCAB, SEQ, BATCH, N_EMBD = 64, 16, 4, 32
STEPS, SAMPLE_EVERY = 4, 2


class TokenData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Seeded random token sequences; labels = inputs (the model shifts them)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_head=2, n_embd=N_EMBD, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg)


def training_args(tmp_path: Path, **args: Any) -> TrainingArguments:
    """CPU, no reporting, no checkpoints, a log line every step; ``args`` add to or override these."""
    return TrainingArguments(
        **{
            "output_dir": str(tmp_path / "trainer"),
            "per_device_train_batch_size": BATCH,
            "use_cpu": True,
            "report_to": [],
            "logging_steps": 1,
            "save_strategy": "no",
            "disable_tqdm": True,
            "seed": 0,
            **args,
        }
    )


def make_trainer(tmp_path: Path, callbacks: list[Any] | None = None, **args: Any) -> Trainer:
    targs = training_args(tmp_path, max_steps=STEPS, **args)
    return Trainer(model=tiny_gpt2(), args=targs, train_dataset=TokenData(), callbacks=callbacks or [])


def _render_available() -> bool:
    return importlib.util.find_spec("precprof.report.render") is not None


def test_bf16_trainer_covers_every_conv1d(tmp_path: Path) -> None:
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=SAMPLE_EVERY)
    trainer = make_trainer(tmp_path, callbacks=[cb], bf16=True)
    trainer.train()
    run_dir = cb.run_dir
    assert run_dir == tmp_path / "run" and T.is_run_dir(run_dir)
    summary = T.read_summary(run_dir)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    tables = T.read_tables(run_dir)
    layers, steps = tables["layers"], tables["steps"]

    conv1d = {n: m for n, m in trainer.model.named_modules() if isinstance(m, Conv1D)}
    assert len(conv1d) == 4 * 2  # c_attn, attn.c_proj, c_fc, mlp.c_proj per block
    sampled = list(range(0, STEPS, SAMPLE_EVERY))
    for name, mod in conv1d.items():
        for step in sampled:
            rows = layers[(layers[T.MODULE] == name) & (layers[T.STEP] == step)]
            kinds = set(rows[T.TENSOR])
            assert {T.ACTIVATION, T.ACTIVATION_GRAD, T.WEIGHT, T.WEIGHT_GRAD, T.WEIGHT_UPDATE} <= kinds, name
            act = rows[rows[T.TENSOR] == T.ACTIVATION].iloc[0]
            # autocast ran the matmul in bf16; numel = batch x seq x out_features (Conv1D's nf)
            assert act[T.DTYPE] == "bfloat16"
            assert act[T.NUMEL] == BATCH * SEQ * mod.nf
            weight = rows[(rows[T.TENSOR] == T.WEIGHT) & (rows[T.PARAM] == "weight")].iloc[0]
            assert weight[T.DTYPE] == "float32" and weight[T.NUMEL] == mod.weight.numel()
    # the steps table: every optimizer step, the loss the Trainer logged (rounded to 4 digits there)
    assert steps[T.STEP].tolist() == list(range(STEPS))
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert steps[T.LOSS].tolist() == pytest.approx(logged, abs=1e-4)
    assert (steps[T.TOKENS] == BATCH * SEQ).all()
    assert summary[T.SUMMARY_CONFIG]["precision"] == "bf16"
    assert summary[T.SUMMARY_CAPTURE]["mixed_precision_active"] is True
    assert summary[T.SUMMARY_CAPTURE]["autocast"]["dtype"] == "bfloat16"
    assert summary[T.SUMMARY_MODEL]["n_embd"] == N_EMBD
    if _render_available():
        assert cb.report_path is not None and cb.report_path.exists()
        page = cb.report_path.read_text()
        assert "c_attn" in page and "Asked for <strong>bf16</strong> (TrainingArguments(bf16=True))." in page


def test_fp16_on_cpu_is_reported_as_not_active(tmp_path: Path) -> None:
    """accelerate accepts fp16=True on a CPU and trains in fp32: the run says so, and so does the advisor."""
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=SAMPLE_EVERY, memory=False, report=False)
    trainer = make_trainer(tmp_path, callbacks=[cb], fp16=True)
    assert trainer.accelerator.mixed_precision == "fp16" and trainer.accelerator.scaler is None
    trainer.train()
    summary = T.read_summary(cb.run_dir)
    capture = summary[T.SUMMARY_CAPTURE]
    assert summary[T.SUMMARY_CONFIG]["precision"] == "fp16"
    # the bare callback reads the calling Trainer's accelerator (it was None: read only with profile_trainer)
    assert summary[T.SUMMARY_CONFIG]["accelerate_mixed_precision"] == "fp16"
    assert capture["mixed_precision_requested"] == "fp16"
    assert capture["mixed_precision_active"] is False
    assert capture["matmul_layers_float32"] == capture["matmul_layers"] > 0
    layers = T.read_tables(cb.run_dir)["layers"]
    acts = layers[(layers[T.TENSOR] == T.ACTIVATION) & (layers[T.MODULE_TYPE] == "Conv1D")]
    assert set(acts[T.DTYPE]) == {"float32"}
    codes = [f["code"] for f in summary[T.SUMMARY_RECOMMENDATION]["findings"]]
    assert "mixed_precision_inactive" in codes


@pytest.mark.skipif(not _render_available(), reason="report extra")
def test_fp16_on_cpu_trained_in_fp32_and_only_the_precision_check_speaks_of_fp16(tmp_path: Path) -> None:
    """accelerate trains fp16=True in fp32 on a CPU: the title, the header, the heatmaps and the memory projection
    call the run fp32 (they called it fp16: 'this run trained in FP16', the projection's measured mode fp16); the
    precision check and its finding speak of the fp16 asked for."""
    from precprof.report import summarize as S
    from precprof.report.context import build_context, heatmap_focus

    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False)
    targs = training_args(tmp_path, max_steps=2, fp16=True)
    Trainer(model=tiny_gpt2(), args=targs, train_dataset=TokenData(), callbacks=[cb]).train()
    summary = T.read_summary(cb.run_dir)
    tables = T.read_tables(cb.run_dir)
    assert summary[T.SUMMARY_CAPTURE]["precision_seen"] == "fp32"
    assert summary[T.SUMMARY_MEMORY]["measured_mode"] == "fp32"
    assert (
        "measured mode: fp32 (as the profiler saw the run train; fp16 was asked for)"
        in (summary[T.SUMMARY_MEMORY]["assumptions"])
    )
    assert heatmap_focus(summary, None) == (
        "fp16",
        "FP16 has the narrowest range of the formats a run can train in",
    )
    ctx = build_context(tables, summary)
    assert ctx["title"] == "GPT2LMHeadModel · fp32"
    assert dict(ctx["headline"])["precision"] == "fp32"
    check = S.precision_check(tables["layers"], tables["memory"], summary)
    assert check["requested"] == "fp16" and check["asked"] and not check["ok"]
    assert check["asked_as"] == "TrainingArguments(fp16=True)"
    codes = [f["code"] for f in summary[T.SUMMARY_RECOMMENDATION]["findings"]]
    assert "mixed_precision_inactive" in codes


def test_weights_loaded_in_bf16_under_autocast_lose_updates_and_are_told_how_to_keep_them(
    tmp_path: Path,
) -> None:
    """A model loaded in bf16 (from_pretrained(..., dtype=torch.bfloat16)) trained with the Trainer's bf16=True:
    autocast casts ops' inputs and keeps no fp32 copy, so AdamW's small updates round away in the bf16 weights.
    The final norm's weight (all ones, updates near the learning rate, 5e-5, against half a bf16 ulp of 1,
    2^-8) has not moved at all, its bias (from 0, where bf16 is fine) has: half the module's updates lost, as
    the finding says. The finding called this "a bf16-pure run" and said "bf16 autocast does" keep fp32
    master weights: this run had autocast on."""
    model = tiny_gpt2().to(torch.bfloat16)
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, memory=False, report=False)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, max_steps=STEPS, bf16=True),
        train_dataset=TokenData(),
        callbacks=[cb],
    )
    trainer.train()
    ln_f = model.transformer.ln_f
    assert torch.equal(ln_f.weight, torch.ones_like(ln_f.weight)) and bool((ln_f.bias != 0).all())
    summary = T.read_summary(cb.run_dir)
    assert summary[T.SUMMARY_CAPTURE]["autocast"]["enabled"] is True
    f = next(f for f in summary[T.SUMMARY_RECOMMENDATION]["findings"] if f["code"] == "bf16_lost_updates")
    assert f["severity"] == "critical" and "worst: " in f["message"]
    # half the final norm's sampled updates lost: its weight's all, its bias's none (the worst the finding lists
    # are the wider layers, now that their samples spread across their columns)
    layers = T.read_tables(cb.run_dir)["layers"]
    u = layers[(layers[T.TENSOR] == T.WEIGHT_UPDATE) & (layers[T.MODULE] == "transformer.ln_f")]
    assert u[T.LOST_UPDATE_BF16].sum() / (u[T.NUMEL] - u[T.ZEROS]).sum() == pytest.approx(0.5, abs=0.01)
    assert "holds its weights in bf16 under bf16 autocast" in f["message"] and "bf16-pure" not in f["message"]
    assert f["remedy"].startswith("Hold the weights in fp32 and let bf16 autocast cast the matmuls")


class _Boom(TrainerCallback):  # type: ignore[misc]
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:
            raise RuntimeError("boom at step 2")


def test_profile_trainer_saves_an_incomplete_run_on_crash(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[_Boom()], bf16=True)
    with pytest.raises(RuntimeError, match="boom at step 2") as info:
        profile_trainer(trainer, out=tmp_path / "run", sample_every=1, report=False, memory=False)
    assert any("partial run was saved" in n for n in getattr(info.value, "__notes__", []))
    summary = T.read_summary(tmp_path / "run")
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert "boom at step 2" in summary[T.SUMMARY_INCOMPLETE_REASON]
    steps = T.read_tables(tmp_path / "run")["steps"]
    assert steps[T.STEP].tolist() == [0, 1]
    # profile_trainer knows the trainer: the config names accelerate's setting
    assert summary[T.SUMMARY_CONFIG]["accelerate_mixed_precision"] == "bf16"
    # the hooks are gone: the model trains on without precprof
    assert trainer.precprof_callback.profiler is None
    assert not trainer.model._forward_hooks
    json.dumps(summary)  # JSON-safe
    assert isinstance(T.read_tables(tmp_path / "run")["layers"], pd.DataFrame)


def test_bare_callback_session_is_saved_at_interpreter_exit(tmp_path: Path) -> None:
    """Without profile_trainer a crash has no hook: the session is written, incomplete, by atexit."""
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import torch
        from precprof.integrations._common import Session

        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        session = Session({str(tmp_path / "run")!r}, {{"sample_every": 1, "memory": False}}, report=False)
        session.start(model, opt, None, {{"config": {{"precision": "fp32"}}}})
        for _ in range(2):
            loss = model(torch.randn(2, 4)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            session.step(loss=loss.detach())
        raise RuntimeError("crash with no hook")
        """
    )
    # a fork of the preloaded Python (tests/forks.py): its interpreter ends as a fresh one does, atexit and all
    proc = forks.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "crash with no hook" in proc.stderr
    summary = T.read_summary(tmp_path / "run")
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    # the exception that ended the script (capture.unsaved.uncaught), as profile_trainer says it
    assert summary[T.SUMMARY_INCOMPLETE_REASON] == (
        "RuntimeError: crash with no hook; the process exited before training ended"
    )
    assert T.read_tables(tmp_path / "run")["steps"][T.STEP].tolist() == [0, 1]


# ---------------------------------------------------------------------------------- gradient accumulation
GA, GA_SAMPLES = 4, 40  # 10 micro-batches an epoch: windows of 4, 4 and 2 (the epoch ends mid-window)


class ShortEpochData(TokenData):
    def __len__(self) -> int:
        return GA_SAMPLES


class _Windows(TrainerCallback):  # type: ignore[misc]
    """Micro-batches per optimizer step, as the Trainer ran them (on_substep_end, then on_step_end)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._n = 0

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._n += 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.sizes.append(self._n + 1)
        self._n = 0


@pytest.mark.parametrize("attach", ["callback", "profile_trainer", "no_trainer"])
def test_accumulated_loss_and_grad_norm_are_the_trainers(
    tmp_path: Path, attach: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gradient_accumulation_steps=4 over 2 epochs that end mid-window: per optimizer step, the loss recorded is
    the one the Trainer logs (transformers 5.x normalises outputs.loss over the window: no second division), and
    the grad norm is the Trainer's own (max_grad_norm=1: the pre-clip norm it logs).

    ``callback``: the bare callback finds the Trainer on the call stack; ``profile_trainer``: it is handed the
    Trainer; ``no_trainer``: no Trainer to read, the loss comes from outputs.loss by the window rule."""
    import transformers

    from precprof.integrations import hf

    if attach == "no_trainer":
        monkeypatch.setattr(hf, "_calling_trainer", lambda: None)
    targs = training_args(tmp_path, num_train_epochs=2, gradient_accumulation_steps=GA, max_grad_norm=1.0)
    windows = _Windows()
    trainer = Trainer(model=tiny_gpt2(), args=targs, train_dataset=ShortEpochData(), callbacks=[windows])
    kw: dict[str, Any] = {"sample_every": 100, "report": False, "memory": False}
    if attach == "profile_trainer":
        profile_trainer(trainer, out=tmp_path / "run", **kw)
        run_dir = tmp_path / "run"
    else:
        cb = PrecprofCallback(out=tmp_path / "run", **kw)
        trainer.add_callback(cb)
        trainer.train()
        run_dir = cb.run_dir
    steps = T.read_tables(run_dir)["steps"]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    v5 = int(transformers.__version__.split(".")[0]) >= 5
    if v5:  # each epoch: windows of 4, 4 and 2 (transformers < 4.46 let a window run on into the next epoch)
        assert windows.sizes == [GA, GA, GA_SAMPLES // BATCH % GA] * 2
    assert steps[T.STEP].tolist() == list(range(len(windows.sizes))) and len(logged) == len(windows.sizes)
    # transformers 4.x rounds the logged loss to 4 decimals; 5.x logs the float32 sum itself
    tol = {"rel": 1e-6} if v5 else {"abs": 6e-5}
    assert steps[T.LOSS].tolist() == pytest.approx([h["loss"] for h in logged], **tol)
    # random weights: every step's loss is near ln(vocab), the short windows' included (no 4x / 2x error)
    assert steps[T.LOSS].between(3.0, 5.0).all(), steps[T.LOSS].tolist()
    assert steps[T.TOKENS].tolist() == [n * BATCH * SEQ for n in windows.sizes]
    # without a Trainer to read (no_trainer), the norm comes from the clip_grad_norm_ call the loop makes
    # (precprof.clipwatch): the same number the Trainer logs
    assert steps[T.GRAD_NORM].tolist() == pytest.approx([h["grad_norm"] for h in logged], rel=1e-6)
    # the taps are gone: the Trainer's methods are its class's again
    assert "training_step" not in vars(trainer) and "clip_grad_norm_" not in vars(trainer.accelerator)


def test_the_advisor_reads_a_trainers_tokens_per_call_from_the_layers(tmp_path: Path) -> None:
    """A Trainer knows its batch size, not its sequences' length: the advisor measures the rows of each GEMM
    (batch x sequence, 4 x 16 here) from the linear layers' outputs. Taking the batch alone (4) made a false
    "Dimensions not a multiple of 8: batch x sequence = 4" finding in every such run (a warning on a GPU),
    and left the head tied to the embedding of unknown shape for the FP8 rule."""
    from precprof.analysis.advisor import recommend

    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False)
    targs = training_args(tmp_path, max_steps=2, gradient_accumulation_steps=2, bf16=True)
    Trainer(model=tiny_gpt2(), args=targs, train_dataset=TokenData(), callbacks=[cb]).train()
    assert T.read_summary(cb.run_dir)[T.SUMMARY_CONFIG].get("seq_len") is None  # the Trainer does not say
    rec = recommend(cb.run_dir, hardware="h100")
    # every dimension of this model (32, 64, 16 a head, 4 x 16 tokens a call) is a multiple of 8
    assert "tensor_core_alignment" not in {f.code for f in rec.findings}
    fp8 = next(f for f in rec.findings if f.code == "fp8_eligibility")
    assert fp8.numbers["tied"] == 1 and fp8.numbers["unknown_shape"] == 0, fp8.numbers
    assert "lm_head" in fp8.message and "tied to the embedding transformer.wte" in fp8.message


class StepOf(TrainerCallback):
    """The optimizer step the Trainer is computing (its global_step when the step begins)."""

    step = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step


def test_trainer_counts_are_real_casts_and_training_is_unchanged(tmp_path: Path) -> None:
    """bf16 Trainer on code precprof did not write: the counts of every Conv1D's output and output gradient
    equal independent hooks' real casts on every sampled step, and the losses and final weights are bitwise
    those of the same Trainer without the callback (the independent hooks run in both)."""
    runs: dict[str, tuple[CastCounts, Trainer]] = {}
    for name, callbacks in (
        ("plain", []),
        ("profiled", [PrecprofCallback(out=tmp_path / "run", sample_every=2, report=False)]),
    ):
        targs = training_args(tmp_path / name, max_steps=STEPS, bf16=True)
        model, at = tiny_gpt2(), StepOf()
        check = CastCounts(model, (Conv1D,), lambda at=at: at.step, SAMPLE_EVERY)
        trainer = Trainer(model=model, args=targs, train_dataset=TokenData(), callbacks=[at, *callbacks])
        trainer.train()
        runs[name] = (check, trainer)
    (plain, t_plain), (check, t_prof) = runs["plain"], runs["profiled"]
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (t_plain, t_prof)]
    assert losses[0] == losses[1] and len(losses[0]) == STEPS
    for (k, a), b in zip(t_plain.model.state_dict().items(), t_prof.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert plain.seen == check.seen
    layers = T.read_tables(tmp_path / "run")["layers"]
    assert {s for s, _, _ in check.seen} == set(range(0, STEPS, SAMPLE_EVERY)) == set(layers[T.STEP])
    assert len(check.seen) == 2 * 8 * 2  # sampled steps x Conv1D layers x (output, output gradient)
    assert check.compare(layers) > 0


class GraphsMoved(TrainerCallback):
    """The steps in which Dynamo's own count of the graphs it compiled moved."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self._graphs = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from torch._dynamo.utils import counters

        self._graphs = int(counters["stats"]["unique_graphs"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from torch._dynamo.utils import counters

        if int(counters["stats"]["unique_graphs"]) != self._graphs:
            self.steps.append(state.global_step - 1)  # global_step counts the step that ended


def test_a_compiled_trainer_keeps_its_graphs_and_every_conv1d_is_recorded(tmp_path: Path) -> None:
    """``torch_compile=True`` (Dynamo with its "eager" backend, to stay fast on the CPU: the graphs, breaks
    and recompiles are Dynamo's own): with the callback the Trainer compiles the same graphs as without it,
    no graph break and no recompile, trains bitwise the same, and every Conv1D's output and output gradient
    are recorded on every sampled step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    got: dict[str, Any] = {}
    compiled_in = GraphsMoved()
    for name, callbacks in (
        ("plain", []),
        ("profiled", [compiled_in, PrecprofCallback(out=tmp_path / "run", sample_every=2, report=False)]),
    ):
        torch._dynamo.reset()
        counters.clear()
        targs = training_args(
            tmp_path / name, max_steps=STEPS, torch_compile=True, torch_compile_backend="eager"
        )
        trainer = Trainer(model=tiny_gpt2(), args=targs, train_dataset=TokenData(), callbacks=callbacks)
        trainer.train()
        got[name] = (
            int(counters["stats"]["unique_graphs"]),
            int(sum(counters["graph_break"].values())),
            [h["loss"] for h in trainer.state.log_history if "loss" in h],
            trainer.model.state_dict(),
        )
    (graphs, breaks, losses, weights), (graphs_p, breaks_p, losses_p, weights_p) = (
        got["plain"],
        got["profiled"],
    )
    assert graphs_p == graphs > 0 and breaks_p == breaks
    assert losses_p == losses and len(losses) == STEPS
    for k, a in weights.items():
        assert torch.equal(a, weights_p[k]), k
    layers = T.read_tables(tmp_path / "run")["layers"]
    conv = layers[layers[T.MODULE_TYPE] == "Conv1D"]
    for kind in (T.ACTIVATION, T.ACTIVATION_GRAD):
        rows = conv[conv[T.TENSOR] == kind]
        assert set(rows[T.STEP]) == set(range(0, STEPS, SAMPLE_EVERY)), kind
        assert rows.groupby(T.STEP)[T.MODULE].nunique().eq(8).all(), kind
    # the summary and the report say the Trainer compiled it (the callback holds the module, which cannot tell),
    # and that its dropout makes a sampled step draw other masks than inductor's kernels would
    from precprof.report.environment import capture_rows

    capture = T.read_summary(tmp_path / "run")[T.SUMMARY_CAPTURE]
    assert capture["compiled"] == "the whole model (the Trainer's torch_compile, backend eager)"
    dropouts = [m for m in tiny_gpt2().modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    assert capture["dropout_layers"] == len(dropouts) > 0
    row = dict(capture_rows(capture, {}))["torch.compile"]
    assert (
        row.startswith(capture["compiled"]) and "dropout" not in row
    )  # Dynamo's eager backend: torch's masks
    inductor = {**capture, "compiled": "the whole model (the Trainer's torch_compile, backend inductor)"}
    row = dict(capture_rows(inductor, {}))["torch.compile"]
    assert f"the model has {len(dropouts)} dropout layers: inductor's kernels draw their own random" in row
    # the step Dynamo compiled in (the first unsampled: a sampled step runs eagerly) is no part of the rate
    assert compiled_in.steps == [1] == capture["sampling"]["compiled_steps"]
    final, steps = T.read_summary(tmp_path / "run")[T.SUMMARY_FINAL], T.read_tables(tmp_path / "run")["steps"]
    # step 0 is warm-up, 1 compiled; too few unsampled steps are left: every other step counts
    counted = steps[steps[T.STEP] > 1]
    assert final["tokens_per_s_steps"] == len(counted) == 2
    assert final["tokens_per_s"] == pytest.approx(BATCH * SEQ / counted[T.TIME_S].median())


def _mixtral(experts_implementation: str) -> Any:
    """A 2-layer Mixtral of 4 experts (2 a token) built from a config, its experts run by ``experts_implementation``
    (transformers 5 holds each layer's experts as 3-D weights in one ``MixtralExperts`` module)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=N_EMBD,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation=experts_implementation,
    )
    model = MixtralForCausalLM(cfg)
    if getattr(model.config, "_experts_implementation", None) != experts_implementation:
        pytest.skip("this transformers has no experts implementations (transformers 5 added them)")
    return model


def _bf16_steps(
    model: torch.nn.Module, autocast: bool = True, memory: bool = False
) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """Two AdamW steps of a causal LM, under bf16 autocast or (``autocast=False``) as the model's dtype has it,
    every step sampled: its tables and summary (the memory table with ``memory``)."""
    from precprof.capture import Profiler

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Profiler(model, optimizer=opt, sample_every=1, memory=memory, memory_every=1) as prof:
        for i in range(2):
            ids = TokenData()[i]["input_ids"].repeat(BATCH, 1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    return prof.tables(), {T.SUMMARY_CAPTURE: prof.summary()}


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_experts_multiplied_in_fp32_under_autocast_are_found(tmp_path: Path, implementation: str) -> None:
    """A Mixtral under bf16 autocast on the CPU, each expert implementation, checked by a plain hook on the
    experts' activation function: transformers' default ("grouped_mm") calls torch._grouped_mm, which autocast
    does not cast, so the experts (most of a mixture of experts' weights) multiply in float32 while the
    attention runs in bf16; "batched_mm" calls bmm, which it casts. The finding is there exactly when it
    happened, and names the expert modules."""
    from precprof.analysis.advisor import recommend

    model = _mixtral(implementation)
    seen: set[torch.dtype] = set()
    for layer in model.model.layers:
        layer.mlp.experts.act_fn.register_forward_hook(lambda m, args, out: seen.add(args[0].dtype))
    tables, summary = _bf16_steps(model)
    rec = recommend(tables, summary=summary)
    found = rec.finding("experts_fp32")
    assert seen == ({torch.float32} if implementation == "grouped_mm" else {torch.bfloat16})
    if implementation == "batched_mm":
        assert found is None
        return
    assert found is not None and found.severity == "warning"
    assert found.modules == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert "bf16 autocast on" in found.message and 'experts_implementation="batched_mm"' in found.remedy
    n = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
    assert found.numbers["expert_params"] == experts and found.numbers["share_of_params"] == pytest.approx(
        experts / n
    )


def test_fp8_counts_the_experts_it_would_not_convert(tmp_path: Path) -> None:
    """A Mixtral's experts (3-D weights in one module per layer) carry most of its matmul FLOPs, and float8
    conversion swaps nn.Linear alone: the FP8 rule counted the linear layers only ("9 of 9 qualify, carrying
    100% of the linear layers' FLOPs"), so FP8 could be advised for a model whose matmuls would mostly stay in
    bf16. The share is checked against the model's own shapes: 2 x in x out per token for each nn.Linear, and
    for the experts 2 x (tokens each goes to: num_experts_per_tok) x out x in of each expert weight."""
    from precprof.analysis.advisor import recommend

    model = _mixtral("batched_mm")
    tables, summary = _bf16_steps(model)
    rec = recommend(tables, hardware="h100", summary=summary)
    f = rec.finding("fp8_eligibility")
    assert f is not None
    linear = {
        n: 2 * m.in_features * m.out_features
        for n, m in model.named_modules()
        if type(m).__name__ == "Linear"
    }
    k = model.config.num_experts_per_tok
    experts = sum(
        2 * k * w.shape[1] * w.shape[2]
        for layer in model.model.layers
        for w in layer.mlp.experts.parameters()
    )
    total = sum(linear.values()) + experts
    assert f.numbers["checked"] == len(linear)
    assert f.numbers["eligible_flops_share"] == pytest.approx(sum(linear[m] for m in f.modules) / total)
    assert f.numbers["experts_flops_share"] == pytest.approx(experts / total) and experts / total > 0.5
    assert "model.layers.0.mlp.experts, model.layers.1.mlp.experts" in f.message
    assert (
        "of the matmul FLOPs of the model's layers, the experts' 70.6% (which stay in bf16) among them"
        in " ".join(rec.reasons)
    )


def _llama_config(**over: Any) -> Any:
    """A one-layer Llama of this file's sizes (two heads, grouped as two), ``over`` changing any of it."""
    from transformers import LlamaConfig

    sizes: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=N_EMBD,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaConfig(**{**sizes, **over})


def test_rotary_frequencies_a_cast_rounded_are_found_and_bounded() -> None:
    """A Llama cast with .to(torch.bfloat16), as a user's loop or Lightning's "bf16-true" does: the cast rounds
    the rotary embedding's inverse frequencies (buffers) to 8 significant bits, and the angle at position p
    moves by p times the error. This was reported as "normalisation buffers ... running statistics (momentum
    0.1 of a batch statistic)". The finding bounds the error by half a bf16 unit in the last place of the largest
    frequency that is not a power of two (10000^(-2/128) = 0.93 lies in [0.5, 1): 2^-9), at or above the true
    error (the frequencies recomputed in fp32 as built) and, with a head of 128 as Llama's, within 2x of it.
    Built in bf16 (transformers keeps these buffers in fp32), there is no finding."""
    from transformers import LlamaForCausalLM

    from precprof.analysis.advisor import recommend

    torch.manual_seed(0)
    cfg = _llama_config(head_dim=128)
    cast = LlamaForCausalLM(cfg).to(torch.bfloat16)
    exact = LlamaForCausalLM(cfg).model.rotary_emb.inv_freq  # fp32, as built
    assert cast.model.rotary_emb.inv_freq.dtype == torch.bfloat16 and exact.dtype == torch.float32
    error = float((cast.model.rotary_emb.inv_freq.float() - exact).abs().max())
    tables, summary = _bf16_steps(cast, autocast=False)
    rec = recommend(tables, summary=summary)
    f = rec.finding("low_precision_rope")
    assert f is not None and f.severity == "warning"
    assert f.modules == ["model.rotary_emb"] and f.numbers["buffers"] == 2  # inv_freq, original_inv_freq
    assert f.numbers["frequency_error"] == 2.0**-9 and 0.5 <= 10000 ** (-2 / 128) < 1
    assert error <= f.numbers["frequency_error"] <= 2 * error
    assert f.numbers["angle_error_at_4096"] == 4096 * f.numbers["frequency_error"]
    assert "model.rotary_emb.inv_freq (bfloat16)" in f.message and "running statistics" not in f.message
    assert rec.finding("low_precision_buffers") is None and "model.rotary_emb" not in rec.keep_fp32
    built = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    assert built.model.rotary_emb.inv_freq.dtype == torch.float32
    tables, summary = _bf16_steps(built, autocast=False)
    rec = recommend(tables, summary=summary)
    assert rec.finding("low_precision_rope") is None and rec.finding("low_precision_constants") is None


class InputDtypeLayerNorm(nn.Module):
    """A LayerNorm of one's own code, computing its statistics in its input's dtype (torch's computes in fp32
    inside)."""

    def __init__(self, ln: nn.LayerNorm) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = ln.weight, ln.bias, ln.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


def test_norms_of_a_cast_model_are_flagged_when_they_compute_in_bf16_and_the_remedy_runs_as_written() -> None:
    """A Llama cast to bf16: transformers' RMSNorm upcasts its input and computes in fp32, rounding only its
    output (it keeps fp32 tensors for its backward, the memory table says so), and was warned about all the same
    ("normalisation loses accuracy in bf16", a remedy to cast it back). Now it is no finding; the memory off, it
    is flagged with "not known". A GPT-2 cast to bf16: torch's LayerNorm computes in fp32 inside on this CPU too
    (its output within a bf16 unit of the fp32 computation rounded once, a bf16 computation's 40x further off),
    though it keeps bf16 tensors for its backward here: no finding (it had been told it computed in bf16). Its
    LayerNorms swapped for a LayerNorm computing in bf16: flagged, and the remedy done as written (the modules
    and their inputs in fp32, their outputs cast back to bf16) runs a training step, where casting the outputs
    back was missing from it and the next bf16 layer refused them."""
    from transformers import LlamaForCausalLM

    from precprof.analysis.advisor import recommend

    torch.manual_seed(0)
    llama = LlamaForCausalLM(_llama_config()).to(torch.bfloat16)
    tables, summary = _bf16_steps(llama, autocast=False, memory=True)
    rec = recommend(tables, summary=summary)
    assert rec.finding("bf16_fp32_ops") is None and not any("norm" in m for m in rec.keep_fp32)
    tables, summary = _bf16_steps(llama, autocast=False)
    f = recommend(tables, summary=summary).finding("bf16_fp32_ops")
    assert f is not None and "(Whether they computed in bf16 inside is not known" in f.message

    model = tiny_gpt2().to(torch.bfloat16)
    ln = model.transformer.ln_f
    x = torch.randn(64, ln.weight.numel()).mul(3).add(100).bfloat16()
    wide = F.layer_norm(x.float(), ln.weight.shape, ln.weight.float(), ln.bias.float(), ln.eps)
    low = InputDtypeLayerNorm(ln)(x)
    assert (ln(x).float() - wide.bfloat16().float()).abs().max() <= 2.0**-6
    assert (low.float() - wide.bfloat16().float()).abs().max() >= 2.0**-3
    tables, summary = _bf16_steps(model, autocast=False, memory=True)
    f = recommend(tables, summary=summary).finding("bf16_fp32_ops")
    assert f is None or not any("ln" in m for m in f.modules), f
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.LayerNorm):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, InputDtypeLayerNorm(m))
    tables, summary = _bf16_steps(model, autocast=False, memory=True)
    f = recommend(tables, summary=summary).finding("bf16_fp32_ops")
    assert f is not None and f.severity == "warning"
    assert "They kept no fp32 tensor for their backward: they computed in bf16." in f.message
    assert "their outputs back to bfloat16 for the layers that read them" in f.remedy
    norms = [model.get_submodule(m) for m in f.modules]
    assert {type(m).__name__ for m in norms} == {"InputDtypeLayerNorm"}
    ids = TokenData()[0]["input_ids"].repeat(BATCH, 1)
    for m in norms:
        m.float().register_forward_pre_hook(lambda mod, args: (args[0].float(),))
    with pytest.raises(RuntimeError, match="dtype"):
        model(input_ids=ids, labels=ids)
    for m in norms:
        m.register_forward_hook(lambda mod, args, out: out.to(torch.bfloat16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(m.weight.grad is not None and m.weight.grad.dtype == torch.float32 for m in norms)


def test_wandb_beside_the_trainers_own_logs_keeps_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``report_to="wandb"`` with ``PrecprofCallback(wandb=True)``: the Trainer's WandbCallback logs without
    ``step=`` (evaluations too), wandb's step ran ahead of precprof's, and precprof's series stopped after the
    first steps with a warning whose remedy (``step=``) a Trainer user cannot apply. Beside the Trainer the rows
    are logged without ``step=``, each with ``precprof/step``: every step's loss is in the run's history. The
    Trainer's "*" glob put most of precprof's series against train/global_step: each key of precprof's is
    defined by its name against precprof/step."""
    wandb = pytest.importorskip("wandb")
    from test_export import (
        _assert_precprof_series_go_against_precprof_step,
        _wandb_files_closed,
        _wandb_history,
    )

    for k, v in {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False, wandb=True)
    args = training_args(tmp_path, max_steps=STEPS, report_to=["wandb"], eval_strategy="steps", eval_steps=1)
    trainer = Trainer(
        model=tiny_gpt2(), args=args, train_dataset=TokenData(), eval_dataset=TokenData(), callbacks=[cb]
    )
    try:
        trainer.train()
    finally:
        wandb.finish()
        _wandb_files_closed()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = [r for r in _wandb_history(run_dir).values() if "precprof/loss" in r]
    steps = T.read_tables(cb.run_dir)["steps"]
    assert [r["precprof/step"] for r in rows] == steps[T.STEP].tolist() == list(range(STEPS))
    assert [r["precprof/loss"] for r in rows] == pytest.approx(steps[T.LOSS].tolist())
    _assert_precprof_series_go_against_precprof_step(run_dir, "train/global_step")


def _precprof_rows_beside_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: Any
) -> list[dict[str, Any]]:
    """precprof's rows in the history of an offline wandb run that the Trainer reports to too, precprof given
    ``target(run)`` as its ``wandb=``."""
    wandb = pytest.importorskip("wandb")
    from test_export import _wandb_files_closed, _wandb_history

    for k, v in {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    run = wandb.init(mode="offline", dir=str(tmp_path), project="precprof-test")
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=2, report=False, wandb=target(run))
    try:
        Trainer(
            model=tiny_gpt2(),
            args=training_args(tmp_path, max_steps=STEPS, report_to=["wandb"]),
            train_dataset=TokenData(),
            callbacks=[cb],
        ).train()
    finally:
        wandb.finish()
        _wandb_files_closed()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    return [
        {k: v for k, v in r.items() if k.startswith("precprof/") and not k.startswith("precprof/step_time")}
        for r in _wandb_history(run_dir).values()
        if "precprof/step" in r
    ]


def test_a_besidetrainer_of_the_users_own_logs_as_the_run_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wandb=BesideTrainer(run)`` beside ``report_to="wandb"`` was wrapped a second time and refused ("expected
    True (the current wandb.run) or a wandb run object"): the Trainer did not start. It logs what ``wandb=run``
    logs, the step times aside."""
    from precprof.export.wandb import BesideTrainer

    plain = _precprof_rows_beside_the_trainer(tmp_path / "plain", monkeypatch, lambda run: run)
    wrapped = _precprof_rows_beside_the_trainer(tmp_path / "wrapped", monkeypatch, BesideTrainer)
    assert [r["precprof/step"] for r in plain] == list(range(STEPS))
    assert wrapped == plain


class _LogsToWandbAtItsStep(TrainerCallback):
    """A user's own callback: the Trainer's loss to the current wandb run at the Trainer's step (``step=``)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        import wandb

        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
            wandb.log({"my/loss": logs["loss"]}, step=state.global_step)


def test_wandb_beside_a_callback_that_logs_at_the_trainers_step_keeps_the_unsampled_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A callback of the user's logs to wandb with ``step=state.global_step`` (no ``report_to``) and precprof
    samples every 3rd step: the unsampled steps' rows came after the callback had logged a later step, and
    wandb dropped them (precprof/loss at steps 0 and 3 of 6). They go to wandb's next steps, against
    precprof/step, and the callback's own values stay at its steps; the last, still waiting when training
    ends, goes when the wandb run finishes (it was left out, with a warning)."""
    wandb = pytest.importorskip("wandb")
    from test_export import _wandb_files_closed, _wandb_history

    for k, v in {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    wandb.init(mode="offline", dir=str(tmp_path), project="precprof-test")
    mine = _LogsToWandbAtItsStep()
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=3, report=False, wandb=True)
    try:
        args = training_args(tmp_path, max_steps=6)
        Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(), callbacks=[mine, cb]).train()
    finally:
        wandb.finish()
        _wandb_files_closed()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    history = _wandb_history(run_dir)
    assert {s: r["my/loss"] for s, r in history.items() if "my/loss" in r} == mine.losses
    rows = {r["precprof/step"]: r["precprof/loss"] for r in history.values() if "precprof/loss" in r}
    # the Trainer's step s + 1 is precprof's step s (it logs the loss rounded to 4 digits)
    assert rows == {s - 1: pytest.approx(loss, abs=1e-4) for s, loss in mine.losses.items()}


class _Images(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"pixel_values": torch.randn(3, 16, 16, generator=g), "labels": torch.tensor(i % 3)}


def test_a_model_without_input_ids_counts_no_tokens(tmp_path: Path) -> None:
    """A ViT's batch has ``pixel_values`` and ``labels``: its "tokens" were the labels (the first integer tensor
    of the forward's arguments), 8 a step, shown as tokens/s beside an advisor that said 68 tokens per call.
    Labels are never tokens: a batch without ``input_ids`` counts none."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_labels=3,
    )  # fmt: skip
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=2, report=False)
    args = training_args(tmp_path, max_steps=2, gradient_accumulation_steps=2)
    Trainer(model=ViTForImageClassification(cfg), args=args, train_dataset=_Images(), callbacks=[cb]).train()
    steps = T.read_tables(cb.run_dir)["steps"]
    assert len(steps) == 2 and steps[T.TOKENS].isna().all()
    final = T.read_summary(cb.run_dir)["final"]
    assert (
        final["tokens_per_s_steps"] == 0 and final["tokens_per_s"] is None
    )  # not measured: null in summary.json


class _SlowEval(TokenData):
    """An evaluation set of 4 samples that take 0.5 s each to load: 2 s an evaluation."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(0.5)
        return super().__getitem__(i)


def test_the_trainers_evaluation_is_not_the_next_steps_time(tmp_path: Path) -> None:
    """The Trainer evaluates after ``on_step_end`` (precprof's step) and before the next step: the evaluation's
    time was the next step's ``time_s``, and with ``eval_steps`` a multiple of the sampling interval it always
    fell in a sampled step, read as precprof's overhead. ``Trainer.evaluate`` is left out of step times."""
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=2, report=False)
    args = training_args(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4
    )
    Trainer(
        model=tiny_gpt2(), args=args, train_dataset=TokenData(), eval_dataset=_SlowEval(), callbacks=[cb]
    ).train()
    steps = T.read_tables(cb.run_dir)["steps"]
    assert steps[T.STEP].tolist() == [0, 1, 2, 3]
    # the evaluation after step 2 took 2 s; a step of this model takes milliseconds, under load a few tenths
    assert steps[T.TIME_S][3] < 2.0, steps[T.TIME_S].tolist()


@pytest.mark.parametrize("resume", [None, False])
def test_a_train_resumed_from_a_checkpoint_continues_the_run_unless_told_to_replace_it(
    tmp_path: Path, resume: bool | None
) -> None:
    """4 steps with a checkpoint every 2, then a second Trainer on from checkpoint-2 into the same ``out``
    without ``resume=True``: the run directory held steps 2-3 only, the first Trainer's steps gone without a
    word. It continues the run now (0-1 | 2-3), warning that it does and how to do otherwise;
    ``resume=False`` still replaces it, as asked. The losses are those the two Trainers logged."""
    out, logged = tmp_path / "run", []
    for ckpt in (None, tmp_path / "trainer" / "checkpoint-2"):
        kw = {"resume": resume} if ckpt is not None and resume is not None else {}
        cb = PrecprofCallback(out=out, sample_every=1, report=False, memory=False, **kw)
        trainer = make_trainer(tmp_path, callbacks=[cb], save_strategy="steps", save_steps=2)
        if ckpt is not None and resume is None:
            with pytest.warns(UserWarning, match="resumed at step 2 .* continuing it .* resume=True"):
                trainer.train(resume_from_checkpoint=str(ckpt))
        else:
            trainer.train(resume_from_checkpoint=str(ckpt) if ckpt is not None else None)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        logged += losses[:2] if ckpt is None else losses[-2:]
    read = T.read_run(out)
    steps = read.tables["steps"]
    if resume is False:
        assert steps[T.STEP].tolist() == [2, 3]
        assert steps[T.LOSS].tolist() == pytest.approx(logged[2:], rel=1e-6)
        return
    assert steps[T.STEP].tolist() == [0, 1, 2, 3] and read.restarts == [2]
    assert steps[T.LOSS].tolist() == pytest.approx(logged, rel=1e-6)
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE


def _logged_losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_a_second_train_into_a_complete_run_is_refused_unless_asked_to_replace_it(tmp_path: Path) -> None:
    """A notebook cell run again: a second ``train()`` with the same callback replaced the complete run in
    ``out`` without a word. It is refused now, as ``Profiler(out=...)`` refuses it, and the run is kept whole;
    ``overwrite=True`` replaces it. The losses are those the Trainer logged."""
    out = tmp_path / "run"
    trainer = make_trainer(tmp_path, [PrecprofCallback(out=out, sample_every=1, report=False, memory=False)])
    trainer.train()
    first = _logged_losses(trainer)
    with pytest.raises(RunDirError, match=r"already holds a precprof run \(complete\).* overwrite=True"):
        trainer.train()
    steps = T.read_tables(out)["steps"]
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert steps[T.LOSS].tolist() == pytest.approx(first, abs=1e-4)
    again = make_trainer(tmp_path, [PrecprofCallback(out=out, sample_every=1, report=False, overwrite=True)])
    again.model.load_state_dict(trainer.model.state_dict())  # trained on: other losses than the first run's
    again.train()
    second = _logged_losses(again)
    assert second != pytest.approx(first, abs=1e-3)
    assert T.read_tables(out)["steps"][T.LOSS].tolist() == pytest.approx(second, abs=1e-4)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, ValueError])
def test_a_cell_run_again_after_its_train_raised_takes_the_run_by_the_usual_rules(
    tmp_path: Path, stop: type[BaseException]
) -> None:
    """The bare callback's ``train()`` stopped by Ctrl-C or an exception (the Trainer has no hook for it), the
    notebook cell run again with a new model, Trainer and callback on the same ``out``: refused every time, even
    with overwrite=True or resume=True, "a Profiler in this process is still writing this run directory (it is
    attached) ... call that Profiler's detach() first", of a Profiler the user never made and could not reach,
    and the run said "running" (tester t7). The earlier run is saved as stopped, saying why, and the new one
    takes the directory as any run would: refused unless asked, replaced with overwrite=True."""
    out = tmp_path / "run"

    class Stop(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                raise stop()

    def cell(*callbacks: Any, **kw: Any) -> Trainer:
        cb = PrecprofCallback(out=out, sample_every=1, report=False, memory=False, **kw)
        trainers.append(make_trainer(tmp_path, [cb, *callbacks]))
        trainers[-1].train()
        return trainers[-1]

    trainers: list[Trainer] = []
    with pytest.raises(stop):
        cell(Stop())
    assert str(T.read_summary(out)[T.SUMMARY_INCOMPLETE_REASON]).startswith("running (pid")
    said = "is saved as incomplete: its train() did not end (an exception or Ctrl-C in the Trainer's loop"
    with (
        pytest.warns(UserWarning, match=re.escape(said)),
        pytest.raises(RunDirError, match=r"already holds a precprof run \(incomplete\).* overwrite=True"),
    ):
        cell()
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    assert str(summary[T.SUMMARY_INCOMPLETE_REASON]).startswith("its train() did not end")
    assert T.read_tables(out)["steps"][T.STEP].tolist() == [0, 1]
    assert not trainers[0].model._forward_hooks  # the old model trains on without precprof
    cell(overwrite=True)
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert T.read_tables(out)["steps"][T.STEP].tolist() == list(range(STEPS))


def test_profile_trainer_on_a_trainer_with_a_callback_refuses_and_keeps_its_run(tmp_path: Path) -> None:
    """The README's two ways at once: ``Trainer(callbacks=[PrecprofCallback(out)])``, ``train()``, then
    ``profile_trainer(trainer, out)``. It added a second callback: the first one's session claimed (and wiped)
    ``out``, the second's was refused it, and the complete run was left "incomplete", with no step. It is
    refused now before anything runs, naming the fix."""
    out = tmp_path / "run"
    trainer = make_trainer(tmp_path, [PrecprofCallback(out=out, sample_every=1, report=False, memory=False)])
    trainer.train()
    first = _logged_losses(trainer)
    with pytest.raises(
        UserError, match=r"already has a PrecprofCallback .*trainer.remove_callback\(PrecprofCallback\)"
    ):
        profile_trainer(trainer, out=out)
    assert _logged_losses(trainer) == first  # nothing trained
    assert sum(isinstance(c, PrecprofCallback) for c in trainer.callback_handler.callbacks) == 1
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert T.read_tables(out)["steps"][T.LOSS].tolist() == pytest.approx(first, abs=1e-4)


class _Copies(TrainerCallback):  # type: ignore[misc]
    """A copy of the model at each step's end, deep (an EMA's, a "best model so far") and saved whole."""

    def __init__(self) -> None:
        self.copies: list[Any] = []

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.copies.append(copy.deepcopy(model))
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        self.copies.append(torch.load(buf, weights_only=False))


def test_copies_of_the_model_during_training_leave_precprofs_hooks_behind(tmp_path: Path) -> None:
    """The callback's forward hook stays on the model for the whole training, precprof's own between two
    sampled steps: a copy made at any step holds none of them (it held a no-op in place of each), and trains."""
    copies = _Copies()
    trainer = make_trainer(
        tmp_path, [PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False), copies]
    )
    trainer.train()
    assert len(copies.copies) == 2 * STEPS
    batch = TokenData()[0]
    for c in [*copies.copies, trainer.model]:  # the model itself after training: as it was
        dicts = [d for m in c.modules() for d in (m._forward_pre_hooks, m._forward_hooks)]
        assert [h for d in dicts for h in d.values()] == [] and not any(map(vars, dicts))
        c(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()


class _AdamWHoldingAnother(torch.optim.AdamW):
    """A user's AdamW that keeps another optimizer under the attribute ``optimizer`` for a purpose of its own
    (here an SGD over copies of the weights, never stepped): no wrapper, it steps the model's weights itself."""

    def __init__(self, params: Any) -> None:
        params = list(params)
        super().__init__(params, lr=1e-3)
        self.optimizer = torch.optim.SGD([p.detach().clone() for p in params], lr=0.0)


class _ProfiledOptimizer(TrainerCallback):  # type: ignore[misc]
    """The optimizer the callback's Profiler holds, read at each step's end (after the callback's own)."""

    def __init__(self, cb: PrecprofCallback) -> None:
        self.cb = cb
        self.optimizer: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.optimizer = self.cb.profiler.optimizer


class _NewHead(TrainerCallback):  # type: ignore[misc]
    """A new output head in place of GPT-2's tied one when training begins, after the optimizer was built."""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        model.lm_head = torch.nn.Linear(N_EMBD, VOCAB, bias=False)


@pytest.mark.parametrize("own", [False, True], ids=["trainers", "users_with_an_optimizer_attribute"])
def test_the_profiler_is_given_the_optimizer_that_steps_the_weights(tmp_path: Path, own: bool) -> None:
    """The Trainer hands callbacks accelerate's AcceleratedOptimizer: the Profiler is given the optimizer inside
    it. A user's optimizer with an attribute named ``optimizer`` is that optimizer, not a wrapper of the one the
    attribute holds: the callback went down it to an SGD that never stepped, and the run had no weight updates.
    The user's run also puts a new head in place of the tied one once the optimizer was built: it gets gradients
    and is never updated, and ``gradients_not_applied`` names it (the Trainer's own optimizer, over every parameter
    with the head tied to the embedding, holds them all: nothing is said)."""
    from accelerate.optimizer import AcceleratedOptimizer

    from precprof.analysis.advisor import recommend

    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, memory=False, report=False)
    seen = _ProfiledOptimizer(cb)
    model = tiny_gpt2()
    opt = _AdamWHoldingAnother(model.parameters()) if own else None
    targs = training_args(tmp_path, max_steps=2)
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=TokenData(),
        callbacks=[_NewHead(), cb, seen] if own else [cb, seen],
        optimizers=(opt, None),
    )
    trainer.train()
    loose = T.read_summary(cb.run_dir)[T.SUMMARY_CAPTURE].get("trainable_not_in_optimizer")
    assert loose == ({"lm_head": ["weight"]} if own else None), loose
    if own:
        f = recommend(cb.run_dir).finding("gradients_not_applied")
        assert f is not None and f.modules == ["lm_head"] and f.numbers["steps"] == 2, f
    assert isinstance(trainer.optimizer, AcceleratedOptimizer)
    assert seen.optimizer is trainer.optimizer.optimizer
    assert seen.optimizer is opt if own else type(seen.optimizer) is torch.optim.AdamW
    # its steps were read: every Conv1D's weight moved on both steps
    layers = T.read_tables(cb.run_dir)["layers"]
    upd = layers[(layers[T.TENSOR] == T.WEIGHT_UPDATE) & (layers[T.PARAM] == "weight")]
    for name, mod in model.named_modules():
        if isinstance(mod, Conv1D):
            rows = upd[upd[T.MODULE] == name]
            assert rows[T.STEP].tolist() == [0, 1] and (rows[T.UPDATE_RMS] > 0).all(), name


class _LossOutsideTheModel(Trainer):  # type: ignore[misc]
    """A Trainer computing the loss itself from the model's logits; under the callback's ``profiler.memory_scope()``
    when given the callback, as the report tells a Trainer user to."""

    def __init__(self, *args: Any, precprof_cb: Any = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.precprof_cb = precprof_cb

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1].float().reshape(-1, VOCAB)
        scope = self.precprof_cb.profiler.memory_scope() if self.precprof_cb is not None else nullcontext()
        with scope:
            loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
        return (loss, outputs) if return_outputs else loss


@pytest.mark.skipif(not _render_available(), reason="report extra")
def test_the_memory_section_tells_a_trainer_user_how_to_count_the_loss(tmp_path: Path) -> None:
    """A loss the Trainer's compute_loss computes outside the model's forward is not in the activations: the report
    names the callback's profiler (the user holds no ``prof``), and that call counts the loss: cross-entropy keeps
    its fp32 log-softmax, batch x (seq - 1) x vocab floats."""
    for scoped in (False, True):
        cb = PrecprofCallback(out=tmp_path / f"run{scoped}", sample_every=1)
        targs = training_args(tmp_path, max_steps=2)
        trainer = _LossOutsideTheModel(
            model=tiny_gpt2(),
            args=targs,
            train_dataset=TokenData(),
            callbacks=[cb],
            precprof_cb=cb if scoped else None,
        )
        trainer.train()
        assert cb.report_path is not None
        page = cb.report_path.read_text()
        mem = T.read_tables(cb.run_dir)["memory"]
        in_loss = mem[
            (mem[T.COMPONENT] == T.ACTIVATIONS) & (mem[T.MODULE] == "(loss)") & (mem[T.DTYPE] == "float32")
        ]
        if scoped:
            assert len(in_loss) and (in_loss[T.BYTES] >= BATCH * (SEQ - 1) * VOCAB * 4).all()
            assert 'id="memory-loss"' not in page
        else:
            assert in_loss.empty
            assert 'id="memory-loss"' in page and "precprof_cb.profiler.memory_scope()" in page
            assert "compute_loss" in page and "with prof.memory_scope()" not in page


@pytest.mark.parametrize(
    ("kw", "error", "said"),
    [
        (
            {"sample_evry": 1},
            TypeError,
            "PrecprofCallback(sample_evry=...) is not a precprof.Profiler argument "
            "(did you mean sample_every?); they are: sample_every, overhead_budget, ",
        ),
        ({"sample_every": -1}, ValueError, "PrecprofCallback(sample_every=-1): expected a whole number >= 0"),
        ({"update_sample": 0}, ValueError, "PrecprofCallback(update_sample=0): expected a whole number >= 1"),
        ({"modules": [3]}, TypeError, "PrecprofCallback(modules=[3]): 3 is neither a name pattern"),
        (
            {"first_step": 3},
            TypeError,
            "PrecprofCallback(first_step=...): the callback gives the Profiler the Trainer's step",
        ),
        # (refused only at trainer.train(), after the Trainer was set up, in words that named no callback)
        (
            {"tensorboard": 3},
            TypeError,
            "PrecprofCallback(tensorboard=3): expected a log directory or a torch.utils.tensorboard.SummaryWriter",
        ),
        ({"wandb": 3}, TypeError, "PrecprofCallback(wandb=3): expected True (the current wandb.run)"),
    ],
)
def test_a_profiler_argument_the_callback_cannot_pass_on_is_refused_when_it_is_made(
    kw: dict[str, Any], error: type[Exception], said: str, tmp_path: Path
) -> None:
    """A typo (``sample_evry=1``) or a bad value was taken by the callback and failed only in
    ``trainer.train()`` (``update_sample=0``: a ZeroDivisionError 14 frames deep), a run directory left behind.
    Checked as the Profiler checks them, where the callback is made."""
    with pytest.raises(error) as e:
        PrecprofCallback(out=tmp_path / "run", report=False, **kw)
    assert str(e.value).startswith(said) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_the_callbacks_own_arguments_are_checked_when_it_is_made() -> None:
    """``out=123`` was pathlib's TypeError naming no argument; ``report="yes"`` was taken (tester t8)."""
    with pytest.raises(TypeError) as e:
        PrecprofCallback(out=123)
    assert (
        str(e.value)
        == "PrecprofCallback(out=123): expected a run directory's path (a str or a Path), got int"
    )
    with pytest.raises(TypeError) as e:
        PrecprofCallback(report="yes")
    assert str(e.value) == "PrecprofCallback(report='yes'): expected True or False, got str"
    assert PrecprofCallback(out="runs/x", report=0).report is False


def test_the_callback_takes_one_module_pattern_alone(tmp_path: Path) -> None:
    cb = PrecprofCallback(
        out=tmp_path / "run", sample_every=1, report=False, memory=False, modules="transformer.h.0.mlp.*"
    )
    make_trainer(tmp_path, callbacks=[cb]).train()
    modules = set(T.read_tables(tmp_path / "run")["layers"][T.MODULE])
    assert modules and all(m.startswith("transformer.h.0.mlp.") for m in modules), modules
