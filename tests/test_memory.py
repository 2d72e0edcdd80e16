"""capture.memory_tracker and analysis.memory_projection: components measured against hand arithmetic and autograd's own saved tensors."""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._profiler import _EventType
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import precprof
from precprof import pipeline
from precprof import tables as T
from precprof.analysis.memory_projection import MODES, infer_mode, project, textbook
from precprof.capture import storage
from precprof.capture.memory_tracker import MemoryTracker
from precprof.report import memory_summary as M
from precprof.report.plots import memory_figure
from precprof.taxonomy import autocast_class as module_class

B, D_IN, D_HID, D_OUT = 5, 8, 16, 4
N_MLP = D_IN * D_HID + D_HID + D_HID * D_OUT + D_OUT  # 212 parameters


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, D_IN, generator=g), torch.randn(B, D_OUT, generator=g)


def one_step(
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    tracker: MemoryTracker | None,
    step: int = 0,
    *,
    autocast: torch.dtype | None = None,
    x: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
) -> tuple[float, list[dict[str, Any]]]:
    """A hand-written training step as a user writes it: zero_grad(set_to_none) before the tracker's end."""
    if x is None or y is None:
        x, y = batch(step + 1)
    if tracker is not None:
        tracker.begin_step(step, True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(x)
    loss = F.mse_loss(out.float(), y)
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    rows = tracker.end_step(step) if tracker is not None else []
    return loss.item(), rows


def total(rows: list[dict[str, Any]], component: str, **match: str) -> int:
    """The bytes of ``component`` in ``rows``: each component's own size (``moment`` ""), unless ``match`` says."""
    match = {T.MOMENT: "", **match}
    return sum(
        r[T.BYTES]
        for r in rows
        if r[T.COMPONENT] == component and all(r.get(k, "") == v for k, v in match.items())
    )


def by_module(rows: list[dict[str, Any]], component: str = T.ACTIVATIONS) -> dict[tuple[str, str], int]:
    return {(r[T.MODULE], r[T.DTYPE]): r[T.BYTES] for r in rows if r[T.COMPONENT] == component}


def assert_no_hooks(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    for mod in model.modules():
        assert not mod._forward_pre_hooks and not mod._forward_hooks
        assert not mod._forward_hooks_always_called
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)
    if opt is not None:
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


# ------------------------------------------------------------------------ parameters, gradients, states
def test_fp32_mlp_adamw_is_4n_4n_8n_plus_step_counters() -> None:
    model = mlp()
    assert sum(p.numel() for p in model.parameters()) == N_MLP
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tr = MemoryTracker(model, opt)
    tr.attach()
    try:
        _, rows = one_step(model, opt, tr)
    finally:
        tr.detach()
    # AdamW keeps exp_avg and exp_avg_sq (fp32, one element per parameter element) and one fp32 scalar
    # "step" tensor per parameter tensor (4 tensors: two weights, two biases).
    n_tensors = 4
    step_counter = torch.tensor(0.0).element_size()
    assert total(rows, T.PARAMETERS, dtype="float32") == 4 * N_MLP
    assert total(rows, T.GRADIENTS, dtype="float32") == 4 * N_MLP  # measured before zero_grad freed them
    assert total(rows, T.OPTIMIZER_STATES) == 8 * N_MLP + n_tensors * step_counter
    assert total(rows, T.MASTER_WEIGHTS) == 0
    assert {r[T.DTYPE] for r in rows} == {"float32"}
    assert all(r[T.STEP] == 0 and r[T.PHASE] == "" for r in rows)  # CPU: no allocator rows
    assert not any(r[T.COMPONENT] in T.MEMORY_PEAK_COMPONENTS for r in rows)
    assert list(T.frame("memory", rows).columns) == list(T.MEMORY_COLUMNS)


def test_sgd_momentum_states_are_4n() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    tr = MemoryTracker(model, opt)
    tr.attach()
    _, rows = one_step(model, opt, tr)
    tr.detach()
    assert total(rows, T.OPTIMIZER_STATES) == 4 * N_MLP  # one momentum buffer per element, no counters


def test_bf16_pure_parameters_are_2n() -> None:
    model = mlp().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tr = MemoryTracker(model, opt)
    tr.attach()
    x, y = batch()
    _, rows = one_step(model, opt, tr, x=x.bfloat16(), y=y)
    tr.detach()
    assert total(rows, T.PARAMETERS) == total(rows, T.PARAMETERS, dtype="bfloat16") == 2 * N_MLP
    assert total(rows, T.GRADIENTS, dtype="bfloat16") == 2 * N_MLP
    # plain AdamW on bf16 parameters keeps bf16 moments (and fp32 step counters)
    assert total(rows, T.OPTIMIZER_STATES, dtype="bfloat16") == 4 * N_MLP
    assert total(rows, T.OPTIMIZER_STATES, dtype="float32") == 4 * 4


def _to_masters(params: list[nn.Parameter], masters: list[torch.Tensor]) -> None:
    """The bf16 model's gradients copied to its fp32 masters, as the pure-bf16 recipe does."""
    for m, p in zip(masters, params, strict=True):
        m.grad = p.grad.float()


def _master_step(
    model: nn.Module, opt: torch.optim.Optimizer, params: list[nn.Parameter], masters: list[torch.Tensor]
) -> None:
    """The optimizer steps the masters, the model's weights are copied back from them, both sets' gradients go."""
    opt.step()
    with torch.no_grad():
        for m, p in zip(masters, params, strict=True):
            p.copy_(m)
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)


