"""Parameters on several devices, and what a sampled step copies to the host.

A model may keep a layer on another device than the rest (CPU offload beside CUDA layers; here the CPU beside
the ``meta`` device, which has no data): the Profiler samples each parameter where it lives and skips what it
cannot read, and the user's ``optimizer.step()`` goes on. A sampled step's data reaches the host in one
transfer per device (``precprof.stats.transfer.to_host``), the Profiler's one sync point.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof._compat import indexed_device
from precprof.capture import profiler as profiler_module
from precprof.capture import records
from precprof.stats import StatsBuffer, transfer
from precprof.stats.rows import same_values


class TwoDevices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def losses(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One loss per device: autograd cannot carry a gradient from ``meta`` back to the CPU."""
        la = self.a(x).square().mean()
        w = self.b.weight
        lb = self.b(torch.ones(2, 8, device=w.device)).square().mean()
        return [la, lb]


def _train(model: TwoDevices, opt: torch.optim.Optimizer, prof: precprof.Profiler | None) -> None:
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8)
        opt.zero_grad(set_to_none=True)
        losses = model.losses(x)
        for loss in losses:
            loss.backward()
        opt.step()
        if prof is not None:
            prof.step(loss=losses[0].detach())


def _update_rows(prof: precprof.Profiler) -> pd.DataFrame:
    layers = prof.tables()["layers"]
    return layers[layers[T.TENSOR] == T.WEIGHT_UPDATE].sort_values([T.STEP, T.MODULE, T.PARAM])


def _to_meta_in_place(module: nn.Module) -> None:
    """Move ``module``'s parameters to ``meta`` keeping the Parameter objects, as ``.cuda()`` does on a GPU
    (``module.to("meta")`` would make new ones)."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def test_a_layer_moved_after_attach_is_sampled_where_it_lives_and_training_goes_on() -> None:
    """On an H100, ``attach()`` before ``model.a.cuda()`` made the user's ``optimizer.step()`` raise: the
    update sampler concatenated samples from two devices. The same with the CPU and ``meta``."""
    torch.manual_seed(0)
    mixed = TwoDevices()
    torch.manual_seed(0)
    plain = TwoDevices()
    plain.b.to("meta")
    opt = torch.optim.SGD(mixed.parameters(), lr=0.1, momentum=0.9)
    prof = precprof.Profiler(mixed, optimizer=opt, sample_every=1, block_formats=False)
    with prof:
        b_weight = mixed.b.weight
        _to_meta_in_place(mixed.b)
        assert mixed.b.weight is b_weight and b_weight.device.type == "meta"
        _train(mixed, opt, prof)  # raised in the optimizer's pre-hook: torch.cat over cpu and meta
    _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), None)
    for name in ("weight", "bias"):
        assert torch.equal(getattr(mixed.a, name), getattr(plain.a, name))  # training unchanged
    upd = _update_rows(prof)
    assert set(upd[T.MODULE]) == {"a"}  # b has no data to sample
    assert sorted(set(upd[T.PARAM])) == ["bias", "weight"]
    assert len(upd) == 3 * 2 and (upd[T.NUMEL] > 0).all()
    skipped = {(s["module"], s["tensor"]) for s in prof.summary()["skipped_tensors"]}
    assert ("b", T.WEIGHT) in skipped


def test_update_counts_equal_a_single_device_run() -> None:
    """The CPU layer's weight-update counts do not depend on where the other layer lives."""
    runs = []
    for b_device in ("cpu", "meta"):
        torch.manual_seed(0)
        model = TwoDevices()
        model.b.to(b_device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        prof = precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=False)
        with prof:
            _train(model, opt, prof)
        upd = _update_rows(prof)
        runs.append(upd[upd[T.MODULE] == "a"][[T.STEP, T.PARAM, T.NUMEL, T.ZEROS]].reset_index(drop=True))
    pd.testing.assert_frame_equal(runs[0], runs[1])


