"""Weight-update samples: what the optimizer meant to change in a strided sample of each parameter, what
landed, and how much a weight held in bf16 or fp16 loses.

On a sampled step the samples (and their gradients) are read before ``optimizer.step()`` (its pre-hook) and
the samples again after it (its post-hook), all parameters in one concatenated fp32 tensor. An element's
update was *intended* when its gradient is nonzero or its weight moved (weight decay, momentum); it *landed*
when the weight moved. Per sampled element, without a sync:

- no update: nothing intended and nothing moved (the ``zeros`` column);
- lost in bf16: an update that landed in an fp32 weight but would round away in bf16 (the weight held in
  bf16, plus the same delta, rounds back to itself), or an intended update that did not land at all: in a
  ``bf16-pure`` run that is the update bf16 really lost (a lost update arrives as a zero delta, so counting
  zero deltas as "no update" would hide every one of them);
- lost in fp16: the same for fp16 (an intended update that did not land in a bf16 weight says nothing about
  fp16, which is finer, so it counts only for fp32 and fp16 weights);
- lost in the weight as held: an intended update that did not land, in the parameter's own dtype (measured,
  where the two above are what-ifs for an fp32 weight: an fp32 run whose updates fall below half an fp32 ulp).

The counts go into a small int64 buffer per device, summed per parameter from a running sum. The gradient is a lower bound of intent: an
element with a zero gradient whose momentum update did not land is not seen. Beside the counts, the updates'
size (``capture/update_sizes.py``): the sums of the squared updates and weights, the largest and smallest
nonzero |update|, in a float64 buffer per device.

Where the C statistics kernel (CPU) or the Triton engine (CUDA) is in use, the samples are read in place by
the parameters' addresses (``capture/update_readers.py``: the same arithmetic in one call or launch in each
optimizer hook); the torch ops above cost a sampled step of many small parameters about 2 us per parameter on
the CPU, and GPT-2 small's 148 parameters 245 ops on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from precprof import _compat
from precprof import tables as T
from precprof.capture import update_carry, update_readers, update_sizes, update_steps
from precprof.capture.records import _local, _ParamSlot, sample_stride
from precprof.capture.storage import dtype_name
from precprof.stats.buffer import unreadable

_PLAIN, _PLAIN_SET = update_readers._PLAIN, update_readers._PLAIN_SET


def _sampled_in_place(t: torch.Tensor) -> bool:
    """Whether a parameter's values can be sampled: real floating point, in a storage of its own (this rank's
    shard of a DTensor; not a wrapper subclass such as torchao's NF4 weights, nor a complex parameter)."""
    local = t if type(t) in _PLAIN_SET else _local(t.detach())
    return not local.is_complex() and (type(local) in _PLAIN_SET or not hasattr(local, "__tensor_flatten__"))


