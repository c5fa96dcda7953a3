"""A token's routed experts computed on the CPU straight from Q4_K blocks in host RAM (Numba, AVX2): gate and up
Q4_K, down Q4_K or Q6_K (the layout of Q4_K_M files).

The expert store's pinned blocks are read in place: no repacked copy, no extra RAM, nothing to prepare at load, so
the CPU can compute any expert left in host RAM. The input is quantized to 8 bits per 256 values (a scale per 256
and the sums of each 32 and 16, as llama.cpp's q8_K), and each 32 bytes of codes are multiplied with it by the
integer multiply-adds of AVX2 (pmaddubsw, then pmaddwd with the sub-blocks' scales); Q4_K's minimums and Q6_K's
offset of 32 come from the sums. The rounding (of the input and of the gate's output before down) keeps a mix of
experts within cosine 0.9995-0.9999 of the exact float result on random blocks, a token's worst case over 40
routings 0.99947 (tests/engine/experts/test_cpu_q4k.py), which is why `--activations float`
(engine.kernels.int8_activations) keeps them out of the default paths (an explicit --cpu-experts F still uses them).

One call computes all of a request's experts: gate and up for every (expert, row block) in one parallel loop, then
down for every output row block, each summing its experts, in a second. On an H200 machine's 16 cores a request of
1-4 experts read 45-80 GB/s of blocks (the host's RAM reads ~96 GB/s), 1.4-2.3x torch's 4-bit kernel on a
repacked copy (bench/cpu_q4k_kernel.py, bench/results/cpu-q4k-kernel-2.json).

Numba compiles the kernels on first use (~5 s; cached on disk afterwards). Without Numba, or on a CPU without AVX2
and F16C, `available()` says why and engine/experts/cpu_experts.py falls back to torch's kernel on a repacked copy."""

import logging
import time

import numpy as np

from engine.kernels import cpu_blocks

log = logging.getLogger("strata.engine")

QK = 256  # values per Q4_K block
BLOCK_BYTES = 144  # d, dmin (half each), 12 bytes of 6-bit scales and minimums, 128 bytes of codes
Q6K_BYTES = 210  # Q6_K (the down projection of most Q4_K_M files): 128 + 64 bytes of codes, 16 scales, half d
ROWS_PER_TASK = 16  # output rows per parallel task: enough work per task to hide the scheduling
# One request at a time in the process: the stages of a split each answer their own card's requests, and Numba's
# fallback thread pool (workqueue, where neither OpenMP nor TBB is found) aborts on concurrent parallel launches.
_LOCK = cpu_blocks.LOCK
# StepServer.state: pairs computed, the kernels' cycles, the post in progress, the last failing kernel's error code
# and its mailbox row, whether the server holds the lock word
ST_PAIRS, ST_CYCLES, ST_AT, ST_BAD, ST_BAD_ROW, ST_HELD = 0, 1, 2, 3, 4, 5
# the process's step servers run one request's kernels at a time (a lock word they take inside Numba)
_STEP_LOCK = np.zeros(1, np.int64)


available = cpu_blocks.available  # Numba, and a CPU with AVX2 and F16C: the same probe as the dense kernels
_NO_KINDS = np.zeros(3, np.int64)


def _kernels():
    from engine.experts import cpu_q4k_jit  # lazy: importing it compiles the kernels (seconds), at first use

    return cpu_q4k_jit


