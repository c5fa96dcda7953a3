"""Programmatic dependent launch for the decode step's kernel chain (Hopper and later).

A decode step is ~9 small kernels a layer, each waiting for the one before. Launched with PDL, a kernel's programs
start while the previous kernel finishes: each reads what does not depend on it (its weight rows, prefetched into
L2 by one bulk copy) and then waits (`griddepcontrol.wait`: the previous kernel complete, its writes visible)
before it reads or writes anything else. Every kernel launched this way waits before touching the step's data, so
the wait chains: a kernel's wait also covers every kernel before the previous one. On GPUs before sm_90, with a
Triton or a driver too old for it (`pdl`), under Triton's interpreter, or with STRATA_PDL=0 the kernels launch one
after another as before; tests/engine/test_launch_rules.py checks on the source that every kernel launched early
waits before its first load or store."""

import ctypes
import functools
import os
import sys

import torch
import triton
import triton.language as tl

from installer.engine_options import runtime_switches

try:  # the NVIDIA backend's options (a Triton built without it has none)
    from triton.backends.nvidia.compiler import CUDAOptions
except ImportError:
    CUDAOptions = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter: no inline PTX there


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel (complete, memory visible), then let the next one launch. Call it before the
    first read of anything another kernel of the step writes, and before any write."""
    if PDL:
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; griddepcontrol.launch_dependents; mov.u32 $0, 0;",
            "=r", [], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def prefetch_l2(ptr, nbytes, PDL: tl.constexpr):
    """Start reading the `nbytes` at `ptr` into L2 (the 16-byte units that hold them: one bulk prefetch, by one
    thread of the program): weight rows the program or the next kernel reads soon. With PDL only: otherwise
    nothing runs ahead of the loads themselves."""
    if PDL:
        a = ptr.to(tl.uint64, bitcast=True)
        lo = a & ~tl.full([], 15, tl.uint64)
        size = ((a + nbytes.to(tl.uint64) + 15) & ~tl.full([], 15, tl.uint64)) - lo
        tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            .reg .u32 t;
            mov.u32 t, %tid.x;
            setp.eq.u32 p, t, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }""",
            "=r,l,r", [lo, size.to(tl.uint32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


def _triton_launches_pdl() -> bool:
    """Whether this Triton takes the `launch_pdl` launch option (an older one, or a build without the NVIDIA
    backend, would refuse the keyword at the first launch)."""
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


# CUDA graphs keep a programmatic launch's early start from CUDA 12.3's driver on; an older driver may refuse the
# launch attribute inside a capture.
MIN_DRIVER = 12030


def driver_version() -> int | None:
    """The CUDA driver's version (12030 for 12.3) from the driver library torch has loaded; None where unknown."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        lib = ctypes.WinDLL(name) if sys.platform == "win32" else ctypes.CDLL(name)  # type: ignore[attr-defined]
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return int(v.value)


@functools.cache
def _capable(index: int) -> bool:
    if (
        not runtime_switches().pdl
        or torch.cuda.get_device_capability(index) < (9, 0)
        or not _triton_launches_pdl()
    ):
        return False
    drv = driver_version()
    return drv is None or drv >= MIN_DRIVER


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA sm_90 or later, a Triton that takes the launch option, a
    driver of CUDA 12.3 or later, compiled (not interpreted), STRATA_PDL (read once per device and process)."""
    if device.type != "cuda" or INTERPRETED:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict:
    """The launch keywords of a kernel that takes `PDL: tl.constexpr` (and calls pdl_enter)."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {}
