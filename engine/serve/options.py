"""The server's options as the server takes them (built once by engine/serve/cli.py from the engine's options,
installer/engine_options.py, whose defaults these are) and the model's id as clients name it."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from installer.engine_options import D

if TYPE_CHECKING:
    from engine.pipeline.split import SplitOptions

_SPLIT_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")


def model_id(file_name: str) -> str:
    """`Qwen3-30B-A3B-Q4_K_M-00001-of-00002.gguf` -> `Qwen3-30B-A3B-Q4_K_M`."""
    stem = file_name[: -len(".gguf")] if file_name.lower().endswith(".gguf") else file_name
    return _SPLIT_SUFFIX.sub("", stem)


@dataclass(frozen=True)
class ServeOptions:
    model: Path | None = None  # None: the embedded default model
    device: str = D.device
    dtype: str = D.dtype
    kv: str = D.kv
    max_context: int = D.max_context
    prefill: int | None = None  # prompt chunk in tokens; None: --prefill auto (split.prefill_chunk)
    prompt_cache_mib: int = D.prompt_cache_mib
    max_queue: int = D.max_queue
    parallel: int | None = (
        D.parallel
    )  # slots decoded together; None: auto (installer.placement.auto_parallel)
    batch_groups: int | None = None  # groups of slots pipelined through a remote stage; None: auto
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = int(D.max_body_mib * (1 << 20))
    threads: int = D.threads  # torch intra-op threads; 0: torch's default
    spec: int = D.spec  # --spec N: drafted tokens per verify window (engine/pipeline/spec.py)
    suffix_draft: bool = bool(D.suffix_draft)  # --suffix-draft: drafts copied from earlier context
    mtp: str = D.mtp  # --mtp auto|1|0: drafts from the model's own draft layer
    pipeline_windows: int = D.pipeline_windows  # --pipeline-windows 2 (a layer split only)
    split: "SplitOptions | None" = None  # the layer-split flags; None: the whole model on `device`
    profile_every_s: float = (
        D.profile_every
    )  # --profile-every: save the usage profile this often (and at shutdown)
