"""Constrained decoding (engine/pipeline/constrain.py): a random tiny model, sampling at temperature 1, writes
output that the grammar admits every time - JSON valid against its schema (checked with the jsonschema package),
tool calls in each format whose arguments validate, GBNF and regex grammars - through the Runner and the slots; bad
grammars are refused with the reason."""

import json
import re

import gguf
import jsonschema
import numpy as np
import pytest

from engine.pipeline.batch import BatchRunner
from engine.pipeline.constrain import (
    HARMONY_MARKS,
    Constraint,
    GrammarError,
    compile_grammar,
    forced_calls_grammar,
    hermes_calls_grammar,
    special_marks,
)
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import SamplingParams
from engine.serve.tool_calls import (
    CallFormat,
    GlmCalls,
    HarmonyCalls,
    HermesCalls,
    MistralCalls,
    QwenXmlCalls,
)
from engine.testing.tiny_models import write_tiny_model
from engine.testing.tokenizer_fixture import tiny_bpe_metadata
from engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -99, "maximum": 99},
                    "b": {"type": "integer"},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SEEDS = 200


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = write_tiny_model(tmp_path_factory.mktemp("c") / "q.gguf", "qwen2", "Q8_0", seed=4)
    return load_model(path, device="cpu", dtype="f32")


