"""The fit on this PC (installer.recommend.pc_fit, catalog.fits_here): a label per model from the cards, the RAM
and the disk, with the numbers behind it; in CPU mode RAM decides; the first model offered fits."""

from installer.catalog import fits_here, geometry, load_catalog
from installer.recommend import pc_fit
from tests.installer.test_fit import card

GIB = 1 << 30
CATALOG = load_catalog()


def _entry(model_id: str):
    return next(e for e in CATALOG if e.id == model_id)


def test_a_24_gib_pc_without_a_gpu_is_told_the_truth() -> None:
    """The reported case: an 84.8 GB model 'runs' and an 18.6 GB one was offered first on 24 GiB of RAM."""
    rows = fits_here(CATALOG.entries, (), 24 * GIB, 4096)
    labels = {e.id: f.label for e, f in rows}
    assert labels["qwen3-next-80b-a3b-thinking-q8_0"] == "does not fit: RAM"
    assert labels["qwen3-30b-a3b-instruct-2507-q4_k_m"] == "does not fit: RAM"
    assert labels["qwen2.5-coder-0.5b-instruct-q4_k_m"] == "CPU only"
    _, fit = rows[0]
    assert fit.fits and fit.kind == "CPU only"
    assert all(f.fits for _, f in rows[: sum(f.fits for _, f in rows)])  # those that fit come first
    big = pc_fit(geometry(_entry("qwen3-30b-a3b-instruct-2507-q4_k_m")), 18_600_000_000, (), 24 * GIB, 4096)
    assert any("--cpu-weights-mib 0" in line for line in big.lines)  # how it would fit, and at what cost
    assert "RAM 24.0 GiB less 2.0 GiB for the PC" in big.lines[0]


def test_cards_give_all_in_vram_a_share_of_experts_or_not_at_all() -> None:
    e = _entry("qwen3-30b-a3b-instruct-2507-q4_k_m")
    g = geometry(e)
    assert pc_fit(g, e.size_bytes, (card(0, 24_000),), 32 * GIB, 4096).kind == "all in VRAM"
    part = pc_fit(g, e.size_bytes, (card(0, 12_000),), 32 * GIB, 4096)
    assert part.kind == "experts in VRAM" and part.label.endswith("% of experts in VRAM")
    assert 0.2 < part.vram_share < 0.9
    assert any(line.startswith("RAM: experts in host memory") for line in part.lines)
    low_ram = pc_fit(g, e.size_bytes, (card(0, 8_000),), 12 * GIB, 4096)
    assert low_ram.label == "does not fit: RAM"
    tiny_card = pc_fit(g, e.size_bytes, (card(0, 600),), 64 * GIB, 4096)
    assert tiny_card.label == "does not fit: VRAM"
    ranked = sorted(
        [part, low_ram, pc_fit(g, e.size_bytes, (card(0, 24_000),), 32 * GIB, 4096)], key=lambda f: f.rank
    )
    assert [f.kind for f in ranked] == ["all in VRAM", "experts in VRAM", "does not fit"]


def test_a_download_needs_the_disk_and_a_downloaded_model_does_not() -> None:
    e = _entry("gpt-oss-20b-mxfp4")
    fit = pc_fit(geometry(e), e.size_bytes, (card(0, 24_000),), 32 * GIB, 4096, disk_free=5 * GIB)
    assert fit.label == "does not fit: disk" and "5.0 GiB is free" in fit.lines[0]
    rows = fits_here([e], (card(0, 24_000),), 32 * GIB, 4096, disk_free=5 * GIB, downloaded=lambda _: True)
    assert rows[0][1].fits
