"""precprof on code it did not write: karpathy's nanoGPT ``train.py``, checked against independent hooks.

Given a nanoGPT checkout (``fetch github:karpathy/nanoGPT``; the script never downloads), it writes a copy of
``train.py`` with the lines a user adds (``Profiler(...).attach()`` before the loop, ``prof.step(loss=...)``
after ``optimizer.zero_grad``, ``prof.detach()`` and ``prof.report()`` after it) and, for the checks, lines that
record every iteration's loss, the final weights and, on sampled iterations, what independent hooks see. It
trains a small GPT (2 layers, n_embd 64, dropout 0.1, so that the RNG matters) on generated tokens on the CPU,
in fp32 and in bf16 autocast (nanoGPT turns autocast off on a CPU; the copy turns it on for bf16), and checks:

- the profiler changes nothing: the losses of every iteration and the final weights are bitwise those of the
  same script without it (the hooks of the checks run in both);
- the counts are a real cast's: for every linear layer's output (forward, grad enabled: nanoGPT's evaluation
  passes under ``no_grad`` are not training) and every linear weight's gradient (read after backward, before
  clipping) and output gradient (a tensor hook), on every sampled iteration: elements, zeros, values that a
  cast to fp16 / bf16 turns to 0 or to inf, and the largest magnitude, against precprof's layers table;
- the inputs of nanoGPT's own LayerNorm class (``ln_1``, ``ln_2``, ``ln_f``: residual sums, which no module
  returns), read into their ``:input`` rows, likewise against a pre-hook's casts (the first ``ln_1``'s input, the
  dropout's output as it made it, against that dropout's row);
- nanoGPT's evaluation passes in between do not change the sampled steps' rows (calls per step: 1);
- a run killed with SIGKILL mid-training leaves a run directory that ``precprof report`` renders, and every
  iteration flushed before the kill is read back.

Usage: python bench/nanogpt_check.py --nanogpt PATH [--iters 40]
Writes bench/results/nanogpt_cpu.json and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from precprof import tables as T  # noqa: E402

SAMPLE_EVERY = 5
CONFIG = {
    "device": "cpu",
    "compile": False,
    "dataset": "precprof_synth",
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 64,
    "block_size": 64,
    "batch_size": 8,
    "gradient_accumulation_steps": 1,
    "dropout": 0.1,
    "eval_interval": 20,
    "eval_iters": 2,
    "log_interval": 10,
    "always_save_checkpoint": False,
    "warmup_iters": 5,
    "learning_rate": 3e-3,
}

# what the copy of train.py gains; PRECPROF_OUT unset: the same script without the profiler
PROFILER_ATTACH = """
import precprof as _precprof
_prof = None
if os.environ.get("PRECPROF_OUT"):
    _prof = _precprof.Profiler(model, optimizer=optimizer, scaler=scaler, sample_every=int(os.environ["PRECPROF_SAMPLE_EVERY"]), out=os.environ["PRECPROF_OUT"]).attach()
"""
PROFILER_STEP = "    if _prof is not None: _prof.step(loss=loss.detach() * gradient_accumulation_steps)\n"
PROFILER_END = "if _prof is not None:\n    _prof.detach()\n    _prof.report()\n"

# the checks' own hooks and records, in both scripts
CHECK_SETUP = """
import json as _json, torch as _torch
_check_every = int(os.environ["PRECPROF_SAMPLE_EVERY"])
_seen = {}
_losses = []
def _counts(x):
    x = x.detach().float()
    finite = _torch.isfinite(x)
    nz = (x != 0) & finite
    h, b = x.to(_torch.float16), x.to(_torch.bfloat16)
    return {
        "numel": x.numel(), "zeros": int((x == 0).sum()),
        "underflow_fp16": int((nz & (h == 0)).sum()), "overflow_fp16": int((finite & _torch.isinf(h)).sum()),
        "underflow_bf16": int((nz & (b == 0)).sum()), "overflow_bf16": int((finite & _torch.isinf(b)).sum()),
        "absmax": float(x[finite].abs().max()) if finite.any() else None,
    }
