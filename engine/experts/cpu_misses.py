"""A decode step's missed experts split between the CPU and the GPU's PCIe copies (`--cpu-experts F`).

Of each layer's experts left in host RAM, a fraction F (the least used first, where a profile says which) may be
computed by the CPU (engine/experts/cpu_experts.py): Q4_K experts straight from the store's blocks, other types
from a repacked copy. By default every expert of the layers read in place, and no others. When a one-token step
misses experts the CPU holds, the CPU computes some of them while the GPU copies and computes the others: the two
draw on different buses (host RAM for the CPU, PCIe for the copies), so a layer's misses take less time than the
copies alone would.

No host synchronisation is involved (engine/kernels/cpu_handoff.py): the device decides which slots the CPU takes
(at most `quota[m]` when the step misses m experts, so the CPU's share stays near the `ratio` that balances the two
sides) and writes them into a pinned mailbox; the host polls the mailbox, computes, and writes the sum back; the
device waits for it only where the CPU took a slot. Decode steps therefore still run as CUDA graphs.

The host side runs on the thread that launches the step, not on a thread of its own: once a graph is replayed
(or a layer's launches are queued) that thread has nothing else to do, and the CPU kernels then use its thread
team. A second thread would bring a second team, and with more OpenMP threads than cores libgomp stops spinning
between parallel regions, so that each kernel call woke sleeping threads (on an H200's 16-core host, torch's
kernels: 270-380 us an expert from a second thread, 150-160 us from the launching one).

Where every held layer is read in place, a replayed step's requests are answered by one call of
engine.experts.cpu_q4k.StepServer: it polls, computes and answers them all in Numba without holding the GIL, so
the process's other threads (the HTTP server's, a second stage's) run meanwhile and no Python runs between a post
and its answer (STRATA_CPU_STEP_SERVE=0: request by request from Python)."""

import logging
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.experts.cache import MAX_STEP_ROWS
from engine.experts.cpu_experts import CpuExperts
from engine.experts.cpu_q4k import ST_AT, ST_BAD, ST_BAD_ROW, ST_CYCLES, ST_PAIRS, StepServer
from engine.experts.share_tuner import ShareTuner, nested_turn
from engine.kernels import cpu_handoff as ho
from engine.kernels.cpu_blocks import box_pairs, check_pairs
from installer.engine_options import runtime_switches

if TYPE_CHECKING:
    from engine.experts.cache import ExpertCache

log = logging.getLogger("strata.engine")
# The CPU's share of a layer's misses where the tuner starts (share_tuner.py): 4 of 8 was the best fixed share on an
# H200's 16-core host beside PCIe 5 with the in-place Q4_K kernels, across processes (Qwen3-30B-A3B at llama.cpp's
# -ncmoe 36 VRAM, docs/performance.md); --cpu-ratio fixes one.
DEFAULT_RATIO = 0.5
_IDLE_S = 30.0  # the host gives up on a request the device has not posted after this long (and says so)
_TUNERS: "weakref.WeakSet[ShareTuner]" = weakref.WeakSet()  # the process's live tuners (their turns nest)


