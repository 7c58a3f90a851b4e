"""The fields of a torchdata ``StatefulDataLoader`` state (torchdata 0.11's layout), checked as
``StatefulLoader.load_state_dict`` takes it: torchdata reads them only as the next pass begins,
where a bad one fails inside it (a bare AssertionError, KeyError or TypeError, or a worker's
traceback), and a missing worker or dataset state resumes nothing, silently. Under another
torchdata version, whose layout may differ, the state is left to torchdata's own checks:
a state it wrote itself is never refused here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from remote_loader.checks import one_line, shown
from remote_loader.errors import ResumeError


def _known_layout() -> bool:
    try:
        return version("torchdata").split(".")[:2] == ["0", "11"]
    except PackageNotFoundError:
        return False


KNOWN_LAYOUT = _known_layout()
"""Whether the installed torchdata writes the layout checked here (0.11)."""

_Check = tuple[Callable[[Any], bool], str]  # whether a value is right; what it must be, for the message
_COUNT: _Check = (lambda v: type(v) is int and v >= 0, "a whole number")
_INT_OR_NONE: _Check = (lambda v: v is None or type(v) is int, "an integer or None")
_INT: _Check = (lambda v: type(v) is int, "an integer")
_FLAG: _Check = (lambda v: type(v) is bool, "true or false")
_ANY: _Check = (lambda v: True, "")  # a sampler's or the dataset's own state: theirs to check
_DICT: _Check = (lambda v: isinstance(v, Mapping), "a dict")
_FETCHER: _Check = (lambda v: v is None or isinstance(v, Mapping), "a dict or None")

_SAMPLER = {"_sampler_iter_state": _ANY, "_index_sampler_state": _ANY, "_sampler_iter_yielded": _COUNT,
            "_IterableDataset_len_called": _INT_OR_NONE, "_shared_seed": _INT_OR_NONE}
_WITHOUT_WORKERS = {**_SAMPLER, "_num_yielded": _COUNT, "_iterator_finished": _FLAG, "fetcher_state": _FETCHER,
                    "dataset_state": _ANY}
_WITH_WORKERS = {"_snapshot": _DICT, "_steps_since_snapshot": _COUNT, "_iterator_finished": _FLAG}
_SNAPSHOT = {"_snapshot_step": _COUNT, "_last_yielded_worker_id": _COUNT, "_main_snapshot": _DICT,
             "_worker_snapshots": _DICT}
_MAIN = {**_SAMPLER, "_num_workers": _COUNT, "_base_seed": _INT}
_WORKER = {"worker_id": _COUNT, "fetcher_state": _FETCHER, "dataset_state": _ANY}
_FETCHER_FIELDS = {"dataset_iter_state": _ANY, "fetcher_ended": _FLAG}


def check(state: Any, num_workers: int, stateful: bool) -> None:
    """Raise ResumeError naming the first field of ``state`` that is not as torchdata writes it
    for a loader of ``num_workers`` workers (``{}``, torchdata's "no state", passes);
    ``stateful``: the dataset has a state of its own, which each dataset state must hold.
    Nothing is checked under another torchdata version (``KNOWN_LAYOUT``)."""
    if not KNOWN_LAYOUT:
        return
    _fields(state, "", _WITH_WORKERS if num_workers else _WITHOUT_WORKERS)
    if not state:
        return
    if not num_workers:
        _fetcher_and_dataset(state, "", stateful)
        return
    snapshot = _fields(state["_snapshot"], "_snapshot", _SNAPSHOT)
    main = _fields(snapshot["_main_snapshot"], "_snapshot._main_snapshot", _MAIN)
    if main["_num_workers"] != num_workers:
        raise ResumeError(f"StatefulDataLoader state field '_snapshot._main_snapshot._num_workers' is"
                          f" {main['_num_workers']}, this loader has {num_workers} workers: a loader resumes its own"
                          " worker count only; to resume on another, give the state to the dataset before the"
                          " loader starts: ds.load_state_dict(state)")
    if snapshot["_last_yielded_worker_id"] >= num_workers:
        raise ResumeError(f"StatefulDataLoader state field '_snapshot._last_yielded_worker_id' is"
                          f" {snapshot['_last_yielded_worker_id']}, not one of this loader's {num_workers} workers")
    workers = snapshot["_worker_snapshots"]
    names = [f"worker_{i}" for i in range(num_workers)]
    if sorted(map(str, workers)) != sorted(names) or len(workers) != num_workers:
        held = ", ".join(one_line(shown(k)) for k in list(workers)[:4]) + (" ..." if len(workers) > 4 else "")
        raise ResumeError(f"StatefulDataLoader state field '_snapshot._worker_snapshots' must hold one snapshot for"
                          f" each of worker_0..worker_{num_workers - 1}, holds {held or 'none'}")
    for i, name in enumerate(names):
        where = f"_snapshot._worker_snapshots.{name}"
        worker = _fields(workers[name], where, _WORKER)
        if worker["worker_id"] != i:
            raise ResumeError(f"StatefulDataLoader state field '{where}.worker_id' is {worker['worker_id']}, not {i}")
        _fetcher_and_dataset(worker, f"{where}.", stateful)


def _fields(state: Any, where: str, fields: Mapping[str, _Check]) -> Mapping[str, Any]:
    """``state``, the dict at ``where``, whose ``fields`` are there and right (ResumeError)."""
    named = f"StatefulDataLoader state field '{where}'" if where else "StatefulDataLoader state"
    if not isinstance(state, Mapping):
        raise ResumeError(f"{named} is not a dict (got {type(state).__name__})")
    if not where and not state:  # torchdata's own "nothing to resume": the next pass starts anew
        return state
    for name, (right, what) in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in state:
            raise ResumeError(f"StatefulDataLoader state lacks its field '{path}'")
        if not right(state[name]):
            raise ResumeError(f"StatefulDataLoader state field '{path}' must be {what}, got"
                              f" {one_line(shown(state[name]))}")
    return state


def _fetcher_and_dataset(state: Mapping[str, Any], where: str, stateful: bool) -> None:
    """The fetcher's fields of ``state`` (the main process's, or a worker's), and, where the
    dataset has a state, its dataset state: without it, torchdata restores nothing, and the
    dataset delivers its epoch from the start again."""
    if state["fetcher_state"] is not None:
        _fields(state["fetcher_state"], f"{where}fetcher_state", _FETCHER_FIELDS)
    if stateful and state["dataset_state"] is None:
        raise ResumeError(f"StatefulDataLoader state field '{where}dataset_state' is None: it holds no dataset state,"
                          " so the dataset would deliver its epoch from the start again")
