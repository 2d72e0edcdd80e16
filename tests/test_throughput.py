"""Throughput counts the steps precprof left alone: not the sampled steps, not the first step's warm-up.

On an H100 the report showed bf16 at 10,572 tokens/s while its median step took 75 ms (109,000 tokens/s):
the rate was tokens over wall time, sampled steps and the first step's compilation included.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import forks
import numpy as np
import pandas as pd
import pytest

from precprof import tables as T
from precprof.analysis.throughput import BASIS_ALL, BASIS_UNSAMPLED, compiled_steps, throughput
from precprof.report import filters as F
from precprof.report.context import _headline
from precprof.training import TrainConfig, train


def _steps(times: list[float], sampled: list[bool], tokens: float = 8192.0) -> pd.DataFrame:
    n = len(times)
    return pd.DataFrame(
        {
            T.STEP: np.arange(n),
            T.TIME_S: times,
            T.SAMPLED: sampled,
            T.TOKENS: [tokens] * n,
            T.LOSS: np.linspace(3.0, 2.0, n),
            T.SKIPPED: [False] * n,
        }
    )


def test_h100_like_run_reports_the_unsampled_rate() -> None:
    # gpt2-small bf16 8x1024 on an H100: a first step of 18.8 s (compilation, sampled), sampled steps of
    # 770 ms every 10th step, the others 75 ms
    times = [18.8] + [0.770 if i % 10 == 0 else 0.075 for i in range(1, 50)]
    sampled = [i % 10 == 0 for i in range(50)]
    tp = throughput(_steps(times, sampled))
    assert tp["tokens_per_s"] == pytest.approx(8192 / 0.075)
    assert tp["tokens_per_s_basis"] == BASIS_UNSAMPLED and tp["tokens_per_s_steps"] == 45
    assert tp["step_time_sampled_median_s"] == pytest.approx(0.770)  # the first step is left out
    assert tp["sampled_step_cost"] == pytest.approx(0.770 / 0.075)
    wall = 50 * 8192 / sum(times)
    assert wall < tp["tokens_per_s"] / 4  # what the report used to show


def test_every_step_sampled_counts_all_but_the_first() -> None:
    tp = throughput(_steps([5.0, 0.2, 0.3, 0.25, 0.2], [True] * 5, tokens=100.0))
    assert tp["tokens_per_s_basis"] == BASIS_ALL and tp["tokens_per_s_steps"] == 4
    assert tp["tokens_per_s"] == pytest.approx(100 / 0.225)
    assert math.isnan(tp["sampled_step_cost"])  # nothing unprofiled to compare with


def test_a_resumed_attempts_first_step_is_warm_up_too() -> None:
    """A run resumed at step 40 (``Profiler(resume=True, first_step=40)``): its new process's first step is
    warm-up as the run's step 0 is (3.0 s here, sampled as a first step). Counted, "a sampled step 956.61x an
    unsampled one" came from a median over 4 sampled steps, two of them the attempts' first."""
    times = [3.0] + [0.2 if i % 10 == 1 else 0.05 for i in range(1, 40)]  # the first attempt, steps 0-39
    times += [3.0] + [0.2 if i % 10 == 1 else 0.05 for i in range(41, 60)]  # resumed at 40
    sampled = [i == 0 or i % 10 == 1 or i == 40 for i in range(60)]
    steps = _steps(times, sampled)
    steps[T.RESUMED] = steps[T.STEP] == 40
    tp = throughput(steps)
    assert tp["steps_timed_sampled"] == sum(sampled) - 2
    assert tp["step_time_sampled_median_s"] == pytest.approx(0.2)
    assert tp["sampled_step_cost"] == pytest.approx(0.2 / 0.05)


def test_missing_times_and_tokens() -> None:
    assert math.isnan(throughput(pd.DataFrame())["tokens_per_s"])
    tp = throughput(_steps([1.0, 0.5, math.nan, 0.5, 0.5, 0.5], [False] * 6, tokens=math.nan))
    assert math.isnan(tp["tokens_per_s"]) and tp["step_time_unsampled_median_s"] == 0.5


