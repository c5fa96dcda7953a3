"""The other families' tool-call formats (engine/serve/tool_calls.py): Qwen3-Coder's XML, GLM-4.5's key/value
elements, Mistral's [TOOL_CALLS] and gpt-oss's harmony channels. Each on answers written as those models write
them (their chat templates' own layout), text that only looks like a call, and the same answers streamed split at
every character, which must give what the whole answer gives."""

import json

import pytest

from engine.serve.reasoning import AnswerParts
from engine.serve.tool_calls import (
    GlmCalls,
    HarmonyCalls,
    HermesCalls,
    MistralCalls,
    Parsed,
    QwenXmlCalls,
    ToolCall,
    parser_for,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "zip": {"type": "string"}}}  # fmt: skip
TOOLS = {"get_weather": WEATHER, "get_time": {}}

QWEN_XML = (
    "I will check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>\n"
    '<tool_call>\n<function=get_time>\n<parameter=tz>\n"CET"\n</parameter>\n</function>\n</tool_call>'
)
GLM = (
    "Let me look that up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
)
MISTRAL_LIST = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "a1b2c3d4e"}]'
)
MISTRAL_NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{}'
MISTRAL_ID = 'Sure.[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Paris", "days": 3}'
HARMONY_CALL = (
    "<|channel|>analysis<|message|>The user wants the weather in Paris. Call the tool.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", '
    '"days": 3}'
)
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hello! How "
    "can I help?"
)
HARMONY_RECIPIENT_FIRST = (
    "<|channel|>analysis<|message|>Need time.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json"
    "<|message|>{}"
)

PARIS = ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3}))


@pytest.mark.parametrize(
    "fmt,text,content,calls",
    [
        (QwenXmlCalls(), QWEN_XML, "I will check both.",
         [ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3, "zip": "75001"})),
          ToolCall("get_time", json.dumps({"tz": "CET"}))]),
        (GlmCalls(), GLM, "Let me look that up.", [PARIS]),
        (MistralCalls(), MISTRAL_LIST, None, [PARIS]),
        (MistralCalls(), MISTRAL_NAMED, None, [PARIS, ToolCall("get_time", "{}")]),
        (MistralCalls(), MISTRAL_ID, "Sure.", [PARIS]),
        (HarmonyCalls(), HARMONY_CALL, None, [PARIS]),
        (HarmonyCalls(), HARMONY_RECIPIENT_FIRST, None, [ToolCall("get_time", "{}")]),
        (HarmonyCalls(), HARMONY_ANSWER, "Hello! How can I help?", []),
    ],
)  # fmt: skip
def test_each_format_reads_its_calls_and_keeps_the_text(fmt, text: str, content, calls) -> None:
    got = fmt.parse(text, TOOLS)
    assert got.calls == calls
    assert got.content == content
    _streams_as_whole(fmt, text, got)


def test_string_parameters_keep_their_text_and_others_are_json() -> None:
    """A zip code of digits stays a string where the schema says string; without a schema it is read as JSON."""
    got = QwenXmlCalls().parse(QWEN_XML, TOOLS).calls[0]
    assert json.loads(got.arguments) == {"city": "Paris", "days": 3, "zip": "75001"}
    untyped = QwenXmlCalls().parse(QWEN_XML, ["get_weather", "get_time"]).calls[0]
    assert json.loads(untyped.arguments) == {"city": "Paris", "days": 3, "zip": 75001}


def test_harmony_keeps_the_analysis_channel_as_reasoning() -> None:
    got = HarmonyCalls().parse(HARMONY_CALL, TOOLS)
    assert got.reasoning == "The user wants the weather in Paris. Call the tool."
    assert HarmonyCalls().parse(HARMONY_ANSWER, {}).reasoning == "Simple greeting."


@pytest.mark.parametrize(
    "fmt,text",
    [
        (QwenXmlCalls(), "Use <tool_call> tags like <function=name> to call tools."),
        (QwenXmlCalls(), "<tool_call>\n<function=get_weather>\nsome prose\n</function>\n</tool_call>"),
        (GlmCalls(), "<tool_call>{not a call}</tool_call>"),
        (MistralCalls(), "The [TOOL_CALLS] token starts calls."),
        (MistralCalls(), "[TOOL_CALLS] [{broken json"),
        (HarmonyCalls(), "A plain answer with no channels."),
    ],
)
def test_text_that_only_looks_like_a_call_stays_text(fmt, text: str) -> None:
    got = fmt.parse(text, TOOLS)
    assert got.calls == []
    assert got.content == text.strip()
    _streams_as_whole(fmt, text, got)


def test_harmony_call_to_an_undeclared_function_is_not_a_call() -> None:
    text = HARMONY_CALL.replace("get_weather", "delete_everything")
    assert HarmonyCalls().parse(text, TOOLS).calls == []


def test_the_template_picks_the_format() -> None:
    cases = {
        "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{ '<parameter=' }}": QwenXmlCalls,
        "<tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>": GlmCalls,
        "{{- '[TOOL_CALLS]' + tool_calls|tojson }}": MistralCalls,
        "<|start|>assistant<|channel|>commentary to=functions.{{ name }}": HarmonyCalls,
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>': HermesCalls,
    }
    for template, kind in cases.items():
        assert type(parser_for(template)) is kind, template
    assert parser_for("{{ messages[0].content }}") is None


def test_a_harmony_answer_streams_reasoning_then_text_without_tools() -> None:
    parts = AnswerParts({}, False, HarmonyCalls())
    items = []
    for ch in HARMONY_ANSWER:
        items += parts.feed(ch)
    items += parts.end()
    assert "".join(v for k, v in items if k == "reasoning") == "Simple greeting."
    assert "".join(v for k, v in items if k == "text") == "Hello! How can I help?"
    assert not any("<|" in v for k, v in items if k != "call")


def _streams_as_whole(fmt, text: str, whole: Parsed) -> None:
    """The answer fed one character at a time, and in two pieces cut at every place, gives the whole's parts."""
    cuts = [list(text)] + [[text[:i], text[i:]] for i in range(1, len(text), 7)]
    for pieces in cuts:
        st = fmt.stream(TOOLS)
        items = []
        for p in pieces:
            items += st.feed(p)
        items += st.end()
        calls = [v for k, v in items if k == "call"]
        content = "".join(v for k, v in items if k == "text").strip() or None
        reasoning = "".join(v for k, v in items if k == "reasoning").strip() or None
        assert calls == whole.calls
        assert content == whole.content
        assert reasoning == whole.reasoning
