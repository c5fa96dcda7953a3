"""Matrix products on the CPU straight from GGUF blocks, for every block type the CPU reads in place: no float copy
of a weight is kept (engine/kernels/cpu_blocks_jit.py holds the Numba kernels and says how they read blocks).

`matmul(raw, qtype, n_out, k, x)`: x [..., k] (float) @ W.T -> float32 [..., n_out], with x rounded to 8 bits per
32 values as llama.cpp's CPU path does (`--activations float` keeps the exact path of engine/layers/qtensor.py).
`dequantize(raw, qtype, n_out, k)` gives the float rows with the same unpacking (prompt chunks multiply those
through a float GEMM one tile at a time).

Numba compiles the kernels on first use (~10 s; cached on disk afterwards). Without Numba `available()` says why
and the callers keep their float paths."""

import functools
import importlib.util
import logging
import threading
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

# Block types computed here (the others, IQ1-IQ3 grids among them, go through the float path).
KINDS = frozenset({QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
                   QT.IQ4_NL, QT.IQ4_XS, QT.MXFP4})  # fmt: skip
# One product at a time in the process (Numba's workqueue pool aborts on concurrent parallel launches); the experts'
# CPU kernels take the same lock.
LOCK = threading.Lock()
log = logging.getLogger("strata.engine")


@functools.cache
def available() -> tuple[bool, str]:
    """(True, "") where the kernels can run here (Numba, and a CPU with AVX2 and F16C), else (False, why)."""
    if importlib.util.find_spec("numba") is None or importlib.util.find_spec("llvmlite") is None:
        return False, "Numba is not installed (pip install numba)"
    try:
        import llvmlite.binding as llvm  # lazy: Numba's compiler, loaded only where a CPU kernel may run

        feats = llvm.get_host_cpu_features()
    except (ImportError, RuntimeError) as e:  # llvmlite cannot read the features on some hosts
        return False, f"the CPU's features could not be read ({e})"
    missing = [f for f in ("avx2", "f16c") if not feats.get(f, False)]
    if missing:
        return False, f"the CPU lacks {' and '.join(m.upper() for m in missing)}"
    return True, ""


def supports(qtype: QT, k: int) -> bool:
    return qtype in KINDS and k % GGML_QUANT_SIZES[qtype][0] == 0 and available()[0]


@functools.cache
def _jit():
    from engine.kernels import cpu_blocks_jit  # lazy: the first call compiles (or loads the cache)

    return cpu_blocks_jit


def _flat(raw: torch.Tensor) -> np.ndarray:
    return raw.reshape(-1).numpy()


def matmul(raw: torch.Tensor, qtype: QT, n_out: int, k: int, x: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ W.T for W [n_out, k] in `qtype` blocks (raw: its bytes, on the CPU) -> float32 [..., n_out]."""
    j = _jit()
    x2 = x.reshape(-1, k).to(torch.float32).contiguous().numpy()
    out = np.empty((x2.shape[0], n_out), np.float32)
    row_bytes = k // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
    with LOCK:
        j.matmul(_flat(raw), int(qtype), n_out, k, row_bytes, x2, out, j.F16)
    return torch.from_numpy(out).reshape(*x.shape[:-1], n_out)


def dequantize(raw: torch.Tensor, qtype: QT, n_out: int, k: int) -> torch.Tensor:
    """W's rows as float32 [n_out, k]."""
    j = _jit()
    out = np.empty((n_out, k), np.float32)
    row_bytes = k // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
    with LOCK:
        j.dequantize(_flat(raw), int(qtype), n_out, k, row_bytes, out, j.F16)
    return torch.from_numpy(out)


def warm_up() -> None:
    """Compile the kernels (or load them from Numba's cache) now, at load, rather than in the first request: one
    compilation serves every block type."""
    t0 = time.perf_counter()
    raw = torch.zeros(1, GGML_QUANT_SIZES[QT.Q8_0][1], dtype=torch.uint8)
    matmul(raw, QT.Q8_0, 1, 32, torch.zeros(1, 32))
    dequantize(raw, QT.Q8_0, 1, 32)
    secs = time.perf_counter() - t0
    if secs > 2:
        log.info("CPU kernels compiled in %.0f s (kept in Numba's cache for the next start)", secs)
