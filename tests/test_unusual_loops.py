"""Training loops that run the model in unusual ways (through torch.func transforms, two models sharing one
GradScaler, ...): precprof records what it can read of them exactly, skips and counts what it cannot, and never
ends the training."""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from cast_counts import counts
from torch import nn
from torch.func import functional_call, grad, vmap

import precprof
from precprof import clipwatch
from precprof import tables as T


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _transformed_step(model: nn.Module, transform: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step's gradients into ``.grad`` through ``transform``: ``grad`` (a torch.func training loop, meta-
    learning), ``vmap`` (a batched forward, then an ordinary backward), ``vmap_grad`` (DP-SGD's per-sample
    gradients, averaged)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (xi,)), yi)

    if transform == "vmap":
        F.cross_entropy(vmap(model)(x), y).backward()
        return
    if transform == "grad":
        g = grad(loss)(params, x, y)
    else:
        per_sample = vmap(grad(lambda p, xi, yi: loss(p, xi[None], yi[None])), in_dims=(None, 0, 0))(
            params, x, y
        )
        g = {k: v.mean(0) for k, v in per_sample.items()}
    for k, p in model.named_parameters():
        p.grad = g[k]


@pytest.mark.parametrize("transform", ["grad", "vmap", "vmap_grad"])
def test_a_model_run_under_torch_func_transforms_is_skipped_and_counted_not_a_crash(transform: str) -> None:
    """Inside ``torch.func.grad`` or ``vmap`` the hooks see functorch's wrappers, plain ``torch.Tensor``s to every
    other test but without a storage: the first sampled step raised ``Cannot access data pointer of Tensor that
    doesn't have storage`` from the forward pre-hook. Those reads are skipped and counted, with why; the weights
    and the gradients the optimizer applied are read as in any loop (checked against real casts), and training
    is bitwise that of the loop without precprof."""
    steps = 3
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(steps)]

    came_back: dict[
        str, int
    ] = {}  # gradients that came back to each module's output, by a hook of the test's

    def came(name: str) -> Any:
        def fwd(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(lambda g: came_back.__setitem__(name, came_back.get(name, 0) + 1))

        return fwd

    def train(profiled: bool) -> tuple[list[torch.Tensor], dict[tuple[int, str], dict[str, float]], Any]:
        model = _mlp()
        if profiled:
            for name, child in model.named_children():
                child.register_forward_hook(came(name))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        applied: dict[tuple[int, str], dict[str, float]] = {}
        names = {id(p): n for n, p in model.named_parameters()}
        at = [0]

        def read(o: Any, args: Any, kwargs: Any) -> None:
            for p in o.param_groups[0]["params"]:
                applied[(at[0], names[id(p)])] = counts(p.grad)

        opt.register_step_pre_hook(read)
        prof = (
            precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=True) if profiled else None
        )
        if prof is not None:
            prof.attach()
        for i, (x, y) in enumerate(data):
            at[0] = i
            _transformed_step(model, transform, x, y)
            opt.step()
            opt.zero_grad()
            if prof is not None:
                prof.step()
        if prof is not None:
            prof.detach()
        return [p.detach().clone() for p in model.parameters()], applied, prof

    plain, _, _ = train(False)
    weights, applied, prof = train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, weights, strict=True))
    layers = prof.tables()["layers"]
    grads = layers[layers[T.TENSOR] == T.WEIGHT_GRAD]
    assert len(grads) == steps * 4
    for row in grads.itertuples(index=False):
        want = applied[(row.step, f"{row.module}.{row.param}")]
        got = row._asdict()
        assert {k: got[k] for k in want} == want, (row.step, row.module, row.param)
    # every module output and linear input (a row of its own with block formats on) ran inside the transform:
    # one wrapper each per step; so did the gradient that came back to each output (it was left out unsaid)
    skipped = {(s["module"], s["tensor"]): s["count"] for s in prof.skipped_tensors()}
    assert skipped == {
        **{(m, T.ACTIVATION): steps for m in ("0", "0:input", "1", "2", "2:input")},
        **{(m, T.ACTIVATION_GRAD): n for m, n in came_back.items()},
    }
    assert transform == "vmap" or came_back == {m: steps for m in ("0", "1", "2")}
    assert {s["reason"] for s in prof.skipped_tensors()} == {
        "a tensor inside a torch.func transform (grad, vmap, jacrev): a wrapper without a storage of its own"
    }
    assert not (layers[T.TENSOR].isin([T.ACTIVATION, T.ACTIVATION_GRAD])).any()


