"""Distributed capture (2 processes, gloo, CPU): one run directory from rank 0 whose counts are exactly the sum
of what each rank saw, checked against a single-process reference on the same batches.

The two-process runs (DDP; FSDP2 ``fully_shard`` in fp32 and with ``MixedPrecisionPolicy(bfloat16, float32)``)
happen once per session in ``dist_worker.py``. The reference replays each rank in one process: one model
replica per rank, its tensors caught by plain hooks and their statistics computed directly, gradients averaged as DDP/FSDP do, AdamW on fp32 masters.
Expected rows per wrapper:

- activations and activation gradients: the statistics of every rank's tensors, summed;
- DDP weights / weight gradients / weight updates: every replica's (local gradients: the hook reads them before
  DDP's all-reduce copies the average back);
- FSDP2 weights: the full fp32 parameter (the shards sum to it); weight gradients: the averaged gradient;
  weight updates: the master's.
"""

from __future__ import annotations

import copy
import html
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import dist_worker as W
import forks
import pandas as pd
import pytest
import torch
from torch import nn

import precprof
from precprof import formats
from precprof import stats as st
from precprof import tables as T
from precprof.capture.reducer import RankReducer, _row_layout, wrapper_info

HERE = Path(__file__).parent
SCENARIOS = ("ddp", "fsdp2", "fsdp2-bf16")
TRAIN_SCENARIOS = ("train-ddp", "train-fsdp2")
# run, not counted layer by layer against the one-process reference (each has tests of its own below)
OTHER_SCENARIOS = ("fsdp1", "fsdp1-orig", "fsdp1-orig-scaled", "zero", "ddp-join", "fsdp2-shard-scale")
ALONE_SCENARIOS = ("rank0-only",)  # a Profiler on rank 0 alone, refused at attach: no run directory
CUT_SCENARIOS = ("cut",)  # cut off before it saved: its first summary.json and its stream
CLAIM_SCENARIOS = ("train-claim-fail",)  # rank 0 cannot create its run directory: every rank stops at once
FAIL_SCENARIOS = ("train-fail",)  # rank 1 fails and leaves the group: last, the group is broken after it
Key = tuple[int, str, str, str]  # step, module, tensor, param


# ------------------------------------------------------------------------------------------ the runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every scenario, in one two-process world. Each rank is a fork of the preloaded Python (tests/forks.py) with
    the variables torchrun would give it (``dist_worker.torchrun_env``), started here: ``torchrun`` itself (a
    launcher importing torch) and two fresh interpreters cost 10 s of CPU more, for nothing the tests read."""
    out = tmp_path_factory.mktemp("dist")
    scenarios = ",".join(
        SCENARIOS
        + TRAIN_SCENARIOS
        + OTHER_SCENARIOS
        + ALONE_SCENARIOS
        + CUT_SCENARIOS
        + CLAIM_SCENARIOS
        + FAIL_SCENARIOS
    )
    with socket.socket() as s:  # a free port for rank 0's store (as --standalone picks one)
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # (torchrun runs its ranks with python -u)
    logs = [(out.parent / f"rank{rank}.log").open("w+") for rank in range(W.WORLD)]
    ranks = [
        forks.popen(
            [sys.executable, str(HERE / "dist_worker.py"), str(out), scenarios, str(rank), str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank, log in zip(range(W.WORLD), logs, strict=True)
    ]
    deadline = time.monotonic() + 400
    # a rank that failed leaves the other waiting in a collective: it is ended then, as torchrun ends it
    while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in ranks):
            time.sleep(5)  # (its peer's error, where it has one to write)
            break
        time.sleep(0.1)
    for p in ranks:
        if p.poll() is None:
            p.kill()
            p.wait()
    said = []
    for rank, (p, log) in enumerate(zip(ranks, logs, strict=True)):
        log.seek(0)
        said.append(f"rank {rank} (exit code {p.returncode}):\n{log.read()[-4000:]}")
        log.close()
    if any(p.returncode != 0 for p in ranks):
        raise AssertionError("dist_worker failed:\n" + "\n".join(said))
    return out


def run_dir(runs: Path, scenario: str) -> Path:
    """The scenario's run directory; fails with rank 0's traceback when the scenario raised."""
    err = runs / f"{scenario}-rank0.error"
    if err.exists():
        text = err.read_text()
        raise AssertionError(f"{scenario} failed on rank 0:\n{text}")
    return runs / scenario


# ------------------------------------------------------------------------------ expected statistics
def _empty_entry() -> dict[str, Any]:
    return {
        "counts": defaultdict(int),
        "absmax": 0.0,
        "absmin": math.nan,
        "hist": defaultdict(int),
        "calls": 0,
    }


def _add(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for c, v in src["counts"].items():
        dst["counts"][c] += v
    for e, v in src["hist"].items():
        dst["hist"][e] += v
    dst["calls"] += src["calls"]
    dst["absmax"] = max(dst["absmax"], src["absmax"])
    mins = [m for m in (dst["absmin"], src["absmin"]) if not math.isnan(m)]
    dst["absmin"] = min(mins) if mins else math.nan


def entries_from_tables(tables: dict[str, pd.DataFrame]) -> dict[Key, dict[str, Any]]:
    """Layer rows and histograms of a run as {(step, module, tensor, param): entry}."""
    out: dict[Key, dict[str, Any]] = {}
    count_cols = [*T.COUNT_COLUMNS, T.LOST_UPDATE_BF16, T.LOST_UPDATE_FP16]
    for r in tables["layers"].to_dict("records"):
        key = (int(r[T.STEP]), str(r[T.MODULE]), r[T.TENSOR], r[T.PARAM])
        e = _empty_entry()
        for c in count_cols:
            v = r[c]
            if not (isinstance(v, float) and math.isnan(v)):
                e["counts"][c] = int(v)
        e["absmax"] = 0.0 if pd.isna(r[T.ABSMAX]) else float(r[T.ABSMAX])
        e["absmin"] = float(r[T.ABSMIN]) if not pd.isna(r[T.ABSMIN]) else math.nan
        e["calls"] = int(r[T.CALLS])
        e["dtype"] = r[T.DTYPE]
        out[key] = e
    for r in tables["histograms"].to_dict("records"):
        key = (int(r[T.STEP]), str(r[T.MODULE]), r[T.TENSOR], r[T.PARAM])
        out[key]["hist"][int(r[T.EXPONENT])] += int(r[T.COUNT])
    return out


def entry_from_tensor(x: torch.Tensor) -> dict[str, Any]:
    """What one Profiler row holds for tensor ``x`` seen once (stats computed directly)."""
    s = st.tensor_stats(x)
    e = _empty_entry()
    e["counts"].update({T.NUMEL: s.numel, T.ZEROS: s.zeros, T.NAN: s.nan, T.INF: s.inf})
    for f, v in s.underflow.items():
        e["counts"][T.underflow_col(f)] = v
    for f, v in s.overflow.items():
        e["counts"][T.overflow_col(f)] = v
    for f, v in s.underflow_cs.items():
        e["counts"][T.underflow_cs_col(f)] = v
    e["absmax"], e["absmin"], e["calls"] = s.absmax, s.absmin, 1
    for exp, c in zip(s.exponents, s.hist, strict=True):
        if c:
            e["hist"][int(exp)] += int(c)
    return e


def entry_of_calls(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """A row that aggregated these tensors, one call each (fp8 current scaling: each its own amax)."""
    e = _empty_entry()
    for t in tensors:
        _add(e, entry_from_tensor(t.detach()))
    return e


def shards(x: torch.Tensor) -> list[torch.Tensor]:
    """FSDP2's dim-0 shards of ``x`` (torch.chunk: 5 rows over 2 ranks -> 3 + 2)."""
    return list(torch.chunk(x.detach(), W.WORLD, dim=0))


