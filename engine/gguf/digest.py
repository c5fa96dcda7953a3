"""Fingerprints of a GGUF model: which model a file (or a shard of it) holds, and whether two files' weights agree.
Used to pair a stage with its worker and a usage profile with its file."""

import hashlib

from engine.gguf.reader import GGUFFile, block_index

_SAMPLE = 4096


def header_digest(gf: GGUFFile) -> str:
    """sha256 of what every file holding part of one model shares: its metadata (minus the `split.*` keys of
    multi-part files) and the name, block type and shape of its tensors outside the blocks. The whole file and a
    shard the node agent ships (its own tensor table, only some blocks) give the same value; the blocks' own
    weights are compared by `data_digest` over each stage's range."""
    h = hashlib.sha256()
    for key in sorted(gf.metadata):
        if key.startswith("split."):
            continue
        value = gf.metadata[key]
        h.update(key.encode() + b"\0")
        h.update(value.tobytes() if hasattr(value, "tobytes") else repr(value).encode())
        h.update(b"\n")
    for name in sorted(gf.tensors):
        if block_index(name) is None:
            t = gf.tensors[name]
            h.update(f"{name}\0{int(t.qtype)}\0{','.join(map(str, t.shape))}\n".encode())
    return h.hexdigest()


def data_digest(gf: GGUFFile, begin: int, end: int) -> str:
    """A digest of samples (start, middle, end) of every tensor of layers [begin, end): cheap to compute on a mapped
    file, and it tells two files with equal headers but other weights apart."""
    h = hashlib.sha256()
    for name in gf.tensor_names_for_layers(begin, end):
        flat = gf.tensor_bytes(name).reshape(-1)
        n = flat.numel()
        h.update(name.encode())
        for at in sorted({0, max(0, n // 2 - _SAMPLE // 2), max(0, n - _SAMPLE)}):
            h.update(flat[at : at + _SAMPLE].numpy().tobytes())
    return h.hexdigest()