class _SharedScalerGan:
    """A GAN whose two optimizers share one GradScaler (torch's AMP recipe for several models), one Profiler per
    model. ``truth`` holds, per step, the scale the step ran at, whether each optimizer's step was skipped
    (its weights unmoved) and G's first weight gradient's absmax, unscaled by hand."""

    def __init__(self, growth_interval: int) -> None:
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.D = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.oG = torch.optim.Adam(self.G.parameters(), 1e-3)
        self.oD = torch.optim.Adam(self.D.parameters(), 1e-3)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=growth_interval)
        self.pG = precprof.Profiler(self.G, optimizer=self.oG, scaler=self.scaler, sample_every=1).attach()
        self.pD = precprof.Profiler(self.D, optimizer=self.oD, scaler=self.scaler, sample_every=1).attach()
        self.truth: list[tuple[float, bool, bool, float]] = []

    def step(self, inf_in: str = "") -> None:
        """One step of both models; ``inf_in`` "D" or "G": that model's loss is made infinite."""
        real, z = torch.randn(8, 16), torch.randn(8, 8)
        bce = F.binary_cross_entropy_with_logits
        scale = self.scaler.get_scale()
        fake = self.G(z)
        d_loss = bce(self.D(real), torch.ones(8, 1)) + bce(self.D(fake.detach()), torch.zeros(8, 1))
        self.oD.zero_grad()
        self.scaler.scale(d_loss * (math.inf if inf_in == "D" else 1.0)).backward()
        d_before = self.D[0].weight.detach().clone()
        self.scaler.step(self.oD)
        g_loss = bce(self.D(fake), torch.ones(8, 1))
        self.oG.zero_grad()
        self.scaler.scale(g_loss * (math.inf if inf_in == "G" else 1.0)).backward()
        g_absmax = float((self.G[0].weight.grad / scale).abs().max())
        g_before = self.G[0].weight.detach().clone()
        self.scaler.step(self.oG)
        self.scaler.update()
        d_skipped = torch.equal(d_before, self.D[0].weight)
        self.truth.append((scale, d_skipped, torch.equal(g_before, self.G[0].weight), g_absmax))
        for prof, loss in ((self.pG, g_loss), (self.pD, d_loss)):
            if prof.attached:
                prof.step(loss=loss)


@pytest.mark.parametrize("first", ["D", "G"])
def test_two_profilers_sharing_a_grad_scaler_each_keeps_reading_it_once_the_other_is_detached(
    first: str,
) -> None:
    """Detaching one Profiler removed the other's wrapper of ``scaler.update`` with its own: the one left read the
    scale after ``update()`` (twice the scale of every step the scaler grew at, the gradients unscaled by it:
    absmax half the true one) and saw no skipped step. Each takes out its own wrapper alone; checked against the
    scale each step ran at, the skips seen in the weights and the gradient unscaled by hand."""
    gan = _SharedScalerGan(growth_interval=1)  # grows at every step it does not skip
    for i in range(6):
        if i == 2:
            (gan.pD if first == "D" else gan.pG).detach()
        gan.step(inf_in=("G" if first == "D" else "D") if i == 4 else "")  # the one left skips step 4
    left = gan.pG if first == "D" else gan.pD
    left.detach()
    assert "update" not in vars(gan.scaler) and "__getstate__" not in vars(gan.scaler)
    steps = left.tables()["steps"]
    assert steps[T.LOSS_SCALE].tolist() == [t[0] for t in gan.truth]
    skipped = [t[2] if first == "D" else t[1] for t in gan.truth]
    assert skipped[4] and steps[T.SKIPPED].tolist() == skipped
    if first == "D":
        layers = left.tables()["layers"]
        absmax = layers[
            (layers[T.TENSOR] == T.WEIGHT_GRAD) & (layers[T.MODULE] == "0") & (layers[T.PARAM] == "weight")
        ]
        finite = [i for i, t in enumerate(gan.truth) if not t[2]]
        assert absmax.set_index(T.STEP)[T.ABSMAX].loc[finite].tolist() == pytest.approx(
            [gan.truth[i][3] for i in finite], rel=1e-6
        )


def test_a_step_the_shared_scaler_skipped_for_one_model_alone_is_skipped_for_that_models_profiler_alone() -> (
    None
):
    """The discriminator's gradients overflow: ``scaler.step(oD)`` skips, ``scaler.step(oG)`` applies the
    generator's update. Both Profilers said skipped (the found-inf flags of every optimizer the scaler holds were
    summed): each now reads its own optimizer's."""
    gan = _SharedScalerGan(growth_interval=1000)
    for i in range(4):
        gan.step(inf_in="D" if i == 2 else "")
    gan.pG.detach()
    gan.pD.detach()
    assert [t[1] for t in gan.truth] == [False, False, True, False]  # D skipped step 2, G did not
    assert [t[2] for t in gan.truth] == [False] * 4
    assert gan.pD.tables()["steps"][T.SKIPPED].tolist() == [t[1] for t in gan.truth]
    assert gan.pG.tables()["steps"][T.SKIPPED].tolist() == [t[2] for t in gan.truth]


