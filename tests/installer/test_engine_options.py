"""The engine's options: defaults < config file < environment < flags typed, each default written once."""

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from installer.config import ConfigError, StrataConfig, write_config
from installer.engine_options import (
    COMMAND_DEFAULTS,
    COMMANDS,
    ENV,
    EngineOptions,
    OptionsError,
    build_parser,
    check_args,
    from_config,
    merge,
    resolve,
    typed,
)

# Flags with two values each that a config's "args" and a command line can both set: (flag, field, a, b).
PAIRS: list[tuple[str, str, str, str]] = [
    ("--max-context", "max_context", "4096", "8192"),
    ("--vram-reserve-mib", "vram_reserve_mib", "512", "1024"),
    ("--kv", "kv", "int8", "bf16"),
    ("--prefill", "prefill", "256", "auto"),
    ("--port", "port", "8080", "9090"),
    ("--max-queue", "max_queue", "3", "64"),
    ("--spec", "spec", "0", "4"),
    ("--expert-cache", "expert_cache", "100", "200"),
    ("--cpu-ratio", "cpu_ratio", "0.25", "0.5"),
    ("--gpu-order", "gpu_order", "auto", "as_given"),
    ("--threads", "threads", "2", "4"),
    ("--prompt-cache-mib", "prompt_cache_mib", "0", "2048"),
]


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "strata-x.json"
    path.write_text(json.dumps(cfg))
    return path


def test_typed_flags_beat_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported case: the config's 8192 / 1024 lost to the typed 4096 / 512 (which equal the defaults)."""
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    path = _write(tmp_path, {"model": "m.gguf", "max_context": 8192, "args": ["--vram-reserve-mib", "1024"]})
    o = resolve(
        ["serve", "--config", str(path), "--max-context", "4096", "--vram-reserve-mib", "512"], env={}
    )
    assert (o.max_context, o.vram_reserve_mib) == (4096, 512)
    assert (o.source("max_context"), o.source("vram_reserve_mib")) == ("command line", "command line")
    # Untyped, the config's values stand.
    o = resolve(["serve", "--config", str(path)], env={})
    assert (o.max_context, o.vram_reserve_mib, o.source("max_context")) == (8192, 1024, "config")


