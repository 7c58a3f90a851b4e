"""Video files told by their first bytes: a member holding one is stored under its
container's extension (``mp4``, ``mov``, ``mkv``, ``webm``, ``avi``), its bytes as they are."""

from __future__ import annotations

VIDEO_EXTENSIONS = frozenset({"mp4", "mov", "mkv", "webm", "avi"})

_QUICKTIME_ATOMS = (b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot")
_EBML = b"\x1a\x45\xdf\xa3"


def video_extension(data: bytes | bytearray | memoryview) -> str | None:
    """The extension of the video container ``data`` starts as, or None: ISO base media
    (``ftyp``: ``mov`` for QuickTime's brand, else ``mp4``), an older QuickTime file that
    opens on another atom (``mov``), Matroska (``webm`` where its DocType says so, else
    ``mkv``), or RIFF AVI."""
    head = bytes(data[:64])
    if len(head) >= 12 and head[4:8] == b"ftyp":
        return "mov" if head[8:12] == b"qt  " else "mp4"
    if len(head) >= 8 and head[4:8] in _QUICKTIME_ATOMS:
        return "mov"
    if head.startswith(_EBML):
        return "webm" if b"webm" in head else "mkv"
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    return None
