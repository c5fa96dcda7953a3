"""The tokenizer fixture library: deterministic vocabularies, written with the value types llama.cpp reads, and the
tests' small metadata reader checked against gguf.GGUFReader."""

import hashlib
import json
import subprocess
import sys
from typing import Any

import gguf
import numpy as np
import pytest

from engine.testing.tokenizer_fixture import tiny_bpe_metadata, tiny_spm_metadata
from tests.engine.tokenizer.gguf_files import TokenizerFile, read_metadata

_DIGEST = (
    "import hashlib, json\n"
    "from engine.testing.tokenizer_fixture import tiny_bpe_metadata, tiny_spm_metadata\n"
    "def plain(m): return {k: (v.tolist() if hasattr(v, 'tolist') else v) for k, v in m.items()}\n"
    "data = [plain(tiny_bpe_metadata()), plain(tiny_spm_metadata()), plain(tiny_bpe_metadata(3, 700, 'llama-bpe'))]\n"
    "print(hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest())\n"
)


def _digest(meta: dict[str, Any]) -> str:
    plain = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in meta.items()}
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


def test_fixtures_are_deterministic_across_processes() -> None:
    """`tokenizers` hashes with a per-process seed; the vocabularies must not depend on it."""
    runs = {
        subprocess.run([sys.executable, "-c", _DIGEST], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert len(runs) == 1
    assert _digest(tiny_bpe_metadata(seed=0)) != _digest(tiny_bpe_metadata(seed=1))
    assert _digest(tiny_spm_metadata(seed=0)) != _digest(tiny_spm_metadata(seed=1))


def test_fixture_contents() -> None:
    bpe = tiny_bpe_metadata()
    tokens, types = bpe["tokenizer.ggml.tokens"], bpe["tokenizer.ggml.token_type"]
    assert len(tokens) == 512 and len(set(tokens)) == 512 and bpe["tokenizer.ggml.pre"] == "qwen2"
    kinds = {t: int(k) for t, k in zip(tokens, types, strict=True)}
    assert {kinds[t] for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")} == {gguf.TokenType.CONTROL}
    assert {kinds[t] for t in ("<think>", "</think>")} == {gguf.TokenType.USER_DEFINED}
    assert tokens[bpe["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert "enable_thinking" in bpe["tokenizer.chat_template"] and "tools" in bpe["tokenizer.chat_template"]
    assert all(
        a in tokens and b in tokens and a + b in tokens
        for a, b in (m.split(" ") for m in bpe["tokenizer.ggml.merges"])
    )

    spm = tiny_spm_metadata(vocab_size=700)
    tokens, scores, types = (
        spm["tokenizer.ggml.tokens"],
        spm["tokenizer.ggml.scores"],
        spm["tokenizer.ggml.token_type"],
    )
    assert len(tokens) == 700 and tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)] and set(types[3:259].tolist()) == {
        gguf.TokenType.BYTE
    }
    normal = types == gguf.TokenType.NORMAL
    assert np.all(np.diff(scores[normal]) < 0)  # best piece first, every score distinct
    assert scores.dtype == np.float32 and types.dtype == np.int32

    # the cache hands out fresh containers
    bpe["tokenizer.ggml.tokens"].append("x")
    assert len(tiny_bpe_metadata()["tokenizer.ggml.tokens"]) == 512


@pytest.mark.parametrize("name", ["bpe_file", "spm_file"])
def test_written_value_types(name: str, request: pytest.FixtureRequest) -> None:
    file: TokenizerFile = request.getfixturevalue(name)
    reader = gguf.GGUFReader(file.path)
    fields = reader.fields
    GT = gguf.GGUFValueType

    def kind(key: str) -> tuple[Any, ...]:
        field = fields[key]
        return tuple(field.types)

    assert kind("tokenizer.ggml.tokens") == (GT.ARRAY, GT.STRING)
    assert kind("tokenizer.ggml.token_type") == (GT.ARRAY, GT.INT32)
    assert kind("tokenizer.ggml.bos_token_id") == (GT.UINT32,)
    assert kind("tokenizer.ggml.add_bos_token") == (GT.BOOL,)
    assert kind("tokenizer.ggml.model") == (GT.STRING,)
    if name == "spm_file":
        assert kind("tokenizer.ggml.scores") == (GT.ARRAY, GT.FLOAT32)
        assert kind("tokenizer.ggml.add_space_prefix") == (GT.BOOL,)
    else:
        assert kind("tokenizer.ggml.merges") == (GT.ARRAY, GT.STRING)
        assert kind("tokenizer.chat_template") == (GT.STRING,)

    # the tests' fast reader returns exactly what gguf.GGUFReader does
    ours = read_metadata(file.path)
    assert set(ours) == {k for k in fields if k.startswith(("tokenizer.", "general."))}
    for key, value in ours.items():
        theirs = fields[key].contents()
        if isinstance(value, np.ndarray):
            assert value.tolist() == theirs, key
        else:
            assert value == theirs, key
