"""The report's environment section in words: the machine, the software, the run's settings and what the
profiler captured, each fact once, with its unit, and nothing that is empty.

``summary.json`` keeps every setting under its machine name (``memory_total_bytes``, ``loss_scale`` beside the
resolved ``loss_scaling``); a reader wants "140 GiB of memory" and "dynamic loss scaling from 65,536 (2^16)".
Each group is a list of (label, text) rows. A setting this module does not know is still shown, under its own
name, so that nothing recorded is hidden; ``config_rows`` is also the comparison page's setup.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from precprof import schema as S
from precprof import tables as T
from precprof.analysis.throughput import MIN_STEPS, timed_enough, within_noise
from precprof.report import filters as F
from precprof.report.blocks import group_range
from precprof.report.compiled_row import compiled_row
from precprof.report.overhead import past_budget

Rows = list[tuple[str, str]]


def _keys(names: str) -> frozenset[str]:
    return frozenset(names.split())


# config keys a row below says in words (or that say nothing about the run: progress bars, file handling)
_CONFIG_SAID = _keys(
    "model model_args precision loss_scale loss_scaling init_scale growth_factor backoff_factor "
    "growth_interval static_scale plan fp8_layers tf32_matmul optimizer optimizer_class lr "
    "weight_decay grad_clip steps batch_size seq_len seed device device_requested data out "
    "sample_every progress refresh_every report command_line command cmdline argv distributed "
    "world_size overwrite memory_estimate precisions max_steps "
    # (the "compiled" row says them in words: wrapped or not, asked or the default, how many steps ran compiled)
    "compile compile_requested steps_run_compiled"
)
# capture keys said elsewhere on the page (precision check, memory, per-layer table) or internal bookkeeping
_CAPTURE_SAID = _keys(
    "sample_every sample_origin sampled_steps steps_recorded modules_captured modules stats_engine "
    "block_formats weight_update_sample skipped_tensors stream memory_error histogram_shift_exact "
    "loss_dtypes device n_params param_bytes profiler_buffer_bytes profiler_scratch_bytes "
    "profiler_buffer_share_of_params model_class precision_seen autocast scaler scaler_enabled scaler_growth_interval "
    "compiled loop_stance loop_order fp8_emulated dropout_layers "
    "static_loss_scale low_precision_buffers fp8_recipe block_recipe bias_dropped fp8_whatif_recipe sampling memory_steps memory_enabled grad_norm_type shared_params shared_outside "
    "gemm_inputs model_inputs modules_without_forward optimizer optimizer_changes updates_from updates_read_steps "
    "model_changes "
    "distributed eval_forwards_ignored checkpointed_forwards weight_grads_unread_steps weight_grads_unread_modules "
    "self_call_forwards_unread scaler_from output_head mixed_precision_asked_as step_passes "
    "trainable_not_in_optimizer trainable_in_optimizer_not_given machine_load"
)
_HARDWARE_SAID = _keys(
    "device name compute_capability bf16_supported bf16_native fp16_native fp16_tensor_cores tf32_supported "
    "fp8_supported fp8_library tf32_matmul_enabled tf32_cudnn_enabled float32_matmul_precision "
    "memory_total_bytes memory_used_bytes driver_version cuda_version device_count cpu_capability "
    "nvml block_formats preset extra"
)
_LIBRARIES = {
    "precprof": "precprof",
    "python": "Python",
    "torch": "PyTorch",
    "cuda": "CUDA",
    "cudnn": "cuDNN",
    "triton": "Triton",
    "numpy": "NumPy",
    "pandas": "pandas",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "lightning": "Lightning",
    "peft": "PEFT",
    "torchao": "torchao",
    "transformer_engine": "Transformer Engine",
    "nvidia-ml-py": "nvidia-ml-py",
}
_ENGINES = {"c": "the C kernel", "triton": "the Triton kernel", "torch": "torch operations"}


def _map(v: Any) -> dict[str, Any]:
    return dict(v) if isinstance(v, Mapping) else {}


def _empty(v: Any) -> bool:
    return v is None or v == "" or v == [] or v == {} or (isinstance(v, float) and math.isnan(v))


def _label(key: str) -> str:
    return key.replace("_", " ")


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def weight_grads_unread(capture: Mapping[str, Any]) -> str:
    """Why no weight gradient was read on some sampled steps ("" when every one's was): their backward left
    none in ``.grad``, where precprof reads them: ``torch.autograd.grad`` returns them and accumulates nothing,
    and an optimizer stepped inside the backward pass (PyTorch's recipe: a post-accumulate-grad hook that steps
    and clears ``.grad``, registered before precprof's) leaves none either. Both are said, with what to do."""
    n = _int(capture.get("weight_grads_unread_steps"))
    some = _map(capture.get("weight_grads_unread_modules"))
    if not n and not some:
        return ""
    names = [T.module_in_prose(str(m)) for m in some]
    where = (
        f"not read on {F.count(n)} sampled step(s): their backward left no gradient in any parameter's .grad"
        if n
        else ""
    )
    if some:
        where += ("; and " if n else "") + (
            f"not read for {F.count(len(names))} layer(s) on the sampled steps that read the others' "
            f"({', '.join(names[:8])}{', ...' if len(names) > 8 else ''}): their output's gradient was read, yet "
            "no gradient of their parameters reached .grad"
        )
    return (
        f"{where} where precprof reads them: a loop that takes its gradients with torch.autograd.grad, or an "
        "optimizer stepped inside the backward pass (a post-accumulate-grad hook that steps and clears .grad); "
        "the advice is made without them. Give the Profiler the optimizers to have them read as each one steps "
        "(with torch.autograd.grad, assign them to .grad first)"
    )


def _optimizer_changes(changes: Any) -> str:
    """The optimizers the run switched to (``Profiler.use_optimizer``), in order: "from Adam to SGD at step 2"
    (the capture's optimizer settings are the last one's)."""
    said = [
        f"from {c.get('from') or 'none'} to {c.get('to') or 'none'} at step {F.count(c['step'])}"
        for c in changes or ()
        if isinstance(c, Mapping) and _int(c.get("step")) is not None
    ]
    return "; ".join(said)


def _model_changes(changes: Any, listed: int = 6) -> str:
    """The steps at which the model's parameters or modules changed while it was profiled
    (``remove_parametrizations``, an adapter added, torchao's ``convert_to_float8_training`` swapping the linear
    layers), which parameters came and went, and which modules were replaced, added or taken out (the first
    ``listed``): the rows follow the model as it was at each step."""
    said = []
    for c in changes or ():
        if isinstance(c, Mapping) and _int(c.get("step")) is not None:
            parts = [
                f"{', '.join(map(str, c[k]))} {what}"
                for k, what in (("added", "new"), ("removed", "gone"))
                if c.get(k)
            ]
            modules = [T.module_in_prose(str(m)) for m in c.get("modules") or ()]
            if modules and not parts:  # (modules that came or went with parameters are said by those)
                more = f" and {len(modules) - listed} more" if len(modules) > listed else ""
                parts.append(f"modules replaced, added or taken out: {', '.join(modules[:listed])}{more}")
            said.append(f"at step {F.count(c['step'])}: {'; '.join(parts) or 'parameters replaced'}")
    return "; ".join(said) + (" (recorded as the model was from then on)" if said else "")


def resumed_from(capture: Mapping[str, Any]) -> int | None:
    """The step the last attempt of a resumed run began at (``capture.stream.resumed_from``), None for a run of
    one attempt: the capture's counts and the sampler's figures are that attempt's."""
    return _int(_map(capture.get("stream")).get("resumed_from"))


def _update_reads(sample: Any, optimizer: Mapping[str, Any], capture: Mapping[str, Any]) -> str:
    """What the weight-update sample read, or, when it read none, why: without an optimizer nothing is read
    around its step, so a run that could lose updates in bf16 weights is not told (its finding needs them);
    where the optimizer stepped on none of the sampled steps (``capture.updates_read_steps`` 0: every sampled
    step a micro-batch between optimizer steps, ``prof.step()`` called once per micro-batch), none was read."""
    sampled = _int(capture.get("sampled_steps")) or 0
    if _int(sample) and optimizer.get("class") and capture.get("updates_read_steps") == 0 and sampled:
        idle = _int(_map(_map(capture.get("loop_order")).get(T.LOOP_NOT_STEPPED)).get("steps")) or 0
        # (the capture's counts are the last attempt's: an earlier one's updates are in the tables)
        resumed = resumed_from(capture)
        whose = (
            f"none in the attempt resumed at step {F.count(resumed)} (the earlier attempts' updates read are in the "
            "tables)"
            if resumed is not None
            else "none"
        )
        return (
            f"{whose}: the optimizer the Profiler was given stepped on none of the {F.count(sampled)} sampled steps, "
            "so no weight update was read, nor whether bf16 or fp16 weights would lose them"
            + (
                f" ({F.count(idle)} of them read weight gradients and no optimizer step: prof.step() called once "
                "per micro-batch under gradient accumulation makes each micro-batch a step; call it once per "
                "optimizer step)"
                if idle
                else ""
            )
        )
    if _int(sample):
        return (
            f"up to {F.count(sample)} elements of each parameter (all of a smaller one), before and after the "
            "optimizer step"
        )
    if not optimizer.get("class"):
        return (
            "none: no optimizer was given to the Profiler, so no update was sampled (updates made by hand are not "
            "seen either), nor whether bf16 or fp16 weights would lose them; give it the optimizer to know"
        )
    return "none: turned off (the Profiler was made with weight_updates False)"


def updates_from(capture: Mapping[str, Any]) -> str:
    """From which step the weight updates were read, and why, where the Profiler was given its optimizer after
    the run began and sampled steps before it have none (``capture.updates_from``): minGPT's Trainer makes its
    optimizer in run(), which a callback reaches after the first batch's step. "" otherwise."""
    got = _map(capture.get("updates_from"))
    given, first = _int(got.get("optimizer_given_at")), _int(got.get("step"))
    if given is None or (first is not None and first <= (_int(capture.get("sample_origin")) or 0)):
        return ""
    why = (
        f"the optimizer was given to the Profiler (use_optimizer) during step {F.count(given)}, and an optimizer "
        "step taken before it was given is not seen"
    )
    if first is None:
        return f"none read: {why}, and no sampled step stepped it after"
    return (
        f"from step {F.count(first)} on, the first sampled step whose optimizer step precprof read: {why}, so the "
        f"steps before {F.count(first)} have no weight-update rows (give the Profiler the optimizer before the "
        "first step to read them all)"
    )


def _cudnn(v: Any) -> str:
    """cuDNN's version number in dotted form: 91900 -> 9.19.0 (cuDNN 9), 8902 -> 8.9.2 (cuDNN 8)."""
    n = _int(v) if not isinstance(v, str) else (int(v) if v.isdigit() else None)
    if n is None:
        return str(v)
    if n >= 10000:
        return f"{n // 10000}.{(n % 10000) // 100}.{n % 100}"
    return f"{n // 1000}.{(n % 1000) // 100}.{n % 100}"


def machine_rows(hw: Mapping[str, Any]) -> Rows:
    """The machine the run trained on: device, number formats it runs natively, TF32 (CUDA), driver."""
    rows: Rows = []
    if not hw:
        return rows
    cuda = hw.get("device") == "cuda"
    name = str(hw.get("name") or hw.get("device") or "unknown")
    if cuda:
        text = name
        if hw.get("compute_capability"):
            text += f", compute capability {hw['compute_capability']}"
        total = _int(hw.get("memory_total_bytes"))
        if total:
            text += f", {F.nbytes(total)} of memory"
            used = _int(hw.get("memory_used_bytes"))
            if used is not None:
                text += f" ({F.nbytes(used)} in use when the run began)"
        count = _int(hw.get("device_count"))
        if count and count > 1:
            text += f"; {count} GPUs in the machine"
        rows.append(("GPU", text))
    else:
        cap = f", {hw['cpu_capability']}" if hw.get("cpu_capability") else ""
        rows.append(("CPU", f"{name}{cap}"))
    formats: list[str] = []
    if hw.get("bf16_native"):
        formats.append("bf16 in hardware" if not cuda else "bf16 tensor cores")
    elif hw.get("bf16_supported"):
        formats.append("bf16 emulated (no bf16 arithmetic in hardware)")
    # a CPU's fp16, as the run recorded it (every GPU has it; a run recorded before precprof recorded it says
    # nothing rather than this machine's)
    if not cuda and isinstance(hw.get("fp16_native"), bool):
        formats.append(
            "fp16 in hardware" if hw["fp16_native"] else "fp16 emulated (no fp16 arithmetic in hardware)"
        )
    if cuda:
        formats.append("fp16 tensor cores" if hw.get("fp16_tensor_cores") else "no fp16 tensor cores")
        if hw.get("fp8_supported"):
            lib = hw.get("fp8_library")
            formats.append(
                f"FP8 tensor cores ({lib})" if lib else "FP8 tensor cores (no FP8 library installed)"
            )
    blocks = hw.get("block_formats") or []
    if blocks:
        formats.append("block-scaled formats in hardware: " + ", ".join(str(b).upper() for b in blocks))
    if formats:
        rows.append(("number formats", "; ".join(formats)))
    if cuda:
        tf32 = []
        if "tf32_matmul_enabled" in hw:
            tf32.append(f"matmuls {'on' if hw['tf32_matmul_enabled'] else 'off'}")
        if "tf32_cudnn_enabled" in hw:
            tf32.append(f"cuDNN {'on' if hw['tf32_cudnn_enabled'] else 'off'}")
        if hw.get("float32_matmul_precision"):
            tf32.append(f"float32 matmul precision {hw['float32_matmul_precision']!r}")
        if tf32:
            rows.append(("TF32", ", ".join(tf32)))
        driver = [
            f"NVIDIA driver {hw['driver_version']}" if hw.get("driver_version") else "",
            f"CUDA {hw['cuda_version']}" if hw.get("cuda_version") else "",
        ]
        if any(driver):
            rows.append(("driver", ", ".join(d for d in driver if d)))
    if hw.get("preset"):
        rows.append(("planned as", f"the preset {hw['preset']}"))
    rows += [(_label(k), F.plain(v)) for k, v in hw.items() if k not in _HARDWARE_SAID and not _empty(v)]
    return rows


def software_rows(versions: Mapping[str, Any]) -> Rows:
    """Versions of what is installed, one row each; what is not installed in one row."""
    rows: Rows = []
    missing: list[str] = []
    for key, v in versions.items():
        name = _LIBRARIES.get(key, key)
        if _empty(v):
            missing.append(name)
        elif key == "cudnn":
            rows.append((name, _cudnn(v)))
        elif key == "platform":
            rows.append(("operating system", str(v)))
        else:
            rows.append((name, str(v)))
    if missing:
        rows.append(("not installed", ", ".join(missing)))
    return rows


def _loss_scaling(cfg: Mapping[str, Any]) -> str:
    kind = str(cfg.get("loss_scaling") or "")
    if not kind and cfg.get("loss_scale") not in (None, "auto"):
        kind = str(cfg.get("loss_scale")).partition(":")[0]
    if kind == "dynamic":
        text = "dynamic loss scaling"
        if cfg.get("init_scale") is not None:
            text += f" from {F.pow2(cfg['init_scale'])}"
        gf, bf, gi = cfg.get("growth_factor"), cfg.get("backoff_factor"), cfg.get("growth_interval")
        if gf is not None and gi is not None:
            text += f", ×{F.num(gf)} after {F.count(gi)} steps without overflow"
        if bf is not None:
            text += f", ×{F.num(bf)} on overflow"
        return text
    if kind == "static":
        scale = cfg.get("static_scale")
        return f"a static loss scale of {F.pow2(scale)}" if scale is not None else "a static loss scale"
    if kind == "none":
        return "no loss scaling"
    return ""


def _autocast_unseen(capture: Mapping[str, Any] | None) -> bool:
    """Whether the capture records that no recorded forward pass saw autocast (``capture.autocast`` null: no
    step sampled), neither on nor off (a summary before it recorded ``{"enabled": false}`` then)."""
    return isinstance(capture, Mapping) and "autocast" in capture and capture["autocast"] is None


def _seen_autocast(capture: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``capture.autocast`` as the hooks saw it, None where they saw none (``_autocast_unseen``)."""
    seen = capture.get("autocast")
    return seen if isinstance(seen, Mapping) else None


def precision_text(cfg: Mapping[str, Any], capture: Mapping[str, Any] | None = None) -> str:
    """The precision mode and what it means here: autocast dtype, weights, FP8 layers, TF32, loss scaling. The
    built-in loop's plan says them; a run of the callbacks (HF, Lightning) has none, and the autocast the hooks
    saw (``capture.autocast``) says it there: null where no recorded forward pass saw it (nothing sampled), which
    says neither on nor off."""
    precision = str(cfg.get("precision") or "")
    if not precision:
        return ""
    plan = _map(cfg.get("plan"))
    parts: list[str] = []
    seen = _map(_map(capture).get("autocast"))
    # (the built-in loop's plan says whether it ran autocast, sampled or not: "not observed" is the hooks' word
    # where no plan says it, a callback's run that sampled nothing)
    none = (
        "autocast not observed (no recorded forward pass)"
        if _autocast_unseen(capture) and not plan
        else "no autocast"
    )
    autocast = plan.get("autocast_dtype") or (seen.get("dtype") if seen.get("enabled") else None)
    params = plan.get("param_dtype")
    if precision == "fp8":
        n = _int(cfg.get("fp8_layers"))
        lib = plan.get("fp8_library") or "an FP8 library"
        parts.append(
            f"{F.count(n)} linear layers in FP8 through {lib}" if n is not None else f"FP8 through {lib}"
        )
        parts.append(f"the rest under {autocast or 'bfloat16'} autocast")
    elif autocast:
        weights = params or ("float32" if plan else None)  # the hooks saw the autocast, not the weights
        parts.append(f"autocast to {autocast}" + (f", {weights} weights" if weights else ""))
    elif params and params != "float32":
        parts.append(f"weights in {params}, {none}")
    else:
        parts.append(none)
    tf32 = plan.get("tf32", cfg.get("tf32_matmul"))
    if tf32 is not None and precision in ("fp32", "tf32") and str(cfg.get("device") or "").startswith("cuda"):
        parts.append(f"TF32 {'on' if tf32 else 'off'}")
    scaling = _loss_scaling(cfg)
    if scaling:
        parts.append(scaling)
    return f"{precision}: " + "; ".join(parts)


_SIZES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("n_layer", "num_hidden_layers", "num_layers"), "layers"),
    (("n_head", "num_attention_heads"), "attention heads"),
    (("n_embd", "hidden_size", "d_model"), "wide"),
    (("vocab_size",), "tokens in the vocabulary"),
    (("max_seq_len",), "positions at most"),
)


def trainable(summary: Mapping[str, Any], step: Any = None) -> tuple[int, int] | None:
    """(parameters that train, all parameters) where some are frozen (a LoRA model's base), from what the memory
    breakdown counted (summary.json's memory.model): when the summary was written, or on sampled ``step`` where
    requires_grad changed during the run (``T.trainable_at``); None where all train or the run did not count
    them."""
    facts = _map(_map(summary.get(T.SUMMARY_MEMORY)).get("model"))
    n, n_train = _int(facts.get("n_params")), _int(facts.get("n_trainable"))
    at = T.trainable_at(summary, step)
    n_train = at if at is not None else n_train
    return (n_train, n) if n is not None and n_train is not None and n_train < n else None


def _trained_said(counts: tuple[int, int], changed: bool = False) -> str:
    """ "8,704 of 115,520 parameters train (7.53%), 106,816 frozen"; ``changed``: requires_grad changed during
    the run, and these are the counts at its end ("train at the end")."""
    n_train, n = counts
    return (
        f"{F.count(n_train)} of {F.count(n)} parameters train{' at the end' if changed else ''} "
        f"({F.pct(n_train / n)}), {F.count(n - n_train)} frozen"
    )


def trainable_changes_said(summary: Mapping[str, Any]) -> str:
    """ "requires_grad changed during the run: 4,160 parameters trainable on sampled steps 0-3, 5,216 on 4-11, 4,160
    on 12-15 (at most 5,216 at once)", the model's trainable elements per run of sampled steps (the first 4 and
    the last); "" where requires_grad did not change."""
    changes = T.trainable_changes(summary)
    runs = [r for r in changes.get("numel") or [] if isinstance(r, list) and len(r) == 3]
    if not runs:
        return ""

    shown = runs if len(runs) <= 5 else [*runs[:4], runs[-1]]
    parts = [f"{F.count(r[2])} on {F.step_runs([r])}" for r in shown]
    parts[0] = f"{F.count(shown[0][2])} parameters trainable on sampled steps {F.step_runs([shown[0]])}"
    if len(runs) > len(shown):
        parts[-1] = f"... {parts[-1]}"
    most = max(r[2] for r in runs)
    return f"requires_grad changed during the run: {', '.join(parts)} (at most {F.count(most)} at once)"


def _model(
    model: Mapping[str, Any],
    cfg: Mapping[str, Any],
    capture: Mapping[str, Any],
    trains: tuple[int, int] | None = None,
) -> Rows:
    name = model.get("name") or cfg.get("model") or capture.get("model_class")
    if not name:
        return []
    what = [str(x) for x in (model.get("kind"), model.get("class")) if x]
    rows: Rows = [("model", f"{name}" + (f" ({', '.join(what)})" if what else ""))]
    n = _int(model.get("n_params") or capture.get("n_params"))
    shape: list[str] = []
    changes = trainable_changes_said({T.SUMMARY_CAPTURE: capture})
    # requires_grad changed during the run: the count at its end is the capture's (the memory breakdown's, which
    # ``trains`` holds, is missing where memory was not measured: "all train at the end" was said of 72 of 92)
    end = _int(T.trainable_changes({T.SUMMARY_CAPTURE: capture}).get("end")) if changes else None
    if changes and end is not None and n is not None and end < n:
        shape.append(_trained_said((end, n), True))
    elif trains is not None and trains[1] == n and not changes:
        shape.append(_trained_said(trains))
    elif n is not None:
        shape.append(f"{F.count(n)} parameters" + (", all train at the end" if changes else ""))
    if changes:
        shape.append(changes)
    # each size once, under whichever name the model's config gives it (GPT-2's config answers both n_embd and
    # hidden_size: the row said "32 wide, 32 wide")
    for keys, unit in _SIZES:
        v = next((_int(model.get(k)) for k in keys if _int(model.get(k)) is not None), None)
        if v is not None:
            shape.append(f"{F.count(v)} {unit}")
    known = {"name", "kind", "class", "n_params", "parameters", *(k for keys, _ in _SIZES for k in keys)}
    shape += [f"{_label(k)} {F.plain(v)}" for k, v in model.items() if k not in known and not _empty(v)]
    if shape:
        rows.append(("size", ", ".join(shape)))
    args = _map(cfg.get("model_args"))
    if args:
        rows.append(("model settings", ", ".join(f"{k}={F.plain(v)}" for k, v in args.items())))
    return rows


def _data(data: Any) -> str:
    d = _map(data)
    if not d:
        return F.plain(data) if not _empty(data) else ""
    if d.get("name") == "synthetic":
        text = "synthetic"
        if d.get("kind") == "markov_chain":
            text += (
                f": a first-order Markov chain over {F.count(d.get('vocab_size'))} tokens, "
                f"{F.count(d.get('branching'))} successors each"
            )
        if d.get("entropy_rate_nats") is not None:
            text += f" (best possible loss {F.num(d['entropy_rate_nats'])} nats"
            if d.get("uniform_loss_nats") is not None:
                text += f", {F.num(d['uniform_loss_nats'])} at the start"
            text += ")"
        return text
    if d.get("name") == "text":
        text = f"the text file {d.get('path')}, read as bytes"
        if d.get("bytes") is not None:
            text += f" ({F.count(d['bytes'])} bytes"
            if d.get("unigram_entropy_nats") is not None:
                text += f", byte entropy {F.num(d['unigram_entropy_nats'])} nats"
            text += ")"
        return text
    return F.plain(d)


def _memory_estimate(est: Any) -> str:
    e = _map(est)
    if not e or e.get("total") is None:
        return ""

    def said(keys: tuple[str, ...]) -> str:
        return ", ".join(f"{_label(k)} {F.nbytes(e[k])}" for k in keys if e.get(k) is not None)

    parts = said(("parameters", "gradients", "optimizer_states", "activations"))
    ranks = _int(e.get("ranks")) or 1
    if parts and e.get("sharded"):  # FSDP: a rank's shard, the largest unit it gathers whole, its activations
        parts = (
            f"its 1/{ranks} shard of the model: {said(('parameters', 'gradients', 'optimizer_states'))}; the "
            f"largest unit gathered whole {F.nbytes(e.get('gathered_unit'))}; {said(('activations',))}"
        )
    return (
        f"{F.nbytes(e['total'])}"
        + (" per rank" if ranks > 1 else "")
        + (f" ({parts})" if parts else "")
        + (f": {e['note']}" if e.get("note") else "")
    )


def config_rows(cfg: Mapping[str, Any], capture: Mapping[str, Any] | None = None) -> Rows:
    """The run's settings in words (the built-in loop's ``summary["config"]``; the comparison's shared one),
    ``capture`` (``summary["capture"]``) telling what the configuration does not."""
    rows: Rows = []
    precision = precision_text(cfg, capture)
    if precision:
        rows.append(("precision", precision))
    if cfg.get("precisions"):
        rows.append(("precisions compared", F.plain(cfg["precisions"])))
    opt = cfg.get("optimizer_class") or cfg.get("optimizer")
    if opt:
        hyper = [f"learning rate {F.num(cfg['lr'])}" if cfg.get("lr") is not None else ""]
        if cfg.get("weight_decay") is not None:
            hyper.append(f"weight decay {F.num(cfg['weight_decay'])}")
        hyper = [h for h in hyper if h]
        rows.append(("optimizer", f"{opt}" + (f" ({', '.join(hyper)})" if hyper else "")))
    if cfg.get("grad_clip") is not None:
        clip = float(cfg["grad_clip"])
        rows.append(("gradient clipping", f"global norm at most {F.num(clip)}" if clip > 0 else "off"))
    b, s = _int(cfg.get("batch_size")), _int(cfg.get("seq_len"))
    world = _int(cfg.get("world_size"))
    if b is not None and s is not None:
        # under torchrun --batch-size is each rank's: the steps table's tokens and the tokens/s are every rank's
        ranks = (
            f" per rank; {F.count(b * s * world)} tokens a step over {F.count(world)} ranks"
            if world is not None and world > 1
            else ""
        )
        rows.append(
            ("batch", f"{F.count(b)} sequences × {F.count(s)} tokens = {F.count(b * s)} tokens a step{ranks}")
        )
    if cfg.get("steps") is not None:
        rows.append(("steps", F.count(cfg["steps"])))
    if _max_steps(cfg):
        rows.append(("max steps", _max_steps(cfg)))
    data = _data(cfg.get("data"))
    if data:
        rows.append(("data", data))
    if cfg.get("seed") is not None:
        rows.append(("seed", str(cfg["seed"])))
    if cfg.get("device"):
        asked = cfg.get("device_requested")
        rows.append(
            (
                "training device",
                f"{cfg['device']}" + (f" (asked for: {asked})" if asked and asked != cfg["device"] else ""),
            )
        )
    if world is not None and world > 1:
        rows.append(("distributed", f"{cfg.get('distributed')} over {F.count(world)} processes"))
    est = _memory_estimate(cfg.get("memory_estimate"))
    if est:
        rows.append(("memory estimated before training", est))
    if cfg.get("out"):
        rows.append(("run directory", str(cfg["out"])))
    rows += [(_label(k), F.plain(v)) for k, v in cfg.items() if k not in _CONFIG_SAID and not _empty(v)]
    return rows


def _max_steps(cfg: Mapping[str, Any]) -> str:
    """A framework's ``max_steps`` in words ("" without one): Lightning's counts every optimizer's step (its
    ``global_step``, two a batch for a GAN's two optimizers), where precprof's steps are the batches that stepped,
    so a GAN run's "max steps 6" stood beside "steps 3" unexplained; -1, Lightning's default, is no limit."""
    n = _int(cfg.get("max_steps"))
    if n is None:
        return ""
    if n < 0:
        return "none (the epochs set the length)"
    k = _int(cfg.get("optimizers")) or 1
    if cfg.get("source") == T.SOURCE_LIGHTNING and k > 1:
        return (
            f"{F.count(n)} (Lightning's count of optimizer steps, one per step of each of the {F.count(k)} "
            "optimizers; precprof counts one step per batch)"
        )
    return F.count(n)


def _engines(engine: Any) -> str:
    e = _map(engine)
    used = _map(e.get("used"))
    if used:
        return "; ".join(f"{_ENGINES.get(str(v), str(v))} on {dev}" for dev, v in used.items())
    return F.plain(e.get("requested")) if e.get("requested") else ""


def ordinal_every(n: int) -> str:
    """A fixed sampling interval in words: "every step", "every 5th step"."""
    return "every step" if n == 1 else f"every {F.ordinal(n)} step"


def capture_rows(
    capture: Mapping[str, Any], cfg: Mapping[str, Any], tp: Mapping[str, Any] | None = None
) -> Rows:
    """What the profiler recorded: which steps, which modules, with which engine, and what it left out;
    ``tp``: the run's throughput figures (``analysis.throughput``), by which the overhead is shown or withheld."""
    rows: Rows = []
    every = _int(capture.get("sample_every", cfg.get("sample_every")))
    sampled, recorded = _int(capture.get("sampled_steps")), _int(capture.get("steps_recorded"))
    sampling = _map(capture.get("sampling"))
    resumed = resumed_from(capture)
    if sampling.get("mode") == "budget":
        rows.append(("steps sampled", sampling_text(sampling, sampled, recorded, resumed, tp)))
    elif every is not None:
        if every <= 0:
            text = "no step: per-step figures only (loss, loss scale, time), no per-layer statistics"
        else:
            origin = _int(capture.get("sample_origin")) or 0
            text = ordinal_every(every) + (f" from step {origin}" if origin else "")
            if sampled is not None and recorded is not None:
                text += f": {F.count(sampled)} of {F.count(recorded)} steps"
                # (a resumed run's counts are its last attempt's: "4 of 4" stood below a header of 16, tester t3)
                text += f" of the attempt resumed at step {F.count(resumed)}" if resumed is not None else ""
            text += f" ({_FROM_STEPS})" if sampling.get("from_steps") else ""
        rows.append(("steps sampled", text))
    if capture.get("modules_captured") is not None:
        rows.append(("modules captured", F.count(capture["modules_captured"])))
    # what ran compiled, and on which steps (the Profiler's word for a user's loop, the built-in loop's model)
    compiled = compiled_row(capture, cfg)
    if compiled:
        rows.append(("torch.compile", compiled))
    stance = _loop_stance_text(capture.get("loop_stance"))
    if stance:
        rows.append(("compiler stance", stance))
    order = loop_order_text(capture.get("loop_order"))
    if order:
        rows.append(("loop order", order))
    shared = "; ".join(
        t
        for t in (_shared_text(capture.get("shared_params")), _outside_text(capture.get("shared_outside")))
        if t
    )
    if shared:
        rows.append(("tied or shared weights", shared))
    engines = _engines(capture.get("stats_engine"))
    if engines:
        rows.append(("statistics computed by", engines))
    if "block_formats" in capture:
        rows.append(("block-format what-if", block_setting(capture["block_formats"], resumed)))
    if capture.get("scaler_from"):
        rows.append(
            (
                "loss scaler",
                f"{capture.get('scaler') or 'a GradScaler'} found in {capture['scaler_from']} (not given to the "
                "Profiler): the one the framework scaled the loss with; its scale and skipped steps are read",
            )
        )
    opt = _map(capture.get("optimizer"))
    if opt.get("class") and not (
        cfg.get("optimizer_class") or cfg.get("optimizer")
    ):  # else config_rows says it
        settings = [f"{k} {F.num(opt[k])}" for k in ("eps", "beta2") if isinstance(opt.get(k), (int, float))]
        rows.append(("optimizer", str(opt["class"]) + (f" ({', '.join(settings)})" if settings else "")))
    changes = _optimizer_changes(capture.get("optimizer_changes"))
    if changes:
        rows.append(("optimizer changed", changes))
    model_changes = _model_changes(capture.get("model_changes"))
    if model_changes:
        rows.append(("model changed", model_changes))
    if capture.get("weight_update_sample") is not None:
        late = updates_from(capture)
        rows.append(
            (
                "weight updates read on",
                _update_reads(capture["weight_update_sample"], opt, capture) + (f"; {late}" if late else ""),
            )
        )
    rows += _not_held_rows(capture)
    unread = weight_grads_unread(capture)
    if unread:
        rows.append(("weight gradients", unread))
    skipped = capture.get("skipped_tensors") or []
    if skipped:
        rows.append(
            ("tensors not measured", f"{F.count(len(skipped))} precprof could not read (see the banner)")
        )
    evals, again = _int(capture.get("eval_forwards_ignored")), _int(capture.get("checkpointed_forwards"))
    if evals:
        rows.append(
            (
                "evaluations with grad on",
                f"{F.count(evals)} module forwards in eval mode, not read as training (model.eval() without "
                "no_grad)",
            )
        )
    self_calls = _int(capture.get("self_call_forwards_unread"))
    if self_calls:
        rows.append(
            (
                "the model's call of itself",
                f"{F.count(self_calls)} module forwards of the model called by itself under no_grad inside its "
                "forward (a self-distillation target): not read (an evaluation of it), so an overflow there shows in no row",
            )
        )
    if again:
        rows.append(
            (
                "activation checkpointing",
                f"{F.count(again)} module forwards a checkpoint ran twice, read once; the saved activations are "
                "what checkpointing keeps",
            )
        )
    if capture.get("histogram_shift_exact") is False:
        rows.append(("histograms", "unscaled by a loss scale that is not a power of two: within one binade"))
    stream_error = _map(capture.get("stream")).get("error")
    if stream_error:
        rows.append(("streaming to disk", f"stopped: {stream_error}"))
    if isinstance(capture.get("memory_steps"), Mapping):
        rows.append(("memory measured on", memory_setting(capture["memory_steps"], resumed)))
    if capture.get("memory_error"):
        rows.append(("memory breakdown", f"failed: {capture['memory_error']}"))
    rows += [(_label(k), F.plain(v)) for k, v in capture.items() if k not in _CAPTURE_SAID and not _empty(v)]
    return rows


def _params_said(held: Any) -> str:
    """{module: [param, ...]} (``capture.trainable_not_in_optimizer`` and its kin) as the parameters' names, at
    most 8 and how many more: "0.bias, 2.bias"."""
    names = [f"{m}.{p}" for m, ps in _map(held).items() if isinstance(ps, list) for p in ps]
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _not_held_rows(capture: Mapping[str, Any]) -> Rows:
    """The trainable parameters no optimizer the Profiler follows held (``capture.trainable_not_in_optimizer``),
    and apart from them those an optimizer it was not given held as it stepped the model's parameters
    (``capture.trainable_in_optimizer_not_given``): those are in an optimizer, one it does not follow (a row read
    "trainable not in optimizer 0=bias, 2=bias" of the biases a second optimizer stepped, tester t2)."""
    rows: Rows = []
    loose = _params_said(capture.get("trainable_not_in_optimizer"))
    if loose:
        rows.append(
            (
                "trainable, in no optimizer followed",
                f"{loose}: in no param group of the optimizers the "
                "Profiler follows on any sampled step they stepped",
            )
        )
    beside = _params_said(capture.get("trainable_in_optimizer_not_given"))
    if beside:
        rows.append(
            (
                "stepped by another optimizer",
                f"{beside}: held by an optimizer the Profiler was not given, "
                "which stepped them; their updates were not read",
            )
        )
    return rows


# why a step was sampled (schema.REASONS), as the environment says it
_REASONS = {
    S.REASON_FIRST: "first",
    S.REASON_BUDGET: "within the budget",
    S.REASON_INTERVAL: "on the interval",
    S.REASON_NONFINITE: "right after a non-finite loss",
    S.REASON_SKIPPED: "right after a skipped step",
    S.REASON_SPIKE: "right after a loss spike",
}


def _loop_stance_text(loop_stance: Any, listed: int = 6) -> str:
    """A compiler stance the loop set itself (``capture.loop_stance``), in words: the sampled steps whose forward
    began under it, which ran compiled, without the hooks; and the steps its fail_on_recompile was held off for,
    as the model's compiled paths compiled there for the first time (one step, an int, in older runs)."""
    ls = _map(loop_stance)
    sets = [_map(s) for s in ls.get("set_in_sampled_steps") or [] if isinstance(s, Mapping)]
    parts = []
    if sets:
        steps = ", ".join(f"{F.count(s.get('step'))} ('{s.get('stance')}')" for s in sets[:listed])
        more = f" and {len(sets) - listed} more" if len(sets) > listed else ""
        parts.append(
            f"set by the loop before the forward of sampled step{'s' if len(sets) > 1 else ''} {steps}{more}: "
            "precprof leaves a loop's stance in force, so the compiled model ran compiled there, without the "
            "hooks, and the step's rows lack its activations and their gradients; the other sampled steps ran "
            "eagerly (a stance set after the forward, before prof.step(), loses nothing)"
        )
    held = ls.get("fail_on_recompile_held_off")
    held = [held] if _int(held) is not None else [h for h in held or [] if _int(h) is not None]
    if held:
        steps = ", ".join(F.count(h) for h in held[:listed])
        if len(held) > listed:
            steps += f" and {len(held) - listed} more"
        elif len(held) > 1:
            steps = steps.rpartition(", ")[0] + f" and {F.count(held[-1])}"
        parts.append(
            f"'fail_on_recompile' was held off for step{'s' if len(held) > 1 else ''} {steps}, not sampled, which "
            "ran under 'default' until one compiled nothing: the sampled steps before them ran eagerly, so the "
            "model's compiled paths first compiled there (without precprof, before the loop forbade recompiles; "
            "held off only when nothing had compiled before precprof attached); it was back in force after them"
        )
    return "; ".join(parts)


_ONCE_PER_STEP = "call prof.step() once per optimizer step, after optimizer.step()"
# what each fault of the loop's order (``capture.loop_order``, ``capture/loop_order.py``) did to the rows, and its fix
_LOOP_FAULTS = {
    "optimizer_not_followed": (
        "an optimizer the Profiler was not given ({optimizers}) stepped the model's parameters on {steps}: their "
        "weight updates were not read, and the memory section's optimizer states and the optimizer named here are "
        "those of the optimizers it was given",
        "give the Profiler every optimizer the loop steps, as a list (prof.use_optimizer(new_opt) for one the loop "
        "makes later)",
    ),
    T.LOOP_SEVERAL_STEPS: (
        "{steps} held up to {most} optimizer steps each: their rows add them up (each layer's activation calls "
        "and their gradients, the weight updates; each weight-gradient row is the gradient of its optimizer's "
        "first step there) and their time is theirs together",
        _ONCE_PER_STEP,
    ),
    # no fault: a WGAN's critic, as the README has it (``capture/loop_order.py``)
    T.LOOP_CRITIC_STEPS: (
        "{optimizers} stepped up to {most} times in each of {steps}, beside another optimizer's one step (a "
        "critic's steps per generator step): the rows of the modules it updates hold its steps, the activation "
        "calls and their gradients and the weight updates added up, each weight-gradient row its first step's "
        "gradient",
        "",
    ),
    "optimizer_before_forward": (
        "the optimizer stepped before the model's forward on {steps}: each weight-update row there is the step "
        "before's update (prof.step() called before optimizer.step())",
        _ONCE_PER_STEP,
    ),
    "empty_step": (
        "{steps} ran no forward, backward or optimizer step (prof.step() called twice)",
        _ONCE_PER_STEP,
    ),
    T.LOOP_NOT_STEPPED: (
        "{steps} read weight gradients and no optimizer step (a micro-batch's step, where prof.step() is called "
        "once per micro-batch; a batch the loop skipped): no weight update was read there",
        "",  # (the advisor's steps_without_update says the fix where it is the loop's mistake)
    ),
}


def loop_order_text(loop_order: Any) -> str:
    """What the sampled steps saw of the loop's order (``capture.loop_order``), in words: each fault, on which
    sampled steps, what it did to their rows, and the fix, each fix said once."""
    texts, fixes = [], []
    for kind, facts in _map(loop_order).items():
        said, fix = _LOOP_FAULTS.get(kind, (f"{_label(kind)} on {{steps}}", ""))
        fact = _map(facts)
        optimizers = ", ".join(str(o) for o in fact.get("optimizers") or []) or "?"
        texts.append(
            said.format(steps=_sampled_steps(fact), most=F.count(fact.get("most")), optimizers=optimizers)
        )
        if fix and fix not in fixes:
            fixes.append(fix)
    return "; ".join(texts) + (f"; to fix it, {' and '.join(fixes)}" if fixes else "")


def _sampled_steps(fact: Mapping[str, Any]) -> str:
    """The sampled steps of one fault of ``capture.loop_order`` (its ``steps`` and ``first_step``) in words: "3
    sampled steps from step 2", "1 sampled step (step 5)"."""
    n, first = _int(fact.get("steps")) or 0, _int(fact.get("first_step"))
    said = f"{F.count(n)} sampled step{'s' if n != 1 else ''}"
    if first is None:
        return said
    return f"{said} from step {F.count(first)}" if n > 1 else f"{said} (step {F.count(first)})"


def _shared_text(shared: Any, listed: int = 6) -> str:
    """The parameters recorded under another module (``capture.shared_params``), in words: their rows are that
    module's."""
    pairs = [
        f"{module}.{param} is {T.module_in_prose(str(owner))}'s"
        for module, params in _map(shared).items()
        for param, owner in _map(params).items()
    ]
    if not pairs:
        return ""
    more = f" and {len(pairs) - listed} more" if len(pairs) > listed else ""
    return "; ".join(pairs[:listed]) + more + " (recorded once, under its first owner)"


def _outside_text(outside: Any, listed: int = 6) -> str:
    """The parameters first owned by a module the capture left out (``capture.shared_outside``), in words: their
    rows are under the captured module."""
    pairs = [
        f"{module}.{param} is also {T.module_in_prose(str(_map(owner).get('module')))}'s ({_map(owner).get('type')}, not captured)"
        for module, params in _map(outside).items()
        for param, owner in _map(params).items()
    ]
    more = f" and {len(pairs) - listed} more" if len(pairs) > listed else ""
    return "; ".join(pairs[:listed]) + more if pairs else ""


def overhead_withheld(tp: Mapping[str, Any]) -> str:
    """Why precprof's overhead is not shown, in words, or "" where it is: from fewer timed steps of each kind
    than a sampled step's cost is measured from (``throughput``'s figures ``tp``, ``timed_enough``), a share
    measures nothing (2 sampled steps of a run cut short made 32.4%). The header's card and the environment's
    "steps sampled" row both keep to it: the row had printed "they took 5.52%" beside a card that withheld it."""
    if timed_enough(tp):
        return ""
    n_s, n_u = F.count(tp["steps_timed_sampled"]), F.count(tp["steps_timed_unsampled"])
    return f"{n_s} sampled, {n_u} unsampled steps timed: {MIN_STEPS} of each needed"


def _overhead_reached(s: Mapping[str, Any], tp: Mapping[str, Any] | None) -> str:
    """The overhead the sampler reached, in words for the "steps sampled" row ("" where the summary has none):
    withheld, and why, as the header withholds it; "at most" where a sampled step adds less than the steps'
    times vary (``within_noise``). ``tp``: the run's throughput figures (None: the figures as recorded)."""
    overhead, part = s.get("overhead"), s.get("overhead_sampled")
    if not isinstance(overhead, (int, float)) or not math.isfinite(overhead):
        return ""
    withheld = overhead_withheld(tp) if tp is not None else ""
    if withheld:
        return f" (what they took is not measured: {withheld})"
    bound = "at most " if tp is not None and within_noise(tp) else ""
    if isinstance(part, (int, float)) and math.isfinite(part):
        _, past = past_budget(s)  # steps sampled beyond the budget by design took it past: which, and why
        past = f"; {past}" if past else ""
        return (
            f" (they took {bound}{F.pct(float(part))}; precprof in all {bound}{F.pct(float(overhead))}{past})"
        )
    return f" (it took {bound}{F.pct(float(overhead))})"


# a run killed before it saved: its sampling counted from its steps table (``context.sampling_from_steps``)
_FROM_STEPS = "counted from the steps table: the run ended before it saved its summary"


def sampling_text(
    s: Mapping[str, Any],
    sampled: int | None,
    recorded: int | None,
    resumed: int | None = None,
    tp: Mapping[str, Any] | None = None,
) -> str:
    """Budgeted sampling (``capture.sampling.Sampler.describe``) in words: the budget, the overhead reached
    (withheld by the header's rule, ``tp`` being the run's throughput figures), the sampled steps by reason,
    and when sampling began if the kernels compiled beside the training. Of a run resumed at step ``resumed``,
    the figures are the last attempt's, and say so (the header counts the run's). Of a run killed before it
    saved (``from_steps``), the counts are its steps table's, and the overhead reached is not known."""
    budget = s.get("budget")
    within = (
        F.pct(float(budget)) if isinstance(budget, (int, float)) else "the overhead budget (not recorded)"
    )
    text = f"as many as keep the time sampled steps add within {within} of the run's time"
    text += _overhead_reached(s, tp)
    if sampled is not None and recorded is not None:
        text += f": {F.count(sampled)} of {F.count(recorded)} steps"
        if resumed is not None:
            text += f" of the attempt resumed at step {F.count(resumed)}"
    reasons = [
        f"{F.count(int(n))} {_REASONS.get(str(r), str(r))}" for r, n in _map(s.get("reasons")).items() if n
    ]
    if reasons:
        text += " (" + ", ".join(reasons) + ")"
    held, first = _int(s.get("held_for_compile")), _int(s.get("first_sampled_step"))
    if held and first is not None:
        text += f"; from step {F.count(first)}, once the statistics kernels had compiled beside the training"
    elif held and not sampled:
        text += (
            "; none: the run ended while the statistics kernels compiled beside the training (a machine's first "
            "run compiles them; the next finds them in Triton's cache)"
        )
    compiled = _int(s.get("compile_steps"))
    if compiled and s.get("mode") == "budget":
        text += (
            f"; {F.count(compiled)} unsampled step{'s' if compiled > 1 else ''} in which torch.compile compiled "
            "left out of the run's time"
        )
    thinned = _map(s.get("thinned"))
    after, every, gap = (_int(thinned.get(k)) for k in ("after", "doubling_every", "least_gap"))
    if after and every and gap:
        text += (
            f"; past {F.count(after)} sampled within the budget, each {F.count(every)} more came at least twice as "
            f"far apart (at the end at least {F.count(gap)} steps apart), and so did those after an event of a kind "
            "seen before, so that what the run records grows with the log of its length"
        )
    text += _unsampled_tail(s, sampled, recorded, bool(tp is not None and overhead_withheld(tp)))
    if s.get("synchronized"):
        text += "; every rank sampled the same steps"
    if s.get("from_steps"):
        text += f"; {_FROM_STEPS}, so what the sampled steps took of the run's time is not known"
    return text


# a budgeted run's last steps, none of them sampled, are said from this share of its steps (and this many) on, and
# past twice a thinned run's least gap between samples
TAIL_SAID_SHARE = 0.1
TAIL_SAID_MIN = 100
# ... with what took the budget past itself from this many budgets on
TAIL_PAST_BUDGET = 1.2


def _unsampled_tail(
    s: Mapping[str, Any], sampled: int | None, recorded: int | None, withheld: bool = False
) -> str:
    """Where none of a budgeted run's last steps was sampled (``TAIL_SAID_SHARE`` of its steps, and more than
    its thinning spaces samples), which and why, in words for the "steps sampled" row ("" otherwise): no step fitted
    the budget, which the sampled steps before had spent. One that cost more than expected (a wait of seconds for
    the run directory's writer, starved of CPU) is paid for by the steps after it: a 10,000-step run sampled
    nothing after step 6,356, and its heatmaps ended there unexplained (tester t1). ``withheld``: the overhead
    reached is not said (the header's rule), and so not here either."""
    last_s, last = _int(s.get("last_sampled_step")), _int(s.get("last_step"))
    if last_s is None or last is None or not sampled or not recorded:
        return ""
    tail = last - last_s
    thin = _int(_map(s.get("thinned")).get("least_gap")) or 0
    if tail < max(TAIL_SAID_SHARE * recorded, TAIL_SAID_MIN, 2 * thin):
        return ""
    text = (
        f"; none of the last {F.count(tail)} steps (after step {F.count(last_s)}, to step {F.count(last)}) was "
        "sampled: none fitted the budget, which the sampled steps before them had spent"
    )
    budget, part = s.get("budget"), s.get("overhead_sampled")
    if (
        not withheld
        and isinstance(budget, (int, float))
        and isinstance(part, (int, float))
        and part > TAIL_PAST_BUDGET * budget
    ):
        text += (
            f" and more ({F.pct(float(part))}): a sampled step that cost more than the budget had room for is paid "
            "for by the steps after it, unsampled until the run's time has grown enough to hold it"
        )
    return text


def unsampled_tail(s: Mapping[str, Any], steps: pd.DataFrame) -> str:
    """The timeline's sentence for a budgeted run none of whose last steps was sampled (``_unsampled_tail``'s
    rule, on its steps table: a killed run's too), "" otherwise: its columns end at the last sampled step."""
    if s.get("mode") != "budget" or steps.empty or T.SAMPLED not in steps or T.STEP not in steps:
        return ""
    step = pd.to_numeric(steps[T.STEP], errors="coerce")
    sampled = step[T.flags(steps[T.SAMPLED]).to_numpy()].dropna()
    if sampled.empty or step.isna().all():
        return ""
    last_s, last = int(sampled.max()), int(step.max())
    tail = last - last_s
    thin = _int(_map(s.get("thinned")).get("least_gap")) or 0
    if tail < max(TAIL_SAID_SHARE * len(steps), TAIL_SAID_MIN, 2 * thin):
        return ""
    return (
        f"No step after step {F.count(last_s)} was sampled (the run went on to step {F.count(last)}): the "
        "columns end there; the environment section's “steps sampled” says why."
    )


def memory_setting(v: Mapping[str, Any], resumed: int | None = None) -> str:
    """Which sampled steps measured memory (``capture.memory_schedule.MemorySchedule.describe``), in words;
    ``resumed``: the step the last attempt of a resumed run began at, whose counts these are (the earlier
    attempts' measurements are in the memory table)."""
    every = _int(v.get("every")) or 1
    most, now = _int(v.get("max_every")), _int(v.get("every_now"))
    if every == 1:
        text = "every sampled step"
    else:
        text = f"the first 2 sampled steps and every {F.ordinal(every)} after them"
        if v.get("adaptive") and most and most > every:
            text += (
                f", spacing out to every {F.ordinal(most)} while each held the same memory as the last of its "
                f"input shapes (every {F.ordinal(now or every)} at the end)"
            )
        if v.get("shapes_watched"):
            text += ", and any sampled step whose inputs had shapes no measured step had"
    n, of, last = _int(v.get("measured_steps")), _int(v.get("sampled_steps")), _int(v.get("last_measured"))
    if n is not None and of is not None:
        text += f": {F.count(n)} of {F.count(of)}"
        if resumed is not None:
            text += f" in the attempt resumed at step {F.count(resumed)}"
        if last is not None:
            text += f" (the last: step {F.count(last)})"
        if resumed is not None:
            text += "; the earlier attempts' measurements are in the memory table"
    new = [int(s) for s in v.get("measured_for_new_shapes") or [] if isinstance(s, (int, float))]
    if new:
        text += f"; measured for new input shapes: step{'s' if len(new) > 1 else ''} " + ", ".join(
            F.count(s) for s in new
        )
    return text


def block_setting(v: Any, resumed: int | None = None) -> str:
    """The capture's ``block_formats`` setting in words (``capture.block_budget.BlockBudget.describe``);
    ``resumed``: the step the last attempt of a resumed run began at (its budget measured the what-if's cost
    anew: the groups' figures are that attempt's)."""
    if not isinstance(v, Mapping):
        return "on" if v else "off"
    n = int(v.get("groups") or 1)
    lo, hi = group_range(v)
    turns = (
        "every linear layer on every sampled step"
        if hi <= 1
        else f"each linear layer on every {F.ordinal(n)} sampled step ({n} groups taking turns)"
        if lo == hi
        else f"the linear layers in turns, in {lo} to {hi} groups as the run went on ({n} at its end)"
    )
    if not v.get("adaptive"):
        return f"on, {turns} (block_groups={n})" + _coverage(v)
    out = f"on, {turns}: as many groups as keep the what-if within {F.pct(float(v.get('budget') or 0))} of a sampled step"
    done, needed = _int(v.get("estimates")), _int(v.get("estimates_to_widen"))
    if done is not None and needed is not None and done < needed:  # one layer a group: no budget chose them
        out = f"on, {turns}: {_unadapted(done, needed, float(v.get('budget') or 0), resumed)}"
    cost = v.get("every_layer_cost")
    if isinstance(cost, (int, float)) and math.isfinite(cost):
        out += f" (every layer at once was measured to add {F.pct(float(cost))})"
    controls, factor = _int(v.get("control_steps")), v.get("timer_factor")
    if controls:
        out += (
            f"; {F.count(controls)} sampled step{'s' if controls > 1 else ''} evaluated none, to measure what"
            " the what-if adds"
        )
        if isinstance(factor, (int, float)) and math.isfinite(factor) and round(factor, 1) > 1:  # as shown
            if v.get("timer_factor_measured", True):
                out += f": {factor:.1f} times what its own timer reads"
            else:  # the controls' times spread too widely to tell: the device's prior per call
                taken = f"its timer's reading taken {factor:.1f} times, for what a call adds here"
                out += f" (too uneven to tell: {taken})"
    return out + _coverage(v)


def _unadapted(done: int, needed: int, budget: float, resumed: int | None = None) -> str:
    """Why the block budget's groups are still one layer each: it widens them only on ``needed`` estimates of
    the what-if's cost, and the run made ``done`` (it read "as many groups as keep the what-if within 10% of a
    sampled step (every layer at once was measured to add 4.67%)" beside 17 groups)."""
    made = "none" if not done else F.count(done)
    whose = "this run's" if resumed is None else f"the attempt resumed at step {F.count(resumed)}"
    return (
        f"one layer a group, as the block budget ({F.pct(budget)} of a sampled step) starts, until "
        f"{F.count(needed)} sampled steps have measured what the what-if costs; {whose} measured it on {made}"
    )


def _tied(embeddings: int, tied: int | None) -> str:
    """Why the block what-if evaluates embeddings, and how many of them a tied head reads (``tied``: None in a
    run recorded before it was counted): every embedding is evaluated, though only a tied head's GEMM reads one.
    (It read "evaluated for a head tied to their weight: none has one here", as if evaluated for nothing.)"""
    if tied == embeddings:
        return ", whose weight a tied head reads"
    why = ", evaluated in case a head is tied to their weight"
    if tied is None:
        return why
    if not tied:
        return why + ", though no head is tied to one here"
    return why + f"; a head is tied to {F.count(tied)} of the {F.count(embeddings)}"


def _coverage(v: Mapping[str, Any]) -> str:
    """How many linear layers the sampled steps evaluated, and on how many steps each ("" when not recorded)."""
    layers, done, ev = _int(v.get("layers")), _int(v.get("layers_evaluated")), v.get("evaluations")
    if not layers or done is None:
        return ""
    text = f"; {F.count(done)} of {F.count(layers)} linear layers evaluated"
    emb, emb_done = _int(v.get("embeddings")), _int(v.get("embeddings_evaluated"))
    if emb and emb_done is not None:
        text += f" (and {F.count(emb_done)} of {F.count(emb)} embeddings{_tied(emb, _int(v.get('embeddings_tied')))})"
    if not (isinstance(ev, (list, tuple)) and len(ev) == 2) or not done:
        return text
    lo, hi = _int(ev[0]), _int(ev[1])
    if hi is None:
        return text
    unit = "sampled step" if hi == 1 else "sampled steps"
    if done < layers or lo is None:
        return text + f", each on at most {F.count(hi)} {unit}"
    span = F.count(lo) if lo == hi else f"{F.count(lo)} to {F.count(hi)}"
    return text + f", each on {span} {unit}"


_NONFINITE_KINDS = ("nan", "inf")


def _param_dtype_words(wrapper: str, param_dtype: Any, autocast: Mapping[str, Any] | None) -> list[str]:
    """The parameters' dtype and the compute's, in words. FSDP's ``param_dtype`` is the dtype it gathers the
    parameters in for the forward, which computes in it unless autocast runs on top; DDP's is the parameters'
    own (DDP has no compute dtype), and a bf16-autocast DDP run read "computes in float32". ``autocast`` None:
    no recorded forward pass saw it, and the compute's dtype is not said."""
    if not param_dtype:
        return []
    cast = autocast.get("dtype") if autocast is not None and autocast.get("enabled") else None
    if wrapper in ("FSDP1", "FSDP2") and not cast and autocast is not None:
        return [f"computes in {param_dtype}"]
    held = "gathered in" if wrapper in ("FSDP1", "FSDP2") else "in"
    return [f"parameters {held} {param_dtype}" + (f" (compute: {cast} autocast)" if cast else "")]


def distributed_rows(d: Mapping[str, Any], autocast: Mapping[str, Any] | None = None) -> Rows:
    """``capture.distributed`` (``precprof.capture.reducer``) in words: the ranks, the wrapper, what the numbers of
    a multi-rank run are, non-finite values by rank, and every rank's memory. ``autocast``: the capture's
    (``capture.autocast``), for the dtype the forward computes in; None where no recorded forward pass saw it."""
    if not d:
        return []
    rows: Rows = []
    world, reduced = _int(d.get("world_size")), _int(d.get("sampled_steps_reduced"))
    local, writer = _int(d.get("sampled_steps_local")), d.get("writer_rank", 0)
    backend = f" ({d['backend']})" if d.get("backend") else ""
    rows.append(
        (
            "processes",
            f"{F.count(world)}{backend}; rank {writer} wrote this run"
            + (
                f"; the statistics of {F.count(reduced)} sampled step{'s' if reduced != 1 else ''} are every "
                "rank's together"
                if reduced is not None
                else ""
            )
            + (f", those of {F.count(local)} rank {writer}'s alone" if local else ""),
        )
    )
    if d.get("local_only"):  # why the ranks stopped combining their statistics (a crash, uneven inputs)
        rows.append(("rank-local statistics", F.plain(d["local_only"])))
    wrapper = str(d.get("wrapper") or "none")
    dtypes = [
        *_param_dtype_words(wrapper, d.get("param_dtype"), autocast),
        *([f"reduces gradients in {d['reduce_dtype']}"] if d.get("reduce_dtype") else []),
    ]
    if wrapper == "none":
        parallel = str(d.get("sharding") or "none")
    else:
        parallel = (
            wrapper
            + (f": {d['sharding']}" if d.get("sharding") else "")
            + (f"; {', '.join(dtypes)}" if dtypes else "")
        )
    rows.append(("parallelism", parallel))
    sem = _map(d.get("semantics"))
    said = {
        "counts": "counts and histograms",
        "activations": "activations",
        "activation_gradients": "activation gradients",
        "weights": "weights",
        "weight_gradients": "weight gradients",
        "fp8_current_scaling": "FP8 and block what-ifs",
        "optimizer_states": "optimizer states",
        "steps": "steps",
    }
    for key, what in said.items():
        if sem.get(key):
            rows.append((what, F.plain(sem[key])))
    by_rank = {str(r): _map(v) for r, v in _map(d.get("nonfinite_by_rank")).items()}
    bad = [
        f"rank {r}: "
        + ", ".join(f"{F.count(v.get(k))} {k}" for k in _NONFINITE_KINDS if _int(v.get(k)))
        + f" on {F.count(v.get('sampled_steps_with_nonfinite'))} sampled step(s)"
        for r, v in sorted(by_rank.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0)
        if any(_int(v.get(k)) for k in _NONFINITE_KINDS)
    ]
    events = [_map(e) for e in d.get("nonfinite_events") or []]
    if events:
        first = events[0]
        where = (
            f"module {T.module_in_prose(str(first.get('module')))} ({first.get('tensor')})"
            if first.get("module")
            else ""
        )
        bad.append(f"first at step {first.get('step')}" + (f" in {where}" if where else ""))
    mem = {str(r): _map(v) for r, v in _map(d.get("memory_by_rank")).items()}
    if sem.get("memory"):  # (no step reduced over the ranks: no totals of theirs)
        below = "; every rank's totals in the row below" if mem else ""
        rows.append(("memory", f"rank 0's breakdown (the memory section){below}"))
    if by_rank:
        rows.append(("non-finite values by rank", "; ".join(bad) if bad else "none on any rank"))
    if mem:
        comps = list(dict.fromkeys(c for v in mem.values() for c in v))
        most = _map(d.get("memory_max_over_ranks"))
        text = ", ".join(f"{c} {F.nbytes(most.get(c))}" for c in comps if most.get(c) is not None)
        rank_totals = {
            r: sum(int(b) for b in v.values() if isinstance(b, (int, float))) for r, v in mem.items()
        }
        top = max(rank_totals, key=lambda r: rank_totals[r])
        spread = len(set(rank_totals.values())) > 1
        step = f" on step {d['memory_step']}" if d.get("memory_step") is not None else ""
        rows.append(
            (
                "memory of the ranks",
                f"the most any rank held{step}: {text}"
                + (f" (rank {top} held the most in all)" if spread else " (every rank the same)"),
            )
        )
    return rows


def environment(summary: Mapping[str, Any], tp: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The environment section: the device (for the page's header), the command line, and the groups of rows;
    ``tp``: the run's throughput figures (``analysis.throughput``), as the header has them."""
    cfg = _map(summary.get(T.SUMMARY_CONFIG))
    hw = _map(summary.get(T.SUMMARY_HARDWARE))
    capture = _map(summary.get(T.SUMMARY_CAPTURE))
    command = None
    for src in (cfg, summary):
        for key in ("command", "command_line", "cmdline", "argv"):
            if src.get(key):
                command = src[key]
                break
        if command is not None:
            break
    device = hw.get("name") or hw.get("device")
    if hw.get("compute_capability"):
        device = f"{device} (compute capability {hw['compute_capability']})"
    groups = [
        ("Machine", machine_rows(hw)),
        ("Software", software_rows(_map(summary.get(T.SUMMARY_VERSIONS)))),
        ("Model", _model(_map(summary.get(T.SUMMARY_MODEL)), cfg, capture, trainable(summary))),
        ("Run", config_rows(cfg, capture)),
        ("Capture", capture_rows(capture, cfg, tp)),
        ("Processes", distributed_rows(_map(capture.get("distributed")), _seen_autocast(capture))),
    ]
    return {"device": device, "command": command, "groups": [(n, rows) for n, rows in groups if rows]}
