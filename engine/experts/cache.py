"""The per-card expert cache: routed experts in pinned host RAM once (block format), the most-used ones also in
VRAM slots, and a device-side table per layer that gives each expert's address, VRAM slot or pinned host memory.

The MoE kernels read whichever address the table holds, so a miss costs a PCIe read inside the same kernel: no
host synchronisation in the decode step, and the step can be captured in a CUDA graph. Swaps copy an expert into a
slot on a side stream and then rewrite its table entry; a step never waits for them."""

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine import kernels
from engine.layers.moe import ExpertWeights
from engine.layers.pinned import plan_slabs, views
from engine.layers.qtensor import QTensor

if TYPE_CHECKING:
    from engine.experts.cpu_misses import CpuMisses
    from engine.experts.prefetch import Prefetch
    from engine.kernels.expert_lru import DeviceLru
    from engine.kernels.stage_copy import Stager

log = logging.getLogger("strata.engine")
GiB = 1 << 30
MAX_STEP_ROWS = 16  # token rows a decode step's fused launches take (engine/models/fast_decode.py)


class ExpertCacheError(ValueError):
    pass


@dataclass
class _Proj:
    """One projection (gate, up or down) of one layer's experts."""

    host: QTensor  # [E, rows, row_bytes] in pinned host memory (or the CPU tensor it was read from)
    slots: torch.Tensor  # uint8 [C, rows, row_bytes] on the device
    table: torch.Tensor  # int64 [E] on the device: address of each expert's first row

    @property
    def expert_bytes(self) -> int:
        return self.host.raw[0].numel()

    def host_addr(self, e: int) -> int:
        return self.host.raw[e].data_ptr()

    def slot_addr(self, c: int) -> int:
        return self.slots[c].data_ptr()


@dataclass
class LayerExperts:
    router: QTensor
    gate: _Proj
    up: _Proj
    down: _Proj
    n_expert: int
    slot_of: list[int]  # expert -> slot, -1 when only in host RAM
    expert_in: list[int]  # slot -> expert
    resident: torch.Tensor  # bool [E] on the device
    side_stream: "torch.cuda.Stream | None" = None
    tables: torch.Tensor | None = None  # int64 [3, E]: the projections' tables (theirs are views of it)
    host_tables: torch.Tensor | None = (
        None  # int64 [3, E]: every expert's host address (layers not all in VRAM)
    )
    nbytes: torch.Tensor | None = None  # int64 [3]: bytes of one expert per projection
    # Hits and misses are derived from the model's selection counts (no extra kernels in a step): the counts
    # since the last residency change split by the residency then, plus what earlier periods added up to.
    counts_base: torch.Tensor | None = None
    hits_before: int = 0
    misses_before: int = 0
    swaps: int = 0
    bytes_moved: int = 0
    lru: "DeviceLru | None" = None  # --expert-policy lru/lfu: residency kept on the card, decode steps admit

    @property
    def projections(self) -> tuple[_Proj, _Proj, _Proj]:
        return self.gate, self.up, self.down

    @property
    def capacity(self) -> int:
        return len(self.expert_in)

    def expert(self, e: int, device: torch.device) -> ExpertWeights:
        """Expert e's weights on the device for a prompt chunk: its slot, or a copy streamed from host RAM."""
        c = self.slot_of[e]
        if device.type == "cuda":  # a swap into this slot may still be in flight on the side stream
            torch.cuda.current_stream(device).wait_stream(self.side_stream)
        parts = []
        for p in self.projections:
            raw = p.slots[c] if c >= 0 else p.host.raw[e].to(device, non_blocking=True)
            parts.append(QTensor(raw, p.host.qtype, p.host.shape[1:]))
        return ExpertWeights(self.router, *parts)


@dataclass
class CacheStats:
    experts_in_vram: int
    experts_total: int
    vram_bytes: int
    hits: int
    misses: int
    swaps: int
    bytes_moved: int
    per_layer: dict[int, int] = field(default_factory=dict)
    cpu_computed: int = 0  # missed (token, expert) pairs the CPU computed (--cpu-experts)
    # the CPU's share of a decode step's misses now (tuned or --cpu-ratio); None: the CPU takes none
    cpu_share: float | None = None


