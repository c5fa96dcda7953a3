"""--kv q4_0's check of a model's keys at load (engine/pipeline/kv_check.py)."""

import logging
from pathlib import Path

import pytest
import torch

from engine.pipeline.kv_check import Q4_KEY_LIMIT, check_q4_keys, q4_key_errors
from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("kvcheck") / "qwen2.gguf", "qwen2")


def _outlier(lm, layer: int, size: float) -> None:
    """A key bias channel far larger than the rest in every key head of `layer`, where RoPE hardly turns it (the
    last of a head's first half: the lowest frequency), as Qwen2.5's keys have."""
    lw, c = lm.model.layers[layer], lm.config
    bias = lw.k_bias.clone()
    for h in range(c.n_head_kv):
        bias[h * c.head_dim_k + c.head_dim_k // 2 - 1] += size
    lw.k_bias = bias


def test_tiny_model_keys_pass_and_an_outlier_channel_is_caught(qwen2: Path, caplog) -> None:
    lm = load_model(qwen2, device="cpu", dtype="f32")
    errors = q4_key_errors(lm.model, lm.tokenizer)
    assert sorted(errors) == list(range(lm.config.n_layer))
    assert all(0.0 < e < Q4_KEY_LIMIT for e in errors.values()), errors
    with caplog.at_level(logging.INFO, logger="strata.engine"):
        check_q4_keys(lm.model, lm.tokenizer)
    assert "at most" in caplog.text and "WARNING" not in caplog.text

    _outlier(lm, 1, 300.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="strata.engine"):
        errors = check_q4_keys(lm.model, lm.tokenizer)
    assert errors[1] > Q4_KEY_LIMIT > errors[0], errors
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "layer 1" in warned[0].getMessage() and "--kv int8" in warned[0].getMessage()


def test_the_check_leaves_the_models_caches_and_expert_counts_as_they_were(tmp_path: Path) -> None:
    lm = load_model(write_tiny_model(tmp_path / "moe.gguf", "qwen3moe"), device="cpu", dtype="f32")
    ids = torch.arange(5, 25)
    cache = lm.model.new_cache(64, "f32")
    ref = lm.model.forward(ids, cache, 0)[-1]
    before = lm.model.expert_counts.clone()
    assert before.sum() > 0
    check_q4_keys(lm.model, lm.tokenizer)
    assert torch.equal(lm.model.expert_counts, before)
    again = lm.model.new_cache(64, "f32")
    assert torch.equal(lm.model.forward(ids, again, 0)[-1], ref)
