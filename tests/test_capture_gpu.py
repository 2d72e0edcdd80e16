"""GPU checks of capture: no host synchronisation inside hooks (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import precprof
from precprof import tables as T
from precprof.models import build_model
from precprof.stats import transfer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_profiled_gpt2_small_step_never_syncs(precision: str) -> None:
    """A profiled step of gpt2-small under set_sync_debug_mode("error"): any host sync in a hook raises."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = build_model("gpt2-small", vocab_size=256, seq_len=256).module.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    x = torch.randint(0, 256, (4, 256), device=dev)
    y = torch.randint(0, 256, (4, 256), device=dev)
    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, compile_beside=False)
    with prof:
        for _ in range(2):
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.autocast("cuda", dtype=dtype):
                    logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                scaler.scale(loss).backward()  # activation, weight and gradient hooks run here
                if precision == "bf16":
                    opt.step()  # the weight-update hooks run here
            finally:
                torch.cuda.set_sync_debug_mode(0)
            if precision == "fp16":
                scaler.step(opt)  # GradScaler itself reads found_inf on the host: outside the check
                scaler.update()
            opt.zero_grad(set_to_none=True)
            copies = transfer.copies
            prof.step(loss=loss.detach())  # the one sync per sampled step happens here, outside the check
            assert transfer.copies - copies == 1  # one device-to-host copy of everything (it was 4)
    layers = prof.tables()["layers"]
    assert set(layers[T.STEP]) == {0, 1}
    lin = layers[(layers[T.MODULE_TYPE] == "Linear") & (layers[T.TENSOR] == T.ACTIVATION)]
    assert set(lin[T.DTYPE]) == {str(dtype).removeprefix("torch.")}


def test_attach_before_cuda_and_an_offloaded_layer() -> None:
    """``attach()`` before ``.cuda()`` and a layer left on the CPU: every tensor is read on its own device
    (no foreign pointer reaches an engine), and the numbers are the same as an all-CPU run."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(64, 64)
            self.b = torch.nn.Linear(64, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x.to(self.a.weight.device))
            return self.b(h.to(self.b.weight.device)).cuda()

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1)
    with prof:
        model.a.cuda()  # after attach; b stays on the CPU
        x = torch.randn(16, 64, device="cuda")
        for _ in range(2):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            prof.step(loss=loss)
    layers = prof.tables()["layers"]
    used = prof.summary()["stats_engine"]["used"]
    assert set(used) == {"cpu", "cuda:0"} and used["cuda:0"] == "triton"
    w = layers[(layers[T.MODULE] == "a") & (layers[T.TENSOR] == T.WEIGHT) & (layers[T.PARAM] == "weight")]
    assert len(w) == 2 and int(w[T.NUMEL].iloc[0]) == 64 * 64
    assert not prof.summary()["skipped_tensors"]
