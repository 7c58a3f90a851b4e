"""A dataset sent to each worker of a Dask cluster once, as a worker plugin: each worker
unpickles it when the plugin is registered (a worker that joins later, when it starts), and
an upload's tasks name it by a token. A scattered dataset is a piece of data like any
other to Dask, whose memory manager drops replicas of it between tasks: a worker then
fetched and unpickled it again, once per task at worst."""

from __future__ import annotations

import uuid
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from remote_loader.upload.sources import Shipped, drop_shipped, keep_shipped


class DatasetPlugin(WorkerPlugin):
    """Holds an upload's dataset, or the ``SourceSpec`` each worker builds it from, on each
    worker while the upload runs."""

    def __init__(self, dataset: Any) -> None:
        self.token = uuid.uuid4().hex
        self.name = f"remote-loader-dataset-{self.token}"
        self.dataset = dataset

    def setup(self, worker: Any) -> None:
        keep_shipped(self.token, self.dataset)

    def teardown(self, worker: Any) -> None:
        drop_shipped(self.token)


def ship(client: Any, dataset: Any) -> tuple[Shipped, str]:
    """The dataset on every worker of ``client``'s cluster: what tasks take instead of it,
    and the plugin's name (``unship`` it when the upload ends)."""
    plugin = DatasetPlugin(dataset)
    client.register_plugin(plugin, name=plugin.name)
    return Shipped(plugin.token), plugin.name


def unship(client: Any, name: str) -> None:
    client.unregister_worker_plugin(name)
