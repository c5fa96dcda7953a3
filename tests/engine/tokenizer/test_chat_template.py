"""Chat templates: the fixture's Qwen-style template against transformers' apply_chat_template and hand-written
expectations, the ChatML fallback, sandboxing and error messages."""

import datetime

import jinja2.exceptions
import pytest

from engine.testing.tokenizer_fixture import CHATML_TOOLS_TEMPLATE, tiny_bpe_metadata, tiny_spm_metadata
from engine.tokenizer import (
    FALLBACK_TEMPLATE,
    ChatFormatter,
    ChatTemplateError,
    ChatTemplateSecurityError,
    Tokenizer,
    render_chat,
)
from tests.engine.tokenizer.gguf_files import TokenizerFile, hf_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! Grüße aus Zürich 日本"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Weather?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter für eine Stadt",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_TURNS = [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
        ],
    },
    {"role": "tool", "content": '{"temp_c": 21}'},
]


def test_multi_turn_with_system_and_generation_prompt() -> None:
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi! Grüße aus Zürich 日本<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello.<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_chat(CHATML_TOOLS_TEMPLATE, CONVERSATION) == expected
    assert render_chat(
        CHATML_TOOLS_TEMPLATE, CONVERSATION, add_generation_prompt=False
    ) == expected.removesuffix("<|im_start|>assistant\n")
    no_think = render_chat(CHATML_TOOLS_TEMPLATE, CONVERSATION, enable_thinking=False)
    assert no_think == expected + "<think>\n\n</think>\n\n"
    assert render_chat(CHATML_TOOLS_TEMPLATE, CONVERSATION, enable_thinking=True) == expected


def test_tools_and_tool_turns() -> None:
    text = render_chat(CHATML_TOOLS_TEMPLATE, CONVERSATION + TOOL_TURNS, tools=TOOLS)
    schema = (
        '{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
    )
    assert text.startswith(
        "<|im_start|>system\nYou are terse.\n\n# Tools\nFunctions you may call, one JSON schema per line:\n"
        f"<tools>\n{schema}\n</tools>\n"
    )
    assert text.endswith(
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("thinking", [None, False])
def test_fixture_template_matches_transformers(
    bpe_file: TokenizerFile, with_tools: bool, thinking: bool | None
) -> None:
    """transformers renders the template stored in the GGUF in its own sandbox; the texts must be identical."""
    hf = hf_tokenizer(bpe_file.path)
    formatter = ChatFormatter.from_metadata(bpe_file.meta)
    assert not formatter.is_fallback and formatter.template == CHATML_TOOLS_TEMPLATE
    assert formatter.stop_strings == ()  # the file's own template ends replies with its EOG tokens
    messages = CONVERSATION + (TOOL_TURNS if with_tools else [])
    extra = {} if thinking is None else {"enable_thinking": thinking}
    tools = TOOLS if with_tools else None
    expected = hf.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **extra
    )
    assert formatter.render(messages, tools=tools, **extra) == expected


def test_fallback_is_chatml() -> None:
    meta = {k: v for k, v in tiny_bpe_metadata().items() if k != "tokenizer.chat_template"}
    formatter = ChatFormatter.from_metadata(meta)
    assert formatter.is_fallback and formatter.template == FALLBACK_TEMPLATE
    assert formatter.stop_strings == ("<|im_end|>", "<|im_start|>")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Hel"}, {"type": "image"}, {"type": "text", "text": "lo"}],
        },
        {"role": "user", "content": "Bye"},
    ]
    assert formatter.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    assert formatter.render(messages[:2], add_generation_prompt=False).endswith("Hi<|im_end|>\n")


@pytest.mark.real_model
def test_gemma3_file_gets_the_fallback(gemma_file: TokenizerFile) -> None:
    """The Gemma 3 270M base model ships without a template."""
    formatter = ChatFormatter.from_metadata(gemma_file.meta, source=gemma_file.path.name)
    assert formatter.is_fallback
    assert (
        formatter.render([{"role": "user", "content": "Hi"}])
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_leading_bos_is_stripped_when_the_tokenizer_adds_it() -> None:
    meta = {
        **tiny_spm_metadata(),
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}",
    }
    tok = Tokenizer.from_metadata(meta)
    formatter = ChatFormatter.from_metadata(meta, tokenizer=tok)
    text = formatter.render([{"role": "user", "content": "Hi"}])
    assert text == "Hi</s>"  # add_bos: the template's <s> goes, the tokenizer adds it; add_eos is off
    assert tok.encode(text).count(1) == 1
    keep = ChatFormatter.from_metadata({**meta, "tokenizer.ggml.add_bos_token": False})
    assert keep.render([{"role": "user", "content": "Hi"}]) == "<s>Hi</s>"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{% set x = messages.append({'role': 'x'}) %}",
        "{{ messages[0].update({'content': 'x'}) }}",
    ],
)
def test_sandbox_escapes_raise_security_error(template: str) -> None:
    with pytest.raises(ChatTemplateSecurityError) as info:
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert isinstance(info.value, jinja2.exceptions.SecurityError)
    assert "\n" not in str(info.value) and "sandbox" in str(info.value)


def test_raise_exception_gives_one_line_error() -> None:
    template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported!\\nGot: ' + m.role) }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, [{"role": "system", "content": "x"}], source="model.gguf")
    message = str(info.value)
    assert message == (
        "chat template of model.gguf refused the conversation: Only user and assistant roles are supported! Got: system"
    )
    assert not isinstance(info.value, ChatTemplateSecurityError)


def test_syntax_and_runtime_errors_name_the_line() -> None:
    with pytest.raises(ChatTemplateError, match=r"^chat template of t\.gguf: syntax error at line 2: "):
        render_chat("ok\n{% for m in messages %}", [], source="t.gguf")
    with pytest.raises(ChatTemplateError, match=r"^chat template failed at line 3: TypeError: ") as info:
        render_chat("a\nb\n{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        ChatFormatter("{% if %}")  # compiled at load


def test_environment_helpers() -> None:
    msgs = [
        {"role": "user", "content": "日本"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert render_chat("{{ messages[0] | tojson }}", msgs) == '{"role": "user", "content": "日本"}'
    assert render_chat("{{ messages[0] | tojson(indent=2, sort_keys=True) }}", msgs) == (
        '{\n  "content": "日本",\n  "role": "user"\n}'
    )
    assert render_chat("{{ strftime_now('%Y') }}", msgs) == str(datetime.datetime.now().year)
    loop = "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}"
    assert render_chat(loop, msgs) == "b"
    assert (
        render_chat(
            "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}", msgs
        )
        == "[日本][b][c]"
    )
    # trim_blocks / lstrip_blocks: block tags do not leave their newline or indentation behind
    assert (
        render_chat(
            "{% for m in messages %}\n  {% if true %}\n{{ m.role }}\n  {% endif %}\n{% endfor %}", msgs[:1]
        )
        == "user\n"
    )
    assert (
        render_chat(
            "{{ flag }}|{{ bos_token }}|{{ eos_token }}", [], bos_token="<s>", eos_token="</s>", flag=1
        )
        == "1|<s>|</s>"
    )
