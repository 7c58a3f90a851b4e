"""An upload's hold on its prefix: the state object that claims it, the records that let an
interrupted run resume, the conditional switch of the manifest, and the clean-up of the
upload's own objects (never another upload's).

Every function takes a store whose requests retry (a ``RetryingStore``). Conditional
writes make the claim and the switch safe between processes: the state is
created with ``If-None-Match: *`` and replaced only with ``If-Match``; the manifest is
created the same way, or replaced with ``If-Match`` on the version the upload read.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable, Container, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgpack

from remote_loader.checks import one_line
from remote_loader.errors import FormatError, ObjectNotFound, PreconditionFailed, StorageError, UploadConflict
from remote_loader.format import MANIFEST_NAME, UPLOAD_STATE, Manifest, ShardTable
from remote_loader.format.index import unpack
from remote_loader.format.table import Shards
from remote_loader.storage import Location, ObjectInfo, Store
from remote_loader.storage.daemon import in_daemon_thread, map_on_daemon_threads, wait_result
from remote_loader.upload import tasks
from remote_loader.upload.fingerprint import first_difference
from remote_loader.upload.tasks import STATE_DIR, TaskResult

_STATE = UPLOAD_STATE
log = logging.getLogger("remote_loader")


def read_versioned(store: Store, bucket: str, key: str) -> tuple[bytes, str] | None:
    """The object and its version tag (ETag), or None if it does not exist."""
    try:
        result: tuple[bytes, str] = store.get_versioned(bucket, key)
        return result
    except ObjectNotFound:
        return None


def read_state(store: Store, location: Location) -> tuple[dict[str, Any] | None, str | None, bytes | None]:
    """The upload state at ``location`` (None if there is none or it is not one), its version
    tag, and its bytes as stored (what ``switch`` and ``release`` recognise it by)."""
    found = read_versioned(store, location.bucket, location.key(_STATE))
    if found is None:
        return None, None, None
    try:
        state = unpack(found[0], what="upload state", name=location.key(_STATE))
    except FormatError:
        return None, found[1], found[0]
    valid = (
        isinstance(state, dict)
        and isinstance(state.get("params"), dict)
        and isinstance(state.get("task_size"), int)
        and isinstance(state.get("run"), str)
        and re.fullmatch(r"[0-9a-f]{8}", state["run"]) is not None
    )
    return (state if valid else None), found[1], found[0]


def take(store: Store, location: Location, record: bytes, etag: str | None) -> None:
    """Write the upload state so that only one upload holds the prefix: created only if
    absent (``etag`` None), else replacing only the version ``etag`` that was read."""
    try:
        store.put(location.bucket, location.key(_STATE), record, if_none_match=etag is None, if_match=etag)
    except PreconditionFailed:
        found = read_versioned(store, location.bucket, location.key(_STATE))
        if found is None or found[0] != record:  # a retried PUT that had landed reads back as ours
            raise UploadConflict(
                f"another upload to {location} started at the same time; this one stopped without writing anything",
                location=str(location),
            ) from None


def kept_results(store: Store, location: Location, run: str, num_tasks: int) -> dict[int, TaskResult]:
    """Task results of an earlier run of this upload whose shards all exist with the recorded sizes."""
    shards, records = _listings(store, location.bucket, [own(location, run), location.key(f"{STATE_DIR}/{run}/")])
    sizes = {info.key: info.size for info in shards}
    recorded = {info.key for info in records}
    kept = {}
    for task_id in range(num_tasks):
        key = tasks.task_record_key(location, run, task_id)
        if key not in recorded:
            continue
        result = TaskResult.decode(store.get(location.bucket, key), key)
        if all(
            e.name.startswith(f"shard-{run}-") and sizes.get(location.key(e.name)) == e.size for e in result.entries
        ):
            kept[task_id] = result
    return kept


def _listings(store: Store, bucket: str, prefixes: list[str]) -> list[list[ObjectInfo]]:
    """The objects under each of ``prefixes``, listed at once (a round trip each across a network)."""
    return map_on_daemon_threads(
        lambda prefix: list(store.list(bucket, prefix)), prefixes, len(prefixes), "remote-loader-list"
    )


def own(location: Location, run: str) -> str:
    """The key prefix of the shards of upload ``run``: every object it writes but its state."""
    return location.key(f"shard-{run}-")


def pages_name(run: str) -> str:
    """The object holding the manifest pages of upload ``run`` (version 3, when not inline):
    under the run's own prefix, so it goes with the run's shards."""
    return f"shard-{run}-manifest.pages"


class _Kept:
    """The names a manifest lists (and its pages object), as a membership test: no set of
    every name is built."""

    def __init__(self, table: Any, pages: str) -> None:
        self.table, self.pages = table, pages

    def __contains__(self, name: object) -> bool:
        return name == self.pages or name in self.table.names


def names_of(store: Store, location: Location, data: bytes, run: str) -> Container[str]:
    """Those of upload ``run``'s objects that the manifest ``data`` at ``location`` names
    (shards, pages object): none unless it is that run's own (two processes finishing one
    upload); then its pages are read from ``store`` if kept apart."""
    if Manifest.decode(data, name=location.key(MANIFEST_NAME)).params.get("upload_id") != run:
        return ()

    def load(pages: str, size: int, start: int, end: int, parse: Callable[[bytes], Any]) -> Any:
        return parse(store.get_range(location.bucket, location.key(pages), start, end))

    table = Manifest.decode(data, name=location.key(MANIFEST_NAME), load=load).shards
    if isinstance(table, ShardTable):
        return _Kept(table, "")
    return {entry.name for entry in table} | {table.directory.object or ""}


def dataset_shards(store: Store, location: Location, data: bytes) -> Shards:
    """The shards the manifest ``data`` at ``location`` lists, its pages read from ``store`` as
    they are asked for where they are kept apart."""

    def load(pages: str, size: int, start: int, end: int, parse: Callable[[bytes], Any]) -> Any:
        return parse(store.get_range(location.bucket, location.key(pages), start, end))

    return Manifest.decode(data, name=location.key(MANIFEST_NAME), load=load).shards


def delete_all(store: Store, bucket: str, keys: Iterable[str]) -> None:
    """Delete ``keys``, 16 at once: each DELETE costs a round trip, and an overwrite may
    leave thousands of old shards. On daemon threads: Ctrl-C on a store that hangs does
    not wait for them."""
    map_on_daemon_threads(partial(store.delete, bucket), list(keys), 16, "remote-loader-delete")


def run_keys(store: Store, location: Location, run: str, keep: Container[str] = ()) -> list[str]:
    """The shards and task records of upload ``run``, less the shard names in ``keep``."""
    found = [
        info.key
        for listing in _listings(store, location.bucket, [own(location, run), location.key(f"{STATE_DIR}/{run}/")])
        for info in listing
    ]
    return [key for key in found if key[len(location.key("")) :] not in keep]


def delete_run(store: Store, location: Location, run: str, keep: Container[str] = ()) -> None:
    """Delete the shards and task records of upload ``run``, less the shard names in ``keep``."""
    delete_all(store, location.bucket, run_keys(store, location, run, keep))


def release(store: Store, location: Location, record: bytes,
            reading: Future[tuple[bytes, str] | None] | None = None) -> None:
    """Delete the upload state if it is still this upload's (as ``reading`` read it, if given)."""
    found = read_versioned(store, location.bucket, location.key(_STATE)) if reading is None else wait_result(reading)
    if found is not None and found[0] == record:
        store.delete(location.bucket, location.key(_STATE))


