"""Checkpoint states of a ``RemoteDataset``: parsed, encoded and gathered here; how a stream
takes and resumes them is told in ``pipeline/state/stream.py``.

- ``states.py``: a worker's state (specified in docs/FORMAT.md): ``encode``, ``parse`` (each
  field checked), the worker states inside a loader's state, and ``gather``: the rest of an
  epoch from every worker's state of every rank.
- ``item_counts.py``: count states (``state_dict(consumed=...)``), for a plain DataLoader whose
  workers cannot be asked.
- ``loaded.py``: what ``load_state_dict`` was given, as one ``Loaded`` (each worker's own
  state, a count state converted into those, or a gathered rest), and the ``Entry`` of each
  worker's next iteration.
- ``layout.py``: what a state is checked against and a share is cut from.

**Refused, with ``ResumeError`` (a ``ConfigError``):** a state of another dataset, seed,
shuffle or upload (a replaced dataset would name other samples), a worker's own state on
another worker or in a pipeline that mixes otherwise (open shards, shuffle buffer), one
whose listed positions are not those of its order or do not add up to its plan with what it
delivered, a count state that cuts an item, states from different runs, overlapping
or missing ones, a count state in a pipeline whose items hold another number of samples or
on another number of ranks, a state StatefulDataLoader took some batches after its workers'
last snapshot (it cannot say what those held, so an elastic resume would lose or repeat
them), one loaded after persistent workers started, ``set_epoch`` to another epoch while a
mid-epoch state is unused, and any malformed field. A state resumes its epoch once; a state
of a finished epoch lets the next iteration start the next epoch whole.
"""

from remote_loader.pipeline.state.resume.handover import Handover
from remote_loader.pipeline.state.resume.item_counts import count_state
from remote_loader.pipeline.state.resume.layout import Layout
from remote_loader.pipeline.state.resume.loaded import Entry, Loaded, entry, load, share
from remote_loader.pipeline.state.resume.states import encode

__all__ = ["Entry", "Handover", "Layout", "Loaded", "count_state", "encode", "entry", "load", "share"]