def test_one_profiler_per_gan_model_ends_the_discriminators_run_at_its_last_step() -> None:
    """WGAN with n_critic=3, one Profiler per model, each stepped at its own optimizer's step: the generator's
    last update runs the discriminator's forward and backward after the discriminator's last ``prof.step()``.
    The discriminator's run ended with one step more, "cut off", made of gradients its optimizer never applied
    (the report said "1 cut off" of a run that ended normally). Its run is its optimizer's steps, each with the
    gradient that optimizer applied (checked against real casts)."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    D = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    oG, oD = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    applied: dict[tuple[int, str], dict[str, float]] = {}
    names = {id(p): n for n, p in D.named_parameters()}
    d_steps = [0]

    def read(o: Any, args: Any, kwargs: Any) -> None:
        for p in o.param_groups[0]["params"]:
            applied[(d_steps[0], names[id(p)])] = counts(p.grad)

    oD.register_step_pre_hook(read)
    pG = precprof.Profiler(G, optimizer=oG, sample_every=1).attach()
    pD = precprof.Profiler(D, optimizer=oD, sample_every=1).attach()
    for _ in range(2):
        for _ in range(3):
            real, fake = torch.randn(8, 16), G(torch.randn(8, 8)).detach()
            oD.zero_grad()
            (D(fake).mean() - D(real).mean()).backward()
            oD.step()
            d_steps[0] += 1
            pD.step()
        oG.zero_grad()
        (-D(G(torch.randn(8, 8))).mean()).backward()  # through D: its .grad too, which oD never applies
        oG.step()
        pG.step()
    pG.detach()
    pD.detach()
    steps = pD.tables()["steps"]
    assert steps[T.STEP].tolist() == list(range(6)) and not steps[T.CUT_OFF].any()
    grads = pD.tables()["layers"]
    grads = grads[grads[T.TENSOR] == T.WEIGHT_GRAD]
    assert len(grads) == 6 * 4
    for row in grads.itertuples(index=False):
        want = applied[(row.step, f"{row.module}.{row.param}")]
        got = row._asdict()
        assert {k: got[k] for k in want} == want, (row.step, row.module, row.param)


def _notebook_cell(
    model: nn.Module, opt: Any, scaler: Any, bug: int | None, kept: list[Any], steps: int = 3, **kw: Any
) -> Any:
    """A notebook cell with the README's loop at top level: ``prof = Profiler(...).attach()``, train, then
    ``prof.detach()``. With ``bug`` the loop raises in that step after the forward, as a bug in the loss code
    would, and ``prof.detach()`` is never reached. ``kept``: each Profiler, as the notebook's name holds it."""
    torch.manual_seed(1)
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(steps)]
    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, **kw).attach()
    kept.append(prof)
    for i, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y)
        if i == bug:
            raise ValueError("a bug in the loop")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        prof.step(loss)
    prof.detach()
    return prof


