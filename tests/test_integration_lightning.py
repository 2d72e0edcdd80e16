"""Lightning Trainer + PrecprofCallback on the CPU: bf16-mixed (report), bf16-true, gradient accumulation, crash."""

from __future__ import annotations

import copy
import importlib.util
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from cast_counts import CastCounts  # noqa: E402

from precprof import tables as T  # noqa: E402
from precprof.analysis import update_ratio  # noqa: E402
from precprof.integrations.lightning import (  # noqa: E402
    TOKENS_UNKNOWN,
    PrecprofCallback,
    precprof_precision,
)
from precprof.report import summarize  # noqa: E402
from precprof.report.context import _headline  # noqa: E402
from precprof.report.environment import config_rows  # noqa: E402
from precprof.rundir import RunDirError  # noqa: E402

VOCAB, SEQ, BATCH, HID = 32, 8, 4, 16


class TinyLM(L.LightningModule):
    """Embedding -> Linear -> GELU -> Linear over tokens; remembers the losses training_step returned."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Embedding(VOCAB, HID), nn.Linear(HID, 2 * HID), nn.GELU(), nn.Linear(2 * HID, VOCAB)
        )
        self.losses: list[float] = []
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at is not None and batch_idx == self.fail_at:
            raise RuntimeError(f"boom at batch {batch_idx}\n  (its second line)")
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    y = torch.roll(x, -1, dims=1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def quiet_trainer(
    tmp_path: Path, cb: PrecprofCallback, *more: Any, before: Sequence[Any] = (), **kw: Any
) -> Any:
    """A CPU Trainer without logger, progress bar or summary, and without checkpoints unless ``more`` callbacks
    (a ModelCheckpoint) come after ``cb``; ``before``: callbacks that run before it; ``kw`` add to these (or
    replace ``enable_checkpointing``)."""
    kw.setdefault("enable_checkpointing", bool(more))
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[*before, cb, *more],
        **kw,
    )


def fit(tmp_path: Path, precision: str, cb: PrecprofCallback, module: TinyLM, **kw: Any) -> Any:
    trainer = quiet_trainer(tmp_path, cb, max_steps=4, precision=precision, **kw)
    trainer.fit(module, loader())
    return trainer


def test_bf16_mixed_produces_a_report(tmp_path: Path) -> None:
    cb = PrecprofCallback(sample_every=2)
    module = TinyLM()
    fit(tmp_path, "bf16-mixed", cb, module)
    run_dir = cb.run_dir
    assert run_dir == tmp_path / "precprof" and T.is_run_dir(run_dir)
    summary = T.read_summary(run_dir)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert summary[T.SUMMARY_CONFIG]["precision"] == "bf16"
    assert summary[T.SUMMARY_CONFIG]["lightning_precision"] == "bf16-mixed"
    assert summary[T.SUMMARY_CAPTURE]["mixed_precision_active"] is True
    tables = T.read_tables(run_dir)
    layers, steps = tables["layers"], tables["steps"]
    assert steps[T.STEP].tolist() == [0, 1, 2, 3]
    assert steps[T.LOSS].tolist() == pytest.approx(module.losses, rel=0, abs=0)
    assert (steps[T.TOKENS] == BATCH * SEQ).all()
    for name in ("net.1", "net.3"):  # the Linears: autocast ran them in bf16
        for step in (0, 2):
            rows = layers[(layers[T.MODULE] == name) & (layers[T.STEP] == step)]
            assert {T.ACTIVATION, T.ACTIVATION_GRAD, T.WEIGHT, T.WEIGHT_GRAD, T.WEIGHT_UPDATE} <= set(
                rows[T.TENSOR]
            )
            act = rows[rows[T.TENSOR] == T.ACTIVATION].iloc[0]
            assert act[T.DTYPE] == "bfloat16"
            out_features = module.net[int(name[-1])].out_features
            assert act[T.NUMEL] == BATCH * SEQ * out_features
    if importlib.util.find_spec("precprof.report.render") is not None:
        assert cb.report_path is not None and cb.report_path.exists()
        # the Run section says the autocast the hooks saw: the callback's configuration has no plan to say it
        # (it said "bf16: no autocast")
        page = cb.report_path.read_text()
        assert "precision</th><td>bf16: autocast to bfloat16; no loss scaling" in page
        # what was asked for, in precprof's words and in Lightning's
        assert "Asked for <strong>bf16</strong> (Lightning&#39;s precision=&#34;bf16-mixed&#34;)." in page


def test_bf16_true_holds_weights_in_bf16_and_accumulates(tmp_path: Path) -> None:
    """bf16-true: parameters in bf16 (precprof's bf16-pure); 2 micro-batches per optimizer step."""
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False, memory=False)
    module = TinyLM()
    fit(tmp_path, "bf16-true", cb, module, accumulate_grad_batches=2)
    summary = T.read_summary(cb.run_dir)
    assert summary[T.SUMMARY_CONFIG]["precision"] == "bf16-pure"
    assert (
        summarize.asked_as(summary) == 'Lightning\'s precision="bf16-true"'
    )  # the report's "Asked for bf16-pure"
    tables = T.read_tables(cb.run_dir)
    steps, layers = tables["steps"], tables["layers"]
    assert steps[T.STEP].tolist() == [0, 1, 2, 3]
    # the loss of an optimizer step is the mean over its micro-batches
    pairs = [(module.losses[2 * i] + module.losses[2 * i + 1]) / 2 for i in range(4)]
    assert steps[T.LOSS].tolist() == pytest.approx(pairs, rel=1e-6)
    assert (steps[T.TOKENS] == 2 * BATCH * SEQ).all()
    weights = layers[layers[T.TENSOR] == T.WEIGHT]
    assert set(weights[T.DTYPE]) == {"bfloat16"}
    acts = layers[(layers[T.TENSOR] == T.ACTIVATION) & (layers[T.MODULE] == "net.1")]
    assert (acts[T.CALLS] == 2).all()  # both micro-batches in the step's row
    assert (acts[T.NUMEL] == 2 * BATCH * SEQ * 2 * HID).all()