@pytest.mark.parametrize("sampled_at", [(0, 3, 6), (0, 3, 5, 6)])
def test_the_overhead_card_keeps_to_the_sampled_step_costs_rule(sampled_at: tuple[int, ...]) -> None:
    """A run cut short after 9 steps, every 3rd sampled (the times of the Ctrl-C run of the report): the header
    said "precprof's overhead 32.4% of the run's time" from 2 timed sampled steps (step 0, warm-up, is not
    timed), while it withheld the cost of a sampled step from fewer than 3. Both keep to one rule now."""
    times = [8.4, 4.41, 0.33, 5.91, 2.16, 3.53, 2.02, 2.04, 1.25]
    sampled = [s in sampled_at for s in range(len(times))]
    summary = {T.SUMMARY_CAPTURE: {"sampling": {"mode": "every", "every": 3, "overhead": 0.324}}}
    head = dict(_headline(summary, _steps(times, sampled), pd.DataFrame()))
    n_sampled = sum(sampled[1:])  # the first step is left out of both
    n_plain = len(times) - 1 - n_sampled
    if n_sampled < 3:
        assert head["precprof's overhead"] == (
            f"not measured ({n_sampled} sampled, {n_plain} unsampled steps timed: 3 of each needed)"
        )
        assert "a sampled step" not in head  # said once
    else:
        assert head["precprof's overhead"] == (
            "32.4% of the run's time (every 3rd step sampled: a fixed interval, not the Profiler's default budget "
            "of 3%)"
        )
        cost = float(np.median([t for t, s in zip(times[1:], sampled[1:], strict=True) if s])) / float(
            np.median([t for t, s in zip(times[1:], sampled[1:], strict=True) if not s])
        )
        assert head["a sampled step"] == f"{cost:.2f}× an unsampled one"


@pytest.mark.parametrize(
    "plain, profiled",
    [
        ([0.03, 0.83, 0.05, 0.75, 0.04, 0.81, 0.03, 0.79], [0.20, 0.21, 0.19]),  # sampled faster: noise
        ([0.30, 0.70, 0.35, 0.65, 0.40, 0.60, 0.45, 0.55], [0.55, 0.56, 0.54]),  # 1.1x, inside the spread
        ([0.10, 0.10, 0.11, 0.10, 0.10, 0.11, 0.10, 0.10], [0.20, 0.21, 0.20]),  # 2x of steady steps
    ],
)
def test_the_overhead_within_the_steps_noise_is_said_to_be_an_upper_bound(
    plain: list[float], profiled: list[float]
) -> None:
    """A noisy machine's header read "14.8% of the run's time (sampled steps 13.3%; ...)" beside "a sampled step:
    cost not measured (... noise)": the sampler counts what each sampled step seemed to add, clipped at 0, so
    where a sampled step adds less than the steps' times vary that share is an upper bound, and the card says so;
    of steady steps it is a measurement, said plainly."""
    times = [1.0, *plain, *profiled]  # step 0, warm-up, is left out
    sampled = [False] * (1 + len(plain)) + [True] * len(profiled)
    sampling = {
        "mode": "every",
        "every": 3,
        "overhead": 0.148,
        "overhead_sampled": 0.133,
        "overhead_every_step": 0.015,
    }
    head = dict(
        _headline({T.SUMMARY_CAPTURE: {"sampling": sampling}}, _steps(times, sampled), pd.DataFrame())
    )
    median = float(np.median(plain))
    cost = float(np.median(profiled)) / median
    spread = float(np.quantile(plain, 0.75) - np.quantile(plain, 0.25)) / median
    parts = (
        "sampled steps 13.3%; prof.step() on every step 1.5%; every 3rd step sampled: a fixed interval, not the "
        "Profiler's default budget of 3%"
    )
    if cost < 1 or cost - 1 < spread:
        assert head["precprof's overhead"] == (
            f"at most 14.8% of the run's time ({parts}; an upper bound: a sampled step adds less than the steps' "
            "times vary)"
        )
    else:
        assert head["precprof's overhead"] == f"14.8% of the run's time ({parts})"
    assert (cost < 1) == head["a sampled step"].startswith("cost not measured")
    # beside the bound, what the medians make of the sampled steps' share, and why the two differ (h76: "at most
    # 8.09%" beside "1.07x an unsampled one", about 0.75% on its 12 sampled steps, unexplained)
    added = len(profiled) * (float(np.median(profiled)) - median) / (sum(plain) + sum(profiled))
    if 1 <= cost < 1 + spread:
        assert head["a sampled step"] == (
            f"{cost:.2f}× an unsampled one (their median times; at that cost the 3 sampled steps timed took about "
            f"{F.pct(added)} of the run's time. The overhead above is an upper bound: it counts each sampled step's "
            "time over the unsampled steps just before it, one that came out faster as adding nothing, which on "
            "steps as uneven as these counts their noise as cost)"
        )
    elif cost >= 1:
        assert head["a sampled step"] == f"{cost:.2f}× an unsampled one"