class Q4KExperts:
    """One layer's routed experts in Q4_K blocks on the host, computed in place. gate, up: uint8 [E, F, F-row bytes]
    of a [E, F, D] tensor; down: uint8 [E, D, D-row bytes] of [E, D, F] (numpy views of the store: only read)."""

    def __init__(
        self, gate: np.ndarray, up: np.ndarray, down: np.ndarray, d: int, f: int, down_q6k: bool = False
    ) -> None:
        """down_q6k: down is in Q6_K blocks (Q4_K_M files mix them in), not Q4_K."""
        ok, why = available()
        if not ok:
            raise RuntimeError(f"the Q4_K CPU kernels cannot run here: {why}")
        if d % QK or f % QK:
            raise ValueError(f"Q4_K rows hold multiples of {QK} values, not D={d}, F={f}")
        n_exp = gate.shape[0]
        want = {"gate": (n_exp, f, d // QK * BLOCK_BYTES), "up": (n_exp, f, d // QK * BLOCK_BYTES),
                "down": (n_exp, d, f // QK * (Q6K_BYTES if down_q6k else BLOCK_BYTES))}  # fmt: skip
        for name, a in (("gate", gate), ("up", up), ("down", down)):
            if a.dtype != np.uint8 or a.shape != want[name]:
                kind = "Q6_K" if name == "down" and down_q6k else "Q4_K"
                raise ValueError(f"{name} must be uint8 {want[name]} ({kind} rows), got {a.dtype} {a.shape}")
            if not a.flags.c_contiguous:  # a copy here would double the experts' host RAM
                raise ValueError(f"{name} must be one contiguous block of rows (the store's layout)")
        # flat views: the kernels address rows by byte offset
        self._g, self._u, self._d = (a.reshape(-1) for a in (gate, up, down))
        self.n_experts, self.d, self.f, self.down_q6k = n_exp, d, f, down_q6k
        self._jit = _kernels()

    def mix(self, ids: np.ndarray, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        """ids int [n] distinct experts, w float32 [n] their weights, x float32 [D] -> out float32 [D] (written):
        the weighted sum of the experts' outputs."""
        ids = np.asarray(ids, dtype=np.int64)
        self.mix_rows(ids, np.zeros(ids.size, np.int64), w, x.reshape(1, -1), out.reshape(1, -1))

    def mix_rows(
        self, ids: np.ndarray, tok: np.ndarray, w: np.ndarray, x: np.ndarray, out: np.ndarray
    ) -> None:
        """(expert, token) pairs ids, tok int [n] with weights w float32 [n], x float32 [T, D] -> out float32 [T, D]
        (written): each token's weighted sum of its pairs' experts; an expert's blocks read once for its pairs."""
        ids, tok, w = cpu_blocks.pair_arrays(ids, tok, w)
        with _LOCK:
            bad = self._jit.mix(self._g, self._u, self._d, self.down_q6k, self.f, self.d, *cpu_blocks.NO_BOX, ids,
                                tok, w, np.ascontiguousarray(x, dtype=np.float32), out)  # fmt: skip
        cpu_blocks.check_pairs(bad, ids, tok, self.n_experts, x.shape[0])

    def step_args(self) -> tuple:
        """What StepServer takes of these kernels: (Q4_K kernels, gate, up, down blocks, down in Q6_K, kinds, row
        bytes; the last two the block kernels' only)."""
        return True, self._g, self._u, self._d, self.down_q6k, _NO_KINDS, _NO_KINDS[:2]

    def serve_box(self, box: np.ndarray, boxf: np.ndarray, at: tuple[int, int, int], n: int, k: int,
                  x: np.ndarray, out: np.ndarray) -> None:  # fmt: skip
        """A decode step's request in a mailbox row, answered in one kernel call (cpu_blocks.BlockExperts.serve_box
        says what the arguments are)."""
        with _LOCK:
            bad = self._jit.mix(self._g, self._u, self._d, self.down_q6k, self.f, self.d, box, boxf, *at, n, k,
                                *cpu_blocks.NO_PAIRS, x, out)  # fmt: skip
        if bad:
            cpu_blocks.check_pairs(
                bad, *cpu_blocks.box_pairs(box, boxf, at, n, k)[:2], self.n_experts, x.shape[0]
            )


class StepServer:
    """A decode step's mailbox requests (engine/experts/cpu_misses.py) answered in one Numba call that holds no GIL:
    the polling, every request's kernels and the answers, so the process's other threads (the HTTP server, a
    second stage) run meanwhile, and a request costs no Python between the device's post and the host's answer.
    `kernels`: each mailbox row's layer's (Q4KExperts or cpu_blocks.BlockExperts), all of one width."""

    def __init__(self, kernels: "list[Q4KExperts | cpu_blocks.BlockExperts]", lay: tuple[int, ...], f: int,
                 d: int) -> None:  # fmt: skip
        j = _kernels()
        args = [k.step_args() for k in kernels]
        self.lay = np.array(lay, np.int64)
        self.q4k = np.array([a[0] for a in args], np.bool_)
        self.gates, self.ups, self.downs = (j.typed_arrays([a[i] for a in args]) for i in (1, 2, 3))
        self.q6k = np.array([a[4] for a in args], np.bool_)
        self.kinds = np.stack([a[5] for a in args]).astype(np.int64)
        self.row_bytes = np.stack([np.asarray(a[6], np.int64) for a in args])
        self.f, self.d, self.f16 = f, d, j.BLOCKS_F16
        self.state = np.zeros(6, np.int64)
        # the cycle counter's rate, for the time spent in the kernels
        c0, t0 = j.read_cycles(), time.perf_counter()
        time.sleep(0.005)
        self.hz = (j.read_cycles() - c0) / (time.perf_counter() - t0)
        # with Numba's own thread pool (no OpenMP or TBB) parallel calls from two threads abort: one at a time, and
        # short turns then (another stage's thread takes the lock between them)
        self._one_at_a_time = j.one_at_a_time()
        self._step = j.serve_step(not self.q4k.all())  # the block kernels' branch only where a layer needs it
        self.spin_s = 0.0002 if self._one_at_a_time else 0.05

    def serve(self, box: np.ndarray, done: np.ndarray, posts: np.ndarray, first: int) -> int:
        """Answer posts[first:] (cpu_q4k_jit.serve_step) -> the index of the first not answered (len(posts): all)."""
        args = (box, done, posts, first, int(self.spin_s * self.hz), self.lay, self.q4k, self.gates, self.ups,
                self.downs, self.q6k, self.kinds, self.row_bytes, self.f, self.d, self.f16, self.state,
                _STEP_LOCK)  # fmt: skip
        try:
            if self._one_at_a_time:
                with _LOCK:
                    return self._step(*args)
            return self._step(*args)
        except BaseException:
            if self.state[ST_HELD]:  # a kernel raised while this server held the lock word: let it go
                self.state[ST_HELD] = 0
                _STEP_LOCK[0] = 0
            raise
