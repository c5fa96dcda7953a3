"""After a rejected window the KV cache is cut back to the last kept token: the next step's logits equal those of a
fresh run that never saw the rejected drafts (one stage, sliding-window attention, and a 2-stage split)."""

from pathlib import Path

import pytest
import torch

from engine.link.startup import load_split_model
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY, Sampler
from engine.pipeline.spec import SpecConfig, WindowDecoder
from engine.pipeline.split import SplitOptions
from tests.engine.spec.toys import ScriptedDraft, reference_greedy

PROMPT = [5, 9, 33, 71, 120, 200, 7, 64, 3, 11, 17, 42]
CTX = 64


def _model(path: Path, split: bool) -> object:
    if not split:
        return load_model(path, "cpu", "f32").model
    return load_split_model(path, SplitOptions(device="cpu", layer_split=(2,)), CTX, "f32", "f32").model


@pytest.mark.parametrize(("arch", "split"), [("qwen3moe", False), ("gemma3", False), ("llama", True)])
@torch.inference_mode()
def test_rejected_window_is_forgotten(tiny_models: dict[str, Path], arch: str, split: bool) -> None:
    model = _model(tiny_models[arch], split)
    ref = reference_greedy(model, PROMPT, 6, CTX)
    vocab = int(model.cfg.n_vocab)  # type: ignore[attr-defined]
    p = len(PROMPT)

    cache = model.new_cache(CTX, "f32")  # type: ignore[attr-defined]
    model.forward(torch.tensor(PROMPT), cache, 0)  # type: ignore[attr-defined]
    wrong = ScriptedDraft(PROMPT + ref, vocab, 1)
    dec = WindowDecoder(model, cache, SpecConfig(n=3), Sampler(GREEDY), wrong)
    dec.start(PROMPT)
    w = dec.window(ref[0], p, PROMPT + ref[:1], 3)
    assert len(w.tokens) == 4 and w.accepted == [] and w.next_token == ref[1]
    assert cache.length == p + 1
    ours = model.forward(torch.tensor([w.next_token]), cache, p + 1)  # type: ignore[attr-defined]

    fresh_cache = model.new_cache(CTX, "f32")  # type: ignore[attr-defined]
    model.forward(torch.tensor(PROMPT), fresh_cache, 0)  # type: ignore[attr-defined]
    model.forward(torch.tensor(ref[:1]), fresh_cache, p)  # type: ignore[attr-defined]
    fresh = model.forward(torch.tensor([ref[1]]), fresh_cache, p + 1)  # type: ignore[attr-defined]
    # The window's first row ran among four rows and the fresh one alone: the same math up to float rounding.
    assert torch.allclose(ours, fresh, rtol=0, atol=1e-4)
    assert int(torch.argmax(ours[-1])) == ref[2]

    # What reading on after the rejected drafts would give instead: far from it, so the check above has teeth.
    stale_cache = model.new_cache(CTX, "f32")  # type: ignore[attr-defined]
    model.forward(torch.tensor(PROMPT + w.tokens), stale_cache, 0)  # type: ignore[attr-defined]
    stale = model.forward(torch.tensor([ref[1]]), stale_cache, p + len(w.tokens))  # type: ignore[attr-defined]
    assert (stale - fresh).abs().max() > 1e-2
