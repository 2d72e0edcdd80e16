"""Device capabilities, presets, the usual-format decision tree, versions and the `precprof env` text."""

from __future__ import annotations

import platform

import pytest
import torch

from precprof import hardware
from precprof.hardware import HardwareInfo


def test_detect_cpu() -> None:
    info = hardware.detect("cpu")
    assert info.device == "cpu" and not info.is_cuda
    assert info.compute_capability is None and not info.fp8_supported and not info.tf32_supported
    assert info.bf16_supported
    assert info.tf32_matmul_enabled == torch.backends.cuda.matmul.allow_tf32
    assert info.float32_matmul_precision == torch.get_float32_matmul_precision()
    assert HardwareInfo.from_dict(info.to_dict()) == info


@pytest.mark.parametrize("flags", [set(), {"avx512_fp16", "amx_bf16"}])
def test_detect_records_the_cpus_fp16_and_bf16_arithmetic(
    flags: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recording CPU's fp16 and bf16 arithmetic go into the run's hardware block, so that a run compared or
    reported on another machine is judged by the CPU that trained it; the report's environment section and
    ``precprof env`` say both. A block recorded before ``fp16_native`` existed says nothing of fp16."""
    from precprof.report.environment import machine_rows

    monkeypatch.setattr(hardware, "_cpu_flags", lambda: flags)
    info = hardware.detect("cpu")
    native = bool(flags)
    assert (info.fp16_native, info.bf16_native) == (native, native)
    assert HardwareInfo.from_dict(info.to_dict()) == info
    (formats,) = [text for key, text in machine_rows(info.to_dict()) if key == "number formats"]
    said = "fp16 in hardware" if native else "fp16 emulated (no fp16 arithmetic in hardware)"
    assert said in formats and ("bf16 in hardware" if native else "bf16 emulated") in formats
    assert f"fp16 arithmetic in hardware (AVX512-FP16/AMX-FP16): {'yes' if native else 'no'}" in (
        hardware.env_report(info)
    )
    older = {k: v for k, v in info.to_dict().items() if k != "fp16_native"}
    assert HardwareInfo.from_dict(older).fp16_native is None
    assert "fp16" not in dict(machine_rows(older))["number formats"]


def test_presets_round_trip_and_errors() -> None:
    for name in hardware.PRESET_NAMES:
        p = hardware.preset(name)
        assert p.preset == name
        assert HardwareInfo.from_dict(p.to_dict()) == p
    assert hardware.preset(" H100 ").compute_capability == (9, 0)
    with pytest.raises(ValueError, match="known targets"):
        hardware.preset("z80")


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("v100", "fp16"),
        ("t4", "fp16"),
        ("a100", "bf16"),
        ("l4", "bf16"),
        ("h100", "bf16"),
        ("b200", "bf16"),
        ("gb200", "bf16"),
        ("cpu", "fp32"),
    ],
)
def test_usual_format(name: str, fmt: str) -> None:
    got, why = hardware.usual_format(hardware.preset(name))
    assert got == fmt and why
    if name in ("l4", "h100", "b200", "gb200"):
        assert "fp8" in why
    if fmt == "fp16":
        assert "loss scaling" in why


def test_usual_format_cpu_with_native_bf16() -> None:
    # native bf16 on a CPU is no measured speed: fp32 until precprof compare measures a gain
    info = HardwareInfo(device="cpu", name="cpu", bf16_supported=True, bf16_native=True)
    fmt, why = hardware.usual_format(info)
    assert fmt == "fp32" and "precprof compare" in why and "is faster than fp32" not in why
    info = HardwareInfo(device="cuda", name="old", compute_capability=(6, 1))
    assert hardware.usual_format(info)[0] == "fp32"


def test_software_versions() -> None:
    v = hardware.software_versions()
    assert v["torch"] == torch.__version__
    assert v["python"] == platform.python_version()
    assert v["cuda"] == torch.version.cuda
    import precprof

    assert v["precprof"] == precprof.__version__


def test_env_report_text() -> None:
    info = hardware.detect()
    text = hardware.env_report(info)
    assert f"torch {torch.__version__}" in text
    assert f"usual format here: {hardware.usual_format(info)[0]}" in text
    if info.nvml != "ok":
        assert f"NVML: {info.nvml}" in text
    # every library the JSON lists is in the text too (peft and triton were in neither)
    versions = hardware.software_versions()
    for lib in ("numpy", "pandas", "transformers", "lightning", "peft", "torchao", "triton", "nvidia-ml-py"):
        assert f"{lib} {versions[lib] or 'not installed'}" in text, lib
    fake = HardwareInfo(
        device="cuda",
        name="H100",
        compute_capability=(9, 0),
        bf16_supported=True,
        bf16_native=True,
        tf32_supported=True,
        fp8_supported=True,
        fp8_library="torchao",
        nvml="ok",
        driver_version="550.54",
        memory_total_bytes=80 * 2**30,
        memory_used_bytes=2**30,
        device_count=1,
    )
    text = hardware.env_report(fake)
    assert "compute capability: 9.0" in text and "driver 550.54" in text and "80.0 GiB" in text


@pytest.mark.gpu
def test_detect_cuda() -> None:
    info = hardware.detect("cuda")
    assert info.is_cuda and info.compute_capability == torch.cuda.get_device_capability(0)
    assert info.fp8_supported == (info.compute_capability >= (8, 9))
    assert info.name == torch.cuda.get_device_name(0)
