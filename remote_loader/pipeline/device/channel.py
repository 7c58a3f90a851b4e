"""What passes between a process and its decoding process (``process``, ``serve``): whole
messages over the socket pair only the two hold.

To the decoding process goes a pipeline with its DataLoader (``pipeline_bytes``), pickled
once (cloudpickle, where installed, so that a lambda or a function of ``__main__`` goes too,
as a forked DataLoader worker would have it), its tensors in shared memory by torch's own
reductions: the dataset's epochs and counters stay the very numbers the user's process
reads. The classes and functions of the user's ``__main__`` it holds go with it, under their
names: the DataLoader's workers there pickle their samples by reference, and must find them.

Back come decoded batches (``Channel``). A CUDA tensor comes by CUDA IPC, torch's reduction:
no copy, and the receiving stream waits for the one that made it. A CPU tensor comes by
value, its bytes beside the message (pickle's out-of-band buffers), read straight into
memory of its own: no file descriptor to pass (about ten system calls a tensor, each of
which lets a Python thread of the user's take the GIL for a switch interval, and one held
open as long as the tensor lives), and nothing left to fetch from a sender that has died.
"""

from __future__ import annotations

import io
import pickle
import select
import socket
import struct
import sys
import threading
import traceback
import types
from typing import Any

import numpy as np
import torch
from torch.multiprocessing import reductions

from remote_loader.pipeline.stages.threads import note as add_note

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
    a spawned DataLoader worker; notes the classes and functions of ``__main__`` it meets.
    With ``share=False`` it only looks: a tensor goes as nothing, since sharing one hands a
    copy of its file descriptor to multiprocessing's resource sharer, which keeps it until
    a process that unpickles it asks for it."""

    def __init__(self, *args: Any, share: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.of_main: dict[str, Any] = {}
        self.share = share

    def reducer_override(self, obj: Any) -> Any:
        reduce = _SHARED.get(type(obj))
        if reduce is not None:
            return reduce(obj) if self.share else (tuple, ())
        if isinstance(obj, type | types.FunctionType) and getattr(obj, "__module__", None) == "__main__":
            name = getattr(obj, "__qualname__", "")
            if name.isidentifier() and getattr(sys.modules["__main__"], name, None) is obj:
                self.of_main[name] = obj
        parent = getattr(super(), "reducer_override", None)
        return parent(obj) if parent is not None else NotImplemented


def pipeline_bytes(obj: Any) -> bytes:
    """``obj`` (a DataLoader and its pipeline) pickled for the decoding process, with the
    classes and functions of ``__main__`` it holds (``load_pipeline`` puts them back under
    their names): raises what pickling raises where something in it cannot be sent (a
    generator, a lock, an open file)."""
    _own_resource_sharer()
    found = _PipelinePickler(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL, share=False)
    found.dump(obj)  # which of __main__'s it holds; then the two in one pickle, as one set of objects
    out = io.BytesIO()
    _PipelinePickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump((obj, found.of_main))
    return out.getvalue()


def _own_resource_sharer() -> None:
    """Where this process was forked by ``os.fork`` from one that shared a tensor's file
    descriptor, make multiprocessing's resource sharer this process's, as multiprocessing does
    in the children it forks itself: the one inherited names the parent's socket, whose thread
    is not here, and the decoding process would ask the parent for this process's tensors."""
    from multiprocessing import resource_sharer

    sharer = getattr(resource_sharer, "_resource_sharer", None)
    thread = getattr(sharer, "_thread", None)
    if thread is not None and not thread.is_alive() and getattr(sharer, "_listener", None) is not None:
        sharer._afterfork()  # type: ignore[union-attr]


def load_pipeline(data: bytes) -> Any:
    """What ``pipeline_bytes`` pickled, the classes and functions of the user's ``__main__``
    set in this process's ``__main__`` under their names, where pickling by reference (as
    DataLoader workers pickle their samples) finds them."""
    obj, of_main = loads(data)
    main = sys.modules["__main__"]
    for name, value in of_main.items():
        setattr(main, name, value)
    return obj