def test_bf16_pure_with_fp32_master_weights() -> None:
    """The standard pure-bf16 recipe: bf16 model, optimizer on fp32 masters, grads copied over."""
    model = mlp().to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2)
    tr = MemoryTracker(model, opt)
    tr.attach()
    tr.begin_step(0, True)
    x, y = batch()
    F.mse_loss(model(x.bfloat16()).float(), y).backward()
    _to_masters(params, masters)
    _master_step(model, opt, params, masters)
    rows = tr.end_step(0)
    tr.detach()
    assert total(rows, T.PARAMETERS) == 2 * N_MLP
    assert total(rows, T.MASTER_WEIGHTS, dtype="float32") == 4 * N_MLP
    assert total(rows, T.OPTIMIZER_STATES) == 8 * N_MLP + 4 * 4  # masters are not counted twice
    # at the optimizer step both the bf16 model gradients and the fp32 master gradients exist
    assert total(rows, T.GRADIENTS, dtype="bfloat16") == 2 * N_MLP
    assert total(rows, T.GRADIENTS, dtype="float32") == 4 * N_MLP


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.filterwarnings("ignore:precprof. the optimizer given:UserWarning")  # it steps the masters
def test_a_bf16_model_with_fp32_master_weights_is_a_pure_run_in_memory_too(tmp_path: Path) -> None:
    """A bf16 model whose optimizer steps fp32 masters (the master gradients copied in, the weights copied
    back): its fp32 master gradients made the memory projection take it for bf16 autocast while the header
    said bf16-pure, and the verdict's "this run" was the bf16-pure projection without the master copy and its
    gradients, so FP32 "needed more" than this run when it needs less."""
    model = mlp().to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2)
    x, y = batch()
    x = x.bfloat16()
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)  # what the model's forward saves (the bf16 weights' storages left out below)
    acts = sum(b for ptr, b in saved.items() if ptr not in {p.untyped_storage().data_ptr() for p in params})
    with precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False) as prof:
        for _ in range(2):
            out = model(x)
            F.mse_loss(out.float(), y).backward()
            _to_masters(params, masters)
            grads = _storage_bytes([p.grad for p in [*params, *masters]])
            _master_step(model, opt, params, masters)
            prof.step(loss=out.float().mean())
    prof.save(tmp_path / "run")
    summary = T.read_summary(tmp_path / "run")
    assert summary[T.SUMMARY_CAPTURE]["precision_seen"] == "bf16-pure"
    block = summary[T.SUMMARY_MEMORY]
    assert block["measured_mode"] == "bf16-pure" and infer_mode(prof.tables()["memory"]) == "bf16-pure"
    n = N_MLP
    states = _storage_bytes(
        [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    )
    assert grads == 2 * n + 4 * n and states == 8 * n + 4 * 4  # by hand: both gradients; AdamW's moments
    held = 2 * n + 4 * n + grads + states + acts  # bf16 weights, fp32 masters, gradients, states, activations
    fp32 = 4 * n + 4 * n + states + 2 * acts  # no masters; fp32 weights and gradients; activations in fp32
    records = M.memory_records(summary)
    saving = M.expected_saving(records, 0.0, "bf16-pure", "fp32", M.measured_memory(prof.tables()["memory"]))
    assert saving is not None and saving["basis"] == "held"  # the CPU records no allocator peak unasked
    assert (saving["current"], saving["recommended"]) == (held, fp32)
    assert saving["saved"] == held - fp32 > 0  # FP32 needs less than this run: no master copy, one gradient
    own = {
        r["component"]: r["bytes"] for r in records if (r["mode"], r["source"]) == ("bf16-pure", "projected")
    }
    assert own[T.MASTER_WEIGHTS] == 4 * n and own[T.GRADIENTS] == grads  # the master copy kept, as measured


def test_a_sparse_gradient_is_projected_as_the_rows_it_holds(tmp_path: Path) -> None:
    """nn.Embedding(sparse=True) over 10,000 rows: its gradient holds the 40 rows a step looked up and their
    indices (3 KiB), measured so, yet every mode was projected as if it were dense (625 KiB, 200x). Each mode is
    projected from its real parts now: the values at the mode's bytes per element, the indices as they are,
    and the dense gradients as before; the fp32 projection equals what the run measured."""
    torch.manual_seed(0)
    vocab, dim = 10_000, 16
    model = nn.Sequential(nn.Embedding(vocab, dim, sparse=True), nn.Linear(dim, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parts: list[tuple[int, int, int]] = []  # per step: values' and indices' elements, dense gradient elements
    with precprof.Profiler(model, opt, sample_every=1, memory_every=1, block_formats=False) as prof:
        for _ in range(2):
            model(torch.randint(0, vocab, (8, 5))).square().mean().backward()
            g = model[0].weight.grad
            assert g is not None and g.layout is torch.sparse_coo
            dense = [p.grad for p in model[1].parameters() if p.grad is not None]
            parts.append((g._values().numel(), g._indices().numel(), sum(t.numel() for t in dense)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    prof.save(tmp_path / "run")
    block = T.read_summary(tmp_path / "run")[T.SUMMARY_MEMORY]
    values, indices, dense = parts[block["step"]]
    assert values == 8 * 5 * dim  # one row per id looked up (uncoalesced)
    r = records(block)
    assert r[("fp32", "measured", T.GRADIENTS)] == 4 * (values + dense) + 8 * indices
    for mode in MODES:
        per_element = 2 if mode in ("bf16-pure", "fp16-pure") else 4
        assert r[(mode, "projected", T.GRADIENTS)] == per_element * (values + dense) + 8 * indices, mode


def test_a_profiler_without_the_optimizer_says_its_states_were_not_measured(tmp_path: Path) -> None:
    """Adam steps the model but the Profiler was not given it: its states were left out silently, and the
    projection had pure bf16 save half of fp32's memory, the states that no format changes being absent. They
    are said to be unmeasured, and every mode is given Adam's, as the loop's Adam holds them."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch()
    with precprof.Profiler(model, sample_every=1, block_formats=False) as prof:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
            prof.step()
    prof.report(tmp_path / "run")
    block = T.read_summary(tmp_path / "run")[T.SUMMARY_MEMORY]
    assert block["unmeasured"] == {T.OPTIMIZER_STATES: "no optimizer was given to the Profiler"}
    moments = sum(v.nbytes for st in opt.state.values() for k, v in st.items() if k != "step")
    assert moments == 8 * N_MLP  # Adam's two fp32 moments per element
    r = records(block)
    assert all(r[(m, "projected", T.OPTIMIZER_STATES)] == moments for m in MODES)
    # what the saving really is, by hand: weights and gradients 4 -> 2 bytes, the moments unchanged,
    # activations (the input and the ReLU output, one storage per layer) 4 -> 2 bytes
    acts = B * (D_IN + D_HID)
    fp32, pure = 8 * N_MLP + moments + 4 * acts, 4 * N_MLP + moments + 2 * acts
    tot = {(t["mode"], t["source"]): t for t in block["totals"]}
    assert tot[("bf16-pure", "projected")]["saving_vs_fp32"] == pytest.approx(1 - pure / fp32)
    assert 1 - pure / fp32 < 0.3  # the states kept it from the 50% it showed
    # the verdict's "this run" is what the run held, its states with it
    saving = M.expected_saving(M.memory_records({T.SUMMARY_MEMORY: block}), 0.0, "fp32", "bf16-pure")
    assert saving is not None and saving["current"] == fp32 and saving["assumed"] == moments
    page = (tmp_path / "run" / "report.html").read_text()
    assert re.search(r'<tr class="unmeasured"><td>optimizer states</td><td>not measured', page)
    # the figure: a bar per mode, none for the assumed states alone (drawn as a second "fp32 · projected")
    fig = memory_figure(
        M.measured_memory(prof.tables()["memory"]), M.memory_records({T.SUMMARY_MEMORY: block})
    )
    assert fig is not None
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(labels) == len(set(labels)) == 1 + len(MODES)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 6, *, tie: str = "tied") -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie == "tied":
            self.head.weight = self.wte.weight  # one Parameter in two modules
        elif tie == "shared_storage":
            self.head.weight = nn.Parameter(self.wte.weight.data)  # two Parameters, one storage

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.wte(idx)))


@pytest.mark.parametrize("scoped", [False, True])
def test_a_loss_computed_in_the_users_loop_is_said_not_counted_unless_scoped(
    scoped: bool, tmp_path: Path
) -> None:
    """A loss computed in the user's loop, outside the model's forward, saves its fp32 log-softmax for backward
    (batch x positions x vocabulary x 4 bytes: here more than the model saves) and was left out of the
    activations without a word. The memory section says so and names prof.memory_scope(), which counts it."""
    vocab = 64
    torch.manual_seed(0)
    model = TinyLM(vocab=vocab, dim=6, tie="untied")
    idx = torch.randint(0, vocab, (4, 8))
    floats: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float32:
            floats[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    logits = model(idx)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(logits.view(-1, vocab), idx.view(-1))  # what the loss alone saves, in fp32
    loss_floats = sum(floats.values())
    assert loss_floats >= 4 * 8 * vocab * 4  # the log-softmax, at least
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False) as prof:
        for _ in range(2):
            logits = model(idx)
            with prof.memory_scope() if scoped else contextlib.nullcontext():
                loss = F.cross_entropy(logits.view(-1, vocab), idx.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    prof.report(tmp_path / "run")
    mem = prof.tables()["memory"]
    last = mem[(mem[T.STEP] == 1) & (mem[T.COMPONENT] == T.ACTIVATIONS)]
    in_loss = last[last[T.MODULE] == "(loss)"]
    page = (tmp_path / "run" / "report.html").read_text()
    if scoped:
        assert in_loss[in_loss[T.DTYPE] == "float32"][T.BYTES].sum() == loss_floats
        assert 'id="memory-loss"' not in page
    else:
        assert in_loss.empty and len(last)
        assert 'id="memory-loss"' in page and "prof.memory_scope()" in page


def _saved_bytes(run: Callable[[], Any], params: list[torch.Tensor]) -> int:
    """The bytes of the storages autograd saves for backward while ``run`` runs, each storage once, the
    parameters' left out: counted by a saved-tensor hooks pair of the test's own."""
    own = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


def test_a_scope_around_the_model_call_and_the_loss_counts_both(tmp_path: Path) -> None:
    """``with prof.memory_scope(): loss = F.cross_entropy(model(x), y)``, the model called inside the scope:
    the scope's hooks were popped at the model's forward as if left by an interrupted one, and recording ended
    when the model returned, so the loss's saved tensors (its fp32 log-softmax, most of the step's) were not
    counted and the report asked for the scope the user had used. Both are counted now, as a saved-tensor
    hooks pair of the test's own sees them: the model's by module, the loss's under (loss)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 100))
    x, y = torch.randn(6, 8), torch.randint(0, 100, (6,))
    params = list(model.parameters())
    step_bytes = _saved_bytes(lambda: F.cross_entropy(model(x), y), params)
    logits = model(x)
    loss_bytes = _saved_bytes(lambda: F.cross_entropy(logits, y), params)
    assert loss_bytes >= 6 * 100 * 4  # the log-softmax, at least
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False) as prof:
        for _ in range(2):
            with prof.memory_scope():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.zero_grad(set_to_none=True)  # (no update: the independent counts stay the step's)
            prof.step(loss=loss.detach())
    prof.report(tmp_path / "run")
    mem = prof.tables()["memory"]
    for step in (0, 1):
        acts = mem[(mem[T.STEP] == step) & (mem[T.COMPONENT] == T.ACTIVATIONS) & (mem[T.MOMENT] == "")]
        assert acts[T.BYTES].sum() == step_bytes
        assert acts[acts[T.MODULE] == "(loss)"][T.BYTES].sum() == loss_bytes
        assert set(acts[T.MODULE]) == {"0", "1", "(loss)"}  # the model's by module, as outside a scope
    assert 'id="memory-loss"' not in (tmp_path / "run" / "report.html").read_text()


@pytest.mark.parametrize("retry", ["in a new scope", "in the same scope"])
def test_a_step_retried_after_a_keyboard_interrupt_in_a_scope_counts_the_model_and_the_loss(
    retry: str,
) -> None:
    """A KeyboardInterrupt raised inside the model called under ``prof.memory_scope()``, caught by the loop and
    the step run again: at the retried model's call, the interrupted forward's cleanup popped the scope's
    saved-tensor hooks, so the model was recorded alone and the loss not at all (576 of 3028 B, no (loss) row).
    The retried step counts what a saved-tensor hooks pair of the test's own sees one attempt save."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 100))
    x, y = torch.randn(6, 8), torch.randint(0, 100, (6,))
    params = list(model.parameters())
    step_bytes = _saved_bytes(lambda: F.cross_entropy(model(x), y), params)
    logits = model(x)
    loss_bytes = _saved_bytes(lambda: F.cross_entropy(logits, y), params)
    armed = [False]

    def interrupt(mod: nn.Module, args: Any, out: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise _Stop

    model[1].register_forward_hook(interrupt)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # (no update: the independent counts stay the step's)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False) as prof:
        for _ in range(2):
            armed[0] = True
            if retry == "in a new scope":
                with contextlib.suppress(_Stop), prof.memory_scope():
                    loss = F.cross_entropy(model(x), y)
                with prof.memory_scope():
                    loss = F.cross_entropy(model(x), y)
            else:
                with prof.memory_scope():
                    with contextlib.suppress(_Stop):
                        model(x)
                    loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    mem = prof.tables()["memory"]
    for step in (0, 1):
        acts = mem[(mem[T.STEP] == step) & (mem[T.COMPONENT] == T.ACTIVATIONS) & (mem[T.MOMENT] == "")]
        assert acts[T.BYTES].sum() == step_bytes
        assert acts[acts[T.MODULE] == "(loss)"][T.BYTES].sum() == loss_bytes


class TinyLMWithLoss(TinyLM):
    """nanoGPT's, llm.c's and minGPT's shape of forward: given its targets, the model computes its loss itself."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:  # type: ignore[override]
        logits = super().forward(idx)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_a_loss_computed_in_the_models_forward_is_said_counted_in_the_models_row(tmp_path: Path) -> None:
    """A model that computes its loss in its forward (llm.c, minGPT, nanoGPT, HF models given labels) had its
    loss's log-softmax in the model's own row, '(model)', and the note under it said 'No loss is in these
    activations' and advised prof.memory_scope(), which cannot reach inside the forward. The loss's saved floats
    are the model's row's, counted independently with autograd's own saved-tensor hooks, and the page says
    they are counted there, with no memory_scope advice."""
    vocab = 64
    torch.manual_seed(0)
    model = TinyLMWithLoss(vocab=vocab, dim=6, tie="untied")
    idx = torch.randint(0, vocab, (4, 8))
    floats: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float32:
            floats[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    logits, _ = model(idx)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(logits.view(-1, vocab), idx.view(-1))  # what the loss alone saves, in fp32
    loss_floats = sum(floats.values())
    assert loss_floats >= 4 * 8 * vocab * 4  # the log-softmax, at least
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False) as prof:
        for _ in range(2):
            _, loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.item())  # a float, as llm.c gives it: nothing ties it to the model's output
    prof.report(tmp_path / "run")
    mem = prof.tables()["memory"]
    own = mem[(mem[T.STEP] == 1) & (mem[T.COMPONENT] == T.ACTIVATIONS) & (mem[T.MODULE] == "")]
    assert own[own[T.DTYPE] == "float32"][T.BYTES].sum() == loss_floats
    page = (tmp_path / "run" / "report.html").read_text()
    assert 'id="memory-loss"' not in page and "prof.memory_scope()" not in page
    assert 'id="memory-loss-counted"' in page and "The loss is in these activations" in page


class _ClipLike(nn.Module):
    """Two towers and a learned temperature, returned as ``logit_scale.exp()``: a scalar with a gradient that is
    no loss (CLIP's contrastive loss is computed in the loop, from the features)."""

    def __init__(self) -> None:
        super().__init__()
        self.img, self.txt = nn.Linear(8, 6), nn.Linear(5, 6)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.img(a), self.txt(b), self.logit_scale.exp()


def test_a_scalar_the_model_returns_beside_its_outputs_is_no_loss_in_forward(tmp_path: Path) -> None:
    """A scalar with a gradient among a model's outputs was taken for its loss ('The loss is in these activations:
    your model's forward returned it') though the loss was computed in the loop, and the page lost its advice to
    compute it under prof.memory_scope(). Only a scalar a loss function made is the model's loss."""
    torch.manual_seed(0)
    model = _ClipLike()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False) as prof:
        for _ in range(2):
            a, b = torch.randn(16, 8), torch.randn(16, 5)
            fa, fb, scale = model(a, b)
            logits = scale * F.normalize(fa, dim=-1) @ F.normalize(fb, dim=-1).T
            loss = F.cross_entropy(logits, torch.arange(16))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    prof.report(tmp_path / "run")
    page = (tmp_path / "run" / "report.html").read_text()
    assert 'id="memory-loss-counted"' not in page and "prof.memory_scope()" in page


@pytest.mark.parametrize("tie", ["tied", "shared_storage", "untied"])
def test_tied_and_shared_weights_counted_once(tie: str) -> None:
    torch.manual_seed(0)
    vocab, dim = 11, 6
    model = TinyLM(vocab, dim, tie=tie)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = MemoryTracker(model, opt)
    tr.attach()
    tr.begin_step(0, True)
    idx = torch.randint(0, vocab, (2, 3))
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    rows = tr.end_step(0)
    tr.detach()
    unique = vocab * dim + 2 * dim  # embedding (= head when tied) + LayerNorm weight and bias
    expect = unique if tie != "untied" else unique + vocab * dim
    assert total(rows, T.PARAMETERS) == 4 * expect
    # a shared storage held by two Parameter objects still gets two gradient tensors
    grads = unique + (vocab * dim if tie != "tied" else 0)
    assert total(rows, T.GRADIENTS) == 4 * grads


def test_gradients_without_optimizer_after_zero_grad() -> None:
    """No optimizer, gradients freed before end_step: the post-accumulate-grad hooks saw them."""
    model = mlp()
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    rows = tr.end_step(0)
    tr.detach()
    assert total(rows, T.GRADIENTS) == 4 * N_MLP
    assert total(rows, T.OPTIMIZER_STATES) == 0


class _Checkpointed(nn.Module):
    """A reentrant checkpoint between two layers: its inner backward pass ends before the outer one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(D_IN, D_HID), nn.Linear(D_HID, D_HID), nn.Linear(D_HID, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.c(checkpoint(self.b, self.a(x).relu(), use_reentrant=True).relu())


def test_gradients_read_when_each_backward_ends_count_every_gradient_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without an optimizer step, the gradients are read when each backward pass ends, once per pass, not in
    each parameter's hook: two micro-batches, a reentrant checkpoint (its inner pass ends first, before every
    gradient exists) and the gradients freed before ``end_step`` give every gradient's bytes once."""
    from precprof.capture import memory_grads

    reads, adds = [], []
    real_read, real_add = memory_grads.GradientBytes._read, memory_grads.GradientBytes.add
    monkeypatch.setattr(
        memory_grads.GradientBytes, "_read", lambda self, ps: reads.append(1) or real_read(self, ps)
    )
    monkeypatch.setattr(
        memory_grads.GradientBytes, "add", lambda self, g: adds.append(1) or real_add(self, g)
    )
    model = _Checkpointed()
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    for seed in (1, 2):
        x, _ = batch(seed)
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    rows = tr.end_step(0)
    tr.detach()
    n = sum(p.numel() for p in model.parameters())
    assert total(rows, T.GRADIENTS) == 4 * n
    assert not adds and 2 <= len(reads) <= 4  # per pass (the checkpoint's inner one too), not per gradient


def _after_a_backward(
    optimizer: Any, sampled: bool
) -> tuple[nn.Module, torch.optim.Optimizer, MemoryTracker]:
    """The MLP, an ``optimizer`` of it and an attached tracker, step 0 begun (``sampled``) and its backward done."""
    model = mlp()
    opt = optimizer(model.parameters(), lr=1e-2)
    tr = MemoryTracker(model, opt)
    tr.attach()
    tr.begin_step(0, sampled)
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    return model, opt, tr


def test_the_optimizer_reads_gradients_anew_when_their_memory_changed() -> None:
    """The optimizer's pre-hook takes the storages read when the backward ended only for the same gradient
    tensors on the same memory: gradients moved into one larger buffer (``.data``, the same tensor objects) in
    between count that buffer once."""
    model, opt, tr = _after_a_backward(torch.optim.SGD, sampled=True)
    flat = torch.zeros(N_MLP + 100)
    at = 0
    for p in model.parameters():
        assert p.grad is not None
        flat[at : at + p.numel()] = p.grad.reshape(-1)
        p.grad.data = flat[at : at + p.numel()].view_as(p)
        at += p.numel()
    opt.step()
    opt.zero_grad(set_to_none=True)
    rows = tr.end_step(0)
    tr.detach()
    assert total(rows, T.GRADIENTS) == 4 * (N_MLP + 100)


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(1000, D_IN, sparse=True), nn.Linear(D_IN, D_OUT)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).mean(1))


