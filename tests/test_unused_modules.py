"""The modules holding parameters that never ran (``unused_modules``), on real tiny training runs."""

from __future__ import annotations

import torch
from scenarios.loop import square_mean, train_profiled
from torch import nn

from precprof.analysis.advisor import AdvisorConfig


class _Skipped(nn.Module):
    """A layer built in ``__init__`` and left out of ``forward`` (``unused``), a module whose weight its parent
    multiplies itself (``proj``: it never runs, yet trains), and a module called under ``no_grad`` (``frozen``:
    it runs, without a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 32)
        self.proj = nn.Linear(32, 16)
        self.frozen = nn.Linear(16, 16)
        self.unused = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = self.frozen(x)
        return nn.functional.linear(torch.relu(self.fc(x)), self.proj.weight, self.proj.bias)


def test_modules_that_never_ran_are_named_with_their_share_of_the_parameters() -> None:
    """A decoder-only BartForCausalLM never calls its cross-attention, 18% of its parameters, and nothing said
    so. The modules with neither a forward of their own nor a gradient on any sampled step are named, with
    their share of the parameters counted from the model itself; a module whose weight its parent multiplies
    and one run under no_grad are not among them."""
    model = _Skipped()
    run = train_profiled(model, lambda step: (torch.randn(8, 16),) * 2, square_mean, steps=3)
    f = run.recommend("cpu", config=AdvisorConfig()).finding("unused_modules")
    unused = ["unused.0", "unused.1"]
    n_unused = sum(p.numel() for p in model.unused.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert f is not None and f.severity == "info" and f.modules == unused
    assert (f.numbers["unused_param_elements"], f.numbers["param_elements"]) == (n_unused, total)
    assert f.numbers["sampled_steps_with_grads"] == 3
    assert (
        f.title
        == f"2 module(s) holding {100 * n_unused / total:.3g}% of the parameters ran on no sampled step"
    )
    assert "find_unused_parameters=True" in f.remedy


def test_a_model_whose_every_module_runs_has_no_unused_modules() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16))
    run = train_profiled(model, lambda step: (torch.randn(8, 16),) * 2, square_mean, steps=2)
    assert run.recommend("cpu", config=AdvisorConfig()).finding("unused_modules") is None