def _fwd_hook(name):
    def hook(mod, args, out):
        if _torch.is_grad_enabled() and iter_num % _check_every == 0:
            per = _seen.setdefault(str(iter_num), {})
            per["activation|" + name] = _counts(out)
            def grad_hook(g):  # the gradient of the output, read; returns None, so it changes nothing
                per["activation_grad|" + name] = _counts(g)
            out.register_hook(grad_hook)
    return hook
def _input_hook(name):  # a norm's input, which precprof reads into "<name>:input": here a residual sum
    def hook(mod, args):
        if _torch.is_grad_enabled() and iter_num % _check_every == 0:
            _seen.setdefault(str(iter_num), {})["activation|" + name + ":input"] = _counts(args[0])
    return hook
_owner = {}  # a shared parameter is recorded under the first module that holds it (lm_head's is wte's)
for _name, _mod in model.named_modules():
    for _p in _mod.parameters(recurse=False):
        _owner.setdefault(id(_p), _name)
    if isinstance(_mod, _torch.nn.Linear):
        _mod.register_forward_hook(_fwd_hook(_name))
    if type(_mod).__name__ == "LayerNorm" and not type(_mod).__module__.startswith("torch."):  # nanoGPT's own
        _mod.register_forward_pre_hook(_input_hook(_name))
"""
CHECK_AFTER_BACKWARD = """        if iter_num % _check_every == 0:
            for _name, _mod in model.named_modules():
                if isinstance(_mod, _torch.nn.Linear) and _mod.weight.grad is not None and _owner[id(_mod.weight)] == _name:
                    _seen.setdefault(str(iter_num), {})["weight_grad|" + _name] = _counts(_mod.weight.grad)
"""
CHECK_LOSS = "    _losses.append(loss.item() * gradient_accumulation_steps)\n"
CHECK_END = """_torch.save({k: v.detach().clone() for k, v in raw_model.state_dict().items()}, os.environ["CHECK_OUT"] + ".pt")
with open(os.environ["CHECK_OUT"] + ".json", "w") as _f:
    _json.dump({"losses": _losses, "seen": _seen}, _f)