class _DeviceGroup:
    """The tracked parameters of one device and one dtype, sampled together: one ``torch.cat`` never mixes
    devices (a CPU-offloaded layer beside CUDA ones is sampled on the CPU), and whether the weights are held
    in bf16 is one flag for the group. Persistent memory: the counts and sizes, one index per parameter and one
    per sampled element (``update_sizes.padded_slots``)."""

    def __init__(self, device: torch.device, held_bf16: bool, members: list[_ParamSlot]) -> None:
        self.device = device
        self.held_bf16 = held_bf16
        self.members = members
        lens = torch.tensor([ps.sample_len for ps in members], dtype=torch.int64)
        # columns: sampled elements, zero updates, lost in bf16, lost in fp16, lost in the weight as held
        self.counts = torch.zeros((len(members), 5), dtype=torch.int64, device=device)
        self.sizes = update_sizes.empty(len(members), device)  # the updates' sizes (update_sizes)
        # made here, as lens and ends are: a copy to the device in the optimizer's hooks would wait for it
        self._slots = update_sizes.padded_slots([ps.sample_len for ps in members], device)
        self.lens = lens.to(device)
        self.ends = (lens.cumsum(0) - 1).to(device)  # each member's last sampled element
        self.before: torch.Tensor | None = None
        self.intended: torch.Tensor | None = None
        # each plain member's strided sample as a view of its parameter, made once: (data pointer, view); a
        # parameter whose storage was replaced (``p.data = ...``) gets a new one, a DTensor's shard is read anew
        self._views: list[tuple[int, torch.Tensor] | None] = [None] * len(members)
        # every member's view, while the members are plain contiguous tensors on the same memory: (their data
        # pointers, the views), read with one C-level map per step instead of a Python call per member
        self._all_views: tuple[list[int], list[torch.Tensor]] | None = None
        self._engine = update_readers.engine(device, members)
        # the in-place reader (``update_readers``): the C kernel's, or the Triton kernels' once loaded; None: torch
        self._reader = update_readers.reader(device, members, self._engine)
        self._reader_read = False  # this step's samples were read by ``_reader``

    @property
    def nbytes(self) -> int:
        held = (self.counts, self.sizes, self.lens, self.ends, self._slots[0])
        return sum(t.numel() * t.element_size() for t in held)

    def _sample_view(self, i: int, ps: _ParamSlot) -> torch.Tensor:
        t = ps.tensor
        if type(t) not in _PLAIN or not t.is_contiguous():  # (a non-contiguous one's reshape is a copy)
            return _local(t.detach()).reshape(-1)[:: ps.sample_stride][: ps.sample_len]
        ptr = t.data_ptr()
        held = self._views[i]
        if held is None or held[0] != ptr:
            held = self._views[i] = (ptr, t.detach().reshape(-1)[:: ps.sample_stride][: ps.sample_len])
        return held[1]

    def _member_views(self) -> list[torch.Tensor]:
        tensors = [ps.tensor for ps in self.members]
        held = self._all_views
        if held is not None:
            try:
                if list(map(torch.Tensor.data_ptr, tensors)) == held[0]:
                    return held[1]
            except (RuntimeError, TypeError):  # a wrapper without storage of its own
                pass
        views = [self._sample_view(i, ps) for i, ps in enumerate(self.members)]
        plain = all(type(t) in _PLAIN and t.is_contiguous() for t in tensors)
        self._all_views = (list(map(torch.Tensor.data_ptr, tensors)), views) if plain else None
        return views

    def samples(self) -> torch.Tensor:
        """The members' samples, now, in fp32: one concatenation of views, and one cast when the members share a
        dtype (a group is one device and one bf16-or-not flag: fp32 and fp16 members may sit together)."""
        views = self._member_views()
        return (
            torch.cat(views).float()
            if len({v.dtype for v in views}) == 1
            else torch.cat([v.float() for v in views])
        )

    @torch.no_grad()
    def grad_nonzero(self) -> torch.Tensor:
        """Per sampled element, whether its gradient is nonzero (False where a parameter has no gradient, or a
        sparse one, ``nn.Embedding(sparse=True)``'s, whose sample would need the gradient made dense): the
        gradients' strided samples as views, one concatenation and one compare (gradients are new tensors each
        step under ``zero_grad(set_to_none=True)``: no view of them is kept)."""
        parts = []
        for ps in self.members:
            g = ps.tensor.grad
            if g is None or g.layout is not torch.strided:  # a sparse gradient: no intent read from it
                parts.append(torch.zeros(ps.sample_len, dtype=ps.tensor.dtype, device=self.device))
                continue
            if type(g) not in _PLAIN:
                g = _local(g)
            if g.device != self.device:  # a gradient kept on another device: a copy of its sample
                g = g.reshape(-1)[:: ps.sample_stride][: ps.sample_len].to(self.device)
            elif g.is_contiguous():  # one view op: the sample's elements are every sample_stride-th one
                g = g.as_strided((ps.sample_len,), (ps.sample_stride,), g.storage_offset())
            else:
                g = g.reshape(-1)[:: ps.sample_stride][: ps.sample_len]
            parts.append(g)
        return torch.cat(parts) != 0

    def read_before(self, idle: set[int] | frozenset[int] = frozenset()) -> None:
        """The samples and the gradients' intent, before the optimizer step: by the in-place reader when it can
        read every member in place, by torch ops else. The members in ``idle`` (ids: their group's learning
        rate is 0 this step, the first step of a warmup from 0) intend nothing: no update is lost."""
        tensors = [ps.tensor for ps in self.members]
        if self._reader is None and self._engine == "triton":  # its kernels loaded since (else None again)
            self._reader = update_readers.reader(self.device, self.members, self._engine)
        self._reader_read = self._reader is not None and self._reader.read_before(tensors)
        if self._reader_read:
            self.before = self.intended = None
        else:
            self.before, self.intended = self.samples(), self.grad_nonzero()
        self._idle(idle)

    @torch.no_grad()
    def read_intent(self, idle: set[int] | frozenset[int] = frozenset()) -> None:
        """The gradients' intent read again, the samples kept: a closure's step (``optimizer.step(closure)``)
        has its gradients only once the closure ran, and may move the weights before it (SAM perturbs them),
        so the samples are those of its pre-hook and the intent this."""
        nonzero = self.grad_nonzero()
        if self._reader_read:
            self._reader.set_intent(nonzero)
        elif self.before is not None:
            self.intended = nonzero
        self._idle(idle)

    def _idle(self, idle: set[int] | frozenset[int]) -> None:
        """No intent for the members in ``idle``."""
        if not idle:
            return
        at = 0
        for ps in self.members:
            if id(ps.tensor) in idle:
                if self._reader_read:
                    self._reader.intended[at : at + ps.sample_len] = 0
                elif self.intended is not None:
                    self.intended[at : at + ps.sample_len] = False
            at += ps.sample_len

    @torch.no_grad()
    def classify(self) -> bool:
        if self._reader_read:
            self._reader_read = False
            tensors = [ps.tensor for ps in self.members]
            if self._reader.classify(tensors, self.counts, self.sizes, self.held_bf16):
                return True
            # a member can no longer be read in place (its storage replaced during the step): torch ops
            self.before, self.intended = self._reader.held()
        before, self.before = self.before, None
        intended, self.intended = self.intended, None
        if before is None or intended is None:
            return False
        delta = self.samples() - before
        nonzero = delta != 0
        stuck = intended & ~nonzero  # meant to move, did not
        # one row per column (a scan along rows: a [n, 3] tensor's scan along dim 0 ran as three threads on CUDA,
        # 5 ms of an H200's time for gpt2-small's samples)
        flags = torch.empty((4, len(before)), dtype=torch.int64, device=before.device)
        flags[0] = ~(nonzero | intended)
        for col, dtype in ((1, torch.bfloat16), (2, torch.float16)):
            held = before.to(dtype)
            landed_but_lost = ((held.float() + delta).to(dtype) == held) & nonzero
            # a stuck update in a bf16 weight says nothing of fp16, which is finer
            counts_stuck = dtype == torch.bfloat16 or not self.held_bf16
            flags[col] = (landed_but_lost | stuck) if counts_stuck else landed_but_lost
        flags[3] = stuck
        # per member: sums over its segment of samples, from the running sum at each segment's end
        at_end = flags.cumsum(1)[:, self.ends].t()
        at_end[1:] -= at_end[:-1].clone()
        self.counts[:, 0] += self.lens
        self.counts[:, 1:] += at_end
        update_sizes.add(self.sizes, *self._slots, before, delta)
        return True