def test_pack_and_unpack_keep_every_dtype_and_shape() -> None:
    tensors = [
        torch.arange(12, dtype=torch.int64).reshape(3, 4) - 6,
        torch.tensor([1.5, float("nan"), -float("inf"), 2.0**-1074], dtype=torch.float64),
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.int32).reshape(5, 1),
        torch.tensor(3.25, dtype=torch.float32),
        torch.tensor([[0.0, -0.0]], dtype=torch.float64).t(),  # not contiguous
    ]
    packed = transfer._pack(tensors)
    assert packed.dtype == torch.uint8 and packed.numel() == sum(
        t.numel() * t.element_size() for t in tensors
    )
    back = transfer._unpack(packed.numpy(), tensors)
    for t, a in zip(tensors, back, strict=True):
        assert a.shape == tuple(t.shape) and a.dtype == t.numpy().dtype
        np.testing.assert_array_equal(a, t.numpy())
        assert a.tobytes() == t.contiguous().numpy().tobytes()  # bit for bit (-0.0, nan)
    with pytest.raises(TypeError, match="bfloat16"):
        transfer.to_host([torch.zeros(2, dtype=torch.bfloat16)])


_HOST_READS = ("cpu", "item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


def test_a_device_loss_is_held_without_a_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prof.step(loss=...)``'s hold of a loss not on the CPU (meta stands in for a device here) is a copy on its
    device, with no host read: only a plain CPU tensor is read at once."""
    reads: list[str] = []
    for name in _HOST_READS:
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, _real=real, _name=name, **k):  # type: ignore[no-untyped-def]
            reads.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    held = records.held_scalar(torch.empty((), device="meta"))
    held_vector = records.held_scalar(torch.empty(3, device="meta"))
    monkeypatch.undo()
    assert reads == []
    assert isinstance(held, torch.Tensor) and held.device.type == "meta" and held.dim() == 0
    assert isinstance(held_vector, torch.Tensor) and held_vector.dim() == 0
    assert (
        records.held_scalar(torch.tensor([2.5, 1.0])) == 2.5 and records.held_scalar(torch.empty(0)) is None
    )


def test_a_sampled_step_reads_device_data_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prof.step()`` of a sampled step calls ``transfer.to_host`` once, and reads no tensor to the host
    anywhere else (``.cpu()``, ``.item()``, ``bool(t)``, ...: each of those is a sync on a GPU)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=2)
    calls = {"to_host": 0, "outside": []}
    inside = {"depth": 0}
    real_to_host = transfer.to_host

    def to_host(tensors):  # type: ignore[no-untyped-def]
        calls["to_host"] += 1
        inside["depth"] += 1
        try:
            return real_to_host(tensors)
        finally:
            inside["depth"] -= 1

    def spy(name):  # type: ignore[no-untyped-def]
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):  # type: ignore[no-untyped-def]
            if spying["on"] and not inside["depth"]:
                calls["outside"].append(name)
            return real(self, *a, **k)

        return wrapper

    real_held = records.held_scalar

    def held_scalar(t):  # type: ignore[no-untyped-def]
        # a CPU loss is read at once, as a float (one op that waits for nothing: no device); a device loss is
        # copied on its device (test_a_device_loss_is_held_without_a_host_read)
        inside["depth"] += t.is_cpu
        try:
            return real_held(t)
        finally:
            inside["depth"] -= t.is_cpu

    spying = {"on": False}
    with prof:
        monkeypatch.setattr(transfer, "to_host", to_host)
        monkeypatch.setattr(profiler_module, "held_scalar", held_scalar)
        for name in _HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, spy(name))
        for step in range(4):
            x = torch.randn(8, 16)
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            spying["on"] = True
            before = calls["to_host"]
            prof.step(loss=loss.detach(), grad_norm=norm)
            spying["on"] = False
            assert calls["to_host"] - before == (1 if step % 2 == 0 else 0), step
        monkeypatch.undo()
    assert calls["outside"] == []
    layers = prof.tables()["layers"]
    assert set(layers[T.STEP]) == {0, 2} and (layers[T.TENSOR] == T.WEIGHT_UPDATE).any()
    steps = prof.tables()["steps"]
    assert steps[T.LOSS].notna().all() and steps[T.GRAD_NORM].notna().all()


def test_device_names_are_normalised_to_what_tensors_report(monkeypatch: pytest.MonkeyPatch) -> None:
    assert indexed_device("cpu:0") == torch.device("cpu") == torch.zeros(1).device
    assert indexed_device("meta") == torch.device("meta")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert indexed_device("cuda") == torch.device("cuda", 2)  # what a tensor made on "cuda" reports
    assert indexed_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_a_buffer_named_by_another_spelling_keeps_one_row_set() -> None:
    """On an H100 ``StatsBuffer(rows, "cuda")`` opened rows under ``cuda`` and a second set under the tensors'
    ``cuda:0``; ``cpu:0`` and ``cpu`` are the same case on the CPU."""
    buf = StatsBuffer(1, "cpu:0")
    x = torch.randn(1000)
    buf.accumulate(x, 0)
    assert buf.engines == {"cpu": "c"} or buf.engines == {"cpu": "torch"}
    one = StatsBuffer(1, "cpu")
    one.accumulate(x, 0)
    assert np.array_equal(buf.to_host(), one.to_host())


def _three_steps(
    make: Callable[[], tuple[nn.Module, torch.optim.Optimizer]],
    inputs: Callable[[], torch.Tensor],
    profiled: bool,
    before_step: Callable[[nn.Module], None] | None = None,
    **options: Any,
) -> tuple[nn.Module, list[float], precprof.Profiler | None]:
    """Three training steps of the model ``make`` builds (seed 0) on ``inputs()`` (seed 1), the loss the mean
    square of the output, with a Profiler sampling every step (its kernels compiled at attach: a compile
    beside the training may hold sampling past three steps) or without; ``before_step(model)`` after each
    backward; ``options``: the Profiler's others. Returns the model, the losses and the Profiler."""
    torch.manual_seed(0)
    model, opt = make()
    kw = {"sample_every": 1, "compile_beside": False, **options}
    prof = precprof.Profiler(model, optimizer=opt, **kw).attach() if profiled else None
    torch.manual_seed(1)
    losses = []
    for _ in range(3):
        loss = model(inputs()).float().square().mean()
        loss.backward()
        if before_step is not None:
            before_step(model)
        opt.step()
        opt.zero_grad()
        if prof is not None:
            prof.step()
        losses.append(float(loss.detach()))
    return model, losses, prof


@pytest.mark.parametrize("engine", ["c", "triton"])
def test_a_sparse_gradient_is_skipped_counted_and_reported_and_training_goes_on(
    engine: str, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    """``nn.Embedding(sparse=True)``'s gradient is a sparse tensor: the gradient read at the end of backward
    raised (no data pointer), and the update sampler's gradient sample in ``optimizer.step()``'s pre-hook
    raised. Its row is skipped, counted and said why (summary and report); every other row is the C kernel's
    rows of the same tensors, and training is bitwise what it is without precprof."""
    if engine == "triton":
        from precprof.stats import triton_engine

        if triton_engine.unavailable(torch.device("cpu")) is not None:
            pytest.skip(str(triton_engine.unavailable(torch.device("cpu"))))
    monkeypatch.setenv("PRECPROF_STATS_ENGINE", engine)

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Linear(8, 4))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    grads: list[torch.Tensor] = []
    plain, plain_losses, _ = _three_steps(make, lambda: torch.randint(0, 50, (6, 5)), False)
    model, losses, prof = _three_steps(make, lambda: torch.randint(0, 50, (6, 5)), True,
                                       lambda m: grads.append(m[1].weight.grad.clone()))  # fmt: skip
    grad = grads[-1]
    assert prof is not None
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    summary = prof.summary()
    (skipped,) = summary["skipped_tensors"]
    assert (skipped["module"], skipped["tensor"], skipped["param"]) == ("0", T.WEIGHT_GRAD, "weight")
    assert skipped["count"] == summary["sampled_steps"] == 3
    assert "sparse_coo" in skipped["reason"]
    layers = prof.tables()["layers"]
    step = layers[(layers[T.STEP] == 2) & (layers[T.MODULE] == "1") & (layers[T.TENSOR] == T.WEIGHT_GRAD)]
    c = StatsBuffer(1, "cpu", engine="c")
    c.accumulate(grad, 0)
    assert int(step[T.NUMEL].iloc[0]) == 32 and int(step[T.ZEROS].iloc[0]) == int(
        c.to_host()[0][c.layout.zeros]
    )
    assert not ((layers[T.MODULE] == "0") & (layers[T.TENSOR] == T.WEIGHT_GRAD)).any()
    prof.save(tmp_path / "run", render=True)  # type: ignore[operator]
    html = (tmp_path / "run" / "report.html").read_text()  # type: ignore[operator]
    assert 'id="skipped-tensors"' in html and "sparse_coo tensor" in html
    assert 'id="verdict-not-measured">1 tensor precprof could not read' in html
    prof.detach()


class _ComplexMix(nn.Module):
    """A complex parameter (as an SSM's) beside a real linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.complex64))
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin((torch.fft.fft(x) * self.w).real)


def test_a_complex_parameter_is_skipped_counted_and_reported_and_training_goes_on() -> None:
    """A complex parameter's gradient was read as its real part (torch's warning about discarding the imaginary
    part came from precprof's statistics), and its weight not at all. Both are skipped, counted and said why;
    the update sample leaves it out and says so (its update was dropped with nothing to say it); no warning;
    training is bitwise what it is without precprof."""
    import warnings

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _ComplexMix()
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    plain, plain_losses, _ = _three_steps(make, lambda: torch.randn(4, 8), False)
    with warnings.catch_warnings(record=True) as said:  # (precprof's warnings are shown, never raised)
        warnings.simplefilter("always")
        model, losses, prof = _three_steps(make, lambda: torch.randn(4, 8), True)
    assert not said, [str(w.message) for w in said]
    assert prof is not None and losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    skipped = {(s["tensor"], s["param"], s["count"]) for s in prof.summary()["skipped_tensors"]}
    # three sampled steps, each with one optimizer step
    assert skipped == {(T.WEIGHT, "w", 3), (T.WEIGHT_GRAD, "w", 3), (T.WEIGHT_UPDATE, "w", 3)}
    assert all("complex64" in s["reason"] for s in prof.summary()["skipped_tensors"])
    layers = prof.tables()["layers"]
    assert not (layers[T.PARAM] == "w").any()
    assert set(layers[layers[T.MODULE] == "lin"][T.TENSOR]) >= {
        T.WEIGHT,
        T.WEIGHT_GRAD,
        T.ACTIVATION,
        T.WEIGHT_UPDATE,
    }
    prof.detach()


@pytest.mark.parametrize("engine", ["c", "triton"])
def test_a_wrapper_subclass_parameter_is_skipped_and_training_goes_on(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parameter that is a wrapper tensor subclass (``TwoTensor`` here; torchao's NF4 weights are one) has no
    storage of its own: its ``data_ptr()`` is 0, and the C kernel reading it ended the process (a segmentation
    fault in the first forward). It is skipped, counted and said why, as is everything it spreads to (its
    layer's outputs and gradients are TwoTensors too); its update is not sampled; the other layer's weight is
    read; training is bitwise what it is without precprof."""
    from torch.testing._internal.two_tensor import TwoTensor

    if engine == "triton":
        from precprof.stats import triton_engine

        if triton_engine.unavailable(torch.device("cpu")) is not None:
            pytest.skip(str(triton_engine.unavailable(torch.device("cpu"))))
    monkeypatch.setenv("PRECPROF_STATS_ENGINE", engine)

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        first = nn.Linear(8, 8)
        w = first.weight.detach()
        first.weight = nn.Parameter(TwoTensor(w.clone(), w.clone()))
        model = nn.Sequential(first, nn.Linear(8, 4))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    plain, plain_losses, _ = _three_steps(make, lambda: torch.randn(4, 8), False)
    model, losses, prof = _three_steps(make, lambda: torch.randn(4, 8), True)
    assert prof is not None and losses == plain_losses
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.a, b.a) if isinstance(a, TwoTensor) else torch.equal(a, b)
    summary = prof.summary()
    skipped = {(s["module"], s["tensor"], s["param"]) for s in summary["skipped_tensors"]}
    assert ("0", T.WEIGHT, "weight") in skipped and ("0", T.WEIGHT_GRAD, "weight") in skipped
    assert ("0", T.WEIGHT_UPDATE, "weight") in skipped  # (its update is not sampled, and said so)
    assert all("TwoTensor" in s["reason"] for s in summary["skipped_tensors"])
    layers = prof.tables()["layers"]
    read = set(zip(layers[T.MODULE], layers[T.TENSOR], layers[T.PARAM], strict=True))
    assert ("1", T.WEIGHT, "weight") in read and ("0", T.WEIGHT, "weight") not in read
    assert ("0", T.WEIGHT_UPDATE, "weight") not in read and ("1", T.WEIGHT_UPDATE, "weight") in read
    prof.detach()