"""


def patched(train_py: str, bf16: bool) -> str:
    """train.py with the user's lines and the checks' lines added at the places the module docstring names."""
    s = train_py

    def insert_after(anchor: str, text: str) -> None:
        nonlocal s
        assert s.count(anchor) == 1, anchor
        s = s.replace(anchor, anchor + text)

    def insert_before(anchor: str, text: str) -> None:
        nonlocal s
        assert s.count(anchor) == 1, anchor
        s = s.replace(anchor, text + anchor)

    if bf16:  # nanoGPT keeps autocast off on a CPU
        old = "ctx = nullcontext() if device_type == 'cpu' else "
        assert s.count(old) == 1
        s = s.replace(old, "ctx = ")
    insert_after("raw_model = model.module if ddp else model # unwrap DDP container if needed\n", CHECK_SETUP)
    insert_after(
        "raw_model = model.module if ddp else model # unwrap DDP container if needed\n", PROFILER_ATTACH
    )
    insert_after("        scaler.scale(loss).backward()\n", CHECK_AFTER_BACKWARD)
    insert_after("    optimizer.zero_grad(set_to_none=True)\n", PROFILER_STEP + CHECK_LOSS)
    insert_before("if ddp:\n    destroy_process_group()", PROFILER_END + CHECK_END)
    return s


def make_data(nanogpt: Path) -> None:
    """data/precprof_synth: a character-level corpus from a seeded Markov chain (65 symbols, as shakespeare_char)."""
    d = nanogpt / "data" / "precprof_synth"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    trans = rng.dirichlet(np.full(65, 0.3), size=65)
    toks = np.empty(200_000, dtype=np.uint16)
    toks[0] = 0
    u = rng.random(len(toks))
    cdf = trans.cumsum(axis=1)
    for i in range(1, len(toks)):
        toks[i] = min(int(np.searchsorted(cdf[toks[i - 1]], u[i])), 64)
    toks[:180_000].tofile(d / "train.bin")
    toks[180_000:].tofile(d / "val.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": {i: chr(48 + i) for i in range(65)}}, f)


def run(nanogpt: Path, script: Path, args: list[str], env: dict[str, str], kill_at: int | None = None) -> str:
    cmd = [sys.executable, str(script), *args]
    if kill_at is None:
        res = subprocess.run(cmd, cwd=nanogpt, env=env, capture_output=True, text=True, timeout=1800)
        if res.returncode != 0:
            raise RuntimeError(f"{script.name} failed:\n{res.stderr[-3000:]}")
        return res.stdout
    env = {**env, "PYTHONUNBUFFERED": "1"}  # its lines as they are printed
    proc = subprocess.Popen(
        cmd, cwd=nanogpt, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith(f"iter {kill_at}:"):
            time.sleep(0.5)  # a few more iterations, their flushes in flight
            proc.send_signal(signal.SIGKILL)
            break
    proc.communicate(timeout=60)
    return "".join(out)


def compare_counts(
    layers: pd.DataFrame, seen: dict[str, dict[str, dict[str, Any]]], fed: dict[str, list[str]]
) -> dict[str, Any]:
    """precprof's rows against the independent hooks', per sampled iteration, layer and tensor kind; a norm's
    input that a module made as it is (``fed``: summary capture.norm_inputs_from) against that module's row."""
    cols = ["numel", "zeros", "underflow_fp16", "overflow_fp16", "underflow_bf16", "overflow_bf16"]
    mismatches: list[str] = []
    compared = 0
    for step, per in seen.items():
        for key, want in per.items():
            kind, module = key.split("|", 1)
            norm = module.removesuffix(T.INPUT_SUFFIX)
            if module != norm and len(fed.get(norm, [])) == 1:
                module = fed[norm][0]  # (the dropout after the embeddings feeds the first ln_1)
            tensor = {"activation": T.ACTIVATION, "activation_grad": T.ACTIVATION_GRAD}.get(
                kind, T.WEIGHT_GRAD
            )
            rows = layers[
                (layers[T.STEP] == int(step)) & (layers[T.MODULE] == module) & (layers[T.TENSOR] == tensor)
            ]
            if tensor == T.WEIGHT_GRAD:
                rows = rows[rows[T.PARAM] == "weight"]
            if len(rows) != 1:
                mismatches.append(f"step {step} {key}: {len(rows)} rows")
                continue
            row = rows.iloc[0]
            compared += 1
            for c in cols:
                got = int(
                    row[T.underflow_col(c[10:])]
                    if c.startswith("underflow_")
                    else row[T.overflow_col(c[9:])]
                    if c.startswith("overflow_")
                    else row[c]
                )
                if got != want[c]:
                    mismatches.append(f"step {step} {key} {c}: precprof {got}, cast {want[c]}")
            if want["absmax"] is not None and float(row[T.ABSMAX]) != want["absmax"]:
                mismatches.append(
                    f"step {step} {key} absmax: precprof {row[T.ABSMAX]}, hook {want['absmax']}"
                )
            if tensor == T.ACTIVATION and int(row[T.CALLS]) != 1:
                mismatches.append(f"step {step} {key}: {row[T.CALLS]} calls (evaluation passes counted?)")
    return {"compared": compared, "mismatches": mismatches[:20], "n_mismatches": len(mismatches)}


