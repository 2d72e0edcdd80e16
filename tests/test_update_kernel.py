"""The weight-update samples read in place (``capture.update_readers``: the C kernel's ``HostSamples``, and
the Triton kernels' ``stats.triton_updates.TritonSamples`` in Triton's interpreter) against the torch path
(``_DeviceGroup.samples`` / ``grad_nonzero`` / ``classify``, real casts), element by element: one parameter per
value, so that a member's counts are that element's flags, on values built at the rounding boundaries of bf16
and fp16 (ties, fp16 subnormals, the edge of fp16's range, signed zeros, inf, nan) and on random ones. The
updates' sizes (``update_sizes``) too: the same within float64's rounding of the sums."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from precprof.capture import update_readers
from precprof.capture.records import _ParamSlot
from precprof.capture.updates import UpdateSampler, _DeviceGroup
from precprof.stats import kernel as cpu_kernel
from precprof.stats import triton_engine, triton_launch, triton_updates
from precprof.stats.engine import ENGINE_ENV

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CPU = torch.device("cpu")
READERS = [
    pytest.param(
        "c",
        marks=pytest.mark.skipif(
            cpu_kernel.load() is None, reason="no C compiler: the torch path runs alone"
        ),
    ),
    pytest.param(
        "triton",
        marks=[
            pytest.mark.skipif(
                triton_engine.unavailable(CPU) is not None or not triton_engine.interpreting(),
                reason="needs triton with TRITON_INTERPRET=1 (pip install triton; conftest sets it without CUDA)",
            ),
            # the interpreter's numpy says so of inf - inf and nan, which the kernel reads on purpose
            pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
            pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
        ],
    ),
]


def _use(group: _DeviceGroup, reader: str | None) -> None:
    """Read ``group``'s samples by ``reader`` ("c", "triton"; None: the torch path)."""
    group._engine = reader or "torch"
    group._reader = None if reader is None else update_readers.reader(group.device, group.members, reader)
    assert (group._reader is None) == (reader is None)


def _run(
    before: list[float],
    after: list[float],
    grads: list[float | None],
    dtype: torch.dtype,
    reader: str | None,
    device: torch.device = CPU,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[elements, 5] counts (sampled, no update, lost in bf16, lost in fp16, lost as held) and [elements, 6]
    sizes of one optimizer step that takes each one-element parameter from ``before`` to ``after`` with
    gradient ``grads`` (None: no gradient)."""
    params = [nn.Parameter(torch.tensor([b], dtype=dtype, device=device)) for b in before]
    slots = [_ParamSlot("m", f"p{i}", p, -1, -1) for i, p in enumerate(params)]
    sampler = UpdateSampler(slots, 4, device)
    (group,) = sampler._groups
    _use(group, reader)
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else torch.tensor([g], dtype=dtype, device=device)
    sampler.before_step()
    assert group._reader_read == (reader is not None)
    with torch.no_grad():
        for p, a in zip(params, after, strict=True):
            p.fill_(a)
    assert sampler.after_step()
    return group.counts.clone(), group.sizes.clone()


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The same counts, and the same sizes within float64's rounding of the sums (their order differs)."""
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-13, atol=0, equal_nan=True)


def _boundary_cases() -> tuple[list[float], list[float], list[float | None]]:
    """(before, after, gradient) triples at the boundaries of what bf16 and fp16 keep."""
    rows: list[tuple[float, float, float | None]] = []
    for w in (
        1.0,
        -1.0,
        3.0,
        2.0**-14,
        2.0**-20,
        5.96e-8,
        1000.0,
        65504.0,
        65519.0,
        65520.0,
        1e30,
        0.0,
        -0.0,
    ):
        for d in (
            2.0**-8,
            2.0**-7,
            2.0**-11,
            2.0**-10,
            2.0**-24,
            2.0**-25,
            2.0**-30,
            3 * 2.0**-9,
            16.0,
            32.0,
        ):
            for sign in (1.0, -1.0):
                rows.append((w, w + sign * d * max(abs(w), 2.0**-14), 1.0))
        rows.append((w, w, 1.0))  # intended, did not move
        rows.append((w, w, 0.0))  # nothing meant, nothing moved
        rows.append((w, w, -0.0))
        rows.append((w, w, None))
        rows.append((w, w, math.nan))
        rows.append((w, -w, 0.0))  # moved without a gradient (weight decay)
    for w, a in (
        (math.inf, math.inf),
        (1.0, math.inf),
        (math.nan, math.nan),
        (1.0, math.nan),
        (-math.inf, 0.0),
    ):
        rows.append((w, a, 1.0))
    before, after, grads = zip(*rows, strict=True)
    return list(before), list(after), list(grads)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_the_kernels_update_counts_are_the_torch_paths_at_the_rounding_boundaries(
    dtype: torch.dtype, reader: str
) -> None:
    before, after, grads = _boundary_cases()
    got = _run(before, after, grads, dtype, reader)
    _same(got, _run(before, after, grads, dtype, None))
    # the boundaries are hit: some updates are lost in each format, some kept, some not meant
    for col in (1, 2, 3):
        assert 0 < int(got[0][:, col].sum()) < len(before)
    assert int(got[1][:, 2].sum()) > 0 and int(got[1][:, 3].sum()) > 0  # nan and inf updates counted


