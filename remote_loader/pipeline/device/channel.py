"""What passes between a process and its decoding process (``decoding``), as bytes.

To the decoding process goes a pipeline with its DataLoader, pickled once (cloudpickle,
where installed, so that a lambda or a function of ``__main__`` goes too, as a forked
DataLoader worker would have it), its tensors in shared memory by torch's own reductions:
the dataset's epochs and counters stay the very numbers the user's process reads.

Back come decoded batches. A CUDA tensor comes by CUDA IPC, torch's reduction: no copy,
and the receiving stream waits for the one that made it. A small CPU tensor (labels, the
CPU backend's small crops) comes by value, in the message: passing a file descriptor
instead costs the receiver about ten system calls a tensor, each of which lets a Python
thread of the user's take the GIL for a switch interval (5 ms), which is what the decoding
process exists to avoid; a large one (``BY_VALUE``) in shared memory, as torch shares it.
"""

from __future__ import annotations

import io
import pickle
import traceback
from typing import Any

import numpy as np
import torch
from torch.multiprocessing import reductions

from remote_loader.pipeline.threads import note as add_note

try:
    import cloudpickle
except ImportError:  # pragma: no cover - the gpu extra brings it
    cloudpickle = None

_BASE: type[pickle.Pickler] = cloudpickle.Pickler if cloudpickle is not None else pickle.Pickler
_SHARED: dict[type, Any] = {
    torch.Tensor: reductions.reduce_tensor,
    torch.nn.Parameter: reductions.reduce_tensor,
    torch.UntypedStorage: reductions.reduce_storage,
    torch.storage.TypedStorage: reductions.reduce_typed_storage,
}


class _PipelinePickler(_BASE):  # type: ignore[misc, valid-type]
    """cloudpickle (or pickle), with tensors and storages shared as torch shares them with
    a spawned DataLoader worker."""

    def reducer_override(self, obj: Any) -> Any:
        reduce = _SHARED.get(type(obj))
        if reduce is not None:
            return reduce(obj)
        parent = getattr(super(), "reducer_override", None)
        return parent(obj) if parent is not None else NotImplemented


def pipeline_bytes(obj: Any) -> bytes:
    """``obj`` (a DataLoader and its pipeline) pickled for the decoding process: raises what
    pickling raises where something in it cannot be sent (a generator, a lock, an open file)."""
    out = io.BytesIO()
    _PipelinePickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


def _cpu_tensor(data: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor over the bytes unpickled for it (writable: torch warns of any other)."""
    return torch.from_numpy(np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape))


BY_VALUE = 1 << 20
"""A CPU tensor up to this size comes by value; a larger one in shared memory, where the
few system calls that pass its file descriptor cost less than copying it through the socket."""


class _BatchPickler(_BASE):  # type: ignore[misc, valid-type]
    """Plain tensors on a GPU by CUDA IPC, on the CPU by value up to ``BY_VALUE`` bytes, in
    shared memory past it; everything else as pickle (or cloudpickle) does it."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and not obj.requires_grad:
            if obj.is_cuda or (obj.device.type == "cpu" and obj.nbytes > BY_VALUE):
                return reductions.reduce_tensor(obj)
            if obj.device.type == "cpu" and obj.dtype in _NUMPY:
                array = np.ascontiguousarray(obj.numpy())
                return _cpu_tensor, (pickle.PickleBuffer(array.data), array.dtype.str, array.shape)
        elif type(obj) in _STORAGES:  # a shared tensor's storage: shared as well
            return _SHARED[type(obj)](obj)
        parent = getattr(super(), "reducer_override", None)
        return parent(obj) if parent is not None else NotImplemented


_STORAGES = (torch.UntypedStorage, torch.storage.TypedStorage)
_NUMPY = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
          torch.float64, torch.complex64, torch.complex128}


def batch_bytes(obj: Any) -> bytes:
    """A message of decoded batches, pickled to go back to the user's process."""
    out = io.BytesIO()
    _BatchPickler(out, protocol=5).dump(obj)
    return out.getvalue()


def loads(data: bytes) -> Any:
    """A message from the other side of a decoding process's socket pair, which only the two
    processes hold (pickle, as multiprocessing sends between its processes: never bytes read
    from a store, which are msgpack and checked)."""
    return pickle.loads(data)


def error_bytes(error: BaseException, pid: int) -> bytes:
    """``error`` pickled to be raised in the user's process as it is (its type and facts),
    with where it was raised in a note; a ``RuntimeError`` naming it where it does not
    pickle."""
    note = f"raised in remote_loader's decoding process (pid {pid}):\n" + "".join(
        traceback.format_exception(type(error), error, error.__traceback__))
    add_note(error, note)
    try:
        data = batch_bytes(error)
        loads(data)  # one that pickles but does not unpickle (required arguments) is sent as text
        return data
    except Exception:  # noqa: BLE001 - any failure to pickle falls back to the text
        return batch_bytes(RuntimeError(f"{type(error).__name__}: {error}\n{note}"))
