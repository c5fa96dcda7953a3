"""The layer shard (a valid GGUF with only what a stage needs) and shipping it: resumable, verified."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.gguf.reader import GGUFFile
from engine.models.decoder import DecoderLM
from engine.models.registry import config_for
from engine.node.agent import Agent
from engine.node.client import NodeClient, NodeError
from engine.node.shard import ShardLayout
from engine.node.shipper import ship
from engine.testing.tiny_models import write_tiny_model
from tests.engine.node.conftest import AgentProc, free_port, pair_with

N_LAYER = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("ship") / "tiny-moe.gguf", "qwen3moe", qtype="Q8_0", n_layer=N_LAYER, seed=3
    )


def _fields(reader: gguf.GGUFReader) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = [bytes(p.tobytes()) for p in f.parts[f.data[0] :]] if f.data else []
    return out


def test_shard_is_a_gguf_with_only_its_layers(model: Path, tmp_path: Path) -> None:
    layout = ShardLayout(model, 2, 4)
    out = layout.write(tmp_path / layout.default_name())
    assert out.name == "tiny-moe.L2-4.gguf" and out.stat().st_size == layout.size
    src, got = (
        gguf.GGUFReader(str(model)),
        gguf.GGUFReader(str(out)),
    )  # the gguf package as the reference reader
    src_t = {t.name: t for t in src.tensors}
    names = [t.name for t in got.tensors]
    assert not any(n.startswith(("blk.0.", "blk.1.")) for n in names)
    expected = [n for n in src_t if not n.startswith("blk.") or n.split(".")[1] in ("2", "3")]
    assert sorted(names) == sorted(expected)
    for t in got.tensors:
        ref = src_t[t.name]
        assert t.tensor_type == ref.tensor_type and list(t.shape) == list(ref.shape)
        assert t.data.tobytes() == ref.data.tobytes(), t.name
        assert t.data_offset % 32 == 0
    assert _fields(got) == _fields(src)  # metadata byte for byte
    assert layout.sha256() == hashlib.sha256(out.read_bytes()).hexdigest()
    full = out.read_bytes()
    for offset in (0, 1, 100, layout.segments[0].length, layout.size // 2, layout.size - 1):
        assert b"".join(layout.read(offset, 4096)) == full[offset:]


def test_shard_loads_with_the_engine_and_computes_the_same(model: Path, tmp_path: Path) -> None:
    out = ShardLayout(model, 2, 4).write(tmp_path / "s.gguf")
    torch.manual_seed(0)
    with GGUFFile.open(model) as full_gf, GGUFFile.open(out) as shard_gf:
        cfg = config_for(
            full_gf.architecture, full_gf.metadata, n_vocab=full_gf.tensors["token_embd.weight"].shape[0]
        )
        full = DecoderLM(cfg, full_gf, layers=range(2, 4), embed=False, head=False)
        part = DecoderLM(cfg, shard_gf, layers=range(2, 4), embed=False, head=False)
        h = torch.randn(5, cfg.n_embd)  # [T, D]
        outs = []
        for m in (full, part):
            cache = m.new_cache(16, "f32")
            x = h
            for i in range(2, 4):
                x = m.layer(i, x, cache, 0)
            outs.append(x)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(Exception, match=r"blk\.0"):
        with GGUFFile.open(out) as gf:
            DecoderLM(cfg, gf, layers=range(0, 2), embed=False, head=False)


def test_bad_ranges(model: Path) -> None:
    for begin, end in ((3, 3), (0, 5), (-1, 2)):
        with pytest.raises(ValueError, match="not a range"):
            ShardLayout(model, begin, end)


def test_ship_then_already_there(model: Path, make_agent: Callable[..., Agent]) -> None:
    p = pair_with(make_agent())
    res = ship(p.client, model, 1, None, chunk=256 << 10)
    want = ShardLayout(model, 1).sha256()
    assert (res.name, res.resumed_from, res.sent, res.already_there) == (
        "tiny-moe.L1-4.gguf",
        0,
        res.size,
        False,
    )
    stored = p.agent.store.root / res.name
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == want == res.sha256
    again = ship(p.client, model, 1, None)
    assert again.already_there and again.sent == 0
    p.client.close()


def test_shipment_cut_three_times_resumes_with_the_right_hash(model: Path, tmp_path: Path) -> None:
    """The agent process is killed (SIGKILL) three times mid-shipment and started again each time."""
    port = free_port()
    data_dir = tmp_path / "worker-pc"
    current = {"agent": AgentProc(data_dir, port, "--no-mdns")}
    from engine.node.client import NodeRegistry, identify, pair
    from engine.node.keys import KeyPair

    keys = KeyPair.generate()
    ident = identify("127.0.0.1", port)
    rec = pair(
        "127.0.0.1", port, current["agent"].ready["pairing_code"], ident.fingerprint, keys, NodeRegistry()
    )
    layout = ShardLayout(model, 0, N_LAYER)
    chunk = 64 << 10
    resumed: list[int] = []
    try:
        for cut in (0.2, 0.45, 0.7):
            client = NodeClient.for_record(rec, keys, timeout=1.0)

            def kill_at(done: int, total: int, cut: float = cut) -> None:
                if done >= total * cut and current["agent"].proc.poll() is None:
                    current["agent"].kill()

            with pytest.raises(NodeError) as err:
                ship(client, model, 0, N_LAYER, progress=kill_at, chunk=chunk, window=2, layout=layout)
            assert err.value.code in ("unreachable", "timeout")
            client.close()
            part = data_dir / "node" / "models" / (layout.default_name() + ".part")
            assert 0 < part.stat().st_size < layout.size
            current["agent"] = AgentProc(data_dir, port, "--no-mdns")  # same key, same pairing
            res_client = NodeClient.for_record(rec, keys, timeout=5.0)
            resumed.append(
                res_client.call(
                    "upload_begin",
                    {"name": layout.default_name(), "size": layout.size, "sha256": layout.sha256()},
                )["offset"]
            )
            res_client.close()
        client = NodeClient.for_record(rec, keys, timeout=5.0)
        res = ship(client, model, 0, N_LAYER, chunk=chunk, layout=layout)
        client.close()
    finally:
        current["agent"].stop()
    assert resumed == sorted(resumed) and resumed[0] > 0 and len(set(resumed)) == 3
    assert res.resumed_from == resumed[-1] and res.sent == layout.size - resumed[-1]
    stored = data_dir / "node" / "models" / res.name
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == res.sha256 == layout.sha256()
    assert stored.read_bytes() == b"".join(layout.read(0))
    assert not (stored.parent / (res.name + ".part")).exists()
    # and the shipped file is the source's layers, bit for bit
    src = gguf.GGUFReader(str(model))
    got = {t.name: t for t in gguf.GGUFReader(str(stored)).tensors}
    for t in src.tensors:
        assert np.array_equal(got[t.name].data, t.data)
