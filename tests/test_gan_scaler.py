"""A GAN under one GradScaler shared by the discriminator's and the generator's optimizers (fp16 autocast on the
CPU, tiny Linear models): the weight-gradient rows are what each optimizer was given, also on the steps the
scaler skipped one of them; checked against the loop's own reads of ``.grad`` before each ``scaler.step``, and
the training bitwise the same with and without the Profiler."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from cast_counts import counts
from torch import nn

import precprof
from precprof import tables as T
from precprof.analysis.advisor import evidence as E
from precprof.analysis.advisor import recommend
from precprof.report.context import _headline


def _gan_loop(prof_on: bool, steps: int = 3, init_scale: float = 2.0**20) -> dict[str, Any]:
    """The DCGAN-style loop: D's loss backward, ``scaler.step(optD)``, then G's loss through D (adding to D's
    ``.grad``), ``scaler.step(optG)``, one ``update()``. At 2^20 D's gradients overflow (its step is skipped)
    and G's, scaled by 1e-4, do not."""
    torch.manual_seed(0)
    gan = nn.ModuleDict(
        {
            "G": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6)),
            "D": nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1)),
        }
    )
    D, G = gan["D"], gan["G"]
    optD = torch.optim.Adam(D.parameters(), 2e-3)
    optG = torch.optim.SGD(G.parameters(), 1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    names = {
        id(p): (f"{m}.{n.rsplit('.', 1)[0]}", n.rsplit(".", 1)[1])
        for m in "DG"
        for n, p in gan[m].named_parameters()
    }
    given: dict[tuple[int, str, str], dict[str, float]] = {}
    stepped: dict[str, list[int]] = {"D": [], "G": []}
    now = [0]
    optD.register_step_post_hook(lambda *a: stepped["D"].append(now[0]))
    optG.register_step_post_hook(lambda *a: stepped["G"].append(now[0]))
    losses: list[torch.Tensor] = []

    def read(opt: torch.optim.Optimizer) -> None:  # the loop's own read, before the scaler unscales them
        s = float(scaler.get_scale())
        for p in (p for g in opt.param_groups for p in g["params"]):
            c = counts(p.grad)
            c[T.ABSMAX] /= s
            given[(now[0], *names[id(p)])] = c

    prof = precprof.Profiler(gan, optimizer=[optD, optG], scaler=scaler, sample_every=1, memory=False)
    if prof_on:
        prof.attach()
    for step in range(steps):
        now[0] = step
        real, z = torch.randn(8, 6) + 1, torch.randn(8, 4)
        optD.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            fake = G(z)
            lossD = F.softplus(-D(real).float()).mean() + F.softplus(D(fake.detach()).float()).mean()
        scaler.scale(lossD).backward()
        read(optD)
        scaler.step(optD)
        optG.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            lossG = F.softplus(-D(fake).float()).mean() * 1e-4
        scaler.scale(lossG).backward()  # adds to D's .grad, which no optimizer applies
        read(optG)
        scaler.step(optG)
        scaler.update()
        losses.append(torch.stack([lossD.detach(), lossG.detach()]))
        if prof_on:
            prof.step(loss=lossD.detach() + lossG.detach())
    if prof_on:
        prof.detach()
    return {
        "prof": prof if prof_on else None,
        "given": given,
        "stepped": stepped,
        "losses": torch.stack(losses),
        "state": {k: v.clone() for k, v in gan.state_dict().items()},
    }


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal, nan equal to nan (the absmax of a gradient all inf)."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@pytest.fixture(scope="module")
def gan_run() -> dict[str, Any]:
    run = _gan_loop(True)
    run["plain"] = _gan_loop(False)
    return run


def test_a_gan_s_gradient_rows_are_what_each_optimizer_was_given_when_the_shared_scaler_skips_one(
    gan_run: dict[str, Any],
) -> None:
    """optD skipped (inf in D's gradients at 2^20), optG stepped: D's rows were read again after ``unscale_``
    divided D's .grad in place and G's backward added to it (calls=2, absmax 24,000x too small, and the report
    told of "gradient accumulation"), as a skip runs neither of optD's step hooks. ``unscale_`` now keeps what
    was read, as a step does."""
    run = gan_run
    assert run["stepped"]["D"] == [] and run["stepped"]["G"] == [0, 1, 2]  # the case at hand
    grads = run["prof"].tables()["layers"]
    grads = grads[grads[T.TENSOR] == T.WEIGHT_GRAD]
    assert len(grads) == len(run["given"]) == 3 * 8
    for row in grads.itertuples(index=False):
        want = run["given"][(row.step, row.module, row.param)]
        got = row._asdict()
        assert row.calls == 1, (row.step, row.module, row.param)
        assert _same({k: got[k] for k in want}, want), (row.step, row.module, row.param, want, got)
    assert grads[grads[T.MODULE].str.startswith("D")][T.INF].sum() > 0  # the inf the skip was on
    plain = run["plain"]
    assert torch.equal(run["losses"], plain["losses"])
    assert all(torch.equal(v, plain["state"][k]) for k, v in run["state"].items())


def test_a_scaler_over_two_optimizers_says_which_it_skipped_and_keeps_the_gradients_of_the_one_that_stepped(
    gan_run: dict[str, Any],
) -> None:
    """The same run: the scaler skipped optD on every step and optG on none. The report said "skipped 3 of 3
    optimizer steps", left G's gradients out of fp16_gradient_underflow as "skipped", and drew a norm the loop
    never took as "not finite". The steps table now says which optimizer (``skipped_optimizers``), the summary
    names each one's modules, and only the skipped optimizer's rows of those steps are left out."""
    prof = gan_run["prof"]
    steps = prof.tables()["steps"]
    assert steps[T.SKIPPED].tolist() == [True] * 3 and steps[T.SKIPPED_OPTIMIZERS].tolist() == ["0"] * 3
    each = prof.summary()["optimizer"]["each"]
    assert each == [{"class": "Adam", "modules": ["D.0", "D.2"]}, {"class": "SGD", "modules": ["G.0", "G.2"]}]
    rec = recommend(prof)
    by = {f.code: f for f in rec.findings}
    msg = by["scaler_skipped_steps"].message
    assert msg.startswith(
        "The dynamic loss scaler skipped optimizer steps on 3 of 3 steps, of optimizer 0 (Adam: D.0, D.2) on 3 "
        "and of optimizer 1 (SGD: G.0, G.2) on none (scale started at"
    ), msg
    for f in rec.findings:
        assert "the 3 the loss scaler skipped are left out" not in f.message, f.code
    # the report's header says of its skipped steps which optimizer each was (it read "skipped steps 3" alone)
    cards = dict(_headline({T.SUMMARY_CAPTURE: prof.summary()}, steps, prof.tables()["layers"]))
    assert cards["skipped steps"] == "3 (optimizer 0, Adam, on 3; optimizer 1, SGD, on none)", cards
    # the rows left out: D's (its parameters' and its parameterless LeakyReLU's), never G's
    run = E._Run(*E._prepare(prof.tables()), {T.SUMMARY_CAPTURE: prof.summary()}, None, False, None)  # type: ignore[arg-type]
    out = E._skipped_rows(run, run.layers)
    assert {"D.0", "D.1", "D.2"} <= set(run.layers.loc[out, T.MODULE]) <= {"D.0", "D.1", "D.2", "D.0:input"}
    assert not run.layers.loc[~out, T.MODULE].str.startswith("D").any()