class CpuMisses:
    """The CPU's share of one expert cache's misses: the experts it holds and the mailboxes."""

    def __init__(
        self,
        cache: "ExpertCache",
        share: float,
        k: int,
        act: str,
        profile: torch.Tensor | None = None,
        ratio: float | None = None,
        in_place_only: bool = False,
    ) -> None:
        """share: the fraction of each layer's host-RAM experts the CPU may compute; in_place_only: only layers
        whose blocks it reads in place (nothing repacked, the default of --cpu-experts); ratio: the CPU's share of a
        step's misses, fixed (--cpu-ratio), or None: tuned while serving from DEFAULT_RATIO (share_tuner.py)."""
        if not 0.0 < share <= 1.0:
            raise ValueError(f"--cpu-experts {share}: give a fraction above 0 and at most 1")
        self.cache = cache
        self.k = k
        self.act = act
        self.layers: dict[int, CpuExperts] = {}
        dev = cache.device
        d = 0
        for li, le in cache.layers.items():
            if le.host_tables is None:  # every expert of the layer is in VRAM
                continue
            if in_place_only and not CpuExperts.in_place(le.gate.host, le.up.host, le.down.host, act):
                continue
            out = [e for e in range(le.n_expert) if le.slot_of[e] < 0]
            if profile is not None:
                out.sort(key=lambda e: float(profile[li, e]))  # the least used go to the CPU
            n = round(len(out) * share)
            if n:
                self.layers[li] = CpuExperts(le.gate.host, le.up.host, le.down.host, out[:n], act)
                d = self.layers[li].d
        self.d = d
        self.rows = {li: r for r, li in enumerate(self.layers)}
        # decode rows a step hands over at most (a decode step's fused launches take up to as many)
        self.max_rows = MAX_STEP_ROWS
        self.layout = ho.row_layout(k, max(d, 1), self.max_rows)
        self.answer = self.layout.answer
        n_rows = max(len(self.layers), 1)
        pin = dev.type == "cuda"  # the device reads and writes these in place, over PCIe
        self.box = torch.zeros(n_rows, self.layout.words, dtype=torch.int32, pin_memory=pin)
        self.quota = torch.zeros(self.layout.pairs + 1, dtype=torch.int32, pin_memory=pin)
        self.tuner: ShareTuner | None = None
        self._seen = 0.0  # when the host last saw a step reach its first held layer (perf_counter)
        self._apply(DEFAULT_RATIO if ratio is None else ratio)
        if ratio is None:
            self.tuner = ShareTuner(self.ratio, turn=nested_turn(len(_TUNERS)))
            _TUNERS.add(self.tuner)
        n_exp = max((le.n_expert for le in cache.layers.values()), default=1)
        cpu_of = torch.zeros(n_rows, n_exp, dtype=torch.int32)  # 1 where the CPU holds the expert
        for li, r in self.rows.items():
            cpu_of[r, [e for e in range(n_exp) if self.layers[li].holds(e)]] = 1
        self.cpu_of = cpu_of.to(dev)
        self._layer_of = list(self.rows)
        self.cnt = torch.zeros(n_rows, dtype=torch.int32, device=dev)
        self.claim = torch.zeros(n_rows, self.layout.pairs, dtype=torch.int32, device=dev)
        self.wg = torch.zeros(n_rows, self.layout.pairs, dtype=torch.float32, device=dev)
        self.taken = torch.zeros(1, dtype=torch.int64, device=dev)
        self.error: BaseException | None = None
        self._box = self.box.numpy()
        self._boxf = self.box.view(torch.float32).numpy()
        self._done = np.zeros(n_rows, dtype=np.int32)
        # each mailbox's inputs and sums as float32 [rows, D] views, made once (the answer reads them)
        lay, most = self.layout, self.max_rows
        self._x = [self._boxf[r, lay.x : lay.x + most * d].reshape(most, d) for r in range(n_rows)]
        self._at = (ho.IDS, ho.IDS + lay.pairs, ho.IDS + 2 * lay.pairs)  # a row's ids, taken flags, weights
        self._y = [self._boxf[r, lay.y : lay.y + most * d].reshape(most, d) for r in range(n_rows)]
        self._recorded: list[int] | None = None  # a capture's posts (recording)
        self._rows_seen = 0  # rows of the last step timed for the tuner
        self.served = [0, 0, 0.0]  # requests answered, experts computed, seconds spent computing them
        held = sum(ce.n_held for ce in self.layers.values())
        in_place = sum(ce.q4k is not None for ce in self.layers.values())
        how = (f"{in_place} layers read in place, " if in_place else "") + (
            f"{sum(ce.nbytes for ce in self.layers.values()) / 2**30:.1f} GiB of repacked copies"
        )
        log.info("%d experts of %d layers also computed by the CPU (%s): it takes %s of a decode step's misses%s",
                 held, len(self.layers), how, f"{100 * self.ratio:.0f}%",
                 ", tuned while serving" if self.tuner else "")  # fmt: skip
        if in_place:  # compile (or load from the disk cache) now, not in the first decode step
            for ce in {ce.kernels: ce for ce in self.layers.values() if ce.q4k is not None}.values():
                scratch = np.zeros(self.layout.words, np.int32)
                scratch[self._at[1]] = 1  # one pair taken (expert 0, weight 0): the whole path runs once
                ce.serve_box(scratch, scratch.view(np.float32), self._at, k, k, np.zeros((1, d), np.float32),
                             np.zeros((1, d), np.float32))  # fmt: skip
        self._fast = self._step_server()

    def _step_server(self) -> StepServer | None:
        """A step's requests answered in one call without the GIL, where every held layer is read in place (else,
        or with STRATA_CPU_STEP_SERVE=0, request by request from Python)."""
        kernels = [self.layers[li].q4k for li in self._layer_of]
        if not kernels or any(kn is None for kn in kernels) or not runtime_switches().cpu_step_serve:
            return None
        lay = self.layout
        fast = StepServer(kernels, (lay.pairs, lay.x, lay.answer, lay.y, self.k, self.max_rows, ho.HDR_REQ,
                                    ho.HDR_TAKE, ho.HDR_ROWS, ho.IDS), self.layers[self._layer_of[0]].f, self.d)  # fmt: skip
        t0 = time.perf_counter()
        fast.serve(self._box, self._done, np.zeros(0, np.int64), 0)  # compiled once per process
        took = time.perf_counter() - t0
        (log.info if took > 2 else log.debug)(
            "the CPU's step server compiled in %.1f s (once per process)", took
        )
        return fast

    # -- the device side, from the decode step --------------------------------------------------------------------

    def set_ratio(self, ratio: float) -> None:
        """Fix the CPU's share of a step's misses (no more tuning): quota[m] = round(ratio * m) experts when the step
        misses m distinct experts. Read by the device at every step (pinned memory), so it can change between
        steps, graphs included."""
        self.tuner = None
        self._apply(ratio)

    def _apply(self, ratio: float) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"the CPU's share of misses must be within 0..1, not {ratio}")
        self.ratio = ratio
        self.quota.copy_(
            torch.tensor([int(ratio * m + 0.5) for m in range(self.quota.numel())], dtype=torch.int32)
        )

    def post(
        self, li: int, ids: torch.Tensor, w: torch.Tensor, x: torch.Tensor, tables: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer li of a decode step of T rows: ids, w [T, k], the experts' float32 input x [T, D] (device). Returns
        the claim int32 [T * k] (1: the CPU computes that pair's expert; the GPU neither copies it nor weighs it)
        and the weights [T, k] with the CPU's pairs zeroed; None where the CPU holds none of this layer's experts
        or T is over `max_rows`. `tables`: the layer's, with experts the prefetch staged in VRAM (hits here)."""
        r = self.rows.get(li)
        t = ids.shape[0]
        if r is None or t > self.max_rows:
            return None
        self.check()
        le = self.cache.layers[li]
        assert le.tables is not None and le.host_tables is not None
        p = ids.numel()
        claim, wg = self.claim[r, :p], self.wg[r, :p]
        if self._recorded is not None and torch.cuda.is_current_stream_capturing():
            self._recorded.append(r)
        tab = le.tables[0] if tables is None else tables[0]
        ho.post(ids, w.float().contiguous(), x.contiguous(), self.cpu_of[r], tab, le.host_tables[0],
                self.quota, claim, wg, self.cnt[r : r + 1], self.taken, self.box[r], self.layout)  # fmt: skip
        return claim, wg.view(t, -1)

    def collect(self, li: int, out: torch.Tensor) -> torch.Tensor:
        """out [T, D] float32 (device) with the CPU's share of layer li added, once the CPU has answered. Run
        eagerly, the host answers this layer's request here; in a graph capture, `serve_posts` does after each
        replay."""
        r = self.rows[li]
        eager = self.cache.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
        if eager:
            if self._fast is not None:
                self._serve_fast([r])
            else:
                self._serve_when_posted(r)
        ho.collect(out, self.claim[r, : out.shape[0] * self.k], self.cnt[r : r + 1], self.box[r], self.layout)
        if eager:
            self.check()
        return out

    @contextmanager
    def recording(self) -> Iterator[list[int]]:
        """The mailboxes the posts of a graph capture inside this block write to, in order."""
        self._recorded = []
        try:
            yield self._recorded
        finally:
            self._recorded = None

    def serve_posts(self, posts: Sequence[int]) -> None:
        """After a captured step is replayed: answer its requests (`posts`, recorded at its capture), in order."""
        if not posts:
            return
        if self._fast is not None:
            self._serve_fast(posts)
        else:
            for r in posts:
                self._serve_when_posted(r)
        self.check()

    def _serve_fast(self, posts: Sequence[int]) -> None:
        """Answer `posts` in order through the step server (no GIL while it polls and computes)."""
        fast, arr = self._fast, np.asarray(posts, dtype=np.int64)
        assert fast is not None
        st = fast.state
        pairs0, cycles0 = int(st[ST_PAIRS]), int(st[ST_CYCLES])
        seen, since, i = time.perf_counter(), time.monotonic(), 0
        while i < arr.size:
            st[ST_AT] = i  # the post a failure leaves unanswered (the kernel loop moves it on)
            try:
                i = fast.serve(self._box, self._done, arr, i)
            except BaseException as e:
                # a kernel raised: its request is answered with zeros (the device must not wait), check() raises it
                at = int(st[ST_AT])
                self.error = e
                self._answer_zeros(int(arr[at]))
                i = at + 1
                continue
            if st[ST_BAD]:
                r = int(st[ST_BAD_ROW])
                t = min(max(int(self._box[r, ho.HDR_ROWS]), 1), self.max_rows)
                try:
                    ids, tok, _ = box_pairs(self._box[r], self._boxf[r], self._at, t * self.k, self.k)
                    check_pairs(int(st[ST_BAD]), ids, tok, self.layers[self._layer_of[r]].n_experts, t)
                except ValueError as e:
                    self.error = e
                st[ST_BAD] = 0
            if i < arr.size and time.monotonic() - since > _IDLE_S:
                raise self._not_posted(int(arr[i]))
        first = next(iter(self.rows.values()), -1)  # the first held layer's row (drop may change it)
        if arr[0] == first:
            self._tune(seen, int(self._box[first, ho.HDR_ROWS]))
        self.served[0] += arr.size
        self.served[1] += int(st[ST_PAIRS]) - pairs0
        self.served[2] += (int(st[ST_CYCLES]) - cycles0) / fast.hz

    def _not_posted(self, r: int) -> RuntimeError:
        return RuntimeError(f"the GPU did not post layer {self._layer_of[r]}'s experts for the CPU within "
                            f"{_IDLE_S:.0f} s")  # fmt: skip

    def _answer_zeros(self, r: int) -> None:
        """Answer mailbox row r's request with zero sums, once the device has posted it (its kernel failed, or the
        call failed before it: the device must not wait)."""
        row, since = self._box[r], time.monotonic()
        while row[ho.HDR_REQ] == self._done[r]:
            if time.monotonic() - since > _IDLE_S:
                raise self._not_posted(r)
        seq = int(row[ho.HDR_REQ])
        self._y[r][:] = 0.0
        row[self.answer] = seq
        self._done[r] = seq

    def drop(self, li: int) -> None:
        """Layer li's experts compute what the CPU's kernels do not (biases, a family's own activation): its
        misses all stay with the GPU, and no step posts or waits for it."""
        if self.layers.pop(li, None) is not None:
            self.rows.pop(li)
            log.info("layer %d's experts are not plain gated experts: the GPU computes all its misses", li)

    @property
    def slots(self) -> int:
        """(token, slot) pairs the CPU was given so far."""
        return int(self.taken.item())

    def check(self) -> None:
        err, self.error = self.error, None
        if err is not None:
            raise RuntimeError(f"computing experts on the CPU failed ({err!r}); they were left out of the step: "
                               "run without --cpu-experts") from err  # fmt: skip
        late = self._box[:, ho.HDR_WAIT] < 0
        if late.any():
            # start the next step in step: requests the host never answered are dropped, not answered late
            self._box[late, ho.HDR_WAIT] = 0
            self._done[:] = self._box[:, ho.HDR_REQ]
            raise RuntimeError("the GPU waited too long for the CPU's experts (the host did not answer); that "
                               "step's output is wrong: run without --cpu-experts if it happens again")  # fmt: skip

    def _serve_when_posted(self, r: int) -> None:
        """Poll mailbox r until the device raises its request number, then answer it."""
        req = self._box[:, ho.HDR_REQ]
        spins, since = 0, time.monotonic()
        while req[r] == self._done[r]:
            spins += 1
            if spins & 1023 == 0 and time.monotonic() - since > _IDLE_S:
                raise self._not_posted(r)
        first = r == next(iter(self.rows.values()))
        seen = time.perf_counter() if first else 0.0
        self._serve(r)
        if first:
            self._tune(seen, int(self._box[r, ho.HDR_ROWS]))

    def _tune(self, seen: float, rows: int) -> None:
        """A step of `rows` rows reached the first held layer at `seen`: the time since the last one is a decode
        step's (or a pause, which the tuner ignores), where that step had as many rows (steps of other sizes take
        other times); the tuner's share goes to the device for the steps that follow."""
        last, self._seen = self._seen, seen
        same, self._rows_seen = rows == self._rows_seen, rows
        if self.tuner is None or not last or not same:
            return
        before = self.tuner.ratio
        ratio = self.tuner.observe(seen - last)
        if ratio != self.ratio:
            self._apply(ratio)
        if self.tuner.ratio != before:
            log.info("the CPU now takes %.0f%% of a decode step's misses (median step %.2f ms; %.0f%% before)",
                     100 * self.tuner.ratio, 1e3 * self.tuner.best_median, 100 * before)  # fmt: skip

    def _serve(self, r: int) -> None:
        row, k = self._box[r], self.k
        seq = int(row[ho.HDR_REQ])
        t = min(max(int(row[ho.HDR_ROWS]), 1), self.max_rows)
        y = self._y[r][:t]
        t0 = time.perf_counter()
        try:  # one kernel call reads the request out of the mailbox and writes the sums into it
            self.layers[self._layer_of[r]].serve_box(
                row, self._boxf[r], self._at, t * k, k, self._x[r][:t], y
            )
        except BaseException as e:  # answered with zeros; check() raises it after the step
            self.error = e
            y[:] = 0.0
        row[self.answer] = seq  # last: the device reads the sum once it sees this number
        self._done[r] = seq
        took, n = time.perf_counter() - t0, int(row[ho.HDR_TAKE])
        self.served[0] += 1
        self.served[1] += n
        self.served[2] += took

    def timing(self) -> dict[str, float]:
        """What the host computed so far, and how long the device waited for it at the last step's layers."""
        n, experts, secs = self.served
        wait = self._box[:, ho.HDR_WAIT]
        return {
            "requests": n,
            "experts": experts,
            "us_per_expert": 1e6 * secs / experts if experts else 0.0,
            "us_per_request": 1e6 * secs / n if n else 0.0,
            "last_step_device_polls_per_layer": float(wait[wait >= 0].mean()) if wait.size else 0.0,
            "quota": self.quota.tolist(),
            "ratio": self.ratio,
            "tuned": self.tuner is not None,
            "tuner_decisions": [list(d) for d in self.tuner.decisions] if self.tuner else [],
        }
