"""Device capabilities: what formats this machine (or a named target machine) runs natively.

``detect()`` looks at the current machine (torch, CUDA, NVML when a driver is there); ``preset(name)``
describes a machine the user plans to train on ("v100", "t4", "a100", "l4", "h100", "b200", "gb200", "cpu"), so
that a run profiled on one box can be planned for another.
"""

from __future__ import annotations

import contextlib
import importlib.util
import platform
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from typing import TYPE_CHECKING, Any

from precprof._version import __version__

if TYPE_CHECKING:
    import torch


@dataclass
class HardwareInfo:
    """Capabilities of one device.

    ``compute_capability`` is (major, minor) for CUDA devices, None on CPU. ``bf16_native``: bf16 matmuls run
    in hardware (CUDA 8.0+, or a CPU with AVX512-BF16/AMX); ``bf16_supported``: bf16 runs at all (emulated on
    most CPUs). ``fp16_native``: fp16 arithmetic runs in hardware (every CUDA GPU; a CPU with AVX512-FP16 or
    AMX-FP16, without which torch emulates fp16 matmuls about 15x slower than fp32); None in a summary.json
    recorded before precprof recorded it (a reader then falls back on this machine's, ``cpu_fp16_native``, and
    says so). ``fp8_supported``: FP8 tensor cores (compute capability 8.9+); ``fp8_library``: "torchao" or
    "transformer_engine" when one is importable. ``tf32_*_enabled`` are torch's current flags.
    ``block_formats``: the block-scaled recipes its tensor cores run natively (names of
    ``precprof.block_formats.RECIPES``: "mxfp8_e4m3", "mxfp4", "nvfp4", ...); empty before Blackwell (compute
    capability 10.0) and on CPUs.
    """

    device: str  # "cuda" | "cpu"
    name: str
    compute_capability: tuple[int, int] | None = None
    bf16_supported: bool = False
    bf16_native: bool = False
    fp16_native: bool | None = None
    fp16_tensor_cores: bool = False
    tf32_supported: bool = False
    fp8_supported: bool = False
    fp8_library: str | None = None
    tf32_matmul_enabled: bool = False
    tf32_cudnn_enabled: bool = False
    float32_matmul_precision: str = "highest"
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    device_count: int = 0
    cpu_capability: str | None = None
    nvml: str = "no NVIDIA driver"
    block_formats: tuple[str, ...] = ()
    preset: str | None = None  # set when this describes a named target machine, not the current one
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = (
            ".".join(map(str, self.compute_capability)) if self.compute_capability else None
        )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareInfo:
        d = dict(d)
        cc = d.get("compute_capability")
        if isinstance(cc, str):
            major, minor = cc.split(".")
            d["compute_capability"] = (int(major), int(minor))
        elif isinstance(cc, list):
            d["compute_capability"] = (int(cc[0]), int(cc[1]))
        if isinstance(d.get("block_formats"), (list, tuple)):  # a JSON list after summary.json
            d["block_formats"] = tuple(str(b) for b in d["block_formats"])
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"


def fp8_library() -> str | None:
    """The FP8 training library that is importable here: "torchao", "transformer_engine" or None."""
    if importlib.util.find_spec("torchao") is not None:
        return "torchao"
    if importlib.util.find_spec("transformer_engine") is not None:
        return "transformer_engine"
    return None


# What the tensor cores of compute capability 10.x (B200, GB200: tcgen05 MMA kinds f8f6f4, mxf8f6f4, mxf4,
# mxf4nvf4) run natively among precprof.block_formats' recipes: MX with E8M0 scales per 32 values for FP8, FP6
# and FP4 elements, and NVFP4 (E4M3 scales per 16 FP4 values). Hopper (9.0) has none of them.
BLACKWELL_BLOCK_FORMATS: tuple[str, ...] = (
    "mxfp8_e4m3",
    "mxfp8_e5m2",
    "mxfp6_e2m3",
    "mxfp6_e3m2",
    "mxfp4",
    "nvfp4",
)


