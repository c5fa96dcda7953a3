"""Ollama's /api/* on the shared server, in the shapes Ollama's docs/api.md gives: the model list, the running
models, show, and generate and chat whole and streamed as one JSON object a line, with the same text the OpenAI
routes give for the same request."""

import json

from tests.engine.serve.harness import ServerProc

OPTIONS = {"num_predict": 6, "temperature": 0, "num_ctx": 4096, "num_gpu": 99, "mirostat": 0}


def test_version_tags_ps_and_show(server: ServerProc) -> None:
    assert server.get("/api/version").json()["version"]
    served = server.get("/v1/models").json()["data"][0]["id"]
    (m,) = server.get("/api/tags").json()["models"]
    assert m["name"] == m["model"] == f"{served}:latest" and m["size"] > 0
    assert m["details"]["format"] == "gguf" and m["details"]["family"] == "qwen3moe"
    assert m["modified_at"].endswith("Z")
    (p,) = server.get("/api/ps").json()["models"]
    assert p["name"] == m["name"] and p["size_vram"] == 0  # on the CPU
    s = server.post("/api/show", {"model": m["name"]}).json()
    assert s["model_info"]["general.architecture"] == "qwen3moe" and isinstance(s["template"], str)
    assert s["details"] == m["details"]


def test_generate_and_chat_match_the_openai_routes(server: ServerProc) -> None:
    want = server.post("/v1/completions", {"prompt": "jade harbor", "max_tokens": 6, "temperature": 0}).json()
    r = server.post("/api/generate", {"model": "anything", "prompt": "jade harbor", "raw": True, "stream": False,
                                      "options": OPTIONS, "keep_alive": "5m"})  # fmt: skip
    assert r.status_code == 200, r.text
    g = r.json()
    assert g["response"] == want["choices"][0]["text"] and g["done"] is True
    assert g["eval_count"] == want["usage"]["completion_tokens"] and g["prompt_eval_count"] > 0
    assert g["done_reason"] in ("stop", "length") and g["total_duration"] > 0
    with server.client() as c, c.stream("POST", "/api/generate", json={"prompt": "jade harbor", "raw": True,
                                                                          "options": OPTIONS}) as s:  # fmt: skip
        assert s.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in s.iter_lines() if x]
    assert all(x["done"] is False for x in lines[:-1]) and lines[-1]["done"] is True
    assert "".join(x["response"] for x in lines) == g["response"]

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    want = server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "temperature": 0}).json()
    c = server.post("/api/chat", {"messages": msgs, "stream": False, "options": OPTIONS}).json()
    assert c["message"] == {"role": "assistant", "content": want["choices"][0]["message"]["content"]}
    assert c["done"] is True and c["eval_count"] == want["usage"]["completion_tokens"]


def test_what_is_not_supported_yet_is_refused_by_name(server: ServerProc) -> None:
    user = [{"role": "user", "content": "hi"}]
    for path, body, param in (
        ("/api/generate", {"prompt": "x", "format": "yaml"}, "format"),
        ("/api/chat", {"messages": user, "tools": [{"type": "function"}]}, "tools[0].function"),
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]},
            "messages.0.images",
        ),
        ("/api/generate", {"prompt": "x", "options": {"frobnicate": 1}}, "options.frobnicate"),
    ):
        r = server.post(path, body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param


def test_format_holds_the_answer_to_json(server: ServerProc) -> None:
    """Ollama's `format`: a JSON schema (or "json": any object), through the same constrained decoding."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    r = server.post("/api/chat", {"messages": [{"role": "user", "content": "ok?"}], "format": schema,
                                  "stream": False, "options": {"temperature": 1.0, "seed": 1}})  # fmt: skip
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["message"]["content"]) in ({"ok": True}, {"ok": False})
    r = server.post(
        "/api/generate", {"prompt": "x", "format": "json", "stream": False, "options": {"num_predict": 4}}
    )
    assert r.status_code == 200 and r.json()["response"].startswith("{")


def test_tool_messages_go_through_the_template(server: ServerProc) -> None:
    """A conversation with Ollama's tool calls (arguments as objects, no ids) and a tool's answer is read."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    user = [{"role": "user", "content": "Add 2 and 3"}]
    history = [*user, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
               {"role": "tool", "content": "5", "tool_name": "add"}]  # fmt: skip
    short = server.post(
        "/api/chat", {"messages": user, "tools": tools, "stream": False, "options": OPTIONS}
    ).json()
    long_ = server.post(
        "/api/chat", {"messages": history, "tools": tools, "stream": False, "options": OPTIONS}
    ).json()
    assert long_["done"] is True and long_["prompt_eval_count"] > short["prompt_eval_count"] + 10