def _cpu_tensor(data: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor over the bytes received for it (writable: torch warns of any other)."""
    return torch.from_numpy(np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape))


_STORAGES = (torch.UntypedStorage, torch.storage.TypedStorage)
_NUMPY = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
          torch.float64, torch.complex64, torch.complex128}


class _BatchPickler(_BASE):  # type: ignore[misc, valid-type]
    """Plain tensors on a GPU by CUDA IPC, on the CPU by value (out of band); everything
    else as pickle (or cloudpickle) does it."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and not obj.requires_grad:
            if obj.is_cuda:
                return reductions.reduce_tensor(obj)
            if obj.device.type == "cpu" and obj.dtype in _NUMPY:
                array = np.ascontiguousarray(obj.numpy())
                return _cpu_tensor, (pickle.PickleBuffer(array.data), array.dtype.str, array.shape)
        parent = getattr(super(), "reducer_override", None)
        return parent(obj) if parent is not None else NotImplemented


def loads(data: bytes | bytearray, buffers: list[bytearray] | None = None) -> Any:
    """A message from the other side of a decoding process's socket pair, which only the two
    processes hold (pickle, as multiprocessing sends between its processes: never bytes read
    from a store, which are msgpack and checked)."""
    return pickle.loads(data, buffers=buffers)


_HEADER = struct.Struct("<QI")  # the pickle's size, its buffers' count; then each buffer's size
_SIZE = struct.Struct("<Q")
_CHUNK = 1 << 16  # smaller reads than this go through a buffer: a small message in one read


class Channel:
    """One end of the socket pair: whole messages, each a pickle and its out-of-band buffers.
    Sends are whole (a lock), receives from one thread; a send that cannot go on for
    ``timeout`` seconds (the other side stopped) raises ``TimeoutError``."""

    def __init__(self, sock: socket.socket, timeout: float | None = None) -> None:
        self.sock = sock
        sock.settimeout(timeout)
        self._lock = threading.Lock()
        self._pending = bytearray()

    def send(self, message: Any) -> None:
        buffers: list[pickle.PickleBuffer] = []
        out = io.BytesIO()
        _BatchPickler(out, protocol=5, buffer_callback=buffers.append).dump(message)
        data, raws = out.getbuffer(), [b.raw() for b in buffers]
        head = _HEADER.pack(len(data), len(raws)) + b"".join(_SIZE.pack(r.nbytes) for r in raws)
        with self._lock:
            self.sock.sendall(head)
            self.sock.sendall(data)
            for raw in raws:
                self.sock.sendall(raw)

    def ready(self, timeout: float) -> bool:
        """Whether a message (or the end) can be read now, waiting at most ``timeout``."""
        return bool(self._pending) or bool(select.select([self.sock], [], [], timeout)[0])

    def receive(self) -> Any:
        """The next message; EOFError where the other side has closed its end."""
        return loads(*self.receive_raw())

    def receive_raw(self) -> tuple[bytearray, list[bytearray]]:
        """The next message's pickle and buffers, to unpickle (``loads``) where it suits."""
        size, count = _HEADER.unpack(self._exactly(_HEADER.size))
        sizes = [_SIZE.unpack_from(self._exactly(_SIZE.size))[0] for _ in range(count)]
        data = self._exactly(size)
        return data, [self._exactly(n) for n in sizes]

    def _exactly(self, n: int) -> bytearray:
        out = bytearray(n)
        view = memoryview(out)
        got = min(n, len(self._pending))
        view[:got] = self._pending[:got]
        del self._pending[:got]
        while got < n:
            if n - got >= _CHUNK:  # large: straight into place
                k = self.sock.recv_into(view[got:])
            else:
                chunk = self.sock.recv(_CHUNK)
                k = min(len(chunk), n - got)
                view[got : got + k] = chunk[:k]
                self._pending += chunk[k:]
            if k == 0:
                raise EOFError("the other side of the decoding process's socket has closed it")
            got += k
        return out

    def close(self) -> None:
        self.sock.close()


def sendable(error: BaseException, pid: int) -> BaseException:
    """``error`` as the user's process will raise it (its type and facts), with where it was
    raised in a note; a ``RuntimeError`` naming it where it does not pickle both ways."""
    note = f"raised in remote_loader's decoding process (pid {pid}):\n" + "".join(
        traceback.format_exception(type(error), error, error.__traceback__))
    add_note(error, note)
    try:
        buffers: list[pickle.PickleBuffer] = []
        out = io.BytesIO()
        _BatchPickler(out, protocol=5, buffer_callback=buffers.append).dump(error)
        loads(out.getvalue(), [bytearray(b.raw()) for b in buffers])  # one that does not unpickle goes as text
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle falls back to the text
        return RuntimeError(f"{type(error).__name__}: {error}\n{note}")