def test_exception_writes_an_incomplete_run(tmp_path: Path) -> None:
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False, memory=False)
    with pytest.raises(RuntimeError, match="boom at batch 2"):
        fit(tmp_path, "bf16-mixed", cb, TinyLM(fail_at=2))
    summary = T.read_summary(tmp_path / "run")
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    # one line, as a with block's Profiler and profile_trainer say it (capture.unsaved.cause)
    assert summary[T.SUMMARY_INCOMPLETE_REASON] == "RuntimeError: boom at batch 2 (its second line)"
    assert T.read_tables(tmp_path / "run")["steps"][T.STEP].tolist() == [0, 1]
    assert cb.profiler is None


class BlockLM(TinyLM):
    """Batches are (B, T + 1) blocks of ids: training_step feeds the first T to the model, the last T are targets."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step((batch[:, :-1], batch[:, 1:]), batch_idx)


def test_tokens_are_the_ids_fed_to_the_model(tmp_path: Path) -> None:
    """16 blocks of 64 + 1 ids: 1024 tokens fed a step, not the 1040 ids of the batch (target column included)."""
    rows, seq = 16, 64
    blocks = torch.randint(0, VOCAB, (4 * rows, seq + 1), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(blocks, batch_size=rows)  # type: ignore[arg-type]
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=100, report=False, memory=False)
    module = BlockLM()
    trainer = quiet_trainer(tmp_path, cb, max_steps=2, accumulate_grad_batches=2)
    trainer.fit(module, data)
    steps = T.read_tables(cb.run_dir)["steps"]
    assert steps[T.TOKENS].tolist() == [2 * rows * seq] * 2  # 2 micro-batches of 1024 tokens fed
    pairs = [(module.losses[2 * i] + module.losses[2 * i + 1]) / 2 for i in range(2)]
    assert steps[T.LOSS].tolist() == pytest.approx(pairs, rel=1e-6)
    assert not module.net[0]._forward_pre_hooks  # the token-embedding hook is removed at the end


def test_token_embedding_is_the_vocabulary_not_the_positions() -> None:
    from precprof.integrations.lightning import token_embedding

    model = nn.ModuleDict(
        {"pos": nn.Embedding(16, 8), "tok": nn.Embedding(100, 8), "head": nn.Linear(8, 100)}
    )
    assert token_embedding(model) is model["tok"]
    assert token_embedding(nn.Linear(2, 2)) is None
    # a character-level model: 65 tokens, 256 positions; its position table is told by its name (untied), or by
    # the head sharing the token table's weight (tied, whatever the names)
    chars = nn.ModuleDict(
        {"wpe": nn.Embedding(256, 8), "wte": nn.Embedding(65, 8), "lm_head": nn.Linear(8, 65)}
    )
    assert token_embedding(chars) is chars["wte"]
    tied = nn.ModuleDict({"a": nn.Embedding(256, 8), "b": nn.Embedding(65, 8), "head": nn.Linear(8, 65)})
    tied["head"].weight = tied["b"].weight
    assert token_embedding(tied) is tied["b"]
    assert token_embedding(nn.ModuleDict({"pos_emb": nn.Embedding(4, 2)})) is not None  # the only one
    # a position name is the module's own, not its parent's: composer.tok_emb is the vocabulary (reviewer h93)
    composer = nn.ModuleDict({"tok_emb": nn.Embedding(512, 8), "head": nn.Linear(8, 512)})
    music = nn.ModuleDict({"composer": composer, "instrument_emb": nn.Embedding(16, 8)})
    assert token_embedding(music) is composer["tok_emb"]


def test_precision_names() -> None:
    assert [precprof_precision(p) for p in ("16-mixed", "bf16-mixed", "bf16-true", "32-true", "64")] == [
        "fp16",
        "bf16",
        "bf16-pure",
        "fp32",
        "64",
    ]


def test_counts_are_real_casts_and_training_is_unchanged(tmp_path: Path) -> None:
    """bf16-mixed on a LightningModule: the Linears' outputs and output gradients, counted by independent hooks
    with real casts on every sampled step, equal precprof's rows; the losses and final weights are bitwise those
    of the same Trainer without the callback (the independent hooks run in both)."""
    runs: dict[str, tuple[CastCounts, TinyLM]] = {}
    for name in ("plain", "profiled"):
        module = TinyLM()
        check = CastCounts(module, (nn.Linear,), lambda m=module: m.global_step, 2)
        callbacks = (
            [PrecprofCallback(out=tmp_path / "run", sample_every=2, report=False)]
            if name == "profiled"
            else []
        )
        trainer = L.Trainer(
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path / name),
            callbacks=callbacks,
            max_steps=4,
            precision="bf16-mixed",
        )
        torch.manual_seed(0)
        trainer.fit(module, loader())
        runs[name] = (check, module)
    (plain, m_plain), (check, m_prof) = runs["plain"], runs["profiled"]
    assert m_plain.losses == m_prof.losses and len(m_prof.losses) == 4
    for (k, a), b in zip(m_plain.state_dict().items(), m_prof.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert (
        plain.seen == check.seen and len(check.seen) == 2 * 2 * 2
    )  # steps 0, 2 x net.1, net.3 x (out, grad)
    layers = T.read_tables(tmp_path / "run")["layers"]
    assert {s for s, _, _ in check.seen} == {0, 2} == set(layers[T.STEP])
    check.compare(layers)


def test_a_module_the_user_compiled_is_recorded_and_trains_the_same(tmp_path: Path) -> None:
    """``trainer.fit(torch.compile(module))`` (Dynamo's "eager" backend, fast on the CPU): with the callback no
    graph and no graph break beyond those of the run without it (the module's own ``loss.item()`` breaks its
    graph; sampled steps run eagerly, so they compile nothing), the same losses, and each Linear's output, output
    gradient and weight gradient recorded on the sampled steps."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    got = {}
    for name in ("plain", "profiled"):
        torch._dynamo.reset()
        counters.clear()
        module = TinyLM()
        cb = PrecprofCallback(out=tmp_path / "run", sample_every=2, report=False)
        trainer = quiet_trainer(tmp_path / name, cb, max_steps=4, precision="bf16-mixed")
        if name == "plain":
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, PrecprofCallback)]
        trainer.fit(torch.compile(module, backend="eager"), loader())
        got[name] = (
            int(counters["stats"]["unique_graphs"]),
            int(sum(counters["graph_break"].values())),
            list(module.losses),
        )
    (graphs, breaks, losses), (graphs_p, breaks_p, losses_p) = got["plain"], got["profiled"]
    assert 0 < graphs_p <= graphs and breaks_p <= breaks
    assert losses_p == losses and len(losses) == 4
    layers = T.read_tables(tmp_path / "run")["layers"]
    lin = layers[layers[T.MODULE_TYPE] == "Linear"]
    for kind in (T.ACTIVATION, T.ACTIVATION_GRAD, T.WEIGHT_GRAD):
        rows = lin[lin[T.TENSOR] == kind]
        assert set(rows[T.STEP]) == {0, 2}, kind
        assert set(rows[T.MODULE]) == {"net.1", "net.3"}, kind


