"""The strata-setup dialogue with injected input, a fake NVML and a local hub: what it prints and writes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pynvml
import pytest

from installer import setup_cli
from installer.config import default_config
from installer.download import Downloader, DownloadOptions
from installer.gpus import ProbeResult, probe
from installer.setup_cli import main
from installer.version import __version__
from tests.installer.conftest import KIB, blob
from tests.installer.fake_nvml import GTX_1080_TI, RTX_3090, RTX_5080, FakeCard, FakeNvml
from tests.installer.hubserver import Hub
from tests.installer.test_rules_recommend import SEED_CHOICES, SEED_LISTING

REPO = "tiny/Tiny-MoE-GGUF"


def seed_pc() -> ProbeResult:
    return probe(FakeNvml([RTX_5080, GTX_1080_TI, RTX_3090]), others=[])


@pytest.fixture
def setup_env(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions, monkeypatch: pytest.MonkeyPatch
) -> dict:
    part1, part2 = blob(300 * KIB, 21), blob(100 * KIB, 22)
    hub.add(REPO, "Q4/tiny-00001-of-00002.gguf", part1)
    hub.add(REPO, "Q4/tiny-00002-of-00002.gguf", part2)
    catalog = {
        "models": [
            {
                "family": "tiny-moe",
                "display_name": "Tiny MoE",
                "architecture": "qwen3moe",
                "layers": 8,
                "experts": 16,
                "experts_used": 2,
                "context": 4096,
                "geometry": {
                    "hidden_size": 64,
                    "expert_ffn": 32,
                    "kv_heads": 2,
                    "head_dim": 16,
                    "vocab": 1000,
                    "params_total": 200000,
                },
                "variants": [
                    {
                        "id": "tiny-moe-q4",
                        "quant": "Q4_K_M",
                        "hf_repo": REPO,
                        "files": [
                            {"path": "Q4/tiny-00001-of-00002.gguf", "size_bytes": len(part1), "sha256": None},
                            {"path": "Q4/tiny-00002-of-00002.gguf", "size_bytes": len(part2), "sha256": None},
                        ],
                        "size_bytes": len(part1) + len(part2),
                        "size_exact": True,
                    }
                ],
            }
        ]
    }
    cat_path = tmp_path / "catalog.json"
    cat_path.write_text(json.dumps(catalog))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(setup_cli, "ram_bytes", lambda: 32 << 30)  # a PC of 32 GiB, whatever runs the tests
    return {
        "argv": [
            "--catalog",
            str(cat_path),
            "--config-dir",
            str(tmp_path / "cfg"),
            "--models-dir",
            str(tmp_path / "models"),
        ],
        "cfg": tmp_path / "cfg",
        "models": tmp_path / "models",
        "parts": (part1, part2),
        "make": lambda dest: Downloader(dest, options=fast_options),
    }


def run(
    argv: list[str], answers: str, probe_result: ProbeResult, env: dict | None = None
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(
        argv,
        stdin=io.StringIO(answers),
        stdout=out,
        stderr=err,
        probe_fn=lambda: probe_result,
        make_downloader=env["make"] if env else None,
    )
    return code, out.getvalue(), err.getvalue()


def test_seed_dialogue_writes_the_config_and_downloads(setup_env: dict) -> None:
    code, out, err = run(setup_env["argv"], "\n\n", seed_pc(), setup_env)
    assert code == 0, err
    lines = out.splitlines()
    start = lines.index(SEED_LISTING[0])
    assert lines[start : start + 4] == SEED_LISTING
    assert lines[start + 4 : start + 7] == SEED_CHOICES
    assert lines[start + 7].startswith("Which GPUs? [1]: ")
    assert "Which model? [1]: " in out
    # The fit estimate in numbers, in stage order (the faster 5080 last under auto).
    assert "card order: GPU 0 goes last" in out
    assert "fits fully: 128 of 128 routed experts in VRAM" in out
    # Progress lines, then the model and the config.
    assert "[1/2] Q4/tiny-00001-of-00002.gguf" in out and "[2/2] Q4/tiny-00002-of-00002.gguf" in out
    assert " done" in out
    model = setup_env["models"] / "tiny--Tiny-MoE-GGUF" / "tiny-00001-of-00002.gguf"
    assert model.read_bytes() == setup_env["parts"][0]
    assert (model.parent / "tiny-00002-of-00002.gguf").read_bytes() == setup_env["parts"][1]
    config = json.loads((setup_env["cfg"] / "strata-tiny-moe-q4.json").read_text())
    assert config == {
        "model": str(model),
        "gpu": [0, 2],
        "layer_split": "auto",
        "gpu_order": "auto",
        "args": [],
        "workers": [],
        "max_context": 4096,
    }
    assert (
        f"Start it with: strata-engine serve --config {setup_env['cfg'] / 'strata-tiny-moe-q4.json'}" in out
    )
    # the model is in place, so it is this PC's configured model (what --headless serves)
    assert default_config(setup_env["cfg"]) == (setup_env["cfg"] / "strata-tiny-moe-q4.json").resolve()


def test_choosing_the_second_option_after_a_wrong_answer(setup_env: dict) -> None:
    code, out, _ = run(
        [*setup_env["argv"], "--no-download", "--kv", "int8", "--context", "2048"],
        "9\n2\n1\n",
        seed_pc(),
        setup_env,
    )
    assert code == 0
    assert "Please answer with a number from 1 to 3." in out
    assert "Not downloaded (--no-download)" in out
    config = json.loads((setup_env["cfg"] / "strata-tiny-moe-q4.json").read_text())
    assert config["gpu"] == [2] and config["kv"] == "int8" and config["max_context"] == 2048
    assert not setup_env["models"].exists()


def test_named_pascal_card_asks_and_no_stops(setup_env: dict) -> None:
    argv = [*setup_env["argv"], "--gpus", "0,1", "--model", "tiny-moe-q4", "--no-download"]
    code, out, err = run(argv, "n\n", seed_pc(), setup_env)
    assert code == 1
    assert "Warning: GPU 1 (NVIDIA GeForce GTX 1080 Ti) is a Pascal/Volta card" in out
    assert "Use these cards anyway? [y/N]: " in out
    assert "setup stopped" in err and not setup_env["cfg"].exists()
    code, out, _ = run([*argv, "--yes"], "", seed_pc(), setup_env)
    assert code == 0 and "Use these cards anyway" not in out
    assert json.loads((setup_env["cfg"] / "strata-tiny-moe-q4.json").read_text())["gpu"] == [0, 1]


def test_named_unsupported_or_missing_card_is_refused(setup_env: dict) -> None:
    nvml = FakeNvml([RTX_3090, FakeCard("NVIDIA GeForce GTX 980", 4096, (5, 2), cores=2048)])
    code, _, err = run([*setup_env["argv"], "--gpus", "1"], "", probe(nvml, others=[]), setup_env)
    assert (
        code == 2
        and "GPU 1 (NVIDIA GeForce GTX 980) is not supported" in err
        and "cards that can be used: GPU 0" in err
    )
    code, _, err = run([*setup_env["argv"], "--gpus", "5"], "", seed_pc(), setup_env)
    assert code == 2 and "GPU 5 does not exist" in err


def test_no_driver_offers_cpu_mode(setup_env: dict) -> None:
    no_driver = probe(FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), others=[])
    code, out, _ = run(
        [*setup_env["argv"], "--model", "tiny-moe-q4", "--no-download"], "\n", no_driver, setup_env
    )
    assert code == 0
    assert "The NVIDIA driver is installed but not loaded" in out
    assert "Continue in CPU mode (slow)? [Y/n]: " in out
    assert "Fit of Tiny MoE Q4_K_M at 4096 tokens of context (estimate): CPU only" in out
    assert "CPU mode, RAM: weights " in out and "of 30.0 GiB (RAM 32.0 GiB less 2.0 GiB for the PC)" in out
    assert json.loads((setup_env["cfg"] / "strata-tiny-moe-q4.json").read_text())["gpu"] == []
    code, _, err = run([*setup_env["argv"], "--model", "tiny-moe-q4"], "n\n", no_driver, setup_env)
    assert code == 1 and "CPU mode was declined" in err


def test_local_file_is_used_where_it_is(setup_env: dict, tmp_path: Path) -> None:
    local = tmp_path / "mine.gguf"
    local.write_bytes(b"GGUF")
    code, out, _ = run([*setup_env["argv"], "--model", str(local), "--yes"], "", seed_pc(), setup_env)
    assert code == 0 and "Which GPUs? [1]: 1 (--yes)" in out
    config = json.loads((setup_env["cfg"] / "strata-mine.json").read_text())
    assert config["model"] == str(local) and config["gpu"] == [0, 2]
    assert not setup_env["models"].exists()


def test_hub_repo_and_file(setup_env: dict) -> None:
    argv = [*setup_env["argv"], "--model", f"{REPO}:Q4/tiny-00001-of-00002.gguf", "--gpus", "2"]
    code, out, err = run(argv, "", seed_pc(), setup_env)
    assert code == 0, err
    assert "Downloading 2 file(s)" in out
    folder = setup_env["models"] / "tiny--Tiny-MoE-GGUF"
    assert sorted(p.name for p in folder.iterdir()) == [
        "tiny-00001-of-00002.gguf",
        "tiny-00002-of-00002.gguf",
    ]
    config = json.loads((setup_env["cfg"] / "strata-tiny.json").read_text())
    assert config["gpu"] == [2] and config["model"] == str(folder / "tiny-00001-of-00002.gguf")


def test_failed_download_writes_no_config_and_says_how_to_resume(setup_env: dict, hub: Hub) -> None:
    """The config is written once the model is in place: a failed download leaves none (and no configured model)
    that names a file that is not there."""
    hub.files[f"{REPO}/Q4/tiny-00002-of-00002.gguf"].corrupt_offset = 5
    hub.files[f"{REPO}/Q4/tiny-00002-of-00002.gguf"].corrupt_times = 100
    code, out, err = run([*setup_env["argv"], "--yes"], "", seed_pc(), setup_env)
    assert code == 1
    assert "download failed: the sha256 of Q4/tiny-00002-of-00002.gguf is" in err
    assert not (setup_env["cfg"] / "strata-tiny-moe-q4.json").exists()
    assert default_config(setup_env["cfg"]) is None
    assert not (setup_env["models"] / "tiny--Tiny-MoE-GGUF" / "tiny-00002-of-00002.gguf").exists()
    assert " failed - " in out


def test_list_gpus_models_and_version(setup_env: dict, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*setup_env["argv"], "--list-gpus"], "", seed_pc(), setup_env)
    assert code == 0 and SEED_LISTING[1] in out.splitlines() and SEED_CHOICES[0] in out.splitlines()
    code, out, _ = run([*setup_env["argv"], "--list-models"], "", seed_pc(), setup_env)
    assert code == 0 and "tiny-moe-q4" in out and "Tiny MoE Q4_K_M" in out
    code, out, _ = run(["--list-models"], "", seed_pc())
    assert "qwen3-30b-a3b-instruct-2507-q4_k_m" in out and "gemma-3-270m-q4_k_m" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"strata-setup {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--gpus LIST|all" in capsys.readouterr().out


def test_unknown_model_id(setup_env: dict) -> None:
    code, _, err = run([*setup_env["argv"], "--model", "tiny", "--yes"], "", seed_pc(), setup_env)
    assert code == 2 and "Did you mean: tiny-moe-q4" in err