def held_by(optimizers: Sequence[Any], params: Sequence[_ParamSlot]) -> tuple[list[_ParamSlot], list[int]]:
    """The parameters of ``params`` (the plan's) that one of ``optimizers`` holds now, and the index of the
    one whose step moves each: a parameter no optimizer given holds moves in no step precprof sees."""
    held = {id(p): k for k, o in enumerate(optimizers) for g in o.param_groups for p in g["params"]}
    tracked = [ps for ps in params if ps.grad_row >= 0 and id(ps.tensor) in held]
    return tracked, [held[id(ps.tensor)] for ps in tracked]


def groups_key(optimizers: Sequence[Any]) -> tuple[tuple[int, int], ...]:
    """What changes when the optimizers' parameters do, read without a walk over them: each param group's list
    of parameters, by object and length (``add_param_group`` adds a group)."""
    return tuple((id(g["params"]), len(g["params"])) for o in optimizers for g in o.param_groups)


class UpdateSampler:
    """Samples ``per_param`` elements (strided) of each parameter in ``tracked``.

    Parameters are sampled on the device they live on at the optimizer step, in one group per device (the
    model may move after ``attach()``, or keep a layer offloaded to the CPU); a parameter on the ``meta``
    device has no data, and a complex one or a wrapper subclass no values the sample reads: they are not
    sampled, and each of their optimizer's sampled steps is counted in ``skipped``, with why (the report lists
    them beside the other tensors precprof could not read). ``device`` is where :meth:`combined` gathers the
    counts.
    """

    def __init__(
        self, tracked: list[_ParamSlot], per_param: int, device: torch.device, owners: Sequence[int] = ()
    ) -> None:
        self.per_param = per_param
        self.device = device
        # (the plan's parameters, the optimizers, their ``groups_key``) for ``following``'s sampler
        self._follow: tuple[Sequence[_ParamSlot], Sequence[Any], tuple[tuple[int, int], ...]] | None = None
        self.tracked: list[_ParamSlot] = []
        self._counted = False  # an optimizer's step of this sampled step has added to the counts
        # (module, param) -> [sampled optimizer steps whose update of it was not sampled, why]: over the run
        self.skipped: dict[tuple[str, str], list[Any]] = {}
        self.carry = update_carry.CarryProbe()  # whether the optimizers carry what a weight could not take
        self._track(tracked, owners)

    @classmethod
    def following(
        cls, params: Sequence[_ParamSlot], optimizers: Sequence[Any], per_param: int, device: torch.device
    ) -> UpdateSampler:
        """A sampler of the parameters of ``params`` that ``optimizers`` hold, now and as their param groups
        change (``reset``)."""
        tracked, owners = held_by(optimizers, params)
        sampler = cls(tracked, per_param, device, owners)
        sampler._follow = (params, optimizers, groups_key(optimizers))
        return sampler

    def _track(self, tracked: list[_ParamSlot], owners: Sequence[int]) -> None:
        """Sample ``tracked`` from now on, each in the step of its optimizer in ``owners`` (indices)."""
        for ps in self.tracked:
            ps.update_index = -1
        for i, ps in enumerate(tracked):
            # (FSDP1's padding at the end of a rank's shard is left out: it is never updated)
            local = _local(ps.tensor.detach())
            n = local.numel() - _compat.shard_padding(ps.tensor)
            row = n // local.shape[0] if local.dim() > 1 and local.shape[0] > 0 else 1  # (dim 0: its rows)
            ps.sample_stride = sample_stride(n, self.per_param, row)
            ps.sample_len = len(range(0, n, ps.sample_stride))
            ps.update_index = i
        self.tracked = tracked
        # the optimizer (an index) whose step moves each tracked parameter: its groups are read in its hooks
        self._owners = list(owners) or [0] * len(tracked)
        self._steps = update_steps.OptimizerSteps([ps.tensor for ps in tracked], self._owners)
        self._lr_idle: dict[
            int, set[int]
        ] = {}  # per optimizer in its step: its parameters at a learning rate of 0
        self._group_owner: list[int] = []
        self._update_idx = np.array([ps.update_index for ps in tracked], dtype=np.int64)
        # the last named columns of ``columns``: (kept, order, module types, dtypes, columns)
        self._named: tuple[np.ndarray, Any, Any, list[torch.dtype], dict[str, Any]] | None = None
        self._placement: tuple[torch.device, ...] | None = None
        self._groups: list[_DeviceGroup] = []
        self._regroup()

    def _regroup(self) -> None:
        """One group per device and dtype the tracked parameters are on now (rebuilt only when one moved)."""
        tensors = [ps.tensor for ps in self.tracked]
        placement = tuple(t.device if type(t) in _PLAIN else _local(t.detach()).device for t in tensors)
        if placement == self._placement:
            return
        groups: dict[tuple[int, torch.device, bool], list[_ParamSlot]] = {}
        # the parameters whose values cannot be sampled (complex, a wrapper subclass, on ``meta``), each with
        # its optimizer and why: skipped and counted at each of its steps (``after_step``)
        self._unsampled: list[tuple[_ParamSlot, int, str]] = []
        for ps, dev, k in zip(self.tracked, placement, self._owners, strict=True):
            if dev.type != "meta" and ps.sample_len and _sampled_in_place(ps.tensor):
                groups.setdefault((k, dev, ps.tensor.dtype == torch.bfloat16), []).append(ps)
            elif ps.sample_len:
                why = unreadable(_local(ps.tensor.detach())) or "not readable"
                self._unsampled.append((ps, k, why))
        self._groups = [_DeviceGroup(dev, bf16, members) for (_, dev, bf16), members in groups.items()]
        self._group_owner = [k for k, _, _ in groups]
        self._placement = placement

    @property
    def nbytes(self) -> int:
        """Device bytes held for the whole run: the counts and the indexes of every sampled element."""
        return sum(g.nbytes for g in self._groups)

    @property
    def devices(self) -> list[torch.device]:
        return [g.device for g in self._groups]

    def reset(self) -> None:
        for g in self._groups:
            g.counts.zero_()
            update_sizes.reset(g.sizes)
        self._steps.reset()
        self._lr_idle.clear()
        self._counted = False

    def _follow_groups(self) -> None:
        """A ``following`` sampler samples the parameters its optimizers hold now, when their param groups
        changed (``add_param_group``: a new head, a layer unfrozen by adding its group; a few ids compared, no
        walk over the parameters). Only before the sampled step's first optimizer step: no count is lost."""
        follow = self._follow
        if follow is None or self._counted or groups_key(follow[1]) == follow[2]:
            return
        self._follow = (follow[0], follow[1], groups_key(follow[1]))
        self._track(*held_by(follow[1], follow[0]))

    def use(self, optimizers: Sequence[Any]) -> None:
        """Sample the parameters ``optimizers`` hold from now on, each in the step of the one that holds it (a new
        optimizer made mid-run: ``Profiler.use_optimizer``). The counts start again: in a sampled step in
        progress, an update the old optimizer already made is not counted, rather than counted under the new."""
        params = self._follow[0] if self._follow is not None else self.tracked
        self._follow = (params, optimizers, groups_key(optimizers))
        self._track(*held_by(optimizers, params))
        self._counted = False

    def before_step(self, k: int = 0, optimizer: Any = None) -> None:
        """Read the samples of optimizer ``k``'s parameters before its step (on each parameter's device; no
        sync)."""
        self._follow_groups()
        self._regroup()
        idle = self._lr_idle[k] = update_steps.idle_params(optimizer)
        for g, owner in zip(self._groups, self._group_owner, strict=True):
            if owner == k:
                g.read_before(idle)

    def intent_after_closure(self, k: int = 0, optimizer: Any = None) -> None:
        """Optimizer ``k``'s step was given a closure, which has run its backward: the intended updates read
        from the gradients it made (the samples stay those of ``before_step``)."""
        idle = update_steps.idle_params(optimizer)
        for g, owner in zip(self._groups, self._group_owner, strict=True):
            if owner == k:
                g.read_intent(idle)

    @torch.no_grad()
    def after_step(self, k: int = 0, optimizer: Any = None) -> bool:
        """Classify the updates of optimizer ``k``'s step just taken, and count the step for the parameters it
        updated (``update_steps``: not those at a learning rate of 0 or without a gradient, which it skipped);
        False when ``before_step`` did not run."""
        idle = self._lr_idle.pop(k, None)
        if idle is not None:
            self._steps.step(k, idle | update_steps.without_gradient(optimizer))
        done = [g.classify() for g, owner in zip(self._groups, self._group_owner, strict=True) if owner == k]
        self._counted = True
        for ps, owner, why in self._unsampled:
            if owner == k:
                count = self.skipped.setdefault((ps.module, ps.param), [0, why])
                count[0] += 1
                count[1] = why
        return bool(done) and all(done)

    def device_counts(self) -> list[torch.Tensor]:
        """Each device group's counts ([members, 5] int64, on its device), then each one's sizes ([members, 6]
        float64, ``update_sizes``), for one copy with the rest of a sampled step's data; :meth:`host_counts`
        puts the copies back in parameter order."""
        return [g.counts for g in self._groups] + [g.sizes for g in self._groups]

    def host_counts(self, parts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """[tracked, 5] int64 counts and [tracked, 6] float64 sizes from the host copies of
        :meth:`device_counts` (nothing for parameters that were not sampled)."""
        k = len(self._groups)
        rows = max(len(self.tracked), 1)
        out = np.zeros((rows, 5), dtype=np.int64)
        sizes = update_sizes.empty_host(rows)
        for g, part, size in zip(self._groups, parts[:k], parts[k:], strict=True):
            at = [ps.update_index for ps in g.members]
            out[at], sizes[at] = part, size
        return out, sizes

    def combined(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[tracked, 6] int64 counts (the 6th: ``calls``, the optimizer steps, to be summed over the ranks as every
        row's are) and float64 sizes on the one device the parameters are on (else ``device``), for the
        collectives; copies across devices when the groups live on several."""
        dev = self._groups[0].device if len(self._groups) == 1 else self.device
        rows = max(len(self.tracked), 1)
        out = torch.zeros((rows, 6), dtype=torch.int64, device=dev)
        out[self._update_idx, 5] = torch.from_numpy(self._steps.counts).to(dev)
        sizes = update_sizes.empty(rows, dev)
        for g in self._groups:
            idx = torch.tensor([ps.update_index for ps in g.members], dtype=torch.int64, device=dev)
            out[:, :5].index_copy_(0, idx, g.counts.to(dev))
            sizes.index_copy_(0, idx, g.sizes.to(dev))
        return out, sizes

    def columns(
        self, counts: Any, sizes: Any, step: int, order: dict[str, int], module_type: dict[str, str]
    ) -> dict[str, Any] | None:
        """``weight_update`` rows of the layers table, as columns, from ``counts`` and ``sizes`` (the host
        copies, reduced over ranks when distributed); parameters with no sampled element are left out (None:
        none left). The columns that name the rows are made once while the same parameters, dtypes and order
        come back (the steps' columns share them: they are read, never changed)."""
        counts = np.asarray(counts, dtype=np.int64)
        if not self.tracked:
            return None
        c = counts[self._update_idx]
        keep = np.flatnonzero(c[:, 0] > 0)
        if not len(keep):
            return None
        named = self._named_columns(keep, order, module_type)
        n = len(keep)
        cols: dict[str, Any] = dict(named)
        cols.update(
            {
                T.STEP: np.full(n, step, dtype=np.int64),
                # optimizer steps with a nonzero learning rate and a gradient (update_steps), summed over ranks
                T.CALLS: c[keep, 5] if c.shape[1] > 5 else self._steps.counts[keep],
                T.NUMEL: c[keep, 0].copy(),
                T.ZEROS: c[keep, 1].copy(),
                T.LOST_UPDATE_BF16: c[keep, 2].copy(),
                T.LOST_UPDATE_FP16: c[keep, 3].copy(),
                T.LOST_UPDATE_HELD: c[keep, 4].copy(),
                **update_sizes.columns(
                    np.asarray(sizes, dtype=np.float64)[self._update_idx][keep], c[keep, 0]
                ),
            }
        )
        return cols

    def _named_columns(
        self, keep: np.ndarray, order: dict[str, int], module_type: dict[str, str]
    ) -> dict[str, Any]:
        """The columns of ``columns`` that are the same from step to step for the same kept parameters."""
        dtypes = [ps.tensor.dtype for ps in self.tracked]
        held = self._named
        if (
            held is not None
            and held[1] is order
            and held[2] is module_type
            and held[3] == dtypes
            and np.array_equal(held[0], keep)
        ):
            return held[4]
        kept = [self.tracked[i] for i in keep.tolist()]
        n = len(kept)
        modules = [ps.module for ps in kept]
        named: dict[str, Any] = {col: np.zeros(n, dtype=np.int64) for col in T.COUNT_COLUMNS}
        # the what-if formats' underflow and overflow are not measured on an update (added to its weight, never
        # cast: what a weight's format loses of it is ``lost_update_*``): NaN, where 0 read as "never underflows"
        # (real casts of 5e-7 updates flush all of them in either fp8 format)
        named.update({col: np.full(n, np.nan) for col in T.WHATIF_COUNT_COLUMNS})
        named.update(
            {
                T.ORDER: np.array([order.get(m, -1) for m in modules], dtype=np.int64),
                T.MODULE: modules,
                T.MODULE_TYPE: [module_type.get(m, "") for m in modules],
                T.TENSOR: [T.WEIGHT_UPDATE] * n,
                T.PARAM: [ps.param for ps in kept],
                T.DTYPE: [dtype_name(ps.tensor.dtype) for ps in kept],
                T.SCALE: np.ones(n),
            }
        )
        self._named = (keep, order, module_type, dtypes, named)
        return named