class LlamaLM(L.LightningModule):
    """A transformers Llama; ``rebuild_rope``: its rotary embedding built again in on_fit_start, as the advisor's
    remedy for Lightning's "bf16-true" says."""

    def __init__(self, rebuild_rope: bool) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HID,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
        self.model = LlamaForCausalLM(cfg)
        self.rebuild_rope = rebuild_rope

    def on_fit_start(self) -> None:
        rope = self.model.model.rotary_emb
        assert rope.inv_freq.dtype == torch.bfloat16  # Lightning cast the whole module before this hook
        if self.rebuild_rope:
            self.model.model.rotary_emb = type(rope)(rope.config).to(rope.inv_freq.device)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("rebuild_rope", [False, True])
def test_bf16_true_rounds_rotary_frequencies_and_the_remedy_keeps_them(
    tmp_path: Path, rebuild_rope: bool
) -> None:
    """precision="bf16-true" casts a Llama with .to(), its rotary frequencies included, whatever loaded it: the
    finding's remedy says where to rebuild them (on_fit_start, after Lightning's cast), and done so, the next run
    has no 16-bit buffer and no finding."""
    pytest.importorskip("transformers")
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, memory=False, report=False)
    module = LlamaLM(rebuild_rope)
    fit(tmp_path, "bf16-true", cb, module)
    summary = T.read_summary(cb.run_dir)
    found = {f["code"]: f for f in summary[T.SUMMARY_RECOMMENDATION]["findings"]}
    if rebuild_rope:
        assert module.model.model.rotary_emb.inv_freq.dtype == torch.float32
        assert summary[T.SUMMARY_CAPTURE]["low_precision_buffers"] == [] and "low_precision_rope" not in found
        return
    f = found["low_precision_rope"]
    assert f["modules"] == ["model.model.rotary_emb"]
    assert 'Lightning\'s precision="bf16-true" casts the whole module' in f["remedy"]
    assert "on_fit_start" in f["remedy"] and "type(m)(m.config)" in f["remedy"]


