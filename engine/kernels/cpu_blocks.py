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

# Block types computed here (the others - F16, BF16, the ternary TQ types, NVFP4 - take the float path); IN_PLACE:
# those read without unpacking a row first (all but Q2_K, Q3_K and the IQ grids), which routed experts need.
UNPACKED = frozenset(
    {QT.Q2_K, QT.Q3_K, QT.IQ1_S, QT.IQ1_M, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S}
)
KINDS = frozenset({QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS,
                   QT.MXFP4}) | UNPACKED  # fmt: skip
IN_PLACE = KINDS - UNPACKED
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


def attend_rows(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    pos: np.ndarray,
    window: int,
    scale: float,
    softcap: float,
    out: np.ndarray,
) -> None:
    """engine/kernels/cpu_attention.py's kernel (cpu_blocks_jit.attend_rows), compiled and cached with these."""
    _jit().attend_rows(q, k, v, pos, int(window), np.float32(scale), np.float32(softcap), out)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int, neox: bool) -> torch.Tensor:
    """engine/layers/rope.py's rotation of x [T, H, D] (float32, contiguous) by cos, sin [T, dim/2] (float32) in one
    kernel call (cpu_blocks_jit.rotate) instead of ~10 torch operations a call, two calls a layer."""
    out = torch.empty_like(x)
    _jit().rotate(x.numpy(), cos.numpy(), sin.numpy(), int(dim), bool(neox), out.numpy())
    return out


_NO_WEIGHT = np.zeros(0, np.float32)


def attend_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    consts: "tuple[np.ndarray, ...]",
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dim: int,
    neox: bool,
    kc: torch.Tensor,
    vc: torch.Tensor,
    pos: np.ndarray,
    window: int,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """cpu_blocks_jit.attend_step: a CPU decode step's attention from its projections q [T, H*Dk], k, v (float32,
    contiguous, written), `consts` the layer's (q, k, v biases, q, k norms) as float32 arrays (empty: none), into
    the float32 cache kc, vc [S, Hkv, D] at positions pos (int64) -> [T, H*Dv]."""
    t, dv = q.shape[0], vc.shape[2]
    n_head = q.shape[1] // kc.shape[2]
    out = np.empty((t, n_head, dv), np.float32)
    _jit().attend_step(q.numpy(), k.numpy(), v.numpy(), *consts, np.float32(eps), cos.numpy(), sin.numpy(),
                       int(dim), bool(neox), kc.numpy(), vc.numpy(), pos, int(window), np.float32(scale),
                       np.float32(softcap), out)  # fmt: skip
    return torch.from_numpy(out).view(t, n_head * dv)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """engine/layers/norm.py's RMS norm of float32 rows (x [..., D] contiguous, weight float32 [D] or None) in one
    kernel call (cpu_blocks_jit.rms_norm): torch's composite took ~10 us a decode row on 2 cores, ~50 a token."""
    flat = x.dim() == 2  # a step's rows: no reshapes (each torch call ~1 us)
    xn = x.numpy() if flat else x.reshape(-1, x.shape[-1]).numpy()
    out = np.empty_like(xn)
    _jit().rms_norm(xn, _NO_WEIGHT if weight is None else weight.numpy(), float(eps), out)
    return torch.from_numpy(out) if flat else torch.from_numpy(out).view(x.shape)


def _flat(raw: torch.Tensor) -> np.ndarray:
    return raw.reshape(-1).numpy()


