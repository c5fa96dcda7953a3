"""`strata-engine profile` on a tiny MoE model, checked against the routing recomputed independently (HF transformers
for the hidden states, then a plain softmax/top-k on the router weights dequantized by gguf.quants), and the split
loader reading the profile back at start."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cli import main
from engine.experts.profile import load_profile, profile_location
from engine.gguf.digest import header_digest
from engine.gguf.reader import GGUFFile
from engine.link import startup as startup_mod
from engine.link.startup import load_split_model
from engine.models.registry import config_for
from engine.pipeline.split import SplitOptions
from engine.testing.tiny_models import write_tiny_model
from engine.tokenizer import ChatFormatter, Tokenizer
from tests.engine.hf_reference import hf_logits, hf_model, read_gguf

PROMPTS = ["hello there", "write a poem about the sea", "", "what is 2+2?"]
MAX_TOKENS = 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("prof") / "tiny.gguf", "qwen3moe", qtype="Q8_0", seed=3)


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.txt"
    p.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    return p


@torch.inference_mode()
def reference_counts(path: Path, prompts: list[str], max_tokens: int) -> tuple[np.ndarray, int, int]:
    """-> counts [L, E], tokens read, top-k: every prompt as a chat message, then greedy tokens."""
    meta, tensors = read_gguf(path)
    arch = meta["general.architecture"]
    n_layer, k = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.expert_used_count"])
    n_expert = int(meta[f"{arch}.expert_count"])
    gf = GGUFFile.open(path)
    tok, chat = Tokenizer.from_metadata(gf.metadata), ChatFormatter.from_metadata(gf.metadata)
    model = hf_model(path)
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda _m, args, i=i: seen.__setitem__(i, args[0][0].clone()))
    counts = np.zeros((n_layer, n_expert), np.int64)
    tokens = 0
    for text in prompts:
        ids = tok.encode(chat.render([{"role": "user", "content": text}], add_generation_prompt=True))
        seq, out = list(ids), 0
        while True:  # greedy; the last token emitted is never read by the model
            nxt = int(hf_logits(model, seq)[-1].argmax())
            if nxt in tok.eog_ids:
                break
            out += 1
            if out >= max_tokens:
                break
            seq.append(nxt)
        model(torch.tensor([seq]))  # the hooks see each layer's router input for every token read
        tokens += len(seq)
        for i in range(n_layer):
            router = torch.from_numpy(tensors[f"blk.{i}.ffn_gate_inp.weight"])  # [E, D]
            probs = torch.softmax(seen[i].float() @ router.T, dim=-1)  # [T, E]
            chosen = torch.topk(probs, k, dim=-1).indices  # [T, k]
            counts[i] += np.bincount(chosen.flatten().numpy(), minlength=n_expert)
    return counts, tokens, k


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["profile", "--device", "cpu", *args]) == 0
    return capsys.readouterr().out


def test_profile_counts_the_routing_of_the_prompts(
    tiny: Path,
    prompts: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STRATA_PROFILE_DIR", str(tmp_path / "profiles"))
    out = _run(capsys, "--model", str(tiny), "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS))
    path = tmp_path / "profiles" / f"{header_digest(GGUFFile.open(tiny))}.json"
    assert path.is_file(), out
    ref, tokens, k = reference_counts(tiny, [p for p in PROMPTS if p], MAX_TOKENS)
    doc = json.loads(path.read_text(encoding="utf-8"))
    counts = np.array(doc["counts"])
    assert doc["tokens"] == tokens
    assert counts.sum() == tokens * k * 2  # tokens x top-k x layers
    np.testing.assert_array_equal(counts, ref)
    used = int(np.count_nonzero(ref))
    assert out.strip() == f"expert profile {path}: 3 prompts, {tokens} tokens, {used} of 16 experts used"

    # A second run adds to the same file; --out writes elsewhere.
    out2 = _run(capsys, "--model", str(tiny), "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS))
    assert f"the file now holds {2 * tokens} tokens" in out2
    np.testing.assert_array_equal(np.array(json.loads(path.read_text())["counts"]), 2 * ref)
    other = tmp_path / "elsewhere.json"
    _run(capsys, "--model", str(tiny), "--prompts", str(prompts), "-n", str(MAX_TOKENS), "--out", str(other))
    np.testing.assert_array_equal(np.array(json.loads(other.read_text())["counts"]), ref)


def test_the_split_loader_reads_the_profile_at_start(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_PROFILE_DIR", str(tmp_path / "profiles"))
    gf = GGUFFile.open(tiny)
    cfg = config_for(gf.architecture, gf.metadata, n_vocab=gf.tensors["token_embd.weight"].shape[0])
    path, ident = profile_location(gf, cfg)
    counts = np.arange(16, dtype=np.int64).reshape(2, 8)
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps({"format": "polystrata-expert-profile", "version": 1, "model": ident.to_json(), "tokens": 60,
                    "counts": counts.tolist()}), encoding="utf-8",
    )  # fmt: skip
    given: list[np.ndarray | None] = []
    real = startup_mod.plan_stages

    def spy(*args: object, **kw: object) -> object:
        given.append(args[5] if len(args) > 5 else kw.get("profile"))  # type: ignore[arg-type]
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(startup_mod, "plan_stages", spy)
    with caplog.at_level(logging.INFO, "strata.engine"):
        load_split_model(tiny, SplitOptions(device="cpu"))
    assert f"expert profile: {path} (60 tokens)" in caplog.messages
    assert given[-1] is not None
    np.testing.assert_array_equal(given[-1], counts)

    caplog.clear()
    with caplog.at_level(logging.INFO, "strata.engine"):
        load_split_model(tiny, SplitOptions(device="cpu", use_profile=False))
    assert not [m for m in caplog.messages if "expert profile" in m] and given[-1] is None

    # --profile PATH to another model's profile: one warning, and the caches are filled without it.
    foreign = tmp_path / "foreign.json"
    foreign.write_text(path.read_text().replace(ident.digest, "0" * 64), encoding="utf-8")
    caplog.clear()
    with caplog.at_level(logging.INFO, "strata.engine"):
        load_split_model(tiny, SplitOptions(device="cpu", profile=str(foreign)))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "another model file" in warned[0] and str(foreign) in warned[0]
    assert given[-1] is None
    assert load_profile(path, ident) is not None  # the good one is untouched


def test_profile_refuses_a_dense_model_and_an_empty_prompt_file(tmp_path: Path) -> None:
    dense = write_tiny_model(tmp_path / "dense.gguf", "qwen3", qtype="Q8_0", seed=0)
    lines = tmp_path / "p.txt"
    lines.write_text("hi\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="dense qwen3 model: it has no experts"):
        main(["profile", "--device", "cpu", "--model", str(dense), "--prompts", str(lines)])
    with pytest.raises(SystemExit, match="--no-profile does not go with profile"):
        main(["profile", "--model", str(dense), "--prompts", str(lines), "--no-profile"])
    lines.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(SystemExit, match="has no prompt: write one user message per line"):
        main(["profile", "--device", "cpu", "--model", str(dense), "--prompts", str(lines)])
