"""The usage profile on CUDA: `strata-engine profile` counts the same routing as the independent reference, and the
saved profile fills the expert cache hottest-first at start."""

import json
from pathlib import Path

import numpy as np
import pytest

from engine.cli import main
from engine.experts.profile import profile_location
from engine.gguf.reader import GGUFFile
from engine.link.startup import load_split_model
from engine.models.registry import config_for
from engine.pipeline.split import SplitOptions
from engine.testing.tiny_models import write_tiny_model
from tests.engine.experts.test_profile_cli import MAX_TOKENS, PROMPTS, reference_counts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("profgpu") / "tiny.gguf", "qwen3moe", qtype="Q8_0", seed=3
    )


def test_profile_on_cuda_counts_the_reference_routing(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS), encoding="utf-8")
    args = ["profile", "--device", "cuda", "--dtype", "f32", "--model", str(tiny), "--prompts", str(prompts)]
    assert main([*args, "--max-tokens", str(MAX_TOKENS), "--out", str(out)]) == 0
    ref, tokens, k = reference_counts(tiny, [p for p in PROMPTS if p], MAX_TOKENS)
    doc = json.loads(out.read_text(encoding="utf-8"))
    counts = np.array(doc["counts"])
    assert doc["tokens"] == tokens and counts.sum() == tokens * k * 2
    # f32 on both sides; the GPU sums in another order, so a near-tie between two experts may go either way.
    assert np.abs(counts - ref).sum() <= 0.02 * ref.sum()


def test_the_saved_profile_fills_the_cache_hottest_first(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_PROFILE_DIR", str(tmp_path))
    gf = GGUFFile.open(tiny)
    cfg = config_for(gf.architecture, gf.metadata, n_vocab=gf.tensors["token_embd.weight"].shape[0])
    path, ident = profile_location(gf, cfg)
    counts = np.ones((2, 8), np.int64)
    counts[0, 5], counts[0, 2], counts[1, 7], counts[1, 0] = 100, 90, 95, 80
    path.write_text(
        json.dumps({"format": "polystrata-expert-profile", "version": 1, "model": ident.to_json(), "tokens": 10,
                    "counts": counts.tolist()}), encoding="utf-8",
    )  # fmt: skip
    lm = load_split_model(tiny, SplitOptions(device="cuda", expert_slots=4))
    cache = lm.model.expert_cache
    assert cache is not None
    assert cache.layers[0].expert_in == [5, 2] and cache.layers[1].expert_in == [7, 0]
    lm = load_split_model(tiny, SplitOptions(device="cuda", expert_slots=4, use_profile=False))
    plain = lm.model.expert_cache
    assert plain.layers[0].expert_in == [0, 1, 2, 3] and plain.layers[1].expert_in == []  # without: in order
