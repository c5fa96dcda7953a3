"""The real Gemma 3 270M (Q4_K_M): logits against transformers on the same dequantized weights, and greedy
completions whose content is right."""

from pathlib import Path

import pytest
import torch

from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

# Prompt -> text the greedy continuation must contain (a base model: plain completions).
COMPLETIONS = {
    "The capital of France is the city of": "Paris",
    "Monday, Tuesday, Wednesday,": "Thursday",
    "def add(a, b):\n    return": "a + b",
}


@pytest.fixture(scope="module")
def gemma(gemma_path: Path):
    return load_model(gemma_path, device="cpu", dtype="f32")


def test_logits_match_transformers(gemma, gemma_path: Path) -> None:
    from tests.engine.hf_reference import hf_logits, hf_model

    ids = gemma.tokenizer.encode("The capital of France is", add_special=True, parse_special=False)
    cache = gemma.model.new_cache(32, "f32")
    ours = gemma.model.forward(torch.tensor(ids), cache, 0)
    ref = hf_logits(hf_model(gemma_path), ids)
    assert torch.nn.functional.cosine_similarity(ours.flatten(), ref.flatten(), dim=0).item() >= 0.9999
    assert (ours - ref).abs().max().item() <= 1e-3


@pytest.mark.parametrize("prompt", list(COMPLETIONS))
def test_greedy_completions_are_right(gemma, prompt: str) -> None:
    runner = Runner(gemma.model, gemma.tokenizer, 128, "f32")
    ids = gemma.tokenizer.encode(prompt, add_special=True, parse_special=False)
    done = [
        e
        for e in runner.generate(GenerationRequest(ids, max_tokens=5, sampling=GREEDY))
        if isinstance(e, DoneEvent)
    ]
    text = gemma.tokenizer.decode(done[0].tokens)
    assert COMPLETIONS[prompt] in text, text


def test_missing_chat_template_falls_back_to_chatml(gemma) -> None:
    assert gemma.chat.is_fallback
    text = gemma.chat.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
