"""Token ids against transformers' GGUF tokenizer conversion of the same file, on strings chosen to break tokenizers.

Where transformers and llama.cpp disagree we follow llama.cpp and test its behaviour with explicit expectations:
- SentencePiece with `add_space_prefix`: llama.cpp puts one "▁" in front of every text piece - at the start *and
  after every special token* - even when the piece already starts with a space (the `Prepend` normalizer of the
  original Llama/Mistral `tokenizer.json`). transformers' GGUF conversion uses `Metaspace(prepend_scheme="first")`,
  which adds it at the start only and not before an existing space. We match llama.cpp so that prompts tokenize
  as the model saw them in llama.cpp-served chats.
Gemma 3 (`add_space_prefix = false`, BOS added by both) has no such difference.
"""

import re
import time
from typing import Any

import pytest

from engine.testing.tokenizer_fixture import tiny_bpe_metadata
from engine.tokenizer import Tokenizer
from tests.engine.tokenizer.gguf_files import TokenizerFile, hf_tokenizer, read_metadata, write_tokenizer_gguf
from tests.engine.tokenizer.hard_strings import HARD_STRINGS

# pre-tokenizer families transformers' GGUF conversion knows (it falls back to GPT-2's regex for the others)
HF_PRE_TYPES = ("qwen2", "llama-bpe", "gpt-4o", "tekken", "qwen35", "deepseek-r1-qwen", "dbrx")


def _mismatches(ours: Tokenizer, expected: dict[str, list[int]], add_special: bool = True) -> list[str]:
    return [
        f"{s!r}: ours {ours.encode(s, add_special=add_special)} expected {ids}"
        for s, ids in expected.items()
        if ours.encode(s, add_special=add_special) != ids
    ]


def test_hard_strings_are_enough() -> None:
    assert len(set(HARD_STRINGS)) >= 30


def test_bpe_ids_match_transformers(bpe_file: TokenizerFile) -> None:
    ours = Tokenizer.from_metadata(bpe_file.meta, source=bpe_file.path.name)
    hf = hf_tokenizer(bpe_file.path)
    expected = {s: hf.encode(s, add_special_tokens=True) for s in HARD_STRINGS}
    assert _mismatches(ours, expected) == []
    plain = {s: hf.encode(s, add_special_tokens=False) for s in HARD_STRINGS}
    assert _mismatches(ours, plain, add_special=False) == []
    # control and user-defined tokens written inline stay whole
    ids = ours.encode("<|im_start|>user<|im_end|><think>")
    assert ids[0] == ours.token_id("<|im_start|>") and ids[-2:] == [
        ours.token_id(t) for t in ("<|im_end|>", "<think>")
    ]
    assert ours.decode(ids[1:-2]) == "user"
    assert ours.encode("<think></think>") == [ours.token_id("<think>"), ours.token_id("</think>")]


@pytest.mark.parametrize("pre", HF_PRE_TYPES)
@pytest.mark.parametrize("vocab_size", [384, 1000])
def test_bpe_pre_tokenizers_match_transformers(
    pre: str, vocab_size: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each vocabulary is trained with the split it declares; a wrong regex changes digits, spaces or scripts."""
    path = tmp_path_factory.mktemp("pre") / f"{pre}-{vocab_size}.gguf"
    write_tokenizer_gguf(path, tiny_bpe_metadata(seed=1, vocab_size=vocab_size, pre=pre), "qwen2")
    ours = Tokenizer.from_metadata(read_metadata(path))
    hf = hf_tokenizer(path)
    assert _mismatches(ours, {s: hf.encode(s) for s in HARD_STRINGS}) == []


def _spm_space_rule(hf: Any, meta: dict[str, Any], text: str) -> list[int]:
    """llama.cpp's SentencePiece ids for `text`, built from transformers' ids: cut at special/user-defined tokens,
    then give every text piece its own leading "▁". transformers adds none before an existing space, so the
    piece " x" encoded as "  x" comes out as "▁▁x", which is llama.cpp's result for " x"."""
    specials = sorted(
        {
            t
            for t, k in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], strict=True)
            if k in (2, 3, 4)
        },
        key=len,
        reverse=True,
    )
    ids = [meta["tokenizer.ggml.bos_token_id"]]
    for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if part in specials:
            ids.append(meta["tokenizer.ggml.tokens"].index(part))
        elif part:
            ids += hf.encode(" " + part, add_special_tokens=False)
    return ids


