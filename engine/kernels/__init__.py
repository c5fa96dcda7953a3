"""The engine's GPU kernels (Triton) and what they share with the CPU kernels. Importing the package loads no Triton:
its kernel modules load on first use, `kernels.gemv.moe_gemv(...)` (PEP 562), the one place where the engine
imports them lazily, because CPU-only installs have no Triton (an ImportError there says so to the caller)."""

import importlib
from types import ModuleType

from installer import engine_options

_KERNEL_MODULES = frozenset(
    ("attention", "cpu_handoff", "delta_net", "dequant", "fused", "gemv", "expert_lru", "launch", "moe_blocks", "moe_gemm", "prefill_attention", "route_trace", "rows_gemm", "stage_copy",
     "token_mask", "tuning", "vec_dot")
)  # fmt: skip


def __getattr__(name: str) -> ModuleType:
    if name in _KERNEL_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def loaded(name: str) -> ModuleType | None:
    """The kernel module `name`, or None where Triton is not installed (the CPU paths run instead)."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        return None


def int8_activations() -> bool:
    """`--activations` (STRATA_ACTIVATIONS, read by installer.engine_options): "int8", the default, lets a GPU
    launch class whose tuning entry has an 8-bit body (a "<class>:q8" key) read activations rounded to 8 bits, as
    llama.cpp's MMVQ does (1.7-2.3x the float bodies' speed on an H200), and lets the CPU's expert kernels
    (engine/experts/cpu_q4k.py) round theirs; "float" keeps every product on float activations (the exact path)."""
    return engine_options.int8_activations()
