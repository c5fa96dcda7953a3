"""`strata-engine generate --spec N` prints the same greedy text as without drafts and says how many drafts were
kept; `serve --spec N` answers with those tokens and reports the drafts in its timings; bad values of the window
options are refused with a message, by generate and by serve before it starts."""

import io
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from engine.cli import main
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.serve.cli import cmd_serve
from installer.engine_options import resolve
from tests.engine.serve.harness import start_server


def _generate(model: Path, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = [
        "generate",
        "--model",
        str(model),
        "--device",
        "cpu",
        "--prompt",
        "the cat sat on the mat, the cat",
    ]
    with redirect_stdout(out), redirect_stderr(err):
        rc = main([*argv, "-n", "12", *extra])
    return rc, out.getvalue(), err.getvalue()


def test_generate_with_spec(tiny_models: dict[str, Path]) -> None:
    rc0, plain, err0 = _generate(tiny_models["qwen2"])
    rc4, drafted, err4 = _generate(tiny_models["qwen2"], "--spec", "4")
    assert rc0 == rc4 == 0
    assert drafted == plain
    assert "drafts kept" in err4 and "drafts kept" not in err0


def test_generate_with_the_draft_layer(tiny_models: dict[str, Path]) -> None:
    """`--mtp` (alone: required) drafts from GLM's nextn layer: the same text, and drafts were proposed."""
    _, plain, _ = _generate(tiny_models["glm4moe"])
    rc, drafted, err = _generate(tiny_models["glm4moe"], "--spec", "4", "--suffix-draft", "0", "--mtp")
    assert rc == 0 and drafted == plain
    proposed = int(err.split("drafts kept ")[1].split(" of ")[1].split(",")[0])
    assert proposed > 0
    rc, _, err = _generate(tiny_models["qwen2"], "--spec", "4", "--mtp")
    assert rc == 1 and "--mtp 1: the model has no draft layer" in err


def test_generate_refuses_bad_window_options(tiny_models: dict[str, Path]) -> None:
    rc, _, err = _generate(tiny_models["qwen2"], "--spec", "4", "--pipeline-windows", "1")
    assert rc == 1 and "--pipeline-windows 1: use 0 (off) or 2" in err
    rc, _, err = _generate(tiny_models["qwen2"], "--spec", "-1")
    assert rc == 1 and "--spec -1" in err


def test_serve_refuses_bad_spec(capsys: pytest.CaptureFixture[str]) -> None:
    args = resolve(["serve", "--spec", "99"])
    assert cmd_serve(args) == 2
    assert "--spec 99: give the drafted tokens per window, 0 (off) to 32" in capsys.readouterr().err
    args = resolve(["serve", "--mtp", "1"])
    assert cmd_serve(args) == 2
    assert (
        "--mtp 1 drafts with the model's draft layer in verify windows: give --spec N"
        in capsys.readouterr().err
    )
    args = resolve(["serve", "--spec", "4", "--suffix-draft", "0", "--pipeline-windows", "2", "--mtp", "0"])
    assert (args.spec, args.suffix_draft, args.pipeline_windows, args.mtp) == (4, 0, 2, "0")


@pytest.mark.parametrize(
    ("arch", "flags"),
    [("qwen2", ("--spec", "4")), ("glm4moe", ("--spec", "4", "--suffix-draft", "0", "--mtp", "1"))],
)
def test_serve_with_spec(tiny_models: dict[str, Path], arch: str, flags: tuple[str, ...]) -> None:
    """A server started with --spec 4 answers greedy completions with the tokens of decoding without drafts, and
    reports the drafts in its timings (GLM: drafts from its draft layer only)."""
    prompt = "one two three four, one two three four, one two three"
    lm = load_model(tiny_models[arch], "cpu", "f32")
    ids = lm.tokenizer.encode(prompt, add_special=True, parse_special=True)
    req = GenerationRequest(ids, max_tokens=16, sampling=GREEDY, ignore_eos=True)
    plain = [e for e in Runner(lm.model, lm.tokenizer, 256, "f32").generate(req) if isinstance(e, DoneEvent)]
    srv = start_server(tiny_models[arch], "--device", "cpu", "--threads", "1", *flags)
    try:
        body = {"model": arch, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = srv.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        out = r.json()
    finally:
        srv.stop()
    assert out["choices"][0]["text"] == lm.tokenizer.decode(plain[0].tokens)
    t = out["timings"]
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["predicted_n"] == 16
    if "--mtp" in flags:
        assert t["draft_n"] > 0


@pytest.mark.parametrize(("arch", "slots"), [("qwen2", {"total": 1}), ("glm4moe", None)])
def test_serve_with_spec_and_one_slot(tiny_models: dict[str, Path], arch: str, slots: dict | None) -> None:
    """`--spec 4 --parallel 1`: one slot of the scheduler with windows drafted from earlier context, except for a
    model with a draft layer, whose layer drafts for the one request (the single-sequence runner: no slots)."""
    srv = start_server(
        tiny_models[arch], "--device", "cpu", "--threads", "1", "--spec", "4", "--parallel", "1"
    )
    try:
        body = {
            "model": arch,
            "prompt": "one two three",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = srv.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        got = srv.get("/stats").json()["slots"]
    finally:
        srv.stop()
    assert (got if got is None else {"total": got["total"]}) == slots
    if arch == "glm4moe":  # the draft layer proposes at every window
        assert r.json()["timings"]["draft_n"] > 0


def test_serve_with_spec_and_slots(tiny_models: dict[str, Path]) -> None:
    """`serve --spec 4 --parallel 2`: two clients at once each get the tokens of decoding without drafts, both
    served in slots at once (verify windows per slot), with their drafts kept in their timings."""
    prompts = [
        "one two three four, one two three four, one two three",
        "red green blue, red green blue, red green blue, red",
    ]
    lm = load_model(tiny_models["qwen2"], "cpu", "f32")
    plain = []
    for p in prompts:
        ids = lm.tokenizer.encode(p, add_special=True, parse_special=True)
        req = GenerationRequest(ids, max_tokens=64, sampling=GREEDY, ignore_eos=True)
        done = [
            e for e in Runner(lm.model, lm.tokenizer, 256, "f32").generate(req) if isinstance(e, DoneEvent)
        ]
        plain.append(lm.tokenizer.decode(done[0].tokens))
    srv = start_server(tiny_models["qwen2"], "--device", "cpu", "--threads", "1", "--spec", "4", "--parallel", "2",
                       env={"STRATA_ACTIVATIONS": "float"})  # fmt: skip
    try:
        assert srv.get("/stats").json()["slots"]["total"] == 2

        def ask(p: str) -> dict:
            body = {"model": "qwen2", "prompt": p, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
            r = srv.post("/v1/completions", body)
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(ask, prompts))
    finally:
        srv.stop()
    for out, want in zip(outs, plain, strict=True):
        assert out["choices"][0]["text"] == want
        t = out["timings"]
        assert t["predicted_n"] == 64 and 0 < t["draft_n_accepted"] <= t["draft_n"]
