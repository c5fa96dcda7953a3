"""Reading /stats: the contract's per-stage form and the shape the engine's server sends today."""

from app.controllers.stats import experts_held, last_timings, queue_text, runs_on, slots_text, stage_views
from tests.app.fake_engine import STATS

# The engine's own /stats answer for a one-stage CPU run (engine/serve/serving.py), trimmed.
ENGINE_STATS = {
    "status": "ready",
    "model": "tiny",
    "queue": {"waiting": 0, "active": 1, "max": 64, "active_request": None},
    "last_request": {
        "prompt_n": 16,
        "prompt_per_second": 30.9,
        "predicted_n": 5,
        "predicted_per_second": 5.95,
    },
    "arch": "qwen3moe",
    "device": "cpu",
    "dtype": "float32",
    "kv_type": "f32",
    "max_context": 4096,
    "n_layer": 2,
    "stages": [
        {
            "stage": 0,
            "step_ms": {"count": 5, "mean": 167.5, "last": 0.5, "recent": 120.0},
            "expert_cache": {"hits": 3, "misses": 1, "hit_rate": 0.75},
            "device": "cpu",
            "layers": [0, 2],
        }
    ],
    "experts": {"n_expert": 8, "routed": 16, "in_vram": 0},
}


def test_engine_shape() -> None:
    (v,) = stage_views(ENGINE_STATS)
    assert (v.index, v.device, v.begin, v.end) == (0, "cpu", 0, 2)
    assert (v.experts_in_vram, v.experts_total, v.hit_rate, v.step_ms) == (0, 16, 0.75, 120.0)
    assert experts_held(ENGINE_STATS) == (0, 16)
    assert last_timings(ENGINE_STATS)["predicted_per_second"] == 5.95
    assert runs_on(ENGINE_STATS) == "cpu, qwen3moe, float32, KV f32, context 4096, 2 layers"
    spilled = {**ENGINE_STATS, "device": "cuda:0", "kv_host_layers": [36, 37, 38]}
    assert (
        runs_on(spilled)
        == "cuda:0, qwen3moe, float32, KV f32, context 4096, KV of 3 layer(s) in host RAM, 2 layers"
    )
    assert runs_on({**ENGINE_STATS, "kv_host_layers": []}) == runs_on(ENGINE_STATS)
    assert queue_text(ENGINE_STATS) == "waiting 0, active 1"


def test_contract_shape() -> None:
    views = stage_views(STATS)
    assert [(v.index, v.device, v.begin, v.end, v.experts_in_vram, v.experts_total) for v in views] == [
        (0, "cuda:0", 0, 12, 1536, 1536),
        (1, "cuda:1", 12, 48, 3000, 4608),
    ]
    assert views[1].hit_rate == 0.7 and views[1].step_ms == 19.0
    assert experts_held(STATS) == (4536, 6144)
    assert last_timings(STATS)["prompt_n"] == 120


def test_missing_fields_read_as_unknown() -> None:
    (v,) = stage_views({"stages": [{"layers": "all"}]})
    assert (v.index, v.begin, v.experts_total, v.hit_rate, v.step_ms) == (0, None, None, None, None)
    assert experts_held({"experts": None, "stages": []}) is None
    assert last_timings({"last_request": None}) is None
    assert runs_on({}) == "–" and queue_text({}) == "–"


def test_a_cards_cpu_share_of_misses() -> None:
    """A card whose CPU computes part of its decode misses: the engine's `cpu_share` in the Engine page's row."""
    from app.ui.engine_page import stage_row

    stats = {
        "stages": [
            {
                "stage": 0,
                "device": "cuda:0",
                "layers": [0, 48],
                "expert_cache": {"hits": 203, "misses": 797, "cpu_share": 0.6},
            }
        ],
        "experts": {"routed": 6144, "in_vram": 1248},
    }
    (v,) = stage_views(stats)
    assert v.cpu_share == 0.6
    assert stage_row(v)[5] == "20.3% · CPU 60% of misses"
    (v,) = stage_views(ENGINE_STATS)  # a CPU engine: no share, the cell as before
    assert v.cpu_share is None and stage_row(v)[5] == "75.0%"
    for bad in (None, "0.5", True, 1.5, -0.1):
        stats["stages"][0]["expert_cache"]["cpu_share"] = bad
        assert stage_views(stats)[0].cpu_share is None


def test_slots_text() -> None:
    slots = {
        "total": 4,
        "busy": 2,
        "rows_per_step": {
            "count": 9,
            "total": 30.0,
            "mean": 3.3,
            "last": 3.0,
            "min": 1.0,
            "max": 5.0,
            "recent": 3.5,
        },
        "slots": [
            {"index": 0, "state": "decode", "tokens": 40, "tokens_per_second": 9.5},
            {"index": 1, "state": "prompt", "tokens": 512, "tokens_per_second": 0.0},
            {"index": 2, "state": "idle", "tokens": 0, "tokens_per_second": 0.0},
            {"index": 3, "state": "idle", "tokens": 0, "tokens_per_second": 0.0},
        ],
    }
    assert (
        slots_text({"status": "ready", "slots": slots}) == "2 of 4 busy, 3.5 rows a step (1 reading a prompt)"
    )
    assert slots_text({"status": "ready", "slots": None}) == "1 (one request at a time)"
    assert slots_text({}) == "–"
