"""The icon files in resources/: up to date with packaging/make_icons.py, readable by Qt's own decoders, and the same
picture as the icon the app draws for its windows and tray (app/ui/icons.py)."""

import importlib.util
import os
import struct
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QByteArray, Qt
from PySide6.QtGui import QImage, QImageReader
from PySide6.QtWidgets import QApplication

ROOT = Path(__file__).resolve().parents[2]
RESOURCES = ROOT / "resources"


def _make_icons():  # packaging/ is scripts, not a package
    spec = importlib.util.spec_from_file_location("make_icons", ROOT / "packaging" / "make_icons.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_icons"] = module
    spec.loader.exec_module(module)
    return module


make_icons = _make_icons()


@pytest.fixture(scope="module", autouse=True)
def qapp() -> QApplication:
    return QApplication.instance() or QApplication([])


def _argb(img: QImage) -> QImage:
    return img.convertToFormat(QImage.Format.Format_ARGB32)


def _mean_abs_diff(a: QImage, b: QImage) -> float:
    a, b = _argb(a), _argb(b)
    assert a.size() == b.size()
    da = bytes(a.constBits())[: a.sizeInBytes()]
    db = bytes(b.constBits())[: b.sizeInBytes()]
    return sum(abs(x - y) for x, y in zip(da, db, strict=True)) / len(da)


def test_committed_icons_are_what_the_script_writes(tmp_path: Path) -> None:
    """The SVG is text the script writes: byte for byte. The PNG and ICO bytes depend on the Qt build that renders and
    encodes them (its rasterizer, its zlib), so they are compared as pictures: the committed files decode to what this
    machine's Qt renders from the same SVG, within anti-aliasing noise."""
    written = make_icons.write_icons(tmp_path)
    assert {p.name for p in written} == {
        "polystrata.svg",
        "polystrata.ico",
        *(f"polystrata-{s}.png" for s in make_icons.PNG_SIZES),
    }
    assert (RESOURCES / "polystrata.svg").read_bytes() == (tmp_path / "polystrata.svg").read_bytes(), (
        "resources/polystrata.svg is out of date: run packaging/make_icons.py"
    )
    for size in make_icons.PNG_SIZES:
        name = f"polystrata-{size}.png"
        committed, fresh = QImage(str(RESOURCES / name)), QImage(str(tmp_path / name))
        assert not committed.isNull() and (committed.width(), committed.height()) == (size, size), name
        assert _mean_abs_diff(committed, fresh) < 1.0, (
            f"resources/{name} is out of date: run packaging/make_icons.py"
        )
    committed_ico = (RESOURCES / "polystrata.ico").read_bytes()
    fresh_ico = (tmp_path / "polystrata.ico").read_bytes()
    assert committed_ico[:6] == fresh_ico[:6]  # the same number of entries


@pytest.mark.parametrize("size", [16, 24, 32, 48, 64, 128, 256, 512])
def test_png_is_the_apps_own_icon(size: int) -> None:
    from app.ui.icons import app_icon

    png = QImage(str(RESOURCES / f"polystrata-{size}.png"))
    assert not png.isNull() and (png.width(), png.height()) == (size, size)
    assert png.hasAlphaChannel()
    # The app draws its icon with QPainter; the PNG is the SVG rendered by QSvgRenderer. Same picture, edge pixels
    # anti-aliased a little differently: compare the mean difference per channel (0-255).
    drawn = app_icon().pixmap(size, size).toImage()
    if drawn.width() < size:  # the app draws up to 256 px: compare the 512 px file at that size
        png = png.scaled(drawn.size(), mode=Qt.TransformationMode.SmoothTransformation)
    assert _mean_abs_diff(png, drawn) < 1.0
    corner = png.pixelColor(0, 0)
    assert corner.alpha() == 0  # transparent background


def test_ico_holds_every_size_and_decodes_to_the_pngs() -> None:
    data = (RESOURCES / "polystrata.ico").read_bytes()
    reserved, kind, count = struct.unpack_from("<HHH", data)
    assert (reserved, kind) == (0, 1)
    sizes = []
    for i in range(count):
        w, h, _, _, planes, bpp, length, offset = struct.unpack_from("<BBBBHHII", data, 6 + 16 * i)
        assert (planes, bpp) == (1, 32) and w == h
        assert offset + length <= len(data)
        sizes.append(w or 256)
    assert sizes == list(make_icons.ICO_SIZES)

    # Qt's ICO plugin is an independent decoder of both entry kinds (bitmap and PNG).
    reader = QImageReader(str(RESOURCES / "polystrata.ico"), QByteArray(b"ico"))
    assert reader.imageCount() == count
    for i, size in enumerate(sizes):
        assert reader.jumpToImage(i)
        img = reader.read()
        assert not img.isNull(), reader.errorString()
        assert (img.width(), img.height()) == (size, size)
        png = QImage(str(RESOURCES / f"polystrata-{size}.png"))
        assert _mean_abs_diff(img, png) < 0.5


def test_svg_renders_and_is_transparent_outside_the_strata() -> None:
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(RESOURCES / "polystrata.svg"))
    assert renderer.isValid()
    img = make_icons.render((RESOURCES / "polystrata.svg").read_bytes(), 64)
    assert img.pixelColor(32, 2).alpha() == 0  # above the top stratum
    assert img.pixelColor(32, 16).alpha() == 255  # inside it
    assert img.pixelColor(32, 16).name() == "#3b6fb6"
    assert img.pixelColor(0, 0).alpha() == 0
