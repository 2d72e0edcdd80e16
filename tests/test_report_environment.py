"""The report's environment section reads as words: each fact once, with its unit and thousands separators,
no machine names (``memory_total_bytes``), no dictionary dumped as ``k=v``, no empty rows, nothing that does not
apply to the run (an FP8 recipe in an fp32 run, TF32 on a CPU).

Checked on the summary of a real gpt2-small fp8 run on an H200 (``tests/data``) and on a real CPU run.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pandas as pd
import pytest
from report_fixtures import real_run

from precprof import tables as T
from precprof.report import blocks, context, environment, render
from precprof.report import filters as F

H200 = Path(__file__).parent / "data" / "h200_fp8_summary.json"


def env_rows(page: str) -> tuple[list[tuple[str, str]], str]:
    """The environment section's (label, value) rows and its whole text."""
    m = re.search(r'<section id="environment">(.*?)</section>', page, re.S)
    assert m is not None
    body = m.group(1)
    rows = [
        (html.unescape(re.sub(r"<[^>]+>", "", k)).strip(), html.unescape(re.sub(r"<[^>]+>", "", v)).strip())
        for k, v in re.findall(r'<th scope="row">(.*?)</th><td>(.*?)</td>', body, re.S)
    ]
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", body)))
    return rows, text


def check_words(rows: list[tuple[str, str]], text: str) -> None:
    labels = [k for k, _ in rows]
    assert rows, "no rows"
    assert [k for k in labels if "_" in k] == [], "machine names as labels"
    assert len(set(labels)) == len(labels), f"a label twice: {labels}"
    assert [k for k, v in rows if v in ("", "—")] == [], "empty rows"
    # no dictionary written out as k=v pairs (a command line or a model's own settings may hold "=")
    dumped = [(k, v) for k, v in rows if k not in ("model settings",) and re.search(r"\b\w+=\S", v)]
    assert dumped == [], dumped
    for raw in ("in_use", "not loaded yet", "severity before"):
        assert raw not in text
    assert sum("sampl" in k.lower() for k in labels) == 1  # the sampling is said once


def test_an_h200_fp8_run_environment_in_words() -> None:
    summary = json.loads(H200.read_text())
    page = render.render_html({}, summary)
    rows, text = env_rows(page)
    check_words(rows, text)
    got = dict(rows)
    assert "150754820096" not in text and "124439808" not in text and "7598811333" not in text
    assert "140 GiB of memory" in got["GPU"] and "compute capability 9.0" in got["GPU"]
    assert "124,439,808 parameters" in got["size"]
    assert got["precision"].startswith("fp8: 48 linear layers in FP8 through torchao")
    assert text.count("loss scaling") == 1 and "no loss scaling" in got["precision"]
    assert got["statistics computed by"] == "the Triton kernel on cuda:0"
    assert got["steps sampled"] == "every 10th step: 4 of 40 steps"
    assert got["batch"] == "8 sequences × 1,024 tokens = 8,192 tokens a step"
    assert got["cuDNN"] == "9.19.0"
    assert "Transformer Engine" in got["not installed"]
    assert got["memory estimated before training"].startswith("7.08 GiB (parameters 475 MiB")


@pytest.mark.usefixtures("one_thread")
def test_a_cpu_fp32_run_environment_has_nothing_that_does_not_apply(tmp_path: Path) -> None:
    run = real_run("fp32", tmp_path)
    rows, text = env_rows((run / T.REPORT_FILE).read_text())
    check_words(rows, text)
    got = dict(rows)
    assert "TF32" not in got and "GPU" not in got and "CPU" in got
    assert "current scaling" not in text and "fp8" not in text.lower()
    assert got["precision"] == "fp32: no autocast; no loss scaling"


