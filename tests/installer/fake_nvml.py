"""A stand-in for the `pynvml` module with scripted cards, for probing without a GPU.

Errors and constants are the real nvidia-ml-py ones (`pynvml.NVMLError(code)` maps to the same subclasses NVML
raises), so the probe sees exactly what it would see from the library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

GIB = 1024**3
MIB = 1024**2


@dataclass
class FakeCard:
    name: str
    total_mib: int
    cc: tuple[int, int]
    cores: int | None = None
    """None: nvmlDeviceGetNumGpuCores answers NOT_SUPPORTED (older drivers)."""
    sm_attr: int | None = None
    """multiprocessorCount from nvmlDeviceGetAttributes (MIG devices); None: NOT_SUPPORTED."""
    max_sm_clock: int | None = 2000
    used_mib: int = 300
    pcie: tuple[int, int, int, int] | None = (4, 16, 4, 16)
    uuid: str = ""


@dataclass
class FakeNvml:
    cards: list[FakeCard] = field(default_factory=list)
    init_error: int | None = None
    driver: str = "580.95.05"
    cuda: int = 13000
    shutdowns: int = 0

    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    NVMLError = pynvml.NVMLError

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> SimpleNamespace:
        if not 0 <= i < len(self.cards):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return SimpleNamespace(i=i, card=self.cards[i])

    def nvmlDeviceGetName(self, h: SimpleNamespace) -> bytes:
        return h.card.name.encode()  # older pynvml versions return bytes

    def nvmlDeviceGetUUID(self, h: SimpleNamespace) -> str:
        return h.card.uuid or f"GPU-0000000{h.i}-aaaa-bbbb-cccc-dddddddddddd"

    def nvmlDeviceGetMemoryInfo(self, h: SimpleNamespace) -> SimpleNamespace:
        total = h.card.total_mib * MIB
        used = h.card.used_mib * MIB
        return SimpleNamespace(total=total, free=total - used, used=used)

    def nvmlDeviceGetCudaComputeCapability(self, h: SimpleNamespace) -> tuple[int, int]:
        return h.card.cc

    def nvmlDeviceGetMaxClockInfo(self, h: SimpleNamespace, kind: int) -> int:
        assert kind == pynvml.NVML_CLOCK_SM
        if h.card.max_sm_clock is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return h.card.max_sm_clock

    def _pcie(self, h: SimpleNamespace, k: int) -> int:
        if h.card.pcie is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return h.card.pcie[k]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: SimpleNamespace) -> int:
        return self._pcie(h, 0)

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: SimpleNamespace) -> int:
        return self._pcie(h, 1)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: SimpleNamespace) -> int:
        return self._pcie(h, 2)

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: SimpleNamespace) -> int:
        return self._pcie(h, 3)

    def nvmlDeviceGetNumGpuCores(self, h: SimpleNamespace) -> int:
        if h.card.cores is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return h.card.cores

    def nvmlDeviceGetAttributes(self, h: SimpleNamespace) -> SimpleNamespace:
        if h.card.sm_attr is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(multiprocessorCount=h.card.sm_attr)


# The seed's PC (002 "Using it"): NVML reports a little under the nominal VRAM.
RTX_5080 = FakeCard("NVIDIA GeForce RTX 5080", 16303, (12, 0), cores=10752, max_sm_clock=3090)
GTX_1080_TI = FakeCard("NVIDIA GeForce GTX 1080 Ti", 11264, (6, 1), cores=3584, max_sm_clock=1911)
RTX_3090 = FakeCard("NVIDIA GeForce RTX 3090", 24576, (8, 6), cores=10496, max_sm_clock=2100)
