"""The per-layer table's rows of a head tied to its embedding and of a frozen layer: they say so, where "—" alone
(no param dtype, no weight gradient, no update) read as a layer without parameters."""

from __future__ import annotations

import html
import re
import warnings
from pathlib import Path

import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof.analysis import memory_projection
from precprof.report import environment, render
from precprof.report import summarize as S


class _TiedFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.mix = nn.Linear(8, 8)
        self.mix.bias.requires_grad_(False)  # part frozen: its weight trains
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(self.mix(h + self.frozen(h)))


def _cells(page: str) -> dict[str, list[str]]:
    """The per-layer table's cells as text, by module."""
    body = page.split('id="layer-table"', 1)[1].split("</table>", 1)[0]
    out = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)[1:]:
        cells = [
            " ".join(html.unescape(re.sub("<[^>]+>", " ", c)).split())
            for c in re.findall(r"<td.*?</td>", row)
        ]
        out[cells[1]] = cells
    return out


def test_a_tied_head_and_a_frozen_layer_say_so_in_their_rows() -> None:
    torch.manual_seed(0)
    model = _TiedFrozen()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        model(torch.randint(0, 16, (2, 4))).square().mean().backward()
        opt.step()
        prof.step()
    summary = {T.SUMMARY_CAPTURE: prof.summary()}
    assert T.frozen_params(summary) == {"frozen": ["weight", "bias"], "mix": ["bias"]}
    assert T.frozen_params({}) == {}  # a run recorded before the capture said so: nothing said
    rows = S.layer_records(prof.tables()["layers"], T.shared_params(summary), T.frozen_params(summary))
    layers_cols = {"lost_updates": True, "update_format": "bf16", "update_held": "", "nonfinite": False}
    page = (
        render.environment()
        .get_template("_layers.html.j2")
        .render(
            section={"id": "layers", "number": 5, "heading": "Per layer"},
            layers=rows,
            layer_inputs=1,
            layers_cols=layers_cols,
            update_ratios=[],
            update_nonfinite=[],
        )
    )
    cells = _cells(page)
    # param dtype, weight grad dtype, updates lost
    head, frozen, mix = cells["head"], cells["frozen"], cells["mix"]
    assert (head[3], head[6], head[-1]) == ("tied to emb", "tied to emb", "tied to emb"), head
    assert (frozen[3], frozen[6], frozen[-1]) == ("float32", "frozen", "frozen"), frozen
    assert mix[6] == "float32 bias frozen" and mix[-1].endswith("%"), mix
    assert "Of its 5 rows, 1 is not a layer but" in " ".join(page.split())  # (mix:input: h + frozen(h))


