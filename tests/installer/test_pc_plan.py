"""Layers across PCs (installer.pc_plan) and the torch-free geometry of a GGUF file (installer.gguf_geometry), the
latter checked against the engine's own reading of the same file (engine.pipeline.split.geometry_from_gguf)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from engine.gguf.reader import GGUFFile
from engine.layers.kv_cache import kv_bytes_per_token
from engine.models.registry import file_config
from engine.pipeline.split import geometry_from_gguf
from engine.testing.tiny_models import write_tiny_model
from installer.catalog import geometry, load_catalog
from installer.config import Worker
from installer.gguf_geometry import GeometryError, file_geometry
from installer.gpus import GpuInfo
from installer.pc_plan import PcCard, PlanError, agent_cards, plan_pcs, tune_splits

GIB = 1024**3


def _gpu(name: str, gib: int, index: int = 0) -> GpuInfo:
    return GpuInfo(index, f"GPU-{name}", name, gib * GIB, gib * GIB - GIB // 2, (8, 6), "560.0", sm_count=68,
                   max_sm_clock_mhz=1710)  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama"])
def test_file_geometry_reads_what_the_engine_reads(arch: str, tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, qtype="Q8_0", n_layer=4, seed=1)
    ours = file_geometry(path).to_placement("bf16")
    gf = GGUFFile.open(path)
    cfg = file_config(gf, 0)
    engine = geometry_from_gguf(gf, cfg, "bf16")
    assert ours.n_layer == engine.n_layer and ours.n_expert == engine.n_expert
    assert ours.expert_bytes == engine.expert_bytes
    assert sum(ours.dense_bytes) == pytest.approx(sum(engine.dense_bytes), abs=ours.n_layer)
    assert ours.head_bytes == engine.head_bytes
    assert ours.kv_bytes_per_token[0] == kv_bytes_per_token(cfg, "bf16")


def test_file_geometry_refuses_what_is_not_a_model(tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"hello, not a model")
    with pytest.raises(GeometryError, match="not a readable GGUF file"):
        file_geometry(bad)


def test_a_3080_here_and_a_2080_ti_on_a_worker_pc_split_qwen3_30b() -> None:
    """The seeds' two PCs: the stages are contiguous, the worker's entry names its agent's first worker port, and
    each stage's experts are priced on its own card."""
    g = geometry(load_catalog().get("qwen3-30b-a3b-instruct-2507-q4_k_m"))
    here = PcCard("this PC", _gpu("NVIDIA GeForce RTX 3080", 10))
    there = PcCard("gpu-box", _gpu("NVIDIA GeForce RTX 2080 Ti", 11), "192.168.1.20", 7460)
    plan = plan_pcs(g, [here, there], 8192)
    first, second = plan.stages
    assert (first.begin, second.end) == (0, g.layers) and first.end == second.begin
    assert 3 <= first.end <= g.layers - 3
    assert plan.workers == (Worker("192.168.1.20", 7470, second.begin, g.layers),)
    assert second.card.gpu.name.endswith("2080 Ti")
    lines = plan.lines()
    assert lines[0].startswith("this PC GPU 0 · RTX 3080: layers 0-") and "experts in VRAM" in lines[1]
    cfg = plan.config("/models/q.gguf")
    assert cfg.gpu == (0,) and cfg.workers == plan.workers and cfg.validate().workers == plan.workers


def test_choices_the_engine_cannot_run_are_refused_with_what_to_change() -> None:
    g = geometry(load_catalog().get("qwen3-30b-a3b-instruct-2507-q4_k_m"))
    here = PcCard("this PC", _gpu("A", 24))
    w1 = PcCard("pc-b", _gpu("B", 12), "10.0.0.2", 7460)
    w1b = PcCard("pc-b", _gpu("B2", 12, 1), "10.0.0.2", 7460)
    with pytest.raises(PlanError, match="one card of this PC"):
        plan_pcs(g, [w1], 4096)
    with pytest.raises(PlanError, match="several cards of one PC"):
        plan_pcs(g, [here, PcCard("this PC", _gpu("A2", 24, 1)), w1], 4096)
    with pytest.raises(PlanError, match="one card per worker PC"):
        plan_pcs(g, [here, w1, w1b], 4096)


def test_agent_cards_read_the_status_answer_and_skip_entries_without_vram() -> None:
    status = [
        {"index": 0, "name": "NVIDIA GeForce RTX 2080 Ti", "vram_total": 11 * GIB, "vram_free": 10 * GIB,
         "compute_capability": [7, 5], "sm_count": 68, "max_sm_mhz": 1545},
        {"index": 1, "name": "broken"},
    ]  # fmt: skip
    cards = agent_cards("pc-b", "10.0.0.2", 7460, status)
    assert (
        len(cards) == 1 and cards[0].gpu.compute_capability == (7, 5) and cards[0].gpu.vram_free == 10 * GIB
    )
    assert cards[0].label == "pc-b GPU 0 · RTX 2080 Ti" and not cards[0].local


def test_the_tuner_measures_the_plans_split_and_its_neighbours() -> None:
    g = geometry(load_catalog().get("qwen3-30b-a3b-instruct-2507-q4_k_m"))
    here = PcCard("this PC", _gpu("NVIDIA GeForce RTX 3080", 10))
    there = PcCard("gpu-box", _gpu("NVIDIA GeForce RTX 2080 Ti", 11), "192.168.1.20", 7460)
    third = PcCard("old-box", _gpu("NVIDIA GeForce RTX 2070", 8), "192.168.1.21", 7460)
    plan = plan_pcs(g, [here, there], 8192)
    k = plan.stages[1].begin
    step = g.layers // 16  # 3 of 48 layers
    assert tune_splits(plan) == [(k,), (k - step,), (k + step,), (k - 2 * step,), (k + 2 * step,)]
    assert tune_splits(plan, 0) == [(k,)]
    three = plan_pcs(g, [here, there, third], 8192)
    splits = tune_splits(three, 1)
    own = tuple(s.begin for s in three.stages[1:])
    assert splits[0] == own and len(splits) == 5 and len(set(splits)) == 5
    for s in splits:  # every PC keeps at least one layer
        edges = [0, *s, g.layers]
        assert all(a < b for a, b in itertools.pairwise(edges))
