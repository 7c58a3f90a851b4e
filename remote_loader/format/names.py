"""Shard object names in a manifest: a template with number columns, or a blob of UTF-8
names with offsets; rendered one at a time, checked as a reader must."""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from remote_loader.format.columns import array, column, increasing, manifest_error, narrow

SHARD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$")
NAME_CHARS = re.compile(r"^[A-Za-z0-9_./-]*$")


class Names:
    """The shards' object names, rendered one at a time on demand."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> str:
        raise NotImplementedError

    def encode(self) -> dict[str, Any]:
        raise NotImplementedError


def render(parts: Sequence[str], widths: Sequence[int], numbers: Sequence[int]) -> str:
    """A template's name for one row: ``parts[0] + numbers[0]`` zero-padded to ``widths[0]``
    ``+ parts[1] + ...``."""
    out = [parts[0]]
    for number, width, part in zip(numbers, widths, parts[1:], strict=False):
        out.append(str(number).zfill(width))
        out.append(part)
    return "".join(out)


@dataclass(frozen=True, eq=False)
class TemplateNames(Names):
    """``parts[0] + number(0) + parts[1] + ... + parts[k]``, each number zero-padded to its width."""

    parts: tuple[str, ...]
    widths: tuple[int, ...]
    numbers: tuple[np.ndarray, ...]
    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> str:
        return render(self.parts, self.widths, [int(numbers[i]) for numbers in self.numbers])

    def encode(self) -> dict[str, Any]:
        return {"parts": list(self.parts), "widths": list(self.widths), "numbers": [column(a) for a in self.numbers]}

    def __contains__(self, name: object) -> bool:
        """Whether some row renders as ``name``: its numbers parsed, then a binary search of
        the rows (which increase), so no set of every name is built."""
        if not isinstance(name, str):
            return False
        pattern = r"(\d+)".join(re.escape(p) for p in self.parts)
        found = re.fullmatch(pattern, name)
        if found is None:
            return False
        target = tuple(int(g) for g in found.groups())
        if any(str(v).zfill(w) != g for v, w, g in zip(target, self.widths, found.groups(), strict=True)):
            return False
        row = bisect.bisect_left(range(self.count), target, key=lambda i: tuple(int(a[i]) for a in self.numbers))
        return row < self.count and tuple(int(a[row]) for a in self.numbers) == target

    @classmethod
    def infer(cls, names: Sequence[str]) -> TemplateNames | None:
        """The template all ``names`` follow with their numbers in strictly increasing order, if any."""
        if not names:
            return None
        tokens = [re.split(r"(\d+)", n) for n in names]
        first = tokens[0]
        if any(len(t) != len(first) or t[0::2] != first[0::2] for t in tokens):
            return None
        parts, widths, numbers = [first[0]], [], []
        for j in range(1, len(first), 2):
            runs = [t[j] for t in tokens]
            if all(r == runs[0] for r in runs):
                parts[-1] += runs[0] + first[j + 1]
                continue
            width = min(len(r) for r in runs)
            values = [int(r) for r in runs]
            if any(str(v).zfill(width) != r for v, r in zip(values, runs, strict=True)) or max(values) >= 2**64:
                return None
            widths.append(width)
            numbers.append(np.array(values, dtype=np.uint64))
            parts.append(first[j + 1])
        template = cls(tuple(parts), tuple(widths), tuple(narrow(a) for a in numbers), len(names))
        if not all(template.parts[1:-1]) or not increasing(template.numbers):
            return None
        return template


@dataclass(frozen=True, eq=False)
class BlobNames(Names):
    """Every name's UTF-8 bytes in one blob; name ``i`` is ``blob[offsets[i]:offsets[i + 1]]``."""

    blob: bytes
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return self.blob[int(self.offsets[i]) : int(self.offsets[i + 1])].decode()

    def encode(self) -> dict[str, Any]:
        return {"blob": self.blob, "offsets": column(self.offsets)}

    def __contains__(self, name: object) -> bool:
        return any(self[i] == name for i in range(len(self)))

    @classmethod
    def of(cls, names: Sequence[str]) -> BlobNames:
        encoded = [n.encode() for n in names]
        offsets = np.zeros(len(encoded) + 1, dtype=np.uint64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        return cls(b"".join(encoded), narrow(offsets))


def decode_names(raw: dict[str, Any], count: int, name: str | None, *, allow_empty: bool) -> Names:
    if "blob" in raw:
        blob = raw["blob"]
        if not isinstance(blob, bytes):
            raise manifest_error(name, "names blob is not bytes")
        offsets = array(raw.get("offsets"), count + 1, "names offsets", name)
        if offsets[0] != 0 or offsets[-1] != len(blob) or not bool(np.all(offsets[1:] >= offsets[:-1])):
            raise manifest_error(name, "names offsets do not run from 0 to the blob's end in order")
        names = BlobNames(blob, offsets)
        seen: set[str] = set()
        for i in range(count):
            try:
                text = names[i]
            except UnicodeDecodeError:
                raise manifest_error(name, f"name of shard {i} is not UTF-8") from None
            if text or not allow_empty:
                check_name(text, name)
            seen.add(text)
        if not allow_empty and len(seen) != count:
            raise manifest_error(name, "a shard is listed twice")
        return names
    numbers = raw.get("numbers")
    widths = raw.get("widths")
    parts, widths = template_parts(raw, count, name, numbers=not allow_empty and isinstance(numbers, list)
                                   and isinstance(widths, list) and len(numbers) == len(widths))
    arrays = tuple(array(column, count, f"names number column {j}", name) for j, column in enumerate(numbers or ()))
    template = TemplateNames(tuple(parts), tuple(widths), arrays, count)
    if not increasing(arrays):
        raise manifest_error(name, "template name numbers are not in strictly increasing order")
    if count:
        check_name(template[0], name)  # digits never make a '.' or '/', so one name shows all names' shape
    return template


def template_parts(raw: dict[str, Any], count: int, name: str | None,
                   numbers: bool = True) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A template's checked ``parts`` and ``widths`` for ``count`` shards (``numbers``: its
    number columns came as the widths ask, where they come with it)."""
    parts, widths = raw.get("parts"), raw.get("widths")
    if (
        not numbers
        or not isinstance(parts, list) or not all(isinstance(p, str) and NAME_CHARS.match(p) for p in parts)
        or not isinstance(widths, list) or not all(isinstance(w, int) and 1 <= w <= 20 for w in widths)
        or not len(parts) == len(widths) + 1
    ):
        raise manifest_error(name, "names are neither a blob with offsets nor a template of parts, widths and numbers")
    if not all(p and not p[0].isdigit() for p in parts[1:-1]):
        raise manifest_error(name, f"template parts {parts!r}: every part between two numbers must be non-empty and"
                                   " start with a character that is not a digit, or two rows could render one name")
    if not widths and count > 1:
        raise manifest_error(name, f"a template without numbers names one shard, not {count}")
    return tuple(parts), tuple(widths)


def valid_shard_name(object_name: str) -> bool:
    """Whether a manifest may name this shard object (relative to the dataset's prefix):
    ASCII letters, digits and ``_ . - /``, no part starting with ``.`` or ``-``."""
    return bool(SHARD_NAME.match(object_name)) and ".." not in object_name.split("/")


def check_name(object_name: str, name: str | None) -> None:
    if not valid_shard_name(object_name):
        raise manifest_error(name, f"shard name {object_name!r} is unsafe")
