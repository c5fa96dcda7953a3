"""Pre-tokenizer splits for byte-level BPE vocabularies, selected by `tokenizer.ggml.pre`.

A byte-level BPE vocabulary was learned on text cut into words by one particular regex; the merges only
reproduce the original ids when the text is cut the same way. llama.cpp applies a short list of regexes one
after the other: each one cuts every piece left by the previous one, keeping both the matches and the text
between them. That is a `tokenizers` `Split(..., behavior="isolated")` per regex.

The regexes below follow llama.cpp's table per pre type (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`). Where
llama.cpp only approximates the vocabulary's own `tokenizer.json` regex because C++ `std::regex` lacks the
Unicode case classes (`tekken`, `gpt-4o`), we use the `tokenizer.json` regex it quotes: the Oniguruma engine
inside `tokenizers` supports `\\p{Lu}` & co., and that regex is what the merges were learned with. Case-insensitive
contractions are spelled `'[sS]` instead of `(?i:'s)` so Unicode case folding (`ſ`, the Kelvin sign) cannot
widen them, as llama.cpp does.
"""

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# English contractions, ASCII case-insensitive.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

JAIS2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
    r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)

# Digits in runs of up to three, then Han and kana runs, then words with a leading ASCII punctuation mark.
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_HAN_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"

_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_STARCODER = (r"\p{N}", GPT2)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_PORO = (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How one `tokenizer.ggml.pre` family cuts text before the merges, and the vocabulary flags llama.cpp
    sets with it."""

    name: str
    regexes: tuple[str, ...]
    # A word that is itself in the vocabulary is emitted whole, without running the merges.
    ignore_merges: bool = False
    # llama.cpp turns BOS on for these families unless the file's add_bos_token says otherwise.
    add_bos: bool = False
    # llama.cpp drops the default BOS id for these families (ChatGLM writes its own prefix).
    no_bos: bool = False


_FAMILIES: dict[str, PreTokenizerSpec] = {}


def _family(spec: PreTokenizerSpec, *names: str) -> None:
    for name in names:
        _FAMILIES[name] = spec


_family(PreTokenizerSpec("default", _DEFAULT), "default")
_family(
    PreTokenizerSpec("llama3", (LLAMA3,), ignore_merges=True, add_bos=True),
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
)
_family(PreTokenizerSpec("dbrx", (LLAMA3,)), "dbrx", "smaug-bpe")
_family(PreTokenizerSpec("jais-2", (JAIS2,)), "jais-2")
_family(
    PreTokenizerSpec(
        "deepseek-llm",
        (
            r"[\r\n]",
            "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
            "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
            "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
            "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
            "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
            "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
            "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
            "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
            "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
            "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
            "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
            "\U0001e900-\U0001e943]+",
            r"\s?[!-/:-~" "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            r"\s+\z",  # end of the piece (Oniguruma's `$` would also match before a newline)
            "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
            r"\p{N}+",
        ),
    ),
    "deepseek-llm",
)
_family(
    PreTokenizerSpec(
        "deepseek-coder",
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"),
    ),
    "deepseek-coder",
)
_family(
    PreTokenizerSpec("deepseek-v3", (r"\p{N}{1,3}", _HAN_KANA, _DEEPSEEK3_WORDS)),
    "deepseek-v3",
    "hunyuan-dense",
    "joyai-llm",
    "hy_v4",
)
_family(
    PreTokenizerSpec(
        "spark2_5",
        (
            r"\p{N}{1,3}",
            _HAN_KANA,
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
            r"\p{N}",
        ),
    ),
    "spark2_5",
)
_family(
    PreTokenizerSpec(
        "falcon",
        (
            r"[\p{P}\$\+<=>\^~\|`]+",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            r"[0-9][0-9][0-9]",
        ),
    ),
    "falcon",
)
_family(
    PreTokenizerSpec("starcoder", _STARCODER),
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "codeshell",
    "exaone",
    "minerva-7b",
    "mellum2",
)
_family(
    PreTokenizerSpec("gpt2", (GPT2,)),
    "gpt2",
    "gpt-2",
    "mpt",
    "olmo",
    "jais",
    "trillion",
    "granite-docling",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "exaone4",
    "jina-v1-en",
    "jina-v2-code",
    "roberta-bpe",
)
_family(
    PreTokenizerSpec("qwen2", (QWEN2,)),
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "megrez",
    "stablelm2",
    "hunyuan",
    "solar-open",
)
_family(PreTokenizerSpec("qwen35", (QWEN35,)), "qwen35")
_family(PreTokenizerSpec("poro", _PORO), "poro-chat", "bloom", "gpt3-finnish")
_family(PreTokenizerSpec("chatglm-bpe", (LLAMA3,), no_bos=True), "chatglm-bpe")
_family(PreTokenizerSpec("glm4", (LLAMA3,), ignore_merges=True, no_bos=True), "glm4", "glm5")
_family(PreTokenizerSpec("viking", (*_PORO, r"\p{N}")), "viking")
_family(PreTokenizerSpec("tekken", (TEKKEN,), ignore_merges=True, add_bos=True), "tekken")
_family(
    PreTokenizerSpec(
        "chameleon",
        (
            r"<sentinel:[0-9]+>",
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            GPT2,
        ),
        add_bos=True,
    ),
    "chameleon",
)
_family(PreTokenizerSpec("gpt-4o", (GPT4O,)), "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")
_family(
    PreTokenizerSpec(
        "tiny_aya",
        (r"\d{1,3}(?=(?:\d{3})*\b)", GPT4O),
    ),
    "tiny_aya",
    "cohere2moe",
)
_family(
    PreTokenizerSpec(
        "bailingmoe",
        (
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        ),
    ),
    "bailingmoe",
    "bailingmoe2",
    "llada-moe",
)
_family(
    PreTokenizerSpec(
        "seed-coder",
        (
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
    ),
    "seed-coder",
)
_family(
    PreTokenizerSpec(
        "ufakzeka",
        (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    ),
    "ufakzeka",
)
_family(PreTokenizerSpec("grok-2", (QWEN2,)), "grok-2")
_family(PreTokenizerSpec("laguna", (r"[^\n]+|[\n]+", QWEN2)), "laguna")
_family(
    PreTokenizerSpec(
        "exaone-moe",
        (
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
            r"|\s*[\r\n]|\s+(?!\S)|\s+",
        ),
    ),
    "exaone-moe",
)
_family(
    PreTokenizerSpec(
        "minicpm5",
        (
            r"\p{N}{1,3}",
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
    ),
    "minicpm5",
)
_family(
    PreTokenizerSpec(
        "youtu",
        (
            "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c"
            "\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _HAN_KANA,
            rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
            r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
    ),
    "youtu",
)

SUPPORTED_PRE_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))


def pre_tokenizer_spec(pre: str | None) -> PreTokenizerSpec:
    """The split for a `tokenizer.ggml.pre` value. A missing value is llama.cpp's `default`; a value we do not
    know gets the GPT-2 regex and a warning, since the ids may then differ from the model's own tokenizer."""
    if not pre:
        log.warning("the GGUF file has no tokenizer.ggml.pre; using the 'default' pre-tokenizer")
        return _FAMILIES["default"]
    spec = _FAMILIES.get(pre)
    if spec is None:
        log.warning(
            "unknown pre-tokenizer tokenizer.ggml.pre=%r; using the GPT-2 split, so token ids may differ from the "
            "model's own tokenizer (known: %s)",
            pre,
            ", ".join(SUPPORTED_PRE_TYPES),
        )
        return PreTokenizerSpec(pre, (GPT2,))
    return spec
