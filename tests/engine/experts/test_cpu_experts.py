"""CpuExperts against gguf-py's dequantizer and the plain expert math in float64.

The 4-bit path (Q4_K, Q4_0, Q4_1) and the bf16 path (other block types) both round to bf16 (8 significant bits,
2^-9 relative a rounding): the activations, the scales and zeros or the dequantized weights, and the kernels'
outputs. Each product of D or F terms then lies within a few 2^-9 of its size, so the mixed output is checked to
1e-2 of its largest element and to a cosine of 0.999 per token; the repacking itself is checked exactly (float32)."""

import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

import engine.experts.cpu_experts as cpu_experts
from engine.experts.cpu_experts import CpuExperts, int4_parts
from engine.gguf.random_blocks import random_blocks
from engine.layers.qtensor import QTensor

E = 8


@pytest.fixture(autouse=True)
def _repacked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests cover the repacked copies; Q4_K read in place is tested in test_cpu_q4k.py."""
    monkeypatch.setattr(cpu_experts.cpu_q4k, "available", lambda: (False, "tested in test_cpu_q4k.py"))


def _experts(qtype: QT, rows: int, cols: int, seed: int) -> tuple[QTensor, np.ndarray]:
    """E experts' matrices [rows, cols] of random blocks -> (QTensor [E, rows, cols], gguf's float64 values)."""
    raw = np.stack([random_blocks(qtype, rows, cols, seed=seed * 100 + e) for e in range(E)])
    ref = gq.dequantize(raw, qtype).astype(np.float64).reshape(E, rows, cols)
    return QTensor(torch.from_numpy(raw), qtype, (E, rows, cols)), ref


def _act(a: np.ndarray, act: str) -> np.ndarray:
    if act == "silu":
        return a / (1.0 + np.exp(-a))
    return 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a**3)))  # gelu, tanh form


def _reference(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, take: torch.Tensor, g: np.ndarray, u: np.ndarray,
    dn: np.ndarray, act: str,
) -> np.ndarray:  # fmt: skip
    xs = x.double().numpy()
    out = np.zeros_like(xs)
    for t, s in take.nonzero().tolist():
        e = int(ids[t, s])
        h = _act(g[e] @ xs[t], act) * (u[e] @ xs[t])  # [F]
        out[t] += float(w[t, s]) * (dn[e] @ h)
    return out


def _routing(t: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)])  # [T, k]
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)  # [T, k]
    take = torch.rand(t, k, generator=gen) < 0.6  # [T, k]
    take[0, 0] = True
    if t > 1:
        take[1] = False  # a token with nothing taken here
    return ids, w, take


def _check(y: torch.Tensor, ref: np.ndarray, take: torch.Tensor) -> None:
    yd = y.double().numpy()
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert np.abs(yd - ref).max() <= 1e-2 * np.abs(ref).max()  # seen: 5.0e-3 to 6.3e-3
    for t in range(ref.shape[0]):
        if not take[t].any():
            assert not yd[t].any()  # nothing taken: an exact zero row
            continue
        cos = yd[t] @ ref[t] / (np.linalg.norm(yd[t]) * np.linalg.norm(ref[t]))
        assert cos >= 0.999


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q4_0, QT.Q4_1])
def test_int4_parts_rebuild_gguf_values(qtype: QT) -> None:
    n, k = 48, 512
    raw = random_blocks(qtype, n, k, seed=3)
    codes, sz = int4_parts(torch.from_numpy(raw), qtype, n, k)
    assert codes.shape == (n, k) and sz.shape == (k // 32, n, 2)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    scale, zero = (
        sz[..., 0].T.repeat_interleave(32, dim=1),
        sz[..., 1].T.repeat_interleave(32, dim=1),
    )  # [n, k]
    mine = ((codes - 8).double() * scale.double() + zero.double()).numpy()
    ref = gq.dequantize(raw, qtype).astype(np.float64).reshape(n, k)
    np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-6 * np.abs(ref).max())


CASES = [  # gate/up type, down type, activation, D, T, k, the kernels expected for (gate+up, down)
    (QT.Q4_K, QT.Q4_K, "silu", 512, 1, 4, ("int4", "int4")),
    (QT.Q4_K, QT.Q4_K, "silu", 256, 3, 3, ("int4", "int4")),
    (QT.Q4_0, QT.Q4_0, "gelu_tanh", 256, 3, 2, ("int4", "int4")),
    (QT.Q4_K, QT.Q6_K, "silu", 256, 3, 4, ("int4", "bf16")),  # the Q4_K_M layout: Q6_K down
    (QT.Q8_0, QT.Q8_0, "silu", 256, 3, 4, ("bf16", "bf16")),
]


@pytest.mark.parametrize(
    ("gt", "dt", "act", "d", "t", "k", "kernels"),
    CASES,
    ids=[f"{c[0].name}-{c[1].name}-T{c[4]}" for c in CASES],
)
def test_mix_matches_float64_reference(
    gt: QT, dt: QT, act: str, d: int, t: int, k: int, kernels: tuple[str, str]
) -> None:
    f = 256
    (g, gr), (u, ur), (dn, dr) = _experts(gt, f, d, 1), _experts(gt, f, d, 2), _experts(dt, d, f, 3)
    ce = CpuExperts(g, u, dn, range(E), act=act)
    assert ce.kernels == kernels
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(4))
    ids, w, take = _routing(t, k, seed=5)
    _check(ce.mix(x, ids, w, take), _reference(x, ids, w, take, gr, ur, dr, act), take)


def test_untaken_pairs_and_missing_experts() -> None:
    d, f = 256, 256
    (g, gr), (u, ur), (dn, dr) = (
        _experts(QT.Q4_K, f, d, 1),
        _experts(QT.Q4_K, f, d, 2),
        _experts(QT.Q4_K, d, f, 3),
    )
    before = [q.raw.clone() for q in (g, u, dn)]
    ce = CpuExperts(g, u, dn, [0, 2, 5, 2])
    assert [e for e in range(E) if ce.holds(e)] == [0, 2, 5]
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(6))
    ids = torch.tensor([[0, 3, 5], [7, 2, 1], [4, 6, 3]])  # [T, k]: 1, 3, 4, 6, 7 not held
    w = torch.tensor([[0.5, 9.0, 0.25], [9.0, 0.7, 9.0], [9.0, 9.0, 9.0]])
    take = torch.tensor([[True, False, True], [False, True, False], [False, False, False]])
    y = ce.mix(x, ids, w, take)  # the untaken slots name experts not held, with large weights: ignored
    _check(y, _reference(x, ids, w, take, gr, ur, dr, "silu"), take)
    take[2, 1] = True
    with pytest.raises(ValueError, match=r"expert 6 is not held"):
        ce.mix(x, ids, w, take)
    with pytest.raises(ValueError, match=r"expert 3 is not held"):
        ce.mix(x[:1], ids[:1], w[:1], torch.tensor([[True, True, False]]))
    assert not ce.mix(x, ids, w, torch.zeros(3, 3, dtype=torch.bool)).any()
    assert all(torch.equal(a, q.raw) for a, q in zip(before, (g, u, dn), strict=True))  # blocks only read


def test_nbytes_of_the_repacked_copies() -> None:
    d, f, held = 256, 256, [1, 4, 6]
    g, u, dn = _experts(QT.Q4_K, f, d, 1)[0], _experts(QT.Q4_K, f, d, 2)[0], _experts(QT.Q4_K, d, f, 3)[0]
    int4 = (
        2 * f * d // 2 + d // 32 * 2 * f * 2 * 2 + d * f // 2 + f // 32 * d * 2 * 2
    )  # codes, bf16 scales/zeros
    assert CpuExperts(g, u, dn, held).nbytes == len(held) * int4
    g8, u8, dn8 = _experts(QT.Q8_0, f, d, 1)[0], _experts(QT.Q8_0, f, d, 2)[0], _experts(QT.Q8_0, d, f, 3)[0]
    assert CpuExperts(g8, u8, dn8, held).nbytes == len(held) * 3 * f * d * 2  # bf16 matrices


def _layer(gate_up: QT, down: QT, f: int, d: int) -> tuple:
    """(QTensor, dequantized reference) for the gate, up and down of E experts."""
    return _experts(gate_up, f, d, 1), _experts(gate_up, f, d, 2), _experts(down, d, f, 3)


def test_bf16_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shapes the 4-bit packer refuses (2F = 40 rows, not a multiple of 16) and a torch without the kernel."""
    d, f, t, k = 256, 20, 3, 3
    (g, gr), (u, ur), (dn, dr) = _layer(QT.Q4_0, QT.F16, f, d)
    ce = CpuExperts(g, u, dn, range(E))
    assert ce.kernels == ("bf16", "bf16")
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(7))
    ids, w, take = _routing(t, k, seed=8)
    _check(ce.mix(x, ids, w, take), _reference(x, ids, w, take, gr, ur, dr, "silu"), take)

    monkeypatch.setattr(cpu_experts, "_HAS_INT4", False)
    f = 256
    (g, gr), (u, ur), (dn, dr) = _layer(QT.Q4_K, QT.Q4_K, f, d)
    ce = CpuExperts(g, u, dn, range(E))
    assert ce.kernels == ("bf16", "bf16")
    _check(ce.mix(x, ids, w, take), _reference(x, ids, w, take, gr, ur, dr, "silu"), take)