def test_a_profiler_left_attached_by_a_loop_that_raised_is_detached_when_the_cell_runs_again() -> None:
    """The cell's loop raised in a sampled step; the user fixed it and ran the cell again, a new Profiler on the
    same model. The first one stayed attached for the whole process: its hooks kept firing beside the new one's,
    ``scaler.update`` stayed wrapped (and ``clip_grad_norm_`` noting for it), and its saved-tensor hooks around
    the model's forward left the new Profiler no activations to measure (it blamed saved-tensor hooks of the
    user's own). Attaching the new one detaches the old one, with a warning: the new run measures what autograd
    saves in the model's forward (the test's own saved-tensor hooks), and nothing of precprof is left after its
    detach."""
    clip = torch.nn.utils.clip_grad_norm_
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(8, 16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    own = sum(saved.values())  # each storage autograd saves in the forward, once, the parameters left out
    assert own == 8 * (16 + 32) * 4  # the input and the tanh's output (the second layer's input), fp32
    kept: list[Any] = []
    with pytest.raises(ValueError, match="a bug in the loop"):
        _notebook_cell(model, opt, scaler, 1, kept, sample_every=1, memory_every=1)
    with pytest.warns(
        UserWarning,
        match=r"attached to Sequential \(676 parameters, in its step 1\) was detached: another Profiler attached",
    ):
        prof = _notebook_cell(model, opt, scaler, None, kept, sample_every=1, memory_every=1)
    memory = prof.tables()["memory"]
    activations = memory[memory[T.COMPONENT] == T.ACTIVATIONS].groupby(T.STEP)[T.BYTES].sum()
    assert activations.to_dict() == {0: own, 1: own, 2: own}
    for mod in model.modules():
        assert not mod._forward_pre_hooks and not mod._forward_hooks
    assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert "update" not in vars(scaler) and torch.nn.utils.clip_grad_norm_ is clip and not clipwatch._watchers
    stale = kept[0]
    assert not stale.attached and stale.status[0] == T.STATUS_INCOMPLETE
    assert "detached when another Profiler attached" in str(stale.status[1])
    assert set(stale.tables()["layers"][T.STEP]) == {0, 1}  # nothing of the second run


def test_two_profilers_nested_on_one_model_say_why_the_first_was_detached() -> None:
    """`with p: with q:` on one model: entering q detaches p, whose warning blamed an early-stopped loop, and
    p.step() inside `with p:` then said "not attached (use `with prof:`)" (t4). Both say that another Profiler
    attached to the same model, one model taking one Profiler at a time; nothing is left on the model, and p
    attached again steps as before."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = precprof.Profiler(model, opt, sample_every=1, memory=False)
    q = precprof.Profiler(model, opt, sample_every=1, memory=False)
    same = "another Profiler attached to the same model, and one model takes one Profiler at a time"
    with (
        pytest.raises(RuntimeError) as e,
        p,
        pytest.warns(UserWarning, match=rf"in its step 0\) was detached: {same}.* not nested"),
        q,
    ):
        F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
        opt.step()
        q.step()
        p.step()
    assert str(e.value) == (
        f"Profiler.step() called while the profiler is not attached: it was detached at its step 0: {same} "
        "(each would record the other's hooks). Detach one before attaching the next (`with` blocks one after "
        "the other, not nested; prof.detach() in a `finally:` where a loop may stop early)"
    )
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with p:  # attached again: its step is its own again
        F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
        opt.step()
        p.step()
    assert p.tables()["steps"][T.STEP].tolist() == [0]  # (detached in its step 0, before its model ran)


def test_a_profiler_never_attached_saves_nothing(tmp_path: Path) -> None:
    """``report(DIR)`` of a Profiler never attached wrote a "complete" run of no step, whose page said to
    re-render with --target for a recommendation (which cannot help) (t4): one line now, nothing written."""
    model = _mlp()
    never = precprof.Profiler(model, torch.optim.SGD(model.parameters(), lr=0.1), out=tmp_path / "out")
    for write in (never.save, never.report):
        with pytest.raises(RuntimeError) as e:
            write(tmp_path / "never")
        assert str(e.value) == (
            "nothing recorded: this Profiler was never attached; attach it (`with prof:` or prof.attach()) and "
            "call prof.step() after each optimizer step first"
        )
        with pytest.raises(RuntimeError, match=r"^nothing recorded: this Profiler was never attached"):
            write()  # its out=
    assert not (tmp_path / "never").exists() and not (tmp_path / "out").exists()


def test_a_compiled_model_compiles_after_a_profiler_its_loop_left_in_a_sampled_step() -> None:
    """The cell builds a model, compiles it and attaches a Profiler; its loop raises in a sampled step, whose
    ``force_eager`` stance then stayed in force for the whole process: the cell run again (a new model, a new
    Profiler) never compiled, nor did any compiled model after it. The new Profiler detaches the old one, whose
    model ran in a step no ``prof.step()`` ended while the new one took two steps: the steps it does not sample
    after that compile (Dynamo's graphs, counted by the test's own backend), and the stance after it is the one
    before."""
    import torch._dynamo
    import torch._dynamo.eval_frame as ef

    graphs: list[Any] = []

    def backend(gm: Any, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def compiled() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _mlp()
        return torch.compile(model, backend=backend), torch.optim.SGD(model.parameters(), lr=0.1)

    torch._dynamo.reset()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    kept: list[Any] = []
    try:
        with pytest.raises(ValueError, match="a bug in the loop"):
            _notebook_cell(*compiled(), scaler, 0, kept, steps=4, sample_every=2)
        assert ef._stance.stance == "force_eager" and not graphs  # step 0 is sampled: it ran eagerly
        with pytest.warns(UserWarning, match="its model ran in that step, which no prof.step"):
            _notebook_cell(*compiled(), scaler, None, kept, steps=4, sample_every=2)
        assert len(graphs) == 1  # step 3 ran the model compiled (step 1 was the second of two to wait for)
        assert ef._stance.stance == "default" and not kept[0].attached
    finally:
        for prof in kept:
            prof.detach()
        torch.compiler.set_stance("default")


def test_two_profilers_on_two_compiled_models_stay_attached_together() -> None:
    """Two compiled models trained in one loop, one Profiler each (attached one after the other, as a GAN's
    are): the first one's sampled step put the stance back when it ended, under the second one's sampled step,
    whose forward then ran compiled through precprof's hooks, and Dynamo failed on them (the training ended).
    The stance is handed on to the sampled step still running. Attached together, neither is taken for one
    left over (no warning), and each records every step of its own model."""
    import torch._dynamo

    torch._dynamo.reset()
    models = [_mlp(), _mlp()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    compiled = [torch.compile(m, backend="eager") for m in models]
    try:
        first = precprof.Profiler(compiled[0], optimizer=opts[0], sample_every=2).attach()
        with warnings.catch_warnings(record=True) as said:  # (precprof's warnings are shown, never raised)
            warnings.simplefilter("always", UserWarning)
            second = precprof.Profiler(compiled[1], optimizer=opts[1], sample_every=2).attach()
        assert not [w for w in said if issubclass(w.category, UserWarning)], [str(w.message) for w in said]
        assert first.attached and second.attached
        for _ in range(4):
            for model, opt, prof in zip(compiled, opts, (first, second), strict=True):
                F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
                opt.step()
                opt.zero_grad()
                prof.step()
    finally:
        torch.compiler.set_stance("default")
    for prof in (first, second):
        prof.detach()
        assert prof.status[0] == T.STATUS_COMPLETE
        assert prof.tables()["steps"][T.STEP].tolist() == [0, 1, 2, 3]
        assert set(prof.tables()["layers"][T.STEP]) == {0, 2}


def test_a_profiler_attached_inside_another_ones_step_leaves_it_attached() -> None:
    """A GAN whose discriminator, and its Profiler, are made on the first iteration after the generator's
    forward (its input size read from the generator's output): the generator's Profiler, whose model had run in
    a step no prof.step() had ended yet, was taken for one its loop left and detached, and the loop's own
    ``profG.step()`` raised. Both stay attached, and each records every step of its own model."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    opt_g = torch.optim.Adam(gen.parameters(), 1e-3)
    prof_g = precprof.Profiler(gen, optimizer=opt_g, sample_every=1).attach()
    disc: nn.Module | None = None
    with warnings.catch_warnings(record=True) as said:  # (precprof's warnings are shown, never raised)
        warnings.simplefilter("always")  # nothing said: both loops run
        for _ in range(4):
            fake = gen(torch.randn(16, 8))
            if disc is None:
                disc = nn.Sequential(nn.Linear(fake.shape[-1], 32), nn.ReLU(), nn.Linear(32, 1))
                opt_d = torch.optim.Adam(disc.parameters(), 1e-3)
                prof_d = precprof.Profiler(disc, optimizer=opt_d, sample_every=1).attach()
            loss_d = F.softplus(disc(fake.detach())).mean() + F.softplus(-disc(torch.randn(16, 16))).mean()
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            prof_d.step(loss=loss_d)
            loss_g = F.softplus(-disc(fake)).mean()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
            prof_g.step(loss=loss_g)
    assert not said, [str(w.message) for w in said]
    assert prof_g.attached and prof_d.attached
    prof_d.detach()
    prof_g.detach()
    for prof in (prof_g, prof_d):
        assert prof.tables()["steps"][T.STEP].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "nothing_compiled"])
