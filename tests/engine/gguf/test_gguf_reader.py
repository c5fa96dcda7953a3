"""GGUFFile against gguf.GGUFReader on files written by gguf.GGUFWriter."""

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from engine.gguf import names
from engine.gguf.random_blocks import random_blocks
from engine.gguf.reader import GGUFError, GGUFFile

Q = GGMLQuantizationType
N_LAYERS = 5


def _write_model(path: Path, split_max_tensors: int = 0) -> None:
    """A small MoE-shaped model: dense, quantized and 3-D expert tensors, every metadata value type."""
    rng = np.random.default_rng(7)
    w = GGUFWriter(path, arch="qwen3moe", split_max_tensors=split_max_tensors)
    w.add_block_count(N_LAYERS)
    w.add_uint32("qwen3moe.expert_count", 4)
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -5)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_int32("test.i32", -(2**31))
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float32("test.f32", 0.1)
    w.add_float64("test.f64", 1e-300)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo ✓ 世界")
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.floats", [0.5, -1.25, 3.0])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(300)] + ["", "ü", "<|im_end|>"])
    w.add_token_types([1] * 303)
    w.add_token_merges([f"t o{i}" for i in range(50)])
    w.add_tensor(names.TOKEN_EMBD, random_blocks(Q.Q8_0, 303, 64, 1), raw_dtype=Q.Q8_0)
    w.add_tensor(names.OUTPUT_NORM, rng.normal(size=64).astype(np.float32))
    for i in range(N_LAYERS):
        w.add_tensor(names.blk(i, "attn_norm"), rng.normal(size=64).astype(np.float32))
        w.add_tensor(names.blk(i, "attn_q"), rng.normal(size=(128, 64)).astype(np.float16))
        w.add_tensor(names.blk(i, "attn_k"), random_blocks(Q.Q4_K, 32, 256, i), raw_dtype=Q.Q4_K)
        w.add_tensor(names.blk(i, "ffn_gate_inp"), rng.normal(size=(4, 64)).astype(np.float32))
        exps = random_blocks(Q.Q6_K, 4 * 8, 256, 100 + i).reshape(4, 8, -1)  # [E, n_out, row_bytes]
        w.add_tensor(names.blk(i, "ffn_up_exps"), exps, raw_dtype=Q.Q6_K)
    w.add_tensor(names.OUTPUT, random_blocks(Q.IQ4_XS, 303, 256, 3), raw_dtype=Q.IQ4_XS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("single") / "model.gguf"
    _write_model(path)
    return path


@pytest.fixture(scope="module")
def split_paths(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("split")
    _write_model(folder / "model.gguf", split_max_tensors=7)
    return sorted(folder.glob("model-*-of-*.gguf"))


def _reference_value(field: Any) -> Any:
    return field.contents()


def _assert_metadata_matches(ours: dict[str, Any], reader: GGUFReader) -> None:
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(ours) == keys
    for key in keys:
        field = reader.fields[key]
        ref = field.contents()
        got = ours[key]
        if field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
            assert got == ref, key
        elif field.types[0] == GGUFValueType.ARRAY and len(field.types) > 2:
            # arrays of arrays: GGUFReader flattens them
            flat = [v for part in got for v in np.asarray(part).tolist()]
            assert flat == ref, key
        elif field.types[0] == GGUFValueType.ARRAY:
            expected_dtype = field.parts[field.data[0]].dtype
            assert isinstance(got, np.ndarray), key
            if field.types[-1] == GGUFValueType.BOOL:
                assert got.dtype == np.bool_
            else:
                assert got.dtype == expected_dtype.newbyteorder("="), key
            assert got.tolist() == ref, key
        else:
            assert got == ref and type(got) is type(ref), key


def _assert_tensors_match(f: GGUFFile, readers: list[GGUFReader]) -> None:
    expected = {t.name: (i, t) for i, r in enumerate(readers) for t in r.tensors}
    assert list(f.tensors) == list(expected)
    for name, (part, ref) in expected.items():
        info = f.tensors[name]
        assert info.qtype == ref.tensor_type
        assert info.shape == tuple(reversed(ref.shape.tolist()))
        assert info.file_index == part
        assert info.offset == ref.data_offset
        assert info.nbytes == ref.n_bytes
        raw = f.tensor_bytes(name)
        assert raw.dtype == torch.uint8
        ref_bytes = np.ascontiguousarray(ref.data).view(np.uint8).reshape(raw.shape)
        assert raw.shape == (*info.shape[:-1], info.row_bytes)
        np.testing.assert_array_equal(raw.numpy(), ref_bytes)


def test_single_file_matches_gguf_reader(model_path: Path) -> None:
    reader = GGUFReader(model_path)
    with GGUFFile.open(model_path) as f:
        assert f.path == model_path and f.paths == [model_path]
        assert f.architecture == "qwen3moe"
        assert f.get(gguf.Keys.LLM.BLOCK_COUNT.format(arch="qwen3moe")) == N_LAYERS
        assert f.get("missing.key", 42) == 42
        _assert_metadata_matches(f.metadata, reader)
        _assert_tensors_match(f, [reader])
        assert f.metadata["test.nested"][0].tolist() == [1, 2]
        # torch order: [n_out, n_in], experts [E, n_out, n_in]
        assert f.tensors[names.blk(0, "attn_q")].shape == (128, 64)
        assert f.tensors[names.blk(0, "ffn_up_exps")].shape == (4, 8, 256)
        assert f.tensor_bytes(names.blk(0, "ffn_up_exps")).shape == (4, 8, 210)


def test_split_model_opens_from_any_part(split_paths: list[Path]) -> None:
    assert len(split_paths) >= 3
    readers = [GGUFReader(p) for p in split_paths]
    for given in (split_paths[0], split_paths[-1]):
        with GGUFFile.open(given) as f:
            assert f.paths == split_paths and f.path == split_paths[0]
            _assert_metadata_matches(f.metadata, readers[0])
            _assert_tensors_match(f, readers)
            assert {t.file_index for t in f.tensors.values()} == set(range(len(split_paths)))


def test_split_model_with_missing_part_names_it(split_paths: list[Path], tmp_path: Path) -> None:
    for p in split_paths:
        if p != split_paths[1]:
            (tmp_path / p.name).write_bytes(p.read_bytes())
    with pytest.raises(GGUFError, match=re.escape(split_paths[1].name)) as err:
        GGUFFile.open(tmp_path / split_paths[0].name)
    assert "missing" in str(err.value) and "\n" not in str(err.value)


def test_layer_range_selection(model_path: Path) -> None:
    reader = GGUFReader(model_path)
    with GGUFFile.open(model_path) as f:
        for begin, end in [(0, N_LAYERS), (1, 3), (4, 5), (2, 2), (5, 9)]:
            expected = [
                t.name
                for t in reader.tensors
                if (m := re.match(r"blk\.(\d+)\.", t.name)) and begin <= int(m.group(1)) < end
            ]
            assert f.tensor_names_for_layers(begin, end) == expected
        assert len(f.tensor_names_for_layers(1, 3)) == 2 * 5


def test_tensor_bytes_are_views_of_the_mapped_file(model_path: Path) -> None:
    with GGUFFile.open(model_path) as f:
        a, b = f.tensors[names.blk(0, "attn_norm")], f.tensors[names.blk(3, "attn_k")]
        ta, tb = f.tensor_bytes(a.name), f.tensor_bytes(b.name)
        # same mapping: pointer distance equals the file distance, and a second view aliases the first
        assert tb.data_ptr() - ta.data_ptr() == b.offset - a.offset
        assert f.tensor_bytes(a.name).data_ptr() == ta.data_ptr()
        before = model_path.read_bytes()
        ta[0] ^= 0xFF  # copy-on-write: the process sees the change, the file never does
        assert f.tensor_bytes(a.name)[0] == ta[0]
        assert model_path.read_bytes() == before
        ta[0] ^= 0xFF
    # views outlive close(); the file object refuses new ones
    assert torch.equal(
        tb, torch.from_numpy(np.frombuffer(before, np.uint8, b.nbytes, b.offset).copy()).view(tb.shape)
    )
    with pytest.raises(GGUFError, match="closed"):
        f.tensor_bytes(a.name)


def test_missing_tensor_and_architecture(model_path: Path, tmp_path: Path) -> None:
    with (
        GGUFFile.open(model_path) as f,
        pytest.raises(GGUFError, match=re.escape("no tensor named 'blk.99.attn_q.weight'")),
    ):
        f.tensor_bytes(names.blk(99, "attn_q"))
    w = GGUFWriter(tmp_path / "noarch.gguf", arch="llama")
    w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with (
        GGUFFile.open(tmp_path / "noarch.gguf") as f,
        pytest.raises(GGUFError, match=r"general\.architecture"),
    ):
        _ = f.architecture


def test_names_table() -> None:
    assert names.blk(3, "attn_q") == "blk.3.attn_q.weight"
    assert names.blk(0, "attn_q", "bias") == "blk.0.attn_q.bias"
    assert names.blk(7, "exp_probs_b", "bias") == "blk.7.exp_probs_b.bias"
    assert names.blk(2, "post_attention_norm") == "blk.2.post_attention_norm.weight"
    assert names.blk(48, "nextn.eh_proj") == "blk.48.nextn.eh_proj.weight"
    assert (names.TOKEN_EMBD, names.OUTPUT_NORM, names.OUTPUT, names.ROPE_FREQS) == (
        "token_embd.weight",
        "output_norm.weight",
        "output.weight",
        "rope_freqs.weight",
    )
    assert names.block_index("blk.12.ffn_up_exps.weight") == 12 and names.block_index("output.weight") is None
    with pytest.raises(KeyError, match="attn_qq"):
        names.blk(0, "attn_qq")


@pytest.mark.real_model
@pytest.mark.slow
def test_gemma_file_matches_gguf_reader(gemma_path: Path) -> None:
    with GGUFFile.open(gemma_path) as f:
        assert f.architecture == "gemma3"
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 262144
        reader = GGUFReader(gemma_path)  # ~10 s: one numpy view per vocabulary entry
        _assert_metadata_matches(f.metadata, reader)
        _assert_tensors_match(f, [reader])
        # every per-block tensor of the real file is in the names table
        n_layers = f.metadata["gemma3.block_count"]
        known = {names.blk(i, part) for i in range(n_layers) for part in names.BLOCK_TENSORS}
        assert {n for n in f.tensors if n.startswith("blk.")} <= known
        assert {names.TOKEN_EMBD, names.OUTPUT_NORM} <= set(f.tensors)
