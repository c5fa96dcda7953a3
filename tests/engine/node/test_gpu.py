"""GPU report, live samples and clock locking against a scripted NVML (constants and errors are pynvml's own)."""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from engine.node.agent import Agent
from engine.node.gpu import Nvml, NvmlUnavailable, gpu_report, gpu_summary, reason_names
from tests.engine.node.conftest import pair_with
from tests.engine.node.fake_nvml import RTX_3070, RTX_3080, ClockNvml, LiveState


def two_cards(**kw: object) -> ClockNvml:
    return ClockNvml(cards=[RTX_3080, RTX_3070], **kw)  # type: ignore[arg-type]


def test_reason_bits_follow_pynvml() -> None:
    mask = pynvml.nvmlClocksEventReasonGpuIdle | pynvml.nvmlClocksEventReasonSwThermalSlowdown
    assert reason_names(mask, pynvml) == ["gpu_idle", "sw_thermal"]
    assert reason_names(0, pynvml) == []


def test_gpu_report_has_facts_and_live_state() -> None:
    nv = two_cards(
        live=[
            LiveState(sm_mhz=210, mem_mhz=810, pstate=5, reasons=pynvml.nvmlClocksEventReasonGpuIdle),
            LiveState(),
        ]
    )
    rep = gpu_report(nv)
    assert rep["status"] == "ok" and rep["driver"] == "580.95.05"
    g0, g1 = rep["gpus"]
    assert g0["name"] == "NVIDIA GeForce RTX 3080" and g0["uuid"].startswith("GPU-")
    assert g0["vram_total"] == 10240 * 2**20 and g0["vram_free"] == (10240 - 300) * 2**20
    assert g0["compute_capability"] == [8, 6] and (g0["pcie_gen"], g0["pcie_width"]) == (4, 8)
    assert g0["sm_count"] == 68 and g0["max_sm_mhz"] == 1905
    s0 = g0["state"]
    assert (s0["sm_mhz"], s0["mem_mhz"], s0["pstate"], s0["reasons"]) == (210, 810, 5, ["gpu_idle"])
    assert (s0["util_gpu"], s0["temp_c"], s0["power_w"]) == (37, 61, 180.5)
    assert g1["state"]["pstate"] == 2 and g1["state"]["reasons"] == []
    assert gpu_summary(rep) == "RTX 3080 10 GB, RTX 3070 8 GB"


