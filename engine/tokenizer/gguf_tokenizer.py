"""A fast tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata, encoding and decoding as llama.cpp does.

The text is cut and merged by a `tokenizers` (Rust) tokenizer assembled here; the surrounding rules are llama.cpp's:

- Control (type 3) and unknown (type 2) tokens written in the text become their single id when `parse_special`;
  user-defined tokens (type 4, e.g. `<think>`) always do. The text between them is tokenized piece by piece.
- `gpt2` (byte-level BPE): each piece is cut by the pre-tokenizer regexes of `tokenizer.ggml.pre`, mapped to the
  byte alphabet and merged by rank with the file's merges.
- `llama` (SentencePiece BPE, Llama/Mistral/Gemma): spaces become "▁"; with `add_space_prefix` every piece (the
  first one and each one after a special token) gets one "▁" in front; no pre-split; pairs merge best score first
  (merges rebuilt from the scores unless the file lists them); characters outside the vocabulary fall back to
  their `<0xXX>` byte tokens.
- BOS/EOS are added by `encode(add_special=True)` when the file (or llama.cpp's default) says so.

`decode` is the exact inverse of `encode` (for SentencePiece with `add_space_prefix` it drops the one "▁" that
encode put in front of each piece). llama.cpp's `detokenize` keeps that space after a BOS and, for some byte-level
families, removes spaces before punctuation ("clean spaces"); we do neither, so that `decode(encode(s)) == s`.
"""

import codecs
import functools
import logging
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer.vocab import TokenAttr, TokenizerError, Vocab, read_vocab

log = logging.getLogger(__name__)

_SPACE = "\u2581"  # SentencePiece's visible space "▁"
_SPECIAL = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)
_MATCHED = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN | TokenAttr.USER_DEFINED)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte -> the byte.
    Printable Latin-1 bytes stand for themselves; the other 68 bytes take the code points from U+0100 up."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_alphabet()


def spm_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """Merges equivalent to llama.cpp's SentencePiece loop: two adjacent pieces merge when their concatenation is a
    token, best score first. Every split of every token into two tokens is a merge, ranked by the score of the
    token it makes (then by id and split position, so the order is total and reproducible)."""
    tokens = vocab.tokens
    ids = vocab.token_to_id
    scores = vocab.scores if vocab.scores is not None else np.zeros(len(tokens), dtype=np.float32)
    best_first = np.lexsort((np.arange(len(tokens)), -scores.astype(np.float64))).tolist()
    out = []
    for t in (tokens[i] for i in best_first):
        for k in range(1, len(t)):
            left = ids.get(t[:k])
            if left is not None and (right := ids.get(t[k:])) is not None:
                # the vocabulary's own strings, not the slices: a 262k vocabulary has 515k merges, whose slices
                # took ~70 MB more at the peak of a load
                out.append((tokens[left], tokens[right]))
    return out


def _file_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """The file's "left right" merges (split at the first space after the first character, as llama.cpp does),
    keeping only those whose two parts and result are tokens: the others can never apply."""
    known = vocab.token_to_id
    out = []
    dropped = 0
    for merge in vocab.merges or ():
        cut = merge.find(" ", 1)
        if cut < 0:
            dropped += 1
            continue
        left, right = merge[:cut], merge[cut + 1 :]
        if left in known and right in known and left + right in known:
            out.append((left, right))
        else:
            dropped += 1
    if dropped:
        log.warning(
            "ignored %d of %d tokenizer merges whose parts are not in the vocabulary",
            dropped,
            len(vocab.merges or ()),
        )
    return out


