"""Test helpers for the report: an HTML tree from html.parser, and the pixels of a PNG."""

import struct
import zlib
from html.parser import HTMLParser

import numpy as np

VOID = {"meta", "br", "hr", "img", "input", "link"}


class Node:
    def __init__(self, tag, attrs, parent=None):
        self.tag, self.attrs, self.parent, self.children, self.text = tag, dict(attrs), parent, [], ""

    def find_all(self, tag=None, cls=None):
        out = []
        for c in self.children:
            if (tag is None or c.tag == tag) and (cls is None or cls in c.attrs.get("class", "").split()):
                out.append(c)
            out += c.find_all(tag, cls)
        return out


class _Builder(HTMLParser):
    def __init__(self):
        super().__init__()
        self.root = self.cur = Node("root", {})

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.cur)
        self.cur.children.append(node)
        if tag not in VOID:
            self.cur = node

    def handle_startendtag(self, tag, attrs):
        self.cur.children.append(Node(tag, attrs, self.cur))

    def handle_endtag(self, tag):
        node = self.cur
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.cur = node.parent

    def handle_data(self, data):
        self.cur.text += data


def parse_html(text: str) -> Node:
    b = _Builder()
    b.feed(text)
    b.close()
    return b.root


def _unfilter_sequential(f: int, line: bytearray, prev, ch: int) -> None:
    """Undo PNG filter 3 (Average) or 4 (Paeth) of one row in place: each byte needs the one
    decoded ``ch`` before it, so byte by byte."""
    for i in range(len(line)):
        a = line[i - ch] if i >= ch else 0
        b, c = prev[i], (prev[i - ch] if i >= ch else 0)
        if f == 3:
            line[i] = (line[i] + (a + b) // 2) & 255
        else:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255


def png_pixels(path: str):
    """(width, height, channels, pixels: uint8 array height × width × channels) of an 8-bit RGB/RGBA
    PNG (what Chromium writes). Rows filtered None, Sub or Up (nearly all of a page: blank rows are
    Up) are undone with numpy; Average and Paeth rows byte by byte."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), (depth, color)
            ch = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    stride = width * ch
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, stride + 1)
    out = np.empty((height, stride), np.uint8)
    prev = np.zeros(stride, np.uint8)
    for y in range(height):
        f, line = int(raw[y, 0]), raw[y, 1:]
        if f == 0:
            out[y] = line
        elif f == 1:  # Sub: each byte plus the decoded one ch before it, a running sum per channel
            out[y] = np.cumsum(line.reshape(width, ch), axis=0, dtype=np.uint8).reshape(stride)
        elif f == 2:  # Up: plus the byte above
            out[y] = line + prev
        else:
            row = bytearray(line.tobytes())
            _unfilter_sequential(f, row, prev.tolist(), ch)
            out[y] = np.frombuffer(bytes(row), np.uint8)
        prev = out[y]
    return width, height, ch, out.reshape(height, width, ch)


def count_color(pixels, hex_color: str, tol: int = 8) -> int:
    """Pixels within ``tol`` of ``hex_color`` in every channel."""
    w, h, ch, rgb = pixels
    want = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)], np.int16)
    return int((np.abs(rgb[..., :3].astype(np.int16) - want) <= tol).all(axis=-1).sum())
