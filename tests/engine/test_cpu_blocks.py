"""CPU matrix products straight from GGUF blocks (engine.kernels.cpu_blocks) against gguf's own dequantizer and
float64 products, for every block type they read; and the CPU layers using them with 8-bit activations (the
suite's default is --activations float, which keeps the exact path: tests/conftest.py)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from engine.gguf.random_blocks import random_blocks
from engine.kernels import cpu_blocks
from engine.layers.qtensor import QTensor
from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(not cpu_blocks.available()[0], reason=cpu_blocks.available()[1])
KINDS = sorted(cpu_blocks.KINDS, key=int)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


# 640: 20 blocks of 32 (the 32-value types' rows in groups of eight, and four left over)
SHAPES = [(q, k) for q in sorted(KINDS) for k in (512, 640) if k % GGML_QUANT_SIZES[q][0] == 0]


@pytest.mark.parametrize(("qtype", "k"), SHAPES, ids=lambda v: v.name if isinstance(v, QT) else str(v))
def test_each_block_type_unpacks_as_gguf_and_multiplies_within_int8_rounding(qtype: QT, k: int) -> None:
    n_out = 37  # rows not a multiple of the rows per task
    raw = random_blocks(qtype, n_out, k, seed=int(qtype))
    ref = quants.dequantize(raw, qtype).reshape(n_out, k).astype(np.float64)
    got = cpu_blocks.dequantize(torch.from_numpy(raw), qtype, n_out, k).numpy()
    assert np.array_equal(got, ref.astype(np.float32))  # the same values, bit for bit
    # the bfloat16 tiles of prompt chunks: those values rounded to nearest even, as torch rounds them
    b16 = cpu_blocks.dequantize(torch.from_numpy(raw), qtype, n_out, k, bf16=True)
    assert b16.dtype == torch.bfloat16 and torch.equal(b16, torch.from_numpy(got).to(torch.bfloat16))
    rng = np.random.default_rng(int(qtype))
    for rows in (1, 3, 8):  # 8: two passes of four inputs at once (rows32)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x[:, :32] *= 20  # an outlier block: each 32 has its own scale
        y = cpu_blocks.matmul(torch.from_numpy(raw), qtype, n_out, k, torch.from_numpy(x)).numpy()
        want = x.astype(np.float64) @ ref.T
        for r in range(rows):
            assert _cos(y[r], want[r]) >= 0.999, (qtype.name, rows, r)
        assert np.abs(y - want).max() <= 0.05 * np.abs(want).max()
        # each row alone (a decode step: the task's rows in one call) = in a step of several, bit for bit
        for r in range(rows if rows > 1 else 0):
            one = cpu_blocks.matmul(torch.from_numpy(raw), qtype, n_out, k, torch.from_numpy(x[r : r + 1]))
            assert np.array_equal(one.numpy()[0], y[r]), (qtype.name, rows, r)


def test_a_zero_input_gives_zeros_and_types_outside_the_kernels_are_not_claimed() -> None:
    raw = torch.from_numpy(random_blocks(QT.Q4_K, 16, 256, seed=1))
    assert cpu_blocks.matmul(raw, QT.Q4_K, 16, 256, torch.zeros(2, 256)).abs().max() == 0
    assert not cpu_blocks.supports(QT.TQ1_0, 256) and not cpu_blocks.supports(QT.F16, 256)
    assert not cpu_blocks.supports(QT.Q4_K, 320)  # not a whole number of blocks


@pytest.mark.parametrize(("rows", "bf16"), [(1, False), (5, False), (40, False), (40, True)])
def test_cpu_linear_reads_blocks_with_int8_activations_and_keeps_no_float_copy(
    rows: int, bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = torch.from_numpy(random_blocks(QT.Q6_K, 300, 512, seed=2))
    w = QTensor(raw, QT.Q6_K, (300, 512))
    x = torch.randn(rows, 512)
    want = x.double() @ torch.from_numpy(quants.dequantize(raw.numpy(), QT.Q6_K)).reshape(300, 512).double().T
    monkeypatch.setenv("STRATA_ACTIVATIONS", "int8")
    monkeypatch.setattr(cpu_blocks, "bf16_gemm", lambda: bf16)
    y = w.linear(x)
    assert w.dense is None and w.in_blocks_on_cpu() and y.shape == (rows, 300) and y.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(y.double().flatten(), want.flatten(), dim=0)
    # up to 8 rows: 8-bit activations; a prompt chunk of more: tiles of the weight through a GEMM, float32 or
    # (where the cores multiply bfloat16 natively) bfloat16 tiles and inputs
    assert cos >= (0.999 if rows <= 8 else 0.9999 if bf16 else 0.999999)
    monkeypatch.setenv("STRATA_ACTIVATIONS", "float")
    assert not w.in_blocks_on_cpu()


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_several_weights_in_one_call_give_each_ones_own_products_to_the_bit(rows: int) -> None:
    """q, k and v (other block types, other heights) and gate and up (two weights) multiplied in one call
    (cpu_blocks.matmul_many, one parallel region, the input quantized once): each output is that weight's own
    matmul, bit for bit, and linear_many gives each weight's linear; other input widths or more rows are not
    taken in one call."""
    from engine.layers.qtensor import linear_many

    def weight(qt: QT, n: int, k: int, seed: int) -> QTensor:
        return QTensor(torch.from_numpy(random_blocks(qt, n, k, seed=seed)), qt, (n, k))

    x = torch.randn(rows, 512)
    qkv = [weight(QT.Q5_0, 512, 512, 1), weight(QT.Q4_K, 64, 512, 2), weight(QT.Q8_0, 64, 512, 3)]
    gate_up = [weight(QT.Q6_K, 640, 512, 4), weight(QT.Q6_K, 640, 512, 5)]
    for group in (qkv, gate_up):
        ws = [w.cpu_weight() for w in group]
        assert cpu_blocks.in_one_call(ws, rows)
        for got, w in zip(cpu_blocks.matmul_many(ws, x), ws, strict=True):
            assert torch.equal(got, w.matmul(x))
        for got, w in zip(linear_many(group, x), group, strict=True):
            assert torch.equal(got, w.linear(x))
    odd = [weight(QT.Q5_0, 64, 512, 6), weight(QT.Q5_0, 64, 256, 7)]  # other input widths: each its own call
    assert not cpu_blocks.in_one_call([w.cpu_weight() for w in odd], rows)
    assert not cpu_blocks.in_one_call([w.cpu_weight() for w in qkv], 9)  # a prompt chunk: float tiles


def test_a_tiny_model_on_the_cpu_keeps_its_greedy_tokens_with_int8_activations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", qtype="Q4_K", seed=4)
    tokens = torch.tensor([1, 17, 42, 99, 150, 7])

    def logits() -> tuple[torch.Tensor, object]:
        lm = load_model(path, device="cpu", dtype="f32")
        cache = lm.model.new_cache(32, "f32")
        return lm.model.forward(tokens, cache, 0), lm.model

    exact, _ = logits()
    monkeypatch.setenv("STRATA_ACTIVATIONS", "int8")
    rounded, m = logits()
    cos = torch.nn.functional.cosine_similarity(rounded.flatten(), exact.flatten(), dim=0)
    assert cos >= 0.999
    weights = [v for lw in m.layers.values() for v in vars(lw).values() if isinstance(v, QTensor)]  # type: ignore[attr-defined]
    assert weights and all(q.dense is None for q in weights)  # nothing kept as floats


# Q2_K onwards: the types unpacked a row at a time into codes (cpu_blocks.UNPACKED)
@pytest.mark.parametrize(
    "qtype",
    [QT.Q8_0, QT.IQ4_XS, QT.Q5_K, QT.MXFP4, QT.Q2_K, QT.Q3_K, QT.IQ2_XXS, QT.IQ3_S, QT.IQ1_M],
    ids=lambda q: q.name,
)
def test_routed_experts_of_other_block_types_are_computed_in_place(qtype: QT) -> None:
    """The CPU's experts (a CPU model's, or a card's misses) of types beyond Q4_K/Q6_K: SiLU-gated mix from the
    blocks where they lie, against float64 products of gguf's dequantized weights."""
    from engine.experts.cpu_experts import CpuExperts

    e, f, d = 6, 512, 256
    gate, up = (random_blocks(qtype, e * f, d, seed=s).reshape(e, f, -1) for s in (1, 2))
    down = random_blocks(qtype, e * d, f, seed=3).reshape(e, d, -1)
    qs = [
        QTensor(torch.from_numpy(a), qtype, shape)
        for a, shape in ((gate, (e, f, d)), (up, (e, f, d)), (down, (e, d, f)))
    ]
    kernels = CpuExperts.in_place_kernels(*qs, "silu")
    assert isinstance(kernels, cpu_blocks.BlockExperts)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(d).astype(np.float32)
    ids, w = np.array([4, 1, 3]), np.array([0.5, 0.3, 0.2], np.float32)
    out = np.empty(d, np.float32)
    kernels.mix(ids, w, x, out)
    deq = [quants.dequantize(a.reshape(-1, a.shape[-1]), qtype).reshape(e, -1, k).astype(np.float64)
           for a, k in ((gate, d), (up, d), (down, f))]  # fmt: skip
    want = np.zeros(d)
    for j, ex in enumerate(ids):
        g, u = deq[0][ex] @ x, deq[1][ex] @ x
        want += w[j] * (deq[2][ex] @ (g / (1 + np.exp(-g)) * u))
    assert _cos(out.astype(np.float64), want) >= 0.999
    with pytest.raises(ValueError, match="out of range"):
        kernels.mix(np.array([6]), np.ones(1, np.float32), x, out)
    # a step of several rows (the CPU's share of a batched step): each row as its own call, to the bit
    xs = np.stack([x, rng.standard_normal(d).astype(np.float32)])
    pairs = (
        np.array([4, 1, 3, 1, 5]),
        np.array([0, 0, 0, 1, 1]),
        np.array([0.5, 0.3, 0.2, 0.6, 0.4], np.float32),
    )
    rows = np.empty((2, d), np.float32)
    kernels.mix_rows(*pairs, xs, rows)
    for t in range(2):
        alone = np.empty(d, np.float32)
        sel = pairs[1] == t
        kernels.mix(pairs[0][sel], pairs[2][sel], xs[t], alone)
        assert np.array_equal(rows[t], alone)
