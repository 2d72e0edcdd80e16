"""Training loops that run the model in unusual ways (through torch.func transforms, two models sharing one
GradScaler, ...): precprof records what it can read of them exactly, skips and counts what it cannot, and never
ends the training."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from cast_counts import counts
from torch import nn
from torch.func import functional_call, grad, vmap

import precprof
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

    def train(profiled: bool) -> tuple[list[torch.Tensor], dict[tuple[int, str], dict[str, float]], Any]:
        model = _mlp()
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
    # one wrapper each per step
    skipped = {(s["module"], s["tensor"]): s["count"] for s in prof.skipped_tensors()}
    assert skipped == {(m, T.ACTIVATION): steps for m in ("0", "0:input", "1", "2", "2:input")}
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


class _RaisesOnce(nn.Module):
    """A linear layer whose forward raises when ``fail`` is set, after its layer ran (a simulated CUDA
    out-of-memory error midway through the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l(x)
        if self.fail:
            raise RuntimeError("CUDA out of memory (simulated)")
        return y


def test_a_forward_that_raised_and_was_run_again_is_not_the_steps_forward() -> None:
    """An out-of-memory-and-retry loop: the step's forward raises inside a layer, the loop catches it and runs
    half the batch. The failed call was merged into the step's rows (``0``: calls=2, numel 32 + 16); the rows
    are the forward that trained, checked against the retry's outputs read by hooks of the test's own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _RaisesOnce(), nn.Linear(8, 2))
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
            except RuntimeError:
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
