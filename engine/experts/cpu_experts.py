"""One MoE layer's routed experts computed on the CPU: the expert cache's misses, beside the GPU's PCIe copies.

Where gate and up are Q4_K and down Q4_K or Q6_K (Qwen3 MoE Q4_K_M files) with a SiLU gate and the CPU has AVX2, the
experts are computed straight from the host store's blocks by engine/experts/cpu_q4k.py: no copy, 1.4-2.3x faster
(bench/results/cpu-q4k-kernel-2.json). Otherwise:

4-bit block types (Q4_K, Q4_0, Q4_1) are repacked once into the operand of torch's group-wise 4-bit CPU kernel
(`_weight_int4pack_mm_for_cpu`, groups of 32, bf16 activations and scales): per 32 weights a scale and a zero with
element = (code - 8) * scale + zero. It reads 0.625 bytes a weight (Q4_K: 0.5625), against 2 for a bf16 matmul, and a token's
expert matrix-vector product is bound by memory reads. Other block types are dequantized once to bf16 matrices.
Gate and up of an expert are one [2F, D] matrix: one kernel call for both.

Made for decode (a token's few missed experts): the 4-bit kernel's time grows about linearly with the rows it is
given beyond ~4 (it decodes the weights per row), so prompt chunks are better served by the GPU."""

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from engine.experts import cpu_q4k
from engine.gguf.quants import q4_0_parts, q4_1_parts, q4_k_parts
from engine.kernels import cpu_blocks
from engine.layers.moe import ACTIVATIONS
from engine.layers.qtensor import QTensor

GROUP = 32  # the kernel's group: one scale and one zero per 32 weights of a row
_PACK_ROWS = 16  # the packer wants the output rows (N) in multiples of 16
_BATCH_ROWS = 64  # the packer's output for a row depends on nothing outside its block of 64 rows (tested)
_BATCH = 8  # experts repacked together: ~100 MB of int32 codes for Qwen3-30B-A3B's gate and up
INT4_TYPES = frozenset({QT.Q4_0, QT.Q4_1, QT.Q4_K})
# Added in torch 2.6 (the project allows older): without it every block type takes the bf16 path.
_HAS_INT4 = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
    torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
)