class _Sliced(nn.Module):
    """The net fed the first T ids of a (B, T + 1) block it is given whole: the ids it looks up are made inside."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, block: torch.Tensor) -> torch.Tensor:
        return self.net(block[:, :-1])  # type: ignore[no-any-return]


class CompiledBlockLM(TinyLM):
    """(B, T + 1) blocks of ids; the model a compiled submodule (``self.fwd``, Dynamo's "eager" backend) fed the
    first T (``inside=False``), or fed the whole block, slicing it inside the compiled code (``inside=True``)."""

    def __init__(self, inside: bool) -> None:
        super().__init__()
        self.inside = inside
        self.fwd = torch.compile(_Sliced(self.net) if inside else self.net, backend="eager")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.fwd(batch if self.inside else batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))


@pytest.mark.parametrize("inside", [False, True])
def test_tokens_of_a_model_compiled_before_the_fit_are_the_ids_fed_or_unknown(
    tmp_path: Path, inside: bool
) -> None:
    """A model whose compiled graph was made before the fit (its forward run once, as a notebook's earlier cell
    does): Dynamo does not guard on module hooks, so the callback's embedding hook ran on the sampled (eager)
    steps alone, and the compiled steps counted the whole batch, targets too: 4 x 9 ids for the 4 x 8 fed,
    tokens/s 1/8 too high (tester h74). Now they count the compiled wrapper's input that the embedding looked
    up on the eager steps; where the ids are made inside the compiled code, no input outside says how many, and
    the steps' tokens are unknown, said once and in ``capture.tokens_unknown``, never the batch's."""
    import torch._dynamo

    torch._dynamo.reset()
    blocks = torch.randint(0, VOCAB, (4 * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    module = CompiledBlockLM(inside)
    module.fwd(blocks[:BATCH] if inside else blocks[:BATCH, :-1])  # compiled, before the callback's hook
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=2, report=False, memory=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_trainer(tmp_path, cb, max_steps=4).fit(module, torch.utils.data.DataLoader(blocks, BATCH))
    finally:
        torch._dynamo.reset()
    said = [str(w.message) for w in caught if "tokens" in str(w.message) and "precprof" in str(w.message)]
    steps = T.read_tables(cb.run_dir)["steps"]
    assert steps[T.SAMPLED].tolist() == [True, False, True, False]
    unknown = T.read_summary(cb.run_dir)[T.SUMMARY_CAPTURE].get("tokens_unknown")
    if not inside:
        assert steps[T.TOKENS].tolist() == [BATCH * SEQ] * 4
        assert not said and unknown is None
        return
    assert steps[T.TOKENS][[0, 2]].tolist() == [BATCH * SEQ] * 2
    assert steps[T.TOKENS][[1, 3]].isna().all()
    assert said == [f"precprof: the tokens of step 1 are not known: {TOKENS_UNKNOWN}"]
    assert unknown == {"first_step": 1, "steps": 2, "why": TOKENS_UNKNOWN}
    head = dict(_headline(T.read_summary(cb.run_dir), steps, pd.DataFrame()))  # the report's headline
    assert head["tokens not known"] == f"on 2 steps from step 1: {TOKENS_UNKNOWN}"


class TwoOptimizerLM(TinyLM):
    """TinyLM with its embedding stepped by one AdamW and its Linears by another, in manual optimization (as a
    GAN's two networks, or Muon beside AdamW); ``groups``: one AdamW with the same two parameter groups (the
    same update per element) instead."""

    def __init__(self, groups: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.groups = groups

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        return loss

    def configure_optimizers(self) -> Any:
        embedding = list(self.net[0].parameters())
        linears = [p for m in self.net[1:] for p in m.parameters()]
        if self.groups:
            return torch.optim.AdamW([{"params": embedding}, {"params": linears}], lr=1e-2)
        return [torch.optim.AdamW(embedding, lr=1e-2), torch.optim.AdamW(linears, lr=1e-2)]


def test_two_optimizers_each_sample_the_updates_of_the_parameters_they_step(tmp_path: Path) -> None:
    """The callback attached the first optimizer alone: the Linears, which the second steps, had every
    sampled update counted as intended and never landed ("lost in bf16"), in an fp32 run. Every optimizer is
    attached now, and the weight-update rows are those of one AdamW with the same two parameter groups. Two
    optimizers advance Lightning's global_step twice a batch, and each batch was two steps, the second with no
    forward pass, loss or tokens (sampled empty, timed at nothing): one step a batch now."""
    rows = {}
    for groups in (False, True):
        cb = PrecprofCallback(out=tmp_path / f"run{groups}", sample_every=1, report=False, memory=False)
        quiet_trainer(tmp_path, cb, max_steps=4 if not groups else 2).fit(TwoOptimizerLM(groups), loader())
        tables = T.read_tables(cb.run_dir)
        steps, layers = tables["steps"], tables["layers"]
        assert (
            steps[T.STEP].tolist() == [0, 1] and steps[T.LOSS].notna().all() and steps[T.TOKENS].notna().all()
        )
        assert sorted(set(layers[T.STEP])) == [0, 1]
        got = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE].astype({T.MODULE: str, T.PARAM: str})
        cols = [T.MODULE, T.PARAM, T.NUMEL, T.ZEROS, T.LOST_UPDATE_BF16, T.LOST_UPDATE_FP16]
        rows[groups] = (
            got[cols].sort_values(cols[:2], kind="stable").reset_index(drop=True)
        )  # two optimizer steps a batch
        # Lightning's max_steps counts the steps of each optimizer: "max steps 4" stood beside "steps 2" with
        # nothing to say why (tester h74)
        said = dict(config_rows(T.read_summary(cb.run_dir)[T.SUMMARY_CONFIG]))["max steps"]
        assert said == (
            "2"
            if groups
            else "4 (Lightning's count of optimizer steps, one per step of each of the 2 optimizers; precprof "
            "counts one step per batch)"
        )
    assert set(rows[False][T.MODULE]) == {"net.0", "net.1", "net.3"}
    pd.testing.assert_frame_equal(rows[False], rows[True])


class _SwitchToSGD(L.Callback):  # type: ignore[misc]
    """Sets SGD as the trainer's optimizer at the start of batch ``at`` (a switch of optimizer mid-fit)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            trainer.optimizers = [torch.optim.SGD(pl_module.parameters(), lr=0.1, momentum=0.9)]


@pytest.mark.parametrize("switch_first", [True, False])
def test_an_optimizer_set_on_the_trainer_mid_fit_is_followed(tmp_path: Path, switch_first: bool) -> None:
    """A callback that sets SGD as the trainer's optimizer at batch 2: precprof's hooks stayed on AdamW's step,
    so no update of steps 2 and 3 was sampled and the summary named AdamW. SGD is followed now, from the step
    it first steps in when the switch comes before precprof's callback, else from the next one (the switch at
    batch 2 is seen at its end: its step reads no update); the summary names SGD and says from which step."""
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False, memory=False)
    switch = _SwitchToSGD(at=2)
    after = () if switch_first else (switch,)
    before = (switch,) if switch_first else ()
    trainer = quiet_trainer(tmp_path, cb, *after, before=before, enable_checkpointing=False, max_steps=4)
    module = TinyLM()
    trainer.fit(module, loader())
    assert type(trainer.optimizers[0]).__name__ == "SGD"
    layers = T.read_tables(cb.run_dir)["layers"]
    updates = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE]
    n_params = len(list(module.parameters()))
    per_step = updates.groupby(T.STEP).size().to_dict()
    assert per_step == (
        {0: n_params, 1: n_params, 2: n_params, 3: n_params}
        if switch_first
        else {0: n_params, 1: n_params, 3: n_params}
    )
    capture = T.read_summary(cb.run_dir)[T.SUMMARY_CAPTURE]
    assert capture["optimizer"]["class"] == "SGD"
    assert capture["optimizer_changes"] == [{"step": 2, "from": "AdamW", "to": "SGD"}]


