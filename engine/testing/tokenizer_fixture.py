"""Tiny, deterministic tokenizer vocabularies for tests: the `tokenizer.*` metadata of a GGUF file.

- `tiny_bpe_metadata`: a byte-level BPE (`tokenizer.ggml.model = "gpt2"`) trained with `tokenizers` on a built-in
  English + code + Unicode text, cut by the regexes of the `pre` it declares, with Qwen-style control tokens, the
  user-defined `<think>`/`</think>`/`<tool_call>`/`</tool_call>` and a ChatML chat template (tools, `enable_thinking`).
- `tiny_spm_metadata`: a SentencePiece-style BPE (`"llama"`): `<unk>`, `<s>`, `</s>`, the 256 byte tokens, two
  turn markers, then pieces with scores, best first. Rare characters are left out of the alphabet so that they
  exercise the byte fallback.
- `write_tokenizer`: adds such metadata to a `gguf.GGUFWriter` with the value types llama.cpp expects.

The training text is fixed and `tokenizers`' BPE trainer is deterministic, so each call with the same arguments
returns the same vocabulary; `seed` varies the word counts (and so the merges) reproducibly.
"""

import json
import random
from collections import Counter
from functools import lru_cache
from typing import Any

import gguf
import numpy as np
from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer.pretokenizers import pre_tokenizer_spec

K = gguf.Keys.Tokenizer

_CORPUS = r"""
The quick brown fox jumps over the lazy dog. The dog didn't care; it's been a long day, and we'll rest soon.
A mixture of experts routes each token to a few experts out of many, so most weights stay idle at every step.
She said: "Don't panic!" -- then counted 1, 2, 3, 12, 123, 1234, 12345 and 3.14159 before 2025-01-31 at 09:30.
Prices rose 4.5% to $1,299.99 (about EUR 1.200); the report (page 17, line 42) calls it "unusual".
When the GPU runs out of memory, the layers that do not fit are kept in host RAM and copied on demand.
Hello world! Hello, World? HELLO WORLD... hello   world	tabs	and  double  spaces  too.
  Indented line with leading spaces.
Multiple

blank lines


and trailing spaces.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"{i:>3} -> {fibonacci(i)}")  # comment with symbols: <>, [], {}, ==, !=, ->, **, //

class Cache(dict):
    def __missing__(self, key):
        value = self[key] = len(key) * 2
        return value

const add = (a, b) => a + b; let xs = [1, 2, 3].map(x => x * x); console.log(`sum=${xs.reduce(add, 0)}`);
#include <stdio.h>
int main(void) { printf("%d\n", 42); return 0; }
SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;
{"model": "tiny", "layers": [0, 1, 2], "ok": true, "ratio": 0.75, "name": null}
<div class="note">Tags &amp; entities &lt;b&gt; stay as text.</div>
Café, naïve, résumé, coöperate, façade, jalapeño, Straße, smørrebrød, Ångström, ÉCOLE, école.
Привет, мир! Как дела? Это тест токенизатора.
Γειά σου κόσμε· αυτό είναι ένα τεστ.
日本語のテキストも少し入れます。東京は大きい都市です。ひらがなとカタカナ。
中文文本：你好，世界！机器学习模型需要分词器。
한국어 문장도 있습니다. 안녕하세요!
مرحبا بالعالم، هذا اختبار.
नमस्ते दुनिया, यह एक परीक्षण है।
Emoji: 🙂 😀 🚀 👍🏽 👨‍👩‍👧 ❤️ ✨ 🤖 and symbols ≤ ≥ ≠ ∑ ∞ → ← © ® ™ € £ ¥.
Numbers in a row: 0 1 2 3 4 5 6 7 8 9 10 100 1000 10000 100000 1000000 007 0x1F 1e-9 -12.5 +7.
It's, I'm, you're, they've, we'd, she'll, IT'S, I'M, YOU'RE.
"""

_TRAILING = (
    "trailing spaces and tabs   \t\n"  # kept out of the raw string above, where an editor would strip them
)

_BPE_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_BPE_USER = ("<think>", "</think>", "<tool_call>", "</tool_call>")
_SPM_CONTROL = ("<start_of_turn>", "<end_of_turn>")
_SPM_USER = ("<br>",)
_SPACE = "\u2581"
_SPM_ALPHABET = 96

