"""The contract between the engine's status endpoints and the app: /health, /stats and /events answer with the
pydantic models of engine/serve/protocol.py, and every field the app reads from them exists there under that name,
with a type the app's readers take (checked by feeding them payloads of the engine itself and of the app's fake)."""

import ast
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from app.controllers.charts import stage_label, stage_point
from app.controllers.stats import experts_held, last_timings, queue_text, runs_on, stage_views
from engine.serve.protocol import EVENT, Health, Stats
from engine.testing.tiny_models import write_tiny_model
from tests.app.fake_engine import SPLIT_EVENTS, STATS, TIMINGS, health_body
from tests.engine.serve.harness import ServerProc, start_server

ROOT = Path(__file__).resolve().parents[3]
# The app's modules that read the engine's status, and what they read: health, stats, events.
READERS = {
    "app/controllers/engine.py": ("health", "stats"),
    "app/controllers/stats.py": ("stats",),
    "app/controllers/charts.py": ("stats", "events"),
    "app/ui/engine_page.py": ("stats",),
}


def _models_of(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += _models_of(arg)
    return out


def _fields(models: tuple[type[BaseModel], ...]) -> dict[str, set[str]]:
    """Every field name reachable from `models` -> the JSON kinds its annotation allows."""
    out: dict[str, set[str]] = {}
    seen: set[type[BaseModel]] = set()
    todo = list(models)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for name, f in m.model_fields.items():
            out.setdefault(name, set()).update(_kinds(f.annotation))
            todo += _models_of(f.annotation)
    return out


def _kinds(annotation: Any) -> set[str]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_kinds(a) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return {type(v).__name__ for v in typing.get_args(annotation)}
    if origin is typing.Annotated:
        return _kinds(typing.get_args(annotation)[0])
    if origin in (list, tuple):
        return {"list"}
    if annotation is type(None):
        return {"null"}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {"object"}
    return {getattr(annotation, "__name__", str(annotation))}


def _event_models() -> tuple[type[BaseModel], ...]:
    from engine.serve.protocol import PromptChunkEvent, RequestEvent, StepEvent

    return (StepEvent, PromptChunkEvent, RequestEvent)


def _keys_read(path: Path) -> set[str]:
    """String keys a module reads from dicts: `.get("k")`, `x["k"]`, and `for k in ("a", "b")` loops over such
    reads."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                keys.add(node.args[0].value)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if isinstance(node.slice.value, str):
                keys.add(node.slice.value)
        if (
            isinstance(node, ast.For)
            and isinstance(node.iter, ast.Tuple)
            and isinstance(node.target, ast.Name)
        ):
            consts = [
                e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
            ]
            name = node.target.id
            used = any(
                isinstance(n, ast.Name) and n.id == name and isinstance(p, ast.Call | ast.Subscript)
                for p in ast.walk(node)
                for n in ast.iter_child_nodes(p)
            )
            if consts and used:
                keys.update(consts)
    return keys


@pytest.mark.parametrize("module", list(READERS))
def test_every_key_the_app_reads_is_in_the_protocol(module: str) -> None:
    kinds = {"health": (Health,), "stats": (Stats,), "events": _event_models()}
    fields = _fields(tuple(m for k in READERS[module] for m in kinds[k]))
    read = _keys_read(ROOT / module)
    assert read, module
    missing = sorted(read - set(fields))
    assert not missing, f"{module} reads {missing}, which engine/serve/protocol.py does not have"


def test_the_field_types_the_app_reads() -> None:
    """The kinds of value behind the keys the app converts (numbers it sums, strings it shows, lists it splits)."""
    fields = _fields((Health, Stats, *_event_models()))
    numbers = {"int", "float"}
    from engine.serve.protocol import ExpertCacheStats

    assert _kinds(ExpertCacheStats.model_fields["total"].annotation) == {"int", "null"}
    for key in ("hits", "misses", "in_vram", "routed", "max_context", "n_layer", "stage", "tokens",
                "prompt_n", "predicted_n"):  # fmt: skip
        assert fields[key] - {"null"} == {"int"}, key
    for key in ("ms", "compute_ms", "wait_ms", "transfer_ms", "cpu_share", "recent", "mean", "last",
                "prompt_per_second", "predicted_per_second"):  # fmt: skip
        assert fields[key] - {"null"} <= numbers, key
    for key in ("status", "error", "model", "device", "host", "arch", "dtype", "kv_type", "type"):
        assert fields[key] - {"null"} == {"str"}, key
    assert fields["layers"] - {"null"} == {"list", "str"}  # [begin, end) in /stats, "0-23" in events
    assert fields["step_ms"] == {"object"} and fields["stages"] == {"list"}


def test_the_apps_fake_engine_speaks_the_protocol() -> None:
    """The app's tests run against tests/app/fake_engine.py: it must answer as the engine does."""
    Stats.model_validate(STATS)
    Health.model_validate(health_body("ready", "m.gguf", None))
    for ev in SPLIT_EVENTS:
        EVENT.validate_python({**ev, "t": 1.0})
    EVENT.validate_python({"type": "request", "endpoint": "chat", "outcome": "ok", "t": 1.0,
                           **{**dict.fromkeys(("prompt_per_token_ms", "predicted_per_token_ms", "queued_ms"), 0.0),
                              "draft_n": 0, "draft_n_accepted": 0, **TIMINGS}})  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = write_tiny_model(tmp_path_factory.mktemp("contract") / "moe.gguf", "qwen3moe", "Q8_0")
    server = start_server(path, "--device", "cpu", "--dtype", "f32", "--max-context", "256")
    try:
        yield server
    finally:
        server.stop()


def test_the_real_server_answers_with_the_models_and_the_app_reads_them(served: ServerProc) -> None:
    events, _ = served.events_of({"prompt": "one two three", "max_tokens": 4, "ignore_eos": True})
    health = served.get("/health").json()
    stats = served.get("/stats").json()
    Health.model_validate(health)
    Stats.model_validate(stats)
    for ev in events:
        EVENT.validate_python(ev)
    # What the app makes of them: every reader finds its values.
    assert health["status"] == "ready" and health["error"] is None
    (view,) = stage_views(stats)
    assert view.device == "cpu" and (view.begin, view.end) == (0, stats["n_layer"])
    assert view.step_ms is not None and view.step_ms > 0
    assert experts_held(stats) == (0, stats["experts"]["routed"])  # the CPU: none in VRAM
    timings = last_timings(stats)
    assert timings is not None and timings["predicted_n"] == 4 and timings["predicted_per_second"] > 0
    assert runs_on(stats).startswith("cpu, qwen3moe, float32, KV f32, context 256")
    assert queue_text(stats) == "waiting 0, active 0"
    steps = [e for e in events if e["type"] == "step"]
    assert steps and all(stage_point(e, 0.0) is not None for e in steps)
    assert stage_label({**steps[0], "layers": "0-1", "device": "cpu"}) == "layers 0-1 on cpu"
