"""The StatefulDataLoader ``loader(ds, stateful=True)`` makes. This module imports torchdata
(an optional extra): ``loader()`` imports it only where it is asked for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from remote_loader.errors import ResumeError
from remote_loader.pipeline.run import loader_state
from remote_loader.pipeline.run.dataloader import made_here, start_iteration
from remote_loader.pipeline.state.resume.states import WorkerState, find_states, parse, steps_since_snapshot

# What torchdata's state_dict() holds with DataLoader workers, and without them.
_WITH_WORKERS, _WITHOUT_WORKERS = "_snapshot", "_num_yielded"
# Without workers: whether the pass had ended, and the dataset's own state.
_FINISHED, _DATASET = "_iterator_finished", "dataset_state"


class StatefulLoader(StatefulDataLoader):
    """torchdata's StatefulDataLoader, whose workers start without this process's garbage
    (``dataloader.start_iteration``), and which says where its samples are decoded."""

    decoded_on = "CPU"
    """Where JPEGs are decoded: by the DataLoader workers, on the CPU."""

    def __iter__(self) -> Any:
        return start_iteration(self, super().__iter__)

    def _get_iterator(self) -> Any:
        state = getattr(self, "next_iter_state", None)  # torchdata's (untyped there): the state for this pass
        if not self.num_workers and isinstance(state, dict) and state.get(_DATASET) is not None \
                and hasattr(self.dataset, "load_own_state"):
            # torchdata gives the dataset its state here, as the pass begins, through its
            # load_state_dict, which made the state's epoch the epoch set for the passes after
            # it too. Loaded as its own, it applies to this pass only, as a worker's own state
            # does; torchdata then has no dataset state to load.
            self.dataset.load_own_state(state[_DATASET])
            self.next_iter_state = {**state, _DATASET: None}
        return made_here(self, super()._get_iterator)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torchdata's, refusing with ResumeError, now, a state taken with DataLoader workers
        where this loader has none, or the reverse (torchdata's own check, as the next pass
        begins, is a bare AssertionError), one whose torchdata fields are not as torchdata
        writes them (``loader_state``), and one holding a worker state that is not valid
        (each worker's refusal, as the pass begins, comes with torchdata's traceback)."""
        _check_workers(state_dict, self.num_workers)
        loader_state.check(state_dict, self.num_workers, hasattr(self.dataset, "load_state_dict"))
        workers = _parsed_workers(state_dict) if self.num_workers else []
        if not self.num_workers and _ended_here(state_dict) and hasattr(self.dataset, "load_state_dict"):
            # torchdata would restore the ended pass as the next one begins, by loading the
            # dataset's state and beginning its iteration, then drop it and begin another:
            # the dropped one took an epoch (or the state moved the epoch set back to its
            # own). Loaded now, the state says where the epochs go on, and nothing is dropped.
            self.dataset.load_state_dict(state_dict[_DATASET])
            state_dict = {}
        elif self.num_workers and _nothing_left(state_dict, workers) and hasattr(self.dataset, "load_state_dict"):
            # Each worker restored would follow its own state's epoch in the next pass, whatever
            # epoch is set: with nothing of it left, a pass of set_epoch(E + 1) was empty and
            # epoch E + 1 never came. Loaded here, the state gives way to another epoch set.
            self.dataset.load_state_dict(state_dict)
            state_dict = {}
        super().load_state_dict(state_dict)


def _ended_here(state: Any) -> bool:
    """Whether ``state`` is the state of a loader without workers whose pass had ended."""
    return (isinstance(state, Mapping) and _WITHOUT_WORKERS in state and state.get(_FINISHED) is True
            and state.get(_DATASET) is not None)


def _parsed_workers(state: Any) -> list[WorkerState]:
    """The worker states in ``state``, a StatefulDataLoader state taken with DataLoader workers,
    each checked (ResumeError naming the first bad field); none where it is not such a state."""
    if not isinstance(state, Mapping) or _WITH_WORKERS not in state:
        return []
    return [parse(worker) for worker in find_states(state)]


def _nothing_left(state: Any, workers: list[WorkerState]) -> bool:
    """Whether ``state``, whose worker states are ``workers`` (``_parsed_workers``), is the state
    of a loader with workers of which each had delivered all of its share of the epoch, as of
    the state (taken at a snapshot of them)."""
    return bool(workers) and not steps_since_snapshot(state) and not any(worker.unfinished for worker in workers)


def _check_workers(state: Any, num_workers: int) -> None:
    """A ResumeError where ``state`` is a StatefulDataLoader state of a loader with workers and
    ``num_workers`` is 0, or the reverse."""
    if not isinstance(state, Mapping):
        return
    if num_workers and _WITHOUT_WORKERS in state and _WITH_WORKERS not in state:
        taken = "no DataLoader workers"
    elif not num_workers and _WITH_WORKERS in state and _WITHOUT_WORKERS not in state:
        snapshot = state[_WITH_WORKERS]
        count = len(snapshot.get("_worker_snapshots", ())) if isinstance(snapshot, Mapping) else 0
        taken = f"{count} DataLoader worker{'s' * (count != 1)}" if count else "DataLoader workers"
    else:
        return
    raise ResumeError(f"this StatefulDataLoader state was taken with {taken}, this loader has {num_workers or 'none'}:"
                      " a loader resumes its own worker count only; to resume on another, give the state to the"
                      " dataset before the loader starts: ds.load_state_dict(state)")