def test_nvml_missing() -> None:
    nv = ClockNvml(cards=[RTX_3080], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    rep = gpu_report(nv)
    assert rep["status"] == "no_nvml" and rep["gpus"] == [] and "NVIDIA driver" in rep["message"]
    with pytest.raises(NvmlUnavailable, match="no NVIDIA driver found"):
        Nvml(nv)


def test_lock_defaults_and_reset() -> None:
    nv = two_cards()
    s = Nvml(nv)
    res = s.lock(1)
    assert res.locked and res.sm == (1524, 1905) and res.mem == (7001, 7001)
    assert res.detail == "locked: SM 1524-1905 MHz, memory 7001 MHz"
    assert nv.calls == [("lock_sm", 1, 1524, 1905), ("lock_mem", 1, 7001, 7001)]
    assert s.lock(0, (1500, 1905), (5000, 7001)).detail == "locked: SM 1500-1905 MHz, memory 5000-7001 MHz"
    back = s.reset(0)
    assert not back.locked and back.detail.startswith("reset")
    assert nv.calls[-2:] == [("reset_sm", 0), ("reset_mem", 0)]
    s.close()


def test_card_without_rights_to_lock() -> None:
    nv = two_cards(lock_error=pynvml.NVML_ERROR_NO_PERMISSION)
    res = Nvml(nv).lock(0)
    assert not res.locked
    assert res.detail.startswith("NOT locked: no permission") and "administrator" in res.detail
    mem_only = two_cards(mem_lock_error=pynvml.NVML_ERROR_NOT_SUPPORTED)
    part = Nvml(mem_only).lock(0)
    assert part.locked and part.mem is None and "memory clock NOT locked" in part.detail


def test_nvidia_smi_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A binding without the lock calls: nvidia-smi does it, and its refusal text is passed on."""
    log = tmp_path / "smi.log"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        f"#!{sys.executable}\nimport sys\nopen({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "if '-lmc' in ' '.join(sys.argv):\n    print('Setting locked memory clocks is not supported'); sys.exit(3)\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    nv = two_cards()
    for name in ("nvmlDeviceSetGpuLockedClocks", "nvmlDeviceSetMemoryLockedClocks"):
        monkeypatch.setattr(ClockNvml, name, property(lambda self: None), raising=True)
    res = Nvml(nv).lock(0)
    assert res.locked and "memory clock NOT locked" in res.detail and "not supported" in res.detail
    assert log.read_text().splitlines() == ["-i 0 -lgc=1524,1905", "-i 0 -lmc=7001,7001"]


def test_agent_reports_locks_and_samples(make_agent: Callable[..., Agent]) -> None:
    nv = two_cards(lock_error=pynvml.NVML_ERROR_NO_PERMISSION)
    agent = make_agent(nvml=nv, sample_ms=20)
    p = pair_with(agent)
    c = p.client
    info = c.info()
    assert [g["name"] for g in info["gpu"]["gpus"]] == ["NVIDIA GeForce RTX 3080", "NVIDIA GeForce RTX 3070"]
    assert info["pc"]["ram_total"] > 0 and info["pc"]["cpu_threads"] >= 1
    lock = c.lock_clocks(0)
    assert lock["locked"] is False and lock["detail"].startswith("NOT locked: no permission")
    with pytest.raises(Exception, match="does not exist"):
        c.lock_clocks(5)
    first = c.gpu_samples(0, wait_ms=2000)
    assert first["samples"] and {s["index"] for s in first["samples"]} <= {0, 1}
    nv.live[0].pstate = 8
    time.sleep(0.1)
    later = c.gpu_samples(first["next"], wait_ms=2000)
    assert all(s["seq"] > first["next"] for s in later["samples"])
    assert any(s["index"] == 0 and s["pstate"] == 8 for s in later["samples"])
    p.client.close()


def test_agent_without_nvml_says_so(make_agent: Callable[..., Agent]) -> None:
    nv = ClockNvml(cards=[RTX_3080], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    p = pair_with(make_agent(nvml=nv))
    info = p.client.info()
    assert info["gpu"]["status"] == "no_nvml" and info["gpu"]["gpus"] == []
    res = p.client.lock_clocks(0)
    assert res["locked"] is False and res["detail"].startswith("NOT locked: no NVIDIA driver found")
    assert p.client.gpu_samples(0, wait_ms=500) == {"samples": [], "next": 0}
    p.client.close()


@pytest.mark.parametrize("allowed", [True, False])
def test_worker_clocks_locked_around_the_worker(make_agent: Callable[..., Agent], allowed: bool) -> None:
    nv = two_cards(lock_error=None if allowed else pynvml.NVML_ERROR_NO_PERMISSION)
    agent = make_agent(nvml=nv, engine_command=[sys.executable, "-c", "print('worker ran')"])
    (agent.store.root / "m.gguf").write_bytes(b"GGUF")
    p = pair_with(agent)
    w = p.client.start_worker(model="m.gguf", begin=1, gpu=1, lock_clocks=True)
    assert w["clocks"]["locked"] is allowed
    assert w["clocks"]["detail"].startswith(
        "locked: SM 1524-1905" if allowed else "NOT locked: no permission"
    )
    deadline = time.monotonic() + 10
    while p.client.workers()[0]["state"] != "exited" and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = p.client.workers()[0]
    assert ended["state"] == "exited" and ended["exit_code"] == 0
    assert p.client.logs(w["id"])["lines"] == ["worker ran"]
    if allowed:
        assert ("reset_sm", 1) in nv.calls and ended["clocks"]["locked"] is False
    else:
        assert not any(c[0].startswith("reset") for c in nv.calls)
    p.client.close()
