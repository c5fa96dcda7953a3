"""`strata-engine serve` adds the experts it used to the model file's usage profile: at shutdown, and after requests
with --profile-every 0; the next start reads it back."""

import json
from pathlib import Path

from engine.gguf.digest import header_digest
from engine.gguf.reader import GGUFFile
from tests.engine.serve.harness import start_server

TOP_K, LAYERS = 2, 2  # the tiny qwen3moe model's


def _complete(srv: object, prompt: str, n: int) -> int:
    """-> tokens the model read for it: the prompt, and each generated token but the last."""
    r = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": n, "ignore_eos": True})  # type: ignore[attr-defined]
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == n
    return usage["prompt_tokens"] + n - 1


def _saved(path: Path) -> tuple[int, int]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    return doc["tokens"], sum(map(sum, doc["counts"]))


def test_serve_saves_the_profile_at_shutdown_and_reads_it_at_start(tiny_model: Path, tmp_path: Path) -> None:
    env = {"STRATA_PROFILE_DIR": str(tmp_path)}
    path = tmp_path / f"{header_digest(GGUFFile.open(tiny_model))}.json"
    args = ("--device", "cpu", "--threads", "1", "--prompt-cache-mib", "0")
    srv = start_server(tiny_model, *args, key=None, env=env)
    try:
        first = _complete(srv, "count the experts", 5)
        assert not path.exists()  # the default interval (300 s) has not passed
    finally:
        srv.stop()
    assert any(f"expert profile: none yet for this file ({path})" in line for line in srv.log)
    assert _saved(path) == (first, first * TOP_K * LAYERS)
    assert any(f"expert profile saved: {path}" in line for line in srv.log)

    srv = start_server(tiny_model, *args, "--profile-every", "0", key=None, env=env)
    try:
        assert any(f"expert profile: {path} ({first} tokens)" in line for line in srv.log), srv.log
        second = _complete(srv, "and once more, please", 3)
        total = first + second
        assert _saved(path) == (total, total * TOP_K * LAYERS)  # saved after the request
    finally:
        srv.stop()
    assert _saved(path) == (total, total * TOP_K * LAYERS)  # nothing new at shutdown: nothing added twice

    srv = start_server(tiny_model, *args, "--no-profile", key=None, env=env)
    try:
        _complete(srv, "not recorded", 2)
    finally:
        srv.stop()
    assert not any("expert profile" in line for line in srv.log)
    assert _saved(path) == (total, total * TOP_K * LAYERS)
