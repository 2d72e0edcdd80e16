"""Will this training run fit in memory? An estimate made after the model is built and before the optimizer,
so that a run too large for the machine is refused in one line naming the sizes to change, instead of being
killed by the out-of-memory killer with no message and no run directory.

The estimate adds what training holds at its peak, all in bytes:

- parameters and gradients, as they are stored: 4 bytes each in fp32 and the autocast modes, 2 in the pure
  bf16/fp16 modes (their ``element_size``, read from the model as it will train);
- optimizer states: AdamW keeps two fp32 tensors per trainable parameter, SGD with momentum one, in every mode
  (precprof's optimizers for the pure modes keep theirs in fp32 too);
- saved activations, *measured*: the forward pass and the loss run at batch 1 and at batch 2, at the run's
  sequence length and in its precision (autocast included), counting every tensor autograd saves for backward
  once per storage (``saved_tensors_hooks``), the parameters' own storages excluded. The difference between
  the two is what one more sample costs; what is left of batch 1 is saved once per step whatever the batch
  (under autocast, the 16-bit copies of the weights; position tables). Counting from batch 1 alone and
  multiplying by the batch would count autocast's weight copies once per sample: 2.4x too much for gpt-mini
  in bf16 at batch 8. Measuring works for any model, a user's own factory included, where a formula from the
  model's shape would only know the built-in ones;
- the model's outputs (the logits), measured in the same passes: the loop holds them until backward ends, and
  autograd does not save them (cross-entropy saves its log-probabilities);
- under activation checkpointing, the largest checkpointed segment's activations (``recomputed``): the forward
  keeps only a segment's inputs, and the backward pass runs the segment again, whose saved activations live
  while its backward runs. Measured in the same passes: inside a segment's first forward each module's saved
  tensors are counted by hooks of ours (which keep them, as a forward without checkpointing would, until the
  pass's graph is dropped). A gpt-style model with checkpointed blocks at batch 16 x 64 peaked 13-17% above an
  estimate that left them out. Non-reentrant checkpoints (torch's default, Hugging Face's gradient
  checkpointing) save through those hooks; a reentrant one's first forward runs without grad and saves nothing,
  so in the measuring pass its segment's modules run with grad, as the backward pass runs them again, and what
  they save is counted (four checkpointed MLP blocks at batch 64 x 128 peaked 50% above the estimate that left
  it out). Operations of a segment's function outside any module are not counted; a segment that cannot run
  with grad there (an in-place change of a leaf that requires grad) is left out;
- the backward pass's temporaries: the larger of a quarter of the saved activations
  (``BACKWARD_TEMPORARIES``: gradients of activations in flight) and what the backward allocates at its start,
  the gradients of the loss's fp32 log-probabilities and of the logits together: two fp32 tensors of the
  outputs' size (``OUTPUT_GRADIENTS``). For a language model with a real vocabulary these are the largest
  tensors of the step: gpt-nano with GPT-2's 50,257 tokens at batch 8 x 64 peaked at 466 MiB, 2.1x an estimate
  that left out the logits and their gradients (saved 111 MiB, logits 98 MiB, their two gradients 196 MiB).
  A model that computes its loss inside forward and returns it alone (``forward(x, targets)``, a wrapper of a
  Hugging Face model given its labels) has no output to hold, yet its backward starts the same way: the
  gradients are those of the last output of a module inside it that backward flows into, its logits.

Under ``precprof train --distributed`` the estimate is one rank's (``Sharding``): with DDP each rank holds every
parameter, gradient and optimizer state; with FSDP (``fsdp2``, ``fsdp1``) each holds its 1/world-size shard of
them, plus the largest unit gathered whole (its parameters all-gathered for its forward and backward, and their
gradients before the reduce-scatter). gpt-nano 2 x 128 in bf16 over 2 CPU ranks under FSDP2: estimated 6.2 MiB a
rank against an allocator peak of 6.2 MiB, where the whole model's 8.2 MiB refused it on 8 MiB a rank.

The measuring passes never run a batch larger than 2, and the batch-2 pass only when batch 1 says it fits;
a run whose model states alone, or whose batch 1, cannot fit is refused before anything larger is tried. They
run with the random state forked and the module buffers restored, so training is exactly what it would have
been without them.

The total is an estimate, near the step's peak on either side: the allowance for backward's temporaries can be
more than a model's backward holds (gpt-nano's measured peak was 9-13% under the estimate), while the
allocator's fragmentation, the optimizer step's temporaries and the data come on top. The run is refused when
it exceeds ``HEADROOM`` (90%) of the memory available to it: on CUDA what ``torch.cuda.mem_get_info`` says is free plus what this process's
caching allocator holds unused, on the CPU ``MemAvailable`` of /proc/meminfo, bounded by the cgroup's limit
when one is set; in both cases plus the bytes of the model already on the device, which the estimate counts
again. On other devices nothing is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from precprof import _compat
from precprof.capture.storage import _tensors_in
from precprof.errors import UserError

HEADROOM = 0.9  # refuse above this share of the available memory
# The backward pass allocates the gradients of the activations while the saved ones are alive: measured on
# gpt-mini (CPU, fp32, batch 16 and 64 x 256) a step's resident memory above the fixed parts was 1.4-1.6x the
# saved activations. A quarter keeps the estimate below what a run really takes.
BACKWARD_TEMPORARIES = 0.25
# At the start of backward the gradient of the loss's fp32 log-probabilities and that of the logits (fp32: the
# loop computes the loss in fp32, and a 16-bit output's gradient comes from its fp32 copy's) are alive together:
# this many fp32 tensors of the outputs' size
OUTPUT_GRADIENTS = 2
# fp32 tensors per trainable parameter (the built-in loop's SGD always has momentum)
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}
GiB = 2.0**30


@dataclass(frozen=True)
class Sharding:
    """How the model states of a data-parallel run are held: ``ranks`` processes; ``sharded``, each holds a
    1/ranks shard of the parameters, gradients and optimizer states (FSDP) rather than all of them (DDP);
    ``gathered``, the bytes of the largest unit a rank holds whole at its peak (FSDP: its all-gathered parameters
    and their gradients before the reduce-scatter)."""

    ranks: int = 1
    sharded: bool = False
    gathered: int = 0


@dataclass(frozen=True)
class Footprint:
    """Bytes a training step needs at its peak, by part.

    Invariants: every size is >= 0 and in bytes, one rank's (``sharding``); ``total == model_states +
    activations``; the activation sizes come from the measuring passes (``measured``) or are 0 when those could
    not run (``note`` says why).
    """

    parameters: int
    gradients: int
    optimizer_states: int
    activations_per_sample: int  # saved for backward by each sample of the batch
    batch_size: int
    activations_shared: int = 0  # saved once per step whatever the batch (autocast's weight copies)
    measured: bool = True
    note: str = ""
    outputs_per_sample: int = 0  # the model's outputs (logits) beyond what autograd saves, per sample
    output_gradients_per_sample: int = (
        0  # the gradients at backward's start (``OUTPUT_GRADIENTS``), per sample
    )
    recomputed_per_sample: int = 0  # the largest checkpointed segment's saved activations, per sample
    recomputed_shared: int = 0  # of those, saved once per step whatever the batch
    sharding: Sharding = Sharding()  # parameters, gradients and optimizer states are a rank's shards
    failed_at: int = 0  # the batch of the measuring pass that raised the model's own error (0: none did)

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer states (and, sharded, the largest unit gathered whole): what a rank
        holds of the model at a step's peak."""
        return self.parameters + self.gradients + self.optimizer_states + self.sharding.gathered

    @property
    def saved(self) -> int:
        """Saved activations of the whole batch."""
        return self.activations_shared + self.activations_per_sample * self.batch_size

    @property
    def recomputed(self) -> int:
        """The largest checkpointed segment's activations, remade by the backward pass (0 without checkpoints)."""
        return self.recomputed_shared + self.recomputed_per_sample * self.batch_size

    @property
    def temporaries(self) -> int:
        """The backward pass's temporaries beside the saved activations: a quarter of them, or the gradients
        allocated at backward's start where those are more (a large vocabulary)."""
        return max(int(self.saved * BACKWARD_TEMPORARIES), self.output_gradients_per_sample * self.batch_size)

    @property
    def activations(self) -> int:
        """Saved activations of the whole batch, the outputs the loop holds, the largest checkpointed segment's
        activations remade in backward and the backward's temporaries."""
        return self.saved + self.outputs_per_sample * self.batch_size + self.recomputed + self.temporaries

    @property
    def total(self) -> int:
        return self.model_states + self.activations

    def at_batch(self, batch_size: int) -> Footprint:
        """The same model and sequence length at another batch size."""
        return dataclasses.replace(self, batch_size=batch_size)

    def largest_batch(self, available: int) -> int:
        """The largest batch size whose estimate stays within ``HEADROOM`` of ``available`` bytes (0: none)."""
        limit = HEADROOM * available
        if self.at_batch(0).total > limit:
            return 0
        # each sample adds at least this (the temporaries' quarter rounds down: one byte less per batch)
        grow = (
            self.activations_per_sample
            + self.outputs_per_sample
            + self.recomputed_per_sample
            + max(self.activations_per_sample * BACKWARD_TEMPORARIES, self.output_gradients_per_sample)
        )
        if grow <= 0:
            return 1 << 62  # nothing grows with the batch: any batch fits
        fits, too_large = 0, int((limit + 1) // grow) + 1
        while too_large - fits > 1:  # the total grows with the batch: bisect for the last batch that fits
            mid = (fits + too_large) // 2
            if self.at_batch(mid).total <= limit:
                fits = mid
            else:
                too_large = mid
        return fits


def size_text(n: float) -> str:
    """Bytes for a message: GiB (one decimal) from 0.1 GiB up, TiB from 1024 GiB; below, whole MiB from 10 MiB,
    MiB with one decimal from 1 MiB, whole KiB under it (whole MiB printed "parameters 0 MiB" of 0.3 MiB, and
    parts that did not add up to the total beside them)."""
    if n >= 1024 * GiB:
        return f"{n / 2**40:,.1f} TiB"
    if n >= 0.1 * GiB:
        return f"{n / GiB:,.1f} GiB"
    if n >= 10 * 2**20:
        return f"{n / 2**20:,.0f} MiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


# ------------------------------------------------------------------------------------ available memory
def available_bytes(device: torch.device, *, cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process can still allocate on ``device``; None where it cannot be read (then nothing is
    refused). The model's tensors already on the device are *not* included (``resident_bytes``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # what the caching allocator holds but no tensor uses is free for this process, not for the driver
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(int(cached), 0)
    if device.type != "cpu":
        return None
    avail = _meminfo_available()
    room = cgroup_room(cgroup_root)
    if avail is None or room is None:
        return avail if room is None else room
    return min(avail, room)


def _meminfo_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file's unit is kB (KiB)
    return None


def cgroup_room(root: Path) -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``);
    None when no limit is set. Inactive page cache counts as free: the kernel reclaims it before killing."""
    for limit_name, usage_name, inactive_key in (
        ("memory.max", "memory.current", "inactive_file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"),
    ):
        limit_file = root / limit_name
        with contextlib.suppress(OSError, ValueError):
            text = limit_file.read_text().strip()
            stat = _stat_file(limit_file.parent / "memory.stat")
            # v1 reports "no limit" as a huge number, and a parent's limit only in memory.stat
            limits = [int(text)] if text != "max" else []
            if "hierarchical_memory_limit" in stat:
                limits.append(stat["hierarchical_memory_limit"])
            limit = min((v for v in limits if v < (1 << 60)), default=None)
            if limit is None:
                return None
            usage = int((root / usage_name).read_text().strip()) - stat.get(inactive_key, 0)
            return max(limit - max(usage, 0), 0)
    return None


def _stat_file(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
    return out


def resident_bytes(model: nn.Module, device: torch.device) -> int:
    """Bytes of the model's parameters, gradients and buffers already on ``device`` (each storage once):
    ``available_bytes`` no longer sees them as free, and the estimate counts them."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    for t in tensors:
        if t is None or t.device.type != device.type:
            continue
        with contextlib.suppress(RuntimeError):  # tensor subclasses without a plain storage
            st = t.untyped_storage()
            if _storage_key(st) not in seen:
                seen.add(_storage_key(st))
                total += st.nbytes()
    return total


# ---------------------------------------------------------------------------------------- the estimate
def model_state_bytes(model: nn.Module, optimizer: str, shards: int = 1) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) in bytes, from the parameters as they will train; ``shards``:
    one rank's 1/shards of each (FSDP), rounded up."""
    params = list(model.parameters())  # tied weights appear once
    trainable = [p for p in params if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    state_bytes = OPTIMIZER_STATES.get(optimizer, 2) * 4 * sum(p.numel() for p in trainable)
    n = max(shards, 1)
    return -(-param_bytes // n), -(-grad_bytes // n), -(-state_bytes // n)


@dataclass(frozen=True)
class PassBytes:
    """What one measuring pass saw, in bytes: ``saved`` for backward; ``outputs``, the model's outputs that
    autograd does not save (the logits, which the loop holds until backward ends); ``output_gradients``, the
    gradients backward allocates at its start (``OUTPUT_GRADIENTS`` fp32 tensors of the outputs' size);
    ``recomputed``, what the largest checkpointed segment saves when the backward pass runs it again."""

    saved: int
    outputs: int = 0
    output_gradients: int = 0
    recomputed: int = 0


def saved_activation_bytes(
    model: nn.Module,
    forward_loss: Callable[[], torch.Tensor],
    leave_out: Callable[[torch.Tensor], bool] | None = None,
) -> int:
    """Bytes of the tensors autograd saves for backward while ``forward_loss()`` runs (``pass_bytes``)."""
    return pass_bytes(model, forward_loss, leave_out).saved


def pass_bytes(
    model: nn.Module,
    forward_loss: Callable[[], torch.Tensor],
    leave_out: Callable[[torch.Tensor], bool] | None = None,
) -> PassBytes:
    """The bytes of one forward pass and loss (``PassBytes``): what autograd saves for backward while
    ``forward_loss()`` runs (each storage once, the model's parameters excluded, and those ``leave_out``
    picks) and the model's outputs that require grad. The graph is dropped afterwards; nothing is trained. The
    random state is forked and the module buffers (BatchNorm's running statistics) restored: training is
    unchanged.

    A reentrant checkpoint's segment runs here with grad, as the backward pass runs it again, so that what it
    saves is counted (``recomputed``); a segment that cannot run with grad inside the checkpoint's first
    forward (an in-place change of a leaf that requires grad) makes the pass run again without that, its
    recomputation left out as before."""
    entered = [False]
    try:
        return _pass_bytes(model, forward_loss, leave_out, entered, reentrant=True)
    except Exception as e:
        if not entered[0] or _is_out_of_memory(e):
            raise
    return _pass_bytes(model, forward_loss, leave_out, entered, reentrant=False)


def _pass_bytes(
    model: nn.Module,
    forward_loss: Callable[[], torch.Tensor],
    leave_out: Callable[[torch.Tensor], bool] | None,
    entered: list[bool],
    *,
    reentrant: bool,
) -> PassBytes:
    """``pass_bytes``; ``reentrant``: run reentrant checkpoints' segments with grad and count them (``entered``
    is set when one was)."""
    params = {_storage_key(p.untyped_storage()) for p in model.parameters()}
    seen: set[int] = set()
    outputs: dict[int, tuple[int, int]] = {}  # storage -> (bytes, elements) of the model's outputs
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        with contextlib.suppress(RuntimeError):  # tensor subclasses without a plain storage
            st = t.untyped_storage()
            key = _storage_key(st)
            if key not in params and key not in seen and not (leave_out is not None and leave_out(t)):
                seen.add(key)
                total += st.nbytes()
        return t

    def keep_outputs(module: nn.Module, args: Any, out: Any) -> None:
        for t in _tensors_in(out):
            if t.requires_grad and t.dim() > 0:  # backward flows into it (a scalar loss is no output to hold)
                with contextlib.suppress(RuntimeError):
                    outputs[_storage_key(t.untyped_storage())] = (t.untyped_storage().nbytes(), t.numel())

    # the elements of the last output of a module inside the model that backward flows into: the logits of a
    # model that computes its loss inside forward and returns it alone (a wrapper's ``hf(x, labels=y).loss``)
    last = [0]

    def keep_last(module: nn.Module, args: Any, out: Any) -> None:
        sizes = [t.numel() for t in _tensors_in(out) if t.requires_grad and t.dim() > 0]
        if sizes:
            last[0] = max(sizes)

    # checkpointed segments: the checkpoint's pack hook (non-reentrant) or autograd context (reentrant) naming
    # each -> what its modules save, each storage once
    segments: dict[int, tuple[Any, dict[int, int]]] = {}
    pushed: list[Any] = []  # per module call: our contexts pushed inside a segment, innermost last, or None
    # a reentrant segment's saved tensors, kept while it runs: its modules' graphs are dropped as the checkpoint
    # returns (or between two modules of its function), and a storage made later must not take a counted one's key
    kept: list[Any] = [None, []]  # (the segment, its tensors)

    def enter(module: nn.Module, args: Any) -> None:
        segment, grad = _compat.checkpoint_segment(), None
        if segment is None and reentrant and not torch.is_grad_enabled():
            # a reentrant checkpoint's first forward, without grad: the backward pass runs it again with grad
            segment = _compat.reentrant_segment()
            grad = torch.enable_grad() if segment is not None else None
        if segment is None:
            pushed.append(None)
            return
        counted = segments.setdefault(id(segment), (segment, {}))[1]
        if grad is not None:
            entered[0] = True
            if kept[0] is not segment:
                kept[:] = [segment, []]

        def pack_segment(t: torch.Tensor) -> torch.Tensor:
            with contextlib.suppress(RuntimeError):
                st = t.untyped_storage()
                key = _storage_key(st)
                if key not in params and not (leave_out is not None and leave_out(t)):
                    counted[key] = st.nbytes()
                    if grad is not None:
                        kept[1].append(t)
            return t

        contexts = [
            c
            for c in (grad, torch.autograd.graph.saved_tensors_hooks(pack_segment, lambda t: t))
            if c is not None
        ]
        for c in contexts:
            c.__enter__()
        pushed.append(contexts)

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        contexts = pushed.pop() if pushed else None
        for c in reversed(contexts or []):
            c.__exit__(None, None, None)

    handles = [model.register_forward_hook(keep_outputs)]
    handles += [m.register_forward_hook(keep_last) for m in model.modules() if m is not model]
    inner = [m for m in model.modules() if m is not model]
    handles += [m.register_forward_pre_hook(enter) for m in inner]
    handles += [m.register_forward_hook(leave, always_call=True) for m in inner]
    try:
        with _unchanged(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward_loss()
        del loss
    finally:
        for handle in handles:
            handle.remove()
        while pushed:  # (a forward that raised past a module's hooks)
            for c in reversed(pushed.pop() or []):
                c.__exit__(None, None, None)
        kept.clear()
    recomputed = max((sum(counted.values()) for _, counted in segments.values()), default=0)
    segments.clear()
    held = sum(b for key, (b, _) in outputs.items() if key not in seen and key not in params)
    # backward starts from the loss wherever it was computed: with a loss made inside forward and returned
    # alone, the gradients at its start are those of the logits the model made, not of an output it returned
    elements = sum(n for _, n in outputs.values()) if outputs else last[0]
    return PassBytes(total, held, OUTPUT_GRADIENTS * 4 * elements, recomputed)


def run_once(model: nn.Module, forward_loss: Callable[[], torch.Tensor]) -> None:
    """Run ``forward_loss()`` once as training runs it, nothing measured (no hooks), and drop its graph: the
    model's own error propagates. Like ``pass_bytes``, training is unchanged (random state forked, buffers
    restored)."""
    with _unchanged(model):
        loss = forward_loss()
    del loss


@contextlib.contextmanager
def _unchanged(model: nn.Module) -> Iterator[None]:
    """Run a pass that is not training: the random state forked and the module buffers (BatchNorm's running
    statistics) put back afterwards, whether the pass returned or raised."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [d for d in {p.device for p in model.parameters()} if d.type == "cuda"]
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])


def _storage_key(st: torch.UntypedStorage) -> int:
    """One number per storage alive: its StorageImpl's address. ``data_ptr`` would do on real devices, but is 0
    for every storage on the meta device (where a model can be measured without allocating it)."""
    key = getattr(st, "_cdata", None)
    return key if isinstance(key, int) else st.data_ptr()


def _is_out_of_memory(e: BaseException) -> bool:
    # CUDA raises torch.OutOfMemoryError; the CPU allocator a RuntimeError naming the allocation
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )


def estimate(
    model: nn.Module,
    *,
    batch_size: int,
    optimizer: str,
    forward_loss: Callable[[int], torch.Tensor],
    available: int | None = None,
    what: str = "this run",
    where: str = "this machine",
    leave_out: Callable[[torch.Tensor], bool] | None = None,
    sharding: Sharding = Sharding(),
) -> Footprint:
    """The footprint of training ``model`` at ``batch_size`` (>= 1) with ``optimizer`` ("adamw" or "sgd"), on one
    rank of ``sharding`` (the unwrapped model given: its states are sharded here).

    ``forward_loss(n)`` runs the forward pass and the loss on ``n`` random samples at the run's sequence length,
    in the run's precision. ``available`` (bytes, None: unknown) guards the measuring passes: a run whose model
    states or whose batch 1 cannot fit is refused (UserError) before a larger batch is tried, and batch 2 is
    measured only when batch 1 says it fits. Only a refusal is raised here: when the model's own forward pass
    fails, the estimate is left unmeasured (``measured`` False, ``note`` says why, ``failed_at`` at which
    batch), and the caller may run that pass again without the measuring (``run_once``) to tell the model's
    error from one the measuring alone met. ``what`` and ``where`` name the run and the machine in a refusal. ``leave_out``
    picks saved tensors not to count (the meta device's attention matrices, which a device's fused kernel does
    not keep).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    params, grads, states = model_state_bytes(model, optimizer, sharding.ranks if sharding.sharded else 1)
    fp = Footprint(params, grads, states, 0, batch_size, sharding=sharding)
    check_fits(fp, available, what=what, where=where)  # the model alone: nothing measured yet

    try:
        one = _measure(model, forward_loss, 1, leave_out)
    except torch.OutOfMemoryError:
        raise _refusal(fp.at_batch(1), available, what=what, where=where, out_of_memory=True) from None
    except Exception as e:  # the model's own error: the caller decides (``run_once`` tells it apart)
        return dataclasses.replace(fp, measured=False, note=_failure(e), failed_at=1)
    # batch 1 counts what is saved once per step as if each sample saved it: an upper bound per sample
    fp = dataclasses.replace(
        fp,
        activations_per_sample=one.saved,
        outputs_per_sample=one.outputs,
        output_gradients_per_sample=one.output_gradients,
        recomputed_per_sample=one.recomputed,
    )
    check_fits(fp.at_batch(1), available, what=what, where=where)  # refused without measuring more
    if batch_size == 1:
        return dataclasses.replace(fp, note="measured at batch 1 only: the run's batch")
    if available is not None and fp.at_batch(2).total > HEADROOM * available:
        check_fits(fp, available, what=what, where=where)  # "use --batch-size 1" from the upper bound
        return fp  # not reached while batch_size >= 2: batch 2 does not fit
    try:
        two = _measure(model, forward_loss, 2, leave_out)
    except torch.OutOfMemoryError:
        raise _refusal(fp.at_batch(2), available, what=what, where=where, out_of_memory=True) from None
    except Exception as e:  # batch 1 ran: keep its upper bound
        return dataclasses.replace(fp, note=f"measured at batch 1 only: {_failure(e)}", failed_at=2)
    per_sample = max(two.saved - one.saved, 0)
    fp = dataclasses.replace(
        fp,
        activations_per_sample=per_sample,
        activations_shared=max(one.saved - per_sample, 0),
        outputs_per_sample=max(two.outputs - one.outputs, 0),
        output_gradients_per_sample=max(two.output_gradients - one.output_gradients, 0),
        recomputed_per_sample=max(two.recomputed - one.recomputed, 0),
        recomputed_shared=max(one.recomputed - max(two.recomputed - one.recomputed, 0), 0),
    )
    check_fits(fp, available, what=what, where=where)
    return fp


def _measure(
    model: nn.Module,
    forward_loss: Callable[[int], torch.Tensor],
    n: int,
    leave_out: Callable[[torch.Tensor], bool] | None = None,
) -> PassBytes:
    """``pass_bytes`` at batch ``n``; running out of memory raises torch.OutOfMemoryError."""
    try:
        return pass_bytes(model, lambda: forward_loss(n), leave_out)
    except Exception as e:
        if not _is_out_of_memory(e):
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the failed pass cached must not stay held by the run
        raise torch.OutOfMemoryError(str(e)) from None


def _failure(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"the measuring pass raised {type(e).__name__}" + (f": {first}" if first else "")


class ModelDoesNotFit(UserError):
    """The model's own states (parameters, gradients, optimizer states) exceed the memory available, whatever the
    batch: the fix is a smaller model (:meth:`with_example` names one)."""

    def with_example(self, example: str | None) -> UserError:
        """This refusal with ``example`` (--model-arg settings that make the model small) in its fix."""
        if not example:
            return self
        return UserError(
            str(self).replace("model (--model-arg) or", f"model with --model-arg, e.g. {example}, or")
        )


def check_fits(fp: Footprint, available: int | None, *, what: str, where: str) -> None:
    """UserError, one line, when ``fp`` exceeds ``HEADROOM`` of ``available`` bytes (None: nothing to check).

    The message gives the estimate by part and the largest batch size that fits, or, when none does, whether
    the model alone is too large or one sample at this sequence length is.
    """
    if available is None or fp.total <= HEADROOM * available:
        return
    raise _refusal(fp, available, what=what, where=where)


def _refusal(
    fp: Footprint, available: int | None, *, what: str, where: str, out_of_memory: bool = False
) -> UserError:
    fits = 0 if available is None or out_of_memory else fp.largest_batch(available)
    has = f"{where} has {size_text(available)} available" if available is not None else f"{where} ran out"
    states = _states_text(fp)
    if fits >= 1:
        return UserError(
            f"{what} needs about {size_text(fp.total)}{_per_rank(fp)} to train ({states}{_then(fp)}activations "
            f"{size_text(fp.activations)}) but {has}: use --batch-size {fits} or less, or a shorter --seq-len"
        )
    if available is not None and fp.model_states > HEADROOM * available:
        return ModelDoesNotFit(
            f"{what} needs at least {size_text(fp.model_states)}{_per_rank(fp)} to train ({states}) but {has}: the model "
            "alone does not fit; choose a smaller model (--model-arg) or a machine with more memory"
        )
    one = fp.at_batch(1)
    if out_of_memory:  # the measuring pass itself failed at batch fp.batch_size (1 or 2)
        fix = (
            "use --batch-size 1, or a shorter --seq-len"
            if fp.batch_size > 1
            else "even --batch-size 1 does not fit; use a shorter --seq-len or a smaller model (--model-arg)"
        )
        return UserError(
            f"{what} ran out of memory measuring the activations of batch size {fp.batch_size} "
            f"({states}); {has}: {fix}"
        )
    return UserError(
        f"{what} cannot train here: even batch size 1 needs about {size_text(one.total)}{_per_rank(fp)} "
        f"({states}{_then(fp)}activations {size_text(one.activations)}) but {has}: use a shorter --seq-len or a smaller model "
        "(--model-arg)"
    )


def _states_text(fp: Footprint) -> str:
    shard = fp.sharding
    text = (
        f"parameters {size_text(fp.parameters)}, gradients {size_text(fp.gradients)}, "
        f"optimizer states {size_text(fp.optimizer_states)}"
    )
    if not shard.sharded:
        return text
    return (
        f"its 1/{shard.ranks} shard of the model: {text}; the largest unit gathered whole "
        f"{size_text(shard.gathered)}"
    )


def _then(fp: Footprint) -> str:
    """Between the model's states and the activations: a sharded rank's states end in a clause of their own."""
    return "; " if fp.sharding.sharded else ", "


def _per_rank(fp: Footprint) -> str:
    return " per rank" if fp.sharding.ranks > 1 else ""


def line(fp: Footprint) -> str:
    """The estimate in one line, printed before the first step: the peak and its parts (one rank's)."""
    if not fp.measured:
        return f"memory: at least {size_text(fp.model_states)}{_per_rank(fp)} ({_states_text(fp)}); {fp.note}"
    return (
        f"memory: about {size_text(fp.total)}{_per_rank(fp)} at a step's peak, an estimate ({_states_text(fp)}{_then(fp)}"
        f"activations {size_text(fp.activations)}: saved {size_text(fp.saved)}, outputs "
        f"{size_text(fp.outputs_per_sample * fp.batch_size)}, "
        + (f"a checkpointed segment recomputed {size_text(fp.recomputed)}, " if fp.recomputed else "")
        + f"backward temporaries {size_text(fp.temporaries)})"
    )


def place(device: torch.device, processes_sharing: int = 1) -> str:
    """The memory a refusal speaks of: "this machine" (CPU) or the device, and how many ranks share it."""
    where = "this machine" if device.type == "cpu" else str(device)
    return where + (f" ({processes_sharing} ranks sharing it)" if processes_sharing > 1 else "")


def check_training_fits(
    model: nn.Module,
    *,
    batch_size: int,
    optimizer: str,
    forward_loss: Callable[[int], torch.Tensor],
    device: torch.device,
    what: str,
    processes_sharing: int = 1,
    sharding: Sharding = Sharding(),
) -> Footprint:
    """The entry point of the training loop, called once the model is on ``device`` in its training dtype
    and before the optimizer exists: the footprint (``estimate``), or UserError when the run cannot fit.

    ``processes_sharing`` is the number of ranks training on this same memory (CPU ranks of one machine under
    torchrun): each may take only its share of what is available. ``sharding``: how the ranks hold the model
    states (the estimate is one rank's).
    """
    avail = available_bytes(device)
    if avail is not None:
        avail = avail // max(processes_sharing, 1) + resident_bytes(model, device)
    where = place(device, processes_sharing)
    return estimate(
        model,
        batch_size=batch_size,
        optimizer=optimizer,
        forward_loss=forward_loss,
        available=avail,
        what=what,
        where=where,
        sharding=sharding,
    )


def describe(fp: Footprint) -> dict[str, Any]:
    """The estimate for summary.json's configuration block (bytes)."""
    how = (
        "saved activations and the model's outputs measured at batch 1 and 2 (what each sample adds, and what "
        "is saved once per step) and scaled to the batch, plus the largest checkpointed segment's activations "
        "(the backward pass remakes them), plus backward's temporaries: the larger of "
        f"{BACKWARD_TEMPORARIES:.0%} of the saved activations and the gradients of the outputs at its start"
        if fp.measured
        else "activations not measured"
    )
    return {
        "parameters": fp.parameters,
        "gradients": fp.gradients,
        "optimizer_states": fp.optimizer_states,
        "activations": fp.activations,  # saved_activations + outputs + recomputed + backward_temporaries
        "saved_activations": fp.saved,
        "activations_per_sample": fp.activations_per_sample,
        "activations_shared": fp.activations_shared,
        "outputs": fp.outputs_per_sample * fp.batch_size,
        "backward_temporaries": fp.temporaries,
        # the largest checkpointed segment's activations, remade by the backward pass (0 without checkpoints)
        "recomputed": fp.recomputed,
        "total": fp.total,
        "ranks": fp.sharding.ranks,  # the sizes are one rank's of these
        "sharded": fp.sharding.sharded,  # parameters, gradients and optimizer states: the rank's shards
        "gathered_unit": fp.sharding.gathered,  # sharded: the largest unit gathered whole
        # an estimate, not a bound: the allowance for backward's temporaries can exceed what a model's backward
        # holds (gpt-nano's step peaked 9-13% under it), and fragmentation and the data can put a step above it
        "note": f"an estimate made before training: {how}" + (f"; {fp.note}" if fp.note else ""),
    }