def test_bad_arguments() -> None:
    d, f = 512, 256
    g, u, dn = _experts(QT.Q4_0, f, d, 1)[0], _experts(QT.Q4_0, f, d, 2)[0], _experts(QT.Q4_0, d, f, 3)[0]
    with pytest.raises(ValueError, match="out of range"):
        CpuExperts(g, u, dn, [0, E])
    with pytest.raises(ValueError, match="activation"):
        CpuExperts(g, u, dn, [0], act="relu")
    with pytest.raises(ValueError, match=r"\[E, D, F\]"):
        CpuExperts(g, u, g, [0])
    ce = CpuExperts(g, u, dn, [0])
    with pytest.raises(ValueError, match=r"x must be \[T, 512\]"):
        ce.mix(
            torch.zeros(1, 128),
            torch.zeros(1, 2, dtype=torch.long),
            torch.ones(1, 2),
            torch.ones(1, 2).bool(),
        )


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q4_0])
def test_experts_repacked_in_batches_match_one_at_a_time(qtype: QT) -> None:
    """Experts are repacked several at a time and cut into rows afterwards (the packer keeps blocks of 64 rows
    apart): the result is the same bytes as repacking each expert alone."""
    f, d = 256, 256  # gate and up 2 x 256 rows, down 256 rows: multiples of 64
    g, _ = _experts(qtype, f, d, 1)
    u, _ = _experts(qtype, f, d, 2)
    dn, _ = _experts(qtype, d, f, 3)
    batched = CpuExperts(g, u, dn, range(E), "silu")
    if batched.kernels != ("int4", "int4"):
        pytest.skip("this torch has no 4-bit CPU kernel")
    for e in range(E):
        alone = cpu_experts._Proj([(g.raw[e], qtype), (u.raw[e], qtype)], d, True)
        got = batched._gate_up[e]
        assert got.packed is not None and alone.packed is not None
        assert torch.equal(got.packed, alone.packed) and torch.equal(got.sz, alone.sz)
        alone = cpu_experts._Proj([(dn.raw[e], qtype)], f, True)
        assert torch.equal(batched._down[e].packed, alone.packed) and torch.equal(
            batched._down[e].sz, alone.sz
        )
