"""crc32 (the zlib polynomial) at SIMD speed where python-isal is installed, else zlib's."""

from __future__ import annotations

import zlib
from collections.abc import Callable

crc32: Callable[..., int]
"""``crc32(data, value=0)``: identical results to ``zlib.crc32``."""
try:
    from isal.isal_zlib import crc32
except ImportError:  # a platform without isal wheels: same values, slower
    crc32 = zlib.crc32
