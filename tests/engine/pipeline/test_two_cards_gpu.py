"""The layer split on two real cards (issue 14): the prompt, decode steps through each stage's CUDA graph (the
second stage's on the second card) and greedy tokens equal those of the same model on one card, with the pinned-host
and the peer-copy hand-off. The reference is the unsplit model on card 0."""

import pytest
import torch

from engine.link.startup import load_split_model
from engine.pipeline.loader import load_model
from engine.pipeline.split import SplitOptions
from engine.pipeline.stages import LocalStage, SplitModel
from engine.testing.tiny_models import write_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA cards"),
]
PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180, 3, 8, 77, 19]


@pytest.mark.parametrize("handoff", ["host", "peer"])
def test_two_cards_give_one_cards_logits_and_tokens(
    tmp_path_factory: pytest.TempPathFactory, handoff: str
) -> None:
    if handoff == "peer" and not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("these two cards have no peer access")
    path = write_tiny_model(
        tmp_path_factory.mktemp("g") / "m.gguf", "qwen3moe", qtype="Q4_K", seed=4, n_layer=6
    )
    base = load_model(path, "cuda:0", "bf16").model
    opts = SplitOptions(gpus=(0, 1), layer_split=(3,), handoff=handoff, pipe_chunk=4)  # type: ignore[arg-type]
    sm = load_split_model(path, opts, 128, "bf16", "bf16").model
    assert isinstance(sm, SplitModel)
    assert len({d.index for d in sm.devices}) == 2 and sm.handoffs[0].mode == handoff
    with torch.inference_mode():
        rc, sc = base.new_cache(128, "bf16"), sm.new_cache(128, "bf16")
        ref = base.forward(torch.tensor(PROMPT[:4]), rc, 0)
        ours = sm.forward(torch.tensor(PROMPT[:4]), sc, 0)  # one piece: no pipeline
        torch.testing.assert_close(ours.to(ref.device), ref, rtol=1e-3, atol=1e-3)
        # the rest of the prompt in pieces of 4 through both cards at once, against the same pieces on one card
        ref = torch.cat([base.forward(torch.tensor(PROMPT[o : o + 4]), rc, o) for o in range(4, 24, 4)])
        ours = sm.forward(torch.tensor(PROMPT[4:]), sc, 4)
        torch.testing.assert_close(ours.to(ref.device), ref, rtol=1e-3, atol=1e-3)
        tok_ref = tok_ours = ref[-1].argmax().view(1).cpu()
        got, want = [], []
        for p in range(len(PROMPT), len(PROMPT) + 16):  # decode steps: each stage's graph on its own card
            tok_ours = sm.forward(tok_ours, sc, p)[-1].argmax().view(1).cpu()
            tok_ref = base.forward(tok_ref, rc, p)[-1].argmax().view(1).cpu()
            got.append(int(tok_ours))
            want.append(int(tok_ref))
    assert got == want
    for st in sm.stages:
        assert isinstance(st, LocalStage)
        if st.graphs is not None:
            assert st.graphs.graphs, f"no decode graph was captured on {st.device}"
