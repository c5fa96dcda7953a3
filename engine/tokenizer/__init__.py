"""Tokenizer and chat template from a GGUF file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""

from engine.tokenizer.chat_template import (
    FALLBACK_TEMPLATE,
    ChatFormatter,
    ChatTemplateError,
    ChatTemplateSecurityError,
    render_chat,
)
from engine.tokenizer.gguf_tokenizer import StreamDecoder, Tokenizer
from engine.tokenizer.pretokenizers import SUPPORTED_PRE_TYPES
from engine.tokenizer.vocab import TokenAttr, TokenizerError

__all__ = [
    "FALLBACK_TEMPLATE",
    "SUPPORTED_PRE_TYPES",
    "ChatFormatter",
    "ChatTemplateError",
    "ChatTemplateSecurityError",
    "StreamDecoder",
    "TokenAttr",
    "Tokenizer",
    "TokenizerError",
    "render_chat",
]
