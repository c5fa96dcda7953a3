"""GPU inventory through NVML (nvidia-ml-py's `pynvml`), plus a cheap look at non-NVIDIA display adapters.

`probe()` never raises for a machine without NVIDIA hardware: it returns a `ProbeResult` whose `kind` says what is
missing (no NVML library, no driver, no cards) with a message a user can act on, and offers the CPU mode.
The NVML module can be injected (`probe(nvml=fake)`) so the rules are tested without a GPU.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

GIB = 1024**3

# FP32 cores per SM by compute capability (major, minor): turns nvmlDeviceGetNumGpuCores into an SM count.
_CORES_PER_SM: dict[tuple[int, int], int] = {
    (6, 0): 64,
    (6, 1): 128,
    (6, 2): 128,
    (7, 0): 64,
    (7, 2): 64,
    (7, 5): 64,
    (8, 0): 64,
    (8, 6): 128,
    (8, 7): 128,
    (8, 9): 128,
    (9, 0): 128,
    (10, 0): 128,
    (10, 3): 128,
    (11, 0): 128,
    (12, 0): 128,
    (12, 1): 128,
}

# SM counts of common cards (public spec sheets), used when NVML cannot tell. Longest name match wins.
_SM_BY_NAME: dict[str, int] = {
    "RTX 2060": 30,
    "RTX 2060 SUPER": 34,
    "RTX 2070": 36,
    "RTX 2070 SUPER": 40,
    "RTX 2080": 46,
    "RTX 2080 SUPER": 48,
    "RTX 2080 Ti": 68,
    "TITAN RTX": 72,
    "RTX 3060": 28,
    "RTX 3060 Ti": 38,
    "RTX 3070": 46,
    "RTX 3070 Ti": 48,
    "RTX 3080": 68,
    "RTX 3080 Ti": 80,
    "RTX 3090": 82,
    "RTX 3090 Ti": 84,
    "RTX 4060": 24,
    "RTX 4060 Ti": 34,
    "RTX 4070": 46,
    "RTX 4070 SUPER": 56,
    "RTX 4070 Ti": 60,
    "RTX 4070 Ti SUPER": 66,
    "RTX 4080": 76,
    "RTX 4080 SUPER": 80,
    "RTX 4090": 128,
    "RTX 5060": 30,
    "RTX 5060 Ti": 36,
    "RTX 5070": 48,
    "RTX 5070 Ti": 70,
    "RTX 5080": 84,
    "RTX 5090": 170,
    "RTX A4000": 48,
    "RTX A5000": 64,
    "RTX A6000": 84,
    "A100": 108,
    "A10": 72,
    "L4": 58,
    "L40S": 142,
    "H100 PCIe": 114,
    "H100": 132,
    "H200": 132,
    "GTX 1080 Ti": 28,
    "GTX 1080": 20,
    "GTX 1070": 15,
    "Tesla P40": 30,
    "Tesla P100": 56,
    "V100": 80,
}


@dataclass(frozen=True)
class GpuInfo:
    """One NVIDIA card as NVML reports it. Sizes in bytes, clocks in MHz; None where NVML could not tell."""

    index: int
    uuid: str
    name: str
    vram_total: int
    vram_free: int
    compute_capability: tuple[int, int]
    driver: str
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    sm_count: int | None = None
    max_sm_clock_mhz: int | None = None

    @property
    def vram_gb(self) -> int:
        """VRAM as the box says it (NVML reports a little less than the nominal size, e.g. 16303 MiB for 16 GB)."""
        return round(self.vram_total / GIB)

    @property
    def cc_text(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    @property
    def speed_score(self) -> float | None:
        """SMs x max SM clock: the seed's measure of which card is faster."""
        if self.sm_count is None or self.max_sm_clock_mhz is None:
            return None
        return float(self.sm_count * self.max_sm_clock_mhz)

    @property
    def short(self) -> str:
        """`GPU 0 (NVIDIA GeForce RTX 5080, 16 GB)` as the setup dialogue names a card."""
        return f"GPU {self.index} ({self.name}, {self.vram_gb} GB)"


