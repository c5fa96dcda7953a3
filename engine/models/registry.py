"""Which module runs which `general.architecture`."""

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from engine.gguf import names
from engine.gguf.model_config import ModelConfig
from engine.gguf.reader import GGUFFile

# architecture -> module under engine.models (one file per family)
ARCHITECTURES: dict[str, str] = {
    "qwen3moe": "qwen3moe",
    "qwen2moe": "qwen2moe",
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "gpt-oss": "gpt_oss",
    "qwen3next": "qwen3next",
    "deepseek2": "deepseek2",
    "glm4moe": "glm4moe",
}


class UnsupportedArchitecture(ValueError):
    pass


def module_for(arch: str) -> ModuleType:
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return importlib.import_module(f"engine.models.{ARCHITECTURES[arch]}")


def model_class(arch: str) -> type | None:
    """The family's own model class (its module's `MODEL_CLASS`), or None where the shared DecoderLM runs it."""
    return getattr(module_for(arch), "MODEL_CLASS", None)


def config_for(arch: str, metadata: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    return module_for(arch).config_from_metadata(metadata, n_vocab)


def file_config(gf: GGUFFile, tokenizer_vocab: int) -> ModelConfig:
    """The config of a file's model. Its vocabulary is the embedding's rows (files may pad it beyond the tokenizer's);
    a file without the embedding (a shard of later layers) takes the tokenizer's size."""
    embd = gf.tensors.get(names.TOKEN_EMBD)
    return config_for(gf.architecture, gf.metadata, n_vocab=embd.shape[0] if embd else tokenizer_vocab)
