"""Dashboards: a real fp16 run (autocast + GradScaler, with skipped steps) written live to TensorBoard and
wandb and exported from its run directory; the event files are read back with TensorBoard's own reader and
the offline wandb run file with a reader of its record log, and compared with the run's own tables."""

from __future__ import annotations

import errno
import gc
import json
import math
import os
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forks
import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import precprof
from precprof import cli
from precprof import export as exporting
from precprof import tables as T
from precprof.errors import UserError
from precprof.export import events as ev

pytest.importorskip("tensorboard", reason="the dashboards need the tensorboard package")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

try:
    import wandb
except ImportError:  # pragma: no cover - wandb is in the test extra
    wandb = None

STEPS = 6


def _train(prof_kwargs: dict[str, Any]) -> precprof.Profiler:
    """A tiny MLP in fp16 autocast with a GradScaler whose first scale overflows (skipped steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17, growth_interval=2)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=2, **prof_kwargs) as prof:
        for _ in range(STEPS):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (model(x).float() - y).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss)
    return prof


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("dash")
    env = {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DIR": str(root)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        wb_run = wandb.init(mode="offline", dir=str(root), project="precprof-test") if wandb else None
        prof = _train({"tensorboard": root / "live", "wandb": True if wandb else None})
        if wb_run is not None:
            wb_run.finish()
            _wandb_files_closed()
        prof.save(root / "run")
        yield {
            "root": root,
            "tables": prof.tables(),
            "wandb_dir": Path(wb_run.dir).parent if wb_run else None,
        }  # offline-run-*/
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wandb_files_closed() -> None:
    """Wait until wandb's service has written and closed the files of every run it had. ``Run.finish()``
    returns once the service has processed the run's exit, but the service writes the last, partial 32 KiB
    block of the run's .wandb log when it closes the run's stream, which ``finish`` asks for without waiting
    (``inform_finish``). Under load a reader then saw the first two blocks alone: steps 0-3 of 0-5 (under
    strace, 2 reads in 3 right after ``finish`` found 65,536 of 71,774 bytes, the rest written 1.5 ms later).
    ``wandb.teardown()`` waits for the service to exit, which closes every stream first; the next
    ``wandb.init`` starts a new one."""
    wandb.teardown()


def _accumulator(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _scalars(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {s.step: s.value for s in acc.Scalars(tag)}


def test_live_tensorboard_equals_the_tables(run: dict[str, Any]) -> None:
    steps, layers, hist = (run["tables"][k] for k in ("steps", "layers", "histograms"))
    acc = _accumulator(run["root"] / "live")
    assert steps[T.SKIPPED].any() and not steps[T.SKIPPED].all()  # the run has skipped steps to show
    f32 = np.float32  # TensorBoard stores scalars as float32
    assert _scalars(acc, "precprof/loss") == {
        int(s): pytest.approx(f32(v)) for s, v in zip(steps[T.STEP], steps[T.LOSS], strict=True)
    }
    assert _scalars(acc, "precprof/loss_scale") == dict(zip(steps[T.STEP], steps[T.LOSS_SCALE], strict=True))
    assert _scalars(acc, "precprof/skipped_steps") == dict(
        zip(steps[T.STEP], steps[T.SKIPPED].astype(int).cumsum(), strict=True)
    )

    # fp16 underflow share of the first Linear's activation gradient, on each sampled step
    grad = layers[(layers[T.MODULE] == "0") & (layers[T.TENSOR] == T.ACTIVATION_GRAD)]
    assert set(grad[T.STEP]) == {0, 2, 4}
    expected = {int(r[T.STEP]): r[T.underflow_col("fp16")] / r[T.NUMEL] for _, r in grad.iterrows()}
    assert _scalars(acc, "precprof/underflow/fp16/0/activation_grad") == pytest.approx(expected)
    # ... and summed over every layer
    allg = layers[layers[T.TENSOR] == T.ACTIVATION_GRAD].groupby(T.STEP)
    expected = (allg[T.underflow_col("fp16")].sum() / allg[T.NUMEL].sum()).to_dict()
    assert _scalars(acc, "precprof/underflow/fp16/all/activation_grad") == pytest.approx(expected)

    # the exponent histogram of layer 2's weights (weight and bias summed) on step 4, bucket by bucket
    h = hist[(hist[T.MODULE] == "2") & (hist[T.TENSOR] == T.WEIGHT) & (hist[T.STEP] == 4)]
    want = h.groupby(T.EXPONENT)[T.COUNT].sum()
    event = {e.step: e.histogram_value for e in acc.Histograms("precprof/exponent/2/weight")}[4]
    got = {int(right) - 1: c for right, c in zip(event.bucket_limit, event.bucket, strict=True) if c}
    assert got == {int(e): float(c) for e, c in want.items()}
    assert (
        event.num
        == want.sum()
        == layers.query("module == '2' and tensor == 'weight' and step == 4")[
            [T.NUMEL, T.ZEROS, T.NAN, T.INF]
        ].pipe(lambda d: d[T.NUMEL].sum() - d[T.ZEROS].sum() - d[T.NAN].sum() - d[T.INF].sum())
    )


def test_export_writes_what_the_live_run_wrote(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = run["root"] / "exported"
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(run["root"] / "run"), "--tensorboard", str(out)])
    assert e.value.code in (0, None), capsys.readouterr().err
    live, exported = _accumulator(run["root"] / "live"), _accumulator(out)
    assert sorted(live.Tags()["scalars"]) == sorted(exported.Tags()["scalars"])
    assert sorted(live.Tags()["histograms"]) == sorted(exported.Tags()["histograms"])
    for tag in live.Tags()["scalars"]:
        if tag != "precprof/step_time_s":  # live: perf_counter; the run directory: the same number
            assert _scalars(live, tag) == _scalars(exported, tag), tag
    for tag in live.Tags()["histograms"]:
        a = [(h.step, h.histogram_value) for h in live.Histograms(tag)]
        b = [(h.step, h.histogram_value) for h in exported.Histograms(tag)]
        assert a == b, tag
    # a second export into the same folder (or one into the live run's) drew every series twice: refused
    for into in (out, run["root"] / "live"):
        with pytest.raises(SystemExit) as e:
            cli.main(["export", str(run["root"] / "run"), "--tensorboard", str(into)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "already holds TensorBoard event files" in err[0], err


def test_layer_selection_keeps_the_aggregates(run: dict[str, Any]) -> None:
    tables = run["tables"]
    none = {e.tag for e in ev.table_events(tables, layers="none")}
    some = {e.tag for e in ev.table_events(tables, layers=["2"])}
    every = {e.tag for e in ev.table_events(tables, layers="all")}
    assert "precprof/exponent/all/activation_grad" in none and "precprof/loss" in none
    assert not any("/0/" in t or "/2/" in t for t in none)
    assert {t for t in some - none} == {t for t in every - none if "/2/" in t or t.endswith("/2")}
    assert any(t.endswith("/0/activation") for t in every)
    with pytest.raises(UserError, match="layers="):
        ev.EventStream(layers="most")


def _scopes(events: list[ev.Event]) -> set[str]:
    return {e.tag.split("/")[2] for e in events if e.tag.split("/")[1] == "zeros"} - {ev.ALL_LAYERS}


def test_the_live_dashboards_take_their_layer_selection(tmp_path: Path) -> None:
    """The README's "watch a long run live" chose the per-layer tags with `layers="all"` or name patterns, which
    the Profiler did not take (a TypeError, t4): only ``precprof export --layers`` chose them, after the run.
    ``Profiler(..., tensorboard=DIR, dashboard_layers=...)`` chooses them live, as export does from the same
    tables; a value it cannot take is refused in one line, with or without a dashboard."""
    _train({"tensorboard": tmp_path / "two", "dashboard_layers": ["2"]})
    _train({"tensorboard": tmp_path / "none", "dashboard_layers": "none"})
    prof = _train({"tensorboard": tmp_path / "auto"})
    tags = {name: set(_accumulator(tmp_path / name).Tags()["scalars"]) for name in ("two", "none", "auto")}
    want = {e.tag for e in ev.table_events(prof.tables(), layers=["2"]) if e.tag.split("/")[1] == "zeros"}
    assert {t for t in tags["two"] if t.split("/")[1] == "zeros"} == want
    assert {t.split("/")[2] for t in want} == {"2", ev.ALL_LAYERS}
    assert not any("/0/" in t or "/2/" in t for t in tags["none"]) and "precprof/loss" in tags["none"]
    assert any("/0/" in t for t in tags["auto"])  # (3 layers: "auto" writes every one)
    for kw in ({"tensorboard": tmp_path / "bad"}, {}):
        with pytest.raises(UserError, match=r"^dashboard_layers='most': expected 'auto', 'all', 'none' or a"):
            precprof.Profiler(nn.Linear(4, 2), dashboard_layers="most", **kw)
    assert not (tmp_path / "bad").exists()


def test_the_auto_layer_limit_counts_layers_as_the_report_does(
    run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's own input feeding layer 0 has a row of its own, "0:input" (T.input_module), which the
    report's "layers profiled" does not count: neither does the limit (32 nn.Linear counted 33 and got no
    per-layer tags). The row is a scope of its own, with its layer, its activation's tags only."""
    tables = run["tables"]
    modules = set(tables["layers"][T.MODULE])
    layers = {m for m in modules if not m.endswith(T.INPUT_SUFFIX)}
    assert modules - layers == {"0:input"}
    monkeypatch.setattr(ev, "AUTO_LAYER_LIMIT", len(layers))
    auto = ev.table_events(tables)
    assert _scopes(auto) == modules
    assert {e.tag.split("/")[-1] for e in auto if "/0:input/" in e.tag} == {T.ACTIVATION}
    monkeypatch.setattr(ev, "AUTO_LAYER_LIMIT", len(layers) - 1)
    assert _scopes(ev.table_events(tables)) == set()
    # a pattern that selects a layer selects its input row; one may select the rows by their own name
    assert _scopes(ev.table_events(tables, layers=["0"])) == {"0", "0:input"}
    assert _scopes(ev.table_events(tables, layers=["2", "*:input"])) == {"2", "0:input"}