@dataclass(frozen=True)
class OtherAdapter:
    """A display adapter that is not NVIDIA (AMD, Intel, ...), found by the OS or given by the caller."""

    vendor: str
    name: str
    pci_id: str = ""


ProbeKind = Literal["ok", "no_nvml", "no_driver", "no_gpus", "error"]


@dataclass(frozen=True)
class ProbeResult:
    kind: ProbeKind
    gpus: tuple[GpuInfo, ...] = ()
    driver: str | None = None
    cuda_driver: str | None = None
    message: str = ""
    others: tuple[OtherAdapter, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def cpu_mode_offered(self) -> bool:
        """No NVIDIA card to run on: the setup offers the (slow) CPU mode instead of stopping."""
        return self.kind != "ok"


_CPU_HINT = "PolyStrata can still run on the CPU (slow)."


def _decode(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _optional(call: Any, *args: Any) -> Any:
    """NVML queries that some cards or drivers do not support answer None instead of failing the probe."""
    try:
        return call(*args)
    except Exception:
        return None


def _sm_from_name(name: str) -> int | None:
    best: tuple[int, int] | None = None
    for key, sms in _SM_BY_NAME.items():
        if re.search(r"(?<![\w])" + re.escape(key) + r"(?![\w])", name, flags=re.IGNORECASE):
            if best is None or len(key) > best[0]:
                best = (len(key), sms)
    return best[1] if best else None


def _sm_count(nvml: Any, handle: Any, name: str, cc: tuple[int, int]) -> int | None:
    attrs = (
        _optional(nvml.nvmlDeviceGetAttributes, handle) if hasattr(nvml, "nvmlDeviceGetAttributes") else None
    )
    count = getattr(attrs, "multiprocessorCount", 0) if attrs is not None else 0
    if isinstance(count, int) and count > 0:
        return count
    if hasattr(nvml, "nvmlDeviceGetNumGpuCores") and cc in _CORES_PER_SM:
        cores = _optional(nvml.nvmlDeviceGetNumGpuCores, handle)
        if isinstance(cores, int) and cores > 0:
            return cores // _CORES_PER_SM[cc]
    return _sm_from_name(name)


def _query_gpu(nvml: Any, index: int, driver: str) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _decode(nvml.nvmlDeviceGetName(handle))
    uuid = _decode(nvml.nvmlDeviceGetUUID(handle))
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    cc = (int(major), int(minor))
    clock = _optional(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM)
    return GpuInfo(
        index=index,
        uuid=uuid,
        name=name,
        vram_total=int(mem.total),
        vram_free=int(mem.free),
        compute_capability=cc,
        driver=driver,
        pcie_gen=_optional(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        pcie_width=_optional(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        pcie_gen_max=_optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        pcie_width_max=_optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        sm_count=_sm_count(nvml, handle, name, cc),
        max_sm_clock_mhz=int(clock) if isinstance(clock, int) and clock > 0 else None,
    )


def _cuda_version_text(value: Any) -> str | None:
    if not isinstance(value, int) or value <= 0:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}"


def probe(nvml: ModuleType | Any | None = None, others: Sequence[OtherAdapter] | None = None) -> ProbeResult:
    """Every NVIDIA card with its facts, or why there are none. `others` defaults to `detect_other_adapters()`."""
    other_list = tuple(detect_other_adapters() if others is None else others)
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            return ProbeResult(
                kind="no_nvml",
                message="The Python package nvidia-ml-py (pynvml) is missing, so NVIDIA GPUs cannot be listed. "
                f"Reinstall PolyStrata (pip install nvidia-ml-py). {_CPU_HINT}",
                others=other_list,
            )
    try:
        nvml.nvmlInit()
    except Exception as exc:
        code = _error_code(exc)
        if code == getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", -1):
            return ProbeResult(
                kind="no_nvml",
                message="No NVIDIA driver found (the NVML library libnvidia-ml / nvml.dll is missing). "
                f"Install the NVIDIA driver (550 or newer) if this PC has an NVIDIA card. {_CPU_HINT}",
                others=other_list,
            )
        if code == getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", -2):
            return ProbeResult(
                kind="no_driver",
                message="The NVIDIA driver is installed but not loaded (NVML: Driver Not Loaded). Reboot, or check "
                f"`nvidia-smi`; on Linux the kernel module may not match the running kernel. {_CPU_HINT}",
                others=other_list,
            )
        return ProbeResult(
            kind="error",
            message=f"NVML could not start: {exc}. Check `nvidia-smi`. {_CPU_HINT}",
            others=other_list,
        )
    try:
        driver = _decode(nvml.nvmlSystemGetDriverVersion())
        cuda = _optional(getattr(nvml, "nvmlSystemGetCudaDriverVersion", lambda: None))
        count = int(nvml.nvmlDeviceGetCount())
        gpus = tuple(_query_gpu(nvml, i, driver) for i in range(count))
    except Exception as exc:
        return ProbeResult(
            kind="error",
            message=f"NVML failed while listing the GPUs: {exc}. Check `nvidia-smi`. {_CPU_HINT}",
            others=other_list,
        )
    finally:
        _optional(nvml.nvmlShutdown)
    if not gpus:
        return ProbeResult(
            kind="no_gpus",
            driver=driver,
            cuda_driver=_cuda_version_text(cuda),
            message=f"The NVIDIA driver {driver} is loaded but reports no GPU. {_CPU_HINT}",
            others=other_list,
        )
    return ProbeResult(
        kind="ok", gpus=gpus, driver=driver, cuda_driver=_cuda_version_text(cuda), others=other_list
    )


_VENDORS = {"0x1002": "AMD", "0x1022": "AMD", "0x8086": "Intel", "0x10de": "NVIDIA"}
_PCI_IDS = ("/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids", "/usr/share/pci.ids")


def _pci_name(vendor: str, device: str, pci_ids: Sequence[str]) -> str | None:
    """The device's name from pci.ids where the OS ships it (one linear scan, only at setup)."""
    v, d = vendor.lower().removeprefix("0x"), device.lower().removeprefix("0x")
    for candidate in pci_ids:
        path = Path(candidate)
        if not path.is_file():
            continue
        in_vendor = False
        with path.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line or line.startswith("#"):
                    continue
                if not line.startswith("\t"):
                    in_vendor = line.lower().startswith(v + " ")
                elif in_vendor and not line.startswith("\t\t") and line[1:].lower().startswith(d + " "):
                    return line[1:].split(" ", 1)[1].strip()
        return None
    return None


def detect_other_adapters(
    sysfs: str | os.PathLike[str] = "/sys/bus/pci/devices", pci_ids: Sequence[str] = _PCI_IDS
) -> list[OtherAdapter]:
    """AMD and Intel display adapters from Linux sysfs (PCI class 0x03). Elsewhere: an empty list; pass yours."""
    root = Path(sysfs)
    if not sys.platform.startswith("linux") or not root.is_dir():
        return []
    found = []
    for dev in sorted(root.iterdir()):
        try:
            pci_class = (dev / "class").read_text().strip()
            vendor = (dev / "vendor").read_text().strip().lower()
            device = (dev / "device").read_text().strip().lower()
        except OSError:
            continue
        if not pci_class.startswith("0x03") or vendor == "0x10de":
            continue
        maker = _VENDORS.get(vendor, f"vendor {vendor}")
        label = _pci_name(vendor, device, pci_ids) or f"{maker} display adapter"
        found.append(OtherAdapter(vendor=maker, name=label, pci_id=f"{vendor[2:]}:{device[2:]}"))
    return found