# A ChatML template in the style of Qwen3: an optional system turn (with a tools section when tools are given),
# assistant turns with their reasoning in <think> and tool calls in <tool_call>, tool results as user turns, and
# an empty <think></think> in the generation prompt when enable_thinking is false.
CHATML_TOOLS_TEMPLATE = (
    "{%- set first = 1 if messages and messages[0]['role'] == 'system' else 0 -%}\n"
    "{%- if first or tools -%}\n"
    "{{- '<|im_start|>system\\n' -}}\n"
    "{%- if first -%}{{- messages[0]['content'] -}}{%- endif -%}\n"
    "{%- if tools -%}\n"
    "{%- if first -%}{{- '\\n\\n' -}}{%- endif -%}\n"
    "{{- '# Tools\\nFunctions you may call, one JSON schema per line:\\n<tools>' -}}\n"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}\n"
    '{{- \'\\n</tools>\\nTo call one, answer with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.\' -}}\n'
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages[first:] -%}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if message.get('reasoning_content') -%}\n"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- message['content'] or '' -}}\n"
    "{%- for call in message.get('tool_calls') or [] -%}\n"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}\n"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}\n"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args + '}\\n</tool_call>' -}}\n"
    "{%- endfor -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- elif message['role'] == 'tool' -%}\n"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}\n"
    "{%- else -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}\n"
    "{%- endif -%}"
)


def _lines(seed: int) -> list[str]:
    """The corpus lines with their newlines, each repeated 1-3 times as `seed` decides, in a fixed order."""
    rng = random.Random(seed)
    lines = (_CORPUS + _TRAILING).splitlines(keepends=True)
    return [line for line in lines for _ in range(1 + rng.randrange(3))]


def _trained_merges(tokenizer: HFTokenizer) -> list[tuple[str, str]]:
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]  # type: ignore[misc]


@lru_cache(maxsize=16)
def _bpe(seed: int, vocab_size: int, pre: str) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    spec = pre_tokenizer_spec(pre)
    tokenizer = HFTokenizer(models.BPE())
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), "isolated") for r in spec.regexes
    ]
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits)
    extra = len(_BPE_CONTROL) + len(_BPE_USER)
    if vocab_size < 256 + extra + 1:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE; expected at least {257 + extra}"
        )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - extra,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_lines(seed), trainer)
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id] + list(_BPE_CONTROL) + list(_BPE_USER)
    types = [gguf.TokenType.NORMAL] * len(by_id)
    types += [gguf.TokenType.CONTROL] * len(_BPE_CONTROL) + [gguf.TokenType.USER_DEFINED] * len(_BPE_USER)
    merges = [f"{a} {b}" for a, b in _trained_merges(tokenizer)]
    return tuple(tokens), tuple(int(t) for t in types), tuple(merges)


def tiny_bpe_metadata(seed: int = 0, vocab_size: int = 512, pre: str = "qwen2") -> dict[str, Any]:
    """`tokenizer.*` metadata of a tiny byte-level BPE (Qwen-like: BOS `<|endoftext|>` not added, EOS `<|im_end|>`)."""
    tokens, types, merges = _bpe(seed, vocab_size, pre)
    index = {t: i for i, t in enumerate(tokens)}
    return {
        K.MODEL: "gpt2",
        K.PRE: pre,
        K.LIST: list(tokens),
        K.TOKEN_TYPE: np.asarray(types, dtype=np.int32),
        K.MERGES: list(merges),
        K.BOS_ID: index["<|endoftext|>"],
        K.EOS_ID: index["<|im_end|>"],
        K.PAD_ID: index["<|endoftext|>"],
        K.ADD_BOS: False,
        K.CHAT_TEMPLATE: CHATML_TOOLS_TEMPLATE,
    }