def _all_tags(events: list[ev.Event]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for e in events:
        if "/all/" in e.tag or e.tag.endswith("/all"):
            out.setdefault(e.step, set()).add(e.tag)
    return out


def test_the_all_scope_writes_what_dashboards_md_says_on_each_step(run: dict[str, Any]) -> None:
    """docs/dashboards.md: 54 `all` tags on a sampled step whose optimizer stepped; a step the scaler skipped
    made no update, so the six weight_update tags are missing (48); a histogram of no finite nonzero value (every
    weight gradient inf, a step the scaler skips) is missing too (47); 48 without an optimizer."""
    tables = run["tables"]
    steps = tables["steps"]
    skipped = {int(s) for s in steps.loc[T.flags(steps[T.SKIPPED]), T.STEP]}
    by_step = _all_tags(ev.table_events(tables, layers="none"))
    assert sorted(by_step) == [0, 2, 4] and skipped & set(by_step) == {2}
    update = {f"precprof/{c}/all/weight_update" for c in ("zeros", "nan", "inf")} | {
        "precprof/lost_update/bf16/all",
        "precprof/lost_update/fp16/all",
        "precprof/update_ratio/all",
    }
    assert {s: len(t) for s, t in by_step.items()} == {0: 54, 2: 48, 4: 54}
    assert by_step[0] - by_step[2] == update
    # every weight gradient of step 2 inf or nan: its histogram has no row
    hist = tables["histograms"]
    empty = hist[~((hist[T.STEP] == 2) & (hist[T.TENSOR] == T.WEIGHT_GRAD))]
    by_step = _all_tags(ev.table_events({**tables, "histograms": empty}, layers="none"))
    assert by_step[0] - by_step[2] == update | {"precprof/exponent/all/weight_grad"}
    # without an optimizer, no weight_update rows
    layers = tables["layers"]
    no_opt = layers[layers[T.TENSOR] != T.WEIGHT_UPDATE]
    by_step = _all_tags(ev.table_events({**tables, "layers": no_opt}, layers="none"))
    assert {s: len(t) for s, t in by_step.items()} == {0: 48, 2: 48, 4: 48}
    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "dashboards.md").read_text().split())
    for said in (
        "That is 54 in all, or 48 without an optimizer",
        "the six `weight_update` tags are missing: 48",
        "`exponent/all/weight_grad` is missing too: 47",
    ):
        assert said in doc, said