def reference(scenario: str) -> dict[str, Any]:
    """``_reference`` on one thread, as every rank of dist_worker runs (bf16 CPU kernels round differently
    with another thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(scenario)
    finally:
        torch.set_num_threads(threads)


def _reference(scenario: str) -> dict[str, Any]:
    """Replay ``scenario`` in one process; returns expected entries, rank 0's losses and the final parameters.

    Activations and gradients are caught with plain hooks on one replica per rank and their statistics computed
    directly (``stats.tensor_stats`` per tensor, summed: fp8 current scaling is per call, so per rank and per
    shard); weight updates come from a Profiler on the fp32 master that the optimizer steps.
    """
    param_dtype = torch.bfloat16 if scenario == "fsdp2-bf16" else torch.float32
    master = W.build_model()
    opt = W.make_optimizer(master.parameters())
    master_prof = precprof.Profiler(
        master, optimizer=opt, sample_every=W.SAMPLE_EVERY, memory=False, reducer=None
    )
    replicas = [copy.deepcopy(master).to(param_dtype) for _ in range(W.WORLD)]
    seen: dict[tuple[str, str], list[torch.Tensor]] = defaultdict(list)

    def catch(name: str) -> Any:
        def fwd_hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            seen[(name, T.ACTIVATION)].append(out.detach().clone())
            out.register_hook(lambda g: seen[(name, T.ACTIVATION_GRAD)].append(g.detach().clone()))

        return fwd_hook

    for m in replicas:
        for name, mod in m.named_children():
            mod.register_forward_hook(catch(name))
        # the first linear layer reads the model's input: a row of its own
        m[0].register_forward_pre_hook(
            lambda mod, args: seen[(T.input_module("0"), T.ACTIVATION)].append(args[0].detach().clone())
        )
    expected: dict[Key, dict[str, Any]] = {}
    losses: list[float] = []
    names = [n for n, _ in master.named_parameters()]
    with master_prof:
        for step in range(W.STEPS):
            sampled = step % W.SAMPLE_EVERY == 0
            seen.clear()
            with torch.no_grad():
                for m in replicas:
                    for p, q in zip(m.parameters(), master.parameters(), strict=True):
                        p.copy_(q)
            for r, m in enumerate(replicas):
                x, y = W.batch(step, r, nan=scenario == "ddp")
                loss = nn.functional.mse_loss(m(x.to(param_dtype)), y)
                loss.backward()
                if r == 0:
                    losses.append(loss.item())
            if sampled:
                for (mod, kind), ts in seen.items():
                    expected[(step, mod, kind, "")] = entry_of_calls(ts)
            # DDP and FSDP divide by the world size, then sum over ranks (in rank order)
            for name, q, *ps in zip(
                names, master.parameters(), *(m.parameters() for m in replicas), strict=True
            ):
                avg = ps[0].grad.float() / W.WORLD
                for p in ps[1:]:
                    avg = avg + p.grad.float() / W.WORLD
                if sampled:
                    mod, pname = name.rsplit(".", 1)
                    if scenario == "ddp":  # every replica's weights and local gradients
                        weights, grads = [q] * W.WORLD, [p.grad for p in ps]
                    else:  # the shards of the fp32 master and of the averaged gradient
                        weights, grads = shards(q), shards(avg)
                    expected[(step, mod, T.WEIGHT, pname)] = entry_of_calls(weights)
                    expected[(step, mod, T.WEIGHT_GRAD, pname)] = entry_of_calls(grads)
                q.grad = avg
            opt.step()
            opt.zero_grad(set_to_none=True)
            for m in replicas:
                m.zero_grad(set_to_none=True)
            master_prof.step()
    for key, e in entries_from_tables(master_prof.tables()).items():
        if key[2] == T.WEIGHT_UPDATE:  # DDP: every replica applies the same update
            dst = expected.setdefault(key, _empty_entry())
            for _ in range(W.WORLD if scenario == "ddp" else 1):
                _add(dst, e)
    return {
        "entries": expected,
        "losses": losses,
        "params": {n: p.detach() for n, p in master.named_parameters()},
    }


def assert_entries_equal(got: dict[Key, dict[str, Any]], want: dict[Key, dict[str, Any]]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        g, w = got[key], want[key]
        for c in set(g["counts"]) | set(w["counts"]):
            assert g["counts"].get(c, 0) == w["counts"].get(c, 0), (key, c)
        assert g["absmax"] == w["absmax"], key
        assert (math.isnan(g["absmin"]) and math.isnan(w["absmin"])) or g["absmin"] == w["absmin"], key
        assert dict(g["hist"]) == {e: c for e, c in w["hist"].items() if c}, key
        if key[2] in (T.ACTIVATION, T.ACTIVATION_GRAD):
            assert g["calls"] == w["calls"], key


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_counts_are_the_sum_over_ranks(runs: Path, scenario: str) -> None:
    rdir = run_dir(runs, scenario)
    assert T.is_run_dir(rdir)
    assert not (runs / f"{scenario}-rank1").exists(), "only rank 0 writes"
    tables = T.read_tables(rdir)
    # the layers by the model's own names, DDP's ``module.`` left out: a DDP run compares with a single process
    assert not tables["layers"][T.MODULE].str.startswith("module").any()
    got = entries_from_tables(tables)
    ref = reference(scenario)
    assert_entries_equal(got, ref["entries"])
    # the steps table is rank 0's
    steps = T.read_tables(rdir)["steps"]
    assert steps[T.LOSS].tolist() == ref["losses"]
    assert steps[T.SAMPLED].tolist() == [s % W.SAMPLE_EVERY == 0 for s in range(W.STEPS)]
    # the training itself matched the reference (FSDP shards gathered back into full parameters)
    if scenario.startswith("fsdp2"):
        dumped = json.loads((runs / f"{scenario}-rank0.json").read_text())
        for name, want in ref["params"].items():
            assert torch.equal(torch.tensor(dumped["params"][name]), want), name


def test_fsdp2_shards_sum_to_full_parameters(runs: Path) -> None:
    layers = T.read_tables(run_dir(runs, "fsdp2"))["layers"]
    model = W.build_model()
    local = [json.loads((runs / f"fsdp2-rank{r}.json").read_text())["local_numel"] for r in range(W.WORLD)]
    for name, p in model.named_parameters():
        mod, pname = name.rsplit(".", 1)
        assert sum(rank_numel[name] for rank_numel in local) == p.numel()
        rows = layers[(layers[T.MODULE] == mod) & (layers[T.PARAM] == pname)]
        for kind in (T.WEIGHT, T.WEIGHT_GRAD, T.WEIGHT_UPDATE):
            assert (rows[rows[T.TENSOR] == kind][T.NUMEL] == p.numel()).all(), (name, kind)
    # the last layer is sharded unevenly (5 rows over 2 ranks): shards of 3 and 2 rows
    assert [rank_numel["2.weight"] for rank_numel in local] == [3 * W.N_HID, 2 * W.N_HID]


def test_summary_describes_ddp(runs: Path) -> None:
    ddp = T.read_summary(run_dir(runs, "ddp"))["capture"]["distributed"]
    assert ddp["world_size"] == W.WORLD and ddp["backend"] == "gloo"
    assert ddp["wrapper"] == "DDP" and ddp["reduce_dtype"] == "float32" and ddp["comm_hooks"] == []
    assert "replica" in ddp["semantics"]["weights"]
    assert "before DDP's all-reduce" in ddp["semantics"]["weight_gradients"]
    assert "world_size times" in ddp["semantics"]["activation_gradients"]
    fsdp2 = T.read_summary(run_dir(runs, "fsdp2"))["capture"]["distributed"]["semantics"]
    assert fsdp2["weight_gradients"] == "each rank's reduce-scattered shard, as the optimizer gets it"
    # the report says it in words (it was one row of key=value pairs, the dict as it was stored)
    from precprof.report.environment import environment

    groups = dict(environment(T.read_summary(run_dir(runs, "ddp")))["groups"])
    rows = dict(groups["Processes"])
    assert rows["weight gradients"].startswith("each rank's local gradient, read before DDP's all-reduce")
    assert rows["processes"].startswith(f"{W.WORLD} (gloo); rank 0 wrote this run; the statistics of ")
    assert rows["parallelism"] == (
        "DDP: replicated (every rank holds every parameter); parameters in float32, reduces gradients in float32"
    )
    nan = ddp["nonfinite_by_rank"][str(W.NAN_RANK)]["nan"]
    assert rows["non-finite values by rank"] == (
        f'rank {W.NAN_RANK}: {nan:,} nan on 1 sampled step(s); first at step {W.NAN_STEP} in module "0" '
        f"({T.ACTIVATION})"
    )
    assert rows["memory of the ranks"].startswith("the most any rank held on step ")
    assert not any(re.search(r"\w=\w", text) for text in rows.values())  # no key=value
    assert "distributed" not in dict(groups["Capture"])


def test_the_memory_section_says_ddps_gradient_buckets(runs: Path) -> None:
    """DDP (``gradient_as_bucket_view=False``, the default) keeps flat gradient buckets as large as the gradients
    beside the .grad tensors, one more copy of them per rank: the memory section showed the same components as a
    run with ``gradient_as_bucket_view=True``, whose gradients are views into them, and never said so. The
    summary holds DDP's bucket bytes, the gradients' bytes on one rank (every parameter trains here); the page
    says them and the fix."""
    from precprof import pipeline

    grads = sum(p.numel() * p.element_size() for p in W.build_model().parameters())  # 916 bytes
    rdir = run_dir(runs, "ddp")
    ddp = T.read_summary(rdir)["capture"]["distributed"]
    assert ddp["gradient_as_bucket_view"] is False and ddp["bucket_bytes"] == grads
    page = html.unescape(re.sub(r"<[^>]+>", "", pipeline.rerender(rdir).read_text()))
    assert (
        f"Not in the measured table nor the projections: DDP's gradient buckets, {grads} B on each rank."
        in page
    )
    assert "DistributedDataParallel(model, gradient_as_bucket_view=True) makes the gradients views" in page


def test_summary_describes_fsdp2_mixed_precision(runs: Path) -> None:
    summary = T.read_summary(run_dir(runs, "fsdp2-bf16"))
    # bf16 compute over fp32 masters, as torchtitan trains: bf16 (it said fp32, and so did the report)
    assert summary["capture"]["precision_seen"] == "bf16"
    assert T.read_summary(run_dir(runs, "fsdp2"))["capture"]["precision_seen"] == "fp32"
    # the class the user wrote, not fully_shard's subclass of it (FSDPSequential)
    assert summary["capture"]["model_class"] == "Sequential"
    fsdp = summary["capture"]["distributed"]
    assert fsdp["wrapper"] == "FSDP2"
    assert (fsdp["param_dtype"], fsdp["reduce_dtype"], fsdp["storage_dtypes"]) == (
        "bfloat16",
        "float32",
        ["float32"],
    )
    assert fsdp["units"] == 3
    layers = T.read_tables(run_dir(runs, "fsdp2-bf16"))["layers"]
    acts = layers[(layers[T.TENSOR] == T.ACTIVATION) & layers[T.MODULE].isin(["0", "2"])]
    assert set(acts[T.DTYPE]) == {"bfloat16"}
    weights = layers[layers[T.TENSOR] == T.WEIGHT]
    assert set(weights[T.DTYPE]) == {"float32"}  # the sharded fp32 masters


def test_memory_projection_of_an_fsdp_rank_is_its_shard(runs: Path) -> None:
    """FSDP2 in fp32: a rank holds its shard of the parameters and of their gradients. The projection took the
    parameters from the rank's measured shard and the gradients from the whole model's count, the world size
    times too many; projected to the mode it ran in, the rank's memory is now what was measured."""
    from precprof.analysis import memory_projection as MP

    run = run_dir(runs, "fsdp2")
    summary, memory = T.read_summary(run), T.read_tables(run)["memory"]
    got = MP.project(memory, summary)
    measured = got["measured"]
    assert got["measured_mode"] == "fp32" and measured[T.GRADIENTS] == measured[T.PARAMETERS]
    fp32 = {
        r["component"]: r["bytes"]
        for r in got["records"]
        if r["mode"] == "fp32" and r["source"] == "projected"
    }
    assert fp32[T.PARAMETERS] == fp32[T.GRADIENTS] == measured[T.GRADIENTS]
    full = summary["memory"]["model"]["n_params"]
    assert got["n_params"] * 4 == measured[T.PARAMETERS] and 0 < got["n_params"] < full  # the shard