def test_a_training_run_reports_and_renders_the_unsampled_rate(tmp_path: Path) -> None:
    cfg = TrainConfig(
        model="gpt-nano",
        steps=13,  # steps 4, 8 and 12 sampled: three of each kind timed, the least a cost is measured from
        sample_every=4,
        batch_size=2,
        seq_len=16,
        out=tmp_path / "r",
        progress=False,
        report=False,
    )
    result = train(cfg)
    steps = pd.read_parquet(tmp_path / "r" / "steps.parquet")
    final = result.summary[T.SUMMARY_FINAL]
    plain = steps[(~steps[T.SAMPLED]) & (steps[T.STEP] > 0)]
    assert final["tokens_per_s"] == pytest.approx(2 * 16 / plain[T.TIME_S].median())
    assert final["tokens_per_s_steps"] == len(plain) == 9
    sampled = steps[steps[T.SAMPLED] & (steps[T.STEP] > 0)]
    assert final["sampled_step_cost"] == pytest.approx(sampled[T.TIME_S].median() / plain[T.TIME_S].median())
    assert final["tokens_per_s_wall"] > 0
    head = dict(_headline(result.summary, steps, pd.DataFrame()))
    assert "tokens/s (unsampled steps, median of 9)" in head
    # the ratio when a sampled step took longer; on a loaded machine the medians can come out the other way,
    # and then the page says the cost was not measured rather than call a sampled step cheaper
    if final["sampled_step_cost"] >= 1:  # (with what the medians make of it, where the overhead is a bound)
        assert head["a sampled step"].startswith(f"{final['sampled_step_cost']:.2f}× an unsampled one")
    else:
        assert head["a sampled step"].startswith("cost not measured")


def test_a_reattached_profiler_does_not_count_the_time_it_was_detached() -> None:
    """A loop that detaches between blocks of steps (an evaluation, bench/overhead.py's interleaving) must not
    see that pause in the next step's time: it skewed the block budget's estimate by 100x. Nor a
    ``prof.not_training()`` entered while detached (an evaluation's callback): its time came off the next step's."""
    import time

    import torch

    import precprof

    model = torch.nn.Linear(4, 4)
    prof = precprof.Profiler(model, sample_every=1, memory=False, block_formats=False)
    for block in range(2):
        if block:
            time.sleep(0.3)  # detached between the blocks (none after the last: no step would time it)
            with prof.not_training():
                time.sleep(0.3)
        with prof:
            model(torch.randn(2, 4)).sum().backward()
            prof.step()
    steps = prof.tables()["steps"]
    assert ((steps[T.TIME_S] > 0) & (steps[T.TIME_S] < 0.25)).all(), steps[T.TIME_S].tolist()


