"""Give freed heap memory back to the operating system (glibc's ``malloc_trim``).

After a large block is freed (the manifest's raw bytes, an epoch split's temporary arrays),
glibc raises its mmap threshold, so later large temporaries come from the heap and stay in
the process once freed: in every forked DataLoader worker, tens of MB at a million shards.
Trimming after those steps keeps a worker's private memory to what it holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

_libc: Any = None


def release_free_memory() -> None:
    """Return free heap pages to the OS; a no-op where the C library has no ``malloc_trim``."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is not None:
        trim(0)