def test_a_layer_unfrozen_and_frozen_again_is_not_called_frozen() -> None:
    """Gradual unfreezing: ``mid`` frozen on steps 0-1, trained on 2-3, frozen again on 4-5, and the whole model
    frozen after the loop (before an export). It was called "frozen" (beside its gradient and update rows on 2-3),
    and every layer with it: the summary now says when each trained, the row "had gradients on sampled steps 2-3", and the
    model's trainable counts are per run of sampled steps, the memory textbook's of the step measured (the end's
    alone were said: 0 of them train)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 8))
    model[1].requires_grad_(False)
    model[2].requires_grad_(False)  # frozen throughout
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for step in range(6):
            if step in (2, 4):
                model[1].requires_grad_(step == 2)
            model(torch.randint(0, 8, (2, 3))).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
        model.requires_grad_(False)
    summary = {T.SUMMARY_CAPTURE: prof.summary()}
    assert T.frozen_params(summary) == {"2": ["weight", "bias"]}  # (the layer frozen throughout, alone)
    runs = [[0, 1, False, False], [2, 3, True, True], [4, 5, False, False]]
    changed = T.trainable_changed(summary)
    assert changed["1"] == {p: {"runs": runs, "end": False} for p in ("weight", "bias")}
    assert changed["3"]["weight"] == {"runs": [[0, 5, True, True]], "end": False} and "2" not in changed
    n_all, n_mid = sum(p.numel() for p in model.parameters()), 20
    n_rest = n_all - 2 * n_mid
    assert T.trainable_changes(summary) == {
        "numel": [[0, 1, n_rest], [2, 3, n_rest + n_mid], [4, 5, n_rest]],
        "most": n_rest + n_mid,
        "end": 0,
    }
    assert T.trainable_at(summary, 3) == n_rest + n_mid and T.trainable_at(summary, 9) is None
    assert T.trainable_changes({}) == T.trainable_changed({}) == {}  # a run recorded before: nothing said
    layers = prof.tables()["layers"]
    rows = {
        r["module"]: r
        for r in S.layer_records(layers, T.shared_params(summary), T.frozen_params(summary), changed=changed)
    }
    label, tip = rows["1"]["trainable_changed"]
    assert (rows["1"]["frozen"], label) == ([], "weight, bias had gradients on sampled steps 2\u20133"), rows[
        "1"
    ]
    assert "False on sampled steps 0\u20131, True on 2\u20133, False on 4\u20135; False at the end" in tip
    assert rows["3"]["trainable_changed"][0] == "weight, bias had gradients on sampled steps 0\u20135"
    assert rows["2"]["frozen"] == ["weight", "bias"] and rows["2"]["trainable_changed"] is None
    # the memory textbook's gradients are of those that trained on the step it reads, not at the end: memory is
    # measured on the step after ``mid`` first trained (3: ``MemorySchedule.trains``; frozen again on 4, it trains
    # as many as steps 0-1, measured), and step 3, with ``mid`` training, held the most
    memory = memory_projection.project(prof.tables()["memory"], summary, facts=prof._tracker.model_facts())
    saved = {**summary, T.SUMMARY_MEMORY: memory}
    assert sorted(set(prof.tables()["memory"][T.STEP])) == [0, 1, 3]
    assert memory["step"] == 3 and memory["model"]["n_trainable"] == 0  # (memory.model: the end's)
    textbook = next(a for a in memory["assumptions"] if a.startswith("Textbook"))
    n_3 = n_rest + n_mid
    assert f"the gradients' N is the {n_3:,} of {n_all:,} parameters that train on step 3, " in textbook
    assert environment.trainable(saved, 3) == (n_3, n_all) and environment.trainable(saved, 5) == (
        n_rest,
        n_all,
    )
    assert environment.trainable(saved) == (0, n_all)
    assert environment.trainable_changes_said(summary) == (
        f"requires_grad changed during the run: {n_rest} parameters trainable on sampled steps 0\u20131, "
        f"{n_rest + n_mid} on 2\u20133, {n_rest} on 4\u20135 (at most {n_rest + n_mid} at once)"
    )


def _attempt(out: object, first: int, last: int, mid: bool, resume: bool) -> precprof.Profiler:
    """Steps ``first`` to ``last`` of a tiny run streamed into ``out``, its middle layer trained or not."""
    torch.manual_seed(first)
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8))
    model[1].requires_grad_(mid)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"resume": True, "first_step": first} if resume else {}
    with precprof.Profiler(model, optimizer=opt, sample_every=1, out=out, memory=False, **kw) as prof:
        for _ in range(first, last):
            model(torch.randint(0, 8, (2, 3))).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    prof.report()
    return prof


def test_a_resumed_run_and_a_run_without_memory_say_what_trained(tmp_path: object) -> None:
    """Reviewer r1: a resumed run's layer trained before the restart (steps 0-2) and frozen after it was called
    "frozen throughout" beside its own gradient rows (the capture's word is its last attempt's): the page holds it
    to the tables. Without memory measured, the Model row said "all train at the end" of a run whose end froze a
    layer (the memory breakdown's count, missing, read as all): the capture's end count is said. A layer frozen on
    every sampled step and set to train after them had its label dropped ("—"), reading "on steps none"."""
    out = Path(str(tmp_path)) / "run"
    _attempt(out, 0, 3, True, False)
    _attempt(out, 3, 6, False, True)
    summary, layers = T.read_summary(out), T.read_tables(out)["layers"]
    # the summary's word is every attempt's (it was the last one's: frozen throughout, and no label said when the
    # layer had gradients), read from the earlier attempt's rows
    assert (
        T.frozen_params(summary) == T.frozen_params(summary, layers) == {}
    )  # its gradient rows of steps 0-2
    runs = [[0, 2, True, True], [3, 5, False, False]]
    assert T.trainable_changed(summary)["1"] == {p: {"runs": runs, "end": False} for p in ("weight", "bias")}
    assert "0" not in T.trainable_changed(summary)  # (trained in both attempts: no change)
    # an earlier attempt's step without a gradient: its requires_grad was not recorded, and is not guessed
    _, tip = S.trainable_said(
        {"weight": {"runs": [[0, 2, None, False], [3, 4, True, True]], "end": False}}
    ) or ("", "")
    assert "changed during the run: not recorded on sampled steps 0\u20132, True on 3\u20134; False at" in tip
    page = (out / T.REPORT_FILE).read_text()
    row = re.search(r'<tr><td data-v="\d+">\d+</td><td class="mod"><code>1</code>.*?</tr>', page, re.S)
    assert row is not None and "frozen" not in row.group(0)
    assert "weight, bias had gradients on sampled steps 0\u20132" in html.unescape(row.group(0)), row.group(0)
    # memory off; the middle layer trained on steps 1-2, the last frozen at the end, the embedding frozen on
    # every sampled step and set to train after them
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[0].requires_grad_(False)
    with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
        for step in range(4):
            model[1].requires_grad_(step in (1, 2))
            model(torch.randint(0, 8, (2, 3))).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
        model[2].requires_grad_(False)
        model[0].requires_grad_(True)
    page = prof.report(Path(str(tmp_path)) / "memory-off").read_text()
    capture = prof.summary()
    n = sum(p.numel() for p in model.parameters())
    said = dict(environment._model({}, {}, capture)).get("size", "")
    end = n - 20 - 40  # the middle layer's 4 x 4 + 4 and the last one's 4 x 8 + 8 frozen at the end
    assert said.startswith(f"{end} of {n} parameters train at the end"), said
    label = "weight frozen on every sampled step, requires_grad at the end"
    assert T.trainable_changed({T.SUMMARY_CAPTURE: capture})["0"]["weight"]["end"] is True
    row = re.search(r'<tr><td data-v="\d+">\d+</td><td class="mod"><code>0</code>.*?</tr>', page, re.S)
    assert row is not None and label in html.unescape(row.group(0)), row


def test_the_memory_textbooks_count_is_said_of_the_step_it_is_of() -> None:
    """Reviewer r1: where requires_grad changed during the run, the textbook line said "on step 5, the step
    measured" of the end's count whenever step 5 was in none of the sampled steps' runs (a step cut off by a
    crash, an earlier attempt's): it says "at the end" then, and "not training then" where "frozen" meant frozen
    throughout."""
    src = (Path(render.templates_dir()) / "_memory.html.j2").read_text()
    line = next(x for x in src.splitlines() if 'id="memory-trainable"' in x)
    tpl = render.environment().from_string(line.replace("tab is sameas memory.textbook and ", ""))
    summary = {
        T.SUMMARY_CAPTURE: {"trainable_changes": {"numel": [[10, 15, 150]], "most": 150, "end": 60}},
        T.SUMMARY_MEMORY: {"step": 5, "model": {"n_params": 200, "n_trainable": 60}},
    }
    for step, said in ((5, "60 of 200 parameters train at the end (30%), 140 not training then"), (12, None)):
        memory = {
            "trainable": environment.trainable(summary, step),
            "trainable_changes": environment.trainable_changes_said(summary),
            "trainable_on_step": T.trainable_at(summary, step) is not None,
            "step_measured": step,
        }
        text = re.sub(r"<[^>]+>", "", tpl.render(memory=memory))
        if said is None:
            assert text.startswith("150 of 200 parameters train on step 12, the step measured (75%)"), text
        else:
            assert text.startswith(said), text


def test_a_layer_unfrozen_outside_the_optimizer_is_said_to_get_no_update() -> None:
    """Tester t3: the Hugging Face Trainer builds its optimizer from the parameters trainable at the start; a
    layer unfrozen later gets gradients and is never updated, and precprof said it had trained. A finding names
    it; none where the optimizer holds it (built over all parameters, or given the layer when unfrozen)."""

    def run(how: str) -> precprof.Recommendation:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8))
        model[1].requires_grad_(False)
        trainable = model.parameters() if how == "all" else [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(trainable, lr=0.1)
        with precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False) as prof:
            for step in range(4):
                if step == 2:
                    model[1].requires_grad_(True)
                    if how == "added":
                        opt.add_param_group({"params": list(model[1].parameters())})
                model(torch.randint(0, 8, (2, 3))).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                prof.step()
        return precprof.recommend(prof)

    f = run("left out").finding("gradients_not_applied")
    assert f is not None and f.modules == ["1"], f
    assert (f.numbers["parameters"], f.numbers["steps"]) == (2, 2)
    assert "add_param_group" in f.remedy
    assert run("all").finding("gradients_not_applied") is None
    assert run("added").finding("gradients_not_applied") is None


def test_a_head_added_after_the_optimizer_was_built_is_said_to_get_no_update() -> None:
    """The commonest form of the bug: a head added to the model after the optimizer was built. Its requires_grad is
    set throughout and its gradient is computed on every step; it never moves, and nothing said so (the finding
    fired only for a layer unfrozen during the run). The capture records the parameters no optimizer it follows
    held on the sampled steps they stepped in, and the finding names them. None where they are held: a tied head
    (the embedding's Parameter under another name), the optimizer over every parameter, a second optimizer given
    to the Profiler that holds the head, a param group added mid-run; none for a frozen layer left out of the
    optimizer, an optimizer the Profiler was not given that steps the head, or a Profiler that follows none."""

    def run(how: str) -> tuple[precprof.Profiler, dict[str, list[str]]]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 8, bias=False)
        )
        model[1].requires_grad_(False)  # frozen, and left out of the optimizer: no gradient, nothing said
        if how == "tied":
            model[3].weight = model[0].weight
        # (tied: the embedding's weight held as the head's alone)
        params = [*model[3].parameters(), *model[2].parameters()] if how == "tied" else model.parameters()
        opt = torch.optim.SGD([p for p in params if p.requires_grad], lr=0.1)
        if how != "tied":
            model.append(nn.Linear(8, 8))  # the new head, after the optimizer was built
        others = [torch.optim.SGD(model[-1].parameters(), lr=0.1)] if how in ("second", "not given") else []
        given = {"second": [opt, *others], "none": None}.get(how, opt)
        with precprof.Profiler(model, optimizer=given, sample_every=1, memory=False) as prof:
            for step in range(4):
                if how == "group" and step == 2:
                    opt.add_param_group({"params": list(model[-1].parameters())})
                model(torch.randint(0, 8, (2, 3))).square().mean().backward()
                for o in [opt, *others]:
                    o.step()
                    o.zero_grad(set_to_none=True)
                if (
                    how == "by hand"
                ):  # stepped by the loop's own code, through .data (no version bump); of the
                    # weight only the row of token 0, as a hand-stepped embedding moves the batch's rows (its
                    # extremes stay where they were: its exponent histogram tells, reviewer r2)
                    model[-1].weight.data[0].mul_(0.8)
                    model[-1].bias.data.add_(model[-1].bias.grad, alpha=-0.1)
                    model[-1].zero_grad(set_to_none=True)
                prof.step()
        return prof, prof.summary().get("trainable_not_in_optimizer", {})

    prof, loose = run("head")
    assert loose == {"4": ["weight", "bias"]}, loose
    f = precprof.recommend(prof).finding("gradients_not_applied")
    assert f is not None and f.modules == ["4"], f
    assert (f.numbers["parameters"], f.numbers["steps"]) == (2, 4)
    assert "added to the model after the optimizer was built" in f.message, f.message
    assert "unfrozen" not in f.message and "when you add the module," in f.remedy, f.remedy
    # the weights' own rows show they never moved; a backbone meant to stay fixed is told to freeze (reviewer r1)
    assert "their weights' extremes and exponent histogram were the same on every sampled step" in f.message
    assert "linear probing" in f.message and "requires_grad_(False)" in f.remedy, f.remedy
    for how in ("tied", "second", "group", "not given", "none", "by hand"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ("not given": the loop's order is warned about)
            prof, loose = run(how)
        # (an optimizer the Profiler was not given holds it and stepped it: the capture says so apart, not that
        # it is in no optimizer, and steps_without_update speaks of the other optimizer)
        assert loose == ({"4": ["weight", "bias"]} if how == "by hand" else {}), (how, loose)
        beside = prof.summary().get("trainable_in_optimizer_not_given", {})
        assert beside == ({"4": ["weight", "bias"]} if how == "not given" else {}), (how, beside)
        if (
            how in ("tied", "not given", "by hand")
        ):  # (by hand: no optimizer holds it, and its weights moved)  # (the others: the rule has nothing to go on, and 0.3 s each)
            assert precprof.recommend(prof).finding("gradients_not_applied") is None, how
