"""The remote stage for each model family: main (layers 0..K-1) and a worker process (K..end) on loopback give the
one-process model's greedy tokens; qwen3next's recurrent states stay with the process that owns their layers."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.link.startup import load_split_model
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.pipeline.split import SplitOptions
from engine.pipeline.stages import SplitModel
from engine.testing.tiny_families import FAMILIES, write_tiny_family
from tests.engine.link.harness import TOKEN, start_worker

PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180]


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("STRATA_STAGE_TOKEN", TOKEN)
    yield


def _greedy(model: object, tok: object) -> list[int]:
    runner = Runner(model, tok, 256, "f32", 8)  # type: ignore[arg-type]
    req = GenerationRequest(PROMPT, max_tokens=8, sampling=GREEDY, ignore_eos=True)
    return next(e for e in runner.generate(req) if isinstance(e, DoneEvent)).tokens


@pytest.mark.parametrize("arch", FAMILIES)
def test_remote_stage_of_each_family(tmp_path: Path, arch: str) -> None:
    path = write_tiny_family(tmp_path / f"{arch}.gguf", arch, qtype="Q8_0", seed=11)
    base = load_model(path, device="cpu", dtype="f32")
    k = base.config.n_layer // 2
    worker = start_worker(path, k)
    try:
        opts = SplitOptions(device="cpu", layer_split=(k,), remote=f"127.0.0.1:{worker.port}")
        sm = load_split_model(path, opts, 256, "f32", "f32").model
        assert isinstance(sm, SplitModel)
        try:
            with torch.inference_mode():
                assert _greedy(sm, base.tokenizer) == _greedy(base.model, base.tokenizer)
        finally:
            sm.close()
    finally:
        worker.stop()
