"""A 2-stage in-process split of each family (stages built from the family's own class, prompt pieces pipelined
across stage threads) gives the unsplit model's logits bit for bit and its greedy tokens."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.models.gated_delta import RecurrentCache
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.pipeline.stages import SplitModel
from engine.testing.tiny_families import FAMILIES, write_tiny_family
from tests.engine.spec.toys import family_split

PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180]
PIECE = 4


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _split(path: Path, k: int) -> SplitModel:
    return family_split(path, k, pipeline=True, pipe_chunk=PIECE)


def _cache(model: object) -> object:
    if isinstance(model, SplitModel):
        parts = [s.model.new_cache(64, "f32") for s in model.stages]  # type: ignore[attr-defined]
        if isinstance(parts[0], RecurrentCache):  # the split's own new_cache does not carry recurrent states
            for p in parts[1:]:
                parts[0].merge(p)
            return parts[0]
        return model.new_cache(64, "f32")
    return model.new_cache(64, "f32")  # type: ignore[attr-defined]


def _greedy(model: object, n: int = 8) -> list[int]:
    cache = _cache(model)
    logits = model.forward(torch.tensor(PROMPT), cache, 0)  # type: ignore[attr-defined]
    out, pos = [], len(PROMPT)
    for _ in range(n):
        tok = int(logits[-1].argmax())
        out.append(tok)
        logits = model.forward(torch.tensor([tok]), cache, pos)  # type: ignore[attr-defined]
        pos += 1
    return out


@pytest.mark.parametrize("arch", FAMILIES)
def test_two_stage_split_matches_unsplit(tmp_path: Path, arch: str) -> None:
    path = write_tiny_family(tmp_path / f"{arch}.gguf", arch, qtype="Q8_0", seed=11)
    base = load_model(path, device="cpu", dtype="f32").model
    sm = _split(path, 1)
    with torch.inference_mode():
        ref_cache, cache = _cache(base), _cache(sm)
        ref = torch.cat(
            [base.forward(torch.tensor(PROMPT[o : o + PIECE]), ref_cache, o) for o in range(0, 16, PIECE)]
        )
        ours = sm.forward(torch.tensor(PROMPT[:16]), cache, 0)  # four pieces through the pipeline
        assert torch.equal(ours, ref)
        assert _greedy(sm) == _greedy(base)
    # through the Runner, which makes the cache with the split's new_cache (qwen3next's: merged recurrent states)
    lm = load_model(path, device="cpu", dtype="f32")
    req = GenerationRequest(PROMPT, max_tokens=8, sampling=GREEDY, ignore_eos=True)
    runner = Runner(sm, lm.tokenizer, 64, "f32", prefill_chunk=8)
    tokens = next(e for e in runner.generate(req) if isinstance(e, DoneEvent)).tokens
    assert tokens == _greedy(base)