@lru_cache(maxsize=16)
def _spm(seed: int, vocab_size: int) -> tuple[tuple[str, ...], tuple[float, ...], tuple[int, ...]]:
    head = (
        ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(_SPM_CONTROL) + list(_SPM_USER)
    )
    head_types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    head_types += [gguf.TokenType.BYTE] * 256
    head_types += [gguf.TokenType.CONTROL] * len(_SPM_CONTROL) + [gguf.TokenType.USER_DEFINED] * len(
        _SPM_USER
    )
    if vocab_size < len(head) + 64:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for the SPM fixture; expected at least {len(head) + 64}"
        )

    lines = _lines(seed)
    # The most frequent characters (ties by code point) form the alphabet; the rest is left to the byte tokens.
    counts = Counter(c for line in lines for c in line.replace(" ", _SPACE))
    alphabet = sorted(sorted(counts, key=lambda c: (-counts[c], c))[:_SPM_ALPHABET])
    kept = set(alphabet) | {" "}
    tokenizer = HFTokenizer(models.BPE())
    # SentencePiece cuts at spaces, each word keeping its "▁"; pieces never cross a word boundary.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="always", split=True
    )
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(head), min_frequency=1, show_progress=False)
    tokenizer.train_from_iterator(["".join(c if c in kept else " " for c in line) for line in lines], trainer)
    merged = [a + b for a, b in _trained_merges(tokenizer)]
    # SentencePiece BPE order: pieces in the order they were merged (best score first), then single characters.
    pieces = list(dict.fromkeys(merged)) + [c for c in alphabet if c not in head]
    tokens = head + pieces
    scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))]
    types = head_types + [gguf.TokenType.NORMAL] * len(pieces)
    return tuple(tokens), tuple(scores), tuple(int(t) for t in types)


def tiny_spm_metadata(seed: int = 0, vocab_size: int = 640, add_space_prefix: bool = True) -> dict[str, Any]:
    """`tokenizer.*` metadata of a tiny SentencePiece-style vocabulary (Llama-like: BOS added, space prefix)."""
    tokens, scores, types = _spm(seed, vocab_size)
    return {
        K.MODEL: "llama",
        K.PRE: "default",
        K.LIST: list(tokens),
        K.SCORES: np.asarray(scores, dtype=np.float32),
        K.TOKEN_TYPE: np.asarray(types, dtype=np.int32),
        K.UNK_ID: 0,
        K.BOS_ID: 1,
        K.EOS_ID: 2,
        K.ADD_BOS: True,
        K.ADD_EOS: False,
        K.ADD_PREFIX: add_space_prefix,
    }


_ID_KEYS = {
    K.BOS_ID: "add_bos_token_id",
    K.EOS_ID: "add_eos_token_id",
    K.EOT_ID: "add_eot_token_id",
    K.EOM_ID: "add_eom_token_id",
    K.UNK_ID: "add_unk_token_id",
    K.SEP_ID: "add_sep_token_id",
    K.PAD_ID: "add_pad_token_id",
    K.MASK_ID: "add_mask_token_id",
}
_FLAG_KEYS = {K.ADD_BOS: "add_add_bos_token", K.ADD_EOS: "add_add_eos_token", K.ADD_SEP: "add_add_sep_token"}


def _as_list(value: Any) -> list[Any]:
    return value.tolist() if isinstance(value, np.ndarray) else list(value)


def write_tokenizer(writer: gguf.GGUFWriter, meta: dict[str, Any]) -> None:
    """Add `meta` (as returned above, or read from a file) to `writer`: strings as strings, ids as uint32, flags as
    bools, token types as int32 and scores as float32 arrays, as llama.cpp reads them."""
    for key, value in meta.items():
        if key == K.MODEL:
            writer.add_tokenizer_model(value)
        elif key == K.PRE:
            writer.add_tokenizer_pre(value)
        elif key == K.LIST:
            writer.add_token_list(_as_list(value))
        elif key == K.TOKEN_TYPE:
            writer.add_token_types([int(t) for t in _as_list(value)])
        elif key == K.SCORES:
            writer.add_token_scores([float(s) for s in _as_list(value)])
        elif key == K.MERGES:
            writer.add_token_merges(_as_list(value))
        elif key == K.CHAT_TEMPLATE:
            writer.add_chat_template(value)
        elif key in _ID_KEYS:
            getattr(writer, _ID_KEYS[key])(int(value))
        elif key in _FLAG_KEYS:
            getattr(writer, _FLAG_KEYS[key])(bool(value))
        elif isinstance(value, bool | np.bool_):
            writer.add_bool(key, bool(value))
        elif isinstance(value, int | np.integer):
            (writer.add_uint32 if value >= 0 else writer.add_int32)(key, int(value))
        elif isinstance(value, float | np.floating):
            writer.add_float32(key, float(value))
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list | tuple | np.ndarray):
            writer.add_array(key, _as_list(value))
        else:
            raise TypeError(
                f"metadata key {key!r} has a value of type {type(value).__name__}; expected str, number, bool or array"
            )