# a Trainer run with torch_compile=True, bf16, 10 steps (tester h50): steps 0-1 sampled (eager), Dynamo compiled
# in step 2, the first unsampled one (98.6 s)
TRAINER_COMPILED = [2.932, 3.110, 98.575, 0.587, 0.649, 4.428, 0.376, 0.540, 1.866, 0.877]


def test_the_step_torch_compile_compiled_in_is_left_out_of_the_rate() -> None:
    """The header read "tokens/s (unsampled steps, median of 8) 336" and "1 sampled, 8 unsampled steps timed":
    the 8 held step 2, in which the model compiled for 98.6 s, which the sampler already left out of the run's
    time (``capture.sampling.compiled_steps``). Without it the median of 7 is 0.649 s: 394 tokens/s."""
    sampled = [True, True] + [False] * 8
    steps = _steps(TRAINER_COMPILED, sampled, tokens=256.0)
    sampling = {
        "mode": "budget",
        "budget": 0.03,
        "overhead": 0.203,
        "compile_steps": 1,
        "compiled_steps": [2],
    }
    head = dict(_headline({T.SUMMARY_CAPTURE: {"sampling": sampling}}, steps, pd.DataFrame()))
    trained = TRAINER_COMPILED[3:]  # step 0 is warm-up, 1 sampled, 2 compiled
    key = "tokens/s (unsampled steps, median of 7; torch.compile's step left out)"
    assert head[key] == F.num(256 / float(np.median(trained)))
    assert 256 / float(np.median(trained)) == pytest.approx(394, abs=1)  # 336 with step 2 counted
    assert head["precprof's overhead"].startswith("not measured (1 sampled, 7 unsampled steps timed")
    tp = throughput(steps, [2])
    assert tp["step_time_unsampled_median_s"] == pytest.approx(np.median(trained))
    assert tp["steps_compiled_left_out"] == 1


