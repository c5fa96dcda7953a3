"""The fit-estimate geometry (installer.recommend.ModelGeometry) of a GGUF file on this PC, read from its header
with the gguf package's reader (torch-free, so the app can price a split across PCs before any engine runs).

Unlike the catalog's estimate from a file size, these are the file's own bytes: each layer's tensors, the routed
experts' stacked tensors divided by the expert count, the head and the token table. Sliding-window and
linear-attention layers are priced as full attention (more KV than the engine keeps: a plan that fits here fits
there)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from installer.library import parts_of
from installer.recommend import ModelGeometry

_BLOCK = re.compile(r"^blk\.(\d+)\.")
_EXPERTS = re.compile(r"\.ffn_(gate|up|down|gate_up)_exps\.")


class GeometryError(ValueError):
    """A file whose header does not describe a model the placement can price; the message says why."""


def file_geometry(path: Path) -> ModelGeometry:
    """The geometry of the model in `path` (every part of a split file). Raises GeometryError on a file that is not
    a readable GGUF model."""
    import gguf

    layer_bytes: dict[int, int] = {}
    expert_bytes: dict[int, int] = {}
    other: dict[str, int] = {}
    meta: dict[str, object] = {}
    for part in parts_of(Path(path)):
        try:
            reader = gguf.GGUFReader(part, "r")
        except (OSError, ValueError) as e:
            raise GeometryError(f"{part.name} is not a readable GGUF file ({e}): download it again") from None
        for key, field in reader.fields.items():
            if not key.startswith("split."):
                meta.setdefault(key, field.contents())
        for t in reader.tensors:
            m = _BLOCK.match(t.name)
            if m is None:
                other[t.name] = other.get(t.name, 0) + int(t.n_bytes)
            elif _EXPERTS.search(t.name):
                i = int(m.group(1))
                expert_bytes[i] = expert_bytes.get(i, 0) + int(t.n_bytes)
            else:
                i = int(m.group(1))
                layer_bytes[i] = layer_bytes.get(i, 0) + int(t.n_bytes)
    arch = str(meta.get("general.architecture") or "")

    def num(key: str, default: int = 0) -> int:
        v = meta.get(f"{arch}.{key}")
        if isinstance(v, list):  # per-layer values (head counts): the largest prices every layer
            v = max((x for x in v if isinstance(x, int)), default=default)
        return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else default

    layers = num("block_count")
    if not arch or layers < 1:
        raise GeometryError(
            f"{Path(path).name} has no architecture or block count in its header: not a model"
        )
    experts = num("expert_count")
    used = num("expert_used_count") if experts else 0
    per_expert = max(expert_bytes.values(), default=0) // experts if experts else 0
    moe = [i for i in range(layers) if expert_bytes.get(i)]
    first_dense = min(moe) if moe else 0
    dense = [layer_bytes.get(i, 0) for i in range(layers)]
    heads = num("attention.head_count", 1)
    kv_heads = num("attention.head_count_kv", heads)
    key_len = num("attention.key_length", num("embedding_length") // max(heads, 1))
    value_len = num("attention.value_length", key_len)
    norm = other.get("output_norm.weight", 0)
    table = other.get("token_embd.weight", 0)
    head = other.get("output.weight", 0)
    return ModelGeometry(
        layers=layers,
        experts=experts if per_expert else 0,
        experts_used=used if per_expert else 0,
        expert_bytes=per_expert,
        dense_bytes_per_layer=math.ceil(sum(dense) / layers),
        kv_bytes_per_token_layer=kv_heads * (key_len + value_len) * 2,
        head_bytes=(head or table) + norm,
        embedding_bytes=table if head else 0,
        first_dense_layers=first_dense if per_expert else 0,
    )
