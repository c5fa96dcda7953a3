"""The usage profile file: round trip, merge, and every kind of bad file ignored with one warning, never trusted."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from engine.experts.profile import (
    FORMAT,
    VERSION,
    ModelIdentity,
    ProfileRecorder,
    UsageProfile,
    default_profile_path,
    dumps,
    load_profile,
    profile_location,
    save_profile,
    tokens_from_counts,
)
from engine.gguf.reader import GGUFFile
from engine.models.registry import config_for
from engine.testing.tiny_models import write_tiny_model

IDENT = ModelIdentity("qwen3moe", 3, 4, "ab" * 32)


@pytest.fixture(autouse=True)
def _profile_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STRATA_PROFILE_DIR", str(tmp_path / "profiles"))
    return tmp_path / "profiles"


def _profile(seed: int, ident: ModelIdentity = IDENT) -> UsageProfile:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 1000, size=(ident.n_layer, ident.n_expert)).astype(np.int64)
    return UsageProfile(ident, counts, int(rng.integers(1, 10_000)))


def _doc(p: UsageProfile) -> dict:
    return json.loads(dumps(p))


def _one_warning(caplog: pytest.LogCaptureFixture, *words: str) -> str:
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


def test_round_trip_in_the_data_dir(_profile_dir: Path) -> None:
    p = _profile(1)
    path = default_profile_path(IDENT)
    assert path == _profile_dir / f"{IDENT.digest}.json"
    written = save_profile(path, p)
    assert written.tokens == p.tokens
    doc = json.loads(path.read_text(encoding="utf-8"))  # the file as any JSON reader sees it
    assert doc["format"] == FORMAT and doc["version"] == VERSION
    assert doc["model"] == {"architecture": "qwen3moe", "n_layer": 3, "n_expert": 4, "digest": IDENT.digest}
    assert doc["counts"] == p.counts.tolist() and doc["tokens"] == p.tokens
    back = load_profile(path, IDENT)
    assert back is not None
    assert back.identity == IDENT and back.tokens == p.tokens
    assert back.counts.dtype == np.int64
    np.testing.assert_array_equal(back.counts, p.counts)
    assert [f.name for f in _profile_dir.iterdir()] == [path.name]  # no temporary file left behind


def test_saving_adds_to_an_existing_profile(tmp_path: Path) -> None:
    a, b = _profile(1), _profile(2)
    path = tmp_path / "p.json"
    save_profile(path, a)
    total = save_profile(path, b)
    back = load_profile(path, IDENT)
    assert back is not None
    np.testing.assert_array_equal(back.counts, a.counts + b.counts)
    assert back.tokens == a.tokens + b.tokens == total.tokens


def test_a_missing_profile_is_silent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "strata.engine"):
        assert load_profile(tmp_path / "none.json", IDENT) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _with(doc: dict, **change: object) -> bytes:
    return json.dumps({**doc, **change}).encode()


def _bad_files() -> list[tuple[str, bytes, str]]:
    good = _doc(_profile(3))
    text = json.dumps(good).encode()
    counts = good["counts"]
    return [
        ("garbage", bytes(range(256)) * 4, "not UTF-8"),
        ("truncated", text[: len(text) // 2], "not valid JSON"),
        ("empty", b"", "not valid JSON"),
        ("other JSON", b'{"hello": [1, 2]}', "not an expert profile"),
        ("a list", b"[1, 2, 3]", "not an expert profile"),
        ("wrong version", _with(good, version=VERSION + 1), f"version {VERSION + 1}"),
        ("foreign digest", _with(good, model={**good["model"], "digest": "cd" * 32}), "another model file"),
        ("other geometry", _with(good, model={**good["model"], "n_expert": 8}), "differs"),
        ("too few rows", _with(good, counts=counts[:2]), "2 rows"),
        ("short row", _with(good, counts=[counts[0], counts[1][:3], counts[2]]), "row 1 has 3 entries"),
        ("negative count", _with(good, counts=[counts[0], [1, -5, 2, 3], counts[2]]), "-5"),
        ("NaN count", text.replace(b"[" + str(counts[2][0]).encode() + b",", b"[NaN,", 1), "nan"),
        ("fractional count", _with(good, counts=[counts[0], counts[1], [1.5, 2, 3, 4]]), "1.5"),
        ("bool count", _with(good, counts=[counts[0], counts[1], [True, 2, 3, 4]]), "True"),
        ("huge count", _with(good, counts=[counts[0], counts[1], [2**70, 2, 3, 4]]), "outside"),
        ("negative tokens", _with(good, tokens=-1), '"tokens"'),
        ("no tokens", _with(good, tokens=None), '"tokens"'),
    ]


@pytest.mark.parametrize(
    ("data", "why"), [(d, w) for _, d, w in _bad_files()], ids=[n for n, _, _ in _bad_files()]
)
def test_a_bad_profile_is_ignored_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, data: bytes, why: str
) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(data)
    with caplog.at_level(logging.INFO, "strata.engine"):
        assert load_profile(path, IDENT) is None
    _one_warning(caplog, str(path), "ignored", why)


def test_an_unreadable_path_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "dir.json").mkdir()
    with caplog.at_level(logging.INFO, "strata.engine"):
        assert load_profile(tmp_path / "dir.json", IDENT) is None
    _one_warning(caplog, "cannot be read")


def test_saving_over_a_bad_file_keeps_it_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b"\x00garbage")
    p = _profile(4)
    with caplog.at_level(logging.INFO, "strata.engine"):
        written = save_profile(path, p)
    _one_warning(caplog, "p.json.bad")
    assert (tmp_path / "p.json.bad").read_bytes() == b"\x00garbage"
    back = load_profile(path, IDENT)
    assert back is not None and written.tokens == p.tokens  # only the new counts: the bad ones were not added
    np.testing.assert_array_equal(back.counts, p.counts)


def test_another_file_of_the_same_geometry_is_foreign(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ids = []
    for seed in (0, 1):
        path = write_tiny_model(tmp_path / f"m{seed}.gguf", "qwen3moe", qtype="Q8_0", seed=seed)
        gf = GGUFFile.open(path)
        cfg = config_for(gf.architecture, gf.metadata, n_vocab=gf.tensors["token_embd.weight"].shape[0])
        loc, ident = profile_location(gf, cfg)
        assert loc == default_profile_path(ident)
        ids.append(ident)
    a, b = ids
    assert (a.arch, a.n_layer, a.n_expert) == (b.arch, b.n_layer, b.n_expert) == ("qwen3moe", 2, 8)
    assert a.digest != b.digest
    theirs = tmp_path / "a.json"
    save_profile(theirs, _profile(5, a))
    with caplog.at_level(logging.INFO, "strata.engine"):
        assert load_profile(theirs, b) is None
    _one_warning(caplog, "another model file")


def test_tokens_are_read_from_the_counts() -> None:
    counts = np.array(
        [[3, 1, 0, 2], [0, 0, 0, 0], [2, 2, 1, 1]]
    )  # 3 tokens x top-2; layer 1 not counted here
    assert tokens_from_counts(counts, 2) == 3


def test_the_recorder_saves_what_was_added_since_its_last_save(tmp_path: Path) -> None:
    live = np.zeros((3, 4), np.int64)
    live[0, 1] = 7  # counted before the recorder started: not its to save
    path = tmp_path / "p.json"
    rec = ProfileRecorder(path, IDENT, 1, lambda: live.copy(), every_s=3600.0)
    rec.tick()
    assert not path.exists()  # the interval has not passed
    assert rec.save() is None and not path.exists()  # nothing new
    live[:, 2] += 5
    rec.save()
    live[:, 3] += 2
    rec.save()
    back = load_profile(path, IDENT)
    assert back is not None and back.tokens == 7
    np.testing.assert_array_equal(back.counts, [[0, 0, 5, 2]] * 3)
    every = ProfileRecorder(tmp_path / "q.json", IDENT, 1, lambda: live.copy(), every_s=0.0)
    live[1, 0] += 4
    every.tick()
    got = load_profile(tmp_path / "q.json", IDENT)
    assert got is not None and got.counts[1, 0] == 4 and got.counts.sum() == 4
