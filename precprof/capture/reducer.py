"""Rank-aware capture under torch.distributed (torchrun; DDP, FSDP1 ``FullyShardedDataParallel``, FSDP2
``fully_shard``): statistics of every rank combined on sampled steps, rank 0 writes.

The Profiler picks :class:`RankReducer` by itself when a process group of more than one rank is initialised
(``Profiler(..., reducer="auto")``, the default). On every sampled step, every rank reaches the same
collectives (same model, same sampling schedule):

- ``reduce_rows``: the statistics buffer (``precprof.stats`` row layout) is all-reduced — every count and
  histogram column summed, the largest finite |x| (``COL_ABSMAX_BITS``) reduced with MAX, the smallest nonzero
  |x| (``COL_ABSMIN_BITS``) with MIN. Two all-reduces of int64 tensors, on the device (NCCL or gloo);
- ``reduce_meta``: one ``all_gather_object`` of the host-side row descriptions — calls summed, dtypes unioned,
  a linear layer's ``numel_gcd`` the largest number dividing every rank's, forward order the earliest any rank saw — and of each rank's nonzero nan/inf counts, so that a nan on one
  rank stays attributed to that rank instead of being averaged away;
- ``reduce_sum``: the weight-update samples, summed.

What the numbers mean (also in ``summary.json`` under ``capture.distributed.semantics``):

- Activations and activation gradients: every rank's local micro-batch, summed — the statistics of the
  global batch.
- Weights and weight gradients under DDP: every rank holds a full replica, so ``numel`` is world_size x the
  parameter's size (every fraction — underflow/numel and so on — is the one of a single replica). Weight
  gradients are read by the post-accumulate-grad hook, before DDP's all-reduce copies the averaged gradient back
  (default ``gradient_as_bucket_view=False``): they are each rank's local gradient.
- Weights and weight gradients under FSDP2: the rank-local shard (``DTensor.to_local()``) of the sharded
  parameter (its storage dtype, e.g. fp32 masters under ``MixedPrecisionPolicy(param_dtype=bfloat16)``), so the
  sum over ranks is exactly the full parameter; gradients are the reduce-scattered (averaged) shards.
- Weights under FSDP1: the rank's stored shard of each ``FlatParameter`` (padding left out; read while gathered).
  With ``use_orig_params=True`` FSDP1 sets each parameter's ``.grad`` to its reduce-scattered shard outside
  autograd: weight gradients are read in the optimizer's step pre-hook, the shards as the optimizer gets them.
- fp8 underflow after per-tensor current scaling is counted per call, each tensor with its own amax, so per
  rank and, under FSDP, per shard (fewer flushes than the whole weight's one amax gives; block what-ifs: blocks
  within a shard), then summed; the histogram cannot make it the whole tensor's: ``_SHARD_SCALING`` says so.
- The steps table (loss, loss scale, skipped, grad norm, time) is rank 0's: the loss is what rank 0 passed to
  ``Profiler.step`` (its local loss unless the training loop passes a reduced one).
- The memory table is rank 0's; ``capture.distributed.memory_by_rank`` holds every rank's last sampled step
  when the Profiler hands its memory rows to ``reduce_memory``.
Crashes: a rank unwinding from an exception enters no collective (the others may never reach it): its own rows.
Uneven inputs: a rank out of batches inside DDP's ``model.join()`` (or a ``Join``) runs only its Joinables' join
hooks' collectives, not precprof's (gloo aborts, NCCL can hang or mix buffers): once a Joinable the reducer watches
(the wrapper, the Profiler's model and optimizers) is in a join context, every rank keeps its own statistics
(``local_only``, ``sampled_steps_local``, and why): training goes on as it would without precprof.
"""

from __future__ import annotations

import math
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from precprof import _compat
from precprof import stats as st
from precprof import tables as T
from precprof.capture.plan import can_have_grad

_MAX_EVENTS = 64  # nonfinite events (row x sampled step) kept for the summary


def _dist() -> Any:
    import torch.distributed as dist

    return dist


