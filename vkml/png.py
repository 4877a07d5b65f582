"""A tiny PNG writer and raster canvas (numpy + zlib), so figures need no imaging library.

`Canvas` draws filled rectangles, polylines and text in a 5x7 bitmap font on an RGB array;
`write_png` stores any (h, w) grey or (h, w, 3) RGB uint8 array as an 8-bit PNG.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence

import numpy as np

Color = tuple[int, int, int]

# 5x7 glyphs, one string per row, '#' = ink. Only what figure labels need: upper case, digits
# and a little punctuation; `Canvas.text` upper-cases its input and draws unknowns as blanks.
_GLYPHS: dict[str, tuple[str, ...]] = {
    "A": (" ### ", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"),
    "B": ("#### ", "#   #", "#   #", "#### ", "#   #", "#   #", "#### "),
    "C": (" ### ", "#   #", "#    ", "#    ", "#    ", "#   #", " ### "),
    "D": ("#### ", "#   #", "#   #", "#   #", "#   #", "#   #", "#### "),
    "E": ("#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"),
    "F": ("#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#    "),
    "G": (" ### ", "#   #", "#    ", "# ###", "#   #", "#   #", " ####"),
    "H": ("#   #", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"),
    "I": (" ### ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "),
    "J": ("  ###", "   # ", "   # ", "   # ", "   # ", "#  # ", " ##  "),
    "K": ("#   #", "#  # ", "# #  ", "##   ", "# #  ", "#  # ", "#   #"),
    "L": ("#    ", "#    ", "#    ", "#    ", "#    ", "#    ", "#####"),
    "M": ("#   #", "## ##", "# # #", "# # #", "#   #", "#   #", "#   #"),
    "N": ("#   #", "#   #", "##  #", "# # #", "#  ##", "#   #", "#   #"),
    "O": (" ### ", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "),
    "P": ("#### ", "#   #", "#   #", "#### ", "#    ", "#    ", "#    "),
    "Q": (" ### ", "#   #", "#   #", "#   #", "# # #", "#  # ", " ## #"),
    "R": ("#### ", "#   #", "#   #", "#### ", "# #  ", "#  # ", "#   #"),
    "S": (" ####", "#    ", "#    ", " ### ", "    #", "    #", "#### "),
    "T": ("#####", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  "),
    "U": ("#   #", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "),
    "V": ("#   #", "#   #", "#   #", "#   #", "#   #", " # # ", "  #  "),
    "W": ("#   #", "#   #", "#   #", "# # #", "# # #", "# # #", " # # "),
    "X": ("#   #", "#   #", " # # ", "  #  ", " # # ", "#   #", "#   #"),
    "Y": ("#   #", "#   #", " # # ", "  #  ", "  #  ", "  #  ", "  #  "),
    "Z": ("#####", "    #", "   # ", "  #  ", " #   ", "#    ", "#####"),
    "0": (" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "),
    "1": ("  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "),
    "2": (" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"),
    "3": ("#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "),
    "4": ("   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "),
    "5": ("#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "),
    "6": ("  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "),
    "7": ("#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "),
    "8": (" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "),
    "9": (" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "),
    ".": ("     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "),
    ",": ("     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   "),
    ":": ("     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "),
    "-": ("     ", "     ", "     ", "#####", "     ", "     ", "     "),
    "/": ("     ", "    #", "   # ", "  #  ", " #   ", "#    ", "     "),
    "%": ("##   ", "##  #", "   # ", "  #  ", " #   ", "#  ##", "   ##"),
    "=": ("     ", "     ", "#####", "     ", "#####", "     ", "     "),
    "(": ("   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "),
    ")": (" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "),
}
GLYPH_W, GLYPH_H = 5, 7
_BITMAPS = {c: np.array([[p == "#" for p in row] for row in rows])
            for c, rows in _GLYPHS.items()}


class Canvas:
    """An RGB uint8 image with the few drawing operations figures need; coordinates are
    (x, y) pixels from the top-left corner, and drawing is clipped to the canvas."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        self.pixels = np.empty((height, width, 3), np.uint8)
        self.pixels[:] = background

    @property
    def width(self) -> int:
        return self.pixels.shape[1]

    @property
    def height(self) -> int:
        return self.pixels.shape[0]

    def rect(self, x: int, y: int, w: int, h: int, color: Color) -> None:
        x0, y0 = max(x, 0), max(y, 0)
        self.pixels[y0:max(y + h, 0), x0:max(x + w, 0)] = color

    def frame(self, x: int, y: int, w: int, h: int, color: Color, thickness: int = 1) -> None:
        """The outline of a rectangle, drawn inside its bounds."""
        t = thickness
        self.rect(x, y, w, t, color)
        self.rect(x, y + h - t, w, t, color)
        self.rect(x, y, t, h, color)
        self.rect(x + w - t, y, t, h, color)

    def image(self, x: int, y: int, grey: np.ndarray, scale: int = 1) -> None:
        """Paste a grey image with values in [0, 1], each pixel a `scale` x `scale` block."""
        big = np.kron(np.clip(grey, 0.0, 1.0), np.ones((scale, scale)))
        h, w = big.shape
        self.pixels[y:y + h, x:x + w] = np.round(big * 255).astype(np.uint8)[..., None]

    def polyline(self, xs: Sequence[float], ys: Sequence[float], color: Color,
                 thickness: int = 1) -> None:
        """Connect the points in order, sampling each segment densely enough to leave no gaps."""
        px, py = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
        if len(px) == 1:
            px, py = np.repeat(px, 2), np.repeat(py, 2)
        for x0, y0, x1, y1 in zip(px[:-1], py[:-1], px[1:], py[1:]):
            n = int(max(abs(x1 - x0), abs(y1 - y0))) + 2
            t = np.linspace(0.0, 1.0, n)
            xi = np.round(x0 + t * (x1 - x0)).astype(int)
            yi = np.round(y0 + t * (y1 - y0)).astype(int)
            for d in range(thickness):
                ys_, xs_ = yi + d - thickness // 2, xi
                keep = (ys_ >= 0) & (ys_ < self.height) & (xs_ >= 0) & (xs_ < self.width)
                self.pixels[ys_[keep], xs_[keep]] = color

    def text(self, x: int, y: int, s: str, color: Color = (0, 0, 0), scale: int = 1) -> int:
        """Draw `s` with its top-left corner at (x, y); returns the x just past its end."""
        for ch in s.upper():
            bitmap = _BITMAPS.get(ch)
            if bitmap is not None:
                ink = np.kron(bitmap, np.ones((scale, scale), bool))
                ys, xs = np.nonzero(ink)
                ys, xs = ys + y, xs + x
                keep = (ys >= 0) & (ys < self.height) & (xs >= 0) & (xs < self.width)
                self.pixels[ys[keep], xs[keep]] = color
            x += (GLYPH_W + 1) * scale
        return x

    def upscaled(self, factor: int) -> np.ndarray:
        """The pixels enlarged `factor` times by repetition: crisp text for high-DPI viewers."""
        return self.pixels.repeat(factor, axis=0).repeat(factor, axis=1)


def text_width(s: str, scale: int = 1) -> int:
    return len(s) * (GLYPH_W + 1) * scale - scale if s else 0


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes for a (h, w) grey or (h, w, 3) RGB uint8 array (8 bits, no filtering)."""
    if pixels.dtype != np.uint8 or pixels.ndim not in (2, 3) or (
            pixels.ndim == 3 and pixels.shape[2] != 3):
        raise ValueError(f"expected a uint8 (h, w) or (h, w, 3) array, got {pixels.dtype} "
                         f"{pixels.shape}")
    h, w = pixels.shape[:2]
    color_type = 0 if pixels.ndim == 2 else 2
    rows = np.ascontiguousarray(pixels).reshape(h, -1)
    # Each scanline starts with its filter type; 0 (none) is valid and zlib does the rest.
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rows], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", w, h, 8, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def write_png(path: str | os.PathLike, pixels: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(encode_png(pixels))