def test_zero_redundancy_optimizer_states_are_the_ranks_shard(runs: Path) -> None:
    """DDP with ``ZeroRedundancyOptimizer(optimizer_class=Adam)``: the wrapper's own ``state`` stays empty, its
    ``optim`` holds this rank's shard of Adam's states. precprof read the wrapper's: 0 bytes "measured", and the
    projection then kept no optimizer states at all. Rank 0's table holds rank 0's shard, and the summary says
    it is one rank's."""
    from precprof.analysis import memory_projection as MP
    from precprof.report.environment import environment

    run = run_dir(runs, "zero")
    summary, memory = T.read_summary(run), T.read_tables(run)["memory"]
    held = memory[memory[T.COMPONENT] == T.OPTIMIZER_STATES].groupby(T.STEP)[T.BYTES].sum()
    ranks = [json.loads((runs / f"zero-rank{r}.json").read_text())["state_bytes"] for r in range(W.WORLD)]
    full = sum(p.numel() for p in W.build_model().parameters())
    assert (
        0 < ranks[0] < 8 * full < sum(ranks)
    )  # exp_avg and exp_avg_sq of rank 0's parameters, and its steps
    assert held[W.SAMPLE_EVERY] == ranks[0]  # measured once Adam had stepped
    assert MP.project(memory, summary)["measured"][T.OPTIMIZER_STATES] == ranks[0]
    said = summary[T.SUMMARY_CAPTURE]["distributed"]["semantics"]["optimizer_states"]
    assert said.startswith("each rank's own shard (ZeroRedundancyOptimizer)")
    rows = dict(dict(environment(summary)["groups"])["Processes"])
    assert rows["optimizer states"] == said


def test_no_wrapper_reads_as_a_model_whose_parameters_changed(runs: Path) -> None:
    """Each sampled step compares the model's parameters with the capture plan's, object by object (a model
    changed mid-run is planned again): DDP, FSDP1's flat parameters and FSDP2's DTensors keep theirs from step to
    step, so no run re-planned. Nor did any find a trainable parameter its optimizer does not hold: DDP's names
    and FSDP1's flat parameters are the optimizer's parameters, by object."""
    for scenario in SCENARIOS + OTHER_SCENARIOS + TRAIN_SCENARIOS:
        capture = T.read_summary(run_dir(runs, scenario))[T.SUMMARY_CAPTURE]
        assert scenario in TRAIN_SCENARIOS or capture["model_changes"] == [], scenario
        assert "trainable_not_in_optimizer" not in capture, (scenario, capture["trainable_not_in_optimizer"])


def test_fsdp2_saved_activations_are_those_of_ddp(runs: Path) -> None:
    """The same model, batches and dtype under DDP and FSDP2: the activations autograd saves are the same. The
    unsharded weights a matmul saves under FSDP2, which FSDP frees after the forward, were counted as
    activations (8,192 bytes against DDP's 3,584 in a user's test)."""

    def saved(scenario: str) -> dict[str, int]:
        memory = T.read_tables(run_dir(runs, scenario))["memory"]
        acts = memory[(memory[T.COMPONENT] == T.ACTIVATIONS) & (memory[T.MOMENT] == "")]
        last = acts[acts[T.STEP] == acts[T.STEP].max()]
        return {str(m): int(b) for m, b in last.groupby(T.MODULE)[T.BYTES].sum().items()}

    ddp, fsdp2 = saved("ddp"), saved("fsdp2")
    assert ddp and fsdp2 == ddp


def test_nan_on_one_rank_is_kept(runs: Path) -> None:
    """Rank 1's batch holds a nan at a sampled step: the summary names rank 1 and the first module."""
    info = T.read_summary(run_dir(runs, "ddp"))["capture"]["distributed"]
    assert info["ranks_with_nonfinite"] == [W.NAN_RANK]
    assert info["nonfinite_by_rank"]["0"]["nan"] == 0
    events = info["nonfinite_events"]
    assert events and all(set(e["by_rank"]) == {str(W.NAN_RANK)} for e in events)
    first = events[0]
    assert (first["module"], first["tensor"]) == ("0", T.ACTIVATION)
    # the nan row of the first Linear: one input element nan -> one output row (N_HID values) nan
    assert first["by_rank"]["1"]["nan"] == W.N_HID
    layers = T.read_tables(run_dir(runs, "ddp"))["layers"]
    row = layers[
        (layers[T.STEP] == W.NAN_STEP) & (layers[T.MODULE] == "0") & (layers[T.TENSOR] == T.ACTIVATION)
    ]
    assert int(row[T.NAN].iloc[0]) == W.N_HID


