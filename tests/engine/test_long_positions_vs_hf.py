"""Positions past 8K against HF transformers (float32, the same weights): the RoPE tables and the attention at a
depth of 8,448 tokens, for a RoPE base of 10^6 (Qwen3), linear scaling (Llama, factor 4), YaRN (Qwen3, factor 4 over
a 4K original context, llama.cpp's defaults) and Gemma 3's sliding window (8 tokens in the tiny model) crossed a
thousand times over; two layers each. The last 256 positions' logits must match as the first ones do."""

from pathlib import Path

import pytest
import torch

from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model
from tests.engine.hf_reference import hf_logits, hf_model

LONG = 8448
TAIL = 256
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("qwen3", {}),
        ("llama", {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
        (
            "qwen3",
            {
                "rope.scaling.type": "yarn",
                "rope.scaling.factor": 4.0,
                "rope.scaling.original_context_length": 4096,
            },
        ),
        ("gemma3", {}),
    ],
    ids=["qwen3-base-1e6", "llama-linear-x4", "qwen3-yarn-x4", "gemma3-sliding"],
)
@torch.inference_mode()
def test_logits_past_8k_positions_match_transformers(tmp_path: Path, arch: str, extra: dict) -> None:
    path = write_tiny_model(
        tmp_path / "m.gguf",
        arch,
        "F32",
        seed=5,
        context=16384,
        n_layer=2,
        extra=extra,
    )
    ids = torch.randint(3, 500, (LONG,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf_model(path), ids)[-TAIL:]
    lm = load_model(path, device="cpu", dtype="f32")
    cache = lm.model.new_cache(LONG + 8, "f32")
    ours = lm.model.forward(torch.tensor(ids), cache, 0)[-TAIL:].float()
    cos = torch.nn.functional.cosine_similarity(ours.flatten(), ref.flatten(), dim=0).item()
    assert cos >= 0.9999, cos
    assert (ours - ref).abs().max().item() <= 2e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
