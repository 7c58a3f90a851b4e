"""What a value given to the library must be: checks that name the value and what was wrong
in one line (a ConfigError, or a TypeError for an index), and values shown short in messages."""

from __future__ import annotations

import decimal
import math
import numbers
import operator
import os
import re
import reprlib

from remote_loader.errors import ConfigError

_SHOWN = reprlib.Repr()  # Python 3.11's takes its limits as attributes
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxset = 6
_SHOWN.maxdict, _SHOWN.maxlevel = 4, 2


def shown(value: object) -> str:
    """``repr(value)`` cut short for a one-line message: a list of a million items, or a
    string of megabytes, a state dict's field may hold, named by its first few."""
    return _SHOWN.repr(value)


def one_line(text: object) -> str:
    """``str(text)`` with its control characters (a newline, a terminal's escape sequence)
    written as escapes (``\\n``, ``\\x1b``): a message that quotes what a user's code or a
    store said stays on one line and sends a terminal nothing but text."""
    text = str(text)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def require_int(name: str, value: object, low: int | None = None, high: int | None = None, *,
                error: type[ConfigError] = ConfigError, exact: bool = False) -> int:
    """``value`` if it is an int (not a bool) within ``low..high``; else ``error`` (a
    ConfigError) naming ``name``. ``exact``: only ``int`` itself, as a state dict decoded
    from JSON or msgpack holds (not a numpy integer)."""
    bounds = "" if low is None and high is None else f" >= {low}" if high is None else \
        f" in {low}..{high}" if low is not None else f" <= {high}"
    try:
        if isinstance(value, bool) or (exact and type(value) is not int):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{name} must be an integer{bounds}, got {shown(value)}") from None
    if (low is not None and number < low) or (high is not None and number > high):
        raise error(f"{name} must be an integer{bounds}, got {number}")
    return number


def as_index(value: object, what: str) -> int:
    """``value`` as an index: an int, numpy's or torch's (0-d); else a TypeError naming
    ``what``. A bool, a float (never taken for its floor) or an array of one item is refused."""
    try:
        boolean = isinstance(value, bool) or str(getattr(value, "dtype", "")).endswith("bool")
        if boolean or getattr(value, "ndim", 0) != 0:
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} is an int, got {type(value).__name__} {shown(value)}") from None


def require_path(name: str, value: object) -> str:
    """``value`` as a path's string: a str or ``os.PathLike`` naming something (not ``""``,
    which a Path takes for the current directory, nor a NUL byte); else a ConfigError naming ``name``."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text or "\0" in text:
        raise ConfigError(f"{name} must be a path (a str or pathlib.Path), got {type(value).__name__} {shown(value)}")
    return text


def require_bool(name: str, value: object, *, optional: bool = False) -> bool | None:
    """``value`` if it is a bool, numpy's too (or None when ``optional``); else a ConfigError naming ``name``."""
    if isinstance(value, bool) or (optional and value is None):
        return value if isinstance(value, bool) else None
    if str(getattr(value, "dtype", "")) == "bool" and getattr(value, "ndim", None) == 0:  # np.bool_, read from an array
        return bool(value)
    raise ConfigError(f"{name} must be True or False{' or None' if optional else ''}, got {shown(value)}")


def seconds(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a finite number of seconds (numpy's numbers too), > 0 where ``positive``,
    else >= 0; ConfigError naming ``name`` otherwise (a bool, a string, nan, inf)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        seconds = float(value)
        if seconds > 0 or (seconds == 0 and not positive):
            return seconds
    raise ConfigError(f"{name} must be a finite number of seconds {'>' if positive else '>='} 0, got {shown(value)}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


MOST_BYTES = 2**63 - 1
"""The largest byte count ``parse_bytes`` takes: the largest a file can be (a larger one is a typo)."""


def parse_bytes(name: str, value: object) -> int:
    """A byte count from 1 to ``MOST_BYTES``: an int, or a string such as ``"500G"``,
    ``"1.5TB"``, ``"64GiB"`` (decimal units; ``i`` for binary ones) that comes to a whole
    number of bytes; ConfigError naming ``name`` otherwise."""
    count: object = value
    if isinstance(value, str):
        found = _SIZE.match(value)
        if found is None:
            raise ConfigError(f"{name} must be a number of bytes such as 500G or 64GiB, got {shown(value)}")
        digits, unit = found.group(1), (found.group(2) or "").upper().removesuffix("B")
        with decimal.localcontext() as exact:  # digits enough for the product: nothing rounded
            exact.prec = len(digits) + 20
            exact_count = decimal.Decimal(digits) * _UNITS[unit]
            if exact_count != exact_count.to_integral_value():
                raise ConfigError(f"{name} must be a whole number of bytes, got {shown(value)}")
        count = int(exact_count) if exact_count <= MOST_BYTES else MOST_BYTES + 1  # not an int of 1000 digits
    number = require_int(name, count, low=1)
    if number > MOST_BYTES:
        raise ConfigError(f"{name} must be at most {MOST_BYTES} bytes, got {shown(value)}")
    return number
