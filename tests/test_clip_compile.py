"""A loop that compiles its gradient clip (``@torch.compile def clip_and_step(): clip_grad_norm_(...);
opt.step()``, here the clip alone) compiles the same graphs with precprof as without it: before ``attach()``,
while attached and after ``detach()``. precprof's ``clip_grad_norm_`` wrapper (``precprof.clipwatch``) was put in place at the first
``attach()`` and taken out at the last ``detach()``; Dynamo guards on the function (``__code__``), so each swap
recompiled every compiled function that clips, and ``torch.compiler.set_stance("fail_on_recompile")`` refused the
first step after attach (and after detach). The wrapper is installed once, never removed, and calls torch's own
function under compile without reading precprof's state. With no Profiler attached it passes every call through."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precprof
from precprof import clipwatch
from precprof import tables as T
from precprof.capture.stance import SampledStance


def _loop(profile: bool, attach_at: int) -> tuple[list[int], list[float], list[float]]:
    """6 steps of a loop whose clip is compiled (a graph-counting backend), recompiles forbidden once warm (from
    step 2); a Profiler (sample_every=2) attached from step ``attach_at`` to step 4, then one step after its
    detach. Returns the graphs' node counts, the loop's norms and the norms precprof recorded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    @torch.compile(backend=counting)
    def clip() -> torch.Tensor:  # (opt.step() compiled in it too takes 2.5 s more, and passes the same)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # looked up at call time

    torch._dynamo.reset()
    norms: list[float] = []
    prof = precprof.Profiler(model, optimizer=opt, sample_every=2, memory=False) if profile else None
    try:
        for step in range(6):
            if prof is not None and step == attach_at:
                prof.attach()
            F.cross_entropy(model(x), y).backward()
            norms.append(float(clip()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 1:  # warm: set before prof.step(), as the README says (force_eager for step 2 stays)
                torch.compiler.set_stance("fail_on_recompile")
            if prof is not None and prof.attached:
                prof.step()
            if prof is not None and step == 4:
                prof.detach()
    finally:
        torch.compiler.set_stance("default")
        if prof is not None and prof.attached:
            prof.detach()
    recorded = [] if prof is None else prof.tables()["steps"].sort_values(T.STEP)[T.GRAD_NORM].tolist()
    return graphs, norms, recorded


def test_a_compiled_clip_compiles_the_same_graphs_with_precprof() -> None:
    """Warm before attach: the first step after attach raised "Detected recompile when torch.compile stance is
    'fail_on_recompile'" (guard ``G['torch'].nn.utils.clip_grad_norm_.__code__``). Compiled while attached: the
    step after detach did. The norms precprof records come from the sampled steps, which run compiled code
    eagerly; on the others the compiled clip notes nothing (the loop passes grad_norm= there)."""
    plain_graphs, plain_norms, _ = _loop(profile=False, attach_at=-1)
    for attach_at in (2, 0):  # warm before attach; compiled while attached
        graphs, norms, recorded = _loop(profile=True, attach_at=attach_at)
        # the same graphs, node for node: no recompile, no other graph
        assert graphs == plain_graphs, attach_at
        assert norms == plain_norms
        sampled = [i for i, n in enumerate(recorded) if not math.isnan(n)]  # the others: not recorded
        assert len(recorded) == 5 - attach_at and sampled == list(range(0, 5 - attach_at, 2))
        assert [recorded[i] for i in sampled] == pytest.approx(
            [norms[attach_at + i] for i in sampled], rel=1e-6
        )


def test_with_no_profiler_attached_the_wrapper_is_torchs_function() -> None:
    """The wrapper stays for the process; with no Profiler attached a call is torch's: the same norm, the same
    exception, torch's warning for an empty generator (a generator is not read into a list first)."""
    wrapped = torch.nn.utils.clip_grad_norm_
    own = wrapped.__wrapped__  # type: ignore[attr-defined]
    assert own is wrapped._precprof_original  # type: ignore[attr-defined]  # (installed with precprof)
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is wrapped is not own
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.ones(1, 3)).sum().backward()
    assert torch.equal(wrapped(a.parameters(), 0.1, norm_type=3.0), own(b.parameters(), 0.1, norm_type=3.0))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    a.weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        wrapped(a.parameters(), 1.0, error_if_nonfinite=True)
    for clip in (wrapped, own):
        with pytest.warns(UserWarning, match="empty generator"):
            clip((p for p in ()), 1.0)
    with warnings.catch_warnings():  # a generator of parameters, watched: torch still sees a generator
        warnings.simplefilter("error")
        norms = clipwatch.ClipNorms(a.parameters())
        clipwatch.watch(norms)
        try:
            assert float(wrapped((p for p in b.parameters()), 1e9)) > 0
            with pytest.warns(UserWarning, match="empty generator"):
                wrapped((p for p in ()), 1.0)
        finally:
            clipwatch.unwatch(norms)


def test_a_recompile_refused_for_a_clip_wrapped_after_it_compiled_names_the_fix() -> None:
    """``import precprof`` before ``import torch``, the function compiled, and the first ``precprof.Profiler``
    after: the wrappers go in then, and the compiled clip recompiles once. fail_on_recompile's error says why."""
    exc = RuntimeError(
        "Detected recompile when torch.compile stance is 'fail_on_recompile'. ... guard failure(s):\n"
        "- 0/0: ___check_obj_id(G['torch'].nn.utils.clip_grad_norm_.__code__, 1)"
    )
    stance = SampledStance()
    late, clipwatch.wrapped_after_compile = clipwatch.wrapped_after_compile, True
    try:
        stance.explain(exc, 3)
    finally:
        clipwatch.wrapped_after_compile = late
    assert "import precprof after torch" in exc.__notes__[0]


def test_a_reload_of_clipwatch_while_attached_keeps_noting_the_norm() -> None:
    """``importlib.reload(precprof.clipwatch)`` (a notebook's %autoreload) with a Profiler attached: the wrapper
    installed reads the module's globals, and the reload had replaced its set of watchers with an empty one, so
    the steps after it recorded no grad norm (nan)."""
    import importlib

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    norms = []
    with precprof.Profiler(model, sample_every=1, memory=False) as prof:
        for step in range(2):
            if step == 1:
                importlib.reload(clipwatch)
            model(torch.randn(3, 4)).square().sum().backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            model.zero_grad()
            prof.step()
    assert prof.tables()["steps"][T.GRAD_NORM].tolist() == pytest.approx(norms)