def test_a_compiled_loops_rate_leaves_out_the_steps_dynamo_compiled_in() -> None:
    """An own loop over a torch.compile'd model (Dynamo's eager backend: its graphs and recompiles, fast on the
    CPU), its sequence length changed once: the steps in which Dynamo's own counter of graphs moved, read by
    the loop itself, are the steps the Profiler says torch.compile compiled in, and the header's rate leaves them
    out."""
    import torch
    from torch import nn
    from torch._dynamo.utils import counters

    import precprof

    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    vocab, dim = 64, 16
    model = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, vocab))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    lengths = [8] * 7 + [12] + [8] * 4  # a sampled step runs eagerly: the new length comes unsampled
    moved = []
    with precprof.Profiler(model, optimizer=opt, sample_every=3, memory=False, block_formats=False) as prof:
        for step, n in enumerate(lengths):
            graphs = counters["stats"]["unique_graphs"]
            z = torch.randint(0, vocab, (2, n + 1))
            loss = nn.functional.cross_entropy(compiled(z[:, :-1]).reshape(-1, vocab), z[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if counters["stats"]["unique_graphs"] != graphs:
                moved.append(step)
            prof.step(loss=loss.detach(), tokens=2 * n)
    steps = prof.tables()["steps"]
    assert moved == [1, 7] and prof.compiled_steps == moved  # the first unsampled step; the new length
    head = dict(_headline(prof.run_summary(), steps, pd.DataFrame()))
    kept = steps[~steps[T.SAMPLED] & ~steps[T.STEP].isin([0, *moved])]
    assert len(kept) == 6
    key = "tokens/s (unsampled steps, median of 6; torch.compile's 2 steps left out)"
    assert head[key] == F.num(16 / float(kept[T.TIME_S].median()))


# steps FIRST..LAST of a torch.compile'd model (Dynamo's eager backend) in an own loop streaming into OUT, resumed
# there when FIRST > 0 and then saved; stopped by Ctrl-C after LAST when FIRST is 0, before any save. Prints the
# steps in which Dynamo's own counter of graphs moved, read by the loop itself.
COMPILED_ATTEMPT = """
import contextlib, sys, torch
from torch import nn
from torch._dynamo.utils import counters
import precprof
out, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
vocab, dim = 64, 16
model = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, vocab))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
compiled = torch.compile(model, backend="eager")
moved = []
prof = precprof.Profiler(model, optimizer=opt, sample_every=3, memory=False, block_formats=False, out=out,
                         resume=first > 0, first_step=first)
with contextlib.suppress(KeyboardInterrupt), prof:
    for step in range(first, last + 1):
        graphs = counters["stats"]["unique_graphs"]
        z = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(step))
        loss = nn.functional.cross_entropy(compiled(z[:, :-1]).reshape(-1, vocab), z[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if counters["stats"]["unique_graphs"] != graphs:
            moved.append(step)
        prof.step(loss=loss.detach(), tokens=16)
        if first == 0 and step == last:
            raise KeyboardInterrupt
if first > 0:
    prof.save()
print(*moved)
"""


RESUMED_AT = 9  # the checkpoint the resumed attempt starts from: a sampled step (every 3rd), run eagerly


def _compiled_attempt(out: Path, first: int, last: int) -> list[int]:
    """``COMPILED_ATTEMPT`` in a process of its own (a resumed job is a new process, which compiles again)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    res = forks.run(
        [sys.executable, "-c", COMPILED_ATTEMPT, str(out), str(first), str(last)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return [int(s) for s in res.stdout.split()]


def test_a_resumed_runs_rate_leaves_out_every_attempts_compiled_steps(tmp_path: Path) -> None:
    """A compiled run stopped by Ctrl-C after step 11 (its loop saved nothing) and resumed from its step-9
    checkpoint: the steps the first attempt compiled in counted in tokens/s, since the summary's sampling block
    is the resumed attempt's alone. The steps table says which steps compiled, in every attempt, and the rate
    leaves out each one the loop saw Dynamo compile in, as it leaves out each attempt's first step."""
    # each attempt compiles in its first unsampled step: step 1, and step 10 after the sampled step 9
    first_attempt = _compiled_attempt(tmp_path / "run", 0, 11)
    resumed = _compiled_attempt(tmp_path / "run", RESUMED_AT, 19)
    assert first_attempt and first_attempt[0] < RESUMED_AT and resumed and resumed[0] > RESUMED_AT
    compiled = sorted({s for s in first_attempt if s < RESUMED_AT} | set(resumed))
    summary = T.read_summary(tmp_path / "run")
    steps = T.read_tables(tmp_path / "run")["steps"].sort_values(T.STEP)
    assert steps[T.STEP].tolist() == list(range(20))
    assert not set(summary[T.SUMMARY_CAPTURE]["sampling"]["compiled_steps"]) & set(first_attempt)
    # the rate's rule by hand: unsampled steps, not the first of an attempt, not one Dynamo compiled in
    kept = steps[~steps[T.SAMPLED] & ~steps[T.STEP].isin([0, RESUMED_AT, *compiled])]
    assert len(kept) >= 3
    tp = throughput(steps, compiled_steps(summary))
    sampled = set(steps[T.STEP][steps[T.SAMPLED]])
    left_out = [s for s in compiled if s not in (0, RESUMED_AT, *sampled)]
    assert tp["steps_compiled_left_out"] == len(left_out) >= 2
    assert tp["tokens_per_s_steps"] == len(kept)
    assert tp["tokens_per_s"] == pytest.approx(16 / float(kept[T.TIME_S].median()), rel=1e-12)
    head = dict(_headline(summary, steps, pd.DataFrame()))
    key = f"tokens/s (unsampled steps, median of {len(kept)}; torch.compile's {len(left_out)} steps left out)"
    assert head[key] == F.num(16 / float(kept[T.TIME_S].median()))
