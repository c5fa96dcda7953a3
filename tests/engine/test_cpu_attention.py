"""The CPU decode attention kernel (engine/kernels/cpu_attention.py) against float64 attention written out here, and
a row alone against the same row in a step of several."""

import math

import pytest
import torch

from engine.kernels import cpu_attention, cpu_blocks

pytestmark = pytest.mark.skipif(not cpu_blocks.available()[0], reason="no CPU kernels here")


def _reference(q, k, v, p, window, scale, softcap):  # type: ignore[no-untyped-def]
    """One row q [H, D] at position p over k, v [S, Hkv, D] in float64, head by head."""
    h, hkv = q.shape[0], k.shape[1]
    lo = max(0, p - window + 1) if window > 0 else 0
    out = torch.empty(h, v.shape[2], dtype=torch.float64)
    for head in range(h):
        kk = k[lo : p + 1, head // (h // hkv)].double()
        s = kk @ q[head].double() * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        w = torch.softmax(s, dim=0)
        out[head] = w @ v[lo : p + 1, head // (h // hkv)].double()
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "window", "softcap"),
    [(14, 2, 64, 0, 0.0), (4, 1, 256, 0, 0.0), (8, 4, 128, 16, 30.0), (8, 8, 64, 5, 0.0)],
)
def test_rows_match_float64_attention_and_each_row_alone(heads, kv_heads, dim, window, softcap) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(heads * dim + window)
    s = 80
    k = torch.randn(s, kv_heads, dim, generator=g)
    v = torch.randn(s, kv_heads, dim, generator=g)
    q = torch.randn(4, heads, dim, generator=g)
    pos = torch.tensor([3, 40, 41, 79])  # rows at different depths, the first inside any window
    scale = 1 / math.sqrt(dim)
    got = cpu_attention.attend(q, k, v, pos, window, scale, softcap)
    for t, p in enumerate(pos.tolist()):
        want = _reference(q[t], k, v, p, window, scale, softcap)
        assert torch.allclose(got[t].double(), want, atol=2e-5, rtol=1e-4), (t, (got[t] - want).abs().max())
        alone = cpu_attention.attend(
            q[t : t + 1], k[: p + 1], v[: p + 1], pos[t : t + 1], window, scale, softcap
        )
        assert torch.equal(alone[0], got[t])  # the same sums alone and in a step of several


def test_a_step_past_the_keys_given_is_refused_and_long_steps_go_to_torch() -> None:
    q, k = torch.randn(1, 4, 64), torch.randn(10, 1, 64)
    with pytest.raises(ValueError, match="position 10 attends past the 10 positions"):
        cpu_attention.attend(q, k, k, torch.tensor([10]), 0, 0.125)
    n = cpu_attention.MAX_MACS // (4 * 64)  # keys a row of 4 heads of 64 may take
    assert cpu_attention.takes(q, k, k, n) and not cpu_attention.takes(q, k, k, n + 1)
    assert not cpu_attention.takes(q.bfloat16(), k, k, 10)


def test_a_step_gives_each_row_its_one_token_steps_output_on_both_sides_of_the_kernels_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cached_attention: a verify window's rows, some within the kernel's bound and some past it, equal one-token
    steps at their positions, bit for bit (whether a row takes the kernel depends on its own position only)."""
    from engine.layers.attention import cached_attention
    from engine.layers.kv_cache import KVCache

    h, hkv, d = 4, 2, 64
    monkeypatch.setattr(cpu_attention, "MAX_MACS", h * 21 * d)  # rows over up to 21 keys take the kernel
    g = torch.Generator().manual_seed(7)
    k, v, q = (torch.randn(24, n, d, generator=g) for n in (hkv, hkv, h))
    window = KVCache(range(1), 32, hkv, d, d, "f32", torch.device("cpu"))
    cached_attention(window, 0, q[:18], k[:18], v[:18], torch.arange(18), 18, 0, 0.125)  # the prompt
    pos = torch.arange(18, 24)  # rows over 19..24 keys: the first three within the bound
    got = cached_attention(window, 0, q[18:], k[18:], v[18:], pos, 24, 0, 0.125)
    steps = KVCache(range(1), 32, hkv, d, d, "f32", torch.device("cpu"))
    cached_attention(steps, 0, q[:18], k[:18], v[:18], torch.arange(18), 18, 0, 0.125)
    for j, p in enumerate(pos.tolist()):
        one = cached_attention(
            steps, 0, q[p : p + 1], k[p : p + 1], v[p : p + 1], pos[j : j + 1], p + 1, 0, 0.125
        )
        assert torch.equal(one[0], got[j]), p
        want = _reference(q[p], k, v, p, 0, 0.125, 0.0)
        assert torch.allclose(got[j].double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3", "qwen3moe"])
def test_a_decode_steps_attention_in_one_call_gives_the_general_layers_logits(
    tmp_path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:  # type: ignore[no-untyped-def]
    """DecoderLM._cpu_attention (biases, QK norms, RoPE, the KV write and the attention in one kernel call) against
    the layer's torch operations: the same logits, to the bit, for one sequence's decode steps past gemma3's
    window and for a step of several sequences (a verify window's rows among them)."""
    from engine.models.decoder import DecoderLM
    from engine.models.family_base import BatchPart
    from engine.pipeline.loader import load_model
    from engine.testing.tiny_models import write_tiny_model

    m = load_model(
        write_tiny_model(tmp_path / "m.gguf", arch, qtype="Q8_0", seed=5), device="cpu", dtype="f32"
    ).model
    fused = DecoderLM._cpu_attention
    taken = []

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        got = fused(*a, **k)
        taken.append(got is not None)
        return got

    def run() -> list[torch.Tensor]:
        out = []
        cache = m.new_cache(64, "f32")
        m.forward(torch.arange(3, 9), cache, 0)
        tok = torch.tensor([7])
        for pos in range(6, 20):  # past gemma3's window of 8
            logits = m.forward(tok, cache, pos)
            out.append(logits)
            tok = logits[-1:].argmax(-1)
        caches = [m.new_cache(32, "f32") for _ in range(3)]
        for j, c in enumerate(caches):
            m.forward(torch.arange(4, 9 + j), c, 0)
        parts = [
            BatchPart(torch.tensor([11]), caches[0], 5),
            BatchPart(torch.tensor([12, 13, 14]), caches[1], 6, logits=3),
            BatchPart(torch.tensor([15]), caches[2], 7),
        ]
        out.append(m.forward_batch(parts))
        return out

    with torch.inference_mode():
        monkeypatch.setattr(DecoderLM, "_cpu_attention", lambda *a, **k: None)
        want = run()
        monkeypatch.setattr(DecoderLM, "_cpu_attention", counted)
        got = run()
    assert taken and all(taken)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
