"""What the agent says about this PC and its GPUs, live GPU state from NVML, and locked clocks.

Facts (name, UUID, VRAM, compute capability, PCIe, driver) come from `installer.gpus.probe()`; this module adds the
state that changes: SM and memory clocks, P-state, clock-event reasons, utilisation, temperature, power. Clocks are
locked with `nvmlDeviceSetGpuLockedClocks` / `nvmlDeviceSetMemoryLockedClocks` (or `nvidia-smi -lgc/-lmc` where the
NVML binding lacks them) and reset afterwards. The NVML module can be injected, so all of it is tested without a GPU.
"""

import importlib
import platform
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import psutil

from installer.gpus import ProbeResult, probe

# Clock-event (throttle) reason bits: our name -> NVML's constant suffix (nvmlClocksEventReason*, older
# bindings nvmlClocksThrottleReason*).
_REASONS = (
    ("gpu_idle", "GpuIdle"),
    ("applications_clocks", "ApplicationsClocksSetting"),
    ("sw_power_cap", "SwPowerCap"),
    ("hw_slowdown", "HwSlowdown"),
    ("sync_boost", "SyncBoost"),
    ("sw_thermal", "SwThermalSlowdown"),
    ("hw_thermal", "HwThermalSlowdown"),
    ("hw_power_brake", "HwPowerBrakeSlowdown"),
    ("display_clocks", "DisplayClockSetting"),
)
_NO_PERMISSION_HINT = (
    "run the agent as administrator (Windows) or as root (Linux; `sudo strata-node serve`), or run `{smi}` "
    "yourself in an administrator / root shell"
)


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this PC; the message says why and what to do."""


def _load(nvml: ModuleType | Any | None) -> Any:
    if nvml is not None:
        return nvml
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        raise NvmlUnavailable(
            "the Python package nvidia-ml-py (pynvml) is missing: reinstall PolyStrata (pip install nvidia-ml-py)"
        ) from None


def _err_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def reason_names(mask: int, nvml: Any) -> list[str]:
    out = []
    for name, suffix in _REASONS:
        bit = getattr(nvml, "nvmlClocksEventReason" + suffix, None)
        if bit is None:
            bit = getattr(nvml, "nvmlClocksThrottleReason" + suffix, None)
        if isinstance(bit, int) and bit and mask & bit:
            out.append(name)
    return out


@dataclass(frozen=True)
class GpuSample:
    """One card at one moment. Clocks in MHz, memory in bytes; None where the card or driver cannot tell."""

    index: int
    t: float  # time.time()
    sm_mhz: int | None
    mem_mhz: int | None
    pstate: int | None  # 0 = P0 (fastest) ... 15
    reasons: list[str]
    util_gpu: int | None  # percent
    util_mem: int | None
    temp_c: int | None
    power_w: float | None
    vram_used: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ClockResult:
    gpu: int
    locked: bool
    detail: str  # "locked: SM 1500-1905 MHz, memory 7001 MHz" or "NOT locked: <reason>; <what to do>"
    sm: tuple[int, int] | None = None
    mem: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "locked": self.locked,
            "detail": self.detail,
            "sm": list(self.sm) if self.sm else None,
            "mem": list(self.mem) if self.mem else None,
        }


class Nvml:
    """An NVML session: init once, handles by index, shut down on close."""

    def __init__(self, nvml: ModuleType | Any | None = None) -> None:
        self.nvml = _load(nvml)
        try:
            self.nvml.nvmlInit()
        except Exception as exc:
            code = _err_code(exc)
            if code == getattr(self.nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", -1):
                raise NvmlUnavailable(
                    "no NVIDIA driver found (libnvidia-ml / nvml.dll is missing): install the NVIDIA driver"
                ) from None
            if code == getattr(self.nvml, "NVML_ERROR_DRIVER_NOT_LOADED", -2):
                raise NvmlUnavailable(
                    "the NVIDIA driver is installed but not loaded: reboot or check `nvidia-smi`"
                ) from None
            raise NvmlUnavailable(f"NVML could not start ({exc}): check `nvidia-smi`") from None
        self.count = int(self.nvml.nvmlDeviceGetCount())
        self._handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.count)]
        self.closed = False

    def handle(self, index: int) -> Any:
        if not 0 <= index < self.count:
            raise ValueError(
                f"GPU {index} does not exist on this PC (it has {self.count}: 0-{self.count - 1})"
            )
        return self._handles[index]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass

    def _opt(self, fn: str, *args: Any) -> Any:
        call = getattr(self.nvml, fn, None)
        if call is None:
            return None
        try:
            return call(*args)
        except Exception:
            return None

    def sample(self, index: int) -> GpuSample:
        h = self.handle(index)
        nv = self.nvml
        reasons = self._opt("nvmlDeviceGetCurrentClocksEventReasons", h)
        if reasons is None:
            reasons = self._opt("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        util = self._opt("nvmlDeviceGetUtilizationRates", h)
        mem = self._opt("nvmlDeviceGetMemoryInfo", h)
        power = self._opt("nvmlDeviceGetPowerUsage", h)  # milliwatts
        pstate = self._opt("nvmlDeviceGetPerformanceState", h)
        return GpuSample(
            index=index,
            t=time.time(),
            sm_mhz=_int(self._opt("nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_SM)),
            mem_mhz=_int(self._opt("nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_MEM)),
            pstate=_int(pstate) if _int(pstate) is not None and 0 <= int(pstate) <= 15 else None,
            reasons=reason_names(int(reasons), nv) if isinstance(reasons, int) else [],
            util_gpu=_int(getattr(util, "gpu", None)),
            util_mem=_int(getattr(util, "memory", None)),
            temp_c=_int(self._opt("nvmlDeviceGetTemperature", h, getattr(nv, "NVML_TEMPERATURE_GPU", 0))),
            power_w=round(power / 1000.0, 1) if isinstance(power, int | float) else None,
            vram_used=_int(getattr(mem, "used", None)),
        )

    def sample_all(self) -> list[GpuSample]:
        return [self.sample(i) for i in range(self.count)]

    # -- clocks ----------------------------------------------------------------------------------------------

    def max_clocks(self, index: int) -> tuple[int | None, int | None]:
        h = self.handle(index)
        sm = _int(self._opt("nvmlDeviceGetMaxClockInfo", h, self.nvml.NVML_CLOCK_SM))
        mem = _int(self._opt("nvmlDeviceGetMaxClockInfo", h, self.nvml.NVML_CLOCK_MEM))
        return sm, mem

    def _why(self, exc: BaseException, smi: str = "nvidia-smi -lgc MIN,MAX") -> str:
        """Why NVML refused; `smi`: the nvidia-smi command that does the same by hand."""
        code = _err_code(exc)
        if code == getattr(self.nvml, "NVML_ERROR_NO_PERMISSION", -100):
            return f"no permission to change clocks; {_NO_PERMISSION_HINT.format(smi=smi)}"
        if code == getattr(self.nvml, "NVML_ERROR_NOT_SUPPORTED", -100):
            return "this card or driver does not support locked clocks (Volta or newer and a current driver needed)"
        return f"NVML refused ({exc})"

    def lock(
        self, index: int, sm: tuple[int, int] | None = None, mem: tuple[int, int] | None = None
    ) -> ClockResult:
        """Lock the SM clock to [min, max] (default: 80%-100% of its maximum) and the memory clock (default: its
        maximum). Never raises for a refusal: the result says "NOT locked" and why."""
        max_sm, max_mem = self.max_clocks(index)
        if sm is None:
            if not max_sm:
                return ClockResult(
                    index, False, "NOT locked: NVML does not report this card's maximum SM clock"
                )
            sm = (round(max_sm * 0.8), max_sm)
        if mem is None and max_mem:
            mem = (max_mem, max_mem)
        if sm[0] > sm[1] or (mem is not None and mem[0] > mem[1]):
            return ClockResult(
                index, False, "NOT locked: a clock range must be given as [min, max] with min <= max"
            )
        h = self.handle(index)
        setter = getattr(self.nvml, "nvmlDeviceSetGpuLockedClocks", None)
        try:
            if setter is not None:
                setter(h, sm[0], sm[1])
            else:
                _smi(index, f"-lgc={sm[0]},{sm[1]}")
        except Exception as exc:
            why = self._why(exc, f"nvidia-smi -i {index} -lgc {sm[0]},{sm[1]}")
            return ClockResult(index, False, f"NOT locked: {why}")
        detail = f"locked: SM {sm[0]}-{sm[1]} MHz"
        mem_done: tuple[int, int] | None = None
        if mem is not None:
            msetter = getattr(self.nvml, "nvmlDeviceSetMemoryLockedClocks", None)
            try:
                if msetter is not None:
                    msetter(h, mem[0], mem[1])
                else:
                    _smi(index, f"-lmc={mem[0]},{mem[1]}")
                mem_done = mem
                detail += f", memory {mem[0]}-{mem[1]} MHz" if mem[0] != mem[1] else f", memory {mem[0]} MHz"
            except Exception as exc:
                why = self._why(exc, f"nvidia-smi -i {index} -lmc {mem[0]},{mem[1]}")
                detail += f"; memory clock NOT locked: {why}"
        return ClockResult(index, True, detail, sm, mem_done)

    def reset(self, index: int) -> ClockResult:
        h = self.handle(index)
        problems = []
        for fn, flag in (
            ("nvmlDeviceResetGpuLockedClocks", "-rgc"),
            ("nvmlDeviceResetMemoryLockedClocks", "-rmc"),
        ):
            call = getattr(self.nvml, fn, None)
            try:
                if call is not None:
                    call(h)
                else:
                    _smi(index, flag)
            except Exception as exc:
                code = _err_code(exc)
                if code != getattr(self.nvml, "NVML_ERROR_NOT_SUPPORTED", -100) or "Gpu" in fn:
                    why = self._why(exc, f"nvidia-smi -i {index} {flag}")
                    problems.append(f"{'SM' if 'Gpu' in fn else 'memory'} clock: {why}")
        if problems:
            return ClockResult(index, True, "NOT reset: " + "; ".join(problems))
        return ClockResult(index, False, "reset: the driver manages the clocks again")


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _smi(index: int, flag: str) -> None:
    """`nvidia-smi -i N <flag>`; raises with nvidia-smi's own words when it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise RuntimeError("nvidia-smi is not on PATH and this NVML binding cannot lock clocks")
    proc = subprocess.run([exe, "-i", str(index), flag], capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        text = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(text[-1] if text else f"nvidia-smi {flag} exited with {proc.returncode}")


# ---------------------------------------------------------------------------------------------------------------
# The report


def pc_report() -> dict[str, Any]:
    """This PC as the agent describes it: hostname, OS, RAM, CPU (psutil)."""
    vm = psutil.virtual_memory()
    freq = None
    try:
        f = psutil.cpu_freq()
        freq = round(f.max or f.current) if f else None
    except Exception:
        freq = None
    return {
        "hostname": platform.node(),
        "os": platform.system(),
        "os_release": platform.release(),
        "os_version": platform.version(),
        "machine": platform.machine(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": psutil.cpu_count(logical=False),
        "cpu_threads": psutil.cpu_count(logical=True),
        "cpu_mhz": freq,
        "ram_total": vm.total,
        "ram_available": vm.available,
    }


def gpu_report(nvml: ModuleType | Any | None = None) -> dict[str, Any]:
    """Every card's facts and live state, or why there are none (`status` is installer.gpus' kind)."""
    result: ProbeResult = probe(nvml=nvml, others=())
    gpus = []
    samples: dict[int, GpuSample] = {}
    if result.ok:
        try:
            session = Nvml(nvml)
        except NvmlUnavailable:
            session = None
        if session is not None:
            try:
                samples = {s.index: s for s in session.sample_all()}
            finally:
                session.close()
    for g in result.gpus:
        s = samples.get(g.index)
        gpus.append(
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "vram_total": g.vram_total,
                "vram_free": g.vram_free,
                "compute_capability": list(g.compute_capability),
                "pcie_gen": g.pcie_gen,
                "pcie_width": g.pcie_width,
                "pcie_gen_max": g.pcie_gen_max,
                "pcie_width_max": g.pcie_width_max,
                "sm_count": g.sm_count,
                "max_sm_mhz": g.max_sm_clock_mhz,
                "driver": g.driver,
                "state": s.to_dict() if s else None,
            }
        )
    return {"status": result.kind, "message": result.message, "driver": result.driver, "gpus": gpus}


def gpu_summary(report: dict[str, Any]) -> str:
    """`2x RTX 3080 10 GB` style text for an mDNS advert (short: TXT records are small)."""
    names: dict[str, int] = {}
    for g in report.get("gpus", []):
        label = f"{str(g['name']).replace('NVIDIA ', '').replace('GeForce ', '')} {round(g['vram_total'] / 2**30)} GB"
        names[label] = names.get(label, 0) + 1
    text = ", ".join(f"{n}x {k}" if n > 1 else k for k, n in names.items())
    return (text or "no NVIDIA GPU")[:180]
