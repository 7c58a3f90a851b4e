"""The one walk over a batch's nested containers (tuples, lists, dicts) that the device
stage needs: finding the leaves of a kind, and rebuilding a container around new ones."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

Path = tuple[Any, ...]

WALK_ON = object()
"""What a ``rebuild`` function returns for a node it leaves as it is: a container is then
walked into, anything else kept."""


def leaves(item: Any, kind: type | tuple[type, ...], path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every ``kind`` inside ``item``, with its path of indexes and keys."""
    if isinstance(item, kind):
        yield path, item
    elif isinstance(item, tuple | list):
        for i, x in enumerate(item):
            yield from leaves(x, kind, (*path, i))
    elif isinstance(item, dict):
        for k, x in item.items():
            yield from leaves(x, kind, (*path, k))


def holds(item: Any, kind: type | tuple[type, ...]) -> bool:
    return next(leaves(item, kind), None) is not None


def rebuild(item: Any, fn: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """``item`` with each node replaced by ``fn(path, node)``, outermost first; where ``fn``
    returns ``WALK_ON`` a container is rebuilt of its walked members, of its own type where
    one can be made so (a named tuple, an ``OrderedDict``, a list's subclass), else a plain one."""
    out = fn(path, item)
    if out is not WALK_ON:
        return out
    if isinstance(item, dict):
        return _like(item, {k: rebuild(x, fn, (*path, k)) for k, x in item.items()})
    if isinstance(item, tuple | list):
        return _like(item, [rebuild(x, fn, (*path, i)) for i, x in enumerate(item)])
    return item


def _like(item: Any, members: Any) -> Any:
    """``members`` (a dict or a list) in a container of ``item``'s type."""
    kind = type(item)
    if kind is dict or kind is list:
        return members
    if kind is tuple:
        return tuple(members)
    try:
        if hasattr(item, "_fields"):  # a named tuple
            return kind(*members)
        if isinstance(item, dict):
            clone = copy.copy(item)  # a defaultdict keeps its factory
            clone.clear()
            clone.update(members)
            return clone
        return kind(members)
    except (TypeError, ValueError):
        return tuple(members) if isinstance(item, tuple) else members