def _outputs(lm: object, grammar: str, seeds: int, max_tokens: int = 120) -> list[str]:
    tok = lm.tokenizer  # type: ignore[attr-defined]
    runner = Runner(lm.model, tok, 512, "f32")  # type: ignore[attr-defined]
    prompt = tok.encode("Answer:", add_special=False)
    out = []
    for seed in range(seeds):
        req = GenerationRequest(prompt, max_tokens=max_tokens, grammar=grammar,
                                sampling=SamplingParams(temperature=1.0, seed=seed))  # fmt: skip
        done = list(runner.generate(req))[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == "stop", (seed, tok.decode(done.tokens))
        out.append(tok.decode(done.tokens))
    return out


def test_json_output_validates_against_its_schema_for_every_seed(tiny: object) -> None:
    grammar = compile_grammar("json_schema", SCHEMA, tiny.tokenizer)  # type: ignore[attr-defined]
    texts = _outputs(tiny, grammar, SEEDS)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > SEEDS // 2  # sampled, not one forced answer


def test_a_forced_tool_call_always_parses_and_its_arguments_validate(tiny: object) -> None:
    grammar = compile_grammar("lark", hermes_calls_grammar(TOOLS, several=False), tiny.tokenizer)  # type: ignore[attr-defined]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    names = set()
    for text in _outputs(tiny, grammar, SEEDS):
        (call,) = HermesCalls().parse(text, list(params)).calls
        jsonschema.validate(json.loads(call.arguments), params[call.name])
        names.add(call.name)
    assert names == set(params)


@pytest.mark.parametrize("fmt", [MistralCalls(), QwenXmlCalls(), GlmCalls()], ids=lambda f: f.name)
def test_a_forced_call_in_each_format_parses_with_that_formats_reader(tiny: object, fmt: CallFormat) -> None:
    """The forced-call grammar of each format a template can teach: what a random model writes under it is read
    back by that format's parser as one call whose arguments validate against the tool's schema."""
    grammar = compile_grammar("lark", forced_calls_grammar(fmt.name, TOOLS, several=False), tiny.tokenizer)  # type: ignore[attr-defined]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    names = set()
    for text in _outputs(tiny, grammar, SEEDS // 4):
        parsed = fmt.parse(text, params)
        assert len(parsed.calls) == 1 and not parsed.content, text
        call = parsed.calls[0]
        jsonschema.validate(json.loads(call.arguments), params[call.name])
        names.add(call.name)
    assert names == set(params)


def test_formats_without_a_forced_call_grammar_say_so() -> None:
    assert forced_calls_grammar("no-such-format", TOOLS, several=False) is None


def _harmony_tokenizer() -> Tokenizer:
    """The tiny vocabulary with gpt-oss's harmony markers added as control tokens, as its GGUF files type them
    (the reader then treats <|channel|>, <|message|>, <|start|>, <|constrain|> and <|end|> as text-matched
    user-defined tokens, as llama.cpp does, and <|call|> and <|return|> as end-of-generation controls)."""
    meta = dict(tiny_bpe_metadata())
    added = [*HARMONY_MARKS, "<|return|>"]
    meta[gguf.Keys.Tokenizer.LIST] = list(meta[gguf.Keys.Tokenizer.LIST]) + added
    types = np.asarray(meta[gguf.Keys.Tokenizer.TOKEN_TYPE], dtype=np.int32)
    meta[gguf.Keys.Tokenizer.TOKEN_TYPE] = np.concatenate([types, np.full(len(added), 3, np.int32)])
    return Tokenizer.from_metadata(meta)


def test_a_forced_harmony_call_uses_the_vocabularys_control_tokens() -> None:
    """In gpt-oss's vocabulary <|call|> is a control token (the others are text-matched, as llama.cpp reads them):
    the answer gpt-oss writes - reasoning, then a commentary message to the function, ended by <|call|> - is
    accepted token by token and complete; an undeclared function, invalid arguments or <|call|> spelled as text
    are refused."""
    tok = _harmony_tokenizer()
    specials = special_marks(tok, HARMONY_MARKS)
    assert specials == {"<|call|>"}
    grammar = compile_grammar("lark", forced_calls_grammar("harmony", TOOLS, False, specials), tok)

    def accepts(text: str, parse_special: bool = True) -> bool:
        c = Constraint(grammar, tok)
        for t in tok.encode(text, add_special=False, parse_special=parse_special):
            if not c.matcher.consume_token(t):
                return False
        return c.matcher.is_accepting()

    call = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>'
    reasoning = "<|channel|>analysis<|message|>Add them: 1 < 2.\nThen call.<|end|><|start|>assistant"
    assert accepts(reasoning + call)
    assert accepts(call)  # the reasoning is optional
    assert not accepts(call.replace("functions.add", "functions.mul"))
    assert not accepts(call.replace('"b": 2', '"b": "two"'))
    assert not accepts(call, parse_special=False)  # "<|call|>" as text is not the control token
    parsed = HarmonyCalls().parse(reasoning + call, ["add"])
    assert parsed.reasoning is not None and [c.name for c in parsed.calls] == ["add"]


def test_a_forced_harmony_call_parses_with_its_reader(tiny: object) -> None:
    """Where the markers are not control tokens (the tiny vocabulary) they are written as text: what a random model
    writes under the grammar - each tool forced in turn, as a named tool_choice does - is read back by the harmony
    reader as one call of that tool whose arguments validate."""
    tok = tiny.tokenizer  # type: ignore[attr-defined]
    assert special_marks(tok, HARMONY_MARKS) == set()
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for tool in TOOLS:
        grammar = compile_grammar("lark", forced_calls_grammar("harmony", [tool], several=False), tok)
        for text in _outputs(tiny, grammar, SEEDS // 8, max_tokens=400):  # an unbounded integer may run long
            parsed = HarmonyCalls().parse(text, params)
            assert [c.name for c in parsed.calls] == [tool["function"]["name"]] and not parsed.content, text
            jsonschema.validate(json.loads(parsed.calls[0].arguments), params[parsed.calls[0].name])


def test_gbnf_and_regex_grammars(tiny: object) -> None:
    tok = tiny.tokenizer  # type: ignore[attr-defined]
    gbnf = compile_grammar("gbnf", 'root ::= ("yes" | "no") " because " [a-z]{1,8}', tok)
    assert all(re.fullmatch(r"(yes|no) because [a-z]{1,8}", t) for t in _outputs(tiny, gbnf, 20))
    regex = compile_grammar("regex", r"[0-9]{3}-[a-z]{2}", tok)
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) for t in _outputs(tiny, regex, 20))


def test_constrained_requests_in_slots(tiny: object) -> None:
    tok = tiny.tokenizer  # type: ignore[attr-defined]
    grammar = compile_grammar("json_schema", SCHEMA, tok)
    br = BatchRunner(tiny.model, tok, 256, "f32", slots=4)  # type: ignore[attr-defined]
    got: list[list[object]] = [[] for _ in range(6)]
    for i, g in enumerate(got):
        req = GenerationRequest(tok.encode("Answer:", add_special=False), max_tokens=120, grammar=grammar,
                                sampling=SamplingParams(temperature=1.0, seed=100 + i))  # fmt: skip
        br.admit(req, g.append) if i < 4 else None
    pending = got[4:]
    while br.busy or pending:
        while pending and br.free:
            req = GenerationRequest(tok.encode("Answer:", add_special=False), max_tokens=120, grammar=grammar,
                                    sampling=SamplingParams(temperature=1.0, seed=200 + len(pending)))  # fmt: skip
            br.admit(req, pending.pop(0).append)
        br.step()
    for events in got:
        done = events[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == "stop"
        jsonschema.validate(json.loads(tok.decode(done.tokens)), SCHEMA)


@pytest.mark.parametrize(
    ("kind", "source", "says"),
    [
        ("json_schema", {"type": "objekt"}, "objekt"),
        ("json_schema", [1, 2], "a JSON schema is an object"),
        ("gbnf", 'root ::= "a" missing', "missing"),
        ("regex", "[a-", "the regex cannot be used"),
    ],
)
def test_a_bad_grammar_is_refused_with_the_reason(tiny: object, kind: str, source: object, says: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(says)):
        compile_grammar(kind, source, tiny.tokenizer)  # type: ignore[arg-type, attr-defined]


@pytest.mark.gpu
def test_a_mask_on_a_card_is_the_hosts_and_is_computed_once_a_token(tiny: object) -> None:
    """Constraint.mask on CUDA logits (one Triton launch, the words prepared while the step ran) gives the CPU
    path's -inf rows, the rows of a padded head past the vocabulary included."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tok = tiny.tokenizer  # type: ignore[attr-defined]
    grammar = compile_grammar("json_schema", SCHEMA, tok)
    on_card, on_host = Constraint(grammar, tok), Constraint(grammar, tok)
    logits = torch.randn(on_card.n_vocab + 40, generator=torch.Generator().manual_seed(3))
    for _ in range(12):
        on_card.prepare(True)
        got = on_card.mask(logits.cuda().to(torch.bfloat16)).cpu()
        want = on_host.mask(logits.to(torch.bfloat16).float())
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        token = int(torch.argmax(want))
        on_card.consume(token)
        on_host.consume(token)
        if on_host.done:
            break
