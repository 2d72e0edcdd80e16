"""What the rows of every device share: the block-format accumulator, the torch-op path's scratch and keys, and
the order of work issued from several CUDA streams. ``rows_host.HostRows`` (the CPU's rows, filled by the C
kernel or torch ops) and ``rows_device.DeviceRows`` (one dense int64 tensor on a device, filled by Triton or
torch ops) build on it; ``buffer.StatsBuffer`` holds one per device."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from precprof import _compat
from precprof.stats import blocks as _blocks
from precprof.stats import magnitude
from precprof.stats.engine import _default_kernel_threads
from precprof.stats.layout import _N_KEYS, RowLayout

# bench/host_cost.py sets this to measure everything around reading a tensor: the engines return at once
NO_READ = False


def same_values(held: torch.Tensor | None, x: torch.Tensor) -> bool:
    """Whether ``x`` holds the values of ``held`` (the tensor a row last read, still alive) in the same memory:
    the same object, or a view of the same contiguous block (the same first element, count and dtype), as a
    module returns that reshapes its input (``nn.Flatten``, ``nn.Unflatten``) and its gradient is. With their
    shared version counter unchanged since the read, the statistics of one are the other's."""
    if held is x:
        return True
    if held is None:
        return False
    try:
        return bool(
            held.data_ptr() == x.data_ptr()
            and held.numel() == x.numel()
            and held.dtype == x.dtype
            and held.device == x.device
            and held.is_contiguous()
            and x.is_contiguous()
        )
    except RuntimeError:  # a tensor without storage to point at
        return False