def test_a_profiler_whose_loop_stopped_before_its_sampled_steps_forward_is_said_not_detached(
    compiled: bool,
) -> None:
    """A loop that stopped at the start of a sampled step (its batch failed to load) leaves the ``force_eager``
    stance with nothing to tell it from a loop about to run its model: a Profiler attached to another model then
    says so, naming the stance and ``detach()``, and leaves it attached; where that stance changes how anything
    runs (the new model is compiled, and would never compile). With nothing compiled, as with two models
    trained alternately (the second's Profiler attached after a step), nothing is said: the warning was false."""
    import torch._dynamo

    torch._dynamo.reset()
    model, other = _mlp(), _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        first = precprof.Profiler(model, optimizer=opt, sample_every=2).attach()
        for _ in range(2):  # steps 0 and 1; step 2, sampled, never runs
            F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            opt.step()
            first.step()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            second = precprof.Profiler(
                torch.compile(other, backend="eager") if compiled else other, sample_every=2
            ).attach()
        stance = [str(w.message) for w in said if "holds torch.compile's" in str(w.message)]
        assert len(stance) == int(compiled), stance
        if compiled:
            assert "attached to Sequential (676 parameters, in its step 2) holds torch.compile's" in stance[0]
        assert first.attached and second.attached
    finally:
        first.detach()
        second.detach()
        torch.compiler.set_stance("default")


class _Interrupted(KeyboardInterrupt):
    """A KeyboardInterrupt of the test's own, which its loop catches (not an Exception: torch calls no forward
    hook for it, not even the always-called ones)."""


class _RaisesOnce(nn.Module):
    """A linear layer whose forward raises ``error`` when ``fail`` is set, after its layer ran (a simulated CUDA
    out-of-memory error midway through the model)."""

    def __init__(self, error: type[BaseException] = RuntimeError) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.fail = False
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l(x)
        if self.fail:
            raise self.error("CUDA out of memory (simulated)")
        return y