def test_spm_ids_match_transformers(spm_file: TokenizerFile) -> None:
    ours = Tokenizer.from_metadata(spm_file.meta)
    hf = hf_tokenizer(spm_file.path)
    # strings where transformers and llama.cpp agree: no leading space, no text after a special token
    plain = [s for s in HARD_STRINGS if not s.startswith(" ") and "<" not in s]
    assert len(plain) >= 20
    assert _mismatches(ours, {s: hf.encode(s) for s in plain}) == []
    # all of them, with llama.cpp's space rule applied to transformers' pieces
    expected = {s: _spm_space_rule(hf, spm_file.meta, s) for s in HARD_STRINGS}
    assert _mismatches(ours, expected) == []


def test_spm_space_prefix_follows_llama_cpp(spm_file: TokenizerFile) -> None:
    ours = Tokenizer.from_metadata(spm_file.meta)

    def pieces(text: str) -> list[str]:
        return [ours.token_text(i) for i in ours.encode(text)]

    assert pieces("Hello") == ["<s>", "▁Hello"]
    leading = pieces(" leading space")  # the added "▁", then the text's own space starting "▁l..."
    assert leading[:2] == ["<s>", "▁"] and leading[2].startswith("▁l")
    assert pieces("<s>Hello") == ["<s>", "<s>", "▁Hello"]  # BOS from add_bos, then the one in the text
    assert pieces("Hello<br>world") == ["<s>", "▁Hello", "<br>", "▁world"]  # "▁" after a user-defined token
    assert pieces("  ") == ["<s>", "▁", "▁", "▁"]
    assert pieces("<start_of_turn>user")[:3] == ["<s>", "<start_of_turn>", "▁"]
    # characters outside the vocabulary fall back to their UTF-8 bytes
    assert pieces("🤖") == ["<s>", "▁", "<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]
    no_prefix = Tokenizer.from_metadata({**spm_file.meta, "tokenizer.ggml.add_space_prefix": False})
    assert not any(no_prefix.token_text(i).startswith("▁") for i in no_prefix.encode("Hello<br>world"))


@pytest.mark.real_model
def test_gemma3_ids_match_transformers(gemma_file: TokenizerFile, record_property: Any) -> None:
    start = time.perf_counter()
    ours = Tokenizer.from_metadata(gemma_file.meta, source=gemma_file.path.name)
    build_s = time.perf_counter() - start
    record_property("gemma3_tokenizer_build_s", round(build_s, 2))
    print(f"Gemma 3 tokenizer ({ours.vocab_size} tokens) built in {build_s:.2f} s")
    assert build_s < 30, f"building the 262k-token Gemma tokenizer took {build_s:.1f} s"

    hf = hf_tokenizer(gemma_file.path)
    assert _mismatches(ours, {s: hf.encode(s) for s in HARD_STRINGS}) == []
    assert _mismatches(ours, {s: hf.encode(s, add_special_tokens=False) for s in HARD_STRINGS}, False) == []

    # llama.cpp's view of the file: BOS <bos>=2 added, EOS <eos>=1, end of turn <end_of_turn>=106
    assert (ours.bos_id, ours.eos_id, ours.eot_id, ours.add_bos) == (2, 1, 106, True)
    assert {1, 106} <= ours.eog_ids
    assert ours.is_special(105) and not ours.is_special(107)  # <start_of_turn> control, "\n" user-defined
    assert ours.encode("<start_of_turn>user\n", add_special=False) == [105, 2364, 107]
    assert len(ours.encode("<start_of_turn>", add_special=False, parse_special=False)) > 1
    assert ours.decode(ours.encode("Hello <b>wörld</b> 🤖"), skip_special=True) == "Hello <b>wörld</b> 🤖"