class Rows:
    """The rows of one device (``rows`` slots of ``layout``), filled by ``engine``. Subclasses hold the counts
    and implement ``add`` (one tensor into one row, never syncing), ``dense``, ``reset_counts`` and the sizes.

    ``block_slot``: row -> its slot in the block accumulator (-1: the row never holds block statistics)."""

    on_cpu = False

    def __init__(
        self,
        rows: int,
        device: torch.device,
        *,
        engine: str,
        layout: RowLayout,
        block_slot: np.ndarray | None,
    ) -> None:
        self.device = device
        self.rows = rows
        self.layout = layout
        self.engine = engine
        self._block_slot = np.arange(rows, dtype=np.int64) if block_slot is None else block_slot
        n_slots = int(self._block_slot.max()) + 1 if len(self._block_slot) else 0
        self.use_kernel = engine == "c"  # tests switch it off to compare the C kernel and torch ops
        # threads per C kernel call (0: torch.get_num_threads()); decided on first use
        self.kernel_threads: int | None = None
        self._last_stream: Any = None
        self._last_raw_stream: int | None = None
        # rows written (counts or block statistics) since the last reset of all rows: an ``assign`` into a row
        # that was not needs no clearing (the hook of every weight gradient assigns)
        self._written = np.zeros(rows, dtype=bool)
        # the torch-op path's scratch, grown to the largest chunk seen
        self._scratch_len = 0
        self._f64 = torch.empty(0, dtype=torch.float64, device=device)
        self._i64 = torch.empty(0, dtype=torch.int64, device=device)
        self._key = torch.empty(0, dtype=torch.int64, device=device)
        self._bool = torch.empty(0, dtype=torch.bool, device=device)
        self._ones = torch.ones(1, dtype=torch.int64, device=device)
        self._keys_hist = torch.zeros(_N_KEYS, dtype=torch.int64, device=device)
        self._small = torch.empty(layout.n_whatif + 1, dtype=torch.int64, device=device)
        # block-format what-if per block slot (stats.blocks): float64 [slots, orientation, recipe, stat] on the
        # device; only the rows that can hold block statistics have a slot
        self._blocks = torch.zeros(
            (n_slots, _blocks.N_ORIENTATIONS, _blocks.N_RECIPES, _blocks.N_STATS),
            dtype=torch.float64,
            device=device,
        )
        # the tensors added to the block accumulator since the last reset: (id, row) -> (tensor, version)
        self._blocks_added: dict[tuple[int, int], tuple[weakref.ref[torch.Tensor], int]] = {}

    # -- what subclasses provide
    def add(self, x: torch.Tensor, row: int, assign: bool = False) -> None:
        raise NotImplementedError

    def add_many(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], assign: bool = False) -> None:
        """:meth:`add` of each tensor into its row (an engine may read them all in one call); ``assign`` clears
        each row first."""
        for t, r in zip(tensors, rows, strict=True):
            self.add(t, r, assign)

    def dense(self) -> torch.Tensor:
        raise NotImplementedError

    def reset_counts(self, sl: slice) -> None:
        raise NotImplementedError

    @property
    def buffer_bytes(self) -> int:
        return self._blocks.numel() * self._blocks.element_size()

    @property
    def scratch_bytes(self) -> int:
        """Bytes of reusable scratch held now: the torch-op path's chunk buffers and small tensors."""
        return sum(
            t.numel() * t.element_size()
            for t in (self._f64, self._i64, self._key, self._bool, self._keys_hist, self._small)
        )

    # -- shared
    def accumulate(self, x: torch.Tensor, row: int) -> None:
        """Add the statistics of ``x`` (any floating dtype, any shape, on this device) into ``row``."""
        if x.numel() and not NO_READ:
            self.add(x.detach(), row)

    def reset(self, rows: slice | None = None) -> None:
        """Zero the counts of all rows (or ``rows``) and their block statistics; device ops, no sync."""
        sl = rows if rows is not None else slice(None)
        self._written[sl] = False
        self._blocks_added.clear()
        self._reset_blocks(sl)
        self.reset_counts(sl)

    def snapshot(self) -> tuple[Any, ...]:
        """A copy of the rows and their block statistics as they are now, for :meth:`restore`: the point a sampled
        step's attempt that raised goes back to (``capture/attempts.py``). Device copies, no sync."""
        self._order_stream()
        return self._counts_copy(), self._blocks.clone(), self._written.copy(), dict(self._blocks_added)

    def restore(self, held: tuple[Any, ...]) -> None:
        """The rows as :meth:`snapshot` held them (``held`` stays as it is: a second attempt that raises goes back
        to it again). Device copies, no sync."""
        counts, blocks, written, added = held
        self._order_stream()
        self._restore_counts(counts)
        self._blocks.copy_(blocks)
        self._written[:] = written
        self._blocks_added = dict(added)

    def _counts_copy(self) -> Any:
        raise NotImplementedError

    def _restore_counts(self, held: Any) -> None:
        raise NotImplementedError

    def to_host(self) -> np.ndarray:
        """Copy the rows to the host: the one synchronising call per sampled step."""
        return self.dense().cpu().numpy()

    def _threads(self) -> int:
        if self.kernel_threads is None:
            self.kernel_threads = _default_kernel_threads()
        return self.kernel_threads or torch.get_num_threads()

    def _order_stream(self) -> None:
        """Order this call's work after the previous call's when they come from different CUDA streams (a
        gradient hook on FSDP2's reduce-scatter stream, then one on the default stream): the rows and the
        scratch are shared. An event, not a host sync."""
        if self.device.type != "cuda":
            return
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)  # an int: no Stream object per call
        if raw == self._last_raw_stream:
            return
        cur = torch.cuda.current_stream(self.device)
        last = self._last_stream
        if last is not None and last != cur:
            event = torch.cuda.Event()
            event.record(last)
            cur.wait_event(event)
        self._last_stream, self._last_raw_stream = cur, raw

    def _ensure_scratch(self, n: int) -> None:
        if n <= self._scratch_len:
            return
        dev = self.device
        self._f64 = torch.empty(n, dtype=torch.float64, device=dev)
        self._i64 = torch.empty(n, dtype=torch.int64, device=dev)
        self._key = torch.empty(n, dtype=torch.int64, device=dev)
        self._bool = torch.empty(n, dtype=torch.bool, device=dev)
        self._scratch_len = n

    def _keys_of(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """|part| as fp64 in scratch, its bit patterns, and the key of every element.

        The bit patterns come from ``part``'s own bits by integer operations (``stats.magnitude``: the sign bit
        masked off, subnormals converted as integers), so every key lies in [0, 4096) by construction, on
        any device. key = 2 * exponent_field + (mantissa == 0), with shifts and bitwise ops only (integer
        multiply, add and compare-to-bool are several times slower on CPU): subtracting 1 from the bits
        borrows into the exponent exactly when the mantissa is zero, so the lowest bit of
        (bits >> 52) ^ ((bits - 1) >> 52) is that flag. A zero gives key 1 ("exponent 0, mantissa 0"); nan
        4094, inf 4095.
        """
        m = part.numel()
        self._ensure_scratch(m)
        bits = magnitude.abs_bits(part, self._f64[:m].view(torch.int64))
        a = bits.view(torch.float64)
        key = self._key[:m]
        tmp = self._i64[:m]
        torch.sub(bits, 1, out=tmp)
        tmp.bitwise_right_shift_(52)
        torch.bitwise_right_shift(bits, 52, out=key)
        tmp.bitwise_xor_(key).bitwise_and_(1)
        key.bitwise_left_shift_(1).bitwise_or_(tmp)
        return a, bits, key

    # -- block formats
    def _reset_blocks(self, sl: slice) -> None:
        if sl == slice(None):
            self._blocks.zero_()
            return
        # one row (an assign into a row written before): its slot alone, if it has one
        if sl.stop is not None and sl.start is not None and sl.stop - sl.start == 1:
            slot = int(self._block_slot[sl.start])
            if slot >= 0:
                self._blocks[slot].zero_()
            return
        slots = self._block_slot[sl]
        slots = slots[slots >= 0]
        # zeroed in runs of consecutive slots, by views: an index tensor would be a host-to-device copy (from
        # pageable memory, a sync) inside the hook that clears an accumulated gradient's row
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        for run in np.split(slots, breaks) if len(slots) else []:
            self._blocks[int(run[0]) : int(run[-1]) + 1].zero_()

    def accumulate_blocks(self, x: torch.Tensor, row: int) -> None:
        """Add the block-format statistics of ``x`` (ndim >= 2, on this device; both orientations, every
        recipe of ``stats.blocks.RECIPES``) into ``row``'s slot of the block accumulator (a row without one
        is left alone). Never syncs. A tensor (object and in-place version) already added into ``row`` since the
        last ``reset`` is not added again: a module output that several linear layers read (q, k and v
        projections) counts once, like its other statistics, so its shares keep their denominator. Only
        ``x``'s data is read (``add_tensor_block_stats`` detaches it: no autograd op is recorded)."""
        slot, version = self._blocks_due(x, row)
        if slot < 0:
            return
        self._order_stream()
        self._add_blocks(x, slot)
        self._blocks_done(x, row, version)

    def _add_blocks(self, x: torch.Tensor, slot: int) -> None:
        """Add the block statistics of ``x`` into the accumulator's ``slot`` (the engines' general path)."""
        engine = "torch" if self.engine == "c" and not self.use_kernel else self.engine
        # threads are the C kernel's alone: asking for them loads (and on a machine's first run builds) it, which
        # on an H100 ran the C compiler inside the first sampled step's first block-format hook
        threads = self._threads() if engine == "c" else 0
        _blocks.add_tensor_block_stats(x, self._blocks[slot], engine=engine, threads=threads)

    def accumulate_blocks_many(self, tensors: Sequence[torch.Tensor], rows: Sequence[int]) -> None:
        """:meth:`accumulate_blocks` of each tensor into its row (an engine may read them all in one call)."""
        for t, r in zip(tensors, rows, strict=True):
            self.accumulate_blocks(t, r)

    def _blocks_due(self, x: torch.Tensor, row: int) -> tuple[int, int | None]:
        """``row``'s block slot when ``x`` is to be added into it (-1: the row has none, or ``x`` as it is now was
        added already), and ``x``'s in-place version for :meth:`_blocks_done`."""
        slot = int(self._block_slot[row])
        if slot < 0:
            return -1, None
        self._written[row] = True
        version = _compat.tensor_version(x)
        if version is not None:
            done = self._blocks_added.get((id(x), row))
            if done is not None and done[0]() is x and done[1] == version:
                return -1, None
        return slot, version

    def _blocks_done(self, x: torch.Tensor, row: int, version: int | None) -> None:
        """``x`` (at ``version``) was added into ``row``'s slot: not again until the next reset."""
        if version is not None:
            self._blocks_added[(id(x), row)] = (weakref.ref(x), version)

    def blocks_dense(self) -> torch.Tensor:
        """The block accumulator, float64 [slots, 2, n_recipes, 5], on this device."""
        self._order_stream()
        return self._blocks