@pytest.mark.parametrize("scenario", TRAIN_SCENARIOS)
def test_precprof_train_under_torchrun(runs: Path, scenario: str) -> None:
    """`torchrun -m precprof train --distributed ...`: one run directory, the wrapper and world size in it,
    layer names of the inner model, weight counts of the whole model."""
    from precprof.models import build_model

    rdir = run_dir(runs, scenario)
    summary = T.read_summary(rdir)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    info = summary[T.SUMMARY_CAPTURE]["distributed"]
    assert info["world_size"] == W.WORLD
    assert info["wrapper"] == {"train-ddp": "DDP", "train-fsdp2": "FSDP2"}[scenario]
    assert summary[T.SUMMARY_CONFIG]["world_size"] == W.WORLD
    tables = T.read_tables(rdir)
    steps, layers = tables["steps"], tables["layers"]
    assert steps[T.STEP].tolist() == list(range(W.TRAIN_STEPS))
    assert (steps[T.TOKENS] == W.WORLD * 2 * 16).all()  # both ranks' batches
    # the report's batch row says the rank's batch is one rank's, and the step's tokens as the table has them
    from precprof.report.environment import config_rows, environment

    assert dict(config_rows(summary[T.SUMMARY_CONFIG]))["batch"] == (
        f"2 sequences × 16 tokens = 32 tokens a step per rank; {W.WORLD * 32} tokens a step over {W.WORLD} ranks"
    )
    assert not layers[T.MODULE].str.startswith("module.").any()
    torch.manual_seed(0)
    model = build_model("gpt-nano", {"n_layer": 1, "n_embd": 32}, vocab_size=256, seq_len=16).module
    weights = layers[(layers[T.TENSOR] == T.WEIGHT) & (layers[T.STEP] == 0)]
    replicas = W.WORLD if scenario == "train-ddp" else 1  # DDP: every replica; FSDP2: shards of one
    assert int(weights[T.NUMEL].sum()) == replicas * sum(p.numel() for p in model.parameters())
    # the memory check was one rank's: FSDP2's shard of the fp32 states (its whole model refused runs that fit)
    estimate = summary[T.SUMMARY_CONFIG]["memory_estimate"]
    param_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert (estimate["ranks"], estimate["sharded"]) == (W.WORLD, scenario == "train-fsdp2")
    assert estimate["parameters"] == -(-param_bytes // (1 if scenario == "train-ddp" else W.WORLD))
    row = dict(dict(environment(summary)["groups"])["Run"])["memory estimated before training"]
    assert " per rank (" in row and ("its 1/2 shard of the model" in row) == (scenario == "train-fsdp2")


def test_the_fp8_outlier_check_judges_the_weights_of_a_ddp_run(runs: Path) -> None:
    """Under DDP a row sums the ranks' calls: the outlier check, which does not judge a tensor read in several
    calls a step (each call is scaled on its own), left every weight unjudged ("Most pushed there: none judged"),
    though every rank holds the same weight. The weights are judged; the activations, each rank's own, are not."""
    import precprof

    rdir = run_dir(runs, "train-ddp")
    layers = T.read_tables(rdir)["layers"]
    weights = layers[(layers[T.TENSOR] == T.WEIGHT) & layers[T.MODULE].str.endswith("c_attn")]
    assert len(weights) and (weights[T.CALLS] == W.WORLD).all()  # the ranks' calls, summed
    f = precprof.recommend(rdir, hardware="h100").finding("fp8_eligibility")
    assert f is not None
    assert isinstance(f.numbers["max_pushed_subnormal"], float)  # judged: the weights
    assert "The outlier check could not judge" in f.message  # the activations: each rank's own
    assert (
        "Most values a tensor's largest 0.1% push below FP8's smallest normal: none judged" not in f.message
    )


def test_uneven_inputs_under_ddp_join_keep_each_ranks_statistics(runs: Path) -> None:
    """DDP's ``model.join()`` with uneven inputs: rank 1 runs out of batches a step before rank 0 and shadows
    DDP's collectives in the join hook, where precprof's all-reduce of the rows met them (gloo aborted the job).
    Training goes on; every rank keeps its own statistics, rank 0's rows are its own batches', and the summary
    and the report say so."""
    from precprof.report.environment import environment

    rdir = run_dir(runs, "ddp-join")
    summary = T.read_summary(rdir)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_COMPLETE
    info = summary[T.SUMMARY_CAPTURE]["distributed"]
    assert (info["sampled_steps_reduced"], info["sampled_steps_local"]) == (0, W.STEPS)
    assert "model.join()" in info["local_only"]
    assert info["semantics"]["activations"] == "rank 0's local micro-batch"
    assert "memory_by_rank" not in info  # rank 0's totals alone are not the ranks'
    got = entries_from_tables(T.read_tables(rdir))
    x, _ = W.batch(0, 0)
    key = (0, "0", T.ACTIVATION, "")  # rank 0's first batch alone, through the initial weights
    assert_entries_equal({key: got[key]}, {key: entry_from_tensor(W.build_model()[0](x).detach())})
    assert got[(W.STEPS - 1, "0", T.ACTIVATION, "")]["calls"] == 1  # the step after rank 1 joined
    rows = dict(dict(environment(summary)["groups"])["Processes"])
    assert rows["processes"].endswith(f"are every rank's together, those of {W.STEPS} rank 0's alone")
    assert rows["rank-local statistics"].startswith("rank 0: the training loop runs in a join context")
    assert rows["memory"] == "rank 0's breakdown (the memory section)"


# -------------------------------------------------------------------------------- single process
def test_row_layout_matches_the_profiler() -> None:
    """RankReducer names rows by rebuilding the Profiler's layout; the two must agree (tied weights too)."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 10))
    model[3].weight = model[0].weight  # tied: recorded under the first owner only
    model[1].bias.requires_grad_(False)
    for blocks in (False, True):  # each linear layer also has a row for its input, block formats on or off
        prof = precprof.Profiler(model, sample_every=1, memory=False, reducer=None, block_formats=blocks)
        with prof:
            # the names the Profiler hands the reducer: its modules', then its matmul layers' inputs'
            order = [s.name for s in prof._modules]
            order += [T.input_module(s.name) for s in prof._modules if s.input >= 0]
            rows = [(r.module, r.tensor, r.param) for r in prof._rows]
        assert _row_layout(model, order) == rows
        assert sum(t == T.ACTIVATION and m.endswith(T.INPUT_SUFFIX) for m, t, _ in rows) == 2


def test_wrapper_info_without_a_wrapper() -> None:
    info = wrapper_info(nn.Linear(2, 2).to(torch.bfloat16))
    assert info["wrapper"] == "none" and info["param_dtype"] == "bfloat16"


def test_reducer_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="process group"):
        RankReducer()


def test_the_reducers_tensors_outlive_their_collectives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gloo's worker drops a collective's tensors when it drops the work, which a later barrier keeps: at a
    program's last barrier that came after the interpreter began to finish, and a tensor whose Python object
    had died asked for the interpreter lock then: "terminate called without an active exception", rank 1 aborted
    after its run was written (1 run in ~20 of dist_worker.py under load; none in 100 since). Every tensor the
    reducer all-reduces or all-gathers is still held in Python after the caller let go of everything it was
    given (torch's all_gather_object let its own go at once)."""
    import gc
    import weakref

    import torch.distributed as dist

    given: list[weakref.ref[torch.Tensor]] = []
    reduce, gather = dist.all_reduce, dist.all_gather
    monkeypatch.setattr(
        dist, "all_reduce", lambda t, *a, **k: (given.append(weakref.ref(t)), reduce(t, *a, **k))[1]
    )
    monkeypatch.setattr(
        dist,
        "all_gather",
        lambda out, t, *a, **k: (given.extend(weakref.ref(x) for x in [*out, t]), gather(out, t, *a, **k))[1],
    )
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        reducer = RankReducer()
        data = torch.arange(3 * st.ROW_WIDTH, dtype=torch.int64).reshape(3, st.ROW_WIDTH)
        out = reducer.reduce_rows(data)
        assert torch.equal(out, data)
        assert torch.equal(reducer.reduce_sum(torch.ones(4)), torch.ones(4))
        meta = reducer.reduce_meta([{"calls": 2, "dtypes": ["float32"]}] * 3, {"a": 0})  # (two all-gathers)
        assert [m["calls"] for m in meta["rows"]] == [2, 2, 2]
        del out, data, meta
        gc.collect()
        assert len(given) == 3 + 2 * 2 and all(ref() is not None for ref in given)
    finally:
        dist.destroy_process_group()


def test_ddp_bucket_bytes_are_those_of_the_gradients_that_train(tmp_path: Path) -> None:
    """DDP buckets the parameters that train, a frozen one not; with ``gradient_as_bucket_view=True`` the
    memory section says the gradients are the buckets, no second copy."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from precprof.report.memory_summary import ddp_buckets

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3).to(torch.float64))
        model[0].requires_grad_(False)
        info = wrapper_info(DistributedDataParallel(model, gradient_as_bucket_view=True))
    finally:
        dist.destroy_process_group()
    assert info["bucket_bytes"] == (4 * 3 + 3) * 8  # the float64 layer alone
    said = ddp_buckets({"capture": {"distributed": info}})
    assert said == {"bytes": (4 * 3 + 3) * 8, "as_view": True}


def test_single_rank_group(tmp_path: Path) -> None:
    """With one rank the reduction is the identity, the absmin sentinel included; describe() says so."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        buf = st.StatsBuffer(3, "cpu")
        buf.accumulate(torch.tensor([0.5, -3.0, 0.0]), 0)
        buf.accumulate(torch.tensor([float("inf")]), 2)  # row 1 stays empty: absmin sentinel
        reducer = RankReducer()
        assert reducer.is_writer
        assert torch.equal(reducer.reduce_rows(buf.data), buf.data)
        meta = reducer.reduce_meta(
            [
                {"calls": 1, "dtypes": ["float32"]},
                {"calls": 0, "dtypes": []},
                {"calls": 2, "dtypes": ["bfloat16"]},
            ],
            {"a": 0, "b": -1},
        )
        assert [m["calls"] for m in meta["rows"]] == [1, 0, 2]
        assert meta["rows"][2]["inf_ranks"] == [0] and meta["rows"][0]["inf_ranks"] == []
        assert meta["order"] == {"a": 0, "b": -1}
        info = reducer.describe(nn.Linear(2, 2))
        assert info["world_size"] == 1 and info["ranks_with_nonfinite"] == [0]
        # rows named by the Profiler (module, tensor, param) and the step name the nonfinite events
        reducer.reduce_rows(buf.data)
        named = [{"calls": 1, "dtypes": ["float32"], "module": "a", "tensor": T.ACTIVATION, "param": ""}] * 3
        reducer.reduce_meta(named, {"a": 0}, step=7)
        event = reducer.describe()["nonfinite_events"][-1]
        assert (event["step"], event["module"], event["tensor"], event["by_rank"]) == (
            7,
            "a",
            T.ACTIVATION,
            {"0": {"nan": 0, "inf": 1}},
        )
        # memory: the table stays this rank's rows; the summary gets every rank's totals (peaks: max)
        rows = [
            {T.STEP: 7, T.COMPONENT: T.PARAMETERS, T.MODULE: "", T.DTYPE: "float32", T.BYTES: 100},
            {T.STEP: 7, T.COMPONENT: T.ACTIVATIONS, T.MODULE: "a", T.DTYPE: "float32", T.BYTES: 30},
            {T.STEP: 7, T.COMPONENT: T.ACTIVATIONS, T.MODULE: "b", T.DTYPE: "bfloat16", T.BYTES: 12},
            {T.STEP: 7, T.COMPONENT: T.ALLOCATOR_PEAK, T.MODULE: "", T.DTYPE: "", T.BYTES: 500},
            {T.STEP: 7, T.COMPONENT: T.ALLOCATOR_PEAK, T.MODULE: "", T.DTYPE: "", T.BYTES: 800},
            # a part of the allocator's peak: the parameters again, at that moment (not added twice)
            {
                T.STEP: 7,
                T.COMPONENT: T.PARAMETERS,
                T.MODULE: "",
                T.DTYPE: "float32",
                T.BYTES: 100,
                T.MOMENT: T.MOMENT_PEAK,
            },
        ]
        assert reducer.reduce_memory(rows) == rows
        info = reducer.describe()
        assert info["memory_by_rank"] == {"0": {T.PARAMETERS: 100, T.ACTIVATIONS: 42, T.ALLOCATOR_PEAK: 800}}
        assert info["memory_max_over_ranks"] == info["memory_by_rank"]["0"] and info["memory_step"] == 7
        # a later sampled step that does not measure memory (most of them: memory_every) has no rows: the last
        # measured step's totals stay (they were emptied, and memory_step became None, in most runs)
        assert reducer.reduce_memory([]) == []
        assert reducer.describe()["memory_by_rank"] == info["memory_by_rank"]
        assert reducer.describe()["memory_step"] == 7
    finally:
        dist.destroy_process_group()


def test_only_the_writing_rank_checks_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun every rank validates the configuration, but only rank 0 claims ``--out``: a rank that
    started a moment after rank 0 had claimed it found "already holds a precprof run (incomplete)" and exited,
    leaving rank 0 in a collective until torchrun's timeout (once in a CI run). Rank 1 leaves ``--out`` to
    rank 0; rank 0, and a process outside torchrun, still refuse a run already there."""
    from precprof.training import TrainConfig

    out = tmp_path / "run"
    out.mkdir()
    T.write_summary(out, {T.SUMMARY_STATUS: T.STATUS_INCOMPLETE})
    config = TrainConfig(out=out, device="cpu")
    for env, refused in (
        ({}, True),
        ({"WORLD_SIZE": "2", "RANK": "0"}, True),
        ({"WORLD_SIZE": "2", "RANK": "1"}, False),
    ):
        for name in ("WORLD_SIZE", "RANK"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        if refused:
            with pytest.raises(precprof.rundir.RunDirError, match="already holds a precprof run"):
                config.validate()
        else:
            config.validate()


def test_a_wrapper_the_profiler_was_not_given_is_not_claimed_absent() -> None:
    """Under a process group of two ranks, a Profiler holding the module itself (the bare Hugging Face callback
    is handed the unwrapped model) said "the model is not wrapped; each rank trains its own copy" of a model the
    Trainer had wrapped in DDP. It says it cannot know; without a process group the model is what it holds."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert wrapper_info(torch.nn.Linear(2, 2))["sharding"].startswith("none (the model is not wrapped")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        info = wrapper_info(torch.nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()
    assert info["wrapper"] == "none" and info["sharding"].startswith(
        "not known: the Profiler holds the module itself"
    )
    assert "profile_trainer(trainer)" in info["sharding"]


def test_the_processes_row_says_the_parameters_dtype_and_the_autocast_compute() -> None:
    """A DDP run under bf16 autocast: the Processes row said "computes in float32" (the parameters' dtype, which
    DDP records as its param_dtype) beside a header saying bf16. It says the parameters' dtype and autocast's;
    FSDP's param_dtype, which the forward computes in without autocast, still reads as the compute's."""
    from precprof.report.environment import environment

    def parallelism(wrapper: str, param_dtype: str, autocast: dict[str, Any] | None) -> str:
        d = {"world_size": 2, "wrapper": wrapper, "param_dtype": param_dtype, "reduce_dtype": "float32"}
        groups = dict(environment({"capture": {"distributed": d, "autocast": autocast}})["groups"])
        return dict(groups["Processes"])["parallelism"]

    bf16 = {"enabled": True, "dtype": "bfloat16", "device_type": "cpu"}
    off = {"enabled": False, "dtype": None}
    assert parallelism("DDP", "float32", bf16) == (
        "DDP; parameters in float32 (compute: bfloat16 autocast), reduces gradients in float32"
    )
    assert parallelism("DDP", "float32", off) == "DDP; parameters in float32, reduces gradients in float32"
    assert (
        parallelism("FSDP2", "bfloat16", off) == "FSDP2; computes in bfloat16, reduces gradients in float32"
    )
    assert parallelism("FSDP2", "float32", bf16) == (
        "FSDP2; parameters gathered in float32 (compute: bfloat16 autocast), reduces gradients in float32"
    )
    # no recorded forward pass saw autocast (capture.autocast null: nothing sampled): the compute's dtype is not
    # said ("computes in bfloat16" was autocast off's)
    assert parallelism("FSDP2", "bfloat16", None) == (
        "FSDP2; parameters gathered in bfloat16, reduces gradients in float32"
    )


def test_compare_says_which_runs_trained_on_several_processes(runs: Path, tmp_path: Path) -> None:
    """A single-process run and a DDP run that trained alike differed by "+0.62%": the DDP run's loss is rank 0's,
    of half the batch, and nothing on the page said a run was distributed, nor that its memory is one rank's."""
    from precprof import compare as C

    comp, page = C.compare_runs([run_dir(runs, "ddp"), run_dir(runs, "fsdp2")], out=tmp_path / "cmp")
    (note,) = [n for n in comp.notes if n.startswith("Trained on several processes:")]
    assert f"on {W.WORLD} processes (DDP)" in note and f"on {W.WORLD} processes (FSDP2)" in note
    assert "rank 0's, of its share of the batch" in note and "its memory is one rank's" in note
    assert "Trained on several processes" in page.read_text()


def test_a_distributed_run_says_so_before_it_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank killed under torchrun (SIGTERM when another rank fails) never saves: its first summary.json had no
    ``capture.distributed``, so the report of what it streamed had no Processes rows, and its summed counts
    read as one process's. The first summary has it (a one-rank group here, the reducer forced)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        monkeypatch.setattr(precprof.Profiler, "_resolve_reducer", lambda self: RankReducer())
        model = nn.Linear(4, 4)
        prof = precprof.Profiler(model, sample_every=1, out=tmp_path / "run").attach()
        first = T.read_summary(tmp_path / "run")
        assert first[T.SUMMARY_CAPTURE]["distributed"]["world_size"] == 1
        assert "weight_gradients" in first[T.SUMMARY_CAPTURE]["distributed"]["semantics"]
        assert "SIGTERM, as torchrun sends when another rank fails" in first[T.SUMMARY_INCOMPLETE_REASON]
        prof.detach()
        prof.save()
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP is switching to use:UserWarning")  # one rank: nothing to shard
def test_wrap_model_as_the_readme_shows_it(tmp_path: Path) -> None:
    """The README's ``wrap_model(model, S, param_dtype=torch.bfloat16, ...)``: under "ddp" the dtypes were
    dropped and the run trained in fp32 without a word; "fsdp1" on a CPU needed a ``device=`` the README does
    not show ("FSDP needs a non-CPU accelerator device"). DDP refuses the dtypes in one line; FSDP1 takes the
    CPU when no accelerator is there (a one-rank gloo group here)."""
    import torch.distributed as dist

    from precprof.errors import UserError
    from precprof.training.distributed import wrap_model

    with pytest.raises(
        UserError, match=r"wrap_model\(\.\.\., 'ddp'\): DDP has no param_dtype or reduce_dtype"
    ):
        wrap_model(nn.Linear(4, 4), "ddp", param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if torch.cuda.is_available():
        pytest.skip("FSDP1 on this machine's accelerator, not the CPU")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = wrap_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), "fsdp1")
        model(torch.randn(3, 4)).sum().backward()
        assert type(model).__name__ == "FullyShardedDataParallel"
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP is switching to use:UserWarning")  # one rank: nothing to shard
def test_fsdp1_weights_under_mixed_precision_are_the_stored_fp32_values(tmp_path: Path) -> None:
    """FSDP1 under ``MixedPrecision(param_dtype=bfloat16)``: the forward's first hook found the FlatParameter
    pointing at its bf16 copy, and the weight row said the weights were held in bfloat16 (the fp32 values the
    optimizer steps were never read). The stored values are read, in float32; one rank (NO_SHARD) holds them
    whole, every rank's replica, as the summary says."""
    import torch.distributed as dist

    from precprof.training.distributed import wrap_model

    if torch.cuda.is_available():
        pytest.skip("FSDP1 on this machine's accelerator, not the CPU")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        inner[0].weight.data[0, :2] = torch.tensor([1e-3, 1 + 2**-12])  # not bf16 values
        stored = torch.cat([p.detach().flatten() for p in inner.parameters()]).clone()
        model = wrap_model(inner, "fsdp1", param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        prof = precprof.Profiler(model, memory=False)
        with prof:
            model(torch.randn(3, 4)).float().sum().backward()
            prof.step()
        layers = prof.tables()["layers"]
        info = RankReducer().describe(model)
    finally:
        dist.destroy_process_group()
    (row,) = layers[layers[T.TENSOR] == T.WEIGHT].to_dict("records")
    assert row[T.DTYPE] == "float32" and row[T.NUMEL] == stored.numel()
    assert row[T.ABSMIN] == stored.abs()[stored != 0].min().item()  # 1e-3, not its bf16 rounding
    assert info["semantics"]["weights"].startswith("every rank's replica")


def test_fsdp1_orig_params_weight_gradients_are_the_shards_the_optimizer_applied(runs: Path) -> None:
    """FSDP1 with ``use_orig_params=True`` (accelerate's default, and torch.compile's need) sets each parameter's
    ``.grad`` to its reduce-scattered shard outside autograd: no post-accumulate-grad hook fires, and the run had
    no weight-gradient row at all, without a word. They are read in the optimizer's step pre-hook: each row is
    the sum over ranks of the shards the optimizer applied (a rank without a shard of it adds nothing)."""
    rdir = run_dir(runs, "fsdp1-orig")
    got = entries_from_tables(T.read_tables(rdir))
    dumps = [json.loads((runs / f"fsdp1-orig-rank{r}.json").read_text()) for r in range(W.WORLD)]
    model = W.build_model()
    grad_keys = [k for k in got if k[2] == T.WEIGHT_GRAD]
    assert len(grad_keys) == len(list(model.parameters())) * len(range(0, W.STEPS, W.SAMPLE_EVERY))
    for step in range(0, W.STEPS, W.SAMPLE_EVERY):
        for name, p in model.named_parameters():
            mod, pname = name.rsplit(".", 1)
            want = _empty_entry()
            for d in dumps:
                shard = d["applied"][step][f"_fsdp_wrapped_module.{name}"]
                if shard:
                    _add(want, entry_from_tensor(torch.tensor(shard)))
            assert want["counts"][T.NUMEL] == p.numel(), name  # the shards make up the parameter
            (key,) = [k for k in grad_keys if k[0] == step and k[1].endswith(mod) and k[3] == pname]
            g = got[key]
            for c in set(g["counts"]) | set(want["counts"]):
                assert g["counts"].get(c, 0) == want["counts"].get(c, 0), (key, c)
            assert g["absmax"] == want["absmax"] and dict(g["hist"]) == dict(want["hist"]), key
    semantics = T.read_summary(rdir)[T.SUMMARY_CAPTURE]["distributed"]["semantics"]["weight_gradients"]
    assert semantics.startswith("each rank's reduce-scattered shard"), semantics


def test_gradients_a_scaler_unscaled_before_the_read_are_listed_from_every_rank(runs: Path) -> None:
    """FSDP1 with ``use_orig_params=True`` under a loss scaler: the shards are unscaled in place before the
    optimizer's hook sees them, so they are skipped and counted, but the summary listed rank 0's alone (1 tensor
    where all 4 parameters had no row: the other 3 live on rank 1). Each is listed, counted over the ranks that
    hold a shard of it, once a sampled step each."""
    from precprof.capture.grad_reads import UNSCALED_UNREAD

    rdir = run_dir(runs, "fsdp1-orig-scaled")
    assert not (T.read_tables(rdir)["layers"][T.TENSOR] == T.WEIGHT_GRAD).any()
    skipped = T.read_summary(rdir)[T.SUMMARY_CAPTURE]["skipped_tensors"]
    listed = {(s["module"].removeprefix("_fsdp_wrapped_module."), s["param"]): s for s in skipped}
    assert set(listed) == {tuple(n.rsplit(".", 1)) for n, _ in W.build_model().named_parameters()}
    assert {s["reason"] for s in skipped} == {UNSCALED_UNREAD}
    # a parameter split over both ranks is skipped twice a sampled step, one held whole by one rank once
    sampled = len(range(0, W.STEPS, W.SAMPLE_EVERY))
    assert {s["count"] for s in skipped} <= {sampled, W.WORLD * sampled}


def test_the_model_size_of_a_sharded_run_is_the_models(runs: Path) -> None:
    """FSDP1 on 2 ranks: the model's parameter count was rank 0's shard of each FlatParameter, half the model,
    which the advisor's model-size rules read and ``compare`` refused as "a different model" beside the same
    model's one-process run. FSDP2's DTensors said the full count already."""
    full = sum(p.numel() for p in W.build_model().parameters())
    for scenario in ("fsdp1", "fsdp2", "ddp"):
        capture = T.read_summary(run_dir(runs, scenario))[T.SUMMARY_CAPTURE]
        assert capture["n_params"] == full, scenario
    # the model section precprof train records, of the module FSDP1 wrapped in place (it said rank 0's shard)
    assert json.loads((runs / "fsdp1-rank0.json").read_text())["n_params"] == full


def test_the_advisor_says_the_parameters_of_a_ddp_model(runs: Path) -> None:
    """An own-loop DDP run records no model section: the advisor summed the first step's weight rows, which hold
    every rank's replica, and said the model had world_size times its parameters ("The model has 42,624
    parameters" of a 21,312-parameter model on 2 ranks), which can flip its fp32-for-small-models verdict."""
    full = sum(p.numel() for p in W.build_model().parameters())
    f = precprof.recommend(run_dir(runs, "ddp")).finding("small_model")
    assert f is not None and f.numbers["n_params"] == full


def _cut_off_page(runs: Path) -> tuple[str, dict[str, str]]:
    """The report of the "cut" run (every rank raised mid-step): its text, and its Processes rows."""
    from precprof import pipeline
    from precprof.report.context import build_context

    rdir = run_dir(runs, "cut")
    read = T.read_run(rdir)
    assert read.streamed  # never saved: read from its stream, beside its first summary.json
    ctx = build_context(read.tables, T.read_summary(rdir))
    return html.unescape(pipeline.rerender(rdir).read_text()), dict(
        dict(ctx["environment"]["groups"])["Processes"]
    )


def test_a_cut_off_distributed_run_counts_the_steps_it_reduced(runs: Path) -> None:
    """A DDP run cut off before it saved keeps its first summary.json, written at attach: the Processes row said
    "the statistics of 0 sampled steps are every rank's together" of a run whose finished sampled steps were
    all reduced. They are counted from its steps table; the step cut off is not among them."""
    steps = T.read_tables(run_dir(runs, "cut"))["steps"]
    done = [s for s in range(W.CUT_STEP) if s % W.SAMPLE_EVERY == 0]  # sampled and finished
    assert steps[T.STEP].tolist() == list(range(W.CUT_STEP + 1))
    _, rows = _cut_off_page(runs)
    assert rows["processes"] == (
        f"{W.WORLD} (gloo); rank 0 wrote this run; the statistics of {len(done)} sampled "
        f"step{'s' if len(done) != 1 else ''} are every rank's together"
    )


def test_the_step_a_distributed_run_was_cut_off_in_is_said_to_be_one_ranks(runs: Path) -> None:
    """No collective runs while an exception unwinds: the step the run was cut off in holds rank 0's rows
    alone (half the activation elements of the others' on 2 ranks) beside "counts summed over ranks", and
    nothing said so. The banner says it, and says the run was cut off during that step (it said "after step
    1 (...; step 2 was cut off)" and, below, "cut off after step 2")."""
    layers = T.read_tables(run_dir(runs, "cut"))["layers"]
    acts = layers[(layers[T.TENSOR] == T.ACTIVATION) & (layers[T.MODULE] == "0")].set_index(T.STEP)
    assert acts.loc[0, T.NUMEL] == W.WORLD * W.BATCH * W.N_HID  # every rank's batch
    assert acts.loc[W.CUT_STEP, T.NUMEL] == W.BATCH * W.N_HID  # rank 0's alone
    page, _ = _cut_off_page(runs)
    assert f"step {W.CUT_STEP}'s statistics are rank 0's alone, not summed over the {W.WORLD} ranks" in page
    assert f"The run was cut off during step {W.CUT_STEP}." in page


def test_fsdp1_weight_updates_leave_the_shards_padding_out(runs: Path) -> None:
    """FSDP1 (``use_orig_params=False``) on 2 ranks: the model's 229 elements in one FlatParameter, sharded 115 +
    115, rank 1's last element padding that no optimizer moves. The weight-update row counted it: 230 sampled
    elements, 1 of them "no update". Each sampled step's row is the model's elements, with the zero updates of
    the same training replayed in one process (every element of every parameter, as AdamW moves them)."""
    full = sum(p.numel() for p in W.build_model().parameters())
    assert full % W.WORLD  # (so that a shard is padded)
    layers = T.read_tables(run_dir(runs, "fsdp1"))["layers"]
    rows = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE].set_index(T.STEP)
    want = reference("fsdp1")["entries"]
    for step in range(0, W.STEPS, W.SAMPLE_EVERY):
        updates = [e for k, e in want.items() if k[0] == step and k[2] == T.WEIGHT_UPDATE]
        assert sum(e["counts"][T.NUMEL] for e in updates) == full
        assert rows.loc[step, T.NUMEL] == full, step
        assert rows.loc[step, T.ZEROS] == sum(e["counts"][T.ZEROS] for e in updates), step


def test_the_run_of_a_rank_whose_peer_failed_gives_that_ranks_error(runs: Path) -> None:
    """``precprof train --distributed ddp`` whose rank 1 raised in its forward: rank 0, waiting in the backward's
    all-reduce, failed with gloo's "Connection closed by peer", and its run gave that as the cause; rank 1's
    error was on the terminal alone. Rank 1 keeps its error in the group's store before it leaves; rank 0's run
    gives it, and then what rank 0 saw. Rank 0's terminal says that same line (it said "the model raised
    RuntimeError in the backward pass of step 1: [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer
    ...", a built-in model's run gloo's whole traceback), and rank 1's names the directory rank 0 wrote: without
    ``--out`` each rank named its own default one, by its own clock ("rank 0 saves what it recorded to
    runs/...-105349" beside rank 0's runs/...-105348).

    The error is the model's own (a factory's): rank 1 says it in the one line a single process says, with the
    model's line, where it printed torch's 60-line traceback, and rank 0's line repeats that line; traceback.txt,
    which "its traceback is in" named, held rank 0's gloo traceback alone, no line of the model's: it holds rank
    1's traceback (kept in the store beside its line), then rank 0's (tester t6)."""
    (rdir,) = (runs / "train-fail" / "runs").iterdir()  # the default name, in the ranks' working directory
    summary = T.read_summary(rdir)
    assert summary[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    reason = summary[T.SUMMARY_INCOMPLETE_REASON]
    worker = str(HERE / "dist_worker.py")
    (line,) = [
        i
        for i, text in enumerate(Path(worker).read_text().splitlines(), 1)
        if 'raise RuntimeError(f"injected' in text
    ]
    raised = (
        f"the model raised RuntimeError in the forward pass of step {W.FAIL_STEP} (at {worker}:{line}, in "
        f"forward): injected failure on rank 1 at step {W.FAIL_STEP}"
    )
    assert re.fullmatch(
        rf"rank 1 failed first: {re.escape(raised)}; rank 0 then lost its connection to it \(RuntimeError: "
        r"[^;]*Connection (closed|reset) by peer[^;]*\)",
        reason,
    ), reason
    shown = Path("runs") / rdir.name  # as the ranks name it, from their working directory
    assert (runs / "train-fail-rank1.stderr").read_text().splitlines() == [
        f"precprof: error: {raised}; rank 0 writes its traceback into {shown / 'traceback.txt'}",
        f"precprof: this rank writes no run directory; rank 0 saves what it recorded to {shown}",
    ]
    assert (runs / "train-fail-rank0.stderr").read_text().splitlines()[:2] == [
        f"precprof: error: {reason}; rank 1's traceback is in {shown / 'traceback.txt'} (then rank 0's)",
        f"precprof: training stopped: the partial run is in {shown} (1 finished step)",
    ]
    kept = (rdir / T.TRACEBACK_FILE).read_text()
    theirs, ours = kept.split("# rank 0's, after rank 1 failed:\n")
    assert theirs.startswith(
        f"{T.TRACEBACK_HEAD}# rank 1's, which failed first:\nTraceback (most recent call last):"
    )
    assert f'File "{worker}", line {line}, in forward' in theirs
    assert theirs.rstrip().endswith(f"RuntimeError: injected failure on rank 1 at step {W.FAIL_STEP}")
    assert ours.startswith("Traceback (most recent call last):") and "by peer" in ours


def test_a_profiler_attached_on_rank_0_alone_is_refused_with_its_fix(runs: Path) -> None:
    """``if rank == 0: prof = Profiler(...)`` under DDP: rank 0 waited in precprof's all-reduce of step 0 and rank 1
    in DDP's next collective until the group's timeout (gloo's default: 30 minutes), then gloo's "Timed out waiting
    20000ms for recv" said nothing of the fix (tester t6). Rank 0 warns, naming rank 1 and the fix, once rank 1 has
    not attached within the wait, and is refused past the process group's timeout, in one line that says the fix;
    its run directory goes with it. A Profiler then attached on every rank, twice, rank 1 late the first time,
    meets the other rank's each time (after rank 0's warning: a fixed wait had refused both ranks, each blaming the
    other, reviewer r1) and records both steps."""
    warning = (
        f"precprof: rank 0 attached a Profiler {W.ALONE_WAIT_S:g} s ago and waits for rank 1 to attach theirs, up to "
        "the process group's timeout ({limit:g} s): every rank attaches a Profiler (or passes reducer=None to profile "
        "itself alone)"
    )
    said = (runs / "rank0-only-rank0.said").read_text().splitlines()
    assert said == [
        warning.format(limit=W.ALONE_LIMIT_S),
        f"rank 0 attached a Profiler but rank 1 did not within the process group's timeout ({W.ALONE_LIMIT_S:g} s): "
        "attach it on every rank (or pass reducer=None to profile this rank alone)",
    ]
    assert not (runs / "rank0-only").exists()
    late = (runs / "rank0-only-late.said").read_text().splitlines()
    assert len(late) == 1 and late[0].startswith(warning.split(" up to ")[0]), late
    assert [(runs / f"rank0-only-rank{r}.steps").read_text() for r in range(W.WORLD)] == ["2", "2"]


def test_a_rank_0_that_cannot_create_the_run_directory_stops_every_rank(runs: Path) -> None:
    """Without ``--out``, rank 0 could not create its run directory (``runs`` is a file) and stopped; rank 1,
    which claims none, trained on into DDP's first collective and waited there for rank 0 (for ever in a process
    that goes on, as dist_worker's does; under the command line until rank 0's exit broke the connection: gloo's
    traceback), and said "rank 0 saves what it recorded to" a directory that never was. Rank 0 says whether it
    claimed one, and rank 1 stops at once with rank 0's reason."""
    rank0 = (runs / "train-claim-fail-rank0.stderr").read_text().splitlines()
    assert len(rank0) == 1 and re.fullmatch(
        r"precprof: error: cannot create the run directory runs/gpt-nano-fp32-[0-9-]+ \(Not a directory\); use --out",
        rank0[0],
    ), rank0
    said = rank0[0].removeprefix("precprof: error: ")
    assert (runs / "train-claim-fail-rank1.stderr").read_text().splitlines() == [
        f"precprof: error: rank 0 could not claim the run directory, so no rank trains: {said}"
    ]
    assert [p.name for p in (runs / "train-claim-fail").iterdir()] == ["runs"]  # (the file) nothing else


def test_a_lost_peer_without_its_error_is_said_to_be_another_ranks_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where no other rank left its error (killed: out of memory, SIGKILL), rank 0's lost connection is said to be
    another rank's stopping, whose error is in its own output; a SIGTERM (torchrun's, after another rank failed)
    names the rank that failed; a rank's own error, or a lost peer on another rank, is no other rank's cause."""
    from precprof.training import distributed as launch

    store = torch.distributed.HashStore()
    monkeypatch.setattr(launch._compat, "default_store", lambda: store)
    rank0, rank1, rank2 = (launch.DistInfo(r, 3, r, torch.device("cpu")) for r in range(3))
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:44781. This "
        "is typically caused by a remote worker crashing. Check the logs of the remote worker."
    )
    lost = launch.failure_cause(rank0, gloo, f"RuntimeError: {gloo}", interrupted=False)
    assert lost == (
        "another rank stopped first: rank 0 lost its connection to it (RuntimeError: Connection closed by peer "
        "[127.0.0.1]:44781); that rank's error is in its own output (torchrun prefixes its lines with [rankN])"
    )
    sigterm = "interrupted (terminated, SIGTERM)"
    assert launch.failure_cause(rank0, KeyboardInterrupt(), sigterm, interrupted=True) == sigterm
    assert not launch.record_failure(rank1, gloo)  # a consequence, not rank 1's own: not kept
    assert launch.record_failure(rank2, ValueError("bad batch\nsecond line"))
    assert launch.failure_cause(rank0, KeyboardInterrupt(), sigterm, interrupted=True) == (
        f"rank 2 failed first: ValueError: bad batch; rank 0 then was {sigterm}"
    )
    assert launch.peer_traceback(rank0) is None  # (it left no traceback)
    # its traceback beside its line, the end of it where it is long
    trace = "Traceback (most recent call last):\n" + "  frame\n" * 20_000 + "ValueError: bad batch\n"
    assert launch.record_failure(
        rank2, ValueError("bad batch"), "the model raised ValueError (at m.py:3)", trace
    )
    assert launch.failure_cause(rank0, KeyboardInterrupt(), sigterm, interrupted=True) == (
        f"rank 2 failed first: the model raised ValueError (at m.py:3); rank 0 then was {sigterm}"
    )
    left = len(trace) - launch._TRACEBACK_CHARS
    assert launch.peer_traceback(rank0) == (
        2,
        f"... ({left} characters left out)\n{trace[-launch._TRACEBACK_CHARS :]}",
    )
    own = "ValueError: rank 0's own"
    assert launch.failure_cause(rank0, ValueError("rank 0's own"), own, interrupted=False) == own


def test_fsdp1_weights_are_the_ranks_shards_summing_to_the_parameters(runs: Path) -> None:
    """FSDP1 (``use_orig_params=False``) on 2 ranks: the FlatParameter was read in the forward's first hook,
    after FSDP1 had gathered it whole, so its weight row held every rank's whole parameter (458 elements of a
    229-element model, each count twice) where the summary said "rank-local shards, summing to the full
    parameters". Each rank's stored shard is read, its padding left out: the row is the sum of the ranks' shards
    as each held them before the forward."""
    full = sum(p.numel() for p in W.build_model().parameters())
    rdir = run_dir(runs, "fsdp1")
    got = entries_from_tables(T.read_tables(rdir))
    dumps = [json.loads((runs / f"fsdp1-rank{r}.json").read_text())["flat_shards"] for r in range(W.WORLD)]
    for step in range(0, W.STEPS, W.SAMPLE_EVERY):
        held = [torch.tensor(d[step]) for d in dumps]
        flat = torch.cat(held)[:full]  # the padding at the end of the last shard left out
        want = entry_of_calls(list(flat.split([len(held[0]), full - len(held[0])])))
        (key,) = [k for k in got if k[0] == step and k[2] == T.WEIGHT]
        assert key[3] == "_flat_param" and got[key]["dtype"] == "float32"
        assert_entries_equal({key: got[key]}, {key: want})
        assert got[key]["counts"][T.NUMEL] == full
    semantics = T.read_summary(rdir)[T.SUMMARY_CAPTURE]["distributed"]["semantics"]["weights"]
    assert (
        semantics.startswith("rank-local shards of the stored parameters")
        and "summing to the full" in semantics
    )


def test_a_resumed_distributed_run_counts_the_runs_sampled_steps_reduced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distributed run killed after step 5 and resumed from its checkpoint at step 4: the summary's
    ``sampled_steps_reduced`` (the Processes row's "the statistics of N sampled steps are every rank's
    together") counted the last attempt's sampled steps alone, 2 (steps 4 and 6), where the run's tables hold
    4 (0 and 2 kept from the first attempt). A one-rank group, the reducer forced."""
    import torch.distributed as dist

    def attempt(steps: range, **kw: Any) -> precprof.Profiler:
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prof = precprof.Profiler(model, opt, sample_every=2, out=tmp_path / "run", **kw)
        with prof:
            for _ in steps:
                model(torch.randn(2, 4)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        return prof

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        monkeypatch.setattr(precprof.Profiler, "_resolve_reducer", lambda self: RankReducer())
        killed = attempt(range(6))  # sampled 0, 2, 4; never saved
        assert killed._owned_run is not None
        killed._owned_run.release()
        resumed = attempt(range(4, 8), resume=True, first_step=4)  # sampled 4, 6
        resumed.save()
    finally:
        dist.destroy_process_group()
    steps = T.read_run(tmp_path / "run").tables["steps"]
    assert steps[T.STEP].tolist() == list(range(8))
    sampled = int(T.flags(steps[T.SAMPLED]).sum())
    assert sampled == 4
    distributed = T.read_summary(tmp_path / "run")[T.SUMMARY_CAPTURE]["distributed"]
    assert distributed["sampled_steps_reduced"] == sampled


def test_fsdp2_weights_fp8_counts_are_said_to_be_the_shards(runs: Path) -> None:
    """Under FSDP2 a weight row sums each rank's shard counted at its own amax (tester t6: a Linear whose rows on
    rank 1 were 1e-6 of rank 0's flushed 256 of 512 values in a real cast at the whole tensor's scale, 0 in the
    row): the summary says so, and the advisor's FP8 figures of the weight are the whole tensor's: the values it
    flushes (every one in a binade wholly under the whole tensor's limit), and a lost-norm bound that bounds the
    real cast's (it was 0)."""
    from precprof.analysis.advisor import AdvisorConfig, _load, _prepare
    from precprof.analysis.advisor.evidence import _Run
    from precprof.analysis.advisor.rules import fp8
    from precprof.hardware import preset

    rdir = run_dir(runs, "fsdp2-shard-scale")
    tables, summary = _load(rdir, None)
    said = summary["capture"]["distributed"]["semantics"]["fp8_current_scaling"]
    assert "each rank's shard at its own amax, not the whole tensor's" in said
    assert "column block crossing a shard boundary" in said
    ddp = T.read_summary(run_dir(runs, "ddp"))["capture"]["distributed"]["semantics"]
    assert ddp["fp8_current_scaling"] == "each call at its own amax"
    from precprof.report.environment import distributed_rows

    assert dict(distributed_rows(summary["capture"]["distributed"]))["FP8 and block what-ifs"] == said
    # the real cast: the whole weight at its one power-of-two current scale
    w = torch.tensor(json.loads((runs / "fsdp2-shard-scale-rank0.json").read_text())["weight"])
    k = formats.current_scaling_exponent(formats.FP8_E4M3, float(w.abs().max()))
    q = (w * 2.0**k).to(torch.float8_e4m3fn).float() / 2.0**k
    flushed = int(((q == 0) & (w != 0)).sum())
    lost = float(w[q == 0].norm() / w.norm())
    assert flushed == 256
    layers = tables["layers"]
    row = layers[(layers[T.MODULE] == "0") & (layers[T.TENSOR] == T.WEIGHT)]
    assert row[T.underflow_cs_col("fp8_e4m3")].tolist() == [
        0
    ]  # the shards' own: said, not the whole tensor's
    run = _Run(*_prepare(tables), summary, preset("h100"), True, AdvisorConfig())
    assert fp8._sharded(run)
    got = fp8.fp8_losses(run, ["0"], {})
    got = got[got[T.TENSOR] == T.WEIGHT].iloc[0]
    assert got["lost_values"] == flushed / w.numel()
    assert lost <= got["lost_norm"] < 1e-4


@pytest.mark.parametrize("scenario", ["ddp", "fsdp2"])
def test_calls_are_summed_over_ranks_for_every_kind_of_parameter_row(runs: Path, scenario: str) -> None:
    """Every row's ``calls`` is summed over the ranks, the weight updates' too (tester t6: under DDP a
    weight_update row's numel summed both ranks' samples while its calls were rank 0's 1 optimizer step, so
    numel / calls was twice the elements sampled per update)."""
    layers = T.read_tables(run_dir(runs, scenario))["layers"]
    for kind in (T.WEIGHT, T.WEIGHT_GRAD, T.WEIGHT_UPDATE):
        rows = layers[layers[T.TENSOR] == kind]
        assert len(rows) and (rows[T.CALLS] == W.WORLD).all(), (kind, rows[T.CALLS].tolist())