def switch(store: Store, location: Location, manifest: bytes, record: bytes, run: str, replaced: str | None) -> None:
    """Put the manifest, the switch readers see, if this upload still holds the prefix and the
    manifest is still the one it read (``replaced``, its tag; None: there was none).

    An upload that lost the prefix to another stops with ``UploadConflict``, having deleted
    its own shards only (none that the other's manifest names).
    """
    key = location.key(MANIFEST_NAME)
    state = read_versioned(store, location.bucket, location.key(_STATE))
    try:
        if state is None or state[0] != record:
            raise UploadConflict(
                f"another upload to {location} took over while this one ran; this one stopped and"
                " removed its own shards",
                location=str(location),
            )
        try:
            store.put(location.bucket, key, manifest, if_none_match=replaced is None, if_match=replaced)
        except PreconditionFailed:
            now = read_versioned(store, location.bucket, key)
            if now is not None and now[0] == manifest:  # a retried PUT that had landed
                return
            raise UploadConflict(
                f"another upload to {location} finished first; this one stopped and removed its own shards",
                location=str(location),
            ) from None
    except UploadConflict:
        now = read_versioned(store, location.bucket, key)
        keep: Container[str] = () if now is None else names_of(store, location, now[0], run)
        delete_run(store, location, run, keep=keep)
        release(store, location, record)
        raise