def test_a_sparse_gradient_counts_its_values_and_indices() -> None:
    torch.manual_seed(0)
    model = SparseBag()
    opts = [torch.optim.SparseAdam([model.emb.weight]), torch.optim.Adam(model.fc.parameters())]
    tr = MemoryTracker(model, opts)
    tr.attach()
    ids = torch.randint(0, 1000, (B, 3))
    tr.begin_step(0, True)
    F.mse_loss(model(ids), torch.randn(B, D_OUT)).backward()
    grad = model.emb.weight.grad
    for opt in opts:
        opt.step()
    rows = tr.end_step(0)
    tr.detach()
    # the embedding's gradient: one row of D_IN fp32 values and one int64 index per lookup (B * 3), uncoalesced
    assert grad is not None and grad.is_sparse
    assert grad._values().nbytes == B * 3 * D_IN * 4 and grad._indices().nbytes == B * 3 * 8
    dense = (D_IN * D_OUT + D_OUT) * 4
    assert total(rows, T.GRADIENTS, dtype="float32") == B * 3 * D_IN * 4 + dense
    assert total(rows, T.GRADIENTS, dtype="int64") == B * 3 * 8


def test_gradients_on_a_step_gradscaler_skipped() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    tr = MemoryTracker(model, opt)
    tr.attach()
    tr.begin_step(0, True)
    x, y = batch()
    loss = F.mse_loss(model(x), y) * torch.tensor(float("nan"))
    scaler.scale(loss).backward()
    scaler.step(opt)  # finds nan gradients: optimizer.step() never runs, nor its hooks
    scaler.update()
    opt.zero_grad(set_to_none=True)
    rows = tr.end_step(0)
    tr.detach()
    assert scaler.get_scale() == 2.0**3  # the step was skipped
    assert total(rows, T.GRADIENTS) == 4 * N_MLP
    assert total(rows, T.OPTIMIZER_STATES) == 0  # AdamW never ran, so it has no state yet


@pytest.mark.parametrize("modules", [None, ["0"]])
@pytest.mark.parametrize("case", ["no optimizer", "skipped step"])
def test_a_profilers_gradients_are_measured_where_the_optimizer_does_not_run(case: str, modules: Any) -> None:
    """In a Profiler the gradient sizes come from its statistics' post-accumulate-grad hooks (the tracker's own
    only on parameters it does not capture, ``modules=["0"]``): no optimizer, or a step GradScaler skipped, with
    the gradients freed before ``step()``, still gives every gradient's bytes, once."""
    from precprof.capture import Profiler

    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if case == "skipped step" else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    prof = Profiler(model, optimizer=opt, scaler=scaler if opt else None, sample_every=1, modules=modules)
    prof.attach()
    x, y = batch()
    loss = F.mse_loss(model(x), y)
    if opt is None:
        loss.backward()
        model.zero_grad(set_to_none=True)
    else:
        scaler.scale(loss * torch.tensor(float("nan"))).backward()
        scaler.step(opt)  # nan gradients: optimizer.step() never runs, nor its hooks
        scaler.update()
        opt.zero_grad(set_to_none=True)
    prof.step()
    prof.detach()
    mem = prof.tables()["memory"]
    rows = mem[mem[T.STEP] == 0].to_dict("records")
    assert total(rows, T.GRADIENTS) == 4 * N_MLP
    assert_no_hooks(model, opt)


# ----------------------------------------------------------------------------------- saved activations
def test_saved_activations_of_an_mlp_by_hand() -> None:
    model = mlp()
    tr = MemoryTracker(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tr.attach()
    _, rows = one_step(model, tr.optimizers[0], tr)
    tr.detach()
    # Linear 0 (addmm): saves its input x for the weight gradient, (B, D_IN) fp32. It does not save its
    #   weight: x does not require grad, so no input gradient is computed (and weights are never activations).
    # ReLU 1: saves its output, (B, D_HID) fp32.
    # Linear 2: saves its input (the ReLU output: the same storage, counted once) and weight.t() (a param).
    # The loss is computed outside the model's forward, so what mse_loss saves is not seen.
    assert by_module(rows) == {("0", "float32"): B * D_IN * 4, ("1", "float32"): B * D_HID * 4}
    assert total(rows, T.AUTOCAST_WEIGHT_COPIES) == 0


def test_a_loop_that_calls_the_submodules_itself_has_their_activations_counted() -> None:
    # for mod in model: h = mod(h), never model(x): the root's forward hooks never run. The same step as
    # test_saved_activations_of_an_mlp_by_hand's, so the same bytes: Linear 0 saves x, ReLU 1 its output.
    model = mlp()
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    h, y = batch()
    for mod in model:
        h = mod(h)
    F.mse_loss(h, y).backward()
    rows = tr.end_step(0)
    tr.detach()
    assert by_module(rows) == {("0", "float32"): B * D_IN * 4, ("1", "float32"): B * D_HID * 4}
    assert_no_hooks(model)


class WithLoss(nn.Module):
    """Computes its loss inside forward, as Hugging Face models do with labels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


def test_saved_activations_with_loss_inside_forward() -> None:
    model = WithLoss()
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    x, y = batch()
    model(x, y).backward()
    rows = tr.end_step(0)
    tr.detach()
    # mse_loss (in the root module "") saves its input (the output of net.2, (B, D_OUT) fp32) and target.
    assert by_module(rows) == {
        ("net.0", "float32"): B * D_IN * 4,
        ("net.1", "float32"): B * D_HID * 4,
        ("", "float32"): 2 * B * D_OUT * 4,
    }


def saved_by_autograd(root: torch.Tensor, exclude: set[int]) -> int:
    """Independent count: walk the graph and read every node's ``_saved_*`` tensors, each storage once.

    Python numbers that an op wraps as 0-dim tensors (``x / 4.0`` saves 4.0 as a float64 scalar) are stored
    without going through the saved-tensor hooks; they are 8 host bytes each and are left out here too.
    """
    seen: set[int] = set()
    nodes = [root.grad_fn]
    visited: set[int] = set()
    total_bytes = 0
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            value = getattr(node, attr)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                    continue
                if t.dim() == 0 and t.dtype in (torch.float64, torch.int64):  # a wrapped Python number
                    continue
                ptr = t.untyped_storage().data_ptr()
                if ptr in seen or ptr in exclude:
                    continue
                seen.add(ptr)
                total_bytes += t.untyped_storage().nbytes()
        nodes.extend(fn for fn, _ in node.next_functions)
    return total_bytes


class Block(nn.Module):
    """A pre-norm transformer block with causal attention written out (nanoGPT style)."""

    def __init__(self, dim: int = 16, heads: int = 2, *, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(64, 64, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)  # (B, H, T, T)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.fc2(self.act(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_saved_activations_match_autograds_saved_tensors(autocast: torch.dtype | None) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    idx = torch.randint(0, 32, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
        logits = model(idx)
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    expected = saved_by_autograd(logits, exclude)
    logits.float().square().mean().backward()
    rows = tr.end_step(0)
    tr.detach()
    measured = total(rows, T.ACTIVATIONS) + total(rows, T.AUTOCAST_WEIGHT_COPIES)
    assert measured == expected
    acts = by_module(rows)
    # attribution: every block's attention probabilities are saved inside the block, the GELU output by act
    assert acts[("blocks.0.act", "float32" if autocast is None else "bfloat16")] > 0
    if autocast is None:
        assert total(rows, T.AUTOCAST_WEIGHT_COPIES) == 0
    else:
        assert total(rows, T.AUTOCAST_WEIGHT_COPIES) > 0


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose blocks run under activation checkpointing, called from the model's own forward."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=self.use_reentrant)
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_blocks_keep_their_inputs_and_nothing_else(use_reentrant: bool) -> None:
    """Under activation checkpointing a block keeps only its input until the backward pass recomputes the
    rest: the tracker counts each block's input, under the module that called the checkpoint (here the model
    itself, ""), and nothing saved inside the blocks; outside them it counts what the plain model saves."""
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))

    def measured(model: nn.Module) -> dict[tuple[str, str], int]:
        tr = MemoryTracker(model)
        tr.attach()
        tr.begin_step(0, True)
        model(idx).square().mean().backward()
        rows = tr.end_step(0)
        tr.detach()
        return by_module(rows)

    torch.manual_seed(0)
    plain = measured(TinyGPT())
    torch.manual_seed(0)
    model = CheckpointedGPT(use_reentrant)
    acts = measured(model)
    expected = {k: v for k, v in plain.items() if not k[0].startswith("blocks.")}
    expected[("", "float32")] = len(model.blocks) * 2 * 12 * 16 * 4  # each block's input, (2, 12, 16) fp32
    assert acts == expected
    assert all(k[0].startswith("blocks.") for k in plain.keys() - expected.keys())  # the blocks saved some


MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveGPT(TinyGPT):
    """TinyGPT whose blocks run under selective activation checkpointing: the policy keeps the matmuls' outputs
    in the checkpoint's cache and recomputes the rest. No RNG state is kept, so that what the forward leaves
    allocated is the activations and the output alone (the dropout masks are recomputed unlike the first)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for blk in self.blocks:
            x = checkpoint(
                blk,
                x,
                use_reentrant=False,
                preserve_rng_state=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls),
            )
        return self.head(self.ln_f(x))