class _SwitchToSGDAtBatchEnd(L.Callback):  # type: ignore[misc]
    """Sets SGD as the trainer's optimizer at the end of batch ``at``, once AdamW stepped in it."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.states: dict[int, int] = {}  # the bytes of the states of the optimizer that stepped, per batch

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        opt = trainer.optimizers[0]
        self.states[batch_idx] = sum(
            t.nbytes for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)
        )
        if batch_idx == self.at:
            trainer.optimizers = [torch.optim.SGD(pl_module.parameters(), lr=0.1, momentum=0.9)]


def test_an_optimizer_set_at_the_end_of_a_batch_that_stepped_is_followed_from_the_next(
    tmp_path: Path,
) -> None:
    """A callback before precprof's sets SGD at the end of batch 1, after AdamW stepped in it: step 1 lost its
    AdamW update rows and its states in the memory table, and the switch was dated 1. Now step 1 keeps them
    (AdamW's two moments and step counter, counted by hand) and the switch is dated 2, SGD's first step."""
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False, memory_every=1)
    switch = _SwitchToSGDAtBatchEnd(at=1)
    trainer = quiet_trainer(tmp_path, cb, before=[switch], max_steps=4)
    module = TinyLM()
    trainer.fit(module, loader())
    tables = T.read_tables(cb.run_dir)
    layers = tables["layers"]
    updates = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE]
    n_params = len(list(module.parameters()))
    assert updates.groupby(T.STEP).size().to_dict() == {0: n_params, 1: n_params, 2: n_params, 3: n_params}
    memory = tables["memory"]
    held = memory[memory[T.COMPONENT] == T.OPTIMIZER_STATES].groupby(T.STEP)[T.BYTES].sum()
    assert {s: int(held[s]) for s in range(4)} == switch.states
    capture = T.read_summary(cb.run_dir)[T.SUMMARY_CAPTURE]
    assert capture["optimizer_changes"] == [{"step": 2, "from": "AdamW", "to": "SGD"}]


class TinyLMThenSGD(TinyLM):
    """TinyLM whose optimizer is AdamW, then SGD with momentum once ``sgd`` is set (a second fit that makes its
    optimizer anew, as Lightning calls ``configure_optimizers`` again for each fit)."""

    sgd = False

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return super().configure_optimizers()


def test_a_second_fit_with_another_optimizer_says_so_in_the_run_it_continues(tmp_path: Path) -> None:
    """A fit of 4 steps with AdamW, then a second fit of the same trainer on to 6, for which the module makes
    SGD: the run it continues named SGD alone, as if every step had been SGD's. It says AdamW was switched for
    SGD at step 4, and steps 4 and 5 have their weight updates sampled around SGD's steps."""
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False, memory=False, resume=True)
    trainer = quiet_trainer(tmp_path, cb, max_steps=4)
    module = TinyLMThenSGD()
    trainer.fit(module, loader())
    module.sgd = True
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(module, loader())
    assert type(trainer.optimizers[0]).__name__ == "SGD" and trainer.global_step == 6
    capture = T.read_summary(cb.run_dir)[T.SUMMARY_CAPTURE]
    assert capture["optimizer"]["class"] == "SGD"
    assert capture["optimizer_changes"] == [{"step": 4, "from": "AdamW", "to": "SGD"}]
    layers = T.read_run(cb.run_dir).tables["layers"]
    assert sorted(set(layers.loc[layers[T.TENSOR] == T.WEIGHT_UPDATE, T.STEP])) == list(range(6))


@pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.parametrize("profiled_first", [True, False])
@pytest.mark.parametrize("groups", [False, True])
def test_a_run_resumed_from_a_checkpoint_counts_batches_not_optimizer_steps(
    tmp_path: Path, groups: bool, profiled_first: bool
) -> None:
    """Fit 4 batches with a checkpoint every 2, then fit on from the one after batch 2 with ``resume=True``: the
    resumed attempt replaces steps 2 and 3 and goes on to 5. With two optimizers Lightning's global_step counts
    two a batch, and the resumed attempt started at step 4: steps 2-3 never replaced, a gap where there was none.
    A checkpoint saved without the callback has no step of precprof's: Lightning's count of the batches that
    stepped numbers the resumed fit, 2-5."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    per_batch = 1 if groups else 2  # global_step per batch
    out = tmp_path / "run"
    for attempt, (batches, ckpt) in enumerate(
        ((4, None), (6, tmp_path / "ckpt" / f"step={2 * per_batch}.ckpt"))
    ):
        cb = PrecprofCallback(out=out, sample_every=1, report=False, memory=False, resume=attempt > 0)
        every = ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=2 * per_batch, save_top_k=-1, filename="{step}"
        )
        trainer = L.Trainer(
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
            max_steps=batches * per_batch,
            callbacks=[cb, every] if attempt > 0 or profiled_first else [every],
        )
        trainer.fit(TwoOptimizerLM(groups), loader(), ckpt_path=ckpt)
    read = T.read_run(out)
    steps = read.tables["steps"]
    if not profiled_first:
        assert steps[T.STEP].tolist() == [2, 3, 4, 5]
        return
    assert steps[T.STEP].tolist() == list(range(6)) and read.restarts == [2]
    assert steps[T.LOSS].notna().all() and steps[T.TOKENS].notna().all()


class SilentManualLM(TwoOptimizerLM):
    """Manual optimization whose training_step logs its loss and returns nothing, as many examples do."""

    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)


def test_a_training_step_that_returns_nothing_is_said_to_have_no_loss(tmp_path: Path) -> None:
    """No loss reached the callback: the steps have none (no divergence), and the report says why, where the
    curve was empty without a word."""
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, memory=False)
    quiet_trainer(tmp_path, cb, max_steps=2).fit(SilentManualLM(groups=True), loader())
    steps = T.read_tables(cb.run_dir)["steps"]
    assert T.flags(steps[T.NO_LOSS]).all() and len(steps) == 2
    page = (cb.run_dir / T.REPORT_FILE).read_text()
    assert (
        "No loss was recorded: the loop passed none" in page
        and "a training_step that returns nothing" in page
    )


def test_the_norm_lightning_clips_by_is_recorded(tmp_path: Path) -> None:
    """With ``gradient_clip_val`` Lightning clips through torch.nn.utils.clip_grad_norm_, whose return the
    Profiler records (integrations.md said no gradient norm is recorded under Lightning): the norm of the
    accumulated gradients before clipping, read by a callback of our own in ``on_before_optimizer_step``."""
    norms: list[float] = []

    class Probe(L.Callback):  # type: ignore[misc]
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norms.append(
                float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            )

    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False, memory=False)
    trainer = quiet_trainer(
        tmp_path, cb, max_steps=4, precision="bf16-mixed", gradient_clip_val=0.5, accumulate_grad_batches=2
    )
    trainer.callbacks.append(Probe())
    trainer.fit(TinyLM(), loader())
    assert T.read_tables(cb.run_dir)["steps"][T.GRAD_NORM].tolist() == norms and len(norms) == 4


class SlowValidationLM(TinyLM):
    """A validation loop of 1 s (two batches of 0.5 s) after every second training batch."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        time.sleep(0.5)