def matmul(raw: torch.Tensor, qtype: QT, n_out: int, k: int, x: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ W.T for W [n_out, k] in `qtype` blocks (raw: its bytes, on the CPU) -> float32 [..., n_out]."""
    return Weight(raw, qtype, n_out, k).matmul(x)


class Weight:
    """A weight's blocks as the kernels take them, worked out once: a decode step makes ~130 products of a few
    microseconds of work each, and working the arguments out per call cost a third of a small one's time."""

    __slots__ = ("flat", "k", "kind", "n_out", "row_bytes")

    def __init__(self, raw: torch.Tensor, qtype: QT, n_out: int, k: int) -> None:
        self.flat, self.kind, self.n_out, self.k = _flat(raw), int(qtype), n_out, k
        self.row_bytes = _row_bytes(qtype, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> float32 [..., n_out]."""
        j = _jit()
        # a decode step's row: no reshapes (each torch call costs ~1 us, ~170 products a token)
        flat2 = x.dim() == 2
        x2 = x if flat2 else x.reshape(-1, self.k)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.to(torch.float32).contiguous()
        out = torch.empty(x2.shape[0], self.n_out)
        with LOCK:
            o, f, kd, rb = out.numpy(), self.flat, self.kind, self.row_bytes  # one weight: the others' rows 0
            j.matmul(f, f, f, kd, kd, kd, self.n_out, 0, 0, rb, rb, rb, self.k, x2.numpy(), o, o, o, j.F16)
        return out if flat2 else out.reshape(*x.shape[:-1], self.n_out)


def in_one_call(weights: "list[Weight]", rows: int) -> bool:
    """Whether matmul_many takes these weights' products with `rows` decode rows in one call: two or three weights
    of the same input width."""
    return 2 <= len(weights) <= 3 and rows <= 8 and len({w.k for w in weights}) == 1


def matmul_many(weights: "list[Weight]", x: torch.Tensor) -> list[torch.Tensor]:
    """x [T, k] (T <= 8) times each weight (in_one_call's) -> float32 [T, n_out] each, in one parallel region with x
    quantized once; the same sums, to the bit, as each weight's own matmul."""
    j = _jit()
    x2 = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    outs = [torch.empty(x2.shape[0], w.n_out) for w in weights]
    ws = list(weights) + [weights[0]] * (3 - len(weights))
    ns = [w.n_out for w in weights] + [0] * (3 - len(weights))
    os_ = [o.numpy() for o in outs] + [outs[0].numpy()] * (3 - len(weights))
    with LOCK:
        j.matmul(ws[0].flat, ws[1].flat, ws[2].flat, ws[0].kind, ws[1].kind, ws[2].kind, ns[0], ns[1], ns[2],
                 ws[0].row_bytes, ws[1].row_bytes, ws[2].row_bytes, weights[0].k, x2.numpy(), *os_, j.F16)  # fmt: skip
    return outs


def dequantize(raw: torch.Tensor, qtype: QT, n_out: int, k: int, bf16: bool = False) -> torch.Tensor:
    """W's rows as float32 [n_out, k], or bfloat16 (rounded to nearest even) with `bf16`."""
    j = _jit()
    out = np.empty((0 if bf16 else n_out, k), np.float32)
    bits = np.empty((n_out if bf16 else 0, k), np.uint16)
    with LOCK:
        j.dequantize(_flat(raw), int(qtype), n_out, k, _row_bytes(qtype, k), out, bits, j.F16)
    got = torch.from_numpy(bits if bf16 else out)
    return got.view(torch.bfloat16) if bf16 else got


@functools.cache
def bf16_gemm() -> bool:
    """Whether prompt chunks' products over 8-bit activations multiply bfloat16 tiles of the weights (dequantize's
    `bf16`) rather than float32 ones: where the cores have bfloat16 dot products (AVX512-BF16, AMX), whose GEMM runs
    at ~2.5x float32's pace; elsewhere torch emulates bfloat16 products, slower than float32's."""
    cpu = torch.cpu
    return any(
        getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )


def warm_up() -> None:
    """Compile the kernels (or load them from Numba's cache) now, at load, rather than in the first request: one
    compilation serves every block type."""
    t0 = time.perf_counter()
    raw = torch.zeros(1, GGML_QUANT_SIZES[QT.Q8_0][1], dtype=torch.uint8)
    matmul(raw, QT.Q8_0, 1, 32, torch.zeros(1, 32))
    dequantize(raw, QT.Q8_0, 1, 32, bf16_gemm())
    one = np.zeros((1, 1, 32), np.float32)  # a decode step's attention (engine/kernels/cpu_attention.py)
    attend_rows(one, one, one, np.zeros(1, np.int64), 0, 1.0, 0.0, np.empty_like(one))
    secs = time.perf_counter() - t0
    if secs > 2:
        log.info("CPU kernels compiled in %.0f s (kept in Numba's cache for the next start)", secs)


# what the kernels' mix takes in place of a mailbox row (pairs given as arrays), and of the arrays (a mailbox row)
_EMPTY_BOX = np.zeros(0, np.int32)
NO_BOX = (_EMPTY_BOX, _EMPTY_BOX.view(np.float32), 0, 0, 0, -1, 1)
NO_PAIRS = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))


def pair_arrays(ids: np.ndarray, tok: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expert, token) pairs as the kernels take them (int64, int64, float32: one compiled form each)."""
    return np.asarray(ids, dtype=np.int64), np.asarray(tok, dtype=np.int64), np.asarray(w, dtype=np.float32)


def box_pairs(
    box: np.ndarray, boxf: np.ndarray, at: tuple[int, int, int], n: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mailbox row's taken pairs as (expert ids, token rows, weights), read by numpy (the kernels read them
    themselves: this is for the kernels that do not, and for error messages)."""
    take = np.flatnonzero(box[at[1] : at[1] + n])
    return box[at[0] : at[0] + n][take], take // k, boxf[at[2] : at[2] + n][take]


def check_pairs(bad: int, ids: np.ndarray, tok: np.ndarray, n_experts: int, n_tok: int) -> None:
    """Raise for an error code of the kernels' grouping (1: an expert id, 2: a token row out of range)."""
    if bad == 1:
        raise ValueError(f"expert ids {ids.tolist()} out of range: this layer has 0..{n_experts - 1}")
    if bad == 2:
        raise ValueError(f"token rows {tok.tolist()} out of range: the input has {n_tok}")


def _row_bytes(qtype: QT, k: int) -> int:
    return k // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]


class BlockExperts:
    """A layer's routed experts computed from their blocks where they lie (gate, up [E, F, D] and down [E, D, F],
    uint8 row bytes of any KINDS, e.g. the host store's pinned copy; the UNPACKED ones a row at a time into codes,
    as matmul takes them): SiLU-gated, as engine.experts.cpu_q4k.Q4KExperts computes Q4_K/Q6_K ones, with the
    same `mix`."""

    def __init__(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray, qtypes: tuple[QT, QT, QT], d: int,
                 f: int) -> None:  # fmt: skip
        for name, qt, k in (("gate", qtypes[0], d), ("up", qtypes[1], d), ("down", qtypes[2], f)):
            if qt not in KINDS or k % GGML_QUANT_SIZES[qt][0]:
                raise ValueError(
                    f"{name} ({qt.name}, rows of {k}) cannot be read from its blocks by the CPU kernels"
                )
        want = {"gate": (f, _row_bytes(qtypes[0], d)), "up": (f, _row_bytes(qtypes[1], d)),
                "down": (d, _row_bytes(qtypes[2], f))}  # fmt: skip
        for name, a in (("gate", gate), ("up", up), ("down", down)):
            if a.dtype != np.uint8 or a.shape[1:] != want[name] or not a.flags.c_contiguous:
                raise ValueError(f"{name} must be contiguous uint8 [E, {want[name][0]}, {want[name][1]}], got "
                                 f"{a.dtype} {a.shape}")  # fmt: skip
        if _row_bytes(qtypes[0], d) != _row_bytes(qtypes[1], d):
            raise ValueError("gate and up rows must be of one size")
        self._g, self._u, self._d = (a.reshape(-1) for a in (gate, up, down))
        self._kinds = np.array([int(q) for q in qtypes], np.int64)
        self._rb = (_row_bytes(qtypes[0], d), _row_bytes(qtypes[2], f))
        self.n_experts, self.d, self.f = gate.shape[0], d, f

    def mix(self, ids: np.ndarray, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        """ids int [n] distinct experts, w float32 [n] their weights, x float32 [D] -> out float32 [D] (written)."""
        ids = np.asarray(ids, dtype=np.int64)
        self.mix_rows(ids, np.zeros(ids.size, np.int64), w, x.reshape(1, -1), out.reshape(1, -1))

    def mix_rows(
        self, ids: np.ndarray, tok: np.ndarray, w: np.ndarray, x: np.ndarray, out: np.ndarray
    ) -> None:
        """(expert, token) pairs ids, tok int [n] with weights w float32 [n], x float32 [T, D] -> out float32 [T, D]
        (written): each token's weighted sum of its pairs' experts; an expert's blocks read once for its pairs."""
        ids, tok, w = pair_arrays(ids, tok, w)
        j = _jit()
        with LOCK:
            bad = j.mix(self._g, self._u, self._d, self._kinds, self._rb[0], self._rb[1], self.f, self.d, *NO_BOX,
                        ids, tok, w, np.ascontiguousarray(x, dtype=np.float32), out, j.F16)  # fmt: skip
        check_pairs(bad, ids, tok, self.n_experts, x.shape[0])

    def step_args(self) -> tuple:
        """What engine.experts.cpu_q4k.StepServer takes of these kernels (its Q4KExperts.step_args's order)."""
        return False, self._g, self._u, self._d, False, self._kinds, np.array(self._rb, np.int64)

    def serve_box(self, box: np.ndarray, boxf: np.ndarray, at: tuple[int, int, int], n: int, k: int,
                  x: np.ndarray, out: np.ndarray) -> None:  # fmt: skip
        """A decode step's request in a mailbox row (engine/experts/cpu_misses.py), answered in one kernel call:
        of the row's n pairs (k a token) those flagged taken, their expert ids and weights at the offsets
        at = (ids, taken, weights) of the int32 row box and its float32 view boxf; x [T, D] -> out [T, D]."""
        j = _jit()
        with LOCK:
            bad = j.mix(self._g, self._u, self._d, self._kinds, self._rb[0], self._rb[1], self.f, self.d, box, boxf,
                        *at, n, k, *NO_PAIRS, x, out, j.F16)  # fmt: skip
        if bad:
            check_pairs(bad, *box_pairs(box, boxf, at, n, k)[:2], self.n_experts, x.shape[0])