def test_serve_runs_with_the_typed_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `strata-engine serve` itself: what the server is built from has the typed values."""
    import engine.serve.cli as serve_cli
    from engine.cli import main

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    path = _write(tmp_path, {"model": "m.gguf", "max_context": 8192, "args": ["--vram-reserve-mib", "1024"]})
    seen: list[Any] = []

    def stop(args: Any) -> Any:
        seen.append(args)
        raise serve_cli.ServeError("stopped by the test")

    monkeypatch.setattr(serve_cli, "_split_options", stop)
    rc = main(["serve", "--config", str(path), "--max-context", "4096", "--vram-reserve-mib", "512"])
    assert rc == 2 and len(seen) == 1
    assert (seen[0].max_context, seen[0].vram_reserve_mib, seen[0].model) == (4096, 512, str(model))


def test_the_log_says_which_won(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write(tmp_path, {"model": "m.gguf", "max_context": 8192})
    with caplog.at_level(logging.INFO, logger="strata.options"):
        resolve(["serve", "--config", str(path), "--max-context", "4096"], env={})
    assert "--max-context 4096 from the command line wins over 8192 from strata-x.json" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="strata.options"):
        resolve(["serve", "--config", str(path), "--max-context", "8192"], env={})  # the same value: no line
    assert "wins over" not in caplog.text


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(range(len(PAIRS))), unique=True, max_size=6),
    st.lists(st.sampled_from(range(len(PAIRS))), unique=True, max_size=6),
    st.lists(st.booleans(), min_size=len(PAIRS), max_size=len(PAIRS)),
)
def test_any_flag_given_beats_any_config(in_config: list[int], typed_: list[int], pick: list[bool]) -> None:
    """Random flag/config pairs: a typed flag always wins; a config value wins over the default; the rest default."""
    cfg_args: list[str] = []
    argv: list[str] = ["serve"]
    for i in in_config:
        flag, _, a, b = PAIRS[i]
        cfg_args += [flag, a if pick[i] else b]
    for i in typed_:
        flag, _, a, b = PAIRS[i]
        argv += [flag, b if pick[i] else a]  # the other value than the config's
    cfg = StrataConfig(model="m.gguf", args=tuple(cfg_args))
    given_ = typed(argv)
    from_file, unknown = from_config(cfg, "serve")
    assert unknown == []
    o, notes = merge("serve", given_, from_file)
    defaults = replace(EngineOptions(), **COMMAND_DEFAULTS["serve"])  # serve's own: --max-context auto
    for i, (flag, key, a, b) in enumerate(PAIRS):
        if i in typed_:
            want, where = typed(["serve", flag, b if pick[i] else a])[key], "command line"
        elif i in in_config:
            want, where = typed(["serve", flag, a if pick[i] else b])[key], "config"
        else:
            want, where = getattr(defaults, key), "default"
        assert getattr(o, key) == want, flag
        assert o.source(key) == where, flag
    assert len(notes) == len(set(in_config) & set(typed_))


def test_environment_sits_between_config_and_flags(tmp_path: Path) -> None:
    path = _write(tmp_path, {"model": "m.gguf", "args": ["--api-key", "from-config"]})
    assert resolve(["serve", "--config", str(path)], env={}).api_key == "from-config"
    env = {"STRATA_API_KEY": "from-env", "STRATA_REMOTE_TIMING": "1", "STRATA_ACTIVATIONS": "float"}
    o = resolve(["serve", "--config", str(path)], env=env)
    assert (o.api_key, o.remote_timing, o.activations) == ("from-env", True, "float")
    o = resolve(["serve", "--config", str(path), "--api-key", "typed", "--activations", "int8"], env=env)
    assert (o.api_key, o.activations) == ("typed", "int8")
    with pytest.raises(OptionsError, match="STRATA_ACTIVATIONS is 'fast': set it to int8 or float"):
        resolve(["serve"], env={"STRATA_ACTIVATIONS": "fast"})


def test_every_flag_is_a_field_and_no_parser_holds_a_default() -> None:
    """Defaults live in EngineOptions alone: a parsed command line holds only what was typed."""
    names = {f for f in EngineOptions.__dataclass_fields__ if f != "sources"}
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == set(COMMANDS)
    for command, sub in subs.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.dest in names, f"{command} {action.option_strings}"
            assert action.default is argparse.SUPPRESS, f"{command} {action.option_strings} has a default"
    assert {key for key, _ in ENV.values()} <= names
    assert typed(["serve"]) == {"command": "serve"}


def test_per_command_defaults() -> None:
    assert (
        resolve(["generate", "--prompt", "x"], env={}).temperature == 0.0
    )  # greedy: the same output each run
    assert resolve(["serve"], env={}).temperature == EngineOptions().temperature
    assert resolve(["profile", "--prompts", "p.txt"], env={}).max_tokens == 16
    assert resolve(["generate", "--prompt", "x"], env={}).max_tokens == 128


def test_the_sampling_defaults_are_one_set() -> None:
    from app.settings import Sampling
    from engine.pipeline.sampling import SamplingParams
    from installer.engine_options import SAMPLING

    app, engine = Sampling(), SamplingParams()
    for key in ("temperature", "top_p", "top_k", "min_p"):
        assert getattr(app, key) == getattr(engine, key) == getattr(SAMPLING, key), key


def test_bad_config_args_name_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, {"model": "m.gguf", "args": ["--max-context", "lots"]})
    with pytest.raises(
        OptionsError,
        match=r'"args" in strata-x.json: argument --max-context: .lots. is neither a count of positions nor auto',
    ):
        resolve(["serve", "--config", str(path)], env={})


def test_the_config_writer_checks_args(tmp_path: Path) -> None:
    write_config(StrataConfig(model="m.gguf", args=("--spec", "4")), tmp_path / "strata-a.json")
    with pytest.raises(ConfigError, match="'--no-such-flag', which is not an option of strata-engine serve"):
        write_config(StrataConfig(model="m.gguf", args=("--no-such-flag",)), tmp_path / "strata-b.json")
    with pytest.raises(ConfigError, match="argument --kv: expected one argument"):
        write_config(StrataConfig(model="m.gguf", args=("--kv",)), tmp_path / "strata-c.json")
    assert not (tmp_path / "strata-b.json").exists()
    check_args(["--gpu", "1", "--no-profile"])


def test_every_strata_variable_is_listed_and_model_code_reads_none() -> None:
    """installer.engine_options.ENVIRONMENT names every STRATA_* variable the code uses; model, layer and kernel
    code read no environment of their own (their switches come through runtime_switches)."""
    import ast
    import re

    from installer.engine_options import ENVIRONMENT

    root = Path(__file__).resolve().parents[2]
    used: set[str] = set()
    for package in ("engine", "installer", "app"):
        for path in (root / package).rglob("*.py"):
            used |= set(re.findall(r"\bSTRATA_[A-Z_]+\b", path.read_text(encoding="utf-8")))
    assert used <= set(ENVIRONMENT), sorted(used - set(ENVIRONMENT))
    for package in ("models", "layers", "kernels"):
        for path in (root / "engine" / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                    line = ast.get_source_segment(path.read_text(encoding="utf-8"), node) or ""
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    assert (
                        "TRITON_INTERPRET" in path.read_text(encoding="utf-8").splitlines()[node.lineno - 1]
                    ), f"{where} reads the environment ({line}): read it in installer/engine_options.py"


def test_runtime_switches() -> None:
    from installer.engine_options import runtime_switches

    assert runtime_switches({}) == runtime_switches({"STRATA_ACTIVATIONS": "int8"})
    s = runtime_switches({"STRATA_ACTIVATIONS": "float", "STRATA_NORM_ROUTE": "0", "STRATA_PROMPT_GRAPHS": "0",
                          "STRATA_GEMV_TUNED": "/x.json"})  # fmt: skip
    assert (s.activations, s.norm_route, s.prompt_graphs, s.gemv_tuned) == ("float", False, False, "/x.json")


def test_the_api_key_can_come_from_a_file_and_stays_out_of_the_command_line(tmp_path: Path) -> None:
    from installer.engine_options import OptionsError, resolve

    key = tmp_path / "key.txt"
    key.write_text("s3cret-key\n")
    assert resolve(["serve", "--api-key-file", str(key)], env={}).api_key == "s3cret-key"
    key.write_text("\n")
    with pytest.raises(OptionsError, match="is empty"):
        resolve(["serve", "--api-key-file", str(key)], env={})
    with pytest.raises(OptionsError, match="cannot be read"):
        resolve(["serve", "--api-key-file", str(tmp_path / "none")], env={})
