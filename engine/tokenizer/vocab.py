"""The vocabulary a GGUF file describes under `tokenizer.ggml.*`, read into plain data with llama.cpp's rules:
token attributes from the token types, default and explicit special token ids, the BOS/EOS flags and the set of
tokens that end a generation.

Only metadata is read here (a `dict[str, Any]` as the GGUF reader gives it); building the fast tokenizer from it
is `engine.tokenizer.gguf_tokenizer`.
"""

import logging
from dataclasses import dataclass
from enum import IntFlag
from typing import Any

import numpy as np
from gguf import Keys, TokenType

from engine.tokenizer.pretokenizers import PreTokenizerSpec, pre_tokenizer_spec

log = logging.getLogger(__name__)

K = Keys.Tokenizer

SUPPORTED_MODELS = ("gpt2", "llama")


class TokenizerError(ValueError):
    """The file's tokenizer metadata cannot be used; the message names the key and what to do."""


class TokenAttr(IntFlag):
    """Per-token attributes, as llama.cpp derives them from `tokenizer.ggml.token_type`."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


# token_type value -> attribute; anything outside 1..6 is UNDEFINED (never matched, decoded as nothing).
_TYPE_TO_ATTR = np.zeros(8, dtype=np.int32)
_TYPE_TO_ATTR[TokenType.NORMAL] = TokenAttr.NORMAL
_TYPE_TO_ATTR[TokenType.UNKNOWN] = TokenAttr.UNKNOWN
_TYPE_TO_ATTR[TokenType.CONTROL] = TokenAttr.CONTROL
_TYPE_TO_ATTR[TokenType.USER_DEFINED] = TokenAttr.USER_DEFINED
_TYPE_TO_ATTR[TokenType.UNUSED] = TokenAttr.UNUSED
_TYPE_TO_ATTR[TokenType.BYTE] = TokenAttr.BYTE

# Texts llama.cpp recognises when the file names no id (first listed wins here; llama.cpp's pick among several
# present is unordered, and <|im_end|> before <|endoftext|> is the one chat models need).
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
# Every token with one of these texts ends a generation.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
# gpt-oss (harmony) markers that llama.cpp always renders and always matches as text.
_HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass
class Vocab:
    """Everything the tokenizer needs from the file, checked and with llama.cpp's defaults applied."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)
    pre: PreTokenizerSpec | None  # byte-level BPE only
    tokens: list[str]
    attrs: np.ndarray  # [V] int32 TokenAttr bits
    scores: np.ndarray | None  # [V] float32, SentencePiece only
    merges: list[str] | None
    token_to_id: dict[str, int]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: frozenset[int]


def _where(source: str | None) -> str:
    return f" in {source}" if source else ""


def _as_list(value: Any) -> list[Any]:
    return value.tolist() if isinstance(value, np.ndarray) else list(value)


def _first_present(token_to_id: dict[str, int], texts: tuple[str, ...]) -> int | None:
    for text in texts:
        if text in token_to_id:
            return token_to_id[text]
    return None