# The tensors given to precprof's collectives since the last sampled step's began (``reduce_rows`` starts them),
# held until the next sampled step's begin, or to the end of the process. Gloo's worker frees a collective's
# tensors when it drops its last reference to the work, and a barrier after it keeps that work until the barrier's
# own is dropped; a worker thread the system did not run for a while keeps one too. At a program's last barrier,
# that can be after the interpreter began to finish: a tensor whose Python object died before needs the
# interpreter lock then, and a thread that asks for it while the interpreter finishes ends inside a C++ frame,
# "terminate called without an active exception", the rank aborted after its run was written (4 runs in 53 of the
# test's under load; holding only the last 4 tensors, 1 in 122: an older one of the step was in the chain). Held
# here, the worker's drop needs no lock.
_HELD: list[torch.Tensor] = []


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> None:
    """``dist.all_reduce`` of ``t`` in place, ``t`` held (``_HELD``)."""
    _HELD.append(t)
    _dist().all_reduce(t, op=op, group=group)


def _all_gather_object(obj: Any, world: int, group: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, as ``dist.all_gather_object`` gathers them (pickled bytes on the
    device torch's object collectives use, their sizes gathered first; one host read of the sizes), with the
    tensors the collectives were given held (``_HELD``: torch's own made them inside and let them go at
    once)."""
    dist = _dist()
    device = _compat.object_collective_device(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    counts = torch.cat(sizes).tolist()
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(world)]
    _HELD.extend([size, *sizes, padded, *out])
    dist.all_gather(out, padded, group=group)
    return [pickle.loads(t.cpu().numpy().tobytes()[:n]) for t, n in zip(out, counts, strict=True)]


def is_distributed() -> bool:
    """True under an initialised process group of more than one rank."""
    dist = _dist()
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def wrapper_info(model: nn.Module) -> dict[str, Any]:
    """How ``model`` is parallelised: DDP, FSDP1, FSDP2 (``fully_shard``) or none, with its precision settings.

    Keys: ``wrapper`` ("DDP" | "FSDP1" | "FSDP2" | "none"), ``sharding`` (what each rank holds),
    ``param_dtype`` (dtype of the parameters the forward computes with), ``reduce_dtype`` (dtype gradients are
    communicated in), plus wrapper-specific details. Pure inspection, no collective.
    """
    from torch.nn.parallel import DistributedDataParallel

    storage = sorted({_dtype_name(p.dtype) or "" for p in model.parameters()})
    if isinstance(model, DistributedDataParallel):
        mp = getattr(model, "mixed_precision", None)
        hooks = [getattr(h, "__name__", type(h).__name__) for h, _ in getattr(model, "_comm_hooks", [])]
        reduce_dtype = _dtype_name(getattr(mp, "reduce_dtype", None)) if mp is not None else None
        for name, dt in (("fp16_compress", "float16"), ("bf16_compress", "bfloat16")):
            if any(name in h for h in hooks):
                reduce_dtype = dt
        param_dtype = _dtype_name(getattr(mp, "param_dtype", None)) if mp is not None else None
        return {
            "wrapper": "DDP",
            "sharding": "replicated (every rank holds every parameter)",
            "param_dtype": param_dtype or "|".join(storage),
            "reduce_dtype": reduce_dtype or "|".join(storage),
            "storage_dtypes": storage,
            "comm_hooks": hooks,
            "gradient_as_bucket_view": bool(getattr(model, "gradient_as_bucket_view", False)),
            # DDP's flat gradient buckets, as large as the gradients: one more copy of them beside the .grad
            # tensors unless gradient_as_bucket_view=True makes the gradients views into them
            "bucket_bytes": _compat.ddp_bucket_bytes(model),
        }

    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    fsdp1 = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    if fsdp1:
        root = fsdp1[0]
        mp = getattr(root, "mixed_precision", None)
        strategy = getattr(root, "sharding_strategy", None)
        return {
            "wrapper": "FSDP1",
            "sharding": getattr(strategy, "name", str(strategy)),
            "param_dtype": _dtype_name(getattr(mp, "param_dtype", None)) or "|".join(storage),
            "reduce_dtype": _dtype_name(getattr(mp, "reduce_dtype", None))
            or _dtype_name(getattr(mp, "param_dtype", None))
            or "|".join(storage),
            "buffer_dtype": _dtype_name(getattr(mp, "buffer_dtype", None)),
            "storage_dtypes": storage,
            "units": len(fsdp1),
            "use_orig_params": _compat.fsdp_root_uses_orig_params(root),
        }

    fsdp2 = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if fsdp2:
        policies: list[dict[str, Any]] = []
        reshard: set[str] = set()
        for m in fsdp2:
            pol, group = _compat.fsdp2_policy(m)
            desc = {
                "param_dtype": _dtype_name(getattr(pol, "param_dtype", None)),
                "reduce_dtype": _dtype_name(getattr(pol, "reduce_dtype", None)),
                "output_dtype": _dtype_name(getattr(pol, "output_dtype", None)),
            }
            if desc not in policies:
                policies.append(desc)
            if group is not None:
                post = getattr(group, "post_forward_mesh_info", None)
                reshard.add("after forward" if post is not None else "kept unsharded after forward")
        root_pol = policies[0] if policies else {}
        param_dtype = root_pol.get("param_dtype") or "|".join(storage)
        return {
            "wrapper": "FSDP2",
            "sharding": "fully_shard (parameters sharded as DTensor over the data-parallel mesh)",
            "param_dtype": param_dtype,
            # FSDP2 reduces in param_dtype unless reduce_dtype is set
            "reduce_dtype": root_pol.get("reduce_dtype") or param_dtype,
            "output_dtype": root_pol.get("output_dtype"),
            "storage_dtypes": storage,
            "units": len(fsdp2),
            "policies": policies,
            "reshard": sorted(reshard),
        }
    sharding = "none (the model is not wrapped; each rank trains its own copy)"
    if (
        is_distributed()
    ):  # a wrapper the Profiler was not given (a callback handed the unwrapped model) is not seen
        sharding = (
            "not known: the Profiler holds the module itself and no wrapper around it (a DDP or FSDP1 wrapper "
            "made by a trainer is not visible: with the Hugging Face Trainer, profile_trainer(trainer) describes it)"
        )
    return {
        "wrapper": "none",
        "sharding": sharding,
        "param_dtype": "|".join(storage),
        "reduce_dtype": None,
        "storage_dtypes": storage,
    }


def _row_layout(model: nn.Module, modules: Sequence[str]) -> list[tuple[str, str, str]]:
    """(module, tensor, param) of each Profiler buffer row, rebuilt from the captured module names in order.

    Mirrors ``Profiler._attach``: per captured module an activation and an activation_grad row, its input's row
    when it has one (a matmul layer whose input no captured module made: ``T.input_module(name)`` is then among
    ``modules``),
    then per own parameter (first owner only) a weight row and, when it can have a gradient, a weight_grad row.
    """
    rows: list[tuple[str, str, str]] = []
    seen: set[int] = set()
    names = set(modules)
    for name in modules:
        if name.endswith(T.INPUT_SUFFIX):
            continue
        try:
            module = model.get_submodule(name)
        except AttributeError:
            return []
        rows.append((name, T.ACTIVATION, ""))
        rows.append((name, T.ACTIVATION_GRAD, ""))
        if T.input_module(name) in names:
            rows.append((T.input_module(name), T.ACTIVATION, ""))
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            rows.append((name, T.WEIGHT, pname))
            if can_have_grad(p):
                rows.append((name, T.WEIGHT_GRAD, pname))
    return rows


class RankReducer:
    """The Profiler's reducer under torch.distributed: sums counts, reduces extrema, keeps per-rank nan/inf.

    Every method but ``describe`` is a collective: all ranks of ``group`` call it in the same order (the
    Profiler does so on sampled steps). ``describe`` is local (only the writer calls it, from ``save``).

    Args:
        group: the process group (None: the default group).
        wrapped: the wrapped model to describe (DDP/FSDP) when the Profiler watches the inner module (as the
            Hugging Face and Lightning callbacks do); None: describe the Profiler's own model.
        joinables: the training loop's objects a ``Join`` may hold besides ``wrapped`` (the Profiler's model and
            optimizers): once one is in a join context, nothing is reduced (uneven inputs, above).
    """

    def __init__(
        self, group: Any = None, wrapped: nn.Module | None = None, joinables: Sequence[Any] = ()
    ) -> None:
        dist = _dist()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("RankReducer needs an initialised torch.distributed process group")
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        self.backend: str = str(dist.get_backend(group))
        self.wrapped = wrapped
        self._joinables = [o for o in (wrapped, *joinables) if o is not None]
        self._samples = 0  # sampled steps so far
        self._local_samples = 0  # of which each rank kept its own statistics
        # sampled steps the run's earlier attempts reduced (a run resumed from its checkpoint: the sampled steps
        # it keeps from before the restart, set by the writer when it opens its stream)
        self.earlier_samples = 0
        self._local_nonfinite: torch.Tensor | None = None
        self._local_only = False
        self._local_only_reason: str | None = None
        self._events: list[dict[str, Any]] = []
        self._events_dropped = 0
        self._rank_totals: dict[int, dict[str, int]] = {}
        self._row_names: list[tuple[str, str, str]] | None = None
        self._order_names: list[str] = []
        self._memory_by_rank: dict[int, dict[str, int]] = {}
        self._memory_step: int | None = None

    # ------------------------------------------------------------------------------------ protocol
    @property
    def is_writer(self) -> bool:
        """Rank 0 writes the run directory and the report."""
        return self.rank == 0

    def local_only(self, reason: str) -> None:
        """From now on reduce nothing across ranks (e.g. saving at interpreter exit, when the other ranks may be
        gone): each method returns this rank's own values, and ``describe`` says why."""
        self._local_only = True
        self._local_only_reason = f"rank {self.rank}: {reason}"

    def _unwinding(self) -> bool:
        """True while an exception propagates (the Profiler's ``__exit__``) or after ``local_only``.

        A collective then could wait forever for ranks that never reach it, so this rank's own values are used.
        """
        if self._local_only:
            return True
        if any(_compat.join_enabled(o) for o in self._joinables):
            self.local_only(
                "the training loop runs in a join context for uneven inputs (DDP's model.join()): a rank that "
                "has run out of batches runs only the collectives its join hooks shadow, which precprof's cannot "
                "match, so from the first sampled step in it every rank kept its own statistics"
            )
            return True
        exc = sys.exc_info()[1]
        if exc is None:
            return False
        self._local_only_reason = (
            f"rank {self.rank} stopped with {type(exc).__name__}: its last step holds only its own statistics "
            "(no collective while an exception propagates)"
        )
        return True

    def reduce_rows(self, data: torch.Tensor) -> torch.Tensor:
        """Combine the ``[rows, ROW_WIDTH]`` int64 statistics buffer of every rank; returns a new tensor.

        Counts and histogram columns are summed; absmax bits reduced with MAX, absmin bits with MIN (fp64 bit
        patterns of non-negative numbers order like the values). Device-side collectives; the rank-local
        nan/inf columns are kept (on the device) for ``reduce_meta``.
        """
        self._samples += 1
        _HELD.clear()  # (the collectives of the sampled step before: long done)
        self._local_nonfinite = data[:, st.COL_NAN : st.COL_INF + 1].clone()
        if self._unwinding():
            self._local_samples += 1
            return data.clone()
        dist = _dist()
        out = data.clone()
        # the layout's merge rule (stats.merge_rows) as collectives: SUM for counts and histograms, MAX and MIN
        # for the extrema, both in one MAX all-reduce (min(x) = -max(-x); the sentinel 2^63-1 negates safely)
        ops = st.LAYOUT.merge_ops
        mx = np.flatnonzero(ops == st.MERGE_MAX).tolist()
        mn = np.flatnonzero(ops == st.MERGE_MIN).tolist()
        extrema = torch.cat([data[:, mx], data[:, mn].neg()], dim=1)
        out[:, mx + mn] = 0  # summing bit patterns would overflow int64
        _all_reduce(out, dist.ReduceOp.SUM, self.group)
        _all_reduce(extrema, dist.ReduceOp.MAX, self.group)
        out[:, mx] = extrema[:, : len(mx)]
        out[:, mn] = extrema[:, len(mx) :].neg()
        return out

    def reduce_meta(
        self, rows_meta: Sequence[Mapping[str, Any]], order: Mapping[str, int], step: int | None = None
    ) -> dict[str, Any]:
        """Combine the host-side row descriptions of every rank (one ``all_gather_object``).

        ``rows_meta``: per buffer row ``{"calls": int, "dtypes": [str]}`` (optionally ``module``, ``tensor``,
        ``param``); ``order``: forward order per captured module (-1: not run). Returns ``{"rows": [...],
        "order": {...}}``: calls summed over ranks, dtypes unioned (first seen first), order the earliest a rank
        saw; each row also carries ``nan_ranks`` / ``inf_ranks``, the ranks whose own tensors held nan / inf.
        Syncs (host copy of the rank's nan/inf columns).
        """
        local_nf: dict[int, tuple[int, int]] = {}
        if self._local_nonfinite is not None:
            nf = self._local_nonfinite.cpu().tolist()
            local_nf = {i: (int(nan), int(inf)) for i, (nan, inf) in enumerate(nf) if nan or inf}
            self._local_nonfinite = None
        mine = {"rows": [dict(m) for m in rows_meta], "order": dict(order), "nonfinite": local_nf}
        if self._unwinding():
            gathered: list[Any] = [None] * self.world_size
            gathered[self.rank] = mine
        else:
            gathered = _all_gather_object(mine, self.world_size, self.group)
        present = [(r, g) for r, g in enumerate(gathered) if g is not None]

        rows: list[dict[str, Any]] = []
        for i, m in enumerate(rows_meta):
            calls = common = 0
            dtypes: list[str] = []
            for _, g in present:
                gm = g["rows"][i]
                calls += int(gm["calls"])
                common = math.gcd(common, int(gm.get("numel_gcd", 0)))
                for d in gm["dtypes"]:
                    if d not in dtypes:
                        dtypes.append(d)
            rec: dict[str, Any] = {**m, "calls": calls, "dtypes": dtypes, "numel_gcd": common}
            skips = [(int(g["rows"][i].get("skipped", 0)), g["rows"][i].get("why", "")) for _, g in present]
            if any(n for n, _ in skips):
                rec["skipped"] = sum(n for n, _ in skips)
                rec["why"] = next(w for n, w in skips if n)
            rec["nan_ranks"] = [r for r, g in present if g["nonfinite"].get(i, (0, 0))[0] > 0]
            rec["inf_ranks"] = [r for r, g in present if g["nonfinite"].get(i, (0, 0))[1] > 0]
            rows.append(rec)

        merged_order: dict[str, int] = {}
        for name in order:
            seen = [int(g["order"].get(name, -1)) for _, g in present]
            valid = [o for o in seen if o >= 0]
            merged_order[name] = min(valid) if valid else -1
        self._order_names = list(order)
        if rows_meta and all("module" in m for m in rows_meta):
            self._row_names = [
                (str(m["module"]), str(m["tensor"]), str(m.get("param", ""))) for m in rows_meta
            ]

        for r, g in present:
            tot = self._rank_totals.setdefault(r, {"nan": 0, "inf": 0, "sampled_steps_with_nonfinite": 0})
            if g["nonfinite"]:
                tot["sampled_steps_with_nonfinite"] += 1
            for nan, inf in g["nonfinite"].values():
                tot["nan"] += nan
                tot["inf"] += inf
        for i in sorted({i for _, g in present for i in g["nonfinite"]}):
            if len(self._events) >= _MAX_EVENTS:
                self._events_dropped += 1
                continue
            self._events.append(
                {
                    "sampled_step_index": self._samples - 1,
                    "step": step,
                    "row": i,
                    "by_rank": {
                        str(r): {"nan": g["nonfinite"][i][0], "inf": g["nonfinite"][i][1]}
                        for r, g in present
                        if i in g["nonfinite"]
                    },
                }
            )
        return {"rows": rows, "order": merged_order}

    def reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over ranks (a new tensor; ``t`` is untouched). Device-side collective."""
        out = t.clone()
        if not self._unwinding():
            _all_reduce(out, _dist().ReduceOp.SUM, self.group)
        return out

    def reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Maximum of ``t`` over ranks (a new tensor). Device-side collective."""
        out = t.clone()
        if not self._unwinding():
            _all_reduce(out, _dist().ReduceOp.MAX, self.group)
        return out

    def reduce_memory(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Rank 0's memory rows stay the table; every rank's per-component totals go to the summary.

        Collective (``all_gather_object`` of a small dict). Returns ``rows`` unchanged.
        """
        totals: dict[str, int] = {}
        step = None
        for r in rows:
            comp = str(r.get(T.COMPONENT, ""))
            b = int(r.get(T.BYTES, 0) or 0)
            step = r.get(T.STEP, step)
            if r.get(T.MOMENT, ""):  # the parts of the allocator's peak: the components again, by moment
                continue
            if comp in T.MEMORY_PEAK_COMPONENTS:
                totals[comp] = max(totals.get(comp, 0), b)
            else:
                totals[comp] = totals.get(comp, 0) + b
        if self._unwinding():  # one rank's totals are not the ranks': those of the last step reduced stay
            return [dict(r) for r in rows]
        gathered = _all_gather_object(totals, self.world_size, self.group)
        if any(gathered):  # a step that measured memory (every rank measures the same steps): the last one's
            self._memory_by_rank = {r: g for r, g in enumerate(gathered) if g is not None}
            self._memory_step = int(step) if step is not None else None
        return [dict(r) for r in rows]

    # ------------------------------------------------------------------------------------ description
    def _name_events(self, model: nn.Module | None) -> list[dict[str, Any]]:
        names = self._row_names
        if names is None and model is not None and self._order_names:
            names = _row_layout(model, self._order_names) or None
        out = []
        for ev in self._events:
            e = dict(ev)
            if names is not None and ev["row"] < len(names):
                e["module"], e["tensor"], e["param"] = names[ev["row"]]
            out.append(e)
        return out

    def memory_max_over_ranks(self) -> dict[str, int]:
        """Per component, the largest total any rank reported on the last sampled step (empty before it)."""
        out: dict[str, int] = {}
        for totals in self._memory_by_rank.values():
            for comp, b in totals.items():
                out[comp] = max(out.get(comp, 0), b)
        return out

    def describe(self, model: nn.Module | None = None) -> dict[str, Any]:
        """The ``capture.distributed`` block of summary.json. Local (no collective): only the writer calls it."""
        info: dict[str, Any] = {
            "world_size": self.world_size,
            "backend": self.backend,
            "writer_rank": 0,
            "sampled_steps_reduced": self.earlier_samples + self._samples - self._local_samples,
        }
        if self._local_samples:
            info["sampled_steps_local"] = self._local_samples
        target = self.wrapped if self.wrapped is not None else model
        if target is not None:
            info.update(wrapper_info(target))
        wrapper = info.get("wrapper")
        info["semantics"] = {
            "counts": "summed over ranks; absmax: max over ranks; absmin: min over ranks",
            "activations": "every rank's local micro-batch (the global batch)",
            "activation_gradients": (
                "every rank's, of its own local loss: world_size times those of one process's mean loss over the "
                "global batch (log2(world_size) binades higher), as the ranks compute them"
            ),
            "weight_gradients": (
                "each rank's reduce-scattered shard, as the optimizer gets it"
                if wrapper == "FSDP2"
                else "each rank's reduce-scattered shard, as the optimizer gets it, read in its step pre-hook (none "
                "under a loss scaler, which unscales them first: skipped_tensors lists them)"
                if wrapper == "FSDP1" and info.get("use_orig_params")
                else "each rank's local gradient before the reduction (FSDP1: unsharded, before its reduce-scatter)"
                if wrapper == "FSDP1"
                else "each rank's local gradient, read before DDP's all-reduce (numel = world_size x parameter size)"
            ),
            "weights": (weights := _weights_said(wrapper, str(info.get("sharding") or ""))),
            "fp8_current_scaling": _SHARD_SCALING if weights != _REPLICAS else "each call at its own amax",
            "steps": "rank 0's: loss, loss scale, skipped, grad norm and time as rank 0 saw them",
            "memory": "rank 0's table; memory_by_rank has every rank's totals of the last sampled step",
        }
        if self._local_samples:
            info["semantics"] = _rank_local(
                info["semantics"], self._local_samples, info["sampled_steps_reduced"]
            )
        ranks_nonfinite = sorted(r for r, t in self._rank_totals.items() if t["nan"] or t["inf"])
        info["ranks_with_nonfinite"] = ranks_nonfinite
        info["nonfinite_by_rank"] = {str(r): t for r, t in sorted(self._rank_totals.items())}
        info["nonfinite_events"] = self._name_events(model)
        if self._events_dropped:
            info["nonfinite_events_dropped"] = self._events_dropped
        if self._memory_by_rank:
            info["memory_step"] = self._memory_step
            info["memory_by_rank"] = {str(r): t for r, t in sorted(self._memory_by_rank.items())}
            info["memory_max_over_ranks"] = self.memory_max_over_ranks()
        if self._local_only_reason:
            info["local_only"] = self._local_only_reason
        return info


_REPLICAS = "every rank's replica (numel = world_size x parameter size; fractions are a replica's)"
_SHARD_SCALING = (  # the histogram cannot recount a shard at the whole tensor's amax (exact powers of two)
    "weights: each rank's shard at its own amax, not the whole tensor's (a tensorwise FP8 recipe's under FSDP), "
    "then summed: a shard of small values flushes fewer (the advisor bounds the whole tensor's from the histogram); "
    "block what-ifs: blocks within each shard (a column block crossing a shard boundary is two); others: per call"
)


def _weights_said(wrapper: Any, sharding: str) -> str:
    """What a weight row holds under ``wrapper``: FSDP's stored shards (FSDP1's FlatParameter shards too, read
    from ``_local_shard`` while the forward has the whole parameter gathered, its padding left out), every
    rank's replica under DDP and FSDP1's ``NO_SHARD``, each shard group's shards under hybrid sharding."""
    if wrapper not in ("FSDP1", "FSDP2") or (wrapper == "FSDP1" and sharding == "NO_SHARD"):
        return _REPLICAS
    shards = "rank-local shards of the stored parameters (their storage dtype, not the param_dtype copies gathered "
    if wrapper == "FSDP1" and "HYBRID" in sharding:
        return shards + (
            "for the forward); the shards of each shard group sum to the full parameters (numel = the number of "
            "shard groups x parameter size)"
        )
    return shards + "for the forward), summing to the full parameters"


def _rank_local(semantics: dict[str, str], local: int, reduced: int) -> dict[str, str]:
    """``semantics`` of a run some of whose sampled steps (``local``) each rank kept its own (``local_only``): those
    rows are the writer's, rank 0's alone."""
    out = dict(semantics)
    if reduced:
        out["counts"] += f"; on the last {local} sampled step(s) rank 0's alone (rank-local statistics)"
        return out
    out["counts"] = "rank 0's alone: no sampled step was combined over the ranks (rank-local statistics)"
    out["activations"] = "rank 0's local micro-batch"
    out["activation_gradients"] = "rank 0's, of its own local loss"
    out["weights"] = "rank 0's " + ("shards" if out["weights"].startswith("rank-local shards") else "replica")
    out["weight_gradients"] = "rank 0's alone: " + out["weight_gradients"].split(" (numel")[0].replace(
        "each rank's", "its"
    )
    out["memory"] = "rank 0's table"
    return out


def mean_over_ranks(reducer: Any, device: torch.device) -> Callable[[float | None], float | None]:
    """A function of one rank's number (None: it has none) that returns the mean over the ranks that have one
    (None where no rank has): a collective, so that every rank decides alike (the block budget's deal)."""

    def mean(value: float | None) -> float | None:
        t = torch.tensor([value or 0.0, value is not None], dtype=torch.float64, device=device)
        total, n = reducer.reduce_sum(t).cpu().tolist()
        return total / n if n else None

    return mean
