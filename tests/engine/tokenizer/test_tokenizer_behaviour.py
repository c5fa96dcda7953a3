"""Decoding, streaming, special-token rules and errors of engine.tokenizer.Tokenizer (llama.cpp's behaviour)."""

import logging
from typing import Any

import numpy as np
import pytest

from engine.testing.tokenizer_fixture import tiny_bpe_metadata, tiny_spm_metadata
from engine.tokenizer import TokenAttr, Tokenizer, TokenizerError
from tests.engine.tokenizer.gguf_files import TokenizerFile
from tests.engine.tokenizer.hard_strings import HARD_STRINGS


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.from_metadata(tiny_bpe_metadata())


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_metadata(tiny_spm_metadata())


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_decode_inverts_encode(kind: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(kind)
    for s in HARD_STRINGS:
        assert tok.decode(tok.encode(s, add_special=False)) == s
        assert tok.decode(tok.encode(s)) == (("<s>" + s) if kind == "spm" else s)
        assert tok.decode(tok.encode(s), skip_special=True) == _without_control(tok, s)


def _without_control(tok: Tokenizer, s: str) -> str:
    for t in sorted(
        (tok.token_text(i) for i in range(tok.vocab_size) if tok.is_special(i)), key=len, reverse=True
    ):
        s = s.replace(t, "")
    return s


@pytest.mark.real_model
def test_gemma3_decode_inverts_encode(gemma_file: TokenizerFile) -> None:
    tok = Tokenizer.from_metadata(gemma_file.meta)
    for s in HARD_STRINGS:
        assert tok.decode(tok.encode(s, add_special=False)) == s
        assert tok.decode(tok.encode(s)) == "<bos>" + s


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_stream_decoder_reassembles_split_characters(kind: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(kind)
    text = "Zürich 日本語 🙂🚀👍🏽 👨‍👩‍👧 naïve"
    ids = tok.encode(text, add_special=False)
    # the tiny vocabularies cut these characters into byte-level / <0xXX> tokens
    assert any(len(tok.token_to_bytes(i)) and not _is_utf8(tok.token_to_bytes(i)) for i in ids)
    stream = tok.stream_decoder()
    chunks = [stream.push(i) for i in ids]
    chunks.append(stream.flush())
    assert "".join(chunks) == (text if kind == "bpe" else " " + text)  # the stream keeps SPM's prefix space
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks[:-1]  # held back until the character was complete
    assert stream.pending == b""


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_stream_decoder_specials_and_invalid_bytes(spm: Tokenizer) -> None:
    stream = spm.stream_decoder()
    assert stream.push(spm.bos_id or 0) == ""  # control tokens are hidden by default
    assert stream.push(spm.token_id("<br>") or 0) == "<br>"  # user-defined tokens are text
    assert stream.push(spm.token_id("<0xE6>") or 0) == ""
    assert stream.pending == b"\xe6"
    assert stream.flush() == "\ufffd"  # a character that never completed
    shown = spm.stream_decoder(skip_special=False)
    assert shown.push(spm.bos_id or 0) == "<s>"


def test_token_to_piece(bpe: Tokenizer, spm: Tokenizer) -> None:
    space_the = bpe.token_id("Ġthe")
    assert space_the is not None and bpe.token_to_piece(space_the) == " the"
    assert spm.token_to_piece(spm.token_id("▁Hello") or 0) == " Hello"
    assert spm.token_to_bytes(spm.token_id("<0x0A>") or 0) == b"\n"
    assert spm.token_to_piece(spm.token_id("<0xE6>") or 0) == "\ufffd"
    assert spm.token_to_piece(1) == "<s>" and spm.token_to_piece(1, special=False) == ""
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        spm.token_to_piece(spm.vocab_size)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        spm.decode([-1])


def test_special_ids_and_flags(bpe: Tokenizer, spm: Tokenizer) -> None:
    tid = bpe.token_id
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (
        tid("<|endoftext|>"),
        tid("<|im_end|>"),
        tid("<|endoftext|>"),
    )
    assert bpe.eot_id == tid("<|im_end|>")
    assert bpe.eog_ids == {tid("<|im_end|>"), tid("<|endoftext|>")}
    assert bpe.is_special(tid("<|im_start|>") or 0) and not bpe.is_special(tid("<think>") or 0)
    assert bpe.token_attr(tid("<think>") or 0) == TokenAttr.USER_DEFINED
    assert not bpe.add_bos and bpe.encode("hi")[0] != bpe.bos_id
    assert (spm.bos_id, spm.eos_id, spm.unk_id, spm.add_bos, spm.add_eos) == (1, 2, 0, True, False)
    assert spm.eog_ids == {2, spm.token_id("<end_of_turn>")}  # </s> and <end_of_turn>
    assert spm.encode("") == [1] and spm.encode("", add_special=False) == []
    assert spm.vocab_size == 640 and bpe.vocab_size == 512


def test_add_bos_defaults_follow_llama_cpp() -> None:
    spm_meta = {k: v for k, v in tiny_spm_metadata().items() if "add_" not in k}
    spm = Tokenizer.from_metadata(spm_meta)
    assert spm.add_bos and spm.add_space_prefix and spm.encode("a")[0] == 1  # SentencePiece: BOS by default
    bpe_meta = {k: v for k, v in tiny_bpe_metadata().items() if "add_" not in k}
    assert not Tokenizer.from_metadata(bpe_meta).add_bos  # byte-level BPE: only when the file says so
    llama3 = Tokenizer.from_metadata({**bpe_meta, "tokenizer.ggml.pre": "llama-bpe"})
    assert llama3.add_bos and llama3.encode("a")[0] == llama3.bos_id  # ...or for llama3-style vocabularies
    with_eos = Tokenizer.from_metadata({**tiny_spm_metadata(), "tokenizer.ggml.add_eos_token": True})
    assert with_eos.encode("a")[-1] == 2


def test_parse_special(bpe: Tokenizer, spm: Tokenizer) -> None:
    text = "<|im_start|>user<think>"
    parsed = bpe.encode(text)
    literal = bpe.encode(text, parse_special=False)
    assert parsed[0] == bpe.token_id("<|im_start|>")
    assert bpe.token_id("<|im_start|>") not in literal and len(literal) > len(parsed)
    assert literal[-1] == bpe.token_id("<think>")  # user-defined tokens are always matched, as in llama.cpp
    assert bpe.decode(literal) == text
    assert spm.encode("<s>x", add_special=False, parse_special=False)[:1] != [1]
    assert bpe.encode(text) == parsed  # the flag does not stick


def test_eog_derivation_follows_llama_cpp() -> None:
    meta = tiny_bpe_metadata()
    tokens = [
        *meta["tokenizer.ggml.tokens"],
        "<|return|>",
        "<|call|>",
        "<|end|>",
        "<|eot_id|>",
        "<|channel|>",
    ]
    types = np.concatenate([meta["tokenizer.ggml.token_type"], np.array([3, 3, 3, 1, 3], dtype=np.int32)])
    tok = Tokenizer.from_metadata(
        {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    )
    ids = {t: tok.token_id(t) for t in tokens[-5:]}
    # harmony: <|end|> closes a message, not the generation, when <|return|> and <|call|> exist
    assert ids["<|return|>"] in tok.eog_ids and ids["<|call|>"] in tok.eog_ids
    assert ids["<|end|>"] not in tok.eog_ids
    # an end-of-turn text typed as normal is promoted to control
    assert ids["<|eot_id|>"] in tok.eog_ids and tok.is_special(ids["<|eot_id|>"] or 0)
    assert tok.token_attr(ids["<|channel|>"] or 0) == TokenAttr.USER_DEFINED  # always rendered
    assert tok.eot_id == ids["<|eot_id|>"]  # first in llama.cpp's list wins over <|im_end|>
    explicit = Tokenizer.from_metadata({**meta, "tokenizer.ggml.eot_token_id": 7})
    assert explicit.eot_id == 7 and 7 in explicit.eog_ids


def test_unknown_pre_warns_and_uses_gpt2(caplog: pytest.LogCaptureFixture) -> None:
    meta = tiny_bpe_metadata(pre="gpt2")
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "no-such-pre"})
    assert "no-such-pre" in caplog.text and "GPT-2" in caplog.text
    assert tok.encode("abc 12345") == Tokenizer.from_metadata(meta).encode("abc 12345")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"tokenizer.ggml.model": "t5"},
            "tokenizer type tokenizer.ggml.model='t5' in m.gguf is not supported",
        ),
        ({"tokenizer.ggml.model": None}, "no tokenizer in m.gguf"),
        ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens is missing or empty in m.gguf"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges is missing in m.gguf"),
        ({"tokenizer.ggml.token_type": np.ones(3, dtype=np.int32)}, "has 3 entries for 512 tokens"),
        (
            {"tokenizer.ggml.tokens": ["a", "b", "a"], "tokenizer.ggml.token_type": None},
            "lists token 'a' more than once",
        ),
    ],
)
def test_errors_are_one_line_and_name_the_file(change: dict[str, Any], message: str) -> None:
    meta = {k: v for k, v in {**tiny_bpe_metadata(), **change}.items() if v is not None}
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_metadata(meta, source="m.gguf")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_file_merges_are_used_for_spm_when_present() -> None:
    """A SentencePiece vocabulary with merges in the file tokenizes with those, not with the scores."""
    meta = tiny_spm_metadata()
    tokens = meta["tokenizer.ggml.tokens"]
    tok = Tokenizer.from_metadata(meta)
    hello = tok.token_id("▁Hello")
    assert tok.encode("Hello", add_special=False) == [hello]
    # without the merges that make "▁Hello", it can no longer be formed
    merges = [f"{a} {b}" for a, b in _splits(tokens) if a + b != "▁Hello"]
    without = Tokenizer.from_metadata({**meta, "tokenizer.ggml.merges": merges})
    assert without.encode("Hello", add_special=False) != [hello]
    assert without.decode(without.encode("Hello", add_special=False)) == "Hello"


def _splits(tokens: list[str]) -> list[tuple[str, str]]:
    known = set(tokens)
    return [(t[:k], t[k:]) for t in tokens for k in range(1, len(t)) if t[:k] in known and t[k:] in known]
