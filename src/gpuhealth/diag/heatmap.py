"""The fabric probe's pair matrix as a PNG a person can read, with no imaging library (zlib only).

Row i, column j: bandwidth from node i to node j as a share of the probe's reference (``fabric.judge``),
coloured red (0) → yellow (the slow line) → green (1 and above); dark grey: not measured; the diagonal
white. Node indices label the rows (senders, left) and columns (receivers, top); a colour bar with
the slow line sits underneath. The JSON beside it maps index → node name.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence

RGB = tuple[int, int, int]

# 3×5 digits, one row per string of 3 bits (1 = ink).
_DIGITS = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    ".": ("000", "000", "000", "000", "010"),
}
WHITE: RGB = (255, 255, 255)
BLACK: RGB = (0, 0, 0)
MISSING: RGB = (90, 90, 90)
DIAGONAL: RGB = (235, 235, 235)


def colour(ratio: float, slow: float) -> RGB:
    """Red below the slow line fading to yellow at it, yellow to green from it to 1."""
    r = max(0.0, min(1.0, ratio))
    if r < slow:
        t = r / slow if slow > 0 else 1.0
        return (220, int(40 + 160 * t), 40)
    t = (r - slow) / (1 - slow) if slow < 1 else 1.0
    return (int(220 - 180 * t), int(200 - 20 * t), 40)


class _Canvas:
    def __init__(self, w: int, h: int) -> None:
        self.w, self.h = w, h
        self.px = [bytearray(WHITE * w) for _ in range(h)]

    def rect(self, x: int, y: int, w: int, h: int, c: RGB) -> None:
        row = bytes(c) * max(0, min(w, self.w - x))
        for yy in range(max(0, y), min(self.h, y + h)):
            self.px[yy][3 * x:3 * x + len(row)] = row

    def text(self, x: int, y: int, s: str, scale: int = 1) -> None:
        for ch in s:
            glyph = _DIGITS.get(ch)
            if glyph:
                for gy, bits in enumerate(glyph):
                    for gx, bit in enumerate(bits):
                        if bit == "1":
                            self.rect(x + gx * scale, y + gy * scale, scale, scale, BLACK)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.px)

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def layout(n: int) -> tuple[int, int, int, int]:
    """(left, top, cell size, text scale): where cell (i, j) starts is (left + j·cell, top + i·cell)."""
    cell = max(3, min(28, 900 // max(n, 1)))
    scale = 2 if cell >= 16 else 1
    label = 4 * scale * len(str(max(n - 1, 0))) + 4
    return label, label, cell, scale


def render(n: int, ratios: Mapping[tuple[int, int], float], slow_fraction: float) -> bytes:
    """PNG bytes of the n×n matrix of ``ratios[(src, dst)]``."""
    left, top, cell, scale = layout(n)
    bar_h = 12
    w = left + n * cell + 4
    h = top + n * cell + 8 + bar_h + 7 * scale + 4
    cv = _Canvas(max(w, 140), h)
    step = 1 if cell >= 4 * scale * len(str(n)) + 2 else max(1, (4 * scale * len(str(n)) + 2) // cell + 1)
    for i in range(n):
        if i % step == 0:
            cv.text(2, top + i * cell + max(0, (cell - 5 * scale) // 2), str(i), scale)
            cv.text(left + i * cell + 1, 2, str(i), scale)
        for j in range(n):
            c = DIAGONAL if i == j else (colour(ratios[(i, j)], slow_fraction) if (i, j) in ratios else MISSING)
            cv.rect(left + j * cell, top + i * cell, cell - (1 if cell > 4 else 0), cell - (1 if cell > 4 else 0), c)
    y = top + n * cell + 6
    bar_w = cv.w - left - 4
    for x in range(bar_w):
        cv.rect(left + x, y, 1, bar_h, colour(x / max(bar_w - 1, 1), slow_fraction))
    cv.rect(left + int(slow_fraction * (bar_w - 1)), y - 2, 1, bar_h + 4, BLACK)  # the slow line
    cv.text(left, y + bar_h + 2, "0", scale)
    cv.text(left + int(slow_fraction * (bar_w - 1)) - 4 * scale, y + bar_h + 2, f"{slow_fraction:g}", scale)
    cv.text(left + bar_w - 4 * scale, y + bar_h + 2, "1", scale)
    return cv.png()


def read_png_rgb(data: bytes) -> tuple[int, int, Sequence[bytes]]:
    """Decode what ``render`` writes (8-bit RGB, filter 0): width, height, rows. For tests and tools."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, w, h, idat = 8, 0, 0, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = 3 * w + 1
    return w, h, [raw[y * stride + 1:(y + 1) * stride] for y in range(h)]


__all__ = ["colour", "layout", "read_png_rgb", "render"]