def left_allocated(run: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Independent: the bytes the CPU allocator gave out during ``run()`` and still holds when it returns
    (torch.profiler's memory events, matched by address), and ``run()``'s result."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        out = run()
    held: dict[int, int] = {}
    events = sorted(
        (e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size)
        for e in prof.profiler.kineto_results.experimental_event_tree()
        for e in _event_tree(e)
        if e.typed[0] == _EventType.Allocation
    )
    for _, ptr, nbytes in events:
        if nbytes > 0:
            held[ptr] = nbytes
        else:
            held.pop(ptr, None)
    # Python numbers an op wraps as 0-dim float64 tensors (8 bytes) are left out by the tracker (saved_by_autograd)
    return sum(b for b in held.values() if b != 8), out


def _event_tree(e: Any) -> Iterator[Any]:
    yield e
    for c in e.children:
        yield from _event_tree(c)


def test_selective_checkpointing_counts_what_its_policy_keeps() -> None:
    """Selective activation checkpointing keeps the outputs of the ops its policy saves (here the matmuls) in
    the checkpoint's cache until the backward pass, out of autograd's saved-tensor hooks: the table had the
    blocks' inputs alone (6.5 KB of 41.9 KB). The activations are now what the allocator still holds from the
    forward, less its output (and plus the token ids, which the embedding saves and the forward did not make);
    each cached matmul output is counted under the layer that made it."""
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = SelectiveGPT()
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    held, out = left_allocated(lambda: model(idx))
    out.square().mean().backward()
    rows = tr.end_step(0)
    tr.detach()
    assert total(rows, T.ACTIVATIONS) == held - out.untyped_storage().nbytes() + idx.nbytes
    acts = by_module(rows)
    b, t, d = 2, 12, 16
    for k in range(len(model.blocks)):
        assert acts[(f"blocks.{k}.qkv", "float32")] == b * t * 3 * d * 4  # addmm's output, (24, 48) fp32
        assert acts[(f"blocks.{k}.fc", "float32")] == b * t * 4 * d * 4
        # the block's own two bmm: q @ k^T (2, 2, 12, 12) and att @ v (2, 2, 12, 8)
        assert acts[(f"blocks.{k}", "float32")] == (b * 2 * t * t + b * 2 * t * (d // 2)) * 4


class Refuses(nn.Linear):
    """A captured leaf (it owns parameters) whose forward raises: its parent falls back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no fast path here")


class WithFallback(nn.Module):
    """Catches its child's exception and computes by another path, saving tensors of its own."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fast = Refuses(dim, dim)
        self.slow = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.fast(x)
        except RuntimeError:
            pass
        return torch.tanh(self.slow(x)) * x  # tanh's output and both factors saved here, in this module


class GPTWithFallback(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.fallback = WithFallback()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + self.fallback(self.wte(idx)).sum()


@pytest.mark.parametrize("modules", [None, ["blocks.0.*", "fallback.fast"]])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_profiler_attributes_activations_as_a_standalone_tracker(
    autocast: torch.dtype | None, modules: list[str] | None
) -> None:
    """A Profiler attributes saved tensors to modules as a standalone tracker does: nested modules, a subset of
    them captured, a captured leaf that raises and whose parent falls back."""
    from precprof.capture import Profiler

    def activations(profiled: bool) -> dict[tuple[str, str, str], int]:
        torch.manual_seed(0)
        model = GPTWithFallback()
        idx = torch.randint(0, 32, (2, 12))
        if profiled:
            prof = Profiler(model, sample_every=1, modules=modules).attach()
        else:
            tr = MemoryTracker(model)
            tr.attach()
            tr.begin_step(0, True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
            logits = model(idx)
        logits.float().square().mean().backward()
        if profiled:
            prof.step()
            prof.detach()
            mem = prof.tables()["memory"]
            rows = mem[mem[T.STEP] == 0].to_dict("records")
            assert_no_hooks(model)
        else:
            rows = tr.end_step(0)
            tr.detach()
        out = {
            (r[T.COMPONENT], r[T.MODULE], r[T.DTYPE]): r[T.BYTES]
            for r in rows
            if r[T.COMPONENT] in (T.ACTIVATIONS, T.AUTOCAST_WEIGHT_COPIES)
        }
        assert out[(T.ACTIVATIONS, "fallback", "float32" if autocast is None else "bfloat16")] > 0
        assert (T.ACTIVATIONS, "fallback.fast", "float32") not in out
        return out

    assert activations(True) == activations(False)


def test_autocast_weight_copies_equal_bf16_weight_bytes() -> None:
    model = mlp()
    tr = MemoryTracker(model)
    tr.attach()
    x, y = batch()
    x.requires_grad_(True)  # so that the first Linear's backward needs (and saves) its weight copy too
    _, rows = one_step(model, None, tr, autocast=torch.bfloat16, x=x, y=y)
    # without input gradients only the second Linear keeps its weight copy
    _, rows_nograd = one_step(model, None, tr, step=1, autocast=torch.bfloat16)
    tr.detach()
    weights = [model[0].weight, model[2].weight]  # biases are added, never saved
    bf16_weight_bytes = sum(w.numel() * torch.finfo(torch.bfloat16).bits // 8 for w in weights)
    assert total(rows, T.AUTOCAST_WEIGHT_COPIES, dtype="bfloat16") == bf16_weight_bytes
    assert total(rows_nograd, T.AUTOCAST_WEIGHT_COPIES) == D_HID * D_OUT * 2
    # activations are bf16 now: the cast of x (a leaf that is no parameter) and the ReLU output
    assert by_module(rows) == {("0", "bfloat16"): B * D_IN * 2, ("1", "bfloat16"): B * D_HID * 2}


def test_frozen_weight_copies_are_weight_copies() -> None:
    """A frozen weight's autocast copy has no grad_fn (LoRA-style fine-tuning); it is still a copy."""
    model = mlp()
    model[2].weight.requires_grad_(False)
    tr = MemoryTracker(model)
    tr.attach()
    _, rows = one_step(model, None, tr, autocast=torch.bfloat16)
    tr.detach()
    assert total(rows, T.AUTOCAST_WEIGHT_COPIES) == D_HID * D_OUT * 2
    assert by_module(rows) == {("0", "bfloat16"): B * D_IN * 2, ("1", "bfloat16"): B * D_HID * 2}


def test_gradient_accumulation_reports_one_micro_batch() -> None:
    model = mlp()
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    for seed in (1, 2):  # forward, backward, forward, backward: one micro-batch alive at a time
        x, y = batch(seed)
        F.mse_loss(model(x), y).backward()
    rows = tr.end_step(0)
    tr.begin_step(1, True)
    (x1, y1), (x2, y2) = batch(1), batch(2)
    (F.mse_loss(model(x1), y1) + F.mse_loss(model(x2), y2)).backward()  # both graphs alive together
    rows_both = tr.end_step(1)
    tr.detach()
    one = B * (D_IN + D_HID) * 4
    assert total(rows, T.ACTIVATIONS) == one
    assert total(rows_both, T.ACTIVATIONS) == 2 * one


def saved_bytes_of_a_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Independent count: what autograd saves in the model's forward, through saved-tensor hooks of our own,
    each storage once (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total_bytes = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total_bytes
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total_bytes += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    F.mse_loss(out, y).backward()
    model.zero_grad(set_to_none=True)
    return total_bytes


def test_a_batch_sliced_from_a_dataset_counts_as_the_same_batch_copied_out() -> None:
    model = mlp()
    g = torch.Generator().manual_seed(3)
    data_x, data_y = torch.randn(1000, D_IN, generator=g), torch.randn(1000, D_OUT, generator=g)
    tr = MemoryTracker(model)
    tr.attach()
    _, rows = one_step(model, None, tr, x=data_x[B : 2 * B], y=data_y[B : 2 * B])
    tr.detach()
    # a DataLoader's batch: the same rows in a tensor of their own; the dataset (32,000 B) is no activation
    expected = saved_bytes_of_a_step(model, data_x[B : 2 * B].clone(), data_y[B : 2 * B].clone())
    assert expected == B * (D_IN + D_HID) * 4
    assert total(rows, T.ACTIVATIONS) == expected


def test_micro_batches_chunked_from_one_batch_count_their_own_rows() -> None:
    model = mlp()
    x, y = torch.randn(4 * B, D_IN), torch.randn(4 * B, D_OUT)
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    for xc, yc in zip(x.chunk(4), y.chunk(4), strict=True):  # forward, backward per micro-batch
        F.mse_loss(model(xc), yc).backward()
    rows = tr.end_step(0)
    tr.begin_step(1, True)
    sum(F.mse_loss(model(xc), yc) for xc, yc in zip(x.chunk(4), y.chunk(4), strict=True)).backward()
    rows_all = tr.end_step(1)
    tr.detach()
    one = saved_bytes_of_a_step(model, x[:B].clone(), y[:B].clone())
    assert by_module(rows) == {("0", "float32"): B * D_IN * 4, ("1", "float32"): B * D_HID * 4}
    assert total(rows, T.ACTIVATIONS) == one
    # four micro-batches alive together: the whole batch, its storage once
    assert total(rows_all, T.ACTIVATIONS) == 4 * one


class TwoWindows(nn.Module):
    """Reads two overlapping windows of one tensor, the second given by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, a: torch.Tensor, *, b: torch.Tensor) -> torch.Tensor:
        return self.net(a) + self.net(b)


def test_overlapping_views_of_an_input_count_each_byte_once() -> None:
    model = TwoWindows()
    data = torch.randn(100, D_IN)
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    model(data[0:B], b=data[2 : B + 2]).sum().backward()
    rows = tr.end_step(0)
    tr.detach()
    # net.0 saves both windows: rows 0 .. B+2 of the data, once; net.1 saves two ReLU outputs of its own
    assert by_module(rows) == {
        ("net.0", "float32"): (B + 2) * D_IN * 4,
        ("net.1", "float32"): 2 * B * D_HID * 4,
    }


class HeadOnFirstRow(nn.Module):
    """A head reading a slice of a tensor its forward made: the slice keeps that whole tensor alive."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(D_IN, D_HID), nn.Linear(D_HID, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)[:, 0])  # (B, 3, D_IN) -> (B, 3, D_HID) -> (B, D_OUT)


def test_a_slice_of_what_the_forward_made_counts_the_whole_tensor() -> None:
    model = HeadOnFirstRow()
    x = torch.randn(B, 3, D_IN)
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    model(x).sum().backward()
    rows = tr.end_step(0)
    tr.detach()
    assert by_module(rows) == {("body", "float32"): B * 3 * D_IN * 4, ("head", "float32"): B * 3 * D_HID * 4}


def test_targets_sliced_from_a_dataset_in_the_loss_scope() -> None:
    model = mlp()
    data_y = torch.randn(1000, D_OUT)
    x, y = torch.randn(B, D_IN), data_y[B : 2 * B]
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    out = model(x)
    with tr.scope():
        loss = F.mse_loss(out, y)
    loss.backward()
    rows = tr.end_step(0)
    tr.detach()
    # mse_loss saves the model's output and the B target rows (not the 1000 rows they are sliced from)
    assert by_module(rows)[("(loss)", "float32")] == 2 * B * D_OUT * 4


def test_unsampled_steps_record_nothing() -> None:
    _, opt, tr = _after_a_backward(torch.optim.AdamW, sampled=False)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not tr._groups and not tr._grads.seen
    opt.step()
    assert tr._grads.snapshot is None
    assert tr.end_step(0) == []
    tr.detach()


# ------------------------------------------------------------------------------ no effect, clean detach
def train(with_tracker: bool, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyGPT()  # has dropout: RNG use must not change either
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tr = MemoryTracker(model, opt) if with_tracker else None
    if tr is not None:
        tr.attach()
    losses = []
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        if tr is not None:
            tr.begin_step(step, True)
        idx = torch.randint(0, 32, (2, 12), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if tr is not None:
            assert tr.end_step(step)
    if tr is not None:
        tr.detach()
    return losses, [p.detach().clone() for p in model.parameters()]


def test_tracker_changes_nothing_bitwise() -> None:
    losses_a, weights_a = train(False)
    losses_b, weights_b = train(True)
    assert losses_a == losses_b
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b, strict=True))


def test_detach_removes_every_hook_and_is_idempotent() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tr = MemoryTracker(model, opt)
    tr.attach()
    assert_no_hooks(model, opt)  # hooks exist on sampled steps only
    tr.begin_step(0, True)
    assert model[0]._forward_pre_hooks and opt._optimizer_step_pre_hooks
    tr.begin_step(0, False)
    assert_no_hooks(model, opt)
    one_step(model, opt, tr)
    tr.detach()
    assert_no_hooks(model, opt)
    tr.detach()
    assert_no_hooks(model, opt)


class Boom(nn.Module):
    def __init__(self, exc: type[BaseException]) -> None:
        super().__init__()
        self.exc = exc
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise self.exc("mid-forward")
        return x


class Interrupt(BaseException):
    """Like KeyboardInterrupt: not an Exception, so always_call forward hooks do not run."""


def boom_model(exc: type[BaseException]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), Boom(exc), nn.Linear(D_HID, D_OUT))


@pytest.mark.parametrize("exc", [RuntimeError, Interrupt])
def test_exception_mid_forward_then_detach(exc: type[BaseException]) -> None:
    model = boom_model(exc)
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    with pytest.raises(exc):
        model(batch()[0])
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if exc is RuntimeError:
        assert top is None  # the always-called post-hook popped the saved-tensor hooks at once
    else:
        assert top is not None and top[0] == tr._pack  # stale: nothing ran after the interrupt
    tr.detach()
    assert_no_hooks(model)


@pytest.mark.parametrize("exc", [RuntimeError, Interrupt])
def test_stale_push_is_popped_by_the_next_forward(exc: type[BaseException]) -> None:
    """A forward ended by an exception that is not an ``Exception`` (KeyboardInterrupt) reaches no forward hook:
    its saved tensors were counted with those of the forward the loop ran next, as the step's (twice the step's).
    Now it ends at the model's next call, as one that raised a RuntimeError does in its always-called hook."""
    model = boom_model(exc)
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    with pytest.raises(exc) as failed:  # (its traceback holds the failed forward's tensors)
        model(batch()[0])
    model[2].armed = False
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    rows = tr.end_step(0)
    tr.detach()
    assert_no_hooks(model)
    # the interrupted forward saved x in Linear 0 and the ReLU output before failing: an attempt that raised and
    # was run again, not the step's; the step's are the forward's that trained
    assert by_module(rows) == {("0", "float32"): B * D_IN * 4, ("1", "float32"): B * D_HID * 4}
    del failed


def saved_in(model: nn.Module, forward: Callable[[], Any]) -> int:
    """Bytes of the storages autograd saves while ``forward()`` runs, each once, the model's parameters left out:
    the test's own count of a training forward's activations."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())


def activations_by_step(prof: precprof.Profiler) -> dict[int, int]:
    memory = prof.tables()["memory"]
    return memory[memory[T.COMPONENT] == T.ACTIVATIONS].groupby(T.STEP)[T.BYTES].sum().to_dict()


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


class _Siamese(nn.Module):
    """A forward that calls the model itself with grad on (a siamese pair, a recurrent wrapper) and saves more
    after that call: the sigmoid's output and the inner call's, for the product."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _Body()

    def forward(self, x: torch.Tensor, outer: bool = True) -> torch.Tensor:
        y = self.body(x)
        if not outer:
            return y
        z = self(x.flip(0), outer=False)
        return (torch.sigmoid(y) * z).mean()


def test_the_forward_after_the_models_call_of_itself_with_grad_is_measured() -> None:
    """The model's call of itself with grad on was taken for a forward of its own, whose end stopped the recording
    of the outer one: what the outer forward saved after it (the sigmoid's output and the inner call's) was not
    in the activations, 6 of 8 KiB. Every tensor the training forward saves, the inner call's included, is
    counted once: what the test's own saved-tensor hooks see the same forward save."""
    torch.manual_seed(0)
    model = _Siamese()
    x = torch.randn(32, 8)
    own = saved_in(model, lambda: model(x))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for _ in range(2):
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss)
    assert activations_by_step(prof) == {0: own, 1: own}
    assert own == 8 * 1024


class _Stop(KeyboardInterrupt):
    """A KeyboardInterrupt of the test's own, caught by its loop (not an Exception: torch calls no forward hook)."""


class _Teacher(nn.Module):
    """A forward that calls the model itself under no_grad (a self-distillation target), and raises ``_Stop`` once
    in the call ``stop_in`` names ("outer" or "inner", after the body ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _Body()
        self.stop_in = ""

    def forward(self, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
        y = self.body(x)
        if self.stop_in == ("inner" if inner else "outer"):
            self.stop_in = ""
            raise _Stop
        if inner:
            return y
        with torch.no_grad():
            target = self(x * 0.5, inner=True)
        return torch.sigmoid(y - target).mean()


@pytest.mark.parametrize("where", ["outer", "inner"])
def test_a_forward_a_keyboard_interrupt_ended_is_no_part_of_the_next(where: str) -> None:
    """A forward ended by a KeyboardInterrupt (of a subclass the loop catches) reaches no forward hook, not even
    the always-called one that ends a forward that raised: its saved tensors were counted with the step's (6 KiB
    where its training forward saved 4), and the evaluation under no_grad after it was read as the model's call
    of itself (its module forwards counted as self-call forwards not read). Now it ends at the model's next
    call, as one that raised a RuntimeError. The activations are what the test's own saved-tensor hooks see one
    training forward save; the self-call forwards, what its own hooks see run under no_grad in the forwards that
    trained."""
    torch.manual_seed(0)
    model = _Teacher()
    g = torch.Generator().manual_seed(1)
    own = saved_in(model, lambda: model(torch.randn(32, 8, generator=g)))
    unread: list[int] = []
    for mod in (model.body.l1, model.body.l2):
        mod.register_forward_hook(lambda mod, args, out: unread.append(int(not torch.is_grad_enabled())))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trained = 0
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory_every=1) as prof:
        for step in range(3):
            x = torch.randn(32, 8, generator=g)
            if step == 1:
                model.stop_in = where
                with pytest.raises(_Stop):
                    model(x)
                with torch.no_grad():
                    model(torch.randn(64, 8, generator=g))  # an evaluation
            unread.clear()
            loss = model(x)
            trained += sum(unread)
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss)
    assert activations_by_step(prof) == {0: own, 1: own, 2: own}
    assert prof.summary()["self_call_forwards_unread"] == trained == 6


def test_buffer_bytes_small_and_flat() -> None:
    """The tracker keeps names, storage addresses and totals: its footprint grows with the number of modules
    and of tensors they save, never with their size or the batch."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, dim=192, layers=4)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_modules = len(list(model.modules()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = MemoryTracker(model, opt)
    tr.attach()
    peaks = []
    for step, batch_size in enumerate((1, 4, 4)):
        tr.begin_step(step, True)
        idx = torch.randint(0, 256, (batch_size, 16))
        model(idx).square().mean().backward()
        opt.step()
        peaks.append(tr.buffer_bytes)  # before end_step clears the per-step records
        opt.zero_grad(set_to_none=True)
        tr.end_step(step)
    after = tr.buffer_bytes
    tr.detach()
    assert max(peaks) < 0.01 * param_bytes, (peaks, param_bytes)
    assert max(peaks) < 2048 * n_modules
    assert max(peaks) < 1.02 * min(peaks)  # 4x the batch, a later step: the same (up to int widths)
    assert after < peaks[0] / 2  # between steps only names and handles are kept


# ------------------------------------------------------------------------------------------ projection
def run_rows(mode: str) -> tuple[pd.DataFrame, MemoryTracker]:
    model = mlp()
    if mode == "bf16-pure":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tr = MemoryTracker(model, opt)
    tr.attach()
    x, y = batch()
    rows = []
    for step in range(2):
        rows += one_step(
            model,
            opt,
            tr,
            step,
            autocast=torch.bfloat16 if mode == "bf16" else None,
            x=x.to(next(model.parameters()).dtype),
            y=y,
        )[1]
    tr.detach()
    return T.frame("memory", rows), tr


def records(proj: dict[str, Any]) -> pd.DataFrame:
    return pd.DataFrame(proj["records"]).set_index(["mode", "source", "component"])["bytes"]


def test_textbook_table() -> None:
    tb = textbook(1000)
    df = pd.DataFrame(tb["records"]).set_index(["mode", "component"])["bytes"]
    assert df[("fp32", T.PARAMETERS)] == df[("fp32", T.GRADIENTS)] == 4000
    assert df[("bf16", T.PARAMETERS)] == df[("bf16-pure", T.GRADIENTS)] == 2000
    assert df[("bf16", T.OPTIMIZER_STATES)] == df[("fp32", T.OPTIMIZER_STATES)] == 8000
    assert "fp8" not in set(df.index.get_level_values(0))
    assert tb["saving_range"] == (0.4, 0.5)


def test_projection_from_fp32_run() -> None:
    mem, tr = run_rows("fp32")
    proj = project(mem, {T.SUMMARY_CONFIG: {"precision": "fp32"}}, facts=tr.model_facts())
    r = records(proj)
    assert proj["measured_mode"] == "fp32" and proj["n_params"] == N_MLP and proj["step"] == 1
    for m in MODES:  # the projection reproduces the measured fp32 run where it should
        low = m.endswith("-pure")
        assert r[(m, "projected", T.PARAMETERS)] == (2 if low else 4) * N_MLP
        assert r[(m, "projected", T.GRADIENTS)] == (2 if low else 4) * N_MLP
        assert r[(m, "projected", T.OPTIMIZER_STATES)] == 8 * N_MLP + 16
        assert r[(m, "projected", T.MASTER_WEIGHTS)] == 0  # the built-in pure modes keep no master copy
    for c in (T.PARAMETERS, T.GRADIENTS, T.OPTIMIZER_STATES, T.ACTIVATIONS):
        assert r[("fp32", "measured", c)] == r[("fp32", "projected", c)]
    fp32_acts = B * (D_IN + D_HID) * 4
    assert r[("fp32", "measured", T.ACTIVATIONS)] == fp32_acts
    # Linear and ReLU are both classes autocast runs in bf16: the projection halves them ...
    assert r[("bf16", "projected", T.ACTIVATIONS)] == fp32_acts // 2
    assert r[("fp8", "projected", T.ACTIVATIONS)] == fp32_acts // 2
    assert r[("bf16-pure", "projected", T.ACTIVATIONS)] == fp32_acts // 2
    # ... and a real autocast run agrees
    mem_bf16, _ = run_rows("bf16")
    assert total(mem_bf16.to_dict("records"), T.ACTIVATIONS) == 2 * fp32_acts // 2  # two sampled steps
    # weight copies from an fp32 run: every matmul weight, an upper bound on what autocast keeps
    assert r[("bf16", "projected", T.AUTOCAST_WEIGHT_COPIES)] == 2 * (D_IN * D_HID + D_HID * D_OUT)
    assert r[("fp32", "projected", T.AUTOCAST_WEIGHT_COPIES)] == 0
    # textbook rows beside them
    assert r[("bf16", "textbook", T.PARAMETERS)] == 2 * N_MLP
    assert r[("bf16", "textbook", T.ACTIVATIONS)] == fp32_acts // 2
    assert r[("fp32", "textbook", T.OPTIMIZER_STATES)] == 8 * N_MLP + 16
    # totals are sums of the records, savings relative to fp32 of the same source
    tot = {(t["mode"], t["source"]): t for t in proj["totals"]}
    for (m, src), t in tot.items():
        assert t["bytes"] == sum(
            rec["bytes"] for rec in proj["records"] if (rec["mode"], rec["source"]) == (m, src)
        )
    assert tot[("fp32", "projected")]["saving_vs_fp32"] == 0
    tb = tot[("bf16", "textbook")]
    expect = 1 - tb["bytes"] / tot[("fp32", "textbook")]["bytes"]
    assert tb["saving_vs_fp32"] == pytest.approx(expect)
    # under autocast the parameters stay fp32 and copies are added: autocast saves less than the textbook
    assert tot[("bf16", "projected")]["saving_vs_fp32"] < tb["saving_vs_fp32"]
    assert proj["assumptions"] and all(isinstance(a, str) for a in proj["assumptions"])


def test_projection_from_autocast_run_uses_its_dtype_mix() -> None:
    mem, tr = run_rows("bf16")
    assert infer_mode(mem) == "bf16"
    proj = project(mem, {}, facts=tr.model_facts())  # mode inferred: no config in the summary
    r = records(proj)
    assert proj["measured_mode"] == "bf16"
    bf16_acts = B * (D_IN + D_HID) * 2
    assert r[("bf16", "measured", T.ACTIVATIONS)] == r[("bf16", "projected", T.ACTIVATIONS)] == bf16_acts
    assert r[("fp32", "projected", T.ACTIVATIONS)] == 2 * bf16_acts
    copies = D_HID * D_OUT * 2  # only the second Linear's copy is kept (x needs no gradient)
    assert r[("bf16", "measured", T.AUTOCAST_WEIGHT_COPIES)] == copies
    assert r[("fp16", "projected", T.AUTOCAST_WEIGHT_COPIES)] == copies
    assert r[("fp8", "projected", T.AUTOCAST_WEIGHT_COPIES)] == 0
    assert r[("bf16", "measured", T.PARAMETERS)] == 4 * N_MLP  # autocast keeps fp32 parameters


class LlamaBlock(nn.Module):
    """A Llama-style block written out: separate q, k and v projections of one normalised input, the softmax in
    fp32 (as HF Llama's eager attention asks) before the matmul with v, and a gated MLP whose gate and up read
    one input."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm1(x)
        q, k, v = (
            z(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (self.q, self.k, self.v)
        )
        att = (q @ k.transpose(-2, -1)).softmax(dim=-1, dtype=torch.float32)  # (B, H, T, T), as Llama's
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def test_fp32_projected_from_an_fp16_run_is_what_the_fp32_run_saves() -> None:
    """A tiny Llama's fp16 verdict read "FP32 needs 448 KiB more" where its fp32 run needed ~133 KiB more: the
    projection doubled every 16-bit saved tensor for fp32, but under autocast q, k and v each save their own fp16
    copy of the one fp32 input (gate and up too), and the matmul after the fp32 softmax a copy of its output,
    which the softmax saves too: fp32 saves each of those tensors once. Projected from the fp16 run, fp32's
    activations are now what a real fp32 run of the same model and batch saves, counted by walking autograd's
    graph (each storage once, parameters and buffers left out)."""
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))
    rows: dict[str, list[dict[str, Any]]] = {}
    expected: dict[str, int] = {}
    for mode, dtype in (("fp16", torch.float16), ("fp32", None)):
        torch.manual_seed(0)
        model = TinyLlama()
        tr = MemoryTracker(model)
        tr.attach()
        tr.begin_step(0, True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=dtype is not None):
            logits = model(idx)
        exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        expected[mode] = saved_by_autograd(logits, exclude)
        logits.float().square().mean().backward()
        rows[mode] = tr.end_step(0)
        tr.detach()
    fp16 = T.frame("memory", rows["fp16"])
    summary = {T.SUMMARY_CONFIG: {"precision": "fp16"}}
    r = records(project(fp16, summary, facts={"n_params": sum(p.numel() for p in model.parameters())}))
    fp32_acts = total(rows["fp32"], T.ACTIVATIONS)
    assert fp32_acts == expected["fp32"]  # the fp32 run's own count: no weight copies without autocast
    assert r[("fp32", "projected", T.ACTIVATIONS)] == fp32_acts
    # the doubling it replaced: every 16-bit byte twice, the fp32 ones once
    held = T.memory_at(fp16)
    acts = held[held[T.COMPONENT] == T.ACTIVATIONS]
    doubled = sum(
        b * (2 if dt == "float16" else 1) for dt, b in zip(acts[T.DTYPE], acts[T.BYTES], strict=True)
    )
    dim, tokens, heads = 16, 2 * 12, 2
    # per block: k's and v's copies of q's input, up's of gate's, and the probabilities' copy: 16-bit bytes
    copies = 2 * (3 * tokens * dim + heads * 12 * 12 * 2) * 2
    assert doubled - fp32_acts == 2 * copies
    assert r[("fp16", "projected", T.ACTIVATIONS)] == total(rows["fp16"], T.ACTIVATIONS)
    ids = idx.numel() * 8  # the embedding's int64 indices, the same in every mode
    assert r[("fp16-pure", "projected", T.ACTIVATIONS)] == (fp32_acts - ids) // 2 + ids  # 16-bit floats, once


def conv_bn(norm: Callable[[int], nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), norm(8), nn.ReLU()
    )


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, nn.InstanceNorm2d])
def test_a_batchnorm_cnn_projected_to_bf16_saves_what_a_bf16_autocast_run_saves(
    norm: Callable[[int], nn.Module],
) -> None:
    """Autocast has no rule for batch_norm or instance_norm: they run in their input's dtype, a 16-bit conv
    output, and save it in 16-bit. Taken for fp32 modules, a conv-BN-ReLU net's bf16 activations were projected
    at 1.5x what a bf16 autocast run saves."""
    x = torch.randn(4, 3, 8, 8)

    def saved(autocast: bool) -> tuple[int, dict[str, Any]]:
        model = conv_bn(norm)
        tr = MemoryTracker(model)
        tr.attach()
        tr.begin_step(0, True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        expected = saved_by_autograd(out, exclude)  # autograd's own count, activations and weight copies
        out.float().square().mean().backward()
        rows = tr.end_step(0)
        tr.detach()
        assert total(rows, T.ACTIVATIONS) + total(rows, T.AUTOCAST_WEIGHT_COPIES) == expected
        return total(rows, T.ACTIVATIONS), {"rows": rows, "facts": tr.model_facts()}

    fp32_acts, fp32 = saved(autocast=False)
    bf16_acts, _ = saved(autocast=True)
    proj = project(T.frame("memory", fp32["rows"]), {T.SUMMARY_CONFIG: {"precision": "fp32"}}, fp32["facts"])
    projected = records(proj)[("bf16", "projected", T.ACTIVATIONS)]
    # the norms' per-channel statistics (BatchNorm's mean and 1/std: 2 x 8 fp32 values) stay fp32 under
    # autocast; the projection halves them with the rest, 32 bytes per norm
    stats = 2 * 8 * 4 // 2 if norm is nn.BatchNorm2d else 0
    assert bf16_acts - projected == 2 * stats
    assert fp32_acts > 1.9 * bf16_acts


class _Lora(nn.Module):
    """A frozen base Linear held in bf16 and a trained fp32 low-rank adapter beside it (LoRA's usual recipe:
    the base loaded in bf16, peft's adapters in fp32, trained under bf16 autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(64, 64).to(torch.bfloat16).requires_grad_(False)
        self.down = nn.Linear(64, 4, bias=False)
        self.up = nn.Linear(4, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def test_a_frozen_bf16_base_under_fp32_adapters_is_an_autocast_run() -> None:
    """LoRA on a bf16 base under bf16 autocast: the frozen base is most of the parameter bytes, and the run
    was taken for bf16-pure ("mixed precision was not active"), its base projected at fp32 size in its own
    mode (92 KiB projected against 48 KiB measured). Its gradients are fp32: an autocast run, whose frozen
    16-bit parameters stay as measured in the modes that do not make every weight 16-bit."""
    torch.manual_seed(0)
    model = _Lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tr = MemoryTracker(model, opt)
    tr.attach()
    rows = []
    for step in range(2):
        tr.begin_step(step, True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 64)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows += tr.end_step(step)
    tr.detach()
    mem = T.frame("memory", rows)
    assert infer_mode(mem) == "bf16"
    proj = project(mem, {T.SUMMARY_CONFIG: {"precision": "bf16"}}, facts=tr.model_facts())
    r = records(proj)
    base, adapters = 64 * 64 + 64, 64 * 4 * 2
    assert r[("bf16", "measured", T.PARAMETERS)] == 2 * base + 4 * adapters
    assert r[("bf16", "projected", T.PARAMETERS)] == r[("bf16", "measured", T.PARAMETERS)]
    assert r[("fp32", "projected", T.PARAMETERS)] == 2 * base + 4 * adapters
    assert r[("bf16-pure", "projected", T.PARAMETERS)] == 2 * (base + adapters)
    assert not any("was not active" in a for a in proj["assumptions"])
    assert any(f"{base:,} frozen parameter elements held in 16-bit" in a for a in proj["assumptions"])


def test_projection_from_pure_run_and_round_trip_through_summary() -> None:
    mem, tr = run_rows("bf16-pure")
    assert infer_mode(mem) == "bf16-pure"
    summary: dict[str, Any] = {T.SUMMARY_MEMORY: {"model": tr.model_facts()}}
    proj = project(mem, summary)
    r = records(proj)
    assert r[("bf16-pure", "measured", T.PARAMETERS)] == r[("bf16-pure", "projected", T.PARAMETERS)]
    assert r[("fp32", "projected", T.PARAMETERS)] == 4 * N_MLP
    # plain AdamW on bf16 parameters: bf16 moments (two per element) and an fp32 step counter per tensor,
    # which the pure modes keep (they projected fp32 moments in the run's own mode: 8 N + 16); the other modes
    # have fp32 parameters, and fp32 moments with them
    moments = torch.optim.AdamW([nn.Parameter(torch.zeros(N_MLP, dtype=torch.bfloat16))])
    moments.param_groups[0]["params"][0].grad = torch.zeros(N_MLP, dtype=torch.bfloat16)
    moments.step()
    bf16_moments = sum(t.nbytes for t in moments.state[moments.param_groups[0]["params"][0]].values()) - 4
    assert r[("bf16-pure", "measured", T.OPTIMIZER_STATES)] == bf16_moments + 4 * 4 == 4 * N_MLP + 16
    assert r[("bf16-pure", "projected", T.OPTIMIZER_STATES)] == 4 * N_MLP + 16
    assert r[("fp16-pure", "projected", T.OPTIMIZER_STATES)] == 4 * N_MLP + 16
    assert r[("fp32", "projected", T.OPTIMIZER_STATES)] == r[("bf16", "projected", T.OPTIMIZER_STATES)]
    assert r[("fp32", "projected", T.OPTIMIZER_STATES)] == 2 * bf16_moments + 4 * 4
    # summary.json round trip: stored block feeds a re-render with the same result
    summary[T.SUMMARY_MEMORY] = proj
    again = project(mem, summary)
    assert again["records"] == proj["records"]
    assert T.SUMMARY_MEMORY in summary and pd.DataFrame(proj["records"]).shape[1] == 4


class UpcastRMSNorm(nn.Module):
    """An RMSNorm as transformers writes it: computed in fp32 whatever its input, its output cast back."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class UpcastLM(nn.Module):
    """A causal LM as transformers writes one: an upcasting final norm, and given labels, the loss computed in its
    forward on ``logits.float()``."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)
        self.norm = UpcastRMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(F.gelu(self.fc(self.emb(idx)))))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def test_a_pure_run_projects_the_fp32_tensors_its_code_keeps_at_4_bytes(tmp_path: Path) -> None:
    """A whole-bf16 Hugging Face causal LM (tester h65, a LoRA Llama) saved 99,076 B where its own bf16-pure
    projection read 57,986 B: the projection halved every float saved tensor, the fp32 ones its code computes
    (the loss on logits.float(), the RMSNorm's upcast) among them. Projected from the pure run, both pure modes'
    activations are what the run saves, counted with autograd's own saved-tensor hooks."""
    torch.manual_seed(0)
    model = UpcastLM().to(torch.bfloat16)
    idx = torch.randint(0, 64, (2, 8))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[torch.dtype, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = (t.dtype, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    acts = sum(b for _, b in saved.values())
    assert sum(b for dt, b in saved.values() if dt == torch.float32) >= 2 * 8 * 64 * 4  # the log-softmax
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False) as prof:
        for _ in range(2):
            loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.item())
    prof.save(tmp_path / "run")
    summary = T.read_summary(tmp_path / "run")
    r = records(summary[T.SUMMARY_MEMORY])
    assert summary[T.SUMMARY_MEMORY]["measured_mode"] == "bf16-pure"
    assert r[("bf16-pure", "measured", T.ACTIVATIONS)] == acts
    assert r[("bf16-pure", "projected", T.ACTIVATIONS)] == acts
    assert r[("fp16-pure", "projected", T.ACTIVATIONS)] == acts  # fp16 takes bf16's bytes; fp32 stays fp32


def test_projection_keeps_a_measured_master_copy_for_pure_modes() -> None:
    n = 1000
    rows = [
        {T.STEP: 4, T.COMPONENT: T.PARAMETERS, T.MODULE: "", T.DTYPE: "bfloat16", T.BYTES: 2 * n},
        {T.STEP: 4, T.COMPONENT: T.GRADIENTS, T.MODULE: "", T.DTYPE: "bfloat16", T.BYTES: 2 * n},
        {T.STEP: 4, T.COMPONENT: T.MASTER_WEIGHTS, T.MODULE: "", T.DTYPE: "float32", T.BYTES: 4 * n},
        {T.STEP: 4, T.COMPONENT: T.OPTIMIZER_STATES, T.MODULE: "", T.DTYPE: "float32", T.BYTES: 8 * n},
        {T.STEP: 4, T.COMPONENT: T.ACTIVATIONS, T.MODULE: "fc", T.DTYPE: "bfloat16", T.BYTES: 600},
        {T.STEP: 4, T.COMPONENT: T.ACTIVATIONS, T.MODULE: "drop", T.DTYPE: "bool", T.BYTES: 100},
        {T.STEP: 4, T.COMPONENT: T.ACTIVATIONS, T.MODULE: "(loss)", T.DTYPE: "float32", T.BYTES: 40},
    ]
    proj = project(T.frame("memory", rows), {T.SUMMARY_CONFIG: {"precision": "bf16-pure"}})
    r = records(proj)
    assert proj["n_params"] == n and proj["measured_mode"] == "bf16-pure"
    assert r[("bf16-pure", "measured", T.MASTER_WEIGHTS)] == r[("fp16-pure", "projected", T.MASTER_WEIGHTS)]
    assert r[("bf16-pure", "projected", T.MASTER_WEIGHTS)] == 4 * n
    assert r[("fp32", "projected", T.MASTER_WEIGHTS)] == r[("bf16", "projected", T.MASTER_WEIGHTS)] == 0
    # a bool dropout mask takes 100 bytes in every mode, the fp32 loss 40; 300 bf16 elements take 1200
    # bytes in fp32
    assert r[("fp32", "projected", T.ACTIVATIONS)] == 1200 + 100 + 40
    assert r[("bf16-pure", "projected", T.ACTIVATIONS)] == 600 + 100 + 40
    # the textbook halves every float activation, the loss included
    assert r[("fp32", "textbook", T.ACTIVATIONS)] == 1200 + 100 + 40
    assert r[("bf16", "textbook", T.ACTIVATIONS)] == 600 + 100 + 20
    # module classes unknown (no facts): under autocast the "fc" tensors are assumed to stay fp32
    assert r[("bf16", "projected", T.ACTIVATIONS)] == 1200 + 100 + 40


def test_scope_records_a_loss_computed_outside_the_model() -> None:
    model = mlp()
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    x, y = batch()
    out = model(x)
    with tr.scope():
        loss = F.mse_loss(out, y)
    with tr.scope():
        no_grad_needed = (y * 2).sum()  # nothing requiring grad: nothing saved
    loss.backward()
    rows = tr.end_step(0)
    tr.begin_step(1, False)
    with tr.scope():  # not sampled: inert
        F.mse_loss(model(x), y).backward()
    assert tr.end_step(1) == []
    tr.detach()
    assert no_grad_needed.item() == pytest.approx(2 * y.sum().item())
    # mse_loss saves its input (the model output, (B, D_OUT) fp32) and the target (B, D_OUT) fp32
    assert by_module(rows) == {
        ("0", "float32"): B * D_IN * 4,
        ("1", "float32"): B * D_HID * 4,
        ("(loss)", "float32"): 2 * B * D_OUT * 4,
    }
    assert_no_hooks(model)


def test_projection_when_mixed_precision_was_asked_for_but_not_active() -> None:
    """accelerate ignores fp16=True on a CPU: the config says fp16, the tensors are fp32."""
    mem, tr = run_rows("fp32")
    proj = project(mem, {T.SUMMARY_CONFIG: {"precision": "fp16"}}, facts=tr.model_facts())
    r = records(proj)
    fp32_acts = B * (D_IN + D_HID) * 4
    assert proj["measured_mode"] == "fp16"
    assert r[("fp16", "measured", T.ACTIVATIONS)] == fp32_acts
    assert r[("fp16", "projected", T.ACTIVATIONS)] == fp32_acts // 2  # what fp16 would take once active
    assert any(a.startswith("fp16 was asked for but the measured") for a in proj["assumptions"])
    # a user's own loop asks nothing: fp16 is what the profiler saw (it read 'fp16 was asked for')
    seen = project(mem, {T.SUMMARY_CAPTURE: {"precision_seen": "fp16"}}, facts=tr.model_facts())
    assert seen["measured_mode"] == "fp16"
    assert any(a.startswith("fp16 was seen but the measured tensors look like") for a in seen["assumptions"])
    assert not any("asked for" in a for a in seen["assumptions"])


def test_projection_of_an_empty_table() -> None:
    proj = project(T.empty("memory"), {})
    assert proj["step"] is None and proj["n_params"] == 0
    assert all(rec["bytes"] == 0 for rec in proj["records"])


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        (lambda: nn.Linear(2, 2), "matmul"),
        (lambda: nn.Conv2d(1, 1, 3), "matmul"),
        (lambda: nn.GELU(), "elementwise"),
        (lambda: nn.Dropout(), "elementwise"),
        (lambda: nn.LayerNorm(2), "fp32"),
        (lambda: nn.GroupNorm(1, 2), "fp32"),
        (lambda: nn.BatchNorm2d(2), "elementwise"),
        (lambda: nn.SyncBatchNorm(2), "elementwise"),
        (lambda: nn.InstanceNorm1d(2), "elementwise"),
        (lambda: nn.CrossEntropyLoss(), "fp32"),
        (lambda: nn.Embedding(3, 2), "other"),
        (lambda: nn.Sequential(nn.Linear(2, 2)), "other"),
    ],
)
def test_module_class(factory: Callable[[], nn.Module], expected: str) -> None:
    assert module_class(factory()) == expected


def test_hf_gpt2_conv1d_weight_copies_and_saved_tensors() -> None:
    """Hugging Face GPT-2 uses its own Conv1D (addmm on the weight, no transpose) and computes the loss inside
    forward; its tied lm_head is a Linear on the embedding's Parameter."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    conv1d = [m for m in model.modules() if type(m).__name__ == "Conv1D"]
    assert conv1d and all(module_class(m) == "matmul" for m in conv1d)
    tr = MemoryTracker(model)
    tr.attach()
    tr.begin_step(0, True)
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, labels=idx).loss
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    expected = saved_by_autograd(loss, exclude)
    loss.backward()
    rows = tr.end_step(0)
    tr.detach()
    assert total(rows, T.ACTIVATIONS) + total(rows, T.AUTOCAST_WEIGHT_COPIES) == expected
    # every Conv1D weight and the (tied) head weight keep a bf16 copy: the first matmul's input, the
    # embedding output, requires grad
    matmul_weights = sum(m.weight.numel() for m in conv1d) + model.lm_head.weight.numel()
    assert total(rows, T.AUTOCAST_WEIGHT_COPIES, dtype="bfloat16") == 2 * matmul_weights
    assert tr.model_facts()["matmul_weight_numel"] == matmul_weights


def test_a_detached_tracker_keeps_nothing_alive() -> None:
    """After detach, dropping the model and the tracker frees the model at once (reference counting), without
    waiting for the garbage collector: no hook closure or bound method of the tracker refers back to it."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    tr = MemoryTracker(model, None)
    tr.attach()
    tr.begin_step(0, True)
    x = torch.randn(4, 8)
    F.mse_loss(model(x), x).backward()
    tr.end_step(0)
    tr.detach()
    alive = weakref.ref(model), weakref.ref(tr)
    was = gc.isenabled()
    gc.disable()
    try:
        del model, tr
        assert alive[0]() is None and alive[1]() is None
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("tracked", [False, True])
def test_a_forward_never_backpropagated_is_freed(tracked: bool) -> None:
    """An evaluation with grad on in a sampled step (``model.eval()`` without ``no_grad``), whose output the loop
    drops without a backward: a tensor an op saves as its own output (ReLU's, sigmoid's) was kept by the pack
    hook as itself, holding its backward node, which held it, a cycle that even ``gc.collect()`` cannot free:
    the evaluation's activations stayed allocated for the rest of the run. They are freed when dropped, as
    without the tracker."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Sigmoid())
    outputs: list[weakref.ref[torch.Tensor]] = []
    model[1].register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    model[3].register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    tr = MemoryTracker(model, None)
    tr.attach()
    tr.begin_step(0, tracked)
    model.eval()
    model(torch.randn(4, 8)).sum()
    gc.collect()
    assert len(outputs) == 2 and all(o() is None for o in outputs)
    tr.end_step(0)
    tr.detach()


def test_a_tensor_on_a_smaller_storage_at_the_same_address_is_read_again() -> None:
    """The memo of storages and the steady components' fingerprint key a tensor by its id, data pointer and
    size: the same object at the same address on a storage of half the bytes (a state freed and made anew in
    bf16 where the allocator put the fp32 one: the suite met it, one run in about 60) is read again."""
    whole = torch.UntypedStorage(800)
    half = whole[0:400]  # the same memory, the same address, half the bytes
    assert half.data_ptr() == whole.data_ptr()
    t = torch.empty(0).set_(whole, 0, (200,))
    memo, steady, computed = storage.StorageMemo(), storage.Steady(), []

    def compute() -> int:
        computed.append(1)
        return storage._by_dtype([t], storage=memo)["float32"]

    assert memo(t) == (whole.data_ptr(), 800) and steady.get([t], compute) == 800
    assert steady.get([t], compute) == 800 and len(computed) == 1  # unchanged: not computed again
    t.set_(half, 0, (100,))
    assert t.data_ptr() == whole.data_ptr()
    assert memo(t) == (whole.data_ptr(), 400) and steady.get([t], compute) == 400 and len(computed) == 2


def test_steady_components_follow_the_tensors_step_after_step() -> None:
    """Parameters, buffers, master weights and optimizer states are computed again only when those tensors
    changed (``storage.Steady``): every step's rows equal a fresh tracker's over a run where the states appear
    (none at the first step's start), the model is cast to bf16 between steps and its states made anew, a
    parameter gets new data on a larger storage, and the optimizer gets a tensor of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.BatchNorm1d(D_HID), nn.Linear(D_HID, D_OUT))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tr = MemoryTracker(model, opt)
    tr.attach()
    steady = (T.PARAMETERS, T.BUFFERS, T.MASTER_WEIGHTS, T.OPTIMIZER_STATES)
    extra = nn.Parameter(torch.zeros(7))

    def fresh(step: int) -> dict[tuple[str, str], int]:
        ref = MemoryTracker(model, opt)  # not attached: walks the model, no cache yet
        ref.begin_step(step, True)
        return {(c, dt): b for (c, dt), b in by_component(ref.end_step(step)).items() if c in steady}

    def by_component(rows: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
        return {(r[T.COMPONENT], r[T.DTYPE]): r[T.BYTES] for r in rows if r[T.MODULE] == ""}

    seen = []
    try:
        for step in range(6):
            if step == 2:
                model.to(torch.bfloat16)  # new storages, another dtype
                opt.state.clear()  # and new states, made by this step's optimizer step
            if step == 3:
                model[2].weight.data = torch.zeros(D_OUT, 2 * D_HID, dtype=torch.bfloat16)[:, :D_HID]
            if step == 4:
                opt.add_param_group({"params": [extra]})  # a tensor of the optimizer's alone
            x, y = batch(step + 1)
            _, rows = one_step(model, opt, tr, step, x=x.to(model[0].weight.dtype), y=y)
            got = {k: b for k, b in by_component(rows).items() if k[0] in steady}
            assert got == fresh(step), step
            seen.append(got)
    finally:
        tr.detach()
    assert seen[0][(T.PARAMETERS, "float32")] == 4 * (
        D_IN * D_HID + D_HID + D_HID * D_OUT + D_OUT + 2 * D_HID
    )
    assert (T.PARAMETERS, "bfloat16") in seen[2] and (T.PARAMETERS, "float32") not in seen[2]
    # the view of a [D_OUT, 2 D_HID] storage counts the whole storage
    assert seen[3][(T.PARAMETERS, "bfloat16")] - seen[2][(T.PARAMETERS, "bfloat16")] == 2 * D_OUT * D_HID
    assert seen[1][(T.BUFFERS, "float32")] == 4 * 2 * D_HID and seen[1][(T.BUFFERS, "int64")] == 8
    assert seen[4][(T.MASTER_WEIGHTS, "float32")] == 4 * 7 and (T.MASTER_WEIGHTS, "float32") not in seen[3]
    assert seen[0][(T.OPTIMIZER_STATES, "float32")] == seen[1][(T.OPTIMIZER_STATES, "float32")] > 0


def test_persistent_labels_follow_the_tensors_step_after_step() -> None:
    """The names of the storages that outlive a step (what the peak's blocks are called) keep the parameters',
    buffers', master weights' and states' labels of the step before while those tensors are the same, and
    equal labels made afresh at every step of a run where the states appear, the model is cast to bf16, a
    parameter gets new data and the optimizer a tensor of its own; gradients are read every time."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.BatchNorm1d(D_HID), nn.Linear(D_HID, D_OUT))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tr = MemoryTracker(model, opt)
    tr.attach()
    extra = nn.Parameter(torch.zeros(7))
    kept = []
    try:
        for step in range(6):
            if step == 2:
                model.to(torch.bfloat16)
                opt.state.clear()
            if step == 3:
                model[2].weight.data = torch.zeros(D_OUT, 2 * D_HID, dtype=torch.bfloat16)[:, :D_HID]
            if step == 4:
                opt.add_param_group({"params": [extra]})
            x, y = batch(step + 1)
            x, y = x.to(model[0].weight.dtype), y.to(model[0].weight.dtype)
            model(x).float().sub(y.float()).square().mean().backward()  # gradients that exist now
            labels = tr._persistent()
            fresh = storage.persistent_labels(
                list(model.parameters()), list(model.buffers()), [opt], tr._own, storage._storage
            )
            assert labels == fresh, step
            assert any(lab.component == T.GRADIENTS for lab in labels.values())
            kept.append(tr._steady_labels._value)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        tr.detach()
    # made again where the tensors changed (step 0: no states; 1: states; 2: bf16; 3: new data; 4: a group),
    # kept at step 5
    assert [kept[i] is kept[i - 1] for i in range(1, 6)] == [False, False, False, False, True]


def test_module_tensors_are_parameters_and_buffers_in_order() -> None:
    from precprof.capture.storage import module_tensors

    torch.manual_seed(0)
    emb = nn.Embedding(10, D_IN)
    head = nn.Linear(D_IN, 10, bias=False)
    head.weight = emb.weight  # tied: once
    model = nn.Sequential(emb, nn.LayerNorm(D_IN), nn.BatchNorm1d(4), head)
    params, buffers = module_tensors([m for _, m in model.named_modules()])
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    assert [id(b) for b in buffers] == [id(b) for b in model.buffers()]


def test_a_backward_that_raised_leaves_the_next_pass_its_read_of_the_gradients() -> None:
    """Without an optimizer the gradients are counted when each backward pass ends. A pass that raised (a user's
    check, caught) never ends well, so its queued read never ran and the step's next pass took a read for
    queued: the step counted no gradient once the user set them to None. The next forward clears it."""
    model = mlp()
    tr = MemoryTracker(model, None)
    tr.attach()
    tr.begin_step(0, True)
    x, y = batch()
    h = model[0](x)

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("a check of the user's")

    h.register_hook(fail)
    with pytest.raises(RuntimeError, match="a check of the user's"):
        F.mse_loss(model[1:](h), y).backward()
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    rows = tr.end_step(0)
    tr.detach()
    assert total(rows, T.GRADIENTS) == 4 * N_MLP


def test_every_memory_row_has_a_phase_and_a_moment() -> None:
    """The profiler's own buffers' row had a null phase and moment where every other component's own size has
    "" in both: a reader filtering ``moment == ""`` lost it."""
    import precprof
    from precprof import tables as T

    model = torch.nn.Linear(4, 4)
    with precprof.Profiler(model, sample_every=1) as prof:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            prof.step()
    mem = prof.tables()["memory"]
    assert T.PROFILER_BUFFERS in set(mem[T.COMPONENT])
    assert mem[T.PHASE].notna().all() and mem[T.MOMENT].notna().all()
    assert T.PROFILER_BUFFERS in set(T.memory_at(mem)[T.COMPONENT])


def test_precprofs_own_buffers_in_the_memory_table_are_its_tensors_alone() -> None:
    """The row added the memory tracker's host Python objects (storage addresses, hook handles: sys.getsizeof)
    to the device bytes of precprof's statistics rows and scratch: 57 KB beside 42 KB of tensors on a CPU MLP."""
    model = mlp()
    with precprof.Profiler(model, sample_every=1) as prof:
        model(torch.randn(B, D_IN)).sum().backward()
        prof.step()
        mem = prof.tables()["memory"]
        row = int(mem[mem[T.COMPONENT] == T.PROFILER_BUFFERS][T.BYTES].iloc[-1])
        tensors = prof._buffer.buffer_bytes + prof.scratch_bytes
        tensors += prof._updates.nbytes if prof._updates is not None else 0
        assert prof._tracker is not None and prof._tracker.buffer_bytes > 0  # the host objects exist
    assert row == tensors


def test_memory_off_records_no_memory_and_the_report_says_it_was_off(tmp_path: Path) -> None:
    """``Profiler(memory=False)`` still wrote one memory row a step, precprof's own buffers: the report drew a
    Memory section "measured" from it, projected 0 B for every mode, and the verdict read "fp32 0 B". The run
    has no memory table rows, and the page says memory was turned off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for _ in range(2):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    assert prof.tables()["memory"].empty
    page = prof.report(tmp_path / "run").read_text()
    memory = page.split('id="memory"', 1)[1].split("</section>", 1)[0]
    assert "No memory was recorded. Profiler(memory=False) turned it off." in memory
    assert " 0 B" not in page


@pytest.mark.parametrize("around", ["user_hooks", "checkpoint"])
def test_saved_tensor_hooks_around_the_model_call_stay_in_force(around: str, tmp_path: Path) -> None:
    """``save_on_cpu()`` (or any pack hook: offloading, fp8 compression) around the model call, and a checkpoint
    of the whole model: on a sampled step the tracker pushed its own saved-tensor hooks in the model's forward
    pre-hook, and autograd calls only the innermost pair, so the user's hooks saw 1 tensor of 6 and the
    checkpoint kept every activation instead of recomputing them: memory changed on exactly the sampled steps,
    and the memory table described a run that does not exist. Their hooks now stay in force; the activations
    are not measured, and the report says why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    packed: list[int] = []
    forwards = [0]
    model[0].register_forward_hook(lambda m, a, o: forwards.__setitem__(0, forwards[0] + 1))

    def pack(t: torch.Tensor) -> tuple[str, torch.Tensor]:
        packed[-1] += 1
        return ("mine", t)

    def step(prof: precprof.Profiler | None) -> tuple[int, int]:
        packed.append(0)
        forwards[0] = 0
        x = torch.randn(8, 32)
        if around == "user_hooks":
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[1]):
                loss = model(x).pow(2).mean()
        else:
            loss = checkpoint(model, x.requires_grad_(), use_reentrant=False).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if prof is not None:
            prof.step(loss=loss.detach())
        return packed[-1], forwards[0]

    without = [step(None) for _ in range(2)]
    with precprof.Profiler(model, optimizer=opt, sample_every=2, out=tmp_path / "run") as prof:
        with_it = [step(prof) for _ in range(4)]
    assert with_it == without * 2  # the same tensors packed, the same forwards run again in the backward
    assert without[0] == ((6, 1) if around == "user_hooks" else (0, 2))
    memory = prof.tables()["memory"]
    assert not (memory[T.COMPONENT] == T.ACTIVATIONS).any()
    page = prof.report(tmp_path / "run").read_text()
    assert "Saved activations not measured: the model&#39;s forward ran under saved-tensor hooks" in page


def test_a_lora_runs_textbook_counts_the_gradients_that_train_and_the_page_says_how_many(
    tmp_path: Path,
) -> None:
    """A LoRA model (a frozen base, trained adapters): the textbook table gave gradients of every parameter, 4N
    and 2N, beside the adapters' few measured, and its saving came from those; nothing on the page said how many
    parameters train (tester h65: 8,704 of 115,520). The textbook's gradients and optimizer states are now of
    the parameters that train, and the Environment's model size and the memory section say how many do."""
    torch.manual_seed(0)
    model = _Lora()
    trained = [p for p in model.parameters() if p.requires_grad]
    n_all, n_train = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in trained)
    assert n_train < n_all
    opt = torch.optim.AdamW(trained, lr=1e-3)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, out=tmp_path / "run") as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(8, 64)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
    prof.save()
    summary = T.read_summary(tmp_path / "run")
    r = records(project(T.read_run(tmp_path / "run").tables["memory"], summary))
    # AdamW's two fp32 moments of each trained element, and one step counter of each trained tensor
    states = sum(8 * p.numel() + 4 for p in trained)
    assert (
        r[("fp32", "textbook", T.PARAMETERS)] == 4 * n_all
        and r[("bf16", "textbook", T.PARAMETERS)] == 2 * n_all
    )
    assert (
        r[("fp32", "textbook", T.GRADIENTS)] == 4 * n_train
        and r[("bf16", "textbook", T.GRADIENTS)] == 2 * n_train
    )
    assert r[("fp32", "textbook", T.OPTIMIZER_STATES)] == states
    page = pipeline.rerender(tmp_path / "run").read_text()
    said = f"{n_train:,} of {n_all:,} parameters train ({100 * n_train / n_all:.3g}%), {n_all - n_train:,} frozen"
    assert page.count(said) == 2  # the Environment's model size and the memory section's textbook table
