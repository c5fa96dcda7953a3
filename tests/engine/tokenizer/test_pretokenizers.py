"""Pre-tokenizer splits per `tokenizer.ggml.pre`, for the families transformers' GGUF conversion does not know
(it falls back to GPT-2's regex for them, so it cannot be the reference): expected pieces follow the regexes
llama.cpp documents per family, worked out by hand."""

import pytest
from tokenizers import Regex, pre_tokenizers

from engine.tokenizer.pretokenizers import SUPPORTED_PRE_TYPES, pre_tokenizer_spec
from tests.engine.tokenizer.hard_strings import HARD_STRINGS


def _cut(pre: str, text: str) -> list[str]:
    spec = pre_tokenizer_spec(pre)
    splits = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated") for r in spec.regexes])
    return [piece for piece, _ in splits.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        # digits in threes, Han/kana runs on their own, then the letters/punctuation regex
        (
            "deepseek-v3",
            "Price 1234567 日本語テキストabc",
            ["Price", " ", "123", "456", "7", " ", "日本語テキスト", "abc"],
        ),
        (
            "deepseek-v3",
            "don't\n\n  x.y,z 你好世界",
            ["don", "'t", "\n\n", " ", " x", ".y", ",z", " ", "你好世界"],
        ),
        # glm4: the llama3 regex (digits in threes, letters keep one leading non-letter)
        ("glm4", "abc 123456 日本", ["abc", " ", "123", "456", " 日本"]),
        # llama.cpp's "default": punctuation runs first, then GPT-2, then digit runs, then digit triples
        ("default", "Hello, world!! 12345", ["Hello", ",", " world", "!!", " ", "123", "45"]),
        # smollm / starcoder: every digit alone, then GPT-2
        ("smollm", "abc 2024", ["abc", " ", "2", "0", "2", "4"]),
        ("gpt2", "I'm 12345  x", ["I", "'m", " 12345", " ", " x"]),
        ("qwen2", "abc123", ["abc", "1", "2", "3"]),
        # qwen35 keeps combining marks with their letters; qwen2 does not
        ("qwen35", "नमस्ते", ["नमस्ते"]),
        ("qwen2", "नमस्ते", ["नमस", "्त", "े"]),
        ("falcon", "a 1234 b", ["a", " ", "123", "4", " b"]),
        # tiny_aya groups digits in threes from the right
        ("tiny_aya", "1234567 x", ["1", "234", "567", " x"]),
        # o200k: case changes split words, digits in threes
        (
            "gpt-4o",
            "HelloWorld camelCase 1234567",
            ["Hello", "World", " camel", "Case", " ", "123", "456", "7"],
        ),
        # contractions are ASCII-only: no Unicode case folding of the long s or the Kelvin sign
        ("llama3", "it'S ſ 'ſ", ["it", "'S", " ſ", " '", "ſ"]),
    ],
)
def test_split(pre: str, text: str, pieces: list[str]) -> None:
    assert _cut(pre, text) == pieces


@pytest.mark.parametrize("pre", SUPPORTED_PRE_TYPES)
def test_every_family_splits_losslessly(pre: str) -> None:
    for text in HARD_STRINGS:
        pieces = _cut(pre, text)
        assert "".join(pieces) == text and all(pieces)


def test_family_flags_follow_llama_cpp() -> None:
    assert pre_tokenizer_spec("llama-bpe").ignore_merges and pre_tokenizer_spec("llama-bpe").add_bos
    assert pre_tokenizer_spec("tekken").add_bos and not pre_tokenizer_spec("qwen2").add_bos
    assert pre_tokenizer_spec("glm4").no_bos and pre_tokenizer_spec("glm4").ignore_merges
    assert pre_tokenizer_spec("deepseek-r1-qwen") == pre_tokenizer_spec("qwen2")
    assert len(SUPPORTED_PRE_TYPES) >= 60