def read_vocab(meta: dict[str, Any], source: str | None = None) -> Vocab:
    """Read and check `tokenizer.ggml.*` from `meta`; `source` (the file name) goes into error messages."""
    where = _where(source)
    model = meta.get(K.MODEL)
    if model is None:
        raise TokenizerError(
            f"no tokenizer{where}: key {K.MODEL} is missing; use a GGUF file that embeds its vocabulary"
        )
    if model not in SUPPORTED_MODELS:
        raise TokenizerError(
            f"tokenizer type {K.MODEL}={model!r}{where} is not supported (supported: {', '.join(SUPPORTED_MODELS)})"
        )
    raw_tokens = meta.get(K.LIST)
    if raw_tokens is None or len(raw_tokens) == 0:
        raise TokenizerError(
            f"key {K.LIST} is missing or empty{where}; the file has no vocabulary to tokenize with"
        )
    tokens = [
        t.decode("utf-8", "replace") if isinstance(t, bytes | bytearray) else str(t) for t in raw_tokens
    ]
    n = len(tokens)
    for i, t in enumerate(tokens):
        if not t:  # llama.cpp's placeholder, so the id stays addressable
            tokens[i] = f"[EMPTY_{i}]"

    token_to_id = {t: i for i, t in enumerate(tokens)}
    if len(token_to_id) != n:
        seen: set[str] = set()
        dup = ""
        for t in tokens:
            if t in seen:
                dup = t
                break
            seen.add(t)
        raise TokenizerError(
            f"{K.LIST}{where} lists token {dup!r} more than once; expected unique tokens - re-convert the model"
        )

    types = meta.get(K.TOKEN_TYPE)
    if types is None:
        attrs = np.full(n, int(TokenAttr.NORMAL), dtype=np.int32)
    else:
        types_arr = np.asarray(types, dtype=np.int64)
        if types_arr.shape[0] < n:
            raise TokenizerError(
                f"{K.TOKEN_TYPE}{where} has {types_arr.shape[0]} entries for {n} tokens; expected one per token"
            )
        types_arr = types_arr[:n]
        attrs = np.where((types_arr >= 0) & (types_arr < 8), _TYPE_TO_ATTR[np.clip(types_arr, 0, 7)], 0)
        attrs = attrs.astype(np.int32)

    scores = None
    if meta.get(K.SCORES) is not None:
        scores = np.asarray(meta[K.SCORES], dtype=np.float32)
        if scores.shape[0] < n:
            raise TokenizerError(
                f"{K.SCORES}{where} has {scores.shape[0]} entries for {n} tokens; expected one per token"
            )
        scores = scores[:n]

    merges = _as_list(meta[K.MERGES]) if meta.get(K.MERGES) is not None else None
    pre = None
    if model == "gpt2":
        if not merges:
            raise TokenizerError(
                f"key {K.MERGES} is missing{where}; a byte-level BPE vocabulary needs its merges - re-convert the model"
            )
        pre = pre_tokenizer_spec(meta.get(K.PRE))

    # llama.cpp's defaults, then the file's keys.
    if model == "llama":
        bos, eos, unk = 1, 2, 0
        add_bos, add_space_prefix = True, True
    else:
        assert pre is not None
        bos, eos, unk = (None if pre.no_bos else 11), 11, None
        add_bos, add_space_prefix = pre.add_bos, False
    ids: dict[str, int | None] = {"bos": bos, "eos": eos, "unk": unk, "eot": None, "eom": None, "pad": None}
    ids = {k: (v if v is not None and v < n else None) for k, v in ids.items()}
    fim: dict[str, int | None] = {"pad": None, "rep": None, "sep": None}
    for name, key in (
        ("bos", K.BOS_ID),
        ("eos", K.EOS_ID),
        ("eot", K.EOT_ID),
        ("eom", K.EOM_ID),
        ("unk", K.UNK_ID),
        ("pad", K.PAD_ID),
    ):
        if meta.get(key) is not None:
            value = int(meta[key])
            if 0 <= value < n:
                ids[name] = value
            else:
                log.warning(
                    "%s=%d%s is outside the vocabulary (%d tokens); ignoring it", key, value, where, n
                )
    for name, key in (("pad", K.FIM_PAD_ID), ("rep", K.FIM_REP_ID), ("sep", K.FIM_SEP_ID)):
        if meta.get(key) is not None and 0 <= int(meta[key]) < n:
            fim[name] = int(meta[key])
    if meta.get(K.ADD_BOS) is not None:
        add_bos = bool(meta[K.ADD_BOS])
    add_eos = bool(meta[K.ADD_EOS]) if meta.get(K.ADD_EOS) is not None else False
    if meta.get(K.ADD_PREFIX) is not None and model == "llama":
        add_space_prefix = bool(meta[K.ADD_PREFIX])

    def control(token_id: int | None) -> None:
        # llama.cpp promotes end-of-turn looking tokens to control, so they are matched and hidden as specials.
        if token_id is not None and not attrs[token_id] & TokenAttr.CONTROL:
            log.warning(
                "token %d %r%s is on llama.cpp's list of control tokens but is not typed as one; treating it as control",
                token_id,
                tokens[token_id],
                where,
            )
            attrs[token_id] |= TokenAttr.CONTROL

    if ids["eot"] is None:
        ids["eot"] = _first_present(token_to_id, _EOT_TEXTS)
    if ids["eom"] is None:
        ids["eom"] = _first_present(token_to_id, _EOM_TEXTS)
    if fim["pad"] is None:
        fim["pad"] = _first_present(token_to_id, _FIM_PAD_TEXTS)
    if fim["rep"] is None:
        fim["rep"] = _first_present(token_to_id, _FIM_REP_TEXTS)
    if fim["sep"] is None:
        fim["sep"] = _first_present(token_to_id, _FIM_SEP_TEXTS)
    for token_id in (ids["eot"], ids["eom"], *fim.values()):
        control(token_id)

    eog = {i for i in fim.values() if i is not None}
    for text in _EOG_TEXTS:
        token_id = token_to_id.get(text)
        if token_id is not None:
            eog.add(token_id)
            control(token_id)
    for text in _HARMONY_MARKERS:
        if text in token_to_id:
            attrs[token_to_id[text]] = TokenAttr.USER_DEFINED
    eog.update(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None)

    eog_texts = {tokens[i] for i in eog}
    # harmony / solar-open: "<|end|>" closes a message there, not the generation.
    has_call = bool(eog_texts & {"<|call|>", "<|calls|>"})
    if "<|end|>" in eog_texts and has_call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
        end_id = token_to_id["<|end|>"]
        eog.discard(end_id)
        attrs[end_id] = TokenAttr.USER_DEFINED
    # gemma4 / plamo: "</s>" is an ordinary token there.
    if "</s>" in eog_texts and eog_texts & {"<|tool_response>", "<|plamo:eos|>"}:
        s_id = token_to_id["</s>"]
        eog.discard(s_id)
        attrs[s_id] = TokenAttr.NORMAL

    return Vocab(
        model=model,
        pre=pre,
        tokens=tokens,
        attrs=attrs,
        scores=scores,
        merges=merges,
        token_to_id=token_to_id,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        eot_id=ids["eot"],
        eom_id=ids["eom"],
        unk_id=ids["unk"],
        pad_id=ids["pad"],
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        eog_ids=frozenset(eog),
    )