@pytest.mark.parametrize("error", [RuntimeError, _Interrupted])
def test_a_forward_that_raised_and_was_run_again_is_not_the_steps_forward(error: type[BaseException]) -> None:
    """An out-of-memory-and-retry loop: the step's forward raises inside a layer, the loop catches it and runs
    half the batch. The failed call was merged into the step's rows (``0``: calls=2, numel 32 + 16), and still
    was after a KeyboardInterrupt, which reaches no forward hook of torch's: its forward is ended at the model's
    next call. The rows are the forward that trained, checked against the retry's outputs read by hooks of the
    test's own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _RaisesOnce(error), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs: dict[str, dict[str, float]] = {}
    for name in ("0", "1.l", "2"):
        model.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: outputs.__setitem__(name, counts(out))
        )
    seen: dict[tuple[int, str], dict[str, float]] = {}
    x = torch.randn(4, 8)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for step in range(3):
            model[1].fail = step == 1
            outputs.clear()
            try:
                loss = model(x).square().mean()
            except error:
                model[1].fail = False
                outputs.clear()
                loss = model(x[:2]).square().mean()
            seen.update({(step, name): c for name, c in outputs.items()})
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss)
    layers = prof.tables()["layers"]
    acts = layers[(layers[T.TENSOR] == T.ACTIVATION) & layers[T.MODULE].isin(["0", "1.l", "2"])]
    assert len(acts) == 3 * 3
    for row in acts.itertuples(index=False):
        want = seen[(row.step, row.module)]
        got = row._asdict()
        assert {k: got[k] for k in want} == want, (row.step, row.module)
        assert row.calls == 1


class _FailingBackward(torch.autograd.Function):
    """The identity, whose backward raises once ``fails`` is set (a simulated CUDA out-of-memory error in the
    backward pass, after the layers above it had their gradients)."""

    fails = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if _FailingBackward.fails:
            _FailingBackward.fails = False
            raise RuntimeError("CUDA out of memory (simulated, backward)")
        return g


class _RetryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2, self.fc3 = (
            nn.Linear(8, 16),
            nn.ReLU(),
            nn.Linear(16, 16),
            nn.Linear(16, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _FailingBackward.apply(self.act(self.fc1(x)))
        return self.fc3(self.act(self.fc2(h)))


def _retry_loop(
    fails: str, profiled: bool = True, crash: bool = False, out: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Three steps of two micro-batches; step 1's second micro-batch raises in its forward (from a forward hook of
    fc2's) or its backward. The loop runs the failed micro-batch again (``retried alone``), or zeroes the gradients
    and runs the whole batch again in four micro-batches; ``crash``: the error ends the run. Fills and returns
    ``out``: the Profiler (``prof``), the weights trained (``weights``), and what the test's own hooks saw
    (``seen``) of the forwards and backward passes that trained (with ``crash``: of all that ran), per (step,
    layer, tensor): its outputs (and the layers' inputs), its output gradients, and per (step, layer, parameter) the gradient the
    optimizer got."""
    torch.manual_seed(0)
    model = _RetryNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    armed = {"forward": False}
    pending: list[tuple[str, str, torch.Tensor]] = []  # the micro-batch's reads, until its backward ends well

    def own(name: str) -> Any:
        def hook(m: nn.Module, args: Any, out: torch.Tensor) -> None:
            pending.append((name, T.ACTIVATION, out.detach().clone()))
            out.register_hook(lambda g: pending.append((name, T.ACTIVATION_GRAD, g.detach().clone())))

        return hook

    def boom(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        if armed["forward"]:
            armed["forward"] = False
            raise RuntimeError("CUDA out of memory (simulated)")

    model.fc2.register_forward_hook(boom)  # (first: fc2's output is read by no hook when it raises)
    for name in ("fc1", "act", "fc2", "fc3"):
        model.get_submodule(name).register_forward_hook(own(name))
    # the layers' inputs that no module's row holds as read, each the layer's own row (T.input_module): fc1's
    # (the micro-batch), fc2's (_FailingBackward's output, a function's), fc3's (act's, which ran twice a call)
    for name in ("fc1", "fc2", "fc3"):
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, args, n=T.input_module(name): pending.append(
                (n, T.ACTIVATION, args[0].detach().clone())
            )
        )
    out = {} if out is None else out
    seen = out["seen"] = {}

    def keep(step: int, reads: list[tuple[str, str, torch.Tensor]]) -> None:
        for name, kind, t in reads:
            seen.setdefault((step, name, kind), []).append(t)

    g = torch.Generator().manual_seed(1)
    prof = out["prof"] = precprof.Profiler(model, optimizer=opt, sample_every=1) if profiled else None
    with prof if prof is not None else contextlib.nullcontext():
        for step in range(3):
            x = torch.randn(8, 8, generator=g)
            kept: list[tuple[str, str, torch.Tensor]] = []

            def micro(xb: torch.Tensor, n: int, kept: list[tuple[str, str, torch.Tensor]] = kept) -> None:
                pending.clear()
                (model(xb).square().mean() / n).backward()
                kept.extend(pending)

            try:
                for k in range(2):
                    armed["forward"] = step == 1 and k == 1 and fails != "backward"
                    _FailingBackward.fails = step == 1 and k == 1 and fails == "backward"
                    micro(x[4 * k : 4 * k + 4], 2)
            except RuntimeError:
                if crash:
                    keep(step, kept + pending)
                    raise
                if fails == "retried alone":
                    micro(x[4:], 2)
                else:
                    opt.zero_grad()
                    kept.clear()
                    for k in range(4):
                        micro(x[2 * k : 2 * k + 2], 4)
            keep(step, kept)
            for name, p in model.named_parameters():
                seen[(step, *name.split("."))] = p.grad.detach().clone()
            opt.step()
            opt.zero_grad()
            if prof is not None:
                prof.step()
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    return out


