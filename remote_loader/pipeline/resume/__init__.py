"""Checkpoints and resume of a ``RemoteDataset``: one subsystem, one entry (``Checkpoints``).

**What a state holds.** A worker's *position state* (``progress.py``, specified in
docs/FORMAT.md) is its header (epoch, seed, dataset identity, rank and worker of how many),
the positions of its plan it has not delivered, as merged intervals (so its size follows
the open ranges and the shuffle buffer, never the dataset), its *extras* (positions it
reads as repeats under ``equalize``) with whether each was delivered, and the *record* of
its run (``replay.py``): the run's plan, the items past the replay point, the skips. A
*count state* (``counts.py``) says how many samples each DataLoader worker had delivered,
for a plain DataLoader whose workers cannot be asked.

**Exact in order, exact in set.** A worker resumed from its own state (what torchdata's
``StatefulDataLoader`` does on the same ranks and workers) goes on exactly as it would have:
it replays its run from its start, delivered samples standing in as placeholders that are
never fetched, decoded or given to user code (only ``replay.py`` and the sample source know
of them), and drops at the replay point as many items as it had delivered. Every state of
every rank, gathered (``states.py``), resumes *exactly in set* on any number of ranks and
workers: the union of what each has not delivered, less the repeats already delivered, is
divided as an epoch is (``split.py``), each sample delivered once.

**Refused, with ``ResumeError`` (a ``ConfigError``):** a state of another dataset, seed,
shuffle or upload (a replaced dataset would name other samples), a worker's own state on
another worker, states from different runs, overlapping or missing ones, a state
StatefulDataLoader took some batches after its workers' last snapshot (it cannot say what
those held, so an elastic resume would lose or repeat them), one loaded after persistent
workers started, ``set_epoch`` to another epoch while a mid-epoch state is unused, and any
malformed field. A state resumes its epoch once; a state of a finished epoch lets the next
iteration start the next epoch whole.
"""

from remote_loader.pipeline.resume.checkpoint import Checkpoints
from remote_loader.pipeline.resume.counts import MAX_WORKERS, skip_delivered
from remote_loader.pipeline.resume.layout import Layout
from remote_loader.pipeline.resume.progress import Progress
from remote_loader.pipeline.resume.replay import route

__all__ = ["MAX_WORKERS", "Checkpoints", "Layout", "Progress", "route", "skip_delivered"]
