"""strata-<model>.json: round trips, the seed's forms of "layer_split", and errors that say how to fix them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from installer import config as cfg
from installer.config import ConfigError, StrataConfig, Worker


def test_round_trip_through_the_file(tmp_path: Path) -> None:
    c = StrataConfig(
        model="/models/Qwen3-30B-A3B-Instruct-2507-Q4_K_M.gguf",
        gpu=(0, 2, 1),
        layer_split=(24, 36),
        gpu_order="as_given",
        args=("--spec", "4"),
        workers=(Worker("192.168.1.20", 7070, 40, 44), Worker("pc-b.local", 7071, 44, 48)),
        max_context=32768,
        kv="int8",
    )
    path = cfg.write_config(c, tmp_path / "strata-x.json")
    assert cfg.read_config(path) == c
    data = json.loads(path.read_text())
    assert data["layer_split"] == [24, 36] and data["gpu"] == [0, 2, 1]
    assert data["workers"][0] == {"host": "192.168.1.20", "port": 7070, "begin": 40, "end": 44}
    assert [p.name for p in tmp_path.iterdir()] == ["strata-x.json"]  # no temp file left behind


def test_the_seed_forms_of_layer_split() -> None:
    base = {"model": "m.gguf", "gpu": [0, 1, 2, 3]}
    assert cfg.parse_config({**base, "layer_split": "24,36,42"}).layer_split == (24, 36, 42)
    assert cfg.parse_config({**base, "layer_split": [24, 36, 42]}).layer_split == (24, 36, 42)
    assert cfg.parse_config({**base, "layer_split": "auto"}).layer_split == "auto"
    assert cfg.parse_config({"model": "m.gguf", "gpu": [0, 2]}).layer_split == "auto"
    assert cfg.parse_config({"model": "m.gguf", "gpu": 1}).gpu == (1,)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"model": "m.gguf", "gpu": [0, 1, 2], "layer_split": [36, 24]},
            r"the numbers must rise.*e.g. \[24, 36\]",
        ),
        (
            {"model": "m.gguf", "gpu": [0, 1], "layer_split": "24,36"},
            r"has 2 number\(s\) for 2 card\(s\).*give 1",
        ),
        ({"model": "m.gguf", "gpu": [0, 1], "layer_split": "24;36"}, r'expected "auto" or the first layer'),
        ({"model": "m.gguf", "gpu": [0, 1], "layer_split": [0]}, "layer numbers start at 1"),
        ({"model": "m.gguf", "layer_split": [24]}, r'"gpu" is empty: name the cards'),
        ({"model": "m.gguf", "gpu": [0, 0]}, "a card is named twice"),
        ({"model": "m.gguf", "gpu": [True]}, "expected a list of card numbers"),
        ({"model": "m.gguf", "gpu": [-1]}, "card numbers start at 0"),
        ({"model": ""}, r'needs "model": the path of the \.gguf file'),
        ({"gpu": [0]}, r'needs "model"'),
        (
            {"model": "m.gguf", "gpu_order": "fastest"},
            r'"gpu_order" .* expected "auto" \(faster card last\) or "as_given"',
        ),
        ({"model": "m.gguf", "args": "--spec 4"}, r'expected a list of strings, e.g. \["--spec", "4"\]'),
        ({"model": "m.gguf", "kv": "fp8"}, "expected one of bf16, int8"),
        ({"model": "m.gguf", "max_context": 0}, "expected a positive number of tokens"),
        ({"model": "m.gguf", "gpus": [0]}, "unknown key 'gpus': the keys are model, gpu, layer_split"),
        (
            {"model": "m.gguf", "workers": [{"host": "a", "port": 70000, "begin": 1, "end": 2}]},
            "between 1 and 65535",
        ),
        (
            {"model": "m.gguf", "workers": [{"host": "a", "port": 7, "begin": 5, "end": 5}]},
            "1 <= begin < end",
        ),
        ({"model": "m.gguf", "workers": [{"host": "a", "port": 7, "begin": 5}]}, "missing key 'end'"),
        (
            {
                "model": "m.gguf",
                "workers": [
                    {"host": "a", "port": 7, "begin": 5, "end": 9},
                    {"host": "b", "port": 7, "begin": 8, "end": 12},
                ],
            },
            "must equal the previous worker's end 9",
        ),
        (
            {"model": "m.gguf", "workers": [{"host": "bad host!", "port": 7, "begin": 5, "end": 9}]},
            "is not a host name",
        ),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_errors_say_what_is_wrong_and_how_to_fix_it(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg.parse_config(data, "strata-x.json")


def test_model_layers_bound_the_split() -> None:
    with pytest.raises(ConfigError, match=r"the model has 48 layers .* below 48"):
        cfg.parse_config({"model": "m", "gpu": [0, 1], "layer_split": [48]}, layers=48)
    with pytest.raises(ConfigError, match="past the model's 48 layers"):
        cfg.parse_config(
            {"model": "m", "workers": [{"host": "a", "port": 7, "begin": 40, "end": 49}]}, layers=48
        )


def test_read_reports_the_file_and_position(tmp_path: Path) -> None:
    path = tmp_path / "strata-m.json"
    path.write_text('{"model": "m.gguf",\n "gpu": [0, 1,]}')
    with pytest.raises(ConfigError, match=r"strata-m.json is not valid JSON \(line 2, column"):
        cfg.read_config(path)
    with pytest.raises(ConfigError, match="does not exist: run strata-setup"):
        cfg.read_config(tmp_path / "strata-none.json")
    with pytest.raises(ConfigError, match="numbers must rise"):
        cfg.write_config(
            StrataConfig("m.gguf", gpu=(0, 1, 2), layer_split=(30, 20)), tmp_path / "strata-w.json"
        )
    assert not (tmp_path / "strata-w.json").exists()


def test_config_dir_and_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(cfg.CONFIG_DIR_ENV, str(tmp_path / "cfg"))
    assert cfg.config_dir() == tmp_path / "cfg"
    assert (
        cfg.config_path("/m/gpt-oss-120b-Q4_K_M-00001-of-00002.gguf")
        == tmp_path / "cfg" / "strata-gpt-oss-120b-q4_k_m.json"
    )
    assert (
        cfg.config_name("qwen3-30b-a3b-instruct-2507-q4_k_m")
        == "strata-qwen3-30b-a3b-instruct-2507-q4_k_m.json"
    )
    assert cfg.config_name("My Model (v2).GGUF") == "strata-my-model-v2.json"
    cfg.write_config(StrataConfig("a.gguf"), cfg.config_path("a.gguf"))
    assert cfg.list_configs() == [tmp_path / "cfg" / "strata-a.json"]
    monkeypatch.delenv(cfg.CONFIG_DIR_ENV)
    monkeypatch.setenv(
        "XDG_CONFIG_HOME", str(tmp_path / "xdg")
    )  # platformdirs' base on Linux; keeps $HOME clean
    assert cfg.config_dir().name == "PolyStrata"  # platformdirs' user config dir for the app


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 100)
    | st.text(max_size=6)
    | st.sampled_from(["auto", "24,36", "as_given", "bf16"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["host", "port", "begin", "end", "x"]), inner, max_size=5)
    ),
    max_leaves=12,
)
_keys = st.sampled_from([*cfg.KEYS, "gpus", "split_skip_if_fits"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=9), st.one_of(st.none(), st.integers(1, 64)))
def test_random_dicts_never_crash(data: dict, layers: int | None) -> None:
    try:
        c = cfg.parse_config(data, "strata-h.json", layers)
    except ConfigError as exc:
        assert str(exc)  # a message, never a bare crash
        return
    assert (
        cfg.parse_config(c.to_dict(), "strata-h.json", layers) == c
    )  # whatever is accepted survives a round trip


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 7), unique=True, min_size=1, max_size=4),
    st.integers(8, 96),
    st.data(),
)
def test_valid_splits_are_accepted(gpus: list[int], layers: int, data: st.DataObject) -> None:
    starts = sorted(
        data.draw(
            st.lists(st.integers(1, layers - 1), unique=True, min_size=len(gpus) - 1, max_size=len(gpus) - 1)
        )
    )
    c = cfg.parse_config(
        {"model": "m.gguf", "gpu": gpus, "layer_split": ",".join(map(str, starts)) or "auto"}, layers=layers
    )
    assert c.layer_split == (tuple(starts) if starts else "auto")
