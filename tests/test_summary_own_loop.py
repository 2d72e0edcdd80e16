"""summary.json of a Profiler in the user's own loop: the ``versions``, ``final`` and ``model`` blocks the README
lists, which only ``precprof train`` wrote (a notebook had no torch version and no final loss, and the report
no Software rows); and the report of such a run killed before it saved, which named no precision."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import precprof
from precprof import hardware, pipeline, taxonomy
from precprof import tables as T
from precprof.analysis.advisor import Finding, Recommendation
from precprof.analysis.throughput import compiled_steps, throughput
from precprof.report import context, environment
from precprof.report import filters as F
from precprof.report import summarize as S


def _run(out: Path, steps: int = 3) -> tuple[precprof.Profiler, nn.Module, list[float]]:
    """A tiny bf16-autocast loop of ``steps`` steps, every one sampled, 64 tokens each, streamed into ``out``
    (detached, not saved); the Profiler, the model and the losses passed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    losses = []
    with precprof.Profiler(model, opt, sample_every=1, memory=False, out=out) as prof:
        for _ in range(steps):
            x = torch.randint(0, 32, (4, 16), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, 32), x.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach(), tokens=64)
            losses.append(float(loss.detach()))
    return prof, model, losses


def test_a_profiler_runs_summary_has_versions_final_figures_and_model(tmp_path: Path) -> None:
    """Written by the Profiler's save: the versions precprof train records, the final figures as the report's
    header reads them (no wall-clock time: the loop is the user's), the model's class and size; the report's
    Software rows come back. A run directory written before (none of the three) still renders."""
    out = tmp_path / "run"
    prof, model, losses = _run(out)
    prof.save()
    summary = T.read_summary(out)
    assert summary[T.SUMMARY_VERSIONS] == json.loads(json.dumps(hardware.software_versions()))
    final = summary[T.SUMMARY_FINAL]
    tables = T.read_tables(out)
    steps, layers = tables["steps"], tables["layers"]
    tp = throughput(steps, compiled_steps(summary))
    assert final["final_loss"] == losses[-1] and final["steps_done"] == 3 and final["skipped_steps"] == 0
    assert final["tokens_per_s"] == tp["tokens_per_s"] > 0 and final["wall_s"] is None
    header = dict(context._headline(summary, steps, layers))
    assert header["final loss"] == F.num(final["final_loss"], 4)
    assert header[f"tokens/s (all steps, median of {tp['tokens_per_s_steps']})"] == F.num(
        final["tokens_per_s"]
    )
    assert summary[T.SUMMARY_MODEL] == {
        "name": "Sequential",
        "kind": "user",
        "class": "torch.nn.modules.container.Sequential",
        "n_params": sum(p.numel() for p in model.parameters()),
    }
    groups = dict(environment.environment(summary)["groups"])
    assert ("PyTorch", torch.__version__) in groups["Software"]
    # a run saved before these blocks were written (a killed run's first summary has none either: its report
    # renders, below): no Software rows, no figures made up
    old = {
        k: v for k, v in summary.items() if k not in (T.SUMMARY_VERSIONS, T.SUMMARY_FINAL, T.SUMMARY_MODEL)
    }
    assert "Software" not in dict(environment.environment(old)["groups"])
    assert dict(context._headline(old, steps, layers)) == header


def test_a_killed_own_loop_runs_report_names_the_precision_its_layers_ran_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed before it saved has only the summary written at its start, before any forward pass: no
    precision_seen, and its report read "Precision report · Sequential" with no precision row, where every layer
    says bfloat16. It names the precision its layers' dtypes show, and says where it read it."""
    out = tmp_path / "killed"
    prof, _, _ = _run(out, steps=2)
    prof._owned_run.release()  # as a killed job leaves it: its stream and first summary
    first = T.read_summary(out)
    assert "precision_seen" not in (first.get(T.SUMMARY_CAPTURE) or {})
    monkeypatch.setattr(context, "_heatmaps", lambda *a, **k: [])  # 2 s of matplotlib, no part of this
    html = pipeline.rerender(out).read_text()
    assert "<h1>Precision report · Sequential · bf16</h1>" in html, re.findall(r"<h1>.*?</h1>", html)
    assert "bf16 (read from the layers&#39; dtypes)" in html
    layers = T.read_run(out).tables["layers"]
    filled = taxonomy.with_precision_seen(first, layers)
    seen = filled[T.SUMMARY_CAPTURE]
    assert seen["precision_seen"] == "bf16" and seen["precision_from"] == taxonomy.PRECISION_FROM_LAYERS
    # a run that said its precision (precprof train's configuration) is not said to have it from the dtypes
    assert S.precision_from_layers(filled) and not S.precision_from_layers(
        {**filled, T.SUMMARY_CONFIG: {"precision": "bf16"}}
    )
    # the modes precision_seen names: pure where the parameters are 16-bit, fp32 where nothing is
    pure = layers.assign(**{T.DTYPE: layers[T.DTYPE].astype(str).replace("float32", "bfloat16")})
    assert taxonomy.precision_in_layers(pure) == "bf16-pure"
    plain = layers.assign(**{T.DTYPE: "float32"})
    assert (
        taxonomy.precision_in_layers(plain) == "fp32" and taxonomy.precision_in_layers(layers.iloc[:0]) == ""
    )


def test_the_readmes_own_loop_snippet_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's "In your own training loop" block, run as it is written, with a model, an optimizer, a loss
    and a loader of the user's: it used ``autocast("cuda")`` and a ``scaler`` it never made, which a user on a
    CPU had to mend (tester t1). Its run directory holds the report and a recommendation."""
    readme = (Path(precprof.__file__).parent.parent / "README.md").read_text()
    section = readme.split("## In your own training loop", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
    scope = {
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.1),
        "loss_fn": nn.functional.mse_loss,
        "loader": loader,
    }
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), scope)  # the README's own code
    assert (tmp_path / "runs" / "mine" / "report.html").is_file()
    assert set(scope["tables"]) >= {"layers", "steps"} and len(scope["tables"]["steps"]) == 3
    assert precprof.recommend(tmp_path / "runs" / "mine").format


def test_the_public_names_and_fields_are_the_documented_ones() -> None:
    """t4 read the API literally: ``finish_run`` was in ``precprof.__all__`` and nowhere in the README, the
    Profiler's docstring left ``first_step`` out, and ``Finding.title``, ``Recommendation.target``, ``.device``,
    ``.block_what_if``, ``.wrapped_weight_layers`` and summary.json's ``final.tokens_per_s_basis`` were not
    documented. Each public name and field is named in the README, and each Profiler argument in its docstring."""
    readme = (Path(precprof.__file__).parent.parent / "README.md").read_text()
    named = {n for t in re.findall(r"`([^`\n]+)`", readme) for n in (t, t.split(".")[-1])}
    assert [n for n in precprof.__all__ if not n.startswith("__") and n not in named] == []
    for cls in (Finding, Recommendation):
        assert [f.name for f in dataclasses.fields(cls) if f.name not in named] == [], cls.__name__
    assert "final.tokens_per_s_basis" in named
    doc = precprof.Profiler.__doc__ or ""
    params = inspect.signature(precprof.Profiler).parameters
    assert [p for p in params if not re.search(rf"^ {{8}}{p}: ", doc, re.MULTILINE)] == []