def _build_backend(vocab: Vocab) -> HFTokenizer:
    ranked = vocab.token_to_id
    if vocab.model == "gpt2":
        assert vocab.pre is not None
        backend = HFTokenizer(
            models.BPE(vocab=ranked, merges=_file_merges(vocab), ignore_merges=vocab.pre.ignore_merges)
        )
        splits: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(r), behavior="isolated") for r in vocab.pre.regexes
        ]
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
        backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
        backend.decoder = decoders.ByteLevel()
    else:
        merges = _file_merges(vocab) if vocab.merges else spm_merges(vocab)
        unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
        backend = HFTokenizer(models.BPE(vocab=ranked, merges=merges, byte_fallback=True, unk_token=unk))
        steps: list[normalizers.Normalizer] = []
        if vocab.add_space_prefix:
            # Prepend runs on each piece between added tokens: llama.cpp's "space after a special token" rule.
            steps.append(normalizers.Prepend(_SPACE))
        steps.append(normalizers.Replace(" ", _SPACE))
        backend.normalizer = normalizers.Sequence(steps)
        backend.decoder = decoders.Sequence(
            [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )

    special = np.nonzero(vocab.attrs & _SPECIAL)[0].tolist()
    user = np.nonzero(((vocab.attrs & int(TokenAttr.USER_DEFINED)) != 0) & ((vocab.attrs & _SPECIAL) == 0))[
        0
    ].tolist()
    if special:
        backend.add_special_tokens(
            [AddedToken(vocab.tokens[i], special=True, normalized=False) for i in special]
        )
    if user:
        backend.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False) for i in user])
    return backend


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # the reader keeps invalid bytes as surrogates
        return False
    return True


