"""The NVML probe with a scripted pynvml module: no library, no driver, several cards, missing queries."""

from __future__ import annotations

import sys
from pathlib import Path

import pynvml
import pytest

from installer.gpus import GIB, OtherAdapter, detect_other_adapters, probe
from tests.installer.fake_nvml import GTX_1080_TI, RTX_3090, RTX_5080, FakeCard, FakeNvml


def test_three_cards_of_the_seed() -> None:
    nvml = FakeNvml([RTX_5080, GTX_1080_TI, RTX_3090])
    result = probe(nvml, others=[])
    assert result.ok and not result.cpu_mode_offered
    assert result.driver == "580.95.05" and result.cuda_driver == "13.0"
    g0, g1, g2 = result.gpus
    assert [g.index for g in result.gpus] == [0, 1, 2]
    assert g0.name == "NVIDIA GeForce RTX 5080" and g0.uuid.startswith("GPU-")
    assert g0.vram_total == 16303 * 1024**2 and g0.vram_free == (16303 - 300) * 1024**2
    assert g0.vram_gb == 16 and g1.vram_gb == 11 and g2.vram_gb == 24  # what the box says
    assert g0.compute_capability == (12, 0) and g1.cc_text == "6.1"
    # SMs from CUDA cores / cores per SM of the architecture: 10752/128, 3584/128, 10496/128.
    assert (g0.sm_count, g1.sm_count, g2.sm_count) == (84, 28, 82)
    assert g0.max_sm_clock_mhz == 3090 and g0.speed_score == 84 * 3090
    assert (g0.pcie_gen, g0.pcie_width, g0.pcie_gen_max, g0.pcie_width_max) == (4, 16, 4, 16)
    assert g0.driver == "580.95.05"
    assert nvml.shutdowns == 1
    assert g2.short == "GPU 2 (NVIDIA GeForce RTX 3090, 24 GB)"


def test_sm_count_sources_in_order() -> None:
    cards = [
        FakeCard(
            "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40960, (8, 0), cores=None, sm_attr=42
        ),  # attribute wins
        FakeCard("NVIDIA GeForce RTX 4070 Ti SUPER", 16376, (8, 9), cores=None),  # name table, longest match
        FakeCard("NVIDIA GeForce RTX 4070", 12282, (8, 9), cores=None),
        FakeCard("NVIDIA Mystery Card", 8192, (8, 9), cores=None, max_sm_clock=None, pcie=None),
    ]
    result = probe(FakeNvml(cards), others=[])
    assert [g.sm_count for g in result.gpus] == [42, 66, 46, None]
    mystery = result.gpus[3]
    assert mystery.max_sm_clock_mhz is None and mystery.speed_score is None
    assert mystery.pcie_gen is None and mystery.pcie_width_max is None


def test_no_nvml_library_offers_cpu_mode() -> None:
    result = probe(FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), others=[])
    assert result.kind == "no_nvml" and result.cpu_mode_offered and not result.gpus
    assert "No NVIDIA driver found" in result.message and "CPU" in result.message


def test_driver_not_loaded_offers_cpu_mode() -> None:
    result = probe(FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), others=[])
    assert result.kind == "no_driver" and result.cpu_mode_offered
    assert "not loaded" in result.message and "nvidia-smi" in result.message


def test_other_nvml_failure_and_no_cards() -> None:
    result = probe(FakeNvml(init_error=pynvml.NVML_ERROR_NO_PERMISSION), others=[])
    assert result.kind == "error" and "Insufficient Permissions" in result.message
    empty = probe(FakeNvml([]), others=[])
    assert empty.kind == "no_gpus" and "reports no GPU" in empty.message and empty.driver == "580.95.05"


def test_missing_python_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    result = probe(others=[OtherAdapter("Intel", "UHD Graphics 770")])
    assert result.kind == "no_nvml" and "nvidia-ml-py" in result.message
    assert result.others == (OtherAdapter("Intel", "UHD Graphics 770"),)


def _pci(root: Path, slot: str, cls: str, vendor: str, device: str) -> None:
    d = root / slot
    d.mkdir(parents=True)
    (d / "class").write_text(cls + "\n")
    (d / "vendor").write_text(vendor + "\n")
    (d / "device").write_text(device + "\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sysfs is Linux only")
def test_other_adapters_from_sysfs(tmp_path: Path) -> None:
    sysfs = tmp_path / "devices"
    _pci(sysfs, "0000:00:02.0", "0x030000", "0x8086", "0xa780")  # Intel iGPU
    _pci(sysfs, "0000:03:00.0", "0x030000", "0x1002", "0x744c")  # AMD dGPU
    _pci(sysfs, "0000:01:00.0", "0x030000", "0x10de", "0x2684")  # NVIDIA: NVML lists it
    _pci(sysfs, "0000:00:1f.3", "0x040300", "0x8086", "0x7ad0")  # audio, not display
    ids = tmp_path / "pci.ids"
    ids.write_text(
        "# comment\n1002  Advanced Micro Devices, Inc. [AMD/ATI]\n\t744c  Navi 31 [Radeon RX 7900 XT/7900 XTX]\n"
        "8086  Intel Corporation\n\ta780  Raptor Lake-S GT1 [UHD Graphics 770]\n"
    )
    found = detect_other_adapters(sysfs, [str(ids)])
    assert found == [
        OtherAdapter("Intel", "Raptor Lake-S GT1 [UHD Graphics 770]", "8086:a780"),
        OtherAdapter("AMD", "Navi 31 [Radeon RX 7900 XT/7900 XTX]", "1002:744c"),
    ]
    assert detect_other_adapters(sysfs, [str(tmp_path / "none")])[1].name == "AMD display adapter"
    assert detect_other_adapters(tmp_path / "missing") == []


def test_vram_gb_rounds_to_the_nominal_size() -> None:
    result = probe(FakeNvml([FakeCard("NVIDIA GeForce RTX 3070", 7982, (8, 6), cores=5888)]), others=[])
    (g,) = result.gpus
    assert g.vram_gb == 8 and g.vram_total < 8 * GIB