def _pin_one(raw: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of raw, or raw itself where pinning fails (RAM short: its misses are staged through
    copies; said)."""
    try:
        out = torch.empty(raw.shape, dtype=raw.dtype, pin_memory=True)
    except RuntimeError as e:
        log.warning("could not pin %.1f MiB of host RAM for experts (%s): misses are staged through copies",
                    raw.numel() * raw.element_size() / 2**20, e)  # fmt: skip
        return raw
    out.copy_(raw)
    return out


def pin_all(raws: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Page-locked host copies of `raws` (views into slabs, plan_slabs), in order. Where a slab cannot be pinned
    (RAM short) the rest are pinned one by one (_pin_one)."""
    out: list[torch.Tensor] = []
    i = 0
    for size, offsets in plan_slabs([r.numel() * r.element_size() for r in raws]):
        try:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            return out + [_pin_one(r) for r in raws[i:]]
        mine = raws[i : i + len(offsets)]
        for view, r in zip(views(buf, offsets, [(tuple(r.shape), r.dtype) for r in mine]), mine, strict=True):
            view.copy_(r)
            out.append(view)
        i += len(offsets)
    return out


class ExpertCache:
    """The experts of one stage's MoE layers on one CUDA device."""

    def __init__(
        self,
        experts: Mapping[int, ExpertWeights],
        device: torch.device,
        capacity: Mapping[int, int],
        profile: torch.Tensor | None = None,
        device_label: str = "",
        miss_path: str = "copy",
        eviction: str = "profile",
        lfu_decay: float = 0.9,
        max_selections: int = 64,
        stage_slots: int = 8,
    ) -> None:
        """stage_slots: the distinct missed experts a decode step stages in VRAM (`--expert-misses copy`; the rest
        are read in place)."""
        self.device = device
        self.miss_path = (
            miss_path  # "direct": kernels read missed experts from host memory; "copy": staged first
        )
        self.stager: Stager | None = None
        self.cpu_misses: CpuMisses | None = None  # --cpu-experts: the CPU's share of decode misses
        self.prefetch: Prefetch | None = None  # --expert-prefetch: next layers' misses staged early
        self.prompt_area: list[torch.Tensor] | None = None  # prompt chunks' staged experts, per projection
        self._held: int | None = None  # the layer whose staged experts the next prompt chunks share
        self._held_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.layers: dict[int, LayerExperts] = {}
        # the ids a step's expert kernels read per-selection tables with (the first T * k, viewed [T, k])
        self.identity = torch.arange(max_selections, dtype=torch.int64, device=device)
        self.counts: torch.Tensor | None = None
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        # the host store of every layer that keeps experts out of VRAM, pinned together (pin_all)
        out = [ew for li, ew in experts.items() if capacity.get(li, ew.gate.shape[0]) < ew.gate.shape[0]]
        pinned = iter(pin_all([q.raw for ew in out for q in (ew.gate, ew.up, ew.down)]))
        for li, ew in experts.items():
            n_e = ew.gate.shape[0]
            cap = min(capacity.get(li, n_e), n_e)
            order = list(range(n_e))
            if profile is not None:
                order.sort(key=lambda e: -float(profile[li, e]))
            projs = []
            full = cap == n_e
            if full:  # every expert in VRAM, in expert order: no pinned copy is needed
                order = list(range(n_e))
            tables = torch.empty(3, n_e, dtype=torch.int64, device=device)
            for j, q in enumerate((ew.gate, ew.up, ew.down)):
                if full:
                    host, slots = q, q.raw.to(device)
                else:
                    host = QTensor(next(pinned), q.qtype, q.shape)
                    slots = torch.empty((cap, *q.raw.shape[1:]), dtype=torch.uint8, device=device)
                projs.append(_Proj(host, slots, tables[j]))
            slot_of = [-1] * n_e
            expert_in = order[:cap]
            for c, e in enumerate(expert_in):
                slot_of[e] = c
                if not full:
                    for p in projs:
                        p.slots[c].copy_(p.host.raw[e], non_blocking=True)
            le = LayerExperts(
                router=ew.router.to(device),
                gate=projs[0],
                up=projs[1],
                down=projs[2],
                n_expert=n_e,
                slot_of=slot_of,
                expert_in=expert_in,
                resident=torch.zeros(n_e, dtype=torch.bool, device=device),
                side_stream=self.side,
                tables=tables,
            )
            if not full:
                le.host_tables = torch.tensor(
                    [[p.host_addr(e) for e in range(n_e)] for p in projs], dtype=torch.int64, device=device
                )
                le.nbytes = torch.tensor([p.expert_bytes for p in projs], dtype=torch.int64, device=device)
            self._write_tables(le)
            if eviction != "profile" and 0 < cap < n_e and device.type == "cuda":
                assert le.host_tables is not None and le.nbytes is not None
                le.lru = kernels.expert_lru.DeviceLru(
                    device, slot_of, expert_in, tables, le.host_tables, [p.slots.data_ptr() for p in projs],
                    le.nbytes, eviction, lfu_decay, max_selections,
                )  # fmt: skip
            self.layers[li] = le
        self.n_expert = max((le.n_expert for le in self.layers.values()), default=0)
        self.stage_slots = stage_slots
        self.stage_stride = max(
            (p.expert_bytes for le in self.layers.values() for p in le.projections), default=0
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        st = self.stats()
        if self.layers:
            lo, hi = min(self.layers), max(self.layers)
            log.info(
                "layers %d to %d on %s: %d of %d routed experts in VRAM (%.1f GiB)",
                lo,
                hi,
                device_label or str(device),
                st.experts_in_vram,
                st.experts_total,
                st.vram_bytes / GiB,
            )

    def _write_tables(self, le: LayerExperts) -> None:
        for p in le.projections:
            addrs = [p.slot_addr(c) if c >= 0 else p.host_addr(e) for e, c in enumerate(le.slot_of)]
            p.table.copy_(torch.tensor(addrs, dtype=torch.int64))
        le.resident.copy_(torch.tensor([c >= 0 for c in le.slot_of]))

    def staged_tables(
        self,
        li: int,
        ids: torch.Tensor,
        claim: torch.Tensor | None = None,
        tables: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a decode step of layer li that has experts in host memory: with `--expert-policy lru/lfu`, admit
        its misses into the layer's slots; else, with `--expert-misses copy`, stage the step's missed experts in
        VRAM, each once however many rows chose it. -> (tables [3, S], the ids [T, k] to read them with: per
        selection with the identity, or per expert with the step's ids); None where the kernels read the cache's
        own tables. `claim` [T * k]: selections the CPU computes (neither copied nor admitted). `tables`: the
        layer's tables with experts the prefetch staged in VRAM (engine/experts/prefetch.py), instead of its own."""
        le = self.layers[li]
        if le.lru is not None and ids.numel() <= self.identity.numel():
            return le.lru.admit(ids, claim), self.identity[: ids.numel()].view(ids.shape)
        if self.miss_path != "copy" or le.host_tables is None or ids.shape[0] > MAX_STEP_ROWS:
            return None
        if self.stager is None:  # made once, at the most experts a step stages: graphs keep its addresses
            self.stager = kernels.stage_copy.Stager(
                self.device, self.stage_slots, self.stage_stride, self.n_expert
            )
        assert le.tables is not None and le.nbytes is not None
        tabs = le.tables if tables is None else tables
        return self.stager.stage(ids, tabs, le.host_tables, le.nbytes, claim), ids

    def prompt_tables(self, li: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gate, up and down tables a prompt chunk's grouped kernels read for layer li. Where the layer has
        experts in host memory, they are first streamed into a VRAM staging area with bulk copies (a chunk of a
        few dozen tokens touches nearly every expert, and the kernels' own small loads across PCIe ran a 4,096-token
        prompt at a third of the speed); the staging area's room is kept out of the slots' budget
        (policy.stage_bytes)."""
        le = self.layers[li]
        if le.host_tables is None:
            return le.gate.table, le.up.table, le.down.table
        if self._held == li and self._held_tables is not None:
            return self._held_tables
        self._held_tables = None  # another layer's experts take the staging area
        if le.lru is not None:  # decode steps moved experts on the card: read where they are now
            le.slot_of, le.expert_in = le.lru.slot_of.tolist(), le.lru.expert_in.tolist()
        missing = [e for e, c in enumerate(le.slot_of) if c < 0]
        if self.device.type == "cuda":  # a swap into a slot may still be in flight on the side stream
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        if self.prompt_area is None or self.prompt_area[0].shape[0] < len(missing):
            most = self._area_rows()
            self.prompt_area = None  # the old area goes before the new one is allocated
            self.prompt_area = [
                torch.empty((most, *p.host.raw.shape[1:]), dtype=torch.uint8, device=self.device)
                for p in le.projections
            ]
        out = []
        for p, area in zip(le.projections, self.prompt_area, strict=True):
            addrs = [p.slot_addr(c) if c >= 0 else 0 for c in le.slot_of]
            i = 0
            while i < len(missing):  # runs of consecutive experts go in one copy
                j = i
                while j + 1 < len(missing) and missing[j + 1] == missing[j] + 1:
                    j += 1
                a, b = missing[i], missing[j] + 1
                area[i : i + b - a].copy_(p.host.raw[a:b], non_blocking=True)
                for n, e in enumerate(range(a, b)):
                    addrs[e] = area[i + n].data_ptr()
                i = j + 1
            tab = torch.tensor(addrs, dtype=torch.int64)
            # from pinned memory: a pageable copy would wait for the stream first
            if self.device.type == "cuda":
                tab = tab.pin_memory()
            out.append(tab.to(self.device, non_blocking=True))
        le.bytes_moved += len(missing) * sum(p.expert_bytes for p in le.projections)
        if self._held == li:
            self._held_tables = (out[0], out[1], out[2])
        return out[0], out[1], out[2]

    @contextmanager
    def hold_prompt_layer(self, li: int) -> Iterator[None]:
        """Within this block the prompt chunks of layer li share one staging of its host-RAM experts: a prompt read
        layer by layer (FamilyLM.forward_span) streams each layer's experts over PCIe once, not once a chunk."""
        self._held, self._held_tables = li, None
        try:
            yield
        finally:
            self._held = self._held_tables = None

    @property
    def pending_bytes(self) -> int:
        """VRAM the prompt chunks' staging area will take at the first prompt and does not take yet (the room
        policy.stage_bytes kept out of the slots' budget): whoever sizes a chunk from the VRAM free counts it."""
        if self.prompt_area is not None or not self.streams_prompts:
            return 0
        per = max(sum(p.expert_bytes for p in le.projections) for le in self.layers.values())
        return self._area_rows() * per

    def _area_rows(self) -> int:
        """Experts the staging area holds: the most any layer keeps in host RAM."""
        return max(sum(c < 0 for c in le.slot_of) for le in self.layers.values())

    @property
    def streams_prompts(self) -> bool:
        """Whether prompt chunks stream experts from host RAM (some layer keeps experts out of VRAM)."""
        return any(le.host_tables is not None for le in self.layers.values())

    def attach_counts(self, counts: torch.Tensor) -> None:
        """The model's selection counts [n_layer, E]; hits and misses are read from them."""
        self.counts = counts
        for li, le in self.layers.items():
            le.counts_base = counts[li].clone()

    def _split(self, li: int) -> tuple[int, int]:
        """(hits, misses) of layer li since the start."""
        return self._splits([li])[li]

    def _splits(self, lis: list[int]) -> dict[int, tuple[int, int]]:
        """(hits, misses) since the start of each of `lis`, read back in one copy (a server reads these while steps
        are queued)."""
        live = [li for li in lis if self.counts is not None and self.layers[li].counts_base is not None]
        out = {
            li: (self.layers[li].hits_before, self.layers[li].misses_before) for li in lis if li not in live
        }
        if live:
            assert self.counts is not None
            delta = self.counts[live] - torch.stack([self.layers[li].counts_base for li in live])  # type: ignore[misc]
            resident = torch.stack([self.layers[li].resident for li in live])
            both = torch.stack([(delta * resident).sum(1), delta.sum(1)], 1).tolist()
            for li, (hits, total) in zip(live, both, strict=True):
                le = self.layers[li]
                out[li] = (le.hits_before + int(hits), le.misses_before + int(total) - int(hits))
        return out

    def _lru_stats(self) -> dict[int, list[int]]:
        """(hits, misses, admissions) of each layer whose decode steps admit on the card (counted by the admitting
        launch), read in one copy."""
        lru = [li for li, le in self.layers.items() if le.lru is not None]
        if not lru:
            return {}
        rows = torch.stack([self.layers[li].lru.stats for li in lru]).tolist()  # type: ignore[union-attr]
        return dict(zip(lru, rows, strict=True))

    def _fold(self, li: int) -> None:
        """Close the current period of layer li before its residency changes."""
        le = self.layers[li]
        le.hits_before, le.misses_before = self._split(li)
        if self.counts is not None:
            le.counts_base = self.counts[li].clone()

    def stats(self) -> CacheStats:
        in_vram = sum(le.capacity for le in self.layers.values())
        total = sum(le.n_expert for le in self.layers.values())
        vram = sum(le.capacity * sum(p.expert_bytes for p in le.projections) for le in self.layers.values())
        lru = self._lru_stats()
        counted = self._splits([li for li in self.layers if li not in lru])
        split = [(lru[li][0], lru[li][1]) if li in lru else counted[li] for li in self.layers]
        hits = sum(h for h, _ in split)
        misses = sum(m for _, m in split)
        admitted = {li: s[2] for li, s in lru.items()}
        return CacheStats(
            experts_in_vram=in_vram,
            experts_total=total,
            vram_bytes=vram,
            hits=hits,
            misses=misses,
            swaps=sum(le.swaps for le in self.layers.values()) + sum(admitted.values()),
            bytes_moved=sum(le.bytes_moved for le in self.layers.values())
            + sum(n * sum(p.expert_bytes for p in self.layers[li].projections) for li, n in admitted.items()),
            per_layer={li: le.capacity for li, le in self.layers.items()},
            cpu_computed=self.cpu_misses.slots if self.cpu_misses is not None else 0,
            cpu_share=self.cpu_misses.ratio if self.cpu_misses is not None else None,
        )

    def adapt(self, counts: torch.Tensor, max_swaps: int = 8) -> int:
        """Promote hot experts that miss over the coldest resident ones of the same layer, on the side stream.
        `counts` [n_layer, E] are the usage counts (host copy). Returns the number of swaps started."""
        done = 0
        for li, le in self.layers.items():
            if le.capacity in (0, le.n_expert) or le.lru is not None:  # lru/lfu: the card decides
                continue
            heat = counts[li]
            cold_slot = min(range(le.capacity), key=lambda c: float(heat[le.expert_in[c]]))
            hot = max((e for e in range(le.n_expert) if le.slot_of[e] < 0), key=lambda e: float(heat[e]))
            if float(heat[hot]) <= float(heat[le.expert_in[cold_slot]]):
                continue
            self._fold(li)
            self._swap(le, cold_slot, hot)
            done += 1
            if done >= max_swaps:
                break
        return done

    def _swap(self, le: LayerExperts, slot: int, new: int) -> None:
        old = le.expert_in[slot]
        main = torch.cuda.current_stream(self.device)
        assert self.side is not None
        # On the main stream: the old expert reads from host memory from the next step on. The side stream waits
        # for the steps already queued (they may still read the slot), copies, then points the table at the slot.
        for p in le.projections:
            p.table[old] = p.host_addr(old)
        le.resident[old] = False
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            for p in le.projections:
                p.slots[slot].copy_(p.host.raw[new], non_blocking=True)
                p.table[new] = p.slot_addr(slot)
                le.bytes_moved += p.expert_bytes
            le.resident[new] = True
        le.slot_of[old] = -1
        le.slot_of[new] = slot
        le.expert_in[slot] = new
        le.swaps += 1
