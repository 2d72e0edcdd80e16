"""A loop that calls the Profiler out of order trains as it should, but its rows are not its steps: a new optimizer
made mid-run without ``prof.use_optimizer``, ``prof.step()`` called every few optimizer steps or twice after one,
or before ``optimizer.step()``. Each was accepted silently; precprof now warns once per run and kind, naming the
fix, and says it in the summary's ``capture.loop_order`` (``capture/loop_order.py``). A loop in order gets none.

Every loop here is a real tiny training loop on CPU; what each says is checked against the loop's own count of
its steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import optimizer as optimizer_module

import precprof
from precprof import tables as T
from precprof.analysis import advisor

ONCE_PER_STEP = "call prof.step() once per optimizer step, after optimizer.step()"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One forward, backward and optimizer step."""
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _run(
    loop: Callable[[precprof.Profiler, nn.Module], None], **kw: Any
) -> tuple[precprof.Profiler, list[str]]:
    """``loop`` run under a Profiler of a fresh model and an SGD (both given to ``loop`` as the Profiler's);
    returns the Profiler, detached, and the messages of precprof's warnings about the loop's order."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prof = precprof.Profiler(model, optimizer=opt, memory=False, block_formats=False, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with prof:
            loop(prof, model)
    said = [
        str(w.message) for w in caught if "prof.step()" in str(w.message) or "use_optimizer" in str(w.message)
    ]
    return prof, said


def test_a_new_optimizer_the_profiler_was_not_given_is_said_once() -> None:
    """AdamW for steps 0-2, then an SGD made without ``prof.use_optimizer``: the weight-update rows stopped without
    a word, and the memory table kept counting AdamW's states. One warning names the fix; the summary says from
    which sampled step and how many (steps 3, 4 and 5: three)."""

    def loop(prof: precprof.Profiler, model: nn.Module) -> None:
        opt: torch.optim.Optimizer = prof.optimizer  # type: ignore[assignment]
        for step in range(6):
            if step == 3:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # use_optimizer forgotten
            _train(model, opt)
            prof.step()

    prof, said = _run(loop, sample_every=1)
    assert len(said) == 1
    assert "in sampled step 3 an optimizer the Profiler was not given (AdamW) stepped" in said[0]
    assert said[0].endswith(
        "give the Profiler every optimizer the loop steps (optimizer=[opt1, opt2]), or call "
        "prof.use_optimizer(new_opt) for one made later (a list when the loop steps several)"
    )
    assert prof.summary()["loop_order"] == {
        "optimizer_not_followed": {"first_step": 3, "steps": 3, "at": [3, 4, 5], "optimizers": ["AdamW"]}
    }
    layers = prof.tables()["layers"]
    assert sorted(set(layers[layers[T.TENSOR] == T.WEIGHT_UPDATE][T.STEP])) == [0, 1, 2]
    # the advisor names that cause, and its remedy: steps 3-5 had gradients and no update of the SGD it follows,
    # which is no prof.step() per micro-batch (it told the loop to call prof.step() once per optimizer step)
    found = {
        f.code: f
        for f in advisor.recommend(dict(prof.tables()), summary={T.SUMMARY_CAPTURE: prof.summary()}).findings
    }
    f = found["steps_without_update"]
    assert f.title == "An optimizer the Profiler was not given stepped the model's parameters", f.title
    assert "(3, 4, 5) the optimizer the Profiler was given (SGD) did not step" in f.message
    assert "was not given (AdamW) stepped" in f.message and "micro-batch" not in f.message
    assert f.remedy.startswith("Call prof.use_optimizer(new_opt)") and "prof.step()" not in f.remedy
    assert f.numbers == {"steps_without_update": 3, "sampled_steps_with_grads": 6, "steps_other_optimizer": 3}
    # the lost updates are those of steps 0-2, and say so
    lost = found["bf16_lost_updates"]
    assert "on 3 sampled steps (3, 4, 5) an optimizer it was not given (AdamW) stepped" in lost.message
    assert lost.numbers["steps_other_optimizer"] == 3
    # past the steps the capture lists (its first AT_MAX), a step without an update is judged neither way
    capture = prof.summary()
    capture["loop_order"]["optimizer_not_followed"]["at"] = [3, 4]
    cut = advisor.recommend(dict(prof.tables()), summary={T.SUMMARY_CAPTURE: capture}).findings
    f = next(f for f in cut if f.code == "steps_without_update")
    assert f.numbers["steps_other_optimizer"] == 2 and "micro-batch" not in f.message
    # the lost updates count the steps the capture counted, not those it listed ("on at least 2 sampled steps")
    lost = next(f for f in cut if f.code == "bf16_lost_updates")
    assert "on 3 sampled steps (3, 4 and 1 more) an optimizer it was not given (AdamW)" in lost.message
    assert lost.numbers["steps_other_optimizer"] == 3
    assert f.message.endswith(
        "Past sampled step 4 the capture lists no more steps: 1 sampled step after it without an update is not judged."
    )


def test_a_second_optimizer_stepping_beside_the_given_one_is_a_finding() -> None:
    """Two optimizers, the matrices' and the vectors', both stepping every step, one given to the Profiler (a
    common slip, tester t2): no finding said so, only an info finding's last clause and the environment's row,
    whose remedy was for a new optimizer made mid-run. A warning now names the other optimizer, what its updates'
    absence leaves out, and the fix: give the Profiler every optimizer."""

    def loop(prof: precprof.Profiler, model: nn.Module) -> None:
        opt: torch.optim.Optimizer = prof.optimizer  # type: ignore[assignment]
        vectors = torch.optim.AdamW([p for p in model.parameters() if p.dim() == 1], lr=1e-3)
        for _ in range(4):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            vectors.step()
            opt.zero_grad()
            vectors.zero_grad()
            prof.step()

    prof, said = _run(loop, sample_every=1)
    assert len(said) == 1 and "optimizer=[opt1, opt2]" in said[0]
    assert prof.summary()["loop_order"]["optimizer_not_followed"]["at"] == [0, 1, 2, 3]
    found = {
        f.code: f
        for f in advisor.recommend(dict(prof.tables()), summary={T.SUMMARY_CAPTURE: prof.summary()}).findings
    }
    f = found["steps_without_update"]
    assert (
        f.severity == "warning"
        and f.title == "An optimizer the Profiler was not given stepped the model's parameters"
    )
    assert f.message.startswith(
        "On 4 sampled steps (0, 1, 2, 3) an optimizer the Profiler was not given (AdamW) stepped the model's "
        "parameters beside the one it was given (SGD)."
    )
    assert f.remedy.startswith(
        "Give the Profiler every optimizer the loop steps: Profiler(model, optimizer=["
    )
    assert f.numbers == {"steps_other_optimizer": 4}
    # both given: nothing said
    model = _model()
    mats, vecs = (
        torch.optim.SGD([p for p in model.parameters() if p.dim() == 2], lr=0.1),
        torch.optim.AdamW([p for p in model.parameters() if p.dim() == 1], lr=1e-3),
    )
    with precprof.Profiler(
        model, optimizer=[mats, vecs], memory=False, block_formats=False, sample_every=1
    ) as p2:
        for _ in range(4):
            model(torch.randn(4, 8)).square().mean().backward()
            for o in (mats, vecs):
                o.step()
                o.zero_grad()
            p2.step()
    codes = [
        f.code
        for f in advisor.recommend(dict(p2.tables()), summary={T.SUMMARY_CAPTURE: p2.summary()}).findings
    ]
    assert "steps_without_update" not in codes


def test_prof_step_every_third_optimizer_step_is_said() -> None:
    """``prof.step()`` at a logging interval, every 3rd optimizer step: each precprof step held 3 (activation calls
    3, updates summed). 12 optimizer steps: 4 sampled steps of 3 each."""

    def loop(prof: precprof.Profiler, model: nn.Module) -> None:
        for step in range(12):
            _train(model, prof.optimizer)  # type: ignore[arg-type]
            if step % 3 == 2:
                prof.step()

    prof, said = _run(loop, sample_every=1)
    assert said == [
        "precprof: sampled step 0 holds 3 steps of SGD: its rows add them up (each layer's activation calls and "
        "their gradients, the weight updates; each weight-gradient row is the gradient of its optimizer's first "
        f"step); {ONCE_PER_STEP}"
    ]
    assert prof.summary()["loop_order"] == {
        "several_optimizer_steps": {"first_step": 0, "steps": 4, "at": [0, 1, 2, 3], "most": 3}
    }


def test_a_critic_stepping_twice_per_generator_step_is_no_fault() -> None:
    """A WGAN's critic: of the two optimizers the Profiler follows, the critic's steps twice per ``prof.step()``
    and the generator's once, as the README documents. It was warned of as a loop fault ("holds 2 steps of Adam:
    its rows add them up ...; call prof.step() once per optimizer step") and the report said to fix it, and what
    the rows hold was wrong: D's weight-gradient rows are its first critic step's (calls 1), not added up (tester
    t2). Now no warning; the summary names the critic's optimizer by its place and the modules it updates, and
    the report says what the rows hold, with no fix. What it says is checked against the rows."""
    from precprof.report.environment import loop_order_text

    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    D = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    gan = nn.ModuleDict({"G": G, "D": D})
    oD, oG = torch.optim.Adam(D.parameters(), 1e-3), torch.optim.Adam(G.parameters(), 1e-3)
    prof = precprof.Profiler(gan, optimizer=[oD, oG], sample_every=1, memory=False, block_formats=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with prof:
            for _ in range(3):
                for _ in range(2):  # n_critic = 2
                    fake = G(torch.randn(4, 4)).detach()
                    loss_d = D(fake).mean() - D(torch.randn(4, 6)).mean()
                    oD.zero_grad()
                    loss_d.backward()
                    oD.step()
                loss_g = -D(G(torch.randn(4, 4))).mean()
                oG.zero_grad()
                loss_g.backward()
                oG.step()
                prof.step()
    order = prof.summary()["loop_order"]
    assert order == {
        T.LOOP_CRITIC_STEPS: {
            "first_step": 0,
            "steps": 3,
            "at": [0, 1, 2],
            "most": 2,
            "optimizers": ["optimizer 0 (Adam: D.0, D.2)"],
        }
    }
    said = loop_order_text(order)
    assert said.startswith("optimizer 0 (Adam: D.0, D.2) stepped up to 2 times in each of 3 sampled steps")
    assert "fix" not in said and "prof.step()" not in said
    assert "each weight-gradient row its first step's gradient" in said
    layers = prof.tables()["layers"]
    d0 = layers[(layers[T.MODULE] == "D.0") & (layers[T.PARAM] == "weight")]
    assert d0.groupby(T.TENSOR)[T.CALLS].max().to_dict() == {
        T.WEIGHT: 1,
        T.WEIGHT_GRAD: 1,
        T.WEIGHT_UPDATE: 2,
    }
    acts = layers[(layers[T.MODULE] == "D.0") & (layers[T.TENSOR] == T.ACTIVATION)]
    assert acts[T.CALLS].tolist() == [5, 5, 5]  # 2 forwards a critic step, twice, and the generator's


def test_prof_step_called_twice_after_one_optimizer_step_is_said() -> None:
    """Two ``prof.step()`` after each optimizer step, 3 times: steps 1, 3 and 5 ran nothing, each an empty step
    marked sampled."""

    def loop(prof: precprof.Profiler, model: nn.Module) -> None:
        for _ in range(3):
            _train(model, prof.optimizer)  # type: ignore[arg-type]
            prof.step()
            prof.step()

    prof, said = _run(loop, sample_every=1)
    assert said == [
        "precprof: sampled step 1 ran no forward, backward or optimizer step (prof.step() called twice?); "
        + ONCE_PER_STEP
    ]
    assert prof.summary()["loop_order"] == {"empty_step": {"first_step": 1, "steps": 3, "at": [1, 3, 5]}}


def test_prof_step_before_optimizer_step_is_said() -> None:
    """``loss.backward(); prof.step(); opt.step()``, 6 iterations, every 2nd step sampled: on sampled steps 2 and 4
    SGD stepped before the forward (the update of iterations 1 and 3's gradients), read as their updates."""

    def loop(prof: precprof.Profiler, model: nn.Module) -> None:
        opt = prof.optimizer
        assert opt is not None
        for _ in range(6):
            model(torch.randn(4, 8)).square().mean().backward()
            prof.step()
            opt.step()
            opt.zero_grad()

    prof, said = _run(loop, sample_every=2)
    assert said == [
        "precprof: in sampled step 2 SGD stepped before the model's forward: its weight-update rows are the step "
        f"before's update (prof.step() called before optimizer.step()?); {ONCE_PER_STEP}"
    ]
    assert prof.summary()["loop_order"] == {
        "optimizer_before_forward": {"first_step": 2, "steps": 2, "at": [2, 4]}
    }


def test_an_optimizer_step_alone_after_the_last_prof_step_makes_no_step_at_detach() -> None:
    """``loss.backward(); prof.step(); opt.step()``, 6 iterations, every 2nd step sampled: the last iteration's
    optimizer step comes after its ``prof.step()``, and detach made of it a step 6 of that update alone (sampled,
    no loss, not cut off, only weight-update rows). The run has the 6 steps the loop took."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (said: test_prof_step_before_optimizer_step_is_said)
        with precprof.Profiler(
            model, optimizer=opt, sample_every=2, memory=False, block_formats=False
        ) as prof:
            for _ in range(6):
                model(torch.randn(4, 8)).square().mean().backward()
                prof.step()
                opt.step()
                opt.zero_grad()
    assert prof.tables()["steps"][T.STEP].tolist() == list(range(6))
    assert prof.tables()["layers"][T.STEP].max() == 4


class _Lookahead(torch.optim.Optimizer):
    """An optimizer that steps the one it wraps (Lookahead's shape): the Profiler given either is in order."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        super().__init__(inner.param_groups, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.inner.step()


def _closure_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One step of ``opt`` given a closure that runs the forward and backward (LBFGS, Lightning's automatic
    optimization): the forward runs inside the step."""

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        return loss

    opt.step(closure)  # type: ignore[no-untyped-call]


def _in_order(kind: str) -> Callable[[precprof.Profiler, nn.Module], None]:
    """Loops in order: ``plain``, two optimizers both given (``two``), LBFGS's closure running the forward inside
    the step (``closure``), the Profiler given the optimizer a wrapper steps (``wrapped``) or the wrapper
    (``wrapper``), and a new optimizer given to ``use_optimizer`` only after its first step, before
    ``prof.step()`` (``followed late``: Lightning's callback follows one set on the trainer at the end of the
    batch that stepped it), and a step 2 that skips its batch as Lightning's automatic optimization does for a
    ``training_step`` that returned None (``skipped batch``: the step's closure zeroes the gradients and runs no
    forward or backward; the optimizer steps on no gradient)."""

    def loop(prof: precprof.Profiler, model: nn.Module) -> None:
        params = list(model.parameters())
        sgd = prof.optimizer
        assert sgd is not None
        opts: list[torch.optim.Optimizer] = {
            "two": [torch.optim.SGD(params[:2], lr=0.1), torch.optim.Adam(params[2:], lr=1e-3)],
            "closure": [torch.optim.LBFGS(params, lr=0.1, max_iter=2)],
            "wrapped": [_Lookahead(sgd)],
            "wrapper": [_Lookahead(sgd)],
        }.get(kind, [sgd])
        if kind != "wrapped":  # (the Profiler follows the SGD the wrapper steps)
            prof.use_optimizer(opts)
        for step in range(4):
            if kind == "followed late" and step == 2:
                opts = [torch.optim.Adam(params, lr=1e-3)]
            if kind == "closure":
                _closure_step(model, opts[0])
            elif kind == "skipped batch" and step == 2:
                opts[0].step(opts[0].zero_grad)  # type: ignore[arg-type]
            else:
                model(torch.randn(4, 8)).square().mean().backward()
                for o in opts:
                    o.step()
                    o.zero_grad()
            if kind == "followed late" and step == 2:
                prof.use_optimizer(opts)
            prof.step()

    return loop


@pytest.mark.parametrize(
    "kind", ["plain", "two", "closure", "wrapped", "wrapper", "followed late", "skipped batch"]
)
def test_a_loop_in_order_is_said_nothing(kind: str) -> None:
    """Each loop in order (``_in_order``): no warning, an empty ``loop_order``; an optimizer that wraps the one
    followed, or runs inside its step, is that one's step, not one the Profiler was not given. A skipped batch's
    step on no gradient was said to be "SGD stepped before the model's forward ... the step before's update"
    (tester h74): it updated nothing, and its rows say so (``calls`` 0: left out of the update-to-weight
    ratio)."""
    prof, said = _run(_in_order(kind), sample_every=1)
    assert said == []
    assert prof.summary()["loop_order"] == {}
    if kind in ("plain", "skipped batch"):
        updates = prof.tables()["layers"].query(f"{T.TENSOR} == '{T.WEIGHT_UPDATE}'")
        calls = updates.groupby(T.STEP)[T.CALLS].max().tolist()
        assert calls == ([1, 1, 0, 1] if kind == "skipped batch" else [1] * 4)
    # the hooks on every optimizer's step are a sampled step's: none left once detached
    assert (
        not optimizer_module._global_optimizer_pre_hooks and not optimizer_module._global_optimizer_post_hooks
    )