@pytest.mark.parametrize("reader", READERS)
def test_the_kernels_update_counts_match_hand_computed_flags(reader: str) -> None:
    """fp32 weights at 1.0: bf16 keeps steps of 2^-7 (2^-8 is a tie, to even: lost), fp16 of 2^-10 (2^-11
    lost, 3 * 2^-11 rounds to 2^-9: kept); 2^-30 does not even land in fp32 (intended, stuck: lost in both)."""
    before = [1.0] * 6
    after = [1.0 + 2.0**-8, 1.0 + 2.0**-7, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-30, 1.0]
    grads: list[float | None] = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    counts, sizes = _run(before, after, grads, torch.float32, reader)
    assert counts[:, 0].tolist() == [1] * 6
    assert counts[:, 1].tolist() == [0, 0, 0, 0, 0, 1]  # the last: nothing meant, nothing moved
    assert counts[:, 2].tolist() == [1, 0, 1, 1, 1, 0]  # lost in bf16
    assert counts[:, 3].tolist() == [0, 0, 1, 0, 1, 0]  # lost in fp16
    assert counts[:, 4].tolist() == [0, 0, 0, 0, 1, 0]  # lost in the fp32 weight itself
    # the sizes: the squared update that landed (2^-30 did not), the squared weight, the largest and smallest
    assert sizes[:, 0].tolist() == [2.0**-16, 2.0**-14, 2.0**-22, 9 * 2.0**-22, 0.0, 0.0]
    assert sizes[:, 1].tolist() == [1.0] * 6
    assert sizes[:, 4].tolist() == [2.0**-8, 2.0**-7, 2.0**-11, 3 * 2.0**-11, 0.0, 0.0]
    assert sizes[:, 5].tolist() == [2.0**-8, 2.0**-7, 2.0**-11, 3 * 2.0**-11, math.inf, math.inf]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_the_kernels_update_counts_are_the_torch_paths_on_random_values(
    dtype: torch.dtype, reader: str
) -> None:
    """Weights across every binade fp16 has and beyond, updates of a few quarter spacings of bf16 or fp16 at the
    weight (ties among them) and random ones, gradients zero for a third. (Fewer in Triton's interpreter, which
    takes some 10 ms a program: a parameter each.)"""
    rng = np.random.default_rng(0)
    n = 3000 if reader == "c" else 200
    w = rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(-27, 18, n)) * (1 + rng.integers(0, 8, n) / 8)
    spacing = np.exp2(np.floor(np.log2(np.abs(w))) - np.where(rng.random(n) < 0.5, 7, 10))
    delta = np.where(rng.random(n) < 0.8, rng.integers(-6, 7, n) * spacing / 4, rng.normal(0, 1, n) * spacing)
    after = (w.astype(np.float32) + delta.astype(np.float32)).astype(np.float64)
    grads: list[float | None] = [0.0 if r < 0.33 else 1.0 for r in rng.random(n)]
    got = _run(w.tolist(), after.tolist(), grads, dtype, reader)
    _same(got, _run(w.tolist(), after.tolist(), grads, dtype, None))
    assert 0 < int(got[0][:, 2].sum()) < n and 0 < int(got[0][:, 3].sum()) < n


@pytest.mark.parametrize("reader", READERS)
def test_the_kernel_reads_strided_samples_of_whole_layers_like_the_torch_path(reader: str) -> None:
    """A real optimizer step on a small model (several samples per parameter, a bf16 copy of the weights held
    in bf16, a parameter without gradient): the same counts both ways."""
    torch.manual_seed(0)
    counts = []
    for way in (reader, None):
        for dtype in (torch.float32, torch.bfloat16):
            model = nn.Sequential(nn.Linear(40, 30), nn.GELU(), nn.Linear(30, 5), nn.Linear(5, 5)).to(dtype)
            model.load_state_dict({k: v.to(dtype) for k, v in _reference_state().items()})
            params = list(model.named_parameters())
            slots = [_ParamSlot("m", n, p, -1, -1) for n, p in params]
            sampler = UpdateSampler(slots, 16, CPU)
            (group,) = sampler._groups
            _use(group, way)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
            for _ in range(3):
                model[:3](torch.ones(8, 40, dtype=dtype)).float().square().mean().backward()
                sampler.before_step()
                assert group._reader_read == (way is not None)
                opt.step()
                assert sampler.after_step()
                opt.zero_grad()
            counts.append((group.counts.clone(), group.sizes.clone()))
    _same(counts[0], counts[2])
    _same(counts[1], counts[3])
    assert int(counts[1][0][:, 2].sum()) > 0  # bf16 weights lose updates