# --------------------------------------------------------------------------- an upload's phases around its tasks


@dataclass(frozen=True)
class Before:
    """What the prefix held when the upload began: a manifest (with its version tag) and the
    state of an unfinished upload (with its tag and bytes), read at once (each is a round trip)."""

    found: tuple[bytes, str] | None
    existing: Manifest | None
    state: dict[str, Any] | None
    state_tag: str | None
    stored: bytes | None

    @classmethod
    def read(cls, store: Store, location: Location) -> Before:
        reading_state = in_daemon_thread(partial(read_state, store, location))
        found = read_versioned(store, location.bucket, location.key(MANIFEST_NAME))
        existing = None if found is None else Manifest.decode(found[0], name=location.key(MANIFEST_NAME))
        return cls(found, existing, *wait_result(reading_state))


@dataclass(frozen=True)
class Held:
    """The upload's hold on its prefix: its run id, task size and state record, and the run it abandoned."""

    run: str
    task_size: int
    record: bytes
    abandoned: str | None = None
    resumed: bool = False  # an interrupted run of this upload, finished now


def hold(
    store: Store,
    location: Location,
    before: Before,
    params: dict[str, Any],
    overwrite: bool,
    task_size: Callable[[], int],
) -> Held:
    """Resume the prefix's unfinished run if it is this upload's, else claim the prefix for a
    new run (abandoning another's only with ``overwrite``)."""
    state = before.state
    if state is not None and before.stored is not None and _resumable(state["params"], params):
        return Held(state["run"], state["task_size"], before.stored, resumed=True)  # this upload's interrupted run
    if before.state_tag is not None and not overwrite:
        seen = f" (run {state['run']}: {_differences(state['params'], params)})" if state else ""
        raise UploadConflict(
            f"{location} holds an unfinished upload with other parameters{seen}, which may still be running:"
            " wait for it, re-run it with its own parameters to finish it, or pass overwrite=True"
            " (--overwrite) to abandon it",
            location=str(location),
        )
    size, run = task_size(), secrets.token_hex(4)
    record = msgpack.packb({"params": params, "task_size": size, "run": run})
    take(store, location, record, before.state_tag)
    return Held(run, size, record, state["run"] if state and before.state_tag is not None else None)