def test_validation_is_not_the_next_steps_time(tmp_path: Path) -> None:
    """The callback steps the Profiler when a training batch ends; Lightning then validates, and that time
    landed in the next step's ``time_s``: with validation every 4 steps and sampling every 4, a report blamed
    precprof for 96% of the run's time, and the budget sampler stopped sampling. The validation loop is left
    out of step times."""
    cb = PrecprofCallback(sample_every=2, report=False)
    trainer = quiet_trainer(
        tmp_path, cb, max_steps=4, val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0
    )
    trainer.fit(SlowValidationLM(), loader(), loader())
    steps = T.read_tables(cb.run_dir)["steps"]
    assert steps[T.STEP].tolist() == [0, 1, 2, 3]
    # the validation after step 1 took 1 s; a step of this model takes milliseconds, under load a few tenths
    assert steps[T.TIME_S][2] < 1.0, steps[T.TIME_S].tolist()


class SkippingLM(TinyLM):
    """Returns None for the batches in ``skip`` (Lightning's way to skip a batch: no forward, no backward);
    ``by_batch``: the loss of every other batch, by batch index."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip = skip
        self.by_batch: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:  # type: ignore[override]
        if batch_idx in self.skip:
            return None
        loss = super().training_step(batch, batch_idx)
        self.by_batch[batch_idx] = self.losses[-1]
        return loss


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
def test_a_skipped_batch_adds_no_loss_and_no_tokens_to_its_step(tmp_path: Path) -> None:
    """Batches 1 and 2 return None under ``accumulate_grad_batches=2``: the steps 0 (batches 0, 1) and 1
    (batches 2, 3) trained on one micro-batch each. Their loss was divided by both micro-batches (half the
    loss Lightning logs) and the skipped batch's ids counted as tokens; now each step's loss is the mean over
    the batches that returned one, and its tokens are those of the batches fed to the model.

    Batches 4 and 5, step 2, both return None: Lightning steps AdamW on no gradient, which moves nothing. precprof
    warned "AdamW stepped before the model's forward ... the step before's update ... call prof.step() once per
    optimizer step" to a user who never calls prof.step() (tester h74), and step 2's zero updates counted in each
    layer's median update-to-weight ratio, pulling it down. It is said nothing now, and left out of the ratio
    (its ``weight_update`` rows' ``calls``, the optimizer steps that updated them, are 0)."""
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False, memory=False)
    module = SkippingLM(skip={1, 2, 4, 5})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(tmp_path, cb, max_steps=4, accumulate_grad_batches=2).fit(module, loader())
    assert not [str(w.message) for w in caught if "precprof" in str(w.message)]
    tables = T.read_tables(cb.run_dir)
    steps, layers = tables["steps"], tables["layers"]
    fed = [[0], [3], [], [6, 7]]  # the batches of each step that returned a loss
    trained = [i for i, bs in enumerate(fed) if bs]
    want = [sum(module.by_batch[b] for b in fed[i]) / len(fed[i]) for i in trained]
    assert steps[T.LOSS][trained].tolist() == pytest.approx(want, rel=1e-6)
    assert steps[T.TOKENS][trained].tolist() == [len(fed[i]) * BATCH * SEQ for i in trained]
    assert pd.isna(steps[T.LOSS][2]) and pd.isna(steps[T.TOKENS][2])
    summary = T.read_summary(cb.run_dir)
    assert summary[T.SUMMARY_CAPTURE]["loop_order"] == {}
    updates = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE]
    assert (updates[T.ZEROS] == updates[T.NUMEL])[updates[T.STEP] == 2].all()  # nothing moved
    assert updates.groupby(T.STEP)[T.CALLS].max().tolist() == [1, 1, 0, 1]
    ratios = update_ratio.step_ratios(layers)
    assert sorted(set(ratios[T.STEP])) == [0, 1, 3]
    for r in summary[T.SUMMARY_WEIGHT_UPDATES]["layers"]:
        mine = ratios[ratios[T.MODULE] == r["module"]]["ratio"]
        assert r["steps"] == 3 and r["median"] == pytest.approx(mine.median())


