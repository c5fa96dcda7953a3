"""Tokenizer.min_tokens: a bound from the text's length alone that never exceeds the tokens it encodes to (the
server refuses a text too long for the context with it, before tokenizing)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.testing.tokenizer_fixture import tiny_bpe_metadata, tiny_spm_metadata
from engine.tokenizer import Tokenizer

TOKENIZERS = [
    Tokenizer.from_metadata(tiny_bpe_metadata()),
    Tokenizer.from_metadata(tiny_spm_metadata()),
    Tokenizer.from_metadata(tiny_spm_metadata(add_space_prefix=False)),
]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</tool_call>", "<s>", "</s>"]
texts = st.lists(
    st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL), st.just(" " * 300)), max_size=12
).map("".join)


@settings(max_examples=300, deadline=None)
@given(texts, st.booleans())
def test_the_bound_never_exceeds_the_tokens(text: str, parse_special: bool) -> None:
    for tok in TOKENIZERS:
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special=False, parse_special=parse_special))


def test_the_bound_grows_with_the_text() -> None:
    tok = TOKENIZERS[0]
    assert tok.min_tokens("") == 0 and tok.min_tokens("x") == 1
    assert tok.min_tokens("word " * 100_000) >= 500_000 // tok.max_token_bytes