def kept(store: Store, location: Location, held: Held, num: int) -> dict[int, TaskResult]:
    """The finished tasks of this run, kept; its unfinished multipart uploads, aborted meanwhile.
    A new run has none (its id was just drawn): no request."""
    if not held.resumed:
        return {}
    aborting = in_daemon_thread(partial(abort_unfinished, store, location, held.run))
    kept = kept_results(store, location, held.run, -(-num // held.task_size))
    wait_result(aborting)
    return kept


def abort_unfinished(store: Store, location: Location, run: str) -> None:
    """Abort the multipart uploads of run ``run`` left unfinished: an interrupted run's, or
    an attempt's whose completion failed while the store was away (its task written again)."""
    try:
        store.abort_uploads(location.bucket, own(location, run))
    except StorageError as exc:
        if exc.code != "NotImplemented":
            raise
        log.debug("%s cannot list multipart uploads; unfinished uploads of %s stay", location.bucket, run)


def finish(store: Store, location: Location, manifest: Manifest, held: Held, before: Before) -> None:
    """Switch the manifest to this upload's, then clean up in one pass: this run's leftovers
    (its records, and uploads a failed attempt left unfinished) and, now that no manifest
    names them, the replaced upload's shards (tars indexed in place by ``remote-loader
    index`` are the user's own and stay) and an abandoned run's objects; deleted 16 at a
    time. The state goes last. Across a network each step in sequence costs a round trip,
    so what does not depend on the step before goes out beside it: the listings beside the
    switch (every object they list is written by then), the state's check beside the deletes."""
    pages = pages_name(held.run)
    head, body = manifest.encode_parts(pages)
    if body is not None:
        store.put(location.bucket, location.key(pages), body)
    names = _Kept(manifest.shards, pages)
    runs = [held.run] if held.abandoned is None else [held.run, held.abandoned]
    old = before.existing.params.get("upload_id") if before.existing is not None else None
    if isinstance(old, str) and old not in runs:  # the replaced upload's shards (and pages), by their run's name
        runs.append(old)
    listing = in_daemon_thread(partial(map_on_daemon_threads, lambda r: run_keys(
        store, location, r, keep=names if r == held.run else ()), runs, len(runs), "remote-loader-list"))
    switch(store, location, head, held.record, held.run, None if before.found is None else before.found[1])
    try:
        aborting = in_daemon_thread(partial(abort_unfinished, store, location, held.run))
        leftovers = [key for keys in wait_result(listing) for key in keys]
        reading_state = in_daemon_thread(partial(read_versioned, store, location.bucket, location.key(_STATE)))
        delete_all(store, location.bucket, leftovers)
        wait_result(aborting)
        release(store, location, held.record, reading_state)
    except StorageError as exc:  # the dataset is public and whole: what is left is no reason to fail the upload
        others = [run for run in runs if run != held.run]
        log.warning("upload to %s: the dataset is uploaded, but its clean-up failed (%s); running the same upload"
                    " again removes this run's records and state%s", location, one_line(exc),
                    f", not the objects of the runs it replaced or abandoned ({', '.join(others)}: their keys hold"
                    " those names; delete them by hand)" if others else "")


def tidy(store: Store, location: Location, before: Before) -> None:
    """Remove what a finished upload of the dataset there left where its clean-up failed: its
    task records, unfinished multipart uploads and state (the state of the run the manifest
    names). A store that still refuses is said in the log: the dataset is whole."""
    state, existing = before.state, before.existing
    if state is None or existing is None or before.stored is None or state["run"] != existing.params.get("upload_id"):
        return
    run = state["run"]
    try:
        aborting = in_daemon_thread(partial(abort_unfinished, store, location, run))
        delete_all(store, location.bucket, [info.key for info in store.list(location.bucket,
                                                                              location.key(f"{STATE_DIR}/{run}/"))])
        wait_result(aborting)
        release(store, location, before.stored)
    except StorageError as exc:
        log.warning("upload to %s: the dataset is whole, but what its upload left could not be removed (%s); running"
                    " the same upload again tries again", location, one_line(exc))


def _resumable(unfinished: dict[str, Any], params: dict[str, Any]) -> bool:
    """Whether an upload with ``params`` may finish an unfinished run made with ``unfinished``:
    the same parameters and items, or the same but ``on_error`` going from raise to skip (its
    finished tasks met no bad sample; the usual next step after a run that stopped at one)."""
    if not same_items(unfinished, params):
        return False
    there, here = _settings(unfinished), _settings(params)
    if there == here:
        return True
    return there.get("on_error") == "raise" and here["on_error"] == "skip" and {**there, "on_error": "skip"} == here


def _settings(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k != "items"}


def same_items(there: Any, params: dict[str, Any]) -> bool:
    """Whether a recorded upload's items are those of ``params`` (``fingerprint.items``)."""
    return isinstance(there, dict) and first_difference(there.get("items"), params["items"], params["samples"]) is None


def same_upload(there: Any, params: dict[str, Any]) -> bool:
    """Whether a finished upload's recorded parameters are ``params``, over the same items."""
    return same_items(there, params) and _settings(there) == _settings(params)


def _differences(unfinished: dict[str, Any], params: dict[str, Any]) -> str:
    """What an unfinished run's parameters and these differ in, for the refusal's message."""
    there, here = _settings(unfinished), _settings(params)
    differences = [f"{k}={_short(there.get(k))} there, {_short(here.get(k))} here"
                   for k in sorted(set(there) | set(here)) if there.get(k) != here.get(k)]
    if not same_items(unfinished, params) and there.get("samples") == here.get("samples"):
        differences.append(_items(unfinished, params))  # datasets of other lengths differ by it, said above
    return ", ".join(differences) or "the same"


def _short(value: Any) -> str:
    """A parameter's value for a message: a clip index of thousands of videos cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _items(there: dict[str, Any], params: dict[str, Any]) -> str:
    """How a recorded upload's items differ from these, of a dataset of the same length (of
    another, the fingerprints sample other indices: the lengths say how they differ)."""
    index = first_difference(there.get("items"), params["items"], params["samples"])
    if index == -1:
        return "items uploaded before uploads recorded them, which cannot be told from these"
    return f"other items (ds[{index}] differs)"


def what_differs(existing: Any, params: dict[str, Any]) -> str:
    """The dataset a prefix holds, as a refusal to keep it for an upload with ``params`` names it."""
    if not isinstance(existing, dict):
        return "a dataset whose upload parameters are not recorded"
    if _settings(existing) == _settings(params):
        return f"another dataset uploaded with these parameters: {_items(existing, params)}"
    return f"a dataset uploaded with other parameters ({_differences(existing, params)})"
