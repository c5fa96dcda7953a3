"""Write the PolyStrata icon files into resources/: polystrata.svg, polystrata-<N>.png and polystrata.ico.

The design is the app's own icon (app/ui/icons.py: three stacked strata on a 32-unit grid, in its colours); the SVG is
written from that geometry, the PNGs are the SVG rendered by Qt, and the ICO holds the small sizes as bitmaps and
256 px as PNG (what Windows, PyInstaller and Inno Setup all read). Run it again after changing the design:
    QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/make_icons.py
"""

import argparse
import os
import struct
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

from app.ui.icons import LAYERS

ROOT = Path(__file__).resolve().parent.parent
PNG_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
ICO_SIZES = (16, 24, 32, 48, 64, 256)
ICO_PNG_FROM = 256  # entries this size and up are stored as PNG, smaller ones as 32-bit bitmaps


def svg_text() -> str:
    """The icon on a 32-unit canvas: three rounded bars, 26x6, at y = 5, 13, 21 (app/ui/icons.py's geometry)."""
    bars = "\n".join(
        f'  <rect x="3" y="{5 + 8 * i}" width="26" height="6" rx="2" ry="2" fill="{color}"/>'
        for i, color in enumerate(LAYERS)
    )
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" width="256" height="256" viewBox="0 0 32 32">\n'
        "  <title>PolyStrata</title>\n"
        f"{bars}\n"
        "</svg>\n"
    )


def render(svg: bytes, size: int) -> QImage:
    renderer = QSvgRenderer(QByteArray(svg))
    if not renderer.isValid():
        raise SystemExit("make_icons: Qt could not read the generated SVG")
    img = QImage(size, size, QImage.Format.Format_ARGB32)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(p)
    p.end()
    return img


def png_bytes(img: QImage) -> bytes:
    buf = QByteArray()
    dev = QBuffer(buf)
    dev.open(QIODevice.OpenModeFlag.WriteOnly)
    img.save(dev, "PNG")
    dev.close()
    return bytes(buf.data())


def dib_bytes(img: QImage) -> bytes:
    """An ICO bitmap entry: BITMAPINFOHEADER (height doubled for the mask), BGRA rows bottom-up, then the AND mask."""
    img = img.convertToFormat(QImage.Format.Format_ARGB32)  # little-endian memory order: B, G, R, A
    w, h = img.width(), img.height()
    header = struct.pack("<IiiHHIIiiII", 40, w, 2 * h, 1, 32, 0, 0, 0, 0, 0, 0)
    rows = [bytes(img.constScanLine(y))[: 4 * w] for y in range(h)]
    mask_row = bytes(((w + 31) // 32) * 4)  # all zero: the alpha channel decides transparency
    return header + b"".join(reversed(rows)) + mask_row * h


def ico_bytes(images: dict[int, QImage]) -> bytes:
    entries = [(s, png_bytes(images[s]) if s >= ICO_PNG_FROM else dib_bytes(images[s])) for s in ICO_SIZES]
    out = struct.pack("<HHH", 0, 1, len(entries))
    offset = 6 + 16 * len(entries)
    for size, data in entries:
        dim = 0 if size >= 256 else size  # 0 means 256 in an ICONDIRENTRY
        out += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(data), offset)
        offset += len(data)
    return out + b"".join(data for _, data in entries)


def write_icons(out_dir: Path) -> list[Path]:
    """Write the SVG, the PNGs and the ICO into out_dir; returns the paths written."""
    _app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])
    out_dir.mkdir(parents=True, exist_ok=True)
    svg = svg_text()
    written = [out_dir / "polystrata.svg"]
    written[0].write_text(svg, encoding="utf-8")
    images = {s: render(svg.encode(), s) for s in set(PNG_SIZES) | set(ICO_SIZES)}
    for s in PNG_SIZES:
        path = out_dir / f"polystrata-{s}.png"
        path.write_bytes(png_bytes(images[s]))
        written.append(path)
    ico = out_dir / "polystrata.ico"
    ico.write_bytes(ico_bytes(images))
    written.append(ico)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "resources", help="folder (default: resources/)")
    args = p.parse_args(argv)
    for path in write_icons(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