def block_formats_native(cc: tuple[int, int] | None) -> tuple[str, ...]:
    """The block-scaled recipes a GPU of compute capability ``cc`` runs natively (data-centre Blackwell, 10.x;
    () for older GPUs and for None, a CPU). Consumer Blackwell (12.x) is left out: precprof has no preset for
    it and its MMA kinds differ."""
    return BLACKWELL_BLOCK_FORMATS if cc is not None and cc[0] == 10 else ()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return set()


def _cpu_bf16_native() -> bool:
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_fp16_native() -> bool:
    """Whether this CPU computes fp16 in hardware (AVX512-FP16 or AMX-FP16); without it torch emulates fp16
    matmuls, about 15x slower than fp32 (measured on an AVX512 EPYC)."""
    return bool(_cpu_flags() & {"avx512_fp16", "amx_fp16"})


def _nvml(index: int) -> dict[str, Any]:
    """Driver version and memory of GPU ``index`` through NVML; {"nvml": reason} when unavailable."""
    try:
        import pynvml  # provided by nvidia-ml-py
    except ImportError:
        return {"nvml": "nvidia-ml-py is not installed (pip install nvidia-ml-py)"}
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return {"nvml": "no NVIDIA driver"}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        return {
            "nvml": "ok",
            "driver_version": driver.decode() if isinstance(driver, bytes) else str(driver),
            "memory_total_bytes": int(mem.total),
            "memory_used_bytes": int(mem.used),
        }
    except Exception as e:
        return {"nvml": f"NVML error: {e}"}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def detect(device: str | torch.device | None = None) -> HardwareInfo:
    """Capabilities of ``device`` (default: CUDA device 0 when there is one, else the CPU)."""
    import torch  # here, not at import: presets and the report's reading need no torch

    dev = torch.device(device) if device is not None else None
    use_cuda = torch.cuda.is_available() and (dev is None or dev.type == "cuda")
    common = dict(
        tf32_matmul_enabled=bool(torch.backends.cuda.matmul.allow_tf32),
        tf32_cudnn_enabled=bool(torch.backends.cudnn.allow_tf32),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        cuda_version=torch.version.cuda,
        fp8_library=fp8_library(),
    )
    if use_cuda:
        index = dev.index if dev is not None and dev.index is not None else 0
        props = torch.cuda.get_device_properties(index)
        cc = (int(props.major), int(props.minor))
        info = HardwareInfo(
            device="cuda",
            name=props.name,
            compute_capability=cc,
            bf16_supported=bool(torch.cuda.is_bf16_supported()),
            bf16_native=cc >= (8, 0),
            fp16_native=True,
            fp16_tensor_cores=cc >= (7, 0),
            tf32_supported=cc >= (8, 0),
            fp8_supported=cc >= (8, 9),
            block_formats=block_formats_native(cc),
            memory_total_bytes=int(props.total_memory),
            device_count=torch.cuda.device_count(),
            **common,  # type: ignore[arg-type]
        )
        nv = _nvml(index)
        info.nvml = nv.pop("nvml")
        for k, v in nv.items():
            setattr(info, k, v)
        return info
    cpu_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    nv = _nvml(0) if torch.version.cuda else {"nvml": "no NVIDIA driver"}
    return HardwareInfo(
        device="cpu",
        name=cpu_name,
        bf16_supported=True,  # CPU autocast runs bf16 everywhere; natively only with AVX512-BF16/AMX
        bf16_native=_cpu_bf16_native(),
        fp16_native=cpu_fp16_native(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        nvml=str(nv.get("nvml", "no NVIDIA driver")),
        **common,  # type: ignore[arg-type]
    )


_PRESETS: dict[str, HardwareInfo] = {
    "cpu": HardwareInfo(device="cpu", name="CPU", bf16_supported=True, bf16_native=False, fp16_native=False),
    "v100": HardwareInfo(
        device="cuda",
        name="Tesla V100",
        compute_capability=(7, 0),
        fp16_native=True,
        fp16_tensor_cores=True,
        memory_total_bytes=32 * 2**30,
    ),
    "t4": HardwareInfo(
        device="cuda",
        name="Tesla T4",
        compute_capability=(7, 5),
        fp16_native=True,
        fp16_tensor_cores=True,
        memory_total_bytes=16 * 2**30,
    ),
    "a100": HardwareInfo(
        device="cuda",
        name="A100",
        compute_capability=(8, 0),
        bf16_supported=True,
        bf16_native=True,
        fp16_native=True,
        fp16_tensor_cores=True,
        tf32_supported=True,
        memory_total_bytes=80 * 2**30,
    ),
    "l4": HardwareInfo(
        device="cuda",
        name="L4",
        compute_capability=(8, 9),
        bf16_supported=True,
        bf16_native=True,
        fp16_native=True,
        fp16_tensor_cores=True,
        tf32_supported=True,
        fp8_supported=True,
        memory_total_bytes=24 * 2**30,
    ),
    "h100": HardwareInfo(
        device="cuda",
        name="H100",
        compute_capability=(9, 0),
        bf16_supported=True,
        bf16_native=True,
        fp16_native=True,
        fp16_tensor_cores=True,
        tf32_supported=True,
        fp8_supported=True,
        memory_total_bytes=80 * 2**30,
    ),
    # Blackwell: natively FP8 (per-tensor scaled, as on H100), MXFP8, MXFP6, MXFP4, NVFP4, BF16 and TF32; the
    # libraries are torchao (MX and NVFP4 training, prototype) and Transformer Engine (MXFP8BlockScaling,
    # NVFP4BlockScaling recipes). 180 GB of HBM3e per GPU in an HGX B200.
    "b200": HardwareInfo(
        device="cuda",
        name="B200",
        compute_capability=(10, 0),
        bf16_supported=True,
        bf16_native=True,
        fp16_native=True,
        fp16_tensor_cores=True,
        tf32_supported=True,
        fp8_supported=True,
        block_formats=BLACKWELL_BLOCK_FORMATS,
        memory_total_bytes=180 * 10**9,
    ),
}
# GB200 pairs the same B200 GPU (compute capability 10.0, the same tensor-core formats) with a Grace CPU: for
# precprof's numerics it does not differ from b200, so it is an alias with its own name and memory (186 GB of
# HBM3e per GPU in a GB200 NVL72), not a separate set of capabilities.
_PRESETS["gb200"] = replace(_PRESETS["b200"], name="GB200", memory_total_bytes=186 * 10**9)
PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def preset(name: str) -> HardwareInfo:
    """A named target machine. Its ``fp8_library`` is assumed installable (fp8 needs torchao or TE there)."""
    key = name.lower().strip()
    if key not in _PRESETS:
        raise ValueError(f"unknown hardware target {name!r}; known targets: {', '.join(PRESET_NAMES)}")
    p = replace(_PRESETS[key], preset=key)
    if p.fp8_supported:
        p.fp8_library = p.fp8_library or "torchao"
    return p


# ------------------------------------------------------------------------------------ decision tree
def usual_format(info: HardwareInfo) -> tuple[str, str]:
    """(format, why): what the usual practitioner's decision tree picks for this device, before any
    measurement. precprof's advisor starts from the same tree and then checks it against the recorded
    numbers; this is the answer ``precprof env`` gives without a run."""
    if not info.is_cuda:
        if info.bf16_native:
            # bf16 matmuls in hardware do not make a training step faster by themselves (conversions, the ops
            # autocast keeps in fp32): no speed is claimed that nothing here measured
            return "fp32", (
                "CPU with native bf16 (AVX512-BF16/AMX): bf16 matmuls run in hardware, but whether bf16 autocast "
                "trains faster than fp32 depends on the model; precprof compare --precisions fp32,bf16 measures it"
            )
        return "fp32", "CPU without native bf16: low precision is emulated and brings no speed"
    cc = info.compute_capability or (0, 0)
    if info.fp8_supported:
        lib = info.fp8_library or "torchao or Transformer Engine (not installed)"
        blocks = " (MXFP8, or NVFP4/MXFP4 where the error allows, in hardware)" if info.block_formats else ""
        return "bf16", (
            f"compute capability {cc[0]}.{cc[1]}: bf16 autocast, and fp8 for eligible large matmuls{blocks} via {lib}"
        )
    if cc >= (8, 0):
        return "bf16", f"compute capability {cc[0]}.{cc[1]}: bf16 tensor cores, no loss scaling needed"
    if info.fp16_tensor_cores:
        return "fp16", (
            f"compute capability {cc[0]}.{cc[1]}: fp16 tensor cores and no bf16; use dynamic loss scaling"
        )
    return "fp32", f"compute capability {cc[0]}.{cc[1]}: no tensor cores for low precision"


# the libraries precprof uses when they are there, by their distribution names
OPTIONAL_LIBRARIES = (
    "transformers",
    "accelerate",
    "lightning",
    "peft",
    "torchao",
    "transformer_engine",
    "triton",
)


def software_versions() -> dict[str, str | None]:
    """Versions of python, torch, CUDA/cuDNN and the optional libraries precprof uses (None: not installed).

    Reads package metadata only, and torch's own versions.
    """
    import torch

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "precprof": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(cudnn) if cudnn else None,
        **{dist: version(dist) for dist in ("numpy", "pandas", "nvidia-ml-py", *OPTIONAL_LIBRARIES)},
    }