def int4_parts(raw: torch.Tensor, qtype: QT, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit block rows uint8 [n, row_bytes] of a matrix [n, k] -> (codes int32 [n, k] 0..15, scales and zeros
    float32 [k / 32, n, 2]) with element = (code - 8) * scale + zero, the form of the 4-bit CPU kernel."""
    if qtype == QT.Q4_K:
        q, scale, offset = q4_k_parts(raw.reshape(-1, 144))  # [n*k/256, 8, 32], [n*k/256, 8] twice
        codes = q.reshape(n, k)
        scale, zero = scale.reshape(n, k // GROUP), (8 * scale - offset).reshape(n, k // GROUP)
    elif qtype == QT.Q4_0:  # d * (q - 8)
        q, d = q4_0_parts(raw.reshape(-1, 18))  # [n*k/32, 32], [n*k/32, 1]
        codes = q.reshape(n, k)
        scale = d.reshape(n, k // GROUP)
        zero = torch.zeros_like(scale)
    elif qtype == QT.Q4_1:  # d * q + m = d * (q - 8) + (8 * d + m)
        q, d, m = q4_1_parts(raw.reshape(-1, 20))  # [n*k/32, 32], [n*k/32, 1] twice
        codes = q.reshape(n, k)
        scale, zero = d.reshape(n, k // GROUP), (8 * d + m).reshape(n, k // GROUP)
    else:
        raise ValueError(
            f"int4_parts takes {', '.join(t.name for t in sorted(INT4_TYPES))}, not {qtype.name}"
        )
    sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()  # [k/32, n, 2]
    return codes.int(), sz


def _int4pack(codes: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), sz.to(dtype)


def q4k_int4pack(raw: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K rows uint8 [n, k / 256 * 144] -> (the 4-bit kernel's packed weight, its scales and zeros
    [k / 32, n, 2] in dtype): the kernel computes (code - 8) * scale + zero, so zero = 8 * scale - offset."""
    return _int4pack(*int4_parts(raw, QT.Q4_K, n, k), dtype)


def _int4_fits(qtypes: Iterable[QT], n: int, k: int) -> bool:
    return _HAS_INT4 and all(t in INT4_TYPES for t in qtypes) and n % _PACK_ROWS == 0 and k % GROUP == 0


class _Proj:
    """One expert's matrix [N, K] (or gate and up stacked) as its matmul reads it: int4 codes with bf16 scales and
    zeros, or a bf16 matrix."""

    __slots__ = ("dense", "packed", "sz")

    def __init__(self, parts: list[tuple[torch.Tensor, QT]], k: int, int4: bool) -> None:
        """parts: (raw rows uint8 [n_i, row_bytes], block type), stacked along the rows into N = sum n_i."""
        self.packed: torch.Tensor | None = None
        self.sz: torch.Tensor | None = None
        self.dense: torch.Tensor | None = None
        if int4:
            split = [int4_parts(raw, qt, raw.shape[0], k) for raw, qt in parts]
            codes = torch.cat([c for c, _ in split])  # [N, k]
            sz = torch.cat([s for _, s in split], dim=1)  # [k/32, N, 2]
            self.packed, self.sz = _int4pack(codes, sz, torch.bfloat16)
        else:
            mats = [QTensor(raw, qt, (raw.shape[0], k)).dequant(torch.bfloat16) for raw, qt in parts]
            self.dense = torch.cat(mats) if len(mats) > 1 else mats[0]  # [N, k]

    @classmethod
    def many(cls, experts: list[list[tuple[torch.Tensor, QT]]], k: int, int4: bool) -> list["_Proj"]:
        """One _Proj an expert, its parts as in __init__. Where every part has one 4-bit block type and row counts
        the packer keeps apart (multiples of _BATCH_ROWS), a batch of experts is repacked by one call of each step
        (several times faster than one expert at a time) and cut into the experts' rows afterwards."""
        qts = {qt for parts in experts for _, qt in parts}
        rows = {raw.shape[0] for parts in experts for raw, _ in parts}
        if not int4 or len(qts) != 1 or any(r % _BATCH_ROWS for r in rows):
            return [cls(parts, k, int4) for parts in experts]
        qt = qts.pop()
        out: list[_Proj] = []
        for at in range(0, len(experts), _BATCH):
            batch = experts[at : at + _BATCH]
            raw = torch.cat(
                [r for parts in batch for r, _ in parts]
            )  # experts one after another, parts stacked
            codes, sz = int4_parts(raw, qt, raw.shape[0], k)
            packed, sz = _int4pack(codes, sz, torch.bfloat16)
            start = 0
            for parts in batch:
                n = sum(r.shape[0] for r, _ in parts)
                p = cls.__new__(cls)
                p.dense = None
                p.packed = packed[
                    start : start + n
                ]  # row slices of the packed weight are the rows' own packing
                p.sz = sz[:, start : start + n].contiguous()
                out.append(p)
                start += n
        return out

    @property
    def nbytes(self) -> int:
        ts = (self.packed, self.sz) if self.dense is None else (self.dense,)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x bf16 [n, K], contiguous -> bf16 [n, N]"""
        if self.dense is not None:
            return F.linear(x, self.dense)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.sz)


class CpuExperts:
    """One MoE layer's routed experts (a chosen subset) held for computing on the CPU."""

    def __init__(
        self, gate: QTensor, up: QTensor, down: QTensor, experts: Iterable[int], act: str = "silu"
    ) -> None:
        """gate, up: [E, F, D]; down: [E, D, F]; their `raw` uint8 CPU [E, rows, row_bytes] (pinned or a view of a
        mapped file: only read). The held experts are repacked (or dequantized) once, here."""
        if len(gate.shape) != 3 or up.shape != gate.shape:
            raise ValueError(f"expert gate and up must both be [E, F, D], got {gate.shape} and {up.shape}")
        n_exp, f, d = gate.shape
        if down.shape != (n_exp, d, f):
            raise ValueError(f"expert down must be [E, D, F] = {(n_exp, d, f)} beside gate {gate.shape}, "
                             f"got {down.shape}")  # fmt: skip
        for name, t in (("gate", gate), ("up", up), ("down", down)):
            if t.raw.device.type != "cpu":
                raise ValueError(
                    f"CpuExperts reads expert blocks in host memory; {name} is on {t.raw.device}"
                )
        if act not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {act!r}; expected one of {', '.join(ACTIVATIONS)}")
        held = sorted(set(int(e) for e in experts))
        bad = [e for e in held if not 0 <= e < n_exp]
        if bad:
            raise ValueError(f"expert ids {bad} out of range: this layer has experts 0..{n_exp - 1}")
        self.n_experts, self.d, self.f = n_exp, d, f
        self._act = ACTIVATIONS[act]
        self._held = frozenset(held)
        self.q4k = self.in_place_kernels(gate, up, down, act)
        if self.q4k is not None:  # computed in place from the store's blocks: nothing to repack
            self.kernels = ("q4k", "q4k") if self._q4k(gate, up, down) else ("blocks", "blocks")
            self._gate_up, self._down = {}, {}
            return
        gu_int4 = _int4_fits((gate.qtype, up.qtype), 2 * f, d)
        down_int4 = _int4_fits((down.qtype,), d, f)
        self.kernels: tuple[str, str] = ("int4" if gu_int4 else "bf16", "int4" if down_int4 else "bf16")
        gu = _Proj.many([[(gate.raw[e], gate.qtype), (up.raw[e], up.qtype)] for e in held], d, gu_int4)
        dn = _Proj.many([[(down.raw[e], down.qtype)] for e in held], f, down_int4)
        self._gate_up = dict(zip(held, gu, strict=True))
        self._down = dict(zip(held, dn, strict=True))

    @staticmethod
    def _q4k(gate: QTensor, up: QTensor, down: QTensor) -> bool:
        return gate.qtype == up.qtype == QT.Q4_K and down.qtype in (QT.Q4_K, QT.Q6_K)

    @classmethod
    def in_place(cls, gate: QTensor, up: QTensor, down: QTensor, act: str, unpacked: bool = False) -> bool:
        """Whether these experts are computed from their blocks in place (no copy): Q4_K with Q4_K/Q6_K down by
        engine/experts/cpu_q4k.py, the other block types the CPU reads in place by engine/kernels/cpu_blocks.py,
        and with `unpacked` Q2_K, Q3_K and the IQ1-IQ3 grids too, each weight row unpacked into codes by the same
        kernel call. Those take ~10x an in-place type's time for one token's experts
        (`bench/results/cpu-mix-unpacked.json`: Q2_K 12.6 ms, IQ3_S 9.7, against Q8_0 1.2 on 2 cores), so a card's
        CPU share takes them only when `--cpu-experts F` asks for it; a CPU model's experts take them always (its
        other path unpacks as much)."""
        _, f, d = gate.shape
        kinds = cpu_blocks.KINDS if unpacked else cpu_blocks.IN_PLACE
        generic = all(
            q.qtype in kinds and cpu_blocks.supports(q.qtype, k) for q, k in ((gate, d), (up, d), (down, f))
        )
        return (
            act == "silu"
            and (cls._q4k(gate, up, down) or generic)
            and gate.raw[0].numel() == up.raw[0].numel()
            and all(t.raw.is_contiguous() for t in (gate, up, down))
            and cpu_q4k.available()[0]
        )

    @classmethod
    def in_place_kernels(
        cls, gate: QTensor, up: QTensor, down: QTensor, act: str, unpacked: bool = True
    ) -> cpu_q4k.Q4KExperts | cpu_blocks.BlockExperts | None:
        """The kernels that compute these experts from their blocks where they lie, or None where `in_place`
        says they cannot."""
        if not cls.in_place(gate, up, down, act, unpacked):
            return None
        n, f, d = gate.shape
        g, u, dn = (q.raw.reshape(n, q.shape[1], -1).numpy() for q in (gate, up, down))  # views: contiguous
        if cls._q4k(gate, up, down):
            return cpu_q4k.Q4KExperts(g, u, dn, d, f, down_q6k=down.qtype == QT.Q6_K)
        return cpu_blocks.BlockExperts(g, u, dn, (gate.qtype, up.qtype, down.qtype), d, f)

    def holds(self, e: int) -> bool:
        return e in self._held

    @property
    def n_held(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        """Host bytes of the repacked copies (none where the blocks are computed in place)."""
        return sum(p.nbytes for p in self._gate_up.values()) + sum(p.nbytes for p in self._down.values())

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x bf16 [n, D] -> bf16 [n, D]: down(act(gate x) * up x). The activation runs on the kernel's bf16
        output: in float32 it cost ~8% more time an expert at one token (two more small ops) for ~1e-3 less error."""
        if self.q4k is not None:
            return torch.stack([self._mix_row([e], [1.0], r) for r in x.float()]).to(torch.bfloat16)
        g, u = self._gate_up[e](x).split(self.f, dim=1)  # [n, F] twice
        return self._down[e](self._act(g) * u)  # [n, D]

    def mix(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
        """x [T, D] float32, ids [T, k] int64, w [T, k] float32 routing weights, take [T, k] bool: the (token, slot)
        pairs computed here -> float32 [T, D]: per token the sum over its taken slots of w * expert(x); zero rows
        where nothing is taken."""
        t = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.d:
            raise ValueError(f"x must be [T, {self.d}], got {tuple(x.shape)}")
        if ids.dim() != 2 or ids.shape[0] != t or w.shape != ids.shape or take.shape != ids.shape:
            raise ValueError(f"ids, w and take must all be [T={t}, k], got {tuple(ids.shape)}, "
                             f"{tuple(w.shape)} and {tuple(take.shape)}")  # fmt: skip
        out = torch.zeros(t, self.d, dtype=torch.float32)  # [T, D]
        tok, slot = take.nonzero(as_tuple=True)  # [P] each
        if tok.numel() == 0:
            return out
        eid = ids[tok, slot]  # [P]
        wsel = w[tok, slot].float()  # [P]
        if t == 1:  # decode: one expert call a taken slot
            experts, counts = eid.tolist(), None
        else:  # group the pairs by expert: one matmul per expert over all its tokens
            eid, order = torch.sort(eid, stable=True)
            tok, wsel = tok[order], wsel[order]
            uniq, cnt = torch.unique_consecutive(eid, return_counts=True)
            experts, counts = uniq.tolist(), cnt.tolist()
        missing = [e for e in experts if e not in self._held]
        if missing:
            raise ValueError(f"expert {missing[0]} is not held by this CpuExperts (it holds "
                             f"{len(self._held)} of {self.n_experts}); compute it elsewhere")  # fmt: skip
        if self.q4k is not None:  # one kernel call for every taken pair, each expert's blocks read once
            self.mix_rows(eid.numpy(), tok.numpy(), wsel.numpy(), x.float().contiguous().numpy(), out.numpy())
            return out
        xb = x.to(torch.bfloat16).contiguous()  # [T, D]: the kernel wants contiguous bf16 rows
        if counts is None:
            for e, we in zip(experts, wsel.tolist(), strict=True):
                out.add_(self.expert(e, xb), alpha=we)  # accumulated in float32
            return out
        start = 0
        for e, n in zip(experts, counts, strict=True):
            te = tok[start : start + n]  # [n]
            y = self.expert(e, xb.index_select(0, te))  # [n, D]
            out.index_add_(0, te, y.float() * wsel[start : start + n, None])
            start += n
        return out

    def _mix_row(self, ids: list[int], w: list[float], x: torch.Tensor) -> torch.Tensor:
        """One token, torch in and out: x float32 [D] -> float32 [D], sum of w * expert(x)."""
        out = np.zeros(self.d, dtype=np.float32)
        self.mix_into(
            np.asarray(ids, dtype=np.int64), np.asarray(w, dtype=np.float32), x.contiguous().numpy(), out
        )
        return torch.from_numpy(out)

    def mix_rows(
        self, ids: np.ndarray, tok: np.ndarray, w: np.ndarray, x: np.ndarray, out: np.ndarray
    ) -> None:
        """A step's rows, numpy in and out (the decode hand-off's mailbox): (expert, token) pairs ids, tok int [n]
        of held experts with weights w float32 [n], x float32 [T, D] -> out float32 [T, D] (written): each token's
        weighted sum of its pairs' experts. In place, an expert's blocks are read once for all its tokens."""
        if self.q4k is not None:
            self.q4k.mix_rows(ids, tok, w, x, out)
            return
        tok = np.asarray(tok)
        for t in range(x.shape[0]):
            sel = np.flatnonzero(tok == t)
            self.mix_into(np.asarray(ids)[sel], np.asarray(w, dtype=np.float32)[sel], x[t], out[t])

    def serve_box(self, box: np.ndarray, boxf: np.ndarray, at: tuple[int, int, int], n: int, k: int,
                  x: np.ndarray, out: np.ndarray) -> None:  # fmt: skip
        """A decode step's request in a mailbox row (engine/experts/cpu_misses.py): of its n (row, slot) pairs, k a
        row, those flagged taken, with their expert ids and weights at the offsets at = (ids, taken, weights) of the
        int32 row box and its float32 view boxf; x float32 [T, D] -> out [T, D] (written, zeros where nothing is
        taken). In place, the whole request is one kernel call."""
        if self.q4k is not None:
            self.q4k.serve_box(box, boxf, at, n, k, x, out)
            return
        ids, tok, w = cpu_blocks.box_pairs(box, boxf, at, n, k)
        if not ids.size:
            out[:] = 0.0
            return
        self.mix_rows(ids, tok, w, x, out)

    def mix_into(self, ids: np.ndarray, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        """One token, numpy in and out (the decode hand-off's mailbox): ids int [n] held experts, w float32 [n],
        x float32 [D] -> out float32 [D] = sum of w * expert(x), written in place."""
        if self.q4k is not None:
            self.q4k.mix(ids, w, x, out)
            return
        xb = torch.from_numpy(x).view(1, -1).to(torch.bfloat16)
        y = torch.from_numpy(out).view(1, -1)
        y.zero_()
        for e, we in zip(ids.tolist(), w.tolist(), strict=True):
            y.add_(self.expert(int(e), xb), alpha=float(we))  # float32 sum
