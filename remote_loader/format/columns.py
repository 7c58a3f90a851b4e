"""The manifest's column arrays: the narrowest little-endian unsigned type for a column,
its encoding, and its checked decoding with ``numpy.frombuffer`` (no copy).

A column must be stored in the narrowest of the four types that holds its values: a reader
refuses a wider one, so a manifest's size, and the memory it takes to open, follow from
its values, whoever wrote it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from remote_loader.errors import CorruptShard

DTYPES: dict[str, np.dtype[Any]] = {
    "<u1": np.dtype("<u1"),
    "<u2": np.dtype("<u2"),
    "<u4": np.dtype("<u4"),
    "<u8": np.dtype("<u8"),
}
LIMIT = 2**63  # every size, offset and the sum of sample counts fit a signed 64-bit integer
MOST_SAMPLES_PER_SHARD = (LIMIT - 1) // 512
"""The most samples a shard can hold: each takes at least a 512-byte tar header, and a shard
is under ``LIMIT`` bytes (docs/FORMAT.md); a count that msgpack holds too."""


def manifest_error(name: str | None, what: str) -> CorruptShard:
    """The error of a manifest ``name`` found malformed: ``what`` says how."""
    return CorruptShard(f"manifest {name}: {what}", name=name)


def narrow(values: np.ndarray) -> np.ndarray:
    """The values in the narrowest little-endian unsigned type that holds them."""
    top = int(values.max()) if len(values) else 0
    for dtype in DTYPES.values():
        if top < 1 << (8 * dtype.itemsize):
            return values.astype(dtype, copy=False)
    raise ValueError(f"value {top} does not fit 64 bits")


def column(values: np.ndarray) -> dict[str, Any]:
    """A column as the manifest stores it: its dtype's name and its bytes."""
    return {
        "dtype": f"<u{values.dtype.itemsize}",
        "data": values.astype(DTYPES[f"<u{values.dtype.itemsize}"]).tobytes(),
    }


def increasing(columns: Sequence[np.ndarray]) -> bool:
    """Whether the rows ``(columns[0][i], columns[1][i], ...)`` are strictly increasing."""
    if not columns or len(columns[0]) < 2:
        return True
    later = np.zeros(len(columns[0]) - 1, dtype=bool)
    for values in reversed(columns):
        a, b = values[:-1], values[1:]
        later = (b > a) | ((b == a) & later)
    return bool(later.all())


def array(column: Any, count: int, what: str, name: str | None) -> np.ndarray:
    """A column's array, after checking its dtype and that its bytes hold exactly ``count`` values."""
    if not isinstance(column, dict) or not isinstance(column.get("dtype"), str) or column["dtype"] not in DTYPES \
            or not isinstance(column.get("data"), bytes):
        raise manifest_error(name, f"{what} is not a map of a dtype ({', '.join(DTYPES)}) and bytes")
    dtype = DTYPES[column["dtype"]]
    if len(column["data"]) != count * dtype.itemsize:
        raise manifest_error(
            name,
            f"{what} holds {len(column['data'])} bytes; {count} values of {dtype.str} need {count * dtype.itemsize}",
        )
    values = np.frombuffer(column["data"], dtype=dtype)
    top = int(values.max()) if count else 0
    if dtype.itemsize > 1 and top < 1 << (4 * dtype.itemsize):  # the next narrower type holds every value
        raise manifest_error(
            name,
            f"{what} is stored as {dtype.str} but its values fit <u{narrow(values).dtype.itemsize}:"
            " a column takes the narrowest type that holds it",
        )
    return values