class AccumulatingLM(TinyLM):
    """Manual optimization stepping its optimizer every second batch (its own gradient accumulation, as
    Lightning documents it for manual optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            opt = self.optimizers()
            opt.step()
            opt.zero_grad()
        return loss


@pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_a_resumed_fit_that_steps_every_second_batch_goes_on_from_the_checkpoints_step(
    tmp_path: Path,
) -> None:
    """4 optimizer steps over 8 batches with a checkpoint every 2 steps, then a fit on to 6 from the one at
    step 2. Lightning's count of the batches that stepped counts every batch under manual optimization: the
    resumed fit was numbered from 4 (steps 0-3 | 4-7, steps 2-3 of the first attempt kept though trained
    again). The checkpoint holds the callback's own step: 0-1 | 2-5."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = tmp_path / "run"
    for attempt, (max_steps, ckpt) in enumerate(((4, None), (6, tmp_path / "ckpt" / "step=2.ckpt"))):
        cb = PrecprofCallback(out=out, sample_every=1, report=False, memory=False, resume=attempt > 0)
        every = ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}"
        )
        trainer = quiet_trainer(tmp_path, cb, every, max_steps=max_steps)
        module = AccumulatingLM()
        trainer.fit(module, loader(), ckpt_path=ckpt)
        assert trainer.global_step == max_steps
    read = T.read_run(out)
    steps = read.tables["steps"]
    # the resumed fit: batches 4-11, a step every second one
    pairs = [(module.losses[2 * i] + module.losses[2 * i + 1]) / 2 for i in range(4)]
    assert steps[T.STEP].tolist() == list(range(6)) and read.restarts == [2]
    assert steps[T.LOSS].tolist()[2:] == pytest.approx(pairs, rel=1e-6)
    assert (steps[T.TOKENS] == 2 * BATCH * SEQ).all()


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.parametrize("resume", [None, False])
def test_a_second_fit_from_a_checkpoint_continues_the_run_unless_told_to_replace_it(
    tmp_path: Path, resume: bool | None
) -> None:
    """A fit of 4 steps, then a second fit on to 6 from its last checkpoint into the same ``out``, without
    ``resume=True``: the second replaced the first's run (steps 4-5 only, the report of steps 0-3 gone) without
    a word. It continues the run now (0-3 | 4-5), warning that it does and how to do otherwise;
    ``resume=False`` still replaces it, as asked."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out, losses = tmp_path / "run", []
    for max_steps, ckpt in ((4, None), (6, tmp_path / "ckpt" / "step=4.ckpt")):
        kw = {"resume": resume} if ckpt is not None and resume is not None else {}
        cb = PrecprofCallback(out=out, sample_every=1, report=False, memory=False, **kw)
        every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, filename="{step}")
        trainer = quiet_trainer(tmp_path, cb, every, max_steps=max_steps)
        module = TinyLM()
        if ckpt is not None and resume is None:
            told = pytest.warns(UserWarning, match="resumed at step 4 .* continuing it .* resume=True")
            with told, warnings.catch_warnings():  # (pytest.warns re-raises what it caught: lightning's too)
                warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)`", FutureWarning)
                trainer.fit(module, loader(), ckpt_path=ckpt)
        else:
            trainer.fit(module, loader(), ckpt_path=ckpt)
        losses += module.losses
    read = T.read_run(out)
    steps = read.tables["steps"]
    if resume is False:
        assert steps[T.STEP].tolist() == [4, 5]
        assert steps[T.LOSS].tolist() == pytest.approx(losses[4:], rel=0, abs=0)
        return
    assert steps[T.STEP].tolist() == list(range(6)) and read.restarts == [4]
    assert steps[T.LOSS].tolist() == pytest.approx(losses, rel=0, abs=0)
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE


class _Copies(L.Callback):  # type: ignore[misc]
    """A deep copy of the module after each batch (an EMA's, a "best model so far")."""

    def __init__(self) -> None:
        self.copies: list[Any] = []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.copies.append(copy.deepcopy(pl_module))


def test_copies_of_the_module_during_training_leave_precprofs_hooks_behind(tmp_path: Path) -> None:
    """The callback's hook on the token embedding stays for the whole fit, precprof's own between two sampled
    steps: a copy made at any batch holds none of them (it held a no-op in place of each), and trains."""
    copies = _Copies()
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False)
    module = TinyLM()
    quiet_trainer(tmp_path, cb, copies, max_steps=4, precision="32-true").fit(module, loader())
    assert len(copies.copies) == 4
    x, _ = next(iter(loader()))
    for c in [*copies.copies, module]:  # the module itself after the fit: as it was
        dicts = [d for m in c.modules() for d in (m._forward_pre_hooks, m._forward_hooks)]
        assert [h for d in dicts for h in d.values()] == [] and not any(map(vars, dicts))
        c.net(x).sum().backward()