def digest(path: Path) -> str:
    import torch

    state = torch.load(path)
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "nanogpt_cpu.json")
    a = ap.parse_args()
    nanogpt = a.nanogpt.resolve()
    make_data(nanogpt)
    tmp = Path(tempfile.mkdtemp(prefix="precprof-nanogpt-"))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PRECPROF_SAMPLE_EVERY": str(SAMPLE_EVERY),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PRECPROF_OUT", None)
    results: dict[str, Any] = {
        "nanogpt": subprocess.run(
            ["git", "-C", str(nanogpt), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "config": {**CONFIG, "max_iters": a.iters, "sample_every": SAMPLE_EVERY},
        "runs": {},
    }
    ok = True
    for dtype in ("float32", "bfloat16"):
        script = nanogpt / f"train_precprof_{dtype}.py"
        script.write_text(patched((nanogpt / "train.py").read_text(), bf16=dtype == "bfloat16"))
        args = [
            f"--{k}={v}"
            for k, v in {**CONFIG, "max_iters": a.iters, "dtype": dtype, "out_dir": str(tmp / "out")}.items()
        ]
        t0 = time.perf_counter()
        run(nanogpt, script, args, {**env, "CHECK_OUT": str(tmp / f"{dtype}-plain")})
        t_plain = time.perf_counter() - t0
        out_dir = tmp / f"{dtype}-run"
        t0 = time.perf_counter()
        run(
            nanogpt,
            script,
            args,
            {**env, "CHECK_OUT": str(tmp / f"{dtype}-prof"), "PRECPROF_OUT": str(out_dir)},
        )
        t_prof = time.perf_counter() - t0
        plain = json.loads((tmp / f"{dtype}-plain.json").read_text())
        prof = json.loads((tmp / f"{dtype}-prof.json").read_text())
        tables = T.read_tables(out_dir)
        steps = tables["steps"]
        r: dict[str, Any] = {
            "losses_bitwise_equal": plain["losses"] == prof["losses"],
            "weights_bitwise_equal": digest(tmp / f"{dtype}-plain.pt") == digest(tmp / f"{dtype}-prof.pt"),
            "hooks_agree_without_profiler": plain["seen"] == prof["seen"],
            "steps_recorded": len(steps),
            "iterations": len(prof["losses"]),
            "steps_loss_equal": [float(x) for x in steps[T.LOSS]] == prof["losses"],
            "sampled_steps": sorted(int(s) for s in set(tables["layers"][T.STEP])),
            "counts": compare_counts(
                tables["layers"],
                prof["seen"],
                (T.read_summary(out_dir).get(T.SUMMARY_CAPTURE) or {}).get("norm_inputs_from") or {},
            ),
            "wall_s": {"without": round(t_plain, 2), "with": round(t_prof, 2)},
        }
        rec = T.read_summary(out_dir).get(T.SUMMARY_RECOMMENDATION) or {}
        r["recommendation"] = {"format": rec.get("format"), "measured_format": rec.get("measured_format")}
        r["report_written"] = (out_dir / T.REPORT_FILE).exists()
        # killed mid-training: what was flushed is read back and reported
        killed = tmp / f"{dtype}-killed"
        long = [x for x in args if not x.startswith("--max_iters=")] + [
            "--max_iters=1000"
        ]  # killed long before its end
        run(
            nanogpt,
            script,
            long,
            {**env, "CHECK_OUT": str(tmp / f"{dtype}-killed"), "PRECPROF_OUT": str(killed)},
            kill_at=20,
        )
        read = T.read_run(killed)
        rep = subprocess.run(
            [sys.executable, "-m", "precprof", "report", str(killed)], env=env, capture_output=True, text=True
        )
        html = (killed / T.REPORT_FILE).read_text() if (killed / T.REPORT_FILE).exists() else ""
        r["killed"] = {
            "last_step": read.last_step,
            "steps_contiguous": read.tables["steps"][T.STEP].tolist()
            == list(range((read.last_step or -1) + 1)),
            "report_rc": rep.returncode,
            "report_says_cut_off": "The run was cut off; its record ends after step" in html,
            "traceback": "Traceback" in rep.stderr,
        }
        good = (
            r["losses_bitwise_equal"]
            and r["weights_bitwise_equal"]
            and r["hooks_agree_without_profiler"]
            and r["steps_recorded"] == r["iterations"] == a.iters + 1
            and r["steps_loss_equal"]
            and r["counts"]["n_mismatches"] == 0
            and r["counts"]["compared"] > 0
            and r["report_written"]
            and r["killed"]["report_rc"] == 0
            and r["killed"]["report_says_cut_off"]
            and r["killed"]["steps_contiguous"]
            and not r["killed"]["traceback"]
            and (r["killed"]["last_step"] or 0) >= 20
        )
        r["ok"] = bool(good)
        ok = ok and good
        results["runs"][dtype] = r
        print(json.dumps({dtype: r}, indent=1), flush=True)
    results["ok"] = ok
    if ok:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"kept for a look: {tmp}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    print(a.out)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
