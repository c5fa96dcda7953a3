"""The hand-off of a hidden state [T, D] from one stage's device to the next's.

- `host`: through pinned host memory - a copy out on the source card, a copy in on the next; no NVLink or peer
  access needed, the path every pair of cards has. Also what `--split-device 0` runs, so two stages on one card
  check this path bit for bit.
- `peer`: a direct copy between two cards that allow peer access (torch orders it against both cards' streams).
- `direct`: the tensor itself (both stages on the CPU).

A small ring of pinned slots lets a stage hand chunk c+1 off while the next stage still copies chunk c in; a slot
is reused only after the copy that read it has finished on the receiving card.
"""

from __future__ import annotations

from typing import Literal

import torch

from engine.pipeline.stage_clock import HopMarks, Mark

HandoffMode = Literal["auto", "host", "peer", "direct"]
HANDOFF_MODES = ("auto", "host", "peer", "direct")


class HandoffError(ValueError):
    pass


def resolve_mode(src: torch.device, dst: torch.device, mode: HandoffMode = "auto") -> str:
    """The path used between two devices: `auto` takes peer access where two different cards allow it and pinned
    host memory otherwise (also between two stages on one card, so that the path a real split uses is the one
    checked)."""
    if mode not in HANDOFF_MODES:
        raise HandoffError(f"hand-off mode {mode!r} is not one of {', '.join(HANDOFF_MODES)}")
    if src.type == "cpu" and dst.type == "cpu":
        return "direct"
    if mode == "direct":
        if src != dst:
            raise HandoffError(f"a direct hand-off needs both stages on one device, not {src} and {dst}")
        return "direct"
    if mode == "peer":
        if src.type != "cuda" or dst.type != "cuda":
            raise HandoffError(f"a peer hand-off needs two CUDA devices, not {src} and {dst}")
        if src != dst and not torch.cuda.can_device_access_peer(src.index or 0, dst.index or 0):
            raise HandoffError(f"{src} cannot access {dst} directly (no peer access): use the host hand-off")
        return "peer"
    if mode == "auto" and src.type == "cuda" and dst.type == "cuda" and src != dst:
        if torch.cuda.can_device_access_peer(src.index or 0, dst.index or 0):
            return "peer"
    return "host"


class _Slot:
    __slots__ = ("buf", "read_done", "written")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.read_done: torch.cuda.Event | None = None  # on the receiving card, after it copied the slot in
        self.written: torch.cuda.Event | None = None  # on the sending card, after it copied the slot out


class Handoff:
    """Moves hidden states from `src` to `dst`; `send` returns the tensor on `dst`, ordered on its current stream.

    Between cards nothing waits on the host: the receiving card's stream waits for the copy out (a CUDA event),
    and the sending card's stream waits for the copy in before it overwrites a slot."""

    def __init__(
        self, src: torch.device, dst: torch.device, mode: HandoffMode = "auto", slots: int = 4
    ) -> None:
        self.src, self.dst = src, dst
        self.mode = resolve_mode(src, dst, mode)
        self._pin = torch.cuda.is_available() and (src.type == "cuda" or dst.type == "cuda")
        self._ring = [_Slot() for _ in range(max(2, slots))]
        self._next = 0
        self.bytes = 0  # moved so far (telemetry)

    def _buffer(self, slot: _Slot, like: torch.Tensor) -> torch.Tensor:
        n = like.numel()
        if slot.buf is None or slot.buf.numel() < n or slot.buf.dtype != like.dtype:
            if slot.read_done is not None:
                slot.read_done.synchronize()  # the old buffer is freed below: nothing may still read it
            slot.buf = torch.empty(max(n, 1), dtype=like.dtype, pin_memory=self._pin)
            slot.read_done = None
        return slot.buf[:n].view(like.shape)

    def send(self, h: torch.Tensor, marks: HopMarks | None = None) -> torch.Tensor:
        """h [T, D] on src -> the same values [T, D] on dst. `marks` (optional) gets the copies' begin and end on
        each device's timeline (stage_clock); recording them adds no wait."""
        self.bytes += h.numel() * h.element_size()
        if self.mode == "direct":
            return h
        if self.mode == "peer":
            if marks is None:
                return h.to(self.dst)
            # torch copies between cards on the source card's stream and orders the destination's after it.
            marks.out_begin = Mark(self.src)
            out = h.to(self.dst)
            marks.out_end = Mark(self.src)
            return out
        slot = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        buf = self._buffer(slot, h)
        if h.device.type == "cuda":
            src_stream = torch.cuda.current_stream(h.device)
            if slot.read_done is not None:
                src_stream.wait_event(slot.read_done)  # the last copy in from this slot has finished
            if marks is not None:
                marks.out_begin = Mark(self.src)
            buf.copy_(h, non_blocking=True)  # [T, D] -> pinned host
            written = torch.cuda.Event(enable_timing=marks is not None)
            written.record(src_stream)
        else:
            if slot.read_done is not None:
                slot.read_done.synchronize()
            if marks is not None:
                marks.out_begin = Mark(self.src)
            buf.copy_(h)
            written = None
        if marks is not None:
            marks.out_end = Mark(self.src, written)
        if self.dst.type == "cpu":
            if written is not None:
                written.synchronize()
            if marks is not None:
                marks.in_begin = Mark(self.dst)
            out = buf.clone()  # the slot is reused; the CPU stage gets its own tensor
            if marks is not None:
                marks.in_end = Mark(self.dst)
            return out
        dst_stream = torch.cuda.current_stream(self.dst)
        if written is not None:
            dst_stream.wait_event(written)
        if marks is not None:
            marks.in_begin = Mark(self.dst)  # completes once the copy out has: the copy in starts here
        out = buf.to(self.dst, non_blocking=True)  # pinned host -> [T, D] on the next card
        done = torch.cuda.Event(enable_timing=marks is not None)
        done.record(dst_stream)
        if marks is not None:
            marks.in_end = Mark(self.dst, done)
        slot.read_done = done
        return out
