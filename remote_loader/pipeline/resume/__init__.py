"""Checkpoints and resume of a ``RemoteDataset``: one subsystem, one entry (``Checkpoints``).

**What a state holds.** A worker's delivery order in an epoch (which position it gives at
each output, after the mix of its open shards and the shuffle buffer) is fixed by the seed,
the epoch, its plan and the pipeline's mixing, never by the bytes (``pipeline/order.py``). So
its state (``states.py``, specified in docs/FORMAT.md) is mainly a count: how many outputs of
that order it had delivered. It also lists the positions of its plan not yet delivered, as
merged intervals (their number follows the shuffle buffer and the open shards, never the
dataset), with its *extras* (positions it reads as repeats under ``equalize``) apart. A
*count state* (``counts.py``) says how many items each DataLoader worker had delivered, for
a plain DataLoader whose workers cannot be asked.

**Exact in order, exact in set.** A worker resumed from its own state (what torchdata's
``StatefulDataLoader`` does on the same ranks and workers) regenerates its order on
integers up to the count, fetches what its shuffle buffer held there, and goes on exactly
as it would have: the items it gives next are the ones it would have given. Its listed
positions are checked against its regenerated order first. Every state of every rank,
gathered (``states.py``), resumes *exactly in set* on any number of ranks and workers: the
union of what each has not delivered, less the repeats already delivered, is divided as an
epoch is (``split.py``), each sample delivered once.

**Refused, with ``ResumeError`` (a ``ConfigError``):** a state of another dataset, seed,
shuffle or upload (a replaced dataset would name other samples), a worker's own state on
another worker or in a pipeline that mixes otherwise (open shards, shuffle buffer), one
whose listed positions are not those of its order, states from different runs, overlapping
or missing ones, a state StatefulDataLoader took some batches after its workers' last
snapshot (it cannot say what those held, so an elastic resume would lose or repeat them),
one loaded after persistent workers started, ``set_epoch`` to another epoch while a
mid-epoch state is unused, and any malformed field. A state resumes its epoch once; a
state of a finished epoch lets the next iteration start the next epoch whole.
"""

from remote_loader.pipeline.resume.checkpoint import Checkpoints, Iteration
from remote_loader.pipeline.resume.counts import MAX_WORKERS
from remote_loader.pipeline.resume.layout import Layout
from remote_loader.pipeline.resume.states import encode

__all__ = ["MAX_WORKERS", "Checkpoints", "Iteration", "Layout", "encode"]