def _check_outputs(layers: Any, seen: dict[Any, Any]) -> None:
    """Each output and output gradient row is the test's own reads of that layer, merged (one tensor of them
    all: the counts add, the largest magnitude is the largest), and its calls are how many there were."""
    for row in layers[layers[T.TENSOR].isin([T.ACTIVATION, T.ACTIVATION_GRAD])].itertuples(index=False):
        made = seen[(row.step, row.module, row.tensor)]
        want = counts(torch.cat([t.flatten() for t in made]))
        got = row._asdict()
        assert {k: got[k] for k in want} == want, (row.step, row.module, row.tensor)
        assert row.calls == len(made), (row.step, row.module, row.tensor)


@pytest.mark.parametrize("fails", ["forward", "retried alone", "backward"])
def test_an_attempt_that_raised_in_a_later_forward_or_the_backward_is_not_the_steps(fails: str) -> None:
    """An out-of-memory-and-retry loop whose step raises in its second micro-batch's forward, or in its backward
    (after the layers above had their gradients read): the failed attempt was merged into the retry's rows (fc1
    calls=4 where 2 trained, the output gradients of a backward that never ended). Each layer's output, output
    gradient and weight gradient rows are what the test's own hooks saw of the forwards and backward passes that
    trained: the retried micro-batch and the one before it, or the whole batch run again after ``zero_grad``.
    Training is bitwise the same as without precprof."""
    run = _retry_loop(fails)
    plain = _retry_loop(fails, profiled=False)
    assert all(torch.equal(a, b) for a, b in zip(run["weights"], plain["weights"], strict=True))
    layers = run["prof"].tables()["layers"]
    assert set(layers[T.STEP]) == {0, 1, 2}
    _check_outputs(layers, run["seen"])
    trained = 2 if fails == "retried alone" else 4  # the micro-batches whose backward reached .grad in step 1
    grads = layers[layers[T.TENSOR] == T.WEIGHT_GRAD]
    assert len(grads) == 3 * 6
    for row in grads.itertuples(index=False):
        want = counts(run["seen"][(row.step, row.module, row.param)])
        got = row._asdict()
        assert {k: got[k] for k in want} == want, (row.step, row.module, row.param)
        assert row.calls == (trained if row.step == 1 else 2)


@pytest.mark.parametrize("fails", ["forward", "backward"])
def test_an_attempt_that_raised_and_ended_the_run_keeps_what_it_read(fails: str) -> None:
    """A crash is no retry: the step whose second micro-batch raised, uncaught, keeps what it read, the failed
    forward's first layers or the failed backward's output gradients (fc3's and fc2's, the layers it reached)."""
    run: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="simulated"):
        _retry_loop(fails, crash=True, out=run)
    layers = run["prof"].tables()["layers"]
    assert set(layers[T.STEP]) == {0, 1}
    _check_outputs(layers, run["seen"])
    step1 = layers[layers[T.STEP] == 1]
    grads = set(step1[step1[T.TENSOR] == T.ACTIVATION_GRAD][T.MODULE])
    assert grads == {"fc1", "act", "fc2", "fc3"}  # (the first micro-batch's backward reached them all)
    fc1 = step1[(step1[T.MODULE] == "fc1") & (step1[T.TENSOR] == T.ACTIVATION)]
    assert fc1[T.CALLS].tolist() == [2]  # the failed micro-batch's forward read it too


class _FailingIdentity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailingBackward.apply(x)