class _QLoRA(nn.Module):
    """A frozen NF4 base weight (torchao's, as QLoRA fine-tuning holds it) and a trained low-rank adapter."""

    def __init__(self, d: int = 256, r: int = 4) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        base = nn.Linear(d, d, bias=False).weight.detach().bfloat16()
        self.weight = nn.Parameter(to_nf4(base), requires_grad=False)
        self.a = nn.Linear(d, r, bias=False)
        self.b = nn.Linear(r, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.b(self.a(x.float())).to(x.dtype)


def test_qlora_with_torchaos_nf4_weights_trains_the_same_and_reads_the_adapters() -> None:
    """QLoRA as torchao holds it: the frozen base weights are NF4 tensors (a wrapper subclass, ``data_ptr()``
    0), which ended the process in the first sampled forward. They are skipped and said why; the adapters'
    weights, gradients and updates and every activation are read; training is bitwise unchanged."""
    pytest.importorskip("torchao")

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(_QLoRA(), _QLoRA())
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def inputs() -> torch.Tensor:
        return torch.randn(8, 256, dtype=torch.bfloat16)

    plain, plain_losses, _ = _three_steps(make, inputs, False)
    model, losses, prof = _three_steps(make, inputs, True)
    assert prof is not None and losses == plain_losses
    adapters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert len(adapters) == 4
    assert all(torch.equal(p, dict(plain.named_parameters())[n]) for n, p in adapters)
    skipped = {
        (s["module"], s["tensor"], s["reason"].split(",")[0]) for s in prof.summary()["skipped_tensors"]
    }
    assert skipped == {("0", T.WEIGHT, "a NF4Tensor"), ("1", T.WEIGHT, "a NF4Tensor")}
    layers = prof.tables()["layers"]
    read = set(zip(layers[T.MODULE], layers[T.TENSOR], strict=True))
    for m in ("0.a", "0.b", "1.a", "1.b"):
        assert {(m, T.WEIGHT), (m, T.WEIGHT_GRAD), (m, T.WEIGHT_UPDATE), (m, T.ACTIVATION)} <= read
    assert ("0", T.ACTIVATION) in read and ("1", T.ACTIVATION_GRAD) in read
    prof.detach()


def test_what_the_engines_cannot_read_is_named_and_the_rest_is_read() -> None:
    """``stats.buffer.unreadable``: a reason for each kind of tensor no engine reads in place, None for the
    rest (a parameter, a view, a 0-dim tensor, fp8)."""
    import warnings

    from torch.testing._internal.two_tensor import TwoTensor

    from precprof.stats.buffer import unreadable

    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: sparse CSR support is in beta; strided nested, a prototype)
        csr = x.to_sparse_csr()
        strided_nested = torch.nested.as_nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    nested = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)
    cases = {
        "meta device": torch.empty(3, device="meta"),
        "sparse_coo tensor, whose values precprof does not read (summing": x.to_sparse(),
        "sparse_csr tensor, whose values precprof does not read": csr,
        # (the hooks read a nested tensor's elements, ``records._readable``: one reaching the buffer could not be)
        "a nested tensor whose elements": nested,
        "a nested tensor whose": strided_nested,
        "complex tensor (complex64)": torch.randn(3, dtype=torch.complex64),
        "a TwoTensor, a tensor subclass": TwoTensor(x, x.clone()),
    }
    for words, t in cases.items():
        why = unreadable(t)
        assert why is not None and words in why, (words, why)
    assert unreadable(csr) is not None and "duplicates" not in str(unreadable(csr))
    for t in (nn.Parameter(x), x.t()[1:], x[0, 0], x.to(torch.float8_e4m3fn), x.bfloat16()):
        assert unreadable(t) is None