def _reference_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shapes = {"0.weight": (30, 40), "0.bias": (30,), "2.weight": (5, 30), "2.bias": (5,), "3.weight": (5, 5)}
    state = {k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}
    state["3.bias"] = torch.zeros(5)
    return state


@pytest.mark.parametrize("reader", READERS)
def test_a_parameter_the_kernel_cannot_read_in_place_takes_the_torch_path(reader: str) -> None:
    """A non-contiguous weight, a non-contiguous gradient, a gradient of another dtype than its weight, or a
    weight given new storage during the step: the torch path counts that step, and the counts are what it
    would have counted."""
    torch.manual_seed(0)

    def step(case: str, way: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        lin = nn.Linear(6, 4)
        with torch.no_grad():
            lin.weight.copy_(torch.arange(24.0).reshape(4, 6) / 7)
            lin.bias.copy_(torch.arange(4.0) / 3)
        if case == "transposed weight":
            lin.weight.data = lin.weight.data.t().contiguous().t()
        slots = [_ParamSlot("lin", n, p, -1, -1) for n, p in lin.named_parameters()]
        sampler = UpdateSampler(slots, 8, CPU)
        (group,) = sampler._groups
        _use(group, way)
        lin.weight.grad = torch.ones(4, 6) * (torch.arange(24).reshape(4, 6) % 3 == 0)
        lin.bias.grad = torch.ones(4)
        if case == "transposed gradient":
            lin.weight.grad = lin.weight.grad.t().contiguous().t()
        if case == "bf16 gradient":  # (``.data`` lets a gradient's dtype differ from its parameter's)
            lin.weight.grad.data = lin.weight.grad.data.bfloat16()
        sampler.before_step()
        assert group._reader_read == (way is not None and case in ("plain", "new storage"))
        with torch.no_grad():
            if case == "new storage":
                lin.weight.data = lin.weight.data + 2.0**-9
            else:
                lin.weight.add_(2.0**-9)
            lin.bias.sub_(1.0)
        assert sampler.after_step()
        return group.counts.clone(), group.sizes.clone()

    for case in ("plain", "transposed weight", "transposed gradient", "bf16 gradient", "new storage"):
        _same(step(case, reader), step(case, None))


class _Ops(TorchDispatchMode):
    """The torch ops dispatched inside it, but those of a Triton launch (the interpreter's own copies of its
    arguments), and the launches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launches: list[str] = []
        self.launching = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.launching:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def spy(self, kernels: Any) -> Any:
        """``kernels`` (the kernels' module) with each launch of ``_read`` and ``_classify`` counted."""
        ops = self

        class Launch:
            def __init__(self, name: str) -> None:
                self.name, self.kernel = name, getattr(kernels, name)

            def __getitem__(self, grid: Any) -> Any:
                def run(*args: Any, **kw: Any) -> Any:
                    ops.launches.append(self.name)
                    ops.launching = True
                    try:
                        return self.kernel[grid](*args, **kw)
                    finally:
                        ops.launching = False

                return run

        class Spied:
            _read, _classify = Launch("_read"), Launch("_classify")

            def __getattr__(self, name: str) -> Any:
                return getattr(kernels, name)

        return Spied()


@pytest.mark.parametrize("reader", [p for p in READERS if p.values == ("triton",)])
def test_a_sampled_steps_updates_take_two_launches_and_a_few_ops_whatever_the_parameters(reader: str) -> None:
    """The torch path's ops grow with the parameters (a view of each one's gradient, made in Python, every step:
    245 dispatcher ops for GPT-2 small's 148 parameters, 148 of them those views); the Triton reader's are two
    launches and the table's upload, for 3 parameters as for 60."""
    seen = []
    for n in (3, 60):
        params = [nn.Parameter(torch.randn(7, 5)) for _ in range(n)]
        slots = [_ParamSlot("m", f"p{i}", p, -1, -1) for i, p in enumerate(params)]
        sampler = UpdateSampler(slots, 16, CPU)
        (group,) = sampler._groups
        _use(group, reader)
        ops = _Ops()
        group._reader._kernels = ops.spy(group._reader._kernels)
        for _ in range(2):  # the second step: new gradients, as ``zero_grad(set_to_none=True)`` leaves
            for p in params:
                p.grad = torch.randn_like(p)
            ops.ops.clear()
            ops.launches.clear()
            with ops:
                sampler.before_step()
                with torch.no_grad():
                    for p in params:
                        p.add_(1.0)
                assert sampler.after_step()
        assert ops.launches == ["_read", "_classify"]
        seen.append(sum(ops.ops.values()) - n)  # (less the test's own adds)
        # (both steps counted: every sampled weight moved, and meant to)
        assert group.counts[:, 0].tolist() == [2 * ps.sample_len for ps in slots]
        assert int(group.counts[:, 1].sum()) == 0
    assert seen[0] == seen[1] and seen[0] <= 10, seen


@pytest.mark.parametrize("reader", [p for p in READERS if p.values == ("triton",)])
def test_a_group_the_triton_kernels_cannot_read_takes_torch_ops_for_good(
    reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the Triton engine, a group of fp32 and fp16 weights (one group: neither is bf16) or of float64
    ones has no kernel to launch: its engine is "torch" from the start, so it never asks again at each sampled
    step whether the kernels are loaded; a group of one dtype the kernels read is Triton's, and reads by them."""
    monkeypatch.setenv(ENGINE_ENV, reader)

    def group(*dtypes: torch.dtype) -> _DeviceGroup:
        params = [nn.Parameter(torch.randn(6, 4, dtype=d)) for d in dtypes]
        sampler = UpdateSampler([_ParamSlot("m", f"p{i}", p, -1, -1) for i, p in enumerate(params)], 8, CPU)
        (g,) = sampler._groups
        return g

    for dtypes in ((torch.float32, torch.float16), (torch.float64,)):
        g = group(*dtypes)
        assert (g._engine, g._reader) == ("torch", None), dtypes
    g = group(torch.float16, torch.float16)
    assert g._engine == "triton" and isinstance(g._reader, triton_updates.TritonSamples)


def test_a_failed_compile_of_the_update_kernels_leaves_the_samples_to_torch_ops_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two kernels compile beside the row kernels; another Triton that refuses their code (what this
    machine's cannot show: it is made to raise) must cost the samples their launches, never the rows their
    compile: ``warm`` gives None, nothing is ready, the summary's launch line says why; a later warm that
    compiles clears it."""
    dev = torch.device("cuda", 7)  # a device's name: nothing runs on it
    monkeypatch.setattr(triton_updates, "_READY", set())
    monkeypatch.setattr(triton_updates, "_ERRORS", {})
    monkeypatch.setattr(triton_updates, "interpreting", lambda: False)  # (as on a GPU)
    monkeypatch.setattr(triton_updates, "triton_missing", lambda: None)

    def refuse(device: torch.device, dtypes: object) -> list[object]:
        raise RuntimeError("at 12:8: unsupported cast\n  line two of the compiler's message")

    monkeypatch.setattr(triton_updates, "compile_kernels", refuse)
    got = triton_updates.warm(dev, [torch.float32])
    assert got is None
    triton_updates.load(dev, [torch.float32], got)
    assert not triton_updates.ready(dev, torch.float32)
    said = triton_updates.status(dev)
    assert said == "torch ops (the Triton kernels did not compile: RuntimeError: at 12:8: unsupported cast)"
    monkeypatch.setattr(triton_updates, "compile_kernels", lambda device, dtypes: [])
    triton_updates.load(dev, [torch.float32], triton_updates.warm(dev, [torch.float32]))
    assert triton_updates.ready(dev, torch.float32) and not triton_updates.ready(dev, torch.bfloat16)
    assert triton_updates.status(dev) == "two Triton launches a step"
    assert triton_updates.status(torch.device("cuda", 6)) == "torch ops until the Triton kernels are loaded"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_on_a_gpu_the_triton_kernels_count_what_the_torch_path_counts(dtype: torch.dtype) -> None:
    """Compiled for the GPU (a GPU rounds ``.to(tl.bfloat16)`` where the interpreter truncates; the kernel
    rounds bf16 by its bits, the same on both), at the rounding boundaries and on a real model's steps."""
    if triton_engine.unavailable(torch.device("cuda")) is not None:
        pytest.skip(f"no Triton here: {triton_engine.unavailable(torch.device('cuda'))}")
    dev = torch.device("cuda", torch.cuda.current_device())
    triton_launch.load_kernels(triton_updates.compile_kernels(dev, [dtype]))
    triton_updates.loaded(dev, [dtype])
    before, after, grads = _boundary_cases()
    got = _run(before, after, grads, dtype, "triton", dev)
    _same(got, _run(before, after, grads, dtype, None, dev))
    for col in (1, 2, 3):
        assert 0 < int(got[0][:, col].sum()) < len(before)