def _wandb_records(run_dir: Path) -> Iterator[Any]:
    """Records of an offline run's .wandb file: a LevelDB-style log (7-byte header ':W&B' + magic + version,
    then 32 KiB blocks of chunks: crc32, length, type FULL/FIRST/MIDDLE/LAST) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def _wandb_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for rec in _wandb_records(run_dir):
        if rec.WhichOneof("record_type") == "history":
            row: dict[str, Any] = {}
            for (
                item
            ) in rec.history.item:  # a histogram is logged as nested keys (tag, "bins"), (tag, "values")
                *outer, key = list(item.nested_key) or [item.key]
                node = row
                for k in outer:
                    node = node.setdefault(k, {})
                node[key] = json.loads(item.value_json)
            out[int(row["_step"])] = row
    return out


def _assert_precprof_series_go_against_precprof_step(run_dir: Path, trainer_step: str) -> None:
    """From an offline run's records, beside a trainer whose "*" glob puts every key against ``trainer_step``
    (with step_sync: wandb copies that step's value into each row holding a key bound to it): every key of
    precprof's rows, a histogram's own keys (``<tag>.bins``, ...) included, is defined by its name against
    precprof/step, and wandb copied the trainer's step into none of precprof's rows."""
    records = list(_wandb_records(run_dir))
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert {(m.glob_name, m.step_metric) for m in metrics if m.glob_name} >= {("*", trainer_step)}
    named = {m.name: m.step_metric for m in metrics if m.name}
    rows = [
        {".".join(item.nested_key) or item.key for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    rows = [keys for keys in rows if "precprof/step" in keys]
    keys = {k for keys in rows for k in keys if k.startswith("precprof/")} - {"precprof/step"}
    assert rows and any(k.endswith(".bins") for k in keys)  # histograms among them
    assert {k: named.get(k) for k in keys} == dict.fromkeys(keys, "precprof/step")
    assert [keys for keys in rows if trainer_step in keys] == []


@pytest.mark.skipif(wandb is None, reason="wandb is not installed (pip install wandb)")
def test_wandb_offline_logs_the_same_values(run: dict[str, Any]) -> None:
    steps, hist = run["tables"]["steps"], run["tables"]["histograms"]
    history = _wandb_history(run["wandb_dir"])
    assert sorted(history) == list(range(STEPS))
    for s, loss, scale in zip(steps[T.STEP], steps[T.LOSS], steps[T.LOSS_SCALE], strict=True):
        assert history[s]["precprof/loss"] == pytest.approx(loss)
        assert history[s]["precprof/loss_scale"] == scale
    h = hist[(hist[T.MODULE] == "0") & (hist[T.TENSOR] == T.ACTIVATION) & (hist[T.STEP] == 2)]
    logged = history[2]["precprof/exponent/0/activation"]
    assert logged["_type"] == "histogram"
    edges, counts = logged["bins"], logged["values"]
    assert edges[0] == h[T.EXPONENT].min() and edges[-1] == h[T.EXPONENT].max() + 1
    assert dict(zip((int(b) for b in edges[:-1]), counts, strict=True)) == {
        e: int(h.loc[h[T.EXPONENT] == e, T.COUNT].sum()) for e in range(int(edges[0]), int(edges[-1]))
    }


def test_missing_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(UserError, match=r"^tensorboard=\.\.\. needs the tensorboard package: pip install"):
        precprof.Profiler(model, tensorboard="tb")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r"^wandb=\.\.\. needs the wandb package: pip install wandb$"):
        precprof.Profiler(model, wandb=True)


def test_export_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in (
        (["export", str(tmp_path), "--tensorboard", str(tmp_path / "tb")], "not a precprof run directory"),
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and needle in err[0], err
    pd.DataFrame({T.STEP: [0]}).to_parquet(tmp_path / T.TABLE_FILES["layers"])
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--tensorboard DIR and/or --wandb-project" in err[0]


def _read_only(monkeypatch: pytest.MonkeyPatch, folder: Path) -> Path:
    """``folder`` as a read-only file system shows it to every process, root included: creating anything in it
    fails with EROFS (a real read-only mount needs root to make; the suite must not)."""
    folder.mkdir()
    real = os.makedirs

    def makedirs(name: Any, *args: Any, **kwargs: Any) -> None:
        if Path(name).is_relative_to(folder) and not Path(name).is_dir():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(name))
        real(name, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    return folder / "tb"


@pytest.mark.parametrize("where", ["a-file", "/proc/precprof-tb", "read-only"])
def test_export_to_a_place_that_cannot_hold_a_log_is_one_line(
    run: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """An existing file, /proc and a read-only folder were tracebacks."""
    if where == "a-file":
        target = tmp_path / "a-file"
        target.write_text("mine")
    elif where == "read-only":
        target = _read_only(monkeypatch, tmp_path / "ro")
    else:
        if not Path("/proc/self").is_dir():
            pytest.skip("needs Linux's /proc")
        target = Path(where)
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(run["root"] / "run"), "--tensorboard", str(target)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"precprof: error: --tensorboard {target}: ") and "choose another" in err[0], err
    if where == "a-file":
        assert target.read_text() == "mine"


@pytest.mark.skipif(wandb is None, reason="wandb is not installed (pip install wandb)")
def test_export_to_wandb_offline_matches_the_live_run(run: dict[str, Any]) -> None:
    out = run["root"] / "wandb-export"
    out.mkdir()
    exporting.export_run(
        run["root"] / "run", wandb_project="precprof-test", wandb_mode="offline", wandb_dir=out
    )
    _wandb_files_closed()  # the exported run's log is complete on disk (the flake read it before)
    (exported,) = (out / "wandb").glob("offline-run-*")
    live, again = _wandb_history(run["wandb_dir"]), _wandb_history(exported)
    assert sorted(live) == sorted(again)
    for step, row in live.items():
        want = {k: v for k, v in row.items() if not k.startswith("_") and k != "precprof/step_time_s"}
        assert {k: again[step][k] for k in want} == want, step


@pytest.mark.skipif(wandb is None, reason="wandb is not installed (pip install wandb)")
def test_the_update_to_weight_ratio_is_that_of_the_weights_before_and_after_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sampled step's ||dw|| / ||w|| per layer (weight and bias together) and over every layer, in
    TensorBoard and wandb: the test's own norms of the weights before and after ``opt.step()``. Every
    parameter has at most 256 elements, so precprof samples all of them. The other per-layer statistics were
    on the dashboards, this one only in the report and summary.json."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    assert max(p.numel() for p in model.parameters()) <= 256
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    scopes = {
        "0": list(model[0].parameters()),
        "2": list(model[2].parameters()),
        "all": [*model.parameters()],
    }
    want: dict[str, dict[int, float]] = {scope: {} for scope in scopes}
    wb_run = _offline_wandb(tmp_path, monkeypatch)
    try:
        with precprof.Profiler(
            model, optimizer=opt, sample_every=2, memory=False, tensorboard=tmp_path / "tb", wandb=True
        ) as prof:
            for step in range(6):
                (model(x) - y).square().mean().backward()
                before = [p.detach().clone() for p in model.parameters()]
                opt.step()
                opt.zero_grad(set_to_none=True)
                old = dict(zip(map(id, model.parameters()), before, strict=True))
                for scope, params in scopes.items():
                    # the update in fp32 (as the optimizer made it), its norm and the weights' in float64
                    dw = torch.cat([(p.detach() - old[id(p)]).reshape(-1) for p in params]).double()
                    w = torch.cat([old[id(p)].reshape(-1) for p in params]).double()
                    want[scope][step] = float(torch.linalg.vector_norm(dw) / torch.linalg.vector_norm(w))
                prof.step()
    finally:
        wb_run.finish()
        _wandb_files_closed()
    acc = _accumulator(tmp_path / "tb")
    history = _wandb_history(next((tmp_path / "wandb").glob("offline-run-*")))
    for scope, ratios in want.items():
        sampled = {s: r for s, r in ratios.items() if s % 2 == 0}
        assert _scalars(acc, f"precprof/update_ratio/{scope}") == pytest.approx(sampled, rel=1e-5), scope
        logged = {
            s: row[f"precprof/update_ratio/{scope}"]
            for s, row in _precprof_rows(history).items()
            if f"precprof/update_ratio/{scope}" in row
        }
        assert logged == pytest.approx(sampled, rel=1e-6), scope


def _offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A wandb run of its own, offline and silent (wandb's own warnings off), in ``tmp_path``."""
    for k, v in {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    return wandb.init(mode="offline", dir=str(tmp_path), project="precprof-test")


def _sgd_step(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One SGD step of a tiny regression on random inputs; its loss."""
    loss = model(torch.randn(2, 4)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _fp16_loop_beside_wandb(
    steps: int, sample_every: int, explicit: bool, evaluate_at: int | None = None
) -> dict[str, list[float]]:
    """A tiny fp16 loop (autocast, a GradScaler whose first scales overflow) that logs its own loss to the
    current wandb run before ``prof.step``, with ``step=`` its step or without; what the loop saw itself, per
    step: the loss, the scale of its backward, and whether ``update()`` lowered it (the step was skipped).
    ``evaluate_at``: after that step the Profiler is detached around an evaluation, which logs ``my/eval``
    at the loop's step, and attached again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17, growth_interval=2)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    seen: dict[str, list[float]] = {"loss": [], "scale": [], "skipped": []}
    with precprof.Profiler(
        model, optimizer=opt, scaler=scaler, sample_every=sample_every, wandb=True
    ) as prof:
        for s in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (model(x).float() - y).pow(2).mean()
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            seen["loss"].append(loss.item())
            seen["scale"].append(scale)
            seen["skipped"].append(float(scaler.get_scale() < scale))
            wandb.log({"my/loss": seen["loss"][-1]}, **({"step": s} if explicit else {}))
            prof.step(loss=loss)
            if s == evaluate_at:
                prof.detach()
                wandb.log({"my/eval": float(model(x).mean())}, **({"step": s} if explicit else {}))
                prof.attach()
    return seen


def _precprof_rows(history: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The rows precprof logged, by precprof's step."""
    return {int(r["precprof/step"]): r for r in history.values() if "precprof/step" in r}


@pytest.mark.skipif(wandb is None, reason="wandb is not installed (pip install wandb)")
def test_a_loop_that_logs_to_wandb_with_its_step_gets_every_unsampled_steps_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop logs its own loss with ``wandb.log(..., step=s)`` and samples every 3rd step: the unsampled
    steps' rows reach precprof's host at the next sampled step, after the loop had logged a later step, and
    wandb dropped them (precprof/loss at steps 0, 3, 6 of 9). Each waits for a wandb step of its own, against
    precprof/step: the loop's own values stay where it logged them. The rows still waiting when the Profiler
    closed (7, 8: with the default sampling, 255 of 300 steps) were left out with a warning, and those waiting
    at a detach around an evaluation too (a gap mid-run): they go on after the attach, and the last ones when
    the run finishes, past the loop's last step (its own last log, after the Profiler's close, kept)."""
    wb_run = _offline_wandb(tmp_path, monkeypatch)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seen = _fp16_loop_beside_wandb(steps=9, sample_every=3, explicit=True, evaluate_at=4)
        assert not [w for w in caught if "precprof" in str(w.message)]  # no row left out
        wandb.log({"my/final": 1.0}, step=8)
    finally:
        wb_run.finish()
        _wandb_files_closed()
    history = _wandb_history(next((tmp_path / "wandb").glob("offline-run-*")))
    assert {s: r["my/loss"] for s, r in history.items() if "my/loss" in r} == dict(enumerate(seen["loss"]))
    assert [s for s, r in history.items() if "my/eval" in r] == [4]
    assert [s for s, r in history.items() if "my/final" in r] == [8]
    rows = _precprof_rows(history)
    assert sorted(rows) == list(range(9)) and 0 < sum(seen["skipped"]) < 9
    for s, row in rows.items():
        assert row["precprof/loss"] == pytest.approx(seen["loss"][s], rel=1e-6), s
        assert (row["precprof/loss_scale"], row["precprof/skipped"]) == (seen["scale"][s], seen["skipped"][s])
    axes = {
        m.glob_name: m.step_metric
        for rec in _wandb_records(next((tmp_path / "wandb").glob("offline-run-*")))
        if rec.WhichOneof("record_type") == "metric"
        for m in [rec.metric]
    }
    assert axes["precprof/*"] == "precprof/step"


@pytest.mark.skipif(wandb is None, reason="wandb is not installed (pip install wandb)")
def test_a_loop_that_logs_to_wandb_without_a_step_gets_every_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual loop logs its own metrics with wandb.log({...}), no step=: wandb's step moves on one a call,
    and precprof's rows, logged at precprof's step, fell below it and were dropped, every one. Each goes to
    the wandb step the loop is at, beside the loop's own values, against precprof/step."""
    wb_run = _offline_wandb(tmp_path, monkeypatch)
    try:
        seen = _fp16_loop_beside_wandb(steps=6, sample_every=1, explicit=False)
    finally:
        wb_run.finish()
        _wandb_files_closed()
    history = _wandb_history(next((tmp_path / "wandb").glob("offline-run-*")))
    assert [r["my/loss"] for _, r in sorted(history.items()) if "my/loss" in r] == seen["loss"]
    rows = _precprof_rows(history)
    assert sorted(rows) == list(range(6))
    assert [rows[s]["precprof/loss"] for s in range(6)] == pytest.approx(seen["loss"], rel=1e-6)
    assert [rows[s]["precprof/skipped"] for s in range(6)] == seen["skipped"]


class _Run:
    """A stand-in for a wandb run at step 100, which drops rows below its step; ``hooks``: with wandb's list of
    teardown hooks (``on_finish``), else as a wandb without one."""

    def __init__(self, hooks: bool) -> None:
        self.step = 100
        self.logged: list[tuple[int, int]] = []
        if hooks:
            self._teardown_hooks: list[Any] = []

    def define_metric(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log(self, data: dict[str, Any], step: int) -> None:
        assert step >= self.step
        self.step = step
        self.logged.append((step, data["precprof/step"]))


@pytest.mark.skipif(wandb is None, reason="wandb is not installed (pip install wandb)")
def test_rows_waiting_for_wandb_steps_are_bounded_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop whose wandb step stays ahead of precprof's and moves on more slowly (``step=`` tokens seen, logged
    every few steps) would keep precprof's rows waiting without end: the oldest beyond the bound are dropped,
    and named at the next close, each run of steps as a range (the list had built up across detaches and its
    one range hid the gap: "6 steps (5..15)"). A wandb with no hook on its run's finish gets the rows still
    waiting at the close, past its step (they were dropped too)."""
    from precprof.export import wandb as wb

    monkeypatch.setattr(wb, "MAX_WAITING", 3)
    run = _Run(hooks=False)
    sink = wb.WandbSink(run)
    sink.write([ev.Scalar("precprof/loss", s, 1.0) for s in range(6)])
    assert run.logged == [(100, 0)]  # one row a wandb step: the others wait, the oldest two beyond 3 dropped
    run.step = 101
    sink.tick()
    assert run.logged == [(100, 0), (101, 3)]
    sink.write([ev.Scalar("precprof/loss", s, 1.0) for s in range(6, 10)])  # 4..9 wait: 4, 5, 6 dropped
    with pytest.warns(
        RuntimeWarning, match=r"wandb has no row of 5 steps \(1\.\.2, 4\.\.6\): .*BesideTrainer"
    ):
        sink.close()
    assert run.logged == [(100, 0), (101, 3), (102, 7), (103, 8), (104, 9)]
    with warnings.catch_warnings(record=True) as said:  # (precprof's warnings are shown, never raised)
        warnings.simplefilter("always")
        sink.close()  # said once
    assert not said


@pytest.mark.skipif(wandb is None, reason="wandb is not installed (pip install wandb)")
def test_rows_waiting_at_a_close_go_when_the_wandb_run_finishes() -> None:
    """The rows still waiting when the Profiler closes (a detach) keep waiting: the loop may log again, and a
    row logged past wandb's step would make wandb drop the loop's next ``wandb.log(step=...)``. The run's
    finish (wandb's hook) logs them past its step, once."""
    from precprof.export import wandb as wb

    run = _Run(hooks=True)
    sink = wb.WandbSink(run)
    sink.write([ev.Scalar("precprof/loss", s, 1.0) for s in range(3)])
    sink.close()
    assert run.logged == [(100, 0)] and len(run._teardown_hooks) == 1
    run.step = 105  # the loop's own log after the close
    for hook in run._teardown_hooks:
        hook.call()
    assert run.logged == [(100, 0), (105, 1), (106, 2)]
    sink._at_exit()  # nothing left for the process's exit
    assert len(run.logged) == 3
    # the hook of a run the sink no longer waits for places nothing; and no exit handler keeps a sink alive (a
    # sweep makes a Profiler, and a sink, per trial)
    sink.write([ev.Scalar("precprof/loss", 3, 1.0), ev.Scalar("precprof/loss", 4, 1.0)])
    assert sink._hooked is run and sink in wb._waiting_at_exit
    sink._at_finish(object())
    assert len(run.logged) == 3 and len(sink._waiting) == 2
    alive = weakref.ref(sink)
    del sink, run, hook
    gc.collect()
    assert alive() is None


def test_a_step_without_a_loss_logs_no_loss() -> None:
    """``prof.step()`` without ``loss=`` now and then: those steps' null losses went to the dashboards as nan
    (a curve that looks diverged); a step with no loss logs none, and a real nan loss still logs nan."""
    from precprof.export.events import EventStream, Scalar

    steps = pd.DataFrame(
        {
            T.STEP: [0, 1, 2, 3],
            T.LOSS: [2.0, float("nan"), 1.5, float("nan")],
            T.LOSS_SCALE: [1.0] * 4,
            T.SKIPPED: [False] * 4,
            T.NO_LOSS: [False, True, False, False],
        }
    )
    losses = {
        e.step: e.value
        for e in EventStream()._step_events(steps)
        if isinstance(e, Scalar) and e.tag == "precprof/loss"
    }
    assert sorted(losses) == [0, 2, 3] and losses[2] == 1.5 and math.isnan(losses[3])


_KILLED_AFTER_7 = """
import os, sys, torch, precprof
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17, growth_interval=2)
x, y = torch.randn(8, 16), torch.randn(8, 4)
prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=2, out=sys.argv[1], tensorboard=sys.argv[2])
prof.attach()
for _ in range(8):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(x).float() - y).pow(2).mean()
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()
    prof.step(loss=loss)
prof.detach()
os._exit(0)  # killed: nothing saved
"""


def test_a_resumed_run_goes_on_in_tensorboard_where_the_killed_job_stopped(tmp_path: Path) -> None:
    """A job killed after step 7 and resumed at step 5 into the same log directory: TensorBoard showed the killed
    job's steps 5-7 beside the new ones, and the live skipped count started again from 0 (export said 2). The
    restart is a SessionLog START at step 5, on which TensorBoard drops the old points, and the count goes on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tb = tmp_path / "run", tmp_path / "tb"
    proc = forks.run(  # a process of its own (a fork of the preloaded Python: tests/forks.py)
        [sys.executable, "-c", _KILLED_AFTER_7, str(out), str(tb)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    time.sleep(1.1)  # a new event file: its name holds the second it was made
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    kw = {"sample_every": 2, "out": out, "tensorboard": tb, "resume": True, "first_step": 5}
    with precprof.Profiler(model, optimizer=opt, scaler=scaler, **kw) as prof:
        for _ in range(5, 10):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (model(x).float() - y).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            prof.step(loss=loss)
    prof.save()
    steps = T.read_tables(out)["steps"]
    assert steps[T.STEP].tolist() == list(range(10)) and int(T.flags(steps[T.SKIPPED])[:5].sum()) >= 1
    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    loss_steps = [e.step for e in ea.Scalars("precprof/loss")]
    assert loss_steps == list(range(10))  # one point a step: the killed job's 5-7 dropped
    live = {e.step: e.value for e in ea.Scalars("precprof/skipped_steps")}
    want = T.flags(steps[T.SKIPPED]).cumsum().tolist()
    assert [live[s] for s in range(10)] == want


@pytest.mark.parametrize("owner", ["precprof", "caller"])
def test_a_profiler_attached_again_and_a_second_one_in_the_same_second_log_every_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder, owner: str
) -> None:
    """``Profiler(tensorboard=DIR)`` detached (around an evaluation) and attached again wrote nothing more:
    ``detach`` closed the event file and the next write went to the closed file (the sink dropped with "write
    to closed file"). And a second Profiler logging to the same folder in the same second (a job resumed in
    the same process) opened the same file name "wb", wiping the first one's steps. Each writer now has a file
    of its own; a SummaryWriter the caller hands in is flushed, never closed. Every step is there, once."""
    from types import SimpleNamespace

    from precprof.export import tensorboard as tb_module

    monkeypatch.setattr(tb_module, "time", SimpleNamespace(time=lambda: 1.7e9))  # every file in one second
    tb = tmp_path / "tb"
    writer = exporting.tensorboard.summary_writer_class()(str(tb)) if owner == "caller" else None
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"optimizer": opt, "sample_every": 2, "memory": False, "tensorboard": writer or tb}
    prof = precprof.Profiler(model, **kw)
    for _ in range(2):  # steps 0-1, an evaluation, steps 2-3
        prof.attach()
        for _ in range(2):
            prof.step(loss=_sgd_step(model, opt))
        prof.detach()
    with precprof.Profiler(model, first_step=4, **kw) as again:  # the job going on in this process
        for _ in range(2):
            again.step(loss=_sgd_step(model, opt))
    if writer is not None:
        assert writer.file_writer is not None  # still open: the caller's to close
        writer.close()
    acc = _accumulator(tb)
    assert [s.step for s in acc.Scalars("precprof/loss")] == list(range(6))  # once each, none lost
    assert [h.step for h in acc.Histograms("precprof/exponent/all/weight")] == [0, 2, 4]
    if writer is None:  # attached, attached again, the second Profiler
        assert len(list(tb.glob("events.out.tfevents.*"))) == 3
    assert not [w for w in recwarn if "stopped writing" in str(w.message)]  # no sink dropped on the way


@pytest.mark.skipif(wandb is None, reason="wandb is not installed (pip install wandb)")
@pytest.mark.parametrize("handed_in", [False, True])
def test_a_wandb_run_finished_inside_the_profiler_is_said_to_be_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handed_in: bool
) -> None:
    """``wandb.finish()`` inside ``with Profiler(wandb=True)``: the steps not yet flushed were lost with a
    warning that said "wandb=...=True logs to the current wandb run: call wandb.init() first", though it had.
    The warning says the run was finished early, when to finish it, and how to log the whole run."""
    wb_run = _offline_wandb(tmp_path, monkeypatch)
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    told = pytest.warns(UserWarning, match="precprof: stopped writing to wandb")
    target = wb_run if handed_in else True
    with told as caught, precprof.Profiler(model, optimizer=opt, sample_every=3, wandb=target) as prof:
        for _ in range(5):
            prof.step(loss=_sgd_step(model, opt))
        wb_run.finish()
    _wandb_files_closed()
    (msg,) = [str(w.message) for w in caught if "stopped writing to wandb" in str(w.message)]
    assert "was finished before precprof logged its last steps" in msg, msg
    assert "call wandb.finish() after the Profiler closes" in msg and "precprof export RUN_DIR" in msg, msg
    assert "wandb.init() first" not in msg and "UserError" not in msg, msg
    logged = _wandb_history(next((tmp_path / "wandb").glob("offline-run-*")))
    assert sorted(logged) == [0, 1, 2, 3]  # step 4 waited for the flush at close, after the finish


def test_a_full_disk_under_a_live_tensorboard_log_is_one_warning_and_no_traceback(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """SummaryWriter wrote on a thread of its own: on a full disk that thread died with a traceback on the
    terminal beside precprof's one-line warning. precprof's log directory is written on the calling thread:
    the disk filling up (``/dev/full`` under the event file) is one warning, and training goes on."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    from tensorboard.summary.writer.record_writer import RecordWriter

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    threads = threading.active_count()
    told = pytest.warns(UserWarning, match=r"stopped writing to TensorBoard: .*No space left on device")
    kw = {"optimizer": opt, "sample_every": 1, "tensorboard": tmp_path / "tb"}
    with told as caught, precprof.Profiler(model, **kw) as prof:
        prof.step(loss=_sgd_step(model, opt))
        (sink,) = prof._dashboards.sinks
        sink.writer._file = open("/dev/full", "wb")  # noqa: SIM115 (the writer closes it)
        sink.writer._records = RecordWriter(sink.writer._file)
        for _ in range(3):
            prof.step(loss=_sgd_step(model, opt))
    assert sum("stopped writing to TensorBoard" in str(w.message) for w in caught) == 1
    assert threading.active_count() == threads
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert len(prof.tables()["steps"]) == 4