def _user_loop_rows(tmp_path: Path, batches: list[int], **kw: object) -> tuple[list[tuple[str, str]], str]:
    """A user's loop of a small MLP under a Profiler made with ``kw``, one step per batch size; its report's
    environment rows and text."""
    import torch
    from torch import nn

    import precprof

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with precprof.Profiler(model, optimizer=opt, **kw) as prof:  # type: ignore[arg-type]
        for batch in batches:
            model(torch.randn(batch, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    prof.report(tmp_path / "run")
    rows, text = env_rows((tmp_path / "run" / "report.html").read_text())
    check_words(rows, text)
    return rows, text


def test_the_steps_that_measured_memory_in_words(tmp_path: Path) -> None:
    """A Profiler that measures memory on some sampled steps says which, and which was the last (the memory
    section says which one it shows)."""
    rows, _ = _user_loop_rows(tmp_path, [4] * 6 + [2], sample_every=1, memory_every=3, block_formats=False)
    assert dict(rows)["memory measured on"] == (
        "the first 2 sampled steps and every 3rd after them, and any sampled step whose inputs had shapes no "
        "measured step had: 4 of 7 (the last: step 6); measured for new input shapes: step 6"
    )


def test_a_budgeted_runs_sampling_in_words(tmp_path: Path) -> None:
    """A user's loop with the default Profiler (sampling within its overhead budget): the environment says the
    budget, the overhead it took, the sampled steps by reason and when sampling began, in one row."""
    rows, _ = _user_loop_rows(tmp_path, [4] * 40, memory=False)
    sampled = dict(rows)["steps sampled"]
    assert sampled.startswith("as many as keep the time sampled steps add within 3% of the run's time")
    assert "of 40 steps" in sampled and "2 first" in sampled
    # the page's headline says the overhead too, as the summary has it: the number a user decides by whether
    # to leave precprof on
    page = (tmp_path / "run" / "report.html").read_text()
    # a card's value, its long qualification shown as a note under the figure joined back
    found = re.findall(
        r'<li><span class="k">([^<]*)</span><span class="v">([^<]*)</span>(?:<span class="vnote">([^<]*)</span>)?</li>',
        page,
    )
    cards = {k: f"{v} {note}" if note else v for k, v, note in found}
    sampling = T.read_summary(tmp_path / "run")[T.SUMMARY_CAPTURE]["sampling"]
    overhead, part, every = (
        sampling["overhead"],
        sampling["overhead_sampled"],
        sampling["overhead_every_step"],
    )
    # the overhead is the two parts': the sampled steps' added time and prof.step() on every step
    assert overhead == pytest.approx(part + every) and every > 0
    # the count of sampled steps, not the sampled steps' overhead share printed as one ("0 of 40 steps")
    every_step = pd.read_parquet(tmp_path / "run" / "steps.parquet")
    assert f": {int(every_step[T.SAMPLED].sum())} of 40 steps" in sampled
    # from as many timed steps as a sampled step's cost (the first step left out): 1 sampled step made 32.3%
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet").iloc[1:]
    n_s, n_u = int(steps[T.SAMPLED].sum()), int((~steps[T.SAMPLED]).sum())
    # a sampled step that adds less than the unsampled steps' times vary (their middle half, over their median):
    # the overhead is an upper bound, and the card says so (a loaded machine makes it so)
    plain, profiled = steps[~steps[T.SAMPLED]][T.TIME_S], steps[steps[T.SAMPLED]][T.TIME_S]
    cost = profiled.median() / plain.median() if min(n_s, n_u) >= 3 else float("nan")
    noise = cost < 1 or cost - 1 < (plain.quantile(0.75) - plain.quantile(0.25)) / plain.median()
    bound = (
        ("at most ", "; an upper bound: a sampled step adds less than the steps' times vary")
        if noise
        else ("", "")
    )
    assert html.unescape(cards["precprof&#39;s overhead"]) == (
        f"{bound[0]}{F.pct(overhead)} of the run's time (sampled steps {F.pct(part)}; prof.step() on every step "
        f"{F.pct(every)}; budget 3%{bound[1]})"
        if min(n_s, n_u) >= 3
        else f"not measured ({n_s} sampled, {n_u} unsampled steps timed: 3 of each needed; budget 3%)"
    )
    if (
        min(n_s, n_u) < 3
    ):  # its "cost not measured" said less; a loaded machine samples more steps, then it is
        assert "a sampled step" not in cards  # measured (the sampler takes more steps when they cost less)
    # the environment's row keeps to the card's rule: it withholds the share the card withholds, and says why
    if min(n_s, n_u) >= 3:
        assert f" (they took {bound[0]}{F.pct(part)}; precprof in all {bound[0]}{F.pct(overhead)})" in sampled
    else:
        assert (
            f" (what they took is not measured: {n_s} sampled, {n_u} unsampled steps timed: 3 of" in sampled
        )
        assert F.pct(overhead) not in sampled


def test_the_environment_withholds_the_overhead_the_header_withholds() -> None:
    """A budgeted fp16 run of 24 steps (tester h50): steps 0 and 1 sampled, the other 22 not. The header read
    "precprof's overhead: not measured (1 sampled, 22 unsampled steps timed: 3 of each needed; budget 3%)" while
    the environment's "steps sampled" row of the same page read "(they took 5.52%; precprof in all 5.67%)"."""
    from precprof.report.context import build_context

    times = [2.996, 2.371, 1.798, 0.417, 0.522, 0.957, 1.221, 0.996, 0.827, 2.448, 1.013, 1.295]
    times += [1.880, 1.587, 2.117, 2.629, 0.617, 2.912, 1.428, 2.594, 0.458, 2.032, 1.657, 3.401]
    n = len(times)
    steps = T.frame(
        "steps",
        pd.DataFrame(
            {
                T.STEP: range(n),
                T.TIME_S: times,
                T.SAMPLED: [s < 2 for s in range(n)],
                T.LOSS: [5.0] * n,
                T.LOSS_SCALE: [1.0] * n,
                T.SKIPPED: [False] * n,
            }
        ),
    )
    sampling = {
        "mode": "budget",
        "every": None,
        "budget": 0.03,
        "reasons": {"first": 2},
        "overhead": 0.0567,
        "overhead_sampled": 0.0552,
        "overhead_every_step": 0.0014,
    }
    summary = {T.SUMMARY_CAPTURE: {"sampling": sampling, "sampled_steps": 2, "steps_recorded": n}}
    ctx = build_context({"steps": steps}, summary)
    timed_sampled, timed_plain = 1, n - 2  # step 0 is warm-up: never timed
    said = f"{timed_sampled} sampled, {timed_plain} unsampled steps timed: 3 of each needed"
    assert dict(ctx["headline"])["precprof's overhead"] == f"not measured ({said}; budget 3%)"
    row = dict(dict(ctx["environment"]["groups"])["Capture"])["steps sampled"]
    assert row == (
        f"as many as keep the time sampled steps add within 3% of the run's time (what they took is not "
        f"measured: {said}): 2 of {n} steps (2 first)"
    )


def test_the_recompiles_left_out_of_the_budget_are_said() -> None:
    sampling = {
        "mode": "budget",
        "budget": 0.03,
        "overhead": 0.02,
        "reasons": {"first": 2},
        "compile_steps": 3,
    }
    text = environment.sampling_text(sampling, 2, 30)
    assert text.endswith("; 3 unsampled steps in which torch.compile compiled left out of the run's time")
    assert "torch.compile" not in environment.sampling_text({**sampling, "compile_steps": 0}, 2, 30)


@pytest.mark.parametrize("given", ["none", "off"])
def test_a_run_that_read_no_weight_update_says_why(tmp_path: Path, given: str) -> None:
    """A loop that updates its weights by hand and gives the Profiler no optimizer: the environment said "weight
    updates read on: up to 0 elements of each parameter ... before and after the optimizer step", when none
    was read. It says none was, and why."""
    import torch
    from torch import nn

    import precprof

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2) if given == "off" else None
    with precprof.Profiler(model, opt, sample_every=1, memory=False, weight_updates=given != "off") as prof:
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 1e-2 * p.grad
                    p.grad = None
            prof.step()
    prof.report(tmp_path / "run")
    rows, _ = env_rows((tmp_path / "run" / "report.html").read_text())
    check_words(rows, "")
    said = dict(rows)["weight updates read on"]
    assert said.startswith("none: ") and "up to" not in said
    assert ("no optimizer was given" in said) == (given == "none")


def test_an_optimizer_switched_mid_run_is_said_with_its_step(tmp_path: Path) -> None:
    """Adam made again as SGD at step 2 and given to ``prof.use_optimizer``: the environment named Adam, with
    its eps and beta2, for a run whose last steps SGD took. It names SGD, and says from which step."""
    import torch
    from torch import nn

    import precprof

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with precprof.Profiler(model, opt, sample_every=1, memory=False) as prof:
        for step in range(3):
            if step == 2:
                opt = torch.optim.SGD(model.parameters(), lr=1e-2)
                prof.use_optimizer(opt)
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    prof.report(tmp_path / "run")
    rows, text = env_rows((tmp_path / "run" / "report.html").read_text())
    check_words(rows, text)
    said = dict(rows)
    assert said["optimizer"] == "SGD" and said["optimizer changed"] == "from Adam to SGD at step 2"


def test_a_layer_swapped_mid_run_is_said_by_name(tmp_path: Path) -> None:
    """The last layer swapped at step 1 for a module of another class holding its parameters (as torchao's
    ``convert_to_float8_training`` does): the row said 'parameters replaced' of a change that replaced none. It
    names the module, and the step the capture followed it from."""
    import torch
    from torch import nn

    import precprof

    class Swapped(nn.Linear):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = precprof.Profiler(model, opt, sample_every=1, memory=False)
    with prof, pytest.warns(UserWarning, match="modules changed before step 2"):
        for step in range(3):
            if step == 1:
                new = Swapped(16, 1, device="meta")
                new.weight, new.bias = model[2].weight, model[2].bias
                model[2] = new
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    prof.report(tmp_path / "run")
    rows, text = env_rows((tmp_path / "run" / "report.html").read_text())
    check_words(rows, text)
    assert dict(rows)["model changed"] == (
        'at step 2: modules replaced, added or taken out: "2" (recorded as the model was from then on)'
    )


def test_a_loop_out_of_order_is_said_with_the_fix(tmp_path: Path) -> None:
    """A new AdamW made at step 2 without ``prof.use_optimizer``, and ``prof.step()`` called twice after step 3's
    optimizer step: the report said nothing of either (the memory section counted the SGD's states, and step 4
    was an empty step). The environment's "loop order" row says both, on which sampled steps, and each fix."""
    import torch
    from torch import nn

    import precprof

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = precprof.Profiler(model, opt, sample_every=1, memory=False)
    with (
        prof,
        pytest.warns(UserWarning, match="call prof.use_optimizer"),
        pytest.warns(UserWarning, match="called twice"),
    ):
        for step in range(4):
            if step == 2:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
        prof.step()  # (step 4)
    prof.report(tmp_path / "run")
    rows, text = env_rows((tmp_path / "run" / "report.html").read_text())
    check_words(rows, text)
    assert dict(rows)["loop order"] == (
        "an optimizer the Profiler was not given (AdamW) stepped the model's parameters on 2 sampled steps from "
        "step 2: their weight updates were not read, and the memory section's optimizer states and the optimizer "
        "named here are those of the optimizers it was given; 1 sampled step (step 4) ran no forward, backward or "
        "optimizer step (prof.step() called twice); to fix it, give the Profiler every optimizer the loop steps, "
        "as a list (prof.use_optimizer(new_opt) for one the loop makes later) and call prof.step() once per "
        "optimizer step, after optimizer.step()"
    )


@pytest.mark.parametrize("given", ["after_the_first_step", "before_it"])
def test_an_optimizer_given_after_the_first_step_says_from_which_step_updates_were_read(
    tmp_path: Path, given: str
) -> None:
    """minGPT's Trainer makes its optimizer in run(), and a callback reaches it first after the first batch's
    optimizer step: ``prof.use_optimizer(opt)`` there leaves step 0 without weight-update rows, and nothing
    said so (the summary's optimizer_changes empty, the environment 'up to 256 elements of each parameter').
    The summary and the environment say from which step updates were read (1: the first step whose optimizer
    step came after the hand-over, as this loop runs it) and why. Given before step 0's optimizer step, every
    step is read and nothing is said."""
    import torch
    from torch import nn

    import precprof

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    late = given == "after_the_first_step"
    with precprof.Profiler(model, sample_every=1, memory=False) as prof:  # no optimizer yet, as in a Trainer
        for step in range(4):
            if step == 0 and not late:
                prof.use_optimizer(opt)
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 0 and late:  # the Trainer's on_batch_end callback: after the batch's optimizer step
                prof.use_optimizer(opt)
            prof.step()
    first = 1 if late else 0  # the first step whose opt.step() ran with the optimizer handed over
    layers = prof.tables()["layers"]
    assert sorted(set(layers[layers[T.TENSOR] == T.WEIGHT_UPDATE][T.STEP])) == list(range(first, 4))
    assert prof.summary()["updates_from"] == {"step": first, "optimizer_given_at": 0}
    prof.report(tmp_path / "run")
    page = (tmp_path / "run" / "report.html").read_text()
    rows, text = env_rows(page)
    check_words(rows, text)
    said = dict(rows)["weight updates read on"]
    if late:
        assert said.endswith(
            "; from step 1 on, the first sampled step whose optimizer step precprof read: the optimizer was given "
            "to the Profiler (use_optimizer) during step 0, and an optimizer step taken before it was given is "
            "not seen, so the steps before 1 have no weight-update rows (give the Profiler the optimizer before "
            "the first step to read them all)"
        )
        assert "Weight updates: from step 1 on" in html.unescape(page)  # under the timeline too
    else:
        assert "from step" not in said and "Weight updates: from step" not in page


def test_a_tied_weight_is_said_with_its_owner_and_escaped(tmp_path: Path) -> None:
    """A tied output head has no weight rows of its own: the environment says whose weight it is (the module
    names escaped, as every name on the page)."""
    import torch
    from torch import nn

    import precprof

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("<i>emb", nn.Embedding(16, 8))
    model.add_module("<b>head", nn.Linear(8, 16, bias=False))
    model[1].weight = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for _ in range(2):
            model(torch.randint(0, 16, (4,))).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    prof.report(tmp_path / "run")
    page = (tmp_path / "run" / "report.html").read_text()
    rows, text = env_rows(page)
    check_words(rows, text)
    assert dict(rows)["tied or shared weights"] == (
        "<b>head.weight is <i>emb's (recorded once, under its first owner)"
    )
    assert "<b>head" not in page and "&lt;b&gt;head.weight is &lt;i&gt;emb" in page


def test_a_hugging_face_models_sizes_are_said_once() -> None:
    """GPT-2's config answers both its own names and the common ones (n_embd and hidden_size, n_head and
    num_attention_heads): the size row said "32 wide, 32 wide ... num attention heads 2, num hidden layers 2"."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from precprof.integrations._common import model_info
    from precprof.report.environment import environment

    info = model_info(
        GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32))
    )
    assert info["n_embd"] == info["hidden_size"] == 32 and info["num_attention_heads"] == 2
    size = dict(dict(environment({T.SUMMARY_MODEL: info})["groups"])["Model"])["size"]
    assert (
        size
        == f"{info['n_params']:,} parameters, 2 layers, 2 attention heads, 32 wide, 96 tokens in the vocabulary"
    )


def test_adaptive_block_groups_are_not_said_to_take_every_nth_step_exactly() -> None:
    """An adaptive what-if whose groups went 19 -> 2 -> 5 (each layer evaluated on 2 to 10 sampled steps): the
    what-if section said 'each is evaluated on every 5th sampled step, exactly' (the last group count) and the
    environment 'every 5th sampled step (5 groups taking turns)' beside 'each on 2 to 10 sampled steps'."""
    changes = [{"step": 5, "groups": 2, "from": 19}, {"step": 6, "groups": 3, "from": 2}]
    changes += [{"step": 8, "groups": 5, "from": 3}]
    capture = {"groups": 5, "adaptive": True, "budget": 0.1, "changes": changes, "evaluations": [2, 10]}
    capture |= {"layers": 17, "layers_evaluated": 17}
    counts = [capture["groups"]] + [c[k] for c in changes for k in ("groups", "from")]
    lo, hi = min(counts), max(counts)
    setting = environment.block_setting(capture)
    assert "every 5th" not in setting and f"in {lo} to {hi} groups" in setting
    assert "each on 2 to 10 sampled steps" in setting
    turns = blocks.table({"block_what_if": {"layers": [{"module": "fc"}]}}, capture)["turns"]
    assert "exactly" not in turns and turns.endswith(
        f"{lo} to {hi} groups as the run went on: each was evaluated on 2 to 10 sampled steps"
    )
    fixed = blocks.table({"block_what_if": {"layers": [{"module": "fc"}]}}, {"groups": 4})["turns"]
    assert fixed == "the layers take turns: each is evaluated on every 4th sampled step, exactly"


def test_an_nn_sequentials_numbered_modules_read_as_names_in_the_environments_prose() -> None:
    """The environment's sentences that name modules quote a name of numbers alone, an nn.Sequential's child, as
    the findings do: "modules replaced, added or taken out: 0, 3" read as counts."""
    from precprof.analysis.advisor.evidence import _optimizer_named

    unread = environment.weight_grads_unread({"weight_grads_unread_modules": {"0": 3, "head": 3}})
    assert '2 layer(s) on the sampled steps that read the others\' ("0", head)' in unread, unread
    changes = environment._model_changes([{"step": 4, "modules": ["0", "3", "blocks.1"]}])
    assert 'modules replaced, added or taken out: "0", "3", blocks.1' in changes, changes
    assert (
        environment._shared_text({"2": {"weight": "0"}})
        == '2.weight is "0"\'s (recorded once, under its first owner)'
    )
    assert _optimizer_named([{"class": "Adam", "modules": ["0", "2"]}], 0) == 'optimizer 0 (Adam: "0", "2")'


def test_the_steps_sampled_counted_from_a_steps_table_without_step_numbers() -> None:
    """A steps table whose sampled rows hold no step number (the property test's hostile tables): counting the
    sampling from it raised "cannot convert float NaN to integer" at the first sampled step, and the page was
    not written. It says the counts, and no first sampled step."""
    from precprof.report.context import sampling_from_steps

    steps = pd.DataFrame({T.STEP: [float("nan")] * 2, T.SAMPLED: [True, False]})
    said = sampling_from_steps({T.SUMMARY_CAPTURE: {}}, steps)[T.SUMMARY_CAPTURE]
    assert said["sampled_steps"] == 1 and said["steps_recorded"] == 2
    assert "first_sampled_step" not in said["sampling"]
    # the built-in loop's first summary says its interval in its config, not its capture: a killed
    # --sample-every 1 run was said to sample "within the overhead budget (not recorded)" (reviewer r2)
    killed = {T.SUMMARY_CONFIG: {"sample_every": 1}, T.SUMMARY_CAPTURE: {}}
    sampling = sampling_from_steps(killed, steps)[T.SUMMARY_CAPTURE]["sampling"]
    assert (sampling["mode"], sampling["every"]) == ("every", 1)


def test_the_overhead_row_counts_every_paused_step_and_names_the_median_it_counts_them_at() -> None:
    """Reviewer r2: past the 64 the summary lists, the row said "64 sampled steps" of 99, and "counted at their
    median time" read as the paused steps' own median (it is the recent sampled steps')."""
    listed = list(range(8, 8 + 8 * 64, 8))
    (said,) = context._paused({"paused_steps": listed, "paused_s": 97.9, "paused_count": 99})
    assert said.startswith("99 sampled steps (8, 16, 24, 32, 40, 48, ...) took over 4x the other steps' time")
    assert "counted at the recent sampled steps' median time, 97.90 s left out" in said
    (old,) = context._paused({"paused_steps": [8, 16], "paused_s": 3.0})  # a summary before the count
    assert old.startswith("2 sampled steps (8, 16)")


def test_a_resumed_runs_weight_update_row_says_whose_none_it_is() -> None:
    """Reviewer r2: an attempt resumed at step 20 that sampled one micro-batch step said "none: the optimizer
    ... stepped on none of the 1 sampled steps, so no weight update was read" of a run whose layers table holds
    the first attempt's updates of steps 1-19: the capture's count is the last attempt's."""
    capture = {"sampled_steps": 1, "updates_read_steps": 0, "stream": {"resumed_from": 20}}
    said = environment._update_reads(256, {"class": "AdamW"}, capture)
    assert said.startswith(
        "none in the attempt resumed at step 20 (the earlier attempts' updates read are in the tables): the "
        "optimizer the Profiler was given stepped on none of the 1 sampled steps"
    )
    plain = environment._update_reads(256, {"class": "AdamW"}, {"sampled_steps": 1, "updates_read_steps": 0})
    assert plain.startswith(
        "none: the optimizer the Profiler was given stepped on none of the 1 sampled steps"
    )


def test_a_resumed_runs_memory_row_says_whose_counts_they_are() -> None:
    """Tester t8: a run resumed at step 10 said "memory measured on ...: 0 of 0" beside a memory table holding
    the first attempt's step 0, from which the memory section is built: the counts are the last attempt's."""
    v = {"every": 4, "measured_steps": 0, "sampled_steps": 0}
    said = environment.memory_setting(v, resumed=10)
    assert said.endswith(
        ": 0 of 0 in the attempt resumed at step 10; the earlier attempts' measurements are in the memory table"
    )
    assert environment.memory_setting(v).endswith(": 0 of 0")


def test_a_resumed_runs_block_budget_row_says_whose_measurements_they_are() -> None:
    """Tester t8: a resumed run's block what-if row said "this run's measured it on none" of the last attempt's
    budget alone (a resumed attempt measures the what-if's cost anew; the earlier attempt had measured it)."""
    v = {
        "adaptive": True,
        "groups": 9,
        "group_sizes": [1],
        "budget": 0.1,
        "estimates": 0,
        "estimates_to_widen": 3,
    }
    said = environment.block_setting(v, resumed=10)
    assert "; the attempt resumed at step 10 measured it on none" in said and "this run's" not in said
    assert "; this run's measured it on none" in environment.block_setting(v)


def test_a_budgeted_runs_unsampled_tail_is_said_with_why() -> None:
    """A sampled step that cost far more than the others (a wait of 1.6 s for the run directory's writer, starved
    of CPU: tester t1's 10,000-step run) spent the budget, and no step after it was sampled: the last 3,643
    steps of the run had no layer statistics, its heatmaps ended at step 6,300, and nothing said why. A real
    budgeted run of 1,200 fast steps whose second sampled step sleeps 0.5 s (no pause: under a second more than
    the others), which spends the budget for good (the run's 1,200 steps of a fraction of a millisecond would
    need 17 s to hold it), says which steps went unsampled and why; a run sampled at the budget's pace to its
    end says nothing of it."""
    import time

    import torch
    from torch import nn

    import precprof

    def run(stall_s: float) -> tuple[dict[str, object], pd.DataFrame]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        stalled = False
        with precprof.Profiler(model, optimizer=opt, memory=False, block_formats=False) as prof:
            for step in range(1200):
                loss = model(torch.randn(4, 8)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                if stall_s and not stalled and step >= 1 and prof.sampling:
                    time.sleep(stall_s)
                    stalled = True
                prof.step()  # (no loss: no loss spike sampled late, whatever the random batches)
            steps = prof.tables()["steps"]
            capture = prof.summary()
        return capture, steps

    capture, steps = run(0.5)
    s = capture["sampling"]
    sampled = steps.loc[T.flags(steps[T.SAMPLED]), T.STEP]
    assert s["last_sampled_step"] == int(sampled.max()) and s["last_step"] == 1199
    assert sampled.tolist() == [0, 1]  # the first two steps, then none: no loss given, no loss spike sampled
    tail = 1198
    text = environment.sampling_text(s, len(sampled), len(steps))
    assert (
        f"none of the last {F.count(tail)} steps (after step {F.count(int(sampled.max()))}, to step 1,199) was "
        "sampled: none fitted the budget, which the sampled steps before them had spent" in text
    )
    assert s["overhead_sampled"] > s["budget"] and "is paid for by the steps after it" in text
    assert f"{F.count(len(sampled))} of 1,200 steps" in text
    # the heatmap over the sampled steps, which ends at the last of them, says so too
    assert environment.unsampled_tail(s, steps) == (
        f"No step after step {F.count(int(sampled.max()))} was sampled (the run went on to step 1,199): the "
        "columns end there; the environment section’s “steps sampled” says why."
    ).replace("’", "'")
    # a run that sampled at the budget's pace to its end, or whose thinning spaces samples further apart than its
    # unsampled last steps: nothing said
    even = {**s, "overhead_sampled": 0.029, "last_sampled_step": 1150}
    assert "none of the last" not in environment.sampling_text(even, 40, 1200)
    near_end = steps.assign(**{T.SAMPLED: steps[T.STEP].isin([0, 1, 1150])})
    assert environment.unsampled_tail(s, near_end) == ""
    thinned = {
        **s,
        "thinned": {"after": 200, "doubling_every": 100, "least_gap": 400},
        "last_sampled_step": 500,
    }
    assert "none of the last" not in environment.sampling_text(thinned, 40, 1200)