def test_torchaos_float8_weight_wrapper_is_read_through_to_the_weight_it_wraps() -> None:
    """torchao's weight for FSDP2's float8 all-gather (``WeightWithDynamicFloat8CastTensor``) wraps the bf16
    or fp32 weight itself; its own ``data_ptr()`` is 0. precprof reads the tensor inside: the weight's rows
    (read before the step's update) equal the C kernel's rows of the wrapped tensor, its update is sampled,
    nothing is skipped, and training is bitwise what it is without precprof."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        first = nn.Linear(16, 16)
        w = first.weight.detach().clone()
        first.weight = nn.Parameter(
            WeightWithDynamicFloat8CastTensor(w, LinearMMConfig(), torch.float8_e4m3fn)
        )
        model = nn.Sequential(first, nn.Linear(16, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    weights: list[torch.Tensor] = []  # the values each step's weight read saw (before its update)
    assert nn.Linear(2, 2).weight.data_ptr() != 0
    plain, plain_losses, _ = _three_steps(make, lambda: torch.randn(8, 16), False)
    model, losses, prof = _three_steps(make, lambda: torch.randn(8, 16), True,
                                       lambda m: weights.append(m[0].weight._tensor.detach().clone()))  # fmt: skip
    last = weights[-1]
    assert prof is not None and losses == plain_losses
    assert model[0].weight.data_ptr() == 0  # (the wrapper's own: nothing to read there)
    assert torch.equal(model[0].weight._tensor, plain[0].weight._tensor)
    assert not prof.summary()["skipped_tensors"]
    layers = prof.tables()["layers"]
    row = layers[(layers[T.STEP] == 2) & (layers[T.MODULE] == "0") & (layers[T.TENSOR] == T.WEIGHT)]
    row = row[row[T.PARAM] == "weight"]
    c = StatsBuffer(1, "cpu", engine="c")
    c.accumulate(last, 0)
    want = c.to_host()[0]
    assert int(row[T.NUMEL].iloc[0]) == 256 and int(row[T.ZEROS].iloc[0]) == int(want[c.layout.zeros])
    assert float(row[T.ABSMAX].iloc[0]) == float(last.abs().max())
    assert ((layers[T.MODULE] == "0") & (layers[T.TENSOR] == T.WEIGHT_UPDATE)).any()
    prof.detach()


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor
    aux: torch.Tensor


def test_a_dataclass_output_is_read_and_a_complex_one_is_said_skipped() -> None:
    """A module returning a plain ``@dataclass`` of tensors had no activation rows (its weight rows were there,
    the table showed "act. dtype —"), and one returning a complex tensor recorded nothing, with no word in
    ``skipped_tensors``, where a sparse gradient is named. The dataclass's tensors are read, as a dict's are;
    the complex output is skipped and counted, and so is the gradient that comes back to it (it was dropped
    with nothing to say it)."""

    class DC(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> _Out:
            y = self.lin(x)
            return _Out(hidden=y, aux=y.square().mean())

    class Spectral(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.fft.rfft(x)

    torch.manual_seed(0)
    dc, spectral = DC(), Spectral()
    model = nn.ModuleDict({"dc": dc, "spectral": spectral})
    x = torch.randn(4, 8)
    with precprof.Profiler(model, modules=["dc", "spectral"], sample_every=1) as prof:
        out = dc(x)
        seen = [out.hidden.detach().clone(), out.aux.detach().clone()]
        (spectral(out.hidden).abs().sum() + out.aux).backward()
        prof.step()
    layers = prof.tables()["layers"]
    act = layers[(layers[T.MODULE] == "dc") & (layers[T.TENSOR] == T.ACTIVATION)]
    assert len(act) == 1 and int(act[T.NUMEL].iloc[0]) == 32 + 1 and int(act[T.CALLS].iloc[0]) == 1
    assert float(act[T.ABSMAX].iloc[0]) == float(torch.cat([t.flatten() for t in seen]).abs().max())
    assert ((layers[T.MODULE] == "dc") & (layers[T.TENSOR] == T.ACTIVATION_GRAD)).any()
    skipped = prof.summary()["skipped_tensors"]
    assert {(s["module"], s["tensor"], s["count"]) for s in skipped} == {
        ("spectral", T.ACTIVATION, 1),
        ("spectral", T.ACTIVATION_GRAD, 1),
    }
    assert all("complex" in s["reason"] for s in skipped)


class _Nested(nn.Module):
    """A layer between layers that hands on a padded batch as a nested tensor (``torch.nested``) of its rows'
    first ``lengths`` positions, scaled so that some of its values underflow fp16 (or, ``nested=False``, the same
    rows as one plain tensor, one after another: what a nested tensor's statistics must equal)."""

    def __init__(self, layout: torch.layout, nested: bool = True) -> None:
        super().__init__()
        self.layout, self.nested = layout, nested

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows = [h[i, :n] * 1e-6 for i, n in enumerate((6, 2, 4))]
        return torch.nested.as_nested_tensor(rows, layout=self.layout) if self.nested else torch.cat(rows)


class _Padded(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_nested:
            return x
        return torch.nested.to_padded_tensor(x, 0.0) if x.layout is torch.strided else x.to_padded_tensor(0.0)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.usefixtures("block_formats_on")
def test_nested_tensors_are_read_as_their_elements_and_training_goes_on(layout: torch.layout) -> None:
    """A nested tensor between layers (a frozen ``nn.TransformerEncoder``'s fast path makes them of a padded
    batch) ended the first sampled step ("NestedTensorImpl doesn't support sizes", a linear layer's input read
    for the block what-if), and a jagged one was skipped. Read as its elements, one after another: its rows (the
    output, its gradient, the next linear layer's input, the block what-if) count what one plain tensor of its
    elements counts, nothing is skipped; a nested input to the model too (its memory measured); training is
    bitwise what it is without precprof (tester t3)."""

    def make(nested: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(
            nn.Linear(8, 64),
            _Nested(layout, nested),
            nn.Linear(64, 64),
            nn.GELU(),
            nn.Linear(64, 4),
            _Padded(),
        )
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    inputs = lambda: torch.randn(3, 6, 8)  # noqa: E731
    plain, plain_losses, _ = _three_steps(make, inputs, False)
    model, losses, prof = _three_steps(make, inputs, True, block_groups=1)
    assert prof is not None and losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    assert prof.summary()["skipped_tensors"] == []
    _, _, flat = _three_steps(lambda: make(nested=False), inputs, True, block_groups=1)
    assert flat is not None
    layers, flat_layers = prof.tables()["layers"], flat.tables()["layers"]
    prof.detach()
    flat.detach()
    first = layers[(layers[T.STEP] == 0) & (layers[T.MODULE] == "1")].set_index(T.TENSOR)
    want = flat_layers[(flat_layers[T.STEP] == 0) & (flat_layers[T.MODULE] == "1")].set_index(T.TENSOR)
    # (its values: 12 positions of 64 features, some underflowing fp16; read with the block what-if)
    assert first.loc[T.ACTIVATION, "numel"] == 12 * 64 and first.loc[T.ACTIVATION, "underflow_fp16"] > 0
    assert first.loc[T.ACTIVATION, "blk_row_mxfp4_sum_x2"] > 0
    pd.testing.assert_series_equal(first.loc[T.ACTIVATION], want.loc[T.ACTIVATION])
    assert first.loc[T.ACTIVATION_GRAD, "numel"] == 12 * 64 and first.loc[T.ACTIVATION_GRAD, "calls"] == 1
    assert not layers[T.MODULE].str.endswith(":input").any() or set(
        layers[layers[T.MODULE].str.endswith(":input")][T.MODULE]
    ) == {"0:input"}

    class Inner(nn.Module):  # the model's own input nested
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(8, 16), nn.Linear(16, 4), _Padded()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.b(self.a(x)))

    model = Inner()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precprof.Profiler(
        model, optimizer=opt, sample_every=1, compile_beside=False, block_groups=1
    ) as prof:
        for _ in range(2):
            x = torch.nested.as_nested_tensor([torch.randn(n, 8) for n in (5, 2, 3)], layout=layout)
            with prof.memory_scope():
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
    a_input = prof.tables()["layers"].query("module == 'a:input' and step == 0")
    assert list(a_input["numel"]) == [10 * 8] and prof.summary()["skipped_tensors"] == []


class _PassThrough(nn.Module):
    """A residual block as nanoGPT's at ``dropout=0.0``: the projection's output passes through a dropout that
    returns it (the same tensor), then an identity, and so does its gradient; then a flatten and an unflatten,
    which return views of the same memory (their gradients too)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.0)
        self.same = nn.Identity()
        self.flat = nn.Flatten(0)
        self.unflat = nn.Unflatten(0, (8, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.unflat(self.flat(self.same(self.drop(self.fc(x))))))


def test_the_same_values_are_the_same_object_or_a_view_of_the_same_contiguous_memory() -> None:
    x = torch.randn(8, 16)
    assert same_values(x, x) and same_values(x, x.view(-1)) and same_values(x.view(2, 64), x.reshape(16, 8))
    assert not same_values(None, x)
    assert not same_values(x, x.clone())  # other memory
    assert not same_values(x, x[:4]) and not same_values(x[4:], x[4:].view(-1)[:8])  # fewer values
    assert not same_values(x, x.t()) and not same_values(x.t(), x)  # a transposed view reads in another order
    assert not same_values(x, x.view(torch.int32))  # the same bits as other values
    assert not same_values(x, x.to(torch.bfloat16))


def test_a_module_returning_its_input_gets_its_rows_without_a_second_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device rows (CUDA's; Triton's interpreter here) copy the row of a tensor read a moment before into the
    row of a module that returned it unchanged (``nn.Dropout(p=0)``, ``nn.Identity``) and of its gradient,
    where they read it again before: the layer rows equal the C kernel's, which merges such a read on the CPU,
    with two reads fewer per pass-through module and sampled step."""
    from precprof.stats import rows_device, triton_engine

    if triton_engine.unavailable(torch.device("cpu")) is not None:
        pytest.skip(str(triton_engine.unavailable(torch.device("cpu"))))
    reads = [0]
    add = triton_engine.TritonRows.add

    def counted(self: Any, *args: Any) -> bool:
        reads[0] += 1
        return add(self, *args)

    monkeypatch.setattr(triton_engine.TritonRows, "add", counted)
    device_add = rows_device.DeviceRows.add

    def every(self: Any, x: torch.Tensor, row: int, assign: bool = False) -> None:
        self._last_read = None
        device_add(self, x, row, assign)

    tables = {}
    for engine in ("c", "triton", "triton-every-read"):
        monkeypatch.setenv("PRECPROF_STATS_ENGINE", engine.removesuffix("-every-read"))
        if engine == "triton-every-read":  # the rows of a read of every call, as before
            monkeypatch.setattr(rows_device.DeviceRows, "add", every)
        torch.manual_seed(0)
        model = _PassThrough()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        reads[0] = 0
        with precprof.Profiler(
            model, optimizer=opt, sample_every=1, memory=False, compile_beside=False
        ) as prof:
            for _ in range(2):
                model(torch.randn(8, 16)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        tables[engine] = (prof.tables()["layers"], prof.tables()["histograms"], reads[0])
    layers, hist, reads_copied = tables["triton"]
    _, _, reads_every = tables["triton-every-read"]
    # per step: drop, same, flat and unflat, output and gradient, copied (the weights and their gradients go 16 a
    # launch)
    assert reads_every - reads_copied == 2 * 4 * 2
    kept = [T.STEP, T.MODULE, T.TENSOR, T.PARAM, T.NUMEL, T.ZEROS, T.ABSMAX, T.ABSMIN, T.CALLS]
    for engine in ("c", "triton-every-read"):
        other_layers, other_hist, _ = tables[engine]
        pd.testing.assert_frame_equal(layers[kept], other_layers[kept])
        pd.testing.assert_frame_equal(hist, other_hist)
    drop = layers[(layers[T.MODULE] == "drop") & (layers[T.STEP] == 1)]
    assert set(drop[T.TENSOR]) == {T.ACTIVATION, T.ACTIVATION_GRAD}
