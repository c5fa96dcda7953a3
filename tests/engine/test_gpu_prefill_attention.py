"""The flash prompt kernel on CUDA (engine/kernels/prefill_attention.py): against float64 attention at the shapes of
Qwen3-30B-A3B deep into a cache (bf16 and int8 KV, with and without a window), and a model's prompt read through it
against the same model with torch's attention."""

from pathlib import Path

import pytest
import torch

from engine.layers.attention import causal_mask

pytestmark = pytest.mark.gpu


def _ref(q, keys, values, pos, span, window, scale, softcap=0.0, sinks=None) -> torch.Tensor:
    """float64 attention with grouped heads repeated: [T, H, Dv]."""
    h, hkv = q.shape[1], keys.shape[1]
    k = keys[:span].double().repeat_interleave(h // hkv, dim=1)
    v = values[:span].double().repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~causal_mask(pos, span, window)[None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(h, 1, 1).expand(h, s.shape[1], 1)], -1)
    p = torch.softmax(s, -1)[..., :span]
    return torch.einsum("hts,shd->thd", p, v)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize(
    ("t", "start", "window", "kv", "softcap", "sinks"),
    [(1000, 3000, 0, "bf16", 0.0, False), (512, 0, 0, "bf16", 0.0, False), (700, 2500, 1024, "bf16", 0.0, False),
     (1000, 3000, 0, "int8", 0.0, False), (300, 800, 128, "bf16", 50.0, True), (13, 4000, 0, "bf16", 0.0, False),
     (1000, 3000, 0, "q4_0", 0.0, False), (300, 800, 128, "q4_0", 0.0, False)],
)  # fmt: skip
def test_against_float64(t: int, start: int, window: int, kv: str, softcap: float, sinks: bool) -> None:
    from engine.kernels.prefill_attention import prefill_attention
    from engine.layers.kv_cache import KVCache, dequant4

    h, hkv, d, dev = 32, 4, 128, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(t + start)
    span = start + t
    cache = KVCache(range(1), span + 64, hkv, d, d, kv, dev)
    old = torch.arange(start, device=dev)
    cache.write(0, old, *(torch.randn(start, hkv, d, device=dev, generator=g) for _ in range(2)), start)
    q = torch.randn(t, h, d, device=dev, generator=g).bfloat16()
    k, v = (torch.randn(t, hkv, d, device=dev, generator=g).bfloat16() for _ in range(2))
    pos = torch.arange(start, span, device=dev)
    lk = cache.write(0, pos, k, v, span)
    sk = torch.randn(h, device=dev, generator=g) if sinks else None
    got = prefill_attention(q, lk.k, lk.v, pos, span, window, d**-0.5, softcap, lk.k_scale, lk.v_scale, sk)
    keys, values = (lk.k.float(), lk.v.float())
    if kv == "int8":
        keys, values = keys * lk.k_scale.float(), values * lk.v_scale.float()  # type: ignore[union-attr]
    if kv == "q4_0":  # the values the kernel reads: dequantized in bf16, as the compute dtype
        keys, values = (
            dequant4(c, sc, torch.bfloat16).float() for c, sc in ((lk.k, lk.k_scale), (lk.v, lk.v_scale))
        )
    ref = _ref(q, keys, values, pos, span, window, d**-0.5, softcap, sk)
    assert _cos(got, ref) >= 0.9999
    assert (got.double() - ref).abs().max().item() < 0.03


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_model_prompt_equals_torch_attention(tmp_path: Path, arch: str) -> None:
    """A model's prompt in chunks (f32: the kernel's IEEE products), and int8 and q4_0 KV in bf16: logits with the
    kernel against torch's attention (gemma3: sliding layers whose window the chunks cross)."""
    from engine.pipeline.loader import load_model
    from engine.testing.tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, seed=4)
    ids = torch.randint(0, 200, (300,), generator=torch.Generator().manual_seed(1))
    for dtype, kv, tol in (("f32", "f32", 0.999999), ("bf16", "int8", 0.9995), ("bf16", "q4_0", 0.9995)):
        lm = load_model(path, device="cuda", dtype=dtype, cuda_graphs=False)
        m = lm.model
        assert m.prefill_kernel is not None
        outs = []
        for kernel in (m.prefill_kernel, None):
            m.prefill_kernel = kernel
            cache = m.new_cache(320, kv)
            logits = [m.forward(ids[s : s + 100], cache, s).float().cpu() for s in range(0, 300, 100)]
            outs.append(torch.cat(logits))
        assert _cos(outs[0], outs[1]) >= tol, (dtype, kv)