@pytest.mark.parametrize("fails", ["first forward", "second forward", "backward"])
def test_the_activations_of_a_step_run_again_are_those_of_the_attempt_that_trained(fails: str) -> None:
    """The memory table counted the saved tensors of an attempt that raised as the step's activations: a step
    whose first forward raised midway and ran again in smaller micro-batches read the failed forward's (freed as
    the error unwound) and the first retry's together, 4.9x those of one micro-batch. After a failed second
    micro-batch (the loop zeroes the gradients and runs the batch again in four) or a failed backward pass, the
    failed attempt's own forwards were the largest group. Each step's activations are now one micro-batch of
    the run that trained, B = 2 rows: the input fc1 saves (16 floats a row), the two ReLU outputs the next
    layers save (32 each: once for the ReLU and the linear layer reading it) and the failing identity's copy,
    which the second linear layer saves (32)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), _FailingIdentity(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    armed = {"forward": False}

    def boom(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        if armed["forward"]:
            armed["forward"] = False
            raise RuntimeError("CUDA out of memory (simulated)")

    model[4].register_forward_hook(boom)  # (after the second ReLU ran: every tensor the step saves is saved)
    g = torch.Generator().manual_seed(1)
    parts = 2 if fails == "second forward" else 1
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory_every=1) as prof:
        for step in range(2):
            x = torch.randn(8, 16, generator=g)
            try:
                if step == 0:  # (the micro-batches that train, on a step that does not fail)
                    raise RuntimeError("smaller micro-batches")
                for k, xb in enumerate(x.chunk(parts)):
                    armed["forward"] = fails != "backward" and k == parts - 1
                    _FailingBackward.fails = fails == "backward"
                    model(xb).square().mean().backward()
            except RuntimeError:
                opt.zero_grad()
                for xb in x.chunk(4):
                    model(xb).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    mem = prof.tables()["memory"]
    acts = mem[(mem[T.COMPONENT] == T.ACTIVATIONS) & (mem[T.MOMENT] == "")]
    per_step = 2 * (16 + 32 + 32 + 32) * 4
    assert acts.groupby(T.STEP)[T.BYTES].sum().to_dict() == {0: per_step, 1: per_step}


class _SelfTeacher(nn.Module):
    """A forward that calls the model itself under ``no_grad`` (a self-distillation target) before its loss, and
    raises once, after that call, when ``fails`` is set (an out-of-memory error in the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.fails = False

    def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        h = self.a(x)
        if depth:
            return h
        with torch.no_grad():
            target = self(x, depth=1)
        if self.fails:
            self.fails = False
            raise RuntimeError("out of memory (the test's)")
        return (self.b(h) - target).square().mean()


def test_the_self_calls_of_an_attempt_that_raised_are_not_the_steps() -> None:
    """A step whose second micro-batch raised after the model's call of itself, run again whole after
    ``zero_grad``: the failed attempt's self-call forwards stayed counted as the run's unread ones (8 where 6 of
    the attempts that trained), as its evaluations and checkpointed forwards are not. Counted by the test's own
    hook on the forwards under no_grad, of the attempts that trained."""
    torch.manual_seed(0)
    model = _SelfTeacher()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    unread: list[int] = []
    model.a.register_forward_hook(lambda mod, args, out: unread.append(int(not torch.is_grad_enabled())))
    trained = 0
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for step in range(3):
            x = torch.randn(8, 8)
            unread.clear()
            try:
                for k in range(2):
                    model.fails = step == 1 and k == 1
                    model(x[4 * k : 4 * k + 4]).backward()
            except RuntimeError:
                opt.zero_grad()
                unread.clear()
                for k in range(2):
                    model(x[4 * k : 4 * k + 4]).backward()
            trained += sum(unread)
            opt.step()
            opt.zero_grad()
            prof.step()
    assert trained == 6
    assert prof.summary()["self_call_forwards_unread"] == trained


class _AttentionThatRaises(nn.Module):
    """Two encoder layers (nn.MultiheadAttention inside) and a head; the forward raises once after the encoder
    when ``fails`` is set (an out-of-memory error in the head)."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 1)
        self.fails = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        if self.fails:
            self.fails = False
            raise RuntimeError("out of memory (the test's)")
        return self.head(h).square().mean()


@pytest.mark.parametrize("before", ["attempt that raised", "evaluation with grad"])
def test_an_attentions_calls_are_those_of_the_forward_that_trained(before: str) -> None:
    """The first sampled step's calls of each nn.MultiheadAttention (batch, query and key lengths: the FP8 share
    counts its projections and score matmuls from them) kept those of an attempt that raised and was run again,
    or of an evaluation with grad on before the training forward: 2 calls beside a row of 1, and the advisor
    fell back to counting at the query's tokens. They are the calls of the forward that trained, as the test's
    own hooks on the attentions saw them."""
    torch.manual_seed(0)
    model = _AttentionThatRaises()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: dict[str, list[list[int]]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.MultiheadAttention):
            mod.register_forward_pre_hook(
                lambda m, args, name=name: seen.setdefault(name, []).append(
                    [*args[0].shape[:2], args[1].shape[1]]
                )
            )
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        x = torch.randn(3, 5, 16)
        if before == "evaluation with grad":
            model.eval()
            model(torch.randn(2, 9, 16))
            model.train()
        else:
            model.fails = True
            with contextlib.suppress(RuntimeError):
                model(x)
        seen.clear()
        model(x).backward()
        opt.step()
        opt.zero_grad()
        prof.step()
    recorded = {
        m["name"]: m.get("attention_calls")
        for m in prof.summary()["modules"]
        if m["type"] == "MultiheadAttention"
    }
    assert recorded == seen == {f"enc.layers.{i}.self_attn": [[3, 5, 5]] for i in range(2)}