def env_report(info: HardwareInfo | None = None) -> str:
    """The text of ``precprof env``: versions, device, capabilities, TF32 flags, NVML, the usual format, the
    CPU kernel's cache folder and whether it passes its checks (read only: nothing is created or built)."""
    info = info if info is not None else detect()
    v = software_versions()

    def yes(b: bool) -> str:
        return "yes" if b else "no"

    cc = ".".join(map(str, info.compute_capability)) if info.compute_capability else "n/a"
    lines = [
        f"precprof {v['precprof']}  python {v['python']}  torch {v['torch']}",
        f"CUDA (torch build): {v['cuda'] or 'none (CPU-only build)'}   cuDNN: {v['cudnn'] or 'n/a'}",
        f"device: {info.device}  {info.name}"
        + (f"  ({info.device_count} GPU{'s' if info.device_count != 1 else ''})" if info.is_cuda else ""),
        f"compute capability: {cc}",
        f"bf16: supported {yes(info.bf16_supported)}, native {yes(info.bf16_native)}"
        f"   fp16 tensor cores: {yes(info.fp16_tensor_cores)}",
        f"tf32: supported {yes(info.tf32_supported)}; flags: matmul {info.tf32_matmul_enabled}, "
        f"cudnn {info.tf32_cudnn_enabled}, float32_matmul_precision {info.float32_matmul_precision!r}",
        f"fp8: supported {yes(info.fp8_supported)}; library: {info.fp8_library or 'none (pip install torchao)'}",
        f"block-scaled formats in hardware: {', '.join(info.block_formats) or 'none'}",
    ]
    if info.cpu_capability:
        lines.append(f"CPU capability: {info.cpu_capability}")
    if not info.is_cuda and info.fp16_native is not None:
        lines.append(f"fp16 arithmetic in hardware (AVX512-FP16/AMX-FP16): {yes(info.fp16_native)}")
    if info.nvml == "ok":
        total = f"{info.memory_total_bytes / 2**30:.1f} GiB" if info.memory_total_bytes else "?"
        used = f"{info.memory_used_bytes / 2**30:.1f} GiB" if info.memory_used_bytes is not None else "?"
        lines.append(f"NVML: driver {info.driver_version}, memory {used} used of {total}")
    else:
        lines.append(f"NVML: {info.nvml}")
    fmt, why = usual_format(info)
    lines.append(f"usual format here: {fmt} ({why})")
    lines.append(
        "libraries: "
        + ", ".join(f"{k} {v[k] or 'not installed'}" for k in ("numpy", "pandas", "nvidia-ml-py"))
    )
    lines.append("optional: " + ", ".join(f"{k} {v[k] or 'not installed'}" for k in OPTIONAL_LIBRARIES))
    # precprof.stats imports torch; a preset (`precprof report --target`) needs neither
    from precprof.stats import kernel_cache

    cache, state = kernel_cache.describe()
    lines.append(f"CPU kernel cache: {cache} ({state})")
    return "\n".join(lines)
