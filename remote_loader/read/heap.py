"""Give freed heap memory back to the operating system (glibc's ``malloc_trim``), and keep a
DataLoader worker's large temporaries out of its heap (``mallopt``).

After a large block is freed (the manifest's raw bytes, an epoch split's temporary arrays,
an 8 MiB range, a batch's tensor), glibc raises its mmap threshold, so later large
temporaries come from the heap and stay in the process once freed: in every forked
DataLoader worker, tens of MB at a million shards. Trimming after those steps keeps a
worker's private memory to what it holds. A worker that decodes on its main thread is worse
off: a decode's temporaries, hundreds of KB each, come from the main heap between the
shuffle buffer's samples, and the holes they leave grow the heap for as long as it runs (2
workers decoding 4,000 JPEGs each: 755 MB private each, against 254 MB with the threshold
fixed; docs/performance.md). A fixed threshold keeps each block of 256 KiB or more a
mapping of its own, given back when it is freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

_libc: Any = None
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
LARGE = 256 * 1024
"""The size from which a worker's blocks are mappings of their own: above a sample of
ImageNet's (110 KB), below a decoded image."""
_apart = False  # this process's threshold is fixed (a forked child inherits it)


def _c_library() -> Any:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    return _libc


def keep_large_blocks_apart() -> None:
    """Fix this process's mmap threshold at ``LARGE``: every block that size or larger is
    mapped on its own and unmapped when freed, never left in the heap. Once a process; a
    no-op where the C library has no ``mallopt``. For DataLoader workers that decode or run
    the user's functions, whose memory is the pipeline's: the training process's allocator
    is left as it is, and so is a worker's that only streams bytes (nothing there to keep
    apart: its samples are smaller, its ranges reused)."""
    global _apart
    if not _apart:
        _apart = True
        mallopt = getattr(_c_library() or None, "mallopt", None)
        if mallopt is not None:
            mallopt(_M_MMAP_THRESHOLD, LARGE)


def release_free_memory() -> None:
    """Return free heap pages to the OS; a no-op where the C library has no ``malloc_trim``."""
    trim = getattr(_c_library() or None, "malloc_trim", None)
    if trim is not None:
        trim(0)
