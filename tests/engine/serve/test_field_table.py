"""docs/api.md's table of every field of the OpenAI routes agrees with the request models: every field a route
takes is in it once, on that route, and what it says is what the route does (an accepted field changes nothing,
a refused one is a 400 that names it)."""

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.serve.protocol import ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parents[3] / "docs" / "api.md"
ROUTES = {"chat": ChatCompletionRequest, "completions": CompletionRequest}


def _table() -> list[tuple[list[str], str, str]]:
    """(fields, route text, status) per row of the table."""
    text = DOC.read_text()
    body = text.split("### Every field of the OpenAI routes", 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.append((re.findall(r"`([a-z_]+)`", cells[0]), cells[1], cells[2]))
    return rows


def _on(route: str, field: str, where: str) -> bool:
    """Whether a row's route text puts `field` on `route` ("both", "chat", "chat (`user`: both)", ...)."""
    special = re.search(rf"`{field}`: (\w+)", where)
    kind = special.group(1) if special else where.split()[0]
    return kind == "both" or kind == route


def test_every_field_of_each_route_is_in_the_table_once() -> None:
    rows = _table()
    assert rows
    for route, model in ROUTES.items():
        listed = [f for fields, where, _ in rows for f in fields if _on(route, f, where)]
        assert sorted(set(listed)) == sorted(listed), f"{route}: a field twice"
        assert set(listed) == set(model.model_fields), (
            route, set(model.model_fields) ^ set(listed))  # fmt: skip
    assert {s for _, _, s in rows} <= {"honoured", "accepted", "refused"}


def test_accepted_fields_are_read_nowhere_and_refused_ones_are_named() -> None:
    """An accepted field is one the request models take and no serving code reads (so the answer is as without
    it); a refused one is a 400 naming it."""
    serve = Path(__file__).resolve().parents[3] / "engine" / "serve"
    # the modules that read the OpenAI routes' requests (the other dialects have request models of their own)
    code = "".join(
        (serve / f).read_text() for f in ("app.py", "translate.py", "answers.py", "serving.py", "jobs.py")
    )
    values = {"modalities": ["audio"], "audio": {}, "web_search_options": {}, "functions": [{}],
              "function_call": "auto", "suffix": "x", "best_of": 2}  # fmt: skip
    base = {"chat": {"messages": [{"role": "user", "content": "hi"}]}, "completions": {"prompt": "hi"}}
    accepted = {f for fields, _, status in _table() if status == "accepted" for f in fields}
    refused = {f for fields, _, status in _table() if status == "refused" for f in fields}
    assert set(ChatCompletionRequest.ignored_fields()) - refused <= accepted
    for f in accepted:
        assert not re.search(rf"\.{f}\b", code), f"{f} is listed as accepted but engine/serve reads it"
    for fields, where, status in _table():
        for f in fields:
            for route, model in ROUTES.items():
                if status == "refused" and _on(route, f, where):
                    with pytest.raises(ValidationError, match=f):
                        model(**base[route], **{f: values[f]})
