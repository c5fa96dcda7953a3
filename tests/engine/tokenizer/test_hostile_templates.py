"""A chat template comes from the model file, so a bad download can hold anything. The three that froze the server
(a power folded while compiling, nested range loops, lipsum) now fail their render within seconds with one clear
line, compiling takes no time, and a template that cannot compile gives way to ChatML with one log line."""

import time

import pytest

from engine.tokenizer.chat_template import ChatFormatter, ChatTemplateError, render_chat

MESSAGES = [{"role": "user", "content": "hi"}]
HOSTILE = {
    "power": "{{ 10 ** 100000000 }}",
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "lipsum": "{{ lipsum(100000, false, 5000, 10000) | length }}",
    "repeat": "{{ 'x' * 10000000000 }}",
    "output": "{% for i in range(1000000) %}{{ 'y' * 1000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_fails_its_render_fast(name: str) -> None:
    t0 = time.monotonic()
    fmt = ChatFormatter(HOSTILE[name], source="x.gguf")  # compiles (at load): no work done there
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ChatTemplateError, match=r"chat template of x\.gguf"):
        fmt.render(MESSAGES)
    assert time.monotonic() - t0 < 5.0


def test_an_ordinary_template_still_renders_its_loops_and_sums() -> None:
    template = "{% for i in range(3) %}{{ i * 2 + 1 }},{% endfor %}{{ 'ab' * 2 }}{{ 2 ** 10 }}{{ [1] + [2] }}"
    assert render_chat(template, MESSAGES) == "1,3,5,abab1024[1, 2]"


def test_a_template_that_cannot_compile_falls_back_to_chatml(caplog: pytest.LogCaptureFixture) -> None:
    meta = {"tokenizer.chat_template": "{% for m in messages %}{{ m.content }"}
    with caplog.at_level("WARNING", logger="strata.engine"):
        fmt = ChatFormatter.from_metadata(meta, source="broken.gguf")
    assert fmt.is_fallback and fmt.render(MESSAGES).startswith("<|im_start|>user\nhi<|im_end|>")
    assert sum("using the ChatML fallback template" in r.message for r in caplog.records) == 1
