"""Whether an encoded image is whole: a JPEG's structure (an image scan, and the end marker
after it), a PNG's chunks. A file cut short by a failed copy or download reads as an image
by its header, and fails only once decoded: the upload refuses it, the GPU stage (whose
hardware decoder reports an image decoded once it is queued) catches it before decoding."""

from __future__ import annotations

from typing import Any


def structure_problem(data: Any) -> str | None:
    """What makes ``data`` less than a whole JPEG's structure (no image scan, or cut short
    before the end marker that follows its scan), or None. Bytes after the end marker
    (a camera's trailer, padding) are harmless. A GPU's hardware decoder reports an image
    decoded once it is queued, so a JPEG cut short must be caught before it gets there."""
    raw = bytes(data)
    scan = _scan_start(raw)
    if scan is None:
        return "it has no image scan"
    if raw.rfind(b"\xff\xd9") < scan:  # entropy-coded data never holds FF D9: it is the end
        return "it ends before its end-of-image marker"
    return None


def _scan_start(raw: bytes) -> int | None:
    """Where the image's scan (its first SOS segment) starts, walking the segments from the
    start-of-image marker (an EXIF thumbnail inside APP1 is skipped whole), or None."""
    at = 2
    while at + 4 <= len(raw):
        if raw[at] != 0xFF:
            return None
        marker = raw[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
            continue
        if marker == 0xDA:
            return at
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            at += 2
            continue
        at += 2 + int.from_bytes(raw[at + 2 : at + 4], "big")
    return None


def png_cut_short(data: bytes) -> bool:
    """Whether a PNG ends inside a chunk's data (a chunk: its length, type, data and crc, 12
    bytes and its data; a crc cut short Pillow reads past, and a PNG without its ``IEND``
    chunk Pillow reads whole)."""
    at = 8  # the signature's end
    while at + 8 <= len(data) and data[at + 4 : at + 8] != b"IEND":
        at += 12 + int.from_bytes(data[at : at + 4], "big")
    return at - 4 > len(data)