class Tokenizer:
    """Encode/decode with a GGUF file's vocabulary. Build it with `Tokenizer.from_metadata(meta)`."""

    def __init__(self, vocab: Vocab, backend: HFTokenizer) -> None:
        self._vocab = vocab
        self._backend = backend
        self._lock = threading.Lock()
        self._attrs: list[int] = vocab.attrs.tolist()
        self._pieces: list[bytes | None] = [None] * len(vocab.tokens)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], source: str | None = None) -> "Tokenizer":
        """Build from the `tokenizer.*` metadata of a GGUF file; `source` (the file name) is named in errors."""
        vocab = read_vocab(meta, source)
        try:
            backend = _build_backend(vocab)
        except Exception as e:  # tokenizers reports inconsistent vocabularies as plain Exceptions
            where = f" in {source}" if source else ""
            bad = next((i for i, t in enumerate(vocab.tokens) if not _utf8(t)), None)
            why = f"token {bad} is not valid UTF-8" if bad is not None else " ".join(str(e).split())[:300]
            raise TokenizerError(
                f"the tokenizer{where} could not be built: {why}; re-convert the model"
            ) from e
        return cls(vocab, backend)

    # --- facts -----------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._vocab.tokens)

    @property
    def model(self) -> str:
        """ "gpt2" (byte-level BPE) or "llama" (SentencePiece)."""
        return self._vocab.model

    @property
    def pre(self) -> str | None:
        """The pre-tokenizer family in use (byte-level BPE only)."""
        return self._vocab.pre.name if self._vocab.pre else None

    @property
    def bos_id(self) -> int | None:
        return self._vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._vocab.eos_id

    @property
    def eot_id(self) -> int | None:
        return self._vocab.eot_id

    @property
    def eom_id(self) -> int | None:
        return self._vocab.eom_id

    @property
    def unk_id(self) -> int | None:
        return self._vocab.unk_id

    @property
    def pad_id(self) -> int | None:
        return self._vocab.pad_id

    @property
    def add_bos(self) -> bool:
        return self._vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self._vocab.add_eos

    @property
    def add_space_prefix(self) -> bool:
        return self._vocab.add_space_prefix

    @property
    def eog_ids(self) -> frozenset[int]:
        """Tokens that end a generation (EOS, end-of-turn, `<|im_end|>`, `<end_of_turn>`, ...)."""
        return self._vocab.eog_ids

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying `tokenizers` object (control tokens parsed), e.g. for batch encoding."""
        return self._backend

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._vocab.eog_ids

    def is_special(self, token_id: int) -> bool:
        """Control and unknown tokens: hidden by `decode(skip_special=True)`, matched only with `parse_special`."""
        return bool(self._attrs[self._check(token_id)] & _SPECIAL)

    def token_attr(self, token_id: int) -> TokenAttr:
        return TokenAttr(self._attrs[self._check(token_id)])

    def token_text(self, token_id: int) -> str:
        """The token as the file spells it (byte-level or "▁" form)."""
        return self._vocab.tokens[self._check(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled exactly `text` in the file, if any."""
        return self._vocab.token_to_id.get(text)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any token's text has: no token covers more bytes of a text than that (a byte-level
        token's characters stand for one byte each, a SentencePiece "▁" for one space, a special token for its own
        spelling)."""
        return max((len(t.encode("utf-8")) for t in self._vocab.tokens), default=1) or 1

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, from its length alone (no tokenizing): a text too long
        for the context is refused before the tokenizer spends seconds on it."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    # --- encode ----------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. `add_special` adds BOS/EOS where the vocabulary asks for them; `parse_special`
        turns control tokens written in the text (`<|im_start|>`) into their ids (user-defined ones always are)."""
        ids: list[int] = []
        if text:
            # The flag lives on the shared backend; the lock keeps a concurrent call from seeing it flipped
            # (encode holds the GIL, so this costs no parallelism).
            with self._lock:
                if not parse_special:
                    self._backend.encode_special_tokens = True
                try:
                    ids = self._backend.encode(text, add_special_tokens=False).ids
                finally:
                    self._backend.encode_special_tokens = False
        if add_special:
            v = self._vocab
            if v.add_bos and v.bos_id is not None:
                ids.insert(0, v.bos_id)
            if v.add_eos and v.eos_id is not None:
                ids.append(v.eos_id)
        return ids

    # --- decode ----------------------------------------------------------------------------------------------

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._attrs):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{len(self._attrs) - 1})")
        return token_id

    def _piece(self, token_id: int) -> bytes:
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._render(token_id)
            self._pieces[token_id] = piece
        return piece

    def _render(self, token_id: int) -> bytes:
        text = self._vocab.tokens[token_id]
        attr = self._attrs[token_id]
        if attr & _MATCHED:
            return text.encode("utf-8")
        if attr & TokenAttr.NORMAL:
            if self._vocab.model == "llama":
                return text.replace(_SPACE, " ").encode("utf-8")
            # Characters outside the byte alphabet only occur in mislabeled tokens; keep them as UTF-8.
            return b"".join(
                bytes((_BYTE_OF_CHAR[c],)) if c in _BYTE_OF_CHAR else c.encode("utf-8") for c in text
            )
        if attr & TokenAttr.BYTE:
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                return bytes((int(text[3:5], 16),))
            return text.encode("utf-8")
        return b""  # unused / undefined tokens render as nothing, as in llama.cpp

    def token_to_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes a token stands for; control/unknown tokens give their text only when `special`."""
        if not special and self._attrs[self._check(token_id)] & _SPECIAL:
            return b""
        return self._piece(self._check(token_id))

    def token_to_piece(self, token_id: int, special: bool = True) -> str:
        """`token_to_bytes` as text; a token holding part of a UTF-8 character shows as U+FFFD."""
        return self.token_to_bytes(token_id, special).decode("utf-8", "replace")

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`; control/unknown tokens are written out unless `skip_special`."""
        out = bytearray()
        spm_prefix = self._vocab.model == "llama" and self._vocab.add_space_prefix
        strip = spm_prefix  # encode put one "▁" at the start and after every matched token
        for token_id in ids:
            attr = self._attrs[self._check(token_id)]
            if attr & _MATCHED:
                if not (skip_special and attr & _SPECIAL):
                    out += self._piece(token_id)
                strip = spm_prefix
                continue
            piece = self._piece(token_id)
            if strip and piece:
                if piece[:1] == b" ":
                    piece = piece[1:]
                strip = False
            out += piece
        return out.decode("utf-8", "replace")

    def stream_decoder(self, skip_special: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Turns generated token ids into text as they arrive. A token that ends inside a multi-byte UTF-8 character
    yields nothing until the character is complete; invalid bytes become U+FFFD. Control tokens yield nothing
    unless `skip_special=False`. No space is stripped (generated text continues a prompt)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        """The text completed by this token ("" while a character is still incomplete)."""
        return self._utf8.decode(self._tokenizer.token_to_bytes(token_id, self._special))

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    @property
    def pending(self) -> bytes:
        """Bytes held back because they start an incomplete character."""
        return self._utf8.getstate()[0]

    def flush(self) -> str:
        """End of stream: whatever is held back, as U+FFFD if it never completed."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