def test_a_second_fit_from_step_0_into_a_complete_run_is_refused_unless_asked_to_replace_it(
    tmp_path: Path,
) -> None:
    """A fit of 4 steps, then a new Trainer's fit from step 0 into the same ``out``: the second replaced the
    first's complete run without a word. It is refused now at its first batch, as ``Profiler(out=...)`` refuses
    it, and the run is kept whole; ``overwrite=True`` replaces it. The losses are those training_step returned."""
    out = tmp_path / "run"
    first = TinyLM()
    fit(tmp_path, "32-true", PrecprofCallback(out=out, sample_every=1, report=False, memory=False), first)
    refused = TinyLM()
    with pytest.raises(RunDirError, match=r"already holds a precprof run \(complete\).* overwrite=True"):
        fit(tmp_path, "32-true", PrecprofCallback(out=out, sample_every=1, report=False), refused)
    assert refused.losses == []  # refused before its first training_step
    assert T.read_summary(out)[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    assert T.read_tables(out)["steps"][T.LOSS].tolist() == pytest.approx(first.losses, rel=0, abs=0)
    second = TinyLM()
    second.net.load_state_dict(first.net.state_dict())  # trained on: other losses than the first run's
    fit(tmp_path, "32-true", PrecprofCallback(out=out, sample_every=1, report=False, overwrite=True), second)
    assert second.losses != first.losses
    assert T.read_tables(out)["steps"][T.LOSS].tolist() == pytest.approx(second.losses, rel=0, abs=0)


class LoggingLM(TinyLM):
    """Logs its training loss (each step) and its validation loss (each validation) through ``self.log``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x).reshape(-1, VOCAB), y.reshape(-1)))


@pytest.mark.parametrize("every", [1, 4])
def test_wandb_beside_lightnings_wandb_logger_keeps_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """``PrecprofCallback(wandb=True)`` beside Lightning's ``WandbLogger``, which logs without ``step=`` (its
    own ``trainer/global_step`` in the dict), a training row each step and a validation row each validation:
    every step's precprof row is in the run's history, against precprof/step, and Lightning's own values are
    there too. The logger's "*" glob put most of precprof's series against trainer/global_step: each key of
    precprof's is defined by its name against precprof/step."""
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger
    from test_export import (
        _assert_precprof_series_go_against_precprof_step,
        _wandb_files_closed,
        _wandb_history,
    )

    for k, v in {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    steps_run = 12
    cb = PrecprofCallback(out=tmp_path / "run", sample_every=1, report=False, wandb=True)
    module = LoggingLM()
    trainer = L.Trainer(
        accelerator="cpu",
        logger=WandbLogger(offline=True, save_dir=str(tmp_path), project="precprof-test"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        callbacks=[cb],
        max_steps=steps_run,
        log_every_n_steps=every,
        val_check_interval=every,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(module, loader(), loader())
    finally:
        wandb.finish()
        _wandb_files_closed()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    history = _wandb_history(run_dir)
    rows = [r for r in history.values() if "precprof/loss" in r]
    steps = T.read_tables(cb.run_dir)["steps"]
    assert [r["precprof/step"] for r in rows] == steps[T.STEP].tolist() == list(range(steps_run))
    assert [r["precprof/loss"] for r in rows] == pytest.approx(module.losses)
    assert [r["precprof/loss"] for r in rows] == pytest.approx(steps[T.LOSS].tolist())
    # Lightning's own rows: the training loss of every ``every``-th batch and a validation after it, each at
    # trainer/global_step = the index of that batch
    logged = list(range(every - 1, steps_run, every))
    train = {r["trainer/global_step"]: r["train_loss"] for r in history.values() if "train_loss" in r}
    assert train == pytest.approx({s: module.losses[s] for s in logged})
    assert [r["trainer/global_step"] for r in history.values() if "val_loss" in r] == logged
    _assert_precprof_series_go_against_precprof_step(run_dir, "trainer/global_step")


def test_only_a_wandb_logger_of_precprofs_own_run_turns_its_rows_beside_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """precprof's rows go without ``step=`` (``BesideTrainer``) where a ``WandbLogger`` of the trainer logs to
    the run precprof logs to (``wandb=True``: the current run; or that run object). Beside a logger of another
    run, or none of wandb's, wandb's step in precprof's run is the user's loop's (``wandb.log(step=...)``), which
    precprof's rows follow."""
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from precprof.integrations.lightning import _logs_to_wandb_run

    mine, other = object(), object()  # stand-ins for two wandb runs
    monkeypatch.setattr(wandb, "run", mine)
    beside_mine = type("Trainer", (), {"loggers": [CSVLogger(str(tmp_path)), WandbLogger(experiment=mine)]})
    beside_other = type("Trainer", (), {"loggers": [WandbLogger(experiment=other)]})
    beside_csv = type("Trainer", (), {"loggers": [CSVLogger(str(tmp_path))]})
    assert _logs_to_wandb_run(beside_mine, True) and _logs_to_wandb_run(beside_mine, mine)
    assert not _logs_to_wandb_run(beside_mine, other)
    assert not _logs_to_wandb_run(beside_other, True) and not _logs_to_wandb_run(beside_other, mine)
    assert not _logs_to_wandb_run(beside_csv, True)


class ScopedLossLM(TinyLM):
    """TinyLM computing its loss under the callback's ``profiler.memory_scope()``, as the report tells a Lightning
    user to."""

    def __init__(self, cb: PrecprofCallback) -> None:
        super().__init__()
        self.cb = cb

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        with self.cb.profiler.memory_scope():
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        return loss


@pytest.mark.skipif(importlib.util.find_spec("precprof.report.render") is None, reason="report extra")
def test_the_memory_section_tells_a_lightning_user_how_to_count_the_loss(tmp_path: Path) -> None:
    """A loss computed outside the model's forward is not in the activations: the report said to wrap it in
    ``prof.memory_scope()``, and a Lightning user holds no ``prof``. It names the callback's profiler, and that
    call counts the loss: cross-entropy keeps its fp32 log-softmax, batch x seq x vocab floats."""
    cb = PrecprofCallback(sample_every=1)
    fit(tmp_path / "plain", "32-true", cb, TinyLM())
    assert cb.report_path is not None
    page = cb.report_path.read_text()
    assert 'id="memory-loss"' in page and "precprof_cb.profiler.memory_scope()" in page
    assert "with prof.memory_scope()" not in page

    cb = PrecprofCallback(sample_every=1)
    fit(tmp_path / "scoped", "32-true", cb, ScopedLossLM(cb))
    mem = T.read_tables(cb.run_dir)["memory"]
    acts = mem[(mem[T.COMPONENT] == T.ACTIVATIONS) & (mem[T.MODULE] == "(loss)")]
    floats = acts[acts[T.DTYPE] == "float32"]
    assert len(floats) and (floats[T.BYTES] >= BATCH * SEQ * VOCAB * 4).all()  # each step measured
    assert cb.report_path is not None and 'id="memory-loss"' not in cb.report_path.read_text()


@pytest.mark.parametrize(
    ("kw", "error", "said"),
    [
        (
            {"memroy": False},
            TypeError,
            "PrecprofCallback(memroy=...) is not a precprof.Profiler argument (did you mean memory?)",
        ),
        (
            {"sample_every": 1.5},
            TypeError,
            "PrecprofCallback(sample_every=1.5): expected a whole number >= 0",
        ),
        ({"update_sample": 0}, ValueError, "PrecprofCallback(update_sample=0): expected a whole number >= 1"),
        (
            {"scaler": None},
            TypeError,
            "PrecprofCallback(scaler=...): the callback gives the Profiler the Trainer's GradScaler itself",
        ),
        ({"tensorboard": 3}, TypeError, "PrecprofCallback(tensorboard=3): expected a log directory or a"),
        ({"wandb": "yes"}, TypeError, "PrecprofCallback(wandb='yes'): expected True (the current wandb.run)"),
    ],
)
def test_a_profiler_argument_the_callback_cannot_pass_on_is_refused_when_it_is_made(
    kw: dict[str, Any], error: type[Exception], said: str, tmp_path: Path
) -> None:
    """As the Hugging Face callback: a typo or a bad value failed at the fit's first batch, not where it was
    given."""
    with pytest.raises(error) as e:
        PrecprofCallback(out=tmp_path / "run", report=False, **kw)
    assert str(e.value).startswith(said) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_the_callbacks_own_arguments_are_checked_when_it_is_made() -> None:
    """As the Hugging Face callback's: ``out=123`` and ``report="yes"`` (tester t8)."""
    with pytest.raises(TypeError, match=r"^PrecprofCallback\(out=123\): expected a run directory's path"):
        PrecprofCallback(out=123)
    with pytest.raises(TypeError, match=r"^PrecprofCallback\(report='yes'\): expected True or False"):
        PrecprofCallback(report="yes")
