"""The hand-over of a loaded state to the iterations that resume from it, in whatever process
they run.

A state loaded in the main process is held there and in the DataLoader workers started from
then on (each a copy of the dataset): every worker of the first iteration of its epoch
resumes from it once, and marks it applied in shared memory (one number per worker: the
generation, how many states the main process had loaded). A persistent worker, started
before a later load, would not see it: ``applying`` refuses that. A DataLoader worker that
loaded its own state (torchdata's StatefulDataLoader restores each worker so), and the main
process of a StatefulDataLoader without workers (``load_own_state``), holds it for its own next
iteration only, whatever epoch is set.
"""

from __future__ import annotations

from typing import Any

import torch

from remote_loader.config import MAX_WORKERS
from remote_loader.errors import ResumeError
from remote_loader.pipeline.state.resume.loaded import Loaded

LOADED_LATE = ("load_state_dict was called after this DataLoader's persistent workers started; load the state"
               " before the first epoch, or create a new DataLoader")
_GENERATION = 0  # how many states the main process loaded
_APPLIED = 1  # per worker from here: the generation of the last loaded state it applied


class Handover:
    """A dataset's loaded state and which iterations took it (see the module's docstring)."""

    def __init__(self) -> None:
        self.shared = torch.zeros(_APPLIED + MAX_WORKERS, dtype=torch.int64).share_memory_()
        self.loaded: Loaded | None = None
        self.local = False  # the loaded state was loaded in this process, a DataLoader worker, for itself
        self.generation = 0  # the main process's loads this copy knows of

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self.loaded is None:  # states loaded since in another process (a decoding process), applied there
            state["generation"] = max(self.generation, int(self.shared[_GENERATION]))
        return state

    def loads(self) -> int:
        """How many states the main process loaded, as every copy sees it (shared memory)."""
        return int(self.shared[_GENERATION])

    def own_epoch(self) -> int | None:
        """The epoch of the state a DataLoader worker loaded for itself, while unused."""
        return self.loaded.epoch if self.local and self.loaded is not None else None

    def hold(self, loaded: Loaded, in_worker: bool) -> None:
        """Hold ``loaded`` for the next iteration of its epoch: in this process only for a
        process's own (``in_worker``: a DataLoader worker's, or a StatefulDataLoader's without
        workers), else here and in the DataLoader workers started from now on."""
        self.loaded, self.local = loaded, in_worker
        if not in_worker:
            self.shared[_GENERATION] += 1
            self.generation = int(self.shared[_GENERATION])

    def owed(self) -> Loaded | None:
        """A loaded mid-epoch state whose rest no iteration has taken yet."""
        loaded = self.loaded
        if loaded is None or not loaded.pending:
            return None
        if not self.local and bool((self.shared[_APPLIED:] >= self.generation).any()):
            return None
        return loaded

    def check_epoch(self, epoch: int) -> None:
        """Before ``set_epoch(epoch)``: a ResumeError where a loaded state's rest is owed in
        another epoch; a state of another epoch, finished, is dropped."""
        if self.local:  # a process's own state, for its next iteration whatever the epoch set
            return
        owed = self.owed()
        if owed is not None and owed.epoch != epoch:
            raise ResumeError(f"the loaded state stopped mid-way through epoch {owed.epoch} and its rest has not been"
                              f" iterated: set_epoch({owed.epoch}) and finish it first, or make a new dataset to start"
                              f" epoch {epoch} without it")
        if self.loaded is not None and self.loaded.epoch != epoch:
            self.loaded = None

    def applying(self, epoch: int, worker: int, peek: bool = False) -> Loaded | None:
        """The loaded state worker ``worker``'s iteration of ``epoch`` resumes from: at the first
        iteration of its epoch only (``applied`` marks it used). ``peek``: for the state of an
        iteration not begun, a load this copy missed is not refused; the iteration refuses it."""
        if not peek and int(self.shared[_GENERATION]) != self.generation:
            raise ResumeError(LOADED_LATE)
        loaded = self.loaded
        if loaded is None:
            return None
        if not self.local:
            applied = int(self.shared[_APPLIED + worker]) >= self.generation
            return loaded if loaded.epoch == epoch and not applied else None
        if loaded.epoch != epoch:
            if loaded.pending:
                raise ResumeError(f"the loaded state stopped mid-way through epoch {loaded.epoch}, but this iteration"
                                  f" is epoch {epoch}: call set_epoch({loaded.epoch}) first")
            self.loaded = None  # a state of a finished epoch is used up by any later iteration
        return self.loaded

    def applied(self, loaded: Loaded | None, worker: int) -> None:
        """Mark ``loaded`` used by ``worker``."""
        if loaded is None:
            return
        if self.local:
            self.loaded = None
        else:
            self.shared[_APPLIED + worker] = self.generation

    def counted_before(self, epoch: int) -> list[int] | None:
        """The samples each worker had delivered where ``epoch`` resumed from a count state
        loaded here, if it did; ResumeError where it resumed from workers' own or gathered
        states, whose rest a count of items cannot place (which of it was delivered depends
        on where each worker stood, which only the workers' states say)."""
        loaded = self.loaded
        if self.local or loaded is None or loaded.epoch != epoch:
            return None
        if loaded.rest is not None or any(s.remaining is not None for s in loaded.own.values()):
            raise ResumeError(f"epoch {epoch} resumed from workers' own or gathered states: a count state cannot say"
                              " which of its rest was delivered; checkpoint it with the StatefulDataLoader's"
                              " state_dict(), or count from the next epoch")
        if not loaded.own:
            return None
        return [loaded.own[w].delivered for w in sorted(loaded.own)]
